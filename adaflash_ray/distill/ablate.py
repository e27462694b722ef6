"""Recipe ablations on the Ray-free trainer loop: train each variant from the same trajectory files for the same
training budget, evaluate every published version on the held-out prompts, compare with the free drafters.

    python -m adaflash_ray.distill.ablate --recipe recipes/smollm2_135m_gpu.yaml --trajectories traj/ --out abl/ \\
        --train-s 90 --variant base --variant 'depth5:drafter.num_hidden_layers=5,distill.lr=6e-4'

Each ``--variant NAME[:KEY=VALUE,...]`` is the recipe with those ``--set`` overrides plus
``distill.max_train_s = --train-s``; it trains with ``python -m adaflash_ray.distill.loop`` (a process of its own) into
``OUT/NAME`` and every version it publishes is evaluated on the recipe's held-out prompts (``data.eval_sources``,
``data.num_eval_prompts``, ``data.eval_max_new_tokens``; greedy; γ = block_size - 1 on every step, the drafter's own
quality, as the main job's ``eval_full_block``) with the built-in engine. Greedy outputs are the target's whatever
the drafter, so the prompt-lookup and suffix-lookup τ (:func:`adaflash_ray.drafting.heldout.lookup_baselines`) are
computed once, from the first evaluation's outputs. ``OUT/ablation.json`` holds per variant and version the
training seconds (sum of the optimizer steps' ``train/seconds`` after the first, warm-up step: GPU-seconds of one
trainer rank) and the held-out
τ per domain; ``OUT/ablation.png`` draws τ against training seconds per domain with the lookup lines.

Warm-up (``--warmup-steps``, default 10; 0 = off): before the timed variants, one untimed training of the first
variant (its overrides, the same files in the same order, so the batches its first steps see) runs for that many
optimizer steps in a process of its own into ``OUT/_warmup`` (deleted afterwards; ``ablation.json`` records it under
``warmup``: overrides, steps, seconds, exit status). Without it the first variant paid what the machine's on-disk
caches (Triton kernels, torch.compile's) then hold for every later process: at 3cafc9a its 30 s held 43 steps against
55-69 for the others, slower over all its steps, not only the first. Every variant still pays its own process's
start (CUDA context, cuBLAS handles, allocator growth) in its first step: that step is left out of every variant's
training seconds and step means alike, but it counts against its ``distill.max_train_s`` budget (the loop's budget
starts at the first step) in the same way for all. A variant using kernels the first one does not (e.g.
``distill.drafter_attention=flex``) still compiles them in its own budget.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from adaflash_ray.config import RecipeError, RunConfig, add_recipe_args, config_from_args

__all__ = ["parse_variant", "evaluate_checkpoint", "run_ablation", "main"]


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``"NAME"`` or ``"NAME:key=value,key=value"`` -> (NAME, ["key=value", ...]).

    Raises:
        ValueError: an empty name, a name with '/' (it names a directory), or an override without '='.
    """
    name, _, rest = spec.partition(":")
    sets = [s.strip() for s in rest.split(",") if s.strip()] if rest else []
    if not name or "/" in name:
        raise ValueError(f"--variant {spec!r}: the name must be non-empty and contain no '/'")
    bad = [s for s in sets if "=" not in s]
    if bad:
        raise ValueError(f"--variant {spec!r}: overrides must be key=value, got {bad}")
    return name, sets


def _heldout(cfg: RunConfig):
    """The recipe's held-out prompts (chat-templated ids) and each one's domain, as the main job's evaluation."""
    from adaflash_ray.data import encode_prompts, ensure_target, load_eval_prompts, load_tokenizer
    from adaflash_ray.drafting import heldout

    tok = load_tokenizer(ensure_target(cfg.model.path or cfg.model.name))
    evalp = encode_prompts(tok, load_eval_prompts(cfg.data.eval_sources, cfg.data.num_eval_prompts, cfg.seed + 1),
                           cfg.data.max_prompt_tokens)
    return list(evalp), [heldout.domain_of(p.source) for p in evalp.prompts]


