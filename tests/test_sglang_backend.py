"""Contract tests of the SGLang backend (adaflash_ray/backends/sglang.py; issue 10 part 3).

(a) a recording fake ``sglang.Engine``: call order, selector never "all", pause/continue around every update,
    versions, a checksum failure keeps the old drafter (always run, no sglang needed);
(b) ``ast`` reads of the installed sglang sources: every keyword, method and request field the adapter uses
    exists with the expected defaults (skipped, with the reason, when sglang is not installed:
    ``pip install --no-deps sglang==0.5.23``, as cluster/setup.sh does);
(c) our DFlash checkpoint names against SGLang's DFlash draft model parameters.
Run: ``pytest tests/test_sglang_backend.py -q``.
"""
from __future__ import annotations

import math

import ast
import asyncio
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adaflash_ray.backends import InferenceBackend
from adaflash_ray.backends.sglang import (DRAFT_SELECTOR, SGLANG_VERSION, SGLangBackend, engine_kwargs,
                                          per_step_arrays)
from adaflash_ray.config import RecipeError, RunConfig, load_recipe
from adaflash_ray.engine.engine import SpecStats
from adaflash_ray.models.checkpoint import CheckpointError, load_drafter_checkpoint, tensors_sha256
from adaflash_ray.models.drafter import DFlashDrafter

ROOT = Path(__file__).resolve().parents[1]
BS = 4  # block_size of the test recipe

# ------------------------------------------------------------------------------------------ the fake


class _Req:
    """Stand-in for an sglang io_struct request: its class name and keyword fields."""

    def __init__(self, kind, **kw):
        self.kind, self.kw = kind, kw

    def __getattr__(self, k):
        return self.kw[k]


FAKE_IO = SimpleNamespace(**{name: (lambda name: lambda **kw: _Req(name, **kw))(name) for name in (
    "PauseGenerationReqInput", "ContinueGenerationReqInput", "BeginWeightUpdateReqInput", "EndWeightUpdateReqInput",
    "UpdateWeightsFromTensorReqInput", "CheckWeightsReqInput")})


def _digest(state: dict) -> str:
    return hashlib.sha256(b"".join(k.encode() + v.float().numpy().tobytes() for k, v in sorted(state.items()))
                          ).hexdigest()


class FakeTokenizerManager:
    """Records every call; applies updates like SGLang does (unknown names skipped; "all" also hits the target)."""

    def __init__(self, eng):
        self.eng, self.calls = eng, []
        self.refuse_update = False
        self.drop_next_update = False  # answer success but load nothing (what a silently skipped name does)
        self.corrupt_next_draft_checksum = False

    async def pause_generation(self, obj):
        self.calls.append(("pause", obj.kw))

    async def continue_generation(self, obj):
        self.calls.append(("continue", obj.kw))

    async def begin_weight_update(self, obj, request=None):
        self.calls.append(("begin", obj.kw))
        return True, "Success"

    async def end_weight_update(self, obj, request=None):
        self.calls.append(("end", obj.kw))
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request=None):
        self.calls.append(("update", {k: v for k, v in obj.kw.items() if k != "serialized_named_tensors"}
                           | {"names": [n for n, _ in obj.kw["serialized_named_tensors"]]}))
        if self.refuse_update:
            return False, "refused by the fake"
        if self.drop_next_update:
            self.drop_next_update = False
            return True, "Success"
        for name, t in obj.kw["serialized_named_tensors"]:
            if name in self.eng.draft:
                self.eng.draft[name] = t.clone()
            if obj.kw["selector"] == "all" and name in self.eng.target:
                self.eng.target[name] = t.clone()
        return True, "Success"

    async def check_weights(self, obj, request=None):
        self.calls.append(("check", obj.kw))
        sel = obj.kw["selector"]
        value = _digest(self.eng.target if sel == "target" else self.eng.draft)
        if sel == "draft" and self.corrupt_next_draft_checksum:
            self.corrupt_next_draft_checksum, value = False, "0" * 64
        return True, "Success.", [], value

    def abort_request(self, rid="", abort_all=False):
        self.calls.append(("abort", {"rid": rid}))


