"""Tests of adaflash_ray.engine: speculative decoding is lossless.

- greedy on the real SmolLM2-135M-Instruct (float32): spec output == our AR output == transformers'
  greedy ``generate``, for random drafters (``fixed`` and ``direct`` policies), a perfect drafter
  (every draft accepted) and a wrong one (every draft rejected);
- tiny random targets: per-request γ, very different prompt lengths and slot reuse in one batch, exact
  ``max_new_tokens`` truncation, stop tokens, hot reload mid-flight, recorded trajectories against a
  fresh full forward, and a χ² test that sampling (temperature > 0) follows the target's distribution.

"Perfect" / "wrong" drafters replace the drafter's proposals (``DFlashDrafter.logits``) with the
reference continuation, so the accept / reject paths run without training a drafter.

Run: python -m pytest -q tests/test_engine.py   (CPU, ~1.5 min, most of it the real model)
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import greedy_reference, make_drafter, make_tiny_target

from adaflash_ray.engine import SamplingParams, SpecEngine, Status
from adaflash_ray.models.checkpoint import tensors_sha256

REAL_NEW_TOKENS = 40


# ----------------------------------------------------------------------------------- helpers
class Oracle:
    """Replaces the drafter's proposals: a request's drafts are its reference continuation
    (``reference[prompt] = prompt + greedy output``) for the first ``num_correct(req)`` block positions
    and a wrong token after. The proposing forward itself still runs (shapes, caches, length head)."""

    def __init__(self, monkeypatch, engine: SpecEngine, reference: dict[tuple, list[int]], num_correct=None):
        self.engine, self.reference = engine, reference
        self.num_correct = num_correct or (lambda req: 10 ** 9)
        self.rows: list = []  # (request, anchor position) per row of the current proposal
        propose = engine.drafter.propose_hidden

        def propose_hidden(cache, slot_ids, anchor_ids, anchor_pos, span=None, **kw):
            by_slot = {r.slot: r for r in engine.scheduler.running}  # rows of idle slots map to None
            self.rows = [(by_slot.get(s), p) for s, p in zip(slot_ids.tolist(), anchor_pos.tolist())]
            return propose(cache, slot_ids, anchor_ids, anchor_pos, span, **kw)

        monkeypatch.setattr(engine.drafter, "propose_hidden", propose_hidden)
        monkeypatch.setattr(engine.drafter, "logits", self.logits)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        b, n, _ = hidden.shape  # [B, block_size-1, H]
        vocab = self.engine.target.config.vocab_size
        out = torch.zeros(b, n, vocab)
        for i, (req, p) in enumerate(self.rows):
            if req is None:
                continue
            seq = self.reference[tuple(req.prompt_ids)]
            assert seq[: req.num_tokens] == req.prompt_ids + req.output_ids  # lossless so far
            for k in range(n):
                tok = seq[p + 1 + k] if p + 1 + k < len(seq) else 0
                if k >= self.num_correct(req):
                    tok = (tok + 1) % vocab
                out[i, k, tok] = 5.0
        return out


class SlotPattern:
    """A length policy giving γ = pattern[slot % len(pattern)] (different γ per request in one batch)."""

    def __init__(self, oracle: Oracle, pattern: list[int]):
        self.oracle, self.pattern = oracle, pattern

    def __call__(self, block_hidden: torch.Tensor, draft_logits: torch.Tensor, live=None) -> torch.Tensor:
        assert block_hidden.shape[0] == len(self.oracle.rows) == draft_logits.shape[0]
        return torch.tensor([0 if req is None else self.pattern[req.slot % len(self.pattern)]
                             for req, _ in self.oracle.rows])


def tiny_reference(target, prompts, num_new):
    """prompt -> prompt + greedy continuation, by the cache-free slow oracle."""
    return {tuple(p): list(p) + greedy_reference(target, p, num_new) for p in prompts}


def outputs(reqs):
    return [r.output_ids for r in reqs]


# ----------------------------------------------------------------------------------- real model, greedy
@pytest.fixture(scope="module")
def real_ar(real_target, chat_prompts):
    """Our engine's plain autoregressive greedy output: 8 chat prompts x REAL_NEW_TOKENS (40) tokens (EOS ignored)."""
    engine = SpecEngine(real_target, None, None, max_batch_size=8, max_seq_len=256)
    reqs = engine.generate(chat_prompts, SamplingParams(max_new_tokens=REAL_NEW_TOKENS, ignore_eos=True))
    assert all(r.finish_reason == "length" and len(r.output_ids) == REAL_NEW_TOKENS for r in reqs)
    assert engine.stats.num_verify_steps == 0
    return outputs(reqs)


# fixed and direct: ~20 s each on 2 CPU cores, long (the tiny-model lossless tests cover every policy; cost, the
# recipes' policy, runs on the real model by default)
@pytest.mark.parametrize("policy,block_size", [pytest.param("fixed", 4, marks=pytest.mark.long),
                                               pytest.param("direct", 8, marks=pytest.mark.long), ("cost", 8)])
def test_real_greedy_lossless_random_drafter(real_target, chat_prompts, real_ar, policy, block_size):
    """8 prompts x 40 tokens, batch 8, random drafter: token for token the AR output."""
    drafter, head = make_drafter(real_target, block_size=block_size, policy=policy, seed=1)
    # the throughput guard off: its forced AR steps (a random drafter is slower than AR on CPU) would be γ = 0 below
    # the last token (tests/test_throughput_guard.py tests the guard, lossless included)
    engine = SpecEngine(real_target, drafter, head, policy=policy, max_batch_size=8, max_seq_len=256,
                        throughput_guard=False, calibrate=False)
    if policy == "cost":  # a table instead of timing the real model on CPU (45 s): drafting always beats AR here
        engine.runner.length_policy.set_costs(list(range(1, 9)), torch.ones(8, block_size - 1), torch.full((8,), 100.0))
    reqs = engine.generate(chat_prompts, SamplingParams(max_new_tokens=REAL_NEW_TOKENS, ignore_eos=True))
    assert outputs(reqs) == real_ar
    s = engine.stats
    assert s.num_generated == 8 * REAL_NEW_TOKENS
    assert s.num_verify_steps == sum(len(r.draft_lens) for r in reqs)
    assert s.num_verify_steps >= 8 * (REAL_NEW_TOKENS - 1) * 0.8  # a random drafter is rarely right
    for r in reqs:  # replay the budget: γ <= remaining - 1 (= for fixed), γ >= 1 until the last token
        remaining = REAL_NEW_TOKENS - 1
        for drafted, accepted in zip(r.draft_lens, r.num_accepted):
            cap = min(block_size - 1, remaining - 1)
            assert drafted == cap if policy == "fixed" else min(1, cap) <= drafted <= cap
            remaining -= accepted + 1
        assert remaining == 0
    if policy == "direct":
        assert len(set(g for r in reqs for g in r.draft_lens[:-4])) > 1  # the head chose different γ
    assert sum(s.draft_len_hist.values()) == s.num_verify_steps


def test_real_ar_matches_transformers_generate(real_model_dir, real_target, chat_prompts, real_ar):
    """Our greedy output == transformers' ``generate(do_sample=False)`` (3 prompts, batched, left-padded),
    and for all 8 prompts HF's argmax at every position of prompt + our output is our next token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    prompts = chat_prompts[:3]
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = hf.generate(ids, attention_mask=mask, max_new_tokens=REAL_NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
        assert gen[:, width:].tolist() == real_ar[:3]
        for p, out in zip(chat_prompts, real_ar):
            seq = torch.tensor([p + out])
            logits = hf(seq).logits[0, len(p) - 1:-1]  # [64, V] predictions of the output tokens
            assert logits.argmax(-1).tolist() == out
            top2 = logits.topk(2).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4  # no near-tie: the comparison is meaningful


def test_real_perfect_and_wrong_drafter(monkeypatch, real_target, chat_prompts, real_ar):
    """Perfect proposals: a == γ every step, τ = 8 with γ = 7; wrong proposals: a = 0 every step. Both lossless."""
    reference = {tuple(p): p + out for p, out in zip(chat_prompts, real_ar)}
    drafter, _ = make_drafter(real_target, block_size=8, policy="fixed")
    engine = SpecEngine(real_target, drafter, None, policy="fixed", max_batch_size=8, max_seq_len=256)
    Oracle(monkeypatch, engine, reference)
    reqs = engine.generate(chat_prompts, SamplingParams(max_new_tokens=REAL_NEW_TOKENS, ignore_eos=True))
    assert outputs(reqs) == real_ar
    # 1 token from prefill (40 - 1 = 39 left), then 4 steps of γ = 7 (8 tokens each) and one capped by the budget
    assert REAL_NEW_TOKENS == 40
    for r in reqs:
        assert r.num_accepted == r.draft_lens  # every draft accepted
        assert r.draft_lens == [7] * 4 + [6]
    s = engine.stats
    assert s.accept_len > 3 and abs(s.accept_len - 39 / 5) < 1e-9
    assert s.draft_waste == 0.0

    wrong_drafter, _ = make_drafter(real_target, block_size=8, policy="fixed")
    wrong_engine = SpecEngine(real_target, wrong_drafter, None, policy="fixed", max_batch_size=8, max_seq_len=256)
    Oracle(monkeypatch, wrong_engine, reference, num_correct=lambda req: 0)
    reqs = wrong_engine.generate(chat_prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert outputs(reqs) == [out[:16] for out in real_ar]
    # γ = min(7, remaining - 1) with remaining 15, 14, ..., 1
    assert all(r.num_accepted == [0] * 15 and r.draft_lens == [7] * 8 + [6, 5, 4, 3, 2, 1, 0] for r in reqs)
    assert wrong_engine.stats.accept_len == 1.0 and wrong_engine.stats.draft_waste == 1.0


def test_real_eos_stop(real_target, tokenizer, chat_prompts, real_ar):
    """Without ignore_eos the request stops at the target's EOS (<|im_end|>), included in the output."""
    eos = real_target.config.eos_token_ids
    assert eos == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    i = 4  # "What is the capital of France?"
    assert eos[0] in real_ar[i]
    stop_at = real_ar[i].index(eos[0])
    drafter, head = make_drafter(real_target, block_size=4, policy="direct")
    engine = SpecEngine(real_target, drafter, head, max_batch_size=2, max_seq_len=256)
    req, = engine.generate([chat_prompts[i]], SamplingParams(max_new_tokens=REAL_NEW_TOKENS))
    assert req.output_ids == real_ar[i][: stop_at + 1] and req.finish_reason == "stop"
    assert "Paris" in tokenizer.decode(req.output_ids)


