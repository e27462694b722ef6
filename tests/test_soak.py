"""The sampled soak, short: ``python -m adaflash_ray.loadtest --soak`` with :data:`SOAK_STEPS` (300) decode steps of
mixed sampled (T = 0.8, top-p 0.9) and greedy traffic through its own Serve process (cpu_tiny, live distillation
hot-reloading version 1 in between): no failed or stuck request, exact token accounting, at least one hot reload,
the first token's distribution on a fixed prompt consistent with the target's own (χ²), the server drained with
exit 0.
The traffic is locust's: its own counts (requests, failures, completion tokens as response length) are checked.

Run: python -m pytest -q tests/test_soak.py     (~2-3 min on 2 CPU cores)
"""
from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# locust runs in the load test's own child process; importing it here would monkey-patch this process for gevent
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed (pip install -e .[dev])", allow_module_level=True)
pytest.importorskip("scipy")

ROOT = Path(__file__).resolve().parents[1]
# Decode steps of the soak phase. On 2 CPU cores the server's live distillation of cpu_tiny publishes version 1 after
# ~130 decode steps and each further version ~120 steps later (seen: 3 reloads by step 370 of a 2,000-step soak):
# with 1 version, 300 steps keep the reload inside the soak phase, training finished before the server is stopped,
# with room for a slower machine. (Was 500 steps and 2 versions: ~220 s of the suite.)
SOAK_STEPS = 300
#: sampled one-token requests of the χ² phase (~0.4 s each on 2 cores beside the live training)
CHI2_SAMPLES = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.long  # ~150 s; the Serve hot reload under traffic is also tests/test_serve.py's
def test_short_sampled_soak(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "adaflash_ray.loadtest", "--soak", "--soak-steps", str(SOAK_STEPS),
           "--concurrency", "6",
           "--chi2-samples", str(CHI2_SAMPLES), "--max-tokens", "32", "--min-reloads", "1", "--soak-versions", "1",
           "--num-prompts", "64", "--recipe", "recipes/cpu_tiny.yaml", "--port", str(_free_port()),
           "--set", "ray.include_dashboard=false", "--set", "logging.wandb_mode=disabled",
           "--set", f"serve.run_dir={tmp_path / 'run'}", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert out.is_file(), r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res == json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and res["ok"], (res["checks"], res["failures_sample"], res["token_errors_sample"],
                                              r.stderr[-2000:])
    assert res["decode_steps"] >= SOAK_STEPS and res["num_sampled"] > 0 and res["num_greedy"] > 0
    assert res["client"].startswith("locust ")
    lo, lo2 = res["locust"], res["chi2_locust"]  # locust's own statistics of the two phases
    assert lo["num_failed"] == 0 and lo2["num_failed"] == 0 and not res["failures_sample"]
    assert lo["num_requests"] == res["num_requests"] == res["num_sampled"] + res["num_greedy"]
    assert lo["completion_tokens"] == res["completion_tokens"] == res["server_tokens"] and res["reloads"]
    assert 0 < lo["ttft_p50_s"] <= lo["ttft_p99_s"] and 0 < lo["latency_p50_s"] <= lo["latency_p99_s"]
    assert lo2["num_requests"] == CHI2_SAMPLES and lo2["completion_tokens"] == CHI2_SAMPLES
    assert res["chi2"]["num_samples"] == CHI2_SAMPLES and res["chi2"]["num_outside_support"] == 0
