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
        chat_port: int = typer.Option(None, help="TCP port for the OpenAI-compatible /v1/chat/completions "
                                      "(assistant backend; default PORT+1, 0 any free port, -1 off)."),
        token: list[str] = typer.Option(None, help="Accepted bearer token (repeatable); default $TRISTREAM_TOKEN."),
        no_auth: bool = typer.Option(False, "--no-auth", help="Accept clients without a token (trusted demo only)."),
        metrics_auth: bool = typer.Option(False, "--metrics-auth", help="/metrics wants the bearer token too "
                                          "(`tristream top --token`)."),
        backend: str = typer.Option("assistant", help="Session backend: assistant (the default: VAD, Whisper ASR, "
                                    "SmolLM2 on our engine, piper TTS, camera scene; `pipeline` is the same), "
                                    "engine[:device=cuda,model=...,stages=none|embedded|gpu,sched=ours|fifo|none] "
                                    "(our engine under the scheduler; docs/protocol.md) or echo (a test backend, "
                                    "no models). Tokens may carry a tier: SECRET@gold|silver|bronze."),
        model: str = typer.Option(None, "--model", "-m", help="assistant: a .gguf file or Hugging Face folder "
                                  "instead of the embedded SmolLM2-135M-Instruct."),
        device: str = typer.Option("auto", help="assistant: the LLM's device (cpu, cuda or auto)."),
        quant: str = typer.Option("auto", help="assistant: LLM weights (auto = int4 on CPU, none, int8, int4, fp8 on CUDA 8.9+)."),
        record: Path = typer.Option(None, "--record", help="Write every session to DIR/<session>.mcap."),
        max_sessions: int = typer.Option(64, help="Concurrent sessions; more get HTTP 503."),
        max_session_s: float = typer.Option(3600.0, help="Session length limit in seconds."),
        max_message_bytes: int = typer.Option(1 << 20, help="Larger messages get an error event."),
        max_messages_per_s: float = typer.Option(200.0, help="Per-session message rate."),
        drain_s: float = typer.Option(30.0, help="On SIGTERM/Ctrl-C: how long sessions may finish before closing."),
        memory_trim_s: float = typer.Option(None, help="After many sessions closed, give freed heap back to the OS "
                                            "this many seconds later (glibc malloc_trim; 0 = never; default "
                                            "$TRISTREAM_MEMORY_TRIM_S or 2; docs/serve-memory.md)."),
        pace: float = typer.Option(1.0, help="Echo backend: answer audio pace (1 = real time, 0 = instant)."),
        otlp_endpoint: str = typer.Option(None, help="Export turn spans over OTLP/HTTP (needs opentelemetry-sdk)."),
        ray: bool = typer.Option(False, "--ray", help="Serve through Ray Serve: engine replicas, sessions pinned "
                                 "to the replica that holds their state (see docs/scale.md)."),
        replicas: int = typer.Option(2, help="--ray: initial replicas."),
        min_replicas: int = typer.Option(None, help="--ray: autoscaling lower bound (default: --replicas)."),
        max_replicas: int = typer.Option(None, help="--ray: autoscaling upper bound (default: --replicas)."),
        replica_gpus: float = typer.Option(None, help="--ray: GPUs per replica (default 1 where CUDA exists, else 0)."),
        ray_address: str = typer.Option(None, help="--ray: join this Ray cluster instead of starting a local one."),
        ray_ingress: str = typer.Option("direct", help="--ray: direct (the ingress processes listen on HOST:PORT, "
                                        "one per replica) or proxy (through Ray Serve's HTTP proxy)."),
    ) -> None:
        """Serve the Realtime API on ws://HOST:PORT/v1/realtime and the browser page on http://HOST:PORT/."""
        import asyncio
        import logging
        import signal

        from tristream.observe.gcpause import gc_pauses, settle_heap
        from tristream.observe.tracing import TurnTracer
        from tristream.serve.backends import make_factory
        from tristream.serve.limits import ServerLimits
        from tristream.serve.server import RealtimeServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("websockets.server").setLevel(logging.WARNING)  # not a line per connection
        from tristream.commands.errors import UserError, check_device, check_model
        from tristream.serve.backends import BACKENDS, parse_spec

        tokens = list(token or []) or ([os.environ["TRISTREAM_TOKEN"]] if os.environ.get("TRISTREAM_TOKEN") else [])
        if not tokens and not no_auth:  # before loading any model
            raise UserError("auth is required but no token was given: pass --token SECRET (or set "
                            "TRISTREAM_TOKEN), or --no-auth for a trusted local demo")
        base, opts = parse_spec(backend)
        if base in ("assistant", "pipeline"):
            check_device(device)
            check_model(model)
            extra = {"model": model, "device": None if device == "auto" else device,
                     "quant": None if quant == "auto" else quant}
            opts.update({k: v for k, v in extra.items() if v})
            backend = base + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
        elif model or device != "auto" or quant != "auto":
            raise UserError(f"--model/--device/--quant are options of the assistant backend; with {base!r} "
                            f"put them in the backend spec (e.g. --backend engine:device=cpu,model=PATH)")
        if base not in BACKENDS and not ray:
            make_factory(backend)  # raises UnknownBackend with a did-you-mean hint, before any loading
        _port_free(host, port)
        if ray:
            _serve_ray(host, port, tokens, no_auth, backend, max_sessions, replicas, min_replicas, max_replicas,
                       replica_gpus, ray_address, record, ray_ingress)
            return
        max_sessions = fit_sessions_to_fd_limit(max_sessions, per_session=2 if record else 1)
        limits = ServerLimits(max_sessions=max_sessions, max_session_s=max_session_s,
                              max_message_bytes=max_message_bytes, max_messages_per_s=max_messages_per_s,
                              burst_messages=2 * max_messages_per_s, shutdown_grace_s=drain_s)
        if memory_trim_s is not None:
            if memory_trim_s < 0:
                raise typer.BadParameter("--memory-trim-s must be >= 0 (0 turns trimming off)")
            limits.memory_trim_s = memory_trim_s
        try:
            factory = make_factory(backend, pace=pace)
        except ValueError as exc:  # a bad engine option value
            raise UserError(f"--backend {backend}: {exc}") from exc
        chat_default = chat_port is None
        if chat_port is None:
            chat_port = port + 1 if port else 0
        server = RealtimeServer(factory, host=host, port=port, tokens=tokens,
                                require_auth=not no_auth, limits=limits, record_dir=record,
                                tracer=TurnTracer(otlp_endpoint=otlp_endpoint),
                                chat_port=None if chat_port < 0 else chat_port, chat_required=not chat_default,
                                metrics_auth=metrics_auth)

        async def main() -> None:
            await server.start()
            # models loaded: time GC pauses (/metrics) and freeze the start-up heap so that full
            # collections stop walking it (tristream.observe.gcpause)
            server.metrics.add_collector(gc_pauses().collect)
            settle_heap()
            typer.echo(f"ws://{host}:{server.port}/v1/realtime  page http://{host}:{server.port}/  "
                       f"metrics http://{host}:{server.port}/metrics"
                       + "".join(f"  {name} {server.chat_url}{path}" for name, path in server.side_routes()))
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            typer.echo("draining sessions ...")
            await server.stop()

        asyncio.run(main())


