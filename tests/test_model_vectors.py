"""The forward against the tiny-a oracle vectors (../shared/vectors/model/tiny-a, README there).

Two modes: vectors_noquant (the three QAT fake-quants as identity) must agree everywhere to float32 noise; with QAT
on, an FP8/FP4 rounding input that lies within float32 noise of a rounding midpoint can land on the other side than
in the oracle and shift later positions by a quantisation step (the README's own self-consistency shows the same).
So the QAT checks are the README criteria per prompt where no near-tie occurs, and, for the prompts that do hit
one, that the first deviating position is explained by a window-KV FP8 near-tie (anything else would be a bug).
"""
import pytest
import torch
from safetensors.torch import load_file

from dsv41.model import quant
from dsv41.model.model import Model, SeqInput
from dsv41.tools.logits import run

N_PROMPTS = 7


def _dir(shared):
    return shared / "vectors/model/tiny-a"


@pytest.fixture(scope="module")
def vec(shared):
    return {"qat": load_file(str(_dir(shared) / "vectors.safetensors")),
            "noquant": load_file(str(_dir(shared) / "vectors_noquant.safetensors"))}


@pytest.fixture(scope="module")
def models(shared):
    ck = _dir(shared) / "checkpoint"
    return {"qat": Model.load(ck), "noquant": Model.load(ck, qat=False)}


@pytest.fixture(scope="module")
def results(models, vec):
    """Every prompt once per mode: one-shot prefill + teacher-forced decode (through dsv41.tools.logits.run)."""
    out = {}
    for mode in ("qat", "noquant"):
        for i in range(N_PROMPTS):
            ids = vec["qat"][f"prompt.{i}.input_ids"].tolist()
            feed = vec[mode][f"prompt.{i}.decode_ids"].tolist()
            out[mode, i] = run(models[mode], ids, feed=feed)
    return out


def _per_position(out, ref):
    return (out - ref).abs().amax(-1)


def test_engram_hash_ids_and_rope_tables_equal_oracle(models, vec):
    m, v = models["qat"], vec["qat"]
    assert torch.equal(m.hasher.token_map, v["engram.token_map"])
    assert torch.equal(m.hasher.primes, v["engram.primes"])
    assert torch.equal(m.hasher.offsets, v["engram.offsets"])
    assert torch.equal(m.hasher.multipliers, v["engram.multipliers"])
    assert torch.equal(m.rope.inv_freq["main"], v["rope.main_inv_freq"])
    assert torch.equal(m.rope.inv_freq["compress"], v["rope.compress_inv_freq"])
    for i in range(N_PROMPTS):
        ids = torch.cat([v[f"prompt.{i}.input_ids"], v[f"prompt.{i}.decode_ids"]])
        assert torch.equal(m.hasher.hash_compressed(m.hasher.compress(ids), 0), v[f"prompt.{i}.hash_ids"])


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_noquant_logits(results, vec, i):
    """README: >= 99.5 % of positions within 1e-4, prefill and teacher-forced decode; greedy ids agree."""
    r, v = results["noquant", i], vec["noquant"]
    for out, ref in ((r["prompt_logits"], v[f"prompt.{i}.prefill_logits"]),
                     (r["decode_logits"], v[f"prompt.{i}.decode_logits"])):
        assert out.shape == ref.shape
        d = _per_position(out, ref)
        assert (d <= 1e-4).float().mean().item() >= 0.995, d.max()
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


