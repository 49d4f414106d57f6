"""`tristream replay FILE.mcap`: re-run a recorded session on a virtual clock and compare outputs."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the ``replay`` command."""

    @app.command("replay")
    def replay_cmd(
        file: Path = typer.Argument(..., exists=True, help="A recording from `tristream serve --record DIR`."),
        backend: str = typer.Option("echo", help="Backend to replay through (the one that served the session)."),
        audio: str = typer.Option(None, help="'exact' compares answer audio bytes, 'ignore' skips them "
                                  "(default: exact for echo, ignore for pipeline, whose live TTS adds noise)."),
    ) -> None:
        """Replay FILE deterministically; exit 1 if the outputs differ from the recording."""
        from rich.console import Console
        from rich.table import Table

        from tristream.observe.record import RecordingError
        from tristream.serve.backends import make_factory
        from tristream.serve.replay import replay_file

        console = Console()
        try:
            if backend == "pipeline":
                from tristream.serve.pipeline_replay import PipelineReplayDriver, replay_models

                res = replay_file(file, driver=PipelineReplayDriver(replay_models()), audio=audio or "ignore")
            else:
                res = replay_file(file, make_factory(backend, pace=0.0), audio=audio or "exact")
        except RecordingError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from exc
        table = Table(title=f"{file.name}: {len(res.recorded)} recorded / {len(res.replayed)} replayed events")
        for col in ("turn", "status", "recorded EoS->audio ms", "replayed EoS->audio ms (virtual)"):
            table.add_column(col)
        for i, t in enumerate(res.replayed_turns):
            rec = res.recorded_turns[i] if i < len(res.recorded_turns) else {}
            rv = rec.get("eos_to_first_audio_ms")
            pv = t.latencies_ms().get("eos_to_first_audio_ms")
            table.add_row(str(i + 1), t.status, "-" if rv is None else f"{rv:.1f}", "-" if pv is None else f"{pv:.1f}")
        console.print(table)
        if res.identical:
            console.print("[green]outputs identical[/green] (ids and latency fields excluded)")
        else:
            for m in res.mismatches:
                console.print(f"[red]mismatch[/red] {m}")
            raise typer.Exit(1)
