"""The host time of one CUDA graph launch (``torch.cuda.CUDAGraph.replay``) per step key, in an AR engine and in an
engine with a drafter, and what changes it: how many graphs the runner holds, an upload again, a fresh capture.

A diagnostic for the host cost of a step's launch: the plain AR step of a locked wave (``SpecEngine``
``makespan_lock``) against the AR engine's step of the same kernels, and the drafting steps. Per key it
prints the median and p90 µs of ``replay()`` alone (the device synchronised before and after each call) over
``--launches`` calls, and the node types of a fresh capture of the same step (``keep_graph=True``:
``cudaGraphGetNodes`` / ``cudaGraphNodeGetType`` through ctypes - kernel, memcpy, memset, host, event nodes...).
Random weights of a real shape (no checkpoint); CUDA only. ``--recipe``: the engines as the bench builds them
(``SpecEngine.from_config`` with that recipe's engine settings: prefill buckets, fused kernels, guards), else the
constructor's defaults (scripts/profile_step_phases.py's engines).

    python scripts/graph_launch_probe.py --shape smollm2-135m --batch 64 --launches 200
    python scripts/graph_launch_probe.py --recipe recipes/smollm2_135m_gpu.yaml --new-tokens 128
    python scripts/graph_launch_probe.py --methods dflash --batch 8 --extra-graphs 100 500 2000   # launch vs graphs held
    python scripts/graph_launch_probe.py --methods ar --batch 8 --after-profiler   # launch after torch.profiler
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step_phases import _engine, drafting_never_pays  # noqa: E402

from adaflash_ray.config import LengthHeadConfig  # noqa: E402
from adaflash_ray.engine import SamplingParams  # noqa: E402
from adaflash_ray.engine.engine import SpecEngine  # noqa: E402
from adaflash_ray.engine.graph_upload import cudart_paths, upload_graph  # noqa: E402
from adaflash_ray.engine.length_policy import length_policy  # noqa: E402
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config  # noqa: E402
from adaflash_ray.step_profile import replay_us  # noqa: E402


def _launch_us(graph: torch.cuda.CUDAGraph, n: int) -> dict:
    """Median / p90 / min / max µs of ``graph.replay()``'s host call, the device idle before each."""
    return replay_us(graph, n)


#: cudaGraphNodeType values (CUDA runtime API), by name
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child_graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}


def _cudart():
    with open("/proc/self/maps") as f:
        for path in cudart_paths(f.read(), torch.version.cuda):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _node_types(graph: torch.cuda.CUDAGraph) -> dict | None:
    """Counts of the node types of a graph captured with ``keep_graph=True`` (None where the runtime is not found)."""
    rt = _cudart()
    if rt is None:
        return None
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    if rt.cudaGraphGetNodes(handle, None, ctypes.byref(n)) != 0:
        return None
    nodes = (ctypes.c_void_p * n.value)()
    if rt.cudaGraphGetNodes(handle, nodes, ctypes.byref(n)) != 0:
        return None
    out = collections.Counter()
    for node in nodes:
        t = ctypes.c_int(-1)
        rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        out[NODE_TYPES.get(t.value, str(t.value))] += 1
    return dict(out)