def _near_tie_positions(model, ids, monkeypatch, tol=5e-6):
    """Run ids in one pass (bitwise equal to prompt + decode, tests/test_model_exact.py) with spies on the three
    QAT quantisers; return the positions owning a quantiser input within `tol` (relative) of a rounding midpoint
    but not exactly on it (an exact tie is decided by the rounding rule alike everywhere). Rows map to positions: per-token calls have len(ids) rows; ratio-2 entries close at 2g+1."""
    n = len(ids)
    found = set()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])

    def record(rows_rel):
        rows = rows_rel.shape[0]
        near = (rows_rel < tol) & (rows_rel > 0)
        hit = torch.nonzero(near.view(rows, -1).any(-1))[:, 0].tolist()
        if rows == n:
            found.update(hit)
        elif rows == n // 2:
            found.update(2 * g + 1 for g in hit)

    def fp8(x, block=32):
        v = x.reshape(x.shape[0], -1, block)
        q = (v / quant.pow2_ceil(v.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)).abs()
        step = torch.exp2(torch.floor(torch.log2(q.clamp_min(2.0 ** -9))).clamp_min(-6) - 3)
        frac = q / step
        record((frac - torch.floor(frac) - 0.5).abs() * step / q.clamp_min(1e-30))
        return orig[0](x, block)

    def fp4(scale_of, k):
        def spy(x, block):
            v = x.reshape(x.shape[0], -1, block)
            q = (v / scale_of(v.abs().amax(-1, keepdim=True))).abs()
            record((q[..., None] - mids).abs().amin(-1) / q.clamp_min(1e-30))
            return orig[k](x, block)
        return spy

    orig = (quant.fp8_fake_quant, quant.fp4_fake_quant_e4m3, quant.fp4_fake_quant_ue8m0)
    monkeypatch.setattr(quant, "fp8_fake_quant", fp8)
    monkeypatch.setattr(quant, "fp4_fake_quant_e4m3",
                        fp4(lambda a: (a.clamp_min(6 * 2.0 ** -9) / 6).to(torch.float8_e4m3fn).float(), 1))
    monkeypatch.setattr(quant, "fp4_fake_quant_ue8m0",
                        fp4(lambda a: quant.pow2_ceil(a.clamp_min(6 * 2.0 ** -126) / 6), 2))
    model.forward([SeqInput(model.new_state(), ids)])
    monkeypatch.undo()
    return found


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_qat_logits(models, results, vec, monkeypatch, i):
    """Prefill: argmax agreement >= 98 % and >= 95 % of positions within 2e-2 (README). Prefill + teacher-forced
    decode: every position before the first one off by more than 1e-4 agrees to 1e-4, and that first deviation has
    a QAT rounding near-tie at or before it (a float32-noise flip; a math difference would deviate without one)."""
    r, v = results["qat", i], vec["qat"]
    out, ref = r["prompt_logits"], v[f"prompt.{i}.prefill_logits"]
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.98
    assert (_per_position(out, ref) <= 2e-2).float().mean().item() >= 0.95
    d = torch.cat([_per_position(out, ref), _per_position(r["decode_logits"], v[f"prompt.{i}.decode_logits"])])
    bad = torch.nonzero(d > 1e-4)
    if bad.numel() == 0:
        return
    first = int(bad[0, 0])
    ids = torch.cat([v[f"prompt.{i}.input_ids"], v[f"prompt.{i}.decode_ids"]])
    ties = _near_tie_positions(models["qat"], ids, monkeypatch)
    assert any(p <= first for p in ties), f"position {first} deviates ({d[first]:.3g}) without a QAT near-tie"


def _check_streams(trace, v):
    for l, s in enumerate(trace["layer_out_streams"]):
        ref = v["debug.layer_out_streams"][l]
        assert (s - ref).abs().max() <= 1e-4 * ref.abs().max(), f"layer {l}"
    for k in ("engram_out_streams.layer1", "engram_out_streams.layer4", "dspark_taps"):
        ref = v[f"debug.{k}"]
        assert (trace[k] - ref).abs().max() <= 1e-4 * ref.abs().max(), k


@pytest.mark.parametrize("mode", ("noquant", "qat"))
def test_debug_streams(models, vec, mode):
    v = vec[mode]
    i = int(v["debug.prompt_index"])
    tr = {}
    models[mode].forward([SeqInput(models[mode].new_state(), vec["qat"][f"prompt.{i}.input_ids"])], trace=tr)
    _check_streams(tr, v)


@pytest.mark.parametrize("mode", ("noquant", "qat"))
def test_topk_selections(models, vec, mode):
    """select.*: per-query top-k of every index source and the candidate mask, prefill and greedy decode.
    noquant: all equal. QAT: the 100-token prompt's prefill flips at row 78 (see above), so rows before it."""
    m, v = models[mode], vec[mode]
    i = int(v["select.prompt_index"])
    st = m.new_state()
    tr = {}
    m.forward([SeqInput(st, vec["qat"][f"prompt.{i}.input_ids"])], trace=tr)
    rows = slice(None) if mode == "noquant" else slice(0, 78)
    layers = [int(k.rsplit("layer", 1)[1]) for k in v if k.startswith("select.prefill.topk_idx.")]
    assert layers
    for layer in layers:
        assert torch.equal(tr[f"topk.layer{layer}"][0][rows], v[f"select.prefill.topk_idx.layer{layer}"].long()[rows])
    for k in v:
        if k.startswith("select.prefill.candidates."):
            layer = int(k.rsplit("layer", 1)[1])
            assert torch.equal(tr[f"candidates.layer{layer}"][0][rows], v[k].bool()[rows])
    if mode != "noquant":
        return
    dec = {layer: [] for layer in layers}
    for tok in v[f"prompt.{i}.decode_ids"].tolist():
        tr = {}
        m.forward([SeqInput(st, torch.tensor([tok]))], trace=tr)
        for layer in layers:
            dec[layer].append(tr[f"topk.layer{layer}"][0][0])
    for layer in layers:
        assert torch.equal(torch.stack(dec[layer]), v[f"select.decode.topk_idx.layer{layer}"].long())
