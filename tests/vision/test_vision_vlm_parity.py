"""Tiny random LLaVA and Idefics3 checkpoints saved in HF format: our loader + vision path vs transformers.

The language model here is transformers' own Llama fed with our `inputs_embeds`, so a logits match
proves the tower, connector, feature-layer selection and image-token merge; the engine's Llama is
exercised on the same embeddings when it is importable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.vision._tiny_vlm import IMAGE_TOKEN, TEXT, saved_vlm
from tristream.vision.vlm import VisionLanguageModel

transformers = pytest.importorskip("transformers")


def _llava(tmp_path: Path, vision: str, strategy: str, layer: int | list[int]) -> tuple[torch.nn.Module, Path]:
    ref = saved_vlm(transformers, tmp_path / "llava", "llava", layers=3, seed=11, scale=0.1, tower=vision,
                    vision_feature_select_strategy=strategy, vision_feature_layer=layer)
    return ref, tmp_path / "llava"


def _idefics3(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    return saved_vlm(transformers, tmp_path / "idefics3", "idefics3", layers=3, seed=12, scale=0.1), tmp_path / "idefics3"


def _prompt(vlm: VisionLanguageModel, n_images: int, keep: float = 1.0) -> torch.Tensor:
    ids = [1, 5, 6] + [IMAGE_TOKEN, 7] * n_images + [8, 9, 10]
    return torch.tensor([vlm.expand_image_tokens(ids, vlm.tokens_per_image(keep))])


def _hf_text_logits(vlm: VisionLanguageModel, embeds: torch.Tensor) -> torch.Tensor:
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**vlm.text_config)).eval()
    lm.load_state_dict(vlm.text_state_dict(), strict=True)
    return lm(inputs_embeds=embeds).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("vision", "strategy", "layer"), [
    ("clip", "default", -2), ("siglip", "full", -1), ("clip", "full", [-3, -1]),
])
def test_llava_logits_match_transformers(tmp_path: Path, vision: str, strategy: str, layer: int | list[int]) -> None:
    ref, folder = _llava(tmp_path, vision, strategy, layer)
    vlm = VisionLanguageModel.from_folder(folder).eval()
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ids = _prompt(vlm, 2)
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=px).logits
        img = vlm.encode_images(px)
        assert img.embeds.shape == (2, vlm.tokens_per_image(), TEXT["hidden_size"])
        got = _hf_text_logits(vlm, vlm.merge(ids, img))
    assert _rel(got, want) < 1e-5


def test_idefics3_logits_match_transformers(tmp_path: Path) -> None:
    ref, folder = _idefics3(tmp_path)
    vlm = VisionLanguageModel.from_folder(folder).eval()
    assert vlm.tokens_per_image() == 4  # 4x4 patches, pixel shuffle 2
    px = torch.randn(1, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ids = _prompt(vlm, 2)
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=px).logits
        got = _hf_text_logits(vlm, vlm.merge(ids, vlm.encode_images(px[0])))
    assert _rel(got, want) < 1e-5


def test_pruned_images_keep_most_salient_tokens_in_order(tmp_path: Path) -> None:
    _, folder = _llava(tmp_path, "clip", "default", -2)
    vlm = VisionLanguageModel.from_folder(folder).eval()
    px = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = vlm.encode_images(px)
        for saliency in ("norm", "attention"):
            half = vlm.encode_images(px, keep_ratio=0.5, saliency=saliency)
            assert half.embeds.shape[1] == vlm.tokens_per_image(0.5) == 8
            assert half.dropped == 3 * 8
            assert bool((half.index.diff(dim=1) > 0).all())
            picked = full.embeds.gather(1, half.index.unsqueeze(-1).expand(-1, -1, full.embeds.shape[-1]))
            torch.testing.assert_close(half.embeds, picked)
        ids = _prompt(vlm, 3, keep=0.5)
        assert vlm.merge(ids, half).shape == (1, ids.shape[1], TEXT["hidden_size"])


def test_merge_rejects_token_count_mismatch(tmp_path: Path) -> None:
    _, folder = _idefics3(tmp_path)
    vlm = VisionLanguageModel.from_folder(folder)
    img = vlm.encode_images(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="expand_image_tokens"):
        vlm.merge(torch.tensor([[1, IMAGE_TOKEN, 2]]), img)
