"""Draft sources beside DFlash (engine ``draft_sources``): prompt lookup (``ngram``), suffix lookup (``suffix``,
SuffixDecoding, arXiv 2411.04975) and the hybrid per-request choice (adaflash_ray.engine.hybrid).

- greedy ngram / suffix / hybrid output == the target's greedy output, token for token (tiny random float32 targets);
- sampled lookup drafts (a point-mass q) follow the target distribution (χ² on pairs of tokens);
- a perfect lookup (a corpus holding the request's own greedy continuation) commits > 1 token per step;
- the planner answers "none" when no source pays (cost table by hand), the lookup when its estimate wins, the
  drafter's block when its estimate wins, and skips the drafter's propose while it is not chosen;
- on a synthetic two-source stream (no model) the hybrid keeps proposing a block that pays on the steps without a
  lookup match (batch 1, chat-like), and follows the suffix where it is the better source or the propose costs more;
- the source histogram counts every request-step; a deferred drafter context (AR steps) is caught up exactly.

Run: python -m pytest -q tests/test_hybrid.py
"""
from __future__ import annotations

import bisect

import numpy as np
import pytest
import torch
from conftest import greedy_reference, make_drafter, make_tiny_target
from test_engine import _assert_context_matches, _chi2_pvalue

from adaflash_ray.drafting.lookup import Proposal, SuffixCorpus
from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats
from adaflash_ray.engine.hybrid import WIDTH_RESID_MIN, HybridPlanner, SourceCalibration, check_draft_sources


def _prompts(n=3, vocab=128, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in [4, 11, 25][:n]]
    out[0] = out[0] * 3  # a repeated prompt: prompt lookup finds matches
    return out


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("sources", [("ngram",), ("suffix",)])
def test_lookup_sources_greedy_lossless(tiny_target, sources, where):
    """Lookup drafts alone (no drafter), computed on the host or on the device (eager CPU): greedy output == the
    target's; every step's source is the lookup or none."""
    prompts, budgets = _prompts(), [40, 24, 33]
    ref = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    engine = SpecEngine(tiny_target, None, None, max_batch_size=2, max_seq_len=160, draft_sources=sources,
                        lookup_device=where, lookup_corpus_tokens=256)
    assert engine.lookup_on_device == (where == "device")
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, budgets)]
    while engine.has_unfinished():
        engine.step()
    for r, out in zip(reqs, ref):
        assert r.output_ids == out
    s = engine.stats
    assert set(s.source_hist) <= {sources[0], "none"} and sum(s.source_hist.values()) == s.num_verify_steps
    assert s.source_hist[sources[0]] > 0 and s.num_drafted > 0  # lookups were verified (3-slot slot reuse too)
    assert sum(len(r.step_sources) for r in reqs) == s.num_verify_steps


def test_perfect_suffix_lookup_commits_several_tokens(tiny_target):
    """A corpus holding the request's own greedy sequence (a server that answered the same prompt before): the suffix
    proposal is the target's continuation, so steps commit many tokens each, and the output is still exact."""
    prompt = _prompts()[1]
    ref = greedy_reference(tiny_target, prompt, 48)
    corpus = SuffixCorpus(max_ngram=3)
    corpus.add(prompt + ref)
    engine = SpecEngine(tiny_target, None, None, max_batch_size=1, max_seq_len=128, draft_sources=("suffix",),
                        suffix_corpus=corpus)
    req = engine.generate([prompt], SamplingParams(max_new_tokens=48, ignore_eos=True))[0]
    assert req.output_ids == ref
    assert engine.stats.accept_len > 4.0, engine.stats.accept_len
    assert engine.lookup.corpus.num_sequences == 2  # the finished request joined the corpus
    engine.reset_corpus([prompt])
    assert engine.lookup.corpus.num_sequences == 1


def test_ngram_on_a_repetitive_target_commits_several_tokens():
    """A small-vocabulary target whose greedy output cycles: prompt lookup finds the cycle, τ > 1, exact output."""
    target = make_tiny_target("llama", vocab_size=16, seed=1, logit_scale=3.0)
    prompt = [1, 2, 3, 4, 5]
    ref = greedy_reference(target, prompt, 64)
    engine = SpecEngine(target, None, None, max_batch_size=1, max_seq_len=128, draft_sources=("ngram",))
    req = engine.generate([prompt], SamplingParams(max_new_tokens=64, ignore_eos=True))[0]
    assert req.output_ids == ref
    assert engine.stats.accept_len > 1.5, (engine.stats.accept_len, ref)


@pytest.mark.parametrize("where", ["host", "device"])
def test_hybrid_greedy_lossless_with_measured_costs(tiny_target, where):
    """DFlash + suffix through the planner (lookups on the host or on the device), with the cost table this engine
    measured (CPU), drafter head random: greedy output == the target's; the corpus then makes the suffix source pay,
    and it is chosen."""
    prompts, budgets = _prompts(), [40, 24, 33]
    ref = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160,
                        draft_sources=("dflash", "suffix"), lookup_device=where)
    assert engine.planner.spec_costs is not None and len(engine.cost_table["lookup_costs_ms"][0]) == 16
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for r in reqs:
        assert r.output_ids == greedy_reference(tiny_target, r.prompt_ids, 40)
    engine.stats = SpecStats()
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, budgets)]
    while engine.has_unfinished():
        engine.step()
    for r, out in zip(reqs, ref):  # second pass: the corpus holds each prompt's first-pass output
        assert r.output_ids == out
    assert engine.stats.source_hist["suffix"] > 0
    assert engine.stats.accept_len > 1.5


def test_planned_propose_skips_the_length_policy_forward(tiny_target, monkeypatch):
    """With the planner's block estimate (``runner.expected_fn``) the planner picks each row's γ, so a propose runs
    the acceptance head once (the estimate) and not the ``cost`` policy's own forward as well; the cost policy
    alone still runs its forward once per propose."""
    from adaflash_ray.engine import length_policy as lp
    from adaflash_ray.models import length_head as lh

    calls = {"policy": 0, "confidence": 0}
    policy_call, conf = lp.CostLength.__call__, lh.draft_confidence

    def counted_policy(self, *a, **k):
        calls["policy"] += 1
        return policy_call(self, *a, **k)

    def counted_conf(*a, **k):
        calls["confidence"] += 1
        return conf(*a, **k)

    monkeypatch.setattr(lp.CostLength, "__call__", counted_policy)
    monkeypatch.setattr(lp, "draft_confidence", counted_conf)
    import adaflash_ray.engine.engine as eng
    monkeypatch.setattr(eng, "draft_confidence", counted_conf)
    prompts = _prompts()
    for sources in (("dflash", "suffix"), None):
        drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
        engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160,
                            draft_sources=sources, lookup_device="host")
        calls.update(policy=0, confidence=0)
        reqs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        for r in reqs:
            assert r.output_ids == greedy_reference(tiny_target, r.prompt_ids, 12)
        proposes = engine.stats.num_prefills + engine.stats.num_engine_steps  # at most one propose each
        if sources is not None:
            assert calls["policy"] == 0 and calls["confidence"] > 0
        else:
            assert calls["policy"] > 0 and calls["confidence"] == calls["policy"] <= proposes


def test_confidence_kernel_is_checked_before_an_engine_takes_it(tiny_target, caplog, monkeypatch):
    """An engine takes the draft-confidence Triton kernel only if it builds and agrees with the torch reference (a
    failing or wrong kernel leaves the reference in use, with a warning naming why, instead of stopping the engine)."""
    import adaflash_ray.kernels.draft_confidence as dc
    from adaflash_ray.engine import engine as eng

    def broken(z):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(dc, "draft_confidence_fused", broken)
    with caplog.at_level("WARNING"):
        assert eng._confidence_kernel_ok(tiny_target) is False
    assert "no kernel here" in caplog.text
    monkeypatch.setattr(dc, "draft_confidence_fused", lambda z: dc.draft_confidence_ref(z) + 0.01)
    with caplog.at_level("WARNING"):
        assert eng._confidence_kernel_ok(tiny_target) is False
    assert "disagrees" in caplog.text
    monkeypatch.setattr(dc, "draft_confidence_fused", dc.draft_confidence_ref)
    assert eng._confidence_kernel_ok(tiny_target) is True


def test_hybrid_sources_chosen_by_hand_costs_lossless(tiny_target):
    """Hand-set tables: drafting never pays -> every step "none" (no propose after the first block); the drafter's
    block always pays -> "dflash" steps; output exact in both."""
    prompts = _prompts()
    ref = [greedy_reference(tiny_target, p, 30) for p in prompts]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160,
                        draft_sources=("dflash", "ngram"), calibrate=False, probe_every=4)
    nd = engine.runner.max_draft
    planner = engine.planner
    planner.set_costs([1, 2, 3], np.full((3, 7), 100.0), np.concatenate([np.ones((3, 1)), np.full((3, nd), 100.0)], 1))
    calls = []
    real = engine.runner._propose
    engine.runner._propose = lambda *a, **k: calls.append(1) or real(*a, **k)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert [r.output_ids for r in reqs] == ref
    hist = engine.stats.source_hist
    assert "dflash" not in hist and hist["none"] > 0.7 * engine.stats.num_verify_steps, hist  # lookups: probes only
    assert len(calls) < 3 + engine.stats.num_engine_steps // 2  # the probe schedule skips most proposes
    planner.set_costs([1, 2, 3], np.ones((3, 7)), np.concatenate([np.ones((3, 1)), np.full((3, nd), 100.0)], 1))
    planner.calibration = SourceCalibration(prior=1.0, decay=1e-9, running_start=False)  # trust the (random) head as it is
    engine.stats = SpecStats()
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert [r.output_ids for r in reqs] == ref
    assert engine.stats.source_hist["dflash"] > 0


def _planner(sources=("dflash", "ngram"), nd=15, bs=16):
    p = HybridPlanner(sources, nd, bs, [1, 2, 3, 4, 6, 8, 12, 16], probe_every=2,
                      calibration=SourceCalibration(prior=1.0, decay=0.5))
    return p


def _costs(p, spec, look_w1, look_rest):
    p.set_costs([1, 4], np.full((2, p.block_size - 1), spec),
                np.concatenate([np.full((2, 1), look_w1), np.full((2, p.max_draft), look_rest)], 1))


def test_planner_choices_by_hand():
    """Expected tokens per ms by hand: nothing pays -> none; a perfect lookup that costs about an AR step -> the
    lookup at its whole length; a confident drafter block -> dflash; no costs -> the longest estimate."""
    p = _planner()
    sure = Proposal([7, 8, 9, 10], 3, "context", [4, 4, 4, 4], 4)
    weak = Proposal([7, 8], 1, "context", [1, 1], 8)
    low_block = [1.05] * 15  # E[c(γ)] ≈ 1: the drafter's block is worthless
    high_block = [1 + 0.9 * (1 - 0.9 ** g) / 0.1 for g in range(1, 16)]
    # drafting costs 10x an AR step: none for everyone
    _costs(p, 10.0, 1.0, 10.0)
    ch, propose = p.plan(2, [20, 20], [low_block, low_block], [sure, weak])
    assert [c.source for c in ch] == ["none", "none"] and [c.draft_len for c in ch] == [0, 0] and not propose
    # lookup verify costs about an AR step: the perfect proposal is taken whole, the weak one not worse than none
    _costs(p, 10.0, 1.0, 1.05)
    ch, propose = p.plan(2, [20, 20], [low_block, low_block], [sure, weak])
    assert (ch[0].source, ch[0].draft_len, ch[0].tokens) == ("ngram", 4, [7, 8, 9, 10]) and not propose
    # a capped request (2 tokens left: γ <= 1)
    ch, _ = p.plan(1, [1], [None], [sure])
    assert (ch[0].source, ch[0].draft_len) == ("ngram", 1)
    # a drafter block worth ~6 tokens at cheap verify: dflash, and the step proposes the next block
    p.reset()
    _costs(p, 1.1, 1.0, 1.05)
    ch, propose = p.plan(2, [20, 20], [high_block, high_block], [weak, None])
    assert [c.source for c in ch] == ["dflash", "dflash"] and ch[0].draft_len == 15 and propose
    # a lookup worth a quarter token: taken, but when its host time (50 ms) outweighs that, later steps skip lookups
    # until the next probe
    for ms, due in ((0.0, True), (50.0, False)):
        r = _planner()
        _costs(r, 10.0, 1.0, 1.05)
        ch, _ = r.plan(2, [20, 20], [None, None], [weak, None], lookup_ms=ms)
        assert ch[0].source == "ngram" and r.lookup_due() is due
    # no cost table: the larger estimate at full length
    q = _planner()
    ch, _ = q.plan(2, [20, 20], [low_block, None], [sure, None])
    assert [c.source for c in ch] == ["ngram", "none"]


def test_planner_calibration_and_probe_schedule():
    """Realised acceptance below the estimate lowers a source's factor until it stops paying; the drafter's block,
    once not chosen (and worth nothing), is proposed again only at the probes (every probe_every steps, doubling)."""
    cal = SourceCalibration(prior=1.0, decay=0.5)
    for _ in range(6):
        cal.record("ngram", 4.0, 0)
    assert cal.factor("ngram") < 0.05 and cal.factor("dflash") == 1.0
    p = _planner()
    _costs(p, 10.0, 1.0, 10.0)
    low = [1.05] * 15
    proposes = []
    pending = low
    for _ in range(12):
        _, propose = p.plan(1, [30], [pending], [None])
        proposes.append(propose)
        pending = low if propose else None
    # step 0 sees a block and skips it (no propose: a plan with it does not beat AR steps); 2 AR steps, a probe
    # (step 3), its block not chosen (step 4), then 4 AR steps (the wait doubled) and the next probe (step 9)
    assert proposes == [False, False, False, True, False, False, False, False, False, True, False, False], proposes
    with pytest.raises(ValueError, match="needs a drafter"):
        check_draft_sources(["dflash"], has_drafter=False)
    with pytest.raises(ValueError, match="one of"):
        check_draft_sources(["ngram", "suffix"], has_drafter=True)
    with pytest.raises(ValueError, match="subset"):
        check_draft_sources(["eagle"], has_drafter=True)


def test_source_histogram_counts():
    s = SpecStats()
    s.record_step(3, 2, "ngram")
    s.record_step(0, 0, "none")
    s.record_step(7, 7, "dflash")
    s.record_step(2, 0, "ngram")
    assert dict(s.source_hist) == {"ngram": 2, "none": 1, "dflash": 1}
    assert dict(s.source_drafted) == {"ngram": 5, "none": 0, "dflash": 7} and s.source_accepted["ngram"] == 2
    assert s.source_accept_len("ngram") == 2.0 and s.source_accept_len("dflash") == 8.0
    window = s - SpecStats.from_steps([3], [2])
    assert dict(window.source_hist) == dict(s.source_hist)  # from_steps records no source
    assert dict((s + s).source_hist) == {"ngram": 4, "none": 2, "dflash": 2}


def _assert_pairs_follow_the_target(target, prompt: list[int], toks: np.ndarray, temp: float):
    """``toks`` ``[num, 4]``: the first 4 tokens sampled after ``prompt`` at ``temp`` from a target of a small vocabulary;
    asserts that each pair of neighbours (t1,t2 / t2,t3 / t3,t4) follows the target's joint law (χ², p > 0.001, every
    prefix of 3 tokens through the target). Returns (p1 ``[V]``, p2 ``[V, V]``): the laws of t1 and of t2 given t1."""
    vocab, num = target.config.vocab_size, len(toks)
    prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * 3)  # [V^3, 3], t1 major
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = target(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -4:]  # [V^3, 4, V]
    cond = torch.softmax(logits.double() / temp, -1).reshape(vocab, vocab, vocab, 4, vocab)
    p1, p2, p3, p4 = cond[0, 0, 0, 0], cond[:, 0, 0, 1], cond[:, :, 0, 2], cond[:, :, :, 3]
    joint = p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4
    checks = {"t1,t2": (toks[:, 0] * vocab + toks[:, 1], joint.sum((2, 3))),
              "t2,t3": (toks[:, 1] * vocab + toks[:, 2], joint.sum((0, 3))),
              "t3,t4": (toks[:, 2] * vocab + toks[:, 3], joint.sum((0, 1)))}
    for name, (cells, law) in checks.items():
        observed = np.bincount(cells, minlength=law.numel()).astype(float)
        assert _chi2_pvalue(observed, law.flatten().numpy() * num) > 1e-3, name
    return p1, p2


@pytest.mark.parametrize("where", [pytest.param("host", marks=pytest.mark.long), "device"])  # host: ~30 s, long
def test_sampled_lookup_drafts_follow_the_target(where):
    """Temperature 0.8, vocab 12, suffix drafts (host or device lookup) from a corpus of the target's own samples (a
    point-mass q, accepted and rejected both): the joint law of the first 4 generated tokens equals the target's (χ²
    on pairs, p > 0.001); the same samples reject the law of a greedy-fallback bug."""
    vocab, temp, num = 12, 0.8, 3072
    target = make_tiny_target("qwen3", vocab_size=vocab, seed=2, logit_scale=2.0)
    prompt = [1, 2, 3, 4, 5]
    seen = SpecEngine(target, None, None, max_batch_size=16, max_seq_len=32, seed=5).generate(
        [prompt] * 16, SamplingParams(max_new_tokens=8, temperature=temp, ignore_eos=True), mode="ar")
    corpus = SuffixCorpus(max_ngram=2)
    for r in seen:
        corpus.add(prompt + r.output_ids)
    engine = SpecEngine(target, None, None, max_batch_size=64, max_seq_len=32, seed=11, draft_sources=("suffix",),
                        suffix_corpus=corpus, lookup_max_ngram=2, lookup_device=where,
                        lookup_corpus_tokens=256)  # the 16 sequences and their separators fit
    # keep the corpus fixed: every request sees the same proposal law
    if where == "device":
        engine.runner.lookup.add_sequences = lambda sequences: None
    else:
        engine.lookup.finish = lambda tokens: None
    reqs = engine.generate([prompt] * num, SamplingParams(max_new_tokens=4, temperature=temp))
    toks = np.array([r.output_ids for r in reqs])  # [num, 4]
    s = engine.stats
    assert s.num_drafted > num and 0.1 < s.num_accepted / s.num_drafted < 0.9, (s.num_drafted, s.num_accepted)
    p1, p2 = _assert_pairs_follow_the_target(target, prompt, toks, temp)
    greedy2 = torch.nn.functional.one_hot(p2.argmax(-1), vocab).double()
    wrong = (p1[:, None] * (0.5 * p2 + 0.5 * greedy2)).flatten().numpy() * num
    assert _chi2_pvalue(np.bincount(toks[:, 0] * vocab + toks[:, 1], minlength=vocab ** 2).astype(float), wrong) < 1e-6


