"""Image rows in a round: the prompt chunks that cover image span positions get their rows (docs/vision.md).

Rank 0's scheduler hands the runner each filling sequence's `PromptImage` spans; a chunk [start, start + n) takes
`chunk_image_inputs` of them, so a span may be cut across rounds anywhere and each position still gets the same row
(Exactness). The plan itself stays plain data: each `SeqRows` says whether its rows cover an image position
(`SeqRows.images`, set by the scheduler with `covers_images`). On several ranks, rank 0 sends the flagged rows'
`[embeds | token_type + 1]` through the ring (an all-reduce where every other rank adds zeros, which is exact), and
every rank then runs the rows it received, rank 0 included, so the ranks agree bit for bit. A round with no flagged
row (every text-only round, every decode round) makes no collective for images.
"""
from __future__ import annotations

import torch

from dsv41.comm.plan import PlanError
from dsv41.model.vision import chunk_image_inputs


def covers_images(spans, start: int, n: int) -> bool:
    """Whether positions [start, start + n) of a prompt with these PromptImage spans hold an image position: exactly
    when `chunk_rows` returns rows."""
    return any(p.start < start + n and start < p.end for p in spans or ())


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
    for k, (r, inp) in enumerate(zip(plan.rows, inputs)):
        spans = images.get(r.seq)
        got.append(chunk_rows(spans, r.start, len(r.ids), hidden) if spans else (None, None))
        if got[-1][0] is not None and not r.images:   # the other ranks would not get these rows
            raise PlanError(f"round {plan.round}: rows[{k}] (seq {r.seq}) cover image positions but the plan does "
                            f"not flag them (SeqRows.images)")
    comm = getattr(model, "comm", None)
    if comm is not None and comm.world > 1:
        got = _share(comm, got, [k for k, r in enumerate(plan.rows) if r.images], [len(r.ids) for r in plan.rows],
                     hidden, getattr(model, "device", "cpu"))
    for inp, (e, t) in zip(inputs, got):
        if e is not None:
            inp.embeds, inp.token_type = e, t


def _share(comm, got: list, which: list[int], lengths: list[int], hidden: int, device) -> list:
    """Rank 0's rows of the plan's flagged rows `which` on every rank: their [embeds | type + 1] on the model's
    device, summed over the ranks in one all-reduce (the others add zeros; text positions carry type -1, so a row
    no rank has reads back as all text and is passed as none); types come back to the host, where the forward
    reads them. No flagged row: no collective."""
    out: list = [(None, None)] * len(got)
    if not which:
        return out
    parts = []
    for k in which:
        e, t = got[k]
        if e is None:
            parts.append(torch.zeros(lengths[k], hidden + 1, device=device))
        else:
            parts.append(torch.cat([e.float().to(device), t.float().to(device)[:, None] + 1], dim=1))
    summed = comm.all_reduce(torch.cat(parts))
    at = 0
    for k in which:
        block = summed[at:at + lengths[k]]
        at += lengths[k]
        types = block[:, hidden].round().long().cpu() - 1
        if bool((types >= 0).any()):
            out[k] = (block[:, :hidden].contiguous(), types)
    return out
