"""SimClock (adaflash_ray/engine/sim_clock.py) and SpecEngine.set_cost_table: the simulated clock prices each device
call by the table it was given and nothing else (host time off), the engine's policy and planner take a table from
outside, and bad tables are refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import greedy_reference, make_drafter

from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.engine.sim_clock import SimClock, load_cost_table


def _table(batch_sizes=(1, 2), bs=8, max_draft=7) -> dict:
    """Distinct prices per row and width, so a wrong row or column shows: spec 10 + row + 0.1 γ, AR 1 + row, lookup
    2 + row + 0.01 W."""
    return {"batch_sizes": list(batch_sizes),
            "costs_ms": [[10.0 + r + 0.1 * g for g in range(1, bs)] for r in range(len(batch_sizes))],
            "ar_costs_ms": [1.0 + r for r in range(len(batch_sizes))],
            "lookup_costs_ms": [[2.0 + r + 0.01 * w for w in range(1, max_draft + 2)]
                                for r in range(len(batch_sizes))],
            "context_len": 16}


def test_step_prices_read_the_row_and_column_of_the_table():
    clock = SimClock(_table())
    assert clock.step_ms(1, 1, False) == 1.0  # AR at batch 1
    assert clock.step_ms(2, 1, False) == 2.0  # AR at batch 2 (second row)
    assert clock.step_ms(5, 1, False) == 2.0  # past the last batch size: the last row
    assert clock.step_ms(1, 4, True) == pytest.approx(10.3)  # propose, γ = 3
    assert clock.step_ms(1, 1, True) == pytest.approx(10.1)  # a propose at width 1 costs width 2's
    assert clock.step_ms(2, 30, True) == pytest.approx(11.7)  # past the block: the last column
    assert clock.step_ms(1, 5, False) == pytest.approx(2.05)  # lookup drafts, W = 5
    no_lookup = {k: v for k, v in _table().items() if k != "lookup_costs_ms"}
    assert SimClock(no_lookup).step_ms(1, 5, False) == pytest.approx(10.4)  # the spec price of γ = 4
    with pytest.raises(ValueError, match="batch_sizes"):
        SimClock({"batch_sizes": [1, 2], "costs_ms": [[1.0]], "ar_costs_ms": [1.0, 1.0]})
    with pytest.raises(ValueError, match="host_scale"):
        SimClock(_table(), host_scale=-1)


def test_dflash_run_costs_exactly_its_steps_prices(tiny_target):
    """Host time off: one request's simulated seconds are its prefill's price plus, per step, the spec price of the
    width it verified (every dflash step proposes); the output is the target's greedy."""
    drafter, _ = make_drafter(tiny_target, block_size=8, layers=1, policy="fixed", seed=3)
    eng = SpecEngine(tiny_target, drafter, None, policy="fixed", max_batch_size=2, max_seq_len=128)
    clock = SimClock(_table(), host_scale=0.0, prefill_ms=(5.0, 0.5)).install(eng)
    assert eng.clock() == 0.0
    prompt = [3, 5, 7, 9]
    req = eng.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert req.output_ids == greedy_reference(tiny_target, prompt, 24)
    expected = 5.5 + sum(clock.step_ms(1, g + 1, True) for g in req.draft_lens)
    assert clock.num_calls["step"] == len(req.draft_lens) and clock.num_calls["prefill"] == 1
    assert eng.clock() * 1e3 == pytest.approx(expected, rel=1e-9)
    st = eng.stats  # the engine's own step timings read the same clock
    assert st.num_engine_steps == len(req.draft_lens)
    assert (st.decode_seconds + st.prefill_seconds) * 1e3 == pytest.approx(expected, rel=1e-9)


def test_host_time_counts_at_its_scale(tiny_target):
    """With host_scale 1 the clock also runs while no device call does (and not while one does)."""
    import time

    drafter, _ = make_drafter(tiny_target, block_size=8, layers=1, policy="fixed", seed=3)
    eng = SpecEngine(tiny_target, drafter, None, policy="fixed", max_batch_size=1, max_seq_len=64)
    clock = SimClock(_table(), host_scale=1.0).install(eng)
    t0 = clock.now()
    time.sleep(0.05)
    assert clock.now() - t0 >= 0.05
    half = SimClock(_table(), host_scale=0.5)
    t0 = half.now()
    time.sleep(0.05)
    assert 0.024 <= half.now() - t0 < 0.05


def test_set_cost_table_reaches_policy_planner_and_guards(tiny_target):
    drafter, head = make_drafter(tiny_target, block_size=8, layers=1, policy="cost", seed=5)
    eng = SpecEngine(tiny_target, drafter, head, policy="cost", max_batch_size=2, max_seq_len=128, calibrate=False,
                     draft_sources=("dflash", "ngram"))
    md = eng.runner.max_draft  # the lookups' longest draft (its table's widths: 1..md + 1)
    t = _table(max_draft=md)
    t["costs_ms"][0][2] = 99.0  # a slowed width: the lower envelope takes the next width's price
    set_ = eng.set_cost_table(t)
    assert set_["costs_ms"][0][2] == pytest.approx(10.4) and set_["costs_ms"][0][3] == pytest.approx(10.4)
    assert eng.policy.batch_sizes == [1, 2]
    assert torch.allclose(eng.policy.ar_costs.cpu(), torch.tensor([1.0, 2.0]))
    assert eng.policy.costs.cpu()[1, 0].item() == pytest.approx(11.1)
    assert np.allclose(eng.planner.lookup_costs[:, 0], [2.01, 3.01])
    assert eng.guard.batch_sizes == [1, 2] and eng.source_guard.batch_sizes == [1, 2]
    with pytest.raises(ValueError, match="max_batch_size"):
        eng.set_cost_table(_table(batch_sizes=(1, 4), max_draft=md))
    with pytest.raises(ValueError, match="costs_ms"):
        eng.set_cost_table({"batch_sizes": [1]})
    fixed_drafter, _ = make_drafter(tiny_target, block_size=8, layers=1, policy="fixed", seed=3)
    plain = SpecEngine(tiny_target, fixed_drafter, None, policy="fixed", max_batch_size=2, max_seq_len=64)
    with pytest.raises(ValueError, match="cost policy"):
        plain.set_cost_table(_table())


def test_load_cost_table_picks_the_lookup_table_of_the_concurrency(tmp_path):
    rows = [{"method": "dflash", "domain": "code", "concurrency": 8, "cost_table": {**_table(), "lookup_costs_ms": None}},
            {"method": "hybrid", "domain": "code", "concurrency": 8, "cost_table": _table()},
            {"method": "hybrid", "domain": "code", "concurrency": 1, "cost_table": _table(batch_sizes=(1,))},
            {"method": "ar", "domain": "code", "concurrency": 1}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    t = load_cost_table(path, 8)
    assert t["batch_sizes"] == [1, 2] and t["lookup_costs_ms"] and "hybrid" in t["source"]
    assert load_cost_table(path, 1)["batch_sizes"] == [1]
    with pytest.raises(ValueError, match="concurrency 64"):
        load_cost_table(path, 64)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON"):
        load_cost_table(bad)
    one = tmp_path / "table.json"
    one.write_text(json.dumps(_table()))
    assert load_cost_table(one)["costs_ms"] == _table()["costs_ms"]
