"""dsv41: an exact, fast inference server for DeepSeek-V4.1-Flash."""
import os
from pathlib import Path

__version__ = "0.1.0"

# MKL's default reproducibility mode may sum a GEMM in another order when an operand's address alignment differs, and
# a row tile of the CPU path (model/linear.py) is a view at an offset set by its place in the batch: on the H200
# host's 16-thread AVX-512 CPU that made a row's float32 result depend on the round (scripts/h200/cpuexact.sh, 27
# differing rows; 0 with MKL_CBWR=AUTO,STRICT, which keeps the best code path but makes results independent of
# alignment). MKL reads it at its first call, so setting it here, before any product, is enough.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

REPO_ROOT = Path(__file__).resolve().parent.parent
# The V4.1 tokenizer ships in kit/ so a fresh clone serves without any download.
BUILTIN_TOKENIZER_DIR = REPO_ROOT / "kit" / "tokenizer"


def shared_dir() -> Path:
    """The read-only ../shared folder beside the checkout (test vectors, specs); DSV41_SHARED overrides."""
    return Path(os.environ.get("DSV41_SHARED", REPO_ROOT.parent / "shared")).resolve()
