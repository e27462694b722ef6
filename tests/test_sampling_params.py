"""Tests of the per-request sampling parameters (``SamplingParams``: repetition / frequency / presence penalties,
min_tokens, ignore_eos, top_k, min_p, seed, logprobs) through the speculative engine, on tiny random float32 targets.

- greedy: the output of DFlash drafts (an oracle drafter whose blocks are the processed reference, so long windows
  are accepted and window position j must count the drafts before it), of prompt-lookup (``ngram``) drafts and of
  AR mode equals a plain per-token reference loop over the target's full-sequence logits that applies the same
  processing (:func:`reference_generate`, written from vLLM's rules, independent of the engine's code);
- sampled: the joint law of the first tokens of a fixed prompt equals the processed target law (χ², drafter and
  ngram sources, seeded and unseeded rows separately), and the test rejects the unprocessed law;
- seed: a seeded request's output is the reference loop's inverse-CDF sample at the request's uniforms, whatever the
  batch, the draft source or the mode;
- logprobs equal log_softmax of the target's raw logits (a fresh full forward) for the committed tokens, top-k too;
- min_tokens / ignore_eos lengths; bad values raise ValueError naming the field; the StepKey flags are off on the
  common path (no penalty state allocated).

Run: python -m pytest -q tests/test_sampling_params.py   (CPU, ~30 s)
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import make_drafter, make_tiny_target
from test_engine import Oracle, _chi2_pvalue

from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.engine.runner import StepKey
from adaflash_ray.engine.sampling import SamplingFlags, seed_uniforms

NEW = 24


# ----------------------------------------------------------------------------------- the reference
def reference_uniforms(seed: int, n: int) -> np.ndarray:
    """The documented stream of a seeded request: entry k drives output token k."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 1 << 24, (n,), generator=g).double() / (1 << 24)).numpy()


def reference_adjust(logits: torch.Tensor, prompt: list[int], out: list[int], sp: SamplingParams,
                     stop: set[int]) -> torch.Tensor:
    """Penalties (repetition over prompt + output, frequency / presence over the output) and min_tokens, float64."""
    x = logits.double().clone()
    for t in set(prompt) | set(out):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t, c in Counter(out).items():
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty
    if len(out) < sp.min_tokens and stop:
        x[sorted(stop)] = float("-inf")
    return x


def reference_probs(x: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """temperature -> min_p -> top_k -> top_p (nucleus: keep a token while the mass before it is <= top_p)."""
    p = torch.softmax(x / sp.temperature, -1)
    if sp.min_p > 0:
        p = torch.where(p < sp.min_p * p.max(), 0.0, p)
    if 0 < sp.top_k < len(p):
        p = torch.where(p < p.sort(descending=True).values[sp.top_k - 1], 0.0, p)
    p = p / p.sum()
    if sp.top_p < 1:
        keep, mass = torch.zeros_like(p, dtype=torch.bool), 0.0
        for t in p.argsort(descending=True).tolist():
            if mass > sp.top_p:
                break
            keep[t], mass = True, mass + float(p[t])
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p


@torch.no_grad()
def reference_generate(target, prompt: list[int], sp: SamplingParams, stop: set[int] = frozenset()) -> list[int]:
    """Slow oracle: one cache-free full forward per token, the processing of vLLM's sampler on the last position;
    greedy: argmax; seeded: the inverse-CDF sample at the request's uniform of that output index."""
    u = reference_uniforms(sp.seed, sp.max_new_tokens) if sp.temperature > 0 else None
    ids, out = list(prompt), []
    dev = target.lm_head.weight.device
    for k in range(sp.max_new_tokens):
        logits = target(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None]).logits[0, -1]
        x = reference_adjust(logits.cpu(), prompt, out, sp, stop)
        if u is None:
            tok = int(x.argmax())
        else:
            cdf = reference_probs(x, sp).cumsum(0)
            tok = int(torch.searchsorted(cdf, torch.tensor([u[k] * float(cdf[-1])], dtype=torch.float64),
                                         right=True)[0])
        out.append(tok)
        ids.append(tok)
        if tok in stop:
            break
    return out


