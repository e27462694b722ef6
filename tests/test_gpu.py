"""CUDA-only tests of the engine's graph path (marker ``gpu``; skipped without a CUDA device).

- the CUDA-graph step equals the eager step bit for bit (same kernels, bf16, real SmolLM2); so do graphed prefills
  (``prefill_buckets``) and eager ones of the same padded shapes;
- lossless in bf16: greedy speculative output vs the same engine's AR output; every divergence must sit
  at a near tie of the target (top-2 logit gap <= ``NEAR_TIE`` at the first differing position, measured
  by a cache-free bf16 forward over the AR sequence) - batched bf16 matmuls may flip exact-looking ties;
- sampling (temperature / top-p) runs through the graphs and commits valid tokens.

Run on a GPU machine: python -m pytest -q -m gpu tests/test_gpu.py
"""
from __future__ import annotations

import pytest
import torch
from conftest import CHAT_QUESTIONS, encode_chat, make_drafter

from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.models.target import TargetModel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW_TOKENS = 96
#: bf16 has 8 significant bits: at |logit| ~ 16-32 one ulp is 0.125; a reduction in another order (batch
#: size, verify width) moves a logit by a few ulps, so a gap of up to 0.5 can flip. Larger gaps must not.
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def gpu_target(real_model_dir) -> TargetModel:
    torch.set_num_threads(4)
    return TargetModel.from_pretrained(real_model_dir, dtype=torch.bfloat16, device="cuda")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [encode_chat(tokenizer, q) for q in CHAT_QUESTIONS] * 2  # 16 requests


def _gen(engine, prompts, **kw):
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **kw))
    return [r.output_ids for r in reqs], reqs


def test_graph_equals_eager(gpu_target, prompts):
    """Same engine settings with and without CUDA graphs: identical tokens, γ and accepted counts."""
    drafter, head = make_drafter(gpu_target, block_size=16, layers=1, policy="direct", seed=1)
    runs = []
    for graphs in (False, True):
        eng = SpecEngine(gpu_target, drafter, head, max_batch_size=16, max_seq_len=512, use_cuda_graph=graphs)
        out, reqs = _gen(eng, prompts)
        runs.append((out, [r.draft_lens for r in reqs], [r.num_accepted for r in reqs]))
        if graphs:
            assert len(eng.runner.graphs) > 0  # the graph path really ran
    assert runs[0] == runs[1]


def test_prefill_graphs_equal_eager_prefills(gpu_target, prompts):
    """``prefill_buckets`` with CUDA graphs (4 slots, 16 requests: prefills of several sizes, each shape captured
    after its first eager prefill, replayed after; junk tensors of the inputs' sizes allocated between passes)
    against the same padded prefills without graphs: identical tokens, γ and accepted counts; graphs captured,
    counted and replayed."""
    drafter, head = make_drafter(gpu_target, block_size=16, layers=1, policy="direct", seed=1)
    runs = []
    for graphs in (False, True):
        eng = SpecEngine(gpu_target, drafter, head, max_batch_size=4, max_seq_len=512, use_cuda_graph=graphs,
                         prefill_buckets=True)
        for _ in range(2):  # the second pass replays the shapes the first one captured
            out, reqs = _gen(eng, prompts)
            runs.append((graphs, out, [r.draft_lens for r in reqs], [r.num_accepted for r in reqs]))
            # fresh allocations of every captured input's size, filled with junk: a graph that lost an input buffer
            # to the allocator would read them on its next replay
            junk = [torch.full((n, length), 200, dtype=torch.long, device="cuda")
                    for n, length in eng.runner._prefill_graphs for _ in range(3)]
        del junk
        if graphs:
            assert eng.runner._prefill_graphs and eng.stats.num_prefill_captures == len(eng.runner._prefill_graphs)
            assert eng.runner.prefill_replays > 0
    assert runs[0][1:] == runs[1][1:] == runs[2][1:] == runs[3][1:]


