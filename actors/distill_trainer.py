"""DistillTrainer: a Ray actor running one DeepSpeed rank of on-policy drafter distillation.

Lifecycle (driven by adaflash_ray.pipeline):
1. ``DistillTrainer.remote(cfg, rank, world_size)`` - light constructor;
2. ``rank0.master_address()`` -> (addr, port); every rank ``setup(addr, port, state_dir)`` concurrently: sets
   RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK itself, loads the frozen target, builds the
   drafter + length head and ``deepspeed.initialize`` (gloo on CPU, NCCL on GPU), then resumes from the
   newest trainer state under ``state_dir`` if there is one (a restarted actor, ``--resume``);
3. ``run(buffer, registry)`` - the Ray-free :class:`~adaflash_ray.distill.loop.TrainerLoop` (replay pool,
   leases, prefetch, publish cadence, time budget, rank agreement) over two adapters: a trajectory source on
   this rank's lease of the TrajectoryBuffer (ObjectRefs; a trajectory whose producing worker died is skipped
   and counted) and (rank 0) a weight sink on the WeightRegistry (object store, or the collective weight
   group with the object store as fallback).
Metrics are returned to the driver as flat dicts by :meth:`pop_metrics`.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import ray
import torch
from ray.util import metrics as ray_metrics

from adaflash_ray.config import RunConfig
from adaflash_ray.distill.loop import TrainerLoop
from adaflash_ray.models import tensors_sha256
from adaflash_ray.models.factory import load_target


@ray.remote(max_concurrency=4)
class DistillTrainer:
    def __init__(self, cfg: RunConfig | dict, rank: int = 0, world_size: int = 1):
        self.cfg = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
        self.rank, self.world_size = rank, world_size
        self.core = None
        self.loop: TrainerLoop | None = None  # built by setup
        self._metrics: list[dict] = []
        self._lock = threading.Lock()
        self._stop = False
        self.weight_group = None  # distill.weight_sync: collective (rank 0, after join_weight_group)
        self._g_loss = ray_metrics.Gauge("adaflash_train_loss", "distillation loss", tag_keys=("rank",))
        self._g_loss.set_default_tags({"rank": str(rank)})

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port for the process-group rendezvous (rank 0)."""
        addr = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        return addr, port

    def setup(self, master_addr: str, master_port: int, state_dir: str | None = None, resume: bool = False) -> dict:
        """Build this rank (see the module docstring). With ``state_dir`` the trainer state is saved there
        with every published version; with ``resume`` too, the newest one found there now is loaded
        (drafter, head, optimizer, lr schedule, step, version counter, anchor RNG, the ids of trajectories
        trained on). Returns ``{rank, num_trainable_params, version, step, resumed}``."""
        from adaflash_ray.distill.trainer import DistillTrainerCore

        cfg = self.cfg
        torch.set_num_threads(cfg.engine.num_threads)
        DistillTrainerCore.setup_dist_env(self.rank, self.world_size, master_addr, master_port)
        os.environ.setdefault("LOCAL_RANK", "0")
        target = load_target(cfg.model)
        self.core = DistillTrainerCore(target, cfg.drafter, cfg.length_head, cfg.distill, seed=cfg.seed,
                                       rank=self.rank, world_size=self.world_size)
        state = self.core.load_state(state_dir) if state_dir and resume else None
        self.loop = TrainerLoop(self.core, cfg.distill, seed=cfg.seed, rank=self.rank,
                                serving_dtype=getattr(torch, cfg.model.dtype),  # float32 | bfloat16 | float16
                                state_dir=state_dir, state=state, on_metrics=self._record,
                                should_stop=lambda: self._stop)
        n = sum(p.numel() for p in self.core.publish_tensors().values())
        return {"rank": self.rank, "num_trainable_params": n, "version": self.loop.version,
                "step": self.core.global_step, "resumed": state is not None}

    def current_version(self) -> tuple[int, int]:
        """(version counter, optimizer steps) of this rank."""
        return self.loop.version, self.core.global_step

    def initial_weights(self) -> tuple[list, str, dict]:
        """The current weights in the serving dtype - version 0 (untrained) on a fresh start, the saved
        version after a resume: ``([ObjectRef], sha256, drafter config dict)``. Every rank calls it
        (ZeRO-3 gathers)."""
        tensors = self.loop.serving_tensors()
        return [ray.put(tensors)], tensors_sha256(tensors), self.core.drafter_model_config().as_dict()

    def run(self, buffer, registry, num_versions: int | None = None) -> dict:
        """Train until ``num_versions`` versions are published (rank 0 publishes): the Ray-free
        :class:`~adaflash_ray.distill.loop.TrainerLoop` over this rank's lease of ``buffer`` and (rank 0)
        ``registry``. Returns its summary: ``{rank, final_version, steps, seconds, num_fresh,
        num_counted_twice, num_lost, num_duplicates_skipped}``."""
        source = _BufferSource(buffer, f"trainer-{self.rank}")
        return self.loop.run(source, _RegistrySink(registry, self), num_versions)

    def warm_start(self, prompts: list[list[int]], registry, warm_buffer=None, num_warm_sources: int = 0,
                   stream: bool = False, expected: int = 0) -> dict:
        """The offline warm start (``distill.warm_start``) on this rank's device, before :meth:`run`: decode
        ``prompts`` (this rank's share of the training prompts, token ids) with the frozen target - AR steps, no
        drafter, ``distill.warm_start_batch_size`` KV slots (None: ``engine.max_batch_size``), the
        ``data.sample_fraction`` share sampled - for at most ``distill.warm_start_generate_s`` seconds, free the
        engine, add this rank's share of the text ``num_warm_sources`` inference workers decoded meanwhile (taken
        from ``warm_buffer``, :meth:`TrajectoryBuffer.take_warm`, waiting for them at most
        ``warm_start_generate_s`` + 300 s more), then train on all of it for ``distill.warm_start_train_s``
        seconds and (rank 0) publish the next version to ``registry`` (:meth:`TrainerLoop.warm_start`). Every rank
        calls it concurrently. With ``stream`` (``distill.warm_start_streaming``) the rank decodes nothing and trains
        on the workers' batches as they arrive (:meth:`TrajectoryBuffer.take_warm_stream`; ``expected``: about how
        many trajectories its share holds, the replay pool's size), ``warm_start_train_s`` counting from its first
        step; should the stream end before any step (no worker's text arrived: the same on every rank), it decodes
        ``prompts`` itself as without ``stream``. Returns ``{rank, num_requests, num_tokens, tokens_per_s,
        generate_s, version, steps}`` (this rank's own decode) plus, with worker sources, ``worker_requests`` /
        ``worker_tokens`` (the trajectories of this rank's share) and ``workers`` (each source's report); a resumed
        rank past version 0 does nothing (``version`` only).
        Raises:
            ValueError: no prompts and no worker sources, or no trajectory with output (own or the workers')."""
        from adaflash_ray.distill.loop import decode_for_training
        from adaflash_ray.engine import SpecEngine

        if self.loop.version > 0:
            return {"rank": self.rank, "version": self.loop.version, "skipped": "resumed past version 0"}
        if not prompts and not num_warm_sources:
            raise ValueError("warm start: no prompts for this rank and no worker decoding a share")
        cfg, dc = self.cfg, self.cfg.distill
        if stream:
            try:
                return self._warm_start_stream(registry, warm_buffer, num_warm_sources, expected)
            except _EmptyStream as e:  # every rank alike (no step trained anywhere): decode this rank's share
                print(f"DistillTrainer rank {self.rank}: {e}; decoding its {len(prompts)} prompts itself", flush=True)
                if not prompts:
                    raise ValueError(f"warm start: {e}, and no prompts for this rank") from None
                num_warm_sources = 0
        trajs: list = []
        stats = {"num_requests": 0, "num_tokens": 0, "tokens_per_s": 0.0, "seconds": 0.0}
        if prompts:  # none: more prompts went to the workers' slots than there were (this rank trains on theirs)
            engine = SpecEngine(self.core.target, None, None, layer_ids=self.core.layer_ids,
                                max_batch_size=dc.warm_start_batch_size or cfg.engine.max_batch_size,
                                max_seq_len=cfg.engine.max_seq_len, record=True,
                                record_features=dc.features == "captured", seed=cfg.seed + 7 + self.rank)
            stats = decode_for_training(engine, cfg, prompts, trajs.append, mode="ar",
                                        time_limit_s=dc.warm_start_generate_s, tag=f"warm{self.rank}-",
                                        log_prefix=f"[warm start rank {self.rank}]")
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the engine's KV cache and graphs back to the device before training
        extra: dict = {}
        if num_warm_sources:  # the workers' share, decoded beside this rank's (they end by the same time limit)
            got = ray.get(warm_buffer.take_warm.remote(num_warm_sources, self.rank, self.world_size,
                                                       dc.warm_start_generate_s + 300.0))
            parts = _get_or_none(got["refs"])  # None: a batch whose worker died before it was read
            theirs = [t for part in parts if part is not None for t in part]
            extra = {"worker_requests": len(theirs), "worker_tokens": sum(t.num_response_tokens for t in theirs),
                     "worker_batches_lost": sum(part is None for part in parts), "workers": got["reports"]}
            trajs += theirs
        if not trajs:
            raise ValueError(f"warm start: none of {len(prompts)} prompts gave output"
                             + (f" and no worker batch arrived ({extra})" if num_warm_sources else ""))
        self._record({"train/step": float(self.core.global_step), "warm/num_requests": float(stats["num_requests"]),
                      "warm/num_tokens": float(stats["num_tokens"]),
                      "warm/tokens_per_s": stats["tokens_per_s"], "warm/generate_s": stats["seconds"],
                      **({"warm/worker_requests": float(extra["worker_requests"]),
                          "warm/worker_tokens": float(extra["worker_tokens"])} if extra else {})})
        out = self.loop.warm_start(trajs, _RegistrySink(registry, self), dc.warm_start_train_s)
        return {"rank": self.rank, "num_requests": stats["num_requests"], "num_tokens": stats["num_tokens"],
                "tokens_per_s": round(stats["tokens_per_s"], 1), "generate_s": round(stats["seconds"], 2),
                "version": out["final_version"], "steps": out["steps"], **extra}

    def _warm_start_stream(self, registry, warm_buffer, num_sources: int, expected: int) -> dict:
        """:meth:`warm_start` with ``stream``: train on the workers' batches as they arrive."""
        from adaflash_ray.distill.loop import StreamSource

        if not num_sources:
            raise ValueError("the streaming warm start needs at least one worker decoding")
        dc, got = self.cfg.distill, {"batches_lost": 0, "reports": {}}
        deadline = time.monotonic() + dc.warm_start_generate_s + 300.0  # as take_warm: a worker that never reports

        def fetch(wait_s: float) -> tuple[list, bool]:
            left = deadline - time.monotonic()
            r = ray.get(warm_buffer.take_warm_stream.remote(self.rank, self.world_size, num_sources,
                                                            max(0.0, min(wait_s, left))))
            parts = _get_or_none(r["refs"])
            got["batches_lost"] += sum(p is None for p in parts)
            if r["done"]:
                got["reports"] = r["reports"]
            return [t for p in parts if p is not None for t in p], r["done"] or left <= 0

        source = StreamSource(fetch)
        t0, steps_before = time.time(), self.core.global_step
        try:
            out = self.loop.warm_start(source, _RegistrySink(registry, self), dc.warm_start_train_s,
                                       pool_size=expected)
        except ValueError as e:
            if self.core.global_step == steps_before:  # the stream ended before any step (the same on every rank)
                raise _EmptyStream(f"the workers' warm-start stream ended with {source.num_fetched} trajectories "
                                   f"and no step ({got['reports']})") from e
            raise
        theirs = source.trajectories
        extra = {"worker_requests": len(theirs), "worker_tokens": sum(t.num_response_tokens for t in theirs),
                 "worker_batches_lost": got["batches_lost"], "workers": got["reports"]}
        self._record({"train/step": float(self.core.global_step), "warm/worker_requests": float(len(theirs)),
                      "warm/worker_tokens": float(extra["worker_tokens"])})
        return {"rank": self.rank, "num_requests": 0, "num_tokens": 0, "tokens_per_s": 0.0, "generate_s": 0.0,
                "streamed": True, "stage_s": round(time.time() - t0, 2), "version": out["final_version"],
                "steps": out["steps"], **extra}

    def join_weight_group(self, rendezvous: str, world_size: int) -> int:
        """Rank 0 only (``distill.weight_sync: collective``): become the sender (group rank 0) of the weight
        broadcast group whose receivers are the inference workers (ranks 1..world_size-1). Every member must
        call its ``join_weight_group`` concurrently. Returns this member's group rank (0).
        Raises:
            ValueError: called on a rank other than 0."""
        from adaflash_ray.distill.weight_sync import WeightBroadcastGroup

        if self.rank != 0:
            raise ValueError(f"only trainer rank 0 sends weights, not rank {self.rank}")
        self.weight_group = WeightBroadcastGroup(rendezvous, 0, world_size, self.core.device,
                                                 self.cfg.distill.weight_sync_timeout_s)
        return 0

    def _broadcast(self, tensors: dict) -> bool:
        """Send ``tensors`` to the group from this GPU; on failure (a worker gone, a timeout) leave the group
        for good - later versions travel through the object store - and return False."""
        try:
            self.weight_group.broadcast({k: v.to(self.core.device) for k, v in tensors.items()})
            return True
        except Exception as e:  # noqa: BLE001 - any failure: the registry's object-store fallback delivers
            self._leave_weight_group(f"weight broadcast failed ({type(e).__name__}: {str(e)[:300]})")
            return False

    def _leave_weight_group(self, reason: str) -> None:
        """Close the group for good; this and later versions go through the object store."""
        print(f"DistillTrainer rank 0: {reason}; this and later versions go through the object store", flush=True)
        group, self.weight_group = self.weight_group, None
        try:
            group.close()
        except Exception as e:  # noqa: BLE001 - a broken group may not close cleanly
            print(f"DistillTrainer rank 0: closing the weight group failed: {e!r}", flush=True)

    def _record(self, m: dict) -> None:
        """The loop's metric dicts, kept for :meth:`pop_metrics`; the loss gauge follows each step's loss."""
        if "train/loss" in m:
            self._g_loss.set(m["train/loss"])
        with self._lock:
            self._metrics.append(m)

    def pop_metrics(self) -> list[dict]:
        with self._lock:
            out, self._metrics = self._metrics, []
        return out

    def stop(self) -> None:
        self._stop = True


