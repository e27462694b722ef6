"""Per-step-kind wall time in SpecStats and the realised-throughput guard (adaflash_ray/engine/throughput_guard.py).

- step kinds: an AR run has only ``ar``; the kinds' counts add up to ``num_engine_steps`` and their times to
  ``decode_seconds``; the ``cost`` policy with hand-set costs under which drafting never pays takes ``gamma0`` steps
  with ``probe`` steps on its probe schedule, each probe one context catch-up;
- the guard, with a fake clock that makes the steps' times deterministic: drafting steps "slow" -> the guard
  forces AR (exact sequence of step kinds: the AR reference, then back-offs of 16 and 32 steps), its state shows the
  policy's realised rate below AR's; drafting as fast as AR -> no back-off; greedy output equal to AR in both.

Run: python -m pytest -q tests/test_throughput_guard.py   (CPU, tiny random target, ~20 s)
"""
from __future__ import annotations

import itertools

import pytest
import torch
from conftest import greedy_reference, make_drafter

from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats
from adaflash_ray.engine.runner import StepKey
from adaflash_ray.engine.stats import STEP_KINDS
from adaflash_ray.engine.throughput_guard import ThroughputGuard


class FakeClock:
    """Seconds that advance only inside the runner's step: ``draft_ms`` for a step with drafter work (it proposes a
    block or verifies drafts), ``ar_ms`` for one without."""

    def __init__(self, engine: SpecEngine, ar_ms: float, draft_ms: float):
        self.t = 0.0
        real = engine.runner.step

        def step(slots, anchors, anchor_pos, draft_lens, spec, propose=True, *a, **k):
            drafter_work = spec and (propose or any(draft_lens))
            self.t += 1e-3 * (draft_ms if drafter_work else ar_ms)
            return real(slots, anchors, anchor_pos, draft_lens, spec, propose, *a, **k)

        engine.runner.step = step

    def __call__(self) -> float:
        return self.t


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in [4, 11, 25]]


def _engine(tiny_target, **kw) -> SpecEngine:
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=200, calibrate=False,
                     probe_every=4, **kw)
    if eng.guard is not None:  # the step sequences below: min_samples policy samples at every batch size
        eng.guard.min_rows = 0
    return eng


def _kinds_per_step(engine: SpecEngine, num_steps: int) -> list[str]:
    out = []
    for _ in range(num_steps):
        before = engine.stats.copy()
        engine.step()
        (kind,) = (engine.stats - before).kind_steps
        out.append(kind)
    return out


def test_step_kinds_ar_run_and_probe_schedule(tiny_target):
    prompts = _prompts()
    ar = SpecEngine(tiny_target, None, None, max_batch_size=3, max_seq_len=200)
    ar.generate(prompts, SamplingParams(max_new_tokens=20))
    st = ar.stats
    assert set(st.step_ms_by_kind) == {"ar"} and st.step_ms_by_kind["ar"]["count"] == st.num_engine_steps > 0
    assert st.step_ms_by_kind["ar"]["total_ms"] == pytest.approx(1e3 * st.decode_seconds)
    assert st.num_prefills >= 1 and st.num_catch_ups == 0
    # the cost policy, drafting never pays (guard off: the policy's own probe schedule), a fake clock
    eng = _engine(tiny_target, throughput_guard=False)
    clock = FakeClock(eng, ar_ms=1.0, draft_ms=3.0)
    eng.clock = eng.runner.clock = clock
    eng.runner.length_policy.set_costs([1, 2, 3], torch.full((3, 7), 100.0), torch.ones(3))
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=80)) for p in prompts]
    kinds = _kinds_per_step(eng, 31)
    # steps 1-4 γ = 0, step 5 probes (the wait doubles to 8), 6-13 γ = 0, step 14 probes (16), 15-30, 31 probes
    assert [i + 1 for i, k in enumerate(kinds) if k == "probe"] == [5, 14, 31]
    assert set(kinds) == {"gamma0", "probe"}
    st = eng.stats
    by = st.step_ms_by_kind
    assert list(by) == ["gamma0", "probe"] and sum(v["count"] for v in by.values()) == st.num_engine_steps == 31
    assert by["gamma0"] == {"count": 28, "total_ms": pytest.approx(28.0), "mean_ms": pytest.approx(1.0)}
    assert by["probe"] == {"count": 3, "total_ms": pytest.approx(9.0), "mean_ms": pytest.approx(3.0)}
    assert sum(v["total_ms"] for v in by.values()) == pytest.approx(1e3 * st.decode_seconds)
    # each probe catches up the skipped context of the γ = 0 steps before it: 3 slots x 4, 8 and 16 positions
    assert st.num_catch_ups == 3 and st.catch_up_positions == 3 * (4 + 8 + 16)
    t = st.timing()
    assert t["catch_up"]["count"] == 3 and t["catch_up"]["num_positions"] == 84 and t["num_guard_steps"] == 0
    assert t["steps"] == by and t["prefill"]["count"] == 1
    # by the shape the device ran: 3 rows (slots 0-2), width 1 (γ = 0 everywhere; a probe proposes, verifies none)
    shapes = t["steps_by_shape"]
    assert {k: {s: r["count"] for s, r in v.items()} for k, v in shapes.items()} == {"gamma0": {"3x1": 28},
                                                                                    "probe": {"3x1": 3}}
    assert shapes["probe"]["3x1"]["mean_ms"] == pytest.approx(3.0)
    while eng.has_unfinished():
        eng.step()
    for r, p in zip(reqs, prompts):
        assert r.output_ids == greedy_reference(tiny_target, p, 80)
    assert sum(st.kind_steps.values()) == st.num_engine_steps and set(st.kind_steps) <= set(STEP_KINDS)
    window = st - SpecStats()
    assert window.kind_steps == st.kind_steps and (st + st).kind_steps["probe"] == 2 * st.kind_steps["probe"]
    assert window.shape_steps == st.shape_steps and sum(st.shape_steps.values()) == st.num_engine_steps
    assert {k[2] for k in st.shape_steps} == {1}  # never a draft to verify under this table


