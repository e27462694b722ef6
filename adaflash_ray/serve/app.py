"""The Ray Serve application: an OpenAI-compatible FastAPI ingress whose replicas each own a SpecEngine.

Routes (all JSON; errors are ``{"error": {"message", "type", "param", "code"}}``):
``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(SSE with ``"stream": true``; request fields: :mod:`~adaflash_ray.serve.protocol`, response bodies and chunks, ``n``
choices and logprobs: :mod:`~adaflash_ray.serve.responses`), ``GET /v1/adaflash/status``. Every generation response carries the header
``x-adaflash-drafter-version`` (the drafter version loaded when the response started) and, in its body
(the last chunk when streaming), ``adaflash.drafter_versions`` - every version that served one of its steps.
Unknown request fields are ignored with a logged warning (vLLM's behaviour); a response to such a request names
them in the header ``x-adaflash-ignored-fields`` (comma-separated dotted paths) and in ``adaflash.ignored_fields``.

With ``serve.distill: true`` a :class:`DistillCoordinator` deployment starts the TrajectoryBuffer, the
WeightRegistry and the DeepSpeed DistillTrainer group; each replica ships the trajectories of the requests it
served (unless a request says ``"store": false``) and polls the registry, hot-reloading each new drafter
version between engine steps while requests are in flight.

    serve run adaflash_ray.serve:app recipe=recipes/cpu_tiny.yaml   # an existing cluster / serve CLI
    python -m adaflash_ray.serve --recipe recipes/cpu_tiny.yaml      # embedded: local Ray on 127.0.0.1
"""
import asyncio
import hmac
import json
import logging
import os
import threading
import time
from pathlib import Path

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.util import metrics as ray_metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaflash_ray.config import RunConfig, check_serve_config, load_recipe
from adaflash_ray.metrics import strict_json
from adaflash_ray.serve.protocol import APIError, GenSpec, error_body, parse_request, served_model_id
from adaflash_ray.serve.responses import ResponseWriter
from adaflash_ray.serve.runtime import EngineLoop, QueueFull
from adaflash_ray.versions import is_newer

log = logging.getLogger("ray.serve")


def _bind_replica_grpc_to_node_ip() -> None:
    """Ray Serve 2.60 starts an inter-deployment gRPC server in every replica on ``[::]:0`` - every
    interface - whatever the node's address. Bind it to the node's Ray IP instead (127.0.0.1 on the embedded
    default), like every other Ray port, so nothing listens beyond loopback unless the cluster does.
    Runs at import and in each deployment's constructor, i.e. in each replica before Serve starts that
    server (tests/test_serve.py checks every listener of the server's process tree)."""
    try:
        from ray.serve._private import replica as _replica
    except ImportError:
        return
    orig = getattr(_replica, "add_port_to_grpc_server", None)
    if orig is None or getattr(orig, "_adaflash", False):
        return

    def bound(server, address: str):
        if address.startswith("[::]:"):
            ip = ray.util.get_node_ip_address()
            address = f"{f'[{ip}]' if ':' in ip else ip}:{address.rsplit(':', 1)[1]}"
        return orig(server, address)

    bound._adaflash = True
    _replica.add_port_to_grpc_server = bound


_bind_replica_grpc_to_node_ip()
APP_NAME = "adaflash"
VERSION_HEADER = "x-adaflash-drafter-version"
IGNORED_HEADER = "x-adaflash-ignored-fields"  # comma-separated dotted paths of the unknown fields ignored

api = FastAPI(title="adaflash_ray", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), kind, None, None), status_code=e.status_code)


