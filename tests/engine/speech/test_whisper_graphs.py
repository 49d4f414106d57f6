"""GPU: every (batch, audio) bucket's graphed pass equals the eager pass on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tristream.engine.speech.config import WhisperTokens
from tristream.engine.speech.runner import WhisperRunner

TOKENS = WhisperTokens.for_vocab(51865)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graph_replay_equals_eager_for_every_bucket(dtype: torch.dtype, make_whisper) -> None:  # type: ignore[no-untyped-def]
    model = make_whisper().to("cuda", dtype)
    kw = dict(batch_buckets=(1, 2, 4), audio_buckets_s=(2.0, 5.0), max_new_tokens=12, chunk=4, early_stop=False)
    graphed = WhisperRunner(model, TOKENS, use_graphs=True, **kw)  # type: ignore[arg-type]
    eager = WhisperRunner(model, TOKENS, use_graphs=False, **kw)  # type: ignore[arg-type]
    graphed.capture()
    assert graphed.stats.captured == 2 * 3 * 2
    rng = np.random.default_rng(0)
    for ab in (2.0, 5.0):
        for bb in (1, 2, 4):
            audio = [(0.1 * rng.standard_normal(int(ab * 16000) - 800 * i)).astype(np.float32) for i in range(bb)]
            g, e = graphed.run(audio), eager.run(audio)
            assert (g.batch_bucket, g.audio_bucket_s) == (bb, ab)
            np.testing.assert_array_equal(g.tokens, e.tokens)
            np.testing.assert_array_equal(g.frames, e.frames)
