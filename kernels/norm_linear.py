"""A pre-norm layer's residual add, RMSNorm and the linear layer after it in one kernel (optionally with the SwiGLU
product of a fused gate/up projection as its epilogue).

A pre-norm decoder layer computes ``r = x + delta``, ``h = rmsnorm(r) * w_norm`` and then a GEMM of ``h``: the
fused q/k/v projection before attention, the fused gate/up projection (then ``silu(g) * u``, Shazeer 2020) before
the MLP's down projection. :func:`norm_linear` does the three (four) in one launch: each program takes a tile of
rows and of output columns, finds its rows' ``rsqrt(mean(r^2) + eps)`` in a first pass over ``K`` and feeds the
normed rows, rounded to the input dtype as :func:`~adaflash_ray.kernels.fused_norm.add_rmsnorm` writes them, to
``tl.dot`` tile by tile in a second (the rows' ``K`` values are re-read from L2, never written normed). The
programs of the first column tile also write ``r``. So a layer needs no separate norm kernel, no normed
activation in memory and, with ``swiglu``, no ``[M, 2I]`` gate/up output: per decode layer the launches are q/k/v,
rotary + cache write, attention, o_proj, gate/up + SwiGLU, down - six with o_proj and down_proj by :func:`linear`
and a one-pass attention, against the unfused path's two norms and a SwiGLU more (and cuBLAS's split-K workspace
memsets and reductions where it picks split-K).

The GEMV shape of decode (a few rows) is what it is for: every program reads its rows' whole ``K`` (a few KB)
beside its weight tile. At hundreds of rows the re-read normed input costs more than a separate norm would; the
caller chooses (``ADAFLASH_FUSED_LINEAR``, :func:`mode`). :func:`linear` is the same kernel without the norm: a
plain linear layer in one launch (o_proj and down_proj with ``ADAFLASH_FUSED_LINEAR=all``).

Numerics: ``r`` rounded to x's dtype (as ``x + delta`` is), the norm in float32 of that rounded ``r``, the normed
rows rounded to x's dtype, the dot products accumulated in float32 and rounded once (as ``F.linear`` in bf16);
with ``swiglu`` the gate and up outputs rounded, ``silu`` in float32 rounded, the product in float32 rounded once
(:mod:`adaflash_ray.kernels.swiglu`). The reduction orders differ from the unfused kernels', so results agree to
rounding, not bit for bit.

:func:`norm_linear_ref` is the pure-torch reference; :func:`norm_linear` the Triton kernel (CUDA, or CPU tensors
under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from adaflash_ray.kernels.fused_norm import residual_rows
from adaflash_ray.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["ENV_VAR", "linear", "mode", "norm_linear", "norm_linear_ref"]

#: ``off`` (default) / ``on`` / ``all``: whether the fused layer stack uses :func:`norm_linear` for the GEMMs after
#: a norm (``on``), and :func:`linear` for o_proj and down_proj too (``all``: no cuBLAS GEMM, none of its split-K
#: workspace memsets and reductions); read at each forward
ENV_VAR = "ADAFLASH_FUSED_LINEAR"


def mode() -> str:
    """``"off"``, ``"on"`` or ``"all"`` from ``ADAFLASH_FUSED_LINEAR`` (unset: off; ``1`` / ``true``: on). Raises
    ValueError on another value."""
    raw = os.environ.get(ENV_VAR, "off").strip().lower()
    if raw in ("on", "1", "true", "yes"):
        return "on"
    if raw in ("off", "0", "false", "no", "", "all"):
        return raw if raw == "all" else "off"
    raise ValueError(f"{ENV_VAR}={raw!r}: expected off, on or all")


def norm_linear_ref(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``r = x + delta`` (``x`` when ``delta`` is None), ``h = F.rms_norm(r, [K], norm_weight, eps)``
    (``h = r`` when ``norm_weight`` is None), ``y = F.linear(h, weight, bias)``; with ``swiglu``
    ``y = F.silu(g) * u`` for ``g, u = y.chunk(2, -1)``.

    Args: x, delta ``[..., K]``; norm_weight ``[K]``; weight ``[N, K]``; bias ``[N]`` or None.
    Returns ``(r, y)``: ``[..., K]`` and ``[..., N]`` (``[..., N / 2]`` with swiglu), in x's dtype.
    """
    r = x if delta is None else x + delta
    y = F.linear(r if norm_weight is None else F.rms_norm(r, r.shape[-1:], norm_weight, eps), weight, bias)
    if swiglu:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return r, y


