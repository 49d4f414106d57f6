"""The five stages of a voice session: input (VAD + frames), ASR + turns, LLM, TTS, playout.

Each stage is a `Stage` of the runtime in `stage.py`; they talk through their inboxes and
call back into their `Session` (`session.py`) for shared per-session state: conversation,
turn records, the frame ring and barge-in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tristream.observe.events import (
    AnswerText,
    AudioIn,
    FrameIn,
    ReplyEnd,
    SilenceOnset,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptDone,
)
from tristream.pipeline.inbox import OverflowPolicy
from tristream.pipeline.llm import EngineStepError, LlmEndpointError
from tristream.pipeline.prompt import SentenceCut
from tristream.pipeline.stage import Stage
from tristream.pipeline.turns import HeardText, UserTurn

if TYPE_CHECKING:
    from tristream.pipeline.session import Session

log = logging.getLogger("tristream.pipeline")
SAMPLE_RATE = 16_000  # the session's input audio (`AudioIn`)


class InputStage(Stage):
    """Runs the VAD on each chunk (sub-ms), files frames in the ring, triggers barge-in."""

    def __init__(self, session: Session) -> None:
        super().__init__("input", capacity=256, policy=OverflowPolicy.DROP_OLDEST)
        self.s = session
        self._silence_marked = False
        self._recent = np.zeros(8 * SAMPLE_RATE, dtype=np.float32)  # the last 8 s (a turn model's input)
        self._recent_end = 0

    def process(self, item: Any) -> None:
        s = self.s
        if type(item) is FrameIn:
            if not s.frames.append(item.ref_ns, item.image):
                s.drops.add("frame_late_or_full")
            return
        if s.assistant_active and not s.config.barge_in:
            # half duplex (live speakers without echo cancellation): the assistant would hear itself
            s.drops.add("half_duplex_muted")
            return
        vad = s.vad
        if s.echo is not None:  # is it the user or the echo of the answer? (judged at barge-in)
            s.echo.process(item.pcm, item.ref_ns)
        vad.push(item.pcm, item.ref_ns)
        self._keep(item.pcm)
        self.emit(item)
        for ev in vad.poll():
            if ev.kind == "start" and s.assistant_active:
                s.overlap.begin(ev.decided_ns)
            ms = int(ev.sample_index * 1000 // SAMPLE_RATE)
            s.publish(SpeechStarted(ms, s.clock.now_ns()) if ev.kind == "start" else SpeechStopped(ms, s.clock.now_ns()))
            self.emit(ev)
        if s.overlap.open:
            s.overlap.judge(vad.speaking, vad.silence_start is None)
        if s.spec_asr is not None or s.streaming_asr:
            self._mark_silence(vad)

    def _keep(self, pcm: np.ndarray) -> None:
        n = self._recent.shape[0]
        x = pcm[-n:]
        idx = (self._recent_end + np.arange(x.shape[0])) % n
        self._recent[idx] = x
        self._recent_end += x.shape[0]

    def recent_audio(self) -> np.ndarray:
        """The last 8 s of microphone audio (fewer at the start), oldest first."""
        n = self._recent.shape[0]
        k = min(self._recent_end, n)
        idx = (self._recent_end - k + np.arange(k)) % n
        return self._recent[idx]

    def _mark_silence(self, vad: Any) -> None:
        # the VAD's silence-candidate start inside speech
        temp_end = vad.silence_start
        if vad.speaking and temp_end is not None:
            if not self._silence_marked and vad.clock.total - temp_end >= self.s.spec_after:
                self._silence_marked = True
                self.emit(SilenceOnset(int(temp_end), int(vad.clock.ns_at(temp_end))))
        elif self._silence_marked:
            self._silence_marked = False
            if vad.speaking:
                self.emit(SpeechResumed(int(vad.clock.total)))


class AsrStage(Stage):
    """Feeds the ASR stream; the final text of each speech segment goes through turn-taking."""

    def __init__(self, session: Session) -> None:
        super().__init__("asr", capacity=1024, policy=OverflowPolicy.DROP_OLDEST)
        self.s = session
        self._final_pending = False
        # decoders that work on every chunk (pocketsphinx: ~15 ms per 20 ms on 2 cores) run in
        # a worker thread so that the event loop, and barge-in with it, never waits for them
        self._incremental = not session.streaming_asr and getattr(session.models.asr, "name", "") != "whisper"
        self._segment_start: int | None = None
        self._early_scene: Any = None
        self._turn_wait: Any = None  # the turn model's extra wait for the segment that just ended

    async def process(self, item: Any) -> None:
        s = self.s
        loop = asyncio.get_running_loop()
        if type(item) is AudioIn:
            if self._final_pending or (self._incremental and s.asr.in_utterance):
                await loop.run_in_executor(s.pool, s.asr.push, item.pcm, item.ref_ns)
                self._collect()
            else:
                s.asr.push(item.pcm, item.ref_ns)
                if s.streaming_asr:  # committed words go out (and into the LLM) as they come
                    self._collect()
            turn = s.turns.on_tick(s.clock.now_ns())
            if turn is not None:
                self._send(turn)
            return
        if type(item) is SilenceOnset:
            u = self._speculating_decoder()
            if u is not None and s.asr.in_utterance:
                u.speculate(s.pool)
                # the latest frame at the first silent sample is the one at the end of speech
                self._early_scene = s.describe_scene(self._segment_start, item.t_ns)
            return
        if type(item) is SpeechResumed:
            u = self._speculating_decoder()
            if u is not None:
                u.drop()
            self._early_scene = None
            return
        if item.kind == "start":
            self._segment_start = item.t_ns
            self._early_scene = None
            s.turns.on_speech_start(item.t_ns)
            s.asr.push(item)
            return
        # END: the scene of this segment is described in parallel with the ASR final (or was
        # already started at the silence onset).
        early, self._early_scene = self._early_scene, None
        s.pending_scene = early if early is not None else s.describe_scene(item.start_ns, item.t_ns)
        detector = s.turns.detector
        if getattr(detector, "uses_audio", False):  # the turn model judges the voice beside the ASR final
            audio = s.input.recent_audio()
            judge: Any = detector.extra_wait_ms
            self._turn_wait = s.pool.submit(lambda: judge("", audio))
        self._final_pending = True
        await loop.run_in_executor(s.pool, s.asr.push, item)
        self._collect()

    def _speculating_decoder(self) -> Any:
        """The open utterance's decoder that can start its final early (None if there is none)."""
        s = self.s
        if s.spec_asr is not None:
            return s.spec_asr.current
        u = s.asr.decoder if s.streaming_asr else None
        return u if hasattr(u, "speculate") else None

    def _collect(self) -> None:
        s = self.s
        results = s.asr.poll()
        ending = any(tr.final for tr in results)
        for tr in results:
            s.publish(TranscriptDelta(tr.text, s.clock.now_ns()))
            if not tr.final:
                s.overlap.partial(tr.text)
                if not ending:  # with the final in hand the answer's own prompt comes next
                    s.prefill_partial(tr.text)
                continue
            timed = getattr(tr, "words", None)  # `asr_batched_stream.TimedTranscript` times its words
            words = [(w.text, w.start_ms, w.end_ms) for w in timed] if timed else None
            self._final_pending = False
            if getattr(tr, "error", ""):  # the decode failed: the client hears why, the session goes on
                self.errors.add("asr_final_failed")
                s.publish(TranscriptDone("", s.clock.now_ns(), None, tr.error))
                self._turn_wait = None
                turn = s.turns.on_failed_segment(tr.start_ns, tr.end_ns, s.clock.now_ns(), s.vad.speaking)
                if turn is not None:  # words of the turn's earlier segments still make a turn
                    self._send(turn)
                continue
            if s.overlap.final(tr.text):  # echo or a backchannel: the answer goes on
                continue
            s.publish(TranscriptDone(tr.text, s.clock.now_ns(), words))
            wait, self._turn_wait = self._turn_wait, None
            wait_ms = wait.result() if wait is not None and tr.text.strip() else None
            turn = s.turns.on_final(tr.text, tr.start_ns, tr.end_ns, s.clock.now_ns(), s.vad.speaking, wait_ms)
            if turn is not None:
                self._send(turn)
            elif not tr.text.strip():
                s.drops.add("empty_transcript")
            else:
                self._arm_hold()

    def _arm_hold(self, tries: int = 50) -> None:
        """A held turn ends at its deadline even when no more audio comes (a client that stops
        sending after speech): a timer ticks the turn taker then."""
        deadline = self.s.turns.deadline_ns
        if deadline is None or tries <= 0:
            return
        delay = max(0.0, (deadline - self.s.clock.now_ns()) / 1e9) + 0.002

        def tick() -> None:
            turn = self.s.turns.on_tick(self.s.clock.now_ns())
            if turn is not None:
                self._send(turn)
            else:
                self._arm_hold(tries - 1)  # not yet (a clock that audio advances), or held again

        asyncio.get_running_loop().call_later(delay, tick)

    def _send(self, turn: UserTurn) -> None:
        turn.scene = self.s.pending_scene
        self.s.pending_scene = None
        self.emit(turn)