def _recipe_engine(method: str, cfg, target, drafter, head, batch: int, seq: int) -> SpecEngine:
    """``method`` (ar / lock / dflash) built as the bench builds it (``SpecEngine.from_config``), the lock's cost
    tables and history set as scripts/profile_step_phases.py sets them (AR's verdict from the first step)."""
    if method == "ar":
        return SpecEngine.from_config(cfg, models=(target, None, None), policy="fixed", max_batch_size=batch,
                                      max_seq_len=seq, calibrate=False)
    if method == "dflash":
        return SpecEngine.from_config(cfg, models=(target, drafter, None), policy="fixed", max_batch_size=batch,
                                      max_seq_len=seq, calibrate=False, throughput_guard=False)
    eng = SpecEngine.from_config(cfg, models=(target, drafter, head), policy="cost", max_batch_size=batch,
                                 max_seq_len=seq, calibrate=False, throughput_guard=True, makespan_guard=True,
                                 makespan_lock=True, draft_sources=None)
    return drafting_never_pays(eng, batch)


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
    seq = ns.prompt_len + ns.new_tokens + 64
    if ns.recipe:
        eng = _recipe_engine(method, ns.cfg, target, drafter, head, ns.batch, seq)
    else:
        eng = _engine(method, target, drafter, head, ns.batch, seq)
    mode = "ar" if method == "ar" else "spec"
    eng.generate(prompts, sp, mode=mode)
    if method == "lock":  # a second wave: the first gave the throughput guard its samples; this one runs plain steps
        eng._ms_history_waves = 0
        eng.generate(prompts, sp, mode=mode)
    runner = eng.runner
    row = {"method": method, "graphs_after_run": len(runner.graphs), "kinds": dict(eng.stats.kind_steps),
           "plain_steps": eng.stats.num_plain_steps, "keys": {}}
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
    for k in keys:  # a fresh capture of the same step into the runner's pool, its graph kept: the node types
        fresh = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(fresh, pool=runner._pool):
            runner._step_fn(*k)
        row["keys"][repr(k)]["nodes"] = _node_types(fresh)
        fresh.instantiate()
        upload_graph(fresh)
        row["keys"][repr(k)]["fresh_capture"] = _launch_us(fresh, ns.launches)
    if ns.extra_graphs and keys:  # the first key's launch as the process holds more uploaded graphs
        row["extra_graphs"] = {"key": repr(keys[0]),
                               "launch_us": extra_graphs(runner, keys[0], [0] + ns.extra_graphs, ns.launches)}
    # the last method's last measurement: torch.profiler may slow every later launch in the process
    if ns.after_profiler and keys and method == ns.methods[-1]:
        row["after_profiler"] = after_profiler(runner, keys[0], ns.launches)
    return row


def after_profiler(runner, key, launches: int) -> dict:
    """Does torch.profiler's CUDA activity slow later graph launches? ``key``'s launch before, under and after one
    torch.profiler run of a few replays of it (:func:`_launch_us`'s dicts; the replays run the step again)."""
    from torch.profiler import ProfilerActivity, profile
    graph = runner.graphs[key]
    out = {"before": _launch_us(graph, launches)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        out["under"] = _launch_us(graph, launches)
    out["after"] = _launch_us(graph, launches)
    return out


def extra_graphs(runner, key, counts: list[int], launches: int) -> dict:
    """Does a graph launch get slower as the process holds more uploaded graphs? Captures copies of ``key``'s step
    into the runner's pool (each uploaded, as a precapture does) until it holds each of ``counts`` extra graphs, and
    after each count times the launch of ``key``'s own graph and of the first extra one (the oldest upload).
    ``{count: {"step_graph": ..., "oldest_extra": ...}}`` (:func:`_launch_us`'s dicts). The replays run the step:
    the runner's caches change (a probe's engine, not used for decoding after it)."""
    extra, out = [], {}
    for total in sorted(set(counts)):
        while len(extra) < total:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=runner._pool):
                runner._step_fn(*key)
            upload_graph(graph)
            extra.append(graph)
        out[str(total)] = {"step_graph": _launch_us(runner.graphs[key], launches),
                           "oldest_extra": _launch_us(extra[0], launches) if extra else None}
    del extra
    gc.collect()
    torch.cuda.synchronize()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--launches", type=int, default=200)
    p.add_argument("--methods", nargs="+", default=["ar", "lock", "dflash"])
    p.add_argument("--no-precapture", action="store_true")
    p.add_argument("--extra-graphs", type=int, nargs="*", default=[],
                   help="also time a launch while the runner holds this many more uploaded graphs (e.g. 100 500 2000)")
    p.add_argument("--after-profiler", action="store_true",
                   help="at the end (the last method), time its first key's launch before, under and after one "
                        "torch.profiler run")
    p.add_argument("--recipe", default=None, help="build the engines as the bench does, from this recipe")
    p.add_argument("--out", default=None, help="write the rows as JSON here too")
    ns = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch_probe needs CUDA (it times CUDA graph launches)")
    torch.set_num_threads(1)
    if ns.recipe:
        from adaflash_ray.config import load_recipe

        ns.cfg = load_recipe(ns.recipe)
    target = build_random_target(shape_config(ns.shape), "cuda", torch.bfloat16)
    drafter = build_random_drafter(target, num_layers=2, block_size=16)
    if ns.recipe:  # the recipe's fused-kernel switch, as from_config sets it before the runner fuses
        target.fused_kernels = ns.cfg.engine.fused_kernels
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