def engines(target, block_size: int = 8, **engine_kw):
    """name -> engine factory (its keywords join ``engine_kw``): DFlash drafts (random drafter, fixed γ) and prompt
    lookup (no drafter)."""
    drafter, _ = make_drafter(target, block_size=block_size, policy="fixed", seed=3)
    return {"dflash": lambda **kw: SpecEngine(target, drafter, None, policy="fixed", max_seq_len=128, **engine_kw,
                                              **kw),
            "ngram": lambda **kw: SpecEngine(target, None, None, max_seq_len=128, draft_sources=("ngram",),
                                             **engine_kw, **kw)}


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", seed=5, logit_scale=2.0)


def _prompts(vocab: int = 128):
    g = torch.Generator().manual_seed(11)
    a, b, c = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 9, 17))
    return [a * 3, b, c + c[:5]]  # repeats: prompt lookup finds matches


# ----------------------------------------------------------------------------------- greedy
GREEDY_CASES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition<1": dict(repetition_penalty=0.5),
    "frequency+presence": dict(frequency_penalty=1.2, presence_penalty=-0.5),
    "presence<0": dict(presence_penalty=-2.0, top_k=3, min_p=0.3),  # top_k / min_p: argmax-invariant
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6, min_tokens=12),
}


def greedy_case(target, case: str):
    """The three prompts of a :data:`GREEDY_CASES` case, their SamplingParams (with min_tokens, stop tokens the plain
    greedy output opens with, so they are held back) and the reference outputs."""
    prompts = _prompts()
    params = []
    for p in prompts:
        plain = reference_generate(target, p, SamplingParams(max_new_tokens=4))
        stop = [plain[0], plain[2]] if "min_tokens" in GREEDY_CASES[case] else []
        params.append(SamplingParams(max_new_tokens=NEW, stop_token_ids=stop, **GREEDY_CASES[case]))
    refs = [reference_generate(target, p, sp, set(sp.stop_token_ids)) for p, sp in zip(prompts, params)]
    return prompts, params, refs


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_processing_lossless(monkeypatch, target, case):
    """Greedy output with the case's processing == the reference loop, for DFlash drafts (an oracle drafter proposing
    the processed reference: 7-token windows accepted, some rows wrong after 2 drafts), ngram drafts and AR mode,
    three requests in one batch."""
    prompts, params, refs = greedy_case(target, case)
    assert refs != [reference_generate(target, p, SamplingParams(max_new_tokens=NEW)) for p in prompts]  # it bites
    if "min_tokens" in GREEDY_CASES[case]:
        assert all(len(r) >= 12 for r in refs) and any(len(r) < NEW for r in refs)  # stopped, after min_tokens
    make = engines(target)
    eng = make["dflash"](max_batch_size=3)
    Oracle(monkeypatch, eng, {tuple(p): p + r + [0] * NEW for p, r in zip(prompts, refs)},
           num_correct=lambda req: 10 ** 9 if req.slot != 1 else 2)
    got = [r.output_ids for r in eng.generate(prompts, [SamplingParams(**vars(sp)) for sp in params])]
    assert got == refs
    assert eng.stats.num_accepted > eng.stats.num_verify_steps  # long windows were accepted
    eng = make["ngram"](max_batch_size=3)
    assert [r.output_ids for r in eng.generate(prompts, [SamplingParams(**vars(sp)) for sp in params])] == refs
    assert eng.stats.num_drafted > 0
    ar = [r.output_ids for r in eng.generate(prompts, [SamplingParams(**vars(sp)) for sp in params], mode="ar")]
    assert ar == refs


