"""EngineService: the one thread that steps a :class:`SpecEngine`, and everything that talks to it.

Ray-free. The inference worker (``actors/inference_worker.py``) and the Serve replica
(``adaflash_ray/serve/runtime.py``) are thin adapters over it::

    service = EngineService(engine, name="worker 0")
    service.subscribe(on_step)                       # called in the engine thread after every step
    h = service.submit(prompt_ids, SamplingParams(max_new_tokens=64), tag="anything")
    req = h.future.result()                          # the finished Request (finish_reason "abort" when aborted)
    service.load_drafter(tensors, version=3).result()    # applied between steps; returns the sha256
    service.shutdown()

Commands - add, abort, load drafter, rollback, calibrate, abort the waiting requests that match, any
``call(fn)`` - are applied by the engine thread between steps, never inside one, in the order they were
issued. After every step each subscriber gets one :class:`StepEvent`: the tokens each request committed in
that step (one step may commit several), the requests that finished, and the step's statistics delta;
subscribers run before the finished requests' futures resolve, so a waiter sees what they did (a shipped
trajectory, a pushed token). A step that raises - or a subscriber that raises - stops the thread:
:attr:`EngineService.dead` becomes an :class:`EngineDead` that every queued and running request's future
and every queued command's future receives, and that every later call raises. A step that never returns (a stuck
device call) stops nothing: :meth:`EngineService.stalled_for` measures it, for a watchdog to act on.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from adaflash_ray.engine.engine import SpecEngine
from adaflash_ray.engine.request import Request, SamplingParams, Status
from adaflash_ray.engine.stats import SpecStats

__all__ = ["EngineDead", "EngineService", "RequestHandle", "StepEvent"]

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine thread has stopped: a step failed (the cause is chained) or the service was shut down."""


@dataclass(eq=False)
class RequestHandle:
    """One submitted request, as its submitter sees it.

    ``future`` resolves to the finished :class:`Request` (``finish_reason`` "stop" / "length" / "abort"), or
    raises ValueError (the engine rejected the request: empty prompt, ids out of the vocabulary, too long) or
    :class:`EngineDead`. ``req`` is set by the engine thread once the request is queued in the engine; ``tag``
    is the submitter's own (e.g. whether to record it); ``num_sent`` counts output tokens already delivered in
    :class:`StepEvent` s."""

    prompt_ids: list[int]
    params: SamplingParams
    tag: Any = None
    request_id: str | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    req: Request | None = None
    num_sent: int = 0


@dataclass
class StepEvent:
    """What one engine step did, delivered to every subscriber in the engine thread.

    committed: ``(handle, tokens)`` per request that committed tokens in this step (the prefill's first token
        included), in running order. finished: handles of the requests that finished in this step (not aborted
        ones), their futures still pending. stats: the step's :class:`SpecStats` delta (counts of this step
        only; the per-shape counters left empty, :meth:`SpecStats.since`). drafter_version: the version that served
        the step.
    """

    committed: list[tuple[RequestHandle, list[int]]]
    finished: list[RequestHandle]
    stats: SpecStats
    drafter_version: int


@dataclass(eq=False)
class _Command:
    fn: Callable[[SpecEngine], Any]
    future: concurrent.futures.Future | None  # None: the command resolves handles itself (add, abort)
    when_idle: bool = False  # applied only once the engine has no unfinished request


