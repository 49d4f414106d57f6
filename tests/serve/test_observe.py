"""Metrics exposition, turn spans, and the `top` / `client` commands against a live server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.serve.helpers import TOKEN, run, running_server, tone_turns, url
from tristream.cli import app
from tristream.commands.top import parse_prometheus
from tristream.observe.tracing import TurnTracer
from tristream.serve.client import stream_media
from tristream.serve.metrics import ServeMetrics
from tristream.serve.session import TurnTiming
from tristream.stages.audio_io import write_wav


def test_prometheus_text_is_well_formed() -> None:
    m = ServeMetrics()
    m.inc("tristream_x_total", reason='a"b')
    m.inc("tristream_x_total", 2, reason="c")
    m.set("tristream_g", 3)
    for v in (1_000_000, 2_000_000, 50_000_000):
        m.observe_ns("tristream_lat_seconds", v)
    m.add_collector(lambda: [("tristream_f", "gauge", "f", [("tristream_f", {"s": "1"}, 1.0)])])
    m.add_collector(lambda: [("tristream_f", "gauge", "f", [("tristream_f", {"s": "2"}, 2.0)])])
    text = m.render()
    assert text.count("# TYPE tristream_f gauge") == 1  # merged across collectors
    parsed = parse_prometheus(text)
    assert parsed['tristream_x_total{reason="a\\"b"}'] == 1
    assert parsed['tristream_x_total{reason="c"}'] == 2
    assert parsed["tristream_lat_seconds_count"] == 3
    assert 0.049 < parsed['tristream_lat_seconds{quantile="0.99"}'] <= 0.0505
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


def test_turn_spans() -> None:
    tr = TurnTracer(keep=10)
    t = TurnTiming(speech_started=1_000, speech_stopped=5_000, transcript_done=6_000, response_started=6_500,
                   first_text=7_000, first_audio=8_000, done=20_000, status="completed")
    spans = tr.record_turn("s1", t)
    names = [s.name for s in spans]
    assert names == ["turn", "user.speech", "asr.final", "response.first_text", "response.first_audio",
                     "response.stream"]
    assert spans[0].start_ns == 1_000 and spans[0].end_ns == 20_000
    assert {s.parent for s in spans[1:]} == {"turn"}
    assert spans[4].duration_ms == (8_000 - 5_000) / 1e6
    assert tr.record_turn("s1", TurnTiming()) == []  # an unfinished turn makes no span


def test_turn_spans_export_to_opentelemetry() -> None:
    import pytest

    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    tr = TurnTracer(exporter=exp)
    tr.record_turn("s9", TurnTiming(speech_started=10**9, speech_stopped=2 * 10**9, first_audio=2_300_000_000,
                                    response_started=2_100_000_000, done=3 * 10**9, status="completed"))
    spans = {s.name: s for s in exp.get_finished_spans()}
    assert {"turn", "user.speech", "response.first_audio", "response.stream"} <= set(spans)
    root, child = spans["turn"], spans["response.first_audio"]
    assert child.parent is not None and child.parent.span_id == root.context.span_id
    assert child.end_time - child.start_time == 300_000_000
    assert root.attributes["session.id"] == "s9"


def test_server_records_turn_spans_and_top_shows_latency() -> None:
    async def go() -> tuple[int, str]:
        async with running_server() as srv:
            await stream_media(url(srv), TOKEN, tone_turns([300]), 24_000, pace=0, expect_turns=1)
            assert any(s.name == "response.first_audio" for s in srv.tracer.spans)
            loop = asyncio.get_running_loop()
            res = await loop.run_in_executor(None, lambda: CliRunner().invoke(
                app, ["top", "--once", "--url", f"http://127.0.0.1:{srv.port}/metrics"], env={"COLUMNS": "160"}))
            return res.exit_code, res.output
    code, out = run(go())  # type: ignore[misc]
    assert code == 0, out
    assert "eos_to_first_audio" in out and "sessions" in out


def test_client_command_prints_turns(tmp_path: Path) -> None:
    wav = tmp_path / "in.wav"
    write_wav(wav, tone_turns([400], rate=16_000), 16_000)

    async def go() -> tuple[int, str]:
        async with running_server() as srv:
            loop = asyncio.get_running_loop()
            res = await loop.run_in_executor(None, lambda: CliRunner().invoke(app, [
                "client", "--wav", str(wav), "--url", url(srv), "--token", TOKEN, "--pace", "0"],
                env={"COLUMNS": "200"}))
            return res.exit_code, res.output
    code, out = run(go())  # type: ignore[misc]
    assert code == 0, out
    assert "speech 400 ms" in out and "completed" in out


def test_client_command_reports_auth_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tristream.commands.errors import run as run_cli

    wav = tmp_path / "in.wav"
    write_wav(wav, tone_turns([300], rate=16_000), 16_000)

    async def go() -> int:
        async with running_server() as srv:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, lambda: run_cli(app, [
                "client", "--wav", str(wav), "--url", url(srv), "--token", "nope", "--pace", "0"]))
    code = run(go())
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "401" in err and "\n" not in err, err


def test_client_reads_video_file_and_jpeg_folder(tmp_path: Path) -> None:
    import cv2
    import numpy as np

    from tristream.serve.client import read_video_jpegs

    path = tmp_path / "clip.avi"
    vw = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    for k in range(20):  # 2 s at 10 fps
        vw.write(np.full((48, 64, 3), 10 * k, np.uint8))
    vw.release()
    frames = read_video_jpegs(path, fps=5.0)
    assert len(frames) == 10
    assert [round(t, 2) for t, _ in frames[:3]] == [0.0, 0.2, 0.4]
    assert all(j[:2] == b"\xff\xd8" for _, j in frames)
    folder = tmp_path / "jpegs"
    folder.mkdir()
    for i, (_, j) in enumerate(frames[:4]):
        (folder / f"{i:03d}.jpg").write_bytes(j)
    assert [t for t, _ in read_video_jpegs(folder, fps=2.0)] == [0.0, 0.5, 1.0, 1.5]
