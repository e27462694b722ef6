"""Shared building blocks of the target and drafter: RMSNorm, rotary embedding, SwiGLU MLP,
and the masked attention used by every forward in the engine.

All functions are pure torch (no Ray), shape-commented, and dtype-agnostic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# one definition each, beside the fused kernels that replace them on CUDA (re-exported here)
from adaflash_ray.kernels.reference import apply_rotary, folded_attention, gqa_mask  # noqa: F401


def _views_of(fused: torch.Tensor, parts) -> bool:
    """Whether ``parts`` (tensors of one dtype) lie back to back in ``fused``'s storage from its start, in order:
    the layout :meth:`AttentionProjections.fuse` / :meth:`SwiGLU.fuse` leave (a host-side pointer check)."""
    ptr, step = fused.data_ptr(), fused.element_size()
    for p in parts:
        if p.data_ptr() != ptr or p.dtype != fused.dtype or p.device != fused.device:
            return False
        ptr += p.numel() * step
    return True


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) as in Llama/Qwen: computed in float32,
    cast back to the input dtype. Weight shape ``[dim]``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s forward on plain tensors (``x`` ``[..., D]``, ``weight`` ``[D]``): one fused kernel on CUDA
    when the dtypes agree (statistics in float32 for bf16 input), else computed in float32 and cast back."""
    if x.dtype == weight.dtype:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class SwiGLU(nn.Module):
    """Llama/Qwen MLP: ``down(silu(gate(x)) * up(x))``; no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

        self._gate_up: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """Keep gate/up weights in one ``[2I, H]`` tensor (one GEMM per call); the parameters become views
        of it, so names, values and in-place updates are unchanged. Idempotent."""
        if self._fused():
            return
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        n = self.gate_proj.out_features
        self.gate_proj.weight.data, self.up_proj.weight.data = w[:n], w[n:]
        self._gate_up = w

    def _fused(self) -> bool:  # false again if .to() or an assigning load moved a parameter off the fused storage
        return self._gate_up is not None and _views_of(self._gate_up, (self.gate_proj.weight, self.up_proj.weight))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with the SwiGLU product as one Triton kernel on the fused gate/up GEMM output
        (:func:`adaflash_ray.kernels.swiglu.swiglu`); needs :meth:`fuse` and Triton (CUDA or its interpreter)."""
        from adaflash_ray.kernels.swiglu import swiglu

        return self.down_proj(swiglu(F.linear(x, self._gate_up)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused():
            gate, up = F.linear(x, self._gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, arXiv 2104.09864), "default" rope type with the
    half-split layout used by Hugging Face Llama/Qwen (``rotate_half``).

    ``cos_sin(positions)`` takes integer positions of any shape ``[...]`` and returns
    ``(cos, sin)`` of shape ``[..., head_dim]`` in float32.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., D]
        return emb.cos(), emb.sin()


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads and an explicit visibility mask.

    Args:
        q: ``[B, Tq, Hq, D]`` queries.
        k, v: ``[B, Tk, Hkv, D]`` keys/values; ``Hq`` must be a multiple of ``Hkv``.
        visible: ``[B, Tq, Tk]`` bool, True where query may attend to key. Every query row must
            see at least one key (callers guarantee it; a fully masked row would give NaN).
    Returns:
        ``[B, Tq, Hq, D]`` in q's dtype.
    """
    hq, hkv = q.shape[2], k.shape[2]
    if hq != hkv:
        rep = hq // hkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible[:, None, :, :]
    )  # [B, Hq, Tq, D]
    return out.transpose(1, 2)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query SDPA over keys/values read in place (no ``repeat_interleave`` copy of K/V).

    The ``rep = Hq / Hkv`` query heads that share a KV head are folded into the query length, so one
    SDPA call with ``Hkv`` heads computes them all; K/V may be strided views of a static cache
    (``cache.k[layer][:B, :span]``), which SDPA reads without a copy (gpt-fast / nano-vllm style).

    Args:
        q: ``[B, Tq, Hq, D]``; k, v: ``[B, Tk, Hkv, D]`` (last dim contiguous).
        mask: ``[B, 1, Tq*rep, Tk]`` additive mask from :func:`gqa_mask`; every row must see a key.
    Returns:
        ``[B, Tq, Hq, D]`` in q's dtype. Head h uses KV head ``h // rep`` (Hugging Face's layout).
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    qg = q.view(b, tq, hkv, rep, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, tq * rep, d)
    return folded_attention(qg, k, v, mask, tq).view(b, tq, hq, d)


class AttentionProjections(nn.Module):
    """q/k/v/o projections (+ optional per-head q/k RMSNorm, Qwen3) shared by the target and the drafter.
    Parameter names match Hugging Face (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self._qkv_w: torch.Tensor | None = None
        self._qkv_b: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """Keep q/k/v weights (and biases) in one tensor, so :meth:`qkv` is one GEMM; the parameters become
        views of it (names, values, ``state_dict`` and in-place updates unchanged). Idempotent."""
        if self._fused():
            return
        projs = (self.q_proj, self.k_proj, self.v_proj)
        w = torch.cat([p.weight for p in projs])
        b = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        start = 0
        for p in projs:
            n = p.out_features
            p.weight.data = w[start:start + n]
            if b is not None:
                p.bias.data = b[start:start + n]
            start += n
        self._qkv_w, self._qkv_b = w, b

    def _fused(self) -> bool:  # false again if .to() or an assigning load moved a parameter off the fused storage
        projs = (self.q_proj, self.k_proj, self.v_proj)
        return (self._qkv_w is not None and _views_of(self._qkv_w, [p.weight for p in projs])
                and (self._qkv_b is None or _views_of(self._qkv_b, [p.bias for p in projs])))

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries of ``x`` ``[B, T, H]`` (normed if qk_norm, rotated) -> ``[B, T, Hq, D]``."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        return apply_rotary(q if self.q_norm is None else self.q_norm(q), cos, sin)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries ``[B, T, Hq, D]``, keys and values ``[B, T, Hkv, D]`` of ``x`` ``[B, T, H]``: the same
        values as :meth:`q` and :meth:`kv`, with one rotary pass over the queries and keys together
        (fewer kernels per layer on the GPU decode path). q and k are views of one tensor."""
        b, t, _ = x.shape
        if self._fused():
            nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = F.linear(x, self._qkv_w, self._qkv_b).split([nq, nk, nk], dim=-1)
            q = q.view(b, t, self.num_heads, self.head_dim)
            k = k.view(b, t, self.num_kv_heads, self.head_dim)
            v = v.view(b, t, self.num_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        qk = apply_rotary(torch.cat([q, k], dim=2), cos, sin)
        return qk[:, :, : self.num_heads], qk[:, :, self.num_heads:], v

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed if qk_norm, rotated) and values of ``x`` ``[B, T, H]`` -> ``[B, T, Hkv, D]`` each."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        return apply_rotary(k if self.k_norm is None else self.k_norm(k), cos, sin), v

    def forward_fused(self, x, cos, sin, mask, k_cache, v_cache, rows, positions, span, slot_ids, split_k=False,
                      qkv=None, o_linear=False):
        """Attention over a static cache with Triton kernels (needs :meth:`fuse`): one GEMM for q/k/v, one kernel
        for qk-norm + rotary + the K/V write at ``[rows[b], positions[b, t]]`` + the query fold
        (:func:`adaflash_ray.kernels.rotary_cache.rotary_qkv_cache`), SDPA, o_proj.

        x ``[B, W, H]``; k_cache/v_cache ``[slots, S_max, Hkv, D]`` (one layer, x's dtype); rows ``[B]`` int64
        slots; positions ``[B, W]`` int64; mask ``[B, 1, W*rep, span]`` additive (:func:`gqa_mask`); span: keys
        attended; slot_ids None = batch row b is slot b (keys read in place as ``cache[:B, :span]``), else ``[B]``
        slots whose keys are gathered (a copy). ``split_k``: attention by
        :func:`adaflash_ray.kernels.decode_attention.decode_attention` (rows are slots, W <= 16, keys ``0..p`` for
        the query at position p) instead of SDPA with ``mask``; with :func:`rotary_attention_fused` the rotary,
        the cache write and the split-K attention are one launch
        (:func:`adaflash_ray.kernels.decode_attention.rotary_decode_attention`). ``qkv``: the q/k/v projection of
        the normed input ``[B, W, (Hq + 2 Hkv) D]`` already computed (e.g. by
        :func:`adaflash_ray.kernels.norm_linear.norm_linear`; ``x`` is then unused). ``o_linear``: o_proj by
        :func:`adaflash_ray.kernels.norm_linear.linear` (one Triton launch) instead of ``nn.Linear``; a callable:
        o_proj replaced by it (applied to the attention output ``[B, W, Hq*D]``, its result returned). Returns
        ``[B, W, H]`` (or the callable's result)."""
        from adaflash_ray.kernels.rotary_cache import rotary_qkv_cache

        if qkv is None:
            qkv = F.linear(x, self._qkv_w, self._qkv_b)  # [B, W, (Hq + 2 Hkv) D]
        b, w, _ = qkv.shape
        qn = None if self.q_norm is None else self.q_norm.weight
        kn = None if self.k_norm is None else self.k_norm.weight
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        if split_k and rotary_attention_fused():
            from adaflash_ray.kernels.decode_attention import rotary_decode_attention

            out = rotary_decode_attention(qkv, cos, sin, qn, kn, eps, k_cache, v_cache, rows, positions, span,
                                          self.num_heads, self.num_kv_heads)
        elif split_k:
            from adaflash_ray.kernels.decode_attention import decode_attention

            qg = rotary_qkv_cache(qkv, cos, sin, qn, kn, eps, k_cache, v_cache, rows, positions,
                                  self.num_heads, self.num_kv_heads)  # [B, Hkv, W*rep, D]
            out = decode_attention(qg, k_cache, v_cache, rows, positions, span)
        else:
            qg = rotary_qkv_cache(qkv, cos, sin, qn, kn, eps, k_cache, v_cache, rows, positions,
                                  self.num_heads, self.num_kv_heads)
            if slot_ids is None:
                k, v = k_cache[:b, :span], v_cache[:b, :span]
            else:
                k, v = k_cache[slot_ids, :span].to(qkv.dtype), v_cache[slot_ids, :span].to(qkv.dtype)
            out = folded_attention(qg, k, v, mask, w)
        if callable(o_linear):
            return o_linear(out)
        if o_linear:
            from adaflash_ray.kernels.norm_linear import linear

            return linear(out, self.o_proj.weight)
        return self.o_proj(out)


class DecoderLayerParams(nn.Module):
    """The pre-norm decoder layer's modules (HF names): ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``. Subclasses define how attention sees keys/values."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float, self_attn: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)


ROTARY_ATTENTION_ENV = "ADAFLASH_ROTARY_ATTENTION"


def rotary_attention_fused() -> bool:
    """Whether a split-K forward runs the rotary + cache write and the attention as one launch
    (:func:`adaflash_ray.kernels.decode_attention.rotary_decode_attention`) or as two kernels (``rotary_qkv_cache``
    then ``decode_attention``; the default until the one launch is timed on a GPU): ``ADAFLASH_ROTARY_ATTENTION`` =
    ``fused`` or ``separate`` / unset. Read when a forward runs (a CUDA graph keeps what its capture read).
    Raises ValueError on another value."""
    import os

    raw = os.environ.get(ROTARY_ATTENTION_ENV, "separate").strip().lower()
    if raw not in ("fused", "separate", ""):
        raise ValueError(f"{ROTARY_ATTENTION_ENV}={raw!r}: expected fused or separate")
    return raw == "fused"


def fuse_layers(layers) -> None:
    """:meth:`AttentionProjections.fuse` and :meth:`SwiGLU.fuse` for every :class:`DecoderLayerParams` of ``layers``
    (one q/k/v GEMM and one gate/up GEMM each; idempotent)."""
    for layer in layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()


def fused_layer_stack(layers, x: torch.Tensor, final_norm: RMSNorm, attend, want=(), captured=None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack of pre-norm :class:`DecoderLayerParams` with the fused kernels: each residual add is fused into the
    next RMSNorm (:func:`adaflash_ray.kernels.fused_norm.add_rmsnorm`; the last into ``final_norm``) and each MLP
    is :meth:`SwiGLU.forward_fused` (needs :meth:`SwiGLU.fuse` and Triton). With ``ADAFLASH_FUSED_LINEAR=on``
    (:func:`adaflash_ray.kernels.norm_linear.mode`) the add + norm is fused into the GEMM after it instead: the
    q/k/v projection, and the gate/up projection with the SwiGLU product
    (:func:`adaflash_ray.kernels.norm_linear.norm_linear`; needs :meth:`AttentionProjections.fuse` too); with
    ``all`` o_proj and down_proj run by the same kernel without the norm; ``decode`` is ``all`` for a forward of at
    most 16 token rows (``B * T``) and ``off`` above; ``residual`` runs only o_proj and down_proj by that kernel, the
    SwiGLU product in down_proj's loads and each one's residual add + next norm in its epilogue (at most 16 token
    rows; ``off`` above) (:func:`adaflash_ray.kernels.norm_linear.layer_mode`).

    Args:
        layers: the decoder layers. x: ``[B, T, H]`` input residual stream.
        attend: ``(i, layer.self_attn, h [B, T, H], qkv=None, o_linear=False) -> [B, T, H]``, layer i's attention
            output on its normed input ``h`` or on its q/k/v projection ``qkv`` (``h`` None then), o_proj by the
            Triton linear with ``o_linear`` (e.g. :meth:`AttentionProjections.forward_fused` over the layer's cache).
        want, captured: layer i's output (the residual the next norm returns) is stored as ``captured[i]`` for
            each i in ``want``.
    Returns:
        ``(x, final_norm(x))`` ``[B, T, H]`` each, in x's dtype: the last layer's output and its final norm.
    """
    from adaflash_ray.kernels import norm_linear as nl
    from adaflash_ray.kernels.fused_norm import add_rmsnorm

    mode = nl.layer_mode(x.shape[0] * x.shape[1])
    if mode == "residual":
        return _residual_fused_stack(layers, x, final_norm, attend, want, captured)
    linear, out_linear = mode in ("on", "all"), mode == "all"
    delta = None
    for i, layer in enumerate(layers):
        ln, attn, mlp = layer.input_layernorm, layer.self_attn, layer.mlp
        if linear:
            x, qkv = nl.norm_linear(x, delta, ln.weight, ln.eps, attn._qkv_w, attn._qkv_b)
        else:
            x, h = add_rmsnorm(x, delta, ln.weight, ln.eps)
        if i - 1 in want:
            captured[i - 1] = x
        a = attend(i, attn, None if linear else h, qkv=qkv if linear else None, o_linear=out_linear)
        ln = layer.post_attention_layernorm
        if linear:
            x, act = nl.norm_linear(x, a, ln.weight, ln.eps, mlp._gate_up, swiglu=True)
            delta = nl.linear(act, mlp.down_proj.weight) if out_linear else mlp.down_proj(act)
        else:
            x, h = add_rmsnorm(x, a, ln.weight, ln.eps)
            delta = mlp.forward_fused(h)
    x, last = add_rmsnorm(x, delta, final_norm.weight, final_norm.eps)
    if len(layers) - 1 in want:
        captured[len(layers) - 1] = x
    return x, last


def _residual_fused_stack(layers, x, final_norm: RMSNorm, attend, want, captured):
    """:func:`fused_layer_stack` with ``ADAFLASH_FUSED_LINEAR=residual``: o_proj and down_proj (the SwiGLU product
    in its loads) by :func:`adaflash_ray.kernels.norm_linear.linear_add_norm`, each with the residual add and the
    next RMSNorm as its epilogue; q/k/v and gate/up by cuBLAS. With the one-launch rotary attention a layer is
    q/k/v, attention, o_proj + add + norm, gate/up, down_proj + add + norm (the first layer's input norm before)."""
    from adaflash_ray.kernels import norm_linear as nl
    from adaflash_ray.kernels.fused_norm import add_rmsnorm

    ln = layers[0].input_layernorm
    x, h = add_rmsnorm(x, None, ln.weight, ln.eps)
    for i, layer in enumerate(layers):
        attn, mlp, ln = layer.self_attn, layer.mlp, layer.post_attention_layernorm

        def o_proj(out, attn=attn, res=x, ln=ln):  # [B, T, Hq*D] attention output -> (residual, normed)
            return nl.linear_add_norm(out, attn.o_proj.weight, res, ln.weight, ln.eps)
        x, h = attend(i, attn, h, o_linear=o_proj)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        x, h = nl.linear_add_norm(F.linear(h, mlp._gate_up), mlp.down_proj.weight, x, nxt.weight, nxt.eps,
                                  swiglu_in=True)
        if i in want:
            captured[i] = x
    return x, h