class LlmStage(Stage):
    """Prompts the LLM with history + scene + the user's turn and streams the answer text."""

    def __init__(self, session: Session) -> None:
        super().__init__("llm", capacity=16)
        self.s = session

    async def process(self, turn: UserTurn) -> None:
        s = self.s
        rec = s.begin_turn(turn)
        scene_text = None
        if turn.scene is not None:
            desc = await turn.scene
            scene_text = getattr(desc, "text", None)
            rec.scene = scene_text
        messages = s.conversation.prompt(turn.text, scene_text)
        s.conversation.add_user(turn.text)
        s.close_prefill()  # its blocks stay cached: the answer's prompt reuses them
        speak = s.config.speak if turn.speak is None else turn.speak
        rec.llm_start_ns = s.clock.now_ns()
        try:
            cut = SentenceCut(s.config.max_sentences)  # a spoken answer ends after its first sentence(s)
            async with contextlib.aclosing(s.llm.stream(messages, s.config.max_tokens)) as deltas:  # type: ignore[type-var]
                async for piece in deltas:
                    delta = cut.push(piece)
                    if not delta:
                        if cut.done:  # closing the stream cancels the generation
                            break
                        continue
                    if rec.first_token_ns is None:
                        rec.first_token_ns = s.clock.now_ns()
                    rec.answer += delta
                    out = AnswerText(delta, s.clock.now_ns(), turn.turn_id, speak)
                    if not rec.status:
                        s.publish(out)
                    self.emit(out)
                    if cut.done:
                        break
        except (EngineStepError, LlmEndpointError) as exc:
            # The answer is lost, the session is not: end the turn so the next one can start.
            self.errors.add(type(exc).__name__)
            log.warning("llm failed on turn %d: %s", turn.turn_id, exc)
            shed = getattr(exc, "shed_reason", None)  # the scheduler shed the turn (`sched_backend.TurnShed`)
            s.end_response(rec, "failed", f"{type(exc).__name__}: {exc}",
                           {"shed": shed, "tier": getattr(exc, "tier", "")} if shed else {})
        rec.llm_done_ns = s.clock.now_ns()
        self.emit(ReplyEnd(turn.turn_id, speak))


