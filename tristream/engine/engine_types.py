"""The LLM engine's plain types: configuration, step outputs, statistics, errors; and `to_host`."""

from __future__ import annotations

import dataclasses

import torch

from tristream.engine.kv_retention import RetentionConfig, RetentionStats
from tristream.engine.sequence import FinishReason


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
    decode_kernels: str = "auto"  # small decode buckets: 'fused', 'cublas', 'b1', 'b1_pdl' or 'auto' (timed; graphs.py)
    packed_prefill: bool | None = None  # all prefill chunks in one batched attention (default: CUDA only)
    kv_budget_tokens: int | None = None  # default KV budget per sequence (None: no eviction); see kv_retention.py
    retention: RetentionConfig = dataclasses.field(default_factory=RetentionConfig)


def to_host(tokens: torch.Tensor) -> list[int]:
    """Token ids to a host list. On CUDA: an asynchronous copy into pinned memory and a wait on
    an event, which releases the GIL (`tolist()` on a device tensor blocks holding it), so
    the asyncio thread serving sockets runs while the GPU finishes the step."""
    if tokens.device.type != "cuda":
        return tokens.tolist()
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()


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
    retention: RetentionStats = dataclasses.field(default_factory=RetentionStats)
    """KV retention: evicted blocks by reason, eviction events, attention probes."""
    ignored: dict[str, int] = dataclasses.field(default_factory=dict)
    """Commands that found no live sequence, by kind ('append', 'start_generation', 'cancel'):
    a sequence that finished or was cancelled before the command reached the engine thread."""

    def ignore(self, kind: str) -> None:
        self.ignored[kind] = self.ignored.get(kind, 0) + 1
