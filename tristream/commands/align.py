"""`tristream align`: map a recorded JSONL event file onto the reference clock (two passes)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

_MAX_SHOWN_ERRORS = 20


def _parse_latency(items: list[str]) -> dict[str, int]:
    from tristream.core.units import parse_unit

    out: dict[str, int] = {}
    for item in items:
        src, sep, value = item.partition("=")
        num = value.rstrip("abcdefghijklmnopqrstuvwxyzµ")
        unit = value[len(num):] or "ms"
        if not sep or not src or not num:
            raise typer.BadParameter(f"--latency {item!r}; expected SOURCE=VALUE[unit], e.g. cam0=35ms")
        try:
            out[src] = parse_unit(unit).to_ns(float(num))
        except (ValueError, ArithmeticError) as exc:
            raise typer.BadParameter(f"--latency {item!r}: {exc}") from exc
    return out


def register(app: typer.Typer) -> None:
    @app.command()
    def align(
        input: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True,
                                     help="JSONL: one event per line with source, ts, unit, arrival_ns."),
        output: Path = typer.Option(..., "-o", "--output", help="Where to write the events with ref_ns."),
        summary: Path = typer.Option(None, "--summary", help="Write the per-source summary JSON here "
                                     "(default: a table on stderr)."),
        strict: bool = typer.Option(False, "--strict", help="Stop at the first malformed line."),
        latency: list[str] = typer.Option([], "--latency", help="Known capture-to-arrival latency of a "
                                          "source, e.g. --latency cam0=35ms (repeatable; default 0)."),
        progress: bool = typer.Option(None, "--progress/--no-progress",
                                      help="Progress bar (default: on for files over 8 MB on a terminal)."),
    ) -> None:
        """Align a recording: every event is written back, in input order, with `ref_ns` added.

        Each source's clock is fitted over the whole file (drift, offset per epoch, resets,
        outliers); `ref_ns` is the event's capture time (first sample) on the reference clock.
        """
        import json

        from rich.console import Console
        from rich.table import Table
        from tqdm import tqdm

        from tristream.core.offline import AlignInputError, align_file

        err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
        shown = 0

        def on_error(e: AlignInputError) -> None:
            nonlocal shown
            shown += 1
            if shown <= _MAX_SHOWN_ERRORS:
                err.print(f"[yellow]skipped[/] {input}:{e}")

        size = input.stat().st_size
        show = progress if progress is not None else (size > 8 << 20 and sys.stderr.isatty())
        bar = tqdm(total=2 * size, unit="B", unit_scale=True, desc="align", disable=not show, file=sys.stderr)
        try:
            result = align_file(input, output, latency_ns=_parse_latency(latency), strict=strict,
                                on_error=on_error, progress=bar.update)
        except AlignInputError as exc:
            bar.close()
            err.print(f"[red]error[/] {input}:{exc} (--strict)")
            raise typer.Exit(2) from None
        bar.close()
        if shown > _MAX_SHOWN_ERRORS:
            err.print(f"... and {shown - _MAX_SHOWN_ERRORS} more malformed lines")
        if summary is not None:
            summary.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
            err.print(f"wrote {result['written']} events to {output}; summary in {summary}")
            return
        table = Table(title=f"{result['written']} events -> {output} ({result['invalid_lines']} invalid lines)")
        for col in ("source", "packets", "drift ppm", "offset s", "epochs", "resets", "wraps", "dups",
                    "gaps/lost", "outliers", "too early", "reordered", "late", "delay P50/P99 ms"):
            table.add_column(col, justify="right")
        for src, s in result["sources"].items():
            d = s.get("delay_above_min_ms", {})
            off = s["offset_ns"]
            table.add_row(src, str(s["packets"]), f"{s['drift_ppm']:+.3f}",
                          "-" if off is None else f"{off / 1e9:.6f}", str(s["epochs"]), str(s["resets"]),
                          str(s["wraps"]), str(s["duplicates"]), f"{s['gaps']}/{s['lost_packets']}", str(s["outliers"]), str(s["too_early"]), str(s["out_of_order"]), str(s["late"]),
                          f"{d.get('p50', 0):.2f}/{d.get('p99', 0):.2f}")
        err.print(table)