class TtsStage(Stage):
    """Synthesises the answer sentence by sentence in a worker thread."""

    def __init__(self, session: Session) -> None:
        super().__init__("tts", capacity=512)
        self.s = session
        self.gen = 0
        self._job_gen = 0
        self._lock = threading.Lock()
        self._acc = ""
        self._first_cut = False
        self.pieces = 0
        """Audio pieces synthesised (text-only answers add none)."""

    def _job(self, gen: int, text: str | None) -> list[Any]:
        stream = self.s.tts
        with self._lock:
            if gen != self._job_gen:
                # output of a cancelled job (barge-in) must never reach the speaker
                stream.interrupt()
                stream.poll()
                self._job_gen = gen
            if text is None:
                stream.flush()
            else:
                stream.push(text)
            return list(stream.poll())

    async def process(self, item: Any) -> None:
        if not item.speak:  # a text-only answer: nothing to synthesise, the end goes on to playout
            if type(item) is ReplyEnd:
                self.emit(item)
            return
        loop = asyncio.get_running_loop()
        text = None
        if type(item) is AnswerText:
            text = item.text
            k = self.s.config.tts_first_words
            if not self._first_cut and k and text[:1].isspace() and len(self._acc.split()) >= k:
                # first audio sooner: speak the first words as a piece of their own
                text = "\n" + text
                self._first_cut = True
            self._acc += item.text
        events = await loop.run_in_executor(self.s.pool, self._job, self.gen, text)
        if events:
            self._first_cut = True
        self.pieces += len(events)
        for ev in events:
            self.emit(ev)
        if type(item) is ReplyEnd:
            self._reset_reply()
            self.emit(item)

    def _reset_reply(self) -> None:
        self._acc = ""
        self._first_cut = False

    def on_interrupt(self, reason: str) -> None:
        self.gen += 1
        self._reset_reply()


