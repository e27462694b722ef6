"""Tests of the engine's overlapped plain steps (SpecEngine ``async_scheduling``): each plain AR step is launched
before the step in flight is read, its anchor tokens read on the device (``ModelRunner.launch_plain``).

On tiny random targets (CPU: the launch runs at once, but the chained step still reads its anchors from the device
buffer the step before wrote): the outputs, finish reasons and logprobs equal the synchronous engine's for greedy,
seeded sampled and stop-token requests through fewer slots than requests; a stop token inside a chain drops the row
already launched; an abort or ``drain`` with a step in flight loses nothing; the makespan lock's plain steps overlap
too; a chained launch over a slot the plain launch before did not run, or after any other step, prefill or slot
move, is refused.

Run: python -m pytest -q tests/test_async_scheduling.py   (CPU, ~1 min)
"""
from __future__ import annotations

import pytest
import torch
from conftest import greedy_reference, make_drafter, make_tiny_target

from adaflash_ray.engine import SamplingParams, SpecEngine


def _prompts(lengths=(3, 90, 1, 17, 45, 5, 120), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _run(target, prompts, params, async_scheduling, max_batch_size=3, mode="ar", **kw):
    eng = SpecEngine(target, None, None, policy="fixed", max_batch_size=max_batch_size, max_seq_len=200,
                     async_scheduling=async_scheduling, **kw)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished = []
    while eng.has_unfinished():
        finished += eng.step(mode)
    assert eng._inflight is None  # nothing left on the device once every request ended
    return eng, reqs, finished


def _cost_engine(target, async_scheduling, **kw):
    """The ``cost`` policy with a random drafter and the throughput guard (every step counts: ``min_rows`` 0)."""
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=200, calibrate=False,
                     probe_every=4, async_scheduling=async_scheduling, **kw)
    eng.guard.min_rows = 0
    return eng


def _same(a, b):
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]
    assert [r.output_logprobs for r in a] == [r.output_logprobs for r in b]
    assert [r.output_top_logprobs for r in a] == [r.output_top_logprobs for r in b]


def test_overlapped_ar_steps_equal_the_synchronous_engines():
    """Greedy requests of different budgets, seeded sampled ones with logprobs and a stop token, 7 requests through
    3 slots: every output, finish reason and logprob of the overlapped engine is the synchronous one's (greedy: the
    target's own greedy output), every request is returned finished exactly once, and steps were chained."""
    target = make_tiny_target("llama", seed=1)
    prompts = _prompts()
    ref = [greedy_reference(target, p, 30) for p in prompts]
    stop = ref[1][6]  # a token request 1 meets early: it ends by a stop token while the others run on
    params = []
    for i in range(len(prompts)):
        if i % 3 == 2:
            params.append(SamplingParams(max_new_tokens=25, temperature=0.9, top_p=0.9, seed=100 + i, logprobs=2))
        elif i == 1:
            params.append(SamplingParams(max_new_tokens=30, stop_token_ids=[stop]))
        else:
            params.append(SamplingParams(max_new_tokens=30 - 3 * (i % 4), logprobs=0 if i == 0 else None))
    sync_eng, sync_reqs, _ = _run(target, prompts, params, False)
    eng, reqs, finished = _run(target, prompts, params, True)
    _same(reqs, sync_reqs)
    assert sorted(map(id, finished)) == sorted(map(id, reqs))
    assert reqs[1].finish_reason == "stop" and reqs[1].output_ids == ref[1][:ref[1].index(stop) + 1]
    for i in (0, 3, 4, 6):
        assert reqs[i].output_ids == ref[i][:params[i].max_new_tokens]
    assert eng.stats.num_overlapped_steps > 0 and sync_eng.stats.num_overlapped_steps == 0
    assert eng.stats.num_generated == sync_eng.stats.num_generated
    assert eng.num_steps == sync_eng.num_steps and eng.stats.kind_steps == sync_eng.stats.kind_steps


