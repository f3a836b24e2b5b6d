"""Loading an EXL3 pack (an exllamav3 quant of V4.1 as the reference recipe serves it) into the official weights.

A pack (docs/exl3.md, ../shared/spec/exl3.md §6) has the official config with `quantization_config.quant_method:
exl3`, and per linear layer `<m>` the EXL3 parts (`<m>.trellis`, `<m>.suh|su`, `<m>.svh|sv`, `<m>.mcg|mul1`,
obsolete `<m>.scale`) where the release has `<m>.weight` (+ `.scale`); `attn.wo_a` is stored as one EXL3 linear per
output group (`attn.wo_a.slice.<g>`). Every other tensor keeps its official name, 16-bit (or float32). The Engram
tables are not in packs: they are read from the original shards (`Model.load(engram=DIR)`, `--engram DIR`).

`load_exl3_weights` returns exactly what `weights.load_weights` returns for an official checkpoint: official names,
`[out, in]` weights in `dtype` (F32 tensors stay float32), only the rank's share. Each EXL3 linear is decoded with
the bit-exact reference decoder (`exl3.dequant_exl3`, exllamav3's dense reconstruction, fp16) and transposed, so
the CPU model built from a pack is the float32 model of those fp16 weights. The rate K and the codebook are read
from each tensor, never assumed from the config.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dsv41.config import ModelConfig
from dsv41.model.exl3 import (
    Exl3FormatError,
    bits_of,
    codebook_of,
    decode_trellis,
    dequant_exl3,
    official_name,
    sign_scales,
)
from dsv41.model.weights import (
    BF16,
    F32,
    RankShare,
    TensorSpec,
    WeightError,
    expected_tensors,
    read_weight_map,
)

F16, I16, I32 = "F16", "I16", "I32"
# 16-bit tensors: exllamav3 keeps the source dtype; fp16 or float32 copies are accepted as well.
_PLAIN_DTYPES = (BF16, F16, F32)


@dataclass(frozen=True)
class Exl3Linear:
    """One EXL3 linear of a pack: y = x @ W with W [n_in, n_out], the transpose of rows `rows` of `official`."""

    module: str                       # the pack's name, before .trellis
    official: str                     # the official weight it is (part of)
    rows: tuple[int, int] | None      # rows [lo, hi) of the official weight, None = all
    n_in: int
    n_out: int

    def parts(self) -> dict[str, tuple[tuple[str, ...], tuple[int, ...] | None, bool]]:
        """part name -> (accepted dtypes, shape or None for any, required)."""
        m, a, b = self.module, self.n_in, self.n_out
        return {
            f"{m}.trellis": ((I16,), None, True),
            f"{m}.suh": ((F16,), (a,), False), f"{m}.su": ((I16,), (a // 16,), False),
            f"{m}.svh": ((F16,), (b,), False), f"{m}.sv": ((I16,), (b // 16,), False),
            f"{m}.mcg": ((I32,), None, False), f"{m}.mul1": ((I32,), None, False),
            f"{m}.scale": (None, None, False),                  # obsolete in exllamav3, ignored (spec §1)
        }


@dataclass(frozen=True)
class PackInventory:
    plain: dict[str, TensorSpec]              # official 16-bit / float32 tensors, by name
    linears: dict[str, list[Exl3Linear]]      # official weight name -> its EXL3 linear(s), in row order
    engram_tables: tuple[str, ...]            # may be in the pack (then all of them), usually not


def _logical_shape(spec: TensorSpec) -> tuple[int, int]:
    rows, cols = spec.shape
    return (rows, cols * 2) if spec.fmt == "fp4" else (rows, cols)


def pack_inventory(cfg: ModelConfig, vision: bool = False) -> PackInventory:
    """What an EXL3 pack of this config holds: the official inventory with every linear the packs quantise
    (`exl3.EXL3_TO_OFFICIAL`) replaced by its EXL3 linear(s)."""
    t = cfg.text
    plain: dict[str, TensorSpec] = {}
    linears: dict[str, list[Exl3Linear]] = {}
    tables = []
    for name, spec in expected_tensors(cfg, vision=vision).items():
        if spec.fmt == "scale":
            continue
        if spec.fmt == "engram":
            tables.append(name)
            continue
        if name.endswith(".weight") and len(spec.shape) == 2:
            mod = name[: -len(".weight")]
            out_f, in_f = _logical_shape(spec)
            if mod.endswith(".attn.wo_a"):
                r = t.o_lora_rank
                linears[name] = [Exl3Linear(f"{mod}.slice.{g}", name, (g * r, (g + 1) * r), in_f, r)
                                 for g in range(t.o_groups)]
                continue
            try:
                off, _, _ = official_name(mod)
            except KeyError:
                off = None
            if off == name:
                linears[name] = [Exl3Linear(mod, name, None, in_f, out_f)]
                continue
        if spec.fmt != "plain":
            raise AssertionError(f"{name}: a quantised official tensor that EXL3_TO_OFFICIAL does not map")
        plain[name] = TensorSpec(spec.dtype, spec.shape, alt_dtypes=_PLAIN_DTYPES)
    return PackInventory(plain, linears, tuple(tables))


def _vision_present(wm: dict[str, str]) -> bool:
    return any(k.startswith(("vision.", "aligner.")) for k in wm)


def check_pack(wm: dict[str, str], cfg: ModelConfig) -> PackInventory:
    """Names only: every 16-bit tensor and every EXL3 linear's required parts present (a sign-scale side as
    fp16 `s?h` or packed `s?`), the Engram tables all or none, nothing unknown. WeightError names the tensor."""
    inv = pack_inventory(cfg, vision=_vision_present(wm))
    known = set(inv.plain)
    for name in inv.plain:
        if name not in wm:
            raise WeightError(name, "missing from the pack's weight_map")
    for lins in inv.linears.values():
        for lin in lins:
            parts = lin.parts()
            known.update(parts)
            m = lin.module
            if f"{m}.trellis" not in wm:
                raise WeightError(f"{m}.trellis", "missing from the pack's weight_map (an EXL3 linear)")
            for side in ("u", "v"):
                if f"{m}.s{side}h" not in wm and f"{m}.s{side}" not in wm:
                    raise WeightError(f"{m}.s{side}h", f"missing from the pack's weight_map (nor {m}.s{side})")
    present = [n for n in inv.engram_tables if n in wm]
    if present and len(present) != len(inv.engram_tables):
        missing = next(n for n in inv.engram_tables if n not in wm)
        raise WeightError(missing, "the pack lists some Engram tables but not this one")
    known.update(inv.engram_tables)
    for name in wm:
        if name not in known:
            raise WeightError(name, "not expected in an EXL3 pack of this config (a tensor this code would ignore)")
    return inv


def _check_header(f, name: str, dtypes: tuple[str, ...] | None, shape: tuple[int, ...] | None) -> None:
    sl = f.get_slice(name)
    dt, shp = sl.get_dtype(), tuple(sl.get_shape())
    if dtypes is not None and dt not in dtypes:
        raise WeightError(name, f"dtype {dt}, expected {' or '.join(dtypes)}")
    if shape is not None and shp != shape:
        raise WeightError(name, f"shape {list(shp)}, expected {list(shape)}")


class _Shards:
    """safe_open handles by file, opened once each, with their tensor names."""

    def __init__(self, d: Path, wm: dict[str, str], stack: contextlib.ExitStack):
        self.d, self.wm, self.stack = d, wm, stack
        self.files: dict[str, tuple[object, set[str]]] = {}

    def handle(self, name: str):
        fname = self.wm[name]
        if fname not in self.files:
            path = self.d / fname
            if not path.is_file():
                raise WeightError(name, f"its shard {fname} is missing")
            f = self.stack.enter_context(safe_open(path, framework="pt"))
            self.files[fname] = (f, set(f.keys()))
        f, names = self.files[fname]
        if name not in names:
            raise WeightError(name, f"listed in the index under {fname} but not in that file")
        return f


def decode_linear(lin: Exl3Linear, shards: _Shards) -> torch.Tensor:
    """The official-orientation weight [n_out, n_in] (fp16 values) of one EXL3 linear, checked part by part."""
    parts = read_linear_parts(lin, shards)
    try:
        w = dequant_exl3(parts)
    except Exl3FormatError as e:
        raise WeightError(lin.module, str(e)) from None
    return w.t()


class Exl3Packed:
    """An official weight [out, in] kept as its EXL3 linear(s) (row blocks in order; wo_a has one per output group):
    the GPU path's counterpart of `device.Fp8Weight`, data with the same protocol (shape, device, row slices by
    whole blocks, dequant, nbytes). The op set's `linear` computes x . W^T from the codes (dsv41/model/ops.py): the
    fused Triton kernel (kernels/exl3.py: W never formed, row-invariant, activations rounded to fp16 after the
    input Hadamard) when `Ops.with_exl3` added it, otherwise the float32 reference `exl3.exl3_linear` (W~ decoded
    once, fixed row tiles). `rotated` / `kernel_weight` hold what either needs, made on first use."""

    def __init__(self, blocks: list[dict[str, torch.Tensor]]):
        self.blocks = blocks
        self._w_rot: list[torch.Tensor | None] = [None] * len(blocks)
        self._kernel_w: list[object | None] = [None] * len(blocks)
        self._slices: dict[tuple[int, int, int], Exl3Packed] = {}   # the model slices wo_a per group every call

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(b["trellis"].shape[1] * 16 for b in self.blocks), self.blocks[0]["trellis"].shape[0] * 16))

    @property
    def device(self) -> torch.device:
        return self.blocks[0]["trellis"].device

    def __getitem__(self, rows: slice) -> Exl3Packed:
        """Rows a:b of the official weight (e.g. one output group of wo_a)."""
        a, b, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("an EXL3 weight slices by contiguous rows only")
        return self.split(0, a, b)

    def split(self, dim: int, a: int, b: int) -> Exl3Packed:
        """Rows (dim 0) or columns (dim 1) a:b of the official weight [out, in]. The Hadamard is block-diagonal over
        128, so cutting at multiples of 128 cuts the EXL3 linear exactly: official rows are its output columns
        (trellis dim 1, svh), official columns its input rows (trellis dim 0, suh)."""
        if (dim, a, b) in self._slices:
            return self._slices[dim, a, b]
        if a % 128 or b % 128 or not 0 <= a < b <= self.shape[dim]:
            raise ValueError(f"an EXL3 weight splits at multiples of 128 only, not {a}:{b} of dim {dim}")
        if dim == 1:
            blocks = [{**blk, "trellis": blk["trellis"][a // 16:b // 16].contiguous(), "suh": blk["suh"][a:b]}
                      for blk in self.blocks]
        else:
            blocks, lo = [], 0
            for blk in self.blocks:
                n = blk["trellis"].shape[1] * 16
                s, e = max(a, lo) - lo, min(b, lo + n) - lo
                if s < e:
                    blocks.append(blk if (s, e) == (0, n) else
                                  {**blk, "trellis": blk["trellis"][:, s // 16:e // 16].contiguous(),
                                   "svh": blk["svh"][s:e]})
                lo += n
        self._slices[dim, a, b] = part = Exl3Packed(blocks)
        return part

    def rotated(self, i: int, device: torch.device) -> torch.Tensor:
        """W~ of block i (decode_trellis on the host, then on `device`), decoded once: the reference's operand."""
        if self._w_rot[i] is None:
            t = self.blocks[i]
            self._w_rot[i] = decode_trellis(t["trellis"].cpu(), *_rate(t)).to(device)
        return self._w_rot[i]

    def kernel_weight(self, i: int):
        """Block i as the fused kernel's kernels.exl3.Exl3Weight (a view of the codes), made once."""
        if self._kernel_w[i] is None:
            self._kernel_w[i] = _kernel_weight([self.blocks[i]])
        return self._kernel_w[i]

    def dequant(self) -> torch.Tensor:
        """float32 [out, in]: the bit-exact dense reconstruction (CPU emulation: for tests and small weights)."""
        cpu = [{k: v.cpu() for k, v in b.items()} for b in self.blocks]
        return torch.cat([dequant_exl3(b).float().t() for b in cpu]).to(self.device)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for b in self.blocks for v in b.values())


