from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tristream.cli import app
from tristream.core.offline import AlignInputError, align_file, parse_event
from tristream.core.synth import generate, to_events, tri_modal_specs


def _write(path: Path, events: list[dict]) -> None:  # type: ignore[type-arg]
    path.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:  # type: ignore[type-arg]
    streams = generate(tri_modal_specs(), 40.0, seed=3)
    path = tmp_path_factory.mktemp("rec") / "in.jsonl"
    _write(path, to_events(streams))
    return path, streams


def test_parse_event_units_and_durations() -> None:
    assert parse_event({"source": "mic0", "ts": 48000, "unit": "samples@16000", "samples": 320,
                        "arrival_ns": 5}) == ("mic0", 3_000_000_000, 3_020_000_000, 5)
    assert parse_event({"source": "imu", "ts": 10, "unit": "us", "samples": 10, "rate_hz": 200,
                        "arrival_ns": 7})[2] == 10_000 + 50_000_000
    with pytest.raises(ValueError, match="sample rate"):
        parse_event({"source": "a", "ts": 1, "unit": "ms", "samples": 3, "arrival_ns": 1})
    with pytest.raises(ValueError, match="missing field 'arrival_ns'"):
        parse_event({"source": "a", "ts": 1, "unit": "ms"})
    with pytest.raises(ValueError, match="non-negative"):
        parse_event({"source": "a", "ts": 1, "unit": "ms", "arrival_ns": -3})


def test_align_file_accuracy_order_and_fields(recording: tuple[Path, dict], tmp_path: Path) -> None:  # type: ignore[type-arg]
    path, streams = recording
    out = tmp_path / "out.jsonl"
    lat = {sid: s.spec.latency_ns for sid, s in streams.items()}
    summary = align_file(path, out, latency_ns=lat)
    src_lines = path.read_text().splitlines()
    out_lines = out.read_text().splitlines()
    assert len(out_lines) == len(src_lines) == summary["written"]
    truth = {(sid, int(s.ts[i]), int(s.arrival_ns[i])): int(s.true_ref_ns[i])
             for sid, s in streams.items() for i in range(len(s))}
    err = []
    for a, b in zip(src_lines, out_lines, strict=True):
        ia, ob = json.loads(a), json.loads(b)
        assert list(ob)[:-1] == list(ia) and ob["ref_ns"] == int(ob["ref_ns"])  # every field kept, same order
        err.append(abs(ob["ref_ns"] - truth[(ia["source"], ia["ts"], ia["arrival_ns"])]))
    assert np.percentile(err, 99) < 0.5e6  # issue target for offline align: P99 <= 0.5 ms
    mic = summary["sources"]["mic0"]
    assert mic["resets"] == 1 and mic["epochs"] == 2
    assert abs(summary["sources"]["cam0"]["drift_ppm"] - 80.0) < 1.0


def test_bad_lines_counted_or_strict(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"source": "a", "ts": 1, "unit": "sec", "arrival_ns": 5}\nnot json\n\n'
                 '{"source": "a", "ts": 2, "unit": "ms", "arrival_ns": 2000000}\n', encoding="utf-8")
    errors: list[AlignInputError] = []
    s = align_file(p, tmp_path / "o.jsonl", on_error=errors.append)
    assert s["invalid_lines"] == 2 and s["written"] == 1
    assert [e.line for e in errors] == [1, 2]
    assert "unknown time unit 'sec'" in str(errors[0]) and "not valid JSON" in str(errors[1])
    with pytest.raises(AlignInputError, match="line 1"):
        align_file(p, tmp_path / "o.jsonl", strict=True)


def test_cli(recording: tuple[Path, dict], tmp_path: Path) -> None:  # type: ignore[type-arg]
    path, _ = recording
    runner = CliRunner()
    out, summ = tmp_path / "o.jsonl", tmp_path / "s.json"
    res = runner.invoke(app, ["align", str(path), "-o", str(out), "--summary", str(summ),
                              "--latency", "cam0=35ms", "--latency", "mic0=10ms"])
    assert res.exit_code == 0, res.output
    data = json.loads(summ.read_text())
    assert set(data["sources"]) == {"cam0", "mic0", "imu0"}
    assert data["sources"]["cam0"]["latency_ns"] == 35_000_000
    res = runner.invoke(app, ["align", str(path), "-o", str(out)])
    assert res.exit_code == 0 and "mic0" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a"}\n', encoding="utf-8")
    res = runner.invoke(app, ["align", str(bad), "-o", str(out), "--strict"])
    assert res.exit_code == 2 and "line 1" in res.output
    res = runner.invoke(app, ["align", str(path), "-o", str(out), "--latency", "cam0"])
    assert res.exit_code != 0


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_offline_fit_with_two_percent_stamped_late(seed: int) -> None:
    """The tri-modal recording with 2 % of packets stamped late (1-9 ms too early): bins of them
    at the ends of an epoch are judged against the one side they have (2.4 ms P99 at seed 4
    when they were kept)."""
    from tristream.core.offline import fit_source
    from tristream.core.scenario import cross_modal_error
    from tristream.core.synth import stamp_late

    streams = generate(tri_modal_specs(), 60.0, seed)
    stamp_late(streams, 0.02, seed + 1000)
    refs = {sid: fit_source(sid, s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns, latency_ns=s.spec.latency_ns).ref_ns
            for sid, s in streams.items()}
    assert cross_modal_error(streams, refs, warmup_s=10.0)["all"]["p99"] <= 0.3


