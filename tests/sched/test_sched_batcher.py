from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.sched.batcher import Batcher, BatchLimits
from tristream.sched.steptime import (
    DECODE_BUCKETS,
    StepSample,
    StepTimeModel,
    bucket_for,
    fit_step_time,
    read_samples_csv,
)
from tristream.sched.types import Kind, Tier, WorkItem, WorkModality

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "sched_steptime.csv"
_ids = iter(range(1, 10**9))


def wi(kind: Kind, tokens: int = 0, images: int = 0, asr: int = 0, sid: int = 0) -> WorkItem:
    mod = {Kind.ASR_CHUNK: WorkModality.SPEECH, Kind.VISION_FRAME: WorkModality.VISION}.get(kind, WorkModality.TEXT)
    return WorkItem(next(_ids), sid, Tier.SILVER, mod, kind, 0, 0, tokens=tokens, images=images, asr_units=asr)


def test_bucket_for() -> None:
    assert bucket_for(0, DECODE_BUCKETS) == 0
    assert [bucket_for(n, DECODE_BUCKETS) for n in (1, 2, 3, 5, 9, 100, 128)] == [1, 2, 4, 8, 16, 128, 128]
    with pytest.raises(ValueError, match="largest captured bucket 128"):
        bucket_for(129, DECODE_BUCKETS)


def test_committed_coefficients_match_a_refit_of_the_committed_data() -> None:
    fitted = fit_step_time(read_samples_csv(DATA.read_text()), "refit")
    default = StepTimeModel()
    for name in ("c0", "c_dec", "c_pf", "v0", "v1", "a0", "a1"):
        assert getattr(default, name) == pytest.approx(getattr(fitted, name), rel=1e-3, abs=1e-6), name


def test_fit_recovers_known_coefficients() -> None:
    truth = StepTimeModel(1.0, 0.01, 0.002, 3.0, 0.1, 2.0, 0.05, source="truth")
    rows = [StepSample("llm", d, p, 0, 0, truth.step_ms(d, p, 0, 0), "syn") for d, p in
            [(1, 0), (8, 0), (64, 0), (0, 100), (4, 300)]]
    rows += [StepSample("vision", 0, 0, n, 0, truth.step_ms(0, 0, n, 0), "syn") for n in (1, 4, 16)]
    rows += [StepSample("asr", 0, 0, 0, n, truth.step_ms(0, 0, 0, n), "syn") for n in (1, 8)]
    got = fit_step_time(rows, "syn")
    for name in ("c0", "c_dec", "c_pf", "v0", "v1", "a0", "a1"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-9)


def test_fit_rejects_too_little_data() -> None:
    with pytest.raises(ValueError, match="at least 2 vision samples"):
        fit_step_time([StepSample("llm", 1, 0, 0, 0, 1.0, "x"), StepSample("llm", 2, 0, 0, 0, 1.1, "x")], "x")


def test_decode_pads_to_bucket_in_step_time() -> None:
    m = StepTimeModel()
    assert m.step_ms(3, 0, 0, 0) == m.step_ms(4, 0, 0, 0)
    assert m.step_ms(5, 0, 0, 0) > m.step_ms(4, 0, 0, 0)
    assert m.step_ms(0, 0, 0, 0) == 0.0


def test_token_budget_and_chunked_prefill() -> None:
    b = Batcher(StepTimeModel(), BatchLimits(token_budget=100))
    decodes = [wi(Kind.DECODE, 1, sid=i) for i in range(30)]
    long_prompt = wi(Kind.PREFILL, tokens=500, sid=99)
    plan = b.build(decodes + [long_prompt], budget_ms=1e9)
    assert plan.decode == 30 and plan.prefill_tokens == 100 and plan.tokens == 130  # decode slots are separate
    entry = plan.entries[-1]
    assert entry.item is long_prompt and not entry.completes


