"""Decode steps fed on the device: a step's input token ids are the previous step's sampled ids.

`overlap.py` launches decode step i+1 before the host has read step i's tokens. The token ids
of step i never leave the device on the way in: they are copied straight into the decode
graph's input-id slots (`DecodeGraphs.ids`), while the host writes the rest of the step's
inputs (positions, cache slots, context lengths, block tables) from its own pinned buffer.
Two pinned buffers alternate: the host writes step i+2's inputs after waiting for step i only,
while the copy of step i+1's inputs (queued behind step i) may not have run yet.

When the batch and its block tables are those of the last step, nothing is copied at all: the
graph's first kernel advances the inputs (`kernels/advance.py`, `DecodeGraphs.skip_copy`).

`TokenReadback` gets a step's token ids to the host without waiting, and waits later (two slots,
one per step in flight): a decode graph's argmax already wrote them into mapped pinned memory
(`DecodeGraphs.mapped_tokens`), so only an event is recorded; other steps copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from tristream.engine.decode_inputs import FRESH
from tristream.engine.engine_types import PinnedCopy
from tristream.engine.runner import ModelRunner
from tristream.engine.sampler import greedy_tokens
from tristream.engine.sequence import Sequence


@dataclasses.dataclass(slots=True)
class Readback:
    """A device→host copy of one step's token ids that may still be running."""

    tokens: torch.Tensor  # the device tensor (kept alive until the copy is done)
    slot: int  # pinned slot index (CUDA), -1 on CPU
    n: int
    mapped: tuple[torch.Tensor, Callable[[], None]] | None = None  # the graph's host tokens, their check


