"""WAV files in and out for the stages (stdlib `wave`; PCM 8/16/24/32-bit, any channel count)."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from tristream.stages.base import BadAudio, as_float_mono, resample

__all__ = ["load_wav_16k", "read_wav", "write_wav"]


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """(mono float32 samples in [-1, 1], sample rate) of a PCM WAV file; raises `BadAudio`."""
    p = Path(path)
    if not p.exists():
        raise BadAudio(f"{p}: no such file")
    if not p.is_file():
        raise BadAudio(f"{p}: not a file")
    try:
        with wave.open(str(p), "rb") as w:
            n, ch, width, rate = w.getnframes(), w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(n)
    except (wave.Error, EOFError) as e:
        raise BadAudio(f"{p}: not a PCM WAV file ({e or type(e).__name__}); convert it, e.g. `sox in.mp3 -r 16000 -c 1 out.wav`") from e
    if n == 0 or not raw:
        raise BadAudio(f"{p}: WAV file has no audio frames")
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(raw, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise BadAudio(f"{p}: {8 * width}-bit samples are not supported; use 16-bit PCM")
    x = x[: x.shape[0] // ch * ch].reshape(-1, ch)
    return as_float_mono(x.mean(axis=1).astype(np.float32)), rate


def load_wav_16k(path: str | Path, min_rate: int = 8000) -> tuple[np.ndarray, int]:
    """Mono float32 at 16 kHz (resampled when needed) and the file's original rate.

    Rates below `min_rate` are refused: upsampling telephone-band audio further gives no
    usable speech for the models.
    """
    pcm, rate = read_wav(path)
    if rate < min_rate:
        raise BadAudio(f"{path}: sample rate {rate} Hz is below {min_rate} Hz; record at 16 kHz or more")
    return resample(pcm, rate, 16_000), rate


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int) -> None:
    """Write mono float32 audio as 16-bit PCM WAV."""
    data = (np.clip(as_float_mono(pcm), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(data.tobytes())
