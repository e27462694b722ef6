"""Tests of adaflash_ray.distill (blocks, losses, DeepSpeed trainer core) and adaflash_ray.kernels.chunked_kl.

Run: python -m pytest -q tests/test_distill.py   (CPU, ~20 s; DeepSpeed over gloo: one rank, then two spawned ranks)

The fast paths are checked against slow references written here (unchunked, per-row loops):
every loss term, both RKL clip modes, weights, temperature != 1, the length label / loss and the
accepted-length count, chunked vs unchunked gradients; anchors and teacher rows against the target's
own greedy generations; the trainer against itself across ZeRO stages and feature sources.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os

import pytest
import torch

from adaflash_ray.config import DistillConfig, DrafterConfig, LengthHeadConfig
from adaflash_ray.distill.blocks import collate, recompute_features, sample_anchors
from adaflash_ray.distill.losses import (acceptance_loss, accepted_length, forward_kl_loss, length_loss,
                                         mixture_rkl_loss)
from adaflash_ray.models.length_head import (AcceptanceHead, acceptance_labels, direct_length_label,
                                             draft_confidence)
from adaflash_ray.models.target import TargetConfig, TargetModel
from adaflash_ray.trajectory import Trajectory
from adaflash_ray.kernels.chunked_kl import chunked_kl_terms, kl_terms

torch.set_num_threads(1)


def make_distill_target(seed: int = 0) -> TargetModel:
    """A random ``llama`` target (V=128, H=32, 4 layers, 4 query / 2 KV heads of 8 dims), frozen, float32.
    lm_head ~ N(0, 0.5²) gives a peaked teacher, so distillation has a clear signal to learn."""
    cfg = TargetConfig(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=10000.0, eos_token_ids=[])
    torch.manual_seed(seed)
    model = TargetModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.5 if "embed_tokens" in name or "lm_head" in name else 0.1)
    return model.requires_grad_(False).eval()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_distill_target()


# ----------------------------------------------------------------------------------- naive references
def naive_terms(hs, ht, w, temperature):
    """Per-row loop: (ce, rkl, fkl, student argmax, teacher argmax), nothing shared between rows."""
    ce, rkl, fkl, sa, ta = [], [], [], [], []
    for i in range(hs.shape[0]):
        zs, zt = hs[i] @ w.t(), (ht[i] @ w.t()).detach()
        t = int(torch.argmax(zt))
        ce.append(-torch.log_softmax(zs, -1)[t])
        ps, pt = torch.softmax(zs / temperature, -1), torch.softmax(zt / temperature, -1)
        rkl.append(temperature ** 2 * torch.sum(ps * (torch.log(ps) - torch.log(pt))))
        fkl.append(temperature ** 2 * torch.sum(pt * (torch.log(pt) - torch.log(ps))))
        sa.append(int(torch.argmax(zs)))
        ta.append(t)
    return torch.stack(ce), torch.stack(rkl), torch.stack(fkl), torch.tensor(sa), torch.tensor(ta)


def naive_mixture(hs, ht, w, weights, alpha, temperature, clip, clip_mode):
    ce, rkl, _, sa, ta = naive_terms(hs, ht, w, temperature)
    den = weights.sum()
    ce_loss = sum(weights[i] * ce[i] for i in range(len(ce))) / den
    if clip_mode == "per_token":
        rkl_loss = sum(weights[i] * torch.clamp(rkl[i], max=clip) for i in range(len(rkl))) / den
    else:  # AdaFlash code: clamp(RKL_i / Σw, τ), then weighted sum
        rkl_loss = sum(weights[i] * torch.clamp(rkl[i] / den, max=clip) for i in range(len(rkl)))
    match = sum(float(weights[i]) * float(sa[i] == ta[i]) for i in range(len(sa))) / float(den)
    return alpha * ce_loss + (1 - alpha) * rkl_loss, ce_loss.item(), rkl_loss.item(), match


def naive_accepted(draft, target, valid):
    out = torch.zeros(draft.shape[:-1], dtype=torch.long)
    for idx in itertools.product(*(range(n) for n in draft.shape[:-1])):
        a = 0
        for k in range(draft.shape[-1]):
            if not valid[idx][k] or draft[idx][k] != target[idx][k]:
                break
            a += 1
        out[idx] = a
    return out


def _rand_rows(m=23, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g)
    ht = torch.randn(m, h, generator=g)
    hs = (ht + 0.7 * torch.randn(m, h, generator=g)).requires_grad_(True)
    weights = torch.rand(m, generator=g) * (torch.rand(m, generator=g) > 0.2)
    return hs, ht, w, weights


# ----------------------------------------------------------------------------------- kernels / losses
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.8])
def test_kl_terms_match_naive(temperature):
    hs, ht, w, _ = _rand_rows()
    ce, rkl, fkl, sa, ta = naive_terms(hs, ht, w, temperature)
    for chunk in (1, 5, 1000):
        c, r, s, t, _ = chunked_kl_terms(hs, ht, w, temperature=temperature, chunk_size=chunk)
        torch.testing.assert_close(c, ce, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r, rkl, atol=1e-5, rtol=1e-5)
        assert torch.equal(s, sa) and torch.equal(t, ta)
        _, f, _, _, _ = chunked_kl_terms(hs, ht, w, temperature=temperature, chunk_size=chunk,
                                         direction="forward")
        torch.testing.assert_close(f, fkl, atol=1e-5, rtol=1e-5)
    assert (rkl >= -1e-6).all() and (fkl >= -1e-6).all()


@pytest.mark.parametrize("clip_mode", ["per_token", "reference"])
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_mixture_rkl_matches_naive(clip_mode, temperature):
    hs, ht, w, weights = _rand_rows(seed=3)
    rkl = naive_terms(hs, ht, w, temperature)[1].detach()
    scale = 1.0 if clip_mode == "per_token" else 1.0 / float(weights.sum())
    for clip in (1e9, float(rkl.median()) * scale):  # no clamp, and clamp active on about half the rows
        for alpha in (0.8, 0.0, 1.0):
            ref, ce, rl, match = naive_mixture(hs, ht, w, weights, alpha, temperature, clip, clip_mode)
            for chunk in (4, 64):
                out = torch.empty(hs.shape[0], dtype=torch.long)
                loss, m = mixture_rkl_loss(hs, ht, w, weights, alpha=alpha, temperature=temperature, clip=clip,
                                           clip_mode=clip_mode, chunk_size=chunk, argmax_out=out)
                assert abs(float(loss) - float(ref)) < 1e-5
                assert abs(m["train/ce"] - ce) < 1e-5 and abs(m["train/rkl"] - rl) < 1e-5
                assert abs(m["train/top1_match"] - match) < 1e-6
                assert torch.equal(out, (hs.detach() @ w.t()).argmax(-1))
    # without any clamp the two modes are the same objective
    a, _ = mixture_rkl_loss(hs, ht, w, weights, clip=1e9, clip_mode="per_token", chunk_size=7)
    b, _ = mixture_rkl_loss(hs, ht, w, weights, clip=1e9, clip_mode="reference", chunk_size=7)
    assert abs(float(a) - float(b)) < 1e-6


def test_chunked_gradients_equal_unchunked_and_naive():
    hs, ht, w, weights = _rand_rows(m=31, seed=5)
    grads = []
    for chunk in (3, 10, 31):
        h = hs.detach().clone().requires_grad_(True)
        loss, _ = mixture_rkl_loss(h, ht, w, weights, alpha=0.6, temperature=1.3, clip=0.5, chunk_size=chunk)
        loss.backward()
        grads.append(h.grad)
    h = hs.detach().clone().requires_grad_(True)
    naive_mixture(h, ht, w, weights, 0.6, 1.3, 0.5, "per_token")[0].backward()
    for g in grads:
        torch.testing.assert_close(g, h.grad, atol=1e-5, rtol=1e-4)
    # forward KL (OSD baseline): gradient too
    h1 = hs.detach().clone().requires_grad_(True)
    l1, m1 = forward_kl_loss(h1, ht, w, weights, temperature=1.3, chunk_size=4)
    l1.backward()
    h2 = hs.detach().clone().requires_grad_(True)
    fkl = naive_terms(h2, ht, w, 1.3)[2]
    ((weights * fkl).sum() / weights.sum()).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    assert abs(m1["train/fkl"] - float((weights * fkl).sum() / weights.sum())) < 1e-5


def test_chunked_loss_never_keeps_full_vocab_activations():
    """Autograd keeps no [M, V] tensor alive between forward and backward (only per-chunk recompute)."""
    m, h, v = 64, 8, 256
    hs, ht, w, weights = _rand_rows(m=m, h=h, v=v, seed=7)
    biggest = []

    def pack(t):
        biggest.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = mixture_rkl_loss(hs, ht, w, weights, chunk_size=8, confidence_out=torch.empty(m, 2))
    assert max(biggest) < m * v // 4, max(biggest)
    loss.backward()  # recomputation works
    biggest.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kl_terms(hs, ht, w, 1.0)  # the unchunked math does keep [M, V] (what chunking avoids)
    assert max(biggest) >= m * v


def test_zero_weight_and_empty_inputs():
    hs, ht, w, weights = _rand_rows(seed=9)
    loss, m = mixture_rkl_loss(hs, ht, w, torch.zeros_like(weights))
    assert float(loss) == 0.0 and math.isfinite(m["train/ce"])
    e = torch.zeros(0, hs.shape[1], requires_grad=True)
    loss, _ = mixture_rkl_loss(e, e.detach(), w, torch.zeros(0))
    loss.backward()
    assert float(loss) == 0.0
    with pytest.raises(ValueError):
        mixture_rkl_loss(hs, ht, w, weights[:-1])
    with pytest.raises(ValueError):
        mixture_rkl_loss(hs, ht, w, weights, clip_mode="bogus")


def test_accepted_length_and_length_loss_match_naive():
    g = torch.Generator().manual_seed(11)
    target = torch.randint(0, 4, (5, 6, 7), generator=g)
    draft = torch.where(torch.rand(5, 6, 7, generator=g) < 0.8, target, torch.randint(0, 4, (5, 6, 7), generator=g))
    valid = torch.arange(7)[None, None] < torch.randint(0, 8, (5, 6, 1), generator=g)
    a = accepted_length(draft, target, valid)
    assert torch.equal(a, naive_accepted(draft, target, valid))
    assert a.max() > 0
    pred = torch.rand(30, generator=g, requires_grad=True)
    blocks_valid = torch.rand(30, generator=g) > 0.3
    num_acc = a.reshape(-1)
    loss = length_loss(pred, num_acc, block_size=8, lookahead=1, valid=blocks_valid)
    ref = sum((pred[i] - min(1.0, (int(num_acc[i]) + 1) / 8)) ** 2 for i in range(30) if blocks_valid[i])
    assert abs(float(loss) - float(ref) / int(blocks_valid.sum())) < 1e-6
    assert torch.allclose(direct_length_label(torch.tensor([0, 3, 7, 9]), 8, 1), torch.tensor([1 / 8, 0.5, 1.0, 1.0]))


def naive_confidence(hs, w):
    """Per-row float64 softmax of the student logits at T = 1: (max probability, entropy in nats) ``[M, 2]``."""
    rows = []
    for i in range(hs.shape[0]):
        p = torch.softmax((hs[i].detach() @ w.t()).double(), -1)
        rows.append(torch.stack([p.max(), -(p * p.log()).sum()]))
    return torch.stack(rows).float()


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_confidence_matches_full_softmax(temperature, direction):
    """The kernel's 5th output is the student's (max prob, entropy) at T = 1 whatever the loss temperature,
    per row, without gradient, for chunk sizes that do and do not divide M; the losses hand it out."""
    m = 23
    hs, ht, w, weights = _rand_rows(m=m, seed=13)
    ref = naive_confidence(hs, w)
    torch.testing.assert_close(draft_confidence(hs.detach() @ w.t()), ref, atol=1e-5, rtol=1e-5)  # engine helper
    assert float(ref[:, 0].max() - ref[:, 0].min()) > 0.2 and float(ref[:, 1].max() - ref[:, 1].min()) > 0.5
    full = kl_terms(hs, ht, w, temperature, direction)
    for chunk in (1, 5, 7, m, 1000):  # 5 and 7 do not divide 23
        out = chunked_kl_terms(hs, ht, w, temperature=temperature, chunk_size=chunk, direction=direction)
        assert len(out) == 5
        conf = out[4]
        assert conf.shape == (m, 2) and conf.dtype == torch.float32 and not conf.requires_grad
        torch.testing.assert_close(conf, ref, atol=1e-5, rtol=1e-5)
        for a, b in zip(out[:2], full[:2]):  # the first four outputs keep their order and meaning
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[2], full[2]) and torch.equal(out[3], full[3])
    # through the losses: filled in place, and the loss itself is unchanged by asking for it
    got = torch.full((m, 2), float("nan"))
    plain, _ = mixture_rkl_loss(hs, ht, w, weights, temperature=temperature, chunk_size=5)
    loss, _ = mixture_rkl_loss(hs, ht, w, weights, temperature=temperature, chunk_size=5, confidence_out=got)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert float(loss.detach()) == float(plain.detach())
    got.fill_(float("nan"))
    forward_kl_loss(hs, ht, w, weights, temperature=temperature, chunk_size=7, confidence_out=got)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="confidence_out"):
        mixture_rkl_loss(hs, ht, w, weights, confidence_out=torch.empty(m - 1, 2))
    with pytest.raises(ValueError, match="confidence_out"):
        forward_kl_loss(hs, ht, w, weights, confidence_out=torch.empty(m))
    e = torch.zeros(0, hs.shape[1])
    assert chunked_kl_terms(e, e, w)[4].shape == (0, 2)


def test_acceptance_labels_hand_example_and_bce():
    t, f = True, False
    draft = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9], [3, 3, 3, 3]])
    target = torch.tensor([[5, 6, 0, 8], [0, 2, 3, 4], [9, 9, 9, 9], [3, 3, 3, 3]])
    valid = torch.tensor([[t, t, t, t], [t, t, t, t], [t, t, f, f], [f, f, f, f]])
    label, mask = acceptance_labels(draft, target, valid)
    assert label.dtype == torch.float32 and mask.dtype == torch.bool
    # row 0: accept, accept, reject, then (a match after a rejection) not counted
    # row 1: the first draft is rejected: only it counts; row 2: invalid tail; row 3: nothing exists
    assert label.tolist() == [[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert mask.tolist() == [[t, t, t, f], [t, f, f, f], [t, t, f, f], [f, f, f, f]]
    # random blocks: the counted positions are the accepted prefix plus the first rejection (if it exists),
    # and the accepted length is the sum of the counted labels
    g = torch.Generator().manual_seed(21)
    tgt = torch.randint(0, 3, (6, 5, 7), generator=g)
    drf = torch.where(torch.rand(6, 5, 7, generator=g) < 0.7, tgt, torch.randint(0, 3, (6, 5, 7), generator=g))
    n_valid = torch.randint(0, 8, (6, 5, 1), generator=g)
    val = torch.arange(7) < n_valid
    lab, msk = acceptance_labels(drf, tgt, val)
    a = naive_accepted(drf, tgt, val)
    assert torch.equal(msk.sum(-1), torch.minimum(a + 1, n_valid[..., 0]))
    assert torch.equal((lab * msk).sum(-1).long(), a)
    # masked BCE and accuracy against a direct computation over the counted positions only
    z = (torch.randn(6, 5, 7, generator=g) * 2).requires_grad_(True)
    loss, acc = acceptance_loss(z, lab, msk)
    ref = torch.nn.functional.binary_cross_entropy_with_logits(z[msk], lab[msk])
    assert abs(loss.item() - ref.item()) < 1e-6
    assert abs(float(acc) - float(((z[msk] > 0).float() == lab[msk]).float().mean())) < 1e-6
    assert 0.0 < float(acc) < 1.0
    loss.backward()
    assert z.grad[~msk].abs().max() == 0 and z.grad[msk].abs().min() > 0
    # nothing counted: an exact zero with a graph (zero gradient)
    z.grad = None
    loss, acc = acceptance_loss(z, lab, torch.zeros_like(msk))
    loss.backward()
    assert loss.item() == 0.0 and float(acc) == 0.0 and not z.grad.any()
    with pytest.raises(ValueError):
        acceptance_loss(z, lab[..., :-1], msk)


# ----------------------------------------------------------------------------------- blocks
def test_sample_anchors_bounds():
    g = torch.Generator().manual_seed(0)
    for prompt_len, t in [(1, 2), (1, 3), (5, 6), (5, 40), (10, 12), (3, 100)]:
        for _ in range(5):
            a = sample_anchors(prompt_len, t, 8, 4, g)
            lo, hi = max(1, prompt_len - 1), t - 2
            assert len(a) == min(8, max(0, hi - lo + 1))
            if len(a):
                assert a.min() >= lo and a.max() <= hi and a.dtype == torch.long
                assert (a[1:] > a[:-1]).all()  # sorted, distinct
    assert torch.equal(sample_anchors(5, 9, 16, 4), torch.arange(4, 8))  # all candidates
    with pytest.raises(ValueError):
        sample_anchors(0, 5, 4, 4)


def _greedy_trajectories(target, num=6, prompt_len=5, num_new=20, seed=0, dtype=torch.bfloat16, version=0):
    """Greedy generations of the target + features/last_hidden from one full forward (engine layout)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    layer_ids = [1, 2]
    for i in range(num):
        ids = torch.randint(0, target.config.vocab_size, (prompt_len,), generator=g)
        n = num_new - (i % 3) * 3  # different lengths -> padding
        with torch.no_grad():
            for _ in range(n):
                logits = target(ids[None], torch.arange(len(ids))[None]).logits
                ids = torch.cat([ids, logits[0, -1].argmax()[None]])
            res = target(ids[None, :-1], torch.arange(len(ids) - 1)[None], capture_layer_ids=layer_ids)
        out.append(Trajectory(request_id=f"r{i}", token_ids=ids, prompt_len=prompt_len,
                              features=res.features[0].to(dtype), last_hidden=res.last_hidden[0].to(dtype),
                              drafter_version=version + i % 2))
    return out


