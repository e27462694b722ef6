"""Why a graph replay's host call is slow for some engines: ``CUDAGraph.replay()`` timed per step, per method.

Builds the engines of :mod:`scripts.profile_hybrid_host` (``suffix``, ``hybrid``; plus ``dflash``: the drafter's
block at γ = 15 on every step) on random weights of a real shape on CUDA, runs one batch of requests to completion
(warm-up: every graph those steps use is captured), then runs it again with ``ModelRunner._run`` wrapped. Per step it
records the host time inside the replay call and splits the steps three ways:

- ``same``: the step's graph is the one the step before replayed;
- ``changed``: another graph than the step before's;
- and, in a third run where each replay is preceded by ``torch.cuda.synchronize()``, ``synced``: the call with the
  device idle and nothing queued (the call then cannot wait on earlier work).

If ``synced`` is fast and the others slow, the call waits on work queued before it (e.g. copies from pageable host
memory, or a full launch queue); if ``changed`` is slow and ``same`` fast, switching graphs costs; if every kind is
slow for one method, its graphs themselves are slow to launch (node count, memcpy nodes). Prints one JSON line per
(method, batch) with medians and means in µs, the graphs used and their node counts where torch exposes them.

    python scripts/replay_host_by_method.py [--shape smollm2-135m] [--batch 8 64] [--new-tokens 96]
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
from profile_hybrid_host import build, corrupted_corpus  # noqa: E402

from adaflash_ray.config import LengthHeadConfig  # noqa: E402
from adaflash_ray.drafting.lookup import SuffixCorpus  # noqa: E402
from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats  # noqa: E402
from adaflash_ray.engine.length_policy import length_policy  # noqa: E402
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config  # noqa: E402


def engine(method: str, target, drafter, head, batch: int, seq: int, corpus: SuffixCorpus) -> SpecEngine:
    if method == "dflash":
        return SpecEngine(target, drafter, head, policy="fixed", max_batch_size=batch, max_seq_len=seq,
                          calibrate=False)
    return build(method, target, drafter, head, batch, seq, corpus)


def timed_run(eng: SpecEngine, prompts, params: SamplingParams, sync: bool) -> list[tuple[object, float, float]]:
    """One run of ``prompts`` with ``_run`` wrapped: per replay (its key, host seconds in the call, seconds the
    synchronize before it waited)."""
    runner, out = eng.runner, []
    real = runner._run

    def run(key):
        w = 0.0
        if sync:
            t = time.perf_counter()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            w = time.perf_counter() - t
        t0 = time.perf_counter()
        real(key)
        out.append((key, time.perf_counter() - t0, w))

    runner._run = run
    try:
        for p in prompts:
            eng.add_request(p, SamplingParams(**vars(params)))
        while eng.has_unfinished():
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        del runner._run
    return out


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "median_us": round(1e6 * statistics.median(xs), 1) if xs else None,
            "mean_us": round(1e6 * statistics.fmean(xs), 1) if xs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--methods", nargs="+", default=["dflash", "suffix", "hybrid"])
    ap.add_argument("--precapture", type=float, default=0.0,
                    help="seconds to precapture the graph grid after the warm-up (the bench's hundreds of graphs)")
    ap.add_argument("--cpu", action="store_true", help="a dry run on the CPU (float32, no graphs): checks the script")
    ns = ap.parse_args()
    if not ns.cpu and not torch.cuda.is_available():
        sys.exit("needs CUDA: it times CUDA graph replays (--cpu: a dry run)")
    dev, dtype = ("cpu", torch.float32) if ns.cpu else ("cuda", torch.bfloat16)
    target = build_random_target(shape_config(ns.shape), dev, dtype)
    drafter = build_random_drafter(target, num_layers=1, block_size=16)
    head = length_policy("cost").build_head(target.config.hidden_size, LengthHeadConfig(policy="cost"), 16)
    head = head.to(dev).requires_grad_(False)
    for b in ns.batch:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(10, target.config.vocab_size, (ns.prompt_len,), generator=g).tolist()
                   for _ in range(b)]
        seeds = corrupted_corpus(target, prompts, ns.new_tokens, 0.25, b)
        params = SamplingParams(max_new_tokens=ns.new_tokens, ignore_eos=True)
        for method in ns.methods:
            eng = engine(method, target, drafter, head, b, ns.prompt_len + ns.new_tokens + 64, SuffixCorpus(3))
            eng.reset_corpus(seeds) if method != "dflash" else None
            timed_run(eng, prompts, params, sync=False)  # warm-up: captures
            if ns.precapture:  # as the bench does: every key of the kinds met, at every bucket and span
                n_pre, _ = eng.runner.precapture(eng.runner.graph_grid(), max_seconds=ns.precapture)
            row = {"method": method, "batch": b}
            for sync in (False, True):
                if method != "dflash":
                    eng.reset_corpus(seeds)
                eng.stats = SpecStats()
                rec = timed_run(eng, prompts, params, sync)
                if sync:
                    row["synced"] = summary([h for _, h, _ in rec])
                    row["sync_wait"] = summary([w for _, _, w in rec])
                    continue
                same = [h for (k0, _, _), (k1, h, _) in zip(rec, rec[1:]) if k0 == k1]
                changed = [h for (k0, _, _), (k1, h, _) in zip(rec, rec[1:]) if k0 != k1]
                row.update(all=summary([h for _, h, _ in rec]), same=summary(same), changed=summary(changed),
                           graphs_used=len({k for k, _, _ in rec}), graphs_captured=len(eng.runner.graphs),
                           steps=len(rec))
                by_kind: dict[str, list[float]] = {}
                for k, h, _ in rec:
                    by_kind.setdefault(f"lookup={getattr(k, 'lookup', None)} propose={getattr(k, 'propose', None)}"
                                       f" host_drafts={getattr(k, 'host_drafts', None)}", []).append(h)
                row["by_kind"] = {k: summary(v) for k, v in by_kind.items()}
            print(json.dumps(row), flush=True)
            del eng
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
