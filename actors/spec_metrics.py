"""The speculative-decoding and latency metrics in vLLM's shape, on Ray's metrics export (``ray.util.metrics``);
one definition for the Serve replicas (``adaflash_ray.serve``) and the main job's inference workers.

Counters (exported by Ray to Prometheus as ``ray_<name>_total``), summable across replicas / workers and
re-windowable with ``rate()``:

- ``adaflash_spec_decode_num_drafts``: request-steps that drafted (γ >= 1);
- ``adaflash_spec_decode_num_draft_tokens``: Σγ, drafted tokens;
- ``adaflash_spec_decode_num_accepted_tokens``: Σa, accepted drafted tokens;
- ``adaflash_spec_decode_num_accepted_tokens_per_pos`` (label ``position``, 0-based): drafts whose token at
  that draft position was accepted (a > position);
- ``adaflash_generation_tokens``: committed output tokens (the prefill's first token included);
- ``adaflash_spec_decode_num_drafts_per_source`` / ``_num_draft_tokens_per_source`` /
  ``_num_accepted_tokens_per_source`` (label ``source``: "dflash", "ngram", "suffix"; γ = 0 steps are not drafts):
  the same three counts split by the draft source that proposed each draft.

So per-draft acceptance length = 1 + rate(accepted) / rate(drafts) over any window and any set of replicas.

Histograms (seconds): ``adaflash_time_to_first_token_seconds`` (submission -> the step that committed the first
token), ``adaflash_inter_token_latency_seconds`` (one observation per output token after the first: a step that
committed k tokens Δt after the previous one observes Δt / k, k times, so the sum is the decode time and the
count is tokens - 1), ``adaflash_e2e_request_latency_seconds`` (submission -> finished; aborted requests are not
observed); ``adaflash_spec_decode_draft_len`` (γ per request-step, bounds
:meth:`SpecStats.draft_len_boundaries`). Gauge ``adaflash_drafter_version``.

Every metric carries the tag keys ``component`` ("serve" / "worker") and ``instance`` (the replica tag / the
worker index). Fed from :class:`~adaflash_ray.engine.EngineService` step events (:meth:`SpecMetrics.on_step`,
in the engine thread; submissions through :meth:`SpecMetrics.timed_submit`); the metric objects come from a backend (default :class:`RayMetricsBackend`), which a test
replaces with a recording one.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Protocol

from adaflash_ray.engine import SpecStats, StepEvent

__all__ = ["METRIC_NAMES", "RayMetricsBackend", "SpecMetrics", "TTFT_BUCKETS", "ITL_BUCKETS", "E2E_BUCKETS"]

# vLLM's bucket bounds (seconds); ITL gets two finer bounds below vLLM's first for fast GPU steps
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
TAG_KEYS = ("component", "instance")
METRIC_NAMES = {
    "drafts": "adaflash_spec_decode_num_drafts",
    "draft_tokens": "adaflash_spec_decode_num_draft_tokens",
    "accepted": "adaflash_spec_decode_num_accepted_tokens",
    "accepted_per_pos": "adaflash_spec_decode_num_accepted_tokens_per_pos",
    "generation_tokens": "adaflash_generation_tokens",
    "drafts_per_source": "adaflash_spec_decode_num_drafts_per_source",
    "draft_tokens_per_source": "adaflash_spec_decode_num_draft_tokens_per_source",
    "accepted_per_source": "adaflash_spec_decode_num_accepted_tokens_per_source",
    "ttft": "adaflash_time_to_first_token_seconds",
    "itl": "adaflash_inter_token_latency_seconds",
    "e2e": "adaflash_e2e_request_latency_seconds",
    "draft_len": "adaflash_spec_decode_draft_len",
    "drafter_version": "adaflash_drafter_version",
}


class MetricsBackend(Protocol):
    """Makes metric objects with Ray's API: ``inc(value, tags=)``, ``observe(value, tags=)``, ``set(value, tags=)``,
    ``set_default_tags(dict)``."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any: ...

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any: ...

    def histogram(self, name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...]) -> Any: ...


class RayMetricsBackend:
    """``ray.util.metrics`` Counter / Gauge / Histogram (exported by the node's metrics agent)."""

    def counter(self, name, description, tag_keys):
        from ray.util import metrics
        return metrics.Counter(name, description, tag_keys=tag_keys)

    def gauge(self, name, description, tag_keys):
        from ray.util import metrics
        return metrics.Gauge(name, description, tag_keys=tag_keys)

    def histogram(self, name, description, boundaries, tag_keys):
        from ray.util import metrics
        return metrics.Histogram(name, description, boundaries=boundaries, tag_keys=tag_keys)


class _Timing:
    __slots__ = ("t_submit", "t_last")

    def __init__(self, t_submit: float):
        self.t_submit, self.t_last = t_submit, None


