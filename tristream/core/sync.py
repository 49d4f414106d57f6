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
        self._bmin: tuple[str, ...] = ()
        self._bactive: tuple[str, ...] = ()
        self._bdeadline = 0
        self._last_h: int | None = None
        self._unknown: str | None = None  # a stream with messages, all beyond the last pass's horizon
        self._cols = [(s, self.q.t[s], self.q.v[s]) for s in self.streams]  # (the lists are updated in place)
        # Streams as bits of a mask for `_scan`: the names of every mask are built once (a
        # scan allocates nothing), and the other streams of each pivot for `_best2`.
        self._wms = [(1 << i, st) for i, st in enumerate(self.q.wm.streams.values())]
        names = list(self.q.wm.streams)
        self._names = [tuple(n for i, n in enumerate(names) if m >> i & 1) for m in range(1 << len(names))] \
            if len(names) <= 8 else None
        self._others = {s: tuple(o for o in self.streams if o != s) for s in self.streams}
        self._two = len(self.streams) == 3  # two streams besides each pivot: `_best2`
        self._col_of = {s: (self.q.t[s], self.q.v[s], self.q.wm.streams[s]) for s in self.streams}
        self._late = {s: f"late:{s}" for s in self.streams}
        self._unmatched = {s: f"unmatched:{s}" for s in self.streams}

    def push(self, stream: str, ref_ns: int, item: Any, now_ns: int) -> list[AlignedWindow]:
        """Add a message; returns the sets that became final."""
        col = self._col_of.get(stream)
        if col is None:
            raise KeyError(f"unknown stream {stream!r}; this join was built for {self.streams}")
        ts, vs, st = col
        q = self.q
        # `_Queues.push` and `WatermarkTracker.observe`, inlined: this runs for every packet
        wm = q.wm
        if wm._unstarted:
            wm._start(now_ns)
        if now_ns > q.now:
            q.now = now_ns
        if now_ns > st.last_active_ns:
            st.last_active_ns = now_ns
        st.closed = False
        seen = st.max_seen_ns
        if ref_ns > seen:
            st.max_seen_ns = ref_ns
        if (seen > NEG_INF and ref_ns < seen - st.lateness_ns) or ref_ns < wm._combined:
            wm.counts.add(self._late[stream])
            q.counts.add(self._late[stream])
        else:
            if not ts or ref_ns >= ts[-1]:
                ts.append(ref_ns)
                vs.append(item)
            else:
                k = bisect.bisect_right(ts, ref_ns)
                ts.insert(k, ref_ns)
                vs.insert(k, item)
            if len(ts) > self.queue_size:
                ts.pop(0)
                vs.pop(0)
                self.counts.add(f"overflow:{stream}")
                self._bh = None
        bh = self._bh
        if bh is not None and ref_ns > bh and q.now <= self._bdeadline and stream in self._bactive and not q.flushed:
            if stream not in self._bmin:
                return []
            u = self._unknown
            if u is not None and u != stream:
                # The pusher held the watermark, so the horizon may move; if the stream that
                # blocked the last pass still has nothing at or before it, a pass would only prune.
                h, act = self._scan()
                tu = q.t[u]
                if not tu or tu[0] > h:
                    self._last_h = h
                    floor = h - self.max_interval_ns
                    for s, ts, vs in self._cols:
                        if ts and ts[0] <= floor:
                            self._drop(s, ts, vs, floor)
                    self._bh = h if act else None
                    return []
                return self._pass(h, act)
        return self._emit()

    def _emit(self) -> list[AlignedWindow]:
        if self.q.flushed:
            self._bh = None
            return self._emit_sets(POS_INF, (), True)
        h, act = self._scan()
        return self._pass(h, act)

    def _pass(self, h: int, act: tuple[str, ...]) -> list[AlignedWindow]:
        out = self._emit_sets(h, act, False)
        self._bh = self._last_h if act else None
        return out

    def _scan(self) -> tuple[int, tuple[str, ...]]:
        """One look at the watermarks (not flushed): the combined watermark (`WatermarkTracker.combined`,
        which it updates), the active streams, and - kept for the next push - the streams holding
        the combined minimum and when the first active one turns idle."""
        q = self.q
        wm = q.wm
        now = q.now
        if wm._unstarted:
            wm._start(now)
        low = POS_INF
        mins = act = 0
        deadline = POS_INF
        for bit, st in self._wms:
            la = st.last_active_ns
            if st.closed or (la > NEG_INF and now - la > st.idle_timeout_ns):
                continue
            act |= bit
            ms = st.max_seen_ns
            m = ms - st.lateness_ns if ms > NEG_INF else NEG_INF
            if m < low:
                low, mins = m, bit
            elif m == low:
                mins |= bit
            d = la + st.idle_timeout_ns
            if d < deadline:
                deadline = d
        low = wm._raise_to(low)
        names = self._names
        if names is not None:
            self._bmin, active = names[mins], names[act]
        else:
            every = list(wm.streams)
            self._bmin = tuple(n for i, n in enumerate(every) if mins >> i & 1)
            active = tuple(n for i, n in enumerate(every) if act >> i & 1)
        self._bactive = active
        self._bdeadline = deadline
        return low, active

    def _drop(self, s: str, ts: list[int], vs: list[Any], t_ns: int) -> int:
        """Remove the messages of `s` at or before `t_ns` (its head is), counted as unmatched."""
        k = bisect.bisect_right(ts, t_ns)
        del ts[:k]
        del vs[:k]
        self.counts.add(self._unmatched[s], k)
        return k

    def pending(self) -> dict[str, int]:
        """Messages waiting per stream."""
        return {s: len(ts) for s, ts in self.q.t.items()}

    def _emit_sets(self, h: int, active: tuple[str, ...], flushed: bool) -> list[AlignedWindow]:
        # Taking sets changes neither the watermarks nor processing time: one horizon and one
        # set of active streams hold for the whole pass.
        out: list[AlignedWindow] = []
        self._last_h = h
        mi = self.max_interval_ns
        cols = self._cols
        counts = self.counts
        while True:
            p_t = 0
            pivot: str | None = None
            absent: list[str] | None = None
            blocker: str | None = None
            low = POS_INF  # the oldest head
            for s, ts, _ in cols:
                if ts:
                    t = ts[0]
                    if t < low:
                        low = t
                    if t <= h:
                        if pivot is None or t > p_t:  # the latest head; the first stream of equal ones
                            p_t, pivot = t, s
                    elif blocker is None:  # its next message is later than h but not known yet
                        blocker = s
                elif not flushed and s in active:
                    if blocker is None:
                        blocker = s
                elif absent is None:  # empty and idle (or ended): it cannot hold a set back
                    absent = [s]
                else:
                    absent.append(s)
            if pivot is None:
                self._unknown = blocker
                return out
            if blocker is not None:
                # The pivot (latest head) is > h, so nothing at or before h - max_interval can be used.
                floor = h - mi
                if low <= floor:
                    for s, ts, vs in cols:
                        if ts and ts[0] <= floor:
                            self._drop(s, ts, vs, floor)
                self._unknown = blocker
                return out
            floor = p_t - mi - 1
            if low <= floor:
                for s, ts, vs in cols:  # too old for any set containing this (or a later) pivot
                    if ts and ts[0] <= floor:
                        self._drop(s, ts, vs, floor)
                continue
            choice = self._best2(pivot, p_t, h, absent) if self._two else self._best(pivot, p_t, h, absent or ())
            if choice is None:
                self._unknown = None
                return out
            members: dict[str, list[tuple[int, Any]]] = {}
            missing = []
            t_min = t_max = p_t
            for s, ts, vs in cols:
                t_c = p_t if s == pivot else choice.get(s)
                if t_c is None:
                    missing.append(s)
                    continue
                if ts[0] == t_c and (len(ts) == 1 or ts[1] > t_c):  # the member heads its queue
                    members[s] = [(ts.pop(0), vs.pop(0))]
                else:
                    k = bisect.bisect_right(ts, t_c)
                    members[s] = [(ts[k - 1], vs[k - 1])]
                    if k > 1:
                        counts.add(self._unmatched[s], k - 1)
                    del ts[:k]
                    del vs[:k]
                t = members[s][0][0]
                if t < t_min:
                    t_min = t
                elif t > t_max:
                    t_max = t
            out.append(AlignedWindow(p_t, members, tuple(missing), t_max - t_min))

    def _best2(self, pivot: str, p_t: int, h: int, absent: list[str] | None) -> dict[str, int | None] | None:
        """`_best` for three streams (two besides the pivot), with the same result: the same
        candidates in the same order, without building lists and sets for them."""
        o1, o2 = self._others[pivot]
        qt = self.q.t
        far = _FAR
        b1, a1, u1 = (None, None, False) if absent is not None and o1 in absent else _around(qt[o1], p_t, h)
        db1 = far if b1 is None else p_t - b1
        da1 = far if a1 is None else a1 - p_t
        b2, a2, u2 = (None, None, False) if absent is not None and o2 in absent else _around(qt[o2], p_t, h)
        db2 = far if b2 is None else p_t - b2
        da2 = far if a2 is None else a2 - p_t
        # the candidate distances, ascending and distinct: 0 and those of existing members
        # (before: >= 0, after: > 0)
        x = 0 if b1 is None else db1
        y = 0 if b2 is None else db2
        if x > y:
            x, y = y, x
        los: tuple[int, ...] = (0,) if not y else (0, y) if not x or x == y else (0, x, y)
        x = 0 if a1 is None else da1
        y = 0 if a2 is None else da2
        if x > y:
            x, y = y, x
        his: tuple[int, ...] = (0,) if not y else (0, y) if not x or x == y else (0, x, y)
        mi = self.max_interval_ns
        f = 1.0 + self.age_penalty
        found = False
        b_missing = b_unc = 0
        b_cost = 0.0
        best_lo = best_hi = 0
        for lo in los:
            if lo > mi or (found and not b_missing and (lo > b_cost or (lo == b_cost and not b_unc))):
                break
            before1 = db1 <= lo
            before2 = db2 <= lo
            for hi in his:
                if lo + hi > mi:
                    break
                cost = lo + hi * f
                if found and not b_missing and (cost > b_cost or (cost == b_cost and not b_unc)):
                    break
                n_missing = n_uncertain = 0
                if not (before1 and (da1 > hi or db1 <= da1)):
                    if da1 <= hi:
                        n_uncertain += u1
                    else:
                        n_missing += 1
                if not (before2 and (da2 > hi or db2 <= da2)):
                    if da2 <= hi:
                        n_uncertain += u2
                    else:
                        n_missing += 1
                if not found or n_missing < b_missing or (n_missing == b_missing and (
                        cost < b_cost or (cost == b_cost and n_uncertain < b_unc))):
                    found = True
                    b_missing, b_cost, b_unc = n_missing, cost, n_uncertain
                    best_lo, best_hi = lo, hi
        if not found or b_unc > 0:
            return None
        lo, hi = best_lo, best_hi
        return {o1: b1 if db1 <= lo and (da1 > hi or db1 <= da1) else a1 if da1 <= hi else None,
                o2: b2 if db2 <= lo and (da2 > hi or db2 <= da2) else a2 if da2 <= hi else None}

    def _best(self, pivot: str, p_t: int, h: int, absent: list[str] | tuple[()]) -> dict[str, int | None] | None:
        """Members minimising (missing, lo + hi * (1 + age_penalty)); None if not final yet."""
        qt = self.q.t
        far = _FAR  # the distance of a member that does not exist: never within any bound
        # per other stream: name, distance and time before, distance and time after, uncertain
        names: list[str] = []
        dbs: list[int] = []
        bs: list[int | None] = []
        das: list[int] = []
        avs: list[int | None] = []
        uncs: list[bool] = []
        lo_set = {0}
        hi_set = {0}
        for s in self.streams:
            if s == pivot:
                continue
            names.append(s)
            if s in absent:
                dbs.append(far)
                bs.append(None)
                das.append(far)
                avs.append(None)
                uncs.append(False)
                continue
            b, a, unc = _around(qt[s], p_t, h)
            if b is None:
                dbs.append(far)
            else:
                db = p_t - b
                dbs.append(db)
                lo_set.add(db)
            if a is None:
                das.append(far)
            else:
                da = a - p_t
                das.append(da)
                hi_set.add(da)
            bs.append(b)
            avs.append(a)
            uncs.append(unc)
        mi = self.max_interval_ns
        f = 1.0 + self.age_penalty
        his = sorted(hi_set)
        los = sorted(lo_set)
        found, b_missing, b_cost, b_unc, best_lh = _search(los, his, mi, f, dbs, das, uncs)
        if not found or b_unc > 0:
            return None
        lo, hi = best_lh
        best: dict[str, int | None] = {}
        for s, db, b, da, a in zip(names, dbs, bs, das, avs, strict=True):
            best[s] = b if db <= lo and (da > hi or db <= da) else a if da <= hi else None
        return best


