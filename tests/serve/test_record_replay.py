"""Record a live session to MCAP, replay it on a virtual clock, compare; draw the report."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests.serve.helpers import TOKEN, run, running_server, tone_turns, url
from tristream.cli import app
from tristream.observe.record import read_recording
from tristream.sched.clock import VirtualClock
from tristream.serve.backends import make_factory
from tristream.serve.client import stream_media
from tristream.serve.replay import replay_file
from tristream.serve.report import turns_from_events


def _record(tmp_path: Path) -> Path:
    async def go() -> None:
        async with running_server(tmp_path) as srv:
            # Real-time pace so that the live interleaving equals the replay's (answers finish between chunks).
            res = await stream_media(url(srv), TOKEN, tone_turns([300, 500], gap_ms=700), 24_000, pace=1.0,
                                     expect_turns=2, tail_silence_s=0.2)
            assert [r.transcript for r in res] == ["speech 300 ms", "speech 500 ms"]
    run(go())
    files = list(tmp_path.glob("*.mcap"))
    assert len(files) == 1
    return files[0]


def test_record_replay_report_roundtrip(tmp_path: Path) -> None:
    path = _record(tmp_path)
    events = read_recording(path)
    dirs = {e.direction for e in events}
    assert dirs == {"in", "out", "meta"}
    assert [e.ref_ns for e in events] == sorted(e.ref_ns for e in events)
    turns = turns_from_events(events)
    assert [t.status for t in turns] == ["completed", "completed"]
    assert all((t.latency_ms("first_audio") or -1) >= 0 for t in turns)

    res = replay_file(path, make_factory("echo"))
    assert res.identical, res.mismatches
    assert len(res.replayed_turns) == 2
    # On the virtual clock the echo backend takes no time: latency is purely algorithmic.
    assert res.replayed_turns[1].latencies_ms()["eos_to_first_audio_ms"] == 0.0

    runner = CliRunner()
    r = runner.invoke(app, ["replay", str(path)])
    assert r.exit_code == 0, r.output
    assert "outputs identical" in r.output
    r = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    pngs = sorted(p.name for p in (tmp_path / "rep").glob("*.png"))
    assert pngs == [f"{path.stem}_latency_cdf.png", f"{path.stem}_timeline.png"]
    assert all((tmp_path / "rep" / p).stat().st_size > 5000 for p in pngs)


def test_replay_detects_a_changed_backend(tmp_path: Path) -> None:
    """Replaying through a backend that answers differently reports mismatches (not a rubber stamp)."""
    from tristream.serve.echo import EchoBackend

    class Louder(EchoBackend):
        def create_response(self, instructions: str | None, ref_ns: int) -> None:
            self._texts.append("changed")
            super().create_response(instructions, ref_ns)

    path = _record(tmp_path)
    res = replay_file(path, lambda: Louder())
    assert not res.identical
    assert any("changed" in m for m in res.mismatches)


def test_virtual_clock_monotonic() -> None:
    c = VirtualClock(10)
    c.advance_to(5)
    assert c() == 10
    c.advance_to(20)
    assert c() == 20
