"""Where the decode step's device time goes: each kernel of one CUDA-graph replay of a random-weight target's cached
forward (the engine's AR / verify body), timed by ``torch.profiler`` over ``--iters`` replays.

Per kernel name: launches per forward, device µs per forward (sum and per launch) and, for the GEMMs, the weight
bytes they read and the bandwidth that implies against the measured copy bandwidth. Per forward: the wall time of a
replay (CUDA events, no profiler attached), the sum of kernel times, and the difference - the time the GPU spends
between kernels (launch latency inside the graph, each kernel's ramp-up and tail).

Run (GPU):
    python scripts/kernel_times.py --shape qwen3-8b --batch 1 --width 1 --out kt.json
    ADAFLASH_FUSED_LINEAR=all python scripts/kernel_times.py ...   # the fused norm + linear kernels
Prints one JSON document (and writes it to ``--out``). Raises SystemExit without CUDA.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaflash_ray.shapes import (build_random_target, decode_weight_bytes, measure_copy_bandwidth,  # noqa: E402
                                 shape_config)


def _gemm_bytes(target) -> dict[str, int]:
    """Bytes of each distinct linear weight shape of one layer, keyed ``"out x in"`` (for naming what a GEMM reads)."""
    out = {}
    for mod in target.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            out[f"{w.shape[0]}x{w.shape[1]}"] = w.numel() * w.element_size()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--width", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--split-k", choices=["auto", "on", "off"], default="on",
                   help="the split-K decode attention (the engine's choice at batch 1 in every calibration so far)")
    p.add_argument("--fused", choices=["auto", "off"], default="auto")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_times needs CUDA")
    dev = torch.device("cuda")
    cfg = shape_config(ns.shape)
    target = build_random_target(cfg, dev, torch.bfloat16)
    target.fuse_projections()
    active = target.use_fused_kernels(ns.fused)
    target.fused_attention = {"on": True, "off": False}.get(ns.split_k, "auto")
    b, w, ctx = ns.batch, ns.width, ns.context
    cache = target.new_kv_cache(b, ctx + w + 1)
    ids = torch.zeros(b, w, dtype=torch.long, device=dev)
    pos = (ctx + torch.arange(w, device=dev)).expand(b, w).contiguous()

    def step():
        out = target(ids, pos, cache=cache, rows_are_slots=True, span=ctx + w, capture_layer_ids=None,
                     logits_dtype=None)
        return out.logits.argmax(-1)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize(dev)
    # wall per replay, back to back (as the engine's steps: each ends in a sync) and pipelined
    walls = []
    for _ in range(ns.iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize(dev)
        walls.append(e0.elapsed_time(e1) * 1000)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(ns.iters):
        graph.replay()
    e1.record()
    torch.cuda.synchronize(dev)
    pipelined = e0.elapsed_time(e1) * 1000 / ns.iters

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ns.iters):
            graph.replay()
        torch.cuda.synchronize(dev)
    per = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    # the gaps between consecutive kernels inside a replay (a replay's first kernel starts after the host's launch)
    gaps = [b0 - a1 for (_, a1), (b0, _) in zip(spans, spans[1:])]
    n_fwd = ns.iters
    rows = sorted(({"name": k[:160], "launches": c / n_fwd, "us": t / n_fwd, "us_each": t / c}
                   for k, (c, t) in per.items()), key=lambda r: -r["us"])
    kern_us = sum(r["us"] for r in rows)
    launches = sum(r["launches"] for r in rows)
    small = sorted(g for g in gaps if g < 50)  # within a replay (the gap between replays is the host's)
    bw = measure_copy_bandwidth(dev)
    wbytes = decode_weight_bytes(target)
    doc = {
        "shape": ns.shape, "batch": b, "width": w, "context": ctx, "fused_active": active, "split_k": ns.split_k,
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "weight_bytes": wbytes, "copy_bandwidth_gb_s": bw / 1e9, "memory_floor_us": 1e6 * wbytes / bw,
        "replay_us_median": sorted(walls)[len(walls) // 2], "replay_us_pipelined": pipelined,
        "kernel_us_per_forward": kern_us, "launches_per_forward": launches,
        "gap_us_per_forward": sum(small) / n_fwd, "gap_us_median": small[len(small) // 2] if small else None,
        "layers": cfg.num_hidden_layers, "linear_bytes": _gemm_bytes(target), "kernels": rows,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text)


if __name__ == "__main__":
    main()