def test_head_is_always_taken_even_over_budget() -> None:
    b = Batcher(StepTimeModel())
    te = wi(Kind.TURN_END, tokens=40, asr=1)
    plan = b.build([te, wi(Kind.VISION_FRAME, images=1)], budget_ms=0.5)
    assert [e.item for e in plan.entries] == [te]
    assert plan.entries[0].completes


def test_caps_follow_captured_buckets() -> None:
    b = Batcher(StepTimeModel())
    frames = [wi(Kind.VISION_FRAME, images=1, sid=i) for i in range(40)]
    asr = [wi(Kind.ASR_CHUNK, asr=1, sid=i) for i in range(40)]
    dec = [wi(Kind.DECODE, 1, sid=i) for i in range(300)]
    plan = b.build(frames + asr + dec, budget_ms=1e9)
    assert (plan.images, plan.asr_units, plan.decode) == (32, 16, 128)
    assert plan.decode_bucket == 128


def test_sticky_items_go_first() -> None:
    b = Batcher(StepTimeModel(), BatchLimits(max_decode=4))
    running = [wi(Kind.DECODE, 1, sid=i) for i in range(4)]
    urgent = wi(Kind.DECODE, 1, sid=50)
    plan = b.build([urgent] + running, budget_ms=1e9, sticky=running)
    assert urgent not in [e.item for e in plan.entries]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["d", "v", "a", "p"]), min_size=1, max_size=80), st.floats(2.0, 40.0))
def test_plan_respects_budget_unless_single_head(kinds: list[str], budget: float) -> None:
    b = Batcher(StepTimeModel(), BatchLimits(free_ms=0.0))
    mk = {"d": lambda: wi(Kind.DECODE, 1), "v": lambda: wi(Kind.VISION_FRAME, images=1),
          "a": lambda: wi(Kind.ASR_CHUNK, asr=1), "p": lambda: wi(Kind.PREFILL, tokens=64)}
    items = [mk[k]() for k in kinds]
    plan = b.build(items, budget)
    assert plan.entries and plan.entries[0].item is items[0]
    head_only = StepTimeModel().step_ms(*(
        (1, 0, 0, 0) if kinds[0] == "d" else (0, 0, 1, 0) if kinds[0] == "v" else
        (0, 0, 0, 1) if kinds[0] == "a" else (0, 64, 0, 0)))
    assert plan.est_ms <= max(budget, head_only) + 1e-9
    assert plan.prefill_tokens <= b.limits.token_budget


def test_calibrated_model_learns_the_measured_ratio() -> None:
    from tristream.sched.steptime import CalibratedStepTime

    cal = CalibratedStepTime(StepTimeModel(), alpha=0.2)
    for d in (1, 8, 32, 64):
        for _ in range(20):
            cal.observe(d, 64, 0, 0, 3.0 * StepTimeModel().step_ms(d, 64, 0, 0))
    assert cal.ratio == pytest.approx(3.0, rel=0.01)
    assert cal.step_ms(8, 64, 0, 0) == pytest.approx(3.0 * StepTimeModel().step_ms(8, 64, 0, 0), rel=0.01)
    with pytest.raises(ValueError, match="alpha"):
        CalibratedStepTime(alpha=0.0)


def test_nonneg_fit_clips_noisy_negative_slopes() -> None:
    rows = [StepSample("llm", d, 0, 0, 0, 2.0 - 0.001 * d, "noisy") for d in (1, 8, 64)]
    rows += [StepSample("llm", 0, p, 0, 0, 2.0 + 0.01 * p, "noisy") for p in (16, 256)]
    rows += [StepSample("vision", 0, 0, n, 0, 1.0, "flat") for n in (1, 8)]
    rows += [StepSample("asr", 0, 0, 0, n, 5.0 + 0.1 * n, "x") for n in (1, 16)]
    with pytest.raises(ValueError, match="negative"):
        fit_step_time(rows, "strict")
    m = fit_step_time(rows, "clipped", nonneg=True)
    assert m.c_dec == 0.0 and m.c_pf > 0 and m.v1 >= 0 and m.a1 == pytest.approx(0.1, rel=1e-6)
