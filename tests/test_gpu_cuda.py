"""The model on CUDA (docs/gpu.md): the same function as the CPU reference, FP8/FP4 weights kept in checkpoint form,
bitwise batch invariance on the GPU, and the server with --device cuda. Skipped without a CUDA device."""
import concurrent.futures as cf
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from dsv41 import shared_dir
from dsv41.model import device as dev
from dsv41.model.model import Model, SeqInput
from dsv41.model.ops import cuda_ops
from dsv41.tools.logits import run
from tests.test_model_vectors import QAT_OPEN

pytestmark = pytest.mark.gpu

N_PROMPTS = 7
# the op sets to test: the torch fallbacks always, the kernels when kernels/ has them (imported here, without CUDA too)
KERNELS = bool(cuda_ops().kernels)
PATHS = ["fallback"] + (["kernels"] if KERNELS else [])


@pytest.fixture(scope="module")
def tiny_a():
    """The oracle vectors' folder (on the H200 only when the call carried them: scripts/h200/gpu.sh)."""
    d = shared_dir() / "vectors/model/tiny-a"
    if not (d / "vectors.safetensors").is_file():
        pytest.skip(f"tiny-a vectors not at {d} (set DSV41_SHARED)")
    return d


@pytest.fixture(scope="module")
def vec(tiny_a):
    return {"qat": load_file(str(tiny_a / "vectors.safetensors")),
            "noquant": load_file(str(tiny_a / "vectors_noquant.safetensors"))}


@pytest.fixture(scope="module")
def cpu_model(tiny_a):
    return Model.load(tiny_a / "checkpoint")


@pytest.fixture(scope="module")
def cuda_models(tiny_a):
    """tiny-a on CUDA with the torch fallbacks (the op set cuda_ops(kernels=False))."""
    ck = tiny_a / "checkpoint"
    return {"qat": Model.load(ck, device="cuda", kernels=False),
            "noquant": Model.load(ck, device="cuda", qat=False, kernels=False)}


@pytest.fixture(scope="module")
def tiny_cuda():
    """The server's built-in tiny checkpoint (make_tiny, the real tokenizer; made once and cached) on CUDA."""
    from dsv41.api.engine import builtin_checkpoint
    return Model.load(builtin_checkpoint(), device="cuda", kernels=True)


@pytest.fixture(scope="module")
def tiny_fallbacks():
    from dsv41.api.engine import builtin_checkpoint
    return Model.load(builtin_checkpoint(), device="cuda", kernels=False)


@pytest.fixture(params=PATHS)
def path_model(request):
    """The built-in tiny checkpoint on CUDA on each op set: the torch fallbacks, the kernels."""
    m = request.getfixturevalue("tiny_cuda" if request.param == "kernels" else "tiny_fallbacks")
    assert m.ops.name == ("cuda+tf32-index" if request.param == "kernels" else "cuda-fallbacks")   # (QAT on)
    return m


def _host(r):
    return {k: v.cpu() for k, v in r.items()}