def test_bf16_lossless_near_ties(gpu_target, prompts):
    """Greedy spec (random drafter, γ varying) vs AR on the same engine: match rate reported, each
    divergence at a near tie of the target (gap <= NEAR_TIE)."""
    drafter, head = make_drafter(gpu_target, block_size=16, layers=1, policy="direct", seed=2)
    eng = SpecEngine(gpu_target, drafter, head, max_batch_size=16, max_seq_len=512)
    ar, _ = _gen(eng, prompts)
    spec_eng = SpecEngine(gpu_target, drafter, head, max_batch_size=16, max_seq_len=512)
    # a perfect-ish drafter is not needed: varying γ changes the verify width, which is what can flip ties
    spec, reqs = _gen(spec_eng, prompts)
    assert spec_eng.stats.num_verify_steps > 0
    assert len({g for r in reqs for g in r.draft_lens}) > 1
    mismatched = [i for i in range(len(ar)) if ar[i] != spec[i]]
    print(f"bf16 greedy match rate {1 - len(mismatched) / len(ar):.3f} ({len(ar) - len(mismatched)}/{len(ar)})")
    for i in mismatched:
        j = next(k for k in range(NEW_TOKENS) if ar[i][k] != spec[i][k])
        seq = torch.tensor([prompts[i] + ar[i][:j]], device="cuda")
        with torch.no_grad():
            logits = gpu_target(seq, torch.arange(seq.shape[1], device="cuda")[None]).logits[0, -1]
        top2 = logits.topk(2)
        gap = float(top2.values[0] - top2.values[1])
        print(f"request {i}: first divergence at output {j}, top-2 gap {gap:.4f}")
        assert gap <= NEAR_TIE, (i, j, gap)
        assert {ar[i][j], spec[i][j]} <= set(top2.indices.tolist())


def test_sampling_through_graphs(gpu_target, prompts):
    """temperature 0.8 / top_p 0.9 mixed with greedy rows in one batch: tokens in the vocabulary, the
    greedy rows equal the greedy-only run (rows do not leak into each other)."""
    drafter, head = make_drafter(gpu_target, block_size=8, layers=1, policy="fixed", seed=3)
    eng = SpecEngine(gpu_target, drafter, None, policy="fixed", max_batch_size=16, max_seq_len=512)
    greedy, _ = _gen(eng, prompts[:4])
    eng2 = SpecEngine(gpu_target, drafter, None, policy="fixed", max_batch_size=16, max_seq_len=512)
    reqs = [eng2.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                               temperature=0.0 if i < 4 else 0.8, top_p=1.0 if i < 4 else 0.9))
            for i, p in enumerate(prompts[:4] + prompts[:4])]
    while eng2.has_unfinished():
        eng2.step()
    vocab = gpu_target.config.vocab_size
    assert all(len(r.output_ids) == NEW_TOKENS and 0 <= min(r.output_ids) and max(r.output_ids) < vocab for r in reqs)
    same = sum(r.output_ids == g for r, g in zip(reqs[:4], greedy))
    assert same >= 3, same  # bf16: another batch shape may flip one near tie; more means rows leak
    assert any(r.output_ids != g for r, g in zip(reqs[4:], greedy))  # sampling really sampled



def test_cost_policy_graphs_tiny():
    """The ``cost`` length policy on CUDA graphs (a tiny random fp32 target, so it needs no model files):
    calibration measures a finite positive cost for every (batch bucket, γ), the steps run through captured
    graphs, and greedy output equals AR token for token (fp32: no near ties)."""
    from conftest import make_tiny_target

    target = make_tiny_target("llama", logit_scale=4.0).to("cuda")
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=4, max_seq_len=256)
    table = eng.cost_table
    assert len(table["costs_ms"]) == len(table["batch_sizes"]) and all(len(r) == 7 for r in table["costs_ms"])
    assert all(0 < c < 1e3 for r in table["costs_ms"] for c in r), table
    print("cost table (ms)", table)
    spec, reqs = _gen(eng, prompts)
    assert len(eng.runner.graphs) > 0 and eng.stats.num_verify_steps > 0
    print("γ chosen", sorted({d for r in reqs for d in r.draft_lens}))
    # a new cost table (other batch sizes) drops the captured step graphs: they are captured again, into a fresh
    # pool, and agree
    eng.calibrate_costs(batch_sizes=[1, 2])
    assert eng.runner.length_policy.batch_sizes == [1, 2] and len(eng.runner.graphs) == 0
    again, _ = _gen(eng, prompts)
    assert len(eng.runner.graphs) > 0 and again == spec
    ar_eng = SpecEngine(target, None, None, max_batch_size=4, max_seq_len=256)
    ar = [r.output_ids for r in ar_eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                                mode="ar")]
    assert spec == ar


