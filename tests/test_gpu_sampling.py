"""CUDA-only tests of the per-request sampling parameters through the engine's CUDA-graph step (marker ``gpu``; skipped
without a CUDA device): the checks of tests/test_sampling_params.py on tiny random float32 targets moved to the GPU.

- greedy with penalties / min_tokens (DFlash and ngram drafts): output == the per-token reference loop, the steps
  replayed captured graphs whose StepKey carries the flags, and graphs == eager token for token;
- seeded sampling: == the reference loop's inverse-CDF sample, alone and in mixed batches (other batch buckets, other
  slots), graphs == eager; logprobs == log_softmax of a fresh full forward;
- χ² of the processed law through the graphs (unseeded and seeded rows separately, batched GPU prefill);
- the common path's graphs carry no sampling flag and allocate no penalty state.

Run on a GPU machine: python -m pytest -q -m gpu tests/test_gpu_sampling.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_target
from test_engine import _chi2_pvalue
from test_sampling_params import (CHI2_PARAMS, GREEDY_CASES, NEW, SEEDED, _processed_law, _prompts, engines,
                                  greedy_case, reference_generate)

from adaflash_ray.engine import SamplingParams
from adaflash_ray.engine.sampling import SamplingFlags

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def gpu_tiny():
    """The tiny fp32 target of tests/test_sampling_params.py on the GPU (peaky logits: no near ties)."""
    return make_tiny_target("llama", seed=5, logit_scale=2.0).to("cuda")


def _copies(params):
    return [SamplingParams(**vars(p)) for p in params]


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_processing_graphs_equal_reference(gpu_tiny, case):
    """Greedy with the case's processing, batch 3: DFlash / ngram drafts through captured graphs == the reference loop
    == the same engine without graphs; the replayed graphs carry the case's flags."""
    prompts, params, refs = greedy_case(gpu_tiny, case)
    for name in ("dflash", "ngram"):
        outs = []
        for graphs in (True, False):
            eng = engines(gpu_tiny, use_cuda_graph=graphs)[name](max_batch_size=4)
            outs.append([r.output_ids for r in eng.generate(prompts, _copies(params))])
            if graphs:
                keys = list(eng.runner.graphs)
                assert keys and eng.stats.num_drafted > 0
                assert any(k.sampling.penalties for k in keys) == any(
                    f in GREEDY_CASES[case] for f in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
                assert any(k.sampling.min_tokens for k in keys) == ("min_tokens" in GREEDY_CASES[case])
        assert outs[0] == refs and outs[1] == refs, name


def test_seeded_and_logprobs_graphs(gpu_tiny):
    """Seeded requests through the graphs: == the reference loop's sample at the request's uniforms, alone (batch
    bucket 1) and in a batch of 6 (bucket 6) beside greedy and unseeded rows, with DFlash and ngram drafts, == eager;
    logprobs = 5 of the first == log_softmax of a fresh full forward (ids and values)."""
    prompts = _prompts()
    sps = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, **kw) for kw in SEEDED]
    sps[0].logprobs = 5
    refs = [reference_generate(gpu_tiny, prompts[i % 3], sp, set(sp.stop_token_ids or ())) for i, sp in enumerate(sps)]
    others = [SamplingParams(max_new_tokens=NEW, ignore_eos=True), SamplingParams(max_new_tokens=9, temperature=0.7)]
    batch_prompts = [prompts[0]] + [prompts[i % 3] for i in range(len(sps))] + [prompts[2]]
    for name in ("dflash", "ngram"):
        for graphs in (True, False):
            eng = engines(gpu_tiny, use_cuda_graph=graphs)[name](max_batch_size=6)
            alone = eng.generate([prompts[0]], _copies(sps[:1]))[0]
            batch = eng.generate(batch_prompts, [others[0]] + _copies(sps) + [others[1]])
            assert alone.output_ids == refs[0] and [r.output_ids for r in batch[1:-1]] == refs, (name, graphs)
            if graphs:
                assert any(k.sampling.seeded and k.sampling.logprobs == 20 for k in eng.runner.graphs)
            r = batch[1]
            ids = torch.tensor([r.prompt_ids + r.output_ids], device="cuda")
            with torch.no_grad():
                logits = gpu_tiny(ids, torch.arange(ids.shape[1], device="cuda")[None]).logits[0]
            lp = torch.log_softmax(logits.double(), -1)[len(r.prompt_ids) - 1:-1].cpu()  # [n, V]
            want = lp.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
            np.testing.assert_allclose(r.output_logprobs, want.numpy(), atol=1e-4)
            for k, top in enumerate(r.output_top_logprobs):
                vals, idx = lp[k].topk(5)
                assert [t for t, _ in top] == idx.tolist()
                np.testing.assert_allclose([v for _, v in top], vals.numpy(), atol=1e-4)


