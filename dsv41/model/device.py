"""Where the model's weights live on a device and which function computes each op there (docs/gpu.md).

CPU: today's reference path: every weight dequantised to float32 at load, products in ROW_TILE-row tiles.
CUDA: the same model code. FP8 (E4M3, E8M0 per 32x32 block) and packed FP4 expert weights stay in their checkpoint
form in GPU memory as `Fp8Weight` / `Fp4Weight`; `dsv41.model.linear.linear` hands a product with one of them to
this module, which runs the Triton kernel of `kernels/` when it is there and enabled, and otherwise a torch
fallback that dequantises the weight it needs for the call (exact: a power-of-two scale times an E4M3/E2M1 value
is a float32) and multiplies in fixed row tiles (correct, slow: it reads and writes the weight in float32).

Exactness on the GPU (docs/architecture.md "Exactness"): a row's bits must not depend on the other rows of a
round. cuBLAS picks algorithms (and split-K) by shape, so products run in tiles of a FIXED row count; torch's CUDA
reductions pick their thread layout (and so the summation order) from the number of rows, so the row sums of the
model (`row_sum`) are a fixed pairwise tree of elementwise adds there; a Triton kernel used here must run one
configuration (tile sizes, K order, no split-K) for every row count. TF32 is off and checked at start.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dsv41.model import quant
from kernels.numerics import tree_row_sum  # noqa: F401 - the CUDA path's row sum, re-exported

# Rows per product tile on CUDA: one fixed shape for cuBLAS whatever the round holds. 64 covers a decode round of
# 64 rows in one tile; a 2048-row prompt chunk is 32 tiles.
CUDA_ROW_TILE = 64


# ---- start-up -------------------------------------------------------------------------------------------------

_cuda_ready: set[str] = set()


def setup_cuda(device: torch.device | str = "cuda") -> None:
    """TF32 off everywhere (products are float32, as on the CPU reference) and a check that an fp32 product on
    this device really keeps float32's 24-bit significand. Raises RuntimeError if it does not."""
    os.environ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device(device)
    key = str(dev)
    if key in _cuda_ready:
        return
    check_fp32_matmul(dev)
    _cuda_ready.add(key)


def check_fp32_matmul(device: torch.device) -> None:
    """1 + 2^-20 needs 21 significand bits: TF32 (10 bits) or bf16 would round it to 1, so 16 such products summed
    give exactly 16 + 2^-16 only in float32."""
    a = torch.full((16, 16), 1.0 + 2.0 ** -20, dtype=torch.float32, device=device)
    b = torch.ones((16, 16), dtype=torch.float32, device=device)
    got = (a @ b)[0, 0].item()
    if got != 16.0 + 2.0 ** -16:
        raise RuntimeError(f"float32 matmul on {device} is not float32 (got {got!r}): TF32 or a reduced-precision "
                           f"mode is on; set TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0")


# ---- weights in checkpoint form ---------------------------------------------------------------------------------