# ----------------------------------------------------------------------------------- tiny targets, greedy
def test_varied_gamma_and_prompt_lengths_lossless(monkeypatch, tiny_target):
    """γ = [1, 5, 15, 3] by slot in one batch, drafts right for 0..all positions, prompts of 1..150 tokens,
    6 requests through 4 slots (slot reuse): the slow cache-free greedy output, exactly."""
    g = torch.Generator().manual_seed(0)
    lens = [1, 150, 7, 60, 2, 33]
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]
    num_new = [40, 25, 40, 12, 30, 40]
    reference = {tuple(p): p + greedy_reference(tiny_target, p, n) for p, n in zip(prompts, num_new)}
    correct = {tuple(p): c for p, c in zip(prompts, [10 ** 9, 2, 0, 10 ** 9, 1, 4])}
    drafter, head = make_drafter(tiny_target, block_size=16, policy="direct")
    # γ by slot: the slots stay where admission put them (no compaction)
    engine = SpecEngine(tiny_target, drafter, head, max_batch_size=4, max_seq_len=256, compact_slots=False)
    oracle = Oracle(monkeypatch, engine, reference, num_correct=lambda req: correct[tuple(req.prompt_ids)])
    pattern = [1, 5, 15, 3]
    monkeypatch.setattr(engine.runner, "length_policy", SlotPattern(oracle, pattern))
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, num_new)]
    while engine.has_unfinished():
        engine.step()
    for r, p, n in zip(reqs, prompts, num_new):
        assert r.output_ids == reference[tuple(p)][len(p):], len(p)
        assert r.finish_reason == "length" and len(r.output_ids) == n
        c = correct[tuple(p)]
        gamma = pattern[r.slot % 4]
        remaining = n - 1
        for drafted, accepted in zip(r.draft_lens, r.num_accepted):  # replay the budget
            assert drafted == min(gamma, remaining - 1)
            assert accepted == min(drafted, c)
            remaining -= accepted + 1
    assert {r.slot for r in reqs} == {0, 1, 2, 3}
    assert {1, 3, 5, 15} <= set(engine.stats.draft_len_hist)


def test_random_drafter_lossless_with_slot_reuse(tiny_target):
    """Random drafter (direct and fixed), 7 requests through 3 slots with different budgets: AR output."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [3, 90, 1, 17, 45, 5, 120]]
    ref = [greedy_reference(tiny_target, p, 30) for p in prompts]
    for policy in ("direct", "fixed"):
        drafter, head = make_drafter(tiny_target, block_size=8, layers=2, policy=policy, seed=3)
        engine = SpecEngine(tiny_target, drafter, head, policy=policy, max_batch_size=3, max_seq_len=200)
        reqs = [engine.add_request(p, SamplingParams(max_new_tokens=30 - 3 * (i % 4))) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        for r, out in zip(reqs, ref):
            assert r.output_ids == out[: r.params.max_new_tokens]


def test_recipe_prefill_settings_default_to_cuda_only(tiny_target):
    """``engine.prefill_buckets`` / ``engine.defer_first_block`` unset: on for a CUDA recipe, off for a CPU one (the
    CPU engine unchanged); a value the recipe sets wins, and an engine built from a CPU recipe has both off."""
    from adaflash_ray.config import load_recipe
    from adaflash_ray.engine.engine import prefill_settings

    cpu = load_recipe("recipes/cpu_tiny.yaml")
    assert cpu.engine.prefill_buckets is None and cpu.engine.defer_first_block is None
    assert prefill_settings(cpu) == {"prefill_buckets": False, "defer_first_block": False}
    gpu = load_recipe("recipes/smollm2_135m_gpu.yaml")
    assert gpu.model.device == "cuda"
    assert prefill_settings(gpu) == {"prefill_buckets": True, "defer_first_block": True}
    off = load_recipe("recipes/smollm2_135m_gpu.yaml", ["engine.prefill_buckets=false"])
    assert prefill_settings(off) == {"prefill_buckets": False, "defer_first_block": True}
    on = load_recipe("recipes/cpu_tiny.yaml", ["engine.defer_first_block=true"])
    assert prefill_settings(on) == {"prefill_buckets": False, "defer_first_block": True}
    eng = SpecEngine.from_config(cpu, models=(tiny_target, None, None), max_seq_len=128)
    assert not eng.runner.prefill_buckets and not eng.defer_first_block
    eng = SpecEngine.from_config(on, models=(tiny_target, None, None), max_seq_len=128)
    assert eng.defer_first_block


def test_prefill_buckets_pad_prompts_without_changing_outputs(tiny_target):
    """``prefill_buckets``: a prefill runs the next of PREFILL_LEN_BUCKETS positions (capped at max_seq_len, never
    below the prompt); on CPU that is padding only, and the outputs (AR and a random drafter's, with slot reuse and
    the device lookup's token history) are the greedy reference's, as without it."""
    from adaflash_ray.engine.runner import PREFILL_LEN_BUCKETS

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [3, 33, 64, 65, 150]]
    ref = [greedy_reference(tiny_target, p, 24) for p in prompts]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=3)
    for buckets in (False, True):
        eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=200,
                         calibrate=False, draft_sources=("dflash", "suffix"), lookup_device="device",
                         prefill_buckets=buckets)
        lens = [eng.runner._prefill_len(n) for n in (3, 32, 33, 64, 65, 150, 195)]
        assert lens == ([32, 32, 64, 64, 96, 192, 200] if buckets else [3, 32, 33, 64, 65, 150, 195])
        eng.runner.max_seq_len = 20000  # beyond the last bucket: the next multiple of PREFILL_LEN_STEP
        assert eng.runner._prefill_len(8200) == (10240 if buckets else 8200)
        eng.runner.max_seq_len = 200
        shapes, fwd = [], eng.runner._prefill_forward
        eng.runner._prefill_forward = lambda ids, *a: shapes.append(tuple(ids.shape)) or fwd(ids, *a)
        reqs = eng.generate(prompts, SamplingParams(max_new_tokens=24))
        assert [r.output_ids for r in reqs] == ref, buckets
        assert sorted(shapes) == sorted((1, n) for n in ([32, 64, 64, 96, 192] if buckets else [3, 33, 64, 65, 150]))
        ar = SpecEngine(tiny_target, None, None, max_batch_size=2, max_seq_len=200, prefill_buckets=buckets)
        assert [r.output_ids for r in ar.generate(prompts, SamplingParams(max_new_tokens=24), mode="ar")] == ref
        assert eng.stats.num_prefill_captures == 0 and not eng.runner._prefill_graphs  # CPU: no graphs
    assert PREFILL_LEN_BUCKETS[0] == 32 and list(PREFILL_LEN_BUCKETS) == sorted(PREFILL_LEN_BUCKETS)


@pytest.mark.parametrize("policy,sources", [("fixed", None), ("cost", ("dflash", "suffix"))])
def test_defer_first_block_prefills_without_propose(tiny_target, policy, sources):
    """``defer_first_block``: every prefill runs without a propose and without the drafter-context append (a request
    that fixes its own γ excepted), each request's first step verifies no drafter block, the first proposing step
    catches the prompts' context up, and the outputs stay the greedy reference's (slot reuse: 5 requests, 2 slots)."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [5, 40, 17, 3, 60]]
    ref = [greedy_reference(tiny_target, p, 20) for p in prompts]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy=policy, seed=2)
    eng = SpecEngine(tiny_target, drafter, head, policy=policy, max_batch_size=2, max_seq_len=160, calibrate=False,
                     draft_sources=sources, defer_first_block=True)
    calls, real = [], eng.runner.prefill

    def spy(slots, ps, params, spec, lookup=False, append=True):  # the engine's calls (on CPU each recurses per prompt)
        if not spy.depth:
            calls.append((len(ps), spec, append))
        spy.depth += 1
        try:
            return real(slots, ps, params, spec, lookup, append)
        finally:
            spy.depth -= 1
    spy.depth = 0
    eng.runner.prefill = spy
    reqs = eng.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [r.output_ids for r in reqs] == ref
    assert calls and all(not spec and not append for _, spec, append in calls) and sum(n for n, *_ in calls) == 5
    assert all(r.step_sources[0] != "dflash" for r in reqs)  # no block pending at a request's first step
    assert eng.stats.num_catch_ups > 0
    if policy == "fixed":
        assert all(r.draft_lens[0] == 0 and max(r.draft_lens) > 0 for r in reqs)
        own = SpecEngine(tiny_target, drafter, head, policy=policy, max_batch_size=2, max_seq_len=160,
                         defer_first_block=True)
        calls.clear()
        real = own.runner.prefill
        own.runner.prefill = spy
        r = own.generate([prompts[0]], SamplingParams(max_new_tokens=20, draft_len=3))[0]
        assert calls == [(1, True, True)] and r.output_ids == ref[0] and r.draft_lens[0] == 3  # own γ: proposed