def _kernel_weight(blocks: list[dict[str, torch.Tensor]]):
    """kernels.exl3.Exl3Weight over same-shape, same-rate blocks already on the device: a view for one block, one
    stacked copy for several (no trip through the host, unlike Exl3Weight.from_tensors)."""
    from kernels.exl3 import Exl3Weight
    rates = {_rate(b) for b in blocks}
    shapes = {tuple(b["trellis"].shape) for b in blocks}
    if len(rates) != 1 or len(shapes) != 1:
        raise Exl3FormatError("grouped EXL3 matrices must share shape, rate and codebook")
    (K, cb), = rates
    kt, nt, _ = shapes.pop()

    def stack(key):
        return blocks[0][key].unsqueeze(0) if len(blocks) == 1 else torch.stack([b[key] for b in blocks])

    return Exl3Weight(trellis=stack("trellis"), suh=stack("suh"), svh=stack("svh"), bias=None, K2=round(2 * K),
                      cb=cb, in_features=kt * 16, out_features=nt * 16)


def _rate(t: dict) -> tuple[float, int]:
    cb = codebook_of(t)
    return bits_of(t["trellis"], cb), cb


def read_linear_parts(lin: Exl3Linear, shards: _Shards) -> dict[str, torch.Tensor]:
    """One EXL3 linear's parts, checked (header dtypes/shapes, rate, codebook, sign forms), as decode_linear reads
    them; packed legacy signs unpacked to fp16, the obsolete .scale dropped."""
    parts = {}
    for pname, (dtypes, shape, _) in lin.parts().items():
        if pname not in shards.wm:
            continue
        f = shards.handle(pname)
        _check_header(f, pname, dtypes, shape)
        short = pname[len(lin.module) + 1:]
        if short != "scale":
            parts[short] = f.get_tensor(pname)
    tr = parts["trellis"]
    if tr.dim() != 3 or tr.shape[0] * 16 != lin.n_in or tr.shape[1] * 16 != lin.n_out:
        raise WeightError(f"{lin.module}.trellis", f"shape {list(tr.shape)}, expected "
                                                  f"[{lin.n_in // 16}, {lin.n_out // 16}, 16*K]")
    try:
        _rate(parts)
        out = {"trellis": tr, "suh": sign_scales(parts, "u", lin.n_in), "svh": sign_scales(parts, "v", lin.n_out)}
    except Exl3FormatError as e:
        raise WeightError(lin.module, str(e)) from None
    for m in ("mcg", "mul1"):
        if m in parts:
            out[m] = parts[m]
    return out


