"""SpecEngine: the built-in batched speculative-decoding engine (CPU and GPU, PyTorch).

    target = load_target(cfg.model); drafter, head = build_drafter(target, cfg.drafter, cfg.length_head)
    engine = SpecEngine(target, drafter, head, policy="direct", max_batch_size=8, max_seq_len=1024)
    outs = engine.generate([prompt_ids, ...], SamplingParams(max_new_tokens=64))
    engine.load_drafter(tensors, version=3)   # between steps; in-flight requests continue

``step()`` = admit + prefill new requests, one speculative step for all running ones (one device ->
host transfer; a CUDA graph replay on GPU - see runner.py), finish the ones that hit a stop token or
their budget. The ``ngram`` / ``suffix`` lookups run on the host per request per step, or (``lookup_device``; the
default on CUDA) on the device at the end of each step (adaflash_ray/engine/device_lookup.py), whose proposals the
next step plans with and verifies in place. Finished requests become :class:`Trajectory` records when
``record=True``. Verification is lossless: greedy output is token-for-token the target's greedy
output (tests/test_engine.py), sampled output follows the target distribution (χ² test).

Every step's wall time (one clock pair around the whole step, which ends in its device -> host transfer) goes into
:class:`SpecStats` by step kind (``ar`` / ``gamma0`` / ``probe`` / ``draft``), beside the prefills' and the drafter
context catch-ups' times; with the ``cost`` policy (alone or in the hybrid) the same times feed the
:class:`~adaflash_ray.engine.throughput_guard.ThroughputGuard`, which forces AR steps where the policy's realised
tokens per ms fall below AR's (``throughput_guard``); a step that captured its CUDA graph (lazily, inside the step) is
not fed to the guard: its time is a one-off, not what the step costs.
"""
from __future__ import annotations

import bisect
import collections
import logging
import os
import tempfile
import time
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import torch
from filelock import FileLock

from adaflash_ray.drafting.lookup import MAX_DRAFT, PromptLookup, SuffixCorpus, SuffixLookup
from adaflash_ray.engine.hybrid import LOOKUP_SOURCES, HybridPlanner, LookupArrays, RowChoice, check_draft_sources
from adaflash_ray.engine.length_policy import PROBE_MAX_FACTOR, CostLength, length_policy
from adaflash_ray.models.length_head import AcceptanceHead, draft_confidence, expected_committed
from adaflash_ray.engine.request import Request, SamplingParams, Status
from adaflash_ray.engine.device_lookup import NUM_META
from adaflash_ray.engine.gc_pauses import install as _install_gc_pauses
from adaflash_ray.engine.runner import ModelRunner, StepResult, _buckets
from adaflash_ray.engine.scheduler import Scheduler
from adaflash_ray.engine.stats import SpecStats
from adaflash_ray.engine.throughput_guard import ThroughputGuard
from adaflash_ray.models.checkpoint import CheckpointError, check_tensors_fit, tensors_sha256
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.models.target import TargetModel
from adaflash_ray.trajectory import Trajectory
from adaflash_ray.versions import is_newer

#: the collector's pauses, process-wide (read around each decode step: SpecStats.gc_seconds)
_GC_PAUSES = _install_gc_pauses()

# float dtypes by the values they hold exactly: a tensor converted to a dtype at or above its own keeps its values
_FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
#: SpecEngine ``objective`` values; under "drain" a request whose tokens left end before (1 - DRAIN_MARGIN) of the
#: batch's horizon weighs 0, and a request's committed-per-step rate starts from DRAIN_PRIOR pseudo-steps of 1 token
OBJECTIVES = ("throughput", "drain")
DRAIN_MARGIN, DRAIN_PRIOR = 0.1, 4
#: SpecEngine ``makespan_guard``: AR is preferred when its horizon is below (1 - MAKESPAN_MARGIN) x drafting's (a
#: margin: a request's early record, a few steps, may undersell the drafts it will get, and AR steps do not update it; a
#: wider one leaves a wave whose slowest request gains little from its drafts drafting at a drafting step's cost -
#: scripts/gpu_makespan_sweep.sh sweeps it on bench cells); a verdict for AR forces MAKESPAN_BACKOFF AR steps (doubling
#: while the verdict holds, at most PROBE_MAX_FACTOR x), then MAKESPAN_TRIAL steps are the policy's again (fresh
#: records) before the next verdict
MAKESPAN_MARGIN, MAKESPAN_BACKOFF, MAKESPAN_TRIAL = 0.1, 16, 8
#: a verdict for AR whose AR horizon is below MAKESPAN_DECISIVE x drafting's skips the trial after its back-off (the
#: requests' records cannot close that gap in a few steps: the verdict is taken again at once) - drafting's horizon by
#: the requests with a record of their own, not by the history's prior for those without one; the guard keeps the own
#: committed tokens per drafting step of the last MAKESPAN_HISTORY finished requests that drafted at least
#: MAKESPAN_HISTORY_MIN_STEPS steps at the policy's γ (none fixing its own draft_len), and with at least
#: MAKESPAN_HISTORY_MIN of them a request without a record of its own is priced at their 1 / (n + 1) quantile (n: the
#: running requests without one - the expected slowest of n draws), so the first verdict of a wave needs no trial either
MAKESPAN_DECISIVE, MAKESPAN_HISTORY, MAKESPAN_HISTORY_MIN, MAKESPAN_HISTORY_MIN_STEPS = 0.85, 256, 16, 8
#: a verdict for AR over a wave none of whose requests has a record yet is decisive by the history alone (no trial,
#: and under makespan_lock the wave is locked at once) in at most MAKESPAN_HISTORY_WAVES waves since the history last
#: grew (a wave: the requests of one admission): the next one drafts its trial, so the history - which a locked wave
#: never adds to - follows the traffic
MAKESPAN_HISTORY_WAVES = 4


def _wave_ms(steps: list[float], runs: list[tuple[int, int, float]]) -> float:
    """The wall ms of a wave of requests that need ``steps`` more steps each (any order; empty: 0) when a step of k
    running requests costs ``ms`` for k in ``[lo, hi)`` of one of ``runs`` (``(lo, hi, ms)``, covering 1..len(steps)):
    the batch shrinks as they finish, so with s sorted in descending order (s_n+1 = 0) it is the sum over k = 1..n of
    (s_k - s_k+1) x ms(k) - per run, (s_lo - s_hi) x ms."""
    s = sorted(steps, reverse=True)
    n = len(s)
    s.append(0.0)
    total = 0.0
    for lo, hi, ms in runs:
        if lo > n:
            break
        total += (s[lo - 1] - s[min(hi, n + 1) - 1]) * ms
    return total


def request_headroom(block_size: int | None, lookup: bool) -> int:
    """Positions a request needs past its prompt + ``max_new_tokens`` (a step writes a whole verify window): the
    drafter's block (``block_size``; None without a drafter), or with a lookup source its longest draft + 1."""
    return max(block_size or 1, MAX_DRAFT + 1 if lookup else 1)


#: under ``propose_first``: planned steps without a verified block before one verifies it at the full γ again
PROPOSE_FIRST_PROBE = 32
#: under ``request_calibration``: pseudo-tokens, estimated and accepted alike, in each request's factors
REQUEST_CAL_PRIOR = 1.0
#: the source guard's reference run ends before its ``source_guard_reference_rows`` where the block alone runs at less
#: than this fraction of the planned steps' rate (a random or untrained drafter: no long runs of it)
SOURCE_GUARD_REFERENCE_STOP = 0.7
_slot_of = attrgetter("slot")


def _rows_of(batch: _Batch, keep: list[int]) -> _Batch:
    """``batch`` cut to its rows ``keep`` (non-empty indices into its requests) - a plain or AR step's batch: γ 0, no
    choices; its batch size that of the rows kept (the throughput guard's bucket)."""
    slots = batch.slots if batch.slots is not None else [r.slot for r in batch.requests]
    kept = [slots[i] for i in keep]
    return batch._replace(requests=[batch.requests[i] for i in keep], draft_lens=[0] * len(keep), slots=kept,
                          batch_size=max(kept) + 1)


def _running_rows(batch: _Batch) -> list[int]:
    """The rows of ``batch`` whose requests still run (an overlapped step's batch was fixed before the step before
    it was read: a stop token or an abort may have ended some since)."""
    return [i for i, r in enumerate(batch.requests) if r.status == Status.RUNNING]


def _result_rows(res: StepResult, keep: list[int]) -> StepResult:
    """A plain step's :class:`StepResult` cut to its rows ``keep``."""
    pick = (lambda xs: None if xs is None else [xs[i] for i in keep])
    return StepResult(committed=pick(res.committed), num_accepted=pick(res.num_accepted),
                      next_draft_lens=pick(res.next_draft_lens), logprobs=pick(res.logprobs),
                      top_logprobs=pick(res.top_logprobs))
log = logging.getLogger(__name__)


def prefill_settings(cfg) -> dict[str, bool]:
    """The recipe's ``engine.prefill_buckets`` and ``engine.defer_first_block`` for :meth:`SpecEngine.from_config`:
    a value the recipe sets, else (None) on where ``cfg.model.device`` is CUDA and off on CPU (where the prefill's
    forward is not host-bound and padding only adds work)."""
    on_cuda = cfg.model.device.startswith("cuda")
    return {key: on_cuda if getattr(cfg.engine, key) is None else bool(getattr(cfg.engine, key))
            for key in ("prefill_buckets", "defer_first_block")}


def device_lock_path(device: torch.device | str) -> str:
    """A lock file per compute device of this machine: one per GPU (by its UUID, whatever CUDA_VISIBLE_DEVICES
    calls it), one for the CPU. :meth:`SpecEngine.calibrate_costs` holds it while it times steps, so processes
    that share a device (several inference workers on one GPU) measure one at a time."""
    device = torch.device(device)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        key = f"cuda-{getattr(props, 'uuid', None) or os.environ.get('CUDA_VISIBLE_DEVICES', '') + f'-{idx}'}"
    else:
        key = device.type
    return os.path.join(tempfile.gettempdir(), f"adaflash_calibrate_{key}.lock".replace("/", "_"))


