"""The request surface real clients use: sampling fields, logprobs, n > 1, chat_template_kwargs (adaflash_ray.serve).

Ray-free first: request fields -> the engine's SamplingParams (and 400s naming the field), the chat template's extra
variables, OpenAI's logprobs shapes, and the response writer's n-choice bodies and SSE chunks from hand-fed token
streams. Then ONE server (``python -m adaflash_ray.serve``: local Ray, the real SmolLM2-135M, cpu_tiny, no
distillation) driven by the official ``openai`` client: greedy replies and logprobs equal transformers' own, n = 2
with seeds, ignore_eos / min_tokens lengths, top_k = 1 = greedy, chat_template_kwargs, tools refused.

Run: python -m pytest -q tests/test_serve_params.py     (~1.5 min on 2 CPU cores)
"""
from __future__ import annotations

import asyncio
import functools
import json
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from adaflash_ray.engine.request import SamplingParams  # noqa: E402
from adaflash_ray.serve.logprobs import LogprobFormatter  # noqa: E402
from adaflash_ray.serve.protocol import APIError, parse_request  # noqa: E402
from adaflash_ray.serve.responses import ResponseWriter  # noqa: E402
from adaflash_ray.serve.runtime import RequestStream  # noqa: E402
from test_serve import _free_port, _start_server, _stop_server, tok  # noqa: E402,F401  (tests/ is on sys.path)

MODEL = "smollm2-135m-instruct"
EOS = 2


def _kw(tok, **over):
    return {**dict(tokenizer=tok, model_ids={MODEL}, context_limit=96, default_max_tokens=16,
                   default_temperature=0.0, vocab_size=49152, record_default=True, max_n=8), **over}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


# ------------------------------------------------------------------------------------ request -> SamplingParams
def test_sampling_fields_reach_the_engine_params(tok):
    """Every implemented field lands in SamplingParams; absent or at vLLM's defaults they are the engine's neutral
    values; choice i of n gets seed + i (vLLM's rule), and ignore_eos keeps only the user's stop ids."""
    spec = parse_request("chat", {**CHAT, "n": 3, "seed": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 5,
                                  "min_p": 0.1, "repetition_penalty": 1.2, "frequency_penalty": 0.5,
                                  "presence_penalty": -0.5, "min_tokens": 3, "max_tokens": 12, "ignore_eos": True,
                                  "logprobs": True, "top_logprobs": 4, "stop_token_ids": [7]}, **_kw(tok))
    assert spec.n == 3 and spec.sampling == SamplingParams(
        max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2,
        frequency_penalty=0.5, presence_penalty=-0.5, min_tokens=3, ignore_eos=True, seed=5, logprobs=4)
    ps = [spec.choice_params(i, [EOS]) for i in range(3)]
    assert [p.seed for p in ps] == [5, 6, 7] and all(p.stop_token_ids == [7] for p in ps)
    assert spec.sampling.seed == 5 and spec.sampling.stop_token_ids is None  # the spec itself is not changed
    top = parse_request("chat", {**CHAT, "n": 2, "seed": 2 ** 63 - 1, "temperature": 0.8}, **_kw(tok))
    assert [top.choice_params(i, [EOS]).seed for i in range(2)] == [2 ** 63 - 1, -2 ** 63]  # wrapped, still int64
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0,
               "min_tokens": 0, "ignore_eos": False, "logprobs": False, "n": 1, "seed": None, "top_logprobs": None}
    for body in (CHAT, {**CHAT, **neutral}):
        spec = parse_request("chat", body, **_kw(tok))
        assert spec.n == 1 and spec.sampling == SamplingParams(max_new_tokens=16, top_k=spec.sampling.top_k)
        assert spec.sampling.top_k in (0, -1) and spec.choice_params(0, [EOS]).stop_token_ids is None
    assert parse_request("chat", {**CHAT, "stop_token_ids": [7]}, **_kw(tok)).choice_params(0, [EOS]).stop_token_ids \
        == [EOS, 7]
    # chat: logprobs true + top_logprobs k (0 when absent); completions: logprobs k
    assert parse_request("chat", {**CHAT, "logprobs": True}, **_kw(tok)).sampling.logprobs == 0
    comp = {"model": MODEL, "prompt": "hi"}
    assert parse_request("completion", {**comp, "logprobs": 0}, **_kw(tok)).sampling.logprobs == 0
    assert parse_request("completion", {**comp, "logprobs": 5, "n": 2}, **_kw(tok)).sampling.logprobs == 5
    # min_tokens above the default budget raises the default budget, not an error
    assert parse_request("completion", {**comp, "min_tokens": 20}, **_kw(tok)).max_tokens == 20


