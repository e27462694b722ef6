"""The drafter's acceptance on finished text, two ways: at every anchor (what the trainer's block acceptance
averages over its random anchors) and along the walk a greedy verify takes (what serving's τ is).

Given a trajectory (the target's greedy text: prompt of ``P`` tokens, response to position ``T - 1``), one
teacher-forced drafter forward over ALL anchors (:func:`~adaflash_ray.distill.blocks.collate` with every candidate,
features recomputed by the target as the trainer does) gives at each anchor ``p`` the drafter's argmax block and its
accepted length ``a(p)`` against the text (the greedy rule of
:func:`~adaflash_ray.distill.losses.accepted_length`):

- ``block_accept_len`` = mean over anchors ``max(1, P - 1) <= p <= T - 2`` of ``a(p) + 1``, block positions up to
  the text's end (the trainer's ``train/block_accept_len`` with every anchor instead of a sample);
- ``walk_tau``: serving's greedy verify at a fixed γ = block_size - 1 starts its first block at the first response
  token (``p = P``, from the prefill), commits ``a(p) + 1`` tokens with γ capped at ``T - 2 - p`` (the tokens left
  - 1, the engine's cap) and starts the next block there, until ``p = T - 1``; ``walk_tau`` = committed tokens per
  verify step (the engine's τ on that request, when the drafter and the text are the engine's).

The walk visits only the anchors its blocks start at: right after each rejection, and never inside an accepted
run. So ``walk_tau`` is a sample of the anchors biased by the text, and it can fall on either side of
``block_accept_len``. Long runs of easy text and short ones of hard text pull it below. Where acceptance alternates
from one anchor to the next it can lie above. A ``walk_tau`` that differs from the engine's τ on the same text is a
train / serve skew.

    python -m adaflash_ray.distill.walk --recipe recipes/smollm2_135m_gpu.yaml --drafter runs/<run>/checkpoints/v5 \\
        --domains code chat --num-prompts 16 --max-new-tokens 256

decodes the held-out prompts with the engine (the drafter, fixed γ = block_size - 1, greedy), then prints per domain
the engine's τ, ``walk_tau`` and ``block_accept_len`` on the same outputs, and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from adaflash_ray.distill.blocks import collate, with_recomputed_features
from adaflash_ray.trajectory import Trajectory

__all__ = ["anchor_acceptance", "walk_tau", "text_acceptance", "main"]


@torch.no_grad()
def anchor_acceptance(target, drafter, token_ids: torch.Tensor, prompt_len: int, chunk_rows: int = 1024
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted length of the drafter's argmax block at every anchor of one text.

    Args:
        target / drafter: the engine's or trainer's models (the drafter attached to the target's embeddings / head).
        token_ids: ``[T]`` int64, prompt then response. prompt_len: ``P``, ``0 < P < T``.
        chunk_rows: block positions per head matmul (``[chunk_rows, vocab]`` logits alive at a time).
    Returns:
        ``(anchors [N] int64, a [N, block_size] int64)``: the anchors ``max(1, P-1) .. T-2`` and, per anchor and
        γ = 0..block_size-1, the accepted length with at most γ drafts (positions past the text count as rejected).
    Raises:
        ValueError: ``prompt_len`` outside ``(0, T)`` (from :func:`collate`).
    """
    t = int(token_ids.shape[0])
    tr = Trajectory(request_id="walk", token_ids=token_ids.cpu(), prompt_len=prompt_len, features=None,
                    last_hidden=None, drafter_version=0)
    dev = target.lm_head.weight.device
    tr = with_recomputed_features(target, [tr], list(drafter.config.target_layer_ids))[0]
    batch = collate([tr], num_anchors=t, block_size=drafter.block_size,
                    feature_dtype=drafter.fc.weight.dtype).to(dev)
    valid = batch.anchor_valid[0]
    hidden = drafter.forward_train(batch.features, batch.input_ids, batch.anchors)[0, :, 1:]  # [N, bs-1, H]
    n, k = hidden.shape[0], hidden.shape[1]
    flat = hidden.reshape(n * k, -1)
    draft = torch.cat([drafter.logits(flat[s:s + chunk_rows]).argmax(-1) for s in range(0, n * k, chunk_rows)])
    draft = draft.reshape(n, k)
    ok = (draft == batch.target_ids[0]) & (batch.weights[0] > 0)  # [N, bs-1]: right and inside the text
    # accepted with at most γ drafts, γ = 0..bs-1: the leading matches among the first γ positions
    # (accepted_length's rule, every prefix at once)
    a = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=dev), torch.cumprod(ok.long(), 1).cumsum(1)], 1)
    return batch.anchors[0][valid].cpu(), a[valid].cpu()