def test_cost_policy_ar_steps_graphs_tiny():
    """The ``cost`` policy's γ = 0 on CUDA graphs (tiny random fp32 target): calibration measures an AR step per
    batch bucket; with AR cheap the engine steps without proposing (graphs keyed by ``propose``), probes, goes back
    to drafting when the costs say so, and greedy output equals AR token for token throughout."""
    from conftest import make_tiny_target

    target = make_tiny_target("llama", logit_scale=4.0).to("cuda")
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5, head_prior=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=4, max_seq_len=256, probe_every=2)
    table = eng.cost_table
    assert len(table["ar_costs_ms"]) == len(table["batch_sizes"]) and all(0 < c < 1e3 for c in table["ar_costs_ms"])
    print("cost table (ms)", table)
    pol, nb = eng.runner.length_policy, len(table["batch_sizes"])
    pol.set_costs(table["batch_sizes"], torch.full((nb, 7), 100.0), torch.ones(nb))  # AR always pays
    ar_first, reqs = _gen(eng, prompts)
    assert {d for r in reqs for d in r.draft_lens} == {0}
    assert any(k[-1] is False for k in eng.runner.graphs)  # AR steps ran through their own graphs
    pol.set_costs(table["batch_sizes"], torch.ones(nb, 7), torch.full((nb,), 100.0))  # drafting always pays
    drafted, reqs = _gen(eng, prompts)
    assert any(d > 0 for r in reqs for d in r.draft_lens)
    ar_eng = SpecEngine(target, None, None, max_batch_size=4, max_seq_len=256)
    ar = [r.output_ids for r in ar_eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                                mode="ar")]
    assert ar_first == ar and drafted == ar


