"""Prompt lookup and suffix lookup of every engine row in three Triton kernels (the device lookup's proposals,
:mod:`adaflash_ray.engine.device_lookup`, whose tensor-op version is the reference and what CPUs run).

The tensor-op version spends about 70 element-wise kernels on the request's own context and 60 more on the corpus
ring per step (an n-gram level costs a shifted compare, an AND and an add; the pick, gather and packing the rest),
each a launch of a few microseconds inside the step's CUDA graph. Here:

1. :func:`_scan_kernel` over the context (grid: rows x blocks of candidate positions) and again over the corpus ring:
   for every candidate continuation start ``p`` its match length ``run(p)`` (leading tokens before ``p`` equal to
   the row's last tokens, at most ``max_ngram``); per row an ``atomic_max`` of the key ``run << 32 | recency``
   (recency = ``p`` in the context, the ring age in the corpus) gives the longest match and its latest occurrence,
   and ``atomic_add`` into a per-row histogram ``count[run]`` gives the occurrences of each length;
2. :func:`_finalize_kernel` (one program per row): decodes both keys, applies ``min_ngram`` and the occurrence cap,
   gathers the continuation (to the context's end, or to the corpus sequence's separator), takes the corpus match
   only where it is longer, zeroes the tokens past the proposal's length, writes the packed row (tokens, length,
   match length, occurrences, source) and resets the row's key and histogram for the next step.

The rules, ties included, are :func:`~adaflash_ray.engine.device_lookup.context_proposals` /
:func:`~adaflash_ray.engine.device_lookup.corpus_proposals` and :meth:`DeviceLookup.propose` (the longest match
wins; among equal ones the latest; between context and corpus the context at equal length). Every integer argument
is ``do_not_specialize`` (one compiled variant serves every batch and context length, compiled by the first eager
call before any CUDA-graph capture; :mod:`adaflash_ray.kernels.triton_support`).
"""
from __future__ import annotations

import torch

from adaflash_ray.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["lookup_packed_triton", "LookupScratch"]

#: candidate positions per scan program (a key is ``run << 32 | recency``: contexts and rings below 2^31 tokens)
_BLOCK = 1024