def walk_tau(anchors: torch.Tensor, accepted: torch.Tensor, prompt_len: int, num_tokens: int,
             max_draft: int | None = None, max_new_tokens: int | None = None) -> tuple[float | None, int]:
    """Serving's greedy walk over one text (module docstring): ``(committed tokens per verify step, steps)``; (None,
    0) when the response has one token (no verify step). ``accepted`` ``[N, bs]`` from :func:`anchor_acceptance`,
    ``max_draft`` the fixed γ (default block_size - 1). ``max_new_tokens``: the request's budget, whose tokens left
    - 1 cap γ as the engine's (default: the text's own length, a request that ended at its budget); a text that
    ended at a stop token may then differ from the engine's τ in its last step (the engine also verifies drafts
    past the stop token, here rejected)."""
    bs = accepted.shape[1]
    g_max = bs - 1 if max_draft is None else min(max_draft, bs - 1)
    end = num_tokens if max_new_tokens is None else prompt_len + max_new_tokens
    row = {int(p): i for i, p in enumerate(anchors.tolist())}
    p, steps, committed = prompt_len, 0, 0
    while p < num_tokens - 1:
        g = max(0, min(g_max, end - 2 - p))
        a = int(accepted[row[p], g])
        p += a + 1
        committed += a + 1
        steps += 1
    return (committed / steps if steps else None), steps


def text_acceptance(target, drafter, texts: list[tuple[list[int], list[int]]], max_new_tokens: int | None = None
                    ) -> dict:
    """Over ``texts`` (prompt ids, response ids): ``block_accept_len`` (mean of a + 1 over every anchor, positions up
    to the text's end, as the trainer's), ``walk_tau`` (committed tokens over verify steps of the walks, γ capped by
    ``max_new_tokens`` as :func:`walk_tau`) and ``num_texts``; the texts with a response of one token are left out."""
    tot_a, n_a, tot_c, n_s, used = 0.0, 0, 0, 0, 0
    for prompt, resp in texts:
        if len(resp) < 2:
            continue
        ids = torch.tensor(list(prompt) + list(resp), dtype=torch.long)
        anchors, acc = anchor_acceptance(target, drafter, ids, len(prompt))
        tot_a += float((acc[:, -1] + 1).sum())
        n_a += len(anchors)
        tau, steps = walk_tau(anchors, acc, len(prompt), len(ids), max_new_tokens=max_new_tokens)
        tot_c += round(tau * steps)
        n_s += steps
        used += 1
    return {"block_accept_len": tot_a / n_a if n_a else None, "walk_tau": tot_c / n_s if n_s else None,
            "num_texts": used}


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring). Exit 0; 2 on a user error (bad recipe, checkpoint or arguments)."""
    from adaflash_ray.bench import DOMAINS, POOLED, domain_prompts
    from adaflash_ray.config import RecipeError, add_recipe_args, config_from_args
    from adaflash_ray.data import ensure_target, load_tokenizer
    from adaflash_ray.engine import SamplingParams, SpecEngine
    from adaflash_ray.models.factory import build_drafter, load_target

    p = argparse.ArgumentParser(prog="python -m adaflash_ray.distill.walk", description=__doc__.split("\n\n")[0])
    add_recipe_args(p)
    p.add_argument("--drafter", help="DFlash checkpoint dir (e.g. runs/<run>/checkpoints/v5); default: the recipe's "
                   "untrained drafter")
    p.add_argument("--domains", nargs="+", default=["code", "chat"], choices=[*DOMAINS, POOLED])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    ns = p.parse_args(argv)
    try:
        cfg = config_from_args(ns)
        if ns.num_prompts < 1 or ns.max_new_tokens < 2:
            raise ValueError("--num-prompts must be >= 1 and --max-new-tokens >= 2")
        torch.set_num_threads(cfg.engine.num_threads)
        target = load_target(cfg.model)
        drafter, _ = build_drafter(target, cfg.drafter, cfg.length_head.model_copy(update={"policy": "fixed"}),
                                   seed=cfg.seed, init_path=ns.drafter)
        tok = load_tokenizer(ensure_target(cfg.model.path or cfg.model.name))
        prompts = {d: domain_prompts(tok, d, ns.num_prompts, cfg.data.max_prompt_tokens, cfg.seed + 1)
                   for d in ns.domains}
    except (RecipeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    longest = max(len(x) for ps in prompts.values() for x in ps)
    # the prefill proposes the first block (as the walk's first anchor does), whatever the recipe's CUDA default
    eng = SpecEngine.from_config(cfg, models=(target, drafter, None), policy="fixed", defer_first_block=False,
                                 max_batch_size=max(len(ps) for ps in prompts.values()),
                                 max_seq_len=-(-(longest + ns.max_new_tokens + drafter.block_size) // 64) * 64)
    out = {}
    for d, ps in prompts.items():
        reqs = eng.generate(ps, SamplingParams(max_new_tokens=ns.max_new_tokens), mode="spec")
        steps = sum(len(r.draft_lens) for r in reqs)
        engine_tau = sum(a + 1 for r in reqs for a in r.num_accepted) / max(steps, 1)
        res = text_acceptance(target, drafter, [(x, r.output_ids) for x, r in zip(ps, reqs)], ns.max_new_tokens)
        out[d] = {"engine_tau": round(engine_tau, 4), **{k: round(v, 4) if isinstance(v, float) else v
                                                         for k, v in res.items()}}
        print(f"{d:5s} engine τ {out[d]['engine_tau']:.3f}  walk τ {out[d]['walk_tau']}  "
              f"every-anchor block acceptance {out[d]['block_accept_len']}  ({res['num_texts']} texts)")
    print(json.dumps({"drafter": ns.drafter or "untrained (recipe init)", "recipe": cfg.name, "max_new_tokens": ns.max_new_tokens,
                      "domains": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