def test_catch_up_context_graphs_match_eager_tiny():
    """The drafter-context catch-up on CUDA graphs (padded to a power-of-two bucket by repeating the last entry, then
    a replay) writes the same context K/V as the eager append of the unpadded positions (tiny random fp32 target);
    the second catch-up of a bucket replays its captured graph."""
    from conftest import make_tiny_target

    target = make_tiny_target("llama").to("cuda")
    drafter, head = make_drafter(target, block_size=8, layers=2, policy="cost", seed=3)
    engs = [SpecEngine(target, drafter, head, policy="cost", max_batch_size=4, max_seq_len=256, calibrate=False,
                       use_cuda_graph=g) for g in (True, False)]
    g = torch.Generator(device="cuda").manual_seed(0)
    feats = torch.randn(engs[0].runner.feat_hist.shape, generator=g, device="cuda")
    for e in engs:
        e.runner.feat_hist.copy_(feats)
    for spans in ([(0, 0, 37), (2, 5, 60)], [(0, 37, 41), (1, 0, 3), (3, 10, 70)], [(2, 60, 90)],
                  [(1, 3, 20)]):
        for e in engs:
            e.runner.catch_up_context(spans)
    graphed, eager = engs[0].runner, engs[1].runner
    assert sorted(graphed._catch_up_graphs) == [64, 128] and all(v[3] is not None
                                                                 for v in graphed._catch_up_graphs.values())
    assert graphed.ctx_len == eager.ctx_len == [41, 20, 90, 70]
    torch.testing.assert_close(graphed.ctx.k, eager.ctx.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(graphed.ctx.v, eager.ctx.v, rtol=1e-5, atol=1e-5)


def test_bucket_policy_graphs_tiny():
    """The ``bucket`` length policy (the seed guide's head on the target's state at the anchor) through CUDA
    graphs on a tiny random fp32 target: the steps run through captured graphs, the head's γ varies, every γ is a
    bucket - 1 or the budget's cap, and greedy output equals AR token for token (fp32: no near ties)."""
    from conftest import make_tiny_target

    from adaflash_ray.models.length_head import bucket_sizes

    target = make_tiny_target("llama", logit_scale=4.0).to("cuda")
    drafter, head = make_drafter(target, block_size=16, layers=1, policy="bucket", seed=5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    eng = SpecEngine(target, drafter, head, policy="bucket", max_batch_size=4, max_seq_len=256)
    spec, reqs = _gen(eng, prompts)
    assert len(eng.runner.graphs) > 0 and eng.stats.num_verify_steps > 0
    chosen = sorted({d for r in reqs for d in r.draft_lens})
    print("γ chosen", chosen)
    allowed = {s - 1 for s in bucket_sizes(16)}
    assert len(set(chosen) & allowed) > 1, chosen
    for r in reqs:
        remaining = NEW_TOKENS - 1
        for drafted, accepted in zip(r.draft_lens, r.num_accepted):
            cap = max(remaining - 1, 0)
            assert drafted in allowed and drafted <= cap or drafted == cap, (drafted, cap)
            remaining -= accepted + 1
    ar_eng = SpecEngine(target, None, None, max_batch_size=4, max_seq_len=256)
    ar = [r.output_ids for r in ar_eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                                mode="ar")]
    assert spec == ar
    # the same engine without graphs chooses the same γ (the head reads the same anchor states)
    eager = SpecEngine(target, drafter, head, policy="bucket", max_batch_size=4, max_seq_len=256,
                       use_cuda_graph=False)
    out, reqs_eager = _gen(eager, prompts)
    assert out == ar and [r.draft_lens for r in reqs_eager] == [r.draft_lens for r in reqs]


# ------------------------------------------------------------------ fused distillation loss (kernels/)
# The Triton backend of adaflash_ray.kernels.fused_distill against its pure-torch backend (same bf16 logits GEMMs,
# per-row math in fp32 either way) and against the original computation (mixture_rkl_loss impl="reference"),
# at SmolLM2's head shape (V = 49,152, H = 576). Tolerances: bf16 logits are shared, so the backends differ only
# by fp32 summation order (1e-4 relative) and by bf16 rounding of dL/dz before the input-gradient GEMM (1e-2
# relative Frobenius norm of the gradient).
FUSED_CASES = [(1.0, 10.0, "per_token", "reverse"), (0.7, 0.01, "reference", "reverse"),
               (1.0, 0.3, "per_token", "reverse"), (1.0, float("inf"), "per_token", "forward")]


def _head_rows(m: int, dtype=torch.bfloat16, h: int = 576, v: int = 49152, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (0.2 * torch.randn(v, h, device="cuda", generator=g)).to(dtype)  # logit std ~5: peaked softmaxes
    ht = torch.randn(m, h, device="cuda", generator=g)
    hs = ht + 0.5 * torch.randn(m, h, device="cuda", generator=g)
    weights = torch.rand(m, device="cuda", generator=g) * (torch.rand(m, device="cuda", generator=g) > 0.2)
    return hs, ht, w, weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("temperature,clip,clip_mode,direction", FUSED_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_loss_triton_matches_torch_backend(temperature, clip, clip_mode, direction, dtype):
    from adaflash_ray.kernels.fused_distill import fused_distill_loss

    hs0, ht, w, weights = _head_rows(3000, dtype)  # 3 uneven chunks of 1024
    res = {}
    for backend in ("torch", "triton"):
        x = hs0.clone().requires_grad_(True)
        loss, stats = fused_distill_loss(x, ht, w, weights, alpha=0.8, temperature=temperature, clip=clip,
                                         clip_mode=clip_mode, direction=direction, chunk_size=1024, want_conf=True,
                                         backend=backend)
        loss.backward()
        res[backend] = (loss.detach(), stats, x.grad)
    (l0, (ce0, d0, sa0, ta0, c0), g0), (l1, (ce1, d1, sa1, ta1, c1), g1) = res["torch"], res["triton"]
    assert float(l1) == pytest.approx(float(l0), rel=1e-4)
    assert _rel(g1, g0) < (1e-2 if dtype == torch.bfloat16 else 1e-4)
    torch.testing.assert_close(ce1, ce0, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(d1, d0, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(c1, c0, atol=1e-3, rtol=1e-3)
    assert float((sa1 == sa0).float().mean()) > 0.999 and float((ta1 == ta0).float().mean()) > 0.999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_loss_weights_fn_triton_matches_torch(dtype):
    """Weights from the loss's own pass (token_ids + weights_fn: the kernel's token log-probabilities, D-PACE-like
    and boost-like dependence) agree between the Triton and torch backends."""
    from adaflash_ray.kernels.fused_distill import fused_distill_loss

    hs0, ht, w, weights = _head_rows(3000, dtype)
    tok = torch.randint(0, w.shape[0], (3000,), device=hs0.device, generator=torch.Generator(hs0.device).manual_seed(2))
    res = {}
    for backend in ("torch", "triton"):
        x = hs0.clone().requires_grad_(True)
        used = torch.empty(3000, device=hs0.device)
        loss, _ = fused_distill_loss(x, ht, w, weights, alpha=0.8, temperature=1.0, clip=10.0, chunk_size=1024,
                                     backend=backend, token_ids=tok, weights_out=used,
                                     weights_fn=lambda t1, p: weights * (0.5 + p) * (1.0 + (t1 != tok).float()))
        loss.backward()
        res[backend] = (loss.detach(), used, x.grad)
    (l0, u0, g0), (l1, u1, g1) = res["torch"], res["triton"]
    assert float(l1) == pytest.approx(float(l0), rel=1e-4)
    torch.testing.assert_close(u1, u0, atol=1e-3, rtol=1e-3)
    assert _rel(g1, g0) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("temperature,clip,clip_mode", [(1.0, 10.0, "per_token"), (0.7, 0.01, "reference")])
def test_fused_loss_matches_reference_impl(temperature, clip, clip_mode):
    """mixture_rkl_loss with impl="triton" / "torch" against the original computation (impl="reference"), bf16."""
    from adaflash_ray.distill.losses import mixture_rkl_loss

    hs0, ht, w, weights = _head_rows(2500, seed=1)
    res = {}
    for impl in ("reference", "torch", "triton"):
        x = hs0.clone().requires_grad_(True)
        conf = torch.empty(2500, 2, device="cuda")
        loss, metrics = mixture_rkl_loss(x, ht, w, weights, alpha=0.8, temperature=temperature, clip=clip,
                                         clip_mode=clip_mode, chunk_size=1024, confidence_out=conf, impl=impl)
        loss.backward()
        res[impl] = (float(loss.detach()), metrics, x.grad, conf)
    l0, m0, g0, c0 = res["reference"]
    for impl in ("torch", "triton"):
        l1, m1, g1, c1 = res[impl]
        assert l1 == pytest.approx(l0, rel=1e-3), impl
        assert m1 == pytest.approx(m0, rel=2e-3, abs=2e-3), impl
        assert _rel(g1, g0) < 2e-2, impl
        torch.testing.assert_close(c1, c0, atol=1e-3, rtol=1e-3)


def test_bf16_train_step_matches_fp32_step_tiny():
    """One trainer step of a tiny drafter on CUDA: ``distill.compute_dtype`` bfloat16 (the CUDA default) runs the
    drafter's projections in bf16, keeps float32 weights, and its loss is within 3% of the float32 step's (same
    seed, same anchors, same trajectories)."""
    import dataclasses
    import os

    from test_distill import _cfgs, _greedy_trajectories, make_distill_target

    from adaflash_ray.distill.trainer import DistillTrainerCore

    target = make_distill_target()
    trajs = _greedy_trajectories(target, num=3, num_new=24, seed=4, dtype=torch.float32)
    target = target.to("cuda")
    trajs = [dataclasses.replace(t, features=t.features.cuda(), last_hidden=t.last_hidden.cuda()) for t in trajs]
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")):
        DistillTrainerCore.setup_dist_env(0, 1)
    fp32 = DistillTrainerCore(target, *_cfgs(compute_dtype="float32"), seed=5)
    bf16 = DistillTrainerCore(target, *_cfgs(), seed=5)  # auto: bfloat16 on CUDA
    assert fp32.compute_dtype is None and bf16.compute_dtype is torch.bfloat16
    seen = []
    hook = bf16.drafter.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        a, b = fp32.train_step(trajs), bf16.train_step(trajs)
    finally:
        hook.remove()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in bf16.module.parameters())
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=3e-2)
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=0.1)


def test_recompute_causal_features_match_target_forward():
    """The trainer's CUDA recompute path (SDPA is_causal, fused projections; also its Triton-kernel and its
    torch.compile variants) against the target's masked forward, bf16, a random target of 4 layers with grouped KV
    heads and right-padded rows."""
    from adaflash_ray.distill.blocks import causal_features, recompute_features
    from adaflash_ray.models.target import TargetConfig

    cfg = TargetConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_ids=[])
    torch.manual_seed(0)
    target = TargetModel(cfg).to("cuda", torch.bfloat16).requires_grad_(False).eval()
    ids = torch.randint(0, 256, (3, 200), device="cuda")
    pos = torch.arange(200, device="cuda")[None].expand(3, -1)
    ref = target(ids, pos, capture_layer_ids=[1, 3], compute_logits=False)
    for layer in target.model.layers:  # as DistillTrainerCore does on CUDA (the fused variant needs it)
        layer.self_attn.fuse()
        layer.mlp.fuse()
    modes = (dict(fused=False), dict(fused=True), dict(compiled=True))  # compiled: torch.compile around attention
    for mode in modes:
        f, h = causal_features(target, ids, [1, 3], **mode)
        for got, want in ((f, ref.features), (h, ref.last_hidden)):
            assert _rel(got.float(), want.float()) < 2e-2, mode
    seqs = [torch.randint(0, 256, (n,)) for n in (120, 201, 64)]
    runs = [dict(layout=layout, pad_multiple=pad, **mode) for layout in ("padded", "packed")
            for mode in modes for pad in (1, 128)]  # packed: variable-length flash attention
    for kw in runs:
        for s, (fs, hs) in zip(seqs, recompute_features(target, seqs, [1, 3], **kw)):
            r = target(s[None, :-1].cuda(), torch.arange(len(s) - 1, device="cuda")[None], capture_layer_ids=[1, 3],
                       compute_logits=False)
            assert fs.shape == r.features[0].shape, kw
            assert _rel(fs.float(), r.features[0].float()) < 2e-2, kw
            assert _rel(hs.float(), r.last_hidden[0].float()) < 2e-2, kw


def test_drafter_flex_attention_matches_sdpa_cuda():
    """The drafter's training forward with compiled flex attention (the block mask of ``flex_block_mask``, the
    context padded to whole tiles), alone and inside ``compile_training``'s layer graphs, against the explicit-mask
    SDPA forward on CUDA, float32: values and the gradients into the features and the weights."""
    import dataclasses

    from test_distill import _cfgs, _greedy_trajectories, make_distill_target

    from adaflash_ray.distill.blocks import collate
    from adaflash_ray.models.factory import build_drafter
    from adaflash_ray.models.target import TargetModel

    # flex attention (torch >= 2.11) needs head_dim >= 16: make_distill_target's 4 heads of 8 dims become 2 of 16
    base = make_distill_target()
    target = TargetModel(dataclasses.replace(base.config, num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # make_distill_target's init: unit norms, N(0, 0.5²) embeddings / head, N(0, 0.1²) else
        for name, p in target.named_parameters():
            std = 0.5 if "embed_tokens" in name or "lm_head" in name else 0.1
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * std)
    target = target.requires_grad_(False).eval()
    trajs = _greedy_trajectories(target, num=3, num_new=24, seed=4, dtype=torch.float32)
    target = target.to("cuda")
    trajs = [dataclasses.replace(t, features=t.features.cuda(), last_hidden=t.last_hidden.cuda()) for t in trajs]
    drafter_cfg, head_cfg, _ = _cfgs()
    drafter, _ = build_drafter(target, drafter_cfg, head_cfg, 0)
    drafter = drafter.float().cuda()
    batch = collate(trajs, num_anchors=8, block_size=drafter.block_size, generator=torch.Generator().manual_seed(2))
    outs = []
    for attention, compiled in (("sdpa", False), ("flex", False), ("flex", True)):  # True: compile_training's graphs
        drafter.compile_training(compiled)
        drafter.zero_grad()
        feats = batch.features.clone().requires_grad_(True)
        h = drafter.forward_train(feats, batch.input_ids, batch.anchors, attention=attention)
        h.square().sum().backward()
        outs.append((h.detach(), feats.grad, drafter.fc.weight.grad.clone()))
    # the compiled flex kernels may run their float32 matmuls at TF32 precision (10-bit mantissa, ~1e-3 relative):
    # on the H200 the worst of the three tensors differed by 1.2e-3 from SDPA's; a wrong mask differs by O(1)
    for out in outs[1:]:
        for got, want in zip(out, outs[0]):
            assert _rel(got, want) < 5e-3


def _lookup_case():
    """A tiny random fp32 target on CUDA, 4 prompts (the first repeated: prompt lookup finds matches) and their AR
    greedy outputs."""
    from conftest import make_tiny_target

    target = make_tiny_target("llama", logit_scale=4.0).to("cuda")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    prompts[0] = prompts[0] * 4
    ar_eng = SpecEngine(target, None, None, max_batch_size=4, max_seq_len=256)
    ar = [r.output_ids for r in ar_eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                                mode="ar")]
    return target, prompts, ar


def test_lookup_and_hybrid_greedy_equal_ar_graphs_tiny():
    """Draft sources through CUDA graphs (tiny random fp32 target): prompt lookup alone (no drafter) and the hybrid
    (DFlash block + suffix lookup, cost table measured here, the corpus holding an earlier pass's sequences) give
    greedy output equal to AR token for token; lookup rows ran through host-draft graphs and were accepted."""
    target, prompts, ar = _lookup_case()
    ngram = SpecEngine(target, None, None, max_batch_size=4, max_seq_len=256, draft_sources=("ngram",))
    out, _ = _gen(ngram, prompts)
    assert out == ar
    assert any(k.host_drafts for k in ngram.runner.graphs) and ngram.stats.source_hist["ngram"] > 0
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5)
    hybrid = SpecEngine(target, drafter, head, policy="cost", max_batch_size=4, max_seq_len=256,
                        draft_sources=("dflash", "suffix"))
    assert len(hybrid.cost_table["lookup_costs_ms"][0]) == hybrid.runner.max_draft + 1
    first, _ = _gen(hybrid, prompts)
    second, reqs = _gen(hybrid, prompts)  # the corpus now holds the first pass: the suffix source pays
    assert first == ar and second == ar
    print("hybrid sources", dict(hybrid.stats.source_hist), "tau", hybrid.stats.accept_len)
    assert hybrid.stats.source_hist["suffix"] > 0 and hybrid.stats.accept_len > 1.0


