"""The scheduler drives the real LLM engine through the benchmark's plan driver
(`bench/real_backend.py`; tiny random Llama on CPU; virtual clock advanced by
the measured step times, so nothing sleeps)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from bench.real_backend import EncoderLoad, RealEngineBackend, time_scheduler  # noqa: E402
from tristream.engine.config import ModelConfig  # noqa: E402
from tristream.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from tristream.sched.clock import VirtualClock  # noqa: E402
from tristream.sched.config import PRESETS  # noqa: E402
from tristream.sched.driver import run  # noqa: E402
from tristream.sched.real import random_llama  # noqa: E402
from tristream.sched.scheduler import Scheduler  # noqa: E402
from tristream.sched.session import WorkShape  # noqa: E402
from tristream.sched.trace import TraceConfig, generate_trace  # noqa: E402
from tristream.sched.types import Kind  # noqa: E402

TINY = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position=4096)


@pytest.mark.parametrize("name", ["ours", "fifo"])
def test_scheduler_drives_the_real_engine(name: str) -> None:
    torch.set_grad_enabled(False)
    eng = LLMEngine(random_llama(TINY, "cpu", torch.float32), None,
                    EngineConfig(block_size=16, num_blocks=2048, use_graphs=False))
    backend = RealEngineBackend(eng, prefix_tokens=16, seed=1)
    cfg = PRESETS[name](shape=WorkShape(vision_tokens_per_frame=8))
    sched = Scheduler(cfg)
    planned_decodes = 0
    plan_fn = sched.plan

    def counting_plan(now: int):  # type: ignore[no-untyped-def]
        nonlocal planned_decodes
        p = plan_fn(now)
        planned_decodes += sum(1 for e in p.entries if e.item.kind is Kind.DECODE)
        return p

    sched.plan = counting_plan  # type: ignore[method-assign]
    trace = TraceConfig(sessions=4, duration_s=4.0, seed=4, answer_tokens=(3, 8), lifetime_s=(1.5, 3.0),
                        gap_s=(0.3, 1.0), speak_s=(0.3, 1.0))
    res = run(sched, backend, VirtualClock(), generate_trace(trace), int(4e9))
    served = [t for t in res.turns if math.isfinite(t.latency_ms)]
    st = backend.stats
    assert len(served) >= 5
    # every end of turn the scheduler completed got its first token from the engine in that step
    assert st.first_tokens == len(served)
    assert st.missing_first_token == 0
    # the engine decoded exactly the planned sequences, nothing else
    assert st.unplanned_tokens == 0
    assert st.decode_tokens == planned_decodes
    assert len(st.samples) == res.steps and all(s[4] > 0 for s in st.samples)


def test_real_backend_uses_the_public_step_and_records_a_phase_breakdown() -> None:
    """Graphed-runner encoder load (eager on CPU), the engine's public step API, per-phase timing."""
    torch.set_grad_enabled(False)
    eng = LLMEngine(random_llama(TINY, "cpu", torch.float32), None,
                    EngineConfig(block_size=16, num_blocks=2048, use_graphs=False))
    cfg_before = (eng.config.max_batch, eng.config.max_prefill_tokens)
    enc = EncoderLoad("cpu", asr_window_s=1.0, asr_tokens=2, tiny=True)
    backend = RealEngineBackend(eng, enc, prefix_tokens=16, seed=2)
    sched = Scheduler(PRESETS["ours"](shape=WorkShape(vision_tokens_per_frame=8)))
    time_scheduler(sched, backend)
    trace = TraceConfig(sessions=3, duration_s=3.0, seed=5, answer_tokens=(3, 6), lifetime_s=(1.5, 3.0),
                        gap_s=(0.3, 1.0), speak_s=(0.3, 1.0))
    res = run(sched, backend, VirtualClock(), generate_trace(trace), int(3e9))
    st = backend.stats
    assert (eng.config.max_batch, eng.config.max_prefill_tokens) == cfg_before  # no reaching into the engine
    assert st.first_tokens >= 1 and st.missing_first_token == 0 and st.unplanned_tokens == 0
    assert enc.images == sum(s[2] for s in st.samples) and enc.images > 0
    assert enc.asr_passes >= sum(1 for s in st.samples if s[3]) > 0
    assert len(st.phases) == len(st.samples) == res.steps
    seen = set().union(*(ph.keys() for ph in st.phases))
    assert {"backend", "asr", "vision", "engine", "prefill", "sample", "sched"} <= seen
    for ph, smp in zip(st.phases, st.samples, strict=True):  # the phases tile the step's wall time
        covered = sum(h for name, (h, _g) in ph.items() if name != "sched")
        assert covered <= smp[4] * 1.05 + 0.5 and covered >= smp[4] * 0.8 - 0.5
