"""The CUDA-graph upload helper on the CPU: which runtime library it picks from a process's memory map, and that it
uploads nothing (and raises nothing) where no CUDA runtime is loaded. The upload itself is checked by the GPU tests
(`tests/test_gpu.py`: every precaptured graph uploaded, graph replays equal to eager steps)."""
import pytest
import torch

from adaflash_ray.engine import graph_upload
from adaflash_ray.engine.graph_upload import cudart_paths, upload_graph

MAPS = """\
7f00aa000000-7f00aa100000 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6
7f00ab000000-7f00ab100000 r-xp 00000000 08:01 456 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13
7f00ab100000-7f00ab200000 r--p 00100000 08:01 456 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13
7f00ac000000-7f00ac100000 r-xp 00000000 08:01 789 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so
7f00ad000000-7f00ad001000 rw-p 00000000 00:00 0
7f00ae000000-7f00ae100000 r-xp 00000000 08:01 999 /opt/other/libcudart_static_helper.a
"""


def test_cudart_paths_picks_each_runtime_library_once():
    assert cudart_paths(MAPS) == ["/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13"]
    assert cudart_paths("") == []
    # anonymous mappings and other libraries are not runtimes
    assert cudart_paths("7f00ad000000-7f00ad001000 rw-p 00000000 00:00 0\n") == []



def test_cudart_paths_keeps_spaces_drops_deleted_and_puts_torchs_major_first():
    """A path with spaces is the line's sixth field to its end; a deleted library's mapping is left out; with two
    runtimes mapped, the one of PyTorch's CUDA major version comes first (the handles are that runtime's)."""
    maps = (
        "7f00ab000000-7f00ab100000 r-xp 00000000 08:01 456 /home/a b/venv/nvidia/lib/libcudart.so.12\n"
        "7f00ac000000-7f00ac100000 r-xp 00000000 08:01 457 /opt/old/lib/libcudart.so.11.0 (deleted)\n"
        "7f00ad000000-7f00ad100000 r-xp 00000000 08:01 458 /opt/cupy/lib/libcudart.so.11.0\n"
    )
    spaced, other = "/home/a b/venv/nvidia/lib/libcudart.so.12", "/opt/cupy/lib/libcudart.so.11.0"
    assert cudart_paths(maps) == [spaced, other]
    assert cudart_paths(maps, "11.8") == [other, spaced] and cudart_paths(maps, "12.8") == [spaced, other]
    # a major version's prefix is not another's: 1 is not 12
    assert cudart_paths(maps, "1.0") == cudart_paths(maps)


def test_upload_of_a_graph_without_an_executable_returns_false(monkeypatch):
    """A graph captured with keep_graph=True has no executable graph until instantiated (PyTorch raises on
    raw_cuda_graph_exec): the upload returns False instead of failing the capture that succeeded."""
    class KeptGraph:
        def raw_cuda_graph_exec(self):
            raise RuntimeError("You cannot access raw cudaGraphExec_t instance until instantiate() has been called")

    def fake_upload(exec_ptr, stream):
        raise AssertionError("nothing to upload")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(graph_upload, "_upload_fn", lambda: fake_upload)
    monkeypatch.setattr(graph_upload, "_refused", False)
    assert upload_graph(KeptGraph()) is False and graph_upload._refused is False

def test_upload_is_a_no_op_without_cuda(monkeypatch):
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert upload_graph(object()) is False  # the graph is never touched


def test_upload_switch_and_refusal(monkeypatch):
    calls = []

    class Graph:
        def raw_cuda_graph_exec(self):
            return 1234

    def fake_upload(exec_ptr, stream):
        calls.append((exec_ptr.value, stream.value))
        return fake_upload.err

    fake_upload.err = 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 99})())
    monkeypatch.setattr(graph_upload, "_upload_fn", lambda: fake_upload)
    monkeypatch.setattr(graph_upload, "_refused", False)
    assert upload_graph(Graph()) is True and calls == [(1234, 99)]
    monkeypatch.setenv("ADAFLASH_GRAPH_UPLOAD", "0")
    assert upload_graph(Graph()) is False and len(calls) == 1
    monkeypatch.delenv("ADAFLASH_GRAPH_UPLOAD")
    fake_upload.err = 400  # the runtime refuses: a warning, then no more tries
    with pytest.warns(RuntimeWarning, match="CUDA error 400"):
        assert upload_graph(Graph()) is False
    fake_upload.err = 0
    assert upload_graph(Graph()) is False and len(calls) == 2
