"""The distillation training step: a DeepSpeed engine around the DFlash drafter (+ length head).

:class:`DistillTrainerCore` is the Ray-free core that the ``DistillTrainer`` actor (actors/) wraps:
one instance per data-parallel rank, one process group across ranks (gloo on CPU, NCCL on GPU).
It owns optimisation only; the caller decides which trajectories to feed (version lag filtering)
and when to publish (every ``distill.publish_every`` steps). Objective: docs/design/ALGORITHMS.md §3
(mixture reverse-KL, AdaFlash) plus ``λ·L_len`` for the length head (§2): the MSE of the ``direct`` head,
or the masked per-position BCE of the ``cost`` policy's acceptance head. Run the tests with::

    pytest tests/test_distill.py

CPU notes (DeepSpeed 0.19): ``DS_ACCELERATOR=cpu`` is set by :meth:`DistillTrainerCore.setup_dist_env`;
the optimizer is a client ``torch.optim.AdamW`` (no JIT-compiled DeepSpeed op); DeepSpeed's
shared-memory allreduce op (a C++ extension compiled on first use, ~50 s on 2 cores) is disabled so
gloo does the collectives. ZeRO stages 0-3 initialise and step on CPU with gloo.
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time

import torch
from torch import nn

from adaflash_ray.distill.blocks import Batch, collate, with_recomputed_features
from adaflash_ray.distill.losses import (accepted_length, dpace_weights, first_rejection_weights,
                                         mixture_rkl_loss)
from adaflash_ray.engine.length_policy import length_policy
from adaflash_ray.kernels.fused_distill import resolve_loss_impl
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.models.factory import build_drafter
from adaflash_ray.models.length_head import HeadLossInputs
from adaflash_ray.models.target import TargetModel

_DIST_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
_RENDEZVOUS: dict[str, str] = {}  # "file": the rendezvous file of the process group this process initialised


COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_compute_dtype(name: str, device: torch.device | str, target_dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of the drafter's training forward for ``distill.compute_dtype``, or None (no autocast:
    float32 compute on the float32 weights).

    ``auto``: on CUDA float16 if the target is float16, else bfloat16; on any other device None (float32, the CPU
    numbers stay those of the float32 computation). ``float32``: None. ``bfloat16`` / ``float16``: that dtype on
    any device. The trainable weights and the optimizer state stay float32 in every case (autocast casts copies).
    Raises:
        ValueError: ``name`` not in :data:`COMPUTE_DTYPES`.
    """
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"distill.compute_dtype must be one of {COMPUTE_DTYPES}, got {name!r}")
    if name == "auto":
        if torch.device(device).type != "cuda":
            return None
        return torch.float16 if target_dtype == torch.float16 else torch.bfloat16
    return None if name == "float32" else getattr(torch, name)


