"""Which function computes each op of the forward: the op set, a value chosen once when the model loads.

`Model.load` picks it from the device, the kernels present and the config (docs/gpu.md "Which function computes each
op"), stores it as `model.ops`, and gives it to every block it builds (Attention, MoE, Compressor, Indexer, Engram,
the mHC sites, the DSpark stages); the blocks call it. Nothing inside the math asks a global or the environment which
implementation to run.

- `reference_ops()`: the CPU float32 reference, the definition of the math: products in ROW_TILE-row tiles
  (linear.tiled), torch's row sums, the torch forms of every op. FP8/FP4/EXL3 weights kept in checkpoint form
  (`Model.load(keep_quant=True)`) are dequantised per product: the same bits (dequantisation is exact).
- `cuda_ops(kernels=True)`: the CUDA path: products in fixed CUDA_ROW_TILE-row tiles (one shape for cuBLAS), row sums
  as a fixed pairwise tree (a CUDA reduction's order depends on the row count), and the kernels of `kernels/` where
  they are present (imported when the op set is built), else the same torch fallbacks; `kernels=False`: the
  fallbacks only (DSV41_KERNELS=0). On a CPU machine the same functions run on CPU tensors, the Triton kernels under
  TRITON_INTERPRET=1 (tests and benches).
- `ops.with_exl3()`: what an EXL3 pack adds at load: the fused EXL3 kernels for its packed linears and stacked
  experts when the op set runs kernels (without them the float32 reference decode runs).

Weights are data (device.Fp8Weight / Fp4Weight / ExpertStack, exl3_load.Exl3Packed / Exl3ExpertStack); `Ops.linear`
and `Ops.routed` dispatch on their type.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv41.model import linear as L
from dsv41.model.device import CUDA_ROW_TILE, ExpertStack, Fp4Weight, Fp8Weight, FusedWeight, address_table, fuse_rows
from dsv41.model.exl3_load import Exl3Packed
from kernels.numerics import inv_count, tree_row_sum


@dataclass(frozen=True)
class Ops:
    """One implementation of every op. Fields are functions (see the factories for which); `linear`, `routed` and
    `tiled` are the methods the blocks call with a weight / stack of any kind."""
    name: str                      # "reference", "cuda", "cuda-fallbacks" (+ "+exl3")
    row_tile: int                  # rows of every product tile (linear.tiled)
    dense_linear: Callable         # (x [n, in], w float [out, in]) -> [n, out]
    fp8_linear: Callable           # (x, device.Fp8Weight) -> float32 [n, out]
    grouped_linear: Callable       # (ops, x [n, G * in], w [G * rows, in] of any kind, G) -> [n, G * rows]: group g's
    #                                rows times x's group g columns (wo_a)
    fp4_linear: Callable           # (x, device.Fp4Weight) -> float32 [n, out]
    exl3_linear: Callable          # (x, exl3_load.Exl3Packed) -> float32 [n, out]
    row_sum: Callable              # (x) -> Σ over the last dim, keepdim
    row_mean: Callable             # (x) -> mean over the last dim, keepdim
    rms_norm: Callable             # (x, weight | None, eps) -> float32, the shape of x
    sinkhorn: Callable             # (comb [n, hc, hc], iters, eps) -> comb (mhc.sinkhorn)
    hc_mix: Callable               # (mixes m [n, (2 + hc) * hc], scale [3], base, hc, iters, eps) -> (pre, post,
    #                                comb): an mHC site's mixes after its hc_fn product (mhc.hc_mix)
    hc_collapse: Callable          # (streams [n, hc, H], pre [n, hc]) -> [n, H]
    hc_expand: Callable            # (y [n, H], residual [n, hc, H], post [n, hc], comb [n, hc, hc]) -> [n, hc, H]
    route_weights: Callable        # (scores [n, E], ids [n, k], scaling) -> [n, k] (moe.route_weights)
    index_scores: Callable         # (q [n, h, d], w [n, h], keys [T, d], scale) -> [n, T], no visibility mask
    round_scores: Callable         # (q [B*n, h, d], w, keys: B x [T_b, d], tpad, counts [B] | None, scale,
    #                                n=None, table=None) -> [B*n, tpad], no visibility mask; with table (each row's
    #                                keys' address [rows]) counts are per row and rows past B*n pad as row 0
    gather_round: Callable         # (srcs: B x [*, D], idx [B*n, K] (-1: a zero-weight row), n, table [rows] | None)
    #                                -> [rows, K, D]; table: row r's source address (rows >= B*n: padded, as row 0)
    ring_write: Callable           # (rings: B x [W, D], rows [rows, D], slots [rows], n, table [rows] | None): row r
    #                                into slot slots[r] of its sequence's ring (B*n real rows; the rest pad as row 0)
    sparse_attend: Callable        # (ops, q [n, h, D], pool [P, D], idx [n, K] (-1 masked), sink [h], scale)
    #                                -> [n, h, D]
    swiglu_h: Callable             # (gate, up, limit) -> silu(min(gate, limit)) * clamp(up, ±limit) (moe.swiglu_h)
    rope_: Callable                # (x [n, (heads,) D] float32, cos, sin, inverse) -> x rotated in place
    #                                (rope.apply_rope_)
    cos_sin: Callable              # (positions [n], inv_freq [d]) -> (cos, sin) [n, d] (rope.cos_sin)
    fp8_fake_quant: Callable       # (x, block) -> x's FP8 quantise-dequantise (quant.fp8_fake_quant: QAT's KV)
    fp4_fake_quant_ue8m0: Callable  # (x, block) -> x's FP4 round trip, power-of-two scales (the indexer's q, keys)
    fp4_fake_quant_e4m3: Callable   # (x, block) -> x's FP4 round trip, E4M3 scales (the compressed KV entries)
    router_scores: Callable        # (logits [n, E], temp, bias [E], bias_vl [E], image [n] bool | None) ->
    #                                (s [n, E], s + bias by row) (moe.router_scores)
    router_topk: Callable          # (scores [n, E], k) -> (values [n, k], ids [n, k] int64): the router's pick,
    #                                value descending, ties to the lower id (linear.stable_topk)
    select_topk: Callable          # (scores [n, T], k) -> [n, k] int64: the indexer's top-k finite entries in
    #                                ascending index order, -1 padded (indexer.select_topk)
    pool_norm: Callable | None = None     # (kv, gate [g, r, D], norm weight, eps) -> latents [g, D] or None where it
    #                                       does not apply: Compressor.pool in one launch; None: its torch ops
    route_fn: Callable | None = None      # (logits [n, E], temp, bias, bias_vl, image, k, scaling) -> (weights, ids)
    #                                       or None where it does not apply: MoE.route after the gate in one launch
    #                                       (router_scores, router_topk, route_weights); None: the three
    hc_pre: Callable | None = None        # (streams [n, hc, H], hc_fn [NM, hc * H], eps) -> the mixes m [n, NM] or None
    #                                       where it does not apply; None: rms_norm then linear (mhc.hc_mixes)
    hc_site_mixes: Callable | None = None  # (streams, hc_fn, scale, base, hc, iters, hc_eps, norm_eps) -> (pre, post,
    #                                        comb) or None where it does not apply: hc_pre and hc_mix in one launch
    hc_site_in: Callable | None = None    # (y | (y0, y1) | None, streams, post, comb, pre, weight, eps) -> (streams',
    #                                       x) or None where it does not apply: a site's input, collapse_norm /
    #                                       expand_collapse_norm in one launch; None: the ops one by one
    fp4_routed: Callable | None = None    # (ExpertStack, x, weights, ids, limit, shard) -> [n, H]; None: per expert
    fp4_routed_shards: Callable | None = None   # (ExpertStack with .shard, x, weights, ids, limit, shards,
    #                                             addends=None) -> [S, n, H]: each TP shard's slot sum from one
    #                                             grouped pass (addends, two shards: their total with each shard's
    #                                             addend, [n, H] or None where not taken); None: shard by shard
    exl3_routed: Callable | None = None   # (Exl3ExpertStack, x, weights, ids, limit, grouped) -> [n, H]; None: per
    #                                       expert
    exl3_grouped: Callable | None = None  # (x [G, M, in], Exl3Weight stack, ids [G], rows [G]) -> [G, M, out]: the
    #                                       grouped EXL3 kernel exl3_routed runs (CUDA C or Triton)
    norm_rope_quant_fn: Callable | None = None   # (x, weight | None, eps, cos, sin, inverse, quant) -> a new
    #                                              tensor or None where it does not apply: norm_rope_quant in one
    #                                              launch; None: the ops one by one
    round_keys_fn: Callable | None = None   # (ring_table, rsel, nsel, kv, pos, comp_table | None, topk | None) ->
    #                                         (keys, valid): Ops.round_keys in one launch; None: its ops
    sparse_attend_rows: Callable | None = None   # (ops, q, keys [n, K, D], valid [n, K] bool, sink, scale) ->
    #                                              [n, h, D] or None: the gathered form in one launch (no index
    #                                              tensor); None: as indices into the keys (Ops.attend_rows)
    fuse_linears: Callable | None = None   # (weights that take one input) -> device.FusedWeight | None: their rows
    #                                        concatenated for one launch; None: products one by one (the reference)
    fuse_parts: Callable | None = None     # (w, outs) -> FusedWeight over w itself (its rows already the parts, in
    #                                        order: no copy) | None, where the op set computes them in one launch
    fused_linear: Callable | None = None   # (x, FusedWeight) -> [each weight's float32 [n, out_i]]
    cat_linear: Callable | None = None     # (ops, x, [weights]) -> float32 [n, Σ out_i]: the products side by side in
    #                                        one result; None: torch.cat of the linears
    stacks_experts: bool = False   # Model.load stacks each layer's kept experts (the grouped kernels' layout)
    graphs: bool = True            # a round's row-only pieces may become CUDA graphs (no host sync inside them)
    kernels: tuple[str, ...] = ()  # the kernels/ functions this op set runs (reports; empty: torch only)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """y = x · wᵀ for x [n, in] and a weight [out, in] of any kind (float tensor, FP8, FP4, EXL3 codes)."""
        if isinstance(w, torch.Tensor):
            return self.dense_linear(x, w)
        if isinstance(w, Fp8Weight):
            return self.fp8_linear(x, w)
        if isinstance(w, Fp4Weight):
            return self.fp4_linear(x, w)
        if isinstance(w, Exl3Packed):
            return self.exl3_linear(x, w)
        raise TypeError(f"no linear for a weight of type {type(w).__name__}")

    def fuse(self, weights: list) -> FusedWeight | None:
        """Weights that take the same input, as one FusedWeight (their rows concatenated: a load-time copy; the
        caller then holds its `part` views) where this op set computes them in one launch with each product's
        bits as its own launch has them; else None (the products run one by one)."""
        return None if self.fuse_linears is None else self.fuse_linears(weights)

    def linear_parts(self, x: torch.Tensor, w: FusedWeight) -> list[torch.Tensor]:
        """x times each weight of a FusedWeight, in one launch: [n, out_i] each, bitwise `linear(x, part i)`."""
        return self.fused_linear(x, w)

    def linear_cat(self, x: torch.Tensor, ws: list) -> torch.Tensor:
        """x times each weight, side by side: bitwise torch.cat([linear(x, w) for w in ws], dim=1), written into one
        result where the op set can (the TP shards' wq_b products: no cat of a [rows, 32768] q)."""
        if self.cat_linear is not None:
            return self.cat_linear(self, x, ws)
        return torch.cat([self.linear(x, w) for w in ws], dim=1)

    def grouped(self, x: torch.Tensor, w, groups: int) -> torch.Tensor:
        """The block-diagonal product of a grouped projection (wo_a): group g's weight rows times x's group g
        columns, concatenated -> [n, groups * rows]."""
        return self.grouped_linear(self, x, w, groups)

    def routed(self, stack, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float,
               shard: range | None = None) -> torch.Tensor | None:
        """Σ over slots (slot order) of a layer's stacked routed experts' outputs in one grouped launch, only the
        experts within `shard` (a TP shard's global ids) when given; None when this op set has no grouped
        implementation for the stack (the caller, MoE._routed, runs the experts one by one)."""
        if isinstance(stack, ExpertStack):
            f = self.fp4_routed
            return None if f is None else f(stack, x, weights, ids, limit, shard)
        f = self.exl3_routed
        return None if f is None or shard is not None else f(stack, x, weights, ids, limit, self.exl3_grouped)

    def routed_shards(self, stack, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float,
                      shards: int) -> torch.Tensor | None:
        """Each of `shards` TP shards' `routed` sum ([shards, n, H]; shard s = stack.shard's s) from ONE grouped pass
        over all the pairs, the same bits as `routed` shard by shard; None where this op set has no such pass for
        the stack (an EXL3 stack, no shard table, no kernel: MoE runs the shards one by one)."""
        f = self.fp4_routed_shards
        if f is None or not isinstance(stack, ExpertStack) or stack.shard is None:
            return None
        return f(stack, x, weights, ids, limit, shards)

    def routed_total(self, stack, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float,
                     addends: list) -> torch.Tensor | None:
        """Σ over the TP shards, in order, of (routed_shards' shard s + addends[s]) (an addend None: nothing) in the
        same grouped pass, [n, H]: MoE.__call__'s sum of its shards' parts, the same additions; None where this op
        set has no such pass (then routed_shards, or shard by shard)."""
        f = self.fp4_routed_shards
        if f is None or not isinstance(stack, ExpertStack) or stack.shard is None or len(addends) != 2:
            return None
        return f(stack, x, weights, ids, limit, 2, addends=tuple(addends))

    def attend(self, q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Each row's heads over its own key set (K = V), the per-head sink in the softmax denominator only
        (Attention.attend; arch.md §2.6): row r's keys are pool[idx[r, j]] in j's order, -1 a masked slot."""
        return self.sparse_attend(self, q, pool, idx, sink, scale)

    def collapse_norm(self, streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None,
                      eps: float) -> torch.Tensor:
        """An mHC site's input: rms_norm(hc_collapse(streams, pre), weight, eps), in one launch where the op set
        can (the same bits)."""
        got = None if self.hc_site_in is None else self.hc_site_in(None, streams, None, None, pre, weight, eps)
        return got[1] if got is not None else self.rms_norm(self.hc_collapse(streams, pre), weight, eps)

    def expand_collapse_norm(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                             pre: torch.Tensor, weight: torch.Tensor | None,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous site's output into the streams, then the next site's input: (streams = hc_expand(y,
        residual, post, comb), collapse_norm(streams, pre, weight, eps)), in one launch where the op set can. y may
        be a tuple of partials (the TP shards' wo_b products), added in order first (in that launch too)."""
        got = None if self.hc_site_in is None else self.hc_site_in(y, residual, post, comb, pre, weight, eps)
        if got is not None:
            return got
        streams = self.hc_expand(shard_sum(y) if isinstance(y, tuple) else y, residual, post, comb)
        return streams, self.rms_norm(self.hc_collapse(streams, pre), weight, eps)

    def norm_rope_quant(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, quant: str | None, own: bool, inverse: bool = False) -> torch.Tensor:
        """A vector's last steps before it is stored or scored: rms_norm (where `weight` is given), RoPE on its last
        2·d dims, QAT's fake-quant (`quant`: "fp8" -- the window KV --, "fp4_ue8m0" -- the indexer's q and keys --,
        "fp4_e4m3" -- the compressed entries --, or None). own: the caller's own x, which may be rotated in place
        (else it is left as it is). In one launch where the op set can, the same bits."""
        f = self.norm_rope_quant_fn
        got = None if f is None else f(x, weight, eps, cos, sin, inverse, quant)
        if got is not None:
            return got
        y = self.rms_norm(x, weight, eps) if weight is not None else x if own else x.clone()
        y = self.rope_(y, cos, sin, inverse)
        if quant == "fp8":
            return self.fp8_fake_quant(y, 32)
        if quant == "fp4_ue8m0":
            return self.fp4_fake_quant_ue8m0(y, 32)
        if quant == "fp4_e4m3":
            return self.fp4_fake_quant_e4m3(y, 16)
        if quant is not None:
            raise ValueError(f"norm_rope_quant: no fake-quant {quant!r}")
        return y

    def round_keys(self, rings: list, ring_table: torch.Tensor, rsel: torch.Tensor, nsel: torch.Tensor,
                   kv: torch.Tensor, pos: torch.Tensor, n: int, comps: list | None = None,
                   comp_table: torch.Tensor | None = None,
                   topk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode round's key sets (attention's gathered form): row r's W window keys -- the round's own rows
        kv[nsel] where nsel >= 0, else its sequence's ring (rings / ring_table[r]) at rsel -- then (topk [N, T]
        given) its compressed entries (comps / comp_table[r]) at topk; -1 picks a zero row -> (keys [N, W + T, D],
        valid [N, W + T]: pos >= 0, then topk >= 0). In one launch where the op set can (a copy either way)."""
        f = self.round_keys_fn
        if f is not None and ring_table is not None and (topk is None or comp_table is not None):
            got = f(ring_table, rsel, nsel, kv, pos, comp_table, topk)
            if got is not None:
                return got
        old = self.gather_round(rings, rsel, n, ring_table)
        keys = torch.where((nsel >= 0)[:, :, None], kv[nsel.clamp(min=0)], old)
        valid = pos >= 0
        if topk is None:
            return keys, valid
        ckeys = self.gather_round(comps, topk, n, comp_table)
        return torch.cat([keys, ckeys], dim=1), torch.cat([valid, topk >= 0], dim=1)

    def attend_rows(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
        """attend with each row's keys held row by row (a decode round's gathered keys [n, K, D], valid [n, K]
        bool): in one launch where the op set reads them so, else as indices r·K + j into them (-1 where not
        valid)."""
        f = self.sparse_attend_rows
        out = None if f is None else f(self, q, keys, valid, sink, scale)
        if out is not None:
            return out
        n, K, D = keys.shape
        slots = torch.arange(n * K, device=keys.device).view(n, K)
        return self.attend(q, keys.reshape(n * K, D), torch.where(valid, slots, -1), sink, scale)

    def tiled(self, fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        """linear.tiled in this op set's row tile."""
        return L.tiled(fn, *xs, rows=self.row_tile)

    def with_exact_index_inputs(self) -> Ops:
        """This op set for a model whose indexer q and keys are exact in TF32 (QAT: FP4 values times powers of two,
        Model.load's qat=True): the index-score kernels' products in one TF32 pass instead of three, the same bits
        for such inputs (kernels/indexer.py). The same op set where it runs no index-score kernel."""
        return _with_exact_index_inputs(self) if "index_scores" in self.kernels else self

    def with_exl3(self) -> Ops:
        """This op set for a model with EXL3 codes: the fused EXL3 kernels (kernels/exl3.py) for its packed linears
        and stacked experts when this op set runs kernels and they import -- the CUDA C kernel (csrc/exl3.cu) where
        it runs on the current device, else the Triton one; else the same op set (the reference decode runs). One
        value per op set and device (built on first use)."""
        cuda = self.kernels and torch.cuda.is_available() and _exl3_cuda_runs(torch.cuda.current_device())
        return _with_exl3(self, bool(cuda))


