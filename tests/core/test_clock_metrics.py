"""Every duplicate, gap, wrap and reset a source clock counts reaches the Prometheus text."""

from __future__ import annotations

import re

from tristream.core.clock import SourceClock
from tristream.core.family import generate_family
from tristream.core.scenario import run_online
from tristream.serve.metrics import CLOCK_EVENTS, ServeMetrics, clock_families


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    out = {}
    for m in re.finditer(rf'^{name}{{event="([^"]+)",session="s1",source="([^"]+)"}} (\S+)$', text, re.M):
        out[(m.group(2), m.group(1))] = float(m.group(3))
    return out


def test_clock_counters_exported_per_source() -> None:
    streams = generate_family("all", 3, 60.0)
    online = run_online(streams, sync=False)
    m = ServeMetrics()
    m.add_collector(lambda: clock_families(online.clocks, session="s1"))
    text = m.render()
    got = _samples(text, "tristream_clock_events_total")
    for sid, clock in online.clocks.items():
        counts = clock.counts.snapshot()
        for ev in CLOCK_EVENTS:  # zeros too: a dashboard sees the series before the first fault
            assert got[(sid, ev)] == counts.get(ev, 0)
        truth = streams[sid].meta["truth"]
        assert (got[(sid, "wrap")], got[(sid, "duplicate")], got[(sid, "reset")], got[(sid, "gap")],
                got[(sid, "lost")]) == (truth["wraps"], truth["duplicates"], truth["resets"], truth["gaps"],
                                        truth["lost"])
        assert re.search(rf'^tristream_clock_open_gaps{{session="s1",source="{sid}"}} {clock.open_gaps}$', text, re.M)
    assert text.count("# TYPE tristream_clock_events_total counter") == 1
    assert sum(got.values()) > 0


def test_clock_for_unit_counts_wraps_not_resets() -> None:
    c = SourceClock.for_unit("cam0", "rtp@90000")
    assert c.wrap_ns == (1 << 32) * 1e9 / 90000
    fresh = clock_families({"cam0": SourceClock("cam0")})
    assert dict((f[0], f[3][0][2]) for f in fresh)["tristream_clock_uncertainty_seconds"] == -1.0
    wrap = c.wrap_ns
    t = int(wrap) - 2_000_000_000
    for k in range(200):  # 33 ms frames across the wrap, stamped raw (wrapped) in ns
        raw = (t + k * 33_333_333) % round(wrap)
        c.observe(raw, 10**12 + k * 33_333_333)
    assert c.counts["wrap"] == 1 and c.counts["reset"] == 0 and c.epoch == 0


def test_one_clock_per_stream() -> None:
    """Audio spans and frame instants of one device through one clock show holes and
    reordering that are not there; a clock per stream counts none."""
    import numpy as np

    rng = np.random.default_rng(0)
    ev = [(k * 20_000_000 + 20_000_000 + int(rng.exponential(2e6)), 0, k * 20_000_000) for k in range(3000)]
    ev += [(k * 33_333_333 + 5_000_000 + int(rng.exponential(2e6)), 1, k * 33_333_333) for k in range(1800)]
    ev.sort()
    shared, mic, cam = SourceClock("client"), SourceClock("mic"), SourceClock("cam")
    for arr, is_frame, start in ev:
        if is_frame:
            shared.observe(start, arr)
            cam.observe(start, arr)
        else:
            shared.observe_span(start, start + 20_000_000, arr)
            mic.observe_span(start, start + 20_000_000, arr)
    assert shared.counts["gap"] > 100 and shared.counts["reordered"] > 100
    assert mic.counts.total == 0 and cam.counts.total == 0
