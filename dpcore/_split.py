"""How many rows of a batch each device gets, and the checks of the split
arguments (private).

The one place for the rules of ``chunk_sizes`` and ``weights``:
DataParallel checks them at construction (:func:`check_split`),
``comm.scatter`` converts its chunk sizes with :func:`as_int_list` before
anything reaches C++, and :func:`split_sizes` applies them at each call.
:func:`plan_split` decides, for the tensors of one call, which size is the
batch and how each tensor reaches the replicas (the scatter rules).

* An int is an ``int`` or anything ``operator.index`` takes (numpy and torch
  integers, one-element integer tensors), never a ``bool`` (nor a torch bool
  tensor): ``2.5``, ``2.0`` and ``"2"`` are errors, not truncated or parsed.
* A weight is a real number (``numbers.Real``, or a one-element real torch
  tensor), not a bool, finite and ``>= 0``; the weights sum to more than 0.
* Every error names the argument, and the index and value of the entry.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import torch

from dpcore._loader import _C

__all__ = [
    "as_int",
    "as_int_list",
    "check_chunk_sizes",
    "check_weights",
    "check_split",
    "balanced",
    "split_sizes",
    "SplitPlan",
    "plan_split",
    "check_first_device",
    "check_repeated_rows",
]


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def as_int(value: Any, arg: str) -> int:
    """`value` as an int; TypeError naming `arg` and the value otherwise (see the module doc)."""
    if _is_bool(value):
        raise TypeError(f"{arg}: expected an int, but got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{arg}: expected an int, but got {type(value).__name__} {value!r}") from None


def _as_list(values: Any, arg: str, what: str) -> list[Any]:
    if isinstance(values, (str, bytes, Mapping)):
        raise TypeError(
            f"{arg}: expected a sequence of {what}, one per device, but got {type(values).__name__} {values!r}"
        )
    try:
        return list(values)
    except TypeError:
        raise TypeError(
            f"{arg}: expected a sequence of {what}, one per device, but got {type(values).__name__} {values!r}"
        ) from None


def _check_count(values: list[Any], count: int | None, arg: str, what: str) -> None:
    if count is not None and len(values) != count:
        raise ValueError(f"{arg}: expected one {what} per device ({count}), but got {len(values)}: {values}")


def as_int_list(values: Any, arg: str = "chunk_sizes") -> list[int]:
    """`values` (any sequence) as a list of ints, entry i checked as ``arg[i]``;
    TypeError for anything else. Sizes are not checked (see check_chunk_sizes)."""
    return [as_int(v, f"{arg}[{i}]") for i, v in enumerate(_as_list(values, arg, "ints"))]


def check_chunk_sizes(chunk_sizes: Any, count: int | None = None, arg: str = "chunk_sizes") -> list[int]:
    """`chunk_sizes` as a list of non-negative ints, ``count`` of them where
    given. TypeError for a value that is not an int, ValueError for a
    negative one or a wrong count, each naming ``arg[i]`` and the value."""
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
    """`weights` as a list of floats, ``count`` of them where given, with a
    positive sum. TypeError for a value that is not a real number (or is a
    bool), ValueError for a negative or non-finite one, a wrong count or a
    sum of 0, each naming ``arg[i]`` and the value."""
    result = [_as_weight(w, f"{arg}[{i}]") for i, w in enumerate(_as_list(weights, arg, "numbers"))]
    _check_count(result, count, arg, "weight")
    if sum(result) <= 0:
        raise ValueError(f"{arg}: expected a positive sum, but got {result}")
    return result


def check_split(
    chunk_sizes: Any = None, weights: Any = None, count: int | None = None
) -> tuple[list[int] | None, list[float] | None]:
    """The checked ``(chunk_sizes, weights)`` of a split over ``count``
    devices (any count when None): at most one of them given (ValueError
    otherwise), each as check_chunk_sizes and check_weights make it."""
    if chunk_sizes is not None and weights is not None:
        raise ValueError("give at most one of 'chunk_sizes' and 'weights', but got both")
    return (
        None if chunk_sizes is None else check_chunk_sizes(chunk_sizes, count),
        None if weights is None else check_weights(weights, count),
    )


def balanced(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes differing by at most one, the larger
    first (10 into 4: 3, 3, 2, 2): the C++ core's balanced_chunk_sizes, the
    one home of the rule, which comm.scatter uses without chunk sizes."""
    return _C.balanced_chunk_sizes(total, parts)


