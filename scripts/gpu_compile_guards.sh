#!/usr/bin/env bash
# The trainer's torch.compile recompiles on one GPU (scripts/check_compile_guards.py), one device call:
# carry [".gpu_stage/whl"] (bash scripts/gpu_main_job.sh stage). Three processes over the same stream of batch shapes:
# A the recipe, cold compile caches; B the same again, caches warm (what a process that compiled beforehand saves);
# C the recipe with GUARD_SET (default: anchor slots padded to distill.num_anchors), cold caches. Logs under $OUT.
set -uo pipefail
source scripts/gpu_main_job.sh
install_wheels .gpu_stage/whl || exit 1
env_setup
export TORCH_LOGS=recompiles
run() {  # run NAME CACHE_DIR [--set ...]
  local name=$1 cache=$2; shift 2
  TORCHINDUCTOR_CACHE_DIR=$cache timeout "${GUARD_TIMEOUT:-240}" python3 scripts/check_compile_guards.py \
    --recipe recipes/smollm2_135m_gpu.yaml --steps "${GUARD_STEPS:-30}" "$@" > "$OUT/guards_$name.log" 2>&1
  echo "$name rc $?: $(tail -1 "$OUT/guards_$name.log")"
  grep -A3 "Recompiling" "$OUT/guards_$name.log" | grep -E "^\S.*- |guard" | sed 's/.*__recompiles\]//' | head -8
}
# GUARD_RUNS: which of A B C (default all); GUARD_ARGS: extra arguments of C (e.g. --steps 60)
runs=" ${GUARD_RUNS:-A B C} "
[[ $runs == *" A "* ]] && run A /tmp/ind_a
[[ $runs == *" B "* ]] && run B /tmp/ind_a
[[ $runs == *" C "* ]] && run C /tmp/ind_c --set "${GUARD_SET:-distill.pad_anchors_multiple=96}" ${GUARD_ARGS:-}
