"""Triton kernel of the per-row vocabulary math of :mod:`adaflash_ray.kernels.fused_distill` (the ``triton`` backend).

One program per row of a chunk streams the row's student and teacher logits (any float dtype, bf16 on a GPU) twice,
all arithmetic in fp32 registers:

1. online softmax statistics (running max + rescaled sums, as in flash attention): ``logsumexp`` of ``z_S`` at
   T = 1 and of ``u = z / T`` for student and teacher, ``Σ exp(u_S - m)(u_S - u_T)`` (reverse KL) or
   ``Σ exp(u_T - m)(u_T - u_S)`` (forward KL), ``Σ exp(z_S - m) z_S`` (entropy), and both argmaxes (first index
   of the maximum, as ``torch.argmax``);
2. the gradient coefficients of the row (``α w_i / Σw`` for CE; ``(1-α) w_i / Σw · [clip not active]`` for the
   divergence), then ``dL/dz_S`` (formulas in :mod:`adaflash_ray.kernels.fused_distill`) written over the student
   logits in place, ready for the ``dz @ W`` GEMM.

Per-row outputs: CE, divergence (T² included), both argmaxes (int64), optionally (max probability, entropy) at
T = 1 and the student's log-probability of a given token per row at T = 1. The reference is
:func:`adaflash_ray.kernels.fused_distill.rows_torch` (tests/test_kernels.py under ``TRITON_INTERPRET=1`` on CPU,
tests/test_gpu.py on CUDA). Importing this module needs the triton package.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: vocabulary elements per loop step of a program (49,152 = 12 steps for SmolLM2's head) and warps per program;
#: read at every launch (the loss bench, adaflash_ray/trainer_bench.py --loss, sets them to compare). ptxas of
#: Triton 3.6 for sm_90a (compiled on a CPU machine, not run): 4096 / 8 -> 112 registers per thread, 4096 / 16 -> 84,
#: 2048 / 8 -> 64, 1024 / 4 -> 64, no spills in any.
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _distill_rows_kernel(zs_ptr, zt_ptr, wn_ptr, den_ptr, ce_ptr, div_ptr, sarg_ptr, targ_ptr, conf_ptr, tok_ptr,
                         tlp_ptr, stride_s, stride_t, alpha, inv_t, temperature, clip, V: tl.constexpr,
                         PER_TOKEN: tl.constexpr, REVERSE: tl.constexpr, SAME_T: tl.constexpr,
                         WANT_CONF: tl.constexpr, WANT_TOK: tl.constexpr, BLOCK: tl.constexpr):
    # V (the vocabulary) is a compile-time constant: one compilation per head, and a static loop bound
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    offs = tl.arange(0, BLOCK)

    # ---- pass 1: online statistics
    m_u = float("-inf")  # student at T: running max of u_S, Σ exp(u_S - m_u), Σ exp(u_S - m_u)(u_S - u_T)
    s_u = 0.0
    a_u = 0.0
    m_t = float("-inf")  # teacher at T: the same with roles swapped
    s_t = 0.0
    a_t = 0.0
    m_1 = float("-inf")  # student at T = 1 (separate only when T != 1); b_1 = Σ exp(z_S - m_1) z_S
    s_1 = 0.0
    b_1 = 0.0
    best_s = float("-inf")
    best_t = float("-inf")
    arg_s = 0
    arg_t = 0
    for start in range(0, V, BLOCK):
        idx = start + offs
        mask = idx < V
        zs0 = tl.load(zs_row + idx, mask=mask, other=0.0).to(tl.float32)  # 0 outside the row: finite sums
        zt0 = tl.load(zt_row + idx, mask=mask, other=0.0).to(tl.float32)
        zs = tl.where(mask, zs0, float("-inf"))  # -inf outside the row: no weight in max / exp
        zt = tl.where(mask, zt0, float("-inf"))
        # argmaxes: first index of the maximum (strict > across blocks keeps the earliest)
        bmax_s = tl.max(zs, axis=0)
        barg_s = tl.argmax(zs, axis=0)
        arg_s = tl.where(bmax_s > best_s, start + barg_s, arg_s)
        best_s = tl.maximum(best_s, bmax_s)
        bmax_t = tl.max(zt, axis=0)
        barg_t = tl.argmax(zt, axis=0)
        arg_t = tl.where(bmax_t > best_t, start + barg_t, arg_t)
        best_t = tl.maximum(best_t, bmax_t)
        us = zs * inv_t  # exact when T = 1 (inv_t = 1.0)
        ut = zt * inv_t
        d = (zs0 - zt0) * inv_t
        mu_new = tl.maximum(m_u, bmax_s * inv_t)  # max(z * c) = max(z) * c for c > 0 (monotone rounding)
        e_u = tl.exp(us - mu_new)
        r_u = tl.exp(m_u - mu_new)
        s_u = s_u * r_u + tl.sum(e_u, axis=0)
        if REVERSE:
            a_u = a_u * r_u + tl.sum(e_u * d, axis=0)
        if SAME_T:
            if WANT_CONF:
                b_1 = b_1 * r_u + tl.sum(e_u * zs0, axis=0)
        else:
            m1_new = tl.maximum(m_1, bmax_s)
            e_1 = tl.exp(zs - m1_new)
            r_1 = tl.exp(m_1 - m1_new)
            s_1 = s_1 * r_1 + tl.sum(e_1, axis=0)
            if WANT_CONF:
                b_1 = b_1 * r_1 + tl.sum(e_1 * zs0, axis=0)
            m_1 = m1_new
        m_u = mu_new
        mt_new = tl.maximum(m_t, bmax_t * inv_t)
        e_t = tl.exp(ut - mt_new)
        r_t = tl.exp(m_t - mt_new)
        s_t = s_t * r_t + tl.sum(e_t, axis=0)
        if not REVERSE:
            a_t = a_t * r_t + tl.sum(e_t * (0.0 - d), axis=0)
        m_t = mt_new

    lse_u = m_u + tl.log(s_u)
    lse_t = m_t + tl.log(s_t)
    if SAME_T:
        lse_1 = lse_u
        s_1 = s_u
        m_1 = m_u
    else:
        lse_1 = m_1 + tl.log(s_1)
    if REVERSE:
        kl = a_u / s_u - lse_u + lse_t
    else:
        kl = a_t / s_t - lse_t + lse_u
    div = kl * temperature * temperature
    z_tgt = tl.load(zs_row + arg_t).to(tl.float32)
    ce = lse_1 - z_tgt
    wn = tl.load(wn_ptr + row).to(tl.float32)
    den = tl.load(den_ptr).to(tl.float32)
    if PER_TOKEN:
        lim = div
    else:
        lim = div / den
    g_ce = alpha * wn
    g_div_t = tl.where(lim <= clip, (1.0 - alpha) * wn * temperature, 0.0)
    tl.store(ce_ptr + row, ce)
    tl.store(div_ptr + row, div)
    tl.store(sarg_ptr + row, arg_s.to(tl.int64))
    tl.store(targ_ptr + row, arg_t.to(tl.int64))
    if WANT_CONF:
        tl.store(conf_ptr + row * 2, tl.exp(m_1 - lse_1))
        tl.store(conf_ptr + row * 2 + 1, lse_1 - b_1 / s_1)
    if WANT_TOK:  # log softmax(z_S)[token] at T = 1, read before pass 2 overwrites the row
        tok = tl.load(tok_ptr + row)
        tl.store(tlp_ptr + row, tl.load(zs_row + tok).to(tl.float32) - lse_1)

    # ---- pass 2: dL/dz_S over the student logits, in place
    for start in range(0, V, BLOCK):
        idx = start + offs
        mask = idx < V
        zs = tl.load(zs_row + idx, mask=mask, other=0.0).to(tl.float32)
        zt = tl.load(zt_row + idx, mask=mask, other=0.0).to(tl.float32)
        us = zs * inv_t
        ut = zt * inv_t
        ps = tl.exp(us - lse_u)
        if SAME_T:
            p1 = ps
        else:
            p1 = tl.exp(zs - lse_1)
        g = g_ce * (p1 - tl.where(idx == arg_t, 1.0, 0.0))
        if REVERSE:
            g += g_div_t * ps * ((us - lse_u) - (ut - lse_t) - kl)
        else:
            g += g_div_t * (ps - tl.exp(ut - lse_t))
        tl.store(zs_row + idx, g.to(zs_ptr.dtype.element_ty), mask=mask)


def distill_rows_triton(zs: torch.Tensor, zt: torch.Tensor, wn: torch.Tensor, den: torch.Tensor, ce: torch.Tensor,
                        div: torch.Tensor, s_arg: torch.Tensor, t_arg: torch.Tensor, conf: torch.Tensor | None, *,
                        alpha: float, temperature: float, clip: float, per_token: bool, reverse: bool,
                        tok: torch.Tensor | None = None, tok_logprob: torch.Tensor | None = None) -> None:
    """Launch the kernel over the ``c`` rows of one chunk (results written in place).

    Args:
        zs: ``[c, V]`` student logits, row-contiguous (stride(1) == 1); overwritten with ``dL/dz_S`` in its dtype.
        zt: ``[c, V]`` teacher logits, row-contiguous.
        wn: ``[c]`` ``w_i / Σw``; den: 1-element ``Σw`` (clamped > 0), both float32 or float64.
        ce, div: ``[c]`` float32/64 outputs; s_arg, t_arg: ``[c]`` int64 outputs; conf: ``[c, 2]`` contiguous
            float output or None.
        tok, tok_logprob: ``[c]`` int64 token ids in ``[0, V)`` and their float output ``log softmax(z_S)[tok]`` at
            T = 1, or both None.
        alpha, temperature, clip, per_token, reverse: as :func:`adaflash_ray.kernels.fused_distill.fused_distill_loss`.
    Raises:
        ValueError: non-row-contiguous logits or mismatched row counts.
    """
    c, v = zs.shape
    if zs.stride(1) != 1 or zt.stride(1) != 1 or zt.shape != zs.shape:
        raise ValueError(f"zs {tuple(zs.shape)} / zt {tuple(zt.shape)} must be equal-shape row-contiguous [c, V]")
    if not (wn.shape[0] == ce.shape[0] == div.shape[0] == s_arg.shape[0] == t_arg.shape[0] == c):
        raise ValueError("per-row outputs must all have the chunk's row count")
    if c == 0:
        return
    want_conf = conf is not None
    if want_conf and not conf.is_contiguous():
        raise ValueError("conf must be contiguous [c, 2]")
    want_tok = tok is not None
    if want_tok != (tok_logprob is not None) or (want_tok and not tok.shape[0] == tok_logprob.shape[0] == c):
        raise ValueError("tok and tok_logprob go together, each with the chunk's row count")
    _distill_rows_kernel[(c,)](
        zs, zt, wn, den, ce, div, s_arg, t_arg, conf if want_conf else ce, tok if want_tok else s_arg,
        tok_logprob if want_tok else ce,
        zs.stride(0), zt.stride(0), float(alpha), 1.0 / float(temperature), float(temperature), float(clip),
        V=v, PER_TOKEN=bool(per_token), REVERSE=bool(reverse), SAME_T=float(temperature) == 1.0, WANT_CONF=want_conf,
        WANT_TOK=want_tok, BLOCK=min(BLOCK_V, triton.next_power_of_2(v)), num_warps=NUM_WARPS)


__all__ = ["BLOCK_V", "NUM_WARPS", "distill_rows_triton"]
