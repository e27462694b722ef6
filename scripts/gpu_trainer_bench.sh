#!/usr/bin/env bash
# The trainer benchmark on ONE H200, in one `device` call (~2.5 min expected, 480 s of steps at most).
#
# Here (CPU machine), once, if .gpu_stage/whl is missing:  bash scripts/gpu_main_job.sh stage
# Device call (kind nvidia-h200, carry [".gpu_stage/whl"], timeout_s 600):
#     ADAFLASH_COMMIT=<sha> bash scripts/gpu_trainer_bench.sh
# Only the staged wheels travel (DeepSpeed, pydantic, omegaconf, ... ~6 MB; the GPU image has torch and triton):
# the bench uses random weights of the SmolLM2-135M shape (adaflash_ray.shapes), so no model files are needed.
#
# Steps (each under its own timeout; a failed step is reported and the next one still runs):
# 1. gpu-marked tests: the fused loss (Triton vs torch backend vs the original computation) and a bf16 trainer
#    step against the float32 one on a tiny model                                  -> its section of trainer_bench.log
# 2. trainer bench, recipe smollm2_135m_gpu, synthetic trajectories of 256 prompt + 256 response tokens, 96 anchors:
#    baseline: loss_impl=reference, compute_dtype=float32 at batch 16 (the original settings: a float32 drafter,
#    one 24,576-row loss chunk)                                                             -> trainer_reference.json
#    the default path (loss_impl=triton, compute_dtype=auto = bf16 drafter compute) at batch 16, 32, 64, 128,
#    one profiled step at batch 16                                                          -> trainer_triton.json
#    the same at batch 16 with distill.drafter_attention=flex (compiled flex attention, block mask; the first
#    step compiles)                                                                         -> trainer_flex.json
# 3. trainer_summary.json: block positions/s per (impl, batch), speedup over the baseline, FLOP-floor ratio, the
#    split, peak memory, the >= 600k positions/s goal, the baseline/fused last-loss agreement, test outcome.
# All in $OUT, with trainer_bench.log (nvidia-smi and versions, then every step's output): 5 files.
# Dry run on a CPU machine (no install, tiny sizes; the triton step fails there without CUDA, as it should):
#     TB_DRY=1 TB_EXTRA="--set model.device=cpu --set model.dtype=float32 --set placement.gpus_per_trainer=0 \
#       --set placement.gpus_per_inference_worker=0 --shape tiny --prompt-len 10 --new-tokens 20 --warmup 1 \
#       --steps 1 --split-steps 1" OUT=/tmp/tb bash scripts/gpu_trainer_bench.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh  # STAGE, env_setup, install_wheels (returns before its subcommands)
OUT="${OUT:-/tmp/gpu_trainer_bench_out}"
mkdir -p "$OUT"
LOG="$OUT/trainer_bench.log"
: > "$LOG"
TESTS_LOG="$(mktemp)"  # the gpu_tests section of the log, read by the summary (kept out of $OUT: fewer files)

if [ -z "${TB_DRY:-}" ] && ! ls .gpu_stage/whl/deepspeed-*.whl > /dev/null 2>&1; then
  echo "no .gpu_stage/whl: run 'bash scripts/gpu_main_job.sh stage' on the CPU machine, carry .gpu_stage/whl" >&2
  exit 1
fi
if [ -z "${TB_DRY:-}" ]; then
  install_wheels .gpu_stage/whl || exit 1
  env_setup
else  # dry run on a CPU machine whose Python already has the packages (TB_EXTRA shrinks the bench)
  export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1
fi
export ADAFLASH_COMMIT="${ADAFLASH_COMMIT:-unknown}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c "import torch, triton, deepspeed; print('torch', torch.__version__, 'triton', triton.__version__,
'deepspeed', deepspeed.__version__, 'gpus', torch.cuda.device_count())"; } >> "$LOG" 2>&1
cat "$LOG"

step() {  # step NAME TIMEOUT_S CMD...: run with a timeout, stderr+stdout into the log, report the status
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  return $rc
}

# 1. kernel tests (CUDA): the fused loss's Triton backend against the torch backend and the original computation
step gpu_tests 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "fused_loss or train_step or causal_features or flex" \
  -p no:cacheprovider
sed -n '/=== gpu_tests/,/^gpu_tests: rc/p' "$LOG" > "$TESTS_LOG"
tail -3 "$TESTS_LOG"

# 2. trainer bench
# adaflash_ray.trainer_bench is what `python -m adaflash_ray.bench --trainer` runs, called directly: it needs no engine
B=(python3 -m adaflash_ray.trainer_bench --recipe recipes/smollm2_135m_gpu.yaml --shape smollm2-135m
   --prompt-len 256 --new-tokens 256)
