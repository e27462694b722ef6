"""``python -m adaflash_ray.loadtest`` (load mode) against a stand-in server: the load numbers are locust's own
statistics, and they agree with what the server itself counted - requests, failed requests, completion tokens,
responses per drafter version - and the hot reload the status route reports is seen with its time.

The stand-in (stdlib ``http.server`` in a thread, 127.0.0.1) speaks the routes the load test uses: streaming
``/v1/chat/completions`` (SSE chunks, the final one with ``adaflash.drafter_versions``, a usage chunk, ``[DONE]``)
and ``/v1/adaflash/status``; it fails every 5th request in one of three ways (HTTP 500, a stream without
``[DONE]``, an error event), and "hot-reloads" version 1 -> 2 one second into the run. No Ray, no model: ~10 s.

Run: python -m pytest -q tests/test_loadtest.py
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# locust runs in the load test's own child process; importing it here would monkey-patch this process for gevent
# (ssl, sockets) under every other test of the session: only check that it is installed
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed (pip install -e .[dev])", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


class StandIn:
    """The server's own counts: requests, failures by kind, tokens of the successful replies, replies by
    version."""

    def __init__(self):
        self.lock = threading.Lock()
        self.num, self.failed, self.tokens, self.by_version = 0, 0, 0, {}
        self.t0 = None
        self.reloads = []
        self.in_flight = 0

    def version(self) -> int:
        if self.t0 is not None and time.time() - self.t0 > 1.0:
            if not self.reloads:
                self.reloads.append({"version": 2, "time": time.time(), "num_in_flight": self.in_flight,
                                     "seconds": 0.01})
            return 2
        return 1


def _handler(state: StandIn):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, code: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            with state.lock:
                self._json(200, {"drafter_version": state.version(), "in_flight": state.in_flight,
                                 "reloads": list(state.reloads), "tokens_per_s_10s": 1.0, "accept_len": 1.5})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/chat/completions" and body["stream"] and body["temperature"] == 0
            with state.lock:
                state.t0 = state.t0 or time.time()
                state.num += 1
                k, v0 = state.num, state.version()
                state.in_flight += 1
            try:
                if k % 5 == 0 and k % 3 == 0:
                    with state.lock:
                        state.failed += 1
                    return self._json(500, {"error": {"message": "stand-in failure", "type": "server_error"}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("x-adaflash-drafter-version", str(v0))
                self.end_headers()
                n = 1 + k % body["max_tokens"]
                self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n')
                for i in range(n):
                    time.sleep(0.01)
                    ev = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
                          "usage": None}
                    self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                if k % 5 == 0 and k % 3 == 1:
                    with state.lock:
                        state.failed += 1
                    return  # connection closes: no usage, no [DONE]
                if k % 5 == 0:
                    with state.lock:
                        state.failed += 1
                    self.wfile.write(b'data: {"error": {"message": "stand-in stream error"}}\n\ndata: [DONE]\n\n')
                    return
                with state.lock:
                    v1 = state.version()
                fin = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                       "adaflash": {"drafter_versions": sorted({v0, v1})}}
                use = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}
                self.wfile.write(f"data: {json.dumps(fin)}\n\ndata: {json.dumps(use)}\n\ndata: [DONE]\n\n".encode())
                with state.lock:
                    state.tokens += n
                    state.by_version[str(v1)] = state.by_version.get(str(v1), 0) + 1
            finally:
                with state.lock:
                    state.in_flight -= 1

    return H


def test_load_numbers_are_locusts_and_match_the_server():
    state = StandIn()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        cmd = [sys.executable, "-m", "adaflash_ray.loadtest", "--url", f"http://127.0.0.1:{srv.server_port}",
               "--concurrency", "4", "--duration", "5", "--max-tokens", "8", "--num-prompts", "16",
               "--overhead-s", "0", "--min-reloads", "1", "--recipe", "recipes/cpu_tiny.yaml"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        srv.shutdown()
    assert r.stdout.strip(), r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    ld = res["load"]
    assert res["client"].startswith("locust ")
    assert state.num >= 10 and state.failed >= 2, (state.num, state.failed)
    assert r.returncode == 1, r.stderr[-2000:]  # a request failed
    assert ld["num_requests"] == state.num and ld["num_failed"] == state.failed, (ld, state.num, state.failed)
    assert ld["completion_tokens"] == state.tokens
    assert ld["responses_by_drafter_version"] == state.by_version
    # the 500s answer at once: they pull the latency median below the streamed requests' TTFT median
    assert 0 < ld["latency_p50_s"] <= ld["latency_p99_s"] and 0 < ld["ttft_p50_s"] <= ld["ttft_p99_s"] <= ld["latency_p99_s"]
    assert ld["tokens_per_s"] > 0 and ld["failures_sample"]
    assert res["num_reloads_during_load"] == 1 and res["reloads_during_load"][0]["version"] == 2
    # the stand-in reloads 1 s after its first request; locust may take seconds to start on a loaded machine
    assert 0.5 < res["reloads_during_load"][0]["at_s"] <= 5
    assert "Response time percentiles" in r.stderr  # locust's own tables