@pytest.mark.parametrize("sources", [("ngram",), ("suffix",), ("dflash", "suffix")])
def test_device_lookup_graphs_greedy_equal_ar_tiny(sources):
    """The device lookup through CUDA graphs (tiny random fp32 target, ``lookup_device="device"``): prompt lookup,
    suffix lookup (corpus ring holding an earlier pass) and the hybrid give greedy output equal to AR token for token
    in both passes; the steps' graphs proposed lookups on the device (StepKey.lookup) and lookup rows were accepted;
    the same engine on the host path gives the same tokens."""
    target, prompts, ar = _lookup_case()
    for where in ("device", "host"):
        if "dflash" in sources:
            drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5)
            eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=4, max_seq_len=256,
                             draft_sources=sources, lookup_device=where)
        else:
            eng = SpecEngine(target, None, None, max_batch_size=4, max_seq_len=256, draft_sources=sources,
                             lookup_device=where)
        assert eng.lookup_on_device == (where == "device")
        first, _ = _gen(eng, prompts)
        second, _ = _gen(eng, prompts)
        assert first == ar and second == ar, where
        print(where, sources, dict(eng.stats.source_hist), "tau", eng.stats.accept_len)
        assert eng.stats.source_hist[sources[-1]] > 0
        if where == "device":
            assert any(k.lookup for k in eng.runner.graphs) and any(k.host_drafts for k in eng.runner.graphs)


