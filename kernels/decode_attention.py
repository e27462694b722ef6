"""Split-K ("flash-decoding") attention of a decode / verify step over the static KV cache, GQA without K/V copies.

A decode or verify step has few queries (``W <= 16`` positions per row, times ``rep = Hq / Hkv`` query heads per
KV head) against a long cached context, so one program per (row, KV head) leaves most of the GPU idle at small
batch. Flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"; the split-KV
kernels of FlashInfer / vLLM) splits the keys into ``num_splits`` chunks: kernel 1 computes, per (row, KV head,
chunk), the online-softmax partials (Milakov & Gimelshein 2018) of all ``W*rep`` query rows that share that KV
head (the folded layout of :func:`folded_attention`, so K/V are read once per KV head and never repeated);
kernel 2 merges the chunks and writes the output straight into ``o_proj``'s input layout ``[B, W, Hq*D]``.

Visibility is the engine's static-cache rule computed from positions, no mask tensor: query position p of row b
sees cache entries ``0..p`` of its slot (and nothing at or beyond ``span``). Scale ``1/sqrt(D)`` (SDPA's default).

:func:`decode_attention_ref` is the pure-torch reference (SDPA with the additive mask of ``gqa_mask``, exactly
what adaflash_ray/models/target.py computes, from :mod:`adaflash_ray.kernels.reference`); :func:`decode_attention`
the Triton kernels.
"""
from __future__ import annotations

import math

import torch

from adaflash_ray.kernels.reference import folded_attention, gqa_mask
from adaflash_ray.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["block_rows", "decode_attention", "decode_attention_ref", "default_num_splits"]