@api.exception_handler(Exception)
async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    if isinstance(e, ray.exceptions.TaskCancelledError):  # Serve cancels a request whose client went away
        log.info("request cancelled (client disconnected)")
        return JSONResponse(error_body("request cancelled", "server_error"), status_code=499)
    log.exception("request failed")
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {str(e)[:300]}", "server_error"),
                        status_code=500)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class DistillCoordinator:
    """Live distillation beside the replicas: TrajectoryBuffer, WeightRegistry, DistillTrainer x M - the main
    job's :class:`~adaflash_ray.actors.group.ActorGroup` with no inference workers (trainers on their own
    placement group), driven by the main job's :class:`~adaflash_ray.pipeline.Driver` steps.

    It writes the run directory ``serve.run_dir`` (set by :func:`build_app`) as the main job does:
    ``config.yaml``, ``checkpoints/v<N>`` for every version, ``trainer_state/`` (saved with every version),
    ``metrics.jsonl`` (+ wandb) of the trainer, buffer and sync records. On a directory that already holds trainer
    state (``python -m adaflash_ray.serve --resume RUN_DIR``, or Serve restarting this replica) the trainers
    resume from it and the registry starts at their version, which the replicas then load; on a fresh directory it
    publishes version 0 (the trainer's initial weights). Either way before answering; then it trains on the
    served traffic up to ``distill.num_versions`` versions, every ``distill.publish_every`` steps.

    Raises:
        RuntimeError: the trainers' placement group cannot be placed; ValueError: saved trainer state that
            cannot be loaded (nothing is left behind in either case).
    """

    def __init__(self, cfg: dict):
        from adaflash_ray.actors import ActorGroup
        from adaflash_ray.inputs import Inputs
        from adaflash_ray.pipeline import Driver

        _bind_replica_grpc_to_node_ip()  # Serve pickles this class by value: the module import may not run here
        self.cfg = RunConfig.model_validate(cfg)
        if not self.cfg.serve.run_dir:
            raise ValueError("DistillCoordinator needs serve.run_dir (build_app sets it)")
        run_dir = Path(self.cfg.serve.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        saved = self.cfg.model_copy(deep=True)
        saved.serve.api_key = None  # never on disk: --resume takes it from --set or $ADAFLASH_API_KEY again
        saved.dump_yaml(run_dir / "config.yaml")
        self.inputs = Inputs(run_dir=run_dir, ckpt_dir=run_dir / "checkpoints", state_dir=str(run_dir / "trainer_state"),
                             model_dir=None, tokenizer=None, train=[], evalp=[], canary_prompts=[])
        self.resumed = (Path(self.inputs.state_dir) / "latest").is_file()
        # the main job's actor group with no inference workers: the Serve replicas are the inference side
        self.group = ActorGroup(self.cfg, num_inference_workers=0, run_dir=run_dir)
        self.buffer, self.registry, self.trainers = self.group.buffer, self.group.registry, self.group.trainers
        self._stop = threading.Event()
        try:
            self.driver = Driver(self.cfg, self.inputs, self.group)
            self.driver.setup(self.resumed)  # trainers built / resumed, checkpoints/v<V> saved, V published if > 0
            if ray.get(self.registry.latest_meta.remote()) is None:  # a fresh start: version 0 for the replicas
                refs, sha0, dcfg = ray.get([t.initial_weights.remote() for t in self.trainers])[0]  # every rank
                ray.get(self.registry.publish.remote(version=0, parent_version=-1, train_step=0, tensors_ref=refs,
                                                     sha256=sha0, config=dcfg))
            self.start_version = self.driver.last_version
            self.runs = self.group.start_training()
        except BaseException:  # Serve retries the constructor: leave no placement group behind
            self.group.shutdown()
            raise
        self.error: str | None = None
        self.training_done = False
        self._thread = threading.Thread(target=self._drive, name="distill driver", daemon=True)
        self._thread.start()

    def _drive(self) -> None:
        """Every 2 s: restart dead trainers (up to ``distill.trainer_max_restarts``), log the trainer and buffer
        metrics, save each new version's checkpoint; ends when training is done or failed."""
        from adaflash_ray.actors.recovery import trainer_death

        d = self.driver
        while not self._stop.is_set():
            try:
                done, _ = ray.wait(self.group.runs, num_returns=len(self.group.runs), timeout=2.0)
                died = trainer_death(done)
                if died is not None:
                    d.handle_trainer_death(died, done)
                    continue
                d.collect_metrics()
                d.save_new_versions()
                if len(done) == len(self.group.runs):
                    ray.get(self.group.runs)
                    self.training_done = True
                    return
            except Exception as e:  # a trainer dead for good: serving continues with the last saved version
                self.error = f"{type(e).__name__}: {str(e)[:500]}"
                log.warning("live distillation stopped: %s", self.error)
                return

    def __del__(self):  # Serve calls it on a graceful shutdown: the trainers' placement group goes with it
        stop, thread = getattr(self, "_stop", None), getattr(self, "_thread", None)
        if stop is not None:
            stop.set()
        if thread is not None:
            thread.join(timeout=30)
        driver = getattr(self, "driver", None)
        if driver is not None and getattr(self, "error", None) is None:
            try:  # a version published since the last poll is saved too
                driver.save_new_versions()
            except Exception as e:  # noqa: BLE001 - shutting down: log and continue
                log.warning("saving the last versions failed: %r", e)
        group = getattr(self, "group", None)
        if group is not None:
            group.shutdown()

    def handles(self) -> tuple:
        """(TrajectoryBuffer, WeightRegistry) actor handles for the replicas."""
        return self.buffer, self.registry

    async def status(self) -> dict:
        d = self.driver
        meta = await self.registry.latest_meta.remote()
        return {"enabled": True, "latest_version": None if meta is None else meta["version"],
                "saved_versions": sorted(d.shas.copy()), "run_dir": str(self.inputs.run_dir), "resumed": self.resumed,
                "start_version": self.start_version, "num_versions_target": self.cfg.distill.num_versions,
                "training_done": self.training_done, "trainer_error": self.error,
                "last_train": {"step": d.step, "loss": d.last_loss, "num_trainer_restarts": d.num_trainer_restarts},
                "buffer": await self.buffer.stats.remote()}


@serve.deployment(ray_actor_options={"num_cpus": 1})
@serve.ingress(api)
class AdaFlashServer:
    """One replica: a SpecEngine (target + DFlash drafter + length head) behind the OpenAI routes.

    Args:
        cfg: RunConfig dict (``serve`` section: limits, API key, distillation).
        coordinator: DeploymentHandle of :class:`DistillCoordinator`, or None without distillation.
    """

    async def __init__(self, cfg: dict, coordinator=None):
        from adaflash_ray.data import load_tokenizer, target_dir
        from adaflash_ray.actors.spec_metrics import SpecMetrics
        from adaflash_ray.engine import SpecEngine
        from adaflash_ray.models import DrafterModelConfig

        _bind_replica_grpc_to_node_ip()
        self.cfg = c = RunConfig.model_validate(cfg)
        torch.set_num_threads(c.engine.num_threads)
        torch.manual_seed(c.seed)
        self.replica = serve.get_replica_context().replica_tag if serve.get_replica_context() else "local"
        self.model_id = served_model_id(c.model, c.serve)
        self.tokenizer = load_tokenizer(target_dir(c.model))
        self.engine = SpecEngine.from_config(c, record=c.serve.distill)
        target, block_size = self.engine.target, self.engine.drafter.block_size
        self.vocab_size = target.config.vocab_size
        self.eos_ids = list(target.config.eos_token_ids)
        self.context_limit = min(c.serve.max_request_tokens, c.engine.max_seq_len - block_size)
        self.api_key = c.serve.api_key
        self.draining = False
        self.buffer = self.registry = None
        self.coordinator = coordinator
        self.weight_error: str | None = None
        self.num_trajectories = 0
        if coordinator is not None:
            self.buffer, self.registry = await coordinator.handles.remote()
            meta = await self.registry.latest_meta.remote()  # version 0: identical on every side
            tensors = await (await self.registry.get.remote(version=meta["version"]))[0]
            self.engine.load_drafter(tensors, meta["version"], meta["sha256"], DrafterModelConfig(**meta["config"]))
        loop = asyncio.get_running_loop()
        if c.engine.gc_freeze:  # built and loaded: the collector skips this heap from now on (engine/gc_pauses.py)
            from adaflash_ray.engine.gc_pauses import freeze_gc_heap
            freeze_gc_heap()
        # the vLLM-shaped counters / histograms, shared with the main job's inference workers
        self.spec_metrics = SpecMetrics(block_size, "serve", self.replica)
        self.spec_metrics.set_drafter_version(self.engine.drafter_version)
        self.loop = EngineLoop(self.engine, loop, c.engine.max_batch_size, c.serve.max_queued_requests,
                               on_finished=self._record if coordinator is not None else None,
                               metrics=self.spec_metrics, stall_timeout_s=c.serve.engine_stall_timeout_s)
        tags = {"replica": self.replica}
        self.m_tps = ray_metrics.Gauge("adaflash_serve_tokens_per_s", "committed tokens/s (10 s window)",
                                       tag_keys=("replica",))
        self.m_queue = ray_metrics.Gauge("adaflash_serve_queue_depth", "requests waiting / running",
                                         tag_keys=("replica", "state"))
        for m in (self.m_tps, self.m_queue):
            m.set_default_tags(tags)
        self._tasks = [asyncio.create_task(self._metrics_task())]
        if self.registry is not None:
            self._tasks.append(asyncio.create_task(self._weights_task()))

    # ------------------------------------------------------------------ background tasks
    def _record(self, req) -> None:  # engine thread: ship the on-policy trajectory
        traj = self.engine.to_trajectory(req)
        ref = ray.put(traj)
        self.buffer.add.remote([ref], version=traj.drafter_version, num_tokens=traj.num_response_tokens)
        self.num_trajectories += 1

    async def _weights_task(self) -> None:
        from adaflash_ray.models import DrafterModelConfig

        while True:
            await asyncio.sleep(self.cfg.serve.weight_poll_s)
            try:
                meta = await self.registry.latest_meta.remote()
                eng = self.engine
                if meta is None or not is_newer(meta["version"], eng.drafter_version,
                                                current_published=eng.num_reloads > 0):
                    continue
                tensors = await (await self.registry.get.remote(version=meta["version"]))[0]
                await asyncio.wrap_future(self.loop.load_drafter(tensors, meta["version"], meta["sha256"],
                                                                 DrafterModelConfig(**meta["config"])))
                self.weight_error = None
            except Exception as e:  # keep serving with the loaded version; retried next poll
                self.weight_error = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("drafter reload failed: %s", self.weight_error)

    async def _metrics_task(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.spec_metrics.set_drafter_version(self.engine.drafter_version)
            self.m_tps.set(self.loop.tokens_per_s())
            for state, n in self.loop.queue_depth().items():
                self.m_queue.set(n, tags={"state": state})

    # ------------------------------------------------------------------ control (python -m adaflash_ray.serve)
    def begin_drain(self) -> int:
        """Refuse new generations (503) from now on; returns the requests still in flight."""
        self.draining = True
        return self.loop.num_in_flight

    def in_flight(self) -> int:
        return self.loop.num_in_flight

    # ------------------------------------------------------------------ helpers
    def _auth(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           type="authentication_error", code="invalid_api_key")

    async def _body(self, request: Request) -> object:
        """The request's decoded JSON body.

        Raises:
            APIError: 415 for a media type other than JSON, 413 for a body over ``serve.max_body_bytes``, 400
                ``invalid_json`` for a body that is not JSON or nests arrays / objects too deeply to decode.
        """
        ctype = request.headers.get("content-type")
        media = None if ctype is None else ctype.partition(";")[0].strip().lower()
        if media is not None and media != "application/json" and not media.endswith("+json"):
            # a missing Content-Type is read as JSON; another media type is refused, as FastAPI-based servers do
            # (a browser page may send text/plain or a form cross-origin without a preflight)
            raise APIError(415, f"Content-Type {media!r} is not supported: send the JSON body with 'Content-Type: "
                                f"application/json'.", param="Content-Type", code="unsupported_media_type")
        limit = self.cfg.serve.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                           code="request_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        try:
            return json.loads(data)
        except ValueError as e:
            raise APIError(400, f"The request body is not valid JSON: {e}.", code="invalid_json") from None
        except RecursionError:  # json.loads recurses once per nesting level: "[[[[..." thousands deep
            raise APIError(400, "The request body cannot be read: its JSON arrays / objects are nested too deeply.",
                           code="invalid_json") from None

    def _retry(self, status: int, message: str, code: str) -> APIError:
        return APIError(status, message, type="rate_limit_error" if status == 429 else "service_unavailable",
                        code=code, headers={"Retry-After": str(self.cfg.serve.retry_after_s)})

    async def _spec(self, kind: str, request: Request) -> GenSpec:
        self._auth(request)
        raw = await self._body(request)
        if self.draining:
            raise self._retry(503, "The server is shutting down; retry on another replica.", "draining")
        if self.loop.dead is not None:
            raise APIError(503, f"The engine failed: {self.loop.dead!r}.", type="server_error", code="engine_dead")
        return parse_request(kind, raw, tokenizer=self.tokenizer, model_ids={self.model_id},
                             context_limit=self.context_limit, default_max_tokens=self.cfg.serve.default_max_tokens,
                             default_temperature=self.cfg.engine.temperature, vocab_size=self.vocab_size,
                             record_default=True, max_n=self.loop.max_in_flight)

    def _submit(self, spec: GenSpec) -> list:
        """The request's ``n`` choices (of each prompt of a batch: choice ``i * n + j``) as engine requests (all
        queued or none: 429)."""
        params = [spec.choice_params(j, self.eos_ids) for j in range(spec.n)]
        prompts = spec.all_prompts
        try:
            return self.loop.submit([p for p in prompts for _ in params], params * len(prompts),
                                    spec.record and self.buffer is not None)
        except QueueFull as e:
            raise self._retry(429, f"Too many requests in flight on this replica ({e}); retry later.",
                              "queue_full") from None

    async def _generate(self, kind: str, request: Request) -> Response:
        """The generation route's response: JSON, or SSE with ``"stream": true``.

        Raises:
            APIError: the request's 4xx / 503 (:meth:`_spec`, :meth:`_submit`), 400 / 500 from the engine, or 504
                ``timeout`` when it waited on the engine ``serve.request_timeout_s`` seconds from its submission
                (its engine requests aborted). A stream, once started, ends with the engine's errors and the 504 as
                its last event before ``[DONE]`` instead.
        """
        spec = await self._spec(kind, request)
        writer = ResponseWriter(spec, self._submit(spec), loop=self.loop, tokenizer=self.tokenizer,
                                eos_ids=self.eos_ids, timeout_s=self.cfg.serve.request_timeout_s)
        headers = {VERSION_HEADER: str(self.engine.drafter_version)}
        if spec.ignored:  # unknown request fields, ignored with a logged warning (vLLM's behaviour)
            # a header carries latin-1 only: other characters of a field name as their backslash escapes
            headers[IGNORED_HEADER] = ",".join(spec.ignored).encode("ascii", "backslashreplace").decode("ascii")
        if not spec.stream:
            body = await writer.body()
            versions = body["adaflash"]["drafter_versions"]
            headers[VERSION_HEADER] = str(versions[-1] if versions else self.engine.drafter_version)
            return JSONResponse(body, headers=headers)
        return StreamingResponse(writer.sse(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ routes
    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 ``{"status": "ok", "replica"}``; 503 ``"draining"`` while draining; 503 with the OpenAI error body
        (type ``server_error``) once the engine thread died or stalled (:meth:`EngineLoop.health_error`)."""
        problem = self.loop.health_error()
        if problem is not None:
            return JSONResponse(error_body(problem, "server_error"), status_code=503)
        return JSONResponse({"status": "draining" if self.draining else "ok", "replica": self.replica},
                            status_code=503 if self.draining else 200)

    def check_health(self) -> None:
        """Ray Serve's replica health check (every ``health_check_period_s``, :func:`build_app`): raises once the
        engine thread died, or - with ``serve.engine_stall_timeout_s`` - once its step (or a command between steps)
        has not returned for longer than that with requests in flight, so Serve marks the replica UNHEALTHY after
        3 failed checks in a row and replaces it instead of leaving it answering 503 or holding requests forever.

        Raises:
            RuntimeError: naming the engine thread's exception, or the stall ("engine step has not returned for
                X s with N requests in flight").
        """
        problem = self.loop.health_error()
        if problem is not None:
            raise RuntimeError(problem)

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "adaflash_ray",
                "max_model_len": self.context_limit}

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        """One model's card (OpenAI's retrieve-model route); 404 ``model_not_found`` for any other id."""
        self._auth(request)
        if model_id != self.model_id:
            raise APIError(404, f"The model '{model_id}' does not exist; this endpoint serves ['{self.model_id}'].",
                           type="not_found_error", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate("completion", request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate("chat", request)

    @api.get("/v1/adaflash/status")
    async def status(self, request: Request) -> JSONResponse:
        self._auth(request)
        s, lp = self.engine.stats, self.loop
        distill = {"enabled": False}
        if self.coordinator is not None:
            distill = await self.coordinator.status.remote()
            distill["num_trajectories_sent"] = self.num_trajectories
        return JSONResponse(strict_json({
            "replica": self.replica, "model": self.model_id, "context_limit": self.context_limit,
            "drafter_version": self.engine.drafter_version, "drafter_sha256": self.engine.drafter_sha256,
            "num_reloads": self.engine.num_reloads, "reloads": lp.reloads[-20:], "weight_error": self.weight_error,
            "accept_len": s.accept_len, "per_draft_accept_len": s.per_draft_accept_len,
            "accept_len_convention": "committed tokens per target step = mean(a+1), gamma = 0 steps included; "
                                     "per_draft_accept_len = 1 + sum(a) / #drafts, drafting steps only",
            "num_verify_steps": s.num_verify_steps, "num_engine_steps": s.num_engine_steps,
            "num_generated": s.num_generated,
            "draft_waste": s.draft_waste, "draft_len_hist": {str(k): v for k, v in sorted(lp.gamma_hist.items())},
            "queue": lp.queue_depth(), "in_flight": lp.num_in_flight, "tokens_per_s_10s": lp.tokens_per_s(),
            "requests": dict(lp.counts), "draining": self.draining, "distill": distill, "time": time.time()}))


def default_serve_run_dir(cfg: RunConfig) -> Path:
    """``<logging.run_root>/<name>-serve-<YYYYmmdd-HHMMSS>``: live distillation's run directory by default."""
    return Path(cfg.logging.run_root) / f"{cfg.name}-serve-{time.strftime('%Y%m%d-%H%M%S')}"


def build_app(cfg: RunConfig) -> serve.Application:
    """The bound Serve application for a validated RunConfig (API key from the recipe or $ADAFLASH_API_KEY;
    with ``serve.distill``, ``serve.run_dir`` resolved to an absolute path, :func:`default_serve_run_dir` if unset).

    Raises:
        RecipeError: what Serve cannot run (:func:`adaflash_ray.config.check_serve_config`).
    """
    check_serve_config(cfg)
    c = cfg.model_copy(deep=True)
    c.serve.api_key = c.serve.api_key or os.environ.get("ADAFLASH_API_KEY") or None
    if c.serve.distill:  # fixed here, so a coordinator that Serve restarts resumes from the same directory
        c.serve.run_dir = str(Path(c.serve.run_dir or default_serve_run_dir(c)).resolve())
    d = c.model_dump(mode="json")
    coordinator = DistillCoordinator.bind(d) if c.serve.distill else None
    s = c.serve
    stall = s.engine_stall_timeout_s
    server = AdaFlashServer.options(
        num_replicas=s.num_replicas,
        ray_actor_options={"num_cpus": s.cpus_per_replica, "num_gpus": s.gpus_per_replica},
        # 16 beyond the replica's own limit (batch + queue) answer its 429 at once; the rest wait in Serve's
        # unbounded queue for one of them, so every request past the limit gets the replica's OpenAI 429 +
        # Retry-After (a bounded Serve queue answers a burst with its plain-text 503 "backpressure" instead)
        max_ongoing_requests=c.engine.max_batch_size + s.max_queued_requests + 16,
        max_queued_requests=-1,
        graceful_shutdown_timeout_s=s.drain_timeout_s,
        # check_health only reads counters: one that does not answer within a minute means a replica process stuck
        # as a whole (the GIL held). Checked every 10 s (Serve's default), or twice per serve.engine_stall_timeout_s
        # when that is shorter (at least every 1 s): a hung engine's replica is replaced about the stall timeout
        # + 3 periods after its step began (3 failed checks in a row)
        health_check_period_s=10.0 if stall is None else min(10.0, max(1.0, stall / 2)),
        health_check_timeout_s=60,
    )
    return server.bind(d, coordinator)


def app(args: dict | None = None) -> serve.Application:
    """Serve application builder: ``serve run adaflash_ray.serve:app [recipe=PATH] [set='k=v;k2=v2']``, or
    ``import_path: adaflash_ray.serve:app`` with ``args: {recipe: ..., set: [k=v, ...]}`` in a Serve config.

    Raises:
        RecipeError: a bad recipe or override, naming the field; ValueError for an unknown argument.
    """
    args = dict(args or {})
    unknown = set(args) - {"recipe", "set"}
    if unknown:
        raise ValueError(f"unknown application argument(s) {sorted(unknown)}; expected recipe=PATH, set='k=v;...'")
    sets = args.get("set") or []
    if isinstance(sets, str):
        sets = [s for s in sets.split(";") if s.strip()]
    return build_app(load_recipe(args.get("recipe"), sets))
