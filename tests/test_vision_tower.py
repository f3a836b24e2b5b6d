"""The ViT tower, the aligner and the image span against shared/vectors/vision (DeepSeek's release vision.py)."""
import base64
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from dsv41.config import VisionConfig
from dsv41.model.image_prep import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImageError,
                                    expand_image_placeholders, prepare_image)
from dsv41.model.vision import VisionTower, aligner_cells, chunk_image_inputs, image_span, vision_rope_cos_sin, vision_weight_shapes
from dsv41.model.weights import WeightError, vision_tensors

# fp32: the reference's own fp32-vs-fp64 gap is <= 9e-7 of the largest |value| (README: compare at ~1e-5).
FP32_TOL = 1e-5
# bf16: the reference's bf16 run is 0.7-1.3 % of the largest |value| off the exact math, so another bf16 run
# (other kernels) can differ from it by about twice that. We measure 0.6-1.1 % here (0.6-0.9 % off the fp32 math).
BF16_TOL = 2e-2

RELEASE = VisionConfig(num_hidden_layers=32, hidden_size=1024, num_attention_heads=16, intermediate_size=2816,
                       patch_size=14, rope_theta=10000.0, downsample_ratio=3, max_image_tokens=1024,
                       min_pixels=295936, max_wh_ratio=None)


