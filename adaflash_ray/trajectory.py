"""The on-policy trajectory record shared by the engine (producer) and the distillation trainer
(consumer). No Ray here; actors ship :class:`Trajectory` objects through the Ray object store.

Layout for a sequence of ``T`` tokens (prompt + response):

- ``token_ids`` ``[T]`` int64; ``prompt_len`` tokens of prompt, the rest the target's response.
- ``features`` ``[T-1, K*H]`` bfloat16: the K captured target layers at positions 0..T-2 (the last
  token was never fed to the target), exactly what the engine computed while verifying.
- ``last_hidden`` ``[T-1, H]`` bfloat16: final-normed target hidden state (teacher logits =
  ``lm_head(last_hidden)``), or None for ``features: recompute``.
- ``drafter_version``: version active at the request's first speculative step;
  ``step_versions``, ``draft_lens`` (γ), ``num_accepted`` (a): one entry per verify step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Trajectory:
    request_id: str
    token_ids: torch.Tensor
    prompt_len: int
    features: torch.Tensor | None
    last_hidden: torch.Tensor | None
    drafter_version: int
    draft_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))
    num_accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))
    step_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return self.num_tokens - self.prompt_len

    def validate(self) -> None:
        """Raise ValueError if shapes are inconsistent (a corrupt or truncated record)."""
        t = self.num_tokens
        if not 0 < self.prompt_len < t:
            raise ValueError(f"trajectory {self.request_id}: prompt_len {self.prompt_len} not in (0, {t})")
        for name in ("features", "last_hidden"):
            x = getattr(self, name)
            if x is not None and x.shape[0] != t - 1:
                raise ValueError(f"trajectory {self.request_id}: {name} has {x.shape[0]} rows, expected {t - 1}")
        if not (len(self.draft_lens) == len(self.num_accepted) == len(self.step_versions)):
            raise ValueError(f"trajectory {self.request_id}: per-step arrays differ in length")
        if len(self.num_accepted) and bool((self.num_accepted > self.draft_lens).any()):
            raise ValueError(f"trajectory {self.request_id}: accepted length exceeds draft length")


def within_version_lag(latest_version: int, version: int, max_version_lag: int) -> bool:
    """The staleness rule (docs/design/ALGORITHMS.md §3): a trajectory produced by drafter ``version`` may train
    the drafter at ``latest_version`` when the version lag ``latest_version - version`` is at most
    ``max_version_lag`` (0 = synchronous). Used by the buffer on arrival and on delivery and by the trainer's
    replay pool."""
    return latest_version - version <= max_version_lag