@functools.cache
def _exl3_cuda_runs(device: int) -> bool:
    try:
        from kernels.exl3 import cuda_available
    except Exception:  # noqa: BLE001 - Triton absent
        return False
    return cuda_available(device)


@functools.cache
def _with_exact_index_inputs(ops: Ops) -> Ops:
    from kernels import indexer
    table = (functools.partial(indexer.index_scores_table, one_pass=True) if "index_scores_table" in ops.kernels
             else None)
    scores, round_scores = _cuda_index_ops(functools.partial(indexer.index_scores, one_pass=True), table,
                                           ops.row_tile)
    return dataclasses.replace(ops, name=ops.name + "+tf32-index", index_scores=scores, round_scores=round_scores)


@functools.cache
def _with_exl3(ops: Ops, cuda: bool) -> Ops:
    if not ops.kernels or "exl3_linear" in ops.kernels:
        return ops
    try:
        from kernels.exl3 import exl3_grouped, exl3_grouped_cuda, exl3_linear_cuda, exl3_linear_triton
    except Exception:  # noqa: BLE001 - Triton absent: the float32 reference decode runs
        return ops
    from dsv41.model.exl3_load import exl3_routed
    # the CUDA C kernel: one launch per linear or expert stack (both Hadamards, decode, split-K sum inside)
    linear, grouped = (exl3_linear_cuda, exl3_grouped_cuda) if cuda else (exl3_linear_triton, exl3_grouped)
    return dataclasses.replace(ops, name=ops.name + "+exl3", exl3_linear=_exl3_kernel_linear(linear),
                               exl3_routed=exl3_routed, exl3_grouped=grouped,
                               kernels=ops.kernels + ("exl3_linear", "exl3_grouped") + (("exl3_cuda",) if cuda else ()))


