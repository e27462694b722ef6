"""DistillTrainer: a Ray actor running one DeepSpeed rank of on-policy drafter distillation.

Lifecycle (driven by adaflash_ray.pipeline):
1. ``DistillTrainer.remote(cfg, rank, world_size)`` - light constructor;
2. ``rank0.master_address()`` -> (addr, port); every rank ``setup(addr, port)`` concurrently: sets
   RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK itself, loads the frozen target, builds the
   drafter + length head and ``deepspeed.initialize`` (gloo on CPU, NCCL on GPU);
3. ``run(buffer, registry)`` - pull batches from the TrajectoryBuffer, optimise, and (rank 0) publish
   version v+1 to the WeightRegistry every ``publish_every`` optimizer steps until ``num_versions``.
Metrics are returned to the driver as flat dicts by :meth:`pop_metrics`.
"""
from __future__ import annotations

import os
import random
import socket
import threading
import time

import ray
import torch
from ray.util import metrics as ray_metrics

from adaflash_ray.config import RunConfig
from adaflash_ray.models import tensors_sha256
from adaflash_ray.models.factory import load_target

@ray.remote(max_concurrency=4)
class DistillTrainer:
    def __init__(self, cfg: RunConfig | dict, rank: int = 0, world_size: int = 1):
        self.cfg = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
        self.rank, self.world_size = rank, world_size
        self.core = None
        self.version = 0
        self._metrics: list[dict] = []
        self._lock = threading.Lock()
        self._stop = False
        self.num_lost = 0  # trajectories whose producing worker died before they were fetched
        self._g_loss = ray_metrics.Gauge("adaflash_train_loss", "distillation loss", tag_keys=("rank",))
        self._g_loss.set_default_tags({"rank": str(rank)})

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port for the process-group rendezvous (rank 0)."""
        addr = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        return addr, port

    def setup(self, master_addr: str, master_port: int) -> dict:
        from adaflash_ray.distill.trainer import DistillTrainerCore

        cfg = self.cfg
        torch.set_num_threads(cfg.engine.num_threads)
        DistillTrainerCore.setup_dist_env(self.rank, self.world_size, master_addr, master_port)
        os.environ.setdefault("LOCAL_RANK", "0")
        target = load_target(cfg.model)
        self.core = DistillTrainerCore(target, cfg.drafter, cfg.length_head, cfg.distill, seed=cfg.seed,
                                       rank=self.rank, world_size=self.world_size)
        n = sum(p.numel() for p in self.core.publish_tensors().values())
        return {"rank": self.rank, "num_trainable_params": n}

    def serving_tensors(self) -> dict[str, torch.Tensor]:
        """The drafter (+ head) as the workers will hold it: the trainer's float32 master weights cast to
        the serving dtype (``model.dtype``), so the published checksum names exactly what a faithful
        load holds, on a bf16 GPU worker as on a float32 CPU one (issue 6.2)."""
        dtype = getattr(torch, self.cfg.model.dtype)  # float32 | bfloat16 | float16
        return {k: v.to(dtype) for k, v in self.core.publish_tensors().items()}

    def initial_weights(self) -> tuple[list, str, dict]:
        """Version 0 (the untrained drafter): ``([ObjectRef], sha256, drafter config dict)``."""
        tensors = self.serving_tensors()
        return [ray.put(tensors)], tensors_sha256(tensors), self.core.drafter_model_config().as_dict()

    def run(self, buffer, registry, num_versions: int | None = None) -> dict:
        """Train until ``num_versions`` versions are published (rank 0 publishes). Returns a summary."""
        dc = self.cfg.distill
        num_versions = num_versions or dc.num_versions
        cfg_dict = self.core.drafter_model_config().as_dict()
        t_start = time.time()
        pool: list[list] = []  # [trajectory, version, uses]: recent on-policy data for reuse
        rng = random.Random(self.cfg.seed + self.rank)
        while self.version < num_versions and not self._stop:
            pool = [p for p in pool if p[2] < dc.max_reuse and self.version - p[1] <= dc.max_version_lag]
            reusable = len(pool) >= dc.batch_size
            items = ray.get(buffer.get_batch.remote(dc.batch_size, 0.2 if reusable else 60.0))
            fresh, items = self._fetch(items)
            pool.extend([t, it[1], 0] for t, it in zip(fresh, items))
            if len(pool) < dc.batch_size and not fresh:
                continue
            chosen = pool[-len(fresh):] if fresh else []
            others = pool[:len(pool) - len(fresh)]
            chosen += rng.sample(others, min(len(others), dc.batch_size - len(chosen)))
            for p in chosen:
                p[2] += 1
            trajs = [p[0] for p in chosen]
            items = [[None, p[1]] for p in chosen]
            del fresh
            if len(pool) > 4 * dc.batch_size * dc.max_reuse:
                pool = pool[-4 * dc.batch_size * dc.max_reuse:]
            m = self.core.train_step(trajs)
            m["train/version_lag"] = sum(self.version - it[1] for it in items) / len(items)
            m["train/version"] = float(self.version)
            m["train/num_fresh"] = float(sum(1 for p in chosen if p[2] == 1))
            m["train/num_lost_trajectories"] = float(self.num_lost)
            step = self.core.global_step
            self._g_loss.set(m.get("train/loss", 0.0))
            if step % dc.publish_every == 0:  # every rank counts versions; rank 0 publishes
                if self.rank == 0:
                    t0 = time.perf_counter()
                    tensors = self.serving_tensors()
                    sha = tensors_sha256(tensors)
                    ref = ray.put(tensors)
                    reports = ray.get(registry.publish.remote(self.version + 1, self.version, step, [ref], sha,
                                                              cfg_dict))
                    ray.get(buffer.set_version.remote(self.version + 1))
                    m["sync/seconds"] = time.perf_counter() - t0
                    m["sync/num_workers_ok"] = float(sum(1 for r in reports if r.get("sha256") == sha))
                    m["sync/num_workers"] = float(len(reports))
                self.version += 1
                m["sync/version"] = float(self.version)
            with self._lock:
                self._metrics.append(m)
        return {"rank": self.rank, "final_version": self.version, "steps": self.core.global_step,
                "seconds": time.time() - t_start}

    def _fetch(self, items: list) -> tuple[list, list]:
        """Resolve trajectory refs; one whose owner (an inference worker) died is skipped and counted."""
        fresh, kept = [], []
        for it in items:
            try:
                fresh.append(ray.get(it[0]))
                kept.append(it)
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
                    ray.exceptions.ObjectFetchTimedOutError):
                self.num_lost += 1
        return fresh, kept

    def pop_metrics(self) -> list[dict]:
        with self._lock:
            out, self._metrics = self._metrics, []
        return out

    def stop(self) -> None:
        self._stop = True
