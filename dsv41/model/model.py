"""The DeepSeek-V4.1 forward: Model.forward(list[SeqInput]) -> logits (arch.md §2; docs/model.md).

Rows of all sequences in a call are packed into one [N, ...] batch for the row-wise work (GEMMs in fixed tiles,
norms, mHC, MoE); the work that reads a sequence's history (window ring, compressor groups, indexer, compressed
KV) runs per sequence against its SeqState. Each layer in order:
  Engram (its layers) -> mHC mixes -> collapse with the incoming pre -> attn_norm -> attention -> expand
  -> mHC mixes -> collapse with the attention site's pre -> ffn_norm -> MoE -> expand; the FFN site's pre goes on.
Within one forward a KV source publishes its compressed KV, an index-key owner its keys, an index source its
top-k list and the candidate source its candidate blocks; later layers read the latest publication.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv41 import REPO_ROOT
from dsv41.config import ModelConfig
from dsv41.model import device as dev
from dsv41.model import quant
from dsv41.model.attention import Attention
from dsv41.model.compressor import Compressor
from dsv41.model.engram import Engram
from dsv41.model.engram_hash import EngramHasher, build_token_map, load_token_map
from dsv41.model.engram_store import EngramStore
from dsv41.model.indexer import Indexer, candidate_blocks, select_topk
from dsv41.model.layout import LayerRole, Layout
from dsv41.model.linear import linear, rms_norm
from dsv41.model.mhc import HcSite, hc_collapse, hc_expand, hc_mixes
from dsv41.model.moe import Expert, MoE
from dsv41.model.rope import Rope, apply_rope
from dsv41.model.state import DEAD, SeqState
from dsv41.model.weights import RankShare, load_weights

INDEX_KEY_MODES = ("intended", "quirk")


class InputError(ValueError):
    """A SeqInput the model cannot run (bad ids, shapes, modes); the server maps it to a 400."""


@dataclass
class SeqInput:
    state: SeqState
    ids: torch.Tensor                      # [n] int64 token ids (image positions carry image_token_id)
    logits: str = "all"                    # "all" rows, "last" row, or "none"
    embeds: torch.Tensor | None = None     # [n, H] rows that replace the embedding where token_type >= 0
    token_type: torch.Tensor | None = None # [n] int: -1 text, 0..3 image span (start, image, newline, end)


@dataclass
class Block:
    role: LayerRole
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HcSite
    hc_ffn: HcSite
    attn: Attention
    moe: MoE
    compressor: Compressor | None = None
    indexer: Indexer | None = None
    engram: Engram | None = None


@dataclass
class Comm:
    """Tensor-parallel exchange used by the forward (dsv41.comm provides one across ranks). Partial sums must be
    added in rank order so every rank computes the same bits."""
    world: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    all_gather_cols: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


def _build_block(W: dict[str, torch.Tensor], role: LayerRole, cfg: ModelConfig, n_experts: int, top_k: int,
                 engram_rows: Callable | None) -> Block:
    t = cfg.text
    p = role.name
    eps = t.rms_norm_eps

    def site(kind):
        return HcSite(fn=W[f"{p}.hc_{kind}_fn"].float(), base=W[f"{p}.hc_{kind}_base"].float(),
                      scale=W[f"{p}.hc_{kind}_scale"].float())

    attn = Attention(
        wq_a=W[f"{p}.attn.wq_a.weight"], q_norm=W[f"{p}.attn.q_norm.weight"], wq_b=W[f"{p}.attn.wq_b.weight"],
        wkv=W[f"{p}.attn.wkv.weight"], kv_norm=W[f"{p}.attn.kv_norm.weight"],
        attn_sink=W[f"{p}.attn.attn_sink"].float(), wo_a=W[f"{p}.attn.wo_a.weight"],
        wo_b=W[f"{p}.attn.wo_b.weight"], head_dim=t.head_dim, o_lora=t.o_lora_rank, eps=eps)

    def expert(q):
        return Expert(w1=W[f"{q}.w1.weight"], w2=W[f"{q}.w2.weight"], w3=W[f"{q}.w3.weight"])

    experts = {e: expert(f"{p}.ffn.experts.{e}") for e in range(n_experts) if f"{p}.ffn.experts.{e}.w1.weight" in W}
    moe = MoE(gate=W[f"{p}.ffn.gate.weight"], bias=W[f"{p}.ffn.gate.bias"].float(),
              bias_vl=W[f"{p}.ffn.gate.bias_vl"].float(), experts=experts,
              shared=expert(f"{p}.ffn.shared_experts"), top_k=top_k, gate_temp=t.gate_temp,
              scaling=t.routed_scaling_factor, limit=t.swiglu_limit,
              stack=dev.stack_experts(experts, n_experts) if W["embed.weight"].is_cuda else None)
    block = Block(role=role, attn_norm=W[f"{p}.attn_norm.weight"], ffn_norm=W[f"{p}.ffn_norm.weight"],
                  hc_attn=site("attn"), hc_ffn=site("ffn"), attn=attn, moe=moe)
    if role.owns_compressor:
        c = f"{p}.attn.compressor"
        block.compressor = Compressor(layer=role.index, ratio=role.ratio, wkv=W[f"{c}.wkv.weight"].float(),
                                      wgate=W[f"{c}.wgate.weight"].float() if role.ratio > 1 else None,
                                      norm=W[f"{c}.norm.weight"], eps=eps)
    if role.index_source:
        i = f"{p}.attn.indexer"
        block.indexer = Indexer(layer=role.index, n_heads=t.index_n_heads, head_dim=t.index_head_dim,
                                topk=t.index_topk, wq_b=W[f"{i}.wq_b.weight"],
                                weights_proj=W[f"{i}.weights_proj.weight"],
                                wk=W.get(f"{i}.wk.weight"), k_norm=W.get(f"{i}.k_norm.weight"), eps=eps)
    if role.engram is not None and engram_rows(role.index) is not None:
        g = f"{p}.engram"
        block.engram = Engram(rows=engram_rows(role.index), wkv=W[f"{g}.wkv.weight"],
                              weight=W[f"{g}.q_weight"].float() * W[f"{g}.k_weight"].float(), eps=eps)
    return block


class Model:
    def __init__(self, cfg: ModelConfig, W: dict[str, torch.Tensor], engram_rows: Callable,
                 hasher: EngramHasher | None,
                 qat: bool = True, index_keys: str = "intended", comm: Comm | None = None,
                 engram_store: EngramStore | None = None):
        if index_keys not in INDEX_KEY_MODES:
            raise ValueError(f"index_keys must be one of {INDEX_KEY_MODES}, got {index_keys!r}")
        self.cfg = cfg
        t = self.t = cfg.text
        self.layout = Layout.from_config(t)
        self.rope = Rope(t)
        self.qat = qat
        self.index_keys = index_keys
        self.comm = comm or Comm()
        self.hasher = hasher
        self.device = W["embed.weight"].device
        # the RoPE tables live where the positions do
        self.rope.inv_freq = {k: v.to(self.device) for k, v in self.rope.inv_freq.items()}
        self.engram_store = engram_store   # None: no Engram layers, or served without the tables (degraded)
        self.embed = W["embed.weight"]
        self.head = W["head.weight"]
        self.norm = W["norm.weight"]
        self.blocks = [_build_block(W, r, cfg, t.n_routed_experts, t.num_experts_per_tok, engram_rows)
                       for r in self.layout.layers]
        self.dspark = None
        if self.layout.stages and "mtp.0.main_proj.weight" in W:
            from dsv41.model.dspark import DSpark
            stages = [_build_block(W, r, cfg, t.dspark_n_routed_experts, t.dspark_num_experts_per_tok, None)
                      for r in self.layout.stages]
            self.dspark = DSpark(self, W, stages)

    # ---- loading ----------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, ckpt: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
             share: RankShare | None = None, qat: bool = True, index_keys: str = "intended",
             comm: Comm | None = None, engram: str | Path | None = None, engram_tables: bool = True,
             engram_cache_bytes: int = 256 << 20, keep_quant: bool | None = None) -> Model:
        """Load a checkpoint. qat=False makes the three QAT fake-quants (window KV, compressed KV, indexer q/k)
        the identity; index_keys="quirk" reproduces the release's indexer-key publication (arch.md §2.8).
        engram: the folder holding the Engram tables (default: the checkpoint); engram_tables=False runs without
        them (degraded: the Engram layers add nothing to the streams, exactly as all-zero rows would, since wkv has
        no bias); engram_cache_bytes: host memory for hot rows (0: no cache, no read-ahead).
        device "cpu": the float32 reference (weights dequantised at load). "cuda[:N]": the same code on the GPU,
        float32 with TF32 off; FP8/FP4 weights stay in checkpoint form there (dsv41/model/device.py, docs/gpu.md).
        keep_quant: keep FP8/FP4 weights in checkpoint form (default: on CUDA only); the values are the same
        (dequantisation is exact), only where and when the weight is dequantised differs."""
        if dtype != torch.float32:
            raise ValueError("the forward computes in float32")
        dv = torch.device(device)
        if dv.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r}: no CUDA device is visible")
            dev.setup_cuda(dv)
        elif dv.type != "cpu":
            raise ValueError(f"device {device!r}: the model runs on cpu or cuda")
        share = share or RankShare(0, 1)
        if share.world > 1 and (comm is None or comm.world != share.world):
            raise ValueError("a tensor-parallel share needs a Comm of the same world size")
        d = Path(ckpt)
        cfg = ModelConfig.from_checkpoint(d)
        W = load_weights(d, cfg, share=share, dtype=dtype, device=dv,
                         keep_quant=dv.type == "cuda" if keep_quant is None else keep_quant)
        store = None
        if cfg.text.engram_layer_ids and engram_tables:
            store = EngramStore(Path(engram) if engram else d, cfg, dtype=torch.float32,
                                cache_bytes=engram_cache_bytes)
        engram_rows = _engram_row_reader(store)
        hasher = _make_hasher(d, cfg) if cfg.text.engram_layer_ids else None   # no Engram layers: nothing to hash
        return cls(cfg, W, engram_rows, hasher, qat=qat, index_keys=index_keys, comm=comm, engram_store=store)

    def new_state(self) -> SeqState:
        return SeqState()

    def engram_read_ahead(self, before: torch.Tensor, pos0: int, ids: torch.Tensor) -> Future | None:
        """Start reading (in the background) the Engram rows a later forward of token ids `ids` at positions pos0..
        will look up. before: the compressed ids (state.engram_history) of the positions just before pos0 (only the
        last 3 matter). Only warms the row cache: never changes a value, and a wrong guess costs only reads.
        Returns the store's Future (its result: the per-layer read Futures), None when there is nothing to read."""
        if self.engram_store is None or not len(ids):
            return None
        tail = torch.as_tensor(before, dtype=torch.int64)
        new = torch.as_tensor(ids, dtype=torch.int64)
        return self.engram_store.read_ahead(lambda: self.hasher.hash_new(tail, pos0, new)[0])

    # ---- forward ----------------------------------------------------------------------------------------------

    def _check(self, batch: list[SeqInput]) -> None:
        if not isinstance(batch, (list, tuple)) or not batch:
            raise InputError("forward needs a non-empty list of SeqInput")
        seen = set()
        for i, s in enumerate(batch):
            if id(s.state) in seen:
                raise InputError(f"batch[{i}]: the same SeqState appears twice in one forward")
            seen.add(id(s.state))
            ids = s.ids
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
                raise InputError(f"batch[{i}].ids must be a 1-D integer tensor")
            if ids.numel() == 0:
                raise InputError(f"batch[{i}].ids is empty")
            if int(ids.min()) < 0 or int(ids.max()) >= self.t.vocab_size:
                raise InputError(f"batch[{i}].ids has token ids outside 0..{self.t.vocab_size - 1}")
            if s.logits not in ("all", "last", "none"):
                raise InputError(f"batch[{i}].logits must be 'all', 'last' or 'none', got {s.logits!r}")
            if s.state.length + ids.numel() > self.t.max_position_embeddings:
                raise InputError(f"batch[{i}]: sequence would exceed {self.t.max_position_embeddings} positions")
            if (s.token_type is None) != (s.embeds is None):
                raise InputError(f"batch[{i}]: embeds and token_type go together")
            if s.token_type is not None:
                if s.token_type.shape != ids.shape:
                    raise InputError(f"batch[{i}].token_type must have the shape of ids")
                if s.embeds.shape != (ids.numel(), self.t.hidden_size):
                    raise InputError(f"batch[{i}].embeds must be [{ids.numel()}, {self.t.hidden_size}]")

    @torch.no_grad()
    def forward(self, batch: list[SeqInput], trace: dict[str, Any] | None = None) -> list[torch.Tensor]:
        """Run every SeqInput's new tokens; returns per input float32 logits [n | 1 | 0, vocab] and advances each
        state by len(ids). `trace`, when given, receives intermediate arrays (tests, debugging)."""
        self._check(batch)
        with self.on_device():
            return self._forward(batch, trace)

    def on_device(self):
        """Tensors the forward creates (positions, masks, the states' rings) are made on the model's device."""
        return contextlib.nullcontext() if self.device.type == "cpu" else torch.device(self.device)

    def _forward(self, batch: list[SeqInput], trace: dict[str, Any] | None) -> list[torch.Tensor]:
        t = self.t
        segs = []          # (row offset, n, start position, state)
        a = 0
        for s in batch:
            n = s.ids.numel()
            segs.append((a, n, s.state.length, s.state))
            a += n
        ids_host = torch.cat([s.ids.long().cpu() for s in batch])    # Engram hashing and row reads are on the host
        ids = ids_host.to(self.device)
        pos = torch.cat([torch.arange(st, st + n) for _, n, st, _ in segs])
        image = image_host = None
        if any(s.token_type is not None for s in batch):
            image_host = torch.cat([s.token_type.cpu() >= 0 if s.token_type is not None else
                                    torch.zeros(s.ids.numel(), dtype=torch.bool, device="cpu") for s in batch])
            image = image_host.to(self.device)
        h = self.embed[ids].float()
        if image is not None:
            rows = torch.cat([s.embeds.float().to(self.device) if s.embeds is not None else
                              h.new_zeros((s.ids.numel(), t.hidden_size)) for s in batch])
            h = torch.where(image[:, None], rows, h)
        with torch.device("cpu"):    # Engram hashing and table reads run on the host
            hash_ids = self._engram_hashes(batch, segs, ids_host, image_host) if t.engram_layer_ids else None
            if self.engram_store is not None:
                self.engram_store.prefetch_hashes(hash_ids)  # later Engram layers' rows load while earlier layers run

        cs = {k: self.rope.cos_sin(k, pos) for k in ("main", "compress")}
        streams = h[:, None, :].expand(-1, t.hc_mult, -1).clone()
        pre = torch.zeros(ids.numel(), t.hc_mult)
        pre[:, 0] = 1.0
        taps = [None] * len(t.dspark_target_layer_ids)
        shared = [{} for _ in segs]
        for blk in self.blocks:
            r = blk.role
            if blk.engram is not None:
                streams = blk.engram(streams, hash_ids[:, r.engram], image)
                if trace is not None:
                    trace[f"engram_out_streams.layer{r.index}"] = streams.clone()
            if r.dspark_tap is not None:
                taps[r.dspark_tap] = _stream_mean(streams)
            pre_a, post_a, comb_a = hc_mixes(streams, blk.hc_attn, t.hc_sinkhorn_iters, t.hc_eps, t.rms_norm_eps)
            x = rms_norm(hc_collapse(streams, pre), blk.attn_norm, t.rms_norm_eps)
            y = self.comm.all_reduce(self._attention(blk, x, pos, cs[r.rope], cs["compress"], segs, shared, trace))
            streams = hc_expand(y, streams, post_a, comb_a)
            pre_f, post_f, comb_f = hc_mixes(streams, blk.hc_ffn, t.hc_sinkhorn_iters, t.hc_eps, t.rms_norm_eps)
            x = rms_norm(hc_collapse(streams, pre_a), blk.ffn_norm, t.rms_norm_eps)
            y = self.comm.all_reduce(blk.moe(x, image))
            streams = hc_expand(y, streams, post_f, comb_f)
            pre = pre_f
            if trace is not None:
                trace.setdefault("layer_out_streams", []).append(streams.clone())

        if self.dspark is not None:
            main_hidden = torch.cat(taps, dim=1)
            if trace is not None:
                trace["dspark_taps"] = main_hidden.clone()
            self.dspark.fill_rings(main_hidden, pos, segs)

        want = []
        for (a, n, _, _), s in zip(segs, batch):
            want.append(torch.arange(a, a + n) if s.logits == "all" else
                        torch.tensor([a + n - 1]) if s.logits == "last" else torch.zeros(0, dtype=torch.long))
        rows = torch.cat(want)
        x = rms_norm(hc_collapse(streams[rows], pre[rows]), self.norm, t.rms_norm_eps)
        logits = self.comm.all_gather_cols(linear(x, self.head))
        for (_, n, _, st) in segs:
            st.length += n
        out, o = [], 0
        for w in want:
            out.append(logits[o:o + w.numel()])
            o += w.numel()
        return out

    __call__ = forward

    # ---- pieces -----------------------------------------------------------------------------------------------

    def _engram_hashes(self, batch, segs, ids, image) -> torch.Tensor:
        """Append the new compressed ids to each history (DEAD at image rows) and hash the new positions."""
        out = []
        for (a, n, start, st), s in zip(segs, batch):
            comp = self.hasher.compress(ids[a:a + n])
            if image is not None:
                comp = torch.where(image[a:a + n], torch.full_like(comp, DEAD), comp)
            st.engram_history = torch.cat([st.engram_history[:start], comp])
            out.append(self.hasher.hash_compressed(st.engram_history, start))
        return torch.cat(out)

    def _attention(self, blk: Block, x, pos, cos_sin, cs_compress, segs, shared, trace) -> torch.Tensor:
        t, r, attn = self.t, blk.role, blk.attn
        W = t.sliding_window
        cos, sin = cos_sin
        q_res, q, kv = attn.project(x, cos, sin, self.qat)
        if blk.compressor is not None:
            ckv, cgate = blk.compressor.project(x)
        if blk.indexer is not None:
            iq, iw = blk.indexer.queries(q_res, x, cs_compress[0], cs_compress[1], self.qat)
        keys, valid = [], []
        for (a, n, start, st), sh in zip(segs, shared):
            wkeys, wvalid = st.window_keys(r.index, kv[a:a + n], start, W)
            st.write_window(r.index, kv[a:a + n], start, W)
            if r.ratio == 0:
                keys.append(wkeys)
                valid.append(wvalid)
                continue
            p = pos[a:a + n]
            if blk.compressor is not None:
                self._compress(blk, st, sh, ckv[a:a + n], None if cgate is None else cgate[a:a + n])
            if blk.indexer is not None:
                sh["topk"] = self._index(blk, st, sh, iq[a:a + n], iw[a:a + n], p, trace)
            topk = sh["topk"]
            ckv_src = sh["kv"]
            ok = topk >= 0
            ckeys = ckv_src[topk.clamp_min(0)] if ckv_src.shape[0] else kv.new_zeros(topk.shape + (kv.shape[1],))
            keys.append(torch.cat([wkeys, ckeys], dim=1))
            valid.append(torch.cat([wvalid, ok], dim=1))
        o = attn.attend(q, torch.cat(keys), torch.cat(valid))
        return attn.output(o, cos, sin)

    def _compress(self, blk: Block, st: SeqState, sh: dict, kv, gate) -> None:
        """Close this call's groups of a KV source; append compressed KV (and index keys) and publish them."""
        comp, r = blk.compressor, blk.role
        D, Di = self.t.head_dim, self.t.index_head_dim
        latent, first = comp.close_groups(st, kv, gate)
        g = latent.shape[0]
        gpos = first + r.ratio * torch.arange(g)
        if r.index not in st.compressed:
            st.compressed[r.index] = kv.new_zeros((0, D))
            st.index_keys[r.index] = kv.new_zeros((0, Di))
        if g:
            if r.owns_index_keys:
                k = blk.indexer.keys(latent, gpos, self.rope, self.qat)
                st.index_keys[r.index] = _append_rows(st.index_keys[r.index], k)
            cos, sin = self.rope.cos_sin("compress", gpos)
            entry = apply_rope(latent, cos, sin)
            if self.qat:
                entry = quant.fp4_fake_quant_e4m3(entry, 16)
            st.compressed[r.index] = _append_rows(st.compressed[r.index], entry)
        sh["kv"] = st.compressed[r.index]
        # "intended": an owner publishes its running keys on every call. "quirk" (the release): a ratio-2 owner
        # publishes only on calls that close a group; otherwise later index layers score the last published keys.
        if r.owns_index_keys and (self.index_keys == "intended" or g > 0):
            st.published_keys = (r.index, st.index_keys[r.index].shape[0])

    def _index(self, blk: Block, st: SeqState, sh: dict, q, w, p, trace) -> torch.Tensor:
        t, r, ix = self.t, blk.role, blk.indexer
        if st.published_keys is None:
            keys = q.new_zeros((0, t.index_head_dim))
        else:
            owner, count = st.published_keys
            keys = st.index_keys[owner][:count]
        if keys.shape[0] == 0:
            topk = torch.full((q.shape[0], t.index_topk), -1, dtype=torch.long)
        else:
            scores = ix.scores(q, w, keys, p, r.ratio)
            if r.candidate_source:
                sh["candidates"] = candidate_blocks(scores, p, r.ratio, t.candidate_topk_blocks,
                                                    t.candidate_block_size)
                if trace is not None:
                    trace.setdefault(f"candidates.layer{r.index}", []).append(sh["candidates"])
            elif r.uses_candidates and "candidates" in sh:
                scores = scores.masked_fill(~sh["candidates"], float("-inf"))
            topk = select_topk(scores, t.index_topk)
        if trace is not None:
            trace.setdefault(f"topk.layer{r.index}", []).append(topk)
        return topk


