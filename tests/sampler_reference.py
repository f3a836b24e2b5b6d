"""The host sampler as it was before the batched device sampler (dsv41/sched/sampler.py at 930d5ec), kept verbatim as
the oracle the batched one is compared with: numpy row by row, a stable sort of the whole row. Not used by the server.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from dsv41.sched.sampler import MAX_TOP_LOGPROBS, Sample, SamplingParams, clamp_top_k, gumbel


def reference_adjust_row(row: torch.Tensor, params: SamplingParams, reply) -> torch.Tensor:
    out = row.clone()
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long)
        out[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(out.numel(), dtype=torch.bool)
        if params.prompt_tokens:
            seen[torch.tensor(params.prompt_tokens, dtype=torch.long)] = True
        if reply:
            seen[torch.tensor(reply, dtype=torch.long)] = True
        rp = float(params.repetition_penalty)
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    if reply and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(reply, dtype=torch.long), minlength=out.numel()).to(torch.float32)
        out -= float(params.frequency_penalty) * counts + float(params.presence_penalty) * (counts > 0).float()
    return out


def _lowest_id_argmax(values: np.ndarray, ids: np.ndarray) -> int:
    best = values.max()
    return int(ids[values == best].min())


def reference_sample_row(logits: torch.Tensor, position: int, params: SamplingParams, reply=()) -> Sample:
    """Draw the token at absolute `position` from one logits row [vocab]. Pure: same inputs, same token. `reply`:
    the reply's tokens before `position` (penalties; see adjust_row). logprobs are of the row as given."""
    raw = logits.detach().to("cpu", torch.float32).reshape(-1)
    row = reference_adjust_row(raw, params, reply) if params.adjusts else raw
    if params.greedy:
        token = int(torch.argmax(row))          # torch returns the first maximal index: ties to the lower id
    else:
        k = min(clamp_top_k(params.top_k), row.numel())
        # stable sort of the negated row: equal logits keep ascending id order
        order = torch.sort(-row, stable=True).indices[:k]
        ids = order.numpy().astype(np.int64)
        scaled = row[order].double().numpy() / float(params.temperature)
        keep = len(ids)
        if params.top_p < 1.0:
            probs = np.exp(scaled - scaled[0])
            probs /= probs.sum()
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
        if params.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(scaled >= scaled[0] + math.log(params.min_p))))
        keep = max(keep, 1)
        ids, scaled = ids[:keep], scaled[:keep]
        token = _lowest_id_argmax(scaled + gumbel(params.seed, position, ids), ids)
    if not params.logprobs:
        return Sample(token)
    logp = torch.log_softmax(raw.double(), dim=-1)
    top = None
    if params.top_logprobs > 0:
        n = min(params.top_logprobs, MAX_TOP_LOGPROBS, row.numel())
        order = torch.sort(-logp, stable=True).indices[:n]
        top = [(int(i), float(logp[i])) for i in order]
    return Sample(token, float(logp[token]), top)
