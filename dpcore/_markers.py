"""dpcore's markers of how an argument is passed: :class:`Broadcast` (whole
to every replica) and :class:`Samples` (split between samples). The walk
that reads them is :mod:`dpcore._pytree`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Broadcast(Generic[T]):
    """Marks an argument to be passed whole to every replica instead of split.

    ``Broadcast(x)`` as a positional or keyword argument (or anywhere inside
    one) gives every replica the whole of ``x``:

    * a tensor is copied to each replica's device (``comm.broadcast``): the
      first replica on the tensor's own device gets the tensor object itself,
      the others get copies that own their memory; if it requires grad, the
      copies are differentiable and their gradients are summed back into it;
    * a value that contains no tensor is passed by reference (every replica
      gets ``x`` itself);
    * a container holding tensors is rebuilt per replica with each tensor
      broadcast as above and every other leaf passed by reference; an
      iterable that is a container only by torch DP's rebuild rule (not
      registered with ``torch.utils._pytree``) is passed by reference.

    Tensors inside a Broadcast take no part in the batch-size check.
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value: T = value

    def __repr__(self) -> str:
        return f"Broadcast({self.value!r})"


class Samples(Generic[T]):
    """Marks a list (or tuple) as the batch itself: one entry per sample.

    ``Samples(images)`` as a positional or keyword argument (or anywhere
    inside one) is split between its samples, never inside one: each
    replica gets a ``list`` (a ``tuple`` for a tuple) of consecutive
    samples, in order, each sample's tensors moved whole to the replica's
    device (differentiably; a tensor already there is passed as is) and
    every other value passed by reference. How many samples each replica
    gets is the call's split (balanced, ``chunk_sizes``, ``weights``) over
    the number of samples, which is the batch size: every other batched
    input of the call (another Samples list, a PackedSequence, a tensor
    split along ``dim``) must agree with it. Replicas that would get no
    sample do not run. In the outputs of such a call every ``list`` is taken
    to hold one entry per sample and is joined by concatenation in replica
    order (see :func:`dpcore.scatter_gather.gather_with_hints`).

    For models that take a list of variable-size samples: torchvision's
    detection and segmentation models (a list of images, in training also a
    list of target dicts), or any list of per-sample dicts.
    """

    __slots__ = ("value",)

    def __init__(self, value: Sequence[T]) -> None:
        if not isinstance(value, (list, tuple)) or is_namedtuple(value):
            raise TypeError(
                f"dpcore.Samples: expected a list or tuple with one entry per sample, but got "
                f"{type(value).__name__}"
                + (
                    " (a tensor is split along dim already; Samples is for a list of samples)"
                    if isinstance(value, torch.Tensor)
                    else ""
                )
            )
        self.value: Sequence[T] = value

    def __repr__(self) -> str:
        return f"Samples({self.value!r})"


def is_namedtuple(obj: Any) -> bool:
    """Whether `obj` is a namedtuple instance (collections or typing)."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields") and hasattr(obj, "_asdict")
