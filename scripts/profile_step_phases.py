"""Where an engine decode step's wall time goes, per method and batch size: the engine's host work before the step
(schedule: policy / lookups), the runner's host work before the graph launch, the launch, the wait for the device
plus the result's unpacking, and the engine's host work after it (postprocess: stats, commits). Random weights of a
real shape (no checkpoint needed), so acceptance is meaningless; the point is the host time each method adds.

    python scripts/profile_step_phases.py --shape smollm2-135m --batch 1 64 --new-tokens 128

Methods: ar (mode ar), gamma0 (the cost policy with a cost table under which drafting never pays: every step is
the policy's γ = 0, probes included; its throughput guard off, so the policy's own probe schedule runs), dflash
(fixed γ = 15), ngram and suffix (draft sources, fixed policy).
Prints one line per (method, batch) and under it the engine's own split by step kind (SpecStats.timing: count x mean
wall ms of ar / gamma0 / probe / draft steps, the context catch-ups inside them, the prefills), and a JSON document as
the last line (each row's ``step_timing``).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from adaflash_ray.config import LengthHeadConfig
from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats
from adaflash_ray.engine.length_policy import length_policy
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config


def _instrument(eng: SpecEngine) -> dict:
    acc = {"schedule": 0.0, "runner_pre": 0.0, "launch": 0.0, "wait_post": 0.0, "postprocess": 0.0,
           "propose_steps": 0, "propose_run": 0.0, "plain_run": 0.0}
    marks = {}
    e_sched, e_run, e_post, r_run = eng._schedule, eng._run, eng._postprocess, eng.runner._run

    def sched(*a, **k):
        t0 = time.perf_counter(); out = e_sched(*a, **k); acc["schedule"] += time.perf_counter() - t0; return out

    def run(batch, *a, **k):
        marks["t0"] = time.perf_counter(); out = e_run(batch, *a, **k); t1 = time.perf_counter()
        acc["wait_post"] += t1 - marks["t_launched"]
        if batch.spec and batch.propose:
            acc["propose_steps"] += 1; acc["propose_run"] += t1 - marks["t0"]
        else:
            acc["plain_run"] += t1 - marks["t0"]
        return out

    def rrun(*a, **k):
        t = time.perf_counter(); acc["runner_pre"] += t - marks["t0"]; r_run(*a, **k)
        marks["t_launched"] = time.perf_counter(); acc["launch"] += marks["t_launched"] - t

    def post(*a, **k):
        t0 = time.perf_counter(); out = e_post(*a, **k); acc["postprocess"] += time.perf_counter() - t0; return out

    eng._schedule, eng._run, eng._postprocess, eng.runner._run = sched, run, post, rrun
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--methods", nargs="+", default=["ar", "gamma0", "dflash", "ngram", "suffix"])
    p.add_argument("--repeats", type=int, default=2)
    ns = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    target = build_random_target(shape_config(ns.shape), dev, dtype)
    drafter = build_random_drafter(target, num_layers=2, block_size=16)
    hc = LengthHeadConfig(policy="cost")
    head = length_policy("cost").build_head(target.config.hidden_size, hc, 16).to(dev, dtype)
    vocab = target.config.vocab_size
    rows = []
    for b in ns.batch:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(10, vocab, (ns.prompt_len,), generator=g).tolist() for _ in range(b)]
        sp = SamplingParams(max_new_tokens=ns.new_tokens, ignore_eos=True)
        seq = ns.prompt_len + ns.new_tokens + 32
        for m in ns.methods:
            kw = dict(max_batch_size=b, max_seq_len=seq)
            if m in ("ngram", "suffix"):
                eng = SpecEngine(target, None, None, policy="fixed", draft_sources=(m,), **kw)
            elif m == "gamma0":
                eng = SpecEngine(target, drafter, head, policy="cost", ar_steps=True, throughput_guard=False, **kw)
                bs = sorted({1, b})
                eng.policy.set_costs(bs, torch.full((len(bs), 15), 1e4), torch.ones(len(bs)))
            else:
                eng = SpecEngine(target, drafter, None, policy="fixed", **kw)
            mode = "ar" if m == "ar" else "spec"
            eng.generate(prompts, sp, mode=mode)  # captures every graph the timed runs need
            best = None
            for _ in range(ns.repeats):
                acc = _instrument(eng) if best is None or True else None
                eng.stats = SpecStats()
                if dev == "cuda":
                    torch.cuda.synchronize()
                eng.generate(prompts, sp, mode=mode)
                st = eng.stats
                n = st.num_engine_steps
                row = {"method": m, "batch": b, "ms_per_step": 1e3 * st.decode_seconds / n, "steps": n,
                       "tau": st.accept_len if mode == "spec" else 1.0,
                       **{k + "_ms": 1e3 * v / n for k, v in acc.items() if not k.startswith(("propose", "plain"))},
                       "propose_steps": acc["propose_steps"],
                       "propose_step_run_ms": 1e3 * acc["propose_run"] / max(acc["propose_steps"], 1),
                       "plain_step_run_ms": 1e3 * acc["plain_run"] / max(n - acc["propose_steps"], 1),
                       "gamma_hist": {str(k): v for k, v in sorted(st.draft_len_hist.items())},
                       "step_timing": st.timing()}
                if best is None or row["ms_per_step"] < best["ms_per_step"]:
                    best = row
                for name in ("_schedule", "_run", "_postprocess"):
                    eng.__dict__.pop(name, None)
                eng.runner.__dict__.pop("_run", None)
            rows.append(best)
            print(f"{m:7s} b={b:<3d} {best['ms_per_step']:6.3f} ms/step  sched {best['schedule_ms']:.3f} "
                  f"pre {best['runner_pre_ms']:.3f} launch {best['launch_ms']:.3f} wait+post {best['wait_post_ms']:.3f} "
                  f"post {best['postprocess_ms']:.3f}  tau {best['tau']:.2f}  propose steps {best['propose_steps']} "
                  f"({best['propose_step_run_ms']:.3f} ms run vs {best['plain_step_run_ms']:.3f})", flush=True)
            tm = best["step_timing"]
            kinds = "  ".join(f"{k} {v['count']} x {v['mean_ms']:.3f}" for k, v in tm["steps"].items())
            cu, pf = tm["catch_up"], tm["prefill"]
            print(f"        kinds: {kinds}  | catch-up {cu['count']} ({cu['num_positions']} pos, "
                  f"{cu['total_ms']:.3f} ms host)  prefill {pf['count']} x {pf['mean_ms'] or 0:.3f} ms", flush=True)
            del eng
            if dev == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps({"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "shape": ns.shape,
                      "rows": rows}))


if __name__ == "__main__":
    main()
