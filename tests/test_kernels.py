"""Tests of adaflash_ray.kernels.fused_distill (the fused weighted mixture-distillation loss) on CPU.

- the ``torch`` backend against a naive float64 autograd reference (full ``[M, V]`` logits, per-row loss,
  ``torch.clamp``): loss and input gradient for several chunk sizes, per-position weights (zeros included),
  both clip modes with the clamp active on some rows, T != 1, reverse and forward KL;
- against the original computation (:func:`mixture_rkl_loss` with ``impl="reference"``) in float32: loss,
  every metric, the argmax / confidence outputs and the gradient, also through the trainer's
  :class:`DistillModule` (drafter parameter gradients);
- edge cases (no rows, zero weights), argument errors, and ``auto`` resolving to ``reference`` on CPU (the CPU
  default keeps the original numbers, tests/test_golden.py);
- the Triton kernel under Triton's CPU interpreter (``TRITON_INTERPRET=1``, a subprocess) against the ``torch``
  backend; skipped when triton is not installed. The CUDA comparisons are in tests/test_gpu.py.

Run: python -m pytest -q tests/test_kernels.py   (CPU, ~15 s; + ~20 s with triton installed)
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from adaflash_ray.config import DistillConfig
from adaflash_ray.distill.losses import forward_kl_loss, mixture_rkl_loss
from adaflash_ray.kernels.fused_distill import fused_distill_loss, resolve_loss_impl

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _rows(m=29, h=12, v=40, seed=0, dtype=torch.float64, spread=0.7):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g, dtype=dtype)
    ht = torch.randn(m, h, generator=g, dtype=dtype)
    hs = ht + spread * torch.randn(m, h, generator=g, dtype=dtype)
    weights = (torch.rand(m, generator=g, dtype=dtype) * (torch.rand(m, generator=g) > 0.25)).to(dtype)
    return hs, ht, w, weights


def naive_loss(hs, ht, w, weights, alpha, temperature, clip, clip_mode, direction):
    """Full logits, autograd, torch.clamp: the definition in adaflash_ray/kernels/fused_distill.py."""
    zs, zt = hs @ w.t(), (ht @ w.t()).detach()
    t = zt.argmax(-1)
    ce = torch.logsumexp(zs, -1) - zs.gather(1, t[:, None]).squeeze(1)
    ls, lt = torch.log_softmax(zs / temperature, -1), torch.log_softmax(zt / temperature, -1)
    if direction == "reverse":
        div = temperature ** 2 * (ls.exp() * (ls - lt)).sum(-1)
    else:
        div = temperature ** 2 * (lt.exp() * (lt - ls)).sum(-1)
    den = weights.sum().clamp_min(1e-12)
    if clip_mode == "per_token":
        d = (weights * div.clamp(max=clip)).sum() / den
    else:
        d = (weights * (div / den).clamp(max=clip)).sum()
    return alpha * (weights * ce).sum() / den + (1 - alpha) * d, ce, div


CASES = [  # (alpha, temperature, clip, clip_mode, direction)
    (0.8, 1.0, 10.0, "per_token", "reverse"),
    (0.8, 1.0, 0.4, "per_token", "reverse"),  # clamp active on some rows
    (0.5, 0.7, 0.6, "per_token", "reverse"),
    (0.8, 1.0, 0.01, "reference", "reverse"),  # AdaFlash's tau = 0.01 on RKL_i / sum(w)
    (0.3, 1.6, 0.02, "reference", "reverse"),
    (0.0, 1.0, float("inf"), "per_token", "forward"),  # the OSD forward KL
    (0.6, 0.8, 0.5, "per_token", "forward"),
]


@pytest.mark.parametrize("alpha,temperature,clip,clip_mode,direction", CASES)
def test_torch_backend_matches_naive_float64(alpha, temperature, clip, clip_mode, direction):
    hs0, ht, w, weights = _rows()
    ref_h = hs0.clone().requires_grad_(True)
    ref, ce, div = naive_loss(ref_h, ht, w, weights, alpha, temperature, clip, clip_mode, direction)
    ref.backward()
    lim = div if clip_mode == "per_token" else div / weights.sum()
    if clip < 1.0:
        assert 0 < int((lim > clip).sum()) < len(lim)  # the case exercises both sides of the clamp
    for chunk in (1, 4, 7, 1000):
        h = hs0.clone().requires_grad_(True)
        loss, (c, d, s_arg, t_arg, conf) = fused_distill_loss(
            h, ht, w, weights, alpha=alpha, temperature=temperature, clip=clip, clip_mode=clip_mode,
            direction=direction, chunk_size=chunk, want_conf=True)
        (2.5 * loss).backward()
        torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(h.grad, 2.5 * ref_h.grad, atol=1e-9, rtol=1e-7)
        torch.testing.assert_close(c.double(), ce.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.double(), div.detach(), atol=1e-5, rtol=1e-5)
        zs = hs0 @ w.t()
        assert torch.equal(s_arg, zs.argmax(-1)) and torch.equal(t_arg, (ht @ w.t()).argmax(-1))
        p = torch.softmax(zs, -1)
        torch.testing.assert_close(conf[:, 0].double(), p.max(-1).values, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(conf[:, 1].double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("clip_mode,clip,temperature", [("per_token", 10.0, 1.0), ("per_token", 0.5, 0.7),
                                                        ("reference", 0.01, 1.0)])
def test_mixture_impls_agree_float32(clip_mode, clip, temperature):
    """impl="torch" against the original computation (impl="reference"): loss, metrics, outputs, gradient."""
    hs0, ht, w, weights = _rows(m=41, h=16, v=64, seed=3, dtype=torch.float32)
    out = {}
    for impl in ("reference", "torch"):
        for chunk in (5, 1024):
            h = hs0.clone().requires_grad_(True)
            s_arg = torch.empty(41, dtype=torch.long)
            conf = torch.empty(41, 2)
            loss, metrics = mixture_rkl_loss(h, ht, w, weights, alpha=0.8, temperature=temperature, clip=clip,
                                             clip_mode=clip_mode, chunk_size=chunk, argmax_out=s_arg,
                                             confidence_out=conf, impl=impl)
            loss.backward()
            out[impl, chunk] = (loss.detach(), metrics, s_arg, conf, h.grad)
    base = out["reference", 1024]
    for key, (loss, metrics, s_arg, conf, grad) in out.items():
        torch.testing.assert_close(loss, base[0], atol=2e-6, rtol=2e-6)
        assert metrics.keys() == base[1].keys()
        for k, v in metrics.items():
            assert v == pytest.approx(base[1][k], rel=1e-5, abs=1e-6), (key, k)
        assert torch.equal(s_arg, base[2])
        torch.testing.assert_close(conf, base[3], atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(grad, base[4], atol=2e-7, rtol=2e-5)


def test_forward_kl_impls_agree():
    hs0, ht, w, weights = _rows(seed=5, dtype=torch.float32)
    res = []
    for impl in ("reference", "torch"):
        h = hs0.clone().requires_grad_(True)
        loss, metrics = forward_kl_loss(h, ht, w, weights, temperature=0.9, chunk_size=6, impl=impl)
        loss.backward()
        res.append((loss.detach(), metrics, h.grad))
    torch.testing.assert_close(res[0][0], res[1][0], atol=2e-6, rtol=2e-6)
    assert res[0][1] == pytest.approx(res[1][1], rel=1e-5)
    torch.testing.assert_close(res[0][2], res[1][2], atol=2e-7, rtol=2e-5)


def test_weights_fn_from_the_loss_pass_equals_a_separate_pass():
    """mixture_rkl_loss(weights_fn=...): the fused impl takes (student argmax, probability of token_ids) from its own
    vocabulary pass; the reference impl (and the reference clamp) from a separate pass first. Same weights, loss,
    metrics and gradient; a weights_fn needs token_ids."""
    from adaflash_ray.distill.losses import token_stats_rows

    hs0, ht, w, weights = _rows(m=41, h=16, v=64, seed=7, dtype=torch.float32)
    tok = torch.randint(0, 64, (41,), generator=torch.Generator().manual_seed(1))

    def fn(top1, prob):  # depends on both inputs, as D-PACE x reject-boost does
        return weights * (0.5 + prob) * (1.0 + (top1 != tok).float())

    top1, prob = token_stats_rows(hs0, w, tok, chunk_size=7)
    want = fn(top1, prob)
    out = {}
    for impl, mode in (("reference", "per_token"), ("torch", "per_token"), ("explicit", "per_token"),
                       ("reference", "reference"), ("torch", "reference")):
        h = hs0.clone().requires_grad_(True)
        used = torch.empty(41)
        kw = dict(alpha=0.8, temperature=0.9, clip=0.5, clip_mode=mode, chunk_size=5, weights_out=used)
        if impl == "explicit":
            loss, metrics = mixture_rkl_loss(h, ht, w, want, impl="reference", **kw)
        else:
            loss, metrics = mixture_rkl_loss(h, ht, w, weights, impl=impl, token_ids=tok, weights_fn=fn, **kw)
        loss.backward()
        torch.testing.assert_close(used, want, atol=1e-6, rtol=1e-5)
        out[impl, mode] = (loss.detach(), metrics, h.grad)
    for mode in ("per_token", "reference"):
        base = out["reference", mode]
        for key in [k for k in out if k[1] == mode]:
            loss, metrics, grad = out[key]
            torch.testing.assert_close(loss, base[0], atol=2e-6, rtol=2e-6)
            assert metrics == pytest.approx(base[1], rel=1e-5, abs=1e-6), key
            torch.testing.assert_close(grad, base[2], atol=2e-7, rtol=2e-5)
    with pytest.raises(ValueError, match="token_ids"):
        mixture_rkl_loss(hs0, ht, w, weights, impl="torch", weights_fn=fn)
    with pytest.raises(ValueError, match="per_token"):
        fused_distill_loss(hs0, ht, w, weights, clip_mode="reference", token_ids=tok, weights_fn=fn)


@pytest.mark.parametrize("weighting,boost", [("exp_decay", 0.0), ("dpace", 1.0)])
def test_distill_module_impls_agree(tiny_target, weighting, boost):
    """The trainer's whole forward (drafter + loss + cost head) gives the same loss and drafter gradients, also with
    D-PACE weights and a rejection boost (fused: from the loss's own pass; reference: a separate pass)."""
    from conftest import make_drafter

    from adaflash_ray.config import LengthHeadConfig
    from adaflash_ray.distill.blocks import collate, with_recomputed_features
    from adaflash_ray.distill.trainer import DistillModule
    from adaflash_ray.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    trajs = [Trajectory(f"r{i}", torch.randint(0, 128, (40 + 3 * i,), generator=g), 12, None, None, 0)
             for i in range(3)]
    trajs = with_recomputed_features(tiny_target, trajs, [1, 2])
    batch = collate(trajs, 6, 8, torch.Generator().manual_seed(1))
    results = {}
    for impl in ("reference", "torch"):
        drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=0)
        drafter.requires_grad_(True).train()
        head.requires_grad_(True)
        dcfg = DistillConfig(loss_chunk_size=9, loss_impl=impl, position_weighting=weighting, reject_boost=boost)
        module = DistillModule(drafter, head, tiny_target.lm_head, dcfg, LengthHeadConfig(policy="cost"))
        loss, metrics = module(batch)
        loss.backward()
        results[impl] = (loss.detach(), metrics, {n: p.grad.clone() for n, p in module.named_parameters()
                                                  if p.grad is not None})
    (l0, m0, g0), (l1, m1, g1) = results["reference"], results["torch"]
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    assert m1 == pytest.approx(m0, rel=1e-4, abs=1e-6)
    assert g1.keys() == g0.keys() and len(g0) > 4
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=1e-4, msg=n)


