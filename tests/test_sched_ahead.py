"""A round's host side prepared while the round before runs (issue 25: ModelRunner._prepare_next,
Model.prepare_ahead): the runner, told the plan queued behind the running round, builds that round's table before
the running round's draws are read. The replies are the same bits as rounds prepared when they start; a table built
ahead and never used changes no state; a plan whose sequences change in between is not prepared ahead. A plain
decode round is launched ahead (queued with its ids read from the round before's draws on the device, before they
reach the host): the same bits again, and not where the host needs the tokens first."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.comm.plan import PENDING, Ahead, FreeSeq, NewSeq, SeqRows, StepPlan
from dsv41.model.model import InputError, Model, SeqInput
from dsv41.sched.runner import ModelRunner, encode_params
from dsv41.sched.sampler import SamplingParams
from dsv41.sched.tp import DigestingModel


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def model(shared, request):
    """The host op set, and on a GPU the CUDA path (the draws' copy and event, the pinned table sent late)."""
    return Model.load(shared / "vectors/model/tiny-a/checkpoint", device=request.param)


def _without_engram(src: Path, out: Path) -> Path:
    """tiny-a without its Engram layers (as make_real writes a checkpoint): the config lists none and the shards
    drop their tensors. Its rows' Engram reads would otherwise hash the ids on the host (no launch ahead)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    t["engram_layer_ids"], t["engram_num_embeddings"] = [], []
    (out / "config.json").write_text(json.dumps(cfg))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".engram." not in k}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in sorted(src.glob("*.safetensors")):
        kept = {k: v for k, v in load_file(str(f)).items() if ".engram." not in k}
        save_file(kept, str(out / f.name), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, out / f)
    return out


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def plain_model(shared, request, tmp_path_factory):
    """A model without Engram layers: its plain decode rounds may be launched ahead."""
    ck = _without_engram(shared / "vectors/model/tiny-a/checkpoint", tmp_path_factory.mktemp("no-engram"))
    return Model.load(ck, device=request.param)


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _params(i, adjust=False):
    if adjust:                   # a repetition penalty: the draw reads the reply's tokens on the host
        return SamplingParams(temperature=0.9, seed=5 + i, repetition_penalty=1.3)
    return (SamplingParams(temperature=0.0) if i % 2 == 0 else
            SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, logprobs=True, top_logprobs=2))


def decode(model, prompts, rounds, *, tell, skip_one=False, launch=False, reverse=False, adjust=(),
           matchers=None):
    """Open the sequences, fill their prompts, then `rounds` decode rounds of one PENDING row each, each plan made
    before the round before it has run (as the overlapped scheduler makes them). tell: hand each plan to the runner
    as the one queued behind the running round. skip_one: drop the table built for round 3 (it runs as usual).
    launch: the runner may launch rounds ahead. reverse: every other round lists its rows in reverse order.
    adjust: the sequences whose params adjust the logits by the reply. matchers: passed to every execute."""
    runner = ModelRunner(model)
    runner.launch_ahead = launch
    seqs = list(range(1, len(prompts) + 1))
    ops = [NewSeq(s, encode_params(_params(i, s in adjust))) for i, s in enumerate(seqs)]
    res = runner.execute(StepPlan(0, ops=ops, rows=[SeqRows(s, 0, p, [len(p) - 1]) for s, p in zip(seqs, prompts)]))
    last = {s: smp.token_id for s, smp in res.samples}
    out = {s: [t] for s, t in last.items()}
    lengths = {s: len(p) for s, p in zip(seqs, prompts)}

    def plan(k):
        order = seqs[::-1] if reverse and k % 2 else seqs
        return StepPlan(k, rows=[SeqRows(s, lengths[s] + k - 1, [PENDING], [0]) for s in order])
    plans = [plan(k) for k in range(1, rounds + 1)]
    for k, p in enumerate(plans):
        if tell and k + 1 < len(plans):
            runner.upcoming(plans[k + 1])
        if skip_one and k == 2:
            assert runner._ahead is not None and runner._ahead[0] == p.round
            assert runner._take_ahead(None) is None      # taken back: the round builds its own table
        for r in p.rows:                         # the round thread resolves PENDING just before the round
            r.ids = [last[r.seq]]
        res = runner.execute(p, matchers)
        for s, smp in res.samples:
            last[s] = smp.token_id
            out[s].append((smp.token_id, smp.logprob, smp.top))
    return out, runner


def test_rounds_prepared_ahead_equal_rounds_prepared_when_they_start(model):
    prompts = _prompts(5, model.t.vocab_size, seed=1)
    plain, r0 = decode(model, prompts, 7, tell=False)
    ahead, r1 = decode(model, prompts, 7, tell=True)
    assert r0.rounds_ahead == 0
    assert r1.rounds_ahead == 6                  # every round after the first decode round
    assert ahead == plain


def test_a_table_built_ahead_and_never_used_changes_nothing(model):
    prompts = _prompts(3, model.t.vocab_size, seed=2)
    plain, _ = decode(model, prompts, 6, tell=False)
    skipped, runner = decode(model, prompts, 6, tell=True, skip_one=True)
    assert runner.rounds_ahead == 4              # rounds 2, 4, 5 and 6: round 3's table was built, then taken back
    assert skipped == plain


def test_rounds_launched_ahead_equal_rounds_run_when_they_start(plain_model):
    """Each round queued with its ids read from the round before's draws on the device (before they reach the
    host) gives the bits of rounds run one after the other: greedy and sampled rows with logprobs, rows in the
    draws' order and in another (their ids gathered)."""
    model = plain_model
    prompts = _prompts(5, model.t.vocab_size, seed=6)
    plain, _ = decode(model, prompts, 7, tell=False)
    for reverse in (False, True):
        launched, runner = decode(model, prompts, 7, tell=True, launch=True, reverse=reverse)
        assert (runner.rounds_launched, runner.rounds_ahead) == (6, 0)
        assert launched == plain


