"""Exceptions of the speech engine."""

from __future__ import annotations


class WhisperWeightsError(ValueError):
    """A Whisper checkpoint or config does not fit the module asked to load it."""


class AudioInputError(ValueError):
    """Audio handed to the speech engine has the wrong shape, rate, dtype or stream id."""
