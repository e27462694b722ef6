"""EngineService (adaflash_ray/engine/service.py): the one engine thread, on tiny random models, no Ray.

Commands are applied between steps only, per-step events carry exactly the tokens the requests end with, aborts
free the slot through ``SpecEngine.abort``, and a failed step reaches every waiter - queued and running requests
and queued commands - and every later call; ``stalled_for`` measures only a step that has not returned while
requests are open."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from adaflash_ray.engine import EngineDead, EngineService, SamplingParams, SpecEngine, Status
from adaflash_ray.models import CheckpointError
from conftest import greedy_reference, make_drafter

torch.set_num_threads(1)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (k,), generator=g).tolist() for k in [5, 12, 3, 20, 8][:n]]


def _engine(tiny_target, max_batch_size: int = 2, **kw) -> SpecEngine:
    drafter, head = make_drafter(tiny_target, block_size=6, layers=1, policy="direct", seed=2)
    return SpecEngine(tiny_target, drafter, head, max_batch_size=max_batch_size, max_seq_len=128, **kw)


def test_events_carry_every_token_and_commands_run_between_steps(tiny_target):
    """Greedy results equal the target's; the tokens of each request's events, in order, are its output; each
    request finishes in exactly one event, before its future resolves; stats deltas add up to the engine's; a
    command and a drafter swap queued mid-flight run between steps, and the swap is seen by later steps only."""
    prompts = _prompts(4)
    ref = [greedy_reference(tiny_target, p, 20) for p in prompts]
    engine = _engine(tiny_target, record=True)
    new_drafter, new_head = make_drafter(tiny_target, block_size=6, layers=1, policy="direct", seed=9)
    new = dict(new_drafter.drafter_state_dict())
    new.update({f"length_head.{k}": v for k, v in new_head.state_dict().items()})
    in_step = threading.Event()
    real_step = engine.step

    def step(mode="spec"):
        in_step.set()
        try:
            return real_step(mode)
        finally:
            in_step.clear()

    engine.step = step
    service = EngineService(engine, name="test")
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    total = []
    seen_before_resolved = []
    swapped = threading.Event()

    def on_step(ev):
        assert not in_step.is_set()
        total.append(ev.stats)
        for h, toks in ev.committed:
            tokens.setdefault(h.request_id, []).extend(toks)
        for h in ev.finished:
            finished.append(h.request_id)
            seen_before_resolved.append(not h.future.done())
        if ev.stats.num_engine_steps and not swapped.is_set():  # after the first decode step: swap mid-flight
            swapped.set()
            service.load_drafter(new, version=1)
            service.call(lambda eng: steps_at_call.append(eng.stats.num_engine_steps))

    steps_at_call: list[int] = []
    service.subscribe(on_step)
    handles = [service.submit(p, SamplingParams(max_new_tokens=20), request_id=f"r{i}", tag=i)
               for i, p in enumerate(prompts)]
    reqs = [h.future.result(timeout=120) for h in handles]
    assert service.call(lambda eng: eng.drafter_version).result(timeout=60) == 1
    for h, r, out in zip(handles, reqs, ref):
        assert r.output_ids == out and r.status == Status.FINISHED and h.req is r
        assert tokens[h.request_id] == r.output_ids
        assert r.step_versions == sorted(r.step_versions)
    assert any(set(r.step_versions) == {0, 1} for r in reqs)  # a request in flight across the swap
    assert sorted(finished) == sorted(h.request_id for h in handles) and all(seen_before_resolved)
    assert len(steps_at_call) == 1 and steps_at_call[0] >= 1
    s = total[0]
    for t in total[1:]:
        s = s + t
    assert (s.num_verify_steps, s.num_generated, s.num_accepted) == \
        (engine.stats.num_verify_steps, engine.stats.num_generated, engine.stats.num_accepted)
    assert engine.to_trajectory(reqs[0]).token_ids.tolist() == prompts[0] + reqs[0].output_ids
    assert service.num_open == 0
    service.shutdown()
    with pytest.raises(EngineDead, match="shut down"):
        service.submit(prompts[0], SamplingParams(max_new_tokens=2))


def test_abort_rejection_refused_swap_and_abort_waiting(tiny_target):
    """An abort frees the slot (finish_reason "abort"); a bad request's future raises the engine's ValueError and
    the engine goes on; a version that does not rise is refused through the command's future; abort_waiting
    drops only the waiting requests that match, through SpecEngine.abort."""
    engine = _engine(tiny_target, max_batch_size=1)
    service = EngineService(engine, name="test")
    gate, release = threading.Event(), threading.Event()

    def hold(ev):  # keep the engine thread between steps until the test has queued its commands
        if not gate.is_set():
            gate.set()
            release.wait(60)

    service.subscribe(hold)
    long = service.submit([1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert gate.wait(60)
    data = [service.submit([4, 5, 6 + i], SamplingParams(max_new_tokens=4), tag="data") for i in range(3)]
    user = service.submit([7, 8], SamplingParams(max_new_tokens=4), tag="user")
    bad = service.submit([], SamplingParams(max_new_tokens=4))
    dropped = service.abort_waiting(lambda h: h.tag == "data")
    service.abort(long)
    release.set()
    with pytest.raises(ValueError, match="empty prompt"):
        bad.future.result(timeout=60)
    assert dropped.result(timeout=60) == 3
    for h in data:
        assert h.future.result(timeout=60).finish_reason == "abort" and h.req.output_ids == []
    aborted = long.future.result(timeout=60)
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 100
    assert user.future.result(timeout=60).finish_reason in ("length", "stop")
    assert service.call(lambda eng: eng.scheduler.num_unfinished).result(timeout=60) == 0
    tensors = engine.drafter_tensors()
    assert service.load_drafter(tensors, version=2).result(timeout=60) == engine.drafter_sha256
    with pytest.raises(CheckpointError, match="version 1 refused"):
        service.load_drafter(tensors, version=1).result(timeout=60)
    assert service.load_drafter(tensors, version=1, rollback=True).result(timeout=60) == engine.drafter_sha256
    assert service.dead is None
    service.shutdown()


def test_failed_step_reaches_every_waiter(tiny_target):
    """A step that raises: running and queued requests and a queued command all get EngineDead (the cause
    chained), ``dead`` is set, and later calls raise it at once."""
    engine = _engine(tiny_target, max_batch_size=1)
    entered, go = threading.Event(), threading.Event()
    real = engine.runner.step
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            entered.set()
            go.wait(60)
            raise RuntimeError("device lost")
        return real(*a, **k)

    engine.runner.step = failing
    service = EngineService(engine, name="worker 7")
    running = service.submit([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert entered.wait(60)
    queued = service.submit([4, 5], SamplingParams(max_new_tokens=5))
    command = service.call(lambda eng: "never")
    go.set()
    for fut in (running.future, queued.future, command):
        with pytest.raises(EngineDead, match=r"worker 7: engine step failed: RuntimeError\('device lost'\)") as e:
            fut.result(timeout=60)
        assert isinstance(e.value.__cause__, RuntimeError)
    assert isinstance(service.dead, EngineDead)
    with pytest.raises(EngineDead):
        service.submit([1], SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineDead):
        service.call(lambda eng: None)
    service.abort(running)  # no effect, no error
    assert service.num_open == 0


def test_calibrate_waits_for_an_idle_engine(tiny_target):
    """calibrate() overwrites the KV slots: queued behind running requests it runs only once they finished, and its
    table reaches the cost policy."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=200, calibrate=False)
    service = EngineService(engine, name="test")
    busy = [service.submit(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in _prompts(2)]
    table = service.calibrate(batch_sizes=[1, 2], num_iters=1)
    later = service.call(lambda eng: eng.has_unfinished())
    assert later.result(timeout=120) is True  # a command issued after it ran while the requests still decoded
    got = table.result(timeout=300)
    assert all(h.future.done() and h.future.result().finish_reason == "length" for h in busy)
    assert got["batch_sizes"] == [1, 2] and len(got["costs_ms"][0]) == 7
    assert engine.runner.length_policy.batch_sizes == [1, 2]
    service.shutdown()


def test_a_command_whose_generate_raises_leaves_the_engine_serving(tiny_target):
    """A command (``call(when_idle=True)``) that runs its own ``SpecEngine.generate`` and raises half-way (here its
    ``on_finish``, as the workers' warm-start decode could): generate aborts its requests - none stays queued or
    holds a KV slot -, the command's future raises the error, and the engine thread goes on serving (the service's
    own requests finish with the target's greedy output). The same when a prompt fails validation after others were
    queued."""
    engine = _engine(tiny_target, max_batch_size=2)
    service = EngineService(engine, name="test")
    prompts = _prompts(5)

    def decode_then_fail(eng):
        def boom(req):
            raise RuntimeError("writer failed")

        params = [SamplingParams(max_new_tokens=3 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
        eng.generate(prompts, params, mode="ar", on_finish=boom, admit_min=1, stop_admitting=lambda: False)

    with pytest.raises(RuntimeError, match="writer failed"):
        service.call(decode_then_fail, when_idle=True).result(timeout=120)
    assert service.call(lambda eng: (eng.scheduler.num_unfinished, len(eng.scheduler.free_slots))).result(
        timeout=60) == (0, 2)
    # a prompt that fails validation after others passed: those are not left queued either
    too_long = list(range(1, 200))
    with pytest.raises(ValueError):
        service.call(lambda eng: eng.generate([prompts[0], prompts[1], too_long],
                                              SamplingParams(max_new_tokens=4)), when_idle=True).result(timeout=60)
    assert service.call(lambda eng: eng.scheduler.num_unfinished).result(timeout=60) == 0
    ref = greedy_reference(tiny_target, prompts[1], 10)
    h = service.submit(prompts[1], SamplingParams(max_new_tokens=10))
    assert h.future.result(timeout=120).output_ids == ref
    assert service.dead is None
    service.shutdown()


def test_step_events_carry_no_shape_counters(tiny_target):
    """The per-step stats delta of a StepEvent leaves the per-shape counters out (their copy grows with the shapes
    seen); the engine's own stats keep them, and the events' other counts still add up to the engine's."""
    engine = _engine(tiny_target, max_batch_size=2)
    service = EngineService(engine, name="test")
    events = []
    service.subscribe(lambda ev: events.append(ev.stats))
    for h in [service.submit(p, SamplingParams(max_new_tokens=10)) for p in _prompts(3)]:
        h.future.result(timeout=120)
    service.shutdown()
    assert events and all(not s.shape_steps and not s.shape_seconds for s in events)
    assert sum(engine.stats.shape_steps.values()) == engine.stats.num_engine_steps > 0
    assert sum(s.num_engine_steps for s in events) == engine.stats.num_engine_steps
    assert sum(s.num_generated for s in events) == engine.stats.num_generated


def test_stalled_for_measures_a_hung_step_only_while_requests_are_open(tiny_target):
    """``stalled_for``: 0 while idle however far ``now`` is, and for a request just submitted to an idle thread (it
    waits for work: ``busy_since`` None); while a step hangs with a request open, the time since that step began,
    growing with ``now``; each step sets its own start; 0 again once the request finished and after shutdown."""
    engine = _engine(tiny_target, max_batch_size=1)
    entered, gate = threading.Event(), threading.Event()
    real, calls, starts = engine.step, [], []
    service = None

    def step(mode="spec"):
        calls.append(mode)
        starts.append(service.busy_since)
        if len(calls) == 3:  # the third step hangs until the test lets it go
            entered.set()
            gate.wait(60)
        return real(mode)

    engine.step = step
    service = EngineService(engine, name="test", idle_wait_s=30.0)  # an idle wait far longer than the steps
    time.sleep(0.2)
    assert service.busy_since is None and service.stalled_for(time.monotonic() + 1e3) == 0.0
    h = service.submit([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    try:
        assert entered.wait(60)
        mark = service.busy_since  # the hung step's start
        assert mark == starts[2] and starts[0] < starts[1] < starts[2]  # each step sets its own start
        assert service.stalled_for(mark + 2.5) == pytest.approx(2.5) and service.stalled_for(mark - 1) == 0.0
        time.sleep(0.3)
        assert 0.3 <= service.stalled_for() < 60 and service.busy_since == mark
    finally:
        gate.set()
    assert len(h.future.result(timeout=120).output_ids) == 40
    assert len(calls) > 3 and starts[-1] > mark
    time.sleep(0.2)
    assert service.busy_since is None and service.stalled_for(time.monotonic() + 1e3) == 0.0  # idle again
    service.shutdown()
    assert service.dead is not None and service.stalled_for(time.monotonic() + 1e3) == 0.0