def test_edge_cases_and_errors():
    hs, ht, w, _ = _rows(dtype=torch.float32)
    for rows in (0, 5):  # no rows; rows with zero weight
        h = hs[:rows].clone().requires_grad_(True)
        loss, (ce, div, s_arg, t_arg, conf) = fused_distill_loss(h, ht[:rows], w, torch.zeros(rows))
        loss.backward()
        assert float(loss.detach()) == 0.0 and h.grad is not None and not h.grad.any()
        assert ce.shape == div.shape == s_arg.shape == (rows,) and conf.shape == (rows, 0)
    with pytest.raises(ValueError, match="weights"):
        fused_distill_loss(hs, ht, w, torch.ones(3))
    with pytest.raises(ValueError, match="chunk_size"):
        fused_distill_loss(hs, ht, w, torch.ones(len(hs)), chunk_size=0)
    with pytest.raises(ValueError, match="backend"):
        fused_distill_loss(hs, ht, w, torch.ones(len(hs)), backend="cuda")
    with pytest.raises(ValueError, match="loss_impl"):
        resolve_loss_impl("fast", "cpu")
    assert resolve_loss_impl("auto", "cpu") == "reference"  # the CPU default keeps the original computation
    assert DistillConfig().loss_impl == "auto"
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="triton"):
            resolve_loss_impl("triton", "cpu")