@pytest.fixture(scope="module")
def trajectories(target):
    return _greedy_trajectories(target, dtype=torch.float32)


def test_collate_layout(trajectories, target):
    bs = 5
    batch = collate(trajectories, num_anchors=6, block_size=bs, generator=torch.Generator().manual_seed(1))
    t_max = max(tr.num_tokens for tr in trajectories)
    b, n = batch.anchors.shape
    assert batch.input_ids.shape == (b, t_max) and batch.features.shape[:2] == (b, t_max - 1)
    assert batch.target_ids.shape == batch.teacher_pos.shape == batch.weights.shape == (b, n, bs - 1)
    assert batch.drafter_versions.tolist() == [tr.drafter_version for tr in trajectories]
    for i, tr in enumerate(trajectories):
        t = tr.num_tokens
        assert torch.equal(batch.features[i, : t - 1], tr.features) and not batch.features[i, t - 1:].any()
        for j in range(n):
            a = int(batch.anchors[i, j])
            valid = bool(batch.anchor_valid[i, j])
            assert tr.prompt_len - 1 <= a <= t - 2
            for k in range(1, bs):
                w = float(batch.weights[i, j, k - 1])
                expect = math.exp(-(k - 1) / 7) if valid and a + k <= t - 1 else 0.0
                assert abs(w - expect) < 1e-6
                if expect:
                    assert int(batch.target_ids[i, j, k - 1]) == int(tr.token_ids[a + k])
                    assert int(batch.teacher_pos[i, j, k - 1]) == a + k - 1
    # teacher logits at block position k predict token anchor+k: on greedy data they equal it
    sel = batch.weights > 0
    rows = torch.arange(b)[:, None, None].expand_as(sel)[sel]
    teacher = batch.last_hidden[rows, batch.teacher_pos[sel]]
    with torch.no_grad():
        assert torch.equal(target.lm_head(teacher).argmax(-1), batch.target_ids[sel])
    assert batch.num_blocks == int(batch.anchor_valid.sum())


