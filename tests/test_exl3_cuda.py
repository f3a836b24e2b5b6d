"""The CUDA C EXL3 kernel (kernels/csrc/exl3.cu, launched by kernels/exl3.py).

On the CPU: the kernel's trellis decode (the __host__ __device__ helpers: lane layout, window extraction, codebooks,
the tensor-core fragment each lane builds) compiled by nvcc into a small host program (EXL3_HOST_TEST) and compared
bit for bit with the torch reference decoder for every rate and codebook (skips without nvcc).
On a GPU (marker gpu): the product against the float32 reference and against reconstruct + matmul, rows 1..64
bitwise the same alone as in any batch, grouped launches equal to each expert's own, V4.1 shapes.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dsv41.model.exl3 import CB_3INST, CB_MCG, CB_MUL1, decode_trellis, exl3_linear
from test_exl3_triton import _parts

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "kernels" / "csrc"
RTOL = 2e-3

RATES = [(1, CB_3INST), (2, CB_3INST), (3, CB_MCG), (4, CB_3INST), (4, CB_MUL1), (5, CB_MCG), (6, CB_MUL1),
         (7, CB_3INST), (8, CB_MCG), (8, CB_MUL1), (1.5, CB_MUL1), (2.5, CB_MUL1), (3.5, CB_MUL1), (2, CB_MUL1),
         (3, CB_3INST), (5, CB_MUL1), (6, CB_3INST)]

HARNESS = r"""
#include <cstdio>
#include <vector>
#define EXL3_HOST_TEST
#include "exl3.cu"

