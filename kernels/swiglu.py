"""SwiGLU product on the output of the fused gate/up GEMM (one kernel instead of a chunk, a SiLU and a product).

The MLP of Llama / Qwen (Shazeer 2020, "GLU Variants Improve Transformer") computes ``silu(g) * u`` where
``[g | u] = x @ [W_gate; W_up]^T`` is one GEMM output of width ``2I`` (gate first, then up: the layout of
``SwiGLU.fuse`` in adaflash_ray/models/layers.py). Numerics follow the reference: ``silu`` in float32
(``g / (1 + exp(-g))``) rounded to the input dtype, as torch's ``F.silu`` on bf16 returns, then the product in
float32 rounded once.

:func:`swiglu_ref` is the pure-torch reference; :func:`swiglu` the Triton kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adaflash_ray.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["swiglu", "swiglu_ref"]


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference: ``gate, up = gate_up.chunk(2, -1)``; ``F.silu(gate) * up``. ``[..., 2I]`` -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAVE_TRITON:
    # one compiled variant for every batch size and width (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit(do_not_specialize=["inter", "stride_gu", "stride_out"])
    def _swiglu_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like F.silu's output
        tl.store(out_ptr + row * stride_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused :func:`swiglu_ref`.

    Args:
        gate_up: ``[..., 2I]`` (last dim contiguous), gate in the first half, up in the second.
    Returns:
        ``[..., I]`` in gate_up's dtype (a new tensor; no host synchronisation, CUDA-graph capturable).
    Raises:
        RuntimeError: Triton is not installed. ValueError: odd last dimension.
    """
    if not HAVE_TRITON:
        raise RuntimeError("swiglu needs triton (use swiglu_ref)")
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"swiglu: last dimension {two_i} is odd")
    inter = two_i // 2
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    m = x2.shape[0]
    if m == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _swiglu_kernel[(m, triton.cdiv(inter, block))](x2, out.view(-1, inter), inter, x2.stride(0), inter,
                                                   BLOCK=block, num_warps=4)
    return out
