"""Adaptive length heads (docs/design/ALGORITHMS.md §2): pick the draft length γ per request per step.

- ``direct`` (the reference AdaFlash head, github ZinYY/AdaFlash): feature = concat(mean over the
  block's drafter hidden states, last position) ``[2H]`` -> MLP 2H->256 (SiLU) -> residual 256->256
  (SiLU) -> 1 -> sigmoid = ratio r. γ = clamp(round(r * block_size * rate) - 1, min_len,
  block_size - 1), i.e. verify width γ+1 ≈ r·block_size·rate. Label r* = clamp((a + lookahead) /
  block_size, 0, 1), MSE loss, input detached from the drafter.
- ``cost`` (adaflash_ray's own, docs/design/ALGORITHMS.md §2, policy 3): :class:`AcceptanceHead` predicts each
  draft's acceptance given its prefix was accepted (from its hidden state and :func:`draft_confidence`);
  the engine's :class:`~adaflash_ray.engine.length_policy.CostLength` turns that into expected committed tokens
  per measured millisecond. Labels: :func:`acceptance_labels`, masked BCE.
- ``bucket`` (the AdaFlash seed guide's ``AdaptiveLengthHead``, docs/design/ALGORITHMS.md §2, policy 2):
  :class:`BucketLengthHead` classifies the target's final hidden state at the anchor into verify-width buckets
  (:func:`bucket_sizes`: {2, 4, 8, 16} for block 16, {2, 4} for block 4); γ = bucket - 1. Label
  :func:`bucket_label` = the smallest bucket >= a + 1, cross-entropy (:func:`bucket_loss`).
- ``fixed``: γ = block_size - 1 (plain DFlash).

Each head's training loss sits beside it (:func:`direct_head_loss`, :func:`acceptance_head_loss`,
:func:`bucket_head_loss`, on
:class:`HeadLossInputs`); :data:`adaflash_ray.engine.length_policy.LENGTH_POLICIES` maps a policy name to its
head, loss and engine policy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class DirectLengthHead(nn.Module):
    """The reference ``direct`` head. Parameter names: ``inp.weight/bias``, ``res.weight/bias``,
    ``out.weight/bias`` (saved in the drafter checkpoint under ``length_head.``)."""

    def __init__(self, hidden_size: int, inner: int = 256):
        super().__init__()
        self.inp = nn.Linear(2 * hidden_size, inner)
        self.res = nn.Linear(inner, inner)
        self.out = nn.Linear(inner, 1)

    @classmethod
    def from_recipe(cls, hidden_size: int, head_cfg, block_size: int) -> "DirectLengthHead":
        """A fresh head for a drafter of width ``hidden_size``: ``head_cfg.hidden_size`` inner units (a
        ``LengthHeadConfig``), started from :meth:`init_prior` with ``head_cfg.lookahead``."""
        head = cls(hidden_size, head_cfg.hidden_size)
        head.init_prior(block_size, head_cfg.lookahead)
        return head

    @torch.no_grad()
    def init_prior(self, block_size: int, lookahead: int = 1) -> None:
        """Start from the prior of a fresh drafter (a = 0 accepted): zero output weights and the
        output bias at logit((0 + lookahead) / block_size), so version 0 drafts γ = min_len instead of
        spending ~60% of the block on drafts that will be rejected. Training moves it from there."""
        r = min(max((0 + lookahead) / block_size, 1e-3), 1 - 1e-3)
        self.out.weight.zero_()
        self.out.bias.fill_(float(torch.logit(torch.tensor(r))))

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """``block_hidden`` ``[..., block_size, H]`` -> ratio r ``[...]`` in (0, 1), float32."""
        h = block_hidden.to(self.inp.weight.dtype)
        feat = torch.cat([h.mean(dim=-2), h[..., -1, :]], dim=-1)  # [..., 2H]
        z = F.silu(self.inp(feat))
        z = z + F.silu(self.res(z))
        return torch.sigmoid(self.out(z)).squeeze(-1).float()


def ratio_to_draft_len(ratio: torch.Tensor, block_size: int, rate: float, min_len: int) -> torch.Tensor:
    """Map ratio r ``[B]`` to draft length γ ``[B]`` (int64): clamp(round(r·bs·rate) - 1, min_len, bs-1)."""
    width = torch.round(ratio * block_size * rate).long()
    return (width - 1).clamp(min=min_len, max=block_size - 1)


def direct_length_label(num_accepted: torch.Tensor, block_size: int, lookahead: int = 1) -> torch.Tensor:
    """Target ratio for the ``direct`` head: clamp((a + lookahead) / block_size, 0, 1), float32."""
    return ((num_accepted.float() + lookahead) / block_size).clamp(0.0, 1.0)


def draft_confidence(draft_logits: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """Confidence features of drafts for the ``cost`` policy's :class:`AcceptanceHead`.

    Args:
        draft_logits: ``[..., V]`` drafter logits of block positions (any float dtype).
        fused: take the Triton kernel that reads the logits once
            (:func:`adaflash_ray.kernels.draft_confidence.draft_confidence_fused`; the engine passes its fused-kernel
            choice); None = on CUDA with Triton unless ``ADAFLASH_FUSED_KERNELS=off``. False: the pure-torch
            reference.
    Returns:
        ``[..., 2]`` float32: (max probability, entropy in nats) of ``softmax(draft_logits)`` (temperature 1).
    """
    if fused if fused is not None else (draft_logits.is_cuda and _fused_confidence()):
        from adaflash_ray.kernels.draft_confidence import draft_confidence_fused

        return draft_confidence_fused(draft_logits)
    from adaflash_ray.kernels.draft_confidence import draft_confidence_ref

    return draft_confidence_ref(draft_logits)


def _fused_confidence() -> bool:
    """Whether :func:`draft_confidence` takes the Triton kernel on a CUDA tensor (Triton imports, the environment's
    ``ADAFLASH_FUSED_KERNELS`` is not ``off``)."""
    from adaflash_ray.kernels.triton_support import HAVE_TRITON, env_mode

    return HAVE_TRITON and env_mode() != "off"


class AcceptanceHead(nn.Module):
    """The ``cost`` policy's per-position acceptance head (docs/design/ALGORITHMS.md §2, policy 3, adaflash_ray's own).

    ``p_i = P(draft i accepted | drafts < i accepted)`` from the drafter's hidden state at block position i
    (detached) and the draft's confidence (:func:`draft_confidence`): Linear(H+2 -> inner), SiLU, Linear(inner
    -> 1), sigmoid. Trained with BCE on per-position accept / reject labels of the positions whose prefix was
    accepted. Parameter names ``inp.weight/bias``, ``out.weight/bias`` (saved under ``length_head.``)."""

    def __init__(self, hidden_size: int, inner: int = 256):
        super().__init__()
        self.inp = nn.Linear(hidden_size + 2, inner)
        self.out = nn.Linear(inner, 1)

    @classmethod
    def from_recipe(cls, hidden_size: int, head_cfg, block_size: int) -> "AcceptanceHead":
        """A fresh head for a drafter of width ``hidden_size``: ``head_cfg.hidden_size`` inner units (a
        ``LengthHeadConfig``), started from :meth:`init_prior` (``block_size`` unused: one logit per position)."""
        head = cls(hidden_size, head_cfg.hidden_size)
        head.init_prior()
        return head

    @torch.no_grad()
    def init_prior(self, p: float = 0.05) -> None:
        """Start pessimistic: every draft accepted with probability ``p`` whatever its input (a fresh
        drafter's drafts are near-random), so version 0 drafts short blocks until training moves it."""
        self.out.weight.zero_()
        self.out.bias.fill_(float(torch.logit(torch.tensor(min(max(p, 1e-3), 1 - 1e-3)))))

    def forward(self, draft_hidden: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """``draft_hidden`` ``[..., H]`` (block positions 1..bs-1), ``confidence`` ``[..., 2]`` -> acceptance
        logits ``[...]`` float32 (apply sigmoid for p_i)."""
        x = torch.cat([draft_hidden.to(self.inp.weight.dtype), confidence.to(self.inp.weight.dtype)], dim=-1)
        return self.out(F.silu(self.inp(x))).squeeze(-1).float()


def acceptance_labels(draft_ids: torch.Tensor, target_ids: torch.Tensor, position_valid: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position labels of :class:`AcceptanceHead` (greedy acceptance, docs/design/ALGORITHMS.md §4.1).

    Args:
        draft_ids, target_ids: ``[..., bs-1]`` int64 drafter argmax and the trajectory's tokens.
        position_valid: ``[..., bs-1]`` bool (the position exists).
    Returns:
        ``(label, mask)`` ``[..., bs-1]``: label = float(draft == target); mask = position valid and every earlier
        draft of the block accepted (the head predicts acceptance conditional on the prefix).
    """
    match = (draft_ids == target_ids) & position_valid
    prefix_ok = torch.cumprod(torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], dim=-1).long(), dim=-1)
    return match.float(), prefix_ok.bool() & position_valid


def expected_committed(p_accept: torch.Tensor) -> torch.Tensor:
    """``E[committed tokens | γ = k]`` for k = 1..bs-1 from conditional acceptance probabilities.

    ``p_accept`` ``[..., bs-1]`` -> ``[..., bs-1]``: ``1 + Σ_{i<=k} Π_{j<=i} p_j`` (the bonus / correction token
    plus the expected accepted prefix; docs/design/ALGORITHMS.md §2, policy 3)."""
    return 1.0 + torch.cumsum(torch.cumprod(p_accept.float(), dim=-1), dim=-1)


def bucket_sizes(block_size: int) -> list[int]:
    """The ``bucket`` head's verify widths for a drafter block of ``block_size`` positions.

    The AdaFlash seed guide's ``AdaptiveLengthHead`` uses G = {2, 4, 8, 16} for a block of 16 (16 = the whole
    block, γ = 15). Here G = the powers of two 2, 4, ... below ``block_size``, then ``block_size`` itself: {2, 4}
    for block 4, {2, 4, 8, 16} for 16, {2, 4, 8, 16, 24} for 24 (the guide's extra bucket for 70B+ targets), {2}
    for 2. A bucket g means verify width g, i.e. γ = g - 1 drafts.

    Returns:
        strictly increasing ints, the last one ``block_size``.
    Raises:
        ValueError: ``block_size < 2`` (no draft fits).
    """
    if block_size < 2:
        raise ValueError(f"the bucket head needs block_size >= 2, got {block_size}")
    sizes, g = [], 2
    while g < block_size:
        sizes.append(g)
        g *= 2
    return sizes + [block_size]


class BucketLengthHead(nn.Module):
    """The ``bucket`` policy's head: the AdaFlash seed guide's ``AdaptiveLengthHead`` (docs/design/ALGORITHMS.md
    §2, policy 2).

    Input: ``h_t``, the target's final-normed hidden state whose logits gave the anchor token (the newest target
    state when the block is drafted). Linear(H -> H/4), GELU, Linear(H/4 -> |G|) = logits over the buckets G of
    :func:`bucket_sizes`; the engine takes γ = G[argmax] - 1. ``length_head.hidden_size`` does not apply (the
    guide fixes the inner width at H/4, at least 1).

    Parameter names ``proj.weight/bias``, ``out.weight/bias`` (saved under ``length_head.``); the bucket sizes are
    a non-persistent int64 buffer ``sizes`` ``[|G|]`` (rebuilt from the block size, not in the checkpoint; a
    checkpoint of another block size has an ``out`` of another shape and is refused when loaded).
    """

    def __init__(self, hidden_size: int, block_size: int):
        super().__init__()
        sizes = bucket_sizes(block_size)
        inner = max(1, hidden_size // 4)
        self.proj = nn.Linear(hidden_size, inner)
        self.out = nn.Linear(inner, len(sizes))
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)

    @classmethod
    def from_recipe(cls, hidden_size: int, head_cfg, block_size: int) -> "BucketLengthHead":
        """A fresh head for a target (= drafter) of width ``hidden_size`` and a block of ``block_size``, started
        from :meth:`init_prior` (``head_cfg`` unused: the inner width is H/4)."""
        head = cls(hidden_size, block_size)
        head.init_prior()
        return head

    @torch.no_grad()
    def init_prior(self, p_smallest: float = 0.9) -> None:
        """Start from the prior of a fresh drafter (a = 0 accepted, label the smallest bucket): zero output weights,
        output bias giving the smallest bucket probability ``p_smallest`` and the others equal shares, so version
        0 drafts γ = 1 until training moves it."""
        n = self.out.out_features
        self.out.weight.zero_()
        self.out.bias.zero_()
        if n > 1:
            p = min(max(p_smallest, 1e-3), 1 - 1e-3)
            self.out.bias[0] = float(torch.log(torch.tensor(p * (n - 1) / (1 - p))))

    def forward(self, anchor_hidden: torch.Tensor) -> torch.Tensor:
        """``anchor_hidden`` ``[..., H]`` (any float dtype) -> bucket logits ``[..., |G|]`` float32."""
        h = anchor_hidden.to(self.proj.weight.dtype)
        return self.out(F.gelu(self.proj(h))).float()


def bucket_label(num_accepted: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Target bucket of the ``bucket`` head (the seed guide's rule): the index of the smallest bucket >= a + 1, the
    largest where none is (every draft accepted: a + 1 = block_size, the largest bucket).

    Args:
        num_accepted: ``[...]`` int64 accepted drafts a of each block (0..block_size-1).
        sizes: ``[|G|]`` int64 bucket sizes, strictly increasing (:func:`bucket_sizes`).
    Returns:
        ``[...]`` int64 indices into ``sizes``: for block 16, a = 0, 1 -> 0 (bucket 2); 2, 3 -> 1 (4); 4..7 -> 2
        (8); 8..15 -> 3 (16).
    """
    need = (num_accepted.long() + 1).contiguous()
    idx = torch.searchsorted(sizes.to(need.device), need.reshape(-1)).reshape(need.shape)
    return idx.clamp(max=sizes.numel() - 1)


# ---------------------------------------------------------------------------------------------- training losses
def length_loss(pred_ratio: torch.Tensor, num_accepted: torch.Tensor, block_size: int, lookahead: int,
                valid: torch.Tensor) -> torch.Tensor:
    """MSE of the ``direct`` head (docs/design/ALGORITHMS.md §2; AdaFlash ``thresh_head_direct_len``).

    Args:
        pred_ratio: ``[N]`` float predicted ratio r (gradient flows into the head only).
        num_accepted: ``[N]`` int64 accepted length a of each block (``adaflash_ray.distill.losses.accepted_length``).
        block_size, lookahead: label ``r* = clamp((a + lookahead) / block_size, 0, 1)``.
        valid: ``[N]`` bool, False for padding blocks.
    Returns:
        float32 scalar ``Σ_valid (r - r*)² / max(#valid, 1)``.
    Raises:
        ValueError: if the three ``[N]`` inputs differ in shape.
    """
    if not (pred_ratio.shape == num_accepted.shape == valid.shape):
        raise ValueError(f"pred_ratio {tuple(pred_ratio.shape)}, num_accepted {tuple(num_accepted.shape)} and "
                         f"valid {tuple(valid.shape)} must have the same shape")
    label = direct_length_label(num_accepted, block_size, lookahead)
    v = valid.float()
    return (v * (pred_ratio.float() - label) ** 2).sum() / v.sum().clamp_min(1.0)


def acceptance_loss(logits: torch.Tensor, label: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked BCE of the ``cost`` policy's :class:`~adaflash_ray.models.length_head.AcceptanceHead`
    (docs/design/ALGORITHMS.md §2, policy 3).

    Args:
        logits: ``[...]`` acceptance logits (gradient flows into the head only).
        label: ``[...]`` float 1.0 = draft accepted, 0.0 = rejected.
        mask: ``[...]`` bool: positions that count (valid, every earlier draft of the block accepted).
    Returns:
        ``(loss, accuracy)``: loss = float32 scalar ``Σ_mask BCE-with-logits / max(#mask, 1)`` (an exact zero
        that still has a graph into ``logits`` when no position counts); accuracy = detached float32 share of
        masked positions where ``(logit > 0) == label`` (0 when none).
    Raises:
        ValueError: if the three inputs differ in shape.
    """
    if not (logits.shape == label.shape == mask.shape):
        raise ValueError(f"logits {tuple(logits.shape)}, label {tuple(label.shape)} and mask {tuple(mask.shape)} "
                         "must have the same shape")
    lab = label.float()
    z = logits.float()
    bce = F.binary_cross_entropy_with_logits(z, lab, reduction="none")
    return _masked_mean_and_accuracy(bce, (z > 0).float() == lab, mask)


def _masked_mean_and_accuracy(per_item: torch.Tensor, hit: torch.Tensor, mask: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_mask per_item / max(#mask, 1), detached Σ_mask hit / max(#mask, 1))``, float32 scalars; ``per_item``,
    ``hit`` (bool) and ``mask`` (bool) of one shape."""
    m = mask.float()
    count = m.sum().clamp_min(1.0)
    loss = (m * per_item).sum() / count
    with torch.no_grad():
        acc = (m * hit.float()).sum() / count
    return loss, acc


@dataclass
class HeadLossInputs:
    """What a training step hands a length head's loss (all detached from the drafter; M supervised positions).

    block_hidden: ``[B, N, bs, H]`` drafter hidden states of every training block. draft_hidden: ``[M, H]`` those
    of the supervised positions (``position_valid``, block positions 1..bs-1). confidence: ``[M, 2]`` float32
    (max prob, entropy) of the student there, or None when the policy does not ask for it
    (``LengthPolicySpec.needs_confidence``). draft_ids / target_ids: ``[B, N, bs-1]`` int64 student argmax
    (-1 where invalid) and the trajectory's tokens. position_valid: ``[B, N, bs-1]`` bool. num_accepted: ``[B, N]``
    int64 accepted length a per block. anchor_valid: ``[B, N]`` bool (False for padding blocks). block_size,
    lookahead: the recipe's (``drafter.block_size``, ``length_head.lookahead``). anchor_hidden: ``[B, N, H]``
    the target's final-normed hidden state whose logits gave each block's anchor token (trajectory position
    anchor - 1; the state a head reading the target sees when the block is drafted), or None where not given.
    """

    block_hidden: torch.Tensor
    draft_hidden: torch.Tensor
    confidence: torch.Tensor | None
    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    position_valid: torch.Tensor
    num_accepted: torch.Tensor
    anchor_valid: torch.Tensor
    block_size: int
    lookahead: int
    anchor_hidden: torch.Tensor | None = None


def direct_head_loss(head: DirectLengthHead, x: HeadLossInputs) -> tuple[torch.Tensor, None]:
    """The ``direct`` head's training loss: :func:`length_loss` of its ratio per valid block. Returns
    ``(loss, None)`` (no accuracy metric)."""
    ratio = head(x.block_hidden)  # [B, N]
    return length_loss(ratio.reshape(-1), x.num_accepted.reshape(-1), x.block_size, x.lookahead,
                       x.anchor_valid.reshape(-1)), None


def acceptance_head_loss(head: AcceptanceHead, x: HeadLossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cost`` policy's head loss: :func:`acceptance_loss` on :func:`acceptance_labels` of the supervised
    positions (greedy acceptance against the trajectory, counted where every earlier draft was accepted).
    Returns ``(loss, accuracy)``."""
    label, mask = acceptance_labels(x.draft_ids, x.target_ids, x.position_valid)  # [B, N, bs-1]; mask => valid
    logits = head(x.draft_hidden, x.confidence)  # [M]
    sel = x.position_valid
    return acceptance_loss(logits, label[sel], mask[sel])


def bucket_loss(logits: torch.Tensor, num_accepted: torch.Tensor, sizes: torch.Tensor, valid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the ``bucket`` head (the seed guide's ``AdaptiveLengthHead``; docs/design/ALGORITHMS.md §2,
    policy 2) against :func:`bucket_label`.

    Args:
        logits: ``[N, |G|]`` bucket logits (gradient flows into the head only).
        num_accepted: ``[N]`` int64 accepted drafts a of each block.
        sizes: ``[|G|]`` int64 bucket sizes.
        valid: ``[N]`` bool, False for padding blocks.
    Returns:
        ``(loss, accuracy)``: loss = float32 scalar ``Σ_valid CE / max(#valid, 1)`` (an exact zero with a graph
        into ``logits`` when no block is valid); accuracy = detached float32 share of valid blocks whose argmax is
        the label (0 when none).
    Raises:
        ValueError: ``logits`` is not ``[N, len(sizes)]`` or ``num_accepted`` / ``valid`` are not ``[N]``.
    """
    if logits.dim() != 2 or logits.shape[1] != sizes.numel() or not (
            num_accepted.shape == valid.shape == logits.shape[:1]):
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, {sizes.numel()}] with num_accepted "
                         f"{tuple(num_accepted.shape)} and valid {tuple(valid.shape)} of shape [N]")
    label = bucket_label(num_accepted, sizes)
    z = logits.float()
    return _masked_mean_and_accuracy(F.cross_entropy(z, label, reduction="none"), z.argmax(-1) == label, valid)


def bucket_head_loss(head: BucketLengthHead, x: HeadLossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``bucket`` head's training loss: :func:`bucket_loss` of its logits from ``x.anchor_hidden`` (the target's
    state that gave each block's anchor) against each block's accepted drafts ``x.num_accepted``, over the valid
    blocks. Returns ``(loss, accuracy)``.

    Raises:
        ValueError: ``x.anchor_hidden`` is None (the trainer fills it from the trajectory's final hidden states).
    """
    if x.anchor_hidden is None:
        raise ValueError("the bucket head needs HeadLossInputs.anchor_hidden (the target's state at each anchor)")
    logits = head(x.anchor_hidden.detach())  # [B, N, |G|]
    return bucket_loss(logits.reshape(-1, logits.shape[-1]), x.num_accepted.reshape(-1), head.sizes,
                       x.anchor_valid.reshape(-1))
