"""Rotary embedding of q and k (with Qwen3's per-head q/k RMSNorm) fused with the static KV-cache write.

Per decoder layer the reference (adaflash_ray/models/layers.py ``AttentionProjections.qkv`` and the cache write
of adaflash_ray/models/target.py) splits the fused q/k/v GEMM output, norms q and k per head (Qwen3), rotates
them (Su et al. 2021, arXiv 2104.09864; half-split ``rotate_half`` layout of Hugging Face Llama/Qwen), writes
``k`` and ``v`` into ``cache[slot, position]`` and folds the grouped query heads into the query length for SDPA
(:func:`adaflash_ray.models.layers.grouped_attention`). :func:`rotary_qkv_cache` does all of it in one launch,
one program per (token, head): query heads are written straight into the folded layout
``[B, Hkv, W*rep, D]`` (row ``t*rep + r`` for query head ``g*rep + r``), key heads are rotated into the cache,
value heads copied into it. Numerics follow the reference: the normed q/k are rounded to the input dtype before
the rotation (the reference norms in one op and rotates in the next), the rotation is done in float32 on the
float32 ``cos``/``sin`` table of :class:`adaflash_ray.models.layers.Rotary`, and rounded once.

Any verify width ``W`` works; rows of the batch name their cache slots through ``rows`` (the engine's decode
step passes ``arange(B)``: batch row b is KV slot b). :func:`rotary_qkv_cache_ref` is the pure-torch reference.
:func:`rotary_kv_cache` is the same kernel with no query heads: keys normed, rotated and written with the values
(the drafter's context K/V, which has no queries), beside its reference :func:`rotary_kv_cache_ref`.
"""
from __future__ import annotations

import torch

from adaflash_ray.kernels.reference import apply_rotary, fold_queries
from adaflash_ray.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["rotary_kv_cache", "rotary_kv_cache_ref", "rotary_qkv_cache", "rotary_qkv_cache_ref"]


def rotary_qkv_cache_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         rows: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int
                         ) -> torch.Tensor:
    """Reference (what layers.py + target.py compute): split, q/k RMSNorm, rotary, cache write, fold.

    Args:
        qkv: ``[B, W, (Hq + 2*Hkv) * D]`` fused projection output (q heads, then k heads, then v heads).
        cos, sin: ``[B, W, D]`` float32 from ``Rotary.cos_sin(positions)``.
        q_norm, k_norm: ``[D]`` per-head norm weights in qkv's dtype, or None (no qk-norm; both or neither).
        eps: norm epsilon. k_cache, v_cache: ``[slots, S_max, Hkv, D]`` (one layer of the static cache),
            written in place at ``[rows[b], positions[b, t]]``.
        rows: ``[B]`` int64 slot of each batch row. positions: ``[B, W]`` int64 absolute positions.
        num_heads, num_kv_heads: Hq (0: no queries, keys and values only) and Hkv.
    Returns:
        folded queries ``[B, Hkv, W*rep, D]`` in qkv's dtype (no elements when ``num_heads`` is 0).
    """
    import torch.nn.functional as F

    b, w, _ = qkv.shape
    d = cos.shape[-1]
    nq, nk = num_heads * d, num_kv_heads * d
    q, k, v = qkv.split([nq, nk, nk], dim=-1)
    q = q.view(b, w, num_heads, d)
    k = k.view(b, w, num_kv_heads, d)
    v = v.view(b, w, num_kv_heads, d)
    if q_norm is not None:
        q, k = F.rms_norm(q, (d,), q_norm, eps), F.rms_norm(k, (d,), k_norm, eps)
    qk = apply_rotary(torch.cat([q, k], dim=2), cos, sin)
    q, k = qk[:, :, :num_heads], qk[:, :, num_heads:]
    k_cache[rows[:, None], positions] = k.to(k_cache.dtype)
    v_cache[rows[:, None], positions] = v.to(v_cache.dtype)
    return fold_queries(q, num_kv_heads)