@pytest.mark.parametrize("sources", [None, ("dflash", "suffix")])
def test_compaction_packs_slots_and_keeps_every_output(tiny_target, sources):
    """Six requests of unequal budgets through six slots, none waiting: as they finish the rest are packed into the
    lowest slots (their KV, drafter context, histories, drafts, lookup and sampling state moved), steps run at the
    smaller batch, and every output - greedy, repetition-penalised greedy, seeded sampled with penalties and
    min_tokens - equals the uncompacted engine's; after a compaction the moved requests' drafter context equals a
    fresh projection of their tokens."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [5, 40, 12, 3, 70, 21]]
    budgets = [4, 40, 7, 30, 10, 36]
    extra = {1: dict(repetition_penalty=1.3),
             3: dict(temperature=0.9, seed=7, frequency_penalty=0.4, min_tokens=12, stop_token_ids=[5])}
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, **extra.get(i, {})) for i, n in enumerate(budgets)]
    outs, batch_sizes = {}, {}
    for compact in (False, True):
        policy = "cost" if sources else "direct"
        drafter, head = make_drafter(tiny_target, block_size=8, layers=2, policy=policy, seed=3)
        engine = SpecEngine(tiny_target, drafter, head, policy=policy, max_batch_size=6, max_seq_len=200,
                            compact_slots=compact, draft_sources=sources, calibrate=False)
        rows = []
        real_step = engine.runner.step
        engine.runner.step = lambda slots, *a, **k: rows.append(max(slots) + 1) or real_step(slots, *a, **k)
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        checked = False
        while engine.has_unfinished():
            moves = engine.stats.num_slot_moves
            engine.step()
            if engine.stats.num_slot_moves > moves and not checked and sources is None:
                running = [r for r in reqs if r.status == Status.RUNNING]
                _assert_context_matches(engine, running, drafter)
                checked = True
        outs[compact] = [r.output_ids for r in reqs]
        batch_sizes[compact] = rows
        if compact:
            assert engine.stats.num_compactions > 0 and engine.stats.num_slot_moves > 0
            assert engine.stats.timing()["compaction"]["num_moves"] == engine.stats.num_slot_moves
            assert checked or sources is not None
        else:
            assert engine.stats.num_slot_moves == 0
    assert outs[True] == outs[False]
    for i, p in enumerate(prompts):
        if i not in extra:
            assert outs[True][i] == greedy_reference(tiny_target, p, budgets[i])
    assert sum(batch_sizes[True]) < sum(batch_sizes[False])  # rows computed: the tail runs at fewer rows


def test_move_slots_rejects_bad_moves(tiny_target):
    drafter, head = make_drafter(tiny_target, block_size=4, layers=1, policy="direct", seed=0)
    runner = SpecEngine(tiny_target, drafter, head, max_batch_size=4, max_seq_len=64).runner
    for src, dst in (([1], [1]), ([0, 1], [2]), ([0, 0], [2, 3]), ([4], [0]), ([-1], [0])):
        with pytest.raises(ValueError, match="move_slots"):
            runner.move_slots(src, dst)


def test_request_draft_len_overrides_the_policy(tiny_target):
    """SamplingParams.draft_len: that γ on every step of that request (capped by the tokens left), whatever the
    length policy picks for the others in the batch; output stays the target's greedy output; bad values are
    refused naming the limit."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (4, 11, 23)]
    ref = [greedy_reference(tiny_target, p, 25) for p in prompts]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="direct", seed=3)
    engine = SpecEngine(tiny_target, drafter, head, policy="direct", max_batch_size=3, max_seq_len=200)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=25, draft_len=d)) for p, d in zip(prompts, (7, 3, None))]
    while engine.has_unfinished():
        engine.step()
    for r, out in zip(reqs, ref):
        assert r.output_ids == out
    for r in reqs[:2]:
        left = [25 - 1 - sum(a + 1 for a in r.num_accepted[:i]) for i in range(len(r.draft_lens))]
        assert r.draft_lens == [min(r.params.draft_len, n - 1) for n in left], (r.draft_lens, left)
    assert len(set(reqs[2].draft_lens)) > 1  # the policy's own, varying γ (head_prior=False: random head)
    for bad, match in ((0, "draft_len must be >= 1"), (8, "at most block_size - 1 = 7")):
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompts[0], SamplingParams(max_new_tokens=4, draft_len=bad))
    ar = SpecEngine(tiny_target, None, None, max_batch_size=1, max_seq_len=200)
    with pytest.raises(ValueError, match="without a drafter"):
        ar.add_request(prompts[0], SamplingParams(max_new_tokens=4, draft_len=2))


def test_cost_policy_choice_by_hand():
    """The cost policy's γ* = argmax_γ Σ_r E_r[c(γ)] / t(B, γ), E = 1 + Σ_{i<=γ} Π_{j<=i} p_j (ALGORITHMS.md §2, policy 3)."""
    from adaflash_ray.engine.length_policy import CostLength
    from adaflash_ray.models import AcceptanceHead

    pol = CostLength(AcceptanceHead(8), block_size=5)
    p = torch.tensor([[0.9, 0.5, 0.5, 0.5], [0.9, 0.5, 0.5, 0.5]])
    # E per row: 1.9, 2.35, 2.575, 2.6875 -> sums 3.8, 4.7, 5.15, 5.375
    assert pol.choose(p, None).tolist() == [4, 4]  # no costs: the longest γ (plain DFlash)
    flat = torch.tensor([2.0, 2.0, 2.0, 2.0])
    assert pol.choose(p, flat).tolist() == [4, 4]
    steep = torch.tensor([2.0, 3.0, 4.0, 5.0])  # 1.9, 1.567, 1.2875, 1.075 -> γ = 1
    assert pol.choose(p, steep).tolist() == [1, 1]
    mid = torch.tensor([2.0, 2.2, 2.6, 3.0])  # 1.9, 2.136, 1.981, 1.792 -> γ = 2
    assert pol.choose(p, mid).tolist() == [2, 2]
    two = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.1, 0.1, 0.1, 0.1]])  # E: 1.9 .. 4.10 and 1.1 .. 1.11
    gentle = torch.tensor([2.0, 2.1, 2.2, 2.3])
    assert pol.choose(two, gentle).tolist() == [4, 4]
    assert pol.choose(two, gentle, live=torch.tensor([False, True])).tolist() == [1, 1]  # idle / padding rows: out
    # γ = 0: an AR step commits 1 token per live row. `mid`'s best is γ = 2, 2 x 2.35 / 2.2 = 2.136 tokens/ms
    assert pol.choose(p, mid, ar_cost=torch.tensor(1.0)).tolist() == [2, 2]  # AR: 2 rows / 1 ms = 2.0 < 2.136
    assert pol.choose(p, mid, ar_cost=torch.tensor(0.9)).tolist() == [0, 0]  # AR: 2.22 > 2.136
    one = torch.tensor([False, True])  # one live row: γ = 2 gives 2.35 / 2.2 = 1.068 tokens/ms
    assert pol.choose(p, mid, live=one, ar_cost=torch.tensor(0.9)).tolist() == [0, 0]  # 1.11
    assert pol.choose(p, mid, live=one, ar_cost=torch.tensor(0.95)).tolist() == [2, 2]  # 1.053
    # within COST_TIE (2 %) of the best γ: the longest. Tail acceptance ~0 at nearly flat costs: E 1.9, 1.945,
    # 1.947, 1.947 per row over 2.0, 2.0, 2.02, 2.04 ms -> 0.950, 0.9725, 0.964, 0.954 per row: γ = 4 (0.954 >= 0.953)
    tail = torch.tensor([[0.9, 0.05, 0.05, 0.05]] * 2)
    assert pol.choose(tail, torch.tensor([2.0, 2.0, 2.02, 2.04])).tolist() == [4, 4]
    assert pol.choose(tail, torch.tensor([2.0, 2.0, 2.02, 2.1])).tolist() == [3, 3]  # 0.927 for γ = 4: out
    pol.min_len = 3
    assert pol.choose(p, steep).tolist() == [3, 3]  # γ < min_len never chosen
    pol.set_costs([1, 8], torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]]))
    table = pol.costs
    assert pol.cost_row(1).tolist() == [1.0] * 4 and pol.cost_row(5).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert pol.cost_row(64).tolist() == [1.0, 2.0, 3.0, 4.0]  # beyond the table: its largest batch
    pol.set_costs([1, 8], torch.full((2, 4), 7.0))
    assert pol.costs is table and float(table[1, 3]) == 7.0  # in place: captured graphs see new costs
    assert pol.ar_cost(5) is None  # no AR row: γ = 0 never chosen
    assert pol.set_costs([1, 8], torch.full((2, 4), 7.0), torch.tensor([0.5, 3.0])) is True  # an AR row: new table
    ar = pol.ar_costs
    assert float(pol.ar_cost(1)) == 0.5 and float(pol.ar_cost(5)) == 3.0 and float(pol.ar_cost(64)) == 3.0
    assert pol.set_costs([1, 8], torch.full((2, 4), 7.0), torch.tensor([0.6, 3.5])) is False
    assert pol.ar_costs is ar and float(ar[0]) == pytest.approx(0.6)  # in place as well
    pol.ar_steps = False
    assert pol.ar_cost(1) is None  # switched off (length_head.ar_steps: false)
    for bad, msg in ((([], torch.ones(0, 4)), "non-empty"), (([1], torch.ones(1, 3)), r"\[1, 4\]"),
                     (([2, 1], torch.ones(2, 4)), "strictly increasing"), (([1], torch.zeros(1, 4)), "> 0"),
                     (([1], torch.ones(1, 4), torch.ones(2)), r"ar_costs must be \[1\]"),
                     (([1], torch.ones(1, 4), torch.zeros(1)), "AR cost must be > 0")):
        with pytest.raises(ValueError, match=msg):
            pol.set_costs(*bad)
    with pytest.raises(ValueError, match="probe_every"):
        CostLength(AcceptanceHead(8), block_size=5, probe_every=0)


