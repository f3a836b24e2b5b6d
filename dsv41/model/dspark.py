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

import functools
from dataclasses import dataclass

import torch

from dsv41.model.device import host_to_device
from dsv41.model.model import _expand
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

    def _stage_kv(self, blk, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A stage's window KV of main_x rows at the main RoPE rows cos, sin."""
        m, ops = self.model, self.ops
        return ops.norm_rope_quant(ops.linear(x, blk.attn.wkv), blk.attn.kv_norm, m.t.rms_norm_eps, cos, sin,
                                   "fp8" if m.qat else None, own=True)

    def fill_rings(self, main_hidden: torch.Tensor, pos: torch.Tensor, segs, graphs=None, cos_sin=None) -> None:
        """Write every stage's window KV of the rows' main_x into the sequences' stage rings. graphs: the forward's
        PieceGraphs when its round runs through them (then cos_sin are its static RoPE rows): the stages' KV as one
        piece; the ring writes, all stages' and sequences' slot ranges, in one copy list either way."""
        W = self.model.t.sliding_window
        if graphs is not None:
            kvs = graphs.run(("dspark_fill", 0), self._stage_kvs, (main_hidden, *cos_sin))
        else:
            kvs = self._stage_kvs(main_hidden, *self.model.rope.cos_sin("main", pos))
        dst, src = [], []
        for blk, kv in zip(self.stages, kvs):
            L = blk.role.index
            for a, n, start, st in segs:
                ring = st.windows.get(L)
                if ring is None:
                    ring = st.windows[L] = kv.new_zeros((W, kv.shape[1]))
                keep = min(n, W)
                first = start + n - keep                   # the last `keep` rows go to slots first % W ...
                slot, m = first % W, min(keep, W - first % W)
                dst.append(ring[slot:slot + m])
                src.append(kv[a + n - keep:a + n - keep + m])
                if m < keep:                               # ... wrapping to slot 0
                    dst.append(ring[:keep - m])
                    src.append(kv[a + n - keep + m:a + n])
        torch._foreach_copy_(dst, src)

    def _stage_kvs(self, main_hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Each stage's window KV [n, D] of the rows' taps (a row-only piece)."""
        x = self.main_x(main_hidden)
        return tuple(self._stage_kv(blk, x, cos, sin) for blk in self.stages)

    def _ring_index(self, items: list[tuple[SeqState, int]], dv: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block row's key set as indices into cat(the B stage rings [W, D] each, the block's kv [B * S, D]):
        the sequence's last min(L, W) context positions in ascending order (slots before them point at its ring's
        row 0, masked), then its S block rows (bidirectional inside the block). -> (idx [B * S, W + S], valid), sent
        in one copy; the same for every stage."""
        t = self.model.t
        B, S, W = len(items), self.block_size, t.sliding_window
        # host integers (device="cpu" each: no ambient device mode, whose hook costs every torch call), one copy below
        lengths = torch.tensor([st.length for st, _ in items], dtype=torch.long, device="cpu")[:, None]   # [B, 1]
        b = torch.arange(B, device="cpu")[:, None]
        j = torch.arange(W, device="cpu")[None, :]
        lead = torch.clamp(lengths, max=W)
        ctx_ok = j >= W - lead                                                                   # [B, W]
        ctx = b * W + torch.where(ctx_ok, (lengths - W + j) % W, 0)
        block = B * W + b * S + torch.arange(S, device="cpu")[None, :]
        idx = torch.cat([ctx, block], dim=1)                                                     # [B, W + S]
        ok = torch.cat([ctx_ok, torch.ones(B, S, dtype=torch.bool, device="cpu")], dim=1)
        both = torch.cat([idx, ok.long()], dim=1)
        if dv.type != "cpu":
            both = both.pin_memory().to(dv, non_blocking=True)
        idx, ok = both[:, :W + S], both[:, W + S:].bool()
        return (idx[:, None].expand(B, S, W + S).reshape(B * S, W + S),
                ok[:, None].expand(B, S, W + S).reshape(B * S, W + S))

    @torch.no_grad()
    def draft(self, items: list[tuple[SeqState, int]]) -> list[Draft]:
        """Draft block_size tokens after each (state, next_token); next_token is the token at position
        state.length (sampled, not yet fed). Pure: the states are not modified."""
        return self._draft(items)

    def _draft(self, items: list[tuple[SeqState, int]]) -> list[Draft]:
        m, t = self.model, self.model.t
        B, S = len(items), self.block_size
        if B == 0:
            return []
        for st, tok in items:
            if st.length == 0:
                raise ValueError("draft needs a sequence with at least one consumed token")
            if not 0 <= int(tok) < t.vocab_size:
                raise ValueError(f"next_token {tok} outside the vocabulary")
        dv = m.device      # tensors made here name their device (no ambient torch.device mode: see Model._forward)
        # the block's ids, positions and d_0 (next_token) in one pinned, non-blocking copy (no wait for the GPU)
        first = torch.tensor([int(tok) for _, tok in items], dtype=torch.long, device="cpu")
        lengths = torch.tensor([st.length for st, _ in items], dtype=torch.long, device="cpu")
        ids = torch.full((B, S), self.noise, dtype=torch.long, device="cpu")
        ids[:, 0] = first
        host = torch.cat([ids.view(-1), (lengths[:, None] + torch.arange(S, device="cpu")).view(-1), first])
        both = host_to_device(host, dv)
        ids, pos, prev = both[:B * S], both[B * S:2 * B * S], both[2 * B * S:]
        streams = m.embed[ids].float()[:, None, :].expand(-1, t.hc_mult, -1).clone()
        pre = torch.zeros(B * S, t.hc_mult, device=dv)
        pre[:, 0] = 1.0
        cos, sin = m.rope.cos_sin("main", pos)
        # the stages' row-only pieces through the model's CUDA graphs (as a decode round's layers: graphs.py), the
        # keys of every block gathered on the host's index in one op per stage between them
        G = m.graphs if m.ops.graphs else None
        if G is not None:
            cos, sin = G.rows("cos.main", cos), G.rows("sin.main", sin)
        ring_idx, valid = self._ring_index(items, dv)
        for blk in self.stages:
            L = blk.role.index

            def piece(name, fn, *args):
                return fn(*args) if G is None else G.run((name, L), fn, args)

            pre_a, post_a, comb_a, q, kv, *_ = piece("attn_in", functools.partial(m._attn_in, blk), streams, pre,
                                                     cos, sin, cos, sin)
            rings = [st.windows[L] for st, _ in items]
            keys = torch.cat(rings + [kv])[ring_idx]                             # [B * S, W + S, D]
            if m.comm.world == 1:
                streams, pre = piece("attn_out_ffn", functools.partial(m._attn_out_ffn, blk), q, keys, valid, cos,
                                     sin, streams, pre_a, post_a, comb_a)
            else:   # the partial sums cross ranks between the pieces
                y, = piece("attn_out", functools.partial(m._attn_out, blk), q, keys, valid, cos, sin)
                streams, pre, post_f, comb_f, y = piece("ffn", functools.partial(m._ffn, blk), m.reduce_attn(y),
                                                        streams, pre_a, post_a, comb_a)
                streams, = piece("ffn_out", functools.partial(_expand, blk.ops), m.comm.all_reduce(y), streams,
                                 post_f, comb_f)
        streams, pre = streams.view(B, S, *streams.shape[1:]), pre.view(B, S, -1)
        if m.comm.world == 1 and G is not None:     # rows = sequences here (a block's S rows stay together)
            toks, rows, logits, conf = G.run(("dspark_head", 0), self._head_markov, (streams, pre, prev))
        else:
            toks, rows, logits, conf = self._head_markov(streams, pre, prev)
        # out of the graph's static buffers: one copy each, the drafts views of it
        toks, rows, logits, conf = toks.clone(), rows.clone(), logits.clone(), conf.clone()
        return [Draft(tokens=toks[b], logits=rows[b], head_logits=logits[b], confidence=conf[b]) for b in range(B)]

    def _head_markov(self, streams: torch.Tensor, pre: torch.Tensor, prev: torch.Tensor) -> tuple:
        """The blocks' streams [B, S, hc, H] and last pre [B, S, hc] -> (tokens [B, S], Markov rows [B, S, vocab],
        head logits [B, S, vocab], confidence [B, S]); prev [B] = d_0 (next_token). A piece with the sequences as
        rows (a CUDA graph on one rank; across ranks the head's columns are gathered, so it runs eagerly)."""
        m, t, ops = self.model, self.model.t, self.ops
        B, S = streams.shape[:2]
        x = ops.hc_collapse(streams.reshape(B * S, *streams.shape[2:]), pre.reshape(B * S, -1))
        logits = m.gather_logits(m.head_logits(ops.rms_norm(x, self.norm, t.rms_norm_eps))).view(B, S, -1)
        x = x.view(B, S, -1)
        # The Markov steps, all sequences at once (linear's fixed row tiles keep each row independent of the others)
        toks, rows, conf = [], [], []
        for i in range(S):
            e = self.markov_embed[prev]                                          # [B, rank]
            row = logits[:, i] + ops.linear(e, self.markov_head)                 # [B, vocab]
            conf.append(ops.linear(torch.cat([x[:, i], e], dim=1), self.confidence)[:, 0])
            prev = torch.argmax(row, dim=1)                                      # first maximum: ties to the lower id
            toks.append(prev)
            rows.append(row)
        return torch.stack(toks, 1), torch.stack(rows, 1), logits, torch.stack(conf, 1)
