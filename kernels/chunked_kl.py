"""Per-position distillation terms over a large vocabulary, computed in row chunks.

docs/design/ALGORITHMS.md §3: never materialise the fp32 softmax over the whole vocabulary for every position
at once (151,936 x thousands of positions for Qwen3). :func:`chunked_kl_terms` walks the rows in
chunks of ``chunk_size``; each chunk computes its logits ``z = h @ W^T`` itself, and with autograd on
each chunk runs under ``torch.utils.checkpoint`` so that the backward pass recomputes that chunk's
logits instead of keeping ``[M, V]`` activations alive. Only ``[M]``-sized per-row terms survive
(plus the student's ``[M, 2]`` confidence features, computed without gradient from the same logits).

:func:`kl_terms` is the pure-torch math of one chunk (the reference a fused Triton kernel would be
tested against). Only torch is imported here.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Direction = Literal["reverse", "forward"]


def kl_terms(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
             temperature: float, direction: Direction = "reverse", want_conf: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distillation terms of ``c`` positions, materialising ``[c, V]`` logits.

    Args:
        student_hidden: ``[c, H]`` drafter final hidden states (gradient flows into it).
        teacher_hidden: ``[c, H]`` target final-normed hidden states (treated as constant).
        lm_head_weight: ``[V, H]`` the target's frozen lm_head (no gradient is taken for it).
        temperature: T > 0 for the divergence; the hard CE uses the raw logits (T = 1), as the
            AdaFlash reference (github ZinYY/AdaFlash, pipeline/training/rkl_model.py).
        direction: ``reverse``: T²·Σ_v p_S(v)(log p_S(v) - log p_T(v)) (AdaFlash);
            ``forward``: T²·Σ_v p_T(v)(log p_T(v) - log p_S(v)) (the OSD baseline).
    Returns:
        ``(ce [c] float32, div [c] float32, student_argmax [c] int64, teacher_argmax [c] int64,
        student_conf [c, 2] float32)``; ``ce = -log softmax(z_S)[argmax z_T]``; ``student_conf`` =
        (max probability, entropy in nats) of ``softmax(z_S)`` at temperature 1 whatever ``temperature``
        is (:func:`adaflash_ray.models.length_head.draft_confidence`, the ``cost`` head's input), without
        gradient and from the same logits (no second vocabulary matmul). Logits are
        ``(h.to(W.dtype) @ W^T).float()``.
    """
    w = lm_head_weight.detach()
    zs = (student_hidden.to(w.dtype) @ w.t()).float()  # [c, V]
    with torch.no_grad():
        zt = (teacher_hidden.detach().to(w.dtype) @ w.t()).float()  # [c, V]
        t_arg = zt.argmax(dim=-1)  # [c]
        log_pt = F.log_softmax(zt / temperature, dim=-1)  # [c, V]
        s_arg = zs.detach().argmax(dim=-1)  # [c]
    ce = F.cross_entropy(zs, t_arg, reduction="none")  # [c]
    log_ps = F.log_softmax(zs / temperature, dim=-1)  # [c, V]
    ps = None
    if direction == "reverse":
        ps = log_ps.exp()
        div = (ps * (log_ps - log_pt)).sum(dim=-1)
    elif direction == "forward":
        div = (log_pt.exp() * (log_pt - log_ps)).sum(dim=-1)
    else:
        raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
    if not want_conf:  # only the cost policy's head reads it: no extra [c, V] passes otherwise
        return ce, div * (temperature * temperature), s_arg, t_arg, zs.new_zeros(zs.shape[0], 0)
    with torch.no_grad():  # confidence at T = 1: reuse the T = 1 softmax where the divergence already has it
        if temperature == 1.0:
            lp1 = log_ps.detach()
            p1 = ps.detach() if ps is not None else lp1.exp()
        else:
            lp1 = F.log_softmax(zs.detach(), dim=-1)
            p1 = lp1.exp()
        conf = torch.stack([p1.max(dim=-1).values, -(p1 * lp1).sum(dim=-1)], dim=-1)  # [c, 2]
    return ce, div * (temperature * temperature), s_arg, t_arg, conf


def check_head_inputs(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                      chunk_size: int, temperature: float) -> None:
    """Shared argument checks of the head losses (here and :mod:`adaflash_ray.kernels.fused_distill`).

    Raises:
        ValueError: ``student_hidden`` / ``teacher_hidden`` not both ``[M, H]``, ``lm_head_weight`` not ``[V, H]``,
            ``chunk_size < 1`` or ``temperature <= 0``.
    """
    if student_hidden.dim() != 2 or student_hidden.shape != teacher_hidden.shape:
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} must both be [M, H]")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != student_hidden.shape[1]:
        raise ValueError(f"lm_head_weight {tuple(lm_head_weight.shape)} must be [V, {student_hidden.shape[1]}]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def chunked_kl_terms(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                     *, temperature: float = 1.0, chunk_size: int = 1024, direction: Direction = "reverse",
                     want_conf: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kl_terms` over ``M`` rows, ``chunk_size`` rows at a time (same outputs: ``(ce, div,
    student_argmax, teacher_argmax)`` ``[M]`` each and ``student_conf`` ``[M, 2]``, or ``[M, 0]`` with
    ``want_conf=False``, which skips its vocabulary passes).

    With autograd enabled and ``student_hidden.requires_grad``, each chunk runs under non-reentrant
    activation checkpointing: the forward keeps only the chunk's inputs, the backward recomputes
    its logits. Peak extra memory is O(chunk_size · V) instead of O(M · V). With a single chunk
    (M <= chunk_size) nothing is recomputed.

    Raises:
        ValueError: mismatched shapes, ``chunk_size < 1`` or ``temperature <= 0``.
    """
    check_head_inputs(student_hidden, teacher_hidden, lm_head_weight, chunk_size, temperature)
    num_rows = student_hidden.shape[0]
    teacher_hidden = teacher_hidden.detach()
    # a single chunk gains nothing from recomputation (its logits are the peak either way): skip it,
    # saving two of the five [c, V] matmuls per step
    use_ckpt = torch.is_grad_enabled() and student_hidden.requires_grad and num_rows > chunk_size
    parts = []
    for s in range(0, num_rows, chunk_size):
        hs, ht = student_hidden[s:s + chunk_size], teacher_hidden[s:s + chunk_size]
        if use_ckpt:
            parts.append(checkpoint(kl_terms, hs, ht, lm_head_weight, temperature, direction, want_conf,
                                    use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(kl_terms(hs, ht, lm_head_weight, temperature, direction, want_conf))
    if not parts:
        dev = student_hidden.device
        empty_f = student_hidden.new_zeros(0, dtype=torch.float32)
        empty_i = torch.zeros(0, dtype=torch.long, device=dev)
        return (empty_f, empty_f.clone(), empty_i, empty_i.clone(),
                student_hidden.new_zeros(0, 2 if want_conf else 0, dtype=torch.float32))
    return tuple(torch.cat(x) for x in zip(*parts))  # type: ignore[return-value]