def test_collate_pads_anchorless_rows_and_rejects_missing_features(trajectories):
    short = Trajectory("s", torch.tensor([3, 4]), 1, torch.zeros(1, 64), torch.zeros(1, 32), 0)
    batch = collate([short, trajectories[0]], 4, 4, torch.Generator().manual_seed(0))
    assert not batch.anchor_valid[0].any() and not batch.weights[0].any()
    assert batch.anchors[0].min() >= 1
    with pytest.raises(ValueError, match="recompute"):
        collate([dataclasses.replace(trajectories[0], features=None)], 4, 4)


def test_recompute_features_matches_full_forward(target, trajectories):
    tr = trajectories[0]
    feats = recompute_features(target, [tr.token_ids], [1, 2])
    (f, h), = feats
    assert f.shape == tr.features.shape and h.shape == tr.last_hidden.shape
    torch.testing.assert_close(f, tr.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, tr.last_hidden, atol=1e-5, rtol=1e-5)


def test_recompute_features_batched_equals_one_by_one(target, trajectories):
    """Right-padded batches (several groups: max_batch_tokens forces a split) give each sequence's own
    single forward, in input order, whatever the lengths."""
    seqs = [tr.token_ids for tr in trajectories[:4]] + [trajectories[0].token_ids[:5]]
    assert len({s.shape[0] for s in seqs}) > 1
    one = [recompute_features(target, [s], [1, 2])[0] for s in seqs]
    longest = max(s.shape[0] for s in seqs)
    cases = [(layout, budget, pad) for layout in ("padded", "packed")
             for budget, pad in ((10**6, 1), (2 * longest, 1), (2 * longest, 16))]  # pad: rounded lengths and rows
    for layout, budget, pad in cases:  # packed: sequences end to end, attention per sequence, rotary from 0 each
        many = recompute_features(target, seqs, [1, 2], max_batch_tokens=budget, pad_multiple=pad, layout=layout)
        for (f1, h1), (f2, h2), s in zip(one, many, seqs):
            assert f2.shape[0] == h2.shape[0] == s.shape[0] - 1
            torch.testing.assert_close(f2, f1, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h2, h1, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- trainer (DeepSpeed)
@pytest.fixture(scope="module")
def dist_env():
    """DeepSpeed needs RANK/WORLD_SIZE/...; restore the caller's environment afterwards."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "DS_ACCELERATOR")
    saved = {k: os.environ.get(k) for k in keys}
    from adaflash_ray.distill.trainer import DistillTrainerCore

    if not torch.distributed.is_initialized() or "LOCAL_RANK" not in os.environ:  # another test's group
        DistillTrainerCore.setup_dist_env(0, 1)
    yield DistillTrainerCore
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _cfgs(policy="direct", **distill):
    drafter = DrafterConfig(num_hidden_layers=1, block_size=4, num_target_layers=2, target_layer_ids=[1, 2])
    head = LengthHeadConfig(policy=policy, hidden_size=16)
    base = dict(num_anchors=8, lr=3e-3, head_lr=2e-3, batch_size=3, loss_chunk_size=16, grad_clip=1.0,
                lr_decay_steps=0)  # a constant lr unless a test asks for the decay
    base.update(distill)
    return drafter, head, DistillConfig(**base)


def _train_alternating(core, trajs, num_steps: int, check=None) -> tuple[list, list, dict]:
    """``num_steps`` optimizer steps alternating between trajs[0:3] and trajs[3:6]; returns the losses, the
    block acceptance per step and the last metrics (``check(metrics)`` must hold after every step)."""
    losses, accepts, m = [], [], {}
    for step in range(num_steps):
        m = core.train_step(trajs[(step % 2) * 3:(step % 2) * 3 + 3])
        losses.append(m["train/loss"])
        accepts.append(m["train/block_accept_len"])
        assert check is None or check(m), m
    return losses, accepts, m


def test_trainer_reduces_loss_and_publishes_engine_names(dist_env, target):
    trajs = _greedy_trajectories(target, num=6, num_new=24, seed=4)  # bf16, as the engine ships them
    drafter_cfg, head_cfg, distill_cfg = _cfgs(zero_stage=0)
    core = dist_env(target, drafter_cfg, head_cfg, distill_cfg, seed=0)
    before = core.publish_tensors()
    losses, accepts, m = _train_alternating(core, trajs, 30)
    keys = {"train/loss", "train/ce", "train/rkl", "train/len_loss", "train/top1_match", "train/block_accept_len",
            "train/num_blocks", "train/step", "train/lr", "train/seconds", "train/grad_norm"}
    assert keys <= set(m) and all(isinstance(v, float) for v in m.values())
    parts = [m["train/prep_s"], m["train/forward_s"], m["train/backward_step_s"]]
    assert all(p > 0 for p in parts) and sum(parts) == pytest.approx(m["train/seconds"], rel=1e-6)
    assert m["train/step"] == 30 == core.global_step and m["train/lr"] == pytest.approx(3e-3)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, (first, last)
    assert sum(accepts[-3:]) / 3 > sum(accepts[:3]) / 3
    # per-position top-1 (block 4: positions 1..3) bounds the mean accepted length a = Σ_k P(a >= k):
    # P(a >= 1) is position 1's top-1 exactly, and P(a >= k) <= position k's top-1
    tops = [m[f"train/top1_pos{k}"] for k in (1, 2, 3)]
    assert "train/top1_pos4" not in m and all(0.0 <= t <= 1.0 for t in tops)
    assert tops[0] - 1e-6 <= m["train/block_accept_len"] - 1 <= sum(tops) + 1e-6, (tops, m["train/block_accept_len"])
    # publication: CPU float32, the names SpecEngine.drafter_tensors uses, and the weights moved
    after = core.publish_tensors()
    expect = set(core.drafter.drafter_state_dict()) | {f"length_head.{k}" for k in core.length_head.state_dict()}
    assert set(after) == expect and any(k.startswith("length_head.") for k in after)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in after.values())
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    assert core.drafter_model_config().block_size == 4


def test_cost_head_loss_matches_naive_and_stays_off_the_drafter(target, trajectories):
    """DistillModule with the ``cost`` head: BCE / accuracy equal a direct computation from the full student
    logits (draft_confidence, acceptance_labels on the argmax drafts, the head on the detached hidden states
    of block positions 1..bs-1), through the chunked kernel's confidence; the head's loss adds no gradient to
    the drafter and is the head's only gradient."""
    from adaflash_ray.distill.trainer import DistillModule
    from adaflash_ray.models.factory import build_drafter

    drafter_cfg, head_cfg, _ = _cfgs(policy="cost")
    drafter, head = build_drafter(target, drafter_cfg, head_cfg, seed=3)
    assert isinstance(head, AcceptanceHead)
    drafter.float()
    head.float()
    with torch.no_grad():
        head.out.weight.normal_(0.0, 1.0)  # the prior's zero output weights would hide the inputs
    batch = collate(trajectories[:3], 8, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = drafter.forward_train(batch.features, batch.input_ids, batch.anchors)[:, :, 1:]  # [B, N, 3, H]
        zs = hidden @ target.lm_head.weight.t()  # [B, N, 3, V] (reference only)
    draft = zs.argmax(-1)
    # a fresh drafter is rarely right: make ~70% of the trajectory tokens its drafts, so both labels and the
    # prefix mask are non-trivial (the teacher rows are untouched)
    agree = torch.rand(draft.shape, generator=torch.Generator().manual_seed(1)) < 0.7
    batch = dataclasses.replace(batch, target_ids=torch.where(agree, draft, batch.target_ids))
    sel = batch.weights > 0
    label, mask = acceptance_labels(torch.where(sel, draft, -1), batch.target_ids, sel)
    with torch.no_grad():
        z = head(hidden, draft_confidence(zs))
    ref = torch.nn.functional.binary_cross_entropy_with_logits(z[mask], label[mask])
    ref_acc = ((z[mask] > 0).float() == label[mask]).float().mean()
    assert 0.2 < float(label[mask].mean()) < 0.9 and int(sel.sum()) > int(mask.sum()) > 20
    assert 0.0 < float(ref_acc) < 1.0
    grads = {}
    for lam in (1.0, 0.0):
        dcfg = DistillConfig(num_anchors=8, loss_chunk_size=7, length_loss_weight=lam)  # 7 splits M unevenly
        module = DistillModule(drafter, head, target.lm_head, dcfg, head_cfg)
        module.zero_grad(set_to_none=True)
        loss, m = module(batch)
        loss.backward()
        assert abs(m["train/len_loss"] - float(ref)) < 1e-5, (m["train/len_loss"], float(ref))
        assert abs(m["train/accept_head_acc"] - float(ref_acc)) < 1e-6
        grads[lam] = ({n: p.grad for n, p in drafter.named_parameters()},
                      {n: p.grad for n, p in head.named_parameters()})
    for n, g in grads[1.0][0].items():
        g0 = grads[0.0][0][n]
        assert (g is None and g0 is None) or torch.equal(g, g0), n
    assert all(float(g.abs().sum()) > 0 for g in grads[1.0][1].values())
    assert all(g is None or not g.any() for g in grads[0.0][1].values())


def test_trainer_trains_cost_acceptance_head(dist_env, target, tmp_path):
    """policy ``cost``: the trainer steps the AcceptanceHead with its own lr and publishes it under the engine's
    ``length_head.`` names; restarted from that checkpoint with the drafter (nearly) frozen, so that the labels
    stand still, the per-position BCE falls well below that of the best constant predictor."""
    from adaflash_ray.models.checkpoint import save_drafter_checkpoint

    trajs = _greedy_trajectories(target, num=6, num_new=24, seed=4)
    drafter_cfg, head_cfg, distill_cfg = _cfgs(policy="cost", zero_stage=0)
    core = dist_env(target, drafter_cfg, head_cfg, distill_cfg, seed=0)
    assert isinstance(core.length_head, AcceptanceHead)
    assert [g["lr"] for g in core.optimizer.param_groups] == pytest.approx([3e-3, 2e-3])
    before = core.publish_tensors()
    losses, accepts, m = _train_alternating(core, trajs, 30, check=lambda m: (
        0.0 <= m["train/accept_head_acc"] <= 1.0 and m["train/len_loss"] > 0.0))
    # last 3 steps' mean loss / first 3's: 0.48-0.54 over trainer seeds 0-3 (anchors are drawn at random); a
    # trainer that did not learn stays near 1
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3
    assert sum(accepts[-3:]) / 3 > sum(accepts[:3]) / 3
    after = core.publish_tensors()
    hidden = target.config.hidden_size
    head_names = {"length_head.inp.weight", "length_head.inp.bias", "length_head.out.weight", "length_head.out.bias"}
    assert set(after) == set(core.drafter.drafter_state_dict()) | head_names
    assert after["length_head.inp.weight"].shape == (16, hidden + 2)
    assert after["length_head.out.weight"].shape == (1, 16)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in after.values())
    assert not before["length_head.out.weight"].any() and after["length_head.out.weight"].abs().max() > 1e-3
    for k in head_names:  # every head tensor moved (weight_decay 0: only gradients move them)
        assert float((after[k] - before[k]).abs().max()) > 1e-4, k
    assert not torch.equal(before["fc.weight"], after["fc.weight"])

    # phase 2: start from the published checkpoint (drafter + head), drafter lr ~ 0, every anchor each step
    save_drafter_checkpoint(tmp_path / "v1", core.drafter_model_config(), after)
    drafter2 = drafter_cfg.model_copy(update={"init_path": str(tmp_path / "v1")})
    _, _, distill2 = _cfgs(policy="cost", zero_stage=0, lr=1e-8, head_lr=3e-2, num_anchors=NUM_ALL_ANCHORS)
    core2 = dist_env(target, drafter2, head_cfg, distill2, seed=1)
    loaded = core2.publish_tensors()
    assert all(torch.equal(loaded[k], after[k]) for k in after)
    bce, accs = [], []
    for _ in range(40):
        m = core2.train_step(trajs)
        bce.append(m["train/len_loss"])
        accs.append(m["train/accept_head_acc"])
    # the labels the head was fitted to (every anchor: the batch of every step)
    batch = collate(trajs, NUM_ALL_ANCHORS, 4, torch.Generator(), torch.float32)
    sel = batch.weights > 0
    with torch.no_grad():
        hid = core2.drafter.forward_train(batch.features, batch.input_ids, batch.anchors)[:, :, 1:]
        draft = (hid @ target.lm_head.weight.t()).argmax(-1)
    label, mask = acceptance_labels(torch.where(sel, draft, -1), batch.target_ids, sel)
    rate = float(label[mask].mean())
    assert 0.1 < rate < 0.9, rate
    const_bce = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert bce[-1] < 0.6 * bce[0], (bce[0], bce[-1])
    assert sum(bce[-5:]) / 5 < sum(bce[:5]) / 5
    assert bce[-1] < 0.8 * const_bce, (bce[-1], const_bce)
    assert accs[-1] > max(rate, 1 - rate) + 0.1, (accs[-1], rate)


@pytest.mark.parametrize("zero_stage,policy", [(1, "direct"), (2, "direct"), (3, "direct"), (3, "cost")])
def test_zero_stages_match_stage0(dist_env, target, trajectories, zero_stage, policy):
    """ZeRO 1/2/3 initialise on CPU (gloo) and reproduce stage 0's losses and weights under a fixed seed
    (ZeRO-3 also with the ``cost`` policy's AcceptanceHead, partitioned and gathered like the direct head)."""
    results = {}
    for stage in (0, zero_stage):
        core = dist_env(target, *_cfgs(policy, zero_stage=stage, warmup_steps=2), seed=1)
        ms = [core.train_step(trajectories[:3]) for _ in range(3)]
        results[stage] = ([m["train/loss"] for m in ms], core.publish_tensors(), [m["train/lr"] for m in ms])
    (l0, w0, lr0), (l1, w1, lr1) = results[0], results[zero_stage]
    assert lr0 == pytest.approx([1.5e-3, 3e-3, 3e-3]) and lr1 == pytest.approx(lr0)  # warmup then flat
    assert l1 == pytest.approx(l0, rel=1e-4, abs=1e-5)
    assert set(w0) == set(w1) and "length_head.inp.weight" in w0
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-5, rtol=1e-4)