// W~ [kt*16, nt*16] (fp16 bits) of a trellis, each tile decoded lane by lane exactly as the kernel's lanes do,
// the fragment registers put back at their (k, n) by the m16n8k16 A-fragment layout.
template <int K2, int CB>
static void run(const u32* words, int kt, int nt, u16* out) {
    typedef Rate<K2> R_;
    const int N = nt * 16;
    for (int i = 0; i < kt; ++i)
        for (int j = 0; j < nt; ++j) {
            const u32* T = words + ((long long)i * nt + j) * R_::NW;
            for (int lane = 0; lane < 32; ++lane) {
                const int st = R_::start(lane);
                u32 W[R_::NWL], frag[4];
                for (int q = 0; q < R_::NWL; ++q) W[q] = T[((st >> 5) + q) % R_::NW];
                lane_fragment<K2, CB>(W, st & 31, frag);
                const int g = lane >> 2, t = lane & 3;
                const int ns[4] = {g, g + 8, g, g + 8}, ks[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
                for (int r = 0; r < 4; ++r) {
                    out[(long long)(i * 16 + ks[r]) * N + j * 16 + ns[r]] = frag[r] & 0xFFFF;
                    out[(long long)(i * 16 + ks[r] + 1) * N + j * 16 + ns[r]] = frag[r] >> 16;
                }
            }
        }
}

int main() {
    int h[4];
    if (fread(h, 4, 4, stdin) != 4) return 2;
    const int K2 = h[0], CB = h[1], kt = h[2], nt = h[3];
    std::vector<u32> words((size_t)kt * nt * 4 * K2);
    if (fread(words.data(), 4, words.size(), stdin) != words.size()) return 2;
    std::vector<u16> out((size_t)kt * nt * 256);
#define CASE(k, c) else if (K2 == k && CB == c) run<k, c>(words.data(), kt, nt, out.data());
#define CASES(k) CASE(k, 0) CASE(k, 1) CASE(k, 2)
    if (0) {}
    CASES(2) CASES(4) CASES(6) CASES(8) CASES(10) CASES(12) CASES(14) CASES(16) CASE(3, 2) CASE(5, 2) CASE(7, 2)
    else return 3;
    fwrite(out.data(), 2, out.size(), stdout);
    return 0;
}
"""


# ---- CPU: the kernel's decode helpers, compiled for the host -------------------------------------------------------

@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    nvcc = shutil.which("nvcc") or next(iter(sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)), None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    d = tmp_path_factory.mktemp("exl3_host")
    src = d / "harness.cu"
    src.write_text(HARNESS)
    exe = d / "harness"
    r = subprocess.run([str(nvcc), "-O1", "-std=c++17", "-arch=sm_80", f"-I{CSRC}", "-o", str(exe), str(src)],
                       capture_output=True, text=True, check=False, timeout=600)
    assert r.returncode == 0, r.stderr
    return exe


def _host_decode(exe, trellis: torch.Tensor, K: float, cb: int) -> torch.Tensor:
    kt, nt, _ = trellis.shape
    head = torch.tensor([round(2 * K), cb, kt, nt], dtype=torch.int32).numpy().tobytes()
    r = subprocess.run([str(exe)], input=head + trellis.contiguous().numpy().tobytes(), capture_output=True,
                       check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    return torch.frombuffer(bytearray(r.stdout), dtype=torch.int16).view(kt * 16, nt * 16)


@pytest.mark.parametrize("K,cb", RATES)
def test_kernel_decode_is_bit_exact_on_host(harness, K, cb):
    t = _parts(128, 256, K, cb, seed=int(K * 10) + 7 * cb)
    got = _host_decode(harness, t["trellis"], K, cb)
    want = decode_trellis(t["trellis"], K, cb).view(torch.int16)
    assert torch.equal(got, want), (got != want).sum().item()


def test_kernel_source_names_every_launched_kernel():
    """kernels/cuda.py resolves every name of KERNELS['exl3.cu'] when the module loads: each is instantiated in the
    source (its instantiation macros expanded here), and the launcher only picks names from that list, for every
    rate and codebook and row count."""
    import re

    from kernels import cuda
    from kernels.exl3 import cuda_kernel_name
    src = (CSRC / "exl3.cu").read_text()
    body = src[src.index("#define EXL3_CODEBOOKS"):]
    made = set()
    for k in re.findall(r"^EXL3_CODEBOOKS\((\d+)\)", body, re.M):
        made |= {f"exl3_k{k}_cb{c}_t1" for c in (0, 1, 2)} | {f"exl3_k{k}_cb2_t8"}
    for k, c, t in re.findall(r"\bEXL3_KERNEL\((\d+), (\d+), (\d+)\)", body):
        made.add(f"exl3_k{k}_cb{c}_t{t}")
    for p, k, c, t in re.findall(r"EXL3_KERNEL_V\((\w+), true, (\d+), (\d+), (\d+)\)", body):
        made.add(f"{p}_k{k}_cb{c}_t{t}")
    names = set(cuda.KERNELS["exl3.cu"])
    assert names == made
    for K, cb in RATES:
        for rows in (1, 2, 8, 9, 32, 33, 64, 65):
            assert cuda_kernel_name(round(2 * K), cb, rows) in names
    assert cuda_kernel_name(5, CB_MUL1, 20).endswith("_t4") and cuda_kernel_name(5, CB_MUL1, 33).endswith("_t8")
    for K2, cb in ((5, CB_MUL1), (8, CB_3INST), (8, CB_MUL1)):
        for rows in (1, 9, 64):
            assert cuda_kernel_name(K2, cb, rows, "w") in names


def test_routed_runs_bookkeeping_on_cpu():
    """The sync-free routed path's bookkeeping (pairs sorted by expert, runs, positions, other ranks' pairs zeroed,
    slots back in slot order) with a stand-in run-mode kernel made of the Triton grouped kernel run by run
    (interpreted on the CPU): bitwise exl3_routed's grouped path."""
    pytest.importorskip("triton")
    from dsv41.model.exl3_load import Exl3ExpertStack, _routed_runs, exl3_routed
    from kernels.exl3 import Exl3Weight, exl3_grouped
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    H, I, E = 128, 128, 3
    w13 = Exl3Weight.from_tensors([_parts(H, I, 2.5, CB_MUL1, seed=80 + j) for j in range(2 * E)], dev)
    w2 = Exl3Weight.from_tensors([_parts(I, H, 2.5, CB_MUL1, seed=90 + j) for j in range(E)], dev)
    stack = Exl3ExpertStack(w13, w2, torch.tensor([1, -1, 2, 0], device=dev))

    def runs(x, w, ids, rows, xmap, max_rows):
        y = torch.full((ids.shape[0], w.out_features), float("nan"), device=x.device)
        for g in range(ids.shape[0]):
            r = int(rows[g])
            assert r <= max_rows
            if r:
                y[g:g + r] = exl3_grouped(x[xmap[g:g + r].long()].float()[None], w, ids[g:g + 1].int())[0]
        return y

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, H, generator=g).to(dev)
    ids = torch.tensor([[0, 1, 2], [2, 2, 3], [1, 1, 1], [3, 0, 2], [0, 0, 1]], device=dev)
    weights = torch.rand(5, 3, generator=g).to(dev)
    got = _routed_runs(stack, x, weights, ids, 7.0, runs)
    assert torch.equal(got, exl3_routed(stack, x, weights, ids, 7.0))
    assert torch.equal(_routed_runs(stack, x[2:3], weights[2:3], ids[2:3], 7.0, runs), torch.zeros_like(got[2:3]))
    rep = torch.tensor([[0, 0, 0], [0, 0, 2]], device=dev)       # 5 pairs of one expert in 2 rows: runs cut at 2
    assert torch.equal(_routed_runs(stack, x[:2], weights[:2], rep, 7.0, runs),
                       exl3_routed(stack, x[:2], weights[:2], rep, 7.0))


