"""One layer's decode attention in launch variants (stages, warps) against the kernel's own launch and SDPA, on CUDA:
µs per call (20 calls per CUDA graph, median of 5 replays) and whether each variant's output is bitwise the default's.
Writes JSON lines to the path given (default stdout). Needs only torch and triton: no install step.

    python scripts/attention_variants.py $OUT/attention_variants.jsonl
"""
from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from adaflash_ray.kernels import decode_attention as da
from adaflash_ray.kernels.reference import fold_queries, folded_attention, gqa_mask
from adaflash_ray.models.target import graph_replay_ms


def timed(fn) -> float:
    """µs per call: the median of 5 replays of a CUDA graph of 20 calls."""
    return 1e3 * statistics.median(graph_replay_ms(fn, 5, 20))


def launch_with(qg, kc, vc, rows, pos, span, splits, stages, warps):
    """decode_attention's launch with the split kernel's ``num_stages`` / ``num_warps`` set."""
    b, hkv, m, d = qg.shape
    w = pos.shape[1]
    out = torch.empty((b, w, hkv * (m // w) * d), dtype=qg.dtype, device=qg.device)
    da._launch(qg, kc, vc, rows, pos, span, splits, 64, out, num_stages=stages, num_warps=warps)
    return out


def main() -> None:
    sink = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout
    span = 768
    for shape, hq, hkv, d in (("qwen3-8b", 32, 8, 128), ("smollm2-135m", 9, 3, 64)):
        for batch, width in ((64, 16), (64, 1), (8, 16), (1, 1)):
            kc = torch.randn(batch, span, hkv, d, device="cuda").bfloat16()
            vc = torch.randn_like(kc)
            q = fold_queries(torch.randn(batch, width, hq, d, device="cuda").bfloat16(), hkv)
            rows = torch.arange(batch, device="cuda")
            pos = (span - 32 - width + torch.arange(width, device="cuda")).expand(batch, width).contiguous()
            mask = gqa_mask(torch.arange(span, device="cuda")[None, None, :] <= pos[:, :, None], hq // hkv, q.dtype)
            base = da.decode_attention(q, kc, vc, rows, pos, span)
            row = {"shape": shape, "batch": batch, "width": width, "span": span,
                   "sdpa_us": timed(lambda: folded_attention(q, kc, vc, mask, width)),
                   "default_us": timed(lambda: da.decode_attention(q, kc, vc, rows, pos, span))}
            for splits in (1, math.ceil(span / 64)):
                for stages in (2, 3, 4):
                    for warps in (4, 8):
                        key = f"splits{splits}_stages{stages}_warps{warps}"
                        try:
                            out = launch_with(q, kc, vc, rows, pos, span, splits, stages, warps)
                            row[key] = {"us": timed(lambda: launch_with(q, kc, vc, rows, pos, span, splits, stages,
                                                                           warps)),
                                        "same_bits": bool(torch.equal(out, base))}
                        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                            row[key] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            print(json.dumps(row), file=sink, flush=True)
            print(shape, batch, width, {k: (v if not isinstance(v, dict) else v.get("us", v.get("error")))
                                        for k, v in row.items() if k not in ("shape", "batch", "width", "span")},
                  flush=True)


if __name__ == "__main__":
    main()