def test_min_tokens_and_ignore_eos_lengths():
    """The target's EOS is the first token of its plain greedy output: without min_tokens the request stops at once;
    with min_tokens = 9 it runs exactly as the reference (>= 9 tokens, then stops at EOS or the budget); ignore_eos
    with min_tokens runs to max_new_tokens unmasked (no stop token); min_tokens = max_new_tokens fills the budget."""
    target = make_tiny_target("llama", seed=6, logit_scale=2.0)
    prompt = [7, 3, 9, 3, 7]
    eos = reference_generate(target, prompt, SamplingParams(max_new_tokens=1))[0]
    target.config.eos_token_ids = [eos]
    make = engines(target, block_size=4)
    for name in ("dflash", "ngram"):
        eng = make[name](max_batch_size=4)
        plain, held, ignored, full = eng.generate([prompt] * 4, [
            SamplingParams(max_new_tokens=NEW), SamplingParams(max_new_tokens=NEW, min_tokens=9),
            SamplingParams(max_new_tokens=NEW, min_tokens=9, ignore_eos=True),
            SamplingParams(max_new_tokens=12, min_tokens=12)])
        assert plain.output_ids == [eos] and plain.finish_reason == "stop"
        ref = reference_generate(target, prompt, SamplingParams(max_new_tokens=NEW, min_tokens=9), {eos})
        assert held.output_ids == ref and len(ref) >= 9 and eos not in ref[:9]
        assert held.finish_reason == ("stop" if ref[-1] == eos else "length")
        assert ignored.output_ids == reference_generate(target, prompt, SamplingParams(max_new_tokens=NEW))
        assert len(ignored.output_ids) == NEW and ignored.finish_reason == "length"
        assert len(full.output_ids) == 12 and eos not in full.output_ids and full.finish_reason == "length"


# ----------------------------------------------------------------------------------- sampled
CHI2_PARAMS = dict(temperature=0.9, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.4, top_k=8,
                   min_p=0.02, top_p=0.95, min_tokens=2, max_new_tokens=3)


def _processed_law(target, prompt, sp, stop, vocab, processed=True):
    """The exact joint law of the first 3 tokens ``[V, V, V]`` under the reference processing (float64)."""
    prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * 2)  # [V^2, 2]
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = target(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -3:]  # [V^2, 3, V]
    q = sp if processed else SamplingParams(temperature=sp.temperature, max_new_tokens=3)
    stop = stop if processed else set()
    law = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for i, (t1, t2) in enumerate(prefixes.tolist()):
        cond = [reference_probs(reference_adjust(logits[i, k], prompt, out, q, stop), q)
                for k, out in enumerate(([], [t1], [t1, t2]))]
        law[t1, t2] = cond[0][t1] * cond[1][t2] * cond[2]
    return law


@pytest.fixture(scope="module")
def chi2_setup():
    vocab = 12
    target = make_tiny_target("qwen3", vocab_size=vocab, seed=2)
    prompt = [5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3]  # every token occurs: prompt lookup always proposes
    stop = reference_generate(target, prompt, SamplingParams(max_new_tokens=1))[0]  # the likeliest first token
    sp = SamplingParams(stop_token_ids=[stop], **CHI2_PARAMS)
    return target, prompt, sp, stop, _processed_law(target, prompt, sp, {stop}, vocab)


@pytest.mark.parametrize("source,num", [("dflash", 1000), ("ngram", 800)])
def test_sampled_processing_follows_the_processed_law(chi2_setup, source, num):
    """Temperature 0.9 with every processing step (penalties, min_tokens on the likeliest first token, min_p, top_k,
    top_p): the pairs (t1, t2) and (t2, t3) of ``num`` samples follow the processed target law (χ², p > 1e-3); drafts
    (a random drafter's samples / point-mass lookups) were accepted and rejected; the same samples reject the
    unprocessed law (power). Seeded rows: :func:`test_seeded_output_is_the_reference_sample_whatever_the_batch`
    checks them token for token (and tests/test_gpu_sampling.py by χ² as well)."""
    target, prompt, sp, stop, law = chi2_setup
    vocab = law.shape[0]
    eng = engines(target, block_size=4)[source](max_batch_size=64, seed=7)
    toks = np.array([r.output_ids for r in eng.generate([prompt] * num, sp)])
    s = eng.stats
    assert s.num_drafted > num / 2 and 0.02 < s.num_accepted / s.num_drafted < 0.95, (s.num_accepted, s.num_drafted)
    assert not (toks[:, :2] == stop).any()  # min_tokens held the stop token back
    for (a, b), marginal in (((0, 1), law.sum(2)), ((1, 2), law.sum(0))):
        observed = np.bincount(toks[:, a] * vocab + toks[:, b], minlength=vocab ** 2).astype(float)
        p = _chi2_pvalue(observed, marginal.flatten().numpy() * num)
        assert p > 1e-3, (a, b, p)
    plain = _processed_law(target, prompt, sp, {stop}, vocab, processed=False).sum(2).flatten().numpy() * num
    observed = np.bincount(toks[:, 0] * vocab + toks[:, 1], minlength=vocab ** 2).astype(float)
    assert _chi2_pvalue(observed, plain) < 1e-6