# ---- GPU -------------------------------------------------------------------------------------------------------

def _cuda_or_skip():
    """Skip without a CUDA device of compute capability 8.0+; on one, exl3.cu must compile and load (an error
    fails the test instead of quietly leaving the Triton path)."""
    from kernels import cuda
    from kernels.exl3 import _counter, cuda_kernel_name
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs a CUDA device of compute capability 8.0+")
    cuda.function("exl3.cu", cuda_kernel_name(5, CB_MUL1, 1))        # raises CudaKernelError with the compiler log
    _counter(torch.device("cuda", torch.cuda.current_device()))       # the split's counters, outside any capture


@pytest.mark.gpu
def test_the_served_path_takes_the_kernel():
    """cuda_available (the op set's choice at load): exl3.cu compiles and passes its self-check against the Triton
    path, so an EXL3 pack's op set runs the CUDA C kernel."""
    _cuda_or_skip()
    from dsv41.model.ops import cuda_ops
    from kernels.exl3 import _self_check, cuda_available, exl3_grouped_cuda
    _self_check(torch.device("cuda", torch.cuda.current_device()))   # raises with the numbers if it disagrees
    assert cuda_available()
    ops = cuda_ops().with_exl3()
    assert "exl3_cuda" in ops.kernels and ops.exl3_grouped is exl3_grouped_cuda


def _close(y, ref):
    err = (y.float().cpu() - ref).abs().max().item()
    assert err <= RTOL * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("K,cb", RATES)
def test_product_matches_reference(K, cb):
    _cuda_or_skip()
    from kernels.exl3 import Exl3Weight, exl3_linear_cuda, exl3_reconstruct
    t = _parts(512, 256, K, cb, seed=int(K * 10) + cb, bias=True)
    w = Exl3Weight.from_tensors(t, "cuda")
    w_rot = decode_trellis(t["trellis"], K, cb)
    x = torch.randn(5, 512)
    ref = exl3_linear(x, t, w_rot=w_rot)
    y = exl3_linear_cuda(x.cuda(), w)
    _close(y, ref)
    if (K, cb) in ((2.5, CB_MUL1), (4, CB_3INST)):       # (Triton compiles per rate: two rates keep the run short)
        # against reconstruct (the Triton decode, bit-exact) + a float32 matmul of the same fp16 rotated activations
        from dsv41.model.exl3 import hadamard_128_rows
        xh = (hadamard_128_rows(x * t["suh"].float())).half().float()
        yr = hadamard_128_rows(xh @ exl3_reconstruct(w).float().cpu()) * t["svh"].float() + t["bias"].float()
        _close(y, yr)


@pytest.mark.gpu
@pytest.mark.parametrize("K,cb,n_in,n_out", [(2.5, CB_MUL1, 5120, 2304), (4, CB_3INST, 1280, 1024),
                                             (4, CB_MUL1, 512, 128), (3, CB_MCG, 1024, 256)])