_INTERPRET_SCRIPT = textwrap.dedent("""
    import itertools, torch
    from adaflash_ray.kernels.fused_distill import fused_distill_loss
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    m, h, v = 11, 16, 300                       # v not a multiple of the kernel's block: masked tail
    w = torch.randn(v, h, generator=g); ht = torch.randn(m, h, generator=g)
    hs0 = ht + 0.7 * torch.randn(m, h, generator=g)
    weights = torch.rand(m, generator=g) * (torch.rand(m, generator=g) > 0.2)
    cases = [(1.0, "reverse", "per_token", 10.0), (1.0, "reverse", "per_token", 0.4), (0.7, "reverse", "reference", 0.01),
             (1.0, "forward", "per_token", float("inf")), (1.5, "forward", "per_token", 0.3)]
    for (temp, direction, mode, clip), want_conf in itertools.product(cases, (True, False)):
        res = {}
        for backend in ("torch", "triton"):
            x = hs0.clone().requires_grad_(True)
            loss, stats = fused_distill_loss(x, ht, w, weights, alpha=0.7, temperature=temp, clip=clip, clip_mode=mode,
                                             direction=direction, chunk_size=4, want_conf=want_conf, backend=backend)
            loss.backward()
            res[backend] = (loss.detach(), stats, x.grad)
        (l0, s0, g0), (l1, s1, g1) = res["torch"], res["triton"]
        torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g1, g0, atol=1e-6, rtol=1e-4)
        for a, b in zip(s1, s0):
            if a.is_floating_point():
                torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
            else:
                assert torch.equal(a, b)
    # weights from the loss's own pass (token_ids + weights_fn): the kernel's token log-probabilities
    tok = torch.randint(0, v, (m,), generator=g)
    fn = lambda top1, prob: weights * (0.5 + prob) * (1.0 + (top1 != tok).float())
    res = {}
    for backend in ("torch", "triton"):
        x = hs0.clone().requires_grad_(True)
        used = torch.empty(m)
        loss, _ = fused_distill_loss(x, ht, w, weights, alpha=0.7, temperature=1.3, clip=0.4, chunk_size=4,
                                     backend=backend, token_ids=tok, weights_fn=fn, weights_out=used)
        loss.backward()
        res[backend] = (loss.detach(), used, x.grad)
    for a, b in zip(res["triton"], res["torch"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    print("interpreter ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (optional)")
def test_triton_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "interpreter ok" in out.stdout
