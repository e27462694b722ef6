"""Where an engine run's decode steps spend their time, by step kind and shape: host phases, device time, kernels.

:func:`profile_run` runs one ``SpecEngine.generate`` up to three times over the same requests (after the caller's
timed runs: its graphs are captured), the kernels last (torch.profiler slows every later graph launch in the process):

1. **phases**: per decode step its kind (``ar`` / ``gamma0`` / ``probe`` / ``draft``, :data:`~adaflash_ray.engine.stats.
   STEP_KINDS`; a hybrid's drafting steps under its source guard also say ``:planned`` or ``:block-only``) and the
   shape the device ran (rows x verify width), its wall time split into ``admit``
   (``SpecEngine._admit``: admission and prefills), ``schedule``
   (``SpecEngine._schedule``: policy, planner), ``launch`` (host time inside ``ModelRunner._run``: a CUDA graph's
   replay call, or the eager forward on CPU; on CUDA after ``pre_launch_wait``: a ``torch.cuda.synchronize()`` just
   before the call, the time the device still had work queued before the step's graph - none if the host's earlier
   work all completed, so a slow ``launch`` then is the call itself), ``runner_rest`` (the rest of
   ``ModelRunner.step``: inputs, the previous step's planner record run in its overlap, the wait for the device and
   the one device -> host copy),
   ``postprocess`` (``SpecEngine._postprocess``) and ``other``; and the **device** time of the forward (CUDA events
   around ``ModelRunner._run``; on CPU the same host time as ``launch``).
   A step whose wall time is well above its device time is host-bound: the GPU idles for the difference.
   Then the host time of a bare ``replay()`` of the most launched step graphs (:func:`bare_launches`).
2. **cprofile**: the host functions by own time (cProfile over the whole run, prefills included).
3. **kernels** (torch.profiler): per decode step the device kernels by name, count and µs (CUDA), or the outermost
   aten ops (CPU); prefills included.

Times are means per step in ms (µs for kernels). Instrumentation adds a little host time to every step; compare
methods under the same instrumentation, not with the bench's timed rows.
"""
from __future__ import annotations

import collections
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats

PHASES = ("admit", "schedule", "pre_launch_wait", "launch", "runner_rest", "postprocess", "other")


