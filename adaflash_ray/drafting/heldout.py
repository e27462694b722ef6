"""The held-out evaluation's per-domain figures and its free baselines (what the main job's report prints).

Given the inference worker's greedy results on the held-out prompts (each a dict with ``output_ids`` and the
per-step ``draft_lens`` / ``num_accepted``) and each prompt's domain:

- :func:`tau_by_domain` - the drafter's τ per domain, pooled over the domain's verify steps
  (:class:`adaflash_ray.engine.SpecStats`: τ = mean(a + 1), docs/design/ALGORITHMS.md §0);
- :func:`lookup_baselines` - the τ that prompt lookup and suffix lookup (:mod:`adaflash_ray.drafting.lookup`)
  reach on the same greedy outputs, computed offline from them. Greedy verification is lossless, so the
  outputs are the target's whatever the drafter and one version's outputs serve every version;
- :func:`heldout_summary` - the summary fields; :func:`domain_table` - the table beside the versions' τ.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from rich.table import Table

from adaflash_ray.bench import DOMAINS
from adaflash_ray.drafting.lookup import MAX_DRAFT, lookup_tau_by_domain
from adaflash_ray.engine.stats import SpecStats

__all__ = ["DOMAIN_OF_SOURCE", "domain_of", "domain_table", "heldout_summary", "lookup_baselines",
           "tau_by_domain"]

#: eval source (adaflash_ray.data) -> domain name: the bench's (:data:`adaflash_ray.bench.DOMAINS`) inverted
DOMAIN_OF_SOURCE = {source: domain for domain, source in DOMAINS.items()}


def domain_of(source: str) -> str:
    """The domain of an eval source (:data:`DOMAIN_OF_SOURCE`); an unlisted source is its own domain."""
    return DOMAIN_OF_SOURCE.get(source, source)


def _group(domains: Sequence[str], n: int) -> dict[str, list[int]]:
    if len(domains) != n:
        raise ValueError(f"{n} results but {len(domains)} domains")
    out: dict[str, list[int]] = {}
    for i, d in enumerate(domains):
        out.setdefault(d, []).append(i)
    return out


def tau_by_domain(results: Sequence[Mapping], domains: Sequence[str]) -> dict[str, float]:
    """τ per domain of worker results: (Σa + #steps) / #steps over every verify step of the domain's requests
    (NaN for a domain without one), domains in first-seen order.

    Args:
        results: one per request, each with ``draft_lens`` and ``num_accepted`` (per verify step, ints).
        domains: the domain of each request, aligned with ``results``.
    Raises:
        ValueError: ``results`` and ``domains`` differ in length, or a result's two lists do.
    """
    return {d: SpecStats.from_steps([g for i in idx for g in results[i]["draft_lens"]],
                                    [a for i in idx for a in results[i]["num_accepted"]]).accept_len
            for d, idx in _group(domains, len(results)).items()}


def lookup_baselines(prompts: Sequence[Sequence[int]], results: Sequence[Mapping], domains: Sequence[str],
                     max_draft: int = MAX_DRAFT) -> dict[str, dict[str, float]]:
    """Prompt-lookup and suffix-lookup τ per domain on the results' greedy ``output_ids``
    (:func:`adaflash_ray.drafting.lookup.lookup_tau_by_domain`: each domain's corpus holds its earlier
    requests in this order, never the request's own output).

    Args:
        prompts: each request's prompt token ids, aligned with ``results`` and ``domains``.
        results: the greedy results (``output_ids``: token ids).
        max_draft: the longest lookup draft (tokens; pass the drafter's ``block_size - 1`` to match its widest
            verify), capped at :data:`~adaflash_ray.drafting.lookup.MAX_DRAFT`.
    Returns:
        ``{"ngram": {domain: τ}, "suffix": {domain: τ}}``.
    Raises:
        ValueError: lengths differ, or ``max_draft < 0``.
    """
    _group(domains, len(results))
    return lookup_tau_by_domain(prompts, [r["output_ids"] for r in results], domains, min(max_draft, MAX_DRAFT))


def _rounded(by_domain: Mapping[str, float]) -> dict[str, float]:
    return {d: round(t, 4) for d, t in by_domain.items()}


def heldout_summary(by_version: Mapping[int, Mapping[str, float]], full_block: Mapping[str, float],
                    baselines: Mapping[str, Mapping[str, float]], num_positions: float, train_seconds: float,
                    num_trainers: int) -> dict:
    """The main job's summary fields of the held-out evaluation (τ rounded to 4 places, NaN kept for strict_json):

    ``eval_tau_by_domain`` ({domain: τ} of the final - highest - version under its length policy),
    ``eval_tau_by_domain_by_version`` ({version: {domain: τ}}), ``eval_full_block_by_domain`` (final version,
    γ = block_size - 1 every step), ``eval_ngram_tau_by_domain`` / ``eval_suffix_tau_by_domain`` (the free
    baselines on the same outputs) and ``trainer_positions_per_s``: block positions trained per second of
    trainer step time, ``num_trainers x num_positions / train_seconds`` (rank 0's counts; every data-parallel
    rank trains a batch of its own); None without a timed step.

    Args:
        by_version: version -> :func:`tau_by_domain`. full_block: the final version's at γ = block_size - 1.
        baselines: :func:`lookup_baselines`. num_positions, train_seconds: rank 0's summed ``train/num_positions``
            and ``train/seconds`` (s). num_trainers: data-parallel trainer ranks.
    """
    final = by_version[max(by_version)] if by_version else {}
    return {"eval_tau_by_domain": _rounded(final),
            "eval_tau_by_domain_by_version": {str(v): _rounded(t) for v, t in sorted(by_version.items())},
            "eval_full_block_by_domain": _rounded(full_block),
            "eval_ngram_tau_by_domain": _rounded(baselines.get("ngram", {})),
            "eval_suffix_tau_by_domain": _rounded(baselines.get("suffix", {})),
            "trainer_positions_per_s": (round(num_trainers * num_positions / train_seconds, 1)
                                        if train_seconds > 0 else None)}


def domain_table(by_version: Mapping[int, Mapping[str, float]], full_block: Mapping[str, float],
                 baselines: Mapping[str, Mapping[str, float]], title: str) -> Table:
    """Held-out τ per domain: a row per version (its length policy), then the final version at
    γ = block_size - 1 and the prompt-lookup / suffix-lookup baselines on the same outputs."""
    domains = list(dict.fromkeys([d for t in by_version.values() for d in t] + list(full_block)))
    table = Table(title=title)
    for col in ("held-out τ", *domains):
        table.add_column(col)
    rows = [(f"v{v}", t) for v, t in sorted(by_version.items())]
    if full_block:
        rows.append((f"v{max(by_version)} γ = block_size - 1" if by_version else "full block", full_block))
    rows += [("prompt lookup", baselines.get("ngram", {})), ("suffix lookup", baselines.get("suffix", {}))]
    for name, taus in rows:
        table.add_row(name, *(f"{taus[d]:.3f}" if d in taus and not math.isnan(taus[d]) else "-" for d in domains))
    return table
