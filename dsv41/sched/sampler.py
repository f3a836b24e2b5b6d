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

from dsv41.model.device import host_to_device

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



# ---------------------------------------------------------------------------------------------------------------
# The draw, over all rows of a round at once, on the device the logits are on. One definition: sample_row is this on
# one row. Every step is either exact (sorts, selections, integer hashing, counts) or an elementwise float op whose
# result for an element does not depend on its neighbours, or a reduction written as a fixed sequence of elementwise
# ops (the top-p mass), so a row's pick never depends on the other rows of the batch.

_I64_MASK = {s: (1 << (64 - s)) - 1 for s in (11, 27, 30, 31)}


def _on(dev: torch.device, data, dtype: torch.dtype) -> torch.Tensor:
    """Host data (a list, a numpy array) as a tensor on dev without waiting (device.host_to_device):
    torch.tensor(data, device=cuda) copies from pageable memory and then waits for the stream, that is for the
    whole forward queued before the draw, and the draw made a dozen such copies (its parameters, row indices and
    Gumbel keys), each a round trip between the host and an idle GPU. The values are the same either way."""
    return host_to_device(torch.as_tensor(data, dtype=dtype), dev)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN_S, _C1_S, _C2_S = _signed(int(_GOLDEN)), _signed(int(_C1)), _signed(int(_C2))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & _I64_MASK[s]


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """_splitmix64 on int64 tensors holding uint64 bit patterns: add and multiply wrap mod 2^64 as in numpy."""
    z = x + _GOLDEN_S
    z = (z ^ _shr(z, 30)) * _C1_S
    z = (z ^ _shr(z, 27)) * _C2_S
    return z ^ _shr(z, 31)


def _row_keys(params: list[SamplingParams], positions: list[int]) -> np.ndarray:
    """splitmix64(splitmix64(seed) ^ position) per row, as int64 bit patterns (the last level mixes in the id)."""
    seeds = np.array([p.seed & 0xFFFFFFFFFFFFFFFF for p in params], dtype=np.uint64)
    pos = np.array([q & 0xFFFFFFFFFFFFFFFF for q in positions], dtype=np.uint64)
    return _splitmix64(_splitmix64(seeds) ^ pos).view(np.int64)


def _log(t: torch.Tensor) -> torch.Tensor:
    # On the host numpy's log, as the sampler always used: torch's CPU log differs from it in the last bit for ~0.4 %
    # of inputs and picks its vector body or scalar tail by where an element sits in the buffer. On a GPU torch's:
    # one device function for every element.
    if t.device.type == "cpu":
        return torch.from_numpy(np.log(t.contiguous().numpy()))
    return torch.log(t)


def _exp(t: torch.Tensor) -> torch.Tensor:
    # as _log (torch's CPU exp differs from numpy's for ~4.5 % of inputs)
    if t.device.type == "cpu":
        return torch.from_numpy(np.exp(t.contiguous().numpy()))
    return torch.exp(t)


def _gumbel_t(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-log(-log(u)) for candidate ids [M, K] under row keys [M]: u as uniform_keys computes it."""
    h = _splitmix64_t(keys[:, None] ^ ids)
    u = (_shr(h, 11).double() + 0.5) / float(1 << 53)
    return -_log(-_log(u))


def _pairwise_sum(a: torch.Tensor) -> torch.Tensor:
    """Sum of each row of a float64 [M, n], in numpy's pairwise order (np.sum's): blocks of <= 128 summed with 8
    accumulators, halves split at multiples of 8. Elementwise ops only: the same sums on any device, any row count."""
    n = a.shape[1]
    if n < 8:
        res = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
        for i in range(n):
            res = res + a[:, i]
        return res
    if n <= 128:
        r = a[:, :8]
        m = n - n % 8
        for i in range(8, m, 8):
            r = r + a[:, i:i + 8]
        res = ((r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])) + ((r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7]))
        for i in range(m, n):
            res = res + a[:, i]
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise_sum(a[:, :n2]) + _pairwise_sum(a[:, n2:])


def _cumsum(a: torch.Tensor, by_columns: bool | None = None) -> torch.Tensor:
    """Prefix sums of each row of float64 a [M, k] in sequential order (numpy's cumsum, torch's on the host). Off the
    host one add per column (k launches; the default top-k is 20): torch's CUDA scan adds in a tree, which can put
    a prefix sum of tied candidates (0.05 ten times: 0.49999999999999994 in order, 0.5 in a tree) on the other
    side of top_p, and scans one row with CUB and several with its own kernel. by_columns: default off the host."""
    if not (by_columns if by_columns is not None else a.device.type != "cpu"):
        return torch.cumsum(a, dim=1)
    out = torch.empty_like(a)
    out[:, 0] = a[:, 0]
    for j in range(1, a.shape[1]):
        torch.add(out[:, j - 1], a[:, j], out=out[:, j])
    return out


def _keys(x: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 keys ordering (value descending, id ascending) as keys descending: the float's order-preserving bits
    above the id reversed, so no two keys of a row are equal."""
    b = x.view(torch.int32)
    sign = b >> 31                                    # 0 or -1
    b = ((b & 0x7FFFFFFF) ^ sign) - sign              # sign-magnitude to two's complement: -0.0 and +0.0 both 0
    return (b.long() << 32) | ((vocab - 1) - ids)


