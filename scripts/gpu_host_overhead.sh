#!/usr/bin/env bash
# Where the cost policy's γ = 0 step loses time against the AR step, and the Qwen3-8B shape with the split-K attention
# on: one call on ONE GPU, right after the install step of scripts/gpu_main_job.sh (carry [".gpu_stage"]):
#   bash scripts/gpu_main_job.sh a && ADAFLASH_COMMIT=<sha> bash scripts/gpu_host_overhead.sh
# Steps (each under its own timeout), all into $OUT/host_overhead.tar.gz:
# 0. scripts/check_forward_invariance.py, both shapes: verify rows vs AR steps, SDPA and split-K -> forward_invariance.jsonl
# 1. scripts/time_graph_replay.py: each captured graph's replay, host and device, ar vs gamma0  -> replay.jsonl
# 2. scripts/profile_step_phases.py ar gamma0, batch 1 and 64, --sync (device time inside launch) -> phases_sync.log
# 3. the same at batch 1 without --sync, under cProfile                                                      -> phases_cprofile.log
# 4. python -m adaflash_ray.bench --shape qwen3-8b, ADAFLASH_FUSED_ATTENTION=off then on            -> bench_8b_*.json/.log
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh
env_setup
OUT="${OUT:-/tmp/gpu_host_overhead_out}"
W="$(mktemp -d)"
mkdir -p "$OUT"
echo "commit ${ADAFLASH_COMMIT:-unknown}" > "$W/steps.txt"
step() { timed_step "$W/steps.txt" "$@"; }  # step NAME TIMEOUT_S CMD...
for shape in smollm2-135m qwen3-8b; do
  step "forward_invariance_$shape" 60 bash -c "python3 scripts/check_forward_invariance.py --shape $shape \
    >> '$W/forward_invariance.jsonl' 2>> '$W/forward_invariance.err'"
done
python3 -c "
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r['shape'], r['mode'], 'b', r['batch'], 'w', r['width'], 'pad', r['pad'], 'logits', r['max_logits'],
          'hidden', r['max_hidden'], 'first layer', r['first_layer_differing'],
          'argmax same', all(x['same_argmax'] for x in r['rows']))
" "$W/forward_invariance.jsonl"
step replay 70 bash -c "python3 scripts/time_graph_replay.py --batch 1 64 > '$W/replay.jsonl' 2> '$W/replay.err'"
cat "$W/replay.jsonl"
step phases_sync 100 bash -c "python3 scripts/profile_step_phases.py --methods ar gamma0 --batch 1 64 --sync \
  > '$W/phases_sync.log' 2>&1"
grep -E "^(ar|gamma0) |gamma0 host" "$W/phases_sync.log"
step phases_cprofile 60 bash -c "python3 scripts/profile_step_phases.py --methods ar gamma0 --batch 1 \
  --cprofile ar gamma0 > '$W/phases_cprofile.log' 2>&1"
grep -E "^(ar|gamma0) |gamma0 host" "$W/phases_cprofile.log"
for split in off on; do
  step "bench_8b_$split" 90 bash -c "ADAFLASH_FUSED_ATTENTION=$split python3 -m adaflash_ray.bench --shape qwen3-8b \
    --concurrency 1 64 --max-new-tokens 32 --num-iters 10 --out '$W/bench_8b_$split.json' > '$W/bench_8b_$split.log' 2>&1"
  grep -E "ar |dflash|floor" "$W/bench_8b_$split.log" | head -8
done
cat "$W/steps.txt"
tar -czf "$OUT/host_overhead.tar.gz" -C "$W" . && ls -la "$OUT"
