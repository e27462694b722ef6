"""Draft-length policies (docs/design/ALGORITHMS.md §2): map the drafter's block output to γ per request."""
from __future__ import annotations

import torch

from adaflash_ray.models.length_head import DirectLengthHead, ratio_to_draft_len


class FixedLength:
    """Plain DFlash: γ = block_size - 1 for every request."""

    name = "fixed"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def __call__(self, block_hidden: torch.Tensor) -> torch.Tensor:
        return torch.full(block_hidden.shape[:1], self.block_size - 1, dtype=torch.long, device=block_hidden.device)


class DirectLength:
    """The reference AdaFlash ``direct`` head: γ = clamp(round(r·block_size·rate) - 1, min_len, bs-1)."""

    name = "direct"

    def __init__(self, head: DirectLengthHead, block_size: int, rate: float = 1.3, min_len: int = 1):
        self.head, self.block_size, self.rate, self.min_len = head, block_size, rate, min_len

    @torch.no_grad()
    def __call__(self, block_hidden: torch.Tensor) -> torch.Tensor:
        ratio = self.head(block_hidden)  # [B]
        return ratio_to_draft_len(ratio, self.block_size, self.rate, self.min_len)