def test_precaptured_graphs_serve_without_capture_and_equal_ar_tiny():
    """SpecEngine.precapture_graphs on the hybrid with device lookups (tiny random fp32 target): after two passes it
    captures every kind of step the passes ran at every batch bucket x width bucket x span (ModelRunner.graph_grid)
    and the drafter-context catch-up graphs up to the runner's 4 x 256 positions, without running them (outputs of
    the next passes still equal AR token for token); a later pass then captures a step graph only for a kind of step
    never run before."""
    target, prompts, ar = _lookup_case()
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(target, drafter, head, policy="cost", max_batch_size=4, max_seq_len=256,
                     draft_sources=("dflash", "suffix"), lookup_device="device")
    for _ in range(2):  # the second pass meets the first one's sequences in the corpus: more lookup rows
        out, _ = _gen(eng, prompts)
        assert out == ar
    grid = eng.runner.graph_grid()
    kind = lambda k: k._replace(batch_size=0, width=0, span=0)  # noqa: E731
    kinds = {kind(k) for k in eng.runner.graphs}
    assert set(grid) >= set(eng.runner.graphs) and len(grid) >= len(kinds) * len(eng.runner._batch_buckets)
    seen = set(eng.runner.graphs)
    cu_seen = set(eng.runner._catch_up_graphs)
    got = eng.precapture_graphs()
    assert got["graphs"] == len(set(grid) - seen) > 0 and got["stopped"] is None and got["grid"] == len(grid)
    sizes = {64 << i for i in range(5)}  # 64 .. 1024 = 4 slots x 256: the drafter-context catch-up graphs, unrun
    assert got["catch_up_graphs"] == len(sizes - cu_seen) and sizes <= set(eng.runner._catch_up_graphs)
    # every graph captured so far was uploaded at capture (step, prefill and catch-up graphs): the PyTorch build
    # links the CUDA runtime dynamically, so graph_upload finds cudaGraphUpload
    assert got["uploaded"] == eng.runner.num_uploaded >= len(eng.runner.graphs) + len(eng.runner._catch_up_graphs)
    again = eng.precapture_graphs()
    assert set(grid) <= set(eng.runner.graphs) and again["graphs"] == 0 and again["catch_up_graphs"] == 0
    before = set(eng.runner.graphs)
    firsts, replayed = eng.stats.num_first_replays, set(eng.runner._replayed)
    third, _ = _gen(eng, prompts)
    assert third == ar
    assert all(kind(k) not in kinds for k in set(eng.runner.graphs) - before)  # only a kind never run before captures
    reqs = eng.generate(prompts[:3], [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 40, 70)])
    assert [r.output_ids for r in reqs] == [a[:n] for a, n in zip(ar, (5, 40, 70))]
    # a step counts the first replay of a graph it did not capture: since precapture, exactly the precaptured graphs
    # replayed for the first time (one step each; the graphs captured since were replayed in their capture steps)
    runner = eng.runner
    assert runner._replayed <= set(runner.graphs)
    assert eng.stats.num_first_replays - firsts == len((runner._replayed - replayed) & before)
    # a precaptured graph never replayed, replayed here by hand (last in the test: it runs a made-up step's buffers)
    fresh = next((k for k in runner.graphs if k not in runner._replayed), None)
    assert fresh is not None
    runner.step_first_replay = False
    runner._run(fresh)
    assert runner.step_first_replay and fresh in runner._replayed
    runner.step_first_replay = False
    runner._run(fresh)
    torch.cuda.synchronize()  # a fault of the hand-made replays surfaces here, not in a later test
    assert not runner.step_first_replay


def test_device_lookup_triton_kernels_equal_tensor_ops_cuda():
    """The device lookup's Triton kernels on CUDA == its tensor ops (packed proposals and drafts), random states; an
    engine on CUDA picks them (``kernel="auto"``)."""
    from test_lookup import compare_lookup_kernels

    from adaflash_ray.engine.device_lookup import DeviceLookup

    assert compare_lookup_kernels("cuda", cases=120, seed=1) == 120
    assert DeviceLookup(2, 16, 4, "cuda", corpus_tokens=16).use_triton
