"""`tristream serve`: the OpenAI-Realtime-compatible WebSocket server (see docs/protocol.md)."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command."""

    @app.command("serve")
    def serve_cmd(
        host: str = typer.Option("127.0.0.1", help="Interface to bind (0.0.0.0 for all)."),
        port: int = typer.Option(8765, help="TCP port for WebSocket, page, /metrics, /healthz."),
        token: list[str] = typer.Option(None, help="Accepted bearer token (repeatable); default $TRISTREAM_TOKEN."),
        no_auth: bool = typer.Option(False, "--no-auth", help="Accept clients without a token (trusted demo only)."),
        backend: str = typer.Option("echo", help="Session backend: echo (no models) or pipeline (assistant)."),
        record: Path = typer.Option(None, "--record", help="Write every session to DIR/<session>.mcap."),
        max_sessions: int = typer.Option(64, help="Concurrent sessions; more get HTTP 503."),
        max_session_s: float = typer.Option(3600.0, help="Session length limit in seconds."),
        max_message_bytes: int = typer.Option(1 << 20, help="Larger messages get an error event."),
        max_messages_per_s: float = typer.Option(200.0, help="Per-session message rate."),
        pace: float = typer.Option(1.0, help="Echo backend: answer audio pace (1 = real time, 0 = instant)."),
        otlp_endpoint: str = typer.Option(None, help="Export turn spans over OTLP/HTTP (needs opentelemetry-sdk)."),
    ) -> None:
        """Serve the Realtime API on ws://HOST:PORT/v1/realtime and the browser page on http://HOST:PORT/."""
        import asyncio
        import logging
        import signal

        from tristream.observe.tracing import TurnTracer
        from tristream.serve.backends import make_factory
        from tristream.serve.limits import ServerLimits
        from tristream.serve.server import RealtimeServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        tokens = list(token or []) or ([os.environ["TRISTREAM_TOKEN"]] if os.environ.get("TRISTREAM_TOKEN") else [])
        limits = ServerLimits(max_sessions=max_sessions, max_session_s=max_session_s,
                              max_message_bytes=max_message_bytes, max_messages_per_s=max_messages_per_s,
                              burst_messages=2 * max_messages_per_s)
        server = RealtimeServer(make_factory(backend, pace=pace), host=host, port=port, tokens=tokens,
                                require_auth=not no_auth, limits=limits, record_dir=record,
                                tracer=TurnTracer(otlp_endpoint=otlp_endpoint))

        async def main() -> None:
            await server.start()
            typer.echo(f"ws://{host}:{server.port}/v1/realtime  page http://{host}:{server.port}/  "
                       f"metrics http://{host}:{server.port}/metrics")
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            typer.echo("draining sessions ...")
            await server.stop()

        asyncio.run(main())
