"""Exceptions of the vision engine."""

from __future__ import annotations


class VisionWeightsError(ValueError):
    """A vision checkpoint or config does not fit the module asked to load it."""


class VisionInputError(ValueError):
    """Frames or pixels handed to the vision engine have the wrong shape, dtype or count."""
