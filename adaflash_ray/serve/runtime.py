"""EngineLoop: a Serve replica's view of its :class:`~adaflash_ray.engine.EngineService` - per-request asyncio
queues, the in-flight limit, counters for the status route.

Ray-free (the Serve replica in :mod:`adaflash_ray.serve.app` wraps it). After every engine step the service's
thread pushes the tokens each running request committed in that step (one step may commit several) to the
request's :class:`asyncio.Queue` on the event loop (``loop.call_soon_threadsafe``); new requests, aborts and
drafter swaps are applied by that thread between steps, never inside one. An abort finishes the request and frees
its KV slot (``SpecEngine.abort``) before the next step.

Queue items: ``("tokens", [ids], drafter_version, logprobs)``, ``("done", finish_reason)``, ``("error", exc)``
(then ``("done", "error")``): exc is the engine's ValueError for a bad request, or the service's EngineDead.
``logprobs`` is None unless the request asked for them (``SamplingParams.logprobs``); then one
``(logprob, [(top id, top logprob), ...])`` per token of ``ids``, read from the engine's ``Request.output_logprobs``
/ ``output_top_logprobs`` in the engine thread, in the step that committed the tokens (an error message instead
if the engine recorded fewer).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter, deque
from typing import Callable

from adaflash_ray.engine import (EngineDead, EngineService, RequestHandle, SamplingParams, SpecEngine,
                                 StepEvent)
from adaflash_ray.engine.request import Request

__all__ = ["EngineLoop", "QueueFull", "RequestStream"]


class QueueFull(Exception):
    """More requests are waiting than ``max_waiting`` allows (answered as HTTP 429)."""


class RequestStream:
    """One request's handle on the event-loop side: ``queue`` of items, ``handle`` in the engine service."""

    __slots__ = ("queue", "handle", "record", "aborted", "abort_reason", "versions", "t_submit", "started",
                 "num_tokens")

    def __init__(self, record: bool):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handle: RequestHandle | None = None
        self.record = record
        self.aborted = False
        self.abort_reason = ""
        self.versions: list[int] = []  # drafter versions that served this request's steps
        self.t_submit = time.perf_counter()
        self.started = False  # the prefill committed its first token
        self.num_tokens = 0  # completion tokens delivered so far (set by the replica's text stream)


def _logprobs(h: RequestHandle, num_new: int) -> list[tuple[float, list[tuple[int, float]]]] | str | None:
    """The last ``num_new`` output tokens' ``(logprob, top)`` (the tokens this step committed: ``h.num_sent`` is
    already past them); None when the request did not ask for logprobs; an error message (str) when the engine
    recorded fewer than it committed tokens - that request fails, the engine thread goes on (raising here would
    stop it)."""
    req = h.req
    if req.params.logprobs is None:
        return None
    end = h.num_sent
    lps, tops = req.output_logprobs[end - num_new:end], req.output_top_logprobs[end - num_new:end]
    if len(lps) != num_new or len(tops) != num_new:
        return (f"the engine recorded {len(req.output_logprobs)} logprobs for {end} output tokens of a request "
                "that asked for them")
    return [(float(lp), [(int(i), float(v)) for i, v in top]) for lp, top in zip(lps, tops)]


