"""GC pause timing and heap freezing (tristream.observe.gcpause)."""

from __future__ import annotations

import gc

from tristream.observe.gcpause import GcPauses, gc_pauses, settle_heap
from tristream.serve.metrics import ServeMetrics


def test_collections_are_timed_per_generation_and_exported() -> None:
    ticks = iter(float(i) for i in range(1000))
    p = GcPauses(clock=lambda: next(ticks)).install()
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        p.uninstall()
    assert p.count[2] >= 1 and p.count[0] >= 1
    assert p.max_s[2] == 1.0 and p.total_s[2] >= 1.0  # start/stop one tick apart
    m = ServeMetrics()
    m.add_collector(p.collect)
    text = m.render()
    assert 'tristream_gc_collections_total{generation="2"}' in text
    assert 'tristream_gc_pause_max_seconds{generation="2"} 1' in text
    snap = p.snapshot()
    assert snap["gen2"]["count"] == p.count[2] and "frozen_objects" in snap


def test_recent_max_forgets_old_pauses() -> None:
    now = [0.0]
    p = GcPauses(clock=lambda: now[0])
    p._callback("start", {"generation": 2})
    now[0] = 0.2
    p._callback("stop", {"generation": 2})
    assert p.max_recent_s(60.0) == 0.2
    now[0] = 100.0
    assert p.max_recent_s(60.0) == 0.0 and p.max_s[2] == 0.2  # the lifetime max stays


def test_settle_heap_freezes_and_can_be_turned_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TRISTREAM_GC_FREEZE", "0")
    assert settle_heap() == 0
    monkeypatch.setenv("TRISTREAM_GC_FREEZE", "1")
    try:
        assert settle_heap() > 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # give the test process its heap back
    assert gc_pauses() is gc_pauses()
