"""Issue 9 item 9 (fast form): `ray.kill` one of 2 echo replicas while every session is mid-answer.

Every session on the killed replica gets a `replica_failed` error event and then close 1011;
no session on the other replica sees anything but exact answers and a normal close; a new
session is placed on a live replica and answered within 30 s. (40 sessions: `bench/reliability.py --only 9`.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from tests.reliability.ray_death import run_subprocess  # noqa: E402

pytestmark = pytest.mark.slow


def test_killed_replica_fails_only_its_own_sessions_and_new_sessions_route_within_30_s() -> None:
    r = run_subprocess(sessions=8, words=20, after_s=2.0, timeout_s=240)
    assert r["victim_sessions"] >= 1 and r["other_sessions"] >= 1, r  # least-loaded placement spreads them
    assert r["victim_sessions_with_error_event"] == r["victim_sessions"], r
    assert r["victim_error_code_is_replica_failed"], r
    assert r["victim_close_codes"] == ["1011"], r
    assert r["victim_time_to_error_s_max"] is not None and r["victim_time_to_error_s_max"] < 2.0, r
    assert r["other_sessions_affected"] == 0, r
    assert r["other_sessions_turns_completed_after_kill_min"] >= 1, r
    assert r["new_session_routed_and_answered_s"] is not None and r["new_session_routed_and_answered_s"] < 30.0, r
    assert r["new_session_replica_is_live"], r
