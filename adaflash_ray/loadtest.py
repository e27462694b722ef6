"""Load test of the HTTP endpoint through locust, plus what locust cannot see: hot reloads and drafter versions.

    python -m adaflash_ray.loadtest                                   # starts its own servers (local Ray)
    python -m adaflash_ray.loadtest --concurrency 32 --duration 120 --recipe recipes/cpu_tiny.yaml \
        --set distill.num_versions=4 --set distill.publish_every=12
    python -m adaflash_ray.loadtest --url http://127.0.0.1:8000 --api-key K --overhead-s 0   # a running server

The traffic is locust's (``locust`` from PyPI, run headless through its Python API: its runner, its HTTP
client, its statistics; its tables go to stderr): ``--concurrency`` locust users each send streaming ``/v1/chat/completions``
requests (ShareGPT prompts, greedy, ``--max-tokens``) back to back. The load numbers are locust's own statistics
of that run: requests and failures (a request fails unless HTTP 200 and, when streaming, the stream ends with
``[DONE]`` after a usage chunk and no error event), the latency percentiles (locust's entry for the request, its
response time set to the last byte), time to first token (a second locust entry, type ``TTFT``, per streamed
request), completion tokens (the request entry's response length is ``usage.completion_tokens``) over the wall
time. Locust keeps response times to 2 significant digits (its histogram buckets), so are the percentiles here
(its tables' "Aggregated" row mixes the request and TTFT entries; the JSON keeps them apart).
This module keeps only what locust cannot measure: the hot reloads during the load (the status route polled
every 2 s: version, seconds after the start, requests in flight at the swap) and, per response, the drafter
version that finished it (the last of its ``adaflash.drafter_versions``).

Phase 1 (``--duration`` s) runs against a server with ``serve.distill: true``; at the deadline locust stops its
users gracefully, so the requests in flight finish and count (up to ``--request-timeout`` s) and none starts
after. Phase 2 (``--overhead-s`` s, own servers only): the HTTP cost - the same locust traffic against a server
without distillation, then the same prompts on an in-process SpecEngine (no HTTP, no Ray) at the same batch; the
ratio of the two tokens/s is the HTTP layer's efficiency (goal >= 0.9).
The last stdout line is one JSON object with every number. Exit 1 if
a request failed or fewer than ``--min-reloads`` reloads happened during phase 1.

``--soak`` (:func:`run_soak`) instead, also through locust (its users send the mixed requests; each response is
also checked here): half sampled (temperature 0.8, top-p 0.9), half greedy; completions and streaming chat -
until the server has run ``--soak-steps`` decode steps (request-steps after the prefill; the status route's
``requests.decode_steps``), against a server with live distillation hot-reloading drafter versions in between.
Checked: no failed request (locust's failure count, soak and χ² phases), no stuck one (each has
``--request-timeout`` s and nothing is in flight at the end), token counts exact (never more than
``max_tokens``, exactly ``max_tokens`` when ``finish_reason`` is "length"; the completion tokens locust counted
over all replies equal the tokens the server committed), every greedy reply to a prompt the same whatever version
served it, and the first token's distribution on a fixed prompt (``--chi2-samples`` replies, sent by locust too)
against the target's own softmax at T = 0.8 / top-p 0.9 by a χ² test (p >= ``--chi2-alpha``).

Locust runs in a process of its own (:func:`run_locust`: this module again, ``--locust-child``): importing it
monkey-patches the process for gevent, which breaks imports such as transformers' (the tokenizer, the χ² target,
the in-process engine stay here).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from typing import Callable

from adaflash_ray.config import RunConfig, add_recipe_args, config_from_args

SOAK_TEMPERATURE, SOAK_TOP_P = 0.8, 0.9
STATUS_ROUTE = "/v1/adaflash/status"
VERSION_HEADER = "x-adaflash-drafter-version"


def _sse_events(lines):
    """The events of a server-sent-events body (OpenAI streaming; ``lines`` as requests' ``iter_lines()``): each
    ``data: {json}`` line parsed to a dict, in order, then None for ``data: [DONE]``; other lines are skipped.
    Raises json.JSONDecodeError on a bad event."""
    for raw in lines:
        line = (raw.decode() if isinstance(raw, bytes) else raw).strip()
        if line == "data: [DONE]":
            yield None
        elif line.startswith("data: "):
            yield json.loads(line[6:])


def _send(user, req: dict, timeout_s: float) -> dict | None:
    """One request through the locust user's HTTP client (``req``: name, path, JSON body). Locust records it as
    one request of entry ``req["name"]`` (response time: to the last byte; response length: the completion
    tokens) and, when streaming, one ``TTFT`` entry (time to the first content). A failure (not HTTP 200, an error
    event, a stream without usage or ``[DONE]``, more than ``timeout_s``, a bad body) is marked on locust's
    request and returns None; else ``{"text", "finish_reason", "completion_tokens", "version"}`` (``version``:
    the drafter version that finished the response)."""
    import requests

    body = req["body"]
    stream = bool(body.get("stream"))
    t0 = time.perf_counter()
    ttft = None
    with user.client.post(req["path"], json=body, name=req["name"], stream=stream, catch_response=True,
                          timeout=(30, timeout_s)) as r:
        def fail(msg: str) -> None:
            r.request_meta["response_length"] = 0  # bytes of an error body are no completion tokens
            r.failure(msg[:300])
            r.close()  # a stream left unread: the server sees the disconnect and aborts the request

        try:
            if r.error is not None:
                return fail(f"{type(r.error).__name__}: {r.error}")
            if r.status_code != 200:
                return fail(f"HTTP {r.status_code}: {r.text[:200]}")
            if not stream:
                js = r.json()
                ch = js["choices"][0]
                text, reason, n = ch.get("text", (ch.get("message") or {}).get("content")), ch["finish_reason"], \
                    js["usage"]["completion_tokens"]
                versions = (js.get("adaflash") or {}).get("drafter_versions")
            else:
                parts, reason, n, versions, done = [], None, None, None, False
                for ev in _sse_events(r.iter_lines()):  # to the body's end, so the connection can be reused
                    if time.perf_counter() - t0 > timeout_s:
                        return fail(f"stuck: no end after {timeout_s:.0f} s")
                    if ev is None or done:
                        done = True
                        continue
                    if "error" in ev:
                        return fail(f"stream error: {ev['error'].get('message', ev['error'])}")
                    if ev.get("usage"):
                        n = ev["usage"]["completion_tokens"]
                    versions = (ev.get("adaflash") or {}).get("drafter_versions") or versions
                    for c in ev.get("choices", []):
                        piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                        if piece and ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(piece or "")
                        reason = c.get("finish_reason") or reason
                if not done or n is None:
                    return fail("stream ended without usage / [DONE]")
                text = "".join(parts)
        except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as e:
            return fail(f"{type(e).__name__}: {e}")
        wall = time.perf_counter() - t0
        r.request_meta["response_time"] = wall * 1000
        r.request_meta["response_length"] = n
        version = versions[-1] if versions else int(r.headers.get(VERSION_HEADER, -1))
        r.success()
    if stream:
        user.environment.events.request.fire(request_type="TTFT", name=req["name"], context={}, exception=None,
                                             response_time=(ttft if ttft is not None else wall) * 1000,
                                             response_length=0)
    return {"text": text, "finish_reason": reason, "completion_tokens": n, "version": version}


class Traffic(ABC):
    """What locust's users send (:meth:`next`: a request dict, or None when there is nothing more to send) and
    what this module records of each successful response (:meth:`record`); one instance per locust run, shared
    by its users (greenlets of one thread: no locking needed)."""

    def __init__(self):
        self.versions: dict[int, int] = {}  # drafter version that finished the response -> responses

    @abstractmethod
    def next(self) -> dict | None:
        """The next request (``name``, ``path``, JSON ``body``), or None when this traffic has nothing more to send."""

    def record(self, req: dict, out: dict) -> None:
        self.versions[out["version"]] = self.versions.get(out["version"], 0) + 1

    def dump(self) -> dict:
        """The records, as JSON (they travel from the locust process to the caller)."""
        return {"responses_by_drafter_version": dict(sorted(self.versions.items()))}


class ChatLoad(Traffic):
    """The load test's traffic: greedy streaming chat, the prompts in turn."""

    def __init__(self, model: str, prompts: list[list[dict]], max_tokens: int):
        super().__init__()
        self.model, self.prompts, self.max_tokens, self.count = model, prompts, max_tokens, 0

    def next(self) -> dict:
        self.count += 1
        return {"name": "chat", "path": "/v1/chat/completions",
                "body": {"model": self.model, "messages": self.prompts[(self.count - 1) % len(self.prompts)],
                         "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}}}


class SoakTraffic(Traffic):
    """The soak's mixed traffic (half sampled at T 0.8 / top-p 0.9, half greedy on 8 repeated prompts; half
    non-streaming completions on token ids, half streaming chat; ``max_tokens`` one of 8, 16, ``max_tokens``),
    with each reply's token accounting checked and the greedy replies kept per prompt."""

    def __init__(self, model: str, messages: list[list[dict]], prompt_ids: list[list[int]], max_tokens: int,
                 seed: int):
        super().__init__()
        self.model, self.messages, self.prompt_ids, self.max_tokens = model, messages, prompt_ids, max_tokens
        self.rng = random.Random(seed)
        self.greedy_pool = list(range(min(8, len(messages))))  # greedy prompts repeat: their replies must not change
        self.token_errors: list[dict] = []
        self.greedy: dict[str, set[str]] = {}
        self.completion_tokens = self.num_sampled = self.num_greedy = 0

    def next(self) -> dict:
        rng = self.rng
        sampled = rng.random() < 0.5
        k = rng.choice(self.greedy_pool) if not sampled else rng.randrange(len(self.messages))
        n = rng.choice([8, 16, self.max_tokens])
        body = {"model": self.model, "max_tokens": n, "temperature": SOAK_TEMPERATURE if sampled else 0.0}
        if sampled:
            body["top_p"] = SOAK_TOP_P
        if rng.random() < 0.5:
            req = {"name": "completions", "path": "/v1/completions", "body": {**body, "prompt": self.prompt_ids[k]}}
        else:
            req = {"name": "chat", "path": "/v1/chat/completions",
                   "body": {**body, "messages": self.messages[k], "stream": True,
                            "stream_options": {"include_usage": True}}}
        return {**req, "sampled": sampled, "prompt": k}

    def record(self, req: dict, out: dict) -> None:
        super().record(req, out)
        max_tokens, reason, n = req["body"]["max_tokens"], out["finish_reason"], out["completion_tokens"]
        # exact: "length" only at max_tokens; "stop" (EOS, which counts) at or below it - EOS can be the last token
        if reason not in ("stop", "length") or n > max_tokens or (reason == "length" and n != max_tokens):
            self.token_errors.append({"finish_reason": reason, "completion_tokens": n, "max_tokens": max_tokens})
        self.completion_tokens += n
        if req["sampled"]:
            self.num_sampled += 1
        else:
            self.num_greedy += 1
            self.greedy.setdefault(f"{req['name']}:{req['prompt']}:{max_tokens}", set()).add(out["text"])

    def dump(self) -> dict:
        return {**super().dump(), "token_errors": self.token_errors, "completion_tokens": self.completion_tokens,
                "num_sampled": self.num_sampled, "num_greedy": self.num_greedy,
                "greedy": {k: sorted(v) for k, v in self.greedy.items()}}


class FirstTokens(Traffic):
    """``count`` sampled one-token completions on one fixed prompt (the χ² phase); their texts in ``texts``."""

    def __init__(self, model: str, prompt: list[int], count: int):
        super().__init__()
        self.body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": SOAK_TEMPERATURE,
                     "top_p": SOAK_TOP_P}
        self.left, self.texts = count, []

    def next(self) -> dict | None:
        if self.left <= 0:
            return None
        self.left -= 1
        return {"name": "chi2 first token", "path": "/v1/completions", "body": self.body}

    def record(self, req: dict, out: dict) -> None:
        super().record(req, out)
        self.texts.append(out["text"])

    def dump(self) -> dict:
        return {**super().dump(), "texts": self.texts}


TRAFFIC = {"chat": ChatLoad, "soak": SoakTraffic, "first_tokens": FirstTokens}


def _drive(url: str, traffic: Traffic, users: int, *, timeout_s: float, api_key: str | None = None,
           stop: Callable[[], bool] = lambda: False, on_start: Callable[[], None] = lambda: None):
    """One headless locust run in this (gevent-patched) process: ``users`` users (all spawned at once, no wait
    between requests) send ``traffic`` to ``url`` until ``stop()`` or the traffic runs out; then locust stops
    them gracefully (requests in flight finish, up to ``timeout_s``). ``on_start()`` is called once the runner
    has started. Returns (locust's Environment, whose ``stats`` are the run's, wall seconds to the end of the last
    request)."""
    import gevent
    from locust import HttpUser, constant, task
    from locust.env import Environment
    from locust.exception import StopUser
    from locust.runners import STATE_RUNNING

    class Client(HttpUser):
        wait_time = constant(0)

        def on_start(self):
            if api_key:
                self.client.headers["Authorization"] = f"Bearer {api_key}"

        @task
        def one(self):
            req = traffic.next()
            if req is None:
                raise StopUser()
            out = _send(self, req, timeout_s)
            if out is not None:
                traffic.record(req, out)

    env = Environment(user_classes=[Client], host=url, stop_timeout=timeout_s, catch_exceptions=True)
    runner = env.create_local_runner()
    t0 = time.perf_counter()
    try:
        runner.start(users, spawn_rate=users)
        on_start()
        while not stop() and not (runner.state == STATE_RUNNING and runner.user_count == 0):
            gevent.sleep(0.1)
        runner.stop()  # graceful: the requests in flight finish, none starts after
        wall = time.perf_counter() - t0
    finally:
        runner.quit()
    if runner.exceptions:  # an error in the task code itself (not a failed request): a bug here, not the server
        raise RuntimeError("locust task raised: " + next(iter(runner.exceptions.values()))["traceback"][-2000:])
    return env, wall


CHILD_FLAG = "--locust-child"  # python -m adaflash_ray.loadtest --locust-child SPEC.json: one run_locust() run


def _locust_child(spec_path: str) -> int:
    """The locust process of :func:`run_locust`: reads its spec, drives the traffic until SIGUSR1 (graceful stop)
    or the traffic runs out, prints locust's tables to stderr, writes ``{"locust": summary, "traffic": records}``
    to the spec's ``out``."""
    import locust  # noqa: F401  first: it monkey-patches sockets, ssl and threads for gevent
    import gevent

    with open(spec_path) as f:
        spec = json.load(f)
    traffic = TRAFFIC[spec["traffic"]["kind"]](**spec["traffic"]["args"])
    state = {"stop": False}
    gevent.signal_handler(signal.SIGUSR1, lambda: state.update(stop=True))

    def started() -> None:  # the one line the caller reads; anything printed after goes to stderr (no full pipe)
        print("started", flush=True)
        os.dup2(2, 1)

    env, wall = _drive(spec["url"], traffic, spec["users"], timeout_s=spec["timeout_s"], api_key=spec["api_key"],
                       stop=lambda: state["stop"], on_start=started)
    print_locust_stats(env, spec["title"])
    with open(spec["out"], "w") as f:
        json.dump({"locust": locust_summary(env, wall), "traffic": traffic.dump()}, f)
    return 0


def run_locust(url: str, kind: str, args: dict, users: int, *, timeout_s: float, api_key: str | None = None,
               title: str = "", stop: Callable[[float], bool] = lambda elapsed: False,
               poll: Callable[[float], None] | None = None, poll_every_s: float = 2.0) -> dict:
    """Drive ``TRAFFIC[kind](**args)`` against ``url`` with ``users`` locust users, in a locust process of its own
    (locust's gevent monkey patching stays out of this one: it breaks imports such as transformers'). While it
    runs, ``poll(elapsed_s)`` is called here about every ``poll_every_s``; once ``stop(elapsed_s)``, locust is
    asked to stop (gracefully: the requests in flight finish). Returns ``{"locust": locust_summary(...),
    "traffic": the traffic's records}``. Raises RuntimeError when the locust process fails; an exception of
    ``poll`` kills it and propagates."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="adaflash_locust_") as tmp:
        spec = {"url": url, "users": users, "timeout_s": timeout_s, "api_key": api_key, "title": title,
                "traffic": {"kind": kind, "args": args}, "out": os.path.join(tmp, "out.json")}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.Popen([sys.executable, "-m", "adaflash_ray.loadtest", CHILD_FLAG, spec_path],
                                stdout=subprocess.PIPE, text=True)
        try:
            if proc.stdout.readline().strip() != "started":
                raise RuntimeError(f"the locust process did not start (exit code {proc.wait()})")
            t0, next_poll, asked = time.perf_counter(), poll_every_s, False
            while proc.poll() is None:
                time.sleep(0.1)
                elapsed = time.perf_counter() - t0
                if poll is not None and elapsed >= next_poll:
                    poll(elapsed)
                    next_poll += poll_every_s
                if not asked and stop(elapsed):
                    proc.send_signal(signal.SIGUSR1)
                    asked = True
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"the locust process failed (exit code {proc.returncode}); its stderr is above")
        with open(spec["out"]) as f:
            return json.load(f)


def locust_summary(env, wall_s: float) -> dict:
    """Locust's statistics of one run as this module reports them: the request entries (all but ``TTFT``)
    together, the ``TTFT`` entries together; seconds; tokens are the request entries' response length."""
    from locust.stats import StatsEntry

    reqs, ttft = StatsEntry(env.stats, "requests", "POST"), StatsEntry(env.stats, "TTFT", "TTFT")
    for (_, method), e in env.stats.entries.items():
        (ttft if method == "TTFT" else reqs).extend(e)

    def pct(e, q: float) -> float | None:
        return round(e.get_response_time_percentile(q) / 1000, 3) if e.num_requests else None

    out = {"num_requests": reqs.num_requests, "num_failed": reqs.num_failures,
           "latency_p50_s": pct(reqs, 0.5), "latency_p99_s": pct(reqs, 0.99),
           "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
           "completion_tokens": reqs.total_content_length,
           "tokens_per_s": round(reqs.total_content_length / max(wall_s, 1e-9), 2),
           "requests_per_s": round((reqs.num_requests - reqs.num_failures) / max(wall_s, 1e-9), 3),
           "wall_s": round(wall_s, 1),
           "failures_sample": [f"{e.method} {e.name}: {e.error} (x{e.occurrences})"
                               for e in list(env.stats.errors.values())[:5]]}
    return out


def print_locust_stats(env, title: str) -> None:
    """Locust's own statistics and percentile tables (as its headless CLI prints them), to stderr."""
    from locust.stats import get_error_report_summary, get_percentile_stats_summary, get_stats_summary

    lines = [f"locust: {title}", *get_stats_summary(env.stats, current=False), "",
             *get_percentile_stats_summary(env.stats)]
    if env.stats.errors:
        lines += ["", *get_error_report_summary(env.stats)]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _status(url: str, api_key: str | None) -> dict:
    """The status route's JSON. Raises RuntimeError when it does not answer 200."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = requests.get(url + STATUS_ROUTE, headers=headers, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"status route answered HTTP {r.status_code}")
    return r.json()


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


def run_soak(url: str, model: str, messages: list[list[dict]], prompt_ids: list[list[int]], steps: int,
             concurrency: int, max_tokens: int, chi2_prompt: list[int], chi2_samples: int, request_timeout_s: float,
             api_key: str | None = None, seed: int = 0) -> dict:
    """Drive the soak (see the module docstring) against ``url`` through locust; returns its raw results:
    locust's statistics of the soak and χ² phases, this module's per-response records (token errors, greedy
    replies per prompt, the χ² phase's first-token texts, drafter versions), the server's status before / after.
    Raises RuntimeError when the status route does not answer."""
    st0 = _status(url, api_key)
    base = st0["requests"].get("decode_steps", 0)
    t0 = time.time()
    state = {"steps": 0}
    versions_seen: set = set()

    def poll(elapsed: float) -> None:
        st = _status(url, api_key)
        state["steps"] = st["requests"].get("decode_steps", 0) - base
        versions_seen.add(st["drafter_version"])
        print(f"  soak t={elapsed:5.0f}s decode steps {state['steps']}/{steps} "
              f"version {st['drafter_version']} in flight {st['in_flight']}", file=sys.stderr, flush=True)

    run = run_locust(url, "soak", {"model": model, "messages": messages, "prompt_ids": prompt_ids,
                                   "max_tokens": max_tokens, "seed": seed}, concurrency,
                     timeout_s=request_timeout_s, api_key=api_key, title=f"soak, {concurrency} users",
                     stop=lambda _: state["steps"] >= steps, poll=poll)
    out = {"locust": run["locust"], "soak": run["traffic"], "versions_seen": versions_seen,
           "soak_wall_s": round(time.time() - t0, 1)}
    out["status_after_traffic"] = st1 = _status(url, api_key)
    out["decode_steps"] = st1["requests"].get("decode_steps", 0) - base
    out["server_tokens"] = st1["requests"].get("tokens", 0) - st0["requests"].get("tokens", 0)
    out["engine_steps"] = st1["num_engine_steps"] - st0["num_engine_steps"]
    out["reloads"] = [r for r in st1["reloads"] if r["time"] >= t0]
    # χ²: the first token on one fixed prompt, sampled
    first = run_locust(url, "first_tokens", {"model": model, "prompt": chi2_prompt, "count": chi2_samples},
                       concurrency, timeout_s=request_timeout_s, api_key=api_key, title="chi2 first tokens")
    out["chi2_locust"] = first["locust"]
    out["chi2_texts"] = first["traffic"]["texts"]
    out["status_end"] = _status(url, api_key)
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
        raw = run_soak(url, model, messages, prompt_ids, ns.soak_steps, ns.concurrency, ns.max_tokens,
                       chi2_prompt, ns.chi2_samples, ns.request_timeout, ns.api_key, cfg.seed)
    finally:
        exit_code = server.stop() if server is not None else None
    chi2 = chi2_first_token(raw["chi2_texts"], probs, tok)
    st_end, soak, lo, lo2 = raw["status_end"], raw["soak"], raw["locust"], raw["chi2_locust"]
    greedy_changed = {k: v for k, v in soak["greedy"].items() if len(v) > 1}
    checks = {
        "no_failed_request": lo["num_failed"] == 0 and lo2["num_failed"] == 0,
        "no_stuck_request": st_end["in_flight"] == 0 and st_end["queue"]["running"] == 0,
        "decode_steps_reached": raw["decode_steps"] >= ns.soak_steps,
        # locust's counts (requests, response length = completion tokens) against this module's per-response ones
        # and the server's committed tokens
        "token_counts_exact": (not soak["token_errors"] and lo["completion_tokens"] == soak["completion_tokens"]
                               == raw["server_tokens"] and lo["num_requests"] == soak["num_sampled"] + soak["num_greedy"]),
        "hot_reloads": len(raw["reloads"]) >= ns.min_reloads,
        "chi2_first_token": chi2["p_value"] >= ns.chi2_alpha,
    }
    if exit_code is not None:
        checks["server_exit_0"] = exit_code == 0
    result = {
        "checks": checks, "ok": all(checks.values()), "recipe": ns.recipe or "default", "overrides": ns.overrides,
        "client": _client_version(), "temperature": SOAK_TEMPERATURE, "top_p": SOAK_TOP_P,
        "concurrency": ns.concurrency, "decode_steps": raw["decode_steps"], "engine_steps": raw["engine_steps"],
        "num_requests": lo["num_requests"], "num_failed": lo["num_failed"], "num_sampled": soak["num_sampled"],
        "num_greedy": soak["num_greedy"], "completion_tokens": lo["completion_tokens"],
        "server_tokens": raw["server_tokens"], "failures_sample": lo["failures_sample"] + lo2["failures_sample"],
        "locust": lo, "chi2_locust": lo2,
        "num_token_errors": len(soak["token_errors"]), "token_errors_sample": soak["token_errors"][:5],
        "greedy_prompts": len(soak["greedy"]), "greedy_replies_stable": not greedy_changed,
        "greedy_changed": greedy_changed,
        "reloads": [{k: r[k] for k in ("version", "seconds", "num_in_flight")} for r in raw["reloads"]],
        "drafter_versions_seen": sorted(raw["versions_seen"]),
        "responses_by_drafter_version": soak["responses_by_drafter_version"], "soak_wall_s": raw["soak_wall_s"],
        "chi2_prompt": ns.chi2_prompt, "chi2": chi2, "wall_s": round(time.time() - t0, 1),
        "server_exit_code": exit_code, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    line = json.dumps(result)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(f"soak: {result['decode_steps']} decode steps ({result['engine_steps']} engine steps), "
          f"{result['num_requests']} requests, {lo['num_failed'] + lo2['num_failed']} failed (locust), "
          f"{len(raw['reloads'])} reloads, chi2 p={chi2['p_value']:.3g}; checks {checks}", file=sys.stderr)
    print(line)
    return 0 if result["ok"] else 1


def _client_version() -> str:
    """``locust X.Y.Z``, from the installed distribution (importing locust here would monkey-patch this process)."""
    from importlib.metadata import version

    return f"locust {version('locust')}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaflash_ray.loadtest", description=__doc__.split("\n")[0])
    add_recipe_args(p)
    p.add_argument("--url", default=None, help="a running server (default: start one with serve.distill=true)")
    p.add_argument("--api-key", default=os.environ.get("ADAFLASH_API_KEY"))
    p.add_argument("--concurrency", type=int, default=32, help="locust users")
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
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds before a request counts as stuck (failed); also how long the requests in flight "
                        "may take to finish when locust stops")
    p.add_argument("--out", default=None, help="--soak: also write the result JSON here")
    ns = p.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("locust") is None:
        p.error("the load comes from locust: pip install locust (it is in the [dev] extra)")
    cfg = config_from_args(ns)
    if ns.soak:
        if ns.concurrency < 1 or ns.soak_steps < 1 or ns.chi2_samples < 20:
            p.error("--soak needs --concurrency >= 1, --soak-steps >= 1 and --chi2-samples >= 20")
        return soak_main(ns, cfg)
    if ns.concurrency < 1:
        p.error("--concurrency must be >= 1")
    model = cfg.serve.model_name or cfg.model.name
    messages, prompt_ids = _prompts(cfg, ns.num_prompts)
    chat = {"model": model, "prompts": messages, "max_tokens": ns.max_tokens}
    out: dict = {"client": _client_version(), "concurrency": ns.concurrency, "max_tokens": ns.max_tokens,
                 "recipe": ns.recipe or "default", "overrides": ns.overrides,
                 "max_batch_size": cfg.engine.max_batch_size, "num_prompts": len(messages)}
    server = None if ns.url else Server(ns.recipe, ns.overrides + ["serve.distill=true"], ns.port)
    url = ns.url or server.url
    reloads_seen: list[dict] = []
    state = {"last_version": None}

    def poll(elapsed: float) -> None:
        try:
            st = _status(url, ns.api_key)
        except Exception as e:  # a missed poll loses nothing: the reloads list is cumulative
            print(f"  t={elapsed:5.0f}s status: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return
        for rel in st.get("reloads", []):
            if rel["time"] >= t_start and rel["version"] not in {x["version"] for x in reloads_seen}:
                reloads_seen.append({"version": rel["version"], "at_s": round(rel["time"] - t_start, 1),
                                     "num_in_flight": rel["num_in_flight"], "seconds": rel["seconds"]})
        state["last_version"] = st.get("drafter_version")
        if elapsed >= 0:
            print(f"  t={elapsed:5.0f}s version={st.get('drafter_version')} in_flight={st.get('in_flight')} "
                  f"tokens/s(10s)={st.get('tokens_per_s_10s', 0):.1f} τ={st.get('accept_len', 0):.3f}",
                  file=sys.stderr, flush=True)

    try:
        print(f"phase 1: {ns.concurrency} locust users (streaming chat) for {ns.duration:.0f} s against {url}",
              file=sys.stderr)
        t_start = time.time()
        run = run_locust(url, "chat", chat, ns.concurrency, timeout_s=ns.request_timeout, api_key=ns.api_key,
                         title="phase 1", stop=lambda el: el >= ns.duration, poll=poll)
        poll(-1.0)  # the reloads during the drain, not printed
        out["load"] = {**run["locust"], **run["traffic"]}
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
            run = run_locust(plain.url, "chat", chat, ns.concurrency, timeout_s=ns.request_timeout,
                             title="phase 2, HTTP", stop=lambda el: el >= ns.overhead_s)
            h = {**run["locust"], **run["traffic"]}
        finally:
            plain.stop()
        base = engine_baseline(cfg, prompt_ids, ns.concurrency, ns.overhead_s, ns.max_tokens)
        out["overhead"] = {"http": h, "engine": base,
                           "http_over_engine_tokens_per_s": round(h["tokens_per_s"] / base["tokens_per_s"], 3)}
    ld = out["load"]
    print(f"\nrequests {ld['num_requests']}  failed {ld['num_failed']}  latency p50 {ld['latency_p50_s']} s  "
          f"p99 {ld['latency_p99_s']} s  TTFT p50 {ld['ttft_p50_s']} s  p99 {ld['ttft_p99_s']} s  "
          f"tokens/s {ld['tokens_per_s']} ({out['client']})  reloads during load {out['num_reloads_during_load']} "
          f"{[(r['version'], r['at_s']) for r in reloads_seen]}  responses by drafter version "
          f"{ld['responses_by_drafter_version']}", file=sys.stderr)
    if "overhead" in out:
        o = out["overhead"]
        print(f"HTTP {o['http']['tokens_per_s']} tokens/s vs engine {o['engine']['tokens_per_s']} tokens/s "
              f"-> {o['http_over_engine_tokens_per_s']}", file=sys.stderr)
    print(json.dumps(out))
    ok = ld["num_failed"] == 0 and out["num_reloads_during_load"] >= ns.min_reloads
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_locust_child(sys.argv[2]) if sys.argv[1:2] == [CHILD_FLAG] else main())
