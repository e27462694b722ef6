"""The OpenAI wire protocol of the endpoint: request validation, error JSON, incremental detokenisation, logprobs.

Ray-free (tests call it directly). :func:`parse_request` turns a raw JSON body of ``POST /v1/completions`` or
``POST /v1/chat/completions`` into a :class:`GenSpec` - the prompt ids and the engine's validated
:class:`~adaflash_ray.engine.request.SamplingParams` - or raises :class:`APIError` (HTTP status + OpenAI-style
``{"error": {"message", "type", "param", "code"}}``) naming the offending field.

Implemented, beside OpenAI's ``max_tokens`` / ``temperature`` / ``top_p`` / ``stop`` / ``seed`` / ``stream``:
``n`` (that many choices, one engine request each), ``logprobs`` / ``top_logprobs``
(https://platform.openai.com/docs/api-reference/chat/create, .../completions/create), ``frequency_penalty`` /
``presence_penalty``, and vLLM's extensions (https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html,
"Extra parameters"): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``stream_options.continuous_usage_stats``, ``chat_template_kwargs``. Parameters this endpoint
knows but does not implement (``tools``, ``response_format`` other than text, ``echo``, ``best_of``, ``logit_bias``,
guided decoding, ...) are refused with 400 naming the field unless they carry their neutral value, never silently
ignored. Fields it does not know at all, at any depth, are ignored with a logged warning (what vLLM's OpenAI server
does), so clients built for vLLM, which send its extensions, are served.
:class:`TextStream` turns committed token ids into text deltas that never split a UTF-8 character and cuts the
output at a stop string (:mod:`adaflash_ray.serve.logprobs` writes the engine's per-token log-probabilities in
OpenAI's shapes).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from adaflash_ray.engine.request import SamplingParams

__all__ = ["APIError", "GenSpec", "TextStream", "error_body", "parse_request", "served_model_id"]

# Ray Serve routes this logger to the replica's log; outside Serve it is plain `logging`
log = logging.getLogger("ray.serve")
_warned_unknown: set[str] = set()  # unknown field paths already warned about in this process (once each)


def served_model_id(model, serve) -> str:
    """The model id of ``/v1/models`` and of every response.

    Args:
        model: the recipe's ``ModelConfig`` (``name``, ``path``); serve: its ``ServeConfig`` (``model_name``).
    Returns:
        ``serve.model_name`` if set; else ``model.name`` when the recipe names a registry model (no ``path``);
        else the model directory's name (``/models/Qwen3-8B`` -> ``Qwen3-8B``), as vLLM names a local model by
        its path.
    """
    if serve.model_name:
        return serve.model_name
    if not model.path:
        return model.name
    return PurePath(str(model.path).rstrip("/\\")).name or str(model.path)


class APIError(Exception):
    """An HTTP error answered as OpenAI error JSON.

    Args:
        status: HTTP status (400, 401, 404, 413, 415, 429, 503, 500, 504).
        message: human-readable, names the field and the limit.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault, or None.
        code: a machine-readable code (``context_length_exceeded``, ``invalid_api_key``, ...) or None.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` (the OpenAI error shape). A lone UTF-16 surrogate in
    ``message`` or ``param`` (quoted from a request) is written as its backslash escape (``\\ud800`` for U+D800):
    the response must encode as UTF-8."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    param = None if param is None else param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------ request models
def _utf8(text: str) -> str:
    """``text`` if it encodes as UTF-8. Raises ValueError at a lone UTF-16 surrogate (JSON's ``"\\ud800"``
    decodes to one), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid Unicode: lone surrogate {text[e.start]!r} at index {e.start}") from None
    return text


#: a string field of a request: valid Unicode (encodable as UTF-8), else a 400 naming the field
_Utf8Str = Annotated[str, AfterValidator(_utf8)]


class _Strict(BaseModel):
    # strict: JSON types as the OpenAI schema states them - "max_tokens": "5" or true is a 400, not a 5 or a 1.
    # allow_inf_nan=False: NaN / Infinity (which json.loads accepts) are a 400 "should be a finite number".
    # extra="allow": unknown fields are kept aside (model_extra), reported by _unknown_fields, and ignored
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage (so far) in every chunk


class _TextPart(_Strict):
    type: Literal["text"]
    text: _Utf8Str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: _Utf8Str | list[_TextPart]
    name: _Utf8Str | None = None
    tool_calls: list | None = None  # refused when non-empty (no tool use)


class _Common(_Strict):
    model: _Utf8Str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: _Utf8Str | list[_Utf8Str | int] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension: token ids that end the completion
    seed: int | None = Field(None, ge=-2 ** 63, le=2 ** 63 - 1)  # int64, as vLLM's protocol bounds it
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    user: _Utf8Str | None = None
    store: bool | None = None  # False = do not use this request for distillation (OpenAI's `store`)
    # sampling: OpenAI's penalties and vLLM's extensions; their ranges are SamplingParams.validate's
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text stays in it


class CompletionBody(_Common):
    prompt: _Utf8Str | list[int] | list[_Utf8Str] | list[list[int]]
    logprobs: int | None = None  # the top-k alternatives per token (0: the chosen token's only)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None  # needs logprobs: true
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables of the chat template


# parameters this endpoint knows but cannot honour: refused (400 naming the field) unless at a neutral value.
# OpenAI's (https://platform.openai.com/docs/api-reference/chat/create, .../completions/create) ...
_NEUTRAL: dict[str, tuple] = {
    "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None,), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
}
# ... and vLLM's extra sampling / templating parameters (vllm/entrypoints/openai/protocol.py ChatCompletionRequest,
# CompletionRequest), at vLLM's own defaults: a vLLM client sending them at other values asks for behaviour this
# engine does not have, so they are refused rather than dropped with the unknown fields
_NEUTRAL.update({
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structural_tag": (None,), "structured_outputs": (None,), "chat_template": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "add_special_tokens": (None, False), "documents": (None,), "mm_processor_kwargs": (None,),
    "priority": (None, 0), "vllm_xargs": (None,),
})


def _is_neutral(value: Any, neutral: tuple) -> bool:
    """Whether ``value`` equals one of ``neutral`` with JSON's types kept apart (``true`` is not ``1``, ``0`` is
    not ``false``; ``0`` and ``0.0`` are the same number)."""
    def kind(v):
        return "bool" if isinstance(v, bool) else "num" if isinstance(v, (int, float)) else type(v).__name__
    return any(kind(value) == kind(n) and value == n for n in neutral)


def _unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the fields pydantic kept aside as unknown (``extra="allow"``), at any depth."""
    out = [f"{prefix}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        v = getattr(model, name)
        items = enumerate(v) if isinstance(v, list) else [(None, v)]
        for i, item in items:
            if isinstance(item, BaseModel):
                out += _unknown_fields(item, f"{prefix}{name}." + ("" if i is None else f"{i}."))
    return out


@dataclass
class GenSpec:
    """A validated generation request.

    prompt_ids: the prompt token ids (chat template applied for chat). sampling: the engine's
    :class:`SamplingParams` of choice 0, validated (``max_new_tokens`` = the completion budget, ``logprobs`` = the
    top alternatives per token or None; ``stop_token_ids`` left None: the replica adds the EOS ids); choice ``i``
    of ``n`` is :meth:`choice_params` (i). stop: stop strings (cut from the text). stop_token_ids: user stop ids
    (their text is not returned; EOS stops too unless ``ignore_eos``). record: whether the request may become a
    distillation trajectory.
    """

    kind: Literal["completion", "chat"]
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool
    record: bool
    user: str | None
    n: int = 1
    ignored: list[str] = field(default_factory=list)  # unknown request fields (dotted paths) that were ignored
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
    include_stop: bool = False  # include_stop_str_in_output: a stop string that ends the text stays in it
    # a completion request's batch of prompts (``prompt`` as a list of strings or of id lists; ``prompt_ids`` is the
    # first): choice ``i * n + j`` is prompt i's j-th, as vLLM numbers them; empty = the one prompt
    prompts: list[list[int]] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: f"{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def all_prompts(self) -> list[list[int]]:
        """The request's prompts: the batch of a completion request, else ``[prompt_ids]``."""
        return self.prompts or [self.prompt_ids]

    @property
    def seed(self) -> int | None:
        return self.sampling.seed

    def choice_params(self, index: int, eos_ids: list[int]) -> SamplingParams:
        """The engine parameters of choice ``index`` (0 .. n-1): its own random stream, ``seed + index`` (wrapped
        into int64) when a seed is given (vLLM's rule for its n child requests, vllm/v1/engine/parallel_sampling.py),
        the engine's shared generator otherwise. Stop ids: the user's plus ``eos_ids`` (the user's only with
        ``ignore_eos``; None = the engine's EOS default when the user gave none)."""
        p = self.sampling
        if p.ignore_eos:
            stop = list(self.stop_token_ids)
        else:
            stop = [*eos_ids, *self.stop_token_ids] if self.stop_token_ids else None
        # choice i samples with seed + i, wrapped into the engine's int64 seed range
        seed = None if p.seed is None else (p.seed + index + 2**63) % 2**64 - 2**63
        return dataclasses.replace(p, stop_token_ids=stop, seed=seed)


def _first_error(err: ValidationError) -> APIError:
    # the most specific error: one a validator raised on the value itself (a lone surrogate in prompt.1, not
    # "prompt.0 should be a valid integer" of the list[int] member), else the deepest: for a union such as
    # ``content: str | list[part]`` given a list, the failing part's field (messages.0.content.0.txt), not "should
    # be a valid string"
    e = max(err.errors(), key=lambda x: (x["type"] == "value_error", len(x["loc"])))
    # drop pydantic's union-member tags ("str", "list[int]", "function-after[...]"), keep field names
    # ("stream" starts with "str" and is a field)
    loc = [str(x) for x in e["loc"] if str(x) not in ("str", "int", "float", "bool", "none")
           and not str(x).startswith(("list[", "dict[", "function-", "literal[", "nullable["))]
    param = ".".join(loc) if loc else None
    if e["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    got = e.get("input")
    got_s = repr(got)[:80] if not isinstance(got, (dict, list)) else type(got).__name__
    msg = e["msg"].removeprefix("Value error, ")
    if param is None:  # no field to name: the body itself (e.g. a field name with a lone UTF-16 surrogate)
        return APIError(400, f"Invalid request body: {msg} (got {got_s}).", param=None, code="invalid_value")
    return APIError(400, f"Invalid value for '{param}': {msg} (got {got_s}).", param=param, code="invalid_value")


def parse_request(kind: Literal["completion", "chat"], raw: Any, *, tokenizer, model_ids: set[str],
                  context_limit: int, default_max_tokens: int, default_temperature: float,
                  vocab_size: int, record_default: bool, max_n: int | None = None) -> GenSpec:
    """Validate a decoded JSON body and tokenise its prompt.

    Args:
        kind: "completion" (``prompt``) or "chat" (``messages``, the tokenizer's chat template with
            ``chat_template_kwargs`` as extra template variables).
        raw: the decoded JSON body. tokenizer: a Hugging Face tokenizer. model_ids: accepted ``model`` ids.
        context_limit: max prompt + completion tokens. default_max_tokens: budget when none is given
            (clamped to the context left). default_temperature: when ``temperature`` is absent.
        vocab_size: token ids in ``prompt`` / ``stop_token_ids`` must be < this.
        record_default: whether a request without ``store`` may be distilled on.
        max_n: the most choices one request may ask for (``n``; the replica's in-flight limit), None = no limit.
    Returns:
        GenSpec.
    Unknown fields (at any depth) are ignored, listed in ``GenSpec.ignored`` and logged (a warning the first
    time each field path is seen in the process).

    Raises:
        APIError: 400 naming the field (known but unsupported at a non-neutral value, out of range - the ranges
            of :meth:`SamplingParams.validate` -, NaN or ±inf for a number, text with a lone UTF-16 surrogate,
            a prompt over the context limit: code ``context_length_exceeded``, a batch's prompt named by its index,
            ``prompt.<i>``), 404 for an unknown model. Every one carries a machine-readable ``code``:
            ``unsupported_parameter`` (a known parameter not implemented), ``missing_required_parameter``,
            ``context_length_exceeded``, ``model_not_found`` (the 404), ``invalid_json`` (a body that is not an
            object), else ``invalid_value`` (a value out of range, of the wrong type or form, or in conflict with
            another field).
    """
    if not isinstance(raw, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    for key, ok in _NEUTRAL.items():
        if key in raw and not _is_neutral(raw[key], ok):
            raise APIError(400, f"'{key}' is not supported by this endpoint (got {str(raw[key])[:60]}).",
                           param=key, code="unsupported_parameter")
    raw = {k: v for k, v in raw.items() if k not in _NEUTRAL}
    try:
        body = (CompletionBody if kind == "completion" else ChatBody).model_validate(raw)
    except ValidationError as e:
        raise _first_error(e) from None
    ignored = _unknown_fields(body)
    new = [f for f in ignored if f not in _warned_unknown]
    if new:
        _warned_unknown.update(new)
        log.warning("ignoring unknown request field(s) %s (not part of this endpoint's API; further requests "
                    "with them are not reported again)", new)
    if kind == "chat":
        for i, m in enumerate(body.messages):
            if m.tool_calls:
                raise APIError(400, f"'messages.{i}.tool_calls' is not supported by this endpoint: no tool use.",
                               param=f"messages.{i}.tool_calls", code="unsupported_parameter")
    if body.model not in model_ids:
        raise APIError(404, f"The model '{body.model}' does not exist; this endpoint serves {sorted(model_ids)}.",
                       type="not_found_error", param="model", code="model_not_found")
    n = body.n or 1
    if max_n is not None and n > max_n:
        raise APIError(400, f"'n' is {n}; a replica runs at most {max_n} requests at a time.", param="n",
                       code="invalid_value")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true.", param="stream_options",
                       code="invalid_value")
    stop_strings, stop_ids = [], list(body.stop_token_ids or [])
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 16:
        raise APIError(400, f"'stop' has {len(stops)} entries; at most 16 are supported.", param="stop",
                       code="invalid_value")
    for s in stops:
        if isinstance(s, int):
            stop_ids.append(s)
        elif s == "":
            raise APIError(400, "'stop' strings must be non-empty.", param="stop", code="invalid_value")
        else:
            stop_strings.append(s)
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"'stop_token_ids' must be in [0, {vocab_size}), got {bad[:4]}.", param="stop_token_ids",
                       code="invalid_value")

    batch: list[list[int]] = []
    if kind == "completion":
        prompt, param = body.prompt, "prompt"
        batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        for i, p in enumerate(prompt if batched else [prompt]):  # vLLM's batch: a list of strings or of id lists
            where = f"prompt.{i}" if batched else "prompt"
            if isinstance(p, str):
                p_ids = list(tokenizer.encode(p, add_special_tokens=False))
            else:
                p_ids = [int(t) for t in p]
                bad = [t for t in p_ids if not 0 <= t < vocab_size]
                if bad:
                    raise APIError(400, f"prompt token ids must be in [0, {vocab_size}), got {bad[:4]}.", param=where,
                                   code="invalid_value")
            if not p_ids:
                raise APIError(400, f"'{where}' is empty.", param=where, code="invalid_value")
            batch.append(p_ids)
        if max_n is not None and len(batch) * n > max_n:
            raise APIError(400, f"{len(batch)} prompts x 'n' {n} = {len(batch) * n} completions; a replica runs at "
                           f"most {max_n} requests at a time.", param="prompt", code="invalid_value")
        # the context checks below: the longest prompt (the first of equals), named by its index in a batch
        longest = max(range(len(batch)), key=lambda i: len(batch[i]))
        ids = batch[longest]
        if batched:
            param, what = f"prompt.{longest}", f"prompt at index {longest} ('prompt.{longest}')"
        else:
            what = "prompt"
        budget = body.max_tokens
        budget_param = "max_tokens"
    else:
        param = what = "messages"
        ids = _chat_prompt_ids(body, tokenizer)
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, "'max_tokens' and 'max_completion_tokens' differ; send one of them.",
                           param="max_completion_tokens", code="invalid_value")
        budget = body.max_completion_tokens or body.max_tokens
        budget_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if len(ids) >= context_limit:
        raise APIError(400, f"This model's maximum context length is {context_limit} tokens; the {what} has "
                       f"{len(ids)} tokens, which leaves no room for a completion.", param=param,
                       code="context_length_exceeded")
    if budget is None:  # the default budget, but at least min_tokens, within the context left
        budget = min(max(default_max_tokens, body.min_tokens or 0), context_limit - len(ids))
    elif len(ids) + budget > context_limit:
        raise APIError(400, f"This model's maximum context length is {context_limit} tokens. However, you requested "
                       f"{len(ids) + budget} tokens ({len(ids)} in the {what}, {budget} for the completion). "
                       f"Reduce the {what} or '{budget_param}'.", param=budget_param,
                       code="context_length_exceeded")
    sampling = _sampling_params(kind, body, budget, budget_param, default_temperature)
    return GenSpec(kind=kind, model=body.model, prompt_ids=batch[0] if batch else ids, sampling=sampling,
                   stop=stop_strings, prompts=batch if len(batch) > 1 else [],
                   stop_token_ids=stop_ids, stream=body.stream, n=n,
                   include_usage=bool(body.stream_options and body.stream_options.include_usage),
                   continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                   record=record_default if body.store is None else body.store, user=body.user, ignored=ignored,
                   include_stop=body.include_stop_str_in_output)


def _chat_prompt_ids(body: ChatBody, tokenizer) -> list[int]:
    """The chat template applied to ``messages`` with the generation prompt; ``chat_template_kwargs`` become extra
    template variables (``enable_thinking`` of Qwen3's template; one a template does not read changes nothing), as
    vLLM passes them (vllm/entrypoints/chat_utils.py apply_hf_chat_template). A key that is one of
    ``apply_chat_template``'s own arguments (``tools``, ``tokenize``, ``chat_template``, ...) is refused, and a
    template that raises on them is a 400 naming ``chat_template_kwargs``."""
    kwargs = dict(body.chat_template_kwargs or {})
    own = {k for k, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if p.kind is not inspect.Parameter.VAR_KEYWORD}
    for k in kwargs:
        if k in own:
            raise APIError(400, f"'chat_template_kwargs.{k}' is an argument of the tokenizer's apply_chat_template, "
                           "not a template variable; it is not supported.", param=f"chat_template_kwargs.{k}",
                           code="unsupported_parameter")
    msgs = [{"role": "system" if m.role == "developer" else m.role,
             "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
            for m in body.messages]
    try:
        enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError (raise_exception in the template) and the like
        if not kwargs:
            raise
        raise APIError(400, f"The chat template failed with 'chat_template_kwargs' {json.dumps(kwargs)[:80]}: "
                       f"{type(e).__name__}: {str(e)[:200]}", param="chat_template_kwargs",
                       code="invalid_value") from None
    return [int(t) for t in enc["input_ids"]]


def _sampling_params(kind: str, body: _Common, budget: int, budget_param: str,
                     default_temperature: float) -> SamplingParams:
    """The request's sampling fields as the engine's :class:`SamplingParams` (absent = the engine's neutral
    default), checked by :meth:`SamplingParams.validate` - the one home of their ranges - whose error names the
    request field. Logprobs: chat ``logprobs: true`` + ``top_logprobs`` k; completions ``logprobs`` k (OpenAI's
    two spellings of "the chosen token's log-probability and the k most likely alternatives")."""
    if kind == "chat":
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")
        logprobs, logprobs_param = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
    else:
        logprobs, logprobs_param = body.logprobs, "logprobs"
    given = {"temperature": default_temperature if body.temperature is None else body.temperature,
             "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k, "min_p": body.min_p,
             "repetition_penalty": body.repetition_penalty, "frequency_penalty": body.frequency_penalty,
             "presence_penalty": body.presence_penalty, "min_tokens": body.min_tokens, "ignore_eos": body.ignore_eos,
             "logprobs": logprobs}
    params = SamplingParams(max_new_tokens=budget, **{k: v for k, v in given.items() if v is not None})
    try:
        params.validate()
    except ValueError as e:
        name, rest = str(e).split(" ", 1)
        param = {"max_new_tokens": budget_param, "logprobs": logprobs_param}.get(name, name)
        rest = rest.replace("max_new_tokens=", f"{budget_param}=")  # the engine's names -> the request's
        raise APIError(400, f"Invalid value for '{param}': {param} {rest}.", param=param,
                       code="invalid_value") from None
    return params


# ------------------------------------------------------------------------------------------ detokenisation
class TextStream:
    """Committed token ids -> text deltas, never splitting a UTF-8 character, cut at stop strings.

    The incremental rule of vLLM's ``detokenize_incrementally``: decode a short window before the new
    tokens and the window with them; emit the difference only when it does not end in U+FFFD (an
    incomplete byte sequence). Text that could be the start of a stop string is held back until it is
    known not to be one. Feed tokens one at a time so a stop inside a multi-token step is exact.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: stop strings; hidden_ids: ids whose text is never returned (user stop token ids).
        include_stop: the stop string that ends the text stays in it (vLLM's ``include_stop_str_in_output``).
    After the end: :attr:`stop_hit` is the stop string found (None if none), :attr:`last_id` the last token consumed.
    """

    def __init__(self, tokenizer, stop: list[str] = (), hidden_ids: set[int] = frozenset(),
                 include_stop: bool = False):
        self.tok, self.stop, self.hidden = tokenizer, list(stop), set(hidden_ids)
        self.include_stop = include_stop
        self.stop_hit: str | None = None
        self.last_id: int | None = None
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""  # decoded so far (complete characters)
        self.emitted = 0  # chars of ``text`` already returned
        self.num_tokens = 0  # tokens consumed (the completion's token count)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Consume one committed token; returns the text now safe to send (maybe ""). After a stop string
        is found, :attr:`stopped` is True and further tokens are ignored."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        self.last_id = token_id
        if token_id in self.hidden:
            return self._release()
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def _release(self, final: bool = False) -> str:
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at, self.stop_hit = min(hits, key=lambda h: (h[0], -len(h[1])))  # the first; the longest there
                self.text = self.text[:at + len(self.stop_hit) if self.include_stop else at]
                self.stopped = final = True
        end = len(self.text)
        if self.stop and not final:  # hold back a suffix that may grow into a stop string
            for k in range(min(max(len(s) for s in self.stop) - 1, end - self.emitted), 0, -1):
                if any(s.startswith(self.text[end - k:]) for s in self.stop):
                    end -= k
                    break
        out, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return out

    def finish(self) -> str:
        """The rest of the text at the end of the request (an incomplete trailing byte sequence is
        decoded with U+FFFD, as a full decode would)."""
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
        return self._release(final=True)
