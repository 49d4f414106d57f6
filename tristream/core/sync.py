"""`ApproximateTimeSync`: minimal-spread sets across N streams (ROS ApproximateTime semantics).

Like ROS 2 message_filters' ApproximateTime policy: every set holds at most one message per
stream, each message is used at most once, sets come out in time order, the pivot (the latest
of the queue heads) is in the set and the other members are chosen to minimise the set's
spread, no set spans more than `max_interval_ns`, and `age_penalty` trades optimality for
latency (the part of the spread that lies after the pivot, i.e. waiting for newer messages,
costs `1 + age_penalty` times more).

Unlike ROS, decisions are driven by watermarks: a set is emitted only when no message that can
still arrive (within the lateness bound) could make it better, so the output is independent of
arrival order within that bound; and a stream that is idle, or has nothing within
`max_interval_ns` of the pivot, is reported as missing instead of stalling everything.
Messages that no set can use any more are counted as `unmatched:<stream>`.
"""

from __future__ import annotations

import bisect
from typing import Any

from tristream.core.align import AlignedWindow, _QueuedJoin, _Queues
from tristream.core.watermark import NEG_INF, POS_INF

_FAR = 1 << 63  # farther than any two reference times (both < 2**62) are apart


class ApproximateTimeSync(_QueuedJoin):
    """Emit approximately synchronised sets (one message per stream) as they become final."""

    def __init__(
        self,
        streams: list[str],
        *,
        max_interval_ns: int = 50_000_000,
        age_penalty: float = 0.0,
        lateness_ns: int = 100_000_000,
        idle_timeout_ns: int = 500_000_000,
        queue_size: int = 1000,
    ) -> None:
        if max_interval_ns <= 0 or age_penalty < 0 or queue_size <= 0:
            raise ValueError("max_interval_ns > 0, age_penalty >= 0 and queue_size > 0 are required")
        self.q = _Queues(list(streams), lateness_ns, idle_timeout_ns, "approx_sync")
        self.streams = self.q.streams
        self.counts = self.q.counts
        self.max_interval_ns = int(max_interval_ns)
        self.age_penalty = float(age_penalty)
        self.queue_size = int(queue_size)
        # Where the last emission pass stopped: its horizon, the streams holding the combined
        # watermark at its minimum, the active streams and when the first of them turns idle.
        # A push from another active stream, later than that horizon, before that deadline,
        # cannot make any set final (the horizon, the heads and the active set are unchanged),
        # so it returns at once: most pushes take this path.
        self._bh: int | None = None
        self._bmin: list[str] = []
        self._bactive: list[str] = []
        self._bdeadline = 0
        self._last_h: int | None = None
        self._unknown: str | None = None  # a stream with messages, all beyond the last pass's horizon

    def push(self, stream: str, ref_ns: int, item: Any, now_ns: int) -> list[AlignedWindow]:
        """Add a message; returns the sets that became final."""
        q = self.q
        ts = q.t.get(stream)
        if ts is None:
            raise KeyError(f"unknown stream {stream!r}; this join was built for {self.streams}")
        # `_Queues.push` and `WatermarkTracker.observe`, inlined: this runs for every packet
        wm = q.wm
        if wm._unstarted:
            wm._start(now_ns)
        if now_ns > q.now:
            q.now = now_ns
        st = wm.streams[stream]
        if now_ns > st.last_active_ns:
            st.last_active_ns = now_ns
        st.closed = False
        seen = st.max_seen_ns
        if ref_ns > seen:
            st.max_seen_ns = ref_ns
        if (seen > NEG_INF and ref_ns < seen - st.lateness_ns) or ref_ns < wm._combined:
            wm.counts.add(f"late:{stream}")
            q.counts.add(f"late:{stream}")
        else:
            if not ts or ref_ns >= ts[-1]:
                ts.append(ref_ns)
                q.v[stream].append(item)
            else:
                k = bisect.bisect_right(ts, ref_ns)
                ts.insert(k, ref_ns)
                q.v[stream].insert(k, item)
            if len(ts) > self.queue_size:
                ts.pop(0)
                q.v[stream].pop(0)
                self.counts.add(f"overflow:{stream}")
                self._bh = None
        bh = self._bh
        if bh is not None and ref_ns > bh and stream in self._bactive and q.now <= self._bdeadline and not q.flushed:
            if stream not in self._bmin or self._still_unknown(stream):
                return []
        return self._emit()

    def _emit(self) -> list[AlignedWindow]:
        out = self._emit_sets()
        self._record_block()
        return out

    def _record_block(self) -> None:
        q = self.q
        if q.flushed:
            self._bh = None
            return
        now = q.now
        low = POS_INF
        mins: list[str] = []
        act: list[str] = []
        deadline = POS_INF
        for n, st in q.wm.streams.items():
            if st.closed or (st.last_active_ns > NEG_INF and now - st.last_active_ns > st.idle_timeout_ns):
                continue
            act.append(n)
            m = st.max_seen_ns - st.lateness_ns if st.max_seen_ns > NEG_INF else NEG_INF
            if m < low:
                low, mins = m, [n]
            elif m == low:
                mins.append(n)
            d = st.last_active_ns + st.idle_timeout_ns
            if d < deadline:
                deadline = d
        if not act or self._last_h is None:
            self._bh = None
            return
        self._bh = self._last_h
        self._bmin = mins  # (a few streams: a list's membership test is cheaper than a set's build)
        self._bactive = act
        self._bdeadline = deadline

    def _still_unknown(self, stream: str) -> bool:
        """After a push by the stream holding the watermark: if the stream that blocked the last
        pass still has nothing at or before the new horizon, that pass would only prune again."""
        u = self._unknown
        if u is None or u == stream:
            return False
        q = self.q
        h = q.horizon()
        tu = q.t[u]
        if tu and tu[0] <= h:
            return False
        self._last_h = h
        floor = h - self.max_interval_ns
        for s in self.streams:
            ts = q.t[s]
            if ts and ts[0] <= floor:
                q.pop_until(s, floor, "unmatched")
        self._record_block()
        return True

    def pending(self) -> dict[str, int]:
        """Messages waiting per stream."""
        return {s: len(ts) for s, ts in self.q.t.items()}

    def _emit_sets(self) -> list[AlignedWindow]:
        out: list[AlignedWindow] = []
        q = self.q
        qt = q.t
        # Taking sets changes neither the watermarks nor processing time: one horizon and one
        # set of active streams hold for the whole pass.
        h = q.horizon()
        self._last_h = h
        flushed = q.flushed
        active = () if flushed else q.wm.active(q.now)
        mi = self.max_interval_ns
        while True:
            p_t = 0
            pivot: str | None = None
            absent: set[str] = set()
            unknown = False
            blocker: str | None = None
            for s in self.streams:
                ts = qt[s]
                if ts and ts[0] <= h:
                    if pivot is None or ts[0] > p_t:  # the latest head; the first stream of equal ones
                        p_t, pivot = ts[0], s
                elif ts or (not flushed and s in active):
                    unknown = True  # its next message is later than h but not known yet
                    if blocker is None:
                        blocker = s
                else:
                    absent.add(s)  # empty and idle (or ended): it cannot hold a set back
            if pivot is None:
                self._unknown = blocker
                return out
            if unknown:
                # The pivot (latest head) is > h, so nothing at or before h - max_interval can be used.
                for s in self.streams:
                    ts = qt[s]
                    if ts and ts[0] <= h - mi:
                        q.pop_until(s, h - mi, "unmatched")
                self._unknown = blocker
                return out
            dropped = 0
            floor = p_t - mi - 1
            for s in self.streams:  # too old for any set containing this (or a later) pivot
                ts = qt[s]
                if ts and ts[0] <= floor:
                    dropped += len(q.pop_until(s, floor, "unmatched"))
            if dropped:
                continue
            choice = self._best(pivot, p_t, h, absent)
            if choice is None:
                self._unknown = None
                return out
            win = AlignedWindow(anchor_ns=p_t)
            missing = []
            for s in self.streams:
                t_c = p_t if s == pivot else choice.get(s)
                if t_c is None:
                    missing.append(s)
                    continue
                ts, vs = qt[s], q.v[s]
                if ts[0] == t_c and (len(ts) == 1 or ts[1] > t_c):  # the member heads its queue
                    win.members[s] = [(ts.pop(0), vs.pop(0))]
                    continue
                taken = q.pop_until(s, t_c, None)
                if len(taken) > 1:
                    self.counts.add(f"unmatched:{s}", len(taken) - 1)
                win.members[s] = [taken[-1]]
            win.missing = tuple(missing)
            out.append(win.finish())

    def _best(self, pivot: str, p_t: int, h: int, absent: set[str]) -> dict[str, int | None] | None:
        """Members minimising (missing, lo + hi * (1 + age_penalty)); None if not final yet."""
        qt = self.q.t
        far = _FAR  # the distance of a member that does not exist: never within any bound
        # per other stream: (name, distance before, time before, distance after, time after, uncertain)
        opts: list[tuple[str, int, int | None, int, int | None, bool]] = []
        lo_set = {0}
        hi_set = {0}
        for s in self.streams:
            if s == pivot:
                continue
            if s in absent:
                opts.append((s, far, None, far, None, False))
                continue
            ts = qt[s]
            k = bisect.bisect_right(ts, p_t)
            b = ts[k - 1] if k else None
            nxt = ts[k] if k < len(ts) else None
            unc = False
            if nxt is not None and nxt <= h:
                a: int | None = nxt
            elif h < POS_INF:
                a, unc = max(h, p_t + 1), True  # earliest a future message could have
            else:
                a = nxt
            db = far if b is None else p_t - b
            da = far if a is None else a - p_t
            if b is not None:
                lo_set.add(db)
            if a is not None:
                hi_set.add(da)
            opts.append((s, db, b, da, a, unc))
        mi = self.max_interval_ns
        f = 1.0 + self.age_penalty
        his = sorted(hi_set)
        best_key: tuple[int, float, int] | None = None
        best_lh = (0, 0)
        for lo in sorted(lo_set):
            if lo > mi:
                break
            for hi in his:
                if lo + hi > mi:
                    break
                n_missing = n_uncertain = 0
                for _, db, _, da, _, unc in opts:
                    if db <= lo and (da > hi or db <= da):
                        continue
                    if da <= hi:
                        n_uncertain += unc
                    else:
                        n_missing += 1
                key = (n_missing, lo + hi * f, n_uncertain)
                if best_key is None or key < best_key:
                    best_key, best_lh = key, (lo, hi)
        if best_key is None or best_key[2] > 0:
            return None
        lo, hi = best_lh
        best: dict[str, int | None] = {}
        for s, db, b, da, a, _ in opts:
            best[s] = b if db <= lo and (da > hi or db <= da) else a if da <= hi else None
        return best