def ops_for(device: torch.device | str, kernels: bool = True) -> Ops:
    """The op set Model.load picks when it is not given one: the CPU reference on the CPU, the CUDA path on CUDA
    (its kernels unless kernels=False)."""
    return cuda_ops(kernels) if torch.device(device).type == "cuda" else reference_ops()


# ---- the reference (CPU float32) -------------------------------------------------------------------------------

@functools.cache
def reference_ops() -> Ops:
    """The CPU float32 reference: exactly the functions the model defines (the bitwise tests' path)."""
    from dsv41.model import mhc, moe, quant
    from dsv41.model.indexer import select_topk
    from dsv41.model.rope import apply_rope_, cos_sin
    rows = L.ROW_TILE
    dense = _dense_linear(rows)
    return Ops(name="reference", row_tile=rows, dense_linear=dense, fp8_linear=_dequant_linear(dense),
               grouped_linear=_grouped_linear,
               fp4_linear=_dequant_linear(dense), exl3_linear=_exl3_reference_linear(rows),
               row_sum=L.row_sum, row_mean=L.row_mean, rms_norm=L.rms_norm, sinkhorn=mhc.sinkhorn,
               hc_mix=mhc.hc_mix,
               hc_collapse=mhc.hc_collapse, hc_expand=mhc.hc_expand, route_weights=moe.route_weights,
               index_scores=functools.partial(_index_scores_tiled, rows=rows),
               round_scores=functools.partial(_round_scores_padded, rows=rows), gather_round=gather_round,
               ring_write=ring_write, sparse_attend=attend_tiled, swiglu_h=moe.swiglu_h, rope_=apply_rope_,
               cos_sin=cos_sin,
               fp8_fake_quant=quant.fp8_fake_quant, fp4_fake_quant_ue8m0=quant.fp4_fake_quant_ue8m0,
               fp4_fake_quant_e4m3=quant.fp4_fake_quant_e4m3, router_scores=moe.router_scores, router_topk=L.stable_topk,
               select_topk=select_topk)


