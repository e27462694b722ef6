"""Random-weight models of real target shapes, for step timings only (no acceptance: random weights).

Used by ``python -m adaflash_ray.bench --shape qwen3-8b`` (see adaflash_ray/bench.py). A shape is a
:class:`TargetConfig` with the real dimensions; :func:`build_random_target` and :func:`build_random_drafter`
create it directly on the device in the requested dtype (no float32 copy on the host), weights normal(0, 0.02),
norm weights ones. :func:`measure_copy_bandwidth` gives the denominator of the memory floor
(weight bytes read per decode step / device copy bandwidth). :func:`bench_shape` times one engine.

    from adaflash_ray.shapes import bench_shape
    doc = bench_shape("qwen3-8b", device="cuda", batch_sizes=[1, 8, 32, 64])
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import time
from typing import Iterator

import torch

from adaflash_ray.config import default_target_layer_ids
from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.models.target import TargetConfig, TargetModel

__all__ = ["SHAPES", "UNSUPPORTED_SHAPES", "ShapeError", "bench_shape", "build_random_drafter",
           "build_random_target", "count_forward_kernels", "count_propose_kernels", "decode_weight_bytes",
           "measure_copy_bandwidth", "shape_config"]

#: Real target shapes the built-in engine can run (dense Llama / Qwen3 decoders). ``tiny`` is for tests.
SHAPES: dict[str, TargetConfig] = {
    "qwen3-8b": TargetConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, qk_norm=True,
                             eos_token_ids=[151645]),
    "smollm2-135m": TargetConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                 rms_norm_eps=1e-5, rope_theta=1e5, tie_word_embeddings=True, eos_token_ids=[2]),
    "tiny": TargetConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_theta=1e4, qk_norm=True, eos_token_ids=[0]),
}

#: Recipe shapes the built-in engine cannot run, with the reason (they run on the SGLang backend).
UNSUPPORTED_SHAPES: dict[str, str] = {
    "qwen3-coder-30b-a3b": "Qwen3-Coder-30B-A3B is a mixture-of-experts model (48 layers, 128 experts, 8 active); "
                           "the built-in engine implements dense Llama/Qwen2/Qwen3 decoders only "
                           "(recipes/qwen3_coder_30b_a3b.yaml serves it with the SGLang backend)",
    "qwen3.5-9b": "Qwen3.5-9B is a hybrid model (3 of every 4 layers Gated-DeltaNet linear attention); "
                  "the built-in engine has no linear-attention layers (recipes/qwen35_9b.yaml serves it with "
                  "the SGLang backend)",
}
UNSUPPORTED_SHAPES["qwen35-9b"] = UNSUPPORTED_SHAPES["qwen3.5-9b"]

_INIT_STD = 0.02


class ShapeError(ValueError):
    """An unknown shape, or a shape the built-in engine does not support (the message says why)."""


def shape_config(name: str) -> TargetConfig:
    """The :class:`TargetConfig` of a shape name (case-insensitive). Raises :class:`ShapeError`."""
    key = name.lower()
    if key in UNSUPPORTED_SHAPES:
        raise ShapeError(f"shape {name!r} is not supported by the built-in engine: {UNSUPPORTED_SHAPES[key]}")
    if key not in SHAPES:
        raise ShapeError(f"unknown shape {name!r}; supported: {', '.join(SHAPES)} "
                         f"(not supported: {', '.join(sorted(set(UNSUPPORTED_SHAPES) - {'qwen35-9b'}))})")
    return SHAPES[key]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def _init_random(module: torch.nn.Module, generator: torch.Generator) -> None:
    """In place: every ``*norm.weight`` = 1, every other parameter ~ normal(0, 0.02)."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, _INIT_STD, generator=generator)