def test_sampling_field_errors_name_the_field(tok):
    """Out-of-range or mistyped values: a 400 naming the request field (SamplingParams.validate's ranges, the
    engine names translated: max_new_tokens -> max_tokens, logprobs -> top_logprobs for chat)."""
    cases = [("top_k", {"top_k": -2}), ("top_k", {"top_k": 1.5}), ("min_p", {"min_p": 1.5}),
             ("repetition_penalty", {"repetition_penalty": 0}), ("frequency_penalty", {"frequency_penalty": 2.5}),
             ("presence_penalty", {"presence_penalty": -3}), ("min_tokens", {"min_tokens": 9, "max_tokens": 4}),
             ("min_tokens", {"min_tokens": -1}), ("ignore_eos", {"ignore_eos": 1}),
             ("top_logprobs", {"logprobs": True, "top_logprobs": 21}), ("top_logprobs", {"top_logprobs": 2}),
             ("logprobs", {"logprobs": 3}), ("n", {"n": 0}), ("n", {"n": 9}), ("seed", {"seed": 2 ** 63}),
             ("seed", {"seed": "1"}), ("chat_template_kwargs", {"chat_template_kwargs": [1]}),
             ("chat_template_kwargs.tokenize", {"chat_template_kwargs": {"tokenize": False}}),
             ("chat_template_kwargs.tools", {"chat_template_kwargs": {"tools": []}}),
             ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
             ("response_format", {"response_format": {"type": "json_schema"}})]
    for param, extra in cases:
        with pytest.raises(APIError) as e:
            parse_request("chat", {**CHAT, **extra}, **_kw(tok))
        assert (e.value.status, e.value.param) == (400, param), (extra, e.value.message)
        assert param in e.value.message, e.value.message
    with pytest.raises(APIError) as e:
        parse_request("chat", {**CHAT, "min_tokens": 9, "max_tokens": 4}, **_kw(tok))
    assert "max_tokens=4" in e.value.message and "max_new_tokens" not in e.value.message
    for param, extra in (("logprobs", {"logprobs": 21}), ("logprobs", {"logprobs": True}), ("echo", {"echo": True})):
        with pytest.raises(APIError) as e:
            parse_request("completion", {"model": MODEL, "prompt": "hi", **extra}, **_kw(tok))
        assert (e.value.status, e.value.param) == (400, param), extra



def test_non_finite_sampling_values_are_a_400_naming_the_field(tok):
    """NaN and ±Infinity (json.loads accepts them) never reach the engine: a 400 naming the field saying it must be
    a finite number (not a range message such as "less than or equal to 2" for a NaN temperature); a finite but
    absurd repetition_penalty is outside SamplingParams.validate's range."""
    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        for value in ("NaN", "Infinity", "-Infinity"):
            body = json.loads(json.dumps(CHAT)[:-1] + f', "{field}": {value}}}')
            with pytest.raises(APIError) as e:
                parse_request("chat", body, **_kw(tok))
            assert (e.value.status, e.value.param) == (400, field), (field, value, e.value.message)
            assert e.value.message.startswith(f"Invalid value for '{field}': Input should be a finite number"), \
                e.value.message
    for value in (1e308, 1e-308, 0.001, 101):
        with pytest.raises(APIError) as e:
            parse_request("chat", {**CHAT, "repetition_penalty": value}, **_kw(tok))
        assert e.value.param == "repetition_penalty" and "must be in [0.01, 100.0]" in e.value.message
    for value in (0.01, 100, 1.3):
        assert parse_request("chat", {**CHAT, "repetition_penalty": value},
                             **_kw(tok)).sampling.repetition_penalty == value


