"""Load test of the HTTP endpoint: concurrent streaming chat clients, with live distillation hot reloads.

    python -m adaflash_ray.loadtest                                   # starts its own servers (local Ray)
    python -m adaflash_ray.loadtest --concurrency 32 --duration 120 --recipe recipes/cpu_tiny.yaml \
        --set distill.num_versions=4 --set distill.publish_every=12
    python -m adaflash_ray.loadtest --url http://127.0.0.1:8000 --api-key K --overhead-s 0   # a running server

Phase 1 (``--duration`` s): ``--concurrency`` clients each send streaming ``/v1/chat/completions`` requests
(ShareGPT prompts, greedy, ``--max-tokens``) back to back against a server with ``serve.distill: true``; the
status endpoint is polled to count the drafter versions hot-reloaded while requests were in flight.
Printed: requests, failed requests (any non-200, error or stream without ``[DONE]``), latency p50/p99, time to
first token p50/p99, completion tokens/s, reloads (version, seconds after start, requests in flight).
Phase 2 (``--overhead-s`` s, own servers only): the HTTP cost - the same traffic against a server without
distillation, then the same prompts on an in-process SpecEngine (no HTTP, no Ray) at the same batch; the ratio
of the two tokens/s is the HTTP layer's efficiency (goal >= 0.9).
The last stdout line is one JSON object with every number. Exit 1 if a request failed or fewer than
``--min-reloads`` reloads happened during phase 1.

``--soak`` (:func:`run_soak`) instead: mixed traffic - half sampled (temperature 0.8, top-p 0.9), half greedy;
completions and streaming chat - until the server has run ``--soak-steps`` decode steps (request-steps after the
prefill; the status route's ``requests.decode_steps``), against a server with live distillation hot-reloading
drafter versions in between. Checked: no failed request, no stuck one (each has ``--request-timeout`` s and
nothing is in flight at the end), token counts exact (never more than ``max_tokens``, exactly ``max_tokens`` when
``finish_reason`` is "length"; the completion tokens of all replies sum to the tokens the server committed), every greedy reply to a prompt the
same whatever version served it, and the first token's distribution on a fixed prompt (``--chi2-samples``
replies) against the target's own softmax at T = 0.8 / top-p 0.9 by a χ² test (p >= ``--chi2-alpha``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from adaflash_ray.config import RunConfig, add_recipe_args, config_from_args

SOAK_TEMPERATURE, SOAK_TOP_P = 0.8, 0.9


@dataclass
class LoadResult:
    """Per-request outcomes of one load phase (seconds; tokens are usage.completion_tokens)."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    versions: dict[int, int] = field(default_factory=dict)  # drafter version header -> responses
    wall_s: float = 0.0

    def summary(self) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))], 3)

        return {"num_requests": len(self.latencies) + len(self.failures), "num_failed": len(self.failures),
                "latency_p50_s": pct(self.latencies, 0.5), "latency_p99_s": pct(self.latencies, 0.99),
                "ttft_p50_s": pct(self.ttfts, 0.5), "ttft_p99_s": pct(self.ttfts, 0.99),
                "completion_tokens": self.tokens, "tokens_per_s": round(self.tokens / max(self.wall_s, 1e-9), 2),
                "requests_per_s": round(len(self.latencies) / max(self.wall_s, 1e-9), 3), "wall_s": round(self.wall_s, 1),
                "responses_by_drafter_version": dict(sorted(self.versions.items())),
                "failures_sample": self.failures[:5]}


async def _sse_events(content):
    """The events of a server-sent-events body (OpenAI streaming): each ``data: {json}`` line parsed to a dict, in
    order, then None for ``data: [DONE]``; other lines are skipped. Raises json.JSONDecodeError on a bad event."""
    async for raw in content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            yield None
        elif line.startswith("data: "):
            yield json.loads(line[6:])


async def _one(session: aiohttp.ClientSession, url: str, model: str, messages: list, max_tokens: int,
               res: LoadResult) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage, done = None, None, False
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                res.failures.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                return
            version = int(r.headers.get("x-adaflash-drafter-version", -1))
            async for ev in _sse_events(r.content):
                if ev is None:
                    done = True
                    break
                if ev.get("usage"):
                    usage = ev["usage"]
                if ttft is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.failures.append(f"{type(e).__name__}: {str(e)[:200]}")
        return
    if not done or usage is None:
        res.failures.append("stream ended without usage / [DONE]")
        return
    res.latencies.append(time.perf_counter() - t0)
    res.ttfts.append(ttft if ttft is not None else res.latencies[-1])
    res.tokens += usage["completion_tokens"]
    res.versions[version] = res.versions.get(version, 0) + 1


