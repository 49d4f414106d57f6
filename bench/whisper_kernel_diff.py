"""Diagnostic (GPU): WhisperRunner with the speech step kernels vs torch ops, eager and graphed,
on the tiny random test model; prints tokens per configuration and model-level logits error."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.engine.speech.conftest import random_whisper  # noqa: E402
from tristream.engine.speech.config import WhisperTokens  # noqa: E402
from tristream.engine.speech.runner import WhisperRunner  # noqa: E402

TOKENS = WhisperTokens.for_vocab(51865)
for dtype in (torch.float32, torch.float16):
    model = random_whisper().to("cuda", dtype)
    kw = dict(batch_buckets=(1, 4, 16), audio_buckets_s=(2.0, 5.0), max_new_tokens=12, chunk=4, early_stop=False,
              max_draft=8)
    runs = {}
    if "--interleave" in sys.argv:  # every runner alive at once, passes interleaved (as the GPU test does)
        runners = {(g, fk): WhisperRunner(model, TOKENS, use_graphs=g, fused_kernels=fk, **kw)
                   for g in (False, True) for fk in (True, False)}
        if "--plain-first" in sys.argv:
            runners = dict(reversed(list(runners.items())))
        rng = np.random.default_rng(3)
        for k in runners:
            runs[k] = []
        for bb in (1, 4, 16):
            audio = [(0.1 * rng.standard_normal(32000 - 500 * i)).astype(np.float32) for i in range(bb)]
            for k, r in runners.items():
                runs[k].append(r.run(audio).tokens)
    else:
        for graphs in (False, True):
            for fk in (True, False):
                r = WhisperRunner(model, TOKENS, use_graphs=graphs, fused_kernels=fk, **kw)
                rng = np.random.default_rng(3)
                out = []
                for bb in (1, 4, 16):
                    audio = [(0.1 * rng.standard_normal(32000 - 500 * i)).astype(np.float32) for i in range(bb)]
                    out.append(r.run(audio).tokens)
                runs[(graphs, fk)] = out
    base = runs[(False, False)]
    for k, v in runs.items():
        print(dtype, "graphs", k[0], "kernels", k[1], "rows equal to eager torch:",
              [int((a == b).all(1).sum()) for a, b in zip(v, base, strict=True)], "of", [len(a) for a in base], flush=True)
    # model level: decode logits with and without kernels on the same cache
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(0)
        enc = torch.randn(4, 100, 64, device="cuda", generator=g).to(dtype)
        res = {}
        for fused in (False, True):
            cache = model.new_cache(4, 100, 64)
            model.fill_cross(enc, cache)
            toks = torch.randint(0, 50000, (4, 6), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
            res[fused] = model.decode(toks, torch.arange(6, device="cuda"), cache, fused=fused).float()
        err = (res[True] - res[False]).abs().max() / res[False].abs().max()
        top2 = res[False].topk(2, dim=-1).values
        print(dtype, "decode logits rel err", float(err), "argmax equal", bool((res[True].argmax(-1) == res[False].argmax(-1)).all()),
              "min top-2 margin", float((top2[..., 0] - top2[..., 1]).min()), flush=True)
