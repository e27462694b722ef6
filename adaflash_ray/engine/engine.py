"""SpecEngine: the built-in batched speculative-decoding engine (CPU and GPU, PyTorch).

    engine = SpecEngine.build(model_dir, drafter_cfg_or_ckpt, engine_cfg, length_policy="direct")
    outs = engine.generate([prompt_ids, ...], SamplingParams(max_new_tokens=64))
    engine.load_drafter(tensors, version=3)   # between steps; in-flight requests continue

``step()`` = admit + prefill new requests, one speculative step for all running ones, finish
the ones that hit EOS or their budget. Finished requests become :class:`Trajectory` records when
``record=True``. Verification is lossless: greedy output is token-for-token the target's greedy
output (tests/test_engine.py), sampled output follows the target distribution (χ² test).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from adaflash_ray.engine.length_policy import DirectLength, FixedLength
from adaflash_ray.engine.request import Request, SamplingParams, Status
from adaflash_ray.engine.runner import ModelRunner
from adaflash_ray.engine.scheduler import Scheduler
from adaflash_ray.models.checkpoint import CheckpointError, check_tensors_fit, tensors_sha256
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.models.length_head import DirectLengthHead
from adaflash_ray.models.target import TargetModel
from adaflash_ray.trajectory import Trajectory


@dataclass
class SpecStats:
    """Running speculative-decoding statistics. τ = mean committed tokens per verify step = mean(a+1)."""

    num_verify_steps: int = 0  # per request-step
    num_drafted: int = 0  # Σγ
    num_accepted: int = 0  # Σa
    num_generated: int = 0
    num_engine_steps: int = 0
    decode_seconds: float = 0.0
    draft_len_hist: Counter = field(default_factory=Counter)

    @property
    def accept_len(self) -> float:  # τ
        return (self.num_accepted + self.num_verify_steps) / max(self.num_verify_steps, 1)

    @property
    def draft_waste(self) -> float:
        return 1.0 - self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def as_metrics(self, prefix: str = "spec") -> dict[str, float]:
        return {f"{prefix}/accept_len": self.accept_len,
                f"{prefix}/acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
                f"{prefix}/draft_waste": self.draft_waste,
                f"{prefix}/mean_draft_len": self.num_drafted / max(self.num_verify_steps, 1),
                f"{prefix}/num_verify_steps": float(self.num_verify_steps),
                f"{prefix}/num_generated": float(self.num_generated),
                f"{prefix}/decode_tokens_per_s": self.num_generated / self.decode_seconds if self.decode_seconds else 0.0}


class SpecEngine:
    """Facade over Scheduler (request state) and ModelRunner (tensors).

    Args:
        target: the target model. drafter: a DFlash drafter attached to the target (None = AR only).
        length_head: the ``direct`` head (None with policy "fixed").
        policy: "direct" | "fixed". max_batch_size: KV slots. max_seq_len: positions per slot.
        record: keep features and build a Trajectory per finished request.
    """

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, length_head: DirectLengthHead | None,
                 *, policy: str = "direct", rate: float = 1.3, min_len: int = 1, max_batch_size: int = 8,
                 max_seq_len: int = 1024, layer_ids: list[int] | None = None, record: bool = False,
                 seed: int = 0, drafter_version: int = 0):
        self.target, self.drafter, self.length_head = target, drafter, length_head
        if drafter is not None:
            drafter.config.check_target(target.config)
            layer_ids = drafter.config.target_layer_ids
            bs = drafter.block_size
            if policy == "direct":
                if length_head is None:
                    raise ValueError("policy 'direct' needs a length head")
                self.policy = DirectLength(length_head, bs, rate, min_len)
            elif policy == "fixed":
                self.policy = FixedLength(bs)
            else:
                raise ValueError(f"unknown length policy {policy!r} (expected 'direct' or 'fixed')")
        else:
            self.policy = None
        self.layer_ids = list(layer_ids or target.default_layer_ids(5))
        self.max_seq_len = max_seq_len
        self.scheduler = Scheduler(max_batch_size)
        self.runner = ModelRunner(target, drafter, self.policy, num_slots=max_batch_size, max_seq_len=max_seq_len,
                                  layer_ids=self.layer_ids)
        self.record = record
        self.stats = SpecStats()
        self.drafter_version = drafter_version
        self.drafter_sha256 = tensors_sha256(self.drafter_tensors()) if drafter is not None else None
        self.num_reloads = 0
        self.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self._finished: list[Request] = []

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue a request. Raises ValueError for an empty prompt, out-of-vocabulary ids, or a
        prompt + max_new_tokens (+ block_size headroom) longer than max_seq_len."""
        params = params or SamplingParams()
        params.validate()
        if not prompt_ids:
            raise ValueError("empty prompt")
        vocab = self.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        headroom = self.drafter.block_size if self.drafter is not None else 1
        need = len(prompt_ids) + params.max_new_tokens + headroom
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) + "
                             f"{headroom} exceeds max_seq_len {self.max_seq_len}")
        if params.stop_token_ids is None and not params.ignore_eos:
            params.stop_token_ids = list(self.target.config.eos_token_ids)
        req = Request(prompt_ids=list(prompt_ids), params=params)
        if request_id is not None:
            req.request_id = request_id
        self.scheduler.add(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ stepping
    def step(self, mode: str = "spec") -> list[Request]:
        """Admit + prefill, one decode step for all running requests; returns requests finished now."""
        if mode == "spec" and self.drafter is None:
            mode = "ar"
        finished: list[Request] = []
        for req in self.scheduler.admit():
            tok, feats, hid = self.runner.prefill(req.slot, req.prompt_ids, req.params.temperature, self.generator)
            if self.record or self.drafter is not None:
                req.feature_chunks.append(feats)
                req.hidden_chunks.append(hid if self.record else hid[:0])
            self._commit(req, [tok], finished)
        running = list(self.scheduler.running)
        if not running:
            return finished
        t0 = time.perf_counter()
        temps = {r.params.temperature for r in running}
        groups = [[r for r in running if r.params.temperature == t] for t in sorted(temps)]
        for group in groups:
            res = self.runner.step([r.slot for r in group], [r.last_token for r in group],
                                   [r.num_tokens - 1 for r in group], [r.remaining - 1 for r in group], mode,
                                   group[0].params.temperature, self.generator)
            for i, req in enumerate(group):
                a = res.num_accepted[i]
                if mode == "spec":
                    req.draft_lens.append(res.draft_lens[i])
                    req.num_accepted.append(a)
                    req.step_versions.append(self.drafter_version)
                    if req.first_version is None:
                        req.first_version = self.drafter_version
                    self.stats.num_verify_steps += 1
                    self.stats.num_drafted += res.draft_lens[i]
                    self.stats.num_accepted += a
                    self.stats.draft_len_hist[res.draft_lens[i]] += 1
                if self.record or self.drafter is not None:
                    req.feature_chunks.append(res.features[i, : a + 1])
                    if self.record:
                        req.hidden_chunks.append(res.last_hidden[i, : a + 1])
                self._commit(req, res.committed[i], finished)
        self.stats.num_engine_steps += 1
        self.stats.decode_seconds += time.perf_counter() - t0
        return finished

    def _commit(self, req: Request, tokens: list[int], finished: list[Request]) -> None:
        stop = set(req.params.stop_token_ids or [])
        reason = None
        for n, tok in enumerate(tokens):
            if tok in stop:
                tokens, reason = tokens[: n + 1], "stop"
                break
        if len(tokens) >= req.remaining:
            tokens, reason = tokens[: req.remaining], reason or "length"
        req.output_ids.extend(tokens)
        self.stats.num_generated += len(tokens)
        if reason is not None:
            # features cover positions < num_tokens-1: drop rows past the truncation point
            n_feat = req.num_tokens - 1
            if req.feature_chunks:
                total = sum(c.shape[0] for c in req.feature_chunks)
                if total > n_feat:
                    cut = total - n_feat
                    req.feature_chunks[-1] = req.feature_chunks[-1][: req.feature_chunks[-1].shape[0] - cut]
                    if self.record:
                        req.hidden_chunks[-1] = req.hidden_chunks[-1][: req.hidden_chunks[-1].shape[0] - cut]
            self.scheduler.finish(req, reason)
            finished.append(req)
            if not self.record:
                req.feature_chunks, req.hidden_chunks = [], []

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, mode: str = "spec",
                 on_step=None) -> list[Request]:
        """Run ``prompts`` to completion (continuous batching); returns requests in input order.
        ``on_step(engine)`` is called between steps (e.g. to hot-swap drafter weights)."""
        reqs = [self.add_request(p, SamplingParams(**vars(params)) if params else None) for p in prompts]
        while any(r.status != Status.FINISHED for r in reqs):
            self.step(mode)
            if on_step is not None:
                on_step(self)
        return reqs

    # ------------------------------------------------------------------ trajectories
    def to_trajectory(self, req: Request) -> Trajectory:
        """Build the on-policy record of a finished request (needs ``record=True``)."""
        if not self.record:
            raise RuntimeError("engine was built with record=False")
        feats = torch.cat(req.feature_chunks).to(torch.bfloat16).cpu()
        hid = torch.cat(req.hidden_chunks).to(torch.bfloat16).cpu()
        traj = Trajectory(request_id=req.request_id,
                          token_ids=torch.tensor(req.prompt_ids + req.output_ids, dtype=torch.long),
                          prompt_len=len(req.prompt_ids), features=feats, last_hidden=hid,
                          drafter_version=req.first_version if req.first_version is not None else self.drafter_version,
                          draft_lens=np.asarray(req.draft_lens, np.int16),
                          num_accepted=np.asarray(req.num_accepted, np.int16),
                          step_versions=np.asarray(req.step_versions, np.int32))
        traj.validate()
        return traj

    # ------------------------------------------------------------------ hot reload
    def drafter_tensors(self) -> dict[str, torch.Tensor]:
        """Current drafter (+ length head under ``length_head.``) weights, checkpoint names."""
        out = dict(self.drafter.drafter_state_dict())
        if self.length_head is not None:
            out.update({f"length_head.{k}": v.detach() for k, v in self.length_head.state_dict().items()})
        return out

    @torch.no_grad()
    def load_drafter(self, tensors: dict[str, torch.Tensor], version: int, sha256: str | None = None,
                     config: DrafterModelConfig | None = None) -> str:
        """Swap in new drafter weights between steps; running requests continue.

        The new values are copied into the existing parameters (CUDA-graph safe) and every running
        request's drafter context is recomputed from its stored target features. Returns the sha256.

        Raises:
            CheckpointError: the config does not fit the target (vocabulary, width, layers), tensors
                are missing / mis-shaped / non-finite, or the sha256 does not match. The old
                drafter stays loaded.
        """
        if self.drafter is None:
            raise CheckpointError("engine has no drafter to reload")
        if config is not None:
            try:
                config.check_target(self.target.config)
            except ValueError as e:
                raise CheckpointError(str(e)) from e
            mine = self.drafter.config
            if (config.block_size, config.target_layer_ids, config.num_hidden_layers) != \
                    (mine.block_size, mine.target_layer_ids, mine.num_hidden_layers):
                raise CheckpointError("drafter architecture differs from the loaded one (block_size, "
                                      "target_layer_ids or num_hidden_layers); restart the worker to change it")
        current = self.drafter_tensors()
        if self.length_head is None:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("length_head.")}
        elif not any(k.startswith("length_head.") for k in tensors):
            current = {k: v for k, v in current.items() if not k.startswith("length_head.")}
        check_tensors_fit(current, tensors, f"drafter version {version}")
        digest = tensors_sha256(tensors)
        if sha256 is not None and digest != sha256:
            raise CheckpointError(f"drafter version {version}: sha256 mismatch ({digest[:12]} != {sha256[:12]})")
        for name, dst in current.items():
            dst.copy_(tensors[name].to(dst.dtype))
        self.drafter_version = version
        self.drafter_sha256 = tensors_sha256(self.drafter_tensors())
        self.num_reloads += 1
        for req in self.scheduler.running:
            if req.feature_chunks:
                self.runner.rebuild_context(req.slot, torch.cat(req.feature_chunks))
        return self.drafter_sha256
