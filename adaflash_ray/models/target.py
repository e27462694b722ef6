"""The target model: the engine's own Llama / Qwen2 / Qwen3 decoder, loaded from a Hugging Face
safetensors directory, returning logits plus the hidden states the DFlash drafter conditions on.

One forward serves prefill, plain decoding and verification: it writes K/V for the given
absolute positions into a static per-slot cache (gpt-fast style), so rolling back rejected drafts
is just "don't advance the length" - stale entries are beyond every later query's causal limit and
get overwritten. transformers is the test oracle for the logits (tests/test_models.py).

Usage::

    target = TargetModel.from_pretrained(model_dir, dtype=torch.float32)
    out = target(input_ids, positions, capture_layer_ids=[1, 7, 14, 20, 27])
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from adaflash_ray.config import BUILTIN_MODEL_TYPES, default_target_layer_ids  # noqa: F401  (one rule each)
from adaflash_ray.models.layers import (AttentionProjections, DecoderLayerParams, RMSNorm, Rotary, fuse_layers,
                                       fused_layer_stack, gqa_mask, grouped_attention)

#: ``fused_kernels`` values of :class:`TargetModel` (recipe key ``engine.fused_kernels``).
FUSED_KERNEL_MODES = ("auto", "off")

SUPPORTED_MODEL_TYPES = BUILTIN_MODEL_TYPES


def set_fused_kernels(model: nn.Module, layers, mode: str, device: torch.device, head_dim: int) -> bool:
    """The one rule of ``use_fused_kernels`` (target and drafter), applied to ``model``: sets
    ``model.fused_kernels`` (the mode used) and ``model.fused_kernels_active`` and returns the latter. The environment
    variable ``ADAFLASH_FUSED_KERNELS`` (auto/off), when set, overrides ``mode``; the kernels are on when the mode
    is ``auto``, Triton can launch on ``device`` (CUDA; any device under ``TRITON_INTERPRET=1``), ``head_dim`` is
    even and every parameter of ``model`` has one dtype; turning them on fuses the projections of ``layers``
    (:func:`~adaflash_ray.models.layers.fuse_layers`).

    Raises:
        ValueError: ``mode`` (or the environment variable) not auto/off; turning the kernels on,
            ``ADAFLASH_FUSED_LINEAR`` not one of :data:`adaflash_ray.kernels.norm_linear.MODES` or
            ``ADAFLASH_ROTARY_ATTENTION`` not fused / separate.
    """
    from adaflash_ray.kernels.triton_support import env_mode, triton_usable  # imports triton: only here

    if mode not in FUSED_KERNEL_MODES:
        raise ValueError(f"fused_kernels {mode!r}: expected one of {FUSED_KERNEL_MODES}")
    mode = env_mode() or mode
    on = (mode == "auto" and triton_usable(device) and head_dim % 2 == 0
          and len({p.dtype for p in model.parameters()}) == 1)
    if on:  # ADAFLASH_FUSED_LINEAR / _ROTARY_ATTENTION are read at each fused forward: a bad value is refused here,
        # at load, not mid-run
        from adaflash_ray.kernels.norm_linear import mode as linear_mode
        from adaflash_ray.models.layers import rotary_attention_fused

        linear_mode()
        rotary_attention_fused()
    model.fused_kernels, model.fused_kernels_active = mode, False
    if on:
        fuse_layers(layers)
    model.fused_kernels_active = on
    return on


def graph_replay_ms(fn, num_iters: int, calls: int = 1) -> list[float]:
    """Per-call ms of ``fn`` (CUDA work, no host synchronisation inside) over ``num_iters`` replays of one CUDA graph
    holding ``calls`` calls of it, after two eager warm-up calls and one untimed replay (CUDA events; a private
    memory pool, freed with the graph: a graph dropped from a shared pool can leave that pool with no user, and a
    capture into a pool nobody holds fails inside the caching allocator)."""
    fn()
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(num_iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


@dataclass
class TargetConfig:
    """The subset of a Hugging Face ``config.json`` the engine needs.

    Raises ``ValueError`` (from :meth:`from_hf_dict`) for an unsupported ``model_type`` or a rope
    scaling type other than ``default``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v biases
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "TargetConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported target model_type {mt!r}; supported: {SUPPORTED_MODEL_TYPES}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default' is implemented)")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        n_heads = d["num_attention_heads"]
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads", n_heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", mt == "qwen2")),
            qk_norm=mt == "qwen3",
            eos_token_ids=eos_ids,
        )