def test_monotone_costs_lower_envelope():
    """A width slowed during calibration (another process on the GPU) must not make every longer γ look dear:
    the table keeps the lower non-decreasing envelope, never above what was measured."""
    from adaflash_ray.engine.engine import monotone_costs
    from adaflash_ray.engine.length_policy import CostLength
    from adaflash_ray.models.length_head import AcceptanceHead

    measured = torch.tensor([[2.0, 2.1, 5.0, 2.2, 2.3, 2.2, 2.4], [3.0, 3.0, 3.1, 3.3, 3.2, 3.6, 3.7]])
    got = monotone_costs(measured)
    assert torch.equal(got, torch.tensor([[2.0, 2.1, 2.2, 2.2, 2.2, 2.2, 2.4], [3.0, 3.0, 3.1, 3.2, 3.2, 3.6, 3.7]]))
    assert bool((got <= measured).all()) and bool((got[:, 1:] >= got[:, :-1]).all())
    # with that spike a running maximum made γ >= 3 cost 5 ms and the policy stop at γ = 2; the envelope does not
    pol = CostLength(AcceptanceHead(8), block_size=8)
    p = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]])
    assert int(pol.choose(p, measured[0].cummax(0).values)[0]) == 2
    assert int(pol.choose(p, got[0])[0]) > 2


def test_calibration_holds_the_device_lock(monkeypatch, tmp_path, tiny_target):
    """Engines sharing a device calibrate one at a time: while one times its steps, another process cannot take
    the device's lock; afterwards it can."""
    import subprocess
    import sys

    import adaflash_ray.engine.engine as engine_mod

    assert engine_mod.device_lock_path("cpu").endswith("adaflash_calibrate_cpu.lock")
    path = str(tmp_path / "adaflash_calibrate_cpu.lock")  # not the machine-wide one: no other run can hold it
    monkeypatch.setattr(engine_mod, "device_lock_path", lambda device: path)
    probe = [sys.executable, "-c", f"from filelock import FileLock; FileLock({path!r}).acquire(timeout=0)"]
    drafter, head = make_drafter(tiny_target, block_size=4, layers=1, policy="cost", seed=5)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=64, calibrate=False)
    seen = []
    real = engine.runner.time_step

    def timed(*a, **k):
        seen.append(subprocess.run(probe, capture_output=True).returncode)
        return real(*a, **k)

    monkeypatch.setattr(engine.runner, "time_step", timed)
    engine.calibrate_costs(num_iters=1)
    assert seen and all(rc != 0 for rc in seen), seen  # locked during every measurement
    assert subprocess.run(probe, capture_output=True).returncode == 0  # released after


def test_cost_policy_engine_lossless_with_measured_costs(tiny_target):
    """policy cost: the engine measures its step cost table at start (positive, one row per batch size, not
    falling with γ), every step drafts one γ for the whole batch, and the output is the AR output."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [3, 40, 9, 70, 20]]
    budgets = [24, 10, 30, 24, 16]  # staggered: requests join a running batch
    ref = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=200)
    table = engine.cost_table
    assert table["batch_sizes"] == [1, 2, 3] and len(table["costs_ms"]) == 3
    assert all(len(row) == 7 and all(c > 0 for c in row) for row in table["costs_ms"])
    assert len(table["ar_costs_ms"]) == 3 and all(c > 0 for c in table["ar_costs_ms"])
    assert all(a <= b for row in table["costs_ms"] for a, b in zip(row, row[1:]))  # never cheaper with γ
    assert engine.runner.length_policy.costs is not None
    # hand-set costs: verification free at batch 1 (a lone admitted row would draft the whole block), steep at
    # batch 2-3 (the running batch drafts γ = 1): a row that joins must not widen the batch's verify
    steep = [float(k) for k in range(1, 8)]
    assert engine.runner.length_policy.set_costs([1, 2, 3], torch.tensor([[1.0] * 7, steep, steep]),
                                                 torch.full((3,), 1e3)) is False  # AR dear: γ = 0 never pays
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    per_step, joined, started = [], 0, set()
    while engine.has_unfinished():
        batch_gamma = max((r.next_draft_len for r in engine.scheduler.running), default=None)
        engine.step()  # every running request's next γ comes from this step's one batched propose
        per_step.append({r.next_draft_len for r in engine.scheduler.running})
        new = [r for r in reqs if r.request_id not in started and r.draft_lens]  # admitted in this step
        started |= {r.request_id for r in reqs if r.draft_lens}
        if batch_gamma is not None and new:  # joining a running batch: no longer block than the batch's γ
            joined += 1
            assert max(r.draft_lens[0] for r in new) <= batch_gamma
    for r, out in zip(reqs, ref):
        assert r.output_ids == out
    assert all(len(gs) <= 1 for gs in per_step) and sum(len(gs) for gs in per_step) > 10  # one γ per batch
    assert joined >= 2  # 5 requests through 3 slots
    assert set(engine.stats.draft_len_hist) - {0} <= set(range(1, 8))
    with pytest.raises(ValueError, match="needs an AcceptanceHead"):
        SpecEngine(tiny_target, *make_drafter(tiny_target, block_size=8, policy="direct"), policy="cost")
    with pytest.raises(ValueError, match="needs the cost policy"):
        SpecEngine(tiny_target, drafter, None, policy="fixed", max_batch_size=2, max_seq_len=200).calibrate_costs()


def _count_proposes(engine) -> list[int]:
    """Record, for every drafter propose of ``engine`` (CPU: no graphs), the engine steps completed before it."""
    proposes = []
    real = engine.runner._propose

    def counted(*a, **k):
        proposes.append(engine.stats.num_engine_steps)
        return real(*a, **k)

    engine.runner._propose = counted
    return proposes


def test_cost_policy_ar_steps_lossless_and_probing(tiny_target):
    """γ = 0 (an AR step beats every γ at this load): the engine steps without proposing, proposes again every
    probe_every steps, goes back to drafting once drafting pays again, and the output is the AR output throughout.
    A request with its own draft_len keeps every step proposing."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [4, 11, 25]]
    budgets = [80, 64, 72]
    ref = [greedy_reference(tiny_target, p, n) for p, n in zip(prompts, budgets)]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=200,
                        calibrate=False, probe_every=4, throughput_guard=False)  # the policy's own schedule
    pol = engine.runner.length_policy
    ar_cheap = (torch.full((3, 7), 100.0), torch.ones(3))  # drafting never pays: γ = 0
    draft_cheap = (torch.ones(3, 7), torch.full((3,), 100.0))  # drafting always pays: the whole block
    pol.set_costs([1, 2, 3], *ar_cheap)
    proposes = _count_proposes(engine)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    engine.step()  # admits all three (one prefill propose each) and takes the first AR step
    for _ in range(14):
        engine.step()
    in_steps = [s for s in proposes if s > 0]  # proposes inside steps 1..15 (the prefill's ran at step 0)
    assert len(proposes) - len(in_steps) == 3
    # steps 1-4 AR, step 5 proposes (γ = 0 again, so the wait doubles), 6-13 AR, step 14 proposes
    assert in_steps == [4, 13], in_steps
    engine.flush_records()  # the running requests' pending γ = 0 records (lazy_ar_records)
    assert all(set(r.draft_lens) == {0} and len(r.draft_lens) == 15 for r in reqs)
    for _ in range(16):  # steps 16-30 AR (the wait is 16), step 31 proposes; γ = 0 again: the wait doubles to 32
        engine.step()
    assert [s for s in proposes if s > 0] == [4, 13, 30] and pol.probe_interval == 32
    steps_ar = engine.stats.num_engine_steps
    pol.set_costs([1, 2, 3], *draft_cheap)  # in place: the next probe sees drafting pay
    while engine.has_unfinished():
        engine.step()
    for r, out in zip(reqs, ref):
        assert r.output_ids == out
    assert any(g > 0 for r in reqs for g in r.draft_lens[steps_ar:])  # back to drafting after the next probe
    first = min(s for s in proposes if s >= steps_ar)  # the probe after the wait of 32 AR steps
    assert first == steps_ar + 32, (first, steps_ar)
    assert [s for s in proposes if s >= first] == list(range(first, engine.stats.num_engine_steps))  # every step
    # a request that asks for its own γ: every step proposes, however cheap AR looks
    pol.set_costs([1, 2, 3], *ar_cheap)
    proposes.clear()
    own = engine.add_request(prompts[0], SamplingParams(max_new_tokens=12, draft_len=3))
    start = engine.stats.num_engine_steps
    while engine.has_unfinished():
        engine.step()
    assert own.output_ids == ref[0][:12] and set(own.draft_lens) - {0, 1, 2} == {3}
    assert len(proposes) == 1 + engine.stats.num_engine_steps - start  # prefill + every step
    # sampling through AR steps: the right number of in-vocabulary tokens
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True))
    assert all(len(r.output_ids) == 20 and all(0 <= t < 128 for t in r.output_ids) for r in sampled)
    assert 0 in engine.stats.draft_len_hist


