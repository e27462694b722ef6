"""Export a trained drafter as a DFlash drafter directory that SGLang's and vLLM's DFlash loaders read.

    python -m adaflash_ray.export RUN/checkpoints/vN OUT_DIR [--target DIR] [--max-position-embeddings N]

``OUT_DIR`` gets:

- ``config.json``: the DFlash draft config (Qwen3 ``model_type``, ``architectures: [DFlashDraftModel]``), with
  the fields SGLang 0.5.23 reads (``srt/speculative/dflash_utils.py`` ``parse_dflash_draft_config``,
  ``srt/models/dflash.py``: ``dflash_config.{block_size, mask_token_id, target_layer_ids}``,
  ``num_target_layers``, widths, ``rms_norm_eps``, ``rope_parameters``, ``attention_bias``, ``is_causal``,
  ``layer_types``) and those vLLM's ``qwen3_dflash.py`` reads on top (``hidden_act``,
  ``max_position_embeddings``, ``target_hidden_size``);
- ``model.safetensors``: the drafter's weights in bfloat16 under DFlash names (``fc``, ``hidden_norm``,
  ``layers.N.*``, ``norm``), nothing else (embeddings and ``lm_head`` are the target's);
- ``length_head.safetensors``: the adaptive length head (bfloat16; names without the ``length_head.`` prefix;
  metadata ``policy``), which SGLang and vLLM never read and :func:`adaflash_ray.models.load_drafter_checkpoint`
  reads back.

It then prints the command that serves it with each engine (SGLang: ``python -m sglang.launch_server
--speculative-algorithm DFLASH --speculative-draft-model-path OUT_DIR``, flag names as in sglang 0.5.23's
``srt/arg_groups/fields/spec.py``; vLLM: ``vllm serve --speculative-config '{"method": "dflash", ...}'``).

Refused with :class:`ExportError`, never silently changed: a drafter with a learned mask embedding
(``mask_token_id: null``, the SmolLM2 recipes). Both engines build the block's MASK input as the target's
embedding row ``embed_tokens[mask_token_id]``; their only hook for a trained vector (``mask_embedding.pt``)
overwrites that row of the *target's* table (SGLang ``DFlashWorker._maybe_merge_trained_mask_embedding``) or
swaps the vector in wherever that id appears (vLLM), so the target itself, or any anchor with that id, would
see other inputs than it was trained / verified with, unless the id is a reserved token the text never
contains. Train with ``drafter.mask_token_id`` set to such a reserved id instead (as DFlash does for Qwen3,
e.g. 151669 in ``recipes/qwen3_8b.yaml``). A source whose architecture the drafter does not implement fails
already at load (:func:`adaflash_ray.models.drafter.unsupported_architecture`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from adaflash_ray.models.checkpoint import (LENGTH_HEAD_FILE, CheckpointError, load_drafter_checkpoint,
                                           share_like_mkdir, tensors_sha256)
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig

__all__ = ["ExportError", "export_drafter", "exported_config", "launch_commands", "main"]

EXPORT_DTYPE = torch.bfloat16


class ExportError(ValueError):
    """A drafter checkpoint that cannot be exported faithfully (the message says why and what to do)."""


def exported_config(cfg: DrafterModelConfig, max_position_embeddings: int) -> dict:
    """The ``config.json`` of an exported drafter: :meth:`DrafterModelConfig.to_hf_dict` plus what vLLM's DFlash
    model reads without a default (``hidden_act``, ``max_position_embeddings``), the explicit all-full
    ``layer_types`` / ``use_sliding_window: false`` (non-causal full attention in SGLang and vLLM alike),
    ``dflash_config.num_target_layers`` and the bfloat16 dtype. No ``adaflash_extra``."""
    d = cfg.to_hf_dict()
    d.pop("adaflash_extra", None)
    d["dflash_config"] = {**d["dflash_config"], "num_target_layers": cfg.num_target_layers}
    d.update({"hidden_act": "silu", "max_position_embeddings": int(max_position_embeddings),
              "layer_types": ["full_attention"] * cfg.num_hidden_layers, "use_sliding_window": False,
              "sliding_window": None, "dtype": "bfloat16"})  # transformers 5 name (was torch_dtype)
    return d


def _expected_names(cfg: DrafterModelConfig) -> dict[str, tuple[int, ...]]:
    """Drafter parameter names -> shapes, without allocating the weights (meta device)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).drafter_state_dict().items()}