def evaluate_checkpoint(engine, ckpt: str | Path, version: int, prompts: list[list[int]], domains: list[str],
                        max_new_tokens: int) -> tuple[dict[str, float], list[dict]]:
    """Load checkpoint ``ckpt`` into ``engine`` (a :class:`~adaflash_ray.engine.SpecEngine` built from the same
    recipe; versions may go back: it is loaded as a rollback) and decode ``prompts`` greedily at γ = block_size - 1.

    Returns:
        ({domain: τ}, results): τ = committed tokens per verify step per domain
        (:func:`adaflash_ray.drafting.heldout.tau_by_domain`); results are dicts with ``output_ids``,
        ``draft_lens``, ``num_accepted`` per request, in prompt order.
    Raises:
        CheckpointError: an unreadable or mismatched checkpoint.
    """
    from adaflash_ray.drafting import heldout
    from adaflash_ray.engine import SamplingParams
    from adaflash_ray.models import load_drafter_checkpoint

    config, tensors, meta = load_drafter_checkpoint(ckpt)
    engine.load_drafter(tensors, version, meta.get("sha256"), config, rollback=True)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, draft_len=engine.drafter.block_size - 1)
    reqs = engine.generate(prompts, params)
    results = [{"output_ids": list(r.output_ids), "draft_lens": list(r.draft_lens),
                "num_accepted": list(r.num_accepted)} for r in reqs]
    return heldout.tau_by_domain(results, domains), results


def _checkpoint_sha(ckpt: Path) -> str | None:
    """The sha256 a DFlash checkpoint directory's ``model.safetensors`` metadata records (None if none)."""
    from safetensors import safe_open

    try:
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            return (f.metadata() or {}).get("sha256")
    except Exception:  # an unreadable file: evaluate_checkpoint names the error
        return None


