"""Drafter checkpoints in the DFlash format: a directory with a Hugging Face style ``config.json``
(``model_type``, ``block_size``, ``dflash_config.{mask_token_id,target_layer_ids}``, widths) and
``model.safetensors`` (DFlash parameter names; the length head, if any, under ``length_head.``).
Public DFlash drafters load; what adaflash_ray trains loads in SGLang's ``DFLASH`` drafter slot
(it ignores ``length_head.*`` and ``mask_embedding``).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from adaflash_ray.models.drafter import DrafterModelConfig


class CheckpointError(ValueError):
    """A drafter checkpoint is missing, corrupt, truncated or does not fit the target."""


_CANONICAL = (torch.float32, torch.bfloat16, torch.float16)


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the tensors' canonical form, in sorted name order (stable across runs and devices).

    Canonical form: each float32 / bfloat16 / float16 tensor is hashed as its values in float32 (a lossless
    widening), so the checksum names the *values*, not the storage: a bf16 publication hashes the same
    on the trainer, on a bf16 GPU worker and on a float32 CPU worker that loaded it faithfully, while any
    changed value (one bf16 ulp is enough) changes it. Other dtypes (float64, integers) are hashed raw
    with their dtype. Names and shapes are always part of the hash.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.dtype in _CANONICAL:
            t, tag = t.to(device="cpu", dtype=torch.float32).contiguous(), "value"
        else:
            t, tag = t.cpu().contiguous(), str(t.dtype)
        h.update(f"{name}|{tag}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _legacy_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The storage-dtype checksum of checkpoints written before the canonical form (still accepted on load)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_drafter_checkpoint(path: str | Path, cfg: DrafterModelConfig, tensors: dict[str, torch.Tensor],
                            metadata: dict | None = None) -> str:
    """Write ``config.json`` + ``model.safetensors`` atomically (temp dir then rename).

    Returns the sha256 of ``tensors`` (see :func:`tensors_sha256`), also stored in the
    safetensors metadata with ``metadata`` (string values).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sha = tensors_sha256(tensors)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta["sha256"] = sha
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata=meta)
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    if path.exists():
        import shutil
        shutil.rmtree(path)
    os.replace(tmp, path)
    return sha


def load_drafter_checkpoint(path: str | Path) -> tuple[DrafterModelConfig, dict[str, torch.Tensor], dict]:
    """Read a DFlash checkpoint directory -> (config, tensors, safetensors metadata).

    Raises:
        CheckpointError: missing directory/files, unparsable config.json, or an unreadable /
            truncated safetensors file, or a stored sha256 that does not match the tensors.
    """
    path = Path(path)
    cfg_file, st_file = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, st_file):
        if not f.exists():
            raise CheckpointError(f"drafter checkpoint {path}: {f.name} not found")
    try:
        cfg = DrafterModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"drafter checkpoint {path}: bad config.json: {e}") from e
    try:
        tensors = load_file(str(st_file))
        from safetensors import safe_open
        with safe_open(str(st_file), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"drafter checkpoint {path}: model.safetensors is corrupt or truncated: {e}") from e
    if "sha256" in meta and meta["sha256"] not in (tensors_sha256(tensors), _legacy_sha256(tensors)):
        raise CheckpointError(f"drafter checkpoint {path}: sha256 mismatch (file modified or corrupt)")
    return cfg, tensors, meta


def check_tensors_fit(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise CheckpointError unless ``tensors`` has exactly the names and shapes of ``expected``."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{what}: missing tensors {missing[:4]}, unexpected {unexpected[:4]}")
    for n, ref in expected.items():
        if tuple(tensors[n].shape) != tuple(ref.shape):
            raise CheckpointError(f"{what}: tensor {n} has shape {tuple(tensors[n].shape)}, "
                                  f"expected {tuple(ref.shape)}")
        if not torch.is_floating_point(tensors[n]):
            raise CheckpointError(f"{what}: tensor {n} has non-float dtype {tensors[n].dtype}")
        if not bool(torch.isfinite(tensors[n]).all()):
            raise CheckpointError(f"{what}: tensor {n} contains NaN/inf")


__all__ = ["CheckpointError", "tensors_sha256", "save_drafter_checkpoint", "load_drafter_checkpoint",
           "check_tensors_fit"]
