"""``python -m adaflash_ray.bench``: real-model mode on the real SmolLM2 (CPU, float32, tiny sizes) - row
schema, AR speedup 1, losslessness, τ/acceptance/waste consistency, γ histograms, the JSON last line, --out
and the PNG plot; shape mode on the tiny random shape (verify-cost table); unsupported shapes exit 2.

Run: python -m pytest -q tests/test_bench.py   (~1 min on 2 CPU cores)
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaflash_ray.bench import DOMAINS, HF_METHOD, POOLED, _compare, domain_prompts, main, repeat_order
from adaflash_ray.data import EVAL_SOURCES, ensure_target, load_tokenizer
from adaflash_ray.shapes import SHAPES, UNSUPPORTED_SHAPES, build_random_target, decode_weight_bytes

ROOT = Path(__file__).resolve().parents[1]
ROW_KEYS = {"method", "concurrency", "domain", "ms_per_step", "tokens_per_s", "speedup_vs_ar", "tau",
            "acceptance_rate", "draft_waste", "gamma_hist", "lossless"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.long  # ~50 s; the bench's CLI, rows and losslessness are also test_model_mode_draft_source_methods'
def test_model_mode_rows_lossless_and_outputs(tmp_path, capsys):
    out, png = tmp_path / "res" / "bench.json", tmp_path / "bench.png"
    rc = main(["--concurrency", "1", "2", "--num-prompts", "2", "--max-new-tokens", "8", "--domains", "qa", "chat",
               "--out", str(out), "--plot", str(png)])
    assert rc == 0
    doc = _last_json(capsys)
    assert doc == json.loads(out.read_text())  # --out holds the same document as the last stdout line
    assert doc["device"] == "cpu" and doc["torch_version"] == torch.__version__ and doc["model"]
    assert doc["commit"] is None or len(doc["commit"]) == 40
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    rows, bs = doc["rows"], doc["block_size"]
    methods = ["ar", "dflash", "adaflash-direct", HF_METHOD]
    assert [(r["domain"], r["concurrency"], r["method"]) for r in rows] == [
        (d, c, m) for c in (1, 2) for d in ("qa", "chat") for m in methods]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["model"] == doc["model"]
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["speedup_vs_ar"] > 0
        if r["method"] == "ar":
            assert r["speedup_vs_ar"] == 1.0 and r["tau"] == 1.0 and r["lossless"] is True
        elif r["method"] == HF_METHOD:
            assert r["tau"] is None and r["lossless"] is None and r["gamma_hist"] == {}
        else:  # speculative: float32 CPU greedy output is the target's, token for token
            assert r["lossless"] is True and r["match_rate"] == 1.0 and r["mismatch_margins"] == []
            assert 1.0 <= r["tau"] <= bs
            assert 0.0 <= r["draft_waste"] <= 1.0
            assert r["acceptance_rate"] + r["draft_waste"] == pytest.approx(1.0)
            assert set(r["gamma_hist"]) <= {str(g) for g in range(bs)}
            if r["concurrency"] == 1:  # one request in flight: one γ per engine step
                assert sum(r["gamma_hist"].values()) == r["num_engine_steps"]
            if r["method"] == "dflash":  # fixed γ = block_size-1 unless the token budget caps it
                assert max(int(g) for g in r["gamma_hist"]) == bs - 1
        if r["method"] != HF_METHOD:  # wall time per step kind: the counts are the engine steps
            kinds = r["step_timing"]["steps"]
            assert sum(v["count"] for v in kinds.values()) == r["num_engine_steps"]
            assert sum(v["total_ms"] for v in kinds.values()) == pytest.approx(
                r["ms_per_step"] * r["num_engine_steps"], rel=1e-6)
            assert r["step_timing"]["prefill"]["count"] >= 1 and r["guard"] is None  # no cost policy here
            if r["method"] == "ar":
                assert set(kinds) == {"ar"}
        # the same prompts and budget for every method of a (domain, concurrency)
        same = [x for x in rows if x["domain"] == r["domain"] and x["concurrency"] == r["concurrency"]]
        assert {x["num_prompts"] for x in same} == {max(2, r["concurrency"])}
    # τ = mean(a+1): a τ of 1 means nothing was accepted, and vice versa
    for r in rows:
        if r["acceptance_rate"] is not None:
            assert (r["tau"] > 1.0) == (r["acceptance_rate"] > 0.0)


def test_compare_reports_match_rate_and_divergence_margin():
    target = build_random_target(SHAPES["tiny"], "cpu", torch.float32, seed=3)
    prompts, ref = [[5, 6, 7], [8, 9]], [[1, 2, 3], [4, 4]]
    assert _compare(target, prompts, [[1, 2, 3], [4, 4]], ref) == {
        "lossless": True, "match_rate": 1.0, "mismatch_margins": [], "max_mismatch_margin": None}
    res = _compare(target, prompts, [[1, 2, 9], [4, 4]], ref)  # request 0 diverges at output index 2
    with torch.no_grad():
        logits = target(torch.tensor([[5, 6, 7, 1, 2]]), torch.arange(5)[None]).logits[0, -1]
    top = logits.topk(2).values
    assert res["lossless"] is False and res["match_rate"] == 0.5
    assert res["mismatch_margins"] == [pytest.approx(float(top[0] - top[1]))] and res["max_mismatch_margin"] > 0


def test_domain_prompts_are_distinct_per_domain():
    assert set(DOMAINS.values()) <= set(EVAL_SOURCES)
    tok = load_tokenizer(ensure_target("smollm2-135m-instruct"))
    got = {d: domain_prompts(tok, d, 3, 512, seed=1) for d in DOMAINS}
    for d, ids in got.items():
        assert len(ids) == 3 and all(0 < len(p) <= 512 for p in ids)
        assert ids == domain_prompts(tok, d, 3, 512, seed=1)  # deterministic
    assert len({tuple(p) for ids in got.values() for p in ids}) == 3 * len(DOMAINS)
    # the pooled domain: the domains' own prompts, interleaved round-robin, distinct; 64 of each for concurrency 256
    pooled = domain_prompts(tok, POOLED, 8, 512, seed=1)
    for j, d in enumerate(DOMAINS):
        assert pooled[j::len(DOMAINS)] == domain_prompts(tok, d, 2, 512, seed=1), d
    big = domain_prompts(tok, POOLED, 256, 512, seed=1)
    assert len({tuple(p) for p in big}) == 256
    assert big[3::len(DOMAINS)] == domain_prompts(tok, "chat", 64, 512, seed=1)
    with pytest.raises(ValueError, match="mt-bench"):
        domain_prompts(tok, POOLED, 4 * 100, 512, seed=1)  # MT-Bench holds 80 first turns


def test_shape_mode_tiny_verify_cost(tmp_path, capsys):
    out = tmp_path / "shape.json"
    rc = main(["--shape", "tiny", "--device", "cpu", "--concurrency", "1", "2", "--context", "16",
               "--max-new-tokens", "4", "--num-iters", "2", "--drafter-layers", "1", "--block-size", "8",
               "--out", str(out), "--plot", str(tmp_path / "shape.png")])
    assert rc == 0
    doc = _last_json(capsys)
    assert doc == json.loads(out.read_text()) and doc["shape"] == "tiny" and doc["device"] == "cpu"
    assert "no acceptance" in doc["note"]
    assert (tmp_path / "shape.png").read_bytes()[:8] == PNG_MAGIC
    assert list(doc["verify_cost"]) == ["1", "2"]
    for row in doc["verify_cost"].values():
        assert list(row) == ["1", "2", "4", "8"] and all(ms > 0 for ms in row.values())  # widths <= block_size
    target = build_random_target(SHAPES["tiny"], "cpu", torch.bfloat16)
    assert doc["decode_weight_bytes"] == decode_weight_bytes(target) > 0
    assert doc["copy_bandwidth_gb_s"] > 0
    assert doc["memory_floor_ms"] == pytest.approx(doc["decode_weight_bytes"] / doc["copy_bandwidth_gb_s"] / 1e6)
    for b in ("1", "2"):
        assert doc["ar_step_ms"][b] > 0 and doc["spec_step_ms"][b] > 0 and doc["propose_ms"][b] > 0
        assert doc["propose_frac_of_ar"][b] == pytest.approx(doc["propose_ms"][b] / doc["ar_step_ms"][b])
        assert doc["ar_forward_ms"][b] == doc["verify_cost"][b]["1"]
    assert [(r["method"], r["concurrency"]) for r in doc["rows"]] == [("ar", 1), ("dflash", 1), ("ar", 2),
                                                                       ("dflash", 2)]
    assert all(r["shape"] == "tiny" and ROW_KEYS <= set(r) for r in doc["rows"])
    assert all(r["speedup_vs_ar"] == 1.0 for r in doc["rows"] if r["method"] == "ar")


def test_shape_configs_have_the_real_dims():
    q, s = SHAPES["qwen3-8b"], SHAPES["smollm2-135m"]
    assert (q.num_hidden_layers, q.hidden_size, q.num_attention_heads, q.num_key_value_heads, q.head_dim,
            q.intermediate_size, q.vocab_size, q.model_type, q.rope_theta) == (
        36, 4096, 32, 8, 128, 12288, 151936, "qwen3", 1e6)
    assert (s.num_hidden_layers, s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim,
            s.intermediate_size, s.vocab_size, s.model_type, s.tie_word_embeddings, s.rope_theta) == (
        30, 576, 9, 3, 64, 1536, 49152, "llama", True, 1e5)


def test_unsupported_shape_exits_2_with_the_reason():
    out = subprocess.run([sys.executable, "-m", "adaflash_ray.bench", "--shape", "qwen3-coder-30b-a3b"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "mixture-of-experts" in out.stderr and "not supported" in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("shape,needle", [("qwen3.5-9b", "linear attention"), ("llama-7b", "unknown shape")])
def test_other_bad_shapes_exit_2(shape, needle, capsys):
    assert main(["--shape", shape]) == 2
    err = capsys.readouterr().err
    assert needle in err and shape in err
    if shape not in UNSUPPORTED_SHAPES:
        assert "qwen3-8b" in err  # the supported ones are listed


def test_bench_rejects_bad_drafter(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    rc = main(["--drafter", str(tmp_path), "--num-prompts", "1", "--max-new-tokens", "2", "--concurrency", "1",
               "--domains", "code", "--methods", "ar", "dflash"])
    assert rc == 2 and "bad config.json" in capsys.readouterr().err


def test_bench_rejects_unknown_method(capsys):
    assert main(["--methods", "ar", "medusa", "--concurrency", "1", "--num-prompts", "1"]) == 2
    assert "unknown method" in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [(["--shape", "tiny", "--device", "nope"], "expected cpu, cuda or cuda:N"),
                                      (["--out", "/tmp"], "is a directory"),
                                      (["--shape", "tiny", "--context", "100000000"], "positions per request"),
                                      (["--shape", "tiny", "--profile", "/tmp/p"], "not with --shape"),
                                      (["--profile", "/dev/null/p"], "cannot make the folder"),
                                      (["--out", "/dev/null/b/x.json"], "--out /dev/null/b/x.json: cannot make"),
                                      (["--plot", "/dev/null/b/x.png"], "--plot /dev/null/b/x.png: cannot make"),
                                      (["--corpus-prompts", "-1"], "--corpus-prompts must be >= 0"),
                                      (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                                      (["--temperature", "nan"], "--temperature must be a finite number >= 0")])
def test_bad_arguments_fail_up_front(args, msg, capsys):
    """Argument errors exit 2 before anything runs (not a traceback after the benchmark, its results lost, or a
    silently odd run: ``--corpus-prompts -1`` sliced the corpus to all but its last prompt)."""
    from adaflash_ray.bench import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_a_refused_command_makes_no_output_folder(tmp_path, capsys):
    """The output folders are made once every argument passed: a command refused for another argument leaves none."""
    from adaflash_ray.bench import main

    out, prof = tmp_path / "o" / "a" / "b.json", tmp_path / "p"
    with pytest.raises(SystemExit) as e:
        main(["--out", str(out), "--shape", "tiny", "--profile", str(prof)])
    assert e.value.code == 2 and "not with --shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--plot", str(tmp_path / "q" / "c.png"), "--sim-costs", str(tmp_path / "none.json")])
    assert not (tmp_path / "o").exists() and not prof.exists() and not (tmp_path / "q").exists()


@pytest.mark.slow
def test_model_mode_draft_source_methods(capsys):
    """ngram / suffix / hybrid rows on the real SmolLM2 (CPU float32), on the pooled domain: lossless against AR, a
    source histogram per row that counts every request-step, the suffix corpus seeded from other held-out prompts,
    the median of 2 repeats; the block guard only in ``hybrid-block-guard``; ``hybrid-drain``, ``hybrid-request-cal``,
    ``hybrid-drain-request-cal``, ``hybrid-makespan`` and ``hybrid-no-source-guard`` lossless too, drain and makespan
    steps counted in the step timing (none in ``hybrid``); the source guard's state in every hybrid row but
    ``hybrid-no-source-guard``'s."""
    rc = main(["--methods", "ar", "ngram", "suffix", "hybrid", "hybrid-block-guard", "hybrid-drain",
               "hybrid-request-cal", "hybrid-drain-request-cal", "hybrid-makespan", "hybrid-no-source-guard",
               "--concurrency", "2", "--num-prompts", "2",
               "--max-new-tokens", "8", "--domains", POOLED, "--repeats", "2", "--corpus-prompts", "2"])
    assert rc == 0
    doc = _last_json(capsys)
    assert doc["domains"] == {POOLED: "+".join(DOMAINS.values())} and {r["domain"] for r in doc["rows"]} == {POOLED}
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"ar", "ngram", "suffix", "hybrid", "hybrid-block-guard", "hybrid-drain", "hybrid-request-cal",
                         "hybrid-drain-request-cal", "hybrid-makespan", "hybrid-no-source-guard"}
    assert rows["hybrid"]["step_timing"]["num_drain_steps"] == 0
    assert rows["hybrid"]["step_timing"]["num_makespan_steps"] == 0
    assert rows["hybrid"]["block_guard"] is None and rows["hybrid-block-guard"]["block_guard"] is not None
    assert rows["hybrid-no-source-guard"]["source_guard"] is None
    assert all(rows[m]["source_guard"] is not None for m in rows
               if m.startswith("hybrid") and m != "hybrid-no-source-guard")
    assert rows["suffix"]["source_guard"] is None
    for m in ("ngram", "suffix", "hybrid", "hybrid-block-guard", "hybrid-drain", "hybrid-request-cal",
              "hybrid-drain-request-cal", "hybrid-makespan", "hybrid-no-source-guard"):
        r = rows[m]
        assert r["lossless"] is True and r["match_rate"] == 1.0, m
        assert r["repeats"] == 2 and len(r["repeat_tokens_per_s"]) == 2
        assert set(r["source_hist"]) <= {m if not m.startswith("hybrid") else "suffix", "dflash", "none"}
        assert sum(r["source_hist"].values()) == sum(r["gamma_hist"].values())
    assert rows["suffix"]["corpus_seed_sequences"] == 2 and rows["hybrid"]["corpus_seed_sequences"] == 2
    assert rows["hybrid"]["guard"] is not None and rows["suffix"]["guard"] is None  # the cost policy's guard
    table = rows["hybrid"]["cost_table"]  # the hybrid's measured tables (the cost policy's) in its row
    assert len(table["costs_ms"]) == len(table["batch_sizes"]) and "lookup_costs_ms" in table
    assert "cost_table" not in rows["suffix"]
    assert sum(v["steps"] + v["propose_steps"] for v in rows["hybrid"]["realised_costs"].values()) > 0  # it saw them
    for r in rows.values():
        assert sum(v["count"] for v in r["step_timing"]["steps"].values()) == r["num_engine_steps"]
        by_shape = r["step_timing"]["steps_by_shape"]  # the same steps by (rows x width) as the device ran them
        assert {k: sum(v["count"] for v in d.values()) for k, d in by_shape.items()} == \
            {k: v["count"] for k, v in r["step_timing"]["steps"].items()}
        # both requests admitted at once: the slower one's decode steps are the run's engine steps
        assert r["max_request_steps"] == r["num_engine_steps"], r
        assert 1.0 <= r["request_tau_min"] <= r["request_tau_p10"] <= r["request_tau_median"]
    assert rows["ar"]["request_tau_min"] == 1.0 and rows["ar"]["mean_request_steps"] <= 7