@dataclass
class TargetOutput:
    """Result of one target forward.

    logits: ``[B, W, V]`` (float32 unless the caller asked for the model dtype). features: ``[B, W, K*H]`` (the K captured layers, concatenated
    in ``capture_layer_ids`` order) or None. last_hidden: ``[B, W, H]`` final-normed hidden state
    (``lm_head(last_hidden) == logits``).
    """

    logits: torch.Tensor
    features: torch.Tensor | None
    last_hidden: torch.Tensor


def split_k_pays(report: dict) -> bool:
    """Whether one engine should attend with the split-K kernel in every decode / verify step: ``report`` is
    :meth:`TargetModel.calibrate_attention`'s (``{"batch,width": {"sdpa_ms": [...], "split_k_ms": [...]}}``); True iff
    at every calibrated batch size the split-K times, summed over its widths and spans, are below SDPA's (an empty
    report: False). One kernel for all steps keeps a verify row the AR step's bits; the sum weighs the widths a step
    may take alike."""
    by_batch: dict[str, list[float]] = {}
    for key, row in report.items():
        acc = by_batch.setdefault(key.split(",")[0], [0.0, 0.0])
        acc[0] += sum(row["split_k_ms"])
        acc[1] += sum(row["sdpa_ms"])
    return bool(by_batch) and all(split < sdpa for split, sdpa in by_batch.values())


class KVCache:
    """Static per-slot KV cache: ``k, v`` of shape ``[L, num_slots, max_seq_len, Hkv, D]``.

    A request owns one slot; the entry at absolute position ``p`` lives at ``[:, slot, p]``.
    """

    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, max_seq_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len


class _Attention(AttentionProjections):
    def __init__(self, cfg: TargetConfig):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qkv_bias=cfg.attention_bias, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_io):
        """x ``[B, W, H]``; mask ``[B, 1, W*rep, S]``; ``kv_io(k, v) -> (keys, values)`` stores this
        forward's K/V (cache write) and returns what the queries attend to ``[B, S, Hkv, D]``."""
        b, w, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        k, v = kv_io(k, v)
        out = grouped_attention(q, k, v, mask)  # [B, W, Hq, D]
        return self.o_proj(out.reshape(b, w, -1))


class _Layer(DecoderLayerParams):
    def __init__(self, cfg: TargetConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, _Attention(cfg))


