"""DistillTrainer: a Ray actor running one DeepSpeed rank of on-policy drafter distillation.

Lifecycle (driven by adaflash_ray.pipeline):
1. ``DistillTrainer.remote(cfg, rank, world_size)`` - light constructor;
2. ``rank0.master_address()`` -> (addr, port); every rank ``setup(addr, port, state_dir)`` concurrently: sets
   RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK itself, loads the frozen target, builds the
   drafter + length head and ``deepspeed.initialize`` (gloo on CPU, NCCL on GPU), then resumes from the
   newest trainer state under ``state_dir`` if there is one (a restarted actor, ``--resume``);
3. ``run(buffer, registry)`` - pull batches from the TrajectoryBuffer, optimise, and every
   ``publish_every`` optimizer steps save the trainer state (every rank), commit the buffer lease, and
   (rank 0) publish version v+1 to the WeightRegistry, until ``num_versions`` - or until
   ``distill.max_train_s`` seconds after the first step, when one last version is published. Ranks agree on every
   branch (step or wait, go on or stop) through one tiny all-reduce, and under ZeRO-3 every rank takes
   part in gathering the weights to publish, so several ranks never deadlock (issue 9.8).
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

from adaflash_ray.trajectory import within_version_lag
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
        self.state_dir: str | None = None
        self.fresh_ids: list[str] = []  # request ids first trained on in a saved (committed) state
        self.num_duplicates_skipped = 0  # trajectories delivered again (a recovered buffer) and not retrained
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
        self.state_dir = state_dir
        state = self.core.load_state(state_dir) if state_dir and resume else None
        if state is not None:
            self.version = int(state["version"])
            self.fresh_ids = list(state.get("fresh_ids", []))
            self.num_lost = int(state.get("num_lost", 0))
        n = sum(p.numel() for p in self.core.publish_tensors().values())
        return {"rank": self.rank, "num_trainable_params": n, "version": self.version,
                "step": self.core.global_step, "resumed": state is not None}

    def serving_tensors(self) -> dict[str, torch.Tensor]:
        """The drafter (+ head) as the workers will hold it: the trainer's float32 master weights cast to
        the serving dtype (``model.dtype``), so the published checksum names exactly what a faithful
        load holds, on a bf16 GPU worker as on a float32 CPU one (issue 6.2)."""
        dtype = getattr(torch, self.cfg.model.dtype)  # float32 | bfloat16 | float16
        return {k: v.to(dtype) for k, v in self.core.publish_tensors().items()}

    def current_version(self) -> tuple[int, int]:
        """(version counter, optimizer steps) of this rank."""
        return self.version, self.core.global_step

    def initial_weights(self) -> tuple[list, str, dict]:
        """The current weights in the serving dtype - version 0 (untrained) on a fresh start, the saved
        version after a resume: ``([ObjectRef], sha256, drafter config dict)``. Every rank calls it
        (ZeRO-3 gathers)."""
        tensors = self.serving_tensors()
        return [ray.put(tensors)], tensors_sha256(tensors), self.core.drafter_model_config().as_dict()

    def run(self, buffer, registry, num_versions: int | None = None) -> dict:
        """Train until ``num_versions`` versions are published (rank 0 publishes). Returns a summary:
        ``{rank, final_version, steps, seconds, num_fresh, num_counted_twice, num_lost}`` - trajectories
        first trained on (``num_fresh``, over the whole run, resumes included) and those among them
        trained as fresh more than once (0 unless a resume replayed one)."""
        dc, core = self.cfg.distill, self.core
        num_versions = num_versions or dc.num_versions
        cfg_dict = core.drafter_model_config().as_dict()
        t_start = time.time()
        pool: list[list] = []  # [trajectory, version, uses, ref]: leased on-policy data, and recent data for reuse
        pending_ids: list[str] = []  # first trained since the last save
        rng = random.Random(self.cfg.seed + self.rank + 7919 * self.version)
        consumer = f"trainer-{self.rank}"
        seen = set(self.fresh_ids)
        t_first_step: float | None = None  # distill.max_train_s counts from here
        time_up = False
        prefetched = None  # a get_batch issued before the last step (distill.prefetch)
        step_times: list[float] = []  # recent optimizer-step seconds (the first, with warm-up, left out)
        published_step = core.global_step  # the step of the last publication (or of the resumed state)

        def hand_back_untrained() -> None:
            """Before a commit: what this rank holds leased but never trained goes back to the buffer."""
            nonlocal pool
            unused = [p for p in pool if p[2] == 0]
            if unused:
                ray.get(buffer.release.remote(consumer, [p[3] for p in unused]))
                seen.difference_update(p[0].request_id for p in unused)  # a redelivery is then new to it
                pool = [p for p in pool if p[2] > 0]

        while not time_up and core.all_ranks(self.version < num_versions and not self._stop):
            pool = [p for p in pool if p[2] < dc.max_reuse and within_version_lag(self.version, p[1], dc.max_version_lag)]
            wait_s = 60.0  # for a batch when no step is possible without one
            if dc.max_train_s is not None and t_first_step is not None:  # a starved trainer still times out
                wait_s = max(0.0, min(wait_s, dc.max_train_s - (time.time() - t_first_step)))
            if prefetched is not None:  # it waited while the last step computed
                items, prefetched = ray.get(prefetched), None
                if len(pool) + len(items) < dc.batch_size:  # no step possible yet: wait for the rest
                    items += ray.get(buffer.get_batch.remote(dc.batch_size - len(items), wait_s, consumer))
            else:
                reusable = len(pool) >= dc.batch_size
                items = ray.get(buffer.get_batch.remote(dc.batch_size, min(0.2, wait_s) if reusable else wait_s,
                                                        consumer))
            fresh, items = self._fetch(items)
            keep = [i for i, t in enumerate(fresh) if t.request_id not in seen]  # a redelivery it already has
            self.num_duplicates_skipped += len(fresh) - len(keep)
            fresh, items = [fresh[i] for i in keep], [items[i] for i in keep]
            seen.update(t.request_id for t in fresh)
            pool.extend([t, it[1], 0, it[0]] for t, it in zip(fresh, items))
            if not core.all_ranks(len(pool) >= dc.batch_size or bool(fresh)):
                if (dc.max_train_s is not None and t_first_step is not None
                        and not core.all_ranks(time.time() - t_first_step < dc.max_train_s)):
                    # starved past the budget: publish what was trained since the last version, then stop
                    time_up = True
                    hand_back_untrained()
                    if core.global_step > published_step:
                        m = {"train/step": float(core.global_step)}
                        self._publish(buffer, registry, m, pending_ids, core.global_step, cfg_dict, True)
                        pending_ids = []
                        with self._lock:
                            self._metrics.append(m)
                continue  # some rank has nothing to train on yet: every rank waits for data
            # what was never trained first (oldest first), then replays of recent data
            chosen = [p for p in pool if p[2] == 0][:dc.batch_size]
            others = [p for p in pool if p[2] > 0]
            chosen += rng.sample(others, min(len(others), dc.batch_size - len(chosen)))
            for p in chosen:
                if p[2] == 0:
                    pending_ids.append(p[0].request_id)
                p[2] += 1
            trajs = [p[0] for p in chosen]
            items = [[None, p[1]] for p in chosen]
            del fresh
            if len(pool) > 4 * dc.batch_size * dc.max_reuse:
                pool = pool[-4 * dc.batch_size * dc.max_reuse:]
            recent_s = min(step_times[-5:]) if step_times else 0.0
            if dc.prefetch and recent_s > 0 and not self._may_publish_next(t_first_step, recent_s):
                # the next batch gathers in the buffer during this step (returns by the step's end)
                prefetched = buffer.get_batch.remote(dc.batch_size, 0.9 * recent_s, consumer)
            m = core.train_step(trajs)
            if t_first_step is not None:
                step_times = step_times[-4:] + [m["train/seconds"]]
            t_first_step = t_first_step or time.time() - m["train/seconds"]
            if dc.max_train_s is not None:  # every rank stops together once any rank's budget is spent
                time_up = not core.all_ranks(time.time() - t_first_step < dc.max_train_s)
            if prefetched is not None and (time_up or self._stop):  # sooner than foreseen: hand it back
                ray.get(buffer.release.remote(consumer, [it[0] for it in ray.get(prefetched)]))
                prefetched = None
            m["train/version_lag"] = sum(self.version - it[1] for it in items) / len(items)
            m["train/version"] = float(self.version)
            m["train/num_fresh"] = float(sum(1 for p in chosen if p[2] == 1))
            m["train/num_lost_trajectories"] = float(self.num_lost)
            step = core.global_step
            self._g_loss.set(m.get("train/loss", 0.0))
            if step % dc.publish_every == 0 or time_up:  # every rank counts versions; rank 0 publishes
                hand_back_untrained()
                self._publish(buffer, registry, m, pending_ids, step, cfg_dict, time_up)
                pending_ids, published_step = [], step
            with self._lock:
                self._metrics.append(m)
        if prefetched is not None:  # stopped from outside after it was issued
            ray.get(buffer.release.remote(consumer, [it[0] for it in ray.get(prefetched)]))
        hand_back_untrained()  # stopped (or out of data) with leased trajectories never trained
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None
        core.close()  # ends the process group, removes the rendezvous file
        return {"rank": self.rank, "final_version": self.version, "steps": core.global_step,
                "seconds": time.time() - t_start, "num_fresh": len(self.fresh_ids),
                "num_counted_twice": len(self.fresh_ids) - len(set(self.fresh_ids)), "num_lost": self.num_lost,
                "num_duplicates_skipped": self.num_duplicates_skipped}

    def _publish(self, buffer, registry, m: dict, pending_ids: list, step: int, cfg_dict: dict, time_up: bool) -> None:
        """Version v+1: save the state (with ``pending_ids``, the trajectories first trained since v), commit
        the buffer lease, and (rank 0) publish to the registry - object store or weight group - recording
        ``sync/*`` timings in ``m``. Every rank calls it (ZeRO-3 gathers the weights collectively)."""
        consumer = f"trainer-{self.rank}"
        t0 = time.perf_counter()
        tensors = self.serving_tensors()  # every rank: under ZeRO-3 a collective gather
        new_version = self.version + 1
        self.fresh_ids += pending_ids
        if self.state_dir:  # saved before it is published: a resume never re-publishes a number
            self.core.save_state(self.state_dir, f"v{new_version}", {
                "version": new_version, "fresh_ids": self.fresh_ids, "num_lost": self.num_lost})
            m["sync/save_seconds"] = time.perf_counter() - t0
        ray.get(buffer.commit.remote(consumer))
        if self.rank == 0:
            sha = tensors_sha256(tensors)
            t_pub = time.perf_counter()
            ref = ray.put(tensors)
            if self.weight_group is not None and not ray.get(registry.weight_group_ready.remote(new_version)):
                self._leave_weight_group("a worker left the weight broadcast group (restarted?)")
            pub = registry.publish.remote(new_version, self.version, step, [ref], sha, cfg_dict,
                                          self.weight_group is not None)
            if self.weight_group is not None:
                m["sync/collective_ok"] = float(self._broadcast(tensors))
            reports = ray.get(pub)
            m["sync/num_fallbacks"] = float(sum(1 for r in reports if r.get("fallback")))
            m["sync/publish_s"] = time.perf_counter() - t_pub  # put + registry push + every worker loaded
            ray.get(buffer.set_version.remote(new_version))
            m["sync/num_workers_ok"] = float(sum(1 for r in reports if r.get("sha256") == sha))
            m["sync/num_workers"] = float(len(reports))
        m["sync/seconds"] = time.perf_counter() - t0
        self.version = new_version
        m["sync/version"] = float(self.version)
        if time_up:
            m["train/time_up"] = 1.0  # distill.max_train_s spent: this was the last version

    def _may_publish_next(self, t_first_step: float | None, last_step_s: float) -> bool:
        """Whether the coming optimizer step may end in a publication (its step count, or a time budget that
        could run out within two steps): a batch prefetched before it would be leased at the commit untrained."""
        dc = self.cfg.distill
        if (self.core.global_step + 1) % dc.publish_every == 0 or self._stop:
            return True
        return (dc.max_train_s is not None and t_first_step is not None
                and time.time() - t_first_step + 2 * last_step_s >= dc.max_train_s)

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
