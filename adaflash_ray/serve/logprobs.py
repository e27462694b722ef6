"""Per-token log-probabilities in OpenAI's response shapes (Ray-free, engine-free).

The engine gives, per output token, the chosen token's log-probability under the target's raw distribution
and the top-k ``(token id, logprob)`` alternatives (``Request.output_logprobs`` / ``output_top_logprobs``).
:class:`LogprobFormatter` writes them as

- chat (https://platform.openai.com/docs/api-reference/chat/object, ``choices[].logprobs``):
  ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"} x k]}]}``;
- completions (https://platform.openai.com/docs/api-reference/completions/object, ``choices[].logprobs``):
  ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, where each
  ``top_logprobs`` entry holds the chosen token and the top k (vLLM's ``_create_completion_logprobs``,
  vllm/entrypoints/openai/serving_completion.py) and ``text_offset`` is the running sum of the token strings'
  lengths from the start of the completion (vLLM's rule, the same when streaming and not).

A token's string is ``tokenizer.decode([id])`` (special tokens kept), as vLLM's ``convert_ids_list_to_tokens``;
its ``bytes`` are the token's own UTF-8 bytes - for a byte-level BPE tokenizer the raw bytes of its piece, so the
bytes of a character split over two tokens join up, as OpenAI's do - else the string's UTF-8 encoding.
``-inf`` is written as -9999.0 (vLLM's floor: JSON has no infinity).
"""
from __future__ import annotations

import json
import math

__all__ = ["LogprobFormatter"]

_FLOOR = -9999.0


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char -> byte (``bytes_to_unicode`` in openai/gpt-2 src/encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tokenizer) -> bool:
    try:
        return json.loads(tokenizer.backend_tokenizer.to_str())["decoder"]["type"] == "ByteLevel"
    except Exception:  # noqa: BLE001 - a slow or non-BPE tokenizer: fall back to the decoded string's bytes
        return False


def _lp(x: float) -> float:
    return _FLOOR if math.isnan(x) or x < _FLOOR else float(x)


class LogprobFormatter:
    """One choice's log-probabilities, chunk by chunk, in the chat or completions shape.

    Args:
        tokenizer: a Hugging Face tokenizer. kind: "chat" or "completion". num_top: the k alternatives asked for
            (chat ``top_logprobs``, completions ``logprobs``); each entry given to :meth:`format` holds at least k.
    """

    def __init__(self, tokenizer, kind: str, num_top: int):
        self.tok, self.kind, self.num_top = tokenizer, kind, num_top
        self.text_offset = 0  # completions: where the next token's string starts
        self._bytes = _byte_decoder() if _is_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            raw = None
            if self._bytes is not None:
                piece = self.tok.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in self._bytes for c in piece):
                    raw = [self._bytes[c] for c in piece]
            hit = self._cache[token_id] = (text, raw if raw is not None else list(text.encode("utf-8")))
        return hit

    def format(self, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict:
        """``entries``: ``(token id, logprob, [(top id, top logprob), ...])`` per output token, in order.
        Returns this chunk's ``choices[].logprobs`` object (the whole completion's when given all tokens)."""
        k = self.num_top
        if self.kind == "chat":
            content = []
            for tid, lp, top in entries:
                text, raw = self._token(tid)
                alts = [{"token": t, "logprob": _lp(v), "bytes": b}
                        for (t, b), v in ((self._token(i), v) for i, v in top[:k])]
                content.append({"token": text, "logprob": _lp(lp), "bytes": raw, "top_logprobs": alts})
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, top in entries:
            text, _ = self._token(tid)
            alts = {text: _lp(lp)}
            for i, v in top[:k]:
                alts.setdefault(self._token(i)[0], _lp(v))
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(lp))
            out["top_logprobs"].append(alts)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out
