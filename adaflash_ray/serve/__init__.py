"""adaflash_ray.serve: the OpenAI-compatible HTTP endpoint on Ray Serve, with live distillation.

    python -m adaflash_ray.serve [--recipe R] [--set k=v] [--port N]      # embedded: local Ray on 127.0.0.1
    serve run adaflash_ray.serve:app [recipe=R] [set='k=v;k2=v2']        # an existing cluster (Serve CLI)

Modules: ``protocol`` (request validation, OpenAI error JSON, incremental detokenisation; Ray-free),
``runtime`` (the engine thread <-> asyncio bridge; Ray-free), ``app`` (the Serve deployments and routes),
``__main__`` (the command: start, print the URL, drain on SIGTERM / Ctrl-C).
"""
from adaflash_ray.serve.app import APP_NAME, AdaFlashServer, DistillCoordinator, app, build_app

__all__ = ["APP_NAME", "AdaFlashServer", "DistillCoordinator", "app", "build_app"]
