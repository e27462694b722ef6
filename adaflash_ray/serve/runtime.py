"""EngineLoop: one SpecEngine stepped by a background thread, fed and drained from an asyncio loop.

Ray-free (the Serve replica in :mod:`adaflash_ray.serve.app` wraps it). Every engine step the thread
pushes the tokens each running request committed in that step (one step may commit several) to the
request's :class:`asyncio.Queue` on the event loop; new requests, aborts and drafter swaps are applied
by the thread between steps, never inside one. An abort finishes the request and frees its KV slot
(``SpecEngine.abort``) before the next step.

Queue items: ``("tokens", [ids], drafter_version)``, ``("done", finish_reason)``, ``("error", exc)``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter, deque
from typing import Callable

from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.engine.request import Request, Status

__all__ = ["EngineLoop", "QueueFull", "RequestStream"]


class QueueFull(Exception):
    """More requests are waiting than ``max_waiting`` allows (answered as HTTP 429)."""


class RequestStream:
    """One request's handle on the event-loop side: ``queue`` of items, ``req`` once admitted."""

    __slots__ = ("queue", "req", "record", "num_sent", "aborted", "prompt_ids", "params", "versions", "t_submit",
                 "abort_reason")

    def __init__(self, prompt_ids: list[int], params: SamplingParams, record: bool):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.req: Request | None = None
        self.prompt_ids, self.params, self.record = prompt_ids, params, record
        self.num_sent = 0  # output tokens already pushed
        self.aborted = False
        self.abort_reason = ""
        self.versions: list[int] = []  # drafter versions that served this request's steps
        self.t_submit = time.perf_counter()


