"""ModelRunner: owns every tensor of the engine - target, drafter, length policy, the target KV cache,
the drafter context cache, per-slot feature history and pending drafts - and runs prefill and one
batched speculative step, eagerly on CPU (the exact float32 reference) and as CUDA graphs on GPU.

One step for the requests in KV slots ``0..B-1`` (row b *is* slot b, so attention reads the static
caches in place - no gather, no copy of the context):

1. verify ``[anchor, d_1 .. d_{W-1}]`` in one target forward over the static cache (gpt-fast layout:
   K/V written at absolute positions; a rejected draft's entries lie beyond every later query's causal
   limit and are overwritten, so a rollback is "don't advance the position");
2. accept the longest prefix (greedy: d_i == target argmax; sampling: min(1, p/q) with a residual
   resample - Leviathan et al. 2023, Chen et al. 2023) and commit a+1 tokens;
3. append the drafter context of the committed positions (and the target features into the history);
4. propose the *next* block from the new anchor (the correction/bonus token) and pick its γ with the
   length policy.

Rows may verify drafts the host supplies instead (a lookup source: prompt / suffix lookup, packed into the
step's int input buffer, so the step still makes one host -> device copy of its ints): they are a point-mass q,
so acceptance is ``p(d_i)`` and a rejection resamples from ``p`` without ``d_i`` - the same rejection sampling.
A step may skip the propose (no row will use the drafter's block next) and the context append (an AR or
lookup-only stretch): the skipped positions are caught up from the feature history, all slots in one drafter
projection, before the next step that proposes (``StepKey.append``).

Proposing at the end of step t instead of the start of step t+1 means the host learns the accepted
counts and the next γ in **one** device-to-host transfer per step; it then picks the next verify
width bucket without any other synchronisation. On CUDA every step is a graph replay keyed by
:class:`StepKey` (batch bucket, width bucket, span bucket, spec, sampling, top-p, propose), captured lazily the
first time a key
is seen (the engine's very first step runs eagerly to initialise cuBLAS and the allocator), all in one
memory pool (nano-vllm's scheme). Inputs travel in one pinned int buffer and one float buffer.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from adaflash_ray.models.drafter import DFlashDrafter
from adaflash_ray.models.target import TargetModel


@dataclass
class StepResult:
    """Host-side result of one step for the requests passed in (python lists, one transfer)."""

    committed: list[list[int]]  # a_r + 1 tokens per request (before stop truncation)
    num_accepted: list[int]  # a_r
    next_draft_lens: list[int]  # γ chosen by the length policy for the request's next step (0 in AR mode)
    # with an ``expected_fn`` and a propose: per request E[committed tokens | γ] of the new block, γ = 1..bs-1
    expected: list[list[float]] | None = None


class StepKey(NamedTuple):
    """The shape and mode of one step: what a captured CUDA graph is keyed by (fields in ``_step_fn``'s order).

    batch_size: rows 0..batch_size-1 (a batch bucket on CUDA). width: verify positions, anchor + γ drafts (a width
    bucket on CUDA). span: keys read per attention. spec: verify drafts (False = plain AR, width 1). sample: some
    row samples (temperature > 0). use_top_p: some sampling row has top_p < 1. propose: with ``spec``, the step
    proposes the next block. host_drafts: some row verifies drafts the host supplied (a lookup source; a point-mass q)
    instead of the drafter's. append: with ``spec``, the drafter context takes the step's positions (False: they are
    caught up from the feature history before the next step that needs them).
    """

    batch_size: int
    width: int
    span: int
    spec: bool
    sample: bool
    use_top_p: bool
    propose: bool
    host_drafts: bool = False
    append: bool = True


#: E[committed tokens] travel to the host as fixed-point integers in the step's one output buffer (int64)
EXPECTED_SCALE = 1000


def _buckets(limit: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``limit`` (nano-vllm's batch buckets), ``limit`` included."""
    out = [b for b in (1, 2, 4, 8) if b < limit] + list(range(16, limit, 16))
    return out + [limit]


def _round_up(n: int, choices: list[int]) -> int:
    for c in choices:
        if c >= n:
            return c
    return choices[-1]


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """Sampling distribution after the request's logit processing, float32.

    logits ``[B, ..., V]``; temperature ``[B]`` (rows with 0 are treated as 1: greedy rows ignore the
    result); top_p ``[B]`` in (0, 1] or None (nucleus sampling, Holtzman et al. 2020: keep the smallest
    prefix of the sorted distribution whose mass reaches top_p). Returns ``[B, ..., V]`` summing to 1.
    """
    shape = (-1,) + (1,) * (logits.dim() - 1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(shape)
    p = torch.softmax(logits.float() / t, dim=-1)
    if top_p is not None:
        sp, idx = p.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) > top_p.view(shape)
        p = torch.zeros_like(p).scatter_(-1, idx, sp.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


def sample_from(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of ``p`` ``[..., V]`` by the exponential race (argmax p/E, E ~ Exp(1)): exact,
    and unlike ``torch.multinomial`` free of host syncs, so it can be captured in a CUDA graph (gpt-fast)."""
    e = torch.empty_like(p).exponential_(generator=generator)
    return (p / e).argmax(-1)


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


class ModelRunner:
    """Args:
        target, drafter (None = AR only), length_policy (``(block hidden [B, bs, H], draft logits
            [B, bs-1, V], live rows [B] bool or None) -> γ [B]``; see adaflash_ray.engine.length_policy).
        num_slots: KV slots (the engine's max batch). max_seq_len: positions per slot.
        layer_ids: target layers whose outputs form the drafter's features.
        record: also keep the final hidden state per position (trajectories).
        use_cuda_graph: None = on for CUDA devices. seed: sampling RNG (CPU; on CUDA the default
            generator is used, which CUDA graphs support natively).
        max_draft: the longest draft a step verifies (host-supplied lookup drafts included); None = block_size - 1
            (at least 1). It sets the width buckets and the host-draft columns of the input buffer.
    """

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, length_policy, *, num_slots: int,
                 max_seq_len: int, layer_ids: list[int], record: bool = False, use_cuda_graph: bool | None = None,
                 seed: int = 0, max_draft: int | None = None):
        self.target, self.drafter, self.length_policy = target, drafter, length_policy
        self.layer_ids = list(layer_ids)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        w = target.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        self.is_cuda = self.device.type == "cuda"
        self.use_graphs = self.is_cuda if use_cuda_graph is None else bool(use_cuda_graph)
        if self.use_graphs and not self.is_cuda:
            raise ValueError("use_cuda_graph=True needs the model on a CUDA device")
        dev = self.device
        if self.is_cuda:  # fewer, larger GEMMs; the CPU path stays the unfused float32 reference
            target.fuse_projections()
            if drafter is not None:  # the drafter's propose / append kernels: the target's switch (auto / off)
                drafter.fuse_projections(target.fused_kernels)
        self.block_size = drafter.block_size if drafter is not None else 1
        self.kv = target.new_kv_cache(num_slots, max_seq_len)
        self.ctx = drafter.new_context_cache(num_slots, max_seq_len) if drafter is not None else None
        feat_dim = len(self.layer_ids) * target.config.hidden_size
        # per-slot history of the target's features / final hidden state (position p of slot s at [s, p]);
        # written in the step (the same overwrite-beyond-the-causal-limit rule as the KV cache)
        self.feat_hist = (torch.zeros(num_slots, max_seq_len, feat_dim, dtype=self.dtype, device=dev)
                          if drafter is not None or record else None)
        self.hid_hist = (torch.zeros(num_slots, max_seq_len, target.config.hidden_size, dtype=self.dtype, device=dev)
                         if record else None)
        nd = max(self.block_size - 1, max_draft or 0, 1)
        self.max_draft = nd
        self.drafts = torch.zeros(num_slots, nd, dtype=torch.long, device=dev)  # pending drafts per slot
        self.draft_probs: torch.Tensor | None = None  # [slots, bs-1, V] float32, allocated at the first sample
        # static step inputs / output (graph-captured code reads and writes only these). in_ints columns: anchor,
        # position, γ, host-draft flag (1: the row verifies the host's drafts, a point-mass q), host drafts [nd]
        self.in_ints = torch.zeros(num_slots, 4 + nd, dtype=torch.long, device=dev)
        self.in_floats = torch.zeros(num_slots, 2, dtype=torch.float32, device=dev)  # temperature, top_p
        # out columns: committed [width], accepted, next γ, then (with expected_fn) E[c(γ)] x EXPECTED_SCALE [bs-1]
        self._exp_col = nd + 3
        self.out = torch.zeros(num_slots, self._exp_col + max(self.block_size - 1, 0), dtype=torch.long, device=dev)
        # (block_hidden [B, bs, H], draft_logits [B, bs-1, V]) -> E[committed | γ] [B, bs-1] float, or None: set by
        # an engine whose scheduler weighs the drafter's block against other sources (graph-safe, no host sync)
        self.expected_fn = None
        # sampling rows draft the drafter's argmax, verified as a point-mass q (still lossless), instead of sampling
        # each block position from q independently
        self.argmax_drafts = False
        # host: per slot, the drafter context holds positions < ctx_len (steps with append=False leave it behind)
        self.ctx_len = [0] * num_slots
        self.prefill_expected: list[list[float]] | None = None
        pin = self.is_cuda
        self._ints_host = torch.zeros(num_slots, 4 + nd, dtype=torch.long, pin_memory=pin)
        self._floats_host = torch.zeros(num_slots, 2, dtype=torch.float32, pin_memory=pin)
        self.generator = None if self.is_cuda else torch.Generator(device=dev).manual_seed(seed)
        if self.is_cuda:
            torch.cuda.manual_seed(seed)
        self._batch_buckets = _buckets(num_slots) if self.is_cuda else None
        self._width_buckets = [x for x in (1, 2, 3, 4, 6, 8, 12, 16) if x < nd + 1] + [nd + 1]
        self.graphs: dict[StepKey, torch.cuda.CUDAGraph] = {}
        self._warm = False
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @property
    def wants_anchor_hidden(self) -> bool:
        """The length policy reads the target's hidden state at the anchor (its ``needs_anchor_hidden``; read
        per call, so a policy swapped in later is honoured)."""
        return bool(getattr(self.length_policy, "needs_anchor_hidden", False))

    def reset_graphs(self) -> None:
        """Drop every captured step graph (each is captured again on its next use) and start a fresh memory pool
        for them: the old pool goes with its last graph, and capturing into it again would fail."""
        self.graphs.clear()
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()

    # ------------------------------------------------------------------ shapes
    def _span(self, need: int) -> int:
        """Keys read per attention: ``need`` rounded up (multiples of 256 on CUDA, to bound the number of
        graphs; of 16 on CPU), at most max_seq_len. Buckets depend on the device only, so the eager and
        graph paths on a GPU run identical shapes (and kernels)."""
        quantum = 256 if self.is_cuda else 16
        return min(-(-need // quantum) * quantum, self.max_seq_len)

    def _ensure_sampling(self) -> None:
        if self.draft_probs is None and self.drafter is not None:
            v = self.target.config.vocab_size
            # max_draft columns (>= bs-1): a step whose lookup rows are wider than the block reads zeros past it
            self.draft_probs = torch.zeros(self.num_slots, self.max_draft, v, dtype=torch.float32,
                                           device=self.device)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]], temperatures: list[float], top_ps: list[float],
                spec: bool) -> tuple[list[int], list[int]]:
        """Run prompts through the target (writing their slots' KV, feature history and drafter context),
        sample each first token and, with ``spec``, propose each request's first block.

        Returns ``(first_tokens, draft_lens)`` (python lists; one host transfer). On CUDA all prompts go in
        one right-padded batch (pad entries lie beyond each prompt and are overwritten later); on CPU one
        prompt at a time (no padding waste).
        """
        if not self.is_cuda and len(prompts) > 1:
            firsts, gammas, expected = [], [], []
            for args in zip(slots, prompts, temperatures, top_ps):
                f, g = self.prefill(*[[a] for a in args], spec)
                firsts += f
                gammas += g
                expected += self.prefill_expected or []
            self.prefill_expected = expected or None
            return firsts, gammas
        dev = self.device
        n, plen = len(prompts), max(map(len, prompts))
        ids = torch.zeros(n, plen, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        slot_t = torch.tensor(slots, device=dev)
        temp = torch.tensor(temperatures, dtype=torch.float32, device=dev)
        top_p = torch.tensor(top_ps, dtype=torch.float32, device=dev)
        positions = torch.arange(plen, device=dev).expand(n, plen)
        out = self.target(ids, positions, cache=self.kv, slot_ids=slot_t, capture_layer_ids=self.layer_ids,
                          span=plen, compute_logits=False)
        last = out.last_hidden[torch.arange(n, device=dev), lens - 1]  # [N, H]
        logits = self.target.lm_head(last)  # [N, V]
        first = logits.argmax(-1)
        sample = any(t > 0 for t in temperatures)
        use_top_p = sample and any(tp < 1 for tp in top_ps)
        if sample:
            self._ensure_sampling()
            p = processed_probs(logits, temp, top_p if use_top_p else None)
            first = torch.where(temp > 0, sample_from(p, self.generator), first)
        rows = slot_t[:, None].expand(n, plen)
        if self.feat_hist is not None:
            self.feat_hist[rows, positions] = out.features.to(self.feat_hist.dtype)
        if self.hid_hist is not None:
            self.hid_hist[rows, positions] = out.last_hidden.to(self.hid_hist.dtype)
        gamma, expected = torch.zeros_like(first), None
        if self.drafter is not None:
            self.drafter.append_context(self.ctx, rows, positions, out.features)
            for s, prompt in zip(slots, prompts):
                self.ctx_len[s] = len(prompt)
            if spec:
                gamma, expected = self._propose(slot_t, first, lens, plen + self.block_size, temp, top_p, sample,
                                                use_top_p, rows_are_slots=False, anchor_hidden=last)
        cols = [first[:, None], gamma[:, None]]
        if expected is not None:
            cols.append((expected * EXPECTED_SCALE).round().long())
        host = torch.cat(cols, 1).tolist()  # one transfer
        self.prefill_expected = ([[v / EXPECTED_SCALE for v in r[2:]] for r in host] if expected is not None
                                 else None)
        return [r[0] for r in host], [r[1] for r in host]

    # ------------------------------------------------------------------ propose
    def _propose(self, slot_ids, anchors, anchor_pos, span, temp, top_p, sample, use_top_p, rows_are_slots,
                 live=None, anchor_hidden=None):
        """Drafter forward on ``[anchor, MASK...]`` -> pending drafts (+ their probabilities when sampling)
        stored per slot; returns (γ ``[B]`` from the length policy (``live`` [B] bool: the rows that are real
        requests, None = all), E[committed | γ] ``[B, bs-1]`` float from ``expected_fn`` or None). A policy with ``needs_anchor_hidden`` also gets ``anchor_hidden`` ``[B, H]``: the
        target's final-normed hidden state whose logits gave each anchor token."""
        span = min(span, self.max_seq_len)
        hidden = self.drafter.propose_hidden(self.ctx, slot_ids, anchors, anchor_pos, span=span,
                                             rows_are_slots=rows_are_slots)  # [B, bs, H]
        draft_logits = self.drafter.logits(hidden[:, 1:])  # [B, bs-1, V]
        drafts = draft_logits.argmax(-1)
        b, nb = anchors.shape[0], drafts.shape[1]
        if sample and not self.argmax_drafts:
            q = processed_probs(draft_logits, temp, top_p if use_top_p else None)
            drafts = torch.where((temp > 0)[:, None], sample_from(q, self.generator), drafts)
            if rows_are_slots:
                self.draft_probs[:b, :nb] = q
            else:
                self.draft_probs[slot_ids, :nb] = q
        if rows_are_slots:
            self.drafts[:b, :nb] = drafts
        else:
            self.drafts[slot_ids, :nb] = drafts
        expected = self.expected_fn(hidden, draft_logits) if self.expected_fn is not None else None
        if self.wants_anchor_hidden:
            return self.length_policy(hidden, draft_logits, live, anchor_hidden=anchor_hidden).to(torch.long), expected
        return self.length_policy(hidden, draft_logits, live).to(torch.long), expected

    # ------------------------------------------------------------------ one step (graph body)
    def _step_fn(self, b: int, w: int, span: int, spec: bool, sample: bool, use_top_p: bool,
                 propose: bool = True, host_drafts: bool = False, append: bool = True) -> None:
        """Rows 0..b-1, verify width w, keys 0..span-1. Reads in_ints / in_floats / drafts; writes out,
        caches, histories, drafts. ``spec`` without ``propose``: no block is proposed (an AR step of the ``cost``
        policy's γ = 0, or a step that verifies only host drafts); with ``append`` the drafter context still takes
        the new positions. ``host_drafts``: rows flagged in in_ints column 3 verify in_ints' host drafts (a
        point-mass q when sampling) instead of the drafter's. No host synchronisation (CUDA-graph safe)."""
        dev = self.device
        ints = self.in_ints[:b]
        anchor, pos, gamma = ints[:, 0], ints[:, 1], ints[:, 2]
        temp, top_p = self.in_floats[:b].unbind(1)
        ar = torch.arange(w, device=dev)
        positions = (pos[:, None] + ar).clamp(max=self.max_seq_len - 1)  # [B, W] (clamp: padded columns only)
        g_max = w - 1
        d = self.drafts[:b, :g_max]  # [B, Γ]
        point = None
        if host_drafts:
            point = ints[:, 3] > 0
            d = torch.where(point[:, None], ints[:, 4:4 + g_max], d)
        if self.argmax_drafts:  # every row's drafts are deterministic: the drafter's argmax or the host's
            point = torch.ones_like(pos, dtype=torch.bool)
        inp = torch.cat([anchor[:, None], d], 1)  # [B, W]
        out = self.target(inp, positions, cache=self.kv, capture_layer_ids=self.layer_ids, span=span,
                          rows_are_slots=True, logits_dtype=None)
        greedy = out.logits.argmax(-1)  # [B, W]
        live = ar[None, :g_max] < gamma[:, None]  # [B, Γ]
        accepted = ((d == greedy[:, :g_max]) & live).long().cumprod(1).sum(1)  # [B]
        nxt = greedy.gather(1, accepted[:, None])[:, 0]  # correction or bonus
        if sample:
            p = processed_probs(out.logits, temp, top_p if use_top_p else None)  # [B, W, V]
            q = self.draft_probs[:b, :g_max] if self.draft_probs is not None else None
            acc_s, nxt_s = rejection_sample(d, p, q, live, self.generator, point)
            stochastic = temp > 0
            accepted = torch.where(stochastic, acc_s, accepted)
            nxt = torch.where(stochastic, nxt_s, nxt)
        committed = torch.cat([d, torch.zeros_like(anchor)[:, None]], 1)  # [B, W]
        committed.scatter_(1, accepted[:, None], nxt[:, None])
        rows = torch.arange(b, device=dev)[:, None]
        if self.feat_hist is not None:
            self.feat_hist[rows, positions] = out.features.to(self.feat_hist.dtype)
        if self.hid_hist is not None:
            self.hid_hist[rows, positions] = out.last_hidden.to(self.hid_hist.dtype)
        self.out[:b, :w] = committed
        self.out[:b, w] = accepted
        if spec and append and self.drafter is not None:
            self.drafter.append_context(self.ctx, rows.expand(b, w), positions, out.features)
        if spec and propose:
            # rows of idle slots and of the padded bucket carry position 0 (a real request's anchor is >= 1)
            anchor_hidden = out.last_hidden[rows[:, 0], accepted] if self.wants_anchor_hidden else None  # [B, H]
            gamma_next, expected = self._propose(rows[:, 0], nxt, pos + accepted + 1, span, temp, top_p, sample,
                                                 use_top_p, rows_are_slots=True, live=pos > 0,
                                                 anchor_hidden=anchor_hidden)
            self.out[:b, w + 1] = gamma_next
            if expected is not None:
                self.out[:b, self._exp_col:] = (expected * EXPECTED_SCALE).round().long()

    def _run(self, key: StepKey) -> None:
        if not self.use_graphs:
            self._step_fn(*key)
            return
        graph = self.graphs.get(key)
        if graph is None:
            if not self._warm:  # the very first step runs eagerly (initialises cuBLAS, the allocator, kernels)
                self._warm = True
                self._step_fn(*key)
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step_fn(*key)
            self.graphs[key] = graph
        graph.replay()

    # ------------------------------------------------------------------ one step (host side)
    @torch.no_grad()
    def step(self, slots: list[int], anchors: list[int], anchor_pos: list[int], draft_lens: list[int],
             temperatures: list[float], top_ps: list[float], spec: bool, propose: bool = True,
             host_drafts: list[list[int] | None] | None = None, append: bool | None = None) -> StepResult:
        """One decoding step for the running requests in ``slots``.

        Args:
            anchors, anchor_pos: per request the last committed token and its position (= num_tokens-1).
            draft_lens: γ per request for this step (<= its pending drafts; 0 in AR mode), already capped by
                the host (remaining budget).
            temperatures, top_ps: per request sampling settings (0 = greedy).
            spec: verify the pending drafts and propose the next block; False = plain AR (W = 1).
            propose: with ``spec``, False skips the drafter's propose (only host drafts may then be verified):
                next_draft_lens are 0. Without a drafter a step never proposes.
            host_drafts: per request None (verify the drafter's pending drafts) or token ids the host proposes
                (a lookup source), at least ``draft_lens[i]`` of them; verified as a point-mass q. None = none.
            append: with ``spec`` and a drafter, whether the drafter context takes this step's positions (None =
                ``spec``). A step that skips it leaves the slot's context behind; the next step that proposes or
                appends first recomputes the missing positions from the feature history (:meth:`catch_up_context`),
                so AR stretches pay no drafter work.
        Raises:
            ValueError: drafter drafts to verify without a drafter, or host drafts shorter than their γ or longer
                than ``max_draft``.
        """
        has_drafter = self.drafter is not None
        propose = (propose or not spec) and has_drafter
        append = (spec if append is None else append and spec) and has_drafter
        use_host = host_drafts is not None and any(h is not None for h in host_drafts)
        for i, g in enumerate(draft_lens):
            h = host_drafts[i] if use_host else None
            if h is not None:
                if len(h) < g or len(h) > self.max_draft:
                    raise ValueError(f"host drafts of request {i}: {len(h)} tokens for γ {g} (max {self.max_draft})")
            elif spec and g and not has_drafter:
                raise ValueError(f"request {i}: γ {g} without host drafts needs a drafter's pending block")
        if has_drafter and spec and (propose or append):  # a context left behind by AR steps comes back first
            stale = [(s, self.ctx_len[s], p) for s, p in zip(slots, anchor_pos) if self.ctx_len[s] < p]
            if stale:
                self.catch_up_context(stale)
        b = max(slots) + 1
        g_max = max(draft_lens) if spec else 0
        w = g_max + 1
        if self.is_cuda:  # the same buckets with or without graphs
            b = _round_up(b, self._batch_buckets)
            w = _round_up(w, self._width_buckets)
        span = self._span(max(anchor_pos) + w + (self.block_size if spec and propose else 0))
        sample = any(t > 0 for t in temperatures)
        use_top_p = sample and any(tp < 1 for tp in top_ps)
        if sample:
            self._ensure_sampling()
        ints, floats = self._ints_host.numpy(), self._floats_host.numpy()
        ints[:b] = 0
        floats[:b, 0], floats[:b, 1] = 0.0, 1.0
        idx = np.asarray(slots)
        ints[idx, 0], ints[idx, 1], ints[idx, 2] = anchors, anchor_pos, draft_lens
        if use_host:  # the host's drafts ride in the same input buffer: still one host -> device copy of ints
            for s, h in zip(slots, host_drafts):
                if h is not None:
                    ints[s, 3] = 1
                    ints[s, 4:4 + len(h)] = h
        floats[idx, 0], floats[idx, 1] = temperatures, top_ps
        self.in_ints[:b].copy_(self._ints_host[:b], non_blocking=True)
        self.in_floats[:b].copy_(self._floats_host[:b], non_blocking=True)
        self._run(StepKey(b, w, span, spec, sample, use_top_p, propose, use_host and spec, append))
        with_exp = spec and propose and self.expected_fn is not None
        ncols = self.out.shape[1] if with_exp else w + 2
        host = self.out[:b, :ncols].cpu().numpy()  # the one device -> host transfer of the step
        rows = host[idx]
        acc = rows[:, w].tolist()
        committed = [r[: a + 1].tolist() for r, a in zip(rows, acc)]
        nxt = rows[:, w + 1].tolist() if spec and propose else [0] * len(slots)
        if append:
            for s, p, a in zip(slots, anchor_pos, acc):
                self.ctx_len[s] = p + a + 1
        expected = (rows[:, self._exp_col:] / EXPECTED_SCALE).tolist() if with_exp else None
        return StepResult(committed=committed, num_accepted=acc, next_draft_lens=nxt, expected=expected)

    @torch.no_grad()
    def catch_up_context(self, spans: list[tuple[int, int, int]]) -> None:
        """Append the drafter context of positions ``start .. stop-1`` of each ``(slot, start, stop)`` from the
        feature history (the committed positions that steps with ``append=False`` skipped): eager, ONE drafter
        projection for every slot's positions together (a handful of kernels whatever the batch). Afterwards each
        slot's context holds positions < its ``stop``."""
        spans = [(s, a, b) for s, a, b in spans if b > a]
        if not spans:
            return
        rows = np.concatenate([np.full(b - a, s) for s, a, b in spans])
        pos = np.concatenate([np.arange(a, b) for s, a, b in spans])
        rows_t = torch.from_numpy(rows).to(self.device)
        pos_t = torch.from_numpy(pos).to(self.device)
        self.drafter.append_context(self.ctx, rows_t, pos_t, self.feat_hist[rows_t, pos_t])
        for s, _, b in spans:
            self.ctx_len[s] = max(self.ctx_len[s], b)

    # ------------------------------------------------------------------ history, reload
    def features(self, slot: int, n: int) -> torch.Tensor:
        """Target features ``[n, K*H]`` of positions 0..n-1 of ``slot`` (a view; copy before reuse)."""
        return self.feat_hist[slot, :n]

    def last_hidden(self, slot: int, n: int) -> torch.Tensor:
        """Final hidden states ``[n, H]`` of positions 0..n-1 of ``slot`` (record=True only)."""
        return self.hid_hist[slot, :n]

    @torch.no_grad()
    def rebuild_context(self, slot: int, n: int) -> None:
        """Recompute a slot's drafter context K/V for positions 0..n-1 from its feature history (after a
        weight swap, so running requests continue with the new drafter)."""
        pos = torch.arange(n, device=self.device)
        self.drafter.append_context(self.ctx, torch.full((n,), slot, device=self.device), pos,
                                    self.feat_hist[slot, :n])
        self.ctx_len[slot] = n

    # ------------------------------------------------------------------ timing (benchmarks)
    def _time(self, fn, num_iters: int, reduce: str = "median") -> float:
        """Median (``reduce="median"``) or least (``"min"``) ms of ``fn`` over ``num_iters`` runs (graph-captured
        on CUDA after two warm-up calls)."""
        pick = {"median": statistics.median, "min": min}[reduce]
        if not self.use_graphs:
            times = []
            for _ in range(num_iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return pick(times)
        fn()
        fn()
        graph = torch.cuda.CUDAGraph()
        # a private pool, freed with this graph: a graph dropped from the steps' shared pool can leave that pool
        # with no user, and a capture into a pool nobody holds fails inside the caching allocator
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(num_iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return pick(times)

    @torch.no_grad()
    def time_verify(self, batch_size: int, width: int, context_len: int = 128, num_iters: int = 20,
                    reduce: str = "median") -> float:
        """Median ms of one target forward of ``batch_size`` rows x ``width`` positions after a context of
        ``context_len`` (+ argmax). Overwrites slots 0..batch_size-1: call on an idle engine."""
        dev = self.device
        pos = torch.full((batch_size,), context_len, device=dev)
        positions = pos[:, None] + torch.arange(width, device=dev)
        inp = torch.zeros(batch_size, width, dtype=torch.long, device=dev)
        span = self._span(context_len + width)

        def fn():
            out = self.target(inp, positions, cache=self.kv, capture_layer_ids=self.layer_ids, span=span,
                              rows_are_slots=True, logits_dtype=None)
            return out.logits.argmax(-1)
        return self._time(fn, num_iters, reduce)

    @torch.no_grad()
    def time_step(self, batch_size: int, draft_len: int, context_len: int = 128, num_iters: int = 20,
                  reduce: str = "median", propose: bool = True, host_drafts: bool = False,
                  append: bool | None = None) -> float:
        """Median (or least) wall-clock ms of one whole :meth:`step` - host inputs, the (graph-replayed) verify of
        width ``draft_len + 1``, the drafter propose (unless ``propose`` is False: an AR step, or with
        ``host_drafts`` a step verifying lookup drafts) and the one device -> host transfer - on slots
        0..batch_size-1 after ``context_len`` tokens, greedy. ``append``: as in :meth:`step`. What an engine step
        costs including its host work, which a graph's own time leaves out. Overwrites those slots' KV, drafter
        context and drafts: call on an idle engine."""
        slots = list(range(batch_size))
        hd = [[0] * draft_len] * batch_size if host_drafts else None
        args = (slots, [0] * batch_size, [context_len] * batch_size, [draft_len] * batch_size,
                [0.0] * batch_size, [1.0] * batch_size, True, propose, hd, append)
        self.drafts.zero_()
        self.step(*args)  # warm-up: the eager first step / graph capture for this key
        self.step(*args)
        pick = {"median": statistics.median, "min": min}[reduce]
        times = []
        for _ in range(num_iters):
            t0 = time.perf_counter()
            self.step(*args)
            times.append((time.perf_counter() - t0) * 1e3)
        return pick(times)

    @torch.no_grad()
    def time_propose(self, batch_size: int, context_len: int = 128, num_iters: int = 20,
                     reduce: str = "median") -> float:
        """Median ms of one drafter propose (block of block_size) + draft argmax + length policy."""
        dev = self.device
        rows = torch.arange(batch_size, device=dev)
        anchors = torch.zeros(batch_size, dtype=torch.long, device=dev)
        pos = torch.full((batch_size,), context_len, device=dev)
        span = self._span(context_len + self.block_size)
        ones = torch.ones(batch_size, device=dev)
        hid = torch.zeros(batch_size, self.target.config.hidden_size, dtype=self.dtype, device=dev)
        return self._time(lambda: self._propose(rows, anchors, pos, span, ones, ones, False, False, True,
                                                anchor_hidden=hid), num_iters, reduce)