class _EmptyStream(Exception):
    """The streaming warm start ended before any optimizer step (no worker's text arrived)."""


def _get_or_none(refs: list) -> list:
    """``ray.get`` of each of ``refs``, None for an object whose owner (an inference worker) died before it was
    fetched, or that is lost."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
                ray.exceptions.ObjectFetchTimedOutError):
            out.append(None)
    return out


class _PendingRef:
    """A ``get_batch`` in flight (a prefetch): :meth:`result` waits for it."""

    def __init__(self, ref):
        self.ref = ref

    def result(self) -> list:
        return ray.get(self.ref)


class _BufferSource:
    """The loop's trajectory source over the TrajectoryBuffer actor: this rank's lease (``consumer``); handles
    are ObjectRefs of trajectories owned by the inference workers. The buffer learns each new version from
    the registry (:meth:`set_version` is a no-op here); a live buffer is never exhausted."""

    def __init__(self, buffer, consumer: str):
        self.buffer, self.consumer = buffer, consumer

    def get_batch(self, n: int, wait_s: float) -> list:
        return ray.get(self.buffer.get_batch.remote(n=n, timeout_s=wait_s, consumer=self.consumer))

    def prefetch(self, n: int, wait_s: float) -> _PendingRef:
        return _PendingRef(self.buffer.get_batch.remote(n=n, timeout_s=wait_s, consumer=self.consumer))

    def resolve(self, handles: list) -> list:
        """The trajectories; None for one whose owner (an inference worker) died before it was fetched."""
        return _get_or_none(handles)

    def release(self, handles: list) -> None:
        ray.get(self.buffer.release.remote(consumer=self.consumer, refs=list(handles)))

    def commit(self) -> None:
        ray.get(self.buffer.commit.remote(consumer=self.consumer))

    def set_version(self, version: int) -> None:
        """Nothing to do: the WeightRegistry tells the buffer each version it publishes."""

    def exhausted(self) -> bool:
        return False


class _RegistrySink:
    """The loop's weight sink over the WeightRegistry actor (rank 0): the tensors go to the object store
    (``ray.put``, one bulk object per version) and, with a weight broadcast group, also through the group's
    collective broadcast while the registry tells every worker to receive it."""

    def __init__(self, registry, trainer: DistillTrainer):
        self.registry, self.trainer = registry, trainer

    def publish(self, version: int, parent_version: int, step: int, tensors: dict, sha256: str,
                config: dict) -> tuple[list[dict], dict[str, float]]:
        t = self.trainer
        extra = {}
        ref = ray.put(tensors)
        if t.weight_group is not None and not ray.get(
                self.registry.weight_group_ready.remote(version=version)):
            t._leave_weight_group("a worker left the weight broadcast group (restarted?)")
        pub = self.registry.publish.remote(version=version, parent_version=parent_version, train_step=step,
                                           tensors_ref=[ref], sha256=sha256, config=config,
                                           collective=t.weight_group is not None)
        if t.weight_group is not None:
            extra["sync/collective_ok"] = float(t._broadcast(tensors))
        return ray.get(pub), extra

    def close(self) -> None:
        t = self.trainer
        if t.weight_group is not None:
            t.weight_group.close()
            t.weight_group = None