# ---- the CUDA path -------------------------------------------------------------------------------------------

def cuda_ops(kernels: bool = True) -> Ops:
    """The CUDA path's functions: fixed CUDA_ROW_TILE-row product tiles, tree row sums, and (kernels=True) the
    kernels of kernels/ that import here, once; the torch fallbacks where one is absent (or kernels=False). One
    value per setting (built on first use)."""
    return _cuda_ops(bool(kernels))


@functools.cache
def _cuda_ops(kernels: bool) -> Ops:
    from dsv41.model import mhc, moe, quant
    from dsv41.model.indexer import select_topk
    from dsv41.model.rope import apply_rope_, cos_sin
    rows = CUDA_ROW_TILE
    dense = _dense_linear(rows)
    k = _load_kernels() if kernels else {}
    index_scores, round_scores = _cuda_index_ops(k.get("index_scores"), k.get("index_scores_table"), rows)
    fp8 = _dequant_linear(dense)
    grouped = _grouped_linear
    fuse = fused = cat = fuse_parts = None
    if "fp8_linear" in k:
        fp8 = _kernel_fp8_linear(k["fp8_linear"])
        grouped = _kernel_grouped_linear(k["fp8_linear_grouped"], fp8)
        fuse, fused = _kernel_fuse(k["multi_config"]), _kernel_fused_linear(k["fp8_linear_multi"])
        fuse_parts = _kernel_fuse_parts(k["multi_config"])
        if "prompt_fp8_linear" in k:
            fp8, grouped, fused, cat = _prompt_fp8_linear(k["prompt_fp8_linear"], fp8, grouped, fused)
    kdense = _kernel_dense_linear(k["bf16_linear"], dense) if "bf16_linear" in k else dense
    sinkhorn = _or_fallback(k.get("sinkhorn"), mhc.sinkhorn)
    return Ops(
        name="cuda" if kernels else "cuda-fallbacks", row_tile=rows, dense_linear=kdense, fp8_linear=fp8,
        grouped_linear=grouped,
        fp4_linear=_dequant_linear(dense), exl3_linear=_exl3_reference_linear(rows),
        row_sum=tree_row_sum, row_mean=tree_row_mean,
        rms_norm=_kernel_rms_norm(k["rms_norm"]) if "rms_norm" in k else _tree_rms_norm,
        sinkhorn=sinkhorn,
        hc_mix=_or_fallback(k.get("hc_mix"), functools.partial(mhc.hc_mix, sinkhorn_fn=sinkhorn)),
        hc_pre=k.get("hc_pre"), hc_site_in=k.get("hc_site_in"), hc_site_mixes=k.get("hc_site_mixes"),
        route_fn=k.get("route"), pool_norm=k.get("pool_norm"),
        hc_collapse=_or_fallback(k.get("hc_collapse"), mhc.hc_collapse),
        hc_expand=_or_fallback(k.get("hc_expand"), mhc.hc_expand),
        route_weights=_or_fallback(k.get("route_weights"), moe.route_weights),
        index_scores=index_scores,
        round_scores=round_scores,
        gather_round=_kernel_gather_round(k["gather_rows"]) if "gather_rows" in k else gather_round,
        ring_write=_kernel_ring_write(k["scatter_rows"]) if "scatter_rows" in k else ring_write,
        round_keys_fn=_kernel_round_keys(k["round_keys"]) if "round_keys" in k else None,
        sparse_attend=_kernel_attend(k["sparse_attn"]) if "sparse_attn" in k else attend_tiled,
        sparse_attend_rows=_kernel_attend_rows(k["sparse_attn"]) if "sparse_attn" in k else None,
        norm_rope_quant_fn=k.get("norm_rope_quant"),
        swiglu_h=_or_fallback(k.get("swiglu_h"), moe.swiglu_h),
        rope_=_or_fallback(k.get("rope_"), apply_rope_),
        cos_sin=_or_fallback(k.get("cos_sin"), cos_sin),
        fp8_fake_quant=_or_fallback(k.get("fp8_fake_quant"), quant.fp8_fake_quant),
        fp4_fake_quant_ue8m0=_or_fallback(k.get("fp4_fake_quant_ue8m0"), quant.fp4_fake_quant_ue8m0),
        fp4_fake_quant_e4m3=_or_fallback(k.get("fp4_fake_quant_e4m3"), quant.fp4_fake_quant_e4m3),
        router_scores=_or_fallback(k.get("router_scores"), moe.router_scores),
        router_topk=_or_fallback(k.get("router_topk"), L.stable_topk),
        select_topk=_or_fallback(k.get("select_topk"), select_topk),
        fp4_routed=_kernel_fp4_routed(k["fp4_moe"]) if "fp4_moe" in k else None,
        fp4_routed_shards=_kernel_fp4_routed_shards(k["fp4_moe"]) if "fp4_moe" in k else None,
        fuse_linears=fuse, fused_linear=fused, cat_linear=cat, fuse_parts=fuse_parts,
        stacks_experts=True,
        # the fallbacks' per-expert MoE waits for the device (ids.unique): those rounds run eagerly
        graphs="fp4_moe" in k,
        kernels=tuple(sorted(k)))