# Qwen3's thinking switch (Qwen/Qwen3-8B tokenizer_config.json chat_template, generation-prompt part), plus a
# variable that makes the template raise
_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if strict %}{{ raise_exception('strict mode') }}{% endif %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
             "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_are_template_variables(tok):
    """chat_template_kwargs reach apply_chat_template as template variables (enable_thinking of a Qwen3-style
    template); one the template does not read changes nothing; a template that raises on them is a 400."""
    qwen = SimpleNamespace(apply_chat_template=functools.partial(tok.apply_chat_template, chat_template=_TEMPLATE))
    plain = parse_request("chat", CHAT, **_kw(tok, tokenizer=qwen)).prompt_ids
    off = parse_request("chat", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}},
                        **_kw(tok, tokenizer=qwen)).prompt_ids
    assert tok.decode(off) == tok.decode(plain) + "<think>\n\n</think>\n\n"
    on = parse_request("chat", {**CHAT, "chat_template_kwargs": {"enable_thinking": True, "unused_var": 1}},
                       **_kw(tok, tokenizer=qwen)).prompt_ids
    assert on == plain
    assert parse_request("chat", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}},
                         **_kw(tok)).prompt_ids == parse_request("chat", CHAT, **_kw(tok)).prompt_ids  # SmolLM's
    with pytest.raises(APIError) as e:
        parse_request("chat", {**CHAT, "chat_template_kwargs": {"strict": True}}, **_kw(tok, tokenizer=qwen))
    assert e.value.param == "chat_template_kwargs" and "strict mode" in e.value.message


# ------------------------------------------------------------------------------------ logprobs shapes
def test_logprob_formatter_chat_and_completion_shapes(tok):
    """Chat: content[] of {token, logprob, bytes, top_logprobs[k]}, the bytes of a character split over two tokens
    joining up; completions: tokens, token_logprobs, top_logprobs (chosen + top k), text_offset running on across
    chunks; -inf written as -9999.0."""
    text = "ok 😀 done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the emoji is split over tokens
    entries = [(t, -0.1 * j, [(t, -0.1 * j), (EOS, float("-inf")), (ids[0], -3.0)]) for j, t in enumerate(ids)]
    chat = LogprobFormatter(tok, "chat", 2).format(entries)
    content = chat["content"]
    assert [c["token"] for c in content] == [tok.decode([i]) for i in ids]
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8") == text
    assert [c["logprob"] for c in content] == [pytest.approx(-0.1 * j) for j in range(len(ids))]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][1] == {"token": "<|im_end|>", "logprob": -9999.0,
                                                                       "bytes": list(b"<|im_end|>")} for c in content)
    assert json.dumps(chat)  # finite numbers only
    fmt = LogprobFormatter(tok, "completion", 1)
    a, b = fmt.format(entries[:2]), fmt.format(entries[2:])  # two streamed chunks
    whole = LogprobFormatter(tok, "completion", 1).format(entries)
    assert {k: a[k] + b[k] for k in a} == whole
    strs = [tok.decode([i]) for i in ids]
    assert whole["tokens"] == strs and whole["text_offset"] == [sum(map(len, strs[:j])) for j in range(len(ids))]
    assert whole["top_logprobs"][0] == {strs[0]: 0.0}  # chosen == the top-1: one entry
    assert all(len(d) == 1 or len(d) == 2 for d in whole["top_logprobs"])
    assert LogprobFormatter(tok, "chat", 0).format(entries[:1])["content"][0]["top_logprobs"] == []


# ------------------------------------------------------------------------------------ response writer (no Ray)
class _FakeLoop:
    def __init__(self):
        self.aborted = []

    def abort(self, rs, reason="aborted"):
        self.aborted.append(reason)


