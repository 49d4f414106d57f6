"""Session recording to MCAP: every input and output event with its reference timestamp.

One file per session (``<session_id>.mcap``), JSON messages on three topics:

- ``/client``: each client message exactly as received (valid or not), as ``{"raw": ...}``;
- ``/server``: each server event as sent (the event object itself);
- ``/meta``:   session id, settings and limits at the start.

``log_time`` is the server's monotonic reference clock in ns (the clock the session ran
on), ``publish_time`` the wall clock (UTC ns) for humans. `read_recording` returns the
events in log-time order; replay and report build on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcap.reader import make_reader
from mcap.writer import CompressionType, Writer

TOPIC_IN = "/client"
TOPIC_OUT = "/server"
TOPIC_META = "/meta"
PROFILE = "tristream-realtime"
_SCHEMA = json.dumps({"type": "object", "description": "OpenAI-Realtime-style event (see docs/protocol.md)"})


class RecordingError(Exception):
    """A file that is not a tristream session recording."""


@dataclass(slots=True)
class RecordedEvent:
    """One recorded message: direction ('in', 'out', 'meta'), reference time (ns) and payload."""

    direction: str
    ref_ns: int
    wall_ns: int
    payload: dict[str, Any]

    @property
    def raw(self) -> str:
        """The client message text ('in') or the serialised server event ('out')."""
        return str(self.payload["raw"]) if self.direction == "in" else json.dumps(self.payload)


class McapRecorder:
    """Appends a session's events to an MCAP file (LZ4 chunks, indexed)."""

    def __init__(self, path: Path, session_id: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("wb")
        self._w = Writer(self._fh, compression=CompressionType.LZ4, chunk_size=256 * 1024)
        self._w.start(profile=PROFILE, library="tristream")
        schema = self._w.register_schema("tristream.Event", "jsonschema", _SCHEMA.encode())
        meta = {"session_id": session_id}
        self._ch = {
            "in": self._w.register_channel(TOPIC_IN, "json", schema, meta),
            "out": self._w.register_channel(TOPIC_OUT, "json", schema, meta),
            "meta": self._w.register_channel(TOPIC_META, "json", schema, meta),
        }
        self._seq = 0
        self.closed = False
        self.count = 0

    def _add(self, direction: str, data: bytes, ref_ns: int) -> None:
        if self.closed:
            return
        self._seq += 1
        self.count += 1
        self._w.add_message(self._ch[direction], log_time=ref_ns, data=data, publish_time=time.time_ns(),
                            sequence=self._seq)

    def tap(self, direction: str, text: str, ref_ns: int) -> None:
        """The `RealtimeSession` tap: 'in' gets the raw client text, 'out' the server event JSON."""
        if direction == "in":
            self._add("in", json.dumps({"raw": text}).encode(), ref_ns)
        else:
            self._add("out", text.encode(), ref_ns)

    def write_meta(self, meta: dict[str, Any], ref_ns: int) -> None:
        """Session-level facts (id, settings, limits)."""
        self._add("meta", json.dumps(meta).encode(), ref_ns)

    def close(self) -> None:
        """Write the summary section and close the file."""
        if not self.closed:
            self.closed = True
            self._w.finish()
            self._fh.close()


def read_recording(path: Path) -> list[RecordedEvent]:
    """All events of a recording in (log time, sequence) order."""
    out: list[tuple[int, int, RecordedEvent]] = []
    direction = {TOPIC_IN: "in", TOPIC_OUT: "out", TOPIC_META: "meta"}
    try:
        with Path(path).open("rb") as fh:
            reader = make_reader(fh)
            header = reader.get_header()
            if header.profile != PROFILE:
                raise RecordingError(f"{path}: MCAP profile is {header.profile!r}, expected {PROFILE!r} "
                                     "(record with `tristream serve --record DIR`)")
            for _schema, channel, msg in reader.iter_messages(log_time_order=True):
                d = direction.get(channel.topic)
                if d is None:
                    continue
                out.append((msg.log_time, msg.sequence,
                            RecordedEvent(d, msg.log_time, msg.publish_time, json.loads(msg.data))))
    except RecordingError:
        raise
    except Exception as exc:  # the mcap reader raises its own types (InvalidMagic, EndOfFile, ...)
        raise RecordingError(f"{path} is not a tristream recording ({type(exc).__name__}: {exc}); give an "
                             ".mcap file written by `tristream serve --record DIR`") from exc
    out.sort(key=lambda t: (t[0], t[1]))
    return [e for _, _, e in out]