def test_lazy_ar_records_equal_the_eager_ones(tiny_target):
    """The cost policy's γ = 0 steps recorded as a pending run (``lazy_ar_records``, written by flush_records) give
    every request the same per-step records - draft lengths, accepted counts, sources, drafter versions, first
    version - as writing them each step, through AR stretches, probes, drafting stretches, finishes at different
    steps, admissions into a running batch, a request that ends at its prefill and one aborted while it waits
    inside a pending run, a drafter reload and an abort; and the same outputs and stats."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [4, 11, 25, 7, 9]]
    budgets = [150, 90, 120, 60, 100]
    ar_cheap = (torch.full((3, 7), 100.0), torch.ones(3))
    draft_cheap = (torch.ones(3, 7), torch.full((3,), 100.0))
    runs = []
    for lazy in (True, False):  # each engine its own drafter and head (the same seed): nothing shared between runs
        drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
        engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=200,
                            calibrate=False, probe_every=2, throughput_guard=False)
        engine.lazy_ar_records = lazy
        pol = engine.runner.length_policy
        pol.set_costs([1, 2, 3], *ar_cheap)
        reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, budgets)]
        weights = engine.drafter_tensors()
        for step in range(400):
            if not engine.has_unfinished():
                break
            if step == 8:
                pol.set_costs([1, 2, 3], *draft_cheap)  # drafting pays: a drafting stretch
            elif step == 40:
                pol.set_costs([1, 2, 3], *ar_cheap)
            elif step == 50:
                engine.load_drafter(weights, version=1)  # the same weights as version 1 mid AR stretch
            elif step == 56:
                assert reqs[2] in engine.scheduler.running and engine.abort(reqs[2])
                at_abort = (list(reqs[2].draft_lens), list(reqs[2].step_sources))  # complete when it ends
            elif step == 44:  # mid AR stretch: one request that ends at its prefill, one aborted while it waits
                assert not lazy or engine._ar_reqs is not None  # inside a pending run
                extra = [engine.add_request(prompts[0], SamplingParams(max_new_tokens=1, ignore_eos=True)),
                         engine.add_request(prompts[1], SamplingParams(max_new_tokens=30, ignore_eos=True))]
            elif step == 45:
                waited = extra[1] in engine.scheduler.waiting
                assert engine.abort(extra[1])
            engine.step()
            if lazy and step == 10:
                assert engine._ar_reqs is not None and engine._ar_steps > 1  # a pending run of several steps
        runs.append([(r.output_ids, r.draft_lens, r.num_accepted, r.step_sources, r.step_versions, r.first_version,
                      r.finish_reason) for r in reqs + extra] + [dict(engine.stats.draft_len_hist),
                                                                 engine.stats.num_generated, at_abort, waited])
    assert runs[0] == runs[1]
    assert runs[0][5][0] == greedy_reference(tiny_target, prompts[0], 1)
    assert runs[0][5][1] == [] and runs[0][5][6] == "length"  # the prefill's token only: no decode step recorded
    assert runs[0][6][6] == "abort" and runs[0][-1]  # the second one was aborted while it waited
    assert ar_cheap[0].eq(100.0).all() and draft_cheap[0].eq(1.0).all()  # set_costs kept copies, wrote none back
    recs = runs[0][:5]
    assert all(len(r[1]) == len(r[2]) == len(r[3]) == len(r[4]) > 0 for r in recs)
    assert any(0 in r[1] for r in recs) and any(g > 0 for r in recs for g in r[1])  # both kinds of step
    assert {v for r in recs for v in r[4]} == {0, 1} and recs[2][6] == "abort"


def test_cost_policy_gamma0_inside_a_drafting_stretch_waits_one_step(tiny_target):
    """A γ = 0 answer in the middle of a drafting stretch (drafting paid, then the costs say AR): the policy checks
    again after ONE AR step, and the wait doubles from there (1, 2, 4, ...) instead of starting at probe_every; the
    output is the AR output throughout."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [6, 9]]
    ref = [greedy_reference(tiny_target, p, 70) for p in prompts]
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=200,
                        calibrate=False, probe_every=8, throughput_guard=False)  # the policy's own schedule
    pol = engine.runner.length_policy
    pol.set_costs([1, 2], torch.ones(2, 7), torch.full((2,), 100.0))  # drafting always pays
    proposes = _count_proposes(engine)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=70)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert not pol.ar_chosen
    pol.set_costs([1, 2], torch.full((2, 7), 100.0), torch.ones(2))  # in place: the next answer is γ = 0
    start = engine.stats.num_engine_steps
    proposes.clear()
    for _ in range(16):
        engine.step()
    assert pol.ar_chosen
    # step start proposes (drafting: its answer is 0), then AR 1 step, probe, AR 2, probe, AR 4, probe, AR 8 ...
    assert [s - start for s in proposes] == [0, 2, 5, 10], [s - start for s in proposes]
    assert pol.probe_interval == 8  # the next probe after 8 more AR steps
    while engine.has_unfinished():
        engine.step()
    for r, out in zip(reqs, ref):
        assert r.output_ids == out


def test_ar_regime_only_on_the_policys_answer(monkeypatch, tiny_target):
    """AR steps follow the policy's own γ = 0 only: not an engine stepped in "ar" mode before, not an idle engine's
    old wait; a drafter swap asks the policy again at the next step; a calibration that fails keeps the table in
    use before it."""
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    engine = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=3, max_seq_len=200,
                        calibrate=False, probe_every=2, throughput_guard=False)  # the policy's own schedule
    proposes = _count_proposes(engine)
    prompts = [[5, 6, 7], [9, 8], [1, 2, 3, 4]]
    # no cost table: the policy never answers 0, so after an "ar" step every "spec" step proposes
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    engine.step("ar")
    proposes.clear()
    for _ in range(4):
        engine.step("spec")
    assert proposes == [1, 2, 3, 4] and all(max(r.draft_lens) > 0 for r in reqs)
    while engine.has_unfinished():
        engine.step()
    # AR cheap: the wait grows to its cap; an idle engine starts the next batch from the shortest wait
    pol = engine.runner.length_policy
    pol.set_costs([1, 2, 3], torch.full((3, 7), 100.0), torch.ones(3))
    engine.generate(prompts, SamplingParams(max_new_tokens=60))
    assert pol.ar_chosen and pol.probe_interval == 32  # 2, 4, 8, 16, 32 over the 60 steps
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    engine.step()
    assert pol.ar_chosen and pol.probe_interval == 2  # a new batch: the shortest wait again
    for _ in range(12):
        engine.step()
    assert pol.ar_chosen and pol.probe_interval == 8  # 2, 4, 8 over 12 steps
    proposes.clear()
    engine.load_drafter(engine.drafter_tensors(), version=1)  # a new version: the policy answers at the next step
    engine.step()
    assert proposes == [engine.stats.num_engine_steps - 1]
    while engine.has_unfinished():
        engine.step()
    # a failed calibration leaves the table that was in use
    table = (list(pol.batch_sizes), pol.costs.clone(), pol.ar_costs.clone())

    def broken(*a, **k):
        raise RuntimeError("timer failed")

    monkeypatch.setattr(engine.runner, "time_step", broken)
    with pytest.raises(RuntimeError, match="timer failed"):
        engine.calibrate_costs(num_iters=1)
    assert pol.batch_sizes == table[0] and torch.equal(pol.costs, table[1]) and torch.equal(pol.ar_costs, table[2])


