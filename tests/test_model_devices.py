"""Every tensor the forward and the draft make names its device: they run without an ambient torch.device(...) mode
(docs/gpu.md "Same code, device tensors"), whose Python hook would cost every torch call of a round ~7 µs on the
GPU host. On the CPU a factory call without a device still works, so this audit is what catches one that would put
a tensor on the host during a CUDA round: each torch factory function (torch.utils._device's list) called inside
Model.forward / DSpark.draft without `device=` fails the test, on the reference op set and on the CUDA path's
(cuda_ops(kernels=False): the torch fallbacks), over prompt passes, mixed rounds, decode and verify rounds, image
rows, a trace and drafts. Host-side work inside the forward (Engram hashing and rows, the round's integer prep, the
draft's ring index) sets device="cpu" itself: a `with torch.device("cpu")` block would pass this audit but costs
every torch call inside it the same hook (~950 calls of a 32-row round's Engram work on tiny-a)."""
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from dsv41.model.model import Model, SeqInput
from dsv41.model.ops import cuda_ops

CTORS = _device_constructors()


class FactoryAudit(TorchFunctionMode):
    """Records (file:line function, factory) for each factory call without a device."""

    def __init__(self):
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CTORS and kwargs.get("device") is None:
            frames = [f for f in traceback.extract_stack()[:-1] if "/dsv41/" in f.filename or "/kernels/" in f.filename]
            where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
            self.sites.add(f"{where}: torch.{func.__name__}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def tiny_model():
    from dsv41.api.engine import builtin_checkpoint
    return Model.load(builtin_checkpoint())


def _ids(n, seed, vocab):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _exercise(m: Model, audit: FactoryAudit) -> None:
    """Prompt pass, a mixed round (per-sequence path), decode rounds (the batched round), verify rounds, image rows,
    a traced call and, with DSpark stages, drafts; the audit is on inside the model's calls only (the inputs and
    new states are made outside: a state's Engram history lives on the host)."""
    V = min(4000, m.t.vocab_size)

    def fwd(batch, **kw):
        with audit:
            m.forward(batch, **kw)
    a, b, c = m.new_state(), m.new_state(), m.new_state()
    fwd([SeqInput(a, _ids(24, 1, V))])
    fwd([SeqInput(b, _ids(7, 2, V), logits="all"), SeqInput(a, _ids(3, 3, V), logits="none")])
    for k in range(5):
        fwd([SeqInput(s, _ids(1, 10 + k, V)) for s in (a, b)])
    fwd([SeqInput(s, _ids(3, 20, V), logits="all") for s in (a, b)], trace={})
    tt = torch.full((6,), -1, dtype=torch.long)
    tt[2:4] = 0
    emb = torch.randn(6, m.t.hidden_size, generator=torch.Generator().manual_seed(4))
    fwd([SeqInput(c, _ids(6, 5, V), embeds=emb, token_type=tt)])
    if m.dspark is not None:
        with audit:
            m.dspark.draft([(a, 7), (b, 9)])


def test_audit_catches_a_factory_call_without_a_device():
    audit = FactoryAudit()
    with audit:
        torch.arange(3)
        torch.zeros(2, device="cpu")
    assert len(audit.sites) == 1 and next(iter(audit.sites)).endswith("torch.arange")


def test_forward_and_draft_name_every_device(tiny_model):
    audit = FactoryAudit()
    _exercise(tiny_model, audit)
    assert not audit.sites, sorted(audit.sites)


def test_the_cuda_path_names_every_device():
    """The CUDA path's own functions (tree row sums, the batched round's gathers; torch fallbacks for the kernels)
    on CPU tensors."""
    from dsv41.api.engine import builtin_checkpoint
    m = Model.load(builtin_checkpoint(), ops=cuda_ops(kernels=False))
    assert m.ops.name == "cuda-fallbacks"
    audit = FactoryAudit()
    _exercise(m, audit)
    assert not audit.sites, sorted(audit.sites)