class EngineLoop:
    """Drive ``engine`` from a daemon thread; talk to it from ``loop`` (the asyncio event loop).

    Args:
        engine: a SpecEngine (``max_batch_size`` requests run together; the rest wait).
        loop: the event loop whose queues receive the tokens.
        max_batch_size: the engine's KV slots (``engine.max_batch_size`` of the recipe).
        max_waiting: requests allowed to wait for a KV slot beyond the running batch; more -> QueueFull.
        on_finished: called in the engine thread with each finished (not aborted) recorded request,
            e.g. to ship its trajectory to the distillation buffer.
    """

    def __init__(self, engine: SpecEngine, loop: asyncio.AbstractEventLoop, max_batch_size: int, max_waiting: int,
                 on_finished: Callable[[Request], None] | None = None):
        self.engine, self.loop, self.on_finished = engine, loop, on_finished
        self.max_in_flight = max_batch_size + max_waiting
        self._cond = threading.Condition()
        self._new: list[RequestStream] = []
        self._aborts: list[RequestStream] = []
        self._swaps: list[tuple] = []
        self._active: dict[str, RequestStream] = {}
        self._stop = False
        self.dead: BaseException | None = None
        self.num_in_flight = 0  # submitted and not yet done (event-loop side counter)
        self.counts = Counter()  # finished / aborted / rejected / errors / tokens
        self.gamma_hist: Counter = Counter()  # γ chosen per verify step (since start)
        self._gamma_new: Counter = Counter()  # since the last pop_gamma()
        self._tok_window: deque = deque(maxlen=4096)  # (t, num_tokens) per step
        self.reloads: list[dict] = []
        self._thread = threading.Thread(target=self._run, name="serve-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side
    def submit(self, prompt_ids: list[int], params: SamplingParams, record: bool) -> RequestStream:
        """Queue a request; returns its stream. Raises QueueFull, or RuntimeError if the engine died."""
        if self.dead is not None:
            raise RuntimeError(f"engine loop failed: {self.dead!r}")
        with self._cond:
            if self.num_in_flight >= self.max_in_flight:
                self.counts["rejected"] += 1
                raise QueueFull(f"{self.num_in_flight} requests in flight, limit {self.max_in_flight}")
            rs = RequestStream(prompt_ids, params, record)
            self._new.append(rs)
            self.num_in_flight += 1
            self._cond.notify()
        return rs

    def abort(self, rs: RequestStream, reason: str = "aborted") -> None:
        """Cancel a request ("aborted": the client is gone; "stop_string": the text hit a stop string); its KV
        slot is freed before the next engine step. Counted in ``counts[reason]``."""
        with self._cond:
            if rs.aborted:
                return
            rs.aborted, rs.abort_reason = True, reason
            if rs in self._new:
                self._new.remove(rs)
                self.num_in_flight -= 1
                self.counts[reason] += 1
            else:
                self._aborts.append(rs)
            self._cond.notify()

    def load_drafter(self, tensors: dict, version: int, sha256: str | None = None,
                     config=None) -> concurrent.futures.Future:
        """Swap the drafter between steps (requests in flight continue); the future gives the sha256 or
        raises CheckpointError (the old drafter stays loaded)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._swaps.append((tensors, version, sha256, config, fut))
            self._cond.notify()
        return fut

    def queue_depth(self) -> dict[str, int]:
        with self._cond:
            active = [rs.req for rs in self._active.values()]
            num_running = sum(1 for r in active if r.status == Status.RUNNING)
            return {"waiting": len(self._new) + len(active) - num_running, "running": num_running}

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Committed tokens per second over the last ``window_s`` seconds."""
        now = time.perf_counter()
        n = sum(k for t, k in list(self._tok_window) if now - t <= window_s)
        return n / window_s

    def pop_gamma(self) -> Counter:
        with self._cond:
            out, self._gamma_new = self._gamma_new, Counter()
        return out

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ engine thread
    def _push(self, rs: RequestStream, item: tuple) -> None:
        self.loop.call_soon_threadsafe(rs.queue.put_nowait, item)

    def _done(self, rs: RequestStream, reason: str) -> None:
        def finish():
            self.num_in_flight -= 1
            rs.queue.put_nowait(("done", reason))
        self.loop.call_soon_threadsafe(finish)

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._new or self._aborts or self._swaps or eng.has_unfinished()):
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                    swaps, self._swaps = self._swaps, []
                for rs in new:
                    try:
                        rs.req = eng.add_request(rs.prompt_ids, rs.params)
                        self._active[rs.req.request_id] = rs
                    except ValueError as e:
                        self.counts["errors"] += 1
                        self._push(rs, ("error", e))
                        self._done(rs, "error")
                for rs in aborts:
                    if rs.req is not None and self._active.pop(rs.req.request_id, None) is not None:
                        eng.abort(rs.req)
                        self.counts[rs.abort_reason] += 1
                        self._done(rs, "abort")
                for tensors, version, sha, config, fut in swaps:
                    t0 = time.perf_counter()
                    try:
                        digest = eng.load_drafter(tensors, version, sha, config)
                    except Exception as e:  # refused: the old drafter stays loaded
                        fut.set_exception(e)
                        continue
                    self.reloads.append({"version": version, "sha256": digest, "time": time.time(),
                                         "seconds": round(time.perf_counter() - t0, 4),
                                         "num_in_flight": len(self._active)})
                    fut.set_result(digest)
                if not eng.has_unfinished():
                    continue
                version = eng.drafter_version
                finished = eng.step("spec")
                num_new = 0
                for rid, rs in list(self._active.items()):
                    req = rs.req
                    if len(req.output_ids) > rs.num_sent:
                        num_new += len(req.output_ids) - rs.num_sent
                        self._push(rs, ("tokens", list(req.output_ids[rs.num_sent:]), version))
                        rs.num_sent = len(req.output_ids)
                self._tok_window.append((time.perf_counter(), num_new))
                self.counts["tokens"] += num_new
                for req in finished:
                    rs = self._active.pop(req.request_id, None)
                    if rs is None:
                        continue
                    with self._cond:
                        for g in req.draft_lens:
                            self.gamma_hist[g] += 1
                            self._gamma_new[g] += 1
                    if rs.record and self.on_finished is not None and req.output_ids:
                        try:
                            self.on_finished(req)
                        except Exception as e:  # recording must never fail a served request
                            self.counts["record_errors"] += 1
                            self.last_record_error = repr(e)[:500]
                    req.feature_chunks, req.hidden_chunks = [], []
                    self.counts["finished"] += 1
                    self._done(rs, req.finish_reason)
        except BaseException as e:  # fail every waiting request loudly instead of hanging them
            self.dead = e
            with self._cond:
                pending = self._new + list(self._active.values())
                self._new, self._active = [], {}
            for rs in pending:
                self._push(rs, ("error", RuntimeError(f"engine step failed: {e!r}")))
                self._done(rs, "error")
            raise
