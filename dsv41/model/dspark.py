"""DSpark draft head: the three mtp.* stages (arch.md §2.11).

Taps: main_hidden = the block input (after Engram, before the mHC mixes) of each dspark_target_layer, averaged over
the 4 streams and concatenated (the backbone forward computes it for every row). main_x = main_norm(main_proj(.)).
Context: every backbone forward writes, for each of its rows and each stage, the stage's window KV of main_x
(its own wkv / kv_norm, main RoPE at the row's position, FP8 fake-quant) into the stage's ring in the SeqState.
That is all a prefill does for DSpark ("fill rings only").
Drafting (`draft`): the block [next_token, noise ×(block_size-1)] at positions L .. L+block_size-1 (L = tokens
consumed) is embedded with the shared embedding, expanded to the streams with a one-hot pre, and run through the
stages as full blocks (single-pass mHC, attention, MoE with the stage's experts). Stage attention: each block
query sees the stage's ring (the last sliding_window context positions) plus ALL block positions — bidirectional
inside the block. Then collapse with the last pre, mtp.2.norm, the shared head, and the Markov steps
d_{i+1} = argmax(logits_i + H·E[d_i]), d_0 = next_token. Confidence_i = proj([x_i ; E[d_i]]) where x_i is the
collapsed hidden of block position i before mtp.2.norm (as the TensorFold port reads "x_collapsed"); the spec leaves
its use open, so it is returned as is. Drafting reads the state and never writes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.model import quant
from dsv41.model.mhc import hc_mixes
from dsv41.model.rope import apply_rope
from dsv41.model.state import SeqState


@dataclass
class Draft:
    tokens: torch.Tensor       # [block_size] int64: d_1 .. d_block_size
    logits: torch.Tensor       # [block_size, vocab] float32: head logits + Markov bias (the pick's distribution)
    head_logits: torch.Tensor  # [block_size, vocab] float32: the shared head's logits before the Markov bias
    confidence: torch.Tensor   # [block_size] float32 logits of the confidence head


class DSpark:
    def __init__(self, model, W: dict[str, torch.Tensor], stages: list):
        self.model = model
        self.ops = model.ops     # the model's op set; the stages (Blocks) hold it too
        t = model.t
        self.stages = stages
        self.main_proj = W["mtp.0.main_proj.weight"]
        self.main_norm = W["mtp.0.main_norm.weight"]
        last = f"mtp.{len(stages) - 1}"
        self.norm = W[f"{last}.norm.weight"]
        self.markov_embed = W[f"{last}.markov_head.embed.weight"].float()
        self.markov_head = W[f"{last}.markov_head.head.weight"]
        self.confidence = W[f"{last}.confidence_head.proj.weight"]
        self.block_size = t.dspark_block_size
        self.noise = t.dspark_noise_token_id

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        t = self.model.t
        return self.ops.rms_norm(self.ops.linear(main_hidden, self.main_proj), self.main_norm, t.rms_norm_eps)

    def _stage_kv(self, blk, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        m = self.model
        cos, sin = m.rope.cos_sin("main", pos)
        ops = self.ops
        kv = apply_rope(ops.rms_norm(ops.linear(x, blk.attn.wkv), blk.attn.kv_norm, m.t.rms_norm_eps), cos, sin)
        return quant.fp8_fake_quant(kv, 32) if m.qat else kv

    def fill_rings(self, main_hidden: torch.Tensor, pos: torch.Tensor, segs) -> None:
        """Write every stage's window KV of the rows' main_x into the sequences' stage rings."""
        x = self.main_x(main_hidden)
        W = self.model.t.sliding_window
        for blk in self.stages:
            kv = self._stage_kv(blk, x, pos)
            for a, n, start, st in segs:
                st.write_window(blk.role.index, kv[a:a + n], start, W)

    @torch.no_grad()
    def draft(self, items: list[tuple[SeqState, int]]) -> list[Draft]:
        """Draft block_size tokens after each (state, next_token); next_token is the token at position
        state.length (sampled, not yet fed). Pure: the states are not modified."""
        return self._draft(items)

    def _draft(self, items: list[tuple[SeqState, int]]) -> list[Draft]:
        m, t, ops = self.model, self.model.t, self.ops
        B, S, W = len(items), self.block_size, t.sliding_window
        if B == 0:
            return []
        for st, tok in items:
            if st.length == 0:
                raise ValueError("draft needs a sequence with at least one consumed token")
            if not 0 <= int(tok) < t.vocab_size:
                raise ValueError(f"next_token {tok} outside the vocabulary")
        dv = m.device      # tensors made here name their device (no ambient torch.device mode: see Model._forward)
        ids = torch.tensor([[int(tok)] + [self.noise] * (S - 1) for _, tok in items], device=dv).view(-1)
        pos = torch.cat([torch.arange(st.length, st.length + S, device=dv) for st, _ in items])
        streams = m.embed[ids].float()[:, None, :].expand(-1, t.hc_mult, -1).clone()
        pre = torch.zeros(B * S, t.hc_mult, device=dv)
        pre[:, 0] = 1.0
        cos, sin = m.rope.cos_sin("main", pos)
        for blk in self.stages:
            pre_a, post_a, comb_a = hc_mixes(streams, blk.hc_attn, t.hc_sinkhorn_iters, t.hc_eps, t.rms_norm_eps)
            x = ops.rms_norm(ops.hc_collapse(streams, pre), blk.attn_norm, t.rms_norm_eps)
            _, q, kv = blk.attn.project(x, cos, sin, m.qat)
            keys, valid = [], []
            for b, (st, _) in enumerate(items):
                L = st.length
                lead = min(L, W)
                ring = st.windows[blk.role.index]
                ctx = ring[torch.arange(L - lead, L, device=dv) % W]            # ascending positions
                ctx = torch.cat([ctx.new_zeros((W - lead, ctx.shape[1])), ctx])
                block = kv[b * S:(b + 1) * S]
                k = torch.cat([ctx, block])                                      # [W + S, D]
                ok = torch.cat([torch.arange(W, device=dv) >= W - lead, torch.ones(S, dtype=torch.bool, device=dv)])
                keys.append(k[None].expand(S, -1, -1))
                valid.append(ok[None].expand(S, -1))
            o = blk.attn.attend(q, torch.cat(keys), torch.cat(valid))
            y = m.reduce_attn(blk.attn.output(o, cos, sin))
            streams = ops.hc_expand(y, streams, post_a, comb_a)
            pre_f, post_f, comb_f = hc_mixes(streams, blk.hc_ffn, t.hc_sinkhorn_iters, t.hc_eps, t.rms_norm_eps)
            x = ops.rms_norm(ops.hc_collapse(streams, pre_a), blk.ffn_norm, t.rms_norm_eps)
            y = m.comm.all_reduce(blk.moe(x))
            streams = ops.hc_expand(y, streams, post_f, comb_f)
            pre = pre_f
        x = ops.hc_collapse(streams, pre)
        logits = m.gather_logits(m.head_logits(ops.rms_norm(x, self.norm, t.rms_norm_eps))).view(B, S, -1)
        x = x.view(B, S, -1)
        # The Markov steps, all sequences at once (linear's fixed row tiles keep each row independent of the others)
        prev = torch.tensor([int(tok) for _, tok in items], device=dv)           # d_0 = next_token
        toks, rows, conf = [], [], []
        for i in range(S):
            e = self.markov_embed[prev]                                          # [B, rank]
            row = logits[:, i] + ops.linear(e, self.markov_head)                 # [B, vocab]
            conf.append(ops.linear(torch.cat([x[:, i], e], dim=1), self.confidence)[:, 0])
            prev = torch.argmax(row, dim=1)                                      # first maximum: ties to the lower id
            toks.append(prev)
            rows.append(row)
        toks, rows, conf = torch.stack(toks, 1), torch.stack(rows, 1), torch.stack(conf, 1)
        return [Draft(tokens=toks[b], logits=rows[b], head_logits=logits[b].clone(), confidence=conf[b])
                for b in range(B)]
