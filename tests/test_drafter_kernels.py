"""The drafter's propose path with the fused Triton kernels (``DFlashDrafter.fuse_projections`` / ``use_fused_kernels``)
against its pure-torch reference path (an unfused drafter with the same weights).

- ``gpu`` tests (skipped without CUDA or Triton): the keys-only rotary + cache-write kernel against its reference at
  the SmolLM2-135M and Qwen3-8B shapes; a two-layer random drafter of each shape, fused ``append_context`` (a
  prefill's ``[B, T]`` rows and a catch-up's ``[N]`` rows mixing slots) and ``propose_hidden`` (rows are slots, and
  gathered slots) equal to the reference in bf16 and fp32; propose + append captured in a CUDA graph equal their
  eager run bit for bit; the engine with the drafter's kernels on: spec == AR, CUDA graphs == eager, and a hot
  reload in the middle of generation (``load_drafter``, captured graphs kept) gives the reference engine's context.
- CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, a subprocess: Triton chooses the interpreter when a
  kernel is defined), the fused propose / append on float32 CPU tensors equal the reference, also after a reload
  copied in place (the engine's ``load_drafter``) and after an assigning ``load_state_dict`` (fused again); without
  Triton, in-place loads reach the fused weights (they are the parameters' storage) and a CPU engine leaves the
  drafter on the unfused reference path.

Run on a GPU machine: python -m pytest -q -m gpu tests/test_drafter_kernels.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_drafter, make_tiny_target
from test_fused_kernels import HAVE_TRITON, ROOT, SHAPES, _close_bf16, _rotary_case, _small_target, needs_gpu


def _perturbed_drafter(target, layers: int, block_size: int, seed: int = 1):
    """A random drafter (:func:`adaflash_ray.shapes.build_random_drafter`) whose norm weights are 1 + 0.1 N(0, 1)
    (so a kernel that dropped a norm weight fails)."""
    from adaflash_ray.shapes import build_random_drafter

    d = build_random_drafter(target, layers, block_size, seed=seed)
    g = torch.Generator(device=d.fc.weight.device).manual_seed(seed)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=p.device, generator=g))
    return d


def _drafter_calls(d, device: str, seed: int = 0, prompt: int = 40):
    """The drafter's engine calls on a fresh context cache of 5 slots: a prefill-like append of ``prompt`` positions
    (``[B, T]`` rows), a catch-up-like append (``[N]`` rows mixing slots), a propose with rows = slots and one over
    gathered slots (block_size <= 24). Returns (hidden rows-are-slots ``[4, bs, H]``, hidden gathered
    ``[2, bs, H]``, context k, context v)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = d.fc.weight.dtype
    span = prompt + 24
    ctx = d.new_context_cache(5, span + 32)

    def t(*v):
        return torch.tensor(v, device=device)
    feats = torch.randn(4, prompt, d.fc.in_features, device=device, generator=g).to(dtype)
    positions = torch.arange(prompt, device=device).expand(4, prompt)
    d.append_context(ctx, t(1, 3, 0, 2)[:, None].expand(4, prompt), positions, feats)
    d.append_context(ctx, t(4, 4, 4, 0), t(0, 1, 2, prompt), feats[0, :4])
    anchors = torch.randint(0, d.config.vocab_size, (4,), device=device, generator=g)
    h1 = d.propose_hidden(ctx, torch.arange(4, device=device), anchors, t(prompt + 1, prompt // 2, prompt - 3, prompt),
                          span=span, rows_are_slots=True)
    h2 = d.propose_hidden(ctx, t(4, 2), anchors[:2], t(3, prompt - 5), span=span)
    return h1, h2, ctx.k, ctx.v


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("batch,width", [(1, 1), (4, 16), (64, 2)])
def test_rotary_kv_cache_gpu(shape, batch, width):
    """Keys only (the drafter's context K/V): k-norm + rotary + the K/V write equal the reference."""
    from adaflash_ray.kernels.rotary_cache import rotary_kv_cache, rotary_kv_cache_ref

    qkv, cos, sin, _, kn, kc, vc, rows, pos = _rotary_case(shape, batch, width, "cuda", torch.bfloat16)
    hq, hkv, d = shape[3], shape[4], shape[5]
    kv = qkv[..., hq * d:]  # [B, W, 2 Hkv D], a strided slice as the drafter's k/v GEMM rows are not
    kc0, vc0 = kc.clone(), vc.clone()
    rotary_kv_cache(kv, cos, sin, kn, 1e-6, kc, vc, rows, pos, hkv)
    rotary_kv_cache_ref(kv, cos, sin, kn, 1e-6, kc0, vc0, rows, pos, hkv)
    _close_bf16(kc, kc0)
    torch.testing.assert_close(vc, vc0, rtol=0, atol=0)  # values are copied
    assert kc.abs().sum() > 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape_name", ["smollm2-135m", "qwen3-8b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_drafter_fused_matches_reference_gpu(shape_name, dtype):
    """A two-layer random drafter of the real shape: fused append_context / propose_hidden (the engine's CUDA
    preparation, ``fuse_projections("auto")``) vs an unfused drafter with the same weights (the reference path)."""
    target = _small_target(shape_name, 4, "cuda", dtype)
    ref = _perturbed_drafter(target, 2, 16)
    fused = _perturbed_drafter(target, 2, 16)
    assert fused.fuse_projections("auto").fused_kernels_active and not ref.fused_kernels_active
    assert all(torch.equal(a, b) for a, b in zip(fused.parameters(), ref.parameters()))
    tol = 0.02 if dtype == torch.bfloat16 else 2e-4
    with torch.no_grad():
        outs = _drafter_calls(fused, "cuda"), _drafter_calls(ref, "cuda")
    for a, b in zip(*outs):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * b.float().abs().max().item() + (1e-3 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.gpu
@needs_gpu
def test_drafter_kernels_in_cuda_graph_gpu():
    """The fused append + propose captured in CUDA graphs (rows are slots, as in the engine's step): replay == eager
    bit for bit, including batch sizes first met inside the capture (no Triton compile during capture)."""
    target = _small_target("qwen3-8b", 4, "cuda", torch.bfloat16)
    drafter = _perturbed_drafter(target, 2, 16)
    assert drafter.fuse_projections("auto").fused_kernels_active
    dev, nf, vocab = "cuda", drafter.fc.in_features, target.config.vocab_size
    ctx = drafter.new_context_cache(8, 128)
    rows8 = torch.arange(8, device=dev)
    with torch.no_grad():  # eager: compiles every kernel (the keys-only rotary included)
        drafter.append_context(ctx, rows8[:, None].expand(8, 64), torch.arange(64, device=dev).expand(8, 64),
                               torch.randn(8, 64, nf, device=dev).bfloat16())
        drafter.propose_hidden(ctx, rows8[:4], torch.zeros(4, dtype=torch.long, device=dev),
                               torch.full((4,), 64, device=dev), span=96, rows_are_slots=True)
    for b in (4, 2, 3):
        rows = torch.arange(b, device=dev)
        anchors = torch.randint(0, vocab, (b,), device=dev)
        anchor_pos = 64 + rows
        pos = (64 + torch.arange(16, device=dev)).expand(b, 16).contiguous()
        feats = torch.randn(b, 16, nf, device=dev).bfloat16()

        @torch.no_grad()
        def step():
            drafter.append_context(ctx, rows[:, None].expand(b, 16), pos, feats)
            return drafter.propose_hidden(ctx, rows, anchors, anchor_pos, span=96, rows_are_slots=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        anchors.copy_(torch.randint(0, vocab, (b,), device=dev))
        feats.copy_(torch.randn(b, 16, nf, device=dev).bfloat16())
        ref = step().clone()
        ref_k = ctx.k.clone()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(ctx.k, ref_k, rtol=0, atol=0)


def _engine_run(target, drafter, new_tensors, mode: str, use_cuda_graph: bool = True):
    """Generate greedily for three prompts with a fixed-γ engine built in ``mode`` (``engine.fused_kernels``),
    reloading the drafter (``load_drafter``, in place; captured graphs kept) after three steps. Returns (outputs,
    pending drafts, context k, context v, accepted drafts, drafter's kernels on)."""
    from adaflash_ray.engine import SamplingParams, SpecEngine

    target.fused_kernels = mode  # what SpecEngine.from_config sets from the recipe; the runner passes it on
    eng = SpecEngine(target, drafter, None, policy="fixed", max_batch_size=4, max_seq_len=128,
                     use_cuda_graph=use_cuda_graph)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist(), params)
            for n in (5, 9, 17)]
    for _ in range(3):
        eng.step()
    eng.load_drafter(new_tensors, version=1)
    while eng.has_unfinished():
        eng.step()
    r = eng.runner
    return ([q.output_ids for q in reqs], r.drafts.clone(), r.ctx.k.clone(), r.ctx.v.clone(), eng.stats.num_accepted,
            drafter.fused_kernels_active)


@pytest.mark.gpu
@needs_gpu
def test_engine_drafter_kernels_gpu():
    """The engine on CUDA with the drafter's kernels (auto): a tiny random fp32 target and two-layer drafter, greedy
    spec == AR; CUDA graphs == eager (drafts and acceptance identical); a hot reload after three steps (graphs
    captured with the old weights are replayed with the new ones) gives the context and drafts of the engine with
    the kernels off (the reference path)."""
    from adaflash_ray.engine import SamplingParams, SpecEngine

    target = make_tiny_target("qwen3", logit_scale=4.0).to("cuda")
    drafter, _ = make_drafter(target, block_size=8, layers=2, policy="fixed", seed=5)
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.device)
           for k, v in drafter.drafter_state_dict().items()}
    runs = {}
    for mode, graphs in (("auto", True), ("auto", False), ("off", True)):
        drafter.load_state_dict(start)  # in place: every run starts from the same drafter
        runs[mode, graphs] = _engine_run(target, drafter, new, mode, graphs)
    assert runs["auto", True][5] and runs["auto", False][5] and not runs["off", True][5]
    target.fused_kernels = "off"
    ar = SpecEngine(target, None, None, max_batch_size=4, max_seq_len=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 17)]
    ar_out = [r.output_ids for r in ar.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True),
                                                mode="ar")]
    target.fused_kernels = "auto"
    for run in runs.values():
        assert run[0] == ar_out  # lossless with the drafter's kernels on and off
    graph, eager, off = runs["auto", True], runs["auto", False], runs["off", True]
    assert torch.equal(graph[1], eager[1]) and graph[4] == eager[4]  # graph == eager: the same drafts
    for a, b in ((graph[2], eager[2]), (graph[3], eager[3])):
        assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item() + 1e-7
    for a, b in ((graph[2], off[2]), (graph[3], off[3])):  # after the reload: the new weights, fused == reference
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item() + 1e-5
    assert (graph[1] == off[1]).float().mean().item() >= 0.9  # argmax drafts (fp32 near-ties may flip a few)


