"""Logits of a prompt (and of a teacher-forced or greedy continuation) from a checkpoint, float32 on CPU; and the
per-prompt agreement figures of a test-vector set.

    python -m dsv41.tools.logits --checkpoint DIR --tokens 1,2,3 [--feed 4,5,6 | --decode N] [--chunk N]
                                 [--quirk] [--no-qat] [--tp-shards S] --out FILE.npz
    python -m dsv41.tools.logits --vectors ../shared/vectors/model/tiny-a [--no-qat] [--tp-shards S]

Writes `prompt_logits` float32 [L, V] (every prompt position), `decode_tokens` int64 [N] and `decode_logits`
float32 [N, V]: decode step k feeds decode_tokens[k] alone at position L+k and records its logits. With --feed the
tokens are given (teacher forcing); with --decode N, decode_tokens[0] is the argmax of the last prompt row and
decode_tokens[k+1] the argmax of step k (ties to the lower id). --chunk N prefills the prompt N tokens per forward.

--vectors DIR runs every prompt of an oracle vector set (DIR/checkpoint, DIR/vectors.safetensors, or with --no-qat
DIR/vectors_noquant.safetensors; the set's README.md) as its README says: one-shot prefill, then the oracle's
decode_ids fed one per forward. It prints, per prompt, prefill and decode apart, the figures the README's criteria
are stated in (per position p: max over the vocabulary of |ours - oracle|): the median over positions, the share of
positions within 2e-2 and within 1e-4, the argmax agreement, the max, the first position beyond 1e-4, and whether
the README's criteria hold (QAT: median <= 1e-4, >= 95 % within 2e-2, argmax >= 98 %; no fake-quant: >= 99.5 %
within 1e-4, argmax equal). tests/test_model_vectors.py asserts on these same figures (`vector_figures`).
--tp-shards S: the shards every split product is computed in (default weights.TP_SHARDS, what the server computes;
1 = whole products, the reference's summation order; docs/tp.md "Summation order and the reference").
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.model.model import Model, SeqInput
from dsv41.model.weights import TP_SHARDS


def greedy(row: torch.Tensor) -> int:
    """argmax of a logits row, ties to the lower id."""
    return int(torch.nonzero(row == row.max())[0, 0])


def prefill(model: Model, state, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    """Run `tokens` into `state` (in chunks of `chunk` if given) and return the logits of every position [L, V]."""
    step = chunk or len(tokens)
    outs = []
    for a in range(0, len(tokens), step):
        ids = torch.tensor(tokens[a:a + step], dtype=torch.long)
        outs.append(model.forward([SeqInput(state=state, ids=ids, logits="all")])[0])
    return torch.cat(outs)


def continue_tokens(model: Model, state, first: int | None, feed: list[int] | None, steps: int):
    """One token per forward. With `feed`, feed those; else greedy from `first`. -> (tokens [N], logits [N, V])."""
    toks, rows = [], []
    nxt = first
    for k in range(len(feed) if feed is not None else steps):
        tok = feed[k] if feed is not None else nxt
        row = model.forward([SeqInput(state=state, ids=torch.tensor([tok]), logits="all")])[0][0]
        toks.append(tok)
        rows.append(row)
        nxt = greedy(row)
    V = model.t.vocab_size
    return (torch.tensor(toks, dtype=torch.long),
            torch.stack(rows) if rows else torch.zeros((0, V)))


def run(model: Model, tokens: list[int], feed: list[int] | None = None, decode: int = 0,
        chunk: int | None = None) -> dict[str, torch.Tensor]:
    """prompt_logits [L, V], decode_tokens [N], decode_logits [N, V] for one fresh sequence."""
    if not tokens:
        raise ValueError("--tokens is empty")
    st = model.new_state()
    prompt = prefill(model, st, tokens, chunk)
    first = greedy(prompt[-1])
    dt, dl = continue_tokens(model, st, first, feed, decode)
    return {"prompt_logits": prompt, "decode_tokens": dt, "decode_logits": dl}


# ---- agreement with an oracle vector set (README.md of ../shared/vectors/model/<set>) ---------------------------

@dataclass
class Figures:
    """One prompt's prefill or decode rows against the oracle's (d[p] = max over the vocabulary of |Δ| at row p)."""
    prompt: int
    part: str                 # "prefill" | "decode"
    positions: int
    median: float             # median of d
    within_2e2: float         # share of rows with d <= 2e-2
    within_1e4: float         # share of rows with d <= 1e-4
    argmax: float             # share of rows whose argmax equals the oracle's
    max: float
    first_off: int | None     # first row with d > 1e-4 (decode: step index), None if none

    def meets_qat(self) -> bool:
        """The README's QAT criteria: median <= 1e-4, >= 95 % of rows within 2e-2, argmax agreement >= 98 %."""
        return self.median <= 1e-4 and self.within_2e2 >= 0.95 and self.argmax >= 0.98

    def meets_noquant(self) -> bool:
        """The README's criteria without fake-quant: >= 99.5 % of rows within 1e-4, every argmax equal."""
        return self.within_1e4 >= 0.995 and self.argmax == 1.0

    def meets(self, qat: bool) -> bool:
        return self.meets_qat() if qat else self.meets_noquant()


def figures(out: torch.Tensor, ref: torch.Tensor, prompt: int, part: str) -> Figures:
    if out.shape != ref.shape:
        raise ValueError(f"prompt {prompt} {part}: logits {tuple(out.shape)} against the oracle's {tuple(ref.shape)}")
    d = (out.float() - ref.float()).abs().amax(-1)
    off = torch.nonzero(d > 1e-4)
    return Figures(prompt=prompt, part=part, positions=d.numel(), median=d.median().item(),
                   within_2e2=(d <= 2e-2).float().mean().item(), within_1e4=(d <= 1e-4).float().mean().item(),
                   argmax=(out.argmax(-1) == ref.argmax(-1)).float().mean().item(), max=d.max().item(),
                   first_off=int(off[0, 0]) if off.numel() else None)