@pytest.fixture(scope="module")
def vec(shared):
    d = shared / "vectors" / "vision"
    with open(d / "vectors.jsonl") as f:
        recs = [json.loads(line) for line in f]
    tc = next(r for r in recs if r["kind"] == "tower_config")
    c = tc["config"]
    cfg = VisionConfig(num_hidden_layers=c["vision_n_layers"], hidden_size=c["vision_dim"],
                       num_attention_heads=c["vision_n_heads"], intermediate_size=c["vision_inter_dim"],
                       patch_size=c["vision_patch_size"], rope_theta=c["vision_rope_theta"],
                       downsample_ratio=c["vision_downsample_ratio"], max_image_tokens=1024, min_pixels=295936)
    return SimpleNamespace(
        tc=tc, cfg=cfg, text_dim=c["dim"],
        weights=load_file(str(d / tc["weights_file"])), outputs=load_file(str(d / tc["outputs_file"])),
        towers=[r for r in recs if r["kind"] == "tower"],
        images={r["id"]: r for r in recs if r["kind"] == "image"},
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def test_rope_tables_match(vec):
    for name, rp in vec.tc["rope"].items():
        cos, sin = vision_rope_cos_sin(rp["n_h"], rp["n_w"], rp["rope_dim"], rp["theta"])
        for got, key in ((cos, "cos_f32_b64"), (sin, "sin_f32_b64")):
            ref = np.frombuffer(base64.b64decode(rp[key]), dtype="<f4").reshape(rp["cos_shape"])
            assert np.array_equal(got.numpy(), ref), (name, key)


def test_weight_names_and_shapes(vec):
    tiny = {k: tuple(v) for k, v in vec.tc["weights"].items()}
    assert vision_weight_shapes(vec.cfg, vec.text_dim) == tiny
    assert {k: tuple(v.shape) for k, v in vec.weights.items()} == tiny
    release = vision_weight_shapes(RELEASE, 5120)
    assert len(release) == 263  # arch.md §4 count
    assert sum(int(np.prod(s)) for s in release.values()) == 485_253_120  # vectors README: ViT + aligner
    # The checkpoint inventory of dsv41.model.weights agrees name by name.
    inv = vision_tensors(SimpleNamespace(vision=RELEASE, text=SimpleNamespace(hidden_size=5120)))
    assert {k: v.shape for k, v in inv.items()} == release


def test_load_names_the_bad_tensor(vec):
    w = dict(vec.weights)
    del w["vision.blocks.1.attn.wo.bias"]
    with pytest.raises(WeightError, match=r"vision\.blocks\.1\.attn\.wo\.bias"):
        VisionTower.load(w, vec.cfg)
    w = dict(vec.weights)
    w["vision.blocks.0.mlp.w1.weight"] = w["vision.blocks.0.mlp.w1.weight"][:96]
    with pytest.raises(WeightError, match=r"vision\.blocks\.0\.mlp\.w1\.weight.*\[96, 64\], expected \[192, 64\]"):
        VisionTower.load(w, vec.cfg)


@pytest.mark.parametrize("mode,dtype,tol", [("fp32", torch.float32, FP32_TOL), ("bf16", torch.bfloat16, BF16_TOL)])
def test_tower_records(vec, mode, dtype, tol):
    tower = VisionTower.load(vec.weights, vec.cfg, dtype=dtype)
    assert vec.towers
    for rec in vec.towers:
        m = rec["modes"][mode]
        nh, nw = rec["n_vit_h"], rec["n_vit_w"]
        iid = rec["image_id"]
        if iid in vec.images:
            # From the PNG bytes through preprocessing, the ViT and the aligner.
            data = base64.b64decode(vec.images[iid]["image"]["b64"])
            rows, n_llm_h, n_llm_w = tower.encode(data)
            assert (n_llm_h, n_llm_w) == (rec["n_llm_h"], rec["n_llm_w"])
            vit = tower.vit(prepare_image(data).patches, nh, nw)
        else:
            # The image bytes are not in this share: start from the stored patch_embed output.
            x = vec.outputs[f"{iid}.fp32.patch_embed"].to(dtype)
            vit = tower.run_blocks(x, nh, nw)
            rows = tower.align(vit, nh, nw)
        assert rows.dtype == dtype
        assert list(vit.shape) == m["vit_shape"] and list(rows.shape) == m["aligner_shape"]
        assert rel_err(rows, vec.outputs[f"{iid}.{mode}.aligner"]) < tol, iid
        ref_rows = torch.tensor([m["aligner_rows"][k] for k in m["aligner_rows"]])
        assert rel_err(rows[[int(k) for k in m["aligner_rows"]]], ref_rows) < tol
        assert abs(rows.float().abs().sum().item() - m["aligner_abs_sum"]) < tol * m["aligner_abs_sum"]
        ref_vit = torch.tensor([m["vit_rows"][k] for k in m["vit_rows"]])
        assert rel_err(vit[[int(k) for k in m["vit_rows"]]], ref_vit) < tol
        if mode == "fp32":
            assert rel_err(vit, vec.outputs[f"{iid}.fp32.vit"]) < tol


def test_tower_616x504_from_image_bytes(vec):
    # Its tower record is not in this share, but its image and outputs are.
    data = base64.b64decode(vec.images["tower_616x504"]["image"]["b64"])
    for mode, dtype, tol in (("fp32", torch.float32, FP32_TOL), ("bf16", torch.bfloat16, BF16_TOL)):
        rows, n_llm_h, n_llm_w = VisionTower.load(vec.weights, vec.cfg, dtype=dtype).encode(data)
        assert (n_llm_h, n_llm_w) == (12, 15)
        assert rel_err(rows, vec.outputs[f"tower_616x504.{mode}.aligner"]) < tol


def test_aligner_cells_are_3x3_channel_major_with_zero_pad():
    nh, nw, dim = 4, 5, 2
    x = torch.arange(nh * nw, dtype=torch.float32)[:, None].repeat(1, dim) + 1  # patch i holds i+1 ...
    x[:, 1] = -x[:, 1]                                                          # ... and -(i+1) in channel 1
    cells = aligner_cells(x, nh, nw, 3)
    assert cells.shape == (2 * 2, dim * 9)
    # Feature c*9 + ky*3 + kx of cell (cy, cx) is channel c of patch (3cy+ky, 3cx+kx), 0 past the grid.
    for cell, (cy, cx) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        for f in range(dim * 9):
            c, ky, kx = f // 9, f % 9 // 3, f % 3
            r, col = 3 * cy + ky, 3 * cx + kx
            want = 0.0 if r >= nh or col >= nw else (r * nw + col + 1) * (1 if c == 0 else -1)
            assert cells[cell, f].item() == want, (cell, f)


def test_image_span_layout():
    n_h, n_w, hidden = 3, 4, 6
    rows = torch.arange(n_h * n_w, dtype=torch.float32)[:, None].repeat(1, hidden)
    start, newline, end = (torch.full((hidden,), v, dtype=torch.bfloat16) for v in (-1.0, -2.0, -3.0))
    embeds, types = image_span(rows, n_h, n_w, start, newline, end)
    n = n_h * (n_w + 1) + 2
    assert embeds.shape == (n, hidden) and embeds.dtype == torch.float32 and types.shape == (n,)
    assert types.tolist() == [IMAGE_START] + ([IMAGE] * n_w + [IMAGE_NEW_LINE]) * n_h + [IMAGE_END]
    assert (embeds[types == IMAGE_START] == -1).all()
    assert (embeds[types == IMAGE_NEW_LINE] == -2).all()
    assert (embeds[types == IMAGE_END] == -3).all()
    # IMAGE positions take the aligner rows in reading order.
    assert embeds[types == IMAGE][:, 0].tolist() == list(range(n_h * n_w))
    with pytest.raises(ValueError, match="not"):
        image_span(rows[:-1], n_h, n_w, start, newline, end)
    with pytest.raises(ValueError, match="newline row"):
        image_span(rows, n_h, n_w, start, newline[:-1], end)


def test_chunked_image_inputs_equal_the_whole_prompt():
    hidden, image_id = 4, 129264
    grids = [(2, 3), (1, 2)]
    ids = [0, 11, image_id, 12, 13, image_id, 14]
    out = expand_image_placeholders(ids, grids, image_id)
    spans = []
    for k, ((n_h, n_w), start) in enumerate(zip(grids, out.image_starts)):
        rows = torch.arange(n_h * n_w, dtype=torch.float32)[:, None].repeat(1, hidden) + 100 * (k + 1)
        e, t = image_span(rows, n_h, n_w, torch.full((hidden,), -1.0), torch.full((hidden,), -2.0),
                          torch.full((hidden,), -3.0))
        spans.append((start, e, t))
    T = len(out.tokens)
    whole_e, whole_t = chunk_image_inputs(spans, 0, T, hidden)
    assert whole_t.tolist() == out.token_types
    for k, (start, e, t) in enumerate(spans):
        assert torch.equal(whole_e[start:start + len(e)], e)
    assert (whole_e[whole_t < 0] == 0).all()
    assert chunk_image_inputs(spans, 0, 2, hidden) == (None, None)  # text-only chunk
    for cuts in ([1], [3, 4, 9], list(range(1, T)), [5, 17, 20]):
        bounds = [0] + cuts + [T]
        es, ts = [], []
        for a, b in zip(bounds, bounds[1:]):
            e, t = chunk_image_inputs(spans, a, b, hidden)
            es.append(e if e is not None else torch.zeros(b - a, hidden))
            ts.append(t if t is not None else torch.full((b - a,), -1))
        assert torch.equal(torch.cat(es), whole_e) and torch.equal(torch.cat(ts), whole_t)


def test_five_sizes_end_to_end_and_pure_per_image(vec):
    tower = VisionTower.load(vec.weights, vec.cfg)
    rng = np.random.default_rng(5)
    sizes = [(64, 48), (800, 600), (300, 1200), (2000, 150), (600, 560)]  # upscale, pad rows/cols, wide, tall
    blobs = []
    for w, h in sizes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    start, newline, end = (torch.randn(vec.text_dim) for _ in range(3))
    first = []
    for data in blobs:
        rows, n_h, n_w = tower.encode(data)
        assert rows.shape == (n_h * n_w, vec.text_dim)
        embeds, types = image_span(rows, n_h, n_w, start, newline, end)
        assert len(embeds) == len(types) == n_h * (n_w + 1) + 2 == prepare_image(data).n_tokens
        first.append(rows)
    assert len({r.shape for r in first}) == 5
    # An image's rows do not depend on which images were encoded before it (one image per call).
    for data, rows in reversed(list(zip(blobs, first))):
        assert torch.equal(tower.encode(data)[0], rows)


def test_encode_rejects_bad_bytes(vec):
    tower = VisionTower.load(vec.weights, vec.cfg)
    with pytest.raises(ImageError):
        tower.encode(b"\x89PNG\r\n\x1a\n broken")
