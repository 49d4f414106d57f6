"""The greedy-token kernel (`kernels/argmax.py`) equals torch.argmax: first index on ties,
rows that are all -inf, vocabularies that are not a multiple of its chunk, several rows, and
repeated calls (its per-row counters must reset). GPU, or CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]


@pytest.fixture(scope="module")
def device() -> str:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cpu"


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 51865), (8, 5000), (2, 2048), (1, 7)])
def test_greedy_tokens_equal_torch_argmax(device: str, rows: int, vocab: int) -> None:
    from tristream.engine.kernels.argmax import greedy_tokens

    g = torch.Generator().manual_seed(rows * vocab)
    for trial in range(3):  # repeated calls reuse the counters
        x = torch.randn(rows, vocab, generator=g)
        if trial == 1:  # ties: the max value at several places, in different chunks
            x[:, [vocab // 3, vocab - 1, 0]] = 50.0
        if trial == 2 and rows > 1:
            x[1] = -float("inf")
        x = x.to(device)
        got = greedy_tokens(x)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got.cpu(), x.cpu().argmax(-1)), (trial, got, x.argmax(-1))


def test_greedy_tokens_refuses_other_shapes(device: str) -> None:
    from tristream.engine.kernels.argmax import greedy_tokens

    with pytest.raises(ValueError, match="rows, vocab"):
        greedy_tokens(torch.zeros(4, device=device))


def test_sampler_greedy_uses_it_on_the_logits_device(device: str) -> None:
    from tristream.engine.sampler import greedy_tokens

    x = torch.randn(4, 3000, device=device)
    assert torch.equal(greedy_tokens(x).cpu(), x.cpu().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_argmax_writes_tokens_and_ids(device: str, dtype: torch.dtype) -> None:
    from tristream.engine.kernels.argmax import GraphArgmax

    rows, vocab = 3, 5000
    am = GraphArgmax(rows, vocab, torch.device(device))
    ids = torch.full((rows + 2,), -7, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(3)
    for trial in range(3):  # its own counters reset between calls
        x = torch.randn(rows, vocab, generator=g)
        if trial == 1:
            x[:, [11, vocab - 1]] = 40.0  # a tie: the first index wins
        x = x.to(device=device, dtype=dtype)
        out = am(x, ids[:rows])
        want = x.float().cpu().argmax(-1)
        assert out is am.out and torch.equal(out.cpu(), want)
        assert torch.equal(ids[:rows].cpu(), want.to(torch.int32))
        assert ids[rows:].tolist() == [-7, -7]  # nothing past its rows
    with pytest.raises(ValueError, match="GraphArgmax"):
        am(torch.zeros(rows, vocab + 1, device=device), ids[:rows])
    with pytest.raises(ValueError, match="int32"):
        am(torch.zeros(rows, vocab, device=device), ids[:rows].long())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs CUDA")
def test_graph_argmax_replays_in_a_cuda_graph() -> None:
    from tristream.engine.kernels.argmax import GraphArgmax

    x = torch.randn(2, 49152, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int32, device="cuda")
    am = GraphArgmax(2, 49152, torch.device("cuda"))
    am(x, ids)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        am(x, ids)
    for _ in range(3):
        x.copy_(torch.randn(2, 49152, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        am.count_replay()
        torch.cuda.synchronize()
        assert torch.equal(am.out, x.float().argmax(-1)) and torch.equal(ids, am.out.int())
        view, stamp = am.host_tokens()  # the mapped host slot of this replay: no copy
        assert view.device.type == "cpu" and view.tolist() == am.out.tolist()
        am.check_host(stamp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mapped pinned memory needs CUDA")
def test_graph_argmax_host_slots_alternate_and_catch_uncounted_runs() -> None:
    from tristream.engine.kernels.argmax import GraphArgmax

    am = GraphArgmax(3, 3000, torch.device("cuda"))
    ids = torch.zeros(3, dtype=torch.int32, device="cuda")
    seen = []
    for _ in range(4):
        x = torch.randn(3, 3000, device="cuda")
        am(x, ids)
        seen.append((am.host_tokens(), x.argmax(-1).tolist()))
    torch.cuda.synchronize()
    (v2, s2), want2 = seen[2]
    (v3, s3), want3 = seen[3]
    assert (s2, s3) == (3, 4) and v2.tolist() == want2 and v3.tolist() == want3  # two slots, both intact
    am.check_host(s3)
    with pytest.raises(RuntimeError, match="expected run 2"):  # overwritten by run 4
        am.check_host(2)
    with pytest.raises(RuntimeError, match="the host counted"):  # run 3's other slot holds run 4, not yet counted
        am.calls = 3
        am.check_host(3)
    am.calls = 4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        am(x, ids)
    assert am.calls == 4  # capturing runs nothing
    graph.replay()  # not counted
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="ran 5 times, the host counted 4"):
        am.check_host(am.host_tokens()[1])