def test_model_mode_admit_min_batches_the_refills(capsys):
    """``--admit-min 3`` at concurrency 3 with 6 prompts: a refill waits for 3 free slots, so every prefill admits 3
    requests (2 prefills per run); outputs stay AR's."""
    rc = main(["--methods", "ar", "dflash", "--concurrency", "3", "--num-prompts", "6", "--max-new-tokens", "6",
               "--domains", "qa", "--admit-min", "3"])
    assert rc == 0
    doc = _last_json(capsys)
    assert doc["admit_min"] == 3
    for r in doc["rows"]:
        assert r["step_timing"]["prefill"]["count"] == 2, r["method"]
        assert r["lossless"] is True
    with pytest.raises(SystemExit) as e:
        main(["--admit-min", "0"])
    assert e.value.code == 2 and "--admit-min" in capsys.readouterr().err


def test_model_mode_sampled_with_argmax_drafts(capsys):
    """--temperature 0.8: every method samples (rows say so, no token-for-token match against AR is claimed);
    dflash-argmax drafts the drafter's argmax block at the fixed γ, dflash-sampled samples it from q, dflash follows
    the recipe (sampled by default); bad temperatures are user errors (exit 2)."""
    import adaflash_ray.bench as bench_mod

    built = {}
    real = bench_mod.SpecEngine.from_config

    def from_config(cfg, **kw):  # the engines the bench builds, by the argmax_drafts each one ran with
        eng = real(cfg, **kw)
        built.setdefault(eng.runner.argmax_drafts, 0)
        built[eng.runner.argmax_drafts] += 1
        return eng
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_mod.SpecEngine, "from_config", from_config)
        rc = main(["--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "6", "--domains", "chat",
                   "--methods", "ar", "dflash", "dflash-argmax", "dflash-sampled", "--temperature", "0.8"])
    assert rc == 0
    assert built == {True: 1, False: 3}  # dflash-argmax argmax; ar, dflash (the recipe's default) and dflash-sampled
    doc = _last_json(capsys)
    assert doc["temperature"] == 0.8
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"ar", "dflash", "dflash-argmax", "dflash-sampled"}
    for m in ("dflash", "dflash-argmax", "dflash-sampled"):
        r = rows[m]
        assert r["temperature"] == 0.8 and r["lossless"] is None and 1 <= r["num_tokens"] <= 6
        assert 1.0 <= r["tau"] <= doc["block_size"] and r["speedup_vs_ar"] > 0
    assert main(["--methods", "ar", HF_METHOD, "--temperature", "0.5", "--num-prompts", "1", "--concurrency", "1"]) == 2


