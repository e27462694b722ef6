"""Is one query row's decode attention the same bits whatever else is in its forward? (CUDA, bf16)

Greedy speculative decoding is token-for-token AR's output only if the verify forward computes each position's
logits as the AR step does. This measures, for one layer of a model shape, the row at position ``p`` of slot 0:
- alone (width 1, the AR step), span ``p + 1`` and a larger span (what a CUDA graph bucket reads);
- as the first row of a width-16 verify block (positions p..p+15);
- with 63 other slots in the batch;
for the split-K kernel (adaflash_ray.kernels.decode_attention) and the SDPA reference path
(``decode_attention_ref``: SDPA over the cache with the additive mask), and prints the max abs difference to the
width-1 / span p+1 / batch-1 result of the same kernel (0.0 = bitwise equal) as one JSON line.

Run (GPU): python scripts/check_attention_invariance.py [--shape smollm2-135m] [--position 300]
"""
from __future__ import annotations

import argparse
import json

import torch

from adaflash_ray.kernels.decode_attention import decode_attention, decode_attention_ref
from adaflash_ray.shapes import shape_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--position", type=int, default=300)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    cfg = shape_config(ns.shape)
    dev, dt = torch.device("cuda"), torch.bfloat16
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    rep = cfg.num_attention_heads // hkv
    slots, p = 64, ns.position
    k = torch.randn(slots, ns.max_seq_len, hkv, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q16 = torch.randn(slots, hkv, 16 * rep, d, device=dev, dtype=dt)  # rows t*rep + r: position p + t

    def run(fn, batch: int, width: int, span: int) -> torch.Tensor:
        qg = q16[:batch, :, : width * rep].contiguous()
        rows = torch.arange(batch, device=dev)
        pos = (p + torch.arange(width, device=dev)).expand(batch, width).contiguous()
        out = fn(qg, k, v, rows, pos, span)
        return out[0, 0].float()  # slot 0, position p: [Hq*D]

    cases = {"w1_span_p+1_b1": (1, 1, p + 1), "w1_span_max_b1": (1, 1, ns.max_seq_len),
             "w16_span_p+16_b1": (1, 16, p + 16), "w16_span_max_b1": (1, 16, ns.max_seq_len),
             "w1_span_p+1_b64": (64, 1, p + 1), "w16_span_max_b64": (64, 16, ns.max_seq_len)}
    report = {"shape": ns.shape, "position": p, "dtype": "bfloat16", "device": torch.cuda.get_device_name(0)}
    for name, fn in (("split_k", decode_attention), ("sdpa_ref", decode_attention_ref)):
        outs = {c: run(fn, *args) for c, args in cases.items()}
        base = outs["w1_span_p+1_b1"]
        report[name] = {c: float((o - base).abs().max()) for c, o in outs.items()}
    sk, ref = run(decode_attention, 1, 1, p + 1), run(decode_attention_ref, 1, 1, p + 1)
    report["split_k_vs_sdpa_ref_w1"] = float((sk - ref).abs().max())
    print(json.dumps(report))


if __name__ == "__main__":
    main()
