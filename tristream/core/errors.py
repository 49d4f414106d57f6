"""Exceptions raised by the time core.

Every error names what was wrong and what was expected, so a user can fix the input.
"""

from __future__ import annotations


class TimeCoreError(Exception):
    """Base class of every error raised by `tristream.core`."""


class InvalidPacket(TimeCoreError, ValueError):
    """A packet (or one of its fields) cannot be used: NaN time, negative size, wrong shape."""


class UnknownUnit(InvalidPacket):
    """A time unit string is not one of ns, us, ms, s, samples@RATE, rtp90k."""


class OutOfOrder(InvalidPacket):
    """A value went backwards where the component forbids it (e.g. a strictly monotonic ring)."""