@dataclass
class Fp8Weight:
    """An FP8 E4M3 weight [out, in] with its E8M0 scales [ceil(out/32), in/32] (arch.md §4), as stored."""
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __getitem__(self, rows: slice) -> Fp8Weight:
        """Rows a:b (whole 32-row blocks), e.g. one output group of wo_a."""
        a, b, step = rows.indices(self.q.shape[0])
        if step != 1 or a % quant.BLOCK or (b % quant.BLOCK and b != self.q.shape[0]):
            raise ValueError(f"an FP8 weight splits only at 32-row block boundaries, not {a}:{b}")
        return Fp8Weight(self.q[a:b], self.scale[a // quant.BLOCK:-(-b // quant.BLOCK)])

    def dequant(self) -> torch.Tensor:
        return quant.dequant_fp8(self.q, self.scale, torch.float32)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self)

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel()


@dataclass
class Fp4Weight:
    """A routed expert's packed FP4 weight: I8 [out, in/2] (low nibble = even k) + E8M0 [out, in/32], as stored."""
    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dequant(self) -> torch.Tensor:
        return quant.dequant_fp4(self.packed, self.scale, torch.float32)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_matmul(x, self.dequant())

    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel()


def shard_rows(w, n: int) -> list | None:
    """w's rows in n equal shards (views), or None when w cannot be cut so (an FP8 cut inside a 32-row block, a
    packed EXL3 weight)."""
    rows = w.shape[0]
    if rows % n or not isinstance(w, (torch.Tensor, Fp8Weight)):
        return None
    r = rows // n
    if isinstance(w, Fp8Weight) and r % quant.BLOCK:
        return None
    return [w[i * r:(i + 1) * r] for i in range(n)]


def shard_cols(w, n: int) -> list | None:
    """w's columns in n equal shards, each contiguous (a copy: the products want row-major weights), or None when
    w cannot be cut so."""
    cols = w.shape[1]
    if cols % n or not isinstance(w, (torch.Tensor, Fp8Weight)):
        return None
    c = cols // n
    if isinstance(w, torch.Tensor):
        return [w[:, i * c:(i + 1) * c].contiguous() for i in range(n)]
    if c % quant.BLOCK:
        return None
    b = c // quant.BLOCK
    return [Fp8Weight(w.q[:, i * c:(i + 1) * c].contiguous(), w.scale[:, i * b:(i + 1) * b].contiguous())
            for i in range(n)]


def to_device(w: Fp8Weight | Fp4Weight, device) -> Fp8Weight | Fp4Weight:
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.q.to(device), w.scale.to(device))
    return Fp4Weight(w.packed.to(device), w.scale.to(device))


# ---- which function computes each op ------------------------------------------------------------------------------

def _load_kernels() -> dict:
    """The Triton kernels of kernels/ that exist (the gpu_kernels part); missing ones fall back to torch."""
    found = {}
    try:
        from kernels.fp8_linear import fp8_linear as k
        found["fp8_linear"] = k
    except Exception:  # noqa: BLE001, S110 - absent, or Triton missing: the torch fallback runs
        pass
    try:
        from kernels.fp4_moe import fp4_moe as k
        found["fp4_moe"] = k
    except Exception:  # noqa: BLE001, S110
        pass
    try:
        from kernels.indexer import index_scores as k
        found["index_scores"] = k
    except Exception:  # noqa: BLE001, S110
        pass
    try:   # the per-layer row ops: mHC Sinkhorn / collapse / expand, RMSNorm, MoE weights (one launch each)
        from kernels import rowops
        for name in ("rms_norm", "sinkhorn", "hc_collapse", "hc_expand", "route_weights"):
            found[name] = getattr(rowops, name)
    except Exception:  # noqa: BLE001, S110
        pass
    return found


KERNELS = _load_kernels()
# DSV41_KERNELS=0 runs the torch fallbacks on CUDA even where a kernel exists (to compare the two, and a way out
# should a kernel misbehave on some GPU).
_enabled = os.environ.get("DSV41_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def kernels_enabled() -> bool:
    return _enabled


def set_kernels(enabled: bool) -> None:
    """Use the Triton kernels on CUDA (True, the default) or the torch fallbacks (False)."""
    global _enabled
    _enabled = bool(enabled)


# Tests and bench/layer_ops.py only: take the CUDA path's functions (tree row sums; the kernels, which then run
# under TRITON_INTERPRET=1) on CPU tensors, to compare kernels with their torch fallbacks and count the path's ops
# without a GPU. The CPU reference never runs under it.
_emulate_cuda = False


@contextmanager
def cuda_path(enabled: bool = True):
    """Within the block, CPU tensors take the CUDA path's functions (on_cuda_path; kernels only when
    TRITON_INTERPRET=1). Not thread-safe; for tests and benches."""
    global _emulate_cuda
    before = _emulate_cuda
    _emulate_cuda = bool(enabled)
    try:
        yield
    finally:
        _emulate_cuda = before


def on_cuda_path(x: torch.Tensor) -> bool:
    """Whether x takes the CUDA path's functions (x on CUDA, or inside cuda_path())."""
    return x.is_cuda or _emulate_cuda


def address_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[B] int64 data pointers of the tensors (0 for an empty one) on `device`, for kernels that reach each
    sequence's own tensor through a table (a pinned, non-blocking copy: no host sync)."""
    table = torch.tensor([t.data_ptr() if t.shape[0] else 0 for t in tensors], dtype=torch.int64, device="cpu")
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


def kernel(name: str, x: torch.Tensor):
    """The kernel `name` if it exists, is enabled and x is on CUDA (or inside cuda_path() under the Triton
    interpreter); else None."""
    if not _enabled:
        return None
    if not (x.is_cuda or (_emulate_cuda and os.environ.get("TRITON_INTERPRET") == "1")):
        return None
    return KERNELS.get(name)


def row_tile(x: torch.Tensor) -> int:
    from dsv41.model.linear import ROW_TILE
    return CUDA_ROW_TILE if x.is_cuda else ROW_TILE


def tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, in] · w[out, in]ᵀ in fixed row tiles (the reference GEMM; w float32)."""
    from dsv41.model.linear import tiled
    wt = w.t()
    return tiled(lambda t: t @ wt, x)


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    k = kernel("fp8_linear", x)
    if k is not None:
        return k(x.contiguous(), w.q, w.scale).float()
    return tiled_matmul(x, w.dequant())


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The indexer's scores [n, T] (before the visibility mask) in one kernel launch, or None (the torch path)."""
    k = kernel("index_scores", q)
    return None if k is None or keys.shape[1] & (keys.shape[1] - 1) else k(q, w, keys, scale)


