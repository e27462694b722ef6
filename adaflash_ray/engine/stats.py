"""SpecStats: the one definition of the speculative-decoding statistics (docs/design/ALGORITHMS.md §0 names), used by the
engine, the inference worker, the Serve replica, the driver's evaluation, the SGLang backend and the benchmark.

- τ (``accept_len``) = committed tokens per target step = mean(a+1) over the speculative request-steps,
  γ = 0 steps included (they commit one token) = (Σa + #steps) / #steps (SGLang's "average accept length");
- per-draft acceptance length (``per_draft_accept_len``) = 1 + Σa / #drafts over the steps that drafted
  (γ >= 1) only (vLLM's "mean acceptance length");
- acceptance rate = Σa / Σγ; draft waste = 1 - Σa / Σγ (share of drafted tokens rejected);
- accepted per position (``accepted_per_pos``): drafts whose token at draft position i (0-based) was accepted,
  i.e. a > i (vLLM's ``num_accepted_tokens_per_pos``; its sum over i is Σa);
- γ histogram: request-steps per draft length γ = 0 .. block_size-1 (:meth:`SpecStats.draft_len_boundaries`
  gives the matching bucket bounds for a metrics histogram);
- source histogram: request-steps per draft source ("dflash", "ngram", "suffix"; "none" for γ = 0), with Σγ and
  Σa per source (:meth:`SpecStats.source_accept_len`: a source's per-draft acceptance length);
- wall time per engine-step kind (:data:`STEP_KINDS`; :attr:`SpecStats.step_ms_by_kind`): ``ar`` (an AR-mode step,
  no drafter work), ``gamma0`` (a speculative step with γ = 0 for every row and no drafter propose: the ``cost``
  policy's / the planner's γ = 0 steps and the throughput guard's forced AR steps), ``probe`` (γ = 0 for every row,
  but the step proposes the drafter's next block), ``draft`` (some row verifies drafts). The engine times each whole
  step (planning, the device work, the step's one device -> host transfer, postprocessing: one ``perf_counter``
  pair), so the kinds' times add up to ``decode_seconds`` and their counts to ``num_engine_steps``. Beside them:
  prefills (``num_prefills`` / ``prefill_seconds``: admission with its batched prefill, outside the decode steps) and
  the drafter-context catch-ups (``num_catch_ups``, ``catch_up_positions``, ``catch_up_seconds``: the host time of
  :meth:`~adaflash_ray.engine.runner.ModelRunner.catch_up_context`, which runs inside a probe / draft step and is
  included in that step's time; on CUDA its kernels are asynchronous, so their device time shows in the step's).

Undefined values are NaN, everywhere: τ with no step, the per-draft acceptance length, acceptance rate and
draft waste with nothing drafted (γ = 0 on every step). A metrics sink drops or plots NaN; it never reads as a
real 0 or 1.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Iterable


#: engine-step kinds, in the order tables print them (module docstring)
STEP_KINDS = ("ar", "gamma0", "probe", "draft")


_SHAPE_FIELDS = ("shape_steps", "shape_seconds")


def _time_row(count: int, seconds: float) -> dict:
    """``{"count", "total_ms", "mean_ms"}`` (mean None without a count)."""
    return {"count": count, "total_ms": 1e3 * seconds, "mean_ms": 1e3 * seconds / count if count else None}


@dataclass
class SpecStats:
    """Running counts. Add one request-step with :meth:`record_step`, build from recorded per-step lists with
    :meth:`from_steps`, combine with ``+`` and take a window with ``-`` (counts subtract)."""

    num_verify_steps: int = 0  # speculative request-steps: target steps of width γ+1, γ = 0 included
    num_drafted: int = 0  # Σγ
    num_accepted: int = 0  # Σa
    num_generated: int = 0  # committed tokens (prefill's first token included)
    num_engine_steps: int = 0  # batched decode steps
    decode_seconds: float = 0.0  # wall time inside decode steps (host + device)
    draft_len_hist: Counter = field(default_factory=Counter)  # γ -> request-steps
    num_drafting_steps: int = 0  # request-steps with γ >= 1 (#drafts)
    accepted_per_pos: Counter = field(default_factory=Counter)  # draft position i (0-based) -> drafts accepting it
    # draft source of each request-step ("dflash", "ngram", "suffix"; "none" for γ = 0) -> request-steps, Σγ, Σa
    source_hist: Counter = field(default_factory=Counter)
    source_drafted: Counter = field(default_factory=Counter)
    source_accepted: Counter = field(default_factory=Counter)
    kind_steps: Counter = field(default_factory=Counter)  # step kind (STEP_KINDS) -> engine steps
    kind_seconds: Counter = field(default_factory=Counter)  # step kind -> wall seconds
    num_prefills: int = 0  # admissions that prefilled (one batched prefill each)
    prefill_seconds: float = 0.0
    num_catch_ups: int = 0  # drafter-context catch-ups (inside probe / draft steps)
    catch_up_positions: int = 0  # positions they appended, all slots together
    catch_up_seconds: float = 0.0  # their host time (inside the steps' times)
    num_guard_steps: int = 0  # AR steps the throughput guard forced (counted as gamma0 too)
    num_source_guard_steps: int = 0  # block-only steps the source guard forced (SpecEngine source_guard)
    num_drain_steps: int = 0  # planned steps where SpecEngine objective="drain" weighed some request 0
    num_makespan_steps: int = 0  # AR steps SpecEngine makespan_guard forced (the batch's last request ends sooner)
    num_plain_steps: int = 0  # of those, steps of requests makespan_lock locked: the AR engine's own step, no history
    plain_seconds: float = 0.0  # their wall time (inside the gamma0 kind's)
    # plain steps launched before the step in flight was read (SpecEngine async_scheduling): their anchor tokens read
    # on the device
    num_overlapped_steps: int = 0
    num_first_replays: int = 0  # steps that replayed a step graph for the first time and captured no graph
    # Python's garbage collections inside decode steps (gc_pauses.PAUSES; their time is in the steps' times):
    num_gc: int = 0
    num_gc_full: int = 0  # of the oldest generation (2): those traverse every object not frozen
    gc_seconds: float = 0.0
    num_captures: int = 0  # steps that captured a CUDA graph (their own or a catch-up's; a capture's time is in them)
    num_prefill_captures: int = 0  # prefills that captured their forward's graph (ModelRunner prefill_buckets)
    # (kind, rows, verify width) of each step as the device ran it (batch and width buckets on CUDA) -> steps, seconds
    shape_steps: Counter = field(default_factory=Counter)
    shape_seconds: Counter = field(default_factory=Counter)
    num_compactions: int = 0  # times the running requests were packed into the lowest slots (between steps)
    num_slot_moves: int = 0  # requests those moved
    compaction_seconds: float = 0.0

    @classmethod
    def from_steps(cls, draft_lens: Iterable[int], num_accepted: Iterable[int]) -> "SpecStats":
        """Statistics of recorded steps (e.g. a request's ``draft_lens`` / ``num_accepted``)."""
        out = cls()
        for g, a in zip(draft_lens, num_accepted, strict=True):
            out.record_step(int(g), int(a))
        return out

    @staticmethod
    def draft_len_boundaries(block_size: int) -> list[float]:
        """Upper bounds ``[0.5, 1.5, .., block_size - 0.5]`` of a γ histogram (Ray / Prometheus buckets count
        x <= bound and need bounds > 0): each γ = 0 .. block_size-1 gets a bucket of its own."""
        return [g + 0.5 for g in range(block_size)]

    def record_step(self, draft_len: int, num_accepted: int, source: str | None = None) -> None:
        """Count one request's step: γ drafted (0 = a plain target step), a accepted (0 <= a <= γ), and with
        ``source`` the draft source that proposed it (counted in ``source_hist`` / ``source_drafted`` /
        ``source_accepted``)."""
        self.num_verify_steps += 1
        self.num_drafting_steps += draft_len > 0
        self.num_drafted += draft_len
        self.num_accepted += num_accepted
        self.draft_len_hist[draft_len] += 1
        for i in range(num_accepted):  # a accepted = the draft's positions 0 .. a-1 accepted
            self.accepted_per_pos[i] += 1
        if source is not None:
            self.source_hist[source] += 1
            self.source_drafted[source] += draft_len
            self.source_accepted[source] += num_accepted

    def record_ar_steps(self, n: int, sources: bool = True) -> None:
        """:meth:`record_steps` of one engine step whose ``n`` rows all verified nothing (γ = 0; with ``sources``,
        source "none"), without the per-row lists."""
        self.num_verify_steps += n
        self.draft_len_hist[0] += n
        if sources:
            self.source_hist["none"] += n

    def record_steps(self, draft_lens: list[int], num_accepted: list[int], sources: list[str] | None = None) -> None:
        """:meth:`record_step` for each request of one engine step (``draft_lens`` / ``num_accepted`` /
        ``sources``: ``[n]`` host ints / strings); above 4 rows counted per step rather than per request: the same
        counts, and the counters' keys inserted in the same order (the order the rows first show them). A step where
        no request drafted (every γ = 0: the ``cost`` policy's AR steps) is counted in O(1). Raises ValueError when
        the lists' lengths differ."""
        if not isinstance(draft_lens, list):
            draft_lens = list(draft_lens)
        n = len(draft_lens)
        if not any(draft_lens):
            self.record_ar_steps(n, sources is not None)
            return
        if not isinstance(num_accepted, list):
            num_accepted = list(num_accepted)
        if n <= 4 and len(num_accepted) == n and (sources is None or len(sources) == n):  # a few rows: one by one
            for i in range(n):
                self.record_step(draft_lens[i], num_accepted[i], sources[i] if sources is not None else None)
            return
        if len(num_accepted) != n or (sources is not None and len(sources) != n):
            raise ValueError(f"record_steps: {n} draft lengths, {len(num_accepted)} accepted counts"
                             + (f", {len(sources)} sources" if sources is not None else ""))
        self.num_verify_steps += n
        self.num_drafting_steps += n - draft_lens.count(0)
        total_g, total_a = sum(draft_lens), sum(num_accepted)
        self.num_drafted += total_g
        self.num_accepted += total_a
        self.draft_len_hist.update(draft_lens)  # += 1 per row, keys in first-seen order
        if total_a:  # accepted_per_pos[i] += rows with a > i, for i = 0 .. max(a) - 1 in order
            per_a = Counter(num_accepted)
            left = n - per_a.get(0, 0)
            app = self.accepted_per_pos
            for i in range(max(num_accepted)):
                app[i] += left
                left -= per_a.get(i + 1, 0)
        if sources is None:
            return
        self.source_hist.update(sources)
        kinds = list(dict.fromkeys(sources))  # first-seen order, as record_step inserts the keys
        if len(kinds) == 1:
            drafted = {kinds[0]: total_g}
            accepted = {kinds[0]: total_a}
        else:
            drafted, accepted = dict.fromkeys(kinds, 0), dict.fromkeys(kinds, 0)
            for s, g, a in zip(sources, draft_lens, num_accepted):
                if g or a:
                    drafted[s] += g
                    accepted[s] += a
        sd, sa = self.source_drafted, self.source_accepted
        for s in kinds:
            sd[s] += drafted[s]
            sa[s] += accepted[s]

    def __add__(self, other: "SpecStats") -> "SpecStats":
        return SpecStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, earlier: "SpecStats") -> "SpecStats":
        return self.since(earlier)

    def since(self, earlier: "SpecStats", by_shape: bool = True) -> "SpecStats":
        """The counts added after ``earlier`` (``self - earlier``); with ``by_shape=False`` the per-shape counters
        (``shape_steps`` / ``shape_seconds``, up to one key per batch x width bucket and step kind) are left empty -
        the cheap delta of one engine step that the serving path takes every step."""
        skip = () if by_shape else _SHAPE_FIELDS
        out = {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self) if f.name not in skip}
        for k in ("draft_len_hist", "accepted_per_pos", "source_hist", "source_drafted", "source_accepted",
                  "kind_steps", "kind_seconds", "shape_steps", "shape_seconds"):
            if k in out:
                out[k] = +out[k]  # Counter subtraction keeps positive counts only
        return SpecStats(**out)

    def copy(self, by_shape: bool = True) -> "SpecStats":
        """A copy; with ``by_shape=False`` without the per-shape counters (see :meth:`since`)."""
        return self.since(SpecStats(), by_shape)

    def record_engine_step(self, kind: str, seconds: float, shape: tuple[int, int] | None = None) -> None:
        """Count one engine step of ``kind`` (:data:`STEP_KINDS`) that took ``seconds`` of wall time (also added to
        ``num_engine_steps`` / ``decode_seconds``); with ``shape`` ``(rows, verify width)`` as the device ran it, also
        by shape (:meth:`step_ms_by_shape`)."""
        assert kind in STEP_KINDS, kind
        self.num_engine_steps += 1
        self.decode_seconds += seconds
        self.kind_steps[kind] += 1
        self.kind_seconds[kind] += seconds
        if shape is not None:
            key = (kind, *shape)
            self.shape_steps[key] += 1
            self.shape_seconds[key] += seconds

    def step_ms_by_shape(self) -> dict[str, dict[str, dict]]:
        """``{kind: {"<rows>x<width>": {"count", "total_ms", "mean_ms"}}}``: the wall time of each kind's steps by the
        shape the device ran (rows = the batch bucket, width = the verify width bucket: the cost tables' row and
        column), rows then widths ascending - the realised price of each width beside the tables' measured one."""
        out: dict[str, dict[str, dict]] = {}
        for key in sorted(self.shape_steps, key=lambda k: (STEP_KINDS.index(k[0]), k[1], k[2])):
            out.setdefault(key[0], {})[f"{key[1]}x{key[2]}"] = _time_row(self.shape_steps[key],
                                                                         self.shape_seconds.get(key, 0.0))
        return out

    @property
    def step_ms_by_kind(self) -> dict[str, dict[str, float]]:
        """``{kind: {"count", "total_ms", "mean_ms"}}`` for each step kind seen (:data:`STEP_KINDS` order)."""
        return {k: _time_row(self.kind_steps[k], self.kind_seconds.get(k, 0.0))
                for k in STEP_KINDS if self.kind_steps.get(k, 0) > 0}

    def timing(self) -> dict:
        """JSON-ready wall-time split: ``steps`` (:attr:`step_ms_by_kind`), ``prefill`` and ``catch_up``
        (``{"count", "total_ms", "mean_ms"}``, catch-up with ``num_positions``), ``compaction`` (the same, with
        ``num_moves``: requests moved to lower slots between steps), ``num_captures`` (steps that captured a CUDA graph),
        ``num_prefill_captures`` (prefills that did),
        ``num_guard_steps``, ``num_source_guard_steps``, ``num_drain_steps``, ``num_makespan_steps``,
        ``num_plain_steps``, ``plain`` (``{"count", "total_ms", "mean_ms"}`` of those plain steps, part of ``gamma0``),
        ``num_overlapped_steps`` (plain steps launched before the step in flight was read: SpecEngine
        ``async_scheduling``), ``num_first_replays`` (steps that replayed a CUDA graph for the first time: ModelRunner ``step_first_replay``),
        ``gc`` (``{"count", "total_ms", "mean_ms"}`` of Python's garbage collections inside decode steps, their pauses
        part of the steps' times, with ``num_full``: those of the oldest generation), ``steps_by_shape``
        (:meth:`step_ms_by_shape`)."""
        return {"steps": self.step_ms_by_kind, "steps_by_shape": self.step_ms_by_shape(),
                "prefill": _time_row(self.num_prefills, self.prefill_seconds),
                "catch_up": {**_time_row(self.num_catch_ups, self.catch_up_seconds),
                             "num_positions": self.catch_up_positions},
                "compaction": {**_time_row(self.num_compactions, self.compaction_seconds),
                               "num_moves": self.num_slot_moves},
                "num_captures": self.num_captures, "num_prefill_captures": self.num_prefill_captures,
                "num_guard_steps": self.num_guard_steps, "num_source_guard_steps": self.num_source_guard_steps,
                "num_drain_steps": self.num_drain_steps, "num_makespan_steps": self.num_makespan_steps,
                "num_plain_steps": self.num_plain_steps, "plain": _time_row(self.num_plain_steps, self.plain_seconds),
                "num_overlapped_steps": self.num_overlapped_steps, "num_first_replays": self.num_first_replays,
                "gc": {**_time_row(self.num_gc, self.gc_seconds), "num_full": self.num_gc_full}}

    def source_accept_len(self, source: str) -> float:
        """Per-draft acceptance length 1 + Σa / #steps of one draft source (its steps only); NaN if it never ran."""
        n = self.source_hist.get(source, 0)
        return 1.0 + self.source_accepted.get(source, 0) / n if n else math.nan

    @property
    def accept_len(self) -> float:
        """τ = committed tokens per target step = mean(a+1) over every speculative step, γ = 0 steps included;
        NaN with no step."""
        s = self.num_verify_steps
        return (self.num_accepted + s) / s if s else math.nan

    @property
    def per_draft_accept_len(self) -> float:
        """1 + Σa / #drafts over the steps that drafted (γ >= 1; vLLM's mean acceptance length); NaN with none."""
        n = self.num_drafting_steps
        return 1.0 + self.num_accepted / n if n else math.nan

    @property
    def acceptance_rate(self) -> float:
        """Σa / Σγ; NaN when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else math.nan

    @property
    def draft_waste(self) -> float:
        """1 - Σa / Σγ; NaN when nothing was drafted."""
        return 1.0 - self.acceptance_rate

    @property
    def mean_draft_len(self) -> float:
        """Mean γ per step (γ = 0 steps included); NaN with no step."""
        return self.num_drafted / self.num_verify_steps if self.num_verify_steps else math.nan

    @property
    def ms_per_step(self) -> float:
        """Mean wall milliseconds of one engine decode step (host + device, prefill excluded); NaN if none."""
        return 1e3 * self.decode_seconds / self.num_engine_steps if self.num_engine_steps else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        """Committed tokens per second of decode-step time; NaN if no time was spent."""
        return self.num_generated / self.decode_seconds if self.decode_seconds else math.nan

    def as_metrics(self, prefix: str = "spec") -> dict[str, float]:
        """Flat metrics ``{prefix}/accept_len`` (τ), ``per_draft_accept_len``, ``acceptance_rate``, ``draft_waste``,
        ``mean_draft_len``, ``num_verify_steps``, ``num_generated``, ``decode_tokens_per_s``, ``ms_per_step``."""
        return {f"{prefix}/accept_len": self.accept_len,
                f"{prefix}/per_draft_accept_len": self.per_draft_accept_len,
                f"{prefix}/acceptance_rate": self.acceptance_rate,
                f"{prefix}/draft_waste": self.draft_waste,
                f"{prefix}/mean_draft_len": self.mean_draft_len,
                f"{prefix}/num_verify_steps": float(self.num_verify_steps),
                f"{prefix}/num_generated": float(self.num_generated),
                f"{prefix}/decode_tokens_per_s": self.decode_tokens_per_s,
                f"{prefix}/ms_per_step": self.ms_per_step}
