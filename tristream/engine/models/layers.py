"""`Layers`: a `ModuleList` of one layer type, typed as such when indexed or iterated."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar, cast, overload

from torch import nn

L = TypeVar("L", bound=nn.Module)


class Layers(nn.ModuleList, Generic[L]):
    """A `ModuleList` of one layer type, typed as such when indexed or iterated."""

    @overload
    def __getitem__(self, idx: slice) -> Layers[L]: ...

    @overload
    def __getitem__(self, idx: int) -> L: ...

    def __getitem__(self, idx: int | slice) -> L | Layers[L]:
        return cast("L | Layers[L]", super().__getitem__(idx))

    def __iter__(self) -> Iterator[L]:
        return cast(Iterator[L], super().__iter__())
