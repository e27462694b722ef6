"""The AdaFlash main job: on-policy distillation of a DFlash drafter while it serves.

    python -m adaflash_ray.pipeline                                   # embedded default: local Ray, CPU
    python -m adaflash_ray.pipeline --recipe recipes/cpu_tiny.yaml --set distill.num_versions=2
    python -m adaflash_ray.pipeline --resume runs/<run> --set distill.num_versions=8   # continue a stopped run
    ray job submit --address http://127.0.0.1:8265 -- python -m adaflash_ray.pipeline

Wiring (docs/design/ARCHITECTURE.md): placement groups for inference | trainers; InferenceWorker x N record
trajectories into the TrajectoryBuffer; DistillTrainer x M (DeepSpeed) train the drafter + length
head and publish versions to the WeightRegistry, which pushes each to every worker (hot reload
between engine steps). The driver feeds prompts, polls flat metric dicts, writes the run
directory (resolved config, metrics.jsonl, a checkpoint per version, tau_vs_version.png, wandb),
then evaluates every version on held-out prompts (greedy) and prints a table. The last stdout
line is one JSON object: run_dir, final_version, eval_tau (version -> τ), wall_s, ...

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
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from adaflash_ray.actors import DistillTrainer, InferenceWorker, TrajectoryBuffer, WeightRegistry, recovery  # noqa: E402
from adaflash_ray.config import RecipeError, RunConfig, add_recipe_args, config_from_args  # noqa: E402
from adaflash_ray.data import encode_prompts, ensure_target, load_eval_prompts, load_sharegpt, load_tokenizer  # noqa: E402
from adaflash_ray.engine import SpecStats  # noqa: E402
from adaflash_ray.metrics import MetricsSink, PlainProgress, plot_tau, strict_json  # noqa: E402
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


def _pg(bundles: list[dict], what: str):
    """A PACK placement group; raises RuntimeError naming the request if the cluster cannot hold it."""
    total = ray.cluster_resources()
    need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
    short = {k: (v, total.get(k, 0)) for k, v in need.items() if v > total.get(k, 0)}
    if short:
        raise RuntimeError(f"the cluster cannot place the {what}: needs " +
                           ", ".join(f"{k} {v} (cluster has {have})" for k, (v, have) in short.items()) +
                           " - change recipe section `placement`")
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(pg)
        raise RuntimeError(f"placement group for the {what} ({bundles}) not ready after 300 s") from e
    return pg


def _eval_tau(results: list[dict]) -> tuple[float, float, dict]:
    """τ, draft waste and γ histogram of worker results (their per-step ``draft_lens`` / ``num_accepted``),
    by the one definition in :class:`adaflash_ray.engine.SpecStats`."""
    st = SpecStats.from_steps([g for r in results for g in r["draft_lens"]],
                              [a for r in results for a in r["num_accepted"]])
    return st.accept_len, st.draft_waste, dict(sorted(st.draft_len_hist.items()))


def check_drafter_checkpoint(path: str, model_dir: Path, drafter_cfg=None) -> None:
    """Raise CheckpointError if the DFlash checkpoint at ``path`` is unreadable, does not fit the target in
    ``model_dir`` (vocabulary, width, layer ids) or, given the recipe's ``drafter`` section, differs from it."""
    from adaflash_ray.models import CheckpointError, TargetConfig, load_drafter_checkpoint
    from adaflash_ray.models.factory import check_checkpoint_matches_recipe

    cfg, _, _ = load_drafter_checkpoint(path)
    try:
        cfg.check_target(TargetConfig.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text())))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    if drafter_cfg is not None:
        check_checkpoint_matches_recipe(cfg, drafter_cfg, path)


class WorkerLost(RuntimeError):
    """An inference worker died for good (restarts exhausted) or its engine thread failed."""


