"""The ``bucket`` length policy (docs/design/ALGORITHMS.md §2, policy 2; the AdaFlash seed guide's
``AdaptiveLengthHead``): bucket sizes and labels by hand, the head's loss on a toy batch, the engine policy's
γ = bucket - 1, lossless greedy decoding on a tiny random model with the target's anchor state reaching the head,
a checkpoint round trip of the head's tensors, the trainer training it (ZeRO-3 too) and the bench running
``adaflash-bucket``.

Run: python -m pytest -q tests/test_bucket_head.py   (CPU; the bench and trainer tests take ~1 min each)
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import greedy_reference, make_drafter
from test_distill import NUM_ALL_ANCHORS, _cfgs, _greedy_trajectories, _train_alternating, dist_env, target  # noqa: F401

from adaflash_ray.config import LengthHeadConfig
from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.engine.length_policy import LENGTH_POLICIES, BucketLength, policy_of_head_tensors
from adaflash_ray.models.checkpoint import CheckpointError, save_drafter_checkpoint
from adaflash_ray.models.factory import build_drafter
from adaflash_ray.models.length_head import (BucketLengthHead, HeadLossInputs, bucket_head_loss, bucket_label,
                                             bucket_loss, bucket_sizes)

torch.set_num_threads(1)

HEAD_TENSORS = {"proj.weight", "proj.bias", "out.weight", "out.bias"}


# ----------------------------------------------------------------------------------- sizes and labels by hand
def test_bucket_sizes_are_powers_of_two_then_the_block():
    assert bucket_sizes(16) == [2, 4, 8, 16]  # the guide's G
    assert bucket_sizes(4) == [2, 4]  # the CPU recipes' block
    assert bucket_sizes(24) == [2, 4, 8, 16, 24]  # the guide's extra bucket for 70B+ targets
    assert bucket_sizes(8) == [2, 4, 8] and bucket_sizes(3) == [2, 3] and bucket_sizes(2) == [2]
    with pytest.raises(ValueError, match="block_size >= 2"):
        bucket_sizes(1)


def test_bucket_label_by_hand():
    """Smallest bucket >= a + 1: a = 0 -> 2 ... a = 15 (every draft of a block of 16 accepted) -> 16."""
    sizes16 = torch.tensor(bucket_sizes(16))
    a = torch.arange(16)
    want = [2, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16]
    assert sizes16[bucket_label(a, sizes16)].tolist() == want
    assert bucket_label(a, sizes16).tolist() == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    sizes4 = torch.tensor(bucket_sizes(4))
    assert sizes4[bucket_label(torch.arange(4), sizes4)].tolist() == [2, 2, 4, 4]
    # any shape; a beyond the block still maps to the largest bucket
    assert bucket_label(torch.tensor([[0, 3], [1, 9]]), sizes4).tolist() == [[0, 1], [0, 1]]


# ----------------------------------------------------------------------------------- head and loss
def test_head_layout_prior_and_registry_row():
    hidden, bs = 32, 16
    head = BucketLengthHead.from_recipe(hidden, LengthHeadConfig(policy="bucket"), bs)
    assert set(head.state_dict()) == HEAD_TENSORS  # the sizes buffer is not a checkpoint tensor
    assert head.proj.weight.shape == (hidden // 4, hidden) and head.out.weight.shape == (4, hidden // 4)
    assert head.sizes.tolist() == [2, 4, 8, 16]
    p = torch.softmax(head(torch.randn(5, hidden)), -1)
    torch.testing.assert_close(p[:, 0], torch.full((5,), 0.9))  # prior: the smallest bucket, whatever h_t
    spec = LENGTH_POLICIES["bucket"]
    assert spec.head is BucketLengthHead and spec.engine_policy is BucketLength and spec.head_loss is bucket_head_loss
    assert set(spec.head_tensors) == HEAD_TENSORS and policy_of_head_tensors(HEAD_TENSORS) == "bucket"
    head.to(torch.bfloat16)
    assert head.sizes.dtype == torch.long and head(torch.randn(2, hidden)).dtype == torch.float32


def test_bucket_loss_masks_and_checks_shapes():
    sizes = torch.tensor([2, 4, 8, 16])
    logits = torch.zeros(3, 4, requires_grad=True)
    loss, acc = bucket_loss(logits, torch.tensor([0, 5, 15]), sizes, torch.tensor([True, True, False]))
    assert loss.item() == pytest.approx(float(torch.log(torch.tensor(4.0))))
    assert acc.item() == pytest.approx(0.5)  # argmax 0 everywhere: right for a = 0, wrong for a = 5
    loss, acc = bucket_loss(logits, torch.tensor([0, 5, 15]), sizes, torch.zeros(3, dtype=torch.bool))
    assert loss.item() == 0.0 and acc.item() == 0.0
    loss.backward()
    assert logits.grad is not None
    with pytest.raises(ValueError, match=r"must be \[N, 4\]"):
        bucket_loss(torch.zeros(3, 3), torch.zeros(3, dtype=torch.long), sizes, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must be \[N, 4\]"):
        bucket_loss(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), sizes, torch.ones(3, dtype=torch.bool))


def _toy_inputs(b: int, n: int, bs: int, hidden: int, anchor_hidden: torch.Tensor | None, num_accepted):
    g = torch.Generator().manual_seed(1)
    return HeadLossInputs(block_hidden=torch.randn(b, n, bs, hidden, generator=g),
                          draft_hidden=torch.randn(b * n * (bs - 1), hidden, generator=g), confidence=None,
                          draft_ids=torch.zeros(b, n, bs - 1, dtype=torch.long),
                          target_ids=torch.zeros(b, n, bs - 1, dtype=torch.long),
                          position_valid=torch.ones(b, n, bs - 1, dtype=torch.bool), num_accepted=num_accepted,
                          anchor_valid=torch.ones(b, n, dtype=torch.bool), block_size=bs, lookahead=1,
                          anchor_hidden=anchor_hidden)


def test_bucket_head_loss_decreases_on_a_toy_batch():
    """Accepted lengths that follow the anchor state (a = a linear readout of h_t, binned): a few hundred Adam
    steps take the cross-entropy well below its start and the accuracy far above chance."""
    torch.manual_seed(0)
    hidden, bs, b, n = 32, 16, 8, 16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(b, n, hidden, generator=g)
    score = h @ torch.randn(hidden, generator=g)
    num_accepted = torch.bucketize(score, torch.tensor([-1.0, 0.0, 1.0])) * 4 + 1  # a in {1, 5, 9, 13}
    x = _toy_inputs(b, n, bs, hidden, h, num_accepted)
    head = BucketLengthHead.from_recipe(hidden, LengthHeadConfig(policy="bucket"), bs)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses, accs = [], []
    for _ in range(200):
        loss, acc = bucket_head_loss(head, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        accs.append(acc.item())
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])
    assert accs[-1] > 0.8 and accs[0] < 0.5, (accs[0], accs[-1])
    with pytest.raises(ValueError, match="anchor_hidden"):
        bucket_head_loss(head, _toy_inputs(b, n, bs, hidden, None, num_accepted))


# ----------------------------------------------------------------------------------- the engine policy
def test_policy_maps_the_argmax_bucket_to_gamma():
    hidden, bs = 8, 16
    head = BucketLengthHead(hidden, bs)
    with torch.no_grad():  # whatever h_t: the output bias alone picks the bucket
        head.proj.weight.zero_()
        head.proj.bias.fill_(1.0)
        head.out.weight.zero_()
    policy = LENGTH_POLICIES["bucket"].build_policy(head, bs, rate=1.3, min_len=1, ar_steps=True, probe_every=8)
    block = torch.zeros(4, bs, hidden)
    for k, gamma in enumerate([1, 3, 7, 15]):
        with torch.no_grad():
            head.out.bias.zero_()
            head.out.bias[k] = 1.0
        out = policy(block, None, None, anchor_hidden=torch.randn(4, hidden))
        assert out.dtype == torch.long and out.tolist() == [gamma] * 4
    # per row: a state that picks another bucket per row
    with torch.no_grad():
        head.proj.weight.copy_(torch.eye(2, hidden))
        head.proj.bias.zero_()
        head.out.weight.copy_(torch.tensor([[0.0, 0.0], [5.0, 0.0], [0.0, 5.0], [0.0, 0.0]]))
        head.out.bias.zero_()
    h = torch.zeros(3, hidden)
    h[0, 0], h[1, 1] = 2.0, 2.0  # row 0 -> bucket 4, row 1 -> bucket 8, row 2 (all logits 0) -> bucket 2
    assert policy(torch.zeros(3, bs, hidden), anchor_hidden=h).tolist() == [3, 7, 1]
    # min_len bounds the draft from below; the whole block from above
    tall = BucketLength(head, bs, min_len=5)
    assert tall(torch.zeros(3, bs, hidden), anchor_hidden=h).tolist() == [5, 7, 5]
    assert BucketLength(head, bs, min_len=40)(torch.zeros(3, bs, hidden), anchor_hidden=h).tolist() == [15] * 3
    with pytest.raises(ValueError, match="anchor"):
        policy(torch.zeros(3, bs, hidden))
    with pytest.raises(ValueError, match="policy 'bucket' needs a BucketLengthHead"):
        LENGTH_POLICIES["bucket"].build_policy(None, bs, rate=1.3, min_len=1, ar_steps=True, probe_every=8)


def _assert_gammas(req, num_new: int, allowed: set[int]) -> None:
    """Each step's γ is one of ``allowed`` (the policy's) or the budget's cap: replaying the request's steps, the
    engine drafts min(policy γ, tokens left after the first - 1)."""
    remaining = num_new - 1
    for drafted, accepted in zip(req.draft_lens, req.num_accepted):
        cap = max(remaining - 1, 0)
        assert drafted in allowed and drafted <= cap or drafted == cap, (drafted, cap, req.draft_lens)
        remaining -= accepted + 1


@pytest.mark.parametrize("block_size", [16, 4])
def test_bucket_engine_lossless_and_reads_the_target_anchor_state(tiny_target, block_size):
    """Greedy speculative decoding with the bucket policy (random head output weights, so γ varies) equals the
    cache-free greedy reference, every γ is a bucket - 1 (or the budget's cap), and the state the head reads at
    each propose is the target's final hidden state at position anchor - 1 (a full forward's)."""
    drafter, head = make_drafter(tiny_target, block_size=block_size, policy="bucket", seed=3)
    assert isinstance(head, BucketLengthHead)
    engine = SpecEngine(tiny_target, drafter, head, policy="bucket", max_batch_size=2, max_seq_len=256)
    assert isinstance(engine.runner.length_policy, BucketLength)
    seen = []
    forward = head.forward
    head.forward = lambda h: seen.append(h.clone()) or forward(h)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (7,), generator=g).tolist()
    num_new = 40
    req, = engine.generate([prompt], SamplingParams(max_new_tokens=num_new, ignore_eos=True))
    head.forward = forward
    assert req.output_ids == greedy_reference(tiny_target, prompt, num_new)
    _assert_gammas(req, num_new, {s - 1 for s in bucket_sizes(block_size)})
    if block_size == 16:
        assert len(set(req.draft_lens)) > 1, req.draft_lens  # the head's choice varies
    ids = torch.tensor(prompt + req.output_ids)
    with torch.no_grad():
        ref = tiny_target(ids[None], torch.arange(len(ids))[None]).last_hidden[0]  # [T, H]
    pos = len(prompt) - 1  # the prefill's propose: the state that gave the first token
    assert len(seen) >= len(req.num_accepted)
    for h, a in zip(seen, [None] + list(req.num_accepted)):
        if a is not None:
            pos += a + 1
        torch.testing.assert_close(h[0], ref[pos], atol=1e-4, rtol=1e-4)


def test_bucket_engine_batch_lossless(tiny_target):
    """Two requests of different lengths side by side (the step's anchor states gathered per row)."""
    drafter, head = make_drafter(tiny_target, block_size=8, policy="bucket", seed=4)
    engine = SpecEngine(tiny_target, drafter, head, policy="bucket", max_batch_size=2, max_seq_len=256)
    prompts = [[5, 6, 7], [9, 8, 1, 2, 44, 3, 17, 90, 2]]
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for r, p in zip(reqs, prompts):
        assert r.output_ids == greedy_reference(tiny_target, p, 24)
    assert set(engine.stats.draft_len_hist) <= set(range(8))


def test_bucket_engine_samples_with_the_budget(tiny_target):
    """Sampling (temperature 0.8, top-p 0.9) with the bucket policy: every request ends at its budget with
    in-vocabulary tokens and the same seed reproduces the same output (the policy adds no randomness)."""
    outs = []
    for _ in range(2):
        drafter, head = make_drafter(tiny_target, block_size=8, policy="bucket", seed=6)
        engine = SpecEngine(tiny_target, drafter, head, policy="bucket", max_batch_size=2, max_seq_len=128, seed=3)
        reqs = engine.generate([[1, 2, 3], [7, 7, 9, 4]], SamplingParams(max_new_tokens=20, temperature=0.8,
                                                                          top_p=0.9, ignore_eos=True))
        for r in reqs:
            assert len(r.output_ids) == 20 and all(0 <= t < 128 for t in r.output_ids)
            _assert_gammas(r, 20, {1, 3, 7})
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]


