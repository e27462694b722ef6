"""ActorGroup: the actors of one distillation run and everything they hold, created and shut down in one place.

It owns the placement groups (inference workers | trainers, PACK), the TrajectoryBuffer, the WeightRegistry,
InferenceWorker x N (subscribed to the registry), DistillTrainer x M (one DeepSpeed process group), the
driver's MetricsSink (with a run directory) and the shutdown. Used by the main job's driver
(``adaflash_ray.pipeline``, N = ``placement.num_inference_workers``) and by the Ray Serve
``DistillCoordinator`` (``adaflash_ray.serve.app``, N = 0: the Serve replicas are the inference side and
read the registry themselves), as TitanRL / OpenRLHF / slime group their actors on placement groups.

    with ActorGroup(cfg, run_dir=run_dir) as group:   # placement groups, sink, actors
        group.setup_trainers(state_dir, resume)       # rendezvous + build every rank
        runs = group.start_training()                 # DistillTrainer.run on every rank
    # -> workers shut down, sink closed, placement groups removed (their actors with them)
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from adaflash_ray.actors import recovery
from adaflash_ray.actors.distill_trainer import DistillTrainer
from adaflash_ray.actors.inference_worker import InferenceWorker
from adaflash_ray.actors.trajectory_buffer import TrajectoryBuffer
from adaflash_ray.actors.weight_registry import WeightRegistry
from adaflash_ray.config import RunConfig
from adaflash_ray.metrics import MetricsSink

log = logging.getLogger(__name__)


def placement_group_for(bundles: list[dict], what: str, timeout_s: float = 300.0):
    """A PACK placement group of ``bundles``, ready.

    Raises:
        RuntimeError: the cluster cannot hold it (naming what is short and the recipe section to change), or
            it is not ready after ``timeout_s`` seconds (then it is removed again).
    """
    total = ray.cluster_resources()
    need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
    short = {k: (v, total.get(k, 0)) for k, v in need.items() if v > total.get(k, 0)}
    if short:
        raise RuntimeError(f"the cluster cannot place the {what}: needs " +
                           ", ".join(f"{k} {v} (cluster has {have})" for k, (v, have) in short.items()) +
                           " - change recipe section `placement`")
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(pg)
        raise RuntimeError(f"placement group for the {what} ({bundles}) not ready after {timeout_s:.0f} s") from e
    return pg


def _bundles(num: int, cpus: float, gpus: float) -> list[dict]:
    return [{"CPU": cpus, **({"GPU": gpus} if gpus else {})} for _ in range(num)]


class ActorGroup:
    """The actors of one run (see the module docstring); a context manager that shuts them down on exit.

    Args:
        cfg: the validated recipe; ``placement`` sizes the groups, ``buffer`` / ``distill`` the actors.
        num_inference_workers: InferenceWorkers to start (default ``placement.num_inference_workers``; 0 for
            Ray Serve, whose replicas serve). Worker ``i`` is subscribed to the registry as ``worker-{i}``.
        run_dir: where the MetricsSink writes (``metrics.jsonl``, wandb); None: no sink (``self.sink`` is None).

    Restart policy: the buffer is restarted by Ray (twice; with ``buffer.spill_dir`` its journal
    comes back), each worker up to 3 times (it reloads the latest version from the registry), each trainer
    up to ``distill.trainer_max_restarts`` times (the driver then restarts every rank from its saved state).

    Raises:
        RuntimeError: a placement group cannot be placed; ray.exceptions.RayError: the registry is unreachable
            (in both cases nothing is left behind).
    """

    def __init__(self, cfg: RunConfig, num_inference_workers: int | None = None, run_dir: Path | None = None):
        self.cfg = cfg
        pl = cfg.placement
        num_workers = pl.num_inference_workers if num_inference_workers is None else num_inference_workers
        cfg_dict = cfg.model_dump()
        self.placement_groups: list = []
        self.sink: MetricsSink | None = None
        self.buffer = self.registry = None
        self.workers: list = []
        self.trainers: list = []
        self.runs: list = []
        try:
            pg_inf = None
            if num_workers:
                pg_inf = placement_group_for(_bundles(num_workers, pl.cpus_per_inference_worker,
                                                      pl.gpus_per_inference_worker), "inference workers")
                self.placement_groups.append(pg_inf)
            pg_train = placement_group_for(_bundles(pl.num_trainers, pl.cpus_per_trainer, pl.gpus_per_trainer),
                                           "trainers")
            self.placement_groups.append(pg_train)
            if run_dir is not None:
                self.sink = MetricsSink(run_dir, cfg.logging.wandb_mode, cfg.logging.wandb_project, cfg_dict,
                                        Path(run_dir).name)
            self.buffer = TrajectoryBuffer.options(max_restarts=2, max_task_retries=-1).remote(
                capacity=cfg.buffer.capacity, max_version_lag=cfg.distill.max_version_lag,
                spill_dir=cfg.buffer.spill_dir)
            self.registry = WeightRegistry.remote(buffer=self.buffer)  # it tells the buffer each version
            self.workers = [InferenceWorker.options(
                num_cpus=pl.cpus_per_inference_worker, num_gpus=pl.gpus_per_inference_worker, max_restarts=3,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg_inf, placement_group_bundle_index=i),
            ).remote(cfg_dict, worker_index=i, buffer=self.buffer, registry=self.registry)
                for i in range(num_workers)]
            self.trainers = [DistillTrainer.options(
                num_cpus=pl.cpus_per_trainer, num_gpus=pl.gpus_per_trainer,
                max_restarts=cfg.distill.trainer_max_restarts, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg_train, placement_group_bundle_index=r),
            ).remote(cfg_dict, rank=r, world_size=pl.num_trainers) for r in range(pl.num_trainers)]
            ray.get([self.registry.subscribe.remote(f"worker-{i}", w) for i, w in enumerate(self.workers)])
        except BaseException:
            self.shutdown()
            raise

    def setup_trainers(self, state_dir: str | None = None, resume: bool = False) -> list[dict]:
        """Rendezvous and build every trainer rank (:func:`recovery.setup_trainers`); one dict per rank."""
        return recovery.setup_trainers(self.trainers, state_dir, resume)

    def join_weight_group(self, rendezvous_dir: Path | str) -> str:
        """``distill.weight_sync: collective``: build the weight broadcast group - trainer rank 0 sends, every
        inference worker receives (adaflash_ray.distill.weight_sync) - after :meth:`setup_trainers`. One node:
        a file rendezvous under ``rendezvous_dir`` (no listening socket); several: a TCP store on trainer
        rank 0's node. Returns the rendezvous. Raises ValueError when there are no workers to join."""
        if not self.workers:
            raise ValueError("distill.weight_sync: collective needs inference workers in the group")
        nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        if len(nodes) == 1:
            rdv = f"file://{Path(rendezvous_dir).resolve() / f'weight_sync_{os.getpid()}_{time.time_ns()}'}"
        else:
            host, port = ray.get(self.trainers[0].master_address.remote())
            rdv = f"tcp://{host}:{port}"
        size = 1 + len(self.workers)
        ray.get([self.trainers[0].join_weight_group.remote(rendezvous=rdv, world_size=size)]
                + [w.join_weight_group.remote(rendezvous=rdv, world_size=size, rank=i + 1)
                   for i, w in enumerate(self.workers)])
        return rdv

    def start_training(self) -> list:
        """Start ``DistillTrainer.run`` on every rank; returns (and keeps, as ``runs``) their refs."""
        self.runs = [t.run.remote(self.buffer, self.registry) for t in self.trainers]
        return self.runs

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Stop every worker's engine (SGLang's too), close the sink, remove the placement groups (Ray kills
        the actors placed in them). Each failure is logged and the rest still runs; safe to call twice."""
        for i, w in enumerate(self.workers):
            try:
                ray.get(w.shutdown.remote(), timeout=timeout_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                log.warning("InferenceWorker %d did not shut down cleanly: %s", i, str(e)[:300])
        self.workers = []
        if self.sink is not None:
            try:
                self.sink.close()
            except OSError as e:
                log.warning("closing the metrics sink failed: %r", e)
            self.sink = None
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # Ray raises several types here (a lost GCS connection, a gone group)
                log.warning("removing placement group %s failed: %r", pg.id, e)
        self.placement_groups = []

    def __enter__(self) -> "ActorGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