def _sim_bench(tmp_path, note, methods: list[str], extra: list[str] = ()) -> int:
    """The bench on one chat prompt of 4 tokens at concurrency 1 under a simulated clock (a cost table for the default
    CPU recipe - block_size 4: γ 1..3; lookups of width 1..16 - so no calibration), ``note(kwargs, engine)`` called
    with every engine it builds; its exit status."""
    import adaflash_ray.bench as bench_mod

    table = tmp_path / "table.json"
    table.write_text(json.dumps({"batch_sizes": [1], "costs_ms": [[1.5] * 3], "ar_costs_ms": [1.0],
                                 "lookup_costs_ms": [[1.0] + [1.2] * 15], "context_len": 128}))
    real = bench_mod.SpecEngine.from_config

    def from_config(cfg, **kw):
        eng = real(cfg, **kw)
        note(kw, eng)
        return eng
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_mod.SpecEngine, "from_config", from_config)
        return main(["--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "4", "--domains", "chat",
                     "--methods", *methods, "--sim-costs", str(table), *extra])


def test_long_reference_variant_sets_the_source_guards_reference_rows(capsys, tmp_path):
    """``hybrid-long-reference``: the hybrid whose source guard's reference runs hold LONG_REFERENCE_ROWS rows; plain
    ``hybrid`` keeps the default runs (0), whatever the recipe says (a simulated clock: no calibration)."""
    import adaflash_ray.bench as bench_mod

    seen = {}

    def note(kw, eng):
        if eng.source_guard is not None:
            seen[kw["source_guard_reference_rows"]] = eng.source_guard.reference_rows
    assert _sim_bench(tmp_path, note, ["ar", "hybrid", "hybrid-long-reference"]) == 0
    assert seen == {0: 0, bench_mod.LONG_REFERENCE_ROWS: bench_mod.LONG_REFERENCE_ROWS}
    rows = {r["method"]: r for r in _last_json(capsys)["rows"]}
    assert rows["hybrid-long-reference"]["lossless"] is True


