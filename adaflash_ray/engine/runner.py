"""ModelRunner: owns every tensor of the engine - target, drafter, length policy, the target KV
cache and the drafter context cache - and runs prefill and one batched speculative step.

A speculative step (ALGORITHMS.md §4; gpt-fast's layout): propose (one drafter forward per request
block) -> choose γ per request -> verify all drafts in one target forward of width max(γ)+1 ->
accept the longest matching prefix -> commit a+1 tokens. Rows with a smaller γ are padded; their
extra cache writes sit beyond every later query's causal limit and are overwritten (no leak).
One host transfer per step. ``mode="ar"`` is plain autoregressive decoding through the same path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adaflash_ray.models.drafter import DFlashDrafter
from adaflash_ray.models.target import TargetModel


@dataclass
class StepResult:
    """Host-side result of one step for B requests (python lists, one transfer)."""

    committed: list[list[int]]  # a_r + 1 tokens per request (before stop truncation)
    draft_lens: list[int]  # γ_r (0 in AR mode)
    num_accepted: list[int]  # a_r
    features: torch.Tensor  # [B, W, K*H] of the verify forward (positions p_r .. p_r+W-1)
    last_hidden: torch.Tensor  # [B, W, H]


class ModelRunner:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, length_policy, *,
                 num_slots: int, max_seq_len: int, layer_ids: list[int]):
        self.target, self.drafter, self.length_policy = target, drafter, length_policy
        self.layer_ids = list(layer_ids)
        self.max_seq_len = max_seq_len
        self.device = target.lm_head.weight.device
        self.kv = target.new_kv_cache(num_slots, max_seq_len)
        self.ctx = drafter.new_context_cache(num_slots, max_seq_len) if drafter is not None else None

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, slot: int, prompt_ids: list[int], temperature: float, generator=None):
        """Run the prompt through the target (and the drafter context). Returns
        ``(first_token, features [P, K*H], last_hidden [P, H])``."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1, P]
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        slots = torch.tensor([slot], device=self.device)
        out = self.target(ids, pos, cache=self.kv, slot_ids=slots, capture_layer_ids=self.layer_ids)
        logits = out.logits[0, -1]
        if temperature > 0:
            tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        else:
            tok = int(logits.argmax())
        if self.drafter is not None:
            self.drafter.append_context(self.ctx, slots.expand(ids.shape[1]), pos[0], out.features[0])
        return tok, out.features[0], out.last_hidden[0]

    @torch.no_grad()
    def rebuild_context(self, slot: int, features: torch.Tensor) -> None:
        """Recompute a slot's drafter context K/V from stored features ``[n, K*H]`` (after a weight swap)."""
        n = features.shape[0]
        pos = torch.arange(n, device=self.device)
        self.drafter.append_context(self.ctx, torch.full((n,), slot, device=self.device), pos, features)

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, slots: list[int], anchors: list[int], anchor_pos: list[int], max_draft: list[int],
             mode: str, temperature: float = 0.0, generator=None) -> StepResult:
        """One decoding step for B running requests.

        Args:
            slots, anchors, anchor_pos: per request KV slot, last committed token, its position.
            max_draft: per request upper bound on γ (remaining budget - 1).
            mode: "spec" (drafter + policy) or "ar" (γ = 0).
        """
        dev = self.device
        b = len(slots)
        slot_t = torch.tensor(slots, device=dev)
        anchor_t = torch.tensor(anchors, device=dev)
        pos_t = torch.tensor(anchor_pos, device=dev)
        cap = torch.tensor(max_draft, device=dev).clamp(min=0)
        if mode == "spec":
            bs = self.drafter.block_size
            hidden = self.drafter.propose_hidden(self.ctx, slot_t, anchor_t, pos_t)  # [B, bs, H]
            draft_logits = self.drafter.logits(hidden[:, 1:])  # [B, bs-1, V]
            gamma = torch.minimum(self.length_policy(hidden), cap)  # [B]
            if temperature > 0:
                q = torch.softmax(draft_logits / temperature, -1)  # [B, bs-1, V]
                drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator).view(b, bs - 1)
            else:
                q = None
                drafts = draft_logits.argmax(-1)  # [B, bs-1]
            g_max = int(gamma.max())
        else:
            gamma = torch.zeros(b, dtype=torch.long, device=dev)
            g_max, drafts, q = 0, torch.zeros(b, 0, dtype=torch.long, device=dev), None
        width = g_max + 1
        inp = torch.cat([anchor_t[:, None], drafts[:, :g_max]], dim=1)  # [B, W]
        positions = pos_t[:, None] + torch.arange(width, device=dev)  # [B, W]
        out = self.target(inp, positions, cache=self.kv, slot_ids=slot_t, capture_layer_ids=self.layer_ids)
        live = torch.arange(g_max, device=dev)[None, :] < gamma[:, None]  # [B, Γ]
        d = drafts[:, :g_max]
        if temperature > 0:
            p = torch.softmax(out.logits / temperature, -1)  # [B, W, V]
            accepted, nxt = _rejection_sample(d, p, None if q is None else q[:, :g_max], live, generator)
        else:
            g = out.logits.argmax(-1)  # [B, W]
            accepted = ((d == g[:, :g_max]) & live).long().cumprod(1).sum(1)  # [B]
            nxt = g.gather(1, accepted[:, None])[:, 0]  # correction or bonus
        committed_t = torch.cat([d, torch.zeros(b, 1, dtype=torch.long, device=dev)], 1)
        committed_t.scatter_(1, accepted[:, None], nxt[:, None])
        if self.drafter is not None:
            keep = torch.arange(width, device=dev)[None, :] <= accepted[:, None]  # anchor + accepted
            self.drafter.append_context(self.ctx, slot_t[:, None].expand(b, width)[keep], positions[keep],
                                        out.features[keep])
        host = torch.stack([gamma, accepted], 0).tolist()  # one transfer
        rows = committed_t.tolist()
        return StepResult(committed=[rows[i][: host[1][i] + 1] for i in range(b)], draft_lens=host[0],
                          num_accepted=host[1], features=out.features, last_hidden=out.last_hidden)


