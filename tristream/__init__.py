"""tristream: a runtime for real-time tri-modal AI (camera video + speech + text in, text and speech out)."""

from __future__ import annotations

__version__ = "0.1.0"
