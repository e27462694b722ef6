"""Distillation losses of the drafter and the length head (docs/design/ALGORITHMS.md §3, §2).

- :func:`mixture_rkl_loss`: the AdaFlash objective ``α·CE(z_S, argmax z_T) + (1-α)·L_RKL``
  (github ZinYY/AdaFlash, pipeline/training/rkl_model.py), computed in row chunks through
  :func:`adaflash_ray.kernels.chunked_kl.chunked_kl_terms` so the full ``[M, V]`` softmax never exists at once
  (``impl="reference"``), or by :func:`adaflash_ray.kernels.fused_distill.fused_distill_loss`, which also computes
  the gradient into the drafter's hidden states in its forward pass (``impl="torch" | "triton"``).
- :func:`forward_kl_loss`: the OSD baseline (forward KL, α = 0).
- :func:`accepted_length`: the accepted length a of each training block against the trajectory.
- the length heads' own losses live beside the heads (:mod:`adaflash_ray.models.length_head`: ``length_loss``, the
  ``direct`` head's MSE, and ``acceptance_loss``, the ``cost`` head's masked BCE; imported here too); which one a
  policy trains with is its entry in :data:`adaflash_ray.engine.length_policy.LENGTH_POLICIES`.

The teacher is always detached; weights ``w`` are the position weights of
:func:`adaflash_ray.distill.blocks.collate` (decay ``exp(-(k-1)/7)`` times bounds and validity).
"""
from __future__ import annotations

import torch

from adaflash_ray.models.length_head import acceptance_loss, length_loss  # noqa: F401 - the length heads' losses
from adaflash_ray.kernels.chunked_kl import chunked_kl_terms
from adaflash_ray.kernels.fused_distill import fused_distill_loss, resolve_loss_impl

CLIP_MODES = ("per_token", "reference")


def _check_rows(student_hidden: torch.Tensor, weights: torch.Tensor,
                confidence_out: torch.Tensor | None = None) -> None:
    if weights.dim() != 1 or weights.shape[0] != student_hidden.shape[0]:
        raise ValueError(f"weights {tuple(weights.shape)} must be [M] with M = {student_hidden.shape[0]}")
    if confidence_out is not None and tuple(confidence_out.shape) != (student_hidden.shape[0], 2):
        raise ValueError(f"confidence_out {tuple(confidence_out.shape)} must be [M, 2] with "
                         f"M = {student_hidden.shape[0]}")


def _terms(student_hidden, teacher_hidden, lm_head_weight, temperature, chunk_size, direction, argmax_out,
           confidence_out, fused: dict | None = None):
    """Per-row terms ``(ce, div, s_arg, t_arg)`` and the fused loss (None on the reference path), copying the
    student argmax / confidence into the caller's optional outputs.

    ``fused=None``: :func:`chunked_kl_terms` (terms with autograd). Otherwise ``fused`` holds the remaining keyword
    arguments of :func:`fused_distill_loss` (``weights, alpha, clip, clip_mode, backend``): its loss carries the
    gradient and the terms are detached."""
    loss = None
    if fused is None:
        ce, div, s_arg, t_arg, conf = chunked_kl_terms(student_hidden, teacher_hidden, lm_head_weight,
                                                       temperature=temperature, chunk_size=chunk_size,
                                                       direction=direction, want_conf=confidence_out is not None)
    else:
        loss, (ce, div, s_arg, t_arg, conf) = fused_distill_loss(
            student_hidden, teacher_hidden, lm_head_weight, temperature=temperature, chunk_size=chunk_size,
            direction=direction, want_conf=confidence_out is not None, **fused)
    if argmax_out is not None:
        argmax_out.copy_(s_arg)
    if confidence_out is not None:
        confidence_out.copy_(conf)
    return ce, div, s_arg, t_arg, loss


