"""dsv41: an exact, fast inference server for DeepSeek-V4.1-Flash."""
import os
from pathlib import Path

__version__ = "0.1.0"

REPO_ROOT = Path(__file__).resolve().parent.parent
# The V4.1 tokenizer ships in kit/ so a fresh clone serves without any download.
BUILTIN_TOKENIZER_DIR = REPO_ROOT / "kit" / "tokenizer"


def shared_dir() -> Path:
    """The read-only ../shared folder beside the checkout (test vectors, specs); DSV41_SHARED overrides."""
    return Path(os.environ.get("DSV41_SHARED", REPO_ROOT.parent / "shared")).resolve()
