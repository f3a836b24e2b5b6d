"""The DeepSeek-ViT tower, its 3x3 aligner, and the image span layout (arch.md §5), as DeepSeek's release
`inference/vision.py` computes them.

ViT: patch_embed (588 -> dim, bias) ; n_layers pre-norm blocks
    x += wo(SDPA(rope(q), rope(k), v))      q, k, v = wqkv(norm1(x)).chunk(3), bidirectional, 2D rotary
    x += w2(silu(gate) * up)                gate, up = w1(norm2(x)).chunk(2); no MLP biases
then the final norm. RMSNorms have fp32 gains, eps 1e-6, and compute in fp32.
Aligner: [n_vit_h, n_vit_w, dim] zero-padded bottom/right to multiples of 3, unfolded 3x3 channel-major
(feature c*9 + ky*3 + kx), cells in reading order, then w2(gelu_erf(w1(.))) -> rows of the text width.

Tensors keep the checkpoint's names (`vision.*`, `aligner.*`); `vision_weight_shapes` lists them.

Exactness: one image is encoded by itself, never batched with others, so its rows are a pure function of its bytes
(row counts depend only on the image). The model takes the rows through `image_span`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .image_prep import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImagePrepConfig, PreparedImage,
                         image_token_types, prepare_image)
from .weights import WeightError

RMS_EPS = 1e-6  # every vision RMSNorm (the reference's default; arch.md §5.1)


def vision_weight_shapes(vision_cfg, text_dim: int) -> dict[str, tuple[int, ...]]:
    """Every vision/aligner tensor of the checkpoint with its shape (all BF16 in the release).

    `vision_cfg` needs the checkpoint's vision_config field names: num_hidden_layers, hidden_size,
    num_attention_heads, intermediate_size, patch_size, downsample_ratio. `text_dim` is the text hidden size the
    aligner projects to. The release (32 layers, 1024, 2816, 14, 3; text 5120) gives 263 tensors.
    """
    dim, inter = int(vision_cfg.hidden_size), int(vision_cfg.intermediate_size)
    patch_in = 3 * int(vision_cfg.patch_size) ** 2
    cell_in = dim * int(vision_cfg.downsample_ratio) ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "vision.patch_embed.proj.weight": (dim, patch_in),
        "vision.patch_embed.proj.bias": (dim,),
    }
    for i in range(int(vision_cfg.num_hidden_layers)):
        b = f"vision.blocks.{i}."
        shapes.update({
            b + "norm1.weight": (dim,),
            b + "attn.wqkv.weight": (3 * dim, dim),
            b + "attn.wqkv.bias": (3 * dim,),
            b + "attn.wo.weight": (dim, dim),
            b + "attn.wo.bias": (dim,),
            b + "norm2.weight": (dim,),
            b + "mlp.w1.weight": (2 * inter, dim),  # gate rows first, then up rows
            b + "mlp.w2.weight": (dim, inter),
        })
    shapes.update({
        "vision.norm.weight": (dim,),
        "aligner.w1.weight": (text_dim, cell_in),
        "aligner.w1.bias": (text_dim,),
        "aligner.w2.weight": (text_dim, text_dim),
        "aligner.w2.bias": (text_dim,),
    })
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """weight * x / rms(x), computed in fp32 with the fp32 gain, cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def vision_rope_cos_sin(n_h: int, n_w: int, rope_dim: int, theta: float,
                        device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """2D rotary tables [n_h*n_w, 1, rope_dim] (fp32) for patch i = row*n_w + col.

    rope_dim = head_dim/2: its first half holds row*inv_freq, its second col*inv_freq, inv_freq[j] =
    theta^(-2j/rope_dim). They rotate the head's pairs (d, d + head_dim/2), so the whole head is rotated.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    pos = torch.arange(n_h * n_w, device=device)
    rows = (pos // n_w).float()[:, None] * inv_freq
    cols = (pos % n_w).float()[:, None] * inv_freq
    freqs = torch.cat([rows, cols], dim=-1)
    return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on [n, heads, head_dim] in fp32, cast back to x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def aligner_cells(x: torch.Tensor, n_vit_h: int, n_vit_w: int, ratio: int) -> torch.Tensor:
    """[n_vit_h*n_vit_w, dim] -> [n_llm_h*n_llm_w, dim*ratio^2]: the grid zero-padded at the bottom and right to
    multiples of `ratio`, cut into ratio x ratio cells in reading order, each cell's feature c*ratio^2 + ky*ratio + kx
    (F.unfold's channel-major order)."""
    if x.shape[0] != n_vit_h * n_vit_w:
        raise ValueError(f"{x.shape[0]} ViT rows do not make a {n_vit_h}x{n_vit_w} grid")
    grid = x.view(n_vit_h, n_vit_w, -1).permute(2, 0, 1)              # [dim, H, W]
    grid = F.pad(grid, (0, -n_vit_w % ratio, 0, -n_vit_h % ratio))
    return F.unfold(grid.unsqueeze(0), ratio, stride=ratio).squeeze(0).t()


class VisionTower:
    """The ViT and aligner with the checkpoint's tensors. `dtype` is the compute dtype of the linears and
    activations (float32: the clean reference; bfloat16: as the release runs); norm gains and rotary stay fp32."""

    def __init__(self, weights: dict[str, torch.Tensor], vision_cfg, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", prep: ImagePrepConfig | None = None):
        if "aligner.w2.weight" not in weights:
            raise WeightError("aligner.w2.weight", "missing from the vision weights")
        self.text_dim = int(weights["aligner.w2.weight"].shape[0])
        shapes = vision_weight_shapes(vision_cfg, self.text_dim)
        self.w: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            t = weights.get(name)
            if t is None:
                raise WeightError(name, f"missing from the vision weights (expected shape {list(shape)})")
            if tuple(t.shape) != shape:
                raise WeightError(name, f"has shape {list(t.shape)}, expected {list(shape)}")
            gain = name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "vision.norm.weight"
            self.w[name] = t.to(device=device, dtype=torch.float32 if gain else dtype)
        self.dtype = dtype
        self.device = torch.device(device)
        self.n_layers = int(vision_cfg.num_hidden_layers)
        self.dim = int(vision_cfg.hidden_size)
        self.n_heads = int(vision_cfg.num_attention_heads)
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ValueError(f"vision hidden_size {self.dim} / {self.n_heads} heads must give a head_dim "
                             f"divisible by 4 (2D rotary on half of it)")
        self.head_dim = self.dim // self.n_heads
        self.rope_dim = self.head_dim // 2
        self.rope_theta = float(vision_cfg.rope_theta)
        self.patch_size = int(vision_cfg.patch_size)
        self.downsample_ratio = int(vision_cfg.downsample_ratio)
        self.prep = prep if prep is not None else ImagePrepConfig.from_vision_config(vision_cfg)

    @classmethod
    def load(cls, weights: dict[str, torch.Tensor], vision_cfg, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", prep: ImagePrepConfig | None = None) -> "VisionTower":
        """From a dict of checkpoint tensors (extra keys are ignored). Raises WeightError naming a tensor."""
        return cls(weights, vision_cfg, dtype=dtype, device=device, prep=prep)

    def _linear(self, x: torch.Tensor, name: str, bias: bool = True) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"] if bias else None)

    # -- ViT ------------------------------------------------------------------------------------------------------

    def embed_patches(self, patches: torch.Tensor) -> torch.Tensor:
        """[n, 3, p, p] patches (bf16 from image_prep) -> [n, dim]."""
        x = patches.to(device=self.device, dtype=self.dtype).flatten(1)
        return self._linear(x, "vision.patch_embed.proj")

    def block(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b = f"vision.blocks.{i}."
        n = x.shape[0]
        h = rms_norm(x, self.w[b + "norm1.weight"])
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self._linear(h, b + "attn.wqkv").chunk(3, -1))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Every patch attends to every patch of its image (no mask); scale head_dim^-1/2. Batched 4-D
        # [1, heads, n, head_dim]: 3-D input makes CUDA fall back to the materialised math kernel (28x slower).
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)[0]
        x = x + self._linear(o.transpose(0, 1).reshape(n, self.dim), b + "attn.wo")
        h = rms_norm(x, self.w[b + "norm2.weight"])
        gate, up = self._linear(h, b + "mlp.w1", bias=False).chunk(2, -1)
        return x + self._linear(F.silu(gate) * up, b + "mlp.w2", bias=False)

    def run_blocks(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """Embedded patches [n_vit_h*n_vit_w, dim] -> the ViT output after the final norm."""
        if x.shape[0] != n_vit_h * n_vit_w:
            raise ValueError(f"{x.shape[0]} patch rows do not make a {n_vit_h}x{n_vit_w} grid")
        cos, sin = vision_rope_cos_sin(n_vit_h, n_vit_w, self.rope_dim, self.rope_theta, self.device)
        for i in range(self.n_layers):
            x = self.block(i, x, cos, sin)
        return rms_norm(x, self.w["vision.norm.weight"])

    def vit(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        return self.run_blocks(self.embed_patches(patches), n_vit_h, n_vit_w)

    # -- aligner --------------------------------------------------------------------------------------------------

    def align(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """ViT output [n_vit_h*n_vit_w, dim] -> aligner rows [n_llm_h*n_llm_w, text_dim] in reading order."""
        cells = aligner_cells(x, n_vit_h, n_vit_w, self.downsample_ratio)
        return self._linear(F.gelu(self._linear(cells, "aligner.w1")), "aligner.w2")  # exact (erf) GELU

    # -- whole image ----------------------------------------------------------------------------------------------

    def encode_patches(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        return self.align(self.vit(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)

    def encode_prepared(self, image: PreparedImage) -> tuple[torch.Tensor, int, int]:
        plan = image.plan
        rows = self.encode_patches(image.patches, plan.n_vit_h, plan.n_vit_w)
        return rows, plan.n_llm_h, plan.n_llm_w

    def encode(self, image_bytes: bytes) -> tuple[torch.Tensor, int, int]:
        """Image bytes -> (aligner rows [n_llm_h*n_llm_w, text_dim], n_llm_h, n_llm_w). Raises ImageError."""
        return self.encode_prepared(prepare_image(image_bytes, self.prep))


def image_span(image_rows: torch.Tensor, n_h: int, n_w: int, start: torch.Tensor, newline: torch.Tensor,
               end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input rows and token types of one image span, position by position.

    [START] ([IMAGE]*n_w [NEWLINE])*n_h [END]: START/NEWLINE/END take the learned `image_start`/`image_newline`/
    `image_end` rows, IMAGE positions the aligner rows in reading order. Returns (embeds [n_h*(n_w+1)+2, hidden] in
    image_rows' dtype, token_type int64 [same n]). Every position's id is image_token_id; the forward replaces the
    embedding of span positions by these rows.
    """
    if image_rows.dim() != 2 or image_rows.shape[0] != n_h * n_w:
        raise ValueError(f"image_rows {list(image_rows.shape)} is not [{n_h}*{n_w}, hidden]")
    hidden = image_rows.shape[1]
    for name, row in (("start", start), ("newline", newline), ("end", end)):
        if row.shape != (hidden,):
            raise ValueError(f"image {name} row has shape {list(row.shape)}, expected [{hidden}]")
    cast = dict(dtype=image_rows.dtype, device=image_rows.device)
    grid = image_rows.view(n_h, n_w, hidden)
    newlines = newline.to(**cast).expand(n_h, 1, hidden)
    body = torch.cat([grid, newlines], dim=1).reshape(n_h * (n_w + 1), hidden)
    embeds = torch.cat([start.to(**cast)[None], body, end.to(**cast)[None]], dim=0)
    token_type = image_token_types(n_h, n_w)     # on the host, as the forward reads the types there
    return embeds, token_type


def chunk_image_inputs(spans, a: int, b: int, hidden: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """SeqInput.embeds / token_type for prompt positions [a, b).

    `spans` lists each image as (start position, embeds, token_type) from `image_span`. Returns embeds
    [b-a, hidden] (zero rows at text positions, which the forward ignores) and token_type [b-a] (-1 at text), or
    (None, None) when no image position falls in the range, so text-only chunks pass nothing. A span may be cut
    across chunks anywhere: the rows of a position do not depend on the cut.
    """
    embeds = token_type = None
    for start, rows, types in spans:
        lo, hi = max(a, start), min(b, start + rows.shape[0])
        if lo >= hi:
            continue
        if embeds is None:
            embeds = rows.new_zeros((b - a, hidden))
            token_type = torch.full((b - a,), -1, dtype=torch.int64, device=types.device)
        embeds[lo - a:hi - a] = rows[lo - start:hi - start]
        token_type[lo - a:hi - a] = types[lo - start:hi - start]
    return embeds, token_type


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """One image ready for the prompt: its span rows (`image_span`), keyed by the sha256 of its bytes."""
    digest: bytes                 # sha256 of the image file's bytes
    n_h: int                      # token grid (n_llm_h, n_llm_w)
    n_w: int
    embeds: torch.Tensor          # [n_h*(n_w+1)+2, hidden] float32
    token_type: torch.Tensor      # [same n] int64, START/IMAGE/NEW_LINE/END

    @property
    def n_tokens(self) -> int:
        return int(self.token_type.numel())


@dataclass(frozen=True)
class PromptImage:
    """An encoded image placed in a prompt: its span covers positions [start, start + n_tokens)."""
    start: int
    image: EncodedImage

    @property
    def end(self) -> int:
        return self.start + self.image.n_tokens


def image_sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


SPAN_ROW_NAMES = ("image_start", "image_newline", "image_end")


def has_vision_weights(ckpt: str | Path) -> bool:
    from .weights import read_weight_map
    return any(k.startswith(("vision.", "aligner.")) for k in read_weight_map(ckpt))


def load_vision_weights(ckpt: str | Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tower's, the aligner's and the span rows' tensors of a checkpoint (nothing else is read), as stored.
    Raises WeightError naming a missing tensor."""
    from safetensors import safe_open

    from .weights import read_weight_map
    d = Path(ckpt)
    wm = read_weight_map(d)
    names = [k for k in wm if k.startswith(("vision.", "aligner."))] + list(SPAN_ROW_NAMES)
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in wm:
            raise WeightError(name, "missing from the checkpoint's weight_map")
        by_file.setdefault(wm[name], []).append(name)
    for fname, group in by_file.items():
        with safe_open(d / fname, framework="pt") as f:
            for name in group:
                out[name] = f.get_tensor(name).to(device)
    return out


def encode_image(tower: VisionTower, image: PreparedImage, digest: bytes, start: torch.Tensor,
                 newline: torch.Tensor, end: torch.Tensor) -> EncodedImage:
    """A prepared image through the tower and the aligner, laid out as its span (rows in float32)."""
    rows, n_h, n_w = tower.encode_prepared(image)
    embeds, token_type = image_span(rows.float(), n_h, n_w, start, newline, end)
    return EncodedImage(digest, n_h, n_w, embeds, token_type)


__all__ = ["VisionTower", "EncodedImage", "PromptImage", "encode_image", "load_vision_weights",
           "has_vision_weights", "image_sha256", "aligner_cells", "vision_weight_shapes", "image_span", "rms_norm",
           "apply_rotary", "vision_rope_cos_sin", "IMAGE_START", "IMAGE", "IMAGE_NEW_LINE", "IMAGE_END"]
