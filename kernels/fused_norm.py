"""RMSNorm fused with the residual add of a pre-norm decoder layer (one kernel instead of two).

A pre-norm layer computes ``x = x + delta`` then ``h = rmsnorm(x) * w``; :func:`add_rmsnorm` does both in one
pass over each row (read ``x`` and ``delta`` once, write the new residual and the normed output), the
"fused add RMSNorm" of vLLM / FlashInfer / Liger-Kernel. Numerics follow the reference exactly: the sum is
rounded to the residual dtype first (as ``x + delta`` in bf16 is), and the norm of that rounded residual is
taken in float32 (Zhang & Sennrich 2019, as ``torch.nn.functional.rms_norm`` computes it for a weight of the
input's dtype): ``y = x * rsqrt(mean(x^2) + eps) * w``, rounded once to the output dtype.

:func:`add_rmsnorm_ref` is the pure-torch reference (what adaflash_ray/models/layers.py ``RMSNorm`` computes on
``x + delta``); :func:`add_rmsnorm` is the Triton kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adaflash_ray.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["add_rmsnorm", "add_rmsnorm_ref"]


def add_rmsnorm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``r = x + delta`` (or ``x`` when ``delta`` is None), ``h = F.rms_norm(r, [N], weight, eps)``.

    Args: x, delta ``[..., N]`` (same dtype and shape); weight ``[N]`` in x's dtype.
    Returns ``(r, h)``, both ``[..., N]`` in x's dtype.
    """
    r = x if delta is None else x + delta
    return r, F.rms_norm(r, r.shape[-1:], weight, eps)


if HAVE_TRITON:
    # one compiled variant for every batch size (CUDA graphs: see adaflash_ray/kernels/triton_support.py)
    @triton.jit(do_not_specialize=["stride_x", "stride_d", "stride_r", "stride_y", "n"])
    def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, r_ptr, y_ptr, stride_x, stride_d, stride_r, stride_y, n, eps,
                            HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(r_ptr.dtype.element_ty)  # rounded like x + delta
            tl.store(r_ptr + row * stride_r + cols, x, mask=m)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=m)


def residual_rows(x: torch.Tensor, delta: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row views a residual add + norm kernel reads and writes: ``(x2, d2, r, r2)`` - ``x`` as ``[M, N]`` rows
    with unit stride, ``delta`` the same (``x2`` when delta is None), the new residual ``r`` in x's shape (``x``
    itself when delta is None, else a fresh tensor) and its ``[M, N]`` view. ``delta`` must have x's shape."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if delta is None:
        return x2, x2, x, x2
    d2 = delta.reshape(-1, n)
    if d2.stride(-1) != 1:
        d2 = d2.contiguous()
    r = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return x2, d2, r, r.view(-1, n)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`add_rmsnorm_ref`: one Triton launch, one program per row.

    Args:
        x, delta: ``[..., N]`` residual stream and the branch output to add (None: norm only); same dtype/shape.
        weight: ``[N]`` norm weight (any float dtype; math in float32).
        eps: variance epsilon.
        out: optional ``[..., N]`` buffer for the normed output.
    Returns:
        ``(r, h)`` ``[..., N]`` in x's dtype: the new residual (``x`` itself when delta is None) and the normed
        rows. No host synchronisation, allocations only of the outputs (CUDA-graph capturable).
    Raises:
        RuntimeError: Triton is not installed.
        ValueError: mismatched shapes.
    """
    if not HAVE_TRITON:
        raise RuntimeError("add_rmsnorm needs triton (use add_rmsnorm_ref)")
    n = x.shape[-1]
    if weight.shape != (n,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"add_rmsnorm: x {tuple(x.shape)}, delta {None if delta is None else tuple(delta.shape)}, "
                         f"weight {tuple(weight.shape)}")
    x2, d2, r, r2 = residual_rows(x, delta)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    y2 = y.view(-1, n)
    if m == 0:
        return r, y
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _add_rmsnorm_kernel[(m,)](x2, d2, weight, r2, y2, x2.stride(0), d2.stride(0), r2.stride(0), y2.stride(0), n,
                              float(eps), HAS_DELTA=delta is not None, BLOCK=block, num_warps=warps)
    return r, y
