"""Session settings as the Realtime protocol shows them (``session.created``) and changes them.

OpenAI Realtime's pcm16 is 24 kHz mono little-endian; the extension fields
``input_audio_sample_rate`` / ``output_audio_sample_rate`` let a client use other rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tristream.pipeline.turns import DEFAULT_HANGOVER_MS
from tristream.serve.tools import choice_json

DEFAULT_SAMPLE_RATE = 24_000


@dataclass(slots=True)
class TurnDetection:
    """Server VAD settings (``session.turn_detection``); ``None`` on the session means manual commit.

    ``semantic_vad``: the same VAD, and the turn is held `EAGERNESS_HOLD_MS[eagerness]` more
    when the voice (Smart Turn) or the words say it is unfinished (`pipeline.turns.SemanticEndOfTurn`)."""

    type: str = "server_vad"
    eagerness: str = "auto"
    """``semantic_vad`` only: ``low`` waits longest, ``high`` least; ``auto`` is ``medium``."""
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = int(DEFAULT_HANGOVER_MS)  # the pipeline's measured hangover (OpenAI: 500)
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(slots=True)
class SessionSettings:
    """The session state a client can read (``session.created``) and change (``session.update``)."""

    id: str = ""
    model: str = "tristream-embedded"
    modalities: list[str] = field(default_factory=lambda: ["text", "audio"])
    instructions: str = ""  # empty: the backend's own default system prompt
    voice: str = "default"
    input_audio_format: str = "pcm16"
    output_audio_format: str = "pcm16"
    input_audio_sample_rate: int = DEFAULT_SAMPLE_RATE
    output_audio_sample_rate: int = DEFAULT_SAMPLE_RATE
    input_audio_transcription: dict[str, Any] | None = field(default_factory=lambda: {"model": "default"})
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    temperature: float = 0.8
    max_response_output_tokens: int | str = "inf"
    tier: str = "silver"
    """Extension: SLA tier of the session's turns (gold / silver / bronze); capped by the auth token."""
    tools: list[Any] = field(default_factory=list)
    """Function tools (`serve.tools.ToolSpec`) the answers may call."""
    tool_choice: str = "auto"
    """'auto', 'none', 'required' or a tool's name."""
    api: str = "beta"
    """Event names and session shape sent to the client: ``"beta"`` or ``"ga"`` (`serve.ga`); not in `to_json`."""

    def to_json(self) -> dict[str, Any]:
        """The ``session`` object as OpenAI clients expect it (plus the ``input_audio_sample_rate`` extension)."""
        td = None
        if self.turn_detection is not None:
            t = self.turn_detection
            td = {"type": t.type, "eagerness": t.eagerness} if t.type == "semantic_vad" else {
                "type": "server_vad",
                "threshold": t.threshold,
                "prefix_padding_ms": t.prefix_padding_ms,
                "silence_duration_ms": t.silence_duration_ms,
            }
            td = {**td, "create_response": t.create_response, "interrupt_response": t.interrupt_response}
        return {
            "id": self.id,
            "object": "realtime.session",
            "model": self.model,
            "modalities": list(self.modalities),
            "instructions": self.instructions,
            "voice": self.voice,
            "input_audio_format": self.input_audio_format,
            "output_audio_format": self.output_audio_format,
            "input_audio_sample_rate": self.input_audio_sample_rate,
            "output_audio_sample_rate": self.output_audio_sample_rate,
            "input_audio_transcription": self.input_audio_transcription,
            "turn_detection": td,
            "tools": [t.to_json() for t in self.tools],
            "tool_choice": choice_json(self.tool_choice),
            "temperature": self.temperature,
            "max_response_output_tokens": self.max_response_output_tokens,
            "tier": self.tier,
        }
