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
from adaflash_ray.kernels.triton_support import HAVE_TRITON, ticket_counters, tl, triton

__all__ = ["block_rows", "decode_attention", "decode_attention_ref", "default_num_splits",
           "rotary_decode_attention", "rotary_decode_attention_ref"]


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


def default_num_splits(batch: int, hkv: int, row_programs: int, span: int, num_sms: int, block_n: int = 64,
                       rows: int = 1) -> int:
    """Programs per (row, KV head, row programs): 1 (one pass over every key tile, no partials) once the one-pass
    launch's ``batch * hkv * row_programs`` programs, weighted by ``1 + rows / 32``, reach half the ``num_sms``
    multiprocessors; else one per ``block_n``-key tile of ``span`` (flash-decoding's split, partials merged after).
    The weight: a tile's float32 partial of ``rows`` folded query rows is ``rows / 64`` of its K/V bytes, written and
    read back, so wide GQA verify blocks leave the split sooner. Either way the result is the same bits (see
    :func:`decode_attention`): this only chooses the faster launch (the thresholds are fitted to H100 timings of
    the SmolLM2 and Qwen3-8B shapes; results/NOTES.md)."""
    if 2 * batch * hkv * row_programs * (1 + rows / 32) >= num_sms:
        return 1
    return max(1, math.ceil(span / block_n))