async def run_load(url: str, model: str, prompts: list[list[dict]], concurrency: int, duration_s: float,
                   max_tokens: int, api_key: str | None = None, on_tick=None) -> LoadResult:
    """``concurrency`` clients send requests back to back for ``duration_s`` seconds (requests started before
    the deadline finish and count). ``on_tick(elapsed_s)`` is awaited about every 2 s (e.g. status polling)."""
    res = LoadResult()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    t0 = time.perf_counter()
    counter = iter(range(10 ** 9))
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=conn) as session:
        async def client():
            while time.perf_counter() - t0 < duration_s:
                await _one(session, url, model, prompts[next(counter) % len(prompts)], max_tokens, res)

        async def ticker():
            while time.perf_counter() - t0 < duration_s:
                await asyncio.sleep(2.0)
                if on_tick is not None:
                    await on_tick(session, time.perf_counter() - t0)

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(client() for _ in range(concurrency)))
        tick.cancel()
        res.wall_s = time.perf_counter() - t0
    return res


def engine_baseline(cfg: RunConfig, prompt_ids: list[list[int]], concurrency: int, duration_s: float,
                    max_tokens: int) -> dict:
    """The engine's own tokens/s with no HTTP and no Ray: ``concurrency`` requests kept queued on an in-process
    SpecEngine (same recipe, batch ``engine.max_batch_size``, same drafter initialisation) for ``duration_s``."""
    import torch

    from adaflash_ray.engine import SamplingParams, SpecEngine

    torch.set_num_threads(cfg.engine.num_threads)
    torch.manual_seed(cfg.seed)
    eng = SpecEngine.from_config(cfg)
    reqs, num_done = [], 0
    t0 = time.perf_counter()
    # as the HTTP clients: keep `concurrency` requests in flight until the deadline, then let the tail finish
    while eng.has_unfinished() or time.perf_counter() - t0 < duration_s:
        while time.perf_counter() - t0 < duration_s and len(reqs) - num_done < concurrency:
            reqs.append(eng.add_request(prompt_ids[len(reqs) % len(prompt_ids)],
                                        SamplingParams(max_new_tokens=max_tokens)))
        num_done += len(eng.step("spec"))
    wall = time.perf_counter() - t0
    n = sum(len(r.output_ids) for r in reqs)
    return {"num_requests": len(reqs), "completion_tokens": n, "tokens_per_s": round(n / wall, 2),
            "wall_s": round(wall, 1)}


class Server:
    """``python -m adaflash_ray.serve`` as a subprocess on 127.0.0.1; ``stop()`` sends SIGTERM (drain)."""

    def __init__(self, recipe: str | None, overrides: list[str], port: int):
        cmd = [sys.executable, "-m", "adaflash_ray.serve", "--port", str(port)]
        if recipe:
            cmd += ["--recipe", recipe]
        for o in overrides:
            cmd += ["--set", o]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start ({' '.join(cmd)}): {line!r}")
        self.url = line.strip().rsplit(" ", 1)[-1]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def _prompts(cfg: RunConfig, n: int) -> tuple[list[list[dict]], list[list[int]]]:
    from adaflash_ray.data import encode_prompts, load_sharegpt, load_tokenizer, target_dir

    tok = load_tokenizer(target_dir(cfg.model))
    enc = encode_prompts(tok, load_sharegpt(n, cfg.seed + 7), cfg.data.max_prompt_tokens)
    return [p.messages for p in enc.prompts], list(enc)


