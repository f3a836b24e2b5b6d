"""ModelRunner: turns a StepPlan (dsv41.comm.plan) into one batched Model.forward call and samples the rows whose
logits the plan asks for.

The runner is the only caller of Model.forward. It owns the sequence table (seq id -> SeqState, SamplingParams) and
applies the plan's state ops before the forward. It runs in a worker thread (the scheduler's executor), never on the
event loop. The grammar masks of the round are filled on the host in a second thread while the forward runs; the
logits stay on the model's device, where every wanted row of the round is drawn at once (sampler.sample_rows, the
masks applied there), and only the token ids and the logprobs asked for come back. A follower rank runs the same code
on the plans it receives but draws nothing: only rank 0's draws count, and its decisions reach the followers.

Speculative decoding (docs/drafts.md): a decode row may carry draft tokens, `[pending, d1..dn]` with the logits of
every row wanted. The runner marks the state, runs the rows with the rest of the round, draws each row's token with
the sampler exactly as serial decoding would at that position (grammar masks per row from `fill_draft_masks`),
accepts drafts while the draw equals the draft, rolls the state back past the first rejected row, and (row `draft`
> 0) lets the DSpark head propose the next draft from the last accepted position. On several ranks rank 0's
decisions (accepted count, bonus token) are summed into every rank (followers add zeros), so every rank rolls back
and drafts alike even where only rank 0 has the grammar masks.

Ahead of the device (issue 25): told the plan queued behind the running round (upcoming), the runner builds its
table while the round runs (_prepare_next), and where nothing on the host needs the running round's tokens first
it queues that next round too, its ids read on the device from the running round's draws (_launch): the device
goes from one round to the next without waiting for the host. Either way every row computes what it would have.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from dsv41.comm.plan import PENDING, DropState, FreeSeq, NewSeq, RestoreState, Rollback, SaveState, StepPlan
from dsv41.sched.host import name_os_thread
from dsv41.sched.kept import KeptStates
from dsv41.sched.sampler import Drawn, Sample, SamplingParams, draw_rows

_params_decoder = msgspec.msgpack.Decoder(SamplingParams)
_POLL_S = 0.0002   # how often _prepare_next looks at the device while it waits for the next plan


def encode_params(p: SamplingParams) -> bytes:
    """SamplingParams as the opaque bytes NewSeq carries."""
    return msgspec.msgpack.encode(p)


class PlanError(RuntimeError):
    """The plan does not match the runner's sequence table (a scheduler bug, or ranks out of step)."""


class RoundResult(msgspec.Struct, array_like=True, gc=False):
    round: int
    samples: list[tuple[int, Sample]]      # (seq, drawn token), in plan row order; a verify row gives its accepted
                                           # draft tokens then the bonus token, in order
    seconds: float                         # wall time of the forward + sampling
    grammar_errors: dict[int, str] = {}    # seq -> why its grammar matcher refused the drawn token
    accepted: dict[int, int] = {}          # seq -> draft tokens accepted (verify rows only)
    drafts: dict[int, tuple[list[int], list[float]]] = {}   # seq -> next draft tokens and their confidence logits
    draft_seconds: float = 0.0             # of `seconds`, the DSpark proposals


