"""Prompt lookup and suffix lookup on the device, inside the engine step (tensor ops only: no host sync, static
shapes, CUDA-graph safe).

The host lookups (:mod:`adaflash_ray.drafting.lookup`) cost Python time per request per step; here the runner keeps
every slot's tokens on the device (:attr:`DeviceLookup.history` ``[num_slots, max_seq_len + max_draft + 1]`` int64,
the prompt written at prefill and the committed tokens in every step at their absolute positions) and, at the END of
a step whose :class:`~adaflash_ray.engine.runner.StepKey` has ``lookup`` on, proposes every row's next lookup draft from
its new context (prompt + committed output up to and including the new anchor). The proposals travel to the host
in the step's one device -> host transfer (:data:`NUM_META` + ``max_draft`` columns of the runner's ``out``) and
stay on the device (:attr:`DeviceLookup.drafts`), so the next step verifies them without copying them back in.

Rules (prompt lookup decoding, Saxena 2023; vLLM's ``ngram`` speculator) - the same as
:meth:`~adaflash_ray.drafting.lookup.ContextIndex.propose`:

- context = the row's first ``L`` tokens; for ``n`` from ``max_ngram`` down to ``min_ngram`` (and ``n <= L``), an
  occurrence of the last ``n`` tokens is a continuation start ``p`` with ``n <= p <= L - 1`` and
  ``context[p-n:p] == context[L-n:L]`` (it may overlap the suffix itself; ``p = L`` - the suffix - is not one);
- the first ``n`` with an occurrence wins; the proposal is the continuation ``context[p*:p* + max_draft]`` of the
  LATEST occurrence ``p*`` (fewer tokens where the context ends);
- ``num_occurrences`` = occurrences of the winning n-gram, at most ``max_occurrences`` (the host index's bound).

Suffix lookup (``suffix``; SuffixDecoding, Oliaro et al., arXiv 2411.04975) adds a corpus of earlier requests: a
ring buffer :attr:`DeviceLookup.corpus` of ``corpus_tokens`` token ids, each finished request's prompt + output
appended followed by :data:`SEPARATOR` (which matches nothing), the oldest tokens overwritten first (the copy to the
device happens in the engine step in which requests finished: a phase's finished requests - the prefill's, the
decode's - in one :meth:`DeviceLookup.add_sequences`). The corpus match follows the same rules
(a continuation ends at its sequence's separator); between the row's own context and the corpus the longer match
wins, the context's at equal length (as :class:`~adaflash_ray.drafting.lookup.SuffixState`). Two differences from
the host :class:`~adaflash_ray.drafting.lookup.SuffixCorpus`, which stays the offline baseline (``lookup_tau``): the
corpus continuation is the LATEST occurrence's, not the most frequent walk; and eviction overwrites tokens (the
oldest sequence may be cut at its start) instead of dropping whole sequences.

Cost: O(rows x context window x max_ngram) elementwise for the context, O(rows x corpus_tokens x max_ngram) for the
corpus - as tensor ops about 70 kernels for the context and 60 for the corpus per step, on CUDA three Triton kernels
(:mod:`adaflash_ray.kernels.lookup_triton`, the same values); fine on a GPU for corpora of ~64k-256k tokens (at 64 rows and 256k tokens each n-gram level
compares 16M int64 pairs), on a CPU only for small ones.
"""
from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Sequence

import numpy as np
import torch

__all__ = ["DeviceLookup", "LookupProposals", "NUM_META", "SEPARATOR", "context_proposals", "corpus_proposals"]

#: the corpus separator (after each sequence, and in never-written cells): no token id, no suffix value equals it
SEPARATOR = -3
_NO_SUFFIX = -2  # a suffix position before the context's start
_PAD = -1  # a context position before 0
#: columns after the ``max_draft`` proposal tokens in the packed host rows: length, match length, occurrences, source
NUM_META = 4
#: the ``source`` column's codes
SOURCE_CODES = ("context", "corpus")


class LookupProposals(NamedTuple):
    """One lookup proposal per row (all ``[B]`` int64 but ``tokens`` ``[B, max_draft]`` int64).

    tokens: the continuation (entries past ``length`` are unspecified). length: 0..max_draft (0: no match).
    match_len: ``n`` of the matched suffix n-gram (0: none). num_occurrences: occurrences of it (capped).
    source: 0 = the row's own context, 1 = the corpus (:data:`SOURCE_CODES`).
    """

    tokens: torch.Tensor
    length: torch.Tensor
    match_len: torch.Tensor
    num_occurrences: torch.Tensor
    source: torch.Tensor


