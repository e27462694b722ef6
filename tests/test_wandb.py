"""wandb as its users expect (adaflash_ray/metrics.py MetricsSink).

- ``WANDB_MODE`` / ``WANDB_PROJECT`` are honoured unless the recipe sets ``logging.wandb_mode`` / ``wandb_project``;
- every record kind has its own x-axis (``define_metric(key, step_metric=...)``): train metrics against
  ``train/step``, eval against ``eval/version``, each inference worker's under ``worker<i>/`` against its own
  ``worker<i>/poll``; ``wandb.log`` is never given one global ``step=``;
- the JSONL log keeps its flat records.

A recording stand-in for the ``wandb`` module checks the calls; one test runs the real wandb offline
(``WANDB_MODE=offline`` from the environment) into the run directory.
Run: python -m pytest -q tests/test_wandb.py
"""
from __future__ import annotations

import json
from pathlib import Path
import sys
from types import SimpleNamespace

import pytest

from adaflash_ray.config import load_recipe
from adaflash_ray.metrics import MetricsSink, wandb_settings


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def define_metric(self, name, step_metric=None):
        self.calls.append(("define_metric", name, step_metric))

    def log(self, data, **kw):
        self.calls.append(("log", dict(data), kw))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []

    def init(**kw):
        calls.append(("init", kw))
        return _FakeRun(calls)

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init))
    return calls


def test_env_respected_unless_the_recipe_sets_it(monkeypatch):
    env = {"WANDB_MODE": "online", "WANDB_PROJECT": "team-proj"}
    assert wandb_settings(None, None, env) == ("online", "team-proj")
    assert wandb_settings("disabled", "mine", env) == ("disabled", "mine")  # the recipe's explicit value wins
    assert wandb_settings(None, None, {}) == ("offline", "adaflash_ray")  # nothing set: offline, as before
    cfg = load_recipe(None)  # the embedded default recipe leaves both to the environment
    assert (cfg.logging.wandb_mode, cfg.logging.wandb_project) == (None, None)
    assert load_recipe(None, ["logging.wandb_mode=disabled"]).logging.wandb_mode == "disabled"