def test_makespan_lock_variants_set_the_lock(capsys, tmp_path):
    """``<m>-makespan-lock``: the makespan guard with SpecEngine ``makespan_lock`` (``-makespan`` without it, plain
    ``hybrid`` neither, whatever the recipe says); listed among the known methods, its base method the guarded one."""
    import adaflash_ray.bench as bench_mod

    assert {"hybrid-makespan-lock", "adaflash-cost-makespan-lock"} <= set(bench_mod.known_methods())
    assert bench_mod.base_method("hybrid-makespan-lock") == "hybrid"
    assert bench_mod.base_method("adaflash-cost-makespan-lock") == "adaflash-cost"
    seen = {}

    def note(kw, eng):
        if eng.planner is not None:
            seen[(eng.makespan_guard, eng.makespan_lock)] = seen.get((eng.makespan_guard, eng.makespan_lock), 0) + 1
    methods = ["ar", "hybrid", "hybrid-makespan", "hybrid-makespan-lock"]
    assert _sim_bench(tmp_path, note, methods, ["--set", "engine.makespan_lock=true"]) == 0
    assert seen == {(False, False): 1, (True, False): 1, (True, True): 1}
    rows = {r["method"]: r for r in _last_json(capsys)["rows"]}
    assert rows["hybrid-makespan-lock"]["lossless"] is True


