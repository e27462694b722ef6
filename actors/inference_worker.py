"""InferenceWorker: a Ray actor that owns one SpecEngine and runs its step loop in a background
thread. Requests arrive through :meth:`submit` / :meth:`generate`; finished requests become
on-policy Trajectories put into the object store and handed (as ObjectRefs) to the
TrajectoryBuffer. New drafter versions are swapped in between engine steps (:meth:`load_drafter`);
requests in flight continue and stay correct (verification is lossless whatever the drafter).
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass

import ray
import torch
from ray.util import metrics as ray_metrics

from adaflash_ray.config import RunConfig
from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats
from adaflash_ray.models import CheckpointError, DrafterModelConfig
from adaflash_ray.models.factory import build_drafter, load_target

class _Pending:
    """A result the engine thread hands back to a caller thread (set once, then ``event`` fires)."""

    __slots__ = ("event", "result", "error")

    def __init__(self):
        self.event, self.result, self.error = threading.Event(), None, None


@dataclass
class _Swap:
    """Command for the engine thread: load (or, with ``rollback``, return to) a drafter version."""

    version: int
    tensors: dict | None  # None with ``receive``: the engine thread receives them from the weight group
    sha256: str | None
    config: DrafterModelConfig | None
    rollback: bool
    done: _Pending
    receive: bool = False


@dataclass
class _CancelRecorded:
    """Command for the engine thread: drop queued (not yet decoding) recorded requests."""

    done: _Pending


@ray.remote(max_concurrency=16)
class InferenceWorker:
    """Args: cfg (RunConfig or its dict), worker_index, buffer (TrajectoryBuffer handle or None),
    registry (WeightRegistry handle or None: a (re)started worker loads its latest version)."""

    def __init__(self, cfg: RunConfig | dict, worker_index: int = 0, buffer=None, registry=None):
        cfg = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
        self.cfg, self.index, self.buffer = cfg, worker_index, buffer
        torch.set_num_threads(cfg.engine.num_threads)
        torch.manual_seed(cfg.seed)
        self.backend = None  # engine.backend sglang: SGLang's DFLASH engine serves, also as self.engine for swaps
        if cfg.engine.backend == "sglang":
            import tempfile

            from adaflash_ray.backends.sglang import SGLangBackend
            workdir = tempfile.mkdtemp(prefix=f"adaflash-sglang-w{worker_index}-")  # version 0 is written here
            self.backend = self.engine = SGLangBackend(cfg, workdir).start()
        else:
            target = load_target(cfg.model)
            drafter, head = build_drafter(target, cfg.drafter, cfg.length_head, seed=cfg.seed)
            lh = cfg.length_head
            self.engine = SpecEngine(target, drafter, head, policy=lh.policy, rate=lh.rate, min_len=lh.min_len,
                                     # always draft: these workers' τ measures each drafter version (the canary's
                                     # rollback, the held-out eval), which steps without drafts would dilute;
                                     # length_head.ar_steps is for serving (Serve replicas) and the bench
                                     ar_steps=False, probe_every=lh.probe_every,
                                     max_batch_size=cfg.engine.max_batch_size, max_seq_len=cfg.engine.max_seq_len,
                                     record=True, record_features=cfg.distill.features == "captured",
                                     seed=cfg.seed + 1000 * worker_index)
            if self.engine.cost_table is not None:  # the cost policy's measured t(B, γ): in the job's log
                t = self.engine.cost_table
                rows = "; ".join(f"B={b}: " + " ".join(f"{c:.2f}" for c in row)
                                 for b, row in zip(t["batch_sizes"], t["costs_ms"]))
                ar = " ".join(f"B={b}: {c:.2f}" for b, c in zip(t["batch_sizes"], t["ar_costs_ms"]))
                print(f"[worker {worker_index}] cost table, ms per step for γ = 1..{len(t['costs_ms'][0])}: {rows}; "
                      f"AR step (γ = 0, no propose): {ar}", flush=True)
        self._weight_group = None  # distill.weight_sync: collective (join_weight_group)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._new: list = []  # (prompt_ids, params, record, pending)
        self._commands: list[_Swap | _CancelRecorded] = []  # applied by the engine thread between steps
        self._num_rejected = 0  # requests refused by the engine (bad ids / over max_seq_len)
        self._last_rejection = ""
        self._num_refused = 0  # versions refused as not newer than the loaded one
        self._num_rollbacks = 0
        self._waiters: dict[str, tuple] = {}
        self._stop = False
        self._dead: Exception | None = None
        self._num_traj = 0
        self._num_traj_tokens = 0
        self._window, self._window_t0 = SpecStats(), time.perf_counter()  # since the last stats() call
        tags = {"worker": str(worker_index)}
        self._g_version = ray_metrics.Gauge("adaflash_drafter_version", "drafter version loaded", tag_keys=("worker",))
        self._g_tau = ray_metrics.Gauge("adaflash_accept_len", "mean committed tokens per verify step (tau)",
                                        tag_keys=("worker",))
        self._h_gamma = ray_metrics.Histogram("adaflash_draft_len", "chosen draft length gamma",
                                              boundaries=list(range(1, 17)), tag_keys=("worker",))
        self._c_tokens = ray_metrics.Counter("adaflash_generated_tokens", "tokens generated", tag_keys=("worker",))
        for m in (self._g_version, self._g_tau, self._h_gamma, self._c_tokens):
            m.set_default_tags(tags)
        self._g_version.set(0)
        if registry is not None:  # a restarted worker catches up with the latest published version
            meta = ray.get(registry.latest_meta.remote())
            if meta is not None:
                tensors = ray.get(ray.get(registry.get.remote(meta["version"]))[0])
                self.engine.load_drafter(tensors, meta["version"], meta["sha256"])
                self._g_version.set(meta["version"])
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine loop (one thread)
    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._wake:
                while not self._stop and not self._new and not self._commands and not eng.has_unfinished():
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    return
                new, self._new = self._new, []
                commands, self._commands = self._commands, []
            for prompt_ids, params, record, pending in new:
                try:
                    # ids unique across workers, restarts and runs: the trainer counts trajectories by them
                    req = eng.add_request(prompt_ids, params, request_id=f"w{self.index}-{uuid.uuid4().hex[:16]}")
                    self._waiters[req.request_id] = (req, record, pending)
                except ValueError as e:  # counted and logged; a waiting caller gets the error, submit() logs only
                    self._num_rejected += 1
                    self._last_rejection = str(e)
                    print(f"[worker {self.index}] request rejected ({len(prompt_ids)} prompt tokens): {e}", flush=True)
                    pending.error = e
                    pending.event.set()
            for cmd in commands:  # between steps, never inside one
                if isinstance(cmd, _CancelRecorded):
                    cmd.done.result = self._cancel_recorded_now()
                    cmd.done.event.set()
                    continue
                try:
                    tensors = self._receive_now() if cmd.receive else cmd.tensors
                    cmd.done.result = self._apply_swap(cmd.version, tensors, cmd.sha256, cmd.config, cmd.rollback)
                    self._g_version.set(eng.drafter_version)
                except Exception as e:  # refused: old drafter stays loaded
                    cmd.done.error = e
                cmd.done.event.set()
            if not eng.has_unfinished():
                continue
            before = eng.stats.copy()
            try:
                finished = eng.step("spec")
            except Exception as e:  # fail every waiting request loudly instead of hanging them
                self._dead = RuntimeError(f"worker {self.index}: engine step failed: {e!r}")
                with self._wake:
                    queued, self._new = self._new, []
                for _, _, _, pending in queued:
                    pending.error = self._dead
                    pending.event.set()
                for _, (_, _, pending) in list(self._waiters.items()):
                    pending.error = self._dead
                    pending.event.set()
                return
            step_stats = eng.stats - before
            self._window = self._window + step_stats  # a new object: stats() swaps it out atomically
            self._c_tokens.inc(max(step_stats.num_generated, 0))
            for req in finished:
                _, record, pending = self._waiters.pop(req.request_id)
                traj_ref = None
                if record and self.buffer is not None and len(req.output_ids) > 0:
                    traj = eng.to_trajectory(req)
                    traj_ref = ray.put(traj)
                    self.buffer.add.remote([traj_ref], traj.drafter_version, traj.num_response_tokens)
                    self._num_traj += 1
                    self._num_traj_tokens += traj.num_response_tokens
                for g in req.draft_lens:
                    self._h_gamma.observe(g)
                pending.result = {"request_id": req.request_id, "output_ids": list(req.output_ids),
                                  "finish_reason": req.finish_reason, "draft_lens": list(req.draft_lens),
                                  "num_accepted": list(req.num_accepted), "step_versions": list(req.step_versions)}
                req.feature_chunks, req.hidden_chunks = [], []
                pending.event.set()

    def _enqueue(self, items) -> list[_Pending]:
        if self._dead is not None:
            raise self._dead
        pend = [_Pending() for _ in items]
        with self._wake:
            self._new.extend((p, params, rec, pe) for (p, params, rec), pe in zip(items, pend))
            self._wake.notify()
        return pend

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                 record: bool = False, ignore_eos: bool = False, draft_len: int | None = None) -> list[dict]:
        """Generate for ``prompts`` (token id lists); blocks until all finish. Each result: output_ids,
        finish_reason, per-step draft_lens / num_accepted / step_versions. ``draft_len``: draft this γ every
        step instead of the length policy's (:class:`SamplingParams`; the built-in engine only). Raises
        ValueError for a rejected request (bad length / ids / draft_len) or a draft_len on the SGLang backend."""
        if self.backend is not None:
            if draft_len is not None:
                raise ValueError("draft_len needs engine.backend: torch (SGLang's DFLASH drafts its own γ)")
            return [self._sglang_emit(r) for r in self.backend.generate(prompts, max_new_tokens, temperature,
                                                                         ignore_eos, record)]
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=ignore_eos,
                                 draft_len=draft_len) for _ in prompts]
        pend = self._enqueue([(p, sp, record) for p, sp in zip(prompts, params)])
        out = []
        for pe in pend:
            pe.event.wait()
            if pe.error is not None:
                raise pe.error
            out.append(pe.result)
        return out

    def submit(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0) -> int:
        """Fire-and-forget recorded generation (on-policy data); returns the number queued."""
        if self.backend is not None:
            return self.backend.submit(prompts, max_new_tokens, temperature, self._sglang_emit)
        self._enqueue([(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature), True)
                       for p in prompts])
        return len(prompts)

    def load_drafter(self, version: int, tensors: dict, sha256: str | None = None,
                     config: dict | None = None, timeout_s: float = 600.0) -> dict:
        """Queue a weight swap, applied between engine steps; returns {worker, version, sha256}.
        Versions only move forward: a version <= the loaded one is refused (a late or duplicated
        delivery, a restarted trainer) - except the same version with the same sha256, a harmless
        duplicate, answered with ``already_loaded: True``. Going back takes :meth:`rollback_drafter`.
        Raises CheckpointError if refused (the old drafter stays loaded)."""
        return self._queue_swap(version, tensors, sha256, config, timeout_s, rollback=False)

    def join_weight_group(self, rendezvous: str, world_size: int, rank: int) -> int:
        """Become receiver ``rank`` (>= 1) of the weight broadcast group whose sender (rank 0) is trainer rank
        0 (``distill.weight_sync: collective``). Every member must call it concurrently. Returns ``rank``.
        Raises:
            ValueError: the SGLang backend (its engine lives in another process) or rank < 1."""
        from adaflash_ray.distill.weight_sync import WeightBroadcastGroup

        if self.backend is not None or rank < 1:
            raise ValueError(f"worker {self.index}: collective weight sync needs the built-in engine and a "
                             f"receiver rank >= 1 (backend {self.cfg.engine.backend}, rank {rank})")
        self._weight_group = WeightBroadcastGroup(rendezvous, rank, world_size, self.cfg.model.device,
                                                  self.cfg.distill.weight_sync_timeout_s)
        return rank

    def in_weight_group(self) -> bool:
        """Whether this worker process is (still) a receiver of the weight broadcast group (a restarted
        worker is not: the group's members are fixed when it is built)."""
        return self._weight_group is not None

    def receive_drafter(self, version: int, _ref, sha256: str | None = None, config: dict | None = None,
                        timeout_s: float = 600.0) -> dict:
        """The collective path of a publication (the WeightRegistry calls it): receive the tensors from
        trainer rank 0's broadcast straight into this worker's device, then swap them in exactly as
        :meth:`load_drafter` does (version order, checksum, shapes). Raises RuntimeError when this worker
        is not in a weight group, and whatever the broadcast or the swap raises (the registry then falls
        back to the object store for this worker)."""
        if self._weight_group is None:
            raise RuntimeError(f"worker {self.index}: not in a weight broadcast group (restarted, or a failed receive)")
        return self._queue_swap(version, None, sha256, config, timeout_s, rollback=False, receive=True)

    def _receive_now(self) -> dict:
        """Engine thread only (between steps, so no CUDA-graph capture runs beside it): allocate the receive
        buffers and take part in the broadcast. Any failure leaves the group for good (its collectives would
        be out of step), so the next publication goes through the object store."""
        dtype = getattr(torch, self.cfg.model.dtype)  # the serving dtype the trainer publishes in
        bufs = {k: torch.empty(v.shape, dtype=dtype, device=v.device)
                for k, v in self.engine.drafter_tensors().items()}
        try:
            self._weight_group.broadcast(bufs)
        except BaseException:
            self._leave_weight_group()
            raise
        return bufs

    def _leave_weight_group(self) -> None:
        group, self._weight_group = self._weight_group, None
        if group is not None:
            try:
                group.close()
            except Exception as e:  # noqa: BLE001 - closing a broken group may fail too; the worker goes on
                print(f"[worker {self.index}] closing the weight group failed: {e!r}", flush=True)

    def rollback_drafter(self, version: int, tensors: dict, sha256: str | None = None,
                         config: dict | None = None, timeout_s: float = 600.0) -> dict:
        """Explicitly return to an older (or the same) ``version`` (the τ canary, the held-out evaluation of
        every version); returns {worker, version, sha256, rolled_back_from}. Raises CheckpointError for a
        version newer than the loaded one (that is a :meth:`load_drafter`) or a bad drafter."""
        return self._queue_swap(version, tensors, sha256, config, timeout_s, rollback=True)

    def _queue_swap(self, version, tensors, sha256, config, timeout_s: float, rollback: bool,
                    receive: bool = False) -> dict:
        cfg = DrafterModelConfig(**config) if isinstance(config, dict) else config
        pe = _Pending()
        with self._wake:
            self._commands.append(_Swap(version, tensors, sha256, cfg, rollback, pe, receive))
            self._wake.notify()
        if not pe.event.wait(timeout_s):
            raise TimeoutError(f"worker {self.index}: weight swap to version {version} not applied in {timeout_s}s")
        if pe.error is not None:
            raise CheckpointError(str(pe.error)) if not isinstance(pe.error, CheckpointError) else pe.error
        return pe.result

    def _apply_swap(self, version: int, tensors: dict, sha: str | None, config, rollback: bool) -> dict:
        """Engine thread only: enforce the version order, then swap (issue 9 part 1)."""
        eng = self.engine
        current = eng.drafter_version
        fresh = eng.num_reloads == 0 and version == current == 0  # the initial version-0 load
        if rollback:
            if version > current:
                raise CheckpointError(f"worker {self.index}: rollback to version {version} refused: it is newer "
                                      f"than the loaded version {current} (use load_drafter)")
            out = eng.load_drafter(tensors, version, sha, config, rollback=True)
            self._num_rollbacks += 1
            return {"version": version, "sha256": out, "worker": self.index, "rolled_back_from": current}
        if version <= current and not fresh:
            if version == current and sha is not None and sha == eng.drafter_sha256:
                return {"version": version, "sha256": sha, "worker": self.index, "already_loaded": True}
            self._num_refused += 1
            raise CheckpointError(f"worker {self.index}: drafter version {version} refused: not newer than the "
                                  f"loaded version {current}, which stays loaded (a rollback must name its "
                                  "version through rollback_drafter)")
        return {"version": version, "sha256": eng.load_drafter(tensors, version, sha, config), "worker": self.index}

    def cancel_recorded(self, timeout_s: float = 300.0) -> int:
        """Drop queued (not yet decoding) on-policy data requests, e.g. once training has ended;
        requests already decoding finish normally. Applied by the engine thread between steps.
        Returns how many were dropped."""
        if self.backend is not None:  # SGLang: abort recorded requests in flight
            return self.backend.cancel_recorded()
        pe = _Pending()
        with self._wake:
            self._commands.append(_CancelRecorded(pe))
            self._wake.notify()
        pe.event.wait(timeout_s)
        return pe.result or 0

    def _cancel_recorded_now(self) -> int:  # engine thread only
        cancelled = RuntimeError("cancelled: training ended")
        with self._wake:
            drop = [it for it in self._new if it[2]]
            self._new = [it for it in self._new if not it[2]]
        waiting = [r for r in self.engine.scheduler.waiting if self._waiters[r.request_id][1]]
        for r in waiting:
            self.engine.scheduler.waiting.remove(r)
            drop.append((None, None, None, self._waiters.pop(r.request_id)[2]))
        for *_, pending in drop:
            pending.error = cancelled
            pending.event.set()
        return len(drop)

    def loaded_version(self) -> dict:
        return {"worker": self.index, "version": self.engine.drafter_version, "sha256": self.engine.drafter_sha256}

    def _sglang_emit(self, result: dict) -> dict:
        """SGLang backend: hand a finished request's trajectory to the buffer; the result without it."""
        traj = result.pop("trajectory", None)
        if traj is not None and self.buffer is not None:
            self.buffer.add.remote([ray.put(traj)], traj.drafter_version, traj.num_response_tokens)
            self._num_traj += 1
        for g in result.get("draft_lens", ()):
            self._h_gamma.observe(g)
        return result

    def queue_depth(self) -> int:
        if self.backend is not None:
            return self.backend.queue_depth()
        with self._lock:
            return len(self._new) + self.engine.scheduler.num_unfinished

    def stats(self) -> dict[str, float]:
        """Flat metrics since the last call (window) plus totals; τ = mean(a+1) per verify step."""
        if self.backend is not None:
            return {**self.backend.stats(), "spec/num_refused_versions": float(self._num_refused),
                    "spec/num_rollbacks": float(self._num_rollbacks),
                    "spec/num_rejected_requests": float(self._num_rejected)}
        eng = self.engine
        now = time.perf_counter()
        w, t0 = self._window, self._window_t0
        self._window, self._window_t0 = SpecStats(), now
        out = {**{k: v for k, v in w.as_metrics("spec").items()
                  if k in ("spec/accept_len", "spec/acceptance_rate", "spec/draft_waste", "spec/mean_draft_len")},
               "spec/tokens_per_s": w.num_generated / max(now - t0, 1e-9),
               "spec/drafter_version": float(eng.drafter_version),
               "spec/num_reloads": float(eng.num_reloads),
               "spec/num_refused_versions": float(self._num_refused),
               "spec/num_rollbacks": float(self._num_rollbacks),
               "spec/num_rejected_requests": float(self._num_rejected),
               "spec/num_trajectories": float(self._num_traj),
               "spec/queue_depth": float(self.queue_depth()),
               "spec/total_accept_len": eng.stats.accept_len,
               "spec/engine_dead": float(self._dead is not None)}
        if self._dead is not None:
            out["spec/error"] = str(self._dead)[:1500]
        if w.num_verify_steps:
            self._g_tau.set(out["spec/accept_len"])
        return out

    def current_tensors(self) -> dict:
        """CPU copies of the loaded drafter (+ length head) tensors, checkpoint names."""
        return {k: v.detach().cpu().clone() for k, v in self.engine.drafter_tensors().items()}

    def drafter_config(self) -> dict:
        if self.backend is not None:
            return self.backend.drafter_config.as_dict()
        return self.engine.drafter.config.as_dict()

    def draft_len_histogram(self) -> dict[int, int]:
        if self.backend is not None:
            return self.backend.draft_len_histogram()
        return dict(self.engine.stats.draft_len_hist)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)
        self._leave_weight_group()
        if self.backend is not None:
            self.backend.shutdown()
