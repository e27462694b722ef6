"""Hot-path kernels of adaflash_ray, each beside the pure-torch reference it is tested against.

This package imports only torch (and triton, where a kernel needs it); see docs/design/ARCHITECTURE.md.

- :mod:`adaflash_ray.kernels.chunked_kl`: per-position distillation terms (hard CE against the teacher argmax,
  reverse / forward KL, and the student's max probability and entropy for the ``cost`` policy's acceptance
  head) computed chunk by chunk over rows, so the fp32 ``[M, V]`` softmax is never materialised for all M
  positions at once (docs/design/ALGORITHMS.md §3).
- :mod:`adaflash_ray.kernels.fused_distill`: the whole weighted mixture loss (CE + reverse / forward KL) with its
  gradient into the drafter's hidden states computed in the forward pass, chunk by chunk (three GEMMs per chunk,
  no gradient for the frozen head); backends ``torch`` (the reference) and ``triton``
  (:mod:`adaflash_ray.kernels.fused_distill_triton`, imported only when used).
- :mod:`adaflash_ray.kernels.lookup_triton`: the device lookup's prompt / suffix lookup proposals in three kernels
  (the reference: :mod:`adaflash_ray.engine.device_lookup`'s tensor ops; imported only when used, on CUDA).
"""
from adaflash_ray.kernels.chunked_kl import chunked_kl_terms, kl_terms
from adaflash_ray.kernels.fused_distill import fused_distill_loss, resolve_loss_impl

__all__ = ["chunked_kl_terms", "fused_distill_loss", "kl_terms", "resolve_loss_impl"]