@pytest.mark.parametrize("flags, want", [([], None), (["--lookup-device", "host"], {"lookup_device": "host"}),
                                         (["--eager", "--lookup-device", "device"],
                                          {"use_cuda_graph": False, "lookup_device": "device"})])
def test_lookup_device_option_reaches_the_engines(monkeypatch, flags, want):
    """``--lookup-device`` puts the suffix / hybrid lookups where it says (SpecEngine ``lookup_device``); left at
    ``auto`` the engines get no such argument (the device on CUDA, the host on CPU)."""
    import adaflash_ray.bench as bench_mod

    seen = {}

    def fake_bench(cfg, drafter, **kw):
        seen.update(kw)
        raise ValueError("stop before any model is loaded")

    monkeypatch.setattr(bench_mod, "bench", fake_bench)
    assert main(["--methods", "ar", "hybrid", "--concurrency", "1", "--num-prompts", "1", *flags]) == 2
    assert seen["engine_kwargs"] == want


def test_repeat_order_gives_every_method_every_place():
    """The timed repeats of a cell run in rotated orders: over as many repeats as methods, each method runs once in
    each place; repeat 0 keeps the given order (AR first)."""
    methods = ["ar", "adaflash-cost", "hybrid"]
    rounds = [repeat_order(methods, k) for k in range(len(methods))]
    assert rounds[0] == methods and all(sorted(r) == sorted(methods) for r in rounds)
    for place in range(len(methods)):
        assert sorted(r[place] for r in rounds) == sorted(methods)
    assert repeat_order(methods, 4) == rounds[1] and repeat_order([], 3) == []
    assert repeat_order(["ar", "x"], 1) == ["x", "ar"]


