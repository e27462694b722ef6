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
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
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
    ns = p.parse_args(argv)
    cfg = config_from_args(ns)
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