def _suffix(context: torch.Tensor, lengths: torch.Tensor, max_ngram: int) -> torch.Tensor:
    """``[B, N]``: column j = the row's token at ``L - 1 - j`` (:data:`_NO_SUFFIX` before the context's start)."""
    idx = lengths[:, None] - 1 - torch.arange(max_ngram, device=context.device)  # [B, N]
    suf = context.gather(1, idx.clamp(min=0))
    return torch.where(idx >= 0, suf, torch.full_like(suf, _NO_SUFFIX))


def _pick(run: torch.Tensor, order: torch.Tensor, min_ngram: int, max_occurrences: int):
    """From match lengths ``run`` ``[B, P]`` (0 at invalid candidates) and a recency ``order`` ``[B or 1, P]``
    (larger = newer): the winning n ``[B]`` (0 below min_ngram), the latest hit's candidate index ``[B]`` and the
    capped hit count ``[B]``."""
    n = run.amax(1).long()  # [B]
    n = torch.where(n >= min_ngram, n, torch.zeros_like(n))
    hit = (run.long() >= n[:, None]) & (n[:, None] > 0)  # [B, P]
    latest = torch.where(hit, order, torch.full_like(order, -1)).argmax(1)  # [B]
    return n, latest, hit.sum(1).clamp(max=max_occurrences)


def context_proposals(context: torch.Tensor, lengths: torch.Tensor, max_ngram: int, max_draft: int,
                      min_ngram: int = 1, max_occurrences: int = 8) -> LookupProposals:
    """Prompt lookup of every row in its own context (module docstring's rules).

    Args:
        context: ``[B, H]`` int64 token ids; row b's context is ``context[b, :lengths[b]]`` (later entries ignored).
        lengths: ``[B]`` int64, ``0 <= L <= H``.
        max_ngram, min_ngram: n-gram lengths tried, longest first (``1 <= min_ngram <= max_ngram <= 127``).
        max_draft: proposal tokens per row (>= 1). max_occurrences: the occurrence count's cap.
    Returns:
        :class:`LookupProposals` (source 0).
    """
    b, h = context.shape
    dev = context.device
    suf = _suffix(context, lengths, max_ngram)  # [B, N]
    cand = torch.arange(h, device=dev)  # continuation start p
    valid = (cand[None] >= 1) & (cand[None] < lengths[:, None])  # [B, H]
    padded = torch.cat([torch.full((b, max_ngram), _PAD, dtype=context.dtype, device=dev), context], 1)
    cur = valid
    run = torch.zeros(b, h, dtype=torch.int8, device=dev)
    for j in range(max_ngram):  # the token before p - 1 - j: padded column p - 1 - j + N
        cur = cur & (padded[:, max_ngram - 1 - j:max_ngram - 1 - j + h] == suf[:, j:j + 1])
        run += cur.to(torch.int8)
    n, p, count = _pick(run, cand[None].expand(b, h), min_ngram, max_occurrences)
    ar = torch.arange(max_draft, device=dev)
    tokens = context.gather(1, (p[:, None] + ar).clamp(max=h - 1))  # [B, D]
    length = torch.where(n > 0, (lengths - p).clamp(0, max_draft), torch.zeros_like(n))
    z = torch.zeros_like(n)
    return LookupProposals(tokens, length, n, torch.where(n > 0, count, z), z)


