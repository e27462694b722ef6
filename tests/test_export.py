"""Export to and import from the DFlash ecosystem (adaflash_ray/export.py, adaflash_ray/models/checkpoint.py).

- ``python -m adaflash_ray.export RUN/checkpoints/vN OUT`` writes a bfloat16 DFlash drafter directory whose
  ``config.json`` is read back by **sglang 0.5.23's own DFlash config reader**: ``parse_dflash_draft_config``
  and the per-layer attention resolution (``srt/speculative/dflash_utils.py``, ``srt/models/dflash.py``) and
  ``get_rope_config``, taken from the installed sources with ``ast`` and run here (the package itself cannot be
  imported on this machine; tests/test_sglang_backend.py reads its sources the same way), on the file as a
  dict and as the ``transformers`` config SGLang builds from it; field by field against the drafter;
- the fields vLLM's ``qwen3_dflash.py`` reads without a default are present;
- the weights load back unchanged (bf16 values), the length head from its own file;
- the printed launch lines use flags that sglang 0.5.23's ServerArgs defines;
- a learned mask embedding is refused naming the field (never exported changed), and import refuses
  sliding-window layers and other architectures the drafter does not implement.
Run: python -m pytest -q tests/test_export.py
"""
from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import stat
from dataclasses import dataclass
from enum import Enum
from numbers import Integral
from pathlib import Path
from collections.abc import Sequence
from typing import Any, List, Optional, Tuple

import pytest
import torch
import yaml
from safetensors import safe_open

from adaflash_ray.export import ExportError, export_drafter, main
from adaflash_ray.models.checkpoint import (LENGTH_HEAD_FILE, CheckpointError, load_drafter_checkpoint,
                                            save_drafter_checkpoint)
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.models.length_head import AcceptanceHead, DirectLengthHead

_SPEC = importlib.util.find_spec("sglang")
needs_sglang = pytest.mark.skipif(
    _SPEC is None, reason="sglang not installed; CI runs `pip install --no-deps sglang==0.5.23` (cluster/setup.sh)")


def _cfg(mask_token_id: int | None = 5) -> DrafterModelConfig:
    return DrafterModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=128, block_size=4,
                              target_layer_ids=[1, 2], target_hidden_size=64, num_target_layers=4,
                              rms_norm_eps=1e-6, rope_theta=100000.0, mask_token_id=mask_token_id)


def _run(tmp_path: Path, mask_token_id: int | None = 5, head: str = "direct") -> Path:
    """A run directory as the main job writes it: config.yaml (model.path -> a target config.json) and
    checkpoints/v3 (float32 drafter + length head)."""
    cfg = _cfg(mask_token_id)
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(seed=3)
    tensors = dict(drafter.drafter_state_dict())
    torch.manual_seed(0)
    lh = DirectLengthHead(cfg.hidden_size, 16) if head == "direct" else AcceptanceHead(cfg.hidden_size, 16)
    tensors.update({f"length_head.{k}": v.detach() for k, v in lh.state_dict().items()})
    run = tmp_path / "run"
    target = tmp_path / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 2048}))
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "x", "path": str(target)}}))
    save_drafter_checkpoint(run / "checkpoints" / "v3", cfg, tensors, {"version": 3})
    return run


# ------------------------------------------------------------------------ sglang 0.5.23's reader, from its sources
def _sglang_reader() -> dict:
    """The real DFlash config-reading functions of the installed sglang, executed without importing sglang."""
    root = Path(_SPEC.submodule_search_locations[0])
    wanted = {
        "srt/layers/radix_attention.py": {"AttentionType"},
        "srt/utils/hf_transformers/common.py": {"get_rope_config"},
        "srt/speculative/dflash_utils.py": {
            "DEFAULT_DFLASH_MASK_TOKEN", "build_target_layer_ids", "get_dflash_layer_types",
            "get_dflash_attention_sliding_window_size", "_cfg_get", "_get_text_config", "_get_dflash_config",
            "is_nemotron_35_draft_config", "_parse_optional_int", "DFlashDraftConfig", "parse_dflash_draft_config"},
        "srt/models/dflash.py": {"_get_dflash_attention_type", "_get_dflash_layer_attention_params"},
    }
    ns: dict = {"dataclass": dataclass, "Enum": Enum, "Integral": Integral, "Sequence": Sequence, "Any": Any,
                "List": List, "Optional": Optional, "Tuple": Tuple, "logging": logging,
                "logger": logging.getLogger("sglang-reader"), "__name__": __name__}  # a module dataclass can find
    for rel, names in wanted.items():
        tree = ast.parse((root / rel).read_text())
        found = set()
        for node in tree.body:
            name = getattr(node, "name", None)
            if name is None and isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
            if name in names:
                exec(compile(ast.Module(body=[node], type_ignores=[]), f"{root / rel}", "exec"), ns)
                found.add(name)
        assert found == names, f"{rel}: not found {names - found}"
    return ns


