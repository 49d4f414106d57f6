"""Overlapped greedy decode: step i+1 is launched before the host waits for step i's tokens.

A synchronous step leaves the GPU idle while the host schedules, writes the inputs, launches
the graph, reads the tokens back and accepts them (0.12-0.16 ms per step on an H200).
In steady decode (`EngineConfig.overlap`), each `step()` call instead:

1. launches step i+1 for the sequences of step i, less those that finish with step i by
   max_tokens or context length (known before their token is): the token ids of step i go
   from the device straight into the decode graph's input ids (`decode_chain.ChainedDecode`),
   the host writes positions, slots, context lengths and block tables (the block of the next
   position is allocated first);
2. waits for step i's tokens (`TokenReadback`) and accepts them (EOS, stop, max_tokens);
3. returns step i's outputs: one step per call, the same tokens as the synchronous engine.

A sequence that a token ended at step i (EOS, stop; or cancelled meanwhile) has its step-i+1
token discarded (counted in `EngineStats.overlap_discarded`, nothing of it published); that
step's K/V write went to the sequence's own last block (never a published one), which is freed
with the others, and any later use of the block is ordered after it on the stream. On a GPU,
step i+1 then ran in the bucket of the larger batch (the synchronous engine would have used
the smaller one for it), which can change the other rows' logits in the last bits.

Step i+1 is launched only when nothing else could change it: no command arrived, every
sequence samples greedily, no other sequence has work (prefill, a decode not in the batch),
the batch fits the call's `allow` and `max_batch`, the largest graph bucket and the KV budget
(no eviction), and the new blocks are free without preempting. Otherwise the call completes
the step in flight and the next call runs the synchronous path (which preempts, prefills,
samples non-greedily as usual). Commands that arrive while a step is in flight apply after
its tokens are accepted, as if they had arrived one step later; a cancel of a sequence in
flight applies at once (its in-flight token is dropped), so a cancelled stream ends where the
synchronous engine's does.

Callers that drive the engine must route every call's outputs (a call with `allow=set()`
may complete a step in flight).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tristream.engine.decode_chain import ChainedDecode, Readback, TokenReadback
from tristream.engine.engine_types import Command, StepOutput
from tristream.engine.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from tristream.engine.engine import LLMEngine


@dataclasses.dataclass(slots=True)
class InFlight:
    """A launched greedy decode step whose tokens the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # device token ids [len(seqs)]: the next step's input ids
    readback: Readback


