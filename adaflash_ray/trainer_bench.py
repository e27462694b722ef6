"""Trainer benchmark: block positions per second of one distillation rank, the target recompute included.

Builds :class:`adaflash_ray.distill.trainer.DistillTrainerCore` Ray-free (one rank, as tests/test_distill.py does),
feeds it synthetic trajectories of the recipe's shape (token ids only - ``distill.features`` is forced to
``recompute``, so every step runs the frozen target over the batch first, as the GPU recipe's trainer does) and
times whole optimizer steps (:meth:`DistillTrainerCore.train_step`), then a few more steps with every phase
bracketed by device synchronisations for the split::

    python -m adaflash_ray.bench --trainer --recipe recipes/smollm2_135m_gpu.yaml --shape smollm2-135m \\
        --batch-sizes 16 32 --set distill.loss_impl=triton --out trainer.json
    python -m adaflash_ray.trainer_bench ...      # the same entry point
    python -m adaflash_ray.trainer_bench --loss --recipe recipes/smollm2_135m_gpu.yaml --out loss.json  # loss only
    python -m adaflash_ray.bench --trainer --trajectories traj/ --recipe ...  # the loop's step on real files

``--trajectories DIR``: the Ray-free trainer loop's step on trajectory files, phase by phase (file reads, collate,
copies, the D-PACE / reject-boost head pass ...), beside synthetic trajectories of the files' mean lengths and of
``--prompt-len`` / ``--new-tokens`` - :mod:`adaflash_ray.trainer_bench_files`, whose docstring gives the document.

Synthetic trajectories: ``--prompt-len`` prompt tokens then ``--new-tokens`` response tokens (default: the recipe's
``engine.max_new_tokens``), ids uniform over the vocabulary (step cost does not depend on the values). ``--shape``
uses random weights of a named shape (:data:`adaflash_ray.shapes.SHAPES`) in the recipe's ``model.dtype`` on its
``model.device`` instead of loading the recipe's model.

Output: one JSON object on the last stdout line (and in ``--out``): ``device, commit, torch_version, recipe,
shape, loss_impl`` (resolved), ``compute_dtype`` (the drafter's resolved training compute dtype), ``drafter_attention``, ``loss_chunk_size, num_anchors, block_size, prompt_len, new_tokens, dtype``, ``peak_tflops`` (the bf16 dense peak the floor uses: 989 TFLOP/s, the H200 SXM data
sheet figure; measured GEMMs reach ~790 there), ``rows`` - per batch size: ``batch_size, block_positions`` (valid
blocks x (block_size-1) per step, the unit of the 118k positions/s baseline), ``supervised_positions`` (those with
weight > 0), ``step_s`` (median of the timed steps), ``positions_per_s`` (block positions / mean step time),
``split_s`` (``target_recompute, prep, drafter_forward, loss, forward_other, backward, optimizer, other`` - medians
over the split steps, in seconds; ``loss`` is :func:`adaflash_ray.distill.losses.mixture_rkl_loss` whole, its
backward share is in ``backward`` for ``loss_impl: reference`` and in ``loss`` for the fused ones),
``peak_mem_gib`` (CUDA only), ``flops`` (``target, drafter, head, head_stats, total`` per step) and ``floor_ratio`` (step time
/ total FLOPs at ``peak_tflops``); with ``--profile`` also ``profile_top`` (top operators by device time of one
step); a batch size that ran out of CUDA memory has ``batch_size`` and ``error`` only.

FLOP model (multiply-adds x 2): target forward = matmul weights x tokens + causal attention ``2·nh·hd·t²`` per
layer and sequence; drafter = 3 x its forward (forward + backward), forward = projections of the block positions
and of the context K/V, the ``fc`` context projection, and attention over each block's visible keys
(context before its anchor + its own block); head = 3 GEMMs ``2·M·H·V`` (student and teacher logits, input
gradient; the frozen head has no weight gradient) plus, with ``distill.position_weighting: dpace`` or
``reject_boost > 0`` on the reference loss (or ``rkl_clip_mode: reference``), ``head_stats`` - the one no-grad GEMM
``2·M·H·V`` of their pass over the shared head (the fused loss takes those statistics from its own pass).

``--loss``: :func:`bench_loss` - the head loss alone (forward + backward) at the shape's head (``--shape``,
default smollm2-135m) for ``--rows`` positions, per implementation and Triton kernel configuration, against its
3-GEMM floor.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from adaflash_ray.config import RecipeError, add_recipe_args, config_from_args

PEAK_TFLOPS = 989.0  # H200 SXM bf16 dense, NVIDIA data sheet (no sparsity)
SPLIT_PHASES = ("target_recompute", "prep", "drafter_forward", "loss", "forward_other", "backward", "optimizer",
                "other")


def synthetic_trajectories(num: int, prompt_len: int, new_tokens: int, vocab_size: int, seed: int) -> list:
    """``num`` :class:`~adaflash_ray.trajectory.Trajectory` of ``prompt_len + new_tokens`` uniform random token ids,
    no features (``features: recompute``), drafter version 0. Raises ValueError if ``prompt_len < 1`` or
    ``new_tokens < 2``."""
    from adaflash_ray.trajectory import Trajectory

    if prompt_len < 1 or new_tokens < 2:
        raise ValueError(f"need prompt_len >= 1 and new_tokens >= 2, got {prompt_len}, {new_tokens}")
    g = torch.Generator().manual_seed(seed)
    return [Trajectory(request_id=f"bench{i}", token_ids=torch.randint(0, vocab_size, (prompt_len + new_tokens,),
                                                                        generator=g),
                       prompt_len=prompt_len, features=None, last_hidden=None, drafter_version=0)
            for i in range(num)]


def step_flops(tcfg, dcfg, seq_lens: list[int], anchors_per_seq: list[list[int]], positions: int,
               head_stats: bool = False) -> dict:
    """FLOPs of one training step (the module docstring's model).

    Args:
        tcfg: the target's :class:`~adaflash_ray.models.target.TargetConfig`; dcfg: the drafter's
            :class:`~adaflash_ray.models.drafter.DrafterModelConfig`.
        seq_lens: tokens per trajectory (the target and the context see ``T - 1`` positions each).
        anchors_per_seq: the valid anchors of each trajectory's blocks.
        positions: supervised positions (rows of the head loss).
        head_stats: the step runs the no-grad pass over the shared head of D-PACE / reject_boost (one more GEMM
            ``2·M·H·V``).
    Returns:
        ``{"target", "drafter", "head", "head_stats", "total"}`` in FLOPs (floats; ``head_stats`` 0 without it).
    """
    h, i, nh, nkv, hd = (tcfg.hidden_size, tcfg.intermediate_size, tcfg.num_attention_heads,
                         tcfg.num_key_value_heads, tcfg.head_dim)
    per_tok = 2 * tcfg.num_hidden_layers * (h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * i)
    ctx = [t - 1 for t in seq_lens]
    target = sum(per_tok * t + tcfg.num_hidden_layers * 2 * nh * hd * t * t for t in ctx)
    dh, di, dnh, dnkv, dhd, bs = (dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_attention_heads,
                                  dcfg.num_key_value_heads, dcfg.head_dim, dcfg.block_size)
    q = sum(len(a) for a in anchors_per_seq) * bs  # block query positions
    n_ctx = sum(ctx)
    k = len(dcfg.target_layer_ids)
    fwd = 2 * n_ctx * k * dcfg.target_hidden_size * dh  # fc
    per_layer_q = 2 * (dh * dnh * dhd + dnh * dhd * dh + 3 * dh * di + 2 * dh * dnkv * dhd)
    per_layer_ctx = 2 * 2 * dh * dnkv * dhd  # context K and V
    attn = sum(2 * 2 * dnh * dhd * bs * (a + bs) for anchors in anchors_per_seq for a in anchors)
    fwd += dcfg.num_hidden_layers * (per_layer_q * q + per_layer_ctx * n_ctx + attn)
    drafter = 3 * fwd
    head = 3 * 2 * positions * tcfg.hidden_size * tcfg.vocab_size
    stats = 2 * positions * tcfg.hidden_size * tcfg.vocab_size if head_stats else 0
    return {"target": float(target), "drafter": float(drafter), "head": float(head), "head_stats": float(stats),
            "total": float(target + drafter + head + stats)}


def _header(device: str) -> dict:
    """``device, commit, torch_version`` as :mod:`adaflash_ray.bench` writes them; if that module (which imports the
    engine) fails to import, the same keys from ``$ADAFLASH_COMMIT`` / torch plus ``header_note`` with the error -
    the trainer bench itself needs no engine."""
    try:
        from adaflash_ray.bench import _header as bench_header
    except Exception as e:  # noqa: BLE001 - any import-time failure of the engine side
        name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
        return {"device": name, "commit": os.environ.get("ADAFLASH_COMMIT"), "torch_version": torch.__version__,
                "header_note": f"adaflash_ray.bench did not import: {e!r}"}
    return bench_header(device)


class _PhaseTimer:
    """Accumulates wall time of wrapped callables, synchronising the device before and after each call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            return out

        return timed


@contextlib.contextmanager
def _instrumented(core, timer: _PhaseTimer):
    """Time the phases of ``core.train_step`` by wrapping what it calls (restored on exit): ``target_recompute``,
    ``collate``, ``batch_to`` (:meth:`Batch.to`), ``head_stats`` (the D-PACE / reject-boost no-grad pass over the
    shared head, :func:`~adaflash_ray.distill.losses.token_stats_rows`, which runs inside ``loss`` where it runs at
    all: the reference loss or ``rkl_clip_mode: reference``; the fused loss takes those statistics from its own pass),
    ``loss``, ``drafter_forward``, ``backward``, ``optimizer``."""
    import adaflash_ray.distill.losses as losses_mod
    import adaflash_ray.distill.trainer as trainer_mod
    from adaflash_ray.distill.blocks import Batch

    phase_of = {"with_recomputed_features": "target_recompute", "collate": "collate", "mixture_rkl_loss": "loss"}
    saved_mod = {n: getattr(trainer_mod, n) for n in phase_of}
    for n, fn in saved_mod.items():
        setattr(trainer_mod, n, timer.wrap(phase_of[n], fn))
    saved_stats = losses_mod.token_stats_rows
    losses_mod.token_stats_rows = timer.wrap("head_stats", saved_stats)
    saved_to = Batch.to
    Batch.to = timer.wrap("batch_to", saved_to)
    inst = [(core.drafter, "forward_train", "drafter_forward"), (core.engine, "backward", "backward"),
            (core.engine, "step", "optimizer")]
    for obj, attr, name in inst:
        setattr(obj, attr, timer.wrap(name, getattr(obj, attr)))
    try:
        yield
    finally:
        for n, fn in saved_mod.items():
            setattr(trainer_mod, n, fn)
        losses_mod.token_stats_rows = saved_stats
        Batch.to = saved_to
        for obj, attr, _ in inst:
            delattr(obj, attr)  # back to the class's method


def bench_batch(core, trajectories: list, *, warmup: int, steps: int, split_steps: int) -> dict:
    """Time ``core.train_step`` on ``trajectories``: ``warmup`` untimed steps, ``steps`` timed, ``split_steps``
    instrumented. Returns one ``rows`` entry of the module docstring (without ``flops`` / ``floor_ratio``)."""
    device = core.device
    cuda = device.type == "cuda"
    for _ in range(warmup):
        core.train_step(trajectories)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, blocks, positions = [], [], []
    bs1 = core.drafter.block_size - 1
    for _ in range(steps):
        t0 = time.perf_counter()
        m = core.train_step(trajectories)  # ends with a device sync on CUDA
        times.append(time.perf_counter() - t0)
        blocks.append(m["train/num_blocks"] * bs1)
        positions.append(m["train/num_positions"])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    splits: dict[str, list[float]] = {p: [] for p in SPLIT_PHASES}
    for _ in range(split_steps):
        timer = _PhaseTimer(device)
        with _instrumented(core, timer):
            m = core.train_step(trajectories)
        t = dict(timer.times)
        t["prep"] = max(0.0, m["train/prep_s"] - t.get("target_recompute", 0.0))
        t["forward_other"] = max(0.0, m["train/forward_s"] - t.get("drafter_forward", 0.0) - t.get("loss", 0.0))
        t["other"] = max(0.0, m["train/seconds"] - sum(t.get(p, 0.0) for p in SPLIT_PHASES if p != "other"))
        for p in SPLIT_PHASES:
            splits[p].append(t.get(p, 0.0))
    return {"batch_size": len(trajectories), "block_positions": statistics.mean(blocks),
            "supervised_positions": statistics.mean(positions), "step_s": statistics.median(times),
            "positions_per_s": sum(blocks) / sum(times),
            "split_s": {p: (statistics.median(v) if v else None) for p, v in splits.items()},
            "peak_mem_gib": peak, "last_loss": m["train/loss"]}


def profile_step(core, trajectories: list, top: int = 20) -> list[dict]:
    """One ``core.train_step`` under ``torch.profiler``: the ``top`` operators by self device time (CUDA; CPU time
    on CPU), each ``{"name", "self_ms", "calls"}`` - which kernels the step's time goes to."""
    from torch.profiler import ProfilerActivity, profile

    cuda = core.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        core.train_step(trajectories)

    def self_us(e) -> float:
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = sorted(prof.key_averages(), key=self_us, reverse=True)[:top]
    return [{"name": e.key, "self_ms": self_us(e) / 1e3, "calls": e.count} for e in events]


def _head_stats(distill_cfg, device) -> bool:
    """Whether the step runs a separate no-grad pass over the shared head for D-PACE / reject-boost weights (as
    :func:`~adaflash_ray.distill.losses.mixture_rkl_loss`: not with the fused loss and the per-token clamp)."""
    from adaflash_ray.kernels.fused_distill import resolve_loss_impl

    wanted = distill_cfg.position_weighting == "dpace" or distill_cfg.reject_boost > 0
    impl = resolve_loss_impl(getattr(distill_cfg, "loss_impl", "reference"), device)
    return wanted and (impl == "reference" or distill_cfg.rkl_clip_mode != "per_token")


def _anchors_of(core, trajectories: list) -> list[list[int]]:
    """Valid anchors one collate of ``trajectories`` samples (a fresh generator: same counts as the steps)."""
    from adaflash_ray.distill.blocks import sample_anchors

    g = torch.Generator().manual_seed(0)
    return [sample_anchors(tr.prompt_len, tr.num_tokens, core.distill_cfg.num_anchors, core.drafter.block_size,
                           g).tolist() for tr in trajectories]


def run(cfg, *, shape: str | None, batch_sizes: list[int], prompt_len: int, new_tokens: int, warmup: int,
        steps: int, split_steps: int, log=print, out: str | None = None, profile: bool | list[int] = False) -> dict:
    """The benchmark document (module docstring) for a loaded recipe ``cfg``.

    A batch size that runs out of CUDA memory gets the row ``{"batch_size": b, "error": "out of memory: ..."}``
    and the next one still runs. With ``out``, the document so far is written there after every batch size (a
    run stopped by a timeout keeps its finished rows). ``profile`` adds ``profile_top`` (:func:`profile_step`) to
    each row (True), or to the rows of the batch sizes it lists.
    Raises:
        ValueError: bad sizes, an unknown shape, or a trainer construction error (e.g. ``loss_impl: triton``
            off CUDA).
    """
    from adaflash_ray.distill.trainer import DistillTrainerCore

    check_sizes(batch_sizes, warmup, steps, split_steps)
    device = cfg.model.device
    target = bench_target(cfg, shape)
    dcfg = cfg.distill.model_copy(update={"features": "recompute"})  # trajectories carry token ids only
    doc = {**_header(device), "mode": "trainer", "recipe": cfg.name, "shape": shape, "loss_impl": None,
           "loss_chunk_size": cfg.distill.loss_chunk_size, "num_anchors": cfg.distill.num_anchors,
           "block_size": None, "compute_dtype": None, "drafter_attention": None, "prompt_len": prompt_len, "new_tokens": new_tokens, "dtype": cfg.model.dtype,
           "peak_tflops": PEAK_TFLOPS, "rows": []}
    for b in batch_sizes:
        core = None
        try:
            core = DistillTrainerCore(target, cfg.drafter, cfg.length_head, dcfg, seed=cfg.seed)
            doc["loss_impl"], doc["block_size"] = core.loss_impl, core.drafter.block_size
            doc["compute_dtype"] = str(core.compute_dtype or torch.float32).removeprefix("torch.")
            doc["drafter_attention"] = getattr(dcfg, "drafter_attention", "sdpa")
            trajs = synthetic_trajectories(b, prompt_len, new_tokens, target.config.vocab_size, cfg.seed)
            row = bench_batch(core, trajs, warmup=warmup, steps=steps, split_steps=split_steps)
            row["flops"] = step_flops(target.config, core.drafter.config, [tr.num_tokens for tr in trajs],
                                      _anchors_of(core, trajs), int(row["supervised_positions"]),
                                      _head_stats(dcfg, core.device))
            row["floor_ratio"] = row["step_s"] / (row["flops"]["total"] / (PEAK_TFLOPS * 1e12))
            if profile is True or (not isinstance(profile, bool) and b in profile):
                row["profile_top"] = profile_step(core, trajs)
            log(f"trainer bench: batch {b} ({core.loss_impl}): {row['positions_per_s']:,.0f} block positions/s, "
                f"step {row['step_s'] * 1e3:.1f} ms, {row['floor_ratio']:.1f}x the FLOP floor, split "
                + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row["split_s"].items() if v is not None) + " ms")
        except torch.cuda.OutOfMemoryError as e:
            row = oom_row(b, e)
            log(f"trainer bench: batch {b}: {row['error']}")
        doc["rows"].append(row)
        del core
        release(doc, out)
    return doc


