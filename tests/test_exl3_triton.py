"""EXL3 Triton kernels against the torch reference (dsv41/model/exl3.py).

Without a GPU the kernels run under TRITON_INTERPRET=1 on small shapes; with one (marker gpu) at V4.1 shapes.
Tolerance: the trellis decode is bit-exact (W~ compared as bits); the products round the Hadamard-transformed
activations to fp16 (the tensor-core input, as exllamav3 does) and accumulate in fp32, so
max|y - y_ref| <= 2e-3 * max|y_ref| against the float32 reference.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from dsv41.model.exl3 import (
    CB_3INST,
    CB_MCG,
    CB_MUL1,
    MCG_MARKER,
    MUL1_MARKER,
    decode_trellis,
    exl3_linear,
)
from kernels.exl3 import (
    Exl3Weight,
    exl3_grouped,
    exl3_linear_prompt,
    exl3_linear_triton,
    exl3_reconstruct,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 2e-3


def _parts(n_in, n_out, K, cb, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    t = {"trellis": torch.randint(-32768, 32768, (n_in // 16, n_out // 16, int(16 * K)), generator=g,
                                  dtype=torch.int16),
         "suh": (0.02 * torch.randn(n_in, generator=g)).half(), "svh": (0.02 * torch.randn(n_out, generator=g)).half()}
    if cb == CB_MCG:
        t["mcg"] = torch.tensor(MCG_MARKER, dtype=torch.int32)
    if cb == CB_MUL1:
        t["mul1"] = torch.tensor(MUL1_MARKER, dtype=torch.int32)
    if bias:
        t["bias"] = (0.1 * torch.randn(n_out, generator=g)).half()
    return t


def _close(y, ref):
    err = (y.float().cpu() - ref).abs().max().item()
    assert err <= RTOL * ref.abs().max().item(), (err, ref.abs().max().item())


RATES = [(2, CB_3INST), (3, CB_MCG), (4, CB_3INST), (5, CB_MCG), (6, CB_MUL1), (7, CB_3INST), (8, CB_MCG),
         (1.5, CB_MUL1), (2.5, CB_MUL1), (3.5, CB_MUL1), (2, CB_MUL1)]


@pytest.mark.parametrize("K,cb", RATES)
def test_reconstruct_kernel_is_bit_exact(K, cb):
    t = _parts(128, 128, K, cb, seed=int(K * 10) + cb)
    w = Exl3Weight.from_tensors(t, DEV)
    got = exl3_reconstruct(w).cpu()
    assert torch.equal(got.view(torch.int16), decode_trellis(t["trellis"], K, cb).view(torch.int16))


@pytest.mark.parametrize("K,cb", [(2.5, CB_MUL1), (4, CB_3INST)])
def test_fused_linear_matches_reference(K, cb):
    t = _parts(256, 128, K, cb, seed=3, bias=True)
    w = Exl3Weight.from_tensors(t, DEV)
    x = torch.randn(5, 256)
    ref = exl3_linear(x, t)
    _close(exl3_linear_triton(x.to(DEV), w), ref)
    _close(exl3_linear_prompt(x.to(DEV), w), ref)


def test_fused_linear_rows_do_not_depend_on_the_batch():
    t = _parts(128, 128, 3, CB_MCG, seed=4)
    w = Exl3Weight.from_tensors(t, DEV)
    x = torch.randn(6, 128, device=DEV)
    y = exl3_linear_triton(x, w)
    assert torch.equal(exl3_linear_triton(x[2:3], w)[0], y[2])
    assert torch.equal(exl3_linear_triton(x[:4], w), y[:4])


def test_grouped_launch_equals_each_expert():
    experts = [_parts(128, 128, 2.5, CB_MUL1, seed=10 + e) for e in range(3)]
    w = Exl3Weight.from_tensors(experts, DEV)
    x = torch.randn(4, 2, 128)
    ids = torch.tensor([2, 0, 2, 1], dtype=torch.int32)
    rows = torch.tensor([2, 1, 2, 2], dtype=torch.int32)
    y = exl3_grouped(x.to(DEV), w, ids, rows).cpu()
    for g in range(4):
        ref = exl3_linear(x[g, :int(rows[g])], experts[int(ids[g])])
        _close(y[g, :int(rows[g])], ref)


# ---- GPU, V4.1 shapes ---------------------------------------------------------------------------------------------

V41_SHAPES = [
    ("routed expert w1 5120->2304 @2.5 mul1", 5120, 2304, 2.5, CB_MUL1),
    ("routed expert w2 2304->5120 @2.5 mul1", 2304, 5120, 2.5, CB_MUL1),
    ("attention wq_a 5120->1280 @4 3inst", 5120, 1280, 4, CB_3INST),
    ("attention wo_a slice 4096->1024 @5 mcg", 4096, 1024, 5, CB_MCG),
    ("indexer wk 512->128 @8 3inst", 512, 128, 8, CB_3INST),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n_in,n_out,K,cb", V41_SHAPES)
def test_v41_shapes_on_gpu(name, n_in, n_out, K, cb):
    t = _parts(n_in, n_out, K, cb, seed=n_in + n_out)
    w = Exl3Weight.from_tensors(t, "cuda")
    w_rot = decode_trellis(t["trellis"], K, cb)
    assert torch.equal(exl3_reconstruct(w).cpu().view(torch.int16), w_rot.view(torch.int16))
    for rows in (1, 8, 200):
        x = torch.randn(rows, n_in)
        ref = exl3_linear(x, t, w_rot=w_rot)
        _close(exl3_linear_triton(x.cuda(), w), ref)
        _close(exl3_linear_prompt(x.cuda(), w), ref)


@pytest.mark.gpu
def test_v41_grouped_experts_on_gpu():
    experts = [_parts(5120, 2304, 2.5, CB_MUL1, seed=100 + e) for e in range(8)]
    w = Exl3Weight.from_tensors(experts, "cuda")
    ids = torch.tensor([7, 1, 4, 0, 5, 2], dtype=torch.int32)
    x = torch.randn(6, 3, 5120)
    y = exl3_grouped(x.cuda(), w, ids).cpu()
    for g in range(6):
        _close(y[g], exl3_linear(x[g], experts[int(ids[g])]))
    # one row alone == the same row inside the grouped launch
    solo = exl3_grouped(x[:1, :1].cuda(), w, ids[:1]).cpu()
    assert torch.equal(solo[0, 0], y[0, 0])
