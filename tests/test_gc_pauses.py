"""Python's garbage collector around the engine's steps (adaflash_ray/engine/gc_pauses.py): pauses counted inside
the decode steps they land in, and the heap frozen once an engine is built. Tiny random models, no Ray."""
from __future__ import annotations

import gc

import pytest
import torch

from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.engine import gc_pauses
from conftest import greedy_reference, make_drafter

torch.set_num_threads(1)


@pytest.fixture
def unfrozen():
    """Leaves the process's heap unfrozen after the test (later tests see a plain collector)."""
    yield
    gc.unfreeze()


def test_pauses_count_each_collection_and_its_generation():
    pauses = gc_pauses.install()
    assert gc_pauses.install() is pauses and gc.callbacks.count(pauses) == 1  # once per process
    n0, full0, s0 = pauses.snapshot()
    gc.collect(0)
    gc.collect()  # the oldest generation
    n1, full1, s1 = pauses.snapshot()
    assert n1 - n0 == 2 and full1 - full0 == 1 and s1 > s0


def test_freeze_moves_the_live_heap_to_the_permanent_generation(unfrozen):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    keep = [[i] for i in range(1000)]  # 1,001 live containers at least
    out = gc_pauses.freeze_gc_heap()
    # the count it returns is the permanent generation's then: a thread of an earlier test (Ray's) may free a frozen
    # object before the count is read again here
    now = gc.get_freeze_count()
    assert out["frozen"] - 100 <= now <= out["frozen"] and now >= len(keep) and out["seconds"] >= 0
    assert not any(o is keep[0] for o in gc.get_objects())  # the permanent generation is left out of every one
    gc.unfreeze()
    assert gc.get_freeze_count() == 0 and any(o is keep[0] for o in gc.get_objects())


def test_a_collection_inside_a_step_is_in_that_steps_stats(tiny_target):
    """A collection forced inside one decode step (its host work) is counted once, in full, in the engine's stats -
    ``timing()["gc"]`` - and the outputs stay the target's."""
    drafter, head = make_drafter(tiny_target, block_size=6, layers=1, policy="direct", seed=2)
    eng = SpecEngine(tiny_target, drafter, head, max_batch_size=2, max_seq_len=128)
    prompt = [5, 9, 17, 3, 40]
    real = eng._postprocess
    calls = []

    def postprocess(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # the third step's host work
            gc.collect()
        return real(*a, **k)

    eng._postprocess = postprocess
    before = eng.stats.num_gc
    out = eng.generate([prompt], SamplingParams(max_new_tokens=12))[0].output_ids
    assert out == greedy_reference(tiny_target, prompt, 12)
    st = eng.stats
    assert len(calls) >= 3
    assert st.num_gc - before >= 1 and st.num_gc_full >= 1 and st.gc_seconds > 0
    row = st.timing()["gc"]
    assert row["count"] == st.num_gc and row["num_full"] == st.num_gc_full
    assert row["total_ms"] == pytest.approx(1e3 * st.gc_seconds)
