"""Programmatic dependent launch (PDL) for the decode round's kernels.

In a CUDA graph a dependent launch costs ~1.0 us of gap for a one-program kernel and ~3.3 us for a 132-program
GEMV on the H200; launched with PDL (the next kernel may be scheduled while this one finishes; it waits with
`griddepcontrol.wait` before it touches memory) 0.58 and 2.47 us (bench/pdl_bench.py, bench/results/pdl.md). A
1-row decode layer is ~115 launches, most of a few KB.

The rule every kernel launched so obeys: `wait_inputs(PDL)` (or csrc's griddep_wait) before its first read of
anything a kernel wrote and before its first write; only reads of weights and constants may come before it. Then
`griddepcontrol.wait` returning means the previous kernel has completed and its writes are visible, and since that
kernel obeyed the same rule, so had every kernel before it: stream order holds for all of them. A kernel launched
without PDL waits for its predecessor as always, so kernels with and without it mix freely. The result of every
kernel is unchanged (the bits do not depend on when a kernel starts).

`ENABLED` (on by default on sm_90+) is the bench's switch for timing both ways; the interpreter never launches so.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ENABLED = True


@triton.jit
def wait_inputs(PDL: tl.constexpr):
    """The top of a kernel launched with PDL: wait until the previous kernel's writes are visible, then let the
    next kernel be scheduled (it waits the same way before touching memory)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def on(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device launches with PDL: CUDA tensors of an sm_90+ device, ENABLED, compiled."""
    return (ENABLED and not INTERPRET and t.device.type == "cuda"
            and _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()))


def options(t: torch.Tensor) -> dict:
    """A Triton launch's PDL arguments: the kernel's PDL constexpr and the launch_pdl option."""
    return {"PDL": True, "launch_pdl": True} if on(t) else {"PDL": False}
