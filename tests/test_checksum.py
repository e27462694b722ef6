"""The drafter checksum means the same on every side (issue 6.2): it hashes the canonical form (values
widened to float32), and the trainer publishes in the serving dtype, so a faithful load - bf16 on a GPU
worker, float32 on a CPU worker - reports the published sha256, while a real mismatch (one changed bf16
ulp) still fails. Tiny random targets; runs in seconds.

Run: python -m pytest -q tests/test_checksum.py
"""
from __future__ import annotations

import pytest
import torch

from adaflash_ray.engine import SpecEngine
from adaflash_ray.models import CheckpointError, load_drafter_checkpoint, save_drafter_checkpoint, tensors_sha256
from tests.conftest import make_drafter, make_tiny_target


def _engine(dtype: torch.dtype) -> SpecEngine:
    target = make_tiny_target("llama", dtype=dtype)
    drafter, head = make_drafter(target, block_size=4)
    return SpecEngine(target, drafter, head, max_batch_size=2, max_seq_len=64)


def _trainer_master(engine: SpecEngine, seed: int = 3) -> dict[str, torch.Tensor]:
    """float32 "master weights" as a trainer holds them (not representable in bf16)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v.float() + 1e-3 * torch.randn(v.shape, generator=g) for k, v in engine.drafter_tensors().items()}


def test_canonical_hash_names_values_not_storage():
    g = torch.Generator().manual_seed(0)
    t = {"a": torch.randn(4, 8, generator=g).to(torch.bfloat16), "b": torch.randn(3, generator=g).half()}
    widened = {k: v.float() for k, v in t.items()}
    assert tensors_sha256(t) == tensors_sha256(widened)  # same values, other storage
    assert tensors_sha256(t) != tensors_sha256({**t, "a": t["a"].reshape(8, 4)})  # shape is part of it
    assert tensors_sha256(t) != tensors_sha256({"x": t["a"], "b": t["b"]})  # so are names
    ints = {"i": torch.arange(5)}
    assert tensors_sha256(ints) != tensors_sha256({"i": torch.arange(5).float()})  # non-float: raw + dtype


@pytest.mark.parametrize("worker_dtype", [torch.bfloat16, torch.float32])
def test_faithful_load_passes_in_any_worker_dtype(worker_dtype):
    """A bf16 publication (the serving dtype of a GPU recipe) loaded by a bf16 or a float32 engine:
    the engine accepts the sha256 and reports it back as its loaded checksum (what the driver compares)."""
    engine = _engine(worker_dtype)
    published = {k: v.to(torch.bfloat16) for k, v in _trainer_master(engine).items()}
    sha = tensors_sha256(published)
    assert engine.load_drafter(published, 1, sha) == sha
    assert engine.drafter_sha256 == sha
    held = engine.drafter_tensors()
    assert all(h.dtype == worker_dtype for h in held.values())


def test_storage_dtype_hash_could_never_match_on_a_bf16_worker():
    """What issue 6 saw on the GPU: float32 master weights published as is, a bf16 worker holds their
    rounding - a different model, so the checksum rightly differs; publishing in the serving dtype fixes it."""
    engine = _engine(torch.bfloat16)
    master = _trainer_master(engine)
    engine.load_drafter(master, 1, tensors_sha256(master))  # the incoming tensors match what was sent ...
    assert engine.drafter_sha256 != tensors_sha256(master)  # ... but the held bf16 copy is not them
    serving = {k: v.to(torch.bfloat16) for k, v in master.items()}
    engine.load_drafter(serving, 2, tensors_sha256(serving))
    assert engine.drafter_sha256 == tensors_sha256(serving)


@pytest.mark.parametrize("worker_dtype", [torch.bfloat16, torch.float32])
def test_real_mismatch_fails(worker_dtype):
    """One value off by one bf16 ulp: the sha256 differs, a load naming the published sha256 is refused
    (old drafter kept) and a worker holding the changed weights does not report the published checksum."""
    engine = _engine(worker_dtype)
    published = {k: v.to(torch.bfloat16) for k, v in _trainer_master(engine).items()}
    sha = tensors_sha256(published)
    name = "fc.weight"
    bad = dict(published)
    flat = bad[name].clone().view(-1)
    flat[7] = (flat[7].view(torch.int16) + 1).view(torch.bfloat16)  # exactly one bf16 ulp up
    bad[name] = flat.view_as(published[name])
    assert not torch.equal(bad[name], published[name])
    assert tensors_sha256(bad) != sha
    before = engine.drafter_sha256
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        engine.load_drafter(bad, 1, sha)
    assert engine.drafter_sha256 == before
    engine.load_drafter(bad, 1)  # loaded without a checksum: the report differs from the publication
    assert engine.drafter_sha256 != sha


def test_checkpoint_roundtrip_keeps_canonical_and_legacy_checksums(tmp_path):
    engine = _engine(torch.float32)
    tensors = {k: v.to(torch.bfloat16) for k, v in _trainer_master(engine).items()}
    cfg = engine.drafter.config
    sha = save_drafter_checkpoint(tmp_path / "v1", cfg, tensors, {"version": 1})
    _, back, meta = load_drafter_checkpoint(tmp_path / "v1")
    assert meta["sha256"] == sha == tensors_sha256(back)
    # a checkpoint written before the canonical form (storage-dtype hash in its metadata) still loads
    from safetensors.torch import save_file

    from adaflash_ray.models.checkpoint import _legacy_sha256

    save_file(tensors, str(tmp_path / "v1" / "model.safetensors"), metadata={"sha256": _legacy_sha256(tensors)})
    load_drafter_checkpoint(tmp_path / "v1")
    save_file(tensors, str(tmp_path / "v1" / "model.safetensors"), metadata={"sha256": "0" * 64})
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_drafter_checkpoint(tmp_path / "v1")
