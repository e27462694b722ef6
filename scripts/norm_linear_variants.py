"""The fused norm + linear kernel (kernels/norm_linear.py) in launch variants against the unfused path, on CUDA.

For each layer GEMM of the Qwen3-8B and SmolLM2-135M shapes (q/k/v after the input norm, gate/up + SwiGLU after the
post-attention norm, o_proj and down_proj without a norm) and rows 1 / 8 / 16 / 64 / 1024: µs per call (20 calls per
CUDA graph, median of 5 replays) of the unfused path (``add_rmsnorm`` then ``F.linear`` - then ``swiglu`` - or
``F.linear`` alone), of the kernel's default launch (the GEMV form up to 16 rows, the tiled form above) and of each
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) variant - up to 16 rows the GEMV form's (keys ``gemv_m...``; BLOCK_N
halved for the gate/up GEMM at one row, the same weight rows a program) and the tiled form's default launch
(``tiled_us``), above 16 the tiled form's - with the weights' read at each time as GB/s. Writes JSON lines to the
path given (default stdout). Needs only torch and triton: no install step.

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
#: the GEMV form's launches timed up to 16 rows: one-row programs (FMA accumulator; BLOCK_K = 256 x warps, one
#: 16-byte vector a lane on each weight row) at one row, 16-row ``tl.dot`` tiles at every row count
GEMV_VARIANTS = ((1, 8, 1024, 4, 1), (1, 4, 1024, 4, 1), (1, 4, 2048, 8, 1), (1, 8, 512, 2, 1),
                 (16, 16, 128, 4, 3), (16, 32, 128, 4, 3), (16, 16, 256, 8, 3), (16, 32, 64, 4, 4))


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
            for rows in (1, 8, 16, 64, 1024):
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

                def fused(launch=None, gemv=None):
                    return nl.norm_linear(x, d if norm else None, nw if norm else None, 1e-6, w, swiglu=glu,
                                          launch=launch, gemv=gemv)[1]
                gb = w.numel() * w.element_size() / 1e9
                small = rows <= nl.GEMV_MAX_ROWS
                row = {"shape": shape, "gemm": name, "rows": rows, "k": k, "n": n,
                       "unfused_us": timed(unfused), "default_us": timed(fused),
                       "default_form": "gemv" if small else "tiled",
                       "default_launch": list(nl.gemv_launch(rows, k, glu)) if small else
                       [*nl.launch_tiles(rows, k, glu), nl.NUM_WARPS, nl.NUM_STAGES]}
                row["default_gb_per_s"] = gb / (row["default_us"] * 1e-6)
                row["unfused_gb_per_s"] = gb / (row["unfused_us"] * 1e-6)
                base = fused()
                best = None
                if small:
                    row["tiled_us"] = timed(lambda: fused(gemv=False))
                    variants = [("gemv_", (bm, bn // 2 if glu and bm == 1 else bn, bk, warps, stages))
                                for bm, bn, bk, warps, stages in GEMV_VARIANTS if bm == 16 or rows == 1]
                else:
                    variants = [("", v) for v in itertools.product((16, 32, 64), (64, 128), (64,), (4, 8), (3,))]
                for prefix, launch in variants:
                    key = prefix + "m{}_n{}_k{}_w{}_s{}".format(*launch)
                    try:
                        out = fused(launch, gemv=bool(prefix))
                        us = timed(lambda: fused(launch, gemv=bool(prefix)))
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
