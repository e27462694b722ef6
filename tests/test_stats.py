"""SpecStats, the one definition of τ / acceptance rate / draft waste / γ histogram (adaflash_ray/engine/stats.py)."""
from __future__ import annotations

import math

from adaflash_ray.engine import SpecStats


def test_definitions_on_recorded_steps():
    s = SpecStats.from_steps([3, 3, 1, 0], [3, 0, 1, 0])  # γ and a per verify step
    assert s.num_verify_steps == 4 and s.num_drafted == 7 and s.num_accepted == 4
    assert s.accept_len == (4 + 4) / 4  # τ = mean(a+1)
    assert s.acceptance_rate == 4 / 7 and math.isclose(s.draft_waste, 3 / 7)
    assert s.mean_draft_len == 7 / 4
    assert dict(s.draft_len_hist) == {3: 2, 1: 1, 0: 1}
    m = s.as_metrics("eval")
    assert m["eval/accept_len"] == 2.0 and m["eval/num_verify_steps"] == 4.0


def test_undefined_values_are_nan_everywhere():
    empty = SpecStats()
    assert math.isnan(empty.accept_len) and math.isnan(empty.acceptance_rate) and math.isnan(empty.draft_waste)
    assert math.isnan(empty.ms_per_step) and math.isnan(empty.decode_tokens_per_s)
    nothing_drafted = SpecStats.from_steps([0, 0], [0, 0])  # verify steps with γ = 0 (end of a budget)
    assert nothing_drafted.accept_len == 1.0
    assert math.isnan(nothing_drafted.acceptance_rate) and math.isnan(nothing_drafted.draft_waste)


def test_windows_add_and_subtract():
    total = SpecStats.from_steps([2, 2], [2, 1])
    total.num_generated, total.num_engine_steps, total.decode_seconds = 7, 2, 0.5
    before = total.copy()
    total.record_step(4, 0)
    window = total - before
    assert window.num_verify_steps == 1 and window.num_drafted == 4 and window.accept_len == 1.0
    assert dict(window.draft_len_hist) == {4: 1}
    assert (before + window).accept_len == total.accept_len
    assert before.num_verify_steps == 2  # the snapshot is independent


def test_since_without_shapes_leaves_only_the_shape_counters_out():
    a = SpecStats()
    a.record_engine_step("draft", 0.002, (4, 8))
    a.record_steps([3, 0, 5, 2, 1], [1, 0, 5, 2, 0], ["dflash", "none", "suffix", "suffix", "dflash"])
    before = a.copy(by_shape=False)
    assert not before.shape_steps and not before.shape_seconds and before.num_engine_steps == 1
    a.record_engine_step("gamma0", 0.001, (4, 1))
    a.record_steps([0, 0, 0, 0], [0, 0, 0, 0], ["none"] * 4)
    d = a.since(before, by_shape=False)
    full = a - before
    assert not d.shape_steps and full.shape_steps == {("draft", 4, 8): 1, ("gamma0", 4, 1): 1}
    assert (d.num_engine_steps, d.num_verify_steps, d.kind_steps) == (1, 4, {"gamma0": 1})
    assert a.copy().shape_steps == a.shape_steps
