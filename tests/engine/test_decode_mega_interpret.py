"""The batch-1 decode megakernel (`kernels/decode_mega.py`) against `decode_logits_b1` and the torch
reference forward on a tiny random Llama: logits and the K/V rows it writes, over a context spanning
several non-contiguous cache blocks, with and without q/k/v biases, with tiles small enough that
every loop (units per program, K tiles, attention blocks) takes several turns.

Phase-by-phase mode runs on GPU or on CPU under TRITON_INTERPRET=1; the persistent single-launch
mode (grid barriers) only on a GPU, where it is compared with phase-by-phase, `decode_logits_b1`
in bf16 and CUDA-graph replays (the barrier counters reset themselves between launches).
"""

from __future__ import annotations

import os

import pytest
import torch

from tristream.engine.attention import AttnMetadata, SeqSlice, TorchAttention
from tristream.engine.config import ModelConfig
from tristream.engine.kv_cache import KVCache
from tristream.engine.models.llama import LlamaModel

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]

BLOCK = 4
TABLE = [5, 2, 9, 0, 7, 11, 3]  # non-contiguous blocks of the sequence


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def tiny_model(bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0, head_dim: int = 16) -> LlamaModel:
    """2 layers, hidden 64, 4 q heads / 2 kv heads, intermediate 96, vocab 300: random weights."""
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=head_dim, max_position=512, tie_word_embeddings=True,
                      attention_bias=bias, rms_norm_eps=1e-5)
    m = LlamaModel(cfg, dtype=dtype, device=_device(), max_positions=512)
    g = torch.Generator(device=_device()).manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2 if p.dim() == 2 else 0.3, generator=g)
            if p.dim() == 1 and p.shape[0] == cfg.hidden_size:  # norm weights around 1
                p.add_(1.0)
    return m


def filled_cache(m: LlamaModel, seed: int = 1) -> KVCache:
    cache = KVCache(m.cfg, 16, BLOCK, m.dtype, device=m.device)
    g = torch.Generator(device=m.device).manual_seed(seed)
    cache.k.normal_(0, 1, generator=g)
    cache.v.normal_(0, 1, generator=g)
    return cache


def clone_cache(m: LlamaModel, src: KVCache) -> KVCache:
    c = KVCache(m.cfg, src.num_blocks, src.block_size, m.dtype, device=m.device)
    c.k.copy_(src.k)
    c.v.copy_(src.v)
    return c


