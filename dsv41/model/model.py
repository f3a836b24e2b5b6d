"""The DeepSeek-V4.1 forward: Model.forward(list[SeqInput]) -> logits (arch.md §2; docs/model.md).

Rows of all sequences in a call are packed into one [N, ...] batch for the row-wise work (GEMMs in fixed tiles,
norms, mHC, MoE); the work that reads a sequence's history (window ring, compressor groups, indexer, compressed
KV) runs per sequence against its SeqState when the sequences bring different row counts (prompt passes), and
once for the whole call when each brings the same n <= window rows (decode and drafted-verify rounds: `_Round`,
its integers computed on the host before the layers from the states' metadata and sent in one copy; no host sync
inside a layer). Both give a row the same bits (tests/test_model_round.py). Each layer in order:
  Engram (its layers) -> mHC mixes -> collapse with the incoming pre -> attn_norm -> attention -> expand
  -> mHC mixes -> collapse with the attention site's pre -> ffn_norm -> MoE -> expand; the FFN site's pre goes on.
Within one forward a KV source publishes its compressed KV, an index-key owner its keys, an index source its
top-k list and the candidate source its candidate blocks; later layers read the latest publication.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsv41 import REPO_ROOT
from dsv41.config import ModelConfig
from dsv41.model import device as dev
from dsv41.model.attention import Attention
from dsv41.model.compressor import Compressor
from dsv41.model.engram import Engram
from dsv41.model.engram_hash import EngramHasher, build_token_map, load_token_map
from dsv41.model.engram_store import EngramStore
from dsv41.model.exl3_load import Exl3Packed
from dsv41.model.graphs import PieceGraphs
from dsv41.model.indexer import KEY_TILE, Indexer, candidate_blocks
from dsv41.model.layout import LayerRole, Layout
from dsv41.model.mhc import HcSite, hc_mixes
from dsv41.model.moe import Expert, MoE
from dsv41.model.ops import Ops, ops_for, reference_ops
from dsv41.model.rope import Rope
from dsv41.model.state import DEAD, SeqState
from dsv41.model.weights import TP_SHARDS, RankShare, SplitPlan, load_weights, part_range, tp_parts

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
    ops: Ops = field(default_factory=reference_ops)   # the model's op set, as each of the parts above holds it


@dataclass
class Comm:
    """Tensor-parallel exchange used by the forward (dsv41.comm provides one across ranks). Partial sums must be
    added in rank order so every rank computes the same bits."""
    world: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    all_gather_cols: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


@dataclass
class _RoundSource:
    """A KV source's compressor work in a round (per sequence: first pending position, open rows, groups closed)."""
    ratio: int
    first: list[int]
    pend: list[int]
    groups: list[int]
    block: list[int] = field(default_factory=list)   # where each sequence's rows start in the round's row order
    gpos: torch.Tensor | None = None                  # [G] first position of each closing group (device)
    order: torch.Tensor | None = None                 # open rows of all sequences, then the new rows -> per sequence
    group_rows: torch.Tensor | None = None            # [G * ratio] rows of the closing groups in that order


@dataclass
class _RoundIndex:
    """An index layer's keys in a round: per sequence the publishing owner and key count, the padded count."""
    owner: list[int | None]
    count: list[int]
    tpad: int
    limit: torch.Tensor | None = None     # [N] a row sees entries < limit (visible, capped by its key count)
    newest: torch.Tensor | None = None    # [N] candidate source: the block forced in, -1 for none
    counts: torch.Tensor | None = None    # [B] the key counts (device)


@dataclass
class _Round:
    """What Model._prepare_round precomputed for a round of sequences with n rows each, and what its layers
    publish (the round's compressed KV per sequence, top-k, candidate mask).

    Toward a CUDA graph of a round (not there yet): the round has no host sync and its integers arrive in one copy,
    but its shapes and addresses still change from round to round: the padded key count (bucket it by context), the
    number of closing ratio-2 groups and open rows (pool every sequence's group each round, mask the append), and
    the per-sequence tensors the ring writes, appends and key reads name directly (address tables, as the key gather
    and the indexer's keys already use, refreshed by the round's one copy, or one paged pool for all states)."""
    n: int
    starts: list[int]
    states: list[SeqState]
    win_src: torch.Tensor                  # [N, W] rows of the round's [ring | new rows] blocks
    win_valid: torch.Tensor                # [N, W] position >= 0
    ring_segs: list[list[tuple[int, int, int]]]   # per sequence: (ring slot, row, count) runs to write
    srcs: dict[int, _RoundSource]
    idx: dict[int, _RoundIndex]
    kv: list[torch.Tensor] | None = None
    topk: torch.Tensor | None = None
    cand: torch.Tensor | None = None


