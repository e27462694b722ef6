"""Per-request logits processing and the sampling rules of the engine's step: graph-safe (static shapes, no host
synchronisation), so every function here runs inside the captured CUDA graph of :mod:`adaflash_ray.engine.runner`.

Processing follows vLLM v1's sampler, in its order: penalties (repetition over prompt + output tokens, CTRL -
Keskar et al. 2019: ``logit / rp`` if ``logit > 0`` else ``logit * rp``; frequency ``logit -= fp * count`` and
presence ``logit -= pp * (count > 0)`` over the output, OpenAI's definition) -> min_tokens (the request's stop tokens
get ``-inf`` while fewer than ``min_tokens`` tokens are generated) -> [greedy rows take the argmax here] ->
temperature -> min_p (drop tokens below ``min_p`` x the most likely token's probability) -> top_k (ties at the k-th
value kept, as vLLM) -> top_p (nucleus, Holtzman et al. 2020, on the renormalised distribution).

Lossless verification against the processed distribution: in a verify window the distribution at position j
continues ``output + d_1..d_j``, so its penalty counts include those drafts and its min_tokens test counts them as
generated (:func:`window_counts`, the ``index`` of :func:`adjust_logits`). A drafter block's positions are sampled
in parallel, so its q applies the penalties of the committed tokens only - still exactly the distribution the
drafts were drawn from, which is all rejection sampling needs (Leviathan et al. 2023; Chen et al. 2023).

Seeded rows (``SamplingParams.seed``) use drafter-invariant verification (Daliri, Musco, Suresh 2024, "Coupling
without Communication and Drafter-Invariant Speculative Decoding", arXiv 2408.07978): the token at output index k is
the target's own inverse-CDF sample of its processed distribution at the request's uniform ``u_k``
(:func:`seed_uniforms`), drafts are accepted while they equal it, and drafts are drawn from q with the same
``u_k``. The output is then AR sampling driven by the request's stream - the same tokens whatever the batch, γ, draft
source or AR / speculative mode. The paper couples p and q by Gumbel sampling (acceptance >= (1 - TV) / (1 + TV));
one uniform per token (inverse CDF in token-id order, a weaker coupling: accepted often when q is close to p) keeps
the host's share to a slice of floats per seeded row and step, and the device's to one cumsum and searchsorted.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

#: the most top log-probabilities a request may ask for (OpenAI's and vLLM's default limit); a step that computes
#: top log-probabilities computes this many for every row
MAX_TOP_LOGPROBS = 20
#: seeded uniforms are k / 2**UNIFORM_BITS, exact in float32 and < 1
UNIFORM_BITS = 24


class RowSampling(NamedTuple):
    """One forward's per-row processing, device tensors whose rows are the forward's rows. A field is None when no
    row of the batch uses it (its :class:`~adaflash_ray.engine.runner.StepKey` flag is off), so that path costs
    nothing; a row that does not use a parameter present for the batch carries its neutral value.

    temperature ``[B]`` float32 (0 = greedy). top_p, min_p ``[B]`` float32. top_k ``[B]`` int64 (<= 0 or >= V: off).
    penalties ``[B, 3]`` float32 (repetition, frequency, presence); seen_prompt ``[B, V]`` bool (the token occurs in
    the prompt) and counts ``[B, V]`` int32 (occurrences in the committed output) come with it. stop_mask ``[B, V]``
    bool (the request's stop tokens) and min_left ``[B]`` int64 (tokens still to generate before a stop token may
    come, counted from the forward's first position). seeded ``[B]`` bool and uniforms ``[B, U]`` float32 (the
    request's uniforms for output indices from the forward's first position on).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    penalties: torch.Tensor | None = None
    seen_prompt: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    stop_mask: torch.Tensor | None = None
    min_left: torch.Tensor | None = None
    seeded: torch.Tensor | None = None
    uniforms: torch.Tensor | None = None