@pytest.mark.parametrize("source", ["dflash", "ngram"])
def test_sampled_processing_graphs_follow_the_processed_law(source):
    """Every processing step at temperature 0.9 through the graphs, 3000 unseeded + 3000 seeded (distinct seeds)
    requests: the pairs (t1, t2) and (t2, t3) of each half follow the processed law (χ², p > 1e-3); the unprocessed
    law is rejected."""
    vocab, num = 12, 3000
    cpu_target = make_tiny_target("qwen3", vocab_size=vocab, seed=2)
    prompt = [5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3]
    stop = reference_generate(cpu_target, prompt, SamplingParams(max_new_tokens=1))[0]
    sp = SamplingParams(stop_token_ids=[stop], **CHI2_PARAMS)
    law = _processed_law(cpu_target, prompt, sp, {stop}, vocab)
    target = make_tiny_target("qwen3", vocab_size=vocab, seed=2).to("cuda")
    eng = engines(target, block_size=4)[source](max_batch_size=128, seed=7)
    params = [SamplingParams(**{**vars(sp), "seed": None}) for _ in range(num)] + \
             [SamplingParams(**{**vars(sp), "seed": 1000 + i}) for i in range(num)]
    toks = np.array([r.output_ids for r in eng.generate([prompt] * (2 * num), params)])  # [2 num, 3]
    assert len(eng.runner.graphs) > 0 and any(k.sampling.seeded for k in eng.runner.graphs)
    s = eng.stats
    assert 0 < s.num_accepted < s.num_drafted, (s.num_accepted, s.num_drafted)
    assert not (toks[:, :2] == stop).any()
    for half, rows in (("unseeded", toks[:num]), ("seeded", toks[num:])):
        for (a, b), marginal in (((0, 1), law.sum(2)), ((1, 2), law.sum(0))):
            observed = np.bincount(rows[:, a] * vocab + rows[:, b], minlength=vocab ** 2).astype(float)
            p = _chi2_pvalue(observed, marginal.flatten().numpy() * num)
            assert p > 1e-3, (half, a, b, p)
    plain = _processed_law(cpu_target, prompt, sp, {stop}, vocab, processed=False).sum(2).flatten().numpy() * num
    observed = np.bincount(toks[:num, 0] * vocab + toks[:num, 1], minlength=vocab ** 2).astype(float)
    assert _chi2_pvalue(observed, plain) < 1e-6


def test_common_path_graphs_carry_no_sampling_flag(gpu_tiny):
    """Greedy and temperature / top-p requests only: every captured graph has the new flags off and the engine holds
    no penalty or stop state (the common path pays nothing)."""
    eng = engines(gpu_tiny)["dflash"](max_batch_size=4)
    eng.generate(_prompts(), [SamplingParams(max_new_tokens=NEW), SamplingParams(max_new_tokens=NEW, temperature=0.8),
                              SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9)])
    keys = list(eng.runner.graphs)
    assert keys and any(k.sampling.use_top_p for k in keys)
    assert {k.sampling for k in keys} <= {SamplingFlags(), SamplingFlags(sample=True),
                                          SamplingFlags(sample=True, use_top_p=True)}
    assert eng.runner.sampling.counts is None and eng.runner.sampling.stop_mask is None