# --------------------------------------------------------------------------------------------- CPU
_INTERPRETER_SCRIPT = textwrap.dedent("""
    import dataclasses, torch
    torch.set_num_threads(1)
    from adaflash_ray.shapes import SHAPES, build_random_target
    from test_drafter_kernels import _drafter_calls, _perturbed_drafter

    def same(outs, refs, tol=1e-5):
        for a, b in zip(outs, refs):
            err = (a - b).abs().max().item()
            assert err <= tol * max(1.0, b.abs().max().item()), err

    g = torch.Generator().manual_seed(0)
    t = build_random_target(dataclasses.replace(SHAPES["tiny"], num_hidden_layers=4), "cpu", torch.float32)
    dr = _perturbed_drafter(t, 2, 4)
    assert dr.use_fused_kernels("off") is False
    ref = _drafter_calls(dr, "cpu", prompt=8)
    assert dr.fuse_projections("auto").fused_kernels_active
    same(_drafter_calls(dr, "cpu", prompt=8), ref)
    # a reload copied in place (the engine's load_drafter): the fused weights are the parameters' storage
    with torch.no_grad():
        for p in dr.drafter_state_dict().values():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    fused = _drafter_calls(dr, "cpu", prompt=8)
    dr.use_fused_kernels("off"); ref2 = _drafter_calls(dr, "cpu", prompt=8); dr.use_fused_kernels("auto")
    same(fused, ref2)
    assert (ref2[0] - ref[0]).abs().max() > 1e-3
    # an assigning load_state_dict moves parameters off the fused storage: the next call fuses them again
    new = {n: v + 0.05 * torch.randn(v.shape, generator=g) for n, v in dr.drafter_state_dict().items()}
    dr.load_state_dict(new, assign=True)
    assert not dr.layers[0].self_attn._fused() and dr.fused_kernels_active
    fused = _drafter_calls(dr, "cpu", prompt=8)
    assert all(l.self_attn._fused() and l.mlp._fused() for l in dr.layers)
    dr.use_fused_kernels("off"); ref3 = _drafter_calls(dr, "cpu", prompt=8)
    same(fused, ref3)
    assert (ref3[0] - ref2[0]).abs().max() > 1e-3
    # the add + norm fused into the q/k/v and gate/up GEMMs (kernels/norm_linear.py)
    dr.use_fused_kernels("auto")
    import os
    for linear in ("on", "all", "decode", "residual"):  # residual: o_proj / down_proj with the add + norm epilogue
        os.environ["ADAFLASH_FUSED_LINEAR"] = linear
        same(_drafter_calls(dr, "cpu", prompt=8), ref3)
    print("drafter interpreter ok")
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (optional; pip install triton)")
def test_drafter_kernels_under_triton_interpreter():
    """The fused propose / append on CPU float32 tensors under ``TRITON_INTERPRET=1`` == the reference, before and
    after reloads (in place, and assigning)."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("ADAFLASH_FUSED_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "drafter interpreter ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_fused_drafter_weights_follow_in_place_loads(monkeypatch):
    """Without Triton: the fused q/k/v and gate/up weights are the parameters' storage, so the engine's in-place
    reload reaches them and the reference path over them is unchanged; a CPU engine leaves the drafter unfused,
    kernels off (the float32 reference); ``auto`` on CPU without the interpreter keeps the kernels off."""
    from adaflash_ray.engine import SpecEngine

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("ADAFLASH_FUSED_KERNELS", raising=False)
    target = make_tiny_target("qwen3")
    drafter, _ = make_drafter(target, block_size=4, layers=2, policy="fixed", seed=3)
    eng = SpecEngine(target, drafter, None, policy="fixed", max_batch_size=2, max_seq_len=32)
    assert not drafter.fused_kernels_active and not drafter.layers[0].self_attn._fused()
    with torch.no_grad():
        ref = _drafter_calls(drafter, "cpu")
        assert drafter.fuse_projections("auto").fused_kernels_active is False  # no Triton launch on CPU
        attn, mlp = drafter.layers[1].self_attn, drafter.layers[1].mlp
        assert attn._fused() and mlp._fused()
        for a, b in zip(_drafter_calls(drafter, "cpu"), ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        g = torch.Generator().manual_seed(0)
        new = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in drafter.drafter_state_dict().items()}
        eng.load_drafter(new, version=1)
        assert attn._fused() and mlp._fused()
        torch.testing.assert_close(attn._qkv_w, torch.cat([new[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
        torch.testing.assert_close(mlp._gate_up,
                                   torch.cat([new[f"layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]))
        drafter.load_state_dict(new, assign=True)  # moves the parameters off the fused storage: detected
        assert not attn._fused() and not mlp._fused()
