"""Host time per engine step of the ``suffix`` and ``hybrid`` bench methods, the model forward left out.

Both engines are built as :mod:`adaflash_ray.bench` builds its methods (``suffix``: ``draft_sources=("suffix",)``, no
drafter, the ``fixed`` policy; ``hybrid``: ``("dflash", "suffix")`` with the ``cost`` policy's head, throughput guard
and block guard), with the lookups on the device (``lookup_device="device"``, as on CUDA) and, for the hybrid,
GPU-like cost tables set by hand (:func:`gpu_like_tables`: the cost-table code paths run as on a GPU; a CPU
calibration would measure the CPU's width-bound forward). The drafter is random, so its block is never chosen: what
the hybrid does per step beyond ``suffix`` while its block is idle is what this measures.

The target: ``tiny`` (a random-weight small shape: fast steps) or ``smollm2`` (the real SmolLM2-135M-Instruct of
``recipes/cpu_smollm2.yaml``, float32: seconds per batch-64 step, minutes per run). The suffix corpus holds each
timed prompt's AR continuation with a share ``--corrupt`` of its tokens replaced at random, so the suffix drafts
match for a few tokens at a time (about ``1 / corrupt`` - 1 accepted), as on real traffic.

Per step: ``host`` = the step's wall time minus the time inside ``ModelRunner._run`` (the forward, eager on CPU: on
CUDA a graph replay) and minus the drafter-context catch-up; ``plan`` = ``HybridPlanner.plan``, ``record`` =
``HybridPlanner.record``, ``schedule`` / ``postprocess`` = the engine's phases. Reported as µs per decode step (mean
over the timed runs' steps; the runs repeat after one untimed warm-up run, the row is the fastest of ``--repeats``).

    PYTHONPATH=. python scripts/profile_hybrid_host.py --batch 1 64 --new-tokens 96
    PYTHONPATH=. python scripts/profile_hybrid_host.py --batch 64 --cprofile hybrid
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import numpy as np
import torch

from adaflash_ray.config import LengthHeadConfig
from adaflash_ray.drafting.lookup import SuffixCorpus
from adaflash_ray.engine import SamplingParams, SpecEngine, SpecStats
from adaflash_ray.engine.length_policy import length_policy
from adaflash_ray.engine.runner import _buckets
from adaflash_ray.shapes import build_random_drafter, build_random_target, shape_config

#: the H200's calibrated spec table at batch buckets 1..64 (results/h200_ef18ca8_cost_table_standalone.txt), ms by
#: γ = 1..15 (a propose + a verify of width γ + 1)
H200_SPEC = {1: [2.418, 2.468, 2.468, 2.481, 2.481, 2.483, 2.483, 2.509, 2.509, 2.509, 2.509, 2.519, 2.519, 2.519, 2.519],
             2: [2.469, 2.5, 2.503, 2.519, 2.519, 2.528, 2.528, 2.559, 2.559, 2.559, 2.559, 2.576, 2.576, 2.576, 2.576],
             4: [2.528, 2.531, 2.542, 2.576, 2.576, 2.586, 2.586, 2.639, 2.639, 2.639, 2.639, 2.639, 2.639, 2.639, 2.639],
             8: [2.568, 2.597, 2.619, 2.647, 2.647, 2.671, 2.671, 2.702, 2.702, 2.702, 2.702, 2.726, 2.726, 2.726, 2.726],
             16: [2.67, 2.695, 2.716, 2.738, 2.738, 2.761, 2.761, 2.859, 2.859, 2.859, 2.859, 2.895, 2.895, 2.895, 2.895],
             32: [2.811, 2.843, 2.867, 2.971, 2.971, 3.013, 3.013, 3.121, 3.121, 3.121, 3.121, 3.236, 3.236, 3.236,
                  3.236],
             48: [3.078, 3.146, 3.214, 3.305, 3.305, 3.378, 3.378, 3.63, 3.63, 3.63, 3.63, 3.832, 3.832, 3.832, 3.832],
             64: [3.209, 3.313, 3.353, 3.479, 3.479, 3.602, 3.602, 3.94, 3.94, 3.94, 3.94, 4.231, 4.231, 4.231, 4.231]}


def gpu_like_tables(batch_sizes: list[int], max_draft: int) -> tuple[list, list, list]:
    """``(spec [nb][15], lookup [nb][max_draft + 1], ar [nb])`` ms: the H200 spec table at the nearest batch bucket at
    or above each batch size, an AR step of 1.2 + 0.008 B ms, a lookup step of width W = the AR step plus the spec
    table's growth from γ = 1 to γ = W - 1."""
    spec, look, ar = [], [], []
    for b in batch_sizes:
        row = H200_SPEC[min(k for k in H200_SPEC if k >= b) if b <= 64 else 64]
        a = 1.2 + 0.008 * b
        spec.append(list(row))
        ar.append(a)
        look.append([a] + [a + row[min(w - 1, len(row)) - 1] - row[0] for w in range(2, max_draft + 2)])
    return spec, look, ar