def load_exl3_weights(ckpt: str | Path, cfg: ModelConfig, share: RankShare | None = None,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      keep_quant: bool = False) -> dict[str, torch.Tensor]:
    """The share's tensors of an EXL3 pack under official names, as `weights.load_weights` returns them for an
    official checkpoint (module doc). Engram tables are checked (all or none in the pack) but not returned.

    keep_quant (the GPU path, device.py): every EXL3 linear the model only multiplies through the op set's `linear`
    comes back as an `Exl3Packed` on `device` (codes, sign-scales, marker) instead of a dense weight; the compressor's
    (which the model converts with .float()) stays dense."""
    share = share or RankShare(0, 1)
    d = Path(ckpt)
    wm = read_weight_map(d)
    inv = check_pack(wm, cfg)
    t = cfg.text
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        shards = _Shards(d, wm, stack)
        for name, spec in inv.plain.items():
            f = shards.handle(name)
            _check_header(f, name, spec.alt_dtypes, spec.shape)
        for name, spec in inv.plain.items():
            part = share.split(name, spec.shape)
            sl = shards.handle(name).get_slice(name)
            x = sl[:] if part is None else (sl[part[1]:part[2]] if part[0] == 0 else sl[:, part[1]:part[2]])
            x = x.float() if spec.dtype == F32 else x.to(dtype)
            out[name] = x.to(device)
        for name, lins in inv.linears.items():
            n_exp = t.dspark_n_routed_experts if name.startswith("mtp.") else t.n_routed_experts
            if not share.wants(name, n_exp):
                continue
            if keep_quant and ".attn.compressor." not in name:
                packed = _packed(name, lins, shards, share, device)
                if packed is not None:
                    out[name] = packed
                    continue
            w = torch.cat([decode_linear(lin, shards) for lin in lins], dim=0)
            part = share.split(name, tuple(w.shape))
            if part is not None:
                w = w.narrow(part[0], part[1], part[2] - part[1])
            out[name] = w.to(dtype).contiguous().to(device)
    return out


