"""adaflash_ray.serve: the OpenAI-compatible HTTP endpoint on Ray Serve, with live distillation.

    python -m adaflash_ray.serve [--recipe R] [--set k=v] [--port N]      # embedded: local Ray on 127.0.0.1
    serve run adaflash_ray.serve:app [recipe=R] [set='k=v;k2=v2']        # an existing cluster (Serve CLI)

Modules: ``protocol`` (request validation, OpenAI error JSON, incremental detokenisation; Ray-free),
``runtime`` (the engine thread <-> asyncio bridge; Ray-free), ``app`` (the Serve deployments and routes),
``__main__`` (the command: start, print the URL, drain on SIGTERM / Ctrl-C).
"""
import os

# Ray reads this when it is first imported: bind a local Ray to loopback. `python -m adaflash_ray.serve` imports
# this package (and Ray) before running __main__, so it must be set here, not only in __main__.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from adaflash_ray.serve.app import APP_NAME, AdaFlashServer, DistillCoordinator, app, build_app  # noqa: E402

__all__ = ["APP_NAME", "AdaFlashServer", "DistillCoordinator", "app", "build_app"]
