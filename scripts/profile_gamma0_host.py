"""Host work of a γ = 0 step against a plain AR step, per engine phase (µs per step, the model forward left out).

A γ = 0 step of the ``cost`` policy (and of the hybrid planner) replays the AR step's device work, so whatever it
costs beyond an AR step is host work: the policy / planner, the throughput guard, the statistics. This script runs
many steps where the policy answers γ = 0 (a hand-set cost table under which drafting and lookups never pay) and
times, per step: ``admit`` (SpecEngine._admit), ``schedule`` (_schedule: policy / planner / guard), ``runner``
(ModelRunner.step's host work around the forward: inputs, catch-up checks, the result's unpacking), ``post``
(_postprocess: stats, commits), ``rest`` (step()'s own bookkeeping: step kind, stats, guard record) and ``host`` (the
whole step minus the forward). The forward (ModelRunner._run, followed by a device synchronisation on CUDA so its
device time stays inside it) is printed apart as ``fwd``.

Modes: ``ar`` (an engine without a drafter, ``mode="ar"``: the bench's ``ar``), ``cost`` (the ``cost`` policy,
guard on: its γ = 0 steps; probes and guard-forced steps are reported apart), ``hybrid-host`` / ``hybrid-device``
(``draft_sources=("dflash", "suffix")`` with the lookups on the host / on the device: the planner's γ = 0 steps).

    PYTHONPATH=. python scripts/profile_gamma0_host.py                       # CPU, tiny random shape, ~1 min
    python scripts/profile_gamma0_host.py --shape smollm2-135m --batch 1 64  # on CUDA
    python scripts/profile_gamma0_host.py --cprofile cost                     # + the cProfile top of one mode

The last stdout line is one JSON document (per mode and batch: µs per step per phase, by step kind).
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
from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.engine.length_policy import length_policy
from adaflash_ray.engine.runner import _buckets
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config

MODES = ("ar", "cost", "hybrid-host", "hybrid-device")
PHASES = ("admit", "schedule", "runner", "post", "rest", "host")


def _engine(mode: str, target, drafter, head, batch: int, seq: int) -> SpecEngine:
    kw = dict(max_batch_size=batch, max_seq_len=seq, calibrate=False)
    if mode == "ar":
        return SpecEngine(target, None, None, policy="fixed", **kw)
    sources = None if mode == "cost" else ("dflash", "suffix")
    where = "device" if mode == "hybrid-device" else "host"
    eng = SpecEngine(target, drafter, head, policy="cost", draft_sources=sources, lookup_device=where, **kw)
    bs = _buckets(batch)
    bsz = drafter.block_size
    eng.policy.set_costs(bs, torch.full((len(bs), bsz - 1), 1e4), torch.ones(len(bs)))  # drafting never pays
    if eng.planner is not None:  # nor do lookups: width 1 (the AR step) costs 1 ms, every wider step 1e4
        nd = eng.runner.max_draft
        eng.planner.set_costs(bs, [[1e4] * (bsz - 1)] * len(bs), [[1.0] + [1e4] * nd] * len(bs))
    eng.guard is not None and eng.guard.set_buckets(bs)
    return eng


class _Timer:
    """Wraps the engine's phases with perf_counter pairs; one dict of seconds per step in ``steps``."""

    def __init__(self, eng: SpecEngine):
        self.eng, self.cur, self.steps = eng, None, []
        sync = torch.cuda.synchronize if eng.runner.is_cuda else (lambda: None)
        orig = {n: getattr(eng, n) for n in ("_admit", "_schedule", "_run", "_postprocess")}
        fwd = eng.runner._run

        def wrap(name, fn):
            def inner(*a, **k):
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.cur[name] += time.perf_counter() - t0
                return out
            return inner

        def forward(key):
            t0 = time.perf_counter()
            fwd(key)
            sync()
            self.cur["fwd"] += time.perf_counter() - t0

        eng._admit, eng._schedule = wrap("admit", orig["_admit"]), wrap("schedule", orig["_schedule"])
        eng._run, eng._postprocess = wrap("run", orig["_run"]), wrap("post", orig["_postprocess"])
        eng.runner._run = forward

    def step(self, mode: str) -> None:
        eng = self.eng
        self.cur = dict.fromkeys(("admit", "schedule", "run", "post", "fwd"), 0.0)
        before, forced = dict(eng.stats.kind_steps), eng.stats.num_guard_steps
        t0 = time.perf_counter()
        eng.step(mode)
        total = time.perf_counter() - t0
        c = self.cur
        kinds = [k for k, v in eng.stats.kind_steps.items() if v != before.get(k, 0)]
        if not kinds:  # nothing ran (all finished)
            return
        kind = kinds[0] + ("-forced" if eng.stats.num_guard_steps != forced else "")
        self.steps.append({"kind": kind, "admit": c["admit"], "schedule": c["schedule"], "runner": c["run"] - c["fwd"],
                           "post": c["post"], "rest": total - c["admit"] - c["schedule"] - c["run"] - c["post"],
                           "host": total - c["fwd"], "fwd": c["fwd"]})