_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); 1 elsewhere (the interpreter: every split is as good)."""
    if device.type != "cuda":
        return 1
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


if HAVE_TRITON:
    @triton.jit
    def _merge_partial(m, l, a, m_t, l_t, a_t):
        """One key tile's softmax partial ``(m_t, l_t, a_t)`` merged into the running state ``(m, l, a)`` (rows
        ``[M]``, ``[M]``, ``[M, D]``): the same operations - explicit fused multiply-adds, so the compiler contracts
        nothing differently - in the one-pass kernel and in the merge of stored partials."""
        m_new = tl.maximum(m, m_t)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_t - m_new)
        l = tl.fma(l, alpha, l_t * beta)
        a = tl.fma(a, alpha[:, None], a_t * beta[:, None])
        return m_new, l, a

    # one compiled variant for every batch size and width (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit
    def _tile_partial(q, kt, vt, qpos, offs_n, qk_scale):
        """One key tile's softmax partial for a query-row tile, from nothing: ``(m_t, l_t, a_t)`` (running max in log2
        units, sum of exp2, unnormalised output ``[M, D]``); keys past a row's position count as absent."""
        s = tl.dot(q, tl.trans(kt)) * qk_scale  # [M, BLOCK_N], log2 units
        s = tl.where(offs_n[None, :] <= qpos[:, None], s, float("-inf"))  # (positions < span: keys < span too)
        m_t = tl.maximum(tl.max(s, axis=1), -1.0e30)
        p = tl.exp2(s - m_t[:, None])
        return m_t, tl.sum(p, axis=1), tl.dot(p.to(vt.dtype), vt)

    @triton.jit
    def _store_partial(acc_ptr, ml_ptr, part, rows_per_head, offs_m, offs_d, m_ok, m_t, l_t, a_t, D: tl.constexpr):
        """A tile's partial into the scratch ``[B*HKV, num_tiles, W*rep, (D | 2)]`` (the real rows only)."""
        tl.store(acc_ptr + (part * rows_per_head + offs_m[:, None]) * D + offs_d[None, :], a_t, mask=m_ok[:, None])
        tl.store(ml_ptr + (part * rows_per_head + offs_m) * 2, m_t, mask=m_ok)
        tl.store(ml_ptr + (part * rows_per_head + offs_m) * 2 + 1, l_t, mask=m_ok)

    @triton.jit
    def _key_tiles(q, q1, qpos, qpos1, k_base, v_base, acc_ptr, ml_ptr, bh, first, last, span, num_tiles,
                   rows_per_head, offs_m, offs_m1, m_ok, m_ok1, offs_d, qk_scale, HKV: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS: tl.constexpr, SUB: tl.constexpr):
        """Key tiles ``first .. last - 1`` of one (row, KV head) for one or two (``SUB``) query-row tiles: each
        tile's own partial, from nothing (the same bits whichever program or pass computes it), stored
        (``PARTIALS``) or merged into the running states, which are returned ``(m, l, a, m1, l1, a1)`` (the empty
        state where stored)."""
        m_s = tl.full([BLOCK_M], -1.0e30, tl.float32)  # the empty state: merging a partial into it gives the partial
        l_s = tl.zeros([BLOCK_M], tl.float32)
        a_s = tl.zeros([BLOCK_M, D], tl.float32)
        m_s1 = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_s1 = tl.zeros([BLOCK_M], tl.float32)
        a_s1 = tl.zeros([BLOCK_M, D], tl.float32)
        for tile in tl.range(first, last):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < span
            kt = tl.load(k_base + offs_n[:, None].to(tl.int64) * (HKV * D) + offs_d[None, :], mask=n_ok[:, None],
                         other=0.0)
            vt = tl.load(v_base + offs_n[:, None].to(tl.int64) * (HKV * D) + offs_d[None, :], mask=n_ok[:, None],
                         other=0.0)
            m_t, l_t, a_t = _tile_partial(q, kt, vt, qpos, offs_n, qk_scale)
            if PARTIALS:
                _store_partial(acc_ptr, ml_ptr, bh * num_tiles + tile, rows_per_head, offs_m, offs_d, m_ok, m_t,
                               l_t, a_t, D)
            else:
                m_s, l_s, a_s = _merge_partial(m_s, l_s, a_s, m_t, l_t, a_t)
            if SUB == 2:
                m_t1, l_t1, a_t1 = _tile_partial(q1, kt, vt, qpos1, offs_n, qk_scale)
                if PARTIALS:
                    _store_partial(acc_ptr, ml_ptr, bh * num_tiles + tile, rows_per_head, offs_m1, offs_d, m_ok1,
                                   m_t1, l_t1, a_t1, D)
                else:
                    m_s1, l_s1, a_s1 = _merge_partial(m_s1, l_s1, a_s1, m_t1, l_t1, a_t1)
        return m_s, l_s, a_s, m_s1, l_s1, a_s1

    # the caches' strides in units of a position (HKV*D elements, a constexpr): the compiler then knows every key row
    # starts 16-byte aligned and loads it in vectors (runtime element strides would leave it 2-byte loads)
    @triton.jit(do_not_specialize=["span", "width", "num_tiles", "tiles_per_program", "rows_per_head", "stride_qb",
                                   "stride_qh", "stride_qm", "k_slot_stride", "v_slot_stride"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, out_ptr, acc_ptr, ml_ptr, span, width, num_tiles,
                      tiles_per_program, rows_per_head, stride_qb, stride_qh, stride_qm, k_slot_stride, v_slot_stride,
                      qk_scale, HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, PARTIALS: tl.constexpr, SUB: tl.constexpr):
        """``SUB`` (1 or 2) query-row tiles of ``BLOCK_M`` rows per program: with 2, both tiles' dot products read
        each key tile once (a wide GQA verify block), each the same ``BLOCK_M``-row dot as alone."""
        bh = tl.program_id(0).to(tl.int64)  # b * HKV + g
        b = bh // HKV
        g = bh % HKV
        offs_d = tl.arange(0, D)
        q_base = q_ptr + b * stride_qb + g * stride_qh
        offs_m = tl.program_id(2) * (SUB * BLOCK_M) + tl.arange(0, BLOCK_M)  # this program's first row tile
        m_ok = offs_m < rows_per_head
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        qpos = tl.load(pos_ptr + b * width + offs_m // REP, mask=m_ok, other=-1)  # rows beyond W*rep see nothing
        hi = tl.max(qpos)
        offs_m1 = offs_m + BLOCK_M  # the second row tile (SUB == 2)
        m_ok1 = (offs_m1 < rows_per_head) & (SUB == 2)
        q1 = tl.load(q_base + offs_m1[:, None] * stride_qm + offs_d[None, :], mask=m_ok1[:, None], other=0.0)
        qpos1 = tl.load(pos_ptr + b * width + offs_m1 // REP, mask=m_ok1, other=-1)
        hi = tl.maximum(hi, tl.max(qpos1))
        slot = tl.load(rows_ptr + b).to(tl.int64)
        k_base = k_ptr + (slot * k_slot_stride) * (HKV * D) + g * D
        v_base = v_ptr + (slot * v_slot_stride) * (HKV * D) + g * D
        # this program's key tiles, cut after the last one a row of its tiles sees (a tile past a row's position
        # merges as exactly nothing: skipping it changes no bit)
        first = tl.program_id(1) * tiles_per_program
        last = tl.minimum(tl.minimum(first + tiles_per_program, num_tiles), hi // BLOCK_N + 1)
        m_s, l_s, a_s, m_s1, l_s1, a_s1 = _key_tiles(q, q1, qpos, qpos1, k_base, v_base, acc_ptr, ml_ptr, bh, first,
                                                     last, span, num_tiles, rows_per_head, offs_m, offs_m1, m_ok,
                                                     m_ok1, offs_d, qk_scale, HKV, D, BLOCK_M, BLOCK_N, PARTIALS, SUB)
        if not PARTIALS:  # one program held every tile its rows see: the output now
            _store_rows(out_ptr, a_s, l_s, b, g, offs_m, offs_d, m_ok, width, HKV, REP, D)
            if SUB == 2:
                _store_rows(out_ptr, a_s1, l_s1, b, g, offs_m1, offs_d, m_ok1, width, HKV, REP, D)

    @triton.jit
    def _store_rows(out_ptr, a, l, b, g, offs_m, offs_d, m_ok, width, HKV: tl.constexpr, REP: tl.constexpr,
                    D: tl.constexpr):
        """The merged rows ``a / l`` into ``o_proj``'s input layout ``[B, W, Hq*D]`` (row ``t*REP + r`` = query head
        ``g*REP + r`` at position t)."""
        o = a / l[:, None]
        t = offs_m // REP
        r = offs_m % REP
        dst = out_ptr + ((b * width + t) * (HKV * REP) + g * REP + r)[:, None] * D + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])

    @triton.jit
    def _merge_stored(acc_ptr, ml_ptr, bh, num_tiles, rows_per_head, offs_m, offs_d, m_ok, qpos, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CG: tl.constexpr):
        """The stored partials of one (row, KV head) query-row tile merged tile by tile in key order from the empty
        state (:func:`_merge_partial`, as the one-pass kernel merges them): ``(m, l, a)``. ``CG``: the partials are
        read through L2 only (``.cg``: stored by other programs of the same launch)."""
        last = tl.minimum(num_tiles, tl.max(qpos) // BLOCK_N + 1)  # the split programs stored these tiles
        m_s = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_s = tl.zeros([BLOCK_M], tl.float32)
        a_s = tl.zeros([BLOCK_M, D], tl.float32)
        for tile in tl.range(0, last):
            base = (bh * num_tiles + tile) * rows_per_head + offs_m
            if CG:
                m_t = tl.load(ml_ptr + base * 2, mask=m_ok, other=-1.0e30, cache_modifier=".cg")
                l_t = tl.load(ml_ptr + base * 2 + 1, mask=m_ok, other=0.0, cache_modifier=".cg")
                a_t = tl.load(acc_ptr + base[:, None] * D + offs_d[None, :], mask=m_ok[:, None], other=0.0,
                              cache_modifier=".cg")
            else:
                m_t = tl.load(ml_ptr + base * 2, mask=m_ok, other=-1.0e30)
                l_t = tl.load(ml_ptr + base * 2 + 1, mask=m_ok, other=0.0)
                a_t = tl.load(acc_ptr + base[:, None] * D + offs_d[None, :], mask=m_ok[:, None], other=0.0)
            m_s, l_s, a_s = _merge_partial(m_s, l_s, a_s, m_t, l_t, a_t)
        return m_s, l_s, a_s

    @triton.jit(do_not_specialize=["width", "num_tiles", "rows_per_head"])
    def _merge_kernel(acc_ptr, ml_ptr, pos_ptr, out_ptr, width, num_tiles, rows_per_head, HKV: tl.constexpr,
                      REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The stored partials of one (row, KV head, row tile) merged (:func:`_merge_stored`), then the output."""
        bh = tl.program_id(0).to(tl.int64)
        b = bh // HKV
        g = bh % HKV
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        m_ok = offs_m < rows_per_head
        qpos = tl.load(pos_ptr + b * width + offs_m // REP, mask=m_ok, other=-1)
        m_s, l_s, a_s = _merge_stored(acc_ptr, ml_ptr, bh, num_tiles, rows_per_head, offs_m, offs_d, m_ok, qpos, D,
                                      BLOCK_M, BLOCK_N, False)
        _store_rows(out_ptr, a_s, l_s, b, g, offs_m, offs_d, m_ok, width, HKV, REP, D)

    @triton.jit
    def _rope_rows(qkv_ptr, offs, cs_offs, cos_ptr, sin_ptr, w_ptr, offs_d, ok, eps, D: tl.constexpr,
                   QK_NORM: tl.constexpr):
        """Rows of one head each of the fused q/k/v output (``offs`` ``[R]``: each row's first element; ``cs_offs``
        ``[R]``: its ``cos`` / ``sin`` row): Qwen3's per-head RMSNorm (rounded to the input dtype, as the reference
        norms in one op and rotates in the next), then the rotary embedding in float32 (half-split ``rotate_half``
        layout: element j pairs with ``j ^ D/2``) - :mod:`adaflash_ray.kernels.rotary_cache`'s arithmetic.
        Returns ``[R, D]`` float32 (rows not ``ok``: zeros)."""
        HALF: tl.constexpr = D // 2
        partner = offs_d ^ HALF
        x = tl.load(qkv_ptr + offs[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        xp = tl.load(qkv_ptr + offs[:, None] + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        if QK_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            w = tl.load(w_ptr + offs_d).to(tl.float32)
            wp = tl.load(w_ptr + partner).to(tl.float32)
            x = (x * rstd[:, None] * w[None, :]).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            xp = (xp * rstd[:, None] * wp[None, :]).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_ptr + cs_offs[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        s = tl.load(sin_ptr + cs_offs[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        sign = tl.where(offs_d < HALF, -1.0, 1.0)  # x * cos + rotate_half(x) * sin
        return x * c + (xp * sign[None, :]) * s

    @triton.jit(do_not_specialize=["span", "width", "num_tiles", "tiles_per_program", "rows_per_head", "stride_tok",
                                   "k_slot_stride", "v_slot_stride"])
    def _rotary_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, out_ptr,
                                 acc_ptr, ml_ptr, cnt_ptr, span, width, num_tiles, tiles_per_program, rows_per_head,
                                 stride_tok, k_slot_stride, v_slot_stride, qk_scale, eps, HKV: tl.constexpr,
                                 REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_W: tl.constexpr, PARTIALS: tl.constexpr, SUB: tl.constexpr,
                                 QK_NORM: tl.constexpr):
        """:func:`rotary_decode_attention`: one program per (row, KV head, key split, query-row tiles). (1) The
        step's own keys / values that fall in this program's key tiles: normed, rotated, written to the cache (a
        barrier, then the tiles are read back from it). (2) The queries: normed and rotated in registers. (3) The
        split kernel's tile loop. (4) With partials, the program that finishes last (an atomic ticket per (row, KV
        head, row tiles), reset to 0 by that program) merges them and writes the output."""
        bh = tl.program_id(0).to(tl.int64)  # b * HKV + g
        b = bh // HKV
        g = bh % HKV
        HQ: tl.constexpr = HKV * REP
        offs_d = tl.arange(0, D)
        slot = tl.load(rows_ptr + b).to(tl.int64)
        k_base = k_ptr + (slot * k_slot_stride) * (HKV * D) + g * D
        v_base = v_ptr + (slot * v_slot_stride) * (HKV * D) + g * D
        first = tl.program_id(1) * tiles_per_program
        # (1) this step's keys / values at the positions of this program's tiles
        offs_w = tl.arange(0, BLOCK_W)
        w_ok = offs_w < width
        tok = b * width + offs_w
        wpos = tl.load(pos_ptr + tok, mask=w_ok, other=0)
        own = w_ok & (wpos >= first * BLOCK_N) & (wpos < (first + tiles_per_program) * BLOCK_N)
        kn = _rope_rows(qkv_ptr, tok * stride_tok + (HQ + g) * D, tok * D, cos_ptr, sin_ptr, kw_ptr, offs_d, own, eps,
                        D, QK_NORM)
        tl.store(k_base + wpos[:, None] * (HKV * D) + offs_d[None, :], kn.to(k_ptr.dtype.element_ty), mask=own[:, None])
        vn = tl.load(qkv_ptr + (tok * stride_tok + (HQ + HKV + g) * D)[:, None] + offs_d[None, :], mask=own[:, None],
                     other=0.0)
        tl.store(v_base + wpos[:, None] * (HKV * D) + offs_d[None, :], vn.to(v_ptr.dtype.element_ty), mask=own[:, None])
        tl.debug_barrier()  # the block's own writes are visible to all its threads after the barrier
        # (2) the queries of this program's row tile(s), row t*REP + r = query head g*REP + r at position t
        offs_m = tl.program_id(2) * (SUB * BLOCK_M) + tl.arange(0, BLOCK_M)
        m_ok = offs_m < rows_per_head
        qtok = b * width + offs_m // REP
        q = _rope_rows(qkv_ptr, qtok * stride_tok + (g * REP + offs_m % REP) * D, qtok * D, cos_ptr, sin_ptr, qw_ptr,
                       offs_d, m_ok, eps, D, QK_NORM).to(qkv_ptr.dtype.element_ty)
        qpos = tl.load(pos_ptr + qtok, mask=m_ok, other=-1)  # rows beyond W*rep see nothing
        hi = tl.max(qpos)
        offs_m1 = offs_m + BLOCK_M  # the second row tile (SUB == 2)
        m_ok1 = (offs_m1 < rows_per_head) & (SUB == 2)
        qtok1 = b * width + offs_m1 // REP
        q1 = _rope_rows(qkv_ptr, qtok1 * stride_tok + (g * REP + offs_m1 % REP) * D, qtok1 * D, cos_ptr, sin_ptr,
                        qw_ptr, offs_d, m_ok1, eps, D, QK_NORM).to(qkv_ptr.dtype.element_ty)
        qpos1 = tl.load(pos_ptr + qtok1, mask=m_ok1, other=-1)
        hi = tl.maximum(hi, tl.max(qpos1))
        last = tl.minimum(tl.minimum(first + tiles_per_program, num_tiles), hi // BLOCK_N + 1)
        # (3) the split kernel's key tiles
        m_s, l_s, a_s, m_s1, l_s1, a_s1 = _key_tiles(q, q1, qpos, qpos1, k_base, v_base, acc_ptr, ml_ptr, bh, first,
                                                     last, span, num_tiles, rows_per_head, offs_m, offs_m1, m_ok,
                                                     m_ok1, offs_d, qk_scale, HKV, D, BLOCK_M, BLOCK_N, PARTIALS, SUB)
        if PARTIALS:  # (4) the last program of this (row, KV head, row tiles) to finish merges every split's tiles
            tl.debug_barrier()  # every thread's partials stored before the ticket (released with it)
            counter = cnt_ptr + bh * tl.num_programs(2) + tl.program_id(2)
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == tl.num_programs(1) - 1:
                m_s, l_s, a_s = _merge_stored(acc_ptr, ml_ptr, bh, num_tiles, rows_per_head, offs_m, offs_d, m_ok,
                                              qpos, D, BLOCK_M, BLOCK_N, True)
                _store_rows(out_ptr, a_s, l_s, b, g, offs_m, offs_d, m_ok, width, HKV, REP, D)
                if SUB == 2:
                    m_s1, l_s1, a_s1 = _merge_stored(acc_ptr, ml_ptr, bh, num_tiles, rows_per_head, offs_m1, offs_d,
                                                     m_ok1, qpos1, D, BLOCK_M, BLOCK_N, True)
                    _store_rows(out_ptr, a_s1, l_s1, b, g, offs_m1, offs_d, m_ok1, width, HKV, REP, D)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        else:
            _store_rows(out_ptr, a_s, l_s, b, g, offs_m, offs_d, m_ok, width, HKV, REP, D)
            if SUB == 2:
                _store_rows(out_ptr, a_s1, l_s1, b, g, offs_m1, offs_d, m_ok1, width, HKV, REP, D)


def decode_attention(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor, span: int, num_splits: int | None = None,
                     block_n: int = 64, max_width: int = 16) -> torch.Tensor:
    """:func:`decode_attention_ref` in Triton (same arguments and result; no K/V copy, no mask tensor).

    The keys go in tiles of ``block_n``; each tile's softmax partial is computed from nothing, and the partials are
    merged in key order from the empty state (:func:`_merge_partial`). ``num_splits`` (host int; None:
    :func:`default_num_splits`) only says how programs share that work: 1 = one program per (row, KV head, row
    tile) merges its tiles as it goes and writes the output (one launch: enough programs at large batch); n > 1 =
    n programs per (row, KV head, row tile) each store their tiles' partials, and a second kernel merges them
    (flash-decoding's split-K: parallelism at small batch). Both are the same operations in the same order, so a
    query row's result is the same bits at every batch, width, span and split - what lets greedy spec decoding
    with the kernel equal AR's output. Tiles past every position of a row tile are skipped (they merge as nothing),
    so a CUDA graph captured for a long ``span`` reads only the keys its rows see.

    Every query row must see at least one key (positions >= 0), as in the reference. ``head_dim`` must be a power
    of two >= 16 and ``W*rep <= 128``; the query rows go in tiles of :func:`block_rows` rows (16 or 32: the same
    instruction path for every width), and the first call compiles both launches for the tiles of every width up
    to ``max_width`` (so a CUDA-graph capture of a new width finds its kernels compiled). No host synchronisation;
    the split launch's scratch ``[B*Hkv, tiles, W*rep, D + 2]`` float32 comes from the caching allocator (CUDA-graph
    capturable). On CUDA the float32 path's dot products run in TF32 (Triton's default); the engine's bf16 path is
    unaffected.

    Raises:
        RuntimeError: Triton is not installed.
        ValueError: unsupported head_dim / query rows, mis-shaped inputs, a cache whose positions are not packed
            ``[Hkv, D]`` blocks (strides ``(k*Hkv*D, Hkv*D, D, 1)``), or ``num_splits < 1``.
    """
    if not HAVE_TRITON:
        raise RuntimeError("decode_attention needs triton (use decode_attention_ref)")
    b, hkv, m, d = qg.shape
    w = positions.shape[1]
    if (d < 16 or d & (d - 1) or m % w or m > 128 or positions.shape[0] != b or rows.shape != (b,)
            or k_cache.shape[-2:] != (hkv, d) or v_cache.shape != k_cache.shape or qg.stride(-1) != 1
            or not all(_positions_packed(c) for c in (k_cache, v_cache))):
        raise ValueError(f"decode_attention: qg {tuple(qg.shape)}, cache {tuple(k_cache.shape)}, positions "
                         f"{tuple(positions.shape)}, rows {tuple(rows.shape)}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"decode_attention: num_splits must be >= 1, got {num_splits}")
    rep = m // w
    out = torch.empty((b, w, hkv * rep * d), dtype=qg.dtype, device=qg.device)
    if b == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, _row_programs(m, d), span, _num_sms(qg.device), block_n, m)
    positions, rows = positions.contiguous(), rows.contiguous()
    _compile_variants(qg, k_cache, v_cache, rows, positions, rep, block_n, max_width)
    _launch(qg, k_cache, v_cache, rows, positions, span, num_splits, block_n, out)
    return out


def rotary_decode_attention_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm, eps: float,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                                positions: torch.Tensor, span: int, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Reference: :func:`adaflash_ray.kernels.rotary_cache.rotary_qkv_cache_ref` (q/k norm, rotary, the K/V write
    at ``[rows[b], positions[b, t]]``, the query fold), then :func:`decode_attention_ref`.

    Args:
        qkv: ``[B, W, (Hq + 2*Hkv) * D]`` fused projection output. cos, sin: ``[B, W, D]`` float32.
        q_norm, k_norm: ``[D]`` or None (both or neither). eps: their epsilon.
        k_cache, v_cache: ``[slots, S_max, Hkv, D]`` one layer of the static cache (written in place).
        rows: ``[B]`` int64 slots. positions: ``[B, W]`` int64, every one ``< span``. span: keys considered.
        num_heads, num_kv_heads: Hq, Hkv.
    Returns:
        ``[B, W, Hq*D]`` in qkv's dtype.
    """
    from adaflash_ray.kernels.rotary_cache import rotary_qkv_cache_ref

    qg = rotary_qkv_cache_ref(qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, rows, positions, num_heads,
                              num_kv_heads)
    return decode_attention_ref(qg, k_cache, v_cache, rows, positions, span)