def corpus_proposals(corpus: torch.Tensor, head: torch.Tensor, suffix: torch.Tensor, max_draft: int,
                     min_ngram: int = 1, max_occurrences: int = 8) -> LookupProposals:
    """Suffix lookup of every row's suffix in the corpus ring (module docstring's rules; latest occurrence).

    Args:
        corpus: ``[C]`` int64 ring of token ids and :data:`SEPARATOR`. head: ``[1]`` int64, the next write index
            (the oldest token; recency runs from it around to ``head - 1``, the newest).
        suffix: ``[B, N]`` int64, column j the row's token at ``L - 1 - j`` (negative: none).
        max_draft, min_ngram, max_occurrences: as :func:`context_proposals`.
    Returns:
        :class:`LookupProposals` (source 1).
    """
    c = corpus.shape[0]
    b, num_n = suffix.shape
    dev = corpus.device
    cand = torch.arange(c, device=dev)
    cur = (corpus != SEPARATOR)[None].expand(b, c)  # a continuation start holds a token of its sequence
    run = torch.zeros(b, c, dtype=torch.int8, device=dev)
    for j in range(num_n):  # the token at p - 1 - j (mod C)
        cur = cur & (torch.roll(corpus, j + 1)[None] == suffix[:, j:j + 1])
        run += cur.to(torch.int8)
    order = (cand - head) % c  # [C]: 0 = oldest
    n, start, count = _pick(run, order[None].expand(b, c), min_ngram, max_occurrences)  # start: latest occurrence's
    tokens = corpus[(start[:, None] + torch.arange(max_draft, device=dev)) % c]  # [B, D]
    live = torch.cumprod((tokens != SEPARATOR).long(), 1)  # a continuation ends at its separator
    length = torch.where(n > 0, live.sum(1), torch.zeros_like(n))
    return LookupProposals(tokens, length, n, torch.where(n > 0, count, torch.zeros_like(n)), torch.ones_like(n))