async def _soak_one(session, url: str, model: str, kind: str, prompt, max_tokens: int, sampled: bool,
                    out: dict) -> None:
    """One soak request (``kind`` "completion": ``prompt`` is token ids, non-streaming; "chat": ``prompt`` is
    messages, streaming with usage); its outcome is appended to ``out``'s lists."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": SOAK_TEMPERATURE if sampled else 0.0}
    if sampled:
        body["top_p"] = SOAK_TOP_P
    try:
        if kind == "completion":
            async with session.post(url + "/v1/completions", json={**body, "prompt": prompt}) as r:
                if r.status != 200:
                    out["failures"].append(f"HTTP {r.status}: {(await r.text())[:200]}")
                    return
                js = await r.json()
            text, reason, n = js["choices"][0]["text"], js["choices"][0]["finish_reason"], js["usage"]["completion_tokens"]
        else:
            body.update(messages=prompt, stream=True, stream_options={"include_usage": True})
            parts, reason, n, done = [], None, None, False
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    out["failures"].append(f"HTTP {r.status}: {(await r.text())[:200]}")
                    return
                async for ev in _sse_events(r.content):
                    if ev is None:
                        done = True
                        break
                    if "error" in ev:
                        out["failures"].append(f"stream error: {ev['error']['message'][:200]}")
                        return
                    if ev.get("usage"):
                        n = ev["usage"]["completion_tokens"]
                    for ch in ev.get("choices", []):
                        parts.append(ch["delta"].get("content") or "")
                        reason = ch.get("finish_reason") or reason
            if not done or n is None:
                out["failures"].append("stream ended without usage / [DONE]")
                return
            text = "".join(parts)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
        out["failures"].append(f"{type(e).__name__}: {str(e)[:200]}")
        return
    # exact: "length" only at max_tokens; "stop" (EOS, which counts) at or below it - EOS can be the last token
    if reason not in ("stop", "length") or n > max_tokens or (reason == "length" and n != max_tokens):
        out["token_errors"].append({"finish_reason": reason, "completion_tokens": n, "max_tokens": max_tokens})
    out["completion_tokens"] += n
    out["num_sampled" if sampled else "num_greedy"] += 1
    if not sampled:
        out["greedy"].setdefault(f"{kind}:{json.dumps(prompt)}:{max_tokens}", set()).add(text)


def target_nucleus(model_dir: str, prompt_ids: list[int], temperature: float, top_p: float) -> dict[int, float]:
    """The target's next-token distribution after ``prompt_ids`` at ``temperature`` / ``top_p`` (Hugging Face
    transformers' own forward in float32; the nucleus rule of the engine's
    :func:`adaflash_ray.engine.runner.processed_probs`): token id -> probability, only ids with probability > 0."""
    import torch
    from transformers import AutoModelForCausalLM

    from adaflash_ray.engine.runner import processed_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1].float()
    p = processed_probs(logits[None], torch.tensor([temperature]), torch.tensor([top_p]))[0]
    idx = torch.nonzero(p > 0).flatten().tolist()
    return {i: float(p[i]) for i in idx}


def chi2_first_token(texts: list[str], probs: dict[int, float], tokenizer, min_expected: float = 5.0) -> dict:
    """χ² goodness of fit of the first generated token's text against ``probs`` (token id -> probability).

    Token ids whose texts coincide are one category; categories with fewer than ``min_expected`` expected
    replies are pooled into one; a reply outside the distribution's support counts in its own category with
    expectation 0 (the test then fails). Returns ``{statistic, dof, p_value, num_samples, categories}``.
    Raises ValueError when fewer than 2 categories remain (a distribution too peaked to test)."""
    from scipy import stats

    by_text: dict[str, float] = {}
    for tid, pr in probs.items():
        t = tokenizer.decode([tid])
        by_text[t] = by_text.get(t, 0.0) + pr
    n = len(texts)
    outside = sum(t not in by_text for t in texts)
    seen = {t: sum(x == t for x in texts) for t in by_text}
    big = [t for t in by_text if by_text[t] * n >= min_expected]
    small = [t for t in by_text if t not in big]
    obs = [seen[t] for t in big] + ([sum(seen[t] for t in small)] if small else [])
    exp = [by_text[t] * n for t in big] + ([sum(by_text[t] for t in small) * n] if small else [])
    if small and exp[-1] < min_expected and len(obs) > 2:  # too little mass to stand alone: join the last one
        obs[-2:], exp[-2:] = [obs[-2] + obs[-1]], [exp[-2] + exp[-1]]
    if len(obs) < 2:
        raise ValueError(f"the distribution has {len(obs)} testable category(ies): choose a less peaked prompt")
    tot = sum(exp)
    exp = [e * (n - outside) / tot for e in exp]  # renormalise for float rounding (outside replies excluded)
    stat, pval = stats.chisquare(obs, exp)
    if outside:
        stat, pval = float("inf"), 0.0
    cats = [{"text": t, "expected_p": round(by_text[t], 5), "observed": seen[t]} for t in big]
    if small:
        cats.append({"text": f"<{len(small)} rarer tokens pooled>", "expected_p": round(sum(by_text[t] for t in small), 5),
                     "observed": sum(seen[t] for t in small)})
    return {"statistic": float(stat), "dof": len(obs) - 1, "p_value": float(pval), "num_samples": n,
            "num_outside_support": outside, "categories": cats}


async def run_soak(url: str, model: str, messages: list[list[dict]], prompt_ids: list[list[int]], steps: int,
                   concurrency: int, max_tokens: int, chi2_prompt: list[int], chi2_samples: int,
                   request_timeout_s: float, api_key: str | None = None, seed: int = 0) -> dict:
    """Drive the soak (see the module docstring) against ``url``; returns its raw results: per-phase counts,
    the server's status before / after, the greedy replies per prompt, the χ² phase's first-token texts.
    Raises RuntimeError when the status route does not answer."""
    import random

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    out = {"failures": [], "token_errors": [], "completion_tokens": 0, "num_sampled": 0, "num_greedy": 0,
           "greedy": {}, "versions_seen": set(), "reloads": []}
    rng = random.Random(seed)
    greedy_pool = list(range(min(8, len(messages))))  # greedy prompts repeat: their replies must not change
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency + 4)) as session:
        async def status() -> dict:
            async with session.get(url + "/v1/adaflash/status") as r:
                if r.status != 200:
                    raise RuntimeError(f"status route answered HTTP {r.status}")
                return await r.json()

        st0 = await status()
        base = st0["requests"].get("decode_steps", 0)
        t0 = time.time()
        state = {"steps": 0, "stop": False}

        async def client(i: int) -> None:
            while not state["stop"]:
                sampled = rng.random() < 0.5
                k = rng.choice(greedy_pool) if not sampled else rng.randrange(len(messages))
                n = rng.choice([8, 16, max_tokens])
                if rng.random() < 0.5:
                    await _soak_one(session, url, model, "completion", prompt_ids[k], n, sampled, out)
                else:
                    await _soak_one(session, url, model, "chat", messages[k], n, sampled, out)

        async def monitor() -> None:
            while True:
                await asyncio.sleep(2.0)
                st = await status()
                state["steps"] = st["requests"].get("decode_steps", 0) - base
                out["versions_seen"].add(st["drafter_version"])
                print(f"  soak t={time.time() - t0:5.0f}s decode steps {state['steps']}/{steps} "
                      f"version {st['drafter_version']} in flight {st['in_flight']}", file=sys.stderr, flush=True)
                if state["steps"] >= steps:
                    state["stop"] = True
                    return

        mon = asyncio.create_task(monitor())
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        await mon
        out["soak_wall_s"] = round(time.time() - t0, 1)
        out["status_after_traffic"] = st1 = await status()
        out["decode_steps"] = st1["requests"].get("decode_steps", 0) - base
        out["server_tokens"] = st1["requests"].get("tokens", 0) - st0["requests"].get("tokens", 0)
        out["engine_steps"] = st1["num_engine_steps"] - st0["num_engine_steps"]
        out["reloads"] = [r for r in st1["reloads"] if r["time"] >= t0]
        # χ²: the first token on one fixed prompt, sampled
        texts: list[str] = []
        sem = asyncio.Semaphore(concurrency)

        async def first_token() -> None:
            async with sem:
                body = {"model": model, "prompt": chi2_prompt, "max_tokens": 1, "temperature": SOAK_TEMPERATURE,
                        "top_p": SOAK_TOP_P}
                try:
                    async with session.post(url + "/v1/completions", json=body) as r:
                        if r.status != 200:
                            out["failures"].append(f"chi2 HTTP {r.status}: {(await r.text())[:200]}")
                            return
                        texts.append((await r.json())["choices"][0]["text"])
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    out["failures"].append(f"chi2 {type(e).__name__}: {str(e)[:200]}")

        await asyncio.gather(*(first_token() for _ in range(chi2_samples)))
        out["chi2_texts"] = texts
        out["status_end"] = await status()
    return out


def soak_main(ns, cfg: RunConfig) -> int:
    """``--soak``: start a server with live distillation (unless ``--url``), run :func:`run_soak`, judge it,
    print one JSON line (also written to ``--out``). Exit 0 iff every check passed."""
    from adaflash_ray.data import load_tokenizer, target_dir

    model = cfg.serve.model_name or cfg.model.name
    messages, prompt_ids = _prompts(cfg, ns.num_prompts)
    tok = load_tokenizer(target_dir(cfg.model))
    chi2_prompt = list(tok.apply_chat_template([{"role": "user", "content": ns.chi2_prompt}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"])
    probs = target_nucleus(str(target_dir(cfg.model)), chi2_prompt, SOAK_TEMPERATURE, SOAK_TOP_P)
    server = None
    if not ns.url:
        server = Server(ns.recipe, ns.overrides + ["serve.distill=true", f"distill.num_versions={ns.soak_versions}"],
                        ns.port)
    url = ns.url or server.url
    t0 = time.time()
    try:
        raw = asyncio.run(run_soak(url, model, messages, prompt_ids, ns.soak_steps, ns.concurrency, ns.max_tokens,
                                   chi2_prompt, ns.chi2_samples, ns.request_timeout, ns.api_key, cfg.seed))
    finally:
        exit_code = server.stop() if server is not None else None
    chi2 = chi2_first_token(raw["chi2_texts"], probs, tok)
    st_end = raw["status_end"]
    greedy_changed = {k: sorted(v) for k, v in raw["greedy"].items() if len(v) > 1}
    checks = {
        "no_failed_request": not raw["failures"],
        "no_stuck_request": st_end["in_flight"] == 0 and st_end["queue"]["running"] == 0,
        "decode_steps_reached": raw["decode_steps"] >= ns.soak_steps,
        "token_counts_exact": not raw["token_errors"] and raw["completion_tokens"] == raw["server_tokens"],
        "hot_reloads": len(raw["reloads"]) >= ns.min_reloads,
        "chi2_first_token": chi2["p_value"] >= ns.chi2_alpha,
    }
    if exit_code is not None:
        checks["server_exit_0"] = exit_code == 0
    result = {
        "checks": checks, "ok": all(checks.values()), "recipe": ns.recipe or "default", "overrides": ns.overrides,
        "temperature": SOAK_TEMPERATURE, "top_p": SOAK_TOP_P, "concurrency": ns.concurrency,
        "decode_steps": raw["decode_steps"], "engine_steps": raw["engine_steps"],
        "num_requests": raw["num_sampled"] + raw["num_greedy"], "num_sampled": raw["num_sampled"],
        "num_greedy": raw["num_greedy"], "completion_tokens": raw["completion_tokens"],
        "server_tokens": raw["server_tokens"], "failures_sample": raw["failures"][:5],
        "num_token_errors": len(raw["token_errors"]), "token_errors_sample": raw["token_errors"][:5], "greedy_prompts": len(raw["greedy"]),
        "greedy_replies_stable": not greedy_changed, "greedy_changed": greedy_changed, "reloads": [{k: r[k] for k in ("version", "seconds", "num_in_flight")}
                                                       for r in raw["reloads"]],
        "drafter_versions_seen": sorted(raw["versions_seen"]), "soak_wall_s": raw["soak_wall_s"],
        "chi2_prompt": ns.chi2_prompt, "chi2": chi2, "wall_s": round(time.time() - t0, 1),
        "server_exit_code": exit_code, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    line = json.dumps(result)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(f"soak: {result['decode_steps']} decode steps ({result['engine_steps']} engine steps), "
          f"{result['num_requests']} requests, {len(raw['failures'])} failed, {len(raw['reloads'])} reloads, "
          f"chi2 p={chi2['p_value']:.3g}; checks {checks}", file=sys.stderr)
    print(line)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaflash_ray.loadtest", description=__doc__.split("\n")[0])
    add_recipe_args(p)
    p.add_argument("--url", default=None, help="a running server (default: start one with serve.distill=true)")
    p.add_argument("--api-key", default=os.environ.get("ADAFLASH_API_KEY"))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=120.0, help="phase 1 seconds")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-reloads", type=int, default=2)
    p.add_argument("--overhead-s", type=float, default=40.0, help="phase 2 seconds per side; 0 = skip")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--soak", action="store_true", help="the sampled soak instead (see the module docstring)")
    p.add_argument("--soak-steps", type=int, default=20_000, help="--soak: decode steps to drive")
    p.add_argument("--soak-versions", type=int, default=4, help="--soak: distill.num_versions of its own server")
    p.add_argument("--chi2-samples", type=int, default=400, help="--soak: first-token samples on the fixed prompt")
    p.add_argument("--chi2-alpha", type=float, default=1e-3, help="--soak: the χ² test's p-value threshold")
    p.add_argument("--chi2-prompt", default="Name one animal.", help="--soak: the fixed user message")
    p.add_argument("--request-timeout", type=float, default=300.0, help="--soak: seconds before a request is stuck")
    p.add_argument("--out", default=None, help="--soak: also write the result JSON here")
    ns = p.parse_args(argv)
    cfg = config_from_args(ns)
    if ns.soak:
        if ns.concurrency < 1 or ns.soak_steps < 1 or ns.chi2_samples < 20:
            p.error("--soak needs --concurrency >= 1, --soak-steps >= 1 and --chi2-samples >= 20")
        return soak_main(ns, cfg)
    model = cfg.serve.model_name or cfg.model.name
    messages, prompt_ids = _prompts(cfg, ns.num_prompts)
    out: dict = {"concurrency": ns.concurrency, "max_tokens": ns.max_tokens, "recipe": ns.recipe or "default",
                 "overrides": ns.overrides, "max_batch_size": cfg.engine.max_batch_size, "num_prompts": len(messages)}
    server = None if ns.url else Server(ns.recipe, ns.overrides + ["serve.distill=true"], ns.port)
    url = ns.url or server.url
    reloads_seen: list[dict] = []
    state = {"last_version": None}

    async def tick(session, elapsed):
        try:
            async with session.get(url + "/v1/adaflash/status") as r:
                st = await r.json()
        except (aiohttp.ClientError, ValueError):
            return
        for rel in st.get("reloads", []):
            if rel["time"] >= t_start and rel["version"] not in {x["version"] for x in reloads_seen}:
                reloads_seen.append({"version": rel["version"], "at_s": round(rel["time"] - t_start, 1),
                                     "num_in_flight": rel["num_in_flight"], "seconds": rel["seconds"]})
        state["last_version"] = st.get("drafter_version")
        print(f"  t={elapsed:5.0f}s version={st.get('drafter_version')} in_flight={st.get('in_flight')} "
              f"tokens/s(10s)={st.get('tokens_per_s_10s', 0):.1f} τ={st.get('accept_len', 0):.3f}",
              file=sys.stderr, flush=True)

    try:
        print(f"phase 1: {ns.concurrency} streaming clients for {ns.duration:.0f} s against {url}", file=sys.stderr)
        t_start = time.time()
        res = asyncio.run(run_load(url, model, messages, ns.concurrency, ns.duration, ns.max_tokens, ns.api_key, tick))
        out["load"] = res.summary()
        out["reloads_during_load"] = reloads_seen
        out["num_reloads_during_load"] = sum(1 for r in reloads_seen if r["at_s"] <= ns.duration)
        out["final_drafter_version"] = state["last_version"]
    finally:
        if server is not None:
            out["server_exit_code"] = server.stop()
    if server is not None and ns.overhead_s > 0:
        print(f"phase 2: HTTP vs in-process engine, {ns.overhead_s:.0f} s each", file=sys.stderr)
        plain = Server(ns.recipe, ns.overrides + ["serve.distill=false"], ns.port)
        try:
            h = asyncio.run(run_load(plain.url, model, messages, ns.concurrency, ns.overhead_s, ns.max_tokens))
        finally:
            plain.stop()
        base = engine_baseline(cfg, prompt_ids, ns.concurrency, ns.overhead_s, ns.max_tokens)
        out["overhead"] = {"http": h.summary(), "engine": base,
                           "http_over_engine_tokens_per_s": round(h.summary()["tokens_per_s"] / base["tokens_per_s"], 3)}
    ld = out["load"]
    print(f"\nrequests {ld['num_requests']}  failed {ld['num_failed']}  latency p50 {ld['latency_p50_s']} s  "
          f"p99 {ld['latency_p99_s']} s  TTFT p50 {ld['ttft_p50_s']} s  p99 {ld['ttft_p99_s']} s  "
          f"tokens/s {ld['tokens_per_s']}  reloads during load {out['num_reloads_during_load']} "
          f"{[(r['version'], r['at_s']) for r in reloads_seen]}", file=sys.stderr)
    if "overhead" in out:
        o = out["overhead"]
        print(f"HTTP {o['http']['tokens_per_s']} tokens/s vs engine {o['engine']['tokens_per_s']} tokens/s "
              f"-> {o['http_over_engine_tokens_per_s']}", file=sys.stderr)
    print(json.dumps(out))
    ok = ld["num_failed"] == 0 and out["num_reloads_during_load"] >= ns.min_reloads
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
