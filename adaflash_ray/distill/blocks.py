"""Training blocks from on-policy trajectories (docs/design/ALGORITHMS.md §3; SpecForge's DFlash trainer).

A trajectory of ``T`` tokens yields up to ``num_anchors`` blocks. Block n starts at anchor position
``a`` (a committed token) and its positions k = 1..block_size-1 predict the tokens ``a + k`` - the
SpecForge off-by-one fix. The teacher of block position k is the target's own prediction of token
``a + k``: ``lm_head(last_hidden[a + k - 1])``. Position weights ``w_k = exp(-(k-1)/7)`` (SpecForge
``loss_decay_gamma = 7``), zero beyond the sequence end and for padding anchors.

Usage::

    g = torch.Generator().manual_seed(0)
    batch = collate(trajectories, num_anchors=16, block_size=16, generator=g)
    hidden = drafter.forward_train(batch.features, batch.input_ids, batch.anchors)  # [B, N, bs, H]
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from adaflash_ray.trajectory import Trajectory

#: SpecForge / AdaFlash ``loss_decay_gamma``: w_k = exp(-(k-1) / LOSS_DECAY_GAMMA).
LOSS_DECAY_GAMMA = 7.0


def walk_anchors(tr: Trajectory) -> torch.Tensor:
    """The anchors the serving engine's verify steps started from, from the trajectory's per-step record: the first
    decode step's anchor is the first output token (``prompt_len``, committed by the prefill) and each step moves it by
    its committed tokens, ``num_accepted + 1``. These are the positions a greedy walk lands on - just after each
    rejection - where acceptance runs below the every-anchor mean that random anchors train on
    (:mod:`adaflash_ray.distill.walk` measures both).

    Returns:
        ``[n]`` int64 strictly increasing anchors ``<= num_tokens - 2`` (empty without a per-step record).
    """
    if not len(tr.num_accepted):
        return torch.zeros(0, dtype=torch.long)
    steps = torch.as_tensor(np.asarray(tr.num_accepted, dtype=np.int64)) + 1
    pos = tr.prompt_len + torch.cumsum(steps, 0) - steps  # each step's anchor
    return pos[pos <= tr.num_tokens - 2]


def sample_anchors(prompt_len: int, num_tokens: int, num_anchors: int, block_size: int,
                   generator: torch.Generator | None = None, walk: torch.Tensor | None = None,
                   walk_fraction: float = 0.0) -> torch.Tensor:
    """Random distinct anchors in the supervised (response) region, sorted.

    An anchor ``a`` satisfies ``max(1, prompt_len - 1) <= a <= num_tokens - 2``: the last prompt token
    may be an anchor (its block predicts the first response tokens), the context before it is
    non-empty, and at least one predicted token ``a + 1`` exists.

    Args:
        prompt_len, num_tokens: of the trajectory (``0 < prompt_len < num_tokens``).
        num_anchors: at most this many anchors (all candidates if there are fewer).
        block_size: positions per block (>= 2); anchors near the end keep partial blocks, whose
            out-of-sequence positions get zero weight in :func:`collate`.
        generator: CPU torch generator (reproducible sampling).
        walk, walk_fraction: with ``walk_fraction`` > 0, up to ``round(walk_fraction * num_anchors)`` of the anchors
            are drawn from ``walk`` (:func:`walk_anchors`, the serving engine's own anchors), the rest from the other
            candidates; 0 (or an empty walk) draws exactly as without them.
    Returns:
        ``[n]`` int64, ``n = min(num_anchors, #candidates)`` (possibly 0), strictly increasing.
    Raises:
        ValueError: ``num_anchors < 1``, ``block_size < 2``, ``prompt_len`` outside ``(0, num_tokens)`` or
            ``walk_fraction`` outside [0, 1].
    """
    if not 0.0 <= walk_fraction <= 1.0:
        raise ValueError(f"walk_fraction must be in [0, 1], got {walk_fraction}")
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if not 0 < prompt_len < num_tokens:
        raise ValueError(f"prompt_len {prompt_len} not in (0, {num_tokens})")
    lo, hi = max(1, prompt_len - 1), num_tokens - 2
    num_candidates = hi - lo + 1
    if num_candidates <= 0:
        return torch.zeros(0, dtype=torch.long)
    if num_candidates <= num_anchors:
        return torch.arange(lo, hi + 1, dtype=torch.long)
    if walk is not None and walk_fraction > 0 and len(walk):
        walk = walk[(walk >= lo) & (walk <= hi)]
        k = min(len(walk), round(walk_fraction * num_anchors))
        if k:
            chosen = walk[torch.randperm(len(walk), generator=generator)[:k]]
            free = torch.ones(num_candidates, dtype=torch.bool)
            free[chosen - lo] = False
            rest = free.nonzero()[:, 0]
            rest = rest[torch.randperm(len(rest), generator=generator)[:num_anchors - k]] + lo
            return torch.sort(torch.cat([chosen, rest])).values
    pick = torch.randperm(num_candidates, generator=generator)[:num_anchors]
    return torch.sort(pick).values + lo


@dataclass
class Batch:
    """A padded training batch (B trajectories, N blocks each, bs = block_size).

    Fields (all on one device):
        input_ids ``[B, T]`` int64, padded with 0 (T = longest trajectory).
        features ``[B, T-1, K*H]`` target features of positions 0..T-2 (zeros past each row's end).
        last_hidden ``[B, T-1, H]`` final-normed target hidden states (teacher rows).
        num_tokens ``[B]`` int64: each row's real length T_b.
        anchors ``[B, N]`` int64; padding anchors repeat a valid anchor of the row (1 if it has none).
        anchor_valid ``[B, N]`` bool.
        target_ids ``[B, N, bs-1]`` int64: ``input_ids[anchor + k]`` for k = 1..bs-1 (clamped index).
        teacher_pos ``[B, N, bs-1]`` int64: ``anchor + k - 1``, the row of ``last_hidden`` (clamped).
        weights ``[B, N, bs-1]`` float32: ``exp(-(k-1)/7) * (anchor + k <= T_b - 1) * anchor_valid``.
        drafter_versions ``[B]`` int64: the version that generated each trajectory.
    """

    input_ids: torch.Tensor
    features: torch.Tensor
    last_hidden: torch.Tensor
    num_tokens: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    target_ids: torch.Tensor
    teacher_pos: torch.Tensor
    weights: torch.Tensor
    drafter_versions: torch.Tensor

    @property
    def num_blocks(self) -> int:
        """Number of valid (non-padding) blocks."""
        return int(self.anchor_valid.sum().item())

    def to(self, device: torch.device | str) -> "Batch":
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)})


#: with ``pad_multiple > 1``, :func:`recompute_features` rounds each forward's rows up to a multiple of this
RECOMPUTE_ROW_MULTIPLE = 8


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (>= 1)."""
    return -(-n // multiple) * multiple


def collate(trajectories: list[Trajectory], num_anchors: int, block_size: int,
            generator: torch.Generator | None = None, feature_dtype: torch.dtype = torch.float32,
            pad_tokens_multiple: int = 1, pad_anchors_multiple: int = 1, walk_anchor_fraction: float = 0.0) -> Batch:
    """Pad trajectories into a :class:`Batch` with freshly sampled anchors (:func:`sample_anchors`; with
    ``walk_anchor_fraction`` > 0 that share of them from each trajectory's serving walk, :func:`walk_anchors`).

    Tensors are built on the device of the first trajectory's features; features and last_hidden
    are cast to ``feature_dtype``. The token length ``T'`` is the longest trajectory's rounded up to a multiple of
    ``pad_tokens_multiple`` (features / last_hidden ``[B, T'-1, ...]``) and the anchor slots ``N`` per row the most
    any row sampled rounded up to a multiple of ``pad_anchors_multiple``; the extra positions are zeros no block
    sees and the extra slots are invalid anchors of weight 0, so the loss is unchanged (fewer distinct shapes).

    Raises:
        ValueError: empty list; a trajectory failing :meth:`Trajectory.validate`; missing features or
            last_hidden (set ``distill.features: recompute`` and use :func:`with_recomputed_features`);
            trajectories with different feature or hidden widths.
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    for tr in trajectories:
        tr.validate()
        if tr.features is None or tr.last_hidden is None:
            raise ValueError(f"trajectory {tr.request_id} has no captured features/last_hidden; "
                             "use distill.features=recompute")
    widths = {(tr.features.shape[1], tr.last_hidden.shape[1]) for tr in trajectories}
    if len(widths) != 1:
        raise ValueError(f"trajectories differ in feature / hidden widths: {sorted(widths)}")
    (feat_w, hid_w), = widths
    device = trajectories[0].features.device
    bsz, t_max = len(trajectories), round_up(max(tr.num_tokens for tr in trajectories), pad_tokens_multiple)
    input_ids = torch.zeros(bsz, t_max, dtype=torch.long, device=device)
    features = torch.zeros(bsz, t_max - 1, feat_w, dtype=feature_dtype, device=device)
    last_hidden = torch.zeros(bsz, t_max - 1, hid_w, dtype=feature_dtype, device=device)
    rows = []
    for b, tr in enumerate(trajectories):
        t = tr.num_tokens
        input_ids[b, :t] = tr.token_ids.to(device)
        features[b, : t - 1] = tr.features.to(device=device, dtype=feature_dtype)
        last_hidden[b, : t - 1] = tr.last_hidden.to(device=device, dtype=feature_dtype)
        walk = walk_anchors(tr) if walk_anchor_fraction > 0 else None
        rows.append(sample_anchors(tr.prompt_len, t, num_anchors, block_size, generator, walk, walk_anchor_fraction))
    n = round_up(max(1, max(len(r) for r in rows)), pad_anchors_multiple)
    anchors = torch.ones(bsz, n, dtype=torch.long)
    anchor_valid = torch.zeros(bsz, n, dtype=torch.bool)
    for b, r in enumerate(rows):
        if len(r):
            anchors[b] = r[0]
            anchors[b, : len(r)] = r
            anchor_valid[b, : len(r)] = True
    anchors, anchor_valid = anchors.to(device), anchor_valid.to(device)
    num_tokens = torch.tensor([tr.num_tokens for tr in trajectories], dtype=torch.long, device=device)
    k = torch.arange(1, block_size, device=device)  # [bs-1]
    label_pos = anchors[:, :, None] + k  # [B, N, bs-1]
    in_seq = label_pos <= (num_tokens[:, None, None] - 1)
    decay = torch.exp(-(k - 1).float() / LOSS_DECAY_GAMMA)  # [bs-1]
    weights = decay * in_seq.float() * anchor_valid[:, :, None].float()
    target_ids = input_ids.gather(1, label_pos.clamp(max=t_max - 1).reshape(bsz, -1)).reshape(label_pos.shape)
    teacher_pos = (label_pos - 1).clamp(max=t_max - 2)
    versions = torch.tensor([tr.drafter_version for tr in trajectories], dtype=torch.long, device=device)
    return Batch(input_ids=input_ids, features=features, last_hidden=last_hidden, num_tokens=num_tokens,
                 anchors=anchors, anchor_valid=anchor_valid, target_ids=target_ids, teacher_pos=teacher_pos,
                 weights=weights, drafter_versions=versions)


@torch.no_grad()
def causal_features(target, input_ids: torch.Tensor, layer_ids: list[int],
                    fused: bool = False, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features and final hidden states of ``input_ids`` ``[B, W]`` (positions ``0..W-1``, causal
    attention inside each row): what ``target(input_ids, positions, capture_layer_ids=layer_ids,
    compute_logits=False)`` returns, computed with SDPA's ``is_causal`` path (flash attention on CUDA) instead of
    an explicit ``[B, 1, W*rep, W]`` mask tensor, with the target's own modules.

    Args:
        target: a :class:`~adaflash_ray.models.target.TargetModel`.
        input_ids: ``[B, W]`` int64 on the target's device (W >= 1).
        layer_ids: decoder layers whose outputs are captured (any order, repeats allowed), each in ``[0, L)``.
        fused: the Triton kernels of the engine's cached forward: each residual add fused into the next RMSNorm
            (:func:`adaflash_ray.kernels.fused_norm.add_rmsnorm`), qk-norm + rotary in one pass over the fused q/k/v
            GEMM's output (:func:`adaflash_ray.kernels.rotary_cache.rotary_qkv_cache`, its "cache" a ``[B, W, Hkv,
            D]`` buffer per layer), the SwiGLU product in one kernel
            (:meth:`~adaflash_ray.models.layers.SwiGLU.forward_fused`); needs fused projections
            (``AttentionProjections.fuse``, ``SwiGLU.fuse``) and a device Triton launches on. The kernels are
            launched from Python, 3-4 per layer: they pay when a forward holds many tokens (the packed recompute of
            :func:`recompute_features`), not at a few hundred.
        compiled: each layer's work around the attention as two ``torch.compile(dynamic=True)`` graphs (input norm,
            q/k/v GEMMs, qk-norm, rotary and the GQA repeat of K/V; o_proj, residual adds, post norm and SwiGLU),
            the same graphs for every layer and token count (the weights are graph inputs; Dynamo specialises on
            one row against several, so a few compilations in all); the attention stays eager. The values are the
            eager ones up to floating-point reassociation inside the fused kernels.
    Returns:
        ``(features [B, W, len(layer_ids)*H], last_hidden [B, W, H])`` in the target's dtype.
    Raises:
        ValueError: a layer id outside ``[0, L)``; ``fused`` and ``compiled`` both set.
    """
    b, w = input_ids.shape
    pos = torch.arange(w, device=input_ids.device)[None].expand(b, w).contiguous()

    def attend(q, k, v):  # [B, W, Hq | Hkv, D] -> [B, W, Hq*D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, w, -1)

    return _causal_stack(target, input_ids, pos, layer_ids, attend, fused, compiled)


def _layer_pre(x, ln_w, ln_eps: float, wq, bq, wk, bk, wv, bv, qn_w, kn_w, qk_eps: float, cos, sin,
               hq: int, hkv: int, d: int):
    """One decoder layer up to its attention, on plain tensors: input RMSNorm, q/k/v GEMMs (+ bias), qk RMSNorm
    (Qwen3; ``qn_w`` None = none), rotary; K/V repeated to the query heads. ``x`` ``[B, W, H]`` -> q ``[B, W, Hq,
    D]``, k, v ``[B, W, Hq, D]`` (contiguous, the layout variable-length flash attention takes)."""
    from adaflash_ray.models.layers import apply_rotary, rms_norm

    b, w = x.shape[0], x.shape[1]
    h = rms_norm(x, ln_w, ln_eps)
    q = F.linear(h, wq, bq).view(b, w, hq, d)
    k = F.linear(h, wk, bk).view(b, w, hkv, d)
    v = F.linear(h, wv, bv).view(b, w, hkv, d)
    if qn_w is not None:
        q, k = rms_norm(q, qn_w, qk_eps), rms_norm(k, kn_w, qk_eps)
    qk = apply_rotary(torch.cat([q, k], dim=2), cos, sin)
    q, k = qk[:, :, :hq], qk[:, :, hq:]
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, dim=2), v.repeat_interleave(hq // hkv, dim=2)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _layer_post(x, a, wo, ln_w, ln_eps: float, wg, wu, wd):
    """The rest of one decoder layer on plain tensors: ``x + o_proj(a)``, then ``+ SwiGLU(RMSNorm(.))``.
    ``x`` ``[B, W, H]``, ``a`` ``[B, W, Hq*D]`` (the attention output) -> ``[B, W, H]``."""
    from adaflash_ray.models.layers import rms_norm

    x = x + F.linear(a, wo)
    h = rms_norm(x, ln_w, ln_eps)
    return x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


@functools.lru_cache(maxsize=1)
def _compiled_layer_fns():
    """``(pre, post)``: :func:`_layer_pre` and :func:`_layer_post` through ``torch.compile(dynamic=True)``, built
    once per process (the weights are inputs, so every layer and token count shares a compilation; one packed row
    and several padded rows compile apart)."""
    return torch.compile(_layer_pre, dynamic=True), torch.compile(_layer_post, dynamic=True)


def _compiled_stack(target, input_ids: torch.Tensor, pos: torch.Tensor, layer_ids: list[int], attend):
    """:func:`_causal_stack` with :func:`_compiled_layer_fns` around ``attend`` (which takes K/V already repeated
    to the query heads here)."""
    m = target.model
    pre, post = _compiled_layer_fns()
    x = m.embed_tokens(input_ids)
    cos, sin = target.rotary.cos_sin(pos)
    want = set(layer_ids)
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qn = None if attn.q_norm is None else attn.q_norm.weight
        kn = None if attn.k_norm is None else attn.k_norm.weight
        q, k, v = pre(x, layer.input_layernorm.weight, layer.input_layernorm.eps, attn.q_proj.weight,
                      attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias,
                      qn, kn, 0.0 if attn.q_norm is None else attn.q_norm.eps, cos, sin,
                      attn.num_heads, attn.num_kv_heads, attn.head_dim)
        ln = layer.post_attention_layernorm
        x = post(x, attend(q, k, v), attn.o_proj.weight, ln.weight, ln.eps, mlp.gate_proj.weight,
                 mlp.up_proj.weight, mlp.down_proj.weight)
        if i in want:
            captured[i] = x
    return torch.cat([captured[i] for i in layer_ids], dim=-1), m.norm(x)


def _causal_stack(target, input_ids: torch.Tensor, pos: torch.Tensor, layer_ids: list[int], attend,
                  fused: bool, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's decoder stack over ``input_ids`` ``[B, W]`` at rotary positions ``pos`` ``[B, W]``, with
    ``attend(q [B, W, Hq, D], k [B, W, Hkv, D], v) -> [B, W, Hq*D]`` as the attention (which decides which
    positions see which; it must also take K/V already repeated to ``Hq`` heads); ``fused`` and ``compiled`` as in
    :func:`causal_features`. Returns ``(features, last_hidden)`` as there."""
    m = target.model
    n_layers = len(m.layers)
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layer ids {bad} outside [0, {n_layers})")
    if fused and compiled:
        raise ValueError("fused (the Triton kernels) and compiled (torch.compile) are two ways to the same forward: "
                         "choose one")
    if compiled:
        return _compiled_stack(target, input_ids, pos, layer_ids, attend)
    b, w = input_ids.shape
    x = m.embed_tokens(input_ids)  # [B, W, H]
    if fused:
        from adaflash_ray.kernels.fused_norm import add_rmsnorm
        from adaflash_ray.kernels.rotary_cache import rotary_qkv_cache

        rows = torch.arange(b, device=x.device)
        slots = torch.arange(w, device=x.device)[None].expand(b, w).contiguous()  # the K/V buffer's write index
    cos, sin = target.rotary.cos_sin(pos)
    want = set(layer_ids)
    captured: dict[int, torch.Tensor] = {}
    delta = None  # fused: the last branch output, not yet added to x
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        if fused:
            ln = layer.input_layernorm
            x, h = add_rmsnorm(x, delta, ln.weight, ln.eps)
            if i - 1 in want:
                captured[i - 1] = x
        else:
            h = layer.input_layernorm(x)
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        if fused:
            k = torch.empty(b, w, hkv, d, dtype=x.dtype, device=x.device)
            v = torch.empty_like(k)
            qn = None if attn.q_norm is None else attn.q_norm.weight
            kn = None if attn.k_norm is None else attn.k_norm.weight
            eps = 0.0 if attn.q_norm is None else attn.q_norm.eps
            qg = rotary_qkv_cache(F.linear(h, attn._qkv_w, attn._qkv_b), cos, sin, qn, kn, eps, k, v, rows, slots,
                                  hq, hkv)  # [B, Hkv, W*rep, D]: row t*rep + r is head g*rep + r at position t
            q = qg.view(b, hkv, w, hq // hkv, d).permute(0, 2, 1, 3, 4).reshape(b, w, hq, d)
        else:
            q, k, v = attn.qkv(h, cos, sin)  # [B, W, Hq | Hkv, D]
        a = attn.o_proj(attend(q, k, v))
        if fused:
            ln = layer.post_attention_layernorm
            x, h = add_rmsnorm(x, a, ln.weight, ln.eps)
            delta = layer.mlp.forward_fused(h)
        else:
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in want:
                captured[i] = x
    if fused:
        x, last = add_rmsnorm(x, delta, m.norm.weight, m.norm.eps)
        if len(m.layers) - 1 in want:
            captured[len(m.layers) - 1] = x
    else:
        last = m.norm(x)
    return torch.cat([captured[i] for i in layer_ids], dim=-1), last


@functools.lru_cache(maxsize=1)
def _varlen_fn():
    """PyTorch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``) and the keyword that
    makes it causal in the installed version (``is_causal=True`` in its first releases, ``window_size=(-1, 0)``
    later), or None where it is missing."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}
    return None


@torch.no_grad()
def packed_causal_features(target, token_ids: torch.Tensor, seq_lens: list[int], layer_ids: list[int],
                           fused: bool = False, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and last hidden states of several sequences packed end to end in one row, no padding: causal
    attention inside each sequence, none across them, every sequence's rotary positions from 0.

    On CUDA in bf16 / fp16 with head dims <= 256 the attention is PyTorch's variable-length flash attention
    (``torch.nn.attention.varlen.varlen_attn``, cumulative sequence offsets; Dao 2023, FlashAttention-2's varlen
    interface) with the key/value heads repeated to the query heads; otherwise (float32, CPU, a PyTorch without it)
    SDPA ``is_causal`` over each sequence in turn. Every other op runs once over all the tokens.

    Args:
        target: a :class:`~adaflash_ray.models.target.TargetModel`.
        token_ids: ``[S]`` int64 on the target's device, ``S = sum(seq_lens)``.
        seq_lens: each sequence's length (>= 1), in packing order.
        layer_ids: as :func:`causal_features`.
        fused, compiled: as :func:`causal_features`.
    Returns:
        ``(features [S, len(layer_ids)*H], last_hidden [S, H])`` in the target's dtype, sequences in packing order.
    Raises:
        ValueError: ``seq_lens`` empty, holding a length < 1, or not summing to ``S``; a layer id outside ``[0, L)``;
            ``fused`` and ``compiled`` both set.
    """
    s = int(token_ids.shape[0])
    if not seq_lens or min(seq_lens) < 1 or sum(seq_lens) != s:
        raise ValueError(f"seq_lens must be >= 1 each and sum to {s} tokens, got {list(seq_lens)[:8]}...")
    device = token_ids.device
    lens = torch.tensor(seq_lens, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    pos = (torch.arange(s) - torch.repeat_interleave(starts, lens)).to(device)[None]  # [1, S]
    attn0 = target.model.layers[0].self_attn
    flash_ok = device.type == "cuda" and target.lm_head.weight.dtype in (torch.float16, torch.bfloat16) and \
        attn0.head_dim <= 256  # flash attention's dtypes and head sizes
    varlen = _varlen_fn() if flash_ok else None
    if varlen is not None:
        fn, causal_kw = varlen
        cu = torch.cat([starts, lens.sum().reshape(1)]).to(device=device, dtype=torch.int32)
        max_len = int(lens.max())

    def attend(q, k, v):  # [1, S, Hq | Hkv, D] -> [1, S, Hq*D]
        rep = q.shape[2] // k.shape[2]
        q, k, v = q[0], k[0], v[0]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if varlen is not None:
            out = fn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **causal_kw)
            return out.reshape(1, s, -1)
        parts, at = [], 0
        for n in seq_lens:  # [1, H, n, D] each
            qs, ks, vs = (t[at:at + n].transpose(0, 1)[None] for t in (q, k, v))
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
            at += n
        return torch.cat(parts).reshape(1, s, -1)

    feats, last = _causal_stack(target, token_ids[None], pos, layer_ids, attend, fused, compiled)
    return feats[0], last[0]


@torch.no_grad()
def recompute_features(target, token_ids_list: list[torch.Tensor], layer_ids: list[int],
                       max_batch_tokens: int = 32768, pad_multiple: int = 1, layout: str = "padded",
                       fused: bool = False, compiled: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the frozen target over each sequence (``features: recompute``, docs/design/ALGORITHMS.md §3).

    ``layout="padded"``: sequences are right-padded and run together, up to ``max_batch_tokens`` padded positions
    per forward (a trainer GPU does a batch of 32 x 512 tokens in one pass instead of 32 passes). Attention is
    causal, so the padding after a row's end never reaches that row's own positions: the result equals one
    forward per sequence (tests/test_distill.py checks it). On CUDA the forward is :func:`causal_features`
    (SDPA's causal fast path, no mask tensor, the target's torch modules); elsewhere the target's own forward.

    ``layout="packed"``: sequences are laid end to end, up to ``max_batch_tokens`` tokens per forward, with no
    padding (:func:`packed_causal_features`: variable-length flash attention on CUDA): a batch of mixed lengths
    costs its real tokens only. ``pad_multiple`` > 1 rounds each forward's token count up with one extra padding
    sequence (fewer distinct shapes; a forward then holds up to ``pad_multiple - 1`` tokens over ``max_batch_tokens``).

    Args:
        target: a :class:`~adaflash_ray.models.target.TargetModel`.
        token_ids_list: ``[T_b]`` int64 sequences (T_b >= 2).
        layer_ids: the drafter's ``target_layer_ids``.
        max_batch_tokens: bound on ``rows x padded length`` (padded) or tokens (packed) of one forward (activation
            memory); a packed sequence longer than it runs alone.
        pad_multiple: padded: each forward's padded length rounded up to a multiple of this and, when > 1, its rows
            to a multiple of :data:`RECOMPUTE_ROW_MULTIPLE` with all-padding rows (fewer distinct shapes; causal
            attention keeps the extra positions out of every real one, and rows never mix). Packed: as above.
        layout: ``"padded"`` or ``"packed"``.
        fused: the Triton kernels of :func:`causal_features` (CUDA only; needs fused projections).
        compiled: the ``torch.compile`` graphs of :func:`causal_features` (the CUDA and packed paths; the padded
            CPU path runs the target's own forward). Not with ``fused``.
    Returns:
        Per sequence ``(features [T_b-1, K*H], last_hidden [T_b-1, H])`` in the target's dtype, on its
        device: positions 0..T_b-2, exactly the layout the engine captures (the last token is never fed).
    Raises:
        ValueError: a sequence shorter than 2 tokens; an unknown ``layout``.
    """
    if layout not in ("padded", "packed"):
        raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")
    device = target.lm_head.weight.device
    for ids in token_ids_list:
        if ids.shape[0] < 2:
            raise ValueError(f"need >= 2 tokens to recompute features, got {ids.shape[0]}")
    out: list = [None] * len(token_ids_list)
    if layout == "packed":
        start = 0
        while start < len(token_ids_list):
            group, total = [], 0
            while start < len(token_ids_list) and (not group or
                                                   total + token_ids_list[start].shape[0] - 1 <= max_batch_tokens):
                group.append(start)
                total += token_ids_list[start].shape[0] - 1
                start += 1
            lens = [token_ids_list[i].shape[0] - 1 for i in group]
            pieces = [token_ids_list[i][:-1] for i in group]
            extra = round_up(total, pad_multiple) - total
            if extra:
                pieces.append(torch.zeros(extra, dtype=torch.long))
                lens.append(extra)
            ids = torch.cat([p.cpu() for p in pieces]).to(device, non_blocking=True)  # one host-to-device copy
            feats, last = packed_causal_features(target, ids, lens, list(layer_ids), fused=fused, compiled=compiled)
            at = 0
            for i, n in zip(group, lens):
                out[i] = (feats[at:at + n], last[at:at + n])
                at += n
        return out
    order = sorted(range(len(token_ids_list)), key=lambda i: -token_ids_list[i].shape[0])  # longest first
    start = 0
    while start < len(order):
        t_max = round_up(token_ids_list[order[start]].shape[0] - 1, pad_multiple)
        rows = max(1, min(len(order) - start, max_batch_tokens // max(t_max, 1)))
        group = order[start:start + rows]
        width = len(group) if pad_multiple == 1 else round_up(len(group), RECOMPUTE_ROW_MULTIPLE)  # + zero rows
        inp = torch.zeros(width, t_max, dtype=torch.long)
        for r, i in enumerate(group):
            ids = token_ids_list[i]
            inp[r, : ids.shape[0] - 1] = ids[:-1]
        inp = inp.to(device, non_blocking=True)  # one host-to-device copy
        if device.type == "cuda":
            feats, last = causal_features(target, inp, list(layer_ids), fused=fused, compiled=compiled)
        else:
            pos = torch.arange(t_max, device=device)[None].expand(width, -1)
            res = target(inp, pos, capture_layer_ids=list(layer_ids), compute_logits=False)
            feats, last = res.features, res.last_hidden
        for r, i in enumerate(group):
            n = token_ids_list[i].shape[0] - 1
            out[i] = (feats[r, :n], last[r, :n])
        start += rows
    return out


def with_recomputed_features(target, trajectories: list[Trajectory], layer_ids: list[int],
                             pad_multiple: int = 1, layout: str = "padded", fused: bool = False,
                             compiled: bool = False) -> list[Trajectory]:
    """Copies of ``trajectories`` whose features / last_hidden come from :func:`recompute_features`."""
    feats = recompute_features(target, [tr.token_ids for tr in trajectories], layer_ids, pad_multiple=pad_multiple,
                               layout=layout, fused=fused, compiled=compiled)
    return [dataclasses.replace(tr, features=f, last_hidden=h) for tr, (f, h) in zip(trajectories, feats)]


__all__ = ["Batch", "LOSS_DECAY_GAMMA", "RECOMPUTE_ROW_MULTIPLE", "causal_features", "collate",
           "packed_causal_features", "recompute_features", "round_up", "sample_anchors", "walk_anchors",
           "with_recomputed_features"]
