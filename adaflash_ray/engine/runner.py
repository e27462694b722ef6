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
With a device lookup (:mod:`adaflash_ray.engine.device_lookup`) the lookup is computed here instead: the runner
keeps every slot's tokens on the device, a step with ``StepKey.lookup`` proposes every row's next lookup draft at
its end (as the drafter's block), the proposals reach the host in the step's one transfer, and the next step's
rows flagged for them verify them from the device buffer (no host -> device copy of the drafts).
A step may skip the propose (no row will use the drafter's block next) and the context append (an AR or
lookup-only stretch): the skipped positions are caught up from the feature history, all slots in one drafter
projection, before the next step that proposes (``StepKey.append``).

Proposing at the end of step t instead of the start of step t+1 means the host learns the accepted
counts and the next γ in **one** device-to-host transfer per step; it then picks the next verify
width bucket without any other synchronisation. On CUDA every step is a graph replay keyed by
:class:`StepKey` (batch bucket, width bucket, span bucket, spec, propose, and which logits processing the batch
needs), captured lazily the first time a key is seen (the engine's very first step runs eagerly to initialise cuBLAS
and the allocator), all in one memory pool (nano-vllm's scheme). Inputs travel in one pinned int buffer and one float
buffer (plus, for seeded rows, one buffer of their uniforms).

Per-request logits processing (vLLM's sampling parameters: penalties, min_tokens, temperature, min_p, top_k, top_p,
seed, logprobs) is :mod:`adaflash_ray.engine.sampling`: each request's settings sit in per-slot tables written at its
prefill; a processing step that no row of the batch needs is not in the step's graph at all (its StepKey flag is
off). Verification is lossless against the processed distribution: window position j accounts for the drafts
d_1..d_j in its penalty counts and min_tokens test.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from adaflash_ray.engine.device_lookup import DeviceLookup
from adaflash_ray.engine.graph_upload import upload_graph
from adaflash_ray.engine.request import SamplingParams
from adaflash_ray.engine.sampling import (MAX_TOP_LOGPROBS, NEUTRAL_FLOATS, RowSampling, SamplingFlags,
                                         SlotSampling, adjust_logits, choose_tokens, match_prefix, processed_probs,
                                         rejection_sample, sample_from, sample_inverse_cdf, window_counts)
from adaflash_ray.models.drafter import DFlashDrafter
from adaflash_ray.models.target import TargetModel, graph_replay_ms, split_k_pays

__all__ = ["ModelRunner", "StepKey", "StepResult", "processed_probs", "rejection_sample", "sample_from"]


@dataclass
class StepResult:
    """Host-side result of one step for the requests passed in (python lists, one transfer)."""

    committed: list[list[int]]  # a_r + 1 tokens per request (before stop truncation)
    num_accepted: list[int]  # a_r
    next_draft_lens: list[int]  # γ chosen by the length policy for the request's next step (0 in AR mode)
    # with an ``expected_fn`` and a propose: per request E[committed tokens | γ] of the new block, γ = 1..bs-1
    expected: list[list[float]] | None = None
    # per request (None where its SamplingParams.logprobs is None, or no row of the step asked): per committed token
    # its log-probability under the target's raw distribution, and its top-k (token id, logprob), best first
    logprobs: list[list[float] | None] | None = None
    top_logprobs: list[list[list[tuple[int, float]]] | None] | None = None
    # with a device lookup step (StepKey.lookup): per request its next lookup proposal, packed as DeviceLookup rows
    # ``[n, max_draft + NUM_META]`` int64 (tokens, length, match length, occurrences, source code)
    lookup: np.ndarray | None = None
    # on a step that verified host / device-lookup drafts with a drafter: per request ``(match, known)``, the pending
    # drafter block's common prefix with the committed tokens and the cut ``min(a + 1, W - 1)`` it is measured to
    # (match < known: the block's greedy acceptance was ``match``; match == known: at least that); None otherwise
    block_match: list[tuple[int, int]] | None = None


@dataclass
class PendingStep:
    """A plain step launched by :meth:`ModelRunner.launch_plain` and not read yet: its slots (host ints and index
    array), the pinned host rows its result is copied into, the CUDA event after that copy (None on CPU: the copy has
    run), its logprobs setting, the (rows, width) the device runs and whether it captured or first replayed a graph."""

    slots: list[int]
    idx: np.ndarray
    host: torch.Tensor
    event: object
    logprobs: int
    shape: tuple[int, int]
    captured: bool
    first_replay: bool


class StepKey(NamedTuple):
    """The shape and mode of one step: what a captured CUDA graph is keyed by (fields in ``_step_fn``'s order).

    batch_size: rows 0..batch_size-1 (a batch bucket on CUDA). width: verify positions, anchor + γ drafts (a width
    bucket on CUDA). span: keys read per attention. spec: verify drafts (False = plain AR, width 1). propose: with
    ``spec``, the step proposes the next block. host_drafts: some row verifies drafts the host supplied (a lookup
    source; a point-mass q) instead of the drafter's. sampling: the logits processing some row needs
    (:class:`~adaflash_ray.engine.sampling.SamplingFlags`: sample, use_top_p, penalties, min_tokens, use_min_p,
    use_top_k, seeded, logprobs; all off for greedy rows without parameters, whose step then runs none of it).
    append: with ``spec``, the drafter context takes the step's positions (False: they are caught up from the feature
    history before the next step that needs them). lookup: at the end of the step the device lookup
    (:class:`~adaflash_ray.engine.device_lookup.DeviceLookup`) proposes every row's next lookup draft from its new
    context (off: the step's graph has none of it). propose_first: the drafter proposes a block for the step's own
    anchors before the verify, which then checks it (``propose`` is then off: no block for the next step). expected:
    with a ``propose`` and an ``expected_fn`` (the planner's acceptance head), the step computes its block's
    E[committed | γ] (False: the block alone, as a step whose next step verifies it at a fixed γ needs no estimate).
    plain: an AR step (``spec`` off) that keeps no history - no target features captured, no feature / hidden
    history or device lookup history written: the AR engine's step exactly (:meth:`ModelRunner.step` ``plain``).
    """

    batch_size: int
    width: int
    span: int
    spec: bool
    propose: bool
    host_drafts: bool = False
    sampling: SamplingFlags = SamplingFlags()
    append: bool = True
    lookup: bool = False
    propose_first: bool = False
    expected: bool = True
    plain: bool = False


#: E[committed tokens] travel to the host as fixed-point integers in the step's one output buffer (int64)
EXPECTED_SCALE = 1000


#: the verify width buckets on CUDA (a step's width is rounded up to one; the widest is the runner's max_draft + 1);
#: an ``auto`` attention choice is calibrated at all of them, whatever one engine's widest
WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


def _concat(parts: list[StepResult]) -> StepResult:
    """One StepResult for the requests of ``parts`` in order (a field None in every part stays None)."""
    merged = {}
    for f in dataclasses.fields(StepResult):
        vals = [getattr(r, f.name) for r in parts]
        if f.name == "lookup":
            merged[f.name] = None if any(v is None for v in vals) else np.concatenate(vals)
            continue
        merged[f.name] = None if all(v is None for v in vals) else [
            x for r, v in zip(parts, vals) for x in (v if v is not None else [None] * len(r.committed))]
    return StepResult(**merged)


def _buckets(limit: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``limit`` (nano-vllm's batch buckets), ``limit`` included."""
    out = [b for b in (1, 2, 4, 8) if b < limit] + list(range(16, limit, 16))
    return out + [limit]


def _expand_spans(spans: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(slot, start, stop)`` spans (stop > start) as int64 ``(rows, positions)``: slot ``s`` once per position
    ``start .. stop-1``, span after span (a fixed handful of numpy calls whatever the number of spans)."""
    sl, st, sp = np.array(spans, dtype=np.int64).T
    lens = sp - st
    rows = np.repeat(sl, lens)
    # each span's positions: a running index minus the span's offset in the output, plus its start
    pos = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(st - (np.cumsum(lens) - lens), lens)
    return rows, pos


#: positions a bucketed prefill pads its prompts to (``ModelRunner(prefill_buckets=True)``): 32 x 2^k and the 1.5x
#: steps between them; beyond the last, the next multiple of PREFILL_LEN_STEP; never beyond ``max_seq_len``
PREFILL_LEN_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
PREFILL_LEN_STEP = 2048
#: captured prefill graphs a runner keeps at most, and the most positions (prompts x padded length) one holds: a
#: shape beyond either prefills eagerly (a long prefill keeps the device busy while the host launches: no gain). Each
#: graph keeps its static output allocated: its features and final hidden state, (len(layer_ids) + 1) x hidden size
#: values a position - at most MAX_PREFILL_GRAPHS x MAX_PREFILL_GRAPH_TOKENS positions of them in all
MAX_PREFILL_GRAPHS, MAX_PREFILL_GRAPH_TOKENS = 32, 2048


def _round_up(n: int, choices: list[int]) -> int:
    for c in choices:
        if c >= n:
            return c
    return choices[-1]


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
        device_lookup: None, or the keywords of a :class:`~adaflash_ray.engine.device_lookup.DeviceLookup`
            (max_ngram, min_ngram, max_occurrences, corpus_tokens): the runner then keeps every slot's tokens on the
            device (written at prefill and in every step), and steps with ``lookup`` propose lookup drafts there.
        prefill_buckets: a prefill pads its prompts to the next of :data:`PREFILL_LEN_BUCKETS` positions (right
            padding, as between prompts of one batch: pad entries lie beyond each prompt and are overwritten later)
            and, with CUDA graphs, runs the target's forward as one captured graph per (prompts, padded length) -
            captured after that shape's first eager prefill once the runner's first decode step has run (before it
            every prefill is eager), at most :data:`MAX_PREFILL_GRAPHS` of them of at most
            :data:`MAX_PREFILL_GRAPH_TOKENS` positions each (others: eager) - one replay instead of a host launch
            per kernel, for the prefills of a few prompts whose device work is shorter than their launches. False:
            each batch padded to its longest prompt, eager.
    """

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, length_policy, *, num_slots: int,
                 max_seq_len: int, layer_ids: list[int], record: bool = False, use_cuda_graph: bool | None = None,
                 seed: int = 0, max_draft: int | None = None, device_lookup: dict | None = None,
                 prefill_buckets: bool = False):
        self.target, self.drafter, self.length_policy = target, drafter, length_policy
        self.prefill_buckets = bool(prefill_buckets)
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
        self.lookup = (DeviceLookup(num_slots, max_seq_len, nd, dev, **device_lookup) if device_lookup is not None
                       else None)
        # static step inputs / output (graph-captured code reads and writes only these). in_ints columns: anchor,
        # position, γ, point-mass flag (1: the row verifies the host's drafts, 2: the device lookup's latest
        # proposal; a point-mass q), host drafts [nd],
        # then top_k, min_left (tokens before a stop token may come), seeded (1: the row's uniforms drive it)
        self._topk_col = 4 + nd
        self.in_ints = torch.zeros(num_slots, 7 + nd, dtype=torch.long, device=dev)
        # in_floats columns: temperature, top_p, min_p, repetition, frequency, presence penalty (NEUTRAL_FLOATS)
        self.in_floats = torch.zeros(num_slots, len(NEUTRAL_FLOATS), dtype=torch.float32, device=dev)
        # seeded rows' uniforms for the output indices a step reads: verify positions 0..nd, next block up to nd+bs-1
        num_unif = nd + max(self.block_size, 1)
        self.in_uniforms = torch.zeros(num_slots, num_unif, dtype=torch.float32, device=dev)
        self.sampling = SlotSampling(num_slots, target.config.vocab_size, num_unif, dev)
        # out columns: committed [width], accepted, next γ, then (with expected_fn) E[c(γ)] x EXPECTED_SCALE [bs-1],
        # then (with a device lookup) the packed lookup proposal [nd + NUM_META], then (with logprobs) per window
        # position j the committed token's logprob [nd+1], top-k ids [(nd+1) x K] and
        # their logprobs [(nd+1) x K] (K = MAX_TOP_LOGPROBS; logprobs travel as their float32 bits)
        self._cf_col = nd + 3  # the drafter's pending block scored against the committed tokens (host-draft steps)
        self._exp_col = nd + 4
        self._look_col = self._exp_col + max(self.block_size - 1, 0)
        self._lp_col = self._look_col + (self.lookup.num_cols if self.lookup is not None else 0)
        self._top_col = self._lp_col + nd + 1
        self.out = torch.zeros(num_slots, self._top_col + 2 * (nd + 1) * MAX_TOP_LOGPROBS, dtype=torch.long,
                               device=dev)
        # (block_hidden [B, bs, H], draft_logits [B, bs-1, V]) -> E[committed | γ] [B, bs-1] float, or None: set by
        # an engine whose scheduler weighs the drafter's block against other sources (graph-safe, no host sync); that
        # scheduler then picks each row's γ itself, so the length policy's forward is skipped (its γ: 0 in every row)
        self.expected_fn = None
        # sampling rows draft the drafter's argmax, verified as a point-mass q (still lossless), instead of sampling
        # each block position from q independently
        self.argmax_drafts = False
        # host: per slot, the drafter context holds positions < ctx_len (steps with append=False leave it behind)
        self.ctx_len = [0] * num_slots
        # the last step's catch-up (positions appended, host seconds by ``clock``; the engine sets its clock here)
        self.clock = time.perf_counter
        self.step_catch_up: tuple[int, float] = (0, 0.0)
        # the last step captured its CUDA graph (or ran the very first step eagerly): a one-off cost, not the step's
        self.step_captured = False
        # the last step replayed its step graph for the first time (a graph it captured itself too: SpecEngine counts
        # only steps that captured nothing, i.e. precaptured graphs' first replays); a diagnostic for steps slower
        # than their shape's others (False without CUDA graphs)
        self.step_first_replay = False
        self._replayed: set[StepKey] = set()  # the step graphs replayed at least once
        self.step_shape: tuple[int, int] = (0, 0)  # the last step's (rows, verify width) as the device ran it
        pin = self.is_cuda
        self._ints_host = torch.zeros(num_slots, 7 + nd, dtype=torch.long, pin_memory=pin)
        self._floats_host = torch.zeros(num_slots, len(NEUTRAL_FLOATS), dtype=torch.float32, pin_memory=pin)
        self._uniforms_host = torch.zeros(num_slots, num_unif, dtype=torch.float32, pin_memory=pin)
        # launch_plain's two alternating sets of (staging buffers, pinned result rows), made on first use; the rows
        # the slots of the last plain launch (a chained launch reads their committed tokens)
        self._plain_bufs: list = [None, None]
        self._plain_parity = 0
        self._plain_slots: frozenset[int] = frozenset()
        self.generator = None if self.is_cuda else torch.Generator(device=dev).manual_seed(seed)
        if self.is_cuda:
            torch.cuda.manual_seed(seed)
        self._batch_buckets = _buckets(num_slots) if self.is_cuda else None
        self._width_buckets = [x for x in WIDTH_BUCKETS if x < nd + 1] + [nd + 1]
        # one attention kernel for every decode / verify step (a verify row is then the AR step's bits): split-K
        # (CUDA, fused kernels) with ``fused_attention`` on, or auto where the calibration at this engine's batch
        # buckets (every width the kernel takes, whatever this engine's) measured it faster at each batch bucket
        # (split_k_pays); else SDPA. The choice is kept on the target per batch buckets: engines of one target and
        # batch size - a spec engine and its AR reference - attend alike. {} = not calibrated
        self.attention_calibration: dict = {}
        self.split_k = False
        if self.is_cuda and target.fused_kernels_active and target.split_k_supported(max(self._width_buckets)):
            mode = target.attention_mode()
            if mode == "on":
                self.split_k = True
            elif mode == "auto":
                from adaflash_ray.models.layers import rotary_attention_fused

                # the calibration times the rotary with the attention where the forward fuses them
                key = (tuple(self._batch_buckets), min(max_seq_len, 2048), rotary_attention_fused())
                if key not in target.attention_choices:
                    report = target.calibrate_attention(self.kv, self._batch_buckets, list(WIDTH_BUCKETS),
                                                        [256, min(max_seq_len, 2048)])
                    target.attention_choices[key] = (report, split_k_pays(report))
                self.attention_calibration, self.split_k = target.attention_choices[key]
        self.graphs: dict[StepKey, torch.cuda.CUDAGraph] = {}
        self.num_uploaded = 0  # graphs uploaded at capture (step, prefill and catch-up graphs; 0 where none can be)
        # catch-up graphs per padded size: (rows buffer, positions buffer, pinned host staging [2, size], graph)
        self._catch_up_graphs: dict[int, tuple] = {}
        self._warm = False
        # a drafter-context append has run (its kernels initialised): catch-up graphs may then be captured unrun
        self._appended = False
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # prefill_buckets with graphs: per (prompts, padded length) the graph of the target's prefill forward, its
        # static token ids [n, L], slot ids [n] and positions [n, L], and its static output (TargetOutput)
        self._prefill_graphs: dict[tuple[int, int], tuple] = {}
        self.prefill_captured = False  # the last prefill captured its graph (a one-off cost inside that prefill's time)
        self.prefill_replays = 0  # prefills that replayed a captured graph

    @property
    def wants_anchor_hidden(self) -> bool:
        """The length policy reads the target's hidden state at the anchor (its ``needs_anchor_hidden``; read
        per call, so a policy swapped in later is honoured)."""
        return bool(getattr(self.length_policy, "needs_anchor_hidden", False))

    def reset_graphs(self) -> None:
        """Drop every captured step graph (each is captured again on its next use) and start a fresh memory pool
        for them: the old pool goes with its last graph, and capturing into it again would fail."""
        self.graphs.clear()
        self._replayed.clear()
        self._catch_up_graphs.clear()
        self._prefill_graphs.clear()
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
        """The drafter's q buffer at the first sampled step (none with ``argmax_drafts``: every block is a point
        mass, never sampled from q)."""
        if self.draft_probs is None and self.drafter is not None and not self.argmax_drafts:
            v = self.target.config.vocab_size
            # max_draft columns (>= bs-1): a step whose lookup rows are wider than the block reads zeros past it
            self.draft_probs = torch.zeros(self.num_slots, self.max_draft, v, dtype=torch.float32,
                                           device=self.device)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]], params: list, spec: bool,
                lookup: bool = False, append: bool = True) -> StepResult:
        """Run prompts through the target (writing their slots' KV, feature history and drafter context), record
        each request's sampling settings for its slot (:class:`~adaflash_ray.engine.sampling.SlotSampling`), choose
        each first token from the processed logits of the prompt's last position and, with ``spec``, propose each
        request's first block.

        params: one ``SamplingParams`` per prompt (``stop_token_ids`` resolved: the tokens that end it). Returns a
        :class:`StepResult`: one committed token per request, ``num_accepted`` 0, ``next_draft_lens`` the first
        block's γ (0 without ``spec``), ``expected`` / ``logprobs`` as a step's (one host transfer). With a device
        lookup the slots' token histories take the prompts and first tokens, and ``lookup`` also proposes each
        request's first lookup draft (``StepResult.lookup``). ``append=False`` (only without ``spec``) leaves the drafter
        context of the prompts to the first step that proposes or appends (:meth:`catch_up_context`, from the feature
        history written here): a request whose first steps draft from lookups or none pays no drafter work. On CUDA all
        prompts go in one right-padded batch (pad entries lie beyond each prompt and are overwritten later); on CPU
        one prompt at a time (no padding waste, unless ``prefill_buckets`` pads it to its length bucket).
        """
        self._plain_slots = frozenset()  # a prefill writes out rows too: no plain launch chains past it
        if not self.is_cuda and len(prompts) > 1:
            return _concat([self.prefill([s], [p], [sp], spec, lookup, append)
                            for s, p, sp in zip(slots, prompts, params)])
        if spec and not append:
            raise ValueError("a prefill that proposes the first block needs the drafter context (append=True)")
        dev = self.device
        n, plen = len(prompts), self._prefill_len(max(map(len, prompts)))
        ids = torch.zeros(n, plen, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        slot_t = torch.tensor(slots, device=dev)
        self.sampling.set_slots(slots, params, prompts)
        unif = np.zeros((n, self.in_uniforms.shape[1]), np.float32)
        floats, top_k, min_left, seeded, flags = self.sampling.step_inputs(slots, np.zeros(n, np.int64), unif,
                                                                           list(range(n)))
        rs = self.sampling.rows(flags, *(torch.from_numpy(a).to(dev) for a in (floats, top_k, min_left, seeded, unif)),
                                slot_t)
        positions = torch.arange(plen, device=dev).expand(n, plen)
        out = self._prefill_forward(ids, positions, slot_t)
        last = out.last_hidden[torch.arange(n, device=dev), lens - 1]  # [N, H]
        logits = self.target.lm_head(last)[:, None]  # [N, 1, V]
        if flags.sample:
            self._ensure_sampling()
        zero = torch.zeros(n, 1, dtype=torch.long, device=dev)
        first = choose_tokens(adjust_logits(logits, rs, zero), rs, flags.sample, self.generator, zero)[0][:, 0]
        if flags.penalties:  # the first output token joins the counts (the first block's q reads them)
            self.sampling.counts[slot_t] = torch.nn.functional.one_hot(first, logits.shape[-1]).to(torch.int32)
            rs = rs._replace(counts=self.sampling.counts[slot_t])
        rows = slot_t[:, None].expand(n, plen)
        if self.feat_hist is not None:
            self.feat_hist[rows, positions] = out.features.to(self.feat_hist.dtype)
        if self.hid_hist is not None:
            self.hid_hist[rows, positions] = out.last_hidden.to(self.hid_hist.dtype)
        gamma, expected = torch.zeros_like(first), None
        propose = spec and self.drafter is not None
        if self.drafter is not None:
            if append:
                self.drafter.append_context(self.ctx, rows, positions, out.features)
                self._appended = True
            for s, prompt in zip(slots, prompts):
                self.ctx_len[s] = len(prompt) if append else 0  # 0: caught up from the history when needed
            if spec:
                gamma, expected = self._propose(slot_t, first, lens, plen + self.block_size, rs, flags.sample,
                                                torch.ones_like(first), rows_are_slots=False, anchor_hidden=last)
        self.out[slot_t, 0], self.out[slot_t, 1], self.out[slot_t, 2] = first, 0, gamma
        if expected is not None:
            self.out[slot_t, self._exp_col:self._look_col] = (expected * EXPECTED_SCALE).round().long()
        lookup = self._check_lookup(lookup)
        if self.lookup is not None:
            self.lookup.write_prompts(slot_t, ids, lens, first)
            if lookup:
                self.out[slot_t, self._look_col:self._lp_col] = self.lookup.propose_packed(
                    slot_t, self.lookup.history[slot_t, :plen + 1], lens + 1)
        if flags.logprobs >= 0:
            self._write_logprobs(slot_t, logits, first[:, None], flags.logprobs)
        host = self.out[slot_t, :self._num_out_cols(1, expected is not None, flags.logprobs, lookup)].cpu().numpy()
        return self._result(slots, host, 1, propose, expected is not None, flags.logprobs, lookup)  # one transfer

    def _prefill_len(self, longest: int) -> int:
        """The positions a prefill whose longest prompt has ``longest`` tokens runs: ``longest``, or with
        ``prefill_buckets`` the next of :data:`PREFILL_LEN_BUCKETS` (beyond the last: the next multiple of
        :data:`PREFILL_LEN_STEP`), at most ``max_seq_len`` (and never below ``longest``)."""
        if not self.prefill_buckets:
            return longest
        b = next((x for x in PREFILL_LEN_BUCKETS if x >= longest), -(-longest // PREFILL_LEN_STEP) * PREFILL_LEN_STEP)
        return max(min(b, self.max_seq_len), longest)

    def _prefill_forward(self, ids: torch.Tensor, positions: torch.Tensor, slot_t: torch.Tensor):
        """The target's prefill forward of ``ids`` ``[n, L]`` (device) at ``positions`` into the slots ``slot_t``
        ``[n]``: eager, or (``prefill_buckets`` with CUDA graphs) the replay of the (n, L) graph, captured after
        that shape's first eager forward. Returns the :class:`TargetOutput` (a graph's static one, in the memory pool
        the step graphs share: read it before any other graph replays)."""
        n, span = ids.shape
        kw = dict(cache=self.kv, capture_layer_ids=self.layer_ids, span=span, compute_logits=False)
        self.prefill_captured = False
        if not (self.prefill_buckets and self.use_graphs and self._warm):
            return self.target(ids, positions, slot_ids=slot_t, **kw)
        entry = self._prefill_graphs.get((n, span))
        if entry is not None:
            graph, ids_buf, slot_buf, _, out = entry  # the positions buffer is kept only for the graph to read
            ids_buf.copy_(ids)
            slot_buf.copy_(slot_t)
            graph.replay()
            self.prefill_replays += 1
            return out
        out = self.target(ids, positions, slot_ids=slot_t, **kw)  # this prefill's result (its kernels initialised)
        if len(self._prefill_graphs) < MAX_PREFILL_GRAPHS and n * span <= MAX_PREFILL_GRAPH_TOKENS:
            ids_buf, slot_buf, pos_buf = ids.clone(), slot_t.clone(), positions.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):  # recorded, not run: the KV holds the eager forward's
                static = self.target(ids_buf, pos_buf, slot_ids=slot_buf, **kw)
            self._uploaded(graph)
            # every input buffer stays referenced here: the graph reads their addresses, not the tensors
            self._prefill_graphs[(n, span)] = (graph, ids_buf, slot_buf, pos_buf, static)
            self.prefill_captured = True
        return out

    def _check_lookup(self, lookup: bool) -> bool:
        if lookup and self.lookup is None:
            raise ValueError("a lookup step needs a runner built with device_lookup")
        return bool(lookup)

    # ------------------------------------------------------------------ propose
    def _propose(self, slot_ids, anchors, anchor_pos, span, rs: RowSampling, sample: bool, base, rows_are_slots,
                 live=None, anchor_hidden=None, expected: bool = True):
        """Drafter forward on ``[anchor, MASK...]`` -> pending drafts (+ their probabilities q when sampling)
        stored per slot; returns (γ ``[B]`` from the length policy (``live`` [B] bool: the rows that are real
        requests, None = all), None) or, with an ``expected_fn``, (zeros ``[B]`` - the planner picks each row's γ;
        no policy forward - , E[committed | γ] ``[B, bs-1]`` float; without ``expected``: None, no head forward).
        A policy with ``needs_anchor_hidden`` also gets ``anchor_hidden`` ``[B, H]``: the target's final-normed hidden
        state whose logits gave each anchor token.

        The block's logits get the rows' processing ``rs`` (:class:`~adaflash_ray.engine.sampling.RowSampling`) with
        the committed output's penalty counts (its positions are drawn in parallel, so a position does not see the
        block's earlier drafts - q is still exactly what the drafts are drawn from); ``base`` ``[B]`` int64: tokens
        committed since ``rs``'s first output index, so block position k (1..bs-1) is output index base + k - 1 from
        there (min_tokens, seeded uniforms). Drafts: greedy rows (and every row with ``argmax_drafts``) the argmax,
        sampling rows a sample of q (seeded rows: at their uniforms, coupled with the target's seeded sample)."""
        span = min(span, self.max_seq_len)
        hidden = self.drafter.propose_hidden(self.ctx, slot_ids, anchors, anchor_pos, span=span,
                                             rows_are_slots=rows_are_slots)  # [B, bs, H]
        draft_logits = self.drafter.logits(hidden[:, 1:])  # [B, bs-1, V]
        b, nb = anchors.shape[0], draft_logits.shape[1]
        index = base[:, None] + torch.arange(nb, device=anchors.device)  # [B, bs-1]
        drafts, q = choose_tokens(adjust_logits(draft_logits, rs, index), rs, sample and not self.argmax_drafts,
                                  self.generator, index)
        if q is not None:
            if rows_are_slots:
                self.draft_probs[:b, :nb] = q
            else:
                self.draft_probs[slot_ids, :nb] = q
        if rows_are_slots:
            self.drafts[:b, :nb] = drafts
        else:
            self.drafts[slot_ids, :nb] = drafts
        if self.expected_fn is not None:  # the planner's estimate; it chooses γ per row (no policy forward)
            return (torch.zeros(b, dtype=torch.long, device=anchors.device),
                    self.expected_fn(hidden, draft_logits) if expected else None)
        expected = None
        if self.wants_anchor_hidden:
            return self.length_policy(hidden, draft_logits, live, anchor_hidden=anchor_hidden).to(torch.long), expected
        return self.length_policy(hidden, draft_logits, live).to(torch.long), expected

    # ------------------------------------------------------------------ one step (graph body)
    def _step_fn(self, b: int, w: int, span: int, spec: bool, propose: bool = True, host_drafts: bool = False,
                 sampling: SamplingFlags = SamplingFlags(), append: bool = True, lookup: bool = False,
                 propose_first: bool = False, expected: bool = True, plain: bool = False) -> None:
        """Rows 0..b-1, verify width w, keys 0..span-1. Reads in_ints / in_floats / in_uniforms / drafts; writes out,
        caches, histories, drafts, the output counts. ``spec`` without ``propose``: no block is proposed (an AR step
        of the ``cost`` policy's γ = 0, or a step that verifies only host drafts); with ``append`` the drafter
        context still takes the new positions. ``host_drafts``: rows flagged in in_ints column 3 verify in_ints' host
        drafts (flag 1) or the device lookup's latest proposal (flag 2; a point-mass q when sampling) instead of the
        drafter's. With a device lookup the committed tokens join the slots' token histories; ``lookup``: then the
        next lookup proposals are made from the new contexts (keys 0..span, ``out``'s lookup columns).
        ``propose_first``: the drafter first proposes a block at each row's anchor (its context holds the positions
        before it), whose drafts this step verifies (rows flagged for host / lookup drafts keep theirs) and whose
        E[committed | γ] goes to ``out`` as a proposing step's would; ``expected`` False: a proposing step skips its
        block's E[committed | γ] (the acceptance head). ``plain`` (``spec`` off): no features captured and no history
        written (feature, hidden, device lookup). ``sampling`` says which processing the rows need; window position
        j's penalty counts and min_tokens test include the drafts d_1..d_j. Seeded rows verify against the target's
        own sample at their uniforms (drafter-invariant, see :mod:`adaflash_ray.engine.sampling`). No host
        synchronisation (CUDA-graph safe)."""
        dev = self.device
        ints = self.in_ints[:b]
        anchor, pos, gamma = ints[:, 0], ints[:, 1], ints[:, 2]
        c = self._topk_col
        rs = self.sampling.rows(sampling, self.in_floats[:b], ints[:, c], ints[:, c + 1], ints[:, c + 2],
                                self.in_uniforms[:b], slice(0, b))
        sample, penalties, logprobs = sampling.sample, sampling.penalties, sampling.logprobs
        temp = rs.temperature
        ar = torch.arange(w, device=dev)
        positions = (pos[:, None] + ar).clamp(max=self.max_seq_len - 1)  # [B, W] (clamp: padded columns only)
        g_max = w - 1
        rows = torch.arange(b, device=dev)[:, None]
        first_exp = None
        if propose_first:  # this step's own block: its anchor and drafter context are current (base 0: output index 0)
            _, first_exp = self._propose(rows[:, 0], anchor, pos, span, rs, sample,
                                         torch.zeros_like(pos), rows_are_slots=True, live=pos > 0)
        d = self.drafts[:b, :g_max]  # [B, Γ]
        point = None
        if host_drafts:
            flag = ints[:, 3]
            point = flag > 0
            d = torch.where((flag == 1)[:, None], ints[:, 4:4 + g_max], d)
            if self.lookup is not None:  # the device lookup's proposal of the previous step, still on the device
                d = torch.where((flag == 2)[:, None], self.lookup.drafts[:b, :g_max], d)
        if self.argmax_drafts:  # every row's drafts are deterministic: the drafter's argmax or the host's
            point = torch.ones_like(pos, dtype=torch.bool)
        inp = torch.cat([anchor[:, None], d], 1)  # [B, W]
        out = self.target(inp, positions, cache=self.kv, capture_layer_ids=None if plain else self.layer_ids,
                          span=span, rows_are_slots=True, logits_dtype=None, split_k=self.split_k)
        extra = window_counts(d, w, out.logits.shape[-1]) if penalties else None
        logits = adjust_logits(out.logits, rs, ar[None], extra)  # [B, W, V]
        live = ar[None, :g_max] < gamma[:, None]  # [B, Γ]
        accepted, nxt = match_prefix(d, logits.argmax(-1), live)  # greedy: correction or bonus
        if sample:
            p = processed_probs(logits, temp, rs.top_p, rs.min_p, rs.top_k)  # [B, W, V]
            q = self.draft_probs[:b, :g_max] if self.draft_probs is not None else None
            acc_s, nxt_s = rejection_sample(d, p, q, live, self.generator, point)
            if sampling.seeded:  # drafter-invariant: accept while drafts equal the target's sample at the uniforms
                acc_c, nxt_c = match_prefix(d, sample_inverse_cdf(p, rs.uniforms[:, :w]), live)
                acc_s, nxt_s = torch.where(rs.seeded, acc_c, acc_s), torch.where(rs.seeded, nxt_c, nxt_s)
            stochastic = temp > 0
            accepted = torch.where(stochastic, acc_s, accepted)
            nxt = torch.where(stochastic, nxt_s, nxt)
        committed = torch.cat([d, torch.zeros_like(anchor)[:, None]], 1)  # [B, W]
        committed.scatter_(1, accepted[:, None], nxt[:, None])
        if host_drafts and self.drafter is not None and g_max > 0:
            # the drafter's pending block where the step verified other drafts: its common prefix with the committed
            # tokens (the target's own up to the correction / bonus), a counterfactual acceptance of the block cut at
            # min(a + 1, W - 1); only meaningful for rows whose block is current and greedy (the host knows which)
            same = (self.drafts[:b, :g_max] == committed[:, :g_max]) & (ar[None, :g_max] <= accepted[:, None])
            self.out[:b, self._cf_col] = same.long().cumprod(1).sum(1)
        if penalties:  # the committed tokens join the output counts (read by the next block's q and the next step)
            rs.counts.scatter_add_(1, committed, (ar[None] <= accepted[:, None]).to(rs.counts.dtype))
        if self.lookup is not None and not plain:
            self.lookup.write_committed(b, pos, committed, accepted)
            if lookup:  # the new context ends at the correction / bonus token, position pos + accepted + 1
                h = min(span + 1, self.max_seq_len)
                self.out[:b, self._look_col:self._lp_col] = self.lookup.propose_packed(
                    slice(0, b), self.lookup.history[:b, :h], pos + accepted + 2)
        # the histories of rows 0..b-1 (= slots): one scatter along the position axis per history (an advanced-index
        # put would first build the broadcast index tensors)
        at = positions[:, :, None]  # [B, W, 1]
        if self.feat_hist is not None and not plain:
            f = out.features
            self.feat_hist[:b].scatter_(1, at.expand(-1, -1, f.shape[-1]), f.to(self.feat_hist.dtype))
        if self.hid_hist is not None and not plain:
            hd = out.last_hidden
            self.hid_hist[:b].scatter_(1, at.expand(-1, -1, hd.shape[-1]), hd.to(self.hid_hist.dtype))
        self.out[:b, :w] = committed
        self.out[:b, w] = accepted
        if logprobs >= 0:
            self._write_logprobs(slice(0, b), out.logits, committed, logprobs)
        if spec and append and self.drafter is not None:
            self.drafter.append_context(self.ctx, rows.expand(b, w), positions, out.features)
            self._appended = True  # eagerly, or inside a capture that succeeded: its kernels were compiled before
        if spec and propose:
            # rows of idle slots and of the padded bucket carry position 0 (a real request's anchor is >= 1)
            anchor_hidden = out.last_hidden[rows[:, 0], accepted] if self.wants_anchor_hidden else None  # [B, H]
            gamma_next, exp = self._propose(rows[:, 0], nxt, pos + accepted + 1, span, rs, sample, accepted + 1,
                                            rows_are_slots=True, live=pos > 0, anchor_hidden=anchor_hidden,
                                            expected=expected)
            self.out[:b, w + 1] = gamma_next
            if exp is not None:
                self.out[:b, self._exp_col:self._look_col] = (exp * EXPECTED_SCALE).round().long()
        elif first_exp is not None:
            self.out[:b, self._exp_col:self._look_col] = (first_exp * EXPECTED_SCALE).round().long()

    def _write_logprobs(self, rows, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> None:
        """Log-probabilities under the raw target distribution (log_softmax of the logits before any processing,
        vLLM's default ``raw_logprobs``) into ``out``: logits ``[B, N, V]``, tokens ``[B, N]``, rows the out rows
        (a slice or ``[B]`` ids); with ``k > 0`` also the top-k ids and logprobs per position, best first."""
        lp = torch.log_softmax(logits.float(), -1)  # [B, N, V]
        b, n = tokens.shape
        self.out[rows, self._lp_col:self._lp_col + n] = lp.gather(2, tokens[..., None])[..., 0].view(torch.int32).long()
        if k > 0:
            vals, ids = lp.topk(k, -1)  # [B, N, K]
            c, m = self._top_col, (self.max_draft + 1) * MAX_TOP_LOGPROBS
            self.out[rows, c:c + n * k] = ids.reshape(b, n * k)
            self.out[rows, c + m:c + m + n * k] = vals.view(torch.int32).long().reshape(b, n * k)

    def _num_out_cols(self, w: int, with_exp: bool, logprobs: int, lookup: bool = False, with_cf: bool = False) -> int:
        """The out columns a step's host transfer needs (width ``w``; expected; logprobs and lookup as in StepKey;
        ``with_cf``: the drafter block's counterfactual match column)."""
        if logprobs > 0:
            return self.out.shape[1]
        if logprobs == 0:
            return self._top_col
        if lookup:
            return self._lp_col
        if with_exp:
            return self._look_col
        return self._cf_col + 1 if with_cf else w + 2

    def _result(self, slots: list[int], host: np.ndarray, w: int, with_next: bool, with_exp: bool,
                logprobs: int, lookup: bool = False, with_cf: bool = False) -> StepResult:
        """Decode the out rows of ``slots`` (``host`` ``[n, cols]`` int64, in the order of ``slots``)."""
        acc = host[:, w].tolist()
        cf = None
        if with_cf:  # (match, known) per row: the block's common prefix with the committed tokens, and where it is cut
            cf = list(zip(host[:, self._cf_col].tolist(), [min(a + 1, w - 1) for a in acc]))
        # each row's committed tokens: one host list of the first w columns, cut per row (no per-row numpy slice)
        committed = [[t] for t in host[:, 0].tolist()] if w == 1 else \
            [r[: a + 1] for r, a in zip(host[:, :w].tolist(), acc)]
        nxt = host[:, w + 1].tolist() if with_next else [0] * len(slots)
        expected = (host[:, self._exp_col:self._look_col] / EXPECTED_SCALE).tolist() if with_exp else None
        res = StepResult(committed=committed, num_accepted=acc, next_draft_lens=nxt, expected=expected,
                         lookup=host[:, self._look_col:self._lp_col].copy() if lookup else None, block_match=cf)
        if logprobs < 0:
            return res
        want = self.sampling.logprobs[np.asarray(slots)].tolist()
        chosen = host[:, self._lp_col:self._lp_col + w].astype(np.int32).view(np.float32)
        c, m, k_all = self._top_col, (self.max_draft + 1) * MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS
        res.logprobs, res.top_logprobs = [], []
        for i, (a, k) in enumerate(zip(acc, want)):
            if k < 0:
                res.logprobs.append(None)
                res.top_logprobs.append(None)
                continue
            res.logprobs.append(chosen[i, :a + 1].tolist())
            ids = host[i, c:c + (a + 1) * k_all].reshape(a + 1, k_all)[:, :k].tolist() if k else [[]] * (a + 1)
            vals = (host[i, c + m:c + m + (a + 1) * k_all].astype(np.int32).view(np.float32)
                    .reshape(a + 1, k_all)[:, :k].tolist()) if k else [[]] * (a + 1)
            res.top_logprobs.append([list(zip(t, v)) for t, v in zip(ids, vals)])
        return res

    def _run(self, key: StepKey) -> None:
        if not self.use_graphs:
            self._step_fn(*key)
            return
        graph = self.graphs.get(key)
        if graph is None:
            self.step_captured = True
            if not self._warm:  # the very first step runs eagerly (initialises cuBLAS, the allocator, kernels)
                self._warm = True
                self._step_fn(*key)
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step_fn(*key)
            self._uploaded(graph)
            self.graphs[key] = graph
        if key not in self._replayed:
            self._replayed.add(key)
            self.step_first_replay = True
        graph.replay()

    def _uploaded(self, graph: torch.cuda.CUDAGraph) -> None:
        """Upload a graph just captured (:func:`~adaflash_ray.engine.graph_upload.upload_graph`: its first replay then
        costs what the later ones do), counted in :attr:`num_uploaded`."""
        self.num_uploaded += upload_graph(graph)

    def graph_grid(self, keys=None) -> list[StepKey]:
        """The step keys an adaptive engine may meet next: every kind of step among ``keys`` (default: the captured
        ones) - the same ``spec`` / ``propose`` / ``host_drafts`` / ``sampling`` / ``append`` / ``lookup`` - at every
        batch bucket, every span this runner reaches (:meth:`_span` up to ``max_seq_len``) and, for a verify step,
        every width bucket (an AR key stays at width 1). Empty without CUDA graphs (CPU: no buckets, nothing to
        capture). Sorted by (batch, width, span) within the order the kinds first appear."""
        if not self.use_graphs:
            return []
        seen = self.graphs if keys is None else keys
        kinds = dict.fromkeys(k._replace(batch_size=0, width=0, span=0) for k in seen)
        spans = sorted({self._span(n) for n in range(1, self.max_seq_len + 1, 16)} | {self._span(self.max_seq_len)})
        out = []
        for kind in kinds:
            widths = self._width_buckets if kind.spec else [1]
            out += [kind._replace(batch_size=b, width=w, span=sp)
                    for b in self._batch_buckets for w in widths for sp in spans]
        return out

    @torch.no_grad()
    def precapture(self, keys, max_seconds: float | None = None) -> tuple[int, str | None]:
        """Capture the CUDA graph of each of ``keys`` (:class:`StepKey`) not captured yet, in order, without running it
        (a capture records the kernels; nothing in the KV cache or the drafter context changes), so a later step of
        that shape replays at once instead of capturing inside a step (tens of ms each). After the runner's first
        step only (that one runs eagerly to initialise the kernels). Stops early - the rest stay lazy - once
        ``max_seconds`` have passed or a capture fails (e.g. out of device memory). Returns ``(graphs captured, why
        it stopped early or None)``; ``(0, None)`` without graphs."""
        if not self.use_graphs or not self._warm:
            return 0, None
        n, t0 = 0, time.perf_counter()
        for key in keys:
            if key in self.graphs:
                continue
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                return n, f"time budget of {max_seconds:g} s spent"
            try:
                if key.sampling.sample:
                    self._ensure_sampling()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self._step_fn(*key)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # the key stays lazy, as do the ones after it
                torch.cuda.synchronize()
                return n, f"capture of {key} failed: {type(e).__name__}: {str(e)[:200]}"
            self._uploaded(graph)
            self.graphs[key] = graph
            n += 1
        return n, None

    # ------------------------------------------------------------------ one step (host side)
    @torch.no_grad()
    def step(self, slots: list[int], anchors: list[int], anchor_pos: list[int], draft_lens: list[int], spec: bool,
             propose: bool = True, host_drafts: list[list[int] | None] | None = None,
             append: bool | None = None, lookup_rows: list[bool] | None = None, lookup: bool = False,
             block_match: bool = True, propose_first: bool = False,
             overlap: Callable[[], None] | None = None, expected: bool = True, plain: bool = False) -> StepResult:
        """One decoding step for the running requests in ``slots`` (each prefilled into its slot: the sampling
        settings are the ones :meth:`prefill` recorded).

        Args:
            anchors, anchor_pos: per request the last committed token and its position (= num_tokens-1).
            draft_lens: γ per request for this step (<= its pending drafts; 0 in AR mode), already capped by
                the host (remaining budget).
            spec: verify the pending drafts and propose the next block; False = plain AR (W = 1).
            propose: with ``spec``, False skips the drafter's propose (only host drafts may then be verified):
                next_draft_lens are 0. Without a drafter a step never proposes.
            host_drafts: per request None (verify the drafter's pending drafts) or token ids the host proposes
                (a lookup source), at least ``draft_lens[i]`` of them; verified as a point-mass q. None = none.
            append: with ``spec`` and a drafter, whether the drafter context takes this step's positions (None =
                ``spec``). A step that skips it leaves the slot's context behind; the next step that proposes or
                appends first recomputes the missing positions from the feature history (:meth:`catch_up_context`),
                so AR stretches pay no drafter work.
            lookup_rows: per request True to verify the device lookup's latest proposal (made by the previous step
                or prefill with ``lookup``; the caller keeps γ within its length), instead of the drafter's block or
                host drafts. None = none.
            lookup: propose the next lookup drafts on the device at the end of the step (``StepResult.lookup``).
            block_match: on a step that verifies host / device-lookup drafts with a drafter, decode the pending
                blocks' match (``StepResult.block_match``); False leaves it None (no row has a current block: the
                caller has nothing to score; the device computes it either way).
            propose_first: with ``spec`` and a drafter, propose a block at the anchors first and verify it in this
                step (rows with host / device-lookup drafts verify those); ``propose`` must then be False. The
                block's E[committed | γ] comes back as ``StepResult.expected`` (with an ``expected_fn``) and
                ``next_draft_lens`` are 0.
            overlap: host work to run once the step is launched, before its result is read (on CUDA the device
                computes the step meanwhile; on CPU the forward has run already): e.g. the previous step's records.
            expected: with ``propose`` and an ``expected_fn``, compute the new blocks' E[committed | γ]
                (``StepResult.expected``); False skips the acceptance head (``expected`` is then None) - for a step
                whose next step verifies the block at a γ fixed beforehand.
            plain: an AR step (``spec`` off) that keeps no history for the drafter or the device lookup: no target
                features captured, nothing written to the feature / hidden history or the lookup's token history -
                the AR engine's step. The slots' histories then lack these positions: a later step that drafts for
                them (a catch-up of the drafter context, a lookup proposal) reads what was there before, which
                costs acceptance, never correctness (verification does not trust the drafts); for requests that
                will not draft again (SpecEngine ``makespan_lock``).
        Raises:
            ValueError: drafter drafts to verify without a drafter, or host drafts shorter than their γ or longer
                than ``max_draft``; ``lookup`` / ``lookup_rows`` without a device lookup; ``plain`` with ``spec``,
                host drafts or ``lookup``.
        """
        if plain and (spec or lookup or host_drafts is not None or lookup_rows is not None):
            raise ValueError("a plain step is an AR step: spec, host drafts and lookups are off")
        has_drafter = self.drafter is not None
        if propose_first and (propose or not spec or not has_drafter):
            raise ValueError("propose_first needs a speculative step with a drafter and propose=False")
        propose = (propose or not spec) and has_drafter
        append = (spec if append is None else append and spec) and has_drafter
        use_host = host_drafts is not None and any(h is not None for h in host_drafts)
        use_dev = lookup_rows is not None and any(lookup_rows)
        lookup = self._check_lookup(lookup or use_dev) and lookup
        # the per-row checks: host or device-lookup drafts to bound, or drafts without a drafter (an AR step, or a
        # drafter's step where every row verifies its own block, has nothing to check)
        checked = draft_lens if use_host or use_dev or (spec and not has_drafter) else ()
        for i, g in enumerate(checked):
            h = host_drafts[i] if use_host else None
            if use_dev and lookup_rows[i]:
                if g > self.max_draft:
                    raise ValueError(f"lookup drafts of request {i}: γ {g} above max_draft {self.max_draft}")
            elif h is not None:
                if len(h) < g or len(h) > self.max_draft:
                    raise ValueError(f"host drafts of request {i}: {len(h)} tokens for γ {g} (max {self.max_draft})")
            elif spec and g and not has_drafter:
                raise ValueError(f"request {i}: γ {g} without host drafts needs a drafter's pending block")
        self.step_catch_up, self.step_captured, self.step_first_replay = (0, 0.0), False, False
        self._plain_slots = frozenset()  # out now holds this step's rows: no plain launch chains to it
        if has_drafter and spec and (propose or append or propose_first):  # a context left behind comes back first
            stale = [(s, self.ctx_len[s], p) for s, p in zip(slots, anchor_pos) if self.ctx_len[s] < p]
            if stale:
                t0 = self.clock()
                self.catch_up_context(stale)
                self.step_catch_up = (sum(p - c for _, c, p in stale), self.clock() - t0)
        b = max(slots) + 1
        g_max = max(draft_lens) if spec else 0
        w = g_max + 1
        if self.is_cuda:  # the same buckets with or without graphs
            b = _round_up(b, self._batch_buckets)
            w = _round_up(w, self._width_buckets)
        self.step_shape = (b, w)  # the rows and verify width the device runs (buckets on CUDA)
        span = self._span(max(anchor_pos) + w + (self.block_size if spec and (propose or propose_first) else 0))
        bufs = (self._ints_host, self._floats_host, self._uniforms_host)
        idx, ints, flags = self._host_inputs(slots, anchors, anchor_pos, draft_lens, b, bufs)
        if use_host:  # the host's drafts ride in the same input buffer: still one host -> device copy of ints
            for s, h in zip(slots, host_drafts):
                if h is not None:
                    ints[s, 3] = 1
                    ints[s, 4:4 + len(h)] = h
        if use_dev:  # the device lookup's proposals stay on the device: only the flag travels
            ints[idx[np.asarray(lookup_rows, dtype=bool)], 3] = 2
            use_host = True
        self._copy_inputs(b, flags, bufs)
        if plain:  # the AR engine's own step: no capture, no history
            key = StepKey(b, w, span, False, False, False, flags, False, False, plain=True)
        elif spec and not (propose or append or use_host or propose_first) and w == 1:
            # the cost policy's γ = 0 step: the AR step's graph (same work, no graph capture of its own)
            key = StepKey(b, w, span, False, has_drafter, False, flags, False, lookup)
        else:
            key = StepKey(b, w, span, spec, propose, use_host and spec, flags, append, lookup, propose_first,
                          expected or not (spec and propose) or self.expected_fn is None)
        self._run(key)
        if overlap is not None:
            overlap()
        with_exp = spec and (propose_first or propose and expected) and self.expected_fn is not None
        with_cf = use_host and spec and has_drafter and w > 1 and block_match
        cols = self._num_out_cols(w, with_exp, flags.logprobs, lookup, with_cf)
        host = self.out[:b, :cols].cpu().numpy()  # the one transfer
        res = self._result(slots, host[idx], w, spec and propose, with_exp, flags.logprobs, lookup, with_cf)
        if append:
            for s, p, a in zip(slots, anchor_pos, res.num_accepted):
                self.ctx_len[s] = p + a + 1
        return res

    def _host_inputs(self, slots: list[int], anchors, anchor_pos: list[int], draft_lens, b: int,
                     bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, np.ndarray, SamplingFlags]:
        """Write one step's per-row inputs (anchor token, position, γ, sampling settings; rows ``0..b-1``, idle rows
        neutral) into the host staging buffers ``bufs`` = (ints, floats, uniforms); returns (the slots as an index
        array, the ints buffer as numpy for further columns, the step's sampling flags)."""
        ints_h, floats_h, unif_h = bufs
        idx = np.asarray(slots)
        ints, floats = ints_h.numpy(), floats_h.numpy()
        num_generated = np.asarray(anchor_pos) + 1 - self.sampling.prompt_len[idx]
        row_floats, top_k, min_left, seeded, flags = self.sampling.step_inputs(slots, num_generated, unif_h.numpy())
        if flags.sample:
            self._ensure_sampling()
        ints[:b] = 0
        floats[:b] = NEUTRAL_FLOATS
        ints[idx, 0], ints[idx, 1], ints[idx, 2] = anchors, anchor_pos, draft_lens
        c = self._topk_col
        ints[idx, c], ints[idx, c + 1], ints[idx, c + 2] = top_k, min_left, seeded
        floats[idx] = row_floats
        return idx, ints, flags

    def _copy_inputs(self, b: int, flags: SamplingFlags, bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The host -> device copies of rows ``0..b-1`` of the staging buffers ``bufs`` into the graphs' inputs."""
        ints_h, floats_h, unif_h = bufs
        self.in_ints[:b].copy_(ints_h[:b], non_blocking=True)
        self.in_floats[:b].copy_(floats_h[:b], non_blocking=True)
        if flags.seeded:
            self.in_uniforms[:b].copy_(unif_h[:b], non_blocking=True)

    # ------------------------------------------------------------------ overlapped plain steps
    @torch.no_grad()
    def launch_plain(self, slots: list[int], anchor_pos: list[int], anchors: list[int] | None = None,
                     history: bool = False) -> PendingStep:
        """Launch one plain AR step (:meth:`step` with ``plain``: width 1, no history kept; ``history``: the
        ``cost`` policy's γ = 0 step instead, which writes the target features into the feature history for the
        drafter's later catch-up) without waiting for it:
        its result's host copy is queued behind it (a pinned buffer; CUDA event) and :meth:`finish_plain` reads it.
        ``anchors`` None chains the step to the plain step launched before it: each row's anchor token is that
        step's committed token in the same slot, read on the device (``out[:, 0]``), so the host can launch this
        step before it knows the last one's tokens - the overlap scheduling of vLLM (``async_scheduling``) and
        SGLang (its overlap scheduler): the host's work on one step's result runs while the device computes the next.
        ``anchor_pos`` must then be the positions after that step (one token a row). Two sets of staging buffers
        alternate, so a launch never rewrites the inputs or the result buffer of the step still in flight (at most
        one: the caller finishes a step before it launches the one after next).
        Raises ValueError for a chained launch over a slot the plain launch before it did not run (or with another
        step, prefill or slot move between them)."""
        b = max(slots) + 1
        if self.is_cuda:
            b = _round_up(b, self._batch_buckets)
        if anchors is None and not self._plain_slots.issuperset(slots):
            raise ValueError(f"launch_plain: a chained step over slots {sorted(set(slots) - self._plain_slots)} the "
                             "plain step before did not run (none, or another step came between)")
        self._plain_parity ^= 1
        k = self._plain_parity
        if self._plain_bufs[k] is None:
            pin = self.is_cuda
            staging = (torch.zeros_like(self._ints_host, pin_memory=pin),
                       torch.zeros_like(self._floats_host, pin_memory=pin),
                       torch.zeros_like(self._uniforms_host, pin_memory=pin))
            self._plain_bufs[k] = (staging, torch.zeros(self.out.numel(), dtype=self.out.dtype, pin_memory=pin))
        bufs, out_host = self._plain_bufs[k]
        self.step_catch_up, self.step_captured, self.step_first_replay = (0, 0.0), False, False
        self.step_shape = (b, 1)
        idx, _, flags = self._host_inputs(slots, 0 if anchors is None else anchors, anchor_pos, 0, b, bufs)
        self._copy_inputs(b, flags, bufs)
        if anchors is None:  # the step before's committed tokens, where the rows are (slots do not move between)
            self.in_ints[:b, 0].copy_(self.out[:b, 0])
        span = self._span(max(anchor_pos) + 1)
        self._run(StepKey(b, 1, span, False, self.drafter is not None, False, flags, False, False) if history else
                  StepKey(b, 1, span, False, False, False, flags, False, False, plain=True))
        self._plain_slots = frozenset(slots)
        cols = self._num_out_cols(1, False, flags.logprobs)
        host = out_host[: b * cols].view(b, cols)
        host.copy_(self.out[:b, :cols], non_blocking=True)
        event = None
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return PendingStep(list(slots), idx, host, event, flags.logprobs, (b, 1), self.step_captured,
                           self.step_first_replay)

    def finish_plain(self, pending: PendingStep) -> StepResult:
        """Wait for a step of :meth:`launch_plain` and decode its result (:meth:`step`'s, for its slots)."""
        if pending.event is not None:
            pending.event.synchronize()
        return self._result(pending.slots, pending.host.numpy()[pending.idx], 1, False, False, pending.logprobs)

    @torch.no_grad()
    def catch_up_context(self, spans: list[tuple[int, int, int]]) -> None:
        """Append the drafter context of positions ``start .. stop-1`` of each ``(slot, start, stop)`` from the
        feature history (the committed positions that steps with ``append=False`` skipped): eager, ONE drafter
        projection for every slot's positions together (a handful of kernels whatever the batch). Afterwards each
        slot's context holds positions < its ``stop``. :meth:`step` notes the catch-up it ran in ``step_catch_up``
        (positions, host seconds by ``clock``; 0 without one)."""
        spans = [(s, a, b) for s, a, b in spans if b > a]
        if not spans:
            return
        rows, pos = _expand_spans(spans)
        if self.use_graphs:
            self._catch_up_graphed(rows, pos)
        else:
            rows_t = torch.from_numpy(rows).to(self.device)
            pos_t = torch.from_numpy(pos).to(self.device)
            self._append_from_history(rows_t, pos_t)
        self._appended = True
        for s, _, b in spans:
            self.ctx_len[s] = max(self.ctx_len[s], b)

    @torch.no_grad()
    def precapture_catch_up(self, max_size: int = 8192, max_seconds: float | None = None) -> tuple[int, str | None]:
        """Capture the drafter-context catch-up graphs of every padded size (:meth:`_catch_up_graphed`: powers of two
        from 64) up to ``max_size`` not captured yet, without running them (a capture records the feature gather, the
        context projection and the K/V writes; nothing in the drafter context changes), so the first catch-up of
        each size after an AR stretch (the ``cost`` policy's probes, a planner's block coming back) replays instead
        of capturing inside its step. Only once an append of the drafter context has run (its kernels initialised:
        a capture must not be where a Triton kernel first compiles); sizes past the most positions this runner holds
        (``num_slots x max_seq_len``) are left out. Stops early at ``max_seconds`` or at a failed capture. Returns
        ``(graphs captured, why it stopped early or None)``; ``(0, None)`` without graphs or a drafter, ``(0, "no
        drafter-context append has run yet")`` before one."""
        if not self.use_graphs or self.drafter is None:
            return 0, None
        if not (self._warm and self._appended):
            return 0, "no drafter-context append has run yet"
        max_size = min(max_size, max(64, 1 << (self.num_slots * self.max_seq_len - 1).bit_length()))
        n, t0, size = 0, time.perf_counter(), 64
        while size <= max_size:
            if size not in self._catch_up_graphs:
                if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                    return n, f"time budget of {max_seconds:g} s spent"
                rows_buf, pos_buf, host, _ = self._catch_up_entry(size)
                try:
                    self._catch_up_graphs[size] = (rows_buf, pos_buf, host, self._capture_catch_up(rows_buf, pos_buf))
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                    torch.cuda.synchronize()
                    return n, f"catch-up capture of size {size} failed: {type(e).__name__}: {str(e)[:200]}"
                n += 1
            size *= 2
        return n, None

    def _catch_up_graphed(self, rows: np.ndarray, pos: np.ndarray) -> None:
        """:meth:`catch_up_context`'s append on CUDA graphs: the ``N`` (row, position) pairs padded to a bucket
        (the next power of two >= max(N, 64)) by repeating the last pair - a padded entry writes the same K/V to the
        same place again, so the result is the unpadded append's - then the bucket's graph (captured on first use,
        noted in ``step_captured``: the feature gather, the drafter's context projection and every layer's K/V
        write) is replayed: one launch instead of the eager path's tens of kernel launches with host work between."""
        n = len(rows)
        size = max(64, 1 << (n - 1).bit_length())
        rows_buf, pos_buf, host, graph = self._catch_up_entry(size)
        h = host.numpy()
        h[0, :n], h[1, :n] = rows, pos
        h[0, n:], h[1, n:] = rows[-1], pos[-1]
        rows_buf.copy_(host[0], non_blocking=True)
        pos_buf.copy_(host[1], non_blocking=True)
        if graph is None:  # eager once (kernels initialised), then captured for the next catch-up of this size
            self.step_captured = True
            self._append_from_history(rows_buf, pos_buf)
            self._appended = True
            self._catch_up_graphs[size] = (rows_buf, pos_buf, host, self._capture_catch_up(rows_buf, pos_buf))
            return
        graph.replay()

    def _catch_up_entry(self, size: int) -> tuple:
        """The catch-up graph entry of padded ``size``: (rows buffer, positions buffer, pinned host staging [2, size],
        graph), new buffers and graph None where none is kept yet."""
        entry = self._catch_up_graphs.get(size)
        if entry is not None:
            return entry
        return (torch.zeros(size, dtype=torch.long, device=self.device),
                torch.zeros(size, dtype=torch.long, device=self.device),
                torch.zeros(2, size, dtype=torch.long, pin_memory=True), None)

    def _append_from_history(self, rows_buf: torch.Tensor, pos_buf: torch.Tensor) -> None:
        """The drafter context of the (row, position) pairs in the buffers, from the feature history."""
        self.drafter.append_context(self.ctx, rows_buf, pos_buf, self.feat_hist[rows_buf, pos_buf])

    def _capture_catch_up(self, rows_buf: torch.Tensor, pos_buf: torch.Tensor) -> torch.cuda.CUDAGraph:
        """A CUDA graph of :meth:`_append_from_history` over the buffers (captured, not run)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._append_from_history(rows_buf, pos_buf)
        self._uploaded(graph)
        return graph

    # ------------------------------------------------------------------ slots
    def batch_bucket(self, n: int) -> int:
        """The batch rows a step over slots 0..n-1 computes: ``n`` rounded up to a CUDA-graph bucket (CPU: ``n``)."""
        return _round_up(n, self._batch_buckets) if self.is_cuda else n

    @torch.no_grad()
    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Move every per-slot state of slots ``src`` to the free slots ``dst`` (eager; one index copy per tensor):
        the target's and the drafter's KV caches, the feature / hidden histories, the pending drafts and their q, the
        device lookup's token history and proposals, the sampling state and the drafter-context lengths. A step then
        reads the moved requests at their new slots, so a batch whose low slots emptied runs at a smaller batch
        bucket (the rows a step computes are slots 0..max(slot)). Raises ValueError unless ``src`` and ``dst`` are
        the same length, disjoint, with no repeats, all in 0..num_slots-1."""
        if len(src) != len(dst) or len(set(src) | set(dst)) != 2 * len(src) or \
                not all(0 <= x < self.num_slots for x in (*src, *dst)):
            raise ValueError(f"move_slots: src {src} and dst {dst} must be disjoint slot lists of one length")
        if not src:
            return
        self._plain_slots = frozenset()  # the rows moved: no plain launch chains past it
        si = torch.tensor(src, device=self.device)
        di = torch.tensor(dst, device=self.device)
        for cache in (self.kv, self.ctx):  # [L, S, T, H, D]
            if cache is not None:
                for t in (cache.k, cache.v):
                    t.index_copy_(1, di, t.index_select(1, si))
        lk = self.lookup
        for t in (self.feat_hist, self.hid_hist, self.drafts, self.draft_probs,
                  lk.history if lk is not None else None, lk.drafts if lk is not None else None):
            if t is not None:
                t.index_copy_(0, di, t.index_select(0, si))
        self.sampling.move_slots(src, dst, si, di)
        for a, b in zip(src, dst):
            self.ctx_len[b] = self.ctx_len[a]

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
        times = graph_replay_ms(fn, num_iters)
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
                              rows_are_slots=True, logits_dtype=None, split_k=self.split_k)
            return out.logits.argmax(-1)
        return self._time(fn, num_iters, reduce)

    @torch.no_grad()
    def time_step(self, batch_size: int, draft_len: int, context_len: int = 128, num_iters: int = 20,
                  reduce: str = "median", propose: bool = True, host_drafts: bool = False,
                  append: bool | None = None, lookup: bool = False) -> float:
        """Median (or least) wall-clock ms of one whole :meth:`step` - host inputs, the (graph-replayed) verify of
        width ``draft_len + 1``, the drafter propose (unless ``propose`` is False: an AR step, or with
        ``host_drafts`` a step verifying lookup drafts) and the one device -> host transfer - on slots
        0..batch_size-1 after ``context_len`` tokens, greedy. ``append``, ``lookup``: as in :meth:`step`. What an
        engine step
        costs including its host work, which a graph's own time leaves out. Overwrites those slots' KV, drafter
        context and drafts: call on an idle engine."""
        slots = list(range(batch_size))
        hd = [[0] * draft_len] * batch_size if host_drafts else None
        self.sampling.set_slots(slots, [SamplingParams()] * batch_size, [[0]] * batch_size)  # greedy, unprocessed
        args = (slots, [0] * batch_size, [context_len] * batch_size, [draft_len] * batch_size, True, propose, hd,
                append, None, lookup)
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
        greedy = RowSampling(temperature=torch.zeros(batch_size, device=dev))
        hid = torch.zeros(batch_size, self.target.config.hidden_size, dtype=self.dtype, device=dev)
        return self._time(lambda: self._propose(rows, anchors, pos, span, greedy, False, torch.ones_like(anchors),
                                                True, anchor_hidden=hid), num_iters, reduce)
