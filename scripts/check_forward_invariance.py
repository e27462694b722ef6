"""Is a verify forward's row the same bits as the AR step at that position? (the whole target forward, CUDA, bf16)

Greedy speculative decoding reproduces AR token for token only if every verify row's logits equal the width-1 AR
step's at the same position. For random weights of a real shape (all layers), attention ``off`` (SDPA) and ``on``
(the split-K kernel), this prefills the same prompt into two caches, then
- AR: ``width`` width-1 steps (rows are slots, the engine's span bucket for each step), tokens t_0..t_{W-1};
- verify: one width-``W`` forward over t_0..t_{W-1} (span = the next bucket above), optionally padded to a larger
  width bucket with junk tokens (``--pad``), optionally with 63 other slots in the batch (``--batch 64``);
and prints, per mode, the max abs difference per verify row of the logits and of the last hidden state, and per
layer of the residual stream (captured features) for the worst row, as one JSON line per case (0.0 = bitwise).

Run (GPU): python scripts/check_forward_invariance.py [--shape smollm2-135m] [--layers N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from adaflash_ray.shapes import build_random_target, shape_config


def _span(need: int, bucket: int = 64) -> int:
    return -(-need // bucket) * bucket


@torch.no_grad()
def run_case(target, mode: str, batch: int, prompt: int, width: int, pad: int, seed: int) -> dict:
    target.fused_attention = mode
    dev = "cuda"
    v = target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, v, (batch, prompt), generator=g).to(dev)
    toks = torch.randint(10, v, (batch, width), generator=g).to(dev)
    junk = torch.randint(10, v, (batch, pad), generator=g).to(dev)
    layers = list(range(target.config.num_hidden_layers))
    caches = []
    for _ in range(2):
        c = target.new_kv_cache(batch, prompt + width + pad + 80)
        target(ids, torch.arange(prompt, device=dev).expand(batch, prompt), cache=c,
               slot_ids=torch.arange(batch, device=dev))
        caches.append(c)
    ar_logits, ar_hidden, ar_feats = [], [], []
    for j in range(width):
        pos = torch.full((batch, 1), prompt + j, device=dev, dtype=torch.long)
        o = target(toks[:, j:j + 1], pos, cache=caches[0], rows_are_slots=True, span=_span(prompt + j + 1),
                   capture_layer_ids=layers, logits_dtype=None)
        ar_logits.append(o.logits[:, 0])
        ar_hidden.append(o.last_hidden[:, 0])
        ar_feats.append(o.features[:, 0])
    w = width + pad
    inp = torch.cat([toks, junk], 1)
    pos = prompt + torch.arange(w, device=dev).expand(batch, w).contiguous()
    o = target(inp, pos, cache=caches[1], rows_are_slots=True, span=_span(prompt + w + 16),
               capture_layer_ids=layers, logits_dtype=None)
    hs = target.config.hidden_size
    rows = []
    worst, worst_err = 0, -1.0
    for j in range(width):
        dl = (o.logits[0, j].float() - ar_logits[j][0].float()).abs().max().item()
        dh = (o.last_hidden[0, j].float() - ar_hidden[j][0].float()).abs().max().item()
        same_argmax = bool(o.logits[0, j].argmax() == ar_logits[j][0].argmax())
        rows.append({"row": j, "logits": dl, "hidden": dh, "same_argmax": same_argmax})
        if dh > worst_err:
            worst, worst_err = j, dh
    f_v = o.features[0, worst].float().view(len(layers), hs)
    f_a = ar_feats[worst][0].float().view(len(layers), hs)
    per_layer = (f_v - f_a).abs().amax(1).tolist()
    first = next((i for i, e in enumerate(per_layer) if e > 0), None)
    return {"mode": mode, "batch": batch, "prompt": prompt, "width": width, "pad": pad,
            "max_logits": max(r["logits"] for r in rows), "max_hidden": max(r["hidden"] for r in rows),
            "rows": rows, "worst_row": worst, "first_layer_differing": first,
            "per_layer_worst_row": [round(e, 6) for e in per_layer]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's own layer count")
    ap.add_argument("--modes", nargs="+", default=["off", "on"])
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    cfg = shape_config(ns.shape)
    if ns.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=ns.layers)
    target = build_random_target(cfg, "cuda", torch.bfloat16)
    target.fuse_projections()
    target.use_fused_kernels("auto")
    for mode in ns.modes:
        for batch, prompt, width, pad in ((1, 100, 16, 0), (1, 100, 5, 3), (1, 250, 8, 0), (1, 120, 2, 2),
                                          (64, 100, 16, 0), (64, 250, 6, 2)):
            r = run_case(target, mode, batch, prompt, width, pad, seed=prompt + width)
            r["shape"] = ns.shape
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