def test_guard_forces_ar_when_drafting_is_slow(tiny_target):
    """Drafting always pays by the (hand-set) table, but each drafting step takes 20 ms against AR's 1 ms: the guard
    first takes its AR reference (3 steps), then backs off 16, then 32 AR steps; greedy output is AR's."""
    prompts = _prompts()
    eng = _engine(tiny_target)
    clock = FakeClock(eng, ar_ms=1.0, draft_ms=20.0)
    eng.clock = eng.runner.clock = clock
    eng.runner.length_policy.set_costs([1, 2, 3], torch.ones(3, 7), torch.full((3,), 100.0))
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=150, ignore_eos=True)) for p in prompts]
    kinds = _kinds_per_step(eng, 58)
    expected = ["draft"] * 3 + ["gamma0"] * 3 + ["probe"] + ["gamma0"] * 16 + ["probe", "draft", "draft"] + \
        ["gamma0"] * 32
    assert kinds == expected
    state = eng.guard.state()["3"]
    assert state["num_backoffs"] == 2 and state["factor"] == 4 and state["num_forced"] == 3 + 16 + 32
    assert state["forced_left"] == 0 and state["num_ar_samples"] == 3 + 16 + 32
    assert state["ar_tokens_per_ms"] == pytest.approx(1.0)  # per row: 1 token in 1 ms
    assert state["policy_tokens_per_ms"] < 0.98 * state["ar_tokens_per_ms"]
    assert eng.stats.num_guard_steps == eng.stats.kind_steps["gamma0"] == 51  # the policy itself never answers 0
    while eng.has_unfinished():
        eng.step()
    for r, p in zip(reqs, prompts):
        assert r.output_ids == greedy_reference(tiny_target, p, 150)
    # a drafter reload forgets the policy's record (the AR one stays) and ends the back-off
    eng.guard.buckets[2].forced_left = 5
    eng.load_drafter(eng.drafter_tensors(), version=1)
    state = eng.guard.state()["3"]
    assert state["num_policy_samples"] == 0 and state["forced_left"] == 0 and state["factor"] == 1
    assert state["num_ar_samples"] > 0


def test_guard_never_backs_off_when_drafting_is_as_fast_as_ar(tiny_target):
    """Drafting steps as fast as AR steps: a drafting step commits at least one token per row, so the policy is never
    slower; the guard only takes its AR reference (at most min_samples steps per bucket). Guard off: no forced step.
    Greedy output equal to AR's in both."""
    prompts = _prompts()
    outs = {}
    for guard in (True, False):
        eng = _engine(tiny_target, throughput_guard=guard)
        eng.clock = eng.runner.clock = FakeClock(eng, ar_ms=1.0, draft_ms=1.0)
        eng.runner.length_policy.set_costs([1, 2, 3], torch.ones(3, 7), torch.full((3,), 100.0))
        reqs = eng.generate(prompts, SamplingParams(max_new_tokens=100, ignore_eos=True))
        outs[guard] = [r.output_ids for r in reqs]
        if guard:
            state = eng.guard.state()
            assert all(b["num_backoffs"] == 0 and b["num_forced"] <= eng.guard.min_samples for b in state.values())
            assert state["3"]["num_forced"] == 3 and eng.stats.num_guard_steps == sum(
                b["num_forced"] for b in state.values())
            assert state["3"]["policy_tokens_per_ms"] >= state["3"]["ar_tokens_per_ms"]
        else:
            assert eng.guard is None and eng.stats.num_guard_steps == 0 and "gamma0" not in eng.stats.kind_steps
        assert eng.stats.kind_steps["draft"] > 0.8 * eng.stats.num_engine_steps
    for r, p in zip(outs[True], prompts):
        assert r == greedy_reference(tiny_target, p, 100)
    assert outs[True] == outs[False]


