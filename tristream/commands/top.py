"""`tristream top`: a live terminal view of a running server (reads its /metrics)."""

from __future__ import annotations

import typer

from tristream.commands.errors import UserError


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            out[key] = float(val)
        except ValueError:
            continue
    return out


def register(app: typer.Typer) -> None:
    """Add the ``top`` command."""

    @app.command("top")
    def top_cmd(
        url: str = typer.Option("http://127.0.0.1:8765/metrics", help="The server's /metrics URL."),
        interval: float = typer.Option(1.0, help="Refresh period in seconds."),
        once: bool = typer.Option(False, help="Print one snapshot and exit."),
        token: str = typer.Option(None, help="Bearer token, for a server run with --metrics-auth "
                                  "(default: $TRISTREAM_TOKEN)."),
    ) -> None:
        """Sessions, message rates, latency quantiles and drops of a running server, refreshed live."""
        import os
        import time
        import urllib.error
        import urllib.request

        from rich.console import Console, Group
        from rich.live import Live
        from rich.table import Table

        secret = token or os.environ.get("TRISTREAM_TOKEN")
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}

        def snapshot(prev: dict[str, float] | None, dt: float) -> tuple[Group, dict[str, float]]:
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
                    m = parse_prometheus(r.read().decode())
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    raise UserError(f"{url} wants a bearer token (the server runs with --metrics-auth): "
                                    "pass --token or set TRISTREAM_TOKEN") from None
                raise UserError(f"{url} answered HTTP {exc.code} {exc.reason}") from None
            head = Table(title=f"tristream top — {url}", show_header=True)
            for col in ("sessions", "msgs in/s", "events out/s", "errors", "dropped"):
                head.add_column(col)
            def rate(prefix: str) -> float:
                now = sum(v for k, v in m.items() if k.startswith(prefix))
                before = sum(v for k, v in (prev or {}).items() if k.startswith(prefix))
                return (now - before) / dt if prev is not None and dt > 0 else 0.0
            head.add_row(f"{m.get('tristream_sessions_active', 0):.0f}", f"{rate('tristream_messages_in_total'):.0f}",
                         f"{rate('tristream_events_out_total'):.0f}",
                         f"{sum(v for k, v in m.items() if k.startswith('tristream_client_errors_total')):.0f}",
                         f"{sum(v for k, v in m.items() if 'dropped_total' in k):.0f}")
            lat = Table(title="latency (ms)")
            for col in ("metric", "p50", "p95", "p99", "count"):
                lat.add_column(col)
            names = sorted({k.split("{")[0] for k in m if k.endswith('quantile="0.5"}')})
            for n in names:
                q = [m.get(f'{n}{{quantile="{x}"}}', 0.0) * 1e3 for x in ("0.5", "0.95", "0.99")]
                lat.add_row(n.replace("tristream_", "").replace("_seconds", ""), *(f"{v:.1f}" for v in q),
                            f"{m.get(n + '_count', 0):.0f}")
            drops = Table(title="drops by reason")
            drops.add_column("counter")
            drops.add_column("value")
            for k, v in sorted(m.items()):
                if "dropped_total" in k or "refused_total" in k:
                    drops.add_row(k, f"{v:.0f}")
            return Group(head, lat, drops), m

        console = Console()
        view, prev = snapshot(None, 0.0)
        if once:
            console.print(view)
            return
        t_prev = time.monotonic()
        with Live(view, console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                now = time.monotonic()
                view, prev = snapshot(prev, now - t_prev)
                t_prev = now
                live.update(view)