def _head_policy(head: dict[str, torch.Tensor]) -> str:
    """``direct`` (inp/res/out, DirectLengthHead) or ``cost`` (inp/out, AcceptanceHead), from the tensor names."""
    names = {k.split(".")[0] for k in head}
    if names == {"inp", "res", "out"}:
        return "direct"
    if names == {"inp", "out"}:
        return "cost"
    raise ExportError(f"the length head's tensors {sorted(head)} are neither a direct nor a cost head")


def _run_target(ckpt: Path) -> tuple[str | None, str]:
    """(target model directory, how it was found) from the run's ``config.yaml`` (``RUN/checkpoints/vN`` ->
    ``RUN``): ``model.path``, else the registry model's converted cache directory; (None, why) if unknown."""
    import yaml

    run_cfg = ckpt.resolve().parent.parent / "config.yaml"
    try:
        model = (yaml.safe_load(run_cfg.read_text()) or {}).get("model") or {}
    except (OSError, yaml.YAMLError):
        return None, f"no readable {run_cfg}"
    if model.get("path"):
        return str(model["path"]), f"model.path of {run_cfg}"
    if model.get("name"):
        from adaflash_ray.data import cache_dir

        return str(cache_dir() / "models" / "float32" / model["name"]), f"registry model {model['name']!r} (cache)"
    return None, f"{run_cfg} names no model"


def launch_commands(out_dir: str | Path, target: str, cfg: DrafterModelConfig, host: str = "127.0.0.1") -> dict:
    """The command line that serves ``target`` with the exported drafter, per engine (strings, shell-quoted)."""
    out, tgt = shlex.quote(str(out_dir)), shlex.quote(str(target))
    spec = json.dumps({"method": "dflash", "model": str(out_dir), "num_speculative_tokens": cfg.block_size - 1})
    return {
        # sglang 0.5.23: srt/arg_groups/fields/spec.py (speculative_algorithm, speculative_draft_model_path,
        # speculative_dflash_block_size = the verify window, block_size), fields/model.py (model_path, dtype)
        "sglang": (f"python -m sglang.launch_server --model-path {tgt} --dtype bfloat16 "
                   f"--speculative-algorithm DFLASH --speculative-draft-model-path {out} "
                   f"--speculative-dflash-block-size {cfg.block_size} --host {host} --port 30000"),
        # vLLM: --speculative-config JSON, method "dflash"; a block is [anchor, MASK x num_speculative_tokens]
        "vllm": (f"vllm serve {tgt} --dtype bfloat16 --speculative-config {shlex.quote(spec)} "
                 f"--host {host} --port 8000"),
    }