def build(method: str, target, drafter, head, batch: int, seq: int, corpus: SuffixCorpus) -> SpecEngine:
    """The bench's ``suffix`` / ``hybrid`` engine (device lookups; the hybrid with the hand tables)."""
    kw = dict(max_batch_size=batch, max_seq_len=seq, calibrate=False, lookup_device="device",
              suffix_corpus=corpus, lookup_corpus_tokens=1 << 16)
    if method == "suffix":
        return SpecEngine(target, None, None, policy="fixed", draft_sources=("suffix",), **kw)
    eng = SpecEngine(target, drafter, head, policy="cost", ar_steps=True, draft_sources=("dflash", "suffix"), **kw)
    bs = _buckets(batch)
    spec, look, ar = gpu_like_tables(bs, eng.runner.max_draft)
    nb = drafter.block_size - 1
    eng.policy.set_costs(bs, torch.tensor([r[:nb] for r in spec]), torch.tensor(ar))
    eng.planner.set_costs(bs, [r[:nb] for r in spec], look)
    for g in (eng.guard, eng.block_guard):
        if g is not None:
            g.set_buckets(bs)
    eng._guard_prior(ar)  # the AR costs as the guard's prior, as set_cost_table sets it
    return eng


class Timer:
    """Wraps ``eng``'s phases with perf_counter pairs (instance attributes; :meth:`detach` removes them): per step
    the seconds in ``forward`` (ModelRunner._run), ``plan``, ``record``, ``schedule``, ``postprocess``.

    The engine's clock (its step timings, the throughput guard and the block guard read it) becomes a GPU-like one:
    ``perf_counter`` with each forward's CPU time replaced by :func:`gpu_like_tables`' cost of that step (the spec
    table for a step that proposes, the lookup table for one that does not, the AR cost for an AR step), so the guards
    judge the steps by GPU-like costs, not by the CPU's width-bound forward."""

    NAMES = ("forward", "plan", "record", "schedule", "postprocess")

    def __init__(self, eng: SpecEngine):
        self.eng, self.cur = eng, dict.fromkeys(self.NAMES, 0.0)
        self._wrapped = []
        bs = _buckets(eng.runner.num_slots)
        spec, look, ar = gpu_like_tables(bs, eng.runner.max_draft)
        shift = [0.0]  # seconds: simulated forward time minus real forward time so far

        def sim_cost(key) -> float:
            r = min(i for i, b in enumerate(bs) if b >= key.batch_size)
            if not key.spec or key.width == 1 and not key.propose:
                return 1e-3 * ar[r]
            if key.propose:
                return 1e-3 * spec[r][max(key.width - 2, 0)]
            return 1e-3 * look[r][key.width - 1]

        real_run = eng.runner._run

        def forward(key):
            t0 = time.perf_counter()
            real_run(key)
            dt = time.perf_counter() - t0
            self.cur["forward"] += dt
            shift[0] += sim_cost(key) - dt

        eng.runner._run = forward
        self._wrapped.append((eng.runner, "_run"))
        eng.clock = eng.runner.clock = lambda: time.perf_counter() + shift[0]

        def wrap(obj, attr, name):
            fn = getattr(obj, attr)

            def inner(*a, **k):
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.cur[name] += time.perf_counter() - t0
                return out
            setattr(obj, attr, inner)
            self._wrapped.append((obj, attr))

        wrap(eng, "_schedule", "schedule")
        wrap(eng, "_postprocess", "postprocess")
        if eng.planner is not None:
            wrap(eng.planner, "plan", "plan")
            wrap(eng.planner, "record", "record")

    def detach(self) -> None:
        for obj, attr in self._wrapped:
            obj.__dict__.pop(attr, None)
        self.eng.clock = self.eng.runner.clock = time.perf_counter

    def run(self, prompts, params: SamplingParams) -> list[dict]:
        """Every prompt to completion; per decode step (no prefill in it) its phases' seconds and ``host``."""
        eng, steps = self.eng, []
        for p in prompts:
            eng.add_request(p, SamplingParams(**vars(params)))
        while eng.has_unfinished():
            self.cur = dict.fromkeys(self.NAMES, 0.0)
            prefills = eng.stats.num_prefills
            t0 = time.perf_counter()
            eng.step()
            total = time.perf_counter() - t0
            if eng.stats.num_prefills != prefills:
                continue
            catch_up = eng.runner.step_catch_up[1]
            steps.append({**self.cur, "total": total, "host": total - self.cur["forward"] - catch_up})
        return steps