class DeviceLookup:
    """Per-slot token history, the optional corpus ring and the latest proposals, on one device.

    Args:
        num_slots, max_seq_len: the runner's KV slots and positions per slot.
        max_draft: proposal tokens per row (the runner's ``max_draft``).
        device: where the tensors live.
        max_ngram, min_ngram: n-gram lengths tried (``1 <= min_ngram <= max_ngram <= 127``).
        max_occurrences: the occurrence count's cap (>= 1).
        corpus_tokens: the corpus ring's size in tokens (0 = prompt lookup only; else >= max_ngram + 2).
        kernel: ``"auto"`` (the Triton kernels of :mod:`adaflash_ray.kernels.lookup_triton` on CUDA when Triton is
            present and ``ADAFLASH_FUSED_KERNELS`` is not off: three launches per step instead of ~130 tensor ops),
            ``"torch"`` (the tensor ops: the reference, and CPUs) or ``"triton"`` (also under Triton's CPU
            interpreter).
    Raises:
        ValueError: a bad n-gram range, ``max_occurrences < 1``, a corpus too small for one n-gram, an unknown
            ``kernel`` or ``"triton"`` where Triton cannot launch.
    """

    def __init__(self, num_slots: int, max_seq_len: int, max_draft: int, device, *, max_ngram: int = 3,
                 min_ngram: int = 1, max_occurrences: int = 8, corpus_tokens: int = 0, kernel: str = "auto"):
        if not 1 <= min_ngram <= max_ngram <= 127 or max_occurrences < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram <= 127 and max_occurrences >= 1, got {min_ngram}, "
                             f"{max_ngram}, {max_occurrences}")
        if corpus_tokens and corpus_tokens < max_ngram + 2:
            raise ValueError(f"corpus_tokens {corpus_tokens}: need 0 or >= max_ngram + 2 = {max_ngram + 2}")
        self.max_draft, self.max_ngram, self.min_ngram = max_draft, max_ngram, min_ngram
        self.max_occurrences, self.corpus_tokens = max_occurrences, corpus_tokens
        # [S, T + max_draft + 1]: a step writes all its W <= max_draft + 1 committed columns from the anchor on, past
        # position T - 1 too (write_committed), so no two columns of a row ever meet in one cell
        self.history = torch.zeros(num_slots, max_seq_len + max_draft + 1, dtype=torch.long, device=device)
        self.drafts = torch.zeros(num_slots, max_draft, dtype=torch.long, device=device)  # latest proposals [S, D]
        self.corpus = (torch.full((corpus_tokens,), SEPARATOR, dtype=torch.long, device=device)
                       if corpus_tokens else None)  # [C]
        self.corpus_head = torch.zeros(1, dtype=torch.long, device=device)
        self._head = 0  # host copy of corpus_head
        # add_sequences' host staging ring (allocated at the first add) and the tokens staged since the last wait
        self._staging: torch.Tensor | None = None
        self._staged = 0
        self.num_corpus_written = 0  # tokens (separators included) ever written to the ring
        from adaflash_ray.kernels.triton_support import env_mode, triton_usable

        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel {kernel!r}: expected auto, torch or triton")
        dev = torch.device(device)
        if kernel == "triton" and not triton_usable(dev):
            raise ValueError(f"kernel 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1), got {dev}")
        # the Triton path bound to this lookup's scratch and settings (None: the tensor ops)
        self._triton_packed = None
        if kernel == "triton" or (kernel == "auto" and dev.type == "cuda" and triton_usable(dev)
                                  and env_mode() != "off"):
            from adaflash_ray.kernels.lookup_triton import LookupScratch, lookup_packed_triton

            self._triton_packed = functools.partial(
                lookup_packed_triton, scratch=LookupScratch(num_slots, max_ngram, dev), max_ngram=max_ngram,
                min_ngram=min_ngram, max_occurrences=max_occurrences, max_draft=max_draft, corpus=self.corpus,
                corpus_head=self.corpus_head, sep=SEPARATOR)
            # compile every kernel variant now, eagerly: a first launch inside a CUDA-graph capture could not
            try:
                self.propose_packed(slice(0, 1), self.history[:1, :1], torch.zeros(1, dtype=torch.long, device=dev))
            except Exception as e:  # noqa: BLE001 - a Triton build that cannot compile here: the tensor ops instead
                if kernel == "triton":
                    raise
                warnings.warn(f"device lookup: the Triton kernels failed to compile ({e!r:.300}); using tensor ops")
                self._triton_packed = None
            self.drafts.zero_()

    @property
    def use_triton(self) -> bool:
        """Whether :meth:`propose_packed` runs the Triton kernels (:mod:`adaflash_ray.kernels.lookup_triton`)."""
        return self._triton_packed is not None

    @property
    def num_cols(self) -> int:
        """Columns of one packed proposal row: ``max_draft`` tokens + :data:`NUM_META`."""
        return self.max_draft + NUM_META

    # ------------------------------------------------------------------ history
    def write_prompts(self, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
                      first: torch.Tensor) -> None:
        """Prefill: slot ``slots[i]`` holds ``ids[i, :lengths[i]]`` then ``first[i]`` (the first output token).
        ``ids`` ``[N, P]`` int64 (right-padded, ``P <= max_seq_len``), ``slots`` / ``lengths`` / ``first`` ``[N]``
        int64. Two writes: the padded rows whole (the padding past a prompt lands in cells no proposal reads - past its
        context - and the step writes its tokens over them), then each first token at its prompt's length."""
        self.history[slots, :ids.shape[1]] = ids
        self.history[slots, lengths] = first

    def write_committed(self, b: int, pos: torch.Tensor, committed: torch.Tensor, accepted: torch.Tensor) -> None:
        """Step: row r (slot r, r < b) commits ``committed[r, :accepted[r] + 1]`` at positions ``pos[r] + 1 ..``
        (the anchor sits at ``pos[r]``). All ``W`` columns are written, one scatter: the cells past ``accepted``
        take the step's rejected drafts, past the row's context like the cells a slot's earlier request left - no
        proposal reads past its context's length, and the next step writes its tokens over them. ``pos`` /
        ``accepted`` ``[B]`` (``pos`` <= ``max_seq_len`` - 1), ``committed`` ``[B, W]`` int64, ``W`` <= ``max_draft``
        + 1. Graph-safe."""
        w = committed.shape[1]
        tgt = pos[:, None] + 1 if w == 1 else pos[:, None] + torch.arange(1, w + 1, device=pos.device)  # [B, W]
        self.history[:b].scatter_(1, tgt.clamp(max=self.history.shape[1] - 1), committed)

    # ------------------------------------------------------------------ proposals
    def propose(self, context: torch.Tensor, lengths: torch.Tensor) -> LookupProposals:
        """The proposal of every row: prompt lookup in ``context`` ``[B, H]`` (first ``lengths`` ``[B]`` tokens of
        each row), and with a corpus the longer of that and the corpus match (ties: the context's). Graph-safe."""
        own = context_proposals(context, lengths, self.max_ngram, self.max_draft, self.min_ngram,
                                self.max_occurrences)
        if self.corpus is None:
            return own
        other = corpus_proposals(self.corpus, self.corpus_head, _suffix(context, lengths, self.max_ngram),
                                 self.max_draft, self.min_ngram, self.max_occurrences)
        take = other.match_len > own.match_len  # [B]
        return LookupProposals(*(torch.where(take[:, None] if a.dim() == 2 else take, o, a)
                                 for a, o in zip(own, other)))

    def _propose_clean(self, context: torch.Tensor, lengths: torch.Tensor) -> LookupProposals:
        """:meth:`propose` with the tokens past each proposal's length set to 0 (a valid id: a verify step feeds
        them to the target beyond the row's γ, where they are masked)."""
        prop = self.propose(context, lengths)
        keep = torch.arange(self.max_draft, device=context.device)[None] < prop.length[:, None]
        return prop._replace(tokens=torch.where(keep, prop.tokens, torch.zeros_like(prop.tokens)))

    def propose_packed(self, rows, context: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """:meth:`propose`, its tokens kept in :attr:`drafts` (rows ``rows``: a slice or ``[B]`` slot ids); returns
        the packed proposals ``[B, num_cols]`` int64 (tokens, length, match_len, num_occurrences, source); with
        :attr:`use_triton` by :func:`~adaflash_ray.kernels.lookup_triton.lookup_packed_triton` (the same values)."""
        if self._triton_packed is not None:
            packed = self._triton_packed(context, lengths)
            self.drafts[rows] = packed[:, :self.max_draft]
            return packed
        prop = self._propose_clean(context, lengths)
        self.drafts[rows] = prop.tokens
        return torch.cat([prop.tokens, torch.stack([prop.length, prop.match_len, prop.num_occurrences,
                                                     prop.source], 1)], 1)

    # ------------------------------------------------------------------ corpus (host side)
    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Append a finished request's tokens + :data:`SEPARATOR` to the corpus ring: :meth:`add_sequences` of one."""
        self.add_sequences([tokens])

    def add_sequences(self, sequences: Sequence[Sequence[int]]) -> None:
        """Append finished requests' tokens, each followed by :data:`SEPARATOR`, to the corpus ring in order,
        overwriting the oldest; a sequence longer than the ring keeps its last ``corpus_tokens - 1`` tokens. The ring
        ends as it would after one append per sequence, but the whole batch goes through a host staging ring laid out
        as the device ring (pinned on CUDA) in one or two slice copies and one head update, asynchronous on CUDA -
        no index tensor, no wait for the device: a step in which many requests finish pays a few launches, not a few
        per request. Of a batch longer than the ring only its last ``corpus_tokens`` tokens are written (the earlier
        ones would be overwritten within the batch). Before the staging ring would overwrite tokens whose copy may
        still be in flight (``corpus_tokens`` written since the last wait), the stream is synchronised once. Raises
        ValueError without a corpus."""
        if self.corpus is None:
            raise ValueError("this DeviceLookup has no corpus (corpus_tokens=0)")
        c = self.corpus_tokens
        stream: list[int] = []
        for tokens in sequences:
            stream += list(tokens)[-(c - 1):]
            stream.append(SEPARATOR)
        total = len(stream)
        if not total:
            return
        seq = stream[-c:]  # a batch longer than the ring: its last c tokens, written where the full batch ends
        n = len(seq)
        h = (self._head + total - n) % c
        cuda = self.corpus.is_cuda
        if self._staging is None:
            self._staging = torch.empty(c, dtype=torch.long, pin_memory=cuda)
        if cuda and self._staged + n > c:
            torch.cuda.current_stream(self.corpus.device).synchronize()
            self._staged = 0
        first = min(n, c - h)
        stage = self._staging.numpy()
        stage[h:h + first] = seq[:first]
        self.corpus[h:h + first].copy_(self._staging[h:h + first], non_blocking=cuda)
        if first < n:  # the ring wraps: the rest from its start
            stage[:n - first] = seq[first:]
            self.corpus[:n - first].copy_(self._staging[:n - first], non_blocking=cuda)
        self._head = (h + n) % c
        self.corpus_head.fill_(self._head)
        self._staged += n
        self.num_corpus_written += total

    def reset_corpus(self, sequences: Sequence[Sequence[int]] = ()) -> None:
        """Empty the ring (every cell :data:`SEPARATOR`), then :meth:`add_sequences` of ``sequences``."""
        if self.corpus is None:
            raise ValueError("this DeviceLookup has no corpus (corpus_tokens=0)")
        self.corpus.fill_(SEPARATOR)
        self._head, self.num_corpus_written = 0, 0
        self.corpus_head.zero_()
        self.add_sequences(sequences)
