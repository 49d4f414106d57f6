"""Our ViT towers vs transformers' SigLIP / CLIP / Idefics3 vision models on the same random weights."""

from __future__ import annotations

import pytest
import torch

from tests.models import randomise
from tristream.vision.vit import VisionTowerConfig, load_vision_tower

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            image_size=32, patch_size=8)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _pixels(n: int, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("use_head", [True, False])
def test_siglip_tower_matches_transformers(use_head: bool) -> None:
    cfg = transformers.SiglipVisionConfig(**TINY, vision_use_head=use_head)
    ref = transformers.SiglipVisionModel(cfg).eval()
    randomise(ref, 3, 0.2)
    ours = load_vision_tower(VisionTowerConfig.from_hf(cfg.to_dict()), ref.state_dict()).eval()
    px = _pixels(2)
    with torch.no_grad():
        r = ref(pixel_values=px, output_hidden_states=True)
        o = ours(px)
        assert _rel(o.features, r.last_hidden_state) < 1e-5
        if use_head:
            assert o.pooled is not None and _rel(o.pooled, r.pooler_output) < 1e-5
        for layer in (0, 1, -2):
            assert _rel(ours(px, layer=layer).features, r.hidden_states[layer]) < 1e-5


def test_clip_tower_matches_transformers() -> None:
    cfg = transformers.CLIPVisionConfig(**TINY)
    ref = transformers.CLIPVisionModel(cfg).eval()
    randomise(ref, 4, 0.2)
    vc = VisionTowerConfig.from_hf(cfg.to_dict())
    assert vc.kind == "clip" and vc.hidden_act == "quick_gelu"
    ours = load_vision_tower(vc, ref.state_dict()).eval()
    px = _pixels(3, seed=2)
    with torch.no_grad():
        r = ref(pixel_values=px, output_hidden_states=True)
        o = ours(px)
        assert _rel(o.features, r.last_hidden_state) < 1e-5
        assert o.pooled is not None and _rel(o.pooled, r.pooler_output) < 1e-5
        assert _rel(ours(px, layer=-2).features, r.hidden_states[-2]) < 1e-5


def test_idefics3_tower_matches_transformers() -> None:
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    cfg = transformers.Idefics3VisionConfig(**TINY)
    ref = Idefics3VisionTransformer(cfg).eval()
    randomise(ref, 5, 0.2)
    ours = load_vision_tower(VisionTowerConfig.from_hf(cfg.to_dict(), kind="idefics3", use_head=False),
                             ref.state_dict()).eval()
    px = _pixels(2, seed=3)
    with torch.no_grad():
        r = ref(pixel_values=px).last_hidden_state
        assert _rel(ours(px).features, r) < 1e-5


def test_saliency_shapes_and_attention_is_a_distribution() -> None:
    cfg = transformers.SiglipVisionConfig(**TINY, vision_use_head=True)
    ref = transformers.SiglipVisionModel(cfg).eval()
    randomise(ref, 6, 0.2)
    ours = load_vision_tower(VisionTowerConfig.from_hf(cfg.to_dict()), ref.state_dict()).eval()
    with torch.no_grad():
        a = ours(_pixels(2), saliency="attention").saliency
        n = ours(_pixels(2), saliency="norm").saliency
    assert a is not None and n is not None
    assert a.shape == n.shape == (2, 16)
    torch.testing.assert_close(a.sum(-1), torch.ones(2))


def test_wrong_image_size_is_an_actionable_error() -> None:
    cfg = transformers.SiglipVisionConfig(**TINY)
    ref = transformers.SiglipVisionModel(cfg)
    ours = load_vision_tower(VisionTowerConfig.from_hf(cfg.to_dict()), ref.state_dict())
    with pytest.raises(ValueError, match="FramePreprocessor"):
        ours(_pixels(1, size=48))
