"""The decode graph's first kernel (`kernels/advance.py`) equals its torch reference on the input
buffer (fresh, advance, hold; padded rows; block boundaries) and gathers the ids' embeddings like
`F.embedding`. GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine._reference import advance_reference
from tristream.engine.decode_inputs import ADVANCE, FRESH, HOLD

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 2048), (8, 96)])
def test_advance_embed_equals_reference(rows: int, hidden: int) -> None:
    from tristream.engine.kernels.advance import advance_embed

    n, mb, bs, vocab = 8, 6, 16, 1000
    off = {"off_pos": n + 1, "off_slot": 2 * n + 1, "off_ctx": 3 * n + 1, "off_bt": 4 * n + 1, "off_flag": n}
    g = torch.Generator().manual_seed(rows)
    buf = torch.zeros(4 * n + 1 + n * mb, dtype=torch.int32)
    buf[:rows] = torch.randint(0, vocab, (rows,), generator=g, dtype=torch.int32)
    for r in range(rows):
        ctx = 0 if r == rows - 1 and rows > 1 else int(torch.randint(1, bs * (mb - 1), (1,), generator=g))
        buf[off["off_ctx"] + r] = ctx
        buf[off["off_pos"] + r] = ctx + 3 if ctx else 0
        buf[off["off_slot"] + r] = -1
        buf[off["off_bt"] + r * mb:off["off_bt"] + (r + 1) * mb] = torch.randperm(50, generator=g)[:mb].int()
    emb = torch.randn(vocab, hidden, dtype=torch.bfloat16, device="cuda")
    dev = buf.cuda()
    ref = buf.clone()
    for flag in (FRESH, ADVANCE, ADVANCE, HOLD, ADVANCE):
        if flag != ADVANCE:
            dev[off["off_flag"]] = flag
            ref[off["off_flag"]] = flag
        elif int(ref[off["off_flag"]]) == HOLD:
            dev[off["off_flag"]] = ADVANCE
            ref[off["off_flag"]] = ADVANCE
        h = advance_embed(dev, emb, rows, bs, max_blocks=mb, **off)
        advance_reference(ref, rows, bs, max_blocks=mb, **off)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), ref), flag
        assert torch.equal(h, F.embedding(dev[:rows].long(), emb))
    assert int(ref[off["off_ctx"]]) == int(buf[off["off_ctx"]]) + 3  # three advances happened


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_advance_embed_refuses_bad_buffers() -> None:
    from tristream.engine.kernels.advance import advance_embed

    emb = torch.zeros(10, 8, device="cuda")
    with pytest.raises(ValueError, match="int32"):
        advance_embed(torch.zeros(40, dtype=torch.int64, device="cuda"), emb, 1, 16, 2, 3, 4, 5, 1, 2)
    with pytest.raises(ValueError, match="hidden"):
        advance_embed(torch.zeros(40, dtype=torch.int32, device="cuda"), emb.t(), 1, 16, 2, 3, 4, 5, 1, 2)