def test_init_kwargs_from_env_and_recipe(fake_wandb, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    MetricsSink(tmp_path, None, None, {"a": 1}, "run-1").close()
    init = fake_wandb[0][1]
    assert (init["mode"], init["project"], init["name"], init["dir"]) == ("offline", "from-env", "run-1", str(tmp_path))
    fake_wandb.clear()
    MetricsSink(tmp_path, "online", "from-recipe").close()
    assert (fake_wandb[0][1]["mode"], fake_wandb[0][1]["project"]) == ("online", "from-recipe")
    fake_wandb.clear()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = MetricsSink(tmp_path, None, None)
    sink.log({"train/loss": 1.0}, step=1, kind="train")
    sink.close()
    assert fake_wandb == []  # disabled by the environment: wandb is never started


def test_each_series_has_its_own_axis(fake_wandb, tmp_path):
    sink = MetricsSink(tmp_path, "offline", "p")
    sink.log({"train/step": 1, "train/loss": 3.0}, step=1, kind="train")
    sink.log({"train/loss": 2.5}, step=2, kind="train")  # a record without train/step gets it from step=
    sink.log({"spec/accept_len": 1.1, "worker": 0}, kind="inference")
    sink.log({"spec/accept_len": 1.3, "worker": 1}, kind="inference")
    sink.log({"spec/accept_len": 1.2, "worker": 0}, kind="inference")
    sink.log({"eval/version": 3, "eval/accept_len": 1.15}, kind="eval")
    sink.log({"buffer/depth": 4}, kind="buffer")
    sink.log({"buffer/depth": 5}, kind="buffer")
    sink.close()
    axis = {name: step for kind, name, step, *_ in [c for c in fake_wandb if c[0] == "define_metric"]}
    assert axis["train/loss"] == "train/step" and "train/step" in axis
    assert axis["worker0/spec/accept_len"] == "worker0/poll" and axis["worker1/spec/accept_len"] == "worker1/poll"
    assert axis["eval/accept_len"] == "eval/version"
    assert axis["buffer/depth"] == "buffer/record"
    logs = [c for c in fake_wandb if c[0] == "log"]
    assert all(kw == {} for _, _, kw in logs)  # no global step=: it would have to grow across every kind at once
    data = [d for _, d, _ in logs]
    assert data[1] == {"train/loss": 2.5, "train/step": 2}
    assert [d.get("worker0/poll") for d in data[2:5]] == [1, None, 2] and data[3]["worker1/poll"] == 1
    assert "worker" not in data[2] and data[7]["buffer/record"] == 2
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[2]["worker"] == 0 and recs[2]["spec/accept_len"] == 1.1 and recs[1]["step"] == 2  # JSONL flat


_OFFLINE_CHILD = """
import sys
from pathlib import Path
from adaflash_ray.metrics import MetricsSink
sink = MetricsSink(Path(sys.argv[1]), None, None, {"seed": 0}, "offline-test")
assert (sink.wandb_mode, sink.wandb_project) == ("offline", "env-project"), (sink.wandb_mode, sink.wandb_project)
assert sink._wandb is not None, "wandb failed to start offline"
sink.log({"train/step": 1, "train/loss": 3.0}, step=1, kind="train")
sink.log({"spec/accept_len": 1.1, "worker": 0}, kind="inference")
sink.log({"eval/version": 0, "eval/accept_len": 1.0}, kind="eval")
sink.close()
print("closed")
"""


def test_real_wandb_offline_from_env(tmp_path):
    """The real wandb, offline from the environment, in a fresh interpreter (wandb's service is per process: what
    other tests of the session did to it cannot reach this run, and the process exit is the point where wandb
    has written its run log whatever its version): the run log holds the project and every axis."""
    pytest.importorskip("wandb")
    import os
    import subprocess

    env = dict(os.environ, WANDB_MODE="offline", WANDB_PROJECT="env-project", WANDB_SILENT="true")
    r = subprocess.run([sys.executable, "-c", _OFFLINE_CHILD, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=240, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "closed" in r.stdout, r.stderr[-3000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()  # the offline run log (protobuf records): the axes and the project are in it
    for key in (b"env-project", b"train/step", b"worker0/poll", b"worker0/spec/accept_len", b"eval/version"):
        assert key in data, (key, len(data))


def test_plot_tau_draws_the_domain_panel_with_the_lookup_lines(tmp_path):
    """plot_tau with per-domain τ and the lookup baselines: a PNG of two panels (twice as wide as without them), the
    second with one drafter curve per domain and a prompt-lookup and a suffix-lookup line per domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from adaflash_ray.metrics import plot_tau

    by_domain = {0: {"code": 1.0, "chat": 1.0}, 1: {"code": 1.4, "chat": 1.5}, 2: {"code": 1.9, "chat": 1.8}}
    baselines = {"ngram": {"code": 2.3, "chat": 2.0}, "suffix": {"code": 2.8, "chat": 2.2}}
    drawn = []
    real_axhline = plt.Axes.axhline
    plt.Axes.axhline = lambda self, y, **kw: drawn.append((y, kw["linestyle"])) or real_axhline(self, y, **kw)
    try:
        one = plot_tau({0: 1.0, 1: 1.45, 2: 1.85}, {1: 1.5}, tmp_path / "one.png", "t")
        two = plot_tau({0: 1.0, 1: 1.45, 2: 1.85}, {1: 1.5}, tmp_path / "two.png", "t", by_domain, baselines)
    finally:
        plt.Axes.axhline = real_axhline
    assert sorted(drawn) == [(2.0, ":"), (2.2, "--"), (2.3, ":"), (2.8, "--")]
    w1, h1 = Image.open(one).size
    w2, h2 = Image.open(two).size
    assert h1 == h2 and w2 == 2 * w1
