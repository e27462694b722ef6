#!/usr/bin/env bash
# Recipe ablations of the drafter's distillation on ONE H200, Ray-free, in the third of three back-to-back
# `device` calls (the machine stays warm between them):
#
#   call a (carry [".gpu_stage"]):   bash scripts/gpu_main_job.sh a     # wheels, data files, GGUF part 0
#   call b (carry [".gpu_stage2"]):  bash scripts/gpu_main_job.sh b     # GGUF part 1
#   call c (carry [".gpu_stage3"]):  ADAFLASH_COMMIT=<sha> bash scripts/gpu_ablation.sh [VARIANT ...]
#
# Call c assembles the model, writes the target's own text at full engine throughput (AR steps, batch 256;
# greedy and sampled at temperature 0.8; the main job's training prompts: ShareGPT plus in-domain prompts,
# held-out prompts excluded) with `python -m adaflash_ray.distill.loop generate`, then trains each VARIANT
# (default: base, depth5, batch64) from those files for ABL_TRAIN_S seconds of trainer time and evaluates every
# version it publishes on the recipe's held-out prompts (`python -m adaflash_ray.distill.ablate`).
# $OUT: ablation.json (per variant and version: training seconds, held-out τ per domain; the prompt-lookup and
# suffix-lookup τ on the same outputs), ablation.png, gen.log, ablate.log.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh  # STAGE, env_setup, prepare_model
env_setup
OUT="${OUT:-/tmp/gpu_ablation_out}"
mkdir -p "$OUT"
R=recipes/smollm2_135m_gpu.yaml
TRAJ=/root/ablation_traj
TRAIN_S="${ABL_TRAIN_S:-75}"
prepare_model || exit 1

t0=$(date +%s)
rm -rf "$TRAJ"
G=(python3 -m adaflash_ray.distill.loop generate --recipe "$R" --out "$TRAJ" --set engine.max_batch_size=256
   --set data.num_train_prompts=8000)
{ timeout 150 "${G[@]}" --prompts "${ABL_GREEDY_PROMPTS:-6000}"
  timeout 90 "${G[@]}" --prompts "${ABL_SAMPLED_PROMPTS:-2000}" --set engine.temperature=0.8; } > "$OUT/gen.log" 2>&1
echo "generate: $(ls "$TRAJ"/*.parquet | wc -l) trajectories in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gen.log"

V=()
for v in "${@:-base depth5:drafter.num_hidden_layers=5,distill.lr=6e-4 batch64:distill.batch_size=64,distill.publish_every=100}"; do
  for w in $v; do V+=(--variant "$w"); done
done
# offline data: each trajectory may feed up to 4 steps (fresh anchors each time); every variant sees the same files
timeout "${ABL_TIMEOUT_S:-420}" python3 -m adaflash_ray.distill.ablate --recipe "$R" --trajectories "$TRAJ" \
  --out /root/ablation --train-s "$TRAIN_S" --set distill.max_reuse=4 --set engine.max_batch_size=256 "${V[@]}" \
  > "$OUT/ablate.log" 2>&1
echo "ablate rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^\[ablate\]" "$OUT/ablate.log"
python3 - "$OUT" "${ADAFLASH_COMMIT:-unknown}" <<'EOF'
import json, os, shutil, sys
out, commit = sys.argv[1:]
p = "/root/ablation/ablation.json"
if os.path.exists(p):
    d = json.load(open(p))
    d["commit"] = commit
    json.dump(d, open(os.path.join(out, "ablation.json"), "w"), indent=1)
if os.path.exists("/root/ablation/ablation.png"):
    shutil.copy("/root/ablation/ablation.png", out)
EOF