def test_fp32_matmul_check_catches_tf32():
    dev.setup_cuda("cuda")
    dev.check_fp32_matmul(torch.device("cuda"))
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with pytest.raises(RuntimeError, match="not float32"):
            dev.check_fp32_matmul(torch.device("cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    dev.check_fp32_matmul(torch.device("cuda"))


def test_weights_stay_in_checkpoint_form(tiny_cuda):
    m = tiny_cuda
    blk = m.blocks[2]
    assert isinstance(blk.attn.wq_b, dev.Fp8Weight) and blk.attn.wq_b.q.dtype == torch.float8_e4m3fn
    assert blk.attn.wq_b.device.type == "cuda"
    e = next(iter(blk.moe.experts.values()))
    assert isinstance(e.w1, dev.Fp4Weight) and e.w1.packed.dtype == torch.int8 and e.w1.packed.is_cuda


# ---- the server with --device cuda -----------------------------------------------------------------------------

def _complete(client, prompt, n=12) -> tuple[int, ...]:
    """The greedy reply's token ids (the server's return_token_ids)."""
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return tuple(r.choices[0].model_extra["token_ids"])


# The CPU reference's greedy picks along the CUDA server's replies are held to the vectors' QAT criteria (README of
# tiny-a): two float32 devices sum in different orders, and a fake-quant input within float32 noise of a rounding
# midpoint may round the other way, so a pick may flip where the reference's top two lie close; the oracle's own
# isolated flips reach 0.2-0.4 per logit. A wiring bug moves every position (gaps of 5-9 logits on this model).
AGREE, FLIP_GAP = 0.98, 0.4


def _teacher_forced(model, prompt, reply) -> tuple[int, float]:
    """(picks of the CPU model that equal the reply's tokens, the largest logit gap where one does not), the model
    fed the prompt and the reply in one pass (a row's bits do not depend on chunking: tests/test_model_exact.py)."""
    ids = torch.tensor(list(prompt) + list(reply[:-1]))
    lg = model.forward([SeqInput(model.new_state(), ids, logits="all")])[0][len(prompt) - 1:]
    pick = lg.argmax(-1)
    tok = torch.tensor(reply)
    gaps = lg.gather(1, pick[:, None])[:, 0] - lg.gather(1, tok[:, None])[:, 0]
    return int((pick == tok).sum()), float(gaps.max())


def _say(capsys, t0: float, what: str, server=None) -> None:
    """Progress past pytest's capture (capsys.disabled): on the H200 this test twice ran past its time limit without
    a verdict, and an interrupted pytest does not print a test's captured output."""
    tail = "" if server is None else " | server: " + " / ".join(x.strip() for x in server.lines[-2:])
    with capsys.disabled():
        print(f"\n[server test +{time.monotonic() - t0:6.1f}s] {what}{tail}", flush=True)


def _solo_then_burst(capsys, t0: float, server, prompts, n: int, label: str) -> tuple[list, list]:
    """Each prompt's greedy reply alone, one after another, then all of them at once (a burst of len(prompts))."""
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600, max_retries=0)
    solo = []
    for k, p in enumerate(prompts):
        solo.append(_complete(client, p, n))
        if k % 8 == 7:
            _say(capsys, t0, f"{label}: {k + 1} solo replies", server)
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        burst = list(ex.map(lambda p: _complete(client, p, n), prompts))
    _say(capsys, t0, f"{label}: the burst of {len(prompts)} replied", server)
    return solo, burst


def _differing(solo, burst) -> list[int]:
    return [k for k, (a, b) in enumerate(zip(solo, burst)) if a != b]


def test_server_cuda_gives_cpu_tokens_and_solo_equals_burst(capsys):
    """--device cuda on the built-in tiny checkpoint: the torch fallbacks' greedy replies are the CPU reference's
    (the same float32 function summed in another order) within the vectors' QAT criteria (AGREE of the picks
    teacher-forced, no flip wider than FLIP_GAP), and each reply alone equals it bit for bit inside a 32-stream
    burst (fallbacks, then kernels with CUDA graphs)."""
    from dsv41.api.engine import builtin_checkpoint
    from test_server import LiveServer
    t0 = time.monotonic()
    prompts = [_ids(4 + 5 * k, 300 + k, vocab=20000).tolist() for k in range(32)]
    common = ["--context", "512", "--prefill-chunk", "256", "--state-budget-gib", "2", "--name", "tiny",
              "--max-streams", "32", "--prompt-cache-gib", "0", "--device", "cuda"]
    replies = {}
    for kernels in ["0"] + (["1"] if KERNELS else []):
        s = LiveServer(*common, env={"DSV41_KERNELS": kernels})
        try:
            s.wait_ready()
            _say(capsys, t0, f"cuda server (DSV41_KERNELS={kernels}) ready", s)
            assert any("on cuda" in line for line in s.lines), s.lines[-5:]
            replies[kernels] = _solo_then_burst(capsys, t0, s, prompts, 12, f"kernels={kernels}")
        finally:
            s.stop()
    for kernels, (solo, burst) in replies.items():
        assert burst == solo, f"DSV41_KERNELS={kernels}: burst != solo for prompts {_differing(solo, burst)}"
    ref = Model.load(builtin_checkpoint())
    tf = [_teacher_forced(ref, p, r) for p, r in zip(prompts, replies["0"][0])]
    agree = sum(a for a, _ in tf) / sum(len(r) for r in replies["0"][0])
    widest = max(g for _, g in tf)
    _say(capsys, t0, f"cuda fallbacks vs the CPU reference, teacher-forced: {agree:.1%} of picks agree; widest "
                     f"flip {widest:.3g}")
    assert agree >= AGREE and widest <= FLIP_GAP, (agree, widest)


@pytest.mark.skipif(not os.environ.get("DSV41_REAL_CHECKPOINT"), reason="DSV41_REAL_CHECKPOINT (a make_real folder) "
                    "not set: scripts/h200/gpuserver.sh makes one")
def test_server_on_a_real_shaped_checkpoint_solo_equals_burst(capsys):
    """The server on the H200 with a real-shaped partial checkpoint (python -m dsv41.tools.make_real: release shapes,
    random values; FP8/FP4 kernels, CUDA graphs): each of 32 greedy replies alone equals it inside a 32-stream burst,
    bit for bit."""
    from test_server import LiveServer
    t0 = time.monotonic()
    prompts = [_ids(8 + 7 * k, 500 + k, vocab=20000).tolist() for k in range(32)]
    s = LiveServer("--model", os.environ["DSV41_REAL_CHECKPOINT"], "--device", "cuda", "--context", "1024",
                   "--state-budget-gib", "8", "--name", "tiny", "--max-streams", "32", "--prompt-cache-gib", "0")
    try:
        s.wait_ready()
        _say(capsys, t0, "real-shaped server ready", s)
        solo, burst = _solo_then_burst(capsys, t0, s, prompts, 8, "real-shaped")
    finally:
        s.stop()
    assert all(len(r) == 8 for r in solo)
    assert burst == solo, f"burst != solo for prompts {_differing(solo, burst)}"


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_noquant_vectors_on_cuda(cuda_models, vec, i):
    """The torch fallbacks compute the reference's float32 function: the CPU test's README criterion, >= 99.5 % of
    positions within 1e-4 (prefill and teacher-forced decode), greedy ids equal."""
    v = vec["noquant"]
    ids = vec["qat"][f"prompt.{i}.input_ids"].tolist()
    r = _host(run(cuda_models["noquant"], ids, feed=v[f"prompt.{i}.decode_ids"].tolist()))
    for out, ref in ((r["prompt_logits"], v[f"prompt.{i}.prefill_logits"]),
                     (r["decode_logits"], v[f"prompt.{i}.decode_logits"])):
        assert out.shape == ref.shape
        d = (out - ref).abs().amax(-1)
        assert (d <= 1e-4).float().mean().item() >= 0.995, d.max()
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(not KERNELS, reason="no Triton kernels in kernels/")
def test_kernels_stay_near_the_float32_function(cuda_models, tiny_a, vec):
    """The kernels round activations to bf16 (docs/kernels.md), which the vectors README says lands "much further
    away": compared with our own float32 function (the fallbacks) over tiny-a's prompts, no fake-quant. A router
    near-tie flipped by bf16 noise moves a position by O(1), so the bound is statistical; a wiring bug (a wrong
    expert, a wrong scale) moves every position (argmax near chance, 1/512)."""
    m = cuda_models["noquant"]
    mk = Model.load(tiny_a / "checkpoint", device="cuda", qat=False, kernels=True)
    ds, agree = [], []
    for i in range(N_PROMPTS - 1):
        ids = vec["qat"][f"prompt.{i}.input_ids"].tolist()
        a = _host(run(m, ids))["prompt_logits"]
        b = _host(run(mk, ids))["prompt_logits"]
        ds.append((a - b).abs().amax(-1))
        agree.append(a.argmax(-1) == b.argmax(-1))
    d, agree = torch.cat(ds), torch.cat(agree).float()
    print(f"kernels vs fallback: median {d.median():.3g}, p90 {d.quantile(0.9):.3g}, argmax {agree.mean():.1%}")
    assert d.median() <= 0.5 and agree.mean() >= 0.8


@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.xfail(
    reason="issue 28: this prompt's QAT roundings are decided by float32 summation order (QAT_OPEN on the CPUs); "
           "the GPU's order is another (bench/qat_flips.py)", strict=False)) if i in {j for j, _ in QAT_OPEN}
    else i for i in range(N_PROMPTS)])