# ----------------------------------------------------------------------------------- seed
SEEDED = [dict(temperature=1.0, seed=42, repetition_penalty=1.2, top_k=40),
          dict(temperature=0.7, seed=0, top_p=0.8, min_p=0.05),
          dict(temperature=1.3, seed=-5, frequency_penalty=0.5, presence_penalty=0.3),
          dict(temperature=1.0, seed=2 ** 40, min_tokens=20, stop_token_ids=[3, 7, 11])]


def test_seeded_output_is_the_reference_sample_whatever_the_batch(target):
    """Seeded requests (several temperatures and processings): each output is the reference loop's inverse-CDF
    sample at the request's uniforms - alone, or in a batch beside greedy, unseeded and each other (other slots),
    through DFlash drafts, ngram drafts and AR mode. Another seed gives another output."""
    assert np.array_equal(seed_uniforms(42, 50), reference_uniforms(42, 50).astype(np.float32))
    prompts = _prompts()
    sps = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, **kw) for kw in SEEDED]
    refs = [reference_generate(target, prompts[i % 3], sp, set(sp.stop_token_ids or ())) for i, sp in enumerate(sps)]
    others = [SamplingParams(max_new_tokens=NEW, ignore_eos=True), SamplingParams(max_new_tokens=9, temperature=0.7)]
    batch_prompts = [prompts[0]] + [prompts[i % 3] for i in range(len(sps))] + [prompts[2]]
    make = engines(target)
    for name in ("dflash", "ngram"):
        eng = make[name](max_batch_size=6)
        alone = eng.generate([prompts[0]], SamplingParams(**vars(sps[0])))[0].output_ids
        batch = eng.generate(batch_prompts, [others[0]] + [SamplingParams(**vars(sp)) for sp in sps] + [others[1]])
        assert alone == refs[0] and [r.output_ids for r in batch[1:-1]] == refs, name
        assert eng.stats.num_accepted > 0
    ar = eng.generate(batch_prompts[1:-1], [SamplingParams(**vars(sp)) for sp in sps], mode="ar")
    assert [r.output_ids for r in ar] == refs
    other = eng.generate([prompts[0]], SamplingParams(**{**vars(sps[0]), "seed": 43}))[0].output_ids
    assert other != refs[0]


# ----------------------------------------------------------------------------------- logprobs
def test_logprobs_are_the_targets_raw_log_softmax(target):
    """logprobs = 5 (with penalties and sampling, which do not change them: vLLM's raw logprobs), 0 and None, DFlash /
    ngram / AR: per committed token the log_softmax of the target's logits of a fresh full forward; top-5 = its topk
    (ids and values, best first); logprobs = 0: an empty top list per token; None: nothing."""
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=NEW, logprobs=5, temperature=0.8, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_new_tokens=15, logprobs=0, ignore_eos=True),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True)]
    make = engines(target)
    for name, mode in (("dflash", "spec"), ("ngram", "spec"), ("ngram", "ar")):
        reqs = make[name](max_batch_size=3).generate(prompts, [SamplingParams(**vars(p)) for p in params], mode=mode)
        for r in reqs[:2]:
            ids = torch.tensor([r.prompt_ids + r.output_ids])
            with torch.no_grad():
                lp = torch.log_softmax(target(ids, torch.arange(ids.shape[1])[None]).logits[0].double(), -1)
            lp = lp[len(r.prompt_ids) - 1:-1]  # [n, V]: the position that chose each output token
            assert len(r.output_logprobs) == len(r.output_top_logprobs) == len(r.output_ids) == r.params.max_new_tokens
            want = lp.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
            np.testing.assert_allclose(r.output_logprobs, want.numpy(), atol=1e-4)
            for k, top in enumerate(r.output_top_logprobs):
                if r.params.logprobs == 0:
                    assert top == []
                    continue
                vals, idx = lp[k].topk(5)
                assert [t for t, _ in top] == idx.tolist(), (name, k)
                np.testing.assert_allclose([v for _, v in top], vals.numpy(), atol=1e-4)
        assert reqs[2].output_logprobs == [] and reqs[2].output_top_logprobs == []


