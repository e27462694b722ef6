"""Where an engine decode step's wall time goes, per method and batch size, phase by phase and by step kind.

Random weights of a real shape (no checkpoint needed), so acceptance is meaningless; the point is the host time each
method adds. Every step of a timed run (after a warm-up run of the same requests, which captures the CUDA graphs
the timed runs need) is split into ``admit`` (SpecEngine._admit: admission, prefill), ``schedule`` (_schedule:
policy / planner / lookups / throughput guard), ``runner_pre`` (the host work before the forward: the step's inputs,
catch-up checks), ``launch`` (ModelRunner._run: the graph launch on CUDA, the whole forward on CPU), ``wait_post``
(the wait for the device and the result's unpacking), ``postprocess`` (_postprocess: stats, commits), ``rest``
(step()'s own bookkeeping: step kind, stats, guard record) and ``host`` (the whole step minus ``launch``). With
``--sync`` a device synchronisation follows the forward, so its device time stays inside ``launch`` and ``host`` is
host work only (on CPU it is anyway); without it the device time mostly lands in ``wait_post``. The per-phase means
are over all of a run's steps, so ``admit`` and ``host`` carry the batch's prefill (the first step's).

Methods (``--methods``):
  ar             an engine without a drafter, ``mode="ar"`` (the bench's ``ar``)
  gamma0         the ``cost`` policy with a cost table under which drafting never pays, throughput guard off: every
                 step is the policy's γ = 0, and its probe schedule runs
  cost           the same with the guard on: its γ = 0 steps, probes and guard-forced steps apart
  dflash         the drafter's whole block every step (``fixed`` policy, γ = block size - 1)
  ngram, suffix  a lookup draft source alone (``fixed`` policy, no drafter), where ``lookup_device="auto"`` puts it
                 (the device on CUDA, the host on CPU)
  suffix-device  ``suffix`` with the lookups on the device (what the bench runs on CUDA; on CPU its host phases)
  hybrid-host, hybrid-device
                 ``draft_sources=("dflash", "suffix")`` with the lookups on the host / on the device, the cost and
                 lookup tables set so that neither pays: the planner's γ = 0 steps
  lock           ``cost`` with the makespan guard and its lock, the finished requests' history one token per
                 drafting step: each timed run's wave is locked at its first step, every later step the plain AR
                 step (once the warm-up run gave the throughput guard its samples of both kinds of step: enough
                 ``--new-tokens``; the default's do)

Per (method, batch) it prints the step's mean ms and per-phase ms with τ and the steps that proposed, the engine's
own split by step kind (SpecStats.timing: count x mean wall ms of ar / gamma0 / probe / draft steps, the catch-ups
inside them, the prefills) and µs per step per phase by step kind (``-admit``: a step that admitted and prefilled
requests, ``-forced``: a step the guard forced to AR, ``-capture``: a step that captured a CUDA graph); then each
method's γ = 0 host time against the AR step's at the same batch. The last stdout line is one JSON document (per
row: ``<phase>_ms`` per step, ``by_kind_us``, ``step_timing``). Repeats reduce to the fastest run (``--reduce min``)
or to the field-wise median of the runs (``--reduce median``).

    PYTHONPATH=. python scripts/profile_step_phases.py --shape tiny --batch 1 8 --new-tokens 64   # CPU, seconds
    python scripts/profile_step_phases.py --shape smollm2-135m --batch 1 64 --new-tokens 256     # CUDA, 5 methods
    python scripts/profile_step_phases.py --methods ar cost hybrid-host hybrid-device --sync      # CUDA, γ = 0 host
    PYTHONPATH=. python scripts/profile_step_phases.py --shape tiny --batch 1 8 --methods ar cost --cprofile cost
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from adaflash_ray.config import LengthHeadConfig
from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats
from adaflash_ray.engine.engine import MAKESPAN_HISTORY_MIN
from adaflash_ray.engine.length_policy import length_policy
from adaflash_ray.engine.runner import _buckets
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config
from adaflash_ray.step_profile import kernel_run

METHODS = ("ar", "gamma0", "cost", "dflash", "ngram", "suffix", "suffix-device", "hybrid-host", "hybrid-device",
           "lock")
DEFAULT_METHODS = ("ar", "gamma0", "dflash", "ngram", "suffix")
TIMED = ("admit", "schedule", "runner_pre", "launch", "wait_post", "postprocess")  # wrapped calls
PHASES = (*TIMED, "rest", "host")


def _engine(method: str, target, drafter, head, batch: int, seq: int) -> SpecEngine:
    kw = dict(max_batch_size=batch, max_seq_len=seq, calibrate=False)
    if method == "ar":
        return SpecEngine(target, None, None, policy="fixed", **kw)
    if method in ("ngram", "suffix"):
        return SpecEngine(target, None, None, policy="fixed", draft_sources=(method,), **kw)
    if method == "suffix-device":
        return SpecEngine(target, None, None, policy="fixed", draft_sources=("suffix",), lookup_device="device", **kw)
    if method == "dflash":
        return SpecEngine(target, drafter, None, policy="fixed", **kw)
    sources = ("dflash", "suffix") if method.startswith("hybrid") else None
    where = "device" if method == "hybrid-device" else "host"
    lock = method == "lock"
    eng = SpecEngine(target, drafter, head, policy="cost", ar_steps=True, throughput_guard=method != "gamma0",
                     draft_sources=sources, lookup_device=where, makespan_guard=lock, makespan_lock=lock, **kw)
    return drafting_never_pays(eng, batch)


def drafting_never_pays(eng: SpecEngine, batch: int) -> SpecEngine:
    """Set ``eng``'s (``cost`` policy) tables so that drafting never pays at any bucket up to ``batch`` rows, nor do
    lookups; with the makespan lock, seed the finished requests' history at one token per drafting step (as the
    makespan tests do): AR's verdict, and the lock, from a wave's first step. Returns ``eng``."""
    bs, nb = _buckets(batch), eng.drafter.block_size - 1
    eng.policy.set_costs(bs, torch.full((len(bs), nb), 1e4), torch.ones(len(bs)))  # drafting never pays
    if eng.planner is not None:  # nor do lookups: width 1 (the AR step) costs 1 ms, every wider step 1e4
        eng.planner.set_costs(bs, [[1e4] * nb] * len(bs), [[1.0] + [1e4] * eng.runner.max_draft] * len(bs))
    if eng.guard is not None:
        eng.guard.set_buckets(bs)
        eng._guard_prior([1.0] * len(bs))  # the AR costs as the guard's prior, as set_cost_table sets it
    if eng.makespan_lock:  # a history of one token per drafting step: AR's verdict from step 1
        eng._ms_history.extend([1.0] * MAKESPAN_HISTORY_MIN)
        eng._ms_history_added += MAKESPAN_HISTORY_MIN
    return eng


class _Timer:
    """Times each step of ``eng`` per phase: perf_counter pairs around its _admit, _schedule, _run, _postprocess and
    its runner's _run (instance attributes over the methods; :meth:`detach` removes them). ``steps``: one dict of
    seconds per step (:data:`PHASES`, ``kind``, ``propose``)."""

    def __init__(self, eng: SpecEngine, sync: bool):
        self.eng, self.cur, self.steps = eng, {}, []
        clock = time.perf_counter
        sync_fn = torch.cuda.synchronize if sync and eng.runner.is_cuda else None
        e_run, r_run = eng._run, eng.runner._run
        marks = {}

        def timed(name, fn):
            def inner(*a, **k):
                t0 = clock()
                out = fn(*a, **k)
                self.cur[name] += clock() - t0
                return out
            return inner

        def run(batch):
            self.cur["propose"] = bool(batch.spec and batch.propose)
            marks["run"] = clock()
            out = e_run(batch)
            self.cur["wait_post"] += clock() - marks["launched"]
            return out

        def forward(key):
            t0 = clock()
            self.cur["runner_pre"] += t0 - marks["run"]
            r_run(key)
            if sync_fn is not None:
                sync_fn()
            marks["launched"] = clock()
            self.cur["launch"] += marks["launched"] - t0

        eng._admit, eng._schedule = timed("admit", eng._admit), timed("schedule", eng._schedule)
        eng._run, eng._postprocess = run, timed("postprocess", eng._postprocess)
        eng.runner._run = forward

    def detach(self) -> None:
        for name in ("_admit", "_schedule", "_run", "_postprocess"):
            self.eng.__dict__.pop(name, None)
        self.eng.runner.__dict__.pop("_run", None)

    def step(self, mode: str) -> None:
        eng, st = self.eng, self.eng.stats
        self.cur = {**dict.fromkeys(TIMED, 0.0), "propose": False}
        before, forced, prefills = dict(st.kind_steps), st.num_guard_steps, st.num_prefills
        t0 = time.perf_counter()
        eng.step(mode)
        total = time.perf_counter() - t0
        kinds = [k for k, v in st.kind_steps.items() if v != before.get(k, 0)]
        if not kinds:  # no decode step (nothing running)
            return
        c = self.cur
        kind = kinds[0] + ("-admit" if st.num_prefills != prefills else "") + \
            ("-forced" if st.num_guard_steps != forced else "") + ("-capture" if eng.runner.step_captured else "")
        run = c["runner_pre"] + c["launch"] + c["wait_post"]
        self.steps.append({**c, "kind": kind, "rest": total - c["admit"] - c["schedule"] - run - c["postprocess"],
                           "host": total - c["launch"]})

    def run(self, prompts: list[list[int]], params: SamplingParams, mode: str) -> list[dict]:
        """Every prompt to completion (each step timed); the steps' dicts."""
        self.steps = []
        for p in prompts:
            self.eng.add_request(p, SamplingParams(**vars(params)))
        while self.eng.has_unfinished():
            self.step(mode)
        return self.steps


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _row(method: str, batch: int, stats: SpecStats, steps: list[dict], spec: bool) -> dict:
    n = stats.num_engine_steps
    by: dict[str, list[dict]] = {}
    for s in steps:
        by.setdefault(s["kind"], []).append(s)
    run = [s["runner_pre"] + s["launch"] + s["wait_post"] for s in steps]
    prop = [r for r, s in zip(run, steps) if s["propose"]]
    return {"method": method, "batch": batch, "ms_per_step": 1e3 * stats.decode_seconds / n, "steps": n,
            "tau": stats.accept_len if spec else 1.0,
            **{f"{p}_ms": 1e3 * _mean(s[p] for s in steps) for p in PHASES},
            "propose_steps": len(prop), "propose_step_run_ms": 1e3 * _mean(prop),
            "plain_step_run_ms": 1e3 * _mean(r for r, s in zip(run, steps) if not s["propose"]),
            "by_kind_us": {k: {"count": len(ss), **{p: 1e6 * _mean(s[p] for s in ss) for p in PHASES}}
                           for k, ss in sorted(by.items(), key=lambda kv: -len(kv[1]))},
            "gamma_hist": {str(k): v for k, v in sorted(stats.draft_len_hist.items())},
            "step_timing": stats.timing()}