def test_a_stop_token_in_a_chain_drops_the_launched_row():
    """One request of a wave ends by a stop token while its next step is already launched: that row's token is never
    committed (the output ends at the stop), the others finish as the synchronous engine's; with every row ended by
    stop tokens, the step launched after them is read and dropped."""
    target = make_tiny_target("llama", seed=2)
    prompts = _prompts((6, 9, 12), seed=4)
    ref = [greedy_reference(target, p, 40) for p in prompts]
    stop = ref[0][10]
    params = [SamplingParams(max_new_tokens=40, stop_token_ids=[stop]), SamplingParams(max_new_tokens=40),
              SamplingParams(max_new_tokens=40)]
    _, sync_reqs, _ = _run(target, prompts, params, False, compact_slots=False)
    eng, reqs, _ = _run(target, prompts, params, True, compact_slots=False)
    _same(reqs, sync_reqs)
    assert reqs[0].output_ids == ref[0][:ref[0].index(stop) + 1] and reqs[0].finish_reason == "stop"
    assert eng.stats.num_overlapped_steps >= 30  # one wave of three rows, no compaction: nearly every step chained
    # every row ends by a stop token at once: the step launched after them has no row left
    stops = [SamplingParams(max_new_tokens=40, stop_token_ids=[r[12]]) for r in ref]
    _, sync_reqs, _ = _run(target, prompts, stops, False, compact_slots=False)
    _, reqs, _ = _run(target, prompts, stops, True, compact_slots=False)
    _same(reqs, sync_reqs)


def test_abort_and_drain_with_a_step_in_flight():
    """An abort while a step is in flight freezes that request's output (its launched row is dropped), a drain reads
    the step and commits its tokens (the next step returns what it finished), and a request queued meanwhile is
    admitted once the step in flight is read: every other output is the target's greedy output."""
    target = make_tiny_target("llama", seed=3)
    prompts = _prompts((5, 8, 13), seed=5)
    refs = [greedy_reference(target, p, 30) for p in prompts]
    eng = SpecEngine(target, None, None, policy="fixed", max_batch_size=3, max_seq_len=200, async_scheduling=True)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=30)) for p in prompts]
    while eng._inflight is None:
        eng.step("ar")
    eng.step("ar")
    assert eng._inflight is not None
    frozen = list(reqs[1].output_ids)
    assert eng.abort(reqs[1])
    n0 = len(reqs[0].output_ids)
    eng.drain()
    assert eng._inflight is None and len(reqs[0].output_ids) == n0 + 1 and reqs[1].output_ids == frozen
    late = eng.add_request(prompts[1], SamplingParams(max_new_tokens=12))
    while eng.has_unfinished():
        eng.step("ar")
    assert reqs[1].finish_reason == "abort" and reqs[1].output_ids == frozen
    assert reqs[0].output_ids == refs[0] and reqs[2].output_ids == refs[2]
    assert late.output_ids == refs[1][:12]


@pytest.mark.parametrize("stops", [False, True])
def test_makespan_lock_plain_steps_overlap(stops):
    """Under ``makespan_lock`` (a random drafter whose verdicts lock the wave), the locked plain steps are chained
    too: the outputs are the target's greedy outputs and equal the synchronous engine's, and so are the counts of
    plain, makespan and engine steps and the throughput guard's records (batch bucket, tokens, rows) - also where the
    wave's last rows end by stop tokens while a chained step is in flight (that step is dropped, not counted)."""
    target = make_tiny_target("llama", seed=1)
    prompts = _prompts((4, 11, 25), seed=3)
    refs = [greedy_reference(target, p, 90) for p in prompts]
    out = {}
    for on in (False, True):
        eng = _cost_engine(target, on, makespan_guard=True, makespan_lock=True)
        eng.runner.length_policy.set_costs([1, 2, 3], torch.ones(3, 7), torch.full((3,), 100.0))
        records = []
        real_record = eng.guard.record
        eng.guard.record = lambda bs, policy, tokens, ms, rows=None: (records.append((bs, policy, tokens, rows)),
                                                                       real_record(bs, policy, tokens, ms, rows))
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=90, stop_token_ids=[r[60]] if stops else None,
                                                  ignore_eos=not stops)) for p, r in zip(prompts, refs)]
        while eng.has_unfinished():
            eng.step()
        assert eng._inflight is None
        out[on] = (eng, reqs, records)
    (sync_eng, sync_reqs, sync_records), (eng, reqs, records) = out[False], out[True]
    if not stops:
        for r, ref in zip(reqs, refs):
            assert r.output_ids == ref
    _same(reqs, sync_reqs)
    st, sync_st = eng.stats, sync_eng.stats
    assert st.num_plain_steps == sync_st.num_plain_steps > 10
    assert (st.num_makespan_steps, st.kind_steps, eng.num_steps) == \
        (sync_st.num_makespan_steps, sync_st.kind_steps, sync_eng.num_steps)
    assert records == sync_records
    assert st.num_overlapped_steps > 0