def test_rows_the_host_must_see_first_are_not_launched_ahead(plain_model, model):
    """A round with a row whose params adjust its logits by the reply (penalties), or whose sequence is
    constrained (its mask needs the matcher to consume the token first), or a model with Engram layers (their
    rows are read by hashes of the ids on the host), is prepared ahead but not launched."""
    _, runner = decode(model, _prompts(2, model.t.vocab_size, seed=8), 3, tell=True, launch=True)
    assert (runner.rounds_launched, runner.rounds_ahead) == (0, 2)
    model = plain_model
    prompts = _prompts(3, model.t.vocab_size, seed=7)
    plain, _ = decode(model, prompts, 5, tell=False, adjust={2})
    launched, runner = decode(model, prompts, 5, tell=True, launch=True, adjust={2})
    assert (runner.rounds_launched, runner.rounds_ahead) == (0, 4)
    assert launched == plain
    # a matcher entry for sequence 3 (never consulted past the check: its rows' masks would be filled by it)
    _, runner = decode(model, prompts, 2, tell=True, launch=True, matchers={3: None})
    assert (runner.rounds_launched, runner.rounds_ahead) == (0, 1)


def test_a_plan_that_changes_its_sequences_first_is_not_prepared_ahead(model):
    runner = ModelRunner(model)
    runner.launch_ahead = False
    p = _prompts(2, model.t.vocab_size, seed=3)
    runner.execute(StepPlan(0, ops=[NewSeq(1, encode_params(_params(0))), NewSeq(2, encode_params(_params(0)))],
                            rows=[SeqRows(1, 0, p[0], [len(p[0]) - 1]), SeqRows(2, 0, p[1], [len(p[1]) - 1])]))
    n0, n1 = len(p[0]), len(p[1])

    def step(k, nxt):
        runner.upcoming(nxt)
        runner.execute(StepPlan(k, rows=[SeqRows(1, n0 + k - 1, [5], [0]), SeqRows(2, n1 + k - 1, [6], [0])]))
        return runner._ahead
    # its own sequence freed first: a table built now would be stale
    assert step(1, StepPlan(2, ops=[FreeSeq(2)], rows=[SeqRows(2, n1 + 1, [PENDING], [0])])) is None
    # a row that does not start where its state will end (a rollback or a resumed state in between)
    assert step(2, StepPlan(3, rows=[SeqRows(1, n0 + 5, [PENDING], [0])])) is None
    # a prompt row, not a PENDING decode row
    assert step(3, StepPlan(4, rows=[SeqRows(1, n0 + 3, [7], [0])])) is None
    # another sequence freed: prepared
    got = step(4, StepPlan(5, ops=[FreeSeq(2)], rows=[SeqRows(1, n0 + 4, [PENDING], [0])]))
    assert got is not None and got[0] == 5


