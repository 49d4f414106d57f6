"""Replay of pipeline sessions on the pipeline's `VirtualClock` (used by `tristream replay --backend pipeline`)."""

from __future__ import annotations

import asyncio
from typing import Any

from tristream.serve.pipeline_backend import PipelineBackend


class ReplayStuck(RuntimeError):
    """The pipeline did not settle within the replay's real-time budget."""


class PipelineReplayDriver:
    """Replays a recording through the pipeline on its `VirtualClock` (see `serve.replay`).

    Virtual time moves in ``step_ns`` steps; before each step the driver waits (in real
    time) until every stage is idle or only the playout waits on the clock. Model work in
    threads (ASR, TTS, LLM) therefore takes zero virtual time, and the run depends only on
    the recording: latencies are the algorithmic ones (VAD hangover, playout pacing).
    """

    def __init__(self, models: Any, step_ns: int = 10_000_000, settle_timeout_s: float = 120.0) -> None:
        from tristream.sched.clock import VirtualClock

        self.models = models
        self.vc = VirtualClock(0)
        self.step_ns = step_ns
        self.settle_timeout_s = settle_timeout_s
        self.backends: list[PipelineBackend] = []

    def clock_ns(self) -> int:
        """Virtual now."""
        return int(self.vc.now_ns())

    def factory(self) -> PipelineBackend:
        """A backend whose session runs on the virtual clock."""
        b = PipelineBackend(self.models, clock=self.vc)
        self.backends.append(b)
        return b

    def _busy(self) -> bool:
        for b in self.backends:
            s = b.session
            if s is None:
                continue
            if b.busy:  # a manual-mode transcription in a worker thread
                return True
            for st in s.stages:
                if st is s.playout and st.busy and self.vc.sleepers:
                    continue  # waiting for virtual time to play the next chunk
                if st.inbox.data or st.inbox.control or st.busy:
                    return True
        return False

    async def _settle(self) -> None:
        import time

        deadline = time.monotonic() + self.settle_timeout_s
        await asyncio.sleep(0)
        while self._busy():
            if time.monotonic() > deadline:
                raise ReplayStuck(f"pipeline still busy after {self.settle_timeout_s:g} s of real time")
            await asyncio.sleep(0.001)

    async def advance_to(self, t_ns: int) -> None:
        """Step virtual time to ``t_ns``, settling before each step."""
        if not self.backends:  # nothing runs yet: jump
            self.vc.advance(max(0, t_ns - self.clock_ns()))
            return
        while self.clock_ns() < t_ns:
            await self._settle()
            self.vc.advance(min(self.step_ns, t_ns - self.clock_ns()))
        await self._settle()

    async def finish(self, max_virtual_s: float = 120.0) -> None:
        """Let answers play out (virtual time) until everything is idle."""
        end = self.clock_ns() + int(max_virtual_s * 1e9)
        await self._settle()
        while (self.vc.sleepers or self._busy()) and self.clock_ns() < end:
            self.vc.advance(self.step_ns)
            await self._settle()


def replay_models(**load_kw: Any) -> Any:
    """The embedded models with a deterministic piper voice (no synthesis noise) for replay."""
    import dataclasses

    from tristream.pipeline.models import load_models

    models = load_models(**load_kw)
    if getattr(models.tts, "name", "") == "piper":
        from tristream.stages.tts import PiperTTS

        models = dataclasses.replace(models, tts=PiperTTS(deterministic=True))
    return models
