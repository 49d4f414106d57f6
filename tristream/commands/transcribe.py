"""`tristream transcribe FILE.wav`: offline transcript with times (silero VAD + Whisper or pocketsphinx)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer


class Engine(StrEnum):
    """ASR engines embedded in the CPU defaults."""

    whisper = "whisper"
    pocketsphinx = "pocketsphinx"


class Window(StrEnum):
    """Whisper encoder window."""

    audio = "audio"
    full = "full"


def _fmt(ns: int) -> str:
    s = ns / 1e9
    return f"{int(s // 60):02d}:{s % 60:06.3f}"


def transcribe(
    file: Path = typer.Argument(..., help="WAV file (PCM; any rate ≥ 8 kHz is resampled to 16 kHz)."),
    engine: Engine = typer.Option(Engine.whisper, "--engine", "-e", help="ASR engine."),
    window: Window = typer.Option(Window.audio, help="Whisper: encode only the audio ('audio') or 30 s ('full')."),
    partials: bool = typer.Option(False, help="Also print partial hypotheses."),
    threads: int = typer.Option(2, help="CPU threads for Whisper."),
) -> None:
    """Print the transcript of FILE with start–end times of each utterance."""
    from tristream.stages.asr import transcribe_offline
    from tristream.stages.audio_io import load_wav_16k
    from tristream.stages.base import BadAudio, ModelUnavailable
    from tristream.stages.vad import SileroVAD

    try:
        pcm, rate = load_wav_16k(file)
    except BadAudio as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if rate != 16_000:
        typer.echo(f"note: resampled {rate} Hz → 16000 Hz", err=True)
    try:
        vad = SileroVAD()
        if engine == Engine.whisper:
            from tristream.stages.asr_whisper import WhisperASR

            asr_stream = WhisperASR(threads=threads, window=window.value).stream(
                "cli", partial_every_s=1.0 if partials else None)
        else:
            from tristream.stages.asr_pocketsphinx import PocketsphinxASR

            asr_stream = PocketsphinxASR().stream("cli", partial_every_s=0.5 if partials else None)
    except ModelUnavailable as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(3) from e
    results = transcribe_offline(pcm, vad.stream("cli"), asr_stream)
    finals = [t for t in results if t.final]
    for t in results:
        if t.final or partials:
            tag = "" if t.final else "  (partial)"
            typer.echo(f"[{_fmt(t.start_ns)} → {_fmt(t.end_ns)}] {t.text}{tag}")
    if not finals:
        typer.echo(f"no speech found in {file} ({pcm.shape[0] / 16000:.1f} s of audio)", err=True)


def register(app: typer.Typer) -> None:
    """Add the `transcribe` command to the CLI."""
    app.command("transcribe")(transcribe)