@pytest.fixture(scope="module")
def sgl():
    if _SPEC is None:
        pytest.skip("sglang not installed")
    return _sglang_reader()


@needs_sglang
def test_export_matches_sglangs_dflash_reader_field_by_field(tmp_path, sgl, capsys):
    from transformers import AutoConfig

    run = _run(tmp_path)
    out = tmp_path / "export"
    assert main([str(run / "checkpoints" / "v3"), str(out)]) == 0
    printed = capsys.readouterr().out
    cfg = _cfg()
    d = json.loads((out / "config.json").read_text())
    hf = AutoConfig.from_pretrained(out)  # what SGLang builds from the directory (model_type qwen3)
    assert type(hf).__name__ == "Qwen3Config" and hf.architectures == ["DFlashDraftModel"]
    for view in (d, hf):
        p = sgl["parse_dflash_draft_config"](draft_hf_config=view)
        assert (p.num_hidden_layers, p.num_target_layers, p.block_size) == (2, 4, cfg.block_size)
        assert p.target_layer_ids == cfg.target_layer_ids and p.mask_token_id == cfg.mask_token_id
        assert p.resolve_target_layer_ids(target_num_layers=cfg.num_target_layers) == cfg.target_layer_ids
        # no DFlash variant switched on: plain DFlash, as the drafter was trained
        assert (p.conv_kernel_size, p.conv_group_size, p.selector_rank, p.selector_top_k) == (0, 0, 0, 0)
        assert (p.output_multiplier, p.final_logit_softcapping, p.projector_type) == (1.0, None, None)
        assert (p.attention_sink_bias, p.attention_value_scale) == (False, None)
        assert not sgl["is_nemotron_35_draft_config"](view)
        assert sgl["get_dflash_attention_sliding_window_size"](view) is None
    # srt/models/dflash.py: every layer full-window (-1) and non-causal (ENCODER_ONLY), as the drafter attends
    enc = sgl["AttentionType"].ENCODER_ONLY
    assert [sgl["_get_dflash_layer_attention_params"](hf, i) for i in range(2)] == [(-1, enc), (-1, enc)]
    # DFlashAttention / DFlashMLP / DFlashDraftModel reads (getattr with these defaults in srt/models/dflash.py)
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (64, 4, 2, 16)
    assert (hf.intermediate_size, hf.vocab_size, hf.num_hidden_layers) == (96, 128, 2)
    assert getattr(hf, "attention_bias", False) is False and hf.rms_norm_eps == cfg.rms_norm_eps
    assert getattr(hf, "hidden_act", "silu") == "silu" and not getattr(hf, "use_gemma_norm", False)
    assert float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0) == 1.0
    theta, rope = sgl["get_rope_config"](hf)
    assert float(theta) == cfg.rope_theta and rope.get("rope_type", "default") == "default"
    # vLLM's qwen3_dflash.py reads these without a default (config.hidden_act, config.max_position_embeddings)
    assert d["hidden_act"] == "silu" and d["max_position_embeddings"] == 2048  # the target's
    assert d["is_causal"] is False and d["layer_types"] == ["full_attention"] * 2 and d["target_hidden_size"] == 64
    assert "adaflash_extra" not in d and d["dtype"] == "bfloat16" and hf.dtype == torch.bfloat16
    # weights: bf16, DFlash names only; the length head in its own file
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        assert {fh.get_tensor(k).dtype for k in names} == {torch.bfloat16}
        assert fh.metadata()["format"] == "pt" and fh.metadata()["version"] == "3"
    assert names == set(DFlashDrafter(cfg).drafter_state_dict())
    assert not any(k.startswith("length_head.") or k == "mask_embedding" for k in names)
    with safe_open(str(out / LENGTH_HEAD_FILE), framework="pt") as fh:
        assert set(fh.keys()) == {"inp.weight", "inp.bias", "res.weight", "res.bias", "out.weight", "out.bias"}
        assert fh.metadata()["policy"] == "direct"
    # launch lines: the engines' own flag names (sglang 0.5.23 ServerArgs fields)
    fields = _server_args_fields()
    sglang_line = next(line for line in printed.splitlines() if line.startswith("sglang: "))
    flags = [t for t in sglang_line.split()[1:] if t.startswith("--")]
    assert flags and all(f[2:].replace("-", "_") in fields for f in flags), (flags, sglang_line)
    assert "--speculative-algorithm DFLASH" in sglang_line and f"--speculative-draft-model-path {out.resolve()}" \
        in sglang_line and f"--model-path {run.parent / 'target'}" in sglang_line
    assert "DFLASH" in (Path(_SPEC.submodule_search_locations[0]) / "srt/arg_groups/fields/spec.py").read_text()
    vllm_line = next(line for line in printed.splitlines() if line.startswith("vllm: "))
    spec = json.loads(vllm_line.split("--speculative-config ", 1)[1].split(" --host")[0].strip("'"))
    assert spec == {"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": cfg.block_size - 1}