class PlayoutStage(Stage):
    """Plays answer audio in real time in `out_chunk_ms` pieces and tracks what was heard."""

    def __init__(self, session: Session) -> None:
        super().__init__("playout", capacity=256)
        self.s = session
        self.heard = HeardText()
        self.written = 0
        self.rate = 0
        self.play_until_ns = 0
        self._playing = asyncio.Event()
        self._playing.set()
        self.paused_at_ns: int | None = None
        """When the answer's audio last paused for speech over it."""

    def pause(self) -> None:
        """Hold the answer's audio (speech over it is being judged)."""
        if self._playing.is_set():
            self.paused_at_ns = self.s.clock.now_ns()
        self._playing.clear()

    def resume(self) -> None:
        """Go on playing where the answer paused."""
        self._playing.set()

    async def process(self, item: Any) -> None:
        s = self.s
        clock = s.clock
        if type(item) is ReplyEnd:
            await clock.sleep_until(self.play_until_ns)
            s.finish_turn(item.turn_id, self.heard.heard(self.written))
            self.heard = HeardText()
            self.written = 0
            return
        pcm = item.pcm
        self.rate = item.sample_rate
        self.heard.add(item.text, int(pcm.shape[0]))
        step = max(1, int(item.sample_rate * s.config.out_chunk_ms / 1000))
        dur_ns = step * 1_000_000_000 // item.sample_rate
        for i in range(0, pcm.shape[0], step):
            await clock.sleep_until(self.play_until_ns - dur_ns)  # keep one chunk queued at the device
            piece = pcm[i:i + step]
            now = clock.now_ns()
            rec = s.current
            if rec is not None and rec.first_audio_ns is None:
                rec.first_audio_ns = now
                rec.first_piece, rec.first_piece_s = item.text, float(item.compute_s)
            if not self._playing.is_set():
                await self._playing.wait()  # paused while the user speaks over the answer
                now = clock.now_ns()
                self.play_until_ns = now
            s.sink.write(piece, item.sample_rate)
            if s.echo is not None:
                s.echo.play(piece, item.sample_rate, now)
            self.written += piece.shape[0]
            self.play_until_ns = max(self.play_until_ns, now) + piece.shape[0] * 1_000_000_000 // item.sample_rate

    def heard_now(self) -> str:
        """Text of the audio played out by now (the chunk in the device counts as unheard)."""
        if not self.rate:
            return ""
        unplayed = max(0, self.play_until_ns - self.s.clock.now_ns()) * self.rate // 1_000_000_000
        return self.heard.heard(max(0, self.written - unplayed))

    def on_interrupt(self, reason: str) -> None:
        self.heard = HeardText()
        self.written = 0
        self.play_until_ns = 0
