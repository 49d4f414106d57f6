"""`EngineTextBackend`: a text-turn `SessionBackend` on one replica's `LLMEngine` (GPU or CPU).

For the scale-out benchmark on GPUs: the serving stack's pipeline backend runs the embedded
CPU models, so a replica that owns a GPU needs a backend whose work runs there. This one
answers text turns with our engine (continuous batching across the replica's sessions
through one `AsyncLLM`); with a preset name the model has random weights and no tokenizer
(answers are token ids as text, ``" t<id>"``), which is enough to load the engine the way a
real model would. Audio and frames are counted and ignored (``ignored_audio_chunks``,
``ignored_frames``). Use it as ``backend="tristream.scale.engine_backend:engine_factory"``
with ``backend_kw={"model": "llama-3.2-1b", "device": "cuda"}``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tristream.observe.events import AnswerText, EventSink, ResponseDone, ResponseStarted
from tristream.serve.backend import BackendConfig, BackendFamily, TextTurnBackend


class EngineTextBackend(TextTurnBackend):
    """One session's text turns on the replica's shared engine; see the module docstring."""

    def __init__(self, llm: Any, vocab: int, max_tokens: int) -> None:
        super().__init__()
        self.llm = llm
        self.vocab = vocab
        self.max_tokens = max_tokens
        self.history: list[int] = []
        self.pending: list[int] = []
        self._stream: Any = None

    async def start(self, config: BackendConfig, sink: EventSink) -> None:
        """Keep the sink; nothing to load per session."""
        self.sink = sink

    def update(self, config: BackendConfig) -> None:
        """Nothing to apply (text only)."""

    def push_text(self, role: str, text: str, images: list[bytes], ref_ns: int) -> None:
        """Tokens of the user text (bytes mod vocab when the model has no tokenizer)."""
        tok = getattr(self.llm.engine, "tokenizer", None)
        ids = list(tok.encode(text)) if tok is not None else [1 + b % (self.vocab - 1) for b in text.encode()]
        self.pending.extend(ids)
        if images:
            self._count("ignored_images", len(images))

    def commit_audio(self, ref_ns: int) -> None:
        """Answer pending text, like the pipeline backend does."""
        if self.pending:
            self.create_response(None, ref_ns)

    def create_response(self, instructions: str | None, ref_ns: int, modalities: list[str] | None = None) -> None:
        """Prefill history + pending text and stream the answer."""
        from tristream.engine.sequence import SamplingParams

        prompt = (self.history + self.pending)[-1024:] or [1]
        self.history = prompt
        self.pending = []
        self._emit(ResponseStarted(time.monotonic_ns()))
        self._stream = self.llm.submit(prompt, SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))
        self._task = asyncio.get_running_loop().create_task(self._answer(self._stream))

    async def _answer(self, stream: Any) -> None:
        status = "completed"
        async for d in stream:
            if d.token_id is not None:
                self.history.append(d.token_id)
                self._emit(AnswerText(d.text or f" t{d.token_id}", time.monotonic_ns()))
            if d.finished and d.finish_reason is not None and d.finish_reason.name in ("ERROR", "CANCELLED"):
                status = "failed" if d.finish_reason.name == "ERROR" else "cancelled"
        self._emit(ResponseDone(status, time.monotonic_ns()))
        self._task = None

    def _stop_answer(self) -> None:
        """The engine frees the sequence at its next step."""
        if self._stream is not None:
            self._stream.cancel()


def engine_factory(model: str = "llama-3.2-1b", device: str = "cuda", kv_bytes: int = 8 << 30,
                   max_tokens: int = 16) -> BackendFamily:
    """Load the engine once for this replica (its device) and return the per-session factory."""
    from tristream.engine.async_engine import AsyncLLM
    from tristream.sched.real import build_engine

    engine = build_engine(model, device, kv_bytes)
    llm = AsyncLLM(engine)
    vocab = int(engine.model.cfg.vocab_size)

    return BackendFamily(lambda: EngineTextBackend(llm, vocab, max_tokens), engine=llm)