class TokenReadback:
    """Asynchronous device→host copies of token ids into two reused `PinnedCopy` slots."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.slots = (PinnedCopy(), PinnedCopy())
        self.events = (torch.cuda.Event(), torch.cuda.Event()) if self.cuda else ()
        self.next = 0

    def start(self, tokens: torch.Tensor, mapped: tuple[torch.Tensor, Callable[[], None]] | None = None
              ) -> Readback:
        """Queue the copy of `tokens` ([n] int64) to the host; returns the handle to `wait` on.
        mapped: where the step already wrote them in pinned host memory ([≥ n] view) and a check
        to run once it is done (`DecodeGraphs.mapped_tokens`): then only an event is recorded.
        At most two copies may be outstanding (a slot is reused two `start`s later)."""
        n = int(tokens.shape[0])
        if not self.cuda:
            return Readback(tokens, -1, n)
        slot = self.next
        self.next ^= 1
        if mapped is not None:
            self.events[slot].record()
            return Readback(tokens, slot, n, mapped)
        self.slots[slot].start(tokens)
        return Readback(tokens, slot, n)

    def wait(self, rb: Readback) -> list[int]:
        """Block (releasing the GIL on CUDA) until the copy is done; the token ids."""
        if rb.slot < 0:
            return rb.tokens.tolist()
        if rb.mapped is not None:
            self.events[rb.slot].synchronize()
            view, check = rb.mapped
            check()
            return view[:rb.n].tolist()
        return self.slots[rb.slot].wait()


class ChainedDecode:
    """Launches a decode step of `seqs` whose input ids are a device tensor of the last step's tokens.

    Each sequence's next position is `len(seq.keys)` (its last sampled token is not in `keys`
    yet); the caller has allocated the block that holds it.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        dec = runner.decoder
        self.host: list[torch.Tensor] = []
        self.host_np: list[np.ndarray] = []
        if dec is not None:
            pin = dec.dev_buf.device.type == "cuda"
            for _ in range(2):
                t = torch.zeros_like(dec.host_buf, device="cpu").pin_memory() if pin else dec.host_buf.clone()
                self.host.append(t)
                self.host_np.append(t.numpy())
        self.rows_dev = torch.zeros(dec.max_bs if dec is not None else 1, dtype=torch.int32,
                                    device=dec.dev_buf.device if dec is not None else "cpu")
        self.flip = 0

    def supports(self, n: int) -> bool:
        """Whether a batch of n rows can be launched (at most the largest graph bucket)."""
        dec = self.runner.decoder
        return dec is None or n <= dec.max_bs

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], prev_tokens: torch.Tensor, rows: list[int] | None = None
               ) -> torch.Tensor:
        """Queue the step; float32 logits [len(seqs), vocab] (on CUDA: not yet computed).

        prev_tokens: the last step's token ids on the device, one per row of that step; `rows`:
        which of them feed `seqs` (None: all, in order)."""
        return self._launch(seqs, prev_tokens, rows, greedy=False)

    @torch.inference_mode()
    def launch_greedy(self, seqs: list[Sequence], prev_tokens: torch.Tensor, rows: list[int] | None = None
                      ) -> torch.Tensor:
        """As `launch`, but the step's greedy token ids [len(seqs)] (int64, on the device): the graph's
        own argmax where a graph runs the batch (`DecodeGraphs.run_greedy`)."""
        return self._launch(seqs, prev_tokens, rows, greedy=True)

    def _launch(self, seqs: list[Sequence], prev_tokens: torch.Tensor, rows: list[int] | None, greedy: bool
                ) -> torch.Tensor:
        dec = self.runner.decoder
        if dec is None:
            logits = self._eager(seqs, prev_tokens, rows)
            return greedy_tokens(logits) if greedy else logits
        b = self._inputs(seqs, prev_tokens, rows)
        n = len(seqs)
        if b in dec.graphs:
            dec.graphs[b].replay()
            return dec.tokens[b][:n] if greedy else dec.logits(b, n)
        dec.on_device = dec.pending = None  # an eager step leaves the FRESH flag unread: nothing mirrored
        logits = dec.forward(b)[:n]
        return greedy_tokens(logits) if greedy else logits

    def _inputs(self, seqs: list[Sequence], prev_tokens: torch.Tensor, rows: list[int] | None) -> int:
        """Queue the copies of the step's inputs, unless the graph's advance kernel makes them from the
        last replay's (`DecodeGraphs.skip_copy`); the bucket it runs in."""
        dec = self.runner.decoder
        assert dec is not None
        n = len(seqs)
        b = dec.bucket_for(n)
        assert b is not None, "ChainedDecode.supports() was not checked"
        state = dec.input_state(b, seqs, fed_pending=True)
        own = dec.tokens.get(b)
        same_ids = rows is None and own is not None and prev_tokens.data_ptr() == own.data_ptr()
        if dec.skip_copy(state, ids_ready=same_ids):  # the previous replay was this bucket's: ids in place too
            return b
        mb = dec.max_blocks
        h = self.host_np[self.flip]
        src = self.host[self.flip]
        self.flip ^= 1
        for i, s in enumerate(seqs):
            dec.write_row(h, i, s, len(s.keys))  # the position of the token being fed (logical, RoPE)
        h[dec.o_pos + n:dec.o_pos + b] = 0  # padded rows: position 0, no cache write, empty context
        h[dec.o_slot + n:dec.o_slot + b] = -1
        h[dec.o_ctx + n:dec.o_ctx + b] = 0
        h[dec.o_flag] = FRESH
        used = dec.o_bt + b * mb
        dec.dev_buf[dec.o_flag:used].copy_(src[dec.o_flag:used], non_blocking=True)  # everything but the ids
        dec.inputs_copied(state)
        if same_ids:
            pass  # the previous step was this bucket's graph: its argmax already wrote the ids
        elif rows is None:  # the ids: the previous step's tokens, device to device
            dec.ids[:n].copy_(prev_tokens)
        else:  # some rows left (finished by length): gather the others' tokens
            h[:n] = rows  # the ids slots of this host buffer are free: they carry the row indexes
            self.rows_dev[:n].copy_(src[:n], non_blocking=True)
            dec.ids[:n].copy_(prev_tokens.index_select(0, self.rows_dev[:n]))
        return b

    def _eager(self, seqs: list[Sequence], prev_tokens: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
        """CPU / no decode graphs: the runner's eager decode, with each token put in its
        sequence's keys for the duration of the call (computing is synchronous there)."""
        toks = prev_tokens.tolist()
        if rows is not None:
            toks = [toks[r] for r in rows]
        for s, t in zip(seqs, toks, strict=True):
            s.keys.append(int(t))
        try:
            return self.runner.decode(seqs)
        finally:
            for s in seqs:
                s.keys.pop()
