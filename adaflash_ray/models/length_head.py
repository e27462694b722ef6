"""Adaptive length heads (docs/design/ALGORITHMS.md §2): pick the draft length γ per request per step.

- ``direct`` (the reference AdaFlash head, github ZinYY/AdaFlash): feature = concat(mean over the
  block's drafter hidden states, last position) ``[2H]`` -> MLP 2H->256 (SiLU) -> residual 256->256
  (SiLU) -> 1 -> sigmoid = ratio r. γ = clamp(round(r * block_size * rate) - 1, min_len,
  block_size - 1), i.e. verify width γ+1 ≈ r·block_size·rate. Label r* = clamp((a + lookahead) /
  block_size, 0, 1), MSE loss, input detached from the drafter.
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