def mixture_rkl_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                     weights: torch.Tensor, *, alpha: float = 0.8, temperature: float = 1.0, clip: float = 10.0,
                     clip_mode: str = "per_token", chunk_size: int = 1024,
                     argmax_out: torch.Tensor | None = None, confidence_out: torch.Tensor | None = None,
                     impl: str = "reference", token_ids: torch.Tensor | None = None, weights_fn=None,
                     weights_out: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Mixture reverse-KL distillation loss (docs/design/ALGORITHMS.md §3; AdaFlash).

    ``L = α·CE + (1-α)·L_RKL`` with ``CE = Σ_i w_i·CE_i / Σ_i w_i``, ``CE_i = -log softmax(z_S,i)[argmax z_T,i]``
    (raw logits), ``RKL_i = T²·Σ_v p_S(v)(log p_S(v) - log p_T(v))``, ``p = softmax(z / T)``, and

    - ``clip_mode="per_token"``: ``L_RKL = Σ_i w_i·min(RKL_i, clip) / Σ_i w_i``;
    - ``clip_mode="reference"``: ``L_RKL = Σ_i w_i·min(RKL_i / Σ_j w_j, clip)`` - exactly what the
      AdaFlash code does (it divides every token's RKL by the weight sum, then clamps at τ = 0.01,
      then takes the weighted sum); with no clamp active both modes agree.

    Args:
        student_hidden: ``[M, H]`` drafter final hidden states of the supervised positions.
        teacher_hidden: ``[M, H]`` target final-normed hidden states ``h_last[anchor+k-1]`` (detached).
        lm_head_weight: ``[V, H]`` the target's frozen lm_head weight (no gradient).
        weights: ``[M]`` non-negative position weights.
        alpha, temperature, clip, clip_mode: the recipe's ``distill.{alpha,temperature,rkl_clip,rkl_clip_mode}``.
        chunk_size: rows per vocabulary chunk (``distill.loss_chunk_size``).
        argmax_out: optional int64 ``[M]`` tensor that receives the student argmax (reused for the
            accepted length, saving a second vocabulary pass).
        confidence_out: optional float32 ``[M, 2]`` tensor that receives the student's (max probability,
            entropy) at temperature 1 (no gradient; the ``cost`` length head's confidence input,
            :func:`adaflash_ray.models.length_head.draft_confidence`), taken from the loss's own logits.
        impl: ``distill.loss_impl``: ``reference`` (:func:`chunked_kl_terms` under autograd), ``torch`` / ``triton``
            (:func:`fused_distill_loss` with that backend: the same loss, its gradient computed in the forward
            pass), ``auto`` (:func:`adaflash_ray.kernels.fused_distill.resolve_loss_impl` on the input's device).
        token_ids, weights_fn: weights that depend on the drafter's current predictions: ``weights_fn(student_argmax
            [M] int64, token_prob [M] float32) -> [M]`` replaces ``weights``, ``token_prob`` being the student's
            probability of ``token_ids`` ``[M]`` (the trajectory's tokens) at T = 1. The fused impls with
            ``clip_mode="per_token"`` take both from the loss's own vocabulary pass
            (:func:`~adaflash_ray.kernels.fused_distill.fused_distill_loss`); otherwise one no-grad pass over the head
            (:func:`student_token_stats`) computes them first. Same weights either way.
        weights_out: optional float32 ``[M]`` tensor that receives the weights used.
    Returns:
        ``(loss, metrics)``: loss a float32 scalar with gradient into ``student_hidden``; metrics
        ``train/ce``, ``train/rkl`` (the clipped L_RKL), ``train/rkl_raw`` (unclipped weighted mean),
        ``train/rkl_clip_frac`` (weighted share of clamped terms), ``train/top1_match`` (weighted
        share of positions with student argmax == teacher argmax), all Python floats.
        With ``M = 0`` or ``Σw = 0`` the loss is an exact zero that still depends on ``student_hidden``.
    Raises:
        ValueError: bad shapes (``confidence_out`` included), ``clip_mode``, ``chunk_size``, ``temperature`` or
            ``impl`` (``triton`` off CUDA).
    """
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    _check_rows(student_hidden, weights, confidence_out)
    impl = resolve_loss_impl(impl, student_hidden.device)
    if weights_fn is not None:
        if token_ids is None or token_ids.shape != (student_hidden.shape[0],):
            raise ValueError(f"weights_fn needs token_ids [M] with M = {student_hidden.shape[0]}")
        if impl == "reference" or clip_mode != "per_token":  # the weights first, from a pass of their own
            top1, prob = token_stats_rows(student_hidden.detach(), lm_head_weight, token_ids, chunk_size)
            weights, weights_fn = weights_fn(top1, prob), None
    used = torch.empty(student_hidden.shape[0], dtype=torch.float32, device=student_hidden.device) \
        if weights_fn is not None else None
    fused = None if impl == "reference" else dict(weights=weights, alpha=alpha, clip=clip, clip_mode=clip_mode,
                                                   backend=impl, token_ids=token_ids if used is not None else None,
                                                   weights_fn=weights_fn, weights_out=used)
    ce, rkl, s_arg, t_arg, fused_loss = _terms(student_hidden, teacher_hidden, lm_head_weight, temperature,
                                               chunk_size, "reverse", argmax_out, confidence_out, fused)
    w = (weights if used is None else used).detach().float()
    if weights_out is not None:
        weights_out.copy_(w)
    den = w.sum()
    safe_den = den.clamp_min(1e-12)
    ce_loss = (w * ce).sum() / safe_den
    rkl_raw = (w * rkl).sum() / safe_den
    if clip_mode == "per_token":
        rkl_loss = (w * rkl.clamp(max=clip)).sum() / safe_den
        clipped = rkl.detach() > clip
    else:
        per_token = rkl / safe_den
        rkl_loss = (w * per_token.clamp(max=clip)).sum()
        clipped = per_token.detach() > clip
    loss = alpha * ce_loss + (1.0 - alpha) * rkl_loss if fused_loss is None else fused_loss
    if student_hidden.shape[0] == 0:
        loss = loss + 0.0 * student_hidden.sum()  # an exact zero that still has a graph
    with torch.no_grad():
        match = (w * (s_arg == t_arg).float()).sum() / safe_den
        clip_frac = (w * clipped.float()).sum() / safe_den
        vals = torch.stack([ce_loss.detach(), rkl_loss.detach(), rkl_raw.detach(), clip_frac, match]).tolist()
    metrics = dict(zip(("train/ce", "train/rkl", "train/rkl_raw", "train/rkl_clip_frac", "train/top1_match"), vals))
    return loss, metrics


def forward_kl_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                    weights: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 1024,
                    confidence_out: torch.Tensor | None = None, impl: str = "reference"
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """The OSD baseline: weighted forward KL ``Σ_i w_i·T²·KL(p_T,i || p_S,i) / Σ_i w_i`` (α = 0, no clip).

    Shapes, ``confidence_out`` and ``impl`` as :func:`mixture_rkl_loss`. Returns ``(loss, {"train/fkl",
    "train/top1_match"})``. Raises ValueError on bad shapes or ``impl``.
    """
    _check_rows(student_hidden, weights, confidence_out)
    impl = resolve_loss_impl(impl, student_hidden.device)
    fused = None if impl == "reference" else dict(weights=weights, alpha=0.0, clip=float("inf"),
                                                   clip_mode="per_token", backend=impl)
    _, fkl, s_arg, t_arg, fused_loss = _terms(student_hidden, teacher_hidden, lm_head_weight, temperature,
                                              chunk_size, "forward", None, confidence_out, fused)
    w = weights.detach().float()
    safe_den = w.sum().clamp_min(1e-12)
    loss = (w * fkl).sum() / safe_den if fused_loss is None else fused_loss
    if student_hidden.shape[0] == 0:
        loss = loss + 0.0 * student_hidden.sum()
    with torch.no_grad():
        match = (w * (s_arg == t_arg).float()).sum() / safe_den
        vals = torch.stack([loss.detach(), match]).tolist()
    return loss, {"train/fkl": vals[0], "train/top1_match": vals[1]}


@torch.no_grad()
def accepted_length(draft_ids: torch.Tensor, target_ids: torch.Tensor, position_valid: torch.Tensor) -> torch.Tensor:
    """Accepted length a of blocks against the trajectory (greedy rule, docs/design/ALGORITHMS.md §4.1).

    Args:
        draft_ids, target_ids: ``[..., block_size-1]`` int64: the drafter's argmax and the trajectory's
            token at block positions k = 1..block_size-1.
        position_valid: ``[..., block_size-1]`` bool: the position exists (inside the sequence).
    Returns:
        ``[...]`` int64: number of leading positions with ``draft == target`` and valid; counting
        stops at the first mismatch or invalid position (AdaFlash: cumprod of matches).
    """
    ok = (draft_ids == target_ids) & position_valid
    return torch.cumprod(ok.long(), dim=-1).sum(dim=-1)


@torch.no_grad()
def student_token_stats(student_hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_ids: torch.Tensor,
                        position_valid: torch.Tensor, chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's top-1 and its probability of the trajectory's token at every valid block position, from one
    no-grad pass over the shared head in row chunks of ``chunk_size`` (one ``[chunk, V]`` logit tile at a time, in
    the hidden states' dtype; the softmax in float32).

    Args:
        student_hidden: ``[M, H]`` the drafter's hidden states at the valid positions, in ``position_valid``'s
            row-major order (``hidden[:, :, 1:][position_valid]``).
        lm_head_weight: ``[V, H]`` the shared frozen head.
        target_ids: ``[B, N, bs-1]`` int64 trajectory tokens per block position.
        position_valid: ``[B, N, bs-1]`` bool, ``M`` of them True.
        chunk_size: rows per logit tile (>= 1).
    Returns:
        ``(top1 [M] int64, prob [M] float32)``.
    Raises:
        ValueError: ``chunk_size < 1`` or ``M`` != ``position_valid.sum()``.
    """
    m = student_hidden.shape[0]
    if m != int(position_valid.sum()):
        raise ValueError(f"student_hidden has {m} rows, position_valid {int(position_valid.sum())} True")
    return token_stats_rows(student_hidden, lm_head_weight, target_ids[position_valid], chunk_size)


@torch.no_grad()
def token_stats_rows(student_hidden: torch.Tensor, lm_head_weight: torch.Tensor, token_ids: torch.Tensor,
                     chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`student_token_stats` by rows: ``student_hidden [M, H]``, ``token_ids [M]`` int64 ->
    ``(top1 [M] int64, prob [M] float32)``, the probability of ``token_ids`` at T = 1.

    Raises:
        ValueError: ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    m = student_hidden.shape[0]
    w = lm_head_weight.to(student_hidden.dtype)
    top1, prob = [], []
    for i in range(0, m, chunk_size):
        z = (student_hidden[i:i + chunk_size] @ w.T).float()  # [c, V]
        top1.append(z.argmax(-1))
        prob.append(torch.softmax(z, -1).gather(-1, token_ids[i:i + chunk_size, None])[:, 0])
    if m == 0:
        return token_ids.new_empty(0), torch.empty(0, dtype=torch.float32, device=student_hidden.device)
    return torch.cat(top1), torch.cat(prob)


def first_rejection_weights(top1: torch.Tensor, target_ids: torch.Tensor, position_valid: torch.Tensor,
                            boost: float) -> torch.Tensor:
    """Per-position weight factors that up-weight where greedy verification would reject the current drafter's
    block - the drafter's own mistakes (Draft-OPD, arXiv 2605.29343: target text alone carries little on-policy
    signal; train on the positions verification rejects).

    In each block the first valid position k whose student top-1 differs from the trajectory's token (the draft
    token verification rejects: positions before it would be accepted, after it never verified) gets factor
    ``1 + boost``; every other position 1.

    Args:
        top1: ``[M]`` int64 the drafter's top-1 at the valid positions (:func:`student_token_stats`).
        target_ids: ``[B, N, bs-1]`` int64 trajectory tokens per block position.
        position_valid: ``[B, N, bs-1]`` bool, ``M`` of them True.
        boost: ``>= 0``; 0 returns ones.
    Returns:
        ``[M]`` float32 factors (1 or ``1 + boost``), on ``top1``'s device.
    Raises:
        ValueError: ``boost < 0``.
    """
    if boost < 0:
        raise ValueError(f"boost must be >= 0, got {boost}")
    ones = torch.ones(top1.shape[0], dtype=torch.float32, device=top1.device)
    if boost == 0 or top1.shape[0] == 0:
        return ones
    draft = torch.full_like(target_ids, -1)
    draft[position_valid] = top1
    a = accepted_length(draft, target_ids, position_valid)  # [B, N]: the first rejected position's index
    k = torch.arange(target_ids.shape[-1], device=target_ids.device)
    first_reject = (k == a[..., None]) & position_valid  # [B, N, bs-1]; none where the whole block is accepted
    return ones + boost * first_reject[position_valid].float()


def dpace_weights(prob: torch.Tensor, position_valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights (arXiv 2605.18810; vLLM speculators' ``dpace_loss_decay``): a block position's loss
    weighs by how many later positions its acceptance unlocks. With the smoothed confidence
    ``s_k = (1 - alpha) * q_k + alpha`` (``q_k`` the drafter's probability of the trajectory's token at block
    position k) and the prefix products ``P_j = prod_{i <= j} s_i`` over the valid positions, the weight of
    position k is ``w_k = sum_{j >= k} P_j``. Computed without gradient; it replaces the fixed ``exp(-(k-1)/7)``.

    Args:
        prob: ``[M]`` float32 ``q`` at the valid positions, in ``position_valid``'s row-major order.
        position_valid: ``[B, N, bs-1]`` bool, ``M`` of them True; the valid positions of a block are a prefix.
        alpha: smoothing in [0, 1] (speculators' default 0.5; 1 gives ``w_k = #valid - k + 1``).
    Returns:
        ``[M]`` float32 weights (> 0).
    Raises:
        ValueError: ``alpha`` outside [0, 1] or ``M`` != ``position_valid.sum()``.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"dpace alpha must be in [0, 1], got {alpha}")
    if prob.shape[0] != int(position_valid.sum()):
        raise ValueError(f"prob has {prob.shape[0]} rows, position_valid {int(position_valid.sum())} True")
    s = torch.ones(position_valid.shape, dtype=torch.float32, device=prob.device)
    s[position_valid] = (1.0 - alpha) * prob.float() + alpha
    mask = position_valid.float()
    prefix = torch.cumprod(s, dim=-1) * mask
    w = prefix.flip(-1).cumsum(-1).flip(-1)
    return w[position_valid]
