"""The vLLM-shaped metrics (adaflash_ray/actors/spec_metrics.py) against a known engine run on tiny random models,
with a recording metrics backend in place of Ray's (no Ray started): every counter equals what the requests
themselves recorded, per-position counts follow a > position, the histograms see one TTFT and one E2E per
request and tokens - 1 ITL observations; SpecStats.accepted_per_pos adds and windows like the other counts."""
from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest
import torch

from adaflash_ray.actors.spec_metrics import METRIC_NAMES, SpecMetrics
from adaflash_ray.engine import EngineService, SamplingParams, SpecEngine, SpecStats
from conftest import make_drafter
from test_engine import Oracle, tiny_reference

torch.set_num_threads(1)


class _Metric:
    def __init__(self, sink, name, tag_keys, boundaries=None):
        self.sink, self.name, self.tag_keys, self.boundaries, self.defaults = sink, name, tag_keys, boundaries, {}

    def set_default_tags(self, tags):
        assert set(tags) <= set(self.tag_keys), (self.name, tags)
        self.defaults = dict(tags)

    def _key(self, tags):
        t = {**self.defaults, **(tags or {})}
        assert set(t) == set(self.tag_keys), (self.name, t)  # Ray needs every tag key at record time
        return self.name, tuple(sorted(t.items()))

    def inc(self, value=1.0, tags=None):
        assert value > 0, (self.name, value)  # Ray's Counter refuses others
        self.sink.counts[self._key(tags)] += value

    def observe(self, value, tags=None):
        self.sink.observed[self._key(tags)].append(value)

    def set(self, value, tags=None):
        self.sink.gauges[self._key(tags)] = value


class RecordingBackend:
    def __init__(self):
        self.counts, self.observed, self.gauges, self.made = Counter(), defaultdict(list), {}, {}

    def _make(self, name, tag_keys, boundaries=None):
        assert name not in self.made, f"{name} defined twice"
        self.made[name] = _Metric(self, name, tag_keys, boundaries)
        return self.made[name]

    def counter(self, name, description, tag_keys):
        return self._make(name, tag_keys)

    def gauge(self, name, description, tag_keys):
        return self._make(name, tag_keys)

    def histogram(self, name, description, boundaries, tag_keys):
        assert boundaries == sorted(boundaries) and boundaries[0] > 0
        return self._make(name, tag_keys, boundaries)

    def total(self, key, **tags):
        return sum(v for (n, t), v in self.counts.items() if n == METRIC_NAMES[key] and tags.items() <= dict(t).items())

    def values(self, key):
        return [x for (n, _), v in self.observed.items() if n == METRIC_NAMES[key] for x in v]


def test_accepted_per_pos_counts_a_greater_than_position():
    st = SpecStats.from_steps([3, 0, 5, 2], [2, 0, 5, 0])
    assert st.accepted_per_pos == Counter({0: 2, 1: 2, 2: 1, 3: 1, 4: 1})
    assert sum(st.accepted_per_pos.values()) == st.num_accepted
    later = st + SpecStats.from_steps([4], [1])
    assert (later - st).accepted_per_pos == Counter({0: 1}) and later.copy().accepted_per_pos == later.accepted_per_pos