def _packed(name: str, lins: list[Exl3Linear], shards: _Shards, share: RankShare, device) -> Exl3Packed | None:
    """The share of one weight as codes; None where the share's boundary cuts a 128-block (tiny models at TP2):
    that weight is then decoded dense like on the CPU path."""
    # the codebook marker stays on the host (read with .item() when a kernel weight is made)
    packed = Exl3Packed([{k: v if k in ("mcg", "mul1") else v.to(device)
                          for k, v in read_linear_parts(lin, shards).items()} for lin in lins])
    part = share.split(name, tuple(packed.shape))
    if part is None:
        return packed
    if part[1] % 128 or part[2] % 128:
        return None
    return packed.split(*part)


class Exl3ExpertStack:
    """A layer's routed experts kept as EXL3 codes, stacked for the grouped kernel (kernels.exl3.exl3_grouped), the
    counterpart of device.ExpertStack: w1 and w3 of held expert j at 2j and 2j+1 of one stack, w2 at j of another.
    Data: `exl3_routed` (the op set's `routed` on the EXL3 op set) runs every picked expert's rows in one launch per
    stack (w1 and w3 together, then w2) instead of three launches per expert and matrix."""

    def __init__(self, w13, w2, local: torch.Tensor):
        self.w13, self.w2, self.local = w13, w2, local


