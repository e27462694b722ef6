"""The main job end to end through a real Ray cluster: ``ray start --head`` on 127.0.0.1, then
``ray job submit -- python -m adaflash_ray.pipeline --recipe recipes/cpu_tiny.yaml``. Checks the
summary line, the run directory, that every published version reached the worker, plain progress lines
in the job log, and that Ray's listening sockets are on loopback only; then a second job, ``--resume`` of the
first to one more version, after which no actor, placement group or object-store growth is left (soak). The
first job is the golden cpu_tiny run: its loss curve and summary are checked against
tests/golden/cpu_tiny.json (compared by tests/test_golden.py). Slow (~3-4 minutes on 2 cores)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_golden import OVERRIDES, check_golden

ROOT = Path(__file__).resolve().parents[1]
RAY = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports: every socket stays bound until all are picked, so the kernel cannot hand
    the same ephemeral port out twice (Ray refuses a head whose components share a port)."""
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.socket())
            socks[-1].bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _is_loopback(addr: str) -> bool:
    ip = addr.rsplit(":", 1)[0]
    return ip.startswith("127.") or ip in ("::1", "localhost") or ip.startswith("::ffff:127.")


def _listening_addresses(pids: set[int]) -> list[str]:
    import psutil

    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.append(f"{c.laddr.ip}:{c.laddr.port}")
    return out


