"""The Ray-free trainer loop (adaflash_ray/distill/loop.py): publish cadence, commits before publications, state
saved before a version is published, hand-back of prefetched data, duplicate and lost trajectories, the time
budget of a starved trainer - on a fake core and fake or file-backed sources - the offline commands (generate
trajectory files with the engine, train from them) in a process that never imports Ray, and, on Ray, the
registry telling the buffer each version it published."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from adaflash_ray.config import DistillConfig
from adaflash_ray.distill.loop import (CheckpointSink, DirectorySource, ReplayPool, StreamSource, TrainerLoop, main,
                                       version_table)
from adaflash_ray.distill.spill import spill_path, write_parquet
from adaflash_ray.models import load_drafter_checkpoint, tensors_sha256
from adaflash_ray.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]


def _traj(rid: str, n: int = 12) -> Trajectory:
    return Trajectory(request_id=rid, token_ids=torch.arange(100, 100 + n), prompt_len=4, features=None,
                      last_hidden=None, drafter_version=0)


class _Config:
    def __init__(self, block_size: int = 4):
        self.block_size = block_size

    def as_dict(self) -> dict:
        return {"block_size": self.block_size}


class FakeCore:
    """DistillTrainerCore's surface for the loop, one rank, recording what it trained and saved."""

    def __init__(self, events: list, step_s: float = 0.01, stop_at: int | None = None):
        self.events, self.step_s, self.stop_at = events, step_s, stop_at
        self.global_step, self.trained, self.closed, self.stop = 0, [], False, False
        self.fresh: list[list[bool] | None] = []

    def train_step(self, trajectories: list, fresh: list[bool] | None = None) -> dict:
        self.global_step += 1
        self.trained.append([t.request_id for t in trajectories])
        self.fresh.append(fresh)
        if self.stop_at is not None and self.global_step >= self.stop_at:
            self.stop = True
        return {"train/loss": 10.0 / self.global_step, "train/seconds": self.step_s, "train/num_positions": 8.0,
                "train/top1_pos1": 0.5, "train/block_accept_len": 1.5, "train/step": float(self.global_step)}

    def all_ranks(self, flag: bool) -> bool:
        return bool(flag)

    def save_state(self, save_dir: str, tag: str, client_state: dict) -> None:
        self.events.append(("save", tag, json.loads(json.dumps(client_state))))  # as saved, then

    def publish_tensors(self) -> dict:
        return {"w": torch.full((3,), float(self.global_step))}

    def drafter_model_config(self) -> _Config:
        return _Config()

    def close(self) -> None:
        self.closed = True


class FakeSink:
    def __init__(self, events: list):
        self.events, self.published, self.closed = events, [], False

    def publish(self, version, parent_version, step, tensors, sha256, config):
        assert sha256 == tensors_sha256(tensors)
        self.events.append(("publish", version))
        self.published.append((version, parent_version, step, float(tensors["w"][0])))
        return [{"worker": "w0", "sha256": sha256}], {}

    def close(self) -> None:
        self.closed = True


class ListSource:
    """An in-memory leased source: ``handles`` name trajectories (``request_id`` = the handle before a '#');
    handles in ``lost`` resolve to None (their producer died); an empty queue sleeps up to 50 ms per call."""

    def __init__(self, handles: list[str], events: list, lost: tuple = ()):
        self.queue, self.events, self.lost = list(handles), events, set(lost)
        self.leased, self.released, self.num_committed, self.versions = [], [], 0, []

    def get_batch(self, n, wait_s):
        if not self.queue:
            time.sleep(min(wait_s, 0.05))
        out, self.queue = self.queue[:n], self.queue[n:]
        self.leased += out
        return [(h, 0) for h in out]

    def prefetch(self, n, wait_s):
        batch = self.get_batch(n, wait_s)

        class Done:
            def result(self):
                return batch
        return Done()

    def resolve(self, handles):
        return [None if h in self.lost else _traj(h.split("#")[0]) for h in handles]

    def release(self, handles):
        self.released += list(handles)
        self.leased = [h for h in self.leased if h not in handles]
        self.queue = list(handles) + self.queue

    def commit(self):
        self.events.append(("commit", len(self.leased)))
        self.num_committed += len(self.leased)
        self.leased = []

    def set_version(self, version):
        self.versions.append(version)

    def exhausted(self):
        return False


