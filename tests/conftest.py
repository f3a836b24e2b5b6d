import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dsv41 import shared_dir  # noqa: E402

# Without a GPU, Triton kernels run in the interpreter so CI still tests their logic (set before triton is imported).
try:
    import torch as _torch
    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


@pytest.fixture(scope="session")
def shared() -> Path:
    d = shared_dir()
    if not (d / "vectors").is_dir():
        pytest.fail(f"../shared (test vectors) not found at {d}; set DSV41_SHARED")
    return d


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for it in items:
        if "gpu" in it.keywords:
            it.add_marker(skip)