def test_qat_on_cuda_matches_the_cpu_reference(cuda_models, cpu_model, vec, i):
    """QAT on: the CPU test's bound against the CPU reference (argmax >= 98 %, >= 95 % within 2e-2): an FP8/FP4
    rounding input within float32 noise of a midpoint may round the other way on another device. The prompts whose
    parts miss the criteria against the oracle on the CPUs (tests/test_model_vectors.py QAT_OPEN, issue 28: order-
    decided ties) are expected failures here too: on the H200 prompt 5's decode parts from the CPU reference at a
    layer-6 indexer top-k after such flips (2026-12-05)."""
    v = vec["qat"]
    ids = v[f"prompt.{i}.input_ids"].tolist()
    feed = v[f"prompt.{i}.decode_ids"].tolist()
    got = _host(run(cuda_models["qat"], ids, feed=feed))
    ref = run(cpu_model, ids, feed=feed)
    for k in ("prompt_logits", "decode_logits"):
        d = (got[k] - ref[k]).abs().amax(-1)
        assert (d <= 2e-2).float().mean().item() >= 0.95, (k, d.max())
        assert (got[k].argmax(-1) == ref[k].argmax(-1)).float().mean().item() >= 0.98, k


def _ids(n, seed, vocab=500):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n,), generator=g)
    ids[0] = 0
    return ids


