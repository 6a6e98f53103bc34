"""dpcore's markers of how an argument is passed: :class:`Broadcast` and :class:`Samples`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Broadcast(Generic[T]):
    """Marks an argument (or anything inside one) to be passed whole to every replica, not split.

    A tensor is copied to each replica's device (the replica on its own device gets the tensor
    itself; gradients of the copies are summed back into it), a value without tensors is passed
    by reference, and a container is rebuilt per replica with its tensors copied so. Tensors
    inside a Broadcast take no part in the batch-size check.
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value: T = value

    def __repr__(self) -> str:
        return f"Broadcast({self.value!r})"


class Samples(Generic[T]):
    """Marks a list (or tuple) as the batch itself, one entry per sample (docs/samples.md).

    The call's split is over the samples: each replica gets a list (a tuple for a tuple) of
    consecutive samples, their tensors moved whole to its device, and in the outputs every list
    holds one entry per sample (joined in replica order). Every other batched input of the call
    must have the same number of samples.
    """

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
