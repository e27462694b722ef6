"""Run-directory sinks used by the driver (the only writer of logs): metrics JSONL, wandb
(offline by default), the τ-vs-version plot and the final table. No Ray here."""
from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path


class MetricsSink:
    """Append flat ``dict[str, float]`` records to ``<run_dir>/metrics.jsonl`` and to wandb.

    wandb runs in the mode of the recipe (``offline`` writes under ``<run_dir>/wandb``); a wandb
    failure is reported once and the JSONL log continues (nothing is lost).
    """

    def __init__(self, run_dir: Path, wandb_mode: str = "offline", project: str = "adaflash_ray",
                 config: dict | None = None, name: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._fh = self.path.open("a")
        self._t0 = time.time()
        self._wandb = None
        if wandb_mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(project=project, mode=wandb_mode, dir=str(self.run_dir), config=config,
                                         name=name, reinit="finish_previous")
            except Exception as e:  # wandb is a sink, not a dependency of correctness
                warnings.warn(f"wandb disabled: {e!r}")
                self._wandb = None

    def log(self, metrics: dict, step: int | None = None, kind: str = "metrics") -> None:
        rec = {"kind": kind, "time": time.time(), "wall_s": time.time() - self._t0}
        if step is not None:
            rec["step"] = step
        rec.update({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()})
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._wandb is not None:
            num = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            try:
                self._wandb.log(num)
            except Exception as e:
                warnings.warn(f"wandb log failed, continuing with JSONL only: {e!r}")
                self._wandb = None

    def close(self) -> None:
        self._fh.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:
                pass


def plot_tau(eval_tau: dict[int, float], serve_tau: dict[int, float], path: Path, title: str) -> Path:
    """PNG of τ (mean committed tokens per verify step) against drafter version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if eval_tau:
        xs = sorted(eval_tau)
        ax.plot(xs, [eval_tau[x] for x in xs], "o-", label="held-out eval (greedy)")
    if serve_tau:
        xs = sorted(serve_tau)
        ax.plot(xs, [serve_tau[x] for x in xs], "s--", label="on-policy serving")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("drafter version")
    ax.set_ylabel("τ = mean(a+1) per verify step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
