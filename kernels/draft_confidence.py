"""The draft confidence features of the ``cost`` policy's acceptance head in one pass over the vocabulary.

For each row of drafter logits ``z`` (one block position of one request) the head reads the maximum probability and
the entropy (nats) of ``softmax(z)`` (:func:`adaflash_ray.models.length_head.draft_confidence`). The reference
computes them with a logsumexp, a max, a softmax and a dot product: about eight passes over ``[rows, V]`` float32 and
one ``[rows, V]`` temporary (at batch 64, block 16 and SmolLM2's 49,152-word vocabulary, 960 rows of 189 MB). With
``m = max z``, ``S = Σ exp(z - m)`` and ``T = Σ exp(z - m) (z - m)``: ``logsumexp = m + log S``, the maximum probability
is ``exp(m - logsumexp) = 1 / S`` and the entropy ``logsumexp - Σ p z = log S - T / S``, so one read of the row with a
running maximum (the online softmax of Milakov & Gimelshein 2018, "Online normalizer calculation for softmax") gives
both.

:func:`draft_confidence_ref` is the pure-torch reference; :func:`draft_confidence_fused` the Triton kernel.
"""
from __future__ import annotations

import torch

from adaflash_ray.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["draft_confidence_fused", "draft_confidence_ref"]


def draft_confidence_ref(draft_logits: torch.Tensor) -> torch.Tensor:
    """Reference: ``[..., V]`` logits (any float dtype) -> ``[..., 2]`` float32 (max probability, entropy in nats) of
    ``softmax(draft_logits.float())``."""
    z = draft_logits.float()
    lse = torch.logsumexp(z, dim=-1)
    maxp = (z.max(dim=-1).values - lse).exp()
    # H = lse - Σ_v p_v z_v, the sum as a batched dot product (no [.., V] product tensor)
    entropy = lse - torch.einsum("...v,...v->...", torch.softmax(z, dim=-1), z)
    return torch.stack([maxp, entropy], dim=-1)


if HAVE_TRITON:
    # one compiled variant for every number of rows (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit(do_not_specialize=["vocab", "stride_row"])
    def _confidence_kernel(x_ptr, out_ptr, vocab, stride_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_row
        lanes = tl.arange(0, BLOCK)
        # per lane: running max m, s = Σ exp(z - m), t = Σ exp(z - m) (z - m) - relative to m, so the entropy never
        # subtracts two large numbers; a finite floor for m, not -inf: no inf - inf
        m = tl.full([BLOCK], -3.0e38, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            ok = cols < vocab
            z = tl.load(base + cols, mask=ok, other=-3.0e38).to(tl.float32)
            m_new = tl.maximum(m, z)
            scale = tl.exp(m - m_new)
            e = tl.where(ok, tl.exp(z - m_new), 0.0)
            t = scale * (t + s * (m - m_new)) + tl.where(e > 0.0, e * (z - m_new), 0.0)
            s = s * scale + e
            m = m_new
        mx = tl.max(m, axis=0)
        w = tl.exp(m - mx)
        big_s = tl.sum(s * w, axis=0)
        big_t = tl.sum(w * (t + s * (m - mx)), axis=0)  # Σ exp(z - mx) (z - mx)
        tl.store(out_ptr + row * 2, 1.0 / big_s)
        tl.store(out_ptr + row * 2 + 1, tl.log(big_s) - big_t / big_s)  # lse - Σ p z, both less mx


def draft_confidence_fused(draft_logits: torch.Tensor) -> torch.Tensor:
    """:func:`draft_confidence_ref` in one Triton kernel: one program per row reads the row once.

    Args:
        draft_logits: ``[..., V]`` float32 / bfloat16 / float16 (last dim contiguous; other layouts are copied).
    Returns:
        ``[..., 2]`` float32 (max probability, entropy in nats); no host synchronisation, CUDA-graph capturable
        once compiled (its first call).
    Raises:
        RuntimeError: Triton is not installed. ValueError: an empty vocabulary dimension.
    """
    if not HAVE_TRITON:
        raise RuntimeError("draft_confidence_fused needs triton (use draft_confidence_ref)")
    vocab = draft_logits.shape[-1]
    if vocab == 0:
        raise ValueError("draft_confidence_fused: empty vocabulary dimension")
    x2 = draft_logits.reshape(-1, vocab)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*draft_logits.shape[:-1], 2), dtype=torch.float32, device=draft_logits.device)
    rows = x2.shape[0]
    if rows:
        _confidence_kernel[(rows,)](x2, out.view(-1, 2), vocab, x2.stride(0),
                                    BLOCK=min(2048, triton.next_power_of_2(vocab)), num_warps=8)
    return out