class SpecMetrics:
    """The metrics of one engine (one replica or one worker).

    Args:
        block_size: the drafter's block size (γ = 0 .. block_size-1; the per-position label runs 0 .. block_size-2).
        component: "serve" or "worker" (tag ``component``); instance: the replica tag / worker index (tag
            ``instance``).
        backend: makes the metric objects (default :class:`RayMetricsBackend`).

    Raises:
        ValueError: block_size < 1 or an empty component / instance.
    """

    def __init__(self, block_size: int, component: str, instance: str, backend: MetricsBackend | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not component or not str(instance):
            raise ValueError(f"component and instance must be non-empty, got {component!r}, {instance!r}")
        b = backend or RayMetricsBackend()
        n = METRIC_NAMES
        self.drafts = b.counter(n["drafts"], "speculative request-steps that drafted (gamma >= 1)", TAG_KEYS)
        self.draft_tokens = b.counter(n["draft_tokens"], "drafted tokens (sum of gamma)", TAG_KEYS)
        self.accepted = b.counter(n["accepted"], "accepted drafted tokens (sum of a)", TAG_KEYS)
        self.accepted_per_pos = b.counter(n["accepted_per_pos"], "drafts whose token at this draft position "
                                          "(0-based) was accepted", TAG_KEYS + ("position",))
        self.generation_tokens = b.counter(n["generation_tokens"], "committed output tokens", TAG_KEYS)
        src = TAG_KEYS + ("source",)
        self.drafts_per_source = b.counter(n["drafts_per_source"], "drafts (gamma >= 1) per draft source", src)
        self.draft_tokens_per_source = b.counter(n["draft_tokens_per_source"], "drafted tokens per draft source", src)
        self.accepted_per_source = b.counter(n["accepted_per_source"], "accepted drafted tokens per draft source", src)
        self.ttft = b.histogram(n["ttft"], "submission to first token, seconds", TTFT_BUCKETS, TAG_KEYS)
        self.itl = b.histogram(n["itl"], "latency per output token after the first, seconds", ITL_BUCKETS, TAG_KEYS)
        self.e2e = b.histogram(n["e2e"], "submission to finish, seconds", E2E_BUCKETS, TAG_KEYS)
        self.draft_len = b.histogram(n["draft_len"], "draft length gamma per request-step",
                                     SpecStats.draft_len_boundaries(block_size), TAG_KEYS)
        self.drafter_version = b.gauge(n["drafter_version"], "drafter version loaded", TAG_KEYS)
        tags = {"component": component, "instance": str(instance)}
        for m in (self.drafts, self.draft_tokens, self.accepted, self.accepted_per_pos, self.generation_tokens,
                  self.drafts_per_source, self.draft_tokens_per_source, self.accepted_per_source, self.ttft,
                  self.itl, self.e2e, self.draft_len, self.drafter_version):
            m.set_default_tags(tags)
        self._lock = threading.Lock()
        self._timing: dict[Any, _Timing] = {}  # request key (its RequestHandle) -> timing, until it ends

    def timed_submit(self, submit: Callable[[], Any]) -> Any:
        """Run ``submit()`` (e.g. ``lambda: service.submit(ids, params)``; any thread) and start timing the
        :class:`~adaflash_ray.engine.RequestHandle` it returns, from just before the call. Step events wait
        for the registration, so even a first step that races the submission is timed. Returns the handle;
        what ``submit`` raises propagates (nothing is timed then)."""
        t = time.perf_counter()
        with self._lock:
            h = submit()
            self._timing[h] = _Timing(t)
        return h

    def set_drafter_version(self, version: int) -> None:
        self.drafter_version.set(version)

    def on_step(self, event: StepEvent, now: float | None = None) -> None:
        """Count one engine step (the engine thread): its :class:`SpecStats` delta into the counters and the γ
        histogram, its committed tokens into TTFT / ITL, its finished requests into E2E. Requests whose future
        resolved otherwise (aborted, rejected) stop being timed. ``now``: ``time.perf_counter()`` seconds."""
        now = time.perf_counter() if now is None else now
        self.observe_stats(event.stats)
        with self._lock:
            for h, tokens in event.committed:
                tm = self._timing.get(h)
                if tm is None or not tokens:
                    continue
                k = len(tokens)
                if tm.t_last is None:
                    self.ttft.observe(max(now - tm.t_submit, 0.0))
                    k -= 1  # the first token's latency is the TTFT; the rest of this step came at once
                    dt = 0.0
                else:
                    dt = max(now - tm.t_last, 0.0) / k
                for _ in range(k):
                    self.itl.observe(dt)
                tm.t_last = now
            for h in event.finished:
                tm = self._timing.pop(h, None)
                if tm is not None:
                    self.e2e.observe(max(now - tm.t_submit, 0.0))
            gone = [h for h in self._timing if getattr(getattr(h, "future", None), "done", lambda: False)()]
            for h in gone:
                del self._timing[h]

    def observe_stats(self, st: SpecStats) -> None:
        """Add a :class:`SpecStats` delta (counts of whole steps) to the counters and the γ histogram."""
        for counter, v in ((self.drafts, st.num_drafting_steps), (self.draft_tokens, st.num_drafted),
                           (self.accepted, st.num_accepted), (self.generation_tokens, st.num_generated)):
            if v > 0:  # Ray's Counter refuses a zero / negative increment
                counter.inc(v)
        for pos, v in sorted(st.accepted_per_pos.items()):
            if v > 0:
                self.accepted_per_pos.inc(v, tags={"position": str(pos)})
        for source, v in sorted(st.source_hist.items()):
            drafted = st.source_drafted.get(source, 0)
            if source == "none" or drafted <= 0:  # γ = 0 steps: no draft
                continue
            tags = {"source": source}
            self.drafts_per_source.inc(v, tags=tags)
            self.draft_tokens_per_source.inc(drafted, tags=tags)
            if st.source_accepted.get(source, 0) > 0:
                self.accepted_per_source.inc(st.source_accepted[source], tags=tags)
        for g, v in sorted(st.draft_len_hist.items()):
            for _ in range(v):
                self.draft_len.observe(g)

    @property
    def num_timed(self) -> int:
        """Requests being timed now (submitted, not yet finished / aborted)."""
        return len(self._timing)