def _around(ts: list[int], p_t: int, h: int) -> tuple[int | None, int | None, bool]:
    """A stream's options around the pivot's time `p_t` (its queue `ts`, ascending): the last
    message at or before it and the first after it, or - when that one is not known by the
    horizon `h` - the earliest a future message could have (`True`: uncertain)."""
    k = bisect.bisect_right(ts, p_t)
    b = ts[k - 1] if k else None
    a = ts[k] if k < len(ts) else None
    if (a is None or a > h) and h < POS_INF:
        return b, max(h, p_t + 1), True
    return b, a, False


# The search of `_best`: candidates in order (lo, then hi, ascending); the first smallest key
# (missing members, lo + hi * f, uncertain members) wins. Once a set with every member is known,
# a costlier (lo, hi) cannot win, so such tails are skipped.
_Found = tuple[bool, int, float, int, tuple[int, int]]


def _search(los: list[int], his: list[int], mi: int, f: float, dbs: list[int], das: list[int],
            uncs: list[bool]) -> _Found:
    opts = list(zip(dbs, das, uncs, strict=True))
    found = False
    b_missing = b_unc = 0
    b_cost = 0.0
    best_lh = (0, 0)
    for lo in los:
        if lo > mi or (found and not b_missing and lo > b_cost):
            break
        for hi in his:
            if lo + hi > mi:
                break
            cost = lo + hi * f
            if found and not b_missing and cost > b_cost:
                break
            n_missing = n_uncertain = 0
            for db, da, unc in opts:
                if db <= lo and (da > hi or db <= da):
                    continue
                if da <= hi:
                    n_uncertain += unc
                else:
                    n_missing += 1
            if not found or (n_missing, cost, n_uncertain) < (b_missing, b_cost, b_unc):
                found = True
                b_missing, b_cost, b_unc = n_missing, cost, n_uncertain
                best_lh = (lo, hi)
    return found, b_missing, b_cost, b_unc, best_lh
