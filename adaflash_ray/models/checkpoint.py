"""Drafter checkpoints in the DFlash format: a directory with a Hugging Face style ``config.json``
(``model_type``, ``block_size``, ``dflash_config.{mask_token_id,target_layer_ids}``, widths) and
``model.safetensors`` (DFlash parameter names; the length head, if any, under ``length_head.``).
Public DFlash drafters load (their architecture read from their ``config.json``; what the drafter does not
implement, e.g. sliding-window layers, is refused naming the field). An exported drafter directory
(``python -m adaflash_ray.export``: ``model.safetensors`` for SGLang / vLLM, the length head in
``length_head.safetensors``) loads back too.
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


def _umask() -> int:
    """The process umask, read without changing it (``/proc/self/status``; 0o022 where that is unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def share_like_mkdir(directory: Path) -> None:
    """Give a directory made by ``tempfile.mkdtemp`` (mode 0700) and the files in it (safetensors writes 0600) the
    modes a plain ``mkdir`` / ``open`` gives (0777 / 0666 less the umask), as every other file of a run has: a
    server running as another user (SGLang / vLLM in a container) can then read the checkpoint."""
    mask = _umask()
    for f in directory.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)
    directory.chmod(0o777 & ~mask)


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
    share_like_mkdir(tmp)
    if path.exists():
        import shutil
        shutil.rmtree(path)
    os.replace(tmp, path)
    return sha


#: The length head's own file in an exported drafter directory (adaflash_ray.export); names without the prefix
LENGTH_HEAD_FILE = "length_head.safetensors"


def _read_safetensors(path: Path, where: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of one safetensors file, its stored sha256 (if any) checked.

    Raises:
        CheckpointError: unreadable / truncated file, or a sha256 that does not match the tensors.
    """
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"drafter checkpoint {where}: {path.name} is corrupt or truncated: {e}") from e
    if "sha256" in meta and meta["sha256"] not in (tensors_sha256(tensors), _legacy_sha256(tensors)):
        raise CheckpointError(f"drafter checkpoint {where}: {path.name}: sha256 mismatch (file modified or corrupt)")
    return tensors, meta


def load_drafter_checkpoint(path: str | Path) -> tuple[DrafterModelConfig, dict[str, torch.Tensor], dict]:
    """Read a DFlash checkpoint directory -> (config, tensors, safetensors metadata).

    The architecture comes from ``config.json`` (:meth:`DrafterModelConfig.from_hf_dict`). A
    ``length_head.safetensors`` beside ``model.safetensors`` (an exported directory) adds its tensors under
    ``length_head.``; the metadata returned is ``model.safetensors``'s.

    Raises:
        CheckpointError: missing directory/files, unparsable config.json or one describing an architecture the
            drafter does not implement (e.g. sliding-window layers), an unreadable / truncated safetensors file,
            a stored sha256 that does not match the tensors, or a length head in both files.
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
    tensors, meta = _read_safetensors(st_file, path)
    if (path / LENGTH_HEAD_FILE).exists():
        head, _ = _read_safetensors(path / LENGTH_HEAD_FILE, path)
        if any(k.startswith("length_head.") for k in tensors):
            raise CheckpointError(f"drafter checkpoint {path}: a length head in both model.safetensors and "
                                  f"{LENGTH_HEAD_FILE}")
        tensors.update({f"length_head.{k}": v for k, v in head.items()})
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


__all__ = ["CheckpointError", "LENGTH_HEAD_FILE", "tensors_sha256", "save_drafter_checkpoint", "load_drafter_checkpoint",
           "check_tensors_fit", "share_like_mkdir"]