def step_inputs(pos: int, token: int, dev: torch.device | str) -> dict[str, torch.Tensor]:
    """Device inputs of a batch-1 step at `pos` (context pos + 1), shaped like `DecodeGraphs`' [:1] slices."""
    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=dev)

    return {"ids": i32([token]), "positions": i32([pos]), "slots": i32([TABLE[pos // BLOCK] * BLOCK + pos % BLOCK]),
            "block_tables": i32(TABLE).view(1, -1), "ctx_lens": i32([pos + 1])}


def ref_b1(m: LlamaModel, cache: KVCache, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    from tristream.engine.graphs import TritonDecodeAttention
    from tristream.engine.kernels.decode_fused import decode_logits_b1

    attn = TritonDecodeAttention(m, cache, inp["positions"], inp["slots"], inp["block_tables"], inp["ctx_lens"], 1)
    return decode_logits_b1(m, m.embed(inp["ids"].long()), attn)


def ref_torch(m: LlamaModel, cache: KVCache, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own forward (torch attention over the paged cache)."""
    pos = int(inp["positions"][0])
    idx = torch.tensor([TABLE[n // BLOCK] * BLOCK + n % BLOCK for n in range(pos + 1)], device=m.device)
    meta = AttnMetadata(positions=inp["positions"].long(), seqs=[SeqSlice(0, 1, pos + 1, kv_index=idx)],
                        slot_mapping=inp["slots"].long())
    return m.logits(m(m.embed(inp["ids"].long()), TorchAttention(m.cfg, m.cos_sin, meta, cache, m.dtype)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("bias", "splits"), [(False, 1), (True, 1), (False, 4)])
def test_phase_by_phase_equals_decode_logits_b1_and_torch(bias: bool, splits: int) -> None:
    from tristream.engine.kernels.decode_mega import MegaDecoder

    m = tiny_model(bias)
    cache_ref = filled_cache(m)
    cache_torch = clone_cache(m, cache_ref)
    cache_mega = clone_cache(m, cache_ref)
    # small tiles: several units per program, several K tiles per row, several attention blocks
    # splits=4: 8-token splits of an 18-20-token context, the last one empty
    mega = MegaDecoder(m, cache_mega, num_programs=3, tile_elems=256, max_block_k=16, attn_block=8,
                       attn_splits=splits)
    assert mega.consts["BK_QKV"] < m.cfg.hidden_size and mega.consts["BK_D"] < m.cfg.intermediate_size
    for step, pos in enumerate((17, 18, 19)):  # contexts of 18-20 tokens over 5 blocks
        inp = step_inputs(pos, token=31 + 7 * step, dev=m.device)
        want = ref_b1(m, cache_ref, inp)
        want_torch = ref_torch(m, cache_torch, inp)
        got = mega(**inp, persistent=False).clone()
        assert got.shape == (1, m.cfg.vocab_size) and got.dtype == torch.float32
        assert rel(got, want) < 1e-4, step
        assert rel(got, want_torch) < 1e-4, step
        assert got.std() > 0.1  # not a degenerate all-equal row
        slot = int(inp["slots"][0])
        for layer in range(m.cfg.num_layers):  # the K/V rows written at the step's slot
            (kr, vr), (kg, vg) = cache_ref.flat(layer), cache_mega.flat(layer)
            assert rel(kg[slot], kr[slot]) < 1e-5 and rel(vg[slot], vr[slot]) < 1e-5
            assert kg[slot].abs().sum() > 0
    assert int(mega.counters.abs().sum()) == 0  # every head's split count was reset by its merge
    # nothing but the three written slots changed
    assert torch.allclose(cache_mega.k, cache_ref.k, rtol=1e-5, atol=1e-5)
    assert torch.allclose(cache_mega.v, cache_ref.v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("bias", "splits"), [(False, 1), (True, 2)])
def test_persistent_path_with_one_program_equals_phases(bias: bool, splits: int) -> None:
    """The single-launch code path (layer loop, barriers, next-layer preloads, counter reset) with a
    grid of one program, whose barriers open at its own arrival: runs in the interpreter too."""
    from tristream.engine.kernels.decode_mega import MegaDecoder

    m = tiny_model(bias, seed=2)
    c_one, c_ref = filled_cache(m), filled_cache(m)
    one = MegaDecoder(m, c_one, num_programs=1, tile_elems=256, max_block_k=16, attn_block=8, attn_splits=splits)
    for step, pos in enumerate((14, 15)):
        inp = step_inputs(pos, token=100 + step, dev=m.device)
        want = ref_b1(m, c_ref, inp)
        got = one(**inp, persistent=True).clone()
        assert rel(got, want) < 1e-4, step
        assert int(one.counters.abs().sum()) == 0  # reset by the last program out
    assert torch.allclose(c_one.k, c_ref.k, rtol=1e-5, atol=1e-5)
    assert torch.allclose(c_one.v, c_ref.v, rtol=1e-5, atol=1e-5)


def test_slot_minus_one_writes_nothing() -> None:
    from tristream.engine.kernels.decode_mega import MegaDecoder

    m = tiny_model(False, seed=3)
    cache = filled_cache(m)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    inp = step_inputs(9, token=5, dev=m.device)
    inp["slots"].fill_(-1)
    MegaDecoder(m, cache, num_programs=2)(**inp, persistent=False)
    assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)


def test_refuses_unsupported_shapes_and_modes() -> None:
    from tristream.engine.kernels.decode_mega import MegaDecoder, UnsupportedMegaShape

    m = tiny_model(False)
    cache = filled_cache(m)
    mega = MegaDecoder(m, cache, num_programs=2)
    inp = step_inputs(5, token=3, dev=m.device)
    two = dict(inp, ids=torch.cat([inp["ids"], inp["ids"]]))
    with pytest.raises(UnsupportedMegaShape, match="batch 1"):
        mega(**two, persistent=False)
    with pytest.raises(UnsupportedMegaShape, match="batch 1"):
        mega(**dict(inp, block_tables=inp["block_tables"].repeat(2, 1)), persistent=False)
    odd = tiny_model(False, head_dim=12)
    with pytest.raises(UnsupportedMegaShape, match="power of two"):
        MegaDecoder(odd, filled_cache(odd))
    with pytest.raises(UnsupportedMegaShape, match="KV cache"):
        MegaDecoder(m, KVCache(m.cfg, 4, BLOCK, torch.float16, device=m.device))
    with pytest.raises(UnsupportedMegaShape, match="attn_splits"):
        MegaDecoder(m, cache, attn_splits=3)
    with pytest.raises(ValueError, match="spin"):
        MegaDecoder(m, cache, spin="sleepy")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="persistent=False"):
            mega(**inp, persistent=True)


# ------------------------------------------------------------------ GPU only: the persistent launch

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="the grid barrier needs a GPU")


@gpu_only
@pytest.mark.parametrize(("spin", "bias", "splits"),
                         [("atomic", False, 1), ("atomic", True, 1), ("volatile", False, 1), ("atomic", False, 8)])
def test_persistent_equals_phases_and_b1_in_bf16(spin: str, bias: bool, splits: int) -> None:
    from tests.engine._tiny import random_llama_cuda
    from tristream.engine.kernels.decode_mega import MegaDecoder

    m = random_llama_cuda(torch.bfloat16, num_layers=4, attention_bias=bias)
    base = KVCache(m.cfg, 64, BLOCK, m.dtype, device="cuda")
    base.k.normal_(0, 1)
    base.v.normal_(0, 1)
    caches = [clone_cache(m, base) for _ in range(3)]
    persistent = MegaDecoder(m, caches[0], spin=spin, attn_splits=splits)
    phased = MegaDecoder(m, caches[1], num_programs=persistent.num_programs, spin=spin, attn_splits=splits)
    inp = step_inputs(22, token=1234, dev="cuda")
    got = persistent(**inp).clone()
    torch.cuda.synchronize()
    assert int(persistent.counters.abs().sum()) == 0  # the last program reset them
    info = persistent.kernel_info
    assert info is not None and info["num_programs"] <= info["max_programs"]
    step = phased(**inp, persistent=False).clone()
    want = ref_b1(m, caches[2], inp)
    # the same arithmetic in the same order; two compiled kernels may still contract mul+add differently
    assert rel(got, step) < 5e-3 and int(got.argmax()) == int(step.argmax())
    assert rel(caches[0].k, caches[1].k) < 1e-3 and rel(caches[0].v, caches[1].v) < 1e-3
    assert rel(got, want) < 2e-2, rel(got, want)
    assert int(want.argmax()) in got[0].topk(5).indices.tolist()  # bf16 rounding may swap near-ties only


@gpu_only
def test_persistent_in_a_cuda_graph_replays() -> None:
    from tests.engine._tiny import random_llama_cuda
    from tristream.engine.kernels.decode_mega import MegaDecoder

    m = random_llama_cuda(torch.bfloat16, num_layers=4)
    base = KVCache(m.cfg, 64, BLOCK, m.dtype, device="cuda")
    base.k.normal_(0, 1)
    base.v.normal_(0, 1)
    cg, ce = clone_cache(m, base), clone_cache(m, base)
    graphed, eager = MegaDecoder(m, cg), MegaDecoder(m, ce)
    inp = step_inputs(10, token=7, dev="cuda")
    graphed(**inp)  # compile and check residency outside the capture
    torch.cuda.synchronize()
    cg.k.copy_(base.k)
    cg.v.copy_(base.v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = graphed(**inp)
    for step, pos in enumerate(range(10, 16)):  # six replays, each a new position, token and slot
        new = step_inputs(pos, token=7 + 13 * step, dev="cuda")
        for k, v in new.items():
            inp[k].copy_(v)
        g.replay()
        want = eager(**new, persistent=False)
        torch.cuda.synchronize()
        assert rel(out, want) < 5e-3 and int(out.argmax()) == int(want.argmax()), step
        assert int(graphed.counters.abs().sum()) == 0  # reset by the kernel itself, ready for the next replay
    assert rel(cg.k, ce.k) < 1e-3 and rel(cg.v, ce.v) < 1e-3


@gpu_only
def test_phase_timestamps() -> None:
    from tests.engine._tiny import random_llama_cuda
    from tristream.engine.kernels.decode_mega import MegaDecoder

    m = random_llama_cuda(torch.bfloat16, num_layers=3)
    cache = KVCache(m.cfg, 16, BLOCK, m.dtype, device="cuda")
    mega = MegaDecoder(m, cache, timestamps=True)
    inp = step_inputs(6, token=9, dev="cuda")
    mega(**inp)
    mega(**inp)
    t = mega.phase_times_us()
    assert set(t) == {"qkv_rope_store", "attention", "o_proj", "gate_up", "down", "head", "total"}
    assert all(v > 0 for v in t.values())
    assert 0.5 * t["total"] < 3 * sum(t[k] for k in t if k not in ("head", "total")) + t["head"] < 2 * t["total"]


@gpu_only
def test_refuses_a_grid_that_cannot_be_resident() -> None:
    from tests.engine._tiny import random_llama_cuda
    from tristream.engine.kernels.decode_mega import MegaDecoder, UnsupportedMegaShape

    m = random_llama_cuda(torch.bfloat16, num_layers=1)
    cache = KVCache(m.cfg, 8, BLOCK, m.dtype, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mega = MegaDecoder(m, cache, num_programs=64 * sms)
    with pytest.raises(UnsupportedMegaShape, match="resident"):
        mega(**step_inputs(3, token=1, dev="cuda"))