def _build_block(W: dict[str, torch.Tensor], role: LayerRole, cfg: ModelConfig, n_experts: int, top_k: int,
                 engram_rows: Callable | None, ops: Ops, shards: int = 1, plan: SplitPlan | None = None,
                 rank: int = 0) -> Block:
    """One layer (or DSpark stage) from the weights; every part gets the op set `ops`. `shards`, `plan`, `rank`:
    the tensor-parallel parts this rank computes apart (_shard_block)."""
    t = cfg.text
    p = role.name
    eps = t.rms_norm_eps

    def site(kind):
        return HcSite(fn=W[f"{p}.hc_{kind}_fn"].float(), base=W[f"{p}.hc_{kind}_base"].float(),
                      scale=W[f"{p}.hc_{kind}_scale"].float(), ops=ops)

    attn = Attention(
        wq_a=W[f"{p}.attn.wq_a.weight"], q_norm=W[f"{p}.attn.q_norm.weight"], wq_b=W[f"{p}.attn.wq_b.weight"],
        wkv=W[f"{p}.attn.wkv.weight"], kv_norm=W[f"{p}.attn.kv_norm.weight"],
        attn_sink=W[f"{p}.attn.attn_sink"].float(), wo_a=W[f"{p}.attn.wo_a.weight"],
        wo_b=W[f"{p}.attn.wo_b.weight"], head_dim=t.head_dim, o_lora=t.o_lora_rank, eps=eps, ops=ops)

    def expert(q):
        return Expert(w1=W[f"{q}.w1.weight"], w2=W[f"{q}.w2.weight"], w3=W[f"{q}.w3.weight"])

    experts = {e: expert(f"{p}.ffn.experts.{e}") for e in range(n_experts) if f"{p}.ffn.experts.{e}.w1.weight" in W}
    moe = MoE(gate=W[f"{p}.ffn.gate.weight"], bias=W[f"{p}.ffn.gate.bias"].float(),
              bias_vl=W[f"{p}.ffn.gate.bias_vl"].float(), experts=experts,
              # absent on ranks > 0 when the plan keeps it whole (rank 0 adds it once: weights.SplitPlan)
              shared=(expert(f"{p}.ffn.shared_experts") if f"{p}.ffn.shared_experts.w1.weight" in W else None),
              top_k=top_k, gate_temp=t.gate_temp,
              scaling=t.routed_scaling_factor, limit=t.swiglu_limit,
              stack=dev.stack_experts(experts, n_experts) if ops.stacks_experts else None, ops=ops)
    if shards > 1:
        _shard_block(attn, moe, shards, n_experts, plan, rank)
    moe.fuse_shared()     # the shared expert's w1/w3 (every shard's) in one launch where the op set can
    block = Block(role=role, attn_norm=W[f"{p}.attn_norm.weight"], ffn_norm=W[f"{p}.ffn_norm.weight"],
                  hc_attn=site("attn"), hc_ffn=site("ffn"), attn=attn, moe=moe, ops=ops)
    if role.owns_compressor:
        c = f"{p}.attn.compressor"
        block.compressor = Compressor(layer=role.index, ratio=role.ratio, wkv=W[f"{c}.wkv.weight"],
                                      wgate=W[f"{c}.wgate.weight"] if role.ratio > 1 else None,
                                      norm=W[f"{c}.norm.weight"], eps=eps, ops=ops)
    if role.index_source:
        i = f"{p}.attn.indexer"
        block.indexer = Indexer(layer=role.index, n_heads=t.index_n_heads, head_dim=t.index_head_dim,
                                topk=t.index_topk, wq_b=W[f"{i}.wq_b.weight"],
                                weights_proj=W[f"{i}.weights_proj.weight"],
                                wk=W.get(f"{i}.wk.weight"), k_norm=W.get(f"{i}.k_norm.weight"), eps=eps, ops=ops)
    if role.engram is not None and engram_rows(role.index) is not None:
        g = f"{p}.engram"
        block.engram = Engram(rows=engram_rows(role.index), wkv=W[f"{g}.wkv.weight"],
                              weight=W[f"{g}.q_weight"].float() * W[f"{g}.k_weight"].float(), eps=eps, ops=ops)
    return block


def _shard_block(attn: Attention, moe: MoE, shards: int, n_experts: int, plan: SplitPlan, rank: int) -> None:
    """Give a block's split weights as this rank's `shards` parts of `plan` (parts rank*shards ...), so it computes
    what that many ranks would, part by part. A family the plan keeps whole stays whole (attention: computed whole
    by every rank; the shared expert: part 0's). A block whose weights cannot be cut so (EXL3 packs) stays whole."""
    if moe.stack is not None and not isinstance(moe.stack, dev.ExpertStack):   # an EXL3 stack: no shard mask
        return
    wq_b = wo_b = None
    if plan.heads:
        wq_b, wo_b = dev.shard_rows(attn.wq_b, shards), dev.shard_cols(attn.wo_b, shards)
        if None in (wq_b, wo_b):
            return
    sh = moe.shared
    if sh is None or not plan.shared:     # whole: part 0 (rank 0's first) holds it, the others nothing
        shared_shards = [sh if i == 0 else None for i in range(shards)]
    else:
        w1, w3, w2 = dev.shard_rows(sh.w1, shards), dev.shard_rows(sh.w3, shards), dev.shard_cols(sh.w2, shards)
        if None in (w1, w3, w2):
            return
        shared_shards = [Expert(w1=a, w2=c, w3=b) for a, b, c in zip(w1, w3, w2)]
    if plan.heads:
        # the column shards are copies: the whole wo_b they replace is not kept (the rows' shards are views)
        attn.shards, attn.wq_b_shards, attn.wo_b_shards, attn.wo_b = shards, wq_b, wo_b, None
        if attn.ops.fuse_parts is not None:     # the shards' rows are wq_b's: one launch over them, no copy
            attn.fused_q = attn.ops.fuse_parts(attn.wq_b, tuple(int(w.shape[0]) for w in wq_b))
    moe.shards = shards
    moe.shard_ranges = [part_range(n_experts, rank * shards + i, plan.parts) for i in range(shards)]
    moe.shared_shards = shared_shards
    if moe.stack is not None:       # one grouped pass for all the shards (Ops.routed_shards)
        dev.shard_stack(moe.stack, moe.shard_ranges)