def test_recompute_features_gives_same_step_as_captured(dist_env, target, trajectories):
    captured = dist_env(target, *_cfgs(features="captured"), seed=2)
    recompute = dist_env(target, *_cfgs(features="recompute"), seed=2)
    bare = [dataclasses.replace(tr, features=None, last_hidden=None) for tr in trajectories[:3]]
    a, b = captured.train_step(trajectories[:3]), recompute.train_step(bare)
    for k in ("train/loss", "train/ce", "train/rkl", "train/len_loss", "train/block_accept_len"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
    with pytest.raises(ValueError, match="recompute"):
        captured.train_step(bare)


def test_padded_shapes_give_the_same_step(dist_env, target, trajectories):
    """distill.pad_tokens_multiple / pad_anchors_multiple (fewer distinct shapes) and attention_backends only
    change shapes and the SDPA backend: the step's loss, acceptance and gradient norm stay those of the unpadded
    step; collate's padded tensors have the rounded shapes."""
    bare = [dataclasses.replace(tr, features=None, last_hidden=None) for tr in trajectories[:3]]
    plain = dist_env(target, *_cfgs(features="recompute", attention_backends="auto"), seed=4)
    padded = dist_env(target, *_cfgs(features="recompute", pad_tokens_multiple=16, pad_anchors_multiple=8,
                                     attention_backends="no_cudnn"), seed=4)
    a, b = plain.train_step(bare), padded.train_step(bare)
    for k in ("train/loss", "train/ce", "train/rkl", "train/block_accept_len", "train/num_positions",
              "train/grad_norm"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
    batch = collate(trajectories[:3], 5, 4, torch.Generator().manual_seed(0), pad_tokens_multiple=16,
                    pad_anchors_multiple=8)
    assert batch.input_ids.shape[1] % 16 == 0 and batch.features.shape[1] == batch.input_ids.shape[1] - 1
    assert batch.anchors.shape[1] == 8 and not batch.weights[~batch.anchor_valid].any()
    from adaflash_ray.distill.trainer import sdpa_backends
    with pytest.raises(ValueError, match="attention_backends"):
        sdpa_backends("cudnn")


def test_fresh_rows_report_their_own_block_acceptance(dist_env, target, trajectories):
    """train_step(fresh=...): train/block_accept_len_fresh is the block acceptance of the fresh rows alone (the
    same step's value when every row is fresh), absent when no row is."""
    core = dist_env(target, *_cfgs(), seed=6)
    m_all = core.train_step(trajectories[:3], fresh=[True, True, True])
    assert m_all["train/block_accept_len_fresh"] == pytest.approx(m_all["train/block_accept_len"], rel=1e-6)
    assert m_all["train/num_fresh_blocks"] == m_all["train/num_blocks"]
    m_none = core.train_step(trajectories[:3], fresh=[False, False, False])
    assert "train/block_accept_len_fresh" not in m_none and m_none["train/num_fresh_blocks"] == 0
    m_one = core.train_step(trajectories[:3], fresh=[False, True, False])
    assert 0 < m_one["train/num_fresh_blocks"] < m_one["train/num_blocks"]


def test_setup_dist_env_validation(dist_env):
    with pytest.raises(ValueError):
        dist_env.setup_dist_env(2, 2)
    with pytest.raises(ValueError):
        dist_env.setup_dist_env(1, 2)  # rank > 0 needs rank 0's port


#: the global batch of the two-rank tests: rank r trains on trajectories GLOBAL_BATCH[2r:2r+2]; both halves
#: have equal lengths (16 and 13 tokens), so each rank averages over as many positions as the other and
#: the mean of the two ranks' gradients is the one-rank gradient of the whole batch
GLOBAL_BATCH = (0, 1, 3, 1)
NUM_ALL_ANCHORS = 64  # more than any trajectory has: every candidate anchor, no sampling


def _two_rank_worker(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    from adaflash_ray.distill.trainer import DistillTrainerCore

    DistillTrainerCore.setup_dist_env(rank, 2, master_port=port)
    target = make_distill_target()
    trajs = _greedy_trajectories(target, num=4, num_new=16, seed=4, dtype=torch.float32)
    mine = [trajs[i] for i in GLOBAL_BATCH[2 * rank: 2 * rank + 2]]
    out = {}
    for stage in (1, 2, 3):  # one process group, a fresh trainer per ZeRO stage
        extra = {"num_anchors": NUM_ALL_ANCHORS} if stage != 1 else {}
        core = DistillTrainerCore(target, *_cfgs(zero_stage=stage, **extra), seed=0, rank=rank, world_size=2)
        init = core.publish_tensors()  # ZeRO-3: a gather every rank takes part in
        losses = [core.train_step(trajs[2 * rank: 2 * rank + 2])["train/loss"] for _ in range(3)] \
            if stage == 1 else []
        if stage != 1:
            core.train_step(mine)
        assert core.all_ranks(True) and not core.all_ranks(rank == 0)
        final = core.publish_tensors()
        moved = max(float((final[k] - init[k]).abs().max()) for k in final)
        out[stage] = (losses, moved, {k: v.numpy() for k, v in final.items()})
    from adaflash_ray.distill import trainer as trainer_mod

    rendezvous = trainer_mod._RENDEZVOUS.get("file")
    core.close()
    queue.put((rank, out, rendezvous))


def test_two_ranks_zero123_gloo_match_one_rank(dist_env, target):
    """Issue 9.8: world_size 2 over gloo (spawned processes) under ZeRO-1, -2 and -3: ranks stay identical,
    publication gathers on every rank without deadlock, one step on half the batch each equals one rank's
    step on the whole batch, and the file-rendezvous file is removed when the group ends."""
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = sorted((queue.get(timeout=300) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    assert [p.exitcode for p in procs] == [0, 0]
    (_, out0, rdv), (_, out1, _) = res
    assert rdv and not os.path.exists(rdv), f"rendezvous file {rdv} left behind"
    # ZeRO-1, 3 steps on different data: ranks stay in sync
    (l0, moved0, w0), (l1, _, w1) = out0[1], out1[1]
    assert moved0 > 1e-4 and l0 != l1  # ranks saw different data ...
    assert max(float(abs(w0[k] - w1[k]).max()) for k in w0) == 0.0  # ... and hold the same weights
    assert l0[-1] < l0[0] and l1[-1] < l1[0]
    # ZeRO-2 / -3, one step: equal to one rank stepping on the global batch
    trajs = _greedy_trajectories(target, num=4, num_new=16, seed=4, dtype=torch.float32)
    ref = dist_env(target, *_cfgs(zero_stage=0, num_anchors=NUM_ALL_ANCHORS), seed=0)
    ref.train_step([trajs[i] for i in GLOBAL_BATCH])
    want = ref.publish_tensors()
    for stage in (2, 3):
        got0, got1 = out0[stage][2], out1[stage][2]
        assert out0[stage][1] > 1e-4
        for k in want:
            assert (got0[k] == got1[k]).all(), (stage, k)
            torch.testing.assert_close(torch.from_numpy(got0[k]), want[k], atol=2e-6, rtol=1e-4,
                                       msg=lambda m, k=k, stage=stage: f"ZeRO-{stage} {k}: {m}")


@pytest.mark.parametrize("zero_stage,policy", [(0, "direct"), (2, "direct"), (2, "cost")])
def test_save_and_resume_continue_exactly(dist_env, target, trajectories, tmp_path, zero_stage, policy):
    """Issue 9.2: drafter, head, optimizer state, lr schedule, step and the anchor RNG are saved; a fresh
    trainer that loads them takes the same next steps as the one that kept going (same losses/weights)."""
    cfgs = _cfgs(policy, zero_stage=zero_stage, warmup_steps=3)
    a = dist_env(target, *cfgs, seed=5)
    for _ in range(2):
        a.train_step(trajectories[:3])
    a.save_state(str(tmp_path), "v1", {"version": 1, "fresh_ids": ["r0"]})
    a.save_state(str(tmp_path), "v2", {"version": 2, "fresh_ids": ["r0", "r1"]})  # newest wins; keep=2
    a.save_state(str(tmp_path), "v3", {"version": 3, "fresh_ids": ["r0", "r1", "r2"]})
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["v2", "v3"]
    cont = [a.train_step(trajectories[3:]) for _ in range(2)]
    b = dist_env(target, *cfgs, seed=99)  # other init: everything must come from the checkpoint
    assert dist_env(target, *cfgs, seed=6).load_state(str(tmp_path / "none")) is None
    state = b.load_state(str(tmp_path))
    assert state == {"version": 3, "fresh_ids": ["r0", "r1", "r2"]}
    assert b.global_step == 2
    resumed = [b.train_step(trajectories[3:]) for _ in range(2)]
    for x, y in zip(cont, resumed):
        assert y["train/step"] == x["train/step"] and y["train/lr"] == pytest.approx(x["train/lr"])
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-5, abs=1e-6)
    wa, wb = a.publish_tensors(), b.publish_tensors()
    assert set(wa) == set(wb) and "length_head.inp.weight" in wa
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------- compute dtype (autocast)
def test_resolve_compute_dtype():
    from adaflash_ray.distill.trainer import resolve_compute_dtype

    assert resolve_compute_dtype("auto", "cpu", torch.float32) is None  # CPU stays float32
    assert resolve_compute_dtype("auto", "cpu", torch.bfloat16) is None
    assert resolve_compute_dtype("auto", "cuda", torch.bfloat16) is torch.bfloat16
    assert resolve_compute_dtype("auto", "cuda", torch.float32) is torch.bfloat16
    assert resolve_compute_dtype("auto", "cuda", torch.float16) is torch.float16
    assert resolve_compute_dtype("float32", "cuda", torch.bfloat16) is None
    assert resolve_compute_dtype("bfloat16", "cpu", torch.float32) is torch.bfloat16
    with pytest.raises(ValueError, match="compute_dtype"):
        resolve_compute_dtype("fp8", "cuda", torch.bfloat16)
    assert DistillConfig().compute_dtype == "auto"


def test_cpu_default_has_no_autocast_and_bf16_autocast_reaches_the_drafter(dist_env, target, trajectories):
    """On CPU the default trainer computes in float32 (no autocast); ``compute_dtype: bfloat16`` runs the drafter's
    projections and attention in bf16 through DeepSpeed's engine forward (which disables an autocast opened outside
    it), keeps the weights and gradients float32, and lands near the float32 step's loss."""
    plain = dist_env(target, *_cfgs(), seed=3)
    assert plain.compute_dtype is None and plain.module.compute_dtype is None
    bf16 = dist_env(target, *_cfgs(compute_dtype="bfloat16"), seed=3)
    assert bf16.compute_dtype is torch.bfloat16
    seen = {}
    layer = bf16.drafter.layers[0]
    h1 = layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q_proj", o.dtype))
    h2 = layer.mlp.down_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("down_proj", o.dtype))
    try:
        a = plain.train_step(trajectories[:3])
        b = bf16.train_step(trajectories[:3])
    finally:
        h1.remove()
        h2.remove()
    assert seen == {"q_proj": torch.bfloat16, "down_proj": torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in bf16.module.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in bf16.module.parameters())
    assert math.isfinite(b["train/loss"])
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=3e-2)


@pytest.mark.long  # ~40 s of Inductor compiles on CPU; distill.recompute_compiled is a CUDA option
def test_compiled_recompute_equals_eager(target):
    """``compiled=True`` (torch.compile around each layer's attention; Inductor's C++ backend on CPU): the packed
    and the padded recompute give the eager features and last hidden states, one compilation serving several
    packings; ``fused`` and ``compiled`` together are refused."""
    from adaflash_ray.distill.blocks import causal_features, packed_causal_features

    g = torch.Generator().manual_seed(0)
    for lens in ([9, 13], [5, 7, 11], [30]):
        ids = torch.randint(0, 128, (sum(lens),), generator=g)
        got = packed_causal_features(target, ids, lens, [3, 1], compiled=True)
        want = packed_causal_features(target, ids, lens, [3, 1])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    ids = torch.randint(0, 128, (3, 17), generator=g)
    for a, b in zip(causal_features(target, ids, [0, 3], compiled=True), causal_features(target, ids, [0, 3])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="choose one"):
        causal_features(target, ids, [0], fused=True, compiled=True)


def test_packed_causal_features_refuse_bad_lengths(target):
    from adaflash_ray.distill.blocks import packed_causal_features

    ids = torch.zeros(6, dtype=torch.long)
    for lens in ([], [3, 2], [6, 0]):
        with pytest.raises(ValueError, match="seq_lens"):
            packed_causal_features(target, ids, lens, [1])
    with pytest.raises(ValueError, match="layout"):
        recompute_features(target, [ids], [1], layout="ragged")


def test_causal_features_match_the_target_forward(target):
    """The recompute's causal fast path (SDPA is_causal, no mask tensor; the CUDA path of recompute_features) gives
    the target forward's features and last hidden states, for layer ids in any order, with padding rows."""
    from adaflash_ray.distill.blocks import causal_features

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, target.config.vocab_size, (3, 17), generator=g)
    pos = torch.arange(17)[None].expand(3, -1)
    ref = target(ids, pos, capture_layer_ids=[2, 0, 3], compute_logits=False)
    f, h = causal_features(target, ids, [2, 0, 3])
    torch.testing.assert_close(f, ref.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref.last_hidden, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        causal_features(target, ids, [4])


_FUSED_RECOMPUTE_SCRIPT = """
import torch
torch.set_num_threads(1)
from test_distill import make_distill_target
from adaflash_ray.distill.blocks import causal_features
t = make_distill_target()
for layer in t.model.layers:
    layer.self_attn.fuse()
    layer.mlp.fuse()
ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(3))
ref = t(ids, torch.arange(13)[None].expand(2, -1), capture_layer_ids=[3, 1], compute_logits=False)
f, h = causal_features(t, ids, [3, 1], fused=True)
torch.testing.assert_close(f, ref.features, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(h, ref.last_hidden, atol=1e-5, rtol=1e-5)
from adaflash_ray.distill.blocks import packed_causal_features
pf, ph = packed_causal_features(t, torch.cat([ids[0, :9], ids[1]]), [9, 13], [3, 1], fused=True)
r0 = t(ids[:1, :9], torch.arange(9)[None], capture_layer_ids=[3, 1], compute_logits=False)
torch.testing.assert_close(pf, torch.cat([r0.features[0], ref.features[1]]), atol=1e-5, rtol=1e-5)
torch.testing.assert_close(ph, torch.cat([r0.last_hidden[0], ref.last_hidden[1]]), atol=1e-5, rtol=1e-5)
print("fused recompute ok")
"""


def test_causal_features_fused_kernels_under_interpreter():
    """The fused-kernel variant of the causal recompute (add + RMSNorm and SwiGLU Triton kernels, the CUDA default)
    equals the target forward, run under Triton's CPU interpreter in a subprocess."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed (optional)")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    out = subprocess.run([sys.executable, "-c", _FUSED_RECOMPUTE_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused recompute ok" in out.stdout


def test_forward_train_flex_attention_equals_sdpa(target, trajectories):
    """The drafter's training forward with flex attention (block mask; eager flex on CPU, forward only: flex has no
    CPU backward) equals the explicit-mask SDPA forward; the trainer refuses ``flex`` off CUDA."""
    import warnings

    from adaflash_ray.models.factory import build_drafter

    drafter_cfg, head_cfg, _ = _cfgs()
    drafter, _ = build_drafter(target, drafter_cfg, head_cfg, 0)
    drafter.float()
    batch = collate(trajectories[:3], num_anchors=5, block_size=drafter.block_size,
                    generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex attention warns that it is not compiled
        ref = drafter.forward_train(batch.features, batch.input_ids, batch.anchors)
        got = drafter.forward_train(batch.features, batch.input_ids, batch.anchors, attention="flex")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="attention"):
        drafter.forward_train(batch.features, batch.input_ids, batch.anchors, attention="dense")


@pytest.mark.parametrize("bsz,n,bs,t", [(2, 20, 16, 300), (3, 7, 5, 130), (1, 96, 16, 768), (2, 30, 16, 256)])
def test_flex_block_mask_tiles_equal_create_block_mask(bsz, n, bs, t):
    """``flex_block_mask`` (from the anchors, a few tensor ops) visits the same key tiles per query tile as
    ``create_block_mask`` evaluating the visibility on every (query, key) pair; its full tiles are fully visible
    on every real query, so no mask is needed there (the reference also counts the padded query rows of a last,
    partial tile, so it may call fewer tiles full)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from adaflash_ray.models.drafter import FLEX_TILE, flex_block_mask

    g = torch.Generator().manual_seed(n)
    tp = -(-t // FLEX_TILE) * FLEX_TILE
    anchors = torch.sort(torch.randint(1, t, (bsz, n), generator=g), dim=1).values
    q_anchor = anchors.repeat_interleave(bs, dim=1)  # [B, Q]

    def visible(b, h, q, kv):
        return torch.where(kv < tp, kv < q_anchor[b, q], (kv - tp) // bs == q // bs)

    got = flex_block_mask(q_anchor, bs, tp)
    ref = create_block_mask(visible, bsz, None, n * bs, tp + n * bs, device="cpu")
    assert torch.equal(got.to_dense().bool(), ref.to_dense().bool())
    q = torch.arange(n * bs)
    dense = visible(torch.arange(bsz)[:, None, None], 0, q[None, :, None], torch.arange(tp + n * bs)[None, None])
    for b in range(bsz):  # every full tile holds only visible pairs (real queries)
        for qt in range(got.full_kv_num_blocks.shape[2]):
            for kt in got.full_kv_indices[b, 0, qt, :got.full_kv_num_blocks[b, 0, qt]].tolist():
                tile = dense[b, qt * FLEX_TILE:(qt + 1) * FLEX_TILE, kt * FLEX_TILE:(kt + 1) * FLEX_TILE]
                assert tile.all()
    with pytest.raises(ValueError, match="multiple of"):
        flex_block_mask(q_anchor, bs, tp + 1)


@pytest.mark.long  # ~35 s of Inductor compiles on CPU; distill.compile_drafter is off by default
def test_compiled_training_layers_equal_eager(target, trajectories):
    """``DFlashDrafter.compile_training`` (torch.compile, dynamic shapes; Inductor's C++ backend on CPU): the same
    hidden states and parameter gradients as the eager layers on two batches of different shapes (one compiled
    graph serves both), and ``compile_training(False)`` restores the eager function."""
    from adaflash_ray.models.drafter import _train_layer_step
    from adaflash_ray.models.factory import build_drafter

    drafter_cfg, head_cfg, _ = _cfgs()
    drafter, _ = build_drafter(target, drafter_cfg, head_cfg, 0)
    drafter.float()
    batches = [collate(trajectories[:k], num_anchors=n, block_size=drafter.block_size,
                       generator=torch.Generator().manual_seed(k)) for k, n in ((2, 4), (3, 6))]

    def run():
        out = []
        for b in batches:
            drafter.zero_grad()
            hidden = drafter.forward_train(b.features, b.input_ids, b.anchors)
            (hidden.float() ** 2).mean().backward()
            out.append((hidden.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
        return out
    eager = run()
    drafter.compile_training()
    assert drafter._train_layer is not _train_layer_step
    compiled = run()
    for (h0, g0), (h1, g1) in zip(eager, compiled):
        torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-4)
        assert len(g0) == len(g1) > 0
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert drafter.compile_training(False)._train_layer is _train_layer_step


def test_compiled_training_layers_share_one_graph(target, trajectories):
    """Every layer of the compiled training forward runs one Dynamo graph: layer 0's input (the block embeddings)
    is handed over as a plain tensor, not a view - Dynamo guards on a view's base, and the later layers' plain
    inputs used to fail that guard and compile a second graph (each costing tens of seconds on a GPU)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from adaflash_ray.models.factory import build_drafter

    drafter_cfg, head_cfg, _ = _cfgs()
    drafter, _ = build_drafter(target, drafter_cfg.model_copy(update={"num_hidden_layers": 2}), head_cfg, 0)
    drafter.float().compile_training()
    torch._dynamo.reset()
    counters.clear()
    b = collate(trajectories[:2], num_anchors=4, block_size=drafter.block_size,
                generator=torch.Generator().manual_seed(0))
    (drafter.forward_train(b.features, b.input_ids, b.anchors).float() ** 2).mean().backward()
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
    assert all(p.grad is not None for p in drafter.layers.parameters())


def test_trainer_rejects_flex_attention_off_cuda(dist_env, target):
    with pytest.raises(ValueError, match="drafter_attention"):
        dist_env(target, *_cfgs(drafter_attention="flex"), seed=0)


def test_first_rejection_weights_follow_the_rule():
    """distill.reject_boost (Draft-OPD): in each block only the first valid position whose student top-1 differs
    from the trajectory's token gets 1 + boost - not earlier accepted ones, not later ones, none in a block
    accepted whole or past the sequence end; the weights reach the loss through the trainer unchanged when 0."""
    from adaflash_ray.distill.losses import first_rejection_weights, student_token_stats

    vocab, hid = 8, 8
    head = torch.eye(vocab, hid)  # logits = hidden: a one-hot hidden state names the student's top-1
    target_ids = torch.tensor([[[1, 2, 3, 4], [5, 6, 7, 0], [1, 1, 1, 1]]])  # [B=1, N=3, bs-1=4]
    student_top1 = torch.tensor([[[1, 2, 0, 0], [6, 6, 7, 0], [1, 1, 1, 1]]])  # rejects at k=3, k=1, never
    valid = torch.tensor([[[True] * 4, [True] * 4, [True, True, True, False]]])
    hidden = torch.nn.functional.one_hot(student_top1[valid], vocab).float()  # [M, H]
    top1, prob = student_token_stats(hidden, head, target_ids, valid, chunk_size=3)
    assert torch.equal(top1, student_top1[valid])
    logits = hidden @ head.T
    assert torch.allclose(prob, torch.softmax(logits, -1).gather(-1, target_ids[valid][:, None])[:, 0])
    w = first_rejection_weights(top1, target_ids, valid, boost=2.0)
    want = torch.ones(valid.shape)
    want[0, 0, 2] = 3.0  # block 0: positions 1, 2 accepted, 3 rejected (4 never verified: 1)
    want[0, 1, 0] = 3.0  # block 1: rejected at its first position, later matches do not count
    assert torch.equal(w, want[valid]), (w, want[valid])  # block 2: accepted whole (its 4th position is invalid)
    assert torch.equal(first_rejection_weights(top1, target_ids, valid, boost=0.0), torch.ones(11))
    with pytest.raises(ValueError):
        student_token_stats(hidden[:3], head, target_ids, valid)
    with pytest.raises(ValueError):
        first_rejection_weights(top1, target_ids, valid, boost=-1.0)


def test_dpace_weights_by_hand():
    """D-PACE (arXiv 2605.18810): w_k = sum_{j >= k} prod_{i <= j} ((1 - a) q_i + a) over a block's valid positions,
    computed here by hand for two blocks (one cut by the sequence end); a = 1 gives #valid - k + 1."""
    from adaflash_ray.distill.losses import dpace_weights

    valid = torch.tensor([[[True, True, True], [True, True, False]]])  # [B=1, N=2, bs-1=3]
    q = torch.tensor([0.5, 0.2, 0.9, 1.0, 0.0])
    w = dpace_weights(q, valid, alpha=0.5)
    s = [0.75, 0.6, 0.95]
    p = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]
    want = [p[0] + p[1] + p[2], p[1] + p[2], p[2], 1.0 + 0.5, 0.5]
    assert torch.allclose(w, torch.tensor(want)), (w, want)
    assert torch.equal(dpace_weights(q, valid, alpha=1.0), torch.tensor([3.0, 2.0, 1.0, 2.0, 1.0]))
    with pytest.raises(ValueError):
        dpace_weights(q, valid, alpha=1.5)
    with pytest.raises(ValueError):
        dpace_weights(q[:3], valid)


def test_trainer_reject_boost_changes_only_the_weights(dist_env, target, trajectories):
    """With reject_boost the first step's loss differs from the plain loss (the rejected positions weigh more) and
    its metrics keep their meaning (same blocks and positions); reject_boost=0 is the plain step exactly."""
    results = []
    for boost in (0.0, 0.0, 4.0):
        drafter_cfg, head_cfg, distill_cfg = _cfgs(zero_stage=0, reject_boost=boost)
        core = dist_env(target, drafter_cfg, head_cfg, distill_cfg, seed=0)
        results.append(core.train_step(trajectories[:3]))
    plain, again, boosted = results
    assert plain["train/loss"] == again["train/loss"]
    assert boosted["train/loss"] != pytest.approx(plain["train/loss"], rel=1e-4)
    assert boosted["train/num_positions"] == plain["train/num_positions"]


def test_trainer_dpace_weighting_changes_the_loss(dist_env, target, trajectories):
    """distill.position_weighting dpace gives a different first-step loss than exp_decay over the same blocks."""
    out = {}
    for mode in ("exp_decay", "dpace"):
        drafter_cfg, head_cfg, distill_cfg = _cfgs(zero_stage=0, position_weighting=mode)
        out[mode] = dist_env(target, drafter_cfg, head_cfg, distill_cfg, seed=0).train_step(trajectories[:3])
    assert out["dpace"]["train/loss"] != pytest.approx(out["exp_decay"]["train/loss"], rel=1e-4)
    assert out["dpace"]["train/num_positions"] == out["exp_decay"]["train/num_positions"]


def test_walk_anchors_are_the_engines_verify_anchors():
    """walk_anchors: from an engine-recorded trajectory, the anchor of each verify step (the first output token, then
    + a + 1 per step; the steps' commits add up to the response); sample_anchors draws round(fraction x N) of its
    anchors from the walk, the rest elsewhere, and exactly as before at fraction 0."""
    from conftest import make_tiny_target

    from adaflash_ray.distill.blocks import walk_anchors
    from adaflash_ray.engine import SamplingParams, SpecEngine

    target = make_tiny_target("llama", vocab_size=16, seed=1, logit_scale=3.0)  # cyclic greedy text: long accepts
    eng = SpecEngine(target, None, None, max_batch_size=1, max_seq_len=128, draft_sources=("ngram",), record=True,
                     record_features=False)
    req = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=60, ignore_eos=True))[0]
    tr = eng.to_trajectory(req)
    walk = walk_anchors(tr)
    acc = tr.num_accepted.astype(int)
    assert acc.max() > 1  # a walk with jumps
    assert 1 + int((acc + 1).sum()) == tr.num_response_tokens  # prefill's token + each step's a + 1
    assert walk[0] == tr.prompt_len and bool((walk[1:] - walk[:-1] >= 1).all())
    expect = [tr.prompt_len + int((acc[:i] + 1).sum()) for i in range(len(acc))]
    assert walk.tolist() == [a for a in expect if a <= tr.num_tokens - 2]
    g0, g1 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    base = sample_anchors(tr.prompt_len, tr.num_tokens, 12, 8, g0)
    assert torch.equal(sample_anchors(tr.prompt_len, tr.num_tokens, 12, 8, g1, walk, 0.0), base)
    mixed = sample_anchors(tr.prompt_len, tr.num_tokens, 12, 8, torch.Generator().manual_seed(4), walk, 0.5)
    assert len(mixed) == 12 and len(set(mixed.tolist())) == 12 and bool((mixed[1:] > mixed[:-1]).all())
    assert len(set(mixed.tolist()) & set(walk.tolist())) >= min(6, len(walk))
    with pytest.raises(ValueError, match="walk_fraction"):
        sample_anchors(tr.prompt_len, tr.num_tokens, 12, 8, None, walk, 1.5)
    assert len(walk_anchors(dataclasses.replace(tr, draft_lens=tr.draft_lens[:0], num_accepted=tr.num_accepted[:0],
                                                step_versions=tr.step_versions[:0]))) == 0