def test_offline_fit_rejects_too_early_packets() -> None:
    from tristream.core.offline import fit_source
    from tristream.core.synth import SourceSpec, generate_stream

    spec = SourceSpec("mic", "audio", "samples@16000", 320, 320, drift_ppm=100.0, latency_ns=10_000_000,
                      reset_at_s=30.0)
    s = generate_stream(spec, 60.0, 4)
    rng = np.random.default_rng(9)
    bad = rng.random(len(s)) < 0.02
    s.arrival_ns[bad] -= rng.integers(1_000_000, 9_000_000, int(bad.sum()))
    f = fit_source("mic", s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns, latency_ns=10_000_000)
    assert 0 < f.summary["too_early"] <= bad.sum()
    assert abs(f.summary["drift_ppm"] - 100.0) < 0.5
    assert np.percentile(np.abs(f.ref_ns - s.true_ref_ns)[~bad], 99) < 0.1e6


_FIELDS = ['"source": "mic0"', '"ts": 48000', '"unit": "samples@16000"', '"arrival_ns": 1000020456', '"samples": 320',
           '"sample_rate": 16000', '"rate_hz": 200.5', '"duration_ns": 20000000', '"modality": "audio"', '"note": "a{b}:c,d"',
           '"ref_ns": 5', '"x": [1, 2]', '"y": null', '"z": -0.5e3', '"ts": 4.5']


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from(_FIELDS), min_size=0, max_size=7), min_size=1, max_size=12),
       junk=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 200), st.sampled_from(
           [" ", "  ", "\t", "x", "}", "{", ",", ":", '"', "\\", "1", "-", ".", "e", "\u00e9", "]", "0"])), max_size=6))
def test_bulk_tokeniser_agrees_with_json(tmp_path_factory: pytest.TempPathFactory, rows: list[list[str]],
                                         junk: list[tuple[int, int, str]]) -> None:
    """The vectorised reader (`jsonl.scan`) and the line-by-line `json` path give the same
    output, the same errors at the same lines, on valid, odd and broken lines."""
    from tristream.core.offline import _align_text

    lines = ["{" + ", ".join(r) + "}" for r in rows]
    for row, at, text in junk:
        if row < len(lines):
            ln = lines[row]
            lines[row] = ln[: at % (len(ln) + 1)] + text + ln[at % (len(ln) + 1):]
    tmp = tmp_path_factory.mktemp("fuzz")
    p = tmp / "in.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    e1: list[AlignInputError] = []
    e2: list[AlignInputError] = []
    a = align_file(p, tmp / "a.jsonl", on_error=e1.append)
    b = _align_text(p, tmp / "b.jsonl", on_error=e2.append)
    a2 = align_file(p, tmp / "a2.jsonl", workers=2)  # parts decoded, fitted and written side by side
    assert (tmp / "a2.jsonl").read_bytes() == (tmp / "a.jsonl").read_bytes()
    assert {k: v for k, v in a2.items() if k != "output"} == {k: v for k, v in a.items() if k != "output"}
    assert [(e.line, str(e)) for e in e1] == [(e.line, str(e)) for e in e2]
    assert {k: v for k, v in a.items() if k != "output"} == {k: v for k, v in b.items() if k != "output"}
    out_a = [json.loads(x) for x in (tmp / "a.jsonl").read_text(encoding="utf-8").splitlines()]
    out_b = [json.loads(x) for x in (tmp / "b.jsonl").read_text(encoding="utf-8").splitlines()]
    assert out_a == out_b


