"""GPU smoke test of the SGLang backend - for a CUDA machine where sglang==0.5.23 installs
with its dependencies; not part of CI, and NOT run on the development machines (no GPU, no SGLang runtime).

    pip install sglang==0.5.23          # full install, CUDA machine
    python scripts/sglang_smoke.py --model-path /models/Qwen3-8B [--recipe recipes/qwen3_8b.yaml] [--set k=v ...]

What it does, through adaflash_ray.backends.sglang.SGLangBackend (the worker's code path, no Ray):
start SGLang's DFLASH engine with version 0 written as a DFlash checkpoint; generate greedily (τ₀, outputs₀,
target checksum₀); reload the served drafter twice as versions 1 and 2 (pause -> draft-only update -> checksum
-> continue); generate again. It passes when the outputs are token-for-token the same (greedy is lossless and
the weights are the same), τ is unchanged (within --tau-tolerance), the target's weights checksum is unchanged,
and SGLang reports version 2. The last stdout line is one JSON document; exit 1 on a failed check.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in three sentences why the sky is blue.",
           "List five prime numbers greater than 100 and say how you checked them.",
           "Translate to French: The weather is nice today and we are going to the beach.",
           "What is 17 times 23? Show the steps.",
           "Summarize the plot of Romeo and Juliet in two sentences.",
           "Write a haiku about speculative decoding.",
           "Give three tips for writing readable code."]


def main(argv: list[str] | None = None) -> int:
    from adaflash_ray.backends.sglang import SGLangBackend
    from adaflash_ray.config import add_recipe_args, load_recipe

    ap = add_recipe_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--model-path", required=True, help="target Hugging Face directory (e.g. Qwen3-8B)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tau-tolerance", type=float, default=0.05, help="allowed relative change of τ")
    args = ap.parse_args(argv)
    overrides = ["engine.backend=sglang", "distill.features=recompute", "length_head.policy=fixed",
                 f"model.path={args.model_path}", *args.overrides]
    cfg = load_recipe(args.recipe or "recipes/qwen3_8b.yaml", overrides)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               if tok.chat_template else tok(p)["input_ids"] for p in PROMPTS]
    t0 = time.time()
    backend = SGLangBackend(cfg, tempfile.mkdtemp(prefix="sglang-smoke-"), model_path=args.model_path).start()
    start_s = time.time() - t0
    try:
        def run():
            res = backend.generate(prompts, args.max_new_tokens, 0.0, ignore_eos=True)
            return [r["output_ids"] for r in res], backend.stats()["spec/accept_len"]

        out0, tau0 = run()
        target0 = backend._run(backend._checksum("target"))
        v0 = backend.drafter_tensors()
        backend.load_drafter(v0, 1)
        backend.load_drafter(v0, 2)
        out2, tau2 = run()
        target2 = backend._run(backend._checksum("target"))
        checks = {"outputs_identical": out0 == out2,
                  "tau_unchanged": abs(tau2 - tau0) <= args.tau_tolerance * max(tau0, 1e-9),
                  "target_checksum_unchanged": target0 == target2,
                  "version_2_loaded": backend.loaded_version()["version"] == 2}
    finally:
        backend.shutdown()
    summary = {"ok": all(checks.values()), **checks, "tau_v0": tau0, "tau_v2": tau2, "start_s": round(start_s, 1),
               "num_reloads": backend.num_reloads, "sync_seconds": round(backend.sync_seconds, 3),
               "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "model_path": args.model_path}
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
