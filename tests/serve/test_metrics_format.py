"""The text exposition keeps every digit of a sample and parses back with prometheus-client."""

from __future__ import annotations

from tristream.serve.metrics import ServeMetrics, fmt_value


def test_values_are_exact_and_parse_back() -> None:
    from prometheus_client import parser
    m = ServeMetrics()
    m.inc("tristream_messages_in_total", 1_234_567.0)
    m.inc("tristream_bytes_in_total", 98_765_432_109.0, kind="audio")
    m.set("tristream_frame_ring_fill_ratio", 0.123456789)
    m.add_collector(lambda: [("tristream_clock_drift_ppm", "gauge", "drift", [
        ("tristream_clock_drift_ppm", {"source": "mic"}, -37.000001), ("tristream_clock_drift_ppm", {"source": "x"},
                                                                        float("inf"))])])
    text = m.render()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in parser.text_string_to_metric_families(text) for s in fam.samples}
    assert got[("tristream_messages_in_total", ())] == 1_234_567.0  # %g would print 1.23457e+06
    assert got[("tristream_bytes_in_total", (("kind", "audio"),))] == 98_765_432_109.0
    assert got[("tristream_frame_ring_fill_ratio", ())] == 0.123456789
    assert got[("tristream_clock_drift_ppm", (("source", "mic"),))] == -37.000001
    assert got[("tristream_clock_drift_ppm", (("source", "x"),))] == float("inf")
    assert [fmt_value(v) for v in (0.0, 3.0, 2.5, float("-inf"))] == ["0", "3", "2.5", "-Inf"]
    assert fmt_value(float("nan")) == "NaN"