class FakeEngine:
    """A recording ``sglang.Engine``: the version-0 draft comes from speculative_draft_model_path."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        _, tensors, _ = load_drafter_checkpoint(kwargs["speculative_draft_model_path"])
        self.draft = {k: v.clone() for k, v in tensors.items()}
        # a Qwen3 target shares names with the drafter's layers.0.* and norm.weight (why "all" is dangerous)
        self.target = {"layers.0.self_attn.q_proj.weight": torch.ones(8, 8), "norm.weight": torch.ones(8)}
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.outputs: list[dict] = []
        FakeEngine.instances.append(self)

    def _serialize_tensors_per_rank(self, tensors, load_format):
        return list(tensors)

    async def async_generate(self, input_ids=None, sampling_params=None, rid=None, stream=False):
        self.tokenizer_manager.calls.append(("generate", {"rid": rid, "sampling_params": sampling_params}))
        out = self.outputs.pop(0)
        if not stream:
            return out

        async def chunks():
            for n in range(1, len(out["output_ids"]) + 1):
                yield {"output_ids": out["output_ids"][:n], "meta_info": out["meta_info"]}
        return chunks()

    def shutdown(self):
        pass


def _write_target(tmp_path: Path) -> Path:
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6}))
    return d


def _cfg(**engine_sglang) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"device": "cuda", "dtype": "float32"},
        "drafter": {"num_hidden_layers": 2, "block_size": BS, "num_target_layers": 2, "mask_token_id": 999},
        "length_head": {"policy": "fixed"},
        "engine": {"backend": "sglang", "max_batch_size": 6, "sglang": engine_sglang},
        "distill": {"features": "recompute"},
        "placement": {"gpus_per_inference_worker": 1, "gpus_per_trainer": 1}})


@pytest.fixture
def backend(tmp_path):
    b = SGLangBackend(_cfg(), tmp_path / "work", model_path=str(_write_target(tmp_path)),
                      engine_factory=FakeEngine, io=FAKE_IO).start()
    yield b
    b.shutdown()


def _calls(b):
    return b.engine.tokenizer_manager.calls


def _perturbed(b, scale=0.5):
    return {k: v + scale for k, v in b.drafter_tensors().items()}


def _kinds(b):
    return [c[0] for c in _calls(b)]


# ------------------------------------------------------------------------------------ (a) fake engine


def test_engine_kwargs_pure_and_complete(tmp_path):
    cfg = _cfg(mem_fraction_static=0.7, tp_size=1)
    kw = engine_kwargs(cfg, "/m", "/d")
    assert kw == engine_kwargs(cfg, "/m", "/d")
    assert kw["speculative_algorithm"] == "DFLASH" and kw["speculative_draft_model_path"] == "/d"
    assert kw["speculative_num_draft_tokens"] == BS
    assert kw["max_running_requests"] == 6  # always passed: unset, DFLASH caps it at 48
    assert kw["weight_version"] == "0" and kw["mem_fraction_static"] == 0.7 and kw["tp_size"] == 1
    assert "mem_fraction_static" not in engine_kwargs(_cfg(), "/m", "/d")


def test_start_writes_version0_checkpoint_and_records_checksums(backend):
    eng = backend.engine
    cfg, tensors, meta = load_drafter_checkpoint(eng.kwargs["speculative_draft_model_path"])
    assert cfg.mask_token_id == 999 and cfg.block_size == BS and meta["version"] == "0"
    assert cfg.target_layer_ids == [1, 3] and cfg.num_target_layers == 6 and "mask_embedding" not in tensors
    assert backend.loaded_version() == {"version": 0, "sha256": tensors_sha256(tensors)}
    assert _calls(backend) == [("check", {"action": "checksum", "selector": "target"}),
                               ("check", {"action": "checksum", "selector": "draft"})]
    assert isinstance(backend, InferenceBackend)


def test_load_drafter_call_order_and_version(backend):
    new = _perturbed(backend)
    n0 = len(_calls(backend))
    sha = backend.load_drafter(new, 1, tensors_sha256(new))
    calls = _calls(backend)[n0:]
    assert [c[0] for c in calls] == ["pause", "begin", "update", "end", "check", "check", "continue"]
    assert calls[0][1] == {"mode": "retract"}
    assert calls[1][1] == {"selector": "draft"}
    upd = calls[2][1]
    assert upd["selector"] == "draft" and upd["weight_version"] == "1" and upd["flush_cache"] is True
    assert upd["load_format"] is None and upd["names"] == sorted(new)
    assert [c[1]["selector"] for c in calls[4:6]] == ["target", "draft"]
    assert backend.loaded_version() == {"version": 1, "sha256": sha} and backend.num_reloads == 1
    assert all(torch.equal(backend.engine.draft[k], new[k]) for k in new)


def test_versions_rise_unless_rollback(backend):
    """SpecEngine.load_drafter's rule: the first load may repeat version 0, later ones must rise; an older (or
    the same) version only with ``rollback=True`` - refused before anything is sent, the old drafter kept."""
    v0 = backend.drafter_tensors()
    backend.load_drafter(v0, 0)  # the driver's initial version-0 load on a fresh start
    v2 = _perturbed(backend, 0.1)
    sha2 = backend.load_drafter(v2, 2)
    for version in (1, 2):
        n0 = len(_calls(backend))
        with pytest.raises(CheckpointError, match=f"version {version} refused: the engine serves version 2"):
            backend.load_drafter(_perturbed(backend, 0.2), version)
        assert _calls(backend)[n0:] == [] and backend.loaded_version() == {"version": 2, "sha256": sha2}
    sha0 = backend.load_drafter(v0, 0, rollback=True)
    assert backend.loaded_version() == {"version": 0, "sha256": sha0} and backend.num_reloads == 3
    backend.load_drafter(v2, 1, sha2)  # rising again from there, as the held-out evaluation of every version does
    assert backend.loaded_version() == {"version": 1, "sha256": sha2}


def test_in_place_pause_never_flushes(tmp_path):
    b = SGLangBackend(_cfg(pause_mode="in_place"), tmp_path / "w", model_path=str(_write_target(tmp_path)),
                      engine_factory=FakeEngine, io=FAKE_IO).start()
    b.load_drafter(_perturbed(b), 1)
    kinds = {c[0]: c[1] for c in _calls(b)}
    assert kinds["pause"] == {"mode": "in_place"} and kinds["update"]["flush_cache"] is False
    b.shutdown()


def test_selector_never_all_and_target_untouched(backend):
    target0 = {k: v.clone() for k, v in backend.engine.target.items()}
    backend.load_drafter(_perturbed(backend, 0.1), 1)
    backend.engine.tokenizer_manager.drop_next_update = True
    with pytest.raises(CheckpointError):
        backend.load_drafter(_perturbed(backend, 0.2), 2)
    backend.load_drafter(_perturbed(backend, 0.3), 3)
    selectors = [c[1]["selector"] for c in _calls(backend) if "selector" in c[1]]
    assert "all" not in selectors and set(selectors) == {"draft", "target"}
    assert all(c[1]["selector"] == DRAFT_SELECTOR for c in _calls(backend) if c[0] in ("begin", "update"))
    assert all(torch.equal(backend.engine.target[k], v) for k, v in target0.items())


def test_pause_and_continue_around_every_update(backend):
    backend.load_drafter(_perturbed(backend, 0.1), 1)
    backend.engine.tokenizer_manager.refuse_update = True
    with pytest.raises(CheckpointError):
        backend.load_drafter(_perturbed(backend, 0.2), 2)
    paused = False
    for kind, _ in _calls(backend):
        if kind == "pause":
            assert not paused
            paused = True
        elif kind == "continue":
            assert paused
            paused = False
        elif kind in ("begin", "update", "end"):
            assert paused, f"{kind} outside pause/continue"
    assert not paused and _kinds(backend).count("pause") == _kinds(backend).count("continue") == 2


def test_checksum_failure_keeps_old_drafter(backend):
    v1 = _perturbed(backend, 0.1)
    sha1 = backend.load_drafter(v1, 1)
    backend.engine.tokenizer_manager.drop_next_update = True  # the draft checksum does not move
    n0 = len(_calls(backend))
    with pytest.raises(CheckpointError, match="version 2: draft checksum unchanged.*version 1 restored"):
        backend.load_drafter(_perturbed(backend, 0.2), 2)
    calls = _calls(backend)[n0:]
    updates = [c[1] for c in calls if c[0] == "update"]
    assert [u["weight_version"] for u in updates] == ["2", "1"]  # the new one, then the old one back
    assert calls[-1][0] == "continue"
    assert backend.loaded_version() == {"version": 1, "sha256": sha1}
    assert all(torch.equal(backend.engine.draft[k], v1[k]) for k in v1)


def test_known_weights_with_a_different_checksum_are_refused(backend):
    v0 = backend.drafter_tensors()
    backend.load_drafter(_perturbed(backend, 0.1), 1)
    backend.engine.tokenizer_manager.corrupt_next_draft_checksum = True
    with pytest.raises(CheckpointError, match="differs from .* recorded for these weights"):
        backend.load_drafter(v0, 2)  # version 0's weights again: their checksum was recorded at start
    assert backend.loaded_version()["version"] == 1


def test_refused_update_restores_old_drafter(backend):
    backend.engine.tokenizer_manager.refuse_update = True
    with pytest.raises(CheckpointError, match="update refused"):
        backend.load_drafter(_perturbed(backend), 1)
    assert backend.loaded_version()["version"] == 0 and backend.num_reloads == 0


@pytest.mark.parametrize("bad", ["unknown", "missing", "shape", "nan", "sha", "arch"])
def test_bad_drafter_refused_before_anything_is_sent(backend, bad):
    t = _perturbed(backend)
    sha, config = None, None
    if bad == "unknown":
        t["layers.0.self_attn.qproj.weight"] = t.pop("layers.0.self_attn.q_proj.weight")  # SGLang would skip it
    elif bad == "missing":
        t.pop("norm.weight")
    elif bad == "shape":
        t["norm.weight"] = torch.ones(3)
    elif bad == "nan":
        t["norm.weight"][0] = float("nan")
    elif bad == "sha":
        sha = "0" * 64
    else:
        config = {**backend.drafter_config.as_dict(), "block_size": 8}
    n0 = len(_calls(backend))
    with pytest.raises(CheckpointError, match="version 5"):
        backend.load_drafter(t, 5, sha, config)
    assert _calls(backend)[n0:] == [] and backend.loaded_version()["version"] == 0


def test_length_head_and_mask_embedding_are_not_sent(backend):
    t = _perturbed(backend)
    t["length_head.proj.weight"] = torch.ones(2, 2)
    t["mask_embedding"] = torch.ones(64)
    backend.load_drafter(t, 1, tensors_sha256(t))
    upd = [c[1] for c in _calls(backend) if c[0] == "update"][-1]
    assert not any(n.startswith(("length_head.", "mask_embedding")) for n in upd["names"])
    assert backend.loaded_version()["sha256"] == tensors_sha256(t)  # the registry's checksum of what it sent


def test_target_checksum_change_is_fatal(backend):
    backend.engine.target["norm.weight"] += 1  # as if an update with selector "all" had run
    with pytest.raises(RuntimeError, match="TARGET"):
        backend.load_drafter(_perturbed(backend), 1)


def _meta(ct=3, hist=(1, 1, 1), spans=(("0", 0, 4), ("1", 4, 8)), n=8):
    return {"finish_reason": {"type": "length", "length": n}, "completion_tokens": n, "spec_verify_ct": ct,
            "spec_num_correct_drafts": sum(i * h for i, h in enumerate(hist)),
            "spec_correct_drafts_histogram": list(hist),
            "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in spans]}


def test_generate_results_trajectories_and_stats(backend):
    backend.engine.outputs = [{"output_ids": list(range(10, 18)), "meta_info": _meta()},
                              {"output_ids": [5, 6], "meta_info": _meta(ct=1, hist=(0, 0, 0, 1),
                                                                          spans=(("1", 0, 2),), n=2)}]
    res = backend.generate([[1, 2, 3], [4]], max_new_tokens=8, temperature=0.0, record=True)
    sp = [c[1]["sampling_params"] for c in _calls(backend) if c[0] == "generate"]
    assert sp[0] == {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": False}
    r = res[0]
    assert r["output_ids"] == list(range(10, 18)) and r["finish_reason"] == "length"
    assert r["draft_lens"] == [BS - 1] * 3 and r["num_accepted"] == [0, 1, 2]
    tr = r["trajectory"]
    assert tr.features is None and tr.last_hidden is None and tr.prompt_len == 3
    assert tr.token_ids.tolist() == [1, 2, 3] + list(range(10, 18)) and tr.drafter_version == 0
    assert res[1]["trajectory"].drafter_version == 1 and res[1]["num_accepted"] == [3]
    worker_keys = set(r) - {"trajectory"}
    assert worker_keys == {"request_id", "output_ids", "finish_reason", "draft_lens", "num_accepted",
                           "step_versions"}
    s = backend.stats()
    assert s["spec/accept_len"] == pytest.approx((3 + 3 + 4) / 4)  # Σ(a+1) / steps
    assert s["spec/mean_draft_len"] == BS - 1 and s["spec/num_trajectories"] == 2
    assert math.isnan(backend.stats()["spec/accept_len"])  # a new window: no verify step yet (SpecStats: NaN)
    assert backend.draft_len_histogram() == {BS - 1: 4}


def _worker_stat_keys() -> set[str]:
    """The ``spec/*`` keys the built-in worker's stats() returns (parsed, no Ray import)."""
    tree = ast.parse((ROOT / "actors" / "inference_worker.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "stats")
    return {c.value for c in ast.walk(fn) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            and c.value.startswith("spec/") and c.value != "spec/error"}


def test_stats_have_the_builtin_engines_keys(backend):
    keys = set(backend.stats())
    worker_only = {"spec/num_refused_versions", "spec/num_rollbacks",  # added by the worker for both backends
                   "spec/num_rejected_requests"}
    assert (_worker_stat_keys() - worker_only) <= keys
    assert set(SpecStats().as_metrics("spec")) <= keys


def test_stream_yields_deltas_then_the_result(backend):
    backend.engine.outputs = [{"output_ids": [7, 8, 9], "meta_info": _meta(ct=1, hist=(0, 0, 1), n=3)}]
    events = list(backend.generate_stream([1, 2], max_new_tokens=3))
    assert [e["delta_ids"] for e in events[:-1]] == [[7], [8], [9]]
    assert events[-1]["done"] and events[-1]["output_ids"] == [7, 8, 9]


def test_submit_calls_back_with_trajectories(backend):
    backend.engine.outputs = [{"output_ids": [7, 8], "meta_info": _meta(ct=1, hist=(0, 1), n=2)}]
    got = []
    done = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), backend._loop)
    backend.submit([[1, 2]], 2, 0.0, got.append)
    done.result()
    for _ in range(200):
        if got:
            break
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.005), backend._loop).result()
    assert got and got[0]["trajectory"].token_ids.tolist() == [1, 2, 7, 8]


def test_per_step_arrays_without_histogram_and_spans():
    lens, acc, versions, first = per_step_arrays({"spec_verify_ct": 4, "spec_num_correct_drafts": 6,
                                                  "weight_version": "3"}, BS)
    assert lens.tolist() == [3] * 4 and acc.sum() == 6 and versions.tolist() == [3] * 4 and first == 3
    _, _, versions, first = per_step_arrays(_meta(ct=4, hist=(1, 1, 1, 1)), BS)
    assert first == 0 and versions.tolist() == [0, 0, 1, 1]
    assert per_step_arrays({}, BS)[0].size == 0


# ------------------------------------------------------------------------------ recipe validation (part 2)

CODER = "recipes/qwen3_coder_30b_a3b.yaml"


@pytest.mark.parametrize("override, field", [
    ("drafter.mask_token_id=null", "drafter.mask_token_id"),
    ("engine.sglang.pp_size=2", "engine.sglang.pp_size"),
    ("engine.sglang.dp_size=2", "engine.sglang.dp_size"),
    ("engine.sglang.tp_size=2", "engine.sglang.tp_size"),
    ("length_head.policy=direct", "length_head.policy"),
    ("distill.features=captured", "distill.features"),
])
def test_sglang_recipe_refuses_what_sglang_cannot_honour(override, field):
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        load_recipe(CODER, [override])


def test_sglang_recipe_refuses_cpu():
    with pytest.raises(RecipeError, match=r"model\.device"):
        load_recipe(CODER, ["model.device=cpu", "placement.gpus_per_inference_worker=0",
                            "placement.gpus_per_trainer=0"])


def test_smollm2_cannot_use_sglang():
    with pytest.raises(RecipeError, match=r"drafter\.mask_token_id"):
        load_recipe("recipes/smollm2_135m_gpu.yaml", ["engine.backend=sglang", "distill.features=recompute",
                                                       "length_head.policy=fixed"])


def test_recipes_state_their_backend():
    assert load_recipe("recipes/qwen3_8b.yaml").engine.backend == "torch"
    for r in (CODER, "recipes/qwen35_9b.yaml"):
        cfg = load_recipe(r)
        assert cfg.engine.backend == "sglang" and cfg.length_head.policy == "fixed"
        assert "Backend: sglang" in (ROOT / r).read_text()
    assert "Backend: torch" in (ROOT / "recipes/qwen3_8b.yaml").read_text()


# --------------------------------------------------------------------------- (b) installed sglang sources

_SPEC = importlib.util.find_spec("sglang")
needs_sglang = pytest.mark.skipif(
    _SPEC is None, reason="sglang not installed; CI runs `pip install --no-deps sglang==0.5.23` (cluster/setup.sh)")


def _src(rel: str) -> ast.Module:
    root = Path(_SPEC.submodule_search_locations[0])
    return ast.parse((root / rel).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} not found"
    return found[0]


def _method(cls: ast.ClassDef, name: str):
    found = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    assert found, f"{cls.name}.{name} not found"
    return found[0]


def _fields(cls: ast.ClassDef) -> dict[str, object]:
    """Annotated class fields -> default (ast.literal_eval'd where literal, ... if none)."""
    out = {}
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            try:
                out[n.target.id] = ast.literal_eval(n.value) if n.value is not None else ...
            except ValueError:
                out[n.target.id] = ast.unparse(n.value)
    return out


def _params(fn) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _server_args_fields() -> dict[str, object]:
    """ServerArgs = the fields of the namespaces listed in srt/server_args.py::_INPUT_NAMESPACES."""
    sa = _src("srt/server_args.py")
    ns = next(n for n in sa.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_INPUT_NAMESPACES")
    names = {e.id for e in ns.value.elts}
    fields: dict[str, object] = {}
    for f in (Path(_SPEC.submodule_search_locations[0]) / "srt/arg_groups/fields").glob("*.py"):
        tree = ast.parse(f.read_text())
        for c in tree.body:
            if isinstance(c, ast.ClassDef) and c.name in names:
                fields.update(_fields(c))
    return fields


@needs_sglang
def test_installed_sglang_is_the_pinned_release():
    assert importlib.metadata.version("sglang") == SGLANG_VERSION, (
        f"the adapter is verified against sglang {SGLANG_VERSION}; re-read the sources it cites before upgrading")


@needs_sglang
def test_engine_kwargs_are_server_args_fields_with_expected_defaults():
    fields = _server_args_fields()
    kw = engine_kwargs(load_recipe(CODER), "/m", "/d")
    unknown = sorted(set(kw) - set(fields))
    assert not unknown, f"ServerArgs has no field(s) {unknown}: sglang.Engine would raise TypeError"
    assert fields["max_running_requests"] is None  # unset -> DFLASH resets it to 48, so we always pass it
    assert fields["pp_size"] == 1 and fields["dp_size"] == 1  # the values config.py insists on
    assert fields["weight_version"] == "default"
    assert "mem_fraction_static" in fields and "speculative_dflash_block_size" in fields
    hook = _src("srt/arg_groups/speculative_hook.py")
    dflash = next(n for n in hook.body if isinstance(n, ast.FunctionDef) and n.name == "_handle_dflash")
    text = ast.unparse(dflash)
    assert "max_running_requests=48" in text and "pp_size != 1" in text
    model_ns = _class(_src("srt/arg_groups/fields/model.py"), "Model")
    dtype = next(n for n in model_ns.body if isinstance(n, ast.AnnAssign) and n.target.id == "dtype")
    choices = next(ast.literal_eval(k.value) for k in ast.walk(dtype) if isinstance(k, ast.keyword)
                   and k.arg == "choices")
    assert {"float32", "bfloat16", "float16"} <= set(choices)


@needs_sglang
def test_engine_methods_the_adapter_calls():
    eng = _class(_src("srt/entrypoints/engine.py"), "Engine")
    ag = _method(eng, "async_generate")
    assert isinstance(ag, ast.AsyncFunctionDef) and {"input_ids", "sampling_params", "rid", "stream"} <= set(_params(ag))
    assert _params(_method(eng, "_serialize_tensors_per_rank")) == ["self", "tensors", "load_format"]
    assert _params(_method(eng, "shutdown")) == ["self"]
    # why we bypass the public refit methods: they never pass a selector, so SGLang uses "all"
    for name in ("update_weights_from_tensor", "update_weights_from_disk"):
        fn = _method(eng, name)
        assert "selector" not in _params(fn) and "selector" not in ast.unparse(fn), name


@needs_sglang
def test_tokenizer_manager_coroutines_the_adapter_awaits():
    tm = _class(_src("srt/managers/tokenizer_manager.py"), "TokenizerManager")
    for name in ("pause_generation", "continue_generation"):
        fn = _method(tm, name)
        assert isinstance(fn, ast.AsyncFunctionDef) and _params(fn) == ["self", "obj"], name
    assert _params(_method(tm, "abort_request"))[:3] == ["self", "rid", "abort_all"]
    mixin = _class(_src("srt/managers/tokenizer_control_mixin.py"), "TokenizerControlMixin")
    for name in ("begin_weight_update", "end_weight_update", "update_weights_from_tensor", "check_weights"):
        fn = _method(mixin, name)
        assert isinstance(fn, ast.AsyncFunctionDef) and _params(fn) == ["self", "obj", "request"], name
    ret = ast.unparse(_method(mixin, "check_weights").returns)
    assert ret.startswith("Tuple[bool, str,") and ret.count(",") == 3, ret  # (success, message, ranks, checksum)
    assert "(success, message)" in ast.unparse(_method(mixin, "update_weights_from_tensor")).replace(
        "return success, message", "(success, message)")


@needs_sglang
def test_request_fields_and_defaults():
    io = _src("srt/managers/io_struct.py")
    pause = _fields(_class(io, "PauseGenerationReqInput"))
    assert pause["mode"] == "abort"  # the default aborts requests: we always pass retract / in_place
    assert {"retract", "in_place"} <= set(ast.unparse(
        next(n for n in _class(io, "PauseGenerationReqInput").body if isinstance(n, ast.AnnAssign)).annotation
    ).replace("'", '"').split('"'))
    assert "torch_empty_cache" in _fields(_class(io, "ContinueGenerationReqInput"))
    assert _fields(_class(io, "BeginWeightUpdateReqInput")) == {"selector": "all"}
    assert _fields(_class(io, "EndWeightUpdateReqInput")) == {}
    upd = _fields(_class(io, "UpdateWeightsFromTensorReqInput"))
    assert upd["selector"] == "all" and upd["flush_cache"] is True and upd["load_format"] is None
    assert upd["weight_version"] is None and "serialized_named_tensors" in upd
    chk = _fields(_class(io, "CheckWeightsReqInput"))
    assert chk["action"] == "checksum" and chk["selector"] == "all"
    assert "selector" not in _fields(_class(io, "UpdateWeightFromDiskReqInput"))  # no draft-only disk refit
    gen = _fields(_class(io, "GenerateReqInput"))
    assert {"input_ids", "sampling_params", "rid", "stream"} <= set(gen) and gen["stream"] is False
    sp = _fields(_class(_src("srt/sampling/sampling_params.py"), "SamplingParams"))
    assert sp["max_new_tokens"] == 128 and sp["temperature"] == 1.0 and sp["ignore_eos"] is False


@needs_sglang
def test_draft_selector_never_reaches_the_target():
    wu = _src("srt/managers/scheduler_components/weight_updater.py")
    parse = next(n for n in wu.body if isinstance(n, ast.FunctionDef) and n.name == "_parse_runner_selector")
    text = ast.unparse(parse)
    assert "if selector in ('target', 'draft'):\n        return {selector}" in text
    mgr = _class(wu, "SchedulerWeightUpdaterManager")
    sel = ast.unparse(_method(mgr, "_select_runners"))
    assert "if 'target' in roles:\n        runners += self.tp_worker.weight_update_runners()" in sel
    upd = ast.unparse(_method(mgr, "update_weights_from_tensor"))
    assert "self._select_runners(recv_req.selector)" in upd and "must run between" in upd  # session required
    assert "flush_cache_after_weight_update" in upd and "record_weight_version_after_update" in upd
    worker = _class(_src("srt/speculative/dflash_worker_v2.py"), "DFlashWorkerV2")
    assert "return [('draft', self.draft_model_runner)]" in ast.unparse(_method(worker, "weight_update_runners"))


@needs_sglang
def test_meta_info_fields_the_trajectories_read():
    tm = ast.unparse(_src("srt/managers/tokenizer_manager.py"))
    for key in ("spec_verify_ct", "spec_num_correct_drafts", "spec_correct_drafts_histogram", "completion_tokens",
                "finish_reason"):
        assert f"meta_info['{key}']" in tm or f"'{key}': " in tm, key
    wv = ast.unparse(_src("srt/utils/weight_versions.py"))
    assert "meta_info['weight_versions']" in wv and "'version': span.version" in wv and "'start': span.start" in wv


# ------------------------------------------------------------------ (c) checkpoint names vs SGLang's draft model


def _sglang_draft_params(num_layers: int) -> tuple[set[str], list]:
    """The DFlashDraftModel parameter names (models/dflash.py, read with ast) and its stacked mapping."""
    tree = _src("srt/models/dflash.py")

    def attrs(cls_name):
        init = _method(_class(tree, cls_name), "__init__")
        return {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}

    model, layer, attn, mlp = (attrs(c) for c in ("DFlashDraftModel", "DFlashDecoderLayer", "DFlashAttention",
                                                   "DFlashMLP"))
    assert {"layers", "norm", "fc", "hidden_norm"} <= model
    assert {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"} <= layer
    assert {"qkv_proj", "o_proj", "q_norm", "k_norm"} <= attn and {"gate_up_proj", "down_proj"} <= mlp
    lw = _method(_class(tree, "DFlashDraftModel"), "load_weights")
    mapping = next(ast.literal_eval(n.value) for n in ast.walk(lw) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "stacked_params_mapping")
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{m}.weight" for m in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"layers.{i}.self_attn.{m}.weight" for m in ("qkv_proj", "o_proj", "q_norm", "k_norm")}
        names |= {f"layers.{i}.mlp.{m}.weight" for m in ("gate_up_proj", "down_proj")}
    return names, mapping


def _resolve(name: str, params: set[str], mapping) -> tuple[str, object] | None:
    """What DFlashDraftModel.load_weights does with one checkpoint name (None = silently skipped)."""
    for param, weight, shard in mapping:
        if f".{weight}." in name:
            mapped = name.replace(weight, param)
            return (mapped, shard) if mapped in params else None
    return (name, None) if name in params else None


@needs_sglang
def test_our_checkpoint_names_load_into_sglangs_draft_model(backend):
    dcfg = backend.drafter_config
    params, mapping = _sglang_draft_params(dcfg.num_hidden_layers)
    assert mapping == [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                       ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    ours = DFlashDrafter(dcfg).drafter_state_dict()
    hit: dict[str, set] = {}
    for name in ours:
        r = _resolve(name, params, mapping)
        assert r is not None, f"SGLang would silently skip {name}"
        hit.setdefault(r[0], set()).add(r[1])
    assert set(hit) == params  # every SGLang parameter is written
    assert all(hit[p] == {"q", "k", "v"} for p in params if p.endswith("qkv_proj.weight"))
    assert all(hit[p] == {0, 1} for p in params if p.endswith("gate_up_proj.weight"))
    # what SGLang ignores silently - hence our own name check before every update
    for ignored in ("mask_embedding", "length_head.proj.weight", "layers.0.self_attn.qproj.weight"):
        assert _resolve(ignored, params, mapping) is None
    entry = _src("srt/models/dflash.py")
    entry_cls = next(n for n in entry.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "EntryClass")
    assert dcfg.to_hf_dict()["architectures"][0] in {e.id for e in entry_cls.value.elts}
