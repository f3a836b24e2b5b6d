"""dsv41 sets MKL's reproducibility mode before any product (docs/model.md, Exactness construction): on the H200
host MKL's default mode gave a row tile other bits at another address alignment. An explicit setting wins."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = "import os, dsv41, torch; torch.ones(3, 3) @ torch.ones(3, 3); print(os.environ.get('MKL_CBWR'))"


def _probe(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_import_sets_strict_alignment_independent_mode():
    assert _probe({}) == "AUTO,STRICT"


def test_an_explicit_setting_wins():
    assert _probe({"MKL_CBWR": "COMPATIBLE"}) == "COMPATIBLE"