# ---- routed experts as one stack (the grouped kernel's layout) ---------------------------------------------------

@dataclass
class ExpertStack:
    """A layer's routed experts on the GPU in the grouped kernel's layout (docs/kernels.md): w13 [E, 2I, H/2] (w1
    rows then w3 rows), s13 [E, 2I, H/32], w2 [E, H, I/2], s2 [E, H, I/32], checkpoint bytes; `local` maps a global
    expert id to its place in the stack (-1: not on this rank). The experts' own Fp4Weights are views into it."""
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    local: torch.Tensor

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float,
               keep: torch.Tensor | None = None) -> torch.Tensor | None:
        """Σ over slots (slot order) of the routed experts' outputs in one grouped launch; None when the kernel is
        absent or disabled (the caller runs the experts one by one). keep [n, k]: only these slots (one TP
        shard's experts); the others contribute nothing, as another rank's do."""
        k = kernel("fp4_moe", x)
        if k is None:
            return None
        local = self.local[ids]
        if keep is not None:
            local = torch.where(keep, local, -1)
        return k(x.contiguous(), self.w13, self.s13, self.w2, self.s2, local, weights, limit)


def stack_experts(experts: dict, n_experts: int) -> ExpertStack | None:
    """Stack a layer's Fp4Weight experts (dict id -> moe.Expert) and point each expert's weights into the stack, so
    the grouped kernel and the per-expert fallback read the same memory (held once)."""
    if experts and type(next(iter(experts.values())).w1).__name__ == "Exl3Packed":   # an EXL3 pack (docs/exl3.md)
        from dsv41.model.exl3_load import stack_exl3_experts
        return stack_exl3_experts(experts, n_experts)
    if not experts or not all(isinstance(e.w1, Fp4Weight) for e in experts.values()):
        return None
    ids = sorted(experts)
    first = experts[ids[0]]
    inter = first.w1.shape[0]
    w13 = torch.stack([torch.cat([experts[e].w1.packed, experts[e].w3.packed]) for e in ids])
    s13 = torch.stack([torch.cat([experts[e].w1.scale, experts[e].w3.scale]) for e in ids])
    w2 = torch.stack([experts[e].w2.packed for e in ids])
    s2 = torch.stack([experts[e].w2.scale for e in ids])
    local = torch.full((n_experts,), -1, dtype=torch.int64, device=w13.device)
    for j, e in enumerate(ids):
        ex = experts[e]
        ex.w1 = Fp4Weight(w13[j, :inter], s13[j, :inter])
        ex.w3 = Fp4Weight(w13[j, inter:], s13[j, inter:])
        ex.w2 = Fp4Weight(w2[j], s2[j])
        local[e] = j
    return ExpertStack(w13, s13, w2, s2, local)