def check_sizes(batch_sizes: list[int], warmup: int, steps: int, split_steps: int) -> None:
    """Raises ValueError unless every batch size and ``steps`` are >= 1 and ``warmup`` / ``split_steps`` >= 0."""
    if min(batch_sizes) < 1 or steps < 1 or warmup < 0 or split_steps < 0:
        raise ValueError("batch sizes and --steps must be >= 1, --warmup and --split-steps >= 0")


def bench_target(cfg, shape: str | None):
    """The recipe's target (``load_target``), or random weights of ``shape`` in ``model.dtype`` on
    ``model.device``; sets the one-rank distributed environment when it is missing (DeepSpeed reads LOCAL_RANK
    even when torch.distributed is up). Raises ValueError for an unknown shape."""
    from adaflash_ray.distill.trainer import DistillTrainerCore
    from adaflash_ray.models.factory import load_target
    from adaflash_ray.shapes import build_random_target, shape_config

    if shape is not None:
        target = build_random_target(shape_config(shape), device=cfg.model.device,
                                     dtype=getattr(torch, cfg.model.dtype), seed=cfg.seed)
    else:
        target = load_target(cfg.model)
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")):
        DistillTrainerCore.setup_dist_env(0, 1)
    return target


def oom_row(batch_size: int, e: Exception) -> dict:
    """The row of a batch size that ran out of CUDA memory."""
    return {"batch_size": batch_size, "error": f"out of memory: {str(e).splitlines()[0]}"}