def test_guard_unit_rules():
    """The rules on their own: no comparison before min_samples of each kind; a back-off doubles while the policy
    stays slower (up to PROBE_MAX_FACTOR), resets to 1 once it is not; a new batch ends a back-off; the AR reference
    is refreshed after ar_refresh_steps; buckets by batch size; bad settings raise."""
    from adaflash_ray.engine.length_policy import PROBE_MAX_FACTOR

    g = ThroughputGuard([1, 4], min_samples=2, backoff_steps=2, ar_refresh_steps=0, min_rows=0)
    for _ in range(2):
        assert not g.force_ar(3)
        g.record(3, True, 4, 10.0)  # policy: 0.4 tokens / ms
    assert g.force_ar(3)  # the AR reference: min_samples steps in a row
    g.record(3, False, 4, 1.0)  # AR: 4 tokens / ms
    assert g.force_ar(4)
    g.record(4, False, 4, 1.0)
    assert not g.force_ar(4)
    assert g.state()["4"]["num_backoffs"] == 0 and g.state()["1"]["num_ar_samples"] == 0  # batch 3 -> bucket 4
    factors = []
    for _ in range(6):
        g.record(4, True, 4, 10.0)  # min_samples policy steps since the last back-off: a new one
        g.record(4, True, 4, 10.0)
        n = 0
        while g.force_ar(4):
            n += 1
        factors.append(n // 2)
    assert factors == [1, 2, 4, 8, PROBE_MAX_FACTOR, PROBE_MAX_FACTOR]
    for _ in range(40):  # the policy catches up: the factor goes back to 1
        g.record(4, True, 40, 1.0)
    assert g.state()["4"]["factor"] == 1 and g.state()["4"]["policy_tokens_per_ms"] > 4.0
    g.buckets[1].forced_left = 7
    g.new_batch()
    assert not g.force_ar(4) and g.state()["4"]["num_policy_samples"] > 0  # the record stays
    r = ThroughputGuard([1], min_samples=2, ar_refresh_steps=5, min_rows=0)
    r.record(1, False, 1, 1.0)
    r.record(1, False, 1, 1.0)
    for _ in range(4):
        r.record(1, True, 2, 1.0)
        assert not r.force_ar(1)
    r.record(1, True, 2, 1.0)
    for _ in range(2):  # an AR reference 5 steps old: refreshed by min_samples AR steps
        assert r.force_ar(1)
        r.record(1, False, 1, 1.0)
    assert not r.force_ar(1) and r.state()["1"]["num_ar_samples"] == 4
    for bad in (dict(margin=1.0), dict(decay=0.0), dict(min_samples=0), dict(backoff_steps=0), dict(min_rows=-1)):
        with pytest.raises(ValueError):
            ThroughputGuard([1], **bad)
    with pytest.raises(ValueError, match="strictly increasing"):
        ThroughputGuard([4, 2])


def _forced_share(guard: ThroughputGuard, tokens_of, policy_ms: float, ar_ms: float, catch_up_ms: float,
                  steps: int, batch_size: int = 1) -> float:
    """Share of ``steps`` the guard forces to AR for one live row at ``batch_size`` (its slot) when a policy step
    commits ``tokens_of()`` tokens in ``policy_ms`` plus ``catch_up_ms`` per AR step before it (the drafter context's
    catch-up after an AR stretch) and an AR step one token in ``ar_ms``."""
    forced = behind = 0
    for _ in range(steps):
        if guard.force_ar(batch_size):
            forced += 1
            behind += 1
            guard.record(batch_size, False, 1, ar_ms)
        else:
            guard.record(batch_size, True, tokens_of(), policy_ms + catch_up_ms * behind)
            behind = 0
    return forced / steps


def test_guard_needs_more_policy_samples_at_small_batches():
    """At batch 1 a drafting step commits 1 token or many: a policy 1.8x AR on average (70 % of its steps 1 token, the
    rest 2-8, 1.6 ms against AR's 1.3 ms, plus 0.05 ms of catch-up per AR step before a drafting one) is backed off on
    short unlucky stretches when every batch size decides on min_samples steps, and each back-off's catch-up makes the
    next likelier; deciding on ~min_rows rows' worth of policy samples (32 steps at batch 1) it only takes its AR
    reference, while a policy slower than AR (1 token in 1.6 ms) is still forced to AR on most steps. The count is of
    live rows, not of the bucket's size: one live row in the bucket of 8 (a run's tail, its request in slot 7) is
    judged as at batch 1."""
    import random

    old, new = [], []
    for seed in range(4):
        for guard, out, bsz in ((ThroughputGuard([1], min_rows=0), old, 1), (ThroughputGuard([1]), new, 1),
                                (ThroughputGuard([1, 8]), new, 8)):
            rng = random.Random(seed)
            out.append(_forced_share(guard, lambda: 1 if rng.random() < 0.7 else rng.randint(2, 8), 1.6, 1.3, 0.05,
                                     4000, bsz))
    assert max(new) < 0.03 and min(old) > 0.05 and sum(old) / 4 > 0.2, (old, new)
    assert _forced_share(ThroughputGuard([1]), lambda: 1, 1.6, 1.3, 0.05, 4000) > 0.8
    g = ThroughputGuard([64])  # 64 live rows a step: min_samples steps decide
    for _ in range(3):
        g.record(64, False, 64, 1.0, 64)
    for i in range(3):
        assert not g.force_ar(64), i
        g.record(64, True, 64, 2.0, 64)
    assert g.force_ar(64) and g.state()["64"]["num_backoffs"] == 1


def test_guard_ignores_steps_that_capture_a_graph(tiny_target):
    """A step that captures its CUDA graph (``ModelRunner.step_captured``; lazily, inside the timed step: at c1 the
    bench's ``--warmup short`` leaves most of a hybrid's graphs to the timed runs) costs a one-off tens of ms: the guard
    does not charge it to the policy, so drafting as fast as AR never backs off although a few steps were 200 ms.
    The step-kind times still hold the wall time."""
    eng = _engine(tiny_target)
    clock = FakeClock(eng, ar_ms=1.0, draft_ms=1.0)
    eng.clock = eng.runner.clock = clock
    eng.runner.length_policy.set_costs([1, 2, 3], torch.ones(3, 7), torch.full((3,), 100.0))
    fake, drafts, captured = eng.runner.step, [0], (8, 20, 30)

    def step(slots, anchors, anchor_pos, draft_lens, spec, *a, **k):  # drafting steps 8, 20, 30 capture: +200 ms
        out = fake(slots, anchors, anchor_pos, draft_lens, spec, *a, **k)
        if spec and any(draft_lens):
            drafts[0] += 1
            if drafts[0] in captured:
                clock.t += 0.2
                eng.runner.step_captured = True
        return out

    eng.runner.step = step
    reqs = eng.generate(_prompts(), SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert drafts[0] > max(captured) and eng.stats.decode_seconds > 0.2 * len(captured)
    assert all(b["num_backoffs"] == 0 for b in eng.guard.state().values())
    for r, p in zip(reqs, _prompts()):
        assert r.output_ids == greedy_reference(tiny_target, p, 100)


def test_would_force_looks_ahead_without_changing_the_guard():
    """``would_force`` (the prefill's look ahead) answers what the next ``force_ar`` returns, and changes nothing: over
    a random sequence of records at two batch buckets (seeded), each answer equals the ``force_ar`` call after it and
    a second look ahead gives the same answer."""
    import random

    rng = random.Random(7)
    g = ThroughputGuard([1, 4], min_samples=3, backoff_steps=2, ar_refresh_steps=9, min_rows=0)
    forced = 0
    for _ in range(600):
        b = rng.choice([1, 4])
        ahead = g.would_force(b)
        assert g.would_force(b) == ahead
        now = g.force_ar(b)
        assert now == ahead
        forced += now
        # a policy step slower than AR on bucket 4 (back-offs), as fast on bucket 1
        g.record(b, not now, 2 if (now or b == 1) else 3, 1.0 if (now or b == 1) else 3.0)
    assert 0 < forced < 600 and g.state()["4"]["num_backoffs"] > 0



@pytest.mark.parametrize("reference_rows", [0, 5])
def test_would_force_after_sees_the_forced_steps_own_record(reference_rows):
    """``would_force_after`` (asked by a forced step before its own record) answers what ``would_force`` answers once
    that step is recorded (``num_rows`` rows) or, with None, left unrecorded - the answer at the last step of a
    reference run included, where ``would_force`` asked before the record still sees the run's sample missing. Over a
    random sequence of records at two buckets (seeded); it changes nothing."""
    import random

    rng = random.Random(11)
    g = ThroughputGuard([1, 4], min_samples=3, backoff_steps=2, ar_refresh_steps=9, min_rows=0,
                        reference_rows=reference_rows)
    ends = 0
    for _ in range(800):
        b = rng.choice([1, 4])
        now = g.force_ar(b)
        if not now:
            g.record(b, True, 2 if b == 1 else 3, 1.0 if b == 1 else 3.0, rng.randint(1, 3))
            continue
        rows = rng.choice([None, 1, 2, 3])
        before = g.would_force(b)
        after = g.would_force_after(b, rows)
        assert g.would_force_after(b, rows) == after and g.would_force(b) == before
        if rows is not None:
            g.record(b, False, rows, 1.0, rows)
        assert g.would_force(b) == after, (rows, before, after)
        ends += before and not after
    assert ends > 0  # reference runs whose last step the look ahead before the record got wrong

def test_makespan_guard_rule(tiny_target):
    """``makespan_guard``: a verdict for AR where the most tokens left x the AR step ms is below (1 - MAKESPAN_MARGIN)
    x the most (tokens left / own committed per drafting step) x the drafting step ms (the guard's averages at the
    bucket); a verdict not below MAKESPAN_DECISIVE x that forces 16 AR steps, then 8 policy steps, then the next
    verdict (32 while it repeats); none before the guard has both kinds' samples, nor while a request waits or is held
    back; ValueError without the throughput guard."""
    from adaflash_ray.engine.engine import MAKESPAN_BACKOFF, MAKESPAN_DECISIVE, MAKESPAN_MARGIN, MAKESPAN_TRIAL

    with pytest.raises(ValueError, match="makespan_guard needs the throughput guard"):
        _engine(tiny_target, throughput_guard=False, makespan_guard=True)
    eng = _engine(tiny_target, makespan_guard=True)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    running = list(eng.scheduler.running)
    assert len(running) == 3 and not eng.scheduler.waiting
    # a wave's first MAKESPAN_TRIAL steps are the policy's; then no verdict without the guard's samples
    assert [eng._makespan_prefers_ar(running, 3) for _ in range(MAKESPAN_TRIAL + 1)] == [False] * (MAKESPAN_TRIAL + 1)
    assert eng.guard.step_costs(3) is None
    for _ in range(3):  # AR: 1 token per row in 1 ms; drafting: 3 tokens per row in 2 ms
        eng.guard.record(3, False, 3, 1.0, 3)
        eng.guard.record(3, True, 9, 2.0, 3)
    assert eng.guard.step_costs(3) == pytest.approx((1.0, 2.0, 3.0))
    for r in reqs:  # every request commits 3 per drafting step: drafting's horizon is 2/3 of AR's
        r.spec_steps, r.spec_tokens = 20, 60
    assert not eng._makespan_prefers_ar(running, 3)
    eng.num_held = 1  # held back by generate: the batch does not end with these (checked before anything else)
    reqs[1].spec_tokens = 24
    assert not eng._makespan_prefers_ar(running, 3)
    eng.num_held = 0
    # one request at 1.6 per drafting step: (steps + 4) / (tokens + 4 x 3) = 24 / 44 -> 12/11 x tokens left ms, above
    # AR's 1 x but within the margin: no verdict for AR
    left = [r.params.max_new_tokens - len(r.output_ids) for r in running]
    assert max(left) * 1.0 > (1 - MAKESPAN_MARGIN) * left[1] * 24 / 44 * 2.0 > 0.95 * max(left)
    reqs[1].spec_tokens = 32
    assert not eng._makespan_prefers_ar(running, 3) and eng._ms_forced_left == 0
    # at 1.5 per drafting step: 24 / 42 -> 8/7 x tokens left ms: AR's is below (1 - margin) x that, not decisively
    reqs[1].spec_tokens = 30
    spec_h = left[1] * 24 / 42 * 2.0
    assert MAKESPAN_DECISIVE * spec_h < max(left) * 1.0 < (1 - MAKESPAN_MARGIN) * spec_h
    got = [eng._makespan_prefers_ar(running, 3) for _ in range(MAKESPAN_BACKOFF + MAKESPAN_TRIAL + 2)]
    assert got == [True] * MAKESPAN_BACKOFF + [False] * MAKESPAN_TRIAL + [True, True]  # the back-off, a trial, again
    assert eng._ms_forced_left == 2 * MAKESPAN_BACKOFF - 2 and eng._ms_factor == 4
    assert eng._next_step_forced()  # an admission's look-ahead sees the back-off: no first block to drop
    eng.load_drafter(eng.drafter_tensors(), version=1)  # new weights: no verdict and no record of the old ones
    assert (eng._ms_forced_left, eng._ms_factor, eng._ms_trial) == (0, 1, 0) and not eng._next_step_forced()
    assert all(r.spec_steps == r.spec_tokens == 0 for r in reqs)
    for r in reqs:
        r.spec_steps, r.spec_tokens = 20, 60
    reqs[1].spec_tokens = 24
    for _ in range(3):  # the reload forgot the drafting steps' averages (the AR ones stay)
        eng.guard.record(3, True, 9, 2.0, 3)
    eng._ms_forced_left, eng._ms_factor = 5, 4
    eng._ms_forced_left, eng._ms_trial = 0, MAKESPAN_TRIAL
    reqs[1].spec_tokens = 60  # the request caught up: drafting's horizon again, the factor back to 1
    assert not eng._makespan_prefers_ar(running, 3) and eng._ms_factor == 1
    reqs[1].spec_tokens = 24
    eng.add_request(_prompts()[0], SamplingParams(max_new_tokens=4))  # queued: no free slot
    assert eng.scheduler.waiting and not eng._makespan_prefers_ar(running, 3)
    eng._ms_forced_left, eng._ms_factor = 7, 4
    eng.scheduler.running[0].params.max_new_tokens = len(eng.scheduler.running[0].output_ids)  # ends: a slot frees
    admitted = 0
    while eng.scheduler.waiting:  # it finishes; a later step admits the queued request into the running wave
        assert eng._ms_forced_left == 7  # no verdict and no forced step while a request waits
        eng.step()
        admitted += 1
    assert admitted <= 2 and len(eng.scheduler.running) == 3
    # the admission cleared the back-off (the step's own check then began a trial)
    assert (eng._ms_forced_left, eng._ms_factor, eng._ms_trial) == (0, 1, 1)


def test_makespan_guard_forces_ar_steps_and_stays_lossless(tiny_target):
    """A random drafter commits about one token per drafting step at 3x AR's step ms: once the throughput guard has
    its samples the makespan guard takes AR steps (counted in ``num_makespan_steps``, reported by ``timing()``),
    and the greedy outputs are AR's."""
    prompts = _prompts()
    eng = _engine(tiny_target, makespan_guard=True)
    eng.clock = eng.runner.clock = FakeClock(eng, ar_ms=1.0, draft_ms=3.0)
    eng.runner.length_policy.set_costs([1, 2, 3], torch.ones(3, 7), torch.full((3,), 100.0))
    reqs = eng.generate(prompts, SamplingParams(max_new_tokens=60, ignore_eos=True))
    st = eng.stats
    assert st.num_makespan_steps > 0 and st.timing()["num_makespan_steps"] == st.num_makespan_steps
    assert st.kind_steps["gamma0"] >= st.num_makespan_steps
    assert all(r.spec_steps > 0 and r.spec_tokens >= r.spec_steps for r in reqs)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == greedy_reference(tiny_target, p, 60)


def test_makespan_guard_decisive_verdict_and_history_prior(tiny_target):
    """A verdict for AR with AR's horizon below MAKESPAN_DECISIVE x drafting's is taken again right after its
    back-off (no trial); with MAKESPAN_HISTORY_MIN finished requests' own records, a new wave's first verdict comes at
    once and prices the requests without a record at the history's 1 / (n + 1) quantile; a drafter reload forgets the
    history. A finished request enters the history only after MAKESPAN_HISTORY_MIN_STEPS drafting steps."""
    from adaflash_ray.engine.engine import (MAKESPAN_BACKOFF, MAKESPAN_DECISIVE, MAKESPAN_HISTORY_MIN,
                                            MAKESPAN_HISTORY_MIN_STEPS, MAKESPAN_TRIAL)

    ticks = itertools.count()  # a fake clock: the real AR steps below record 1 ms each, whatever the machine's load
    eng = _engine(tiny_target, makespan_guard=True, clock=lambda: 1e-3 * next(ticks))
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    running = list(eng.scheduler.running)
    assert eng._ms_trial == 0  # no history: the wave starts with a trial
    for _ in range(3):  # AR: 1 token per row in 1 ms; drafting: 3 tokens per row in 2 ms
        eng.guard.record(3, False, 3, 1.0, 3)
        eng.guard.record(3, True, 9, 2.0, 3)
    eng._ms_trial = MAKESPAN_TRIAL
    for r in reqs:
        r.spec_steps, r.spec_tokens = 20, 60
    reqs[1].spec_tokens = 20  # 1 token per drafting step: (20 + 4) / (20 + 12) -> 1.5 x tokens left at 2 ms
    left = [r.params.max_new_tokens - len(r.output_ids) for r in running]
    assert max(left) * 1.0 < MAKESPAN_DECISIVE * left[1] * 24 / 32 * 2.0  # decisive
    got = [eng._makespan_prefers_ar(running, 3) for _ in range(MAKESPAN_BACKOFF + 2 * MAKESPAN_BACKOFF + 1)]
    assert got == [True] * (3 * MAKESPAN_BACKOFF + 1)  # the back-off, then at once the next (twice as long), ...
    assert eng._ms_factor == 8
    # the history: requests that drafted fewer than MAKESPAN_HISTORY_MIN_STEPS steps are left out
    fin = eng.scheduler.running[0]
    fin.spec_steps, fin.spec_tokens = MAKESPAN_HISTORY_MIN_STEPS - 1, 7
    fin.params.max_new_tokens = len(fin.output_ids)
    eng.step("ar")  # an AR step: no drafting record added
    assert fin not in eng.scheduler.running and len(eng._ms_history) == 0
    while eng.has_unfinished():  # the rest of the wave at AR: its two requests' own records join the history
        eng.step("ar")
    assert sorted(eng._ms_history) == [1.0, 3.0]
    eng._ms_history.clear()
    eng._ms_history.extend([3.0] * (MAKESPAN_HISTORY_MIN - 1) + [1.0])  # one slow request in 16
    assert eng._ms_history_quantile(3) == 3.0  # the slowest of 3 such requests: most likely at 3
    assert eng._ms_history_quantile(15) == pytest.approx(1.0 + 2.0 * 0.9375)  # of 15: the 1/16 quantile, 2.875
    assert 1.0 < eng._ms_history_quantile(15) < eng._ms_history_quantile(3) <= 3.0
    wave = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    running = list(eng.scheduler.running)
    assert all(r.spec_steps == 0 for r in wave) and eng._ms_trial == MAKESPAN_TRIAL  # no trial: a verdict at once
    # unknown requests at the quantile (3 per drafting step at 2 ms) against AR's 1 per 1 ms: drafting's horizon
    # 2/3 of AR's - no verdict for AR
    assert not eng._makespan_prefers_ar(running, 3)
    eng._ms_history.extend([1.0] * 8)  # 9 slow requests in 24: the slowest of 3 at 1 per drafting step (2 ms)
    assert eng._makespan_prefers_ar(running, 3)
    eng._ms_forced_left = 0
    eng.load_drafter(eng.drafter_tensors(), version=1)
    assert len(eng._ms_history) == 0 and eng._ms_trial == 0


def test_makespan_history_leaves_out_requests_with_their_own_draft_len(tiny_target):
    """The history prices requests drafted by the length policy: a finished request that fixed its own γ
    (``SamplingParams.draft_len``; its committed tokens per step are that γ's, and the guard never judges a batch
    with one) does not join it; the policy's requests of the same batch do."""
    eng = _engine(tiny_target, makespan_guard=True)
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, draft_len=1 if i else None)
              for i in range(len(prompts))]
    reqs = eng.generate(prompts, params)
    assert all(r.spec_steps >= 8 for r in reqs[1:])  # drafting steps enough to count
    assert len(eng._ms_history) == (reqs[0].spec_steps >= 8)
    if eng._ms_history:
        assert eng._ms_history[0] == reqs[0].spec_tokens / reqs[0].spec_steps