@pytest.mark.slow
def test_profile_runs_after_every_timed_run_of_the_concurrency(monkeypatch, capsys, tmp_path):
    """An engine serves every domain of its concurrency: the profile's instrumented runs of a cell come after the timed
    runs of all that concurrency's cells (they would feed the next domain's planner and guards), one per cell, each
    cell's file written as soon as its host phases ran; every cell's host phases before any cell's kernels, and the
    kernels (torch.profiler slows every later graph launch) at the last concurrency only, after every timed run."""
    import adaflash_ray.bench as bench_mod

    events = []
    run_engine = bench_mod._run_engine

    def timed(engine, prompts, *a, **k):
        events.append("timed")
        return run_engine(engine, prompts, *a, **k)

    def profile_cell(eng, method, domain, conc, prompts, seeds, max_new_tokens, parts):
        events.append(("profile", method, domain, conc, parts))
        return {part: f"{part} of {domain}" for part in parts}

    monkeypatch.setattr(bench_mod, "_run_engine", timed)
    monkeypatch.setattr(bench_mod, "_profile_cell", profile_cell)
    monkeypatch.setattr(bench_mod, "_write_profile", lambda doc, method, domain, conc, *a, **k: events.append(
        ("write", method, domain, conc, sorted(doc))))
    rc = main(["--recipe", str(ROOT / "recipes" / "cpu_tiny.yaml"), "--methods", "ar", "--concurrency", "1", "2",
               "--domains", "code", "qa", "--num-prompts", "1", "--max-new-tokens", "2", "--warmup", "none",
               "--profile", str(tmp_path / "prof")])
    assert rc == 0 and len(_last_json(capsys)["rows"]) == 4
    host = ("phases", "cprofile")
    expected = []
    for c in (1, 2):
        expected += ["timed"] * 2
        for d in ("code", "qa"):
            expected += [("profile", "ar", d, c, host), ("write", "ar", d, c, ["cprofile", "phases"])]
        for d in ("code", "qa"):
            if c == 2:
                expected.append(("profile", "ar", d, c, ("kernels",)))
                expected.append(("write", "ar", d, c, ["cprofile", "kernels", "phases"]))
            else:
                expected.append(("write", "ar", d, c, ["cprofile", "kernels", "kernels_skipped", "phases"]))
    assert events == expected


