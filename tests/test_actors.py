"""Ray actors on a local Ray bound to 127.0.0.1: TrajectoryBuffer capacity / staleness counts,
WeightRegistry pushes to every InferenceWorker (version + checksum), hot reload while requests are
in flight (all complete with the target's greedy output), refusal of a mismatched drafter, and the
Parquet spill round trip."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from adaflash_ray.config import load_recipe  # noqa: E402
from adaflash_ray.models import tensors_sha256  # noqa: E402
from adaflash_ray.trajectory import Trajectory  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _traj(i: int, version: int, n: int = 12) -> Trajectory:
    return Trajectory(request_id=f"t{i}", token_ids=torch.arange(n), prompt_len=4,
                      features=torch.randn(n - 1, 6).to(torch.bfloat16), last_hidden=torch.randn(n - 1, 3).to(torch.bfloat16),
                      drafter_version=version, draft_lens=np.array([3, 3], np.int16),
                      num_accepted=np.array([1, 2], np.int16), step_versions=np.array([version, version], np.int32))


def test_buffer_capacity_and_staleness(ray_local):
    from adaflash_ray.actors import TrajectoryBuffer

    buf = TrajectoryBuffer.remote(capacity=3, max_version_lag=1)
    for i in range(5):  # 5 into capacity 3: the 2 oldest are evicted
        ray.get(buf.add.remote([ray.put(_traj(i, 0))], 0, 8))
    s = ray.get(buf.stats.remote())
    assert s["buffer/depth"] == 3 and s["buffer/dropped_capacity"] == 2 and s["buffer/added"] == 5
    ray.get(buf.set_version.remote(1))  # lag 1 allowed: nothing dropped yet
    assert ray.get(buf.stats.remote())["buffer/depth"] == 3
    ray.get(buf.set_version.remote(2))  # lag 2 > 1: all three version-0 entries go
    s = ray.get(buf.stats.remote())
    assert s["buffer/depth"] == 0 and s["buffer/dropped_stale"] == 3
    ray.get(buf.add.remote([ray.put(_traj(9, 0))], 0, 8))  # arrives already stale
    ray.get(buf.add.remote([ray.put(_traj(10, 2))], 2, 8))
    s = ray.get(buf.stats.remote())
    assert s["buffer/dropped_stale"] == 4 and s["buffer/depth"] == 1
    items = ray.get(buf.get_batch.remote(4, 0.5))  # times out with what it has
    assert len(items) == 1 and items[0][1] == 2
    assert ray.get(items[0][0]).request_id == "t10"
    assert ray.get(buf.stats.remote())["buffer/consumed"] == 1


def test_buffer_spills_instead_of_dropping(ray_local, tmp_path):
    """With spill_dir every trajectory is journaled to Parquet; past capacity the oldest stay on disk only
    and come back (bit-identical) when the queue runs low; consumed ones' files are deleted."""
    from adaflash_ray.actors import TrajectoryBuffer
    from adaflash_ray.distill.spill import read_parquet

    buf = TrajectoryBuffer.remote(capacity=1, max_version_lag=5, spill_dir=str(tmp_path))
    originals = [_traj(i, 0) for i in range(3)]
    for t in originals:
        ray.get(buf.add.remote([ray.put(t)], 0, 8))
    s = ray.get(buf.stats.remote())
    assert s["buffer/spilled"] == 2 and s["buffer/dropped_capacity"] == 0 and s["buffer/on_disk"] == 2
    back = {p.name.split("-v")[0]: read_parquet(p) for p in tmp_path.glob("*.parquet")}
    assert set(back) == {"t0", "t1", "t2"}
    for t in originals:
        r = back[t.request_id]
        assert torch.equal(r.token_ids, t.token_ids) and torch.equal(r.features, t.features)
        assert torch.equal(r.last_hidden, t.last_hidden) and r.num_accepted.tolist() == [1, 2]
    got = [ray.get(it[0]) for it in ray.get(buf.get_batch.remote(3, 0.5))]  # t2 in memory, then t0, t1 from disk
    assert [g.request_id for g in got] == ["t2", "t0", "t1"]
    assert torch.equal(got[1].features, originals[0].features)
    assert list(tmp_path.glob("*.parquet")) == []  # consumed (no lease): journal files gone
    assert ray.get(buf.stats.remote())["buffer/reloaded"] == 2


