#!/usr/bin/env bash
# Is the split-K decode attention (ADAFLASH_FUSED_ATTENTION=on, every decode / verify width) lossless, and what does
# it buy? One call on ONE H200, after calls a and b of scripts/gpu_main_job.sh (this one with carry [".gpu_stage3"]):
#   ADAFLASH_COMMIT=<sha> bash scripts/gpu_splitk_check.sh
# Steps (each under its own timeout; a failed one is reported and the next still runs), all into $OUT/splitk.tar.gz:
# 1. the split-K row-invariance gpu test (tests/test_fused_kernels.py -k same_bits)           -> tests.log
# 2. scripts/check_attention_invariance.py for both shapes                                    -> invariance.jsonl
#    scripts/check_forward_invariance.py for both shapes (whole forward, SDPA and split-K)     -> forward_invariance.jsonl
#    the Qwen3-8B shape bench with split-K on, batch 1 and 64                                 -> bench_8b_on.json/.log
# 3. the hybrid bench (scripts/gpu_hybrid_bench.sh) with ADAFLASH_FUSED_ATTENTION=on, concurrency 1 and 64, code and
#    chat, methods $HYBRID_METHODS (default ar adaflash-cost ngram suffix hybrid)             -> hybrid_bench.tar.gz
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh
env_setup
OUT="${OUT:-/tmp/gpu_splitk_out}"
W="$(mktemp -d)"
mkdir -p "$OUT"
{ echo "commit ${ADAFLASH_COMMIT:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv; } > "$W/steps.txt"
step() { timed_step "$W/steps.txt" "$@"; }  # step NAME TIMEOUT_S CMD...
step same_bits 100 bash -c "python3 -m pytest -q -m gpu tests/test_fused_kernels.py -k same_bits -p no:cacheprovider \
  > '$W/tests.log' 2>&1"
tail -3 "$W/tests.log"
for shape in smollm2-135m qwen3-8b; do
  step "invariance_$shape" 60 bash -c "python3 scripts/check_attention_invariance.py --shape $shape >> '$W/invariance.jsonl' \
    2>> '$W/invariance.err'"
done
cat "$W/invariance.jsonl"
for shape in smollm2-135m qwen3-8b; do  # the whole forward: a verify row's logits vs the AR step's
  step "forward_invariance_$shape" 60 bash -c "python3 scripts/check_forward_invariance.py --shape $shape \
    >> '$W/forward_invariance.jsonl' 2>> '$W/forward_invariance.err'"
done
python3 -c "
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r['shape'], r['mode'], 'b', r['batch'], 'w', r['width'], 'pad', r['pad'], 'logits', r['max_logits'],
          'first layer', r['first_layer_differing'], 'argmax same', all(x['same_argmax'] for x in r['rows']))
" "$W/forward_invariance.jsonl"
step bench_8b_on 90 bash -c "ADAFLASH_FUSED_ATTENTION=on python3 -m adaflash_ray.bench --shape qwen3-8b \
  --concurrency 1 64 --max-new-tokens 32 --num-iters 10 --out '$W/bench_8b_on.json' > '$W/bench_8b_on.log' 2>&1"
grep -E "ar |dflash|floor" "$W/bench_8b_on.log" | head -8
step hybrid_on 420 env HYBRID_METHODS="${HYBRID_METHODS:-ar adaflash-cost ngram suffix hybrid}" OUT="$W" \
  GPU_TESTS=0 T08=0 C1_TIMEOUT="${C1_TIMEOUT:-200}" C64_TIMEOUT="${C64_TIMEOUT:-150}" ADAFLASH_FUSED_ATTENTION=on \
  bash scripts/gpu_hybrid_bench.sh
cat "$W/steps.txt"
tar -czf "$OUT/splitk.tar.gz" -C "$W" . && ls -la "$OUT"
