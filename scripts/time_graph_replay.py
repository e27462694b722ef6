"""The host and device cost of replaying each captured decode graph, AR engine against the cost policy's γ = 0.

Builds the engines of scripts/profile_step_phases.py (``ar``: no drafter, ``mode="ar"``; ``gamma0``: the cost
policy with a cost table under which drafting never pays) on random weights of a real shape, runs one batch of
requests to completion (capturing every graph those steps use), then replays each captured graph on its own:
``host_us`` is the time inside ``CUDAGraph.replay()`` (the launch, device still busy), ``total_us`` the time to the
device's completion after a synchronised start. Medians over ``--iters`` replays; one JSON line per graph, then a
summary line per method. Tells whether a γ = 0 step's graph is itself slower to launch or to run than the AR step's
at the same (batch, width, span), or whether the difference is host work around it.

Run (GPU): python scripts/time_graph_replay.py [--shape smollm2-135m] [--batch 1 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step_phases import _engine  # noqa: E402

from adaflash_ray.config import LengthHeadConfig  # noqa: E402
from adaflash_ray.engine import SamplingParams  # noqa: E402
from adaflash_ray.engine.length_policy import length_policy  # noqa: E402
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    target = build_random_target(shape_config(ns.shape), "cuda", torch.bfloat16)
    drafter = build_random_drafter(target, num_layers=2, block_size=16)
    head = length_policy("cost").build_head(target.config.hidden_size, LengthHeadConfig(policy="cost"), 16)
    head = head.to("cuda", torch.bfloat16).requires_grad_(False)
    clock = time.perf_counter
    for b in ns.batch:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(10, target.config.vocab_size, (64,), generator=g).tolist() for _ in range(b)]
        for method in ("ar", "gamma0"):
            eng = _engine(method, target, drafter, head, b, 64 + ns.new_tokens + 64)
            eng.generate(prompts, SamplingParams(max_new_tokens=ns.new_tokens, ignore_eos=True),
                         mode="ar" if method == "ar" else "spec")
            rows = []
            for key, graph in eng.runner.graphs.items():
                host, total = [], []
                for _ in range(ns.iters):
                    torch.cuda.synchronize()
                    t0 = clock()
                    graph.replay()
                    t1 = clock()
                    torch.cuda.synchronize()
                    host.append(t1 - t0)
                    total.append(clock() - t0)
                row = {"method": method, "batch": b, "key": {k: (v if isinstance(v, (int, bool)) else str(v))
                                                              for k, v in key._asdict().items()},
                       "host_us": round(1e6 * statistics.median(host), 1),
                       "total_us": round(1e6 * statistics.median(total), 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            print(json.dumps({"method": method, "batch": b, "graphs": len(rows),
                              "min_host_us": min(r["host_us"] for r in rows),
                              "max_host_us": max(r["host_us"] for r in rows)}), flush=True)
            del eng
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
