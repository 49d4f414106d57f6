"""Hand heap memory freed by closed sessions back to the OS (glibc ``malloc_trim``) after a burst.

A server that held N sessions at once keeps most of their memory mapped after they close, though
nothing references it any more (docs/serve-memory.md; `bench/serve_rss.py`: 10,000 sessions open
at once take the echo server from ~50 to ~330 MB, and it stayed there once they closed). Two
allocators hold it:

- CPython's small-object allocator (pymalloc) returns a 1 MiB arena only when every block in it
  is free. The few blocks that outlive a burst (the bounded turn history, free lists, caches)
  are spread over every arena the burst used, so nearly all stay mapped (~225 MB after 10,000).
  Nothing from outside CPython can release them.
- glibc's malloc (objects over 512 bytes: frame and JSON buffers, large dicts and lists) keeps
  freed chunks in its free lists (50-80 MB after 10,000). ``malloc_trim(0)`` gives their whole
  pages back, in ~5 ms for that heap.

The next burst reuses the memory (a second wave of the same size does not grow RSS), so it is a
high-water mark, not a leak. `MemoryTrimmer` returns the glibc part once the open sessions have
fallen to half of their peak: a check ``check_s`` after a session closes, never on the message
path. Where the C library has no ``malloc_trim`` (musl, macOS) it does nothing. Under
``PYTHONMALLOC=malloc`` Python's small objects live on glibc too, and the trim (after a garbage
collection) gives back nearly everything; docs/serve-memory.md has the figures and the cost.
"""


from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from tristream.serve.metrics import Family

log = logging.getLogger("tristream.serve")

_UNSET: Any = object()
_trim_fn: Any = _UNSET


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` through ctypes (the C library the process already has loaded), or
    None where there is none (musl, macOS, Windows)."""
    for name in (None, "libc.so.6"):
        try:
            fn = ctypes.CDLL(name).malloc_trim
        except (OSError, AttributeError, TypeError):
            continue
        fn.argtypes = [ctypes.c_size_t]
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]
    return None


def _malloc_trim_fn() -> Callable[[int], int] | None:
    global _trim_fn
    if _trim_fn is _UNSET:
        _trim_fn = _load_malloc_trim()
    return _trim_fn  # type: ignore[no-any-return]


def trim_available() -> bool:
    """Whether the C library has ``malloc_trim`` (glibc)."""
    return _malloc_trim_fn() is not None


def malloc_trim(pad: int = 0) -> bool | None:
    """``malloc_trim(pad)``: True if memory went back to the OS, False if none did, None without glibc."""
    fn = _malloc_trim_fn()
    return None if fn is None else bool(fn(pad))


def rss_bytes() -> int | None:
    """Resident set size of this process from ``/proc/self/statm`` (None where there is no /proc)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryTrimmer:
    """Trims the heap once the open sessions have fallen to half of their peak.

    The server calls `opened` and `closed` with the number of open sessions (a comparison each, on
    connect and disconnect only). ``check_s`` after a close, if the sessions have dropped by at
    least ``min_sessions`` and to at most half of the peak since the last trim, `trim` runs
    once and the peak restarts from the sessions open then. A ramp-down from N to 0 therefore
    trims about log2(N / min_sessions) times; steady churn at one level never trims (it reuses
    the memory it frees). ``check_s <= 0`` or no ``malloc_trim`` in the C library: off.

    ``collect``: run a full garbage collection first, so that what closed connections leave in
    reference cycles (websockets' protocol objects, asyncio's transports) is freed before the
    trim. It matters only when Python's small objects live on glibc (``PYTHONMALLOC=malloc``:
    the default ``None`` turns it on then); it is a pause on the event loop (~100 ms after 10,000
    connections), counted in the GC pause metrics.
    """

    def __init__(self, check_s: float, min_sessions: int, trim: Callable[[], bool | None] = malloc_trim,
                 rss: Callable[[], int | None] = rss_bytes, clock: Callable[[], float] = time.perf_counter,
                 collect: bool | None = None) -> None:
        self.check_s = check_s
        self.min_sessions = max(1, min_sessions)
        self.collect = os.environ.get("PYTHONMALLOC", "").startswith("malloc") if collect is None else collect
        self._trim = trim
        self._rss = rss
        self._clock = clock
        self.enabled = check_s > 0 and (trim is not malloc_trim or trim_available())
        self.peak = 0
        self.live = 0
        self.trims = 0
        self.released_bytes = 0.0  # RSS before minus after, summed over trims
        self.seconds = 0.0
        self._handle: Any = None

    def opened(self, live: int) -> None:
        """A session opened; `live` are open now."""
        self.live = live
        if live > self.peak:
            self.peak = live

    def closed(self, live: int, loop: Any) -> None:
        """A session closed; `live` are open now. Schedules the check on `loop` (one at a time)."""
        self.live = live
        if self.enabled and self._handle is None and self.due():
            self._handle = loop.call_later(self.check_s, self.check)

    def due(self) -> bool:
        """Whether the open sessions have fallen far enough since the peak for a trim."""
        return self.peak - self.live >= self.min_sessions and 2 * self.live <= self.peak

    def check(self) -> bool:
        """Trim now if still `due` (the scheduled check; also callable directly). True if it trimmed."""
        self._handle = None
        if not self.due():
            return False
        before = self._rss()
        t0 = self._clock()
        if self.collect:
            gc.collect()
        self._trim()
        self.seconds += self._clock() - t0
        after = self._rss()
        self.trims += 1
        if before is not None and after is not None:
            self.released_bytes += max(0, before - after)
        log.debug("malloc_trim after sessions fell from %d to %d: RSS %s -> %s", self.peak, self.live,
                  before, after)
        self.peak = self.live
        return True

    def cancel(self) -> None:
        """Drop a pending check (server stop)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def families(self) -> list[Family]:
        """Prometheus families for the server's collector."""
        return [
            ("tristream_memory_trims_total", "counter", "heap trims (malloc_trim) after the open sessions fell",
             [("tristream_memory_trims_total", {}, float(self.trims))]),
            ("tristream_memory_trim_released_bytes_total", "counter", "RSS given back to the OS by heap trims",
             [("tristream_memory_trim_released_bytes_total", {}, self.released_bytes)]),
            ("tristream_memory_trim_seconds_total", "counter", "seconds spent in heap trims (on the event loop)",
             [("tristream_memory_trim_seconds_total", {}, self.seconds)]),
        ]

