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
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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


@dataclass
class _RoundIndex:
    """An index layer's keys in a round: per sequence the publishing owner and key count, the padded count."""
    owner: list[int | None]
    count: list[int]
    tpad: int      # the scores' width: key_bucket of the largest count (a CUDA graph per bucket)
    # per row in the round's metadata: f"limit{L}" (a row sees entries < limit: visible, capped by its key count),
    # f"kcount{L}" (its sequence's key count), f"ikey{L}" (their address), f"newest{L}" (candidate source: the
    # block forced in, -1 for none)


@dataclass
class _Round:
    """What Model._prepare_round precomputed for a round of sequences with n rows each, and what its layers
    publish (the round's compressed KV per sequence, top-k, candidate mask).

    Its per-row metadata `meta` holds everything a layer's history needs: the window's ring slots and new rows, the
    ring-write slot, each compressor's masked groups (members, entry slot, open-group slot) and each index layer's
    key counts and limits, and per row the address of its sequence's ring of every layer, compressed KV, index keys
    and open group of every source (`_prepare_round` creates and reserves them first and sets their lengths after
    the round, so nothing moves inside it). So every layer of a round is one piece (`_layer_round`, one CUDA graph
    per layer and row bucket); the index layers' score width is bucketed (key_bucket)."""
    n: int
    starts: list[int]
    states: list[SeqState]
    meta: torch.Tensor | None              # [N, M] int64 per row, columns at `cols` (one copy; graphs.py pads it)
    cols: dict[str, int]                   # "rsel", "nsel", "pos" (W each), "wslot", f"ring{L}", f"kv{L}"
    rings: dict[int, list[torch.Tensor]]   # per layer: the sequences' window rings (the reference ops' lists)
    srcs: dict[int, _RoundSource]
    idx: dict[int, _RoundIndex]
    # per source, the reference op set's lists (views with room for the round's masked writes): compressed KV,
    # index keys, the open group's kv and gate buffers; and the marked states' open rows before the round
    kvs: dict[int, Sequence[torch.Tensor]] = field(default_factory=dict)
    ikeys: dict[int, Sequence[torch.Tensor]] = field(default_factory=dict)
    partials: dict[int, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] = field(default_factory=dict)
    marked: dict[int, list[tuple]] = field(default_factory=dict)
    topk: torch.Tensor | None = None
    cand: torch.Tensor | None = None
    rows: torch.Tensor | None = None       # the rows that want logits (the copy's tail), on the device
    want: list[int] | None = None
    host: torch.Tensor | None = None       # the table before send(): [N * M + len(want)] int64, pinned on a GPU
    before: list[tuple] | None = None      # (mapping, key, value before the round) of what the table set: undo()
    sent: bool = False

    def undo(self) -> None:
        """Take back what building the table set (the sources' lengths after the round, the published keys) for a
        table built ahead whose round does not come: the states are as they were (the room it reserved stays)."""
        if self.sent or self.before is None:
            return
        for where, key, value in reversed(self.before):
            if isinstance(where, dict):
                where[key] = value
            else:
                setattr(where, key, value)
        self.before = None

    def send(self, device: torch.device, ids: torch.Tensor | None = None) -> None:
        """The round's ids into the table's "ids" column (a table built ahead has none yet) and the table to the
        device in one non-blocking copy."""
        N = len(self.starts) * self.n
        M = (self.host.numel() - len(self.want or ())) // N
        if ids is not None:
            self.host.numpy()[:N * M].reshape(N, M)[:, self.cols["ids"]] = ids.numpy().reshape(-1)
        self.sent = True
        dev_flat = self.host.to(device, non_blocking=True) if device.type == "cuda" else self.host
        self.meta = dev_flat[:N * M].view(N, M)
        self.rows = None if self.want is None else dev_flat[N * M:]