def sdpa_backends(name: str):
    """Context for ``distill.attention_backends``: ``auto`` = PyTorch's own SDPA choice (a null context);
    ``no_cudnn`` = flash, memory-efficient or math attention only, never cuDNN (on Hopper PyTorch prefers cuDNN
    attention, which builds an execution plan per new shape: modelscope/FunASR PR #3705 traces a fine-tune's slow
    steps to those builds; ``distill.pad_tokens_multiple`` is the other remedy, keeping cuDNN with few shapes). The
    backward runs the backend its forward chose.

    Raises:
        ValueError: another name.
    """
    if name == "auto":
        return contextlib.nullcontext()
    if name != "no_cudnn":
        raise ValueError(f"distill.attention_backends must be 'auto' or 'no_cudnn', got {name!r}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def lr_factor(warmup_steps: int, decay_steps: int = 0, min_ratio: float = 0.1):
    """The lr multiplier per optimizer step ``s`` (0-based): linear warmup over ``warmup_steps``, then a
    cosine from 1 down to ``min_ratio`` reached at step ``decay_steps`` and held after (0 = constant after
    warmup). The usual LLM schedule (e.g. SpecForge's draft-model training: warmup + cosine)."""
    import math

    def factor(s: int) -> float:
        if warmup_steps and s < warmup_steps:
            return (s + 1) / warmup_steps
        if decay_steps <= warmup_steps:
            return 1.0
        frac = min(1.0, (s - warmup_steps) / (decay_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return factor


class DistillModule(nn.Module):
    """drafter + optional length head; ``forward(batch)`` computes the whole loss.

    The target's embeddings / lm_head are borrowed (not submodules, never trained). The head sees
    ``hidden.detach()`` (no gradient into the drafter, AdaFlash) and trains with its policy's loss
    (``LENGTH_POLICIES[head_cfg.policy].head_loss``). Heads:

    - :class:`DirectLengthHead` (policy ``direct``): ratio from the whole block's hidden states, MSE on
      ``(a + lookahead) / block_size``.
    - :class:`AcceptanceHead` (policy ``cost``): one logit per supervised block position k = 1..bs-1 from the
      drafter's hidden state there (detached) and the student's (max prob, entropy) at T = 1 - taken from the
      distillation loss's own vocabulary pass, so no extra lm_head matmul; labels/mask from
      :func:`acceptance_labels` (greedy acceptance against the trajectory, counted only where every earlier
      draft of the block was accepted); masked mean BCE.

    ``compute_dtype`` (None = float32): the forward runs under ``torch.autocast`` in that dtype. The autocast
    region is opened here, inside the module, because DeepSpeed's engine forward disables an autocast opened
    around it unless its own ``torch_autocast`` section is on.
    """

    def __init__(self, drafter: DFlashDrafter, length_head: nn.Module | None,
                 lm_head: nn.Linear, distill_cfg, head_cfg):
        super().__init__()
        self.drafter = drafter
        self.length_head = length_head
        object.__setattr__(self, "_lm_head", lm_head)
        self.distill_cfg, self.head_cfg = distill_cfg, head_cfg
        self.head_spec = length_policy(head_cfg.policy) if length_head is not None else None
        self.compute_dtype: torch.dtype | None = None

    def forward(self, batch: Batch, fresh: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns ``(loss, metrics)``: loss = mixture RKL (+ λ·length-head loss: MSE for ``direct``, BCE for
        ``cost``), a float32 scalar; metrics are floats (``train/accept_head_acc`` only with the ``cost`` head).
        ``fresh``: optional ``[B]`` bool, the rows trained on for the first time; with some fresh blocks the metrics
        add ``train/block_accept_len_fresh`` (the block acceptance of those rows alone: the drafter's quality on
        text it has not fitted yet) and ``train/num_fresh_blocks``."""
        if self.compute_dtype is None:
            return self._forward(batch, fresh)
        with torch.autocast(batch.input_ids.device.type, dtype=self.compute_dtype):
            return self._forward(batch, fresh)

    def _forward(self, batch: Batch, fresh: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.distill_cfg
        bs = self.drafter.block_size
        hidden = self.drafter.forward_train(batch.features, batch.input_ids, batch.anchors,
                                            attention=getattr(cfg, "drafter_attention", "sdpa"))  # [B, N, bs, H]
        sel = batch.weights > 0  # [B, N, bs-1]
        rows = torch.arange(sel.shape[0], device=sel.device)[:, None, None].expand_as(sel)[sel]  # [M]
        student = hidden[:, :, 1:, :][sel]  # [M, H]
        teacher = batch.last_hidden[rows, batch.teacher_pos[sel]]  # [M, H]
        s_arg = torch.empty(student.shape[0], dtype=torch.long, device=student.device)
        spec = self.head_spec
        conf = (torch.empty(student.shape[0], 2, dtype=torch.float32, device=student.device)
                if spec is not None and spec.needs_confidence
                else None)  # [M, 2] student (max prob, entropy) at T = 1, filled by the loss's vocabulary pass
        weights = batch.weights[sel]  # [M]
        dpace = getattr(cfg, "position_weighting", "exp_decay") == "dpace"
        weights_fn = None
        if cfg.reject_boost > 0 or dpace:  # weights from the drafter's current top-1 / token probability

            def weights_fn(top1: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
                w = dpace_weights(prob, sel, cfg.dpace_alpha) if dpace else weights  # D-PACE replaces exp decay
                if cfg.reject_boost > 0:  # the drafter's own mistakes weigh more (distill.reject_boost, Draft-OPD)
                    w = w * first_rejection_weights(top1, batch.target_ids, sel, cfg.reject_boost)
                return w
        # the fused loss takes top-1 and probability from its own vocabulary pass (no second pass over the head)
        loss, metrics = mixture_rkl_loss(student, teacher, self._lm_head.weight, weights,
                                         alpha=cfg.alpha, temperature=cfg.temperature, clip=cfg.rkl_clip,
                                         clip_mode=cfg.rkl_clip_mode, chunk_size=cfg.loss_chunk_size,
                                         argmax_out=s_arg, confidence_out=conf,
                                         impl=getattr(cfg, "loss_impl", "reference"),
                                         token_ids=batch.target_ids[sel] if weights_fn is not None else None,
                                         weights_fn=weights_fn)
        draft_ids = torch.full_like(batch.target_ids, -1)
        draft_ids[sel] = s_arg
        num_accepted = accepted_length(draft_ids, batch.target_ids, sel)  # [B, N]
        valid = batch.anchor_valid
        len_loss = torch.zeros((), device=loss.device)
        head_acc = None
        if spec is not None:  # the policy's own head loss (LENGTH_POLICIES)
            len_loss, head_acc = spec.head_loss(self.length_head, HeadLossInputs(
                block_hidden=hidden.detach(), draft_hidden=student.detach(), confidence=conf, draft_ids=draft_ids,
                target_ids=batch.target_ids, position_valid=sel, num_accepted=num_accepted, anchor_valid=valid,
                block_size=bs, lookahead=self.head_cfg.lookahead,
                anchor_hidden=batch.last_hidden[torch.arange(valid.shape[0], device=valid.device)[:, None],
                                                batch.anchors - 1]))  # [B, N, H]: the state that gave the anchor
            loss = loss + cfg.length_loss_weight * len_loss
        with torch.no_grad():
            num_blocks = valid.sum()
            accept = ((num_accepted + 1).float() * valid).sum() / num_blocks.clamp_min(1)
            # top-1 agreement at block positions 1..4 (the ones that decide τ), over the positions that exist
            k = min(4, bs - 1)
            hits = ((draft_ids[..., :k] == batch.target_ids[..., :k]) & sel[..., :k]).flatten(0, -2).sum(0)
            per_pos = hits.float() / sel[..., :k].flatten(0, -2).sum(0).clamp_min(1)
            names = ["train/loss", "train/len_loss", "train/block_accept_len", "train/num_blocks",
                     "train/num_positions", *(f"train/top1_pos{i + 1}" for i in range(k))]
            parts = [torch.stack([loss.detach().float(), len_loss.detach().float(), accept,
                                  num_blocks.float(), sel.sum().float()]), per_pos]
            if head_acc is not None:  # one host sync for every metric
                names.append("train/accept_head_acc")
                parts.append(head_acc.float().reshape(1))
            if fresh is not None:
                fv = valid & fresh.to(valid.device)[:, None]  # [B, N]
                names += ["train/block_accept_len_fresh", "train/num_fresh_blocks"]
                parts.append(torch.stack([((num_accepted + 1).float() * fv).sum() / fv.sum().clamp_min(1),
                                          fv.sum().float()]))
            tail = torch.cat(parts).tolist()
        metrics.update(zip(names, tail, strict=True))
        if metrics.get("train/num_fresh_blocks") == 0:
            del metrics["train/block_accept_len_fresh"]  # no fresh block: no value
        return loss, metrics


class DistillTrainerCore:
    """One data-parallel rank of drafter distillation (no Ray).

    Args:
        target: the frozen target (:class:`TargetModel`); its embeddings / lm_head are shared with the
            drafter and it recomputes features when ``distill.features == "recompute"``. Its parameters
            are set to ``requires_grad=False``.
        drafter_cfg, head_cfg, distill_cfg: ``adaflash_ray.config`` sections (DrafterConfig,
            LengthHeadConfig, DistillConfig) or objects with the same fields.
        seed: drafter init seed (identical on every rank; DeepSpeed also broadcasts rank 0's weights);
            anchor sampling uses ``seed`` and ``rank``.
        rank, world_size: this rank in the trainer group. If ``RANK`` etc. are not in the environment
            and ``world_size == 1``, :meth:`setup_dist_env` is called here.
    Trainable parameters and the optimizer state are kept in float32 (ZeRO partitions them); the forward runs
    under autocast in :func:`resolve_compute_dtype` of ``distill.compute_dtype`` (``auto``: bfloat16 on CUDA,
    float16 with a float16 target, float32 on CPU). ``bf16``/``fp16`` DeepSpeed modes are off.
    Raises:
        ValueError: unknown ``distill.features`` or ``distill.compute_dtype``; ``distill.drafter_attention: flex``
            off CUDA; distributed env missing for world_size > 1 or
            inconsistent with ``rank``/``world_size``; the target's device type differs from
            DeepSpeed's accelerator.
    """

    def __init__(self, target: TargetModel, drafter_cfg, head_cfg, distill_cfg, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # lazy: importing it selects the accelerator (DS_ACCELERATOR)
        from deepspeed.accelerator import get_accelerator

        if distill_cfg.features not in ("captured", "recompute"):
            raise ValueError(f"distill.features must be 'captured' or 'recompute', got {distill_cfg.features!r}")
        self.distill_cfg, self.head_cfg = distill_cfg, head_cfg
        self.rank, self.world_size = rank, world_size
        self.target = target.requires_grad_(False)
        self.device = target.lm_head.weight.device
        if self.device.type == "cuda" and distill_cfg.features == "recompute":
            for layer in target.model.layers:  # one GEMM for q/k/v and one for gate/up in the recompute forward
                layer.self_attn.fuse()  # (parameters become views of the fused weights: same names and values)
                layer.mlp.fuse()
        if getattr(distill_cfg, "drafter_attention", "sdpa") == "flex" and self.device.type != "cuda":
            raise ValueError(f"distill.drafter_attention 'flex' needs a CUDA device (flex attention has no backward "
                             f"on {self.device.type})")
        # the loss implementation this trainer runs (an unusable "triton" fails here, not at the first step)
        self.loss_impl = resolve_loss_impl(getattr(distill_cfg, "loss_impl", "reference"), self.device)
        cuda = self.device.type == "cuda"
        accel = get_accelerator().device_name()
        if accel != self.device.type:
            raise ValueError(f"target is on {self.device} but DeepSpeed's accelerator is {accel!r} "
                             "(set DS_ACCELERATOR before deepspeed is first imported)")
        dtype = target.lm_head.weight.dtype
        self.compute_dtype = resolve_compute_dtype(getattr(distill_cfg, "compute_dtype", "auto"), self.device, dtype)
        self.feature_dtype = dtype if cuda else torch.float32

        drafter, head = build_drafter(target, drafter_cfg, head_cfg, seed)
        drafter.float()
        if head is not None:
            head.float()
        if getattr(distill_cfg, "compile_drafter", False):
            drafter.compile_training()
        self.drafter, self.length_head = drafter, head
        self.module = DistillModule(drafter, head, target.lm_head, distill_cfg, head_cfg)
        self.module.compute_dtype = self.compute_dtype
        groups = [{"params": [p for p in drafter.parameters()], "lr": distill_cfg.lr, "name": "drafter"}]
        if head is not None:
            groups.append({"params": [p for p in head.parameters()], "lr": distill_cfg.head_lr, "name": "length_head"})
        optimizer = torch.optim.AdamW(groups, lr=distill_cfg.lr, weight_decay=distill_cfg.weight_decay,
                                      fused=True if cuda else None)  # CUDA: one fused kernel for the whole step
        factor = lr_factor(int(distill_cfg.warmup_steps), int(distill_cfg.lr_decay_steps),
                           float(distill_cfg.lr_min_ratio))

        def scheduler(opt):
            return torch.optim.lr_scheduler.LambdaLR(opt, factor)

        self._init_dist(deepspeed, cuda)
        self.zero_stage = int(distill_cfg.zero_stage)
        if self.zero_stage == 3 and drafter.mask_embedding is not None:
            # forward_train reads mask_embedding outside a submodule call: ZeRO-3 must gather it.
            deepspeed.zero.register_external_parameter(self.module, drafter.mask_embedding)
        self.ds_config = {
            "train_micro_batch_size_per_gpu": 1,  # we pass whole batches of trajectories ourselves
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(distill_cfg.grad_clip),
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=self.module, model_parameters=groups, optimizer=optimizer, lr_scheduler=scheduler,
            config=self.ds_config)
        self.generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + rank)
        self.layer_ids = list(drafter.config.target_layer_ids)

    # ------------------------------------------------------------------ distributed setup
    @staticmethod
    def setup_dist_env(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int | None = None,
                       local_rank: int | None = None) -> int:
        """Set ``RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK`` (and ``DS_ACCELERATOR=cpu``
        when CUDA is unavailable) in ``os.environ``, as DeepSpeed's launcher would (TitanRL/OpenRLHF
        style: the trainer sets them itself).

        Args:
            master_port: None = rank 0 picks a free port on 127.0.0.1 (pass it to the other ranks).
            local_rank: None = ``rank % device_count`` on CUDA (a Ray actor that sees one GPU gets 0),
                ``rank`` on CPU.
        Returns:
            The master port.
        Raises:
            ValueError: rank outside ``[0, world_size)``, or ``master_port`` missing on a rank > 0.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if master_port is None:
            if rank != 0:
                raise ValueError("ranks > 0 need the master_port chosen by rank 0")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                master_port = s.getsockname()[1]
        if local_rank is None:
            local_rank = rank % torch.cuda.device_count() if torch.cuda.is_available() else rank
        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port), LOCAL_RANK=str(local_rank))
        return int(master_port)

    def _init_dist(self, deepspeed, cuda: bool) -> None:
        if not torch.distributed.is_initialized():
            if not all(k in os.environ for k in _DIST_ENV):
                if self.world_size != 1:
                    raise ValueError(f"world_size {self.world_size}: call DistillTrainerCore.setup_dist_env "
                                     f"first (missing {[k for k in _DIST_ENV if k not in os.environ]})")
                self.setup_dist_env(self.rank, 1)
            env = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
            if env != (self.rank, self.world_size):
                raise ValueError(f"env RANK/WORLD_SIZE {env} != trainer rank/world_size "
                                 f"{(self.rank, self.world_size)}")
        else:
            got = (torch.distributed.get_rank(), torch.distributed.get_world_size())
            if got != (self.rank, self.world_size):
                raise ValueError(f"torch.distributed is already initialised as rank/world_size {got}, "
                                 f"trainer wants {(self.rank, self.world_size)}")
        if not cuda:
            _disable_cpu_shm_comm()  # also when torch.distributed was initialised by someone else
        if not torch.distributed.is_initialized() and not cuda and _is_loopback(os.environ["MASTER_ADDR"]):
            # one-node CPU group: rendezvous through a file instead of a TCPStore, which would listen on
            # every interface; gloo's own sockets stay on loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            path = os.path.join(tempfile.gettempdir(), f"adaflash_pg_{os.environ['MASTER_PORT']}")
            torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=self.rank,
                                                 world_size=self.world_size)
            _RENDEZVOUS["file"] = path  # removed by close()
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")

    # ------------------------------------------------------------------ training
    def train_step(self, trajectories: list, fresh: list[bool] | None = None) -> dict[str, float]:
        """One optimizer step on ``trajectories`` (this rank's share of the global batch); ``fresh`` (one bool per
        trajectory: trained on for the first time) adds ``train/block_accept_len_fresh`` and
        ``train/num_fresh_blocks`` (:meth:`DistillModule.forward`).

        Returns flat metrics: ``train/loss, train/ce, train/rkl, train/rkl_raw, train/rkl_clip_frac,
        train/len_loss`` (the length head's MSE - ``direct`` - or masked BCE - ``cost`` -; 0 without a head),
        ``train/accept_head_acc`` (``cost`` only: share of the BCE's positions where ``(logit > 0) == label``),
        ``train/top1_match, train/block_accept_len`` (mean accepted length a + 1 of the
        blocks against the trajectory, the τ convention of docs/design/ALGORITHMS.md §0), ``train/num_blocks,
        train/num_positions, train/step`` (optimizer steps done), ``train/lr`` (drafter lr used by this
        step), ``train/grad_norm`` (global L2 norm before clipping), ``train/seconds`` (the whole step) split
        into ``train/prep_s`` (feature recompute + collate + copy to the device), ``train/forward_s`` (drafter
        + loss) and ``train/backward_step_s`` (backward + optimizer step). Rank-local values
        except ``train/grad_norm`` (of the all-reduced gradient).
        Raises:
            ValueError: empty list or malformed trajectories (see :func:`collate`).
        """
        if not trajectories:
            raise ValueError("train_step needs at least one trajectory")
        t0 = time.perf_counter()
        cfg = self.distill_cfg
        pad_t, pad_n = int(getattr(cfg, "pad_tokens_multiple", 1)), int(getattr(cfg, "pad_anchors_multiple", 1))
        with sdpa_backends(getattr(cfg, "attention_backends", "auto")):
            # a fixed order within the batch (by token ids): the anchors drawn from self.generator, and so the
            # loss, then depend on which trajectories the batch holds, not on the order the buffer received them
            order = sorted(range(len(trajectories)), key=lambda i: trajectories[i].token_ids.tolist())
            trajectories = [trajectories[i] for i in order]
            fresh = None if fresh is None else [fresh[i] for i in order]
            if cfg.features == "recompute":
                trajectories = with_recomputed_features(
                    self.target, trajectories, self.layer_ids, pad_multiple=pad_t,
                    layout=getattr(cfg, "recompute_layout", "padded"),
                    fused=bool(getattr(cfg, "recompute_fused", False)) and self.device.type == "cuda",
                    compiled=bool(getattr(cfg, "recompute_compiled", False)) and self.device.type == "cuda")
            batch = collate(trajectories, cfg.num_anchors, self.drafter.block_size, self.generator,
                            self.feature_dtype, pad_tokens_multiple=pad_t, pad_anchors_multiple=pad_n,
                            walk_anchor_fraction=float(getattr(cfg, "walk_anchor_fraction", 0.0))).to(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # so prep_s holds the recompute forward, not the loss
            t1 = time.perf_counter()
            lr = float(self.engine.get_lr()[0])
            self.engine.train()
            fresh_rows = None if fresh is None else torch.tensor(fresh, dtype=torch.bool)
            loss, metrics = self.engine(batch, fresh_rows)  # autocast inside; ends in one host sync (its metrics)
            t2 = time.perf_counter()
            self.engine.backward(loss)
        grad_norm = self._stage0_grad_norm() if self.zero_stage == 0 else None
        self.engine.step()
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()  # ZeRO optimizers record it (pre-clip)
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer step's kernels belong to this step's time
        t3 = time.perf_counter()
        metrics.update({"train/step": float(self.global_step), "train/lr": lr, "train/seconds": t3 - t0,
                        "train/prep_s": t1 - t0, "train/forward_s": t2 - t1, "train/backward_step_s": t3 - t2})
        return metrics

    def _stage0_grad_norm(self) -> float | None:
        """Pre-clip global L2 grad norm (DeepSpeed's stage-0 engine does not record one)."""
        norms = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.engine.global_steps)

    # ------------------------------------------------------------------ resume (issue 9.2)
    def save_state(self, save_dir: str, tag: str, client_state: dict | None = None, keep: int = 2) -> None:
        """Save drafter, head, optimizer (ZeRO partitions included), lr schedule, step and the anchor
        sampler's RNG under ``save_dir/tag`` (DeepSpeed ``save_checkpoint``; ``latest`` names it), plus
        ``client_state`` (e.g. the version counter). Collective: every rank calls it. Rank 0 then deletes
        all but the newest ``keep`` tags."""
        state = {"adaflash": dict(client_state or {}), "adaflash_generator": self.generator.get_state()}
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=state)
        if self.rank == 0 and keep > 0:
            import shutil

            tags = sorted((p for p in os.scandir(save_dir) if p.is_dir()), key=lambda p: p.stat().st_mtime)
            for old in tags[:-keep]:
                shutil.rmtree(old.path, ignore_errors=True)

    def load_state(self, save_dir: str) -> dict | None:
        """Restore the newest state saved by :meth:`save_state` under ``save_dir``; returns its
        ``client_state`` (without the RNG), or None if there is none. Collective (every rank).
        Raises:
            ValueError: a checkpoint is named by ``latest`` but cannot be loaded (the message says which)."""
        if not os.path.isfile(os.path.join(save_dir, "latest")):
            return None
        path, state = self.engine.load_checkpoint(save_dir, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        if path is None:
            raise ValueError(f"trainer state under {save_dir} could not be loaded (see its `latest` file)")
        state = state or {}
        if "adaflash_generator" in state:
            self.generator.set_state(state["adaflash_generator"])
        return dict(state.get("adaflash", {}))

    # ------------------------------------------------------------------ several ranks (issue 9.8)
    def all_ranks(self, flag: bool) -> bool:
        """True iff ``flag`` holds on every rank (one tiny all-reduce; no-op for one rank). Ranks call it
        to take the same branch - step or skip, continue or stop - so collectives never deadlock."""
        if self.world_size == 1:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return bool(t.item())

    def close(self) -> None:
        """End the process group (after a barrier) and delete the file-rendezvous file it used (each rank
        deletes it after its own destroy, so whichever rank finishes last leaves nothing behind)."""
        if not torch.distributed.is_initialized():
            return
        if self.world_size > 1:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        path = _RENDEZVOUS.pop("file", None)
        if path:  # every rank, after its own destroy (which may touch the file): the last one leaves none
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    # ------------------------------------------------------------------ publication
    def publish_tensors(self) -> dict[str, torch.Tensor]:
        """CPU float32 copies of the drafter weights under DFlash checkpoint names, plus the length head
        under ``length_head.`` - the names ``SpecEngine.load_drafter`` expects
        (``adaflash_ray.engine.engine.SpecEngine.drafter_tensors``). Under ZeRO-3 this gathers the
        partitions: call it on every rank."""
        params = list(self.module.parameters())
        if self.zero_stage == 3:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            out = {k: v.detach().float().cpu().clone() for k, v in self.drafter.drafter_state_dict().items()}
            if self.length_head is not None:
                out.update({f"length_head.{k}": v.detach().float().cpu().clone()
                            for k, v in self.length_head.state_dict().items()})
        return out

    def drafter_model_config(self) -> DrafterModelConfig:
        """The drafter's architecture (for the checkpoint ``config.json`` / ``load_drafter``)."""
        return self.drafter.config


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _disable_cpu_shm_comm() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory allreduce op (``deepspeed_shm_comm``,
    a C++ extension built on the first ``init_distributed`` with the CPU accelerator: ~50 s on 2 cores,
    needs a compiler). Collectives then go through gloo. DeepSpeed caches the probe result in one
    module-level dict (``deepspeed.ops.__compatible_ops__``), so the edit persists."""
    import deepspeed.ops as ds_ops

    ops = ds_ops.__compatible_ops__
    if "deepspeed_shm_comm" in ops:
        ops["deepspeed_shm_comm"] = False


__all__ = ["COMPUTE_DTYPES", "DistillModule", "DistillTrainerCore", "resolve_compute_dtype"]
