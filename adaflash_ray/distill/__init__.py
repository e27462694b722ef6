"""On-policy distillation of the DFlash drafter (docs/design/ALGORITHMS.md §3): training blocks from trajectories
(:mod:`~adaflash_ray.distill.blocks`), the chunked mixture reverse-KL and length-head losses
(:mod:`~adaflash_ray.distill.losses`) and the DeepSpeed training core (:mod:`~adaflash_ray.distill.trainer`;
DeepSpeed itself is imported only when a :class:`DistillTrainerCore` is built). No Ray imports here.
"""
from adaflash_ray.distill.blocks import (LOSS_DECAY_GAMMA, Batch, collate, recompute_features, sample_anchors,
                                         with_recomputed_features)
from adaflash_ray.distill.losses import accepted_length, forward_kl_loss, length_loss, mixture_rkl_loss
from adaflash_ray.distill.trainer import DistillModule, DistillTrainerCore

__all__ = ["LOSS_DECAY_GAMMA", "Batch", "collate", "recompute_features", "sample_anchors",
           "with_recomputed_features", "accepted_length", "forward_kl_loss", "length_loss", "mixture_rkl_loss",
           "DistillModule", "DistillTrainerCore"]
