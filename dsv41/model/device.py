"""Where the model's weights live on a device (docs/gpu.md): the CUDA start-up checks and the weights kept in their
checkpoint form, as data. Which function computes each op is the op set's business (dsv41/model/ops.py), chosen
once when the model loads.

CPU: the reference: every weight dequantised to float32 at load (unless Model.load(keep_quant=True)).
CUDA: the same model code. FP8 (E4M3, E8M0 per 32x32 block) and packed FP4 expert weights stay in their checkpoint
form in GPU memory as `Fp8Weight` / `Fp4Weight`, a layer's routed experts stacked once as an `ExpertStack` (the
grouped kernel's layout); the op set's `linear` / `routed` take them to a kernel of `kernels/` or to a torch
fallback that dequantises the weight it needs for the call (exact: a power-of-two scale times an E4M3/E2M1 value
is a float32) and multiplies in fixed row tiles.

Exactness on the GPU (docs/architecture.md "Exactness"): a row's bits must not depend on the other rows of a
round. cuBLAS picks algorithms (and split-K) by shape, so products run in tiles of a FIXED row count
(CUDA_ROW_TILE); torch's CUDA reductions pick their thread layout (and so the summation order) from the number of
rows, so the CUDA op set's row sums are a fixed pairwise tree of elementwise adds (kernels.numerics.tree_row_sum);
a kernel must run one configuration for every row count. TF32 is off and checked at start.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsv41.model import quant

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


@dataclass
class FusedWeight:
    """Weights that take the same input, their rows concatenated once at load (Ops.fuse) so one kernel launch
    computes every product (Ops.linear_parts splits the output): `w` the concatenation (an Fp8Weight or a bf16
    tensor), `outs` each weight's rows in order, `cfg` the kernel configuration the parts share. The weights the
    blocks hold are views into it (`part`, `rows`)."""
    w: Fp8Weight | torch.Tensor
    outs: tuple[int, ...]
    cfg: object

    def rows(self, first: int, last: int) -> Fp8Weight | torch.Tensor:
        """Parts first..last-1 as one view of w's rows."""
        a = sum(self.outs[:first])
        return self.w[a:a + sum(self.outs[first:last])]

    def part(self, i: int) -> Fp8Weight | torch.Tensor:
        return self.rows(i, i + 1)


def one_run(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """Equal contiguous tensors that lie one after another in one storage (a fused launch's part blocks) as one
    [len * rows, cols] view; None where they do not."""
    first = parts[0]
    if not first.is_contiguous() or any(p.shape != first.shape or not p.is_contiguous()
                                        or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                                        or p.storage_offset() != first.storage_offset() + i * first.numel()
                                        for i, p in enumerate(parts)):
        return None
    return first.as_strided((len(parts) * first.shape[0], *first.shape[1:]), first.stride())


def fuse_rows(weights: list) -> Fp8Weight | torch.Tensor | None:
    """The weights' rows concatenated (a copy), or None where they are not all FP8 (each in whole 32-row scale
    blocks) or all bf16 tensors with one input width."""
    if len({w.shape[1] for w in weights}) != 1:
        return None
    if all(isinstance(w, Fp8Weight) and w.shape[0] % quant.BLOCK == 0 for w in weights):
        return Fp8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))
    if all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in weights):
        return torch.cat(weights)
    return None


def to_device(w: Fp8Weight | Fp4Weight, device) -> Fp8Weight | Fp4Weight:
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.q.to(device), w.scale.to(device))
    return Fp4Weight(w.packed.to(device), w.scale.to(device))


# ---- helpers the op sets use ---------------------------------------------------------------------------------

def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the GPU: pinned, copied non-blocking (a pageable copy waits for
    the stream to drain; the caching host allocator keeps the pinned block until the copy has read it)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def address_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[B] int64 data pointers of the tensors (0 for an empty one) on `device`, for kernels that reach each
    sequence's own tensor through a table (a pinned, non-blocking copy: no host sync)."""
    table = torch.tensor([t.data_ptr() if t.shape[0] else 0 for t in tensors], dtype=torch.int64, device="cpu")
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


# ---- routed experts as one stack (the grouped kernel's layout) ---------------------------------------------------

@dataclass
class ExpertStack:
    """A layer's routed experts on the GPU in the grouped kernel's layout (docs/kernels.md): w13 [E, 2I, H/2] (w1
    rows then w3 rows), s13 [E, 2I, H/32], w2 [E, H, I/2], s2 [E, H, I/32], checkpoint bytes; `local` maps a global
    expert id to its place in the stack (-1: not on this rank); `shard`, where the rank computes several TP shards
    (MoE.shards > 1; `shard_stack`), each stacked expert's shard (int32, -1: in none). The experts' own Fp4Weights
    are views into it."""
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    local: torch.Tensor
    shard: torch.Tensor | None = None
    identity: bool = False     # local is the identity (every expert on this rank, in id order): ids need no map

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> places in the stack (-1: not here); the ids themselves where the map is the identity
        (one gather launch fewer a layer)."""
        return ids if self.identity else self.local[ids]


def shard_stack(stack: ExpertStack, ranges: list[range]) -> None:
    """Note in the stack which of `ranges` (each TP shard's global expert ids, in shard order) holds each stacked
    expert, so one grouped pass gives every shard's slot sum (Ops.routed_shards)."""
    shard = torch.full((stack.w13.shape[0],), -1, dtype=torch.int32)
    local = stack.local.cpu()
    for i, rng in enumerate(ranges):
        for e in rng:
            if e < local.numel() and local[e] >= 0:
                shard[local[e]] = i
    stack.shard = shard.to(stack.w13.device)


def stack_experts(experts: dict, n_experts: int) -> ExpertStack | None:
    """Stack a layer's Fp4Weight experts (dict id -> moe.Expert) and point each expert's weights into the stack, so
    the grouped kernel and the per-expert fallback read the same memory (held once). Model.load stacks them when
    its op set asks for it (`Ops.stacks_experts`: the CUDA path)."""
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
    return ExpertStack(w13, s13, w2, s2, local, identity=ids == list(range(n_experts)))