def _server_args_fields() -> set[str]:
    root = Path(_SPEC.submodule_search_locations[0])
    out = set()
    for f in (root / "srt/arg_groups/fields").glob("*.py"):
        for c in ast.parse(f.read_text()).body:
            if isinstance(c, ast.ClassDef):
                out |= {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return out


@pytest.mark.parametrize("head", ["direct", "cost"])
def test_export_loads_back_with_the_same_values(tmp_path, head):
    run = _run(tmp_path, head=head)
    src = run / "checkpoints" / "v3"
    res = export_drafter(src, tmp_path / "out", max_position_embeddings=4096)
    assert res["length_head_policy"] == head and res["dtype_from"] == ["float32"]
    cfg0, t0, _ = load_drafter_checkpoint(src)
    cfg1, t1, meta = load_drafter_checkpoint(tmp_path / "out")  # checks both files' sha256
    assert cfg1 == cfg0
    assert set(t1) == set(t0)  # the length head is merged back under length_head.
    for k, v in t0.items():
        assert t1[k].dtype == torch.bfloat16 and torch.equal(t1[k], v.to(torch.bfloat16)), k
    assert meta["sha256"] == res["sha256"]
    # the checkpoint and the export are readable by another user (a server in a container), as a plain mkdir /
    # open makes them: not tempfile.mkdtemp's 0700 and safetensors' 0600
    mask = os.umask(0)
    os.umask(mask)
    for d in (src, tmp_path / "out"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~mask, d
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in d.iterdir()} == \
            {f.name: 0o666 & ~mask for f in d.iterdir()}, d
    with pytest.raises(ExportError, match="not empty"):
        export_drafter(src, tmp_path / "out", max_position_embeddings=4096)
    export_drafter(src, tmp_path / "out", max_position_embeddings=4096, overwrite=True)


def test_learned_mask_embedding_is_refused_never_changed(tmp_path, capsys):
    run = _run(tmp_path, mask_token_id=None)
    with pytest.raises(ExportError, match="mask_token_id"):
        export_drafter(run / "checkpoints" / "v3", tmp_path / "out", max_position_embeddings=2048)
    assert not (tmp_path / "out").exists()
    assert main([str(run / "checkpoints" / "v3"), str(tmp_path / "out")]) == 2
    assert "learned mask embedding" in capsys.readouterr().err
    ok = _run(tmp_path / "b")
    (ok / "config.yaml").unlink()  # no run config: the target's context length must be given
    assert main([str(ok / "checkpoints" / "v3"), str(tmp_path / "o2")]) == 2
    assert "max-position-embeddings" in capsys.readouterr().err
    assert main([str(ok / "checkpoints" / "v3"), str(tmp_path / "o2"), "--max-position-embeddings", "512"]) == 0
    assert "<TARGET_MODEL_DIR>" in capsys.readouterr().out


def test_import_refuses_what_the_drafter_does_not_implement(tmp_path):
    """The architecture comes from the checkpoint: sliding-window layers (and other unimplemented choices) are
    refused naming the field, not loaded as full attention."""
    run = _run(tmp_path)
    ckpt = run / "checkpoints" / "v3"
    base = json.loads((ckpt / "config.json").read_text())
    cases = [({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 512}, "sliding_attention"),
             ({"use_sliding_window": True, "sliding_window": 512}, "sliding_window"),
             ({"is_causal": True}, "is_causal"), ({"attention_bias": True}, "attention_bias"),
             ({"hidden_act": "gelu"}, "hidden_act"),
             ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type"),
             ({"dflash_config": {**base["dflash_config"], "projector_type": "domino"}}, "projector_type"),
             ({"layer_types": ["full_attention"]}, "layer_types")]
    for change, field in cases:
        (ckpt / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(CheckpointError, match=field):
            load_drafter_checkpoint(ckpt)
    # a sliding_window value with every layer full attention changes nothing (Qwen3 configs carry one): loads
    (ckpt / "config.json").write_text(json.dumps({**base, "sliding_window": 4096, "use_sliding_window": False,
                                                  "layer_types": ["full_attention"] * 2}))
    assert load_drafter_checkpoint(ckpt)[0] == _cfg()
    # SGLang's reading order: dflash_config fields first, then the top level
    moved = {k: v for k, v in base.items() if k != "num_target_layers"}
    moved["dflash_config"] = {**base["dflash_config"], "num_target_layers": 4}
    (ckpt / "config.json").write_text(json.dumps(moved))
    assert load_drafter_checkpoint(ckpt)[0].num_target_layers == 4
