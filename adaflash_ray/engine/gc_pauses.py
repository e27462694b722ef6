"""Python's cyclic garbage collector inside the engine's steps: measured, and kept off the startup heap.

CPython's collector stops the interpreter while it runs; a collection of the oldest generation traverses every
container object the process holds - with a model, its engines' CUDA graphs, the held-out prompts and the Ray
client loaded, hundreds of thousands of them - so one such pause can take tens of milliseconds or more, the time of
many decode steps, and it lands on whichever step happened to allocate the object that crossed the threshold. Two
things follow:

- :data:`PAUSES` (installed with :func:`install`, once per process) times every collection through
  ``gc.callbacks``; :class:`~adaflash_ray.engine.engine.SpecEngine` reads it around each step, so a step's wall time
  can be told apart from the pauses inside it (``SpecStats.gc_seconds`` / ``num_gc`` / ``num_gc_full``).
- :func:`freeze_gc_heap` collects once and moves every surviving object to the permanent generation
  (``gc.freeze``), so later collections traverse only what was allocated since - the requests, their lists and
  the step results - not the startup heap. The inference workers and Serve replicas call it once their engine is
  built and its drafter loaded (graphs captured lazily later are not frozen), the bench after each cell's warm-up
  and precapture (``gc.unfreeze`` after the cell); vLLM's engine core freezes its heap after its CUDA graph capture
  and warm-up (``freeze_gc_heap``) and SGLang offers a ``freeze_gc`` call after warm-up requests, for the same
  pauses. Frozen objects are still freed by reference counting; only reference cycles among them are never
  collected (until ``gc.unfreeze``).

A collection counted while an engine steps may have run in another thread (the counter is process-wide); it then
lengthens the step only where that thread held the interpreter while the engine thread needed it.
"""
from __future__ import annotations

import gc
import threading
import time


class GCPauses:
    """Process-wide totals of the collector's pauses (``gc.callbacks``): ``count``, ``full`` (collections of the
    oldest generation, 2), ``seconds`` (wall time between each collection's start and stop callbacks). Read them
    before and after a span of work and subtract. Updated from whichever thread collects."""

    def __init__(self) -> None:
        self.count = 0
        self.full = 0
        self.seconds = 0.0
        self._start = threading.local()

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start.t = time.perf_counter()
            return
        t0 = getattr(self._start, "t", None)
        if t0 is None:  # installed between a collection's start and stop
            return
        self._start.t = None
        self.count += 1
        self.full += info.get("generation") == 2
        self.seconds += time.perf_counter() - t0

    def snapshot(self) -> tuple[int, int, float]:
        """``(count, full, seconds)`` now."""
        return self.count, self.full, self.seconds


#: the process's one :class:`GCPauses` (registered in ``gc.callbacks`` by :func:`install`)
PAUSES = GCPauses()


def install() -> GCPauses:
    """Register :data:`PAUSES` in ``gc.callbacks`` (once per process; later calls do nothing) and return it."""
    if PAUSES not in gc.callbacks:
        gc.callbacks.append(PAUSES)
    return PAUSES


def freeze_gc_heap() -> dict:
    """``gc.collect()`` then ``gc.freeze()``: every object alive now moves to the permanent generation, which later
    collections skip. Returns ``{"frozen": objects in the permanent generation, "seconds": wall time}``."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return {"frozen": gc.get_freeze_count(), "seconds": round(time.perf_counter() - t0, 3)}
