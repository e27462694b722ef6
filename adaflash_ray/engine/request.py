"""Request state (pure Python + the request's recorded tensors); owned by the engine."""
from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import torch

_ids = itertools.count()
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
#: the repetition penalty's bounds (vLLM sets none): it divides or multiplies float32 logits, and a penalty near 0 or a
#: huge one overflows them to ±inf (0 x inf = NaN); the range leaves room for any useful penalty (commonly 1 - 1.5)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    """Per-request generation settings. ``temperature == 0`` is greedy (lossless vs the target's
    greedy output). ``stop_token_ids`` default to the target's EOS ids."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling (temperature > 0 only); 1 = off
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # logits processing, vLLM's semantics and order (penalties -> min_tokens -> temperature -> min_p -> top_k -> top_p);
    # verification stays lossless against the processed distribution, the drafts included in the penalty counts
    top_k: int = 0  # keep the k most likely tokens; 0 (or -1) = off
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability; 0 = off
    repetition_penalty: float = 1.0  # CTRL (Keskar et al. 2019) over prompt + output: logit/rp if > 0 else logit*rp
    frequency_penalty: float = 0.0  # logit -= fp x the token's count in the output (OpenAI's definition)
    presence_penalty: float = 0.0  # logit -= pp if the token occurs in the output
    min_tokens: int = 0  # stop tokens (EOS and stop_token_ids) get probability 0 until this many are generated
    seed: int | None = None  # per-request random stream at temperature > 0 (reproducible whatever the batch)
    logprobs: int | None = None  # None = none; 0 = the chosen token's log-probability; k <= 20: and the top k
    # draft exactly this γ every step, whatever the length policy picks (e.g. block_size - 1: plain DFlash, for a
    # held-out τ that does not depend on the policy); None = the policy's γ. Capped by the tokens left, as any γ.
    draft_len: int | None = None

    def validate(self) -> None:
        """Check every field's range.

        Raises:
            ValueError: the message starts with the field's name (``"temperature must be a finite number, got
                nan"``); NaN and ±inf are refused for every float field.
        """
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_len is not None and self.draft_len < 1:
            raise ValueError(f"draft_len must be >= 1 (or None: the length policy's γ), got {self.draft_len}")
        for name in _FLOAT_FIELDS:  # before the ranges: every comparison with NaN is False
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo}, {hi}], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20] (or None), got {self.logprobs}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2 ** 63 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63) (or None), got {self.seed!r}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation. Token bookkeeping: ``all_ids = prompt_ids + output_ids``; the target KV cache
    and the feature history cover positions ``0 .. num_tokens-2``; the last token is the next anchor.
    Compared and hashed by identity (``eq=False``): the scheduler's ``list.remove`` of a finishing request then
    compares no fields of the requests before it.
    ``next_draft_len``: γ the length policy chose for the pending block (capped by the budget at use).
    Per-step records (``draft_lens``, ``num_accepted``, ``step_sources``, ``step_versions``, ``first_version``): one
    entry per decode step, complete once the request has finished; while it runs, a run of steps where every row had
    γ = 0 may still be pending in its engine (``SpecEngine.flush_records`` writes it).
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
    # its lookup drafts and its drafter blocks' drafts so far (SpecEngine request_calibration): Σ of their estimated
    # accepted tokens (the planner's uncalibrated E[accepted | γ]) and Σ of the tokens they had accepted
    lookup_estimated: float = 0.0
    lookup_accepted: int = 0
    block_estimated: float = 0.0
    block_accepted: int = 0
    # its steps in drafting mode (SpecEngine makespan_guard: steps that drafted or probed, whatever its own γ) and the
    # tokens it committed in them
    spec_steps: int = 0
    spec_tokens: int = 0
    # SpecEngine makespan_lock: drafting ended for this request; its steps are the AR engine's own (no history kept)
    ar_locked: bool = False
    admitted_step: int = 0  # the engine's decode-step count when the request was admitted (SpecEngine.num_steps)
    # with params.logprobs set: per output token its log-probability under the target's raw distribution
    # (log_softmax of the verify logits, before any processing - vLLM's default) and the top-k (token id, logprob),
    # best first (an empty list per token for logprobs = 0); both as long as output_ids
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

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
