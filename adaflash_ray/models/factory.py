"""Build the drafter + length head for a target from the recipe (or a DFlash checkpoint).
Used by the inference engine and the trainer so both hold the same architecture."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from adaflash_ray.models.checkpoint import CheckpointError, check_tensors_fit, load_drafter_checkpoint
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.engine.length_policy import length_policy, policy_of_head_tensors
from adaflash_ray.models.target import TargetModel


def drafter_config_for(target: TargetModel, drafter_cfg) -> DrafterModelConfig:
    """DrafterModelConfig from a recipe ``DrafterConfig`` (adaflash_ray.config) and the target."""
    tcfg = target.config
    ids = drafter_cfg.resolve_target_layer_ids(tcfg.num_hidden_layers)  # the one rule (adaflash_ray.config)
    return DrafterModelConfig.for_target(tcfg, num_hidden_layers=drafter_cfg.num_hidden_layers,
                                         block_size=drafter_cfg.block_size, target_layer_ids=ids,
                                         intermediate_size=drafter_cfg.intermediate_size,
                                         mask_token_id=drafter_cfg.mask_token_id)


def check_checkpoint_matches_recipe(ckpt: DrafterModelConfig, drafter_cfg, where: str) -> None:
    """Raise CheckpointError if a DFlash checkpoint's architecture differs from the recipe's ``drafter`` section
    (``block_size``, ``num_hidden_layers``, ``target_layer_ids``, ``mask_token_id``, ``intermediate_size`` where
    the recipe sets it): the checkpoint would silently win while the recipe's values still size the engine
    (``engine.max_seq_len`` checks use ``drafter.block_size``). The message names each field and both values."""
    ids = drafter_cfg.resolve_target_layer_ids(ckpt.num_target_layers)
    pairs = [("block_size", drafter_cfg.block_size, ckpt.block_size),
             ("num_hidden_layers", drafter_cfg.num_hidden_layers, ckpt.num_hidden_layers),
             ("target_layer_ids", ids, list(ckpt.target_layer_ids)),
             ("mask_token_id", drafter_cfg.mask_token_id, ckpt.mask_token_id)]
    if drafter_cfg.intermediate_size is not None:
        pairs.append(("intermediate_size", drafter_cfg.intermediate_size, ckpt.intermediate_size))
    diff = [f"drafter.{name} {mine} (recipe) != {theirs} (checkpoint)" for name, mine, theirs in pairs if mine != theirs]
    if diff:
        raise CheckpointError(f"{where}: the checkpoint's drafter differs from the recipe: " + "; ".join(diff)
                              + " - set these recipe fields to the checkpoint's values")


def build_drafter(target: TargetModel, drafter_cfg, head_cfg, seed: int = 0,
                  init_path: str | Path | None = None) -> tuple[DFlashDrafter, nn.Module | None]:
    """Create drafter (+ the policy's head, ``LENGTH_POLICIES[head_cfg.policy].head``: ``direct`` ->
    DirectLengthHead, ``cost`` -> AcceptanceHead, ``fixed`` -> none) in the target's dtype/device.

    With ``init_path`` (or ``drafter_cfg.init_path``) the weights come from a DFlash checkpoint;
    raises CheckpointError if it does not fit the target.
    """
    init_path = init_path or drafter_cfg.init_path
    if init_path:
        cfg, tensors, _ = load_drafter_checkpoint(init_path)
        try:
            cfg.check_target(target.config)
        except ValueError as e:
            raise CheckpointError(f"{init_path}: {e}") from e
        if drafter_cfg is not None:
            check_checkpoint_matches_recipe(cfg, drafter_cfg, str(init_path))
    else:
        cfg, tensors = drafter_config_for(target, drafter_cfg), None
    dtype, device = target.lm_head.weight.dtype, target.lm_head.weight.device
    drafter = DFlashDrafter(cfg).attach_target(target.model.embed_tokens, target.lm_head)
    drafter.init_weights(seed)
    if tensors is None and drafter_cfg.init_from_target:
        init_from_target(drafter, target, context=getattr(drafter_cfg, "init_context_from_target", False))
    spec = length_policy(head_cfg.policy)
    if spec.head is not None:
        torch.manual_seed(seed + 1)
    head = spec.build_head(cfg.hidden_size, head_cfg, cfg.block_size)
    if tensors is not None:
        own = {k: v for k, v in tensors.items() if not k.startswith("length_head.")}
        check_tensors_fit(drafter.drafter_state_dict(), own, f"drafter checkpoint {init_path}")
        drafter.load_state_dict(own, strict=False)
        head_t = {k[len("length_head."):]: v for k, v in tensors.items() if k.startswith("length_head.")}
        if head is not None and head_t:
            try:
                check_tensors_fit(head.state_dict(), head_t, f"length head in {init_path}")
            except CheckpointError as e:
                held = policy_of_head_tensors(head_t)
                held = f"the {held!r} policy's" if held is not None else "an unknown"
                raise CheckpointError(f"{e} - the checkpoint holds another policy's head than "
                                      f"length_head.policy {head_cfg.policy!r} builds ({held} head, tensors "
                                      f"{sorted(head_t)}); use the policy it was trained with") from e
            head.load_state_dict(head_t)
    drafter.to(device=device, dtype=dtype)
    if head is not None:
        head.to(device=device, dtype=dtype)
    return drafter, head


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target: TargetModel, context: bool = False) -> None:
    """Warm start: drafter layer i <- target layer ``L - n + i`` (the top n layers; tensors of equal
    shape only: norms, q/k/v/o, MLP) and drafter ``norm`` <- the target's final norm, so the drafter's
    output lands in the space the shared ``lm_head`` expects. ``fc``, ``hidden_norm`` and the mask
    embedding keep their fresh init, so version 0 still proposes near-random drafts (τ ≈ 1).
    Speeds up the first minutes of distillation on small budgets (the CPU recipes). A drafter MLP wider than the
    target's (``drafter.intermediate_size``) takes the target's weights in its leading channels and zero in the extra
    columns of ``down_proj`` (function-preserving widening, as in Net2Net, arXiv 1511.05641): the layer computes what
    the target's does until the extra channels train.

    With ``context``: ``fc.weight`` ``[H, K*Ht]`` becomes the identity on the last (deepest) conditioning layer's
    ``Ht`` columns and zero on the others, and ``hidden_norm`` takes target layer ``L - n``'s input norm: the
    context ``c`` is then that layer's normed input when the deepest conditioning id is ``L - n - 1``, and the
    first drafter layer's context K/V are the target layer's own (up to the drafter's q/k norms).

    Raises:
        ValueError: ``context`` with drafter hidden size != target hidden size.
    """
    n = len(drafter.layers)
    src_layers = target.model.layers[len(target.model.layers) - n:]
    for dst, src in zip(drafter.layers, src_layers):
        src_params = dict(src.named_parameters())
        for name, p in dst.named_parameters():
            sp = src_params.get(name)
            if sp is None:
                continue
            if sp.shape == p.shape:
                p.copy_(sp.to(p.dtype))
            elif _widened_mlp(name, p, sp):  # a wider MLP: the target's in the leading slice, the same function
                if name.endswith("down_proj.weight"):
                    p.zero_()  # the extra intermediate channels add nothing until trained
                p[tuple(slice(0, d) for d in sp.shape)].copy_(sp.to(p.dtype))
    drafter.norm.weight.copy_(target.model.norm.weight.to(drafter.norm.weight.dtype))
    if context:
        h, kh = drafter.fc.weight.shape
        ht = kh // len(drafter.config.target_layer_ids)
        if ht != h:
            raise ValueError(f"init_context_from_target needs the drafter hidden size ({h}) equal to the target's "
                             f"({ht})")
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, kh - ht:].copy_(torch.eye(h, dtype=drafter.fc.weight.dtype))
        drafter.hidden_norm.weight.copy_(src_layers[0].input_layernorm.weight.to(drafter.hidden_norm.weight.dtype))


def _widened_mlp(name: str, p: torch.Tensor, sp: torch.Tensor) -> bool:
    """Whether drafter MLP weight ``p`` is the target's ``sp`` with a larger intermediate size: gate/up ``[I', H]``
    against ``[I, H]``, down ``[H, I']`` against ``[H, I]``, I' > I (``drafter.intermediate_size`` above the
    target's). Copying ``sp`` into the leading slice and zeroing down's extra columns keeps the layer's function."""
    if p.dim() != 2 or sp.dim() != 2:
        return False
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return p.shape[1] == sp.shape[1] and p.shape[0] > sp.shape[0]
    if name.endswith("down_proj.weight"):
        return p.shape[0] == sp.shape[0] and p.shape[1] > sp.shape[1]
    return False


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(model_cfg) -> TargetModel:
    """The recipe's target (``ModelConfig``: ``path`` or registry ``name``, ``dtype``, ``device``),
    converted into the cache on first use (adaflash_ray.data.ensure_target)."""
    from adaflash_ray.data import ensure_target

    return TargetModel.from_pretrained(ensure_target(model_cfg.path or model_cfg.name),
                                       dtype=_DTYPES[model_cfg.dtype], device=model_cfg.device)