def build_random_target(cfg: TargetConfig, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> TargetModel:
    """A :class:`TargetModel` of shape ``cfg`` allocated on ``device`` in ``dtype`` (the rotary table stays
    float32), weights normal(0, 0.02), norm weights ones; eval mode, no gradients."""
    with _default_dtype(dtype), torch.device(device):
        model = TargetModel(cfg)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    _init_random(model, torch.Generator(device=device).manual_seed(seed))
    model.requires_grad_(False)
    return model.eval()


def build_random_drafter(target: TargetModel, num_layers: int = 5, block_size: int = 16,
                         seed: int = 1) -> DFlashDrafter:
    """A random DFlash drafter at the target's width (docs/design/ALGORITHMS.md §1), conditioned on the default
    K = min(5, L-3) target layers, attached to the target's embeddings and lm_head, same device/dtype."""
    tcfg = target.config
    ids = default_target_layer_ids(tcfg.num_hidden_layers, max(1, min(5, tcfg.num_hidden_layers - 3)))
    cfg = DrafterModelConfig.for_target(tcfg, num_hidden_layers=num_layers, block_size=block_size,
                                        target_layer_ids=sorted(set(ids)))
    weight = target.lm_head.weight
    with _default_dtype(weight.dtype), torch.device(weight.device):
        drafter = DFlashDrafter(cfg)
    drafter.attach_target(target.model.embed_tokens, target.lm_head)
    _init_random(drafter, torch.Generator(device=weight.device).manual_seed(seed))
    drafter.requires_grad_(False)
    return drafter.eval()


def decode_weight_bytes(target: TargetModel) -> int:
    """Bytes of weights one decode step must read: every parameter once (tied counted once), minus the
    input embedding table when untied (a step gathers only B of its rows)."""
    seen, total = set(), 0
    for p in target.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if not target.config.tie_word_embeddings:
        emb = target.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: str | torch.device, num_bytes: int | None = None, num_iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a big device-to-device ``copy_``: (bytes read + bytes
    written) / median time. ``num_bytes`` per buffer defaults to 1 GiB on CUDA, 64 MiB on CPU."""
    device = torch.device(device)
    num_bytes = num_bytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(num_iters):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * num_bytes / statistics.median(times)


def _engine_step_ms(engine: SpecEngine, batch: int, context: int, num_new: int, mode: str, seed: int) -> float:
    """Mean ms per engine step of ``engine.generate`` on ``batch`` random prompts of ``context`` tokens,
    ``num_new`` tokens each (EOS ignored), after the same run untimed (captures every CUDA graph it needs);
    prefill excluded."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.target.config.vocab_size
    prompts = torch.randint(1, vocab, (batch, context), generator=g).tolist()
    params = SamplingParams(max_new_tokens=num_new, ignore_eos=True)
    engine.generate(prompts, params, mode=mode)
    engine.stats = type(engine.stats)()
    engine.generate(prompts, params, mode=mode)
    return 1000.0 * engine.stats.decode_seconds / max(engine.stats.num_engine_steps, 1)


def bench_shape(name: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                batch_sizes: list[int] = (1, 8, 32, 64), context: int = 512, num_new: int = 32,
                drafter_layers: int = 5, block_size: int = 16, num_iters: int = 20, seed: int = 0,
                use_cuda_graph: bool | None = None, log=print) -> dict:
    """Step timings of a random-weight model of shape ``name`` (random weights: timings only, no acceptance).

    Measures (all in ms): ``ar_step_ms[batch]`` = mean whole engine step of an AR-only engine (``generate`` on
    random prompts of ``context`` tokens, ``num_new`` new tokens, prefill excluded) and ``spec_step_ms`` the
    same for a fixed-γ (block_size-1) spec engine; on the spec engine, ``verify_cost[batch][width]`` = median
    of one target verify forward (``SpecEngine.time_verify``; widths 1, 2, 4, 8, 16, 17 up to block_size) over
    ``context`` tokens (``ar_forward_ms`` = width 1), ``propose_ms[batch]`` = median drafter propose +
    length policy (``SpecEngine.time_propose``) and ``propose_frac_of_ar`` = propose_ms / ar_step_ms;
    ``memory_floor_ms`` = :func:`decode_weight_bytes` / :func:`measure_copy_bandwidth`; ``attention_calibration``
    the spec engine's per-(batch, width) SDPA vs split-K timings (:meth:`TargetModel.calibrate_attention`; empty
    off CUDA or with ``ADAFLASH_FUSED_ATTENTION`` on / off) and ``split_k`` its one kernel for every step
    (``ModelRunner.split_k``). ``use_cuda_graph``
    goes to both engines (None = on for CUDA).

    Raises:
        ShapeError: unknown or unsupported shape.
    """
    cfg = shape_config(name)
    batch_sizes = sorted(set(batch_sizes))
    widths = [w for w in (1, 2, 4, 8, 16, 17) if w <= block_size]
    dev = torch.device(device)
    t0 = time.perf_counter()
    target = build_random_target(cfg, dev, dtype, seed)
    drafter = build_random_drafter(target, drafter_layers, block_size, seed + 1)
    weight_bytes = decode_weight_bytes(target)
    log(f"built random {name} on {dev} ({weight_bytes / 1e9:.3f} GB read per decode step) "
        f"+ {drafter_layers}-layer drafter in {time.perf_counter() - t0:.1f} s")
    bandwidth = measure_copy_bandwidth(dev)
    floor_ms = 1000.0 * weight_bytes / bandwidth
    max_seq_len = context + num_new + 2 * block_size
    bmax = max(batch_sizes)

    engine = SpecEngine(target, drafter, None, policy="fixed", max_batch_size=bmax, max_seq_len=max_seq_len,
                        seed=seed, use_cuda_graph=use_cuda_graph)
    spec_step = {b: _engine_step_ms(engine, b, context, num_new, "spec", seed) for b in batch_sizes}
    verify_cost = {b: {w: engine.time_verify(b, w, num_iters=num_iters, context_len=context) for w in widths}
                   for b in batch_sizes}
    propose_ms = {b: engine.time_propose(b, num_iters=num_iters, context_len=context) for b in batch_sizes}
    attention, split_k = engine.runner.attention_calibration, engine.runner.split_k
    del engine
    ar_engine = SpecEngine(target, None, None, policy="fixed", max_batch_size=bmax, max_seq_len=max_seq_len,
                           seed=seed, use_cuda_graph=use_cuda_graph)
    ar_step = {b: _engine_step_ms(ar_engine, b, context, num_new, "ar", seed) for b in batch_sizes}
    del ar_engine
    return {
        "shape": name, "note": "random weights: timings only, no acceptance",
        "dtype": str(dtype).removeprefix("torch."), "context": context, "num_new_tokens": num_new,
        "block_size": block_size, "drafter_layers": drafter_layers, "num_iters": num_iters,
        "use_cuda_graph": use_cuda_graph,
        "decode_weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9, "memory_floor_ms": floor_ms,
        "ar_step_ms": {str(b): v for b, v in ar_step.items()},
        "spec_step_ms": {str(b): v for b, v in spec_step.items()},
        "ar_forward_ms": {str(b): verify_cost[b][1] for b in batch_sizes},
        "verify_cost": {str(b): {str(w): ms for w, ms in row.items()} for b, row in verify_cost.items()},
        "propose_ms": {str(b): v for b, v in propose_ms.items()},
        "propose_frac_of_ar": {str(b): propose_ms[b] / ar_step[b] for b in batch_sizes},
        "attention_calibration": attention, "split_k": split_k,
    }


def _kernel_counts(step, dev: torch.device) -> dict[str, collections.Counter]:
    """Device kernels (by name) of ``step()`` run once eagerly and once as a CUDA-graph replay, counted with
    ``torch.profiler``: ``{"graph": ..., "eager": ...}``. ``step`` runs once on a side stream first (Triton compiles,
    cuBLAS initialises outside the capture). Memcpy / memset records count too (they are graph nodes)."""
    from torch.profiler import ProfilerActivity, profile

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize(dev)
    out = {}
    for key, fn in (("graph", graph.replay), ("eager", step)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(dev)
        out[key] = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    del graph
    return out


def _per_layer(counts: dict[tuple[str, int], collections.Counter], layer_counts: tuple[int, int]) -> dict:
    """Kernels per layer from the counts of two depths: the difference over the difference in layers (what the
    rest of the call launches cancels out), from the graph replay's records when the profiler reports kernels
    inside graphs, else from the eager run's (the same launches: the graph captured them)."""
    lo, hi = layer_counts
    src = "graph" if sum(counts["graph", lo].values()) else "eager"
    c_lo, c_hi = counts[src, lo], counts[src, hi]
    diff = {k: (c_hi[k] - c_lo[k]) / (hi - lo) for k in set(c_hi) | set(c_lo)}
    return {"source": src, "per_layer": (sum(c_hi.values()) - sum(c_lo.values())) / (hi - lo),
            "per_forward": {f"{k}_{n}": sum(c.values()) for (k, n), c in counts.items()},
            "names": {f"{k}_{n}": dict(c.most_common()) for (k, n), c in counts.items()},
            "per_layer_names": {k: v for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v}}


def count_forward_kernels(name: str, *, fused: bool, split_k: bool = False, batch: int = 1, width: int = 1,
                          context: int = 64,
                          device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                          layer_counts: tuple[int, int] = (1, 3)) -> dict:
    """Device kernels of one CUDA-graph replay of the target's cached forward (the engine's decode / verify step
    body: rows are slots, ``width`` positions per row after ``context`` cached ones), counted with
    ``torch.profiler`` on random models of shape ``name`` with ``layer_counts`` layers; kernels per layer =
    the difference between the two counts over the difference in layers (what the rest of the forward launches
    cancels out). ``fused`` chooses the Triton kernels (``TargetModel.use_fused_kernels``), ``split_k`` their
    split-K decode attention (``TargetModel.fused_attention``). Memcpy / memset
    records count as kernels too (they are graph nodes); each count's kernel names come with it. The same
    forward run eagerly is counted as well (``source`` says which count ``per_layer`` uses: the graph replay's
    unless the profiler saw no kernel in it).

    Returns ``{"shape", "fused", "split_k", "fused_active", "batch", "width", "source", "per_layer",
    "per_forward": {"graph_<layers>" | "eager_<layers>": n}, "names": {same keys: {kernel name: count}},
    "per_layer_names": {name: count per layer}}``.
    Raises ShapeError (unknown shape) and RuntimeError (not on CUDA).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError("count_forward_kernels needs a CUDA device (it profiles a CUDA-graph replay)")
    base = shape_config(name)
    counts: dict[tuple[str, int], collections.Counter] = {}
    active = False
    for n_layers in layer_counts:
        target = build_random_target(dataclasses.replace(base, num_hidden_layers=n_layers), dev, dtype)
        target.fuse_projections()
        active = target.use_fused_kernels("auto" if fused else "off")
        target.fused_attention = split_k
        cache = target.new_kv_cache(batch, context + width + 1)
        ids = torch.zeros(batch, width, dtype=torch.long, device=dev)
        pos = (context + torch.arange(width, device=dev)).expand(batch, width).contiguous()

        def step():
            return target(ids, pos, cache=cache, rows_are_slots=True, span=context + width, capture_layer_ids=[0],
                          logits_dtype=None)
        for key, c in _kernel_counts(step, dev).items():
            counts[key, n_layers] = c
        del target, cache
        torch.cuda.empty_cache()
    return {"shape": name, "fused": fused, "split_k": split_k, "fused_active": active, "batch": batch, "width": width,
            **_per_layer(counts, layer_counts)}


def count_propose_kernels(name: str, *, fused: bool, batch: int = 1, context: int = 64, block_size: int = 16,
                          device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                          layer_counts: tuple[int, int] = (1, 3)) -> dict:
    """Device kernels of the drafter's two engine calls, each as one CUDA-graph replay: ``propose``
    (``DFlashDrafter.propose_hidden`` for ``batch`` rows after ``context`` positions, rows are slots, then the
    draft logits and their argmax, as the engine's propose runs them) and ``append``
    (``DFlashDrafter.append_context`` of one verify step's ``block_size`` positions per row). Counted with
    ``torch.profiler`` for random drafters of ``layer_counts`` layers on a random one-layer target of shape
    ``name``, prepared as the engine prepares them on CUDA (``fuse_projections`` with ``auto`` when ``fused``,
    else ``off``). Kernels per layer as in :func:`count_forward_kernels`.

    Returns ``{"shape", "fused", "fused_active", "batch", "block_size", "propose": {...}, "append": {...}}``, each
    path with ``source``, ``per_layer``, ``per_forward``, ``names`` and ``per_layer_names`` as in
    :func:`count_forward_kernels`.
    Raises ShapeError (unknown shape) and RuntimeError (not on CUDA).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError("count_propose_kernels needs a CUDA device (it profiles a CUDA-graph replay)")
    target = build_random_target(dataclasses.replace(shape_config(name), num_hidden_layers=1), dev, dtype)
    counts: dict[str, dict[tuple[str, int], collections.Counter]] = {"propose": {}, "append": {}}
    active = False
    rows = torch.arange(batch, device=dev)
    anchors = torch.zeros(batch, dtype=torch.long, device=dev)
    anchor_pos = torch.full((batch,), context, device=dev)
    positions = (context + torch.arange(block_size, device=dev)).expand(batch, block_size).contiguous()
    span = context + block_size
    for n_layers in layer_counts:
        drafter = build_random_drafter(target, n_layers, block_size)
        active = drafter.fuse_projections("auto" if fused else "off").fused_kernels_active  # as the engine does
        ctx = drafter.new_context_cache(batch, context + 2 * block_size)
        feats = torch.randn(batch, block_size, drafter.fc.in_features, device=dev).to(dtype)

        def propose():
            hidden = drafter.propose_hidden(ctx, rows, anchors, anchor_pos, span=span, rows_are_slots=True)
            return drafter.logits(hidden[:, 1:]).argmax(-1)

        def append():
            drafter.append_context(ctx, rows[:, None].expand(batch, block_size), positions, feats)
        with torch.no_grad():
            for path, step in (("propose", propose), ("append", append)):
                for key, c in _kernel_counts(step, dev).items():
                    counts[path][key, n_layers] = c
        del drafter, ctx
        torch.cuda.empty_cache()
    return {"shape": name, "fused": fused, "fused_active": active, "batch": batch, "block_size": block_size,
            **{path: _per_layer(c, layer_counts) for path, c in counts.items()}}
