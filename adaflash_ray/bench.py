"""Benchmark: plain autoregressive decoding vs fixed-length DFlash vs AdaFlash (the recipe's length
policy), same engine, same prompts, same process, per concurrency level.

    python -m adaflash_ray.bench                                        # untrained drafter, default recipe
    python -m adaflash_ray.bench --drafter runs/<run>/checkpoints/v5    # a trained version
    python -m adaflash_ray.bench --concurrency 1 8 --num-prompts 8 --max-new-tokens 64

Prints a table (τ = mean(a+1) per verify step, acceptance rate, draft waste, γ histogram, tokens/s,
speedup vs AR) and, as the last stdout line, one JSON object. Every speculative method's greedy output
is checked token for token against AR (``lossless`` in the JSON). On CPU read ratios, not absolute
times (PERFORMANCE.md); set ``engine.num_threads`` for stable timings.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from adaflash_ray.config import RecipeError, RunConfig, add_recipe_args, config_from_args
from adaflash_ray.data import encode_prompts, ensure_target, load_eval_prompts, load_tokenizer
from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.models.factory import build_drafter, load_target

def _run(engine: SpecEngine, prompts: list[list[int]], max_new: int, mode: str) -> tuple[list, float]:
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new), mode=mode)
    return reqs, time.perf_counter() - t0


def bench(cfg: RunConfig, drafter_path: str | None, concurrency: list[int], num_prompts: int,
          max_new_tokens: int) -> dict:
    """Run AR / fixed / the recipe's policy at each concurrency; returns the JSON-able results."""
    torch.set_num_threads(cfg.engine.num_threads)
    model_dir = ensure_target(cfg.model.path or cfg.model.name)
    tok = load_tokenizer(model_dir)
    prompts = list(encode_prompts(tok, load_eval_prompts(cfg.data.eval_sources, num_prompts, cfg.seed + 1),
                                  cfg.data.max_prompt_tokens))
    target = load_target(cfg.model)
    drafter, head = build_drafter(target, cfg.drafter, cfg.length_head, seed=cfg.seed, init_path=drafter_path)
    policies = ["fixed"] + ([cfg.length_head.policy] if cfg.length_head.policy != "fixed" else [])
    rows = []
    for conc in concurrency:
        def engine(policy):
            return SpecEngine(target, drafter, head, policy=policy, rate=cfg.length_head.rate,
                              min_len=cfg.length_head.min_len, max_batch_size=conc,
                              max_seq_len=cfg.engine.max_seq_len)
        ar_engine = engine("fixed")
        ar_reqs, ar_s = _run(ar_engine, prompts, max_new_tokens, "ar")
        ar_tokens = sum(len(r.output_ids) for r in ar_reqs)
        rows.append({"method": "ar", "concurrency": conc, "tokens_per_s": ar_tokens / ar_s, "speedup": 1.0,
                     "accept_len": 1.0, "acceptance_rate": None, "draft_waste": None, "gamma_hist": {},
                     "lossless": True, "seconds": ar_s})
        for policy in policies:
            eng = engine(policy)
            reqs, secs = _run(eng, prompts, max_new_tokens, "spec")
            st = eng.stats
            toks = sum(len(r.output_ids) for r in reqs)
            rows.append({"method": "dflash" if policy == "fixed" else f"adaflash-{policy}", "concurrency": conc,
                         "tokens_per_s": toks / secs, "speedup": (toks / secs) / (ar_tokens / ar_s),
                         "accept_len": st.accept_len,
                         "acceptance_rate": st.num_accepted / st.num_drafted if st.num_drafted else 0.0,
                         "draft_waste": st.draft_waste, "gamma_hist": dict(sorted(st.draft_len_hist.items())),
                         "lossless": [r.output_ids for r in reqs] == [r.output_ids for r in ar_reqs],
                         "seconds": secs})
    return {"model": cfg.model.name, "drafter": drafter_path or "untrained (recipe init)",
            "block_size": cfg.drafter.block_size, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "device": cfg.model.device, "dtype": cfg.model.dtype, "threads": cfg.engine.num_threads,
            "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaflash_ray.bench", description=__doc__.split("\n")[0])
    add_recipe_args(parser)
    parser.add_argument("--drafter", default=None, help="DFlash checkpoint dir (e.g. runs/<run>/checkpoints/v5)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    ns = parser.parse_args(argv)
    if min(ns.concurrency) < 1 or ns.num_prompts < 1 or ns.max_new_tokens < 1:
        parser.error("--concurrency, --num-prompts and --max-new-tokens must be >= 1")
    try:
        cfg = config_from_args(ns)
        out = bench(cfg, ns.drafter, ns.concurrency, ns.num_prompts, ns.max_new_tokens)
    except (RecipeError, ValueError) as e:  # includes CheckpointError (a ValueError)
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = Table(title=f"{out['model']} | drafter {out['drafter']} | block_size {out['block_size']} | "
                        f"{out['num_prompts']} prompts x {out['max_new_tokens']} tokens | τ = mean(a+1)")
    for col in ("method", "conc", "τ", "accept rate", "draft waste", "γ hist", "tok/s", "speedup", "lossless"):
        table.add_column(col)
    for r in out["results"]:
        table.add_row(r["method"], str(r["concurrency"]), f"{r['accept_len']:.3f}",
                      "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}",
                      "-" if r["draft_waste"] is None else f"{r['draft_waste']:.3f}",
                      " ".join(f"{k}:{v}" for k, v in r["gamma_hist"].items()) or "-",
                      f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x", str(r["lossless"]))
    Console().print(table)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