# ----------------------------------------------------------------------------------- checkpoint round trip
def test_bucket_head_checkpoint_round_trip(tmp_path, tiny_target):
    drafter, head = make_drafter(tiny_target, block_size=4, policy="bucket", seed=5)
    engine = SpecEngine(tiny_target, drafter, head, policy="bucket", max_batch_size=2, max_seq_len=64)
    tensors = {k: v.clone() for k, v in engine.drafter_tensors().items()}
    assert {k for k in tensors if k.startswith("length_head.")} == {f"length_head.{k}" for k in HEAD_TENSORS}
    save_drafter_checkpoint(tmp_path / "ckpt", drafter.config, tensors)
    cfg = LengthHeadConfig(policy="bucket")
    d2, h2 = build_drafter(tiny_target, None, cfg, init_path=tmp_path / "ckpt")
    assert isinstance(h2, BucketLengthHead) and h2.sizes.tolist() == [2, 4]
    assert all(torch.equal(v, tensors[f"length_head.{k}"]) for k, v in h2.state_dict().items())
    assert all(torch.equal(v, tensors[k]) for k, v in d2.drafter_state_dict().items())
    # the bucket head's checkpoint under another policy: refused, naming the policy it holds
    with pytest.raises(CheckpointError, match="the 'bucket' policy's head"):
        build_drafter(tiny_target, None, LengthHeadConfig(policy="cost", hidden_size=16), init_path=tmp_path / "ckpt")
    # and back into a running engine (a weight swap): the loaded head decides the next γ
    moved = dict(tensors)
    moved["length_head.out.bias"] = torch.tensor([0.0, 9.0])  # bucket 4: γ = 3
    moved["length_head.out.weight"] = torch.zeros_like(tensors["length_head.out.weight"])
    engine.load_drafter(moved, version=1)
    assert torch.equal(engine.length_head.out.bias, moved["length_head.out.bias"])
    req, = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert req.output_ids == greedy_reference(tiny_target, [3, 4, 5], 20)
    _assert_gammas(req, 20, {3})
    assert req.draft_lens[0] == 3