def _load_kernels() -> dict:
    """The kernels of kernels/ that import (Triton present); an absent one leaves its op to the torch fallback."""
    found = {}
    for module, names in (("kernels.fp8_linear", ("fp8_linear", "bf16_linear", "fp8_linear_grouped",
                                                  "fp8_linear_multi", "multi_config")),
                          ("kernels.fp4_moe", ("fp4_moe",)),
                          ("kernels.prompt_gemm", ("prompt_fp8_linear",)),
                          ("kernels.indexer", ("index_scores", "index_scores_table")),
                          ("kernels.round_gather", ("gather_rows", "scatter_rows", "round_keys")),
                          ("kernels.sparse_attn", ("sparse_attn",)),
                          ("kernels.topk", ("router_topk", "select_topk")),
                          ("kernels.router", ("router_scores", "route")),
                          ("kernels.mhc", ("hc_mix", "hc_pre", "hc_site_mixes")),
                          ("kernels.act", ("swiglu_h",)),
                          ("kernels.rope", ("rope_", "cos_sin")),
                          ("kernels.fake_quant", ("fp8_fake_quant", "fp4_fake_quant_ue8m0", "fp4_fake_quant_e4m3")),
                          ("kernels.norm_rope_quant", ("norm_rope_quant",)),
                          ("kernels.compress_pool", ("pool_norm",)),
                          ("kernels.rowops", ("rms_norm", "sinkhorn", "hc_collapse", "hc_expand", "hc_site_in",
                                              "route_weights"))):
        try:
            mod = __import__(module, fromlist=list(names))
            found.update({n: getattr(mod, n) for n in names})
        except Exception:  # noqa: BLE001, S112 - absent, or Triton missing: the torch fallback runs
            continue
    return found


# ---- the functions (torch forms here, the model's own in linear / mhc / moe / indexer) ---------------------------

def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the FP8/bf16 product kernels take it: rows of contiguous elements at any row stride (they read x through
    its row stride: kernels/fp8_linear.py, prompt_gemm.pack_rows). A column slice (wo_b's input of one TP shard,
    [rows, 4096] of [rows, 8192]) goes in as it is, where .contiguous() copied it first."""
    return x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous()


def _dense_linear(rows: int) -> Callable:
    """A float weight's product in `rows`-row tiles; a bf16 weight (kept as stored, weights.BF16_KEPT) widened to
    float32 for the call: the reference's function (the widening is exact)."""
    def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return L.linear(x, w.float() if w.dtype == torch.bfloat16 else w, rows)
    return dense_linear


