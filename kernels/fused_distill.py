"""Fused weighted mixture-distillation loss over the target's frozen LM head: value and input gradient in one pass.

The loss (docs/design/ALGORITHMS.md §3; AdaFlash, github ZinYY/AdaFlash, pipeline/training/rkl_model.py) over
``M`` supervised positions with student / teacher hidden states ``h_S, h_T [M, H]``, the shared frozen head
``W [V, H]`` and non-negative position weights ``w [M]``::

    z_S = h_S W^T, z_T = h_T W^T                    (logits; GEMM in W's dtype, bf16 on a GPU)
    CE_i  = logsumexp(z_S,i) - z_S,i[argmax z_T,i]  (raw logits, T = 1)
    RKL_i = T² Σ_v p_S(v) (log p_S(v) - log p_T(v)),  p = softmax(z / T)     (direction "reverse")
    FKL_i = T² Σ_v p_T(v) (log p_T(v) - log p_S(v))                        (direction "forward", OSD)
    L = α Σ_i w_i CE_i / Σw + (1-α) D,  D = Σ_i w_i min(RKL_i, clip) / Σw          (clip_mode "per_token")
                                        D = Σ_i w_i min(RKL_i / Σw, clip)           (clip_mode "reference")

Every coefficient of ``dL/dCE_i`` and ``dL/dRKL_i`` is known once row i's RKL is known (the weights are given,
the clamp's gradient is the indicator ``RKL_i <= clip``, as ``torch.clamp``'s), so the forward pass computes
``dL/dh_S`` itself, chunk by chunk of rows (the Liger-Kernel fused-linear idea), and the backward only scales it
by the incoming gradient. Per chunk of ``c`` rows: two GEMMs for the logits, the per-row vocabulary math, one
GEMM ``dL/dz @ W`` for the input gradient - three ``[c, H] x [H, V]`` GEMMs in all, against five for activation
checkpointing (:func:`adaflash_ray.kernels.chunked_kl.chunked_kl_terms`), and no gradient for the frozen ``W``.
Only ``[c, V]`` buffers of one chunk exist at a time; what survives is ``[M]`` per-row terms and ``[M, H]``.

The analytic gradients used (u = z / T, KL = RKL / T² or FKL / T²)::

    dCE/dz_S  = softmax(z_S) - onehot(argmax z_T)
    dRKL/dz_S = T · p_S ⊙ (log p_S - log p_T - KL)
    dFKL/dz_S = T · (p_S - p_T)

Two backends of the per-row vocabulary math, same GEMMs around them:

- ``torch``: pure torch in float32 (float64 when the inputs are float64); the reference, and what CPUs run;
- ``triton``: :mod:`adaflash_ray.kernels.fused_distill_triton`, one program per row streaming the vocabulary
  twice (online softmax statistics, then ``dL/dz`` written over the student logits in place), all math in fp32
  registers; CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``).

Weights receive no gradient (the trainer's weights are constants), nor does ``W`` or ``h_T``.
Only torch is imported here (triton lazily, by the ``triton`` backend).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch

from adaflash_ray.kernels.chunked_kl import check_head_inputs

Direction = Literal["reverse", "forward"]
BACKENDS = ("torch", "triton")
#: ``distill.loss_impl`` values: ``reference`` = :func:`adaflash_ray.kernels.chunked_kl.chunked_kl_terms` under
#: autograd (the original computation), ``torch`` / ``triton`` = :func:`fused_distill_loss` with that backend,
#: ``auto`` = ``triton`` on a CUDA device when triton imports, else ``reference``.
LOSS_IMPLS = ("auto", "reference", "torch", "triton")
CLIP_MODES = ("per_token", "reference")


def triton_available() -> bool:
    """True iff the ``triton`` package can be imported (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def resolve_loss_impl(impl: str, device: torch.device | str) -> str:
    """The concrete implementation ``reference | torch | triton`` for ``distill.loss_impl`` on ``device``.

    ``auto`` picks ``triton`` on CUDA when triton is importable, else ``reference`` (so CPU numbers stay those of
    the original computation).
    Raises:
        ValueError: unknown ``impl``; ``triton`` asked for on a non-CUDA device (without ``TRITON_INTERPRET=1``)
            or without the triton package.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss_impl must be one of {LOSS_IMPLS}, got {impl!r}")
    dev = torch.device(device)
    if impl == "auto":
        return "triton" if dev.type == "cuda" and triton_available() else "reference"
    if impl == "triton":
        if not triton_available():
            raise ValueError("loss_impl 'triton' needs the triton package (pip install triton)")
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"loss_impl 'triton' runs on CUDA devices (or under TRITON_INTERPRET=1), not {dev}")
    return impl


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def rows_torch(zs: torch.Tensor, zt: torch.Tensor, wn: torch.Tensor, den: torch.Tensor, *, alpha: float,
               temperature: float, clip: float, per_token: bool, reverse: bool, want_conf: bool,
               acc: torch.dtype = torch.float32, tok: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, ...]:
    """The per-row vocabulary math of one chunk in pure torch (the ``torch`` backend; the Triton kernel's reference).

    Args:
        zs, zt: ``[c, V]`` student / teacher logits (any float dtype; computed in ``acc``).
        wn: ``[c]`` ``w_i / Σw`` (``acc``). den: 0-d ``Σw`` clamped at 1e-12 (``acc``).
        alpha, temperature, clip, per_token (clip mode), reverse (direction), want_conf: see the module docstring.
        tok: optional ``[c]`` int64 token ids.
    Returns:
        ``(ce [c], div [c], s_arg [c] int64, t_arg [c] int64, conf [c, 2] or [c, 0], tok_logprob [c] or [0],
        dz [c, V])``, floats in ``acc``: ``div`` is RKL (reverse) or FKL (forward) including T²; ``conf`` = (max
        probability, entropy in nats) of ``softmax(z_S)`` at T = 1; ``tok_logprob`` = ``log softmax(z_S)[tok]`` at
        T = 1 (empty without ``tok``); ``dz = dL/dz_S``.
    """
    zs, zt = zs.to(acc), zt.to(acc)
    t_arg = zt.argmax(dim=-1)
    s_arg = zs.argmax(dim=-1)
    lse1 = torch.logsumexp(zs, dim=-1)
    ce = lse1 - zs.gather(1, t_arg[:, None]).squeeze(1)
    if temperature == 1.0:
        us, ut, lse_u = zs, zt, lse1
    else:
        us, ut = zs / temperature, zt / temperature
        lse_u = torch.logsumexp(us, dim=-1)
    log_ps = us - lse_u[:, None]
    log_pt = ut - torch.logsumexp(ut, dim=-1)[:, None]
    ps = log_ps.exp()
    if reverse:
        diff = log_ps - log_pt
        kl = (ps * diff).sum(dim=-1)
    else:
        pt = log_pt.exp()
        kl = (pt * (log_pt - log_ps)).sum(dim=-1)
    div = kl * (temperature * temperature)
    lim = div if per_token else div / den
    g_ce = alpha * wn
    g_div_t = (1.0 - alpha) * wn * (lim <= clip).to(acc) * temperature
    p1 = ps if temperature == 1.0 else torch.softmax(zs, dim=-1)
    dz = p1 * g_ce[:, None]
    dz.scatter_add_(1, t_arg[:, None], -g_ce[:, None])
    if reverse:
        dz += g_div_t[:, None] * ps * (diff - kl[:, None])
    else:
        dz += g_div_t[:, None] * (ps - pt)
    if want_conf:
        lp1 = log_ps if temperature == 1.0 else zs - lse1[:, None]
        conf = torch.stack([p1.max(dim=-1).values, -(p1 * lp1).sum(dim=-1)], dim=-1)
    else:
        conf = zs.new_zeros(zs.shape[0], 0)
    tlp = zs.new_zeros(0) if tok is None else zs.gather(1, tok[:, None]).squeeze(1) - lse1
    return ce, div, s_arg, t_arg, conf, tlp, dz


class _FusedDistill(torch.autograd.Function):
    """Loss value and ``dL/dh_S`` in the forward (see the module docstring); backward scales the saved gradient."""

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, lm_head_weight, weights, alpha, temperature, clip, per_token,
                reverse, chunk_size, want_conf, backend, token_ids, weights_fn, weights_out):
        dev = student_hidden.device
        w_head = lm_head_weight.detach()
        acc = _acc_dtype(student_hidden, teacher_hidden, w_head)
        m = student_hidden.shape[0]
        with torch.autocast(device_type=dev.type, enabled=False):
            if weights_fn is None:
                w = weights.detach().to(acc)
                den = w.sum().clamp_min(1e-12)
                wn = w / den
            else:  # unit weights now; each row's gradient is linear in its weight, so it is scaled once they exist
                den = torch.ones((), dtype=acc, device=dev)
                wn = torch.ones(m, dtype=acc, device=dev)
            want_tok = token_ids is not None
            tlp = torch.empty(m if want_tok else 0, dtype=acc, device=dev)
            ce = torch.empty(m, dtype=acc, device=dev)
            div = torch.empty(m, dtype=acc, device=dev)
            s_arg = torch.empty(m, dtype=torch.long, device=dev)
            t_arg = torch.empty(m, dtype=torch.long, device=dev)
            conf = torch.zeros(m, 2 if want_conf else 0, dtype=acc, device=dev)
            grad = torch.empty_like(student_hidden)
            if backend == "triton":
                from adaflash_ray.kernels.fused_distill_triton import distill_rows_triton
            hs_all = student_hidden.detach().to(w_head.dtype)
            ht_all = teacher_hidden.detach().to(w_head.dtype)
            for s in range(0, m, chunk_size):
                e = min(m, s + chunk_size)
                zs = hs_all[s:e] @ w_head.t()  # [c, V] in W's dtype (fp32 accumulate in the GEMM)
                zt = ht_all[s:e] @ w_head.t()
                if backend == "triton":
                    # dz overwrites zs in place; stats into the [M] outputs' slices
                    distill_rows_triton(zs, zt, wn[s:e], den, ce[s:e], div[s:e], s_arg[s:e], t_arg[s:e],
                                        conf[s:e] if want_conf else None, alpha=alpha, temperature=temperature,
                                        clip=clip, per_token=per_token, reverse=reverse,
                                        tok=token_ids[s:e] if want_tok else None,
                                        tok_logprob=tlp[s:e] if want_tok else None)
                    dz = zs
                else:
                    c_ce, c_div, c_s, c_t, c_conf, c_tlp, dz = rows_torch(
                        zs, zt, wn[s:e], den, alpha=alpha, temperature=temperature, clip=clip, per_token=per_token,
                        reverse=reverse, want_conf=want_conf, acc=acc, tok=token_ids[s:e] if want_tok else None)
                    ce[s:e], div[s:e], s_arg[s:e], t_arg[s:e] = c_ce, c_div, c_s, c_t
                    if want_conf:
                        conf[s:e] = c_conf
                    if want_tok:
                        tlp[s:e] = c_tlp
                grad[s:e] = (dz.to(w_head.dtype) @ w_head).to(grad.dtype)
                del zs, zt, dz
            if weights_fn is not None:
                w = weights_fn(s_arg, tlp.float().exp()).detach().to(acc)  # [M], from this pass's own statistics
                if w.shape != (m,):
                    raise ValueError(f"weights_fn returned {tuple(w.shape)}, expected ({m},)")
                den = w.sum().clamp_min(1e-12)
                # in place: the product is computed in the promoted float32 and rounded once into grad's dtype,
                # as a float32 copy would be, without an [M, H] float32 temporary
                grad.mul_((w / den)[:, None])
            if weights_out is not None:
                weights_out.copy_(w)
            ce_loss = (w * ce).sum() / den
            if per_token:
                d_loss = (w * div.clamp(max=clip)).sum() / den
            else:
                d_loss = (w * (div / den).clamp(max=clip)).sum()
            loss = (alpha * ce_loss + (1.0 - alpha) * d_loss).float()
        ctx.save_for_backward(grad)
        stats = (ce.float(), div.float(), s_arg, t_arg, conf.float())  # no copies when acc is float32
        ctx.mark_non_differentiable(*stats)
        return (loss, *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss.to(grad.dtype), *([None] * 14))


def fused_distill_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                       weights: torch.Tensor, *, alpha: float = 0.8, temperature: float = 1.0, clip: float = 10.0,
                       clip_mode: str = "per_token", direction: Direction = "reverse", chunk_size: int = 8192,
                       want_conf: bool = False, backend: str = "torch", token_ids: torch.Tensor | None = None,
                       weights_fn=None, weights_out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The weighted mixture loss ``L`` of the module docstring with its gradient into ``student_hidden``.

    Args:
        student_hidden: ``[M, H]`` drafter final hidden states (float; gradient flows into it).
        teacher_hidden: ``[M, H]`` target final-normed hidden states (treated as constant).
        lm_head_weight: ``[V, H]`` the shared frozen head (no gradient); the logits GEMMs run in its dtype.
        weights: ``[M]`` non-negative position weights (no gradient).
        alpha: CE share (0 with ``direction="forward"`` and ``clip=inf`` gives the OSD forward-KL loss).
        temperature: T > 0 of the divergence (the CE uses raw logits).
        clip, clip_mode: ``per_token`` clamps ``RKL_i``; ``reference`` clamps ``RKL_i / Σw`` (AdaFlash's code).
        direction: ``reverse`` (RKL) or ``forward`` (FKL).
        chunk_size: rows per chunk; ``[chunk_size, V]`` logits of student and teacher exist at a time (in W's dtype,
            plus float32 temporaries of the same shape for the ``torch`` backend).
        want_conf: also return the student's (max probability, entropy) at T = 1.
        backend: ``torch`` or ``triton``.
        token_ids: ``[M]`` int64 token per row (the trajectory's), needed by ``weights_fn``.
        weights_fn: ``None`` (``weights`` are the weights) or ``f(student_argmax [M] int64, token_prob [M] float32)
            -> [M]`` weights computed from this pass's own logits (``token_prob`` = ``softmax(z_S)[token_ids]`` at
            T = 1), so weights that depend on the drafter's current predictions (D-PACE, a rejection boost) need no
            second pass over the head; ``weights`` is then unused. Exact for ``clip_mode="per_token"`` only (each
            row's gradient is linear in its own weight there).
        weights_out: optional float ``[M]`` tensor that receives the weights used.
    Returns:
        ``(loss, (ce, div, student_argmax, teacher_argmax, conf))``: ``loss`` a float32 scalar; the rest detached,
        ``[M]`` float32 / int64 and ``conf`` ``[M, 2]`` float32 (``[M, 0]`` without ``want_conf``). With ``M = 0``
        or ``Σw = 0`` the loss is an exact zero that still depends on ``student_hidden``.
    Raises:
        ValueError: mismatched shapes, ``chunk_size < 1``, ``temperature <= 0``, unknown ``clip_mode``,
            ``direction`` or ``backend``; ``weights_fn`` without ``token_ids`` or with ``clip_mode="reference"``.
    """
    check_head_inputs(student_hidden, teacher_hidden, lm_head_weight, chunk_size, temperature)
    if weights.dim() != 1 or weights.shape[0] != student_hidden.shape[0]:
        raise ValueError(f"weights {tuple(weights.shape)} must be [M] with M = {student_hidden.shape[0]}")
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    if direction not in ("reverse", "forward"):
        raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if weights_fn is not None and (token_ids is None or clip_mode != "per_token"):
        raise ValueError("weights_fn needs token_ids and clip_mode 'per_token' (the reference clamp reads Σw)")
    if token_ids is not None and token_ids.shape != (student_hidden.shape[0],):
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must be [M] with M = {student_hidden.shape[0]}")
    loss, ce, div, s_arg, t_arg, conf = _FusedDistill.apply(
        student_hidden, teacher_hidden, lm_head_weight, weights, float(alpha), float(temperature), float(clip),
        clip_mode == "per_token", direction == "reverse", int(chunk_size), bool(want_conf), backend, token_ids,
        weights_fn, weights_out)
    return loss, (ce, div, s_arg, t_arg, conf)


__all__ = ["BACKENDS", "CLIP_MODES", "LOSS_IMPLS", "fused_distill_loss", "resolve_loss_impl", "rows_torch",
           "triton_available"]