# ----------------------------------------------------------------------------------- the trainer
def test_trainer_trains_bucket_head(dist_env, target, tmp_path):
    """policy ``bucket``: the trainer steps the BucketLengthHead (its own lr) on the trajectories' target state
    at each anchor and publishes it under the engine's ``length_head.`` names; restarted from that checkpoint with
    the drafter (nearly) frozen, so that the labels stand still, the cross-entropy falls below that of the best
    constant predictor and the head's accuracy rises above the majority bucket's share."""
    import math

    from adaflash_ray.distill.blocks import collate
    from adaflash_ray.distill.losses import accepted_length

    trajs = _greedy_trajectories(target, num=6, num_new=24, seed=4)
    drafter_cfg, head_cfg, distill_cfg = _cfgs(policy="bucket", zero_stage=0)
    core = dist_env(target, drafter_cfg, head_cfg, distill_cfg, seed=0)
    assert isinstance(core.length_head, BucketLengthHead) and core.length_head.sizes.tolist() == [2, 4]
    assert [g["lr"] for g in core.optimizer.param_groups] == pytest.approx([3e-3, 2e-3])
    before = core.publish_tensors()
    _, _, m = _train_alternating(core, trajs, 30, check=lambda m: (
        0.0 <= m["train/accept_head_acc"] <= 1.0 and m["train/len_loss"] > 0.0))
    after = core.publish_tensors()
    hidden = target.config.hidden_size
    head_names = {f"length_head.{k}" for k in HEAD_TENSORS}
    assert set(after) == set(core.drafter.drafter_state_dict()) | head_names
    assert after["length_head.proj.weight"].shape == (hidden // 4, hidden)
    assert after["length_head.out.weight"].shape == (2, hidden // 4)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in after.values())
    assert not before["length_head.out.weight"].any() and after["length_head.out.weight"].abs().max() > 1e-3
    for k in head_names:  # every head tensor moved (weight_decay 0: only gradients move them)
        assert float((after[k] - before[k]).abs().max()) > 1e-4, k

    # phase 2: start from the published checkpoint (drafter + head), drafter lr ~ 0, every anchor each step
    save_drafter_checkpoint(tmp_path / "v1", core.drafter_model_config(), after)
    drafter2 = drafter_cfg.model_copy(update={"init_path": str(tmp_path / "v1")})
    _, _, distill2 = _cfgs(policy="bucket", zero_stage=0, lr=1e-8, head_lr=3e-2, num_anchors=NUM_ALL_ANCHORS)
    core2 = dist_env(target, drafter2, head_cfg, distill2, seed=1)
    metrics = [core2.train_step(trajs) for _ in range(40)]
    ce = [m["train/len_loss"] for m in metrics]
    accs = [m["train/accept_head_acc"] for m in metrics]
    # the labels the head was fitted to: every anchor (the batch of every step), the frozen drafter's greedy drafts
    full = collate(trajs, NUM_ALL_ANCHORS, 4, torch.Generator(), torch.float32)
    exists = full.weights > 0
    with torch.no_grad():
        drafts = core2.drafter.logits(core2.drafter.forward_train(full.features, full.input_ids,
                                                                  full.anchors)[:, :, 1:]).argmax(-1)
    a = accepted_length(drafts.masked_fill(~exists, -1), full.target_ids, exists)
    label = bucket_label(a, torch.tensor([2, 4]))[full.anchor_valid]
    rate = float(label.float().mean())  # share of bucket 4 (a >= 2)
    assert 0.05 < rate < 0.95, rate
    const_ce = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    print(f"bucket 4 share {rate:.3f}, CE {ce[0]:.3f} -> {ce[-1]:.3f} (constant {const_ce:.3f}), acc {accs[-1]:.3f}")
    assert ce[-1] < 0.6 * ce[0], (ce[0], ce[-1])
    assert ce[-1] < 0.9 * const_ce, (ce[-1], const_ce)
    assert accs[-1] > max(rate, 1 - rate), (accs[-1], rate)


def test_zero3_partitions_the_bucket_head_like_stage0(dist_env, target):
    """ZeRO-3 partitions and gathers the BucketLengthHead (its ``sizes`` buffer stays whole) and reproduces stage
    0's losses and published head under a fixed seed."""
    trajs = _greedy_trajectories(target, num=3, num_new=16, seed=2, dtype=torch.float32)
    runs = []
    for stage in (0, 3):
        core = dist_env(target, *_cfgs("bucket", zero_stage=stage), seed=1)
        runs.append(([core.train_step(trajs)["train/loss"] for _ in range(3)], core.publish_tensors()))
        assert core.length_head.sizes.tolist() == [2, 4]
    (loss0, t0), (loss3, t3) = runs
    assert loss3 == pytest.approx(loss0, rel=1e-4, abs=1e-5)
    assert {f"length_head.{k}" for k in HEAD_TENSORS} <= set(t3) and set(t3) == set(t0)
    for k in t0:
        torch.testing.assert_close(t3[k], t0[k], atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------- the bench
def test_bench_runs_adaflash_bucket(capsys):
    """``python -m adaflash_ray.bench`` with method ``adaflash-bucket`` (real SmolLM2, CPU, tiny sizes): a row per
    cell, lossless, its γ histogram within the buckets' γ (or the budget's cap)."""
    from adaflash_ray.bench import known_methods, main

    assert "adaflash-bucket" in known_methods()
    rc = main(["--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "8", "--domains", "qa",
               "--methods", "ar", "adaflash-bucket"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"ar", "adaflash-bucket"}
    row = rows["adaflash-bucket"]
    assert row["lossless"] is True and row["match_rate"] == 1.0 and 1.0 <= row["tau"] <= doc["block_size"]
    assert sum(row["gamma_hist"].values()) == row["num_engine_steps"] and row["gamma_hist"]