def test_cost_ar_steps_defer_the_drafter_context(tiny_target):
    """The cost policy's AR steps append no drafter context; the next propose catches it up from the feature
    history, equal to a fresh projection, and the output stays exact."""
    prompts = _prompts()
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=200,
                        calibrate=False, probe_every=4)
    engine.runner.length_policy.set_costs([1, 2, 3], torch.full((3, 7), 100.0), torch.ones(3))
    caught = []
    real = engine.runner.catch_up_context
    engine.runner.catch_up_context = lambda spans: caught.extend(b - a for _, a, b in spans) or real(spans)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts]
    for _ in range(6):
        engine.step()
    assert caught and all(n > 1 for n in caught)  # the probe at step 5 caught up several positions per slot
    running = [r for r in reqs if r.status.value == "running"]
    for r in running:  # bring every slot up to date, then compare with a fresh projection
        engine.runner.catch_up_context([(r.slot, engine.runner.ctx_len[r.slot], r.num_tokens - 1)])
    _assert_context_matches(engine, running, drafter)
    while engine.has_unfinished():
        engine.step()
    for r, p in zip(reqs, prompts):
        assert r.output_ids == greedy_reference(tiny_target, p, 40)


@pytest.mark.long  # ~35 s; the point-mass q of a deterministic proposal also runs in the sampled-lookup test
def test_argmax_drafter_blocks_follow_the_target():
    """``argmax_drafts``: at temperature 0.8 the drafter's block is its argmax, verified as a point-mass q; the joint
    law of the first 3 tokens is still the target's (χ² on pairs), and both accept and reject paths ran."""
    vocab, temp, num = 12, 0.8, 3072
    target = make_tiny_target("qwen3", vocab_size=vocab, seed=2, logit_scale=2.0)
    prompt = [1, 2, 3, 4, 5]
    drafter, _ = make_drafter(target, block_size=4, policy="fixed", seed=4)
    engine = SpecEngine(target, drafter, None, policy="fixed", max_batch_size=64, max_seq_len=16, seed=123,
                        argmax_drafts=True)
    reqs = engine.generate([prompt] * num, SamplingParams(max_new_tokens=3, temperature=temp))
    toks = np.array([r.output_ids for r in reqs])
    s = engine.stats
    assert 0.05 < s.num_accepted / s.num_drafted < 0.95
    prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * 2)
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = target(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -3:]
    cond = torch.softmax(logits.double() / temp, -1).reshape(vocab, vocab, 3, vocab)
    p1, p2, p3 = cond[0, 0, 0], cond[:, 0, 1], cond[:, :, 2]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    for cells, law in ((toks[:, 0] * vocab + toks[:, 1], joint.sum(2)), (toks[:, 1] * vocab + toks[:, 2], joint.sum(0))):
        observed = np.bincount(cells, minlength=law.numel()).astype(float)
        assert _chi2_pvalue(observed, law.flatten().numpy() * num) > 1e-3


def test_recipe_argmax_drafts_reach_the_engine(tiny_target):
    """``engine.argmax_drafts`` (off by default) reaches the engines ``from_config`` builds; ``true`` in a recipe
    drafts the block's argmax, an explicit keyword overrides the recipe."""
    from adaflash_ray.config import load_recipe

    drafter, _ = make_drafter(tiny_target, block_size=4, policy="fixed")
    models = (tiny_target, drafter, None)
    off = load_recipe("recipes/cpu_tiny.yaml", ["length_head.policy=fixed"])
    on = load_recipe("recipes/cpu_tiny.yaml", ["length_head.policy=fixed", "engine.argmax_drafts=true"])
    assert on.engine.argmax_drafts is True and off.engine.argmax_drafts is False
    assert SpecEngine.from_config(on, models=models, max_seq_len=64).runner.argmax_drafts is True
    assert SpecEngine.from_config(off, models=models, max_seq_len=64).runner.argmax_drafts is False
    assert SpecEngine.from_config(on, models=models, max_seq_len=64, argmax_drafts=False).runner.argmax_drafts is False


@pytest.mark.parametrize("argmax", [True, False])
def test_argmax_drafts_allocate_no_q_buffer(tiny_target, argmax):
    """With ``argmax_drafts`` a sampled request's blocks are point masses: the runner never allocates the drafter's
    ``[slots, max_draft, V]`` float32 q buffer (sampled drafts do, at their first sampled step)."""
    drafter, _ = make_drafter(tiny_target, block_size=4, policy="fixed")
    eng = SpecEngine(tiny_target, drafter, None, policy="fixed", max_batch_size=2, max_seq_len=64, seed=3,
                     argmax_drafts=argmax)
    reqs = eng.generate(_prompts(2), SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True))
    assert all(len(r.output_ids) == 8 for r in reqs) and eng.stats.num_drafted > 0
    assert (eng.runner.draft_probs is None) == argmax


def test_recipe_source_guard_reference_rows_reach_the_guard(tiny_target):
    """``engine.source_guard_reference_rows`` (0 by default: reference runs of ``min_samples`` steps) becomes the
    source guard's ``reference_rows``, with the early stop of :data:`SOURCE_GUARD_REFERENCE_STOP` beside it."""
    from adaflash_ray.config import load_recipe
    from adaflash_ray.engine.engine import SOURCE_GUARD_REFERENCE_STOP

    drafter, head = make_drafter(tiny_target, block_size=8, policy="cost")
    sets = ["length_head.draft_sources=[dflash,ngram]", "length_head.policy=cost"]
    for extra, rows, stop in (([], 0, 0.0), (["engine.source_guard_reference_rows=16"], 16,
                                             SOURCE_GUARD_REFERENCE_STOP)):
        cfg = load_recipe("recipes/cpu_tiny.yaml", sets + extra)
        eng = SpecEngine.from_config(cfg, models=(tiny_target, drafter, head), calibrate=False, max_seq_len=128)
        assert eng.source_guard is not None
        assert (eng.source_guard.reference_rows, eng.source_guard.reference_stop) == (rows, stop)
    with pytest.raises(Exception, match="source_guard_reference_rows"):
        load_recipe("recipes/cpu_tiny.yaml", ["engine.source_guard_reference_rows=-1"])


def test_recipe_draft_sources_reach_the_engine(tiny_target):
    """``length_head.draft_sources`` in a recipe builds the engine's sources through ``from_config`` (the drafter's
    block dropped for an engine without a drafter); an explicit ``draft_sources=None`` keeps the block only."""
    from adaflash_ray.config import load_recipe

    cfg = load_recipe("recipes/cpu_tiny.yaml", ["length_head.draft_sources=[dflash,ngram]", "length_head.policy=cost"])
    assert cfg.length_head.draft_sources == ["dflash", "ngram"]
    drafter, head = make_drafter(tiny_target, block_size=8, policy="cost")
    eng = SpecEngine.from_config(cfg, models=(tiny_target, drafter, head), calibrate=False, max_seq_len=128)
    assert eng.draft_sources == ("dflash", "ngram") and eng.planner is not None
    ar = SpecEngine.from_config(cfg, models=(tiny_target, None, None), max_seq_len=128)
    assert ar.draft_sources == ("ngram",)
    plain = SpecEngine.from_config(cfg, models=(tiny_target, drafter, head), calibrate=False, max_seq_len=128,
                                   draft_sources=None)
    assert plain.planner is None
    prompt = _prompts()[0]
    assert ar.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].output_ids == \
        greedy_reference(tiny_target, prompt, 12)
    assert eng.objective == "throughput"  # engine.objective: the recipe's, unless the caller gives one
    drain = load_recipe("recipes/cpu_tiny.yaml", ["length_head.draft_sources=[dflash,ngram]", "length_head.policy=cost",
                                                  "engine.objective=drain"])
    assert SpecEngine.from_config(drain, models=(tiny_target, drafter, head), calibrate=False,
                                  max_seq_len=128).objective == "drain"
    with pytest.raises(Exception, match="objective"):
        load_recipe("recipes/cpu_tiny.yaml", ["engine.objective=latency"])
    # engine.makespan_guard: on for the engines with the throughput guard, off (not an error) for the others
    ms = load_recipe("recipes/cpu_tiny.yaml", ["length_head.draft_sources=[dflash,ngram]", "length_head.policy=cost",
                                               "engine.makespan_guard=true"])
    assert not eng.makespan_guard
    assert SpecEngine.from_config(ms, models=(tiny_target, drafter, head), calibrate=False,
                                  max_seq_len=128).makespan_guard
    assert not SpecEngine.from_config(ms, models=(tiny_target, None, None), max_seq_len=128).makespan_guard
    assert not SpecEngine.from_config(ms, models=(tiny_target, drafter, head), calibrate=False, max_seq_len=128,
                                      throughput_guard=False).makespan_guard


def test_planner_keeps_lookups_through_a_step_without_a_match():
    """One looked-up step with no proposal does not put the lookups on the probe schedule (a request's context often
    has no match for a step or two); a run of such steps does (the moving average of verified lookup steps falls below
    IDLE_BELOW), and reset() brings them back."""
    from adaflash_ray.engine.hybrid import USE_EMA, IDLE_BELOW

    p = _planner()
    _costs(p, 10.0, 1.0, 1.05)
    sure = Proposal([7, 8, 9, 10], 3, "context", [4, 4, 4, 4], 4)
    assert p.plan(1, [20], [None], [sure])[0][0].source == "ngram" and p.lookup_due()
    p.plan(1, [20], [None], [Proposal([], 0, "context", [], 0)])  # looked up, nothing found
    assert p.lookup_due()
    misses = 0
    while p.lookup_due():
        p.plan(1, [20], [None], [Proposal([], 0, "context", [], 0)])
        misses += 1
    ema = (1 - USE_EMA) ** (misses + 1)  # from 1.0 after the hit: every miss multiplies by (1 - USE_EMA)
    assert ema < IDLE_BELOW <= ema / (1 - USE_EMA)
    p.reset()
    assert p.lookup_due()


def test_lookup_calibration_learns_acceptance_by_bucket():
    """Device-lookup estimates: the prior before any record; after steps where one bucket's γ = 4 proposals always
    accept exactly 2, E[a | γ] -> 2 for γ >= 2 there, while another bucket keeps its prior; flat past the length."""
    from adaflash_ray.engine.hybrid import LookupCalibration

    cal = LookupCalibration(max_ngram=3, max_draft=6, prior=0.5, prior_weight=1.0, decay=0.0)
    b = cal.bucket(np.array([0, 1]), np.array([3, 1]), np.array([1, 5]))
    assert b[0] != b[1]
    np.testing.assert_allclose(cal.expected(b[:1], np.array([6]))[0, :3], [0.0, 0.5, 0.75])
    for _ in range(200):
        cal.record(np.array([b[0]] * 4), np.array([4] * 4), np.array([2] * 4))
    e = cal.expected(b, np.array([6, 2]))
    assert abs(e[0, 2] - 2.0) < 0.02 and abs(e[0, 6] - 2.0) < 0.02 and e[0, 1] > 0.99
    np.testing.assert_allclose(e[1], [0.0, 0.5, 0.75, 0.75, 0.75, 0.75, 0.75])  # prior, flat past length 2
    with pytest.raises(ValueError):
        LookupCalibration(3, 6, prior=1.5)


@pytest.mark.parametrize("max_ngram,max_draft", [(3, 15), (1, 4), (4, 31), (3, 1)])
def test_lookup_calibration_record_and_bucket_match_their_definitions(max_ngram, max_draft):
    """LookupCalibration.record (histograms summed from the right) adds what its docstring says - 1 at positions
    1..min(a + 1, γ) to ``tried`` and 1..a to ``accepted`` of each row's bucket, the counts decayed first - and
    bucket() (a table read) equals the arithmetic its table is built from, over random rows and 200 steps."""
    from adaflash_ray.engine.hybrid import LookupCalibration

    rng = np.random.default_rng(max_ngram * 100 + max_draft)
    cal = LookupCalibration(max_ngram, max_draft, decay=0.03)
    tried, accepted = np.zeros_like(cal.tried), np.zeros_like(cal.accepted)
    pos = np.arange(1, max_draft + 1)
    for _ in range(200):
        m = int(rng.integers(1, 80))
        src, ml, occ = rng.integers(0, 2, m), rng.integers(0, max_ngram + 3, m), rng.integers(0, 9, m)
        b = cal.bucket(src, ml, occ)
        assert b.tolist() == cal._bucket_arith(src, ml, occ).tolist()
        g = rng.integers(1, max_draft + 1, m)
        a = np.minimum(rng.integers(0, max_draft + 1, m), g)
        cal.record(b, g, a)
        tried *= 0.97
        accepted *= 0.97
        for bi, gi, ai in zip(b, g, a):
            tried[bi] += pos <= min(ai + 1, gi)
            accepted[bi] += pos <= ai
    np.testing.assert_allclose(cal.tried, tried, rtol=1e-12)
    np.testing.assert_allclose(cal.accepted, accepted, rtol=1e-12)
    assert tried[tried > 0].size and (accepted <= tried + 1e-9).all()


@pytest.mark.parametrize("realised", [True, False])
def test_realised_step_cost_moves_the_lookup_width(realised):
    """observe_step: 64 rows with 15-token lookup proposals at the prior's acceptance (0.7 per position: E[a | 7] =
    2.12, E[a | 15] = 2.32); by the table (width 8 at 1.0 ms, width 16 at 1.1 ms) width 8 gives more tokens per ms.
    Steps that really take 1 ms more than the table (the engine's own host work, the same at every width) make width
    16 the better one: with realised_costs the planner's prices follow (table + 1 ms after its steps, the realised
    - table average reported per row) and it verifies γ = 15; without, it keeps γ = 7 and its prices."""
    from adaflash_ray.engine.hybrid import LookupArrays

    pl = HybridPlanner(("suffix",), 15, 16, [1, 8, 16], lookup_on_device=True)
    pl.realised_costs = realised
    look = np.ones((2, 16))
    look[:, 8:] = 1.1  # widths 9..16 at 1.1 ms
    pl.set_costs([32, 64], look[:, 1:] + 0.5, look)
    n = 64
    arr = LookupArrays(np.full(n, 15), np.full(n, 3), np.full(n, 1), np.zeros(n, np.int64), np.ones(n, bool))

    def gammas():
        choices, _ = pl.plan(64, [100] * n, [None] * n, [None] * n, device=arr)
        return {c.draft_len for c in choices}

    assert gammas() == {7}
    for _ in range(16):  # each step 1 ms above the table at its width (8: 1.0 -> 2.0 ms)
        pl.observe_step(64, 8, False, 2.0)
    assert gammas() == ({15} if realised else {7})
    state = pl.realised_cost_state()
    if realised:
        assert state["64"] == {"ms_over_table": pytest.approx(1.0), "steps": 16, "propose_ms_over_table": 0.0,
                               "propose_steps": 0} and state["32"]["steps"] == 0
        np.testing.assert_allclose(pl.spec_costs[1, 1:16], look[1, 1:] + 0.5 + 1.0)  # no propose seen: the same
        np.testing.assert_allclose(pl.lookup_costs[1], look[1] + 1.0)
        np.testing.assert_allclose(pl.lookup_costs[0], look[0])  # the other row: as measured
    else:
        np.testing.assert_allclose(pl.lookup_costs, look)
    # a realised time far below the table: the prices stop at half the table
    pl.set_costs([32, 64], look[:, 1:] + 0.5, look)
    pl.observe_step(64, 8, False, 0.01)
    np.testing.assert_allclose(pl.lookup_costs[1], 0.5 * look[1] if realised else look[1])


def test_realised_cost_of_proposing_is_learned_apart():
    """observe_step keeps the steps that proposed the block apart from the others: the tables price a propose at
    +0.5 ms over a lookup step of the same width; steps in the engine run 0.4 ms above the lookup table without a
    propose and only 0.1 ms above the spec table with one, so the realised propose premium (0.2 ms) is what the prices
    carry afterwards - each table moved by its own kind's average."""
    pl = HybridPlanner(("dflash", "suffix"), 15, 16, [1, 8, 16], lookup_on_device=True)
    look = np.full((1, 16), 1.0)
    spec = look[:, 1:] + 0.5
    pl.set_costs([64], spec, look)
    for _ in range(8):
        pl.observe_step(64, 8, False, 1.4)
    np.testing.assert_allclose(pl.spec_costs[0, 1:16], spec[0] + 0.4)  # no propose seen yet: the common overhead
    for _ in range(8):
        pl.observe_step(64, 8, True, 1.6)
    np.testing.assert_allclose(pl.lookup_costs[0], look[0] + 0.4)
    np.testing.assert_allclose(pl.spec_costs[0, 1:16], spec[0] + 0.1)
    assert pl.spec_costs[0, 7] - pl.lookup_costs[0, 7] == pytest.approx(0.2)
    st = pl.realised_cost_state()["64"]
    assert (st["steps"], st["propose_steps"]) == (8, 8)
    assert st["ms_over_table"] == pytest.approx(0.4) and st["propose_ms_over_table"] == pytest.approx(0.1)
    pl.realised_costs = False  # back to the tables at once
    np.testing.assert_allclose(pl.spec_costs[0, 1:16], spec[0])
    np.testing.assert_allclose(pl.lookup_costs[0], look[0])


