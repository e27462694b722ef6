"""Fault injection (issue 9): a trainer killed with SIGKILL mid-run is restarted by Ray and resumes from
the state saved with the last published version - the run completes, versions rise strictly, no
trajectory is lost or trained as fresh twice (``--resume RUN_DIR`` of a finished run: tests/test_pipeline.py).
Real pipeline on recipes/cpu_tiny.yaml, local Ray on 127.0.0.1.

Run: python -m pytest -q tests/test_faults.py   (slow: a few minutes on 2 CPU cores)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["logging.wandb_mode=disabled", "data.num_eval_prompts=2", "data.eval_max_new_tokens=16"]


def _own_processes(title: str) -> list:
    """This process's descendants (its local Ray) whose title starts with ``title``."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(title):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _kill_trainer_after(run_dir: Path, version: int, delay_s: float, killed: list) -> None:
    """Once ``checkpoints/v<version>`` exists, wait ``delay_s`` (mid-way to the next save), then SIGKILL
    the DistillTrainer process."""
    deadline = time.time() + 600
    while not (run_dir / "checkpoints" / f"v{version}").exists():
        if time.time() > deadline:
            return
        time.sleep(0.5)
    time.sleep(delay_s)
    for p in _own_processes("ray::DistillTrainer"):
        os.kill(p.pid, signal.SIGKILL)
        killed.append(p.pid)


@pytest.mark.slow
def test_trainer_killed_mid_run_resumes(tmp_path):
    from adaflash_ray.config import load_recipe
    from adaflash_ray.pipeline import run

    # 6 steps between saves (cpu_tiny has 2): the kill, 1.5 s after v1, lands mid-way to v2 whatever the machine's
    # speed (with 2 steps a fast run had reached v2 within 3 s and the kill found the trainer done)
    cfg = load_recipe("recipes/cpu_tiny.yaml", TINY + ["distill.num_versions=2", "distill.publish_every=6"])
    run_dir = tmp_path / "run"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_trainer_after, args=(run_dir, 1, 1.5, killed), daemon=True)
    killer.start()
    summary = run(cfg, run_dir)
    killer.join(timeout=5)
    assert killed, "the trainer process was never found to kill"
    assert summary["trainer_restarts"] == 1
    assert summary["final_version"] == 2 and summary["versions_rising"] is True
    assert summary["workers_loaded_final"] is True
    traj = summary["trajectories"]
    assert traj["counted_twice"] == 0 and traj["lost_owner_died"] == 0 and traj["trained_fresh"] > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["v0", "v1", "v2"]
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    faults = [r for r in recs if r["kind"] == "fault"]
    assert any("fault/trainer_resumed_version" in r and r["fault/trainer_resumed_version"] >= 1 for r in faults)
    synced = [int(r["sync/version"]) for r in recs if r["kind"] == "sync"]
    assert synced == sorted(set(synced)) == [1, 2]  # every version once, rising
    # the buffer counted each trajectory once: what was requeued after the kill is not consumed twice
    buf = summary["buffer"]
    assert buf["consumed"] <= buf["added"] and buf["committed"] <= buf["consumed"]
    # --resume of a finished run: tests/test_pipeline.py's second job