def _rejection_sample(d, p, q, live, generator):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    d ``[B, Γ]`` drafts; p ``[B, Γ+1, V]`` target probs; q ``[B, Γ, V]`` drafter probs (drafts were
    sampled from q); live ``[B, Γ]`` marks drafts within each row's γ. Accept d_i with probability
    min(1, p_i(d_i)/q_i(d_i)); at the first rejection sample from normalize(max(0, p_i - q_i)); if all
    γ accepted, sample the bonus from p_{γ+1}. Returns (accepted ``[B]``, next token ``[B]``).
    """
    b, gm = d.shape
    if gm == 0:
        nxt = torch.multinomial(p[:, 0], 1, generator=generator)[:, 0]
        return torch.zeros(b, dtype=torch.long, device=p.device), nxt
    pd = p[:, :gm].gather(2, d[..., None])[..., 0]  # [B, Γ]
    qd = q.gather(2, d[..., None])[..., 0]
    u = torch.rand(pd.shape, generator=generator, device=p.device)
    ok = (u * qd < pd) & live
    accepted = ok.long().cumprod(1).sum(1)  # [B]
    idx = accepted[:, None, None].expand(b, 1, p.shape[-1])
    p_at = p.gather(1, idx)[:, 0]  # [B, V]
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    q_at = q_pad.gather(1, idx)[:, 0]
    rejected = accepted < live.sum(1)  # stopped before γ: residual; else bonus from p
    resid = (p_at - q_at).clamp(min=0)
    norm = resid.sum(-1, keepdim=True)
    resid = torch.where(norm > 0, resid / norm.clamp(min=1e-30), p_at)
    dist = torch.where(rejected[:, None], resid, p_at)
    nxt = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return accepted, nxt