def _dc(**kw) -> DistillConfig:
    base = dict(batch_size=2, max_reuse=1, publish_every=2, num_versions=5, max_version_lag=2, prefetch=False)
    return DistillConfig(**{**base, **kw})


def _spill_dir(tmp_path: Path, n: int) -> Path:
    d = tmp_path / "traj"
    d.mkdir()
    for i in range(n):
        write_parquet(_traj(f"r{i}", 10 + i), spill_path(d, f"r{i}", 0))
    return d


def test_loop_over_spill_files_publishes_on_cadence_saves_then_commits_then_publishes(tmp_path):
    """Six spilled trajectories, batch 2, a version every 2 steps: 3 steps in file order, v1 at step 2, and -
    the files used up - v2 at step 3 marked out of data; each version's state is saved before it is published;
    every file trained once and committed; the sink and the core closed."""
    events, records = [], []
    core, sink = FakeCore(events), FakeSink(events)
    source = DirectorySource(_spill_dir(tmp_path, 6))
    loop = TrainerLoop(core, _dc(), seed=0, state_dir=str(tmp_path / "state"), on_metrics=records.append)
    summary = loop.run(source, sink)
    assert core.trained == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    assert sink.published == [(1, 0, 2, 2.0), (2, 1, 3, 3.0)]
    assert [e[0] for e in events] == ["save", "publish", "save", "publish"]
    assert events[0][1:] == ("v1", {"version": 1, "fresh_ids": ["r0", "r1", "r2", "r3"], "num_lost": 0})
    assert source.num_committed == 6 and source.exhausted() and source.version == 2
    assert summary == {"rank": 0, "final_version": 2, "steps": 3, "seconds": summary["seconds"], "num_fresh": 6,
                       "num_counted_twice": 0, "num_lost": 0, "num_duplicates_skipped": 0, "num_warm_replayed": 0}
    assert sink.closed and core.closed
    assert [m.get("sync/version") for m in records] == [None, 1.0, None, 2.0]  # v2: a publish-only record
    assert records[3] == {**records[3], "train/step": 3.0, "train/out_of_data": 1.0} and "train/loss" not in records[3]
    assert all(m["sync/num_workers_ok"] == 1.0 for m in records if "sync/version" in m)
    table = version_table(records)
    assert table[1]["steps"] == 2 and table[1]["loss"] == pytest.approx((10.0 + 5.0) / 2)
    assert table[1]["positions_per_s"] == pytest.approx(8.0 / 0.01) and table[2]["top1_pos1"] == 0.5


def test_version_table_weighs_fresh_acceptance_by_blocks():
    base = {"train/version": 0.0, "train/num_positions": 4.0, "train/seconds": 1.0, "train/block_accept_len": 2.0}
    records = [{**base, "train/loss": 1.0, "train/block_accept_len_fresh": 3.0, "train/num_fresh_blocks": 10.0},
               {**base, "train/loss": 2.0, "train/block_accept_len_fresh": 1.5, "train/num_fresh_blocks": 30.0},
               {**base, "train/loss": 3.0, "train/num_fresh_blocks": 0.0}, {"sync/version": 1.0}]
    row = version_table(records)[1]
    assert row["steps"] == 3 and row["block_accept_len"] == 2.0
    assert row["block_accept_len_fresh"] == pytest.approx((3.0 * 10 + 1.5 * 30) / 40)