def _observe_step_arrays(pl: HybridPlanner, batch_size: int, width: int, proposed: bool, ms: float) -> None:
    """HybridPlanner.observe_step by the numpy tables (the reference of its host-list path)."""
    if pl._base is None or not pl.realised_costs:
        return
    r = min(bisect.bisect_left(pl.batch_sizes, batch_size), len(pl.batch_sizes) - 1)
    spec, look = pl._base
    kind = bool(proposed)
    col = min(max(int(width), 1), pl.max_draft + 1) - 1
    resid, counts = pl._resid[kind], pl._resid_n[kind]
    n = counts[r] = counts[r] + 1
    w = max(pl.step_cost_decay, 1.0 / n)
    over = ms - float((spec if kind else look)[r, col])
    resid[r] += w * (over - resid[r])
    rw, rwn = pl._resid_w[kind][r], pl._resid_wn[kind][r]
    rwn[col] += 1
    rw[col] += max(pl.step_cost_decay, 1.0 / rwn[col]) * (over - rw[col])
    if (n + pl._resid_n[not kind][r]) % pl.step_cost_every == 0 or n == 1:
        d_spec, d_look = pl._kind_resid(r)
        for k, base, eff, d in ((True, spec, pl.spec_costs, d_spec), (False, look, pl.lookup_costs, d_look)):
            own = np.asarray(pl._resid_wn[k][r]) >= WIDTH_RESID_MIN
            eff[r] = np.maximum(base[r] + np.where(own, pl._resid_w[k][r], d), 0.5 * base[r])
        pl._spec_w[r] = pl.spec_costs[r, pl._widx].tolist()
        pl._look_w[r] = pl.lookup_costs[r, pl._widx].tolist()
        pl._look_ar[r] = float(pl.lookup_costs[r, 0])


def test_observe_step_host_lists_equal_the_arrays():
    """observe_step's host-list update gives the numpy tables' prices bit for bit (both tables, the widths' lists,
    the AR price, the averages) over random steps: every batch size (between and past the buckets), width, kind,
    realised times far below and above the tables, a realised_costs switch off and on, and a new table."""
    rng = np.random.default_rng(7)
    bs = [1, 2, 4, 8]
    fast, ref = (HybridPlanner(("dflash", "suffix"), 15, 16, [1, 2, 3, 4, 6, 8, 12, 16], lookup_on_device=True)
                 for _ in range(2))
    for step in range(600):
        if step % 200 == 0:  # a new table (the rows' averages start over)
            spec = rng.uniform(1.0, 3.0, (4, 15))
            look = rng.uniform(0.8, 2.5, (4, 16))
            for p in (fast, ref):
                p.set_costs(bs, spec, look)
        if step == 350:
            fast.realised_costs = ref.realised_costs = False
        if step == 420:
            fast.realised_costs = ref.realised_costs = True
        args = (int(rng.integers(1, 12)), int(rng.integers(0, 20)), bool(rng.random() < 0.4),
                float(rng.choice([0.01, rng.uniform(0.5, 4.0), 9.0])))
        fast.observe_step(*args)
        _observe_step_arrays(ref, *args)
        assert np.array_equal(fast.spec_costs, ref.spec_costs) and np.array_equal(fast.lookup_costs, ref.lookup_costs)
        assert (fast._spec_w, fast._look_w, fast._look_ar) == (ref._spec_w, ref._look_w, ref._look_ar), step
        assert (fast._resid, fast._resid_n) == (ref._resid, ref._resid_n), step
        assert (fast._resid_w, fast._resid_wn) == (ref._resid_w, ref._resid_wn), step
    assert not np.array_equal(fast.lookup_costs, fast._base[1])  # the prices moved


def test_lookup_device_option_is_checked(tiny_target):
    """``lookup_device``: auto = host on CPU (the CPU behaviour unchanged); an unknown value is a ValueError."""
    assert not SpecEngine(tiny_target, None, None, max_batch_size=1, max_seq_len=64,
                          draft_sources=("ngram",)).lookup_on_device
    with pytest.raises(ValueError, match="lookup_device"):
        SpecEngine(tiny_target, None, None, max_batch_size=1, max_seq_len=64, draft_sources=("ngram",),
                   lookup_device="gpu")


def test_planner_keeps_the_block_when_lookups_win_a_step_and_device_lookups_always_run():
    """At batch 1 a step where a sure lookup beats the drafter's block does not stop the block: it is still proposed
    while it was chosen in enough recent steps (moving average >= IDLE_BELOW), so the next step can choose it again.
    The drafter's estimate starts trusted (SourceCalibration's dflash prior 1.0, a host lookup's 0.6). Device lookups
    are due on every step, also after steps that did not use them; host lookups go on the probe schedule."""
    from adaflash_ray.engine.hybrid import IDLE_BELOW

    cal = SourceCalibration()
    assert cal.factor("dflash") == 1.0 and cal.factor("ngram") == 0.6
    p = _planner()
    _costs(p, 1.2, 1.0, 1.2)
    good_block = [1 + 0.8 * (1 - 0.8 ** g) / 0.2 for g in range(1, 16)]  # E[c(γ)] up to ~4.9
    sure = Proposal(list(range(7, 22)), 3, "context", [8] * 15, 8)  # 15 drafts, every occurrence agrees
    chosen, propose = p.plan(1, [30], [good_block], [None])
    assert chosen[0].source == "dflash" and propose
    chosen, propose = p.plan(1, [30], [good_block], [sure])  # the lookup wins this step ...
    assert chosen[0].source == "ngram" and propose  # ... and the block is proposed again
    chosen, _ = p.plan(1, [30], [good_block], [None])
    assert chosen[0].source == "dflash"
    # a block never chosen goes idle once the average falls below IDLE_BELOW
    q = _planner()
    _costs(q, 1.2, 1.0, 1.2)
    steps = 0
    while q.plan(1, [30], [good_block], [sure])[1]:
        steps += 1
    assert 1 <= steps <= 4 and q._use["dflash"] < IDLE_BELOW
    # device lookups: due whatever the record; host lookups idle after unused steps
    for on_device, due_after in ((True, True), (False, False)):
        r = HybridPlanner(("ngram",), 15, 16, [1, 2, 4, 8, 16], probe_every=2, lookup_on_device=on_device)
        _costs(r, 10.0, 1.0, 10.0)  # drafting never pays: the lookup is never chosen
        for _ in range(12):
            r.plan(1, [30], [None], [sure])
        assert r.lookup_due() is due_after


@pytest.mark.parametrize("where", ["host", "device"])
def test_planner_nothing_to_verify_fast_path_matches_the_arrays(where):
    """A step with no pending block and no non-empty lookup proposal (the γ = 0 regime) takes
    ``HybridPlanner._plan_nothing``: the same choices, propose, plan value and schedules as the general array path
    (``_plan_general``), step after step, with and without costs, host lookup time, fixed γ, and steps that do have
    something to verify in between (both planners then take the general path)."""
    from adaflash_ray.engine.hybrid import LookupArrays

    rng = np.random.default_rng(0)
    num_fast = num_one = 0
    for with_costs in (True, False):
        fast, ref = (HybridPlanner(("dflash", "suffix"), 15, 16, [1, 2, 3, 4, 6, 8, 12, 16], probe_every=2,
                                   lookup_on_device=where == "device") for _ in range(2))
        if with_costs:
            for p in (fast, ref):
                _costs(p, 1.5, 1.0, 1.3)
        for step in range(80):
            n = int(rng.integers(1, 6))
            caps = rng.integers(0, 30, n).tolist()
            block = [1 + 0.5 * g for g in range(1, 16)]
            dexp = [block if rng.random() < 0.1 else None for _ in range(n)]
            fixed = [3 if rng.random() < 0.1 else None for _ in range(n)]
            device, props = None, [None] * n
            if where == "device":
                device = LookupArrays(np.where(rng.random(n) < 0.15, rng.integers(1, 5, n), 0), rng.integers(0, 4, n),
                                      rng.integers(0, 6, n), rng.integers(0, 2, n), rng.random(n) < 0.7)
            else:
                props = [None if rng.random() < 0.3 else Proposal([5, 6, 7], 2, "context", [3, 2, 1], 3)
                         if rng.random() < 0.15 else Proposal([], 0, "context", [], 0) for _ in range(n)]
            args = (4 if n > 1 else 1, caps, dexp, props, fixed, float(rng.choice([0.0, 0.05])), device)
            empty = all(e is None for e in dexp) and (
                not (device.valid & (device.length > 0)).any() if device is not None else
                all(p is None or not len(p) for p in props))
            num_fast += empty
            got, want = fast.plan(*args), ref._plan_general(*args)
            assert got[1] == want[1] and [vars(c) for c in got[0]] == [vars(c) for c in want[0]], step
            assert (fast.last_value, fast._use, fast._since, fast._interval, fast._idle) == \
                (ref.last_value, ref._use, ref._since, ref._interval, ref._idle), step
            assert fast._block_net == pytest.approx(ref._block_net, abs=1e-12), step
            num_one += empty and n == 1 and with_costs and fast._block_est is not None
    assert num_fast > 40  # the fast path ran
    assert num_one > 5  # its one-row float path too, with a block estimate to value


def test_planner_keeps_a_block_that_pays_on_average():
    """Batch 1, a sure lookup match on two steps of three and none on the third: the block wins only the third steps
    (a third of them, where the frequency rule alone lets it go idle) but gains more there than its proposes cost on
    the others, so it stays proposed and every no-match step drafts the block. At a propose price above that gain it
    goes idle (probes, and the step after each one that used it)."""
    good_block = [1 + 0.8 * (1 - 0.8 ** g) / 0.2 for g in range(1, 16)]  # E[c(γ)] up to ~4.9
    sure = Proposal(list(range(7, 22)), 3, "context", [8] * 15, 8)
    for spec_ms, kept in ((1.15, True), (3.0, False)):
        p = _planner()
        _costs(p, spec_ms, 1.0, 1.1)  # a propose costs 0.05 ms (1.15 ms) or 1.9 ms (3.0 ms) on a 1.1 ms verify
        pending, proposes, no_match_sources = good_block, [], []
        for step in range(30):
            prop = None if step % 3 == 2 else sure
            chosen, propose = p.plan(1, [30], [pending], [prop])
            proposes.append(propose)
            if prop is None and pending is not None:
                no_match_sources.append(chosen[0].source)
            pending = good_block if propose else None
        if kept:
            assert all(proposes), proposes
            assert no_match_sources == ["dflash"] * 10, no_match_sources
        else:  # proposed at the probes and after the steps that used the block, not throughout
            assert not all(proposes) and p._block_net < 0, (proposes, p._block_net)
    # a worthless block (never chosen) where the spec table reads below the lookup table (1.08 against 1.10 ms: two
    # tables measured apart) is not kept by its net value: it goes idle as with the frequency rule alone
    p = _planner()
    _costs(p, 1.08, 1.0, 1.10)
    pending, proposes = [1.0] * 15, []
    for _ in range(30):
        chosen, propose = p.plan(1, [30], [pending], [sure])
        assert chosen[0].source == "ngram"
        proposes.append(propose)
        pending = [1.0] * 15 if propose else None
    assert proposes.count(True) < 15 and p._block_net <= 0, (proposes, p._block_net)


def _cyclic_hybrid(tokens: int, **engine_kw):
    """(target, prompt, engine): a vocab-16 cyclic target (ngram lookups match), a random drafter whose head is
    trusted, and the dflash + ngram hybrid at batch 1 whose tables price every step at 1 ms."""
    target = make_tiny_target("llama", vocab_size=16, seed=1, logit_scale=3.0)
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=1, max_seq_len=tokens + 64, calibrate=False,
                     draft_sources=("dflash", "ngram"), probe_every=4, **engine_kw)
    eng.planner.set_costs([1], np.ones((1, 7)), np.ones((1, eng.runner.max_draft + 1)))
    return target, [1, 2, 3, 4, 5], eng


def _block_guard_run(guarded: bool, tokens: int, min_rows: int | None) -> tuple[float, float]:
    """One batch-1 request on a vocab-16 cyclic target (ngram matches) through the hybrid whose tables price the
    drafter's propose at nothing and whose random head is trusted as it is, while each step that proposes really takes
    3 ms against 1 ms for any other step. Returns (share of steps that proposed, fake seconds); asserts the output is
    the target's greedy."""
    target, prompt, eng = _cyclic_hybrid(tokens, block_guard=guarded, source_guard=False)  # the block guard alone
    assert (eng.block_guard is not None) == guarded
    eng.planner.calibration = SourceCalibration(prior=1.0, decay=1e-9, running_start=False)
    eng.guard.set_buckets([1])
    if guarded:
        eng.block_guard.set_buckets([1])
        if min_rows is not None:
            eng.block_guard.min_rows = min_rows
    clock, proposes, real = [0.0], [], eng.runner.step

    def step(slots, anchors, anchor_pos, draft_lens, spec, propose=True, *a, **k):
        clock[0] += 1e-3 * (3.0 if spec and propose else 1.0)
        proposes.append(bool(spec and propose))
        return real(slots, anchors, anchor_pos, draft_lens, spec, propose, *a, **k)

    eng.runner.step = step
    eng.clock = eng.runner.clock = lambda: clock[0]
    req = eng.generate([prompt], SamplingParams(max_new_tokens=tokens, ignore_eos=True))[0]
    assert req.output_ids == greedy_reference(target, prompt, tokens), guarded
    return sum(proposes) / len(proposes), clock[0]


def test_block_guard_stops_proposes_that_cost_more_than_they_gain():
    """The engine's block guard (proposing steps against planned steps without a propose, per batch bucket) backs off
    proposes that the tables call free but that cost 3x a step (:func:`_block_guard_run`): far fewer of them and less
    time, the same greedy output. Deciding on min_samples steps (min_rows 0) over 200 tokens, and with the shipped
    settings (32 rows' worth of proposing steps at batch 1: slower to back off) over 400 (0.81x the time here)."""
    (share_on, t_on), (share_off, t_off) = _block_guard_run(True, 200, 0), _block_guard_run(False, 200, 0)
    assert share_on < 0.2 < 0.4 < share_off and t_on < 0.7 * t_off, (share_on, share_off, t_on, t_off)
    (share_on, t_on), (share_off, t_off) = _block_guard_run(True, 400, None), _block_guard_run(False, 400, None)
    assert share_on < 0.75 * share_off and t_on < 0.9 * t_off, (share_on, share_off, t_on, t_off)


def test_planner_block_off_keeps_the_block_unproposed():
    """``block_off``: no propose whatever the schedule says (a fresh planner proposes), unless a request fixes its γ;
    a pending block that wins is still chosen."""
    good_block = [1 + 0.8 * (1 - 0.8 ** g) / 0.2 for g in range(1, 16)]
    p = _planner()
    _costs(p, 1.0, 1.0, 1.0)
    chosen, propose = p.plan(1, [30], [None], [None], block_off=True)
    assert not propose and chosen[0].source == "none"
    chosen, propose = p.plan(1, [30], [good_block], [None], block_off=True)
    assert chosen[0].source == "dflash" and not propose
    _, propose = p.plan(1, [30], [good_block], [None], fixed=[4], block_off=True)
    assert propose
    _, propose = p.plan(1, [30], [good_block], [None])
    assert propose


def test_block_guard_leaves_fixed_draft_lens_alone_and_resets(tiny_target):
    """A request that fixes its own γ drafts the block at that γ even while the block guard backs the proposes off (the
    guard is not consulted for such a step); a drafter reload forgets the guard's proposing-step record and a new
    batch ends its back-off. Greedy output exact."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=160, calibrate=False,
                     draft_sources=("dflash", "ngram"), probe_every=4, block_guard=True)
    prompts = _prompts(2)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True, draft_len=3)) for p in prompts]
    eng.step()  # admission (a new batch: back-offs end) and the first step
    for bk in eng.block_guard.buckets:
        bk.forced_left = 10**6  # a back-off that outlasts the run
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == [greedy_reference(tiny_target, p, 20) for p in prompts]
    assert all(set(r.draft_lens[:10]) == {3} for r in reqs)  # (the last steps: capped by the tokens left)
    assert all(bk.forced_left == 10**6 for bk in eng.block_guard.buckets)  # never asked: nothing counted down
    eng.block_guard.buckets[0].policy.add(2.0, 1.0, 0.5)
    eng.load_drafter(eng.drafter_tensors(), version=1)
    assert all(bk.policy.num_samples == 0 and bk.forced_left == 0 for bk in eng.block_guard.buckets)
    assert eng._last_planned_propose is None


def _source_guard_run(guarded: bool, planned_ms: float, tokens: int = 300) -> tuple[float, float, int]:
    """One batch-1 request on a vocab-16 cyclic target (ngram matches) through the hybrid, on a fake clock: a planned
    step takes ``planned_ms``, a block-only step (every row its drafter block, no plan) 1 ms, an AR step 4 ms (so the
    throughput guard keeps out of the comparison). Returns (share of planned steps, fake ms, block-only steps forced);
    asserts the output is the target's greedy."""
    target, prompt, eng = _cyclic_hybrid(tokens, source_guard=guarded)
    assert (eng.source_guard is not None) == guarded
    for g in (eng.guard, eng.source_guard):
        if g is not None:
            g.set_buckets([1])
    clock, planned, real = [0.0], [], eng._run

    def run(batch):
        plan = batch.choices is not None
        clock[0] += 1e-3 * (planned_ms if plan else 1.0 if batch.propose else 4.0)
        planned.append(plan)
        return real(batch)

    eng._run = run
    eng.clock = eng.runner.clock = lambda: clock[0]
    req = eng.generate([prompt], SamplingParams(max_new_tokens=tokens, ignore_eos=True))[0]
    assert req.output_ids == greedy_reference(target, prompt, tokens), (guarded, planned_ms)
    return sum(planned) / len(planned), 1e3 * clock[0], eng.stats.num_source_guard_steps