@pytest.mark.slow
def test_lookup_methods_get_room_for_their_longest_draft(capsys):
    """A recipe whose block is shorter than a lookup's longest draft (cpu_tiny: 4 against 15): the bench sizes its
    engines' ``max_seq_len`` for the longer headroom (a QA prompt of 43 tokens + 6 new tokens + 16 needs 65 > 64);
    with ``--prefill-buckets`` (prefills padded) the rows are lossless."""
    rc = main(["--recipe", str(ROOT / "recipes" / "cpu_tiny.yaml"), "--methods", "ar", "hybrid-makespan",
               "--concurrency", "2", "--domains", "qa", "--num-prompts", "2", "--max-new-tokens", "6",
               "--prefill-buckets"])
    assert rc == 0
    rows = _last_json(capsys)["rows"]
    assert [r["method"] for r in rows] == ["ar", "hybrid-makespan"] and all(r["lossless"] for r in rows)


@pytest.mark.slow
def test_profile_writes_one_document_per_cell_and_method(tmp_path, capsys):
    """``--profile DIR`` (adaflash_ray.step_profile through the bench): one JSON per (domain, concurrency, method) with
    the decode steps by kind and shape (AR: as many as the kernel run counted), a kernel table and a cProfile; the rows
    of the bench itself are unchanged (the profile runs come after the timed ones)."""
    prof = tmp_path / "prof"
    rc = main(["--recipe", str(ROOT / "recipes" / "cpu_tiny.yaml"), "--methods", "ar", "hybrid", "--concurrency", "1",
               "--domains", "code", "--num-prompts", "1", "--max-new-tokens", "6", "--profile", str(prof)])
    assert rc == 0
    doc = _last_json(capsys)
    assert [r["method"] for r in doc["rows"]] == ["ar", "hybrid"] and all(r["lossless"] for r in doc["rows"])
    assert sorted(p.name for p in prof.iterdir()) == ["code_c1_ar.json", "code_c1_hybrid.json"]
    for method in ("ar", "hybrid"):
        d = json.loads((prof / f"code_c1_{method}.json").read_text())
        assert (d["method"], d["domain"], d["concurrency"]) == (method, "code", 1)
        steps = sum(p["count"] for p in d["phases"].values())
        # AR takes the same steps in every run; the hybrid's choices follow measured times (its runs may differ)
        assert steps == d["kernels"]["num_steps"] if method == "ar" else steps > 0 and d["kernels"]["num_steps"] > 0
        assert all(k.split(" ")[0] == "ar" for k in d["phases"]) == (method == "ar")
        assert d["kernels"]["top"] and d["cprofile"].startswith(f"{d['kernels']['num_steps']} decode steps")


