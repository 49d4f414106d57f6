"""Semantic end of turn: Smart Turn v3.2 judges from the voice whether the user has finished.

Silence alone cannot tell "I would like to know how many people … [pause] … live in London"
from a finished question: a short VAD hangover cuts the first in two, a long one makes every
answer wait. Smart Turn v3.2 (pipecat-ai, BSD-2-Clause; an ONNX classifier over a Whisper-tiny
encoder, 8.7 MB, shipped inside the `pipecat-ai` wheel and installed with ``--no-deps`` for
the file alone) reads the intonation and rhythm of the last 8 s and gives the probability that
the turn is complete.

Input, as the model was trained: the last 8 s at 16 kHz (zeros in front when shorter),
normalised to zero mean and unit variance, as Whisper's 80-bin log-mel (25 ms windows, 10 ms
hop, log10 clamped 8 below its maximum, then (x + 4) / 4): [1, 80, 800]. The mel features come
from faster-whisper's extractor, the same transform Whisper uses.

`SmartTurnEndOfTurn` uses it at the end of each VAD segment: a complete turn ends at once, an
incomplete one is held open `hold_ms` longer (speech that resumes continues the same turn).
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tristream.stages.base import ModelUnavailable

__all__ = ["SmartTurn", "SmartTurnEndOfTurn", "smart_turn_path"]

RATE = 16_000
WINDOW = 8 * RATE


def smart_turn_path() -> Path:
    """The Smart Turn v3.2 ONNX file inside the installed `pipecat-ai` wheel."""
    spec = importlib.util.find_spec("pipecat")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable("Smart Turn needs the pipecat-ai wheel's model file: "
                               "`pip install --no-deps pipecat-ai==1.14.0`")
    path = Path(next(iter(spec.submodule_search_locations))) / "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing; reinstall pipecat-ai with --no-deps")
    return path


class SmartTurn:
    """The Smart Turn v3.2 classifier (onnxruntime, `threads` intra-op threads), shared by sessions."""

    name = "smart-turn-v3.2"

    def __init__(self, path: str | Path | None = None, threads: int = 1) -> None:
        import onnxruntime as ort
        from faster_whisper.feature_extractor import FeatureExtractor

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._session = ort.InferenceSession(str(path or smart_turn_path()), sess_options=opts,
                                             providers=["CPUExecutionProvider"])
        self._features = FeatureExtractor(feature_size=80)
        self._lock = threading.Lock()
        self.calls = 0

    def features(self, pcm: np.ndarray) -> np.ndarray:
        """[1, 80, 800] model input of the last 8 s of `pcm` (16 kHz mono float32)."""
        x = np.asarray(pcm, dtype=np.float32)[-WINDOW:]
        if x.shape[0] < WINDOW:
            x = np.concatenate([np.zeros(WINDOW - x.shape[0], dtype=np.float32), x])
        x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
        mel = self._features(x, padding=0)[:, :800]
        return np.ascontiguousarray(mel[None], dtype=np.float32)

    def probability(self, pcm: np.ndarray) -> float:
        """Probability that the speech ending `pcm` is a finished turn."""
        feats = self.features(pcm)
        with self._lock:
            out = self._session.run(None, {"input_features": feats})
            self.calls += 1
        return float(np.asarray(out[0]).reshape(-1)[0])


@dataclass(slots=True)
class SmartTurnEndOfTurn:
    """An end-of-turn detector from the voice: 0 extra wait when Smart Turn says the turn is
    complete (probability ≥ `threshold`), `hold_ms` more silence when it says it is not."""

    model: Any
    threshold: float = 0.5
    hold_ms: float = 700.0
    uses_audio = True

    def extra_wait_ms(self, text: str, audio: np.ndarray | None = None) -> float:
        """The extra silence to wait for, from the voice alone (`text` is not used); without
        audio, none (the silence rule alone)."""
        if audio is None or not audio.size:
            return 0.0
        return 0.0 if self.model.probability(audio) >= self.threshold else self.hold_ms