def _one(model, ids):
    st = model.new_state()
    return model.forward([SeqInput(st, ids)])[0], st


def test_chunks_and_decode_equal_one_pass_on_cuda(path_model):
    m = path_model
    ids = _ids(90, 1)
    ref, _ = _one(m, ids)
    for chunk in (1, 3, 8, 64):
        st = m.new_state()
        outs = [m.forward([SeqInput(st, ids[a:a + chunk])])[0] for a in range(0, len(ids), chunk)]
        assert torch.equal(torch.cat(outs), ref), chunk


def test_row_alone_equals_row_in_64_and_in_a_2048_chunk(path_model):
    """Hard rule: a decode row's bits do not depend on the round: alone == among 63 other decode rows == beside a
    2047-row prompt chunk (torch.equal)."""
    m = path_model
    base = m.new_state()
    others = [m.new_state() for _ in range(63)]
    m.forward([SeqInput(base, _ids(37, 2))] + [SeqInput(st, _ids(5 + 3 * k, 100 + k)) for k, st in enumerate(others)])
    tok = torch.tensor([11])

    st = base.snapshot()
    alone = m.forward([SeqInput(st, tok)])[0]
    st = base.snapshot()
    outs = m.forward([SeqInput(o.snapshot(), torch.tensor([5 + k])) for k, o in enumerate(others[:31])]
                     + [SeqInput(st, tok)]
                     + [SeqInput(o.snapshot(), torch.tensor([7 + k])) for k, o in enumerate(others[31:])])
    assert torch.equal(outs[31], alone)
    st = base.snapshot()
    outs = m.forward([SeqInput(m.new_state(), _ids(2047, 9)), SeqInput(st, tok, logits="last")])
    assert torch.equal(outs[1], alone)


def test_batch_of_four_equals_each_alone_on_cuda(path_model):
    m = path_model
    seqs = [_ids(n, 10 + n) for n in (5, 23, 40, 61)]
    alone = [_one(m, s)[0] for s in seqs]
    outs = m.forward([SeqInput(m.new_state(), s) for s in seqs])
    for a, b in zip(alone, outs):
        assert torch.equal(a, b)
    # the DSpark draft of a row does not depend on the others either
    sts = [_one(m, s)[1] for s in seqs]
    one = m.dspark.draft([(sts[1], 9)])[0]
    many = m.dspark.draft([(st, 9) for st in sts])[1]
    assert torch.equal(one.logits, many.logits) and torch.equal(one.tokens, many.tokens)
