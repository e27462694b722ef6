"""SimClock: run the engine's real decoding against another machine's step costs.

The drafting policies (the ``cost`` policy, :class:`~adaflash_ray.engine.hybrid.HybridPlanner`, the guards of
:mod:`adaflash_ray.engine.throughput_guard`) decide from acceptance - what the target and the drafter really do on the
text - and from step costs. On a machine without the GPU they are meant for, the acceptance is the same (the same
weights in the same dtype, greedy verification: run the target in the GPU's dtype, ``--set model.dtype=bfloat16``, as a
drafter trained on bf16 target features accepts fewer drafts over float32 ones) but every step cost is wrong by two
orders of magnitude, and in the wrong proportions (a CPU's verify grows with its width, a GPU's hardly does). A
:class:`SimClock` keeps the real decoding and replaces the clock: every device call of the engine's
:class:`~adaflash_ray.engine.runner.ModelRunner` advances it by what that call costs in a step cost table measured on
the GPU (the ``cost_table`` a GPU bench row or :meth:`SpecEngine.calibrate_costs` reports), and the engine's own host
work between the device calls (planning, records, commits; on a GPU it does not overlap the step) advances it by its
real elapsed time, times ``host_scale``. The engine reads that clock for its step timings, its guards and the planner's
realised costs, so policies can be compared on a CPU at GPU prices: tokens per simulated second.

The model of one device call (milliseconds):

- ``ModelRunner.step``: at batch size B = max(slot) + 1 (the table row of the first batch size >= B, else the
  last) and verify width W = 1 + max γ: a step that proposes a block (``propose`` or ``propose_first``, with a
  drafter) costs ``costs_ms[row][max(W - 1, 1) - 1]``; a step without a propose costs ``lookup_costs_ms[row][W - 1]``
  (W = 1: ``ar_costs_ms[row]``); plus ``catch_up_ms`` where the step first caught up its drafter context;
- ``ModelRunner.prefill``: ``prefill_ms[0] + prefill_ms[1] x`` the prompts prefilled;
- ``ModelRunner.catch_up_context`` (outside a step): ``catch_up_ms``.

What this leaves out: the table is measured at one context length (the GPU's attention grows slowly with it) and
prefills are priced by a line; host work runs at this machine's speed (``host_scale`` rescales it), and work the GPU
overlaps with the step (``ModelRunner.step``'s ``overlap`` callback) is not counted, as on the GPU. It is a tool for
comparing policies, not a timing: GPU benches decide.
"""
from __future__ import annotations

import bisect
import json
import time
from pathlib import Path

#: prefill price (ms): a fixed part and a part per prompt, of the order of SmolLM2-135M's (bf16, CUDA graphs) on an
#: H100; a GPU bench row's ``step_timing.prefill`` gives the real figures to pass instead
PREFILL_MS = (2.0, 0.42)
#: a drafter-context catch-up (ms; one captured graph on the GPU, whatever its positions)
CATCH_UP_MS = 0.1


