"""A pre-norm layer's residual add, RMSNorm and the linear layer after it in one kernel (optionally with the SwiGLU
product of a fused gate/up projection as its epilogue).

A pre-norm decoder layer computes ``r = x + delta``, ``h = rmsnorm(r) * w_norm`` and then a GEMM of ``h``: the
fused q/k/v projection before attention, the fused gate/up projection (then ``silu(g) * u``, Shazeer 2020) before
the MLP's down projection. :func:`norm_linear` does the three (four) in one launch: each program finds its rows'
``rsqrt(mean(r^2) + eps)`` in a first pass over ``K`` and feeds the normed rows, rounded to the input dtype as
:func:`~adaflash_ray.kernels.fused_norm.add_rmsnorm` writes them, to its share of the GEMM chunk by chunk in a
second (the rows' ``K`` values are re-read from L2, never written normed). The programs of the first group of
output columns also write ``r``. So a layer needs no separate norm kernel, no normed activation in memory and,
with ``swiglu``, no ``[M, 2I]`` gate/up output: per decode layer the launches are q/k/v, rotary + cache write,
attention, o_proj, gate/up + SwiGLU, down - six with o_proj and down_proj by :func:`linear` and a one-pass
attention, against the unfused path's two norms and a SwiGLU more (and cuBLAS's split-K workspace
memsets and reductions where it picks split-K).

Two forms of the kernel, by the number of rows ``M`` (:func:`norm_linear` chooses):

- the GEMV form (``M <= 16``, :data:`GEMV_MAX_ROWS`: decode batches and verify widths), the shape decode runs at:
  the weight ``[N, K]`` is all that is worth reading, each output feature one contiguous ``K`` row of it. A program
  owns a few output features (with ``swiglu`` the gate rows ``j`` and the up rows ``I + j``, so the epilogue is
  local) and every row, so the grid is ``N / BLOCK_N`` programs - 512 to 3072 at the 8B model's widths, several
  per SM, each streaming its weight rows once along ``K``: one launch, no split-K. One row:
  float32 FMAs into a ``[BLOCK_N, BLOCK_K]`` accumulator summed once at the end (a tensor-core tile would be 15/16
  padding); 2-16 rows: ``tl.dot`` on a 16-row tile. Each program finds the rows' norm statistic itself in a first
  pass over x and delta (``M x K``, at most 16 x 4096 bf16 = 128 KB, L2-resident), not over the weight;
- the tiled form (more rows): a program per tile of rows and of output columns, ``tl.dot`` tile by tile. At
  hundreds of rows the re-read normed input costs more than a separate norm would; the caller chooses
  (``ADAFLASH_FUSED_LINEAR``, :func:`mode`).

One kernel serves both (the one-row accumulator is the only code the GEMV form adds). Its loads are 16-byte
vectors only where ``K`` and the row strides are multiples of 8 elements: the kernel takes them unspecialised, so
the launch says so (``ALIGNED``); otherwise it loads one element at a time, correct but slow. :func:`linear` is
the same kernel without the norm: a plain linear layer in one launch (o_proj and down_proj with
``ADAFLASH_FUSED_LINEAR=all``).

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
from adaflash_ray.kernels.triton_support import HAVE_TRITON, ticket_counters, tl, triton

__all__ = ["ENV_VAR", "GEMV_MAX_ROWS", "MODES", "gemv_launch", "layer_mode", "linear", "linear_add_norm", "mode",
           "norm_linear", "norm_linear_ref"]

#: ``off`` (default) / ``on`` / ``all`` / ``decode``: whether the fused layer stack uses :func:`norm_linear` for the
#: GEMMs after a norm (``on``), and :func:`linear` for o_proj and down_proj too (``all``: no cuBLAS GEMM, none of its
#: split-K workspace memsets and reductions); ``decode``: ``all`` for a forward of at most :data:`GEMV_MAX_ROWS`
#: token rows (batch x width: decode and verify steps, the GEMV form), ``off`` for larger ones (prefill, wide
#: batches); ``residual``: only o_proj and down_proj (the GEMMs whose outputs join the residual stream) by
#: :func:`linear_add_norm` for a forward of at most :data:`GEMV_MAX_ROWS` token rows - the SwiGLU product in
#: down_proj's loads, the residual add + next RMSNorm in both epilogues; q/k/v and gate/up stay cuBLAS -, ``off``
#: above; read at each forward
ENV_VAR = "ADAFLASH_FUSED_LINEAR"
MODES = ("off", "on", "all", "decode", "residual")


def mode() -> str:
    """``"off"``, ``"on"``, ``"all"``, ``"decode"`` or ``"residual"`` from ``ADAFLASH_FUSED_LINEAR`` (unset: off;
    ``1`` / ``true``: on). Raises ValueError on another value."""
    raw = os.environ.get(ENV_VAR, "off").strip().lower()
    if raw in ("on", "1", "true", "yes"):
        return "on"
    if raw in ("0", "false", "no", ""):
        return "off"
    if raw in MODES:
        return raw
    raise ValueError(f"{ENV_VAR}={raw!r}: expected one of {', '.join(MODES)}")


def layer_mode(rows: int) -> str:
    """The mode a forward of ``rows`` token rows runs in: :func:`mode`, with ``decode`` resolved to ``all`` and
    ``residual`` kept (``rows`` <= :data:`GEMV_MAX_ROWS`), both ``off`` above."""
    m = mode()
    if m in ("decode", "residual"):
        return ("all" if m == "decode" else m) if rows <= GEMV_MAX_ROWS else "off"
    return m


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
    @triton.jit
    def _aligned(k, stride_x, stride_d, stride_r, stride_w):
        """``K`` and the row strides as multiples of 8 elements the compiler can see (``v // 8 * 8``: the same
        values where the caller's ``ALIGNED`` holds): with the 16-byte-aligned base pointers Triton specialises on,
        the ``K`` chunks then load as 16-byte vectors instead of one element a load."""
        return k // 8 * 8, stride_x // 8 * 8, stride_d // 8 * 8, stride_r // 8 * 8, stride_w // 8 * 8

    @triton.jit
    def _residual(x_ptr, d_ptr, rows64, ks, msk, stride_x, stride_d, HAS_DELTA: tl.constexpr):
        """``r = x + delta`` rounded to x's dtype (``x`` without delta) at rows ``rows64`` x columns ``ks``."""
        r = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=msk, other=0.0)
        if HAS_DELTA:
            dd = tl.load(d_ptr + rows64[:, None] * stride_d + ks[None, :], mask=msk, other=0.0)
            r = (r.to(tl.float32) + dd.to(tl.float32)).to(x_ptr.dtype.element_ty)
        return r

    @triton.jit
    def _rows_rstd(x_ptr, d_ptr, r_ptr, rows64, rmask, k, eps, stride_x, stride_d, stride_r, write_r,
                   HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """Pass 1: the rows' ``rsqrt(mean(r^2) + eps)`` in float32 over ``K`` in ``BLOCK_K`` chunks; where
        ``write_r``, the new residual ``r`` is stored too."""
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            msk = rmask[:, None] & (ks < k)[None, :]
            r = _residual(x_ptr, d_ptr, rows64, ks, msk, stride_x, stride_d, HAS_DELTA)
            if HAS_DELTA:
                if write_r:
                    tl.store(r_ptr + rows64[:, None] * stride_r + ks[None, :], r, mask=msk)
            rf = r.to(tl.float32)
            ss += tl.sum(rf * rf, axis=1)
        return tl.rsqrt(ss / k + eps)

    @triton.jit
    def _normed(x_ptr, d_ptr, nw_ptr, rows64, rmask, ks, kmask, rstd, stride_x, stride_d, k,
                HAS_DELTA: tl.constexpr, NORM: tl.constexpr, SWIGLU_IN: tl.constexpr = False):
        """The rows' ``K`` chunk ``ks`` as the GEMM reads it: ``r * rstd * w_norm`` rounded to x's dtype (``r``
        itself without the norm). ``SWIGLU_IN`` (no norm): x holds gate then up (``2K`` columns) and the chunk is
        their SwiGLU product as adaflash_ray/kernels/swiglu.py rounds it (silu of the gate rounded, the product
        rounded once)."""
        if SWIGLU_IN:
            msk = rmask[:, None] & kmask[None, :]
            row = x_ptr + rows64[:, None] * stride_x + ks[None, :]
            g = tl.load(row, mask=msk, other=0.0).to(tl.float32)
            u = tl.load(row + k, mask=msk, other=0.0).to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
            return (sg * u).to(x_ptr.dtype.element_ty)
        r = _residual(x_ptr, d_ptr, rows64, ks, rmask[:, None] & kmask[None, :], stride_x, stride_d, HAS_DELTA)
        if NORM:
            # [1, BLOCK_K], loaded in x's layout (a 1-D load would take another, converted in every chunk)
            nw = tl.load(nw_ptr + ks[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
            r = (r.to(tl.float32) * rstd[:, None] * nw).to(x_ptr.dtype.element_ty)
        return r

    @triton.jit
    def _store_output(acc, acc_up, b_ptr, y_ptr, rows64, rmask, cols, cmask, n, stride_y,
                      HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
        """Bias, rounding (and the SwiGLU product of the gate ``acc`` and up ``acc_up`` accumulators, as
        adaflash_ray/kernels/swiglu.py: silu of the rounded gate, rounded; the product rounded once), store."""
        dt = y_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(b_ptr + n + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dt)
        if SWIGLU:
            g = out.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            out = (s * acc_up.to(dt).to(tl.float32)).to(dt)
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], out, mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _add_norm_epilogue(acc, d_ptr, nw_ptr, r_ptr, y_ptr, cnt_ptr, rows64, rmask, cols, cmask, n, eps, stride_d,
                           stride_r, stride_y, BLOCK_M: tl.constexpr, NORM_BLOCK_N: tl.constexpr):
        """``r = residual + y`` (``y`` rounded to the output dtype first, as the unfused GEMM returns it; ``r``
        rounded: :func:`_residual`'s add) stored for this program's columns; then the row tile's last program to
        finish (an atomic ticket per row tile, reset by it) reads all ``n`` columns of ``r`` back and writes
        ``RMSNorm(r) * w`` into ``y_ptr`` (:func:`_rows_rstd` / :func:`_normed`'s arithmetic)."""
        dt = y_ptr.dtype.element_ty
        msk = rmask[:, None] & cmask[None, :]
        res = tl.load(d_ptr + rows64[:, None] * stride_d + cols[None, :], mask=msk, other=0.0)
        r = (res.to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
        tl.store(r_ptr + rows64[:, None] * stride_r + cols[None, :], r, mask=msk)
        tl.debug_barrier()  # every thread's columns stored before the ticket (released with it)
        counter = cnt_ptr + tl.program_id(0)
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c0 in tl.range(0, n, NORM_BLOCK_N):
                cs = c0 + tl.arange(0, NORM_BLOCK_N)
                m2 = rmask[:, None] & (cs < n)[None, :]
                rr = tl.load(r_ptr + rows64[:, None] * stride_r + cs[None, :], mask=m2, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                ss += tl.sum(rr * rr, axis=1)
            rstd = tl.rsqrt(ss / n + eps)
            for c0 in tl.range(0, n, NORM_BLOCK_N):
                cs = c0 + tl.arange(0, NORM_BLOCK_N)
                m2 = rmask[:, None] & (cs < n)[None, :]
                rr = tl.load(r_ptr + rows64[:, None] * stride_r + cs[None, :], mask=m2, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                nw = tl.load(nw_ptr + cs[None, :], mask=(cs < n)[None, :], other=0.0).to(tl.float32)
                tl.store(y_ptr + rows64[:, None] * stride_y + cs[None, :], (rr * rstd[:, None] * nw).to(dt), mask=m2)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch

    # one compiled variant for every batch size and width (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit(do_not_specialize=["m", "n", "k", "stride_x", "stride_d", "stride_r", "stride_w", "stride_y"])
    def _norm_linear_kernel(x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, r_ptr, y_ptr, cnt_ptr, m, n, k, eps,
                            stride_x, stride_d, stride_r, stride_w, stride_y,
                            HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            NORM_BLOCK_K: tl.constexpr, NORM: tl.constexpr = True, ALIGNED: tl.constexpr = False,
                            SWIGLU_IN: tl.constexpr = False, ADD_NORM: tl.constexpr = False):
        """A program per (``BLOCK_M`` row tile, ``BLOCK_N`` output features - with ``SWIGLU`` the gate rows of the
        weight and the matching up rows, so the epilogue is local), each weight row streamed along its contiguous
        ``K`` in ``BLOCK_K`` chunks. ``BLOCK_M`` 1 (the one-row GEMV form): float32 FMAs into a
        ``[BLOCK_N, BLOCK_K]`` accumulator summed over ``K`` once at the end (no tensor-core tile to fill);
        16 and more: ``tl.dot`` chunk by chunk. Pass 1 reads the rows (x and delta, not the weight) in
        ``NORM_BLOCK_K`` chunks. ``SWIGLU_IN``: the input is a gate/up output ``[m, 2K]``, multiplied in the loads
        (:func:`_normed`; no norm). ``ADD_NORM`` (no norm before): the output is added to the residual ``d_ptr``
        into ``r_ptr`` and ``y_ptr`` receives its RMSNorm by ``nw_ptr`` (:func:`_add_norm_epilogue`, chunks of
        ``NORM_BLOCK_K`` columns)."""
        if ALIGNED:  # 16-byte vectors along K: the loads vectorise and the pipeliner can stage them
            k, stride_x, stride_d, stride_r, stride_w = _aligned(k, stride_x, stride_d, stride_r, stride_w)
            if ADD_NORM:  # the epilogue's row pass too (the caller's ALIGNED then covers n and the output stride)
                n, stride_y = n // 8 * 8, stride_y // 8 * 8
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < m, cols < n
        rows64 = rows.to(tl.int64)
        # pass 1: the rows' norm statistic (the programs of the first column group write r); NORM False: a plain
        # linear layer of x, no pass 1
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM and not ADD_NORM:
            rstd = _rows_rstd(x_ptr, d_ptr, r_ptr, rows64, rmask, k, eps, stride_x, stride_d, stride_r,
                              tl.program_id(1) == 0, HAS_DELTA, BLOCK_M, NORM_BLOCK_K)
        # pass 2: the normed rows (rounded to x's dtype) against the weight rows, float32 accumulation
        if BLOCK_M == 1:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc2_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k
            h = _normed(x_ptr, d_ptr, nw_ptr, rows64, rmask, ks, kmask, rstd, stride_x, stride_d, k, HAS_DELTA,
                        NORM and not ADD_NORM, SWIGLU_IN)
            wmask = cmask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :], mask=wmask, other=0.0)
            if BLOCK_M == 1:
                hf = h.to(tl.float32)  # [1, BLOCK_K], broadcast over the BLOCK_N weight rows
                acc2 += hf * w.to(tl.float32)
            else:
                acc = tl.dot(h, tl.trans(w), acc)
            if SWIGLU:  # the up rows follow the n gate rows
                wu = tl.load(w_ptr + (cols + n).to(tl.int64)[:, None] * stride_w + ks[None, :], mask=wmask, other=0.0)
                if BLOCK_M == 1:
                    acc2_up += hf * wu.to(tl.float32)
                else:
                    acc_up = tl.dot(h, tl.trans(wu), acc_up)
        if BLOCK_M == 1:
            acc = tl.sum(acc2, axis=1)[None, :]
            acc_up = tl.sum(acc2_up, axis=1)[None, :]
        if ADD_NORM:
            _add_norm_epilogue(acc, d_ptr, nw_ptr, r_ptr, y_ptr, cnt_ptr, rows64, rmask, cols, cmask, n, eps, stride_d,
                               stride_r, stride_y, BLOCK_M, NORM_BLOCK_K)
        else:
            _store_output(acc, acc_up, b_ptr, y_ptr, rows64, rmask, cols, cmask, n, stride_y, HAS_BIAS, SWIGLU)


#: the launch's warps and pipeline stages: with 64-wide K tiles every row tile below compiles for sm_90 without
#: register spills (4 warps spill from 32 rows, or 16 rows with 128-wide K tiles: ptxas)
NUM_WARPS, NUM_STAGES = 8, 3


def launch_tiles(m: int, k: int, swiglu: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of a launch over ``m`` rows and ``k`` inputs: 16 / 32 / 64 rows, 64 output
    columns (32 gate + 32 up with ``swiglu``), K tiles of 64 (less for a smaller ``k``, at least 16)."""
    return (16 if m <= 16 else (32 if m <= 32 else 64)), (32 if swiglu else 64), min(64, max(16, triton.next_power_of_2(k)))


#: the most rows the GEMV form (:func:`gemv_launch`) takes by default: decode batches and verify widths up to 16
GEMV_MAX_ROWS = 16


def gemv_launch(m: int, k: int, swiglu: bool = False) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` of the GEMV form over ``m`` rows (1-16) and ``k``
    inputs. One row: 8 output features a program (4 gate + 4 up rows with ``swiglu``: 512-3072 programs at the
    8B model's widths) and ``K`` chunks of 1024 in 4 warps - 32 lanes x 4 warps x 8 elements, one 16-byte bf16
    vector a lane on each weight row, so the x chunk and the weight chunk load in the accumulator's layout (no
    layout conversion in the loop). 2-16 rows: ``tl.dot`` on 16-row tiles, 16 output features (16 gate + 16 up),
    128-wide ``K`` tiles, 4 warps, 3 pipeline stages. Chunks shrink to ``k`` (at least 16). Raises ValueError for
    ``m`` outside 1-16."""
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv_launch: {m} rows (the GEMV form takes 1-{GEMV_MAX_ROWS})")
    kp = max(16, triton.next_power_of_2(k))
    if m == 1:
        return 1, (4 if swiglu else 8), min(1024, kp), 4, 1
    return 16, 16, min(128, kp), 4, 3


def norm_chunk(block_m: int, block_k: int, k: int) -> int:
    """The GEMV form's pass-1 ``K`` chunk: 4096 row elements (all of a 4096-wide row at one row: one round trip to
    L2), never under ``block_k`` nor over ``k`` rounded up to a power of two."""
    return min(triton.next_power_of_2(k), max(block_k, 4096 // block_m))


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
                launch: tuple[int, int, int, int, int] | None = None, gemv: bool | None = None,
                swiglu_in: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`norm_linear_ref`: one Triton launch, in the GEMV form over output features for up to
    :data:`GEMV_MAX_ROWS` rows, else in the tiled form over (row tiles, output-column tiles).

    Args:
        x, delta: ``[..., K]`` residual stream and the branch output to add (None: norm only); same dtype and shape.
        norm_weight: ``[K]`` RMSNorm weight (math in float32). eps: its variance epsilon.
        weight: ``[N, K]`` (``nn.Linear`` layout, rows contiguous) in x's dtype; with ``swiglu`` the gate rows then
            the up rows (``N`` even). bias: ``[N]`` or None. norm_weight None: no norm (``y = linear(r)``).
        launch: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` instead of :func:`gemv_launch`, or
            :func:`launch_tiles` and :data:`NUM_WARPS` / :data:`NUM_STAGES` (scripts/norm_linear_variants.py times
            the choices). gemv: the form (None: GEMV iff the rows are at most :data:`GEMV_MAX_ROWS`; True over
            more rows: 16-row tiles, or the launch's).
        swiglu_in: ``x`` ``[..., 2K]`` is a gate/up GEMM output (gate, then up) and the GEMM's input is its SwiGLU
            product (:func:`adaflash_ray.kernels.swiglu.swiglu_ref`, bit for bit the ``swiglu`` kernel's), computed
            as the chunks load; no delta, no norm.
    Returns:
        ``(r, y)``: the new residual ``[..., K]`` (``x`` itself when delta is None) and ``[..., N]`` (``[..., N/2]``
        with swiglu), in x's dtype. No host synchronisation, allocations only of the outputs (CUDA-graph capturable).
    Raises:
        RuntimeError: Triton is not installed. ValueError: mismatched shapes or dtypes, an odd ``N`` with swiglu,
            a ``delta`` without ``norm_weight`` (the residual is written in the norm's pass), or a launch whose row
            tile is neither 1 nor at least 16.
    """
    if not HAVE_TRITON:
        raise RuntimeError("norm_linear needs triton (use norm_linear_ref)")
    k = x.shape[-1] // 2 if swiglu_in else x.shape[-1]
    n_w = weight.shape[0]
    if (swiglu_in and (x.shape[-1] % 2 or norm_weight is not None or delta is not None)):
        raise ValueError(f"norm_linear: swiglu_in takes gate/up rows (an even width, {x.shape[-1]}) and no "
                         f"delta or norm")
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
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    _launch(x2, d2, norm_weight, weight, bias, r2, y.view(-1, n), n, k, eps, launch, gemv,
            HAS_DELTA=delta is not None, SWIGLU=swiglu, NORM=norm_weight is not None, SWIGLU_IN=swiglu_in)
    return r, y


def _launch(x2, d2, norm_weight, weight, bias, r2, y2, n: int, k: int, eps: float, launch, gemv,
            **flags) -> None:
    """The kernel over rows ``x2`` ``[m, K or 2K]`` into ``y2`` ``[m, n]`` (the GEMV form up to
    :data:`GEMV_MAX_ROWS` rows, else the tiled form; ``launch`` / ``gemv`` as :func:`norm_linear`'s)."""
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    if m == 0:
        return
    swiglu = flags.get("SWIGLU", False)
    if m <= GEMV_MAX_ROWS if gemv is None else gemv:  # grid: (1 row tile, N / BLOCK_N feature groups)
        block_m, block_n, block_k, warps, stages = launch or gemv_launch(min(m, GEMV_MAX_ROWS), k, swiglu)
        norm_block_k = norm_chunk(block_m, block_k, k)
    else:
        block_m, block_n, block_k, warps, stages = launch or (*launch_tiles(m, k, swiglu), NUM_WARPS, NUM_STAGES)
        norm_block_k = block_k
    if flags.get("ADD_NORM"):  # the epilogue's chunks run over the n output columns
        norm_block_k = norm_chunk(block_m, 16, n)
    if 1 < block_m < 16:
        raise ValueError(f"norm_linear: a row tile of {block_m} (1, or 16 and more for tl.dot)")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    counters = ticket_counters(x2.device, grid[0]) if flags.get("ADD_NORM") else w
    _norm_linear_kernel[grid](
        x2, d2, norm_weight if norm_weight is not None else w, w, bias if bias is not None else w, r2,
        y2, counters, m, n, k, float(eps), x2.stride(0), d2.stride(0), r2.stride(0), w.stride(0), y2.stride(0),
        HAS_BIAS=bias is not None, **{"HAS_DELTA": False, "SWIGLU": False, "NORM": False, **flags},
        ALIGNED=all(v % 8 == 0 for v in (k, x2.stride(0), d2.stride(0), r2.stride(0), w.stride(0))
                    + ((n, y2.stride(0)) if flags.get("ADD_NORM") else ())),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM_BLOCK_K=norm_block_k, num_warps=warps,
        num_stages=stages)


def linear_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, swiglu_in: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + F.linear(x, weight)`` and ``RMSNorm(r) * norm_weight`` in one launch (the GEMV / tiled
    kernel of :func:`norm_linear` with the add + norm as its epilogue: the last program of a row tile to finish
    reads the row back and norms it): what ``add_rmsnorm(residual, linear(x, weight), norm_weight, eps)`` returns
    (the GEMM output rounded to x's dtype before the add, as there). A layer's o_proj / down_proj fused with the
    next norm.

    Args:
        x: ``[..., K]`` (``[..., 2K]`` gate/up rows with ``swiglu_in``, :func:`linear`). weight: ``[N, K]`` in x's
            dtype. residual: ``[..., N]``. norm_weight: ``[N]``. eps: the norm's epsilon.
    Returns:
        ``(r, h)`` ``[..., N]`` each in x's dtype. No host synchronisation; launches must not overlap on two
        streams (:func:`adaflash_ray.kernels.triton_support.ticket_counters`).
    Raises:
        RuntimeError: Triton is not installed. ValueError: mismatched shapes or dtypes.
    """
    if not HAVE_TRITON:
        raise RuntimeError("linear_add_norm needs triton")
    k = x.shape[-1] // 2 if swiglu_in else x.shape[-1]
    n = weight.shape[0]
    if (weight.dim() != 2 or weight.shape[1] != k or (swiglu_in and x.shape[-1] % 2) or weight.dtype != x.dtype
            or residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype or norm_weight.shape != (n,)):
        raise ValueError(f"linear_add_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, residual {tuple(residual.shape)} {residual.dtype}, norm_weight "
                         f"{tuple(norm_weight.shape)}, swiglu_in {swiglu_in}")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    d2 = residual.reshape(-1, n)
    d2 = d2 if d2.stride(-1) == 1 else d2.contiguous()
    r = torch.empty(residual.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(r)
    _launch(x2, d2, norm_weight, weight, None, r.view(-1, n), h.view(-1, n), n, k, eps, None, None,
            SWIGLU_IN=swiglu_in, ADD_NORM=True)
    return r, h


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           swiglu_in: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the same kernel without the norm (one launch, no split-K workspace):
    ``x`` ``[..., K]``, ``weight`` ``[N, K]`` in x's dtype -> ``[..., N]``; ``swiglu_in``: ``x`` ``[..., 2K]`` is a
    gate/up output and the input is its SwiGLU product (``F.linear(swiglu(x), weight, bias)`` in one launch). Raises
    as :func:`norm_linear`."""
    return norm_linear(x, None, None, 0.0, weight, bias, swiglu_in=swiglu_in)[1]
