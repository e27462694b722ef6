"""The OpenAI response of one generation request, from its engine requests' token streams (Ray-free).

:class:`ResponseWriter` takes a parsed :class:`~adaflash_ray.serve.protocol.GenSpec` and the
:class:`~adaflash_ray.serve.runtime.RequestStream` of each of its ``n`` choices, and writes either the JSON body
(``chat.completion`` / ``text_completion``) or the SSE stream (``chat.completion.chunk`` / ``text_completion``
chunks, then ``data: [DONE]``) in OpenAI's shapes (https://platform.openai.com/docs/api-reference/chat/object,
.../chat/streaming, .../completions/object):

- ``choices`` indexed 0 .. n-1; the choices advance together and a stream's chunks name their choice ``index``
  (a chat stream opens with one role chunk per choice); ``logprobs`` per choice (``null`` unless asked for, else
  :class:`~adaflash_ray.serve.logprobs.LogprobFormatter`'s shape), streamed with the tokens of each step;
- ``usage``: the prompt counted once, the completion tokens of all choices summed (OpenAI's and vLLM's rule);
  streaming: a last ``choices: []`` chunk with ``stream_options.include_usage``, the usage so far in every chunk
  with vLLM's ``stream_options.continuous_usage_stats``;
- ``adaflash``: ``drafter_versions`` (every drafter version that served a step, in order; per choice on its
  finishing chunk when streaming) and ``ignored_fields`` (the unknown request fields that were ignored).

A stop string ends its choice at once (its engine request is aborted); a consumer that stops reading (client gone)
aborts every choice's request; a response being read that still waits on its engine ``timeout_s`` seconds after its
request was queued has every choice's request aborted and is answered 504 ``timeout`` (the deadline is checked while a
consumer reads: a stream the server never starts reading is not timed).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Callable

from adaflash_ray.serve.logprobs import LogprobFormatter
from adaflash_ray.serve.protocol import APIError, GenSpec, TextStream

__all__ = ["ResponseWriter"]


class _Choices:
    """The choices' event streams merged in arrival order: ``async for index, event in it``. Each stream runs in
    its own task, so the choices advance together; the first error any stream raises is raised here.
    :meth:`cancel` (also on leaving the iteration early) cancels every stream, which aborts its engine request.

    ``deadline`` (a ``time.perf_counter()`` value, None: none): events already queued are still delivered, but
    waiting for the next one ends there - ``on_timeout()`` is called (before any stream is cancelled) and the
    exception it returns is raised here."""

    def __init__(self, streams: list[AsyncIterator], deadline: float | None = None,
                 on_timeout: Callable[[], Exception] | None = None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.deadline, self.on_timeout = deadline, on_timeout
        self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, events: AsyncIterator) -> None:
        try:
            async for event in events:
                self.queue.put_nowait((index, event, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self.queue.put_nowait((index, None, e))
            return
        self.queue.put_nowait((index, None, None))

    async def _next(self) -> tuple:
        if self.deadline is None or not self.queue.empty():
            return await self.queue.get()
        # not asyncio.wait_for: before Python 3.12 it can swallow a cancel (a client gone) that arrives as its inner
        # get completes (CPython gh-86296), and the consumer would then never abort its requests
        get = asyncio.ensure_future(self.queue.get())
        try:
            done, _ = await asyncio.wait({get}, timeout=max(self.deadline - time.perf_counter(), 0.0))
        except asyncio.CancelledError:
            get.cancel()
            raise
        if get in done:
            return get.result()
        get.cancel()  # a cancelled Queue.get takes no item
        raise self.on_timeout()

    async def __aiter__(self):
        left = len(self.tasks)
        try:
            while left:
                index, event, err = await self._next()
                if err is not None:
                    raise err
                if event is None:
                    left -= 1
                    continue
                yield index, event
        finally:
            self.cancel()

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


class ResponseWriter:
    """Write one request's response from its choices' streams.

    Args:
        spec: the parsed request (``kind``, ``n``, ``stream``, stop strings / ids, ``sampling.logprobs``, ...).
        streams: one :class:`~adaflash_ray.serve.runtime.RequestStream` per choice, already submitted.
        loop: the :class:`~adaflash_ray.serve.runtime.EngineLoop` (to abort a request). tokenizer: a Hugging Face
            tokenizer. eos_ids: the target's EOS ids (their text is never returned).
        timeout_s: seconds from the first choice's submission (``RequestStream.t_submit``) after which the
            response stops waiting on the engine: every choice's request is aborted (reason "timeout") and
            :meth:`body` raises / :meth:`sse` ends with an :class:`APIError` 504, code ``timeout``; None: no limit.
    Must be built on the running event loop (it starts one task per choice).
    """

    def __init__(self, spec: GenSpec, streams: list, *, loop, tokenizer, eos_ids: list[int],
                 timeout_s: float | None = None):
        self.spec, self.streams, self.loop, self.tok, self.eos_ids = spec, streams, loop, tokenizer, eos_ids
        self.timeout_s = timeout_s
        self.chat = spec.kind == "chat"
        self.base = {"id": ("chatcmpl-" if self.chat else "cmpl-") + spec.request_id, "created": spec.created,
                     "model": spec.model}
        self.object = "chat.completion" if self.chat else "text_completion"
        self.ext = {"ignored_fields": spec.ignored} if spec.ignored else {}
        k = spec.sampling.logprobs
        self.fmts = [None if k is None else LogprobFormatter(tokenizer, spec.kind, k) for _ in streams]
        deadline = None if timeout_s is None else min(rs.t_submit for rs in streams) + timeout_s
        self.choices = _Choices([self._events(rs) for rs in streams], deadline, self._timed_out)

    def _timed_out(self) -> APIError:
        """Abort every choice's engine request (counted as "timeout"); the 504 to answer."""
        for rs in self.streams:
            self.loop.abort(rs, "timeout")
        return APIError(504, f"The request did not finish within serve.request_timeout_s = {self.timeout_s:g} s; "
                             "it was aborted.", type="server_error", code="timeout")

    def usage(self, num_tokens: int) -> dict:
        """OpenAI's usage: each prompt counted once (whatever ``n``), ``num_tokens`` = the completion tokens of all
        choices."""
        n = sum(len(p) for p in self.spec.all_prompts)
        return {"prompt_tokens": n, "completion_tokens": num_tokens, "total_tokens": n + num_tokens}

    async def _events(self, rs) -> AsyncIterator[tuple[str, object, list | None]]:
        """One choice's events: ("text", delta, entries) per engine step with new text or new logprobs, then
        ("done", (finish_reason, num_tokens, versions, stop_reason), None) - ``stop_reason`` as vLLM reports it:
        the stop string or user stop token id that ended the text, None otherwise (EOS, length, abort).
        ``entries``: ``(token id, logprob, top)`` per
        completion token of the step when logprobs were asked for (tokens past a stop string excluded), else None.
        The request is aborted (KV slot freed) if the consumer stops early or a stop string hits."""
        spec = self.spec
        user_ids = set(spec.stop_token_ids) - set(self.eos_ids)
        ts = TextStream(self.tok, spec.stop, user_ids, include_stop=spec.include_stop)
        finished = False
        try:
            while True:
                item = await rs.queue.get()
                if item[0] == "tokens":
                    _, ids, version, lps = item
                    if version not in rs.versions:
                        rs.versions.append(version)
                    if isinstance(lps, str):  # the engine recorded no logprobs for these tokens
                        raise APIError(500, lps, type="server_error")
                    before = ts.num_tokens
                    delta = "".join(ts.add(t) for t in ids if not ts.stopped)
                    used = ts.num_tokens - before
                    entries = None if lps is None else [(t, lp, top) for t, (lp, top) in zip(ids[:used], lps)]
                    rs.num_tokens = ts.num_tokens
                    if ts.stopped:
                        self.loop.abort(rs, "stop_string")
                        finished = True
                        yield "text", delta + ts.finish(), entries
                        yield "done", ("stop", ts.num_tokens, rs.versions, ts.stop_hit), None
                        return
                    if delta or entries:
                        yield "text", delta, entries
                elif item[0] == "done":
                    finished = True
                    tail = ts.finish()
                    rs.num_tokens = ts.num_tokens
                    if tail:
                        yield "text", tail, None
                    why = ts.stop_hit if ts.stop_hit is not None else \
                        ts.last_id if item[1] == "stop" and ts.last_id in user_ids else None
                    yield "done", (item[1], ts.num_tokens, rs.versions, why), None
                    return
                else:
                    finished = True
                    err = item[1]
                    if isinstance(err, ValueError):  # the engine refused the request (add_request's checks)
                        raise APIError(400, str(err), param="prompt", code="invalid_value")
                    raise APIError(500, str(err), type="server_error")
        finally:
            if not finished:
                self.loop.abort(rs)

    async def body(self) -> dict:
        """The whole response (non-streaming); ``adaflash.drafter_versions`` merges the choices' versions."""
        num = len(self.streams)
        texts, entries, done = [[] for _ in range(num)], [[] for _ in range(num)], [None] * num
        async for i, (kind, val, ents) in self.choices:
            if kind == "text":
                texts[i].append(val)
                entries[i] += ents or []
            else:
                done[i] = val
        out, versions = [], []
        for i, (reason, _, vs, why) in enumerate(done):
            versions += [v for v in vs if v not in versions]
            lp = None if self.fmts[i] is None else self.fmts[i].format(entries[i])
            text = "".join(texts[i])
            out.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                        "finish_reason": reason, "stop_reason": why} if self.chat else
                       {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "stop_reason": why})
        return {**self.base, "object": self.object, "choices": out, "usage": self.usage(sum(d[1] for d in done)),
                "adaflash": {"drafter_versions": versions, **self.ext}}

    def _chunk(self, index: int, delta: str | None, reason: str | None, logprobs: dict | None = None,
               first: bool = False, stop_reason: str | int | None = None, **extra) -> str:
        if self.chat:
            d = {} if delta is None else ({"role": "assistant", "content": delta} if first else {"content": delta})
            choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:  # vLLM's stop_reason beside finish_reason in the choice's last chunk
            choice["stop_reason"] = stop_reason
        body = {**self.base, "object": self.object + ".chunk" if self.chat else self.object, "choices": [choice],
                **extra}
        if self.spec.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far in every chunk
            body["usage"] = self.usage(sum(rs.num_tokens for rs in self.streams))
        elif self.spec.include_usage:
            body.setdefault("usage", None)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        """The SSE stream: chunks as the engine commits tokens, the usage chunk, ``data: [DONE]``. An error after
        the first chunk goes in the stream as OpenAI's error JSON."""
        try:
            if self.chat:
                for i in range(len(self.streams)):
                    yield self._chunk(i, "", None, first=True)
            num_tokens = 0
            async for i, (kind, val, ents) in self.choices:
                if kind == "text":
                    lp = self.fmts[i].format(ents) if self.fmts[i] is not None and ents else None
                    if val or lp:
                        yield self._chunk(i, val, None, lp)
                    continue
                reason, n, versions, why = val
                num_tokens += n
                yield self._chunk(i, None, reason, stop_reason=why,
                                  adaflash={"drafter_versions": versions, **self.ext})
            if self.spec.include_usage:
                body = {**self.base, "object": self.object + ".chunk" if self.chat else self.object, "choices": [],
                        "usage": self.usage(num_tokens)}
                yield f"data: {json.dumps(body)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            self.choices.cancel()  # a client gone mid-stream: every choice's request is aborted
        yield "data: [DONE]\n\n"
