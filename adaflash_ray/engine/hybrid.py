"""Draft sources beside the DFlash drafter, and the hybrid per-request choice among them
(docs/design/ALGORITHMS.md §2, policy 4).

Sources (engine option ``draft_sources``):

- ``dflash``: the drafter's block, proposed in the step's CUDA graph (:class:`~adaflash_ray.engine.runner.ModelRunner`);
- ``ngram``: prompt lookup in the request's own context (prompt lookup decoding; vLLM's ``ngram`` speculator) -
  :class:`~adaflash_ray.drafting.lookup.PromptLookup`;
- ``suffix``: the same plus a bounded corpus of earlier requests (SuffixDecoding, Oliaro et al., arXiv 2411.04975) -
  :class:`~adaflash_ray.drafting.lookup.SuffixLookup`.

A lookup proposal is deterministic, so the verify step treats it as a point-mass q (accept d_i with probability
p_i(d_i), on rejection resample from p_i without d_i): greedy output stays the target's token for token and sampled
output follows the target's distribution, whatever the source.

:class:`HybridPlanner` (host side, between steps) picks per request per step the source and γ - the DFlash block,
the lookup continuation, or none (γ = 0) - that maximise expected committed tokens per measured millisecond of the
whole batch step:

    value(W, plan) = Σ_r max(1, E_r^src(min(W - 1, cap_r))) / t_plan(B, W)

over verify widths W (the runner's width buckets) and two plans: with the drafter's block available (the step also
proposes the next block: ``t_spec(B, W)``, the ``cost`` policy's measured table) or lookup only (no drafter work:
``t_lookup(B, W)``, measured the same way; ``t_lookup(B, 1) = t_AR(B)``). Each row then takes its best source at
that width. Acceptance estimates:

- DFlash: the ``cost`` policy's acceptance head, E[c(γ)] = 1 + Σ_{i<=γ} Π_{j<=i} p_j (computed in the step's graph);
- lookup on the host: the proposal's empirical continuation probabilities (:meth:`Proposal.prefix_probs`,
  SuffixDecoding's path score: of the occurrences of the matched suffix, the share that continue with the proposal's
  prefix);
- lookup on the device (:mod:`adaflash_ray.engine.device_lookup`, :class:`LookupArrays`: no per-position counts):
  by match length and occurrence count (SuffixDecoding scores a match by its length and its continuation's
  frequency), as :class:`LookupCalibration` learns them from the realised record.

The DFlash and host-lookup estimates are calibrated online by this replica's own record: per source, the ratio of
exponential moving averages of realised to estimated accepted tokens (:class:`SourceCalibration`) scales the
estimate; the device-lookup estimate IS the record (per source and match bucket, the acceptance of each draft
position). When the drafter's block
was not chosen for any request, the next steps skip its propose (no drafter forward) and probe again after
``probe_every`` steps, twice as long after each probe that still does not choose it (at most :data:`~adaflash_ray.engine.length_policy.PROBE_MAX_FACTOR` x
``probe_every``);
a source is "not chosen" only when the moving average of the steps that verified its proposal (among the steps that
had one) falls below :data:`IDLE_BELOW` - one step where the other source won every row does not stop it - and, with
a cost table, the drafter's block also stays while the moving average of its net value per step (tokens per ms of
the best plan with it, proposing the next block, minus the best plan without it and without the propose) is > 0:
at batch 1 a lookup match wins most steps and the block the steps without one, which pay for its proposes. The average
runs over every planned step: a step without a pending block (the block idle, so its propose was skipped) counts by
the recent blocks' estimate standing in for each row's block, and once the average is > 0 the step proposes again,
without waiting for a probe (a propose decides for the next step, whose lookup match is not known yet: the average over
matched and unmatched steps, not one probe step, is what it earns). Host lookups
are also skipped the same way when they do not pay for their host time, so that time is not spent every step; device
lookups (:mod:`adaflash_ray.engine.device_lookup`) run in every step.

The plans are valued by the measured tables; the engine's realised-throughput guard
(:class:`~adaflash_ray.engine.throughput_guard.ThroughputGuard`, with ``ar_steps`` and the ``cost`` policy, i.e. the
hybrid) checks them against what the steps really cost: per batch bucket, moving averages of realised committed tokens
per row per ms of AR / γ = 0 steps and of the planner's other steps (drafts of any source, DFlash probes, catch-ups);
where the planner's rate falls 2 % below AR's, the engine skips :meth:`HybridPlanner.plan` and takes AR steps (no
propose, no lookup, no catch-up) for a back-off that doubles while that holds (at most ``PROBE_MAX_FACTOR`` x), then
plans again - the planner's schedules and calibration are untouched by the forced steps. An optional second guard of
the same kind (the engine's ``block_guard=True``; off by default: the steps that do not propose are mostly the
lookup-matched ones, a selection that reads as "proposing is slower") compares the planner's steps that propose the
drafter's next block with its steps that do not; where proposing is the slower, :meth:`HybridPlanner.plan` gets
``block_off`` for a doubling back-off: no propose (a pending block is still verified), whatever the tables and the
net value say.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from adaflash_ray.drafting.lookup import Proposal
from adaflash_ray.engine.length_policy import PROBE_MAX_FACTOR

#: every draft source the engine knows; "none" labels γ = 0 steps in the statistics
DRAFT_SOURCES = ("dflash", "ngram", "suffix")
LOOKUP_SOURCES = ("ngram", "suffix")
#: weight of each step in the moving average of "the source's proposal was verified this step" (per source: the
#: lookups over the steps that looked up, the drafter's block over the steps that had one), and the level below which
#: the source goes on the probe schedule
USE_EMA, IDLE_BELOW = 0.2, 0.3
#: weight of each planned step in the moving average of the block's net value (tokens per ms; a longer memory than
#: USE_EMA: the sign of a mean over wins and losses, not the latest steps', decides), and of each step with a pending
#: block in the moving average of the blocks' estimate that stands in for the block on steps without one
NET_EMA = 0.05
#: the moving averages after a reset: the lookups survive several steps without a match (a context often has none for a
#: step or two); the drafter's block, whose every propose costs a drafter forward, three steps without being chosen
USE_START = {"dflash": 0.5, "lookup": 1.0}
#: the most requests :meth:`HybridPlanner._plan_many` plans in host floats (above it the arrays cost less per row)
HOST_PLAN_MAX_ROWS = 12


def check_draft_sources(sources, has_drafter: bool) -> tuple[str, ...]:
    """Validated, de-duplicated ``draft_sources``. Raises ValueError for an unknown name, for ``dflash`` without a
    drafter, or for both lookups at once (``suffix`` already includes the request's own context)."""
    out = tuple(dict.fromkeys(sources))
    bad = [s for s in out if s not in DRAFT_SOURCES]
    if bad or not out:
        raise ValueError(f"draft_sources {list(sources)}: expected a non-empty subset of {list(DRAFT_SOURCES)}")
    if "dflash" in out and not has_drafter:
        raise ValueError("draft source 'dflash' needs a drafter")
    if "ngram" in out and "suffix" in out:
        raise ValueError("draft_sources: 'suffix' already looks up the request's own context; give one of 'ngram', "
                         "'suffix'")
    return out


#: a record of at most SMALL_RECORD rows (:meth:`SourceCalibration.record_many`, :meth:`LookupCalibration.record`)
#: goes row by row in host numbers instead of one array pass; below RESCALE_BELOW the lookup calibration's stored
#: counts take its decay scale in (the scale is 1 again)
SMALL_RECORD, RESCALE_BELOW = 4, 1e-100
#: HybridPlanner.observe_step: steps of one kind at one width and table row before that width is priced by its own
#: realised average rather than the kind's
WIDTH_RESID_MIN = 8


class SourceCalibration:
    """Online calibration of acceptance estimates per draft source: ``factor(src)`` = EMA(realised accepted) /
    EMA(estimated accepted) over that source's recent request-steps, starting at the source's prior.

    Args:
        prior: the factor before any record of a source not in ``source_priors`` (a host lookup's raw estimate counts
            every earlier occurrence as a vote, so it starts below 1).
        decay: weight of each new request-step in the moving averages (0 < decay <= 1).
        source_priors: per-source priors; None = ``{"dflash": 1.0}`` (the acceptance head is trained to predict the
            drafter's acceptance: it starts trusted, not discounted like a lookup's vote count).
        running_start: the averages are running means (the prior one pseudo-record) until ``1 / decay`` records, so
            the first records move the factor as much as they should; False = the moving average from the start.
    Raises:
        ValueError: a prior <= 0 or ``decay`` outside (0, 1].
    """

    def __init__(self, prior: float = 0.6, decay: float = 0.02, source_priors: dict[str, float] | None = None,
                 running_start: bool = True):
        priors = {"dflash": 1.0} if source_priors is None else dict(source_priors)
        if prior <= 0 or not 0 < decay <= 1 or any(v <= 0 for v in priors.values()):
            raise ValueError(f"need priors > 0 and 0 < decay <= 1, got {prior}, {priors}, {decay}")
        self.prior, self.decay, self.source_priors = prior, decay, priors
        self.running_start = running_start
        self._real: dict[str, float] = {}
        self._est: dict[str, float] = {}
        self._count: dict[str, int] = {}  # records so far, the prior's pseudo-record included

    def prior_of(self, source: str) -> float:
        """The factor of ``source`` before any record: ``source_priors[source]``, else ``prior``."""
        return self.source_priors.get(source, self.prior)

    def factor(self, source: str) -> float:
        est = self._est.get(source)
        if est is None:
            return self.prior_of(source)
        return min(max(self._real[source] / max(est, 1e-6), 0.0), 2.0)

    def record(self, source: str, estimated: float, realised: int) -> None:
        """One verified draft of ``source``: ``estimated`` accepted tokens (uncalibrated, >= 0), ``realised`` a."""
        if source not in self._est:  # the prior as one pseudo-observation of one estimated token
            self._est[source], self._real[source], self._count[source] = 1.0, self.prior_of(source), 1
        self._count[source] += 1
        k = max(self.decay, 1.0 / self._count[source]) if self.running_start else self.decay
        self._est[source] = (1 - k) * self._est[source] + k * estimated
        self._real[source] = (1 - k) * self._real[source] + k * realised

    def record_many(self, source: str, estimated, realised) -> None:
        """:meth:`record` of each pair of ``estimated`` / ``realised`` (``[m]`` each) in order, the same averages up to
        float rounding: the running-start records one by one, the rest as one weighted sum
        (``(1 - k)^m`` on the old average, ``k (1 - k)^(m - 1 - i)`` on record i)."""
        if len(estimated) <= SMALL_RECORD:  # a few pairs (one at batch 1): record() in host floats
            for e, r in zip(estimated, realised):
                self.record(source, float(e), float(r))
            return
        est, real = np.asarray(estimated, dtype=np.float64), np.asarray(realised, dtype=np.float64)
        i, m = 0, len(est)
        if self.running_start:
            while i < m and (source not in self._count or self._count[source] + 1 < 1.0 / self.decay):
                self.record(source, float(est[i]), float(real[i]))
                i += 1
        if i == m:
            return
        if source not in self._est:
            self._est[source], self._real[source], self._count[source] = 1.0, self.prior_of(source), 1
        k, rest = self.decay, m - i
        w = k * (1 - k) ** np.arange(rest - 1, -1, -1)  # record i's weight after the last
        keep = (1 - k) ** rest
        self._est[source] = keep * self._est[source] + float(w @ est[i:])
        self._real[source] = keep * self._real[source] + float(w @ real[i:])
        self._count[source] += rest


#: occurrence-count buckets of :class:`LookupCalibration`: 1, 2-3, >= 4 occurrences of the matched n-gram
OCCURRENCE_EDGES = (2, 4)


class LookupArrays(NamedTuple):
    """The device lookup's proposals for the requests of one step (all ``[n]`` numpy; int64 but ``valid`` bool):
    proposal length (tokens), match length, occurrences of the matched n-gram, source code (0 = the request's own
    context, 1 = the corpus), and whether the proposal is current (made by the request's previous step)."""

    length: np.ndarray
    match_len: np.ndarray
    num_occurrences: np.ndarray
    source: np.ndarray
    valid: np.ndarray


class LookupCalibration:
    """Acceptance of device-lookup proposals, learnt from the realised record per bucket (source code, match length,
    occurrence bucket :data:`OCCURRENCE_EDGES`): for each draft position i, ``p_i`` = P(draft i accepted | drafts < i
    accepted), from exponentially decayed counts of the verified proposals that reached position i and of those
    that accepted it, plus ``prior_weight`` pseudo-trials at ``prior``. E[accepted | γ] = Σ_{i<=γ} Π_{j<=i} p_j
    (the ``cost`` policy's formula, docs/design/ALGORITHMS.md §2), flat past the proposal's length. Match length and
    continuation frequency as the score follow SuffixDecoding (Oliaro et al., arXiv 2411.04975).

    Args:
        max_ngram: the longest match length (tokens; longer ones share its bucket). max_draft: draft positions.
        prior: the conditional acceptance before any record (0 < prior < 1). prior_weight: its pseudo-trials (> 0).
        decay: per recorded step, the weight every earlier count loses (0 <= decay < 1).
    Raises:
        ValueError: an argument outside its range.
    """

    def __init__(self, max_ngram: int, max_draft: int, prior: float = 0.7, prior_weight: float = 2.0,
                 decay: float = 0.01):
        if max_ngram < 1 or max_draft < 1 or not 0 < prior < 1 or prior_weight <= 0 or not 0 <= decay < 1:
            raise ValueError(f"bad LookupCalibration arguments: max_ngram={max_ngram} max_draft={max_draft} "
                             f"prior={prior} prior_weight={prior_weight} decay={decay}")
        self.max_ngram, self.max_draft = max_ngram, max_draft
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        num_buckets = 2 * max_ngram * (len(OCCURRENCE_EDGES) + 1)
        # tried and accepted (one array: record in one pass), stored divided by _scale: the decay of every count at
        # each record is one multiply of _scale, and a record adds 1 / _scale where the counts add 1
        self._counts = np.zeros((2, num_buckets, max_draft))
        self._scale = 1.0
        self._cum: np.ndarray | None = None  # expected()'s table of the current counts (None: record() changed them)
        self._cum_rows: dict[int, list[float]] | None = None  # rows of the same as host lists (expected_row)
        self._edges = np.asarray(OCCURRENCE_EDGES)
        self._gammas = np.arange(max_draft + 1)[None]  # [1, D + 1]
        # bucket ids by (source, match length clipped to 0..max_ngram, occurrences clipped past the last edge): one
        # table read per row instead of a search and the arithmetic
        occ_cap = OCCURRENCE_EDGES[-1] if OCCURRENCE_EDGES else 0
        src, n, occ = np.meshgrid(np.arange(2), np.arange(max_ngram + 1), np.arange(occ_cap + 1), indexing="ij")
        self._bucket_table = self._bucket_arith(src, n, occ)  # [2, max_ngram + 1, occ_cap + 1] int64
        self._occ_cap = occ_cap

    def _bucket_arith(self, source, match_len, num_occurrences) -> np.ndarray:
        """:meth:`bucket` by its arithmetic (the table :meth:`bucket` reads is built from it)."""
        occ = np.searchsorted(self._edges, np.asarray(num_occurrences), side="right")
        n = np.minimum(np.maximum(np.asarray(match_len), 1), self.max_ngram) - 1
        return (np.asarray(source) * self.max_ngram + n) * (len(OCCURRENCE_EDGES) + 1) + occ

    def bucket(self, source: np.ndarray, match_len: np.ndarray, num_occurrences: np.ndarray) -> np.ndarray:
        """``[n]`` int64 bucket ids (source code 0 / 1, the match length clipped to 1..max_ngram, the occurrences
        bucketed by :data:`OCCURRENCE_EDGES`)."""
        n = np.minimum(match_len, self.max_ngram)
        occ = np.minimum(num_occurrences, self._occ_cap)
        return self._bucket_table[source, np.maximum(n, 0), np.maximum(occ, 0)]

    def bucket_one(self, source: int, match_len: int, num_occurrences: int) -> int:
        """:meth:`bucket` of one proposal, in host ints."""
        occ = bisect.bisect_right(OCCURRENCE_EDGES, num_occurrences)
        n = min(max(match_len, 1), self.max_ngram) - 1
        return (source * self.max_ngram + n) * (len(OCCURRENCE_EDGES) + 1) + occ

    def expected_row(self, bucket: int) -> list[float]:
        """``[max_draft + 1]`` floats: E[accepted | γ] of a proposal of ``bucket`` as long as max_draft (index γ;
        cut it at a shorter proposal's length by ``row[min(γ, length)]``)."""
        rows = self._cum_rows
        if rows is None:
            rows = self._cum_rows = {}
        row = rows.get(bucket)
        if row is None:  # this bucket's row of expected()'s table alone (record() changes the counts every step), in
            # host floats: _accept_probs, its running product and sum over max_draft positions without numpy calls
            s, w = self._scale, self.prior_weight
            wp, prod, cum = w * self.prior, 1.0, 0.0
            row = [0.0]
            for t, a in zip(self._counts[0, bucket].tolist(), self._counts[1, bucket].tolist()):
                prod *= (a * s + wp) / (t * s + w)
                cum += prod
                row.append(cum)
            rows[bucket] = row
        return row

    @property
    def tried(self) -> np.ndarray:
        """``[num_buckets, max_draft]`` float64 (a copy): per bucket the decayed count of verified proposals that
        reached draft position i."""
        return self._counts[0] * self._scale

    @property
    def accepted(self) -> np.ndarray:
        """``[num_buckets, max_draft]`` float64 (a copy): ... and that accepted it."""
        return self._counts[1] * self._scale

    def _accept_probs(self, buckets) -> np.ndarray:
        """P(draft i accepted | drafts < i accepted) of ``buckets`` (an index of the tables' rows): the decayed counts
        smoothed by the prior's pseudo-trials."""
        s, w = self._scale, self.prior_weight
        return (self._counts[1, buckets] * s + w * self.prior) / (self._counts[0, buckets] * s + w)

    def expected(self, buckets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``[n, max_draft + 1]`` float: column γ = E[accepted | γ] of each row's proposal (0 at γ = 0; flat past
        its ``lengths`` ``[n]``; all 0 for a length-0 row)."""
        g = np.minimum(self._gammas, np.asarray(lengths)[:, None])  # [n, D + 1]
        return self._table()[np.asarray(buckets)[:, None], g]

    def expected_at(self, buckets: np.ndarray, gammas: np.ndarray) -> np.ndarray:
        """E[accepted | γ] of each row's proposal at the γ values ``gammas`` ``[n, k]`` int (each already cut at its
        proposal's length): ``[n, k]`` float, :meth:`expected`'s entries at those columns."""
        return self._table()[np.asarray(buckets)[:, None], gammas]

    def _table(self) -> np.ndarray:
        """``[num_buckets, max_draft + 1]`` float: E[accepted | γ] per bucket of the current counts (computed again
        only after :meth:`record` changed them)."""
        cum = self._cum
        if cum is None:
            p = self._accept_probs(slice(None))  # [nb, D]
            cum = self._cum = np.concatenate([np.zeros((len(p), 1)), np.cumsum(np.cumprod(p, 1), 1)], 1)  # [nb, D+1]
        return cum

    def record(self, buckets, draft_lens, num_accepted) -> None:
        """One step's verified device-lookup drafts (``[m]`` int arrays or sequences of ints each): bucket, γ,
        accepted a. Positions 1..min(a + 1, γ) were tried, 1..a accepted (both cut at ``max_draft``); every earlier
        count decays by ``decay`` first (kept as a scale on the stored counts: one multiply, not an array pass)."""
        self._cum = self._cum_rows = None
        counts = self._counts
        scale = self._scale * (1 - self.decay)  # every count decays: the stored ones stay, the scale shrinks
        if scale < RESCALE_BELOW:  # fold the scale into the counts before 1 / scale grows past float range
            counts *= scale
            scale = 1.0
        self._scale = scale
        inc = 1.0 / scale
        _, nb, d = counts.shape
        if len(buckets) <= SMALL_RECORD:  # a few rows (one at batch 1): slices of each row's bucket, no histogram
            for b, g, a in zip(*(x.tolist() if isinstance(x, np.ndarray) else x
                                 for x in (buckets, draft_lens, num_accepted))):
                a = min(a, d)
                counts[0, b, :min(a + 1, g, d)] += inc
                counts[1, b, :a] += inc
            return
        b = np.asarray(buckets, dtype=np.int64) * (d + 1)
        a = np.minimum(np.asarray(num_accepted, dtype=np.int64), d)
        reach = np.minimum(np.minimum(a + 1, np.asarray(draft_lens, dtype=np.int64)), d)
        # per bucket, the rows reaching position i (accepting it) = the rows whose reach (a) is >= i: one histogram of
        # reach and a per bucket, summed from the right (one bincount instead of a scatter of [m, D] ones per table)
        hist = np.bincount(np.concatenate([b + reach, b + a + nb * (d + 1)]), minlength=2 * nb * (d + 1))
        tail = np.cumsum(hist.reshape(2, nb, d + 1)[:, :, ::-1], axis=2)[:, :, -2::-1]
        counts += tail * inc if inc != 1.0 else tail


@dataclass
class RowChoice:
    """One request's draft for the next step: ``source`` in :data:`DRAFT_SOURCES` or "none", γ (0 for "none"),
    ``tokens`` (the host lookup's drafts; None for the drafter's block and for the device lookup's, which stay on the
    device), the uncalibrated estimated accepted tokens (for :meth:`SourceCalibration.record`) and, for a device
    lookup's proposal, its :class:`LookupCalibration` bucket (else -1)."""

    source: str
    draft_len: int
    tokens: list[int] | None = None
    estimated: float = 0.0
    bucket: int = -1

    @property
    def device_lookup(self) -> bool:
        """The row verifies the device lookup's proposal."""
        return self.bucket >= 0 and self.draft_len > 0


class HybridPlanner:
    """The per-request choice of draft source and γ (module docstring). Host-side, numpy; state: the calibration
    and the probe schedules.

    Args:
        sources: the engine's draft sources (:func:`check_draft_sources`).
        max_draft: the longest γ (the runner's ``max_draft``). block_size: the drafter's (its block gives at most
            block_size - 1 drafts).
        widths: verify widths considered (the runner's width buckets; each <= max_draft + 1).
        probe_every: AR / lookup-only steps before the drafter's block (or the lookups) are tried again.
        calibration: a :class:`SourceCalibration` (a fresh one when None).
        max_ngram: the lookups' longest n-gram (the device lookup's :class:`LookupCalibration` buckets).
        lookup_on_device: the engine's lookups run on the device (:meth:`lookup_due` is then always True).
    """

    def __init__(self, sources: tuple[str, ...], max_draft: int, block_size: int, widths: list[int],
                 probe_every: int = 8, calibration: SourceCalibration | None = None, max_ngram: int = 3,
                 lookup_on_device: bool = False):
        self.sources, self.max_draft, self.block_size = sources, max_draft, block_size
        self.lookup_on_device = lookup_on_device
        self.widths = sorted(w for w in set(widths) if 1 <= w <= max_draft + 1) or [1]
        self._widths = np.asarray(self.widths)
        self._widx = self._widths - 1  # the cost tables' columns of the widths (and each width's longest γ)
        self._widx_list = self._widx.tolist()
        self.probe_every = probe_every
        self.calibration = calibration or SourceCalibration()
        self.lookup_calibration = LookupCalibration(max_ngram, max_draft)
        self.lookup = next((s for s in sources if s in LOOKUP_SOURCES), None)
        self.use_dflash = "dflash" in sources
        # cost tables (ms): set_costs; None = choose by expected tokens alone
        self.batch_sizes: list[int] = []
        self._row_of: dict[int, int] = {}  # batch size -> the tables' row (_row), as steps meet them
        self.spec_costs: np.ndarray | None = None  # [nb, max_draft + 1] by width (index W - 1), propose included
        self.lookup_costs: np.ndarray | None = None  # [nb, max_draft + 1] by width, no propose (W = 1: AR step)
        self._since = {"dflash": 0, "lookup": 0}
        self._interval = {"dflash": probe_every, "lookup": probe_every}
        self._idle = {"dflash": False, "lookup": False}
        self._use = dict(USE_START)  # moving averages of the steps whose proposals were verified
        # moving average (NET_EMA) over the planned steps of the drafter's block's net value in tokens per ms: the
        # best plan with the block (proposing the next one) minus the best without it and without proposing (< 0:
        # the propose's price in a step where the lookups or none won; > 0: the gain where the block won); a step
        # without a pending block values the block by _block_est
        self._block_net = 0.0
        # the drafter's recent blocks' uncalibrated E[accepted | γ] (index γ = 0..max_draft, host floats): per step
        # with a pending block, a moving average (NET_EMA) of the mean over its rows; on a step without one it stands in
        # for every row's block in that step's net value, so the net value is averaged over every step, not only over
        # the steps that proposed (None: no block seen since construction or reset)
        self._block_est: list[float] | None = None
        # under the engine's propose_first: the same average over the blocks proposed and verified in one step (the
        # only blocks that mode has; block_estimate() reads it), None before the first
        self._fresh_est: list[float] | None = None
        # (_block_est, the dflash factor, max(factor * _block_est, 0) as [max_draft + 1] float64): _stand_in_net
        self._block_est_array: tuple | None = None
        self.last_value: float | None = None  # expected tokens per ms of the last plan (None without costs)
        # one request, device lookups, costs set: plan in host floats (:meth:`_plan_one`; numpy's per-call overhead
        # on arrays of one row costs more than the arithmetic); False: always the arrays
        self.scalar_one_row = True
        # device lookups and no pending drafter block: the lookup-only plan (:meth:`_plan_lookup`); False: the arrays
        self.lookup_only_fast = True
        # 2..HOST_PLAN_MAX_ROWS requests, device lookups, a pending block, costs set, two widths or more: plan in host
        # floats (:meth:`_plan_many`); False: the arrays
        self.scalar_many_rows = True
        # the last lookup-only plan's (choices, lookup rows [n] bool, buckets [n], γ [n]): its record without the rows
        self._lookup_plan: tuple | None = None
        # the last plan with no draft in any row (its choices): its record is empty
        self._nothing_plan: list[RowChoice] | None = None
        # the last lookup-only, draft-less or one-row plan's (choices, γ [n] host ints, device-lookup rows [n] bool or
        # None): plan_rows() of those choices without a pass over them
        self._plan_rows: tuple | None = None
        # the measured tables price a step by its device work and the runner's host work; the engine's own host work
        # per step (planning, recording, commits: the same for every width, so it makes long widths relatively cheaper)
        # is not in them. observe_step keeps per table row a moving average of realised - table ms over the planned
        # steps and the plans read table + that (at least half the table): tokens per measured ms of the whole step.
        # False: the tables as measured
        self._realised_costs = True
        self.step_cost_decay = 0.05  # weight of one step in that moving average (a running mean before 1 / decay)
        self.step_cost_every = 8  # a row's prices are brought up to date every this many of its observed steps
        self._base: tuple[np.ndarray, np.ndarray] | None = None  # the tables as set (set_costs)
        # per kind of step (proposing the block: priced by the spec table; not: by the lookup table) and table row:
        # the moving average of realised - table ms and the steps observed
        self._resid: dict[bool, list[float]] = {True: [], False: []}
        self._resid_n: dict[bool, list[int]] = {True: [], False: []}
        # ... and per verify width (the tables' column W - 1) of each: a width with at least WIDTH_RESID_MIN steps of
        # its own is priced by its own average (the tables' slope over the widths can be off too), the others by the
        # kind's
        self._resid_w: dict[bool, list[list[float]]] = {True: [], False: []}
        self._resid_wn: dict[bool, list[list[int]]] = {True: [], False: []}
        # the current plan's per-row weights (plan's ``weights`` as [n] float64; None: all 1) and their sum
        self._w: np.ndarray | None = None
        self._wsum = 0.0
        self._lf: list[float] | None = None  # the current plan's lookup_factors
        self._bf: list[float] | None = None  # ... and block_factors

    # ------------------------------------------------------------------ costs
    @property
    def realised_costs(self) -> bool:
        """Whether the plans price steps by the tables plus the realised moving average (:meth:`observe_step`);
        setting it False puts the tables' measured prices back at once (the averages are kept: True again applies
        them at the next update of each row)."""
        return self._realised_costs

    @realised_costs.setter
    def realised_costs(self, on: bool) -> None:
        self._realised_costs = bool(on)
        if not on and self._base is not None:
            spec, look = self._base
            self.spec_costs, self.lookup_costs = spec.copy(), look.copy()
            self._spec_w, self._look_w = spec[:, self._widx].tolist(), look[:, self._widx].tolist()
            self._look_ar = look[:, 0].tolist()

    def set_costs(self, batch_sizes: list[int], spec_costs_ms, lookup_costs_ms) -> None:
        """``spec_costs_ms`` ``[len(batch_sizes), bs-1]``: a step that verifies γ = 1..bs-1 drafts and proposes (the
        ``cost`` policy's table); ``lookup_costs_ms`` ``[len(batch_sizes), max_draft + 1]``: a step of width
        W = 1..max_draft+1 without propose (W = 1: the AR step). Spec costs beyond the block take the lookup cost
        plus the propose's measured share. Raises ValueError on shapes or a non-positive cost."""
        spec = np.asarray(spec_costs_ms, dtype=np.float64)
        look = np.asarray(lookup_costs_ms, dtype=np.float64)
        nb = len(batch_sizes)
        if spec.shape != (nb, self.block_size - 1) or look.shape != (nb, self.max_draft + 1):
            raise ValueError(f"costs must be [{nb}, {self.block_size - 1}] and [{nb}, {self.max_draft + 1}], got "
                             f"{spec.shape} and {look.shape}")
        if (spec <= 0).any() or (look <= 0).any():
            raise ValueError("every cost must be > 0 ms")
        full = np.empty((nb, self.max_draft + 1))
        full[:, 0] = spec[:, 0]  # a width-1 step that proposes: no cheaper than width 2
        full[:, 1:self.block_size] = spec
        if self.max_draft + 1 > self.block_size:  # widths past the block: lookup cost + the propose's share
            extra = (spec[:, -1] - look[:, self.block_size - 1])[:, None]
            full[:, self.block_size:] = look[:, self.block_size:] + np.maximum(extra, 0.0)
        self.batch_sizes, self._base = list(batch_sizes), (full, look)
        self._base_rows = (full.tolist(), look.tolist())  # the same as host lists (observe_step reads them)
        self._row_of = {}
        self.spec_costs, self.lookup_costs = full.copy(), look.copy()  # the prices the plans read (observe_step)
        # the same at the planner's widths, as host lists (the one-row plan reads them without numpy)
        self._spec_w, self._look_w = full[:, self._widx].tolist(), look[:, self._widx].tolist()
        self._look_ar = look[:, 0].tolist()
        self._resid = {True: [0.0] * nb, False: [0.0] * nb}
        self._resid_n = {True: [0] * nb, False: [0] * nb}
        cols = self.max_draft + 1
        self._resid_w = {k: [[0.0] * cols for _ in range(nb)] for k in (True, False)}
        self._resid_wn = {k: [[0] * cols for _ in range(nb)] for k in (True, False)}

    def _row(self, batch_size: int) -> int:
        """The cost tables' row of ``batch_size``: the first bucket >= it, else the last."""
        r = self._row_of.get(batch_size)
        if r is None:
            r = self._row_of[batch_size] = min(bisect.bisect_left(self.batch_sizes, batch_size),
                                               len(self.batch_sizes) - 1)
        return r

    def observe_step(self, batch_size: int, width: int, proposed: bool, ms: float) -> None:
        """A planned step's realised wall ``ms`` (the engine's whole step: planning, the device work and its transfer,
        recording and commits) at ``batch_size`` rows and verify ``width`` (the shape the device ran; ``proposed``: it
        proposed the drafter's next block, priced by the spec table, else by the lookup table). With
        :attr:`realised_costs`, the moving average of realised - table ms of the row's steps of that kind moves
        towards it (and that of the row's steps of that kind at that width), and every :attr:`step_cost_every` steps of
        the row (or at the first of a kind) both tables' prices become table + the average of their kind - of the
        width where it has :data:`WIDTH_RESID_MIN` steps of its own (at least half the table; a kind not observed yet
        borrows the other's: the engine's host work common to both) - so a propose that costs less or more in the
        engine than the tables measured it apart, or a width whose table price is off, is priced as it runs. No-op
        without a cost table."""
        if self._base is None or not self._realised_costs:
            return
        r = self._row(batch_size)
        spec, look = self._base_rows  # host lists: a step's update without numpy scalars or row ufuncs
        kind = bool(proposed)
        col = min(max(int(width), 1), self.max_draft + 1) - 1
        resid, counts = self._resid[kind], self._resid_n[kind]
        n = counts[r] = counts[r] + 1
        w = max(self.step_cost_decay, 1.0 / n)
        over = ms - (spec if kind else look)[r][col]
        resid[r] += w * (over - resid[r])
        rw, rwn = self._resid_w[kind][r], self._resid_wn[kind][r]
        m = rwn[col] = rwn[col] + 1
        rw[col] += max(self.step_cost_decay, 1.0 / m) * (over - rw[col])
        total = n + self._resid_n[not kind][r]
        if total % self.step_cost_every == 0 or n == 1:
            d_spec, d_look = self._kind_resid(r)
            widx = self._widx_list
            spec_r = self._priced(spec[r], d_spec, True, r)  # table + average, at least half the table
            look_r = self._priced(look[r], d_look, False, r)
            self.spec_costs[r], self.lookup_costs[r] = spec_r, look_r
            self._spec_w[r] = [spec_r[i] for i in widx]
            self._look_w[r] = [look_r[i] for i in widx]
            self._look_ar[r] = look_r[0]

    def _priced(self, base: list[float], d: float, kind: bool, r: int) -> list[float]:
        """Row ``r`` of a table (``base``: as measured, by column) priced as observed: each column + its own realised
        average where ``kind``'s steps at that width number at least :data:`WIDTH_RESID_MIN`, else + ``d`` (the
        kind's), at least half the table."""
        rw, rwn = self._resid_w[kind][r], self._resid_wn[kind][r]
        return [max(b + (rw[i] if rwn[i] >= WIDTH_RESID_MIN else d), 0.5 * b) for i, b in enumerate(base)]

    def _kind_resid(self, r: int) -> tuple[float, float]:
        """Row ``r``'s realised - table ms of proposing and of other steps (a kind not observed: the other's; 0
        without either)."""
        spec_n, look_n = self._resid_n[True][r], self._resid_n[False][r]
        d_spec, d_look = self._resid[True][r], self._resid[False][r]
        return (d_spec if spec_n else d_look if look_n else 0.0), (d_look if look_n else d_spec if spec_n else 0.0)

    def realised_cost_state(self) -> dict[str, dict[str, float]] | None:
        """Per table row (its batch size, as a string): ``ms_over_table`` / ``steps`` (the moving average of realised -
        table ms over the steps that did not propose, and how many) and ``propose_ms_over_table`` / ``propose_steps``
        (the same over the steps that proposed the block); None without a cost table. JSON-ready."""
        if self._base is None:
            return None
        return {str(b): {"ms_over_table": self._resid[False][i], "steps": self._resid_n[False][i],
                         "propose_ms_over_table": self._resid[True][i], "propose_steps": self._resid_n[True][i]}
                for i, b in enumerate(self.batch_sizes)}

    # ------------------------------------------------------------------ schedules
    def lookup_due(self) -> bool:
        """Whether this step computes lookup proposals at all: never without a lookup source; always when they run on
        the device (``lookup_on_device``: a few element-wise kernels inside the step's graph, no host time to save,
        and a skipped lookup leaves the next step without a proposal); on the host, always while they pay, else every
        ``probe_interval`` steps."""
        if self.lookup is None:
            return False
        if self.lookup_on_device:
            return True
        return not self._idle["lookup"] or self._since["lookup"] >= self._interval["lookup"]

    def _advance(self, key: str, used: bool, tried: bool, probed: bool = False) -> None:
        """One step of a source's probe schedule: ``used`` (chosen for some request), ``tried`` (evaluated and not
        chosen), ``probed`` (this step fetches the source's next proposal although it is idle: the drafter's
        propose)."""
        if used:
            self._idle[key], self._since[key], self._interval[key] = False, 0, self.probe_every
        elif tried:  # evaluated and not chosen: wait, twice as long after each probe that still is not
            if self._idle[key]:
                self._interval[key] = min(2 * self._interval[key], PROBE_MAX_FACTOR * self.probe_every)
            self._idle[key], self._since[key] = True, 0
        elif probed:
            self._since[key] = 0
        else:
            self._since[key] += 1

    def wants_block(self) -> bool:
        """Whether the schedule alone has a step propose the drafter's block now (in use, or its probe due): a
        prefill asks this before proposing a new request's first block."""
        return self.use_dflash and (not self._idle["dflash"] or self._since["dflash"] >= self._interval["dflash"])

    def reset(self) -> None:
        """New drafter weights: both sources are tried on the next step. A new batch keeps the schedules (what
        each source earned still holds; an idle one is still probed)."""
        for key in self._since:
            self._idle[key], self._since[key], self._interval[key] = False, 0, self.probe_every
        self._use = dict(USE_START)
        self._block_net = 0.0
        self._block_est = None
        self._fresh_est = None

    def note_fresh_blocks(self, expected: list[list[float]]) -> None:
        """Blocks proposed and verified in one step (the engine's ``propose_first``): ``expected`` per row the block's
        uncalibrated E[committed | γ], γ = 1..bs-1. Their mean E[accepted | γ] (index γ = 0..max_draft, flat past the
        block) joins the moving average (:data:`NET_EMA`) that :meth:`block_estimate` reads."""
        nd = self.max_draft
        rows = np.asarray(expected, dtype=np.float64)  # [n, bs-1]
        mean = np.concatenate([[0.0], rows.mean(0) - 1.0])
        if len(mean) < nd + 1:
            mean = np.concatenate([mean, np.full(nd + 1 - len(mean), mean[-1])])
        raw = mean[:nd + 1].tolist()
        est = self._fresh_est
        self._fresh_est = raw if est is None else [(1 - NET_EMA) * a + NET_EMA * b for a, b in zip(est, raw)]

    def block_estimate(self) -> list[float] | None:
        """The recent fresh blocks' uncalibrated E[committed | γ] for γ = 1..bs-1 (:meth:`note_fresh_blocks`), as a
        pending block's estimate reads (:meth:`plan`'s ``dflash_expected``); None before the first."""
        est = self._fresh_est
        return None if est is None else [1.0 + est[g] for g in range(1, self.block_size)]

    # ------------------------------------------------------------------ the choice
    def plan(self, batch_size: int, caps: list[int], dflash_expected: list[list[float] | None],
             proposals: list[Proposal | None], fixed: list[int | None] | None = None, lookup_ms: float = 0.0,
             device: LookupArrays | None = None, block_off: bool = False,
             weights: list[float] | None = None, lookup_factors: list[float] | None = None,
             block_factors: list[float] | None = None) -> tuple[list[RowChoice], bool]:
        """Per request the source and γ of this step, and whether the step proposes the next DFlash block.

        Args:
            batch_size: the step's rows (the cost table's batch size: ``max(slot) + 1``).
            caps: per request the largest γ allowed (tokens left - 1, >= 0).
            dflash_expected: per request E[committed | γ] for γ = 1..bs-1 of its pending drafter block (uncalibrated;
                None: no pending block).
            proposals: per request the lookup's proposal (None: not looked up this step).
            fixed: per request a γ the request fixes (``SamplingParams.draft_len``: the drafter's block at that γ) or
                None.
            lookup_ms: host milliseconds this step's lookups took. With a cost table, lookups whose expected gain
                does not cover that time (tokens per ms with it added to the step, against the best plan without
                lookups) count as not chosen for the lookup probe schedule, so later steps skip them. Ignored with
                ``device`` (its lookups run inside the step: no host time to weigh).
            device: the device lookup's proposals (then ``proposals`` are all None): estimated by
                :attr:`lookup_calibration`; a lookup row's :class:`RowChoice` has no tokens (they stay on the
                device) and its bucket.
            block_off: this step does not propose the next block whatever the schedule says (the engine's block
                guard: steps that propose have been slower than steps that do not), unless a request fixes its γ; a
                pending block is still used.
            weights: per request the weight of its committed tokens in the plan's value (tokens per ms) and in the
                block's net value, each in [0, 1] (the engine's ``objective="drain"``: 0 for a request that finishes
                before the batch's slowest even without drafts); None: every request 1 (the plain objective). A row
                of weight 0 still drafts at the width the others choose (its drafts ride in the same verify).
            lookup_factors: per request a factor (> 0) on its lookup proposal's E[accepted | γ] (the engine's
                ``request_calibration``: the request's own realised / estimated acceptance of its earlier lookup
                drafts, smoothed); None: 1 for every request. The recorded estimates stay unscaled.
            block_factors: the same for each request's pending drafter block (its own record of the block's drafts),
                on top of the drafter's shared calibration factor; None: 1 for every request. A step without a
                pending block (the recent blocks' estimate standing in) takes none.
        Returns:
            (choices, propose): one :class:`RowChoice` per request; ``propose`` True when the drafter's block is to
            be proposed in this step (it was chosen for some request, or its probe is due).

        A step with nothing to verify (no pending block, no lookup proposal of a token or more: the γ = 0 regime)
        takes :meth:`_plan_nothing`, the same answer and state updates without the arrays; one request with the
        device lookup and a cost table takes :meth:`_plan_one` (host floats); a step with the device lookup and no
        pending block (the drafter's block idle, or no drafter) takes :meth:`_plan_lookup`, the lookup-only plan
        without the drafter's arrays; 2..:data:`HOST_PLAN_MAX_ROWS` requests with the device lookup, a cost table and
        a pending block take :meth:`_plan_many` (host floats) unless a row fixes its γ, ``weights`` are given or the
        planner has one verify width. Each gives :meth:`_plan_general`'s answer and state updates.
        """
        blocks = self.use_dflash and dflash_expected.count(None) != len(dflash_expected)
        prop_len = None
        self._lf, self._bf = lookup_factors, block_factors
        if weights is None or len(caps) == 1:
            self._w = None
        else:
            self._w = np.asarray(weights, dtype=np.float64)
            self._wsum = float(self._w.sum())
        if not blocks:
            if device is None:
                empty = all(p is None or not len(p) for p in proposals)
                looked = empty and any(p is not None for p in proposals)
            elif len(caps) == 1:  # one row: numpy scalars, not a ufunc per test
                looked = bool(device.valid[0])
                empty = not (looked and device.length[0] > 0)
            else:  # the proposals' lengths cut at max_draft (> 0 where the length is): the lookup-only plan's too
                prop_len = np.where(device.valid, np.minimum(device.length, self.max_draft), 0)
                empty = not prop_len.max(initial=0) > 0
                looked = bool(device.valid.any())
            if empty:
                return self._plan_nothing(batch_size, caps, fixed, looked, lookup_ms if device is None else 0.0,
                                          block_off)
        if (len(caps) == 1 and device is not None and self.spec_costs is not None and self.scalar_one_row
                and (fixed is None or fixed[0] is None)):
            return self._plan_one(batch_size, caps[0], dflash_expected[0], device, block_off)
        if not blocks and device is not None and self.lookup_only_fast:
            return self._plan_lookup(batch_size, caps, device, fixed, block_off, prop_len, looked)
        if (blocks and device is not None and self.spec_costs is not None and self.scalar_many_rows
                and self._w is None and 1 < len(caps) <= HOST_PLAN_MAX_ROWS and len(self.widths) > 1
                and (fixed is None or fixed.count(None) == len(fixed))):
            return self._plan_many(batch_size, caps, dflash_expected, device, block_off)
        return self._plan_general(batch_size, caps, dflash_expected, proposals, fixed, lookup_ms, device, block_off)

    def _plan_lookup(self, batch_size: int, caps: list[int], device: LookupArrays, fixed: list[int | None] | None,
                     block_off: bool, prop_len: np.ndarray | None = None,
                     looked: bool | None = None) -> tuple[list[RowChoice], bool]:
        """:meth:`_plan_general` of a step with the device lookup where no row has a pending drafter block: one plan
        (lookups only; the spec table when the drafter's probe is due, else the lookup table), no drafter arrays, the
        block's net value by the recent blocks' estimate (:meth:`_stand_in_net`); the same choices, value and state
        updates (``tests/test_hybrid.py`` checks them against each other). ``v_l[i, k]`` = E[accepted] of row i's
        proposal at width k's γ, capped by its cap and its proposal's length: ``[n, len(widths)]`` float, read
        straight from :class:`LookupCalibration`'s table (times the row's ``lookup_factors`` where given; the
        choices' estimates stay the table's). ``prop_len``: the proposals' lengths where valid, cut at
        max_draft (``[n]`` int), ``looked``: whether any proposal is current (:meth:`plan` has both at batch > 1;
        None: computed here)."""
        nd, n = self.max_draft, len(caps)
        lc = self.lookup_calibration
        buckets = lc.bucket(device.source, device.match_len, device.num_occurrences)
        if prop_len is None:
            prop_len = np.where(device.valid, np.minimum(device.length, nd), 0)  # [n], <= nd
        # caps cut at 0: min(W - 1, cap) and min(cap, prop_len) need no cut at max_draft (W - 1, prop_len <= it)
        caps_a = np.maximum(caps, 0)
        gam = np.minimum(self._widx[None, :], np.minimum(caps_a, prop_len)[:, None])  # [n, nw] γ of each row
        v_raw = v_l = lc.expected_at(buckets, gam)  # [n, nw], >= 0 (v_raw: the recorded estimates)
        if self._lf is not None:
            v_l = v_raw * np.asarray(self._lf, dtype=np.float64)[:, None]
        probe_d = self.use_dflash and self._idle["dflash"] and self._since["dflash"] >= self._interval["dflash"] \
            and not block_off
        base = n if self._w is None else self._wsum
        total = [base + t for t in self._colsum(v_l).tolist()]  # expected committed tokens per width (host floats)
        costs = self.spec_costs is not None
        if costs:
            r = self._row(batch_size)
            values = [t / c for t, c in zip(total, (self._spec_w if probe_d else self._look_w)[r])]
        else:  # no costs: the most tokens, the longest width on a tie
            values = (np.asarray(total) + 1e-9 * self._widths).tolist()
        j = values.index(max(values))  # the first best width (argmax's)
        self.last_value = values[j] if costs else None
        src = self.lookup
        none = RowChoice("none", 0)
        if self._widx_list[j]:  # a width above AR's: its rows with a proposal draft
            g_l, v_lj = gam[:, j], v_l[:, j]
            is_l = (v_lj > 0) & (g_l > 0)
            any_l = bool(is_l.any())
            if v_raw is not v_l:
                v_lj = v_raw[:, j]
        else:  # the AR width: γ = 0 in every row, no row drafts
            g_l = is_l = None
            any_l = False
        if any_l:
            use_l = is_l.tolist()
            choices = [RowChoice(src, g, None, e, b) if use else none
                       for use, g, e, b in zip(use_l, g_l.tolist(), v_lj.tolist(), buckets.tolist())]
        else:  # no row drafts (the cost tables price every width above AR's): one shared "none" per row
            choices = [none] * n
        self._lookup_plan = (choices, is_l if any_l else None, buckets, g_l)  # record() of these choices reads them
        # every chosen row verifies its device lookup proposal (a bucket >= 0, γ > 0): RowChoice.device_lookup
        self._plan_rows = (choices, np.where(is_l, g_l, 0).tolist() if any_l else [0] * n, use_l if any_l else None)
        forced = fixed is not None and fixed.count(None) != len(fixed)
        # the block's net value; without a probe the plan's value is the best lookup-only value at the lookup table
        keep_d = costs and self._stand_in_net(r, caps_a, v_l, total, None if probe_d else self.last_value)
        if looked is None:
            looked = bool(device.valid.any())
        return choices, self._end_step(False, keep_d, any_l, looked, probe_d, forced, True, block_off)

    def _plan_nothing(self, batch_size: int, caps: list[int], fixed: list[int | None] | None, looked: bool,
                      lookup_ms: float, block_off: bool = False) -> tuple[list[RowChoice], bool]:
        """:meth:`plan` of a step where no row (``caps``: per request its largest γ) has a pending block or a
        non-empty lookup proposal (``looked``: some row was looked up): every row "none"; the plan's value, the
        drafter's propose, its net value and the schedules as :meth:`_plan_general` sets them there (tokens per ms =
        n / the cheapest width's cost; lookups that took host time, ``lookup_ms`` > 0, never pay for it). One row
        (with :attr:`scalar_one_row`) takes host floats for the value and the net value."""
        n = len(caps)
        costs = self.spec_costs is not None
        probe_d = self.use_dflash and self._idle["dflash"] and self._since["dflash"] >= self._interval["dflash"] \
            and not block_off
        one = n == 1 and self.scalar_one_row  # host floats: the array path's values, without numpy's per-call cost
        if costs:
            r = self._row(batch_size)
            if one:
                self.last_value = max(1.0 / c for c in (self._spec_w if probe_d else self._look_w)[r])
            else:
                table = self.spec_costs if probe_d else self.lookup_costs
                self.last_value = float((float(n if self._w is None else self._wsum) / table[r, self._widx]).max())
        else:
            self.last_value = None
        forced = fixed is not None and fixed.count(None) != len(fixed)
        keep_d = False  # the block's net value, as the recent blocks' estimate has it (no lookup: 0 per row)
        if costs and self.use_dflash and self._block_est is not None:
            if one:
                keep_d = self._stand_in_net_one(r, max(min(caps[0], self.max_draft), 0))
            else:
                keep_d = self._stand_in_net(r, np.maximum(caps, 0), None,
                                            [float(n if self._w is None else self._wsum)] * len(self.widths),
                                            None if probe_d else self.last_value)
        propose = self._end_step(False, keep_d, False, looked, probe_d, forced,
                                 lookup_pays=not (costs and looked and lookup_ms > 0), block_off=block_off)
        choices = [RowChoice("none", 0)] * n  # one shared RowChoice (choices are read, never changed)
        self._nothing_plan = choices
        self._plan_rows = (choices, [0] * n, None)
        return choices, propose

    def plan_rows(self, choices: list[RowChoice]) -> tuple[list[int], list[bool] | None]:
        """Of a plan's ``choices``: per request its γ (``[n]`` host ints) and which rows verify the device lookup's
        proposal (``[n]`` bool, :attr:`RowChoice.device_lookup`; None where no row does). The last plan's come
        without a pass over the choices when it was lookup-only, draft-less or one row's."""
        last = self._plan_rows
        if last is not None and last[0] is choices:
            return last[1], last[2]
        lens = [c.draft_len for c in choices]
        rows = [c.bucket >= 0 and g > 0 for c, g in zip(choices, lens)]
        return lens, rows if any(rows) else None

    def _end_step(self, any_d: bool, keep_d: bool, used_l: bool, looked: bool, probe_d: bool, forced: bool,
                  lookup_pays: bool, block_off: bool = False) -> bool:
        """The step's schedule updates, shared by both plan paths: whether the drafter proposes (forced, or - unless
        ``block_off`` - kept, probed, or not idle with no block pending), the dflash and lookup use averages and
        schedules. Returns ``propose``."""
        propose = self.use_dflash and (forced or (not block_off and (
            keep_d or probe_d or (not self._idle["dflash"] and not any_d))))
        self._advance("dflash", keep_d, any_d, probed=propose)
        if self.lookup is not None:
            use = self._note_use("lookup", used_l) if looked else self._use["lookup"]
            keep = used_l or (looked and use >= IDLE_BELOW)  # a step with no match: keep going
            self._advance("lookup", keep and lookup_pays, looked)
        return propose

    def _plan_general(self, batch_size: int, caps: list[int], dflash_expected: list[list[float] | None],
                      proposals: list[Proposal | None], fixed: list[int | None] | None = None, lookup_ms: float = 0.0,
                      device: LookupArrays | None = None, block_off: bool = False) -> tuple[list[RowChoice], bool]:
        """:meth:`plan` by the arrays (every case)."""
        n = len(caps)
        base = n if self._w is None else self._wsum  # the rows' weighted count: tokens a step commits at γ = 0
        fixed = fixed or [None] * n
        nd = self.max_draft
        cal = self.calibration
        # cumulative estimated accepted tokens by γ (index γ; 0 at γ = 0), calibrated, flat past each proposal's end
        has_d = np.fromiter((e is not None for e in dflash_expected), dtype=bool, count=n)
        any_d = self.use_dflash and bool(has_d.any())
        dfl = self._block_table(dflash_expected, has_d, nd) if any_d else None
        host_look = device is None
        raw_l = np.zeros((n, nd + 1)) if host_look else None
        if host_look:
            for i, prop in enumerate(proposals):
                if prop is not None and len(prop):
                    c = np.cumsum(prop.prefix_probs()[:nd])
                    raw_l[i, 1:len(c) + 1] = c
                    raw_l[i, len(c) + 1:] = c[-1]
        dfl_raw = None
        if any_d:
            dfl_raw = dfl.copy()
            dfl[has_d] *= cal.factor("dflash")
            if self._bf is not None:  # each request's own factor on its block (the recorded estimates: dfl_raw's)
                dfl[has_d] *= np.asarray(self._bf, dtype=np.float64)[has_d, None]
        caps_a = np.maximum(np.minimum(np.asarray(caps, dtype=np.int64), nd), 0)
        if device is not None:  # vectorised: no per-request Proposal
            buckets = self.lookup_calibration.bucket(device.source, device.match_len, device.num_occurrences)
            prop_len = np.where(device.valid, np.minimum(device.length, nd), 0).astype(np.int64)
            raw_l = look = self.lookup_calibration.expected(buckets, prop_len)
            looked = bool(device.valid.any())
        else:
            look = raw_l * (cal.factor(self.lookup) if self.lookup else 0.0)
            prop_len = np.array([len(p) if p is not None else 0 for p in proposals], dtype=np.int64)
            looked = any(p is not None for p in proposals)
        if self._lf is not None:  # each request's own factor (the recorded estimates stay raw_l's)
            look = look * np.asarray(self._lf, dtype=np.float64)[:, None]
        widths = self._widths
        gam = np.minimum(self._widx[None, :], caps_a[:, None])  # [n, nw]
        rows = np.arange(n)[:, None]
        v_d = np.where(has_d[:, None], dfl[rows, gam], -1.0) if any_d else None  # [n, nw]; read only with any_d
        v_l = look[rows, np.minimum(gam, prop_len[:, None])]
        probe_d = self.use_dflash and self._idle["dflash"] and self._since["dflash"] >= self._interval["dflash"] \
            and not block_off
        costs = self.spec_costs is not None
        r = self._row(batch_size) if costs else 0

        def best_plans(lookup_values, extra_ms=0.0):  # [(tokens per ms, width index, dflash allowed)]
            out = []
            for allow_d in ((True, False) if any_d else (False,)):
                best = np.maximum(np.maximum(v_d if allow_d else -1.0, lookup_values), 0.0)  # [n, nw] E[accepted]
                total = base + self._colsum(best)  # expected committed tokens per width
                if costs:
                    # a step that proposes pays the spec table; with block_off a pending block verifies at lookup cost
                    table = self.spec_costs if (allow_d or probe_d) and not block_off else self.lookup_costs
                    value = total / (table[r, self._widx] + extra_ms)
                else:
                    value = total + 1e-9 * widths  # no costs: the most tokens, the longest width on a tie
                j = int(np.argmax(value))
                out.append((float(value[j]), j, allow_d))
            return out

        plans = best_plans(v_l)  # this step's lookups are computed already: their host time is spent
        # do the lookups pay for their host time? (else they go on the probe schedule, like the drafter's block)
        lookup_pays = True
        if costs and looked and lookup_ms > 0 and device is None:  # device lookups: no host time to weigh
            lookup_pays = max(best_plans(v_l, lookup_ms))[0] > max(best_plans(np.zeros_like(v_l)))[0]
        # forced rows (a request's own γ) always take the drafter's block: such a step drafts and proposes
        forced = any(f is not None for f in fixed)
        value, j, allow_d = max(plans, key=lambda t: t[0])
        if forced and any_d:
            allow_d = True
        self.last_value = value if costs else None
        # each row's source at the chosen width, as masks (the fixed rows apart), then one RowChoice per row
        g_w, v_lj = gam[:, j], v_l[:, j]
        g_l = np.minimum(g_w, prop_len)
        is_d = (v_d[:, j] > 0) & (v_d[:, j] >= v_lj) & (g_w > 0) if allow_d else np.zeros(n, dtype=bool)
        is_l = ~is_d & (v_lj > 0) & (g_l > 0)
        g_d = np.minimum(g_w, self.block_size - 1)
        is_fixed = np.fromiter((f is not None for f in fixed), dtype=bool, count=n) & has_d
        if is_fixed.any():
            fx = np.asarray([f if f is not None else 0 for f in fixed], dtype=np.int64)
            g_d = np.where(is_fixed, np.minimum(np.minimum(fx, caps_a), self.block_size - 1), g_d)
            is_d, is_l = (is_d & ~is_fixed) | (is_fixed & (g_d > 0)), is_l & ~is_fixed
        used_d, used_l = bool(is_d.any()), bool(is_l.any())
        est_d = dfl_raw[np.arange(n), g_d] if any_d else None  # uncalibrated, as recorded
        est_l = raw_l[np.arange(n), g_l]
        choices = self._choices(is_d, is_l, g_d, g_l, est_d, est_l, buckets if device is not None else None,
                                proposals)
        # the drafter's block stays proposed while it is chosen in enough recent steps that had one (one step where the
        # lookups won every row does not stop it: at batch 1 that is any step with a good lookup match)
        # (and while a plan with it beats plain AR steps: a block that never pays is not kept for its average's sake)
        use_d = self._note_use("dflash", used_d) if any_d else self._use["dflash"]
        d_value = max((v for v, _, allow in plans if allow), default=None)
        d_pays = d_value is not None and (not costs or d_value > base / self.lookup_costs[r, 0])
        # ... and while it pays on average: the steps where it wins gain more than the steps where it loses pay for
        # its propose (at batch 1 a lookup match wins most steps, the block the steps without one); a step without a
        # pending block counts too, by the recent blocks' estimate, so an idle block is proposed again once it pays
        net_pays = False
        if any_d:
            self._note_block(dfl_raw[has_d].mean(0).tolist())
            if costs:
                net_pays = self._note_net(r, v_d, v_l)
        elif costs:
            net_pays = self._stand_in_net(r, caps_a, v_l, (base + self._colsum(np.maximum(v_l, 0.0))).tolist())
        keep_d = used_d or net_pays or (d_pays and use_d >= IDLE_BELOW)
        return choices, self._end_step(any_d, keep_d, used_l, looked, probe_d, forced, lookup_pays, block_off)

    def _plan_one(self, batch_size: int, cap: int, e: list[float] | None, device: LookupArrays,
                  block_off: bool) -> tuple[list[RowChoice], bool]:
        """:meth:`_plan_general` for one request with the device lookup and a cost table, in host floats: the same
        plan, the same state updates (``tests/test_hybrid.py`` checks the two against each other)."""
        nd, widx = self.max_draft, self._widx_list
        r = self._row(batch_size)
        any_d = self.use_dflash and e is not None
        cap = max(min(cap, nd), 0)
        looked = bool(device.valid[0])
        plen = min(int(device.length[0]), nd) if looked else 0
        lc = self.lookup_calibration
        bucket = lc.bucket_one(int(device.source[0]), int(device.match_len[0]), int(device.num_occurrences[0]))
        look = lc.expected_row(bucket)  # [D + 1] cumulative, by γ
        gam = [min(w, cap) for w in widx]
        v_l = [look[min(g, plen)] for g in gam]
        if self._lf is not None:
            f = self._lf[0]
            v_l = [f * v for v in v_l]
        if any_d:
            k = min(len(e), nd)
            raw_d = [0.0] + [e[min(g, k) - 1] - 1.0 if k else 0.0 for g in range(1, nd + 1)]  # by γ, flat past k
            fac = self.calibration.factor("dflash")
            v_d = [fac * raw_d[g] for g in gam]
            if self._bf is not None:
                b = self._bf[0]
                v_d = [v * b for v in v_d]
        probe_d = self.use_dflash and self._idle["dflash"] and self._since["dflash"] >= self._interval["dflash"] \
            and not block_off
        spec_w, look_w = self._spec_w[r], self._look_w[r]
        m_l = [max(vl, 0.0) for vl in v_l]  # E[accepted] of the best allowed draft per width, lookups only
        m_d = [max(vd, vl, 0.0) for vd, vl in zip(v_d, v_l)] if any_d else None  # the block allowed too
        plans = []
        for allow_d in ((True, False) if any_d else (False,)):
            costs = spec_w if (allow_d or probe_d) and not block_off else look_w
            values = [(1.0 + m) / c for m, c in zip(m_d if allow_d else m_l, costs)]
            best_v = max(values)
            plans.append((best_v, values.index(best_v), allow_d))  # the first width of the best value
        value, j, allow_d = max(plans, key=lambda t: t[0])
        self.last_value = value
        g_w, vlj = gam[j], v_l[j]
        g_l = min(g_w, plen)
        is_d = allow_d and v_d[j] > 0 and v_d[j] >= vlj and g_w > 0
        if is_d:
            g = min(g_w, self.block_size - 1)
            choice = RowChoice("dflash", g, None, raw_d[g])
        elif vlj > 0 and g_l > 0:
            choice = RowChoice(self.lookup, g_l, None, look[g_l], bucket)
        else:
            choice = RowChoice("none", 0)
        used_l = not is_d and choice.draft_len > 0
        use_d = self._note_use("dflash", is_d) if any_d else self._use["dflash"]
        d_value = max((v for v, _, allow in plans if allow), default=None)
        d_pays = d_value is not None and d_value > 1.0 / self._look_ar[r]
        net_pays = False
        if any_d:
            self._note_block(raw_d)
        elif self.use_dflash and self._block_est is not None:  # no pending block: the recent blocks' estimate
            est, fac = self._block_est, self.calibration.factor("dflash")
            v_d = [fac * est[g] for g in gam]
        if any_d or (self.use_dflash and self._block_est is not None):
            if m_d is None:
                m_d = [max(vd, vl, 0.0) for vd, vl in zip(v_d, v_l)]
            best_d = max((1.0 + m) / (sc if sc >= lk else lk) for m, sc, lk in zip(m_d, spec_w, look_w))
            # the best plan without the block and without a propose: the lookup-only plan above when it was priced
            # by the lookup table (no probe due, or block_off), the same floats
            best_l = plans[-1][0] if block_off or not probe_d else max((1.0 + m) / lk for m, lk in zip(m_l, look_w))
            net_pays = self._note_net_value(best_d - best_l)
        keep_d = is_d or net_pays or (d_pays and use_d >= IDLE_BELOW)
        choices = [choice]
        self._plan_rows = (choices, [choice.draft_len], [True] if used_l else None)  # plan_rows() without a pass
        return choices, self._end_step(any_d, keep_d, used_l, looked, probe_d, False, True, block_off)

    def _plan_many(self, batch_size: int, caps: list[int], dflash_expected: list[list[float] | None],
                   device: LookupArrays, block_off: bool) -> tuple[list[RowChoice], bool]:
        """:meth:`_plan_general` of a step of 2..:data:`HOST_PLAN_MAX_ROWS` requests with the device lookup, a cost
        table, a pending drafter block in some row, no fixed γ, no weights and two verify widths or more, in host
        floats: per row its γ, lookup and block values at each width (:meth:`_plan_one`'s lists), the widths' totals
        summed over the rows in the arrays' order, so the same floats, choices and state updates
        (``tests/test_hybrid.py`` checks the two against each other). At a few rows numpy's per-call cost is most of
        the arrays' plan. (numpy sums the rows of ``[n, k]`` one after another for k >= 2; a single column it sums
        pairwise from 8 rows on, so a planner of one width takes the arrays.)"""
        nd, widx, top = self.max_draft, self._widx_list, self.block_size - 1
        n = len(caps)
        r = self._row(batch_size)
        lc = self.lookup_calibration
        bucket_ids = lc.bucket(device.source, device.match_len, device.num_occurrences)
        buckets = bucket_ids.tolist()
        valid, lengths = device.valid.tolist(), device.length.tolist()
        fac = self.calibration.factor("dflash")
        spec_w, look_w = self._spec_w[r], self._look_w[r]
        probe_d = self._idle["dflash"] and self._since["dflash"] >= self._interval["dflash"] and not block_off
        rows = []  # per row: (γ by width, lookup E[accepted] by width, calibrated block's (None: no block), the
        # lookup's cumulative row, the block's raw row by γ (None), proposal length)
        sum_l = sum_d = None  # Σ over rows of max(v_l, 0) and of max(v_d, v_l, 0), per width (the arrays' order)
        raw_sum, num_d = None, 0  # the pending blocks' raw rows summed (their mean: the blocks' estimate)
        looks = lc._table()[bucket_ids].tolist()  # [n, nd + 1] each row's expected_row, in one read
        lf, bf = self._lf, self._bf
        for i in range(n):
            cap = caps[i]
            cap = 0 if cap < 0 else nd if cap > nd else cap
            plen = lengths[i] if valid[i] else 0
            if plen > nd:
                plen = nd
            look = looks[i]
            gam = [w if w < cap else cap for w in widx]
            v_l = [look[g if g < plen else plen] for g in gam] if lf is None else \
                [lf[i] * look[g if g < plen else plen] for g in gam]
            m_l = [v if v > 0.0 else 0.0 for v in v_l]
            e = dflash_expected[i]
            if e is not None:
                k = len(e) if len(e) < nd else nd
                raw = [0.0] + [x - 1.0 for x in e[:k]] + [e[k - 1] - 1.0 if k else 0.0] * (nd - k)
                v_d = [fac * raw[g] for g in gam] if bf is None else [fac * raw[g] * bf[i] for g in gam]
                m_d = [(vd if vd > ml else ml) for vd, ml in zip(v_d, m_l)]
                raw_sum = raw if raw_sum is None else [a + b for a, b in zip(raw_sum, raw)]
                num_d += 1
            else:
                raw = v_d = None
                m_d = m_l
            if sum_l is None:  # the arrays' column sums start from the first row
                sum_l, sum_d = m_l, m_d
            else:
                sum_l = [a + b for a, b in zip(sum_l, m_l)]
                sum_d = [a + b for a, b in zip(sum_d, m_d)]
            rows.append((gam, v_l, v_d, look, raw, plen))
        total_d = [n + s for s in sum_d]  # expected committed tokens per width, the block allowed / not
        total_l = [n + s for s in sum_l]
        plans = []
        for allow_d, total in ((True, total_d), (False, total_l)):
            costs = spec_w if (allow_d or probe_d) and not block_off else look_w
            values = [t / c for t, c in zip(total, costs)]
            best_v = max(values)
            plans.append((best_v, values.index(best_v), allow_d))  # the first width of the best value
        value, j, allow_d = max(plans, key=lambda t: t[0])
        self.last_value = value
        src, none = self.lookup, RowChoice("none", 0)
        choices, lens, look_rows = [], [], []
        used_d = used_l = False
        for (gam, v_l, v_d, look, raw, plen), b in zip(rows, buckets):
            g_w, vlj = gam[j], v_l[j]
            g_l = g_w if g_w < plen else plen
            vdj = v_d[j] if v_d is not None else -1.0
            if allow_d and vdj > 0 and vdj >= vlj and g_w > 0:
                g = g_w if g_w < top else top
                choices.append(RowChoice("dflash", g, None, raw[g]))
                used_d = True
                lens.append(g)
                look_rows.append(False)
            elif vlj > 0 and g_l > 0:
                choices.append(RowChoice(src, g_l, None, look[g_l], b))
                used_l = True
                lens.append(g_l)
                look_rows.append(True)
            else:
                choices.append(none)
                lens.append(0)
                look_rows.append(False)
        use_d = self._note_use("dflash", used_d)
        d_pays = plans[0][0] > n / self._look_ar[r]
        self._note_block([x / num_d for x in raw_sum])
        # the block's net value (_note_net): the best plan with it, priced at no less than the lookup table, minus the
        # best without it and without the propose
        best_d = max(t / (sc if sc >= lk else lk) for t, sc, lk in zip(total_d, spec_w, look_w))
        best_l = max(t / lk for t, lk in zip(total_l, look_w))
        net_pays = self._note_net_value(best_d - best_l)
        keep_d = used_d or net_pays or (d_pays and use_d >= IDLE_BELOW)
        self._plan_rows = (choices, lens, look_rows if used_l else None)  # plan_rows() without a pass
        return choices, self._end_step(True, keep_d, used_l, any(valid), probe_d, False, True, block_off)

    def _colsum(self, x: np.ndarray) -> np.ndarray:
        """``x`` ``[n, k]`` summed over the rows, each weighted by the plan's ``weights`` (a plain sum without):
        ``[k]``."""
        return x.sum(0) if self._w is None else self._w @ x

    @staticmethod
    def _block_table(dflash_expected: list, has_d: np.ndarray, nd: int) -> np.ndarray:
        """``[n, nd + 1]`` float64: column γ = E[accepted | γ] of each row's pending block (E[committed] - 1; 0 at
        γ = 0, flat past the block's end), -1 in rows without one."""
        def padded(e):  # E[committed | γ] for γ = 1..nd, the last value repeated past the block (1: an empty one)
            head = list(e[:nd])
            return head + [head[-1] if head else 1.0] * (nd - len(head))

        dfl = np.full((len(dflash_expected), nd + 1), -1.0)
        dfl[has_d, 0] = 0.0
        rows = [e if len(e) == nd else padded(e) for e in dflash_expected if e is not None]  # as they are, mostly
        dfl[has_d, 1:] = np.asarray(rows, dtype=np.float64) - 1.0
        return dfl

    def _choices(self, is_d, is_l, g_d, g_l, est_d, est_l, buckets, proposals) -> list[RowChoice]:
        """One :class:`RowChoice` per row from the plan's masks (``[n]`` each): the block at ``g_d`` where ``is_d``,
        the lookup at ``g_l`` where ``is_l`` (``buckets``: the device lookup's, else the host ``proposals``' tokens),
        else none; ``est_*`` the uncalibrated estimates."""
        kind = np.where(is_d, 1, np.where(is_l, 2, 0)).tolist()
        gd, gl = g_d.tolist(), g_l.tolist()
        ed = est_d.tolist() if est_d is not None else None
        el = est_l.tolist()
        bk = buckets.tolist() if buckets is not None else None
        src = self.lookup
        none = RowChoice("none", 0)  # shared by the rows without a draft (choices are read, never changed)
        out = []
        for i, k in enumerate(kind):
            if k == 1:
                out.append(RowChoice("dflash", gd[i], None, ed[i]))
            elif k == 2:
                g = gl[i]
                out.append(RowChoice(src, g, None, el[i], bk[i]) if bk is not None
                           else RowChoice(src, g, proposals[i].tokens[:g], el[i]))
            else:
                out.append(none)
        return out

    def _note_block(self, raw: list[float]) -> None:
        """One more step of :attr:`_block_est`: ``raw`` ``[max_draft + 1]`` the step's mean uncalibrated
        E[accepted | γ] over its rows with a pending block."""
        est = self._block_est
        self._block_est = list(raw) if est is None else \
            [(1 - NET_EMA) * a + NET_EMA * b for a, b in zip(est, raw)]

    def _note_net(self, r: int, v_d: np.ndarray, v_l: np.ndarray) -> bool:
        """One more step of the block's net value (:attr:`_block_net`, tokens per ms) at cost table row ``r``:
        ``v_d``, ``v_l`` ``[n, len(widths)]`` E[accepted] of each row's block (-1: none) and lookup (0: none) at each
        width's γ. The best plan with the block (proposing, priced at no less than the lookup table: the two tables
        are measured apart) minus the best without it and without the propose. Returns whether the average is > 0."""
        n = v_l.shape[0]
        base = n if self._w is None else self._wsum
        total_l = base + self._colsum(np.maximum(v_l, 0.0))
        total_d = base + self._colsum(np.maximum(np.maximum(v_d, v_l), 0.0))
        look = self.lookup_costs[r, self._widx]
        cost_d = np.maximum(self.spec_costs[r, self._widx], look)
        return self._note_net_value(float((total_d / cost_d).max()) - float((total_l / look).max()))

    def _stand_in_net(self, r: int, caps_a: np.ndarray, v_l: np.ndarray | None, total_l: list[float],
                      best_l: float | None = None) -> bool:
        """:meth:`_note_net` of a step without a pending block, every row's block taken as :attr:`_block_est`
        (calibrated) at its γ ``min(W - 1, cap)`` (``caps_a`` ``[n]`` int >= 0): whether proposing would pay on this
        step as the steps with a block measure it. ``v_l`` ``[n, len(widths)]`` float the rows' lookup values
        (None: all 0), ``total_l`` ``[len(widths)]`` host floats = n + ``max(v_l, 0)`` summed over the rows,
        ``best_l`` the best of ``total_l`` / the lookup table's row where the caller has it (None: computed here).
        The same net value as :meth:`_note_net` (max(v_d, v_l, 0) taken as max(max(v_d, 0), v_l), the first factor
        kept per estimate; the per-width quotients in host floats). False (no update) without a cost table, a
        drafter source or a block seen."""
        if self._block_est is None or self.spec_costs is None or not self.use_dflash:
            return False
        fac = self.calibration.factor("dflash")
        est = self._block_est_array
        if est is None or est[0] is not self._block_est or est[1] != fac:  # made once per estimate and factor
            est = self._block_est_array = (self._block_est, fac, np.maximum(fac * np.asarray(self._block_est), 0.0))
        v_d = est[2][np.minimum(self._widx[None, :], caps_a[:, None])]  # [n, nw], >= 0
        n, look_w = (len(caps_a) if self._w is None else self._wsum), self._look_w[r]
        sums = self._colsum(v_d if v_l is None else np.maximum(v_d, v_l)).tolist()
        best_d = max((n + t) / max(sc, lk) for t, sc, lk in zip(sums, self._spec_w[r], look_w))
        if best_l is None:
            best_l = max(t / lk for t, lk in zip(total_l, look_w))
        return self._note_net_value(best_d - best_l)

    def _note_net_value(self, net: float) -> bool:
        """One more step of :attr:`_block_net` (moving average :data:`NET_EMA`) at ``net`` tokens per ms; whether the
        average is > 0."""
        self._block_net = (1 - NET_EMA) * self._block_net + NET_EMA * net
        return self._block_net > 0.0

    def _stand_in_net_one(self, r: int, cap: int) -> bool:
        """:meth:`_stand_in_net` of one row with no lookup proposal (``cap``: its largest γ, already cut at max_draft),
        in host floats: the same net value and update (``tests/test_hybrid.py`` checks them against each other)."""
        est, fac = self._block_est, self.calibration.factor("dflash")
        best_d = max((1 + max(fac * est[min(w, cap)], 0.0)) / max(sc, lk)
                     for w, sc, lk in zip(self._widx_list, self._spec_w[r], self._look_w[r]))
        best_l = max(1.0 / lk for lk in self._look_w[r])
        return self._note_net_value(best_d - best_l)

    def _note_use(self, key: str, used: bool) -> float:
        """One more step of ``key``'s moving average of verified proposals (:data:`USE_EMA`); its new value."""
        self._use[key] = (1 - USE_EMA) * self._use[key] + USE_EMA * float(used)
        return self._use[key]

    def record(self, choices: list[RowChoice], num_accepted: list[int],
               block_match: list[tuple[int, int]] | None = None,
               block_expected: list[list[float] | None] | None = None, greedy: list[bool] | None = None) -> None:
        """The verified outcome of a plan's drafts: calibrates each source's estimate.

        With ``block_match`` (the step's :attr:`StepResult.block_match`: per request the pending drafter block's
        common prefix with the committed tokens and the cut it is measured to), ``block_expected`` (per request
        E[committed | γ] of that block, γ = 1..bs-1, None: no current block) and ``greedy`` (per request: temperature
        0), every greedy row that verified another source's drafts (or none) while its block was current also
        calibrates the block: had the block been verified at γ = cut, it would have accepted ``min(match, cut)``
        drafts, against the head's E[accepted | γ = cut]. So the block's estimate keeps learning on the steps where
        the lookups win, and a block the head under-rates is not left unused for want of records."""
        work = self.record_later(choices, num_accepted, block_match, block_expected, greedy)
        if work is not None:
            work()

    def record_later(self, choices: list[RowChoice], num_accepted: list[int],
                     block_match: list[tuple[int, int]] | None = None,
                     block_expected: list[list[float] | None] | None = None,
                     greedy: list[bool] | None = None) -> Callable[[], None] | None:
        """:meth:`record` of the same arguments, its work left to the returned callable (None: nothing to record):
        what the record needs of the plan that made ``choices`` is bound now, so later plans may come before the call
        (the engine calls it while the device runs the next step: its next plan reads the calibration one step
        old). The arguments are kept, not copied: the caller leaves them unchanged."""
        if choices is self._nothing_plan and (block_expected is None or
                                              block_expected.count(None) == len(block_expected)):
            return None  # no row drafted, no pending block to score
        last = self._lookup_plan
        if last is not None and last[0] is choices:  # a lookup-only plan: its rows are device lookups or none
            _, rows, buckets, gammas = last
            if rows is None:  # no row drafted; no pending block: nothing else to calibrate
                return None
            return lambda: self.lookup_calibration.record(buckets[rows], gammas[rows],
                                                          np.asarray(num_accepted, np.int64)[rows])
        return lambda: self._record_rows(choices, num_accepted, block_match, block_expected, greedy)

    def _record_rows(self, choices: list[RowChoice], num_accepted: list[int],
                     block_match: list[tuple[int, int]] | None, block_expected: list[list[float] | None] | None,
                     greedy: list[bool] | None) -> None:
        """:meth:`record` of a plan other than the lookup-only and draft-less fast ones: row by row."""
        dev = []
        host: dict[str, tuple[list[float], list[int]]] = {}
        for c, a in zip(choices, num_accepted):
            g = c.draft_len
            if g <= 0:
                continue
            if c.bucket >= 0:  # the device lookup's proposal (RowChoice.device_lookup)
                dev.append((c.bucket, g, a))
            else:
                ea = host.setdefault(c.source, ([], []))
                ea[0].append(c.estimated)
                ea[1].append(a)
        if dev:
            self.lookup_calibration.record(*zip(*dev))  # (buckets, γ, a) as tuples of host ints
        for source, (est, real) in host.items():
            self.calibration.record_many(source, est, real)
        if block_match is None or block_expected is None or not self.use_dflash:
            return
        est, real = [], []
        for i, (c, (match, cut), e) in enumerate(zip(choices, block_match, block_expected)):
            if e is None or c.source == "dflash" or cut < 1 or (greedy is not None and not greedy[i]):
                continue
            k = min(cut, len(e))
            est.append(e[k - 1] - 1.0)
            real.append(min(match, k))
        if est:
            self.calibration.record_many("dflash", est, real)