def seed_uniforms(seed: int, n: int) -> np.ndarray:
    """The random stream of a seeded request: ``n`` float32 uniforms in [0, 1), entry k driving output token k.
    ``torch.Generator().manual_seed(seed)``, ``randint(0, 2**24)`` / 2**24 (exact in float32, never 1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 1 << UNIFORM_BITS, (n,), generator=g).to(torch.float64) / (1 << UNIFORM_BITS)).to(
        torch.float32).numpy()


def window_counts(d: torch.Tensor, width: int, vocab: int) -> torch.Tensor:
    """Counts of the window's earlier drafts: ``[B, W, V]`` float32 whose ``[b, j, v]`` is the number of times v is
    among ``d[b, :j]`` (the drafts a position j of the verify window continues). d ``[B, W-1]`` int64."""
    b, g = d.shape
    hits = torch.zeros(b, width, vocab, dtype=torch.float32, device=d.device)
    if g:
        hits[:, 1:g + 1].scatter_(2, d[..., None], 1.0)
    return hits.cumsum(1)


def adjust_logits(logits: torch.Tensor, rs: RowSampling, index: torch.Tensor,
                  extra_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Penalties and min_tokens (vLLM's argmax-affecting processing; greedy rows take the argmax of the result).

    Args:
        logits: ``[B, N, V]`` (any float dtype).
        rs: the rows' processing (``penalties`` / ``min_left`` None: that part is skipped).
        index: ``[B, N]`` or ``[1, N]`` int64: tokens generated between the forward's first position and each
            position; a position's stop tokens are masked while ``index < rs.min_left``.
        extra_counts: ``[B, N, V]`` float32 added to ``rs.counts`` per position (:func:`window_counts`; consumed:
            the sum is written into it), or None.
    Returns:
        ``[B, N, V]`` float32 (``logits`` itself when neither part applies).
    """
    if rs.penalties is None and rs.min_left is None:
        return logits
    x = logits.float()
    if rs.penalties is not None:  # vLLM's apply_penalties; in place on fresh tensors (a [B, N, V] step: ~3 of them)
        cnt = rs.counts[:, None].float()  # [B, 1, V]
        cnt = extra_counts.add_(cnt) if extra_counts is not None else cnt  # [B, N, V]
        rep, freq, pres = rs.penalties[:, None, None].unbind(-1)  # [B, 1, 1] each
        seen = cnt > 0
        scale = torch.where(x > 0, 1.0 / rep, rep).masked_fill_(~(seen | rs.seen_prompt[:, None]), 1.0)
        x = x * scale  # repetition: logit / rp if > 0 else logit * rp, on prompt + output tokens (vLLM: x * 1/rp)
        del scale
        x.sub_(cnt.mul(freq).add_(seen.to(x.dtype).mul_(pres)))  # frequency x count + presence x (count > 0)
    if rs.min_left is not None:
        under = index < rs.min_left[:, None]  # [B, N]
        x = x.masked_fill(under[..., None] & rs.stop_mask[:, None], float("-inf"))
    return x


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None,
                    min_p: torch.Tensor | None = None, top_k: torch.Tensor | None = None) -> torch.Tensor:
    """Sampling distribution after temperature, min_p, top_k and top_p (in vLLM v1's order), float32.

    logits ``[B, ..., V]`` (already through :func:`adjust_logits`); temperature ``[B]`` (rows with 0 are treated as
    1: greedy rows ignore the result); top_p ``[B]`` in (0, 1] or None (keep the smallest prefix of the sorted
    distribution whose mass reaches top_p); min_p ``[B]`` in [0, 1] or None (drop probabilities below min_p x the
    row's largest); top_k ``[B]`` int64 or None (keep probabilities >= the k-th largest; <= 0 or >= V: off).
    Returns ``[B, ..., V]`` summing to 1.
    """
    shape = (-1,) + (1,) * (logits.dim() - 1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(shape)
    p = torch.softmax(logits.float() / t, dim=-1)
    if min_p is not None:
        p = p.masked_fill(p < min_p.view(shape) * p.amax(-1, keepdim=True), 0.0)
    if top_k is not None or top_p is not None:
        sp, idx = p.sort(dim=-1, descending=True)
        if top_k is not None:
            v = p.shape[-1]
            k = torch.where((top_k > 0) & (top_k < v), top_k, torch.full_like(top_k, v))
            kth = sp.gather(-1, (k - 1).view(shape).expand(*sp.shape[:-1], 1))
            sp = sp.masked_fill(sp < kth, 0.0)
        if min_p is not None or top_k is not None:
            sp = sp / sp.sum(-1, keepdim=True)
        if top_p is not None:
            drop = (sp.cumsum(-1) - sp) > top_p.view(shape)
            sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
    if min_p is not None or top_k is not None or top_p is not None:
        p = p / p.sum(-1, keepdim=True)
    return p


def sample_from(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of ``p`` ``[..., V]`` by the exponential race (argmax p/E, E ~ Exp(1)): exact,
    and unlike ``torch.multinomial`` free of host syncs, so it can be captured in a CUDA graph (gpt-fast)."""
    e = torch.empty_like(p).exponential_(generator=generator)
    return (p / e).argmax(-1)


def sample_inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds ``u``: p ``[..., V]``, u ``[...]`` in [0, 1) -> ``[...]``
    int64. Graph-safe (``searchsorted``). A token of probability 0 is never returned (a float rounding that would
    land on one falls back to the argmax: probability ~2**-24)."""
    c = p.cumsum(-1)
    total = c[..., -1:]
    v = torch.minimum(u[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tok = torch.searchsorted(c, v, right=True).clamp(max=p.shape[-1] - 1)  # [..., 1]
    ok = p.gather(-1, tok) > 0
    return torch.where(ok, tok, p.argmax(-1, keepdim=True))[..., 0]


def match_prefix(d: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's own choice: d ``[B, Γ]``, tokens ``[B, Γ+1]`` (the target's token
    at each window position: its argmax, or a seeded row's sample), live ``[B, Γ]``. Returns (accepted ``[B]``, the
    target's token at the first unaccepted position ``[B]``: the correction or the bonus)."""
    accepted = ((d == tokens[:, :d.shape[1]]) & live).long().cumprod(1).sum(1)
    return accepted, tokens.gather(1, accepted[:, None])[:, 0]


def rejection_sample(d, p, q, live, generator, point=None):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    d ``[B, Γ]`` drafts; p ``[B, Γ+1, V]`` target probs; q ``[B, Γ, V]`` drafter probs (drafts were
    sampled from q) or None (every row is a point mass); live ``[B, Γ]`` marks drafts within each row's γ;
    point ``[B]`` bool or None: rows whose drafts are deterministic (a lookup proposal), i.e. q_i = one-hot(d_i).
    Accept d_i with probability min(1, p_i(d_i)/q_i(d_i)) (a point mass: p_i(d_i)); at the first rejection sample
    from normalize(max(0, p_i - q_i)) (a point mass: p_i with d_i removed, renormalised); if all γ accepted, sample
    the bonus from p_{γ+1}. Returns (accepted ``[B]``, next token ``[B]``).
    """
    b, gm = d.shape
    if gm == 0:
        return torch.zeros(b, dtype=torch.long, device=p.device), sample_from(p[:, 0], generator)
    if q is None:  # no drafter distribution at all: every row's drafts are a point mass
        point = torch.ones(b, dtype=torch.bool, device=p.device)
    pd = p[:, :gm].gather(2, d[..., None])[..., 0]  # [B, Γ]
    qd = q.gather(2, d[..., None])[..., 0] if q is not None else torch.ones_like(pd)
    if point is not None:
        qd = torch.where(point[:, None], torch.ones_like(qd), qd)
    u = torch.rand(pd.shape, generator=generator, device=p.device)
    ok = (u * qd < pd) & live
    accepted = ok.long().cumprod(1).sum(1)  # [B]
    idx = accepted[:, None, None].expand(b, 1, p.shape[-1])
    p_at = p.gather(1, idx)[:, 0]  # [B, V]
    q_at = (torch.cat([q, torch.zeros_like(q[:, :1])], 1).gather(1, idx)[:, 0] if q is not None
            else torch.zeros_like(p_at))
    if point is not None:  # one-hot of the draft at the first rejected position (unused where none was rejected)
        d_at = torch.cat([d, torch.zeros_like(d[:, :1])], 1).gather(1, accepted[:, None])  # [B, 1]
        q_at = torch.where(point[:, None], torch.zeros_like(p_at).scatter_(1, d_at, 1.0), q_at)
    rejected = accepted < live.sum(1)  # stopped before γ: residual; else bonus from p
    resid = (p_at - q_at).clamp(min=0)
    norm = resid.sum(-1, keepdim=True)
    resid = torch.where(norm > 0, resid / norm.clamp(min=1e-30), p_at)
    return accepted, sample_from(torch.where(rejected[:, None], resid, p_at), generator)


def choose_tokens(logits: torch.Tensor, rs: RowSampling, sample: bool, generator: torch.Generator | None,
                  u_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's token from already adjusted logits ``[B, N, V]``: greedy rows the argmax, sampling rows a sample of
    :func:`processed_probs` (seeded rows: :func:`sample_inverse_cdf` at ``rs.uniforms[:, u_index]``, u_index
    ``[B, N]`` int64). Returns (tokens ``[B, N]``, the processed probabilities ``[B, N, V]`` or None without
    ``sample``)."""
    tok = logits.argmax(-1)
    if not sample:
        return tok, None
    p = processed_probs(logits, rs.temperature, rs.top_p, rs.min_p, rs.top_k)
    drawn = sample_from(p, generator)
    if rs.seeded is not None:
        drawn = torch.where(rs.seeded[:, None], sample_inverse_cdf(p, rs.uniforms.gather(1, u_index)), drawn)
    return torch.where((rs.temperature > 0)[:, None], drawn, tok), p


class SamplingFlags(NamedTuple):
    """Which processing a batch needs (the runner's ``StepKey.sampling``; off = that path is not in the step at all).

    sample: some row samples (temperature > 0). use_top_p / use_min_p / use_top_k: some sampling row truncates that
    way. penalties: some row has a repetition, frequency or presence penalty (greedy rows too). min_tokens: some row
    may not end yet. seeded: some sampling row has a seed. logprobs: -1 none, 0 the committed tokens'
    log-probabilities, else also this many top log-probabilities (:data:`MAX_TOP_LOGPROBS`)."""

    sample: bool = False
    use_top_p: bool = False
    penalties: bool = False
    min_tokens: bool = False
    use_min_p: bool = False
    use_top_k: bool = False
    seeded: bool = False
    logprobs: int = -1


# per-slot flag bits (host), one per SamplingFlags field but min_tokens (which depends on the step)
_SAMPLE, _TOP_P, _MIN_P, _TOP_K, _PENALTIES, _SEEDED, _LOGPROBS, _TOP_LOGPROBS = (1 << i for i in range(8))
#: neutral per-row floats: temperature 0, top_p 1, min_p 0, repetition 1, frequency 0, presence 0
NEUTRAL_FLOATS = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], np.float32)


class SlotSampling:
    """The sampling settings of a runner's KV slots.

    Host tables (one row per slot) are written when a request is prefilled into its slot, so a step reads them with
    a few numpy gathers, whatever the batch size; only seeded rows cost Python work per step (a slice of their
    uniforms). Device state is allocated the first time a request needs it (none for the common path): ``counts``
    ``[num_slots, V]`` int32 (the output's token counts, updated by each step's commit) and ``seen_prompt``
    ``[num_slots, V]`` bool for penalties (5 bytes x V per slot: 63 MB at 256 x 49,152), ``stop_mask``
    ``[num_slots, V]`` bool for min_tokens.

    Args: num_slots, vocab_size, num_uniforms (U: the uniforms a forward reads from its first output index on),
    device.
    """

    def __init__(self, num_slots: int, vocab_size: int, num_uniforms: int, device: torch.device):
        self.vocab_size, self.num_uniforms, self.device = vocab_size, num_uniforms, device
        self.floats = np.tile(NEUTRAL_FLOATS, (num_slots, 1))  # [S, 6], NEUTRAL_FLOATS' columns
        self.top_k = np.zeros(num_slots, np.int64)
        self.min_tokens = np.zeros(num_slots, np.int64)  # 0 where the request has no stop token
        self.prompt_len = np.zeros(num_slots, np.int64)
        self.logprobs = np.full(num_slots, -1, np.int64)  # SamplingParams.logprobs, -1 for None
        self.flags = np.zeros(num_slots, np.int64)
        self.uniforms: list[np.ndarray | None] = [None] * num_slots
        self.counts: torch.Tensor | None = None
        self.seen_prompt: torch.Tensor | None = None
        self.stop_mask: torch.Tensor | None = None

    def move_slots(self, src: list[int], dst: list[int], src_t: torch.Tensor, dst_t: torch.Tensor) -> None:
        """Move slots ``src``' sampling state (host arrays, seeded streams, device counts / masks) to ``dst``
        (``*_t``: the same as device index tensors)."""
        for a in (self.floats, self.top_k, self.min_tokens, self.prompt_len, self.logprobs, self.flags):
            a[dst] = a[src]
        for x, y in zip(src, dst):
            self.uniforms[y] = self.uniforms[x]
        for t in (self.counts, self.seen_prompt, self.stop_mask):
            if t is not None:
                t.index_copy_(0, dst_t, t.index_select(0, src_t))

    def set_slots(self, slots: list[int], params: list, prompts: list[list[int]]) -> None:
        """Record the requests' ``SamplingParams`` for their slots and reset the slots' device state (eager; called
        by prefill). A seeded sampling request's stream covers ``max_new_tokens + U`` output indices."""
        v = self.vocab_size
        for s, p, prompt in zip(slots, params, prompts):
            sampled = p.temperature > 0
            self.floats[s] = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                              p.presence_penalty)
            self.top_k[s] = p.top_k
            self.min_tokens[s] = p.min_tokens if p.stop_token_ids else 0
            self.prompt_len[s] = len(prompt)
            self.logprobs[s] = -1 if p.logprobs is None else p.logprobs
            penalised = p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
            seeded = sampled and p.seed is not None
            on = ((sampled, _SAMPLE), (sampled and p.top_p < 1, _TOP_P), (sampled and p.min_p > 0, _MIN_P),
                  (sampled and 0 < p.top_k < v, _TOP_K), (penalised, _PENALTIES), (seeded, _SEEDED),
                  (p.logprobs is not None, _LOGPROBS), ((p.logprobs or 0) > 0, _TOP_LOGPROBS))
            self.flags[s] = sum(bit for used, bit in on if used)
            self.uniforms[s] = seed_uniforms(p.seed, p.max_new_tokens + self.num_uniforms) if seeded else None
        slot_t = torch.tensor(slots, device=self.device)
        if any(self.flags[s] & _PENALTIES for s in slots):
            if self.counts is None:
                self.counts = torch.zeros(len(self.flags), v, dtype=torch.int32, device=self.device)
                self.seen_prompt = torch.zeros(len(self.flags), v, dtype=torch.bool, device=self.device)
            self.counts[slot_t] = 0
            self.seen_prompt[slot_t] = self._token_mask(prompts)
        if any(self.min_tokens[s] > 0 for s in slots):
            if self.stop_mask is None:
                self.stop_mask = torch.zeros(len(self.flags), v, dtype=torch.bool, device=self.device)
            self.stop_mask[slot_t] = self._token_mask([p.stop_token_ids or [] for p in params])

    def _token_mask(self, token_lists: list[list[int]]) -> torch.Tensor:
        """``[len(token_lists), V]`` bool: row i marks the ids in ``token_lists[i]``."""
        rows = [i for i, toks in enumerate(token_lists) for _ in toks]
        cols = [t for toks in token_lists for t in toks]
        m = torch.zeros(len(token_lists), self.vocab_size, dtype=torch.bool, device=self.device)
        m[torch.tensor(rows, dtype=torch.long, device=self.device),
          torch.tensor(cols, dtype=torch.long, device=self.device)] = True
        return m

    def step_inputs(self, slots: list[int], num_generated: np.ndarray, uniforms_out: np.ndarray,
                    out_rows: list[int] | None = None):
        """The host inputs of one forward over ``slots`` whose requests have generated ``num_generated`` ``[n]``
        tokens: returns (floats ``[n, 6]``, top_k ``[n]``, min_left ``[n]``, seeded ``[n]`` int, flags). Seeded rows'
        uniforms for output indices ``num_generated ..`` are written into ``uniforms_out`` ``[rows, U]`` float32 at
        ``out_rows`` (default: the slots)."""
        idx = np.asarray(slots)
        out_rows = slots if out_rows is None else out_rows
        bits = int(np.bitwise_or.reduce(self.flags[idx]))
        min_left = np.maximum(self.min_tokens[idx] - num_generated, 0)
        seeded = np.zeros(len(idx), np.int64)
        if bits & _SEEDED:  # Python work for the seeded rows only
            for i in np.flatnonzero(self.flags[idx] & _SEEDED).tolist():
                n = int(num_generated[i])
                seeded[i] = 1
                uniforms_out[out_rows[i]] = self.uniforms[slots[i]][n:n + self.num_uniforms]
        sample = bool(bits & _SAMPLE)
        flags = SamplingFlags(sample=sample, use_top_p=bool(bits & _TOP_P), penalties=bool(bits & _PENALTIES),
                              min_tokens=bool(min_left.any()), use_min_p=bool(bits & _MIN_P),
                              use_top_k=bool(bits & _TOP_K), seeded=bool(bits & _SEEDED),
                              logprobs=(MAX_TOP_LOGPROBS if bits & _TOP_LOGPROBS else 0) if bits & _LOGPROBS else -1)
        return self.floats[idx], self.top_k[idx], min_left, seeded, flags

    def rows(self, flags: SamplingFlags, floats: torch.Tensor, top_k: torch.Tensor, min_left: torch.Tensor,
             seeded: torch.Tensor, uniforms: torch.Tensor, mask_rows) -> RowSampling:
        """The :class:`RowSampling` of a forward: floats ``[B, 6]``, top_k / min_left / seeded ``[B]`` int64 and
        uniforms ``[B, U]`` on the device (graph inputs in the step); ``mask_rows`` selects the rows' slots in the
        device state (``slice(0, B)`` in the step: rows are slots, read in place)."""
        pen = flags.penalties
        return RowSampling(
            temperature=floats[:, 0], top_p=floats[:, 1] if flags.use_top_p else None,
            min_p=floats[:, 2] if flags.use_min_p else None, top_k=top_k if flags.use_top_k else None,
            penalties=floats[:, 3:6] if pen else None, seen_prompt=self.seen_prompt[mask_rows] if pen else None,
            counts=self.counts[mask_rows] if pen else None,
            stop_mask=self.stop_mask[mask_rows] if flags.min_tokens else None,
            min_left=min_left if flags.min_tokens else None, seeded=seeded > 0 if flags.seeded else None,
            uniforms=uniforms if flags.seeded else None)