@pytest.mark.slow
def test_model_mode_on_a_sim_clock(tmp_path, capsys):
    """``--sim-costs``: every step priced by the file's table at the cell's concurrency; with host time off an AR
    step is exactly the table's AR price and a run's seconds are its steps' and prefills' prices. Bad uses are refused
    before the model loads, naming the flag."""
    bs = 16  # the default recipe's block size (the table's spec row: γ = 1..bs-1)
    table = {"batch_sizes": [1], "costs_ms": [[3.0 + 0.1 * g for g in range(1, bs)]], "ar_costs_ms": [2.0],
             "context_len": 64}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"rows": [{"method": "hybrid", "domain": "chat", "concurrency": 1,
                                          "cost_table": table}]}))
    rc = main(["--methods", "ar", "dflash", "--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "6",
               "--domains", "chat", "--sim-costs", str(path), "--sim-host-scale", "0"])
    assert rc == 0
    doc = _last_json(capsys)
    assert doc["sim_clock"]["1"]["source"].startswith(str(path)) and doc["sim_clock"]["1"]["host_scale"] == 0
    ar, dflash = doc["rows"]
    assert ar["ms_per_step"] == pytest.approx(2.0) and ar["num_engine_steps"] == 5
    assert ar["lossless"] and dflash["lossless"]
    for r in (ar, dflash):  # the prefill's price (2.0 + 0.42 ms a prompt) and each step's
        prefill = r["step_timing"]["prefill"]["total_ms"]
        assert prefill == pytest.approx(2.42)
        assert r["seconds"] * 1e3 == pytest.approx(prefill + r["ms_per_step"] * r["num_engine_steps"])
    steps = [s for s in dflash["step_timing"]["steps_by_shape"].values()]
    assert all(3.1 - 1e-9 <= v["mean_ms"] <= 4.5 for kind in steps for v in kind.values()), dflash["step_timing"]["steps_by_shape"]
    for argv, what in ((["--sim-costs", str(tmp_path / "none.json")], "not a readable JSON"),
                       (["--sim-costs", str(path), "--shape", "tiny"], "--shape"),
                       (["--sim-costs", str(path), "--sim-host-scale", "-1"], "--sim-host-scale")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and what in capsys.readouterr().err, argv


def test_warmup_goes_on_while_a_step_or_a_prefill_captured():
    """The bench's warm-up condition: a run that captured a step graph or a prefill graph asks for another pass."""
    from adaflash_ray.bench import captured_graphs
    from adaflash_ray.engine import SpecStats

    st = SpecStats()
    assert not captured_graphs(st)
    st.num_prefill_captures = 1
    assert captured_graphs(st)
    st.num_prefill_captures, st.num_captures = 0, 2
    assert captured_graphs(st)
