"""Synthetic vision and ASR load for the real backend, through the graphed runners.

Planned images run a SigLIP-B/16 tower through `VisionGraphBank` (one CUDA graph per image
bucket, features of every patch token, what a VLM connector consumes); planned ASR units run
streaming Whisper-tiny updates through `WhisperRunner.run_store` (graphed encoder over a 10 s
window + `asr_tokens` greedy decoder tokens, audio already on the device, tokens to the host
once per pass; no word-time alignment pass, as in the step-time fit). Random weights; eager on CPU. Plans larger than the largest bucket run in
bucket-sized slices.
"""

from __future__ import annotations

from typing import Any

import numpy as np

IMAGE_BUCKETS = (1, 2, 4, 8, 16, 32)
ASR_BUCKETS = (1, 2, 4, 8, 16)


class EncoderLoad:
    """Graphed SigLIP-B/16 and Whisper-tiny runners fed with fixed random inputs."""

    def __init__(self, device: str, asr_window_s: float = 10.0, asr_tokens: int = 8,
                 tiny: bool = False) -> None:
        """tiny: small random configs (CPU smoke tests)."""
        import torch

        from tristream.engine.speech.audio_store import AudioStore
        from tristream.engine.speech.config import WhisperDims, WhisperTokens
        from tristream.engine.speech.config import preset as whisper_preset
        from tristream.engine.speech.runner import WhisperRunner
        from tristream.engine.speech.whisper import Whisper
        from tristream.engine.vision.graphs import VisionGraphBank
        from tristream.engine.vision.vit import VisionTower, VisionTowerConfig

        torch.manual_seed(0)
        dt = torch.float16 if device.startswith("cuda") else torch.float32
        vcfg = (VisionTowerConfig("siglip", 64, 128, 2, 4, 32, 8) if tiny
                else VisionTowerConfig("siglip", 768, 3072, 12, 12, 224, 16))
        self.tower = VisionTower(vcfg).to(device=device, dtype=dt).eval()
        side = vcfg.image_size
        self.pixels = torch.randn(IMAGE_BUCKETS[-1], 3, side, side, device=device, dtype=dt)
        self.vision = VisionGraphBank(lambda px: self.tower(px).features, (3, side, side),
                                      buckets=IMAGE_BUCKETS, device=device, dtype=dt)
        dims: WhisperDims = WhisperDims(64, 1, 1, 2, 128) if tiny else whisper_preset("tiny")
        self.whisper = Whisper(dims).to(device=device, dtype=dt).eval()
        self.asr = WhisperRunner(self.whisper, WhisperTokens.for_vocab(dims.vocab_size), batch_buckets=ASR_BUCKETS,
                                 audio_buckets_s=(asr_window_s,), max_new_tokens=asr_tokens, chunk=asr_tokens,
                                 early_stop=False, word_times=False)
        n = int(asr_window_s * 16000)  # the store holds one window per stream
        self.store = AudioStore(ASR_BUCKETS[-1], n, device)
        rng = np.random.default_rng(0)
        self.slots = [self.store.acquire() for _ in range(ASR_BUCKETS[-1])]
        for s in self.slots:
            self.store.append(s, (0.1 * rng.standard_normal(n)).astype(np.float32))
        self.images = 0
        self.asr_passes = 0

    def capture(self) -> None:
        """Capture every bucket's graphs now (start-up, never while serving)."""
        self.vision.capture()
        self.asr.capture()

    def encode_images(self, n: int) -> Any:
        """Encode n frames (asynchronous on CUDA: graph replays, no sync)."""
        out = None
        for i in range(0, n, IMAGE_BUCKETS[-1]):
            k = min(IMAGE_BUCKETS[-1], n - i)
            out = self.vision(self.pixels[:k])
        self.images += n
        return out

    def asr_update(self, n: int) -> None:
        """n streaming ASR updates (one pass per ≤16 streams; tokens reach the host once per pass)."""
        for i in range(0, n, ASR_BUCKETS[-1]):
            k = min(ASR_BUCKETS[-1], n - i)
            self.asr.run_store(self.store, self.slots[:k])
            self.asr_passes += 1