class _Views(Sequence):
    """A round's per-sequence views of its sources' buffers (`fn` of each buffer as the round found it), made on
    first use: the reference op set reads them; the kernels' reads and writes go through the round's address
    table and never ask, so a decode round no longer makes B views of every source's buffers on the host (most
    of _prepare_round's per-sequence work after the table)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], bufs: list[torch.Tensor]):
        self.fn, self.bufs, self.made = fn, bufs, {}

    def __len__(self) -> int:
        return len(self.bufs)

    def __getitem__(self, b: int) -> torch.Tensor:
        b = range(len(self.bufs))[b]                 # negative indices; IndexError past the end (iteration)
        v = self.made.get(b)
        if v is None:
            v = self.made[b] = self.fn(self.bufs[b])
        return v


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
            if qat:      # the indexer's q and keys are FP4 values times powers of two: exact in TF32
                ops = ops.with_exact_index_inputs()
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

    def engram_read_ahead_next(self, items: list[tuple[SeqState, int]]) -> Future | None:
        """engram_read_ahead of each sequence's next decode row (its drawn token, at position state.length), for
        all of them at once: one hashing of the round (EngramHasher.hash_round) and one prefetch per Engram layer
        (per sequence, the read-ahead's fixed cost was most of it: ~0.1 ms a sequence on the planner thread)."""
        if self.engram_store is None or not items:
            return None
        before = _history_tails([(st, st.length) for st, _ in items], self.hasher.ngram - 1)
        starts = torch.tensor([st.length for st, _ in items], dtype=torch.long, device="cpu")
        toks = torch.tensor([tok for _, tok in items], dtype=torch.long, device="cpu")
        hasher = self.hasher
        return self.engram_store.read_ahead(
            lambda: hasher.hash_round(torch.from_numpy(before), starts, hasher.compress(toks).view(-1, 1)))

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
        # the ids' range once for the batch (two host ops, not two per sequence); the culprit named when one is out
        ids = batch[0].ids if len(batch) == 1 else torch.cat([s.ids for s in batch])
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0 or int(hi) >= self.t.vocab_size:
            i = next(i for i, s in enumerate(batch) if int(s.ids.min()) < 0 or int(s.ids.max()) >= self.t.vocab_size)
            raise InputError(f"batch[{i}].ids has token ids outside 0..{self.t.vocab_size - 1}")

    @torch.no_grad()
    def forward(self, batch: list[SeqInput], trace: dict[str, Any] | None = None,
                ahead: _Round | None = None, ids_on_device: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run every SeqInput's new tokens; returns per input float32 logits [n | 1 | 0, vocab] and advances each
        state by len(ids). `trace`, when given, receives intermediate arrays (tests, debugging). `ahead`: this
        round's table from prepare_ahead (the same states, rows and logits wanted; checked, else taken back).
        `ids_on_device` (with `ahead`, no Engram layers): the round's token ids as a tensor on the model's device,
        [rows] int64, which replace the SeqInputs' ids (placeholders) in the table after it is sent: the round is
        queued before the round that draws them has finished (the runner's launch ahead)."""
        try:
            self._check(batch)
            if ids_on_device is not None and (ahead is None or self.t.engram_layer_ids
                                              or ids_on_device.shape != (sum(s.ids.numel() for s in batch),)):
                raise InputError("ids_on_device needs a table prepared ahead, no Engram layers and a row each")
        except InputError:
            if ahead is not None:
                ahead.undo()
            raise
        return self._forward(batch, trace, ahead, ids_on_device)

    def prepare_ahead(self, states: list[SeqState], n: int, logits: str = "last") -> _Round | None:
        """The host side of the next round of `states` (n rows each, `logits` as SeqInput's) built before its
        token ids exist, while the round before still runs on the device: forward(..., ahead=) then only writes
        the ids into the table and sends it. It sets what the round's table sets (the sources' lengths after the
        round) and keeps what they were: a table whose round does not come is taken back with its undo(). None
        where the round takes the per-sequence loop."""
        segs = [(b * n, n, st.length, st) for b, st in enumerate(states)]
        want = [row for a, _, _, _ in segs for row in _wanted(a, n, logits)]
        return self._prepare_round(segs, None, want, ahead=True) if segs else None

    def _forward(self, batch: list[SeqInput], trace: dict[str, Any] | None,
                 ahead: _Round | None = None, ids_on_device: torch.Tensor | None = None) -> list[torch.Tensor]:
        t = self.t
        segs = []          # (row offset, n, start position, state)
        want, wants = [], []     # the rows that want logits; how many of them each input has
        a = 0
        for s in batch:
            n = s.ids.numel()
            segs.append((a, n, s.state.length, s.state))
            w = _wanted(a, n, s.logits)
            want += w
            wants.append(len(w))
            a += n
        # Engram hashing and row reads are on the host
        ids_host = torch.cat([s.ids.long().cpu() for s in batch]) if len(batch) > 1 else batch[0].ids.long().cpu()
        # tensors the forward makes name their device: an ambient torch.device(...) mode would add ~7 µs of Python
        # to every torch call (a decode round's history work is thousands of small calls; tests/test_model_devices.py)
        dv = self.device
        # the integers cross in one pinned, non-blocking copy (a pageable copy would wait for the GPU to drain the
        # previous round): a round's with its metadata, a prompt pass's ids, positions and logits rows together
        if ahead is None:
            rd = self._prepare_round(segs, ids_host, want)   # None: rows differ per sequence (prompt passes)
        else:
            if (len(segs) != len(ahead.states) or any(sg[3] is not st for sg, st in zip(segs, ahead.states))
                    or [sg[2] for sg in segs] != ahead.starts
                    or any(sg[1] != ahead.n for sg in segs) or want != ahead.want or ahead.sent):
                ahead.undo()
                raise InputError("the round does not match the table prepared ahead for it")
            rd = ahead
            rd.send(dv, ids_host)
            if ids_on_device is not None:     # stream-ordered after the draw that made them and the table's copy
                rd.meta[:, rd.cols["ids"]].copy_(ids_on_device)
        if rd is not None:
            ids, rows = rd.meta[:, rd.cols["ids"]], rd.rows
            pos = rd.meta[:, rd.cols["pos"] + t.sliding_window - 1]
        else:
            N = ids_host.numel()
            pos_host = np.concatenate([np.arange(st, st + n, dtype=np.int64) for _, n, st, _ in segs])
            flat = dev.host_to_device(torch.cat([ids_host, torch.from_numpy(pos_host),
                                         torch.tensor(want, dtype=torch.long, device="cpu")]), dv)
            ids, pos, rows = flat[:N], flat[N:2 * N], flat[2 * N:]
        image = image_host = None
        if any(s.token_type is not None for s in batch):
            image_host = torch.cat([s.token_type.cpu() >= 0 if s.token_type is not None else
                                    torch.zeros(s.ids.numel(), dtype=torch.bool, device="cpu") for s in batch])
            image = dev.host_to_device(image_host, self.device)
        whole = rd is not None and trace is None and self.whole_round()
        h = None
        if not whole or image is not None:   # a whole round embeds its ids inside its piece
            h = self.embed[ids].float()
            if image is not None:
                embeds = torch.cat([s.embeds.float().to(self.device) if s.embeds is not None else
                                    h.new_zeros((s.ids.numel(), t.hidden_size)) for s in batch])
                h = torch.where(image[:, None], embeds, h)
        # Engram hashing and table reads run on the host (host tensors, device="cpu" where they are made: an ambient
        # torch.device("cpu") mode here cost every torch call ~7 us, ~950 calls a 32-row round of tiny-a)
        hash_ids = self._engram_hashes(batch, segs, ids_host, image_host) if t.engram_layer_ids else None
        if self.engram_store is not None and not whole:
            # later Engram layers' rows load while earlier layers run (a whole round reads them all right below)
            self.engram_store.prefetch_hashes(hash_ids)

        taps = [None] * len(t.dspark_target_layer_ids)
        shared = [{} for _ in segs]
        # a round's dense pieces through CUDA graphs (dsv41/model/graphs.py); traced and image calls run eagerly,
        # and so does an op set whose pieces wait for the host (the CUDA torch fallbacks' per-expert MoE: ops.graphs)
        G = (self.graphs if rd is not None and trace is None and image is None and self.ops.graphs
             else None)
        logits = None
        if whole:    # the whole round as one piece: one CUDA graph per row bucket and key buckets (and head)
            erows = [blk.engram.table_rows(hash_ids[:, blk.role.engram], dv) for blk in self.blocks
                     if blk.engram is not None]
            # the head inside when every row wants logits (decode rounds, verify rounds)
            head = len(want) == ids_host.numel()
            args = (rd.meta, h, *erows)
            fn = functools.partial(self._round_piece, rd, image, head)
            writes = [c for k, c in rd.cols.items() if k == "wslot" or k[:5] in ("cslot", "pslot")]
            dry = functools.partial(self._dry_layer, writes, 0)
            key = ("round", head) + tuple(ip.tpad for ip in rd.idx.values())
            outs = fn(*args) if G is None else G.run(key, fn, args, dry=dry)
            streams, pre, logits = outs[0], outs[1], outs[2]
            if logits is not None and G is not None:
                logits = logits.clone()     # the graph's static rows: the next round overwrites them
            cs = {"main": (outs[3], outs[4])}
            taps = list(outs[5:5 + len(taps)])
            notes = iter(outs[5 + len(taps):])
            for blk in self.blocks:
                if blk.compressor is not None and blk.role.ratio > 1:
                    ckv, cgate = next(notes), next(notes)
                    if rd.marked.get(blk.role.index):
                        self._note_groups(blk.role.index, rd, ckv, cgate)
        else:
            cs = {k: self.rope.cos_sin(k, pos) for k in ("main", "compress")}
            streams = h[:, None, :].expand(-1, t.hc_mult, -1).clone()
            pre = torch.zeros(ids_host.numel(), t.hc_mult, device=dv)
            pre[:, 0] = 1.0
            if G is not None:
                cs = {k: (G.rows(f"cos.{k}", c), G.rows(f"sin.{k}", s_)) for k, (c, s_) in cs.items()}
            meta = None if rd is None else rd.meta if G is None else G.rows("round.meta", rd.meta)
        in_place: dict[str, tuple] = {}

        def shared_rows(name, t):
            """t in the round's static buffer `name`, copied once for all the layers that read it in place."""
            if in_place.get(name, (None,))[0] is not t:
                in_place[name] = t, G.rows(name, t)
            return in_place[name][1]
        for blk in self.blocks if not whole else ():
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
            reindex = blk.indexer is not None and r.uses_candidates
            # what the piece reads from earlier layers: a re-index layer the candidates, a layer without an indexer
            # the latest top-k (both absent: the eager history's per-round rules)
            ready = (rd is not None and (rd.cand is not None if reindex else
                                         blk.indexer is not None or r.ratio == 0 or rd.topk is not None))
            if ready and self.one_piece(blk):
                # the whole layer as one piece: its history reads and writes only through the round's tables
                key, topk = ("layer", r.index), None
                if blk.indexer is not None:     # its own top-k: a graph per key bucket (re-index: the candidates)
                    key += (rd.idx[r.index].tpad,)
                    if reindex:
                        topk = rd.cand if G is None else shared_rows("round.cand", rd.cand)
                elif r.ratio:    # the latest top-k, in one static buffer that the following layers read in place
                    topk = rd.topk if G is None else shared_rows("round.topk", rd.topk)
                args = (streams, pre, cos, sin, *cs["compress"], meta, topk)
                fn = functools.partial(self._layer_round, blk, rd, image, trace)
                dry = functools.partial(self._dry_layer, [rd.cols[k] for k in ("wslot", f"cslot{r.index}",
                                                                               f"pslot{r.index}") if k in rd.cols],
                                        len(args) - 2)
                streams, pre, own, cand, ckv, cgate = fn(*args) if G is None else G.run(key, fn, args, dry=dry)
                if ckv is not None and rd.marked.get(r.index):
                    self._note_groups(r.index, rd, ckv, cgate)
                if own is not None:
                    rd.topk = own
                if cand is not None:
                    rd.cand = cand
                if trace is not None:
                    trace.setdefault("layer_out_streams", []).append(streams.clone())
                continue
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

        if logits is None and want:    # not computed in the round's piece
            logits = self._head(streams[rows], pre[rows])
        elif logits is None:   # no row wants logits (a prompt's earlier chunks): skip the head, whose empty call still
            logits = streams.new_zeros((0, t.vocab_size))    # runs one padded row tile, a full read of its weight
        for (_, n, _, st) in segs:
            st.length += n
        out, o = [], 0
        for k in wants:
            out.append(logits[o:o + k])
            o += k
        return out

    __call__ = forward

    def _head(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Logits of the rows' streams: the final collapse, norm, head and (tensor parallelism) the gather."""
        x = self.ops.collapse_norm(streams, pre, self.norm, self.t.rms_norm_eps)
        return self.gather_logits(self.head_logits(x))

    def _round_piece(self, rd: _Round, image, head: bool, meta, h, *erows) -> tuple:
        """A round's forward on the device from its metadata alone (the token ids and positions are its columns):
        the embedding (or the rows `h` an image round brings), the RoPE rows, the streams, every layer
        (_round_layers) and, where every row wants logits (`head`), the head -> (streams, pre, logits or None, the
        main RoPE rows (DSpark's ring fill reads them in place), the DSpark taps, the sources' rows). One piece: the
        host copies the metadata in and launches one graph."""
        t, c = self.t, rd.cols
        pos = meta[:, c["pos"] + t.sliding_window - 1]
        if h is None:
            h = self.embed[meta[:, c["ids"]]].float()
        (cos, sin), (ccos, csin) = (self.rope.cos_sin(k, pos) for k in ("main", "compress"))
        streams = h[:, None, :].expand(-1, t.hc_mult, -1).clone()
        pre = h.new_zeros((h.shape[0], t.hc_mult))
        pre[:, 0] = 1.0
        outs = self._round_layers(rd, image, streams, pre, cos, sin, ccos, csin, meta, *erows)
        logits = self._head(outs[0], outs[1]) if head else None
        return (outs[0], outs[1], logits, cos, sin, *outs[2:])

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
        """Append the new compressed ids to each history (DEAD at image rows) and hash the new positions. A round
        (every sequence n rows, no image) hashes all its rows at once (EngramHasher.hash_round)."""
        n = segs[0][1]
        if image is None and len(segs) > 1 and all(sg[1] == n for sg in segs):
            comp = self.hasher.compress(ids).view(len(segs), n)
            before = _history_tails([(st, start) for _, _, start, st in segs], self.hasher.ngram - 1)
            for b, (_, _, start, st) in enumerate(segs):
                st.engram_history = _append_ids(st.engram_history, start, comp[b])
            return self.hasher.hash_round(torch.from_numpy(before), torch.tensor([sg[2] for sg in segs], device="cpu"),
                                          comp)
        out = []
        for (a, n, start, st), s in zip(segs, batch):
            comp = self.hasher.compress(ids[a:a + n])
            if image is not None:
                comp = torch.where(image[a:a + n], torch.full_like(comp, DEAD), comp)
            st.engram_history = _append_ids(st.engram_history, start, comp)
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
                                                  t.candidate_block_size, select=ix.ops.select_topk))
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

    def _prepare_round(self, segs, ids: torch.Tensor | None = None, want: list[int] | None = None,
                       ahead: bool = False) -> _Round | None:
        """The round's per-sequence integers, computed on the host once before the layers (from the states' host
        metadata: lengths, row counts of the compressed KV / index keys / open groups; never from tensor values)
        and sent to the device in one pinned, non-blocking copy: the window gather index, each KV source's group
        rows, each index layer's key counts; with them the round's token ids (column "ids") and the rows that want
        logits (`want`: rd.rows), so nothing else crosses and the host never waits for the GPU. None when the
        sequences bring different row counts (or more rows than the window): the per-sequence loop runs then.
        The arithmetic is numpy over [B, n, ...] arrays written into the one buffer (a torch op on host tensors
        costs microseconds, and a round builds dozens per layer kind). `ahead`: built before the round's ids exist
        (prepare_ahead): the "ids" column is left for send(), and nothing is sent."""
        t = self.t
        W = t.sliding_window
        n = segs[0][1]
        if any(sg[1] != n for sg in segs) or n > W:
            return None
        starts = [sg[2] for sg in segs]
        states = [sg[3] for sg in segs]
        B = len(starts)
        blocks: list[tuple[str, np.ndarray]] = []     # (column name, [B or 1, n or 1, width] int64)

        def col(name, a):
            blocks.append((name, a if a.ndim == 3 else a[..., None]))

        # window: row i of sequence b (position s+i) reads positions s+i-W+1 .. s+i: those before s from its ring
        # (slot p % W, read before the round's writes), the rest from the round's new rows; it writes slot (s+i) % W
        S = np.asarray(starts, dtype=np.int64)[:, None, None]                          # [B, 1, 1]
        j = np.arange(n, dtype=np.int64)
        p = S + j[:, None] - W + 1 + np.arange(W, dtype=np.int64)                      # [B, n, W]
        first = (np.arange(B, dtype=np.int64) * n)[:, None, None]
        rowpos = S[:, :, 0] + j                                                        # [B, n] positions
        col("rsel", np.where(p < S, p % W, -1))
        col("nsel", np.where(p >= S, first + p - S, -1))
        col("pos", p)
        col("wslot", rowpos % W)
        # every layer's ring exists before the round and stays put: its address goes in the table
        D = t.head_dim
        rings = {}
        for blk in self.blocks:
            L = blk.role.index
            rs = rings[L] = [st.windows.get(L) for st in states]
            for b, ring in enumerate(rs):
                if ring is None or not ring.is_contiguous():
                    ring = rs[b] = states[b].windows[L] = (
                        torch.zeros((W, D), device=self.device) if ring is None else ring.contiguous())
            col(f"ring{L}", np.array([ring.data_ptr() for ring in rs], dtype=np.int64)[:, None])
        # replay the layers' publication on the host: groups closed per source, the keys each index layer sees
        pub = [st.published_keys for st in states]
        counts: dict[int, list[int]] = {}        # index-key owner -> per-sequence key count after this round
        srcs, idx = {}, {}
        cand_counts = None
        Di = t.index_head_dim
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
                # row i of a sequence carries its i-th group that may close (at most n of them: (q-1+n)//q <= n),
                # masked (slot -1) when it does not; its entry lands at comp + i
                C = np.asarray(comp, dtype=np.int64)[:, None]                               # [B, 1]
                gb = np.asarray(groups, dtype=np.int64)[:, None]
                col(f"cslot{L}", np.where(j < gb, C + j, -1))
                if q > 1:
                    # group i's members: virtual rows i*q + t of [open group | new rows]; the open rows from the
                    # sequence's partial buffer, the rest from the round's rows
                    P = np.asarray(pend, dtype=np.int64)[:, None, None]                     # [B, 1, 1]
                    v = (j[:, None] * q + np.arange(q, dtype=np.int64))[None]              # [1, n, q]
                    ok = (j < gb)[:, :, None]
                    col(f"psel{L}", np.where(ok & (v < P), v, -1))
                    col(f"gnsel{L}", np.where(ok & (v >= P), first + v - P, -1))
                    col(f"gpos{L}", (C + j) * q)
                    # new row i is virtual row pend + i: it stays open (partial slot pend + i - groups * q) or not
                    vi = P[:, :, 0] + j
                    col(f"pslot{L}", np.where(vi >= gb * q, vi - gb * q, -1))
                srcs[L] = sp
                # the round's appends land in place (no new buffer inside the round): a source's compressed KV has
                # one address per sequence for the whole round, the table's
                gmax = (q - 1 + n) // q
                for st in states:
                    if L not in st.compressed:
                        st.compressed[L] = torch.zeros((0, D), device=self.device)
                        st.index_keys[L] = torch.zeros((0, Di), device=self.device)
                    st.compressed[L] = _reserve_rows(st.compressed[L], gmax)
                    if r.owns_index_keys:
                        st.index_keys[L] = _reserve_rows(st.index_keys[L], gmax)
                    if q > 1:     # the open group: a buffer of q - 1 rows the round reads and writes in place
                        for part in (st.partial_kv, st.partial_gate):
                            rows = part.get(L)
                            rows = torch.zeros((0, D), device=self.device) if rows is None else rows
                            part[L] = _reserve_rows(rows, q - 1 - rows.shape[0])
                col(f"kv{L}", np.array([_addr(st.compressed[L]) for st in states], dtype=np.int64)[:, None])
                if q > 1:
                    col(f"pkv{L}", np.array([_addr(st.partial_kv[L]) for st in states], dtype=np.int64)[:, None])
                    col(f"pgate{L}", np.array([_addr(st.partial_gate[L]) for st in states],
                                              dtype=np.int64)[:, None])
                if r.owns_index_keys:
                    have = [st.index_keys[L].shape[0] if L in st.index_keys else 0 for st in states]
                    counts[L] = [h + g for h, g in zip(have, groups)]
                    col(f"ikeys{L}", np.array([_addr(st.index_keys[L]) for st in states], dtype=np.int64)[:, None])
                    for b, g in enumerate(groups):
                        if self.index_keys == "intended" or g > 0:
                            pub[b] = (L, counts[L][b])
            if r.index_source:
                L = r.index
                owner = [None if pk is None else pk[0] for pk in pub]
                cnt = [0 if pk is None else pk[1] for pk in pub]
                tpad = key_bucket(max(cnt))
                vis = (rowpos + 1) // r.ratio                                                # [B, n]
                crow = np.asarray(cnt, dtype=np.int64)[:, None]                              # [B, 1]
                col(f"limit{L}", np.minimum(vis, crow))
                col(f"kcount{L}", crow)
                # each row's keys: its sequence's publishing owner's index keys (reserved above: no move)
                col(f"ikey{L}", np.array([_addr(states[b].index_keys[o]) if c else 0
                                          for b, (o, c) in enumerate(zip(owner, cnt))], dtype=np.int64)[:, None])
                if r.candidate_source:
                    bs = t.candidate_block_size
                    nw = (vis - 1) // bs
                    col(f"newest{L}", np.where(nw < (crow + bs - 1) // bs, nw, -1))
                    cand_counts = cnt
                elif r.uses_candidates and cand_counts is not None and cand_counts != cnt and any(cand_counts):
                    return None   # keys changed between the candidate source and here: the per-sequence rules
                idx[L] = _RoundIndex(owner=owner, count=cnt, tpad=tpad)
        # every source's compressed KV, index keys and open group take their lengths after the round now (the
        # round writes the rows in place: _compress_round), and the keys' publication is the host's replay above.
        # The reference op set's lists: views with room for every masked group; the open groups' old rows kept for
        # a marked state's rollback (note_group_rows, after the round)
        kvs, ikeys, partials, marked = {}, {}, {}, {}
        for L, sp in srcs.items():
            q, gmax = sp.ratio, (sp.ratio - 1 + n) // sp.ratio
            owns = self.blocks[L].role.owns_index_keys
            grown = functools.partial(_extend_rows, add=gmax)
            kvs[L] = _Views(grown, [st.compressed[L] for st in states])
            ikeys[L] = _Views(grown, [st.index_keys[L] for st in states]) if owns else []
            if q > 1:
                whole = functools.partial(_first_rows, count=q - 1)
                partials[L] = (_Views(whole, [st.partial_kv[L] for st in states]),
                               _Views(whole, [st.partial_gate[L] for st in states]))
                marked[L] = [(b, sp.first[b], st.partial_kv[L].clone(), st.partial_gate[L].clone())
                             for b, st in enumerate(states) if st.undo is not None]

        # (what they were is kept only for a table built ahead: undo() if its round does not come)
        before = [] if ahead else None

        def put(where: dict, key, value):
            if before is not None:
                before.append((where, key, where[key]))
            where[key] = value
        for L, sp in srcs.items():
            q, owns = sp.ratio, self.blocks[L].role.owns_index_keys
            for st, g, pe in zip(states, sp.groups, sp.pend):
                put(st.compressed, L, _extend_rows(st.compressed[L], g))
                if owns:
                    put(st.index_keys, L, _extend_rows(st.index_keys[L], g))
                if q > 1:
                    put(st.partial_kv, L, _first_rows(st.partial_kv[L], (pe + n) % q))
                    put(st.partial_gate, L, _first_rows(st.partial_gate[L], (pe + n) % q))
        for st, pk in zip(states, pub):
            if before is not None:
                before.append((st, "published_keys", st.published_keys))
            st.published_keys = pk
        if ids is not None or ahead:
            col("ids", ids.numpy().reshape(B, n) if ids is not None else np.zeros((B, n), dtype=np.int64))
        # one host buffer (pinned on a GPU: its copy does not wait for the GPU, and the caching host allocator
        # records the copy's event, so the buffer is not handed out again before the copy has read it), one copy
        cols, M = {}, 0
        for name, a in blocks:
            cols[name] = M
            M += a.shape[-1]
        N = B * n
        extra = 0 if want is None else len(want)
        cuda = self.device.type == "cuda"
        host = torch.empty(N * M + extra, dtype=torch.long, device="cpu", pin_memory=cuda)
        flat = host.numpy()
        table = flat[:N * M].reshape(B, n, M)
        for name, a in blocks:
            table[:, :, cols[name]:cols[name] + a.shape[-1]] = a
        if extra:
            flat[N * M:] = want
        rd = _Round(n=n, starts=starts, states=states, meta=None, cols=cols, rings=rings, srcs=srcs, idx=idx,
                    kvs=kvs, ikeys=ikeys, partials=partials, marked=marked, want=want, host=host, before=before)
        if not ahead:
            rd.send(self.device)
        return rd

    def _keys_round(self, blk: Block, rd: _Round, kv, ckv, cgate, iq, iw, trace) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-sequence loop of _history for a round, each step once for all its sequences: the window keys
        in one gather, the ring writes in one _foreach_copy_, the compressor's groups pooled together, one scoring
        of all rows against their own (padded) keys, one top-k; every row gets the bits the loop gives it."""
        r = blk.role
        if blk.compressor is not None:
            self._compress_round(blk, rd, ckv, cgate, rd.meta)
            self._note_groups(r.index, rd, ckv, cgate)
        if blk.indexer is not None:
            rd.topk = self._index_round(blk, rd, iq, iw, trace)
        return self._round_keys(blk, rd, kv, rd.meta, rd.topk if r.ratio else None)

    def _compress_round(self, blk: Block, rd: _Round, kv, gate, meta) -> None:
        """A KV source's compressor for every sequence of the round, through the round's tables: row i of a
        sequence pools its i-th group that may close (its members from the open group's buffer and the round's rows;
        masked when it does not close), writes the entry (and index key) at the sequence's next row, and the new
        rows that stay open go to the open group's buffer (read before: the members). Ratio 1: every row is its own
        group. Group by group the bits _compress gives each sequence alone (pool, norm, RoPE, quant are row-wise);
        the lengths were set by _prepare_round."""
        comp, r = blk.compressor, blk.role
        L, c, q, n = r.index, rd.cols, r.ratio, rd.n
        if q == 1:
            latent = comp.ops.rms_norm(kv, comp.norm, comp.eps)
            gpos = meta[:, c["pos"] + self.t.sliding_window - 1]          # each row's own position
        else:
            psel, nsel = meta[:, c[f"psel{L}"]:c[f"psel{L}"] + q], meta[:, c[f"gnsel{L}"]:c[f"gnsel{L}"] + q]
            pkv, pgate = rd.partials[L]
            take, at = (nsel >= 0)[:, :, None], nsel.clamp(min=0)
            rows_kv = torch.where(take, kv[at], self.ops.gather_round(pkv, psel, n, meta[:, c[f"pkv{L}"]]))
            rows_gate = torch.where(take, gate[at], self.ops.gather_round(pgate, psel, n, meta[:, c[f"pgate{L}"]]))
            latent = comp.pool(rows_kv, rows_gate)
            gpos = meta[:, c[f"gpos{L}"]]
            pslot = meta[:, c[f"pslot{L}"]]
            self.ops.ring_write(pkv, kv, pslot, n, meta[:, c[f"pkv{L}"]])
            self.ops.ring_write(pgate, gate, pslot, n, meta[:, c[f"pgate{L}"]])
        slot = meta[:, c[f"cslot{L}"]]
        gcs = self.rope.cos_sin("compress", gpos)              # the keys' and the entries' (one computation)
        self.ops.ring_write(rd.kvs[L], self._entries(latent, *gcs), slot, n, meta[:, c[f"kv{L}"]])
        if r.owns_index_keys:
            self.ops.ring_write(rd.ikeys[L], blk.indexer.keys(latent, *gcs, self.qat), slot, n,
                                meta[:, c[f"ikeys{L}"]])

    def _note_groups(self, L: int, rd: _Round, kv, gate) -> None:
        """A marked state's rows of a ratio > 1 source this round (its open group before, then its new rows), for a
        rollback to reopen the groups the round closed (SeqState.note_group_rows); host work for drafts only."""
        n = rd.n
        for b, first, okv, ogate in rd.marked.get(L, ()):
            rd.states[b].note_group_rows(L, first, torch.cat([okv, kv[b * n:(b + 1) * n]]),
                                         torch.cat([ogate, gate[b * n:(b + 1) * n]]))

    def _round_keys(self, blk: Block, rd: _Round, kv, meta, topk) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's key set [N, K, D] and its validity: the W window keys (the rows before the round from the
        rings through the round's address table, the rest from kv), then (topk given) the top-k compressed entries
        of the layer's KV source through the round's table of the sources' buffers (Ops.round_keys: one launch on
        the kernels' op set); then the new rows written into the rings (after the reads: a verify round's later
        rows overwrite slots its earlier rows still read). No per-sequence work (the reference op set's functions
        loop over rd.rings). meta: the round's [rows, M] metadata (a CUDA graph's padded copy)."""
        W, L, c = self.t.sliding_window, blk.role.index, rd.cols
        table = meta[:, c[f"ring{L}"]]
        src = blk.role.kv_source
        keys = self.ops.round_keys(rd.rings[L], table, meta[:, c["rsel"]:c["rsel"] + W],
                                   meta[:, c["nsel"]:c["nsel"] + W], kv, meta[:, c["pos"]:c["pos"] + W], rd.n,
                                   *((rd.kvs[src], meta[:, c[f"kv{src}"]], topk) if topk is not None else ()))
        self.ops.ring_write(rd.rings[L], kv, meta[:, c["wslot"]], rd.n, table)
        return keys

    def one_piece(self, blk: Block) -> bool:
        """Whether a round runs this layer as one piece (`_layer_round`, one CUDA graph): one rank, and a history
        that reads and writes only through the round's tables (every layer kind: window-only, KV sources with their
        masked groups, reuse, re-index). With tensor parallelism the layer splits at the reductions instead."""
        return self.comm.world == 1

    def _layer_round(self, blk: Block, rd: _Round, image, trace, streams, pre, cos, sin, ccos, csin, meta,
                     topk) -> tuple:
        """A whole layer of a round whose history has shapes fixed by the row count (and a re-index layer's key
        bucket): _attn_in, the window keys through the round's tables, the compressed keys of the latest top-k
        (`topk`), or of this layer's own top-k (a re-index layer: `topk` holds the candidate mask then), and
        _attn_out_ffn -> (streams, pre, this layer's top-k or None). Its arguments are all row-first, so it is one
        CUDA graph per layer and row bucket; the ring writes make it run once per call (graphs.py `dry`)."""
        pre_a, post_a, comb_a, q, kv, ckv, cgate, iq, iw = self._attn_in(blk, streams, pre, cos, sin, ccos, csin)
        own = cand = None
        if blk.compressor is not None:
            self._compress_round(blk, rd, ckv, cgate, meta)
        if blk.indexer is not None:
            own = topk = self._index_round(blk, rd, iq, iw, trace, meta, cand=topk)
            cand = rd.cand if blk.role.candidate_source else None
        keys, sel = self._round_keys(blk, rd, kv, meta, topk if blk.role.ratio else None)
        grouped = blk.compressor is not None and blk.role.ratio > 1     # its rows: a marked state's rollback
        return (*self._attn_out_ffn(blk, q, keys, sel, cos, sin, streams, pre_a, post_a, comb_a, image=image), own,
                cand, ckv if grouped else None, cgate if grouped else None)

    @staticmethod
    def _dry_layer(cols: list[int], at: int, args: tuple) -> tuple:
        """A piece's arguments with every write masked (the ring, compressed and open-group slot columns of the
        metadata args[at] set to -1): a capture's extra runs."""
        meta = args[at].clone()
        meta[:, cols] = -1
        return args[:at] + (meta,) + args[at + 1:]

    def whole_round(self) -> bool:
        """Whether a round runs all its layers as one piece (`_round_layers`): one rank, and every layer finds what
        it reads from earlier layers in every round (a layer reusing a top-k comes after an index layer)."""
        seen = False
        for blk in self.blocks:
            if blk.role.ratio and blk.indexer is None and not seen:
                return False
            seen = seen or blk.indexer is not None
        return self.comm.world == 1

    def _round_layers(self, rd: _Round, image, streams, pre, cos, sin, ccos, csin, meta, *erows) -> tuple:
        """Every layer of a round in order (`_layer_round` each, the Engram layers' table entries `erows` read
        before the round) -> (streams, pre, the DSpark taps, each ratio > 1 source's rows (a marked state's
        rollback)): one piece, so one CUDA graph per row bucket and index key buckets."""
        t = self.t
        taps = [None] * len(t.dspark_target_layer_ids)
        topk = cand = None
        notes, e = [], iter(erows)
        for blk in self.blocks:
            r = blk.role
            if blk.engram is not None:
                streams = blk.engram.apply(streams, next(e), image)
            if r.dspark_tap is not None:
                taps[r.dspark_tap] = _stream_mean(streams)
            c, s_ = (cos, sin) if r.rope == "main" else (ccos, csin)
            arg = cand if blk.indexer is not None and r.uses_candidates else None if blk.indexer is not None else topk
            streams, pre, own, new_cand, ckv, cgate = self._layer_round(blk, rd, image, None, streams, pre, c, s_,
                                                                         ccos, csin, meta, arg)
            topk = own if own is not None else topk
            cand = new_cand if new_cand is not None else cand
            if ckv is not None:
                notes += [ckv, cgate]
        return (streams, pre, *taps, *notes)

    def _index_round(self, blk: Block, rd: _Round, q, w, trace, meta=None, cand=None) -> torch.Tensor:
        """_index for every sequence of the round: each row against its sequence's keys (through the round's table)
        in scores of the round's bucketed width, the candidate mask or (re-index) the candidates `cand`, one top-k;
        shapes fixed by the row count and the width. meta: the round's metadata (a graph's padded copy)."""
        t, r, ix = self.t, blk.role, blk.indexer
        ip = rd.idx[r.index]
        L, c = r.index, rd.cols
        meta = rd.meta if meta is None else meta
        n, B = rd.n, len(rd.states)
        if ip.tpad == 0:
            topk = torch.full((q.shape[0], t.index_topk), -1, dtype=torch.long, device=q.device)
        else:
            none = q.new_zeros((0, t.index_head_dim))
            keys = [st.index_keys[owner][:k] if k else none for st, owner, k in zip(rd.states, ip.owner, ip.count)]
            scores = ix.round_scores(q, w, keys, ip.tpad, meta[:, c[f"limit{L}"]], meta[:, c[f"kcount{L}"]],
                                     table=meta[:, c[f"ikey{L}"]], n=n)
            if r.candidate_source:
                rd.cand = candidate_blocks(scores, None, r.ratio, t.candidate_topk_blocks, t.candidate_block_size,
                                           newest=meta[:, c[f"newest{L}"]], select=ix.ops.select_topk)
                if trace is not None:
                    for b, k in enumerate(ip.count):
                        if k:
                            trace.setdefault(f"candidates.layer{r.index}", []).append(
                                rd.cand[b * n:(b + 1) * n, :k])
            elif r.uses_candidates and (cand if cand is not None else rd.cand) is not None:
                scores = scores.masked_fill(~(cand if cand is not None else rd.cand), float("-inf"))
            topk = ix.ops.select_topk(scores, t.index_topk)
        if trace is not None:
            for b in range(B):
                trace.setdefault(f"topk.layer{r.index}", []).append(topk[b * n:(b + 1) * n])
        return topk


def key_bucket(count: int) -> int:
    """The width of a round's index scores for `count` keys: KEY_TILE times the next 2^k or 3 * 2^(k-1) (a third
    wider at most), so a layer's CUDA graphs are few as the context grows; the extra columns score -inf, which
    changes no pick (select_topk, candidate_blocks)."""
    tiles = -(-count // KEY_TILE)
    if tiles <= 2:
        return tiles * KEY_TILE
    p = 1 << (tiles - 1).bit_length()          # the next power of two >= tiles
    return (p * 3 // 4 if tiles <= p * 3 // 4 else p) * KEY_TILE


def _append_rows(rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """rows then new (dim 0), without copying rows when the buffer they are the start of has room. A long prompt's
    compressed KV and index keys would otherwise be copied whole once per chunk (O(T^2) bytes over a 1M prompt). The
    buffer grows by a quarter (the memory plan's margin) and is reached only through views of its first rows, so a
    rollback's shorter view, a snapshot's clone and this forward's published view all stay correct."""
    out, dst = _grow_rows(rows, new.shape[0])
    dst.copy_(new)
    return out


def _wanted(a: int, n: int, logits: str) -> Sequence[int]:
    """The rows that want logits of an input of n rows at row offset a (SeqInput.logits: "all", "last", "none")."""
    return range(a, a + n) if logits == "all" else [a + n - 1] if logits == "last" else ()


def _history_tails(items: list[tuple[SeqState, int]], k: int) -> np.ndarray:
    """[B, k] int64: each (state, start)'s compressed ids of positions start-k .. start-1 from its Engram history,
    DEAD before position 0 (hash_round's `before`)."""
    before = np.full((len(items), k), DEAD, dtype=np.int64)
    for b, (st, start) in enumerate(items):
        m = min(k, start)
        before[b, k - m:] = st.engram_history.numpy()[start - m:start]
    return before


def _append_ids(history: torch.Tensor, start: int, new: torch.Tensor) -> torch.Tensor:
    """history[:start] then new (1-D), in place in history's buffer when it has room (as _append_rows: a decode round
    would otherwise copy a sequence's whole Engram history, 8 bytes a position)."""
    return _append_rows(history[:start].view(-1, 1), new.view(-1, 1)).view(-1)


def _addr(rows: torch.Tensor) -> int:
    """The address of rows' first row, also when it has none yet (a buffer reserved for this round's appends:
    data_ptr() of an empty tensor is 0)."""
    return rows.untyped_storage().data_ptr() + rows.storage_offset() * rows.element_size()


def _reserve_rows(rows: torch.Tensor, g: int) -> torch.Tensor:
    """rows itself when its buffer has room for g more rows after it, else rows copied into a larger buffer (a
    quarter more, as _append_rows grows): a round reserves its appends before it starts, so the addresses in its
    table hold for the whole round. No new tensor in the common case (a round reserves for every sequence)."""
    n, d = rows.shape
    cap = 0
    if rows.is_contiguous() and rows.storage_offset() == 0:
        cap = rows.untyped_storage().nbytes() // (rows.element_size() * d)
    if n + g <= cap:
        return rows
    buf = rows.new_empty(((n + g) * 5 // 4 + 16, d))
    buf[:n] = rows
    return buf[:n]


def _extend_rows(rows: torch.Tensor, add: int) -> torch.Tensor:
    """rows and the `add` rows after them in its buffer (reserved: _reserve_rows), the new ones to be written."""
    return _first_rows(rows, rows.shape[0] + add)


def _first_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` rows of the buffer rows starts (reserved: _reserve_rows)."""
    d = rows.shape[1]
    return rows.as_strided((count, d), (d, 1), 0)


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
