"""Issue 9 item 11 (fast form): SIGTERM under load: no new sessions, in-flight sessions finish or
get an error within the drain limit, exit code 0."""

from __future__ import annotations

import asyncio

from tests.reliability.shutdown import shutdown_under_load
from tests.serve.helpers import TOKEN
from tristream.serve.limits import ServerLimits


def test_sigterm_under_load_drains_and_exits_zero() -> None:
    r = asyncio.run(asyncio.wait_for(shutdown_under_load(TOKEN, sessions=12, pace=1.0), 90))
    assert r["exit_code"] == 0, r
    assert r["newcomer"] != 101, r  # refused (503) or the port already closed
    assert r["unanswered"] == 0, r  # every session: its answer finished, or it was told
    assert r["told_shutting_down"] == 12, r
    assert set(r["close_codes"]) <= {1001}, r
    assert r["max_close_after_term_s"] <= ServerLimits().shutdown_grace_s + 2.0, r