def test_resume_of_a_directory_that_is_no_run_fails_clearly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "adaflash_ray.pipeline", "--resume", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "not a run directory (no config.yaml)" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.fixture
def ray_local():
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _overfit_drafter(cfg, prompt: list[int], steps: int = 5) -> dict:
    """A drafter that is good on ``prompt`` (τ ≈ 1.24 vs 1.0 untrained): a few distillation steps on the
    target's own greedy continuation of it. Runs one world-size-1 trainer in this process."""
    import torch

    from adaflash_ray.distill.trainer import DistillTrainerCore
    from adaflash_ray.engine import SamplingParams, SpecEngine
    from adaflash_ray.models.factory import build_drafter, load_target

    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "DS_ACCELERATOR")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        target = load_target(cfg.model)
        drafter, head = build_drafter(target, cfg.drafter, cfg.length_head, seed=cfg.seed)
        eng = SpecEngine(target, drafter, head, max_batch_size=1, max_seq_len=256, record=True)
        req = eng.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
        traj = eng.to_trajectory(req)
        DistillTrainerCore.setup_dist_env(0, 1)  # (a group another test left initialised keeps its port)
        core = DistillTrainerCore(target, cfg.drafter, cfg.length_head, cfg.distill, seed=cfg.seed)
        for _ in range(steps):
            core.train_step([traj])
        return core.publish_tensors()  # the group stays up: DeepSpeed cannot re-initialise after a destroy
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.slow
def test_tau_canary_rolls_every_worker_back_from_a_bad_version(ray_local, tmp_path):
    """Issue 9.3: a good version (τ 1.24 on the canary prompt) then a deliberately bad, finite one (every
    weight matrix re-drawn at random, same scale): the canary measures the bad one's τ below (1 - δ) x the good one's, every
    worker is rolled back to the good version (its sha256), the event is logged and counted, and version
    numbers keep rising afterwards."""
    import torch

    from adaflash_ray.actors import InferenceWorker, WeightRegistry
    from adaflash_ray.config import load_recipe
    from adaflash_ray.data import ensure_target, load_tokenizer
    from adaflash_ray.metrics import MetricsSink
    from adaflash_ray.models import tensors_sha256
    from adaflash_ray.actors.recovery import TauCanary
    from adaflash_ray.pipeline import _check_canary

    ray = ray_local
    cfg = load_recipe("recipes/cpu_tiny.yaml", ["distill.num_anchors=32", "distill.lr=1e-2"])
    tok = load_tokenizer(ensure_target(cfg.model.name))
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    good = _overfit_drafter(cfg, prompt)
    g = torch.Generator().manual_seed(0)
    bad = {k: torch.randn(v.shape, generator=g) * v.std() if v.dim() == 2 else v for k, v in good.items()}
    assert all(bool(torch.isfinite(t).all()) for t in bad.values())

    registry = WeightRegistry.remote()
    workers = [InferenceWorker.remote(cfg.model_dump(), i, None, registry) for i in range(2)]
    ray.get([registry.subscribe.remote(f"worker-{i}", w) for i, w in enumerate(workers)])
    dcfg = ray.get(workers[0].drafter_config.remote())
    sink = MetricsSink(tmp_path, "disabled")
    canary = TauCanary([prompt], 32, delta=0.1)
    sha_good = tensors_sha256(good)
    ray.get(registry.publish.remote(1, 0, 5, [ray.put(good)], sha_good, dcfg))
    canary.start(workers[0], 1)
    _check_canary(canary, registry, sink, wait=True)
    assert canary.good[0] == 1 and canary.tau[1] > 1.15, canary.tau
    ray.get(registry.publish.remote(2, 1, 10, [ray.put(bad)], tensors_sha256(bad), dcfg))
    assert all(lv["version"] == 2 for lv in ray.get([w.loaded_version.remote() for w in workers]))
    canary.start(workers[0], 2)
    _check_canary(canary, registry, sink, wait=True)
    sink.close()
    assert canary.tau[2] < 0.9 * canary.tau[1], canary.tau
    loaded = ray.get([w.loaded_version.remote() for w in workers])
    assert all(lv["version"] == 1 and lv["sha256"] == sha_good for lv in loaded), loaded
    assert ray.get(registry.latest_meta.remote())["version"] == 1
    events = ray.get(registry.get_rollbacks.remote())
    assert len(events) == 1 and (events[0]["from_version"], events[0]["to_version"]) == (2, 1)
    assert "canary" in events[0]["reason"]
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["canary/rollback_from"] for r in recs if "canary/rollback_from" in r] == [2]
    assert all(ray.get(w.stats.remote())["spec/num_rollbacks"] == 1 for w in workers)
    # numbers keep rising: the bad number is never reused, the next one is accepted everywhere
    with pytest.raises(ray.exceptions.RayTaskError, match="not newer"):
        ray.get(registry.publish.remote(2, 1, 10, [ray.put(good)], sha_good, dcfg))
    reports = ray.get(registry.publish.remote(3, 1, 15, [ray.put(good)], sha_good, dcfg))
    assert all(r["version"] == 3 for r in reports)