def exl3_routed(stack: Exl3ExpertStack, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                limit: float, grouped=None) -> torch.Tensor:
    """Σ over slots (slot order) of the routed experts' outputs through the grouped kernel `grouped` (the op set's:
    kernels.exl3.exl3_grouped_cuda or exl3_grouped, the Triton one when None). Each row's result is the same bits as
    the per-expert path through the same fused kernel (tile sizes and split fixed by the shape; slots summed in slot
    order); rows of experts not in the stack (another rank's) get nothing."""
    from dsv41.model.linear import silu
    if grouped is None:
        from kernels.exl3 import exl3_grouped as grouped
    runs = getattr(grouped, "runs", None)
    if runs is not None:
        return _routed_runs(stack, x, weights, ids, limit, runs)
    exl3_grouped = grouped
    n, top_k = ids.shape
    H = x.shape[1]
    local = stack.local[ids].reshape(-1)                         # [n*k] (row, slot) pairs -> stack index
    pair = torch.nonzero(local >= 0).squeeze(1)
    slots = x.new_zeros((n * top_k, H))
    if pair.numel():
        used, group = torch.unique(local[pair], return_inverse=True)   # each used expert one group
        order = torch.argsort(group, stable=True)
        pair, group = pair[order], group[order]
        counts = torch.bincount(group, minlength=used.numel())
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(pair.numel(), device=x.device) - starts[group]
        G, M = used.numel(), int(counts.max())
        xg = x.new_zeros((G, M, H))
        xg[group, pos] = x[pair // top_k]
        rows = counts.to(torch.int32)
        gu = exl3_grouped(torch.cat([xg, xg]), stack.w13, torch.cat([2 * used, 2 * used + 1]).to(torch.int32),
                          torch.cat([rows, rows]))
        gate = torch.clamp(gu[:G], max=limit)
        up = torch.clamp(gu[G:], min=-limit, max=limit)
        h = silu(gate) * up
        h = h * x.new_zeros((G, M)).index_put_((group, pos), weights.reshape(-1)[pair])[..., None]
        y = exl3_grouped(h, stack.w2, used.to(torch.int32), rows)
        slots[pair] = y[group, pos]
    slots = slots.view(n, top_k, H)
    out = slots[:, 0]
    for j in range(1, top_k):
        out = out + slots[:, j]
    return out


def _routed_runs(stack: Exl3ExpertStack, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float,
                 runs) -> torch.Tensor:
    """exl3_routed through a run-mode kernel (kernels.exl3.exl3_runs_cuda), with no host sync (a CUDA graph can
    hold it): the (row, slot) pairs sorted by stack index on the device, each expert's pairs one run of consecutive
    positions (w1 and w3 of all runs in one launch, then w2), other ranks' pairs in no run and zeroed. Every pair's
    gate, up, h and output are the same operations as exl3_routed's through the same kernel (same bits), the
    slots summed in slot order."""
    from dsv41.model.linear import silu
    n, top_k = ids.shape
    P = n * top_k
    E = stack.w2.experts
    dev = x.device
    local = stack.local[ids].reshape(-1)
    key = torch.where(local >= 0, local, E)                       # another rank's pair sorts last, in no run
    sk, order = torch.sort(key, stable=True)
    pos = torch.arange(P, device=dev)
    new_expert = torch.ones(P, dtype=torch.bool, device=dev)
    new_expert[1:] = sk[1:] != sk[:-1]
    # a run is at most n pairs (the kernel's row bound: an expert appears once in a row's top-k, so an expert's
    # pairs are one run; were a row to repeat an expert, its longer run is cut every n pairs)
    run0 = torch.where(new_expert, pos, 0).cummax(0).values
    first = (pos - run0) % n == 0
    starts = torch.where(first, pos, P)
    nxt = torch.cat([starts.flip(0).cummin(0).values.flip(0)[1:], starts.new_full((1,), P)])   # next run's start
    mine = sk < E
    rows = torch.where(first & mine, nxt - pos, 0).to(torch.int32)
    e = torch.where(mine, sk, 0)
    xmap = (order // top_k).to(torch.int32)
    gu = runs(x, stack.w13, torch.cat([2 * e, 2 * e + 1]), torch.cat([rows, rows]), torch.cat([xmap, xmap]), n)
    gate = torch.clamp(gu[:P], max=limit)
    up = torch.clamp(gu[P:], min=-limit, max=limit)
    h = silu(gate) * up
    h = h * weights.reshape(-1)[order][:, None]
    y = runs(h, stack.w2, e, rows, pos.to(torch.int32), n)
    y = torch.where(mine[:, None], y, 0.0)
    slots = torch.empty_like(y).index_copy_(0, order, y).view(n, top_k, -1)
    out = slots[:, 0]
    for j in range(1, top_k):
        out = out + slots[:, j]
    return out


def stack_exl3_experts(experts: dict, n_experts: int) -> Exl3ExpertStack | None:
    """The grouped-kernel stack of a layer's experts whose weights are Exl3Packed single matrices of one shape, rate
    and codebook each (as a pack stores them); None otherwise (the per-expert path runs)."""
    if not experts or not all(isinstance(getattr(e, m), Exl3Packed) and len(getattr(e, m).blocks) == 1
                              for e in experts.values() for m in ("w1", "w2", "w3")):
        return None
    ids = sorted(experts)
    dev = experts[ids[0]].w1.device
    try:
        w13 = _kernel_weight([getattr(experts[e], m).blocks[0] for e in ids for m in ("w1", "w3")])
        w2 = _kernel_weight([experts[e].w2.blocks[0] for e in ids])
    except Exl3FormatError:        # mixed rates or codebooks within the layer: one launch per expert instead
        return None
    for j, e in enumerate(ids):      # the experts' own weights become views into the stack (held once)
        ex = experts[e]
        for m, w, k in (("w1", w13, 2 * j), ("w3", w13, 2 * j + 1), ("w2", w2, j)):
            old = getattr(ex, m).blocks[0]
            setattr(ex, m, Exl3Packed([{**old, "trellis": w.trellis[k], "suh": w.suh[k], "svh": w.svh[k]}]))
    local = torch.full((n_experts,), -1, dtype=torch.int64, device=dev)
    local[torch.tensor(ids, device=dev)] = torch.arange(len(ids), device=dev)
    return Exl3ExpertStack(w13, w2, local)