@pytest.mark.parametrize("lock", [False, True])
def test_makespan_verdict_on_the_history_alone_skips_the_trial_for_a_few_waves(tiny_target, lock):
    """Where no running request has a drafting record yet, a verdict for AR that the history makes decisive decides
    the wave alone - no trial after its back-off, no request of the wave drafts (under ``makespan_lock`` the wave is
    locked at its first step: every later step plain) - in MAKESPAN_HISTORY_WAVES waves in a row; the next wave drafts
    its trial (the requests' own records), so a history that locked waves never add to is refreshed. Outputs are
    AR's throughout."""
    from adaflash_ray.engine.engine import MAKESPAN_HISTORY_MIN, MAKESPAN_HISTORY_WAVES

    prompts = _prompts()
    eng = _engine(tiny_target, makespan_guard=True, makespan_lock=lock)
    eng.clock = eng.runner.clock = FakeClock(eng, ar_ms=1.0, draft_ms=3.0)
    eng.runner.length_policy.set_costs([1, 2, 3], torch.ones(3, 7), torch.full((3,), 100.0))
    sp = SamplingParams(max_new_tokens=60, ignore_eos=True)
    eng.generate(prompts, sp)  # the throughput guard's samples
    assert eng.guard.step_costs(3) is not None
    eng._ms_history.clear()
    eng._ms_history.extend([1.0] * MAKESPAN_HISTORY_MIN)  # a prior of 1 token per drafting step at 3x AR's ms
    eng._ms_history_added += MAKESPAN_HISTORY_MIN
    eng._ms_history_waves = 0
    refs = [greedy_reference(tiny_target, p, 60) for p in prompts]
    for wave in range(MAKESPAN_HISTORY_WAVES):
        before = eng.stats.copy()
        reqs = eng.generate(prompts, sp)
        st = eng.stats - before
        assert all(r.spec_steps == 0 for r in reqs), wave  # nobody drafted: the history decided
        assert st.num_makespan_steps == st.num_engine_steps and st.num_drafting_steps == 0, wave
        assert st.num_plain_steps == (st.num_engine_steps - 1 if lock else 0), wave  # locked at the first step
        assert [r.output_ids for r in reqs] == refs
    assert eng._ms_history_waves == MAKESPAN_HISTORY_WAVES
    reqs = eng.generate(prompts, sp)
    assert any(r.spec_steps > 0 for r in reqs)  # this wave's trial: the requests' own records again
    assert [r.output_ids for r in reqs] == refs