def _poll(refs: list, default):
    """ray.get each ref; a worker being restarted by Ray yields ``default``; one that is dead for good
    (restarts exhausted) raises :class:`WorkerLost`."""
    out = []
    for r in refs:
        try:
            out.append(ray.get(r, timeout=120))
        except ray.exceptions.ActorDiedError as e:
            raise WorkerLost(f"an InferenceWorker died and will not be restarted: {str(e)[:1500]}") from e
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
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
        reports = ray.get(registry.rollback.remote(good[0], reason, version))
        if reports is not None:
            console.print(f"canary: version {version} rolled back to {good[0]}: {reason}")
            sink.log({"canary/rollback_from": version, "canary/rollback_to": good[0],
                      "canary/num_workers_ok": sum(1 for r in reports if r.get("version") == good[0])},
                     kind="canary")


def run(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False) -> dict:
    """Run the whole job for a validated config; returns the summary dict (also printed). With ``resume``,
    continue the run in ``run_dir``: the trainers load their state saved with the last published version,
    the workers start at that version, and training goes on to ``distill.num_versions``."""
    t_start = time.time()
    root = Path(cfg.logging.run_root)
    run_dir = Path(run_dir) if run_dir else root / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # real inputs (installed packages; converted once into the cache), checked before anything is written
    model_dir = ensure_target(cfg.model.path or cfg.model.name)
    num_target_layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    try:
        cfg.drafter.resolve_target_layer_ids(num_target_layers)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if cfg.drafter.init_path:  # fail before Ray starts, naming what is wrong with the checkpoint
        check_drafter_checkpoint(cfg.drafter.init_path, model_dir, cfg.drafter)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    cfg.dump_yaml(run_dir / "config.yaml")
    ckpt_dir = run_dir / "checkpoints"
    state_dir = str(run_dir / "trainer_state")
    tok = load_tokenizer(model_dir)
    train = encode_prompts(tok, load_sharegpt(cfg.data.num_train_prompts, cfg.seed), cfg.data.max_prompt_tokens)
    evalp = encode_prompts(tok, load_eval_prompts(cfg.data.eval_sources, cfg.data.num_eval_prompts, cfg.seed + 1),
                           cfg.data.max_prompt_tokens)
    if not train or not evalp:
        raise RuntimeError(f"no prompts left after the {cfg.data.max_prompt_tokens}-token limit "
                           f"(train {len(train)}, eval {len(evalp)})")
    train_texts = {m["content"] for p in train.prompts for m in p.messages}
    leak = [p.id for p in evalp.prompts if any(m["content"] in train_texts for m in p.messages)]
    if leak:
        raise RuntimeError(f"eval prompts also in the training set: {leak[:5]}")
    console.print(f"[bold]adaflash_ray[/] run_dir={run_dir} train_prompts={len(train)} eval_prompts={len(evalp)}")

    started, dashboard = init_ray(cfg)
    console.print(f"ray: node {ray.util.get_node_ip_address()} job {ray.get_runtime_context().get_job_id()} "
                  f"dashboard http://{dashboard}" if dashboard else "ray: connected")
    pl = cfg.placement
    cfg_dict = cfg.model_dump()
    pg_inf = _pg([{"CPU": pl.cpus_per_inference_worker, **({"GPU": pl.gpus_per_inference_worker}
                                                           if pl.gpus_per_inference_worker else {})}
                  for _ in range(pl.num_inference_workers)], "inference workers")
    pg_train = _pg([{"CPU": pl.cpus_per_trainer, **({"GPU": pl.gpus_per_trainer} if pl.gpus_per_trainer else {})}
                    for _ in range(pl.num_trainers)], "trainers")
    sink = MetricsSink(run_dir, cfg.logging.wandb_mode, cfg.logging.wandb_project, cfg_dict, run_dir.name)
    summary: dict = {}
    shas: dict[int, str] = {}
    try:
        buffer = TrajectoryBuffer.options(  # restarted by Ray if it dies; with spill_dir its journal comes back
            max_restarts=2, max_task_retries=-1).remote(cfg.buffer.capacity, cfg.distill.max_version_lag,
                                                        cfg.buffer.spill_dir)
        registry = WeightRegistry.remote()
        workers = [InferenceWorker.options(  # restarted by Ray if it dies; it reloads the latest version
            num_cpus=pl.cpus_per_inference_worker, num_gpus=pl.gpus_per_inference_worker, max_restarts=3,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg_inf, placement_group_bundle_index=i),
        ).remote(cfg_dict, i, buffer, registry) for i in range(pl.num_inference_workers)]
        trainers = [DistillTrainer.options(  # restarted by Ray if it dies; every rank then resumes
            num_cpus=pl.cpus_per_trainer, num_gpus=pl.gpus_per_trainer,
            max_restarts=cfg.distill.trainer_max_restarts, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg_train, placement_group_bundle_index=r),
        ).remote(cfg_dict, r, pl.num_trainers) for r in range(pl.num_trainers)]
        ray.get([registry.subscribe.remote(f"worker-{i}", w) for i, w in enumerate(workers)])
        if resume:
            shas.update(recovery.saved_versions(ckpt_dir))
        setup = recovery.setup_trainers(trainers, state_dir, resume)
        last_version, dcfg, sha = recovery.sync_version(trainers, workers, registry, buffer, ckpt_dir, shas)
        drafter_cfg = DrafterModelConfig(**dcfg)
        console.print(f"setup: trainers {setup}; workers at version {last_version} sha {sha[:12]}")

        canary = recovery.TauCanary(recovery.canary_prompts(cfg, tok, evalp), cfg.distill.canary_max_new_tokens,
                           cfg.distill.canary_delta)
        if canary.prompts:  # the starting version's τ is the first reference
            canary.start(workers[0], last_version)
            _check_canary(canary, registry, sink, wait=True)

        runs = [t.run.remote(buffer, registry) for t in trainers]
        restarts_left, num_trainer_restarts = cfg.distill.trainer_max_restarts, 0
        next_prompt, fed = 0, 0
        serve_tau: dict[int, list[float]] = {}
        step, last_loss = setup[0]["step"], None
        low_water = 2 * cfg.engine.max_batch_size
        show = cfg.logging.progress
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]versions"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeElapsedColumn(), TextColumn("{task.description}"), console=console,
                            disable=not (show and console.is_terminal), transient=False)
        # no terminal (ray job logs, CI): a plain line every logging.progress_every_s instead of the bar
        plain = (PlainProgress(sys.stderr, cfg.logging.progress_every_s, cfg.distill.num_versions)
                 if show and not console.is_terminal else None)
        t_train0, train_busy_s = time.time(), 0.0
        with progress:
            task = progress.add_task("starting", total=cfg.distill.num_versions)
            while True:
                depths = _poll([w.queue_depth.remote() for w in workers], low_water)
                for w, d in zip(workers, depths):  # keep every worker busy with on-policy traffic
                    if d < low_water:
                        batch = [train[(next_prompt + j) % len(train)] for j in range(low_water - d)]
                        next_prompt += len(batch)
                        fed += len(batch)
                        w.submit.remote(batch, cfg.engine.max_new_tokens, cfg.engine.temperature)
                done, _ = ray.wait(runs, num_returns=len(runs), timeout=2.0)
                died = recovery.trainer_death(done)
                if died is not None:  # restart every rank from the state saved with the last version
                    if restarts_left <= 0:
                        raise RuntimeError(f"a DistillTrainer died mid-run and its {num_trainer_restarts} restarts "
                                           f"are used up ({died}); versions {sorted(shas)} are saved under "
                                           f"{ckpt_dir}, continue with --resume {run_dir}")
                    restarts_left -= 1
                    num_trainer_restarts += 1
                    console.print(f"a DistillTrainer died ({died[:300]}); restarting the trainers from their last "
                                  f"saved state ({restarts_left} restarts left)", markup=False)
                    sink.log({"fault/trainer_restart": num_trainer_restarts}, kind="fault")
                    recovery.restart_trainers(trainers, runs, done)
                    setup = recovery.setup_trainers(trainers, state_dir, True)
                    requeued = sum(ray.get([buffer.requeue.remote(f"trainer-{r}") for r in range(len(trainers))]))
                    recovery.sync_version(trainers, workers, registry, buffer, ckpt_dir, shas)
                    sink.log({"fault/trainer_resumed_version": setup[0]["version"],
                              "fault/trajectories_requeued": requeued}, kind="fault")
                    runs = [t.run.remote(buffer, registry) for t in trainers]
                    continue
                wstats = _poll([w.stats.remote() for w in workers], None)
                bstats = ray.get(buffer.stats.remote())
                try:
                    tmetrics = ray.get(trainers[0].pop_metrics.remote(), timeout=60)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    tmetrics = []  # dying or restarting: the next poll sees it
                for i, s in enumerate(wstats):
                    if s is None:  # worker restarting (Ray restarts it; it reloads the latest version)
                        sink.log({"worker/unavailable": 1.0, "worker": i}, kind="inference")
                        continue
                    if s.get("spec/engine_dead"):
                        raise WorkerLost(f"InferenceWorker {i}: engine loop failed ({s.get('spec/error', '')})")
                    if s["spec/accept_len"] > 0:
                        serve_tau.setdefault(int(s["spec/drafter_version"]), []).append(s["spec/accept_len"])
                    sink.log({**s, "worker": i}, kind="inference")
                sink.log(bstats, kind="buffer")
                for m in tmetrics:
                    step = int(m.get("train/step", step + 1))
                    train_busy_s += m.get("train/seconds", 0.0)
                    sink.log(m, step=step, kind="train")
                meta = ray.get(registry.latest_meta.remote())
                if meta is not None and meta["version"] > last_version:
                    history = {h["version"]: h for h in ray.get(registry.get_history.remote())}
                    reports_all = ray.get(registry.get_reports.remote())
                    for v in range(last_version + 1, meta["version"] + 1):  # every version, even two per poll
                        h = history[v]
                        tens = ray.get(ray.get(registry.get.remote(v))[0])
                        shas[v] = save_drafter_checkpoint(ckpt_dir / f"v{v}", drafter_cfg, tens,
                                                          {"version": v, "parent_version": h["parent_version"],
                                                           "train_step": h["train_step"]})
                        ok = sum(r.get("sha256") == h["sha256"] for r in reports_all.get(v, []))
                        sink.log({"sync/version": v, "sync/num_workers_ok": ok}, kind="sync")
                    last_version = meta["version"]
                    if canary.prompts:
                        canary.start(workers[0], last_version)
                if canary.prompts:
                    _check_canary(canary, registry, sink)
                if tmetrics:
                    last_loss = tmetrics[-1]["train/loss"]
                if plain is not None:
                    w0 = wstats[0] or {}
                    plain.update(last_version, step=step, loss=last_loss, serve_tau=w0.get("spec/accept_len") or None,
                                 gamma=w0.get("spec/mean_draft_len") or None, buffer=int(bstats["buffer/depth"]),
                                 stale_drops=int(bstats["buffer/dropped_stale"]),
                                 trainer_util=train_busy_s / max(time.time() - t_train0, 1e-9),
                                 tok_per_s=sum((s or {}).get("spec/tokens_per_s", 0.0) for s in wstats))
                progress.update(task, completed=last_version, description=(
                    f"step {step} loss {last_loss if last_loss is None else round(last_loss, 3)} "
                    f"serve τ {(wstats[0] or {}).get('spec/accept_len', 0):.2f} "
                    f"γ̄ {(wstats[0] or {}).get('spec/mean_draft_len', 0):.1f} "
                    f"buffer {int(bstats['buffer/depth'])} stale-drops {int(bstats['buffer/dropped_stale'])}"))
                if len(done) == len(runs):
                    break
            train_summary = ray.get(runs)
            if canary.prompts:
                _check_canary(canary, registry, sink, wait=True)
        train_wall_s = time.time() - t_train0
        if plain is not None:
            plain.update(last_version, force=True, step=step, loss=last_loss, training="done",
                         trainer_util=train_busy_s / max(train_wall_s, 1e-9))
        final_version = max(r["final_version"] for r in train_summary)
        num_cancelled = sum(ray.get([w.cancel_recorded.remote() for w in workers]))
        for m in ray.get(trainers[0].pop_metrics.remote()):
            sink.log(m, kind="train")
        # every worker must hold the final version with the published checksum
        loaded = ray.get([w.loaded_version.remote() for w in workers])
        serving = ray.get(registry.latest_meta.remote())  # the final version, or the one the canary kept
        workers_ok = all(lv["version"] == serving["version"] and lv["sha256"] == serving["sha256"] for lv in loaded)
        # held-out evaluation of every version, greedy, through the hot-reload path of worker 0
        eval_tau, eval_waste, eval_hist = {}, {}, {}
        from adaflash_ray.models import load_drafter_checkpoint

        for i, v in enumerate(sorted(shas)):  # back to v0 (an explicit rollback), then forward version by version
            _, tens, _ = load_drafter_checkpoint(ckpt_dir / f"v{v}")
            load = workers[0].rollback_drafter if i == 0 else workers[0].load_drafter
            ray.get(load.remote(v, tens, shas[v], dcfg))
            res = ray.get(workers[0].generate.remote(list(evalp), cfg.data.eval_max_new_tokens, 0.0, False))
            eval_tau[v], eval_waste[v], eval_hist[v] = _eval_tau(res)
            sink.log({"eval/version": v, "eval/accept_len": eval_tau[v], "eval/draft_waste": eval_waste[v]},
                     kind="eval")
            console.print(f"eval v{v}: τ={eval_tau[v]:.3f} draft waste={eval_waste[v]:.3f} γ hist={eval_hist[v]}")
        serve_mean = {v: sum(x) / len(x) for v, x in serve_tau.items()}
        plot_tau(eval_tau, serve_mean, run_dir / "tau_vs_version.png",
                 f"{cfg.name}: τ vs drafter version ({cfg.model.name})")
        bfinal = ray.get(buffer.stats.remote())
        table = Table(title=f"AdaFlash {cfg.name} — τ = mean committed tokens per verify step (a+1)")
        for col in ("version", "eval τ (held-out, greedy)", "eval draft waste", "serving τ (on-policy)"):
            table.add_column(col)
        for v in sorted(eval_tau):
            table.add_row(str(v), f"{eval_tau[v]:.3f}", f"{eval_waste[v]:.3f}",
                          f"{serve_mean[v]:.3f}" if v in serve_mean else "-")
        Console().print(table)
        summary = {"run_dir": str(run_dir), "final_version": final_version,
                   "eval_tau": {str(k): round(v, 4) for k, v in eval_tau.items()},
                   "eval_draft_waste": {str(k): round(v, 4) for k, v in eval_waste.items()},
                   "serve_tau": {str(k): round(v, 4) for k, v in serve_mean.items()},
                   "train_steps": max(r["steps"] for r in train_summary),
                   "workers_loaded_final": workers_ok, "serving_version": serving["version"], "prompts_fed": fed,
                   "trainer_utilisation": round(train_busy_s / max(train_wall_s, 1e-9), 3),
                   "trainer_restarts": num_trainer_restarts,
                   "canary": {"tau": {str(k): round(v, 4) for k, v in canary.tau.items()},
                              "rollbacks": [{k: r[k] for k in ("from_version", "to_version", "reason")}
                                            for r in ray.get(registry.get_rollbacks.remote())]},
                   "versions_rising": recovery.versions_rising(ray.get(registry.get_history.remote())),
                   "trajectories": {"trained_fresh": train_summary[0]["num_fresh"],
                                    "counted_twice": train_summary[0]["num_counted_twice"],
                                    "lost_owner_died": train_summary[0]["num_lost"],
                                    "duplicates_delivered_not_retrained": train_summary[0]["num_duplicates_skipped"],
                                    "redelivered_after_restart": int(bfinal["buffer/redelivered"])},
                   "prompts_cancelled_after_training": num_cancelled,
                   "buffer": {k.split("/", 1)[1]: v for k, v in bfinal.items()},
                   "num_eval_prompts": len(evalp), "wall_s": round(time.time() - t_start, 1)}
        summary = strict_json(summary)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        for w in workers:
            ray.get(w.shutdown.remote())
    except (WorkerLost, ray.exceptions.RayError) as e:
        raise RuntimeError(f"{type(e).__name__}: {str(e)[:1500]} -- the run stopped; versions {sorted(shas)} are "
                           f"saved under {ckpt_dir}, metrics in {run_dir / 'metrics.jsonl'}") from e
    finally:
        sink.close()
        for pg in (pg_inf, pg_train):
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if started:
            ray.shutdown()
    return summary


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