def _queued_work_done(device):
    """A check of whether what `device`'s stream holds now has run (an event recorded behind it); None on the host,
    where a forward has finished when it returns."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return ev.query


class ModelRunner:
    def __init__(self, model, seq_input_cls=None, follower: bool = False):
        self.model = model
        self.follower = follower                  # a rank >= 1: takes rank 0's draft decisions
        if seq_input_cls is None:
            from dsv41.model.model import SeqInput as seq_input_cls  # noqa: N813
        self.SeqInput = seq_input_cls
        self.states: dict[int, object] = {}
        self.params: dict[int, SamplingParams] = {}
        self.replies: dict[int, list[int]] = {}   # seq -> its reply's tokens fed so far (only when params adjust)
        self.grammar_seconds = 0.0                # computing grammar masks (/metrics dsv41:grammar_seconds_total)
        self.kept = KeptStates()                  # kept prompt states (snapshots), key -> SeqState
        layout = getattr(model, "layout", None)
        self.ratios = {r.index: r.ratio for r in layout.layers if r.owns_compressor} if layout else {}
        self.vocab = int(getattr(getattr(model, "t", None), "vocab_size", 0) or 0)
        self._masker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-masks",
                                          initializer=name_os_thread)
        self._next: StepPlan | None = None        # the plan queued behind the running round (upcoming)
        self._next_ready = threading.Event()
        self._ahead: tuple[int, object] | None = None   # (round, its table built by _prepare_next)
        self.rounds_ahead = 0                     # rounds whose table was built while the round before ran
        # launch ahead: a plain decode round is queued on the device, its ids read there from the round before's
        # draw, before that round's tokens reach the host (_launch); (plan, its Drawn, draws per wanted row)
        self.launch_ahead = True
        self._launched: tuple[StepPlan, Drawn, list[int]] | None = None
        self.rounds_launched = 0                  # rounds queued that way
        # several ranks: rank 0 tells the followers each plan it prepares ahead (tell_ahead(plan): the channel's
        # send_ahead); a follower learns them from its channel (poll_ahead() -> the plan or None, never waiting)
        self.tell_ahead = None
        self.poll_ahead = None

    def execute(self, plan: StepPlan, matchers: dict | None = None, images: dict | None = None) -> RoundResult:
        """Apply the plan's ops, run its rows in one forward, draw a token for each row whose logits it asks for.

        matchers: seq -> grammar Matcher (dsv41.grammar) for constrained sequences (rank 0 only for now): their
        rows' logits are masked to what the grammar allows before the draw, and the drawn token is consumed.
        images: seq -> PromptImage spans of its prompt (rank 0): rows at span positions take the image rows
        (dsv41/sched/images.py; on several ranks rank 0 sends them to the others)."""
        t0 = time.perf_counter()
        launched, self._launched = self._launched, None
        if launched is not None and launched[0] is not plan:
            raise PlanError(f"round {plan.round}: round {launched[0].round} was launched ahead in its place")
        for op in plan.ops:
            if isinstance(op, FreeSeq):
                self.states.pop(op.seq, None)
                self.params.pop(op.seq, None)
                self.replies.pop(op.seq, None)
            elif isinstance(op, NewSeq):
                if op.seq in self.states:
                    raise PlanError(f"round {plan.round}: sequence {op.seq} opened twice")
                self.states[op.seq] = self.model.new_state()
                self.params[op.seq] = _params_decoder.decode(op.params)
            elif isinstance(op, Rollback):
                st = self.states.get(op.seq)
                if st is None:
                    raise PlanError(f"round {plan.round}: rollback of unknown sequence {op.seq}")
                st.rollback(op.n, self.ratios)
            else:
                self._kept_op(plan, op)
        inputs = []
        for r in plan.rows:
            st = self.states.get(r.seq)
            if st is None:
                raise PlanError(f"round {plan.round}: rows for unknown sequence {r.seq}")
            if launched is not None:     # its forward is queued: the state holds the row already
                if st.length != r.start + len(r.ids):
                    raise PlanError(f"round {plan.round}: sequence {r.seq} does not hold the row launched ahead")
                continue
            if st.length != r.start:
                raise PlanError(f"round {plan.round}: sequence {r.seq} holds {st.length} tokens, plan starts at "
                                f"{r.start}")
            verify = len(r.logits) > 1
            if verify and r.logits != list(range(len(r.ids))):
                raise PlanError(f"round {plan.round}: sequence {r.seq}: a verify row wants every row's logits")
            if r.logits and not verify and r.logits != [len(r.ids) - 1]:
                raise PlanError(f"round {plan.round}: sequence {r.seq}: only the last row's logits are served")
            p = self.params[r.seq]
            if p.adjusts:   # the reply's tokens by position; a row starts where the state ends (past a rollback)
                rep = self.replies.setdefault(r.seq, [])
                del rep[max(0, r.start - p.prompt_len):]
                rep.extend(r.ids[max(0, p.prompt_len - r.start):])
            if verify:
                st.mark(len(r.ids), self.model.t.sliding_window)
            else:
                st.unmark()
            inputs.append(self.SeqInput(state=st, ids=torch.tensor(r.ids, dtype=torch.long),
                                        logits="all" if verify else "last" if r.logits else "none"))
        if inputs and (images or getattr(getattr(self.model, "comm", None), "world", 1) > 1):
            from dsv41.sched.images import attach_image_rows
            attach_image_rows(plan, inputs, images or {}, self.model)
        samples = []
        errors: dict[int, str] = {}
        accepted: dict[int, int] = {}
        drafts: dict[int, tuple[list[int], list[float]]] = {}
        draft_s = 0.0
        lasts: dict[int, int] = {}
        if plan.rows:
            wanted = [r for r in plan.rows if r.logits]
            ms = [matchers.get(r.seq) for r in wanted] if matchers and not self.follower else []
            masking = None
            if any(m is not None for m in ms):
                # the masks depend only on the matchers' states and the plan: filled while the forward runs
                masking = self._masker.submit(self._masks, wanted, ms)
            ahead = self._take_ahead(plan.round)
            with torch.no_grad():
                if launched is not None:
                    outs = []
                elif ahead is not None:
                    outs = self.model.forward(inputs, ahead=ahead)
                    self.rounds_ahead += 1
                else:
                    outs = self.model.forward(inputs)
            bitmask = masking.result() if masking is not None else None
            if self.follower:
                # only rank 0's draws count (its grammar masks exist only there): its decisions arrive in _agree
                decisions = [(0, 0)] * len(wanted)
                self._prepare_next(plan, _queued_work_done(getattr(self.model, "device", None)))
            else:
                decisions = []
                if launched is None:
                    outs = [o for r, o in zip(plan.rows, outs) if r.logits]
                    sizes = [o.shape[0] for o in outs]
                    drawn = self._draw_all(wanted, outs, bitmask)
                else:
                    _, drawn, sizes = launched
                    self.rounds_launched += 1
                self._prepare_next(plan, drawn.done, drawn, wanted, matchers)
                draws, at = [], 0
                got_all = drawn.fetch()
                for size in sizes:
                    draws.append(got_all[at:at + size])
                    at += size
                for k, (r, row_draws) in enumerate(zip(wanted, draws)):
                    got = self._accept(r, row_draws, ms[k] if ms else None, errors)
                    samples += [(r.seq, s) for s in got]
                    # (accepted drafts, the token to draft after; -1: none, the grammar ended the reply)
                    decisions.append((max(len(got) - 1, 0), -1 if r.seq in errors else got[-1].token_id))
            decisions = self._agree(decisions)
            lasts = {r.seq: last for r, (_, last) in zip(wanted, decisions) if last >= 0}
            ahead = []
            for r, (a, last) in zip(wanted, decisions):
                st = self.states[r.seq]
                if len(r.logits) > 1:
                    accepted[r.seq] = a
                    back = len(r.ids) - 1 - a
                    if back:
                        st.rollback(back, self.ratios)
                if r.draft and last >= 0:
                    ahead.append((r.seq, st, last))
            if ahead:
                t1 = time.perf_counter()
                with torch.no_grad():
                    got = self.model.dspark.draft([(st, tok) for _, st, tok in ahead])
                for (seq, _, _), d in zip(ahead, got):
                    drafts[seq] = (d.tokens.tolist(), d.confidence.tolist())
                draft_s = time.perf_counter() - t1
        for op in plan.after:
            self._kept_op(plan, op)
        read_ahead = getattr(self.model, "engram_read_ahead_next", None)
        if read_ahead is not None and lasts:   # each sequence's drawn token is its next decode row: its Engram rows
            read_ahead([(self.states[seq], last) for seq, last in lasts.items()])
        return RoundResult(plan.round, samples, time.perf_counter() - t0, errors, accepted, drafts, draft_s)

    def _draw_all(self, wanted: list, outs: list[torch.Tensor], bitmask) -> Drawn:
        """Every wanted row of the round drawn at once on the logits' device (sampler.draw_rows), queued: a verify
        row group [pending, d1..dn] gives a draw per row, each what serial decoding draws at that position."""
        if not outs:                # prompt chunks only
            return draw_rows(torch.zeros((0, 0)), [], [])
        positions, params, replies = [], [], []
        for r, out in zip(wanted, outs):
            p = self.params[r.seq]
            n = out.shape[0]
            rep = self.replies.get(r.seq, ())
            for j in range(n):
                pos = r.start + len(r.ids) - n + j + 1
                positions.append(pos)
                params.append(p)
                replies.append(rep[:max(0, pos - p.prompt_len)] if p.adjusts else ())
        logits = torch.cat(outs) if len(outs) > 1 else outs[0]
        return draw_rows(logits, positions, params, replies, bitmask)

    def _take_ahead(self, round_: int | None):
        """The table built ahead for round `round_`, if that is the one held; any other is taken back (undo: the
        states as they were before it was built)."""
        held, self._ahead = self._ahead, None
        if held is None:
            return None
        if held[0] == round_:
            return held[1]
        held[1].undo()
        return None

    def upcoming(self, plan: StepPlan) -> None:
        """The plan queued behind the running round (the scheduler's loop, when it plans round N+1 while N runs):
        its host side may be prepared while N's forward still runs on the device (_prepare_next)."""
        self._next = plan
        self._next_ready.set()

    def _wait_upcoming(self, timeout: float) -> None:
        """Wait up to `timeout` for the plan queued behind the running round: from the scheduler (upcoming), or on a
        follower from rank 0 (poll_ahead)."""
        if self.poll_ahead is None:
            self._next_ready.wait(timeout)
            self._next_ready.clear()
            return
        nxt = self.poll_ahead()
        if nxt is not None:
            self._next = nxt
        elif timeout > 0:
            time.sleep(timeout)

    def _prepare_next(self, plan: StepPlan, done, drawn: Drawn | None = None, wanted: list = (),
                      matchers: dict | None = None) -> None:
        """While this round's forward and draws run on the device, build the next round's table (Model.prepare_ahead:
        the window slots, the compressor groups, the index counts, the addresses; everything but the ids it
        draws). Waits for the next plan only while the device is still busy (until `done()`: rank 0's draws, a
        follower's forward; a GPU round takes milliseconds, the loop plans the next one meanwhile); on the host op
        set the forward has already finished and only a plan already queued is prepared. A plan is taken only when
        nothing between here and its forward changes its sequences: every row one PENDING decode token wanting its
        logits, no state ops on its sequences, nothing after this round, no verify or drafting rows in either.
        Rank 0 tells the followers each plan it prepares (tell_ahead), and they prepare it by the same rules: their
        states are rank 0's. Where the round may be launched ahead (_launch_sources: `drawn`, this round's draws
        still on the device), its forward and draws are queued now too (_launch)."""
        self._take_ahead(None)
        prepare = getattr(self.model, "prepare_ahead", None)
        if prepare is None or plan.after or any(r.draft or len(r.logits) > 1 for r in plan.rows):
            return
        self._wait_upcoming(0.0)
        while True:
            nxt = self._next
            if nxt is not None and nxt.round == plan.round + 1:
                break
            if done is None or done():
                return
            self._wait_upcoming(_POLL_S)
        seqs = [r.seq for r in nxt.rows]
        if (not seqs or len(set(seqs)) != len(seqs) or nxt.after
                or any(not isinstance(op, (FreeSeq, NewSeq)) or op.seq in seqs for op in nxt.ops)):
            return
        states = []
        for r in nxt.rows:
            st = self.states.get(r.seq)
            if (st is None or r.ids != [PENDING] or r.logits != [0] or r.draft or st.length != r.start
                    or st.undo is not None):
                return
            states.append(st)
        if self.tell_ahead is not None:
            self.tell_ahead(nxt)
        with torch.no_grad():
            rd = prepare(states, 1, "last")
        if rd is None:
            return
        src = self._launch_sources(nxt, wanted, matchers, drawn) if drawn is not None else None
        if src is not None:
            self._launch(nxt, states, rd, drawn, src)
        else:
            self._ahead = (nxt.round, rd)

    def _launch_sources(self, nxt: StepPlan, wanted: list, matchers: dict | None, drawn: Drawn) -> list[int] | None:
        """Where round `nxt` (prepared: each row one PENDING decode token of a sequence this round draws for) may
        be queued before this round's tokens reach the host, each of its rows' place among this round's draws; None
        where something on the host needs them first: a constrained row (its mask needs the matcher to have consumed
        the token), params that adjust the logits by the reply (penalties read the reply's tokens), a model with
        Engram layers (their rows are read by hashes of the ids on the host), several ranks (a follower takes the ids
        from rank 0's plan)."""
        if (not self.launch_ahead or self.follower or drawn.token is None
                or getattr(getattr(self.model, "comm", None), "world", 1) > 1
                or getattr(self.model, "hasher", None) is not None):
            return None
        at = {r.seq: i for i, r in enumerate(wanted)}
        if len(at) != len(wanted) or drawn.token.shape != (len(wanted),):
            return None
        for r in nxt.rows:
            p = self.params.get(r.seq)
            if r.seq not in at or (matchers and r.seq in matchers) or p is None or p.adjusts:
                return None
        return [at[r.seq] for r in nxt.rows]

    def _launch(self, nxt: StepPlan, states: list, rd, drawn: Drawn, src: list[int]) -> None:
        """Queue round `nxt`'s forward and draws behind this round's: its ids are this round's draws `src` (each
        row's place among them), read on the device (the same tokens the host resolves its PENDING rows to when it
        comes), so its rows compute what they would have after this round's commit. execute(nxt) then only waits
        for them."""
        from dsv41.model.model import InputError     # (as SeqInput: the runner imports no model at import time)
        ids = drawn.token
        if src != list(range(ids.shape[0])):
            index = torch.tensor(src, dtype=torch.long)
            if ids.device.type == "cuda":      # pinned: a pageable copy would wait for the device to drain
                index = index.pin_memory().to(ids.device, non_blocking=True)
            ids = ids.index_select(0, index)
        inputs = [self.SeqInput(state=st, ids=torch.zeros(1, dtype=torch.long), logits="last") for st in states]
        try:
            with torch.no_grad():
                outs = self.model.forward(inputs, ahead=rd, ids_on_device=ids)
        except InputError:      # refused before any state moved (the table taken back): the round runs when it comes
            return
        self._launched = (nxt, self._draw_all(list(nxt.rows), outs, None), [1] * len(outs))

    @staticmethod
    def _accept(r, draws: list[Sample], m, errors: dict[int, str]) -> list[Sample]:
        """The tokens a row group yields: its last row's draw, or for a verify row the draws of rows 0.. while each
        equals the next draft token, then the first that differs (the bonus) or the draw after the last draft. The
        matcher consumes them."""
        out = []
        n = len(draws)
        for j, s in enumerate(draws):
            if m is not None and not m.consume(s.token_id):
                errors[r.seq] = f"the grammar refused token {s.token_id}: {m.error}"
                break
            out.append(s)
            if j + 1 >= n or s.token_id != r.ids[len(r.ids) - n + j + 1]:
                break
        return out

    def _agree(self, decisions: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Every rank takes rank 0's decisions (a follower has no grammar masks, so its own draws may differ)."""
        comm = getattr(self.model, "comm", None)
        if comm is None or comm.world <= 1 or not decisions:
            return decisions
        t = torch.tensor(decisions, dtype=torch.float32, device=getattr(self.model, "device", None))
        if self.follower:
            t.zero_()
        t = comm.all_reduce(t).cpu()            # exact: integers below 2^24, one rank non-zero
        return [(int(a), int(b)) for a, b in t.round().long().tolist()]

    def read_ahead(self, hints: list[tuple[list[int], int, list[int]]]) -> None:
        """Start reading the Engram rows of coming prompt chunks (called on the event loop while a round runs):
        (the token ids just before pos0, pos0, the chunk's token ids). Only warms a cache; never changes a value."""
        read_ahead = getattr(self.model, "engram_read_ahead", None)
        if read_ahead is None or getattr(self.model, "hasher", None) is None:   # no Engram layers
            return
        for before, pos0, ids in hints:
            read_ahead(self.model.hasher.compress(torch.tensor(before, dtype=torch.long)), pos0,
                       torch.tensor(ids, dtype=torch.long))

    def _kept_op(self, plan: StepPlan, op) -> None:
        """SaveState / RestoreState / DropState (dsv41.sched.kept): snapshots at token boundaries."""
        if isinstance(op, DropState):
            self.kept.drop(op.key)
        elif isinstance(op, (SaveState, RestoreState)):
            st = self.states.get(op.seq)
            if st is None:
                raise PlanError(f"round {plan.round}: {type(op).__name__} for unknown sequence {op.seq}")
            if isinstance(op, SaveState):
                self.kept.save(op.key, st)
            else:
                self.kept.restore(op.key, st)
        else:
            raise PlanError(f"round {plan.round}: state op {type(op).__name__} is not served yet")

    def _masks(self, wanted: list, ms: list) -> torch.Tensor:
        """The round's grammar bitmask (host int32, a row per wanted logits row; rows without a matcher allow every
        token), sampler.sample_rows applies it on the device. A verify row's rows get the masks after each draft
        prefix (the scheduler cut the draft to what the grammar allows). Runs in the mask thread during the forward."""
        from dsv41.grammar.matchers import VOCAB, allocate_bitmask, fill_draft_masks, fill_masks
        t0 = time.perf_counter()
        vocab = self.vocab or VOCAB
        sizes = [len(r.logits) for r in wanted]
        bitmask = allocate_bitmask(sum(sizes), vocab)
        plain, drafted = [], []
        row = 0
        for r, m, n in zip(wanted, ms, sizes):
            if m is not None:
                if n > 1:
                    drafted.append((m, row, r.ids[len(r.ids) - n + 1:]))
                else:
                    plain.append((m, row))
            row += n
        if plain:
            sub = allocate_bitmask(len(plain), vocab)
            fill_masks([m for m, _ in plain], sub)
            for k, (_, row) in enumerate(plain):
                bitmask[row] = sub[k]
        if drafted:
            fill_draft_masks(drafted, bitmask)
        self.grammar_seconds += time.perf_counter() - t0
        return bitmask

    def drop(self, seqs: list[int]) -> None:
        """Forget sequences whose state may be half-advanced (a failed forward)."""
        for s in seqs:
            self.states.pop(s, None)
            self.params.pop(s, None)
            self.replies.pop(s, None)

    def state_bytes(self) -> int:
        return sum(int(st.nbytes()) for st in self.states.values())

