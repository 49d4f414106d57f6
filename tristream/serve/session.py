"""`RealtimeSession`: one client's protocol state machine, independent of the socket.

It validates each client message (size, rate, schema, order), drives the session's
`SessionBackend`, and turns backend events into Realtime API server events with OpenAI's
item/response ids. Output goes through a ``send`` callable (the server's bounded outbox, a
replay collector, a test list). Every message in and every event out is also handed to an
optional ``tap`` (the MCAP recorder) with its reference time. Nothing here blocks or
sleeps; time comes from an injected clock, so replay runs the same code on a virtual clock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tristream.observe.events import (
    SPEECH_RATE,
    AnswerAudio,
    AnswerText,
    EncodedFrame,
    ResponseDone,
    ResponseStarted,
    SessionEvent,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptDone,
)
from tristream.serve import protocol as P
from tristream.serve.audio import decode_pcm16, encode_pcm16_b64, input_resampler
from tristream.serve.backend import BackendConfig, SessionBackend
from tristream.serve.ga import API_GA, to_ga
from tristream.serve.limits import ServerLimits, TokenBucket
from tristream.serve.media import MediaError
from tristream.serve.metrics import ServeMetrics
from tristream.serve.session_calls import ResponseCalls, check_tool_changes, function_item, tool_choice
from tristream.serve.tools import FunctionCallDelta, FunctionCallDone

log = logging.getLogger("tristream.serve")
BACKEND_RATE = SPEECH_RATE
MAX_STREAMS = 16  # distinct media streams (audio + camera stream_ids) one session may open
Tap = Callable[[str, str, int], None]  # direction ("in"/"out"), JSON text, ref_ns


@dataclass(slots=True)
class TurnTiming:
    """Reference times (ns) of one turn's milestones; 0 = not reached."""

    speech_started: int = 0
    speech_stopped: int = 0
    requested: int = 0
    transcript_done: int = 0
    response_started: int = 0
    first_text: int = 0
    first_audio: int = 0
    done: int = 0
    status: str = ""

    def base_ns(self, milestone: str) -> int:
        """What a milestone's latency counts from: the end of speech, or for the answer a later
        ``response.create`` (manual mode, ``create_response: false``), whichever came last."""
        if milestone == "transcript_done":
            return self.speech_stopped or self.requested or self.response_started
        return max(self.speech_stopped, self.requested) or self.response_started

    def latencies_ms(self) -> dict[str, float]:
        """End-of-speech-relative latencies in ms (only those reached)."""
        out: dict[str, float] = {}
        for name in ("transcript_done", "first_text", "first_audio", "done"):
            t, base = getattr(self, name), self.base_ns(name)
            if base and t:
                out[f"eos_to_{name}_ms"] = (t - base) / 1e6
        return out


FULL_PLAY_SLACK_MS = 20  # a truncation this close to the end is the whole answer (clients round down)
MAX_ITEMS = 512  # item ids a session remembers (conversation.item.truncate of an older one is an error)


@dataclass(slots=True)
class _Said:
    """A finished assistant message item, as far as truncation needs it."""

    text: str
    audio_ms: float
    answer: Any = None
    """The backend's key of this answer (`truncate_answer`); None: the backend keeps no history of it."""


@dataclass(slots=True)
class _Response:
    id: str
    item_id: str
    modalities: list[str]
    text: list[str] = field(default_factory=list)
    audio_samples: int = 0
    message_index: int | None = None  # output_index of the message item once announced
    outputs: list[dict[str, Any]] = field(default_factory=list)  # finished output items, in order
    calls: ResponseCalls | None = None
    next_index: int = 0
    metadata: dict[str, str] | None = None
    cancel_asked: bool = False  # response.cancel came for it (else a cancel is the turn detection's)
    truncate_ms: int | None = None  # conversation.item.truncate came while it ran: applied at its end

    def alloc(self) -> int:
        """The next output_index."""
        self.next_index += 1
        return self.next_index - 1


