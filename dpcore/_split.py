"""How many rows of a batch each device gets (private): the checks of ``chunk_sizes`` and ``weights``
(an int is what ``operator.index`` takes, a weight a finite real ``>= 0``, never a bool; errors name
the argument, index and value), the split itself, and :func:`plan_split`, the scatter's rules."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dpcore._loader import _C


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def as_int(value: Any, arg: str) -> int:
    """`value` as an int; TypeError naming `arg` and the value otherwise."""
    if _is_bool(value):
        raise TypeError(f"{arg}: expected an int, but got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{arg}: expected an int, but got {type(value).__name__} {value!r}") from None


def _as_list(values: Any, arg: str, what: str, convert: Any) -> list[Any]:
    """``convert(values[i], "arg[i]")`` of each entry; TypeError where `values` is no sequence."""
    try:
        if isinstance(values, (str, bytes, Mapping)):
            raise TypeError
        values = list(values)
    except TypeError:
        raise TypeError(
            f"{arg}: expected a sequence of {what}s, one per device, but got {type(values).__name__} {values!r}"
        ) from None
    return [convert(v, f"{arg}[{i}]") for i, v in enumerate(values)]


def _check_count(values: list[Any], count: int | None, arg: str, what: str) -> None:
    if count is not None and len(values) != count:
        raise ValueError(f"{arg}: expected one {what} per device ({count}), but got {len(values)}: {values}")


def as_int_list(values: Any, arg: str = "chunk_sizes") -> list[int]:
    """`values` (any sequence) as a list of ints."""
    return _as_list(values, arg, "int", as_int)


def check_chunk_sizes(chunk_sizes: Any, count: int | None = None, arg: str = "chunk_sizes") -> list[int]:
    """`chunk_sizes` as a list of non-negative ints, `count` of them where given."""
    sizes = as_int_list(chunk_sizes, arg)
    for i, s in enumerate(sizes):
        if s < 0:
            raise ValueError(f"{arg}[{i}]: expected a non-negative size, but got {s}")
    _check_count(sizes, count, arg, "size")
    return sizes


def _as_weight(value: Any, arg: str) -> float:
    number: Any = value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and not _is_bool(value):
        number = value.item()
    if _is_bool(number) or not isinstance(number, numbers.Real):
        raise TypeError(f"{arg}: expected a real number, but got {type(value).__name__} {value!r}")
    result = float(number)
    if not math.isfinite(result) or result < 0:
        raise ValueError(f"{arg}: expected a non-negative finite number, but got {value!r}")
    return result


def check_weights(weights: Any, count: int | None = None, arg: str = "weights") -> list[float]:
    """`weights` as a list of floats, `count` of them where given, with a positive sum."""
    result = _as_list(weights, arg, "number", _as_weight)
    _check_count(result, count, arg, "weight")
    if sum(result) <= 0:
        raise ValueError(f"{arg}: expected a positive sum, but got {result}")
    return result


def check_split(
    chunk_sizes: Any = None, weights: Any = None, count: int | None = None
) -> tuple[list[int] | None, list[float] | None]:
    """The checked ``(chunk_sizes, weights)`` of a split over `count` devices (any when None)."""
    if chunk_sizes is not None and weights is not None:
        raise ValueError("give at most one of 'chunk_sizes' and 'weights', but got both")
    return (
        None if chunk_sizes is None else check_chunk_sizes(chunk_sizes, count),
        None if weights is None else check_weights(weights, count),
    )


def split_sizes(
    batch: int, n_devices: int, chunk_sizes: Sequence[int] | None = None, weights: Sequence[float] | None = None
) -> list[int]:
    """How many of `batch` rows each device gets: balanced (sizes differing by at most one, larger
    first), ``chunk_sizes`` as given (summing to `batch`), or in proportion to ``weights`` (largest
    remainder, exact, ties to the lower index; the arithmetic: _C, csrc/dpcore/split.h)."""
    batch, n_devices = as_int(batch, "batch"), as_int(n_devices, "n_devices")
    if batch < 0:
        raise ValueError(f"batch: expected a non-negative size, but got {batch}")
    if n_devices < 1:
        raise ValueError(f"n_devices: expected at least one device, but got {n_devices}")
    return _C.split_sizes(batch, n_devices, *check_split(chunk_sizes, weights, n_devices))


class SplitPlan(NamedTuple):
    """The batch (None without a batch tensor), each device's rows, and the replicas (at least 1)."""

    batch: int | None
    sizes: list[int]
    replicas: int

    def devices(self, without_batch: Sequence[int]) -> list[int]:
        """The indices of the devices that get a replica (`without_batch` without a batch)."""
        if self.batch is None:
            return list(without_batch)
        return [i for i, s in enumerate(self.sizes) if s > 0] or [0]


def plan_split(
    entries: Sequence[tuple[Any, int | None]],
    n_devices: int,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    dim: int = 0,
    units: Sequence[tuple[Any, int, str]] = (),
    hint: Any = "",
) -> SplitPlan:
    """The scatter rules for one call: `entries` holds ``(path, size along dim or None if 0-dim)`` of
    each tensor, `units` ``(path, count, noun)`` of each input split by whole samples; the split
    arguments come checked. 0. The first unit's count is the batch, which the others must have.
    1. A 0-dim tensor goes whole to every replica. 2. One size is the batch. 3. Of two sizes ``b``
    and ``r``, ``b`` is the batch where a batch of ``b`` runs on ``r`` replicas (a tensor of size
    ``r``: one row per replica), 3b. or on fewer than ``r``, the device count (rows left over
    must repeat the first). 4. Other sizes are a ValueError naming two paths, ended by `hint`
    (the rules' arithmetic and messages: _C, csrc/dpcore/split.h)."""
    return SplitPlan(*_C.plan_split(entries, n_devices, chunk_sizes, weights, dim, units, hint))


def check_first_device(
    sizes: Sequence[int], devices: Sequence[int], n_devices: int, chunk_sizes: Any, weights: Any
) -> None:
    """ValueError naming the split argument where the replicas on `devices` leave out device 0."""
    if not devices or devices[0] == 0:
        return
    given = "chunk_sizes" if chunk_sizes is not None else "weights"
    split = [0] * n_devices
    for index, size in zip(devices, sizes):
        split[index] = size
    raise ValueError(
        f"{given}: the first device (device_ids[0], which holds the module) must get a non-empty "
        f"chunk, but {given}={chunk_sizes if chunk_sizes is not None else weights} split the batch of "
        f"{sum(sizes)} into {split}"
    )


def check_repeated_rows(t: torch.Tensor, dim: int, replicas: int, path: Any) -> torch.Tensor:
    """The first `replicas` rows of `t` (rule 3b of plan_split); ValueError unless all rows are equal."""
    first = t.narrow(dim, 0, 1)
    if not bool((t == first).all()):
        raise ValueError(
            f"{path} has size {t.size(dim)} along dim {dim}, one row per device, but the batch runs on {replicas} "
            f"replica(s), and its rows differ: rows {replicas}.. would be dropped (as one row per device, they are "
            f"sent only where they all repeat the first, as Trainer's expanded num_items_in_batch does)"
        )
    return t.narrow(dim, 0, replicas)