def profile(mode: str, target, drafter, head, batch: int, prompt_len: int, new_tokens: int, repeats: int,
            cprof: bool) -> dict:
    """µs per step per phase (median over ``repeats`` runs of the per-run means) by step kind."""
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    eng = _engine(mode, target, drafter, head, batch, prompt_len + new_tokens + 64)
    step_mode = "ar" if mode == "ar" else "spec"
    eng.generate(prompts[:batch], SamplingParams(max_new_tokens=8, ignore_eos=True), mode=step_mode)  # warm-up
    timer = _Timer(eng)
    runs: dict[str, dict[str, list[float]]] = {}
    prof = cProfile.Profile() if cprof else None
    for _ in range(repeats):
        timer.steps = []
        for p in prompts:
            eng.add_request(p, SamplingParams(**vars(sp)))
        if prof is not None:
            prof.enable()
        while eng.has_unfinished():
            timer.step(step_mode)
        if prof is not None:
            prof.disable()
        by: dict[str, list[dict]] = {}
        for s in timer.steps[1:]:  # the first step admits and prefills the batch
            by.setdefault(s["kind"], []).append(s)
        for kind, ss in by.items():
            r = runs.setdefault(kind, {k: [] for k in (*PHASES, "fwd", "count")})
            for k in (*PHASES, "fwd"):
                r[k].append(1e6 * sum(s[k] for s in ss) / len(ss))
            r["count"].append(len(ss))
    if prof is not None:
        print(f"--- cProfile {mode} b={batch} (all steps, tottime) ---")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {kind: {k: (statistics.median(v) if k != "count" else int(statistics.median(v))) for k, v in r.items()}
            for kind, r in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--cprofile", nargs="*", default=[], choices=MODES, help="modes to run under cProfile too")
    ns = p.parse_args()
    torch.set_num_threads(1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    target = build_random_target(shape_config(ns.shape), dev, dtype)
    drafter = build_random_drafter(target, num_layers=1, block_size=16)
    head = length_policy("cost").build_head(target.config.hidden_size, LengthHeadConfig(policy="cost"), 16)
    head = head.to(dev, dtype).requires_grad_(False)
    out = []
    for b in ns.batch:
        for mode in ns.modes:
            res = profile(mode, target, drafter, head, b, ns.prompt_len, ns.new_tokens, ns.repeats,
                          mode in ns.cprofile)
            for kind, r in sorted(res.items(), key=lambda kv: -kv[1]["count"]):
                print(f"{mode:13s} b={b:<3d} {kind:15s} n={r['count']:<4d} host {r['host']:7.1f} us  "
                      + "  ".join(f"{k} {r[k]:6.1f}" for k in PHASES[:-1]) + f"  | fwd {r['fwd']:7.1f}", flush=True)
            out.append({"mode": mode, "batch": b, "by_kind_us": res})
    ar = {r["batch"]: r["by_kind_us"].get("ar", {}).get("host") for r in out if r["mode"] == "ar"}
    for r in out:
        g0 = r["by_kind_us"].get("gamma0")
        if r["mode"] != "ar" and g0 and ar.get(r["batch"]):
            print(f"{r['mode']:13s} b={r['batch']:<3d} gamma0 host - ar host = {g0['host'] - ar[r['batch']]:+.1f} us")
    print(json.dumps({"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "shape": ns.shape,
                      "rows": out}))


if __name__ == "__main__":
    main()