def _phase_run(eng: SpecEngine, prompts: list[list[int]], sp: SamplingParams,
               mode: str) -> tuple[dict, collections.Counter]:
    """One run with every decode step timed by phase and its forward timed on the device (see the module doc):
    ``({"<kind> <rows>x<width>": {count, <phase> ms, device, launch_p50 / launch_p90 / launch_max ms}}, the step
    keys launched by count)``."""
    runner = eng.runner
    cuda = runner.is_cuda
    cur: dict = {}
    steps: list[dict] = []
    keys: collections.Counter = collections.Counter()  # the step keys the runs launched, by count
    orig_step, orig_admit, orig_sched, orig_post = eng.step, eng._admit, eng._schedule, eng._postprocess
    orig_run, orig_rstep = runner._run, runner.step
    # the instance attributes replaced below (a caller's own wrappers): set again afterwards, the rest deleted
    patched = [(eng, "step"), (eng, "_admit"), (eng, "_schedule"), (eng, "_postprocess"), (runner, "_run"),
               (runner, "step")]
    own = [(o, n, vars(o)[n]) for o, n in patched if n in vars(o)]

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[name] = cur.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    def run(key):
        if cuda:
            t = time.perf_counter()
            torch.cuda.synchronize()  # work still queued before the step's graph (instrumentation: it waits here)
            cur["pre_launch_wait"] = cur.get("pre_launch_wait", 0.0) + time.perf_counter() - t
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        t0 = time.perf_counter()
        orig_run(key)
        dt = time.perf_counter() - t0
        cur["launch"] = cur.get("launch", 0.0) + dt
        keys[key] += 1
        if cuda:
            ev[1].record()
            cur.setdefault("events", []).append(ev)
        else:  # eager on the host: the forward's time is the launch's
            cur["device"] = cur.get("device", 0.0) + dt

    def step(*a, **k):
        cur.clear()
        before = dict(eng.stats.kind_steps)
        t0 = time.perf_counter()
        out = orig_step(*a, **k)
        wall = time.perf_counter() - t0
        grown = [kind for kind, v in eng.stats.kind_steps.items() if v > before.get(kind, 0)]
        if grown:  # a decode step ran (not only admission)
            kind = grown[0]
            if kind in ("probe", "draft") and getattr(eng, "source_guard", None) is not None:
                # the source guard's regime of this drafting step (SpecEngine sets it as the step ends)
                kind += ":planned" if eng._last_regime else ":block-only"
            steps.append({**cur, "shape": runner.step_shape, "wall": wall, "kind": kind})
        return out

    eng.step, eng._admit = step, timed("admit", orig_admit)
    eng._schedule, eng._postprocess = timed("schedule", orig_sched), timed("postprocess", orig_post)
    runner._run, runner.step = run, timed("runner", orig_rstep)
    eng.stats = SpecStats()
    try:
        eng.generate(prompts, sp, mode=mode)
        if cuda:
            torch.cuda.synchronize()
    finally:
        for o, n in patched:  # the class's methods again, or the caller's own attributes
            delattr(o, n)
        for o, n, f in own:
            setattr(o, n, f)
    agg: dict[tuple, dict] = defaultdict(lambda: defaultdict(float))
    launches: dict[tuple, list[float]] = defaultdict(list)
    for s in steps:
        launches[(s["kind"], *s["shape"])].append(s.get("launch", 0.0))
        device = sum(a.elapsed_time(b) / 1e3 for a, b in s.pop("events", [])) if cuda else s.get("device", 0.0)
        row = agg[(s["kind"], *s["shape"])]
        row["count"] += 1
        row["wall"] += s["wall"]
        row["device"] += device
        for p in ("admit", "schedule", "pre_launch_wait", "launch", "postprocess"):
            row[p] += s.get(p, 0.0)
        row["runner_rest"] += s.get("runner", 0.0) - s.get("launch", 0.0) - s.get("pre_launch_wait", 0.0)
    out = {}
    for (kind, b, w), row in sorted(agg.items(), key=lambda kv: -kv[1]["count"]):
        n = row.pop("count")
        ms = {k: round(1e3 * v / n, 4) for k, v in row.items()}
        ms["other"] = round(ms["wall"] - sum(ms[p] for p in PHASES[:-1]), 4)
        spread = sorted(launches[(kind, b, w)])
        ms["launch_p50"] = round(1e3 * spread[len(spread) // 2], 4)
        ms["launch_p90"] = round(1e3 * spread[int(0.9 * (len(spread) - 1))], 4)
        ms["launch_max"] = round(1e3 * spread[-1], 4)
        out[f"{kind} {b}x{w}"] = {"count": int(n), **ms}
    return out, keys


def kernel_run(eng: SpecEngine, prompts, sp: SamplingParams, mode: str, top: int) -> dict:
    """One greedy ``generate`` of ``prompts`` (``mode`` ``"spec"`` / ``"ar"``) under torch.profiler: the device kernels
    (CUDA: what the captured graphs replay) or the outermost aten ops (CPU) per decode step, prefills included.
    Returns ``{num_steps, per_step (count), us_per_step, top: [[name, count per step, µs per step]] (the ``top``
    largest by time)}``; the engine's stats are reset first."""
    from torch.profiler import ProfilerActivity, profile
    cuda = eng.runner.is_cuda
    eng.stats = SpecStats()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        eng.generate(prompts, sp, mode=mode)
        if cuda:
            torch.cuda.synchronize()
    n = max(eng.stats.num_engine_steps, 1)
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "device_time_total", None)
            us = e.cuda_time_total if us is None else us
        elif not e.name.startswith("aten::") or (e.cpu_parent is not None and
                                                 e.cpu_parent.name.startswith("aten::")):
            continue  # the outermost aten ops only (under a record_function range or a compiled region too)
        else:
            us = e.cpu_time_total
        agg[e.name][0] += 1
        agg[e.name][1] += us
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    return {"num_steps": n, "per_step": round(sum(v[0] for v in agg.values()) / n, 2),
            "us_per_step": round(sum(v[1] for v in agg.values()) / n, 2),
            "top": [[name[:120], round(c / n, 3), round(us / n, 2)] for name, (c, us) in rows[:top]]}


def _cprofile_run(eng: SpecEngine, prompts, sp: SamplingParams, mode: str, top: int) -> str:
    """One run under cProfile: the ``top`` host functions by own time, as pstats prints them."""
    eng.stats = SpecStats()
    prof = cProfile.Profile()
    prof.enable()
    eng.generate(prompts, sp, mode=mode)
    if eng.runner.is_cuda:
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    buf.write(f"{eng.stats.num_engine_steps} decode steps\n")
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def replay_us(graph: torch.cuda.CUDAGraph, launches: int) -> dict:
    """``{median, p90, min, max}`` µs of ``graph.replay()``'s host call over ``launches`` calls, the device
    synchronised before and after each (the graph's step runs each time)."""
    ts = []
    for _ in range(launches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        ts.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    ts.sort()
    return {"median": round(statistics.median(ts), 1), "p90": round(ts[int(0.9 * (len(ts) - 1))], 1),
            "min": round(ts[0], 1), "max": round(ts[-1], 1)}


def bare_launches(eng: SpecEngine, keys: collections.Counter, num_keys: int = 3, launches: int = 50) -> dict:
    """:func:`replay_us` of the ``num_keys`` step keys launched most (``keys``): ``{repr(key): {count, median, p90,
    min, max}}`` ({} without CUDA graphs). Against a phase run's ``launch`` it says whether a slow launch is the call
    itself or the process around it (other threads taking the GIL that the replay releases, ...). The replays run
    their steps again on stale inputs: they write KV and history positions of the finished requests' freed slots,
    which a later request in a slot writes before it reads them (the bench's next runs on the engine)."""
    runner = eng.runner
    if not runner.is_cuda or not runner.use_graphs:
        return {}
    return {repr(key): {"count": count, **replay_us(runner.graphs[key], launches)}
            for key, count in keys.most_common(num_keys) if key in runner.graphs}


def profile_run(eng: SpecEngine, prompts: list[list[int]], max_new_tokens: int, mode: str = "spec",
                top: int = 30, parts: tuple[str, ...] = ("phases", "cprofile", "kernels")) -> dict:
    """Phases, host profile and kernels of ``eng`` generating ``prompts`` greedily (``mode``: ``"spec"`` or
    ``"ar"``), one run each of ``parts`` (module doc), the kernels last. Returns ``{"phases": {"<kind> <rows>x<width>":
    {count, wall, admit, schedule, pre_launch_wait, launch, runner_rest, postprocess, other, device, launch_p50,
    launch_p90, launch_max} (ms per step)}, "async_scheduling": the engine's (the phase run's steps are synchronous
    whatever it is: :attr:`SpecEngine.async_scheduling` off for that run), "process": {threads, switch_interval_s,
    graphs_held}, "bare_launches":
    (:func:`bare_launches`, after the phase run's keys), "cprofile": str, "kernels": {num_steps, per_step,
    us_per_step, top: [[name, count per step, µs per step]]}}`` for the parts run. The engine's stats are reset by
    each run.

    torch.profiler's CUDA activity (CUPTI) stays attached to the process once it has run and makes every later graph
    launch several times slower: a caller profiling several engines in one process runs every engine's ``phases``
    and ``cprofile`` before any engine's ``kernels``, and times nothing after them.

    Raises:
        ValueError: an unknown part.
    """
    unknown = set(parts) - {"phases", "cprofile", "kernels"}
    if unknown:
        raise ValueError(f"unknown profile part(s) {sorted(unknown)}; expected phases, cprofile, kernels")
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    doc: dict = {"async_scheduling": eng.async_scheduling}
    if "phases" in parts:
        # the phases time each step's own host work and device time in sequence: synchronous steps (an overlapped
        # step's host work runs while the next step's device work does, and the phase hooks would serialise them)
        eng.drain()
        eng.async_scheduling, was = False, eng.async_scheduling
        try:
            doc["phases"], keys = _phase_run(eng, prompts, sp, mode)
        finally:
            eng.async_scheduling = was
        doc["process"] = {"threads": sorted(t.name for t in threading.enumerate()),
                          "switch_interval_s": sys.getswitchinterval(),
                          "graphs_held": len(eng.runner.graphs) if eng.runner.use_graphs else 0}
    if "cprofile" in parts:
        doc["cprofile"] = _cprofile_run(eng, prompts, sp, mode, top)
    if "phases" in parts:  # replays on stale inputs: after the runs that decode
        doc["bare_launches"] = bare_launches(eng, keys)
    if "kernels" in parts:
        doc["kernels"] = kernel_run(eng, prompts, sp, mode, top)
    return doc
