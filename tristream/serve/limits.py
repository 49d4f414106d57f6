"""Per-session and per-server limits, and the token bucket that enforces rates.

Limits protect other sessions from one bad or greedy client: a message over
``max_message_bytes`` or over the rate gets an ``error`` event and is dropped (counted);
only messages over ``hard_message_bytes`` close the connection (the WebSocket layer cannot
buffer them). Buckets run on an injected clock so tests need no sleeps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(slots=True)
class ServerLimits:
    """Knobs of the server; defaults suit a laptop demo and the loopback tests."""

    max_sessions: int = 64
    max_message_bytes: int = 1 << 20          # 1 MiB: a 640x480 JPEG or 10 s of 24 kHz audio
    hard_message_bytes: int = 8 << 20         # larger frames close the connection (1009)
    max_messages_per_s: float = 200.0
    burst_messages: float = 400.0
    max_bytes_per_s: float = 4 << 20
    burst_bytes: float = 16 << 20
    max_session_s: float = 3600.0
    max_outbox_events: int = 2048             # unsent server events before a client counts as slow
    send_timeout_s: float = 10.0              # one blocked send longer than this = slow client
    write_buffer_bytes: int = 1 << 20         # user-space send buffer per connection before sends block
    shutdown_grace_s: float = 30.0
    # Heap trim (tristream.serve.memtrim): this long after a session closes, if the open sessions
    # fell by >= memory_trim_min_sessions and to half of their peak, give freed heap back to the OS
    # (glibc malloc_trim). 0 = never; default from $TRISTREAM_MEMORY_TRIM_S (2 s).
    memory_trim_s: float = field(default_factory=lambda: _env_float("TRISTREAM_MEMORY_TRIM_S", 2.0))
    memory_trim_min_sessions: int = 64
    memory_trim_collect: bool | None = None   # gc.collect() before the trim; None: under PYTHONMALLOC=malloc


class TokenBucket:
    """Classic token bucket: ``take(n, now_s)`` is True if ``n`` tokens were available."""

    __slots__ = ("burst", "last_s", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now_s: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0 (got {rate}, {burst})")
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.last_s = now_s

    def take(self, n: float, now_s: float) -> bool:
        """Refill for the elapsed time, then take ``n`` tokens if there are enough."""
        if now_s > self.last_s:
            self.tokens = min(self.burst, self.tokens + (now_s - self.last_s) * self.rate)
            self.last_s = now_s
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False
