"""Draft sources that cost no model: prompt lookup and suffix lookup, with an offline τ evaluator.

Two proposers, one implementation (pure Python, CPU host, no torch):

- **prompt lookup** (``ngram``; Saxena's "prompt lookup decoding", vLLM's ``ngram`` speculator): the last
  ``n`` tokens of the request's own context (prompt + output so far), ``n`` from ``max_ngram`` down to
  ``min_ngram``; the first ``n`` that occurred earlier in the context wins and the proposal is the
  continuation of its LATEST earlier occurrence, up to ``k`` tokens (fewer where the context ends first);
- **suffix lookup** (``suffix``; SuffixDecoding, Oliaro et al., arXiv 2411.04975): the same on the request's
  own context, plus a bounded :class:`SuffixCorpus` of earlier requests' token sequences (prompt + output),
  one per replica. The corpus proposes, like SuffixDecoding's global suffix tree, the MOST FREQUENT
  continuation among the recorded occurrences of the matched suffix (built token by token: at each depth the
  most frequent next token among the occurrences that still agree, ties to the latest). Between the two,
  the longer match wins; at equal match length the request's own context (:class:`SuffixState`).

Every :class:`Proposal` carries its match length and, per proposed token, how many of the considered
occurrences agree with the proposal up to there (``counts``, out of ``num_occurrences``): SuffixDecoding's
empirical continuation probabilities, from which a policy can estimate acceptance
(:meth:`Proposal.expected_accepted`).

Incremental: the engine calls a state once per decode step per request. :class:`ContextIndex` keeps a
hashed index ``n-gram -> its latest occurrences`` (a bounded deque of continuation starts per n-gram) that
:meth:`ContextIndex.extend` updates in O(new tokens x max_ngram); :meth:`ContextIndex.propose` costs
O(max_ngram + max_occurrences x k), whatever the context's length. The corpus index is the same, with
sequences evicted first-in first-out once its token budget is exceeded.

Offline evaluation (:func:`lookup_tau`, :func:`lookup_tau_by_domain`): greedy verification simulated over a
finished greedy output. τ = committed tokens per verify step = mean(a + 1) (docs/design/ALGORITHMS.md §0).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

__all__ = [
    "ContextIndex",
    "LookupState",
    "MAX_DRAFT",
    "PromptLookup",
    "Proposal",
    "Proposer",
    "SuffixCorpus",
    "SuffixLookup",
    "SuffixState",
    "greedy_verify_steps",
    "lookup_tau",
    "lookup_tau_by_domain",
]

#: the longest proposal any lookup makes: block_size - 1 of the 16-position DFlash block it stands beside
MAX_DRAFT = 15

_SEQ_SHIFT = 32  # corpus occurrence code = (sequence id << 32) | continuation start


@dataclass(frozen=True)
class Proposal:
    """A lookup's draft for the next tokens of one request.

    Attributes:
        tokens: the proposed continuation, ``0 <= len(tokens) <= k`` token ids (empty: no match).
        match_len: ``n`` of the matched suffix n-gram (tokens); 0 when nothing matched.
        source: ``"context"`` (the request's own tokens), ``"corpus"`` (earlier requests) or ``"none"``.
        counts: ``len(tokens)`` ints, non-increasing: ``counts[i]`` of the ``num_occurrences`` considered
            occurrences of the matched n-gram continue with ``tokens[: i + 1]``.
        num_occurrences: occurrences of the matched n-gram considered (the latest ones, at most the index's
            ``max_occurrences``); 0 when nothing matched.
    """

    tokens: list[int] = field(default_factory=list)
    match_len: int = 0
    source: str = "none"
    counts: list[int] = field(default_factory=list)
    num_occurrences: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix_probs(self) -> list[float]:
        """``counts[i] / num_occurrences``: the empirical probability that the true continuation starts with
        ``tokens[: i + 1]`` (SuffixDecoding's path score); [] for an empty proposal."""
        return [c / self.num_occurrences for c in self.counts] if self.num_occurrences else []

    def expected_accepted(self) -> float:
        """Expected accepted length E[a] = sum_i P(true continuation starts with tokens[:i+1]), by the
        empirical prefix probabilities (tokens; 0.0 for an empty proposal)."""
        return float(sum(self.prefix_probs()))


_NO_PROPOSAL = Proposal()


def _check_ngram_range(max_ngram: int, min_ngram: int) -> None:
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram} max_ngram={max_ngram}")


def _walk(continuations: list[Sequence[int]], k: int, frequent: bool) -> tuple[list[int], list[int]]:
    """The proposal over ``continuations`` (newest first; each the tokens after one occurrence) and its
    per-position agreement counts.

    ``frequent=False``: the newest continuation, cut to ``k``; ``frequent=True``: built token by token, the
    most frequent next token among the continuations that still agree (ties: the newest). Cost O(len x k).
    """
    live = continuations
    tokens: list[int] = []
    counts: list[int] = []
    for depth in range(k):
        live = [c for c in live if len(c) > depth]
        if not live:
            break
        if frequent:
            tally: dict[int, int] = {}
            for c in live:  # dicts keep insertion order: max() then prefers the newest of equal counts
                tally[c[depth]] = tally.get(c[depth], 0) + 1
            tok = max(tally, key=tally.__getitem__)
        else:
            if len(continuations[0]) <= depth:
                break
            tok = continuations[0][depth]
        live = [c for c in live if c[depth] == tok]
        tokens.append(int(tok))
        counts.append(len(live))
    return tokens, counts


def _index_positions(index: dict[tuple[int, ...], deque[int]], seq: list[int], start: int, stop: int, base: int,
                     max_ngram: int, cap: int) -> None:
    """Record, for every position ``pos`` in ``[start, stop)``, ``base | pos`` as the continuation of each
    n-gram ``seq[pos - n:pos]`` (``n`` in ``1..max_ngram``): O((stop - start) x max_ngram)."""
    for pos in range(max(start, 1), stop):
        for n in range(1, min(max_ngram, pos) + 1):
            key = tuple(seq[pos - n:pos])
            occ = index.get(key)
            if occ is None:
                index[key] = occ = deque(maxlen=cap)
            occ.append(base | pos)


def _lookup_lengths(indexed: int, k: int, min_ngram: int, max_ngram: int | None, length: int) -> range:
    """The n-gram lengths a lookup tries, longest first: ``min(max_ngram, length)`` down to ``min_ngram``
    (empty for ``k == 0``). Raises ValueError for ``k < 0``, a bad range or ``max_ngram > indexed``."""
    top = indexed if max_ngram is None else max_ngram
    _check_ngram_range(top, min_ngram)
    if top > indexed:
        raise ValueError(f"max_ngram {top} exceeds the {indexed} the index holds")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return range(min(top, length), min_ngram - 1, -1) if k else range(0)


class ContextIndex:
    """One request's token context (prompt + output so far) and its hashed n-gram index.

    For every ``n`` in ``1..max_ngram`` the index maps each n-gram (a tuple of token ids) to the start
    positions of the tokens that followed its latest ``max_occurrences`` occurrences. An n-gram ending at the
    context's last token is not indexed until a token follows it, so a lookup of the context's own suffix
    finds only EARLIER occurrences.

    Args:
        tokens: the initial context (token ids; typically the chat-templated prompt).
        max_ngram: the longest n-gram indexed and looked up (tokens, >= 1).
        max_occurrences: occurrences remembered per n-gram (>= 1; the proposal's ``num_occurrences`` bound).
    Raises:
        ValueError: ``max_ngram < 1`` or ``max_occurrences < 1``.
    """

    def __init__(self, tokens: Iterable[int] = (), max_ngram: int = 3, max_occurrences: int = 8):
        _check_ngram_range(max_ngram, 1)
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {max_occurrences}")
        self.max_ngram, self.max_occurrences = max_ngram, max_occurrences
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], deque[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """The context (token ids; the live list - do not modify it)."""
        return self._tokens

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (committed output) and index the n-grams they complete: O(len(tokens) x max_ngram)."""
        start = len(self._tokens)
        self._tokens.extend(int(t) for t in tokens)
        _index_positions(self._index, self._tokens, start, len(self._tokens), 0, self.max_ngram,
                         self.max_occurrences)

    def propose(self, k: int = MAX_DRAFT, min_ngram: int = 1, max_ngram: int | None = None) -> Proposal:
        """Prompt lookup: the continuation of the latest earlier occurrence of the context's last ``n``
        tokens, ``n`` from ``max_ngram`` (default: the index's) down to ``min_ngram``, the first ``n`` that
        matches; up to ``k`` tokens (fewer where the context ends first).

        Returns:
            A :class:`Proposal` (``source="context"``), or an empty one when no suffix n-gram occurred
            earlier or ``k == 0``.
        Raises:
            ValueError: ``k < 0`` or a bad n-gram range (``max_ngram`` above the index's included).
        """
        seq = self._tokens
        for n in _lookup_lengths(self.max_ngram, k, min_ngram, max_ngram, len(seq)):
            occ = self._index.get(tuple(seq[len(seq) - n:]))
            if occ:
                conts = [seq[p:p + k] for p in reversed(occ)]  # newest first
                tokens, counts = _walk(conts, k, frequent=False)
                return Proposal(tokens, n, "context", counts, len(conts))
        return _NO_PROPOSAL


class SuffixCorpus:
    """A bounded corpus of earlier requests' token sequences with a hashed n-gram index (one per replica).

    Sequences are added whole (:meth:`add`, typically prompt + output when a request finishes) and evicted
    first-in first-out once the corpus holds more than ``max_tokens`` tokens. Each n-gram (``n`` in
    ``1..max_ngram``) maps to its latest ``max_occurrences`` occurrences (sequence, continuation start).

    Args:
        max_tokens: the token budget (>= 1): after each :meth:`add` the corpus holds at most this many tokens.
        max_ngram: the longest n-gram indexed (tokens, >= 1).
        max_occurrences: occurrences remembered per n-gram (>= 1).
    Raises:
        ValueError: any argument < 1.
    """

    def __init__(self, max_tokens: int = 1 << 20, max_ngram: int = 3, max_occurrences: int = 32):
        _check_ngram_range(max_ngram, 1)
        if max_tokens < 1 or max_occurrences < 1:
            raise ValueError(f"max_tokens and max_occurrences must be >= 1, got {max_tokens}, {max_occurrences}")
        self.max_tokens, self.max_ngram, self.max_occurrences = max_tokens, max_ngram, max_occurrences
        self._seqs: dict[int, list[int]] = {}  # sequence id -> tokens, insertion (= id) order
        self._index: dict[tuple[int, ...], deque[int]] = {}
        self._next_id = 0
        self.num_tokens = 0  # tokens held now
        self.num_evicted = 0  # sequences evicted so far

    @property
    def num_sequences(self) -> int:
        """Sequences held now."""
        return len(self._seqs)

    def sequences(self) -> list[list[int]]:
        """Copies of the held sequences, oldest first."""
        return [list(s) for s in self._seqs.values()]

    def add(self, tokens: Sequence[int]) -> int:
        """Add one sequence (token ids) and evict the oldest ones beyond the budget; returns its id.

        A sequence longer than ``max_tokens`` keeps only its last ``max_tokens`` tokens. Cost
        O(len(tokens) x max_ngram), plus the same for each evicted sequence.
        """
        seq = [int(t) for t in tokens][-self.max_tokens:]
        sid = self._next_id
        self._next_id += 1
        _index_positions(self._index, seq, 1, len(seq), sid << _SEQ_SHIFT, self.max_ngram, self.max_occurrences)
        self._seqs[sid] = seq
        self.num_tokens += len(seq)
        while self.num_tokens > self.max_tokens:
            self._evict_oldest()
        return sid

    def _evict_oldest(self) -> None:
        sid = next(iter(self._seqs))
        seq = self._seqs.pop(sid)
        self.num_tokens -= len(seq)
        self.num_evicted += 1
        # occurrences enter each deque in sequence-id order, so the evicted ones are at its front
        for pos in range(1, len(seq)):
            for n in range(1, min(self.max_ngram, pos) + 1):
                key = tuple(seq[pos - n:pos])
                occ = self._index.get(key)
                if occ is None:
                    continue
                while occ and occ[0] >> _SEQ_SHIFT <= sid:
                    occ.popleft()
                if not occ:
                    del self._index[key]

    def propose(self, context: Sequence[int], k: int = MAX_DRAFT, min_ngram: int = 1,
                max_ngram: int | None = None) -> Proposal:
        """The most frequent corpus continuation of ``context``'s last ``n`` tokens, ``n`` from ``max_ngram``
        (default: the corpus's) down to ``min_ngram``, the first ``n`` the corpus holds; up to ``k`` tokens.

        Args:
            context: the request's tokens (only the last ``max_ngram`` are read).
        Returns:
            A :class:`Proposal` (``source="corpus"``), or an empty one when no suffix n-gram is held or
            ``k == 0``.
        Raises:
            ValueError: ``k < 0`` or a bad n-gram range (``max_ngram`` above the corpus's included).
        """
        mask = (1 << _SEQ_SHIFT) - 1
        for n in _lookup_lengths(self.max_ngram, k, min_ngram, max_ngram, len(context)):
            occ = self._index.get(tuple(int(t) for t in context[len(context) - n:]))
            if occ:
                conts = [self._seqs[code >> _SEQ_SHIFT][(code & mask):(code & mask) + k] for code in reversed(occ)]
                tokens, counts = _walk(conts, k, frequent=True)
                return Proposal(tokens, n, "corpus", counts, len(conts))
        return _NO_PROPOSAL


class LookupState(Protocol):
    """One request's drafting state: fed the committed tokens, asked for a draft each verify step."""

    def extend(self, tokens: Iterable[int]) -> None: ...

    def propose(self, k: int) -> Proposal: ...


class Proposer(Protocol):
    """A draft source: :meth:`begin` makes one request's :class:`LookupState` from its prompt; :meth:`finish`
    is told the request's whole sequence once it is done (a corpus records it; others ignore it)."""

    def begin(self, prompt_ids: Sequence[int]) -> LookupState: ...

    def finish(self, tokens: Sequence[int]) -> None: ...


class PromptLookup:
    """Prompt lookup over each request's own context (:meth:`ContextIndex.propose`).

    Args:
        max_ngram, min_ngram: the n-gram lengths tried, longest first (tokens, 1 <= min <= max).
        max_occurrences: occurrences per n-gram remembered for the proposal's counts.
    Raises:
        ValueError: a bad n-gram range or ``max_occurrences < 1``.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_occurrences: int = 8):
        _check_ngram_range(max_ngram, min_ngram)
        self.max_ngram, self.min_ngram, self.max_occurrences = max_ngram, min_ngram, max_occurrences

    def begin(self, prompt_ids: Sequence[int]) -> _PromptState:
        return _PromptState(ContextIndex(prompt_ids, self.max_ngram, self.max_occurrences), self.min_ngram)

    def finish(self, tokens: Sequence[int]) -> None:
        """Nothing to record: prompt lookup reads only the request's own context."""


class _PromptState:
    def __init__(self, context: ContextIndex, min_ngram: int):
        self.context, self.min_ngram = context, min_ngram

    def extend(self, tokens: Iterable[int]) -> None:
        self.context.extend(tokens)

    def propose(self, k: int) -> Proposal:
        return self.context.propose(k, self.min_ngram)


class SuffixState:
    """One request's suffix-lookup state: its :class:`ContextIndex` and the replica's :class:`SuffixCorpus`.

    :meth:`propose`: the context's proposal (prompt lookup) and the corpus's; the longer ``match_len`` wins,
    the context's at equal length (the request's own text is the more specific evidence); whichever is
    non-empty when only one is.
    """

    def __init__(self, context: ContextIndex, corpus: SuffixCorpus, min_ngram: int = 1):
        self.context, self.corpus, self.min_ngram = context, corpus, min_ngram

    def extend(self, tokens: Iterable[int]) -> None:
        self.context.extend(tokens)

    def propose(self, k: int) -> Proposal:
        own = self.context.propose(k, self.min_ngram)
        if own.match_len >= self.corpus.max_ngram:  # the corpus cannot match longer
            return own
        other = self.corpus.propose(self.context.tokens, k, max(self.min_ngram, own.match_len + 1))
        return other if other.match_len > own.match_len else own


class SuffixLookup:
    """Suffix lookup: prompt lookup on the request's own context plus a shared :class:`SuffixCorpus` of
    earlier requests; :meth:`finish` adds a finished request's sequence to the corpus.

    Args:
        corpus: the replica's corpus (a new one with defaults when None).
        max_ngram, min_ngram: the n-gram lengths tried on the request's context (1 <= min <= max).
        max_occurrences: per n-gram, for the context's index.
    Raises:
        ValueError: a bad n-gram range or ``max_occurrences < 1``.
    """

    def __init__(self, corpus: SuffixCorpus | None = None, max_ngram: int = 3, min_ngram: int = 1,
                 max_occurrences: int = 8):
        _check_ngram_range(max_ngram, min_ngram)
        self.corpus = corpus if corpus is not None else SuffixCorpus()
        self.max_ngram, self.min_ngram, self.max_occurrences = max_ngram, min_ngram, max_occurrences

    def begin(self, prompt_ids: Sequence[int]) -> SuffixState:
        return SuffixState(ContextIndex(prompt_ids, self.max_ngram, self.max_occurrences), self.corpus,
                           self.min_ngram)

    def finish(self, tokens: Sequence[int]) -> None:
        """Record a finished request's whole sequence (prompt + output) in the corpus."""
        self.corpus.add(tokens)


# ------------------------------------------------------------------------------------------ offline τ


def greedy_verify_steps(prompt_ids: Sequence[int], output_ids: Sequence[int], state: LookupState,
                        max_draft: int = MAX_DRAFT) -> list[int]:
    """Simulate greedy verification of ``state``'s drafts over a finished greedy output.

    The first output token comes from the prefill (no verify step, as in the engine); then each step drafts
    ``k = min(max_draft, tokens left - 1)`` tokens from the context ``prompt + output[:pos]``, accepts the
    longest prefix agreeing with ``output[pos:]`` (a tokens) and commits ``a + 1`` (the target's next
    token: correction or bonus), until the output is complete. ``state`` must hold ``prompt_ids`` already
    (``Proposer.begin(prompt_ids)``); it is extended with the whole output.

    Args:
        prompt_ids: the request's prompt (token ids; only for the caller's bookkeeping - ``state`` holds it).
        output_ids: the target's greedy output (token ids, EOS included where it stopped).
        max_draft: the longest draft (tokens, 0 <= max_draft <= :data:`MAX_DRAFT`).
    Returns:
        ``a`` (accepted drafted tokens) of each verify step; [] for an output of <= 1 token.
    Raises:
        ValueError: ``max_draft`` outside ``[0, MAX_DRAFT]``.
    """
    if not 0 <= max_draft <= MAX_DRAFT:
        raise ValueError(f"max_draft must be in [0, {MAX_DRAFT}], got {max_draft}")
    out = [int(t) for t in output_ids]
    accepted: list[int] = []
    if not out:
        return accepted
    state.extend(out[:1])
    pos = 1
    while pos < len(out):
        k = min(max_draft, len(out) - pos - 1)
        draft = state.propose(k).tokens if k > 0 else []
        a = 0
        while a < len(draft) and draft[a] == out[pos + a]:
            a += 1
        accepted.append(a)
        state.extend(out[pos:pos + a + 1])
        pos += a + 1
    return accepted


def lookup_tau(prompt_ids: Sequence[int], output_ids: Sequence[int], proposer: Proposer,
               max_draft: int = MAX_DRAFT) -> float:
    """τ = mean(a + 1) committed tokens per verify step that ``proposer`` would reach on one finished greedy
    output (:func:`greedy_verify_steps`); NaN with no verify step (an output of <= 1 token). Does not call
    ``proposer.finish``: the caller decides what a corpus may see.

    Raises:
        ValueError: ``max_draft`` outside ``[0, MAX_DRAFT]``.
    """
    return _pooled_tau(greedy_verify_steps(prompt_ids, output_ids, proposer.begin(prompt_ids), max_draft))


def lookup_tau_by_domain(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                         domains: Sequence[str], max_draft: int = MAX_DRAFT, max_ngram: int = 3,
                         corpus_tokens: int = 1 << 20) -> dict[str, dict[str, float]]:
    """Prompt-lookup and suffix-lookup τ per domain on finished greedy outputs.

    Requests are taken in the given (evaluation) order. Suffix lookup's corpus is one per domain, empty at
    the domain's first request; request i is drafted against the domain's requests before it (prompt +
    output) and only then added, so the corpus never holds a request's own output. τ pools every verify step
    of the domain: (Σa + #steps) / #steps, as :class:`adaflash_ray.engine.SpecStats` does.

    Args:
        prompts, outputs, domains: aligned per request: prompt token ids, greedy output token ids, domain name.
        max_draft: the longest draft (tokens). max_ngram: n-gram lengths max_ngram..1, for both lookups.
        corpus_tokens: each domain corpus's token budget (FIFO eviction beyond it).
    Returns:
        ``{"ngram": {domain: τ}, "suffix": {domain: τ}}``, domains in first-seen order; τ NaN for a domain
        with no verify step.
    Raises:
        ValueError: the three sequences differ in length, or ``max_draft`` outside ``[0, MAX_DRAFT]``.
    """
    if not len(prompts) == len(outputs) == len(domains):
        raise ValueError(f"prompts, outputs and domains differ in length: {len(prompts)}, {len(outputs)}, "
                         f"{len(domains)}")
    ngram = PromptLookup(max_ngram)
    suffix: dict[str, SuffixLookup] = {}
    steps: dict[str, dict[str, list[int]]] = {"ngram": {}, "suffix": {}}
    for prompt, output, domain in zip(prompts, outputs, domains):
        sfx = suffix.setdefault(domain, SuffixLookup(SuffixCorpus(corpus_tokens, max_ngram), max_ngram))
        for name, proposer in (("ngram", ngram), ("suffix", sfx)):
            steps[name].setdefault(domain, []).extend(
                greedy_verify_steps(prompt, output, proposer.begin(prompt), max_draft))
        sfx.finish(list(prompt) + list(output))
    return {name: {d: _pooled_tau(s) for d, s in by.items()} for name, by in steps.items()}


def _pooled_tau(accepted: Sequence[int]) -> float:
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else math.nan