class OverlapDecode:
    """The overlapped `step()` of one engine (engine thread only)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.eng = engine
        self.chain = ChainedDecode(engine.runner)
        self.readback = TokenReadback(engine.model.device)
        self.flight: InFlight | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still to be returned."""
        return self.flight is not None

    @torch.inference_mode()
    def step(self, allow: set[int] | None, max_batch: int | None, max_prefill_tokens: int | None
             ) -> list[StepOutput]:
        """One engine step's outputs (see the module docstring)."""
        eng = self.eng
        cur, self.flight = self.flight, None
        deferred: list[Command] = []
        commands = False
        if cur is None:
            outputs = eng._apply_commands()
            decode, chunks = eng._schedule(allow, max_batch, max_prefill_tokens)
            if not decode and not chunks:
                return outputs
            if chunks or allow is not None or self._next_batch(decode, allow, max_batch) is None:
                return outputs + eng._run(decode, chunks)
            cur = self._launch_first(decode)
        else:
            outputs, deferred, commands = self._early_cancels(cur)
        # an external scheduler (allow given) plans every step itself: never run ahead of it, or
        # a later step(allow=set()) would hand it tokens of a step it did not plan
        nxt = None if commands or allow is not None else self._next_batch(cur.seqs, allow, max_batch)
        if nxt is not None and self._reserve(nxt):
            self.flight = self._launch_next(cur, nxt)
        tm = eng.timer
        if tm is not None:
            tm.mark("sample")
        toks = self.readback.wait(cur.readback)
        if tm is not None:
            tm.mark("post")
        outputs += self._complete(cur, toks)
        if deferred:
            eng._cancel_outputs = []
            for fn, _ in deferred:
                fn()
            outputs += eng._cancel_outputs
        return outputs

    # ---- launches ----

    def _launch_first(self, decode: list[Sequence]) -> InFlight:
        eng = self.eng
        eng.stats.steps += 1
        if eng.timer is not None:
            eng.timer.mark("decode")
        tokens = eng.runner.decode_greedy(decode)
        return InFlight(decode, tokens, self._readback(tokens))

    def _launch_next(self, cur: InFlight, nxt: list[Sequence]) -> InFlight:
        eng = self.eng
        eng.stats.steps += 1
        eng.stats.overlap_steps += 1
        if eng.timer is not None:
            eng.timer.mark("decode")
        keep = {id(s) for s in nxt}
        rows = None if len(nxt) == len(cur.seqs) else [i for i, s in enumerate(cur.seqs) if id(s) in keep]
        tokens = self.chain.launch_greedy(nxt, cur.tokens, rows)
        return InFlight(nxt, tokens, self._readback(tokens))

    def _readback(self, tokens: torch.Tensor) -> Readback:
        """Start getting the step just launched's tokens to the host: from the decode graph's mapped
        host slot where a graph ran it (no copy), else by an asynchronous copy."""
        dec = self.eng.runner.decoder
        return self.readback.start(tokens, dec.mapped_tokens(tokens) if dec is not None else None)

    # ---- conditions ----

    def _next_batch(self, seqs: list[Sequence], allow: set[int] | None, max_batch: int | None
                    ) -> list[Sequence] | None:
        """The batch of the step after the one computing `seqs`, if it can run ahead: `seqs`
        without those that finish with this step by length (known before their token is), as
        the synchronous engine would schedule it unless a token ends a sequence; else None.

        Called while that step is launched but not accepted: each sequence of the batch has one
        pending position (the token it is feeding) and its next token is not in `keys`."""
        eng = self.eng
        cap = eng.config.max_batch if max_batch is None else max_batch
        if len(seqs) > cap or not self.chain.supports(len(seqs)):
            return None
        bs = eng.blocks.block_size
        nxt: list[Sequence] = []
        for s in seqs:
            p = s.params
            if (s.status is not SeqStatus.RUNNING or p.temperature != 0 or p.repetition_penalty != 1.0
                    or p.logits_mask is not None
                    or (allow is not None and s.seq_id not in allow)):
                return None
            if len(s.output_ids) + 1 >= p.max_tokens or len(s.keys) + 1 >= eng.config.max_model_len:
                continue  # finishes with this step whatever its token
            budget = eng.retention.budget_blocks(s)
            if budget is not None and -(-(len(s.keys) + 1 - s.cache_offset) // bs) > budget:
                return None  # the next step would evict: the synchronous path does that
            nxt.append(s)
        if not nxt:
            return None
        busy = 0
        for s in eng.seqs.values():
            if s.num_pending > 0:
                busy += 1
        return nxt if busy == len(seqs) else None  # nobody else has prefill or decode work

    def _reserve(self, seqs: list[Sequence]) -> bool:
        """Allocate the block of each sequence's next position; False (nothing taken) when
        that would need more blocks than are free (the synchronous path may preempt)."""
        blocks = self.eng.blocks
        bs = blocks.block_size
        need = [max(0, -(-(len(s.keys) + 1 - s.cache_offset) // bs) - len(s.block_table)) for s in seqs]
        if sum(need) > blocks.num_free:
            return False
        for s, k in zip(seqs, need, strict=True):
            for _ in range(k):
                s.block_table.append(blocks.allocate())
        return True

    # ---- completion ----

    def _early_cancels(self, cur: InFlight) -> tuple[list[StepOutput], list[Command], bool]:
        """Apply queued cancels of sequences in flight now; defer every other command."""
        eng = self.eng
        cmds = eng._take_commands()
        if not cmds:
            return [], [], False
        ids = {s.seq_id for s in cur.seqs}
        eng._cancel_outputs = []
        deferred: list[Command] = []
        for cmd in cmds:
            if cmd[1] is not None and cmd[1] in ids:
                cmd[0]()
            else:
                deferred.append(cmd)
        return list(eng._cancel_outputs), deferred, True

    def _complete(self, cur: InFlight, toks: list[int]) -> list[StepOutput]:
        """Account for a finished step: live sequences accept their token, others drop it."""
        eng = self.eng
        live: list[Sequence] = []
        live_toks: list[int] = []
        for s, t in zip(cur.seqs, toks, strict=True):
            if s.status is SeqStatus.RUNNING and eng.seqs.get(s.seq_id) is s:
                live.append(s)
                live_toks.append(t)
            else:
                eng.stats.overlap_discarded += 1
        return eng._account(live, [], live, live_toks)