class EngineLoop:
    """Drive ``engine`` through an :class:`EngineService`; talk to it from ``loop`` (the asyncio event loop).

    Args:
        engine: a SpecEngine (``max_batch_size`` requests run together; the rest wait).
        loop: the event loop whose queues receive the tokens.
        max_batch_size: the engine's KV slots (``engine.max_batch_size`` of the recipe).
        max_waiting: requests allowed to wait for a KV slot beyond the running batch; more -> QueueFull.
        on_finished: called in the engine thread with each finished (not aborted) recorded request,
            e.g. to ship its trajectory to the distillation buffer; what it raises is counted
            (``counts["record_errors"]``), never failing the request.
        metrics: an :class:`adaflash_ray.actors.spec_metrics.SpecMetrics` (or anything with its ``on_step`` /
            ``timed_submit``), fed with every step event and submission; None: no exported metrics.
        stall_timeout_s: ``serve.engine_stall_timeout_s``: seconds the engine thread may go without progress while
            requests are in flight before :meth:`health_error` reports a stall; None: never reported.
    """

    def __init__(self, engine: SpecEngine, loop: asyncio.AbstractEventLoop, max_batch_size: int, max_waiting: int,
                 on_finished: Callable[[Request], None] | None = None, metrics=None,
                 stall_timeout_s: float | None = None):
        self.engine, self.loop, self.on_finished = engine, loop, on_finished
        self.stall_timeout_s = stall_timeout_s
        self.max_in_flight = max_batch_size + max_waiting
        self._lock = threading.Lock()
        self.num_in_flight = 0  # submitted and not yet done (event-loop side counter)
        # finished / aborted / rejected / errors / tokens / record_errors / decode_steps (request-steps after the
        # prefill that committed tokens)
        self.counts = Counter()
        self.gamma_hist: Counter = Counter()  # γ chosen per step (since start)
        self._tok_window: deque = deque(maxlen=4096)  # (t, num_tokens) per step
        self.reloads: list[dict] = []
        self.metrics = metrics
        self.service = EngineService(engine, name="serve replica")
        self.service.subscribe(self._on_step)
        if metrics is not None:
            self.service.subscribe(metrics.on_step)

    @property
    def dead(self) -> EngineDead | None:
        """The service's failure once its thread has stopped, else None."""
        return self.service.dead

    def health_error(self, now: float | None = None) -> str | None:
        """Why this replica cannot serve, or None: the engine thread died, or (``stall_timeout_s`` set) it has made
        no progress for longer than ``stall_timeout_s`` while requests are in flight - a step or command between
        steps stuck, e.g. in a device call (:meth:`EngineService.stalled_for`). An idle engine is never stalled, nor
        one whose step runs shorter than the timeout. ``now``: a ``time.monotonic()`` reading; None = now."""
        if self.dead is not None:
            return f"engine thread died: {self.dead!r}"
        if self.stall_timeout_s is None:
            return None
        stalled = self.service.stalled_for(now)
        if stalled <= self.stall_timeout_s:
            return None
        return (f"engine step has not returned for {stalled:.1f} s with {self.service.num_open} requests in flight "
                f"(serve.engine_stall_timeout_s = {self.stall_timeout_s:g} s)")

    # ------------------------------------------------------------------ event-loop side
    def submit(self, prompts: list[list[int]], params: list[SamplingParams], record: bool) -> list[RequestStream]:
        """Queue one request per entry of ``params``, entry i on ``prompts[i]`` (the choices of one HTTP request:
        its ``n`` per prompt), all or none; returns their streams. Raises QueueFull (nothing queued) when they do not
        all fit in the in-flight limit, ValueError when the two lists differ in length, or RuntimeError if the engine
        died."""
        if len(prompts) != len(params):
            raise ValueError(f"submit: {len(prompts)} prompts for {len(params)} parameter sets")
        if self.dead is not None:
            raise RuntimeError(f"engine loop failed: {self.dead!r}")
        if self.num_in_flight + len(params) > self.max_in_flight:
            self.counts["rejected"] += 1
            raise QueueFull(f"{self.num_in_flight} requests in flight, {len(params)} more asked for, "
                            f"limit {self.max_in_flight}")
        streams = []
        for ids, p in zip(prompts, params):
            rs = RequestStream(record)
            try:
                if self.metrics is not None:
                    rs.handle = self.metrics.timed_submit(lambda p=p, rs=rs, ids=ids: self.service.submit(ids, p, tag=rs))
                else:
                    rs.handle = self.service.submit(ids, p, tag=rs)
            except EngineDead as e:
                raise RuntimeError(f"engine loop failed: {e!r}") from e
            self.num_in_flight += 1
            rs.handle.future.add_done_callback(lambda fut, rs=rs: self._done(rs, fut))
            streams.append(rs)
        return streams

    def abort(self, rs: RequestStream, reason: str = "aborted") -> None:
        """Cancel a request ("aborted": the client is gone; "stop_string": the text hit a stop string; "timeout":
        it waited past ``serve.request_timeout_s``); its KV slot is freed before the next engine step (an engine
        stuck inside a step applies it once the step returns). Counted in ``counts[reason]``."""
        if rs.aborted:
            return
        rs.aborted, rs.abort_reason = True, reason
        self.service.abort(rs.handle)

    def load_drafter(self, tensors: dict, version: int, sha256: str | None = None,
                     config=None) -> concurrent.futures.Future:
        """Swap the drafter between steps (requests in flight continue); the future gives the sha256 or
        raises CheckpointError (the old drafter stays loaded). Each swap is kept in ``reloads``."""
        def swap(eng: SpecEngine) -> str:
            t0 = time.perf_counter()
            digest = eng.load_drafter(tensors, version, sha256, config)
            self.reloads.append({"version": version, "sha256": digest, "time": time.time(),
                                 "seconds": round(time.perf_counter() - t0, 4),
                                 "num_in_flight": eng.scheduler.num_unfinished})
            return digest

        return self.service.call(swap)

    def queue_depth(self) -> dict[str, int]:
        running = self.service.num_running
        return {"waiting": max(self.service.num_open - running, 0), "running": running}

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Committed tokens per second over the last ``window_s`` seconds."""
        now = time.perf_counter()
        n = sum(k for t, k in list(self._tok_window) if now - t <= window_s)
        return n / window_s

    def shutdown(self) -> None:
        self.service.shutdown(timeout_s=30)

    # ------------------------------------------------------------------ engine thread
    def _on_step(self, event: StepEvent) -> None:
        num_new = 0
        for h, tokens in event.committed:
            num_new += len(tokens)
            if h.tag.started:  # a decode step of this request (its prefill excluded)
                self.counts["decode_steps"] += 1
            h.tag.started = True
            self.loop.call_soon_threadsafe(h.tag.queue.put_nowait,
                                           ("tokens", list(tokens), event.drafter_version, _logprobs(h, len(tokens))))
        self._tok_window.append((time.perf_counter(), num_new))
        self.counts["tokens"] += num_new
        for h in event.finished:
            req = h.req
            with self._lock:
                for g in req.draft_lens:
                    self.gamma_hist[g] += 1
            if h.tag.record and self.on_finished is not None and req.output_ids:
                try:
                    self.on_finished(req)
                except Exception:  # noqa: BLE001 - recording must never fail a served request
                    self.counts["record_errors"] += 1

    def _done(self, rs: RequestStream, fut: concurrent.futures.Future) -> None:
        """The request's future resolved (engine thread): count it and end its stream."""
        err = fut.exception()
        if err is not None:
            if not isinstance(err, EngineDead):
                self.counts["errors"] += 1
            items = [("error", err), ("done", "error")]
        else:
            req = fut.result()
            if req.finish_reason == "abort":
                self.counts[rs.abort_reason] += 1
            else:
                self.counts["finished"] += 1
            items = [("done", "abort" if req.finish_reason == "abort" else req.finish_reason)]

        def finish():
            self.num_in_flight -= 1
            for item in items:
                rs.queue.put_nowait(item)
        self.loop.call_soon_threadsafe(finish)