def test_max_new_tokens_truncation_exact(monkeypatch, tiny_target):
    """Budgets 1..33 with a perfect γ = 15 drafter: exactly max_new_tokens tokens, the reference prefix."""
    prompt = [5, 6, 7, 8]
    budgets = [1, 2, 3, 5, 15, 16, 17, 33]
    reference = tiny_reference(tiny_target, [prompt], 40)
    drafter, _ = make_drafter(tiny_target, block_size=16, policy="fixed")
    engine = SpecEngine(tiny_target, drafter, None, policy="fixed", max_batch_size=8, max_seq_len=64)
    Oracle(monkeypatch, engine, reference)
    reqs = [engine.add_request(prompt, SamplingParams(max_new_tokens=n)) for n in budgets]
    while engine.has_unfinished():
        engine.step()
    for r, n in zip(reqs, budgets):
        assert r.output_ids == reference[tuple(prompt)][4:4 + n] and r.finish_reason == "length"
        assert r.num_accepted == r.draft_lens
        assert len(r.draft_lens) == math.ceil((n - 1) / 16)  # γ = min(15, remaining - 1)
    assert reqs[0].draft_lens == [] and reqs[5].draft_lens == [14]


def test_stop_tokens(monkeypatch):
    """A stop token inside an accepted chunk ends the request there; the target's EOS is the default stop;
    ignore_eos runs to the budget."""
    target = make_tiny_target("llama", seed=1)
    prompt = [3, 1, 4, 1, 5]
    ref = greedy_reference(target, prompt, 40)
    # a stop token first produced at output index 2..16: inside the first verify step's chunk
    first = next(i for i in range(2, 17) if ref.index(ref[i]) == i)
    stop = ref[first]
    reference = {tuple(prompt): prompt + ref}
    drafter, _ = make_drafter(target, block_size=16, policy="fixed")
    engine = SpecEngine(target, drafter, None, policy="fixed", max_batch_size=4, max_seq_len=64)
    Oracle(monkeypatch, engine, reference)
    a = engine.add_request(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=[stop]))
    target.config.eos_token_ids = [stop]
    b = engine.add_request(prompt, SamplingParams(max_new_tokens=40))  # default: the target's EOS
    c = engine.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for r in (a, b):
        assert r.output_ids == ref[: first + 1] and r.finish_reason == "stop"
    assert c.output_ids == ref and c.finish_reason == "length"
    assert a.num_accepted == [15] and b.num_accepted == [15]  # 16 tokens committed, cut after the stop
    assert a.features is None  # record=False: no trajectory features kept


# wall times, and Python's garbage collections inside the steps (whenever the collector runs): not the runs' own
_STAT_TIMES = ("decode_seconds", "prefill_seconds", "catch_up_seconds", "compaction_seconds", "kind_seconds",
               "shape_seconds", "gc_seconds", "num_gc", "num_gc_full")


@pytest.mark.parametrize("policy, sources, where, mode", [
    ("direct", None, "host", "spec"), ("direct", None, "host", "ar"),
    ("cost", ("dflash", "suffix"), "device", "spec"), ("cost", ("dflash", "ngram"), "host", "spec"),
    ("fixed", ("suffix",), "device", "spec")])
def test_batched_commit_matches_per_request_commit(policy, sources, where, mode):
    """A batch mixing the target's EOS (hit mid-output), stop ids hit inside a step's chunk, ignore_eos rows whose
    outputs hold another row's stop id, budgets 1..40, min_tokens, a logprobs row and seeded sampling, through four
    slots (admissions mid-flight, slot reuse, compaction): committing the rows that cannot end in _postprocess itself
    (``fast_commit``) gives the outputs, finish reasons, per-step records and statistics (counters' key order
    included) of committing every row through _commit."""
    from dataclasses import fields

    from adaflash_ray.engine import SpecStats

    target = make_tiny_target("llama", seed=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 14, 7, 6, 11, 4, 8, 10)]
    probe = SpecEngine(target, None, None, policy="fixed", max_batch_size=10, max_seq_len=128)
    ref = [r.output_ids for r in probe.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True), mode="ar")]
    eos = ref[2][10]  # in the ignore_eos row 2's output: another row's stop id there
    target.config.eos_token_ids = [eos]
    budgets = [40, 1, 40, 17, 25, 3, 40, 12, 33, 6]
    extra = {1: dict(ignore_eos=True), 2: dict(ignore_eos=True), 3: dict(stop_token_ids=[ref[3][4], ref[3][9]]),
             4: dict(min_tokens=10), 5: dict(logprobs=2, ignore_eos=True), 6: dict(stop_token_ids=[ref[6][20]]),
             7: dict(temperature=0.8, seed=3), 8: dict(stop_token_ids=[eos, ref[8][30]], logprobs=0),
             9: dict(ignore_eos=True, repetition_penalty=1.2)}
    params = [SamplingParams(max_new_tokens=n, **extra.get(i, {})) for i, n in enumerate(budgets)]
    runs = {}
    for fast in (True, False):
        drafter, head = make_drafter(target, block_size=8, layers=1, policy=policy, seed=1) \
            if policy != "fixed" else (None, None)
        engine = SpecEngine(target, drafter, head, policy=policy, max_batch_size=4, max_seq_len=128,
                            draft_sources=sources, lookup_device=where, calibrate=False, throughput_guard=False)
        engine.fast_commit = fast

        def check(eng):  # the step-wide stop check covers every running request's stop ids
            for r in eng.scheduler.running:
                assert set(r.params.stop_token_ids or ()) <= eng._stop_union
            if eng.scheduler.running:  # the batch state kept across steps is the scheduler's, read afresh
                cur = eng._running_state()
                assert cur.requests == eng.scheduler.running and cur.slots == [r.slot for r in cur.requests]
                assert cur.batch_size == max(cur.slots) + 1
                assert np.arange(eng.runner.num_slots)[cur.slot_rows].tolist() == cur.slots  # same rows
                assert cur.fixed == [r.params.draft_len for r in cur.requests]
            if eng.planner is not None and not eng._any_block:  # no pending block flagged: none pending
                assert all(r.dflash_expected is None for r in eng.scheduler.running)

        reqs = engine.generate(prompts, params, mode=mode, on_step=check)
        st = engine.stats
        runs[fast] = ([(r.output_ids, r.finish_reason, r.draft_lens, r.num_accepted, r.step_sources, r.step_versions,
                        r.output_logprobs, r.output_top_logprobs) for r in reqs],
                      {f.name: getattr(st, f.name) for f in fields(SpecStats) if f.name not in _STAT_TIMES},
                      {f.name: list(getattr(st, f.name).items()) for f in fields(SpecStats)
                       if isinstance(getattr(st, f.name), dict) and f.name not in _STAT_TIMES})
        reasons = [r.finish_reason for r in reqs]
        assert "stop" in reasons and "length" in reasons
    assert runs[True] == runs[False]
    outs = [o[0] for o in runs[True][0]]
    for i in (0, 1, 2, 3, 6, 8):  # greedy rows: the AR output cut after the first stop id, then at the budget
        sp = params[i]
        stop = [] if sp.ignore_eos and sp.stop_token_ids is None else (sp.stop_token_ids or [eos])
        cut = next((k + 1 for k, t in enumerate(ref[i]) if t in stop), len(ref[i]))
        assert outs[i] == ref[i][:min(cut, budgets[i])], i
    assert outs[2] == ref[2]  # ignore_eos: past the stop id of the others