def _append_rows(rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """rows then new (dim 0), without copying rows when the buffer they are the start of has room. A long prompt's
    compressed KV and index keys would otherwise be copied whole once per chunk (O(T^2) bytes over a 1M prompt). The
    buffer grows by a quarter (the memory plan's margin) and is reached only through views of its first rows, so a
    rollback's shorter view, a snapshot's clone and this forward's published view all stay correct."""
    n, g, d = rows.shape[0], new.shape[0], rows.shape[1]
    cap = 0
    if rows.is_contiguous() and rows.storage_offset() == 0 and rows.dtype == new.dtype:
        cap = rows.untyped_storage().nbytes() // (rows.element_size() * d)
    if n + g <= cap:
        buf = rows.as_strided((cap, d), (d, 1), 0)
    else:
        buf = rows.new_empty(((n + g) * 5 // 4 + 16, d))
        buf[:n] = rows
    buf[n:n + g] = new
    return buf[:n + g]


def _stream_mean(streams: torch.Tensor) -> torch.Tensor:
    acc = streams[:, 0]
    for j in range(1, streams.shape[1]):
        acc = acc + streams[:, j]
    return acc / streams.shape[1]


# ---- Engram table rows and hashing ----------------------------------------------------------------------------

def _engram_row_reader(store: EngramStore | None) -> Callable[[int], Callable | None]:
    """layer -> (hash ids -> dequantised table rows [..., head_dim]), read through the EngramStore (the release's
    tables are ~100 GB each, so rows are read by position, never the whole table); None without a store."""
    if store is None:
        return lambda layer: None
    return lambda layer: (lambda hash_ids: store.lookup(layer, hash_ids))


def _make_hasher(d: Path, cfg: ModelConfig) -> EngramHasher:
    """The compressed-token map of the checkpoint's tokenizer.json, else the bundled V4.1 map."""
    tok = d / "tokenizer.json"
    if tok.is_file():
        token_map = build_token_map(tok)
    else:
        token_map = load_token_map(REPO_ROOT / "kit" / "engram_token_map_v41.npy")
    return EngramHasher(cfg, token_map)