def load_cost_table(path: str | Path, concurrency: int | None = None) -> dict:
    """The step cost table of a bench JSON (``python -m adaflash_ray.bench --out``) or of a file holding one table.

    A bench JSON gives the ``cost_table`` of its first row (of ``concurrency``, when given) that has one with a lookup
    table (the hybrid's: its AR and spec steps include the device lookup's kernels), else of its first row with any.
    Returns ``{"batch_sizes", "costs_ms", "ar_costs_ms", "context_len", maybe "lookup_costs_ms", "source"}``.
    Raises:
        ValueError: the file is not JSON, or holds no cost table (of that concurrency).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if isinstance(doc, dict) and "costs_ms" in doc:
        return {**doc, "source": str(path)}
    rows = doc.get("rows", []) if isinstance(doc, dict) else []
    rows = [r for r in rows if isinstance(r, dict) and r.get("cost_table")
            and (concurrency is None or r.get("concurrency") == concurrency)]
    if not rows:
        raise ValueError(f"{path}: no row with a cost_table" + (f" at concurrency {concurrency}" if concurrency else ""))
    best = next((r for r in rows if r["cost_table"].get("lookup_costs_ms")), rows[0])
    return {**best["cost_table"], "source": f"{path} ({best['method']}, {best['domain']}, "
                                            f"concurrency {best['concurrency']})"}


class SimClock:
    """Seconds of a simulated GPU (module docstring). ``install`` it on an engine; read :meth:`now`.

    Args:
        table: a step cost table (:func:`load_cost_table`): ``batch_sizes`` [nb], ``costs_ms`` [nb][bs - 1],
            ``ar_costs_ms`` [nb], optional ``lookup_costs_ms`` [nb][W] (without it a step without a propose costs the
            AR step at W = 1, else the spec step of its γ: a propose is then free).
        host_scale: factor on the real elapsed host time between device calls (0: host work is free).
        prefill_ms: (fixed, per prompt) ms of a prefill.
        catch_up_ms: ms of a drafter-context catch-up.
    Raises:
        ValueError: a table without batch sizes or with rows of unequal count, or a negative ``host_scale``.
    """

    def __init__(self, table: dict, *, host_scale: float = 1.0, prefill_ms: tuple[float, float] = PREFILL_MS,
                 catch_up_ms: float = CATCH_UP_MS):
        self.batch_sizes = [int(b) for b in table.get("batch_sizes", [])]
        self.costs = [list(map(float, r)) for r in table.get("costs_ms", [])]
        self.ar = [float(a) for a in table.get("ar_costs_ms", [])]
        look = table.get("lookup_costs_ms")
        self.lookup = [list(map(float, r)) for r in look] if look else None
        nb = len(self.batch_sizes)
        if not nb or len(self.costs) != nb or len(self.ar) != nb or (self.lookup is not None and len(self.lookup) != nb):
            raise ValueError(f"a cost table needs batch_sizes and as many rows of costs_ms, ar_costs_ms (and "
                             f"lookup_costs_ms): got {nb}, {len(self.costs)}, {len(self.ar)}")
        if host_scale < 0:
            raise ValueError(f"host_scale must be >= 0, got {host_scale}")
        self.table = table
        self.host_scale, self.prefill_ms, self.catch_up_ms = float(host_scale), tuple(prefill_ms), float(catch_up_ms)
        self.device_s = 0.0  # simulated device seconds so far
        self._real0 = time.perf_counter()
        self._real_device = 0.0  # real seconds spent inside the device calls (replaced by their simulated price)
        self.num_calls = {"step": 0, "prefill": 0, "catch_up": 0}

    def now(self) -> float:
        """Simulated seconds: the device calls' prices plus the host time between them (x ``host_scale``)."""
        host = time.perf_counter() - self._real0 - self._real_device
        return self.device_s + self.host_scale * host

    def _row(self, batch_size: int) -> int:
        return min(bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1)

    def step_ms(self, batch_size: int, width: int, proposes: bool) -> float:
        """The price of one step at ``batch_size`` rows and verify ``width`` (>= 1): with ``proposes`` the spec table
        (width 1 priced as width 2: a propose step is never cheaper), else the lookup table (width 1: the AR step)."""
        r = self._row(batch_size)
        if proposes:
            row = self.costs[r]
            return row[min(max(width - 1, 1), len(row)) - 1]
        if width <= 1:
            return self.ar[r]
        if self.lookup is not None:
            row = self.lookup[r]
            return row[min(width, len(row)) - 1]
        row = self.costs[r]
        return row[min(width - 1, len(row)) - 1]

    def _charge(self, real_s: float, ms: float) -> None:
        self._real_device += real_s
        self.device_s += ms / 1e3

    def install(self, engine) -> "SimClock":
        """Price ``engine``'s runner calls by this clock and make it the engine's (and runner's) clock; with the
        ``cost`` policy the engine's cost table becomes this table (:meth:`SpecEngine.set_cost_table`). Returns
        self."""
        runner = engine.runner
        step, prefill, catch_up = runner.step, runner.prefill, runner.catch_up_context
        has_drafter = runner.drafter is not None
        depth = [0]  # nested calls (a step's own catch-up, a prefill split per prompt) are priced by the outer one

        def priced(kind, fn, price):
            def call(*args, **kwargs):
                if depth[0]:
                    return fn(*args, **kwargs)
                depth[0] += 1
                t0 = time.perf_counter()
                try:
                    res = fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                self._charge(time.perf_counter() - t0, price(*args, **kwargs))
                self.num_calls[kind] += 1
                return res
            return call

        def step_price(slots, anchors, anchor_pos, draft_lens, spec, propose=True, *args, **kwargs):
            width = 1 + max(draft_lens, default=0) if spec else 1
            proposes = has_drafter and spec and (propose or kwargs.get("propose_first", False))
            ms = self.step_ms(max(slots) + 1, width, proposes)
            return ms + (self.catch_up_ms if runner.step_catch_up[0] else 0.0)  # its catch-up ran inside it

        sim_step = priced("step", step, step_price)
        sim_prefill = priced("prefill", prefill,
                             lambda slots, *a, **k: self.prefill_ms[0] + self.prefill_ms[1] * len(slots))
        sim_catch_up = priced("catch_up", catch_up, lambda spans, *a, **k: self.catch_up_ms if spans else 0.0)
        runner.step, runner.prefill, runner.catch_up_context = sim_step, sim_prefill, sim_catch_up
        engine.clock = runner.clock = self.now
        if _has_cost_policy(engine):  # (an engine with a cost table has the cost policy)
            engine.set_cost_table({k: v for k, v in self.table.items() if k != "source"})
        return self

    def describe(self) -> dict:
        """JSON-ready settings: the table's source, ``host_scale``, ``prefill_ms``, ``catch_up_ms``."""
        return {"source": self.table.get("source"), "host_scale": self.host_scale, "prefill_ms": list(self.prefill_ms),
                "catch_up_ms": self.catch_up_ms, "batch_sizes": self.batch_sizes}


def _has_cost_policy(engine) -> bool:
    from adaflash_ray.engine.length_policy import CostLength

    return isinstance(engine.policy, CostLength)
