"""ThroughputGuard: adaptive drafting is never slower than AR, by the realised record (docs/design/ALGORITHMS.md §2).

The ``cost`` policy and the :class:`~adaflash_ray.engine.hybrid.HybridPlanner` choose γ by a cost table measured once
at start-up; when the table is wrong for the running load (γ = 0 steps, probes and context catch-ups that cost more
than it says) they can lose to plain AR. The guard watches what the steps really cost. Per batch-size bucket (the cost
table's batch sizes; a step's batch size is ``max(slot) + 1`` as the table's row) it keeps exponential moving averages
of committed tokens per row and of wall milliseconds for two kinds of step:

- AR: a step with γ = 0 for every row and no drafter propose (the policy's γ = 0 steps, the guard's own forced steps,
  ``mode="ar"`` steps);
- policy: every other step of the policy - steps that verify drafts and probes (γ = 0 verify that proposes a block),
  each with the drafter-context catch-up that runs inside it (all charged to the policy).

``rate = EMA(tokens per row) / EMA(ms)`` (a ratio of averages: a slow probe weighs by its time; per row, so a step
with fewer live rows in the same bucket - requests finished, slots idle - compares like with like: at a bucket a
step costs about the same whatever its live rows, so ``rate_policy / rate_AR`` is the policy's speedup there).
A drafting step's committed tokens per row vary far more with few live rows (at one row one step commits 1 token,
the next 16) than averaged over many, so the policy's decisions rest on its live rows, not its steps: a comparison
needs policy steps holding at least ``min_rows`` rows between them (and at least ``min_samples`` steps) - 32 steps with
one live row, ``min_samples`` from ``min_rows / min_samples`` rows up - and each policy step weighs
``min(decay, rows / min_rows)`` in the policy's averages. AR steps commit exactly one token per row; their reference
keeps ``min_samples`` steps. Every average is a plain running mean until its window is full (weight ``max(w,
1 / samples)``), so its first sample does not linger. When a bucket has at least ``min_samples`` AR samples, the policy
samples above and as many since its last back-off, and ``rate_policy < (1 - margin) x rate_AR``, the guard forces AR
steps there (γ = 0, no propose, no catch-up) for ``backoff_steps x factor`` steps; the
factor doubles each time the condition still holds when the policy has had its next such steps (at most
:data:`~adaflash_ray.engine.length_policy.PROBE_MAX_FACTOR`), and returns to 1 once it does not. Then the policy runs
again as it would. A bucket with policy samples and fewer than ``min_samples`` AR samples, or whose AR samples are
older than ``ar_refresh_steps`` of its steps, gets the missing AR steps forced in a row (a policy that never answers
γ = 0 still has an AR reference, and context growth does not leave a stale one). A new batch resets the back-off
(factor 1, nothing forced); a drafter reload also forgets the policy's averages (they measured the old drafter).

A prior AR cost per bucket (:meth:`ThroughputGuard.set_prior`: the AR step ms of the start-up cost table, one token a
row) spares the forced AR reference where it cannot change a verdict: while the policy's realised rate is at least
:data:`PRIOR_DECISIVE` x the prior's AR rate, a reference run (the first, or a refresh) is not forced - realised AR
steps would have to run below ``(1 - margin) / PRIOR_DECISIVE`` (~0.78) x the table's AR ms for the comparison to
back off. Below that the reference runs as without a prior. The prior is never a measurement:
:meth:`ThroughputGuard.step_costs` (the makespan guard's AR ms) answers from measured AR steps only, and not from
stale ones (a table's AR ms, timed at a short context, runs below the realised ones); where the prior spared them
the makespan guard prices AR by the table's ms (:meth:`ThroughputGuard.prior_costs`, optimistic for AR) and, if AR
could then win, asks for the reference (:meth:`ThroughputGuard.request_reference`).

Host-side, a few float operations per step; the step times come from the engine's one ``perf_counter`` pair per step
(the step ends in its device -> host transfer, so on CUDA that is the real elapsed time).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from adaflash_ray.engine.length_policy import PROBE_MAX_FACTOR

#: a policy rate at least this many times a bucket's prior AR rate needs no measured AR reference (module docstring)
PRIOR_DECISIVE = 1.25


@dataclass
class _Rate:
    """Moving averages of one kind of step at one bucket: committed tokens per row and ms per step, the samples
    taken."""

    tokens: float = 0.0
    ms: float = 0.0
    num_samples: int = 0

    def add(self, tokens: float, ms: float, weight: float) -> None:
        w = max(weight, 1.0 / (self.num_samples + 1))  # a running mean until the moving average's window is full
        self.tokens += w * (tokens - self.tokens)
        self.ms += w * (ms - self.ms)
        self.num_samples += 1

    @property
    def per_ms(self) -> float | None:
        return self.tokens / self.ms if self.num_samples and self.ms > 0 else None


@dataclass
class _Bucket:
    ar: _Rate
    policy: _Rate
    # the AR averages since the last refresh began (step_costs: a price with no stale samples blended in; the same
    # as ``ar`` until a bucket's first refresh)
    ar_fresh: _Rate = field(default_factory=_Rate)
    forced_left: int = 0  # AR steps still forced here
    factor: int = 1  # the next back-off's length in units of backoff_steps
    trial: int = 0  # policy steps since the last back-off (the condition is re-checked after min_samples of them ...)
    trial_rows: int = 0  # ... holding min_rows live rows between them
    since_ar: int = 0  # this bucket's steps since its last AR sample
    ref_rows: int = 0  # live rows of the AR samples since the current reference run began (reference_rows)
    run_tokens: float = 0.0  # the current reference run's own samples (reference_stop): tokens per row, ms, steps
    run_ms: float = 0.0
    run_steps: int = 0
    num_backoffs: int = 0
    num_forced: int = 0  # forced steps taken (back-offs and AR samples)
    prior_ms: float | None = None  # the AR step's ms by the cost table (set_prior), None = none
    requested: bool = False  # a reference asked for (request_reference) that the prior would have spared


class ThroughputGuard:
    """The realised-throughput guard (module docstring).

    Args:
        batch_sizes: the buckets (strictly increasing; the cost table's batch sizes). A step of batch size B falls in
            the smallest bucket >= B (the largest if none), as the cost table's row.
        margin: the policy is "slower" below ``(1 - margin) x`` the AR rate (default 2 %).
        min_samples: steps of each kind before a comparison, and policy steps after a back-off before the next one
            (the policy's also holding ``min_rows`` rows).
        backoff_steps: the first back-off's forced AR steps; doubles while the condition holds, at most
            ``PROBE_MAX_FACTOR x backoff_steps``.
        decay: weight of each new step in the moving averages (0 < decay <= 1); a policy step's is at most
            ``rows / min_rows``.
        ar_refresh_steps: a bucket's AR samples older than this many of its steps are refreshed (0 = never).
        min_rows: live rows the policy steps of a comparison hold between them (module docstring; 0 = ``min_samples``
            steps whatever their rows).
        reference_rows: the same for the reference (AR) side: a reference run goes on until its recorded steps hold
            this many live rows (and ``min_samples`` steps), and each weighs ``min(decay, rows / reference_rows)`` in
            the AR averages - for a reference whose steps vary like the policy's (the source guard's block-only
            steps); 0 = ``min_samples`` steps, each at ``decay`` (plain AR steps commit one token a row).
        reference_stop: with ``reference_rows``, a reference run also ends once it has ``min_samples`` steps and
            its rate has fallen below ``reference_stop x`` the policy's (a sequential test: a reference far slower
            than the policy is not worth its full run; 0 = never early).
    Raises:
        ValueError: empty / unsorted ``batch_sizes``, ``margin`` or ``reference_stop`` outside [0, 1), ``decay``
            outside (0, 1], a count < 1, ``min_rows`` or ``reference_rows`` < 0.
    """

    def __init__(self, batch_sizes: list[int], *, margin: float = 0.02, min_samples: int = 3, backoff_steps: int = 16,
                 decay: float = 0.125, ar_refresh_steps: int = 256, min_rows: int = 32, reference_rows: int = 0,
                 reference_stop: float = 0.0):
        if not 0 <= margin < 1 or not 0 < decay <= 1 or min(min_samples, backoff_steps) < 1 or ar_refresh_steps < 0 \
                or min_rows < 0 or reference_rows < 0 or not 0 <= reference_stop < 1:
            raise ValueError(f"bad guard settings: margin {margin}, decay {decay}, min_samples {min_samples}, "
                             f"backoff_steps {backoff_steps}, ar_refresh_steps {ar_refresh_steps}, min_rows {min_rows}, "
                             f"reference_rows {reference_rows}, reference_stop {reference_stop}")
        self.margin, self.min_samples, self.backoff_steps = margin, min_samples, backoff_steps
        self.reference_rows, self.reference_stop = reference_rows, reference_stop
        self.decay, self.ar_refresh_steps, self.min_rows = decay, ar_refresh_steps, min_rows
        self.set_buckets(batch_sizes)

    def set_buckets(self, batch_sizes: list[int]) -> None:
        """New buckets (a new cost table): every average and back-off starts over."""
        if not batch_sizes or any(a >= b for a, b in zip(batch_sizes, batch_sizes[1:])):
            raise ValueError(f"batch_sizes must be non-empty and strictly increasing, got {batch_sizes}")
        self.batch_sizes = list(batch_sizes)
        self.buckets = [_Bucket(_Rate(), _Rate()) for _ in batch_sizes]
        self._bucket_of: dict[int, _Bucket] = {}  # batch size -> its bucket (_bucket), as steps meet them

    def set_prior(self, ar_ms: list[float] | None) -> None:
        """The AR step's ms per bucket (one per ``batch_sizes`` entry; the cost table's AR costs) that a policy far
        faster than it needs no forced AR reference against (module docstring); None = no prior (every bucket's
        reference is measured), an infinite entry none for its bucket. Kept until the next :meth:`set_buckets`.
        Raises:
            ValueError: not one value per bucket, or a value not > 0 (NaN included)."""
        if ar_ms is not None:
            ar_ms = [float(a) for a in ar_ms]
            if len(ar_ms) != len(self.buckets) or not all(a > 0 for a in ar_ms):
                raise ValueError(f"set_prior needs {len(self.buckets)} AR step costs > 0 ms, one per bucket "
                                 f"{self.batch_sizes}, got {ar_ms}")
        for i, bk in enumerate(self.buckets):
            bk.prior_ms = ar_ms[i] if ar_ms is not None and ar_ms[i] < float("inf") else None

    @staticmethod
    def _decisive(bk: _Bucket) -> bool:
        """Whether ``bk``'s policy runs at least :data:`PRIOR_DECISIVE` x its prior AR rate (one token a row per
        ``prior_ms``): then a measured AR reference makes the guard back off only where realised AR steps run below
        ~0.78 x the table's ms (module docstring), so none is forced."""
        if bk.prior_ms is None:
            return False
        rate = bk.policy.per_ms
        return rate is not None and rate * bk.prior_ms >= PRIOR_DECISIVE

    def _bucket(self, batch_size: int) -> _Bucket:
        """The bucket of ``batch_size``: the first at or above it, else the last."""
        bk = self._bucket_of.get(batch_size)
        if bk is None:
            bk = self._bucket_of[batch_size] = \
                self.buckets[min(bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1)]
        return bk

    def _reference_due(self, bk: _Bucket) -> int:
        """AR steps an AR reference run of ``bk`` needs now (0: none): its AR samples are too few (or hold fewer than
        ``reference_rows`` rows since the run began: one more step at a time), or too old, once its policy has
        ``min_samples`` of its own."""
        if bk.policy.num_samples < self.min_samples:
            return 0
        if self._decisive(bk) and not bk.requested:  # the prior's verdict: no reference run (nor a refresh: once
            return 0  # the policy falls below PRIOR_DECISIVE x, its AR samples' age since_ar asks for one at once)
        if bk.ar.num_samples < self.min_samples or (bk.ref_rows < self.reference_rows
                                                    and not self._reference_decided(bk)):
            return max(self.min_samples - bk.ar.num_samples, 1)
        if self.ar_refresh_steps and bk.since_ar >= self.ar_refresh_steps:
            return self.min_samples
        return 0

    def _reference_decided(self, bk: _Bucket) -> bool:
        """Whether ``bk``'s current reference run, with ``min_samples`` samples of its own, is already below
        ``reference_stop x`` its policy's rate (``reference_stop``: the run ends before ``reference_rows``). The run's
        own samples, not the reference's moving average: a refresh judges the block as it runs now."""
        if not self.reference_stop or bk.run_steps < self.min_samples or bk.run_ms <= 0:
            return False
        policy = bk.policy.per_ms
        return policy is not None and bk.run_tokens / bk.run_ms < self.reference_stop * policy

    @staticmethod
    def _new_run(bk: _Bucket) -> None:
        """A reference run begins: its rows and its own samples count from zero."""
        bk.ref_rows, bk.run_tokens, bk.run_ms, bk.run_steps = 0, 0.0, 0.0, 0

    def would_force(self, batch_size: int) -> bool:
        """Whether :meth:`force_ar` would force the next step at ``batch_size`` now - a look ahead that changes
        nothing (a prefill asks it before proposing a first block that a forced AR step would drop)."""
        bk = self._bucket(batch_size)
        return bk.forced_left > 0 or self._reference_due(bk) > 0

    def would_force_after(self, batch_size: int, num_rows: int | None) -> bool:
        """:meth:`would_force` as it will answer once the step :meth:`force_ar` has just forced at ``batch_size`` is
        recorded (:meth:`record` as an AR step of ``num_rows`` live rows; None: that step will not be recorded): a
        reference run's last step is the one whose own sample completes the run (``min_samples`` AR samples,
        ``reference_rows`` rows), which :meth:`would_force`, asked before that record, does not see. A run that
        ``reference_stop`` ends early after that record is still answered True (the record's tokens are not known
        yet). Changes nothing."""
        bk = self._bucket(batch_size)
        if num_rows is None or bk.forced_left > 0:
            return self.would_force(batch_size)
        if bk.policy.num_samples < self.min_samples or (self._decisive(bk) and not bk.requested):  # the record
            return False  # sets since_ar to 0: no refresh is due after it (nor any reference where the prior decides)
        return bk.ar.num_samples + 1 < self.min_samples or bk.ref_rows + max(num_rows, 1) < self.reference_rows

    def force_ar(self, batch_size: int) -> bool:
        """Whether the next step at ``batch_size`` must be an AR step; counts it as taken when so."""
        bk = self._bucket(batch_size)
        if bk.forced_left == 0:  # the AR reference, in a row
            due = self._reference_due(bk)
            if due and self.reference_rows and bk.ar.num_samples >= self.min_samples \
                    and (bk.ref_rows >= self.reference_rows or self._reference_decided(bk)):
                self._new_run(bk)  # a refresh (the last run ended): its rows are counted again
            bk.forced_left = due
        if bk.forced_left > 0:
            bk.forced_left -= 1
            bk.num_forced += 1
            return True
        return False

    def record(self, batch_size: int, policy_step: bool, tokens: int, ms: float, num_rows: int = 1) -> None:
        """One step's outcome at ``batch_size``: ``policy_step`` (it drafted or proposed) or an AR step, its committed
        tokens (Σ (a + 1) over its ``num_rows`` rows) and wall ms; starts a back-off when the policy is slower than AR
        here."""
        bk = self._bucket(batch_size)
        rows = max(num_rows, 1)
        tokens = tokens / rows
        if not policy_step:
            w = min(self.decay, rows / self.reference_rows) if self.reference_rows else self.decay
            bk.ar.add(tokens, ms, w)
            if self.ar_refresh_steps and bk.since_ar >= self.ar_refresh_steps:  # a refresh's first sample: the
                bk.ar_fresh = _Rate()  # makespan guard's AR price starts over (step_costs)
            bk.ar_fresh.add(tokens, ms, w)
            bk.ref_rows += rows
            bk.run_tokens, bk.run_ms, bk.run_steps = bk.run_tokens + tokens, bk.run_ms + ms, bk.run_steps + 1
            bk.since_ar = 0
            bk.requested = False  # the asked-for run goes on by force_ar's count
            return
        bk.policy.add(tokens, ms, min(self.decay, rows / self.min_rows) if self.min_rows else self.decay)
        bk.trial += 1
        bk.trial_rows += rows
        bk.since_ar += 1
        if bk.trial < self.min_samples or bk.trial_rows < self.min_rows or bk.ar.num_samples < self.min_samples or \
                bk.policy.num_samples < self.min_samples:
            return
        if bk.policy.per_ms < (1.0 - self.margin) * bk.ar.per_ms:
            bk.forced_left = self.backoff_steps * bk.factor
            bk.factor = min(2 * bk.factor, PROBE_MAX_FACTOR)
            bk.trial = bk.trial_rows = 0
            bk.num_backoffs += 1
        else:
            bk.factor = 1

    def step_costs(self, batch_size: int) -> tuple[float, float, float] | None:
        """``(AR ms, policy ms, policy tokens per row)`` of ``batch_size``'s bucket - the moving averages of an AR
        step's and a policy step's wall ms and of a policy step's committed tokens per row - once each kind has
        ``min_samples`` samples there and the AR ones are younger than ``ar_refresh_steps`` of its steps (measured
        steps only: a bucket whose reference the prior spared has none). The AR ms is the average since the last
        refresh began, none until it has ``min_samples`` samples (no stale samples blended in)."""
        bk = self._bucket(batch_size)
        if bk.ar_fresh.num_samples < self.min_samples or bk.policy.num_samples < self.min_samples or \
                (self.ar_refresh_steps and bk.since_ar >= self.ar_refresh_steps):
            return None
        return bk.ar_fresh.ms, bk.policy.ms, bk.policy.tokens

    def prior_costs(self, batch_size: int) -> tuple[float, float, float] | None:
        """:meth:`step_costs` with the prior's AR ms (the cost table's, below the realised ones: optimistic for AR)
        in place of the measured, where the bucket has a prior and ``min_samples`` policy samples; else None."""
        bk = self._bucket(batch_size)
        if bk.prior_ms is None or bk.policy.num_samples < self.min_samples:
            return None
        return bk.prior_ms, bk.policy.ms, bk.policy.tokens

    def request_reference(self, batch_size: int) -> None:
        """Ask for ``batch_size``'s bucket's AR reference (or refresh) that its prior spares: :meth:`force_ar` forces
        it as it would without a prior, where one is due (too few or too old AR samples)."""
        self._bucket(batch_size).requested = True

    def new_batch(self) -> None:
        """A new batch: back-offs end (factor 1); the averages stay (they measure this engine's steps)."""
        for bk in self.buckets:
            bk.forced_left, bk.factor, bk.trial, bk.trial_rows = 0, 1, 0, 0

    def on_drafter_reload(self, reference: bool = False) -> None:
        """New drafter weights: the back-offs end and the policy's averages start over (the AR ones stay, unless
        ``reference``: a reference that measured the drafter too, as the source guard's block-only steps)."""
        self.new_batch()
        for bk in self.buckets:
            bk.policy = _Rate()
            if reference:
                bk.ar, bk.ar_fresh, bk.since_ar = _Rate(), _Rate(), 0
                self._new_run(bk)

    def state(self) -> dict[str, dict]:
        """Per bucket (its batch size, as a string): ``ar_tokens_per_ms``, ``policy_tokens_per_ms`` (committed tokens
        per row per ms; None before a sample), ``num_ar_samples``, ``num_policy_samples``, ``forced_left``, ``factor``,
        ``num_backoffs``, ``num_forced``, ``prior_ar_ms`` (:meth:`set_prior`; None: none), ``prior_decisive`` (the
        policy at least :data:`PRIOR_DECISIVE` x the prior's AR rate now) - JSON-ready."""
        return {str(b): {"ar_tokens_per_ms": bk.ar.per_ms, "policy_tokens_per_ms": bk.policy.per_ms,
                         "num_ar_samples": bk.ar.num_samples, "num_policy_samples": bk.policy.num_samples,
                         "forced_left": bk.forced_left, "factor": bk.factor, "num_backoffs": bk.num_backoffs,
                         "num_forced": bk.num_forced, "prior_ar_ms": bk.prior_ms, "prior_decisive": self._decisive(bk)}
                for b, bk in zip(self.batch_sizes, self.buckets)}
