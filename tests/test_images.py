"""Images through the serving path (issue 11): the rows the server feeds for an image against a plain reference
written here from arch.md §5 (decode, minimum area, multiples of 14, gray pad, normalisation, the ViT with 2D RoPE,
the 3x3 merge, the aligner, the span layout), and the logits of prompts holding them; chunked prompts and kept
states; the policy's refusals. The live server is tests/test_images_live.py."""
from __future__ import annotations

import base64
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from dsv41 import BUILTIN_TOKENIZER_DIR
from dsv41.serve_config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent
SMALL_MIN_PIXELS = 42 * 42 * 9      # images of a few dozen tokens keep the CPU tests fast; the rules are the same


def make_vision_checkpoint(out: Path, min_pixels: int = SMALL_MIN_PIXELS) -> Path:
    """make_tiny --vision, with a smaller vision_config.min_pixels (every image still takes the same path)."""
    subprocess.run([sys.executable, "-m", "dsv41.tools.make_tiny", "--out", str(out), "--seed", "0", "--vision",
                    "--tokenizer", str(BUILTIN_TOKENIZER_DIR)], cwd=ROOT, check=True, capture_output=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vision_config"]["min_pixels"] = min_pixels
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def image_bytes(w: int, h: int, fmt: str = "PNG", seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
    if mode != "RGB":
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# Five images: upscaled small, landscape, tall, very wide, square; five formats.
FIVE = [((64, 48), "PNG"), ((300, 200), "JPEG"), ((90, 400), "WEBP"), ((500, 60), "GIF"), ((200, 200), "BMP")]


# ------------------------------------------------------------------------------------------------ the reference
def ref_rows(data: bytes, w: dict, vcfg: dict) -> tuple[torch.Tensor, int, int]:
    """arch.md §5 in plain loops: bytes -> aligner rows [n_h*n_w, H] in reading order (float32)."""
    p, r = vcfg["patch_size"], vcfg["downsample_ratio"]
    im = Image.open(io.BytesIO(data)).convert("RGB")
    width, height = im.size
    if width * height < vcfg["min_pixels"]:                       # scale up to about the minimum area
        s = math.sqrt(vcfg["min_pixels"] / (width * height))
        width, height = int(width * s), int(height * s)
    W, H = math.ceil(width / p) * p, math.ceil(height / p) * p    # sides up to multiples of the patch
    n_llm_h, n_llm_w = math.ceil(H // p / r), math.ceil(W // p / r)
    assert n_llm_h * (n_llm_w + 1) + 2 <= vcfg["max_image_tokens"]   # these images stay within the budget
    padded = ImageOps.pad(im, (W, H), method=Image.BICUBIC, color=(127, 127, 127))   # aspect-fit, gray pad
    x = torch.from_numpy(np.array(padded)).float()                               # [H, W, 3]
    x = (((x / 255) - 0.5) / 0.5).to(torch.bfloat16).float()                      # normalise, one bf16 cast
    nh, nw = H // p, W // p
    patches = x.view(nh, p, nw, p, 3).permute(0, 2, 4, 1, 3).reshape(nh * nw, 3 * p * p)  # c-major per patch
    f = {k: v.float() for k, v in w.items()}
    h = patches @ f["vision.patch_embed.proj.weight"].T + f["vision.patch_embed.proj.bias"]
    D, heads = vcfg["hidden_size"], vcfg["num_attention_heads"]
    hd = D // heads
    rd = hd // 2
    inv = vcfg["rope_theta"] ** (-torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    rows_i = torch.arange(nh).repeat_interleave(nw).float()
    cols_i = torch.arange(nw).repeat(nh).float()
    ang = torch.cat([rows_i[:, None] * inv, cols_i[:, None] * inv], dim=1)      # [n, rd/2 + rd/2] = [n, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, 1), torch.cat([ang.sin()] * 2, 1)     # pairs (d, d + hd/2)

    def rms(v, g):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    def rope(v):                                                                # [n, heads, hd]
        half = torch.cat([-v[..., hd // 2:], v[..., :hd // 2]], -1)
        return v * cos[:, None] + half * sin[:, None]

    n = nh * nw
    for i in range(vcfg["num_hidden_layers"]):
        b = f"vision.blocks.{i}."
        q, k, v = (rms(h, f[b + "norm1.weight"]) @ f[b + "attn.wqkv.weight"].T + f[b + "attn.wqkv.bias"]).split(D, -1)
        q, k, v = rope(q.view(n, heads, hd)), rope(k.view(n, heads, hd)), v.view(n, heads, hd)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, D)
        h = h + o @ f[b + "attn.wo.weight"].T + f[b + "attn.wo.bias"]
        gate, up = (rms(h, f[b + "norm2.weight"]) @ f[b + "mlp.w1.weight"].T).split(vcfg["intermediate_size"], -1)
        h = h + (torch.nn.functional.silu(gate) * up) @ f[b + "mlp.w2.weight"].T
    h = rms(h, f["vision.norm.weight"]).view(nh, nw, D)
    cells = []
    for cy in range(n_llm_h):                                                   # 3x3 cells, zero past the grid
        for cx in range(n_llm_w):
            feat = torch.zeros(D, r, r)
            for ky in range(r):
                for kx in range(r):
                    y, xx = cy * r + ky, cx * r + kx
                    if y < nh and xx < nw:
                        feat[:, ky, kx] = h[y, xx]
            cells.append(feat.reshape(-1))                                     # c*9 + ky*3 + kx
    c = torch.stack(cells)
    a = torch.nn.functional.gelu(c @ f["aligner.w1.weight"].T + f["aligner.w1.bias"])
    return a @ f["aligner.w2.weight"].T + f["aligner.w2.bias"], n_llm_h, n_llm_w


def ref_span(rows, n_h, n_w, w) -> tuple[torch.Tensor, list[int]]:
    """[START] ([IMAGE]*n_w [NEWLINE])*n_h [END] with the learned rows; types 0 start, 1 image, 2 newline, 3 end."""
    out, types = [w["image_start"].float()], [0]
    for y in range(n_h):
        for x in range(n_w):
            out.append(rows[y * n_w + x])
            types.append(1)
        out.append(w["image_newline"].float())
        types.append(2)
    out.append(w["image_end"].float())
    types.append(3)
    return torch.stack(out), types


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_vision_checkpoint(tmp_path_factory.mktemp("vision_ckpt"))


@pytest.fixture(scope="module")
def service(ckpt):
    from dsv41.api.images import ImageService
    svc = ImageService.load(ckpt, ServeConfig())
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def model(ckpt):
    from dsv41.model.model import Model
    return Model.load(ckpt)


@pytest.fixture(scope="module")
def weights(ckpt):
    from dsv41.model.vision import load_vision_weights
    return load_vision_weights(ckpt)


@pytest.fixture(scope="module")
def vcfg(ckpt):
    return json.loads((ckpt / "config.json").read_text())["vision_config"]


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# ------------------------------------------------------------------------------------------------ tests
def test_five_images_rows_and_token_count_match_the_reference(service, weights, vcfg):
    seen = set()
    for (wh, fmt) in FIVE:
        data = image_bytes(*wh, fmt=fmt, seed=wh[0])
        enc = service.encode_sync(data)
        rows, n_h, n_w = ref_rows(data, weights, vcfg)
        assert (enc.n_h, enc.n_w) == (n_h, n_w), wh
        assert enc.n_tokens == n_h * (n_w + 1) + 2
        span, types = ref_span(rows, n_h, n_w, weights)
        assert enc.token_type.tolist() == types
        assert rel(enc.embeds, span) < 1e-5, (wh, fmt)
        seen.add((n_h, n_w))
    assert len(seen) == 5


def test_more_formats_match_the_reference(ckpt, service, weights, vcfg):
    """TIFF, a CMYK JPEG (Pillow's conversion, as the reference), and a JPEG with an EXIF orientation tag (ignored,
    as the reference ignores it, unless --image-exif-orientation)."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, size=(70, 110, 3), dtype=np.uint8)).save(
        buf, format="JPEG", exif=_exif_rotate_90())
    rotated = buf.getvalue()
    for data in (image_bytes(130, 60, "TIFF", seed=1), image_bytes(90, 90, "JPEG", seed=2, mode="CMYK"), rotated):
        enc = service.encode_sync(data)
        rows, n_h, n_w = ref_rows(data, weights, vcfg)
        assert (enc.n_h, enc.n_w) == (n_h, n_w) and rel(enc.embeds, ref_span(rows, n_h, n_w, weights)[0]) < 1e-5
    assert Image.open(io.BytesIO(rotated)).getexif()[0x0112] == 6
    from dsv41.api.images import ImageService
    upright = ImageService.load(ckpt, ServeConfig(image_exif_orientation=True))
    try:
        plain, turned = service.encode_sync(rotated), upright.encode_sync(rotated)
        assert (plain.n_h, plain.n_w) == (turned.n_w, turned.n_h) != (turned.n_h, turned.n_w)   # 110x70 -> 70x110
        assert upright.prep.apply_exif_orientation and not service.prep.apply_exif_orientation
    finally:
        upright.close()


def _exif_rotate_90():
    exif = Image.Exif()
    exif[0x0112] = 6      # "rotate 90 clockwise to display"
    return exif


def _prompt(tok, image_id: int) -> list[int]:
    return [tok.bos_id] + tok.encode("<｜User｜>Look:", special=True) + [image_id] + \
        tok.encode(" what is it?<｜Assistant｜></think>", special=True)


def test_logits_of_a_prompt_with_five_images_whole_and_chunked(service, model, weights):
    """A prompt holding the five images: its logits run the runner's way (span rows sliced per chunk, spans cut
    anywhere) equal bitwise those of one pass whose inputs the reference lays out (ref_span placed at each
    placeholder, positions running on across spans). The rows themselves are checked against the reference tower
    above; the logits are compared on the same rows because a random-weight MoE turns 1e-7 differences into other
    experts."""
    from dsv41.chat.tokenizer import Tokenizer
    from dsv41.model.image_prep import expand_image_placeholders
    from dsv41.model.model import SeqInput
    from dsv41.model.vision import PromptImage
    from dsv41.sched.images import chunk_rows
    tok = Tokenizer.from_dir(BUILTIN_TOKENIZER_DIR)
    img_id = model.cfg.image_token_id
    H = model.t.hidden_size
    encs = [service.encode_sync(image_bytes(*wh, fmt=fmt, seed=wh[0])) for wh, fmt in FIVE]
    placeholder = [tok.bos_id] + tok.encode("<｜User｜>", special=True)
    for k in range(5):
        placeholder += tok.encode(f" picture {k}:", special=True) + [img_id]
    placeholder += tok.encode(" which is red?<｜Assistant｜></think>", special=True)
    out = expand_image_placeholders(placeholder, [(e.n_h, e.n_w) for e in encs], img_id)
    ids, ref_e, ref_t, starts = [], [], [], []
    for t in placeholder:                           # the reference layout, placeholder by placeholder
        if t != img_id:
            ids.append(t)
            ref_e.append(torch.zeros(1, H))
            ref_t.append(-1)
            continue
        enc = encs[len(starts)]
        rows = enc.embeds[1:-1].view(enc.n_h, enc.n_w + 1, H)[:, :-1].reshape(-1, H)   # the aligner rows
        span, types = ref_span(rows, enc.n_h, enc.n_w, weights)
        assert len(types) == enc.n_h * (enc.n_w + 1) + 2
        starts.append(len(ids))
        ids += [img_id] * len(types)
        ref_e.append(span)
        ref_t += types
    assert ids == out.tokens and starts == out.image_starts
    ids = torch.tensor(ids)
    ref = model.forward([SeqInput(model.new_state(), ids, embeds=torch.cat(ref_e), token_type=torch.tensor(ref_t)),
                         ])[0]
    spans = [PromptImage(s, e) for s, e in zip(starts, encs)]
    cuts = [starts[0] + 3, (starts[2] + spans[2].end) // 2, len(ids)]
    st, parts, a = model.new_state(), [], 0
    for b in cuts:
        e, t = chunk_rows(spans, a, b - a, H)
        parts.append(model.forward([SeqInput(st, ids[a:b], embeds=e, token_type=t, logits="all")])[0])
        a = b
    assert torch.equal(torch.cat(parts), ref)


def test_same_bytes_share_rows_and_other_bytes_do_not(service):
    a, b = image_bytes(64, 48, seed=1), image_bytes(64, 48, seed=2)
    ea = service.encode_sync(a)
    assert service.encode_sync(a) is ea                      # cached while someone holds it
    eb = service.encode_sync(b)
    assert (eb.n_h, eb.n_w) == (ea.n_h, ea.n_w) and not torch.equal(eb.embeds, ea.embeds)
    assert ea.digest != eb.digest


def test_kept_states_resume_up_to_the_first_image_unless_its_bytes_match():
    from dsv41.sched.kept import ImageSpan, KeptIndex
    idx = KeptIndex(1 << 30, lambda n: 100 * n, model_id="m")
    ids = list(range(100, 140))
    img = ImageSpan(10, 20, b"a" * 32)
    e, _ = idx.plan_save(ids, None, [img])
    assert idx.plan_save(ids[:8], None, [img]) is not None       # before the image
    assert idx.plan_save(ids[:15], None, [img]) is None          # inside the image: never kept
    assert idx.lookup(ids + [1], None, [img]) is e               # same bytes: the whole prefix
    other = ImageSpan(10, 20, b"b" * 32)
    got = idx.lookup(ids + [1], None, [other])                   # other bytes, same ids: up to the image only
    assert got is not None and got.length <= 10
    e2, dropped = idx.plan_save(ids, None, [other])              # the same ids with other bytes replace the state
    assert dropped == [e] and e.key not in idx and e2.key in idx
    assert idx.lookup(ids + [1], None, [other]) is e2 and idx.lookup(ids + [1], None, [img]).length <= 10
    idx.check()


def test_policy_refusals():
    from dsv41.chat.errors import ChatError
    from dsv41.chat.policy import build_chat_prompt
    from dsv41.chat.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(BUILTIN_TOKENIZER_DIR)
    url = data_url(image_bytes(20, 20))
    part = {"type": "image_url", "image_url": {"url": url}}
    cases = [
        ([{"role": "system", "content": [part]}, {"role": "user", "content": "hi"}], {}, "only in user"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]}], {}, "only in user"),
        ([{"role": "user", "content": [part, part, part]}], {"max_images": 2}, "at most 2 images"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}], {},
         "URLs are off"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}]}],
         {}, "not valid base64"),
    ]
    for msgs, kw, want in cases:
        with pytest.raises(ChatError, match=want):
            build_chat_prompt({"messages": msgs}, tok, **kw)
    # The placeholder typed as text: with the shield (the server) it is text; without, a refusal.
    msgs = [{"role": "user", "content": "see <｜deepseek_image｜> here"}]
    assert build_chat_prompt({"messages": msgs}, tok).images == []
    assert tok.image_id not in build_chat_prompt({"messages": msgs}, tok).token_ids
    with pytest.raises(ChatError, match="placeholder"):
        build_chat_prompt({"messages": msgs}, tok, shield=False)
    # Tool results take images.
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "shot:"}, part]}]
    p = build_chat_prompt({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}, tok)
    assert len(p.images) == 1 and p.token_ids[p.images[0].position] == tok.image_id


def test_url_images_within_size_and_time_limits(service):
    """--image-urls: an http(s) URL is fetched, within the byte and time limits; each failure is a 400."""
    import asyncio
    import ipaddress
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dsv41.api.errors import ApiError
    from dsv41.api.images import ImageService, UrlPolicy
    png = image_bytes(40, 30, seed=9)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow.png":
                time.sleep(2)
            if self.path == "/missing.png":
                self.send_response(404)
                self.end_headers()
                return
            body = png * 3 if self.path == "/big.png" else png
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                pass

        def log_message(self, *a):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{http.server_address[1]}"
    svc = ImageService(service.tower, (service.start_row, service.newline_row, service.end_row),
                       service.image_token_id, UrlPolicy(True, len(png) * 2, 0.5,
                                                         (ipaddress.ip_network("127.0.0.0/8"),)))   # loopback allowed
    off = ImageService(service.tower, (service.start_row, service.newline_row, service.end_row),
                       service.image_token_id)
    try:
        assert asyncio.run(svc.fetch(base + "/ok.png", 0)) == png
        for path, want in (("/big.png", "larger than this server's limit"), ("/slow.png", "longer than 0.5 s"),
                           ("/missing.png", "HTTP 404")):
            with pytest.raises(ApiError, match=want) as e:
                asyncio.run(svc.fetch(base + path, 0))
            assert e.value.status == 400
        with pytest.raises(ApiError, match="URLs are off"):
            asyncio.run(off.fetch(base + "/ok.png", 0))
    finally:
        http.shutdown()
        svc.close()
        off.close()


@pytest.mark.gpu
def test_service_on_cuda_matches_cpu(ckpt, service):
    """The server's tower on the GPU (float32, TF32 off): rows within fp32 rounding of the CPU's, types on the host,
    the chunk slicing on the device."""
    from dsv41.api.images import ImageService
    from dsv41.model.vision import PromptImage
    from dsv41.sched.images import chunk_rows
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = ImageService.load(ckpt, ServeConfig(), "cuda")
    try:
        for (wh, fmt) in FIVE:
            data = image_bytes(*wh, fmt=fmt, seed=wh[0])
            a, b = service.encode_sync(data), gpu.encode_sync(data)
            assert b.embeds.is_cuda and b.token_type.device.type == "cpu"
            assert torch.equal(a.token_type, b.token_type) and rel(b.embeds.cpu(), a.embeds) < 1e-5, wh
            e, t = chunk_rows([PromptImage(3, b)], 0, b.n_tokens + 5, b.embeds.shape[1])
            assert e.is_cuda and t.device.type == "cpu" and torch.equal(e[3:3 + b.n_tokens], b.embeds)
    finally:
        gpu.close()
