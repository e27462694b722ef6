"""``python -m adaflash_ray.bench --trainer`` (adaflash_ray/trainer_bench.py) on CPU: a tiny random-weight shape, two
batch sizes, the JSON document's schema and consistency (block positions, split, FLOP floor), the fused loss
switch through ``--set``, the loss-only mode (``--loss``), the FLOP model against a hand count, and the mode on
trajectory files (``--trajectories``, adaflash_ray/trainer_bench_files.py) against the files written.

Run: python -m pytest -q tests/test_trainer_bench.py   (CPU, ~20 s)
"""
from __future__ import annotations

import json

import pytest

from adaflash_ray.bench import main as bench_main
from adaflash_ray.trainer_bench import SPLIT_PHASES, step_flops, synthetic_trajectories

ARGS = ["--trainer", "--recipe", "recipes/cpu_tiny.yaml", "--shape", "tiny", "--prompt-len", "10",
        "--new-tokens", "20", "--warmup", "1", "--steps", "1", "--split-steps", "1"]


@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_trainer_bench_document(impl, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = bench_main(ARGS + ["--batch-sizes", "1", "2", "--set", f"distill.loss_impl={impl}", "--out", str(out)]
                    + (["--profile"] if impl == "torch" else []))
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc == json.loads(out.read_text())
    assert doc["mode"] == "trainer" and doc["device"] == "cpu" and doc["loss_impl"] == impl
    assert doc["shape"] == "tiny" and doc["peak_tflops"] == 989.0
    assert [r["batch_size"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        # cpu_tiny: 8 anchors; 20 response tokens leave >= 8 candidates: 8 full blocks per trajectory
        assert doc["num_anchors"] == 8 and doc["block_size"] >= 2
        assert r["block_positions"] == 8 * (doc["block_size"] - 1) * r["batch_size"]
        assert 0 < r["supervised_positions"] <= r["block_positions"]
        assert r["positions_per_s"] > 0 and r["step_s"] > 0 and r["peak_mem_gib"] is None
        assert set(r["split_s"]) == set(SPLIT_PHASES) and all(v >= 0 for v in r["split_s"].values())
        # every wrapped phase of train_step was seen (the bench wraps what DistillTrainerCore calls by name)
        assert all(r["split_s"][p] > 0 for p in ("target_recompute", "drafter_forward", "loss", "backward",
                                                  "optimizer"))
        assert r["flops"]["total"] == pytest.approx(sum(r["flops"][k] for k in ("target", "drafter", "head")))
        assert r["floor_ratio"] == pytest.approx(r["step_s"] / (r["flops"]["total"] / 989e12))
        assert r["last_loss"] > 0
        if impl == "torch":  # --profile
            top = r["profile_top"]
            assert 0 < len(top) <= 20 and all(t["self_ms"] >= 0 and t["calls"] >= 1 for t in top)
            assert [t["self_ms"] for t in top] == sorted((t["self_ms"] for t in top), reverse=True)


def test_trainer_bench_bad_impl_exits_2(capsys):
    assert bench_main(ARGS + ["--set", "distill.loss_impl=triton"]) == 2  # no CUDA here
    assert "triton" in capsys.readouterr().err


def test_loss_mode(tmp_path, capsys):
    out = tmp_path / "loss.json"
    rc = bench_main(["--trainer", "--loss", "--recipe", "recipes/cpu_tiny.yaml", "--shape", "tiny", "--rows", "60",
                     "--iters", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc == json.loads(out.read_text()) and doc["mode"] == "loss" and doc["vocab"] == 512
    assert [r["impl"] for r in doc["results"]] == ["reference", "torch"]  # no triton without CUDA
    assert doc["flops"] == 3 * 2 * 60 * 64 * 512
    assert all(r["ms"] > 0 and r["floor_ratio"] > 1 for r in doc["results"])
    assert doc["results"][0]["loss"] == pytest.approx(doc["results"][1]["loss"], rel=1e-5)


def test_step_flops_hand_count():
    from adaflash_ray.models.drafter import DrafterModelConfig
    from adaflash_ray.shapes import shape_config

    t = shape_config("tiny")  # H 64, I 128, 8 layers, 4 heads / 2 kv of 16
    d = DrafterModelConfig.for_target(t, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3])
    f = step_flops(t, d, seq_lens=[11], anchors_per_seq=[[2, 5]], positions=6)
    per_tok = 2 * 8 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
    assert f["target"] == per_tok * 10 + 8 * 2 * 64 * 10 * 10
    assert f["head"] == 3 * 2 * 6 * 64 * 512 and f["head_stats"] == 0
    g = step_flops(t, d, seq_lens=[11], anchors_per_seq=[[2, 5]], positions=6, head_stats=True)
    assert g["head_stats"] == 2 * 6 * 64 * 512 and g["total"] == f["total"] + g["head_stats"]
    q = 2 * 4
    fwd = (2 * 10 * 2 * 64 * 64 + 2 * (64 * 64 + 64 * 64 + 3 * 64 * 128 + 2 * 64 * 32) * q + 4 * 64 * 32 * 10
           + 4 * 64 * 4 * ((2 + 4) + (5 + 4)))
    assert f["drafter"] == 3 * fwd


def test_synthetic_trajectories():
    trs = synthetic_trajectories(3, 5, 7, 100, seed=0)
    assert [tr.num_tokens for tr in trs] == [12] * 3 and all(tr.prompt_len == 5 for tr in trs)
    assert all(int(tr.token_ids.max()) < 100 for tr in trs)
    with pytest.raises(ValueError):
        synthetic_trajectories(1, 0, 7, 100, seed=0)


def test_profile_only_listed_batch_sizes(capsys):
    assert bench_main(ARGS + ["--batch-sizes", "1", "2", "--profile", "2"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [("profile_top" in r) for r in doc["rows"]] == [False, True]


def test_trajectory_files_mode(tmp_path, capsys):
    """--trajectories (with --profile): four files written with spill.write_parquet (prompt 5/12/3/8, response 20/9/30/14 tokens),
    batches of 2 leased in file-name order: every row of the four sources, its split, the files' length statistics
    (directory and measured), the recompute / collate padding and the block counts of the timed step's batch."""
    import torch

    from adaflash_ray.distill.spill import spill_path, write_parquet
    from adaflash_ray.trainer_bench_files import FILE_SPLIT_PHASES, SOURCES
    from adaflash_ray.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    traj = tmp_path / "traj"
    traj.mkdir()
    for i, (p, n) in enumerate([(5, 20), (12, 9), (3, 30), (8, 14)]):
        t = Trajectory(request_id=f"r{i}", token_ids=torch.randint(0, 512, (p + n,), generator=g), prompt_len=p,
                       features=None, last_hidden=None, drafter_version=0)
        write_parquet(t, spill_path(traj, t.request_id, 0))
    out = tmp_path / "files.json"
    rc = bench_main(["--trainer", "--recipe", "recipes/cpu_tiny.yaml", "--shape", "tiny", "--trajectories", str(traj),
                     "--batch-sizes", "2", "--warmup", "0", "--steps", "1", "--split-steps", "1", "--prompt-len", "10",
                     "--new-tokens", "20", "--set", "distill.features=recompute", "--profile", "--out", str(out)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc == json.loads(out.read_text())
    prof = {r["source"]: r.get("profile_top") for r in doc["rows"]}
    assert [s for s, p in prof.items() if p] == ["files_preread"]  # --profile: that row's first batch, once
    assert all(e["self_ms"] >= 0 and e["calls"] >= 1 and e["name"] for e in prof["files_preread"])
    assert any("mm" in e["name"] for e in prof["files_preread"])  # the step's matmuls show up
    assert doc["mode"] == "trainer_files" and doc["num_files"] == 4 and doc["features"] == "recompute"
    assert doc["loss_impl"] == "reference" and doc["compute_dtype"] == "float32" and doc["num_anchors"] == 8
    want = {"prompt_tokens": {"mean": 7, "p50": 5, "p90": 12, "max": 12, "min": 3},
            "new_tokens": {"mean": 18.25, "p50": 14, "p90": 30, "max": 30, "min": 9},
            "num_tokens": {"mean": 25.25, "p50": 22, "p90": 33, "max": 33, "min": 21}}
    assert doc["directory_lengths"] == want
    assert doc["synthetic_mean"] == [7, 18] and doc["synthetic_bench"] == [10, 20]
    rows = {r["source"]: r for r in doc["rows"]}
    assert list(rows) == list(SOURCES) and all(r["batch_size"] == 2 for r in rows.values())
    bs = doc["block_size"]
    for src, r in rows.items():
        assert set(r["split_s"]) == set(FILE_SPLIT_PHASES) and all(v >= 0 for v in r["split_s"].values())
        assert all(r["split_s"][p] > 0 for p in ("target_recompute", "collate", "drafter_forward", "loss", "backward",
                                                  "optimizer"))
        assert r["positions_per_s"] > 0 and r["supervised_positions_per_s"] > 0 and r["wall_positions_per_s"] > 0
        assert r["supervised_positions"] <= r["block_positions"] and r["floor_ratio"] > 1
        assert r["flops"]["head_stats"] == 0  # cpu_tiny: exp_decay, no reject_boost
        assert r["flops"]["total"] == pytest.approx(sum(r["flops"][k] for k in ("target", "drafter", "head")))
    for src in ("files", "files_preread"):  # timed step: r0 + r1 (25 and 21 tokens), split step: r2 + r3
        r = rows[src]
        assert r["lengths"] == want
        assert r["recompute"] == {"forwards": 1, "real_tokens": 24 + 20, "padded_tokens": 2 * 24}
        assert r["collate_tokens"] == {"real": 44, "padded": 48}
        # >= 8 anchor candidates in both: 8 full-sized blocks each
        assert r["num_blocks"] == 16 and r["block_positions"] == 16 * (bs - 1) and r["anchor_fill"] == 1.0
        assert r["drafter_queries"] == 2 * 8 * bs and r["mask_elements"] == 2 * 8 * bs * (24 + 8 * bs)
    assert rows["files"]["split_s"]["read"] > 0 and rows["files_preread"]["split_s"]["read"] == 0
    assert rows["files_preread"]["decode_s"] > 0 and rows["synthetic_mean"]["read_s"] == 0
    assert rows["synthetic_mean"]["lengths"]["new_tokens"]["max"] == 18
    assert set(doc["gaps"]["2"]) == {"reader_threads", "length_variation", "mean_lengths"}
