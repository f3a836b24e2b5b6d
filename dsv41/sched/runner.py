"""ModelRunner: turns a StepPlan (dsv41.comm.plan) into one batched Model.forward call and samples the rows whose
logits the plan asks for.

The runner is the only caller of Model.forward. It owns the sequence table (seq id -> SeqState, SamplingParams) and
applies the plan's state ops before the forward. It runs in a worker thread (the scheduler's executor), never on the
event loop. A follower rank runs the same code on the plans it receives, so it samples alike.
"""
from __future__ import annotations

import time

import msgspec
import torch

from dsv41.comm.plan import DropState, FreeSeq, NewSeq, RestoreState, SaveState, StepPlan
from dsv41.sched.kept import KeptStates
from dsv41.sched.sampler import Sample, SamplingParams, sample_row

_params_decoder = msgspec.msgpack.Decoder(SamplingParams)


def encode_params(p: SamplingParams) -> bytes:
    """SamplingParams as the opaque bytes NewSeq carries."""
    return msgspec.msgpack.encode(p)


class PlanError(RuntimeError):
    """The plan does not match the runner's sequence table (a scheduler bug, or ranks out of step)."""


class RoundResult(msgspec.Struct, array_like=True, gc=False):
    round: int
    samples: list[tuple[int, Sample]]      # (seq, drawn token), in plan row order
    seconds: float                         # wall time of the forward + sampling
    grammar_errors: dict[int, str] = {}    # seq -> why its grammar matcher refused the drawn token


class ModelRunner:
    def __init__(self, model, seq_input_cls=None):
        self.model = model
        if seq_input_cls is None:
            from dsv41.model.model import SeqInput as seq_input_cls  # noqa: N813
        self.SeqInput = seq_input_cls
        self.states: dict[int, object] = {}
        self.params: dict[int, SamplingParams] = {}
        self.kept = KeptStates()                  # kept prompt states (snapshots), key -> SeqState

    def execute(self, plan: StepPlan, matchers: dict | None = None) -> RoundResult:
        """Apply the plan's ops, run its rows in one forward, draw a token for each row whose logits it asks for.

        matchers: seq -> grammar Matcher (dsv41.grammar) for constrained sequences (rank 0 only for now): their
        rows' logits are masked to what the grammar allows before the draw, and the drawn token is consumed."""
        t0 = time.perf_counter()
        for op in plan.ops:
            if isinstance(op, FreeSeq):
                self.states.pop(op.seq, None)
                self.params.pop(op.seq, None)
            elif isinstance(op, NewSeq):
                if op.seq in self.states:
                    raise PlanError(f"round {plan.round}: sequence {op.seq} opened twice")
                self.states[op.seq] = self.model.new_state()
                self.params[op.seq] = _params_decoder.decode(op.params)
            else:
                self._kept_op(plan, op)
        inputs = []
        for r in plan.rows:
            st = self.states.get(r.seq)
            if st is None:
                raise PlanError(f"round {plan.round}: rows for unknown sequence {r.seq}")
            if st.length != r.start:
                raise PlanError(f"round {plan.round}: sequence {r.seq} holds {st.length} tokens, plan starts at "
                                f"{r.start}")
            if r.logits and r.logits != [len(r.ids) - 1]:
                raise PlanError(f"round {plan.round}: sequence {r.seq}: only the last row's logits are served")
            inputs.append(self.SeqInput(state=st, ids=torch.tensor(r.ids, dtype=torch.long),
                                        logits="last" if r.logits else "none"))
        samples = []
        errors: dict[int, str] = {}
        if inputs:
            with torch.no_grad():
                outs = self.model.forward(inputs)
            wanted = [(r, out[-1]) for r, out in zip(plan.rows, outs) if r.logits]
            rows = [row for _, row in wanted]
            ms = [matchers.get(r.seq) for r, _ in wanted] if matchers else []
            if any(m is not None for m in ms):
                rows = self._mask(rows, ms)
            for k, ((r, _), row) in enumerate(zip(wanted, rows)):
                s = sample_row(row, r.start + len(r.ids), self.params[r.seq])
                samples.append((r.seq, s))
                m = ms[k] if ms else None
                if m is not None and not m.consume(s.token_id):
                    errors[r.seq] = f"the grammar refused token {s.token_id}: {m.error}"
        for op in plan.after:
            self._kept_op(plan, op)
        read_ahead = getattr(self.model, "engram_read_ahead", None)
        if read_ahead is not None:  # each sequence's last drawn token is its next decode row: read its Engram rows now
            for seq, s in dict(samples).items():
                st = self.states[seq]
                read_ahead(st.engram_history[-3:], st.length, torch.tensor([s.token_id]))
        return RoundResult(plan.round, samples, time.perf_counter() - t0, errors)

    def read_ahead(self, hints: list[tuple[list[int], int, list[int]]]) -> None:
        """Start reading the Engram rows of coming prompt chunks (called on the event loop while a round runs):
        (the token ids just before pos0, pos0, the chunk's token ids). Only warms a cache; never changes a value."""
        read_ahead = getattr(self.model, "engram_read_ahead", None)
        if read_ahead is None:
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

    @staticmethod
    def _mask(rows: list[torch.Tensor], ms: list) -> list[torch.Tensor]:
        """Logits rows with what each row's grammar forbids set to -inf (rows without a matcher untouched)."""
        from dsv41.grammar.matchers import allocate_bitmask, apply_mask, fill_masks
        logits = torch.stack([r.reshape(-1) for r in rows]).float().clone()
        bitmask = allocate_bitmask(len(rows), logits.shape[1])
        fill_masks(ms, bitmask)
        apply_mask(logits, bitmask)
        return list(logits)

    def drop(self, seqs: list[int]) -> None:
        """Forget sequences whose state may be half-advanced (a failed forward)."""
        for s in seqs:
            self.states.pop(s, None)
            self.params.pop(s, None)

    def state_bytes(self) -> int:
        return sum(int(st.nbytes()) for st in self.states.values())