def test_rows_do_not_depend_on_the_batch(K, cb, n_in, n_out):
    """Rows 1..64 (and 65..70, two row blocks; 3-bit MCG has no eight-tile kernel: 8 rows a block): each row's
    output is bitwise the same alone as in any batch."""
    _cuda_or_skip()
    from kernels.exl3 import Exl3Weight, exl3_linear_cuda
    w = Exl3Weight.from_tensors(_parts(n_in, n_out, K, cb, seed=5), "cuda")
    x = torch.randn(70, n_in, device="cuda")
    full = exl3_linear_cuda(x, w)
    solo = torch.cat([exl3_linear_cuda(x[i:i + 1], w) for i in range(70)])
    assert torch.equal(full, solo)
    for n in (2, 7, 8, 9, 16, 31, 33, 64):
        assert torch.equal(exl3_linear_cuda(x[:n], w), full[:n]), n
        assert torch.equal(exl3_linear_cuda(x[70 - n:], w), full[70 - n:]), n


@pytest.mark.gpu
def test_grouped_equals_each_expert():
    _cuda_or_skip()
    from kernels.exl3 import Exl3Weight, exl3_grouped_cuda, exl3_linear_cuda
    experts = [_parts(5120, 2304, 2.5, CB_MUL1, seed=100 + e) for e in range(6)]
    w = Exl3Weight.from_tensors(experts, "cuda")
    ids = torch.tensor([5, 1, 4, 0, 5, 2], dtype=torch.int32, device="cuda")
    rows = torch.tensor([3, 1, 9, 2, 1, 0], dtype=torch.int32, device="cuda")
    x = torch.randn(6, 9, 5120, device="cuda")
    y = exl3_grouped_cuda(x, w, ids, rows)
    for g in range(6):
        n = int(rows[g])
        if n == 0:
            continue
        one = Exl3Weight(trellis=w.trellis[int(ids[g])].unsqueeze(0), suh=w.suh[int(ids[g])].unsqueeze(0),
                         svh=w.svh[int(ids[g])].unsqueeze(0), bias=None, K2=w.K2, cb=w.cb, in_features=5120,
                         out_features=2304)
        assert torch.equal(y[g, :n], exl3_linear_cuda(x[g, :n], one)), g
    _close(y[0, :3], exl3_linear(x[0, :3].cpu(), experts[5]))       # the reference once (its CPU decode is slow)


