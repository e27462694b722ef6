"""SGLangBackend: serve through a real ``sglang.Engine`` with ``speculative_algorithm="DFLASH"`` (sglang 0.5.23).

The only module of the project that imports sglang, lazily, in :meth:`SGLangBackend.start`. SGLang cannot run
on the development machines (its kernels need a CUDA build), so this adapter is proven by contract tests
(``tests/test_sglang_backend.py``): a recording fake engine for call order, and ``ast`` checks of the installed
sglang sources for every keyword, method and request field used here. ``scripts/sglang_smoke.py`` is the GPU
smoke test. Facts, each from the sglang 0.5.23 wheel (paths below ``sglang/srt/``):

- Start: ``Engine(**kwargs)`` builds ``ServerArgs(**kwargs)`` (``entrypoints/engine.py``); the fields live in
  ``arg_groups/fields/*.py`` and an unknown keyword raises ``TypeError``. With ``max_running_requests`` unset,
  DFLASH silently caps it at 48 (``arg_groups/speculative_hook.py::_handle_dflash``): we always pass it.
  DFLASH needs ``pp_size == 1`` (same function) and CUDA/NPU/XPU.
- Draft-only refit: the request structs carry ``selector: "target" | "draft" | "all"`` (default ``"all"``,
  ``managers/io_struct.py``); the public ``Engine.update_weights_from_tensor`` does not pass it and
  ``update_weights_from_disk`` has no selector at all, so we build ``UpdateWeightsFromTensorReqInput`` ourselves
  with ``selector="draft"`` and send it through ``engine.tokenizer_manager``. With "all" the target's loader
  would also receive the drafter's ``layers.N.*`` / ``norm.weight`` and overwrite target layers 0..N-1 and the
  final norm. Updates must run between ``begin_weight_update`` / ``end_weight_update``
  (``managers/scheduler_components/weight_updater.py``), and without a pause they wait for every in-flight
  request (``model_update_lock``, ``managers/tokenizer_control_mixin.py``); so: pause -> begin(draft) ->
  update(draft) -> end -> checksum -> continue (``pause_generation`` / ``continue_generation``,
  ``managers/tokenizer_manager.py``). ``retract`` mode lets the update flush the KV cache, so the draft K/V is
  rebuilt under the new weights; ``in_place`` keeps the old K/V and must not flush (the flush would be refused
  and fail the update, ``flush_cache_after_weight_update``).
- The draft model's ``load_weights`` silently skips names it does not know (``models/dflash.py``), so names
  and shapes are checked here before anything is sent. It ignores ``mask_embedding`` and ``length_head.*``.
- Known upstream fault (not fixable from outside): on CUDA, ``DFlashWorkerV2`` stacks a startup copy of every
  draft layer's k/v projection and ``k_norm`` weight for its fused context-K/V path
  (``kernels/ops/speculative/fused_kv_materialize.py::FusedKVMaterializeHelper``) and a reload never refreshes
  it: output stays lossless, but the context K/V keeps using version-0 k/v weights, so acceptance after a
  reload can be lower than the version deserves.
- Data out: per request ``meta_info`` has ``spec_verify_ct``, ``spec_num_correct_drafts``,
  ``spec_correct_drafts_histogram`` (index a = verify steps with a correct drafts), ``completion_tokens`` and
  ``weight_versions`` spans (``managers/tokenizer_manager.py``, ``utils/weight_versions.py``). The K target
  features cannot be returned while DFLASH drafts (``enable_return_aux_hidden_states`` turns drafting off,
  ``arg_groups/fields/exec_.py``), so trajectories carry token ids only and trainers recompute features
  (``distill.features: recompute``). DFLASH has no per-request draft length: every verify step drafts
  ``block_size - 1`` tokens, so the recipe's length head policy is ``fixed`` (validated in config.py).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from adaflash_ray.config import RunConfig
from adaflash_ray.engine import SpecStats
from adaflash_ray.models.checkpoint import (CheckpointError, check_tensors_fit, load_drafter_checkpoint,
                                            save_drafter_checkpoint, tensors_sha256)
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.trajectory import Trajectory
from adaflash_ray.versions import is_newer

__all__ = ["SGLANG_VERSION", "DRAFT_SELECTOR", "SGLangBackend", "engine_kwargs", "target_hf_config",
           "startup_drafter_config", "write_startup_checkpoint", "draft_update_tensors", "per_step_arrays",
           "trajectory_from_output"]

#: The sglang release the adapter is written and contract-tested against.
SGLANG_VERSION = "0.5.23"
#: The only selector a drafter update ever uses (never "all": see the module docstring).
DRAFT_SELECTOR = "draft"
TARGET_SELECTOR = "target"
#: Checkpoint names SGLang's DFlash loader ignores (models/dflash.py); stripped before an update.
IGNORED_PREFIXES = ("length_head.", "mask_embedding")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------- pure functions
def engine_kwargs(cfg: RunConfig, model_path: str, draft_path: str) -> dict[str, Any]:
    """The ``sglang.Engine(**kwargs)`` keywords for a recipe (pure; every key is a ServerArgs field, pinned by
    tests/test_sglang_backend.py against ``sglang/srt/arg_groups/fields/*.py``).

    Args:
        cfg: a validated RunConfig with ``engine.backend: sglang``.
        model_path: the target's Hugging Face directory. draft_path: the version-0 DFlash checkpoint directory.
    Returns:
        dict of keywords. ``weight_version`` is the drafter version as a string (the target never changes), so
        ``meta_info["weight_versions"]`` spans name drafter versions.
    """
    s = cfg.engine.sglang
    kw: dict[str, Any] = {
        "model_path": str(model_path),
        "dtype": cfg.model.dtype,
        "device": "cuda",
        "tp_size": s.tp_size,
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": str(draft_path),
        "speculative_num_draft_tokens": cfg.drafter.block_size,
        # unset, DFLASH silently caps running requests at 48 (arg_groups/speculative_hook.py)
        "max_running_requests": cfg.engine.max_batch_size,
        "context_length": cfg.engine.max_seq_len,
        "weight_version": "0",
        "random_seed": cfg.seed,
        "log_level": "error",
    }
    if s.mem_fraction_static is not None:
        kw["mem_fraction_static"] = s.mem_fraction_static
    return kw


def target_hf_config(model_path: str | Path) -> dict:
    """The target's ``config.json`` as a dict; a multimodal ``text_config`` (Qwen3.5) is merged on top.

    Raises:
        ValueError: no readable config.json in ``model_path``.
    """
    f = Path(model_path) / "config.json"
    try:
        d = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model.path {model_path}: cannot read config.json ({e})") from None
    return {**d, **(d.get("text_config") or {})}


def startup_drafter_config(cfg: RunConfig, hf: dict) -> DrafterModelConfig:
    """The drafter architecture for the target ``hf`` config (no target weights needed; MoE and hybrid targets
    such as Qwen3-Coder-30B-A3B and Qwen3.5 work, the built-in engine's TargetConfig does not accept them).

    Raises:
        ValueError: a missing config field, or ``drafter.mask_token_id`` unset or outside the vocabulary.
    """
    try:
        hidden, num_layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
        n_heads = hf["num_attention_heads"]
        inter = cfg.drafter.intermediate_size or hf["intermediate_size"]
    except KeyError as e:
        raise ValueError(f"target config.json is missing field {e.args[0]!r}") from None
    mask = cfg.drafter.mask_token_id
    if mask is None or not 0 <= mask < vocab:
        raise ValueError(f"drafter.mask_token_id {mask} must be an id inside the target vocabulary (0..{vocab - 1}) "
                         "for SGLang's DFLASH")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return DrafterModelConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=cfg.drafter.num_hidden_layers,
        num_attention_heads=n_heads, num_key_value_heads=hf.get("num_key_value_heads", n_heads),
        head_dim=hf.get("head_dim") or hidden // n_heads, vocab_size=vocab, block_size=cfg.drafter.block_size,
        target_layer_ids=cfg.drafter.resolve_target_layer_ids(num_layers), target_hidden_size=hidden,
        num_target_layers=num_layers, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), mask_token_id=mask)


def write_startup_checkpoint(cfg: RunConfig, hf: dict, out_dir: str | Path
                             ) -> tuple[Path, DrafterModelConfig, dict[str, torch.Tensor], str]:
    """Write version 0 as a DFlash checkpoint for ``speculative_draft_model_path``.

    ``drafter.init_path`` if set (checked against the recipe), else a seeded random init (the pipeline pushes
    the trainer's version 0 right after start, so all sides then serve the same weights).
    Returns ``(dir, config, tensors, sha256)``. Raises CheckpointError / ValueError naming the mismatch.
    """
    dcfg = startup_drafter_config(cfg, hf)
    if cfg.drafter.init_path:
        loaded, tensors, _ = load_drafter_checkpoint(cfg.drafter.init_path)
        if (loaded.block_size, loaded.mask_token_id, loaded.hidden_size, loaded.vocab_size) != \
                (dcfg.block_size, dcfg.mask_token_id, dcfg.hidden_size, dcfg.vocab_size):
            raise CheckpointError(f"drafter.init_path {cfg.drafter.init_path}: block_size/mask_token_id/hidden_size/"
                                  f"vocab_size {(loaded.block_size, loaded.mask_token_id, loaded.hidden_size, loaded.vocab_size)}"
                                  f" != the recipe's {(dcfg.block_size, dcfg.mask_token_id, dcfg.hidden_size, dcfg.vocab_size)}")
        dcfg = loaded
    else:
        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter(dcfg)
        drafter.init_weights(cfg.seed)
        tensors = {k: v.detach().to(_DTYPES[cfg.model.dtype]) for k, v in drafter.drafter_state_dict().items()}
    path = Path(out_dir) / "v0"
    sha = save_drafter_checkpoint(path, dcfg, tensors, {"version": 0})
    return path, dcfg, tensors, sha


def draft_update_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], version: int,
                         dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list to send for a draft-only update, checked first (SGLang skips unknown names).

    ``length_head.*`` and ``mask_embedding`` are dropped (SGLang's DFlash loader ignores them); the rest must
    have exactly the names and shapes of ``expected`` (the version-0 tensors) and be finite.
    Raises:
        CheckpointError: missing / unexpected names, a shape mismatch, or NaN/inf - nothing was sent.
    """
    kept = {k: v for k, v in tensors.items() if not k.startswith(IGNORED_PREFIXES)}
    check_tensors_fit(expected, kept, f"drafter version {version}")
    return [(k, kept[k].detach().to("cpu", dtype).contiguous()) for k in sorted(kept)]


def per_step_arrays(meta: dict, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per-verify-step ``(draft_lens, num_accepted, step_versions, first_version)`` from one ``meta_info``.

    γ is always ``block_size - 1`` (DFLASH). SGLang reports accepted counts as a histogram, so
    ``num_accepted`` lists them in ascending order, not in step order; ``step_versions`` splits the steps over
    the ``weight_versions`` spans in proportion to their token counts (an estimate: SGLang reports spans in
    tokens, not steps). Without spec fields (no verify step) the arrays are empty.
    """
    ct = int(meta.get("spec_verify_ct") or 0)
    spans = meta.get("weight_versions") or [{"version": meta.get("weight_version", "0"), "start": 0, "end": 1}]
    first = int(spans[0]["version"])
    if ct == 0:
        return np.zeros(0, np.int16), np.zeros(0, np.int16), np.zeros(0, np.int32), first
    hist = list(meta.get("spec_correct_drafts_histogram") or [])
    if sum(hist) == ct:
        acc = np.repeat(np.arange(len(hist)), hist)
    else:  # no histogram: spread the total evenly
        total = int(meta.get("spec_num_correct_drafts") or 0)
        acc = np.full(ct, total // ct) + (np.arange(ct) < total % ct)
    acc = np.minimum(acc, block_size - 1)
    lens = np.array([max(int(s["end"]) - int(s["start"]), 0) for s in spans], np.float64)
    cuts = np.round(np.cumsum(lens) / max(lens.sum(), 1.0) * ct).astype(int)
    versions = np.zeros(ct, np.int32)
    start = 0
    for span, end in zip(spans, cuts):
        versions[start:end] = int(span["version"])
        start = max(start, end)
    versions[start:] = int(spans[-1]["version"])
    return np.full(ct, block_size - 1, np.int16), acc.astype(np.int16), versions, first


def _finish_reason(fr: Any) -> str | None:
    """SGLang's ``{"type": "length" | "stop" | "abort", ...}`` as the built-in engine's string."""
    return fr.get("type") if isinstance(fr, dict) else fr


def trajectory_from_output(request_id: str, prompt_ids: list[int], output_ids: list[int], meta: dict,
                           block_size: int) -> Trajectory:
    """The on-policy record of one SGLang request: token ids and per-step stats, no features (recompute path).

    Raises ValueError (Trajectory.validate) for an empty response.
    """
    lens, acc, versions, first = per_step_arrays(meta, block_size)
    traj = Trajectory(request_id=request_id, token_ids=torch.tensor(list(prompt_ids) + list(output_ids),
                                                                    dtype=torch.long),
                      prompt_len=len(prompt_ids), features=None, last_hidden=None, drafter_version=first,
                      draft_lens=lens, num_accepted=acc, step_versions=versions)
    traj.validate()
    return traj


# ---------------------------------------------------------------------------------------------- backend
class SGLangBackend:
    """The ``sglang`` inference backend (protocol: adaflash_ray.backends).

    Args:
        cfg: RunConfig with ``engine.backend: sglang``. workdir: where version 0 is written.
        model_path: the target directory (default: ``model.path``, else the registry name via
            ``adaflash_ray.data.ensure_target``).
        engine_factory / io: for tests, a fake ``sglang.Engine`` class and a stand-in for
            ``sglang.srt.managers.io_struct``; by default both come from the installed sglang.
    One asyncio loop thread runs every SGLang coroutine; public methods block and are thread-safe.
    """

    def __init__(self, cfg: RunConfig, workdir: str | Path, *, model_path: str | None = None,
                 engine_factory: Callable[..., Any] | None = None, io: Any = None):
        self.cfg, self.workdir, self.model_path = cfg, Path(workdir), model_path
        self.block_size = cfg.drafter.block_size
        self.pause_mode = cfg.engine.sglang.pause_mode
        self._factory, self._io, self.engine = engine_factory, io, None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-loop", daemon=True)
        self._update_lock, self._stats_lock = threading.Lock(), threading.Lock()
        self._win, self._total = SpecStats(), SpecStats()
        self._t0 = time.perf_counter()
        self._inflight: dict[str, bool] = {}  # rid -> record
        self.num_trajectories = self.num_reloads = 0
        self.sync_seconds = 0.0

    # ------------------------------------------------------------------ start / stop
    def start(self) -> "SGLangBackend":
        """Write version 0, start the engine, record the target and draft checksums. Returns self.

        Raises ImportError (sglang missing), ValueError / CheckpointError (bad recipe or checkpoint), and
        whatever ``sglang.Engine`` raises (TypeError for an unknown keyword).
        """
        if self._factory is None or self._io is None:
            import sglang  # the project's only sglang import
            from sglang.srt.managers import io_struct
            self._factory, self._io = self._factory or sglang.Engine, self._io or io_struct
        model_path = self.model_path
        if model_path is None:
            from adaflash_ray.data import ensure_target
            model_path = str(ensure_target(self.cfg.model.path or self.cfg.model.name))
        hf = target_hf_config(model_path)
        path, self.drafter_config, tensors, sha = write_startup_checkpoint(self.cfg, hf, self.workdir)
        self._dtype = _DTYPES[self.cfg.model.dtype]
        self._expected = {k: v for k, v in tensors.items() if not k.startswith(IGNORED_PREFIXES)}
        self._named = draft_update_tensors(self._expected, tensors, 0, self._dtype)
        self.engine = self._factory(**engine_kwargs(self.cfg, model_path, str(path)))
        self._thread.start()
        self._target_checksum = self._run(self._checksum(TARGET_SELECTOR))
        self._draft_checksum = self._run(self._checksum(DRAFT_SELECTOR))
        self._checksum_by_sha = {sha: self._draft_checksum}
        self.drafter_version, self.drafter_sha256 = 0, sha
        return self

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ generation
    def _sampling(self, max_new_tokens: int, temperature: float, ignore_eos: bool) -> dict:
        return {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}

    def _result(self, rid: str, prompt_ids: list[int], out: dict, record: bool) -> dict:
        meta = out.get("meta_info", {})
        output_ids = list(out.get("output_ids") or [])
        lens, acc, versions, _ = per_step_arrays(meta, self.block_size)
        traj = None
        if record and output_ids:
            traj = trajectory_from_output(rid, prompt_ids, output_ids, meta, self.block_size)
        ct = int(meta.get("spec_verify_ct") or 0)
        with self._stats_lock:
            for s in (self._win, self._total):
                s.num_verify_steps += ct
                s.num_drafted += ct * (self.block_size - 1)
                s.num_accepted += int(meta.get("spec_num_correct_drafts") or 0)
                s.num_generated += len(output_ids)
                if ct:
                    s.draft_len_hist[self.block_size - 1] += ct
            self.num_trajectories += traj is not None
        return {"request_id": rid, "output_ids": output_ids, "finish_reason": _finish_reason(meta.get("finish_reason")),
                "draft_lens": lens.tolist(), "num_accepted": acc.tolist(), "step_versions": versions.tolist(),
                "trajectory": traj}

    async def _generate_one(self, prompt_ids: list[int], sampling: dict, rid: str) -> dict:
        return await self.engine.async_generate(input_ids=list(prompt_ids), sampling_params=sampling, rid=rid)

    def _launch(self, prompt_ids, sampling, record):
        rid = f"adaflash-{uuid.uuid4().hex}"
        self._inflight[rid] = record
        fut = asyncio.run_coroutine_threadsafe(self._generate_one(prompt_ids, sampling, rid), self._loop)
        fut.add_done_callback(lambda _: self._inflight.pop(rid, None))
        return rid, fut

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                 ignore_eos: bool = False, record: bool = False) -> list[dict]:
        """Generate for token-id prompts (continuous batching inside SGLang); blocks until all finish.

        Each result: ``request_id, output_ids, finish_reason, draft_lens, num_accepted, step_versions`` (the
        worker's format) and ``trajectory`` (a Trajectory when ``record``, else None).
        """
        t0 = time.perf_counter()
        sp = self._sampling(max_new_tokens, temperature, ignore_eos)
        launched = [self._launch(p, dict(sp), record) for p in prompts]
        results = [self._result(rid, p, fut.result(), record) for p, (rid, fut) in zip(prompts, launched)]
        with self._stats_lock:
            self._win.decode_seconds += time.perf_counter() - t0
            self._total.decode_seconds += time.perf_counter() - t0
        return results

    def submit(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
               on_finished: Callable[[dict], None]) -> int:
        """Fire-and-forget recorded generation: ``on_finished(result)`` runs (in the loop thread) per request,
        with ``result["error"]`` set instead of a trajectory if it failed. Returns the number queued."""
        sp = self._sampling(max_new_tokens, temperature, False)
        for p in prompts:
            rid, fut = self._launch(p, dict(sp), True)

            def done(f, rid=rid, p=p):
                try:
                    on_finished(self._result(rid, p, f.result(), True))
                except Exception as e:  # the request failed or was cancelled
                    on_finished({"request_id": rid, "error": repr(e), "trajectory": None})
            fut.add_done_callback(done)
        return len(prompts)

    def generate_stream(self, prompt_ids: list[int], max_new_tokens: int = 64, temperature: float = 0.0,
                        ignore_eos: bool = False) -> Iterator[dict]:
        """Stream one request: ``{"delta_ids": [...]}`` per chunk, then the final result (as :meth:`generate`)
        with ``"done": True``. SGLang's chunks carry cumulative ``output_ids`` (``incremental_streaming_output``
        is off by default); deltas are cut here."""
        import queue

        q: queue.Queue = queue.Queue()
        rid = f"adaflash-{uuid.uuid4().hex}"

        async def pump():
            try:
                gen = await self.engine.async_generate(input_ids=list(prompt_ids), rid=rid, stream=True,
                                                       sampling_params=self._sampling(max_new_tokens, temperature,
                                                                                      ignore_eos))
                async for chunk in gen:
                    q.put(("chunk", {"output_ids": list(chunk.get("output_ids") or []),
                                     "meta_info": dict(chunk.get("meta_info") or {})}))
                q.put(("end", None))
            except BaseException as e:  # surface it in the consumer thread
                q.put(("error", e))

        asyncio.run_coroutine_threadsafe(pump(), self._loop)
        seen, last = 0, {"output_ids": [], "meta_info": {}}
        while True:
            kind, item = q.get()
            if kind == "error":
                raise item
            if kind == "end":
                break
            last = item
            if len(item["output_ids"]) > seen:
                yield {"delta_ids": item["output_ids"][seen:]}
                seen = len(item["output_ids"])
        yield {**self._result(rid, prompt_ids, last, False), "done": True}

    def cancel_recorded(self) -> int:
        """Abort in-flight recorded (on-policy data) requests, e.g. once training has ended. Returns the count."""
        rids = [r for r, rec in list(self._inflight.items()) if rec]
        for rid in rids:
            self._loop.call_soon_threadsafe(lambda rid=rid: self.engine.tokenizer_manager.abort_request(rid=rid))
        return len(rids)

    def queue_depth(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ drafter refit
    async def _checksum(self, selector: str) -> str:
        """``check_weights(action="checksum", selector=...)`` -> the per-engine checksum string."""
        req = self._io.CheckWeightsReqInput(action="checksum", selector=selector)
        success, message, _ranks, checksum = await self.engine.tokenizer_manager.check_weights(req, None)
        if not success or checksum is None:
            raise CheckpointError(f"sglang check_weights(selector={selector!r}) failed: {message}")
        return checksum

    async def _push(self, named: list[tuple[str, torch.Tensor]], version: int) -> tuple[bool, str]:
        """begin(draft) -> update_weights_from_tensor(draft) -> end, with generation already paused."""
        tm, io = self.engine.tokenizer_manager, self._io
        ok, msg = await tm.begin_weight_update(io.BeginWeightUpdateReqInput(selector=DRAFT_SELECTOR), None)
        if not ok:
            return False, f"begin_weight_update: {msg}"
        try:
            req = io.UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=self.engine._serialize_tensors_per_rank(named, None), load_format=None,
                flush_cache=self.pause_mode == "retract", weight_version=str(version), selector=DRAFT_SELECTOR)
            ok, msg = await tm.update_weights_from_tensor(req, None)
        finally:
            end_ok, end_msg = await tm.end_weight_update(io.EndWeightUpdateReqInput(), None)
        if ok and not end_ok:
            return False, f"end_weight_update: {end_msg}"
        return ok, msg

    async def _verify(self, sha: str, previous_sha: str) -> str | None:
        """None if the target is untouched and the draft checksum fits ``sha``, else what is wrong."""
        target = await self._checksum(TARGET_SELECTOR)
        if target != self._target_checksum:
            raise RuntimeError("sglang: the TARGET weights checksum changed during a draft-only update "
                               f"({self._target_checksum[:12]} -> {target[:12]}); restart this worker")
        draft = await self._checksum(DRAFT_SELECTOR)
        known = self._checksum_by_sha.get(sha)
        if known is not None and draft != known:
            return f"draft checksum {draft[:12]} differs from {known[:12]} recorded for these weights"
        if known is None and sha != previous_sha and draft == self._draft_checksum:
            return "draft checksum unchanged: SGLang loaded none of the new tensors"
        self._draft_checksum = draft
        self._checksum_by_sha.setdefault(sha, draft)
        return None

    async def _refit(self, named, version: int, sha: str) -> None:
        tm, io = self.engine.tokenizer_manager, self._io
        await tm.pause_generation(io.PauseGenerationReqInput(mode=self.pause_mode))
        try:
            ok, msg = await self._push(named, version)
            problem = await self._verify(sha, self.drafter_sha256) if ok else f"update refused: {msg}"
            if problem is not None:  # put the old drafter back before anything generates again
                old = self.drafter_version
                ok_back, msg_back = await self._push(self._named, old)
                back = await self._verify(self.drafter_sha256, sha) if ok_back else msg_back
                raise CheckpointError(f"drafter version {version}: {problem}; " + (
                    f"version {old} restored" if back is None else f"restoring version {old} failed too ({back})"))
        finally:
            await tm.continue_generation(io.ContinueGenerationReqInput())

    def load_drafter(self, tensors: dict[str, torch.Tensor], version: int, sha256: str | None = None,
                     config: DrafterModelConfig | dict | None = None, rollback: bool = False) -> str:
        """Swap in drafter ``version``: check -> pause -> draft-only update -> checksum -> continue.

        Same signature and version rule as ``SpecEngine.load_drafter``, so the InferenceWorker drives both alike:
        versions only rise - the first load may repeat the startup version 0, every later one must be greater -
        unless ``rollback=True`` names an older (or the same) version explicitly (the τ canary's roll back, the
        held-out evaluation of every version).
        Returns the sha256 of ``tensors`` as received (checkpoint.tensors_sha256).
        Raises:
            CheckpointError: the version does not rise (without ``rollback``), sha256 mismatch, a different
                architecture, wrong names/shapes/non-finite values (nothing sent), or SGLang refused the update /
                the draft checksum does not fit (the previous version is pushed back). The old drafter stays
                loaded.
            RuntimeError: the target's checksum changed (never expected; the worker must restart).
        """
        current = self.drafter_version
        if not rollback and not is_newer(version, current, current_published=self.num_reloads > 0):
            raise CheckpointError(f"drafter version {version} refused: the engine serves version {current} "
                                  "(versions must rise; pass rollback=True to return to an older one)")
        if isinstance(config, dict):
            config = DrafterModelConfig(**config)
        mine = self.drafter_config
        if config is not None and (config.block_size, list(config.target_layer_ids), config.num_hidden_layers,
                                   config.mask_token_id) != (mine.block_size, list(mine.target_layer_ids),
                                                             mine.num_hidden_layers, mine.mask_token_id):
            raise CheckpointError(f"drafter version {version}: architecture (block_size, target_layer_ids, "
                                  "num_hidden_layers, mask_token_id) differs from the served one; restart the worker")
        digest = tensors_sha256(tensors)
        if sha256 is not None and digest != sha256:
            raise CheckpointError(f"drafter version {version}: sha256 mismatch ({digest[:12]} != {sha256[:12]})")
        named = draft_update_tensors(self._expected, tensors, version, self._dtype)
        with self._update_lock:
            t0 = time.perf_counter()
            self._run(self._refit(named, version, digest))
            self.drafter_version, self.drafter_sha256, self._named = version, digest, named
            self.num_reloads += 1
            self.sync_seconds += time.perf_counter() - t0
        return digest

    # ------------------------------------------------------------------ state
    def loaded_version(self) -> dict:
        return {"version": self.drafter_version, "sha256": self.drafter_sha256}

    def has_unfinished(self) -> bool:
        """Always False: SGLang schedules its own requests (the worker's step loop then only applies swaps)."""
        return False

    def drafter_tensors(self) -> dict[str, torch.Tensor]:
        """CPU copies of the served drafter tensors (checkpoint names, no length head)."""
        return {k: v.clone() for k, v in self._named}

    def draft_len_histogram(self) -> dict[int, int]:
        return dict(self._total.draft_len_hist)

    def stats(self) -> dict[str, float]:
        """The built-in worker's ``spec/*`` keys (window since the last call + totals) and SpecStats'."""
        now = time.perf_counter()
        with self._stats_lock:
            w, t = self._win, self._total
            out = w.as_metrics("spec")
            out.update({"spec/tokens_per_s": w.num_generated / max(now - self._t0, 1e-9),
                        "spec/drafter_version": float(self.drafter_version),
                        "spec/num_reloads": float(self.num_reloads),
                        "spec/num_trajectories": float(self.num_trajectories),
                        "spec/queue_depth": float(self.queue_depth()),
                        "spec/total_accept_len": t.accept_len,
                        "spec/engine_dead": 0.0,
                        "sync/seconds": self.sync_seconds})
            self._win, self._t0 = SpecStats(), now
        return out