def _ray_pids(temp_dir: str) -> set[int]:
    """Processes of the test's own Ray cluster (their command lines name its private temp dir), and
    their children (workers)."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if temp_dir in " ".join(p.info["cmdline"] or []):
            pids.add(p.info["pid"])
            try:
                pids.update(c.pid for c in p.children(recursive=True))
            except psutil.Error:
                pass
    return pids


def _stop_own_cluster(temp_dir: str) -> None:
    """Stop only this test's cluster (``ray stop`` would kill every Ray on the host)."""
    import psutil

    procs = []
    for pid in _ray_pids(temp_dir):
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def _ray_list(kind: str, dash_port: int, env: dict) -> list:
    """Live entries of ``ray list <kind>`` (actors ALIVE, placement groups CREATED) on the test's cluster."""
    state = "ALIVE" if kind == "actors" else "CREATED"
    out = subprocess.run([RAY, "list", kind, f"--address=http://127.0.0.1:{dash_port}", "--filter",
                          f"state={state}", "--format", "json"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip().startswith("No resource"):  # what `ray list` prints for an empty result
        return []
    return json.loads(out.stdout)


def _object_store_used(gcs_port: int, env: dict) -> float:
    """Bytes of object store in use, from ``ray status``."""
    import re

    out = subprocess.run([RAY, "status", f"--address=127.0.0.1:{gcs_port}"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"([\d.]+)([KMGT]?i?B)/[\d.]+[KMGT]?i?B object_store_memory", out.stdout)
    assert m, out.stdout[-2000:]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    return float(m.group(1)) * units[m.group(2)]


@pytest.mark.slow
def test_ray_job_submit_runs_the_pipeline(tmp_path):
    import secrets

    token = tmp_path / "ray_auth_token"  # Ray 2.5x+ token auth, explicit on both sides (see README)
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "WANDB_MODE": "offline",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    import tempfile

    # the agents' ports too: Ray's fixed defaults (52365, ...) may be held by another Ray on this machine, and then the
    # head's job agent never comes up ("No available agent to submit job"); all six distinct
    gcs_port, dash_port, listen_port, grpc_port, env_port, metrics_port = _free_ports(6)
    agent_ports = [f"--dashboard-agent-listen-port={listen_port}", f"--dashboard-agent-grpc-port={grpc_port}",
                   f"--runtime-env-agent-port={env_port}", f"--metrics-export-port={metrics_port}"]
    temp_dir = tempfile.mkdtemp(prefix="afr", dir="/tmp")  # short: Ray's socket paths have a length limit
    start = subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
                            f"--temp-dir={temp_dir}", *agent_ports,
                            "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}", "--num-cpus=2",
                            "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stderr[-3000:]
    try:
        listening = _listening_addresses(_ray_pids(temp_dir))
        assert listening, "no Ray listening sockets found"
        assert all(_is_loopback(a) for a in listening), f"Ray listens beyond loopback: {listening}"
        run_dir = tmp_path / "run"

        def submit(*args: str, recipe: bool = True):
            cmd = [RAY, "job", "submit", f"--address=http://127.0.0.1:{dash_port}", "--working-dir", str(ROOT),
                   "--", sys.executable, "-m", "adaflash_ray.pipeline",
                   *(("--recipe", "recipes/cpu_tiny.yaml") if recipe else ()), *args]
            deadline = time.time() + 180
            while True:  # the head's job agent may still be starting: Ray answers "No available agent"
                job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
                if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr \
                        or time.time() > deadline:
                    break
                time.sleep(5)
            assert job.returncode == 0, (job.stdout[-4000:], job.stderr[-3000:])
            return job, json.loads([ln for ln in job.stdout.splitlines() if ln.startswith("{")][-1])

        golden_sets = [a for o in OVERRIDES if not o.startswith("logging.wandb_mode=") for a in ("--set", o)]
        job, summary = submit("--run-dir", str(run_dir), "--set", "logging.wandb_mode=offline", *golden_sets,
                              "--set", "logging.progress=true", "--set", "logging.progress_every_s=5",
                              "--set", "distill.weight_sync=collective")
        assert summary["final_version"] == 3
        # distill.weight_sync collective (gloo here, NCCL on GPUs): every version reaches every worker through the
        # broadcast (no object-store fallback) with the published checksum
        ws = summary["weight_sync"]
        assert ws["mode"] == "collective" and ws["num_fallbacks"] == 0
        assert ws["path"] == {str(v): "collective" for v in range(1, summary["final_version"] + 1)}
        assert all(0 < s < 60 for s in ws["broadcast_s"].values()) and ws["num_bytes"] > 0
        recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        sends = [r for r in recs if r["kind"] == "train" and "sync/collective_ok" in r]
        assert [r["sync/collective_ok"] for r in sends] == [1.0] * summary["final_version"]
        assert all(r["sync/num_workers_ok"] == r["sync/num_workers"] for r in sends)
        assert summary == json.loads((run_dir / "summary.json").read_text())
        # no terminal under `ray job submit`: plain progress lines show the run moving (issue 9.6)
        progress = [ln for ln in job.stdout.splitlines() if ln.startswith("progress ")]
        assert len(progress) >= 2 and "version 3/3" in progress[-1] and "trainer_util" in progress[0], progress
        assert set(summary["eval_tau"]) == {"0", "1", "2", "3"}
        assert all(1.0 <= t <= 16.0 for t in summary["eval_tau"].values())
        # the held-out γ histogram per version, whole: its steps' draft lengths, each within the block
        hist = summary["eval_gamma_hist"]
        assert set(hist) == set(summary["eval_tau"]) and all(sum(h.values()) > 0 for h in hist.values())
        assert all(0 <= int(g) <= 15 for h in hist.values() for g in h)
        # the final version also drafted whole blocks: a τ that does not depend on the length policy
        assert list(summary["eval_full_block"]) == ["3"] and summary["eval_full_block"]["3"]["tau"] >= 1.0
        assert summary["workers_loaded_final"] is True
        rd = Path(summary["run_dir"])
        assert rd == run_dir.resolve()
        assert (rd / "config.yaml").exists() and (rd / "tau_vs_version.png").stat().st_size > 1000
        assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["v0", "v1", "v2", "v3"]
        kinds = {json.loads(ln)["kind"] for ln in (rd / "metrics.jsonl").read_text().splitlines()}
        assert {"train", "inference", "buffer", "eval"} <= kinds
        assert any((rd / "wandb").glob("offline-run-*"))
        listening = _listening_addresses(_ray_pids(temp_dir))
        assert all(_is_loopback(a) for a in listening), f"Ray listens beyond loopback: {listening}"
        check_golden(summary, rd)  # the same recipe and seed as tests/test_golden.py: the same loss curve

        # soak: a second job on the same cluster, `--resume` of the first to one more version (its trainer state,
        # checkpoints and trajectory history); afterwards no actor or placement group is left and the object store
        # did not grow. With a one-prompt held-out eval.
        store_after_1 = _object_store_used(gcs_port, env)
        _, s2 = submit("--resume", str(run_dir), "--set", "logging.wandb_mode=disabled",
                       "--set", "distill.num_versions=4", "--set", "data.num_eval_prompts=1",
                       "--set", "data.eval_max_new_tokens=8", recipe=False)
        assert s2["final_version"] == 4 and set(s2["eval_tau"]) == {"0", "1", "2", "3", "4"}
        assert s2["workers_loaded_final"] is True and s2["versions_rising"] is True
        assert s2["train_steps"] > summary["train_steps"]  # the optimizer step count went on
        assert s2["trajectories"]["counted_twice"] == 0
        assert s2["trajectories"]["trained_fresh"] > summary["trajectories"]["trained_fresh"]  # the old ids kept
        assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["v0", "v1", "v2", "v3", "v4"]
        ours = {"InferenceWorker", "DistillTrainer", "TrajectoryBuffer", "WeightRegistry"}
        alive = [a for a in _ray_list("actors", dash_port, env) if a.get("class_name") in ours]
        assert alive == [], f"actors left alive after both jobs: {alive}"
        assert _ray_list("placement-groups", dash_port, env) == [], "placement groups left after both jobs"
        assert _object_store_used(gcs_port, env) <= store_after_1 + 8 * 2**20
    finally:
        _stop_own_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_bad_init_checkpoint_fails_before_ray_starts(tmp_path):
    """A drafter checkpoint whose vocabulary does not match the target: exit 2, the field named."""
    import torch

    from adaflash_ray.models import DrafterModelConfig, save_drafter_checkpoint

    cfg = DrafterModelConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=9,
                             num_key_value_heads=3, head_dim=64, vocab_size=32000, block_size=4,
                             target_layer_ids=[1, 8, 14, 20, 27], target_hidden_size=576, num_target_layers=30)
    save_drafter_checkpoint(tmp_path / "ck", cfg, {"fc.weight": torch.zeros(576, 5 * 576)})
    out = subprocess.run([sys.executable, "-m", "adaflash_ray.pipeline", "--recipe", "recipes/cpu_tiny.yaml",
                          "--run-dir", str(tmp_path / "run"), "--set", f"drafter.init_path={tmp_path / 'ck'}"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "RAY_ADDRESS": "", "WANDB_MODE": "disabled"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "vocab_size 32000 != target vocab_size 49152" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize("flag,deps_installed,expect", [(True, True, True), (True, False, False),
                                                        (False, True, False)])
def test_dashboard_is_a_recipe_choice(monkeypatch, capsys, flag, deps_installed, expect):
    """ray.include_dashboard: on where the dashboard's packages are installed; a minimal Ray (no
    `ray[default]`) runs without it and the driver says why; false turns it off."""
    import ray

    from adaflash_ray import pipeline
    from adaflash_ray.config import load_recipe

    cfg = load_recipe("recipes/cpu_tiny.yaml", [f"ray.include_dashboard={str(flag).lower()}"])
    assert cfg.ray.include_dashboard is flag
    monkeypatch.setattr(ray._private.utils, "get_dashboard_dependency_error",
                        lambda: None if deps_installed else ImportError("No module named 'aiohttp'"))
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert pipeline.init_ray(cfg) == (True, None)
    assert seen["include_dashboard"] is expect and seen["_node_ip_address"] == "127.0.0.1"
    err = capsys.readouterr().err
    if flag and not deps_installed:
        assert "dashboard off" in err and "aiohttp" in err and "ray[default]" in err
    else:
        assert "dashboard off" not in err


def test_plain_progress_lines_without_a_terminal():
    """Issue 9.6: without a TTY the driver prints a plain line every N seconds (the first at once),
    carrying version, step, loss, serving τ, γ, buffer and trainer utilisation."""
    import io

    from adaflash_ray.metrics import PlainProgress

    now = [100.0]
    out = io.StringIO()
    p = PlainProgress(out, every_s=30, total_versions=5, clock=lambda: now[0])
    fields = dict(step=12, loss=3.41234, serve_tau=1.125, gamma=1.0, buffer=7, stale_drops=0, trainer_util=0.8312)
    assert p.update(1, **fields)
    now[0] += 10
    assert not p.update(1, **fields)  # too soon
    now[0] += 25
    assert p.update(2, **{**fields, "loss": None})
    assert p.update(2, force=True, training="done")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(ln.startswith("progress ") and "\x1b" not in ln for ln in lines)
    assert lines[0] == ("progress 00:00:00 version 1/5 step 12 loss 3.412 serve_tau 1.125 gamma 1.000 buffer 7 "
                        "stale_drops 0 trainer_util 0.831")
    assert lines[1].startswith("progress 00:00:35 version 2/5") and "loss -" in lines[1]


def test_deal_by_weight_interleaves_in_proportion():
    """deal_by_weight: equal weights give the round robin ``items[r::k]`` (the trainer ranks' old split); weights
    2 : 1 : 1 give shares 1/2, 1/4, 1/4, interleaved; every item lands once, in order within its part."""
    from adaflash_ray.pipeline import deal_by_weight

    items = list(range(103))
    assert deal_by_weight(items, [4, 4, 4]) == [items[r::3] for r in range(3)]
    parts = deal_by_weight(items, [2, 1, 1])
    assert [len(p) for p in parts] == [52, 26, 25]
    assert sorted(x for p in parts for x in p) == items and all(p == sorted(p) for p in parts)
    assert max(parts[1][:10]) < 40  # interleaved, not a contiguous cut
    with pytest.raises(ValueError, match="weights"):
        deal_by_weight(items, [1, 0])


def test_deal_warm_start_gives_every_rank_a_prompt():
    """deal_warm_start: by KV slots as deal_by_weight, except that a trainer rank the workers' slots left without a
    prompt takes one from the worker holding most; with no prompt at any worker nothing moves."""
    from adaflash_ray.pipeline import deal_by_weight, deal_warm_start

    items = list(range(16))
    assert deal_warm_start(items, [8, 4, 4], 1) == deal_by_weight(items, [8, 4, 4])
    shares = deal_warm_start(list(range(3)), [4, 4, 256, 256], 2)
    assert all(shares[:2]) and sorted(x for p in shares for x in p) == [0, 1, 2]
    assert deal_warm_start([7], [4, 4], 2) == [[7], []]


def _warm_workers_overrides(*extra: str) -> list[str]:
    """cpu_tiny with a warm start of 16 prompts decoded with two inference workers, one version, a short evaluation."""
    return ["distill.warm_start=true", "distill.warm_start_workers=true", "distill.warm_start_prompts=16",
            "distill.warm_start_generate_s=20", "distill.warm_start_train_s=5", "distill.num_versions=1",
            "placement.num_inference_workers=2", "logging.wandb_mode=disabled", "data.num_eval_prompts=2",
            "data.eval_max_new_tokens=8", "distill.canary_prompts=0", *extra]


@pytest.mark.slow
def test_warm_start_workers_decode_a_share_the_trainer_trains_on(tmp_path):
    """distill.warm_start_workers on cpu_tiny, one trainer rank and two inference workers: the prompts are dealt by
    KV slots (warm_start_batch_size 8 for the rank, 4 per worker: 8 / 4 / 4 of 16), each worker decodes its share
    on its own engine and hands it to the buffer, and the rank trains on its own text and theirs before it
    publishes version 1; the summary reports each worker's decode."""
    import json

    from adaflash_ray.config import load_recipe
    from adaflash_ray.pipeline import run

    cfg = load_recipe("recipes/cpu_tiny.yaml", _warm_workers_overrides("distill.warm_start_batch_size=8"))
    summary = run(cfg, tmp_path / "run")
    (rank,) = summary["warm_start"]["ranks"]
    assert rank["version"] == 1 and rank["steps"] >= 1
    assert rank["num_requests"] == 8, rank  # its own share, every prompt finished within the time limit
    workers = rank["workers"]
    assert sorted(workers) == ["worker-0", "worker-1"], workers
    assert all(w.get("num_requests") == 4 and w["num_tokens"] > 0 for w in workers.values()), workers
    assert rank["worker_requests"] == 8
    assert rank["worker_tokens"] == sum(w["num_tokens"] for w in workers.values())
    records = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("warm/worker_requests") == 8.0 for m in records)
    assert summary["final_version"] == 1


@pytest.mark.slow
def test_streaming_warm_start_trains_while_the_workers_decode(tmp_path):
    """distill.warm_start_streaming on cpu_tiny, one trainer rank and two inference workers: the workers decode every
    warm-start prompt (8 / 8 of 16 by KV slots), the rank decodes none and trains on their batches as they arrive,
    publishing version 1; the summary says the stage streamed and reports each worker's decode."""
    from adaflash_ray.config import load_recipe
    from adaflash_ray.pipeline import run

    cfg = load_recipe("recipes/cpu_tiny.yaml", _warm_workers_overrides("distill.warm_start_streaming=true"))
    summary = run(cfg, tmp_path / "run")
    warm = summary["warm_start"]
    (rank,) = warm["ranks"]
    assert warm["streamed"] is True and rank["streamed"] is True
    assert rank["num_requests"] == 0 and rank["version"] == 1 and rank["steps"] >= 1
    assert rank["worker_requests"] == 16 and rank["worker_batches_lost"] == 0, rank
    assert {w: r.get("num_requests") for w, r in rank["workers"].items()} == {"worker-0": 8, "worker-1": 8}
    assert summary["final_version"] == 1


@pytest.mark.slow
def test_warm_start_stage_publishes_version_1_before_on_policy(tmp_path):
    """distill.warm_start on cpu_tiny with the cost policy, on 2 DeepSpeed trainer ranks under ZeRO-3 (gloo, one
    process group over a rendezvous file): the trainers decode target text themselves (AR, no drafter), train on it
    and publish version 1 before any worker is fed; on-policy training then continues from version 1 to
    num_versions, both ranks in lockstep, every rank gathering at publication (no deadlock), every version saved,
    evaluated and loaded by the workers; a quarter of the requests sampled; the rendezvous file is gone afterwards.
    The trainer trains the acceptance head (the cost policy's), which every worker hot-loads with the drafter."""
    import glob
    import json
    import tempfile

    from adaflash_ray.config import load_recipe
    from adaflash_ray.pipeline import run

    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "adaflash_pg_*")))
    cfg = load_recipe("recipes/cpu_tiny.yaml", [
        "distill.warm_start=true", "distill.warm_start_prompts=6", "distill.warm_start_generate_s=15",
        "distill.warm_start_train_s=8", "distill.num_versions=2", "data.sample_fraction=0.25",
        "logging.wandb_mode=disabled", "data.num_eval_prompts=2", "data.eval_max_new_tokens=16",
        "length_head.policy=cost", "placement.num_trainers=2", "distill.zero_stage=3"])
    summary = run(cfg, tmp_path / "run")
    left = set(glob.glob(os.path.join(tempfile.gettempdir(), "adaflash_pg_*"))) - before
    assert not left, f"rendezvous files left behind: {left}"
    warm = summary["warm_start"]
    assert warm is not None and len(warm["ranks"]) == 2, warm
    assert warm["ranks"][0]["version"] == 1 and warm["ranks"][0]["num_requests"] >= 1
    assert warm["ranks"][0]["steps"] >= 1
    assert summary["final_version"] == 2 and summary["workers_loaded_final"] is True
    assert set(summary["eval_tau"]) == {"0", "1", "2"} and summary["versions_rising"] is True
    st = summary["startup_s"]  # the start-up phases' ends, in order, within the run
    assert list(st) == ["inputs", "ray", "actors", "setup"] and 0 <= st["inputs"] <= st["ray"] <= st["actors"] \
        <= st["setup"] <= summary["wall_s"], st
    records = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm_steps = [m for m in records if m.get("train/warm_start") == 1.0 and "train/loss" in m]
    assert warm_steps and all(m["train/version"] == 0.0 for m in warm_steps)
    assert not any(m.get("train/time_up") for m in records if m.get("train/warm_start"))
    from adaflash_ray.models import load_drafter_checkpoint

    tensors = load_drafter_checkpoint(tmp_path / "run" / "checkpoints" / "v2")[1]
    # the AcceptanceHead (hidden state + 2 confidence features in, no residual layer), not the direct head
    assert tensors["length_head.inp.weight"].shape[1] == 576 + 2 and "length_head.res.weight" not in tensors
