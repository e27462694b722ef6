"""The host time of one CUDA graph launch (``torch.cuda.CUDAGraph.replay``) per step key, in an AR engine and in an
engine with a drafter, and what changes it: how many graphs the runner holds, an upload again, a fresh capture.

A diagnostic for the plain AR step of a locked wave (``SpecEngine`` ``makespan_lock``): in the bench's profile its
``launch`` phase took ~0.1 ms of host time where the AR engine's took ~0.01 ms, for the same kernels. Per key it
prints the median and p90 µs of ``replay()`` alone (the device synchronised before and after each call) over
``--launches`` calls. Random weights of a real shape (no checkpoint); CUDA only.

    python scripts/graph_launch_probe.py --shape smollm2-135m --batch 64 --launches 200
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step_phases import _engine  # noqa: E402

from adaflash_ray.config import LengthHeadConfig  # noqa: E402
from adaflash_ray.engine import SamplingParams  # noqa: E402
from adaflash_ray.engine.graph_upload import upload_graph  # noqa: E402
from adaflash_ray.engine.length_policy import length_policy  # noqa: E402
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config  # noqa: E402


def _launch_us(graph: torch.cuda.CUDAGraph, n: int) -> dict:
    """Median / p90 / min µs of ``graph.replay()``'s host call, the device idle before each."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        out.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    out.sort()
    return {"median": round(statistics.median(out), 1), "p90": round(out[int(0.9 * (len(out) - 1))], 1),
            "min": round(out[0], 1)}


def _keys(runner, batch: int) -> list:
    """The captured keys at ``batch`` rows, one per kind (spec / plain / AR-like), the widest span first."""
    seen, keys = set(), []
    for k in sorted(runner.graphs, key=lambda k: -k.span):
        kind = k._replace(span=0, width=0)
        if k.batch_size == batch and kind not in seen:
            seen.add(kind)
            keys.append(k)
    return keys


def probe(method: str, target, drafter, head, ns) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(10, vocab, (ns.prompt_len,), generator=g).tolist() for _ in range(ns.batch)]
    sp = SamplingParams(max_new_tokens=ns.new_tokens, ignore_eos=True)
    eng = _engine(method, target, drafter, head, ns.batch, ns.prompt_len + ns.new_tokens + 64)
    mode = "ar" if method == "ar" else "spec"
    eng.generate(prompts, sp, mode=mode)
    runner = eng.runner
    row = {"method": method, "graphs_after_run": len(runner.graphs), "keys": {}}
    keys = _keys(runner, ns.batch)
    for k in keys:
        row["keys"][repr(k)] = {"after_run": _launch_us(runner.graphs[k], ns.launches)}
    if not ns.no_precapture:
        row["precapture"] = eng.precapture_graphs(120.0)
        row["graphs_after_precapture"] = len(runner.graphs)
        for k in keys:
            row["keys"][repr(k)]["after_precapture"] = _launch_us(runner.graphs[k], ns.launches)
    for k in keys:
        upload_graph(runner.graphs[k])
        row["keys"][repr(k)]["uploaded_again"] = _launch_us(runner.graphs[k], ns.launches)
    # only these keys' graphs kept: do the others' executables make a launch slower?
    kept = {k: runner.graphs[k] for k in keys}
    runner.graphs.clear()
    runner.graphs.update(kept)
    gc.collect()
    torch.cuda.synchronize()
    for k in keys:
        row["keys"][repr(k)]["others_freed"] = _launch_us(runner.graphs[k], ns.launches)
    for k in keys:  # a fresh capture of the same step into the runner's pool
        fresh = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fresh, pool=runner._pool):
            runner._step_fn(*k)
        upload_graph(fresh)
        row["keys"][repr(k)]["fresh_capture"] = _launch_us(fresh, ns.launches)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--launches", type=int, default=200)
    p.add_argument("--methods", nargs="+", default=["ar", "lock", "dflash"])
    p.add_argument("--no-precapture", action="store_true")
    p.add_argument("--out", default=None, help="write the rows as JSON here too")
    ns = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch_probe needs CUDA (it times CUDA graph launches)")
    torch.set_num_threads(1)
    target = build_random_target(shape_config(ns.shape), "cuda", torch.bfloat16)
    drafter = build_random_drafter(target, num_layers=2, block_size=16)
    head = length_policy("cost").build_head(target.config.hidden_size, LengthHeadConfig(policy="cost"), 16)
    head = head.to("cuda", torch.bfloat16).requires_grad_(False)
    rows = []
    for m in ns.methods:
        r = probe(m, target, drafter, head, ns)
        rows.append(r)
        print(json.dumps(r, indent=1), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"shape": ns.shape, "batch": ns.batch, "device": torch.cuda.get_device_name(0),
                       "commit": os.environ.get("ADAFLASH_COMMIT", "unknown"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
