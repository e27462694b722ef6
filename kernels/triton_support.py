"""Whether the Triton kernels of this package can run, and the one switch that turns them off.

Triton is optional (never a dependency of the project): without it every caller uses the pure-torch reference.
``ADAFLASH_FUSED_KERNELS=off`` (or ``0`` / ``false``) in the environment disables the fused kernels even where
Triton and CUDA are present (A/B timings without a code change); ``auto`` / unset leaves the choice to the caller.

CUDA graphs: a Triton kernel compiles (and loads its module, which a stream capture forbids) the first time it
meets a new specialisation of its arguments; by default Triton specialises integer arguments equal to 1 or
divisible by 16. The kernels here mark every integer argument ``do_not_specialize``, so one compiled variant
per model serves every batch size and verify width, and the first eager call (the engine's prefill or first
step) compiles it before any capture.
"""
from __future__ import annotations

import os

try:  # optional: the GPU image carries it; CPU machines may not
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    HAVE_TRITON = True
except Exception:  # pragma: no cover - absent, or an install that fails to import: the torch path only
    triton = None
    tl = None
    HAVE_TRITON = False

ENV_VAR = "ADAFLASH_FUSED_KERNELS"
_OFF = ("off", "0", "false", "no")
_ON = ("auto", "on", "1", "true", "yes", "")


def env_mode() -> str | None:
    """``"off"``, ``"auto"`` or None (unset) from ``ADAFLASH_FUSED_KERNELS``. Raises ValueError on another value."""
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return None
    v = raw.strip().lower()
    if v in _OFF:
        return "off"
    if v in _ON:
        return "auto"
    raise ValueError(f"{ENV_VAR}={raw!r}: expected auto or off")


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``): kernels then accept CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device) -> bool:
    """True when Triton imports and can launch on ``device`` (a CUDA device, or any device under the interpreter)."""
    import torch

    dev = torch.device(device)
    return HAVE_TRITON and (dev.type == "cuda" or interpreting())


_COUNTERS: dict = {}
#: the buffers replaced by larger ones: kept, since a CUDA graph captured earlier holds their address
_RETIRED: list = []


def ticket_counters(device, n: int):
    """The per-device int32 ticket counters (at least ``n``, all 0 between launches) of the kernels whose last
    program to finish does a final step (the merge of split-K attention partials, a row norm after a GEMV): each
    launch takes one counter per group, and that group's last program resets it to 0. Launches that use them must
    not overlap (one stream). Grown (doubling) only outside a CUDA-graph capture, the smaller buffer kept alive
    (graphs captured before hold its address); a capture that needs more than exist gets a zeroed buffer of its
    own (a memset in the graph: correct, one node dearer)."""
    import torch

    device = torch.device(device)
    have = _COUNTERS.get(device)
    if have is not None and have.numel() >= n:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    size = max(n, 2 * (have.numel() if have is not None else 512))
    if have is not None:
        _RETIRED.append(have)
    _COUNTERS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTERS[device]
