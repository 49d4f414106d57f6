"""What a Whisper pass (`runner.WhisperRunner`) reads and returns.

`PassInputs`: the per-row inputs, one int64 device table filled from a pinned host twin by one
host→device copy per pass; the pass's graphs read its columns in place. Columns: valid frames, draft length, real row (1: a stream, 0: bucket padding), audio-store slot,
number of draft frames, then `max_draft` draft tokens and `max_draft + 1` draft frames (the
previous hypothesis's token start frames and its end row).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tristream.speech.config import HOP
from tristream.speech.errors import AudioInputError

SAMPLES_PER_POSITION = 2 * HOP
COLS = 5  # leading columns before the draft tokens and their frames


def valid_frames(lengths: Sequence[int]) -> np.ndarray:
    """Encoder frames holding audio, per stream (at least one)."""
    return np.maximum(1, -(-np.asarray(lengths, np.int64) // SAMPLES_PER_POSITION))


@dataclass(slots=True)
class PassResult:
    """One pass: greedy tokens `[B, K]` (text ids, EOT-terminated or full) and per-token frames.

    `frames[b, j]` is the encoder frame (20 ms units from the buffer start) where token `j` starts:
    its DTW jump time with `word_times`, else 0; `frames[b, n]` (n = number of text tokens, when
    below K) is the end-of-text row's jump, i.e. where the last word ends. `voiced[b, f]` (with word
    times): frame f is within `silence_db` of the buffer's loudest 20 ms frame, for snapping word
    edges to pauses (`timing.snap_words`). `accepted[b]`: draft tokens confirmed by the parallel
    prefill; `steps`: serial decoder steps run.
    """

    tokens: np.ndarray
    frames: np.ndarray
    audio_bucket_s: float
    batch_bucket: int
    accepted: np.ndarray
    steps: int
    voiced: np.ndarray | None = None


@dataclass(slots=True)
class RunnerStats:
    """Counters: passes per bucket, eager passes, graph captures, serial decode steps, draft tokens."""

    passes: dict[tuple[int, float], int] = field(default_factory=dict)
    captured: int = 0
    eager_passes: int = 0
    decode_steps: int = 0
    align_passes: int = 0  # alignment-heads passes run (word times)
    aligned_rows: int = 0  # stream rows those passes timed
    deferred_rows: int = 0  # stream rows of passes run without word times (`word_times=False`)
    draft_tokens: int = 0
    draft_accepted: int = 0
    truncated_drafts: int = 0


class PassInputs:
    """The input table of `WhisperRunner` passes (`rows` streams at most) and its host twin."""

    def __init__(self, rows: int, max_draft: int, eot: int, device: torch.device) -> None:
        self.max_draft, self.eot = max_draft, eot
        width = COLS + 2 * max_draft + 1
        self.table = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.host = torch.zeros(rows, width, dtype=torch.long, pin_memory=device.type == "cuda")
        self.valid_frames = self.table[:, 0]
        self.draft_len = self.table[:, 1]
        self.real = self.table[:, 2]
        self.slots = self.table[:, 3]
        self.n_draft_frames = self.table[:, 4]
        self.draft = self.table[:, COLS : COLS + max_draft]
        self.draft_frames = self.table[:, COLS + max_draft :]
        self._copied: torch.cuda.Event | None = None

    def write(self, lengths: list[int], bb: int, drafts: Sequence[Sequence[int]] | None,
              slots: Sequence[int] | None = None, draft_frames: Sequence[Sequence[int]] | None = None
              ) -> tuple[int, int]:
        """Fill the first `bb` rows for streams of `lengths` samples and queue their copy; returns
        (drafts cut to `max_draft`, draft tokens written: ids >= end-of-text are dropped).

        The twin is rewritten only here; the previous pass's copy out of it is long done (every
        pass ends by reading its tokens, which waits for the whole stream)."""
        d = self.max_draft
        if self._copied is not None:
            self._copied.synchronize()  # normally long complete; guards a pass that raised midway
        host = self.host[:bb].numpy()
        host[:, 0] = 1
        host[:, 1:COLS] = 0
        host[:, COLS:] = self.eot
        m = len(lengths)
        truncated = written = 0
        host[:m, 0] = valid_frames(lengths)
        host[:m, 2] = 1
        if slots is not None:
            host[:m, 3] = slots
        if drafts is not None:
            if len(drafts) != m:
                raise AudioInputError(f"{len(drafts)} drafts for {m} streams; pass one per stream")
            # all rows' tokens (the first `d` of each) as one int64 array by one C-level conversion, and
            # one masked write: per row, a numpy call costs more than the row's few dozen ints
            flat, take, truncated = _flatten(drafts, d)
            if flat.shape[0] and flat.max() >= self.eot:  # ids >= end-of-text are dropped, the rest close up
                text = flat < self.eot
                flat = flat[text]
                take = np.bincount(np.repeat(np.arange(m), take)[text], minlength=m)
            host[:m, 1] = take
            host[:m, COLS : COLS + d][np.arange(d) < take[:, None]] = flat
            written = int(flat.shape[0])
        if draft_frames is not None:
            self.put_draft_frames(host, range(m), draft_frames)
        self.table[:bb].copy_(self.host[:bb], non_blocking=True)
        if self.table.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return truncated, written

    def put_draft_frames(self, host: np.ndarray, rows: Sequence[int], draft_frames: Sequence[Sequence[int]]) -> None:
        """Write each row's previous draft frames (at most `max_draft + 1`) into its row of `host`."""
        if len(draft_frames) != len(rows):
            raise AudioInputError(f"{len(draft_frames)} draft frame lists for {len(rows)} streams; pass one per stream")
        lo, cap = COLS + self.max_draft, self.max_draft + 1
        flat, take, _ = _flatten(draft_frames, cap)
        into = np.arange(cap) < take[:, None]  # [rows, cap]: where each row's frames go
        if isinstance(rows, range) and rows.step == 1:  # the callers' case: a block of the table, in place
            host[rows.start : rows.stop, 4] = take
            host[rows.start : rows.stop, lo : lo + cap][into] = flat
        else:
            at = np.asarray(rows, np.int64)
            host[at, 4] = take
            block = host[at, lo : lo + cap]
            block[into] = flat
            host[at, lo : lo + cap] = block


def _flatten(rows: Sequence[Sequence[int]], cap: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The first `cap` ints of every row as one array, each row's count, and how many rows were cut."""
    lens = [len(r) for r in rows]
    items: Sequence[Iterable[int]] = rows
    cut = 0
    if max(lens, default=0) > cap:
        cut = sum(n > cap for n in lens)
        lens = [n if n < cap else cap for n in lens]
        items = [itertools.islice(r, cap) for r in rows]
    return np.fromiter(itertools.chain.from_iterable(items), np.int64, sum(lens)), np.asarray(lens, np.int64), cut