class LookupScratch:
    """Per-row accumulators the kernels share: ``keys`` ``[2, rows]`` int64 (-1 = no match; context, corpus) and
    ``counts`` ``[2, rows, max_ngram + 1]`` int32, left reset by every finalize (so a step never fills them)."""

    def __init__(self, rows: int, max_ngram: int, device):
        self.keys = torch.full((2, rows), -1, dtype=torch.long, device=device)
        self.counts = torch.zeros(2, rows, max_ngram + 1, dtype=torch.int32, device=device)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["ctx_stride", "hay_len", "sep"])
    def _scan_kernel(ctx_ptr, ctx_stride, len_ptr, hay_ptr, hay_len, head_ptr, key_ptr, cnt_ptr, sep,
                     N: tl.constexpr, IS_RING: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        length = tl.load(len_ptr + row)
        ctx_row = ctx_ptr + row.to(tl.int64) * ctx_stride
        if IS_RING:
            inb = offs < hay_len
            tok_p = tl.load(hay_ptr + offs, mask=inb, other=sep)
            valid = inb & (tok_p != sep)
            head = tl.load(head_ptr)
            order = offs.to(tl.int64) - head  # the ring age, 0 = oldest: one wrap at most (0 <= offs, head < hay_len)
            order = tl.where(order < 0, order + hay_len, order)
        else:
            valid = (offs >= 1) & (offs < length)
            order = offs.to(tl.int64)
        alive = valid
        run = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(N):
            s_pos = length - 1 - j
            s_j = tl.load(ctx_row + tl.maximum(s_pos, 0))
            s_j = tl.where(s_pos >= 0, s_j, -2)  # no suffix token there: matches nothing
            idx = offs - 1 - j
            if IS_RING:  # one wrap at most (idx >= -N > -hay_len): no integer division per candidate
                idx = tl.where(idx < 0, idx + hay_len, idx)
                t = tl.load(hay_ptr + idx, mask=alive, other=-7)
                alive = alive & (t == s_j)
            else:
                ok = idx >= 0
                t = tl.load(ctx_row + tl.maximum(idx, 0), mask=alive & ok, other=-7)
                alive = alive & ok & (t == s_j)
            run += alive.to(tl.int32)
        key = tl.where(valid & (run > 0), (run.to(tl.int64) << 32) | order, -1)
        tl.atomic_max(key_ptr + row, tl.max(key, axis=0))
        for r in tl.static_range(1, N + 1):
            tl.atomic_add(cnt_ptr + row * (N + 1) + r, tl.sum(((run == r) & valid).to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["ctx_stride", "ctx_len", "ring_len", "sep", "min_ngram", "max_occ", "out_stride",
                                   "rows"])
    def _finalize_kernel(ctx_ptr, ctx_stride, ctx_len, len_ptr, ring_ptr, ring_len, head_ptr, key_ptr, cnt_ptr,
                         out_ptr, out_stride, sep, min_ngram, max_occ, rows,
                         N: tl.constexpr, D: tl.constexpr, D_POW2: tl.constexpr, HAS_RING: tl.constexpr):
        row = tl.program_id(0)
        d = tl.arange(0, D_POW2)
        dmask = d < D
        length = tl.load(len_ptr + row)
        ctx_row = ctx_ptr + row.to(tl.int64) * ctx_stride
        # the row's own context
        key_c = tl.load(key_ptr + row)
        n_c = tl.where(key_c >= 0, key_c >> 32, 0)
        n_c = tl.where(n_c >= min_ngram, n_c, 0)
        p_c = tl.where(key_c >= 0, key_c & 0xFFFFFFFF, 0)
        cnt_c = tl.minimum(tl.load(cnt_ptr + row * (N + 1) + n_c), max_occ)
        cnt_c = tl.where(n_c > 0, cnt_c, 0)
        len_c = tl.where(n_c > 0, tl.minimum(tl.maximum(length - p_c, 0), D), 0)
        tok = tl.load(ctx_row + tl.maximum(tl.minimum(p_c + d, ctx_len - 1), 0), mask=dmask, other=0)
        n_out, cnt_out, len_out = n_c, cnt_c, len_c
        src = n_c * 0
        if HAS_RING:
            key_r = tl.load(key_ptr + rows + row)
            n_r = tl.where(key_r >= 0, key_r >> 32, 0)
            n_r = tl.where(n_r >= min_ngram, n_r, 0)
            order = tl.where(key_r >= 0, key_r & 0xFFFFFFFF, 0)
            head = tl.load(head_ptr)
            start = (order + head) % ring_len
            tok_r = tl.load(ring_ptr + (start + d) % ring_len, mask=dmask, other=sep)
            first_sep = tl.min(tl.where((tok_r == sep) | (d >= D), d, D), axis=0)
            len_r = tl.where(n_r > 0, first_sep, 0)
            cnt_r = tl.minimum(tl.load(cnt_ptr + (rows + row) * (N + 1) + n_r), max_occ)
            cnt_r = tl.where(n_r > 0, cnt_r, 0)
            take = n_r > n_c
            tok = tl.where(take, tok_r, tok)
            n_out = tl.where(take, n_r, n_c)
            cnt_out = tl.where(take, cnt_r, cnt_c)
            len_out = tl.where(take, len_r, len_c)
            src = tl.where(take, 1, 0)
            tl.store(key_ptr + rows + row, -1)
            for r in tl.static_range(N + 1):
                tl.store(cnt_ptr + (rows + row) * (N + 1) + r, 0)
        tok = tl.where(d < len_out, tok, 0)
        out_row = out_ptr + row * out_stride
        tl.store(out_row + d, tok, mask=dmask)
        tl.store(out_row + D, len_out)
        tl.store(out_row + D + 1, n_out)
        tl.store(out_row + D + 2, cnt_out)
        tl.store(out_row + D + 3, src)
        tl.store(key_ptr + row, -1)
        for r in tl.static_range(N + 1):
            tl.store(cnt_ptr + row * (N + 1) + r, 0)


def lookup_packed_triton(context: torch.Tensor, lengths: torch.Tensor, scratch: LookupScratch, *, max_ngram: int,
                         min_ngram: int, max_occurrences: int, max_draft: int, corpus: torch.Tensor | None = None,
                         corpus_head: torch.Tensor | None = None, sep: int = -3) -> torch.Tensor:
    """Packed proposals ``[B, max_draft + 4]`` int64 (tokens zeroed past each length, then length, match length,
    occurrences, source) of every row - :meth:`DeviceLookup.propose` followed by its cleaning, in three kernels.

    Args:
        context: ``[B, H]`` int64 with unit column stride (rows may be strided, e.g. a slice of the history); row b's
            context is its first ``lengths[b]`` tokens. lengths: ``[B]`` int64, ``0 <= L <= H``.
        scratch: a :class:`LookupScratch` of at least B rows for this ``max_ngram`` (reset on return).
        corpus / corpus_head: the ring ``[C]`` int64 and its next write index ``[1]`` int64, or None (prompt lookup).
        sep: the ring's separator (:data:`~adaflash_ray.engine.device_lookup.SEPARATOR`).
    Raises:
        ValueError: a context whose columns are not contiguous, or scratch too small.
    """
    b, h = context.shape
    if b and context.stride(1) != 1:
        raise ValueError("lookup_packed_triton needs a context with contiguous columns")
    if scratch.keys.shape[1] < b or scratch.counts.shape[2] != max_ngram + 1:
        raise ValueError(f"scratch of {scratch.keys.shape[1]} rows / {scratch.counts.shape[2] - 1}-grams for {b} rows "
                         f"/ {max_ngram}-grams")
    out = torch.empty(b, max_draft + 4, dtype=torch.long, device=context.device)
    if b == 0:
        return out
    rows = scratch.keys.shape[1]
    lengths = lengths.to(torch.long).contiguous()
    keys, counts = scratch.keys, scratch.counts
    head = corpus_head if corpus is not None else lengths  # unused without a ring
    _scan_kernel[(b, triton.cdiv(max(h, 1), _BLOCK))](context, context.stride(0), lengths, context, h, head, keys[0],
                                                       counts[0], sep, N=max_ngram, IS_RING=False, BLOCK=_BLOCK)
    if corpus is not None:
        c = corpus.shape[0]
        _scan_kernel[(b, triton.cdiv(c, _BLOCK))](context, context.stride(0), lengths, corpus, c, corpus_head,
                                                   keys[1], counts[1], sep, N=max_ngram, IS_RING=True, BLOCK=_BLOCK)
    _finalize_kernel[(b,)](context, context.stride(0), h, lengths, corpus if corpus is not None else context,
                           corpus.shape[0] if corpus is not None else 1, head, keys, counts, out, out.stride(0), sep,
                           min_ngram, max_occurrences, rows, N=max_ngram, D=max_draft,
                           D_POW2=triton.next_power_of_2(max_draft), HAS_RING=corpus is not None)
    return out
