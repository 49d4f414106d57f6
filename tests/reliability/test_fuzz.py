"""Issue 9 item 6 (fast form): hypothesis stateful sequences over a live socket, a short atheris run.

The full counts (>= 10,000 sequences, >= 1,000,000 atheris executions) run in
`bench/reliability.py`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.fuzz_protocol import LiveServer, atheris_command, check_one, make_machine
from tests.serve.helpers import TOKEN

ROOT = Path(__file__).resolve().parents[2]


def test_stateful_sequences_over_a_live_socket() -> None:
    server = LiveServer(TOKEN)
    stats: dict[str, int] = {}
    try:
        machine = make_machine(server, TOKEN, stats)
        machine.TestCase.settings = settings(max_examples=40, stateful_step_count=12, deadline=None,
                                             suppress_health_check=list(HealthCheck))
        machine.TestCase().runTest()
        assert server.count("tristream_sessions_closed_total", reason="server_error") == 0
        assert server.count("tristream_client_errors_total", code="server_error") == 0
    finally:
        server.close()
    assert stats["sequences"] >= 40 and stats.get("invalid_answered", 0) > 0
    assert set(k for k in stats if k.startswith("close_")) <= {"close_1000"}


def test_the_oracle_follows_session_state_and_optional_fields() -> None:
    """Two sequences the 10,000-sequence run found, where the harness (not the server) was wrong:
    a parser-valid frame that moved the clock, then a seed frame now going backwards (refused,
    correctly); a random "unknown" key that is an optional field ("height": null, accepted)."""
    from tests.reliability.fuzz_protocol import SEEDS

    frame = next(e for e in SEEDS if e["type"].endswith("video_frame.append") and e["format"] == "jpeg")
    server = LiveServer(TOKEN)
    stats: dict[str, int] = {}
    try:
        machine = make_machine(server, TOKEN, stats)
        m = machine()
        m.wrong_value(ev=frame, val=100)  # lands on capture_ts_us: a valid frame at 100 µs
        m.valid(ev=frame)                 # the seed's 5 µs is now backwards: invalid_value expected
        m.unknown_field(ev={**frame, "capture_ts_us": 200}, key="height", val=None)  # accepted
        m.valid(ev=frame)                 # still backwards (the accepted frame moved the clock to 200)
        m.teardown()
    finally:
        server.close()
    assert stats.get("state_refusals") == 2 and stats.get("known_field_added") == 1
    assert stats["invalid_answered"] == 2 and stats["close_1000"] == 1


@settings(max_examples=300, deadline=None)
@given(raw=st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_parser_contract_on_arbitrary_input(raw: str | bytes) -> None:
    check_one(raw)  # ProtocolError with a documented code, or a valid event; nothing else


def test_atheris_short_run() -> None:
    pytest.importorskip("atheris")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(atheris_command(20000, 1), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Done 20000 runs" in out.stderr
