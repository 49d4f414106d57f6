"""The LLM engine's plain types: configuration, step outputs, statistics, errors; and `to_host`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from tristream.engine.kv_retention import RetentionConfig, RetentionStats
from tristream.engine.sequence import FinishReason, Sequence
from tristream.engine.speculative import SpecStats, SpeculativeConfig


class UnknownSequence(KeyError):
    """The sequence id is not (or no longer) known to the engine."""


class ContextTooLong(ValueError):
    """A request does not fit in max_model_len or in the whole KV cache."""


@dataclasses.dataclass(slots=True)
class EngineConfig:
    """Engine sizing and policy."""

    block_size: int = 16
    num_blocks: int | None = None  # default: kv_cache_bytes / bytes per block
    kv_cache_bytes: int = 256 << 20
    max_model_len: int = 4096
    max_prefill_tokens: int = 512  # prefill token budget per step (chunked prefill)
    max_batch: int = 128  # decode sequences per step
    enable_prefix_cache: bool = True
    use_graphs: bool = True
    graph_buckets: tuple[int, ...] | None = None
    kv_dtype: torch.dtype | None = None  # default: the model's dtype
    triton_decode: bool | None = None  # default: on CUDA only (True on CPU needs TRITON_INTERPRET=1)
    decode_kernels: str = "auto"  # bucket 1: 'cublas', a batch-1 variant ('b1', 'b1_pdl', ...) or 'auto' (timed; graphs.py)
    packed_prefill: bool | None = None  # all prefill chunks in one batched attention (default: CUDA only)
    kv_budget_tokens: int | None = None  # default KV budget per sequence (None: no eviction); see kv_retention.py
    retention: RetentionConfig = dataclasses.field(default_factory=RetentionConfig)
    overlap: bool | None = None
    """Overlapped greedy decode (`overlap.py`): in steady decode, launch step i+1 (its token ids
    fed on the device) before waiting for step i's tokens, hiding the host side of a step
    (H200, batch 1: SmolLM2-135M 0.507 -> 0.458 ms per step, Llama-3.2-1B 0.998 -> 0.851 ms, same
    tokens: bench/results/llm_gpu_s7b.json at fdf1e72). None (the default): on for CUDA, off on CPU (nothing
    to hide there); False: off."""
    speculative: SpeculativeConfig | None = None
    """N-gram speculative decoding for greedy sequences (`speculative.py`), CPU path only, with
    overlap off. None (the default): off."""


Command = tuple[Callable[[], None], int | None]
"""A queued engine mutation and, for a cancel, the sequence id it ends (`overlap.py` applies
cancels of sequences in flight before the other commands)."""


def all_greedy(seqs: list[Sequence]) -> bool:
    """Whether every sequence samples greedily with no penalty and no mask (tokens = argmax of the logits)."""
    return all(s.params.temperature == 0 and s.params.repetition_penalty == 1.0 and s.params.logits_mask is None
               for s in seqs)


class PinnedCopy:
    """A reusable pinned host buffer and CUDA event: `start` queues an asynchronous device→host
    copy, `wait` blocks on the event (releasing the GIL, which `tolist()` on a device tensor
    does not) and returns the values. A fresh pinned allocation and event per step cost ~20-40 us
    of host time on the decode path."""

    __slots__ = ("buf", "event", "shape")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self.shape: tuple[int, ...] = ()

    def start(self, tokens: torch.Tensor) -> None:
        """Queue the copy of `tokens` (a CUDA tensor) into the buffer (grown on demand)."""
        n = tokens.numel()
        buf = self.buf
        if buf is None or buf.numel() < n or buf.dtype != tokens.dtype:
            # a normal tensor even when first made inside inference mode (the overlapped step runs
            # there): an inference tensor could not be written later outside it
            with torch.inference_mode(False):
                buf = self.buf = torch.empty(max(n, 256), dtype=tokens.dtype, pin_memory=True)
        if self.event is None:
            self.event = torch.cuda.Event()
        buf[:n].copy_(tokens.reshape(-1), non_blocking=True)
        self.event.record()
        self.shape = tuple(tokens.shape)

    def wait(self) -> list[int]:
        """The values of the last `start`, once its copy is done."""
        assert self.buf is not None and self.event is not None, "wait() before start()"
        self.event.synchronize()
        n = 1
        for d in self.shape:
            n *= d
        return self.buf[:n].view(self.shape).tolist()


class _ThreadCopy(threading.local):
    copy: PinnedCopy | None = None


_READBACK = _ThreadCopy()


def to_host(tokens: torch.Tensor) -> list[int]:
    """Token ids to a host list; on CUDA through this thread's `PinnedCopy`, so the asyncio
    thread serving sockets runs while the GPU finishes the step."""
    if tokens.device.type != "cuda":
        return tokens.tolist()
    pc = _READBACK.copy
    if pc is None:
        pc = _READBACK.copy = PinnedCopy()
    pc.start(tokens)
    return pc.wait()


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one sequence produced in one step."""

    seq_id: int
    token_id: int | None
    text: str
    finished: bool
    finish_reason: FinishReason | None = None


@dataclasses.dataclass(slots=True)
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    cancelled: int = 0
    finished: int = 0
    prefix_cached_tokens: int = 0
    context_full: int = 0  # contexts finished (LENGTH) because an append would pass max_model_len
    overlap_steps: int = 0  # decode steps launched before the previous step's tokens were read
    overlap_discarded: int = 0  # tokens of such steps dropped: their sequence finished one step earlier
    retention: RetentionStats = dataclasses.field(default_factory=RetentionStats)
    """KV retention: evicted blocks by reason, eviction events, attention probes."""
    spec: SpecStats = dataclasses.field(default_factory=SpecStats)
    """Speculative verify steps: drafts scored and accepted (`EngineConfig.speculative`)."""
    ignored: dict[str, int] = dataclasses.field(default_factory=dict)
    """Commands that found no live sequence, by kind ('append', 'start_generation', 'cancel'):
    a sequence that finished or was cancelled before the command reached the engine thread."""

    def ignore(self, kind: str) -> None:
        self.ignored[kind] = self.ignored.get(kind, 0) + 1
