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
- ``fixed``: γ = block_size - 1 (plain DFlash).
"""
from __future__ import annotations

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


def draft_confidence(draft_logits: torch.Tensor) -> torch.Tensor:
    """Confidence features of drafts for the ``cost`` policy's :class:`AcceptanceHead`.

    Args:
        draft_logits: ``[..., V]`` drafter logits of block positions (any float dtype).
    Returns:
        ``[..., 2]`` float32: (max probability, entropy in nats) of ``softmax(draft_logits)`` (temperature 1).
    """
    z = draft_logits.float()
    lse = torch.logsumexp(z, dim=-1)
    maxp = (z.max(dim=-1).values - lse).exp()
    # H = lse - Σ_v p_v z_v, the sum as a batched dot product (no [.., V] product tensor)
    entropy = lse - torch.einsum("...v,...v->...", torch.softmax(z, dim=-1), z)
    return torch.stack([maxp, entropy], dim=-1)


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