@pytest.fixture(scope="module")
def tiny_cfg():
    return load_recipe("recipes/cpu_tiny.yaml", ["engine.max_batch_size=4"])


@pytest.fixture(scope="module")
def workers(ray_local, tiny_cfg):
    from adaflash_ray.actors import InferenceWorker, WeightRegistry

    reg = WeightRegistry.remote()
    ws = [InferenceWorker.remote(tiny_cfg.model_dump(), i, None) for i in range(2)]
    ray.get([reg.subscribe.remote(f"w{i}", w) for i, w in enumerate(ws)])
    return reg, ws


def _perturbed(worker, seed: int) -> dict[str, torch.Tensor]:
    base = ray.get(worker.current_tensors.remote())
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def test_registry_pushes_version_and_checksum_to_every_worker(workers):
    reg, ws = workers
    v0 = ray.get([w.loaded_version.remote() for w in ws])
    assert v0[0]["sha256"] == v0[1]["sha256"] and v0[0]["version"] == 0  # same seed -> same init
    tensors = _perturbed(ws[0], 1)
    sha = tensors_sha256(tensors)
    reports = ray.get(reg.publish.remote(1, 0, 10, [ray.put(tensors)], sha, None))
    assert sorted(r["worker"] for r in reports) == [0, 1]
    assert all(r["version"] == 1 and r["sha256"] == sha for r in reports)
    loaded = ray.get([w.loaded_version.remote() for w in ws])
    assert all(lv == {"worker": i, "version": 1, "sha256": sha} for i, lv in enumerate(loaded))
    assert ray.get(reg.latest_meta.remote())["version"] == 1
    (h,) = ray.get(reg.get_history.remote())  # publish -> every worker loaded, and what travelled
    assert h["version"] == 1 and 0 < h["broadcast_s"] < 60
    assert h["num_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    held = ray.get(ray.get(reg.get.remote(1))[0])
    assert all(torch.equal(held[k], tensors[k]) for k in tensors)
    with pytest.raises(ray.exceptions.RayTaskError, match="not held"):
        ray.get(reg.get.remote(7))
    with pytest.raises(ray.exceptions.RayTaskError, match="not newer"):
        ray.get(reg.publish.remote(1, 0, 10, [ray.put(tensors)], sha, None))


def test_hot_reload_with_requests_in_flight(workers, real_target, chat_prompts):
    from tests.conftest import greedy_reference

    _, ws = workers
    w = ws[0]
    start = ray.get(w.loaded_version.remote())["version"]
    prompts = chat_prompts[:4]
    pending = w.generate.remote(prompts, 24, 0.0, False, True)  # ignore_eos: every request runs 24 tokens
    for k in range(3):  # three swaps while those requests decode
        tensors = _perturbed(w, 10 + k)
        rep = ray.get(w.load_drafter.remote(start + 1 + k, tensors, tensors_sha256(tensors)))
        assert rep["version"] == start + 1 + k
    results = ray.get(pending)
    assert len(results) == 4
    seen_versions = set()
    for prompt, res in zip(prompts, results):
        assert res["output_ids"] == greedy_reference(real_target, prompt, 24)
        seen_versions.update(res["step_versions"])
    assert len(seen_versions) >= 2, f"requests did not span a reload: {seen_versions}"
    assert ray.get(w.loaded_version.remote())["version"] == start + 3


def test_mismatched_drafter_is_refused_and_old_one_stays(workers, chat_prompts):
    from adaflash_ray.models import DrafterModelConfig

    _, ws = workers
    w = ws[1]
    before = ray.get(w.loaded_version.remote())
    tensors = ray.get(w.current_tensors.remote())
    cfg = ray.get(w.drafter_config.remote())
    bad_vocab = DrafterModelConfig(**{**cfg, "vocab_size": cfg["vocab_size"] + 1}).as_dict()
    with pytest.raises(ray.exceptions.RayTaskError, match="vocab_size"):
        ray.get(w.load_drafter.remote(before["version"] + 1, tensors, None, bad_vocab))
    bad_width = {**tensors, "fc.weight": tensors["fc.weight"][:, :-8]}
    with pytest.raises(ray.exceptions.RayTaskError, match="fc.weight"):
        ray.get(w.load_drafter.remote(before["version"] + 1, bad_width))
    assert ray.get(w.loaded_version.remote()) == before
    out = ray.get(w.generate.remote(chat_prompts[:1], 8))
    assert len(out[0]["output_ids"]) >= 1


def test_bad_request_gets_a_clear_error(workers):
    """generate() raises the engine's message; every rejection (fire-and-forget submit() included) is counted
    in the worker's metrics instead of vanishing."""
    import time

    _, ws = workers
    before = ray.get(ws[0].stats.remote())["spec/num_rejected_requests"]
    with pytest.raises(ray.exceptions.RayTaskError, match="max_seq_len"):
        ray.get(ws[0].generate.remote([[1] * 1000], 32))
    with pytest.raises(ray.exceptions.RayTaskError, match="empty prompt"):
        ray.get(ws[0].generate.remote([[]], 8))
    assert ray.get(ws[0].submit.remote([[1] * 1000], 32)) == 1  # queued; the engine thread rejects it
    deadline = time.time() + 30
    while ray.get(ws[0].stats.remote())["spec/num_rejected_requests"] < before + 3 and time.time() < deadline:
        time.sleep(0.2)
    assert ray.get(ws[0].stats.remote())["spec/num_rejected_requests"] == before + 3


def test_restarted_worker_reloads_the_latest_version(ray_local, tiny_cfg):
    """A worker that dies is restarted by Ray and catches up with the registry's latest version."""
    import time

    from adaflash_ray.actors import InferenceWorker, WeightRegistry

    reg = WeightRegistry.remote()
    w = InferenceWorker.options(max_restarts=1).remote(tiny_cfg.model_dump(), 0, None, reg)
    ray.get(reg.subscribe.remote("w0", w))
    tensors = _perturbed(w, 99)
    sha = tensors_sha256(tensors)
    ray.get(reg.publish.remote(5, 4, 50, [ray.put(tensors)], sha, None))
    pid = ray.get(w.pid.remote())
    ray.kill(w, no_restart=False)
    deadline = time.time() + 120
    while True:  # ray.kill is asynchronous: wait for the restarted process
        try:
            if ray.get(w.pid.remote(), timeout=60) != pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass
        assert time.time() < deadline, "worker was not restarted"
        time.sleep(1)
    info = ray.get(w.loaded_version.remote())
    assert info["version"] == 5 and info["sha256"] == sha


def test_cancel_recorded_drops_only_queued_data_requests(workers, chat_prompts):
    import time

    _, ws = workers
    w = ws[0]
    ray.get(w.stats.remote())  # stats are per window since the last call: this one starts a fresh window
    ray.get(w.submit.remote(chat_prompts * 2, 32))  # 16 recorded requests, 4 slots
    served = w.generate.remote(chat_prompts[:1], 8)  # a user request queued behind them is kept
    # the first requests hold their slots (decoding) before the cancel: on a loaded machine the engine thread may not
    # have admitted any yet when cancel_recorded arrives
    deadline = time.time() + 60
    while ray.get(w.stats.remote())["spec/tokens_per_s"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    dropped = ray.get(w.cancel_recorded.remote())
    assert 4 <= dropped <= 12, dropped
    assert len(ray.get(served)[0]["output_ids"]) >= 1


def test_driver_poll_tolerates_restarts_but_not_a_dead_worker(ray_local):
    """The driver's poll: a worker being restarted reads as "unavailable"; one dead for good (restarts
    exhausted) stops the run with WorkerLost instead of polling forever."""
    import time

    from adaflash_ray.pipeline import WorkerLost, _poll

    @ray.remote(max_restarts=0)
    class Probe:
        def ping(self):
            return 1

    p = Probe.remote()
    assert _poll([p.ping.remote()], None) == [1]
    ray.kill(p, no_restart=True)
    time.sleep(1)
    with pytest.raises(WorkerLost, match="will not be restarted"):
        _poll([p.ping.remote()], None)


def test_versions_never_go_backwards_out_of_order_delivery(workers):
    """Issue 9.1: a late (older) version is refused with a clear error and the newer drafter stays;
    two swaps in flight at once are applied in arrival order, the older one refused; a duplicate of
    the loaded version is harmless; going back takes an explicit rollback naming the version."""
    from adaflash_ray.models import CheckpointError  # noqa: F401

    _, ws = workers
    w = ws[1]
    cur = ray.get(w.loaded_version.remote())["version"]
    new, old = _perturbed(w, 21), _perturbed(w, 22)
    sha_new, sha_old = tensors_sha256(new), tensors_sha256(old)
    assert ray.get(w.load_drafter.remote(cur + 2, new, sha_new))["version"] == cur + 2
    with pytest.raises(ray.exceptions.RayTaskError, match=rf"version {cur + 1} refused: not newer than the "
                                                          rf"loaded version {cur + 2}"):
        ray.get(w.load_drafter.remote(cur + 1, old, sha_old))  # delivered late
    assert ray.get(w.loaded_version.remote()) == {"worker": 1, "version": cur + 2, "sha256": sha_new}
    dup = ray.get(w.load_drafter.remote(cur + 2, new, sha_new))  # the same version again: no-op
    assert dup["already_loaded"] is True and dup["sha256"] == sha_new
    with pytest.raises(ray.exceptions.RayTaskError, match="not newer"):  # same number, other weights
        ray.get(w.load_drafter.remote(cur + 2, old, sha_old))
    # two deliveries in flight together, the newer first: the older one loses
    a, b = _perturbed(w, 23), _perturbed(w, 24)
    r4, r3 = w.load_drafter.remote(cur + 4, a, tensors_sha256(a)), w.load_drafter.remote(cur + 3, b, tensors_sha256(b))
    assert ray.get(r4)["version"] == cur + 4
    with pytest.raises(ray.exceptions.RayTaskError, match="not newer"):
        ray.get(r3)
    assert ray.get(w.loaded_version.remote())["sha256"] == tensors_sha256(a)
    stats = ray.get(w.stats.remote())
    assert stats["spec/num_refused_versions"] >= 3 and stats["spec/drafter_version"] == cur + 4
    # an explicit rollback names the version it returns to; a "rollback" forward is refused
    back = ray.get(w.rollback_drafter.remote(cur + 2, new, sha_new))
    assert back["version"] == cur + 2 and back["rolled_back_from"] == cur + 4
    assert ray.get(w.loaded_version.remote()) == {"worker": 1, "version": cur + 2, "sha256": sha_new}
    with pytest.raises(ray.exceptions.RayTaskError, match="newer than the loaded version"):
        ray.get(w.rollback_drafter.remote(cur + 9, a, None))
    assert ray.get(w.stats.remote())["spec/num_rollbacks"] == 1


def test_buffer_lease_requeue_and_commit(ray_local):
    """Issue 9.2: what a trainer rank took since its last save is put back, first in line, when it is
    restarted; committed trajectories are not; each trajectory is counted consumed once."""
    from adaflash_ray.actors import TrajectoryBuffer

    buf = TrajectoryBuffer.remote(capacity=10, max_version_lag=5)
    for i in range(5):
        ray.get(buf.add.remote([ray.put(_traj(i, 0))], 0, 8))
    first = ray.get(buf.get_batch.remote(2, 0.1, "trainer-0"))
    assert ray.get(buf.commit.remote("trainer-0")) == 2  # saved with these two trained in
    lost = ray.get(buf.get_batch.remote(2, 0.1, "trainer-0"))  # then the trainer dies before its next save
    assert ray.get(buf.requeue.remote("trainer-0")) == 2
    again = ray.get(buf.get_batch.remote(3, 0.1, "trainer-0"))
    ids = [ray.get(it[0]).request_id for it in again]
    assert ids == [ray.get(it[0]).request_id for it in lost] + ["t4"]  # first in line, then the rest
    assert {ray.get(it[0]).request_id for it in first}.isdisjoint(ids)
    s = ray.get(buf.stats.remote())
    assert s["buffer/consumed"] == 5 and s["buffer/redelivered"] == 2 and s["buffer/committed"] == 2
    assert ray.get(buf.requeue.remote("nobody")) == 0


def test_buffer_release_hands_back_only_the_prefetched_batch(ray_local):
    """distill.prefetch: a trainer whose training ends with a batch prefetched but untrained hands back exactly
    that batch - first in line, in order, not counted consumed - and its commit covers only what it trained."""
    from adaflash_ray.actors import TrajectoryBuffer

    buf = TrajectoryBuffer.remote(capacity=10, max_version_lag=5)
    for i in range(6):
        ray.get(buf.add.remote([ray.put(_traj(i, 0))], 0, 8))
    trained = ray.get(buf.get_batch.remote(2, 0.1, "trainer-0"))
    prefetched = ray.get(buf.get_batch.remote(3, 0.1, "trainer-0"))
    other = ray.get(buf.get_batch.remote(1, 0.1, "trainer-1"))[0][0]  # another rank's lease is not touched
    assert ray.get(buf.release.remote("trainer-0", [it[0] for it in prefetched] + [other])) == 3
    assert ray.get(buf.commit.remote("trainer-0")) == 2
    again = ray.get(buf.get_batch.remote(4, 0.1))
    ids = [ray.get(it[0]).request_id for it in again]
    assert ids == [ray.get(it[0]).request_id for it in prefetched]  # first in line, in order; t5 is trainer-1's
    assert {ray.get(it[0]).request_id for it in trained}.isdisjoint(ids)
    s = ray.get(buf.stats.remote())
    assert s["buffer/consumed"] == 6 and s["buffer/committed"] == 2 and s["buffer/depth"] == 0
    assert ray.get(buf.commit.remote("trainer-1")) == 1
    assert ray.get(buf.release.remote("nobody", [other])) == 0


def test_buffer_warm_start_shares_are_fixed_at_the_first_take(ray_local):
    """The warm start's text from the workers (add_warm / warm_done / take_warm): a rank whose wait ran out takes
    what arrived; the first take fixes the batches the ranks share (disjoint, none missed), a batch added after it
    is dropped and counted late, the first report of a source stands, and once every rank took its share the next
    warm start begins empty."""
    from adaflash_ray.actors import TrajectoryBuffer

    buf = TrajectoryBuffer.remote(capacity=10, max_version_lag=5)
    batches = [ray.put([_traj(10 * b + i, 0) for i in range(2)]) for b in range(3)]
    ray.get(buf.add_warm.remote(batches[:3]))
    ray.get(buf.warm_done.remote("worker-0", {"num_requests": 6}))
    ray.get(buf.warm_done.remote("worker-0", {"error": "reported again by the driver"}))
    t0 = time.monotonic()
    first = ray.get(buf.take_warm.remote(2, 0, 2, 0.5))  # worker-1 never reports: the wait runs out
    assert time.monotonic() - t0 >= 0.4
    assert first["reports"] == {"worker-0": {"num_requests": 6}}
    ray.get(buf.add_warm.remote([ray.put([_traj(99, 0)])]))  # late: after the first take
    second = ray.get(buf.take_warm.remote(2, 1, 2, 30.0))  # answered at once: the shares are fixed
    got = [[t.request_id for t in ray.get(r)] for r in first["refs"] + second["refs"]]
    assert sorted(got) == [["t0", "t1"], ["t10", "t11"], ["t20", "t21"]]
    assert len(first["refs"]) == 2 and len(second["refs"]) == 1
    assert ray.get(buf.stats.remote())["buffer/warm_batches_late"] == 1
    assert ray.get(buf.take_warm.remote(1, 0, 1, 0.2)) == {"refs": [], "reports": {}}


def test_buffer_streams_the_warm_batches_to_the_ranks(ray_local):
    """take_warm_stream: batch j in order of arrival goes to rank j % world_size; a call returns this rank's new
    batches (waiting for one at most its timeout), done once every source reported and the rank has all of its own;
    after every rank's stream ended (or clear_warm) a late batch is dropped and counted."""
    from adaflash_ray.actors import TrajectoryBuffer

    buf = TrajectoryBuffer.remote(capacity=10, max_version_lag=5)
    put = lambda i: ray.put([_traj(i, 0)])  # noqa: E731
    ids = lambda r: [t.request_id for ref in r["refs"] for t in ray.get(ref)]  # noqa: E731
    ray.get(buf.add_warm.remote([put(0), put(1), put(2)]))
    a = ray.get(buf.take_warm_stream.remote(0, 2, 1, 5.0))
    assert ids(a) == ["t0", "t2"] and not a["done"]
    t0 = time.monotonic()
    assert ray.get(buf.take_warm_stream.remote(0, 2, 1, 0.3))["refs"] == []  # nothing new: waited its timeout
    assert time.monotonic() - t0 >= 0.25
    waiting = buf.take_warm_stream.remote(0, 2, 1, 30.0)
    ray.get(buf.add_warm.remote([put(3), put(4)]))  # t4 is rank 0's next: the waiting call returns with it
    assert ids(ray.get(waiting)) == ["t4"]
    ray.get(buf.warm_done.remote("worker-0", {"num_requests": 5}))
    last0 = ray.get(buf.take_warm_stream.remote(0, 2, 1, 5.0))
    assert last0 == {"refs": [], "done": True, "reports": {"worker-0": {"num_requests": 5}}}
    b = ray.get(buf.take_warm_stream.remote(1, 2, 1, 5.0))
    assert ids(b) == ["t1", "t3"] and b["done"]
    ray.get(buf.add_warm.remote([put(5)]))
    assert ray.get(buf.stats.remote())["buffer/warm_batches_late"] == 1
    assert ray.get(buf.clear_warm.remote()) == 0


def test_driver_reports_a_worker_that_died_in_its_warm_decode(ray_local):
    """The driver's watch over the workers' warm-start decodes (pipeline.report_ended_warm_sources): a worker that
    dies mid-decode is reported to the buffer for it, so the ranks' take_warm returns at once with what it added; a
    worker that ends normally is left to its own report; one still decoding stays watched."""
    from adaflash_ray.actors import TrajectoryBuffer
    from adaflash_ray.pipeline import report_ended_warm_sources

    @ray.remote(max_restarts=0)
    class Decoder:
        def warm_decode_result(self, wait_s):
            time.sleep(wait_s)
            return {"num_requests": 3}

    buf = TrajectoryBuffer.remote(capacity=10, max_version_lag=5)
    dying, fine, slow = Decoder.remote(), Decoder.remote(), Decoder.remote()
    ray.get(buf.add_warm.remote([ray.put([_traj(1, 0)])]))  # what the dying worker added before it died
    waits = {"worker-0": dying.warm_decode_result.remote(60), "worker-1": fine.warm_decode_result.remote(0),
             "worker-2": slow.warm_decode_result.remote(60)}
    ray.kill(dying, no_restart=True)
    ended, deadline = [], time.monotonic() + 30
    while len(ended) < 2 and time.monotonic() < deadline:
        ended += report_ended_warm_sources(waits, buf)
        time.sleep(0.1)
    assert sorted(ended) == ["worker-0", "worker-1"] and list(waits) == ["worker-2"]
    ray.get(buf.warm_done.remote("worker-1", {"num_requests": 3}))  # its own report
    ray.get(buf.warm_done.remote("worker-2", {"num_requests": 0}))
    t0 = time.monotonic()
    got = ray.get(buf.take_warm.remote(3, 0, 1, 60.0))
    assert time.monotonic() - t0 < 10
    assert "error" in got["reports"]["worker-0"] and "Actor" in got["reports"]["worker-0"]["error"]
    assert got["reports"]["worker-1"] == {"num_requests": 3}
    assert [t.request_id for r in got["refs"] for t in ray.get(r)] == ["t1"]
    ray.kill(slow)


def test_a_batch_whose_worker_died_reads_as_none(ray_local):
    """The trainer's read of the workers' warm-start batches: an object whose owner (the worker that put it) died
    reads as None instead of raising, so the rank trains on the batches that survived."""
    from adaflash_ray.actors.distill_trainer import _get_or_none

    @ray.remote(max_restarts=0)
    class Owner:
        def put(self, x):
            return [ray.put(x)]

    owner = Owner.remote()
    (lost,) = ray.get(owner.put.remote([1, 2]))
    kept = ray.put([3])
    ray.kill(owner, no_restart=True)
    # the owner's death reaches the reader's core worker asynchronously (on a loaded machine, after > 1 s): read
    # until it has, within a deadline
    deadline = time.monotonic() + 30
    got = _get_or_none([lost, kept])
    while got[0] is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        got = _get_or_none([lost, kept])
    assert got == [None, [3]]


def test_trainer_prefetches_and_a_starved_trainer_still_stops_on_time(ray_local):
    """distill.prefetch + distill.max_train_s: the trainer takes its second batch while the first step
    computes, trains everything it got, and - starved of data afterwards - still stops once its time budget is
    spent, publishing what it trained (one version) and committing exactly the trajectories it trained on."""
    from adaflash_ray.actors import DistillTrainer, TrajectoryBuffer, WeightRegistry
    from adaflash_ray.actors.recovery import setup_trainers

    cfg = load_recipe("recipes/cpu_tiny.yaml", overrides=[
        "distill.features=recompute", "distill.max_reuse=1", "distill.publish_every=1000",
        "distill.num_versions=5", "distill.max_train_s=4"])
    assert cfg.distill.prefetch
    buf = TrajectoryBuffer.remote(capacity=16, max_version_lag=5)
    registry = WeightRegistry.remote()
    trainer = DistillTrainer.options(num_cpus=1).remote(cfg.model_dump())
    setup_trainers([trainer], None, False)
    for i in range(2 * cfg.distill.batch_size):  # two batches, then nothing more arrives
        traj = Trajectory(request_id=f"p{i}", token_ids=torch.arange(100, 140 + i), prompt_len=20,
                          features=None, last_hidden=None, drafter_version=0, draft_lens=np.zeros(0, np.int16),
                          num_accepted=np.zeros(0, np.int16), step_versions=np.zeros(0, np.int32))
        ray.get(buf.add.remote([ray.put(traj)], 0, 20 + i))
    t0 = time.time()
    summary = ray.get(trainer.run.remote(buf, registry), timeout=120)
    assert time.time() - t0 < 90  # a starved trainer without the budget check waits forever
    assert summary["steps"] == 2 and summary["final_version"] == 1 and summary["num_fresh"] == 8
    metrics = ray.get(trainer.pop_metrics.remote())
    assert [m["train/num_fresh"] for m in metrics if "train/num_fresh" in m] == [4.0, 4.0]
    assert [m.get("train/time_up") for m in metrics if "sync/version" in m] == [1.0]
    s = ray.get(buf.stats.remote())
    assert s["buffer/committed"] == 8 and s["buffer/consumed"] == 8 and s["buffer/depth"] == 0
    assert ray.get(registry.latest_meta.remote())["version"] == 1
    ray.kill(trainer)


def test_streaming_warm_start_falls_back_to_the_ranks_decode(ray_local):
    """distill.warm_start_streaming on a trainer rank whose worker reports a failed decode before adding anything:
    the stream ends before any step, so the rank decodes its own share of the prompts (AR, no drafter), trains on
    it and publishes version 1 instead of failing the run."""
    from adaflash_ray.actors import DistillTrainer, TrajectoryBuffer, WeightRegistry
    from adaflash_ray.actors.recovery import setup_trainers

    cfg = load_recipe("recipes/cpu_tiny.yaml", overrides=[
        "distill.features=recompute", "distill.warm_start=true", "distill.warm_start_workers=true",
        "distill.warm_start_streaming=true", "distill.warm_start_generate_s=20", "distill.warm_start_train_s=3",
        "engine.max_new_tokens=8"])
    buf = TrajectoryBuffer.remote(capacity=16, max_version_lag=5)
    registry = WeightRegistry.remote()
    trainer = DistillTrainer.options(num_cpus=1).remote(cfg.model_dump())
    setup_trainers([trainer], None, False)
    ray.get(buf.warm_done.remote("worker-0", {"error": "EngineDead: worker 0: engine step failed"}))
    prompts = [[5 + i, 9, 12, 7 + i] for i in range(6)]
    out = ray.get(trainer.warm_start.remote(prompts, registry, buf, 1, True, 6), timeout=300)
    assert out["version"] == 1 and out["steps"] >= 1 and out["num_requests"] == 6, out
    assert "streamed" not in out
    assert ray.get(registry.latest_meta.remote())["version"] == 1
    ray.kill(trainer)


def _live_placement_groups() -> set:
    return {pid for pid, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}


def test_actor_group_owns_placement_groups_sink_and_shutdown(ray_local, tmp_path, monkeypatch, caplog):
    """The group Serve reuses (no inference workers): one placement group (trainers), buffer, registry,
    trainers and the sink; a cleanup failure is logged and the rest of the shutdown still runs; a second
    shutdown does nothing."""
    import json
    import logging

    from adaflash_ray.actors import ActorGroup
    from adaflash_ray.actors import group as group_mod

    before = _live_placement_groups()
    cfg = load_recipe("recipes/cpu_tiny.yaml", ["placement.cpus_per_trainer=0.5", "logging.wandb_mode=disabled"])
    with ActorGroup(cfg, num_inference_workers=0, run_dir=tmp_path) as group:
        assert group.workers == [] and len(group.trainers) == 1 and len(group.placement_groups) == 1
        assert _live_placement_groups() - before == {group.placement_groups[0].id.hex()}
        assert ray.get(group.buffer.stats.remote())["buffer/depth"] == 0
        assert ray.get(group.registry.latest_meta.remote()) is None
        group.sink.log({"x/y": 1.0}, kind="test")
        pg = group.placement_groups[0]
        real_remove = group_mod.remove_placement_group

        def failing(p):
            raise RuntimeError("GCS unreachable")

        monkeypatch.setattr(group_mod, "remove_placement_group", failing)
        with caplog.at_level(logging.WARNING, logger=group_mod.__name__):
            group.shutdown()
        assert "removing placement group" in caplog.text and "GCS unreachable" in caplog.text
        assert group.sink is None and group.placement_groups == []  # the sink was closed all the same
        assert json.loads((tmp_path / "metrics.jsonl").read_text())["x/y"] == 1.0
        real_remove(pg)
    assert _live_placement_groups() == before  # __exit__'s second shutdown found nothing left to do


def test_actor_group_that_cannot_be_placed_leaves_nothing_behind(ray_local):
    from adaflash_ray.actors import ActorGroup

    before = _live_placement_groups()
    cfg = load_recipe("recipes/cpu_tiny.yaml", ["placement.cpus_per_inference_worker=0.5",
                                                "placement.cpus_per_trainer=64"])
    with pytest.raises(RuntimeError, match=r"cannot place the trainers: needs CPU 64.* section `placement`"):
        ActorGroup(cfg)  # the inference workers' group was placed first: it is removed again
    assert _live_placement_groups() == before


@ray.remote(num_cpus=0)
class _FakeRegistry:
    """The registry calls Driver.save_new_versions makes, over fixed publications."""

    def __init__(self, history: list[dict], tensors: dict, reports: dict):
        self.history, self.tensors, self.reports = history, tensors, reports

    def latest_meta(self):
        return self.history[-1]

    def get_history(self):
        return self.history

    def get_reports(self):
        return self.reports

    def get(self, version):
        return [ray.put(self.tensors[version])]


def test_driver_saves_every_new_version_and_logs_its_sync(ray_local, tmp_path):
    """Two versions published between two polls: both saved (checkpoint + sha256), one ``sync`` record each
    with the workers that loaded that sha256, and ``sync/broadcast_s`` only where the registry timed the push."""
    import json
    from types import SimpleNamespace

    from adaflash_ray.metrics import MetricsSink
    from adaflash_ray.models import DrafterModelConfig, load_drafter_checkpoint
    from adaflash_ray.pipeline import Driver

    dcfg = DrafterModelConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=4, vocab_size=32, block_size=4,
                              target_layer_ids=[1], target_hidden_size=8, num_target_layers=4)
    tensors = {v: {"fc.weight": torch.full((8, 8), float(v))} for v in (1, 2)}
    shas = {v: tensors_sha256(t) for v, t in tensors.items()}
    history = [{"version": 1, "parent_version": 0, "train_step": 2, "sha256": shas[1], "broadcast_s": 0.25},
               {"version": 2, "parent_version": 1, "train_step": 4, "sha256": shas[2]}]
    reports = {1: [{"worker": 0, "version": 1, "sha256": shas[1]}, {"worker": 1, "error": "dead"}],
               2: [{"worker": 0, "version": 2, "sha256": shas[2]}, {"worker": 1, "version": 2, "sha256": shas[2]}]}
    sink = MetricsSink(tmp_path, "disabled")
    group = SimpleNamespace(sink=sink, registry=_FakeRegistry.remote(history, tensors, reports))
    inputs = SimpleNamespace(canary_prompts=[], ckpt_dir=tmp_path / "checkpoints")
    driver = Driver(load_recipe("recipes/cpu_tiny.yaml"), inputs, group)
    driver.drafter_cfg = dcfg
    assert driver.save_new_versions() is True and driver.last_version == 2
    assert driver.save_new_versions() is False  # nothing newer: nothing saved or logged twice
    sink.close()
    assert driver.shas == shas
    _, saved, meta = load_drafter_checkpoint(tmp_path / "checkpoints" / "v2")
    assert torch.equal(saved["fc.weight"], tensors[2]["fc.weight"]) and meta["train_step"] == "4"
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k.startswith("sync/")} for r in recs] == [
        {"sync/version": 1, "sync/num_workers_ok": 1, "sync/broadcast_s": 0.25},
        {"sync/version": 2, "sync/num_workers_ok": 2}]