# shellcheck disable=SC2206
B+=(${TB_EXTRA:-})  # dry run: e.g. --set model.device=cpu --shape tiny --steps 1 (later flags win)
step reference 70 "${B[@]}" --batch-sizes 16 --set distill.loss_impl=reference --set distill.compute_dtype=float32 \
  --out "$OUT/trainer_reference.json"
step triton 140 "${B[@]}" --batch-sizes 16 32 64 128 --set distill.loss_impl=triton --set distill.compute_dtype=auto \
  --profile 16 --out "$OUT/trainer_triton.json"
step flex 120 "${B[@]}" --batch-sizes 16 --set distill.loss_impl=triton --set distill.compute_dtype=auto \
  --set distill.drafter_attention=flex --profile 16 --out "$OUT/trainer_flex.json"
grep -E "^trainer bench:" "$LOG"

# 3. summary
python3 - "$OUT" "$TESTS_LOG" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
docs = {}
for impl in ("reference", "triton", "flex"):
    p = os.path.join(out, f"trainer_{impl}.json")
    if os.path.exists(p):
        docs[impl] = json.load(open(p))
rows = [{"impl": impl, "compute_dtype": d.get("compute_dtype"), **{k: r[k] for k in ("batch_size", "block_positions", "positions_per_s", "step_s",
                                            "floor_ratio", "peak_mem_gib", "last_loss", "split_s")}}
        for impl, d in docs.items() for r in d["rows"] if "error" not in r]
errors = [{"impl": impl, **r} for impl, d in docs.items() for r in d["rows"] if "error" in r]
base = next((r for r in rows if r["impl"] == "reference" and r["batch_size"] == 16), None)
for r in rows:
    r["speedup_vs_reference_b16"] = r["positions_per_s"] / base["positions_per_s"] if base else None
same = [r for r in rows if r["impl"] != "reference" and r["batch_size"] == 16]
log = open(sys.argv[2]).read() if os.path.exists(sys.argv[2]) else ""
m = re.findall(r"^.*\d+ (?:passed|failed|skipped|errors?)\b.*$", log, re.M)  # pytest's closing line
best = max(rows, key=lambda r: r["positions_per_s"]) if rows else None
summary = {
    "commit": os.environ.get("ADAFLASH_COMMIT"),
    "device": next(iter(docs.values()))["device"] if docs else None,
    "shape": "smollm2-135m (random weights)", "recipe": "smollm2_135m_gpu", "prompt_len": 256, "new_tokens": 256,
    "peak_tflops": 989.0,
    "gpu_tests": m[-1] if m else None,
    "rows": rows,
    "best": {k: best[k] for k in ("impl", "batch_size", "positions_per_s", "floor_ratio")} if best else None,
    "goal_600k_positions_per_s": (best["positions_per_s"] >= 600_000) if best else None,
    # same seed, same anchors, same number of steps: the fused losses should end close to the baseline's loss
    "last_loss_rel_diff_vs_reference_b16": {r["impl"]: abs(r["last_loss"] - base["last_loss"]) / abs(base["last_loss"])
                                            for r in same} if base else None,
    "missing": [i for i in ("reference", "triton", "flex") if i not in docs],
    "errors": errors,
    # one profiled fused step at batch 16: where the time goes, kernel by kernel
    "profile_top_triton_b16": next((r.get("profile_top", [])[:20] for r in docs.get("triton", {}).get("rows", [])
                                    if r.get("batch_size") == 16), None),
    "profile_top_flex_b16": next((r.get("profile_top", [])[:20] for r in docs.get("flex", {}).get("rows", [])
                                  if r.get("batch_size") == 16), None),
}
json.dump(summary, open(os.path.join(out, "trainer_summary.json"), "w"), indent=1)
print(json.dumps({k: summary[k] for k in ("gpu_tests", "best", "goal_600k_positions_per_s",
                                          "last_loss_rel_diff_vs_reference_b16", "missing", "errors")}))
for r in rows:
    print(f"{r['impl']:9s} {r['compute_dtype'] or '?':8s} b{r['batch_size']:<3d} {r['positions_per_s']:>10,.0f} pos/s  step {r['step_s'] * 1e3:7.1f} ms "
          f"floor x{r['floor_ratio']:.1f}  speedup {r['speedup_vs_reference_b16'] or 0:.2f}  "
          f"mem {r['peak_mem_gib'] or 0:.1f} GiB")
EOF
rm -f "$TESTS_LOG"
