#!/usr/bin/env bash
# After call d of scripts/gpu_main_job.sh, on the same warm machine (no carry): the decode step's phases on random
# SmolLM2-shape weights (scripts/profile_step_phases.py; PHASES=0 skips it), then everything packed to fit a call's
# eight files of <= 16 MiB: the run's files and the profile in ONE tarball ($OUT/run_files.tar.gz), the final
# drafter as a bf16 tar in 15 MiB parts ($OUT/drafter_vN.tar.part*; here: cat them into .gpu_drafter/vN.tar, then
# `bash scripts/gpu_main_job.sh drafter` brings it to a later machine).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/gpu_main_job.sh
source scripts/gpu_main_job.sh  # RUN_DIR, env_setup (returns before its subcommands)
env_setup
if [ "${PHASES:-1}" != 0 ]; then
  timeout "${PHASES_TIMEOUT:-150}" python3 scripts/profile_step_phases.py --shape smollm2-135m --batch 1 64 \
    --new-tokens 256 --methods ar gamma0 cost hybrid-device > "$OUT/step_phases.log" 2>&1
  echo "step phases: rc $?"; grep -v '^{' "$OUT/step_phases.log" | tail -32
fi
v=$(python3 -c "import json; print(json.load(open('$RUN_DIR/summary.json'))['serving_version'])") || exit 1
mkdir -p /root/drafter_bf16
python3 - "$RUN_DIR/checkpoints/v$v" "/root/drafter_bf16/v$v" <<'EOF'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.suffix == ".safetensors":
        save_file({k: t.bfloat16() if t.is_floating_point() else t for k, t in load_file(str(f)).items()},
                  str(dst / f.name))
    elif f.is_file():
        shutil.copy(f, dst / f.name)
print("drafter", src, "->", dst, sum(p.stat().st_size for p in dst.iterdir()), "bytes (bf16)")
EOF
tar -cf - -C /root/drafter_bf16 "v$v" | split -b 15m - "$OUT/drafter_v$v.tar.part"
cd "$OUT" || exit 1
[ -f metrics.jsonl ] && xz -T0 metrics.jsonl
others=$(ls | grep -v '^drafter_v') && tar -czf run_files.tar.gz $others && rm -f $others
ls -la "$OUT"
