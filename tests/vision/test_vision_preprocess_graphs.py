"""Frame preprocessing (vs PIL + HF-style normalisation) and the image-count graph bank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.models import randomise
from tristream.vision.graphs import VisionGraphBank
from tristream.vision.preprocess import CLIP_MEAN_STD, SIGLIP_MEAN_STD, FramePreprocessor
from tristream.vision.vit import VisionTower, VisionTowerConfig

CUDA = torch.cuda.is_available()


def _frames(n: int, h: int, w: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (n, h // 8 + 1, w // 8 + 1, 3)).astype(np.float32)
    # smooth images (like camera frames) so resampling filters are comparable
    big = np.repeat(np.repeat(base, 8, axis=1), 8, axis=2)[:, :h, :w]
    return [big[i].astype(np.uint8) for i in range(n)]


def test_normalisation_without_resize_is_exact() -> None:
    pre = FramePreprocessor(32, CLIP_MEAN_STD)
    f = _frames(2, 32, 32)
    got = pre(f)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in CLIP_MEAN_STD)
    want = (torch.from_numpy(np.stack(f)).permute(0, 3, 1, 2).float() / 255 - mean) / std
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_resize_matches_pil_bicubic_within_rounding() -> None:
    pre = FramePreprocessor(64, SIGLIP_MEAN_STD)
    frames = _frames(1, 120, 160, seed=1) + _frames(1, 96, 96, seed=2)
    got = pre(frames)
    for i, f in enumerate(frames):
        ref = np.asarray(Image.fromarray(f).resize((64, 64), Image.Resampling.BICUBIC), dtype=np.float32)
        ref_t = (torch.from_numpy(ref).permute(2, 0, 1) / 255 - 0.5) / 0.5
        err = (got[i] - ref_t).abs()
        assert float(err.mean()) < 0.02 and float(err.max()) < 0.25
    assert pre.stats.sizes == {(120, 160): 1, (96, 96): 1}


def test_bad_frames_are_rejected_with_reason() -> None:
    pre = FramePreprocessor(32, max_batch=2)
    with pytest.raises(ValueError, match="uint8"):
        pre([np.zeros((32, 32, 3), np.float32)])
    with pytest.raises(ValueError, match="max_batch"):
        pre(_frames(3, 32, 32))


def _tiny_tower(seed: int = 0) -> VisionTower:
    cfg = VisionTowerConfig(kind="siglip", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                            image_size=32, patch_size=8, use_head=True)
    return randomise(VisionTower(cfg).eval(), seed, 0.2)


def test_graph_bank_eager_path_picks_buckets_and_chunks() -> None:
    tower = _tiny_tower()
    bank = VisionGraphBank(lambda x: tower(x).features, (3, 32, 32), buckets=(1, 2, 4), device="cpu",
                           dtype=torch.float32)
    assert [bank.bucket(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    px = torch.randn(3, 3, 32, 32)
    out = bank(px)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, tower(px).features)
    with pytest.raises(ValueError, match="chunks"):
        bank.bucket(5)


@pytest.mark.gpu
def test_graph_replay_equals_eager_for_every_bucket() -> None:
    tower = _tiny_tower().cuda().half()
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = tower(x, saliency="norm")
        assert o.pooled is not None and o.saliency is not None
        return o.pooled, o.saliency

    bank = VisionGraphBank(fn, (3, 32, 32), buckets=(1, 2, 4, 8), device="cuda", dtype=torch.float16)
    bank.capture()
    for n in (1, 2, 3, 4, 5, 8):
        px = torch.randn(n, 3, 32, 32, device="cuda", dtype=torch.float16)
        got = bank(px)
        want = fn(px) if n == bank.bucket(n) else fn(torch.cat([px, bank.static_in[n:bank.bucket(n)]]))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w[:n], atol=1e-3, rtol=1e-3)
    assert bank.stats.captured == 4


@pytest.mark.gpu
def test_preprocess_on_gpu_equals_cpu() -> None:
    frames = _frames(4, 120, 160, seed=3) + _frames(2, 32, 32, seed=4)
    cpu = FramePreprocessor(32, CLIP_MEAN_STD)(frames)
    gpu_pre = FramePreprocessor(32, CLIP_MEAN_STD, device="cuda")
    for _ in range(3):  # exercises both staging buffers
        gpu = gpu_pre(frames)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)
    assert gpu_pre.stats.bytes_uploaded > 0
