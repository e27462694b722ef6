"""Draft-length policies (docs/design/ALGORITHMS.md §2): map the drafter's block output to γ per request.

Every policy is called inside the engine step (CUDA-graph safe: no host synchronisation) as
``policy(block_hidden [B, bs, H], draft_logits [B, bs-1, V], live [B] bool | None) -> γ [B]`` int64; ``live``
marks the rows that are real requests (the rest are idle slots or bucket padding; None = all real). A policy
whose class sets ``needs_anchor_hidden = True`` (the ``bucket`` policy) is also given ``anchor_hidden=[B, H]``, the
target's final-normed hidden state whose logits gave each row's anchor token.

Between steps the engine asks the policy, on the host, about the batch (:class:`LengthPolicy`'s hooks): which γ
newly admitted requests start with, whether this step proposes a block at all (the ``cost`` policy's γ = 0
regime and its probe schedule), what the step's answer was, and that the drafter weights changed.

:data:`LENGTH_POLICIES` is the one registry of policies: a name -> its engine policy, its head class, the head's
checkpoint tensors and its training loss. The recipe's validation, the model factory, the engine, the trainer and
the benchmark all read it; a new policy is its own module plus one entry here.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from adaflash_ray.models.length_head import (AcceptanceHead, DirectLengthHead, HeadLossInputs, acceptance_head_loss,
                                             direct_head_loss, draft_confidence, expected_committed,
                                             ratio_to_draft_len)
from adaflash_ray.models.length_head import BucketLengthHead, bucket_head_loss


#: the longest wait between probes of an AR stretch, in units of ``probe_every`` (the wait doubles from 1 x): a probe
#: (the drafter's context caught up, a block proposed) costs several AR steps, so at 16 x 8 steps a long stretch spends
#: under 1% of its steps probing
PROBE_MAX_FACTOR = 16
#: the cost policy's tie margin: every γ whose expected tokens per ms is within this share of the best γ's counts as
#: a tie, broken toward the longest draft (a measured cost table is this noisy between equal workers, and a longer
#: draft at the same cost only adds chances for the tokens the acceptance head under-rates)
COST_TIE = 0.02


class LengthPolicy:
    """The host-side hooks every length policy has; the defaults draft on every step.

    The engine calls them between steps, in this order per step: :meth:`on_admit` (requests were just prefilled),
    :meth:`propose_now` (whether the step proposes the next block), :meth:`after_step` (the step's answers), and
    :meth:`on_drafter_reload` whenever the drafter weights change. Each policy also defines the classmethod
    ``create(head, block_size, *, rate, min_len, ar_steps, probe_every)`` (the recipe's ``length_head`` settings;
    it reads the ones it uses), through which :class:`LengthPolicySpec` builds it.
    """

    name = ""

    def admit_proposes(self, running_draft_lens: list[int]) -> bool:
        """Whether the prefill of requests joining a batch whose running requests have these γ (empty: a new batch)
        proposes their first block (and builds their drafter context); False leaves both to the first step that
        proposes. The engine asks it only when no admitted request fixes its own γ."""
        return True

    def on_admit(self, draft_lens: list[int], running_draft_lens: list[int], spec: bool,
                 proposed: bool = True) -> list[int]:
        """γ per admitted request (``draft_lens``: the prefill's propose, host ints; all 0 when it did not
        propose, ``proposed`` False) given the γ of the requests already running (empty: a new batch); ``spec`` False
        for an AR-mode prefill. Returns the γ to use."""
        return draft_lens

    def propose_now(self, spec: bool, pending_draft_lens: list[int], own_draft_len: list[bool]) -> bool:
        """Whether this step proposes the next block (read with ``spec`` only; an AR-mode step never does), given
        the policy's pending γ per running request and which requests fix their own γ
        (``SamplingParams.draft_len``)."""
        return True

    def would_propose(self, spec: bool, pending_draft_lens: list[int], own_draft_len: list[bool]) -> bool:
        """What :meth:`propose_now` would answer now, changing nothing (a look ahead)."""
        return True

    def after_step(self, spec: bool, proposed: bool, next_draft_lens: list[int]) -> None:
        """The step's outcome: ``spec`` False for an AR-mode step; with ``proposed``, ``next_draft_lens`` is the
        policy's γ per request for the next step."""

    def on_drafter_reload(self) -> None:
        """New drafter weights were loaded between steps."""


class FixedLength(LengthPolicy):
    """Plain DFlash: γ = block_size - 1 for every request."""

    name = "fixed"

    def __init__(self, block_size: int):
        self.block_size = block_size

    @classmethod
    def create(cls, head, block_size, **settings) -> "FixedLength":
        return cls(block_size)

    def __call__(self, block_hidden: torch.Tensor, draft_logits: torch.Tensor | None = None,
                 live: torch.Tensor | None = None) -> torch.Tensor:
        return torch.full(block_hidden.shape[:1], self.block_size - 1, dtype=torch.long, device=block_hidden.device)


class DirectLength(LengthPolicy):
    """The reference AdaFlash ``direct`` head: γ = clamp(round(r·block_size·rate) - 1, min_len, bs-1)."""

    name = "direct"

    def __init__(self, head: DirectLengthHead, block_size: int, rate: float = 1.3, min_len: int = 1):
        self.head, self.block_size, self.rate, self.min_len = head, block_size, rate, min_len

    @classmethod
    def create(cls, head, block_size, *, rate, min_len, **settings) -> "DirectLength":
        return cls(head, block_size, rate, min_len)

    @torch.no_grad()
    def __call__(self, block_hidden: torch.Tensor, draft_logits: torch.Tensor | None = None,
                 live: torch.Tensor | None = None) -> torch.Tensor:
        ratio = self.head(block_hidden)  # [B]
        return ratio_to_draft_len(ratio, self.block_size, self.rate, self.min_len)


class CostLength(LengthPolicy):
    """The ``cost`` policy (docs/design/ALGORITHMS.md §2, policy 3, adaflash_ray's own): per batch, the γ that maximises
    expected committed tokens per second.

    The :class:`AcceptanceHead` gives each request's conditional acceptance probabilities p_i (from the drafter's
    hidden state and the draft's confidence), hence ``E_r[c(γ)] = 1 + Σ_{i<=γ} Π_{j<=i} p_j``. The batch's verify
    width is padded to its longest γ, so one γ serves every row: ``γ* = argmax_γ Σ_r E_r[c(γ)] / t(B, γ)`` where
    ``t(B, γ)`` (ms) is a step at batch B and verify width γ+1 as this engine measured it on its own hardware
    (:meth:`set_costs`, filled by :meth:`SpecEngine.calibrate_costs`). Only live rows count in the sum (not idle
    slots or bucket padding). Without costs the policy drafts the whole block (plain DFlash).

    γ = 0 (``ar_steps``, with an AR cost row): drafting is worth less than not drafting. An AR step commits one
    token per live row and costs ``t_AR(B)``, a target forward of width 1 with no drafter propose; when
    ``n_live / t_AR(B) > max_γ Σ_r E_r[c(γ)] / t(B, γ)`` the policy answers 0 and the engine decodes without
    drafting, proposing again every ``probe_every`` steps to re-check (the probe schedule below). That is the
    load-dependent switch the reference head lacks (the reference AdaFlash head has to be turned off by hand at low
    concurrency): at high concurrency a speculative step can cost more than its τ makes up for.

    The probe schedule (host state, advanced by the engine's hooks between steps): while the policy's last answer
    for the whole running batch was γ = 0 (``ar_chosen``), a step proposes only once ``steps_since_probe`` reaches
    ``probe_interval``; each probe that answers 0 again doubles the interval (at most :data:`PROBE_MAX_FACTOR` x ``probe_every``), and an
    answer of γ >= 1, a new batch, or a drafter reload brings it back to ``probe_every``. A γ = 0 answer in the middle of
    a drafting stretch (the answer before it was γ >= 1) waits one AR step first, then doubles from there: a drafter
    that pays on most anchors loses one step at a hard one, not ``probe_every``. In the γ = 0 regime a
    prefill proposes nothing (:meth:`admit_proposes`): requests joining a batch that waits at γ = 0, or starting one,
    get their drafter context at the next probe.

    The realised-throughput guard (the engine's, with ``ar_steps``: :class:`~adaflash_ray.engine.throughput_guard.
    ThroughputGuard`): the table is measured once, on an idle engine; what the steps really cost can differ (γ = 0
    steps, probes and context catch-ups dearer than it says). Per batch bucket (the table's batch sizes) the engine
    keeps moving averages of realised committed tokens per row per ms of AR / γ = 0 steps and of this policy's other
    steps (drafting steps and probes, their catch-ups included); where the policy's rate falls below AR's by the margin
    (2 %), it forces AR steps (γ = 0, no propose, no catch-up) for a back-off that doubles while that holds (at most
    :data:`PROBE_MAX_FACTOR` x), then lets the policy choose again. The policy's own state is left as it was: after a
    back-off its next step proposes (the pending blocks were dropped), as after any AR stretch.
    """

    name = "cost"

    def __init__(self, head: AcceptanceHead, block_size: int, min_len: int = 1, ar_steps: bool = True,
                 probe_every: int = 8):
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.head, self.block_size, self.min_len = head, block_size, min_len
        self.ar_steps, self.probe_every = ar_steps, probe_every
        self.batch_sizes: list[int] = []
        self.costs: torch.Tensor | None = None  # [len(batch_sizes), bs-1] ms, device of the head
        self.ar_costs: torch.Tensor | None = None  # [len(batch_sizes)] ms of an AR step (no propose), or None
        self.ar_chosen = False  # the last answer for the running batch was γ = 0
        self.steps_since_probe = 0  # AR steps since the last propose while it was
        self.probe_interval = probe_every  # AR steps before the next propose (doubles while γ stays 0)
        # the draft confidence by the Triton kernel (True) or the torch reference (False): the engine sets its
        # fused-kernel choice (and compiles the kernel before any graph capture)
        self.fused_confidence = False

    @classmethod
    def create(cls, head, block_size, *, min_len, ar_steps, probe_every, **settings) -> "CostLength":
        return cls(head, block_size, min_len, ar_steps=ar_steps, probe_every=probe_every)

    # ------------------------------------------------------------------ probe schedule (host, between steps)
    def admit_proposes(self, running_draft_lens: list[int]) -> bool:
        """Not in the γ = 0 regime: joining a batch whose running requests all wait at γ = 0 (:meth:`on_admit` caps the
        newcomers' γ at 0: a first block would be dropped), or starting a batch while the earlier one's γ = 0 answer
        stands and no probe is due (the probe after the shortest wait asks the policy for it: a graph step, cheaper
        than an eager propose in the prefill). A due probe (e.g. the one a drafter reload sets up) proposes here."""
        if not self.ar_steps:
            return True
        if running_draft_lens:
            return any(running_draft_lens)
        return not self.ar_chosen or self.steps_since_probe >= self.probe_interval

    def on_admit(self, draft_lens: list[int], running_draft_lens: list[int], spec: bool,
                 proposed: bool = True) -> list[int]:
        """Joining a running batch, admitted requests take at most its γ (their prefill's propose saw only the
        admitted rows, the cost of a small batch, and one long block would widen every row's verify). A new batch
        whose prefill proposed: that propose is the policy's answer for it; one whose prefill did not
        (:meth:`admit_proposes`) keeps the γ = 0 answer until its first probe. Either way an earlier batch's long probe
        wait is gone."""
        if running_draft_lens:
            cap = max(running_draft_lens)
            return [min(g, cap) for g in draft_lens]
        if proposed:
            self.ar_chosen = spec and all(g == 0 for g in draft_lens)
        self.steps_since_probe, self.probe_interval = 0, self.probe_every
        return draft_lens

    def propose_now(self, spec: bool, pending_draft_lens: list[int], own_draft_len: list[bool]) -> bool:
        """In the γ = 0 regime (every request pending at γ = 0 by the policy's answer, none with its own γ) propose
        only every ``probe_interval`` steps; otherwise propose and reset the schedule."""
        if spec and self.ar_chosen and not any(pending_draft_lens) and not any(own_draft_len):
            if self.steps_since_probe >= self.probe_interval:
                self.steps_since_probe = 0
                self.probe_interval = min(2 * self.probe_interval, PROBE_MAX_FACTOR * self.probe_every)
                return True
            self.steps_since_probe += 1
            return False
        self.steps_since_probe, self.probe_interval = 0, self.probe_every
        return True

    def would_propose(self, spec: bool, pending_draft_lens: list[int], own_draft_len: list[bool]) -> bool:
        """What :meth:`propose_now` would answer now, changing nothing (a look ahead)."""
        if spec and self.ar_chosen and not any(pending_draft_lens) and not any(own_draft_len):
            return self.steps_since_probe >= self.probe_interval
        return True

    def after_step(self, spec: bool, proposed: bool, next_draft_lens: list[int]) -> None:
        """The policy's answer for the batch after a step that proposed: a γ = 0 answer for every request enters the
        γ = 0 regime. Entered from a drafting stretch (the answer before was γ >= 1), the first wait is one AR step,
        doubling from there: one hard anchor of a drafter that otherwise pays costs one AR step, not ``probe_every``."""
        if not spec:
            self.ar_chosen = False
        elif proposed:  # the policy answered for the whole batch (one γ per batch)
            drafting = not self.ar_chosen
            self.ar_chosen = all(n == 0 for n in next_draft_lens)
            if drafting and self.ar_chosen:
                self.steps_since_probe, self.probe_interval = 0, 1

    def on_drafter_reload(self) -> None:
        """A new drafter may pay where the old one did not: the next step asks the policy."""
        if self.ar_chosen:
            self.probe_interval = self.steps_since_probe = self.probe_every

    def set_costs(self, batch_sizes: list[int], costs_ms: torch.Tensor, ar_costs_ms: torch.Tensor | None = None
                  ) -> bool:
        """``costs_ms`` ``[len(batch_sizes), bs-1]``: step time at each batch size for γ = 1..bs-1; ``ar_costs_ms``
        ``[len(batch_sizes)]``: an AR step's time (width 1, no propose), or None (γ = 0 never chosen). With the same
        batch sizes (and AR row or not) as before the values are copied in place, so CUDA graphs captured earlier
        read them; returns True when the table is new instead (graphs captured before must then be dropped: they
        read no costs or the old tensors).
        Raises:
            ValueError: shapes do not match, batch sizes not strictly increasing, or a cost is not positive."""
        costs_ms = torch.as_tensor(costs_ms, dtype=torch.float32)
        if costs_ms.shape != (len(batch_sizes), self.block_size - 1):
            raise ValueError(f"costs must be [{len(batch_sizes)}, {self.block_size - 1}], got {tuple(costs_ms.shape)}")
        if any(b >= c for b, c in zip(batch_sizes, batch_sizes[1:])) or not batch_sizes:
            raise ValueError(f"batch_sizes must be non-empty and strictly increasing, got {batch_sizes}")
        if not bool((costs_ms > 0).all()):
            raise ValueError("every cost must be > 0 ms")
        if ar_costs_ms is not None:
            ar_costs_ms = torch.as_tensor(ar_costs_ms, dtype=torch.float32)
            if ar_costs_ms.shape != (len(batch_sizes),):
                raise ValueError(f"ar_costs must be [{len(batch_sizes)}], got {tuple(ar_costs_ms.shape)}")
            if not bool((ar_costs_ms > 0).all()):
                raise ValueError("every AR cost must be > 0 ms")
        same_ar = (self.ar_costs is None) == (ar_costs_ms is None)
        if self.costs is not None and self.batch_sizes == list(batch_sizes) and same_ar:
            self.costs.copy_(costs_ms)
            if ar_costs_ms is not None:
                self.ar_costs.copy_(ar_costs_ms)
            return False
        dev = self.head.out.weight.device
        self.batch_sizes = list(batch_sizes)
        # copies: later tables are copied into these in place, which must never write into the caller's tensors
        self.costs = costs_ms.to(dev, copy=True)
        self.ar_costs = ar_costs_ms.to(dev, copy=True) if ar_costs_ms is not None else None
        return True

    def _row(self, batch_size: int) -> int:
        return min(bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1)

    def cost_row(self, batch_size: int) -> torch.Tensor | None:
        """Costs ``[bs-1]`` of the smallest calibrated batch size >= ``batch_size`` (the largest if none)."""
        if self.costs is None:
            return None
        return self.costs[self._row(batch_size)]

    def ar_cost(self, batch_size: int) -> torch.Tensor | None:
        """The AR step's cost (a 0-d view) at the same row as :meth:`cost_row`; None without an AR row or with
        ``ar_steps`` off."""
        if self.ar_costs is None or not self.ar_steps:
            return None
        return self.ar_costs[self._row(batch_size)]

    @torch.no_grad()
    def choose(self, p_accept: torch.Tensor, cost: torch.Tensor | None, live: torch.Tensor | None = None,
               ar_cost: torch.Tensor | None = None) -> torch.Tensor:
        """γ ``[B]`` (the same for every row) from acceptance probabilities ``[B, bs-1]``, costs ``[bs-1]`` (None:
        the whole block), the live rows ``[B]`` (None: all) and the AR step's cost (0-d; None: γ >= 1): the longest
        γ whose expected tokens per ms is within :data:`COST_TIE` of the best. γ = 0 when one token per live row per
        ``ar_cost`` ms beats every γ's expected tokens per ms; γ = 0 is not drafting at all, so ``min_len`` (the
        shortest draft when drafting) does not bound it."""
        if cost is None:
            return torch.full(p_accept.shape[:1], self.block_size - 1, dtype=torch.long, device=p_accept.device)
        expected = expected_committed(p_accept)  # [B, bs-1]: E_r[c(γ)], γ = 1..bs-1
        n_live = float(p_accept.shape[0]) if live is None else live.to(expected.dtype).sum()
        if live is not None:
            expected = expected * live[:, None].to(expected.dtype)
        value = expected.sum(0) / cost
        value[: self.min_len - 1] = -1.0  # γ < min_len is never chosen
        # the longest γ within COST_TIE of the best (no host sync: a masked max over the γ indices)
        near = value >= (1.0 - COST_TIE) * value.max()
        idx = torch.arange(1, value.shape[0] + 1, device=value.device)
        gamma = torch.where(near, idx, torch.zeros_like(idx)).max()
        if ar_cost is not None:  # no host sync: a tensor select, CUDA-graph safe
            gamma = torch.where(n_live / ar_cost > value.max(), torch.zeros_like(gamma), gamma)
        return gamma.expand(p_accept.shape[0]).to(torch.long)

    @torch.no_grad()
    def __call__(self, block_hidden: torch.Tensor, draft_logits: torch.Tensor | None = None,
                 live: torch.Tensor | None = None) -> torch.Tensor:
        if draft_logits is None:
            raise ValueError("the cost policy needs the draft logits")
        cost = self.cost_row(block_hidden.shape[0])
        if cost is None:  # not calibrated: no head forward needed
            return self.choose(block_hidden.new_zeros(block_hidden.shape[0], self.block_size - 1), None)
        p = torch.sigmoid(self.head(block_hidden[:, 1:], draft_confidence(draft_logits, self.fused_confidence)))
        return self.choose(p, cost, live, self.ar_cost(block_hidden.shape[0]))


class BucketLength(LengthPolicy):
    """The ``bucket`` policy (docs/design/ALGORITHMS.md §2, policy 2; the AdaFlash seed guide's
    ``AdaptiveLengthHead``): γ = G[argmax p(g | h_t)] - 1 per request, clamped to [min_len, block_size - 1].

    ``h_t`` is the target's final-normed hidden state whose logits gave the anchor token (``anchor_hidden``, which
    the engine passes to policies with ``needs_anchor_hidden``); G are the :class:`BucketLengthHead`'s verify-width
    buckets (:func:`~adaflash_ray.models.length_head.bucket_sizes`). The engine caps γ by each request's remaining
    budget on the host. No host synchronisation (CUDA-graph safe). Like the guide's head it always drafts (γ >= 1).
    """

    name = "bucket"
    needs_anchor_hidden = True

    def __init__(self, head: BucketLengthHead, block_size: int, min_len: int = 1):
        self.head, self.block_size, self.min_len = head, block_size, min_len

    @classmethod
    def create(cls, head, block_size, *, min_len, **settings) -> "BucketLength":
        return cls(head, block_size, min_len)

    @torch.no_grad()
    def __call__(self, block_hidden: torch.Tensor, draft_logits: torch.Tensor | None = None,
                 live: torch.Tensor | None = None, anchor_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """γ ``[B]`` int64 from ``anchor_hidden`` ``[B, H]`` (``block_hidden`` ``[B, bs, H]`` sets only B and the
        device). Raises ValueError without ``anchor_hidden``."""
        if anchor_hidden is None:
            raise ValueError("the bucket policy needs the target's hidden state at the anchor (anchor_hidden)")
        sizes = self.head.sizes
        gamma = sizes[self.head(anchor_hidden).argmax(-1)] - 1
        return gamma.clamp(min=min(self.min_len, self.block_size - 1), max=self.block_size - 1).to(torch.long)


# ---------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class LengthPolicySpec:
    """Everything that differs between draft-length policies, under the policy's name.

    Attributes:
        name: the recipe's ``length_head.policy``.
        engine_policy: the engine's policy class (built with :meth:`LengthPolicy.create`).
        head: the trained head's class (``from_recipe(hidden_size, head_cfg, block_size)`` builds a fresh one),
            or None for a policy without a head.
        head_tensors: the head's checkpoint tensor names (saved under ``length_head.``).
        head_loss: ``(head, HeadLossInputs) -> (loss float32 scalar, accuracy or None)``, the head's training loss
            (None without a head).
        needs_confidence: the loss reads ``HeadLossInputs.confidence`` (the student's max prob and entropy, filled
            by the distillation loss's vocabulary pass).
    """

    name: str
    engine_policy: type[LengthPolicy]
    head: type[nn.Module] | None = None
    head_tensors: tuple[str, ...] = ()
    head_loss: Callable[[nn.Module, HeadLossInputs], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    needs_confidence: bool = False

    def build_head(self, hidden_size: int, head_cfg, block_size: int) -> nn.Module | None:
        """A fresh head (float32, CPU) for a drafter of width ``hidden_size``, or None for a policy without one."""
        return None if self.head is None else self.head.from_recipe(hidden_size, head_cfg, block_size)

    def build_policy(self, head: nn.Module | None, block_size: int, **settings) -> LengthPolicy:
        """The engine's policy; ``settings``: rate, min_len, ar_steps, probe_every (``length_head``).
        Raises ValueError if ``head`` is not this policy's head class."""
        if self.head is not None and not isinstance(head, self.head):
            article = "an" if self.head.__name__[0] in "AEIOU" else "a"
            raise ValueError(f"policy {self.name!r} needs {article} {self.head.__name__}, got {type(head).__name__}")
        return self.engine_policy.create(head, block_size, **settings)


LENGTH_POLICIES: dict[str, LengthPolicySpec] = {spec.name: spec for spec in (
    LengthPolicySpec("direct", DirectLength, DirectLengthHead,
                     ("inp.weight", "inp.bias", "res.weight", "res.bias", "out.weight", "out.bias"), direct_head_loss),
    LengthPolicySpec("cost", CostLength, AcceptanceHead, ("inp.weight", "inp.bias", "out.weight", "out.bias"),
                     acceptance_head_loss, needs_confidence=True),
    LengthPolicySpec("bucket", BucketLength, BucketLengthHead, ("proj.weight", "proj.bias", "out.weight", "out.bias"),
                     bucket_head_loss),
    LengthPolicySpec("fixed", FixedLength),
)}


def length_policy(name: str) -> LengthPolicySpec:
    """The registered policy ``name``. Raises ValueError naming the known ones."""
    spec = LENGTH_POLICIES.get(name)
    if spec is None:
        known = ", ".join(repr(n) for n in LENGTH_POLICIES)
        raise ValueError(f"unknown length policy {name!r} (expected one of {known})")
    return spec


def policy_of_head_tensors(names) -> str | None:
    """The policy whose head has exactly these checkpoint tensor names (without ``length_head.``), or None."""
    found = [spec.name for spec in LENGTH_POLICIES.values() if spec.head is not None and set(spec.head_tensors) ==
             set(names)]
    return found[0] if found else None
