"""The Triton kernels of adaflash_ray/kernels against their pure-torch references.

- ``gpu`` tests (skipped without CUDA or Triton): each kernel in bf16 at the shapes of SmolLM2-135M (hidden 576,
  9 / 3 heads, head_dim 64) and Qwen3-8B (hidden 4096, 32 / 8 heads, head_dim 128, qk-norm), verify widths 1-16;
  a random two-layer target of each shape, fused vs reference forward over the static cache; the fused forward
  captured in a CUDA graph equals its eager run bit for bit.
- a CPU test under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess, since Triton chooses the
  interpreter when a kernel is defined): the same kernels on float32 CPU tensors, and the fused target forward
  on a small random model; and a CPU test that every kernel compiles for sm_90 without spills (both skipped
  when Triton is not installed; it is never a dependency).

Run on a GPU machine: python -m pytest -q -m gpu tests/test_fused_kernels.py
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[1]

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON),
                               reason="needs a CUDA device and triton")

#: (name, hidden, intermediate, heads, kv heads, head_dim, qk_norm)
SHAPES = [("smollm2-135m", 576, 1536, 9, 3, 64, False), ("qwen3-8b", 4096, 12288, 32, 8, 128, True)]


def _close_bf16(a: torch.Tensor, b: torch.Tensor, ulps: float = 2.0) -> None:
    """Equal within ``ulps`` bf16 units (8 significant bits) of each element's magnitude, except at most 0.1% of
    elements (a rounding flip upstream of a cancellation), and those within 2 units of the largest magnitude."""
    a, b = a.float(), b.float()
    err = (a - b).abs()
    tol = ulps * torch.maximum(a.abs(), b.abs()).clamp_min(1e-3) * 2.0 ** -7
    bad = int((err > tol).sum())
    assert bad <= 1e-3 * a.numel(), f"{bad} of {a.numel()} differ; max abs diff {err.max().item()}"
    assert err.max().item() <= 2 * 2.0 ** -7 * b.abs().max().item(), err.max().item()


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("vocab", [49152, 151936])  # SmolLM2, Qwen3
@pytest.mark.parametrize("rows", [15, 64 * 15])
def test_draft_confidence_gpu(vocab, rows):
    """The acceptance head's draft confidence in one pass == the float64 definition (and the torch reference within its
    own cancellation error) on drafter-like float32 logits; captured in a CUDA graph it replays the same bits."""
    from adaflash_ray.kernels.draft_confidence import draft_confidence_fused, draft_confidence_ref

    g = torch.Generator(device="cuda").manual_seed(rows)
    z = 4 * torch.randn(rows, vocab, device="cuda", generator=g)
    z[:, :8] += 12 * torch.rand(rows, 8, device="cuda", generator=g)  # a few likely words, as a trained drafter's
    p64 = torch.softmax(z.double(), -1)
    exact = torch.stack([p64.max(-1).values, -(p64 * torch.log_softmax(z.double(), -1)).sum(-1)], -1)
    got = draft_confidence_fused(z)
    assert (got.double() - exact).abs().max().item() <= 2e-5 * max(1.0, exact.abs().max().item())
    assert (got - draft_confidence_ref(z)).abs().max().item() <= 5e-4 * max(1.0, exact.abs().max().item())
    zb = z.bfloat16()
    assert (draft_confidence_fused(zb) - draft_confidence_ref(zb)).abs().max().item() <= 5e-4 * exact.abs().max()
    out = torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(draft_confidence_fused(z))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("rows", [1, 16, 1024])
def test_add_rmsnorm_gpu(shape, rows):
    from adaflash_ray.kernels.fused_norm import add_rmsnorm, add_rmsnorm_ref

    hidden = shape[1]
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1, hidden, device="cuda", generator=g).bfloat16()
    d = torch.randn(rows, 1, hidden, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    r, y = add_rmsnorm(x, d, w, 1e-6)
    r0, y0 = add_rmsnorm_ref(x, d, w, 1e-6)
    torch.testing.assert_close(r, r0, rtol=0, atol=0)  # the add rounds the same way
    _close_bf16(y, y0, ulps=1.0)
    r, y = add_rmsnorm(x, None, w, 1e-6)
    assert r is x
    _close_bf16(y, add_rmsnorm_ref(x, None, w, 1e-6)[1], ulps=1.0)



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("rows,gemv", [(1, None), (3, None), (16, None), (1, False), (16, False), (40, None),
                                       (40, True), (1024, None)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_norm_linear_gpu(shape, rows, gemv, swiglu):
    """Residual add + RMSNorm + the q/k/v (or gate/up + SwiGLU) GEMM in one kernel against the torch reference, bf16:
    the residual bit for bit, the output to bf16 rounding; without the norm, the plain linear layer. Each form at its
    row counts (the GEMV form up to 16 rows, the tiled form above) and the other form forced at 1 / 16 / 40 rows."""
    from adaflash_ray.kernels.norm_linear import norm_linear, norm_linear_ref

    _, hidden, inter, hq, hkv, d, _ = shape
    n = 2 * inter if swiglu else (hq + 2 * hkv) * d
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1, hidden, device="cuda", generator=g).bfloat16()
    delta = torch.randn(rows, 1, hidden, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(n, hidden, device="cuda", generator=g) / hidden ** 0.5).bfloat16()
    r, y = norm_linear(x, delta, nw, 1e-6, w, swiglu=swiglu, gemv=gemv)
    r0, y0 = norm_linear_ref(x, delta, nw, 1e-6, w, swiglu=swiglu)
    assert torch.equal(r, r0) and y.shape == y0.shape and y.dtype == torch.bfloat16
    err = (y.float() - y0.float()).abs().max().item()
    assert err <= 0.02 * y0.float().abs().max().item(), err
    if not swiglu:  # the same kernel without the norm: o_proj / down_proj with ADAFLASH_FUSED_LINEAR=all
        from adaflash_ray.kernels.norm_linear import linear

        y = linear(x, w) if gemv is None else norm_linear(x, None, None, 0.0, w, gemv=gemv)[1]
        y0 = torch.nn.functional.linear(x, w)
        assert (y.float() - y0.float()).abs().max().item() <= 0.02 * y0.float().abs().max().item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("rows", [1, 4, 16, 40])
def test_linear_swiglu_in_and_add_norm_gpu(shape, rows):
    """down_proj with the SwiGLU product in its loads == the swiglu kernel then the same linear kernel, bit for bit
    (bf16, the GEMV form up to 16 rows, the tiled form above), and close to swiglu + cuBLAS; and with the residual
    add + RMSNorm epilogue (linear_add_norm) against add_rmsnorm after the same GEMM."""
    from adaflash_ray.kernels.norm_linear import linear
    from adaflash_ray.kernels.swiglu import swiglu

    _, hidden, inter, *_ = shape
    g = torch.Generator(device="cuda").manual_seed(rows)
    gu = (2 * torch.randn(rows, 2 * inter, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(hidden, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16()
    out = linear(gu, w, swiglu_in=True)
    assert torch.equal(out, linear(swiglu(gu), w))
    _close_bf16(out, torch.nn.functional.linear(swiglu(gu), w), ulps=4.0)
    # with the residual add + RMSNorm as the epilogue: the residual bit for bit add_rmsnorm's on the same GEMM
    # output, the norm within rounding (its sum runs in another order); the ticket counters left at 0
    from adaflash_ray.kernels import triton_support as ts
    from adaflash_ray.kernels.fused_norm import add_rmsnorm
    from adaflash_ray.kernels.norm_linear import linear_add_norm

    res = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    for x, sw in ((gu, True), (gu[:, :inter].contiguous(), False)):
        r, h = linear_add_norm(x, w, res, nw, 1e-6, swiglu_in=sw)
        r0, h0 = add_rmsnorm(res, linear(x, w, swiglu_in=sw), nw, 1e-6)
        assert torch.equal(r, r0)
        _close_bf16(h, h0)
    assert int(ts._COUNTERS[torch.device("cuda", torch.cuda.current_device())].abs().sum()) == 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("rows", [1, 16, 1024])
def test_swiglu_gpu(shape, rows):
    from adaflash_ray.kernels.swiglu import swiglu, swiglu_ref

    inter = shape[2]
    g = torch.Generator(device="cuda").manual_seed(rows)
    gu = (2 * torch.randn(rows, 1, 2 * inter, device="cuda", generator=g)).bfloat16()
    out = swiglu(gu)
    assert out.shape == (rows, 1, inter) and out.dtype == torch.bfloat16
    _close_bf16(out, swiglu_ref(gu), ulps=1.0)



def _rotary_case(shape, batch, width, device, dtype, seed=0, slots=None):
    from adaflash_ray.models.layers import Rotary

    _, _, _, hq, hkv, d, qk = shape
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(batch, width, (hq + 2 * hkv) * d, device=device, generator=g).to(dtype)
    start = torch.randint(0, 200, (batch, 1), device=device, generator=g)
    positions = start + torch.arange(width, device=device)
    cos, sin = Rotary(d, 1e6).to(device).cos_sin(positions)
    qn = (1 + 0.1 * torch.randn(d, device=device, generator=g)).to(dtype) if qk else None
    kn = (1 + 0.1 * torch.randn(d, device=device, generator=g)).to(dtype) if qk else None
    slots = slots or batch + 2
    rows = torch.randperm(slots, device=device, generator=g)[:batch]
    kc = torch.zeros(slots, 256, hkv, d, device=device, dtype=dtype)
    return qkv, cos, sin, qn, kn, kc, kc.clone(), rows, positions


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("batch,width", [(1, 1), (1, 16), (8, 1), (4, 16), (64, 2)])
def test_rotary_qkv_cache_gpu(shape, batch, width):
    from adaflash_ray.kernels.rotary_cache import rotary_qkv_cache, rotary_qkv_cache_ref

    qkv, cos, sin, qn, kn, kc, vc, rows, pos = _rotary_case(shape, batch, width, "cuda", torch.bfloat16)
    kc0, vc0 = kc.clone(), vc.clone()
    hq, hkv = shape[3], shape[4]
    q = rotary_qkv_cache(qkv, cos, sin, qn, kn, 1e-6, kc, vc, rows, pos, hq, hkv)
    q0 = rotary_qkv_cache_ref(qkv, cos, sin, qn, kn, 1e-6, kc0, vc0, rows, pos, hq, hkv)
    assert q.shape == (batch, hkv, width * (hq // hkv), shape[5])
    _close_bf16(q, q0)
    _close_bf16(kc, kc0)
    torch.testing.assert_close(vc, vc0, rtol=0, atol=0)  # values are copied



def _attention_case(hkv: int, d: int, batch: int, width: int, span: int, seed: int):
    """A decode / verify attention case on the GPU: ``(generator, k_cache, v_cache, rows, positions)`` - bf16 caches
    of ``batch + 1`` slots x 1024 positions, the batch's slots in random order, each row's ``width`` positions
    starting at random below ``span - width``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = batch + 1
    kc = torch.randn(slots, 1024, hkv, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(slots, 1024, hkv, d, device="cuda", generator=g).bfloat16()
    rows = torch.randperm(slots, device="cuda", generator=g)[:batch]
    start = torch.randint(0, span - width + 1, (batch, 1), device="cuda", generator=g)
    return g, kc, vc, rows, start + torch.arange(width, device="cuda")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("batch,width,span", [(1, 1, 600), (1, 16, 600), (8, 1, 1024), (64, 16, 600), (3, 2, 37)])
def test_decode_attention_gpu(shape, batch, width, span):
    from adaflash_ray.kernels.decode_attention import decode_attention, decode_attention_ref

    _, _, _, hq, hkv, d, _ = shape
    g, kc, vc, rows, pos = _attention_case(hkv, d, batch, width, span, batch * width)
    q = torch.randn(batch, hkv, width * (hq // hkv), d, device="cuda", generator=g).bfloat16()
    out = decode_attention(q, kc, vc, rows, pos, span)
    ref = decode_attention_ref(q, kc, vc, rows, pos, span)
    assert out.shape == ref.shape == (batch, width, hq * d)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 0.02 * ref.float().abs().max().item(), err
    for splits in (1, 3):
        alt = decode_attention(q, kc, vc, rows, pos, span, num_splits=splits)
        assert (alt.float() - ref.float()).abs().max().item() <= 0.02 * ref.float().abs().max().item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_decode_attention_row_is_the_same_bits_in_every_forward_gpu(shape):
    """Every query row's split-K attention (bf16) is bitwise the same alone (the AR step: width 1, span p + 1) as at
    any place of a verify block (widths 3, 8 and 16: 16- and 32-row tiles, two tiles), over a larger span, with
    other slots in the batch and in either launch (one pass; split + merge): the key tiles, their merge order and
    the instruction path depend on nothing but the keys (what lets greedy spec decoding with the kernel equal AR's
    output). Queries at 1x and 6x scale (flat and peaked softmax)."""
    from adaflash_ray.kernels.decode_attention import decode_attention

    _, _, _, hq, hkv, d, _ = shape
    rep = hq // hkv
    for seed, p, scale in ((1, 300, 1.0), (2, 250, 6.0), (3, 61, 6.0)):
        g = torch.Generator(device="cuda").manual_seed(seed)
        kc = torch.randn(64, 1024, hkv, d, device="cuda", generator=g).bfloat16()
        vc = torch.randn(64, 1024, hkv, d, device="cuda", generator=g).bfloat16()
        q = (scale * torch.randn(64, hkv, 16, rep, d, device="cuda", generator=g)).bfloat16()  # [B, Hkv, t, r, D]

        def rows_at(batch, start, width, span, splits=None):  # positions start..start+width-1 of slot 0
            pos = (p + start + torch.arange(width, device="cuda")).expand(batch, width).contiguous()
            qg = q[:batch, :, start:start + width].reshape(batch, hkv, width * rep, d).contiguous()
            return decode_attention(qg, kc, vc, torch.arange(batch, device="cuda"), pos, span, splits)[0]

        ar = [rows_at(1, j, 1, p + j + 1)[0] for j in range(16)]  # the AR steps
        # each case in the launch its shape gets (None) and in both launches: one pass (1), split + merge (4)
        for batch, start, width, span in [(1, 0, 1, 1024), (1, 0, 16, p + 16), (64, 0, 16, 1024), (7, 0, 3, 517),
                                          (1, 0, 8, p + 64), (3, 4, 8, p + 12), (64, 0, 1, p + 1)]:
            for splits in (None, 1, 4):
                got = rows_at(batch, start, width, span, splits)
                for j in range(width):
                    assert torch.equal(got[j], ar[start + j]), (seed, batch, start, width, span, splits, j)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("batch,width,span", [(1, 1, 600), (1, 16, 600), (8, 1, 1024), (64, 16, 600), (3, 2, 37)])
def test_rotary_decode_attention_gpu(shape, batch, width, span):
    """The one-launch rotary + cache write + split-K attention against its reference (and the two-kernel path) in
    bf16, in the launch its shape gets and in both launches (one pass; split with the last program's merge); the
    ticket counters are all 0 after each launch."""
    from adaflash_ray.kernels import decode_attention as da
    from adaflash_ray.kernels import triton_support as ts
    from adaflash_ray.kernels.rotary_cache import rotary_qkv_cache
    from adaflash_ray.models.layers import Rotary

    _, _, _, hq, hkv, d, qk = shape
    g, kc, vc, rows, pos = _attention_case(hkv, d, batch, width, span, batch * width + span)
    qkv = torch.randn(batch, width, (hq + 2 * hkv) * d, device="cuda", generator=g).bfloat16()
    cos, sin = Rotary(d, 1e6).to("cuda").cos_sin(pos)
    qn = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16() if qk else None
    kn = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16() if qk else None
    kr, vr = kc.clone(), vc.clone()
    ref = da.rotary_decode_attention_ref(qkv, cos, sin, qn, kn, 1e-6, kr, vr, rows, pos, span, hq, hkv)
    k2, v2 = kc.clone(), vc.clone()
    two = da.decode_attention(rotary_qkv_cache(qkv, cos, sin, qn, kn, 1e-6, k2, v2, rows, pos, hq, hkv), k2, v2, rows,
                              pos, span)
    for splits in (None, 1, 3):
        k1, v1 = kc.clone(), vc.clone()
        out = da.rotary_decode_attention(qkv, cos, sin, qn, kn, 1e-6, k1, v1, rows, pos, span, hq, hkv,
                                         num_splits=splits)
        assert out.shape == ref.shape == (batch, width, hq * d)
        scale = ref.float().abs().max().item()
        assert (out.float() - ref.float()).abs().max().item() <= 0.02 * scale
        assert (out.float() - two.float()).abs().max().item() <= 0.02 * scale
        _close_bf16(k1, kr)
        torch.testing.assert_close(v1, vr, rtol=0, atol=0)  # values are copied
        if not qk:  # no qk-norm: the same operations as the two kernels, bit for bit
            assert torch.equal(k1, k2) and torch.equal(out, two), splits
        assert int(ts._COUNTERS[torch.device("cuda", torch.cuda.current_device())].abs().sum()) == 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_rotary_decode_attention_row_is_the_same_bits_in_every_forward_gpu(shape):
    """As the split-K kernel's test, with the step's own keys written by the kernel: 16 AR steps (width 1, each
    writing its key) give bitwise the rows of one width-16 verify (writing all 16), of a width-8 verify in a batch
    of 64 over a longer span, and of every launch (one pass; split + the last program's merge)."""
    from adaflash_ray.kernels.decode_attention import rotary_decode_attention
    from adaflash_ray.models.layers import Rotary

    _, _, _, hq, hkv, d, qk = shape
    rot = Rotary(d, 1e6).to("cuda")
    for seed, p, scale in ((1, 300, 1.0), (2, 61, 6.0)):
        g = torch.Generator(device="cuda").manual_seed(seed)
        kc0 = torch.randn(64, 1024, hkv, d, device="cuda", generator=g).bfloat16()
        vc0 = torch.randn(64, 1024, hkv, d, device="cuda", generator=g).bfloat16()
        qkv = (scale * torch.randn(1, 16, (hq + 2 * hkv) * d, device="cuda", generator=g)).bfloat16()
        qn = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16() if qk else None
        kn = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16() if qk else None

        def rows_at(batch, start, width, span, splits=None):  # positions p+start.. of every slot, the same tokens
            kc, vc = kc0.clone(), vc0.clone()
            if start:  # the earlier positions' keys as the AR steps wrote them
                rotary_decode_attention(qkv[:, :start].expand(batch, -1, -1).contiguous(),
                                        *rot.cos_sin((p + torch.arange(start, device="cuda")).expand(batch, start)),
                                        qn, kn, 1e-6, kc, vc, torch.arange(batch, device="cuda"),
                                        (p + torch.arange(start, device="cuda")).expand(batch, start).contiguous(),
                                        p + start, hq, hkv)
            pos = (p + start + torch.arange(width, device="cuda")).expand(batch, width).contiguous()
            cos, sin = rot.cos_sin(pos)
            x = qkv[:, start:start + width].expand(batch, -1, -1).contiguous()
            return rotary_decode_attention(x, cos, sin, qn, kn, 1e-6, kc, vc, torch.arange(batch, device="cuda"),
                                           pos, span, hq, hkv, num_splits=splits)[0]

        ar, kc, vc = [], kc0.clone(), vc0.clone()
        for j in range(16):  # the AR steps, one cache
            pos = torch.tensor([[p + j]], device="cuda")
            cos, sin = rot.cos_sin(pos)
            ar.append(rotary_decode_attention(qkv[:, j:j + 1].contiguous(), cos, sin, qn, kn, 1e-6, kc, vc,
                                              torch.arange(1, device="cuda"), pos, p + j + 1, hq, hkv)[0, 0])
        for batch, start, width, span in [(1, 0, 16, p + 16), (64, 0, 8, 1024), (3, 4, 8, p + 12), (1, 0, 1, 1024)]:
            for splits in (None, 1, 4):
                got = rows_at(batch, start, width, span, splits)
                for j in range(width):
                    assert torch.equal(got[j], ar[start + j]), (seed, batch, start, width, span, splits, j)


def _small_target(shape_name: str, layers: int, device: str, dtype: torch.dtype):
    from adaflash_ray.shapes import SHAPES as REAL, build_random_target

    cfg = dataclasses.replace(REAL[shape_name], num_hidden_layers=layers)
    return build_random_target(cfg, device, dtype, seed=0)


def _prefill_then_verify(target, batch, prompt, width, device, seed=0):
    """Prefill ``prompt`` tokens per slot (slot_ids path), then a verify step of ``width`` (rows are slots).
    Returns (prefill output, verify output, cache)."""
    g = torch.Generator().manual_seed(seed)
    v = target.config.vocab_size
    ids = torch.randint(0, v, (batch, prompt), generator=g).to(device)
    ids2 = torch.randint(0, v, (batch, width), generator=g).to(device)
    pos = torch.arange(prompt, device=device).expand(batch, prompt)
    pos2 = prompt + torch.arange(width, device=device).expand(batch, width)
    cache = target.new_kv_cache(batch, prompt + width + 4)
    layers = [0, target.config.num_hidden_layers - 1]
    o1 = target(ids, pos, cache=cache, slot_ids=torch.arange(batch, device=device), capture_layer_ids=layers)
    o2 = target(ids2, pos2, cache=cache, rows_are_slots=True, span=prompt + width, capture_layer_ids=layers,
                logits_dtype=None)
    return o1, o2, cache


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape_name", ["smollm2-135m", "qwen3-8b"])
@pytest.mark.parametrize("batch,width", [(1, 1), (4, 16)])
def test_target_fused_forward_gpu(shape_name, batch, width, monkeypatch):
    """Two-layer random target of the real shape: fused vs reference forward (prefill + verify over the cache), with
    SDPA or split-K attention (the rotary in the attention's launch or in its own), and with the add + norm fused
    into the q/k/v and gate/up GEMMs."""
    target = _small_target(shape_name, 2, "cuda", torch.bfloat16)
    target.fuse_projections()  # what the engine does on CUDA; auto turns the kernels on
    assert target.fused_kernels_active
    runs = []
    for split_k, linear, rotary in ((False, "off", "fused"), (True, "off", "fused"), (True, "off", "separate"),
                                    (True, "on", "fused"), (True, "all", "fused"), (True, "decode", "fused"),
                                    (True, "residual", "fused")):
        target.fused_attention = split_k
        monkeypatch.setenv("ADAFLASH_FUSED_LINEAR", linear)
        monkeypatch.setenv("ADAFLASH_ROTARY_ATTENTION", rotary)
        runs.append(_prefill_then_verify(target, batch, 40, width, "cuda"))
    monkeypatch.setenv("ADAFLASH_FUSED_LINEAR", "off")
    target.use_fused_kernels("off")
    ref = _prefill_then_verify(target, batch, 40, width, "cuda")
    for fused in runs:
        for a, b in ((fused[0], ref[0]), (fused[1], ref[1])):
            for x, y in ((a.last_hidden, b.last_hidden), (a.features, b.features), (a.logits, b.logits)):
                err = (x.float() - y.float()).abs().max().item()
                assert err <= 0.02 * y.float().abs().max().item() + 1e-3, err
        assert (fused[2].k.float() - ref[2].k.float()).abs().max() <= 0.02 * ref[2].k.float().abs().max()



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("split_k,linear,rotary", [(False, "off", "separate"), (True, "off", "separate"),
                                                   (True, "off", "fused"), (True, "residual", "fused")])
def test_fused_forward_in_cuda_graph_gpu(split_k, linear, rotary, monkeypatch):
    """The fused decode / verify forward captured in CUDA graphs: replay == eager, bit for bit (no host syncs
    inside), including a batch size and width first met inside the capture (no Triton compile during capture:
    the engine captures new step shapes without a warm-up)."""
    monkeypatch.setenv("ADAFLASH_FUSED_LINEAR", linear)  # residual: the GEMV epilogues' tickets in the graph
    monkeypatch.setenv("ADAFLASH_ROTARY_ATTENTION", rotary)  # fused: the split launch's tickets in the graph
    target = _small_target("qwen3-8b", 2, "cuda", torch.bfloat16)
    assert target.use_fused_kernels("auto")
    target.fused_attention = split_k
    batch, prompt = 4, 24
    _, _, cache = _prefill_then_verify(target, batch, prompt, 16, "cuda")  # compiles every kernel (eager)
    for b, width in ((4, 16), (2, 1), (3, 3)):
        ids = torch.randint(0, target.config.vocab_size, (b, width), device="cuda")
        pos = prompt + torch.arange(width, device="cuda").expand(b, width).contiguous()

        def step():
            return target(ids, pos, cache=cache, rows_are_slots=True, span=prompt + width, capture_layer_ids=[1],
                          logits_dtype=None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        ids.copy_(torch.randint(0, target.config.vocab_size, (b, width), device="cuda"))
        ref = step()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        torch.testing.assert_close(out.features, ref.features, rtol=0, atol=0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("rotary", ["separate", "fused"])
def test_engine_fused_lossless_gpu(model_type, rotary, monkeypatch):
    """The engine on CUDA graphs with the fused kernels (chosen at build: auto, target and drafter): a tiny random
    fp32 target, greedy spec output == AR output == the same engine with the kernels off (fp32: no near ties)."""
    monkeypatch.setenv("ADAFLASH_ROTARY_ATTENTION", rotary)
    from conftest import make_drafter, make_tiny_target

    from adaflash_ray.engine import SamplingParams, SpecEngine

    target = make_tiny_target(model_type, logit_scale=4.0).to("cuda")
    drafter, head = make_drafter(target, block_size=8, layers=1, policy="direct", seed=5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    outs = {}
    for mode in ("auto", "off"):
        target.fused_kernels = mode  # read by fuse_projections() when the engine is built
        for spec in (True, False):
            eng = SpecEngine(target, drafter if spec else None, head if spec else None, max_batch_size=4,
                             max_seq_len=256)
            assert target.fused_kernels_active == (mode == "auto")
            assert not spec or drafter.fused_kernels_active == (mode == "auto")  # the drafter follows the switch
            outs[mode, spec] = [r.output_ids for r in eng.generate(prompts, params, mode="spec" if spec else "ar")]
            assert len(eng.runner.graphs) > 0
    target.fused_kernels = "auto"
    assert outs["auto", True] == outs["auto", False] == outs["off", False] == outs["off", True]


# --------------------------------------------------------------------------------------------- CPU
_INTERPRETER_SCRIPT = textwrap.dedent("""
    import dataclasses, os, torch
    torch.set_num_threads(1)
    from adaflash_ray.kernels.fused_norm import add_rmsnorm, add_rmsnorm_ref
    from adaflash_ray.kernels.rotary_cache import rotary_qkv_cache, rotary_qkv_cache_ref
    from adaflash_ray.kernels.swiglu import swiglu, swiglu_ref
    from adaflash_ray.models.layers import Rotary
    from adaflash_ray.shapes import SHAPES, build_random_target

    def close(a, b, tol=2e-6):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * max(1.0, b.float().abs().max().item()), err

    g = torch.Generator().manual_seed(0)
    x, d = torch.randn(3, 2, 576, generator=g), torch.randn(3, 2, 576, generator=g)
    w = 1 + 0.1 * torch.randn(576, generator=g)
    for delta in (d, None):
        (r, y), (r0, y0) = add_rmsnorm(x, delta, w, 1e-5), add_rmsnorm_ref(x, delta, w, 1e-5)
        close(r, r0, 0.0); close(y, y0)
    gu = torch.randn(5, 2 * 1536, generator=g)
    close(swiglu(gu), swiglu_ref(gu))
    for hq, hkv, hd, qk in ((9, 3, 64, False), (4, 2, 16, True)):
        b, wd = 3, 5
        qkv = torch.randn(b, wd, (hq + 2 * hkv) * hd, generator=g)
        pos = torch.randint(0, 30, (b, 1), generator=g) + torch.arange(wd)
        cos, sin = Rotary(hd, 1e4).cos_sin(pos)
        qn = 1 + 0.1 * torch.randn(hd, generator=g) if qk else None
        kn = 1 + 0.1 * torch.randn(hd, generator=g) if qk else None
        kc = torch.zeros(6, 40, hkv, hd); vc = torch.zeros_like(kc); kc0, vc0 = kc.clone(), vc.clone()
        rows = torch.tensor([4, 0, 2])
        q = rotary_qkv_cache(qkv, cos, sin, qn, kn, 1e-6, kc, vc, rows, pos, hq, hkv)
        q0 = rotary_qkv_cache_ref(qkv, cos, sin, qn, kn, 1e-6, kc0, vc0, rows, pos, hq, hkv)
        close(q, q0); close(kc, kc0); close(vc, vc0, 0.0)

    from adaflash_ray.kernels.decode_attention import decode_attention, decode_attention_ref
    for hq, hkv, hd in ((9, 3, 64), (4, 2, 16)):
        for b, wd, span, splits in ((2, 1, 40, None), (3, 4, 70, 3), (1, 16, 100, 2)):
            kc, vc = torch.randn(5, 128, hkv, hd, generator=g), torch.randn(5, 128, hkv, hd, generator=g)
            rows = torch.randperm(5, generator=g)[:b]
            pos = torch.randint(0, span - wd + 1, (b, 1), generator=g) + torch.arange(wd)
            q = torch.randn(b, hkv, wd * (hq // hkv), hd, generator=g)
            close(decode_attention(q, kc, vc, rows, pos, span, num_splits=splits),
                  decode_attention_ref(q, kc, vc, rows, pos, span))
    # rotary + cache write + split-K attention in one launch, against the reference and the two kernels
    from adaflash_ray.kernels import decode_attention as da
    from adaflash_ray.kernels import triton_support as ts
    for hq, hkv, hd, qk in ((9, 3, 64, False), (8, 2, 32, True)):
        for b, wd, span, splits in ((2, 1, 40, None), (3, 4, 70, 3), (1, 16, 100, 2), (2, 5, 130, 1)):
            if wd * hq // hkv > 128:
                continue
            qkv = torch.randn(b, wd, (hq + 2 * hkv) * hd, generator=g)
            pos = torch.randint(0, span - wd + 1, (b, 1), generator=g) + torch.arange(wd)
            cos, sin = Rotary(hd, 1e4).cos_sin(pos)
            qn = 1 + 0.1 * torch.randn(hd, generator=g) if qk else None
            kn = 1 + 0.1 * torch.randn(hd, generator=g) if qk else None
            kc, vc = torch.randn(5, 160, hkv, hd, generator=g), torch.randn(5, 160, hkv, hd, generator=g)
            kr, vr, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            rows = torch.randperm(5, generator=g)[:b]
            out = da.rotary_decode_attention(qkv, cos, sin, qn, kn, 1e-6, kc, vc, rows, pos, span, hq, hkv,
                                             num_splits=splits)
            close(out, da.rotary_decode_attention_ref(qkv, cos, sin, qn, kn, 1e-6, kr, vr, rows, pos, span, hq, hkv))
            close(kc, kr); close(vc, vr, 0.0)
            two = decode_attention(rotary_qkv_cache(qkv, cos, sin, qn, kn, 1e-6, k2, v2, rows, pos, hq, hkv), k2, v2,
                                   rows, pos, span, num_splits=splits)
            assert qk or (torch.equal(out, two) and torch.equal(kc, k2))  # no qk-norm: the two kernels' operations
            assert int(ts._COUNTERS[torch.device("cpu")].abs().sum()) == 0  # each launch leaves its tickets at 0
    try:
        da.rotary_decode_attention(qkv[:, :1], cos[:, :1], sin[:, :1], qn, kn, 1e-6, kc, vc, rows, pos[:, :1], 5,
                                   hq + 1, hkv)
        raise AssertionError("a qkv of the wrong width accepted")
    except ValueError as e:
        assert "heads 9/2" in str(e), e
    # the step's own keys: 5 AR steps (width 1, each writing its key) give bitwise the rows of a width-5 verify
    # (writing all 5), of a verify of 3 after two AR steps, in a batch of 4 over a longer span, in both launches
    # (widths <= 5 at rep 3: one 16-row tile, as above)
    hq, hkv, hd = 9, 3, 64
    rot = Rotary(hd, 1e4)
    kc0, vc0 = torch.randn(4, 256, hkv, hd, generator=g), torch.randn(4, 256, hkv, hd, generator=g)
    qkv = 3 * torch.randn(1, 6, (hq + 2 * hkv) * hd, generator=g)
    p0 = 120
    def fused_rows(kc, vc, batch, start, width, span, splits):
        pos = (p0 + start + torch.arange(width)).expand(batch, width).contiguous()
        x = qkv[:, start:start + width].expand(batch, -1, -1).contiguous()
        return da.rotary_decode_attention(x, *rot.cos_sin(pos), None, None, 0.0, kc, vc, torch.arange(batch), pos,
                                          span, hq, hkv, num_splits=splits)[0]
    kc, vc = kc0.clone(), vc0.clone()
    ar = [fused_rows(kc, vc, 1, j, 1, p0 + j + 1, None)[0] for j in range(5)]
    for batch, start, width, span, splits in ((1, 0, 5, p0 + 5, None), (4, 0, 5, 256, 1), (4, 0, 5, 256, 3),
                                              (2, 2, 3, p0 + 70, 2)):
        kc, vc = kc0.clone(), vc0.clone()
        if start:
            for j in range(start):
                fused_rows(kc, vc, batch, j, 1, p0 + j + 1, None)
        got = fused_rows(kc, vc, batch, start, width, span, splits)
        for j in range(width):
            assert torch.equal(got[j], ar[start + j]), ("fused", batch, start, width, span, splits, j)
    # a query row's result is the same bits alone (the AR step: batch 1, width 1, span p + 1) as beside other rows,
    # inside a verify block, over a longer span and in either launch (one pass, or split + merge): widths 1-5 with
    # rep 3 keep one 16-row tile (numpy's matmul, the interpreter's dot, may round a 32-row tile's rows otherwise)
    hkv, rep, hd = 3, 3, 64
    kc, vc = torch.randn(6, 256, hkv, hd, generator=g), torch.randn(6, 256, hkv, hd, generator=g)
    qq = 4 * torch.randn(6, hkv, 8, rep, hd, generator=g)
    p0 = 130
    def rows_at(batch, start, width, span, splits):
        pos = (p0 + start + torch.arange(width)).expand(batch, width).contiguous()
        qg = qq[:batch, :, start:start + width].reshape(batch, hkv, width * rep, hd).contiguous()
        return decode_attention(qg, kc, vc, torch.arange(batch), pos, span, num_splits=splits)[0]
    ar = [rows_at(1, j, 1, p0 + j + 1, None)[0] for j in range(8)]
    assert not torch.equal(ar[0], rows_at(1, 0, 1, p0 + 1, 1)[0] * (1 + 2 ** -20))  # the check can fail
    for batch, start, width, span, splits in ((1, 0, 1, 256, 1), (6, 0, 5, 256, 1), (6, 3, 5, p0 + 8, 4),
                                              (2, 0, 4, 200, 2), (1, 2, 3, p0 + 64, None), (6, 0, 1, p0 + 1, 7)):
        got = rows_at(batch, start, width, span, splits)
        for j in range(width):
            assert torch.equal(got[j], ar[start + j]), (batch, start, width, span, splits, j)
    # rep 8 at head_dim 16 (numpy rounds its 16- and 32-row tiles alike here): widths 5-8 are 40-64 rows, two row
    # tiles in one program reading each key tile once
    hkv, rep, hd = 2, 8, 16
    kc, vc = torch.randn(6, 256, hkv, hd, generator=g), torch.randn(6, 256, hkv, hd, generator=g)
    qq = 4 * torch.randn(6, hkv, 8, rep, hd, generator=g)
    ar = [rows_at(1, j, 1, p0 + j + 1, None)[0] for j in range(8)]
    for batch, start, width, span, splits in ((1, 0, 8, 256, 1), (6, 0, 8, p0 + 8, 4), (3, 1, 6, 200, None),
                                              (2, 0, 5, 256, 2)):
        got = rows_at(batch, start, width, span, splits)
        for j in range(width):
            assert torch.equal(got[j], ar[start + j]), ("rep 8", batch, start, width, span, splits, j)

    # the fused target forward on a 2-layer random model (Qwen3 layout: qk-norm), prefill then a verify step
    t = build_random_target(dataclasses.replace(SHAPES["tiny"], num_hidden_layers=2), "cpu", torch.float32)
    ids = torch.randint(0, 512, (3, 6), generator=g); ids2 = torch.randint(0, 512, (3, 4), generator=g)
    pos = torch.arange(6).expand(3, 6); pos2 = 6 + torch.arange(4).expand(3, 4)
    outs = []
    for mode, split_k, linear in (("off", False, "off"), ("auto", False, "off"), ("auto", True, "off"),
                                  ("auto", True, "rotary"), ("auto", True, "on"), ("auto", False, "on"),
                                  ("auto", True, "all"), ("auto", True, "decode"), ("auto", True, "residual")):
        # decode: the 18-row prefill unfused, the 12-row verify all; residual: the verify's o_proj / down_proj only;
        # rotary (and residual): the rotary + cache write in the split-K attention's launch
        os.environ["ADAFLASH_ROTARY_ATTENTION"] = "fused" if linear in ("rotary", "residual") else "separate"
        linear = "off" if linear == "rotary" else linear
        assert t.use_fused_kernels(mode) == (mode == "auto")
        t.fused_attention = split_k
        os.environ["ADAFLASH_FUSED_LINEAR"] = linear  # the add + norm fused into the q/k/v and gate/up GEMMs
        c = t.new_kv_cache(3, 16)
        o1 = t(ids, pos, cache=c, slot_ids=torch.tensor([2, 0, 1]), capture_layer_ids=[0, 1])
        o2 = t(ids2, pos2, cache=c, rows_are_slots=True, span=10, capture_layer_ids=[0, 1])
        outs.append((o1.logits, o1.features, o2.logits, o2.features, o2.last_hidden, c.k, c.v))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            close(a, b, 1e-5)
    os.environ.pop("ADAFLASH_FUSED_LINEAR")
    os.environ.pop("ADAFLASH_ROTARY_ATTENTION")

    # residual add + RMSNorm + linear in one kernel (with a bias; with the SwiGLU epilogue), float32
    from adaflash_ray.kernels.norm_linear import linear, norm_linear, norm_linear_ref
    for rows, kk in ((1, 96), (3, 40), (20, 64)):  # the SwiGLU product in the loads: the GEMV and tiled forms
        gu, w = 3 * torch.randn(rows, 2 * kk, generator=g), torch.randn(50, kk, generator=g)
        close(linear(gu, w, swiglu_in=True), torch.nn.functional.linear(swiglu(gu), w), 1e-5)
    try:
        linear(gu[:, 1:], w, swiglu_in=True)
        raise AssertionError("an odd gate/up width accepted")
    except ValueError as e:
        assert "swiglu_in" in str(e), e
    # the residual add + RMSNorm as the GEMM's epilogue (the last program of a row tile norms the row): 1, 3 and 20
    # rows (GEMV and tiled forms), with and without the SwiGLU product in the loads, N not a power of two
    from adaflash_ray.kernels import triton_support as ts
    from adaflash_ray.kernels.norm_linear import linear_add_norm
    for rows, kk, nn_, sw in ((1, 96, 72, False), (3, 40, 100, True), (20, 64, 48, False), (2, 32, 600, True)):
        x = 2 * torch.randn(rows, (2 if sw else 1) * kk, generator=g)
        w = torch.randn(nn_, kk, generator=g) / kk ** 0.5
        res, nw = torch.randn(rows, nn_, generator=g), 1 + 0.1 * torch.randn(nn_, generator=g)
        r, h = linear_add_norm(x, w, res, nw, 1e-6, swiglu_in=sw)
        r0, h0 = add_rmsnorm_ref(res, torch.nn.functional.linear(swiglu(x) if sw else x, w), nw, 1e-6)
        close(r, r0, 1e-5); close(h, h0, 1e-5)
        assert int(ts._COUNTERS[torch.device("cpu")].abs().sum()) == 0
    try:
        linear_add_norm(x, w, res[:, 1:], nw, 1e-6, swiglu_in=sw)
        raise AssertionError("a residual of the wrong width accepted")
    except ValueError as e:
        assert "residual (2, 599)" in str(e), e
    x, w = torch.randn(7, 3, 100, generator=g), torch.randn(90, 100, generator=g)  # no norm: a plain linear layer
    close(linear(x, w), torch.nn.functional.linear(x, w), 1e-5)
    try:  # a residual to add needs the norm's pass, which writes it
        norm_linear(x, x, None, 0.0, w)
        raise AssertionError("delta without norm_weight accepted")
    except ValueError:
        pass
    for shape, kk, nn_, swiglu, bias, has_d in (((3, 5), 96, 80, False, False, True), ((1, 1), 64, 128, True, False, True),
                                                ((40,), 200, 70, False, True, False), ((2, 9), 48, 64, True, True, True)):
        x = torch.randn(*shape, kk, generator=g)
        d = torch.randn(*shape, kk, generator=g) if has_d else None
        nw = 1 + 0.1 * torch.randn(kk, generator=g)
        w = torch.randn(nn_, kk, generator=g) / kk ** 0.5
        b = torch.randn(nn_, generator=g) if bias else None
        r, y = norm_linear(x, d, nw, 1e-6, w, b, swiglu=swiglu)
        rr, yr = norm_linear_ref(x, d, nw, 1e-6, w, b, swiglu=swiglu)
        assert torch.equal(r, rr) and y.shape == yr.shape, (shape, y.shape, yr.shape)
        close(y, yr, 1e-5)
    # the GEMV form (up to 16 rows; forced over more, or one row a program over several), float32: 1 / 3 / 16 rows,
    # with and without delta, bias and the SwiGLU epilogue, K a multiple of 8 (vector loads) or not
    for rows, kk, nn_, swiglu, bias, has_d, gemv, launch in (
            (1, 96, 40, False, False, True, None, None), (1, 200, 72, True, True, True, None, None),
            (1, 64, 24, False, True, False, None, None), (3, 200, 72, False, True, True, None, None),
            (3, 96, 48, True, False, False, None, None), (16, 96, 80, True, True, True, None, None),
            (16, 100, 40, False, False, False, None, None), (40, 64, 48, True, False, True, True, None),
            (3, 64, 40, True, True, True, True, (1, 8, 32, 4, 1)),
            (5, 100, 24, False, False, True, True, (1, 8, 64, 2, 1))):
        x = torch.randn(rows, kk, generator=g)
        d = torch.randn(rows, kk, generator=g) if has_d else None
        nw = 1 + 0.1 * torch.randn(kk, generator=g)
        w = torch.randn(nn_, kk, generator=g) / kk ** 0.5
        b = torch.randn(nn_, generator=g) if bias else None
        r, y = norm_linear(x, d, nw, 1e-6, w, b, swiglu=swiglu, gemv=gemv, launch=launch)
        rr, yr = norm_linear_ref(x, d, nw, 1e-6, w, b, swiglu=swiglu)
        assert torch.equal(r, rr) and y.shape == yr.shape, (rows, kk, y.shape, yr.shape)
        close(y, yr, 1e-5)
        if not swiglu:
            close(norm_linear(x, None, None, 0.0, w, b, gemv=gemv, launch=launch)[1],
                  torch.nn.functional.linear(x, w, b), 1e-5)
    # bf16 through the one-row GEMV form (the interpreter rounds float32 -> bf16 toward zero and has no bf16 tl.dot, so
    # within a few bf16 units, not bit for bit)
    for rows, swiglu, has_d in ((1, True, True), (3, False, True), (1, False, False)):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        d = torch.randn(rows, 128, generator=g).bfloat16() if has_d else None
        nw = (1 + 0.1 * torch.randn(128, generator=g)).bfloat16()
        w = (torch.randn(48, 128, generator=g) / 128 ** 0.5).bfloat16()
        r, y = norm_linear(x, d, nw, 1e-6, w, swiglu=swiglu, launch=(1, 8, 64, 2, 1))
        rr, yr = norm_linear_ref(x, d, nw, 1e-6, w, swiglu=swiglu)
        assert r.dtype == y.dtype == torch.bfloat16 and y.shape == yr.shape
        close(r, rr, 2 ** -7); close(y, yr, 2 ** -4)
    try:
        norm_linear(x, d, nw, 1e-6, w, launch=(2, 8, 64, 2, 1))  # the GEMV form takes one-row or 16-row tiles
        raise AssertionError("a 2-row GEMV tile accepted")
    except ValueError:
        pass

    # the acceptance head's draft confidence: one pass against the float64 definition (the torch reference's own
    # cancellation is ~1e-4 at logits ~30), a vocabulary that is no multiple of the kernel's block, bf16 input, an
    # uneven row stride, a one-word vocabulary
    from adaflash_ray.kernels.draft_confidence import draft_confidence_fused, draft_confidence_ref
    for shape, dt, scale in (((3, 5, 1000), torch.float32, 3.0), ((2, 7, 4099), torch.bfloat16, 8.0),
                             ((4, 300), torch.float32, 30.0), ((2, 1), torch.float32, 1.0)):
        z = (torch.randn(*shape, generator=g) * scale).to(dt)
        z[..., 0] += 20.0
        p64 = torch.softmax(z.double(), -1)
        exact = torch.stack([p64.max(-1).values, -(p64 * torch.log_softmax(z.double(), -1)).sum(-1)], -1)
        got = draft_confidence_fused(z)
        assert got.shape == (*shape[:-1], 2) and got.dtype == torch.float32
        close(got, exact, 2e-6)
        close(got, draft_confidence_ref(z), 2e-4)
    z = torch.randn(6, 2 * 4099, generator=g)[:, ::2]
    close(draft_confidence_fused(z), draft_confidence_ref(z), 2e-6)
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (optional; pip install triton)")
def test_kernels_under_triton_interpreter():
    """Every kernel and the fused target forward on CPU float32 tensors under ``TRITON_INTERPRET=1``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("ADAFLASH_FUSED_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def _arg_type(name: str, dtype: str = "*bf16") -> str:
    """Triton signature type of a kernel argument, by the naming convention of adaflash_ray/kernels."""
    if name in ("cos_ptr", "sin_ptr", "acc_ptr", "ml_ptr"):
        return "*fp32"
    if name in ("rows_ptr", "pos_ptr"):
        return "*i64"
    if name == "cnt_ptr":
        return "*i32"
    if name in ("eps", "qk_scale"):
        return "fp32"
    return dtype if name.endswith("_ptr") else "i32"


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (optional; pip install triton)")
def test_kernels_compile_for_sm90(tmp_path):
    """Every kernel at the SmolLM2 and Qwen3-8B constants compiles to sm_90 machine code on this CPU machine
    (Triton's compiler and its bundled ptxas need no GPU), and ptxas reports no register spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from adaflash_ray.kernels import decode_attention as da
    from adaflash_ray.kernels import draft_confidence, fused_norm, norm_linear, rotary_cache, swiglu

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    try:  # the ptxas Triton itself runs for sm_90 (3.9 and later: its newer bundled one)
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = Path(get_ptxas(90).path)
    except (ImportError, AttributeError, TypeError):
        pass
    cases = [(fused_norm._add_rmsnorm_kernel, {"HAS_DELTA": True, "BLOCK": 4096}, 8),
             (fused_norm._add_rmsnorm_kernel, {"HAS_DELTA": False, "BLOCK": 1024}, 4),
             (swiglu._swiglu_kernel, {"BLOCK": 1024}, 4),
             (draft_confidence._confidence_kernel, {"BLOCK": 2048}, 8)]
    for _, _, _, hq, hkv, d, qk in SHAPES:
        for heads in (hq, 0):  # 0: keys and values only (the drafter's context, rotary_kv_cache)
            cases.append((rotary_cache._rotary_qkv_cache_kernel,
                          {"HQ": heads, "HKV": hkv, "REP": max(1, heads // hkv), "D": d, "HALF": d // 2,
                           "BLOCK_HALF": d // 2, "QK_NORM": qk or heads == 0}, 2))
        rep = hq // hkv
        for bm in sorted({da.block_rows(w * rep, d) for w in range(1, 17)}):  # every query-row tile a width needs
            for partials in (False, True):
                for sub in (1, 2):  # one row tile a program, or two sharing the key loads
                    cases.append((da._split_kernel, {"HKV": hkv, "REP": rep, "D": d, "BLOCK_M": bm, "BLOCK_N": 64,
                                                     "PARTIALS": partials, "SUB": sub}, da.launch_settings(partials)))
            cases.append((da._merge_kernel, {"HKV": hkv, "REP": rep, "D": d, "BLOCK_M": bm, "BLOCK_N": 64}, 4))
            for partials in (False, True):
                for sub in (1, 2):
                    cases.append((da._rotary_attention_kernel,
                                  {"HKV": hkv, "REP": rep, "D": d, "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_W": 16,
                                   "PARTIALS": partials, "SUB": sub, "QK_NORM": qk}, da.launch_settings(partials)))
    # norm + linear as launched (norm_linear.norm_linear) at K = 4096 (vector loads: ALIGNED): the tiled form's every
    # row tile and the GEMV form's (one row; 2-16 rows), both epilogues and the plain linear layer
    for epi in (dict(HAS_DELTA=True, SWIGLU=False), dict(HAS_DELTA=True, SWIGLU=True),
                dict(HAS_DELTA=False, SWIGLU=False, NORM=False),
                dict(HAS_DELTA=False, SWIGLU=False, NORM=False, SWIGLU_IN=True),  # down_proj with the product
                dict(HAS_DELTA=False, SWIGLU=False, NORM=False, ADD_NORM=True),  # o_proj + the residual add + norm
                dict(HAS_DELTA=False, SWIGLU=False, NORM=False, SWIGLU_IN=True, ADD_NORM=True)):
        launches = [(*norm_linear.launch_tiles(bm, 4096, epi["SWIGLU"]), norm_linear.NUM_WARPS, norm_linear.NUM_STAGES,
                     False) for bm in (16, 32, 64)]
        launches += [(*norm_linear.gemv_launch(rows, 4096, epi["SWIGLU"]), True) for rows in (1, 16)]
        for bm, bn, bk, warps, stages, gemv in launches:
            cases.append((norm_linear._norm_linear_kernel,
                          dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=False, ALIGNED=True, **epi,
                               NORM_BLOCK_K=norm_linear.norm_chunk(bm, bk, 4096) if gemv else bk), (stages, warps)))
    fp32_io = {draft_confidence._confidence_kernel}  # float32 logits in, float32 features out
    for kernel, consts, settings in cases:
        stages, warps = settings if isinstance(settings, tuple) else (None, settings)
        ptr = "*fp32" if kernel in fp32_io else "*bf16"
        sig = {n: "constexpr" if n in consts else _arg_type(n, ptr) for n in kernel.arg_names}
        # as launched: the JIT's 16-byte pointer alignment, the split kernel's stages and warps
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr")}
        out = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, **({"num_stages": stages} if stages else {})})
        assert out.asm.get("cubin"), kernel
        if ptxas.exists():
            ptx = tmp_path / "k.ptx"
            ptx.write_text(out.asm["ptx"])
            r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-2000:]
            # two 32-row tiles of head_dim 128 in 4 warps fill the register file: a few bytes may spill there
            # (32 with the rotary's registers in the one-launch kernel)
            limit = 0
            if kernel in (da._split_kernel, da._rotary_attention_kernel) and consts["D"] >= 128 and consts["SUB"] == 2:
                limit = 16 if kernel is da._split_kernel else 32
            spilled = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
            assert spilled and max(spilled) <= limit, (kernel.fn.__name__, consts, r.stderr[-600:])


def test_cpu_default_stays_reference(monkeypatch):
    """On CPU without the interpreter, auto leaves the fused kernels off (the float32 reference path)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("ADAFLASH_FUSED_KERNELS", raising=False)
    t = _small_target("tiny", 1, "cpu", torch.float32)
    assert t.fuse_projections().fused_kernels_active is False
    with pytest.raises(ValueError):
        t.use_fused_kernels("on")
    monkeypatch.setenv("ADAFLASH_FUSED_KERNELS", "off")
    assert t.use_fused_kernels("auto") is False and t.fused_kernels == "off"


def test_bad_fused_linear_mode_fails_at_load_only_where_the_kernels_run(monkeypatch):
    """ADAFLASH_FUSED_LINEAR is read at each fused forward; a bad value is refused when the kernels are turned on
    (model load), naming the variable - and ignored where they stay off (CPU without the interpreter)."""
    from adaflash_ray.kernels import triton_support

    monkeypatch.delenv("ADAFLASH_FUSED_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("ADAFLASH_FUSED_LINEAR", "garbage")
    t = _small_target("tiny", 1, "cpu", torch.float32)
    assert t.use_fused_kernels("auto") is False  # CPU: the reference path, the variable never read
    monkeypatch.setattr(triton_support, "triton_usable", lambda device: True)  # as on CUDA
    with pytest.raises(ValueError, match="ADAFLASH_FUSED_LINEAR='garbage'"):
        t.use_fused_kernels("auto")
    assert t.fused_kernels_active is False
    monkeypatch.setenv("ADAFLASH_FUSED_LINEAR", "decode")
    assert t.use_fused_kernels("auto") is True


def test_split_k_choice_follows_the_mode_and_the_calibration(monkeypatch):
    """``fused_attention`` auto by default; a forward without the engine's choice: split-K only where the calibration
    table chose it, looked up at the smallest calibrated (batch, width) at or above the step's (none: SDPA); on / off
    (or the environment variable) override it; a width the kernel does not take never uses it; a bad value is refused
    with its name."""
    monkeypatch.delenv("ADAFLASH_FUSED_ATTENTION", raising=False)
    t = _small_target("tiny", 1, "cpu", torch.float32)
    assert t.attention_mode() == "auto" and not t._split_k(1, 1)  # the default; not calibrated: SDPA
    t.split_k_table = {(1, 1): True, (1, 16): False, (8, 1): True, (64, 1): False, (64, 16): False}
    assert t._split_k(1, 1) and not t._split_k(1, 2)  # (1, 2) -> (1, 16)
    assert t._split_k(2, 1) and t._split_k(8, 1) and not t._split_k(9, 1)  # (2, 1) -> (8, 1); (9, 1) -> (64, 1)
    assert not t._split_k(65, 1)  # above every calibrated batch
    t.fused_attention = True
    assert t.attention_mode() == "on" and t._split_k(64, 16) and not t._split_k(1, 17)
    monkeypatch.setenv("ADAFLASH_FUSED_ATTENTION", "0")
    assert t.attention_mode() == "off" and not t._split_k(1, 1)
    monkeypatch.setenv("ADAFLASH_FUSED_ATTENTION", "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        t.attention_mode()
    monkeypatch.delenv("ADAFLASH_FUSED_ATTENTION")
    with pytest.raises(RuntimeError, match="CUDA"):
        t.calibrate_attention(t.new_kv_cache(2, 64), [1], [1], [64])


def test_split_k_pays_only_when_faster_at_every_batch_size():
    """The engine's one choice for all its steps: split-K iff, at each calibrated batch size, its times summed over the
    widths and spans are below SDPA's; an empty calibration keeps SDPA."""
    from adaflash_ray.models.target import split_k_pays

    fast_small = {"1,1": {"sdpa_ms": [0.02, 0.03], "split_k_ms": [0.01, 0.02]},
                  "1,16": {"sdpa_ms": [0.02, 0.03], "split_k_ms": [0.025, 0.03]}}  # one width slower, the sum faster
    assert split_k_pays(fast_small)
    slow_big = {**fast_small, "64,1": {"sdpa_ms": [0.05, 0.08], "split_k_ms": [0.07, 0.10]},
                "64,16": {"sdpa_ms": [0.10, 0.20], "split_k_ms": [0.09, 0.19]}}  # batch 64: 0.45 ms vs 0.43 ms
    assert not split_k_pays(slow_big)
    assert not split_k_pays({})


def test_fused_linear_modes(monkeypatch):
    """ADAFLASH_FUSED_LINEAR: the spellings each mode takes, a clear error naming the others, and ``decode`` resolved
    per forward by its token rows (all up to GEMV_MAX_ROWS, off above)."""
    from adaflash_ray.kernels import norm_linear as nl

    for raw, want in (("", "off"), ("0", "off"), ("off", "off"), ("1", "on"), ("TRUE", "on"), ("all", "all"),
                      (" Decode ", "decode")):
        monkeypatch.setenv(nl.ENV_VAR, raw)
        assert nl.mode() == want, raw
    monkeypatch.setenv(nl.ENV_VAR, "decode")
    assert [nl.layer_mode(r) for r in (1, nl.GEMV_MAX_ROWS, nl.GEMV_MAX_ROWS + 1, 4096)] == ["all", "all", "off", "off"]
    monkeypatch.setenv(nl.ENV_VAR, " Residual")
    assert [nl.layer_mode(r) for r in (1, nl.GEMV_MAX_ROWS, nl.GEMV_MAX_ROWS + 1)] == ["residual", "residual", "off"]
    monkeypatch.setenv(nl.ENV_VAR, "on")
    assert nl.layer_mode(4096) == "on" and nl.layer_mode(1) == "on"
    monkeypatch.setenv(nl.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="ADAFLASH_FUSED_LINEAR='sometimes'.*decode, residual"):
        nl.mode()


def test_rotary_attention_mode(monkeypatch):
    """ADAFLASH_ROTARY_ATTENTION: fused or separate (the default, also when unset or empty); another value is a
    clear error naming both."""
    from adaflash_ray.models.layers import ROTARY_ATTENTION_ENV, rotary_attention_fused

    monkeypatch.delenv(ROTARY_ATTENTION_ENV, raising=False)
    assert not rotary_attention_fused()
    for raw, want in (("", False), ("Fused", True), (" separate ", False)):
        monkeypatch.setenv(ROTARY_ATTENTION_ENV, raw)
        assert rotary_attention_fused() == want, raw
    monkeypatch.setenv(ROTARY_ATTENTION_ENV, "both")
    with pytest.raises(ValueError, match="ADAFLASH_ROTARY_ATTENTION='both'.*fused or separate"):
        rotary_attention_fused()
