"""``python -m adaflash_ray.bench`` on the real model (tiny sizes): the JSON line, AR/DFlash/AdaFlash
rows per concurrency, and losslessness against AR for every speculative method."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_runs_and_is_lossless():
    out = subprocess.run([sys.executable, "-m", "adaflash_ray.bench", "--recipe", "recipes/cpu_tiny.yaml",
                          "--concurrency", "1", "3", "--num-prompts", "3", "--max-new-tokens", "12"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    rows = res["results"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        ("ar", 1), ("dflash", 1), ("adaflash-direct", 1), ("ar", 3), ("dflash", 3), ("adaflash-direct", 3)]
    assert all(r["lossless"] for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and 1.0 <= r["accept_len"] <= res["block_size"]
        if r["method"] == "dflash":
            assert set(r["gamma_hist"]) <= {str(g) for g in range(res["block_size"])}


def test_bench_rejects_bad_drafter(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    out = subprocess.run([sys.executable, "-m", "adaflash_ray.bench", "--recipe", "recipes/cpu_tiny.yaml",
                          "--drafter", str(tmp_path), "--num-prompts", "1", "--max-new-tokens", "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "bad config.json" in out.stderr
