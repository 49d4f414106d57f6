"""A voice + vision session: VAD → ASR → turn-taking → LLM → TTS → playout, with barge-in.

Models come from `SharedModels` (loaded once per process); a session holds only per-user
state: the VAD/ASR/TTS/vision streams, the frame ring, the conversation and turn records.
Camera frames go into a time-indexed ring; at the end of each speech segment the frames
that overlap it (interval join) and the latest frame at its end (as-of join) are turned into
a scene description in a worker thread while the ASR final runs.

Barge-in: when the VAD decides that the user started speaking while an answer is being
generated or played, `barge_in` runs inside the input stage's handling of that very chunk:
the LLM, TTS and playout stages drop their queues and cancel their work in flight, the sink
drops the audio it buffered, and the history keeps only the text of the audio already played.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tristream.core.metrics import DropCounter
from tristream.core.ring import ObjectRing
from tristream.observe.events import AudioIn, EventSink, FrameIn, ResponseDone, ResponseStarted, SessionEvent
from tristream.pipeline.llm import ChatBackend
from tristream.pipeline.models import SharedModels
from tristream.pipeline.overlap import SpeechOverAnswer
from tristream.pipeline.prompt import DECODE, SYSTEM_PROMPT, Conversation
from tristream.pipeline.session_stages import AsrStage, InputStage, LlmStage, PlayoutStage, TtsStage
from tristream.pipeline.speculative_asr import SpeculativeRecognizer
from tristream.pipeline.stage import EndOfStream, Stage
from tristream.pipeline.turns import (
    BACKCHANNELS,
    DEFAULT_HANGOVER_MS,
    EndOfTurnDetector,
    SilenceEndOfTurn,
    TurnTaker,
    UserTurn,
)
from tristream.sched.clock import Clock, MonotonicClock


class AudioSink(Protocol):
    """Where answer audio goes: a speaker, a file, a test buffer."""

    def write(self, pcm: np.ndarray, sample_rate: int) -> None: ...

    def interrupt(self) -> None: ...


class AudioCollector:
    """A sink that keeps every piece written (for the demo's wav file and for tests)."""

    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []
        self.sample_rate = 0
        self.interrupts = 0

    def write(self, pcm: np.ndarray, sample_rate: int) -> None:
        """Keep one played chunk."""
        self.sample_rate = sample_rate
        self.pieces.append(np.asarray(pcm, dtype=np.float32))

    def interrupt(self) -> None:
        """Nothing buffered beyond the chunk already handed over; counted."""
        self.interrupts += 1

    @property
    def samples(self) -> int:
        """Samples written so far."""
        return sum(p.shape[0] for p in self.pieces)

    def audio(self) -> np.ndarray:
        """Everything written, concatenated."""
        return np.concatenate(self.pieces) if self.pieces else np.zeros(0, dtype=np.float32)


@dataclass(slots=True)
class SessionConfig:
    """Per-session settings."""

    hangover_ms: float = DEFAULT_HANGOVER_MS
    max_tokens: int = DECODE.max_tokens
    max_sentences: int = DECODE.max_sentences
    """An answer ends after this many sentences (`prompt.SentenceCut`; 0: at the token budget)."""
    system_prompt: str = SYSTEM_PROMPT
    max_history_turns: int = 2
    scene_when: str = "relevant"
    """When the camera's scene goes into the prompt: ``relevant`` (the user's words are about it), ``always``, ``never``."""
    speak: bool = True
    """Synthesise answers (the Realtime ``modalities`` include ``audio``); False: text only, no TTS."""
    out_chunk_ms: float = 20.0
    end_of_turn: EndOfTurnDetector = field(default_factory=SilenceEndOfTurn)
    semantic_turn: bool = False
    """With the silence rule as `end_of_turn`, let the shared turn model (Smart Turn) hold a
    turn open when the voice says it is unfinished (`stages.turn_model`). Off by default: on
    our labelled set of synthetic speech it still took 66 % of mid-sentence cuts for finished
    turns and held 23 % of finished ones (+164 ms per turn on average), `bench/e2e_cpu.py
    --section turn`; real recordings may judge it differently."""
    frame_ring: int = 64
    barge_in: bool = True
    """False: half duplex, microphone audio is ignored (counted) while the assistant answers
    (live speakers without echo cancellation would otherwise interrupt the assistant with itself)."""
    tts_first_words: int = 4
    """Speak the first this-many words of an answer as their own piece (0: wait for a clause)."""
    speculate_after_ms: float = 120.0
    """Start the ASR final after this much silence, during the hangover (0: off; Whisper only)."""
    echo_gate: bool = True
    """Speech over the answer interrupts it only when the microphone is louder than the echo of
    what the session played (`stages.echo`): its own voice on a speakerphone never does."""
    backchannel_max_ms: float = 1200.0
    """Speech over the answer pauses it; an acknowledgement ("mhm", "yeah") no longer than this
    resumes it, anything longer or other words interrupt it (0: every start interrupts at once).
    The voice counted includes the echo's tail after the pause (a room's reverberation and the
    line's delay: up to ~0.7 s on our simulated speakerphones), so 800 ms took a "Yeah." for a
    turn; the answer's audio is paused from the onset either way."""
    backchannels: frozenset[str] = BACKCHANNELS
    prefill_while_speaking: bool = True
    """Committed words of a streaming ASR enter the LLM's KV cache while the user speaks
    (`ChatBackend.prefill`); at the end of the turn only the tail is prefilled."""


@dataclass(slots=True)
class TurnRecord:
    """What happened in one turn, with reference-clock times (ns) for the latency table."""

    turn_id: int
    user_text: str
    speech_end_ns: int
    asr_final_ns: int
    llm_start_ns: int | None = None
    """When the prompt went to the LLM (after the scene description was ready)."""
    first_token_ns: int | None = None
    first_audio_ns: int | None = None
    llm_done_ns: int | None = None
    first_piece: str = ""
    """Text of the first synthesised piece, and the seconds its synthesis took."""
    first_piece_s: float = 0.0
    answer: str = ""
    heard: str = ""
    interrupted: bool = False
    scene: str | None = None
    status: str = ""
    """How the answer ended for the observers: ``completed``, ``cancelled``, ``failed`` ("" while it runs)."""

    def latency_ms(self) -> dict[str, float | None]:
        """End of speech → ASR final / first token / first audio, in ms."""
        def rel(t: int | None) -> float | None:
            return None if t is None else (t - self.speech_end_ns) / 1e6
        return {"asr_final": rel(self.asr_final_ns), "llm_start": rel(self.llm_start_ns),
                "first_token": rel(self.first_token_ns), "first_audio": rel(self.first_audio_ns)}


_ids = itertools.count()
_text_turns = itertools.count(1_000_000)  # typed turns: ids apart from the turn taker's


class Session:
    """One user's live conversation over shared models."""

    def __init__(self, models: SharedModels, sink: AudioSink | None = None, clock: Clock | None = None,
                 config: SessionConfig | None = None, session_id: str | None = None,
                 pool: ThreadPoolExecutor | None = None, llm: ChatBackend | None = None) -> None:
        """``llm``: this session's chat backend instead of the shared ``models.llm`` (a scheduled
        engine's per-session handle)."""
        from tristream.stages.vad import VADOptions

        self.id = session_id or f"s{next(_ids)}"
        self.models = models
        self.config = cfg = config or SessionConfig()
        self.clock: Clock = clock or MonotonicClock()
        self.sink: AudioSink = sink or AudioCollector()
        self.pool = pool or ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"session-{self.id}")
        self.vad = models.vad.stream(self.id, VADOptions(min_silence_ms=cfg.hangover_ms))
        self.spec_asr: SpeculativeRecognizer | None = None
        self.spec_after = int(cfg.speculate_after_ms * 16)
        self.streaming_asr = bool(getattr(models.asr, "streaming", False))
        """The ASR commits words while the user speaks (`asr_stream`): partials prefill the LLM,
        and its utterances speculate their final themselves."""
        if self.streaming_asr:
            self.asr = models.asr.stream(self.id)
        elif cfg.speculate_after_ms > 0 and getattr(models.asr, "name", "") == "whisper":
            from tristream.stages.asr import UtteranceStream

            self.spec_asr = SpeculativeRecognizer(models.asr)
            self.asr = UtteranceStream(self.spec_asr, self.id, partial_every_s=None)
        else:
            self.asr = models.asr.stream(self.id, partial_every_s=None)
        self.tts = models.tts.stream(self.id)
        self.scene_stream = models.vision.stream(self.id) if models.vision is not None else None
        chat = llm or models.llm
        if chat is None:
            raise ValueError("no LLM: the shared models carry none (load_models(with_llm=False)); pass Session(llm=...)")
        self.llm: ChatBackend = chat
        self._observers: list[EventSink] = []
        self.frames: ObjectRing[np.ndarray] = ObjectRing(cfg.frame_ring, name=f"{self.id}.frames")
        detector: EndOfTurnDetector = cfg.end_of_turn
        if cfg.semantic_turn and getattr(models, "turn", None) is not None and isinstance(detector, SilenceEndOfTurn):
            from tristream.stages.turn_model import SmartTurnEndOfTurn

            detector = SmartTurnEndOfTurn(models.turn)
        self._base_detector = detector
        self.turns = TurnTaker(detector)
        self.conversation = Conversation(cfg.system_prompt, cfg.max_history_turns, scene_when=cfg.scene_when)
        self.drops = DropCounter(f"{self.id}.session")
        self.records: list[TurnRecord] = []
        self.current: TurnRecord | None = None
        self.assistant_active = False
        self.pending_scene: asyncio.Future[Any] | None = None
        self.barge_ins: list[dict[str, Any]] = []
        self.clip_end_ns: list[int] = []  # known true ends of speech (file playback), for reports
        self.turn_done = asyncio.Event()
        from tristream.stages.echo import EchoGate

        self.echo = EchoGate() if cfg.echo_gate else None
        self.overlap = SpeechOverAnswer(self)
        self.prefills = 0
        """Incremental prefills started while the user spoke (`prefill_partial`)."""
        self.input = InputStage(self)
        self.asr_stage = AsrStage(self)
        self.llm_stage = LlmStage(self)
        self.tts_stage = TtsStage(self)
        self.playout = PlayoutStage(self)
        self.stages: list[Stage] = [self.input, self.asr_stage, self.llm_stage, self.tts_stage, self.playout]
        for a, b in zip(self.stages, self.stages[1:], strict=False):
            a.link(b)

    # ---- observers --------------------------------------------------------------------
    def subscribe(self, observer: EventSink) -> Callable[[], None]:
        """Call `observer` with every `SessionEvent` of this session, in order, on the loop thread
        (speech edges, transcripts, answer start, text and end); returns the unsubscribe function.
        Answer audio goes to the session's `AudioSink`."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    def publish(self, event: SessionEvent) -> None:
        """Hand one event to every observer (an observer that raises is counted, never fatal)."""
        for obs in tuple(self._observers):
            try:
                obs(event)
            except Exception:
                self.drops.add("observer_failed")

    def end_response(self, rec: TurnRecord, status: str, reason: str = "", stats: dict[str, Any] | None = None) -> None:
        """Publish the end of `rec`'s answer once (``completed``, ``cancelled`` or ``failed``)."""
        if rec.status:
            return
        rec.status = status
        self.publish(ResponseDone(status, self.clock.now_ns(), reason, stats or {}))

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        """Start the stage tasks on the running loop."""
        for st in self.stages:
            st.start()

    async def close(self) -> None:
        """Stop every stage (an answer in progress is cut, counted) and release per-session streams."""
        if self.assistant_active:
            for answer_stage in (self.llm_stage, self.tts_stage, self.playout):
                answer_stage.interrupt("session_closed")
        for st in self.stages:
            st.inbox.put_control(EndOfStream("session_closed"))
        for st in self.stages:
            await st.join()
        self.close_prefill()
        for stream in (self.vad, self.asr, self.tts, self.scene_stream):
            if stream is not None:
                stream.close()

    # ---- input ------------------------------------------------------------------------
    def push_audio(self, pcm: np.ndarray, ref_ns: int) -> bool:
        """Queue one microphone chunk (16 kHz mono); False if the input queue dropped it."""
        return self.input.inbox.put_data(AudioIn(pcm, ref_ns))

    def ask(self, text: str, speak: bool | None = None, scene: Any = None) -> bool:
        """Answer `text` as a user turn now (a typed message; spoken turns come from the audio).

        `speak`: synthesise the answer (None: `SessionConfig.speak`); `scene`: an awaitable of a
        `SceneDescription` for the prompt. False if the LLM stage's queue is full (counted)."""
        now = self.clock.now_ns()
        turn = UserTurn(next(_text_turns), text, now, now, now, scene, speak)
        if not self.llm_stage.inbox.put_data(turn):
            self.drops.add("text_turn_llm_full")
            return False
        return True

    def push_frame(self, image: np.ndarray, ref_ns: int) -> bool:
        """Queue one camera frame captured at `ref_ns`."""
        return self.input.inbox.put_data(FrameIn(image, ref_ns))

    async def settle_input(self) -> None:
        """Wait until the input stage has handled everything queued (tests, file playback)."""
        inbox = self.input.inbox
        while inbox.data or self.input.busy:
            await asyncio.sleep(0)

    # ---- vision -----------------------------------------------------------------------
    def describe_scene(self, start_ns: int | None, end_ns: int) -> asyncio.Future[Any] | None:
        """Describe the frames aligned to [start_ns, end_ns] in a worker thread (None without vision)."""
        if self.scene_stream is None:
            return None
        aligned = self.frames.window(start_ns if start_ns is not None else end_ns, end_ns + 1)
        latest = self.frames.latest_at_or_before(end_ns)
        if latest is None:
            self.drops.add("no_frame_for_turn")
            return None
        picks = ([aligned[0]] if aligned and aligned[0][0] != latest[0] else []) + [latest]
        stream = self.scene_stream

        def run() -> Any:
            desc = None
            for t, img in picks:
                desc = stream.describe(img, t)
            return desc

        return asyncio.get_running_loop().run_in_executor(self.pool, run)

    # ---- turns ------------------------------------------------------------------------
    def prefill_partial(self, text: str) -> None:
        """The user's committed words so far enter the LLM's KV cache (incremental prefill).

        The prompt is the one the turn would get if it ended now; the LLM backend keeps one open
        context per session and replaces it on each call, and its prefix cache keeps every full
        block that the new prompt shares with the old one: growing words prefill only what is
        new, and revised words roll the cache back to the first block that differs."""
        prefill = getattr(self.llm, "prefill", None)
        if prefill is None or not self.config.prefill_while_speaking or self.assistant_active or not text:
            return
        u = self.asr.decoder
        if getattr(u, "speculating", False):
            return  # the user went silent and the final is being decoded: the answer's prompt comes next
        prefill(self.id, self.conversation.prompt(self.turns.text_with(text), None))
        self.prefills += 1

    def set_turn_detection(self, silence_ms: float, eagerness: str | None = None,
                           threshold: float | None = None) -> None:
        """Change how turns end while the session runs (a client's ``turn_detection``).

        `silence_ms`: silence after speech before the turn ends; beyond the hangover the VAD
        started with (`SessionConfig.hangover_ms`) the turn taker waits the rest, and speech
        within it continues the turn; shorter values act as that hangover. `eagerness`: None for
        the silence rule alone (``server_vad``), or ``low``/``medium``/``high``/``auto`` for
        ``semantic_vad`` (`turns.SemanticEndOfTurn`: the turn model and the words may hold it).
        `threshold`: the VAD's speech probability to enter speech (its exit threshold follows,
        0.15 lower), from the next window; 0 and 1 act as 0.01 and 0.99."""
        from tristream.pipeline.turns import SemanticEndOfTurn

        if silence_ms < 0:
            raise ValueError(f"silence_ms {silence_ms}; expected >= 0")
        if threshold is not None and hasattr(self.vad, "options"):
            import dataclasses

            t = min(max(float(threshold), 0.01), 0.99)
            if t != self.vad.options.threshold:
                self.vad.options = dataclasses.replace(self.vad.options, threshold=t)
        self.turns.extra_silence_ms = max(0.0, silence_ms - self.config.hangover_ms)
        if eagerness is None:
            self.turns.detector = self._base_detector
        else:
            self.turns.detector = SemanticEndOfTurn.for_eagerness(eagerness, getattr(self.models, "turn", None))

    def close_prefill(self) -> None:
        """Close this session's open prefill context (its cached blocks stay reusable)."""
        prefill = getattr(self.llm, "prefill", None)
        if prefill is not None and self.prefills:
            prefill(self.id, None)

    def begin_turn(self, turn: UserTurn) -> TurnRecord:
        """The LLM starts answering `turn`."""
        rec = TurnRecord(turn.turn_id, turn.text, turn.speech_end_ns, turn.asr_final_ns)
        self.records.append(rec)
        self.current = rec
        self.assistant_active = True
        self.turn_done.clear()
        self.publish(ResponseStarted(self.clock.now_ns()))
        return rec

    def finish_turn(self, turn_id: int, heard: str) -> None:
        """The whole answer was played: history keeps all of it."""
        rec = self.current
        if rec is None or rec.turn_id != turn_id:
            return
        rec.heard = heard
        self.conversation.add_assistant(rec.answer)
        self.end_response(rec, "completed")
        self.current = None
        self.assistant_active = False
        self.turn_done.set()

    def barge_in(self, t_ns: int) -> None:
        """The user speaks over the answer (from `t_ns`, when the VAD heard them start): stop LLM,
        TTS and playout now; keep what was heard."""
        rec = self.current
        heard = self.playout.heard_now()
        dropped = 0
        for st in (self.llm_stage, self.tts_stage, self.playout):
            dropped += st.interrupt("barge_in")
        self.sink.interrupt()
        if rec is not None:
            rec.interrupted = True
            rec.heard = heard
            self.conversation.add_assistant(heard)
            self.end_response(rec, "cancelled", "barge_in")
        self.overlap.pending_ns = None
        self.playout.resume()
        self.barge_ins.append({"t_ns": t_ns, "at_ns": self.clock.now_ns(), "dropped": dropped,
                               "turn_id": rec.turn_id if rec else None, "heard": heard})
        self.current = None
        self.assistant_active = False
        self.turn_done.set()

    @property
    def overlaps(self) -> dict[str, int]:
        """How speech over the answer was judged (`SpeechOverAnswer.counts`)."""
        return self.overlap.counts

    def stats(self) -> dict[str, Any]:
        """Stage counters, session drops and stream counters."""
        return {"stages": [s.stats() for s in self.stages], "drops": self.drops.snapshot(),
                "speculative_asr": ({"started": self.spec_asr.started, "hits": self.spec_asr.hits,
                                     "misses": self.spec_asr.misses, "dropped": self.spec_asr.dropped}
                                    if self.spec_asr is not None else None),
                "vad": dict(self.vad.counters), "asr": dict(self.asr.counters), "tts": dict(self.tts.counters),
                "frames": self.frames.counts.snapshot(), "overlaps": dict(self.overlap.counts),
                "echo": (None if self.echo is None else {"blocks": self.echo.stats.blocks,
                                                          "with_reference": self.echo.stats.blocks_with_reference,
                                                          "user_present": self.echo.stats.blocks_user_present})}
