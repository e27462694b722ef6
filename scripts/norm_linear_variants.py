"""The fused norm + linear kernel (kernels/norm_linear.py) in launch variants against the unfused path, on CUDA.

For each layer GEMM of the Qwen3-8B and SmolLM2-135M shapes (q/k/v after the input norm, gate/up + SwiGLU after the
post-attention norm, o_proj and down_proj without a norm) and rows 1 / 16 / 64 / 1024: µs per call (20 calls per CUDA
graph, median of 5 replays) of the unfused path (``add_rmsnorm`` then ``F.linear`` - then ``swiglu`` - or
``F.linear`` alone), of the kernel's default launch and of each (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) variant,
with the weights' read at each time as GB/s. Writes JSON lines to the path given (default stdout). Needs only torch
and triton: no install step.

    python scripts/norm_linear_variants.py $OUT/norm_linear_variants.jsonl
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from adaflash_ray.kernels import norm_linear as nl
from adaflash_ray.kernels.fused_norm import add_rmsnorm
from adaflash_ray.kernels.swiglu import swiglu
from adaflash_ray.models.target import graph_replay_ms

#: (shape, hidden, intermediate, q/k/v width)
SHAPES = (("qwen3-8b", 4096, 12288, (32 + 2 * 8) * 128), ("smollm2-135m", 576, 1536, (9 + 2 * 3) * 64))


def timed(fn) -> float:
    """µs per call: the median of 5 replays of a CUDA graph of 20 calls."""
    return 1e3 * statistics.median(graph_replay_ms(fn, 5, 20))


def main() -> None:
    sink = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout
    for shape, hidden, inter, qkv_n in SHAPES:
        gemms = (("qkv", hidden, qkv_n, True, False), ("gate_up", hidden, 2 * inter, True, True),
                 ("o_proj", hidden, hidden, False, False),  # Hq * D = hidden in both shapes
                 ("down", inter, hidden, False, False))
        for name, k, n, norm, glu in gemms:
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
            nw = torch.ones(k, device="cuda").bfloat16()
            for rows in (1, 16, 64, 1024):
                x = torch.randn(rows, k, device="cuda").bfloat16()
                d = torch.randn_like(x)
                if norm:
                    def unfused():
                        _, h = add_rmsnorm(x, d, nw, 1e-6)
                        y = F.linear(h, w)
                        return swiglu(y) if glu else y
                else:
                    def unfused():
                        return F.linear(x, w)

                def fused(launch=None):
                    return nl.norm_linear(x, d if norm else None, nw if norm else None, 1e-6, w, swiglu=glu,
                                          launch=launch)[1]
                gb = w.numel() * w.element_size() / 1e9
                row = {"shape": shape, "gemm": name, "rows": rows, "k": k, "n": n,
                       "unfused_us": timed(unfused), "default_us": timed(fused),
                       "default_launch": [*nl.launch_tiles(rows, k, glu), nl.NUM_WARPS, nl.NUM_STAGES]}
                row["default_gb_per_s"] = gb / (row["default_us"] * 1e-6)
                row["unfused_gb_per_s"] = gb / (row["unfused_us"] * 1e-6)
                base = fused()
                best = None
                for bm, bn, bk, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8),
                                                                   (3,)):
                    if bm > max(16, rows):
                        continue
                    key = f"m{bm}_n{bn}_k{bk}_w{warps}_s{stages}"
                    try:
                        launch = (bm, bn, bk, warps, stages)
                        out = fused(launch)
                        us = timed(lambda: fused(launch))
                        err = (out.float() - base.float()).abs().max().item()
                        row[key] = {"us": us, "max_diff": err}
                        if best is None or us < best[1]:
                            best = (key, us)
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                        row[key] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                row["best"] = best
                print(json.dumps(row), file=sink, flush=True)
                print(shape, name, rows, f"unfused {row['unfused_us']:.1f} default {row['default_us']:.1f} "
                      f"best {best}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