class _Decoder(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM with feature capture, parameter names matching Hugging Face
    (``model.layers.N.self_attn.q_proj.weight`` ...), so ``load_state_dict`` takes HF safetensors."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = _Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        #: ``auto`` = :meth:`fuse_projections` also turns the Triton kernels on where they can run; ``off`` = never
        self.fused_kernels = "auto"
        self.fused_kernels_active = False  # set by use_fused_kernels
        #: split-K decode attention (adaflash_ray/kernels/decode_attention.py) on rows-are-slots forwards of width
        #: <= 16 when the fused kernels are on: ``off`` / False = never, ``on`` / True = always, ``auto`` (the
        #: default) = the engine's choice (:class:`~adaflash_ray.engine.runner.ModelRunner` calibrates both kernels
        #: at its batch buckets and widths and takes split-K for every step iff it is faster at each batch bucket:
        #: :func:`split_k_pays`); a forward called without the engine's choice uses split-K where
        #: :meth:`calibrate_attention` measured it faster (nowhere before a calibration).
        #: ``ADAFLASH_FUSED_ATTENTION`` (auto / on / off, or 1 / 0) overrides it. The split-K sums are not SDPA's
        #: bit for bit: one engine uses one kernel for every step, so a verify row is the AR step's bits (greedy
        #: output AR's token for token); mixing the two across widths or batches would break that
        self.fused_attention: str | bool = "auto"
        #: (batch, width) -> split-K chosen, from :meth:`calibrate_attention`
        self.split_k_table: dict[tuple[int, int], bool] = {}
        #: the engines' ``auto`` choices: (batch buckets, longest span timed, rotary fused into the attention) ->
        #: (calibration report, split-K for every step)
        self.attention_choices: dict[tuple, tuple[dict, bool]] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "TargetModel":
        """Load ``config.json`` + ``*.safetensors`` from a Hugging Face model directory.

        Raises:
            FileNotFoundError: no config.json or no safetensors file in ``model_dir``.
            ValueError: unsupported architecture, or missing/unexpected/mis-shaped tensors
                (a truncated or foreign checkpoint).
        """
        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path} not found: not a Hugging Face model directory")
        cfg = TargetConfig.from_hf_dict(json.loads(cfg_path.read_text()))
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        with torch.device("meta"):
            model = cls(cfg)
        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for name in fh.keys():
                        state[name] = fh.get_tensor(name).to(dtype)
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise ValueError(f"cannot read target checkpoint {f}: {e}") from e
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {n: p.shape for n, p in model.named_parameters()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"target checkpoint {model_dir} does not match {cfg.model_type}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        for n, shape in expected.items():
            if state[n].shape != shape:
                raise ValueError(f"target checkpoint {model_dir}: {n} has shape {tuple(state[n].shape)}, "
                                 f"expected {tuple(shape)}")
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        model.to(device)
        model.requires_grad_(False)
        return model.eval()

    def fuse_projections(self) -> "TargetModel":
        """One GEMM for q/k/v and one for gate/up per layer (the engine's CUDA path): the weights are stored
        concatenated and the HF-named parameters become views, so nothing else changes. Idempotent."""
        fuse_layers(self.model.layers)
        self.use_fused_kernels(self.fused_kernels)
        return self

    def use_fused_kernels(self, mode: str = "auto") -> bool:
        """Choose the Triton kernels of adaflash_ray/kernels for cached forwards (decode, verify, prefill):
        add + RMSNorm fused, SwiGLU fused, qk-norm + rotary + KV-cache write fused. ``mode`` ``auto`` turns them
        on when Triton can launch on the model's device (CUDA; any device under ``TRITON_INTERPRET=1``) and every
        parameter has one dtype; ``off`` keeps the pure-torch path. The environment variable
        ``ADAFLASH_FUSED_KERNELS`` (auto/off), when set, overrides ``mode``. Fuses the projections when turning
        the kernels on. Returns whether they are on (:attr:`fused_kernels_active`). CPU models stay on the
        reference unless the interpreter is asked for explicitly.

        Raises:
            ValueError: ``mode`` (or the environment variable) not auto/off.
        """
        return set_fused_kernels(self, self.model.layers, mode, self.lm_head.weight.device, self.config.head_dim)

    def _fused_path(self, x: torch.Tensor) -> bool:
        """The fused kernels apply to this forward: turned on, projections still fused (``.to()`` can undo it),
        and x on a device Triton launches on."""
        if not self.fused_kernels_active:
            return False
        from adaflash_ray.kernels.triton_support import triton_usable

        first = self.model.layers[0] if len(self.model.layers) else None
        return (first is not None and first.self_attn._fused() and first.mlp._fused()
                and x.device == self.lm_head.weight.device and triton_usable(x.device))

    def default_layer_ids(self, num_target_layers: int) -> list[int]:
        """docs/design/ALGORITHMS.md §1 default: K evenly spaced ids from 1 to L-3 (DFlash/SpecForge)."""
        return default_target_layer_ids(self.config.num_hidden_layers, num_target_layers)

    def new_kv_cache(self, num_slots: int, max_seq_len: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        p = self.lm_head.weight
        return KVCache(c.num_hidden_layers, num_slots, max_seq_len, c.num_key_value_heads, c.head_dim,
                       dtype or p.dtype, p.device)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *, cache: KVCache | None = None,
                slot_ids: torch.Tensor | None = None, capture_layer_ids: list[int] | None = None,
                key_valid: torch.Tensor | None = None, compute_logits: bool = True, span: int | None = None,
                rows_are_slots: bool = False, logits_dtype: torch.dtype | None = torch.float32,
                split_k: bool | None = None) -> TargetOutput:
        """Run the decoder on ``input_ids`` ``[B, W]`` at absolute ``positions`` ``[B, W]`` (int64).

        Without a cache: causal attention inside the input; ``key_valid`` ``[B, W]`` (bool) can mask
        padding keys.

        With ``cache``: K/V of the inputs are written at their positions and each query at position p
        attends to its slot's entries ``0..p`` (causal by absolute position; stale entries beyond p are
        invisible, so a rejected draft never needs erasing - gpt-fast's static cache). Two layouts:

        - ``rows_are_slots=True`` (the engine's decode/verify step, CUDA-graph safe): batch row b *is*
          slot b; attention reads ``cache.k[layer][:B, :span]`` in place (no copy, no host sync).
          ``span`` (a host int, ``> max(positions)``) is required.
        - otherwise ``slot_ids`` ``[B]`` name the slots; keys are gathered per slot (a copy; used by
          prefill and tests). ``span`` defaults to ``max(positions) + 1`` (one host sync).

        ``logits_dtype``: float32 by default (tests, training); the engine passes None to keep the
        model dtype (argmax and sampling do not need a float32 copy of ``[B, W, V]``). ``split_k``: with the fused
        kernels, a rows-are-slots forward attends with the split-K kernel (True, where the kernel takes the width) or
        SDPA (False); None = :attr:`fused_attention`'s per-(batch, width) rule.
        Returns :class:`TargetOutput`.
        """
        b, w = input_ids.shape
        cfg = self.config
        x = self.model.embed_tokens(input_ids)  # [B, W, H]
        cos, sin = self.rotary.cos_sin(positions)  # [B, W, D]
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        if cache is not None:
            if span is None:
                if rows_are_slots:
                    raise ValueError("rows_are_slots needs an explicit span")
                span = int(positions.max().item()) + 1

            def visible_of():
                return torch.arange(span, device=x.device)[None, None, :] <= positions[:, :, None]  # [B, W, S]
            rows = torch.arange(b, device=x.device)[:, None] if rows_are_slots else slot_ids[:, None]

            def kv_io_for(i):
                kc, vc = cache.k[i], cache.v[i]  # [slots, S_max, Hkv, D]

                def kv_io(k, v):
                    kc[rows, positions] = k.to(kc.dtype)
                    vc[rows, positions] = v.to(vc.dtype)
                    if rows_are_slots:
                        return kc[:b, :span], vc[:b, :span]  # views: read in place
                    return kc[slot_ids, :span].to(k.dtype), vc[slot_ids, :span].to(v.dtype)
                return kv_io
        else:
            def visible_of():
                visible = positions[:, None, :] <= positions[:, :, None]  # [B, W, W]
                if key_valid is not None:
                    visible = visible & key_valid[:, None, :]
                    visible = visible | torch.eye(w, dtype=torch.bool, device=x.device)[None]
                return visible

            def kv_io_for(i):
                return lambda k, v: (k, v)
        fused = cache is not None and self._fused_path(x)
        split_k = fused and rows_are_slots and (self._split_k(b, w) if split_k is None else  # no mask needed
                                                split_k and self.split_k_supported(w))
        mask = None if split_k else gqa_mask(visible_of(), rep, x.dtype)  # once per forward, shared by every layer
        want = set(capture_layer_ids or [])
        captured: dict[int, torch.Tensor] = {}
        if fused:
            x, last = self._fused_layers(x, cos, sin, mask, cache, rows.view(-1), positions, span,
                                         None if rows_are_slots else slot_ids, want, captured, split_k)
        else:
            for i, layer in enumerate(self.model.layers):
                h = layer.input_layernorm(x)
                x = x + layer.self_attn(h, cos, sin, mask, kv_io_for(i))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                if i in want:
                    captured[i] = x
            last = self.model.norm(x)
        feats = torch.cat([captured[i] for i in capture_layer_ids], dim=-1) if capture_layer_ids else None
        logits = None
        if compute_logits:
            logits = self.lm_head(last)
            if logits_dtype is not None:
                logits = logits.to(logits_dtype)
        return TargetOutput(logits=logits, features=feats, last_hidden=last)

    def attention_mode(self) -> str:
        """``auto``, ``on`` or ``off``: :attr:`fused_attention`, or ``ADAFLASH_FUSED_ATTENTION`` when set.

        Raises:
            ValueError: either holds another value.
        """
        raw = os.environ.get("ADAFLASH_FUSED_ATTENTION")
        v = self.fused_attention if raw is None else raw.strip().lower()
        mode = {True: "on", False: "off", "1": "on", "on": "on", "true": "on", "0": "off", "off": "off",
                "false": "off", "": "off", "auto": "auto"}.get(v)
        if mode is None:
            raise ValueError(f"fused_attention {v!r} (or ADAFLASH_FUSED_ATTENTION): expected auto, on or off")
        return mode

    def split_k_supported(self, width: int) -> bool:
        """The split-K kernel takes this model and verify width: power-of-two head_dim >= 16, W <= 16, W*rep <= 128."""
        c = self.config
        rep = c.num_attention_heads // c.num_key_value_heads
        return (c.head_dim >= 16 and c.head_dim & (c.head_dim - 1) == 0 and width <= 16 and width * rep <= 128)

    def _split_k(self, batch: int, width: int) -> bool:
        """Whether a rows-are-slots forward of ``batch`` rows and ``width`` positions attends with the split-K kernel
        (see :attr:`fused_attention`); in ``auto`` the smallest calibrated (batch, width) at or above this one
        decides (none: SDPA)."""
        mode = self.attention_mode()
        if mode == "off" or not self.split_k_supported(width):
            return False
        if mode == "on":
            return True
        above = [k for k in self.split_k_table if k[0] >= batch and k[1] >= width]
        return bool(above) and self.split_k_table[min(above)]

    @torch.no_grad()
    def calibrate_attention(self, cache: KVCache, batch_sizes: list[int], widths: list[int], spans: list[int],
                            num_iters: int = 10, reps: int = 4) -> dict:
        """Time one layer's decode / verify attention both ways - SDPA over the cache with the additive mask (what
        :meth:`forward` computes per layer; the mask itself is built once per forward and is not timed) and the
        split-K kernel - for every (batch, width) of ``batch_sizes`` x ``widths`` at each span of ``spans`` (keys
        read), each as a CUDA graph of ``reps`` calls replayed ``num_iters`` times (median), on layer 0 of
        ``cache`` (its contents do not matter: timings only; nothing is written to it). With
        ``ADAFLASH_ROTARY_ATTENTION=fused`` (:func:`~adaflash_ray.models.layers.rotary_attention_fused`) each side
        times what a forward runs then: ``rotary_qkv_cache`` + SDPA against the one-launch
        ``rotary_decode_attention``, both writing the step's keys / values into layer 0 of ``cache`` at the timed
        positions (the engine calibrates its fresh cache at build). Fills :attr:`split_k_table`: split-K where it
        was faster at every span. Only with the fused kernels on a CUDA device (the engine calls it at build when
        the mode is ``auto``).

        Returns ``{"batch,width": {"sdpa_ms": [per span], "split_k_ms": [per span], "split_k": bool}}``.
        Raises:
            RuntimeError: not on CUDA, or the fused kernels are off.
        """
        from adaflash_ray.kernels.decode_attention import decode_attention, rotary_decode_attention
        from adaflash_ray.kernels.reference import folded_attention
        from adaflash_ray.kernels.rotary_cache import rotary_qkv_cache
        from adaflash_ray.models.layers import rotary_attention_fused

        dev = self.lm_head.weight.device
        rotary = rotary_attention_fused()
        attn0 = self.model.layers[0].self_attn
        qn = None if attn0.q_norm is None else attn0.q_norm.weight
        kn = None if attn0.k_norm is None else attn0.k_norm.weight
        eps = 0.0 if attn0.q_norm is None else attn0.q_norm.eps
        if dev.type != "cuda" or not self.fused_kernels_active:
            raise RuntimeError("calibrate_attention needs the fused kernels on a CUDA device")
        c = self.config
        rep = c.num_attention_heads // c.num_key_value_heads
        kc, vc = cache.k[0], cache.v[0]
        spans = sorted({min(s, kc.shape[1]) for s in spans})
        report: dict[str, dict] = {}
        table: dict[tuple[int, int], bool] = {}

        def timed(fn) -> float:
            times = graph_replay_ms(fn, num_iters, reps)
            return sorted(times)[len(times) // 2]

        for b in sorted(set(batch_sizes)):
            if b > kc.shape[0]:
                continue
            for w in sorted(set(widths)):
                if not self.split_k_supported(w):
                    continue
                sdpa, split = [], []
                for span in spans:
                    if span < w:
                        continue
                    q = torch.randn(b, c.num_key_value_heads, w * rep, c.head_dim, device=dev, dtype=kc.dtype)
                    rows = torch.arange(b, device=dev)
                    pos = (span - w + torch.arange(w, device=dev)).expand(b, w).contiguous()
                    visible = torch.arange(span, device=dev)[None, None, :] <= pos[:, :, None]
                    mask = gqa_mask(visible, rep, q.dtype)
                    k, v = kc[:b, :span], vc[:b, :span]
                    if rotary:  # the rotary + K/V write on both sides, as a forward runs them
                        hq, hkv = c.num_attention_heads, c.num_key_value_heads
                        qkv = torch.randn(b, w, (hq + 2 * hkv) * c.head_dim, device=dev, dtype=kc.dtype)
                        cos, sin = self.rotary.cos_sin(pos)
                        sdpa.append(timed(lambda: folded_attention(
                            rotary_qkv_cache(qkv, cos, sin, qn, kn, eps, kc, vc, rows, pos, hq, hkv), k, v, mask, w)))
                        split.append(timed(lambda: rotary_decode_attention(
                            qkv, cos, sin, qn, kn, eps, kc, vc, rows, pos, span, hq, hkv)))
                        continue
                    sdpa.append(timed(lambda: folded_attention(q, k, v, mask, w)))
                    split.append(timed(lambda: decode_attention(q, kc, vc, rows, pos, span)))
                if sdpa:
                    table[b, w] = all(s < a for s, a in zip(split, sdpa))
                    report[f"{b},{w}"] = {"sdpa_ms": sdpa, "split_k_ms": split, "split_k": table[b, w]}
        self.split_k_table = table
        return report

    def _fused_layers(self, x, cos, sin, mask, cache, rows, positions, span, slot_ids, want, captured, split_k):
        """The decoder stack of :meth:`forward` over the cache with the fused kernels
        (:func:`adaflash_ray.models.layers.fused_layer_stack`): each residual add is fused into the next RMSNorm, so
        layer i's output (captured when ``i in want``) is the residual the next norm returns; ``split_k``: the
        split-K attention (rows are slots; ``mask`` unused). Returns ``(x, last_hidden)``."""

        def attend(i, attn, h, qkv=None, o_linear=False):
            return attn.forward_fused(h, cos, sin, mask, cache.k[i], cache.v[i], rows, positions, span, slot_ids,
                                      split_k, qkv=qkv, o_linear=o_linear)
        return fused_layer_stack(self.model.layers, x, self.model.norm, attend, want, captured)