def monotone_costs(costs_ms: torch.Tensor) -> torch.Tensor:
    """The lower non-decreasing envelope of measured step costs along γ: ``t'(γ) = min_{γ' >= γ} t(γ')``.

    A longer γ verifies more positions, so it is never cheaper; a measurement above a longer γ's was slowed by
    something else (another process on the GPU, the timer) and takes that longer γ's value instead. A running
    maximum would do the opposite: carry one slowed width into every longer γ.

    Args:
        costs_ms: ``[..., bs-1]`` float ms for γ = 1..bs-1.
    Returns:
        Same shape and dtype, non-decreasing along the last dimension, elementwise <= the input.
    """
    return torch.flip(torch.cummin(torch.flip(costs_ms, [-1]), dim=-1).values, [-1])


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting ``src`` to ``dst`` keeps every value (the same dtype, or float16 / bfloat16 -> float32
    and wider)."""
    return src == dst or _FLOAT_WIDTH.get(src, 9) < _FLOAT_WIDTH.get(dst, 0)


class _Running(NamedTuple):
    """The running batch's host state, kept while the scheduler's batch is unchanged (:attr:`Scheduler.version`):
    the requests, their KV slots (host ints, and the index of their rows in the per-slot arrays: ``slice(0, n)`` where
    the slots are 0..n-1, else an ``[n]`` int64 numpy array), max(slot) + 1, the γ each request fixes (None:
    the policy's / planner's) and whether any does."""

    version: int
    requests: list[Request]
    slots: list[int]
    slot_rows: slice | np.ndarray  # the per-slot arrays' rows of the slots: slice(0, n) where they are 0..n-1
    batch_size: int
    fixed: list[int | None]
    any_own: bool


class _Batch(NamedTuple):
    """One step's plan: the running requests, their γ (host ints), AR or speculative, whether it proposes and
    appends the drafter context, and with draft sources the per-request choices (their lookup drafts)."""

    requests: list[Request]
    draft_lens: list[int]
    spec: bool
    propose: bool
    append: bool | None = None
    choices: list[RowChoice] | None = None
    host_drafts: list[list[int] | None] | None = None
    lookup_rows: list[bool] | None = None  # rows verifying the device lookup's proposal
    lookup: bool = False  # the step proposes the next device lookup drafts
    propose_first: bool = False  # the step proposes its own block before the verify (SpecEngine propose_first)
    batch_size: int = 0  # max(slot) + 1 (the cost table's and the throughput guard's batch size)
    blocks: bool = False  # some row has a pending drafter block (the planner scores it on other sources' steps)
    plain: bool = False  # every row locked out of drafting (makespan_lock): the runner's plain AR step
    slots: list[int] | None = None  # the requests' KV slots, host ints (None: read from the requests)
    # with propose: the step computes its new blocks' E[committed | γ] (False: a block-only step whose next step is
    # block-only too - it verifies them at the full γ - skips the acceptance head; the rows' pending blocks then carry
    # the planner's recent estimate, SpecEngine._pending_estimate)
    expected: bool = True


def _confidence_kernel_ok(target) -> bool:
    """Whether the draft-confidence Triton kernel compiles and agrees with the torch reference on this device (float32
    logits of the target's vocabulary, as ``DFlashDrafter.logits`` gives them): the engine takes it only then, and
    otherwise keeps the reference with a warning - a kernel that fails to build must not stop an engine."""
    dev = target.lm_head.weight.device
    try:
        z = 4 * torch.randn(3, 2, target.config.vocab_size, device=dev, generator=torch.Generator(dev).manual_seed(0))
        got, ref = draft_confidence(z, True), draft_confidence(z, False)
        err, scale = float((got - ref).abs().max()), max(1.0, float(ref.abs().max()))
        ok = bool(torch.isfinite(got).all()) and err <= 1e-3 * scale
    except Exception as e:  # noqa: BLE001 - any failure of an optional kernel: the reference path instead
        log.warning("draft-confidence Triton kernel unavailable (%s: %s); using the torch reference",
                    type(e).__name__, str(e)[:200])
        return False
    if not ok:
        log.warning("draft-confidence Triton kernel disagrees with the torch reference; using the reference")
    return ok


class SpecEngine:
    """Facade over Scheduler (request state) and ModelRunner (tensors).

    Args:
        target: the target model. drafter: a DFlash drafter attached to the target (None = AR only).
        length_head: the policy's head (``LENGTH_POLICIES[policy].head``: DirectLengthHead for ``direct``,
            AcceptanceHead for ``cost``, None for ``fixed``).
        policy: a name in :data:`~adaflash_ray.engine.length_policy.LENGTH_POLICIES`. max_batch_size: KV slots.
            max_seq_len: positions per slot.
        calibrate: with policy ``cost``, measure the step cost table now (:meth:`calibrate_costs`; a few
            seconds); False drafts whole blocks until it is called.
        ar_steps: with policy ``cost``, the policy may answer γ = 0 (an AR step beats drafting at this load and
            acceptance); the engine then steps without proposing and proposes again after ``probe_every`` steps,
            waiting twice as long after each probe that still answers 0 (at most ``PROBE_MAX_FACTOR`` x ``probe_every``).
        record: build a Trajectory per finished request. record_features: with ``record``, also copy out
            the captured target features / last hidden states (``distill.features: captured``); False
            leaves them None for a trainer that recomputes them (``recompute``: no device-to-host copy, and
            ~1.7 MB less per 256-token SmolLM2 trajectory through the object store).
        draft_sources: None = the drafter's block only (the length policy's γ), or a subset of ``("dflash",
            "ngram", "suffix")`` (:mod:`adaflash_ray.engine.hybrid`): per request per step a
            :class:`~adaflash_ray.engine.hybrid.HybridPlanner` chooses the source and γ. ``("ngram",)`` /
            ``("suffix",)`` alone: prompt / suffix lookup drafts of up to :data:`MAX_DRAFT` tokens, no drafter needed.
            With ``"dflash"`` and a lookup: the hybrid; any subset with ``"dflash"`` needs the ``cost`` policy (its
            acceptance head estimates the block, its calibration measures the step costs). Lookup drafts are verified as a
            point-mass q: lossless, greedy and sampled.
        suffix_corpus: the ``suffix`` source's corpus of earlier requests (None = a new empty one); finished
            requests are added to it. lookup_max_ngram: the longest suffix n-gram the lookups match (tokens).
        argmax_drafts: at temperature > 0 the drafter's block is its argmax, verified as a point-mass q (lossless:
            docs/design/ALGORITHMS.md §4.2), instead of one independent sample per block position from q
            (:meth:`from_config`: the recipe's ``engine.argmax_drafts``, off unless the recipe says otherwise).
        lookup_device: where the lookup sources run: ``"host"`` (per request per step, in Python:
            :mod:`adaflash_ray.drafting.lookup`), ``"device"`` (at the end of each step on the runner's device:
            :mod:`adaflash_ray.engine.device_lookup`; its corpus is a ring of ``lookup_corpus_tokens`` tokens, which
            takes ``suffix_corpus``'s sequences at the start and proposes latest occurrences) or ``"auto"`` (device
            on CUDA, host on CPU).
        throughput_guard: with ``ar_steps`` and the ``cost`` policy (alone or in the hybrid), a
            :class:`~adaflash_ray.engine.throughput_guard.ThroughputGuard` (``self.guard``) compares the realised
            committed tokens per ms of the policy's steps (drafts, probes, their catch-ups) with AR steps' per batch
            bucket and forces AR steps where the policy is slower; False = off (``self.guard`` None). Without
            ``ar_steps`` (an engine that must always draft: the main job's inference workers) or with another policy
            (lookup-only sources included) there is none. A step with a request's own ``draft_len`` is never forced.
            The cost table's AR costs are its prior (:meth:`ThroughputGuard.set_prior`): a bucket whose policy runs
            at least ``PRIOR_DECISIVE`` x the table's AR rate gets no forced AR reference steps - unless the
            makespan guard, whose horizons read measured AR steps only, asks for them (:meth:`_guard_prior`).
        block_guard: with the throughput guard, the hybrid with the drafter and a lookup source also gets a second
            one (``self.block_guard``) over the planner's own steps: steps that propose the drafter's next block
            against steps that do not (lookups and any pending block only), so a block whose proposes cost more than
            its drafts gain is not proposed for a doubling back-off, then for a trial of about 32 rows' worth of
            steps. Off by default: the planner proposes where its lookups have no good match, so its non-proposing
            steps are the lookup-matched ones, and the comparison reads that selection as "proposing is slower";
            the planner's own realised-cost pricing (:meth:`~adaflash_ray.engine.hybrid.HybridPlanner.observe_step`)
            and its acceptance calibration already price a propose as it runs.
        source_guard: with the throughput guard, the hybrid with the drafter and a lookup source (not under
            ``propose_first``) also gets a guard over its regime (``self.source_guard``): planned steps (the planner's
            per-request sources, the lookups, the plan's host work) against block-only steps - every row verifies its
            pending drafter block at the full γ = block_size - 1 and the step proposes the next, with no plan and no
            lookup proposed, as the ``fixed`` policy's DFlash engine steps (a row without a pending block verifies the
            lookup proposal it has: :meth:`_block_only`). Per batch bucket, where the planned steps' realised committed
            tokens per row per ms fall below (1 - margin) x the block-only steps', it forces block-only steps for a
            doubling back-off, then lets the planner run a trial again; a block-only reference run is forced once the
            planned steps have a record and again every ``ar_refresh_steps`` of the bucket's steps: one forced step at a
            time until its steps hold ``source_guard_reference_rows`` live rows (at one row a block-only step commits 1
            to 16 tokens: a few steps are a noisy reference), or earlier where after ``min_samples`` steps the block
            alone runs at less than :data:`SOURCE_GUARD_REFERENCE_STOP` x the planned steps' rate
            (:class:`~adaflash_ray.engine.throughput_guard.ThroughputGuard` ``reference_rows``, ``reference_stop``; 0
            rows = a run of ``min_samples`` steps). So the hybrid is not slower than its drafter's block alone where the
            plan's host time and lookups do not pay for themselves. Only steps of the same regime as the step before
            count (a regime's first step verifies what the other left pending). A new batch keeps the back-off (one
            request after another at one row would otherwise rerun the trial each time); a drafter reload ends it and
            forgets both regimes' records (the block-only steps' measured the old drafter too). False = off.
        objective: what the draft sources' planner maximises. ``"throughput"``: expected committed tokens per ms of
            the whole batch step, every request's tokens alike. ``"drain"``: the same while requests wait for a slot;
            with none waiting, the running batch ends with its slowest request, so a request whose tokens left fit
            (at one per step, no drafts) in ``1 - DRAIN_MARGIN`` of the slowest one's expected steps (its tokens left
            over its committed tokens per step so far) weighs 0 in the plan (``HybridPlanner.plan`` ``weights``):
            widths are chosen for the requests that bound the batch's time; the others still draft at that width.
            It trades the early finishers' latency for the batch's makespan (offline batches, one wave of requests).
        clock: seconds, monotonic (``time.perf_counter``); what the step timings and the guard read (a test's fake
            clock makes them deterministic).
        propose_first: with ``"dflash"`` among the planner's sources, the drafter's block is proposed at the start of
            the step that verifies it (``ModelRunner.step(propose_first=True)``), not at the end of the step before:
            a step pays the propose only when the planner chooses the block for some row, with this step's lookup
            proposals in view. Before the plan the block has no head estimate of its own: every row takes the recent
            blocks' mean estimate (the planner's, from the blocks this mode verified, calibrated by their realised
            acceptance), and the block is tried at the full γ on the first planned step and again after
            :data:`PROPOSE_FIRST_PROBE` planned steps without it. False: the block proposed one step ahead.
        request_calibration: with a lookup among the planner's sources, each request's lookup proposals are valued
            by the replica's calibration (per match length and occurrences) times the request's own record: (its
            lookup drafts' accepted tokens + :data:`REQUEST_CAL_PRIOR`) / (their estimated accepted tokens +
            :data:`REQUEST_CAL_PRIOR`) (``HybridPlanner.plan`` ``lookup_factors``), and its pending drafter block
            likewise by its own record of the block's drafts (``block_factors``): a request whose text the sources
            predict worse or better than the average is drafted for accordingly (SuffixDecoding, arXiv 2411.04975,
            adapts its speculation per request too). False: every request by the shared calibration alone.
        makespan_guard: with the throughput guard, and with no request waiting (queued or held back by
            :meth:`generate`): the running batch ends with its last request, so per step the batch's horizon is
            compared both ways - AR: each request's tokens left (to ``max_new_tokens``) as its steps left; drafting:
            each request's tokens left / its own committed tokens per drafting step (its record in steps that
            drafted or probed, with :data:`DRAIN_PRIOR` pseudo-steps at the bucket's mean). A horizon prices the
            stretch while k requests still run at a step of k requests (the batch shrinks as they finish:
            :func:`_wave_ms`): the guard's moving averages at k's bucket (:meth:`ThroughputGuard.step_costs`), else
            the running bucket's scaled by the planner's measured cost tables (:meth:`_rows_ms`). Where
            AR's is below ``1 - MAKESPAN_MARGIN`` of drafting's, the next :data:`MAKESPAN_BACKOFF` steps are AR
            steps (twice as many after each verdict that repeats, at most ``PROBE_MAX_FACTOR`` x; one that does not
            resets it), then :data:`MAKESPAN_TRIAL` steps are left to the policy and the throughput guard (so the
            requests' records can follow) before the next verdict - unless AR's horizon was below
            :data:`MAKESPAN_DECISIVE` of drafting's by the requests' own records (the verdict is taken again at
            once). So is the first verdict after an admission or a drafter reload (which also clears the requests'
            records and the history below), unless the guard holds the own record of at least
            :data:`MAKESPAN_HISTORY_MIN` finished requests (the last :data:`MAKESPAN_HISTORY` that drafted at least
            :data:`MAKESPAN_HISTORY_MIN_STEPS` steps, none with a ``draft_len`` of its own): then a request without a
            record of its own counts at their 1 / (n + 1) quantile, n the running requests without one (the expected
            slowest of n such requests), and the first verdict comes at once; where no running request has a record
            yet, a verdict for AR is decisive by that history alone (no trial after its back-off) in at most
            :data:`MAKESPAN_HISTORY_WAVES` waves (admissions) since the history last grew - the next such wave drafts
            its trial, so the history follows the traffic. A request the drafts serve worse than AR no longer holds a
            whole wave at drafting's step cost.
            Batch-level (the rows of one step share its width); one request: the throughput guard's comparison.
            False: off.
        makespan_lock: with ``makespan_guard``, a verdict for AR decisive by the requests' own records (the one that
            skips the trial), where every running request has a drafting record of its own (a step that drafted or
            probed), or decisive by the history alone (none has a record yet: above), ends drafting for them: while
            all running requests are locked so and none waits, each step is the AR engine's own
            (:meth:`ModelRunner.step` ``plain``: no target features captured, no feature or device-lookup history
            written, no planner) - the γ = 0 step at AR's price, for a wave that will not draft again. A request
            admitted later is not locked, and a drafter reload clears the locks; a step holding
            locked and other requests, or taken while one waits, runs as usual (the locked rows' histories then lack
            the plain steps' positions, which costs their drafts acceptance, never correctness). Not with ``record``
            and ``record_features`` (their trajectories' features come from that history).
        prefill_buckets: prefills pad their prompts to length buckets and, on CUDA with graphs, replay one captured
            graph of the target's forward per (prompts, padded length) (``ModelRunner`` ``prefill_buckets``).
        defer_first_block: a prefill never proposes the new requests' first block (unless one fixes its own γ): their
            drafter context is appended by the first step that proposes (its catch-up, a CUDA graph per padded size)
            and their first step verifies no block - one step without the drafter's drafts per request, for an eager
            propose and context append less in every prefill. False: the block proposed at admission whenever the
            next step would use it.
        async_scheduling: overlap the host's work on a plain AR step's result with the device's next step (the
            overlap scheduling of vLLM's ``async_scheduling`` and SGLang's overlap scheduler): where a step is the
            AR engine's own (``mode="ar"`` without a drafter or lookup source, or ``makespan_lock``'s plain step) and
            the next one will be too - no request waits, no compaction is due, not ``record`` -, :meth:`step`
            launches the next step before it reads this one's tokens (:meth:`ModelRunner.launch_plain`: each row's
            anchor token is read on the device), so each call returns the step launched by the call before, and
            the host's scheduling, commit and records cost no device time. A request that a stop token ends has
            one more row computed in the step already launched, which is dropped (its tokens are never committed);
            one its budget ends is left out of the next launch. Greedy and seeded outputs are the synchronous
            engine's token for token (up to near-ties a different batch shape can flip: a compaction comes one step
            later); unseeded sampling follows the same distribution with other draws. A request that arrives while
            a step is in flight is admitted after that step is read (in AR mode the chain goes on while no slot is
            free). None = on with CUDA graphs.
    Raises:
        ValueError: bad ``draft_sources`` (:func:`~adaflash_ray.engine.hybrid.check_draft_sources`), ``"dflash"``
            among them without the ``cost`` policy, an unknown ``lookup_device`` or ``objective``;
            ``propose_first`` without ``"dflash"`` and a device lookup source in ``draft_sources``, or with
            ``block_guard``; ``request_calibration`` without a lookup source in ``draft_sources``;
            ``makespan_guard`` without the throughput guard; ``makespan_lock`` without ``makespan_guard`` or with
            ``record`` and ``record_features``.
    """

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, length_head: torch.nn.Module | None,
                 *, policy: str = "direct", rate: float = 1.3, min_len: int = 1, max_batch_size: int = 8,
                 max_seq_len: int = 1024, layer_ids: list[int] | None = None, record: bool = False,
                 record_features: bool = True, seed: int = 0, drafter_version: int = 0, use_cuda_graph: bool | None = None,
                 calibrate: bool = True, ar_steps: bool = True, probe_every: int = 8,
                 draft_sources=None, suffix_corpus: SuffixCorpus | None = None, lookup_max_ngram: int = 3,
                 argmax_drafts: bool = False, lookup_device: str = "auto", lookup_corpus_tokens: int = 1 << 16,
                 throughput_guard: bool = True, block_guard: bool = False, compact_slots: bool = True,
                 objective: str = "throughput", clock=time.perf_counter, propose_first: bool = False,
                 request_calibration: bool = False, makespan_guard: bool = False, makespan_lock: bool = False,
                 prefill_buckets: bool = False,
                 source_guard: bool = True, source_guard_reference_rows: int = 0,
                 defer_first_block: bool = False, async_scheduling: bool | None = None):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
        self.objective = objective
        self.num_steps = 0  # decode steps so far (a request's admitted_step is this count when it was admitted)
        # requests a caller holds back for later admission (generate's admit_min / stop_admitting): waiting requests
        # for the drain objective although the scheduler has not seen them
        self.num_held = 0
        self.target, self.drafter, self.length_head = target, drafter, length_head
        self.compact_slots = compact_slots
        self.draft_sources = (check_draft_sources(draft_sources, drafter is not None) if draft_sources is not None
                              else None)
        if self.draft_sources is not None and "dflash" in self.draft_sources and \
                not isinstance(length_head, AcceptanceHead):  # the planner weighs the block by that head's estimate
            raise ValueError(f"draft_sources {list(self.draft_sources)}: planning with 'dflash' needs the 'cost' "
                             "policy's acceptance head; for the drafter's block under another length policy leave "
                             "draft_sources unset")
        if drafter is not None:
            drafter.config.check_target(target.config)
            layer_ids = drafter.config.target_layer_ids
            self.policy = length_policy(policy).build_policy(length_head, drafter.block_size, rate=rate,
                                                             min_len=min_len, ar_steps=ar_steps,
                                                             probe_every=probe_every)
        else:
            self.policy = None
        self.layer_ids = list(layer_ids or target.default_layer_ids(5))
        self.max_seq_len = max_seq_len
        self.scheduler = Scheduler(max_batch_size)
        sources = self.draft_sources or ()
        lookup = next((s for s in sources if s != "dflash"), None)
        if lookup_device not in ("auto", "host", "device"):
            raise ValueError(f"lookup_device must be 'auto', 'host' or 'device', got {lookup_device!r}")
        on_cuda = target.lm_head.weight.device.type == "cuda"
        # the device lookup: the runner keeps the slots' tokens and proposes at the end of each step
        self.lookup_on_device = lookup is not None and (lookup_device == "device" or
                                                        (lookup_device == "auto" and on_cuda))
        dev_lookup = dict(max_ngram=lookup_max_ngram, corpus_tokens=lookup_corpus_tokens if lookup == "suffix" else 0)
        self.runner = ModelRunner(target, drafter, self.policy, num_slots=max_batch_size, max_seq_len=max_seq_len,
                                  layer_ids=self.layer_ids, record=record and record_features,  # hid_hist
                                  use_cuda_graph=use_cuda_graph, seed=seed,
                                  max_draft=MAX_DRAFT if lookup is not None else None,
                                  device_lookup=dev_lookup if self.lookup_on_device else None,
                                  prefill_buckets=prefill_buckets)
        # the device lookup's latest proposal per slot (packed runner rows) and whether it is current
        self._dev_props = np.zeros((max_batch_size, self.runner.max_draft + NUM_META), np.int64)
        self._dev_valid = np.zeros(max_batch_size, dtype=bool)
        self._running: _Running | None = None  # the running batch's host state (_running_state)
        # False while no running request has a pending drafter block (every dflash_expected None: the steps before
        # proposed none): the plan then skips reading them
        self._any_block = True
        # a superset of the running requests' stop token ids (taken at each admission): one check per step finds
        # the steps where no committed token can stop any request
        self._stop_union: frozenset[int] = frozenset()
        # _postprocess appends the tokens of rows that cannot end (budget, stop ids) and carry no logprobs itself;
        # False: every row commits through _commit (the same outputs; tests compare the two)
        self.fast_commit = True
        # a run of spec steps where every row had γ = 0 (the cost policy's or the planner's AR steps), not yet in the
        # requests' per-step records: the running list the run's last step had (None: no run), its steps so far,
        # its drafter version, and per request the run's step count when it joined (an admission joins an open run).
        # flush_records() writes them all (before any other step's records, an abort, and at the first γ = 0 step of
        # another drafter version: a reload does not flush, the version check does), a finish
        # only the finished request's (_flush_one), so a γ = 0 step records in O(1) instead of four appends per row
        # and a request's finish in O(1) instead of the whole batch's; False: every step writes its records at once
        self.lazy_ar_records = True
        self._ar_reqs: list[Request] | None = None
        self._ar_steps = 0
        self._ar_version = 0
        self._ar_from: dict[Request, int] = {}
        # finished requests' prompt + output for the device corpus ring, written together after the step's prefill and
        # after its decode (_flush_corpus)
        self._corpus_pending: list[list[int]] = []
        # the last planned step's planner record (HybridPlanner.record_later), run while the device computes the next
        # step (ModelRunner.step's overlap) or at the next flush point (_flush_planner_record)
        self._planner_record = None
        self.runner.argmax_drafts = bool(argmax_drafts)
        self.lookup = None  # the lookup source's proposer (PromptLookup / SuffixLookup), or None
        if lookup == "ngram":
            self.lookup = PromptLookup(lookup_max_ngram)
        elif lookup == "suffix":
            corpus = suffix_corpus if suffix_corpus is not None else SuffixCorpus(max_ngram=lookup_max_ngram)
            self.lookup = SuffixLookup(corpus, max_ngram=min(lookup_max_ngram, corpus.max_ngram))
            if self.lookup_on_device:
                self.runner.lookup.reset_corpus(corpus.sequences())
        self.planner: HybridPlanner | None = None
        if propose_first and (self.draft_sources is None or "dflash" not in self.draft_sources
                              or not self.lookup_on_device):
            raise ValueError(f"propose_first needs 'dflash' and a lookup source among draft_sources, with the lookups "
                             f"on the device (lookup_device 'device', or 'auto' on CUDA); got draft_sources "
                             f"{self.draft_sources}, lookups on the device: {self.lookup_on_device}")
        if propose_first and block_guard:  # its steps never propose a next block: nothing for that guard to compare
            raise ValueError("propose_first and block_guard do not go together: a propose-first step proposes no "
                             "block for the next step, which is what the block guard compares")
        self.propose_first = bool(propose_first)
        if request_calibration and (self.draft_sources is None or self.lookup is None):
            raise ValueError(f"request_calibration needs a lookup source ('ngram' or 'suffix') among draft_sources, "
                             f"got {self.draft_sources}")
        self.request_calibration = bool(request_calibration)
        self._pf_since: int | None = None  # planned steps since the last one that verified a block (None: none yet)
        if self.draft_sources is not None:
            self.planner = HybridPlanner(self.draft_sources, self.runner.max_draft, self.runner.block_size,
                                         self.runner._width_buckets, probe_every=probe_every,
                                         max_ngram=lookup_max_ngram, lookup_on_device=self.lookup_on_device)
        # the acceptance head's draft confidence in one Triton kernel where the engine's fused kernels are on (CUDA),
        # compiled and checked against the torch reference here, before any CUDA graph capture may first meet it;
        # else (or if that fails) the reference
        fused_conf = on_cuda and bool(getattr(target, "fused_kernels_active", False)) and \
            isinstance(length_head, AcceptanceHead) and _confidence_kernel_ok(target)
        if isinstance(self.policy, CostLength):
            self.policy.fused_confidence = fused_conf
        if self.draft_sources is not None:
            if "dflash" in self.draft_sources and isinstance(length_head, AcceptanceHead):
                head = length_head

                def block_expected(block_hidden, draft_logits):  # [B, bs, H], [B, bs-1, V] -> [B, bs-1]
                    conf = draft_confidence(draft_logits, fused_conf)
                    return expected_committed(torch.sigmoid(head(block_hidden[:, 1:], conf)))
                self.runner.expected_fn = block_expected
        self.record, self.record_features = record, record_features
        self.stats = SpecStats()
        self.clock = self.runner.clock = clock
        # the cost policy, alone or in the hybrid: a guard on its realised throughput (lookup-only sources have none)
        on = throughput_guard and ar_steps and isinstance(self.policy, CostLength)
        self.guard = ThroughputGuard(_buckets(max_batch_size)) if on else None
        block_on = block_guard and on and self.planner is not None and self.planner.use_dflash \
            and self.planner.lookup is not None
        self.block_guard = ThroughputGuard(_buckets(max_batch_size)) if block_on else None
        source_on = source_guard and on and self.planner is not None and self.planner.use_dflash \
            and self.planner.lookup is not None and not self.propose_first
        self.source_guard = ThroughputGuard(
            _buckets(max_batch_size), reference_rows=source_guard_reference_rows,
            reference_stop=SOURCE_GUARD_REFERENCE_STOP if source_guard_reference_rows else 0.0) if source_on else None
        self._last_regime: bool | None = None  # the source guard's previous drafting step: True planned, False not
        self._pending_kept: tuple | None = None  # (the planner's _block_est, _pending_estimate's list of it)
        # a block-only step whose next step is forced block-only too skips the acceptance head (its blocks are
        # verified at the full γ whatever it says): such a stretch then costs what the drafter alone does
        # (ADAFLASH_BLOCK_ONLY_HEAD=1: the head on every block-only step, for an A/B on the GPU)
        self.skip_block_only_estimates = os.environ.get("ADAFLASH_BLOCK_ONLY_HEAD", "0") != "1"
        # the throughput guard's AR references are spared where the policy runs far above the cost table's AR rate
        # (ThroughputGuard.set_prior; ADAFLASH_AR_PRIOR=0: every reference measured, for an A/B on the GPU)
        self.ar_prior = os.environ.get("ADAFLASH_AR_PRIOR", "1") != "0"
        if makespan_guard and self.guard is None:
            raise ValueError("makespan_guard needs the throughput guard (the cost policy, alone or in the hybrid, with "
                             "throughput_guard and ar_steps on): its step costs come from that guard")
        self.makespan_guard = bool(makespan_guard)
        if makespan_lock and not makespan_guard:
            raise ValueError("makespan_lock needs makespan_guard: the lock follows its verdicts")
        if makespan_lock and record and record_features:
            raise ValueError("makespan_lock keeps no feature history in its AR steps: not with record_features")
        self.makespan_lock = bool(makespan_lock)
        self.defer_first_block = bool(defer_first_block)
        # its back-off: AR steps still forced, the next back-off's factor, policy steps since the last verdict for AR;
        # the finished requests' own committed tokens per drafting step (the prior of a request without a record)
        self._ms_forced_left, self._ms_factor, self._ms_trial = 0, 1, 0
        self._ms_history: collections.deque[float] = collections.deque(maxlen=MAKESPAN_HISTORY)
        self._ms_history_added = 0  # values ever added to the history (with its length: the quantile cache's key)
        self._ms_quantile_key: tuple | None = None  # (values added, the history's length) of the cached quantiles
        # waves the history alone decided since it last grew (MAKESPAN_HISTORY_WAVES), and whether this wave counted
        self._ms_history_waves, self._ms_wave_counted = 0, False
        # the scheduler's batch version whose running requests were all locked (makespan_lock; None: none): the
        # plain steps' check is then one comparison, not a look at every row
        self._locked_version: int | None = None
        self.async_scheduling = self.runner.use_graphs if async_scheduling is None else bool(async_scheduling)
        # async_scheduling: the plain step launched and not read yet (its batch and ModelRunner.PendingStep), and the
        # requests a step read outside step() finished (step returns them next)
        self._inflight: tuple | None = None
        self._drained: list[Request] = []
        self._prescheduled: _Batch | None = None  # a step scheduled while one was in flight, not launched with it
        self._ms_quantiles: dict[int, float] = {}  # n -> the history's 1 / (n + 1) quantile
        self._ms_rows: dict[tuple, list[tuple]] = {}  # _rows_ms's runs of counts (bucket, table row) per key
        self._last_planned_propose: bool | None = None  # the block guard's previous planned step (None: none yet)
        self.drafter_version = drafter_version
        self.drafter_sha256 = tensors_sha256(self.drafter_tensors()) if drafter is not None else None
        self.num_reloads = 0  # drafter loads (load_drafter) so far; from the first one on, versions must rise
        self.cost_table: dict | None = None
        if isinstance(self.policy, CostLength) and calibrate:
            self.calibrate_costs()

    def reset_corpus(self, sequences=()) -> None:
        """Replace the ``suffix`` source's corpus by a new one (same budget and n-gram length) holding
        ``sequences`` (token id lists, oldest first), e.g. after a warm-up pass whose outputs must not be looked up
        by the timed requests (with the device lookup: its ring, emptied and refilled). Raises ValueError without a
        ``suffix`` source."""
        if not isinstance(self.lookup, SuffixLookup):
            raise ValueError("reset_corpus needs the 'suffix' draft source")
        if self.lookup_on_device:
            self.runner.lookup.reset_corpus(sequences)
            return
        old = self.lookup.corpus
        self.lookup.corpus = SuffixCorpus(old.max_tokens, old.max_ngram, old.max_occurrences)
        for seq in sequences:
            self.lookup.corpus.add(seq)

    @classmethod
    def from_config(cls, cfg, *, models: tuple | None = None, policy: str | None = None, record: bool = False,
                    record_features: bool = True, ar_steps: bool | None = None, seed: int | None = None,
                    max_batch_size: int | None = None, max_seq_len: int | None = None, **kwargs) -> "SpecEngine":
        """An engine as a recipe describes it.

        Args:
            cfg: a ``RunConfig`` (adaflash_ray.config): ``model`` and ``drafter`` build the models, ``length_head``
                gives the policy and its settings (rate, min_len, ar_steps, probe_every), ``engine`` the limits
                (max_batch_size, max_seq_len), ``seed`` the sampling seed.
            models: ``(target, drafter, length_head)`` already built (drafter None: AR only); None = load the
                target (:func:`~adaflash_ray.models.factory.load_target`) and build the drafter and the policy's
                head (:func:`~adaflash_ray.models.factory.build_drafter`, seeded with ``cfg.seed``).
            policy: overrides ``cfg.length_head.policy`` (the head in ``models`` must be that policy's).
            record, record_features: as in the constructor.
            ar_steps, seed, max_batch_size, max_seq_len: override the recipe's values (None = the recipe's).
            **kwargs: the constructor's other keywords (use_cuda_graph, calibrate, drafter_version, draft_sources:
                default ``cfg.length_head.draft_sources``, without ``dflash`` for an engine built without a drafter;
                throughput_guard: default ``cfg.engine.throughput_guard``; propose_first: default
                ``cfg.engine.propose_first`` where the sources are the hybrid's, which then puts ``"auto"`` lookups on
                the device; makespan_guard: default ``cfg.engine.makespan_guard`` for an engine with the throughput
                guard, else off (and with it makespan_lock: ``cfg.engine.makespan_lock`` unless the engine records
                features); source_guard, source_guard_reference_rows, argmax_drafts: default ``cfg.engine``'s;
                prefill_buckets,
                defer_first_block: default ``cfg.engine``'s, where None = on when ``cfg.model.device`` is CUDA;
                async_scheduling: default ``cfg.engine``'s).
        Raises:
            ValueError / CheckpointError: as the constructor and the model builders.
        """
        lh = cfg.length_head
        if models is None:
            from adaflash_ray.models.factory import build_drafter, load_target

            target = load_target(cfg.model)
            models = (target, *build_drafter(target, cfg.drafter, lh, seed=cfg.seed))
        target, drafter, head = models
        target.fused_kernels = cfg.engine.fused_kernels  # read when the runner fuses the projections (CUDA only)
        kwargs.setdefault("throughput_guard", cfg.engine.throughput_guard)
        kwargs.setdefault("source_guard", cfg.engine.source_guard)
        kwargs.setdefault("source_guard_reference_rows", cfg.engine.source_guard_reference_rows)
        kwargs.setdefault("objective", cfg.engine.objective)
        kwargs.setdefault("argmax_drafts", cfg.engine.argmax_drafts)
        kwargs.setdefault("async_scheduling", cfg.engine.async_scheduling)
        for key, value in prefill_settings(cfg).items():
            kwargs.setdefault(key, value)
        if lh.draft_sources is not None and "draft_sources" not in kwargs:
            kwargs["draft_sources"] = [s for s in lh.draft_sources if s != "dflash" or drafter is not None] or None
        srcs = kwargs.get("draft_sources") or ()
        guarded = kwargs["throughput_guard"] and (lh.ar_steps if ar_steps is None else ar_steps) and \
            (policy or lh.policy) == "cost" and drafter is not None  # the engines that get the throughput guard
        if cfg.engine.makespan_guard and guarded:
            kwargs.setdefault("makespan_guard", True)  # the recipe's, for an engine with the throughput guard
        if kwargs.get("makespan_guard") and cfg.engine.makespan_lock and not (record and record_features):
            kwargs.setdefault("makespan_lock", True)
        if cfg.engine.propose_first and "propose_first" not in kwargs and "dflash" in srcs and len(srcs) > 1:
            kwargs["propose_first"] = True  # the recipe's, for an engine that runs the hybrid
            if kwargs.get("lookup_device", "auto") == "auto":
                kwargs["lookup_device"] = "device"  # its lookups on the device, on CPU too
        return cls(target, drafter, head, policy=policy or lh.policy, rate=lh.rate, min_len=lh.min_len,
                   ar_steps=lh.ar_steps if ar_steps is None else ar_steps, probe_every=lh.probe_every,
                   max_batch_size=max_batch_size or cfg.engine.max_batch_size,
                   max_seq_len=max_seq_len or cfg.engine.max_seq_len, record=record,
                   record_features=record_features, seed=cfg.seed if seed is None else seed, **kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue a request. ``params`` (:class:`SamplingParams`, checked by its ``validate``): vLLM's sampling
        parameters, applied as :mod:`adaflash_ray.engine.sampling` describes; ``stop_token_ids`` None becomes the
        target's EOS ids unless ``ignore_eos`` (they also are the tokens ``min_tokens`` holds back). Raises
        ValueError naming the field for a bad parameter, and for an empty prompt, out-of-vocabulary prompt or stop
        ids, or a prompt + max_new_tokens (+ block_size headroom) longer than max_seq_len."""
        params = params or SamplingParams()
        params.validate()
        if not prompt_ids:
            raise ValueError("empty prompt")
        vocab = self.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.draft_len is not None and (self.drafter is None or params.draft_len > self.drafter.block_size - 1):
            limit = "an engine without a drafter takes none" if self.drafter is None else \
                f"at most block_size - 1 = {self.drafter.block_size - 1}"
            raise ValueError(f"draft_len {params.draft_len}: {limit}")
        headroom = request_headroom(self.drafter.block_size if self.drafter is not None else None,
                                    self.lookup is not None)
        need = len(prompt_ids) + params.max_new_tokens + headroom
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) + "
                             f"{headroom} exceeds max_seq_len {self.max_seq_len}")
        if params.stop_token_ids is None and not params.ignore_eos:
            params.stop_token_ids = list(self.target.config.eos_token_ids)
        if params.stop_token_ids and not all(0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}")
        req = Request(prompt_ids=list(prompt_ids), params=params)
        if request_id is not None:
            req.request_id = request_id
        self.scheduler.add(req)
        return req

    def has_unfinished(self) -> bool:
        """Whether a request waits or runs, or a finished one is still to be returned by :meth:`step` (one
        :meth:`drain` read)."""
        return self.scheduler.num_unfinished > 0 or bool(self._drained)

    def abort(self, req: Request) -> bool:
        """Cancel a request: a waiting one leaves the queue, a running one frees its KV slot now (between
        steps). Its ``finish_reason`` becomes "abort". Returns False if it had already finished."""
        if req.status == Status.FINISHED:
            return False
        if self._ar_reqs is not None:
            self.flush_records()
        if req.status == Status.WAITING:
            self.scheduler.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"
        else:
            self.scheduler.finish(req, "abort")
        return True

    def flush_records(self) -> None:
        """Write the pending run of γ = 0 steps (:attr:`lazy_ar_records`) into its rows' per-step records
        (``draft_lens`` / ``num_accepted`` 0, ``step_sources`` "none", ``step_versions`` the run's drafter version, and
        ``first_version`` where unset): a running request's records are complete after this; a finished one's always
        are."""
        if self._ar_reqs is None:
            return
        k, version, joined = self._ar_steps, self._ar_version, self._ar_from
        self._ar_reqs, self._ar_from = None, {}
        cols: dict[int, tuple] = {}  # the record columns of each length, shared by the requests that joined together
        for req, start in joined.items():
            n = k - start
            if n > 0:
                if n not in cols:
                    cols[n] = ([0] * n, ["none"] * n, [version] * n)
                self._write_ar_records(req, *cols[n], version)

    @staticmethod
    def _write_ar_records(req: Request, zeros: list[int], nones: list[str], versions: list[int], version: int) -> None:
        """Append a run of γ = 0 steps to ``req``'s per-step records (the columns of one length)."""
        req.draft_lens += zeros
        req.num_accepted += zeros
        req.step_sources += nones
        req.step_versions += versions
        if req.first_version is None:
            req.first_version = version

    def _flush_one(self, req: Request) -> None:
        """Write ``req``'s part of the pending γ = 0 run (a finish: the others' stay pending); the run closes when
        no request is left in it."""
        start = self._ar_from.pop(req, None)
        if start is not None and (n := self._ar_steps - start) > 0:
            self._write_ar_records(req, [0] * n, ["none"] * n, [self._ar_version] * n, self._ar_version)
        if not self._ar_from:
            self._ar_reqs = None

    # ------------------------------------------------------------------ stepping
    def step(self, mode: str = "spec") -> list[Request]:
        """Admit + prefill new requests, then one decode step for all running ones (one device -> host
        transfer); returns the requests finished now. ``mode="ar"`` decodes one token per step (no
        drafter work; a request decoded in AR mode should stay in AR mode). With the device lookup, the requests
        finished at their prefill join its corpus ring together before the decode step, those finished by the decode
        step together at its end (inside its timing). With ``async_scheduling`` and a plain step in flight, the call
        launches the next plain step (when nothing else is due: no admission, no compaction) and then reads the one in
        flight, returning what that one finished; otherwise it reads the step in flight first and runs as above."""
        spec = mode == "spec" and (self.drafter is not None or self.lookup is not None)
        finished, self._drained = self._drained, []
        if self._inflight is not None and self._chains(spec) is None:
            self._read_inflight(finished)  # an admission, a compaction or another kind of step comes next
        if self._inflight is None:
            self._admit(spec, finished)
            self._flush_corpus()
            if not self.scheduler.running:
                self._flush_planner_record()  # no step to overlap it with: the planner is up to date between batches
                return finished
            if self.compact_slots and not self.scheduler.waiting:
                self._compact()
        self.num_steps += 1
        gc0 = _GC_PAUSES.snapshot()
        t0 = self.clock()
        if self._inflight is None:
            batch, self._prescheduled = self._prescheduled, None
            if batch is not None:  # scheduled with the step before in flight: kept if its rows are the running ones
                live = _running_rows(batch)
                batch = _rows_of(batch, live) if live else None
                if batch is not None and {id(r) for r in batch.requests} != set(map(id, self.scheduler.running)):
                    batch = None  # an admission since: scheduled again
            if batch is None:
                batch = self._schedule(spec)
            if not self._overlaps(batch):
                res = self._run(batch)
                runner = self.runner
                caught_up = runner.step_catch_up
                self._postprocess(batch, res, finished)
                self._flush_corpus()
                return self._after_step(batch, res, finished, self.clock() - t0, gc0, runner.step_shape, caught_up,
                                        runner.step_captured, runner.step_first_replay)
            self._inflight = (batch, self._launch(batch, chained=False), True)
        batch, pending, counted = self._inflight
        self._inflight = None
        captured = pending.captured
        stay = self._chains(spec)
        if stay is not None:  # the next plain step goes to the device before this one's tokens are read
            if spec and not batch.plain:  # the cost policy's γ = 0 step: scheduled (its guard and probe counts) now
                nxt, nxt_counted = self._schedule(spec), True
                keep = [i for i, r in enumerate(nxt.requests) if r.remaining > 1]  # the rest end in the step in flight
                nxt = _rows_of(nxt, keep) if len(keep) < len(nxt.requests) else nxt
            else:
                slots = list(map(_slot_of, stay))
                nxt, nxt_counted = _Batch(stay, [0] * len(stay), spec, not spec, append=not spec,
                                          batch_size=max(slots) + 1, slots=slots, plain=spec), False
            if self._overlaps(nxt):
                launched = self._launch(nxt, chained=True)
                # a graph this launch captured cost this call's time: the step read now carries it
                captured, launched.captured = captured or launched.captured, False
                self._inflight = (nxt, launched, nxt_counted)
                self.stats.num_overlapped_steps += 1
            else:  # the look ahead and the schedule disagree: the next call runs it as scheduled
                self._prescheduled = nxt
        done = self._finish_plain(batch, pending, counted, finished)
        if self._inflight is not None and not self.scheduler.running:  # every row of the launched step has ended
            self.runner.finish_plain(self._inflight[1])
            self._inflight = None
        if done is None:  # every row ended before it (aborted between the calls): no step to account for
            self.num_steps -= 1
            return finished
        batch, res = done
        return self._after_step(batch, res, finished, self.clock() - t0, gc0, pending.shape, (0, 0.0), captured,
                                pending.first_replay)

    def _finish_plain(self, batch: _Batch, pending, counted: bool, finished: list[Request]):
        """Read a launched plain step and commit the tokens of its rows still running (a row ended by a stop token
        in the step before, or aborted since, is dropped); counts a chained lock step (``counted`` False: no
        ``_schedule`` counted it). Returns its (batch, result) cut to those rows, or None if none was left."""
        res = self.runner.finish_plain(pending)
        live = _running_rows(batch)
        if not live:
            return None
        if len(live) < len(batch.requests):
            batch, res = _rows_of(batch, live), _result_rows(res, live)
        if batch.plain and not counted:
            self.stats.num_makespan_steps += 1
            self.stats.num_plain_steps += 1
        self._postprocess(batch, res, finished)
        self._flush_corpus()
        return batch, res

    def _read_inflight(self, finished: list[Request]) -> None:
        """Read the plain step in flight now (the wait for it is its time), committing its tokens; the requests it
        finishes go to ``finished``."""
        (batch, pending, counted), self._inflight = self._inflight, None
        gc0 = _GC_PAUSES.snapshot()
        t0 = self.clock()
        done = self._finish_plain(batch, pending, counted, finished)
        if done is not None:
            self.num_steps += 1
            self._after_step(*done, finished, self.clock() - t0, gc0, pending.shape, (0, 0.0), pending.captured,
                             pending.first_replay)

    def _after_step(self, batch: _Batch, res: StepResult, finished: list[Request], seconds: float, gc0, shape,
                    caught_up: tuple[int, float], captured: bool, first_replay: bool) -> list[Request]:
        """A step's stats and guard records (the step's wall ``seconds``, its device ``shape``, catch-up, capture)."""
        st = self.stats
        gc1 = _GC_PAUSES.snapshot()
        if gc1[0] != gc0[0]:  # Python's collector paused inside this step (its pauses are in ``seconds``)
            st.num_gc += gc1[0] - gc0[0]
            st.num_gc_full += gc1[1] - gc0[1]
            st.gc_seconds += gc1[2] - gc0[2]
        if not batch.spec:
            kind = "ar"
        elif any(batch.draft_lens):
            kind = "draft"
        else:
            kind = "probe" if batch.propose and self.drafter is not None else "gamma0"
        st.record_engine_step(kind, seconds, shape)
        if caught_up[0]:
            st.num_catch_ups += 1
            st.catch_up_positions += caught_up[0]
            st.catch_up_seconds += caught_up[1]
        st.num_captures += bool(captured)
        st.num_first_replays += first_replay and not captured
        if batch.plain:
            st.plain_seconds += seconds
        if batch.choices is not None and not captured and not caught_up[0]:  # a planned step, no one-off work in it
            self.planner.observe_step(*shape,
                                      (batch.propose or batch.propose_first) and self.drafter is not None,
                                      1e3 * seconds)
        if self.makespan_guard:
            if kind in ("probe", "draft"):  # each request's own record in drafting mode
                for r, a in zip(batch.requests, res.num_accepted):
                    r.spec_steps += 1
                    r.spec_tokens += a + 1
            # the policy's requests only: one that fixed its own γ committed that γ's tokens per step
            done = [r.spec_tokens / r.spec_steps for r in finished
                    if r.spec_steps >= MAKESPAN_HISTORY_MIN_STEPS and r.params.draft_len is None]
            if done:
                self._ms_history.extend(done)
                self._ms_history_added += len(done)
                self._ms_history_waves = 0  # the history follows the traffic again
        if self.guard is None and self.source_guard is None and self.block_guard is None:
            return finished
        # what each guard records: (batch size, which of its two kinds of step, committed tokens, ms, rows)
        n, ms = len(batch.requests), 1e3 * seconds
        tokens = n if batch.plain else n + sum(res.num_accepted)
        if self.guard is not None and not captured:  # a graph capture's time is no step's cost
            self.guard.record(batch.batch_size, kind in ("probe", "draft"), tokens, ms, n)
        if self.source_guard is not None:  # drafting steps, planned against block-only ones
            regime = None if kind not in ("probe", "draft") else batch.choices is not None
            if regime is not None and regime == self._last_regime and not captured:
                self.source_guard.record(batch.batch_size, regime, tokens, ms, n)
            self._last_regime = regime
        if self.block_guard is not None:  # planned steps, with or without a propose (a forced AR step proposes none)
            propose = batch.propose and batch.choices is not None
            # a step's tokens come from the block the step before proposed: the first step after a switch carries
            # the other regime's block (or lacks one), so only planned steps that kept the previous step's choice count
            if batch.choices is not None and not captured and propose == self._last_planned_propose:
                self.block_guard.record(batch.batch_size, propose, tokens, ms, n)
            # a block-only step (the source guard's) leaves its block for the next: no planned step's regime
            self._last_planned_propose = None if batch.choices is None and batch.propose else propose
        return finished

    def _overlaps(self, batch: _Batch) -> bool:
        """Whether ``batch`` runs as an overlapped plain step (``async_scheduling``): the lock's plain step, or the AR
        engine's step (AR mode without a drafter or lookup source); not while recording trajectories."""
        return self.async_scheduling and not self.record and \
            (batch.plain or not batch.spec and self.drafter is None and self.lookup is None or self._gamma0(batch))

    def _gamma0(self, batch: _Batch) -> bool:
        """Whether ``batch`` is the ``cost`` policy's γ = 0 step of an engine without draft sources or makespan guard
        (every row γ = 0, no propose, no context append: the AR step that keeps the feature history)."""
        return batch.spec and not batch.plain and not (batch.propose or batch.append or batch.propose_first) and \
            batch.choices is None and batch.host_drafts is None and batch.lookup_rows is None and \
            not batch.lookup and not any(batch.draft_lens) and self._gamma0_engine()

    def _gamma0_engine(self) -> bool:
        return isinstance(self.policy, CostLength) and self.planner is None and self.lookup is None and \
            not self.makespan_guard

    def _chains(self, spec: bool) -> list[Request] | None:
        """The running requests that stay after the step in flight (the rest end with it by their budget) where the
        next step can be launched before that one is read, else None. It can where it is a plain step for the same
        running requests (AR mode: no request waits for a free slot, or for one the step in flight frees by a
        request's budget; under the lock: all still locked, none waits or is held), at least one of them has tokens
        left after the step in flight, and no compaction is due (a compaction moves slots; the chained step reads
        each row's last token where the step before left it)."""
        sched = self.scheduler
        if not self.async_scheduling or not sched.running or sched.waiting and sched.free_slots:
            return None
        if spec:  # the lock's plain step (_schedule's own test: none waits or is held), or the cost policy's γ = 0
            if not (self.makespan_lock and not sched.waiting and not self.num_held and
                    self._all_locked(sched.running)) and not self._next_gamma0():
                return None
        elif self.drafter is not None or self.lookup is not None:
            return None
        stay = [r for r in sched.running if r.remaining > 1]
        if not stay or sched.waiting and len(stay) < len(sched.running):
            return None  # nothing left to run, or a request waits for the slot the step in flight frees
        bucket, top = self.runner.batch_bucket, max(map(_slot_of, stay)) + 1
        return None if self.compact_slots and bucket(len(stay)) < bucket(top) else stay

    def _next_gamma0(self) -> bool:
        """Whether :meth:`_schedule` will answer the cost policy's γ = 0 step next (:meth:`_gamma0`): every running
        request pending at γ = 0, none with its own γ, and the throughput guard forcing an AR step or the policy not
        probing - looked ahead, changing nothing."""
        if not self._gamma0_engine():
            return False
        cur = self._running_state()
        if cur.any_own or any(r.next_draft_len for r in cur.requests):
            return False
        if self.guard is not None and self.guard.would_force(cur.batch_size):
            return True
        n = len(cur.requests)
        return not self.policy.would_propose(True, [0] * n, [False] * n)

    def _launch(self, batch: _Batch, chained: bool):
        """Launch ``batch``'s plain step (:meth:`ModelRunner.launch_plain`): after the step in flight (``chained``:
        each row one position on, its anchor token read on the device), else from the requests' last tokens."""
        reqs = batch.requests
        slots = batch.slots if batch.slots is not None else [r.slot for r in reqs]
        history = not batch.plain and batch.spec
        if chained:
            return self.runner.launch_plain(slots, [len(r.prompt_ids) + len(r.output_ids) for r in reqs],
                                            history=history)
        return self.runner.launch_plain(slots, [len(r.prompt_ids) + len(r.output_ids) - 1 for r in reqs],
                                        [r.output_ids[-1] for r in reqs], history=history)

    def drain(self) -> None:
        """Read the plain step still in flight (``async_scheduling``), if any, and commit its tokens; the requests
        it finished come back from the next :meth:`step` (:meth:`has_unfinished` is True until then). Called before
        anything that reads or rewrites the slots' device state outside a step (timing, calibration, precapture)."""
        if self._inflight is not None:
            self._read_inflight(self._drained)

    def _admit(self, spec: bool, finished: list[Request]) -> None:
        """Move waiting requests into free KV slots and prefill them: each commits its first token, and (with
        ``spec``, while the next step would use it) its first block is proposed, with the γ the length policy gives it
        joining the batch; without that propose its drafter context is left to the first step that proposes."""
        if not (self.scheduler.waiting and self.scheduler.free_slots):  # nothing to admit (most steps)
            return
        running_before = [r.next_draft_len for r in self.scheduler.running]
        admitted = self.scheduler.admit()
        if not admitted:
            return
        t0 = self.clock()
        # requests joining (a new wave, or the running one): the makespan guard's verdicts did not count them; with the
        # finished requests' record as the new ones' prior, the first verdict needs no trial
        self._ms_forced_left, self._ms_factor = 0, 1
        self._ms_trial = MAKESPAN_TRIAL if len(self._ms_history) >= MAKESPAN_HISTORY_MIN else 0
        self._ms_wave_counted = False
        if self.source_guard is not None and not running_before:
            # its back-off goes on (unlike the AR guard's: a new batch of the same traffic changes what AR costs
            # against drafting, not what the plan's host work costs against the block alone); only the regime chain
            # restarts
            self._last_regime = None
        if self.guard is not None and not running_before:
            self.guard.new_batch()
            if self.block_guard is not None:
                self.block_guard.new_batch()
                self._last_planned_propose = None
        # the new requests' first block only while the step after would use it - the planner's schedule wants the
        # block (in use, or its probe due), the length policy is not in its γ = 0 regime, or a new request fixes its
        # own γ; otherwise their drafter context waits for the first step that proposes (caught up then)
        # a step the throughput guard forces to AR (or the block guard keeps from proposing) drops the block too; a
        # block-only step the source guard forces verifies it whatever the planner's schedule says;
        # under propose_first no step verifies a pending block (each proposes its own): none here, the prompts'
        # drafter context still appended (every planned step appends)
        propose = spec and self.drafter is not None and not self.propose_first and (
            any(r.params.draft_len is not None for r in admitted)
            or (not self.defer_first_block and not self._next_step_forced() and
                (self._next_step_block_only() or self.planner.wants_block() if self.planner is not None
                 else self.policy is None or self.policy.admit_proposes(running_before))))
        # the first lookup proposals, unless the next step is a block-only step (the source guard's; never while a
        # request fixes its γ, as _schedule): its rows verify the blocks proposed here and make none (the proposals
        # are then made by the first planned step after it)
        dev_lookup = spec and self.lookup_on_device and not (
            propose and not self._running_state().any_own and self._next_step_block_only())
        res = self.runner.prefill([r.slot for r in admitted], [r.prompt_ids for r in admitted],
                                  [r.params for r in admitted], propose, lookup=dev_lookup,
                                  append=propose or not spec or self.propose_first)
        if self.lookup_on_device:
            self._keep_proposals([r.slot for r in admitted], res)
        gammas, expected = res.next_draft_lens, res.expected if propose else None
        self._any_block |= expected is not None
        if self.policy is not None and self.planner is None:
            gammas = self.policy.on_admit(gammas, running_before, spec, proposed=propose)
        for i, (req, toks, g) in enumerate(zip(admitted, res.committed, gammas)):
            req.next_draft_len = g
            req.admitted_step = self.num_steps
            if self.planner is not None:
                req.dflash_expected = expected[i] if expected is not None else None
                if self.lookup is not None and not self.lookup_on_device:
                    req.lookup_state, req.lookup_synced = self.lookup.begin(req.prompt_ids), 0
            self._commit(req, toks, finished, res, i)
        self._note_running()
        self.stats.num_prefills += 1
        self.stats.num_prefill_captures += self.runner.prefill_captured
        self.stats.prefill_seconds += self.clock() - t0

    def _note_running(self) -> None:
        """After an admission: the union of every running request's stop ids, read once here (as the runner's
        sampling settings at prefill: a request's ``stop_token_ids`` must not change while it runs)."""
        self._stop_union = frozenset().union(*[r.params.stop_token_ids or () for r in self.scheduler.running])

    def _compact(self) -> None:
        """Pack the running requests into the lowest slots when that shrinks the step's batch bucket (a step computes
        rows 0..max(slot), so a batch whose low slots emptied - a closed batch's tail, requests of unequal lengths -
        would keep paying for the highest slot): :meth:`ModelRunner.move_slots` moves their device state, the
        scheduler their slots, and the device lookup's current proposals follow them."""
        sched = self.scheduler
        top = max(map(_slot_of, sched.running)) + 1
        bucket = self.runner.batch_bucket
        if bucket(len(sched.running)) >= bucket(top):
            return
        t0 = self.clock()
        moves = sched.compaction()
        src, dst = [r.slot for r, _ in moves], [d for _, d in moves]
        self.runner.move_slots(src, dst)
        self._dev_props[dst], self._dev_valid[dst] = self._dev_props[src], self._dev_valid[src]
        sched.relocate(moves)
        st = self.stats
        st.num_compactions += 1
        st.num_slot_moves += len(moves)
        st.compaction_seconds += self.clock() - t0

    def _next_step_forced(self) -> bool:
        """Whether the next step (at the running batch's size) will be an AR step the throughput guard forces (or the
        makespan guard's back-off), or a planned step the block guard keeps from proposing - unless the source guard
        forces a block-only step (:meth:`_next_step_block_only`) in its place (their
        :meth:`ThroughputGuard.would_force`: no change)."""
        if self.guard is None or not self.scheduler.running:  # the block and source guards come with it
            return False
        if self.makespan_guard and self._ms_forced_left > 0 and not (self.scheduler.waiting or self.num_held):
            return True  # the makespan guard's back-off goes on
        batch_size = max(r.slot for r in self.scheduler.running) + 1
        if self.guard.would_force(batch_size):
            return True
        return self.block_guard is not None and self.block_guard.would_force(batch_size) and \
            not self._next_step_block_only(batch_size)

    def _next_step_block_only(self, batch_size: int | None = None) -> bool:
        """Whether the source guard will force the next step (at ``batch_size``; None: the running batch's) to a
        block-only step, which verifies every row's pending block (:meth:`ThroughputGuard.would_force`: no change;
        :meth:`_next_step_forced`'s AR step comes first)."""
        if self.source_guard is None or not self.scheduler.running:
            return False
        if batch_size is None:
            batch_size = max(r.slot for r in self.scheduler.running) + 1
        return self.source_guard.would_force(batch_size)

    def _flush_corpus(self) -> None:
        """Write the finished requests waiting for the device corpus ring (``_commit`` collects them) in one
        :meth:`~adaflash_ray.engine.device_lookup.DeviceLookup.add_sequences`."""
        if self._corpus_pending:
            pending, self._corpus_pending = self._corpus_pending, []
            self.runner.lookup.add_sequences(pending)

    def _schedule(self, spec: bool) -> _Batch:
        """The running requests' γ for this step - the policy's (or the request's own), capped by the tokens left -
        and whether the step proposes the next block (the policy's probe schedule)."""
        _, running, slots, _, batch_size, fixed, any_own = self._running_state()
        n = len(running)
        if spec and self.makespan_lock and not (self.scheduler.waiting or self.num_held) and \
                self._all_locked(running):
            st = self.stats  # drafting ended for every running request: the AR engine's own step
            st.num_makespan_steps += 1
            st.num_plain_steps += 1
            return _Batch(running, [0] * n, True, False, append=False, batch_size=batch_size, slots=slots, plain=True)
        if spec and self.makespan_guard and not any_own and self._makespan_prefers_ar(running, batch_size):
            self.stats.num_makespan_steps += 1
            return _Batch(running, [0] * n, True, False, append=False, batch_size=batch_size, slots=slots)
        if spec and self.guard is not None and not any_own and \
                self.guard.force_ar(batch_size):  # the policy is slower than AR here: AR steps for a while
            self.stats.num_guard_steps += 1
            return _Batch(running, [0] * n, True, False, append=False, batch_size=batch_size, slots=slots)
        if spec and self.planner is not None:
            if self.source_guard is not None and not any_own and self.source_guard.force_ar(batch_size):
                self.stats.num_source_guard_steps += 1  # the plan is slower than the block alone here: a while without
                return self._block_only(running, batch_size, slots)
            return self._plan(running, batch_size, self._block_off(batch_size, any_own), slots=slots, fixed=fixed)
        pending = [r.next_draft_len for r in running]
        if spec and (any_own or any(pending)):  # γ capped by the tokens left - 1 (r.remaining - 1), at least 0
            gammas = [max(min(g if d is None else d, r.params.max_new_tokens - len(r.output_ids) - 1), 0)
                      for r, g, d in zip(running, pending, fixed)]
        else:  # AR mode, or every request pending at γ = 0 (the cost policy's AR regime): no per-request caps
            gammas = [0] * n
        propose = True
        if self.policy is not None:
            propose = self.policy.propose_now(spec, pending, [d is not None for d in fixed])
        # a step that does not propose is an AR step (the cost policy's γ = 0): its drafter context append is
        # deferred and caught up from the feature history when the next step proposes
        return _Batch(running, gammas, spec, propose, append=propose, batch_size=batch_size, slots=slots)

    def _all_locked(self, running: list[Request]) -> bool:
        """Whether every running request is locked out of drafting (``makespan_lock``), remembered per scheduler batch
        version (a lock is only ever set for a whole running batch, and cleared at a drafter reload)."""
        version = self.scheduler.version
        if self._locked_version == version:
            return True
        if all(r.ar_locked for r in running):
            self._locked_version = version
            return True
        return False

    def _block_only(self, running: list[Request], batch_size: int, slots: list[int]) -> _Batch:
        """A step the source guard forces: each row verifies its pending drafter block at the full γ = block_size - 1,
        capped by its tokens left - 1, and the step proposes the next block; no plan, and the step proposes no lookup
        drafts (the device lookup's proposals of these rows go stale: the step's result marks them so). A row without
        a pending block (the planned steps before left the block idle, or its prefill proposed none) verifies its
        lookup proposal instead where it has one - the device lookup's current proposal (``_dev_valid``) or the host
        lookup's, at its length capped likewise (so the step keeps the block's verify width), as a point-mass q
        (lossless as in a planned step) - else γ = 0: the first step of a block-only stretch then commits what the
        lookup drafts give, not one token per row at a propose step's price."""
        g, n = self.drafter.block_size - 1, len(running)
        # per request the largest γ its budget and the block leave: min(block_size - 1, max(r.remaining - 1, 0))
        caps = [min(g, c) if (c := r.params.max_new_tokens - len(r.output_ids) - 1) > 0 else 0 for r in running]
        lens = [c if r.dflash_expected is not None else 0 for r, c in zip(running, caps)]
        idle = [i for i, r in enumerate(running) if r.dflash_expected is None and caps[i]]  # rows without a block
        rows = host = None
        if idle and self.lookup_on_device:  # the proposals the step before made, still on the device
            idx = [slots[i] for i in idle]
            length = np.where(self._dev_valid[idx], self._dev_props[idx, self.runner.max_draft], 0).tolist()
            rows = [False] * n
            for i, k in zip(idle, length):
                if k > 0:
                    lens[i], rows[i] = min(k, caps[i]), True
        elif idle:  # the host lookup, for these rows only
            host = [None] * n
            for i in idle:
                if toks := self._lookup(running[i], caps[i]).tokens:
                    lens[i], host[i] = len(toks), toks
        # the next step forced too (same bucket): it verifies these blocks at the full γ, so no estimate is needed.
        # This step's own AR sample comes first (step() records a block-only step after another one): the one that
        # completes a reference run ends the stretch, so its step needs the head (a step that captures a graph is not
        # recorded: then the head is computed where the stretch goes on - a wasted head, never a missing estimate)
        recorded = n if self._last_regime is False else None
        # (and only once the planner has a recent estimate to stand in for the skipped ones)
        expected = not (self.skip_block_only_estimates and self.planner._block_est is not None
                        and self.source_guard.would_force_after(batch_size, recorded))
        return _Batch(running, lens, True, True, append=True, batch_size=batch_size, slots=slots,
                      host_drafts=host if host is not None and host.count(None) != n else None,
                      lookup_rows=rows if rows is not None and any(rows) else None, expected=expected)

    def _pending_estimate(self) -> list[float]:
        """E[committed | γ] for γ = 1..bs-1 that a block proposed without the acceptance head carries (a block-only
        step's, :meth:`_block_only`): the planner's moving average of its recent blocks' estimates
        (``HybridPlanner._block_est``; :meth:`_block_only` skips no head before there is one - the 1.0 for every γ,
        nothing accepted, is a fallback only). Only read if the forced stretch ends sooner than foreseen (a
        batch-size bucket change, a new batch, a reload) and a planned step meets the block. Kept while the planner's
        estimate is the same list (a block-only stretch records no plan: one list for all its steps and rows)."""
        bs = self.drafter.block_size
        est = self.planner._block_est
        if est is None:
            return [1.0] * (bs - 1)
        kept = self._pending_kept
        if kept is None or kept[0] is not est:
            kept = self._pending_kept = (est, [1.0 + est[min(g, len(est) - 1)] for g in range(1, bs)])
        return kept[1]

    def _running_state(self) -> _Running:
        """The running batch's requests, slots and fixed γ, read again only after the scheduler's batch changed
        (admission, finish, compaction): a request's sampling parameters do not change while it runs."""
        cur, version = self._running, self.scheduler.version
        if cur is not None and cur.version == version:
            return cur
        running = list(self.scheduler.running)
        slots = list(map(_slot_of, running))
        fixed = [r.params.draft_len for r in running]  # a γ the request fixes, else None
        # a slice where the slots are 0..n-1 (views, no gather), else their index array
        rows = slice(0, len(slots)) if slots == list(range(len(slots))) else np.array(slots, dtype=np.int64)
        cur = self._running = _Running(version, running, slots, rows, max(slots) + 1, fixed,
                                       fixed.count(None) != len(running))
        return cur

    def _plan(self, running: list[Request], batch_size: int, block_off: bool = False, *,
              slots: list[int] | None = None, fixed: list[int | None] | None = None) -> _Batch:
        """The draft sources' step: each request's lookup proposal (host; when the planner wants lookups this step),
        then the planner's source and γ per request and whether the step proposes the next DFlash block.
        ``slots`` / ``fixed``: the requests' slots and own γ (None: the planner's), as :meth:`_schedule` has them
        (None: read from the requests)."""
        planner, nd = self.planner, self.runner.max_draft
        if slots is None:
            slots = list(map(_slot_of, running))
        if fixed is None:
            fixed = [r.params.draft_len for r in running]
        # per request the largest γ its budget leaves: max(r.remaining - 1, 0)
        caps = [c if (c := r.params.max_new_tokens - len(r.output_ids) - 1) > 0 else 0 for r in running]
        n = len(running)
        proposals = [None] * n
        lookup_ms = 0.0
        if self.lookup_on_device:
            return self._plan_device(running, caps, batch_size, block_off, slots=slots, fixed=fixed)
        if self.lookup is not None and (planner.lookup_due() or planner.spec_costs is None):
            t0 = time.perf_counter()
            proposals = [self._lookup(r, min(nd, c)) if c > 0 else None for r, c in zip(running, caps)]
            lookup_ms = 1e3 * (time.perf_counter() - t0)
        expected = [r.dflash_expected for r in running]
        choices, propose = planner.plan(batch_size, caps, expected, proposals, fixed,
                                        lookup_ms=lookup_ms, block_off=block_off,
                                        weights=self._drain_weights(running, caps),
                                        **self._request_factors(running))
        host = [c.tokens if c.source not in ("dflash", "none") else None for c in choices]
        return _Batch(running, [c.draft_len for c in choices], True, propose, append=propose, choices=choices,
                      host_drafts=host if host.count(None) != n else None, batch_size=batch_size,
                      blocks=expected.count(None) != n, slots=slots)

    def _plan_device(self, running: list[Request], caps: list[int], batch_size: int, block_off: bool = False, *,
                     slots: list[int] | None = None, fixed: list[int | None] | None = None) -> _Batch:
        """:meth:`_plan` with the device lookup: the proposals the requests' previous steps made (arrays, no
        per-request lookup; no host lookup time to weigh, so ``lookup_ms`` stays 0), and whether this step makes the
        next ones (the planner's lookup schedule)."""
        planner, nd = self.planner, self.runner.max_draft
        n = len(running)
        if slots is None:
            slots = list(map(_slot_of, running))
        if fixed is None:
            fixed = [r.params.draft_len for r in running]
        cur = self._running
        slot_rows = cur.slot_rows if cur is not None and cur.slots is slots else np.array(slots, dtype=np.int64)
        # the running slots' proposals (views of the per-slot arrays where the slots are 0..n-1: the plan reads them
        # before this step's result rewrites them, and keeps none)
        props, valid = self._dev_props[slot_rows], self._dev_valid[slot_rows]
        arrays = LookupArrays(props[:, nd], props[:, nd + 1], props[:, nd + 2], props[:, nd + 3], valid)
        if self.propose_first:
            return self._plan_first(running, caps, batch_size, arrays, slots, fixed)
        expected = [r.dflash_expected for r in running] if self._any_block else [None] * n
        choices, propose = planner.plan(batch_size, caps, expected, [None] * n, fixed, device=arrays,
                                        block_off=block_off, weights=self._drain_weights(running, caps),
                                        **self._request_factors(running))
        lens, rows = planner.plan_rows(choices)  # γ per request; rows verifying the device lookup's drafts (or None)
        return _Batch(running, lens, True, propose, append=propose, choices=choices, lookup_rows=rows,
                      lookup=planner.lookup_due() or planner.spec_costs is None, batch_size=batch_size,
                      blocks=expected.count(None) != n, slots=slots)

    def _plan_first(self, running: list[Request], caps: list[int], batch_size: int, arrays: LookupArrays,
                    slots: list[int], fixed: list[int | None]) -> _Batch:
        """:meth:`_plan_device` under ``propose_first``: every row's block is the recent blocks' mean estimate
        (:meth:`HybridPlanner.block_estimate`), the planner chooses per row between it, the lookup and none, and the
        step proposes its own block when a row verifies it. Every step appends its positions to the drafter context
        (a block then never waits for a catch-up of the positions the lookup-only steps skipped). The first planned
        step, and one after :data:`PROPOSE_FIRST_PROBE` planned steps without a block, verifies the block at the full
        γ in every row (a row's own ``draft_len`` is kept) so that the estimate and its calibration keep learning."""
        planner, n = self.planner, len(running)
        est = planner.block_estimate()
        probe = est is None or (self._pf_since is not None and self._pf_since >= PROPOSE_FIRST_PROBE)
        if est is None:  # no block seen yet: a flat placeholder, only verified through the probe's fixed γ
            est = [1.0] * (self.runner.block_size - 1)
        if probe:
            fixed = [f if f is not None else self.runner.block_size - 1 for f in fixed]
        choices, _ = planner.plan(batch_size, caps, [est] * n, [None] * n, fixed, device=arrays,
                                  weights=self._drain_weights(running, caps),
                                  **self._request_factors(running))
        lens, rows = planner.plan_rows(choices)
        first = any(c.source == "dflash" and g > 0 for c, g in zip(choices, lens))
        self._pf_since = 0 if first else (self._pf_since or 0) + 1
        return _Batch(running, lens, True, False, append=True, choices=choices, lookup_rows=rows, lookup=True,
                      batch_size=batch_size, blocks=False, slots=slots, propose_first=first)

    def _request_factors(self, running: list[Request]) -> dict:
        """Under ``request_calibration``: the planner's ``lookup_factors`` and ``block_factors``, per request
        (accepted + :data:`REQUEST_CAL_PRIOR`) / (estimated + :data:`REQUEST_CAL_PRIOR`) of its lookup drafts and
        of its drafter blocks' drafts so far; each None while no running request has such drafts (every factor 1).
        Empty without it."""
        if not self.request_calibration:
            return {}
        c = REQUEST_CAL_PRIOR
        return {"lookup_factors": [(r.lookup_accepted + c) / (r.lookup_estimated + c) for r in running]
                if any(r.lookup_estimated for r in running) else None,
                "block_factors": [(r.block_accepted + c) / (r.block_estimated + c) for r in running]
                if any(r.block_estimated for r in running) else None}

    def _request_records(self, work, reqs: list[Request], choices: list, acc: list[int]):
        """``work`` (a deferred planner record, or None) followed by the step's per-request lookup records
        (``request_calibration``): each row that verified a lookup's drafts or its drafter block's adds their
        estimate and accepted count to its request's record of that source."""
        def run():
            if work is not None:
                work()
            for req, c, a in zip(reqs, choices, acc):
                if c.draft_len > 0:
                    if c.source in LOOKUP_SOURCES:
                        req.lookup_estimated += c.estimated
                        req.lookup_accepted += a
                    elif c.source == "dflash":
                        req.block_estimated += c.estimated
                        req.block_accepted += a
        return run

    def _makespan_prefers_ar(self, running: list[Request], batch_size: int) -> bool:
        """Under ``makespan_guard``: whether this step at ``batch_size`` is an AR step (the constructor's
        ``makespan_guard``: a back-off's forced step, or a verdict for AR that starts one). False while requests wait
        (queued or held back), in a trial, or while the throughput guard has no AR price at this bucket
        (``ThroughputGuard.step_costs``: too few steps of a kind, or AR's stale) - then, where its prior spared the
        reference, it asks for one (``request_reference``) if AR at the table's ms could win the wave."""
        if self.scheduler.waiting or self.num_held:
            return False
        if self._ms_forced_left > 0:
            self._ms_forced_left -= 1
            return True
        if self._ms_trial < MAKESPAN_TRIAL:
            self._ms_trial += 1
            return False
        costs = self.guard.step_costs(batch_size)
        if costs is None:  # no measured AR price: ask for one only where the table's (optimistic) could lose the wave
            optimistic = self.guard.prior_costs(batch_size)
            if optimistic is not None:
                ar_h, spec_h, _, _ = self._makespan_horizons(running, batch_size, *optimistic)
                if ar_h < (1.0 - MAKESPAN_MARGIN) * spec_h:
                    self.guard.request_reference(batch_size)
            return False
        ar_h, spec_h, known_h, unknown_left = self._makespan_horizons(running, batch_size, *costs)
        if ar_h < (1.0 - MAKESPAN_MARGIN) * spec_h:
            self._ms_forced_left = MAKESPAN_BACKOFF * self._ms_factor - 1  # this step is the back-off's first
            self._ms_factor = min(2 * self._ms_factor, PROBE_MAX_FACTOR)
            # a decisive verdict is taken again right after its back-off; a close one after a trial, and so is one
            # only the history's prior makes decisive (the trial gives the requests without a record their own: else
            # none of them would ever draft, nor join the history) - unless no running request has a record yet and
            # the history decided fewer than MAKESPAN_HISTORY_WAVES waves since it last grew: then it alone decides
            by_history = len(unknown_left) == len(running) and (
                self._ms_wave_counted or self._ms_history_waves < MAKESPAN_HISTORY_WAVES)
            decisive = ar_h < MAKESPAN_DECISIVE * (spec_h if by_history else known_h)
            self._ms_trial = MAKESPAN_TRIAL if decisive else 0
            if decisive and by_history and not self._ms_wave_counted:
                self._ms_history_waves += 1
                self._ms_wave_counted = True
            if decisive and self.makespan_lock and (by_history or all(r.spec_steps for r in running)):
                for r in running:  # their drafting ends (by a record of their own, or the history's): plain steps next
                    r.ar_locked = True
            return True
        self._ms_factor = 1
        return False

    def _makespan_horizons(self, running: list[Request], batch_size: int, ar_ms: float, spec_ms: float,
                           spec_tokens: float) -> tuple[float, float, float, list[int]]:
        """The makespan guard's horizons of the running wave at ``batch_size`` (ms): ``(AR's, drafting's, drafting's
        by the requests' own records alone, the tokens left of the requests without a record)`` for an AR step of
        ``ar_ms``, a drafting step of ``spec_ms`` committing ``spec_tokens`` a row (:meth:`_makespan_prefers_ar`)."""
        prior = DRAIN_PRIOR * max(spec_tokens, 1.0)  # DRAIN_PRIOR pseudo-steps at the bucket's mean tokens per row
        ar_steps, spec_steps = [], []  # per request: its steps left decoding AR / drafting (by its own record)
        unknown_left = []  # the tokens left of the requests without a drafting record
        use_history = len(self._ms_history) >= MAKESPAN_HISTORY_MIN
        for r in running:
            left = r.params.max_new_tokens - len(r.output_ids)
            ar_steps.append(left)
            if use_history and r.spec_steps == 0:
                unknown_left.append(left)
            else:
                spec_steps.append(left * (r.spec_steps + DRAIN_PRIOR) / (r.spec_tokens + prior))
        ar_runs, spec_runs = self._rows_ms(batch_size, len(running), ar_ms, spec_ms)
        # drafting's horizon by the requests' own records (and the bucket's prior)
        known_h = _wave_ms(spec_steps, spec_runs)
        if unknown_left:  # the slowest of n unknown requests at the history's 1 / (n + 1) quantile, the others at
            unknown_left.sort(reverse=True)  # its median; at least 1 token per step
            slow = max(self._ms_history_quantile(len(unknown_left)), 1.0)
            typical = max(self._ms_history_quantile(1), 1.0)
            spec_steps += [unknown_left[0] / slow] + [x / typical for x in unknown_left[1:]]
        return _wave_ms(ar_steps, ar_runs), _wave_ms(spec_steps, spec_runs), known_h, unknown_left

    def _rows_ms(self, batch_size: int, rows_now: int, ar_ms: float, spec_ms: float):
        """``(ar_runs, spec_runs)``: the wall ms of an AR / a drafting step of k running requests as :func:`_wave_ms`
        runs ``(lo, hi, ms)`` over k = 1..``rows_now``, for the makespan guard's horizons: ``ar_ms`` / ``spec_ms``
        (the running ``batch_size``'s averages) in the running bucket; else the throughput guard's moving averages at
        k's bucket where it has them (:meth:`ThroughputGuard.step_costs`), else ``ar_ms`` / ``spec_ms`` scaled by the
        planner's measured cost tables (AR: width 1; drafting: the block's full width) from ``rows_now`` to k, else
        unscaled. The runs (counts of one guard bucket and one table row) are cached per (buckets, table batch
        sizes, ``rows_now``, the running bucket); each is priced once per call."""
        guard, planner = self.guard, self.planner
        tables = planner is not None and planner.spec_costs is not None and bool(planner.batch_sizes)
        bounds, sizes = guard.batch_sizes, (planner.batch_sizes if tables else [])
        now = min(bisect.bisect_left(bounds, batch_size), len(bounds) - 1)
        key = (tuple(bounds), tuple(sizes), rows_now, now)
        runs = self._ms_rows.get(key)
        if runs is None:  # (lo, hi, guard bucket or None for the running one, table row): k in [lo, hi)
            runs = []
            for k in range(1, rows_now + 1):
                i = min(bisect.bisect_left(bounds, k), len(bounds) - 1)
                tag = (None if i == now or k == rows_now else i,
                       min(bisect.bisect_left(sizes, k), len(sizes) - 1) if tables else 0)
                if runs and runs[-1][2:] == tag:
                    runs[-1] = (runs[-1][0], k + 1, *tag)
                else:
                    runs.append((k, k + 1, *tag))
            self._ms_rows[key] = runs
        full = (self.drafter.block_size - 1) if self.drafter is not None else 0
        row_now = min(bisect.bisect_left(sizes, rows_now), len(sizes) - 1) if tables else 0
        ar_runs, spec_runs = [], []
        for lo, hi, i, row in runs:
            a, d = ar_ms, spec_ms
            if i is not None:
                costs = guard.step_costs(bounds[i])
                if costs is not None:
                    a, d = costs[0], costs[1]
                elif tables:
                    a *= float(planner.lookup_costs[row, 0]) / float(planner.lookup_costs[row_now, 0])
                    d *= float(planner.spec_costs[row, full]) / float(planner.spec_costs[row_now, full])
            ar_runs.append((lo, hi, a))
            spec_runs.append((lo, hi, d))
        return ar_runs, spec_runs

    def _ms_history_quantile(self, n: int) -> float:
        """The 1 / (n + 1) quantile of the finished requests' own committed tokens per drafting step (the makespan
        guard's history; not empty): the expected slowest of ``n`` requests drawn like them. Cached until the
        history changes (a value added, or the history cleared)."""
        key = (self._ms_history_added, len(self._ms_history))
        if self._ms_quantile_key != key:
            self._ms_quantile_key, self._ms_quantiles = key, {}
        q = self._ms_quantiles.get(n)
        if q is None:
            q = self._ms_quantiles[n] = float(np.quantile(np.fromiter(self._ms_history, float), 1.0 / (n + 1)))
        return q

    def _drain_weights(self, running: list[Request], caps: list[int]) -> list[float] | None:
        """The planner's per-request weights under ``objective="drain"`` (None: every request 1 - the plain
        objective, one request, or requests waiting: queued, or held back by :meth:`generate`). ``caps``: per request
        its tokens left - 1 (>= 0). A request's expected steps left = tokens left / its committed tokens per step so
        far (``DRAIN_PRIOR`` pseudo-steps of one token each smooth a young request's rate; at least 1); the batch's
        horizon is the largest. A request weighs 0 when its tokens left, decoded one per step, end before ``1 -
        DRAIN_MARGIN`` of that horizon (tokens left counts to ``max_new_tokens``: a stop token may end it sooner).
        The throughput guards still compare whole steps, every row alike."""
        if self.objective != "drain" or len(running) < 2 or self.scheduler.waiting or self.num_held:
            return None
        now = self.num_steps
        left = [c + 1 for c in caps]
        horizon = max(t * (now - r.admitted_step + DRAIN_PRIOR) / max(len(r.output_ids) + DRAIN_PRIOR,
                                                                        now - r.admitted_step + DRAIN_PRIOR)
                      for r, t in zip(running, left))
        cut = (1.0 - DRAIN_MARGIN) * horizon
        weights = [1.0 if t >= cut else 0.0 for t in left]
        if weights.count(0.0):
            self.stats.num_drain_steps += 1
            return weights
        return None

    def _block_off(self, batch_size: int, any_own: bool) -> bool:
        """Whether the block guard keeps this planned step from proposing the drafter's next block (never when a
        request fixes its γ, ``any_own``: that step proposes anyway)."""
        return self.block_guard is not None and not any_own and self.block_guard.force_ar(batch_size)

    def _keep_proposals(self, slots, res: StepResult) -> None:
        """Keep the device lookup's proposals of ``res`` (current for ``slots``: host ints, an ``[n]`` int64 index
        array or a slice of the per-slot arrays' rows; none: not current)."""
        if res.lookup is None:
            self._dev_valid[slots] = False
        else:
            self._dev_props[slots] = res.lookup
            self._dev_valid[slots] = True

    def _lookup(self, req: Request, k: int):
        """The lookup source's proposal of up to ``k`` tokens for ``req``, its index brought up to date first."""
        state, out = req.lookup_state, req.output_ids
        if req.lookup_synced < len(out):
            state.extend(out[req.lookup_synced:])
            req.lookup_synced = len(out)
        return state.propose(k)

    def _run(self, batch: _Batch) -> StepResult:
        """One batched step on the device (verify, accept, propose): one device -> host transfer."""
        reqs = batch.requests
        slots = batch.slots if batch.slots is not None else [r.slot for r in reqs]
        # a running request has committed its prefill's token: its last token is its output's last; its anchor
        # position is num_tokens - 1
        return self.runner.step(slots, [r.output_ids[-1] for r in reqs],
                                [len(r.prompt_ids) + len(r.output_ids) - 1 for r in reqs], batch.draft_lens,
                                batch.spec and not batch.plain,
                                batch.propose, batch.host_drafts, batch.append, batch.lookup_rows, batch.lookup,
                                block_match=batch.blocks, propose_first=batch.propose_first,
                                overlap=self._flush_planner_record if self._planner_record is not None else None,
                                **({} if batch.expected else {"expected": False}),
                                **({"plain": True} if batch.plain else {}))

    def _flush_planner_record(self) -> None:
        """Run the last planned step's deferred planner record, if any (:meth:`HybridPlanner.record_later`)."""
        work, self._planner_record = self._planner_record, None
        if work is not None:
            work()

    def _postprocess(self, batch: _Batch, res: StepResult, finished: list[Request]) -> None:
        """Record each request's step (γ, a, drafter version, draft source), commit its tokens, and tell the policy
        (or the planner, which calibrates its acceptance estimates on the outcome)."""
        reqs, lens, acc, committed = batch.requests, batch.draft_lens, res.num_accepted, res.committed
        n = len(reqs)
        if self.lookup_on_device:
            cur = self._running
            self._keep_proposals(cur.slot_rows if cur is not None and batch.slots is cur.slots else
                                 batch.slots if batch.slots is not None else [r.slot for r in reqs], res)
        planner = self.planner
        if planner is not None:
            if batch.choices is not None:
                # the pending blocks, scored where other drafts were verified (none pending: nothing to score)
                cf = res.block_match is not None and batch.blocks
                # done while the device runs the next step (runner.step's overlap): this step's host time stays short
                self._flush_planner_record()  # one not run yet (none: the step's overlap ran it)
                work = planner.record_later(batch.choices, acc, res.block_match,
                                            [r.dflash_expected for r in reqs] if cf else None,
                                            [r.params.temperature == 0 for r in reqs] if cf else None)
                if self.request_calibration:
                    work = self._request_records(work, reqs, batch.choices, acc)
                self._planner_record = work
        elif self.policy is not None:
            self.policy.after_step(batch.spec, batch.propose, res.next_draft_lens)
        version = self.drafter_version
        spec = batch.spec
        sources = None
        lazy = False  # this γ = 0 step's records join the pending run (flush_records) instead of each row's lists
        if spec:
            zero = batch.plain or not any(lens)  # every row γ = 0 (an AR step of the policy, the planner or the lock)
            if zero:
                sources = ["none"] * n
                if self.lazy_ar_records:
                    if self._ar_reqs is not None and self._ar_version != version:
                        self.flush_records()  # the run's steps had another drafter version
                    if self._ar_reqs is None:  # a new run: every running request joins at its start
                        self._ar_steps, self._ar_version = 0, version
                        self._ar_from = dict.fromkeys(reqs, 0)
                    elif self._ar_reqs is not reqs:  # another batch (admission, finish, compaction): the requests
                        k = self._ar_steps  # admitted since join the run at this step
                        joined = self._ar_from
                        for r in reqs:
                            if r not in joined:
                                joined[r] = k
                    self._ar_reqs = reqs
                    self._ar_steps += 1
                    lazy = True
            elif batch.choices is not None:
                sources = [c.source if g else "none" for c, g in zip(batch.choices, lens)]
            else:  # the block; in a block-only step a row without one may verify its lookup proposal (_block_only)
                look = batch.lookup_rows or batch.host_drafts
                sources = ["dflash" if g else "none" for g in lens] if look is None else \
                    [(planner.lookup if k else "dflash") if g else "none" for g, k in zip(lens, look)]
            if not lazy and self._ar_reqs is not None:
                self.flush_records()
            if zero:
                self.stats.record_ar_steps(n)
            else:
                self.stats.record_steps(lens, acc, sources)
        # rows whose tokens may end the request (its budget: tokens left <= tokens committed now; a stop token) or
        # that carry logprobs commit through _commit; the rest append their tokens here
        stop = self._stop_union
        maybe_stop = bool(stop) and not stop.isdisjoint(chain.from_iterable(committed))
        slow_all = res.logprobs is not None or not self.fast_commit
        if batch.propose_first and res.expected is not None:  # the blocks this step proposed and verified
            planner.note_fresh_blocks(res.expected)
        new_blocks = res.expected if batch.propose else None  # each request's next pending block (planner)
        if planner is not None and batch.propose and not batch.expected:  # proposed without the head's estimates
            new_blocks = [self._pending_estimate()] * n
        # the rows' pending blocks are written unless they are None already and stay None
        set_blocks = planner is not None and (new_blocks is not None or self._any_block)
        if set_blocks and new_blocks is None:
            new_blocks = [None] * n
        self._any_block = set_blocks and batch.propose and (res.expected is not None or not batch.expected)
        steps = sources if spec else lens  # any [n] list: zip's column for the per-step records
        generated = 0
        record = spec and not lazy
        for i, (req, g, a, s, toks, nxt) in enumerate(zip(reqs, lens, acc, steps, committed, res.next_draft_lens)):
            if record:
                req.draft_lens.append(g)
                req.num_accepted.append(a)
                req.step_sources.append(s)
                req.step_versions.append(version)
                if req.first_version is None:
                    req.first_version = version
            req.next_draft_len = nxt
            if set_blocks:
                req.dflash_expected = new_blocks[i]
            out = req.output_ids
            if slow_all or len(toks) >= req.params.max_new_tokens - len(out) or \
                    (maybe_stop and not stop.isdisjoint(toks)):
                self._commit(req, toks, finished, res, i)
            else:
                out += toks
                generated += len(toks)
        self.stats.num_generated += generated

    def _commit(self, req: Request, tokens: list[int], finished: list[Request], res: StepResult | None = None,
                row: int = 0) -> None:
        """Append ``tokens`` (cut after a stop token or at the budget) to the request's output, with their
        log-probabilities from ``res`` (row ``row``) when the request asked for them; finish it if it ended.
        :meth:`_postprocess` appends the tokens of the rows that can neither end nor carry logprobs itself."""
        stop_ids = req.params.stop_token_ids
        reason = None
        if stop_ids:
            stop = set(stop_ids)
            for n, tok in enumerate(tokens):
                if tok in stop:
                    tokens, reason = tokens[: n + 1], "stop"
                    break
        left = req.remaining
        if len(tokens) >= left:
            tokens, reason = tokens[:left], reason or "length"
        if res is not None and res.logprobs is not None and res.logprobs[row] is not None:
            req.output_logprobs.extend(res.logprobs[row][: len(tokens)])
            req.output_top_logprobs.extend(res.top_logprobs[row][: len(tokens)])
        req.output_ids.extend(tokens)
        self.stats.num_generated += len(tokens)
        if reason is not None:
            if self._ar_reqs is not None:  # the finished request's records complete (the others' stay pending)
                self._flush_one(req)
            if self.record and self.record_features:  # positions < num_tokens-1, before the slot is reused
                n = req.num_tokens - 1
                req.features = self.runner.features(req.slot, n).to(torch.bfloat16).cpu()
                req.last_hidden = self.runner.last_hidden(req.slot, n).to(torch.bfloat16).cpu()
            self.scheduler.finish(req, reason)
            finished.append(req)
            if self.lookup_on_device:  # the device corpus ring learns it with the phase's others (_flush_corpus)
                if self.runner.lookup.corpus is not None:
                    self._corpus_pending.append(req.prompt_ids + req.output_ids)
            elif self.lookup is not None:  # a suffix corpus learns the finished sequence (prompt lookup ignores it)
                self.lookup.finish(req.prompt_ids + req.output_ids)
                req.lookup_state = None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 mode: str = "spec", on_step=None, on_finish=None, admit_min: int = 1,
                 stop_admitting=None) -> list[Request]:
        """Run ``prompts`` to completion (continuous batching); returns requests in input order.

        Args:
            prompts: token id lists. params: one :class:`SamplingParams` for every prompt (copied per request), a
                list of one per prompt, or None (the defaults).
            mode: ``"spec"`` or ``"ar"`` (as :meth:`step`).
            on_step: ``on_step(engine)`` is called between steps (e.g. to hot-swap drafter weights).
            on_finish: ``on_finish(request)`` is called for each of these requests as the step that finishes it
                returns (before the next step), e.g. to write its trajectory while the others decode; a request
                aborted from ``on_step`` is not passed.
            admit_min: these requests join the engine's queue only when at least ``min(admit_min, requests not
                yet queued)`` KV slots are free (or nothing is running), so a refill prefills many prompts in one
                batched forward instead of one prompt per finishing request each step; 1 = every request is
                queued at once (each free slot refilled in the next step). The outputs do not depend on it
                (greedy: token for token; sampled: the same distribution, other random draws).
            stop_admitting: polled before each step; once it returns True, the requests not yet queued never
                start: they end with ``finish_reason == "abort"`` and no output (not passed to ``on_finish``) and
                generate returns when the started ones finish - a time limit that costs no drain of a new batch.
        All requests are validated (:meth:`add_request`) before the first step. The host work per step is
        independent of ``len(prompts)`` (the finished requests are counted, not rescanned).
        Raises:
            ValueError: as :meth:`add_request` (the prompts validated before the bad one are aborted, not left
                queued); ``params`` a list of another length; ``admit_min`` < 1.
            Whatever a step, ``on_step`` or ``on_finish`` raised, after aborting these requests (none of them is
            left in the engine's queue or KV slots).
        """
        from collections import deque

        if admit_min < 1:
            raise ValueError(f"admit_min must be >= 1, got {admit_min}")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = [SamplingParams(**vars(p)) for p in params]
        else:
            per_prompt = [SamplingParams(**vars(params)) if params else None for _ in prompts]
        reqs: list[Request] = []
        held: deque[Request] = deque()  # validated, not yet queued (admit_min > 1 or stop_admitting); WAITING
        try:
            for p, sp in zip(prompts, per_prompt):  # a bad prompt: the ones queued before it are aborted below
                reqs.append(self.add_request(p, sp))
            if admit_min > 1 or stop_admitting is not None:
                for _ in reqs:  # ours are the newest in the queue
                    held.appendleft(self.scheduler.waiting.pop())
        except BaseException:
            for req in reqs:
                self.abort(req)
            raise
        mine = {id(r) for r in reqs}
        first_unfinished = 0  # every request before it has finished
        try:
            while True:
                while first_unfinished < len(reqs) and reqs[first_unfinished].status == Status.FINISHED:
                    first_unfinished += 1
                if first_unfinished == len(reqs):
                    self._flush_planner_record()  # the planner's calibration complete when generate returns
                    return reqs
                if held and stop_admitting is not None and stop_admitting():
                    for req in held:
                        req.status, req.finish_reason = Status.FINISHED, "abort"
                    held.clear()
                    continue
                if held:
                    sched = self.scheduler
                    free = len(sched.free_slots) - len(sched.waiting)
                    if free >= min(admit_min, len(held)) or not sched.running:
                        for _ in range(min(max(free, 1), len(held))):
                            sched.waiting.append(held.popleft())
                self.num_held = len(held)  # waiting too, for the drain objective
                for req in self.step(mode):
                    if on_finish is not None and id(req) in mine:
                        on_finish(req)
                if on_step is not None:
                    on_step(self)
        except BaseException:  # a callback or a step raised: none of these requests stays queued or holds a slot
            for req in held:
                req.status, req.finish_reason = Status.FINISHED, "abort"
            for req in reqs:
                try:
                    self.abort(req)
                except Exception:  # noqa: BLE001 - a step that failed half-way may leave a request inconsistent
                    log.warning("generate: could not abort request %s after a failure", req.request_id)
            raise
        finally:
            self.num_held = 0

    # ------------------------------------------------------------------ trajectories
    def to_trajectory(self, req: Request) -> Trajectory:
        """Build the on-policy record of a finished request (needs ``record=True``)."""
        if not self.record:
            raise RuntimeError("engine was built with record=False")
        if req.status != Status.FINISHED or (self.record_features and req.features is None):
            raise RuntimeError(f"request {req.request_id} has not finished (or was aborted: no features)")
        feats, hid = req.features, req.last_hidden
        traj = Trajectory(request_id=req.request_id,
                          token_ids=torch.tensor(req.prompt_ids + req.output_ids, dtype=torch.long),
                          prompt_len=len(req.prompt_ids), features=feats, last_hidden=hid,
                          drafter_version=req.first_version if req.first_version is not None else self.drafter_version,
                          draft_lens=np.asarray(req.draft_lens, np.int16),
                          num_accepted=np.asarray(req.num_accepted, np.int16),
                          step_versions=np.asarray(req.step_versions, np.int32))
        traj.validate()
        return traj

    # ------------------------------------------------------------------ hot reload
    def drafter_tensors(self) -> dict[str, torch.Tensor]:
        """Current drafter (+ length head under ``length_head.``) weights, checkpoint names."""
        out = dict(self.drafter.drafter_state_dict())
        if self.length_head is not None:
            out.update({f"length_head.{k}": v.detach() for k, v in self.length_head.state_dict().items()})
        return out

    @torch.no_grad()
    def load_drafter(self, tensors: dict[str, torch.Tensor], version: int, sha256: str | None = None,
                     config: DrafterModelConfig | None = None, *, rollback: bool = False) -> str:
        """Swap in new drafter weights between steps; running requests continue.

        The new values are copied into the existing parameters (so captured CUDA graphs see them) and
        every running request's drafter context is recomputed from its feature history. Returns the
        sha256. Versions only rise: the first published version (0 included) may equal the engine's
        initial version, every later one must be greater, unless ``rollback=True`` names an older one
        explicitly (the τ canary's roll back).

        Raises:
            CheckpointError: the version does not rise (without ``rollback``), the config does not fit
                the target (vocabulary, width, layers), tensors are missing / mis-shaped / non-finite,
                or the sha256 does not match. The old drafter stays loaded.
        """
        if self.drafter is None:
            raise CheckpointError("engine has no drafter to reload")
        if not rollback and not is_newer(version, self.drafter_version, current_published=self.num_reloads > 0):
            raise CheckpointError(f"drafter version {version} refused: the engine serves version "
                                  f"{self.drafter_version} (versions must rise; pass rollback=True to return to an "
                                  "older one)")
        if config is not None:
            try:
                config.check_target(self.target.config)
            except ValueError as e:
                raise CheckpointError(str(e)) from e
            mine = self.drafter.config
            if (config.block_size, config.target_layer_ids, config.num_hidden_layers) != \
                    (mine.block_size, mine.target_layer_ids, mine.num_hidden_layers):
                raise CheckpointError("drafter architecture differs from the loaded one (block_size, "
                                      "target_layer_ids or num_hidden_layers); restart the worker to change it")
        current = self.drafter_tensors()
        if self.length_head is None:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("length_head.")}
        elif not any(k.startswith("length_head.") for k in tensors):
            current = {k: v for k, v in current.items() if not k.startswith("length_head.")}
        check_tensors_fit(current, tensors, f"drafter version {version}")
        # the loaded values are the incoming ones when every tensor lands in an equal or wider float dtype and
        # nothing of the engine's is left out (a head-less publication keeps the engine's head): then the one
        # hash of the incoming tensors names the loaded drafter too (tensors_sha256 hashes values, not storage)
        faithful = len(current) == len(self.drafter_tensors()) and all(
            _widens(tensors[name].dtype, dst.dtype) for name, dst in current.items())
        digest = tensors_sha256(tensors) if sha256 is not None or faithful else None
        if sha256 is not None and digest != sha256:
            raise CheckpointError(f"drafter version {version}: sha256 mismatch ({digest[:12]} != {sha256[:12]})")
        for name, dst in current.items():
            dst.copy_(tensors[name].to(dst.dtype))
        self.drafter_version = version
        self.drafter_sha256 = digest if faithful else tensors_sha256(self.drafter_tensors())
        self.num_reloads += 1
        for req in self.scheduler.running:
            self.runner.rebuild_context(req.slot, req.num_tokens - 1)
        self.policy.on_drafter_reload()
        if self.planner is not None:
            self._flush_planner_record()  # the last step's outcome, recorded before the reset as without deferral
            self.planner.reset()
        if self.guard is not None:
            self.guard.on_drafter_reload()
        # the makespan guard's verdicts and the requests' drafting records measured the old drafter
        self._ms_forced_left, self._ms_factor, self._ms_trial = 0, 1, 0
        self._ms_history.clear()
        self._ms_history_waves = 0
        for r in self.scheduler.running:
            r.spec_steps = r.spec_tokens = 0
            r.ar_locked = False  # the lock was the old drafter's verdict (their histories now lack its plain steps)
        self._locked_version = None
        if self.block_guard is not None:
            self.block_guard.on_drafter_reload()
            self._last_planned_propose = None  # the next step's pending block is the old drafter's
        if self.source_guard is not None:  # its block-only steps' record measured the old drafter too
            self.source_guard.on_drafter_reload(reference=True)
            self._last_regime = None
        return self.drafter_sha256

    # ------------------------------------------------------------------ timing (benchmarks)
    def time_verify(self, batch_size: int, width: int, num_iters: int = 20, context_len: int = 128) -> float:
        """Median ms of one target verify forward (``batch_size`` x ``width`` after ``context_len`` tokens),
        through a CUDA graph on GPU. For benchmarks on an idle engine (overwrites slot contents)."""
        self.drain()
        self._check_timing_args(batch_size, width, context_len)
        return self.runner.time_verify(batch_size, width, context_len, num_iters)

    def time_propose(self, batch_size: int, num_iters: int = 20, context_len: int = 128) -> float:
        """Median ms of one drafter propose (one block of block_size) + the length policy."""
        self.drain()
        if self.drafter is None:
            raise ValueError("engine has no drafter")
        self._check_timing_args(batch_size, self.drafter.block_size, context_len)
        return self.runner.time_propose(batch_size, context_len, num_iters)

    def precapture_graphs(self, max_seconds: float | None = None) -> dict:
        """Capture, ahead of use, the CUDA step graphs of every shape this engine may meet next
        (:meth:`ModelRunner.graph_grid` of the kinds of step it has run: each at every batch bucket, width bucket and
        span), so an adaptive engine - whose widths and batch buckets move from step to step - does not capture them
        inside a step later (a kind of step it never ran is still captured on first use); then, with a drafter, the
        drafter-context catch-up graphs of every padded size up to 8,192 positions or the runner's slots x
        ``max_seq_len`` (:meth:`ModelRunner.precapture_catch_up`; none before a context append has run). Call between
        steps (e.g. after a warm-up run); a no-op without CUDA graphs; stops after ``max_seconds`` or at a failed
        capture (:meth:`ModelRunner.precapture`). Returns
        ``{"graphs": step graphs captured now, "grid": the shapes it covers, "catch_up_graphs": catch-up graphs
        captured now, "seconds": wall time, "stopped": why it stopped early or None, "uploaded": graphs of the runner
        uploaded at capture so far (:attr:`ModelRunner.num_uploaded`: 0 where uploads are not available)}``."""
        self.drain()
        t0 = time.perf_counter()
        grid = self.runner.graph_grid()
        n, why = self.runner.precapture(grid, max_seconds)
        n_cu = 0
        if why is None:
            left = None if max_seconds is None else max(0.0, max_seconds - (time.perf_counter() - t0))
            n_cu, why = self.runner.precapture_catch_up(max_seconds=left)
        return {"graphs": n, "grid": len(grid), "catch_up_graphs": n_cu, "seconds": round(time.perf_counter() - t0, 3),
                "stopped": why, "uploaded": self.runner.num_uploaded}

    @torch.no_grad()
    def calibrate_costs(self, batch_sizes: list[int] | None = None, context_len: int | None = None,
                        num_iters: int = 5, lock_timeout_s: float = 600.0) -> dict:
        """Measure the ``cost`` policy's step cost ``t(B, γ)`` on this engine's hardware and hand it to the policy.

        ``t(B, γ)`` = least wall-clock ms over ``num_iters`` runs of one whole engine step at batch B that verifies
        γ drafts (width γ+1) and proposes the next block (:meth:`ModelRunner.time_step`: CUDA graphs on GPU as the
        engine steps, plus the step's host work and its device -> host transfer, which is the same for every γ and
        so makes long blocks relatively cheaper than graph time alone says). ``t_AR(B)`` = the same for an AR step
        (width 1, no propose), the cost of the policy's γ = 0. Widths are measured on the engine's width buckets
        (GPU: the step pads to them, so this is exact) or on a grid of widths rounded up (CPU). Each row goes through
        :func:`monotone_costs`. Least, not median, and the lower envelope: other processes on the
        same GPU (several inference workers share one) and timer noise only ever add time, and one slowed width
        must not make every longer γ look dear. The timing runs under :func:`device_lock_path`'s lock (waiting up
        to ``lock_timeout_s``), so engines sharing the device calibrate one after another (timed at once, each one's
        longer widths read the others' work). Call on an idle engine: it overwrites the KV slots.
        Returns ``{"batch_sizes", "costs_ms" [len(batch_sizes)][bs-1], "ar_costs_ms" [len(batch_sizes)],
        "context_len"}`` (also kept as ``self.cost_table``).
        Raises:
            ValueError: the policy is not ``cost``, or a batch size is outside [1, max_batch_size].
            filelock.Timeout: another engine held the device's lock for over ``lock_timeout_s``.
        """
        self.drain()
        if not isinstance(self.policy, CostLength):
            raise ValueError(f"calibrate_costs needs the cost policy, not {getattr(self.policy, 'name', None)!r}")
        runner, bs = self.runner, self.drafter.block_size
        if batch_sizes is None:  # the engine's batch buckets (on CPU too: the table needs only a few rows)
            batch_sizes = _buckets(runner.num_slots)
        ctx = context_len if context_len is not None else max(0, min(128, self.max_seq_len - 2 * bs - 1))
        grid = runner._width_buckets  # the step pads its verify width to these on GPU
        for b in batch_sizes:
            self._check_timing_args(b, bs, ctx)
        rows, ar_rows, lookup_rows = [], [], []
        pol = self.policy
        before = (pol.batch_sizes, pol.costs, pol.ar_costs)
        # is_singleton: one lock object per path in this process, so a nested calibration re-enters it
        with FileLock(device_lock_path(runner.device), timeout=lock_timeout_s, is_singleton=True):
            try:
                # a provisional table (new tensors; the old ones stay as they were), so the timed proposes run the
                # acceptance head as the real steps will
                pol.costs = pol.ar_costs = None
                pol.set_costs(list(batch_sizes), torch.ones(len(batch_sizes), bs - 1), torch.ones(len(batch_sizes)))
                spec_widths = sorted({min(w, bs) for w in grid if w >= 2})
                lookup_widths = [w for w in grid if w >= 2] if self.planner is not None and \
                    self.planner.lookup is not None else []
                for b in batch_sizes:
                    # an AR step appends no drafter context (deferred: caught up when a step proposes again)
                    dl = self.lookup_on_device  # every step of a device-lookup engine proposes lookups too
                    ar_rows.append(runner.time_step(b, 0, ctx, num_iters, reduce="min", propose=False, append=False,
                                                    lookup=dl))
                    step = {w: runner.time_step(b, w - 1, ctx, num_iters, reduce="min", lookup=dl)
                            for w in spec_widths}
                    rows.append([step[min(w for w in step if w >= g + 1)] for g in range(1, bs)])
                    if lookup_widths:  # lookup drafts only: no propose, no context append
                        look = {w: runner.time_step(b, w - 1, ctx, num_iters, reduce="min", propose=False,
                                                    host_drafts=True, append=False, lookup=dl) for w in lookup_widths}
                        look[1] = ar_rows[-1]
                        lookup_rows.append([look[min(w for w in look if w >= g)] for g in
                                            range(1, runner.max_draft + 2)])
            except BaseException:  # timing failed: the table in use before stays in use
                pol.batch_sizes, pol.costs, pol.ar_costs = before
                runner.reset_graphs()  # the timing steps' graphs read the provisional tensors
                raise
        table = {"batch_sizes": list(batch_sizes), "costs_ms": rows, "ar_costs_ms": ar_rows, "context_len": ctx}
        if lookup_rows:
            table["lookup_costs_ms"] = lookup_rows
        # the timing steps' graphs read the provisional table: set_cost_table drops them
        table = self.set_cost_table(table)
        if runner.is_cuda:  # the timing graphs' memory: back to the device for the engines beside this one
            torch.cuda.empty_cache()
        return table

    def set_cost_table(self, table: dict) -> dict:
        """Hand a step cost table to the ``cost`` policy, the planner and the guards, as :meth:`calibrate_costs` does
        with the one it measures - e.g. a table measured on another machine (``adaflash_ray.engine.sim_clock``).

        ``table``: ``{"batch_sizes": [nb] strictly increasing ints in [1, max_batch_size], "costs_ms": [nb][bs-1]
        (a step verifying γ = 1..bs-1 drafts that proposes the next block), "ar_costs_ms": [nb] (an AR step),
        "context_len": int, optional "lookup_costs_ms": [nb][max_draft + 1] (a step of width 1..max_draft + 1
        without a propose; the planner's lookup table)}``, milliseconds. Each row of ``costs_ms`` and
        ``lookup_costs_ms`` goes through :func:`monotone_costs`; without ``lookup_costs_ms`` the planner's lookup
        table is the AR cost then the spec row (flat past the block). The captured step graphs are dropped (they
        read the old table). Returns the table as set (also ``self.cost_table``).
        Raises:
            ValueError: the policy is not ``cost``, a batch size is outside [1, max_batch_size], or a shape or a cost
                is wrong (the policy's and the planner's ``set_costs``)."""
        if not isinstance(self.policy, CostLength):
            raise ValueError(f"set_cost_table needs the cost policy, not {getattr(self.policy, 'name', None)!r}")
        runner, bs = self.runner, self.drafter.block_size
        try:
            batch_sizes = [int(b) for b in table["batch_sizes"]]
            rows = monotone_costs(torch.tensor(table["costs_ms"])).tolist()
            ar_rows = [float(a) for a in table["ar_costs_ms"]]
            lookup_rows = table.get("lookup_costs_ms")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a cost table needs batch_sizes, costs_ms and ar_costs_ms: {e!r}") from e
        if not batch_sizes or min(batch_sizes) < 1 or max(batch_sizes) > runner.num_slots:
            raise ValueError(f"cost table batch sizes {batch_sizes} must lie in [1, {runner.num_slots}] "
                             f"(max_batch_size)")
        self.policy.set_costs(batch_sizes, torch.tensor(rows), torch.tensor(ar_rows))
        if self.planner is not None:  # lookup-only steps: the lookup table; without a lookup source, AR and spec only
            lookup_rows = monotone_costs(torch.tensor(lookup_rows)).tolist() if lookup_rows \
                else [[a] + r + [r[-1]] * (runner.max_draft + 1 - bs) for a, r in zip(ar_rows, rows)]
            self.planner.set_costs(batch_sizes, rows, lookup_rows)
        runner.reset_graphs()
        self.cost_table = {"batch_sizes": batch_sizes, "costs_ms": rows, "ar_costs_ms": ar_rows,
                           "context_len": table.get("context_len")}
        for guard in (self.guard, self.block_guard, self.source_guard):  # the guards' buckets: the table's batch sizes
            if guard is not None:
                guard.set_buckets(batch_sizes)
        self._guard_prior(ar_rows)
        if self.planner is not None:
            self.cost_table["lookup_costs_ms"] = lookup_rows
        return self.cost_table

    def _guard_prior(self, ar_ms: list[float]) -> None:
        """The throughput guard's prior (:meth:`ThroughputGuard.set_prior`): a cost table's AR costs per bucket of the
        guard, so no AR reference is forced where drafting is far ahead - unless ``ADAFLASH_AR_PRIOR=0``. The makespan
        guard prices AR by measured steps only (``ThroughputGuard.step_costs``); where the prior spared them it asks
        for a reference (``request_reference``) only if the wave could lose to AR at the table's AR price, which runs
        below the realised one (:meth:`_makespan_prefers_ar`). Call after the guard's buckets were set (they drop the
        prior)."""
        if self.guard is not None and self.ar_prior:
            self.guard.set_prior(ar_ms)

    def _check_timing_args(self, batch_size: int, width: int, context_len: int) -> None:
        if not 1 <= batch_size <= self.runner.num_slots:
            raise ValueError(f"batch_size must be in [1, {self.runner.num_slots}] (max_batch_size), got {batch_size}")
        if context_len + width + self.runner.block_size > self.max_seq_len:
            raise ValueError(f"context_len {context_len} + width {width} does not fit max_seq_len {self.max_seq_len}")
