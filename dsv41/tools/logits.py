"""Logits of a prompt (and of a teacher-forced or greedy continuation) from a checkpoint, float32 on CPU.

    python -m dsv41.tools.logits --checkpoint DIR --tokens 1,2,3 [--feed 4,5,6 | --decode N] [--chunk N]
                                 [--quirk] [--no-qat] --out FILE.npz

Writes `prompt_logits` float32 [L, V] (every prompt position), `decode_tokens` int64 [N] and `decode_logits`
float32 [N, V]: decode step k feeds decode_tokens[k] alone at position L+k and records its logits. With --feed the
tokens are given (teacher forcing); with --decode N, decode_tokens[0] is the argmax of the last prompt row and
decode_tokens[k+1] the argmax of step k (ties to the lower id). --chunk N prefills the prompt N tokens per forward.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from dsv41.model.model import Model, SeqInput


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


def _ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"token lists are comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.tools.logits", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", required=True, help="comma-separated prompt token ids")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--feed", help="comma-separated tokens fed one per forward after the prompt")
    g.add_argument("--decode", type=int, default=0, help="greedy steps after the prompt")
    ap.add_argument("--chunk", type=int, help="prefill chunk size (default: one forward)")
    ap.add_argument("--quirk", action="store_true", help="the release's indexer-key publication (arch.md §2.8)")
    ap.add_argument("--no-qat", action="store_true", help="window KV / compressed KV / indexer q,k fake-quant off")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.chunk is not None and a.chunk < 1:
        ap.error("--chunk must be >= 1")
    if a.decode < 0:
        ap.error("--decode must be >= 0")
    model = Model.load(a.checkpoint, qat=not a.no_qat, index_keys="quirk" if a.quirk else "intended")
    res = run(model, _ids(a.tokens), _ids(a.feed) if a.feed else None, a.decode, a.chunk)
    np.savez(a.out, prompt_logits=res["prompt_logits"].numpy().astype(np.float32),
             decode_tokens=res["decode_tokens"].numpy().astype(np.int64),
             decode_logits=res["decode_logits"].numpy().astype(np.float32))
    print(f"wrote {a.out}: prompt_logits {tuple(res['prompt_logits'].shape)}, "
          f"decode_tokens {tuple(res['decode_tokens'].shape)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
