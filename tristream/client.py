"""Python client for a tristream server: `from tristream.client import RealtimeClient`.

Re-exports `tristream.serve.client`, where the implementation lives.
"""

from __future__ import annotations

from tristream.serve.client import (
    ClientError,
    RealtimeClient,
    TurnResult,
    read_video_jpegs,
    read_wav,
    stream_media,
)

__all__ = ["ClientError", "RealtimeClient", "TurnResult", "read_video_jpegs", "read_wav", "stream_media"]