def test_record_steps_equals_record_step_per_request():
    """SpecStats.record_steps (one engine step's rows at once) counts what record_step per row counts, and inserts the
    counters' keys in the same order; with and without sources, a step of γ = 0 rows only included."""
    from dataclasses import fields

    from adaflash_ray.engine import SpecStats

    rng = np.random.default_rng(0)
    one, batched = SpecStats(), SpecStats()
    for step in range(40):
        n = int(rng.integers(1, 12))
        lens = rng.integers(0, 8, n).tolist() if step % 5 else [0] * n
        acc = [int(rng.integers(0, g + 1)) for g in lens]
        src = None if step % 3 == 0 else [str(rng.choice(["dflash", "suffix"])) if g else "none" for g in lens]
        batched.record_steps(lens, acc, src)
        for i, (g, a) in enumerate(zip(lens, acc)):
            one.record_step(g, a, src[i] if src is not None else None)
    for f in fields(SpecStats):
        a, b = getattr(one, f.name), getattr(batched, f.name)
        assert a == b, f.name
        if isinstance(a, dict):  # (a step of γ = 0 rows only leaves out the zero Σγ / Σa entries, as it did)
            assert [kv for kv in a.items() if kv[1]] == [kv for kv in b.items() if kv[1]], f.name
    with pytest.raises(ValueError):
        SpecStats().record_steps([1, 2], [1])


# ----------------------------------------------------------------------------------- sampling
def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """χ² goodness of fit, cells with expected < 5 pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    try:
        from scipy.stats import chisquare

        return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    except ImportError:  # Wilson-Hilferty normal approximation of the χ² tail
        stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampling_follows_target_distribution():
    """Temperature 0.8, vocab 12, random drafter (accepts and rejects both happen): the joint law of the
    first 4 generated tokens equals the target's, by χ² on pairs (p > 0.001), over 4096 samples."""
    vocab, temp, num = 12, 0.8, 4096
    target = make_tiny_target("qwen3", vocab_size=vocab, seed=2, logit_scale=2.0)
    prompt = [1, 2, 3, 4, 5]
    drafter, _ = make_drafter(target, block_size=4, policy="fixed", seed=4)
    engine = SpecEngine(target, drafter, None, policy="fixed", max_batch_size=64, max_seq_len=16, seed=123)
    reqs = engine.generate([prompt] * num, SamplingParams(max_new_tokens=4, temperature=temp))
    toks = np.array(outputs(reqs))  # [num, 4]
    s = engine.stats
    assert 0.2 < s.num_accepted / s.num_drafted < 0.9  # both the accept and the residual path ran
    # exact law p(t1) p(t2|t1) p(t3|t1,t2) p(t4|t1,t2,t3), from one forward over all 12^3 prefixes
    prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * 3)  # [1728, 3], t1 major
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = target(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -4:]  # [1728, 4, V]
    cond = torch.softmax(logits.double() / temp, -1).reshape(vocab, vocab, vocab, 4, vocab)
    p1 = cond[0, 0, 0, 0]  # [t1]
    p2 = cond[:, 0, 0, 1]  # [t1, t2]
    p3 = cond[:, :, 0, 2]  # [t1, t2, t3]
    p4 = cond[:, :, :, 3]  # [t1, t2, t3, t4]
    joint = p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4
    assert abs(float(joint.sum()) - 1) < 1e-9
    # t2, t3: accepted drafts or residual samples; t4: also the bonus token after a full acceptance
    checks = {"t1,t2": (toks[:, 0] * vocab + toks[:, 1], joint.sum((2, 3))),
              "t2,t3": (toks[:, 1] * vocab + toks[:, 2], joint.sum((0, 3))),
              "t3,t4": (toks[:, 2] * vocab + toks[:, 3], joint.sum((0, 1)))}
    for name, (cells, law) in checks.items():
        observed = np.bincount(cells, minlength=law.numel()).astype(float)
        p = _chi2_pvalue(observed, law.flatten().numpy() * num)
        assert p > 1e-3, (name, p)
    # power: the same samples against the law a greedy-fallback bug would give are rejected
    greedy2 = torch.nn.functional.one_hot(p2.argmax(-1), vocab).double()  # [t1, t2]
    wrong = (p1[:, None] * (0.5 * p2 + 0.5 * greedy2)).flatten().numpy() * num
    assert _chi2_pvalue(np.bincount(toks[:, 0] * vocab + toks[:, 1], minlength=vocab ** 2).astype(float), wrong) < 1e-6


# ----------------------------------------------------------------------------------- hot reload
def _assert_context_matches(engine, reqs, drafter):
    """Each request's drafter context K/V (positions < num_tokens-1) == ``drafter``'s projection of the
    target features of a fresh full forward over its committed tokens."""
    fresh = drafter.new_context_cache(engine.runner.ctx.k.shape[1], engine.max_seq_len)
    for r in reqs:
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        n = ids.shape[1] - 1
        with torch.no_grad():
            feats = engine.target(ids[:, :-1], torch.arange(n)[None], capture_layer_ids=engine.layer_ids).features[0]
        torch.testing.assert_close(engine.runner.features(r.slot, n), feats, rtol=1e-4, atol=1e-4)
        drafter.append_context(fresh, torch.full((n,), r.slot), torch.arange(n), feats)
        for got, want in ((engine.runner.ctx.k, fresh.k), (engine.runner.ctx.v, fresh.v)):
            torch.testing.assert_close(got[:, r.slot, :n], want[:, r.slot, :n], rtol=1e-4, atol=1e-4)


