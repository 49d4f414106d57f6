"""`tristream demo`: the tri-modal assistant on bundled input (or the user's own files/devices).

`tristream demo` plays a short spoken conversation with a moving camera image through the real
pipeline (silero VAD → Whisper base → SmolLM2-135M on our engine → piper TTS, OpenCV scene
description) in real time, prints the transcript, the answers and a per-turn latency table and
writes the answer audio to a wav file.

`tristream demo --time-core` runs the time core alone on a deterministic synthetic camera +
microphone + IMU recording (own clocks with drift, fixed latencies, heavy-tailed jitter,
spikes, stalls, reordering and a microphone clock reset) and prints an alignment report against
ground truth.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        wav: Path = typer.Option(None, help="Your own speech (wav) instead of the bundled conversation."),
        video: Path = typer.Option(None, help="Your own video file instead of the bundled camera frames."),
        mic: bool = typer.Option(False, "--mic", help="Live microphone (sounddevice)."),
        camera: bool = typer.Option(False, "--camera", help="Live camera (OpenCV)."),
        out: Path = typer.Option(Path("demo_answers.wav"), "--out", help="Where the answer audio goes."),
        llm_url: str = typer.Option(None, help="OpenAI-compatible streaming chat endpoint instead of the "
                                    "embedded SmolLM2 (e.g. http://127.0.0.1:8000/v1)."),
        asr: str = typer.Option("whisper", help="ASR: whisper (base, CTranslate2) or pocketsphinx."),
        tts: str = typer.Option("piper", help="TTS: piper (joe voice) or espeak."),
        seconds: float = typer.Option(60.0, help="Live mode: how long to run (s)."),
        half_duplex: bool = typer.Option(False, "--half-duplex",
                                         help="Mute the mic while answering (speakers without echo cancel)."),
        time_core: bool = typer.Option(False, "--time-core",
                                       help="Run only the time-core alignment report on a synthetic recording."),
        seed: int = typer.Option(7, help="--time-core: seed of the synthetic recording."),
        as_json: bool = typer.Option(False, "--json", help="--time-core: print the report as JSON."),
        write_jsonl: Path = typer.Option(None, help="--time-core: also write the recording as `tristream align` input."),
    ) -> None:
        """Run the tri-modal assistant on bundled input (or --wav/--video/--mic/--camera)."""
        if time_core:
            _time_core(seconds, seed, 10.0, as_json, write_jsonl)
            return
        from tristream.pipeline.demo import DemoInputError, run_demo

        config = None
        if half_duplex:
            from tristream.pipeline.session import SessionConfig

            config = SessionConfig(barge_in=False)
        source = "your recording" if wav or video else "the live devices" if mic or camera else \
            "a bundled conversation (3 spoken questions, a moving camera image)"
        typer.echo(f"tristream demo: loading models (VAD, ASR={asr}, SmolLM2-135M, TTS={tts}, OpenCV); the first "
                   "run converts and caches weights, which takes longer.", err=True)
        typer.echo(f"tristream demo: playing {source} through the pipeline in real time; the transcript, "
                   "answers and a latency table follow.", err=True)
        try:
            run_demo(wav=str(wav) if wav else None, video=str(video) if video else None, mic=mic,
                     camera=camera, realtime=True, out_wav=str(out), llm_url=llm_url, asr=asr, tts=tts,
                     seconds=seconds, config=config)
        except DemoInputError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e

    del demo


def _time_core(seconds: float, seed: int, warmup: float, as_json: bool, write_jsonl: Path | None) -> None:
    """Align a synthetic tri-modal recording and report drift, skew and counters vs ground truth."""
    import json

    from rich.console import Console

    from tristream.core.offline import fit_source
    from tristream.core.scenario import cross_modal_error, naive_refs, run_online, set_report
    from tristream.core.synth import generate, to_events, tri_modal_specs

    if seconds < warmup + 5:
        raise typer.BadParameter(f"--seconds {seconds} must exceed the warm-up ({warmup} s) by 5 s")
    streams = generate(tri_modal_specs(), seconds, seed)
    online = run_online(streams)
    offline = {
        sid: fit_source(sid, s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns, latency_ns=s.spec.latency_ns)
        for sid, s in streams.items()
    }
    report = {
        "recording": {"seconds": seconds, "seed": seed, "packets": sum(len(s) for s in streams.values())},
        "online": cross_modal_error(streams, online.refs, warmup_s=warmup),
        "offline": cross_modal_error(streams, {k: f.ref_ns for k, f in offline.items()}, warmup_s=warmup),
        "naive_arrival": cross_modal_error(streams, naive_refs(streams), warmup_s=warmup),
        "naive_arrival_minus_latency": cross_modal_error(
            streams, naive_refs(streams, subtract_latency=True), warmup_s=warmup),
        "sync": set_report(streams, online.sets, warmup_s=warmup),
        "counters": online.counters,
        "online_seconds": round(online.seconds, 3),
    }
    if write_jsonl is not None:
        write_jsonl.write_text("".join(json.dumps(e) + "\n" for e in to_events(streams)), encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    _print(Console(width=118), streams, online, offline, report, warmup)


def _print(con, streams, online, offline, report, warmup) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    rec = report["recording"]
    con.rule("[bold]tristream demo --time-core[/] - time core on a synthetic tri-modal recording")
    con.print(
        f"{rec['seconds']:.0f} s, seed {rec['seed']}, {rec['packets']} packets: camera 30 fps (ns PTS), "
        "microphone 16 kHz in 20 ms chunks (sample index, clock reset at 31 s), IMU 200 Hz in 10-sample "
        "blocks (µs). Each source has its own drifting clock and latency; arrivals carry heavy-tailed "
        "jitter (0-20 ms), 0.5 % spikes (up to 200 ms), stalls and 1 % reordering. "
        f"Processing time is the arrival time (virtual clock); figures exclude the first {warmup:.0f} s."
    )
    t = Table(title="Per-source clocks (online estimate at the end of the run; offline two-pass fit)")
    for col in ("source", "true ppm", "online ppm", "offline ppm", "offset s", "epochs", "resets",
                "reordered", "outliers", "± µs"):
        t.add_column(col, justify="right")
    for sid, s in streams.items():
        st = online.clocks[sid].state()
        t.add_row(sid, f"{s.spec.drift_ppm:+.1f}", f"{st.drift_ppm:+.2f}",
                  f"{offline[sid].summary['drift_ppm']:+.2f}", f"{st.offset_ns / 1e9:+.6f}",
                  str(st.epoch + 1), str(st.counts.get("reset", 0)), str(st.counts.get("reordered", 0)),
                  str(st.counts.get("outlier", 0)), f"{st.uncertainty_ns / 1e3:.1f}")
    con.print(t)
    t = Table(title="Cross-modal timing error vs ground truth (ms; every packet vs nearest of each other source)")
    for col in ("method", "P50", "P99", "max", "target"):
        t.add_column(col, justify="right")
    rows = [("online SourceClock", "online", "P99 ≤ 2 ms"), ("offline (tristream align)", "offline", "P99 ≤ 0.5 ms"),
            ("naive: arrival time", "naive_arrival", ""),
            ("naive: arrival − known latency", "naive_arrival_minus_latency", "")]
    for name, key, target in rows:
        a = report[key]["all"]
        t.add_row(name, f"{a['p50']:.3f}", f"{a['p99']:.3f}", f"{a['max']:.3f}", target)
    con.print(t)
    sy = report["sync"]
    con.print(
        f"[bold]ApproximateTimeSync[/] (cam+mic+imu, max interval 40 ms): {sy['sets']} sets "
        f"({sy['complete']} complete, {sy['partial']} with a stream missing); set skew P50/P99/max "
        f"{sy['skew_ms']['p50']:.2f}/{sy['skew_ms']['p99']:.2f}/{sy['skew_ms']['max']:.2f} ms; "
        f"error of the skew vs truth P50/P99/max {sy['skew_error_ms']['p50']:.3f}/"
        f"{sy['skew_error_ms']['p99']:.3f}/{sy['skew_error_ms']['max']:.3f} ms. Sets come at the IMU's "
        "20 blocks/s, so the extra camera frames and mic chunks are counted as unmatched (they stay in the rings)."
    )
    t = Table(title="Counters (nothing is dropped without one)")
    t.add_column("component")
    t.add_column("counts by reason")
    for name, counts in report["counters"].items():
        t.add_row(name, ", ".join(f"{k}={v}" for k, v in counts.items()) or "-")
    con.print(t)
    t = Table(title="Sample aligned windows (ms since start: mapped ref / true capture)")
    for col in ("set", *streams, "skew", "missing"):
        t.add_column(col, justify="right")
    t0 = min(int(s.true_ref_ns.min()) for s in streams.values())
    n = len(online.sets)
    for k in (n // 4, n // 2, (3 * n) // 4):
        w = online.sets[k]
        cells = []
        for sid in streams:
            if sid in w.members:
                ref, (_, i) = w.members[sid][0]
                cells.append(f"{(ref - t0) / 1e6:.3f} / {(int(streams[sid].true_ref_ns[i]) - t0) / 1e6:.3f}")
            else:
                cells.append("-")
        t.add_row(str(k), *cells, f"{w.skew_ns / 1e6:.2f} ms", ",".join(w.missing) or "-")
    con.print(t)
    con.print(f"online replay (clocks + rings + synchroniser) used {report['online_seconds']:.2f} s of CPU for "
              f"{report['recording']['packets']} packets")
