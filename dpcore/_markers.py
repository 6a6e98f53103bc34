"""dpcore's markers of how an argument is passed: :class:`Broadcast` and :class:`Samples`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Broadcast(Generic[T]):
    """Marks an argument (or anything inside one) to be passed whole to every replica, not split: its tensors copied to
    each replica's device (differentiably; the replica on a tensor's own device gets the tensor itself), other values
    passed by reference, containers rebuilt."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value: T = value

    def __repr__(self) -> str:
        return f"Broadcast({self.value!r})"


class Samples(Generic[T]):
    """Marks a list (or tuple) as the batch itself, one entry per sample (docs/samples.md): each replica gets
    consecutive samples, their tensors moved whole to its device, and every list in the outputs is taken to hold one
    entry per sample (joined in replica order)."""

    __slots__ = ("value",)

    def __init__(self, value: Sequence[T]) -> None:
        if not isinstance(value, (list, tuple)) or is_namedtuple(value):
            tensor = " (a tensor is split along dim already; Samples is for a list of samples)"
            raise TypeError(
                f"dpcore.Samples: expected a list or tuple with one entry per sample, but got "
                f"{type(value).__name__}{tensor if isinstance(value, torch.Tensor) else ''}"
            )
        self.value: Sequence[T] = value

    def __repr__(self) -> str:
        return f"Samples({self.value!r})"


def is_namedtuple(obj: Any) -> bool:
    """Whether `obj` is a namedtuple instance (collections or typing)."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields") and hasattr(obj, "_asdict")
