"""The pure-torch math that the fused kernels of this package replace on CUDA, defined once: the model layers
(adaflash_ray/models/layers.py re-exports these) and the kernels' references both use it. Imports only torch
(never triton), so the CPU path does not load Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["apply_rotary", "fold_queries", "folded_attention", "gqa_mask"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, heads, D]`` by ``cos``/``sin`` ``[B, T, D]`` (float32 math), the
    half-split ``rotate_half`` layout of Hugging Face Llama/Qwen."""
    dtype = x.dtype
    x32 = x.float()
    half = x32.shape[-1] // 2
    rot = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    out = x32 * cos[:, :, None, :] + rot * sin[:, :, None, :]
    return out.to(dtype)


def fold_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, W, Hq, D]`` -> ``[B, Hkv, W*rep, D]`` (contiguous), the layout of ``grouped_attention``'s SDPA call."""
    b, w, hq, d = q.shape
    rep = hq // num_kv_heads
    return q.view(b, w, num_kv_heads, rep, d).permute(0, 2, 1, 3, 4).reshape(b, num_kv_heads, w * rep, d)


def gqa_mask(visible: torch.Tensor, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Expand a visibility mask ``[B, Tq, Tk]`` (bool) to the grouped-query layout of
    :func:`adaflash_ray.models.layers.grouped_attention`: an additive mask ``[B, 1, Tq*num_groups, Tk]`` in
    ``dtype`` (0 where visible, -inf elsewhere; query-position major, group minor). Built once per forward and
    shared by every layer, so SDPA does not convert a bool mask in each layer."""
    b, tq, tk = visible.shape
    vis = visible[:, None, :, None, :].expand(b, 1, tq, num_groups, tk).reshape(b, 1, tq * num_groups, tk)
    return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill_(~vis, float("-inf"))


def folded_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, tq: int) -> torch.Tensor:
    """The SDPA call of :func:`adaflash_ray.models.layers.grouped_attention` on queries already folded to
    ``[B, Hkv, Tq*rep, D]`` (row ``t*rep + r`` is query head ``g*rep + r`` at position t; the fused rotary kernel
    writes this layout directly).

    Args: k, v ``[B, Tk, Hkv, D]`` (may be strided cache views); mask ``[B, 1, Tq*rep, Tk]`` from :func:`gqa_mask`.
    Returns ``[B, Tq, Hq*D]`` in qg's dtype (a view, no copy, when ``Tq == 1``).
    """
    b, hkv, rows, d = qg.shape
    rep = rows // tq
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.view(b, hkv, tq, rep, d).permute(0, 2, 1, 3, 4).reshape(b, tq, hkv * rep * d)
