"""`/metrics`: tristream's own exposition (`tristream.serve.metrics.ServeMetrics`) against
prometheus-client, the ecosystem's library, on the same families in the same run.

Two costs decide which one a server should use:

- **per event**: every message in and event out increments a labelled counter on the event
  loop (`ServeMetrics.inc(name, **labels)` against `Counter.labels(...).inc()`);
- **per scrape**: rendering N sessions' families (outbox depth, per-stage latency summaries,
  source-clock counters: what `RealtimeServer` exports per live session) into the text format
  (`ServeMetrics.render` against `generate_latest` of a registry with the same samples, built by a
  custom collector, since prometheus-client's `Summary` has no quantiles).

Both outputs are parsed back with prometheus-client's own parser and must hold the same samples
(names, labels, values). Run: ``python bench/metrics.py`` → ``bench/results/metrics.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_info, write_results  # noqa: E402

STAGES = ("vad", "asr", "llm", "tts", "playout", "vision")
SOURCES = ("mic", "camera", "imu")
EVENTS = ("duplicate", "gap", "lost", "wrap", "reset", "outlier", "delayed", "reordered", "previous_epoch")


def session_families(n: int) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
    """The per-session families of `n` live sessions, shaped as the server's collectors give them."""
    depth, proc, events, drift = [], [], [], []
    for i in range(n):
        sid = f"sess_{i:032x}"
        depth.append(("tristream_session_outbox_depth", {"session": sid}, float(i % 7)))
        for st in STAGES:
            for q in ("0.5", "0.95", "0.99"):
                proc.append(("tristream_stage_process_seconds", {"session": sid, "stage": st, "quantile": q},
                             0.001 * (i % 13 + 1) * float(q)))
            proc.append(("tristream_stage_process_seconds_sum", {"session": sid, "stage": st}, 0.5 + i))
            proc.append(("tristream_stage_process_seconds_count", {"session": sid, "stage": st}, float(100 + i)))
        for src in SOURCES:
            for ev in EVENTS:
                events.append(("tristream_clock_events_total", {"session": sid, "source": src, "event": ev},
                               float((i + len(ev)) % 5)))
            drift.append(("tristream_clock_drift_ppm", {"session": sid, "source": src}, 12.5 + i % 3))
    return [("tristream_session_outbox_depth", "gauge", "server events queued for a client", depth),
            ("tristream_stage_process_seconds", "summary", "per-stage processing time", proc),
            ("tristream_clock_events_total", "counter", "source clock events by source", events),
            ("tristream_clock_drift_ppm", "gauge", "source clock drift (ppm)", drift)]


def ours(n: int) -> Any:
    from tristream.serve.metrics import ServeMetrics

    m = ServeMetrics()
    fams = session_families(n)
    m.add_collector(lambda: fams)
    for t in ("response.audio.delta", "response.text.delta", "response.done"):
        m.inc("tristream_events_out_total", 1000.0, type=t)
    m.inc("tristream_messages_in_total", 5000.0)
    for i in range(2000):
        m.observe_ns("tristream_eos_to_first_audio_seconds", 200_000_000 + 97_003 * i)
    return m


def theirs(n: int) -> Any:
    """A prometheus-client registry with the same samples: counters as `Counter`s, the latency
    summary and the session families through one custom collector."""
    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.metrics_core import Metric

    from tristream.core.metrics import LatencyHistogram

    reg = CollectorRegistry()
    out = Counter("tristream_events_out", "events out", ["type"], registry=reg)
    for t in ("response.audio.delta", "response.text.delta", "response.done"):
        out.labels(type=t).inc(1000.0)
    Counter("tristream_messages_in", "messages in", registry=reg).inc(5000.0)
    h = LatencyHistogram()
    for i in range(2000):
        h.record(200_000_000 + 97_003 * i)
    fams = session_families(n)

    class Families:
        def collect(self) -> Any:
            s = Metric("tristream_eos_to_first_audio_seconds", "end of speech to first audio", "summary")
            for q in (50.0, 95.0, 99.0):
                s.add_sample("tristream_eos_to_first_audio_seconds", {"quantile": f"{q / 100:g}"}, h.percentile(q) / 1e9)
            s.add_sample("tristream_eos_to_first_audio_seconds_sum", {}, h.sum / 1e9)
            s.add_sample("tristream_eos_to_first_audio_seconds_count", {}, float(h.count))
            yield s
            for name, typ, help_, samples in fams:
                m = Metric(name.removesuffix("_total") if typ == "counter" else name, help_, typ)
                for sn, lab, v in samples:
                    m.add_sample(sn, lab, v)
                yield m

    reg.register(Families())
    return reg


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, parsed by prometheus-client (`_created` series left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def best_us(fn: Any, reps: int, rounds: int = 7) -> float:
    """Best of `rounds` of the mean µs per call over `reps` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from tristream.serve.metrics import ServeMetrics

    # per event: one labelled counter increment, as each message in / event out does
    m = ServeMetrics()
    c = Counter("tristream_events_out", "events out", ["type"], registry=CollectorRegistry())
    per_event = {"ours_us": best_us(lambda: m.inc("tristream_events_out_total", type="response.audio.delta"),
                                    100_000, args.rounds),
                 "prometheus_client_us": best_us(lambda: c.labels(type="response.audio.delta").inc(),
                                                 100_000, args.rounds)}
    per_event["ratio"] = round(per_event["prometheus_client_us"] / per_event["ours_us"], 2)
    print(f"per event: ours {per_event['ours_us']:.3f} µs, prometheus-client "
          f"{per_event['prometheus_client_us']:.3f} µs ({per_event['ratio']}×)")
    scrapes = []
    for n in args.sessions:
        a, b = ours(n), theirs(n)
        ta, tb = a.render(), generate_latest(b).decode()
        sa, sb = samples(ta), samples(tb)
        # the summaries' quantiles are written to the microsecond (`ServeMetrics`), the rest exactly
        same = sa.keys() == sb.keys() and all(abs(sa[k] - sb[k]) <= 1e-6 for k in sa)
        if not same:
            diff = [(k, sa.get(k), sb.get(k)) for k in sorted(sa.keys() | sb.keys())
                    if k not in sa or k not in sb or abs(sa[k] - sb[k]) > 1e-6][:5]
            raise SystemExit(f"{n} sessions: the two expositions differ, e.g. {diff}")
        reps = max(1, 2000 // (n + 1))
        row = {"sessions": n, "samples": len(sa), "bytes_ours": len(ta), "bytes_prometheus_client": len(tb),
               "same_samples": same,
               "ours_ms": round(best_us(a.render, reps, args.rounds) / 1e3, 3),
               "prometheus_client_ms": round(best_us(lambda b=b: generate_latest(b), reps, args.rounds) / 1e3, 3)}
        row["ratio"] = round(row["prometheus_client_ms"] / row["ours_ms"], 2)
        scrapes.append(row)
        print(f"{n:5d} sessions, {len(sa):7d} samples: scrape ours {row['ours_ms']:.3f} ms, "
              f"prometheus-client {row['prometheus_client_ms']:.3f} ms ({row['ratio']}×)")
    path = write_results("metrics", {"cpu": cpu_info(), "prometheus_client": prometheus_client.__version__
                                     if hasattr(prometheus_client, "__version__") else "present",
                                     "per_event": per_event, "scrape": scrapes})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