def _kernel_dense_linear(k: Callable, dense: Callable) -> Callable:
    """A bf16 weight through the decode-product kernel (x rounded to bf16, fp32 sums: kernels/fp8_linear.py); a
    float32 weight as the dense product."""
    def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if w.dtype == torch.bfloat16:
            return k(_rows(x), w)
        return dense(x, w)
    return dense_linear


def _dequant_linear(dense: Callable) -> Callable:
    """A kept FP8/FP4 weight dequantised for the call (exact in float32), then the dense product."""
    def dequant_linear(x: torch.Tensor, w) -> torch.Tensor:
        return dense(x, w.dequant())
    return dequant_linear


def _grouped_linear(ops: Ops, x: torch.Tensor, w, groups: int) -> torch.Tensor:
    """Group by group through ops.linear (a row slice of an FP8 weight stays in checkpoint form), concatenated."""
    rows, cols = w.shape[0] // groups, x.shape[1] // groups
    return torch.cat([ops.linear(x[:, g * cols:(g + 1) * cols], w[g * rows:(g + 1) * rows]) for g in range(groups)],
                     dim=1)


def _kernel_grouped_linear(k: Callable, fp8: Callable) -> Callable:
    """An FP8 grouped weight in one launch of the decode-product kernel (kernels.fp8_linear.fp8_linear_grouped: the
    same bits as the groups one by one through the same kernel); any other weight group by group."""
    def grouped_linear(ops: Ops, x: torch.Tensor, w, groups: int) -> torch.Tensor:
        if isinstance(w, Fp8Weight):
            return k(_rows(x), w.q, w.scale, groups)
        return _grouped_linear(ops, x, w, groups)
    return grouped_linear


def _kernel_fp8_linear(k: Callable) -> Callable:
    def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        return k(_rows(x), w.q, w.scale).float()
    return fp8_linear


def _kernel_fuse(multi_config: Callable) -> Callable:
    """FP8 weights (or bf16 ones) that take one input, concatenated for one launch of kernels/fp8_linear.py's
    kernel where it takes them with each part's own split and tiles (kernels.fp8_linear.multi_config), else None."""
    def fuse(weights: list) -> FusedWeight | None:
        w = fuse_rows(weights)
        if w is None:
            return None
        fp8 = isinstance(w, Fp8Weight)
        outs = tuple(int(p.shape[0]) for p in weights)
        cfg = multi_config(outs, int(w.shape[1]), w.device, fp8)
        return None if cfg is None else FusedWeight(w, outs, cfg)
    return fuse


def _kernel_fuse_parts(multi_config: Callable) -> Callable:
    """A weight whose rows are already several weights' (the TP shards' wq_b rows: views of it) as a FusedWeight
    over itself, where kernels/fp8_linear.py's kernel takes the parts in one launch with each part's bits."""
    def fuse_parts(w, outs: tuple[int, ...]) -> FusedWeight | None:
        if not isinstance(w, Fp8Weight) or sum(outs) != w.shape[0]:
            return None
        cfg = multi_config(tuple(outs), int(w.shape[1]), w.device, True)
        return None if cfg is None else FusedWeight(w, tuple(outs), cfg)
    return fuse_parts


def _kernel_fused_linear(k: Callable) -> Callable:
    def fused_linear(x: torch.Tensor, w: FusedWeight) -> list[torch.Tensor]:
        q, s = (w.w.q, w.w.scale) if isinstance(w.w, Fp8Weight) else (w.w, None)
        return k(_rows(x), q, s, w.outs, w.cfg)
    return fused_linear


def _exl3_reference_linear(rows: int) -> Callable:
    """The float32 reference of an EXL3 linear (exl3.exl3_linear: W~ decoded once per block, Hadamards on the
    activations), block by block."""
    def exl3_linear(x: torch.Tensor, w) -> torch.Tensor:
        from dsv41.model.exl3 import exl3_linear as ref
        outs = [ref(x, b, w_rot=w.rotated(i, x.device), rows=rows) for i, b in enumerate(w.blocks)]
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
    return exl3_linear


def _exl3_kernel_linear(k: Callable) -> Callable:
    """The fused EXL3 kernel (W never formed; CUDA C or Triton), block by block."""
    def exl3_linear(x: torch.Tensor, w) -> torch.Tensor:
        outs = [k(x.contiguous(), w.kernel_weight(i)).float() for i in range(len(w.blocks))]
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
    return exl3_linear


