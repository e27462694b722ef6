"""Continuous-batching scheduler: FIFO admission into a fixed number of KV slots, lowest free slot
first (the runner computes rows 0..max(slot), so keeping slots packed keeps batches small). Pure
Python, no tensors (nano-vllm's split)."""
from __future__ import annotations

import heapq
from collections import deque

from adaflash_ray.engine.request import Request, Status


class Scheduler:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.free_slots = list(range(num_slots))  # a heap
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # bumped whenever ``running`` or a running request's slot changes (admit, finish, relocate): the engine keeps
        # per-batch host state (slots, slot index arrays) across the steps of an unchanged batch
        self.version = 0

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots; returns the newly admitted ones (need prefill)."""
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = heapq.heappop(self.free_slots)
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        self.version += bool(admitted)
        return admitted

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.running.remove(req)
        heapq.heappush(self.free_slots, req.slot)
        self.version += 1

    def compaction(self) -> list[tuple[Request, int]]:
        """The moves that pack the running requests into slots 0..n-1 (n running): each request in a slot >= n, the
        highest first, to the lowest free slot below n; empty when they are packed already."""
        n = len(self.running)
        movers = sorted((r for r in self.running if r.slot >= n), key=lambda r: -r.slot)
        if not movers:
            return []
        low = sorted(s for s in self.free_slots if s < n)  # as many as the movers: n - (running below n)
        return list(zip(movers, low))

    def relocate(self, moves: list[tuple[Request, int]]) -> None:
        """Apply ``moves`` (request, free slot): each request takes its new slot and frees its old one."""
        taken = {dst for _, dst in moves}
        freed = [r.slot for r, _ in moves]
        for req, dst in moves:
            req.slot = dst
        self.free_slots = [s for s in self.free_slots if s not in taken] + freed
        heapq.heapify(self.free_slots)
        self.version += 1

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