def test_reference_rows_make_the_reference_run_hold_that_many_rows():
    """``reference_rows``: a reference run goes on, one forced step at a time, until its recorded AR-side steps hold
    that many live rows (one row a step here: 8 steps, not ``min_samples``' 3); a refresh counts them again; each AR
    sample then weighs rows / reference_rows. Without it (0) the run is ``min_samples`` steps, as before."""
    def reference_run(g: ThroughputGuard) -> int:  # forced steps until the guard lets the policy run, each recorded
        n = 0
        while g.force_ar(1):
            n += 1
            g.record(1, False, 1, 1.0)
        return n

    for ref, expect in ((8, 8), (0, 3)):
        g = ThroughputGuard([1], min_samples=3, min_rows=0, reference_rows=ref, ar_refresh_steps=20)
        for _ in range(3):  # the policy's samples first: then the reference is due
            assert not g.force_ar(1)
            g.record(1, True, 4, 2.0)
        forced = reference_run(g)
        assert forced == expect, (ref, forced)
        bk = g.buckets[0]
        assert bk.ar.num_samples == expect and bk.ref_rows == expect
        for _ in range(20):  # a refresh after ar_refresh_steps policy steps: as long a run again
            g.record(1, True, 4, 2.0)
        refreshed = reference_run(g)
        assert refreshed == expect, (ref, refreshed)
    with pytest.raises(ValueError, match="reference_rows"):
        ThroughputGuard([1], reference_rows=-1)


