"""The drafter's acceptance on finished text (adaflash_ray.distill.walk): the walk a greedy verify takes, computed
from one teacher-forced forward over every anchor, equals the engine's own τ request by request; the CLI on the real
SmolLM2 prints the engine's τ, the walk's and the every-anchor block acceptance."""
from __future__ import annotations

import json

import torch
from conftest import make_drafter, make_tiny_target

from adaflash_ray.distill.walk import anchor_acceptance, main, text_acceptance, walk_tau
from adaflash_ray.engine import SamplingParams, SpecEngine


def test_walk_tau_equals_the_engines_tau_per_request():
    """A 6-token vocabulary, so a random drafter's blocks are sometimes right: the engine (fixed γ = 7, greedy, no
    stop token) and the walk over the same outputs take the same number of verify steps and commit the same tokens;
    the every-anchor acceptance is a different average of the same forward."""
    target = make_tiny_target("llama", vocab_size=6, logit_scale=0.5)
    drafter, _ = make_drafter(target, block_size=8, layers=1, policy="fixed", seed=1, init_from_target=True)
    eng = SpecEngine(target, drafter, None, policy="fixed", max_batch_size=4, max_seq_len=256, use_cuda_graph=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 6, (n,), generator=g).tolist() for n in (5, 9, 17, 30)]
    reqs = eng.generate(prompts, SamplingParams(max_new_tokens=40, stop_token_ids=[]), mode="spec")
    accepted_any = False
    for x, r in zip(prompts, reqs):
        ids = torch.tensor(x + r.output_ids)
        anchors, acc = anchor_acceptance(target, drafter, ids, len(x))
        assert anchors.tolist() == list(range(len(x) - 1, len(ids) - 1)) and acc.shape == (len(anchors), 8)
        assert (acc[:, 0] == 0).all() and (acc[:, 1:] >= acc[:, :-1]).all()  # more drafts never accept fewer
        tau, steps = walk_tau(anchors, acc, len(x), len(ids))
        assert steps == len(r.num_accepted)
        assert tau == sum(a + 1 for a in r.num_accepted) / steps
        accepted_any |= any(a > 0 for a in r.num_accepted)
    assert accepted_any
    res = text_acceptance(target, drafter, [(x, r.output_ids) for x, r in zip(prompts, reqs)])
    assert res["num_texts"] == 4 and res["walk_tau"] > 1.0 and res["block_accept_len"] > 1.0


def test_walk_cli_on_the_real_model(capsys):
    rc = main(["--domains", "code", "--num-prompts", "1", "--max-new-tokens", "12"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = doc["domains"]["code"]
    assert row["num_texts"] == 1 and row["engine_tau"] >= 1.0 and row["walk_tau"] >= 1.0
    assert main(["--num-prompts", "0"]) == 2