def load_vectors(vectors_dir: str | Path, qat: bool) -> dict[str, torch.Tensor]:
    """The set's arrays for one mode; the prompts' input_ids always come from vectors.safetensors."""
    from safetensors.torch import load_file
    d = Path(vectors_dir)
    v = load_file(str(d / "vectors.safetensors"))
    if qat:
        return v
    nq = load_file(str(d / "vectors_noquant.safetensors"))
    nq.update({k: t for k, t in v.items() if k.endswith(".input_ids")})
    return nq


def prompt_count(vec: dict[str, torch.Tensor]) -> int:
    return sum(1 for k in vec if k.startswith("prompt.") and k.endswith(".input_ids"))


def vector_figures(model: Model, vec: dict[str, torch.Tensor], prompts=None) -> list[Figures]:
    """Every prompt (or those listed) as the set's README says: one-shot prefill from an empty state, then the
    oracle's decode_ids fed one per forward (teacher forcing); its prefill and decode figures, in prompt order."""
    out = []
    for i in (range(prompt_count(vec)) if prompts is None else prompts):
        r = run(model, vec[f"prompt.{i}.input_ids"].tolist(), feed=vec[f"prompt.{i}.decode_ids"].tolist())
        out.append(figures(r["prompt_logits"], vec[f"prompt.{i}.prefill_logits"], i, "prefill"))
        out.append(figures(r["decode_logits"], vec[f"prompt.{i}.decode_logits"], i, "decode"))
    return out


def figures_table(figs: list[Figures], qat: bool) -> str:
    head = (f"{'prompt':>6} {'part':<7} {'rows':>4} {'median':>8} {'<=2e-2':>7} {'<=1e-4':>7} {'argmax':>7} "
            f"{'max':>8} {'first>1e-4':>10}  README")
    lines = [head]
    for f in figs:
        lines.append(f"{f.prompt:>6} {f.part:<7} {f.positions:>4} {f.median:>8.2e} {f.within_2e2:>7.1%} "
                     f"{f.within_1e4:>7.1%} {f.argmax:>7.1%} {f.max:>8.2e} "
                     f"{'-' if f.first_off is None else f.first_off:>10}  {'ok' if f.meets(qat) else 'MISS'}")
    met = sum(f.meets(qat) for f in figs)
    lines.append(f"README {'QAT' if qat else 'no-fake-quant'} criteria met by {met} of {len(figs)} prompt parts")
    return "\n".join(lines)


def _ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"token lists are comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.tools.logits", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", help="checkpoint folder (with --vectors: default DIR/checkpoint)")
    ap.add_argument("--tokens", help="comma-separated prompt token ids")
    ap.add_argument("--vectors", help="an oracle vector set's folder: print its per-prompt agreement figures")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--feed", help="comma-separated tokens fed one per forward after the prompt")
    g.add_argument("--decode", type=int, default=0, help="greedy steps after the prompt")
    ap.add_argument("--chunk", type=int, help="prefill chunk size (default: one forward)")
    ap.add_argument("--quirk", action="store_true", help="the release's indexer-key publication (arch.md §2.8)")
    ap.add_argument("--no-qat", action="store_true", help="window KV / compressed KV / indexer q,k fake-quant off")
    ap.add_argument("--tp-shards", type=int, default=TP_SHARDS,
                    help=f"shards every split product is computed in (default {TP_SHARDS}, as served; 1: whole products)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.chunk is not None and a.chunk < 1:
        ap.error("--chunk must be >= 1")
    if a.decode < 0:
        ap.error("--decode must be >= 0")
    if a.tp_shards < 1:
        ap.error("--tp-shards must be >= 1")
    if a.vectors:
        if a.tokens or a.feed or a.decode or a.chunk or a.quirk or a.out:
            ap.error("--vectors takes only --checkpoint, --no-qat and --tp-shards (the set says what to run)")
        qat = not a.no_qat
        model = Model.load(a.checkpoint or Path(a.vectors) / "checkpoint", qat=qat, tp_shards=a.tp_shards)
        vec = load_vectors(a.vectors, qat)
        print(f"{a.vectors}: {'QAT (vectors.safetensors)' if qat else 'no fake-quant (vectors_noquant.safetensors)'}"
              f", tp-shards {a.tp_shards}; per row: max over the vocabulary of |ours - oracle|")
        print(figures_table(vector_figures(model, vec), qat))
        return 0
    if not (a.checkpoint and a.tokens and a.out):
        ap.error("--checkpoint, --tokens and --out are required (or --vectors DIR)")
    model = Model.load(a.checkpoint, qat=not a.no_qat, index_keys="quirk" if a.quirk else "intended",
                       tp_shards=a.tp_shards)
    res = run(model, _ids(a.tokens), _ids(a.feed) if a.feed else None, a.decode, a.chunk)
    np.savez(a.out, prompt_logits=res["prompt_logits"].numpy().astype(np.float32),
             decode_tokens=res["decode_tokens"].numpy().astype(np.int64),
             decode_logits=res["decode_logits"].numpy().astype(np.float32))
    print(f"wrote {a.out}: prompt_logits {tuple(res['prompt_logits'].shape)}, "
          f"decode_tokens {tuple(res['decode_tokens'].shape)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
