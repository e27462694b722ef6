"""The DFlash block-diffusion drafter (docs/design/ALGORITHMS.md §1; z-lab/dflash, SpecForge's DFlash trainer).

One forward proposes ``block_size - 1`` draft tokens: the block ``[anchor, MASK x (block_size-1)]``
attends (bidirectionally inside the block) to the committed context, which enters every layer
as extra K/V projected from the target's hidden states: ``c = hidden_norm(fc(concat_K h))``.
Token embeddings and ``lm_head`` are the target's, frozen and not part of the drafter checkpoint.

Two entry points share the same weights:
- inference: :meth:`DFlashDrafter.append_context` writes the context K/V of newly committed
  positions into a per-slot :class:`~adaflash_ray.models.target.KVCache`, and
  :meth:`DFlashDrafter.propose_hidden` runs one block per request;
- training: :meth:`DFlashDrafter.forward_train` runs many blocks per sequence, block b seeing
  context strictly before its anchor and only itself (blocks never see each other).

On CUDA the engine fuses the inference path (:meth:`DFlashDrafter.fuse_projections`, switch ``engine.fused_kernels``:
the target's): one q/k/v and one gate/up GEMM per layer and the Triton kernels of adaflash_ray/kernels (residual
add + RMSNorm, SwiGLU, q/k-norm + rotary + the K/V cache write). The fused weights are the parameters' own storage,
so a reload copied in place reaches them; training never reads them. CPU keeps the float32 reference.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from adaflash_ray.models.layers import (AttentionProjections, DecoderLayerParams, RMSNorm, Rotary, fuse_layers,
                                       fused_layer_stack, gqa_mask, grouped_attention, masked_attention)
from adaflash_ray.models.target import KVCache, TargetConfig, set_fused_kernels


def _is_int(v) -> bool:
    """A JSON integer (a bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class DrafterModelConfig:
    """Architecture of a DFlash drafter. ``target_hidden_size`` is the width of each captured
    target layer; ``mask_token_id=None`` means the drafter owns a learned mask embedding (for
    targets with no spare vocabulary id, e.g. SmolLM2)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    target_hidden_size: int
    num_target_layers: int  # layers of the target model (DFlash config field)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    mask_token_id: int | None = None
    model_type: str = "qwen3"
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, tcfg: TargetConfig, *, num_hidden_layers: int, block_size: int,
                   target_layer_ids: list[int], intermediate_size: int | None = None,
                   mask_token_id: int | None = None) -> "DrafterModelConfig":
        """A drafter at the target's width (the DFlash default), validated against the target.

        Raises ValueError if a layer id is outside ``[0, L)`` or block_size < 2.
        """
        bad = [i for i in target_layer_ids if not 0 <= i < tcfg.num_hidden_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside [0, {tcfg.num_hidden_layers})")
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=intermediate_size or tcfg.intermediate_size,
                   num_hidden_layers=num_hidden_layers, num_attention_heads=tcfg.num_attention_heads,
                   num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                   vocab_size=tcfg.vocab_size, block_size=block_size, target_layer_ids=list(target_layer_ids),
                   target_hidden_size=tcfg.hidden_size, num_target_layers=tcfg.num_hidden_layers,
                   rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta, mask_token_id=mask_token_id)

    # DFlash checkpoint config.json (HF style) -------------------------------------------------
    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "attention_bias": False,
            "is_causal": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            **({"adaflash_extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterModelConfig":
        """Parse a DFlash ``config.json``: the architecture comes from the checkpoint.

        Fields are read where SGLang 0.5.23's DFlash reader (``srt/speculative/dflash_utils.py``
        ``parse_dflash_draft_config``) reads them: ``dflash_config.{block_size, target_layer_ids, mask_token_id,
        num_target_layers}`` first, then the top level.

        Raises:
            ValueError: a missing field, a field of the wrong type or range (a width given as the string ``"576"``,
                ``block_size`` < 2, a non-positive ``rms_norm_eps``, ``target_layer_ids`` not a non-empty list of
                integers), or an architecture this drafter does not implement, named by its field
                (:func:`unsupported_architecture`): sliding-window layers, causal attention, attention biases,
                an activation other than SiLU, rope scaling, or a DFlash variant (convolution, selector, Domino
                projector, output multiplier, logit soft-capping).
        """
        if not isinstance(d, dict):
            raise ValueError(f"DFlash config.json must be a JSON object, got {type(d).__name__}")
        dc = d.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise ValueError(f"DFlash config.json: dflash_config must be an object, got {type(dc).__name__}")
        if dc.get("block_size", d.get("block_size")) is None:
            raise ValueError("DFlash config.json has no block_size (neither dflash_config.block_size nor block_size)")
        problems = unsupported_architecture(d)
        if problems:
            raise ValueError("DFlash config.json describes an architecture this drafter does not implement: "
                             + "; ".join(problems))
        n_target = dc.get("num_target_layers", d.get("num_target_layers"))
        if "num_target_layers" in dc and "num_target_layers" in d and dc["num_target_layers"] != d["num_target_layers"]:
            raise ValueError(f"DFlash config.json: dflash_config.num_target_layers {dc['num_target_layers']} != "
                             f"num_target_layers {d['num_target_layers']}")
        try:
            n_heads = d["num_attention_heads"]
            for name, v in (("num_attention_heads", n_heads), ("hidden_size", d["hidden_size"])):
                if not _is_int(v) or v < 1:  # head_dim's default divides by them (before _check_types)
                    raise ValueError(f"DFlash config.json: {name} must be an integer >= 1, got {v!r}")
            rope = d.get("rope_parameters") or {}
            if n_target is None:
                raise KeyError("num_target_layers")
            cfg = cls(
                hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"], num_attention_heads=n_heads,
                num_key_value_heads=d.get("num_key_value_heads", n_heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // n_heads, vocab_size=d["vocab_size"],
                block_size=dc.get("block_size", d.get("block_size")),
                target_layer_ids=list(dc["target_layer_ids"] if "target_layer_ids" in dc else d["target_layer_ids"]),
                target_hidden_size=d.get("target_hidden_size", d["hidden_size"]),
                num_target_layers=n_target, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                mask_token_id=dc.get("mask_token_id", d.get("mask_token_id")), model_type=d.get("model_type", "qwen3"),
                extra=d.get("adaflash_extra", {}),
            )
        except KeyError as e:
            raise ValueError(f"DFlash config.json is missing field {e.args[0]!r}") from e
        cfg._check_types()
        return cfg

    def _check_types(self) -> None:
        """Raise ValueError naming the first field read from a ``config.json`` with the wrong JSON type or range
        (a bool is not an integer)."""
        for name, low in (("hidden_size", 1), ("intermediate_size", 1), ("num_hidden_layers", 1),
                          ("num_attention_heads", 1), ("num_key_value_heads", 1), ("head_dim", 1), ("vocab_size", 1),
                          ("block_size", 2), ("target_hidden_size", 1), ("num_target_layers", 1)):
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                raise ValueError(f"DFlash config.json: {name} must be an integer >= {low}, got {v!r}")
        ids = self.target_layer_ids
        if not ids or not all(_is_int(i) for i in ids):
            raise ValueError(f"DFlash config.json: target_layer_ids must be a non-empty list of integers, got {ids!r}")
        if self.mask_token_id is not None and not _is_int(self.mask_token_id):
            raise ValueError(f"DFlash config.json: mask_token_id must be an integer or null, "
                             f"got {self.mask_token_id!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"DFlash config.json: rms_norm_eps must be a positive number, got {eps!r}")

    def check_target(self, tcfg: TargetConfig) -> None:
        """Raise ValueError if this drafter cannot serve ``tcfg`` (vocabulary, width, layers)."""
        problems = []
        if self.vocab_size != tcfg.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {tcfg.vocab_size}")
        if self.target_hidden_size != tcfg.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} != target hidden_size {tcfg.hidden_size}")
        if self.hidden_size != tcfg.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {tcfg.hidden_size} "
                            "(the drafter shares the target's embeddings and lm_head)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < tcfg.num_hidden_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {tcfg.num_hidden_layers} layers")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < tcfg.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary")
        if problems:
            raise ValueError("drafter does not match the target: " + "; ".join(problems))

    def as_dict(self) -> dict:
        return asdict(self)


#: DFlash variants (``dflash_config`` keys, SGLang 0.5.23 ``parse_dflash_draft_config``) and their neutral values
_DFLASH_VARIANTS = {"conv_kernel_size": (None, 0), "conv_group_size": (None, 0), "selector_rank": (None, 0),
                    "selector_top_k": (None, 0), "projector_type": (None,), "output_multiplier": (None, 1, 1.0),
                    "final_logit_softcapping": (None, 0, 0.0), "attention_sink_bias": (None, False),
                    "attention_value_scale": (None,), "use_swa": (None, False), "causal": (None, False)}


def unsupported_architecture(d: dict) -> list[str]:
    """What a DFlash ``config.json`` asks for that :class:`DFlashDrafter` does not implement (empty: loadable).

    The drafter is DFlash's Qwen3-style stack: full bidirectional attention inside the block over the context
    (no sliding window, non-causal), no attention or MLP biases, SiLU-gated MLP, per-head q/k RMSNorm, default
    (unscaled, full-width, neox half-split) rope. Each entry names the field and its value. Sliding-window
    layers follow SGLang's / vLLM's reading: a ``"sliding_attention"`` entry in ``layer_types`` (or, without
    ``layer_types``, ``use_sliding_window: true`` with a ``sliding_window``); a ``sliding_window`` value alone,
    with every layer full, changes nothing and passes.
    """
    out = []
    n = d.get("num_hidden_layers")
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if isinstance(layer_types, str) or not isinstance(layer_types, (list, tuple)):
            out.append(f"layer_types must be a list of attention types, got {layer_types!r}")
        else:
            sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
            other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
            if sliding:
                out.append(f"layer_types has sliding_attention at layers {sliding} (sliding_window "
                           f"{d.get('sliding_window')}): sliding-window drafter layers are not implemented")
            if other:
                out.append(f"layer_types has unknown attention types {other}")
            if n is not None and len(layer_types) != n:
                out.append(f"layer_types has {len(layer_types)} entries for num_hidden_layers {n}")
    elif d.get("use_sliding_window") and d.get("sliding_window") is not None:
        out.append(f"use_sliding_window true with sliding_window {d['sliding_window']}: sliding-window drafter "
                   "layers are not implemented")
    if d.get("is_causal") is True:
        out.append("is_causal true: the drafter attends bidirectionally inside the block (DFlash)")
    for key in ("attention_bias", "mlp_bias", "use_gemma_norm"):
        if d.get(key):
            out.append(f"{key} {d[key]!r} is not implemented")
    if d.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {d['hidden_act']!r}: only silu is implemented")
    if float(d.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        out.append(f"partial_rotary_factor {d['partial_rotary_factor']}: only full-width rope is implemented")
    if d.get("is_neox_style", d.get("rope_is_neox_style", True)) is not True:
        out.append("rope is_neox_style false: only the half-split (neox) rope layout is implemented")
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if rope_type not in ("default", None):
            out.append(f"{key}.rope_type {rope_type!r}: only the default (unscaled) rope is implemented")
    dc = d.get("dflash_config") or {}
    for key, neutral in _DFLASH_VARIANTS.items():
        if key in dc and not any(dc[key] is v or (type(dc[key]) is type(v) and dc[key] == v) for v in neutral):
            out.append(f"dflash_config.{key} {dc[key]!r}: this DFlash variant is not implemented")
    return out


class _DrafterAttention(AttentionProjections):
    """Qwen3-style attention of a drafter layer: no biases, per-head q/k norm (DFlash)."""

    def __init__(self, cfg: DrafterModelConfig):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qkv_bias=False, qk_norm=True, eps=cfg.rms_norm_eps)

    def context_kv_fused(self, c, cos, sin, k_cache, v_cache, rows, positions) -> None:
        """The context K/V of ``c`` ``[N, 1, H]`` written into one layer's cache ``[slots, S_max, Hkv, D]`` at
        ``[rows[n], positions[n, 0]]`` with the fused kernels (needs :meth:`fuse` and Triton): one GEMM for k and v
        (the k/v rows of the fused q/k/v weight), one kernel for k-norm + rotary + the K/V write
        (:func:`adaflash_ray.kernels.rotary_cache.rotary_kv_cache`). cos, sin ``[N, 1, D]`` float32; rows ``[N]``,
        positions ``[N, 1]`` int64. The values :meth:`kv` gives, rounded to the cache dtype."""
        from adaflash_ray.kernels.rotary_cache import rotary_kv_cache

        kv = F.linear(c, self._qkv_w[self.num_heads * self.head_dim:])  # [N, 1, 2 Hkv D]
        rotary_kv_cache(kv, cos, sin, self.k_norm.weight, self.k_norm.eps, k_cache, v_cache, rows, positions,
                        self.num_kv_heads)


class _DrafterLayer(DecoderLayerParams):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, _DrafterAttention(cfg))

    def forward(self, x, cos, sin, ctx_k, ctx_v, visible):
        """x ``[B, Q, H]`` block positions; ctx_k/ctx_v ``[B, C, Hkv, D]``; visible ``[B, Q, C+Q]`` bool, or a
        flex-attention ``BlockMask`` of the same visibility (:func:`_flex_attention`).

        Under autocast, queries, keys and values enter the attention in the autocast dtype (the q/k norms and the
        rotary return float32, which would select a float32 attention kernel); otherwise in the block keys' dtype.
        """
        h = self.input_layernorm(x)
        attn = self.self_attn
        q = attn.q(h, cos, sin)
        bk, bv = attn.kv(h, cos, sin)
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else bk.dtype
        q = q.to(dt)
        k = torch.cat([ctx_k.to(dt), bk.to(dt)], dim=1)
        v = torch.cat([ctx_v.to(dt), bv.to(dt)], dim=1)
        if isinstance(visible, torch.Tensor):
            out = masked_attention(q, k, v, visible)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            fn = flex_attention if torch.compiler.is_compiling() else _flex_attention(q.device)  # inside compile_training
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=visible,
                     enable_gqa=True).transpose(1, 2)
        x = x + attn.o_proj(out.reshape(x.shape[0], x.shape[1], -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, k_cache, v_cache, rows, positions, span, mask):
        """Inference: write the block's K/V into ``k_cache/v_cache`` ``[B, S_max, Hkv, D]`` at
        (``rows`` ``[B, 1]``, ``positions`` ``[B, Q]``), then attend over ``[:, :span]`` with ``mask``
        (``[B, 1, Q*rep, span]``). Same math as :meth:`forward` with the context and block keys side by side."""
        h = self.input_layernorm(x)
        attn = self.self_attn
        q, bk, bv = attn.qkv(h, cos, sin)
        k_cache[rows, positions] = bk.to(k_cache.dtype)
        v_cache[rows, positions] = bv.to(v_cache.dtype)
        out = grouped_attention(q, k_cache[:, :span].to(q.dtype), v_cache[:, :span].to(q.dtype), mask)
        x = x + attn.o_proj(out.reshape(x.shape[0], x.shape[1], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


_FLEX_COMPILED = None

#: flex attention's tile (queries and keys) in :func:`flex_block_mask`: its default ``BLOCK_SIZE``.
FLEX_TILE = 128


def flex_block_mask(q_anchor: torch.Tensor, block_size: int, ctx_len: int):
    """The flex-attention ``BlockMask`` of :meth:`DFlashDrafter.forward_train`'s visibility, built from the anchors
    with a few small tensor ops (``create_block_mask`` evaluates the mask on every (query, key) pair: ~10^8 of them
    for a training batch).

    Keys are ``ctx_len`` context positions (a multiple of :data:`FLEX_TILE`) followed by the ``Q`` block positions;
    query ``i`` (block ``i // block_size``) sees context keys ``< q_anchor[b, i]`` and the keys of its own block.
    Per query tile: the context tiles below every anchor of the tile are full (no mask evaluated), those up to its
    largest anchor partial, and the tiles holding its blocks' own keys partial (one, the diagonal, when
    ``block_size`` divides :data:`FLEX_TILE`); every other tile is skipped.

    Args:
        q_anchor: ``[B, Q]`` int64, each query's anchor (``1 <= a < ctx_len``), non-decreasing along ``Q`` within a
            tile or not (tiles use their min and max).
        block_size: positions per block (``Q`` a multiple of it).
        ctx_len: context keys, a multiple of :data:`FLEX_TILE`.
    Returns:
        ``BlockMask`` for ``[B, *, Q, ctx_len + Q]`` (heads broadcast).
    Raises:
        ValueError: ``ctx_len`` not a multiple of the tile.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if ctx_len % FLEX_TILE:
        raise ValueError(f"ctx_len ({ctx_len}) must be a multiple of {FLEX_TILE}")
    bsz, q_len = q_anchor.shape
    q_tiles = -(-q_len // FLEX_TILE)
    ctx_tiles = ctx_len // FLEX_TILE
    pad = q_tiles * FLEX_TILE - q_len
    a = F.pad(q_anchor, (0, pad), value=-1).view(bsz, q_tiles, FLEX_TILE)
    a_hi = a.amax(-1)  # [B, QT]
    a_lo = torch.where(a < 0, q_anchor.new_tensor(ctx_len), a).amin(-1)
    j = torch.arange(ctx_tiles + q_tiles, device=q_anchor.device)  # key tiles: context, then block
    ctx = j < ctx_tiles
    full = ctx & ((j + 1) * FLEX_TILE <= a_lo[..., None])  # [B, QT, KT]
    t = torch.arange(q_tiles, device=j.device)[:, None]  # [QT, 1]
    first = (t * FLEX_TILE // block_size) * block_size  # the tile's block keys: its first query's block ...
    last = torch.clamp(((t * FLEX_TILE + FLEX_TILE - 1) // block_size + 1) * block_size, max=q_len) - 1  # ... last
    own = ~ctx & (j - ctx_tiles >= first // FLEX_TILE) & (j - ctx_tiles <= last // FLEX_TILE)  # [QT, KT]
    partial = (ctx & ~full & (j * FLEX_TILE < a_hi[..., None])) | own

    def listed(m):  # counts [B, 1, QT] and the tiles' indices first, in order, [B, 1, QT, KT] (int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]

    def visible_mod(b, h, q_idx, kv_idx):  # keys: context 0..ctx_len-1, then the Q block positions
        return torch.where(kv_idx < ctx_len, kv_idx < q_anchor[b, q_idx],
                           (kv_idx - ctx_len) // block_size == q_idx // block_size)

    kv_num, kv_idx = listed(partial)
    full_num, full_idx = listed(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_TILE, mask_mod=visible_mod,
                                    seq_lengths=(q_len, ctx_len + q_len))


def _flex_attention(device: torch.device):
    """``torch.nn.attention.flex_attention.flex_attention``: compiled (once per process) on CUDA, where only the
    compiled form runs fused block-sparse kernels; eager elsewhere (the reference math, for tests)."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(flex_attention)  # automatic dynamic shapes: batches differ
    return _FLEX_COMPILED


def _train_layer_step(layer: "_DrafterLayer", x, c, ccos, csin, cos, sin, visible):
    """One drafter layer of the training forward: the context ``c`` ``[B, T, H]``'s keys / values (rotated at
    ``ccos``/``csin``), then the layer over the block positions ``x`` ``[B, Q, H]``. Returns ``[B, Q, H]``."""
    ck, cv = layer.self_attn.kv(c, ccos, csin)
    return layer(x, cos, sin, ck, cv, visible)


class DFlashDrafter(nn.Module):
    """DFlash drafter. Parameters (checkpoint names, DFlash format): ``fc.weight [H, K*Ht]``,
    ``hidden_norm.weight``, ``layers.N.*`` (Qwen3-style), ``norm.weight`` and, with no mask token,
    ``mask_embedding [H]``. ``embed_tokens`` / ``lm_head`` are borrowed from the target by
    :meth:`attach_target` and excluded from :meth:`drafter_state_dict`.
    """

    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.config = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([_DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        else:
            self.mask_embedding = None
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        #: ``auto`` / ``off``: the Triton kernels on the propose path (:meth:`use_fused_kernels`)
        self.fused_kernels = "auto"
        self.fused_kernels_active = False  # set by use_fused_kernels
        #: the training forward's per-layer function (``_train_layer_step``, or its torch.compile'd form:
        #: :meth:`compile_training`)
        self._train_layer = _train_layer_step
        self._target_embed: nn.Embedding | None = None
        self._target_lm_head: nn.Linear | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Deterministic init: normal(0, std) for linears, ones for norms; mask embedding = mean
        of the target embeddings if attached (zeros otherwise)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif p.dim() == 2:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        if self.mask_embedding is not None and self._target_embed is not None:
            with torch.no_grad():
                self.mask_embedding.copy_(self._target_embed.weight.float().mean(0))

    def attach_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> "DFlashDrafter":
        """Share the target's frozen input embeddings and lm_head (not registered as submodules)."""
        object.__setattr__(self, "_target_embed", embed_tokens)
        object.__setattr__(self, "_target_lm_head", lm_head)
        return self

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights under DFlash checkpoint names (no embeddings / lm_head)."""
        return {n: p.detach() for n, p in self.named_parameters()}

    # ------------------------------------------------------------------ pieces
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., K*Ht]`` target features -> context ``c`` ``[..., H]`` = hidden_norm(fc(features))."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_embeddings(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """``anchor_ids`` ``[...]`` -> block input ``[..., block_size, H]``: embed(anchor) then MASK."""
        emb = self._target_embed(anchor_ids).to(self.fc.weight.dtype)  # [..., H]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(emb.dtype)
        else:
            mask = self._target_embed.weight[self.config.mask_token_id].to(emb.dtype)
        mask = mask.expand(*anchor_ids.shape, self.block_size - 1, emb.shape[-1])
        return torch.cat([emb[..., None, :], mask], dim=-2)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V]`` (float32) from final hidden states ``[..., H]``."""
        w = self._target_lm_head.weight
        # contiguous: a strided [B, T, H] slice makes matmul fall back to a ~7x slower broadcast bmm on CPU
        return (hidden.to(w.dtype).contiguous() @ w.t()).float()

    # ------------------------------------------------------------------ inference kernels
    def fuse_projections(self, mode: str | None = None) -> "DFlashDrafter":
        """One GEMM for q/k/v and one for gate/up per layer (the engine's CUDA path, as
        :meth:`~adaflash_ray.models.target.TargetModel.fuse_projections`): the weights are stored concatenated and
        the parameters become views of them, so names, values, ``drafter_state_dict`` and in-place loads
        (``load_state_dict``, the engine's ``load_drafter``) are unchanged and reach the fused weights. Then
        :meth:`use_fused_kernels` with ``mode`` (None: :attr:`fused_kernels`). Idempotent; training
        (:meth:`forward_train`) never reads the fused weights."""
        fuse_layers(self.layers)
        self.use_fused_kernels(self.fused_kernels if mode is None else mode)
        return self

    def use_fused_kernels(self, mode: str = "auto") -> bool:
        """Choose the Triton kernels of adaflash_ray/kernels for :meth:`propose_hidden` and :meth:`append_context`
        by the target's rule (:func:`~adaflash_ray.models.target.set_fused_kernels`: ``auto`` on CUDA, or any
        device under ``TRITON_INTERPRET=1``, one parameter dtype; ``ADAFLASH_FUSED_KERNELS`` overrides ``mode``).
        On: add + RMSNorm fused across the residual, SwiGLU fused, qk-norm + rotary fused with the block's K/V write
        (propose) and k-norm + rotary with the context K/V write (append), one q/k/v GEMM (projections fused when
        turning on). Returns :attr:`fused_kernels_active`.

        Raises:
            ValueError: ``mode`` (or the environment variable) not auto/off.
        """
        return set_fused_kernels(self, self.layers, mode, self.fc.weight.device, self.config.head_dim)

    def _fused_path(self, device: torch.device, cache: KVCache) -> bool:
        """The fused kernels apply to this call: turned on, inputs and cache on the weights' device (the cache in
        their dtype) and Triton launches there. Where a parameter no longer lies in the fused storage (an assigning
        ``load_state_dict``, ``.to()``), the projections are fused again from the live parameters first (the rule
        re-applied); inside a CUDA-graph capture the reference path runs instead."""
        if not self.fused_kernels_active:
            return False
        from adaflash_ray.kernels.triton_support import triton_usable

        w = self.fc.weight
        if device != w.device or cache.k.dtype != w.dtype or not triton_usable(device):
            return False
        if all(layer.self_attn._fused() and layer.mlp._fused() for layer in self.layers):
            return True
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return self.use_fused_kernels(self.fused_kernels)

    # ------------------------------------------------------------------ inference
    def new_context_cache(self, num_slots: int, max_seq_len: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        p = self.fc.weight
        return KVCache(c.num_hidden_layers, num_slots, max_seq_len, c.num_key_value_heads, c.head_dim,
                       dtype or p.dtype, p.device)

    @torch.no_grad()
    def append_context(self, cache: KVCache, slot_ids: torch.Tensor, positions: torch.Tensor,
                       features: torch.Tensor) -> None:
        """Write context K/V of committed positions into ``cache``.

        slot_ids, positions: int64 of any equal shape ``[...]`` (e.g. ``[N]`` rows mixing requests, or
        ``[B, W]`` for a verify step); features: ``[..., K*Ht]``. Every layer's context K/V come from the
        same ``c`` (the context never passes through the drafter's layers - DFlash).
        """
        if positions.dim() == 1:
            slot_ids, positions, features = slot_ids[None], positions[None], features[None]
        if self._fused_path(features.device, cache):
            self._append_context_fused(cache, slot_ids, positions, features)
            return
        c = self.project_context(features)  # [B, T, H]
        cos, sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(c, cos, sin)  # [B, T, Hkv, D]
            cache.k[i][slot_ids, positions] = k.to(cache.k.dtype)
            cache.v[i][slot_ids, positions] = v.to(cache.v.dtype)

    def _append_context_fused(self, cache, slot_ids, positions, features) -> None:
        """:meth:`append_context` with the fused kernels, every position its own row (rows may mix slots): fc, then
        hidden_norm as one kernel (:func:`adaflash_ray.kernels.fused_norm.add_rmsnorm`), then per layer
        :meth:`_DrafterAttention.context_kv_fused` (one k/v GEMM, one k-norm + rotary + K/V write kernel)."""
        from adaflash_ray.kernels.fused_norm import add_rmsnorm

        n = positions.numel()
        f = self.fc(features.reshape(n, 1, -1).to(self.fc.weight.dtype))  # [N, 1, H]
        c = add_rmsnorm(f, None, self.hidden_norm.weight, self.hidden_norm.eps)[1]  # = project_context
        pos = positions.reshape(n, 1)
        cos, sin = self.rotary.cos_sin(pos)  # [N, 1, D]
        rows = slot_ids.reshape(n)
        for i, layer in enumerate(self.layers):
            layer.self_attn.context_kv_fused(c, cos, sin, cache.k[i], cache.v[i], rows, pos)

    @torch.no_grad()
    def propose_hidden(self, cache: KVCache, slot_ids: torch.Tensor, anchor_ids: torch.Tensor,
                       anchor_pos: torch.Tensor, span: int | None = None, rows_are_slots: bool = False) -> torch.Tensor:
        """One block per request: ``[anchor, MASK x (bs-1)]`` at positions ``anchor_pos .. +bs-1``.

        anchor_ids / anchor_pos / slot_ids ``[B]`` int64. The context is the slot's cache entries at
        positions ``< anchor_pos``; the block's own K/V are written into the cache rows at the block's
        positions (scratch: beyond every committed position, overwritten by the next append) and the
        block attends bidirectionally to itself. ``span`` (keys read, ``>= max(anchor_pos) + bs``)
        defaults to that bound (one host sync). With ``rows_are_slots`` (the engine's graph-captured
        step) row b is slot b and the cache is read in place; otherwise the slots' entries are gathered
        (a copy, so the scratch writes do not touch the cache). Returns final hidden ``[B, bs, H]``.
        """
        bsz, bs = anchor_ids.shape[0], self.block_size
        x = self.block_embeddings(anchor_ids)  # [B, bs, H]
        dev = x.device
        pos = anchor_pos[:, None] + torch.arange(bs, device=dev)  # [B, bs]
        cos, sin = self.rotary.cos_sin(pos)
        if span is None:
            span = int(anchor_pos.max().item()) + bs
        span = min(span, cache.max_seq_len)
        key_pos = torch.arange(span, device=dev)[None, :]
        ctx_vis = (key_pos < anchor_pos[:, None]) | ((key_pos >= pos[:, :1]) & (key_pos <= pos[:, -1:]))  # [B, S]
        mask = gqa_mask(ctx_vis[:, None, :].expand(bsz, bs, span),
                        self.config.num_attention_heads // self.config.num_key_value_heads, x.dtype)
        rows = torch.arange(bsz, device=dev)[:, None]
        write_pos = pos.clamp(max=cache.max_seq_len - 1)
        if self._fused_path(dev, cache):
            return self._propose_fused(x, cos, sin, mask, cache, slot_ids, rows[:, 0], write_pos, span,
                                       rows_are_slots)
        for i, layer in enumerate(self.layers):
            if rows_are_slots:
                kc, vc = cache.k[i][:bsz], cache.v[i][:bsz]  # views
            else:
                kc, vc = cache.k[i][slot_ids, :span], cache.v[i][slot_ids, :span]  # gathered copies
            x = layer.forward_cached(x, cos, sin, kc, vc, rows, write_pos, span, mask)
        return self.norm(x)

    def _propose_fused(self, x, cos, sin, mask, cache, slot_ids, rows, write_pos, span, rows_are_slots):
        """The layers of :meth:`propose_hidden` with the fused kernels (:func:`fused_layer_stack`): per layer one
        q/k/v GEMM, one kernel for qk-norm + rotary + the block's K/V write into the context cache + the query fold
        (:meth:`AttentionProjections.forward_fused`), SDPA with ``mask``, o_proj; each residual add fused into the
        next RMSNorm (the last into ``norm``), SwiGLU fused. The cache is written as the reference writes it: in
        place with ``rows_are_slots``, else into the gathered copies. x ``[B, bs, H]``; rows ``[B]`` =
        ``arange(B)``; write_pos ``[B, bs]``. Returns the final hidden ``[B, bs, H]``."""
        if not rows_are_slots:
            write_pos = write_pos.clamp(max=span - 1)  # the copies hold positions < span (the kernel checks none)

        def attend(i, attn, h, qkv=None, o_linear=False):
            if rows_are_slots:
                kc, vc = cache.k[i], cache.v[i]  # row b is slot b: read as [:B, :span] in place
            else:
                kc, vc = cache.k[i][slot_ids, :span], cache.v[i][slot_ids, :span]  # gathered copies
            return attn.forward_fused(h, cos, sin, mask, kc, vc, rows, write_pos, span, None, qkv=qkv,
                                      o_linear=o_linear)
        return fused_layer_stack(self.layers, x, self.norm, attend)[1]

    # ------------------------------------------------------------------ training
    def forward_train(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                      attention: str = "sdpa") -> torch.Tensor:
        """Many blocks per sequence (DFlash/SpecForge training layout).

        Args:
            features: ``[B, T, K*Ht]`` target features of positions 0..T-1.
            input_ids: ``[B, T']`` token ids (T' >= T); the anchor token is ``input_ids[b, anchor]``.
            anchors: ``[B, N]`` int64 anchor positions (>= 1; padding anchors may repeat a valid
                one - their loss weight must be zero).
            attention: ``sdpa`` (SDPA with an explicit ``[B, N*bs, T + N*bs]`` visibility mask) or ``flex``
                (flex attention with the block mask of :func:`flex_block_mask`, the context padded to whole tiles:
                key tiles no query of a tile sees are skipped; compiled on CUDA).
        Returns:
            ``[B, N, block_size, H]`` final hidden states; block position k predicts token anchor+k.
        Block n sees context positions ``< anchors[b, n]`` and the positions of its own block only.
        Raises:
            ValueError: unknown ``attention``.
        """
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}")
        bsz, t, _ = features.shape
        n, bs = anchors.shape[1], self.block_size
        if torch.is_autocast_enabled(features.device.type):  # fc runs in the autocast dtype: no float32 copy first
            c = self.hidden_norm(self.fc(features))  # [B, T, H], = project_context(features)
        else:
            c = self.project_context(features)  # [B, T, H]
        pad = (-t) % FLEX_TILE if attention == "flex" else 0  # flex: context keys padded to whole tiles
        if pad:  # never visible: every anchor is < t
            c = F.pad(c, (0, 0, 0, pad))
        ctx_pos = torch.arange(t + pad, device=c.device).expand(bsz, t + pad)
        ccos, csin = self.rotary.cos_sin(ctx_pos)
        anchor_ids = input_ids.gather(1, anchors)  # [B, N]
        x = self.block_embeddings(anchor_ids).reshape(bsz, n * bs, -1)  # [B, N*bs, H]
        pos = (anchors[:, :, None] + torch.arange(bs, device=c.device)).reshape(bsz, n * bs)
        cos, sin = self.rotary.cos_sin(pos)
        q_anchor = anchors.repeat_interleave(bs, dim=1)  # [B, N*bs]
        if attention == "flex":
            visible = flex_block_mask(q_anchor, bs, t + pad)
        else:
            ctx_vis = ctx_pos[:, None, :] < q_anchor[:, :, None]  # [B, N*bs, T]
            blk = torch.arange(n, device=c.device).repeat_interleave(bs)
            blk_vis = (blk[:, None] == blk[None, :]).expand(bsz, n * bs, n * bs)
            visible = torch.cat([ctx_vis, blk_vis], dim=-1)
        step = self._train_layer
        if step is not _train_layer_step:
            # compiled: Dynamo guards on a view input's base (x._base), so layer 0's view input and the later layers'
            # plain ones would compile two graphs for every shape regime; a copy (B*N*bs*H elements) makes it one
            x = x.clone()
        for layer in self.layers:
            x = step(layer, x, c, ccos, csin, cos, sin, visible)
        return self.norm(x).reshape(bsz, n, bs, -1)

    def compile_training(self, enable: bool = True) -> "DFlashDrafter":
        """Run each layer of :meth:`forward_train` (its context K/V projection, norms, rotary, attention, SwiGLU and
        residual adds) through ``torch.compile(dynamic=True)`` (one graph per layer for every batch, length and
        anchor count; Inductor fuses the element-wise chains between the GEMMs and the attention), forward and
        backward; ``enable=False`` restores the eager function. With ``attention="flex"`` the flex attention is
        traced into the same graph. The values are the eager ones up to floating-point reassociation.

        Enabling it turns off Dynamo's duck sizing for the process (``torch.fx.experimental._config.use_duck_shape``):
        sizes that happen to be equal in the first batch (e.g. a flex block mask's tile count and the block size, both
        16) would otherwise share one symbol, and a later batch where they differ would compile the layer again."""
        if enable:
            import torch.fx.experimental._config as fx_config

            fx_config.use_duck_shape = False
        self._train_layer = torch.compile(_train_layer_step, dynamic=True) if enable else _train_layer_step
        return self
