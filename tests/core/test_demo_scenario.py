from __future__ import annotations

import json
from importlib.resources import files

from typer.testing import CliRunner

from tristream.cli import app
from tristream.core.scenario import cross_modal_error, naive_refs, run_online, set_report
from tristream.core.synth import generate, tri_modal_specs


def test_online_tri_modal_meets_skew_target() -> None:
    streams = generate(tri_modal_specs(), 45.0, seed=5)
    res = run_online(streams)
    err = cross_modal_error(streams, res.refs, warmup_s=10.0)
    assert err["all"]["p99"] <= 2.0  # SPEC: cross-modal skew P99 <= 2 ms after compensation
    naive = cross_modal_error(streams, naive_refs(streams), warmup_s=10.0)
    assert naive["all"]["p99"] > 10 * err["all"]["p99"]
    rep = set_report(streams, res.sets)
    assert rep["sets"] > 500 and rep["skew_error_ms"]["p99"] <= 2.0
    assert res.counters["clock:mic0"]["reset"] == 1


def test_demo_json_report() -> None:
    res = CliRunner().invoke(app, ["demo", "--time-core", "--seconds", "20", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["online"]["all"]["p99"] <= 2.0 and rep["offline"]["all"]["p99"] <= 0.5
    assert set(rep["counters"]) >= {"clock:cam0", "ring:mic0", "sync"}


def test_demo_text_report() -> None:
    res = CliRunner().invoke(app, ["demo", "--time-core", "--seconds", "20"])
    assert res.exit_code == 0, res.output
    for needle in ("Per-source clocks", "Cross-modal timing error", "naive: arrival time", "Counters",
                   "Sample aligned windows"):
        assert needle in res.output


def test_bundled_sample_recording_is_small_and_valid() -> None:
    data = files("tristream").joinpath("data/sample_recording.jsonl").read_text(encoding="utf-8")
    assert len(data) < 1_000_000
    lines = data.splitlines()
    assert len(lines) > 1000 and {json.loads(ln)["source"] for ln in lines} == {"cam0", "mic0", "imu0"}
