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
from dsv41.model.exl3 import Exl3FormatError, dequant_exl3, official_name
from dsv41.model.weights import BF16, F32, RankShare, TensorSpec, WeightError, expected_tensors, read_weight_map

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
        w = dequant_exl3(parts)
    except Exl3FormatError as e:
        raise WeightError(lin.module, str(e)) from None
    return w.t()


def load_exl3_weights(ckpt: str | Path, cfg: ModelConfig, share: RankShare = RankShare(0, 1),
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      keep_quant: bool = False) -> dict[str, torch.Tensor]:
    """The share's tensors of an EXL3 pack under official names, as `weights.load_weights` returns them for an
    official checkpoint (module doc). Engram tables are checked (all or none in the pack) but not returned.

    keep_quant (the GPU path keeps FP8/FP4 in checkpoint form) does not apply yet: EXL3 linears are decoded to
    dense weights on every device; computing with the codes on CUDA (kernels/exl3.py) is the next step."""
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
            w = torch.cat([decode_linear(lin, shards) for lin in lins], dim=0)
            part = share.split(name, tuple(w.shape))
            if part is not None:
                w = w.narrow(part[0], part[1], part[2] - part[1])
            out[name] = w.to(dtype).contiguous().to(device)
    return out