def decode_attention_ref(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                         positions: torch.Tensor, span: int) -> torch.Tensor:
    """Reference: gather the rows' slots (``k_cache[rows, :span]``), the additive mask of ``gqa_mask`` from
    ``key <= position``, then :func:`folded_attention`.

    Args:
        qg: ``[B, Hkv, W*rep, D]`` folded queries (row ``t*rep + r`` = query head ``g*rep + r`` at position t).
        k_cache, v_cache: ``[slots, S_max, Hkv, D]`` one layer of the static cache.
        rows: ``[B]`` int64 slot of each batch row. positions: ``[B, W]`` int64 (every position < span).
        span: keys considered (host int, ``> max(positions)``).
    Returns:
        ``[B, W, Hq*D]`` in qg's dtype.
    """
    b, hkv, m, _ = qg.shape
    w = positions.shape[1]
    visible = torch.arange(span, device=qg.device)[None, None, :] <= positions[:, :, None]  # [B, W, S]
    mask = gqa_mask(visible, m // w, qg.dtype)
    return folded_attention(qg, k_cache[rows, :span], v_cache[rows, :span], mask, w)


def default_num_splits(span: int, block_n: int = 64) -> int:
    """Chunks per (row, KV head): one per ``block_n`` keys of ``span``. The chunk is ``block_n`` keys whatever the
    batch, width or span, so a query row's partial sums - and their merge - are the same operations in every forward
    that reads its keys: keys past a row's position fall in chunks that contribute exactly 0 to the merge. One
    position's attention is then the same bits in an AR step, a verify block and any batch (a batch-dependent chunk
    changes the reduction order: greedy bf16 output would stop being AR's token for token)."""
    return max(1, math.ceil(span / block_n))


if HAVE_TRITON:
    # one compiled variant for every batch size and width (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit(do_not_specialize=["span", "chunk", "width", "num_splits", "rows_per_head", "stride_qb", "stride_qh",
                                   "stride_qm", "stride_ks", "stride_kp", "stride_kh", "stride_vs", "stride_vp",
                                   "stride_vh"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, acc_ptr, ml_ptr, span, chunk, width, num_splits,
                      rows_per_head, stride_qb, stride_qh, stride_qm, stride_ks, stride_kp, stride_kh, stride_vs,
                      stride_vp, stride_vh, qk_scale, HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)  # b * HKV + g
        split = tl.program_id(1)
        b = bh // HKV
        g = bh % HKV
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # this row tile's folded query rows
        offs_d = tl.arange(0, D)
        m_ok = offs_m < rows_per_head
        q = tl.load(q_ptr + b * stride_qb + g * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        t = offs_m // REP
        qpos = tl.load(pos_ptr + b * width + t, mask=m_ok, other=-1)  # rows beyond W*rep see nothing
        slot = tl.load(rows_ptr + b).to(tl.int64)
        k_base = k_ptr + slot * stride_ks + g * stride_kh
        v_base = v_ptr + slot * stride_vs + g * stride_vh
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        start = split * chunk
        end = tl.minimum(start + chunk, span)
        n0 = start  # a while loop: the CPU interpreter cannot range() over a runtime bound
        while n0 < end:
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            kt = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kp + offs_d[None, :], mask=n_ok[:, None],
                         other=0.0)
            s = tl.dot(q, tl.trans(kt)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            vis = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vp + offs_d[None, :], mask=n_ok[:, None],
                         other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
            n0 += BLOCK_N
        part = bh * num_splits + split  # partials [B*HKV, splits, W*rep, (D | 2)]: the real rows only
        tl.store(acc_ptr + (part * rows_per_head + offs_m[:, None]) * D + offs_d[None, :], acc, mask=m_ok[:, None])
        tl.store(ml_ptr + (part * rows_per_head + offs_m) * 2, m_i, mask=m_ok)
        tl.store(ml_ptr + (part * rows_per_head + offs_m) * 2 + 1, l_i, mask=m_ok)

    @triton.jit(do_not_specialize=["width", "num_splits", "rows_per_head"])
    def _merge_kernel(acc_ptr, ml_ptr, out_ptr, width, num_splits, rows_per_head, HKV: tl.constexpr,
                      REP: tl.constexpr, D: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        row = tl.program_id(1)  # one folded query row t*REP + r
        b = bh // HKV
        g = bh % HKV
        offs_d = tl.arange(0, D)
        one = tl.arange(0, 1)
        m_max = tl.full([1], -1.0e30, tl.float32)
        s = num_splits * 0  # a tensor loop counter (while: see the split kernel)
        while s < num_splits:
            m_max = tl.maximum(m_max, tl.load(ml_ptr + ((bh * num_splits + s) * rows_per_head + row) * 2 + one))
            s += 1
        num = tl.zeros([D], tl.float32)
        den = tl.zeros([1], tl.float32)
        s = num_splits * 0  # a tensor loop counter (while: see the split kernel)
        while s < num_splits:
            base = (bh * num_splits + s) * rows_per_head + row
            wgt = tl.exp2(tl.load(ml_ptr + base * 2 + one) - m_max)
            num += tl.load(acc_ptr + base * D + offs_d) * wgt
            den += tl.load(ml_ptr + base * 2 + 1 + one) * wgt
            s += 1
        o = num / den
        t = row // REP
        r = row % REP
        dst = out_ptr + (b * width + t) * (HKV * REP * D) + (g * REP + r) * D + offs_d
        tl.store(dst, o.to(out_ptr.dtype.element_ty))


def decode_attention(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor, span: int, num_splits: int | None = None,
                     block_n: int = 64, max_width: int = 16) -> torch.Tensor:
    """Split-K :func:`decode_attention_ref` (same arguments and result; two launches, no K/V copy, no mask tensor).

    ``num_splits`` (host int) defaults to :func:`default_num_splits` (``block_n`` keys a chunk: batch-, width- and
    span-invariant results per query row; another value trades that for fewer partials).
    Every query row must see at least one key (positions >= 0), as in the reference. ``head_dim`` must be a power
    of two >= 16 and ``W*rep <= 128``; the query rows go in tiles of :func:`block_rows` rows (16 or 32: the same
    instruction path for every width, so a row's bits do not depend on the width it is verified in), and the first
    call compiles the tiles of every width up to ``max_width`` (so a CUDA-graph capture of a new width finds its
    kernel compiled). No host synchronisation; scratch ``[B*Hkv, splits, W*rep, D + 2]`` float32 (the real rows
    only) comes from the caching allocator (CUDA-graph capturable). On CUDA the float32 path's dot products run in
    TF32 (Triton's default); the engine's bf16 path is unaffected.

    Raises:
        RuntimeError: Triton is not installed.
        ValueError: unsupported head_dim / query rows, or mis-shaped inputs.
    """
    if not HAVE_TRITON:
        raise RuntimeError("decode_attention needs triton (use decode_attention_ref)")
    b, hkv, m, d = qg.shape
    w = positions.shape[1]
    if (d < 16 or d & (d - 1) or m % w or m > 128 or positions.shape[0] != b or rows.shape != (b,)
            or k_cache.shape[-2:] != (hkv, d) or v_cache.shape != k_cache.shape or qg.stride(-1) != 1):
        raise ValueError(f"decode_attention: qg {tuple(qg.shape)}, cache {tuple(k_cache.shape)}, positions "
                         f"{tuple(positions.shape)}, rows {tuple(rows.shape)}")
    rep = m // w
    out = torch.empty((b, w, hkv * rep * d), dtype=qg.dtype, device=qg.device)
    if b == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(span, block_n)
    positions, rows = positions.contiguous(), rows.contiguous()
    _compile_variants(qg, k_cache, v_cache, rows, positions, rep, block_n, max_width)
    _launch(qg, k_cache, v_cache, rows, positions, span, num_splits, block_n, out)
    return out


#: the largest query-row tile up to head_dim 64 (16 rows above: a 32-row tile at head_dim 128 spills registers on
#: sm_90 at 8 warps). A 64-row tile's dot products take another instruction path on sm_90 (wgmma): its rows' sums
#: are not the 16- and 32-row tiles' bits, so a width-16 verify row would differ from the AR step's.
MAX_BLOCK_ROWS = 32


def block_rows(m: int, d: int = 64) -> int:
    """The query-row tile of ``m = W * rep`` folded query rows at head_dim ``d``: the next power of two >= max(m, 16),
    at most :data:`MAX_BLOCK_ROWS` (32 up to head_dim 64, 16 above; more rows take several tiles, each reading the
    chunk's keys; a decode step's ``rep`` rows do not pay for a 16-position tile)."""
    p2 = triton.next_power_of_2(m) if HAVE_TRITON else 1 << max(0, (m - 1).bit_length())
    return min(MAX_BLOCK_ROWS if d <= 64 else 16, max(16, p2))


_COMPILED: set = set()


def _compile_variants(qg, k_cache, v_cache, rows, positions, rep: int, block_n: int, max_width: int) -> None:
    """Compile every query-row tile that widths ``1..max_width`` need, once per (device, dtype, Hkv, rep, D), by
    launching each on the first row (outside any CUDA-graph capture: a capture may not load a module, and the
    engine captures new step shapes without an eager warm-up). Later calls, captured or not, find them compiled."""
    b, hkv, _, d = qg.shape
    key = (qg.device, qg.dtype, k_cache.dtype, hkv, rep, d, block_n, max_width)
    if key in _COMPILED or (qg.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    _COMPILED.add(key)
    done = set()
    for w in range(1, max_width + 1):
        if w * rep > 128 or block_rows(w * rep, d) in done:
            continue
        done.add(block_rows(w * rep, d))
        pos = positions[:1, :1].expand(1, w).contiguous()
        q = qg.new_zeros((1, hkv, w * rep, d))
        _launch(q, k_cache, v_cache, rows[:1], pos, min(block_n, k_cache.shape[1]), 1, block_n,
                qg.new_empty((1, w, hkv * rep * d)))  # keys 0..block_n-1 only: key 0 is visible to every row


def _launch(qg, k_cache, v_cache, rows, positions, span: int, num_splits: int, block_n: int,
            out: torch.Tensor) -> None:
    """The two kernels of :func:`decode_attention` into ``out`` ``[B, W, Hq*D]``."""
    b, hkv, m, d = qg.shape
    w = positions.shape[1]
    rep = m // w
    chunk = triton.cdiv(triton.cdiv(span, num_splits), block_n) * block_n
    num_splits = triton.cdiv(span, chunk)
    block_m = block_rows(m, d)
    acc = torch.empty((b * hkv, num_splits, m, d), dtype=torch.float32, device=qg.device)
    ml = torch.empty((b * hkv, num_splits, m, 2), dtype=torch.float32, device=qg.device)
    qk_scale = (1.0 / math.sqrt(d)) * 1.4426950408889634  # log2(e): exp2 in the kernel
    _split_kernel[(b * hkv, num_splits, triton.cdiv(m, block_m))](
        qg, k_cache, v_cache, rows, positions, acc, ml, span, chunk, w, num_splits, m, qg.stride(0), qg.stride(1),
        qg.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), qk_scale, HKV=hkv, REP=rep, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=8 if d >= 128 else 4, num_stages=2)  # sm_90 ptxas: D=128 at 4 warps spills (255 registers)
    _merge_kernel[(b * hkv, m)](acc, ml, out, w, num_splits, m, HKV=hkv, REP=rep, D=d, num_warps=1)