def test_bulk_reader_blocks_and_parts_agree_with_json(recording: tuple[Path, dict], tmp_path: Path,  # type: ignore[type-arg]
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused line sends only its block of lines through the line-by-line decoder; lines of
    every shape (blank, indented, trailing blanks, escaped keys, floats, nulls, broken, a source
    or unit first seen late) give the same output and errors whatever the number of parts, and
    as the `json` path gives them."""
    from tristream.core import jsonl
    from tristream.core.offline import _align_text

    monkeypatch.setattr(jsonl, "_BLOCK", 64)  # many blocks: the specialised decoders are rebuilt on the way

    path, _ = recording
    lines = path.read_text(encoding="utf-8").splitlines()
    odd = ['', '   ', '  ' + lines[5], lines[6] + ' \t', lines[7].replace('"ts"', '"\\u0074s"'),
           lines[8].replace('"arrival_ns": ', '"arrival_ns": 1e3, "arrival_ns": '), '{"source": "mic0"}',
           lines[9].replace('"unit"', '"ts": 2.5, "unit"'), lines[10][:-1] + ', "x": null}', 'not json',
           lines[11][:-1] + ', "samples": -3}', lines[12][:-1] + ', "ref_ns": 7}', lines[13] + lines[13],
           '{"source": "late0", "ts": 5, "unit": "ms", "arrival_ns": 7000000}',
           lines[14].replace('"source": "', '"source": "x')]
    rng = np.random.default_rng(4)
    at = np.sort(rng.choice(len(lines), len(odd), replace=False))
    for k, text in zip(at[::-1], odd[::-1], strict=True):
        lines.insert(int(k), text)
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(lines), encoding="utf-8")  # no newline at the end
    e_ref: list[AlignInputError] = []
    ref = _align_text(p, tmp_path / "ref.jsonl", on_error=e_ref.append)
    want = [json.loads(x) for x in (tmp_path / "ref.jsonl").read_text(encoding="utf-8").splitlines()]
    for workers in (1, 2, 3):
        errs: list[AlignInputError] = []
        got = align_file(p, tmp_path / f"w{workers}.jsonl", on_error=errs.append, workers=workers)
        assert [(e.line, str(e)) for e in errs] == [(e.line, str(e)) for e in e_ref]
        assert {k: v for k, v in got.items() if k != "output"} == {k: v for k, v in ref.items() if k != "output"}
        assert [json.loads(x) for x in (tmp_path / f"w{workers}.jsonl").read_text(encoding="utf-8").splitlines()] \
            == want
    assert ref["invalid_lines"] == 4  # missing fields, "not json", samples -3, two objects on a line


@pytest.mark.parametrize("workers", [1, 2])
def test_flagged_lines_and_percent_signs_written_as_the_json_path(tmp_path: Path, workers: int) -> None:
    """Duplicates and outliers (flagged lines) amid runs of plain lines, some lines holding `%`:
    the bulk writer's output is the line-by-line path's, byte for byte."""
    from tristream.core.family import generate_family
    from tristream.core.offline import _align_text

    events = to_events(generate_family("loss", 11, 60.0))
    for k in range(0, len(events), 97):
        events[k]["note"] = "50% of %d"
    for k in range(5, len(events), 131):  # stamped impossibly early: outliers
        events[k]["arrival_ns"] = max(0, events[k]["arrival_ns"] - 300_000_000)
    p = tmp_path / "in.jsonl"
    _write(p, events)
    fast = align_file(p, tmp_path / "a.jsonl", workers=workers)
    ref = _align_text(p, tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert fast["sources"] == ref["sources"]
    text = (tmp_path / "a.jsonl").read_text()
    assert text.count('"ref_flag": "duplicate"') >= 3 and '"ref_flag": "outlier"' in text and "50% of %d" in text


@settings(max_examples=80, deadline=None)
@given(ys=st.lists(st.integers(-(10**12), 10**12), min_size=0, max_size=60), floats=st.booleans(),
       width=st.sampled_from([3, 5, 7]))
def test_running_median_is_each_windows_middle_value(ys: list[int], floats: bool, width: int) -> None:
    from tristream.core.epochs import running_median

    y = np.array(ys, np.float64 if floats else np.int64)
    got = running_median(y, width)
    n, h = y.size, width // 2
    if n <= width:
        assert np.array_equal(got, np.full(n, np.median(y) if n else 0, dtype=y.dtype))
        return
    mids = [sorted(ys[k - h : k + h + 1])[h] for k in range(h, n - h)]
    want = [mids[0]] * h + mids + [mids[-1]] * h
    assert got.dtype == y.dtype and got.tolist() == np.array(want, y.dtype).tolist()


def test_running_median_across_chunks() -> None:
    """More values than one chunk of the network (16,384): every window's middle value, as a
    partition of each window gives it, chunk edges included."""
    from tristream.core.epochs import running_median

    rng = np.random.default_rng(7)
    for y in (rng.integers(-(10**12), 10**12, 40_000), rng.integers(0, 3, 16_391), rng.standard_normal(32_774)):
        got = running_median(y)
        mids = np.partition(np.lib.stride_tricks.sliding_window_view(y, 7), 3, axis=1)[:, 3]
        assert got.dtype == y.dtype and np.array_equal(got[3:-3], mids)
        assert np.all(got[:3] == mids[0]) and np.all(got[-3:] == mids[-1])


@pytest.mark.parametrize("workers", [1, 2])
def test_output_over_a_longer_file_is_the_output_alone(recording: tuple[Path, dict], tmp_path: Path,  # type: ignore[type-arg]
                                                       workers: int) -> None:
    """An existing output file longer than the new output ends up as the new output alone (the
    file is set to its final size and overwritten, not truncated on opening)."""
    path, _ = recording
    fresh = tmp_path / "fresh.jsonl"
    align_file(path, fresh, workers=workers)
    old = tmp_path / "old.jsonl"
    old.write_bytes(b"x" * (2 * fresh.stat().st_size + 12_345))
    align_file(path, old, workers=workers)
    assert old.read_bytes() == fresh.read_bytes()
