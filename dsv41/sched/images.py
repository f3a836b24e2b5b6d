"""Image rows in a round: the prompt chunks that cover image span positions get their rows (docs/vision.md).

Rank 0's scheduler hands the runner each filling sequence's `PromptImage` spans; a chunk [start, start + n) takes
`chunk_image_inputs` of them, so a span may be cut across rounds anywhere and each position still gets the same row
(Exactness). The plan itself stays plain data: on several ranks, rank 0 sends the rows through the ring (an
all-reduce where every other rank adds zeros, which is exact), first one flag per plan row, then the flagged rows'
`[embeds | token_type]`. Every rank then runs the rows it received, rank 0 included, so the ranks agree bit for bit.
"""
from __future__ import annotations

import torch

from dsv41.model.vision import chunk_image_inputs


def chunk_rows(spans, start: int, n: int, hidden: int):
    """(embeds, token_type) of positions [start, start + n) of a prompt with these PromptImage spans, or
    (None, None) when none of them is an image position."""
    return chunk_image_inputs([(p.start, p.image.embeds, p.image.token_type) for p in spans], start, start + n,
                              hidden)


def attach_image_rows(plan, inputs: list, images: dict, model) -> None:
    """Set `embeds` / `token_type` on the SeqInputs (in plan row order) whose rows cover image positions.
    `images`: seq -> PromptImage spans (rank 0; {} on the other ranks)."""
    hidden = int(model.t.hidden_size)
    got = []
    for r, inp in zip(plan.rows, inputs):
        spans = images.get(r.seq)
        got.append(chunk_rows(spans, r.start, len(r.ids), hidden) if spans else (None, None))
    comm = getattr(model, "comm", None)
    if comm is not None and comm.world > 1:
        got = _share(comm, got, [len(r.ids) for r in plan.rows], hidden, getattr(model, "device", "cpu"))
    for inp, (e, t) in zip(inputs, got):
        if e is not None:
            inp.embeds, inp.token_type = e, t


def _share(comm, got: list, lengths: list[int], hidden: int, device) -> list:
    """Rank 0's rows on every rank: flags (on the host, as the runner's draft decisions), then the flagged rows'
    [embeds | type] on the model's device, each summed over the ranks (the others add zeros); types come back to
    the host, where the forward reads them."""
    flags = comm.all_reduce(torch.tensor([0.0 if e is None else 1.0 for e, _ in got]))
    which = [k for k, f in enumerate(flags.tolist()) if f != 0.0]
    if not which:
        return [(None, None)] * len(got)
    parts = []
    for k in which:
        e, t = got[k]
        if e is None:
            parts.append(torch.zeros(lengths[k], hidden + 1, device=device))
        else:
            parts.append(torch.cat([e.float().to(device), t.float().to(device)[:, None]], dim=1))
    summed = comm.all_reduce(torch.cat(parts))
    out: list = [(None, None)] * len(got)
    at = 0
    for k in which:
        block = summed[at:at + lengths[k]]
        at += lengths[k]
        out[k] = (block[:, :hidden].contiguous(), block[:, hidden].round().long().cpu())
    return out
