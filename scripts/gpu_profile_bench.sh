#!/usr/bin/env bash
# One bench cell per domain profiled on the GPU (adaflash_ray.step_profile through `bench --profile`): per method the
# host phases and device time of its steps by kind and shape, the kernels per step, and a cProfile of the host.
# Needs the model staged like scripts/gpu_hybrid_bench.sh (calls a and b of scripts/gpu_main_job.sh first, this one
# with carry [".gpu_stage3"]) and a drafter (`bash scripts/gpu_main_job.sh drafter` -> /root/dr/vN).
#   PROFILE_CONC=8 PROFILE_METHODS="ar dflash hybrid" bash scripts/gpu_profile_bench.sh --drafter /root/dr/v6
# Extra arguments go to the bench. Everything comes back as ONE file, $OUT/profile_bench.tar.gz (bench JSON and log,
# one profile JSON per cell and method).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh  # STAGE, env_setup, prepare_model (returns before its subcommands)
OUT="${OUT:-/tmp/gpu_profile_bench_out}"
W="$(mktemp -d)"
env_setup
prepare_model > "$W/prepare.log" 2>&1 || { cat "$W/prepare.log"; echo "prepare_model failed" >&2; exit 1; }
read -r -a METHODS <<< "${PROFILE_METHODS:-ar dflash hybrid}"
timeout "${PROFILE_TIMEOUT:-420}" python3 -m adaflash_ray.bench --recipe recipes/smollm2_135m_gpu.yaml \
  --methods "${METHODS[@]}" --concurrency ${PROFILE_CONC:-8} --domains ${PROFILE_DOMAINS:-code chat} \
  --num-prompts "${PROFILE_PROMPTS:-32}" --max-new-tokens 256 --warmup repeat --repeats 1 \
  --out "$W/bench.json" --profile "$W/profile" "$@" > "$W/bench.log" 2>&1
echo "bench rc $?"
grep -E "profile|tok/s" "$W/bench.log" | tail -20
mkdir -p "$OUT" && tar -czf "$OUT/profile_bench.tar.gz" -C "$W" . && ls -la "$OUT"