def corrupted_corpus(target, prompts, new_tokens: int, corrupt: float, seed: int) -> list[list[int]]:
    """Each prompt + its greedy continuation (an AR engine), a share ``corrupt`` of the continuation's tokens replaced
    by random ones."""
    ar = SpecEngine(target, None, None, policy="fixed", max_batch_size=len(prompts),
                    max_seq_len=max(map(len, prompts)) + new_tokens + 32)
    outs = ar.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), mode="ar")
    rng = np.random.default_rng(seed)
    vocab = target.config.vocab_size
    seqs = []
    for p, r in zip(prompts, outs):
        out = np.asarray(r.output_ids)
        flip = rng.random(len(out)) < corrupt
        out[flip] = rng.integers(10, vocab, int(flip.sum()))
        seqs.append(p + out.tolist())
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--corrupt", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["suffix", "hybrid"], choices=("suffix", "hybrid"))
    ap.add_argument("--cprofile", nargs="*", default=[], choices=("suffix", "hybrid"))
    ns = ap.parse_args()
    torch.set_num_threads(1)
    if ns.target == "tiny":
        target = build_random_target(shape_config("tiny"), "cpu", torch.float32)
    else:
        from adaflash_ray.config import load_recipe
        from adaflash_ray.models.factory import load_target
        target = load_target(load_recipe("recipes/cpu_smollm2.yaml").model)
    drafter = build_random_drafter(target, num_layers=1, block_size=16)
    head = length_policy("cost").build_head(target.config.hidden_size, LengthHeadConfig(policy="cost"), 16)
    head = head.requires_grad_(False)
    rows = []
    for b in ns.batch:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(10, target.config.vocab_size, (ns.prompt_len,), generator=g).tolist()
                   for _ in range(b)]
        seeds = corrupted_corpus(target, prompts, ns.new_tokens, ns.corrupt, b)
        params = SamplingParams(max_new_tokens=ns.new_tokens, ignore_eos=True)
        for method in ns.methods:
            corpus = SuffixCorpus(max_ngram=3)
            eng = build(method, target, drafter, head, b, ns.prompt_len + ns.new_tokens + 64, corpus)
            eng.reset_corpus(seeds)
            timer = Timer(eng)
            timer.run(prompts, params)  # warm-up
            best = None
            prof = cProfile.Profile() if method in ns.cprofile else None
            for _ in range(ns.repeats):
                eng.reset_corpus(seeds)
                eng.stats = SpecStats()
                if prof is not None:
                    prof.enable()
                steps = timer.run(prompts, params)
                if prof is not None:
                    prof.disable()
                st = eng.stats
                row = {"method": method, "batch": b, "steps": len(steps), "guard_steps": st.num_guard_steps,
                       **{f"{k}_us": 1e6 * float(np.mean([s[k] for s in steps])) for k in
                          ("host", "plan", "record", "schedule", "postprocess", "forward")},
                       "source_hist": dict(sorted(st.source_hist.items())),
                       "accept_per_draft": {k: round(st.source_accept_len(k), 3) for k in st.source_hist
                                            if k != "none"},
                       "gamma_hist": {str(k): v for k, v in sorted(st.draft_len_hist.items())}}
                if best is None or row["host_us"] < best["host_us"]:
                    best = row
            timer.detach()
            rows.append(best)
            print(f"{method:7s} b={b:<3d} steps {best['steps']:4d} (forced AR {best['guard_steps']})  "
                  f"host {best['host_us']:7.1f} us/step  "
                  f"(plan {best['plan_us']:6.1f}  record {best['record_us']:6.1f}  schedule {best['schedule_us']:6.1f}"
                  f"  postprocess {best['postprocess_us']:6.1f})  forward {best['forward_us'] / 1e3:8.2f} ms  "
                  f"sources {best['source_hist']}  accepted/draft {best['accept_per_draft']}", flush=True)
            if prof is not None:
                print(f"--- cProfile {method} b={b} (all timed runs, cumulative, the engine's functions) ---")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(r"adaflash_ray/(engine|drafting)", 45)
    print(json.dumps({"target": ns.target, "rows": rows}))


if __name__ == "__main__":
    main()
