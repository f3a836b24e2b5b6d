"""Make the EXL3 reference fixtures with exllamav3 1.6.5 itself (needs a CUDA GPU; its extension JIT-builds at import).

For each case: random trellis codes (every bit pattern is a valid code), random sign x scale vectors (fp16, or the
legacy packed su/sv), the codebook marker; exllamav3's LinearEXL3 then gives
  w_rot  = get_inner_weight_tensor()   the decoded trellis W~ (ext.reconstruct)
  w      = get_weight_tensor()         the dense weight diag(suh) H W~ H diag(svh)
and, for a few cases, its own forward (x -> y, the <= 144-row path that never forms W).
Writes OUT/exl3_fixtures.safetensors (inputs + expected outputs: committed as tests/fixtures/exl3/) and
OUT/exl3_stages.safetensors (each step of get_weight_tensor, for diagnosis only), and prints how the torch decoder
in dsv41/model/exl3.py compares.

  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 scripts/make_exl3_fixtures.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.model.exl3 import MCG_MARKER, MUL1_MARKER, dequant_exl3, decode_trellis, exl3_linear  # noqa: E402

# (name, in, out, K, codebook, signs: "h" = suh/svh fp16, "pu" = packed su + svh, "pv" = suh + packed sv,
#  "p" = both packed, forward rows (0 = none), bias)
CASES = [
    ("inst_k2", 128, 128, 2, "3inst", "h", 0, False),
    ("inst_k3", 128, 128, 3, "3inst", "p", 0, False),
    ("inst_k4", 256, 128, 4, "3inst", "h", 5, True),
    ("inst_k5", 128, 128, 5, "3inst", "h", 0, False),
    ("inst_k6", 128, 128, 6, "3inst", "h", 0, False),
    ("inst_k7", 128, 128, 7, "3inst", "h", 0, False),
    ("inst_k8", 128, 128, 8, "3inst", "h", 0, False),
    ("mcg_k2", 128, 128, 2, "mcg", "h", 0, False),
    ("mcg_k4", 128, 128, 4, "mcg", "pv", 0, False),
    ("mcg_k5", 128, 256, 5, "mcg", "h", 3, False),
    ("mcg_k8", 128, 128, 8, "mcg", "h", 0, False),
    ("mul1_k1p5", 128, 128, 1.5, "mul1", "h", 0, False),
    ("mul1_k2", 128, 128, 2, "mul1", "h", 0, False),
    ("mul1_k2p5", 128, 256, 2.5, "mul1", "pu", 4, False),
    ("mul1_k3", 128, 128, 3, "mul1", "h", 0, False),
    ("mul1_k3p5", 128, 128, 3.5, "mul1", "h", 0, False),
    ("mul1_k4", 128, 128, 4, "mul1", "h", 0, False),
    ("mul1_k6", 128, 128, 6, "mul1", "h", 0, False),
]


def make_inputs(name, n_in, n_out, K, cb, signs, bias, gen):
    t = {"trellis": torch.randint(-32768, 32768, (n_in // 16, n_out // 16, int(16 * K)), generator=gen,
                                  dtype=torch.int16)}
    # sign x scale like a real pack: random sign, magnitude around the codebook's operating point
    def scales(n):
        s = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        return (s * (0.002 + 0.02 * torch.rand(n, generator=gen))).half()
    def packed(n):
        return torch.randint(-32768, 32768, (n // 16,), generator=gen, dtype=torch.int16)
    if signs in ("h", "pv"):
        t["suh"] = scales(n_in)
    else:
        t["su"] = packed(n_in)
    if signs in ("h", "pu"):
        t["svh"] = scales(n_out)
    else:
        t["sv"] = packed(n_out)
    if cb == "mcg":
        t["mcg"] = torch.tensor(MCG_MARKER, dtype=torch.int32)
    if cb == "mul1":
        t["mul1"] = torch.tensor(MUL1_MARKER, dtype=torch.int32)
    if bias:
        t["bias"] = (0.1 * torch.randn(n_out, generator=gen)).half()
    return t


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    import exllamav3.ext  # noqa: F401  (JIT build)
    print(f"exllamav3 extension ready in {time.time() - t0:.0f} s", flush=True)
    from exllamav3.modules.quant.exl3 import LinearEXL3
    from exllamav3.modules.quant.exl3_lib.quantize import preapply_had_l, preapply_had_r, had_k, had_n
    import exllamav3

    gen = torch.Generator().manual_seed(20261202)
    fixtures, stages, meta, summary = {}, {}, {}, []
    for name, n_in, n_out, K, cb, signs, fwd_rows, bias in CASES:
        t = make_inputs(name, n_in, n_out, K, cb, signs, bias, gen)
        dev = {k: v.cuda() for k, v in t.items()}
        lin = LinearEXL3(None, n_in, n_out, **{k: dev.get(k) for k in
                                               ("su", "sv", "suh", "svh", "trellis", "mcg", "mul1", "bias")})
        w_rot = lin.get_inner_weight_tensor().cpu()
        w = lin.get_weight_tensor().cpu()
        # the same steps one by one (diagnosis): H from the left, * suh, H from the right, * svh
        s1 = preapply_had_l(lin.get_inner_weight_tensor(), had_k)
        s2 = s1 * lin.suh.unsqueeze(1)
        s3 = preapply_had_r(s2, had_n)
        for k, v in (("had_l", s1), ("suh", s2), ("had_r", s3)):
            stages[f"{name}.{k}"] = v.cpu().clone()
        for k, v in t.items():
            fixtures[f"{name}.{k}"] = v.clone()
        fixtures[f"{name}.expect_w_rot"] = w_rot.contiguous()
        fixtures[f"{name}.expect_w"] = w.contiguous()
        m = {"in": n_in, "out": n_out, "K": K, "codebook": cb, "signs": signs}
        if fwd_rows:
            x = torch.randn(fwd_rows, n_in, generator=gen).half()
            try:
                y = lin.forward(x.cuda(), {}).float().cpu()
            except Exception as exc:  # the forward is a bonus; the dequantisation fixtures must still be written
                print(f"{name}: exllamav3 forward failed: {exc!r}", flush=True)
                fwd_rows = 0
            else:
                fixtures[f"{name}.x"] = x
                fixtures[f"{name}.expect_y"] = y.contiguous()
                m["forward_rows"] = fwd_rows
        meta[name] = m
        # compare with the torch decoder here too, so the run's log says at once whether the format is right
        mine_rot = decode_trellis(t["trellis"], K, {"3inst": 0, "mcg": 1, "mul1": 2}[cb])
        mine_w = dequant_exl3(t)
        line = {"case": name, "w_rot_equal": bool(torch.equal(mine_rot, w_rot)),
                "w_rot_diff": int((mine_rot != w_rot).sum()), "w_equal": bool(torch.equal(mine_w, w)),
                "w_diff": int((mine_w != w).sum()), "w_maxabs": float((mine_w.float() - w.float()).abs().max())}
        if fwd_rows:
            yr = exl3_linear(x.float(), t)
            line["y_maxabs"] = float((yr - y).abs().max())
            line["y_ref_max"] = float(yr.abs().max())
        summary.append(line)
        print(json.dumps(line), flush=True)
    md = {"cases": json.dumps(meta), "exllamav3": getattr(exllamav3, "__version__", "1.6.5"),
          "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    save_file(fixtures, str(out / "exl3_fixtures.safetensors"), metadata=md)
    save_file(stages, str(out / "exl3_stages.safetensors"), metadata=md)
    (out / "exl3_fixture_summary.json").write_text(json.dumps(summary, indent=1))
    ok = all(s["w_rot_equal"] for s in summary)
    print(f"decoder bit-exact on W~ for all {len(summary)} cases: {ok}; "
          f"on W: {sum(s['w_equal'] for s in summary)}/{len(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out_exl3"))