def export_drafter(ckpt_dir: str | Path, out_dir: str | Path, *, max_position_embeddings: int,
                   overwrite: bool = False) -> dict:
    """Write the DFlash drafter directory ``out_dir`` from the adaflash_ray checkpoint ``ckpt_dir``.

    Args:
        ckpt_dir: a checkpoint directory (``config.json`` + ``model.safetensors``), e.g. ``RUN/checkpoints/v5``.
        out_dir: created (written to a temporary sibling, then renamed into place).
        max_position_embeddings: the target's context length (its ``config.json`` field), which both engines
            size the drafter's rope tables with.
        overwrite: replace an existing non-empty ``out_dir``.
    Returns:
        ``{"out_dir", "config", "sha256" (bf16 drafter tensors, canonical form), "length_head_sha256" (or None),
        "length_head_policy", "dtype_from"}``.
    Raises:
        CheckpointError: unreadable / corrupt source, or one whose config the drafter does not implement.
        ExportError: a learned mask embedding (``mask_token_id`` null), a tensor that is not the drafter's
            (name or shape), a non-finite value, or an existing ``out_dir`` without ``overwrite``.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    cfg, tensors, meta = load_drafter_checkpoint(ckpt_dir)
    if cfg.mask_token_id is None or "mask_embedding" in tensors:
        raise ExportError(
            f"{ckpt_dir}: the drafter has a learned mask embedding (dflash_config.mask_token_id null): SGLang's and "
            "vLLM's DFlash loaders feed MASK as the target's embedding of dflash_config.mask_token_id, and their "
            "mask_embedding.pt hook overwrites that row of the target's own table (or every input with that id), "
            "so the exported drafter would not run as it was trained, or would change the target. Retrain with "
            "drafter.mask_token_id set to a reserved token id the text never contains (e.g. 151669 for Qwen3)")
    head = {k[len("length_head."):]: v for k, v in tensors.items() if k.startswith("length_head.")}
    own = {k: v for k, v in tensors.items() if not k.startswith("length_head.")}
    expected = _expected_names(cfg)
    missing, unexpected = sorted(set(expected) - set(own)), sorted(set(own) - set(expected))
    if missing or unexpected:
        raise ExportError(f"{ckpt_dir}: tensors do not match the DFlash drafter its config.json describes: "
                          f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    for k, v in own.items():
        if tuple(v.shape) != expected[k]:
            raise ExportError(f"{ckpt_dir}: tensor {k} has shape {tuple(v.shape)}, config.json implies {expected[k]}")
    for k, v in tensors.items():
        if not torch.is_floating_point(v) or not bool(torch.isfinite(v).all()):
            raise ExportError(f"{ckpt_dir}: tensor {k} is not finite floating point ({v.dtype})")
    if max_position_embeddings < 1:
        raise ExportError(f"max_position_embeddings must be >= 1, got {max_position_embeddings}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{out_dir} exists and is not empty (pass --overwrite to replace it)")

    dtype_from = sorted({str(v.dtype).removeprefix("torch.") for v in tensors.values()})
    model_t = {k: v.detach().to(device="cpu", dtype=EXPORT_DTYPE).contiguous() for k, v in sorted(own.items())}
    head_t = {k: v.detach().to(device="cpu", dtype=EXPORT_DTYPE).contiguous() for k, v in sorted(head.items())}
    source = {"source_checkpoint": str(ckpt_dir), "source_sha256": meta.get("sha256", ""),
              "version": meta.get("version", "")}
    config = exported_config(cfg, max_position_embeddings)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        sha = tensors_sha256(model_t)
        save_file(model_t, str(tmp / "model.safetensors"), metadata={"format": "pt", "sha256": sha, **source})
        head_sha, policy = None, None
        if head_t:
            policy = _head_policy(head_t)
            head_sha = tensors_sha256(head_t)
            save_file(head_t, str(tmp / LENGTH_HEAD_FILE),
                      metadata={"format": "pt", "sha256": head_sha, "policy": policy, **source})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        share_like_mkdir(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": str(out_dir), "config": config, "sha256": sha, "length_head_sha256": head_sha,
            "length_head_policy": policy, "dtype_from": dtype_from}


def _max_positions(target: str | None, given: int | None) -> int:
    if given is not None:
        return given
    if target is not None:
        try:
            return int(json.loads((Path(target) / "config.json").read_text())["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    raise ExportError(f"cannot read max_position_embeddings from the target's config.json ({target or 'unknown'}): "
                      "pass --target DIR or --max-position-embeddings N")


def main(argv: list[str] | None = None) -> int:
    """CLI; returns 0, or 2 with the reason on stderr when the checkpoint cannot be exported."""
    p = argparse.ArgumentParser(prog="python -m adaflash_ray.export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="an adaflash_ray drafter checkpoint, e.g. runs/<run>/checkpoints/v5")
    p.add_argument("out_dir", help="the DFlash drafter directory to write")
    p.add_argument("--target", default=None,
                   help="the target model directory (default: from the run's config.yaml); its config.json gives "
                        "max_position_embeddings, and the printed launch lines name it")
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="the target's context length, when its config.json is not at hand")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    ns = p.parse_args(argv)
    target, found = (ns.target, "--target") if ns.target else _run_target(Path(ns.checkpoint))
    try:
        res = export_drafter(ns.checkpoint, ns.out_dir, overwrite=ns.overwrite,
                             max_position_embeddings=_max_positions(target, ns.max_position_embeddings))
    except (ExportError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = DrafterModelConfig.from_hf_dict(res["config"])
    out = Path(res["out_dir"]).resolve()
    print(f"exported {ns.checkpoint} -> {out} (bfloat16 from {', '.join(res['dtype_from'])}; block_size "
          f"{cfg.block_size}, mask_token_id {cfg.mask_token_id}, target layers {cfg.target_layer_ids}; length head: "
          f"{res['length_head_policy'] or 'none'})")
    print(f"target: {target or '<TARGET_MODEL_DIR>'} ({found if target else 'unknown: replace the placeholder'})")
    for engine, cmd in launch_commands(out, target or "<TARGET_MODEL_DIR>", cfg).items():
        print(f"{engine}: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
