"""Run-directory sinks used by the driver (the only writer of logs): metrics JSONL, wandb
(offline by default), the τ-vs-version plot and the final table. No Ray here."""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path


#: The x-axis of each record kind in wandb (``define_metric(..., step_metric=...)``): a kind's metrics are charted
#: against this key when its record carries it, else against the kind's own record counter ``<kind>/record``.
#: Per-worker records (a ``worker`` field) go under ``worker<i>/...`` with the axis ``worker<i>/poll``.
WANDB_AXES = {"train": "train/step", "eval": "eval/version", "canary": "canary/version", "sync": "sync/version"}


def wandb_settings(mode: str | None, project: str | None, env: dict | None = None) -> tuple[str, str]:
    """(mode, project) for ``wandb.init``: the recipe's value when it sets one, else ``$WANDB_MODE`` /
    ``$WANDB_PROJECT``, else ``offline`` / ``adaflash_ray`` (wandb's own environment variables, as its users
    expect them to work; an explicit recipe value wins, as an explicit ``wandb.init`` argument does)."""
    env = os.environ if env is None else env
    return (mode or env.get("WANDB_MODE") or "offline", project or env.get("WANDB_PROJECT") or "adaflash_ray")


class MetricsSink:
    """Append flat ``dict[str, float]`` records to ``<run_dir>/metrics.jsonl`` and to wandb.

    wandb: mode and project from :func:`wandb_settings` (``offline`` writes under ``<run_dir>/wandb``; ``disabled``
    starts nothing). Each record kind gets its own x-axis (:data:`WANDB_AXES`, registered with
    ``wandb.define_metric`` the first time a metric appears), so train steps, eval versions and each worker's
    polls are charted on their own axes instead of wandb's one global step; ``wandb.log`` is called without
    ``step=``, which would have to grow monotonically across all kinds. A wandb failure is reported once and the
    JSONL log continues (nothing is lost). The JSONL records keep their flat keys (``worker`` as a field).
    """

    def __init__(self, run_dir: Path, wandb_mode: str | None = None, project: str | None = None,
                 config: dict | None = None, name: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._fh = self.path.open("a")
        self._t0 = time.time()
        self._wandb = None
        self._defined: set[str] = set()  # wandb keys already given their axis
        self._counts: dict[str, int] = {}  # records per axis counter (<kind>/record, worker<i>/poll)
        mode, project = wandb_settings(wandb_mode, project)
        self.wandb_mode, self.wandb_project = mode, project
        if mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(project=project, mode=mode, dir=str(self.run_dir), config=config,
                                         name=name, reinit="finish_previous")
            except Exception as e:  # wandb is a sink, not a dependency of correctness
                warnings.warn(f"wandb disabled: {e!r}")
                self._wandb = None

    def _wandb_record(self, metrics: dict, step: int | None, kind: str) -> tuple[dict, str]:
        """(the numeric record under its wandb keys, with its axis value; the axis key)."""
        num = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        worker = num.pop("worker", None) if "worker" in metrics else None
        if worker is not None:
            prefix = f"worker{int(worker)}/"
            num = {prefix + k: v for k, v in num.items()}
            axis = prefix + "poll"
        else:
            axis = WANDB_AXES.get(kind, "")
            if kind == "train" and step is not None:
                num.setdefault(axis, step)
            if axis not in num:
                axis = f"{kind}/record"
        if axis not in num:
            self._counts[axis] = num[axis] = self._counts.get(axis, 0) + 1
        return num, axis

    def log(self, metrics: dict, step: int | None = None, kind: str = "metrics") -> None:
        rec = {"kind": kind, "time": time.time(), "wall_s": time.time() - self._t0}
        if step is not None:
            rec["step"] = step
        rec.update({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()})
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._wandb is not None:
            num, axis = self._wandb_record(metrics, step, kind)
            try:
                if axis not in self._defined:
                    self._wandb.define_metric(axis)
                    self._defined.add(axis)
                for k in num:
                    if k not in self._defined:
                        self._wandb.define_metric(k, step_metric=axis)
                        self._defined.add(k)
                self._wandb.log(num)
            except Exception as e:
                warnings.warn(f"wandb log failed, continuing with JSONL only: {e!r}")
                self._wandb = None

    def close(self) -> None:
        self._fh.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:  # the JSONL file is already closed and complete; say what wandb lost
                warnings.warn(f"wandb finish failed (the offline run may be incomplete; metrics.jsonl is): {e!r}")


def strict_json(obj):
    """``obj`` with NaN / inf floats as None, so ``json.dumps`` output is strict JSON for any client. SpecStats
    reports undefined statistics (τ with no verify step, draft waste with nothing drafted) as NaN; Python's
    json would write a bare ``NaN`` and a strict encoder (Starlette's) would refuse the whole document."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def plot_tau(eval_tau: dict[int, float], serve_tau: dict[int, float], path: Path, title: str,
             by_domain: dict[int, dict[str, float]] | None = None,
             baselines: dict[str, dict[str, float]] | None = None) -> Path:
    """PNG of τ (mean committed tokens per verify step) against drafter version.

    Args:
        eval_tau, serve_tau: {version: τ} of the held-out evaluation and of on-policy serving (either may be empty).
        path: the PNG written. title: the figure's title.
        by_domain: {version: {domain: held-out τ}}; when given (non-empty), a second panel draws each domain's curve.
        baselines: {"ngram" | "suffix": {domain: τ}} - prompt lookup and suffix lookup on the same greedy outputs
            (:func:`adaflash_ray.drafting.heldout.lookup_baselines`), drawn in the second panel as horizontal lines in
            their domain's colour (dotted: prompt lookup, dashed: suffix lookup): the free drafters to beat.
    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = 2 if by_domain else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0, 0]
    if eval_tau:
        xs = sorted(eval_tau)
        ax.plot(xs, [eval_tau[x] for x in xs], "o-", label="held-out eval (greedy)")
    if serve_tau:
        xs = sorted(serve_tau)
        ax.plot(xs, [serve_tau[x] for x in xs], "s--", label="on-policy serving")
    ax.set_title(title)
    if by_domain:
        ax2 = axes[0, 1]
        versions = sorted(by_domain)
        domains = sorted({d for v in versions for d in by_domain[v]})
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for k, dom in enumerate(domains):
            c = colours[k % len(colours)]
            xs = [v for v in versions if dom in by_domain[v]]
            ax2.plot(xs, [by_domain[v][dom] for v in xs], "o-", color=c, label=f"{dom}: drafter")
            for name, style in (("ngram", ":"), ("suffix", "--")):
                t = (baselines or {}).get(name, {}).get(dom)
                if t is not None:
                    ax2.axhline(t, color=c, linestyle=style, linewidth=1,
                                label=f"{dom}: {'prompt' if name == 'ngram' else 'suffix'} lookup")
        ax2.set_title("held-out τ by domain; lines: prompt (:) / suffix (--) lookup")
        ax2.legend(fontsize=7, ncol=2)
    for a in axes[0]:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_xlabel("drafter version")
        a.set_ylabel("τ = mean(a+1) per verify step")
        a.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class PlainProgress:
    """Progress for logs without a terminal (``ray job logs -f``, CI): one plain ``progress ...`` line to
    ``stream`` at most every ``every_s`` seconds (the first update prints at once), flushed, no control
    codes. Fields keep their order; floats are rounded to 3 digits; None prints as ``-``.

    Example line: ``progress 00:02:10 version 2/5 step 180 loss 3.412 serve_tau 1.121 gamma 1.0 buffer 12
    stale_drops 0 trainer_util 0.83 tok_per_s 31.2``.
    """

    def __init__(self, stream, every_s: float = 30.0, total_versions: int | None = None, clock=time.monotonic):
        self.stream, self.every_s, self.total_versions, self.clock = stream, float(every_s), total_versions, clock
        self._t0 = clock()
        self._last: float | None = None

    def line(self, version: int, **fields) -> str:
        """The text of one progress line (also what :meth:`update` prints)."""
        el = int(self.clock() - self._t0)
        parts = [f"progress {el // 3600:02d}:{el // 60 % 60:02d}:{el % 60:02d}",
                 f"version {version}" + (f"/{self.total_versions}" if self.total_versions else "")]
        for k, v in fields.items():
            if v is None:
                v = "-"
            elif isinstance(v, float):
                v = f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
            parts.append(f"{k} {v}")
        return " ".join(parts)

    def update(self, version: int, force: bool = False, **fields) -> bool:
        """Print a line if ``every_s`` has passed since the last one (or ``force``); returns whether it did."""
        now = self.clock()
        if not force and self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        print(self.line(version, **fields), file=self.stream, flush=True)
        return True
