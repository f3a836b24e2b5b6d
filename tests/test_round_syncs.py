"""A decode round on the GPU path makes the host wait on the device nowhere (issue 8: a host synchronisation inside a
round drains the GPU's queue, and no round with one can become one CUDA graph). Audited on CPU: the round runs on
the CUDA path (the op set cuda_ops(), the Triton kernels under the interpreter, the routed experts as one stacked
launch)
under a dispatch mode that notes every op which, on CUDA, copies a value to the host: item / tolist / bool
(_local_scalar_dense), nonzero, unique, masked_select, bincount, repeat_interleave without its size, boolean-mask
indexing. The only ones allowed read the round's inputs, which are host tensors by design. Not seen here: an
explicit .cpu() / .to("cpu") (every tensor is a host tensor on this path), which round_profile counts on the H200.
(The torch fallbacks do wait, in the per-expert loop of MoE._routed: they never run inside a graph.)"""
import collections
import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsv41
import kernels
from dsv41.model.model import Model, SeqInput
from dsv41.model.ops import cuda_ops
from dsv41.tools.make_tiny import main as make_tiny

# "our" frames are those of files inside the two packages (by their folders, not by a "/dsv41/" in the path: a
# checkout named dsv41, as `git clone` names it, has that in every path, this test's own hook included)
OURS = tuple(os.path.dirname(os.path.abspath(p.__file__)) + os.sep for p in (dsv41, kernels))
SYNCING = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "bincount", "repeat_interleave")
# (function, file) of the ops allowed: the input ids' checks and the Engram hashes of the input ids (host tensors)
HOST_INPUTS = {("_check", "model.py"), ("compress", "engram_hash.py")}


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        bool_index = name.startswith("index.") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for a in args if isinstance(a, (list, tuple))
            for t in a)
        if bool_index or any(s in name for s in SYNCING):
            ours = [f for f in traceback.extract_stack() if os.path.abspath(f.filename).startswith(OURS)]
            f = ours[-1] if ours else None
            self.sites[(name, f.name if f else "?", os.path.basename(f.filename) if f else "?")] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def gpu_path_model(tmp_path_factory):
    if not cuda_ops().kernels:
        pytest.skip("no Triton kernels in kernels/")
    out = tmp_path_factory.mktemp("syncs") / "ck"
    make_tiny(["--out", str(out), "--layers", "7", "--vocab", "512", "--seed", "5"])
    # what Model.load does on CUDA: FP8/FP4 weights kept, the routed experts stacked for the grouped kernel; the
    # reference model of the same checkpoint prefills the states (its prompt passes, quick without the interpreter)
    m = Model.load(out, keep_quant=True, ops=cuda_ops())
    assert all(blk.moe.stack is not None for blk in m.blocks)
    return m, Model.load(out)


def test_a_decode_round_on_the_gpu_path_never_waits_for_the_device(gpu_path_model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    m, host = gpu_path_model
    g = torch.Generator().manual_seed(1)
    states = [m.new_state() for _ in range(3)]
    for k, st in enumerate(states):   # histories long enough for compressed entries and indexer keys (reference)
        host.forward([SeqInput(st, torch.randint(3, 500, (9 + 4 * k,), generator=g), "last")])
    m.forward([SeqInput(st, torch.tensor([7]), "last") for st in states])   # warm (first calls)
    audit = _Syncs()
    with audit:
        out = m.forward([SeqInput(st, torch.tensor([11 + k]), "last") for k, st in enumerate(states)])
    assert len(out) == 3 and all(torch.isfinite(o).all() for o in out)
    waits = {site: n for site, n in audit.sites.items() if site[1:] not in HOST_INPUTS}
    assert not waits, f"ops that wait for the device inside a decode round: {waits}"
    assert audit.sites, "the audit saw no op at all: the detector is broken"
