"""The Ray Serve endpoint (adaflash_ray.serve), end to end through real HTTP on 127.0.0.1.

One server process (``python -m adaflash_ray.serve``: local Ray, the real SmolLM2-135M, cpu_tiny limits,
live distillation on, an API key) serves every test of this module; the last test drains it with SIGTERM.
Clients: the official ``openai`` package (plain and streaming) and raw HTTP (``requests`` / sockets) for the
error cases, the disconnect case, the 429 case and hot reloads under traffic. Unit tests of the wire protocol
(incremental detokenisation, stop strings, validation) run without a server.

Run: python -m pytest -q tests/test_serve.py     (~2-3 min on 2 CPU cores)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from adaflash_ray.serve.protocol import APIError, TextStream, parse_request  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"
HDR = {"Authorization": f"Bearer {KEY}"}
MAX_BATCH, MAX_QUEUED = 4, 4


@pytest.fixture(scope="session")
def tok():
    from adaflash_ray.data import MissingDataPackageError, ensure_target, load_tokenizer

    try:
        return load_tokenizer(ensure_target(MODEL))
    except MissingDataPackageError as e:
        pytest.skip(f"real target unavailable: {e}")


# ------------------------------------------------------------------------------------ protocol (no server)
def test_text_stream_never_splits_utf8_and_matches_full_decode(tok):
    text = "héllo 😀 中文 ok 🎉🎉 done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(len(ids))), "the case must contain split chars"
    ts = TextStream(tok)
    deltas = [ts.add(i) for i in ids] + [ts.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    assert ts.num_tokens == len(ids)


def test_text_stream_stop_string_inside_a_multi_token_step(tok):
    ids = tok.encode("one two three four five six")
    ts = TextStream(tok, stop=[" four"])
    out = ""
    for t in ids:  # the engine loop feeds a step's tokens one by one and stops at the hit
        out += ts.add(t)
        if ts.stopped:
            break
    out += ts.finish()
    assert out == "one two three" and ts.stopped
    assert ts.num_tokens == len(tok.encode("one two three four"))  # tokens after the stop are not counted
    assert ts.stop_hit == " four" and ts.last_id == ids[ts.num_tokens - 1]
    ts2 = TextStream(tok, stop=["zzz"])  # a suffix that might start a stop string is held back, then released
    assert "".join(ts2.add(t) for t in tok.encode("abc zz")) + ts2.finish() == "abc zz" and ts2.stop_hit is None
    # include_stop_str_in_output: the stop string stays; of two stops at the same place the longer one
    ts3 = TextStream(tok, stop=[" fo", " four"], include_stop=True)
    out = "".join(ts3.add(t) for t in ids) + ts3.finish()
    assert out == "one two three four" and ts3.stop_hit == " four"


def test_parse_request_names_the_field(tok):
    kw = dict(tokenizer=tok, model_ids={MODEL}, context_limit=64, default_max_tokens=16, default_temperature=0.0,
              vocab_size=49152, record_default=True)
    cases = [(("n", 400), {"n": 0}), (("logprobs", 400), {"logprobs": 21}),
             (("temperature", 400), {"temperature": 2.5}), (("top_p", 400), {"top_p": 0}),
             (("seed", 400), {"seed": 2 ** 64, "temperature": 0.7}), (("max_tokens", 400), {"max_tokens": 0}),
             (("max_tokens", 400), {"max_tokens": "5"}), (("max_tokens", 400), {"max_tokens": True}),
             (("stream", 400), {"stream": "yes"}), (("temperature", 400), {"temperature": "0"}),
             (("stream_options", 400), {"stream_options": {"include_usage": True}}),
             (("model", 404), {"model": "gpt-4"}), (("stop", 400), {"stop": [""]}),
             (("stop_token_ids", 400), {"stop_token_ids": [10 ** 6]})]
    for (param, status), extra in cases:
        with pytest.raises(APIError) as e:
            parse_request("completion", {"model": MODEL, "prompt": "hi", **extra}, **kw)
        assert (e.value.param, e.value.status) == (param, status), (extra, e.value.message)
        assert param in e.value.message or param == "model"
    for part, param in (({"type": "image", "text": "x"}, "messages.0.content.0.type"),
                        ({"type": "text", "text": 3}, "messages.0.content.0.text")):
        with pytest.raises(APIError) as e:  # the failing part is named, not "content should be a string"
            parse_request("chat", {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}, **kw)
        assert (e.value.param, e.value.status) == (param, 400) and param in e.value.message, e.value.message
    with pytest.raises(APIError) as e:
        parse_request("completion", {"model": MODEL, "prompt": "hi " * 80}, **kw)
    assert e.value.code == "context_length_exceeded" and "64" in e.value.message
    with pytest.raises(APIError) as e:
        parse_request("completion", {"model": MODEL, "prompt": "hi", "max_tokens": 64}, **kw)
    assert e.value.param == "max_tokens" and "64" in e.value.message
    spec = parse_request("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 5,
                                  "stop": ["x", 7], "max_completion_tokens": 8, "store": False}, **kw)
    assert (spec.seed, spec.stop, spec.stop_token_ids, spec.max_tokens, spec.record) == (5, ["x"], [7], 8, False)
    want = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert spec.prompt_ids == list(want) and tok.decode(want).endswith("<|im_start|>assistant\n")


def test_token_ids_out_of_range_are_invalid_value(tok):
    """Token ids outside the vocabulary (``stop_token_ids``, a stop id in ``stop``, a prompt of ids) are a 400 with
    code ``invalid_value``, as every other out-of-range request value."""
    kw = dict(tokenizer=tok, model_ids={MODEL}, context_limit=64, default_max_tokens=16, default_temperature=0.0,
              vocab_size=49152, record_default=True)
    for extra, param in (({"stop_token_ids": [10 ** 6]}, "stop_token_ids"),
                         ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop": ["x", 49152]}, "stop_token_ids"),
                         ({"prompt": [3, 49152]}, "prompt"), ({"prompt": [[3], [-2]]}, "prompt.1")):
        with pytest.raises(APIError) as e:
            parse_request("completion", {"model": MODEL, "prompt": "hi", **extra}, **kw)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value"), (extra, e.value.message)
        assert e.value.body()["error"]["code"] == "invalid_value"


def test_every_client_error_has_a_machine_readable_code(tok):
    """Every 4xx a bad request gets carries a non-null OpenAI ``code`` beside the ``param`` it names:
    ``invalid_value`` for a value out of range, of the wrong form or in conflict with another field,
    ``unsupported_parameter`` for a request key the endpoint does not implement, ``missing_required_parameter``,
    ``model_not_found`` for the 404 unknown model; also an engine's refusal of a request that passed validation."""
    import asyncio
    import functools
    from types import SimpleNamespace

    from adaflash_ray.serve.responses import ResponseWriter
    from adaflash_ray.serve.runtime import RequestStream

    kw = dict(tokenizer=tok, model_ids={MODEL}, context_limit=64, default_max_tokens=16, default_temperature=0.0,
              vocab_size=49152, record_default=True, max_n=4)
    # a chat template that raises on one of its variables (jinja's raise_exception)
    strict = SimpleNamespace(apply_chat_template=functools.partial(
        tok.apply_chat_template, chat_template="{% if strict %}{{ raise_exception('strict mode') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    comp, chat = {"model": MODEL, "prompt": "hi"}, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    tool = [{"type": "function", "function": {"name": "f"}}]
    cases = [  # (kind, body, status, param, code)
        ("completion", {**comp, "stop": [str(i) for i in range(17)]}, 400, "stop", "invalid_value"),
        ("completion", {**comp, "stop": [""]}, 400, "stop", "invalid_value"),
        ("completion", {**comp, "stop": ""}, 400, "stop", "invalid_value"),
        ("completion", {**comp, "n": 5}, 400, "n", "invalid_value"),
        ("completion", {**comp, "n": 0}, 400, "n", "invalid_value"),
        ("completion", {**comp, "prompt": ""}, 400, "prompt", "invalid_value"),
        ("completion", {**comp, "prompt": []}, 400, "prompt", "invalid_value"),
        ("completion", {**comp, "prompt": ["hi", ""]}, 400, "prompt.1", "invalid_value"),
        ("completion", {**comp, "prompt": ["a", "b", "c"], "n": 2}, 400, "prompt", "invalid_value"),
        ("completion", {**comp, "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
        ("completion", {**comp, "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
        ("completion", {**comp, "echo": True}, 400, "echo", "unsupported_parameter"),
        ("completion", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
        ("completion", {**comp, "model": "gpt-4"}, 404, "model", "model_not_found"),
        ("chat", {**chat, "max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens",
         "invalid_value"),
        ("chat", {**chat, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
        ("chat", {**chat, "stream": False, "stream_options": {}}, 400, "stream_options", "invalid_value"),
        ("chat", {**chat, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs", "invalid_value"),
        ("chat", {**chat, "chat_template_kwargs": {"strict": True}}, 400, "chat_template_kwargs", "invalid_value"),
        ("chat", {**chat, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs.tokenize",
         "unsupported_parameter"),
        ("chat", {**chat, "tools": tool}, 400, "tools", "unsupported_parameter"),
        ("chat", {**chat, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, 400,
         "messages.0.tool_calls", "unsupported_parameter"),
        ("chat", {**chat, "messages": []}, 400, "messages", "invalid_value"),
        ("chat", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ]
    for kind, body, status, param, code in cases:
        with pytest.raises(APIError) as e:
            parse_request(kind, body, **{**kw, "tokenizer": strict} if "chat_template_kwargs" in body else kw)
        got = (e.value.status, e.value.param, e.value.code)
        assert got == (status, param, code), (kind, body, got, e.value.message)
        assert e.value.body()["error"]["code"] == code
    # a request the engine refuses after validation (its add_request's ValueError): a 400 invalid_value too
    spec = parse_request("completion", comp, **kw)

    async def refused():
        rs = RequestStream(False)
        rs.queue.put_nowait(("error", ValueError("empty prompt")))
        rs.queue.put_nowait(("done", "error"))
        loop = SimpleNamespace(abort=lambda rs, reason="aborted": None)
        with pytest.raises(APIError) as e:
            await ResponseWriter(spec, [rs], loop=loop, tokenizer=tok, eos_ids=[2]).body()
        return e.value

    err = asyncio.run(refused())
    assert (err.status, err.param, err.code) == (400, "prompt", "invalid_value"), err.message


def test_context_length_error_names_the_batch_prompt(tok):
    """A batch of prompts with one over the context limit: the 400 names that prompt by its index (``prompt.1``, as
    the other per-prompt errors do), in ``param`` and in the message; a single prompt stays ``prompt``."""
    kw = dict(tokenizer=tok, model_ids={MODEL}, context_limit=64, default_max_tokens=16, default_temperature=0.0,
              vocab_size=49152, record_default=True)
    with pytest.raises(APIError) as e:
        parse_request("completion", {"model": MODEL, "prompt": ["hi", "hi " * 80, "yo"]}, **kw)
    assert (e.value.status, e.value.param, e.value.code) == (400, "prompt.1", "context_length_exceeded")
    assert "index 1" in e.value.message and "'prompt.1'" in e.value.message, e.value.message
    with pytest.raises(APIError) as e:  # fits alone, not with max_tokens: the budget is at fault, the prompt named
        parse_request("completion", {"model": MODEL, "prompt": [[5] * 10, [5] * 40], "max_tokens": 30}, **kw)
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    assert "index 1" in e.value.message, e.value.message
    with pytest.raises(APIError) as e:
        parse_request("completion", {"model": MODEL, "prompt": "hi " * 80}, **kw)
    assert e.value.param == "prompt" and "index" not in e.value.message


def test_text_with_a_lone_surrogate_is_a_400_naming_the_field(tok):
    """A JSON ``"\\ud800"`` escape decodes to a lone UTF-16 surrogate, which no tokenizer encodes: every text field
    of the request refuses it with a 400 naming the field (an element of a batch or of ``stop`` by its index), and the
    error body itself still encodes as UTF-8; a valid astral character (an escaped surrogate pair) is text."""
    kw = dict(tokenizer=tok, model_ids={MODEL}, context_limit=64, default_max_tokens=16, default_temperature=0.0,
              vocab_size=49152, record_default=True)
    comp, chat = {"model": MODEL, "prompt": "hi"}, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [("completion", {**comp, "prompt": "\ud800", "max_tokens": 2}, "prompt"),
             ("completion", {**comp, "prompt": ["ok", "\ud800"]}, "prompt.1"),
             ("completion", {**comp, "stop": "\udfff"}, "stop"),
             ("completion", {**comp, "stop": ["x", "a\ud800"]}, "stop.1"),
             ("completion", {**comp, "user": "\ud800"}, "user"),
             ("chat", {**chat, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
             ("chat", {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
              "messages.0.content.0.text"),
             ("chat", {**chat, "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages.0.name")]
    for kind, body, param in cases:
        with pytest.raises(APIError) as e:
            parse_request(kind, json.loads(json.dumps(body)), **kw)  # through JSON: "\ud800" escapes, as sent
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value"), (body, e.value.message)
        assert f"'{param}'" in e.value.message and "lone surrogate" in e.value.message
        json.dumps(e.value.body(), ensure_ascii=False).encode("utf-8")  # the response renders (no surrogate left)
    with pytest.raises(APIError) as e:  # a refused parameter quoting the text: escaped in the body
        parse_request("completion", {**comp, "suffix": "\ud800"}, **kw)
    assert e.value.param == "suffix" and "\\ud800" in e.value.body()["error"]["message"]
    spec = parse_request("completion", json.loads('{"model": "%s", "prompt": "\\ud83d\\ude00 ok"}' % MODEL), **kw)
    assert spec.prompt_ids == tok.encode("\U0001F600 ok", add_special_tokens=False)


class _Request:
    """The part of a Starlette request the replica's handlers read: a JSON body, sent in one chunk."""

    headers = {"content-type": "application/json"}

    def __init__(self, data: bytes):
        self.data = data

    async def stream(self):
        yield self.data


def test_too_deeply_nested_body_is_invalid_json():
    """A body nesting arrays deeper than json.loads recurses (RecursionError) is a 400 invalid_json, as a body that
    is not JSON at all; a body within the limit decodes."""
    import asyncio
    from types import SimpleNamespace

    from adaflash_ray.serve.app import AdaFlashServer

    server = SimpleNamespace(cfg=SimpleNamespace(serve=SimpleNamespace(max_body_bytes=1 << 20)))
    body = AdaFlashServer.func_or_class._body
    for data in (b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, b"{not json"):
        with pytest.raises(APIError) as e:
            asyncio.run(body(server, _Request(data)))
        assert (e.value.status, e.value.code) == (400, "invalid_json"), e.value.message
    assert asyncio.run(body(server, _Request(b'{"prompt": [[[1]]]}'))) == {"prompt": [[[1]]]}


def test_request_timeout_aborts_the_request_of_a_hung_engine_and_answers_504(tok):
    """``serve.request_timeout_s``: through the replica's own handlers, on an engine stuck inside its step, a plain
    request is answered 504 ``timeout`` (OpenAI error JSON) and a stream already started ends with that error event
    and ``[DONE]``, each at its own deadline, measured from its own submission; once the step returns, both requests
    are aborted in the engine (counted "timeout") and the replica serves the next request."""
    import asyncio
    import types
    from types import SimpleNamespace

    from adaflash_ray.config import load_recipe
    from adaflash_ray.engine import SpecEngine
    from adaflash_ray.serve.app import AdaFlashServer, _api_error
    from adaflash_ray.serve.runtime import EngineLoop
    from conftest import make_drafter, make_tiny_target

    timeout = 0.5
    target = make_tiny_target(vocab_size=len(tok))  # a tiny random model that takes the tokenizer's ids
    drafter, head = make_drafter(target, block_size=4)
    engine = SpecEngine(target, drafter, head, max_batch_size=2, max_seq_len=128)
    gate, aborted = threading.Event(), []
    real_step, real_abort = engine.step, engine.abort

    def hung_step(mode="spec"):  # stuck until the test lets it go
        gate.wait(30)
        return real_step(mode)

    def abort(req):
        aborted.append(req.request_id)
        return real_abort(req)

    engine.step, engine.abort = hung_step, abort
    cfg = load_recipe("recipes/cpu_tiny.yaml", [f"serve.request_timeout_s={timeout}"])
    srv = SimpleNamespace(cfg=cfg, api_key=None, draining=False, buffer=None, engine=engine, tokenizer=tok,
                          model_id=MODEL, context_limit=100, vocab_size=len(tok), eos_ids=[])
    for name in ("_auth", "_body", "_retry", "_spec", "_submit", "_generate"):
        setattr(srv, name, types.MethodType(getattr(AdaFlashServer.func_or_class, name), srv))
    comp = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}

    async def plain():
        t0 = time.perf_counter()
        with pytest.raises(APIError) as e:
            await srv._generate("completion", _Request(json.dumps(comp).encode()))
        return await _api_error(None, e.value), time.perf_counter() - t0

    async def streamed():
        await asyncio.sleep(0.3)  # its deadline is its own, not the first request's
        t0 = time.perf_counter()
        resp = await srv._generate("chat", _Request(json.dumps(chat).encode()))
        return [c async for c in resp.body_iterator], time.perf_counter() - t0

    async def main():
        srv.loop = EngineLoop(engine, asyncio.get_running_loop(), max_batch_size=2, max_waiting=2)
        try:
            # without a timeout both would wait as long as the engine hangs: fail after a few seconds instead
            (resp, t_plain), (chunks, t_stream) = await asyncio.wait_for(asyncio.gather(plain(), streamed()),
                                                                         timeout + 5)
            assert not aborted  # the step has not returned: nothing reached the engine yet
            gate.set()
            for _ in range(200):
                if srv.loop.num_in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            after = await srv._generate("completion", _Request(json.dumps({**comp, "max_tokens": 4}).encode()))
            return resp, t_plain, chunks, t_stream, after, dict(srv.loop.counts)
        finally:
            gate.set()
            srv.loop.shutdown()

    resp, t_plain, chunks, t_stream, after, counts = asyncio.run(main())
    err = json.loads(resp.body)["error"]
    assert resp.status_code == 504 and set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == "timeout" and "serve.request_timeout_s" in err["message"], err
    assert timeout - 0.01 <= t_plain < timeout + 3 and timeout - 0.01 <= t_stream < timeout + 3, (t_plain, t_stream)
    assert chunks[-1] == "data: [DONE]\n\n" and json.loads(chunks[0][6:])["choices"][0]["delta"]["role"]
    assert json.loads(chunks[-2][6:])["error"]["code"] == "timeout", chunks
    assert len(aborted) == 2 and counts["timeout"] == 2, (aborted, counts)
    body = json.loads(after.body)
    assert after.status_code == 200 and body["usage"]["completion_tokens"] == 4, body


def test_unknown_fields_are_ignored_known_unsupported_refused(tok, caplog):
    """Fields this endpoint does not know, at any depth, are ignored with a logged warning (vLLM's behaviour), so
    a vLLM client's extensions at their defaults pass; known parameters it cannot honour are still a 400 naming
    the field, never dropped: tools, response_format other than text, best_of, prompt logprobs, tool calls in
    the history (the implemented sampling fields: tests/test_serve_params.py)."""
    import logging

    kw = dict(tokenizer=tok, model_ids={MODEL}, context_limit=64, default_max_tokens=16, default_temperature=0.0,
              vocab_size=49152, record_default=True)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "x_msg": 1}]}
    vllm_defaults = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": False, "min_tokens": 0,
                     "skip_special_tokens": True, "response_format": {"type": "text"}, "tools": [],
                     "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    serve_log = logging.getLogger("ray.serve")  # Ray Serve's logger does not propagate to the root: listen on it
    serve_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="ray.serve"):
            spec = parse_request("chat", {**chat, **vllm_defaults, "foo": 1, "request_id": "abc",
                                          "stream_options": {"include_usage": True, "bar": 2}}, **kw)
    finally:
        serve_log.removeHandler(caplog.handler)
    assert spec.ignored == ["foo", "request_id", "stream_options.bar", "messages.0.x_msg"]
    assert spec.include_usage and spec.prompt_ids == parse_request("chat", chat, **kw).prompt_ids
    assert "foo" in caplog.text and "messages.0.x_msg" in caplog.text
    spec = parse_request("completion", {"model": MODEL, "prompt": "hi", "foo": {"nested": 1}}, **kw)
    assert spec.ignored == ["foo"] and not spec.continuous_usage
    spec = parse_request("chat", {**chat, "stream": True, "stream_options": {"continuous_usage_stats": True}}, **kw)
    assert spec.continuous_usage and not spec.include_usage  # implemented: usage so far in every chunk
    refused = [("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
               ("response_format", {"response_format": {"type": "json_object"}}),
               ("best_of", {"best_of": True}),  # JSON true is not the number 1
               ("prompt_logprobs", {"prompt_logprobs": 0}),  # 0 asks for the prompt tokens' own logprobs
               ("messages.0.tool_calls", {"messages": [{"role": "assistant", "content": "",
                                                        "tool_calls": [{"id": "1"}]}]})]
    for param, extra in refused:
        with pytest.raises(APIError) as e:
            parse_request("chat", {**chat, **extra}, **kw)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "unsupported_parameter"), extra
        assert param in e.value.message


def test_served_model_id_and_serve_config_checks():
    """The served id: serve.model_name, else the registry name, else the model directory's name; Serve refuses a
    CUDA recipe whose replicas reserve no GPU and the sglang backend, naming the field."""
    from adaflash_ray.config import RecipeError, check_serve_config, load_recipe
    from adaflash_ray.serve.protocol import served_model_id

    tiny = load_recipe("recipes/cpu_tiny.yaml")
    assert served_model_id(tiny.model, tiny.serve) == MODEL
    q = load_recipe("recipes/qwen3_8b.yaml")
    assert served_model_id(q.model, q.serve) == "Qwen3-8B"  # model.path /models/Qwen3-8B, not smollm2's name
    q2 = load_recipe("recipes/qwen3_8b.yaml", ["model.path=/m/Qwen3-8B/", "serve.model_name=qwen"])
    assert served_model_id(q2.model, q2.serve) == "qwen"
    assert served_model_id(load_recipe("recipes/qwen3_8b.yaml", ["model.path=/m/x/"]).model, q.serve) == "x"
    check_serve_config(tiny)
    check_serve_config(q)  # the recipe reserves one GPU per replica
    with pytest.raises(RecipeError, match="serve.gpus_per_replica"):
        check_serve_config(load_recipe("recipes/qwen3_8b.yaml", ["serve.gpus_per_replica=0"]))
    with pytest.raises(RecipeError, match="engine.backend"):
        check_serve_config(load_recipe("recipes/qwen3_coder_30b_a3b.yaml", ["serve.gpus_per_replica=1"]))
    from adaflash_ray.serve import app

    with pytest.raises(RecipeError, match="engine.backend"):  # the Serve app builder refuses it too
        app({"recipe": "recipes/qwen3_coder_30b_a3b.yaml", "set": ["serve.gpus_per_replica=1"]})


def test_check_health_and_health_fail_once_the_engine_stalls_or_died():
    """Serve's replica health check and ``/health`` on a real EngineLoop (tiny random engine, no Ray) with
    ``serve.engine_stall_timeout_s`` 0.5: healthy while idle however long; a step that hangs with a request in
    flight is healthy under the timeout, past it check_health raises naming the stall and /health answers 503 with
    the OpenAI error body - never with the watchdog off (None); healthy again once the step returns; a step that
    raises fails both for good, naming the engine's exception."""
    import asyncio
    from types import MethodType, SimpleNamespace

    from adaflash_ray.engine import SamplingParams, SpecEngine
    from adaflash_ray.serve.app import AdaFlashServer
    from adaflash_ray.serve.runtime import EngineLoop
    from conftest import make_drafter, make_tiny_target

    target = make_tiny_target()
    drafter, head = make_drafter(target, block_size=4)
    engine = SpecEngine(target, drafter, head, max_batch_size=2, max_seq_len=128)
    entered, gate, mode = threading.Event(), threading.Event(), {"hang": True, "fail": False}
    real_step = engine.step

    def step(m="spec"):
        entered.set()
        if mode["hang"]:  # stuck until the test lets it go
            gate.wait(30)
        if mode["fail"]:
            raise RuntimeError("CUDA error: boom")
        return real_step(m)

    engine.step = step
    cls = AdaFlashServer.func_or_class
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)]

    async def health(srv) -> tuple[int, dict]:
        resp = await MethodType(cls.health, srv)()
        return resp.status_code, json.loads(resp.body)

    async def main():
        lp = EngineLoop(engine, asyncio.get_running_loop(), max_batch_size=2, max_waiting=2, stall_timeout_s=0.5)
        srv = SimpleNamespace(loop=lp, draining=False, replica="r0")
        check = MethodType(cls.check_health, srv)
        try:
            await asyncio.sleep(0.6)
            check()  # idle past the timeout: not a stall
            assert lp.health_error(time.monotonic() + 1e3) is None
            assert await health(srv) == (200, {"status": "ok", "replica": "r0"})
            [rs] = lp.submit([[1, 2, 3]], params, record=False)
            assert await asyncio.to_thread(entered.wait, 30)
            mark = lp.service.busy_since  # the hung step began here
            assert lp.health_error(mark + 0.4) is None  # a step under the timeout is fine
            assert lp.health_error(mark + 0.6) == ("engine step has not returned for 0.6 s with 1 requests in flight "
                                                   "(serve.engine_stall_timeout_s = 0.5 s)")
            await asyncio.sleep(0.6)
            with pytest.raises(RuntimeError, match=r"engine step has not returned for \d+\.\d s with 1 requests"):
                check()
            status, body = await health(srv)
            assert status == 503 and set(body["error"]) == {"message", "type", "param", "code"}, body
            assert body["error"]["type"] == "server_error"
            assert body["error"]["message"].startswith("engine step has not returned for "), body
            lp.stall_timeout_s = None  # the watchdog off: the same hang is not reported
            check()
            assert lp.health_error(mark + 1e3) is None and (await health(srv))[0] == 200
            lp.stall_timeout_s = 0.5
            mode["hang"] = False
            gate.set()
            items = [await asyncio.wait_for(rs.queue.get(), 30)]
            while items[-1][0] != "done":
                items.append(await asyncio.wait_for(rs.queue.get(), 30))
            assert items[-1] == ("done", "length") and sum(len(i[1]) for i in items[:-1]) == 8, items
            check()  # the step returned: healthy again
            assert lp.health_error(time.monotonic() + 1e3) is None and (await health(srv))[0] == 200
            mode["fail"] = True
            lp.submit([[4, 5]], params, record=False)
            for _ in range(600):
                if lp.dead is not None:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(RuntimeError, match=r"engine thread died: .*CUDA error: boom"):
                check()
            status, body = await health(srv)
            assert status == 503 and "CUDA error: boom" in body["error"]["message"], body
        finally:
            gate.set()
            lp.shutdown()

    asyncio.run(main())


def test_app_builder_args_and_bad_recipe_exit_code():
    """``serve run adaflash_ray.serve:app recipe=... set='a=1;b=2'`` / a Serve config's ``args`` build the app;
    a bad argument or override is refused naming it, and the command exits 2 before Ray starts."""
    from adaflash_ray.config import RecipeError
    from adaflash_ray.serve import app

    built = app({"recipe": "recipes/cpu_tiny.yaml", "set": "serve.num_replicas=2;serve.max_queued_requests=3"})
    cfg = built._bound_deployment.init_args[0]
    assert cfg["serve"]["num_replicas"] == 2 and cfg["serve"]["max_queued_requests"] == 3
    assert built._bound_deployment._deployment_config.num_replicas == 2
    # health checks every 10 s, or twice per serve.engine_stall_timeout_s when that is shorter (at least every 1 s)
    for stall, period in (([], 10.0), (["serve.engine_stall_timeout_s=100"], 10.0),
                          (["serve.engine_stall_timeout_s=5"], 2.5), (["serve.engine_stall_timeout_s=0.5"], 1.0)):
        dc = app({"set": stall})._bound_deployment._deployment_config
        assert (dc.health_check_period_s, dc.health_check_timeout_s) == (period, 60), stall
    assert app({"set": ["serve.distill=true"]})._bound_deployment.init_args[1] is not None  # the coordinator
    with pytest.raises(ValueError, match="bogus"):
        app({"bogus": "1"})
    with pytest.raises(RecipeError, match="serve.max_body_bytes"):
        app({"set": "serve.max_body_bytes=10"})
    r = subprocess.run([sys.executable, "-m", "adaflash_ray.serve", "--set", "serve.port=99999"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "serve.port" in r.stderr and not r.stdout


@pytest.mark.parametrize("override,needle", [("drafter.init_path={ckpt}", "bad config.json"),
                                             ("drafter.init_path={ckpt}/missing", "config.json not found"),
                                             ("model.name=no-such-model", "unknown target 'no-such-model'")])
def test_bad_drafter_checkpoint_or_target_exits_2_before_ray(tmp_path, override, needle):
    """A corrupt / missing ``drafter.init_path`` or an unknown target is refused naming it, exit 2 before Ray starts,
    not a replica constructor failing through Serve's retries and an exit 1 that names no cause."""
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "adaflash_ray.serve", "--recipe", "recipes/cpu_tiny.yaml",
                        "--set", override.format(ckpt=tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and needle in r.stderr and not r.stdout, r.stderr[-2000:]
    assert "Started a local Ray" not in r.stderr and time.monotonic() - t0 < 60


def test_a_port_another_server_listens_on_exits_2():
    """Serve's proxy binds with SO_REUSEPORT: beside another Serve proxy (here a listener with the same option) it
    started and printed "serving", the kernel splitting the connections between the two servers. Refused up front."""
    port = _free_port()
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", port))
    other.listen()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "adaflash_ray.serve", "--recipe", "recipes/cpu_tiny.yaml",
                             "--port", str(port), "--set", "ray.include_dashboard=false"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # it started serving on the shared port: stop it
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        pytest.fail(f"started on a port in use: {out!r}")
    finally:
        other.close()
    assert proc.returncode == 2 and f"serve.port: 127.0.0.1:{port}" in err and "in use" in err and not out, err[-2000:]


# ------------------------------------------------------------------------------------ persisted learning
def _start_server(args: list[str], port: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in ("RAY_ADDRESS", "ADAFLASH_API_KEY"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-m", "adaflash_ray.serve", "--port", str(port),
                             "--set", "ray.include_dashboard=false", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = proc.stdout.readline()
    if proc.poll() is not None or "http://" not in first:
        proc.kill()
        pytest.fail(f"server did not start: {first!r}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, first.strip().rsplit(" ", 1)[-1]


def _stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.mark.slow
def test_live_distillation_persists_and_resumes_the_learned_version(tmp_path):
    """A Serve run with live distillation writes its run directory (config.yaml without the API key,
    checkpoints/v0..vN, trainer state, metrics.jsonl with train records); stopped (SIGTERM) and started again with
    ``--resume RUN_DIR`` it serves version N from the first request (header and status route), without training
    further. The same directory without --resume, or a --resume of a non-run, is refused (exit 2)."""
    run_dir = tmp_path / "serve_run"
    n = 1  # one version learned live: what persisting and resuming need
    proc, url = _start_server(["--recipe", "recipes/cpu_tiny.yaml", "--set", "serve.distill=true",
                               "--set", f"serve.run_dir={run_dir}", "--set", f"distill.num_versions={n}",
                               "--set", "serve.api_key=secret-1", "--set", "logging.wandb_mode=disabled"], _free_port())
    hdr = {"Authorization": "Bearer secret-1"}
    try:
        stop = threading.Event()
        errors: list[str] = []

        def traffic(i: int) -> None:
            k = 0
            while not stop.is_set():
                k += 1
                r = requests.post(url + "/v1/completions", headers=hdr, timeout=120,
                                  json={"model": MODEL, "prompt": f"Story {i}-{k}: once upon a time", "max_tokens": 16,
                                        "temperature": 0})
                if r.status_code != 200:
                    errors.append(r.text[:300])

        threads = [threading.Thread(target=traffic, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + 600
        while time.time() < deadline:
            st = requests.get(url + "/v1/adaflash/status", headers=hdr, timeout=60).json()["distill"]
            if st["training_done"] and n in st["saved_versions"]:
                break
            assert st["trainer_error"] is None, st
            time.sleep(2)
        stop.set()
        for t in threads:
            t.join(180)
        assert st["training_done"] and st["saved_versions"] == list(range(n + 1)), st
        assert not st["resumed"] and st["run_dir"] == str(run_dir.resolve())
        assert not errors, errors[:3]
    finally:
        assert _stop_server(proc) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"v{v}" for v in range(n + 1)]
    assert (run_dir / "trainer_state" / "latest").is_file()
    kinds = [json.loads(line).get("kind") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"train", "buffer", "sync"} <= set(kinds), set(kinds)
    saved = (run_dir / "config.yaml").read_text()
    assert "secret-1" not in saved and str(run_dir.resolve()) in saved

    r = subprocess.run([sys.executable, "-m", "adaflash_ray.serve", "--recipe", "recipes/cpu_tiny.yaml",
                        "--set", "serve.distill=true", "--set", f"serve.run_dir={run_dir}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--resume" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "adaflash_ray.serve", "--resume", str(tmp_path / "nothing")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a live-distillation run directory" in r.stderr, r.stderr

    proc, url = _start_server(["--resume", str(run_dir)], _free_port())  # no API key: it was never saved
    try:
        r = requests.post(url + "/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert r.status_code == 200 and r.headers["x-adaflash-drafter-version"] == str(n), (r.status_code, r.text)
        assert r.json()["adaflash"]["drafter_versions"] == [n]
        st = requests.get(url + "/v1/adaflash/status", timeout=60).json()
        assert st["drafter_version"] == n
        assert st["distill"]["resumed"] and st["distill"]["start_version"] == n and st["distill"]["latest_version"] == n
    finally:
        assert _stop_server(proc) == 0


# ------------------------------------------------------------------------------------ the live server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tok, tmp_path_factory):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the command's own loopback default is what is tested
    env.pop("ADAFLASH_API_KEY", None)
    cmd = [sys.executable, "-m", "adaflash_ray.serve", "--recipe", "recipes/cpu_tiny.yaml", "--port", str(port),
           "--set", "serve.distill=true", "--set", f"serve.api_key={KEY}", "--set", "ray.include_dashboard=false",
           "--set", f"engine.max_batch_size={MAX_BATCH}", "--set", f"serve.max_queued_requests={MAX_QUEUED}",
           "--set", "serve.max_body_bytes=4096", "--set", "distill.num_versions=3",
           "--set", "serve.drain_timeout_s=120", "--set", f"serve.run_dir={tmp_path_factory.mktemp('serve_run')}",
           "--set", "logging.wandb_mode=disabled"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = proc.stdout.readline()  # the one "ready" line (blocks until the app answers)
    if proc.poll() is not None or "http://" not in first:
        proc.kill()
        pytest.fail(f"server did not start: {first!r}")
    url = first.strip().rsplit(" ", 1)[-1]
    assert url == f"http://127.0.0.1:{port}"
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    yield {"url": url, "proc": proc}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _status(server) -> dict:
    return requests.get(server["url"] + "/v1/adaflash/status", headers=HDR, timeout=30).json()


def test_only_loopback_listeners(server):
    import psutil

    root = psutil.Process(server["proc"].pid)
    procs = [root] + root.children(recursive=True)
    listen = []
    for p in procs:
        try:
            listen += [c.laddr for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    assert listen, "the server's process tree should listen somewhere"
    bad = [a for a in listen if a.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not bad, f"listening beyond loopback: {bad}"
    assert any(a.port == int(server["url"].rsplit(":", 1)[1]) for a in listen)


def test_live_distillation_hot_reloads_under_traffic_without_failures(server, client):
    """Served requests become trajectories; the trainer publishes versions 1..3 and the replica loads
    each between engine steps while requests are in flight; every request succeeds and names its version."""
    results, errors = [], []
    stop = threading.Event()

    def worker(i):
        n = 0
        while not stop.is_set():
            try:
                r = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Tell me fact number {i}-{n} about space."}],
                    max_tokens=24, temperature=0)
                body = r.parse()
                results.append((int(r.headers["x-adaflash-drafter-version"]),
                                body.model_extra["adaflash"]["drafter_versions"]))
            except Exception as e:  # any failure fails the test
                errors.append(repr(e))
            n += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(MAX_BATCH)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 150 and _status(server)["drafter_version"] < 3:
        time.sleep(1)
    stop.set()
    for t in threads:
        t.join(120)
    st = _status(server)
    assert not errors, errors[:3]
    assert st["drafter_version"] == 3 and st["distill"]["latest_version"] == 3, st["distill"]
    loaded = [r["version"] for r in st["reloads"]]
    assert loaded == [1, 2, 3] and st["weight_error"] is None
    assert any(r["num_in_flight"] > 0 for r in st["reloads"]), st["reloads"]  # reloaded mid-traffic
    assert st["distill"]["num_trajectories_sent"] >= 4 and st["distill"]["buffer"]["buffer/added"] >= 4
    seen = {v for _, vs in results for v in vs}
    assert len(results) >= 8 and len(seen) >= 2, results  # responses name the versions that served them
    assert all(h == vs[-1] for h, vs in results)


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(server["url"] + "/health", timeout=30).json()["status"] == "ok"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers,
                          timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"] + "/v1", api_key="nope", max_retries=0).models.list()


def test_retrieve_model_route(server, client):
    """``GET /v1/models/{id}`` (the openai client's models.retrieve): the card, or 404 model_not_found."""
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    r = requests.get(server["url"] + "/v1/models/gpt-4", headers=HDR, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert requests.get(server["url"] + f"/v1/models/{MODEL}", timeout=30).status_code == 401
    r = requests.post(server["url"] + "/v1/chat/completions", headers=HDR, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "temperature": 0, "ignore_eos": False, "top_k": -1, "vllm_unknown_extension": 1})
    assert r.status_code == 200, r.text  # a vLLM client's extra fields at their defaults are served


def test_openai_client_plain_and_streaming_agree(client):
    msgs = [{"role": "user", "content": "Explain photosynthesis in two sentences."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, seed=7)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length") and text
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    scomp = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0, stream=True))
    assert scomp == comp.choices[0].text and comp.usage.completion_tokens == 10


def test_completions_batch_of_prompts(client, tok):
    """vLLM's batch on /v1/completions (``prompt`` a list of strings or of id lists): choice ``i * n + j`` is prompt
    i's j-th, each the same as that prompt alone; usage counts each prompt once."""
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    for batch in (prompts, [tok.encode(p, add_special_tokens=False) for p in prompts]):
        r = client.completions.create(model=MODEL, prompt=batch, max_tokens=6, temperature=0, n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == [a.choices[0].text for a in alone for _ in range(2)]
        assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == [a.choices[0].text for a in alone]


def test_stop_strings_and_token_ids(client, tok):
    msgs = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
    base = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    text, n = base.choices[0].message.content, base.usage.completion_tokens
    words = text.split()
    stop = " " + words[len(words) // 2]
    assert stop in text
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, stop=[stop],
                                           stream=stream, **({"stream_options": {"include_usage": True}}
                                                             if stream else {}))
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
            used = chunks[-1].usage.completion_tokens
            why = [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            got, reason, used = r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
            why = [r.choices[0].model_extra["stop_reason"]]
        assert got == text[: text.index(stop)] and reason == "stop" and why == [stop]  # vLLM's stop_reason
        assert used == len(tok.encode(text[: text.index(stop) + len(stop)])) < n  # the completing token counts
        # vLLM's include_stop_str_in_output: the same stop, its string kept in the text
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, stop=[stop],
                                           stream=stream, extra_body={"include_stop_str_in_output": True})
        got = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else \
            r.choices[0].message.content
        assert got == text[: text.index(stop) + len(stop)]
    assert base.choices[0].model_extra["stop_reason"] is None  # a length stop has none
    ids = tok.encode(text)
    k = len(ids) // 2
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                       extra_body={"stop_token_ids": [ids[k]]})
    first = ids.index(ids[k])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    assert r.choices[0].message.content == tok.decode(ids[:first])  # the stop token's text is not returned
    assert r.choices[0].model_extra["stop_reason"] == ids[k]  # the user's stop token id, as vLLM reports it


def test_utf8_streaming_never_splits_characters(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Repeat exactly: 😀😀 中文 🎉 日本語"}],
            "max_tokens": 32, "temperature": 0}
    full = requests.post(server["url"] + "/v1/chat/completions", json=body, headers=HDR, timeout=120).json()
    text = full["choices"][0]["message"]["content"]
    with requests.post(server["url"] + "/v1/chat/completions", json={**body, "stream": True}, headers=HDR,
                       stream=True, timeout=120) as r:
        lines = [ln for ln in r.iter_lines(decode_unicode=False) if ln]
    assert lines[-1] == b"data: [DONE]"
    deltas = [json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in lines[:-1]]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(ord(ch) > 0x2000 for ch in text), f"expected emoji/CJK in {text!r}"


def test_continuous_usage_stats_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (sent by serving benchmarks): every chunk carries the usage so
    far, completion tokens never decreasing, the last equal to the final usage chunk's."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 12,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = requests.post(server["url"] + "/v1/chat/completions", json=body, headers=HDR, stream=True, timeout=120)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] > 0 for e in events) and counts == sorted(counts)
    assert events[-1]["choices"] == [] and counts[-1] == counts[-2] > 0


def test_error_cases_raw_http(server):
    u = server["url"]

    def post(path, data, headers=HDR):
        r = requests.post(u + path, data=data if isinstance(data, (bytes, str)) else json.dumps(data),
                          headers={"Content-Type": "application/json", **headers}, timeout=60)
        err = r.json().get("error")
        assert err is not None and set(err) == {"message", "type", "param", "code"}, r.text
        return r.status_code, err

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/chat/completions", {**chat, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {**chat, "n": MAX_BATCH + MAX_QUEUED + 1}, 400, "n"),  # never fits the replica
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/v1/chat/completions", {**chat, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {**chat, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {**chat, "top_k": -2}, 400, "top_k"),
        ("/v1/chat/completions", {**chat, "max_tokens": 10_000}, 400, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]},
         400, "messages.0.content.0.type"),  # the failing part, not "content should be a string"
        ("/v1/chat/completions", {**chat, "model": "gpt-4o"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt.1"),  # a batch: the empty one
        ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 4, "n": MAX_BATCH + MAX_QUEUED}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 7]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
         "stream_options"),
        # a lone UTF-16 surrogate (json.dumps sends the "\ud800" escape) is not text
        ("/v1/completions", {"model": MODEL, "prompt": "\ud800", "max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", "\ud800"], "max_tokens": 2}, 400, "prompt.1"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400,
         "messages.0.content"),
        ("/v1/chat/completions", {**chat, "stop": "\ud800"}, 400, "stop"),
        ("/v1/chat/completions", {**chat, "repetition_penalty": float("nan")}, 400, "repetition_penalty"),
        ("/v1/chat/completions", {**chat, "repetition_penalty": 1e308}, 400, "repetition_penalty"),
    ]
    for path, body, status, param in cases:
        got, err = post(path, body)
        assert (got, err["param"]) == (status, param), (body, err)
    # an unknown field is ignored (vLLM's behaviour): 200, and the reply names what it ignored
    r = requests.post(u + "/v1/chat/completions", json={**chat, "max_tokens": 2, "frobnicate": 1,
                                                        "messages": [{"role": "user", "content": "hi", "x_msg": 0}]},
                      headers=HDR, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["adaflash"]["ignored_fields"] == ["frobnicate", "messages.0.x_msg"]
    assert r.headers["x-adaflash-ignored-fields"] == "frobnicate,messages.0.x_msg"
    # a name a header cannot carry (latin-1 only): escaped there, still a 200; a name UTF-8 cannot encode (a lone
    # surrogate, which JSON allows): a 400 about the body
    r = requests.post(u + "/v1/chat/completions", json={**chat, "max_tokens": 2, "\u4e2d": 1},
                      headers=HDR, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["adaflash"]["ignored_fields"] == ["\u4e2d"]
    assert r.headers["x-adaflash-ignored-fields"] == "\\u4e2d"
    got, err = post("/v1/chat/completions", {**chat, "\ud800x": 2})
    assert got == 400 and err["param"] is None and err["message"].startswith("Invalid request body"), err
    from adaflash_ray.config import load_recipe

    c = load_recipe("recipes/cpu_tiny.yaml")
    limit = min(c.serve.max_request_tokens, c.engine.max_seq_len - c.drafter.block_size)
    got, err = post("/v1/completions", {"model": MODEL, "prompt": "hello " * (limit + 8)})
    assert got == 400 and err["code"] == "context_length_exceeded" and str(limit) in err["message"]
    got, err = post("/v1/completions", b"{not json")
    assert got == 400 and err["code"] == "invalid_json"
    got, err = post("/v1/completions", b"[" * 2000 + b"]" * 2000)  # deeper than json.loads recurses, < 4096 bytes
    assert got == 400 and err["code"] == "invalid_json" and "nested too deeply" in err["message"], err
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):  # JSON sent as another media type
        got, err = post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                        {**HDR, "Content-Type": ctype})
        assert (got, err["param"], err["code"]) == (415, "Content-Type", "unsupported_media_type"), err
    r = requests.post(u + "/v1/completions", data=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}),
                      headers={**HDR, "Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text
    got, err = post("/v1/completions", {"model": MODEL, "prompt": "x" * 5000})  # serve.max_body_bytes=4096
    assert got == 413 and "4096" in err["message"]
    r = requests.get(u + "/v1/nothing-here", headers=HDR, timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def _open_stream(url: str, max_tokens: int) -> socket.socket:
    """A raw streaming request on a plain socket (so the test controls the disconnect)."""
    host, port = url[len("http://"):].split(":")
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time, in a land far away,", "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def test_disconnect_frees_the_slot_and_queue_full_is_429(server):
    before = _status(server)["requests"].get("aborted", 0)
    socks = [_open_stream(server["url"], 200) for _ in range(MAX_BATCH + MAX_QUEUED)]
    heads = [s.recv(4096) for s in socks]  # status line + first chunk: every one was admitted
    assert all(h.startswith(b"HTTP/1.1 200") for h in heads), heads
    r = requests.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                      headers=HDR, timeout=60)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
    # a burst beyond what Serve lets into the replica at once (max_ongoing_requests) and its own queue: every
    # request still reaches the replica and gets its OpenAI 429, none Serve's plain-text 503 "backpressure"
    burst = []

    def post():
        b = requests.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                          headers=HDR, timeout=120)
        burst.append((b.status_code, b.headers.get("Retry-After"), b.text[:200]))

    threads = [threading.Thread(target=post) for _ in range(3 * (MAX_BATCH + MAX_QUEUED + 16))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(burst) == len(threads)
    bad = [b for b in burst if b[0] != 429 or b[1] != "1" or json.loads(b[2])["error"]["code"] != "queue_full"]
    assert not bad, bad[:3]
    t0 = time.monotonic()
    while (st := _status(server))["queue"]["running"] < MAX_BATCH and time.monotonic() - t0 < 60:
        time.sleep(0.2)  # the engine thread admits the queued requests between two steps
    assert st["in_flight"] == MAX_BATCH + MAX_QUEUED, st
    assert st["queue"] == {"running": MAX_BATCH, "waiting": MAX_QUEUED}, st
    t0 = time.monotonic()
    for s in socks:
        s.close()  # the clients go away mid-stream
    while time.monotonic() - t0 < 30:
        st = _status(server)
        if st["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert st["in_flight"] == 0 and st["queue"] == {"waiting": 0, "running": 0}, st
    assert time.monotonic() - t0 < 10  # 8 x 200 tokens would take minutes on CPU: they were cancelled
    assert st["requests"]["aborted"] - before == MAX_BATCH + MAX_QUEUED


def test_opt_out_requests_are_not_recorded(server, client):
    sent = _status(server)["distill"]["num_trajectories_sent"]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   extra_body={"store": False})
    assert _status(server)["distill"]["num_trajectories_sent"] == sent
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert _status(server)["distill"]["num_trajectories_sent"] == sent + 1


def test_sigterm_drains_in_flight_requests_and_exits_0(server):
    """Last test of the module: SIGTERM while a stream is in flight -> it completes, new requests get 503."""
    s = _open_stream(server["url"], 48)
    data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 200")
    server["proc"].send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        r = requests.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                          headers=HDR, timeout=30)
        if r.status_code == 503:
            break
        time.sleep(0.2)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["Retry-After"]
    s.settimeout(120)
    while b"data: [DONE]" not in data:
        chunk = s.recv(65536)
        assert chunk, "stream cut before [DONE]"
        data += chunk
    s.close()
    finish = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in data.decode().split("\n")
              if ln.startswith("data: {")]
    assert finish[-1] == "length"  # the whole budget was delivered
    assert server["proc"].wait(120) == 0


@pytest.mark.parametrize("hops", range(5))
def test_a_cancel_reaches_a_consumer_waiting_with_a_deadline(hops):
    """A response consumer waiting for its next event under ``serve.request_timeout_s``'s deadline and cancelled (a
    client gone) is cancelled, whenever the cancel lands against an event's arrival (``hops`` loop turns after it):
    ``asyncio.wait_for`` before Python 3.12 returns the event and drops such a cancel, and the request's streams would
    then never be aborted."""
    import asyncio

    from adaflash_ray.serve.responses import _Choices

    async def main():
        q: asyncio.Queue = asyncio.Queue()

        async def stream():
            while True:
                yield await q.get()

        choices = _Choices([stream()], deadline=time.perf_counter() + 60,
                           on_timeout=lambda: AssertionError("the deadline is a minute away"))

        async def consume():
            async for _ in choices:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        q.put_nowait("token")
        for _ in range(hops):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.05)
        return task.cancelled(), [t.done() for t in choices.tasks]

    cancelled, pumps_done = asyncio.run(main())
    assert cancelled and all(pumps_done)
