"""The trainer's compiled step over a stream of batch shapes like the main job's: one line per step (its shape,
seconds, block count) and how many times ``torch.compile`` compiled, so that recompiles (a guard on a size, e.g. an
Inductor kernel choice that depends on how many rows a batch has) show as steps of tens of seconds. Run with
``TORCH_LOGS=recompiles`` to print which guard failed. Random weights of the recipe's shape: no model files needed.
(Until 6a01406 a ``--no-duck-shape`` flag turned Dynamo's duck sizing off; ``compile_training`` now does.)

    TORCH_LOGS=recompiles python scripts/check_compile_guards.py --recipe recipes/smollm2_135m_gpu.yaml \\
        --steps 40 [--set distill.pad_anchors_multiple=96]

The stream: ``--steps`` batches of ``distill.batch_size`` trajectories, lengths drawn as the warm start's text
(prompt 16-512 tokens; output 2-16, 8-256 or 256), grouped by output length as ``distill.warm_start_group_by_length``
groups by length, so batches of short answers (few anchors) come round as they do there; the last JSON line sums it
up. (At c2d363b and before, outputs were 8-256 or 256, sorted by prompt length: no batch of short answers only.)
"""
from __future__ import annotations

import argparse
import json
import random
import time

from adaflash_ray.config import add_recipe_args, config_from_args
from adaflash_ray.trainer_bench import bench_target, synthetic_trajectories


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_recipe_args(p)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="smollm2-135m", help="random weights of this shape (adaflash_ray.shapes)")
    args = p.parse_args()
    cfg = config_from_args(args)
    from adaflash_ray.distill.trainer import DistillTrainerCore
    import torch._dynamo.utils as dyn_utils

    target = bench_target(cfg, args.shape or None)
    dcfg = cfg.distill.model_copy(update={"features": "recompute"})
    core = DistillTrainerCore(target, cfg.drafter, cfg.length_head, dcfg, seed=cfg.seed)
    rng = random.Random(args.seed)
    b = dcfg.batch_size
    # outputs: short (2-16 tokens: one-word and multiple-choice answers), mid-length, or cut at the 256-token cap
    lens = sorted(((rng.randint(16, 512), rng.choice([rng.randint(2, 16), rng.randint(8, 256), 256]))
                   for _ in range(b * args.steps)), key=lambda pn: pn[1])  # grouped by output length
    batches = [lens[i * b:(i + 1) * b] for i in range(args.steps)]
    rng.shuffle(batches)
    vocab = target.config.vocab_size
    rows, t_all = [], time.time()
    for i, batch in enumerate(batches):
        trajs = [synthetic_trajectories(1, pl, nt, vocab, args.seed * 100003 + i * 997 + j)[0]
                 for j, (pl, nt) in enumerate(batch)]
        t0 = time.time()
        m = core.train_step(trajs)
        dt = time.time() - t0
        frames = dict(dyn_utils.counters["frames"])
        rows.append({"step": i, "seconds": round(dt, 3), "num_blocks": int(m["train/num_blocks"]),
                     "max_tokens": max(pl + nt for pl, nt in batch), "frames_ok": frames.get("ok", 0)})
        print(json.dumps(rows[-1]), flush=True)
    secs = [r["seconds"] for r in rows]
    slow = [r for r in rows if r["seconds"] > 5]
    print(json.dumps({"steps": len(rows), "total_s": round(time.time() - t_all, 1),
                      "slow_steps": [(r["step"], r["seconds"], r["num_blocks"]) for r in slow],
                      "seconds_in_slow_steps": round(sum(r["seconds"] for r in slow), 1),
                      "median_step_s": sorted(secs)[len(secs) // 2],
                      "overrides": args.overrides}))


if __name__ == "__main__":
    main()
