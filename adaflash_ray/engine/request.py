"""Request state (pure Python + the request's recorded tensors); owned by the engine."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

_ids = itertools.count()


@dataclass
class SamplingParams:
    """Per-request generation settings. ``temperature == 0`` is greedy (lossless vs the target's
    greedy output). ``stop_token_ids`` default to the target's EOS ids."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling (temperature > 0 only); 1 = off
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # draft exactly this γ every step, whatever the length policy picks (e.g. block_size - 1: plain DFlash, for a
    # held-out τ that does not depend on the policy); None = the policy's γ. Capped by the tokens left, as any γ.
    draft_len: int | None = None

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_len is not None and self.draft_len < 1:
            raise ValueError(f"draft_len must be >= 1 (or None: the length policy's γ), got {self.draft_len}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation. Token bookkeeping: ``all_ids = prompt_ids + output_ids``; the target KV cache
    and the feature history cover positions ``0 .. num_tokens-2``; the last token is the next anchor.
    ``next_draft_len``: γ the length policy chose for the pending block (capped by the budget at use).
    ``features`` / ``last_hidden`` (bf16, CPU) are filled when the request finishes on a recording engine."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    slot: int | None = None
    draft_lens: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    step_versions: list[int] = field(default_factory=list)
    next_draft_len: int = 0
    features: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    first_version: int | None = None
    # draft sources (SpecEngine draft_sources): per step the source that drafted ("dflash", "ngram", "suffix" or
    # "none" for γ = 0); the lookup's per-request state and how many output tokens it has seen; the pending drafter
    # block's E[committed | γ] for γ = 1..bs-1 (None: no pending block)
    step_sources: list[str] = field(default_factory=list)
    lookup_state: object | None = None
    lookup_synced: int = 0
    dflash_expected: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)