def test_counters_match_a_known_engine_run(monkeypatch, tiny_target):
    """An oracle drafter that is right for the first (prompt length mod 5) positions of each draft: every
    acceptance count 0 .. 4 occurs."""
    block = 6
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (k,), generator=g).tolist() for k in (5, 12, 3, 9)]
    drafter, _ = make_drafter(tiny_target, block_size=block, layers=1, policy="fixed", seed=2)
    engine = SpecEngine(tiny_target, drafter, None, policy="fixed", max_batch_size=2, max_seq_len=128)
    Oracle(monkeypatch, engine, tiny_reference(tiny_target, prompts, 20),
           num_correct=lambda req: len(req.prompt_ids) % 5)
    backend = RecordingBackend()
    m = SpecMetrics(block, "worker", "7", backend=backend)
    m.set_drafter_version(3)
    service = EngineService(engine, name="metrics test")
    service.subscribe(m.on_step)
    handles = []
    for p in prompts:
        handles.append(m.timed_submit(lambda p=p: service.submit(p, SamplingParams(max_new_tokens=17,
                                                                                   ignore_eos=True))))
    reqs = [h.future.result(timeout=300) for h in handles]
    service.shutdown(timeout_s=30)
    steps = SpecStats.from_steps([x for r in reqs for x in r.draft_lens], [x for r in reqs for x in r.num_accepted])
    assert steps.num_drafting_steps > 0 and steps.num_accepted > 0  # the run drafted and accepted something
    assert backend.total("drafts") == steps.num_drafting_steps == engine.stats.num_drafting_steps
    assert backend.total("draft_tokens") == steps.num_drafted
    assert backend.total("accepted") == steps.num_accepted
    assert backend.total("generation_tokens") == sum(len(r.output_ids) for r in reqs) == 4 * 17
    for pos in range(block - 1):
        want = sum(a > pos for r in reqs for a in r.num_accepted)
        assert backend.total("accepted_per_pos", position=str(pos)) == want, pos
    assert backend.total("accepted_per_pos") == steps.num_accepted
    # acceptance length as the dashboard computes it = the engine's per-draft acceptance length
    assert math.isclose(1 + backend.total("accepted") / backend.total("drafts"), engine.stats.per_draft_accept_len)
    assert Counter(backend.values("draft_len")) == steps.draft_len_hist
    assert len(backend.values("ttft")) == len(backend.values("e2e")) == 4
    assert len(backend.values("itl")) == 4 * (17 - 1)
    assert all(x >= 0 for k in ("ttft", "itl", "e2e") for x in backend.values(k))
    assert max(backend.values("ttft")) <= max(backend.values("e2e"))
    assert m.num_timed == 0  # every finished request stopped being timed
    assert set(backend.gauges.values()) == {3}
    assert all(dict(t).get("component") == "worker" and dict(t)["instance"] == "7"
               for (_, t) in list(backend.counts) + list(backend.observed))


def test_aborted_requests_stop_being_timed_without_an_e2e(tiny_target):
    drafter, head = make_drafter(tiny_target, block_size=6, layers=1, policy="direct", seed=2)
    engine = SpecEngine(tiny_target, drafter, head, max_batch_size=2, max_seq_len=128)
    backend = RecordingBackend()
    m = SpecMetrics(6, "serve", "r1", backend=backend)
    service = EngineService(engine, name="metrics abort test")
    service.subscribe(m.on_step)
    long = m.timed_submit(lambda: service.submit([1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True)))
    service.abort(long)
    assert long.future.result(timeout=300).finish_reason == "abort"
    short = m.timed_submit(lambda: service.submit([4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    short.future.result(timeout=300)
    service.shutdown(timeout_s=30)
    assert len(backend.values("e2e")) == 1 and m.num_timed == 0


def test_per_source_counters():
    st = SpecStats()
    for g, a, src in [(4, 2, "dflash"), (3, 3, "ngram"), (0, 0, "none"), (5, 0, "dflash"), (2, 1, "suffix")]:
        st.record_step(g, a, src)
    backend = RecordingBackend()
    SpecMetrics(6, "worker", "0", backend=backend).observe_stats(st)
    assert [backend.total(k, source="dflash") for k in ("drafts_per_source", "draft_tokens_per_source",
                                                         "accepted_per_source")] == [2, 9, 2]
    assert backend.total("drafts_per_source") == backend.total("drafts") == 4
    assert backend.total("accepted_per_source") == backend.total("accepted") == 6
    assert backend.total("draft_tokens_per_source", source="none") == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        SpecMetrics(0, "serve", "x", backend=RecordingBackend())
    with pytest.raises(ValueError, match="component"):
        SpecMetrics(4, "", "x", backend=RecordingBackend())


def test_grafana_dashboard_is_built_on_these_metrics():
    """cluster/grafana_adaflash_dashboard.json queries every metric by its exported name (Ray's ``ray_`` prefix,
    ``_total`` for counters, ``_bucket`` for histograms) and nothing else of ours."""
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[1] / "cluster" / "grafana_adaflash_dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"ray_(adaflash_\w+?)(?:_total|_bucket)?\b", e)}
    assert used == set(METRIC_NAMES.values()), used ^ set(METRIC_NAMES.values())
    counters = [METRIC_NAMES[k] for k in ("drafts", "draft_tokens", "accepted", "accepted_per_pos",
                                          "generation_tokens")]
    assert all(f"ray_{n}_total" in " ".join(exprs) for n in counters)
    assert any("1 + sum(rate(ray_adaflash_spec_decode_num_accepted_tokens_total" in e for e in exprs)
    assert sum("histogram_quantile(0.99" in e for e in exprs) == 3 and sum("histogram_quantile(0.5" in e for e in exprs) == 3