# ----------------------------------------------------------------------------------- bad values, flags
@pytest.mark.parametrize("field,value", [
    ("top_k", -2), ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0), ("frequency_penalty", 2.5),
    ("presence_penalty", -3.0), ("min_tokens", -1), ("min_tokens", 65), ("logprobs", 21), ("logprobs", -1),
    ("seed", 2 ** 63), ("seed", "7"), ("seed", 1.5), ("temperature", -1.0), ("top_p", 0.0), ("stop_token_ids", [128])])
def test_bad_values_raise_naming_the_field(target, field, value):
    eng = SpecEngine(target, None, None, max_batch_size=1, max_seq_len=128)
    with pytest.raises(ValueError, match=field):
        eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=64, **{field: value}))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                                   "presence_penalty"])
def test_non_finite_floats_are_refused(field, value):
    """Every comparison with NaN is False, so a range check alone lets NaN through: each float field refuses NaN and
    ±inf first, naming the field."""
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number, got {value}$"):
        SamplingParams(**{field: value}).validate()


def test_repetition_penalty_range():
    """repetition_penalty stays where float32 logits x or / it cannot overflow: [0.01, 100]."""
    for value in (0.01, 0.5, 1.0, 100.0):
        SamplingParams(repetition_penalty=value).validate()
    for value in (0.0, 0.009, 100.5, 1e308, 1e-308, -1.0):
        with pytest.raises(ValueError, match=r"^repetition_penalty must be in \[0\.01, 100\.0\]"):
            SamplingParams(repetition_penalty=value).validate()


def test_step_flags_off_on_the_common_path(monkeypatch, target):
    """Plain greedy / temperature-only batches run StepKeys with every new flag off and allocate no penalty or stop
    state; a batch with the parameters turns exactly their flags on, and min_tokens' flag goes off once the request
    has generated min_tokens tokens."""
    eng = engines(target)["dflash"](max_batch_size=2)
    keys: list[StepKey] = []
    run = eng.runner._run
    monkeypatch.setattr(eng.runner, "_run", lambda key: (keys.append(key), run(key))[1])
    eng.generate(_prompts()[:2], [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=1.0)])
    assert keys and all(k.sampling in (SamplingFlags(), SamplingFlags(sample=True)) for k in keys)
    assert eng.runner.sampling.counts is None and eng.runner.sampling.stop_mask is None
    keys.clear()
    eng.generate(_prompts()[:2], [SamplingParams(max_new_tokens=NEW, presence_penalty=0.5, min_tokens=10,
                                                 stop_token_ids=[0]),
                                  SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=5, seed=1, logprobs=2)])
    assert keys[0].sampling == SamplingFlags(sample=True, penalties=True, min_tokens=True, use_top_k=True, seeded=True,
                                             logprobs=20)  # both requests running
    assert any(not k.sampling.min_tokens for k in keys)  # after 10 tokens
    assert eng.runner.sampling.counts is not None


def test_seeded_output_through_the_propose_first_hybrid(target):
    """The hybrid whose block is proposed in the step that verifies it (SpecEngine propose_first; DFlash + suffix,
    device lookups): seeded requests come out as the reference loop's samples at their uniforms, greedy ones as the
    target's greedy output - the block's q and its output indices (base 0 at the step's own anchor) line up with the
    verify."""
    prompts = _prompts()
    sps = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, **kw) for kw in SEEDED[:3]]
    refs = [reference_generate(target, prompts[i % 3], sp, set(sp.stop_token_ids or ())) for i, sp in enumerate(sps)]
    drafter, head = make_drafter(target, block_size=8, policy="cost", seed=3)
    eng = SpecEngine(target, drafter, head, policy="cost", max_seq_len=128, max_batch_size=4,
                     draft_sources=("dflash", "suffix"), lookup_device="device", propose_first=True)
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    out = eng.generate(prompts + [prompts[1]], [SamplingParams(**vars(sp)) for sp in sps] + [greedy])
    assert [r.output_ids for r in out[:3]] == refs
    assert out[3].output_ids == reference_generate(target, prompts[1], greedy, set())
    assert eng.stats.source_hist["dflash"] > 0