def _ordered_top(x: torch.Tensor, k: int, all_keys: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of each row of float32 x [M, V] sorted by (value descending, id ascending): (ids, values), the
    stable sort's answer without sorting the whole vocabulary. On a GPU: topk over every element's _keys (all
    distinct, so topk has one answer). On the host, where those keys cost more than the rest of the draw: topk of
    the values, whose set is the answer unless equal values straddle the k-th (then the keys for those rows only),
    put in order by the keys of the k. all_keys: the GPU's way (default: off the host)."""
    vocab = x.shape[1]
    if all_keys if all_keys is not None else x.device.type != "cpu":
        ids = torch.arange(vocab, dtype=torch.int64, device=x.device)
        top = torch.topk(_keys(x, ids, vocab), k, dim=1, sorted=True).values
        cand = (vocab - 1) - (top & 0xFFFFFFFF)
        return cand, torch.gather(x, 1, cand)
    vals, cand = torch.topk(x, k, dim=1, sorted=False)
    kth = vals.min(dim=1, keepdim=True).values
    straddle = ((x >= kth).sum(dim=1) > k).nonzero().flatten().tolist()   # ties at the k-th reach past the cut
    if straddle:
        ids = torch.arange(vocab, dtype=torch.int64)
        top = torch.topk(_keys(x[straddle], ids, vocab), k, dim=1).values
        cand[straddle] = (vocab - 1) - (top & 0xFFFFFFFF)
        vals[straddle] = torch.gather(x[straddle], 1, cand[straddle])
    order = torch.sort(_keys(vals.contiguous(), cand, vocab), dim=1, descending=True).indices
    cand = torch.gather(cand, 1, order)
    return cand, torch.gather(x, 1, cand)


def _adjust(rows: torch.Tensor, params: list[SamplingParams], replies: list) -> torch.Tensor:
    """adjust_row over rows [M, V] (each with its params and reply so far), float32 on the rows' device. The same
    elementwise float32 ops as one row at a time (the bias added, then x / rp or x * rp, then - f * count - p)."""
    dev = rows.device
    m, vocab = rows.shape
    out = rows.float().clone()
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        ri = _on(dev, [i for i, _, _ in bias], torch.long)
        ti = _on(dev, [t for _, t, _ in bias], torch.long)
        out[ri, ti] = out[ri, ti] + _on(dev, [b for _, _, b in bias], torch.float32)
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        ri, ti = [], []
        for i in rep_rows:
            toks = list(params[i].prompt_tokens) + list(replies[i])
            ri += [i] * len(toks)
            ti += toks
        seen = torch.zeros(m, vocab, dtype=torch.bool, device=dev)
        seen[_on(dev, ri, torch.long), _on(dev, ti, torch.long)] = True
        rp = _on(dev, [[p.repetition_penalty] for p in params], torch.float32)
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    cnt_rows = [i for i, p in enumerate(params) if replies[i] and (p.frequency_penalty or p.presence_penalty)]
    if cnt_rows:
        ri = [i for i in cnt_rows for _ in replies[i]]
        ti = [t for i in cnt_rows for t in replies[i]]
        counts = torch.zeros(m, vocab, dtype=torch.float32, device=dev)
        counts.index_put_((_on(dev, ri, torch.long), _on(dev, ti, torch.long)),
                          torch.ones(len(ti), dtype=torch.float32, device=dev), accumulate=True)
        sel = _on(dev, cnt_rows, torch.long)
        c = counts[sel]
        fp = _on(dev, [[params[i].frequency_penalty] for i in cnt_rows], torch.float32)
        pp = _on(dev, [[params[i].presence_penalty] for i in cnt_rows], torch.float32)
        out[sel] = out[sel] - (fp * c + pp * (c > 0).float())
    return out


def adjust_row(row: torch.Tensor, params: SamplingParams, reply: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The row the draw reads, as vLLM processes it: the logit bias added, then the penalties over `reply`, the
    reply's tokens so far (each once per occurrence): repetition (vLLM / HF: a logit > 0 of a token seen in the
    prompt or the reply divided by it, one <= 0 multiplied), frequency (minus penalty x count) and presence (minus
    penalty once). float32, elementwise: the same whatever the batch. `row` is not changed."""
    return _adjust(row.reshape(1, -1), [params], [tuple(reply)])[0]


def sample_rows(logits: torch.Tensor, positions: list[int], params: list[SamplingParams], replies=None,
                bitmask: torch.Tensor | None = None) -> list[Sample]:
    """draw_rows(...).fetch(): the draws, on the host."""
    return draw_rows(logits, positions, params, replies, bitmask).fetch()


def draw_rows(logits: torch.Tensor, positions: list[int], params: list[SamplingParams], replies=None,
              bitmask: torch.Tensor | None = None) -> Drawn:
    """Draw one token per row of logits [N, V], on the logits' device: row i at absolute position positions[i] with
    params[i]; replies[i]: the reply's tokens before that position (penalties; see adjust_row). bitmask: int32
    [N, ceil(V/32)] on the host (grammar masks, llguidance's packing; all-ones rows allow every token), applied on
    the device before anything else: logprobs are then those of the masked row, as the masked row is what is
    sampled. Only the token ids and the logprobs asked for come to the host (one transfer).

    Row i's pick is sample_row(logits[i], ...)'s whatever the other rows are: nothing reduces across rows."""
    n = len(params)
    if n == 0:
        return Drawn(None, None, [], [], params)
    raw = logits.detach().reshape(n, -1)
    raw = raw.float() if raw.dtype != torch.float32 else raw
    dev = raw.device
    if bitmask is not None:
        from dsv41.grammar.matchers import apply_mask
        raw = raw.clone()
        apply_mask(raw, bitmask)
    replies = list(replies) if replies is not None else [()] * n
    adj = [i for i, p in enumerate(params) if p.adjusts]
    row = raw
    if adj:
        row = raw.clone()
        sel = _on(dev, adj, torch.long)
        row[sel] = _adjust(raw[sel], [params[i] for i in adj], [tuple(replies[i]) for i in adj])
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:                                  # the first maximal index: ties to the lower id
        token = torch.argmax(row, dim=1)
    elif not greedy:
        token = _draw(row, positions, params)
    else:
        token = torch.empty(n, dtype=torch.long, device=dev)
        g = _on(dev, greedy, torch.long)
        token[g] = torch.argmax(row[g], dim=1)
        d = _on(dev, drawn, torch.long)
        token[d] = _draw(row[d], [positions[i] for i in drawn], [params[i] for i in drawn])
    return _fetch(raw, token, params)


def _draw(x: torch.Tensor, positions: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """Keyed Gumbel-max over rows [M, V] (T > 0), the steps of the module docstring; token ids [M]."""
    dev = x.device
    m, vocab = x.shape
    ks = [min(clamp_top_k(p.top_k), vocab) for p in params]
    width = max(ks)
    ids, vals = _ordered_top(x, width)
    temp = _on(dev, [[float(p.temperature)] for p in params], torch.float64)
    scaled = vals.double() / temp
    col = torch.arange(width, device=dev)
    keep = _on(dev, ks, torch.long)
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    for k in sorted({ks[i] for i in top_p}):        # the mass is summed in numpy's order for k terms
        rows = [i for i in top_p if ks[i] == k]
        sel = _on(dev, rows, torch.long)
        s = scaled[sel, :k]
        probs = _exp(s - s[:, :1]).to(dev)
        probs = probs / _pairwise_sum(probs)[:, None]
        cut = _on(dev, [[params[i].top_p] for i in rows], torch.float64)
        # searchsorted(cumsum, p): the number of prefix sums below p
        keep[sel] = torch.minimum(keep[sel], (_cumsum(probs) < cut).sum(dim=1) + 1)
    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        sel = _on(dev, min_p, torch.long)
        s = scaled[sel]
        floor = s[:, :1] + _on(dev, [[math.log(params[i].min_p)] for i in min_p], torch.float64)
        within = (s >= floor) & (col < _on(dev, [[ks[i]] for i in min_p], torch.long))
        keep[sel] = torch.minimum(keep[sel], within.sum(dim=1))
    keep = keep.clamp(min=1)
    keys = _on(dev, _row_keys(params, positions), torch.int64)
    value = scaled + _gumbel_t(keys, ids).to(dev)
    kept = col < keep[:, None]
    best = torch.where(kept, value, float("-inf")).max(dim=1, keepdim=True).values
    tie = kept & (value == best)
    return torch.where(tie, ids, vocab).min(dim=1).values


class Drawn:
    """A round's draws queued on the device, their copy to the host started (pinned, non-blocking): the runner
    prepares the next round's host side while the GPU still runs this one (done() says whether it has finished),
    then fetch() waits for the copy and reads the tokens and logprobs."""

    def __init__(self, flat: torch.Tensor | None, event, lp: list[int], tops: list[int], params: list[SamplingParams],
                 token: torch.Tensor | None = None):
        self._flat, self._event, self._lp, self._tops, self._params = flat, event, lp, tops, params
        self.token = token      # the drawn ids on the logits' device [rows] (the next round may read them there)

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def fetch(self) -> list[Sample]:
        if self._flat is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        host = self._flat.tolist()
        lp, tops, params, n = self._lp, self._tops, self._params, len(self._params)
        if not lp:
            return [Sample(t) for t in host]
        width = max(tops)
        tokens = [int(t) for t in host[:n]]
        chosen = host[n:n + len(lp)]
        out = [Sample(t) for t in tokens]
        at = n + len(lp)
        for j, (i, k) in enumerate(zip(lp, tops)):
            top = None
            if params[i].top_logprobs > 0:
                a = j * width
                top = [(int(host[at + a + q]), host[at + len(lp) * width + a + q]) for q in range(k)]
            out[i] = Sample(tokens[i], chosen[j], top)
        return out


def _fetch(raw: torch.Tensor, token: torch.Tensor, params: list[SamplingParams]) -> Drawn:
    """The tokens, and the logprobs asked for (of the raw row: log_softmax in float64), in one copy to the host."""
    dev = raw.device
    lp = [i for i, p in enumerate(params) if p.logprobs]
    tops: list[int] = []
    if not lp:
        flat = token
    else:
        vocab = raw.shape[1]
        sel = _on(dev, lp, torch.long)
        logp = torch.log_softmax(raw[sel].double(), dim=-1)
        parts = [token.double(), logp.gather(1, token[sel][:, None])[:, 0]]
        tops = [min(params[i].top_logprobs, MAX_TOP_LOGPROBS, vocab) for i in lp]
        width = max(tops)
        if width > 0:
            order = torch.sort(-logp, dim=1, stable=True).indices[:, :width]
            parts += [order.double().reshape(-1), logp.gather(1, order).reshape(-1)]
        flat = torch.cat(parts)
    if dev.type != "cuda":
        return Drawn(flat, None, lp, tops, params, token)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return Drawn(host, event, lp, tops, params, token)


def sample_row(logits: torch.Tensor, position: int, params: SamplingParams, reply=()) -> Sample:
    """Draw the token at absolute `position` from one logits row [vocab]. Pure: same inputs, same token. `reply`:
    the reply's tokens before `position` (penalties; see adjust_row). logprobs are of the row as given."""
    return sample_rows(logits.reshape(1, -1), [position], [params], [tuple(reply)])[0]