if HAVE_TRITON:
    # one compiled variant for every batch size and width (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit(do_not_specialize=["m", "n", "k", "stride_x", "stride_d", "stride_r", "stride_w", "stride_y"])
    def _norm_linear_kernel(x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, r_ptr, y_ptr, m, n, k, eps,
                            stride_x, stride_d, stride_r, stride_w, stride_y,
                            HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            NORM: tl.constexpr = True):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < m, cols < n
        rows64 = rows.to(tl.int64)
        dt = x_ptr.dtype.element_ty
        write_r = tl.program_id(1) == 0
        # pass 1: the rows' sum of squares of r = x + delta (rounded to x's dtype), in float32 (NORM False: a plain
        # linear layer of x, no pass 1)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:
            for k0 in tl.range(0, k, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                msk = rmask[:, None] & (ks < k)[None, :]
                r = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=msk, other=0.0)
                if HAS_DELTA:
                    dd = tl.load(d_ptr + rows64[:, None] * stride_d + ks[None, :], mask=msk, other=0.0)
                    r = (r.to(tl.float32) + dd.to(tl.float32)).to(dt)
                    if write_r:
                        tl.store(r_ptr + rows64[:, None] * stride_r + ks[None, :], r, mask=msk)
                rf = r.to(tl.float32)
                ss += tl.sum(rf * rf, axis=1)
        rstd = tl.rsqrt(ss / k + eps)
        # pass 2: the normed rows (rounded to x's dtype) against the weight tile(s), float32 accumulation
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if SWIGLU:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k
            msk = rmask[:, None] & kmask[None, :]
            r = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=msk, other=0.0)
            if HAS_DELTA:
                dd = tl.load(d_ptr + rows64[:, None] * stride_d + ks[None, :], mask=msk, other=0.0)
                r = (r.to(tl.float32) + dd.to(tl.float32)).to(dt)
            if NORM:
                nw = tl.load(nw_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
                h = (r.to(tl.float32) * rstd[:, None] * nw[None, :]).to(dt)
            else:
                h = r
            wmask = cmask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :], mask=wmask, other=0.0)
            acc = tl.dot(h, tl.trans(w), acc)
            if SWIGLU:  # the up rows follow the n gate rows
                wu = tl.load(w_ptr + (cols + n).to(tl.int64)[:, None] * stride_w + ks[None, :], mask=wmask, other=0.0)
                acc_up = tl.dot(h, tl.trans(wu), acc_up)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(b_ptr + n + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dt)
        if SWIGLU:  # as adaflash_ray/kernels/swiglu.py: silu of the rounded gate, rounded; the product rounded once
            g = out.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            out = (s * acc_up.to(dt).to(tl.float32)).to(dt)
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], out, mask=rmask[:, None] & cmask[None, :])


#: the launch's warps and pipeline stages: with 64-wide K tiles every row tile below compiles for sm_90 without
#: register spills (4 warps spill from 32 rows, or 16 rows with 128-wide K tiles: ptxas)
NUM_WARPS, NUM_STAGES = 8, 3


def launch_tiles(m: int, k: int, swiglu: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of a launch over ``m`` rows and ``k`` inputs: 16 / 32 / 64 rows, 64 output
    columns (32 gate + 32 up with ``swiglu``), K tiles of 64 (less for a smaller ``k``, at least 16)."""
    return (16 if m <= 16 else (32 if m <= 32 else 64)), (32 if swiglu else 64), min(64, max(16, triton.next_power_of_2(k)))


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
                launch: tuple[int, int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`norm_linear_ref`: one Triton launch over (row tiles, output-column tiles).

    Args:
        x, delta: ``[..., K]`` residual stream and the branch output to add (None: norm only); same dtype and shape.
        norm_weight: ``[K]`` RMSNorm weight (math in float32). eps: its variance epsilon.
        weight: ``[N, K]`` (``nn.Linear`` layout, rows contiguous) in x's dtype; with ``swiglu`` the gate rows then
            the up rows (``N`` even). bias: ``[N]`` or None. norm_weight None: no norm (``y = linear(r)``).
        launch: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` instead of :func:`launch_tiles` and
            :data:`NUM_WARPS` / :data:`NUM_STAGES` (scripts/norm_linear_variants.py times the choices).
    Returns:
        ``(r, y)``: the new residual ``[..., K]`` (``x`` itself when delta is None) and ``[..., N]`` (``[..., N/2]``
        with swiglu), in x's dtype. No host synchronisation, allocations only of the outputs (CUDA-graph capturable).
    Raises:
        RuntimeError: Triton is not installed. ValueError: mismatched shapes or dtypes, an odd ``N`` with swiglu,
            or a ``delta`` without ``norm_weight`` (the residual is written in the norm's pass).
    """
    if not HAVE_TRITON:
        raise RuntimeError("norm_linear needs triton (use norm_linear_ref)")
    k = x.shape[-1]
    n_w = weight.shape[0]
    if ((norm_weight is not None and norm_weight.shape != (k,)) or weight.dim() != 2 or weight.shape[1] != k
            or (delta is not None and delta.shape != x.shape) or (bias is not None and bias.shape != (n_w,))
            or weight.dtype != x.dtype or (swiglu and n_w % 2) or (delta is not None and norm_weight is None)):
        raise ValueError(f"norm_linear: x {tuple(x.shape)} {x.dtype}, delta "
                         f"{None if delta is None else tuple(delta.shape)}, norm_weight "
                         f"{None if norm_weight is None else tuple(norm_weight.shape)}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)}, swiglu {swiglu}")
    n = n_w // 2 if swiglu else n_w
    x2, d2, r, r2 = residual_rows(x, delta)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if m == 0:
        return r, y
    block_m, block_n, block_k, warps, stages = launch or (*launch_tiles(m, k, swiglu), NUM_WARPS, NUM_STAGES)
    _norm_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2, d2, norm_weight if norm_weight is not None else w, w, bias if bias is not None else w, r2,
        y.view(-1, n), m, n, k, float(eps), x2.stride(0), d2.stride(0), r2.stride(0), w.stride(0), n,
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=norm_weight is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return r, y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the same kernel without the norm (one launch, no split-K workspace):
    ``x`` ``[..., K]``, ``weight`` ``[N, K]`` in x's dtype -> ``[..., N]``. Raises as :func:`norm_linear`."""
    return norm_linear(x, None, None, 0.0, weight, bias)[1]