def release(doc: dict, out: str | None) -> None:
    """After a batch size (its core deleted by the caller): free what it held, write the document so far."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if out:
        _write(doc, out)


#: Triton kernel (BLOCK_V, NUM_WARPS) configurations the loss bench compares
KERNEL_CONFIGS = ((4096, 8), (2048, 8), (1024, 4), (4096, 16))


def bench_loss(*, rows: int, hidden: int, vocab: int, device: str, dtype: torch.dtype, impls: list[str],
               chunk_size: int, iters: int = 5, seed: int = 0) -> dict:
    """Forward + backward of :func:`adaflash_ray.distill.losses.mixture_rkl_loss` alone on random data (``--loss``).

    ``rows`` positions of width ``hidden``, a head ``[vocab, hidden]`` in ``dtype`` (std 0.2: logit std ~5),
    the trainer's position weights (``exp(-(k-1)/7)`` over blocks of 15), ``α = 0.8``, confidence output on (the
    ``cost`` head's). Each impl (``reference | torch | triton``; triton once per :data:`KERNEL_CONFIGS` entry) runs
    2 untimed then ``iters`` timed calls. ``chunk_size`` is ``distill.loss_chunk_size`` (the torch backend uses
    at most 8,192). Returns ``{"rows", "hidden", "vocab", "dtype", "flops"`` (3 GEMMs ``2·rows·hidden·vocab``),
    ``"floor_ms"`` (at :data:`PEAK_TFLOPS`), ``"results": [{"impl", "kernel", "ms", "floor_ratio", "peak_mem_gib",
    "loss"}]}``.
    """
    from adaflash_ray.distill.losses import mixture_rkl_loss

    g = torch.Generator(device=device).manual_seed(seed)
    w = (0.2 * torch.randn(vocab, hidden, device=device, generator=g)).to(dtype)
    ht = torch.randn(rows, hidden, device=device, generator=g)
    hs = ht + 0.5 * torch.randn(rows, hidden, device=device, generator=g)
    k = torch.arange(rows, device=device) % 15
    weights = torch.exp(-k.float() / 7.0)
    cuda = device.startswith("cuda")
    flops = 3 * 2 * rows * hidden * vocab
    results = []
    for impl in impls:
        for kernel in (KERNEL_CONFIGS if impl == "triton" else (None,)):
            restore = None
            if kernel is not None:
                import adaflash_ray.kernels.fused_distill_triton as ker

                restore = (ker.BLOCK_V, ker.NUM_WARPS)
                ker.BLOCK_V, ker.NUM_WARPS = kernel
            chunk = min(chunk_size, 8192) if impl == "torch" else chunk_size
            conf = torch.empty(rows, 2, device=device)
            times = []
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for i in range(2 + iters):
                x = hs.clone().requires_grad_(True)
                t0 = time.perf_counter()
                loss, _ = mixture_rkl_loss(x, ht, w, weights, alpha=0.8, chunk_size=chunk, confidence_out=conf,
                                           impl=impl)
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            if restore is not None:
                ker.BLOCK_V, ker.NUM_WARPS = restore
            ms = statistics.median(times) * 1e3
            results.append({"impl": impl, "kernel": list(kernel) if kernel else None, "ms": ms,
                            "floor_ratio": ms / (flops / (PEAK_TFLOPS * 1e12) * 1e3),
                            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                            "loss": float(loss.detach())})
    return {"rows": rows, "hidden": hidden, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
            "flops": float(flops), "floor_ms": flops / (PEAK_TFLOPS * 1e12) * 1e3, "peak_tflops": PEAK_TFLOPS,
            "results": results}


def _write(doc: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m adaflash_ray.bench --trainer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", action="store_true", help="(the bench mode flag; accepted and ignored here)")
    add_recipe_args(p)
    p.add_argument("--shape", default=None, help="random weights of this shape (adaflash_ray.shapes.SHAPES) "
                                                 "instead of the recipe's model")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="trajectories per step (default: the recipe's distill.batch_size)")
    p.add_argument("--prompt-len", type=int, default=200, help="prompt tokens per synthetic trajectory")
    p.add_argument("--new-tokens", type=int, default=None, help="response tokens (default engine.max_new_tokens)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3 on CUDA, 1 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10 on CUDA, 2 on CPU)")
    p.add_argument("--split-steps", type=int, default=None, help="instrumented steps (default 3 on CUDA, 1 on CPU)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON document here")
    p.add_argument("--trajectories", default=None, metavar="DIR",
                   help="the trainer loop's step on these trajectory files, phase by phase, beside synthetic "
                        "trajectories of their mean lengths and of --prompt-len/--new-tokens "
                        "(adaflash_ray/trainer_bench_files.py; default warm-up 5 steps on CUDA)")
    p.add_argument("--profile", type=int, nargs="*", default=None, metavar="B",
                   help="one more step under torch.profiler per batch size (only those listed, if any): the top "
                        "operators by device time (profile_top)")
    g = p.add_argument_group("loss mode (the head loss alone on random data: adaflash_ray.trainer_bench.bench_loss)")
    g.add_argument("--loss", action="store_true", help="time mixture_rkl_loss forward + backward only")
    g.add_argument("--rows", type=int, default=23040, help="positions (default 16 x 96 x 15)")
    g.add_argument("--impls", nargs="+", default=None, choices=["reference", "torch", "triton"],
                   help="default: reference torch, + triton on CUDA")
    g.add_argument("--iters", type=int, default=5, help="timed calls per impl")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m adaflash_ray.bench --trainer`` dispatches here). Returns the exit status: 0, or 2
    on a recipe / argument error (message on stderr)."""
    ns = _parser().parse_args(argv)
    try:
        cfg = config_from_args(ns)
        cuda = cfg.model.device.startswith("cuda")
        if ns.loss:
            from adaflash_ray.shapes import shape_config

            tcfg = shape_config(ns.shape or "smollm2-135m")
            impls = ns.impls or (["reference", "torch"] + (["triton"] if cuda else []))
            doc = {**_header(cfg.model.device), "mode": "loss", "shape": ns.shape or "smollm2-135m",
                   **bench_loss(rows=ns.rows, hidden=tcfg.hidden_size, vocab=tcfg.vocab_size,
                                device=cfg.model.device, dtype=getattr(torch, cfg.model.dtype), impls=impls,
                                chunk_size=cfg.distill.loss_chunk_size, iters=ns.iters)}
            for r in doc["results"]:
                print(f"loss bench: {r['impl']} {r['kernel'] or ''}: {r['ms']:.2f} ms "
                      f"({r['floor_ratio']:.1f}x the 3-GEMM floor)", file=sys.stderr)
            if ns.out:
                _write(doc, ns.out)
            print(json.dumps(doc))
            return 0
        if ns.trajectories is not None:
            from adaflash_ray.trainer_bench_files import run as run_files

            doc = run_files(cfg, ns.trajectories, shape=ns.shape, batch_sizes=ns.batch_sizes or [cfg.distill.batch_size],
                            prompt_len=ns.prompt_len, new_tokens=ns.new_tokens or cfg.engine.max_new_tokens,
                            warmup=ns.warmup if ns.warmup is not None else (5 if cuda else 1),
                            steps=ns.steps or (10 if cuda else 2),
                            split_steps=ns.split_steps if ns.split_steps is not None else (3 if cuda else 1),
                            log=lambda msg: print(msg, file=sys.stderr), out=ns.out, profile=ns.profile is not None)
            print(json.dumps(doc))
            return 0
        doc = run(cfg, shape=ns.shape, batch_sizes=ns.batch_sizes or [cfg.distill.batch_size],
                  prompt_len=ns.prompt_len, new_tokens=ns.new_tokens or cfg.engine.max_new_tokens,
                  warmup=ns.warmup if ns.warmup is not None else (3 if cuda else 1),
                  steps=ns.steps or (10 if cuda else 2),
                  split_steps=ns.split_steps if ns.split_steps is not None else (3 if cuda else 1),
                  log=lambda msg: print(msg, file=sys.stderr), out=ns.out,
                  profile=False if ns.profile is None else (ns.profile or True))
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
