"""TrajectoryBuffer: the swap buffer between inference and training (an async Ray actor).

It holds ObjectRefs (the trajectories stay in the Ray object store, owned by the workers that
produced them), bounded by ``capacity``. Version-aware: the trainer announces its latest version;
trajectories whose version lag exceeds ``max_version_lag`` are dropped and counted. When full,
the oldest entries are evicted (counted), or - with ``spill_dir`` - kept on disk and read back when
the queue runs low, so nothing is lost.

Journal (``spill_dir``): every added trajectory is written to ``spill_dir`` as Parquet before it
is queued, and its file is deleted only once it is consumed for good (a trainer's commit, or a hand-out
without a lease). A buffer actor that dies is restarted by Ray (the pipeline creates it with
``max_restarts``) and recovers every file it finds there: trajectories already journaled come back, and a
retried ``add`` of one it holds is not queued twice.

Leases: a trainer rank that names itself (``consumer``) in :meth:`get_batch` holds what it got
until it :meth:`commit` s (its trainer state, with those trajectories trained in, is saved); a restarted
rank's uncommitted lease is put back first in line by :meth:`requeue`, so a trainer killed between two
saves loses no trajectory and none is trained into the saved state twice.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path

import ray

from adaflash_ray.trajectory import within_version_lag


@ray.remote(num_cpus=0)
class TrajectoryBuffer:
    def __init__(self, capacity: int, max_version_lag: int, spill_dir: str | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_version_lag < 0:
            raise ValueError(f"max_version_lag must be >= 0, got {max_version_lag}")
        self.capacity, self.max_version_lag = capacity, max_version_lag
        self.spill_dir = Path(spill_dir) if spill_dir else None
        # (ref, version, tokens, t, journal file or None)
        self.items: deque[tuple[ray.ObjectRef, int, int, float, Path | None]] = deque()
        self.on_disk: deque[tuple[Path, int]] = deque()  # journaled, not in memory: (file, version), oldest first
        self.known: set[str] = set()  # journal file names held (memory, disk or lease): a retried add is a no-op
        self.latest_version = 0
        self.counts = {"added": 0, "consumed": 0, "dropped_stale": 0, "dropped_capacity": 0, "spilled": 0,
                       "committed": 0, "redelivered": 0, "recovered": 0, "reloaded": 0, "duplicates_ignored": 0,
                       "warm_batches_late": 0}
        self.leases: dict[str, list] = {}  # consumer -> items handed out since its last commit
        # the warm start's text decoded by the inference workers (distill.warm_start_workers): batches of trajectories
        # kept apart from the on-policy queue until the trainer ranks take them (add_warm / warm_done / take_warm)
        self.warm_refs: list = []
        self.warm_reports: dict[str, dict] = {}
        self.warm_taken: set[int] = set()
        self.warm_shared: list | None = None  # the batches as the first rank to take found them (None: none taken)
        self.warm_cursor: dict[int, int] = {}  # take_warm_stream: per rank, the index of its next batch
        self.warm_stream_done: set[int] = set()  # ranks whose stream ended
        self._cond = asyncio.Condition()
        if self.spill_dir is not None and self.spill_dir.is_dir():  # a restarted buffer: take back its journal
            from adaflash_ray.distill.spill import spill_version  # lazy: only with spill_dir

            files = sorted(self.spill_dir.glob("*.parquet"), key=lambda f: f.stat().st_mtime)
            for f in files:
                self.on_disk.append((f, spill_version(f)))
                self.known.add(f.name)
            self.counts["recovered"] = len(files)

    async def add(self, refs: list, version: int, num_tokens: int = 0) -> None:
        """Add trajectory refs (wrapped in a list so Ray does not resolve them) produced by ``version``."""
        async with self._cond:
            for ref in refs:
                if not within_version_lag(self.latest_version, version, self.max_version_lag):
                    self.counts["dropped_stale"] += 1
                    continue
                path = None
                if self.spill_dir is not None:
                    path = await self._journal(ref, version)
                    if path is None:
                        self.counts["duplicates_ignored"] += 1
                        continue
                while len(self.items) >= self.capacity:
                    old = self.items.popleft()
                    if old[4] is not None:  # stays on disk, read back when the queue runs low
                        self.on_disk.append((old[4], old[1]))
                        self.counts["spilled"] += 1
                    else:
                        self.counts["dropped_capacity"] += 1
                self.items.append((ref, version, num_tokens, time.time(), path))
                self.counts["added"] += 1
            self._cond.notify_all()

    async def _journal(self, ref, version: int) -> Path | None:
        """Write the trajectory to the journal; None if it is already held (a retried add)."""
        from adaflash_ray.distill.spill import spill_path, write_parquet  # lazy: only with spill_dir

        traj = await ref
        path = spill_path(self.spill_dir, traj.request_id, version)
        if path.name in self.known:
            return None
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        write_parquet(traj, path)
        self.known.add(path.name)
        return path

    def _forget(self, path: Path | None) -> None:
        """A trajectory consumed for good: its journal file goes."""
        if path is not None:
            self.known.discard(path.name)
            path.unlink(missing_ok=True)

    def _reload(self, n: int) -> None:
        """Bring journaled trajectories back from disk (oldest first) until ``n`` are queued."""
        from adaflash_ray.distill.spill import read_parquet

        while len(self.items) < n and self.on_disk:
            path, version = self.on_disk.popleft()
            if not within_version_lag(self.latest_version, version, self.max_version_lag):
                self.counts["dropped_stale"] += 1
                self._forget(path)
                continue
            traj = read_parquet(path)
            self.items.append((ray.put(traj), version, traj.num_response_tokens, time.time(), path))
            self.counts["reloaded"] += 1

    def _drop_stale(self) -> None:
        keep = deque()
        for it in self.items:
            if self.latest_version - it[1] > self.max_version_lag:
                self.counts["dropped_stale"] += 1
                self._forget(it[4])
            else:
                keep.append(it)
        self.items = keep

    async def _wait(self, ready, deadline: float) -> bool:
        """With ``self._cond`` held: wait for its notifications until ``ready()`` or the ``time.monotonic()``
        ``deadline``; returns ``ready()``'s last answer."""
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._cond.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass
        return True

    async def set_version(self, version: int) -> None:
        """The trainer's latest published version; entries now too stale are dropped."""
        async with self._cond:
            self.latest_version = max(self.latest_version, version)
            self._drop_stale()

    async def get_batch(self, n: int, timeout_s: float = 30.0, consumer: str | None = None) -> list:
        """Wait up to ``timeout_s`` for ``n`` fresh trajectories; returns up to n as ``[[ref, version], ...]``
        (oldest first; fewer on timeout). With ``consumer`` they stay leased to it until :meth:`commit`."""
        def ready() -> bool:
            self._drop_stale()
            self._reload(n)
            return len(self.items) >= n

        async with self._cond:
            await self._wait(ready, time.monotonic() + timeout_s)
            out = []
            while self.items and len(out) < n:
                item = self.items.popleft()
                out.append([item[0], item[1]])
                if consumer is not None:
                    self.leases.setdefault(consumer, []).append(item)
                else:
                    self._forget(item[4])
            self.counts["consumed"] += len(out)
            return out

    async def commit(self, consumer: str) -> int:
        """``consumer`` saved a state with everything it was handed trained in: end its lease (and delete
        those journal files). Returns how many trajectories the commit covered."""
        done = self.leases.pop(consumer, [])
        for item in done:
            self._forget(item[4])
        self.counts["committed"] += len(done)
        return len(done)

    async def requeue(self, consumer: str) -> int:
        """A restarted ``consumer`` lost what it trained since its last commit: put those trajectories back,
        first in line (too-stale ones are dropped and counted). Returns how many were put back."""
        async with self._cond:
            back = self.leases.pop(consumer, [])
            self._put_back(back)
            self.counts["redelivered"] += len(back)
            return len(back)

    def _put_back(self, back: list) -> None:
        """Leased items return first in line, in lease order, as not consumed (caller holds ``self._cond``)."""
        for item in reversed(back):
            self.items.appendleft(item)
        self.counts["consumed"] -= len(back)  # handed out again later: counted once
        self._drop_stale()
        self._cond.notify_all()

    async def release(self, consumer: str, refs: list) -> int:
        """``consumer`` hands back, untrained, trajectories it was leased (``refs``: their ObjectRefs, in a
        list so Ray passes them unresolved) - a batch it prefetched when its training ended, or what it held
        untrained at a commit. They go back first in line, in lease order, and count as not consumed; refs it
        does not hold are ignored. Returns how many went back."""
        wanted = set(refs)
        async with self._cond:
            lease = self.leases.get(consumer, [])
            back = [item for item in lease if item[0] in wanted]
            self.leases[consumer] = [item for item in lease if item[0] not in wanted]
            self._put_back(back)
            return len(back)

    # ------------------------------------------------------------------ the warm start's text from the workers
    async def add_warm(self, refs: list) -> None:
        """Warm-start text an inference worker decoded (``refs``: ObjectRefs of lists of trajectories, in a list so
        Ray passes them unresolved): held apart from the on-policy queue - no capacity, no version lag, no journal -
        until the trainer ranks :meth:`take_warm` it."""
        async with self._cond:
            if self.warm_shared is not None:  # a worker late past the ranks' deadline: they train without it
                self.counts["warm_batches_late"] += len(refs)
                return
            self.warm_refs.extend(refs)
            self._cond.notify_all()  # a streaming rank waits for its next batch

    async def warm_done(self, source: str, report: dict) -> None:
        """``source`` (e.g. ``worker-0``) has added all its warm-start text; ``report``: its decode's counts (or an
        ``error``). The first report of a source stands (the driver reports a worker it saw die, which may have
        reported itself)."""
        async with self._cond:
            self.warm_reports.setdefault(source, report)
            self._cond.notify_all()

    async def take_warm(self, num_sources: int, rank: int = 0, world_size: int = 1, timeout_s: float = 600.0) -> dict:
        """Wait until ``num_sources`` sources reported :meth:`warm_done` (at most ``timeout_s``: a worker that died
        mid-decode leaves what it added); returns ``{"refs": this rank's share of the batches (every world_size-th
        from ``rank``), "reports": {source: report}}``. The first rank's take fixes the batches every rank shares
        (batches added later are dropped, counted as ``warm_batches_late``), so the shares never overlap or miss
        one; once every rank has taken its share the batches and reports are forgotten (the object store frees them
        when the ranks drop theirs)."""
        async with self._cond:
            await self._wait(lambda: self.warm_shared is not None or len(self.warm_reports) >= num_sources,
                             time.monotonic() + timeout_s)
            if self.warm_shared is None:
                self.warm_shared = list(self.warm_refs)
                self.warm_refs = []
            out = {"refs": self.warm_shared[rank::world_size], "reports": dict(self.warm_reports)}
            self.warm_taken.add(rank)
            if len(self.warm_taken) >= world_size:
                self.warm_shared, self.warm_taken, self.warm_reports = [], set(), {}
            return out

    async def take_warm_stream(self, rank: int, world_size: int, num_sources: int, timeout_s: float) -> dict:
        """The streaming warm start (``distill.warm_start_streaming``): this rank's batches added since its last call -
        batch ``j`` (in order of arrival) is rank ``j % world_size``'s - waiting at most ``timeout_s`` for one when
        there is none yet. Returns ``{"refs": the new batches' refs, "done": True once num_sources sources reported
        warm_done and this rank has all its batches, "reports": {source: report} (with done)}``. Once every rank's
        stream is done the batches and reports are forgotten."""
        async with self._cond:
            start = self.warm_cursor.get(rank, rank)
            await self._wait(lambda: start < len(self.warm_refs) or len(self.warm_reports) >= num_sources,
                             time.monotonic() + timeout_s)
            refs = self.warm_refs[start::world_size]
            self.warm_cursor[rank] = start + world_size * len(refs)
            done = len(self.warm_reports) >= num_sources and self.warm_cursor[rank] >= len(self.warm_refs)
            out = {"refs": refs, "done": done, "reports": dict(self.warm_reports) if done else {}}
            if done:
                self.warm_stream_done.add(rank)
                if len(self.warm_stream_done) >= world_size:
                    self.warm_refs, self.warm_reports, self.warm_cursor, self.warm_stream_done = [], {}, {}, set()
                    self.warm_shared = []  # the warm start is over: a late batch is dropped (warm_batches_late)
            return out

    async def clear_warm(self) -> int:
        """End the warm start: forget its batches and reports (a batch added later is dropped and counted as
        ``warm_batches_late``). Returns how many batches it still held."""
        async with self._cond:
            left = len(self.warm_refs)
            self.warm_refs, self.warm_reports, self.warm_cursor, self.warm_stream_done = [], {}, {}, set()
            self.warm_taken, self.warm_shared = set(), []
            return left

    async def stats(self) -> dict[str, float]:
        return {"buffer/depth": float(len(self.items)), "buffer/on_disk": float(len(self.on_disk)),
                "buffer/latest_version": float(self.latest_version),
                **{f"buffer/{k}": float(v) for k, v in self.counts.items()}}