def test_source_guard_takes_the_block_alone_where_the_plan_is_slower():
    """The source guard (planned steps against block-only ones, per batch bucket): where a planned step costs 5x a
    block-only one it forces block-only steps and the run takes less time (0.82x here); where both cost the same the
    planner keeps most steps (its ngram drafts commit more) and the guard's reference runs cost little (1.06x).
    Greedy output exact in all four runs (:func:`_source_guard_run`)."""
    share_off, t_off, forced_off = _source_guard_run(False, 5.0)
    share_on, t_on, forced_on = _source_guard_run(True, 5.0)
    assert forced_off == 0 and forced_on > 30 and share_on < 0.8 * share_off and t_on < 0.9 * t_off, \
        (share_on, share_off, t_on, t_off, forced_on)
    share_off, t_off, _ = _source_guard_run(False, 1.0)
    share_on, t_on, forced_on = _source_guard_run(True, 1.0)
    assert share_on > 0.75 and t_on < 1.12 * t_off, (share_on, share_off, t_on, t_off, forced_on)


@pytest.mark.parametrize("lookup_device", ["host", "device"])
def test_source_guard_block_only_steps_verify_the_block_and_reset(tiny_target, lookup_device):
    """While the source guard forces block-only steps every step verifies the drafter's block at the full γ (capped by
    the tokens left) with no lookup draft (host lookups or the device's, whose stale proposals are dropped; the first
    planned step proposed a block, so every row has one), and a
    request that fixes its own γ is never forced. A new batch keeps the back-off, a drafter reload ends it and forgets
    both regimes' records. Greedy output exact."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=160, calibrate=False,
                     draft_sources=("dflash", "ngram"), probe_every=4, lookup_device=lookup_device)
    assert eng.source_guard is not None and eng.block_guard is None
    eng.guard = None  # no forced AR steps: every step is the source guard's or the planner's
    prompts = _prompts(2)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts]
    eng.step()  # admission and the first (planned) step
    for bk in eng.source_guard.buckets:
        bk.forced_left = 10**6
    forced = eng.stats.num_source_guard_steps
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == [greedy_reference(tiny_target, p, 20) for p in prompts]
    assert eng.stats.num_source_guard_steps - forced == len(reqs[0].draft_lens) - 1  # every step after the first
    for r in reqs:
        assert set(r.step_sources[1:]) <= {"dflash", "none"}
        # the full γ from the second forced step on (the first verifies what the planned step left: maybe none),
        # capped by the tokens left - 1 (the prefill committed the first token)
        left = [20 - 1 - sum(a + 1 for a in r.num_accepted[:i]) - 1 for i in range(len(r.draft_lens))]
        assert all(g == min(7, max(c, 0)) for g, c in zip(r.draft_lens[2:], left[2:])), (r.draft_lens, left)
    own = [eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True, draft_len=2)) for p in prompts]
    eng.step()  # a new batch: the back-off goes on
    assert all(bk.forced_left > 10**5 for bk in eng.source_guard.buckets)
    for bk in eng.source_guard.buckets:
        bk.forced_left = 10**6
    while eng.has_unfinished():
        eng.step()
    assert all(set(r.draft_lens[:8]) == {2} for r in own)  # a request's own γ: planned, never forced
    assert all(bk.forced_left == 10**6 for bk in eng.source_guard.buckets)
    eng.source_guard.buckets[0].policy.add(2.0, 1.0, 0.5)
    eng.source_guard.buckets[0].ar.add(3.0, 1.0, 0.5)
    eng.load_drafter(eng.drafter_tensors(), version=1)
    # both regimes' records go: the block-only steps' measured the old drafter as much as the planned steps'
    assert all(bk.policy.num_samples == bk.ar.num_samples == 0 and bk.forced_left == 0
               for bk in eng.source_guard.buckets)
    assert eng._last_regime is None


@pytest.mark.parametrize("block_guard", [False, True])
def test_source_guard_back_off_has_the_prefill_propose_the_first_block(tiny_target, monkeypatch, block_guard):
    """A request admitted while the source guard's back-off goes on (a new batch keeps it) gets its first block at the
    prefill, whatever the planner's schedule (its block idle) or the block guard (whose planned step the block-only
    step replaces) say: its first block-only step verifies that block at the full γ instead of committing one token.
    Where the throughput guard forces the next step to AR the prefill still proposes nothing. Greedy output exact."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=1, max_seq_len=96, calibrate=False,
                     draft_sources=("dflash", "ngram"), block_guard=block_guard)
    monkeypatch.setattr(eng.planner, "wants_block", lambda: False)  # lookups won: the block idle in the schedule
    guards = [eng.source_guard] + ([eng.block_guard] if block_guard else [])
    prompt = _prompts(1)[0]
    for bk in (bk for g in guards for bk in g.buckets):
        bk.forced_left = 10**6
    prefills, _ = _record_prefills_and_catch_ups(eng)
    req = eng.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert req.output_ids == greedy_reference(tiny_target, prompt, 12)
    assert req.draft_lens[:2] == [7, 7] and req.step_sources[:2] == ["dflash"] * 2, (req.draft_lens, req.step_sources)
    monkeypatch.setattr(eng.guard, "would_force", lambda batch_size: True)  # the next step is an AR step
    eng.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [p[1] for p in prefills] == [True, False]


def test_prefill_before_a_block_only_step_makes_no_lookup_proposals(tiny_target):
    """With the device lookup, a prefill whose next step is the source guard's block-only step proposes the first
    block and no lookup drafts (that step verifies the blocks and proposes no lookups; the admitted slots' device
    proposals are marked stale); a prefill before a planned step makes them - also under the back-off when a request
    fixes its own γ (no block-only step then). Either way the prompt, its first token and the step's tokens fill the
    slot's token history. Greedy output exact throughout."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=96, calibrate=False,
                     draft_sources=("dflash", "ngram"), lookup_device="device")
    eng.guard = None
    calls, prefill = [], eng.runner.prefill

    def recorded(slots, prompts, params, spec, lookup=False, append=True):
        res = prefill(slots, prompts, params, spec, lookup, append)
        calls.append((bool(spec), bool(lookup), res.lookup is not None))
        return res

    eng.runner.prefill = recorded
    prompts = _prompts(2)
    for bk in eng.source_guard.buckets:
        bk.forced_left = 10**6
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True)) for p in prompts]
    eng.step()
    # (on CPU the runner prefills the prompts one at a time: the call and its two inner ones)
    assert calls and set(calls) == {(True, False, False)}, calls
    hist = eng.runner.lookup.history
    for r, p in zip(reqs, prompts):  # the prompt and its first token (and the first step's tokens after them)
        assert hist[r.slot, :len(p)].tolist() == p
        assert hist[r.slot, len(p):len(p) + len(r.output_ids)].tolist() == r.output_ids
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == [greedy_reference(tiny_target, p, 10) for p in prompts]
    for bk in eng.source_guard.buckets:  # no back-off: the prefill makes the first lookup proposals
        bk.forced_left = 0
    calls.clear()
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True)) for p in prompts]
    eng.step()
    assert calls and set(calls) == {(True, True, True)}, calls
    for r, p in zip(reqs, prompts):
        assert hist[r.slot, :len(p) + len(r.output_ids)].tolist() == p + r.output_ids
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == [greedy_reference(tiny_target, p, 10) for p in prompts]
    # the back-off on again, but a request fixes its own γ: the next step is planned (_schedule asks no source guard
    # then), so the prefill makes the lookup proposals
    for bk in eng.source_guard.buckets:
        bk.forced_left = 10**6
    calls.clear()
    guard_steps = eng.stats.num_source_guard_steps
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True, draft_len=d))
            for p, d in zip(prompts, (3, None))]
    eng.step()
    assert calls and set(calls) == {(True, True, True)}, calls
    assert eng.stats.num_source_guard_steps == guard_steps
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == [greedy_reference(tiny_target, p, 10) for p in prompts]


@pytest.mark.parametrize("lookup_device", ["host", "device"])
def test_source_guard_first_block_only_step_verifies_the_lookup_where_no_block_is_pending(lookup_device):
    """Planned steps that leave the drafter's block idle (the block guard's ``block_off``, always on here) and a
    block-only step forced after every two of them: the block-only step's rows have no pending block, so each verifies
    its lookup proposal - the device lookup's current one (at its length) or the host lookup's - capped by its tokens
    left - 1 and the block's γ, instead of γ = 0 at a propose step's price; the rows with a pending block verify it at the full γ, and
    the step still proposes the next block. On a vocab-16 cyclic target (ngram matches) such steps commit several
    tokens per row. Greedy output exact; sampled runs complete (the lookup rows verified as a point-mass q)."""
    target = make_tiny_target("llama", vocab_size=16, seed=1, logit_scale=3.0)
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=160, calibrate=False,
                     draft_sources=("dflash", "ngram"), probe_every=4, lookup_device=lookup_device)
    eng.planner.set_costs([1, 2], np.ones((2, 7)), np.ones((2, eng.runner.max_draft + 1)))
    eng.guard = None  # no forced AR steps: every step is the source guard's or the planner's
    eng._block_off = lambda batch_size, any_own: True  # the planned steps never propose the block
    nd, forced, real = eng.runner.max_draft, [], eng._block_only

    def block_only(running, batch_size, slots):
        # before the step: per row (pending block, the lookup proposal's length where it has a current one, cap)
        caps = [r.params.max_new_tokens - len(r.output_ids) - 1 for r in running]
        if lookup_device == "device":
            props = [int(eng._dev_props[s, nd]) if eng._dev_valid[s] else 0 for s in slots]
        else:  # the host lookup's proposal now (syncing a request's index changes none of its proposals)
            props = [len(eng._lookup(r, min(nd, c)).tokens) if c > 0 else 0 for r, c in zip(running, caps)]
        before = [(r.dflash_expected is not None, k, c) for r, k, c in zip(running, props, caps)]
        batch = real(running, batch_size, slots)
        forced.append((before, batch))
        return batch

    accepted, run = [], eng._run

    def run_step(batch):  # the block-only steps' accepted drafts per row
        res = run(batch)
        if batch.choices is None and batch.propose:
            accepted.append(res.num_accepted)
        return res

    eng._block_only, eng._run = block_only, run_step
    prompts = [[1, 2, 3, 4, 5], [3, 4, 5, 6]]

    def drive(params: SamplingParams) -> list:  # a block-only step forced after every two planned steps
        reqs = [eng.add_request(p, params) for p in prompts]
        num_steps = 0
        while eng.has_unfinished():
            num_steps += 1
            if num_steps % 3 == 0:
                for bk in eng.source_guard.buckets:
                    bk.forced_left = max(bk.forced_left, 1)
            eng.step()
        return reqs

    reqs = drive(SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert [r.output_ids for r in reqs] == [greedy_reference(target, p, 40) for p in prompts]
    assert len(forced) >= 8 and len(accepted) == len(forced)
    num_lookup_rows = 0
    for before, batch in forced:
        assert batch.propose and batch.choices is None
        rows = batch.lookup_rows if lookup_device == "device" else batch.host_drafts
        for i, ((pending, k, c), g) in enumerate(zip(before, batch.draft_lens)):
            if pending:  # its block at the full γ, capped
                assert g == min(7, max(c, 0)) and not (rows and rows[i]), (before, batch.draft_lens)
            elif k > 0 and c > 0:  # no block, a lookup proposal: it, at its length capped - not γ = 0
                assert g == min(k, 7, c) > 0 and rows[i], (before, batch.draft_lens)
                num_lookup_rows += 1
            else:
                assert g == 0, (before, batch.draft_lens)
    assert num_lookup_rows >= 8 and any(p for before, _ in forced for p, _, _ in before)  # both kinds of row
    # the block-only steps' lookup rows commit more than one token each on average (a cyclic target: the ngram
    # drafts hold)
    committed = [a + 1 for (_, batch), acc in zip(forced, accepted)
                 for a, k in zip(acc, (batch.lookup_rows if lookup_device == "device" else batch.host_drafts) or ())
                 if k]
    assert len(committed) == num_lookup_rows and sum(committed) > 2 * len(committed), committed
    forced.clear()
    sampled = drive(SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=7))
    assert all(len(r.output_ids) == 30 for r in sampled)
    assert any(rows for _, b in forced for rows in (b.lookup_rows, b.host_drafts) if rows)


def test_source_guard_only_in_the_hybrid_and_off_by_recipe(tiny_target):
    """The source guard comes with the hybrid of the drafter and a lookup source (the throughput guard on), not with
    the cost policy alone, a lookup-only engine, ``propose_first`` or ``source_guard=False``; the recipe's
    ``engine.source_guard: false`` reaches ``from_config``."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    kw = dict(policy="cost", max_batch_size=2, max_seq_len=128, calibrate=False)
    assert SpecEngine(tiny_target, drafter, head, draft_sources=("dflash", "suffix"), **kw).source_guard is not None
    assert SpecEngine(tiny_target, drafter, head, **kw).source_guard is None
    assert SpecEngine(tiny_target, drafter, head, draft_sources=("dflash", "ngram"), source_guard=False,
                      **kw).source_guard is None
    assert SpecEngine(tiny_target, drafter, head, draft_sources=("dflash", "ngram"), throughput_guard=False,
                      **kw).source_guard is None
    assert SpecEngine(tiny_target, drafter, head, draft_sources=("dflash", "ngram"), propose_first=True,
                      lookup_device="device", **kw).source_guard is None
    assert SpecEngine(tiny_target, None, None, policy="fixed", max_batch_size=2, max_seq_len=128,
                      draft_sources=("ngram",)).source_guard is None
    from adaflash_ray.config import load_recipe

    cfg = load_recipe("recipes/cpu_tiny.yaml", ["length_head.policy=cost", "length_head.draft_sources=[dflash,ngram]"])
    on = SpecEngine.from_config(cfg, models=(tiny_target, drafter, head), calibrate=False, max_batch_size=2,
                                max_seq_len=128)
    cfg_off = load_recipe("recipes/cpu_tiny.yaml", ["length_head.policy=cost",
                                                    "length_head.draft_sources=[dflash,ngram]",
                                                    "engine.source_guard=false"])
    off = SpecEngine.from_config(cfg_off, models=(tiny_target, drafter, head), calibrate=False, max_batch_size=2,
                                 max_seq_len=128)
    assert on.source_guard is not None and off.source_guard is None


def _record_prefills_and_catch_ups(engine) -> tuple[list, list]:
    """Wrap ``engine.runner``'s prefill and catch-up: returns (prefills as ``(num prompts, proposes, appends)``,
    catch-up spans ``(slot, start, stop)``), filled as the engine runs."""
    prefills, catch_ups = [], []
    prefill, catch_up = engine.runner.prefill, engine.runner.catch_up_context

    def recorded_prefill(slots, prompts, params, spec, *a, **k):
        prefills.append((len(slots), bool(spec), k.get("append", True)))
        return prefill(slots, prompts, params, spec, *a, **k)

    engine.runner.prefill = recorded_prefill
    engine.runner.catch_up_context = lambda spans: catch_ups.extend(spans) or catch_up(spans)
    return prefills, catch_ups


def test_hybrid_schedule_carries_over_batches_and_prefill_defers_the_context():
    """At batch 1 each request is a new batch, and the planner's schedule carries over: once the drafter's block is
    idle (its table price is 100x a lookup step's, the lookups win), a new request's prefill proposes no first block
    and appends no drafter context (its slot's context length 0). A later step that proposes catches the context up
    from the feature history, equal to a fresh projection; every output is the target's greedy."""
    target = make_tiny_target("llama", vocab_size=16, seed=1, logit_scale=3.0)
    prompts = [[1, 2, 3, 4, 5], [3, 4, 5, 6, 7], [2, 3, 4, 5, 6]]
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=1, max_seq_len=160, calibrate=False,
                     draft_sources=("dflash", "ngram"), probe_every=4)
    eng.planner.set_costs([1], np.full((1, 7), 100.0), np.ones((1, eng.runner.max_draft + 1)))
    eng.block_guard = None  # the planner's own schedule alone
    prefills, caught = _record_prefills_and_catch_ups(eng)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    first = eng.generate([prompts[0]], params)[0]
    assert [p[1] for p in prefills] == [True] and not eng.planner.wants_block()  # a fresh planner tries the block, then idles it
    caught.clear()
    req = eng.add_request(prompts[1], params)
    eng.step()  # the prefill and one step
    assert [p[1] for p in prefills] == [True, False] and eng.runner.ctx_len[req.slot] <= req.num_tokens - 1
    while req.status.value == "running" and not caught:
        eng.step()  # until the block's probe proposes: the deferred context comes back from the history
    assert caught and caught[0][1] == 0 and caught[0][2] > len(prompts[1])
    assert req.status.value == "running"  # the probe came well before its 60 tokens
    eng.runner.catch_up_context([(req.slot, eng.runner.ctx_len[req.slot], req.num_tokens - 1)])
    _assert_context_matches(eng, [req], drafter)
    while eng.has_unfinished():
        eng.step()
    third = eng.generate([prompts[2]], params)[0]
    for r, p in zip((first, req, third), prompts):
        assert r.output_ids == greedy_reference(target, p, 60)