def rotary_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm, eps: float,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                            span: int, num_heads: int, num_kv_heads: int, num_splits: int | None = None,
                            block_n: int = 64, max_width: int = 16) -> torch.Tensor:
    """:func:`rotary_decode_attention_ref` in one Triton launch (same arguments and result): the rotary + cache
    write of :func:`adaflash_ray.kernels.rotary_cache.rotary_qkv_cache` and both launches of
    :func:`decode_attention` in one kernel. Each program writes the step's keys / values that fall in its own key
    tiles (so nothing it reads is written by another program), rotates its queries in registers, and with a key
    split (``num_splits``, as :func:`decode_attention`) the program that finishes last - an atomic ticket per
    (row, KV head, row tiles) - merges the stored partials in key order, the split + merge arithmetic of
    :func:`decode_attention`: a query row is the same bits at every batch, width, span and split, and greedy spec
    decoding with it equals AR's output. Launches of this kernel must not overlap on two streams (they share the
    per-device ticket counters of :func:`adaflash_ray.kernels.triton_support.ticket_counters`).

    The keys and values are written before they are read (a verify row sees the block's earlier positions),
    rounded to the cache's dtype. Inputs as :func:`rotary_qkv_cache`'s (token-major ``qkv`` with a contiguous last
    dimension; contiguous ``cos`` / ``sin``) and :func:`decode_attention`'s (``head_dim`` a power of two >= 16,
    ``W * rep <= 128``, caches with packed positions). No host synchronisation; CUDA-graph capturable once an eager
    call compiled the kernel (the first call compiles every row-tile variant up to ``max_width`` on scratch tensors).

    Raises:
        RuntimeError: Triton is not installed.
        ValueError: mis-shaped inputs (as the two kernels raise), ``num_splits < 1``.
    """
    if not HAVE_TRITON:
        raise RuntimeError("rotary_decode_attention needs triton (use rotary_decode_attention_ref)")
    b, w, n = qkv.shape
    d = cos.shape[-1]
    hkv = num_kv_heads
    if (d < 16 or d & (d - 1) or num_heads % max(hkv, 1) or n != (num_heads + 2 * hkv) * d or num_heads == 0
            or (q_norm is None) != (k_norm is None) or cos.shape != (b, w, d) or sin.shape != cos.shape
            or positions.shape != (b, w) or rows.shape != (b,) or k_cache.shape[-2:] != (hkv, d)
            or v_cache.shape != k_cache.shape or w * (num_heads // hkv) > 128 or w > max_width
            or not all(_positions_packed(c) for c in (k_cache, v_cache))):
        raise ValueError(f"rotary_decode_attention: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, heads "
                         f"{num_heads}/{num_kv_heads}, positions {tuple(positions.shape)}, rows {tuple(rows.shape)}, "
                         f"cache {tuple(k_cache.shape)}, max_width {max_width}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"rotary_decode_attention: num_splits must be >= 1, got {num_splits}")
    rep = num_heads // hkv
    m = w * rep
    out = torch.empty((b, w, num_heads * d), dtype=qkv.dtype, device=qkv.device)
    if b == 0:
        return out
    if qkv.stride(-1) != 1 or qkv.stride(0) != w * qkv.stride(1):
        qkv = qkv.contiguous()
    cos, sin, positions, rows = cos.contiguous(), sin.contiguous(), positions.contiguous(), rows.contiguous()
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, _row_programs(m, d), span, _num_sms(qkv.device), block_n, m)
    qk_norm = q_norm is not None
    qw = q_norm if qk_norm else cos  # unused pointers when there is no qk-norm
    kw = k_norm if qk_norm else cos
    _compile_rotary_variants(qkv, cos, qw, kw, k_cache, v_cache, rep, hkv, block_n, max_width, qk_norm)
    _launch_rotary(qkv, cos, sin, qw, kw, float(eps), k_cache, v_cache, rows, positions, span, rep, hkv,
                   num_splits, block_n, max_width, qk_norm, out)
    return out


_COMPILED_ROTARY: set = set()


def _compile_rotary_variants(qkv, cos, qw, kw, k_cache, v_cache, rep: int, hkv: int, block_n: int, max_width: int,
                             qk_norm: bool) -> None:
    """Compile every query-row tile that widths ``1..max_width`` need, with and without partials, once per
    (device, dtypes, Hkv, rep, D, qk-norm), by launching on scratch tensors (nothing of the caller's is written) and
    outside any CUDA-graph capture (see :func:`_compile_variants`)."""
    d = cos.shape[-1]
    key = (qkv.device, qkv.dtype, k_cache.dtype, v_cache.dtype, cos.dtype, qw.dtype, kw.dtype, hkv, rep, d, block_n,
           max_width, qk_norm)
    if key in _COMPILED_ROTARY or (qkv.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    _COMPILED_ROTARY.add(key)
    dev = qkv.device
    kc = torch.zeros((1, 2 * block_n, hkv, d), dtype=k_cache.dtype, device=dev)
    rows = torch.zeros(1, dtype=torch.int64, device=dev)
    for w in _width_variants(rep, d, max_width):
        x = qkv.new_zeros((1, w, (hkv * rep + 2 * hkv) * d))
        cs = cos.new_zeros((1, w, d))
        pos = torch.zeros((1, w), dtype=torch.int64, device=dev)  # key 0 only
        for splits in (1, 2):
            _launch_rotary(x, cs, cs, qw, kw, 1e-6, kc, torch.zeros_like(kc, dtype=v_cache.dtype), rows, pos,
                           2 * block_n, rep, hkv, splits, block_n, max_width, qk_norm,
                           x.new_empty((1, w, hkv * rep * d)))


def _launch_plan(b: int, hkv: int, m: int, d: int, span: int, num_splits: int, block_n: int, device, out):
    """What both kernels' launches share: ``(grid, num_tiles, tiles per program, partials, block_m, sub, acc, ml,
    qk_scale)`` for ``m`` folded query rows over ``span`` keys (the float32 scratch only with partials)."""
    num_tiles = triton.cdiv(span, block_n)
    per_program = triton.cdiv(num_tiles, min(num_splits, num_tiles))
    programs = triton.cdiv(num_tiles, per_program)
    partials = programs > 1 or num_splits > 1
    block_m, row_tiles, sub = _row_tiling(m, d)
    if partials:
        acc = torch.empty((b * hkv, num_tiles, m, d), dtype=torch.float32, device=device)
        ml = torch.empty((b * hkv, num_tiles, m, 2), dtype=torch.float32, device=device)
    else:
        acc = ml = out  # unused
    qk_scale = (1.0 / math.sqrt(d)) * 1.4426950408889634  # log2(e): exp2 in the kernel
    grid = (b * hkv, programs, triton.cdiv(row_tiles, sub))
    return grid, num_tiles, per_program, partials, block_m, sub, acc, ml, qk_scale


def _launch_rotary(qkv, cos, sin, qw, kw, eps: float, k_cache, v_cache, rows, positions, span: int, rep: int,
                   hkv: int, num_splits: int, block_n: int, max_width: int, qk_norm: bool, out) -> None:
    """The kernel of :func:`rotary_decode_attention` into ``out`` ``[B, W, Hq*D]`` (ticket counters only for a
    split launch: one per (row, KV head, row program))."""
    b, w, _ = qkv.shape
    d = cos.shape[-1]
    grid, num_tiles, per_program, partials, block_m, sub, acc, ml, qk_scale = _launch_plan(
        b, hkv, w * rep, d, span, num_splits, block_n, qkv.device, out)
    counters = ticket_counters(qkv.device, grid[0] * grid[2]) if partials else rows  # rows: an unused pointer
    stages, warps = launch_settings(partials)
    _rotary_attention_kernel[grid](
        qkv, cos, sin, qw, kw, k_cache, v_cache, rows, positions, out, acc, ml, counters, span, w, num_tiles,
        per_program, w * rep, qkv.stride(1), k_cache.stride(0) // (hkv * d), v_cache.stride(0) // (hkv * d), qk_scale,
        eps,
        HKV=hkv, REP=rep, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=triton.next_power_of_2(max_width),
        PARTIALS=partials, SUB=sub, QK_NORM=qk_norm, num_warps=warps, num_stages=stages)


#: the largest query-row tile (each row tile reads the keys again: a width-16 verify at rep 4 is 64 rows, two tiles).
#: A 64-row tile's dot products take another instruction path on sm_90 (wgmma): its rows' sums are not the 16- and
#: 32-row tiles' bits, so a width-16 verify row would differ from the AR step's. At head_dim 128 the 32-row tile
#: compiles for sm_90 at 8 warps without spills since the keys are addressed in whole positions (124 registers).
MAX_BLOCK_ROWS = 32


def block_rows(m: int, d: int = 64) -> int:
    """The query-row tile of ``m = W * rep`` folded query rows (``d``: head_dim, kept for callers): the next power of
    two >= max(m, 16), at most :data:`MAX_BLOCK_ROWS` (more rows take several tiles, each reading the keys; a decode
    step's ``rep`` rows do not pay for a 16-position tile)."""
    p2 = triton.next_power_of_2(m) if HAVE_TRITON else 1 << max(0, (m - 1).bit_length())
    return min(MAX_BLOCK_ROWS, max(16, p2))


_COMPILED: set = set()


def _row_tiling(m: int, d: int) -> tuple[int, int, int]:
    """``(block_m, row_tiles, sub)`` for ``m`` folded query rows: :func:`block_rows`-row tiles, two to a program
    (``sub``) when there are several (they share each key tile's loads)."""
    block_m = block_rows(m, d)
    tiles = -(-m // block_m)
    return block_m, tiles, 2 if tiles > 1 else 1


def _row_programs(m: int, d: int) -> int:
    """Programs along the query rows of ``m`` folded rows (:func:`_row_tiling`)."""
    _, tiles, sub = _row_tiling(m, d)
    return -(-tiles // sub)


def _positions_packed(cache: torch.Tensor) -> bool:
    """A cache layer whose positions are packed ``[Hkv, D]`` blocks (strides ``(k * Hkv * D, Hkv * D, D, 1)``), as
    the engine's static cache is: the kernel addresses it in whole positions."""
    _, _, hkv, d = cache.shape
    return cache.stride()[1:] == (hkv * d, d, 1) and cache.stride(0) % (hkv * d) == 0


def _width_variants(rep: int, d: int, max_width: int) -> list[int]:
    """The smallest width of each query-row tiling ``(block_m, sub)`` that widths ``1..max_width`` (at most 128
    folded rows) need: one compiled kernel variant each."""
    seen, widths = set(), []
    for w in range(1, max_width + 1):
        variant = _row_tiling(w * rep, d)[::2]
        if w * rep <= 128 and variant not in seen:
            seen.add(variant)
            widths.append(w)
    return widths


def _compile_variants(qg, k_cache, v_cache, rows, positions, rep: int, block_n: int, max_width: int) -> None:
    """Compile every query-row tile that widths ``1..max_width`` need, in both launches (one pass; split + merge),
    once per (device, dtype, Hkv, rep, D), by launching each on the first row (outside any CUDA-graph capture: a
    capture may not load a module, and the engine captures new step shapes without an eager warm-up). Later calls,
    captured or not, find them compiled."""
    b, hkv, _, d = qg.shape
    key = (qg.device, qg.dtype, k_cache.dtype, hkv, rep, d, block_n, max_width)
    if key in _COMPILED or (qg.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    _COMPILED.add(key)
    for w in _width_variants(rep, d, max_width):
        pos = torch.zeros((1, w), dtype=positions.dtype, device=positions.device)  # key 0 only
        q = qg.new_zeros((1, hkv, w * rep, d))
        for splits in (1, 2):
            _launch(q, k_cache, v_cache, rows[:1], pos, min(2 * block_n, k_cache.shape[1]), splits, block_n,
                    qg.new_empty((1, w, hkv * rep * d)))


def launch_settings(partials: bool) -> tuple[int, int]:
    """The split kernel's ``(num_stages, num_warps)``: 3 stages in the one-pass launch, 2 in the split launch (its
    programs see few key tiles each), 4 warps in both. The pipeline depth changes no arithmetic; the warp count
    changes the order of the row max / sum reductions, so both launches take the same one (a row is then the same
    bits in either)."""
    return (2 if partials else 3), 4


def _launch(qg, k_cache, v_cache, rows, positions, span: int, num_splits: int, block_n: int,
            out: torch.Tensor, num_stages: int | None = None, num_warps: int | None = None) -> None:
    """The kernels of :func:`decode_attention` into ``out`` ``[B, W, Hq*D]`` (``num_stages`` / ``num_warps``: the
    split kernel's launch settings; None: :func:`launch_settings`)."""
    b, hkv, m, d = qg.shape
    w = positions.shape[1]
    rep = m // w
    grid, num_tiles, per_program, partials, block_m, sub, acc, ml, qk_scale = _launch_plan(
        b, hkv, m, d, span, num_splits, block_n, qg.device, out)
    _split_kernel[grid](
        qg, k_cache, v_cache, rows, positions, out, acc, ml, span, w, num_tiles, per_program, m, qg.stride(0),
        qg.stride(1), qg.stride(2), k_cache.stride(0) // (hkv * d), v_cache.stride(0) // (hkv * d), qk_scale,
        HKV=hkv, REP=rep, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        PARTIALS=partials, SUB=sub, num_warps=num_warps or launch_settings(partials)[1],
        num_stages=num_stages or launch_settings(partials)[0])
    if partials:
        _merge_kernel[(b * hkv, _row_tiling(m, d)[1])](acc, ml, positions, out, w, num_tiles, m, HKV=hkv, REP=rep,
                                                       D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
