"""`tristream serve` (the real CLI process) freezes its start-up heap and exports GC pauses."""

from __future__ import annotations

import urllib.request

from tests.reliability.shutdown import start_server


def test_serve_cli_exports_gc_pauses_and_froze_its_heap() -> None:
    proc, port = start_server("gc-token")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(15)
    values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("tristream_gc_")}
    assert values["tristream_gc_frozen_objects"] > 10_000, values  # the imported modules at least
    assert 'tristream_gc_collections_total{generation="2"}' in values
    assert "tristream_gc_pause_max_recent_seconds" in values


def test_serve_cli_refuses_a_negative_memory_trim_delay() -> None:
    import pytest

    with pytest.raises(RuntimeError, match="memory-trim-s"):
        proc, _ = start_server("gc-token", extra=("--memory-trim-s", "-1"))
        proc.kill()
