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
        return admitted

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.running.remove(req)
        heapq.heappush(self.free_slots, req.slot)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
