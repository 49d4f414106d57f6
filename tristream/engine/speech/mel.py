"""Whisper's log-mel spectrogram in torch (batched, on whichever device the audio is on).

Same recipe as `WhisperFeatureExtractor`: 400-point periodic Hann STFT, hop 160, power spectrum,
Slaney mel filters, log10 floored at 1e-10, each clip clamped to (its max − 8), then (x + 4) / 4.
"""

from __future__ import annotations

import numpy as np
import torch

from tristream.engine.speech.config import HOP, N_FFT, SAMPLE_RATE


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    mel = f / (200.0 / 3.0)
    logstep = np.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-12) / 1000.0) / logstep, mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    logstep = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), m * (200.0 / 3.0))


def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-normalised triangular filters, `[n_fft // 2 + 1, n_mels]` (float32)."""
    fft_freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    mel_pts = np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(8000.0)), n_mels + 2)
    hz = _mel_to_hz(mel_pts)
    diff = np.diff(hz)
    slopes = hz[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = np.maximum(0.0, np.minimum(down, up))
    fb *= 2.0 / (hz[2 : n_mels + 2] - hz[:n_mels])
    return fb.astype(np.float32)


class LogMel(torch.nn.Module):
    """`[B, samples]` float audio at 16 kHz → `[B, n_mels, samples // 160]` Whisper features."""

    window: torch.Tensor
    filters: torch.Tensor

    def __init__(self, n_mels: int = 80) -> None:
        super().__init__()
        self.n_mels = n_mels
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.register_buffer("filters", torch.from_numpy(mel_filters(n_mels)).T.contiguous(), persistent=False)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        x = audio.float()
        spec = torch.stft(x, N_FFT, HOP, window=self.window.to(x.device), return_complex=True)
        power = spec[..., :-1].abs() ** 2
        mel = self.filters.to(x.device) @ power
        logm = torch.clamp(mel, min=1e-10).log10()
        peak = logm.amax(dim=(1, 2), keepdim=True)
        logm = torch.maximum(logm, peak - 8.0)
        return (logm + 4.0) / 4.0
