"""`tristream report FILE.mcap`: latency CDF and timeline PNGs of a recorded session."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the ``report`` command."""

    @app.command("report")
    def report_cmd(
        file: Path = typer.Argument(..., exists=True, help="A recording from `tristream serve --record DIR`."),
        out: Path = typer.Option(None, help="Output folder (default: next to FILE)."),
    ) -> None:
        """Draw FILE's latency CDF and timeline as PNGs and print the per-turn latencies."""
        from rich.console import Console
        from rich.table import Table

        from tristream.observe.record import read_recording
        from tristream.serve.report import draw_report, turns_from_events

        console = Console()
        events = read_recording(file)  # a RecordingError is one line from the CLI (commands.errors)
        paths = draw_report(events, out or file.parent, file.stem)
        table = Table(title=f"{file.name}")
        for col in ("turn", "status", "EoS->transcript ms", "EoS->text ms", "EoS->audio ms"):
            table.add_column(col)
        for i, t in enumerate(turns_from_events(events), 1):
            f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            table.add_row(str(i), t.status, f(t.latency_ms("transcript")), f(t.latency_ms("first_text")),
                          f(t.latency_ms("first_audio")))
        console.print(table)
        for p in paths:
            console.print(f"wrote {p}")