def test_forward_refuses_a_table_prepared_for_other_rows(model):
    st = [model.new_state() for _ in range(2)]
    model.forward([SeqInput(s, torch.tensor([4, 5, 6 + i]), logits="none") for i, s in enumerate(st)])
    rd = model.prepare_ahead(st, 1)
    with pytest.raises(InputError):
        model.forward([SeqInput(st[0], torch.tensor([7]))], ahead=rd)
    lengths = [s.length for s in st]
    assert lengths == [3, 3]
    # the refused table changed no state: the round prepared as usual equals a fresh pair's
    fresh = [model.new_state() for _ in range(2)]
    model.forward([SeqInput(s, torch.tensor([4, 5, 6 + i]), logits="none") for i, s in enumerate(fresh)])
    a = model.forward([SeqInput(s, torch.tensor([7])) for s in st])
    b = model.forward([SeqInput(s, torch.tensor([7])) for s in fresh])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_follower_prepares_the_rounds_rank0_tells_it(model):
    """A follower (TP rank >= 1) builds the table of the round rank 0 told it about (Ahead, from its channel's
    poll_ahead) while its own round runs; its logits are the same bits as a follower's that is told nothing."""
    prompts = _prompts(4, model.t.vocab_size, seed=4)
    rounds = 6
    ref, _ = decode(model, prompts, rounds, tell=False)         # rank 0's draws: the ids of each round
    seqs = list(range(1, len(prompts) + 1))
    lengths = {s: len(p) for s, p in zip(seqs, prompts)}

    def drawn(s, k):                      # the token rank 0 drew in round k (0: the prompt's)
        return ref[s][0] if k == 0 else ref[s][k][0]

    def follow(told: bool):
        dm = DigestingModel(model)
        runner = ModelRunner(dm, follower=True)
        hints: list = []
        runner.poll_ahead = lambda: hints.pop() if hints else None
        ops = [NewSeq(s, encode_params(_params(i))) for i, s in enumerate(seqs)]
        runner.execute(StepPlan(0, ops=ops, rows=[SeqRows(s, 0, p, [len(p) - 1]) for s, p in zip(seqs, prompts)]))
        digests = [dm.take_digest()]
        for k in range(1, rounds + 1):
            if told and k < rounds:       # rank 0's hint for round k + 1 arrives while round k runs
                hints.append(Ahead(k + 1, [(s, lengths[s] + k) for s in seqs]).plan())
            runner.execute(StepPlan(k, rows=[SeqRows(s, lengths[s] + k - 1, [drawn(s, k - 1)], [0]) for s in seqs]))
            digests.append(dm.take_digest())
        return digests, runner.rounds_ahead

    plain, n_plain = follow(False)
    told, n_told = follow(True)
    assert (n_plain, n_told) == (0, rounds - 1)
    assert told == plain


def test_the_served_scheduler_launches_plain_rounds_ahead_with_the_same_replies(plain_model, shared):
    """Through the real Scheduler (overlapped rounds, admissions, stops at max_tokens mid-run): replies with rounds
    launched ahead == replies without, token for token with logprobs; some rounds were launched."""
    import asyncio

    from dsv41.sched.memory import MemoryBudget, state_cost
    from dsv41.sched.request import Request, TokenEvent
    from dsv41.sched.scheduler import Scheduler
    model = plain_model
    prompts = _prompts(6, model.t.vocab_size, seed=9)
    cfg = json.loads((shared / "vectors/model/tiny-a/checkpoint/config.json").read_text())
    cost = state_cost(cfg.get("text_config", cfg))      # (a bound: tiny-a's Engram history too)

    def serve(launch: bool):
        async def go():
            runner = ModelRunner(model)
            runner.launch_ahead = launch
            sched = Scheduler(runner, MemoryBudget(1 << 40, cost), max_streams=4, prefill_chunk=64)
            sched.start()
            reqs = [Request(p, _params(i), max_tokens=6 + 3 * i, ignore_eos=True) for i, p in enumerate(prompts)]
            for r in reqs:
                sched.submit(r)

            async def reply(r):
                return [(e.token_id, e.sample.logprob, e.sample.top) for e in [ev async for ev in sched.stream(r)]
                        if isinstance(e, TokenEvent)]
            got = await asyncio.gather(*[reply(r) for r in reqs])
            await sched.stop()
            return got, runner.rounds_launched
        return asyncio.run(asyncio.wait_for(go(), 120))

    plain, n0 = serve(False)
    launched, n1 = serve(True)
    assert n0 == 0 and n1 > 0
    assert launched == plain