def test_cost_policy_prefills_in_the_ar_regime_propose_nothing(tiny_target):
    """The cost policy in its γ = 0 regime (drafting priced at 100x an AR step): requests that join a batch waiting at
    γ = 0, or start a batch while the earlier batch's γ = 0 answer stands, are prefilled without a first block or
    drafter context (their γ would be 0; a new batch's first probe comes after the shortest wait); a request fixing
    its own γ still gets its block; the probes catch the context up; every output is the target's greedy."""
    prompts = _prompts() + [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=200,
                        calibrate=False, probe_every=4, throughput_guard=False)
    engine.runner.length_policy.set_costs([1, 2], torch.full((2, 7), 100.0), torch.ones(2))
    firsts, caught = _record_prefills_and_catch_ups(engine)
    params = [SamplingParams(max_new_tokens=12 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    reqs = engine.generate(prompts, params)
    assert firsts[0][1:] == (True, True)  # the first batch: the policy's answer comes from its prefill's propose
    assert any(not spec and not app for _, spec, app in firsts[1:]), firsts  # refills into the γ = 0 batch
    assert all(spec == app for _, spec, app in firsts)  # no propose without the context it needs
    assert caught and any(a == 0 for _, a, _ in caught)  # a deferred prompt's context caught up from position 0
    for r, p, sp in zip(reqs, prompts, params):
        assert r.output_ids == greedy_reference(tiny_target, p, sp.max_new_tokens)
    # a request with its own γ joining the γ = 0 batch still gets its first block at its prefill
    firsts.clear()
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    own = engine.add_request(prompts[1], SamplingParams(max_new_tokens=10, ignore_eos=True, draft_len=3))
    while engine.has_unfinished():
        engine.step()
    assert firsts[-1][1] is True and own.output_ids == greedy_reference(tiny_target, prompts[1], 10)
    # a new batch while the γ = 0 answer stands: no first block, the shortest probe wait; without that answer: the block
    # (and a due probe - a drafter reload sets one up - proposes at the prefill)
    pol = engine.runner.length_policy
    for ar_chosen, reload in ((True, False), (False, False), (True, True)):
        pol.ar_chosen, pol.steps_since_probe, pol.probe_interval = ar_chosen, 5, 32
        if reload:
            engine.load_drafter(engine.drafter_tensors(), version=1)
        firsts.clear()
        r = engine.add_request(prompts[2], SamplingParams(max_new_tokens=8, ignore_eos=True))
        engine.step()
        assert firsts[0][1] is (not ar_chosen or reload) and pol.probe_interval == pol.probe_every
        while engine.has_unfinished():
            engine.step()
        assert r.output_ids == greedy_reference(tiny_target, prompts[2], 8)


def test_prefill_proposes_no_block_a_forced_ar_step_would_drop(tiny_target):
    """A request admitted while the throughput guard will force the next step to AR (or the hybrid's block guard
    keep it from proposing) is prefilled without a first block and without drafter context: that step would drop
    the block. Once nothing forces, a refill proposes again; greedy output is the target's either way."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    prompts = _prompts()
    for hybrid in (False, True):
        engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=200,
                            calibrate=False, probe_every=4, draft_sources=("dflash", "ngram") if hybrid else None,
                            block_guard=True)
        guard = engine.block_guard if hybrid else engine.guard
        assert guard is not None
        firsts, _ = _record_prefills_and_catch_ups(engine)
        long = engine.add_request(prompts[2], SamplingParams(max_new_tokens=40, ignore_eos=True))
        engine.step()
        for bk in guard.buckets:  # every bucket forcing its next 3 steps
            bk.forced_left = 3
        firsts.clear()
        forced = engine.add_request(prompts[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
        engine.step()
        assert firsts == [(1, False, False)]
        for bk in guard.buckets:
            bk.forced_left = 0
        while engine.has_unfinished():
            engine.step()
        for r, p, n in ((long, prompts[2], 40), (forced, prompts[0], 12)):
            assert r.output_ids == greedy_reference(tiny_target, p, n)


def test_block_match_scores_the_pending_block_against_the_committed_tokens(tiny_target):
    """A step that verifies host drafts with a drafter reports, per row, the pending block's common prefix with the
    committed tokens, cut at min(a + 1, W - 1): a mismatch inside the known tokens gives the block's exact greedy
    acceptance, a block agreeing with every known token gives the cut (at least that many)."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=128, calibrate=False,
                     draft_sources=("dflash", "ngram"), lookup_device="host")
    r, prompts = eng.runner, [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    ref = [greedy_reference(tiny_target, p, 8) for p in prompts]
    params = [SamplingParams(max_new_tokens=8)] * 2
    first = r.prefill([0, 1], prompts, params, True)
    assert [c[0] for c in first.committed] == [ref[0][0], ref[1][0]]
    wrong = lambda t: (t + 1) % 128  # noqa: E731
    # host drafts: row 0 right for 3 tokens then wrong (a = 3), row 1 wrong at once (a = 0); W = 5
    host = [ref[0][1:4] + [wrong(ref[0][4])], [wrong(ref[1][1]), 5]]
    # the pending blocks: row 0 agrees with the first 2 committed tokens, row 1 with its only known token
    r.drafts[0, :4] = torch.tensor([ref[0][1], ref[0][2], wrong(ref[0][3]), ref[0][4]])
    r.drafts[1, :4] = torch.tensor([ref[1][1], 3, 3, 3])
    res = r.step([0, 1], [ref[0][0], ref[1][0]], [len(prompts[0]), len(prompts[1])], [4, 2], True, propose=False,
                 host_drafts=host)
    assert res.num_accepted == [3, 0] and res.committed[0] == ref[0][1:5] and res.committed[1] == [ref[1][1]]
    assert res.block_match == [(2, 4), (1, 1)]
    # a step without host drafts reports none
    res = r.step([0, 1], [ref[0][4], ref[1][1]], [len(prompts[0]) + 4, len(prompts[1]) + 1], [0, 0], True,
                 propose=False)
    assert res.block_match is None


def test_planner_calibrates_the_block_on_steps_other_sources_won():
    """The planner's record with the pending blocks' matches: a greedy row that verified a lookup (or nothing) while
    its block was current adds a record (E[accepted | γ = cut] against min(match, cut)) to the block's calibration;
    rows that verified the block itself, sampled rows and rows without a current block add none. The running start
    moves the factor by the first records as a mean would."""
    from adaflash_ray.engine.hybrid import RowChoice

    p = _planner()
    p.calibration = SourceCalibration(decay=0.02)
    low = [1.0 + 0.25 * g for g in range(1, 16)]  # the head: E[accepted | γ] = γ / 4
    choices = [RowChoice("ngram", 3, [1, 2, 3], 2.0), RowChoice("none", 0), RowChoice("dflash", 5, None, 1.25),
               RowChoice("ngram", 2, [4, 5], 1.0), RowChoice("ngram", 2, [6, 7], 1.0)]
    for _ in range(4):  # row 0: the block would have accepted all 4 known tokens (γ = 4: estimated 1.0)
        p.record(choices, [3, 0, 5, 2, 2], block_match=[(4, 4), (1, 1), (5, 5), (3, 3), (0, 3)],
                 block_expected=[low, low, low, None, low], greedy=[True, True, True, True, False])
    # dflash records per step: row 2 verified (est 1.25, real 5), then the blocks of row 0 (est 1.0, real 4) and row 1
    # (est 0.25, real 1); rows 3 (no block) and 4 (sampled) add none: the running mean of 12 records + the prior
    est, real = 1 + 4 * (1.25 + 1.0 + 0.25), 1.0 + 4 * (5 + 4 + 1)
    assert p.calibration._count["dflash"] == 13 and abs(p.calibration._real["dflash"] - real / 13) < 1e-9
    assert abs(p.calibration._est["dflash"] - est / 13) < 1e-9
    assert p.calibration.factor("dflash") == 2.0  # the head under-rates the block: the factor's cap
    frozen = SourceCalibration(decay=0.02, running_start=False)
    frozen.record("dflash", 1.0, 4)
    assert abs(frozen.factor("dflash") - (0.98 * 1.0 + 0.02 * 4) / (0.98 * 1.0 + 0.02 * 1.0)) < 1e-9


def test_dflash_planning_without_the_acceptance_head_is_refused(tiny_target):
    """draft_sources with 'dflash' under a length policy that has no acceptance head would never draft (the planner
    has no estimate of the block): refused at construction, naming the sources and the way out."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="direct", seed=5)
    with pytest.raises(ValueError, match=r"draft_sources \['dflash'\]: planning with 'dflash' needs the 'cost'"):
        SpecEngine(tiny_target, drafter, head, policy="direct", max_batch_size=2, max_seq_len=64,
                   draft_sources=("dflash",))
    eng = SpecEngine(tiny_target, drafter, head, policy="direct", max_batch_size=2, max_seq_len=64)
    r = eng.generate([[3, 4, 5, 6]], SamplingParams(max_new_tokens=12, ignore_eos=True, draft_len=3))[0]
    assert max(r.draft_lens) == 3 and r.output_ids == greedy_reference(tiny_target, [3, 4, 5, 6], 12)


def test_one_row_plan_equals_the_array_plan():
    """The one-request plan in host floats (HybridPlanner._plan_one) gives the array path's choices, propose flag,
    value and schedule state on a random sequence of steps: with and without a pending block, lookup proposals of
    every bucket and length, caps below the width, block_off, probes due, calibration records in between."""
    from adaflash_ray.engine.hybrid import LookupArrays

    rng = np.random.default_rng(3)
    bs = [1, 2, 4]
    spec = 1.2 + 0.03 * np.arange(1, 16)[None] + 0.01 * np.arange(3)[:, None]
    look = 1.0 + 0.02 * np.arange(16)[None] + 0.01 * np.arange(3)[:, None]
    planners = [HybridPlanner(("dflash", "suffix"), 15, 16, [1, 2, 3, 4, 6, 8, 12, 16], lookup_on_device=True,
                              probe_every=3) for _ in range(2)]
    planners[1].scalar_one_row = False
    for p in planners:
        p.set_costs(bs, spec, look)
    seen = set()
    for step in range(400):
        e = None if rng.random() < 0.3 else list(1 + np.cumsum(np.cumprod(rng.uniform(0.2, 0.95, 15))))
        arr = LookupArrays(rng.integers(0, 16, 1), rng.integers(0, 5, 1), rng.integers(0, 9, 1), rng.integers(0, 2, 1),
                           rng.random(1) < 0.8)
        cap, block_off = int(rng.integers(0, 20)), bool(rng.random() < 0.1)
        lf = [float(rng.uniform(0.2, 2.0))] if rng.random() < 0.4 else None  # the request's lookup factor
        bf = [float(rng.uniform(0.2, 2.0))] if rng.random() < 0.4 else None  # ... and block factor
        out = [p.plan(1, [cap], [e], [None], [None], device=arr, block_off=block_off, lookup_factors=lf,
                      block_factors=bf) for p in planners]
        (c1, p1), (c2, p2) = out
        assert p1 == p2 and c1 == c2, step
        assert planners[0].plan_rows(c1) == planners[0].plan_rows(list(c1)), step  # kept rows = a pass over them
        seen |= {c1[0].source, ("propose", p1)}
        assert planners[0].last_value == pytest.approx(planners[1].last_value, rel=1e-12)
        for key in ("_since", "_interval", "_idle"):
            assert getattr(planners[0], key) == getattr(planners[1], key), (step, key)
        assert planners[0]._use == pytest.approx(planners[1]._use)
        assert planners[0]._block_net == pytest.approx(planners[1]._block_net, abs=1e-12)
        acc = [int(rng.integers(0, c1[0].draft_len + 1))]
        match = [(int(rng.integers(0, 6)), int(rng.integers(0, 6)))]
        for p in planners:
            p.record(c1, acc, match, [e], [True])
    assert seen == {"dflash", "suffix", "none", ("propose", True), ("propose", False)}


def test_many_row_plan_equals_the_array_plan():
    """The plan of 2..HOST_PLAN_MAX_ROWS requests in host floats (HybridPlanner._plan_many) gives the array path's
    choices, propose flag, value, planned rows and schedule state, and the same block estimate and net value, on a
    random sequence of steps: rows with and without a pending block (shorter blocks too), lookup proposals of every
    bucket and length (stale ones too), caps of 0 and past max_draft, block_off, probes due, realised step prices
    moving the tables, calibration records in between; a fixed γ and weights take the arrays."""
    from adaflash_ray.engine.hybrid import HOST_PLAN_MAX_ROWS, LookupArrays

    rng = np.random.default_rng(8)
    bs = [1, 2, 4, 8, 16]
    spec = 1.2 + 0.03 * np.arange(1, 16)[None] + 0.01 * np.arange(5)[:, None]
    look = 1.0 + 0.02 * np.arange(16)[None] + 0.01 * np.arange(5)[:, None]
    fast, ref = (HybridPlanner(("dflash", "suffix"), 15, 16, [1, 2, 3, 4, 6, 8, 12, 16], lookup_on_device=True,
                               probe_every=3) for _ in range(2))
    ref.scalar_many_rows = False
    for p in (fast, ref):
        p.set_costs(bs, spec, look)
    calls, real = [0], fast._plan_many
    fast._plan_many = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or real(*a, **k)
    seen = set()
    for step in range(500):
        n = int(rng.integers(2, HOST_PLAN_MAX_ROWS + 1))
        caps = rng.integers(0, 22, n).tolist()
        dexp = [None if rng.random() < 0.3 else
                list(1 + np.cumsum(np.cumprod(rng.uniform(0.2, 0.95, int(rng.choice([15, 15, 15, 6]))))))
                for _ in range(n)]
        if all(e is None for e in dexp):
            dexp[0] = list(1 + np.cumsum(np.cumprod(np.full(15, 0.7))))
        arr = LookupArrays(rng.integers(0, 16, n), rng.integers(0, 5, n), rng.integers(0, 9, n), rng.integers(0, 2, n),
                           rng.random(n) < 0.8)
        fixed = [3 if rng.random() < 0.02 else None for _ in range(n)]
        weights = rng.uniform(0, 1, n).round().tolist() if rng.random() < 0.05 else None
        block_off = bool(rng.random() < 0.1)
        args = (min(16, n), caps, dexp, [None] * n, fixed)
        lf = rng.uniform(0.2, 2.0, n).tolist() if rng.random() < 0.4 else None  # per-request lookup factors
        bf = rng.uniform(0.2, 2.0, n).tolist() if rng.random() < 0.4 else None  # ... and block factors
        c1, p1 = fast.plan(*args, device=arr, block_off=block_off, weights=weights, lookup_factors=lf, block_factors=bf)
        c2, p2 = ref.plan(*args, device=arr, block_off=block_off, weights=weights, lookup_factors=lf, block_factors=bf)
        assert p1 == p2 and [vars(c) for c in c1] == [vars(c) for c in c2], step
        assert fast.plan_rows(c1) == ref.plan_rows(c2), step
        for key in ("last_value", "_block_net", "_block_est", "_since", "_interval", "_idle", "_use"):
            assert getattr(fast, key) == getattr(ref, key), (step, key)  # the same floats, not close ones
        seen |= {c.source for c in c1} | {("propose", p1)}
        acc = [int(rng.integers(0, c.draft_len + 1)) for c in c1]
        match = [(int(rng.integers(0, 6)), int(rng.integers(1, 6))) for _ in range(n)]
        ms = float(rng.uniform(0.5, 3.0))
        for p in (fast, ref):
            p.record(c1, acc, match, dexp, [True] * n)
            p.observe_step(min(16, n), 1 + max(c.draft_len for c in c1), p1, ms)
    assert calls[0] > 350, calls  # the host-float path ran (fixed rows and weights took the arrays)
    assert seen == {"dflash", "suffix", "none", ("propose", True), ("propose", False)}


@pytest.mark.parametrize("widths", [[1, 2, 3, 4, 6, 8, 12, 16], [1, 16], [4], [16]])
def test_many_row_plan_is_the_array_plan_to_the_last_bit(widths):
    """HybridPlanner._plan_many gives the array path's floats exactly (value, net value, block estimate), not only
    close ones, at 8..HOST_PLAN_MAX_ROWS rows too, where numpy sums a single column pairwise (a planner of one
    verify width); with ties between block and lookup values, every lookup stale or every cap 0, short blocks and a
    step's batch size above its rows."""
    from adaflash_ray.engine.hybrid import HOST_PLAN_MAX_ROWS, LookupArrays

    rng = np.random.default_rng(3)
    fast, ref = (HybridPlanner(("dflash", "suffix"), 15, 16, widths, lookup_on_device=True, probe_every=2)
                 for _ in range(2))
    ref.scalar_many_rows = False
    for p in (fast, ref):
        p.set_costs([1, 2, 4, 8, 16], 1.2 + 0.03 * np.arange(1, 16)[None] + 0.01 * np.arange(5)[:, None],
                    1.0 + 0.02 * np.arange(16)[None] + 0.01 * np.arange(5)[:, None])
    calls, real = [0], fast._plan_many
    fast._plan_many = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or real(*a, **k)
    table = fast.lookup_calibration._table
    for step in range(200):
        n = int(rng.integers(8, HOST_PLAN_MAX_ROWS + 1)) if step % 2 else int(rng.integers(2, 8))
        caps = [0] * n if step % 7 == 0 else rng.integers(-1, 20, n).tolist()
        dexp = []
        for _ in range(n):
            k = int(rng.choice([15, 15, 6, 1]))
            if rng.random() < 0.25:
                dexp.append(None)
            elif rng.random() < 0.3:  # a block valued as some lookup bucket: ties between the two
                dexp.append([1.0 + x for x in table()[int(rng.integers(0, len(table())))][1:k + 1].tolist()])
            else:
                dexp.append((1 + np.cumsum(np.cumprod(rng.uniform(0.2, 0.95, k)))).tolist())
        if all(e is None for e in dexp):
            dexp[0] = [1.5] * 15
        arr = LookupArrays(rng.integers(0, 16, n), rng.integers(0, 5, n), rng.integers(0, 9, n),
                           rng.integers(0, 2, n), rng.random(n) < (0.0 if step % 5 == 0 else 0.8))
        args = (n + int(rng.integers(0, 3)), caps, dexp, [None] * n)
        block_off = bool(rng.random() < 0.1)
        c1, p1 = fast.plan(*args, device=arr, block_off=block_off)
        c2, p2 = ref.plan(*args, device=arr, block_off=block_off)
        assert p1 == p2 and [vars(c) for c in c1] == [vars(c) for c in c2], step
        assert fast.plan_rows(c1) == ref.plan_rows(c2), step
        for key in ("last_value", "_block_net", "_block_est", "_since", "_interval", "_idle", "_use"):
            assert getattr(fast, key) == getattr(ref, key), (step, key)
        acc = [int(rng.integers(0, c.draft_len + 1)) for c in c1]
        match = [(int(rng.integers(0, 6)), int(rng.integers(1, 6))) for _ in range(n)]
        ms = float(rng.uniform(0.5, 3.0))
        for p in (fast, ref):
            p.record(c1, acc, match, dexp, [True] * n)
            p.observe_step(n, 1 + max(c.draft_len for c in c1), p1, ms)
    assert calls[0] >= (100 if len(fast.widths) > 1 else 0), calls


def test_stand_in_net_equals_the_net_value_of_the_blocks_it_stands_for():
    """HybridPlanner._stand_in_net (the block estimate clamped and scaled once per estimate and factor, the per-width
    quotients in host floats, the lookup plan's totals and best value reused) moves the block's net value exactly as
    _note_net of the stand-in blocks does: random estimates (negative entries too), factors, caps (past max_draft and 0),
    lookup values (none too), table rows whose prices observe_step moves, best_l given and not."""
    rng = np.random.default_rng(5)
    bs = [1, 4, 16]
    fast, ref = (HybridPlanner(("dflash", "suffix"), 15, 16, [1, 2, 3, 4, 6, 8, 12, 16], lookup_on_device=True)
                 for _ in range(2))
    spec, look = rng.uniform(1.0, 3.0, (3, 15)), rng.uniform(0.8, 2.5, (3, 16))
    for p in (fast, ref):
        p.set_costs(bs, spec, look)
    for step in range(300):
        if step % 7 == 0:  # a new block estimate
            fast._block_est = ref._block_est = rng.uniform(-0.5, 6.0, 16).tolist()
        if step % 3 == 0:  # the drafter's calibration moves, the estimate stays
            realised = int(rng.integers(0, 4))
            for p in (fast, ref):
                p.calibration.record("dflash", 2.0, realised)
        n, r = int(rng.integers(1, 20)), int(rng.integers(0, 3))
        caps = rng.integers(0, 25, n)
        v_l = None if rng.random() < 0.3 else rng.uniform(0.0, 5.0, (n, 8)) * (rng.random((n, 8)) < 0.6)
        zeros = np.zeros((n, 8)) if v_l is None else v_l
        total_l = n + zeros.sum(0)
        best_l = float((total_l / fast.lookup_costs[r, fast._widx]).max()) if rng.random() < 0.5 else None
        got = fast._stand_in_net(r, caps, v_l, total_l.tolist(), best_l)
        gam = np.minimum(ref._widx[None, :], np.minimum(caps, 15)[:, None])
        want = ref._note_net(r, ref.calibration.factor("dflash") * np.asarray(ref._block_est)[gam], zeros)
        assert got == want and fast._block_net == ref._block_net, step
        step_args = (bs[r], int(rng.integers(1, 17)), bool(rng.random() < 0.5), float(rng.uniform(0.5, 4.0)))
        for p in (fast, ref):
            p.observe_step(*step_args)


@pytest.mark.parametrize("with_costs", [True, False, "dear"])
def test_lookup_only_plan_equals_the_array_plan(with_costs):
    """A step with device lookups and no pending drafter block (the block idle, or no drafter) takes the lookup-only
    plan (HybridPlanner._plan_lookup): the array path's choices, propose flag, value and schedule state, step after
    step, with and without a cost table, for the hybrid and a lookup-only planner, at batch 1 (no cost table) and
    above: caps below the width, empty and stale proposals, fixed γ, block_off, the block's probes due (proposing
    steps whose blocks the next steps verify: those take the array path in both planners), calibration records in
    between; ``dear``: every width above AR's costs 1e4 ms, so rows with proposals draft nothing (the plan's
    draft-less choices). Both planners see the same record and realised step times (the prices they plan with
    move), so any divergence shows in the next step."""
    from adaflash_ray.engine.hybrid import LookupArrays

    rng = np.random.default_rng(11)
    bs = [1, 2, 4, 8]
    spec = 1.2 + 0.03 * np.arange(1, 16)[None] + 0.01 * np.arange(4)[:, None]
    look = 1.0 + 0.02 * np.arange(16)[None] + 0.01 * np.arange(4)[:, None]
    block = list(1 + np.cumsum(np.cumprod(np.full(15, 0.6))))
    for sources in (("dflash", "suffix"), ("suffix",)):
        fast, ref = (HybridPlanner(sources, 15, 16, [1, 2, 3, 4, 6, 8, 12, 16], lookup_on_device=True, probe_every=2)
                     for _ in range(2))
        ref.lookup_only_fast = False
        if with_costs:
            dear = with_costs == "dear"
            for p in (fast, ref):
                p.set_costs(bs, np.full_like(spec, 1e4) if dear else spec,
                            np.concatenate([look[:, :1], np.full_like(look[:, 1:], 1e4)], 1) if dear else look)
        calls, pending, seen = [0], None, set()
        frng = np.random.default_rng(12)
        real = fast._plan_lookup
        fast._plan_lookup = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or real(*a, **k)
        for step in range(300):
            n = int(rng.integers(1, 8))
            caps = rng.integers(0, 20, n).tolist()
            arr = LookupArrays(rng.integers(0, 16, n), rng.integers(0, 5, n), rng.integers(0, 9, n),
                               rng.integers(0, 2, n), rng.random(n) < 0.8)
            dexp = [block if pending and rng.random() < 0.7 else None for _ in range(n)]
            fixed = [3 if rng.random() < 0.03 else None for _ in range(n)]
            block_off = bool(rng.random() < 0.1)
            args = (min(n, 8), caps, dexp, [None] * n, fixed)
            # per-request lookup factors, and block factors (no pending block: unused), from their own generator
            lf = frng.uniform(0.2, 2.0, n).tolist() if frng.random() < 0.4 else None
            bf = frng.uniform(0.2, 2.0, n).tolist() if frng.random() < 0.4 else None
            got = fast.plan(*args, device=arr, block_off=block_off, lookup_factors=lf, block_factors=bf)
            want = ref.plan(*args, device=arr, block_off=block_off, lookup_factors=lf, block_factors=bf)
            assert got[1] == want[1] and [vars(c) for c in got[0]] == [vars(c) for c in want[0]], step
            assert fast.last_value == want_value if (want_value := ref.last_value) is None else \
                fast.last_value == pytest.approx(want_value, rel=1e-12), step
            for key in ("_since", "_interval", "_idle", "_use"):
                assert getattr(fast, key) == getattr(ref, key), (step, key)
            assert fast._block_net == ref._block_net, step
            seen |= {c.source for c in got[0]} | {("propose", got[1])}
            pending = got[1] and "dflash" in sources
            acc = [int(rng.integers(0, c.draft_len + 1)) for c in got[0]]
            match = [(int(rng.integers(0, 6)), int(rng.integers(1, 6))) for _ in range(n)]
            ms = float(rng.uniform(0.5, 3.0))  # realised step times: the rows' prices move every few steps
            for p in (fast, ref):
                p.record(got[0], acc, match, dexp, [True] * n)
                p.observe_step(min(n, 8), 1 + max(c.draft_len for c in got[0]), got[1], ms)
        assert calls[0] > 20, calls  # the fast path ran
        if with_costs == "dear":
            assert "none" in seen and ("propose", False) in seen
            continue
        assert {"suffix", "none"} <= seen and ("propose", False) in seen
        if "dflash" in sources:
            assert ("propose", True) in seen


def test_device_corpus_learns_a_steps_finished_requests_together(tiny_target):
    """With the device lookup, the requests that finish in one engine step's decode join the corpus ring in one
    ``add_sequences`` call before the step's time is taken (prompt + output each, in finish order); the ring then
    holds what one add per request would have written, and nothing is left pending after ``step`` returns."""
    from adaflash_ray.engine.device_lookup import DeviceLookup

    prompts, budgets = _prompts(), [12, 12, 20]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=64, calibrate=False,
                     draft_sources=("dflash", "suffix"), lookup_device="device", lookup_corpus_tokens=1024)
    look = eng.runner.lookup
    calls, real = [], look.add_sequences

    def add(seqs):
        calls.append([list(q) for q in seqs])
        real(seqs)
    look.add_sequences = add
    ref = DeviceLookup(1, 8, 4, "cpu", max_ngram=look.max_ngram, corpus_tokens=1024)
    for p, n in zip(prompts, budgets):
        eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    finished_per_step = []
    while eng.has_unfinished():
        done = eng.step("ar")
        assert eng._corpus_pending == []
        if done:
            finished_per_step.append([r.prompt_ids + r.output_ids for r in done])
    assert calls == finished_per_step and [len(c) for c in calls] == [2, 1]  # two ended in the same step
    for seqs in calls:
        for q in seqs:
            ref.add_sequence(q)
    assert look.corpus.tolist() == ref.corpus.tolist() and look._head == ref._head


def test_planner_records_run_while_the_next_step_is_launched(tiny_target):
    """The hybrid engine's planner records (HybridPlanner.record_later) run in the next step's overlap - after its
    launch, before its result is read - or at a flush point (no request left, generate's return, a drafter
    reload); none is lost or run twice, the outputs stay the target's greedy ones, and the calibration
    they build is the one immediate records build."""
    prompts, budgets = _prompts(), [100, 70, 90]
    ref_out = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160, calibrate=False,
                     draft_sources=("dflash", "suffix"), lookup_device="device", lookup_corpus_tokens=1024)
    nd = eng.runner.max_draft
    eng.planner.set_costs([1, 2, 3], np.full((3, 7), 1.0), 1.0 + 0.01 * np.arange(nd + 1)[None].repeat(3, 0))
    eng.reset_corpus([p + [(t + 1) % 128 if i % 5 == 4 else t for i, t in enumerate(o)]
                      for p, o in zip(prompts, ref_out)])
    state, ran, made, bound = {"in_step": False}, [], [0], []
    real_run, real_result, real_later = eng.runner._run, eng.runner._result, eng.planner.record_later

    def run(key):
        real_run(key)
        state["in_step"] = True

    def result(*a, **k):
        state["in_step"] = False
        return real_result(*a, **k)

    def later(*a, **k):  # each deferred record, wrapped: where it runs, and the arguments it was bound to
        work = real_later(*a, **k)
        if work is None:
            return None
        made[0] += 1
        bound.append(a)
        return lambda: ran.append(state["in_step"]) or work()
    eng.runner._run, eng.runner._result, eng.planner.record_later = run, result, later
    reqs = eng.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets])
    assert [r.output_ids for r in reqs] == ref_out
    assert eng._planner_record is None and made[0] == len(ran) > 20  # each one ran once, none left pending
    assert ran.count(True) >= len(ran) - 1  # inside the next step (the last one may wait for generate's return)
    eng._planner_record = lambda: ran.append("flushed")
    assert eng.step() == [] and ran[-1] == "flushed" and eng._planner_record is None  # no request left: flushed
    assert {c.source for a in bound for c in a[0]} >= {"suffix"}
    # the same records, made at once on a fresh planner of the same costs, build the same lookup calibration
    fresh = HybridPlanner(("dflash", "suffix"), nd, 8, eng.planner.widths, lookup_on_device=True)
    fresh.lookup_calibration = type(eng.planner.lookup_calibration)(eng.planner.lookup_calibration.max_ngram, nd)
    for a in bound:
        fresh._record_rows(*a, *[None] * (5 - len(a))) if len(a) < 5 else fresh._record_rows(*a)
    np.testing.assert_allclose(fresh.lookup_calibration.tried, eng.planner.lookup_calibration.tried)
    np.testing.assert_allclose(fresh.lookup_calibration.accepted, eng.planner.lookup_calibration.accepted)