def test_warm_start_groups_its_text_by_length():
    """distill.warm_start_group_by_length: the warm start's fresh batches are runs of the length-sorted text (each
    batch's rows of neighbouring lengths), in a seeded order; off, the list order."""
    from adaflash_ray.distill.loop import length_grouped

    trajs = [_traj(f"t{i}", n) for i, n in enumerate([30, 8, 20, 9, 31, 21, 7, 19])]
    for group, expect_sorted in ((True, True), (False, False)):
        core = FakeCore([])
        loop = TrainerLoop(core, _dc(max_reuse=1, warm_start_group_by_length=group), seed=1)
        loop.warm_start(trajs, FakeSink([]), train_s=5.0)
        lengths = {t.request_id: t.num_tokens for t in trajs}
        batches = [sorted(lengths[r] for r in b) for b in core.trained]
        assert sorted(x for b in batches for x in b) == sorted(lengths.values())
        if expect_sorted:
            assert sorted(batches) == [[7, 8], [9, 19], [20, 21], [30, 31]]
        else:
            assert core.trained[0] == ["t0", "t1"]
    assert length_grouped(trajs, 3, seed=0) == length_grouped(trajs, 3, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        length_grouped(trajs, 0)


def test_warm_start_replays_its_whole_set_max_reuse_times():
    """A warm-start set larger than the on-policy replay pool (4 x batch_size x max_reuse = 16 here): every
    trajectory trains max_reuse = 2 times in all, once fresh then once replayed - not only the last 16 pooled."""
    trajs = [_traj(f"t{i}", 8) for i in range(40)]
    core = FakeCore([])
    loop = TrainerLoop(core, _dc(max_reuse=2, warm_start_group_by_length=False), seed=2)
    summary = loop.warm_start(trajs, FakeSink([]), train_s=30.0)
    counts = Counter(x for step in core.trained for x in step)
    assert counts == {f"t{i}": 2 for i in range(40)} and summary["steps"] == 40
    assert core.trained[:20] == [[f"t{2 * i}", f"t{2 * i + 1}"] for i in range(20)]  # the fresh pass first


def test_streaming_warm_start_trains_as_the_text_arrives():
    """The streaming warm start (StreamSource): the loop trains on the first batches before the rest has arrived,
    every trajectory that arrives trains max_reuse times in all (the pool holds the announced size), and the stage
    publishes once the stream is done and used up; a stream that ends with nothing raises."""
    arrivals = [[_traj(f"t{i}", 8) for i in range(j, j + 4)] for j in range(0, 12, 4)]
    fetched = []

    def fetch(wait_s):
        batch = arrivals[len(fetched)] if len(fetched) < len(arrivals) else []
        fetched.append((len(core.trained), wait_s))
        return batch, len(fetched) >= len(arrivals)

    core = FakeCore([])
    loop = TrainerLoop(core, _dc(max_reuse=2, batch_size=2, warm_start_group_by_length=True), seed=2)
    source = StreamSource(fetch)
    summary = loop.warm_start(source, FakeSink([]), train_s=30.0, pool_size=12)
    counts = Counter(x for step in core.trained for x in step)
    assert counts == {f"t{i}": 2 for i in range(12)} and summary["steps"] == 12 and summary["final_version"] == 1
    assert [n for n, _ in fetched] == [0, 2, 4]  # the second batch was fetched after two steps on the first
    assert source.num_fetched == 12 and source.exhausted()
    with pytest.raises(ValueError, match="stream ended after 0 trajectories"):  # every worker failed
        TrainerLoop(FakeCore([]), _dc(batch_size=2), seed=2).warm_start(
            StreamSource(lambda w: ([], True)), FakeSink([]), train_s=5.0)


def test_replay_pool_follows_the_scanning_rules_step_by_step():
    """ReplayPool against the list the loop used to scan every step (the same rules, O(pool) per step): over random
    adds, version changes, steps, caps and hand-backs, every step takes the oldest fresh entries first and then only
    trained entries still in the list, as many as it can, and afterwards both hold the same entries with the same
    uses in the same arrival order."""
    rng, draw = random.Random(5), random.Random(6)
    for max_reuse, lag in [(1, 0), (2, 1), (4, 2)]:
        pool, ref = ReplayPool(max_reuse, lag), []  # ref: [name, version, uses] in arrival order
        version, n_added = 0, 0
        for _ in range(400):
            op = rng.random()
            if op < 0.35:
                for _ in range(rng.randrange(1, 6)):
                    v = max(0, version - rng.randrange(0, 3))
                    pool.add(f"t{n_added}", v, f"h{n_added}")
                    ref.append([f"t{n_added}", v, 0])
                    n_added += 1
            elif op < 0.45:
                version += 1
            elif op < 0.9:
                pool.prune(version)
                ref = [e for e in ref if e[2] < max_reuse and version - e[1] <= lag]
                n = rng.randrange(1, 8)
                chosen = pool.choose(n, draw)
                fresh = [e for e in ref if e[2] == 0][:n]
                assert [e[0] for e in chosen[:len(fresh)]] == [e[0] for e in fresh]
                used = {e[0] for e in ref if e[2] > 0}
                drawn = [e[0] for e in chosen[len(fresh):]]
                assert len(set(drawn)) == len(drawn) == min(len(used), n - len(fresh)) and set(drawn) <= used
                names = {e[0] for e in chosen}
                for e in ref:
                    e[2] += e[0] in names
                ref = [e for e in ref if e[2] < max_reuse]
            elif op < 0.97:
                cap = rng.randrange(0, 12)
                pool.cap(cap)
                ref = ref[max(0, len(ref) - cap):]
            else:
                handed = pool.take_fresh()
                assert [(e[0], e[3]) for e in handed] == [(e[0], "h" + e[0][1:]) for e in ref if e[2] == 0]
                ref = [e for e in ref if e[2] > 0]
            live = [e for e in ref if e[2] < max_reuse]
            assert len(pool) == len(live)
            assert [(e[0], e[1], e[2]) for e in pool._entries.values()] == [tuple(e) for e in live]


def test_loop_replays_up_to_max_reuse_then_publishes_what_it_trained():
    """max_reuse 2: after the fresh data ran out the pool replays each trajectory once more (the replay
    sampler's draws, seeded), then nothing is trainable and, starved past the budget, the loop publishes."""
    events = []
    core = FakeCore(events)
    source = ListSource(["a", "b", "c", "d"], events)
    loop = TrainerLoop(core, _dc(max_reuse=2, publish_every=100, max_train_s=0.5), seed=3)
    t0 = time.time()
    summary = loop.run(source, FakeSink(events))
    assert time.time() - t0 < 10
    assert core.trained[:2] == [["a", "b"], ["c", "d"]]
    assert sorted(x for step in core.trained[2:] for x in step) == ["a", "b", "c", "d"]  # each replayed once
    assert core.fresh[:2] == [[True, True], [True, True]] and all(not any(f) for f in core.fresh[2:])
    assert summary["final_version"] == 1 and summary["num_fresh"] == 4
    assert events == [("commit", 4), ("publish", 1)]  # the lease ends before the version goes out


def test_warm_replay_fills_short_on_policy_batches_with_the_warm_start_text():
    """distill.warm_replay: after the warm start the rank keeps its text; an on-policy step with too little fresh data
    fills its batch with warm-start trajectories (not fresh, not in the pool's uses) instead of waiting for the source,
    and the fresh data still goes first. Off: the same run waits and trains only the on-policy data."""
    def run(replay: bool):
        events, records = [], []
        core = FakeCore(events)
        loop = TrainerLoop(core, _dc(batch_size=4, max_reuse=1, publish_every=100, max_train_s=0.6,
                                     warm_replay=replay, warm_start=True, warm_start_group_by_length=False),
                           seed=5, on_metrics=records.append)
        warm = [_traj(f"w{i}", 8) for i in range(8)]
        loop.warm_start(warm, FakeSink(events), train_s=30.0)
        warm_steps = core.global_step
        source = ListSource(["a", "b", "c", "d", "e"], events)
        summary = loop.run(source, FakeSink(events))
        return core, records, summary, warm_steps, loop

    core, records, summary, warm_steps, loop = run(True)
    steps = core.trained[warm_steps:]
    assert warm_steps == 2 and loop.warm_set and len(loop.warm_set) == 8
    assert steps[0] == ["a", "b", "c", "d"]  # a full batch of fresh data: no filler
    assert steps[1][0] == "e" and all(x.startswith("w") for x in steps[1][1:])  # fresh first, then warm-start text
    assert len(steps) > 5 and all(len(s) == 4 and all(x.startswith("w") for x in s) for s in steps[2:])
    assert core.fresh[warm_steps + 1] == [True, False, False, False]
    on_policy = [r for r in records if "train/warm_start" not in r and "train/loss" in r]
    assert [r["train/num_warm_replay"] for r in on_policy[:2]] == [0.0, 3.0]
    assert summary["num_warm_replayed"] == 3 + 4 * (len(steps) - 2) and summary["num_fresh"] == 5 + 8
    core, records, summary, warm_steps, loop = run(False)
    assert core.trained[warm_steps:] == [["a", "b", "c", "d"], ["e"]] and summary["num_warm_replayed"] == 0
    assert not loop.warm_set


def test_loop_skips_duplicates_and_counts_lost_trajectories():
    events, records = [], []
    core = FakeCore(events)
    source = ListSource(["a", "gone", "b", "a#again"], events, lost=("gone",))
    summary = TrainerLoop(core, _dc(num_versions=1), on_metrics=records.append).run(source, FakeSink(events))
    assert core.trained == [["a"], ["b"]]
    assert summary["num_lost"] == 1 and summary["num_duplicates_skipped"] == 1 and summary["final_version"] == 1
    assert records[-1]["train/num_lost_trajectories"] == 1.0


def test_loop_hands_back_a_prefetched_batch_when_stopped():
    """distill.prefetch: from the third step on, the next batch is requested before the step; stopped from
    outside during that step, the loop hands the prefetched batch back untrained and publishes nothing."""
    events = []
    core = FakeCore(events, stop_at=3)
    source = ListSource([f"t{i}" for i in range(10)], events)
    loop = TrainerLoop(core, _dc(prefetch=True, publish_every=100), should_stop=lambda: core.stop)
    summary = loop.run(source, FakeSink(events))
    assert core.trained == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"]]
    assert source.released == ["t6", "t7"] and source.queue[:2] == ["t6", "t7"]
    assert summary["final_version"] == 0 and not [e for e in events if e[0] == "publish"]


def test_directory_source_and_cli_name_what_is_wrong(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        DirectorySource(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trajectory files"):
        DirectorySource(tmp_path / "empty")
    d = _spill_dir(tmp_path, 2)
    pq.write_table(pa.table({"x": [1, 2]}), d / "foreign.parquet")
    with pytest.raises(ValueError, match="foreign.parquet.*without trajectory metadata"):
        DirectorySource(d)
    (d / "foreign.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(ValueError, match="foreign.parquet: not a Parquet file"):
        DirectorySource(d)
    assert main(["--trajectories", str(tmp_path / "nowhere"), "--recipe", "recipes/cpu_tiny.yaml",
                 "--out", str(tmp_path / "o")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["--trajectories", str(d), "--recipe", "recipes/cpu_tiny.yaml", "--set", "distill.bogus=1",
                 "--out", str(tmp_path / "o")]) == 2
    assert "distill.bogus" in capsys.readouterr().err


def test_checkpoint_sink_writes_the_published_tensors(tmp_path):
    tensors = {"fc.weight": torch.randn(4, 8)}
    from adaflash_ray.models.drafter import DrafterModelConfig

    cfg = DrafterModelConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=4, vocab_size=32, block_size=4,
                             target_layer_ids=[0], target_hidden_size=8, num_target_layers=2,
                             mask_token_id=3).as_dict()
    reports, extra = CheckpointSink(tmp_path).publish(3, 2, 30, tensors, tensors_sha256(tensors), cfg)
    _, back, meta = load_drafter_checkpoint(tmp_path / "v3")
    assert reports[0]["sha256"] == tensors_sha256(tensors) == tensors_sha256(back)
    assert meta["version"] == "3" and meta["train_step"] == "30" and extra["sync/write_s"] >= 0


@pytest.mark.slow
def test_generate_then_train_from_files_without_ray(tmp_path):
    """The offline commands end to end in one process that never imports Ray: the engine writes trajectory
    files, the loop trains the real DeepSpeed core on them and writes a checkpoint per version whose sha256
    is what the loop published."""
    script = f"""
import json, sys
from adaflash_ray.distill.loop import main
assert main(["generate", "--recipe", "recipes/cpu_tiny.yaml", "--prompts", "6", "--out", {str(tmp_path / 't')!r},
             "--set", "engine.max_new_tokens=16"]) == 0
assert main(["--trajectories", {str(tmp_path / 't')!r}, "--recipe", "recipes/cpu_tiny.yaml",
             "--out", {str(tmp_path / 'o')!r}, "--set", "distill.batch_size=2", "--set", "distill.num_versions=2"]) == 0
assert "ray" not in sys.modules, "the offline loop imported ray"
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    files = sorted((tmp_path / "t").glob("*.parquet"))
    assert len(files) >= 4 and summary["num_files"] == len(files)
    assert summary["final_version"] == 2 and summary["train_steps"] >= 2 and set(summary["versions"]) == {"1", "2"}
    assert summary["versions"]["1"]["steps"] == 2 and summary["versions"]["1"]["positions_per_s"] > 0
    records = [json.loads(ln) for ln in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    for v in (1, 2):
        _, tensors, meta = load_drafter_checkpoint(tmp_path / "o" / "checkpoints" / f"v{v}")
        assert meta["version"] == str(v)
        pub = next(m for m in records if m.get("sync/version") == v)
        assert pub["sync/num_workers_ok"] == 1.0
    assert (tmp_path / "o" / "checkpoints" / "v0" / "model.safetensors").is_file()


@pytest.mark.slow
def test_generate_time_limit_counts_setup_and_starts_nothing_after_it(tmp_path):
    """generate's time limit counts from the call's start, setup included: a limit the setup alone outlasts starts
    no request (no file, no error); a limit <= 0 is refused with the option's name; without one every prompt is
    decoded and written."""
    from adaflash_ray.config import load_recipe
    from adaflash_ray.distill.loop import generate_files

    cfg = load_recipe("recipes/cpu_tiny.yaml", ["engine.max_new_tokens=4"])
    assert generate_files(cfg, 3, tmp_path / "cut", time_limit_s=1e-6) == []
    assert not list((tmp_path / "cut").glob("*.parquet"))
    with pytest.raises(ValueError, match="--time-limit-s"):
        generate_files(cfg, 3, tmp_path / "bad", time_limit_s=0)
    files = generate_files(cfg, 3, tmp_path / "all", time_limit_s=600)
    assert len(files) == 3 and all(f.is_file() for f in files)
    # two shards into one directory: the same three prompts between them, each decoded once
    from adaflash_ray.distill.spill import read_parquet

    shards = [generate_files(cfg, 3, tmp_path / "shards", shard=(i, 2)) for i in range(2)]
    assert [len(f) for f in shards] == [2, 1]
    def prompts_of(fs):
        return sorted(tuple(t.token_ids[:t.prompt_len].tolist()) for t in map(read_parquet, fs))
    assert prompts_of(shards[0] + shards[1]) == prompts_of(files)
    with pytest.raises(ValueError, match="--shard"):
        generate_files(cfg, 3, tmp_path / "bad", shard=(2, 2))


@pytest.mark.slow
def test_registry_tells_the_buffer_each_version_once_every_worker_loaded():
    """The loop's sink on Ray: the WeightRegistry, not the trainer, tells the TrajectoryBuffer the new version
    after the push (trajectories now too stale are dropped there) and records publish -> loaded seconds; a
    version that does not rise is refused by the one version rule."""
    import ray

    from adaflash_ray.actors import TrajectoryBuffer, WeightRegistry

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    try:
        buf = TrajectoryBuffer.remote(capacity=8, max_version_lag=0)
        registry = WeightRegistry.remote(buffer=buf)
        ray.get(buf.add.remote([ray.put(_traj("old"))], version=0, num_tokens=12))
        tensors = {"w": torch.ones(3)}
        assert ray.get(registry.publish.remote(version=1, parent_version=0, train_step=2,
                                               tensors_ref=[ray.put(tensors)], sha256=tensors_sha256(tensors))) == []
        s = ray.get(buf.stats.remote())
        assert s["buffer/latest_version"] == 1.0 and s["buffer/dropped_stale"] == 1.0 and s["buffer/depth"] == 0
        assert ray.get(registry.get_history.remote())[0]["broadcast_s"] >= 0
        with pytest.raises(ray.exceptions.RayTaskError, match="version 1 is not newer than the latest 1"):
            ray.get(registry.publish.remote(version=1, parent_version=0, train_step=3,
                                            tensors_ref=[ray.put(tensors)], sha256=tensors_sha256(tensors)))
    finally:
        ray.shutdown()


def test_directory_source_reads_ahead_in_threads_the_same_trajectories(tmp_path):
    """Read-ahead hands out exactly what synchronous reads give, in the same order; a released file is read again
    when handed out again; at most ``read_ahead`` files are read beyond the lease; a corrupt file raises at resolve."""
    d = _spill_dir(tmp_path, 7)
    sync, ahead = DirectorySource(d, read_ahead=0), DirectorySource(d, read_ahead=3, num_threads=2)
    assert len(ahead._reads) == 3 and not sync._reads
    got, want = [], []
    for n in (2, 3):
        items = ahead.get_batch(n)
        assert len(ahead._reads) <= 3 + n
        got += ahead.resolve([h for h, _ in items])
        want += sync.resolve([h for h, _ in sync.get_batch(n)])
    assert [t.request_id for t in got] == [t.request_id for t in want] == [f"r{i}" for i in range(5)]
    assert all(torch.equal(a.token_ids, b.token_ids) and a.prompt_len == b.prompt_len for a, b in zip(got, want))
    items = ahead.get_batch(2)
    ahead.release([items[1][0]])  # the last file back: first in line again, read again
    again = ahead.get_batch(5)
    assert [p.name for p, _ in again] == [items[1][0].name]
    assert ahead.resolve([again[0][0]])[0].request_id == "r6" and ahead.exhausted()
    assert ahead.read_s >= 0 and ahead._pool is None  # exhausted: the reader threads are stopped
    bad = DirectorySource(d, read_ahead=4)
    first = bad.get_batch(1)[0][0]
    bad._reads.pop(first).result()
    first.write_bytes(b"PAR1 truncated")
    with pytest.raises(ValueError, match=first.name):
        bad.resolve([first])
    bad.close()
    with pytest.raises(ValueError):
        DirectorySource(d, read_ahead=-1)


def test_engine_generate_refills_in_groups_and_reports_each_finish():
    """SpecEngine.generate with admit_min: the same greedy outputs as one-by-one refills, every request passed to
    on_finish once as it finishes, a per-prompt SamplingParams list, and bad arguments refused."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import make_tiny_target

    from adaflash_ray.engine import SamplingParams, SpecEngine, Status

    torch.manual_seed(0)
    target = make_tiny_target("llama")
    prompts = [torch.randint(1, 128, (int(n),)).tolist() for n in torch.randint(2, 12, (13,))]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in torch.randint(2, 14, (13,))]
    runs = []
    for admit_min in (1, 3):
        engine = SpecEngine(target, None, None, layer_ids=[1, 2], max_batch_size=4, max_seq_len=64)
        finished = []
        reqs = engine.generate(prompts, params, mode="ar", admit_min=admit_min,
                               on_finish=lambda r: finished.append((r.request_id, r.status)))
        assert all(r.status == Status.FINISHED for r in reqs) and not engine.has_unfinished()
        assert sorted(i for i, _ in finished) == sorted(r.request_id for r in reqs)
        assert all(s == Status.FINISHED for _, s in finished)
        assert [len(r.output_ids) for r in reqs] == [p.max_new_tokens for p in params]
        runs.append([r.output_ids for r in reqs])
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="admit_min"):
        engine.generate(prompts, params, mode="ar", admit_min=0)
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate(prompts, params[:3], mode="ar")


def test_ablation_keeps_going_past_a_failed_variant_skips_at_the_deadline_and_reuses_v0(tmp_path, monkeypatch):
    """run_ablation with fake training processes and a fake evaluation: a variant whose training exits non-zero is
    recorded with its error and the next one runs; a variant that no longer fits before ``stop_at`` is recorded as
    skipped; identical v0 checkpoints are decoded once; ablation.json holds every variant; the first optimizer step
    is left out of the training seconds."""
    from adaflash_ray.config import load_recipe
    from adaflash_ray.distill import ablate
    from adaflash_ray.models import save_drafter_checkpoint
    from adaflash_ray.models.drafter import DrafterModelConfig

    clock = {"now": 1000.0}
    monkeypatch.setattr(ablate.time, "time", lambda: clock["now"])
    dcfg = DrafterModelConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=4, vocab_size=32, block_size=4, target_layer_ids=[0],
                              target_hidden_size=8, num_target_layers=2, mask_token_id=3)
    v0 = {"fc.weight": torch.zeros(4, 8)}

    def fake_run(cmd, timeout=None):
        out = Path(cmd[cmd.index("--out") + 1])
        clock["now"] += 50.0
        if out.name == "broken":
            return subprocess.CompletedProcess(cmd, 1)
        save_drafter_checkpoint(out / "checkpoints" / "v0", dcfg, v0, {"version": 0})
        save_drafter_checkpoint(out / "checkpoints" / "v1", dcfg, {"fc.weight": torch.rand(4, 8)}, {"version": 1})
        steps = [{"train/seconds": 9.0}, {"train/seconds": 1.0}, {"train/seconds": 2.0, "sync/version": 1}]
        (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
        (out / "summary.json").write_text(json.dumps({"train_steps": 3, "num_trained": 5, "versions": {}}))
        return subprocess.CompletedProcess(cmd, 0)

    decoded = []

    def fake_eval(engine, ckpt, version, prompts, domains, max_new_tokens):
        decoded.append(str(ckpt))
        return {"code": 1.0 + version}, [{"output_ids": [1, 2], "draft_lens": [1], "num_accepted": [0]}]

    monkeypatch.setattr(ablate.subprocess, "run", fake_run)
    monkeypatch.setattr(ablate, "_heldout", lambda cfg: ([[1, 2, 3]], ["code"]))
    monkeypatch.setattr(ablate, "evaluate_checkpoint", fake_eval)
    monkeypatch.setattr("adaflash_ray.engine.SpecEngine.from_config", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr("adaflash_ray.drafting.heldout.lookup_baselines", lambda *a, **k: {"ngram": {"code": 2.0}})
    cfg = load_recipe("recipes/cpu_tiny.yaml")
    doc = ablate.run_ablation(cfg, [("a", []), ("broken", ["distill.lr=1e-3"]), ("b", ["distill.batch_size=2"]),
                                    ("late", [])], tmp_path / "traj", tmp_path / "abl", train_s=10.0,
                              recipe_path="recipes/cpu_tiny.yaml", stop_at=1000.0 + 160.0, overhead_s=5.0,
                              warmup_steps=0)
    v = doc["variants"]
    assert "warmup" not in doc
    assert v["broken"]["error"].startswith("training failed (exit 1)") and v["late"] == {"sets": [], "skipped": "deadline"}
    assert v["a"]["versions"][1]["tau_by_domain"] == {"code": 2.0} and v["b"]["versions"][0]["tau_by_domain"] == {"code": 1.0}
    assert v["a"]["versions"][1]["train_s"] == 3.0  # 1 + 2: the first step's 9 s left out
    assert sorted(Path(p).parts[-3] + "/" + Path(p).name for p in decoded) == ["a/v0", "a/v1", "b/v1"]
    assert json.loads((tmp_path / "abl" / "ablation.json").read_text())["variants"].keys() == v.keys()


def test_ablation_warms_up_with_the_first_variant_before_the_timed_ones(tmp_path, monkeypatch):
    """run_ablation's warm-up: one untimed training of the first variant's overrides, stopped after
    ``warmup_steps`` optimizer steps (one version), runs before every timed variant; it is recorded under
    ``warmup``, its directory removed, and it is no variant (not evaluated, not in ``variants``)."""
    from adaflash_ray.config import load_recipe
    from adaflash_ray.distill import ablate

    cmds = []

    def fake_run(cmd, timeout=None):
        out = Path(cmd[cmd.index("--out") + 1])
        cmds.append((out.name, [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]))
        if out.name != "_warmup":
            return subprocess.CompletedProcess(cmd, 1)  # the timed variants fail: only the order matters here
        (out / "checkpoints").mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({"train_steps": 3}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ablate.subprocess, "run", fake_run)
    monkeypatch.setattr(ablate, "_heldout", lambda cfg: ([[1, 2, 3]], ["code"]))
    cfg = load_recipe("recipes/cpu_tiny.yaml")
    doc = ablate.run_ablation(cfg, [("a", ["distill.lr=1e-3"]), ("b", [])], tmp_path / "traj", tmp_path / "abl",
                              train_s=10.0, recipe_path="recipes/cpu_tiny.yaml", base_sets=["distill.max_reuse=4"],
                              warmup_steps=3)
    assert [name for name, _ in cmds] == ["_warmup", "a", "b"]
    assert cmds[0][1] == ["distill.max_reuse=4", "distill.lr=1e-3", "distill.max_train_s=10.0", "distill.num_versions=1",
                          "distill.publish_every=3"]
    assert cmds[1][1] == ["distill.max_reuse=4", "distill.lr=1e-3", "distill.max_train_s=10.0"]
    assert doc["warmup"]["steps"] == 3 and doc["warmup"]["error"] is None
    assert doc["warmup"]["sets"] == cmds[0][1][1:]
    assert not (tmp_path / "abl" / "_warmup").exists() and set(doc["variants"]) == {"a", "b"}
    assert json.loads((tmp_path / "abl" / "ablation.json").read_text())["warmup"] == doc["warmup"]


def test_engine_generate_stop_admitting_ends_without_starting_the_rest():
    """stop_admitting: once it says so, the requests not yet started end as aborted with no output; the started
    ones finish whole; generate returns."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import make_tiny_target

    from adaflash_ray.engine import SamplingParams, SpecEngine, Status

    engine = SpecEngine(make_tiny_target("llama"), None, None, layer_ids=[1, 2], max_batch_size=2, max_seq_len=64)
    steps = {"n": 0}

    def on_step(eng):
        steps["n"] += 1

    reqs = engine.generate([[1, 2, 3]] * 7, SamplingParams(max_new_tokens=5, ignore_eos=True), mode="ar",
                           on_step=on_step, stop_admitting=lambda: steps["n"] >= 3)
    assert all(r.status == Status.FINISHED for r in reqs) and not engine.has_unfinished()
    started = [r for r in reqs if r.output_ids]
    assert len(started) == 2 and all(len(r.output_ids) == 5 for r in started)
    assert all(r.finish_reason == "abort" and not r.output_ids for r in reqs if r not in started)
