"""kernels/cuda.py's ctypes mirror of CUlaunchConfig / CUlaunchAttribute (the dependent-launch path, launch(pdl=True))
has the layout of the CUDA driver header: a C program built against cuda.h prints the sizes and offsets. Runs where a
C compiler and cuda.h are found (no GPU needed), else skips."""
from __future__ import annotations

import ctypes
import glob
import shutil
import subprocess

import pytest

from kernels import cuda

C_SRC = r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
    CUlaunchAttributeValue v;
    printf("%zu %zu %zu %zu %zu %zu %zu %d %zu\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
           offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
           (size_t)((char*)&v.programmaticStreamSerializationAllowed - (char*)&v));
    return 0;
}
"""


def test_launch_config_layout_matches_cuda_h(tmp_path):
    heads = sorted(glob.glob("/usr/local/cuda*/include/cuda.h"), reverse=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    if not heads or cc is None:
        pytest.skip("needs cuda.h and a C compiler")
    src = tmp_path / "layout.c"
    src.write_text(C_SRC)
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{heads[0].rsplit('/', 1)[0]}", str(src), "-o", str(exe)], check=True)
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    A, C = cuda._LaunchAttribute, cuda._LaunchConfig
    mine = [ctypes.sizeof(A), A.value.offset, ctypes.sizeof(C), C.shared.offset, C.stream.offset, C.attrs.offset,
            C.nattrs.offset, cuda._PROGRAMMATIC_STREAM_SERIALIZATION, 0]
    assert mine == got