def _median(values: list):
    """Field-wise median of JSON-like values (dicts: per key over the runs that have it; None and strings: the
    first run's)."""
    v0 = values[0]
    if isinstance(v0, dict):
        return {k: _median([v[k] for v in values if k in v]) for k in dict.fromkeys(k for v in values for k in v)}
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return v0
    m = statistics.median(nums)
    return int(m) if all(isinstance(v, int) for v in nums) else m


def profile(method: str, target, drafter, head, batch: int, ns) -> dict:
    """The row of ``method`` at ``batch``: ``ns.repeats`` timed runs after a warm-up run, reduced by ``ns.reduce``."""
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, vocab, (ns.prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(max_new_tokens=ns.new_tokens, ignore_eos=True)
    eng = _engine(method, target, drafter, head, batch, ns.prompt_len + ns.new_tokens + 64)
    mode = "ar" if method == "ar" else "spec"
    eng.generate(prompts, sp, mode=mode)  # warm-up: captures the graphs of the shapes it met
    if eng.runner.is_cuda and not ns.no_precapture:  # and every shape the timed runs may meet, as the bench does
        print(f"  {method} b={batch} precapture: {eng.precapture_graphs(120.0)}", flush=True)
    timer = _Timer(eng, ns.sync)
    prof = cProfile.Profile() if method in ns.cprofile else None
    rows = []
    for _ in range(ns.repeats):
        eng.stats = SpecStats()
        if method == "lock":  # the history alone decides a few waves only (MAKESPAN_HISTORY_WAVES): every run one
            eng._ms_history_waves = 0
        if eng.runner.is_cuda:
            torch.cuda.synchronize()
        if prof is not None:
            prof.enable()
        steps = timer.run(prompts, sp, mode)
        if prof is not None:
            prof.disable()
        rows.append(_row(method, batch, eng.stats, steps, mode == "spec"))
    timer.detach()
    if ns.kernels:
        _kernel_table(method, batch, eng, prompts, sp, mode)
    if prof is not None:
        print(f"--- cProfile {method} b={batch} (all timed steps, tottime) ---")
        restrict = (ns.cprofile_match, 40) if ns.cprofile_match else (25,)
        pstats.Stats(prof).sort_stats("tottime").print_stats(*restrict)
    return min(rows, key=lambda r: r["ms_per_step"]) if ns.reduce == "min" else _median(rows)


def _kernel_table(method: str, batch: int, eng: SpecEngine, prompts, sp, mode: str, top: int = 30) -> None:
    """One more run of the same requests under torch.profiler (:func:`adaflash_ray.step_profile.kernel_run`): per
    decode step, the device kernels (CUDA: the kernels the captured graphs replay; CPU: the outermost aten ops) by
    count and microseconds, the largest first."""
    k = kernel_run(eng, prompts, sp, mode, top)
    print(f"--- kernels {method} b={batch}: {k['per_step']:.1f} per step, {k['us_per_step']:.1f} us per step "
          f"({k['num_steps']} steps, prefills included) ---")
    for name, count, us in k["top"]:
        print(f"    {count:7.2f} x  {us:8.2f} us  {name[:110]}")


def _print_row(r: dict) -> None:
    print(f"{r['method']:13s} b={r['batch']:<3d} {r['ms_per_step']:6.3f} ms/step  admit {r['admit_ms']:.3f} "
          f"sched {r['schedule_ms']:.3f} pre {r['runner_pre_ms']:.3f} launch {r['launch_ms']:.3f} "
          f"wait+post {r['wait_post_ms']:.3f} post {r['postprocess_ms']:.3f} rest {r['rest_ms']:.3f} "
          f"host {r['host_ms']:.3f}  tau {r['tau']:.2f}  propose steps {r['propose_steps']} "
          f"({r['propose_step_run_ms']:.3f} ms run vs {r['plain_step_run_ms']:.3f})", flush=True)
    tm = r["step_timing"]
    kinds = "  ".join(f"{k} {v['count']} x {v['mean_ms']:.3f}" for k, v in tm["steps"].items())
    cu, pf = tm["catch_up"], tm["prefill"]
    print(f"    engine kinds (ms): {kinds}  | catch-up {cu['count']} ({cu['num_positions']} pos, "
          f"{cu['total_ms']:.3f} ms host)  prefill {pf['count']} x {pf['mean_ms'] or 0:.3f} ms", flush=True)
    for kind, k in r["by_kind_us"].items():
        print(f"    {kind:15s} n={k['count']:<4d} host {k['host']:7.1f} us  "
              + "  ".join(f"{p} {k[p]:6.1f}" for p in PHASES[:-1]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="a shapes.shape_config name (tiny: CPU)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--methods", "--modes", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS, metavar="METHOD",
                   help=f"of {', '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per method and batch (after one warm-up)")
    p.add_argument("--no-precapture", action="store_true",
                   help="leave the graphs of shapes the warm-up did not meet to be captured in the timed runs")
    p.add_argument("--reduce", default="min", choices=("min", "median"),
                   help="the repeats' row: the fastest run's, or the field-wise median")
    p.add_argument("--sync", action="store_true",
                   help="synchronise the device after each forward (CUDA): launch holds the device time, host is "
                        "host work only")
    p.add_argument("--cprofile-match", default=None, metavar="REGEX",
                   help="with --cprofile: only the functions whose 'file:line(name)' matches (e.g. 'engine/' for the "
                        "engine's host code apart from the models' device work on CPU), the 40 costliest")
    p.add_argument("--cprofile", nargs="*", default=[], choices=METHODS, metavar="METHOD",
                   help="methods whose timed runs also run under cProfile (their times then carry its overhead)")
    p.add_argument("--kernels", action="store_true",
                   help="after the timed runs, one run under torch.profiler: kernels per step by count and time")
    ns = p.parse_args()
    torch.set_num_threads(1)  # host timings free of an intra-op thread pool's noise
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    target = build_random_target(shape_config(ns.shape), dev, dtype)
    drafter = build_random_drafter(target, num_layers=2, block_size=16)
    head = length_policy("cost").build_head(target.config.hidden_size, LengthHeadConfig(policy="cost"), 16)
    head = head.to(dev, dtype).requires_grad_(False)
    rows = []
    for b in ns.batch:
        for m in ns.methods:
            rows.append(profile(m, target, drafter, head, b, ns))
            _print_row(rows[-1])
            if dev == "cuda":
                torch.cuda.empty_cache()
    ar = {r["batch"]: r["by_kind_us"].get("ar", {}).get("host") for r in rows if r["method"] == "ar"}
    for r in rows:
        g0 = r["by_kind_us"].get("gamma0")
        if r["method"] != "ar" and g0 and ar.get(r["batch"]):
            print(f"{r['method']:13s} b={r['batch']:<3d} gamma0 host - ar host = {g0['host'] - ar[r['batch']]:+.1f} us")
    print(json.dumps({"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "shape": ns.shape,
                      "sync": ns.sync, "rows": rows}))


if __name__ == "__main__":
    main()
