"""InferenceWorker: a Ray actor that owns one SpecEngine, stepped by an :class:`EngineService` thread.
Requests arrive through :meth:`submit` / :meth:`generate`; finished recorded requests become
on-policy Trajectories put into the object store and handed (as ObjectRefs) to the
TrajectoryBuffer. New drafter versions are swapped in between engine steps (:meth:`load_drafter`);
requests in flight continue and stay correct (verification is lossless whatever the drafter).
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import uuid

import ray
import torch
from ray.util import metrics as ray_metrics

from adaflash_ray.actors.spec_metrics import SpecMetrics
from adaflash_ray.config import RunConfig
from adaflash_ray.engine import EngineService, SamplingParams, SpecEngine, SpecStats, StepEvent
from adaflash_ray.engine.gc_pauses import freeze_gc_heap
from adaflash_ray.models import CheckpointError, DrafterModelConfig
from adaflash_ray.versions import is_newer

_CANCELLED = "cancelled: training ended"  # a recorded request dropped by cancel_recorded()


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
            # always draft (ar_steps off): these workers' τ measures each drafter version (the canary's rollback,
            # the held-out eval), which steps without drafts would dilute; length_head.ar_steps is for serving
            # (Serve replicas) and the bench
            self.engine = SpecEngine.from_config(cfg, ar_steps=False, record=True,
                                                 record_features=cfg.distill.features == "captured",
                                                 seed=cfg.seed + 1000 * worker_index)
            if self.engine.cost_table is not None:  # the cost policy's measured t(B, γ): in the job's log
                t = self.engine.cost_table
                rows = "; ".join(f"B={b}: " + " ".join(f"{c:.2f}" for c in row)
                                 for b, row in zip(t["batch_sizes"], t["costs_ms"]))
                ar = " ".join(f"B={b}: {c:.2f}" for b, c in zip(t["batch_sizes"], t["ar_costs_ms"]))
                print(f"[worker {worker_index}] cost table, ms per step for γ = 1..{len(t['costs_ms'][0])}: {rows}; "
                      f"AR step (γ = 0, no propose): {ar}", flush=True)
        self._weight_group = None  # distill.weight_sync: collective (join_weight_group)
        self._num_rejected = 0  # requests refused by the engine (bad ids / over max_seq_len)
        self._last_rejection = ""
        self._num_refused = 0  # versions refused as not newer than the loaded one
        self._num_rollbacks = 0
        self._num_traj = 0
        self._num_traj_tokens = 0
        self._window, self._window_t0 = SpecStats(), time.perf_counter()  # since the last stats() call
        tags = {"worker": str(worker_index)}
        self._g_tau = ray_metrics.Gauge("adaflash_accept_len", "tau: committed tokens per target step",
                                        tag_keys=("worker",))
        self._g_tau.set_default_tags(tags)
        block_size = (self.backend.drafter_config if self.backend is not None else self.engine.drafter).block_size
        # the vLLM-shaped counters / histograms, the same as the Serve replicas'
        self._metrics = SpecMetrics(block_size, "worker", str(worker_index))
        self._metrics.set_drafter_version(0)
        if registry is not None:  # a restarted worker catches up with the latest published version
            meta = ray.get(registry.latest_meta.remote())
            if meta is not None:
                tensors = ray.get(ray.get(registry.get.remote(version=meta["version"]))[0])
                self.engine.load_drafter(tensors, meta["version"], meta["sha256"])
                self._metrics.set_drafter_version(meta["version"])
        if cfg.engine.gc_freeze and self.backend is None:  # built: the collector skips this heap from now on
            freeze_gc_heap()
        # SGLang schedules its own requests: there the service's thread only applies the drafter swaps
        self.service = EngineService(self.engine, name=f"worker {worker_index}")
        if self.backend is None:
            self.service.subscribe(self._on_step)
            self.service.subscribe(self._metrics.on_step)

    # ------------------------------------------------------------------ engine thread
    def _on_step(self, event: StepEvent) -> None:
        """After every engine step: the stats window, the token counter, and each finished recorded request's
        trajectory to the buffer (before its waiter wakes)."""
        self._window = self._window + event.stats  # a new object: stats() swaps it out atomically
        for h in event.finished:
            req = h.req
            if h.tag and self.buffer is not None and req.output_ids:
                traj = self.engine.to_trajectory(req)
                self.buffer.add.remote([ray.put(traj)], version=traj.drafter_version,
                                       num_tokens=traj.num_response_tokens)
                self._num_traj += 1
                self._num_traj_tokens += traj.num_response_tokens
            req.features = req.last_hidden = None  # in the object store now; the waiter needs only the ids

    def _count_rejection(self, prompt_len: int, fut) -> None:
        err = fut.exception() if not fut.cancelled() else None
        if isinstance(err, ValueError):  # counted and logged; a waiting caller gets the error, submit() logs only
            self._num_rejected += 1
            self._last_rejection = str(err)
            print(f"[worker {self.index}] request rejected ({prompt_len} prompt tokens): {err}", flush=True)

    def _enqueue(self, prompts: list[list[int]], params: list[SamplingParams], record: bool) -> list:
        handles = []
        for p, sp in zip(prompts, params):
            # ids unique across workers, restarts and runs: the trainer counts trajectories by them
            rid = f"w{self.index}-{uuid.uuid4().hex[:16]}"
            h = self._metrics.timed_submit(lambda p=p, sp=sp, rid=rid: self.service.submit(p, sp, tag=record,
                                                                                         request_id=rid))
            h.future.add_done_callback(lambda fut, n=len(p): self._count_rejection(n, fut))
            handles.append(h)
        return handles

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
        out = []
        for h in self._enqueue(prompts, params, record):
            req = h.future.result()  # raises the engine's ValueError, or EngineDead
            if req.finish_reason == "abort":
                raise RuntimeError(_CANCELLED)
            out.append({"request_id": req.request_id, "output_ids": list(req.output_ids),
                        "finish_reason": req.finish_reason, "draft_lens": list(req.draft_lens),
                        "num_accepted": list(req.num_accepted), "step_versions": list(req.step_versions)})
        return out

    def submit(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0) -> int:
        """Fire-and-forget recorded generation (on-policy data); returns the number queued."""
        if self.backend is not None:
            return self.backend.submit(prompts, max_new_tokens, temperature, self._sglang_emit)
        self._enqueue(prompts, [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
                                for _ in prompts], True)
        return len(prompts)

    def start_warm_decode(self, prompts: list[list[int]], time_limit_s: float, batch: int = 64) -> int:
        """The warm start's share of this worker (``distill.warm_start_workers``): once its engine is idle, decode
        ``prompts`` (training prompts, token ids) on the engine thread with the frozen target - AR steps, no drafter
        work, ``engine.max_batch_size`` KV slots, the ``data.sample_fraction`` share sampled - starting none after
        ``time_limit_s`` seconds or after :meth:`stop_warm_decode`
        (:func:`~adaflash_ray.distill.loop.decode_for_training`), and hand the trajectories to the buffer in lists of
        ``batch`` (:meth:`TrajectoryBuffer.add_warm`), then report to it
        (:meth:`TrajectoryBuffer.warm_done`, source ``worker-<index>``: the counts, or the error that stopped the
        decode). Returns at once with the number of prompts queued; the trainer ranks take the text from the buffer.
        Raises:
            ValueError: on the SGLang backend, without a buffer, or with no prompts."""
        if self.backend is not None:
            raise ValueError("the workers' warm-start decode needs engine.backend: torch")
        if self.buffer is None or not prompts:
            raise ValueError("start_warm_decode needs the worker's buffer and at least one prompt")
        from adaflash_ray.distill.loop import decode_for_training

        buf, pending = self.buffer, []

        def flush() -> None:
            if pending:
                buf.add_warm.remote([ray.put(list(pending))])
                pending.clear()

        def keep(traj) -> None:
            pending.append(traj)
            if len(pending) >= batch:
                flush()

        self._warm_stop = threading.Event()
        stop = self._warm_stop

        def run(eng) -> dict:  # engine thread, no request of the service queued or running
            report: dict = {"error": "not started"}
            # the warm decode's AR steps stay out of the serving statistics and the throughput guards' AR baselines
            saved, guards = eng.stats.copy(), (eng.guard, eng.block_guard)
            eng.guard = eng.block_guard = None
            try:
                stats = decode_for_training(eng, self.cfg, prompts, keep, mode="ar", time_limit_s=time_limit_s,
                                            stop=stop.is_set, tag=f"warm-w{self.index}-",
                                            log_prefix=f"[warm start worker {self.index}]")
                flush()
                report = {"num_requests": stats["num_requests"], "num_tokens": stats["num_tokens"],
                          "tokens_per_s": round(stats["tokens_per_s"], 1), "generate_s": round(stats["seconds"], 2)}
            except Exception as e:  # noqa: BLE001 - reported to the trainers, which train on what arrived
                flush()
                report = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            finally:
                eng.stats, (eng.guard, eng.block_guard) = saved, guards
                buf.warm_done.remote(f"worker-{self.index}", report)
            return report

        self._warm_future = self.service.call(run, when_idle=True)
        return len(prompts)

    def stop_warm_decode(self) -> bool:
        """Start no more requests of the warm-start decode (the started ones finish, their text still goes to the
        buffer): the warm start ended without needing the rest. Returns whether a decode had been started."""
        ev = getattr(self, "_warm_stop", None)
        if ev is not None:
            ev.set()
        return ev is not None

    def warm_decode_result(self, timeout_s: float) -> dict:
        """Wait at most ``timeout_s`` seconds for the decode :meth:`start_warm_decode` started; its report (the
        counts, or ``error``: the decode's, the engine's, none started on this worker - e.g. after a restart - or
        a timeout)."""
        fut = getattr(self, "_warm_future", None)
        if fut is None:
            return {"error": "no warm-start decode was started on this worker"}
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return {"error": f"the warm-start decode did not end within {timeout_s:.0f} s"}
        except Exception as e:  # noqa: BLE001 - the engine thread's failure (EngineDead), reported as the decode's
            return {"error": f"{type(e).__name__}: {str(e)[:500]}"}

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

        def swap(eng) -> dict:  # engine thread, between steps
            out = self._apply_swap(version, self._receive_now() if receive else tensors, sha256, cfg, rollback)
            self._metrics.set_drafter_version(eng.drafter_version)
            return out

        fut = self.service.call(swap)
        try:
            return fut.result(timeout_s)
        except CheckpointError:
            raise
        except Exception as e:  # refused (the old drafter stays loaded), or not applied in time
            if not fut.done():
                raise TimeoutError(f"worker {self.index}: weight swap to version {version} not applied in "
                                   f"{timeout_s}s") from None
            raise CheckpointError(str(e)) from e

    def _apply_swap(self, version: int, tensors: dict | None, sha: str | None, config, rollback: bool) -> dict:
        """Engine thread only: enforce the version order (:func:`~adaflash_ray.versions.is_newer`; the same
        version with the same sha256 is a harmless duplicate), then swap."""
        eng = self.engine
        current = eng.drafter_version
        if rollback:
            if version > current:
                raise CheckpointError(f"worker {self.index}: rollback to version {version} refused: it is newer "
                                      f"than the loaded version {current} (use load_drafter)")
            out = eng.load_drafter(tensors, version, sha, config, rollback=True)
            self._num_rollbacks += 1
            return {"version": version, "sha256": out, "worker": self.index, "rolled_back_from": current}
        if not is_newer(version, current, current_published=eng.num_reloads > 0):
            if version == current and sha is not None and sha == eng.drafter_sha256:
                return {"version": version, "sha256": sha, "worker": self.index, "already_loaded": True}
            self._num_refused += 1
            raise CheckpointError(f"worker {self.index}: drafter version {version} refused: not newer than the "
                                  f"loaded version {current}, which stays loaded (a rollback must name its "
                                  "version through rollback_drafter)")
        return {"version": version, "sha256": eng.load_drafter(tensors, version, sha, config), "worker": self.index}

    def cancel_recorded(self, timeout_s: float = 300.0) -> int:
        """Drop queued (not yet decoding) on-policy data requests, e.g. once training has ended;
        requests already decoding finish normally. Applied by the engine thread between steps
        (``SpecEngine.abort``). Returns how many were dropped."""
        if self.backend is not None:  # SGLang: abort recorded requests in flight
            return self.backend.cancel_recorded()
        try:
            return self.service.abort_waiting(lambda h: bool(h.tag)).result(timeout_s)
        except TimeoutError:
            return 0

    def loaded_version(self) -> dict:
        return {"worker": self.index, "version": self.engine.drafter_version, "sha256": self.engine.drafter_sha256}

    def _sglang_emit(self, result: dict) -> dict:
        """SGLang backend: hand a finished request's trajectory to the buffer; the result without it."""
        traj = result.pop("trajectory", None)
        if traj is not None and self.buffer is not None:
            self.buffer.add.remote([ray.put(traj)], version=traj.drafter_version,
                                   num_tokens=traj.num_response_tokens)
            self._num_traj += 1
        if result.get("draft_lens") is not None and result.get("num_accepted") is not None:
            st = SpecStats.from_steps(result["draft_lens"], result["num_accepted"])  # SGLang steps itself
            st.num_generated = len(result.get("output_ids", ()))
            self._metrics.observe_stats(st)
        return result

    def queue_depth(self) -> int:
        if self.backend is not None:
            return self.backend.queue_depth()
        return self.service.num_open

    def stats(self) -> dict[str, float]:
        """Flat metrics since the last call (window) plus totals, :meth:`SpecStats.as_metrics` names: τ
        (``spec/accept_len``) = committed tokens per target step, ``spec/per_draft_accept_len`` = 1 + Σa / #drafts."""
        if self.backend is not None:
            return {**self.backend.stats(), "spec/num_refused_versions": float(self._num_refused),
                    "spec/num_rollbacks": float(self._num_rollbacks),
                    "spec/num_rejected_requests": float(self._num_rejected)}
        eng = self.engine
        now = time.perf_counter()
        w, t0 = self._window, self._window_t0
        self._window, self._window_t0 = SpecStats(), now
        out = {**{k: v for k, v in w.as_metrics("spec").items()
                  if k in ("spec/accept_len", "spec/per_draft_accept_len", "spec/acceptance_rate", "spec/draft_waste",
                           "spec/mean_draft_len")},
               "spec/tokens_per_s": w.num_generated / max(now - t0, 1e-9),
               "spec/drafter_version": float(eng.drafter_version),
               "spec/num_reloads": float(eng.num_reloads),
               "spec/num_refused_versions": float(self._num_refused),
               "spec/num_rollbacks": float(self._num_rollbacks),
               "spec/num_rejected_requests": float(self._num_rejected),
               "spec/num_trajectories": float(self._num_traj),
               "spec/queue_depth": float(self.queue_depth()),
               "spec/total_accept_len": eng.stats.accept_len,
               "spec/engine_dead": float(self.service.dead is not None)}
        if self.service.dead is not None:
            out["spec/error"] = str(self.service.dead)[:1500]
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

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.service.shutdown(timeout_s=10)
        self._leave_weight_group()
        if self.backend is not None:
            self.backend.shutdown()
