"""Named counters for dropped or shed packets: nothing is dropped without a reason."""

from __future__ import annotations


class DropCounter:
    """Counts drops by reason (`inbox_full_drop_oldest`, `interrupted`, ...)."""

    __slots__ = ("by_reason",)

    def __init__(self) -> None:
        self.by_reason: dict[str, int] = {}

    def add(self, reason: str, n: int = 1) -> None:
        """Count `n` drops under `reason`."""
        self.by_reason[reason] = self.by_reason.get(reason, 0) + n

    @property
    def total(self) -> int:
        """All drops, every reason together."""
        return sum(self.by_reason.values())

    def as_dict(self) -> dict[str, int]:
        """A copy of the counts, for reports and metrics export."""
        return dict(self.by_reason)

    def __repr__(self) -> str:
        return f"DropCounter({self.by_reason})"
