"""`tristream client`: stream a WAV (and optional video) to a server in real time; print replies and latencies."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the ``client`` command."""

    @app.command("client")
    def client_cmd(
        wav: Path = typer.Option(..., "--wav", exists=True, help="16-bit PCM WAV to speak, as a live microphone."),
        video: Path = typer.Option(None, "--video", exists=True, help="Video file (OpenCV) or folder of JPEGs."),
        url: str = typer.Option("ws://127.0.0.1:8765/v1/realtime", help="Server WebSocket URL."),
        token: str = typer.Option(None, help="Bearer token; default $TRISTREAM_TOKEN."),
        fps: float = typer.Option(5.0, help="Video frames per second to send."),
        pace: float = typer.Option(1.0, help="1 = real time, 0 = as fast as possible."),
        timeout: float = typer.Option(60.0, help="Seconds to wait for the last answer."),
    ) -> None:
        """Speak FILE to the server like a microphone; print transcripts, answers and latencies."""
        import asyncio

        from rich.console import Console
        from rich.table import Table

        from tristream.serve.client import read_video_jpegs, read_wav, stream_media

        console = Console()
        pcm, rate = read_wav(wav)  # a ClientError is one line from the CLI (commands.errors)
        frames = read_video_jpegs(video, fps=fps) if video else None
        results = asyncio.run(stream_media(url, token or os.environ.get("TRISTREAM_TOKEN"), pcm, rate, frames,
                                           pace=pace, answer_timeout_s=timeout))
        table = Table(title=f"{wav.name}: {len(results)} turns")
        for col in ("#", "you said", "answer", "status", "EoS->text ms", "EoS->audio ms"):
            table.add_column(col)
        for i, r in enumerate(results, 1):
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            table.add_row(str(i), r.transcript, r.answer, r.status, fmt(r.eos_to_first_text_ms),
                          fmt(r.eos_to_first_audio_ms))
        console.print(table)