def test_hot_reload_mid_flight(tiny_target):
    """load_drafter between steps: running requests keep going with the new weights (context rebuilt),
    finish with the AR output, and record both versions."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [4, 9, 30, 2, 15, 50]]
    ref = [greedy_reference(tiny_target, p, 24) for p in prompts]
    drafter, head = make_drafter(tiny_target, block_size=6, layers=2, policy="direct", seed=0)
    engine = SpecEngine(tiny_target, drafter, head, max_batch_size=6, max_seq_len=128, record=True)
    new_drafter, new_head = make_drafter(tiny_target, block_size=6, layers=2, policy="direct", seed=1)
    new = dict(new_drafter.drafter_state_dict())
    new.update({f"length_head.{k}": v for k, v in new_head.state_dict().items()})
    assert tensors_sha256(new) != engine.drafter_sha256
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert all(r.status == Status.RUNNING for r in reqs)
    _assert_context_matches(engine, reqs, drafter)  # the incremental appends of version 0
    sha = engine.load_drafter(new, version=1, sha256=tensors_sha256(new))
    assert sha == engine.drafter_sha256 == tensors_sha256(new)
    assert engine.drafter_version == 1 and engine.num_reloads == 1
    for k, v in engine.drafter_tensors().items():
        assert torch.equal(v, new[k])
    _assert_context_matches(engine, reqs, new_drafter)  # rebuilt with the new weights
    while engine.has_unfinished():
        engine.step()
    for r, out in zip(reqs, ref):
        assert r.output_ids == out
        assert r.step_versions[:3] == [0, 0, 0] and set(r.step_versions) == {0, 1}
        assert r.step_versions == sorted(r.step_versions)
        traj = engine.to_trajectory(r)
        assert traj.drafter_version == 0 and list(traj.step_versions) == r.step_versions


# ----------------------------------------------------------------------------------- trajectories
def test_trajectory_record(monkeypatch, tiny_target):
    """record=True: features / last_hidden rows = num_tokens - 1, equal to a fresh full forward at those
    positions (bf16 in the record, float32 in the request), one per-step entry per verify step."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in [6, 21, 3, 40]]
    reference = tiny_reference(tiny_target, prompts, 30)
    correct = dict(zip(map(tuple, prompts), [10 ** 9, 3, 0, 6]))
    stop = reference[tuple(prompts[1])][21 + 12]
    budgets = [30, 30, 7, 13]  # request 1 may stop early at `stop`
    drafter, head = make_drafter(tiny_target, block_size=8, policy="direct")
    engine = SpecEngine(tiny_target, drafter, head, max_batch_size=4, max_seq_len=64, record=True, drafter_version=4)
    Oracle(monkeypatch, engine, reference, num_correct=lambda req: correct[tuple(req.prompt_ids)])
    calls = []
    step = engine.runner.step

    def counting_step(slots, *args, **kwargs):
        calls.append(len(slots))
        return step(slots, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", counting_step)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, stop_token_ids=[stop] if i == 1 else []))
            for i, (p, n) in enumerate(zip(prompts, budgets))]
    while engine.has_unfinished():
        engine.step()
    assert sum(len(r.draft_lens) for r in reqs) == sum(calls) == engine.stats.num_verify_steps
    layer_ids = engine.layer_ids
    assert layer_ids == [1, 2]
    for r in reqs:
        traj = engine.to_trajectory(r)
        t = r.num_tokens
        assert traj.token_ids.tolist() == r.prompt_ids + r.output_ids and traj.prompt_len == len(r.prompt_ids)
        assert traj.features.shape == (t - 1, 64) and traj.last_hidden.shape == (t - 1, 32)
        assert traj.features.dtype == traj.last_hidden.dtype == torch.bfloat16
        with torch.no_grad():
            full = tiny_target(traj.token_ids[None, :-1], torch.arange(t - 1)[None], capture_layer_ids=layer_ids)
        raw = engine.runner.features(r.slot, t - 1)  # float32 history (4 requests, 4 slots: no reuse)
        torch.testing.assert_close(raw, full.features[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(engine.runner.last_hidden(r.slot, t - 1), full.last_hidden[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(traj.features.float(), full.features[0], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(traj.last_hidden.float(), full.last_hidden[0], rtol=1e-2, atol=1e-2)
        # teacher logits recomputed from last_hidden predict the committed tokens (greedy)
        with torch.no_grad():
            teacher = tiny_target.lm_head(engine.runner.last_hidden(r.slot, t - 1)).argmax(-1)  # [t-1]
        assert teacher[len(r.prompt_ids) - 1:].tolist() == r.output_ids
        n = len(r.draft_lens)
        assert len(traj.draft_lens) == len(traj.num_accepted) == len(traj.step_versions) == n
        assert traj.draft_lens.dtype == np.int16 and list(traj.step_versions) == [4] * n
        assert traj.drafter_version == 4
        committed = 1 + sum(a + 1 for a in r.num_accepted)  # prefill token + a+1 per step
        if n:
            assert committed - (r.num_accepted[-1] + 1) < len(r.output_ids) <= committed
        else:
            assert len(r.output_ids) == 1
    assert reqs[1].finish_reason == "stop" and reqs[1].output_ids[-1] == stop
    assert reqs[2].num_accepted and set(reqs[2].num_accepted) == {0}


# ----------------------------------------------------------------------------------- bad input
def test_bad_input(tiny_target):
    drafter, head = make_drafter(tiny_target, block_size=4)
    engine = SpecEngine(tiny_target, drafter, head, max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.add_request([1, 128])
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.add_request([-1, 5])
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        engine.add_request(list(range(20)), SamplingParams(max_new_tokens=10))  # 20 + 10 + 4 > 32
    engine.add_request(list(range(18)), SamplingParams(max_new_tokens=10))  # 32 fits
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.add_request([1], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.add_request([1], SamplingParams(temperature=-0.5))
    with pytest.raises(ValueError, match="unknown length policy 'adaptive'"):
        SpecEngine(tiny_target, drafter, head, policy="adaptive")
    with pytest.raises(ValueError, match="needs a DirectLengthHead, got NoneType"):
        SpecEngine(tiny_target, drafter, None, policy="direct")
    assert engine.scheduler.num_unfinished == 1


# ----------------------------------------------------------------------------------- the length-policy registry
def test_registry_entries_are_consistent(tiny_target):
    """Every registered policy: its head's checkpoint tensors are the ones it declares, the engine policy it builds
    is its class (refusing another policy's head), its loss trains the head alone, and the recipe, the factory and
    the bench accept exactly the registered names."""
    from adaflash_ray.bench import known_methods
    from adaflash_ray.config import LengthHeadConfig
    from adaflash_ray.engine.length_policy import LENGTH_POLICIES, policy_of_head_tensors
    from adaflash_ray.models.length_head import HeadLossInputs

    assert set(LENGTH_POLICIES) == {"direct", "cost", "bucket", "fixed"}
    bs, hidden = 8, 32
    g = torch.Generator().manual_seed(0)
    b, n = 2, 3
    x = HeadLossInputs(block_hidden=torch.randn(b, n, bs, hidden, generator=g),
                       draft_hidden=torch.randn(b * n * (bs - 1), hidden, generator=g),
                       confidence=torch.rand(b * n * (bs - 1), 2, generator=g),
                       draft_ids=torch.randint(0, 3, (b, n, bs - 1), generator=g),
                       target_ids=torch.randint(0, 3, (b, n, bs - 1), generator=g),
                       position_valid=torch.ones(b, n, bs - 1, dtype=torch.bool),
                       num_accepted=torch.randint(0, bs, (b, n), generator=g),
                       anchor_valid=torch.ones(b, n, dtype=torch.bool), block_size=bs, lookahead=1,
                       anchor_hidden=torch.randn(b, n, hidden, generator=g))
    for name, spec in LENGTH_POLICIES.items():
        cfg = LengthHeadConfig(policy=name, hidden_size=16)
        head = spec.build_head(hidden, cfg, bs)
        policy = spec.build_policy(head, bs, rate=1.3, min_len=1, ar_steps=True, probe_every=8)
        assert isinstance(policy, spec.engine_policy) and policy.name == name
        drafter, built = make_drafter(tiny_target, block_size=bs, policy=name)
        assert type(built) is spec.head or (built is None and spec.head is None)
        if spec.head is None:
            assert head is None and spec.head_loss is None and spec.head_tensors == ()
            assert f"adaflash-{name}" not in known_methods()
            continue
        assert set(head.state_dict()) == set(spec.head_tensors) and policy_of_head_tensors(spec.head_tensors) == name
        assert f"adaflash-{name}" in known_methods()
        with pytest.raises(ValueError, match=f"policy '{name}' needs an? {spec.head.__name__}"):
            spec.build_policy(None, bs, rate=1.3, min_len=1, ar_steps=True, probe_every=8)
        loss, _ = spec.head_loss(head, x)
        assert loss.shape == () and torch.isfinite(loss)
        loss.backward()
        assert all(p.grad is not None for p in head.parameters())
    with pytest.raises(ValueError, match="unknown length policy 'adaptive'"):
        LengthHeadConfig(policy="adaptive")


def test_a_new_policy_joins_through_the_registry_alone(monkeypatch, tiny_target):
    """A policy defined outside the engine and registered under a new name is accepted by the recipe, built by the
    factory and the engine, and decodes losslessly - nothing else names it."""
    from adaflash_ray.config import LengthHeadConfig
    from adaflash_ray.engine.length_policy import LENGTH_POLICIES, FixedLength, LengthPolicySpec

    class HalfLength(FixedLength):
        name = "half"

        def __call__(self, block_hidden, draft_logits=None, live=None):
            return torch.full(block_hidden.shape[:1], self.block_size // 2, dtype=torch.long,
                              device=block_hidden.device)

    monkeypatch.setitem(LENGTH_POLICIES, "half", LengthPolicySpec("half", HalfLength))
    assert LengthHeadConfig(policy="half").policy == "half"
    drafter, head = make_drafter(tiny_target, block_size=8, policy="half")
    assert head is None
    engine = SpecEngine(tiny_target, drafter, head, policy="half", max_batch_size=2, max_seq_len=128)
    prompts = [[5, 6, 7], [9, 8, 1, 2]]
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for r, p in zip(reqs, prompts):
        assert r.output_ids == greedy_reference(tiny_target, p, 16)
        assert set(r.draft_lens) - {0, 1, 2, 3} == {4}  # γ = bs // 2, capped near the end of the budget


def test_load_drafter_hashes_once_and_follows_the_version_rule(monkeypatch, tiny_target):
    """A load whose tensors land unchanged hashes them once (the digest names the loaded drafter); the initial
    version may be loaded once as a publication, every later load must rise (versions.is_newer), or roll back."""
    import adaflash_ray.engine.engine as engine_mod
    from adaflash_ray.models import CheckpointError

    drafter, head = make_drafter(tiny_target, block_size=4, policy="direct")
    engine = SpecEngine(tiny_target, drafter, head, max_batch_size=2, max_seq_len=64)
    tensors = {k: v.clone() + 0.01 for k, v in engine.drafter_tensors().items()}
    sha = tensors_sha256(tensors)
    calls = []
    monkeypatch.setattr(engine_mod, "tensors_sha256", lambda t: calls.append(1) or tensors_sha256(t))
    assert engine.load_drafter(tensors, version=0, sha256=sha) == sha == engine.drafter_sha256  # the initial v0
    assert len(calls) == 1
    with pytest.raises(CheckpointError, match="version 0 refused"):
        engine.load_drafter(tensors, version=0, sha256=sha)
    headless = {k: v for k, v in tensors.items() if not k.startswith("length_head.")}
    calls.clear()
    engine.load_drafter(headless, version=1)  # the engine keeps its own head: the loaded set is hashed instead
    assert len(calls) == 1 and engine.drafter_sha256 == tensors_sha256(engine.drafter_tensors())
    assert engine.load_drafter(tensors, version=0, sha256=sha, rollback=True) == sha


def test_expand_spans_lists_each_slot_once_per_position_in_span_order():
    """The drafter-context catch-up's (row, position) pairs from ``(slot, start, stop)`` spans: spans of unequal
    lengths, slots out of order, a length-1 span - the same pairs, in the same order, as expanding span by span."""
    from adaflash_ray.engine.runner import _expand_spans

    spans = [(5, 10, 13), (0, 0, 1), (7, 40, 44), (2, 3, 5)]
    rows, pos = _expand_spans(spans)
    assert rows.dtype == pos.dtype == np.int64
    assert rows.tolist() == [5, 5, 5, 0, 7, 7, 7, 7, 2, 2]
    assert pos.tolist() == [10, 11, 12, 0, 40, 41, 42, 43, 3, 4]