if HAVE_TRITON:
    # one compiled variant for every batch size and width (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit(do_not_specialize=["width", "stride_tok", "stride_cs", "stride_qo_b", "stride_qo_h", "stride_qo_t",
                                     "stride_kc_s", "stride_kc_p", "stride_kc_h", "stride_vc_s", "stride_vc_p",
                                     "stride_vc_h"])
    def _rotary_qkv_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, kc_ptr, vc_ptr, rows_ptr,
                                 pos_ptr, width, stride_tok, stride_cs, stride_qo_b, stride_qo_h, stride_qo_t,
                                 stride_kc_s, stride_kc_p, stride_kc_h, stride_vc_s, stride_vc_p, stride_vc_h,
                                 eps, HQ: tl.constexpr, HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)  # b * width + t
        h = tl.program_id(1)  # 0 .. HQ + HKV - 1: a query head, then a key (+ value) head (HQ = 0: keys only)
        b = tok // width
        t = tok % width
        j = tl.arange(0, BLOCK_HALF)
        m = j < HALF
        src = qkv_ptr + tok * stride_tok + h * D
        x1 = tl.load(src + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + j, mask=m, other=0.0).to(tl.float32)
        if QK_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            if h < HQ:
                w1 = tl.load(qw_ptr + j, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(qw_ptr + HALF + j, mask=m, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + j, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(kw_ptr + HALF + j, mask=m, other=0.0).to(tl.float32)
            x1 = (x1 * rstd * w1).to(qkv_ptr.dtype.element_ty).to(tl.float32)  # the reference's normed q/k
            x2 = (x2 * rstd * w2).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        cs = cos_ptr + tok * stride_cs
        sn = sin_ptr + tok * stride_cs
        c1 = tl.load(cs + j, mask=m, other=0.0)
        c2 = tl.load(cs + HALF + j, mask=m, other=0.0)
        s1 = tl.load(sn + j, mask=m, other=0.0)
        s2 = tl.load(sn + HALF + j, mask=m, other=0.0)
        o1 = x1 * c1 + (-x2) * s1  # x * cos + rotate_half(x) * sin
        o2 = x2 * c2 + x1 * s2
        if h < HQ:  # REP = HQ // HKV (1 when HQ = 0, where no program takes this branch)
            dst = qo_ptr + b * stride_qo_b + (h // REP) * stride_qo_h + (t * REP + h % REP) * stride_qo_t
            tl.store(dst + j, o1.to(qo_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + j, o2.to(qo_ptr.dtype.element_ty), mask=m)
        else:
            kh = h - HQ
            slot = tl.load(rows_ptr + b).to(tl.int64)
            pos = tl.load(pos_ptr + tok).to(tl.int64)
            kd = kc_ptr + slot * stride_kc_s + pos * stride_kc_p + kh * stride_kc_h
            tl.store(kd + j, o1.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(kd + HALF + j, o2.to(kc_ptr.dtype.element_ty), mask=m)
            vs = qkv_ptr + tok * stride_tok + (HQ + HKV + kh) * D
            vd = vc_ptr + slot * stride_vc_s + pos * stride_vc_p + kh * stride_vc_h
            tl.store(vd + j, tl.load(vs + j, mask=m, other=0.0).to(vc_ptr.dtype.element_ty), mask=m)
            tl.store(vd + HALF + j, tl.load(vs + HALF + j, mask=m, other=0.0).to(vc_ptr.dtype.element_ty), mask=m)


def rotary_qkv_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int
                     ) -> torch.Tensor:
    """Fused :func:`rotary_qkv_cache_ref` (same arguments and result): one Triton launch over
    ``B*W x (Hq + Hkv)`` programs. ``qkv``, ``cos``/``sin`` need a contiguous last dimension and token-major rows
    (``[B, W, ...]`` contiguous, as the GEMM and ``Rotary.cos_sin`` produce); the caches need a contiguous last
    dimension. No host synchronisation (positions and rows are read on the device): CUDA-graph capturable.

    Raises:
        RuntimeError: Triton is not installed.
        ValueError: odd head_dim, Hq not a multiple of Hkv, one of q_norm/k_norm only, or mis-shaped inputs.
    """
    if not HAVE_TRITON:
        raise RuntimeError("rotary_qkv_cache needs triton (use rotary_qkv_cache_ref)")
    b, w, n = qkv.shape
    d = cos.shape[-1]
    if (d % 2 or num_heads % num_kv_heads or n != (num_heads + 2 * num_kv_heads) * d
            or (q_norm is None) != (k_norm is None) or cos.shape != (b, w, d) or sin.shape != cos.shape
            or positions.shape != (b, w) or rows.shape != (b,) or k_cache.shape[-2:] != (num_kv_heads, d)
            or v_cache.shape != k_cache.shape):
        raise ValueError(f"rotary_qkv_cache: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, heads {num_heads}/"
                         f"{num_kv_heads}, positions {tuple(positions.shape)}, rows {tuple(rows.shape)}, "
                         f"cache {tuple(k_cache.shape)}")
    if qkv.stride(-1) != 1 or qkv.stride(0) != w * qkv.stride(1):
        qkv = qkv.contiguous()
    cos, sin, positions, rows = cos.contiguous(), sin.contiguous(), positions.contiguous(), rows.contiguous()
    rep = num_heads // num_kv_heads
    qo = torch.empty((b, num_kv_heads, w * rep, d), dtype=qkv.dtype, device=qkv.device)
    if b * w == 0:
        return qo
    rep = max(rep, 1)
    qo_arg = qo if num_heads else qkv  # no query heads: an unused pointer (qo has no elements)
    half = d // 2
    qk_norm = q_norm is not None
    qw = q_norm if qk_norm else cos  # unused pointers when there is no qk-norm
    kw = k_norm if qk_norm else cos
    _rotary_qkv_cache_kernel[(b * w, num_heads + num_kv_heads)](
        qkv, cos, sin, qw, kw, qo_arg, k_cache, v_cache, rows, positions, w, qkv.stride(1), cos.stride(1),
        qo.stride(0), qo.stride(1), qo.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(eps), HQ=num_heads, HKV=num_kv_heads,
        REP=rep, D=d, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), QK_NORM=qk_norm,
        num_warps=1 if d <= 64 else 2)
    return qo


def rotary_kv_cache_ref(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_norm: torch.Tensor | None,
                        eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                        positions: torch.Tensor, num_kv_heads: int) -> None:
    """Reference of the keys-only case (the drafter's context K/V, adaflash_ray/models/drafter.py
    ``append_context``): :func:`rotary_qkv_cache_ref` with no query heads.

    Args:
        kv: ``[B, W, 2*Hkv*D]`` fused k/v projection output (k heads, then v heads). k_norm: ``[D]`` or None.
        cos, sin, eps, k_cache, v_cache, rows, positions: as in :func:`rotary_qkv_cache_ref` (caches written in
            place at ``[rows[b], positions[b, t]]``).
    """
    rotary_qkv_cache_ref(kv, cos, sin, k_norm, k_norm, eps, k_cache, v_cache, rows, positions, 0, num_kv_heads)


def rotary_kv_cache(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_norm: torch.Tensor | None, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                    num_kv_heads: int) -> None:
    """Fused :func:`rotary_kv_cache_ref`: k-norm + rotary of the keys and the K/V cache write in one launch of
    :func:`rotary_qkv_cache`'s kernel with no query heads (``B*W x Hkv`` programs). Same input rules and errors."""
    rotary_qkv_cache(kv, cos, sin, k_norm, k_norm, eps, k_cache, v_cache, rows, positions, 0, num_kv_heads)