@pytest.mark.gpu
def test_graph_replay_and_counters():
    """The split's arrival counters reset themselves: repeated launches and CUDA-graph replays give the same bits."""
    _cuda_or_skip()
    from kernels.exl3 import Exl3Weight, exl3_linear_cuda
    w = Exl3Weight.from_tensors(_parts(5120, 1280, 4, CB_3INST, seed=9), "cuda")
    x = torch.randn(3, 5120, device="cuda")
    y0 = exl3_linear_cuda(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        exl3_linear_cuda(x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = exl3_linear_cuda(x, w)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y0)
    assert torch.equal(exl3_linear_cuda(x, w), y0)


@pytest.mark.gpu
def test_v41_shapes_match_reference():
    """V4.1 shapes (every split and column count the served linears use) against the Triton path on the GPU
    (its reconstruct is bit-exact with the reference decoder; fp16 GEMM): the float32 reference's CPU decode of
    these shapes would take most of a device run."""
    _cuda_or_skip()
    from kernels.exl3 import Exl3Weight, exl3_linear_cuda, exl3_linear_prompt
    for n_in, n_out, K, cb in [(2304, 5120, 2.5, CB_MUL1), (1280, 32768, 4, CB_3INST), (4096, 1024, 5, CB_MCG),
                               (512, 128, 8, CB_3INST), (5120, 1024, 6, CB_MUL1), (8192, 5120, 4, CB_MUL1)]:
        w = Exl3Weight.from_tensors(_parts(n_in, n_out, K, cb, seed=n_in + n_out), "cuda")
        for rows in (1, 8, 64):
            x = torch.randn(rows, n_in, device="cuda")
            y, ref = exl3_linear_cuda(x, w), exl3_linear_prompt(x, w)
            err = (y - ref).abs().max().item()
            assert err <= 4e-3 * ref.abs().max().item(), (n_in, n_out, K, rows, err)


@pytest.mark.gpu
def test_agrees_with_exllamav3_fixtures():
    """Every exllamav3-made fixture case (all codebooks, rates and sign forms): the kernel's product agrees with the
    float32 reference on the same codes, and with exllamav3 1.6.5's own forward where the fixture has it."""
    _cuda_or_skip()
    import json

    from safetensors import safe_open

    from kernels.exl3 import Exl3Weight, exl3_linear_cuda
    fixture = Path(__file__).parent / "fixtures" / "exl3" / "exl3_fixtures.safetensors"
    with safe_open(str(fixture), "pt") as f:
        meta = json.loads(f.metadata()["cases"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    forwards = 0
    for name, m in meta.items():
        case = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        parts = {k: v for k, v in case.items() if not k.startswith("expect_") and k != "x"}
        w = Exl3Weight.from_tensors(parts, "cuda")
        x = case["x"].float() if "x" in case else torch.randn(3, m["in"], generator=torch.Generator().manual_seed(1))
        y = exl3_linear_cuda(x.cuda(), w).cpu()
        _close(y, exl3_linear(x, parts))
        if "expect_y" in case:
            ref = case["expect_y"]
            assert (y - ref).abs().max() <= 4e-3 * ref.abs().max() + 1e-3, name
            forwards += 1
    assert forwards >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("K,cb", [(2.5, CB_MUL1), (4, CB_3INST), (4, CB_MUL1)])
def test_warp_ring_variant_gives_the_same_bits(K, cb):
    """The bench's warp-ring variant (no block barrier in the decode loop) runs the same arithmetic: same bits."""
    _cuda_or_skip()
    from kernels.exl3 import Exl3Weight, exl3_linear_cuda
    w = Exl3Weight.from_tensors(_parts(5120, 1280, K, cb, seed=11, bias=True), "cuda")
    x = torch.randn(20, 5120, device="cuda")
    for n in (1, 8, 20):
        assert torch.equal(exl3_linear_cuda(x[:n], w, variant="w"), exl3_linear_cuda(x[:n], w)), n


@pytest.mark.gpu
def test_routed_runs_without_a_sync_equal_the_grouped_path():
    """exl3_routed on the CUDA op set runs the run-mode kernel (no host sync, graph-capturable): bitwise the
    grouped path's result (the same kernel per pair, slots in slot order), a row alone == in the batch, other
    ranks' experts contribute nothing, and a CUDA graph replays it."""
    _cuda_or_skip()
    from dsv41.model.exl3_load import Exl3ExpertStack, exl3_routed
    from kernels.exl3 import Exl3Weight, exl3_grouped_cuda
    H, I, E = 512, 256, 5
    w13 = Exl3Weight.from_tensors([_parts(H, I, 2.5, CB_MUL1, seed=40 + j) for j in range(2 * E)], "cuda")
    w2 = Exl3Weight.from_tensors([_parts(I, H, 2.5, CB_MUL1, seed=60 + j) for j in range(E)], "cuda")
    local = torch.tensor([-1, 0, 1, 2, -1, 3, 4], device="cuda")          # 7 experts, 2 on another rank
    stack = Exl3ExpertStack(w13, w2, local)

    def grouped_only(*a, **k):                                            # the same kernel, no run mode
        return exl3_grouped_cuda(*a, **k)

    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, H, generator=g).cuda()
    ids = torch.randint(0, 7, (12, 3), generator=g).cuda()
    weights = torch.rand(12, 3, generator=g).cuda()
    full = exl3_routed(stack, x, weights, ids, 7.0, exl3_grouped_cuda)
    assert torch.isfinite(full).all()
    assert torch.equal(full, exl3_routed(stack, x, weights, ids, 7.0, grouped_only))
    for a, b in ((0, 1), (3, 5), (5, 12)):
        assert torch.equal(exl3_routed(stack, x[a:b], weights[a:b], ids[a:b], 7.0, exl3_grouped_cuda), full[a:b])
    none = torch.zeros_like(ids)                                          # expert 0 is another rank's
    assert torch.equal(exl3_routed(stack, x, weights, none, 7.0, exl3_grouped_cuda), torch.zeros_like(full))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        exl3_routed(stack, x, weights, ids, 7.0, exl3_grouped_cuda)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = exl3_routed(stack, x, weights, ids, 7.0, exl3_grouped_cuda)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, full)
