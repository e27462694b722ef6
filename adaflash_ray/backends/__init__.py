"""Inference backends behind one small protocol (docs/design/ARCHITECTURE.md, "Inference backends").

An :class:`~adaflash_ray.actors.inference_worker.InferenceWorker` serves through one backend, chosen by the recipe's
``engine.backend``:

- ``torch``: the built-in :class:`adaflash_ray.engine.SpecEngine` (driven directly by the worker's step loop);
- ``sglang``: :class:`adaflash_ray.backends.sglang.SGLangBackend`, a real ``sglang.Engine`` with
  ``speculative_algorithm="DFLASH"``. That module is the only one in the project that imports sglang, and it
  does so lazily (inside :meth:`SGLangBackend.start`), so this package imports without sglang installed.

The protocol is what the worker (and Ray Serve) call; every method is blocking and thread-safe::

    backend.generate(prompts, max_new_tokens=64, temperature=0.0, ignore_eos=False, record=False) -> list[dict]
    backend.load_drafter(tensors, version, sha256=None, config=None, rollback=False) -> sha256   # as SpecEngine's
    backend.loaded_version() -> {"version", "sha256"}
    backend.stats() -> dict[str, float]            # the same spec/* keys as the built-in engine's worker

This package imports neither Ray nor ``actors`` (tests/test_layout.py).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["InferenceBackend"]


@runtime_checkable
class InferenceBackend(Protocol):
    """The small engine protocol an InferenceWorker serves through (see the module docstring)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                 ignore_eos: bool = False, record: bool = False) -> list[dict]:
        """One result per prompt, in order: ``request_id``, ``output_ids``, ``finish_reason``, per verify step
        ``draft_lens`` / ``num_accepted`` / ``step_versions``, and ``trajectory`` (a Trajectory or None)."""
        ...

    def load_drafter(self, tensors: dict[str, torch.Tensor], version: int, sha256: str | None = None,
                     config=None, rollback: bool = False) -> str:
        """Swap in drafter ``version`` (arguments and version rule of ``SpecEngine.load_drafter``: versions rise
        unless ``rollback``); returns its sha256; raises CheckpointError (old drafter still loaded) when refused."""
        ...

    def loaded_version(self) -> dict:
        """``{"version": int, "sha256": str}`` of the drafter being served."""
        ...

    def stats(self) -> dict[str, float]:
        """Flat ``spec/*`` metrics since the previous call plus totals."""
        ...
