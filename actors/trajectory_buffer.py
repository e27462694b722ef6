"""TrajectoryBuffer: the swap buffer between inference and training (an async Ray actor).

It holds ObjectRefs (the trajectories stay in the Ray object store, owned by the workers that
produced them), bounded by ``capacity``. Version-aware: the trainer announces its latest version;
trajectories whose version lag exceeds ``max_version_lag`` are dropped and counted. When full,
the oldest entries are evicted (counted), or - with ``spill_dir`` - written to Parquet first so
nothing is lost.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path

import ray


@ray.remote(num_cpus=0)
class TrajectoryBuffer:
    def __init__(self, capacity: int, max_version_lag: int, spill_dir: str | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_version_lag < 0:
            raise ValueError(f"max_version_lag must be >= 0, got {max_version_lag}")
        self.capacity, self.max_version_lag = capacity, max_version_lag
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.items: deque[tuple[ray.ObjectRef, int, int, float]] = deque()  # (ref, version, tokens, t)
        self.latest_version = 0
        self.counts = {"added": 0, "consumed": 0, "dropped_stale": 0, "dropped_capacity": 0, "spilled": 0}
        self._cond = asyncio.Condition()

    async def add(self, refs: list, version: int, num_tokens: int = 0) -> None:
        """Add trajectory refs (wrapped in a list so Ray does not resolve them) produced by ``version``."""
        async with self._cond:
            for ref in refs:
                if self.latest_version - version > self.max_version_lag:
                    self.counts["dropped_stale"] += 1
                    continue
                while len(self.items) >= self.capacity:
                    old = self.items.popleft()
                    if self.spill_dir is not None:
                        await self._spill(old)
                    else:
                        self.counts["dropped_capacity"] += 1
                self.items.append((ref, version, num_tokens, time.time()))
                self.counts["added"] += 1
            self._cond.notify_all()

    async def _spill(self, item) -> None:
        from adaflash_ray.distill.spill import write_parquet  # lazy: only with spill_dir
        traj = await item[0]
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        write_parquet(traj, self.spill_dir / f"{traj.request_id}-v{item[1]}.parquet")
        self.counts["spilled"] += 1

    def _drop_stale(self) -> None:
        keep = deque()
        for it in self.items:
            if self.latest_version - it[1] > self.max_version_lag:
                self.counts["dropped_stale"] += 1
            else:
                keep.append(it)
        self.items = keep

    async def set_version(self, version: int) -> None:
        """The trainer's latest published version; entries now too stale are dropped."""
        async with self._cond:
            self.latest_version = max(self.latest_version, version)
            self._drop_stale()

    async def get_batch(self, n: int, timeout_s: float = 30.0) -> list:
        """Wait up to ``timeout_s`` for ``n`` fresh trajectories; returns up to n as ``[[ref, version], ...]``
        (oldest first; fewer on timeout)."""
        deadline = time.monotonic() + timeout_s
        async with self._cond:
            while True:
                self._drop_stale()
                if len(self.items) >= n:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._cond.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass
            out = []
            while self.items and len(out) < n:
                ref, version, _, _ = self.items.popleft()
                out.append([ref, version])
            self.counts["consumed"] += len(out)
            return out

    async def stats(self) -> dict[str, float]:
        return {"buffer/depth": float(len(self.items)), "buffer/latest_version": float(self.latest_version),
                **{f"buffer/{k}": float(v) for k, v in self.counts.items()}}
