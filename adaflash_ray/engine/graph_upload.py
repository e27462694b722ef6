"""Upload a captured CUDA graph to the device ahead of its first launch.

PyTorch instantiates a captured graph (``cudaGraphInstantiateWithFlags`` in ``CUDAGraph::capture_end``) but does
not upload it, so the graph's first ``cudaGraphLaunch`` also uploads its nodes: for an engine step of several hundred
kernels that first replay takes a large fraction of a millisecond of host time more than the later ones. An engine
with hundreds of precaptured step shapes (every batch bucket x width bucket x span) meets many shapes for the first
time inside timed steps. ``cudaGraphUpload`` (CUDA runtime API, "Graph Execution") does that work at capture time
instead, without running the graph: nothing in the KV cache or the drafter context changes.

PyTorch exposes the executable graph (``torch.cuda.CUDAGraph.raw_cuda_graph_exec``, an int handle) but no upload;
the runtime function is called through :mod:`ctypes` on the CUDA runtime library this process already loaded (the
one PyTorch links, found in ``/proc/self/maps``), so the handle and the stream belong to the same runtime. Where that
library or the handle is not available (a static runtime, an older PyTorch, no CUDA) nothing is uploaded and the first
launch uploads, as before. ``ADAFLASH_GRAPH_UPLOAD=0`` in the environment turns the upload off (an A/B of its
effect on the same machine).
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch

__all__ = ["cudart_paths", "upload_graph"]


def cudart_paths(maps_text: str, cuda_version: str | None = None) -> list[str]:
    """The CUDA runtime libraries (``libcudart.so*``) mapped in a process, from the text of its ``/proc/<pid>/maps``:
    absolute paths (spaces kept: the path is the line's sixth field to its end), each once; a mapping whose file was
    deleted (`` (deleted)``: the path no longer names the mapped library) is left out. Sorted, those of the CUDA major
    version ``cuda_version`` names (e.g. ``torch.version.cuda``, ``"12.8"``: ``libcudart.so.12*``) first."""
    out = set()
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
            continue
        path = parts[5].rstrip()
        if os.path.basename(path).startswith("libcudart.so"):
            out.add(path)
    major = f"libcudart.so.{cuda_version.split('.')[0]}" if cuda_version else None

    def own_version_first(path: str) -> tuple[bool, str]:
        name = os.path.basename(path)
        return not (major is not None and (name == major or name.startswith(major + "."))), path
    return sorted(out, key=own_version_first)


@functools.lru_cache(maxsize=1)
def _upload_fn():
    """``cudaGraphUpload(cudaGraphExec_t, cudaStream_t) -> cudaError_t`` of the loaded CUDA runtime, or None."""
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = cudart_paths(f.read(), torch.version.cuda)
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaGraphUpload
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        return fn
    return None


_refused = False  # the runtime refused an upload once: no more tries in this process


def upload_graph(graph: torch.cuda.CUDAGraph) -> bool:
    """Upload the captured ``graph`` on the current stream (ordered behind the work queued there), so its first
    ``replay()`` costs what the later ones do. Returns True when uploaded, False where it cannot be (see the module's
    docstring; the graph then uploads at its first launch, as without this). Where the runtime refuses an upload (a
    CUDA error code) it warns once, naming the code, and tries no more: an upload only moves work, so the engine goes
    on without."""
    global _refused
    on = os.environ.get("ADAFLASH_GRAPH_UPLOAD", "1") != "0"
    fn = _upload_fn() if on and torch.cuda.is_available() and not _refused else None
    if fn is None:
        return False
    try:  # a graph not instantiated (captured with keep_graph=True) has no executable graph yet: nothing to upload
        exec_ptr = graph.raw_cuda_graph_exec()
    except RuntimeError:
        return False
    err = fn(ctypes.c_void_p(exec_ptr), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if err != 0:
        _refused = True
        warnings.warn(f"cudaGraphUpload returned CUDA error {err}: graphs upload at their first launch from now on",
                      RuntimeWarning, stacklevel=2)
        return False
    return True
