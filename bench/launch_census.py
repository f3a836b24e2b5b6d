"""Launches a decode round issues on the CUDA path, by call site (issue 24's budget: <= 20 a layer). At one row each
launch is a few microseconds of GPU time, more than a layer's bytes once the host is out of the round, so the count
is what bounds a graphed round there.

Counted on the CPU: the model loaded with the CUDA op set (cuda_ops(): FP8/FP4 weights kept, the Triton kernels run
by the interpreter), every torch op that is not a view or a bare allocation counted as one launch, every Triton
launch as one, grouped by the innermost dsv41/kernels function that issued it (and its caller). The kernels that
take CUDA tensors only (kernels/mhc.py, act.py, router.py, fake_quant.py, norm_rope_quant.py, compress_pool.py,
rope.py's cos_sin) are launched as on CUDA. The round's host work (`Model._prepare_round`: host tensors, one copy)
is not counted. Prompts are fed by the reference model of the same checkpoint. Not a GPU measurement: a real round's
launch count differs where shapes pick other paths (the small checkpoint's narrow products, 4 attention heads).

    python bench/launch_census.py [--checkpoint DIR] [--rows 1] [--top 40] [--tag TAG] [--out FILE] [--count-only]
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported: the kernels run on CPU tensors

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the CUDA-only kernels' launches as on CUDA (on CPU tensors their wrappers leave the op to torch)
for _mod, _fn, _launch in (("kernels.mhc", "hc_mix", "launch"), ("kernels.mhc", "hc_pre", "launch_pre"),
                           ("kernels.mhc", "hc_site_mixes", "launch_site"),
                           ("kernels.act", "swiglu_h", "launch"), ("kernels.router", "router_scores", "launch"),
                           ("kernels.router", "route", "launch_route"),
                           ("kernels.rope", "cos_sin", "launch_cos_sin"),
                           ("kernels.compress_pool", "pool_norm", "launch"),
                           ("kernels.norm_rope_quant", "norm_rope_quant", "launch"),
                           ("kernels.fake_quant", "fp8_fake_quant", "FP8"),
                           ("kernels.fake_quant", "fp4_fake_quant_ue8m0", "FP4_UE8M0"),
                           ("kernels.fake_quant", "fp4_fake_quant_e4m3", "FP4_E4M3")):
    try:
        _m = __import__(_mod, fromlist=[_fn])
        if _mod == "kernels.fake_quant":        # one kernel, three round trips: `launch` with the kind
            setattr(_m, _fn, lambda x, block, _k=getattr(_m, _launch), _l=_m.launch: _l(x, block, _k))
        elif _mod == "kernels.norm_rope_quant":     # where it applies
            setattr(_m, _fn, lambda x, w, eps, c, s, inv, qt, _m=_m: _m.launch(x, w, eps, c, s, inv, qt)
                    if _m.applies(x, w, c, qt) else None)
        else:
            setattr(_m, _fn, getattr(_m, _launch))
    except (ImportError, AttributeError):
        pass

from dsv41.model.model import Model, SeqInput  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402
from round_ops import NO_LAUNCH  # noqa: E402 - the ops that launch no kernel on a GPU, as round_ops counts them

OURS = (str(ROOT / "dsv41"), str(ROOT / "kernels"))


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()
        self.off = 0

    @staticmethod
    def site() -> str:
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(OURS)]
        return " < ".join(f.name for f in frames[-1:-3:-1]) if frames else "?"

    active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.off and not (func.is_view or func.overloadpacket.__name__ in NO_LAUNCH):
            self.sites[self.site()] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=40)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--count-only", action="store_true",
                    help="count the Triton launches without running them (the interpreter takes hours at release "
                         "shapes): each skipped launch zeroes its tensors instead, so the values after it are "
                         "meaningless but the launches (which never depend on values inside a round) are counted")
    a = ap.parse_args()
    if a.checkpoint is None:
        from dsv41.api.engine import builtin_checkpoint
        a.checkpoint = str(builtin_checkpoint())
    census = Census()
    from triton.runtime import interpreter
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kw):
        if census.active and not census.off:    # the census's round only (the first calls launch the same kernels)
            census.sites["triton:" + getattr(self.fn, "__name__", "?") + " < " + census.site()] += 1
        census.off += 1
        try:
            if a.count_only:
                for t in list(args) + list(kw.values()):
                    if isinstance(t, torch.Tensor):
                        t.zero_()
                return None
            return run(self, *args, **kw)
        finally:
            census.off -= 1
    interpreter.InterpretedFunction.run = counted

    # The grouped wo_a is one CUDA C launch on the GPU (fp8_linear_grouped); on CPU tensors it runs group by group
    # (o_groups / shards Triton launches and a cat): counted as the one launch it is there.
    from kernels import fp8_linear as _fp8
    grouped = _fp8.fp8_linear_grouped

    def grouped_once(x, w, scale, groups):
        if census.active:
            census.sites["cuda: fp8_linear_grouped (one launch on the GPU) < " + census.site()] += 1
        census.off += 1
        try:
            return grouped(x, w, scale, groups)
        finally:
            census.off -= 1
    _fp8.fp8_linear_grouped = grouped_once
    host = Model.load(a.checkpoint)
    m = Model.load(a.checkpoint, keep_quant=True, ops=cuda_ops())
    prepare = getattr(m, "_prepare_round", None)
    if prepare is not None:
        def prep(*args, **kw):
            census.off += 1
            try:
                return prepare(*args, **kw)
            finally:
                census.off -= 1
        m._prepare_round = prep
    g = torch.Generator().manual_seed(1)
    states = [m.new_state() for _ in range(a.rows)]
    for k, st in enumerate(states):
        host.forward([SeqInput(st, torch.randint(3, 500, (a.context + k,), generator=g), "last")])
    m.forward([SeqInput(st, torch.tensor([7]), "last") for st in states])          # first calls
    with census:
        m.forward([SeqInput(st, torch.tensor([9]), "last") for st in states])
    layers = len(m.blocks)
    total = sum(census.sites.values())
    commit = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    lines = [f"## {a.tag}", "",
             f"`python bench/launch_census.py --rows {a.rows} --context {a.context}"
             f"{' --count-only' if a.count_only else ''}` at {commit}, checkpoint "
             f"{Path(a.checkpoint).name} ({layers} layers): **{total} launches a round, {total / layers:.1f} a "
             f"layer** ({a.rows} row(s), one token each, after {a.context} tokens)", "",
             "| launches a round | site (innermost function < its caller) |", "|---|---|"]
    lines += [f"| {n} | `{s}` |" for s, n in census.sites.most_common(a.top)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        out = Path(a.out)
        old = out.read_text() if out.is_file() else ""
        head = "# Launches of a decode round on the CUDA path, counted on the CPU (bench/launch_census.py)\n\n"
        rest = old.replace(head, "", 1)
        at = rest.find("## ")          # the newest run first, after the file's notes
        at = len(rest) if at < 0 else at
        out.write_text(head + rest[:at] + text + "\n" + rest[at:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
