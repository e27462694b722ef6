"""The collective weight broadcast (adaflash_ray.distill.weight_sync) and the weight-sync benchmark, on CPU
(gloo; the same code runs NCCL on GPUs)."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from adaflash_ray.distill.weight_sync import WeightBroadcastGroup


def _member(path: str, rank: int, world_size: int, queue) -> None:
    g = WeightBroadcastGroup(f"file://{path}", rank, world_size, "cpu", timeout_s=60)
    src = {"a": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
           "b": torch.linspace(-2, 2, 5).bfloat16(), "c": torch.arange(6, dtype=torch.int64)}
    held = src if rank == 0 else {k: torch.zeros_like(v) for k, v in src.items()}
    out = []
    for step in range(2):  # two versions: the receivers' buffers are overwritten in place
        if rank == 0:
            for v in held.values():
                v.add_(1)
        out.append(g.broadcast(held))
    # plain values (exact: bf16 and int64 fit a double); tensors through a Queue would need this process alive
    queue.put((rank, out, {k: (str(v.dtype), v.double().flatten().tolist()) for k, v in held.items()}))
    g.close()


def test_broadcast_reaches_every_receiver_bit_exact(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(str(tmp_path / "rdv"), r, 3, queue)) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, nbytes, held = queue.get(timeout=120)
        got[rank] = (nbytes, held)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    sent = got[0][1]
    assert got[0][0] == [12 * 4 + 5 * 2 + 6 * 8] * 2
    for rank in (1, 2):
        nbytes, held = got[rank]
        assert nbytes == got[0][0]
        assert held.keys() == sent.keys()
        for k in sent:
            assert held[k] == sent[k], (rank, k)
    assert sent["c"] == ("torch.int64", [2.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # arange(6) + 1 per version


def test_group_refuses_bad_members(tmp_path):
    with pytest.raises(ValueError, match="world_size >= 2"):
        WeightBroadcastGroup(f"file://{tmp_path / 'x'}", 0, 1, "cpu")
    with pytest.raises(ValueError, match="rendezvous"):
        WeightBroadcastGroup("http://127.0.0.1:1", 0, 2, "cpu")


@pytest.mark.long  # ~30 s; the collective path end to end: tests/test_pipeline.py (weight_sync collective)
def test_weight_sync_bench_both_paths_deliver_the_tensors():
    """Object store (through a real WeightRegistry) and the collective both deliver every tensor."""
    from adaflash_ray.actors.weight_sync_bench import bench_weight_sync

    doc = bench_weight_sync("tiny", layers=(1, 2), num_receivers=2, num_iters=1, device="cpu", log=lambda m: None)
    assert doc["backend"] == "gloo" and [r["drafter_layers"] for r in doc["rows"]] == [1, 2]
    one, two = doc["rows"]
    assert one["match"] and two["match"]
    assert 0 < one["num_bytes"] < two["num_bytes"] and one["num_tensors"] < two["num_tensors"]
    assert all(r["object_store_s"] > 0 and r["collective_s"] > 0 for r in doc["rows"])


def _mismatched_member(path: str, rank: int, queue) -> None:
    g = WeightBroadcastGroup(f"file://{path}", rank, 2, "cpu", timeout_s=20)
    held = {"w": torch.ones(6)} if rank == 0 else {"w": torch.zeros(5)}  # the receiver's drafter is smaller
    out = []
    try:
        g.broadcast(held)
        out.append("ok")
    except ValueError as e:
        out.append(f"ValueError: {e}")
    # the group stays in step: the next (matching) version goes through
    nxt = {"w": torch.full((3,), 7.0)} if rank == 0 else {"w": torch.zeros(3)}
    out.append(g.broadcast(nxt))
    out.append(nxt["w"].tolist())
    queue.put((rank, out))


def test_mismatched_receiver_fails_on_every_member_and_the_group_stays_in_step(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_mismatched_member, args=(str(tmp_path / "rdv"), r, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank in (0, 1):  # the sender learns it too: nothing was sent, nobody reads a payload of another size
        assert got[rank][0].startswith("ValueError") and "[1, 6, 24]" in got[rank][0], got[rank]
        assert "[1, 5, 20]" in got[1][0] and "nothing was sent" in got[rank][0]
        assert got[rank][1:] == [12, [7.0, 7.0, 7.0]], got[rank]
