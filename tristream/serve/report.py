"""Plots of a recorded session: latency CDF and per-turn timeline (PNG, matplotlib Agg).

Latencies come from the recording itself: per turn, from ``input_audio_buffer.speech_stopped``
(or ``response.created`` for text turns) to the first ``response.audio.delta`` / first text
delta / ``response.done``, on the server's reference clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tristream.observe.record import RecordedEvent

_TEXT = ("response.text.delta", "response.audio_transcript.delta")


@dataclass(slots=True)
class TurnMarks:
    """Reference times (ns) of one turn as seen in a recording."""

    speech_started: int | None = None
    speech_stopped: int | None = None
    transcript: int | None = None
    response_created: int | None = None
    first_text: int | None = None
    first_audio: int | None = None
    done: int | None = None
    status: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    def latency_ms(self, what: str) -> float | None:
        """``what`` in first_text/first_audio/done/transcript, from end of speech (or response start)."""
        base = self.speech_stopped or self.response_created
        t = getattr(self, what)
        return None if base is None or t is None else (t - base) / 1e6


def turns_from_events(events: list[RecordedEvent]) -> list[TurnMarks]:
    """Split a recording's server events into turns (one per response), in order of completion.

    A response belongs to the latest user turn that ended before it was created; speech that
    starts while an answer streams (barge-in) opens a new turn without losing the old one.
    """
    turns: list[TurnMarks] = []
    user: TurnMarks | None = None          # the user turn being spoken or just ended
    by_resp: dict[str, TurnMarks] = {}
    for e in events:
        if e.direction != "out":
            continue
        p = e.payload
        t = p.get("type")
        if t == "input_audio_buffer.speech_started":
            user = TurnMarks(speech_started=e.ref_ns)
        elif t == "input_audio_buffer.speech_stopped":
            user = user or TurnMarks()
            user.speech_stopped = e.ref_ns
        elif t == "conversation.item.input_audio_transcription.completed" and user is not None:
            user.transcript = e.ref_ns
        elif t == "response.created":
            rid = p.get("response", {}).get("id", "")
            mark = user if user is not None and user.response_created is None else TurnMarks()
            mark.response_created = e.ref_ns
            by_resp[rid] = mark
            user = None
        elif t in _TEXT or t == "response.audio.delta" or t == "response.done":
            rid = p.get("response_id") or p.get("response", {}).get("id", "")
            m = by_resp.get(rid)
            if m is None:
                continue
            if t in _TEXT and m.first_text is None:
                m.first_text = e.ref_ns
            elif t == "response.audio.delta" and m.first_audio is None:
                m.first_audio = e.ref_ns
            elif t == "response.done":
                m.done = e.ref_ns
                m.status = p.get("response", {}).get("status", "")
                turns.append(by_resp.pop(rid))
    return turns


def draw_report(events: list[RecordedEvent], out_dir: Path, name: str = "session") -> list[Path]:
    """Write ``<name>_latency_cdf.png`` and ``<name>_timeline.png``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    turns = turns_from_events(events)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for what, label in (("transcript", "end of speech → transcript"), ("first_text", "→ first text"),
                        ("first_audio", "→ first audio"), ("done", "→ response done")):
        vals = np.sort([v for t in turns if (v := t.latency_ms(what)) is not None])
        if vals.size:
            ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=f"{label} (n={vals.size})")
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("latency (ms, server reference clock)")
    ax.set_ylabel("fraction of turns")
    ax.set_title(f"{name}: latency CDF over {len(turns)} turns")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    p = out_dir / f"{name}_latency_cdf.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    t0 = events[0].ref_ns if events else 0
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * max(1, len(turns))))
    ins = np.array([(e.ref_ns - t0) / 1e9 for e in events if e.direction == "in"])
    if ins.size:
        ax.plot(ins, np.full(ins.size, -0.6), "|", color="grey", markersize=6, label="client messages")
    for i, t in enumerate(turns):
        def s(v: int | None) -> float | None:
            return None if v is None else (v - t0) / 1e9
        a, b = s(t.speech_started), s(t.speech_stopped)
        if a is not None and b is not None:
            ax.barh(i, b - a, left=a, color="tab:blue", height=0.35, label="user speech" if i == 0 else None)
        r0, r1 = s(t.response_created), s(t.done)
        if r0 is not None and r1 is not None:
            ax.barh(i, max(r1 - r0, 1e-3), left=r0, color="tab:green" if t.status == "completed" else "tab:red",
                    height=0.35, alpha=0.7, label="answer" if i == 0 else None)
        fa = s(t.first_audio)
        if fa is not None:
            ax.plot([fa], [i], "k^", markersize=5, label="first audio" if i == 0 else None)
    ax.set_xlabel("time since session start (s)")
    ax.set_ylabel("turn")
    ax.set_title(f"{name}: timeline")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    p = out_dir / f"{name}_timeline.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
