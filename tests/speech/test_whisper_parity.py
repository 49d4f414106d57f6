"""Our Whisper encoder/decoder and log-mel vs transformers on the same random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models import randomise
from tristream.speech.config import WhisperDims, WhisperTokens, preset
from tristream.speech.mel import LogMel
from tristream.speech.whisper import load_whisper

transformers = pytest.importorskip("transformers")

DIMS = WhisperDims(d_model=64, encoder_layers=2, decoder_layers=2, heads=4, ffn=128,
                   max_source_positions=100, max_target_positions=64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _reference(dims: WhisperDims, seed: int = 0) -> torch.nn.Module:
    return randomise(transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**dims.to_hf())).eval(),
                     seed, 0.1)


def test_log_mel_matches_feature_extractor() -> None:
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    audio = (np.random.default_rng(0).standard_normal(16000 * 2) * 0.1).astype(np.float32)
    want = fe(audio, sampling_rate=16000, return_tensors="np").input_features[0]
    padded = np.zeros(480000, np.float32)
    padded[: audio.size] = audio
    got = LogMel(80)(torch.from_numpy(padded)[None])[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_encoder_and_decoder_match_transformers() -> None:
    ref = _reference(DIMS)
    ours = load_whisper(DIMS, ref.state_dict()).eval()
    mel = torch.randn(2, 80, 200, generator=torch.Generator().manual_seed(1))
    toks = WhisperTokens.for_vocab(DIMS.vocab_size)
    ids = torch.tensor([[*toks.prompt(), 11, 400, 7000], [*toks.prompt(), 12, 13, 14]])
    with torch.no_grad():
        r = ref(input_features=mel, decoder_input_ids=ids)
        enc = ours.encode(mel)
        assert _rel(enc, r.encoder_last_hidden_state) < 1e-5
        assert _rel(ours.decode_full(ids, enc), r.logits) < 1e-5


def test_step_decoding_equals_full_decoding() -> None:
    ref = _reference(DIMS, seed=2)
    ours = load_whisper(DIMS, ref.state_dict()).eval()
    mel = torch.randn(3, 80, 200, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 50000, (3, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        enc = ours.encode(mel)
        full = ours.decode_full(ids, enc)
        cache = ours.new_cache(3, enc.shape[1], 16)
        ours.fill_cross(enc, cache)
        got = [ours.decode(ids[:, :4], torch.arange(4), cache)]
        for i in range(4, 9):
            got.append(ours.decode(ids[:, i : i + 1], torch.tensor([i]), cache))
    assert _rel(torch.cat(got, dim=1), full) < 1e-5


def test_short_bucket_equals_model_with_fewer_positions() -> None:
    """audio_ctx-style buckets: encoding 100 frames = a Whisper whose position table is its first 50 rows."""
    ref = _reference(DIMS, seed=5)
    ours = load_whisper(DIMS, ref.state_dict()).eval()
    short = WhisperDims(64, 2, 2, 4, 128, max_source_positions=50, max_target_positions=64)
    ref_short = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**short.to_hf())).eval()
    sd = ref.state_dict()
    sd["model.encoder.embed_positions.weight"] = sd["model.encoder.embed_positions.weight"][:50]
    ref_short.load_state_dict(sd, strict=False)
    mel = torch.randn(1, 80, 100, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref_short.model.encoder(mel).last_hidden_state
        assert _rel(ours.encode(mel), want) < 1e-5


def test_presets_and_tokens() -> None:
    assert preset("tiny").d_model == 384 and preset("large-v3").n_mels == 128
    v2 = WhisperTokens.for_vocab(51865)
    assert v2.prompt() == (50258, 50259, 50359, 50363)
    v3 = WhisperTokens.for_vocab(51866)
    assert v3.prompt() == (50258, 50259, 50360, 50364)
    with pytest.raises(ValueError, match="30 s window"):
        load_whisper(DIMS, _reference(DIMS).state_dict()).encode(torch.zeros(1, 80, 202))