@pytest.mark.slow
def test_killed_node_and_killed_buffer_on_a_multi_node_cluster(tmp_path):
    """Issue 9.4 with ``ray.cluster_utils.Cluster`` (a head and a second node, both on 127.0.0.1): the node
    holding an inference worker is removed -> the request in flight fails with a Ray actor error (no hang),
    Ray recreates the worker on the surviving node and it loads the latest published version (sha256
    checked); the buffer actor is killed -> every journaled trajectory, the one leased to a trainer
    included, comes back once (0 lost, 0 duplicated) and a retried add is not queued twice."""
    import ray
    import torch
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from adaflash_ray.actors import InferenceWorker, TrajectoryBuffer, WeightRegistry
    from adaflash_ray.config import load_recipe
    from adaflash_ray.models import tensors_sha256
    from tests.test_actors import _traj

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    loopback = {"node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**loopback, "num_cpus": 2, "include_dashboard": False})
    try:
        node2 = cluster.add_node(**loopback, num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        cfg = load_recipe("recipes/cpu_tiny.yaml")
        # the registry lives on the head node: only the worker's node dies (placed freely, it could land on node2)
        registry = WeightRegistry.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.head_node.node_id, soft=False)).remote()
        worker = InferenceWorker.options(
            max_restarts=2, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node2.node_id, soft=True),
        ).remote(cfg.model_dump(), 0, None, registry)
        ray.get(registry.subscribe.remote("worker-0", worker))
        base = ray.get(worker.current_tensors.remote())
        g = torch.Generator().manual_seed(1)
        v1 = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        ray.get(registry.publish.remote(1, 0, 10, [ray.put(v1)], tensors_sha256(v1), None))
        assert ray.get(worker.loaded_version.remote())["version"] == 1
        in_flight = worker.generate.remote([[1, 2, 3, 4]] * 4, 200, 0.0, False, True)
        time.sleep(2.0)
        cluster.remove_node(node2)  # the node dies under the worker
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(in_flight, timeout=180)
        deadline = time.time() + 300
        while True:  # Ray recreates the worker on the head node; it catches up from the registry
            try:
                info = ray.get(worker.loaded_version.remote(), timeout=60)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.time() < deadline, "the inference worker was not recreated"
                time.sleep(2.0)
        assert info["version"] == 1 and info["sha256"] == tensors_sha256(v1)
        assert len(ray.get(worker.generate.remote([[1, 2, 3, 4]], 8))[0]["output_ids"]) == 8

        # the buffer: 4 journaled (2 of them past capacity, on disk only), 1 leased, then the actor is killed
        journal = tmp_path / "journal"
        buf = TrajectoryBuffer.options(max_restarts=1, max_task_retries=-1).remote(2, 5, str(journal))
        originals = [_traj(i, 1) for i in range(4)]
        refs = [ray.put(t) for t in originals]
        for r in refs:
            ray.get(buf.add.remote([r], 1, 8))
        leased = ray.get(buf.get_batch.remote(1, 0.1, "trainer-0"))
        assert len(leased) == 1 and len(list(journal.glob("*.parquet"))) == 4
        ray.kill(buf, no_restart=False)
        deadline = time.time() + 120
        while ray.get(buf.stats.remote())["buffer/recovered"] != 4:  # ray.kill is asynchronous
            assert time.time() < deadline, "the buffer was not restarted"
            time.sleep(0.5)
        ray.get(buf.add.remote([refs[3]], 1, 8))  # a retried add of one it already holds
        s = ray.get(buf.stats.remote())
        assert s["buffer/recovered"] == 4 and s["buffer/duplicates_ignored"] == 1
        got = [ray.get(it[0]).request_id for it in ray.get(buf.get_batch.remote(10, 1.0))]
        want = [t.request_id for t in originals]
        lost, duplicated = set(want) - set(got), len(got) - len(set(got))
        assert (lost, duplicated) == (set(), 0) and sorted(got) == sorted(want)
    finally:
        ray.shutdown()
        cluster.shutdown()