class RealtimeSession:
    """One Realtime API session over any transport; see the module docstring."""

    def __init__(
        self,
        session_id: str,
        backend: SessionBackend,
        send: Callable[[dict[str, Any]], None],
        clock_ns: Callable[[], int],
        limits: ServerLimits | None = None,
        metrics: ServeMetrics | None = None,
        tap: Tap | None = None,
        on_turn: Callable[[TurnTiming], None] | None = None,
        tier_cap: str | None = None,
    ) -> None:
        """``tier_cap``: the best SLA tier the client's token allows (its default tier too)."""
        self.id = session_id
        self.backend = backend
        self._send_raw = send
        self.clock_ns = clock_ns
        self.limits = limits or ServerLimits()
        self.metrics = metrics or ServeMetrics()
        self.tap = tap
        self.on_turn = on_turn
        self.settings = P.SessionSettings(id=session_id)
        self.tier_cap = tier_cap
        if tier_cap is not None:
            self.settings.tier = tier_cap
        now_s = clock_ns() / 1e9
        self._msg_bucket = TokenBucket(self.limits.max_messages_per_s, self.limits.burst_messages, now_s)
        self._byte_bucket = TokenBucket(self.limits.max_bytes_per_s, self.limits.burst_bytes, now_s)
        self._item_id: str | None = None
        self._last_item_id: str | None = None
        self._response: _Response | None = None
        self._uncommitted_ms = 0.0
        self._transcript_sent = ""
        self.turn = TurnTiming()
        self.turns: list[TurnTiming] = []
        self.started_ns = clock_ns()
        self.closed = False
        self._last_ts: dict[str, int] = {}  # newest capture_ts_us per media stream
        self._in_item = False
        self._next_modalities: list[str] | None = None  # of the answer a response.create asked for
        self._in_rate: Any = None  # client audio -> the session's speech rate (`input_resampler`)
        self._next_metadata: dict[str, str] | None = None  # of the answer a response.create asked for
        self._items: OrderedDict[str, _Said | None] = OrderedDict()  # recent item ids; assistant messages: what was said

    @property
    def responding(self) -> bool:
        """Whether an answer is in progress (between ``response.created`` and ``response.done``)."""
        return self._response is not None

    # ------------------------------------------------------------------ output
    def send(self, event: dict[str, Any]) -> None:
        """Emit one server event (to the transport and the tap), in the session's API shape."""
        if self.closed:
            self.metrics.inc("tristream_events_dropped_total", reason="session_closed")
            return
        for ev in (to_ga(event) if self.settings.api == API_GA else (event,)):
            if self.tap is not None:
                self.tap("out", P.dumps(ev), self.clock_ns())
            self.metrics.inc("tristream_events_out_total", type=ev["type"])
            self._send_raw(ev)

    def send_error(self, err: P.ProtocolError) -> None:
        """Emit an ``error`` event and count it by code."""
        self.metrics.inc("tristream_client_errors_total", code=err.code)
        self.send(P.error_event(err))

    def _backend_config(self) -> BackendConfig:
        s = self.settings
        td = s.turn_detection
        return BackendConfig(
            instructions=s.instructions, modalities=list(s.modalities), sample_rate=BACKEND_RATE,
            output_sample_rate=s.output_audio_sample_rate, vad=td is not None,
            vad_threshold=td.threshold if td else 0.5,
            prefix_padding_ms=td.prefix_padding_ms if td else 300,
            silence_duration_ms=td.silence_duration_ms if td else 500,
            eagerness=td.eagerness if td is not None and td.type == "semantic_vad" else None,
            create_response=td.create_response if td else False,
            interrupt_response=td.interrupt_response if td else False,
            tier=s.tier,
        )

    async def open(self) -> None:
        """Start the backend and greet the client with ``session.created``."""
        await self.backend.start(self._backend_config(), self.on_backend_event)
        self.send(P.server_event("session.created", session=self.settings.to_json()))

    # ------------------------------------------------------------------- input
    def handle_message(self, raw: str | bytes) -> None:
        """Process one client message; protocol errors become ``error`` events."""
        now = self.clock_ns()
        size = len(raw)
        if self.tap is not None:
            self.tap("in", raw if isinstance(raw, str) else raw.decode("utf-8", "replace"), now)
        self.metrics.inc("tristream_messages_in_total")
        self.metrics.inc("tristream_bytes_in_total", size)
        try:
            if size > self.limits.max_message_bytes:
                raise P.ProtocolError(P.E_TOO_LARGE, f"message has {size} bytes; the limit is "
                                      f"{self.limits.max_message_bytes} (split audio into smaller appends)")
            now_s = now / 1e9
            if not self._msg_bucket.take(1, now_s) or not self._byte_bucket.take(size, now_s):
                self.metrics.inc("tristream_messages_dropped_total", reason="rate_limited")
                raise P.ProtocolError(P.E_RATE_LIMITED, f"rate limit: at most {self.limits.max_messages_per_s:g} "
                                      f"messages/s and {self.limits.max_bytes_per_s:g} bytes/s; message dropped")
            ev = P.parse_client_event(raw)
            self._dispatch(ev, now)
        except P.ProtocolError as err:
            if err.code != P.E_RATE_LIMITED:
                self.metrics.inc("tristream_messages_dropped_total", reason=err.code)
            self.send_error(err)
        except MediaError as exc:  # the backend's decoder refused the media: the client's fault, coded
            self.metrics.inc("tristream_messages_dropped_total", reason="undecodable_media")
            param, self._in_item = ("item.content" if self._in_item else "frame"), False
            self.send_error(P.ProtocolError(P.E_INVALID_VALUE, f"media could not be decoded: {exc}", param))
        except Exception as exc:  # a backend failing on one input must not end the session
            log.exception("session %s: backend failed on a client message", self.id)
            self.metrics.inc("tristream_messages_dropped_total", reason="backend_error")
            failure = P.ProtocolError(P.E_SERVER_ERROR, f"the server failed to process this message "
                                      f"({type(exc).__name__}: {exc}); the session goes on")
            failure.error_type = "server_error"
            self.send_error(failure)

    def push_audio(self, pcm: Any, rate: int, capture_ts_us: int | None = None) -> None:
        """int16 mono audio at `rate` from a media transport (a WebRTC track), as an
        ``input_audio_buffer.append`` would bring it."""
        if self.closed:
            return
        if self._in_rate is None or self._in_rate.rate_in != rate:
            self._in_rate = input_resampler(rate, BACKEND_RATE)
        self.backend.push_audio(self._in_rate.push(pcm), self.clock_ns(), capture_ts_us)
        self._uncommitted_ms += pcm.size * 1000 / rate

    def push_video(self, rgb: Any, capture_ts_us: int, stream_id: str = "camera") -> None:
        """One RGB frame (uint8 [h, w, 3]) captured at `capture_ts_us` (client clock) from a media
        transport (a WebRTC video track), as ``tristream.input_video_frame.append`` would bring it."""
        if self.closed:
            return
        self._dispatch(P.VideoFrameAppend(None, rgb.tobytes(), "rgb24", capture_ts_us, int(rgb.shape[1]),
                                          int(rgb.shape[0]), stream_id), self.clock_ns())

    def _dispatch(self, ev: P.ClientEvent, now: int) -> None:
        self._in_item = False
        stream: str | None = None
        ts = 0
        if isinstance(ev, (P.AudioAppend, P.VideoFrameAppend)) and ev.capture_ts_us is not None:
            ts = ev.capture_ts_us
            stream = "audio" if isinstance(ev, P.AudioAppend) else f"video:{ev.stream_id}"
            last = self._last_ts.get(stream)
            if last is not None and ev.capture_ts_us < last:
                raise P.ProtocolError(P.E_INVALID_VALUE, f"capture_ts_us went backwards on {stream} "
                                      f"({ev.capture_ts_us} < {last}); media must come in capture order",
                                      "capture_ts_us", ev.event_id)
            if stream not in self._last_ts and len(self._last_ts) >= MAX_STREAMS:
                raise P.ProtocolError(P.E_INVALID_VALUE, f"at most {MAX_STREAMS} media streams per session",
                                      "stream_id", ev.event_id)
        if isinstance(ev, P.AudioAppend):
            pcm = decode_pcm16(ev.pcm)
            rate = self.settings.input_audio_sample_rate
            if self._in_rate is None or self._in_rate.rate_in != rate:  # the client may change its rate
                self._in_rate = input_resampler(rate, BACKEND_RATE)
            self.backend.push_audio(self._in_rate.push(pcm), now, ev.capture_ts_us)
            self._uncommitted_ms += pcm.size * 1000 / rate
        elif isinstance(ev, P.VideoFrameAppend):
            self.backend.push_frame(EncodedFrame(ev.data, ev.format, ev.capture_ts_us, ev.width, ev.height,
                                               ev.stream_id, now))
        if stream is not None:  # only media that was taken moves its stream's clock
            self._last_ts[stream] = ts
        elif isinstance(ev, P.SessionUpdate):
            tier = ev.changes.get("tier")
            if tier is not None and self.tier_cap is not None and \
                    P.TIER_NAMES.index(tier) < P.TIER_NAMES.index(self.tier_cap):
                raise P.ProtocolError(P.E_TIER_NOT_ALLOWED, f"this token allows tier '{self.tier_cap}' at best; "
                                      f"'{tier}' needs another token", "session.tier", ev.event_id)
            check_tool_changes(ev.changes, self.settings.tools, self.settings.tool_choice, self.tool_state,
                               ev.event_id)
            for key, val in ev.changes.items():
                setattr(self.settings, key, val)
            ts = self.tool_state
            if ts is not None:
                ts.tools, ts.choice = list(self.settings.tools), self.settings.tool_choice
            if ev.api is not None:  # mirror the client: GA-shaped updates get GA events back
                self.settings.api = ev.api
            self.backend.update(self._backend_config())
            self.send(P.server_event("session.updated", session=self.settings.to_json()))
        elif isinstance(ev, P.AudioCommit):
            if self._uncommitted_ms < 100:
                raise P.ProtocolError(P.E_EMPTY_BUFFER, f"buffer too small: {self._uncommitted_ms:.0f} ms of "
                                      "audio; commit needs at least 100 ms", None, ev.event_id)
            item = self._item_id or P.new_id("item")
            self._commit(item)
            self.turn.speech_stopped = self.turn.speech_stopped or now
            self.backend.commit_audio(now)
        elif isinstance(ev, P.AudioClear):
            self._uncommitted_ms = 0.0
            self.backend.clear_audio(now)
            self.send(P.server_event("input_audio_buffer.cleared"))
        elif isinstance(ev, P.ItemCreate):
            self._in_item = True  # the backend decodes images first: a bad one refuses the whole item
            self.backend.push_text(ev.role, "\n".join(ev.texts), [im.data for im in ev.images], now)
            self._in_item = False
            item_id = ev.item_id or P.new_id("item")
            content = [{"type": "input_text", "text": t} for t in ev.texts]
            content += [{"type": "input_image", "image_url": f"<{len(im.data)} bytes {im.mime}>"} for im in ev.images]
            self.send(P.server_event("conversation.item.created", previous_item_id=self._last_item_id,
                                     item={"id": item_id, "object": "realtime.item", "type": "message",
                                           "status": "completed", "role": ev.role, "content": content}))
            self._last_item_id = item_id
            self._remember(item_id)
        elif isinstance(ev, (P.FunctionOutputCreate, P.FunctionCallCreate)):
            item_id = ev.item_id or P.new_id("item")
            fitem = function_item(ev, self.tool_state, item_id)
            self.send(P.server_event("conversation.item.created", previous_item_id=self._last_item_id, item=fitem))
            self._last_item_id = item_id
            self._remember(item_id)
        elif isinstance(ev, P.ResponseCreate):
            if self._response is not None:
                raise P.ProtocolError(P.E_RESPONSE_ACTIVE, f"response {self._response.id} is still in progress; "
                                      "send response.cancel first or wait for response.done", None, ev.event_id)
            if ev.tool_choice is not None:
                choice = tool_choice(ev.tool_choice, self.settings.tools, "response.tool_choice", ev.event_id)
                ts = self.tool_state
                if ts is not None:
                    ts.next_choice = choice
            if not self.turn.speech_stopped:
                self.turn = TurnTiming(requested=now)
            else:  # a committed turn answered on request: the answer's latency counts from here
                self.turn.requested = now
            self._next_modalities = list(ev.modalities) if ev.modalities else None
            self._next_metadata = ev.metadata
            self.backend.create_response(ev.instructions, now, modalities=self._next_modalities)
        elif isinstance(ev, P.ResponseCancel):
            if self._response is None or (ev.response_id and ev.response_id != self._response.id):
                raise P.ProtocolError(P.E_NO_ACTIVE_RESPONSE, "no response in progress to cancel"
                                      + (f" with id {ev.response_id}" if ev.response_id else ""),
                                      "response_id" if ev.response_id else None, ev.event_id)
            self._response.cancel_asked = True
            self.backend.cancel_response(now)
        elif isinstance(ev, P.ItemTruncate):
            self._truncate(ev)

    # ---------------------------------------------------------------- truncate
    def _remember(self, item_id: str, said: _Said | None = None) -> None:
        self._items[item_id] = said
        self._items.move_to_end(item_id)
        while len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)

    def _truncate(self, ev: P.ItemTruncate) -> None:
        """``conversation.item.truncate``: the user heard only ``audio_end_ms`` of an assistant item; what
        the backend remembers of it (its conversation history) is cut to the words of that audio. An item
        without audio (a user message, a call, a text answer) is left as it is; an unknown id is an error."""
        resp = self._response
        if resp is not None and resp.item_id == ev.item_id:  # still running: cut when it ends
            resp.truncate_ms = ev.audio_end_ms
        elif ev.item_id not in self._items:
            raise P.ProtocolError(P.E_INVALID_VALUE, f"no item with id {ev.item_id!r} in this conversation "
                                  f"(it knows the latest {MAX_ITEMS} items)", "item_id", ev.event_id)
        else:
            said = self._items[ev.item_id]
            if said is not None:
                self._cut(said, ev.audio_end_ms)
        self.send(P.server_event("conversation.item.truncated", item_id=ev.item_id, content_index=ev.content_index,
                                 audio_end_ms=ev.audio_end_ms))

    def _cut(self, said: _Said, audio_end_ms: int) -> None:
        if audio_end_ms >= said.audio_ms - FULL_PLAY_SLACK_MS or not said.audio_ms:
            return  # all of it played (or no audio): nothing to forget
        cut = getattr(self.backend, "truncate_answer", None)
        if cut is not None and said.answer is not None:
            said.text = cut(said.answer, audio_end_ms)
        else:  # no backend history of it: the session's own record, in proportion to the audio played
            words = said.text.split()
            said.text = " ".join(words[:int(len(words) * audio_end_ms / said.audio_ms)])
        said.audio_ms = float(audio_end_ms)
        self.metrics.inc("tristream_truncations_total")

    # ------------------------------------------------------------------- tools
    @property
    def tool_state(self) -> Any:
        """The backend's `tool_session.ToolState` (None: this backend cannot call tools)."""
        return getattr(self.backend, "tool_state", None)

    def _on_call(self, ev: FunctionCallDelta | FunctionCallDone) -> None:
        resp = self._active("function_call")
        if resp is None:
            return
        if resp.calls is None:
            resp.calls = ResponseCalls(resp.id, self.send, resp.alloc)
        if isinstance(ev, FunctionCallDelta):
            resp.calls.delta(ev)
            return
        item = resp.calls.done(ev)
        resp.outputs.append(item)
        self._last_item_id = item["id"]
        self.metrics.inc("tristream_tool_calls_total", status=item["status"])

    def _announce_message(self, resp: _Response) -> None:
        if resp.message_index is None:
            resp.message_index = resp.alloc()
            self.send(P.server_event("response.output_item.added", response_id=resp.id,
                                     output_index=resp.message_index, item=self._out_item(resp, "in_progress")))

    def _commit(self, item_id: str) -> None:
        self._uncommitted_ms = 0.0
        self.send(P.server_event("input_audio_buffer.committed", previous_item_id=self._last_item_id,
                                 item_id=item_id))
        self.send(P.server_event("conversation.item.created", previous_item_id=self._last_item_id,
                                 item={"id": item_id, "object": "realtime.item", "type": "message",
                                       "status": "completed", "role": "user",
                                       "content": [{"type": "input_audio", "transcript": None}]}))
        self._last_item_id = item_id
        self._item_id = item_id
        self._remember(item_id)

    # ----------------------------------------------------------------- backend
    def on_backend_event(self, ev: SessionEvent) -> None:
        """Translate one backend event into server events (called on the loop thread)."""
        now = self.clock_ns()
        if isinstance(ev, SpeechStarted):
            self._item_id = P.new_id("item")
            self.turn = TurnTiming(speech_started=now)
            self.send(P.server_event("input_audio_buffer.speech_started", audio_start_ms=ev.audio_ms,
                                     item_id=self._item_id))
        elif isinstance(ev, SpeechStopped):
            item = self._item_id or P.new_id("item")
            self.turn.speech_stopped = now
            self.send(P.server_event("input_audio_buffer.speech_stopped", audio_end_ms=ev.audio_ms, item_id=item))
            self._commit(item)
        elif isinstance(ev, TranscriptDelta):
            # Backends report the hypothesis so far; the protocol's deltas are increments.
            if ev.text.startswith(self._transcript_sent):
                inc = ev.text[len(self._transcript_sent):]
                if inc:
                    self._transcript_sent = ev.text
                    self.send(P.server_event("conversation.item.input_audio_transcription.delta",
                                             item_id=self._item_id or "", content_index=0, delta=inc))
            else:  # the ASR revised earlier words: the completed event carries the final text
                self.metrics.inc("tristream_transcript_revisions_total")
        elif isinstance(ev, TranscriptDone) and ev.error:
            self._transcript_sent = ""
            self.metrics.inc("tristream_transcription_failures_total")
            self.send(P.server_event("conversation.item.input_audio_transcription.failed",
                                     item_id=self._item_id or "", content_index=0,
                                     error={"type": "transcription_error", "code": "asr_failed",
                                            "message": ev.error}))
        elif isinstance(ev, TranscriptDone):
            self._transcript_sent = ""
            self.turn.transcript_done = now
            extra: dict[str, Any] = {}
            if ev.words is not None:  # extension: word times (ms of the session's input audio)
                extra["x_tristream"] = {"words": [{"word": w, "start_ms": a, "end_ms": b} for w, a, b in ev.words]}
            self.send(P.server_event("conversation.item.input_audio_transcription.completed",
                                     item_id=self._item_id or "", content_index=0, transcript=ev.text, **extra))
        elif isinstance(ev, ResponseStarted):
            mods, self._next_modalities = self._next_modalities or list(self.settings.modalities), None
            resp = _Response(P.new_id("resp"), P.new_id("item"), mods, metadata=self._next_metadata)
            self._next_metadata = None
            self._response = resp
            self.turn.response_started = now
            self.send(P.server_event("response.created", response=P.response_object(
                resp.id, "in_progress", [], resp.modalities, resp.metadata)))
            # the message item is announced with its first text or audio: an answer may be a call only
        elif isinstance(ev, AnswerText):
            tresp = self._active("text")
            if tresp is None:
                return
            self._on_text(tresp, ev, now)
        elif isinstance(ev, AnswerAudio):
            aresp = self._active("audio")
            if aresp is None:
                return
            if "audio" not in aresp.modalities:  # a text-only answer: audio never goes out
                self.metrics.inc("tristream_events_dropped_total", reason="audio_in_text_response")
                return
            self._on_audio(aresp, ev, now)
        elif isinstance(ev, ResponseDone):
            self._finish_response(ev, now)
        elif isinstance(ev, (FunctionCallDelta, FunctionCallDone)):
            self._on_call(ev)

    def _on_text(self, resp: _Response, ev: AnswerText, now: int) -> None:
        self._announce_message(resp)
        resp.text.append(ev.text)
        if not self.turn.first_text:
            self.turn.first_text = now
        kind = "response.audio_transcript.delta" if "audio" in resp.modalities else "response.text.delta"
        self.send(P.server_event(kind, response_id=resp.id, item_id=resp.item_id, output_index=resp.message_index,
                                 content_index=0, delta=ev.text))

    def _on_audio(self, resp: _Response, ev: AnswerAudio, now: int) -> None:
        self._announce_message(resp)
        if not self.turn.first_audio:
            self.turn.first_audio = now
        resp.audio_samples += int(ev.pcm.size)
        self.send(P.server_event("response.audio.delta", response_id=resp.id, item_id=resp.item_id,
                                 output_index=resp.message_index, content_index=0, delta=encode_pcm16_b64(ev.pcm)))

    def _active(self, what: str) -> _Response | None:
        if self._response is None:
            self.metrics.inc("tristream_events_dropped_total", reason=f"{what}_without_response")
        return self._response

    def _out_item(self, resp: _Response, status: str) -> dict[str, Any]:
        text = "".join(resp.text)
        part: dict[str, Any] = ({"type": "audio", "transcript": text} if "audio" in resp.modalities
                                else {"type": "text", "text": text})
        return {"id": resp.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": [part] if resp.text or status != "in_progress" else []}

    def _finish_response(self, ev: ResponseDone, now: int) -> None:
        resp = self._response
        if resp is None:
            self.metrics.inc("tristream_events_dropped_total", reason="done_without_response")
            return
        self._response = None
        shed = ev.stats.get("shed") if ev.status == "failed" else None
        if shed:  # the scheduler dropped this answer under load: say why, the session goes on
            failure = P.ProtocolError(P.E_SHED, f"the scheduler shed this answer: {shed} (tier "
                                      f"{ev.stats.get('tier', self.settings.tier)}); the server is overloaded, "
                                      "retry later or use a higher tier")
            failure.error_type = "server_error"
            self.send_error(failure)
        elif ev.status == "failed":  # the engine failed under this answer: say so, the session goes on
            failure = P.ProtocolError(P.E_SERVER_ERROR, f"the answer failed ({ev.reason or 'engine error'}); "
                                      "the session goes on: send response.create or speak again")
            failure.error_type = "server_error"
            self.send_error(failure)
        text = "".join(resp.text)
        status = ev.status
        if resp.calls is not None:  # calls cut off (cancelled, failed) end incomplete
            resp.outputs += resp.calls.cut_off()
        output = list(resp.outputs)
        if resp.message_index is not None or not resp.calls:  # a call-only answer has no message item
            self._announce_message(resp)
            common = {"response_id": resp.id, "item_id": resp.item_id, "output_index": resp.message_index,
                      "content_index": 0}
            if "audio" in resp.modalities:
                self.send(P.server_event("response.audio.done", **common))
                self.send(P.server_event("response.audio_transcript.done", transcript=text, **common))
            else:
                self.send(P.server_event("response.text.done", text=text, **common))
            item = self._out_item(resp, "completed" if status == "completed" else "incomplete")
            self.send(P.server_event("response.output_item.done", response_id=resp.id,
                                     output_index=resp.message_index, item=item))
            output.insert(min(resp.message_index or 0, len(output)), item)
            rate = self.settings.output_audio_sample_rate
            said = _Said(text, resp.audio_samples * 1000 / rate, getattr(self.backend, "last_answer", None))
            self._remember(resp.item_id, said)
            if resp.truncate_ms is not None:
                self._cut(said, resp.truncate_ms)
        for out_item in resp.outputs:
            self._remember(out_item["id"])
        t = self.turn
        t.done = now
        t.status = status
        lat = t.latencies_ms()
        robj = P.response_object(resp.id, status, output, resp.modalities, resp.metadata,
                                 "client_cancelled" if resp.cancel_asked else "turn_detected")
        if status == "failed":
            robj["status_details"] = {"type": "failed", "reason": f"shed:{shed}" if shed else "engine_error",
                                      "error": {"type": "server_error", "code": P.E_SHED if shed else P.E_SERVER_ERROR,
                                                "message": ev.reason}}
        self.send(P.server_event("response.done",
                                 response=robj,
                                 x_tristream={"latency_ms": lat, "audio_samples": resp.audio_samples}))
        for name, key in (("tristream_eos_to_first_text_seconds", "first_text"),
                          ("tristream_eos_to_first_audio_seconds", "first_audio"),
                          ("tristream_eos_to_transcript_seconds", "transcript_done")):
            base = t.base_ns(key)
            if base and getattr(t, key):
                self.metrics.observe_ns(name, getattr(t, key) - base)
        self.metrics.inc("tristream_responses_total", status=status)
        self.turns.append(t)
        if self.on_turn is not None:
            self.on_turn(t)
        self.turn = TurnTiming()

    async def close(self) -> None:
        """Stop the backend; further events are dropped (and counted)."""
        if self._response is not None:
            self.backend.cancel_response(self.clock_ns())
        await self.backend.close()
        self.closed = True