def _step_means(run_dir: Path) -> dict[str, float]:
    """Means over a run's optimizer steps after the first (``metrics.jsonl``) of what decides its positions/s:
    ``num_positions`` (valid block positions per step), ``num_blocks``, ``seconds`` and its split ``prep_s`` (target
    recompute + collate + copy), ``forward_s``, ``backward_step_s``; ``steps`` counted. Empty without steps."""
    keys = ("num_positions", "num_blocks", "seconds", "prep_s", "forward_s", "backward_step_s")
    steps = [m for m in (json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in m][1:]
    if not steps:
        return {}
    return {"steps": float(len(steps)),
            **{k: round(sum(float(m.get(f"train/{k}", 0.0)) for m in steps) / len(steps), 5) for k in keys}}


def _train_seconds(run_dir: Path) -> dict[int, float]:
    """Version -> cumulative ``train/seconds`` of the optimizer steps up to its publication (``metrics.jsonl``),
    the first step left out: it holds one-time warm-up (Triton kernel compilation - only the first variant of a
    machine pays it, the cache serves the rest -, allocator growth), not training."""
    total, out, first = 0.0, {0: 0.0}, True
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if first and "train/seconds" in m:
            first = False
        else:
            total += float(m.get("train/seconds", 0.0))
        if "sync/version" in m:
            out[int(m["sync/version"])] = total
    return out


def run_ablation(cfg: RunConfig, variants: list[tuple[str, list[str]]], trajectories: str | Path, out: str | Path,
                 train_s: float, recipe_path: str | None = None, base_sets: list[str] | None = None,
                 stop_at: float | None = None, overhead_s: float = 40.0, warmup_steps: int = 10) -> dict:
    """Train and evaluate every variant (see the module docstring); returns the ``ablation.json`` document.

    Args:
        cfg: the base recipe, ``recipe_path`` with ``base_sets`` applied (its held-out prompts are the eval set).
        variants: (name, ["key=value", ...]); each is built as ``recipe_path`` + ``base_sets`` + its overrides.
        trajectories: a directory of trajectory files (:class:`adaflash_ray.distill.loop.DirectorySource`).
        train_s: training budget per variant in seconds of the trainer loop (``distill.max_train_s``).
        recipe_path: the recipe file (None: the embedded default).
        stop_at: a wall-clock deadline (epoch seconds) or None: a variant starts only if ``train_s + overhead_s``
            seconds (its process start, model load, evaluations) fit before it, else it is recorded as
            ``{"skipped": "deadline"}``; a variant's training process is killed at the deadline.
        overhead_s: see ``stop_at``.
        warmup_steps: optimizer steps of the untimed warm-up training before the variants (module docstring);
            0 = none.
    A variant whose training process fails is recorded as ``{"sets", "error"}`` and the next one runs;
    ``ablation.json`` is rewritten after each variant (a run killed part way keeps the variants done). A
    checkpoint identical to one already evaluated (its sha256: e.g. every variant's v0 of the same architecture
    and seed) reuses that evaluation.
    Raises:
        RecipeError: a variant's overrides do not validate.
    """
    from adaflash_ray.config import load_recipe
    from adaflash_ray.drafting import heldout
    from adaflash_ray.engine import SpecEngine

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompts, domains = _heldout(cfg)
    doc = {"recipe": recipe_path, "base_sets": base_sets or [], "train_s": train_s,
           "num_eval_prompts": len(prompts), "eval_max_new_tokens": cfg.data.eval_max_new_tokens,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "variants": {}}
    evaluated: dict[str, dict] = {}  # checkpoint sha256 -> τ by domain

    def save() -> None:
        (out / "ablation.json").write_text(json.dumps(doc, indent=1, default=lambda x: None if x != x else x))

    def train(run_dir: Path, sets: list[str]) -> str | None:
        """``python -m adaflash_ray.distill.loop`` into ``run_dir`` (a process of its own: DeepSpeed keeps
        process-group state per process); None, or what went wrong."""
        cmd = [sys.executable, "-m", "adaflash_ray.distill.loop", "--trajectories", str(trajectories),
               "--out", str(run_dir)] + (["--recipe", str(recipe_path)] if recipe_path else [])
        for s in list(base_sets or []) + sets:
            cmd += ["--set", s]
        try:
            proc = subprocess.run(cmd, timeout=None if stop_at is None else max(1.0, stop_at - time.time()))
        except subprocess.TimeoutExpired:
            return f"training killed at the deadline: {' '.join(cmd)}"
        return f"training failed (exit {proc.returncode}): {' '.join(cmd)}" if proc.returncode != 0 else None

    if warmup_steps > 0 and variants:  # fills the on-disk kernel caches for every variant alike (module docstring)
        sets = variants[0][1] + [f"distill.max_train_s={train_s}", "distill.num_versions=1",
                                 f"distill.publish_every={warmup_steps}"]
        t0 = time.time()
        failed = train(out / "_warmup", sets)
        summary_path = out / "_warmup" / "summary.json"
        steps = json.loads(summary_path.read_text())["train_steps"] if summary_path.exists() else 0
        doc["warmup"] = {"sets": sets, "steps": steps, "seconds": round(time.time() - t0, 1), "error": failed}
        print(f"[ablate] warm-up: {steps} steps of {variants[0][0]} in {doc['warmup']['seconds']} s (discarded)"
              + (f": {failed}" if failed else ""), flush=True)
        shutil.rmtree(out / "_warmup", ignore_errors=True)
        save()

    for name, sets in variants:
        vcfg = load_recipe(recipe_path, list(base_sets or []) + sets + [f"distill.max_train_s={train_s}"])
        if stop_at is not None and time.time() + train_s + overhead_s > stop_at:
            doc["variants"][name] = {"sets": sets, "skipped": "deadline"}
            print(f"[ablate] {name}: skipped (deadline)", flush=True)
            save()
            continue
        t0 = time.time()
        failed = train(out / name, sets + [f"distill.max_train_s={train_s}"])
        if failed is None and not (out / name / "summary.json").exists():
            failed = "training wrote no summary.json"
        if failed is not None:
            doc["variants"][name] = {"sets": sets, "error": failed}
            print(f"[ablate] {name}: {failed}", flush=True)
            save()
            continue
        summary = json.loads((out / name / "summary.json").read_text())
        wall_train = time.time() - t0
        seconds = _train_seconds(out / name)
        engine = SpecEngine.from_config(vcfg, policy="fixed", calibrate=False)
        rows = {}
        for ck in sorted((out / name / "checkpoints").glob("v*"), key=lambda p: int(p.name[1:])):
            v = int(ck.name[1:])
            t1 = time.time()
            sha = _checkpoint_sha(ck)
            if sha is not None and sha in evaluated:
                by_domain = evaluated[sha]
            else:
                by_domain, results = evaluate_checkpoint(engine, ck, v, prompts, domains,
                                                         vcfg.data.eval_max_new_tokens)
                if sha is not None:
                    evaluated[sha] = by_domain
                if "baselines" not in doc:
                    doc["baselines"] = heldout.lookup_baselines(prompts, results, domains,
                                                                vcfg.drafter.block_size - 1)
                    print("[ablate] lookup τ " + json.dumps(doc["baselines"]), flush=True)
            rows[v] = {"train_s": round(seconds.get(v, float("nan")), 2), "tau_by_domain": by_domain,
                       "eval_s": round(time.time() - t1, 1)}
            print(f"[ablate] {name} v{v}: train {rows[v]['train_s']} s, τ "
                  + " ".join(f"{d} {t:.3f}" for d, t in by_domain.items()), flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        doc["variants"][name] = {"sets": sets, "train_steps": summary["train_steps"], "wall_train_s": round(wall_train, 1),
                                 "num_trained": summary["num_trained"], "num_files": summary.get("num_files"),
                                 "positions_per_s_wall": summary.get("positions_per_s_wall"),
                                 "read_wait_s": summary.get("read_wait_s"), "step_means": _step_means(out / name),
                                 "versions": rows,
                                 "train_versions": summary["versions"]}
        save()
    _plot(doc, out / "ablation.png")
    return doc


def _plot(doc: dict, path: Path) -> None:
    """τ per domain against training seconds, one line per variant, lookup baselines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {name: v for name, v in doc["variants"].items() if "versions" in v}  # not the failed or skipped ones
    domains = sorted({d for v in done.values() for r in v["versions"].values() for d in r["tau_by_domain"]})
    if not domains:
        return
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.4), squeeze=False)
    for ax, d in zip(axes[0], domains):
        for name, v in done.items():
            pts = sorted((r["train_s"], r["tau_by_domain"].get(d, math.nan)) for r in v["versions"].values())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for key, style in (("ngram", "--"), ("suffix", ":")):
            t = doc.get("baselines", {}).get(key, {}).get(d)
            if t is not None:
                ax.axhline(t, color="gray", linestyle=style, label=f"{key} lookup")
        ax.set_title(d)
        ax.set_xlabel("training seconds (one trainer rank)")
        ax.set_ylabel("held-out τ at γ = block_size - 1")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m adaflash_ray.distill.ablate`` (see the module docstring); exit 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m adaflash_ray.distill.ablate", description=__doc__.split("\n")[0])
    add_recipe_args(parser)
    parser.add_argument("--trajectories", required=True, help="directory of trajectory files (*.parquet)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train-s", type=float, required=True, help="training budget per variant, seconds")
    parser.add_argument("--variant", action="append", required=True, help="NAME[:key=value,key=value] (repeatable)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="seconds from now: variants that do not fit are skipped, a training past it is killed")
    parser.add_argument("--overhead-s", type=float, default=40.0,
                        help="with --deadline-s: seconds a variant needs beyond --train-s (start, evaluations)")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="optimizer steps of an untimed warm-up training of the first variant before the timed "
                             "ones (fills the kernel caches; 0 = none)")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(s) for s in args.variant]
        if len({n for n, _ in variants}) != len(variants):
            raise ValueError("variant names must be distinct")
        if not args.train_s > 0:
            raise ValueError(f"--train-s must be > 0, got {args.train_s}")
        if args.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
        cfg = config_from_args(args)
    except (RecipeError, ValueError) as e:
        print(f"error: {e}", flush=True)
        return 2
    stop_at = None if args.deadline_s is None else time.time() + args.deadline_s
    run_ablation(cfg, variants, args.trajectories, args.out, args.train_s, args.recipe, list(args.overrides or []),
                 stop_at=stop_at, overhead_s=args.overhead_s, warmup_steps=args.warmup_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
