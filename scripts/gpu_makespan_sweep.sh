#!/usr/bin/env bash
# The makespan guard's thresholds (adaflash_ray/engine/engine.py MAKESPAN_MARGIN, MAKESPAN_DECISIVE) swept on bench
# cells, on the GPU machine after calls a, b, b2 and drafter of scripts/gpu_main_job.sh (carry [".gpu_stage3"]):
#
#   export ADAFLASH_COMMIT=<sha> BENCH_DRAFTER=/root/dr/v5 BENCH_REPEATS=3 BENCH_DOMAINS=chat BENCH_CONC=32
#   SWEEP="0.2,0.7 0.1,0.7 0.1,0.85" bash scripts/gpu_makespan_sweep.sh
#
# Each SWEEP entry "margin,decisive" is one `gpu_main_job.sh e` call (BENCH_METHODS, default the AR row beside
# adaflash-cost-makespan-lock) with the two module constants replaced at interpreter start-up (a sitecustomize.py
# put on the staged PYTHONPATH for the sweep and removed after it), named bench_c<N>_m<margin>_<decisive>; every
# output goes into one $OUT/makespan_sweep.tar.xz (a returned $OUT holds 8 files at most).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
site=/root/stage/site
[ -d "$site" ] || { echo "no $site: calls a, b, b2 and drafter first" >&2; exit 2; }
cat > "$site/sitecustomize.py" <<'EOF'
import os
if os.environ.get("MS_MARGIN"):
    import adaflash_ray.engine.engine as _e
    _e.MAKESPAN_MARGIN, _e.MAKESPAN_DECISIVE = float(os.environ["MS_MARGIN"]), float(os.environ["MS_DECISIVE"])
EOF
trap 'rm -f "$site/sitecustomize.py"' EXIT
export BENCH_METHODS="${BENCH_METHODS:-ar adaflash-cost-makespan-lock}"
real_out=$OUT
rm -rf /root/sweep_out && mkdir -p /root/sweep_out  # this call's outputs only
for v in ${SWEEP:-0.2,0.7 0.1,0.7 0.1,0.85}; do
  tag="_m${v/,/_}"
  OUT=/root/sweep_out MS_MARGIN="${v%,*}" MS_DECISIVE="${v#*,}" BENCH_TAG="$tag" bash scripts/gpu_main_job.sh e \
    | grep -E "^bench c|adaflash|^│ ar" | cut -c1-200
  python3 - "/root/sweep_out" "$tag" <<'EOF'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/bench_c*{sys.argv[2]}.json")):
    for r in json.load(open(f))["rows"]:
        st = r.get("step_timing") or {}
        print(f"{sys.argv[2]} {r['method']} c{r['concurrency']} {r['domain']}: {r['tokens_per_s']:.0f} tok/s "
              f"{[round(x) for x in r.get('repeat_tokens_per_s', [])]} x{r.get('speedup_vs_ar') or 1:.3f} "
              f"tau {r['tau']:.2f} steps {r['num_engine_steps']} makespan {st.get('num_makespan_steps')} "
              f"plain {st.get('num_plain_steps')} lossless {r['lossless']}")
EOF
done
tar -cJf "$real_out/makespan_sweep.tar.xz" -C /root sweep_out && ls -la "$real_out"
