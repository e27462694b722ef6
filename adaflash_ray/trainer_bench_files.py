"""Trainer benchmark on real trajectory files: the Ray-free trainer loop's step, phase by phase, beside the
synthetic trajectories of :mod:`adaflash_ray.trainer_bench` (``python -m adaflash_ray.bench --trainer``)::

    python -m adaflash_ray.bench --trainer --trajectories traj/ --recipe recipes/smollm2_135m_gpu.yaml \\
        [--set distill.batch_size=64] [--shape smollm2-135m] [--prompt-len 256 --new-tokens 256] --out files.json

What :func:`adaflash_ray.distill.loop.train_from_files` does, minus the replay pool and the publications:
``torch.set_num_threads(engine.num_threads)``, the recipe's target (or ``--shape`` random weights, whose
vocabulary must hold the files' token ids), :class:`~adaflash_ray.distill.trainer.DistillTrainerCore` with the
recipe's ``distill`` section unchanged (features, loss_impl, compute_dtype, position_weighting, reject_boost,
num_anchors, drafter_attention; the drafter's init flags from ``drafter``), batches of ``distill.batch_size``
(or each ``--batch-sizes``) trajectories leased from :class:`~adaflash_ray.distill.loop.DirectorySource` (file-name
order, its 4 reader threads reading 256 files ahead) and resolved just before each step, as the loop's fresh
batches are; the files come round again when the directory is used up. Rows, one per (batch size, source):

- ``files``: the loop's path - a new batch every step, read ahead by the reader threads while steps run;
- ``files_preread``: the same batches, read before timing (no reader threads during the steps);
- ``synthetic_mean``: one batch of uniform trajectories at the files' mean prompt / response lengths, repeated
  (the trainer bench's path);
- ``synthetic_bench``: the same at ``--prompt-len`` / ``--new-tokens`` (the trainer bench's shape).

``files`` vs ``files_preread``: the reader threads; ``files_preread`` vs ``synthetic_mean``: length variation
(padding, partial and missing blocks, a new shape every step); ``synthetic_mean`` vs ``synthetic_bench``: the
mean lengths themselves.

Each row: ``warmup`` untimed steps, ``steps`` timed ones (whole steps, as the loop times them), then
``split_steps`` with every phase bracketed by device synchronisations (plain timing on CPU). Output: one JSON
object on the last stdout line (and in ``--out``): the trainer bench's header, ``mode: trainer_files``,
``trajectories, num_files, directory_lengths`` (prompt / new / total tokens of every file, from the Parquet
footers: ``mean, p50, p90, max, min``), the resolved ``loss_impl, compute_dtype, drafter_attention, features,
recompute_layout, recompute_fused, recompute_compiled, compile_drafter, position_weighting, reject_boost,
num_anchors, block_size, num_threads``, ``peak_tflops``, ``rows`` and ``gaps``
(``positions_per_s`` ratios of the neighbouring rows above, per batch size). A row: ``batch_size, source, steps,
step_s`` (median), ``read_s`` (mean seconds per step waiting for files, outside the step), ``positions_per_s``
(block positions = valid blocks x (block_size-1), the trainer bench's unit), ``supervised_positions_per_s``
(``train/num_positions`` - weight > 0 -, the unit of the loop's ``version_table`` and of ablation.json),
``wall_positions_per_s`` (block positions per second of step + read), ``decode_s`` (``files_preread`` only: seconds per batch of reading
and decoding its files on the calling thread, before timing), per-step means ``block_positions,
supervised_positions, num_blocks, anchor_slots`` (N, blocks per row after padding), ``anchors_per_trajectory,
anchor_fill`` (valid / padded blocks), ``drafter_queries`` (B·N·block_size rows the drafter computes),
``mask_elements`` (B·N·bs·(T-1+N·bs), the SDPA visibility mask), ``recompute`` (``forwards, real_tokens,
padded_tokens``: the target's forwards per step and their tokens), ``collate_tokens`` (``real, padded``:
feature rows), ``lengths`` (as ``directory_lengths``, over the timed and split steps' trajectories), ``split_s``
(:data:`FILE_SPLIT_PHASES`, medians in seconds: ``read`` outside the step; ``prep_other`` = prep minus recompute,
collate and copy; ``loss`` without the head-stats pass (:func:`~adaflash_ray.distill.losses.token_stats_rows`,
run inside the loss where it runs at all); ``forward_other`` = forward minus drafter, loss and the head-stats
pass; ``other`` = the step minus every phase inside it), ``flops``
(:func:`adaflash_ray.trainer_bench.step_flops` from the steps' real lengths and anchor counts, means), ``floor_ratio`` (step seconds / floor seconds at ``peak_tflops``, summed over the
timed steps), ``peak_mem_gib`` (CUDA), ``last_loss``, with ``--profile`` ``profile_top`` on the ``files_preread`` row; a row that ran out of CUDA memory has ``error`` instead.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from pathlib import Path

import torch

from adaflash_ray.trainer_bench import (PEAK_TFLOPS, _anchors_of, _head_stats, _header, _instrumented, _PhaseTimer,
                                        _write, bench_target, check_sizes, oom_row, profile_step, release, step_flops,
                                        synthetic_trajectories)

FILE_SPLIT_PHASES = ("read", "target_recompute", "collate", "batch_to", "prep_other", "head_stats", "drafter_forward",
                     "loss", "forward_other", "backward", "optimizer", "other")
SOURCES = ("files", "files_preread", "synthetic_mean", "synthetic_bench")


def length_stats(values: list[int]) -> dict:
    """``{"mean", "p50", "p90", "max", "min"}`` of ``values`` (nearest-rank percentiles); Nones if empty."""
    if not values:
        return {k: None for k in ("mean", "p50", "p90", "max", "min")}
    s = sorted(values)

    def rank(q: float) -> int:
        return s[max(0, math.ceil(q * len(s)) - 1)]

    return {"mean": statistics.mean(s), "p50": rank(0.5), "p90": rank(0.9), "max": s[-1], "min": s[0]}


def _lengths(pairs: list[tuple[int, int]]) -> dict:
    """``(prompt_len, num_tokens)`` pairs -> ``{"prompt_tokens", "new_tokens", "num_tokens"}`` stats."""
    return {"prompt_tokens": length_stats([p for p, _ in pairs]),
            "new_tokens": length_stats([t - p for p, t in pairs]),
            "num_tokens": length_stats([t for _, t in pairs])}


class FileBatches:
    """Batches of ``batch_size`` trajectories from a directory as the loop leases them: ``get_batch`` +
    ``resolve`` of a :class:`~adaflash_ray.distill.loop.DirectorySource` (``read_ahead``: its read-ahead, 0 = read
    in ``resolve``); a new source over the same directory when one is used up (the files in the same order)."""

    def __init__(self, directory: str | Path, batch_size: int, read_ahead: int = 256):
        self.directory, self.batch_size, self.read_ahead = directory, batch_size, read_ahead
        self.source = self._new_source()

    def _new_source(self):
        from adaflash_ray.distill.loop import DirectorySource

        return DirectorySource(self.directory, read_ahead=self.read_ahead)

    def __call__(self) -> tuple[list, float]:
        """The next batch and the seconds spent getting it (waiting for the readers, or reading)."""
        t0 = time.perf_counter()
        out: list = []
        while len(out) < self.batch_size:
            if self.source.exhausted():
                self.source.close()
                self.source = self._new_source()
            items = self.source.get_batch(self.batch_size - len(out))
            out += self.source.resolve([h for h, _ in items])
            self.source.commit()
        return out, time.perf_counter() - t0

    def close(self) -> None:
        self.source.close()


@contextlib.contextmanager
def _recorded_shapes(core, record: dict):
    """During the block: ``record["recompute"]`` gets ``[rows, cols]`` of every target forward of the feature
    recompute, ``record["collate"]`` ``[B, T-1, N]`` of every collated batch (host-side shapes: no sync)."""
    import adaflash_ray.distill.blocks as blocks_mod
    import adaflash_ray.distill.trainer as trainer_mod

    saved_cf, saved_collate, target = blocks_mod.causal_features, trainer_mod.collate, core.target
    saved_pcf = blocks_mod.packed_causal_features
    saved_fwd = target.forward

    def causal_features(tgt, input_ids, *a, **kw):
        record["recompute"].append(list(input_ids.shape))
        return saved_cf(tgt, input_ids, *a, **kw)

    def packed_causal_features(tgt, token_ids, *a, **kw):  # one row of every token (the padding sequence included)
        record["recompute"].append([1, int(token_ids.shape[0])])
        return saved_pcf(tgt, token_ids, *a, **kw)

    def forward(input_ids, *a, **kw):
        record["recompute"].append(list(input_ids.shape))
        return saved_fwd(input_ids, *a, **kw)

    def collate(*a, **kw):
        batch = saved_collate(*a, **kw)
        record["collate"].append([batch.features.shape[0], batch.features.shape[1], batch.anchors.shape[1]])
        return batch

    blocks_mod.causal_features, trainer_mod.collate, target.forward = causal_features, collate, forward
    blocks_mod.packed_causal_features = packed_causal_features
    try:
        yield
    finally:
        blocks_mod.causal_features, trainer_mod.collate = saved_cf, saved_collate
        blocks_mod.packed_causal_features = saved_pcf
        del target.forward  # back to the class's method


def _repeat(trajectories: list):
    """A ``next_batch`` of :func:`measure` handing out the same batch every step (nothing to read)."""
    return lambda: (trajectories, 0.0)


def _replay(batches: list[tuple[list, float]]):
    """A ``next_batch`` of :func:`measure` handing out ``batches`` (read before timing) in order, nothing waited."""
    it = iter(batches)
    return lambda: (next(it)[0], 0.0)


def _split(timer: _PhaseTimer, m: dict, read_s: float) -> dict[str, float]:
    """One instrumented step's :data:`FILE_SPLIT_PHASES` from the timer and the step's metrics."""
    t = {p: timer.times.get(p, 0.0) for p in FILE_SPLIT_PHASES}
    t["read"] = read_s
    t["prep_other"] = max(0.0, m["train/prep_s"] - t["target_recompute"] - t["collate"] - t["batch_to"])
    t["loss"] = max(0.0, t["loss"] - t["head_stats"])  # the head-stats pass, where it runs, runs inside the loss
    t["forward_other"] = max(0.0, m["train/forward_s"] - t["drafter_forward"] - t["loss"] - t["head_stats"])
    inside = [p for p in FILE_SPLIT_PHASES if p not in ("read", "other")]
    t["other"] = max(0.0, m["train/seconds"] - sum(t[p] for p in inside))
    return t


def measure(core, next_batch, *, warmup: int, steps: int, split_steps: int) -> dict:
    """Time ``core.train_step`` on the batches ``next_batch()`` returns (``(trajectories, read_s)``): ``warmup``
    untimed, ``steps`` timed, ``split_steps`` instrumented. Returns one row of the module docstring (without
    ``batch_size`` / ``source``)."""
    device = core.device
    cuda = device.type == "cuda"
    for _ in range(warmup):
        core.train_step(next_batch()[0])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    bs = core.drafter.block_size
    tcfg, dcfg = core.target.config, core.drafter.config
    per_step, pairs = [], []
    record: dict = {"recompute": [], "collate": []}
    for _ in range(steps):
        trajs, read_s = next_batch()
        n_rec, n_col = len(record["recompute"]), len(record["collate"])
        with _recorded_shapes(core, record):
            m = core.train_step(trajs)  # ends with a device sync on CUDA
        rec, (b, t1, n) = record["recompute"][n_rec:], record["collate"][n_col]
        seq_lens = [tr.num_tokens for tr in trajs]
        pairs += [(tr.prompt_len, tr.num_tokens) for tr in trajs]
        flops = step_flops(tcfg, dcfg, seq_lens, _anchors_of(core, trajs), int(m["train/num_positions"]),
                           _head_stats(core.distill_cfg, core.device))
        per_step.append({"step_s": m["train/seconds"], "read_s": read_s, "num_blocks": m["train/num_blocks"],
                         "block_positions": m["train/num_blocks"] * (bs - 1),
                         "supervised_positions": m["train/num_positions"], "anchor_slots": n,
                         "drafter_queries": b * n * bs, "mask_elements": b * n * bs * (t1 + n * bs),
                         "recompute_forwards": len(rec), "recompute_real": sum(t - 1 for t in seq_lens),
                         "recompute_padded": sum(r * c for r, c in rec), "collate_real": sum(t - 1 for t in seq_lens),
                         "collate_padded": b * t1, "flops": flops, "batch": len(trajs)})
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    splits: dict[str, list[float]] = {p: [] for p in FILE_SPLIT_PHASES}
    for _ in range(split_steps):
        trajs, read_s = next_batch()
        pairs += [(tr.prompt_len, tr.num_tokens) for tr in trajs]
        timer = _PhaseTimer(device)
        with _instrumented(core, timer):
            m = core.train_step(trajs)
        for p, v in _split(timer, m, read_s).items():
            splits[p].append(v)

    def mean(key: str) -> float:
        return statistics.mean(s[key] for s in per_step)

    step_total = sum(s["step_s"] for s in per_step)
    floor_total = sum(s["flops"]["total"] for s in per_step) / (PEAK_TFLOPS * 1e12)
    return {"steps": steps, "step_s": statistics.median(s["step_s"] for s in per_step), "read_s": mean("read_s"),
            "positions_per_s": sum(s["block_positions"] for s in per_step) / step_total,
            "supervised_positions_per_s": sum(s["supervised_positions"] for s in per_step) / step_total,
            "wall_positions_per_s": (sum(s["block_positions"] for s in per_step)
                                     / (step_total + sum(s["read_s"] for s in per_step))),
            **{k: mean(k) for k in ("block_positions", "supervised_positions", "num_blocks", "anchor_slots",
                                    "drafter_queries", "mask_elements")},
            "anchors_per_trajectory": sum(s["num_blocks"] for s in per_step) / sum(s["batch"] for s in per_step),
            "anchor_fill": sum(s["num_blocks"] for s in per_step) / sum(s["batch"] * s["anchor_slots"]
                                                                        for s in per_step),
            "recompute": {"forwards": mean("recompute_forwards"), "real_tokens": mean("recompute_real"),
                          "padded_tokens": mean("recompute_padded")},
            "collate_tokens": {"real": mean("collate_real"), "padded": mean("collate_padded")},
            "lengths": _lengths(pairs),
            "split_s": {p: (statistics.median(v) if v else None) for p, v in splits.items()},
            "flops": {k: statistics.mean(s["flops"][k] for s in per_step) for k in per_step[0]["flops"]},
            "floor_ratio": step_total / floor_total, "peak_mem_gib": peak, "last_loss": m["train/loss"]}


def run(cfg, trajectories: str | Path, *, shape: str | None, batch_sizes: list[int], prompt_len: int,
        new_tokens: int, warmup: int, steps: int, split_steps: int, log=print, out: str | None = None,
        profile: bool = False) -> dict:
    """The document of the module docstring for a loaded recipe ``cfg`` and a directory of trajectory files.

    With ``out``, the document so far is written there after every row. ``profile``: the ``files_preread`` row also
    gets ``profile_top`` (:func:`adaflash_ray.trainer_bench.profile_step` over its first batch).
    Raises:
        FileNotFoundError / ValueError: as :class:`~adaflash_ray.distill.loop.DirectorySource` (a missing or
            empty directory, a foreign file); bad sizes; an unknown shape; a trainer construction error.
    """
    from adaflash_ray.distill.spill import trajectory_files, trajectory_lengths
    from adaflash_ray.distill.trainer import DistillTrainerCore

    check_sizes(batch_sizes, warmup, steps, split_steps)
    files = trajectory_files(trajectories)  # checks the directory before the model loads
    pairs = [trajectory_lengths(f) for f in files]
    dir_lengths = _lengths(pairs)
    mean_prompt = max(1, round(dir_lengths["prompt_tokens"]["mean"]))
    mean_new = max(2, round(dir_lengths["new_tokens"]["mean"]))
    torch.set_num_threads(cfg.engine.num_threads)  # as train_from_files
    device = cfg.model.device
    target = bench_target(cfg, shape)
    dc = cfg.distill
    doc = {**_header(device), "mode": "trainer_files", "recipe": cfg.name, "shape": shape,
           "trajectories": str(trajectories), "num_files": len(files), "directory_lengths": dir_lengths,
           "loss_impl": None, "compute_dtype": None, "drafter_attention": dc.drafter_attention,
           "features": dc.features, "recompute_layout": dc.recompute_layout, "recompute_fused": dc.recompute_fused,
           "recompute_compiled": dc.recompute_compiled, "compile_drafter": dc.compile_drafter,
           "position_weighting": dc.position_weighting, "reject_boost": dc.reject_boost,
           "num_anchors": dc.num_anchors, "block_size": None, "loss_chunk_size": dc.loss_chunk_size,
           "num_threads": torch.get_num_threads(), "dtype": cfg.model.dtype, "peak_tflops": PEAK_TFLOPS,
           "synthetic_mean": [mean_prompt, mean_new], "synthetic_bench": [prompt_len, new_tokens],
           "rows": [], "gaps": {}}
    for b in batch_sizes:
        core = None
        rows = {}
        try:
            core = DistillTrainerCore(target, cfg.drafter, cfg.length_head, dc, seed=cfg.seed)
            doc["loss_impl"], doc["block_size"] = core.loss_impl, core.drafter.block_size
            doc["compute_dtype"] = str(core.compute_dtype or torch.float32).removeprefix("torch.")
            num = warmup + steps + split_steps
            with contextlib.closing(FileBatches(trajectories, b, read_ahead=0)) as reader:
                preread = [reader() for _ in range(num)]  # the batches the files row will lease, in its order
            vocab = target.config.vocab_size
            batches = {"files": None, "files_preread": preread,
                       "synthetic_mean": synthetic_trajectories(b, mean_prompt, mean_new, vocab, cfg.seed),
                       "synthetic_bench": synthetic_trajectories(b, prompt_len, new_tokens, vocab, cfg.seed)}
            for src in SOURCES:
                if src == "files":
                    reader = FileBatches(trajectories, b)
                    next_batch = reader
                elif src == "files_preread":
                    next_batch = _replay(batches[src])
                else:
                    next_batch = _repeat(batches[src])
                try:
                    row = {"batch_size": b, "source": src,
                           **measure(core, next_batch, warmup=warmup, steps=steps, split_steps=split_steps)}
                finally:
                    if src == "files":
                        reader.close()
                if src == "files_preread":  # what reading cost where it was not overlapped with steps
                    row["decode_s"] = statistics.mean(r for _, r in preread)
                    if profile:
                        row["profile_top"] = profile_step(core, preread[0][0], top=30)
                rows[src] = row
                doc["rows"].append(row)
                log(f"trainer bench (files): batch {b} {src}: {row['positions_per_s']:,.0f} block positions/s "
                    f"({row['supervised_positions_per_s']:,.0f} supervised), step {row['step_s'] * 1e3:.1f} ms, "
                    f"{row['floor_ratio']:.1f}x the FLOP floor, split "
                    + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row["split_s"].items() if v is not None) + " ms")
                if out:
                    _write(doc, out)
        except torch.cuda.OutOfMemoryError as e:
            doc["rows"].append(oom_row(b, e))
            log(f"trainer bench (files): batch {b}: {doc['rows'][-1]['error']}")
        pairs_of = [("reader_threads", "files", "files_preread"), ("length_variation", "files_preread",
                                                                   "synthetic_mean"),
                    ("mean_lengths", "synthetic_mean", "synthetic_bench")]
        doc["gaps"][str(b)] = {name: rows[a]["positions_per_s"] / rows[z]["positions_per_s"]
                               for name, a, z in pairs_of if a in rows and z in rows}
        del core
        release(doc, out)
    return doc
