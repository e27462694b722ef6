"""The trainer loop of on-policy distillation, without Ray: replay pool, leases, prefetch, publish cadence, time
budget - with the trajectory source and the weight sink injected (torchtitan's habit: the loop runs on one
process with fakes; the Ray actor ``actors/distill_trainer.py`` is a thin adapter over it).

The same loop trains from a directory of trajectory files (the Parquet records ``TrajectoryBuffer`` spills,
:mod:`adaflash_ray.distill.spill`) and writes ``checkpoints/v<N>`` - the offline warm start and the ablation
harness - and a second command writes such a directory from the built-in engine, also without Ray::

    python -m adaflash_ray.distill.loop generate --recipe recipes/cpu_tiny.yaml --prompts 16 --out traj/
    python -m adaflash_ray.distill.loop --trajectories traj/ --recipe recipes/cpu_tiny.yaml --out run/ \\
        [--set distill.num_versions=2] [--set distill.publish_every=4]

The train command prints one line per published version (steps, mean loss, positions/s, top-1 agreement per
block position) and, last, one JSON object (``out``, ``final_version``, ``train_steps``, ``versions``).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import random
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from adaflash_ray.models import tensors_sha256
from adaflash_ray.trajectory import Trajectory, within_version_lag

__all__ = ["TrajectorySource", "WeightSink", "ReplayPool", "TrainerLoop", "DirectorySource", "MemorySource",
           "CheckpointSink", "length_grouped", "version_table", "decode_for_training", "train_from_files",
           "generate_files", "main"]

Item = tuple  # (handle, version): a leased trajectory as the source names it, and the drafter version it carries


class PendingBatch(Protocol):
    def result(self) -> list[Item]: ...


class TrajectorySource(Protocol):
    """Where the loop's trajectories come from, leased to this trainer rank until it commits.

    ``get_batch`` / ``prefetch`` hand out up to ``n`` items ``(handle, version)``, oldest first (fewer when
    ``wait_s`` seconds pass first); ``resolve`` turns handles into :class:`Trajectory` objects (None for one
    that is gone, e.g. its producer died); ``release`` hands back, untrained, leased items (first in line
    again); ``commit`` ends the lease of everything handed out (the trainer state with it trained in is
    saved); ``set_version`` is told each version this rank published; ``exhausted`` is True once nothing more
    will ever arrive (a live buffer: never)."""

    def get_batch(self, n: int, wait_s: float) -> list[Item]: ...
    def prefetch(self, n: int, wait_s: float) -> PendingBatch: ...
    def resolve(self, handles: Sequence) -> list[Trajectory | None]: ...
    def release(self, handles: Sequence) -> None: ...
    def commit(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def exhausted(self) -> bool: ...


class WeightSink(Protocol):
    """Where published versions go (rank 0 only). ``publish`` returns the receivers' reports (each
    ``{"sha256": ..., "fallback": bool?}`` or ``{"error": ...}``) and extra ``sync/*`` metrics; ``close`` ends
    it after the last version."""

    def publish(self, version: int, parent_version: int, step: int, tensors: dict[str, torch.Tensor],
                sha256: str, config: dict) -> tuple[list[dict], dict[str, float]]: ...
    def close(self) -> None: ...


class ReplayPool:
    """The trainer's replay pool: leased trajectories not yet trained (``fresh``) and trained ones kept for reuse,
    each entry ``[trajectory, version, uses, handle]``, in order of arrival. A step's operations cost O(batch), not
    O(pool) - but the first :meth:`prune` after a version change, which scans the pool once: the warm start pools its
    whole set (tens of thousands of trajectories), and a scan per step would cost milliseconds of host time between
    optimizer steps.

    Rules (those of :meth:`TrainerLoop.run`): an entry leaves once trained ``max_reuse`` times, or once its version
    lag exceeds ``max_version_lag`` (:func:`~adaflash_ray.trajectory.within_version_lag`, checked by :meth:`prune`);
    :meth:`choose` takes the fresh entries first, oldest first, then draws uniformly without replacement among the
    trained ones; :meth:`cap` drops the oldest arrivals beyond ``capacity``.

    Args:
        max_reuse: the uses after which an entry leaves (>= 1).
        max_version_lag: the staleness rule's bound (drafter versions).
    """

    def __init__(self, max_reuse: int, max_version_lag: int):
        self.max_reuse, self.max_version_lag = max_reuse, max_version_lag
        self._entries: dict[int, list] = {}  # arrival seq -> entry; a dict keeps the order of arrival
        self._fresh: collections.deque[int] = collections.deque()  # seqs never trained, oldest first (may be stale)
        self._used: list[int] = []  # seqs trained 1 .. max_reuse-1 times (any order: drawn at random)
        self._used_at: dict[int, int] = {}  # seq -> its index in _used (O(1) removal)
        self._unchecked: list[int] = []  # seqs added since the last prune (their lag not yet checked)
        self._pruned_version: int | None = None
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, trajectory, version: int, handle) -> None:
        """A newly leased trajectory, never trained."""
        seq, self._next = self._next, self._next + 1
        self._entries[seq] = [trajectory, version, 0, handle]
        self._fresh.append(seq)
        self._unchecked.append(seq)

    def _remove(self, seq: int) -> list:
        e = self._entries.pop(seq)
        if seq in self._used_at:  # swap-remove from the trained ones; a fresh seq is skipped where it is read
            i, last = self._used_at.pop(seq), self._used.pop()
            if last != seq:
                self._used[i], self._used_at[last] = last, i
        return e

    def prune(self, latest_version: int) -> None:
        """Drop the entries past the version lag at ``latest_version``: all of them when the version changed
        since the last prune, else only those added since."""
        if latest_version != self._pruned_version:
            seqs, self._pruned_version = list(self._entries), latest_version
        else:
            seqs = [q for q in self._unchecked if q in self._entries]
        self._unchecked = []
        for q in seqs:
            if not within_version_lag(latest_version, self._entries[q][1], self.max_version_lag):
                self._remove(q)

    def choose(self, n: int, rng: random.Random) -> list[list]:
        """Up to ``n`` entries for one step - fresh ones first, oldest first, then trained ones drawn with ``rng``
        - each counted as used once more (an entry used ``max_reuse`` times leaves the pool)."""
        chosen = []
        while self._fresh and len(chosen) < n:
            q = self._fresh.popleft()
            if q in self._entries and self._entries[q][2] == 0:
                chosen.append(q)
        drawn = rng.sample(self._used, min(len(self._used), n - len(chosen)))
        out = []
        for q in chosen + drawn:
            e = self._entries[q]
            e[2] += 1
            out.append(e)
            if e[2] >= self.max_reuse:
                self._remove(q)
            elif q not in self._used_at:
                self._used_at[q] = len(self._used)
                self._used.append(q)
        return out

    def cap(self, capacity: int) -> None:
        """Keep the ``capacity`` latest arrivals."""
        for q in list(itertools.islice(iter(self._entries), max(0, len(self._entries) - capacity))):
            self._remove(q)

    def take_fresh(self) -> list[list]:
        """Remove and return the entries never trained (e.g. to hand their leases back), oldest first."""
        out = [self._remove(q) for q in self._fresh if q in self._entries and self._entries[q][2] == 0]
        self._fresh.clear()
        return out


class TrainerLoop:
    """One trainer rank's loop over a built :class:`~adaflash_ray.distill.trainer.DistillTrainerCore`.

    Args:
        core: the rank's core (``train_step``, ``all_ranks``, ``save_state``, ``publish_tensors``, ``global_step``,
            ``close``, ``drafter_model_config``).
        distill_cfg: ``DistillConfig`` (``batch_size``, ``max_reuse``, ``max_version_lag``, ``publish_every``,
            ``num_versions``, ``max_train_s`` in seconds or None, ``prefetch``).
        seed: the run seed (the replay sampler draws from ``Random(seed + rank + 7919 * version)``).
        rank: this rank; rank 0 publishes.
        serving_dtype: the dtype published tensors are cast to (the workers' ``model.dtype``).
        state_dir: where the trainer state is saved with every version (before it is published), or None.
        state: the client state of a resumed trainer state (``version``, ``fresh_ids``, ``num_lost``), or None.
        on_metrics: called with every flat metric dict (one per optimizer step, plus a publish-only one when a
            starved rank publishes at its time budget or at the end of its data).
        should_stop: polled between steps; True stops every rank after the current step.
    """

    def __init__(self, core, distill_cfg, *, seed: int = 0, rank: int = 0, serving_dtype=torch.float32,
                 state_dir: str | None = None, state: dict | None = None,
                 on_metrics: Callable[[dict], None] | None = None, should_stop: Callable[[], bool] | None = None):
        self.core, self.dc, self.seed, self.rank = core, distill_cfg, seed, rank
        self.serving_dtype, self.state_dir = serving_dtype, state_dir
        state = state or {}
        self.version = int(state.get("version", 0))
        self.fresh_ids: list[str] = list(state.get("fresh_ids", []))  # first trained on in a saved state
        self.num_lost = int(state.get("num_lost", 0))  # trajectories whose producer died before they were fetched
        self.num_duplicates_skipped = 0  # trajectories delivered again (a recovered buffer) and not retrained
        self.warm_set: list[Trajectory] = []  # this rank's warm-start text, kept for distill.warm_replay
        self.num_warm_replayed = 0  # warm-start trajectories that filled on-policy batches (distill.warm_replay)
        self._on_metrics = on_metrics or (lambda m: None)
        self._should_stop = should_stop or (lambda: False)

    def serving_tensors(self) -> dict[str, torch.Tensor]:
        """The drafter (+ head) as the workers will hold it: the float32 master weights cast to the serving
        dtype, so the published checksum names exactly what a faithful load holds. Every rank calls it
        (under ZeRO-3 a collective gather)."""
        return {k: v.to(self.serving_dtype) for k, v in self.core.publish_tensors().items()}

    def run(self, source: TrajectorySource, sink: WeightSink, num_versions: int | None = None,
            close: bool = True, replay_pool: int | None = None) -> dict:
        """Train until ``num_versions`` (default ``distill.num_versions``) versions are published, the time
        budget ``distill.max_train_s`` (from the first step) is spent, ``should_stop`` says so, or ``source``
        is exhausted; then hand back what was leased untrained and (``close``) close ``sink`` and the core
        (``close=False``: a stage before another ``run``, e.g. :meth:`warm_start`). Returns
        ``{rank, final_version, steps, seconds, num_fresh, num_counted_twice, num_lost, num_duplicates_skipped,
        num_warm_replayed}`` - trajectories first trained on over the whole run (resumes included) and those among
        them trained as fresh more than once (0 unless a resume replayed one).

        ``replay_pool``: the most trajectories the replay pool keeps (the most recent ones; each is replayed until
        trained ``distill.max_reuse`` times). None = ``distill.replay_pool``, else 4 x ``batch_size`` x
        ``max_reuse``: on-policy data keeps coming, and the pool then holds the latest few steps' worth. A stage
        that trains on a fixed set (:meth:`warm_start`) passes the set's size, so every trajectory is replayed
        ``max_reuse`` times in all, not only the last few batches' worth once the set is exhausted.

        With ``distill.warm_replay`` and a kept warm-start set (:attr:`warm_set`, from :meth:`warm_start`), a step
        whose pool cannot fill a batch does not wait for ``source``: it waits at most 0.05 s (or its prefetch) and
        fills the rest of the batch with warm-start trajectories drawn at random (not fresh, not counted in the
        pool's uses; ``train/num_warm_replay`` per step, ``num_warm_replayed`` in the summary). Not while
        ``source`` is exhausted: a finite source still ends the run."""
        dc, core = self.dc, self.core
        num_versions = num_versions or dc.num_versions
        cfg_dict = core.drafter_model_config().as_dict()
        t_start = time.time()
        pool_cap = replay_pool or getattr(dc, "replay_pool", None) or 4 * dc.batch_size * dc.max_reuse
        pool = ReplayPool(dc.max_reuse, dc.max_version_lag)  # leased on-policy data, and recent data for reuse
        pending_ids: list[str] = []  # first trained since the last save
        rng = random.Random(self.seed + self.rank + 7919 * self.version)
        seen = set(self.fresh_ids)
        t_first_step: float | None = None  # distill.max_train_s counts from here
        time_up = False
        prefetched: PendingBatch | None = None  # a batch requested before the last step (distill.prefetch)
        step_times: list[float] = []  # recent optimizer-step seconds (the first, with warm-up, left out)
        published_step = core.global_step  # the step of the last publication (or of the resumed state)

        def hand_back_untrained() -> None:
            """Before a commit: what this rank holds leased but never trained goes back to the source."""
            unused = pool.take_fresh()
            if unused:
                source.release([p[3] for p in unused])
                seen.difference_update(p[0].request_id for p in unused)  # a redelivery is then new to it

        warm = self.warm_set if getattr(dc, "warm_replay", False) else []
        if getattr(dc, "warm_replay", False) and not warm and self.rank == 0:  # e.g. resumed past the warm start
            print(f"[rank {self.rank}] distill.warm_replay: no warm-start text kept (a resumed run skips the warm "
                  "start), so short on-policy batches wait for data", flush=True)
        while not time_up and core.all_ranks(self.version < num_versions and not self._should_stop()):
            pool.prune(self.version)
            replay = bool(warm) and not source.exhausted()  # may fill a short batch with warm-start text
            wait_s = 60.0  # for a batch when no step is possible without one
            if dc.max_train_s is not None and t_first_step is not None:  # a starved trainer still times out
                wait_s = max(0.0, min(wait_s, dc.max_train_s - (time.time() - t_first_step)))
            if prefetched is not None:  # it waited while the last step computed
                items, prefetched = list(prefetched.result()), None
                if len(pool) + len(items) < dc.batch_size and not replay:  # no step possible yet: wait for the rest
                    items += source.get_batch(dc.batch_size - len(items), wait_s)
            else:
                reusable = len(pool) >= dc.batch_size
                items = list(source.get_batch(dc.batch_size, min(0.2 if reusable else 0.05, wait_s)
                                              if reusable or replay else wait_s))
            fresh, items = self._resolve(source, items)
            keep = [i for i, t in enumerate(fresh) if t.request_id not in seen]  # a redelivery it already has
            self.num_duplicates_skipped += len(fresh) - len(keep)
            fresh, items = [fresh[i] for i in keep], [items[i] for i in keep]
            seen.update(t.request_id for t in fresh)
            for t, it in zip(fresh, items):
                pool.add(t, it[1], it[0])
            if not core.all_ranks(len(pool) >= dc.batch_size or bool(fresh) or replay):
                timed_out = (dc.max_train_s is not None and t_first_step is not None
                             and not core.all_ranks(time.time() - t_first_step < dc.max_train_s))
                if timed_out or core.all_ranks(source.exhausted()):
                    # starved past the budget, or no data will ever come: publish what was trained since the
                    # last version, then stop
                    time_up = True
                    hand_back_untrained()
                    if core.global_step > published_step:
                        m = {"train/step": float(core.global_step)}
                        self._publish(source, sink, m, pending_ids, core.global_step, cfg_dict,
                                      "train/time_up" if timed_out else "train/out_of_data")
                        pending_ids = []
                        self._on_metrics(m)
                continue  # some rank has nothing to train on yet: every rank waits for data
            # what was never trained first (oldest first), then replays of recent data
            chosen = pool.choose(dc.batch_size, rng)
            pending_ids.extend(p[0].request_id for p in chosen if p[2] == 1)
            filler = rng.sample(warm, min(len(warm), dc.batch_size - len(chosen))) if replay else []
            self.num_warm_replayed += len(filler)
            trajs = [p[0] for p in chosen] + filler
            versions = [p[1] for p in chosen]
            del fresh
            pool.cap(pool_cap)
            recent_s = min(step_times[-5:]) if step_times else 0.0
            if dc.prefetch and recent_s > 0 and not self._may_publish_next(t_first_step, recent_s):
                # the next batch gathers in the source during this step (returns by the step's end)
                prefetched = source.prefetch(dc.batch_size, 0.9 * recent_s)
            m = core.train_step(trajs, fresh=[p[2] == 1 for p in chosen] + [False] * len(filler))
            if t_first_step is not None:
                step_times = step_times[-4:] + [m["train/seconds"]]
            t_first_step = t_first_step or time.time() - m["train/seconds"]
            if dc.max_train_s is not None:  # every rank stops together once any rank's budget is spent
                time_up = not core.all_ranks(time.time() - t_first_step < dc.max_train_s)
            if prefetched is not None and (time_up or self._should_stop()):  # sooner than foreseen: hand it back
                source.release([it[0] for it in prefetched.result()])
                prefetched = None
            if versions:  # a batch of warm-start filler only has no on-policy lag to report
                m["train/version_lag"] = sum(self.version - v for v in versions) / len(versions)
            if replay:
                m["train/num_warm_replay"] = float(len(filler))
            m["train/version"] = float(self.version)
            m["train/num_fresh"] = float(sum(1 for p in chosen if p[2] == 1))
            m["train/num_lost_trajectories"] = float(self.num_lost)
            step = core.global_step
            if step % dc.publish_every == 0 or time_up:  # every rank counts versions; rank 0 publishes
                hand_back_untrained()
                self._publish(source, sink, m, pending_ids, step, cfg_dict, "train/time_up" if time_up else None)
                pending_ids, published_step = [], step
            self._on_metrics(m)
        if prefetched is not None:  # stopped from outside after it was issued
            source.release([it[0] for it in prefetched.result()])
        hand_back_untrained()  # stopped (or out of data) with leased trajectories never trained
        if close:
            sink.close()
            core.close()  # ends the process group, removes the rendezvous file
        return {"rank": self.rank, "final_version": self.version, "steps": core.global_step,
                "seconds": time.time() - t_start, "num_fresh": len(self.fresh_ids),
                "num_counted_twice": len(self.fresh_ids) - len(set(self.fresh_ids)), "num_lost": self.num_lost,
                "num_duplicates_skipped": self.num_duplicates_skipped, "num_warm_replayed": self.num_warm_replayed}

    def warm_start(self, trajectories: list[Trajectory] | StreamSource, sink: WeightSink, train_s: float,
                   pool_size: int | None = None) -> dict:
        """The offline warm start: train on ``trajectories`` (target text, e.g. :func:`decode_for_training`'s)
        for ``train_s`` seconds of optimizer steps (or until they are used ``distill.max_reuse`` times each) and
        publish the result as the next version - version 1 on a fresh run - without closing ``sink`` or the core
        (the on-policy :meth:`run` follows). Every rank calls it with its own share. ``trajectories`` may be a
        :class:`StreamSource` (the streaming warm start: text that arrives while it trains; ``train_s`` counts from the
        first step; ``pool_size``: about how many will arrive, so all of them stay in the replay pool). Each metric
        dict carries ``train/warm_start = 1``; the publication's ``train/time_up`` / ``train/out_of_data`` marker is
        dropped (it ends the stage, not the run). Returns :meth:`run`'s summary.
        Raises:
            ValueError: ``train_s`` <= 0 or no trajectories (an empty list, or a stream that ended before any
                step)."""
        stream = isinstance(trajectories, StreamSource)
        if not train_s > 0 or (not stream and not trajectories):
            raise ValueError(f"warm start needs train_s > 0 and trajectories, got {train_s}, "
                             f"{'a stream' if stream else len(trajectories)}")
        dc, on_metrics = self.dc, self._on_metrics

        def tagged(m: dict) -> None:
            m.pop("train/time_up", None)
            m.pop("train/out_of_data", None)
            m["train/warm_start"] = 1.0
            on_metrics(m)

        self.dc = dc.model_copy(update={"max_train_s": train_s, "publish_every": 1 << 30, "prefetch": False,
                                        "warm_replay": False})
        self._on_metrics = tagged
        if not stream and getattr(dc, "warm_start_group_by_length", False):
            trajectories = length_grouped(trajectories, dc.batch_size, self.seed + self.rank)
        size = (pool_size or 0) if stream else len(trajectories)
        steps_before = self.core.global_step
        try:
            out = self.run(trajectories if stream else MemorySource(trajectories), sink,
                           num_versions=self.version + 1, close=False,
                           replay_pool=max(size, 4 * dc.batch_size * dc.max_reuse))
        finally:
            self.dc, self._on_metrics = dc, on_metrics
        if stream and self.core.global_step == steps_before:
            raise ValueError(f"warm start: the stream ended after {trajectories.num_fetched} trajectories "
                             "without one optimizer step")
        if getattr(dc, "warm_replay", False):  # kept for the on-policy stage's short batches
            self.warm_set = list(trajectories.trajectories if stream else trajectories)
        return out

    def _resolve(self, source: TrajectorySource, items: list) -> tuple[list[Trajectory], list]:
        """Trajectories of ``items``; one the source lost (its producer died) is skipped and counted."""
        fresh, kept = [], []
        for it, traj in zip(items, source.resolve([it[0] for it in items])):
            if traj is None:
                self.num_lost += 1
            else:
                fresh.append(traj)
                kept.append(it)
        return fresh, kept

    def _publish(self, source: TrajectorySource, sink: WeightSink, m: dict, pending_ids: list, step: int,
                 cfg_dict: dict, last: str | None) -> None:
        """Version v+1: save the state (with ``pending_ids``, the trajectories first trained since v), commit
        the lease, and (rank 0) publish to ``sink``, recording ``sync/*`` timings in ``m``; ``last`` names the
        metric (``train/time_up`` | ``train/out_of_data``) set to 1 when this is the last version. Every rank
        calls it (ZeRO-3 gathers the weights collectively)."""
        t0 = time.perf_counter()
        tensors = self.serving_tensors()  # every rank: under ZeRO-3 a collective gather
        new_version = self.version + 1
        self.fresh_ids += pending_ids
        if self.state_dir:  # saved before it is published: a resume never re-publishes a number
            self.core.save_state(self.state_dir, f"v{new_version}", {
                "version": new_version, "fresh_ids": self.fresh_ids, "num_lost": self.num_lost})
            m["sync/save_seconds"] = time.perf_counter() - t0
        source.commit()
        if self.rank == 0:
            sha = tensors_sha256(tensors)  # the one hash of this version on the publishing side
            t_pub = time.perf_counter()
            reports, extra = sink.publish(new_version, self.version, step, tensors, sha, cfg_dict)
            m.update(extra)
            m["sync/num_fallbacks"] = float(sum(1 for r in reports if r.get("fallback")))
            m["sync/publish_s"] = time.perf_counter() - t_pub  # the sink's push, up to every receiver loaded
            m["sync/num_workers_ok"] = float(sum(1 for r in reports if r.get("sha256") == sha))
            m["sync/num_workers"] = float(len(reports))
        m["sync/seconds"] = time.perf_counter() - t0
        self.version = new_version
        source.set_version(new_version)
        m["sync/version"] = float(self.version)
        if last is not None:
            m[last] = 1.0  # distill.max_train_s spent (or the data ran out): this was the last version

    def _may_publish_next(self, t_first_step: float | None, last_step_s: float) -> bool:
        """Whether the coming optimizer step may end in a publication (its step count, or a time budget that
        could run out within two steps): a batch prefetched before it would be leased at the commit untrained."""
        dc = self.dc
        if (self.core.global_step + 1) % dc.publish_every == 0 or self._should_stop():
            return True
        return (dc.max_train_s is not None and t_first_step is not None
                and time.time() - t_first_step + 2 * last_step_s >= dc.max_train_s)


# ---------------------------------------------------------------------- trajectory files, checkpoints
class _QueueSource:
    """Hands out the handles of a fixed collection once each, in order; released ones go back first in line;
    exhausted once all were handed out (the bookkeeping :class:`DirectorySource` and :class:`MemorySource`
    share). ``_changed`` is called after the queue changed."""

    def __init__(self, handles):
        from collections import deque

        self.queue = deque(handles)
        self.leased: list = []
        self.num_committed = 0
        self.version = 0

    def _changed(self) -> None:
        """Nothing by default."""

    def get_batch(self, n: int, wait_s: float = 0.0) -> list[Item]:
        out = []
        while self.queue and len(out) < n:
            h = self.queue.popleft()
            self.leased.append(h)
            out.append((h, self.version))
        self._changed()
        return out

    def prefetch(self, n: int, wait_s: float = 0.0) -> PendingBatch:
        done: Future = Future()
        done.set_result(self.get_batch(n, wait_s))
        return done

    def release(self, handles: Sequence) -> None:
        wanted = set(handles)
        back = [h for h in self.leased if h in wanted]
        self.leased = [h for h in self.leased if h not in wanted]
        self.queue.extendleft(reversed(back))  # first in line, in lease order
        self._changed()

    def commit(self) -> None:
        self.num_committed += len(self.leased)
        self.leased = []

    def set_version(self, version: int) -> None:
        self.version = version

    def exhausted(self) -> bool:
        return not self.queue


class DirectorySource(_QueueSource):
    """A :class:`TrajectorySource` over a directory of trajectory files (:func:`~adaflash_ray.distill.spill.
    trajectory_files`: ``<request_id>-v<version>.parquet``, the TrajectoryBuffer's journal format), each handed
    out once, in file-name order; released files go back first in line; exhausted once every file was handed out.

    Offline data has no version lag to the trainer: each item is reported at the version the loop last
    published (:meth:`set_version`), so the replay pool keeps it for ``distill.max_reuse`` uses as it keeps
    fresh on-policy data. Nothing is waited for (``wait_s`` is ignored): all the data is on disk.

    Reading ahead: the next ``read_ahead`` files in line are read and deserialised by ``num_threads`` background
    threads (Parquet decoding releases the GIL), so :meth:`resolve` finds them in memory and the trainer's step
    does not wait on the disk; ``read_ahead=0`` reads in :meth:`resolve` on the calling thread. At most
    ``read_ahead`` decoded trajectories are held beyond those leased (bounded memory with ``features: captured``,
    ~1.7 MB per 256-token SmolLM2 trajectory). :meth:`close` stops the threads (also at exhaustion).

    Raises:
        FileNotFoundError / ValueError: as :func:`~adaflash_ray.distill.spill.trajectory_files` (missing
            directory, no files, a foreign file); :meth:`resolve` raises ValueError naming a corrupt file;
            ValueError for ``read_ahead`` < 0 or ``num_threads`` < 1.
    """

    def __init__(self, directory: str | Path, *, read_ahead: int = 256, num_threads: int = 4):
        from concurrent.futures import ThreadPoolExecutor

        from adaflash_ray.distill.spill import trajectory_files

        if read_ahead < 0 or num_threads < 1:
            raise ValueError(f"read_ahead must be >= 0 and num_threads >= 1, got {read_ahead}, {num_threads}")
        self.directory = Path(directory)
        super().__init__(trajectory_files(self.directory))
        self.num_files = len(self.queue)
        self.read_ahead = read_ahead
        self.read_s = 0.0  # seconds resolve spent waiting for reads (or reading, read_ahead=0)
        self._reads: dict[Path, Future] = {}  # path -> its read, for files in line or leased and not yet resolved
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="traj-reader") if read_ahead else None
        self._fill()

    def _changed(self) -> None:
        self._fill()

    def _fill(self) -> None:
        """Start reading the first ``read_ahead`` files in line that are not read or being read."""
        if self._pool is None:
            return
        from itertools import islice

        from adaflash_ray.distill.spill import read_parquet

        for path in islice(self.queue, self.read_ahead):
            if path not in self._reads:
                self._reads[path] = self._pool.submit(read_parquet, path)

    def resolve(self, handles: Sequence) -> list[Trajectory]:
        from adaflash_ray.distill.spill import read_parquet

        t0 = time.perf_counter()
        out = []
        for p in handles:
            fut = self._reads.pop(p, None)
            out.append(fut.result() if fut is not None else read_parquet(p))
        self.read_s += time.perf_counter() - t0
        if not self.queue:
            self.close()
        return out

    def close(self) -> None:
        """Stop the reader threads (reads in flight finish; later resolves read on the calling thread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=False)
            self._pool = None


def length_grouped(trajectories: list[Trajectory], batch_size: int, seed: int = 0) -> list[Trajectory]:
    """``trajectories`` reordered so that each run of ``batch_size`` holds similar lengths (the HF Trainer's
    ``group_by_length``): sorted by token count, cut into groups of ``batch_size``, the groups in a seeded random
    order. A batch then pads little (its recompute and drafter shapes follow its longest row). Raises: ValueError for
    ``batch_size < 1``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    by_len = sorted(trajectories, key=lambda t: t.num_tokens)
    groups = [by_len[i:i + batch_size] for i in range(0, len(by_len), batch_size)]
    random.Random(seed).shuffle(groups)
    return [t for g in groups for t in g]


class MemorySource(_QueueSource):
    """A :class:`TrajectorySource` over trajectories in memory (the warm start's): each handed out once, in list
    order (handles are list indices); released ones go back first in line; exhausted once all were handed out."""

    def __init__(self, trajectories: list[Trajectory]):
        self.trajectories = list(trajectories)
        super().__init__(range(len(self.trajectories)))

    def resolve(self, handles: Sequence) -> list[Trajectory]:
        return [self.trajectories[i] for i in handles]


class StreamSource(_QueueSource):
    """A :class:`TrajectorySource` over trajectories that arrive while the loop trains (the streaming warm start):
    ``fetch(wait_s)`` returns ``(new trajectories, done)`` - waiting at most ``wait_s`` seconds for some - and is
    called whenever fewer than the requested items are queued and more may come; each trajectory is handed out once,
    in order of arrival (handles are indices); exhausted once ``fetch`` said done and all were handed out.
    ``num_fetched`` counts the trajectories received."""

    def __init__(self, fetch: Callable[[float], tuple[list[Trajectory], bool]]):
        self.fetch, self.done, self.trajectories = fetch, False, []
        super().__init__([])

    @property
    def num_fetched(self) -> int:
        return len(self.trajectories)

    def get_batch(self, n: int, wait_s: float = 0.0) -> list[Item]:
        if len(self.queue) < n and not self.done:
            new, self.done = self.fetch(0.0 if self.queue else wait_s)
            self.queue.extend(range(len(self.trajectories), len(self.trajectories) + len(new)))
            self.trajectories.extend(new)
        return super().get_batch(n, wait_s)

    def exhausted(self) -> bool:
        return self.done and not self.queue

    def resolve(self, handles: Sequence) -> list[Trajectory]:
        return [self.trajectories[i] for i in handles]


class CheckpointSink:
    """A :class:`WeightSink` writing each published version to ``<ckpt_dir>/v<N>`` (the DFlash checkpoint
    format, :func:`~adaflash_ray.models.save_drafter_checkpoint`); its one report carries the sha256 of what
    was written, so ``sync/num_workers_ok`` is 1 when the checkpoint holds exactly the published tensors.
    ``sync/write_s`` is the write time in seconds."""

    def __init__(self, ckpt_dir: str | Path):
        self.ckpt_dir = Path(ckpt_dir)

    def publish(self, version: int, parent_version: int, step: int, tensors: dict[str, torch.Tensor],
                sha256: str, config: dict) -> tuple[list[dict], dict[str, float]]:
        from adaflash_ray.models import DrafterModelConfig, save_drafter_checkpoint

        t0 = time.perf_counter()
        path = self.ckpt_dir / f"v{version}"
        written = save_drafter_checkpoint(path, DrafterModelConfig(**config), tensors,
                                          {"version": version, "parent_version": parent_version, "train_step": step})
        return ([{"worker": "checkpoint", "path": str(path), "version": version, "sha256": written}],
                {"sync/write_s": time.perf_counter() - t0})

    def close(self) -> None:
        """Nothing to close: every version is on disk when :meth:`publish` returns."""


def version_table(records: list[dict]) -> dict[int, dict[str, float]]:
    """Per published version N, from the loop's metric dicts: the optimizer steps that trained it (those run
    at version N-1) - ``steps``, mean ``loss``, ``positions_per_s`` (block positions trained per second of
    optimizer step), mean ``block_accept_len``, ``block_accept_len_fresh`` (over the blocks of first-use
    trajectories, where steps reported it) and mean ``top1_pos<i>`` (top-1 agreement with the target at block
    position i) - for every N some record published (``sync/version``)."""
    published = sorted({int(m["sync/version"]) for m in records if "sync/version" in m})
    out = {}
    for v in published:
        steps = [m for m in records if "train/loss" in m and int(m["train/version"]) == v - 1]
        row = {"steps": float(len(steps))}
        if steps:
            row["loss"] = sum(m["train/loss"] for m in steps) / len(steps)
            row["positions_per_s"] = (sum(m["train/num_positions"] for m in steps)
                                      / max(sum(m["train/seconds"] for m in steps), 1e-9))
            for key in ["train/block_accept_len"] + sorted(k for k in steps[0] if k.startswith("train/top1_pos")):
                row[key.split("/", 1)[1]] = sum(m.get(key, 0.0) for m in steps) / len(steps)
            fresh = [(m["train/block_accept_len_fresh"], m["train/num_fresh_blocks"]) for m in steps
                     if "train/block_accept_len_fresh" in m]
            if fresh:  # block-weighted: the fresh rows' acceptance over the version's steps
                row["block_accept_len_fresh"] = sum(a * n for a, n in fresh) / max(sum(n for _, n in fresh), 1e-9)
        out[v] = row
    return out


# ---------------------------------------------------------------------- the commands
def train_from_files(cfg, trajectories: str | Path, out: str | Path) -> dict:
    """Train the recipe's drafter (+ head) on the trajectory files of ``trajectories`` with no Ray, writing
    ``out/config.yaml``, ``out/checkpoints/v<N>`` (v0: the starting weights), ``out/metrics.jsonl`` (every
    metric dict) and ``out/summary.json``. Returns the summary: ``out``, ``final_version``, ``train_steps``,
    ``num_files``, ``num_trained`` (files trained on), ``seconds``, ``positions_per_s_wall`` (block positions
    trained per second of the whole loop - steps, reads, publications - against the versions' per-step-second
    rate), ``read_wait_s`` (seconds the loop waited for trajectory files: :class:`DirectorySource` reads ahead),
    ``versions`` (:func:`version_table`).
    Raises:
        FileNotFoundError / ValueError: a missing or corrupt trajectory directory (named), a model that
            does not load, trajectories the recipe cannot train on (e.g. ``features: captured`` without features).
    """
    import json

    from adaflash_ray.distill.trainer import DistillTrainerCore
    from adaflash_ray.models import save_drafter_checkpoint
    from adaflash_ray.models.factory import load_target

    source = DirectorySource(trajectories)  # checks the directory before the model loads
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.dump_yaml(out / "config.yaml")
    torch.set_num_threads(cfg.engine.num_threads)
    core = DistillTrainerCore(load_target(cfg.model), cfg.drafter, cfg.length_head, cfg.distill, seed=cfg.seed)
    records: list[dict] = []
    loop = TrainerLoop(core, cfg.distill, seed=cfg.seed, serving_dtype=getattr(torch, cfg.model.dtype),
                       on_metrics=records.append)
    save_drafter_checkpoint(out / "checkpoints" / "v0", core.drafter_model_config(), loop.serving_tensors(),
                            {"version": 0})
    result = loop.run(source, CheckpointSink(out / "checkpoints"))
    with open(out / "metrics.jsonl", "w") as f:
        for m in records:
            f.write(json.dumps(m) + "\n")
    summary = {"out": str(out), "final_version": result["final_version"], "train_steps": result["steps"],
               "num_files": source.num_files, "num_trained": result["num_fresh"],
               "seconds": round(result["seconds"], 3),
               "positions_per_s_wall": round(sum(m.get("train/num_positions", 0.0) for m in records)
                                             / max(result["seconds"], 1e-9), 1),
               "read_wait_s": round(source.read_s, 3),
               "versions": {str(v): {k: round(x, 5) for k, x in row.items()}
                            for v, row in version_table(records).items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def decode_for_training(engine, cfg, prompts: list[list[int]], on_trajectory: Callable[[Trajectory], None], *,
                        mode: str = "ar", time_limit_s: float | None = None, stop: Callable[[], bool] | None = None,
                        tag: str = "", progress_s: float = 10.0, log_prefix: str = "[generate]") -> dict:
    """Decode training ``prompts`` with ``engine`` (a recording :class:`~adaflash_ray.engine.SpecEngine`) and hand
    each finished request's trajectory (request id prefixed with ``tag``) to ``on_trajectory`` as it finishes.

    Sampling: ``engine.temperature`` / ``engine.max_new_tokens``, except the ``data.sample_fraction`` share of
    the prompts (:meth:`~adaflash_ray.config.DataConfig.is_sampled`, by index in ``prompts``) decoded at
    ``data.sampled_temperature``. Freed KV slots are refilled in groups of ``max_batch_size // 8`` (one batched
    prefill; :meth:`SpecEngine.generate`'s ``admit_min``). With ``time_limit_s`` no request starts after that many
    seconds (the started ones finish: at most one request's decode past it; the rest never run); the same from the
    moment ``stop()`` returns True (polled between steps). Every ``progress_s`` seconds a line goes to stderr.

    Returns ``{"num_requests", "num_tokens", "seconds", "tokens_per_s"}`` (requests finished, tokens generated).
    Raises: as the engine (ValueError for a prompt that does not fit) and ``on_trajectory``.
    """
    import sys

    from adaflash_ray.engine import SamplingParams

    greedy = SamplingParams(max_new_tokens=cfg.engine.max_new_tokens, temperature=cfg.engine.temperature)
    sampled = SamplingParams(max_new_tokens=cfg.engine.max_new_tokens, temperature=cfg.data.sampled_temperature)
    params = [sampled if cfg.data.is_sampled(i) else greedy for i in range(len(prompts))]
    slots = engine.runner.num_slots
    t0 = last = time.perf_counter()
    done = {"num_requests": 0, "num_tokens": 0}

    def on_finish(req) -> None:
        nonlocal last
        done["num_requests"] += 1
        done["num_tokens"] += len(req.output_ids)
        if req.output_ids:
            traj = dataclasses.replace(engine.to_trajectory(req), request_id=f"{tag}{req.request_id}")
            req.features = req.last_hidden = None  # the trajectory holds them; the request list keeps no copy
            on_trajectory(traj)
        now = time.perf_counter()
        if progress_s and now - last >= progress_s:
            last = now
            print(f"{log_prefix} {done['num_requests']}/{len(prompts)} requests, "
                  f"{done['num_tokens'] / (now - t0):.0f} tokens/s, {now - t0:.0f} s", file=sys.stderr, flush=True)

    def stop_admitting() -> bool:  # no request starts once the time limit passed or ``stop`` says so
        return (time_limit_s is not None and time.perf_counter() - t0 >= time_limit_s) or \
            (stop is not None and stop())

    engine.generate(prompts, params, mode=mode, on_finish=on_finish, admit_min=max(1, slots // 8),
                    stop_admitting=None if time_limit_s is None and stop is None else stop_admitting)
    dt = time.perf_counter() - t0
    return {**done, "seconds": dt, "tokens_per_s": done["num_tokens"] / max(dt, 1e-9)}


def generate_files(cfg, num_prompts: int, out: str | Path, drafter: str | Path | None = None, *,
                   progress_s: float = 10.0, time_limit_s: float | None = None,
                   shard: tuple[int, int] | None = None) -> list[Path]:
    """Decode ``num_prompts`` training prompts with the built-in engine, recording, and write each request's
    trajectory to ``out`` (:func:`~adaflash_ray.distill.spill.spill_path`) as soon as it finishes; no Ray.

    The prompts are the main job's training set, in its order (:func:`adaflash_ray.inputs.prepare_inputs`: the
    ShareGPT sample with ``data.num_domain_train_prompts`` in-domain prompts mixed in, chat template,
    ``data.max_prompt_tokens``; checked disjoint from the held-out prompts), decoded by
    :func:`decode_for_training` (greedy at ``engine.temperature``, the ``data.sample_fraction`` share at
    ``data.sampled_temperature``; slots refilled in groups). Without ``drafter`` the engine decodes in AR mode
    (one token per step, no drafter work: the target's text at full engine throughput - greedy or sampled, the
    output is the target's whatever drafts); with ``drafter`` (a DFlash checkpoint directory, its ``version``
    metadata naming the files) it drafts with it, so the trajectories record its proposals' acceptance.

    The files are written by two background threads while the engine steps (each atomically renamed into place:
    a run killed part way leaves only whole files). Request ids get a per-call tag (``gen-<tag>-<id>``).
    ``time_limit_s`` (seconds from this call's start, setup included: loading the prompts and the engine, CUDA-graph
    capture): no request starts after it; the started ones finish and are written, so the command ends by itself
    about one request's decode later instead of being cut by an outer timeout mid-stream. ``shard`` ``(i, n)``: this
    call decodes every n-th of the ``num_prompts`` from the i-th (``prompts[i::n]``; its inputs under
    ``out/inputs-<i>-of-<n>``), so n concurrent calls into one ``out`` decode the set once between them. Returns the
    files written, in finishing order.
    Raises:
        ValueError: ``num_prompts`` < 1, ``time_limit_s`` <= 0 or a shard outside ``0 <= i < n``;
            CheckpointError: an unreadable ``drafter``; as
            prepare_inputs, the engine and the writer (an error in a background write is raised here).
    """
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from adaflash_ray.distill.spill import spill_path, write_parquet
    from adaflash_ray.engine import SpecEngine
    from adaflash_ray.inputs import prepare_inputs
    from adaflash_ray.models import load_drafter_checkpoint

    if num_prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {num_prompts}")
    if time_limit_s is not None and time_limit_s <= 0:
        raise ValueError(f"--time-limit-s must be > 0, got {time_limit_s}")
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise ValueError(f"--shard must be I/N with 0 <= I < N, got {shard[0]}/{shard[1]}")
    t_start = time.perf_counter()
    torch.set_num_threads(cfg.engine.num_threads)
    out = Path(out)
    i, n = shard or (0, 1)
    prompts = list(prepare_inputs(cfg, out / ("inputs" if shard is None else f"inputs-{i}-of-{n}")).train)
    prompts = prompts[:num_prompts][i::n]
    engine = SpecEngine.from_config(cfg, record=True, record_features=cfg.distill.features == "captured",
                                    calibrate=False)
    if drafter is not None:
        _, tensors, meta = load_drafter_checkpoint(drafter)
        engine.load_drafter(tensors, int(meta.get("version", 0)), meta.get("sha256"))
    out.mkdir(parents=True, exist_ok=True)
    run_tag = uuid.uuid4().hex[:8]  # request ids unique across runs written into one directory
    setup_s = time.perf_counter() - t_start
    print(f"[generate] setup {setup_s:.1f} s ({len(prompts)} prompts, engine ready)", file=sys.stderr, flush=True)
    decode_limit = None if time_limit_s is None else max(time_limit_s - setup_s, 0.0)
    writes: list[Future] = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="traj-writer") as pool:
        stats = decode_for_training(
            engine, cfg, prompts,
            lambda t: writes.append(pool.submit(write_parquet, t, spill_path(out, t.request_id, t.drafter_version))),
            mode="spec" if drafter is not None else "ar", tag=f"gen-{run_tag}-", progress_s=progress_s,
            time_limit_s=decode_limit)
        written = [f.result() for f in writes]
    print(f"[generate] {stats['num_requests']} requests, {stats['num_tokens']} tokens in {stats['seconds']:.1f} s "
          f"({stats['tokens_per_s']:.0f} tokens/s), {len(written)} files", file=sys.stderr, flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m adaflash_ray.distill.loop [generate] ...`` (see the module docstring); exit 2 on bad input."""
    import argparse
    import json
    import sys

    from adaflash_ray.config import RecipeError, add_recipe_args, config_from_args
    from adaflash_ray.models import CheckpointError

    argv = list(sys.argv[1:] if argv is None else argv)
    gen = bool(argv) and argv[0] == "generate"
    parser = argparse.ArgumentParser(prog="python -m adaflash_ray.distill.loop" + (" generate" if gen else ""),
                                     description=(__doc__ or "").split("\n")[0])
    add_recipe_args(parser)
    parser.add_argument("--out", required=True, help="output directory")
    if gen:
        parser.add_argument("--prompts", type=int, required=True, help="training prompts to decode")
        parser.add_argument("--drafter", default=None, help="DFlash checkpoint to draft with (default: v0)")
        parser.add_argument("--time-limit-s", type=float, default=None,
                            help="seconds from the start (setup included) after which no request starts; the "
                                 "started ones finish and are written")
        parser.add_argument("--shard", default=None, metavar="I/N",
                            help="decode prompts[I::N] of the --prompts (N concurrent calls into one --out)")
    else:
        parser.add_argument("--trajectories", required=True, help="directory of trajectory files (*.parquet)")
    ns = parser.parse_args(argv[1:] if gen else argv)
    try:
        cfg = config_from_args(ns)
        if gen:
            shard = None
            if ns.shard is not None:
                parts = ns.shard.split("/")
                if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
                    raise ValueError(f"--shard must be I/N (two integers), got {ns.shard!r}")
                shard = (int(parts[0]), int(parts[1]))
            files = generate_files(cfg, ns.prompts, ns.out, ns.drafter, time_limit_s=ns.time_limit_s, shard=shard)
            print(json.dumps({"out": str(ns.out), "num_files": len(files)}))
            return 0
        summary = train_from_files(cfg, ns.trajectories, ns.out)
    except (RecipeError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for v, row in summary["versions"].items():
        top1 = " ".join(f"{k[len('top1_pos'):]}:{x:.3f}" for k, x in row.items() if k.startswith("top1_pos"))
        print(f"v{v}: steps {int(row['steps'])} loss {row.get('loss', float('nan')):.4f} "
              f"positions/s {row.get('positions_per_s', 0.0):.1f} τ(block) {row.get('block_accept_len', 0.0):.3f} "
              f"top-1 by position {top1}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