def test_lookup_factors_value_each_request_by_its_own_record():
    """``plan(lookup_factors=..., block_factors=...)``: a request's lookup proposal (pending block) is valued at its
    factor times the shared calibration's E[accepted | γ] - a factor near 0 leaves a good match (block) undrafted
    while the same one at factor 1 is drafted - and the recorded estimate stays the shared calibration's; at batch 1
    and 3, with and without a pending block (the one-row, many-row, lookup-only and array plans)."""
    from adaflash_ray.engine.hybrid import LookupArrays

    for n in (1, 3):
        for block in (None, [1.2] * 15):
            pl = HybridPlanner(("dflash", "suffix"), 15, 16, [1, 2, 4, 8, 16], lookup_on_device=True)
            pl.set_costs([1, 4], np.full((2, 15), 1.5), 1.0 + 0.01 * np.arange(16)[None].repeat(2, 0))
            arr = LookupArrays(np.full(n, 15), np.full(n, 3), np.full(n, 8), np.ones(n, np.int64), np.ones(n, bool))
            args = (n, [100] * n, [block] * n, [None] * n, None)
            plain, _ = pl.plan(*args, device=arr)
            assert all(c.source == "suffix" and c.draft_len > 0 for c in plain), (n, block)
            low, _ = pl.plan(*args, device=arr, lookup_factors=[0.01] * n)
            assert all(c.source != "suffix" for c in low), (n, block)
            # (the others ride in the same verify where their value is above 0, so only row 0's choice is asserted)
            mixed, _ = pl.plan(*args, device=arr, lookup_factors=[1.0] + [0.01] * (n - 1))
            assert mixed[0].source == "suffix" and mixed[0].estimated == pytest.approx(plain[0].estimated)
        # a good block and no lookup match: drafted at factor 1, not at 0.01
        pl = HybridPlanner(("dflash", "suffix"), 15, 16, [1, 2, 4, 8, 16], lookup_on_device=True)
        pl.set_costs([1, 4], np.full((2, 15), 1.5), 1.0 + 0.01 * np.arange(16)[None].repeat(2, 0))
        pl.calibration = SourceCalibration(prior=1.0, decay=1e-9, running_start=False)
        none = LookupArrays(*(np.zeros(n, np.int64) for _ in range(4)), np.zeros(n, bool))
        good = list(1 + np.cumsum(np.full(15, 0.9)))
        args = (n, [100] * n, [good] * n, [None] * n, None)
        plain, _ = pl.plan(*args, device=none)
        assert all(c.source == "dflash" for c in plain), n
        low, _ = pl.plan(*args, device=none, block_factors=[0.01] * n)
        assert all(c.source == "none" for c in low), n


def test_request_calibration_tracks_each_requests_lookup_record(tiny_target):
    """``SpecEngine(request_calibration=True)``: greedy outputs stay the target's; each request's lookup and block
    records are the sums of its lookup / block rows' estimates and accepted drafts (recorded while the next step
    runs); the planner gets per-request factors once a request has drafted; a request whose corpus continuation is mostly wrong ends with a
    lower factor than one whose continuation is right; refused without a lookup source."""
    prompts, budgets = _prompts(), [80, 80, 80]
    ref_out = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    with pytest.raises(ValueError, match="request_calibration needs a lookup"):
        SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160, calibrate=False,
                   draft_sources=("dflash",), request_calibration=True)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160, calibrate=False,
                     draft_sources=("dflash", "suffix"), lookup_device="device", lookup_corpus_tokens=4096,
                     request_calibration=True)
    nd = eng.runner.max_draft
    # proposing priced as a lookup step, the head trusted as it is: the random block is drafted too
    eng.planner.set_costs([1, 2, 3], np.full((3, 7), 1.0), 1.0 + 0.01 * np.arange(nd + 1)[None].repeat(3, 0))
    eng.planner.calibration = SourceCalibration(prior=1.0, decay=1e-9, running_start=False)
    # request 0's continuation in the corpus right, request 2's wrong at every third token
    eng.reset_corpus([prompts[0] + ref_out[0], prompts[2] + [(t + 1) % 128 if i % 3 == 2 else t
                                                             for i, t in enumerate(ref_out[2])]])
    seen, factors = {}, []
    real_post, real_plan = eng._postprocess, eng.planner.plan

    def post(batch, res, finished):
        if batch.choices is not None:
            for r, c, a in zip(batch.requests, batch.choices, res.num_accepted):
                if c.draft_len > 0:
                    e, k = seen.get((r.request_id, c.source), (0.0, 0))
                    seen[(r.request_id, c.source)] = (e + c.estimated, k + a)
        return real_post(batch, res, finished)

    def plan(*a, **k):
        factors.append(k.get("lookup_factors"))
        assert set(k) >= {"lookup_factors", "block_factors"}
        return real_plan(*a, **k)
    eng._postprocess, eng.planner.plan = post, plan
    reqs = eng.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets])
    assert [r.output_ids for r in reqs] == ref_out
    for r in reqs:
        e, k = seen.get((r.request_id, "suffix"), (0.0, 0))
        assert r.lookup_estimated == pytest.approx(e) and r.lookup_accepted == k, r.request_id
        e, k = seen.get((r.request_id, "dflash"), (0.0, 0))
        assert r.block_estimated == pytest.approx(e) and r.block_accepted == k, r.request_id
    assert factors[0] is None and any(f is not None for f in factors)
    assert {s for _, s in seen} == {"suffix", "dflash"}  # both records kept
    good, bad = ((r.lookup_accepted + 1.0) / (r.lookup_estimated + 1.0) for r in (reqs[0], reqs[2]))
    assert reqs[0].lookup_estimated > 0 and reqs[2].lookup_estimated > 0 and good > bad


def test_hybrid_engine_with_the_lookup_only_plan_is_unchanged_and_lossless(tiny_target):
    """The hybrid engine (device lookups, a cost table under which the drafter's random block goes idle, both guards
    on a fake clock) with the lookup-only plan and with the array path for every step: the same outputs - the
    target's greedy ones -, per-request draft lengths and sources, planner state and calibration."""
    prompts, budgets = _prompts(), [100, 70, 90]
    ref_out = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    runs = []
    for fast in (True, False):
        ticks = [0]
        eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160,
                         calibrate=False, draft_sources=("dflash", "suffix"), lookup_device="device",
                         lookup_corpus_tokens=1024, block_guard=True, clock=lambda: ticks.__setitem__(0, ticks[0] + 1) or 1e-3 * ticks[0])
        nd = eng.runner.max_draft
        eng.planner.set_costs([1, 2, 3], np.full((3, 7), 3.0), 1.0 + 0.01 * np.arange(nd + 1)[None].repeat(3, 0))
        eng.planner.lookup_only_fast = fast
        calls, real = [0], eng.planner._plan_lookup
        eng.planner._plan_lookup = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or real(*a, **k)
        for g in (eng.guard, eng.block_guard):
            g.set_buckets([1, 2, 3])
        # the corpus holds each greedy continuation with every 5th token wrong: drafts of a few accepted tokens
        eng.reset_corpus([p + [(t + 1) % 128 if i % 5 == 4 else t for i, t in enumerate(o)]
                          for p, o in zip(prompts, ref_out)])
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, budgets)]
        while eng.has_unfinished():
            eng.step()
        for r, out in zip(reqs, ref_out):
            assert r.output_ids == out, fast
        pl = eng.planner
        runs.append(([(r.draft_lens, r.num_accepted, r.step_sources) for r in reqs], dict(eng.stats.source_hist),
                     (pl._since, pl._interval, pl._idle, pl._use, pl._block_net, pl.last_value),
                     pl.lookup_calibration.tried.tolist(), pl.calibration.factor("dflash")))
        assert (calls[0] > 5) == fast, calls
    assert runs[0] == runs[1]
    assert runs[0][1].get("suffix", 0) > 0 and runs[0][2][2]["dflash"]  # lookups drafted, the block went idle