@pytest.mark.parametrize("ref_tokens, expect", [(1, 3), (2, 8)])
def test_reference_stop_ends_a_reference_far_slower_than_the_policy(ref_tokens, expect):
    """``reference_stop``: a reference run of ``reference_rows`` ends after ``min_samples`` steps once its rate is
    below ``reference_stop x`` the policy's (1 token per ms against the policy's 2: 3 steps, not 8), and a refresh
    after such a run starts a run of its own, judged by its own samples; a reference as fast as the policy (2 per ms)
    runs its full rows."""
    g = ThroughputGuard([1], min_samples=3, min_rows=0, reference_rows=8, reference_stop=0.7, ar_refresh_steps=20)
    for _ in range(3):
        assert not g.force_ar(1)
        g.record(1, True, 4, 2.0)  # the policy: 2 tokens per ms
    for rep in range(2):
        n = 0
        while g.force_ar(1):
            n += 1
            g.record(1, False, ref_tokens, 1.0)
        assert n == expect, (rep, n)
        assert g.buckets[0].ref_rows == expect
        for _ in range(20):
            g.record(1, True, 4, 2.0)
    n = 0  # the block as fast as the policy now: the refresh judges its own samples, not the slow runs' average
    while g.force_ar(1):
        n += 1
        g.record(1, False, 2, 1.0)
    assert n == 8, n
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="reference_stop"):
            ThroughputGuard([1], reference_stop=bad)


def test_makespan_lock_ends_drafting_with_plain_ar_steps(tiny_target):
    """``makespan_lock``: the random drafter's decisive verdicts for AR lock the running requests; from then on every
    step is the runner's plain AR step (counted in ``num_plain_steps``; ``gamma0`` steps of the makespan guard) that
    writes neither the feature history nor the device lookup's token history, and the greedy outputs are AR's. The
    lock needs the makespan guard, and an engine recording features cannot have it."""
    with pytest.raises(ValueError, match="makespan_lock needs makespan_guard"):
        _engine(tiny_target, makespan_lock=True)
    with pytest.raises(ValueError, match="record_features"):
        _engine(tiny_target, makespan_guard=True, makespan_lock=True, record=True)
    prompts = _prompts()
    eng = _engine(tiny_target, makespan_guard=True, makespan_lock=True, draft_sources=("dflash", "suffix"),
                  lookup_device="device")
    eng.clock = eng.runner.clock = FakeClock(eng, ar_ms=1.0, draft_ms=3.0)
    eng.runner.length_policy.set_costs([1, 2, 3], torch.ones(3, 7), torch.full((3,), 100.0))
    plain_calls = []
    real_step_fn = eng.runner._step_fn

    def step_fn(*key):
        plain_calls.append(StepKey(*key).plain)
        return real_step_fn(*key)
    eng.runner._step_fn = step_fn
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=90, ignore_eos=True)) for p in prompts]
    while not all(r.ar_locked for r in reqs):
        assert eng.has_unfinished()
        eng.step()
    assert not any(plain_calls)  # nothing plain before the lock
    feat, hist = eng.runner.feat_hist.clone(), eng.runner.lookup.history.clone()
    before = eng.stats.copy()
    eng.step()
    delta = eng.stats - before
    assert plain_calls[-1] and delta.num_plain_steps == delta.num_makespan_steps == delta.kind_steps["gamma0"] == 1
    assert delta.num_verify_steps == delta.draft_len_hist[0] == delta.source_hist["none"] == len(reqs)  # γ = 0 rows
    assert torch.equal(eng.runner.feat_hist, feat) and torch.equal(eng.runner.lookup.history, hist)
    eng.step()
    late = eng.add_request(prompts[0], SamplingParams(max_new_tokens=5, ignore_eos=True))  # queued: no free slot
    eng.step()
    assert eng.scheduler.waiting and not plain_calls[-1]  # a request waits: the wave's steps run as usual
    while eng.has_unfinished():
        eng.step()
    st = eng.stats
    assert st.num_plain_steps > 1 and st.timing()["num_plain_steps"] == st.num_plain_steps
    plain = st.timing()["plain"]  # their time, part of the gamma0 kind's (the fake clock: 1 ms an AR step)
    assert plain["count"] == st.num_plain_steps and 0 < plain["total_ms"] <= st.step_ms_by_kind["gamma0"]["total_ms"]
    assert st.timing()["num_first_replays"] == 0  # no CUDA graphs on CPU
    assert st.num_plain_steps == sum(plain_calls)
    for r, p, n in zip(reqs + [late], prompts + [prompts[0]], [90] * 3 + [5]):
        assert r.output_ids == greedy_reference(tiny_target, p, n)


def test_all_locked_follows_the_batch_version(tiny_target):
    """The engine remembers a wholly locked running batch by the scheduler's batch version: a finish keeps the rest
    locked, a request admitted into the batch is not."""
    eng = _engine(tiny_target, makespan_guard=True, makespan_lock=True)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    for r in reqs:
        r.ar_locked = True
    assert eng._all_locked(list(eng.scheduler.running))
    eng.abort(reqs[2])  # a finish: a new batch version, the two left still locked
    assert eng._all_locked(list(eng.scheduler.running))
    late = eng.add_request(_prompts()[0], SamplingParams(max_new_tokens=5, ignore_eos=True))
    eng._admit(True, [])
    assert late in eng.scheduler.running and not eng._all_locked(list(eng.scheduler.running))


def test_makespan_lock_needs_each_requests_record_and_ends_at_a_reload(tiny_target):
    """A decisive verdict for AR locks the running requests only where each has a drafting record of its own (one
    priced at the bucket's prior keeps the wave unlocked); a drafter reload clears the locks (and the engine's memory
    of a wholly locked batch)."""
    from adaflash_ray.engine.engine import MAKESPAN_TRIAL

    eng = _engine(tiny_target, makespan_guard=True, makespan_lock=True)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    running = list(eng.scheduler.running)
    eng._ms_trial = MAKESPAN_TRIAL
    for _ in range(3):  # AR: 1 token per row in 1 ms; drafting: 3 tokens per row in 2 ms
        eng.guard.record(3, False, 3, 1.0, 3)
        eng.guard.record(3, True, 9, 2.0, 3)
    for r in reqs:  # 1 token per drafting step: drafting's horizon ~1.5x AR's, decisive
        r.spec_steps, r.spec_tokens = 20, 20
    reqs[0].spec_steps = reqs[0].spec_tokens = 0  # no record of its own
    assert eng._makespan_prefers_ar(running, 3) and eng._ms_trial == MAKESPAN_TRIAL  # decisive, not locked
    assert not any(r.ar_locked for r in reqs)
    reqs[0].spec_steps, reqs[0].spec_tokens = 20, 20
    eng._ms_forced_left = 0
    assert eng._makespan_prefers_ar(running, 3) and all(r.ar_locked for r in reqs)
    assert eng._all_locked(running)  # remembered for this batch version
    eng.load_drafter(eng.drafter_tensors(), version=1)
    assert not any(r.ar_locked for r in reqs)
    assert not eng._all_locked(running)  # the same batch version: the reload forgot it too


