#!/usr/bin/env bash
# The fused Triton kernels of adaflash_ray/kernels on one GPU: their gpu tests, kernels per layer in the captured
# decode / verify graph and in the drafter's captured propose / context append (torch.profiler), and the
# random-weight shape benches with the kernels off and on (target and drafter alike: the bench's propose share).
#
# Runs in the same `run` call right after the install step of scripts/gpu_main_job.sh (carry [".gpu_stage"]):
#     bash scripts/gpu_main_job.sh a && ADAFLASH_COMMIT=<sha> bash scripts/gpu_kernels.sh
# It sources that script for its env_setup (PYTHONPATH onto the installed wheels). KERNELS_BUDGET_S (default 420) bounds
# its own wall time: each step gets at most its own limit and what is left, in this order (most wanted first):
# gpu tests (130 s or KERNELS_TESTS_S; KERNELS_TESTS_K: a pytest -k filter), attention timing (60 s), Qwen3-8B shape bench with SDPA,
# with the calibrated split-K choice, and with that plus the fused norm + linear (120 s each), the same for the
# SmolLM2 shape (50 s each), kernel counts
# (60 s), drafter kernel counts (90 s), both shapes with the kernels off (50 s, 120 s). A step cut short
# leaves its rc (124) in steps.txt. KERNELS_MODES (default "off sdpa auto linear linear-all linear-decode") picks the bench modes;
# KERNELS_SKIP names steps to leave out (e.g. "tests attention_micro"). Run after call a in a call of its own (the machine keeps /root/stage while
# warm), KERNELS_BUDGET_S=590 (a call may run 600 s); ADAFLASH_COMMIT goes into summary.json. $OUT/kernels holds
# more than the 8 files a call brings back: tar it into one file at the end of the call.
# Writes under $OUT/kernels/:
#   tests.log                         pytest -q -m gpu tests/test_fused_kernels.py tests/test_drafter_kernels.py
#   kernel_counts.json                count_forward_kernels for both shapes, fused on, split-K off/on, (batch, width)
#                                     (1,1) (1,16) (64,1)
#   propose_kernel_counts.json        count_propose_kernels (drafter propose + context append) for both shapes,
#                                     fused off/on, batch 1 and 8
#   bench_<shape>_<mode>.json/.log   python -m adaflash_ray.bench --shape <shape>; mode off (ADAFLASH_FUSED_KERNELS=off),
#                                     sdpa (kernels on, ADAFLASH_FUSED_ATTENTION=off), auto (kernels on, the engine's
#                                     one kernel: split-K iff its calibration measured it faster at each batch bucket),
#                                     linear (auto + ADAFLASH_FUSED_LINEAR=on: kernels/norm_linear.py), linear-all
#                                     (ADAFLASH_FUSED_LINEAR=all), linear-decode (=decode: all up to 16 token rows),
#                                     rotary (auto with ADAFLASH_ROTARY_ATTENTION=fused), linear-residual
#                                     (=residual: o_proj / down_proj only, up to 16 token rows; with rotary)
#   attention_micro.json              one layer's attention (Qwen3-8B and SmolLM2 shapes, batch 1 / 8 / 64, width 1 / 16):
#                                     SDPA + mask vs the split-K kernel (its launch; one pass; split + merge), ms per call
#   summary.json                      AR step / verify ratio / propose ms and share off vs on, kernels per layer
#                                     (target forward, drafter propose and append), commit
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh  # STAGE, env_setup (returns before its subcommands)
env_setup
OUT="${OUT:-/tmp/gpu_kernels_out}"
K="$OUT/kernels"
mkdir -p "$K"
DEADLINE=$(( $(date +%s) + ${KERNELS_BUDGET_S:-420} ))
left() { local l=$(( DEADLINE - $(date +%s) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
run_step() {  # run_step MAX_S NAME CMD...: at most MAX_S seconds (less if the budget is short); logs its status
  local max=$1 name=$2; shift 2
  if [[ " ${KERNELS_SKIP:-} " == *" $name "* ]]; then echo "$name: skipped (KERNELS_SKIP)" | tee -a "$K/steps.txt"; return 0; fi
  local t=$(left "$max")
  if [ "$t" -lt 10 ]; then echo "$name: skipped (budget spent)" | tee -a "$K/steps.txt"; return 0; fi
  local t0=$(date +%s)
  timeout "$t" "$@"
  local rc=$?
  echo "$name: rc=$rc wall $(( $(date +%s) - t0 )) s (limit $t s)" | tee -a "$K/steps.txt"
}
: > "$K/steps.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))" \
  2>&1 | tee "$K/versions.txt"

run_step "${KERNELS_TESTS_S:-130}" tests bash -c "python3 -m pytest -q -m gpu tests/test_fused_kernels.py tests/test_drafter_kernels.py \
  -p no:cacheprovider ${KERNELS_TESTS_K:+-k '$KERNELS_TESTS_K'} > '$K/tests.log' 2>&1"
tail -3 "$K/tests.log"


# one layer's attention at the Qwen3-8B and SmolLM2 shapes: SDPA with the additive mask (what the engine runs) vs the
# split-K kernel in the launch it picks (split_k_ms) and in each launch (one pass: one_pass_ms; split + merge, one
# program per 64-key tile: split_ms), 20 calls per CUDA graph, median of 5 replays
run_step 60 attention_micro python3 - "$K/attention_micro.json" <<'EOF'
import json, math, statistics, sys, torch
from adaflash_ray.kernels.decode_attention import decode_attention
from adaflash_ray.kernels.reference import fold_queries
from adaflash_ray.models.layers import folded_attention, gqa_mask
from adaflash_ray.models.target import graph_replay_ms
span = 768
rows_out = []
for shape, hq, hkv, d in (("qwen3-8b", 32, 8, 128), ("smollm2-135m", 9, 3, 64)):
    for batch in (1, 8, 64):
        kc = torch.randn(batch, span, hkv, d, device="cuda").bfloat16()
        vc = torch.randn_like(kc)
        for width in (1, 16):
            q = fold_queries(torch.randn(batch, width, hq, d, device="cuda").bfloat16(), hkv)
            rows = torch.arange(batch, device="cuda")
            pos = (span - 32 - width + torch.arange(width, device="cuda")).expand(batch, width).contiguous()
            res = {"shape": shape, "batch": batch, "width": width, "span": span}
            # as the engine calls it: cache views, the mask built once per forward (outside the timing)
            mask = gqa_mask(torch.arange(span, device="cuda")[None, None, :] <= pos[:, :, None], hq // hkv, q.dtype)
            tiles = math.ceil(span / 64)
            for name, fn in (("sdpa_ms", lambda: folded_attention(q, kc[:batch, :span], vc[:batch, :span], mask, width)),
                             ("split_k_ms", lambda: decode_attention(q, kc, vc, rows, pos, span)),
                             ("one_pass_ms", lambda: decode_attention(q, kc, vc, rows, pos, span, 1)),
                             ("split_ms", lambda: decode_attention(q, kc, vc, rows, pos, span, tiles))):
                res[name] = statistics.median(graph_replay_ms(fn, 5, 20))
            # bytes of K and V the rows see (positions 0..max), over the split-K time: achieved GB/s
            res["kv_gb_per_s"] = 2 * batch * (int(pos.max()) + 1) * hkv * d * 2 / (res["split_k_ms"] * 1e-3) / 1e9
            rows_out.append(res)
            print(res, flush=True)
            json.dump(rows_out, open(sys.argv[1], "w"), indent=1)
EOF

bench() {  # bench SHAPE MODE MAX_S ARGS...: MODE off (kernels off) | sdpa (kernels on, SDPA attention) | auto
  local shape=$1 mode=$2 max=$3; shift 3  # (kernels on, split-K attention where the engine's calibration chose it)
  [[ " ${KERNELS_MODES:-off sdpa auto linear linear-all linear-decode} " == *" $mode "* ]] || return 0  # KERNELS_MODES: a subset
  local kern=auto split=auto linear=off  # | linear (auto + the add + norm fused into the q/k/v and gate/up GEMMs)
  [ "$mode" = off ] && { kern=off; split=off; }  # | linear-all (and o_proj / down_proj by the same Triton kernel)
  [ "$mode" = sdpa ] && split=off
  [ "$mode" = linear ] && linear=on
  [ "$mode" = linear-all ] && linear=all
  [ "$mode" = linear-decode ] && linear=decode  # all for <= 16 token rows (decode / verify), off above
  [ "$mode" = linear-residual ] && linear=residual  # only o_proj / down_proj by it, <= 16 token rows
  local rotary=separate  # | rotary (auto with the rotary + cache write in the split-K attention's launch)
  [ "$mode" = rotary ] && rotary=fused
  [ "$mode" = linear-residual ] && rotary=fused  # the five-launch layer: both
  run_step "$max" "bench_${shape}_$mode" env ADAFLASH_FUSED_KERNELS="$kern" ADAFLASH_FUSED_ATTENTION="$split" \
    ADAFLASH_FUSED_LINEAR="$linear" ADAFLASH_ROTARY_ATTENTION="$rotary" \
    python3 -m adaflash_ray.bench --shape "$shape" \
    "$@" --out "$K/bench_${shape}_$mode.json" > "$K/bench_${shape}_$mode.log" 2>&1
  grep -E "ar |dflash|floor" "$K/bench_${shape}_$mode.log" | head -8
}
Q=(--concurrency 1 8 64 --max-new-tokens 32 --num-iters 10)
S=(--concurrency 1 8 64 --max-new-tokens 32 --num-iters 10)
bench qwen3-8b sdpa 120 "${Q[@]}"
bench qwen3-8b auto 120 "${Q[@]}"
bench qwen3-8b rotary 120 "${Q[@]}"
bench qwen3-8b linear 120 "${Q[@]}"
bench qwen3-8b linear-all 120 "${Q[@]}"
bench qwen3-8b linear-decode 120 "${Q[@]}"
bench qwen3-8b linear-residual 120 "${Q[@]}"
bench smollm2-135m sdpa 50 "${S[@]}"
bench smollm2-135m auto 50 "${S[@]}"
bench smollm2-135m rotary 50 "${S[@]}"
bench smollm2-135m linear 50 "${S[@]}"
bench smollm2-135m linear-all 50 "${S[@]}"
bench smollm2-135m linear-decode 50 "${S[@]}"
bench smollm2-135m linear-residual 50 "${S[@]}"

run_step 60 kernel_counts python3 - "$K/kernel_counts.json" <<'EOF'
import json, os, sys
from adaflash_ray.shapes import count_forward_kernels
rows = []
for shape, fused, split_k, linear in (("qwen3-8b", True, False, "off"), ("qwen3-8b", True, True, "off"),
                                      ("qwen3-8b", True, True, "rotary"), ("qwen3-8b", True, True, "on"),
                                      ("qwen3-8b", True, True, "all"), ("qwen3-8b", True, True, "residual"),
                                      ("smollm2-135m", True, False, "off"), ("smollm2-135m", True, True, "off"),
                                      ("smollm2-135m", True, True, "rotary"), ("smollm2-135m", True, True, "on"),
                                      ("smollm2-135m", True, True, "all"), ("smollm2-135m", True, True, "decode"),
                                      ("smollm2-135m", True, True, "residual")):
    # kernels/norm_linear.py and the rotary switch: read at each forward (rotary: the one-launch rotary attention
    # alone; residual: with it)
    os.environ["ADAFLASH_FUSED_LINEAR"] = "off" if linear == "rotary" else linear
    os.environ["ADAFLASH_ROTARY_ATTENTION"] = "fused" if linear in ("rotary", "residual") else "separate"
    for batch, width in ((1, 1), (1, 16), (64, 1)):
        r = count_forward_kernels(shape, fused=fused, split_k=split_k, batch=batch, width=width)
        r["fused_linear"] = linear
        rows.append(r)
        print(f"{shape} fused={fused} split_k={split_k} linear={linear} (active {r['fused_active']}) b{batch} w{width}: "
              f"{r['per_layer']:.1f} kernels per layer, {r['per_forward']} per forward", flush=True)
        json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF

# the drafter's propose (propose_hidden + draft logits + argmax) and context append (one verify step's positions),
# each one CUDA-graph replay, kernels off / on: per drafter layer and per call (its ms share of an AR step is the
# shape benches' propose_frac_of_ar, off vs on)
run_step 90 propose_kernel_counts python3 - "$K/propose_kernel_counts.json" <<'EOF'
import json, sys
from adaflash_ray.shapes import count_propose_kernels
rows = []
for shape in ("qwen3-8b", "smollm2-135m"):
    for fused in (False, True):
        for batch in (1, 8):
            r = count_propose_kernels(shape, fused=fused, batch=batch)
            rows.append(r)
            for path in ("propose", "append"):
                p = r[path]
                print(f"{shape} {path} fused={fused} (active {r['fused_active']}) b{batch}: {p['per_layer']:.1f} "
                      f"kernels per drafter layer, {p['per_forward']} per call", flush=True)
            json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF

# the kernels off altogether (the pure-torch path), last: the budget may not reach it
bench smollm2-135m off 50 "${S[@]}"
bench qwen3-8b off 120 "${Q[@]}"

python3 - "$K" "${ADAFLASH_COMMIT:-unknown}" <<'EOF'
import json, os, sys
k, commit = sys.argv[1:]
doc = {"commit": commit, "steps": open(os.path.join(k, "steps.txt")).read().splitlines()}
for shape in ("qwen3-8b", "smollm2-135m"):
    for tag in ("off", "sdpa", "auto", "rotary", "linear", "linear-all", "linear-decode",
                "linear-residual"):
        p = os.path.join(k, f"bench_{shape}_{tag}.json")
        if not os.path.exists(p):
            continue
        b = json.load(open(p))
        vc = b["verify_cost"]
        doc[f"{shape}_{tag}"] = {
            "ar_step_ms": b["ar_step_ms"], "spec_step_ms": b["spec_step_ms"], "memory_floor_ms": b["memory_floor_ms"],
            "ar_step_x_floor": {bs: v / b["memory_floor_ms"] for bs, v in b["ar_step_ms"].items()},
            "verify_w16_over_w1": {bs: row["16"] / row["1"] for bs, row in vc.items() if "16" in row},
            "propose_ms": b["propose_ms"], "propose_frac_of_ar": b["propose_frac_of_ar"],
            "split_k_faster": {k: v["split_k"] for k, v in b.get("attention_calibration", {}).items()},
            "split_k": b.get("split_k")}
p = os.path.join(k, "attention_micro.json")
if os.path.exists(p):
    doc["attention_micro"] = json.load(open(p))
p = os.path.join(k, "kernel_counts.json")
if os.path.exists(p):
    doc["kernels_per_layer"] = {f"{r['shape']} fused={r['fused']} split_k={r['split_k']} "
                                f"linear={r.get('fused_linear', 'off')} b{r['batch']} w{r['width']}":
                                r["per_layer"]
                                for r in json.load(open(p))}
p = os.path.join(k, "propose_kernel_counts.json")
if os.path.exists(p):
    counts = json.load(open(p))
    doc["drafter_kernels"] = {f"{r['shape']} {path} fused={r['fused']} b{r['batch']}":
                              {"per_layer": r[path]["per_layer"], "per_call": r[path]["per_forward"]}
                              for r in counts for path in ("propose", "append")}
json.dump(doc, open(os.path.join(k, "summary.json"), "w"), indent=1)
print(json.dumps(doc, indent=1))
EOF
