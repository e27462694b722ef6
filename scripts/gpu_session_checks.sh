#!/usr/bin/env bash
# One wheels-only `device` call (kind nvidia-h200, carry [".gpu_stage/whl", ".gpu_stage3/head.tar"]; no model, no Ray):
#   tar -xf .gpu_stage3/head.tar && ADAFLASH_COMMIT=<sha> bash scripts/gpu_session_checks.sh
# (head.tar = `git archive HEAD`: the device's copy of the tree then holds exactly the commit, whatever is
# uncommitted here). Steps, each under its own timeout, output tarred into ONE file $OUT/session_checks.tar.gz:
# 1. gpu tests: sampling parameters, the drafter's and the target's fused kernels, tests/test_gpu.py   -> tests.log
# 2. the decode step's phases per method, random SmolLM2-shape weights, batch 1 and 64 (scripts/profile_step_phases.py)
# 3. Qwen3-8B shape bench, fused kernels off and on, batch 1 and 64 (AR step, verify ratio, propose share)
# 4. kernels per drafter layer on the propose and append paths, off and on (shapes.count_propose_kernels)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh
install_wheels .gpu_stage/whl || exit 1
env_setup
OUT="${OUT:-/tmp/gpu_session_checks_out}"
W="$(mktemp -d)"
mkdir -p "$OUT"
step() {  # step NAME TIMEOUT_S CMD...: output into W/NAME.log, status into W/steps.txt
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  echo "$name: rc $? $(( $(date +%s) - t0 )) s" | tee -a "$W/steps.txt"
}
{ echo "commit ${ADAFLASH_COMMIT:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$W/versions.txt" 2>&1
step tests "${TESTS_TIMEOUT:-220}" python3 -m pytest -q -m gpu -p no:logging -p no:cacheprovider \
  tests/test_gpu_sampling.py tests/test_drafter_kernels.py tests/test_fused_kernels.py tests/test_gpu.py
tail -3 "$W/tests.log"
step phases 100 python3 scripts/profile_step_phases.py --shape smollm2-135m --batch 1 64 --new-tokens 256
grep -v '^{' "$W/phases.log" | tail -12
for mode in off auto; do
  step "qwen3_8b_$mode" 100 env ADAFLASH_FUSED_KERNELS=$mode python3 -m adaflash_ray.bench --shape qwen3-8b \
    --concurrency 1 64 --max-new-tokens 32 --num-iters 10 --out "$W/bench_qwen3-8b_$mode.json"
  grep -E "propose|ar " "$W/qwen3_8b_$mode.log" | head -6
done
step propose_counts 80 python3 -c "
import json
from adaflash_ray.shapes import count_propose_kernels
rows = [count_propose_kernels(s, fused=f, batch=1) for s in ('qwen3-8b', 'smollm2-135m') for f in (False, True)]
json.dump(rows, open('$W/propose_kernel_counts.json', 'w'), indent=1)
for r in rows:
    print(r.get('shape'), r.get('fused_active'), {p: r[p]['per_layer'] for p in ('propose', 'append')})
"
cat "$W/propose_counts.log" | tail -5
tar -czf "$OUT/session_checks.tar.gz" -C "$W" . && ls -la "$OUT"