def test_plain_step_is_an_ar_step(tiny_target):
    """``ModelRunner.step(plain=True)`` refuses a speculative step or lookups (ValueError); the recipe's
    ``engine.makespan_lock`` reaches the engines that have the makespan guard, never one recording features."""
    from adaflash_ray.config import load_recipe

    eng = _engine(tiny_target)
    with pytest.raises(ValueError, match="plain step is an AR step"):
        eng.runner.step([0], [1], [3], [0], True, plain=True)
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    cfg = load_recipe("recipes/cpu_tiny.yaml", ["length_head.policy=cost", "engine.makespan_guard=true",
                                                "engine.makespan_lock=true"])
    kw = dict(models=(tiny_target, drafter, head), max_seq_len=128)
    built = SpecEngine.from_config(cfg, **kw)
    assert built.makespan_guard and built.makespan_lock
    assert not SpecEngine.from_config(cfg, **kw, record=True).makespan_lock
    assert not SpecEngine.from_config(cfg, **kw, makespan_guard=False).makespan_lock


def test_makespan_horizon_follows_the_shrinking_wave(tiny_target):
    """The makespan guard's horizons: the batch shrinks as requests finish, so each stretch of the wave is priced at
    its running count's step ms (``_wave_ms``: steps [3, 1, 1] at k ms for k requests: 2 x 1 + 0 x 2 + 1 x 3 = 5).
    Where one slow request would keep drafting alone, a cheap one-row drafting step (the throughput guard's samples at
    bucket 1, or without them the hybrid's cost tables scaling the full batch's step) turns a verdict for AR (the whole
    wave priced at the full batch's drafting step) into one for drafting."""
    from adaflash_ray.engine.engine import MAKESPAN_TRIAL, _wave_ms

    assert _wave_ms([1.0, 3.0, 1.0], [(1, 2, 1.0), (2, 3, 2.0), (3, 4, 3.0)]) == 5.0
    assert _wave_ms([1.0, 3.0, 1.0], [(1, 3, 1.0), (3, 9, 3.0)]) == 5.0  # runs past the wave's count are cut
    assert _wave_ms([], [(1, 2, 1.0)]) == 0.0
    ticks = itertools.count()

    def wave(one_row_drafting_ms: float | None, one_row_table: float | None = None) -> bool:
        kw = {} if one_row_table is None else {"draft_sources": ("dflash", "suffix")}
        eng = _engine(tiny_target, makespan_guard=True, clock=lambda: 1e-3 * next(ticks), **kw)
        assert eng.guard.batch_sizes[0] == 1
        if one_row_table is not None:  # the hybrid's tables: at full width 1 row costs one_row_table x 3 rows
            pl = eng.planner
            spec = [[ms] * (pl.block_size - 1) for ms in (one_row_table * 2.0, 1.5, 2.0)]
            pl.set_costs([1, 2, 3], spec, [[1.0] * (pl.max_draft + 1)] * 3)
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
        eng._admit(True, [])
        running = list(eng.scheduler.running)
        eng._ms_trial = MAKESPAN_TRIAL
        for _ in range(3):  # bucket 3: AR 1 token per row in 1 ms; drafting 3 tokens per row in 2 ms
            eng.guard.record(3, False, 3, 1.0, 3)
            eng.guard.record(3, True, 9, 2.0, 3)
            if one_row_drafting_ms is not None:  # bucket 1: AR 1 ms, drafting one_row_drafting_ms
                eng.guard.record(1, False, 1, 1.0, 1)
                eng.guard.record(1, True, 3, one_row_drafting_ms, 1)
        for r in reqs:  # two requests at 3 tokens per drafting step, one at 1.2: it drafts on alone for a while
            r.spec_steps, r.spec_tokens = 20, 60
        reqs[1].spec_tokens = 24
        return eng._makespan_prefers_ar(running, 3)
    assert wave(None)  # its tail priced at the full batch's 2 ms: AR's 99 ms < (1 - margin) = 0.9 x 132
    assert not wave(1.1)  # the tail at 1.1 ms a step: 99 ms against 0.9 x (33 x 1.1 + 66) - drafting
    assert not wave(None, one_row_table=0.55)  # no samples at bucket 1: the planner's table scales 2 ms to 1.1
    assert wave(None, one_row_table=1.0)


def test_prior_spares_the_ar_reference_only_where_decisive():
    """``set_prior``: while a bucket's policy runs at >= PRIOR_DECISIVE x the prior's AR rate, no AR reference (first
    or refresh) is forced there, and ``step_costs`` stays None (the prior is no measurement); once the policy falls
    below, the reference runs at once (its AR samples are missing). ``would_force`` still equals the next
    ``force_ar`` over a random sequence; a bucket without a prior (or an infinite one) is unchanged; bad priors
    raise."""
    import random

    from adaflash_ray.engine.throughput_guard import PRIOR_DECISIVE

    g = ThroughputGuard([1, 4], min_samples=3, backoff_steps=2, ar_refresh_steps=9, min_rows=0)
    g.set_prior([2.0, 2.0])  # one token a row per 2 ms: 0.5 tokens / ms
    for _ in range(20):
        assert not g.would_force(4) and not g.force_ar(4)
        g.record(4, True, 2, 1.0)  # 2 tokens / ms = 4 x the prior's rate
    st = g.state()["4"]
    assert st["num_ar_samples"] == 0 and st["num_forced"] == 0 and st["prior_decisive"] and st["prior_ar_ms"] == 2.0
    assert g.step_costs(4) is None
    for _ in range(40):  # the policy slows to 1 token in 1.8 ms: 1.11 x the prior's rate, below PRIOR_DECISIVE
        if g.force_ar(4):
            g.record(4, False, 1, 0.5)
        else:
            g.record(4, True, 1, 1.8)
    st = g.state()["4"]
    assert not st["prior_decisive"] and st["num_ar_samples"] >= 3 and st["num_forced"] >= 3
    assert 1.8 * PRIOR_DECISIVE > 2.0  # the boundary the test relies on
    assert g.step_costs(4)[0] == pytest.approx(0.5)  # measured AR ms again
    plain = ThroughputGuard([1], min_samples=3, min_rows=0)  # no prior: the reference after min_samples policy steps
    for _ in range(3):
        assert not plain.force_ar(1)
        plain.record(1, True, 8, 1.0)
    assert plain.force_ar(1) and plain.step_costs(1) is None
    rng = random.Random(11)
    h = ThroughputGuard([1, 4], min_samples=3, backoff_steps=2, ar_refresh_steps=9, min_rows=0)
    h.set_prior([1.0, 3.0])
    forced = 0
    for _ in range(800):
        b = rng.choice([1, 4])
        ahead = h.would_force(b)
        now = h.force_ar(b)
        assert now == ahead
        forced += now
        h.record(b, not now, 1 if now else rng.choice([1, 2, 4]), 1.0 if now else rng.choice([1.0, 2.0]))
    assert forced > 0 and h.state()["4"]["num_forced"] < h.state()["1"]["num_forced"]  # 4's prior AR rate is lower
    for bad in ([1.0], [1.0, 0.0], [1.0, float("nan")], [1.0, -2.0]):
        with pytest.raises(ValueError, match="set_prior"):
            h.set_prior(bad)
    h.set_prior([1.0, float("inf")])  # an AR step the table calls never worth it: no prior for that bucket
    assert h.state()["4"]["prior_ar_ms"] is None and not h.state()["4"]["prior_decisive"]


