"""The AdaFlash main job: on-policy distillation of a DFlash drafter while it serves.

    python -m adaflash_ray.pipeline                                   # embedded default: local Ray, CPU
    python -m adaflash_ray.pipeline --recipe recipes/cpu_tiny.yaml --set distill.num_versions=2
    python -m adaflash_ray.pipeline --resume runs/<run> --set distill.num_versions=8   # continue a stopped run
    ray job submit --address http://127.0.0.1:8265 -- python -m adaflash_ray.pipeline

Wiring (docs/design/ARCHITECTURE.md): placement groups for inference | trainers; InferenceWorker x N record
trajectories into the TrajectoryBuffer; DistillTrainer x M (DeepSpeed) train the drafter + length
head and publish versions to the WeightRegistry, which pushes each to every worker (hot reload
between engine steps). The last stdout line is one JSON object: run_dir, final_version, eval_tau
(version -> τ), wall_s, ...

:func:`run` is a sequence of named phases (as torchtitan's trainer or verl's controller):

1. :func:`adaflash_ray.inputs.prepare_inputs` - no Ray: target, layer ids, ``drafter.init_path`` checked,
   run directory + resolved config.yaml, training / held-out eval / canary prompt sets;
2. :func:`init_ray`, then an :class:`~adaflash_ray.actors.group.ActorGroup` (placement groups, buffer,
   registry, workers, trainers, the MetricsSink; shut down on exit - Ray Serve's DistillCoordinator uses it too);
3. :meth:`Driver.setup` - trainers built (or resumed), every side at the trainers' version, canary reference;
4. :meth:`Driver.train` - the loop, one poll every <= 2 s: ``feed_workers``, ``handle_trainer_death`` (when a
   rank died), ``collect_metrics``, ``save_new_versions`` (a checkpoint per version), ``check_canary``;
5. :meth:`Driver.finish_training`, :meth:`Driver.evaluate_versions` (every version on held-out prompts,
   greedy) and :meth:`Driver.report` (tau_vs_version.png, the table, summary.json).

Recovery (issue 9, actors/recovery.py): the trainers save their state with every version and a dead one
is restarted by Ray and resumes; the buffer and workers are restarted by Ray too; a τ canary rolls every
worker back from a version that decodes worse than the last good one; versions never go backwards.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from adaflash_ray.actors import ActorGroup, recovery  # noqa: E402
from adaflash_ray.config import RecipeError, RunConfig, add_recipe_args, config_from_args  # noqa: E402
from adaflash_ray.drafting import heldout  # noqa: E402
from adaflash_ray.engine import SpecStats  # noqa: E402
from adaflash_ray.inputs import Inputs, prepare_inputs  # noqa: E402
from adaflash_ray.metrics import PlainProgress, plot_tau, strict_json  # noqa: E402
from adaflash_ray.models import DrafterModelConfig, save_drafter_checkpoint  # noqa: E402

console = Console(stderr=True)


def init_ray(cfg: RunConfig) -> tuple[bool, str | None]:
    """Connect to ``cfg.ray.address`` / $RAY_ADDRESS, else start a local Ray bound to 127.0.0.1.
    Returns (True if this process started Ray and must shut it down, dashboard URL or None)."""
    if ray.is_initialized():
        return False, None
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        info = ray.init(address=address, log_to_driver=True)
        return False, getattr(info, "dashboard_url", None)
    need = (cfg.placement.num_inference_workers * cfg.placement.cpus_per_inference_worker
            + cfg.placement.num_trainers * cfg.placement.cpus_per_trainer)
    info = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=dashboard_wanted(cfg),
                    dashboard_host=cfg.ray.dashboard_host,
                    num_cpus=cfg.ray.num_cpus or max(int(need + 0.999), os.cpu_count() or 1), log_to_driver=True)
    return True, getattr(info, "dashboard_url", None)


def dashboard_wanted(cfg: RunConfig) -> bool:
    """Whether a local Ray should start its dashboard: ``ray.include_dashboard`` and its packages
    (``ray[default]``: aiohttp, ...) importable. Prints why it stays off when they are missing (a
    minimal ``pip install ray`` refuses ``include_dashboard=True`` outright)."""
    if not cfg.ray.include_dashboard:
        return False
    missing = ray._private.utils.get_dashboard_dependency_error()
    if missing is not None:
        console.print(f"ray: dashboard off - its packages are not installed ({missing}); install them with "
                      "`pip install 'ray[default]'`, or set ray.include_dashboard=false to silence this",
                      markup=False)
        return False
    return True


def _eval_tau(results: list[dict]) -> tuple[float, float, dict]:
    """τ, draft waste and γ histogram of worker results (their per-step ``draft_lens`` / ``num_accepted``),
    by the one definition in :class:`adaflash_ray.engine.SpecStats`."""
    st = SpecStats.from_steps([g for r in results for g in r["draft_lens"]],
                              [a for r in results for a in r["num_accepted"]])
    return st.accept_len, st.draft_waste, dict(sorted(st.draft_len_hist.items()))


class WorkerLost(RuntimeError):
    """An inference worker died for good (restarts exhausted) or its engine thread failed."""


def deal_by_weight(items: list, weights: list[int]) -> list[list]:
    """``items`` dealt in order to ``len(weights)`` parts in proportion to ``weights`` (each item to the part
    furthest below its share so far, the first such part on a tie): the parts interleave the sequence, so each holds
    the same mix of it. Raises ValueError on no weights or one < 1."""
    if not weights or min(weights) < 1:
        raise ValueError(f"deal_by_weight needs weights >= 1, got {weights}")
    parts: list[list] = [[] for _ in weights]
    for it in items:
        j = min(range(len(weights)), key=lambda i: ((len(parts[i]) + 1) / weights[i], i))
        parts[j].append(it)
    return parts


def deal_warm_start(prompts: list, slots: list[int], num_ranks: int) -> list[list]:
    """The warm start's prompts dealt to the trainer ranks (the first ``num_ranks`` of ``slots``) and the workers
    (the rest) in proportion to their KV ``slots`` (:func:`deal_by_weight`), except that a rank left without a prompt
    - fewer prompts than the workers' slots outweigh - takes one from the worker holding the most, as long as any
    worker holds one: every rank decodes some text of its own. Raises ValueError as :func:`deal_by_weight`."""
    shares = deal_by_weight(prompts, slots)
    for r in range(num_ranks):
        if not shares[r] and any(shares[num_ranks:]):
            shares[r].append(max(shares[num_ranks:], key=len).pop())
    return shares


def report_ended_warm_sources(waits: dict, buffer) -> list[str]:
    """The workers' warm-start decodes that ended, without waiting: ``waits`` maps a source name (``worker-<i>``) to
    the ref of its :meth:`InferenceWorker.warm_decode_result`; each ready one leaves ``waits``, and one that ended in
    an error - or whose worker died, so that the ref raises - is reported to ``buffer`` for it
    (:meth:`TrajectoryBuffer.warm_done`; a worker that reported itself keeps its own report), so the trainer ranks
    stop waiting for it and train on what it added. Returns the sources that ended."""
    ended = []
    for source, ref in list(waits.items()):
        if not ray.wait([ref], timeout=0)[0]:
            continue
        del waits[source]
        ended.append(source)
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError as e:  # the worker died mid-decode
            report = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if "error" in report:
            buffer.warm_done.remote(source, report)
    return ended


def _poll(refs: list, default, timeout_s: float = 120.0):
    """The workers' answers, in the order of ``refs``, gathered by one ``ray.wait`` over all of them: one not
    ready within ``timeout_s`` seconds, or from a worker being restarted by Ray, yields ``default``; a worker
    dead for good (restarts exhausted) raises :class:`WorkerLost`."""
    if not refs:
        return []
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
    out = []
    for r in refs:
        if r not in ready:
            out.append(default)
            continue
        try:
            out.append(ray.get(r))
        except ray.exceptions.ActorDiedError as e:
            raise WorkerLost(f"an InferenceWorker died and will not be restarted: {str(e)[:1500]}") from e
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            out.append(default)
    return out


def _check_canary(canary: recovery.TauCanary, registry, sink, wait: bool = False) -> None:
    """Judge finished canary decodes; roll every worker back when a version failed and is still the latest."""
    for version, tau in canary.poll(wait):
        if tau is None:
            sink.log({"canary/version": version, "canary/skipped": 1}, kind="canary")
            continue
        good = canary.good
        passed = canary.judge(version, tau)
        sink.log({"canary/version": version, "canary/accept_len": tau, "canary/passed": float(passed)},
                 kind="canary")
        if passed:
            continue
        reason = f"canary τ {tau:.3f} < (1 - {canary.delta}) x {good[1]:.3f} (version {good[0]})"
        reports = ray.get(registry.rollback.remote(version=good[0], reason=reason, only_if_latest=version))
        if reports is not None:
            console.print(f"canary: version {version} rolled back to {good[0]}: {reason}")
            sink.log({"canary/rollback_from": version, "canary/rollback_to": good[0],
                      "canary/num_workers_ok": sum(1 for r in reports if r.get("version") == good[0])},
                     kind="canary")


class Driver:
    """The main job's control loop over a started :class:`ActorGroup` (torchtitan's trainer, verl's
    controller): :meth:`setup`, then :meth:`train` - a loop of named steps (:meth:`feed_workers`,
    :meth:`collect_metrics`, :meth:`handle_trainer_death`, :meth:`save_new_versions`, :meth:`check_canary`) -
    then :meth:`finish_training`, :meth:`evaluate_versions` and :meth:`report`. It writes every metric (the
    group's sink) and every checkpoint; ``shas`` (version -> sha256) names the versions saved so far."""

    def __init__(self, cfg: RunConfig, inputs: Inputs, group: ActorGroup):
        self.cfg, self.inputs, self.group, self.sink = cfg, inputs, group, group.sink
        self.shas: dict[int, str] = {}
        self.canary = recovery.TauCanary(inputs.canary_prompts, cfg.distill.canary_max_new_tokens,
                                         cfg.distill.canary_delta)
        self.last_version, self.dcfg, self.drafter_cfg = 0, {}, None
        self.restarts_left, self.num_trainer_restarts = cfg.distill.trainer_max_restarts, 0
        self.next_prompt, self.fed = 0, 0
        self.serve_tau: dict[int, list[float]] = {}  # version -> the workers' on-policy τ while serving it
        self.eval_hist: dict[int, dict[int, int]] = {}  # version -> held-out γ histogram (evaluate_versions)
        self.eval_full_block: dict[int, tuple[float, float]] = {}  # final version -> (τ, waste) at γ = block_size-1
        self.eval_by_domain: dict[int, dict[str, float]] = {}  # version -> {domain: held-out τ}
        self.eval_full_block_by_domain: dict[str, float] = {}  # the final version's, at γ = block_size-1
        self.eval_baselines: dict[str, dict[str, float]] = {}  # {"ngram" | "suffix": {domain: τ}}, same outputs
        self.num_cancelled = 0  # training prompts dropped from the workers' queues when training ended
        self.train_positions = 0.0  # rank 0's block positions trained (train/num_positions summed)
        self.step, self.last_loss = 0, None
        # requests open per worker (running + waiting), topped up every poll
        self.low_water = cfg.data.worker_queue_depth or 2 * cfg.engine.max_batch_size
        self.t_train0, self.train_busy_s, self.train_wall_s = time.time(), 0.0, 0.0
        self.plain: PlainProgress | None = None  # progress lines without a terminal (set by train)
        self.warm_summary: dict | None = None  # the warm start's reports (distill.warm_start), None without one
        self.startup_s: dict[str, float] = {}  # run(): seconds from the start to the end of each start-up phase

    # ------------------------------------------------------------------ setup
    def setup(self, resume: bool) -> None:
        """Build every trainer rank (resuming from the saved state with ``resume``), bring every side to the
        trainers' version, and take the starting version's canary τ as the first reference."""
        g, inp = self.group, self.inputs
        if resume:
            self.shas.update(recovery.saved_versions(inp.ckpt_dir))
        setup = g.setup_trainers(inp.state_dir, resume)
        if self.cfg.distill.weight_sync == "collective":
            console.print(f"weight sync: collective broadcast group {g.join_weight_group(inp.run_dir)}", markup=False)
        self.last_version, self.dcfg, sha = recovery.sync_version(g.trainers, g.workers, g.registry, inp.ckpt_dir,
                                                                   self.shas)
        self.drafter_cfg = DrafterModelConfig(**self.dcfg)
        console.print(f"setup: trainers {setup}; workers at version {self.last_version} sha {sha[:12]}")
        self.step = setup[0]["step"]
        if self.canary.prompts:
            self.canary.start(g.workers[0], self.last_version)
            self.check_canary(wait=True)

    # ------------------------------------------------------------------ the loop and its steps
    def train(self) -> list[dict]:
        """Run the trainers to ``distill.num_versions``, one step of the loop every <= 2 s; returns each
        rank's ``DistillTrainer.run`` summary."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        cfg, show = self.cfg, self.cfg.logging.progress
        self.t_train0, self.train_busy_s = time.time(), 0.0
        if cfg.distill.warm_start and self.last_version == 0:
            self.warm_start()
        self.group.start_training()
        progress = Progress(TextColumn("[bold]versions"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeElapsedColumn(), TextColumn("{task.description}"), console=console,
                            disable=not (show and console.is_terminal), transient=False)
        # no terminal (ray job logs, CI): a plain line every logging.progress_every_s instead of the bar
        self.plain = (PlainProgress(sys.stderr, cfg.logging.progress_every_s, cfg.distill.num_versions)
                      if show and not console.is_terminal else None)
        with progress:
            task = progress.add_task("starting", total=cfg.distill.num_versions)
            while True:
                self.feed_workers()
                done, _ = ray.wait(self.group.runs, num_returns=len(self.group.runs), timeout=2.0)
                died = recovery.trainer_death(done)
                if died is not None:
                    self.handle_trainer_death(died, done)
                    continue
                wstats, bstats = self.collect_metrics()
                if self.save_new_versions() and self.canary.prompts:
                    self.canary.start(self.group.workers[0], self.last_version)
                if self.canary.prompts:
                    self.check_canary()
                self.show_progress(progress, task, wstats, bstats)
                if len(done) == len(self.group.runs):
                    break
            train_summary = ray.get(self.group.runs)
            # training is over: the queued training prompts go first, so the last canary is not decoded behind them
            self.num_cancelled = sum(ray.get([w.cancel_recorded.remote() for w in self.group.workers]))
            if self.canary.prompts:
                self.check_canary(wait=True)
        self.train_wall_s = time.time() - self.t_train0
        if self.plain is not None:
            self.plain.update(self.last_version, force=True, step=self.step, loss=self.last_loss, training="done",
                              trainer_util=self.train_busy_s / max(self.train_wall_s, 1e-9))
        return train_summary

    def warm_start(self) -> None:
        """The offline warm start (``distill.warm_start``): the first ``distill.warm_start_prompts`` training
        prompts, split across the trainer ranks, are decoded by the ranks themselves with the frozen target (AR
        steps, no drafter work) and trained on (:meth:`DistillTrainer.warm_start`); rank 0 publishes version 1,
        which the registry pushes to every worker. With ``distill.warm_start_workers`` the inference workers
        decode a share too (:meth:`InferenceWorker.start_warm_decode`; shares in proportion to the KV slots,
        :func:`deal_by_weight`) and the ranks train on theirs as well; with ``distill.warm_start_streaming`` the
        workers decode every prompt and the ranks train on the batches as they arrive (falling back to decoding
        a share each themselves when no worker starts, or when no worker's text arrived). No on-policy traffic
        meanwhile (it starts with version 1, from the prompt after the warm start's). Metrics, the version-1
        checkpoint and its canary are handled as in the loop; the ranks' reports go to the summary (``warm_start``).
        Raises: as the trainers (a rank that dies here ends the run: its state holds no version yet)."""
        cfg, g, train = self.cfg, self.group, self.inputs.train
        dc = cfg.distill
        n, k = dc.warm_start_prompts, len(g.trainers)
        prompts = [list(train[j % len(train)]) for j in range(n)]
        self.next_prompt = n
        t0 = time.time()
        if dc.warm_start_workers and cfg.engine.backend != "torch":
            console.print(f"warm start: distill.warm_start_workers needs engine.backend: torch (not "
                          f"{cfg.engine.backend}); the trainer ranks decode the whole warm start", markup=False)
        workers = g.workers if dc.warm_start_workers and cfg.engine.backend == "torch" else []
        stream = dc.warm_start_streaming and bool(workers)
        rank_slots = dc.warm_start_batch_size or cfg.engine.max_batch_size
        if stream:  # the workers decode everything; the ranks train as it arrives (their share: only if none does)
            shares = deal_by_weight(prompts, [rank_slots] * k) + \
                deal_by_weight(prompts, [cfg.engine.max_batch_size] * len(workers))
        else:
            shares = deal_warm_start(prompts, [rank_slots] * k + [cfg.engine.max_batch_size] * len(workers), k)
        waits = {}  # source name -> the ref of its decode's report (a dead worker's raises: reported for it)
        started = []  # the workers whose decode started
        for i, (w, share) in enumerate(zip(workers, shares[k:])):
            if not share:
                continue
            try:
                ray.get(w.start_warm_decode.remote(share, dc.warm_start_generate_s))
            except (ray.exceptions.RayError, ValueError) as e:  # its share is not decoded; the ranks do not wait for it
                console.print(f"warm start: worker {i} did not start its share ({len(share)} prompts): "
                              f"{type(e).__name__}: {str(e)[:300]}", markup=False)
                continue
            waits[f"worker-{i}"] = w.warm_decode_result.remote(dc.warm_start_generate_s + 300.0)
            started.append(w)
        num_sources = len(waits)
        if stream and not num_sources:  # no worker decodes: the ranks decode the whole warm start themselves
            console.print("warm start: no worker started its decode; the trainer ranks decode every prompt",
                          markup=False)
            stream = False
        expected = sum(len(sh) for sh in shares[k:]) // k if stream else 0
        refs = [t.warm_start.remote(shares[r], g.registry, g.buffer, num_sources, stream, expected)
                for r, t in enumerate(g.trainers)]
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
            report_ended_warm_sources(waits, g.buffer)
            self.collect_metrics()
            if self.save_new_versions() and self.canary.prompts:
                self.canary.start(g.workers[0], self.last_version)
            if len(done) == len(refs):
                break
        reports = ray.get(refs)
        for w in started:  # a decode still running (a stream whose training ended first) starts nothing more
            w.stop_warm_decode.remote()
        ray.get(g.buffer.clear_warm.remote())  # batches no rank took (a stream cut by its time) are let go
        self.warm_summary = {"seconds": round(time.time() - t0, 1), "streamed": stream, "ranks": reports}
        console.print(f"warm start: {reports} in {self.warm_summary['seconds']} s; workers at version "
                      f"{self.last_version}", soft_wrap=True, markup=False)

    def feed_workers(self) -> None:
        """Keep every worker busy with on-policy traffic: top its queue up to ``low_water`` training prompts, the
        ``data.sample_fraction`` share of them (:meth:`~adaflash_ray.config.DataConfig.is_sampled` of the issue
        index) decoded at ``data.sampled_temperature``, the rest at ``engine.temperature``."""
        cfg, train = self.cfg, self.inputs.train
        workers = self.group.workers
        for w, d in zip(workers, _poll([w.queue_depth.remote() for w in workers], self.low_water)):
            if d < self.low_water:
                idx = range(self.next_prompt, self.next_prompt + self.low_water - d)
                self.next_prompt += len(idx)
                self.fed += len(idx)
                # data.sample_fraction of the requests (by issue index) at data.sampled_temperature, lossless
                sampled = [cfg.data.is_sampled(j) for j in idx]
                for temp, pick in ((cfg.engine.temperature, False), (cfg.data.sampled_temperature, True)):
                    batch = [train[j % len(train)] for j, s in zip(idx, sampled) if s == pick]
                    if batch:
                        w.submit.remote(batch, max_new_tokens=cfg.engine.max_new_tokens, temperature=temp)

    def handle_trainer_death(self, died: str, done: list) -> None:
        """Restart every rank from the state saved with the last version (requeueing what the dead ranks had
        leased), bring every side to that version and start training again.
        Raises RuntimeError when ``distill.trainer_max_restarts`` are used up."""
        g, inp = self.group, self.inputs
        if self.restarts_left <= 0:
            raise RuntimeError(f"a DistillTrainer died mid-run and its {self.num_trainer_restarts} restarts "
                               f"are used up ({died}); versions {sorted(self.shas)} are saved under "
                               f"{inp.ckpt_dir}, continue with --resume {inp.run_dir}")
        self.restarts_left -= 1
        self.num_trainer_restarts += 1
        console.print(f"a DistillTrainer died ({died[:300]}); restarting the trainers from their last "
                      f"saved state ({self.restarts_left} restarts left)", markup=False)
        self.sink.log({"fault/trainer_restart": self.num_trainer_restarts}, kind="fault")
        recovery.restart_trainers(g.trainers, g.runs, done)
        setup = g.setup_trainers(inp.state_dir, True)
        requeued = sum(ray.get([g.buffer.requeue.remote(f"trainer-{r}") for r in range(len(g.trainers))]))
        recovery.sync_version(g.trainers, g.workers, g.registry, inp.ckpt_dir, self.shas)
        self.sink.log({"fault/trainer_resumed_version": setup[0]["version"],
                       "fault/trajectories_requeued": requeued}, kind="fault")
        g.start_training()

    def collect_metrics(self) -> tuple[list, dict]:
        """Poll the workers, the buffer and trainer rank 0 and log their flat metric dicts; returns the workers'
        stats (None for one being restarted) and the buffer's. Raises WorkerLost if a worker's engine failed."""
        g, sink = self.group, self.sink
        wstats = _poll([w.stats.remote() for w in g.workers], None)
        bstats = ray.get(g.buffer.stats.remote())
        try:
            tmetrics = ray.get(g.trainers[0].pop_metrics.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            tmetrics = []  # dying or restarting: the next poll sees it
        for i, s in enumerate(wstats):
            if s is None:  # worker restarting (Ray restarts it; it reloads the latest version)
                sink.log({"worker/unavailable": 1.0, "worker": i}, kind="inference")
                continue
            if s.get("spec/engine_dead"):
                raise WorkerLost(f"InferenceWorker {i}: engine loop failed ({s.get('spec/error', '')})")
            if s["spec/accept_len"] > 0:
                self.serve_tau.setdefault(int(s["spec/drafter_version"]), []).append(s["spec/accept_len"])
            sink.log({**s, "worker": i}, kind="inference")
        sink.log(bstats, kind="buffer")
        for m in tmetrics:
            self.step = int(m.get("train/step", self.step + 1))
            self.train_busy_s += m.get("train/seconds", 0.0)
            self.train_positions += m.get("train/num_positions", 0.0)
            sink.log(m, step=self.step, kind="train")
        losses = [m["train/loss"] for m in tmetrics if "train/loss" in m]  # a publish-only record has none
        if losses:
            self.last_loss = losses[-1]
        return wstats, bstats

    def save_new_versions(self) -> bool:
        """Save a checkpoint of every version published since the last poll (even two per poll) and log how
        many workers loaded each with the published sha256; True if there was one."""
        g = self.group
        meta = ray.get(g.registry.latest_meta.remote())
        if meta is None or meta["version"] <= self.last_version:
            return False
        history = {h["version"]: h for h in ray.get(g.registry.get_history.remote())}
        reports_all = ray.get(g.registry.get_reports.remote())
        for v in range(self.last_version + 1, meta["version"] + 1):
            h = history[v]
            tens = ray.get(ray.get(g.registry.get.remote(version=v))[0])
            self.shas[v] = save_drafter_checkpoint(self.inputs.ckpt_dir / f"v{v}", self.drafter_cfg, tens,
                                                   {"version": v, "parent_version": h["parent_version"],
                                                    "train_step": h["train_step"]})
            ok = sum(r.get("sha256") == h["sha256"] for r in reports_all.get(v, []))
            rec = {"sync/version": v, "sync/num_workers_ok": ok}
            if h.get("broadcast_s") is not None:  # the registry's history records it where the push was timed
                rec["sync/broadcast_s"] = h["broadcast_s"]
            self.sink.log(rec, kind="sync")
        self.last_version = meta["version"]
        return True

    def check_canary(self, wait: bool = False) -> None:
        """Judge the finished canary decodes (all of them with ``wait``); see :func:`_check_canary`."""
        _check_canary(self.canary, self.group.registry, self.sink, wait)

    def show_progress(self, progress, task, wstats: list, bstats: dict) -> None:
        """The progress bar (a terminal) or a plain line every ``logging.progress_every_s`` (none)."""
        w0 = (wstats[0] if wstats else None) or {}  # worker 0's stats (None while Ray restarts it)
        if self.plain is not None:
            self.plain.update(self.last_version, step=self.step, loss=self.last_loss,
                              serve_tau=w0.get("spec/accept_len") or None, gamma=w0.get("spec/mean_draft_len") or None,
                              buffer=int(bstats["buffer/depth"]), stale_drops=int(bstats["buffer/dropped_stale"]),
                              trainer_util=self.train_busy_s / max(time.time() - self.t_train0, 1e-9),
                              tok_per_s=sum((s or {}).get("spec/tokens_per_s", 0.0) for s in wstats))
        loss = self.last_loss if self.last_loss is None else round(self.last_loss, 3)
        progress.update(task, completed=self.last_version, description=(
            f"step {self.step} loss {loss} serve τ {w0.get('spec/accept_len', 0):.2f} "
            f"γ̄ {w0.get('spec/mean_draft_len', 0):.1f} "
            f"buffer {int(bstats['buffer/depth'])} stale-drops {int(bstats['buffer/dropped_stale'])}"))

    # ------------------------------------------------------------------ after training
    def finish_training(self) -> dict:
        """Log the trainers' last metrics (the queued training prompts were dropped when training ended) and check
        that every worker holds the serving version (the final one, or the one the canary kept) with its published
        sha256."""
        g = self.group
        num_cancelled = self.num_cancelled  # nothing is queued for training after train() dropped the queues
        for m in ray.get(g.trainers[0].pop_metrics.remote()):
            self.sink.log(m, kind="train")
        loaded = ray.get([w.loaded_version.remote() for w in g.workers])
        serving = ray.get(g.registry.latest_meta.remote())
        workers_ok = all(lv["version"] == serving["version"] and lv["sha256"] == serving["sha256"] for lv in loaded)
        return {"num_cancelled": num_cancelled, "serving": serving, "workers_ok": workers_ok}

    def evaluate_versions(self) -> tuple[dict, dict, dict]:
        """Held-out evaluation of every saved version, greedy, through the hot-reload path of worker 0: back
        to the first version (an explicit rollback), then forward version by version. Returns (τ, draft waste,
        γ histogram) per version, each logged and printed."""
        from adaflash_ray.models import load_drafter_checkpoint

        cfg, w0, evalp = self.cfg, self.group.workers[0], self.inputs.evalp
        domains = [heldout.domain_of(p.source) for p in evalp.prompts]
        eval_tau, eval_waste, eval_hist = {}, {}, {}
        for i, v in enumerate(sorted(self.shas)):
            _, tens, _ = load_drafter_checkpoint(self.inputs.ckpt_dir / f"v{v}")
            load = w0.rollback_drafter if i == 0 else w0.load_drafter
            ray.get(load.remote(version=v, tensors=tens, sha256=self.shas[v], config=self.dcfg))
            res = ray.get(w0.generate.remote(list(evalp), max_new_tokens=cfg.data.eval_max_new_tokens,
                                             temperature=0.0, record=False))
            eval_tau[v], eval_waste[v], eval_hist[v] = _eval_tau(res)
            self.eval_by_domain[v], outputs = heldout.tau_by_domain(res, domains), res
            self.sink.log({"eval/version": v, "eval/accept_len": eval_tau[v], "eval/draft_waste": eval_waste[v],
                           **{f"eval/gamma_{g}": n for g, n in eval_hist[v].items()},
                           **{f"eval/accept_len_{d}": t for d, t in self.eval_by_domain[v].items()}}, kind="eval")
            console.print(f"eval v{v}: τ={eval_tau[v]:.3f} draft waste={eval_waste[v]:.3f} γ hist={eval_hist[v]}",
                          soft_wrap=True)  # whole, not cut at the console's width
        self.eval_hist = eval_hist
        if eval_tau:  # the free baselines, from the last version's greedy outputs (the target's, whatever the drafter)
            self.eval_baselines = heldout.lookup_baselines(list(evalp), outputs, domains,
                                                           self.drafter_cfg.block_size - 1)
            console.print("eval, on the same outputs: " + "; ".join(
                f"{name} lookup τ " + " ".join(f"{d} {t:.3f}" for d, t in self.eval_baselines[key].items())
                for name, key in (("prompt", "ngram"), ("suffix", "suffix"))), soft_wrap=True)
        if eval_tau and cfg.engine.backend == "torch":
            # the final version once more, drafting whole blocks (plain DFlash): the drafter's held-out τ whatever
            # γ the length policy picks - the cost policy trades τ for step time
            v, full = max(eval_tau), self.drafter_cfg.block_size - 1
            res = ray.get(w0.generate.remote(list(evalp), max_new_tokens=cfg.data.eval_max_new_tokens,
                                             temperature=0.0, record=False, ignore_eos=False, draft_len=full))
            tau, waste, _ = _eval_tau(res)
            self.eval_full_block = {v: (tau, waste)}
            self.eval_full_block_by_domain = heldout.tau_by_domain(res, domains)
            self.sink.log({"eval/version": v, "eval/full_block_accept_len": tau, "eval/full_block_draft_waste": waste},
                          kind="eval")
            console.print(f"eval v{v} with γ = {full} on every step: τ={tau:.3f} draft waste={waste:.3f}")
        return eval_tau, eval_waste, eval_hist

    def report(self, train_summary: list[dict], end: dict, eval_tau: dict, eval_waste: dict, t_start: float) -> dict:
        """tau_vs_version.png, the table on stdout, and the summary (written to summary.json, returned)."""
        cfg, g, run_dir = self.cfg, self.group, self.inputs.run_dir
        serve_mean = {v: sum(x) / len(x) for v, x in self.serve_tau.items()}
        plot_tau(eval_tau, serve_mean, run_dir / "tau_vs_version.png",
                 f"{cfg.name}: τ vs drafter version ({cfg.model.name})", self.eval_by_domain, self.eval_baselines)
        bfinal = ray.get(g.buffer.stats.remote())
        table = Table(title=f"AdaFlash {cfg.name} — τ = mean committed tokens per verify step (a+1)")
        for col in ("version", "eval τ (held-out, greedy)", "eval draft waste", "serving τ (on-policy)"):
            table.add_column(col)
        for v in sorted(eval_tau):
            table.add_row(str(v), f"{eval_tau[v]:.3f}", f"{eval_waste[v]:.3f}",
                          f"{serve_mean[v]:.3f}" if v in serve_mean else "-")
        Console().print(table)
        if self.eval_by_domain:
            Console().print(heldout.domain_table(self.eval_by_domain, self.eval_full_block_by_domain,
                                                 self.eval_baselines, f"{cfg.name}: held-out τ by domain"))
        t0 = train_summary[0]
        published = [h for h in ray.get(g.registry.get_history.remote()) if "broadcast_s" in h]
        summary = {"run_dir": str(run_dir), "final_version": max(r["final_version"] for r in train_summary),
                   "eval_tau": {str(k): round(v, 4) for k, v in eval_tau.items()},
                   "eval_draft_waste": {str(k): round(v, 4) for k, v in eval_waste.items()},
                   "eval_full_block": {str(k): {"tau": round(t, 4), "draft_waste": round(w, 4)}
                                       for k, (t, w) in self.eval_full_block.items()},
                   "eval_gamma_hist": {str(k): {str(g): int(n) for g, n in sorted(h.items())}
                                       for k, h in sorted(self.eval_hist.items())},
                   "serve_tau": {str(k): round(v, 4) for k, v in serve_mean.items()},
                   "train_steps": max(r["steps"] for r in train_summary),
                   "workers_loaded_final": end["workers_ok"], "serving_version": end["serving"]["version"],
                   "prompts_fed": self.fed,
                   "trainer_utilisation": round(self.train_busy_s / max(self.train_wall_s, 1e-9), 3),
                   "trainer_restarts": self.num_trainer_restarts,
                   "canary": {"tau": {str(k): round(v, 4) for k, v in self.canary.tau.items()},
                              "rollbacks": [{k: r[k] for k in ("from_version", "to_version", "reason")}
                                            for r in ray.get(g.registry.get_rollbacks.remote())]},
                   "versions_rising": recovery.versions_rising(ray.get(g.registry.get_history.remote())),
                   # publish -> every worker loaded, per version (issue 6.6), and the path it took
                   "weight_sync": {"mode": cfg.distill.weight_sync,
                                   "broadcast_s": {str(h["version"]): round(h["broadcast_s"], 4) for h in published},
                                   "path": {str(h["version"]): h.get("path") for h in published},
                                   "num_fallbacks": sum(h.get("num_fallbacks", 0) for h in published),
                                   "num_bytes": published[-1]["num_bytes"] if published else None},
                   "trajectories": {"trained_fresh": t0["num_fresh"], "counted_twice": t0["num_counted_twice"],
                                    "lost_owner_died": t0["num_lost"],
                                    "duplicates_delivered_not_retrained": t0["num_duplicates_skipped"],
                                    "warm_replayed": t0.get("num_warm_replayed", 0),
                                    "redelivered_after_restart": int(bfinal["buffer/redelivered"])},
                   "prompts_cancelled_after_training": end["num_cancelled"],
                   "buffer": {k.split("/", 1)[1]: v for k, v in bfinal.items()},
                   **heldout.heldout_summary(self.eval_by_domain, self.eval_full_block_by_domain, self.eval_baselines,
                                             self.train_positions, self.train_busy_s, cfg.placement.num_trainers),
                   "warm_start": self.warm_summary, "startup_s": self.startup_s,
                   "num_eval_prompts": len(self.inputs.evalp), "wall_s": round(time.time() - t_start, 1)}
        summary = strict_json(summary)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def run(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False) -> dict:
    """Run the whole job for a validated config; returns the summary dict (also printed). With ``resume``,
    continue the run in ``run_dir``: the trainers load their state saved with the last published version,
    the workers start at that version, and training goes on to ``distill.num_versions``."""
    t_start = time.time()
    startup: dict[str, float] = {}  # seconds from the start to the end of each start-up phase

    def mark(phase: str) -> None:
        startup[phase] = round(time.time() - t_start, 1)
    inputs = prepare_inputs(cfg, run_dir)
    mark("inputs")
    console.print(f"[bold]adaflash_ray[/] run_dir={inputs.run_dir} train_prompts={len(inputs.train)} "
                  f"eval_prompts={len(inputs.evalp)}")
    started, dashboard = init_ray(cfg)
    mark("ray")
    console.print(f"ray: node {ray.util.get_node_ip_address()} job {ray.get_runtime_context().get_job_id()} "
                  f"dashboard http://{dashboard}" if dashboard else "ray: connected")
    driver = None
    try:
        with ActorGroup(cfg, run_dir=inputs.run_dir) as group:
            mark("actors")
            driver = Driver(cfg, inputs, group)
            driver.setup(resume)
            mark("setup")
            console.print("start-up, seconds from the start: " + ", ".join(f"{k} {v}" for k, v in startup.items()),
                          markup=False)
            driver.startup_s = startup
            train_summary = driver.train()
            end = driver.finish_training()
            eval_tau, eval_waste, _ = driver.evaluate_versions()
            return driver.report(train_summary, end, eval_tau, eval_waste, t_start)
    except (WorkerLost, ray.exceptions.RayError) as e:
        saved = sorted(driver.shas) if driver is not None else []
        raise RuntimeError(f"{type(e).__name__}: {str(e)[:1500]} -- the run stopped; versions {saved} are "
                           f"saved under {inputs.ckpt_dir}, metrics in {inputs.run_dir / 'metrics.jsonl'}") from e
    finally:
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaflash_ray.pipeline", description=__doc__.split("\n")[0])
    add_recipe_args(parser)
    parser.add_argument("--run-dir", default=None, help="run directory (default: <logging.run_root>/<name>-<time>)")
    parser.add_argument("--resume", default=None, metavar="RUN_DIR",
                        help="continue a stopped run: its config.yaml (plus any --set, e.g. a larger "
                             "distill.num_versions), its trainer state and checkpoints")
    ns = parser.parse_args(argv)
    try:
        if ns.resume:
            if ns.recipe or ns.run_dir:
                raise RecipeError("--resume RUN_DIR takes the run's own config.yaml and directory: drop "
                                  "--recipe / --run-dir (use --set to change a field)")
            ns.recipe, ns.run_dir = str(Path(ns.resume) / "config.yaml"), ns.resume
            if not Path(ns.recipe).is_file():
                raise RecipeError(f"--resume {ns.resume}: not a run directory (no config.yaml)")
        cfg = config_from_args(ns)  # fails before anything starts
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from adaflash_ray.models import CheckpointError

    try:
        summary = run(cfg, ns.run_dir, resume=bool(ns.resume))
    except (CheckpointError, ValueError, FileNotFoundError) as e:  # bad input, found before or after Ray started
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