def test_a_drain_or_an_abort_of_every_row_loses_no_request():
    """A drain that reads a wave's last step keeps its finished requests for the next step (``has_unfinished`` stays
    True until then, so a ``while has_unfinished(): step()`` loop returns each request once and counts every step);
    aborting every running request with a step in flight lets the next call admit a new request at once."""
    target = make_tiny_target("llama", seed=3)
    prompts = _prompts((5, 8, 13), seed=5)
    counts = {}
    for on in (False, True):
        eng = SpecEngine(target, None, None, policy="fixed", max_batch_size=3, max_seq_len=200, async_scheduling=on)
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
        finished = []
        while eng.has_unfinished():
            finished += eng.step("ar")
            if eng._inflight is not None and all(r.remaining == 1 for r in reqs):
                eng.drain()  # the wave's last step read outside step()
                assert eng.has_unfinished()
        assert sorted(map(id, finished)) == sorted(map(id, reqs))
        counts[on] = (eng.num_steps, eng.stats.kind_steps)
    assert counts[True] == counts[False]
    eng = SpecEngine(target, None, None, policy="fixed", max_batch_size=3, max_seq_len=200, async_scheduling=True)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=30)) for p in prompts]
    while eng._inflight is None:
        eng.step("ar")
    for r in reqs:
        eng.abort(r)
    late = eng.add_request(prompts[0], SamplingParams(max_new_tokens=4))
    eng.step("ar")
    assert len(late.output_ids) == 2  # admitted (its prefill's token) and decoded in the same call
    while eng.has_unfinished():
        eng.step("ar")
    assert late.output_ids == greedy_reference(target, prompts[0], 4)


def test_chained_launch_needs_a_plain_launch_before_it():
    """``launch_plain`` without anchors reads the last plain launch's tokens: after a regular step or a prefill, or
    over more rows than that launch, it is refused (ValueError)."""
    target = make_tiny_target("llama", seed=1)
    eng = SpecEngine(target, None, None, policy="fixed", max_batch_size=4, max_seq_len=64, async_scheduling=False)
    reqs = [eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=8)) for _ in range(2)]
    eng.step("ar")
    runner = eng.runner
    with pytest.raises(ValueError, match="chained step"):
        runner.launch_plain([0], [5])
    pending = runner.launch_plain([0], [4], [reqs[0].output_ids[-1]])
    with pytest.raises(ValueError, match=r"chained step over slots \[1\]"):
        runner.launch_plain([0, 1], [5, 5])
    chained = runner.launch_plain([0], [5])
    first, second = runner.finish_plain(pending), runner.finish_plain(chained)
    ref = greedy_reference(target, [1, 2, 3], 4)
    assert first.committed == [[ref[2]]] and second.committed == [[ref[3]]]


def test_cost_policy_gamma0_steps_overlap():
    """The ``cost`` policy's γ = 0 steps (a cost table under which drafting never pays: AR steps that keep the
    feature history, a probe every few steps) are chained too, probes and the throughput guard's forced steps read in
    between: the outputs are the target's greedy outputs, the probes, proposes and feature history the synchronous
    engine's."""
    target = make_tiny_target("llama", seed=1)
    prompts = _prompts((4, 11, 25), seed=3)
    refs = [greedy_reference(target, p, 60) for p in prompts]
    out = {}
    for on in (False, True):
        eng = _cost_engine(target, on)
        eng.runner.length_policy.set_costs([1, 2, 3], torch.full((3, 7), 100.0), torch.ones(3))
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=60, ignore_eos=True)) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        assert eng._inflight is None and eng._prescheduled is None
        out[on] = (eng, reqs)
    (sync_eng, sync_reqs), (eng, reqs) = out[False], out[True]
    for r, ref in zip(reqs, refs):
        assert r.output_ids == ref
    _same(reqs, sync_reqs)
    st, sync_st = eng.stats, sync_eng.stats
    assert st.kind_steps == sync_st.kind_steps and st.kind_steps["gamma0"] > 20 and st.kind_steps["probe"] > 2
    assert [r.draft_lens for r in reqs] == [r.draft_lens for r in sync_reqs]
    assert st.num_overlapped_steps > 10
    n = len(prompts[0]) + 59  # the feature history the drafter's catch-up reads, position for position
    assert torch.equal(eng.runner.feat_hist[:, :n], sync_eng.runner.feat_hist[:, :n]) or \
        torch.allclose(eng.runner.feat_hist[:, :n], sync_eng.runner.feat_hist[:, :n], atol=1e-5)