class Model:
    def __init__(self, cfg: ModelConfig, W: dict[str, torch.Tensor], engram_rows: Callable,
                 hasher: EngramHasher | None,
                 qat: bool = True, index_keys: str = "intended", comm: Comm | None = None,
                 engram_store: EngramStore | None = None, tp_shards: int = TP_SHARDS, ops: Ops | None = None,
                 rank: int = 0):
        if index_keys not in INDEX_KEY_MODES:
            raise ValueError(f"index_keys must be one of {INDEX_KEY_MODES}, got {index_keys!r}")
        # which function computes each op (dsv41/model/ops.py): chosen once, here; every block gets it
        self.ops = ops = ops or reference_ops()
        self.cfg = cfg
        t = self.t = cfg.text
        self.layout = Layout.from_config(t)
        self.rope = Rope(t, ops.cos_sin)
        self.qat = qat
        self.index_keys = index_keys
        self.comm = comm or Comm()
        self.hasher = hasher
        self.device = W["embed.weight"].device
        # the RoPE tables live where the positions do
        self.rope.inv_freq = {k: v.to(self.device) for k, v in self.rope.inv_freq.items()}
        self.engram_store = engram_store   # None: no Engram layers, or served without the tables (degraded)
        # CUDA graphs of a round's row-only pieces (graphs.py); Model.load turns them on for a CUDA device
        self.graphs: PieceGraphs | None = None
        self.embed = W["embed.weight"]
        self.head = W["head.weight"]
        self.norm = W["norm.weight"]
        # Tensor parallelism (weights.SplitPlan): products cut into plan.parts parts, of which this rank (`rank` of
        # comm.world) computes `shards` apart, as that many ranks would: one rank with --tp-shards W == W ranks
        self.rank = rank
        self.plan = SplitPlan.of(t, tp_parts(self.comm.world, tp_shards))
        self.shards = self.plan.parts // self.comm.world
        self.head_shards = (dev.shard_rows(self.head, self.shards) if self.shards > 1 and self.plan.vocab
                            else None)
        self.blocks = [_build_block(W, r, cfg, t.n_routed_experts, t.num_experts_per_tok, engram_rows, ops,
                                    self.shards, self.plan, rank) for r in self.layout.layers]
        self.dspark = None
        if self.layout.stages and "mtp.0.main_proj.weight" in W:
            from dsv41.model.dspark import DSpark
            stages = [_build_block(W, r, cfg, t.dspark_n_routed_experts, t.dspark_num_experts_per_tok, None, ops,
                                   self.shards, self.plan, rank) for r in self.layout.stages]
            self.dspark = DSpark(self, W, stages)

    # ---- loading ----------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, ckpt: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
             share: RankShare | None = None, qat: bool = True, index_keys: str = "intended",
             comm: Comm | None = None, engram: str | Path | None = None, engram_tables: bool = True,
             engram_cache_bytes: int = 256 << 20, keep_quant: bool | None = None,
             cuda_graphs: bool = True, tp_shards: int = TP_SHARDS, kernels: bool | None = None,
             ops: Ops | None = None) -> Model:
        """Load a checkpoint. qat=False makes the three QAT fake-quants (window KV, compressed KV, indexer q/k)
        the identity; index_keys="quirk" reproduces the release's indexer-key publication (arch.md §2.8).
        engram: the folder holding the Engram tables (default: the checkpoint); engram_tables=False runs without
        them (degraded: the Engram layers add nothing to the streams, exactly as all-zero rows would, since wkv has
        no bias); engram_cache_bytes: host memory for hot rows (0: no cache, no read-ahead).
        device "cpu": the float32 reference (weights dequantised at load). "cuda[:N]": the same code on the GPU,
        float32 with TF32 off; FP8/FP4 weights stay in checkpoint form there (dsv41/model/device.py, docs/gpu.md).
        keep_quant: keep FP8/FP4 weights in checkpoint form (default: on CUDA only); the values are the same
        (dequantisation is exact), only where and when the weight is dequantised differs.
        cuda_graphs: on a CUDA device, replay decode rounds' row-only pieces as CUDA graphs (graphs.py); the same
        bits as running them eagerly.
        tp_shards: the tensor-parallel shards every split product is computed in, at least the world's
        (weights.SplitPlan: families the shapes cannot cut stay whole); one rank with tp_shards N and N ranks give
        the same bits (weights.TP_SHARDS = 2: one rank == two); 1 computes whole products, in the reference's order
        (the test vectors' tie analysis), and a two-rank model then differs from it in low bits.
        kernels / ops: which function computes each op (dsv41/model/ops.py), chosen here once: `ops` as given (tests
        and benches: e.g. cuda_ops() on CPU tensors), else the CPU reference on "cpu" and cuda_ops(kernels) on
        CUDA, kernels=None reading DSV41_KERNELS once (0/false/no/off: the torch fallbacks; the server passes its
        --kernels knob). An EXL3 pack adds its kernels to the op set (Ops.with_exl3)."""
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
        share = share.planned(cfg.text, tp_shards)     # the families this world and tp_shards cut (SplitPlan)
        W = load_weights(d, cfg, share=share, dtype=dtype, device=dv,
                         keep_quant=dv.type == "cuda" if keep_quant is None else keep_quant)
        if ops is None:
            if kernels is None:
                kernels = os.environ.get("DSV41_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")
            ops = ops_for(dv, kernels)
        if any(isinstance(w, Exl3Packed) for w in W.values()):
            ops = ops.with_exl3()
        store = None
        if cfg.text.engram_layer_ids and engram_tables:
            store = EngramStore(Path(engram) if engram else d, cfg, dtype=torch.float32,
                                cache_bytes=engram_cache_bytes)
        engram_rows = _engram_row_reader(store)
        hasher = _make_hasher(d, cfg) if cfg.text.engram_layer_ids else None   # no Engram layers: nothing to hash
        model = cls(cfg, W, engram_rows, hasher, qat=qat, index_keys=index_keys, comm=comm, engram_store=store,
                    tp_shards=tp_shards, ops=ops, rank=share.rank)
        if dv.type == "cuda" and cuda_graphs:
            model.graphs = PieceGraphs("cuda")
        elif cuda_graphs and os.environ.get("DSV41_GRAPHS") == "emulate":   # tests: the graphs' bookkeeping on CPU
            model.graphs = PieceGraphs("emulate")
        return model

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
        return self._forward(batch, trace)

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
        # tensors the forward makes name their device: an ambient torch.device(...) mode would add ~7 µs of Python
        # to every torch call (a decode round's history work is thousands of small calls; tests/test_model_devices.py)
        dv = self.device
        pos = torch.cat([torch.arange(st, st + n, device=dv) for _, n, st, _ in segs])
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
        pre = torch.zeros(ids.numel(), t.hc_mult, device=dv)
        pre[:, 0] = 1.0
        taps = [None] * len(t.dspark_target_layer_ids)
        shared = [{} for _ in segs]
        rd = self._prepare_round(segs)   # None: rows differ per sequence (prompt passes): the per-sequence loop
        # a round's dense pieces through CUDA graphs (dsv41/model/graphs.py); traced and image calls run eagerly,
        # and so does an op set whose pieces wait for the host (the CUDA torch fallbacks' per-expert MoE: ops.graphs)
        G = (self.graphs if rd is not None and trace is None and image is None and self.ops.graphs
             else None)
        if G is not None:
            cs = {k: (G.rows(f"cos.{k}", c), G.rows(f"sin.{k}", s_)) for k, (c, s_) in cs.items()}
        for blk in self.blocks:
            r = blk.role

            def piece(name, fn, *args, layer=r.index):
                return fn(*args) if G is None else G.run((name, layer), fn, args)

            if blk.engram is not None:
                streams = blk.engram(streams, hash_ids[:, r.engram], image)
                if trace is not None:
                    trace[f"engram_out_streams.layer{r.index}"] = streams.clone()
            if r.dspark_tap is not None:
                taps[r.dspark_tap] = _stream_mean(streams)
            cos, sin = cs[r.rope]
            pre_a, post_a, comb_a, q, kv, ckv, cgate, iq, iw = piece(
                "attn_in", functools.partial(self._attn_in, blk), streams, pre, cos, sin, *cs["compress"])
            keys, sel = self._history(blk, kv, ckv, cgate, iq, iw, pos, segs, shared, trace, rd)
            if self.comm.world == 1:
                streams, pre = piece("attn_out_ffn", functools.partial(self._attn_out_ffn, blk, image=image),
                                     q, keys, sel, cos, sin, streams, pre_a, post_a, comb_a)
            else:   # the partial sums cross ranks between the pieces
                y, = piece("attn_out", functools.partial(self._attn_out, blk), q, keys, sel, cos, sin)
                streams, pre, post_f, comb_f, y = piece("ffn", functools.partial(self._ffn, blk, image=image),
                                                        self.reduce_attn(y), streams, pre_a, post_a, comb_a)
                streams, = piece("ffn_out", functools.partial(_expand, blk.ops), self.comm.all_reduce(y), streams,
                                 post_f, comb_f)
            if trace is not None:
                trace.setdefault("layer_out_streams", []).append(streams.clone())

        if self.dspark is not None:
            main_hidden = torch.cat(taps, dim=1)
            if trace is not None:
                trace["dspark_taps"] = main_hidden.clone()
            self.dspark.fill_rings(main_hidden, pos, segs, G, cs["main"] if G is not None else None)

        want = []
        for (a, n, _, _), s in zip(segs, batch):
            want.append(torch.arange(a, a + n, device=dv) if s.logits == "all" else
                        torch.tensor([a + n - 1], device=dv) if s.logits == "last" else
                        torch.zeros(0, dtype=torch.long, device=dv))
        rows = torch.cat(want)
        if rows.numel():
            x = self.ops.collapse_norm(streams[rows], pre[rows], self.norm, t.rms_norm_eps)
            logits = self.gather_logits(self.head_logits(x))
        else:   # no row wants logits (a prompt's earlier chunks): skip the head, whose empty call still runs one
            logits = streams.new_zeros((0, t.vocab_size))    # padded row tile, a full read of its weight (~1 GB)
        for (_, n, _, st) in segs:
            st.length += n
        out, o = [], 0
        for w in want:
            out.append(logits[o:o + w.numel()])
            o += w.numel()
        return out

    __call__ = forward

    def reduce_attn(self, y: torch.Tensor) -> torch.Tensor:
        """The attention output from this rank's partial: the rank-order sum, or y itself where every rank computes
        the whole attention (heads not cut: weights.SplitPlan)."""
        return self.comm.all_reduce(y) if self.plan.heads else y

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Whole logits rows from this rank's vocabulary columns (all of them where the head is not cut)."""
        return self.comm.all_gather_cols(logits) if self.plan.vocab else logits

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits: its head rows, shard by shard (TP_SHARDS)."""
        if self.head_shards is None:
            return self.ops.linear(x, self.head)
        return torch.cat([self.ops.linear(x, h) for h in self.head_shards], dim=1)

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

    # A layer is three pieces: _attn_in (rows only) -> _history (each sequence's history: ring, compressor,
    # indexer, keys) -> _attn_out + _ffn (rows only). The row-only pieces are what a round's CUDA graphs hold
    # (graphs.py); each returns a tuple of row-first tensors.

    def _attn_in(self, blk: Block, streams, pre, cos, sin, ccos, csin) -> tuple:
        """mHC mixes of the attention site, collapse with the incoming pre, attn_norm, the q/kv projections, and the
        compressor's and indexer's row work."""
        t = self.t
        ops = blk.ops
        pre_a, post_a, comb_a = hc_mixes(streams, blk.hc_attn, t.hc_sinkhorn_iters, t.hc_eps, t.rms_norm_eps)
        x = ops.collapse_norm(streams, pre, blk.attn_norm, t.rms_norm_eps)
        q_res, q, kv = blk.attn.project(x, cos, sin, self.qat)
        ckv = cgate = iq = iw = None
        if blk.compressor is not None:
            ckv, cgate = blk.compressor.project(x)
        if blk.indexer is not None:
            iq, iw = blk.indexer.queries(q_res, x, ccos, csin, self.qat)
        return pre_a, post_a, comb_a, q, kv, ckv, cgate, iq, iw

    def _attn_out(self, blk: Block, q, keys, sel, cos, sin) -> tuple:
        return blk.attn.output(blk.attn.attend(q, keys, sel), cos, sin),

    def _ffn(self, blk: Block, y, streams, pre_a, post_a, comb_a, image=None) -> tuple:
        """Expand the attention output into the streams, mHC mixes of the FFN site, collapse with the attention
        site's pre, ffn_norm, MoE: -> (streams, the FFN site's pre/post/comb, this rank's MoE output). y: the
        attention output, or a tuple of its TP shards' partials, added in order first."""
        t, ops = self.t, blk.ops
        streams, x = ops.expand_collapse_norm(y, streams, post_a, comb_a, pre_a, blk.ffn_norm, t.rms_norm_eps)
        pre_f, post_f, comb_f = hc_mixes(streams, blk.hc_ffn, t.hc_sinkhorn_iters, t.hc_eps, t.rms_norm_eps)
        return streams, pre_f, post_f, comb_f, blk.moe(x, image)

    def _attn_out_ffn(self, blk: Block, q, keys, sel, cos, sin, streams, pre_a, post_a, comb_a,
                      image=None) -> tuple:
        """_attn_out, _ffn and the last expand as one piece (one rank: nothing crosses between them)."""
        y = blk.attn.output(blk.attn.attend(q, keys, sel), cos, sin, parts=True)    # the shards' partials (added
        streams, pre_f, post_f, comb_f, y = self._ffn(blk, y, streams, pre_a, post_a, comb_a, image)  # by _ffn)
        return blk.ops.hc_expand(y, streams, post_f, comb_f), pre_f

    def _history(self, blk: Block, kv, ckv, cgate, iq, iw, pos, segs, shared, trace,
                 rd: _Round | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows' KV into each sequence's window ring and compressor, score the indexer, and return
        every row's key set (window, then the top-k compressed entries) in one of Attention.attend's two forms: a
        decode round's gathered keys [N, K, D] with their validity [N, K] (fixed shapes for its CUDA graphs), or a
        prompt pass's pool of latents [P, D] with each row's indices into it [N, K], -1 masked (no [N, K, D] copy:
        1.3 MB a row at the release's sizes)."""
        t, r = self.t, blk.role
        W = t.sliding_window
        if rd is not None:
            return self._keys_round(blk, rd, kv, ckv, cgate, iq, iw, trace)
        pools, idxs, off = [], [], 0
        for (a, n, start, st), sh in zip(segs, shared):
            wpool, widx = st.window_pool(r.index, kv[a:a + n], start, W)
            st.write_window(r.index, kv[a:a + n], start, W)
            pools.append(wpool)
            sel = torch.where(widx >= 0, widx + off, -1)
            off += wpool.shape[0]
            if r.ratio == 0:
                idxs.append(sel)
                continue
            p = pos[a:a + n]
            if blk.compressor is not None:
                self._compress(blk, st, sh, ckv[a:a + n], None if cgate is None else cgate[a:a + n])
            if blk.indexer is not None:
                sh["topk"] = self._index(blk, st, sh, iq[a:a + n], iw[a:a + n], p, trace)
            topk = sh["topk"]
            ckv_src = sh["kv"]
            pools.append(ckv_src)
            idxs.append(torch.cat([sel, torch.where(topk >= 0, topk + off, -1)], dim=1))
            off += ckv_src.shape[0]
        return torch.cat(pools), torch.cat(idxs)

    def _compress(self, blk: Block, st: SeqState, sh: dict, kv, gate) -> None:
        """Close this call's groups of a KV source; append compressed KV (and index keys) and publish them."""
        comp, r = blk.compressor, blk.role
        D, Di = self.t.head_dim, self.t.index_head_dim
        latent, first = comp.close_groups(st, kv, gate)
        g = latent.shape[0]
        gpos = first + r.ratio * torch.arange(g, device=kv.device)
        if r.index not in st.compressed:
            st.compressed[r.index] = kv.new_zeros((0, D))
            st.index_keys[r.index] = kv.new_zeros((0, Di))
        if g:
            gcs = self.rope.cos_sin("compress", gpos)          # the keys' and the entries' (one computation)
            if r.owns_index_keys:
                k = blk.indexer.keys(latent, *gcs, self.qat)
                st.index_keys[r.index] = _append_rows(st.index_keys[r.index], k)
            st.compressed[r.index] = _append_rows(st.compressed[r.index], self._entries(latent, *gcs))
        sh["kv"] = st.compressed[r.index]
        # "intended": an owner publishes its running keys on every call. "quirk" (the release): a ratio-2 owner
        # publishes only on calls that close a group; otherwise later index layers score the last published keys.
        if r.owns_index_keys and (self.index_keys == "intended" or g > 0):
            st.published_keys = (r.index, st.index_keys[r.index].shape[0])

    def _entries(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Compressed KV entries of pooled latents [g, D]: compress RoPE at the group's first position (cos, sin:
        Rope.cos_sin("compress", those positions), shared with the indexer's keys), FP4 fake-quant (E4M3 scale per
        16)."""
        # not own: the latent also feeds the indexer's keys
        return self.ops.norm_rope_quant(latent, None, 0.0, cos, sin, "fp4_e4m3" if self.qat else None, own=False)

    def _index(self, blk: Block, st: SeqState, sh: dict, q, w, p, trace) -> torch.Tensor:
        t, r, ix = self.t, blk.role, blk.indexer
        if st.published_keys is None:
            keys = q.new_zeros((0, t.index_head_dim))
        else:
            owner, count = st.published_keys
            keys = st.index_keys[owner][:count]
        if keys.shape[0] == 0:
            topk = torch.full((q.shape[0], t.index_topk), -1, dtype=torch.long, device=q.device)
        else:
            # rows in blocks: a long prompt's [rows, keys] scores and their top-k temporaries would be tens of GB
            # for a whole chunk at 1M keys; a row's result does not depend on its block (row-invariance)
            rb = index_row_block(keys.shape[0])
            picks, cands = [], []
            for r0 in range(0, q.shape[0], rb):
                rows = slice(r0, r0 + rb)
                scores = ix.scores(q[rows], w[rows], keys, p[rows], r.ratio)
                if r.candidate_source:
                    cands.append(candidate_blocks(scores, p[rows], r.ratio, t.candidate_topk_blocks,
                                                  t.candidate_block_size))
                elif r.uses_candidates and "candidates" in sh:
                    scores = scores.masked_fill(~sh["candidates"][rows], float("-inf"))
                picks.append(ix.ops.select_topk(scores, t.index_topk))
                del scores
            topk = torch.cat(picks) if len(picks) > 1 else picks[0]
            if r.candidate_source:
                sh["candidates"] = torch.cat(cands) if len(cands) > 1 else cands[0]
                if trace is not None:
                    trace.setdefault(f"candidates.layer{r.index}", []).append(sh["candidates"])
        if trace is not None:
            trace.setdefault(f"topk.layer{r.index}", []).append(topk)
        return topk


    # ---- a round of sequences with the same row count (decode, drafted verify): the history work batched --------

    def _prepare_round(self, segs) -> _Round | None:
        """The round's per-sequence integers, computed on the host once before the layers (from the states' host
        metadata: lengths, row counts of the compressed KV / index keys / open groups; never from tensor values)
        and sent to the device in one copy: the window gather index, each KV source's group rows, each index
        layer's key counts. None when the sequences bring different row counts (or more rows than the window):
        the per-sequence loop runs then."""
        t = self.t
        W = t.sliding_window
        n = segs[0][1]
        if any(sg[1] != n for sg in segs) or n > W:
            return None
        starts = [sg[2] for sg in segs]
        states = [sg[3] for sg in segs]
        cpu = torch.device("cpu")
        parts: dict[str, torch.Tensor] = {}
        # window: row i of sequence b (position s+i) reads positions s+i-W+1 .. s+i from [ring slots | new rows]
        S = torch.tensor(starts, dtype=torch.long, device=cpu)[:, None, None]           # [B, 1, 1]
        B = len(starts)
        p = S + torch.arange(n, device=cpu)[:, None] - W + 1 + torch.arange(W, device=cpu)   # [B, n, W]
        base = (torch.arange(B, device=cpu) * (W + n))[:, None, None]
        parts["win_src"] = (base + torch.where(p >= S, W + p - S, p % W)).view(B * n, W)
        parts["win_pos"] = p.view(B * n, W)
        ring_segs = []
        for s in starts:
            a = s % W
            m = min(n, W - a)
            ring_segs.append([(a, 0, m)] + ([(0, m, n - m)] if m < n else []))
        rowpos = (S[:, :, 0] + torch.arange(n, device=cpu)).view(B * n)                 # [N] positions
        # replay the layers' publication on the host: groups closed per source, the keys each index layer sees
        pub = [st.published_keys for st in states]
        counts: dict[int, list[int]] = {}        # index-key owner -> per-sequence key count after this round
        srcs, idx = {}, {}
        cand_counts = None
        for blk in self.blocks:
            r = blk.role
            if r.owns_compressor:
                L, q = r.index, r.ratio
                comp = [st.compressed[L].shape[0] if L in st.compressed else 0 for st in states]
                pend = [st.partial_kv[L].shape[0] if q > 1 and L in st.partial_kv else 0 for st in states]
                if any(c * q + pe != s for c, pe, s in zip(comp, pend, starts)):
                    return None
                groups = [(pe + n) // q for pe in pend]
                sp = _RoundSource(ratio=q, first=[c * q for c in comp], pend=pend, groups=groups)
                gpos = [c * q + q * g for c, gb in zip(comp, groups) for g in range(gb)]
                parts[f"gpos{L}"] = torch.tensor(gpos, dtype=torch.long, device=cpu)
                if q > 1:
                    ptot = sum(pend)
                    order, grows, o, po = [], [], 0, 0
                    for b, (pe, gb) in enumerate(zip(pend, groups)):
                        order += list(range(po, po + pe)) + list(range(ptot + b * n, ptot + (b + 1) * n))
                        grows += list(range(o, o + gb * q))
                        sp.block.append(o)
                        o += pe + n
                        po += pe
                    parts[f"order{L}"] = torch.tensor(order, dtype=torch.long, device=cpu)
                    parts[f"grows{L}"] = torch.tensor(grows, dtype=torch.long, device=cpu)
                srcs[L] = sp
                if r.owns_index_keys:
                    have = [st.index_keys[L].shape[0] if L in st.index_keys else 0 for st in states]
                    counts[L] = [h + g for h, g in zip(have, groups)]
                    for b, g in enumerate(groups):
                        if self.index_keys == "intended" or g > 0:
                            pub[b] = (L, counts[L][b])
            if r.index_source:
                L = r.index
                owner = [None if pk is None else pk[0] for pk in pub]
                cnt = [0 if pk is None else pk[1] for pk in pub]
                tpad = -(-max(cnt) // KEY_TILE) * KEY_TILE
                vis = (rowpos + 1) // r.ratio
                crow = torch.tensor(cnt, dtype=torch.long, device=cpu).repeat_interleave(n)
                parts[f"limit{L}"] = torch.minimum(vis, crow)
                parts[f"kcount{L}"] = torch.tensor(cnt, dtype=torch.long, device=cpu)
                if r.candidate_source:
                    bs = t.candidate_block_size
                    nw = (vis - 1) // bs
                    parts[f"newest{L}"] = torch.where(nw < (crow + bs - 1) // bs, nw, -1)
                    cand_counts = cnt
                elif r.uses_candidates and cand_counts is not None and cand_counts != cnt and any(cand_counts):
                    return None   # keys changed between the candidate source and here: the per-sequence rules
                idx[L] = _RoundIndex(owner=owner, count=cnt, tpad=tpad)
        # one host -> device copy of every integer the layers need
        names = list(parts)
        flat = torch.cat([parts[k].reshape(-1).to(torch.long) for k in names])
        if self.device.type != "cpu":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        dev_parts, o = {}, 0
        for k in names:
            m = parts[k].numel()
            dev_parts[k] = flat[o:o + m].view(parts[k].shape)
            o += m
        for L, sp in srcs.items():
            sp.gpos = dev_parts[f"gpos{L}"]
            sp.order = dev_parts.get(f"order{L}")
            sp.group_rows = dev_parts.get(f"grows{L}")
        for L, ip in idx.items():
            ip.limit = dev_parts[f"limit{L}"]
            ip.newest = dev_parts.get(f"newest{L}")
            ip.counts = dev_parts[f"kcount{L}"]
        return _Round(n=n, starts=starts, states=states, win_src=dev_parts["win_src"],
                      win_valid=dev_parts["win_pos"] >= 0, ring_segs=ring_segs, srcs=srcs, idx=idx)

    def _keys_round(self, blk: Block, rd: _Round, kv, ckv, cgate, iq, iw, trace) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-sequence loop of _history for a round, each step once for all its sequences: the window keys
        in one gather, the ring writes in one _foreach_copy_, the compressor's groups pooled together, one scoring
        of all rows against their own (padded) keys, one top-k; every row gets the bits the loop gives it."""
        t, r = self.t, blk.role
        W, n, D = t.sliding_window, rd.n, kv.shape[1]
        rings = []
        for st in rd.states:
            ring = st.windows.get(r.index)
            if ring is None:
                ring = st.windows[r.index] = kv.new_zeros((W, D))
            rings.append(ring)
        pieces = []
        for b, ring in enumerate(rings):
            pieces += [ring, kv[b * n:(b + 1) * n]]
        wkeys = torch.cat(pieces)[rd.win_src]                    # [N, W, D]; masked slots hold finite ring rows
        dst, src = [], []
        for b, ring in enumerate(rings):
            for slot, i0, m in rd.ring_segs[b]:
                dst.append(ring[slot:slot + m])
                src.append(kv[b * n + i0:b * n + i0 + m])
        torch._foreach_copy_(dst, src)
        if r.ratio == 0:
            return wkeys, rd.win_valid
        if blk.compressor is not None:
            self._compress_round(blk, rd, ckv, cgate)
        if blk.indexer is not None:
            rd.topk = self._index_round(blk, rd, iq, iw, trace)
        topk = rd.topk
        ckeys = self.ops.gather_round(rd.kv, topk, n)
        return torch.cat([wkeys, ckeys], dim=1), torch.cat([rd.win_valid, topk >= 0], dim=1)

    def _compress_round(self, blk: Block, rd: _Round, kv, gate) -> None:
        """_compress for every sequence of the round: the closing groups of all sequences pooled at once."""
        comp, r = blk.compressor, blk.role
        L = r.index
        sp = rd.srcs[L]
        n = rd.n
        D, Di = self.t.head_dim, self.t.index_head_dim
        if sp.ratio == 1:
            latent = comp.ops.rms_norm(kv, comp.norm, comp.eps)
        else:
            q = sp.ratio
            pk = [st.partial_kv[L] for st, pe in zip(rd.states, sp.pend) if pe]
            pg = [st.partial_gate[L] for st, pe in zip(rd.states, sp.pend) if pe]
            rows_kv = torch.cat(pk + [kv])[sp.order]           # per sequence: its open group, then its new rows
            rows_gate = torch.cat(pg + [gate])[sp.order]
            G = sum(sp.groups)
            latent = (comp.pool(rows_kv[sp.group_rows].view(G, q, D), rows_gate[sp.group_rows].view(G, q, D))
                      if G else kv.new_zeros((0, D)))
            for b, st in enumerate(rd.states):
                o, m, used = sp.block[b], sp.pend[b] + n, sp.groups[b] * q
                st.note_group_rows(L, sp.first[b], rows_kv[o:o + m], rows_gate[o:o + m])
                st.partial_kv[L] = rows_kv[o + used:o + m]
                st.partial_gate[L] = rows_gate[o + used:o + m]
        for st in rd.states:
            if L not in st.compressed:
                st.compressed[L] = kv.new_zeros((0, D))
                st.index_keys[L] = kv.new_zeros((0, Di))
        if latent.shape[0]:
            gcs = self.rope.cos_sin("compress", sp.gpos)       # the keys' and the entries' (one computation)
            k = blk.indexer.keys(latent, *gcs, self.qat) if r.owns_index_keys else None
            entry = self._entries(latent, *gcs)
            dst, src, o = [], [], 0
            for st, g in zip(rd.states, sp.groups):
                if g:
                    st.compressed[L], d = _grow_rows(st.compressed[L], g)
                    dst.append(d)
                    src.append(entry[o:o + g])
                    if k is not None:
                        st.index_keys[L], d = _grow_rows(st.index_keys[L], g)
                        dst.append(d)
                        src.append(k[o:o + g])
                o += g
            torch._foreach_copy_(dst, src)
        rd.kv = [st.compressed[L] for st in rd.states]
        if r.owns_index_keys:
            for st, g in zip(rd.states, sp.groups):
                if self.index_keys == "intended" or g > 0:
                    st.published_keys = (L, st.index_keys[L].shape[0])

    def _index_round(self, blk: Block, rd: _Round, q, w, trace) -> torch.Tensor:
        """_index for every sequence of the round: keys padded to a common count, one scoring, one top-k."""
        t, r, ix = self.t, blk.role, blk.indexer
        ip = rd.idx[r.index]
        n, B = rd.n, len(rd.states)
        if ip.tpad == 0:
            topk = torch.full((B * n, t.index_topk), -1, dtype=torch.long, device=q.device)
        else:
            none = q.new_zeros((0, t.index_head_dim))
            keys = [st.index_keys[owner][:c] if c else none for st, owner, c in zip(rd.states, ip.owner, ip.count)]
            scores = ix.round_scores(q, w, keys, ip.tpad, ip.limit, ip.counts)
            if r.candidate_source:
                rd.cand = candidate_blocks(scores, None, r.ratio, t.candidate_topk_blocks, t.candidate_block_size,
                                           newest=ip.newest)
                if trace is not None:
                    for b, c in enumerate(ip.count):
                        if c:
                            trace.setdefault(f"candidates.layer{r.index}", []).append(
                                rd.cand[b * n:(b + 1) * n, :c])
            elif r.uses_candidates and rd.cand is not None:
                scores = scores.masked_fill(~rd.cand, float("-inf"))
            topk = ix.ops.select_topk(scores, t.index_topk)
        if trace is not None:
            for b in range(B):
                trace.setdefault(f"topk.layer{r.index}", []).append(topk[b * n:(b + 1) * n])
        return topk


def _append_rows(rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """rows then new (dim 0), without copying rows when the buffer they are the start of has room. A long prompt's
    compressed KV and index keys would otherwise be copied whole once per chunk (O(T^2) bytes over a 1M prompt). The
    buffer grows by a quarter (the memory plan's margin) and is reached only through views of its first rows, so a
    rollback's shorter view, a snapshot's clone and this forward's published view all stay correct."""
    out, dst = _grow_rows(rows, new.shape[0])
    dst.copy_(new)
    return out


def _grow_rows(rows: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows followed by g rows to fill, those g rows) as views of rows' buffer (or a larger one, see _append_rows);
    the caller writes the g rows (a round writes all its sequences' new rows in one _foreach_copy_)."""
    n, d = rows.shape[0], rows.shape[1]
    cap = 0
    if rows.is_contiguous() and rows.storage_offset() == 0:
        cap = rows.untyped_storage().nbytes() // (rows.element_size() * d)
    if n + g <= cap:
        buf = rows.as_strided((cap, d), (d, 1), 0)
    else:
        buf = rows.new_empty(((n + g) * 5 // 4 + 16, d))
        buf[:n] = rows
    return buf[:n + g], buf[n:n + g]


# float32 scores one prompt pass's indexer holds per block of rows (its top-k temporaries add a few times that)
INDEX_BLOCK_BYTES = 1 << 30


def index_row_block(keys: int) -> int:
    """Rows of a prompt pass scored against `keys` index keys at once: every row while the scores stay under
    INDEX_BLOCK_BYTES, else fewer (a multiple of 16, at least 16)."""
    return max(16, INDEX_BLOCK_BYTES // (4 * max(1, keys)) // 16 * 16)


def _expand(ops: Ops, y, streams, post, comb) -> tuple:
    return ops.hc_expand(y, streams, post, comb),


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
