"""Vision tokens through the LLM engine's incremental prefill equal transformers' VLM greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.vision._tiny_vlm import IMAGE_TOKEN, saved_vlm
from tristream.vision.inject import append_images, load_language_model
from tristream.vision.vlm import VisionLanguageModel

transformers = pytest.importorskip("transformers")
engine_mod = pytest.importorskip("tristream.engine.engine")
seq_mod = pytest.importorskip("tristream.engine.sequence")

N_NEW = 6


def _hf_greedy(ref: torch.nn.Module, ids: torch.Tensor, px: torch.Tensor) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(N_NEW):
            nxt = int(ref(input_ids=ids, pixel_values=px).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def _engine_greedy(vlm: VisionLanguageModel, before: list[int], px: torch.Tensor, after: list[int]) -> list[int]:
    eng = engine_mod.LLMEngine(load_language_model(vlm, max_positions=256), None,
                               engine_mod.EngineConfig(use_graphs=False, triton_decode=False, max_prefill_tokens=8))
    sid = eng.add_request(before, generate=False)
    with torch.no_grad():
        n = append_images(eng, sid, vlm.encode_images(px), cache_key="frame-0")
    assert n == px.shape[0] * vlm.tokens_per_image()
    eng.append(sid, token_ids=after)
    eng.start_generation(sid, seq_mod.SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    toks: list[int] = []
    for _ in range(200):
        for o in eng.step():
            if o.seq_id == sid and o.token_id is not None:
                toks.append(o.token_id)
        if len(toks) >= N_NEW:
            break
    return toks[:N_NEW]


@pytest.mark.parametrize("arch", ["llava", "idefics3"])
def test_images_prefilled_through_engine_decode_like_transformers(tmp_path: Path, arch: str) -> None:
    strategy = {"vision_feature_select_strategy": "full"} if arch == "llava" else {}
    ref = saved_vlm(transformers, tmp_path / arch, arch, layers=2, seed=21, scale=0.15, **strategy)
    vlm = VisionLanguageModel.from_folder(tmp_path / arch).eval()
    px = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    before, after = [1, 17, 18], [19, 20, 21, 22]
    ids = torch.tensor([before + [IMAGE_TOKEN] * vlm.tokens_per_image() + after])
    want = _hf_greedy(ref, ids, px if arch == "llava" else px[None])
    got = _engine_greedy(vlm, before, px, after)
    assert got == want