@pytest.mark.parametrize("running_start", [True, False])
@pytest.mark.parametrize("decay", [0.02, 0.5, 1.0])
def test_record_many_equals_records_one_by_one(running_start, decay):
    """SourceCalibration.record_many: the same averages, factor and count as record() called per pair, across
    the running start and after it, in chunks of 1 to 200."""
    rng = np.random.default_rng(7)
    one = SourceCalibration(decay=decay, running_start=running_start)
    many = SourceCalibration(decay=decay, running_start=running_start)
    for chunk in (3, 70, 1, 200, 0, 5):
        est, real = rng.uniform(0, 5, chunk), rng.integers(0, 6, chunk)
        for e, r in zip(est, real):
            one.record("dflash", float(e), int(r))
        many.record_many("dflash", est, real)
        if chunk:
            assert many.factor("dflash") == pytest.approx(one.factor("dflash"), rel=1e-9)
            assert many._count == one._count
    assert many.factor("dflash") != pytest.approx(SourceCalibration().factor("dflash"))


def _two_source_run(policy: str, match_p: float, lookup_p: float, block_p: float, batch: int, spec, look,
                    steps: int, seed: int = 0, planner_cls=HybridPlanner) -> tuple[float, float]:
    """A synthetic DFlash + device-suffix stream driven through ``policy`` at ``batch`` rows per step (no model).

    Per row per step a suffix match exists with probability ``match_p`` (a 15-token proposal of one bucket); the
    realised acceptance of the lookup's drafts and of the drafter's block are the leading run of successes with
    per-position probability ``lookup_p`` / ``block_p`` (about 1.6 / 1.4 accepted at 0.615 / 0.583), cut at the γ
    verified; the acceptance head's E[committed | γ] is the block's exact one. A step costs ``spec[W - 2]`` ms
    (``[15]``, widths 2..16, width 1 at width 2's price) when it proposes the next block, else ``look[W - 1]``
    (``[16]``, W = 1: the AR step). Policies: ``block`` (always the block, γ = 15), ``lookup`` (the suffix at γ = 15
    where it matched, else none), ``best`` (always propose; each row the suffix where it matched, else the block:
    the per-step choice by the two sources' mean acceptance) and ``hybrid`` (:class:`HybridPlanner` through its public
    plan / record, sources dflash + suffix, lookups on the device, ``probe_every`` 8). Returns (committed tokens per
    ms, share of steps that proposed the next block)."""
    from adaflash_ray.engine.hybrid import LookupArrays

    rng = np.random.default_rng(seed)
    spec_w = np.concatenate([[spec[0]], spec])  # by width 1..16
    widths = [1, 2, 3, 4, 6, 8, 12, 16]

    def run_len(p, size):  # leading successes of 15 Bernoulli(p) trials, per row
        ok = rng.random((size, 15)) < p
        return np.where(ok.all(1), 15, np.argmin(ok, 1))

    pl = planner_cls(("dflash", "suffix"), 15, 16, widths, probe_every=8, lookup_on_device=True)
    pl.set_costs([batch], np.asarray(spec)[None], np.asarray(look)[None])
    head = (1.0 + np.cumsum(np.cumprod(np.full(15, block_p)))).tolist()
    tokens = ms = 0.0
    pending, proposes = True, 0
    for _ in range(steps):
        has_s = rng.random(batch) < match_p
        a_s, a_b = run_len(lookup_p, batch), run_len(block_p, batch)
        if policy == "block":
            tokens, ms = tokens + (1 + a_b).sum(), ms + spec_w[15]
            proposes += 1
        elif policy == "lookup":
            tokens, ms = tokens + (1 + np.where(has_s, a_s, 0)).sum(), ms + look[15 if has_s.any() else 0]
        elif policy == "best":
            tokens, ms = tokens + (1 + np.where(has_s, a_s, a_b)).sum(), ms + spec_w[15]
            proposes += 1
        else:
            dev = LookupArrays(np.where(has_s, 15, 0), np.full(batch, 3), np.full(batch, 4), np.ones(batch, np.int64),
                               has_s)
            blocks = [head if pending else None] * batch
            choices, propose = pl.plan(batch, [100] * batch, blocks, [None] * batch, device=dev)
            g = np.array([c.draft_len for c in choices])
            src = np.array([c.source for c in choices])
            acc = np.minimum(np.where(src == "suffix", a_s, np.where(src == "dflash", a_b, 0)), g)
            w = next(x for x in widths if x >= g.max() + 1)
            tokens, ms = tokens + (1 + acc).sum(), ms + (spec_w if propose else look)[w - 1]
            proposes += propose
            match = list(zip(a_b.tolist(), np.minimum(acc + 1, w - 1).tolist())) if pending and w > 1 else None
            pl.record(choices, acc.tolist(), match, blocks if match else None, [True] * batch)
            pending = propose
    return tokens / ms, proposes / steps


#: the H200 bench's batch-1 prices (ms; smollm2-135m, block 16): a step that proposes ~1.45-1.47 at any width, a
#: lookup verify 1.30-1.36 by width, a γ = 0 step 1.25; and its batch-64 row, where the propose costs 2.4-2.7 ms
_C1_SPEC, _C1_LOOK = np.linspace(1.45, 1.47, 15), np.concatenate([[1.25], np.linspace(1.30, 1.36, 15)])
_C64_SPEC, _C64_LOOK = np.linspace(4.23, 5.0, 15), np.concatenate([[1.575], np.linspace(1.86, 2.67, 15)])


def test_hybrid_keeps_proposing_a_block_that_pays_on_the_steps_without_a_lookup_match():
    """Batch 1, chat-like: a suffix match on ~70 % of steps (~1.6 accepted), the block ~1.4 accepted on every step,
    a propose costing ~0.1-0.2 ms. Proposing every step and taking the suffix where it matched, else the block, beats
    both single sources; the hybrid matches it (its net value counts the steps without a pending block too, by the
    recent blocks' estimate, so an idle block comes back once it pays). Code-like (a match on ~90 % of steps, ~2.1
    accepted) the suffix alone is the best source: the hybrid follows it and proposes on few steps. At batch 64,
    where a propose costs more than the block gains, it follows the suffix too and seldom proposes."""
    chat = {pol: _two_source_run(pol, 0.7, 0.615, 0.583, 1, _C1_SPEC, _C1_LOOK, 3000)
            for pol in ("block", "lookup", "best", "hybrid")}
    assert chat["best"][0] > max(chat["block"][0], chat["lookup"][0]) * 1.03, chat
    assert chat["hybrid"][0] >= 0.99 * chat["best"][0] and chat["hybrid"][1] > 0.9, chat
    code = {pol: _two_source_run(pol, 0.9, 0.72, 0.583, 1, _C1_SPEC, _C1_LOOK, 3000)
            for pol in ("block", "lookup", "best", "hybrid")}
    assert code["lookup"][0] > 1.04 * max(code["block"][0], code["best"][0]), code
    assert code["hybrid"][0] >= 0.99 * code["lookup"][0] and code["hybrid"][1] < 0.15, code
    wide = {pol: _two_source_run(pol, 0.7, 0.615, 0.583, 64, _C64_SPEC, _C64_LOOK, 300)
            for pol in ("block", "lookup", "best", "hybrid")}
    assert wide["lookup"][0] > 1.2 * max(wide["block"][0], wide["best"][0]), wide
    assert wide["hybrid"][0] >= 0.98 * wide["lookup"][0] and wide["hybrid"][1] < 0.15, wide


def test_lookup_calibration_scale_folds_in_and_small_records_match():
    """LookupCalibration keeps its counts divided by a decay scale: with decay 0.9 the scale passes RESCALE_BELOW
    within ~100 records and is folded into the counts; records of 1-4 rows (row by row) and of more (the histogram)
    still give the decayed counts of the definition, and the expected acceptance stays a probability table."""
    from adaflash_ray.engine.hybrid import RESCALE_BELOW, LookupCalibration

    rng = np.random.default_rng(7)
    cal = LookupCalibration(3, 15, decay=0.9)
    tried, accepted = np.zeros_like(cal.tried), np.zeros_like(cal.accepted)
    pos = np.arange(1, 16)
    folded = False
    for step in range(300):
        m = int(rng.integers(1, 9))
        b = cal.bucket(rng.integers(0, 2, m), rng.integers(1, 4, m), rng.integers(0, 6, m))
        g = rng.integers(1, 16, m)
        a = np.minimum(rng.integers(0, 16, m), g)
        before = cal._scale
        cal.record(b, g, a)
        folded |= cal._scale > before
        tried *= 0.1
        accepted *= 0.1
        for bi, gi, ai in zip(b, g, a):
            tried[bi] += pos <= min(ai + 1, gi)
            accepted[bi] += pos <= ai
        np.testing.assert_allclose(cal.tried, tried, rtol=1e-9, atol=1e-300)
        np.testing.assert_allclose(cal.accepted, accepted, rtol=1e-9, atol=1e-300)
    assert folded and cal._scale >= RESCALE_BELOW
    e = cal.expected(np.arange(18), np.full(18, 15))
    assert np.isfinite(e).all() and (np.diff(e, axis=1) >= 0).all() and (e[:, 1] <= 1).all()


@pytest.mark.parametrize("weights,width", [(None, 16), ([1.0, 1.0], 16), ([1.0, 0.0], 16), ([0.0, 1.0], 1)])
def test_plan_weights_choose_the_width_for_the_weighted_rows(weights, width):
    """Two rows, device lookups, no drafter: row 0 has a 15-token proposal (E[a | 15] = 2.32 at the prior's 0.7 per
    position), row 1 none. A width-16 step costs 1.5 ms, an AR step 1.0: (2 + 2.32) / 1.5 beats 2 / 1.0, so the plan
    verifies width 16 - unless row 0 weighs 0 (the drain objective: it finishes before the batch's slowest), when
    1 / 1.0 beats 1 / 1.5 and the step is AR. Weights of all 1 are the plain objective."""
    from adaflash_ray.engine.hybrid import LookupArrays

    p = HybridPlanner(("suffix",), 15, 16, [1, 2, 4, 8, 16], lookup_on_device=True)
    p.set_costs([2], np.full((1, 15), 1.5), np.array([[1.0] + [1.5] * 15]))
    dev = LookupArrays(np.array([15, 0]), np.array([3, 0]), np.array([4, 0]), np.array([0, 0]), np.array([True, False]))
    choices, _ = p.plan(2, [100, 100], [None, None], [None, None], device=dev, weights=weights)
    got = 1 + max(c.draft_len for c in choices)
    assert got == width, (weights, [(c.source, c.draft_len) for c in choices])
    base = 2 if weights is None else sum(weights)
    e15 = sum(0.7 ** k for k in range(1, 16))
    expected = max(base / 1.0, (base + (1 if weights is None else weights[0]) * e15) / 1.5)
    assert abs(p.last_value - expected) < 1e-9, (p.last_value, expected)


def test_drain_objective_weighs_early_finishers_zero_and_stays_lossless(tiny_target):
    """SpecEngine(objective="drain") (throughput guard off: every step planned) on three requests admitted together
    (nothing waiting) with budgets 100 / 40 / 30:
    once decoding, the two short ones end long before the longest even one token per step, so the planner gets
    weights [1, 0, 0] (counted in stats.num_drain_steps) - and the outputs are the target's greedy ones. With a
    fourth request waiting for a slot (queued, or held back by generate's admit_min), or under the plain objective, no
    step is weighed. A bad objective is refused."""
    prompts = _prompts() + [_prompts(seed=9)[1]]
    budgets = [100, 40, 30, 20]
    ref = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    cases = (("drain", 3, False), ("drain", 4, False), ("drain", 4, True), ("throughput", 3, False))
    for objective, n_req, held in cases:
        eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160, calibrate=False,
                         draft_sources=("dflash", "suffix"), lookup_device="device", lookup_corpus_tokens=1024,
                         objective=objective, throughput_guard=False)  # every step planned
        seen = []
        real = eng.planner.plan
        eng.planner.plan = lambda *a, **k: seen.append((len(eng.scheduler.waiting) + eng.num_held, k.get("weights"))) \
            or real(*a, **k)
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets[:n_req]]
        if held:  # generate() holds the fourth back (admit_min 3: a free slot is not enough): waiting all the same
            reqs = eng.generate(prompts[:n_req], params, admit_min=3)
            assert eng.num_held == 0
        else:
            reqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:n_req], params)]
            while eng.has_unfinished():
                eng.step()
        for r, out in zip(reqs, ref):
            assert r.output_ids == out, objective
        weighed = [w for _, w in seen if w is not None]
        assert eng.stats.num_drain_steps == len(weighed)
        if objective == "throughput":
            assert not weighed
            continue
        assert all(w_ is None for q, w_ in seen if q)  # nothing weighed while a request waits
        assert any(q for q, _ in seen) == (n_req == 4)
        assert weighed and all(1.0 in w and 0.0 in w for w in weighed), weighed[:3]
        if n_req == 3:  # row 0 holds the longest request throughout
            assert [1.0, 0.0, 0.0] in weighed and all(w[0] == 1.0 for w in weighed)
    with pytest.raises(ValueError, match="objective"):
        SpecEngine(tiny_target, drafter, head, policy="cost", draft_sources=("dflash", "suffix"), objective="latency")


@pytest.mark.parametrize("per_width", [True, False])
def test_realised_cost_per_width_corrects_the_tables_slope(per_width):
    """One row with a 15-token lookup proposal at the prior's 0.7 per position (E[a | 5] = 1.94, E[a | 15] = 2.32).
    The table prices width 6 at 1.57 ms and width 16 at 1.84, so width 6 wins (2.94 / 1.57 > 3.32 / 1.84); the steps
    really take 1.68 and 1.80 ms. After WIDTH_RESID_MIN steps at each width, each is priced by its own realised
    average and width 16 wins (3.32 / 1.80 > 2.94 / 1.68); with fewer steps at each (the kind's average alone: both
    widths + the same ms) width 6 stays."""
    from adaflash_ray.engine.hybrid import LookupArrays

    pl = HybridPlanner(("suffix",), 15, 16, [1, 6, 16], lookup_on_device=True)
    look = np.array([[1.17] + [1.57] * 5 + [1.84] * 10])
    pl.set_costs([1], look[:, 1:] + 0.3, look)
    arr = LookupArrays(np.array([15]), np.array([3]), np.array([1]), np.array([0]), np.array([True]))

    def width():
        choices, _ = pl.plan(1, [100], [None], [None], device=arr)
        return choices[0].draft_len + 1

    assert width() == 6
    steps = WIDTH_RESID_MIN if per_width else WIDTH_RESID_MIN - 1
    for _ in range(steps):
        pl.observe_step(1, 6, False, 1.68)
        pl.observe_step(1, 16, False, 1.80)
    assert (2 * steps) % pl.step_cost_every == 0 or not per_width  # the last step refreshed the row's prices
    if per_width:
        assert pl.lookup_costs[0, 5] == pytest.approx(1.68) and pl.lookup_costs[0, 15] == pytest.approx(1.80)
        assert pl.lookup_costs[0, 8] == pytest.approx(1.84 + pl._resid[False][0])  # unobserved: the kind's average
    assert width() == (16 if per_width else 6)


def test_step_profile_accounts_every_decode_step(tiny_target):
    """adaflash_ray.step_profile (bench --profile): the phase run counts each decode step once under its kind and the
    shape the device ran, its phases add up to no more than its wall time, the engine's own methods come back; the
    kernel run counts top-level aten ops; the cProfile run reports the same number of steps."""
    from adaflash_ray.step_profile import PHASES, profile_run
    engine = SpecEngine(tiny_target, make_drafter(tiny_target, policy="fixed")[0], None, max_batch_size=2,
                        max_seq_len=160, policy="fixed")  # the same steps in each of the three runs
    doc = profile_run(engine, _prompts(), 12)
    phases, kernels = doc["phases"], doc["kernels"]
    assert sum(p["count"] for p in phases.values()) == kernels["num_steps"] > 0  # greedy: the same steps each run
    for key, p in phases.items():
        kind, shape = key.split(" ")
        rows, width = map(int, shape.split("x"))
        assert kind in ("ar", "gamma0", "probe", "draft") and 1 <= rows <= 2 and 1 <= width <= 16  # no regime label
        assert 0 < p["device"] <= p["wall"] and p["launch"] == pytest.approx(p["device"], abs=1e-3)  # CPU: eager
        assert p["other"] >= -1e-3 and p["wall"] == pytest.approx(sum(p[k] for k in PHASES), abs=1e-3)
        assert 0 < p["launch_p50"] <= p["launch_p90"] <= p["launch_max"], p  # the launch's spread over the steps
        assert p["launch_max"] * p["count"] >= p["launch"] * p["count"] - 1e-3  # the mean is no more than the max
    assert any(k.startswith("draft") for k in phases)
    assert doc["bare_launches"] == {} and doc["process"]["graphs_held"] == 0  # CPU: no graphs
    assert "MainThread" in doc["process"]["threads"]
    assert set(profile_run(engine, _prompts(), 2, parts=("kernels",))) == {"kernels", "async_scheduling"}
    ar = SpecEngine(tiny_target, None, None, max_batch_size=2, max_seq_len=160, policy="fixed", async_scheduling=True)
    ar_doc = profile_run(ar, _prompts(), 12, mode="ar", parts=("phases",))  # synchronous steps, the flag restored
    assert ar_doc["async_scheduling"] and ar.async_scheduling and ar.stats.num_overlapped_steps == 0
    assert sum(p["count"] for p in ar_doc["phases"].values()) == ar.stats.num_engine_steps > 0
    with pytest.raises(ValueError, match=r"unknown profile part\(s\) \['phase'\]"):
        profile_run(engine, _prompts(), 2, parts=("phase",))
    assert not {"step", "_admit", "_schedule", "_postprocess"} & set(vars(engine))
    assert not {"_run", "step"} & set(vars(engine.runner))
    assert kernels["per_step"] > 0 and kernels["us_per_step"] > 0, kernels  # aten ops per step (which: torch's)
    assert all(name.startswith("aten::") and n > 0 for name, n, _ in kernels["top"]), kernels["top"][:8]
    assert doc["cprofile"].startswith(f"{kernels['num_steps']} decode steps")


