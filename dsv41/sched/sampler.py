"""Sampling that does not depend on the batch: a pure function of (seed, absolute position, logits row, params).

Keyed Gumbel-max (serving.md §3.6): every candidate token gets a Gumbel draw from u = hash(seed, position, token id),
so the same row sampled alone, in a batch of 32, or as a draft-verify row picks the same token.

Order of the steps (T > 0):
1. candidates = the vocabulary sorted by (logit descending, id ascending), cut to top-k; top-k is clamped to
   CANDIDATE_WIDTH (0 = off = CANDIDATE_WIDTH), so at most 1024 candidates are ever read;
2. softmax of logit / T over the candidates;
3. top-p: keep the shortest prefix whose mass reaches p (searchsorted(cumsum, p) + 1);
4. min-p: keep the prefix within ln(min_p) of the top (after temperature);
5. pick argmax(logit / T + Gumbel(u)); ties go to the lower id.
T <= 0 is greedy: argmax of the raw row, ties to the lower id.

logprobs are of the model's raw distribution (log_softmax of the row, before temperature or truncation), as vLLM
reports them.

Before step 1 (and before greedy's argmax) a request's logit bias and penalties change the row (adjust_row, vLLM's
order: bias, then repetition, frequency and presence penalties over the reply so far); logprobs stay the raw row's.
"""
from __future__ import annotations

import hashlib
import math
import secrets

import msgspec
import numpy as np
import torch

CANDIDATE_WIDTH = 1024    # the most candidates the sampler reads; top_k is clamped to it (documented in docs/server.md)
MAX_TOP_LOGPROBS = 20

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What the sampler needs for one sequence; plain data so a plan can carry it to another rank."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    # OpenAI / vLLM logits processing, applied to the row before the draw (see adjust_row)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_len: int = 0                  # the reply's first position: tokens from here on are the reply's
    prompt_tokens: tuple[int, ...] = ()  # the prompt's distinct ids (sent only when repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts(self) -> bool:
        """Whether the row is changed before the draw (penalties or a logit bias)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


class Sample(msgspec.Struct, array_like=True, gc=False):
    """One drawn token; logprob fields are filled only when the request asked for them."""
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None     # (id, logprob), best first, ties to the lower id


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (x + _GOLDEN) & _M64
        z = ((z ^ (z >> np.uint64(30))) * _C1) & _M64
        z = ((z ^ (z >> np.uint64(27))) * _C2) & _M64
        return z ^ (z >> np.uint64(31))


def uniform_keys(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """u in (0, 1) for each token id: splitmix64(splitmix64(splitmix64(seed) ^ position) ^ id), top 53 bits."""
    s = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    p = _splitmix64(s ^ np.uint64(position & 0xFFFFFFFFFFFFFFFF))
    h = _splitmix64(p ^ token_ids.astype(np.uint64))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def gumbel(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    u = uniform_keys(seed, position, token_ids)
    return -np.log(-np.log(u))


def prompt_seed(prompt_ids: list[int], salt: str = "0") -> int:
    """The default seed of a request: sha256 of the comma-joined prompt ids + '|salt', first 8 bytes LE, 63 bits."""
    digest = hashlib.sha256((",".join(map(str, prompt_ids)) + "|" + salt).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_seed() -> int:
    return secrets.randbits(63)


def clamp_top_k(top_k: int) -> int:
    """0 or negative (off) and anything above the candidate width become the candidate width."""
    return CANDIDATE_WIDTH if top_k <= 0 else min(top_k, CANDIDATE_WIDTH)


def _lowest_id_argmax(values: np.ndarray, ids: np.ndarray) -> int:
    best = values.max()
    return int(ids[values == best].min())


def adjust_row(row: torch.Tensor, params: SamplingParams, reply: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The row the draw reads, as vLLM processes it: the logit bias added, then the penalties over `reply`, the
    reply's tokens so far (each once per occurrence): repetition (vLLM / HF: a logit > 0 of a token seen in the
    prompt or the reply divided by it, one <= 0 multiplied), frequency (minus penalty x count) and presence (minus
    penalty once). float32 on the host, one row at a time: the same whatever the batch. `row` is not changed."""
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


def sample_row(logits: torch.Tensor, position: int, params: SamplingParams, reply=()) -> Sample:
    """Draw the token at absolute `position` from one logits row [vocab]. Pure: same inputs, same token. `reply`:
    the reply's tokens before `position` (penalties; see adjust_row). logprobs are of the row as given."""
    raw = logits.detach().to("cpu", torch.float32).reshape(-1)
    row = adjust_row(raw, params, reply) if params.adjusts else raw
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