@pytest.mark.parametrize("ar_prior", [True, False])
def test_cost_table_prior_spares_ar_references_where_drafting_is_far_ahead(tiny_target, ar_prior):
    """An engine whose cost table says AR steps cost 5 ms while every realised step takes 1 ms (a fake clock):
    drafting commits >= 1 token a row per ms, >= PRIOR_DECISIVE x the table's AR rate, so with the prior (the
    default) no AR reference step is forced; without it (``ar_prior`` False, as ``ADAFLASH_AR_PRIOR=0``) the guard
    takes its 3-step reference at the full bucket. Greedy output equals AR's either way. An engine with the makespan
    guard gets the prior too: its horizons read measured AR steps only, so where the prior spared them it takes no
    verdict (no makespan step) - and forces none."""
    prompts = _prompts()
    for makespan in (False, True):
        eng = _engine(tiny_target, makespan_guard=makespan)
        eng.ar_prior = ar_prior
        eng.clock = eng.runner.clock = FakeClock(eng, ar_ms=1.0, draft_ms=1.0)
        eng.set_cost_table({"batch_sizes": [1, 2, 3], "costs_ms": [[1.0] * 7] * 3, "ar_costs_ms": [5.0] * 3})
        eng.guard.min_rows = 0
        reqs = eng.generate(prompts, SamplingParams(max_new_tokens=100, ignore_eos=True))
        state = eng.guard.state()
        assert state["3"]["prior_ar_ms"] == (5.0 if ar_prior else None)
        assert state["3"]["num_forced"] == (0 if ar_prior else 3)
        assert (eng.stats.num_guard_steps == 0) == ar_prior
        if makespan and ar_prior:  # no measured AR step at any bucket: the makespan guard has no AR price
            assert all(eng.guard.step_costs(b) is None for b in (1, 2, 3)) and eng.stats.num_makespan_steps == 0
        for r, p in zip(reqs, prompts):
            assert r.output_ids == greedy_reference(tiny_target, p, 100)


def _drive(eng, running, steps: int) -> tuple[int, int]:
    """``steps`` steps of a wave at 3 rows driven through the makespan guard and the throughput guard: an AR step
    (makespan verdict or forced reference) commits 1 token a row in 1 ms, a drafting step 3 a row in 2 ms.
    Returns (forced AR references, makespan AR steps)."""
    forced = verdicts = 0
    for _ in range(steps):
        if eng._makespan_prefers_ar(running, 3):
            verdicts += 1
            eng.guard.record(3, False, 3, 1.0, 3)
        elif eng.guard.force_ar(3):
            forced += 1
            eng.guard.record(3, False, 3, 1.0, 3)
        else:
            eng.guard.record(3, True, 9, 2.0, 3)
    return forced, verdicts


@pytest.mark.parametrize("prior", [None, [1.0, 1.0, 1.0]])
def test_makespan_guard_asks_for_the_reference_a_decisive_prior_spares(tiny_target, prior):
    """Drafting at 1.5 x AR's rate on average (3 tokens a row in 2 ms against 1 in 1 ms: decisive against a table AR
    of 1 ms) while one request of three drafts 1 token a step: AR wins the wave's makespan. With the prior the
    throughput guard forces no reference of its own, yet the makespan guard - pricing AR by the table's ms where
    nothing was measured - asks for it: the same 3 forced reference steps, then AR verdicts and the lock, as without
    a prior."""
    from adaflash_ray.engine.engine import MAKESPAN_TRIAL
    eng = _engine(tiny_target, makespan_guard=True, makespan_lock=True)
    eng.guard.set_prior(prior)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    running = list(eng.scheduler.running)
    eng._ms_trial = MAKESPAN_TRIAL
    for r in reqs:  # two requests at 3 tokens a drafting step, one at 1 (the slow tail)
        r.spec_steps, r.spec_tokens = 20, 60
    reqs[1].spec_tokens = 20
    forced, verdicts = _drive(eng, running, 300)
    assert forced == 3 and verdicts > 250 and all(r.ar_locked for r in reqs)
    assert eng.guard.state()["3"]["prior_decisive"] == (prior is not None)


def test_makespan_guard_asks_for_nothing_where_the_table_says_ar_cannot_win(tiny_target):
    """The same wave with every request drafting 3 tokens a step: even at the table's (optimistic) AR price AR's
    horizon is longer, so no reference is asked for and none forced under a decisive prior; no verdict, no lock."""
    from adaflash_ray.engine.engine import MAKESPAN_TRIAL
    eng = _engine(tiny_target, makespan_guard=True, makespan_lock=True)
    eng.guard.set_prior([1.0, 1.0, 1.0])
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    eng._ms_trial = MAKESPAN_TRIAL
    for r in reqs:
        r.spec_steps, r.spec_tokens = 20, 60
    assert _drive(eng, list(eng.scheduler.running), 300) == (0, 0)
    assert not any(r.ar_locked for r in reqs) and eng.guard.step_costs(3) is None


def test_stale_ar_costs_are_no_price_and_the_makespan_guard_asks_for_a_refresh(tiny_target):
    """AR measured once at 1 ms, then ``ar_refresh_steps`` decisive drafting steps under the prior (no refresh of
    the throughput guard's own): ``step_costs`` answers None rather than the stale 1 ms; the makespan guard of a wave
    AR could win asks for the refresh, which is forced (min_samples steps) and gives a fresh price."""
    from adaflash_ray.engine.engine import MAKESPAN_TRIAL
    eng = _engine(tiny_target, makespan_guard=True, makespan_lock=True)
    g = eng.guard
    for _ in range(g.min_samples):
        g.record(3, True, 9, 2.0, 3)
        g.record(3, False, 3, 1.0, 3)
    g.set_prior([1.0, 1.0, 1.0])
    assert g.step_costs(3) == (1.0, 2.0, 3.0)
    for _ in range(g.ar_refresh_steps):
        assert not g.force_ar(3)  # decisive: no refresh of its own
        g.record(3, True, 9, 2.0, 3)
    assert g.step_costs(3) is None and g.buckets[2].since_ar == g.ar_refresh_steps
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in _prompts()]
    eng._admit(True, [])
    eng._ms_trial = MAKESPAN_TRIAL
    for r in reqs:
        r.spec_steps, r.spec_tokens = 20, 60
    reqs[1].spec_tokens = 20
    assert not eng._makespan_prefers_ar(list(eng.scheduler.running), 3)  # no price yet: a request, no verdict
    costs = []
    for _ in range(g.min_samples):  # the refresh: AR now costs 1.6 ms
        assert g.force_ar(3)
        g.record(3, False, 3, 1.6, 3)
        costs.append(g.step_costs(3))
    assert costs[:-1] == [None] * (g.min_samples - 1)  # the stale average restarted: no blend of old and new
    assert costs[-1] == pytest.approx((1.6, 2.0, 3.0)) and not g.buckets[2].requested  # served: the request cleared
    assert not g.force_ar(3)  # nothing more forced