def _feed(rs: RequestStream, steps: list[list[int]], reason: str, logprobs: bool) -> None:
    for j, ids in enumerate(steps):
        lps = [(-0.5, [(t, -0.5), (EOS, -2.0)]) for t in ids] if logprobs else None
        rs.queue.put_nowait(("tokens", ids, j // 2, lps))
    rs.queue.put_nowait(("done", reason))


def _write(tok, body: dict, kind: str, feeds: list[tuple[list[list[int]], str]], logprobs: bool):
    """Parse ``body``, feed each choice's token steps, return (loop, body dict or list of SSE events)."""
    spec = parse_request(kind, body, **_kw(tok))

    async def go():
        streams = [RequestStream(False) for _ in feeds]
        for rs, (steps, reason) in zip(streams, feeds):
            _feed(rs, steps, reason, logprobs)
        loop = _FakeLoop()
        w = ResponseWriter(spec, streams, loop=loop, tokenizer=tok, eos_ids=[EOS])
        if not spec.stream:
            return loop, await w.body()
        lines = [chunk async for chunk in w.sse()]
        assert lines[-1] == "data: [DONE]\n\n"
        return loop, [json.loads(ln[6:]) for ln in lines[:-1]]

    return asyncio.run(go())


def test_response_writer_n_choices_plain_and_streamed(tok):
    """n = 2: choices indexed 0, 1 with their own text, logprobs and finish reasons; usage counts the prompt
    once and sums the completion tokens; the stream's chunks name their choice, a chat stream opens with one role
    chunk per choice, continuous usage sums the choices so far, and the streamed text and logprobs of each choice
    equal the plain response's. A stop string inside a step drops that step's later tokens and their logprobs."""
    a, b = tok.encode(" red green blue"), tok.encode(" one two three four")
    feeds = [([a[:1], a[1:]], "length"), ([b[:2], b[2:], [EOS]], "stop")]
    body = {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 1, "max_tokens": 16}
    _, plain = _write(tok, body, "chat", feeds, True)
    n_prompt = len(parse_request("chat", CHAT, **_kw(tok)).prompt_ids)
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in plain["choices"]] == [tok.decode(a), tok.decode(b)]
    assert [c["finish_reason"] for c in plain["choices"]] == ["length", "stop"]
    assert plain["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(a) + len(b) + 1,
                              "total_tokens": n_prompt + len(a) + len(b) + 1}
    lp1 = plain["choices"][1]["logprobs"]["content"]
    assert [c["token"] for c in lp1] == [tok.decode([t]) for t in b] + ["<|im_end|>"]
    assert all(c["logprob"] == -0.5 and len(c["top_logprobs"]) == 1 for c in lp1)
    assert plain["adaflash"]["drafter_versions"] == [0, 1]

    _, events = _write(tok, {**body, "stream": True,
                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "chat", feeds,
                       True)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    for i, choice in enumerate(plain["choices"]):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in mine) == choice["message"]["content"]
        assert [x for c in mine if c["logprobs"] for x in c["logprobs"]["content"]] == choice["logprobs"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]

    # completions, one choice, stop string inside the second step: the tokens after it are not returned
    stop_at = tok.decode(b[:3])[len(tok.decode(b[:2])):]  # the third token's text
    loop, comp = _write(tok, {"model": MODEL, "prompt": "x", "logprobs": 0, "stop": [stop_at], "max_tokens": 16},
                        "completion", [([b[:2], b[2:]], "length")], True)
    c = comp["choices"][0]
    assert c["text"] == tok.decode(b[:2]) and c["finish_reason"] == "stop" and loop.aborted == ["stop_string"]
    assert c["logprobs"]["tokens"] == [tok.decode([t]) for t in b[:3]]  # the stop string's token counts
    assert comp["usage"]["completion_tokens"] == 3
    _, plain1 = _write(tok, {**CHAT, "max_tokens": 16}, "chat", [([a], "length")], False)
    assert plain1["choices"][0]["logprobs"] is None and len(plain1["choices"]) == 1


def test_response_writer_engine_without_logprobs_is_an_error(tok):
    """A request that asked for logprobs whose engine recorded none fails with a 500 (every choice aborted),
    rather than answering without them."""
    spec = parse_request("completion", {"model": MODEL, "prompt": "x", "logprobs": 1, "n": 2}, **_kw(tok))

    async def go():
        streams = [RequestStream(False), RequestStream(False)]
        streams[0].queue.put_nowait(("tokens", [5], 0, "the engine recorded 0 logprobs"))
        loop = _FakeLoop()
        with pytest.raises(APIError) as e:
            await ResponseWriter(spec, streams, loop=loop, tokenizer=tok, eos_ids=[EOS]).body()
        await asyncio.sleep(0)  # the other choice's task runs its cancellation
        return loop, e.value

    loop, err = asyncio.run(go())
    assert err.status == 500 and "logprobs" in err.message and loop.aborted == ["aborted", "aborted"]


# ------------------------------------------------------------------------------------ one live server
@pytest.fixture(scope="module")
def server(tok):
    proc, url = _start_server(["--recipe", "recipes/cpu_tiny.yaml", "--set", "logging.wandb_mode=disabled"],
                              _free_port())
    yield url
    _stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(tok):
    import torch
    from transformers import AutoModelForCausalLM

    from adaflash_ray.data import ensure_target

    return AutoModelForCausalLM.from_pretrained(ensure_target(MODEL), dtype=torch.float32).eval()


def _reference(hf, prompt_ids: list[int], max_new: int, k: int):
    """transformers' greedy continuation (up to EOS) and the log_softmax of its own logits at each output token."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == EOS:
                break
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    out = ids[len(prompt_ids):]
    rows = lp[len(prompt_ids) - 1:len(ids) - 1]  # (T, V): row j predicts out[j]
    top = rows.topk(k, dim=-1)
    return out, [float(rows[j, t]) for j, t in enumerate(out)], top.indices.tolist(), top.values.tolist()


def test_greedy_replies_and_logprobs_equal_transformers(client, hf, tok):
    """Greedy text equals transformers' greedy output; logprobs (completions: logprobs=3; chat: top_logprobs=2,
    plain and streamed) are the log_softmax of transformers' own logits at the returned tokens, within 1e-4."""
    prompt = "The capital of France is"
    out, lps, top_ids, top_vals = _reference(hf, tok.encode(prompt, add_special_tokens=False), 8, 3)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    c = r.choices[0]
    assert c.text == tok.decode(out, skip_special_tokens=True)
    L = c.logprobs
    assert L.tokens == [tok.decode([t]) for t in out] and L.token_logprobs == pytest.approx(lps, abs=1e-4)
    for j in range(len(out)):
        want = {tok.decode([i]): v for i, v in zip(top_ids[j], top_vals[j])}
        assert set(want) <= set(L.top_logprobs[j]), (j, want, L.top_logprobs[j])
        assert [L.top_logprobs[j][s] for s in want] == pytest.approx(list(want.values()), abs=1e-4)
    assert L.text_offset == [sum(len(s) for s in L.tokens[:j]) for j in range(len(out))]

    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out, lps, top_ids, top_vals = _reference(hf, list(ids), 10, 2)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == tok.decode(out, skip_special_tokens=True)
    assert [e.token for e in content] == [tok.decode([t]) for t in out]
    assert [e.logprob for e in content] == pytest.approx(lps, abs=1e-4)
    for e, ti, tv in zip(content, top_ids, top_vals):
        assert [t.token for t in e.top_logprobs] == [tok.decode([i]) for i in ti]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(tv, abs=1e-4)
    streamed = [x for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                           logprobs=True, top_logprobs=2, stream=True)
                if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_n_choices_and_seeds(client):
    """n = 2 at temperature 0.8 with a seed: two distinct choices, the same again on a repeat, choice 1 equal to
    a single request with seed + 1; usage sums the choices; streamed, the chunks of each index rebuild the same
    texts and the usage equals the plain response's."""
    kw = dict(model=MODEL, prompt="Once upon a time, a dragon", max_tokens=12, temperature=0.8, seed=1234)
    r = client.completions.create(n=2, logprobs=0, **kw)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1] and texts[0] != texts[1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert [c.text for c in client.completions.create(n=2, **kw).choices] == texts
    assert client.completions.create(**{**kw, "seed": 1235}).choices[0].text == texts[1]
    chunks = list(client.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    assert ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
            for i in (0, 1)] == texts
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_ignore_eos_min_tokens_top_k_template_kwargs_and_tools(client, server):
    """ignore_eos runs to max_tokens past EOS; min_tokens holds EOS off that long; top_k = 1 at temperature 0.8 is
    greedy; the penalties and min_p are accepted; chat_template_kwargs a template ignores change nothing;
    tools are a 400 naming the field."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    base = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    text, n = base.choices[0].message.content, base.usage.completion_tokens
    assert base.choices[0].finish_reason == "stop" and n < 16, (text, n)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (24, "length")
    assert r.choices[0].message.content.startswith(text)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                       extra_body={"min_tokens": 16})
    assert r.usage.completion_tokens >= 16 and r.choices[0].message.content.startswith(text)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0.8, seed=3,
                                       extra_body={"top_k": 1})
    assert r.choices[0].message.content == text
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.8, seed=3,
                                       frequency_penalty=0.5, presence_penalty=0.5,
                                       extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    assert r.usage.completion_tokens >= 1
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == text
    resp = requests.post(server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"