def shard_sum(parts) -> torch.Tensor:
    """TP shards' partial products added in shard order, as the ranks' all-reduce adds them (its bits)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def tree_row_mean(x: torch.Tensor) -> torch.Tensor:
    """The CUDA path's mean: tree Σ · float32(1/n), written out: the same bits as torch's CUDA `Σ / n`."""
    return tree_row_sum(x) * inv_count(x.shape[-1])


def _tree_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return L.rms_norm(x, weight, eps, mean=tree_row_mean)


def _kernel_rms_norm(k: Callable) -> Callable:
    """kernels/rowops.py's norm (the tree norm's operations in one launch) where it applies: a float32 1-D weight
    or none."""
    def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if weight is None or (weight.dtype == torch.float32 and weight.dim() == 1):
            return k(x.float(), weight, eps)
        return _tree_rms_norm(x, weight, eps)
    return rms_norm


def _or_fallback(k: Callable | None, fallback: Callable) -> Callable:
    """The kernel, or the torch function where the kernel does not apply (it returns None) or is absent."""
    if k is None:
        return fallback

    def op(*args):
        out = k(*args)
        return out if out is not None else fallback(*args)
    op.__name__ = getattr(k, "__name__", "op")
    return op


def _index_scores_tiled(q, w, keys, scale, rows):
    from dsv41.model.indexer import index_scores
    return index_scores(q, w, keys, scale, rows=rows)


def _round_scores_padded(q, w, keys, tpad, counts, scale, n=None, table=None, *, rows):
    from dsv41.model.indexer import round_scores_padded
    real = len(keys) * (n or q.shape[0] // len(keys))
    return _pad_like_row0(round_scores_padded(q[:real], w[:real], keys, tpad, scale, rows=rows), q.shape[0])


def _pad_like_row0(out: torch.Tensor, rows: int) -> torch.Tensor:
    """out [real, ...] followed by copies of its row 0 up to `rows` rows (a CUDA graph's padded rows)."""
    if rows == out.shape[0]:
        return out
    return torch.cat([out, out[:1].expand(rows - out.shape[0], *out.shape[1:])])


def _cuda_index_ops(scores_kernel: Callable | None, table_kernel: Callable | None, rows: int) -> tuple:
    """The CUDA op set's (index_scores, round_scores): the kernels where given, the torch path in `rows`-row tiles
    where one is absent or does not apply."""
    scores = functools.partial(_index_scores_tiled, rows=rows)
    if scores_kernel is not None:
        scores = _kernel_index_scores(scores_kernel, scores)
    return scores, _cuda_round_scores(table_kernel, scores)


def _kernel_index_scores(k: Callable, fallback: Callable) -> Callable:
    def index_scores(q, w, keys, scale):
        D = keys.shape[1]
        return fallback(q, w, keys, scale) if D & (D - 1) else k(q, w, keys, scale)
    return index_scores


def _cuda_round_scores(table_kernel: Callable | None, index_scores: Callable) -> Callable:
    """A round's scores on the CUDA path: one launch of the round kernel reading each sequence's keys through a
    table of addresses (no padded copy) where it applies, else each sequence's scores (`index_scores`) padded."""
    def round_scores(q, w, keys, tpad, counts, scale, n=None, table=None):
        B = len(keys)
        n = n or q.shape[0] // B
        Di = q.shape[2]
        if (table_kernel is not None and not Di & (Di - 1) and counts is not None
                and all(k.dtype == torch.float32 and k.is_contiguous() for k in keys)):
            if table is not None:      # the round's per-row table: every row its own "sequence" of the kernel
                return table_kernel(q, w, table.contiguous(), counts.contiguous(), tpad, scale)
            return table_kernel(q, w, address_table(keys, q.device), counts, tpad, scale)
        out = torch.cat([torch.cat([index_scores(q[b * n:(b + 1) * n], w[b * n:(b + 1) * n], k, scale),
                                    q.new_zeros((n, tpad - k.shape[0]))], dim=1) for b, k in enumerate(keys)])
        return _pad_like_row0(out, q.shape[0])
    return round_scores


def gather_round(srcs: list[torch.Tensor], idx: torch.Tensor, n: int,
                 table: torch.Tensor | None = None) -> torch.Tensor:
    """Rows idx [B*n, K] of each sequence's own tensor srcs[b] [*, D] -> [B*n, K, D]; -1 picks a row whose weight
    is an exact zero (the attention masks it): one index_select per sequence. Rows of idx past B*n (a CUDA graph's
    padded rows, which repeat row 0) get row 0's result. `table` (each row's source address) is the kernels'."""
    B, K, D = len(srcs), idx.shape[1], srcs[0].shape[1]
    out = srcs[0].new_empty((idx.shape[0], K, D))
    pick = idx.clamp_min(0)
    for b, c in enumerate(srcs):
        o = out[b * n:(b + 1) * n].view(n * K, D)
        if c.shape[0]:
            torch.index_select(c, 0, pick[b * n:(b + 1) * n].reshape(-1), out=o)
        else:
            o.zero_()
    if idx.shape[0] > B * n:
        out[B * n:] = out[:1]
    return out


def _kernel_gather_round(k: Callable) -> Callable:
    """One launch through a table of the sequences' addresses (kernels/round_gather.py) where D is a power of two:
    the round's per-row table when given (a CUDA graph replays it with the next round's addresses), else one made
    from srcs (a copy to the device)."""
    def gather(srcs: list[torch.Tensor], idx: torch.Tensor, n: int, table: torch.Tensor | None = None):
        D = srcs[0].shape[1]
        if D & (D - 1):
            return gather_round(srcs, idx, n)
        return k(address_table(srcs, idx.device) if table is None else table, idx, D)
    return gather


def ring_write(rings: list[torch.Tensor], rows: torch.Tensor, slots: torch.Tensor, n: int,
               table: torch.Tensor | None = None) -> None:
    """Row r of rows [B*n, D] into slot slots[r] of its sequence's window ring rings[r // n] [W, D]: one index_copy_
    per sequence (rows past B*n are a graph's padding, copies of row 0: nothing to write). A slot < 0 writes nothing
    (a group that does not close, a graph's dry run: graphs.py; on a GPU the selection waits for the host, so the
    kernel op set takes scatter_rows). `table` is the kernels'."""
    masked = slots.device.type != "cpu" or bool((slots < 0).any())
    for b, ring in enumerate(rings):
        s, r = slots[b * n:(b + 1) * n], rows[b * n:(b + 1) * n]
        if masked:
            keep = s >= 0
            s, r = s[keep], r[keep]
        ring.index_copy_(0, s, r)


def _kernel_ring_write(k: Callable) -> Callable:
    """kernels/round_gather.scatter_rows: one launch through the round's per-row table of ring addresses (D a power
    of two), else the per-sequence copies."""
    def write(rings: list[torch.Tensor], rows: torch.Tensor, slots: torch.Tensor, n: int,
              table: torch.Tensor | None = None) -> None:
        D = rows.shape[1]
        if table is None or D & (D - 1) or rows.dtype != torch.float32:
            return ring_write(rings, rows, slots, n)
        k(table, slots, rows)
    return write


def _kernel_round_keys(k: Callable) -> Callable:
    """kernels/round_gather.round_keys where it takes the call (float32 rows, D a power of two), else None."""
    def round_keys(ring_table, rsel, nsel, kv, pos, comp_table, topk):
        D = kv.shape[1]
        if D & (D - 1) or kv.dtype != torch.float32 or rsel.stride() != nsel.stride():
            return None
        return k(ring_table, rsel, nsel, kv, pos, comp_table, topk)
    return round_keys


def attend_tiled(ops: Ops, q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """The reference: each tile of rows gathers its keys pool[idx] (a masked slot reads row 0: its score is -inf,
    its weight 0), scores q·k × scale in float32 (masked keys at -inf), softmax over [scores, sink] with the sink
    column dropped, then P·V with V = K; in the op set's fixed row tiles, so a row's bits never depend on the
    others, and a prompt pass holds one tile's keys at a time, not the chunk's."""
    def tile(qt, it):
        kt = pool[it.clamp(min=0)]                                          # [R, K, D]
        s = torch.bmm(qt, kt.transpose(1, 2)) * scale                       # [R, heads, K]
        s = s.masked_fill((it < 0)[:, None, :], float("-inf"))
        s = torch.cat([s, sink.view(1, -1, 1).expand(s.shape[0], -1, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]                             # the sink only in the denominator
        return torch.bmm(p, kt)

    return ops.tiled(tile, q, idx)


def _kernel_attend(k: Callable) -> Callable:
    """kernels/sparse_attn.py: reads each row's keys from the pool through its indices (no gathered copy; bf16 q, k
    and P with float32 accumulation and softmax, as DeepSeek's kernel; the keys in fixed splits of 64 folded in
    order, so the bits do not depend on the row count). Shapes the kernel does not take (heads not a multiple of 16,
    D not a power of two) run the reference form. Its `all_shards(heads, dim)`: whether one call over several TP
    shards' heads gives each shard's bits, shards of `heads` heads each (the kernel computes every head apart; the
    reference's products do not)."""
    def attend(ops: Ops, q, pool, idx, sink, scale):
        n, heads, dim = q.shape
        if n == 0 or not _attn_takes(heads, dim):
            return attend_tiled(ops, q, pool, idx, sink, scale)
        return k(q, pool, idx, sink, scale)
    attend.all_shards = _attn_takes
    return attend


def _attn_takes(heads: int, dim: int) -> bool:
    """The shapes kernels/sparse_attn.py takes: heads a multiple of 16, D a power of two >= 16."""
    return heads % 16 == 0 and dim >= 16 and not dim & (dim - 1)


def _kernel_attend_rows(k: Callable) -> Callable:
    """kernels/sparse_attn.py on keys held row by row (its bool-validity form: no index tensor made), where it
    takes the shape; None otherwise (Ops.attend_rows then makes the indices)."""
    def attend_rows(ops: Ops, q, keys, valid, sink, scale):
        n, heads, dim = q.shape
        if n == 0 or not _attn_takes(heads, dim):
            return None
        return k(q, keys, valid, sink, scale)
    return attend_rows


def _kernel_fp4_routed(k: Callable) -> Callable:
    """kernels/fp4_moe.py's grouped launch over the layer's stack; slots of experts outside `shard` (another TP
    shard's) get -1, contributing nothing, as another rank's do."""
    def routed(stack: ExpertStack, x, weights, ids, limit, shard):
        local = stack.local_ids(ids)
        if shard is not None:
            local = torch.where((ids >= shard.start) & (ids < shard.stop), local, -1)
        return k(x.contiguous(), stack.w13, stack.s13, stack.w2, stack.s2, local, weights, limit)
    return routed


def _kernel_fp4_routed_shards(k: Callable) -> Callable:
    """kernels/fp4_moe.py's grouped launch over every pair of the rank's shards once, then each shard's slot sum
    (stack.shard): one work list, one gate/up and one down launch where a pass per shard took one each."""
    def routed_shards(stack: ExpertStack, x, weights, ids, limit, shards, addends=None):
        return k(x.contiguous(), stack.w13, stack.s13, stack.w2, stack.s2, stack.local_ids(ids), weights, limit,
                 shard_of=stack.shard, shards=shards, addends=addends)
    return routed_shards


def _prompt_fp8_linear(k: Callable, fp8: Callable, grouped: Callable,
                       fused: Callable) -> tuple[Callable, Callable, Callable, Callable]:
    """FP8 products of more than PROMPT_ROWS rows through kernels/prompt_gemm.py's tensor-core tiles, where the decode
    kernel they replace is the CUDA C one and the device gives its bits (`agrees_with_decode`, checked once per
    device: the prompt kernel runs the decode kernel's k order and K chunks, but whether wgmma sums as mma.sync is the
    hardware's), so the row count picking one or the other changes no row; else `fp8` / `grouped` / `fused` (a
    FusedWeight's parts, each its own prompt product: each part's bits are its own launch's); `linear_cat`'s
    products write their column blocks of one result (a store at another row stride: the same bits)."""
    from kernels.fp8_linear import CUDA, config_for
    from kernels.prompt_gemm import PROMPT_ROWS, agrees_with_decode, fp8_config
    if torch.cuda.is_available():
        agrees_with_decode(torch.cuda.current_device())     # checked at load, outside any graph capture

    def takes(x: torch.Tensor, w, rows: int) -> bool:
        return (x.shape[0] > PROMPT_ROWS and isinstance(w, Fp8Weight) and x.device.type == "cuda"
                and config_for(rows, w.shape[1], x.device) is CUDA and agrees_with_decode(x.device))

    def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        if takes(x, w, w.shape[0]):
            return k(_rows(x), w.q, w.scale)
        return fp8(x, w)

    def grouped_linear(ops: Ops, x: torch.Tensor, w, groups: int) -> torch.Tensor:
        rows = w.shape[0] // groups
        if takes(x, w, rows) and rows % fp8_config(rows, w.shape[1]).bn == 0:
            return k(_rows(x), w.q, w.scale, groups)
        return grouped(ops, x, w, groups)

    def fused_linear(x: torch.Tensor, w: FusedWeight) -> list[torch.Tensor]:
        if isinstance(w.w, Fp8Weight) and all(takes(x, w.w, o) for o in w.outs):
            x = _rows(x)
            return [k(x, part.q, part.scale) for part in (w.part(i) for i in range(len(w.outs)))]
        return fused(x, w)

    def cat_linear(ops: Ops, x: torch.Tensor, ws: list) -> torch.Tensor:
        if not ws or not all(takes(x, w, w.shape[0]) for w in ws):
            return torch.cat([ops.linear(x, w) for w in ws], dim=1)
        x = _rows(x)
        out = torch.empty((x.shape[0], sum(w.shape[0] for w in ws)), dtype=torch.float32, device=x.device)
        a = 0
        for w in ws:
            k(x, w.q, w.scale, out=out[:, a:a + w.shape[0]])
            a += w.shape[0]
        return out
    return fp8_linear, grouped_linear, fused_linear, cat_linear