def _proportional(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights` by the largest-remainder
    method, ties to the lower index; computed exactly (fractions)."""
    fractions = [Fraction(w) for w in weights]
    whole = sum(fractions, Fraction(0))
    quotas = [total * f / whole for f in fractions]
    sizes = [math.floor(q) for q in quotas]
    order = sorted(range(len(sizes)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def split_sizes(
    batch: int,
    n_devices: int,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> list[int]:
    """How many of ``batch`` rows each of ``n_devices`` devices gets.

    Returns ``n_devices`` non-negative ints summing to ``batch``:

    * by default balanced: sizes differ by at most one, larger first, so every
      device gets rows while ``batch >= n_devices``; with fewer rows than
      devices the trailing entries are 0 (the caller runs fewer replicas);
    * ``chunk_sizes``: used as given, after checking (check_split) there is
      one non-negative int per device, and that they sum to ``batch``;
    * ``weights``: one non-negative finite number per device with a positive
      sum; device i gets ``batch * weights[i] / sum(weights)`` rows rounded by
      the largest-remainder method (ties to the lower index); a zero weight
      gets no rows.

    Raises ValueError (TypeError for a wrong kind of value) naming the
    argument; giving both ``chunk_sizes`` and ``weights`` is an error.
    """
    batch = as_int(batch, "batch")
    n_devices = as_int(n_devices, "n_devices")
    if batch < 0:
        raise ValueError(f"batch: expected a non-negative size, but got {batch}")
    if n_devices < 1:
        raise ValueError(f"n_devices: expected at least one device, but got {n_devices}")
    return _sizes(batch, n_devices, *check_split(chunk_sizes, weights, n_devices))


def _sizes(batch: int, n_devices: int, chunk_sizes: list[int] | None, weights: list[float] | None) -> list[int]:
    """split_sizes of arguments checked already (as check_split returns them)."""
    if chunk_sizes is not None:
        if sum(chunk_sizes) != batch:
            raise ValueError(
                f"chunk_sizes: expected sizes summing to the batch size {batch}, but {chunk_sizes} sum to "
                f"{sum(chunk_sizes)}"
            )
        return chunk_sizes
    if weights is not None:
        return _proportional(batch, weights)
    return balanced(batch, n_devices)


class SplitPlan(NamedTuple):
    """What :func:`plan_split` decided for one call.

    ``batch`` is the size along the split dim of the batch tensors (None when
    the call has none), ``sizes`` the rows each device gets (one entry per
    device, as :func:`split_sizes` returns them; empty when ``batch`` is
    None) and ``replicas`` the number of devices with a non-zero entry (at
    least 1). A tensor of size ``batch`` is split by ``sizes``; a tensor of
    another size (then ``replicas``) is split one row per replica; a 0-dim
    tensor goes whole to every replica."""

    batch: int | None
    sizes: list[int]
    replicas: int

    def devices(self, without_batch: Sequence[int]) -> list[int]:
        """The indices of the devices that get a replica, in order: those
        whose entry of ``sizes`` is non-zero (``[0]`` for a batch of 0
        rows), or `without_batch` when the call has no batch tensor."""
        if self.batch is None:
            return list(without_batch)
        return [i for i, s in enumerate(self.sizes) if s > 0] or [0]


def _replicas(sizes: Sequence[int]) -> int:
    return max(1, sum(1 for s in sizes if s > 0))


def plan_split(
    entries: Sequence[tuple[Any, int | None]],
    n_devices: int,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    dim: int = 0,
    units: Sequence[tuple[Any, int, str]] = (),
    hint: Any = "",
) -> SplitPlan:
    """The scatter rules, for the tensors of one call: ``entries`` holds one
     ``(path, size)`` per tensor to scatter, ``size`` its size along the split
     dim ``dim`` or None for a 0-dim tensor; ``units`` one ``(path, count,
     noun)`` per input that is split between its units, never inside one (a
     ``dpcore.Samples`` list: its samples; a PackedSequence: its sequences).

     Guarantees, in this order of decision:

     0. Where the call has units, the first one's count is the batch: every
        other unit must have that count (else ValueError naming both), and
        every tensor must have the batch's size, or (when that differs) the
        number of replicas a batch of that size runs on (split one row per
        replica, as in 3., or the device count, as in 3b.), or be 0-dim (1.);
        any other size is a ValueError
        naming the tensor and the first unit.

     1. A 0-dim tensor takes no part: it goes whole to every replica.
     2. When every other tensor has the same size, that size is the batch
        (also where it equals the number of replicas).
     3. Otherwise there must be exactly two sizes, ``b`` and ``r``, where
        ``r`` is the number of replicas that a batch of ``b`` rows runs on
        (by :func:`split_sizes` with ``chunk_sizes`` / ``weights``: fewer
        replicas than devices when ``b`` is smaller than the device count).
        Then ``b`` is the batch and every tensor of size ``r`` is split one
        row per replica, row j to the j-th replica (torch.nn.DataParallel's
        result for a tensor expanded to ``[n_gpu, ...]``). At most one of the
        two sizes can be the batch: ``r <= b`` always, so ``b = R(r)`` and
        ``r = R(b)`` would need ``b == r``.
    3b. Failing 3., the other size may be the device count ``n`` where a
        batch of ``b`` runs on fewer replicas (a short last batch, or zero
        chunk sizes or weights): row j still goes to the j-th replica, and
        the rows left over must all equal the first (Trainer's
        ``num_items_in_batch`` expanded to ``[n_gpu, 1]``), which the scatter
        checks (:func:`check_repeated_rows`): they are dropped only because
        they repeat a row that was sent.
     4. Every other disagreement is a ValueError naming two paths and their
        sizes and the replica count: nothing is truncated.

     ``hint`` (formatted only then) ends the messages of 0. and 4.
     ``chunk_sizes`` / ``weights`` are taken as :func:`check_split` returns
     them (checked once per call, by the caller); their errors against the
     batch are those of :func:`split_sizes`.
    """
    if units:
        return _plan_units(entries, n_devices, chunk_sizes, weights, dim, units, hint)
    sized = [(path, size) for path, size in entries if size is not None]
    if not sized:
        return SplitPlan(None, [], 1)
    first_path, first = sized[0]
    distinct = list(dict.fromkeys(size for _, size in sized))
    if len(distinct) == 1:
        sizes = _sizes(first, n_devices, chunk_sizes, weights)
        return SplitPlan(first, sizes, _replicas(sizes))
    if len(distinct) == 2:
        for batch, other in (distinct, distinct[::-1]):
            try:
                sizes = _sizes(batch, n_devices, chunk_sizes, weights)
            except (TypeError, ValueError):
                continue  # this size cannot be the batch under the split given
            if _replicas(sizes) == other:
                return SplitPlan(batch, sizes, other)
        for batch, other in (distinct, distinct[::-1]):  # 3b.
            if other != n_devices:
                continue
            try:
                sizes = _sizes(batch, n_devices, chunk_sizes, weights)
            except (TypeError, ValueError):
                continue
            if _replicas(sizes) < n_devices:
                return SplitPlan(batch, sizes, _replicas(sizes))
    # No size is the batch: name the first tensor whose size is neither the
    # first tensor's nor (as one row per replica) the replica count that size gives.
    try:
        replicas: int | None = _replicas(_sizes(first, n_devices, chunk_sizes, weights))
    except (TypeError, ValueError):
        replicas = None
    path, size = next(
        ((p, s) for p, s in sized if s != first and s != replicas),
        next((p, s) for p, s in sized if s != first),
    )
    per_replica = (
        f" or, to be split one row per replica, the number of replicas used ({replicas} for a batch of {first})"
        if replicas is not None
        else ""
    )
    raise ValueError(
        f"{path} has size {size} along dim {dim} but {first_path} has size {first}: every tensor scattered in "
        f"one call must have the batch's size along dim {dim}{per_replica} (wrap a tensor in dpcore.Broadcast "
        f"to pass it whole to every replica){hint}"
    )


def check_first_device(
    sizes: Sequence[int],
    devices: Sequence[int],
    n_devices: int,
    chunk_sizes: Sequence[int] | None,
    weights: Sequence[float] | None,
) -> None:
    """DataParallel's rule on top of the split: the first device, which holds
    the module, gets rows. `sizes` are the rows of the replicas on the device
    indices `devices` (as :meth:`SplitPlan.devices` chose them); a split
    that leaves device 0 out is a ValueError naming ``chunk_sizes`` or
    ``weights`` and the split, per device."""
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


def _plan_units(
    entries: Sequence[tuple[Any, int | None]],
    n_devices: int,
    chunk_sizes: Sequence[int] | None,
    weights: Sequence[float] | None,
    dim: int,
    units: Sequence[tuple[Any, int, str]],
    hint: Any,
) -> SplitPlan:
    """plan_split's rule 0 (see there)."""
    first_path, batch, noun = units[0]
    for path, count, what in units[1:]:
        if count != batch:
            raise ValueError(
                f"{path} has {count} {what} but {first_path} has {batch} {noun}: every input that is split between "
                f"samples (dpcore.Samples lists, PackedSequences) in one call must hold the batch's number of them"
            )
    sizes = _sizes(batch, n_devices, chunk_sizes, weights)
    replicas = _replicas(sizes)
    for path, size in entries:
        if size is not None and size != batch and size != replicas and not (size == n_devices > replicas):
            raise ValueError(
                f"{path} has size {size} along dim {dim} but {first_path} has {batch} {noun}: every tensor "
                f"scattered in one call must have the batch's size ({batch}) along dim {dim} or, to be split one row "
                f"per replica, the number of replicas used ({replicas}) (wrap a tensor in dpcore.Broadcast to pass "
                f"it whole to every replica){hint}"
            )
    return SplitPlan(batch, sizes, replicas)


def check_repeated_rows(t: torch.Tensor, dim: int, replicas: int, path: Any) -> torch.Tensor:
    """The first `replicas` rows (along `dim`) of `t`, a tensor of one row
    per device split over fewer replicas (rule 3b of :func:`plan_split`),
    after checking that every row equals the first: ValueError naming
    `path` otherwise, since the rows beyond the replicas would be lost. Reads
    the values (a device synchronization), only in this case."""
    first = t.narrow(dim, 0, 1)
    if not bool((t == first).all()):
        raise ValueError(
            f"{path} has size {t.size(dim)} along dim {dim}, one row per device, but the batch runs on {replicas} "
            f"replica(s), and its rows differ: rows {replicas}.. would be dropped (as one row per device, they are "
            f"sent only where they all repeat the first, as Trainer's expanded num_items_in_batch does)"
        )
    return t.narrow(dim, 0, replicas)