def _port_free(host: str, port: int) -> None:
    """Fail fast (before loading models) when HOST:PORT is taken."""
    import errno
    import socket

    from tristream.commands.errors import UserError

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is already in use (another server?): stop it or "
                                "pass another --port") from exc
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


FD_RESERVE = 128  # model files, logs, the listening socket, the event loop's own descriptors


def fit_sessions_to_fd_limit(max_sessions: int, per_session: int = 1, reserve: int = FD_RESERVE) -> int:
    """Make room for `max_sessions` open sockets: raise the soft RLIMIT_NOFILE to the hard limit,
    and if that is still too small, lower `max_sessions` (with a warning) so that sessions past it
    get a clear HTTP 503 instead of hanging — past the limit accept() fails with EMFILE and the
    event loop stops accepting for a while."""
    import logging
    import resource

    need = max_sessions * per_session + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fitted = max(1, (soft - reserve) // per_session)
        logging.getLogger("tristream.serve").warning(
            "open-file limit %d leaves room for %d sessions, not --max-sessions %d: serving at most %d "
            "(raise it with `ulimit -n`)", soft, fitted, max_sessions, fitted)
        return fitted
    return max_sessions


def _serve_ray(host: str, port: int, tokens: list[str], no_auth: bool, backend: str, max_sessions: int,
               replicas: int, min_replicas: int | None, max_replicas: int | None, replica_gpus: float | None,
               ray_address: str | None, record: Path | None, ingress: str = "direct") -> None:
    """`tristream serve --ray`: the same protocol through the Ray Serve app of `tristream.scale`."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        typer.echo("error: --ray needs Ray Serve: pip install 'tristream[scale]'", err=True)
        raise typer.Exit(2)
    if record is not None:
        typer.echo("error: --record is not supported with --ray yet (record on a single server)", err=True)
        raise typer.Exit(2)
    if not tokens and not no_auth:
        typer.echo("error: auth is required but no token was given: pass --token (or TRISTREAM_TOKEN), "
                   "or --no-auth for a trusted local demo", err=True)
        raise typer.Exit(2)
    if replica_gpus is None:
        import torch

        replica_gpus = 1.0 if torch.cuda.is_available() else 0.0
    from tristream.scale.app import config_from_args, run_ray_server

    lo = replicas if min_replicas is None else min_replicas
    hi = max(replicas, lo) if max_replicas is None else max_replicas
    cfg = config_from_args({"backend": backend, "replicas": replicas, "min_replicas": lo, "max_replicas": hi,
                            "replica_gpus": replica_gpus, "token": ",".join(tokens), "no_auth": str(no_auth),
                            "max_sessions": max_sessions, "target_p99_ms": 50, "ingress": ingress})
    typer.echo(f"ws://{host}:{port}/v1/realtime via Ray Serve ({ingress} ingress), {replicas} replica(s) "
               f"({replica_gpus:g} GPU each); Ctrl-C stops")
    import signal

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # run_ray_server shuts Serve down on it

    signal.signal(signal.SIGTERM, _stop)
    run_ray_server(cfg, host=host, port=port, address=ray_address)