def test_step_profile_gives_back_the_callers_own_wrappers(tiny_target):
    """step_profile's phase run wraps the engine's and the runner's step methods: afterwards (a step that raised
    included) a wrapper the caller had set on the instance is there again, and no other instance attribute is left."""
    from adaflash_ray.step_profile import _phase_run
    engine = SpecEngine(tiny_target, make_drafter(tiny_target, policy="fixed")[0], None, max_batch_size=2,
                        max_seq_len=160, policy="fixed")
    runner_step = engine.runner.step

    def mine(*a, **k):
        return runner_step(*a, **k)
    engine.runner.step = mine
    doc, _ = _phase_run(engine, _prompts(), SamplingParams(max_new_tokens=6), "spec")
    assert doc and engine.runner.step is mine and "_run" not in vars(engine.runner)
    assert not {"step", "_admit", "_schedule", "_postprocess"} & set(vars(engine))

    def broken(*a, **k):
        raise RuntimeError("step failed")
    engine._postprocess = broken
    with pytest.raises(RuntimeError, match="step failed"):
        _phase_run(engine, _prompts(), SamplingParams(max_new_tokens=6), "spec")
    assert engine._postprocess is broken and engine.runner.step is mine and "_run" not in vars(engine.runner)
    assert not {"step", "_admit", "_schedule"} & set(vars(engine))


def test_step_profile_labels_the_source_guards_regimes():
    """step_profile's phase run splits a hybrid's drafting steps under its source guard into ``:planned`` and
    ``:block-only`` (the guard forced here on every third step, the AR guard kept out): every drafting step is counted
    once under its own regime, and the label agrees with what the engine's step ran (a plan or not)."""
    from adaflash_ray.step_profile import _phase_run
    target, prompt, eng = _cyclic_hybrid(60)
    eng.guard.force_ar = eng.guard.would_force = lambda b: False
    n = [0]

    def force(b):
        n[0] += 1
        return n[0] % 3 == 0
    eng.source_guard.force_ar = force
    eng.source_guard.would_force = lambda b: (n[0] + 1) % 3 == 0
    planned, real = [], eng._run

    def run(batch):
        if batch.spec and (any(batch.draft_lens) or batch.propose):
            planned.append(batch.choices is not None)
        return real(batch)
    eng._run = run
    doc, _ = _phase_run(eng, [prompt], SamplingParams(max_new_tokens=40), "spec")
    counts = {label: sum(p["count"] for k, p in doc.items() if k.split(" ")[0].endswith(label))
              for label in (":planned", ":block-only")}
    assert counts[":planned"] == planned.count(True) > 0 and counts[":block-only"] == planned.count(False) > 0
    assert all(k.split(" ")[0].split(":")[0] in ("ar", "gamma0", "probe", "draft") for k in doc)


def test_propose_first_greedy_lossless_and_proposes_only_for_its_own_verify(tiny_target):
    """SpecEngine(propose_first=True), DFlash + suffix with device lookups (eager CPU): greedy output == the target's
    over two passes (the second with the first's outputs in the corpus); a step proposes a block exactly when some row
    verifies the drafter's block (never one for the next step), the first planned step probes the block at the full
    γ, and the verified blocks' estimates reach the planner (block_estimate)."""
    from adaflash_ray.engine.engine import PROPOSE_FIRST_PROBE
    prompts = _prompts()
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=160,
                        draft_sources=("dflash", "suffix"), lookup_device="device", propose_first=True)
    assert engine.planner.block_estimate() is None
    steps = []
    orig = engine.runner.step

    def step(slots, anchors, anchor_pos, draft_lens, spec, propose=True, host_drafts=None, append=None,
             lookup_rows=None, lookup=False, block_match=True, propose_first=False, overlap=None):
        steps.append((propose and spec, propose_first, list(draft_lens), lookup_rows))
        return orig(slots, anchors, anchor_pos, draft_lens, spec, propose, host_drafts, append, lookup_rows, lookup,
                    block_match, propose_first, overlap)
    engine.runner.step = step
    for _ in range(2):
        reqs = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
        for r in reqs:
            assert r.output_ids == greedy_reference(tiny_target, r.prompt_ids, 40)
    spec_steps = steps  # every step is planned (no AR mode); prefills are not runner steps
    assert not any(p for p, _, _, _ in spec_steps)  # never a block for the next step
    first = spec_steps[0]
    assert first[1] and max(first[2]) == 7  # the probe: the block at γ = bs - 1 in every row
    for _, pf, lens, rows in spec_steps:
        block_rows = [g > 0 and not (rows is not None and rows[i]) for i, g in enumerate(lens)]
        assert pf == any(block_rows)
    assert engine.stats.source_hist["dflash"] > 0 and engine.planner.block_estimate() is not None
    assert len(engine.planner.block_estimate()) == 7 and PROPOSE_FIRST_PROBE > 1


def test_propose_first_prefill_proposes_no_block(tiny_target):
    """Under propose_first no step verifies a block proposed before it: a prefill (a request fixing its own γ
    included) proposes none, yet appends the prompts' drafter context; the output stays the target's greedy one."""
    prompts = _prompts()
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=160,
                        draft_sources=("dflash", "suffix"), lookup_device="device", propose_first=True)
    calls = []
    orig = engine.runner.prefill

    def prefill(slots, prompts, params, spec, lookup=False, append=True):
        calls.append((spec, append))
        return orig(slots, prompts, params, spec, lookup, append)
    engine.runner.prefill = prefill
    for sp in (SamplingParams(max_new_tokens=20, ignore_eos=True),
               SamplingParams(max_new_tokens=20, ignore_eos=True, draft_len=3)):
        for r in engine.generate(prompts, sp):
            assert r.output_ids == greedy_reference(tiny_target, r.prompt_ids, 20)
    assert calls and all(c == (False, True) for c in calls), calls
    assert engine.stats.source_hist["dflash"] > 0


def test_propose_first_needs_the_block_and_device_lookups(tiny_target):
    """propose_first without 'dflash' among the sources, with the lookups on the host, or with the block guard (which
    compares steps that propose the next block with steps that do not: a propose-first engine has none) is refused."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    for kw in (dict(draft_sources=("suffix",), lookup_device="device"),
               dict(draft_sources=("dflash", "suffix"), lookup_device="host"), dict()):
        with pytest.raises(ValueError, match="propose_first needs 'dflash' and a lookup source"):
            SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=64,
                       propose_first=True, **kw)
    with pytest.raises(ValueError, match="propose_first and block_guard"):
        SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=64, propose_first=True,
                   block_guard=True, draft_sources=("dflash", "suffix"), lookup_device="device")


def test_propose_first_sampled_blocks_follow_the_target(monkeypatch):
    """Temperature 0.8, vocab 12, the propose-first hybrid made to verify its own fresh block on every step
    (PROPOSE_FIRST_PROBE 0: the block at the full γ in every row, its q from this step's propose at output index 0):
    the joint law of the first 4 generated tokens equals the target's (χ² on pairs, p > 0.001)."""
    import adaflash_ray.engine.engine as engine_mod
    monkeypatch.setattr(engine_mod, "PROPOSE_FIRST_PROBE", 0)
    vocab, temp, num = 12, 0.8, 2048
    target = make_tiny_target("qwen3", vocab_size=vocab, seed=2, logit_scale=2.0)
    drafter, head = make_drafter(target, block_size=4, layers=1, policy="cost", seed=7)
    prompt = [1, 2, 3, 4, 5]
    engine = SpecEngine(target, drafter, head, policy="cost", max_batch_size=64, max_seq_len=32, seed=11,
                        draft_sources=("dflash", "suffix"), lookup_device="device", lookup_corpus_tokens=256,
                        propose_first=True, throughput_guard=False)
    reqs = engine.generate([prompt] * num, SamplingParams(max_new_tokens=4, temperature=temp))
    toks = np.array([r.output_ids for r in reqs])  # [num, 4]
    s = engine.stats
    assert s.source_hist["dflash"] > num and 0.05 < s.num_accepted / s.num_drafted < 0.95
    _assert_pairs_follow_the_target(target, prompt, toks, temp)


def test_recipe_propose_first_reaches_the_hybrid_engines_only(tiny_target):
    """``engine.propose_first`` in a recipe: the hybrid built by ``from_config`` proposes first with its lookups on the
    device (on CPU too) and stays lossless; an engine of the same recipe without the hybrid's sources (no drafter: the
    lookup alone) does not; a caller's own ``propose_first`` wins; the recipe is refused without the hybrid's sources or
    the cost policy."""
    from adaflash_ray.config import RecipeError, load_recipe

    cfg = load_recipe("recipes/cpu_tiny.yaml", ["length_head.draft_sources=[dflash,suffix]", "length_head.policy=cost",
                                                "engine.propose_first=true"])
    drafter, head = make_drafter(tiny_target, block_size=8, policy="cost")
    eng = SpecEngine.from_config(cfg, models=(tiny_target, drafter, head), calibrate=False, max_seq_len=128)
    assert eng.propose_first and eng.lookup_on_device
    prompt = _prompts()[0]
    assert eng.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].output_ids == \
        greedy_reference(tiny_target, prompt, 12)
    lookup_only = SpecEngine.from_config(cfg, models=(tiny_target, None, None), max_seq_len=128)
    assert lookup_only.draft_sources == ("suffix",) and not lookup_only.propose_first
    assert not SpecEngine.from_config(cfg, models=(tiny_target, drafter, head), calibrate=False, max_seq_len=128,
                                      propose_first=False).propose_first
    for bad, match in ((["length_head.draft_sources=[suffix]"], "engine.propose_first needs the hybrid"),
                       (["length_head.draft_sources=[dflash,suffix]", "length_head.policy=direct"], "policy cost"),
                       ([], "engine.propose_first needs the hybrid")):
        with pytest.raises((RecipeError, ValueError), match=match):
            load_recipe("recipes/cpu_tiny.yaml", ["engine.propose_first=true", *bad])



@pytest.mark.parametrize("lookup_device", ["host", "device"])
def test_random_block_only_steps_keep_greedy_output(lookup_device):
    """Block-only steps forced at random among planned steps that leave the block idle at random (so block-only rows
    without a pending block verify their lookup proposal), over random batches: ngram and suffix lookups, budgets of
    1-3 tokens and longer, stop tokens, requests with their own γ, admissions mid-run, aborts, drafter reloads, and
    slots kept apart (no compaction: rows are not slots 0..n-1). Greedy output equals the target's (an aborted
    request's is a prefix of it) and each request's per-step records agree (γ 0 exactly where the source is none)."""
    target = make_tiny_target("llama", vocab_size=16, seed=1, logit_scale=3.0)
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    num_lookup_rows = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=4, max_seq_len=96, calibrate=False,
                         draft_sources=("dflash", ("ngram", "suffix")[seed % 2]), probe_every=4,
                         lookup_device=lookup_device, compact_slots=seed % 3 != 0, defer_first_block=seed % 4 == 1)
        eng.planner.set_costs([1, 2, 4], np.ones((3, 7)), np.ones((3, eng.runner.max_draft + 1)))
        eng.source_guard.force_ar = eng.source_guard.would_force = lambda batch_size: rng.random() < 0.35
        eng._block_off = lambda batch_size, any_own: rng.random() < 0.9
        real = eng._block_only

        def block_only(running, batch_size, slots):
            nonlocal num_lookup_rows
            batch = real(running, batch_size, slots)
            num_lookup_rows += sum(map(bool, batch.lookup_rows or batch.host_drafts or ()))
            return batch

        eng._block_only = block_only
        reqs, aborted = [], set()

        def add():
            prompt = rng.integers(0, 16, int(rng.integers(2, 7))).tolist()
            n = int(rng.choice([1, 2, 3, int(rng.integers(4, 30))]))
            stop = [int(rng.integers(16))] if rng.random() < 0.3 else []
            own = [None] * 30 + [2]  # a request's own γ keeps the guard off its steps: rare
            params = SamplingParams(max_new_tokens=n, ignore_eos=True, stop_token_ids=stop or None,
                                    draft_len=own[int(rng.integers(len(own)))])
            reqs.append((eng.add_request(prompt, params), greedy_reference(target, prompt, n, set(stop))))

        for _ in range(int(rng.integers(2, 5))):
            add()
        while eng.has_unfinished():
            if rng.random() < 0.1 and len(reqs) < 10:
                add()
            if rng.random() < 0.03 and eng.scheduler.running:
                req = eng.scheduler.running[int(rng.integers(len(eng.scheduler.running)))]
                eng.abort(req)
                aborted.add(id(req))
            if rng.random() < 0.03:
                eng.load_drafter(eng.drafter_tensors(), version=eng.drafter_version + 1)
            eng.step()
        for req, ref in reqs:
            out = req.output_ids
            assert out == (ref[:len(out)] if id(req) in aborted else ref), (seed, req.params, out, ref)
            assert len(req.draft_lens) == len(req.num_accepted) == len(req.step_sources)
            assert all((g == 0) == (s == "none") for g, s in zip(req.draft_lens, req.step_sources))
    assert num_lookup_rows >= 4, num_lookup_rows


@pytest.mark.parametrize("skip", [True, False])
def test_block_only_stretch_skips_the_acceptance_head_until_its_last_step(tiny_target, skip, monkeypatch):
    """While the source guard forces block-only steps and the next step will be forced too, a step proposes its block
    without the acceptance head (the next step verifies it at the full γ whatever the head says); the stretch's last
    step computes it again, so the planned step after it has the blocks' own estimates. The output is the target's
    greedy either way; ``ADAFLASH_BLOCK_ONLY_HEAD=1`` (``skip_block_only_estimates`` False) computes the head on every
    block-only step."""
    if not skip:
        monkeypatch.setenv("ADAFLASH_BLOCK_ONLY_HEAD", "1")
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=200, calibrate=False,
                     draft_sources=("dflash", "ngram"), probe_every=4)
    eng.guard = None  # no forced AR steps: every step is the source guard's or the planner's
    assert eng.skip_block_only_estimates == skip
    calls, real = [], eng.runner.expected_fn

    def counted(hidden, logits):
        calls.append(eng.stats.num_engine_steps)
        return real(hidden, logits)

    eng.runner.expected_fn = counted
    prompts = _prompts(2)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts]
    eng.step()  # admission and the first (planned) step
    stretch = 6
    for bk in eng.source_guard.buckets:
        bk.forced_left = stretch
    calls.clear()
    first = eng.stats.num_engine_steps
    for _ in range(stretch + 1):  # the stretch, then one planned step
        eng.step()
    forced = [s - first for s in calls]
    assert eng.stats.num_source_guard_steps >= stretch
    if skip:  # only the stretch's last block-only step (index stretch - 1) and the planned step after it
        assert forced == [stretch - 1, stretch], forced
        assert all(r.dflash_expected is not None for r in reqs)
    else:
        assert forced == list(range(stretch + 1)), forced
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == [greedy_reference(tiny_target, p, 40) for p in prompts]


def test_pending_estimate_follows_the_planners_estimate(tiny_target):
    """The estimate a block proposed without the head carries is the planner's recent one plus the bonus token: the same
    list while the planner keeps its estimate (a block-only stretch), a new one as soon as the planner's changes;
    all ones before the planner has an estimate."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=96, calibrate=False,
                     draft_sources=("dflash", "ngram"))
    eng.planner._block_est = None
    assert eng._pending_estimate() == [1.0] * 7
    eng.planner._block_est = [0.0, 0.5, 0.8, 1.0]
    first = eng._pending_estimate()
    assert first == [1.5, 1.8, 2.0, 2.0, 2.0, 2.0, 2.0] and eng._pending_estimate() is first
    eng.planner._block_est = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    assert eng._pending_estimate() == [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75]


@pytest.mark.parametrize("lookup_device", ["host", "device"])
def test_block_only_reference_run_computes_the_head_on_its_last_step(tiny_target, lookup_device):
    """The source guard's reference run (block-only steps until its bucket has ``min_samples`` of them recorded) is
    not set by ``forced_left`` alone: its last step is the one whose own record completes it. That step computes the
    acceptance head, so no planned step meets a block proposed without it (the placeholder estimate,
    ``SpecEngine._pending_estimate``) - the stretch does not end sooner than foreseen here. Greedy output exact."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=200, calibrate=False,
                     draft_sources=("dflash", "ngram"), probe_every=4, lookup_device=lookup_device)
    eng.guard = None  # no forced AR steps
    eng.source_guard.margin = 0.999  # no back-off by the wall clock: the forced steps are the reference runs'
    eng.skip_block_only_estimates = True  # whatever ADAFLASH_BLOCK_ONLY_HEAD says

    class Placeholder(list):
        pass

    pending = eng._pending_estimate
    eng._pending_estimate = lambda: Placeholder(pending())
    met, plan = [], eng.planner.plan

    def planned(batch_size, caps, dflash_expected, *args, **kwargs):
        met.append(sum(isinstance(e, Placeholder) for e in dflash_expected))
        return plan(batch_size, caps, dflash_expected, *args, **kwargs)

    eng.planner.plan = planned
    prompts = _prompts(2)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=60, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.num_source_guard_steps >= 3  # a reference run took place
    assert any(bk.ar.num_samples >= 3 for bk in eng.source_guard.buckets)
    assert len(met) > 3 and not any(met), met
    assert [r.output_ids for r in reqs] == [greedy_reference(tiny_target, p, 60) for p in prompts]
