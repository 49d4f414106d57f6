"""Whisper's log-mel spectrogram (batched, on whichever device the audio is on).

Same recipe as `WhisperFeatureExtractor`: 400-point periodic Hann STFT, hop 160, power spectrum,
Slaney mel filters, log10 floored at 1e-10, each clip clamped to (its max − 8), then (x + 4) / 4.

The FFT is torch.stft (cuFFT) on both paths. Where Triton runs (`kernels.enabled`, and
TRISTREAM_WHISPER_KERNELS is not 0) everything after it is two kernels instead of about ten:
power + filterbank + log10 with each program's max, then the per-clip clamp and scale, written
in the caller's dtype and layout. Each Slaney filter is non-zero on one band of at most 14 bins
(80 mels), so the filterbank is a banded fp32 sum (no dense [80, 201] product); it differs
from torch's GEMM by summation order only (features within ~1e-7).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tristream.engine.optional_triton import tl, triton
from tristream.speech.config import HOP, N_FFT, SAMPLE_RATE
from tristream.speech.kernels import enabled

# filterbank kernel: frames x mel bands per program, and its warps (H200, 16 x 10 s: fastest of
# BLOCK_T 8-64 x MELS 4-16 x 1-4 warps)
BLOCK_T = 8
MELS = 8
WARPS = 1
NORM_BLOCK = 2048  # features per program of the clamp-and-scale kernel
# the clamp-and-scale kernel reads a clip's partial maxima (one per filterbank program) in one
# block of at least this many: one compile serves every clip up to Whisper's 30 s
MIN_PEAK_BLOCK = 4096


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


# ---- kernels ----------------------------------------------------------------------------------
if triton is not None:

    @triton.jit(do_not_specialize=["frames", "n_parts", "s_b"])
    def _log_mel_kernel(spec_ptr, lo_ptr, w_ptr, logm_ptr, pmax_ptr, frames, n_parts, s_b,
                        S_K: tl.constexpr, S_T: tl.constexpr, N_FREQ: tl.constexpr, N_MELS: tl.constexpr,
                        TRANSPOSE: tl.constexpr, BLOCK_T: tl.constexpr, MELS: tl.constexpr,
                        BAND: tl.constexpr):
        # the spectrum's strides are constexpr: torch.stft's layout (bins contiguous, 402 floats a
        # frame) is the same for every shape, so one compile serves all
        tile = tl.program_id(0)
        group = tl.program_id(1)
        b = tl.program_id(2)
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        j = tl.arange(0, BAND)
        ri = tl.arange(0, 2)
        t_ok = t < frames  # also drops the STFT's last frame (frames = its frame count - 1)
        spec = spec_ptr + b.to(tl.int64) * s_b + t[:, None, None] * S_T + ri[None, None, :]
        base = logm_ptr + b.to(tl.int64) * frames * N_MELS
        peak = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        # unrolled: the group's loads are independent and all in flight at once
        for i in tl.static_range(MELS):
            m = group * MELS + i
            if m < N_MELS:
                k = tl.load(lo_ptr + m) + j  # the filter's band of bins, zero weights past its end
                z = tl.load(spec + k[None, :, None] * S_K,
                            mask=t_ok[:, None, None] & (k < N_FREQ)[None, :, None], other=0.0)
                power = tl.sum(z * z, axis=2)  # [BLOCK_T, BAND]: re² + im²
                mel = tl.sum(power * tl.load(w_ptr + m * BAND + j)[None, :], axis=1)
                logm = tl.log2(tl.maximum(mel, 1e-10)) * 0.30102999566398120  # log10
                if TRANSPOSE:
                    tl.store(base + t * N_MELS + m, logm, mask=t_ok)
                else:
                    tl.store(base + m * frames + t, logm, mask=t_ok)
                peak = tl.maximum(peak, tl.where(t_ok, logm, float("-inf")))
        tl.store(pmax_ptr + b * n_parts + tile * tl.num_programs(1) + group, tl.max(peak, axis=0))

    @triton.jit(do_not_specialize=["n", "n_parts"])
    def _clamp_scale_kernel(logm_ptr, pmax_ptr, out_ptr, n, n_parts, BLOCK: tl.constexpr,
                            BLOCK_P: tl.constexpr):
        b = tl.program_id(1)
        p = tl.arange(0, BLOCK_P)  # BLOCK_P >= n_parts
        peak = tl.max(tl.load(pmax_ptr + b * n_parts + p, mask=p < n_parts, other=float("-inf")), axis=0)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        base = b.to(tl.int64) * n
        x = tl.load(logm_ptr + base + i, mask=i < n)
        y = (tl.maximum(x, peak - 8.0) + 4.0) / 4.0
        tl.store(out_ptr + base + i, y.to(out_ptr.dtype.element_ty), mask=i < n)


class LogMel(torch.nn.Module):
    """`[B, samples]` float audio at 16 kHz → `[B, n_mels, samples // 160]` Whisper features."""

    window: torch.Tensor
    filters: torch.Tensor
    band_lo: torch.Tensor
    band_w: torch.Tensor

    def __init__(self, n_mels: int = 80) -> None:
        super().__init__()
        self.n_mels = n_mels
        # where Triton runs, the two kernels after the FFT; TRISTREAM_WHISPER_KERNELS=0 keeps the torch ops
        self.fused = os.environ.get("TRISTREAM_WHISPER_KERNELS", "1") != "0"
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.register_buffer("filters", torch.from_numpy(mel_filters(n_mels)).T.contiguous(), persistent=False)
        # the kernel's copy: each filter is zero outside one band of at most 14 bins (80 mels), so
        # it reads that band's first bin and BAND weights, not a dense [201, n_mels] product
        fb = mel_filters(n_mels).T  # [n_mels, bins]
        lo = np.array([int(np.flatnonzero(row)[0]) if row.any() else 0 for row in fb], np.int32)
        width = max(int(np.flatnonzero(row)[-1]) - int(lo[i]) + 1 if row.any() else 1 for i, row in enumerate(fb))
        self.band = max(16, 1 << (width - 1).bit_length())
        band_w = np.zeros((n_mels, self.band), np.float32)
        for i, row in enumerate(fb):
            seg = row[lo[i] : lo[i] + self.band]
            band_w[i, : seg.size] = seg
        self.register_buffer("band_lo", torch.from_numpy(lo), persistent=False)
        self.register_buffer("band_w", torch.from_numpy(band_w), persistent=False)

    def forward(self, audio: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                transpose: bool = False) -> torch.Tensor:
        """Features `[B, n_mels, frames]` (`[B, frames, n_mels]` contiguous with `transpose`), in
        `out_dtype`; frames = samples // 160."""
        x = audio.float()
        spec = torch.stft(x, N_FFT, HOP, window=self.window.to(x.device), return_complex=True)
        if self.fused and enabled(x) and x.dim() == 2 and spec.shape[-1] > 1:
            return self._fused_tail(spec, out_dtype, transpose)
        return self._torch_tail(spec, out_dtype, transpose)

    def forward_torch(self, audio: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                      transpose: bool = False) -> torch.Tensor:
        """`forward` on the torch ops whatever the device (the kernels' reference)."""
        x = audio.float()
        spec = torch.stft(x, N_FFT, HOP, window=self.window.to(x.device), return_complex=True)
        return self._torch_tail(spec, out_dtype, transpose)

    def _torch_tail(self, spec: torch.Tensor, out_dtype: torch.dtype, transpose: bool) -> torch.Tensor:
        power = spec[..., :-1].abs() ** 2
        mel = self.filters.to(spec.device) @ power
        logm = torch.clamp(mel, min=1e-10).log10()
        peak = logm.amax(dim=(1, 2), keepdim=True)
        logm = torch.maximum(logm, peak - 8.0)
        out = (logm + 4.0) / 4.0
        if transpose:
            out = out.transpose(1, 2).contiguous()
        return out.to(out_dtype)

    def _fused_tail(self, spec: torch.Tensor, out_dtype: torch.dtype, transpose: bool) -> torch.Tensor:
        b, n_freq, frames = spec.shape[0], spec.shape[1], spec.shape[2] - 1
        z = torch.view_as_real(spec)  # [B, n_freq, frames + 1, 2], re and im adjacent
        shape = (b, frames, self.n_mels) if transpose else (b, self.n_mels, frames)
        out = torch.empty(shape, dtype=out_dtype, device=spec.device)
        # the clamp-and-scale kernel works in place where the output is float32
        logm = out if out_dtype == torch.float32 else torch.empty(shape, dtype=torch.float32, device=spec.device)
        n_tiles, n_groups = triton.cdiv(frames, BLOCK_T), triton.cdiv(self.n_mels, MELS)
        n_parts = n_tiles * n_groups
        pmax = torch.empty(b, n_parts, dtype=torch.float32, device=spec.device)
        _log_mel_kernel[(n_tiles, n_groups, b)](z, self.band_lo.to(spec.device), self.band_w.to(spec.device), logm,
                                                pmax, frames, n_parts, z.stride(0), S_K=z.stride(1),
                                                S_T=z.stride(2), N_FREQ=n_freq, N_MELS=self.n_mels,
                                                TRANSPOSE=transpose, BLOCK_T=BLOCK_T, MELS=MELS, BAND=self.band,
                                                num_warps=WARPS)
        n = self.n_mels * frames
        _clamp_scale_kernel[(triton.cdiv(n, NORM_BLOCK), b)](logm, pmax, out, n, n_parts, BLOCK=NORM_BLOCK,
                                                              BLOCK_P=max(MIN_PEAK_BLOCK, triton.next_power_of_2(n_parts)),
                                                              num_warps=4)
        return out