class EngineService:
    """Step ``engine`` from a daemon thread named ``name``; every public method is thread-safe.

    Args:
        engine: the SpecEngine; only the engine thread touches it once the service runs. An engine whose
            ``has_unfinished()`` is always False (the SGLang backend, which schedules its own requests) is never
            stepped: the thread then only applies commands (``call``, ``load_drafter``).
        name: names the thread and prefixes :class:`EngineDead` messages (e.g. "worker 0").
        idle_wait_s: how long the idle thread sleeps between checks for a stop (commands wake it at once).
    """

    def __init__(self, engine: SpecEngine, *, name: str = "engine", idle_wait_s: float = 1.0):
        self.engine, self.name, self.idle_wait_s = engine, name, idle_wait_s
        self.dead: EngineDead | None = None
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._applying: list[_Command] = []  # this round's commands not yet applied (engine thread)
        self._open: set[RequestHandle] = set()  # submitted, future not yet resolved (guarded by _cond)
        self._in_engine: dict[str, RequestHandle] = {}  # queued in the engine, not finished (engine thread only)
        self._subscribers: list[Callable[[StepEvent], None]] = []
        self._stop = False
        # time.monotonic() when the engine thread began the step or command it runs now; None while it waits for
        # work. Written by the engine thread only (one assignment: atomic), read by stalled_for
        self.busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def subscribe(self, callback: Callable[[StepEvent], None]) -> None:
        """Call ``callback(event)`` in the engine thread after every step (in subscription order). It must not
        raise: an exception stops the service as a failed step would."""
        with self._cond:
            self._subscribers = [*self._subscribers, callback]

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, tag: Any = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request (added to the engine between steps); returns its handle at once.
        Raises EngineDead if the engine thread has stopped."""
        handle = RequestHandle(list(prompt_ids), params, tag, request_id)
        with self._cond:
            self._raise_if_dead()
            self._open.add(handle)
            self._commands.append(_Command(lambda eng: self._add(handle), None))
            self._cond.notify()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request between steps (``SpecEngine.abort``: a waiting one leaves the queue, a running one
        frees its KV slot); its future resolves to the Request with ``finish_reason`` "abort". No effect on a
        request that finished (or was rejected) first, or once the engine thread has stopped."""
        with self._cond:
            if self.dead is None:
                self._commands.append(_Command(lambda eng: self._abort(handle), None))
                self._cond.notify()

    def call(self, fn: Callable[[SpecEngine], Any], *, when_idle: bool = False) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine thread between steps (with ``when_idle``, between steps once no
        request is queued or running: it is put back behind the commands issued after it until then); the future
        gives its result or raises what it raised (which leaves the engine running).
        Raises EngineDead if the engine thread has stopped."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._raise_if_dead()
            self._commands.append(_Command(fn, fut, when_idle))
            self._cond.notify()
        return fut

    def load_drafter(self, tensors: dict, version: int, sha256: str | None = None, config=None, *,
                     rollback: bool = False) -> concurrent.futures.Future:
        """:meth:`SpecEngine.load_drafter` between steps; requests in flight continue. The future gives the sha256
        or raises CheckpointError (the old drafter stays loaded)."""
        return self.call(lambda eng: eng.load_drafter(tensors, version, sha256, config, rollback=rollback))

    def calibrate(self, **kwargs) -> concurrent.futures.Future:
        """:meth:`SpecEngine.calibrate_costs` (``kwargs`` passed on) at the first moment between steps when no
        request is queued or running (it overwrites the KV slots); later commands wait behind it only while it
        is applied. The future gives the cost table. Raises EngineDead if the engine thread has stopped."""
        return self.call(lambda eng: eng.calibrate_costs(**kwargs), when_idle=True)

    def abort_waiting(self, predicate: Callable[[RequestHandle], bool]) -> concurrent.futures.Future:
        """Between steps, abort every request still waiting for a KV slot (not yet prefilled) for which
        ``predicate(handle)`` is true; running requests finish normally. The future gives how many."""
        def abort_matching(eng: SpecEngine) -> int:
            waiting = [h for h in self._in_engine.values() if h.req.status == Status.WAITING and predicate(h)]
            return sum(self._abort(h) for h in waiting)

        return self.call(abort_matching)

    @property
    def num_open(self) -> int:
        """Requests submitted whose futures have not resolved (queued for the engine, waiting or running)."""
        with self._cond:
            return len(self._open)

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds the step (with its subscribers) or command the engine thread runs now has run (:attr:`busy_since`)
        while requests are open (:attr:`num_open`). 0.0 while the thread waits for work (a request just submitted
        included), with no open request (an idle engine never stalls) and once the thread stopped (:attr:`dead`
        says why).

        Args:
            now: a ``time.monotonic()`` reading; None = now.
        """
        since = self.busy_since
        if since is None or self.dead is not None or not self.num_open:
            return 0.0
        return max((time.monotonic() if now is None else now) - since, 0.0)

    @property
    def num_running(self) -> int:
        """Requests holding a KV slot now (a snapshot read from another thread)."""
        return len(self.engine.scheduler.running)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after the command or step in progress; open requests and queued commands get
        EngineDead. Returns once the thread has ended (or ``timeout_s`` passed)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ engine thread
    def _raise_if_dead(self) -> None:  # with _cond held
        if self.dead is not None:
            raise self.dead

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._commands or eng.has_unfinished()):
                        self._cond.wait(timeout=self.idle_wait_s)
                    if self._stop:
                        break
                    self._applying = list(self._commands)
                    self._commands.clear()
                while self._applying:
                    self.busy_since = time.monotonic()
                    self._apply(self._applying.pop(0))
                if eng.has_unfinished():
                    self.busy_since = time.monotonic()
                    self._step()
                self.busy_since = None
        except BaseException as e:  # every waiter gets the failure instead of hanging
            log.exception("%s: engine step failed", self.name)
            dead = EngineDead(f"{self.name}: engine step failed: {e!r}")
            dead.__cause__ = e
            self._fail(dead)
            return
        self._fail(EngineDead(f"{self.name}: the engine service was shut down"))

    def _apply(self, cmd: _Command) -> None:
        if cmd.future is None:
            cmd.fn(self.engine)
            return
        if cmd.when_idle and self.engine.has_unfinished():
            with self._cond:
                self._commands.append(cmd)
            return
        if not cmd.future.set_running_or_notify_cancel():  # the caller cancelled it
            return
        try:
            result = cmd.fn(self.engine)
        except Exception as e:  # the command's failure, not the engine's (a refused swap: old drafter stays)
            cmd.future.set_exception(e)
        except BaseException as e:  # the thread goes down with it (_fail): this waiter learns why first
            cmd.future.set_exception(e)
            raise
        else:
            cmd.future.set_result(result)

    def _add(self, handle: RequestHandle) -> None:
        try:
            handle.req = self.engine.add_request(handle.prompt_ids, handle.params, request_id=handle.request_id)
        except ValueError as e:  # the engine's message for a bad request
            self._resolve(handle, error=e)
            return
        self._in_engine[handle.req.request_id] = handle

    def _abort(self, handle: RequestHandle) -> bool:
        req = handle.req
        if req is None or self._in_engine.pop(req.request_id, None) is None:
            return False
        self.engine.abort(req)
        self._resolve(handle, result=req)
        return True

    def _step(self) -> None:
        eng = self.engine
        before, version = eng.stats.copy(by_shape=False), eng.drafter_version
        finished = eng.step("spec")
        committed = []
        for h in self._in_engine.values():
            n = len(h.req.output_ids)
            if n > h.num_sent:
                committed.append((h, h.req.output_ids[h.num_sent:]))
                h.num_sent = n
        # a request the service does not own (a command's own generate left it, which generate should not) is not
        # its to resolve: skipped, and said, rather than taking the engine thread down
        done = []
        for r in finished:
            h = self._in_engine.pop(r.request_id, None)
            if h is None:
                log.warning("%s: request %s finished without a handle (left by a command?)", self.name, r.request_id)
            else:
                done.append(h)
        event = StepEvent(committed, done, eng.stats.since(before, by_shape=False), version)
        for callback in self._subscribers:
            callback(event)
        for h in done:
            self._resolve(h, result=h.req)

    def _resolve(self, handle: RequestHandle, result: Request | None = None, error: BaseException | None = None
                 ) -> None:
        with self._cond:
            if handle not in self._open:
                return
            self._open.discard(handle)
        try:
            if error is not None:
                handle.future.set_exception(error)
            else:
                handle.future.set_result(result)
        except concurrent.futures.InvalidStateError:  # the submitter cancelled the future
            pass

    def _fail(self, dead: EngineDead) -> None:
        with self._cond:
            self.dead = dead
            commands = self._applying + list(self._commands)  # this round's rest, then the queue
            self._applying = []
            self._commands.clear()
            handles = list(self._open)
        for cmd in commands:
            if cmd.future is not None and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(dead)
        for h in handles:
            self._resolve(h, error=dead)
