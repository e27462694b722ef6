"""``python -m adaflash_ray.serve``: the OpenAI-compatible endpoint on the embedded default.

    python -m adaflash_ray.serve                                   # local Ray on 127.0.0.1, CPU, SmolLM2-135M
    python -m adaflash_ray.serve --recipe recipes/cpu_tiny.yaml --set serve.distill=true --port 8001
    python -m adaflash_ray.serve --resume runs/cpu_tiny-serve-<time>    # continue a live-distillation run
    RAY_ADDRESS=127.0.0.1:6379 python -m adaflash_ray.serve ...     # deploy onto a running cluster instead

Starts (or joins) Ray, starts Serve's HTTP proxy on ``serve.host:serve.port`` (127.0.0.1:8000 by default),
deploys the app and prints ONE stdout line, ``adaflash_ray serving <model> at http://HOST:PORT``, once it
answers. SIGTERM or Ctrl-C drains: every replica refuses new generations (503 + Retry-After) while the
requests in flight finish (up to ``serve.drain_timeout_s``), then Serve and Ray stop and the exit code is 0.
With ``serve.distill: true`` live distillation writes its run directory (``serve.run_dir``, default
``<logging.run_root>/<name>-serve-<time>``, printed on stderr): config.yaml, checkpoints/v<N>, trainer_state,
metrics.jsonl. ``--resume RUN_DIR`` serves again from that directory's config.yaml (plus any --set): the trainers
resume from its saved state and every replica starts at the latest version it learned.
Exit 2: a bad recipe / override (the message names the field), a target model that is neither a directory nor a
registry model, a ``drafter.init_path`` checkpoint that is unreadable or does not fit the target / the recipe, or a
``serve.host:serve.port`` something already listens on (these three checked here on the local Ray only), a
--resume directory that is not a live distillation run, or a serve.run_dir that already holds trainer state
without --resume - all found before Ray starts; 1: startup failed.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from adaflash_ray.config import (RecipeError, RunConfig, add_recipe_args, check_serve_config,  # noqa: E402
                                 config_from_args)
from adaflash_ray.data import MissingDataPackageError, ensure_target  # noqa: E402
from adaflash_ray.inputs import check_drafter_checkpoint  # noqa: E402
from adaflash_ray.models import CheckpointError  # noqa: E402
from adaflash_ray.serve.app import APP_NAME, build_app  # noqa: E402
from adaflash_ray.serve.protocol import served_model_id  # noqa: E402


def _init_ray(cfg: RunConfig) -> bool:
    """Join ``cfg.ray.address`` / $RAY_ADDRESS, else start a local Ray bound to 127.0.0.1 (as the pipeline
    does). Returns True if this process started Ray."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    s, pl = cfg.serve, cfg.placement
    need = s.num_replicas * s.cpus_per_replica + (pl.num_trainers * pl.cpus_per_trainer if s.distill else 0)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=cfg.ray.include_dashboard,
             dashboard_host=cfg.ray.dashboard_host,
             num_cpus=cfg.ray.num_cpus or max(int(need + 0.999), os.cpu_count() or 1), log_to_driver=True)
    return True


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (e.g. "Address already in use"), or None if it can (or ``port`` is 0).

    Serve's proxy binds with SO_REUSEPORT, so beside another server's Serve proxy it starts without an error and the
    kernel splits the connections between the two servers; a plain bind (SO_REUSEADDR only, as a restart right after a
    stop needs) fails while anything listens there."""
    if port == 0:
        return None
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError:
        return None  # an unresolvable host: Serve's own error names it
    try:
        with socket.create_server(addr, family=family):
            return None
    except OSError as e:
        return os.strerror(e.errno) if e.errno else str(e)


def drain(timeout_s: float) -> int:
    """Stop new generations on every replica and wait for the in-flight ones; returns those left."""
    handle = serve.get_app_handle(APP_NAME)
    handle.broadcast("begin_drain").results()
    deadline = time.monotonic() + timeout_s
    left = 0
    while time.monotonic() < deadline:
        left = sum(handle.broadcast("in_flight").results())
        if left == 0:
            break
        time.sleep(0.2)
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaflash_ray.serve", description=__doc__.split("\n")[0])
    add_recipe_args(parser)
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: serve.port, 8000)")
    parser.add_argument("--host", default=None, help="bind address (default: serve.host, 127.0.0.1)")
    parser.add_argument("--resume", default=None, metavar="RUN_DIR",
                        help="continue a live-distillation run: its config.yaml (plus any --set), trainer state "
                             "and checkpoints; the replicas serve its latest version")
    ns = parser.parse_args(argv)
    if ns.port is not None:
        ns.overrides.append(f"serve.port={ns.port}")
    if ns.host is not None:
        ns.overrides.append(f"serve.host={ns.host}")
    try:
        if ns.resume:
            run_dir = Path(ns.resume).resolve()
            if ns.recipe:
                raise RecipeError("--resume RUN_DIR takes the run's own config.yaml: drop --recipe "
                                  "(use --set to change a field)")
            if not (run_dir / "config.yaml").is_file() or not (run_dir / "trainer_state").is_dir():
                raise RecipeError(f"--resume {ns.resume}: not a live-distillation run directory "
                                  "(needs config.yaml and trainer_state/)")
            ns.recipe = str(run_dir / "config.yaml")
            ns.overrides = ["serve.distill=true", f"serve.run_dir={run_dir}", *ns.overrides]
        cfg = config_from_args(ns)
        check_serve_config(cfg, ns.recipe or "recipe")  # before Ray starts: exit 2 like any bad recipe
        if (cfg.serve.distill and not ns.resume and cfg.serve.run_dir
                and (Path(cfg.serve.run_dir) / "trainer_state" / "latest").is_file()):
            raise RecipeError(f"serve.run_dir {cfg.serve.run_dir} holds a run's trainer state: continue it with "
                              f"--resume {cfg.serve.run_dir}, or pick a new directory")
        if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
            busy = port_in_use(cfg.serve.host, cfg.serve.port)
            if busy:
                raise RecipeError(f"serve.port: {cfg.serve.host}:{cfg.serve.port} cannot be listened on ({busy}): "
                                  "is another server running there? pick another --port")
            # on the local Ray the replicas load these from this machine: a bad one would fail their constructors
            # after Serve's retries, the cause only in Serve's log (on a cluster the replicas' nodes hold them)
            model_dir = Path(ensure_target(cfg.model.path or cfg.model.name))
            if cfg.drafter.init_path:
                check_drafter_checkpoint(cfg.drafter.init_path, model_dir, cfg.drafter)
    except (RecipeError, CheckpointError, MissingDataPackageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    started = False
    try:
        started = _init_ray(cfg)
        serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
        application = build_app(cfg)
        if cfg.serve.distill:
            run_dir = application._bound_deployment.init_args[0]["serve"]["run_dir"]
            print(f"live distillation run directory: {run_dir}" + (" (resumed)" if ns.resume else ""),
                  file=sys.stderr, flush=True)
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
            signal.signal(sig, lambda *_: stop.set())
        print(f"adaflash_ray serving {served_model_id(cfg.model, cfg.serve)} at "
              f"http://{cfg.serve.host}:{cfg.serve.port}", flush=True)
        while not stop.wait(0.5):
            pass
        print("draining: in-flight requests finish, new ones get 503", file=sys.stderr, flush=True)
        left = drain(cfg.serve.drain_timeout_s)
        if left:
            print(f"drain timeout: {left} request(s) still in flight after {cfg.serve.drain_timeout_s} s",
                  file=sys.stderr)
        serve.shutdown()
        return 0
    except Exception as e:
        print(f"error: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr)
        return 1
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
