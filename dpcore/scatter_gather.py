"""Scatter of inputs and gather of outputs for data parallelism, over pytrees.

Pytrees (see :mod:`dpcore._pytree`) are walked through tensors, tuples,
lists, dicts (any Mapping subclass), namedtuples (collections and typing),
dataclass instances and :class:`Broadcast` wrappers; every container is
rebuilt with its own type for every replica, every other value is a leaf.
``torch.Size`` is a leaf. How many rows each device gets is
:func:`dpcore._split.split_sizes`.

* :func:`scatter_kwargs`: splits positional and keyword arguments into one
  ``(args, kwargs)`` pair per replica; tensors through the differentiable
  :class:`dpcore._functions.Scatter`, so gradients reach the inputs.
* :func:`scatter` and :func:`gather`: torch.nn.parallel's top-level
  functions, with their arguments (``dpcore.scatter``, ``dpcore.gather``);
  gather merges per-replica outputs of one structure into one output,
  tensors through the differentiable :class:`dpcore._functions.Gather`.

Errors name the pytree path of the offending value, e.g.
``inputs[1]['mask']``, ``kwargs['x'].field`` or ``output['logits'][0]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dpcore import _pytree as pt
from dpcore import comm
from dpcore._devices import DeviceLike, as_devices, normalize_device
from dpcore._functions import BroadcastTensor, Gather, Scatter
from dpcore._pytree import Broadcast
from dpcore._split import check_split, plan_split

__all__ = ["Broadcast", "Scattered", "scatter_kwargs", "scatter", "gather"]


# ---------------------------------------------------------------------------
# Scatter
# ---------------------------------------------------------------------------


class Scattered(NamedTuple):
    """What :func:`scatter_kwargs` returns: one entry per replica in each list."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    sizes: list[int]
    device_indices: list[int]


def _collect_tensors(obj: Any, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    """Appends (path, tensor) for every tensor to scatter (outside Broadcast)."""
    kind = pt.kind(obj)
    if kind == pt.TENSOR:
        out.append((path, obj))
    elif kind in pt.CONTAINERS:
        for sub, child in pt.children(obj, kind, path):
            _collect_tensors(child, sub, out)


def _broadcast_tensor(tensor: torch.Tensor, devices: list[torch.device]) -> list[torch.Tensor]:
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return list(comm.broadcast(tensor, devices))
    outs = list(BroadcastTensor.apply(devices, tensor))
    source = normalize_device(tensor.device)
    for i, device in enumerate(devices):
        if device == source:
            outs[i] = tensor  # the source replica gets the object itself
            break
    return outs


def _broadcast_tree(obj: Any, devices: list[torch.device]) -> list[Any]:
    """One copy of ``obj`` per device: tensors broadcast, containers rebuilt,
    other leaves (and tensor-free subtrees) by reference."""
    if not pt.contains_tensor(obj):
        return [obj] * len(devices)
    kind = pt.kind(obj)
    if kind == pt.TENSOR:
        return _broadcast_tensor(obj, devices)
    if kind == pt.BROADCAST:
        return _broadcast_tree(obj.value, devices)
    columns = [_broadcast_tree(child, devices) for _, child in pt.children(obj, kind, "")]
    return [pt.rebuild(obj, kind, [col[j] for col in columns]) for j in range(len(devices))]


def _scatter_tree(
    obj: Any,
    path: str,
    n: int,
    scatter_tensor: Callable[[torch.Tensor], Sequence[torch.Tensor]],
    devices: list[torch.device],
) -> list[Any]:
    kind = pt.kind(obj)
    if kind == pt.TENSOR:
        return list(scatter_tensor(obj))
    if kind == pt.BROADCAST:
        return _broadcast_tree(obj.value, devices)
    if kind in pt.CONTAINERS:
        columns = [_scatter_tree(child, sub, n, scatter_tensor, devices) for sub, child in pt.children(obj, kind, path)]
        return [pt.rebuild(obj, kind, [col[j] for col in columns]) for j in range(n)]
    return [obj] * n


def _check_batch(leaves: list[tuple[str, torch.Tensor]], dim: int) -> list[tuple[str, int | None]]:
    """(path, size along ``dim``) of every tensor to scatter, None for a 0-dim
    one; ValueError for a tensor that cannot be split along ``dim``. Which
    sizes may be mixed is :func:`dpcore._split.plan_split`'s rule."""
    entries: list[tuple[str, int | None]] = []
    for path, t in leaves:
        if t.layout != torch.strided:
            raise ValueError(
                f"{path} is a {t.layout} tensor and cannot be split: DataParallel splits dense (strided) "
                f"tensors only; wrap it in dpcore.Broadcast to pass it whole to every replica"
            )
        if t.dim() == 0:
            entries.append((path, None))  # goes whole to every replica
            continue
        if not -t.dim() <= dim < t.dim():
            raise ValueError(
                f"{path} has {t.dim()} dimensions and cannot be split along dim {dim} "
                f"(expected dim in [{-t.dim()}, {t.dim() - 1}])"
            )
        entries.append((path, t.size(dim)))
    return entries


def _devices(devices: Sequence[DeviceLike], arg: str) -> list[torch.device]:
    devs = as_devices(devices, arg)
    if not devs:
        raise ValueError(f"{arg}: expected at least one device, but got an empty list")
    return devs


def _split(
    trees: Sequence[tuple[Any, str]],
    devices: list[torch.device],
    dim: int,
    chunk_sizes: Sequence[int] | None,
    weights: Sequence[float] | None,
    without_tensors: list[int],
) -> tuple[list[list[Any]], list[int], list[int]]:
    """Splits each (tree, path) of `trees` into one value per replica; returns
    (per tree, its values), the replicas' sizes and their device indices.
    With no tensor to split the replicas are the devices `without_tensors`."""
    leaves: list[tuple[str, torch.Tensor]] = []
    for tree, path in trees:
        _collect_tensors(tree, path, leaves)
    plan = plan_split(_check_batch(leaves, dim), len(devices), chunk_sizes, weights, dim)
    if plan.batch is not None:
        used = [i for i, s in enumerate(plan.sizes) if s > 0] or [0]
        used_sizes = [plan.sizes[i] for i in used]
    else:
        used, used_sizes = without_tensors, [0] * len(without_tensors)
    used_devices = [devices[i] for i in used]
    memo: dict[int, tuple[torch.Tensor, Sequence[torch.Tensor]]] = {}

    def scatter_tensor(t: torch.Tensor) -> Sequence[torch.Tensor]:
        # plan_split checked every tensor: 0-dim whole, the batch's size by the split, any other one row each
        hit = memo.get(id(t))
        if hit is None:
            if t.dim() == 0:
                parts: Sequence[torch.Tensor] = _broadcast_tensor(t, used_devices)
            else:
                rows = used_sizes if t.size(dim) == plan.batch else [1] * len(used)
                parts = Scatter.apply(used_devices, rows, dim, t)
            hit = memo[id(t)] = (t, parts)
        return hit[1]

    values = [_scatter_tree(tree, path, len(used), scatter_tensor, used_devices) for tree, path in trees]
    return values, used_sizes, used


def scatter_kwargs(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> Scattered:
    """Splits a call's positional and keyword arguments across ``devices``.

    ``inputs`` is the tuple of positional arguments (None means none; any
    other value, a namedtuple included, is taken as the single positional
    argument), ``kwargs`` the keyword arguments (or None).

    Returns a :class:`Scattered` ``(args, kwargs, sizes, device_indices)``,
    four lists of one length R, the number of replicas: replica j is called
    as ``f(*args[j], **kwargs[j])`` on ``devices[device_indices[j]]`` and got
    ``sizes[j]`` rows.

    Guarantees:

    * Every tensor outside :class:`Broadcast` is split along ``dim`` with the
      differentiable :class:`~dpcore._functions.Scatter` (gradients flow back
      to the input tensors); all of them must have the same size along
      ``dim`` (the batch), except as :func:`dpcore._split.plan_split` rules:
      a 0-dim tensor goes whole to every replica, and a tensor whose size
      is the number of replicas used (while the batch's is not) is split one
      row per replica. Any other disagreement is a ValueError naming both
      pytree paths and sizes (never a silent truncation).
    * The rows are split by :func:`dpcore._split.split_sizes` (balanced by
      default, or ``chunk_sizes`` / ``weights``). Devices whose chunk is
      empty get no replica: ``device_indices`` lists, in order, the devices
      whose split entry is non-zero; with the default split these are the
      first R devices (batch 3 over 4 devices gives 3 replicas). A chunk on
      its source tensor's device is a view of it.
    * Containers (tuple, list, any Mapping subclass incl. OrderedDict and
      defaultdict with its ``default_factory``, namedtuples, dataclasses,
      also with ``init=False`` fields) are rebuilt with their own type for
      every replica; empty containers survive; every other leaf is passed by
      reference (``is`` the caller's object) to every replica.
    * With no tensor to split, or a batch of 0 rows, there is exactly one
      replica (on ``devices[0]``), with ``sizes == [0]`` and
      ``device_indices == [0]``.
    """
    devs = _devices(devices, "devices")
    check_split(chunk_sizes, weights, len(devs))
    if inputs is None:
        inputs = ()
    elif not isinstance(inputs, tuple) or pt.is_namedtuple(inputs):
        inputs = (inputs,)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs: expected a mapping of keyword arguments, but got {type(kwargs).__name__}")
    (args, kws), sizes, used = _split(
        [(tuple(inputs), "inputs"), (kwargs, "kwargs")], devs, dim, chunk_sizes, weights, [0]
    )
    return Scattered(args, kws, sizes, used)


def scatter(inputs: Any, target_gpus: Sequence[DeviceLike], dim: int = 0) -> Any:
    """Splits ``inputs`` across ``target_gpus`` (torch.nn.parallel.scatter's
    arguments; any device list dpcore takes, ``["cpu"] * 4`` included).

    Returns a tuple of chunks for a tensor, else a list with one value per
    device that got rows: tensors (outside :class:`Broadcast`) split along
    ``dim`` by the balanced split, differentiably, every container rebuilt
    and every other leaf passed by reference, as :func:`scatter_kwargs` does.
    With fewer rows than devices only the first ``rows`` devices get a value
    (torch's zip truncates alike); with no tensor to split every device gets
    one. Unlike torch, tensors of different sizes along ``dim`` are an error
    naming both, not a silent truncation (except as :func:`scatter_kwargs`
    says: 0-dim tensors whole, a tensor of the replica count one row each).
    """
    devs = _devices(target_gpus, "target_gpus")
    (values,), _, _ = _split([(inputs, "inputs")], devs, dim, None, None, list(range(len(devs))))
    return tuple(values) if isinstance(inputs, torch.Tensor) else values


# ---------------------------------------------------------------------------
# Gather
# ---------------------------------------------------------------------------


def _mismatch(path: str, j: int, value: Any, kind: str, first: Any, first_kind: str, what: str = "") -> ValueError:
    return ValueError(
        f"gather: {path} of replica {j} is {pt.describe(value, kind)} but replica 0's is "
        f"{pt.describe(first, first_kind)}{what}; every replica must return the same structure"
    )


_WRAPPABLE = (RuntimeError, ValueError, IndexError, TypeError)


def _gather_tree(values: list[Any], path: str, destination: DeviceLike | None, dim: int) -> Any:
    first = values[0]
    first_kind = pt.kind(first)
    kinds = [pt.kind(v) for v in values]

    if first_kind in (pt.NONE, pt.LEAF, pt.BROADCAST):
        # Plain values: None stays None if every replica returned None; any
        # mix of non-container, non-tensor values gathers into a list.
        for j, (v, k) in enumerate(zip(values, kinds)):
            if k not in (pt.NONE, pt.LEAF, pt.BROADCAST):
                raise _mismatch(path, j, v, k, first, first_kind)
        if all(k == pt.NONE for k in kinds):
            return None
        return list(values)

    for j, (v, k) in enumerate(zip(values, kinds)):
        if k != first_kind or type(v) is not type(first):
            raise _mismatch(path, j, v, k, first, first_kind)

    if first_kind == pt.TENSOR:
        try:
            return Gather.apply(destination, dim, *values)
        except _WRAPPABLE as e:
            if type(e) in _WRAPPABLE:
                raise type(e)(f"gather: {path}: {e}") from e
            raise

    if first_kind == pt.MAPPING:
        keys = list(first.keys())
        key_set = set(keys)
        for j, v in enumerate(values[1:], 1):
            other = set(v.keys())
            if other != key_set:
                missing = [k for k in keys if k not in other]
                extra = [k for k in v.keys() if k not in key_set]
                raise _mismatch(
                    path, j, v, first_kind, first, first_kind, f" (missing keys {missing}, extra keys {extra})"
                )
        gathered = [
            _gather_tree([v[key] for v in values], f"{path}[{key!r}]", destination, dim) for key in keys
        ]
        return pt.rebuild(first, first_kind, gathered)

    child_lists = [pt.children(v, first_kind, path) for v in values]
    first_paths = [p for p, _ in child_lists[0]]
    for j, children in enumerate(child_lists[1:], 1):
        if [p for p, _ in children] != first_paths:
            raise _mismatch(path, j, values[j], first_kind, first, first_kind)
    gathered = [
        _gather_tree([children[i][1] for children in child_lists], sub, destination, dim)
        for i, sub in enumerate(first_paths)
    ]
    return pt.rebuild(first, first_kind, gathered)


def gather(outputs: Sequence[Any], target_device: DeviceLike | None, dim: int = 0) -> Any:
    """Merges the per-replica ``outputs`` (one each, of one structure) into one
    (torch.nn.parallel.gather's arguments).

    Guarantees:

    * Tensors at the same path are concatenated along ``dim`` onto
      ``target_device`` with the differentiable
      :class:`~dpcore._functions.Gather` (gradients flow back to every
      replica's output); 0-dim tensors (per-replica scalars) are stacked into
      a 1-D tensor, without a warning.
    * Tuples, lists, Mappings (in replica 0's key order), namedtuples and
      dataclasses are rebuilt with their own type.
    * None stays None when every replica returned None; strings, numbers and
      other leaves gather into a list of the per-replica values (None among
      them included).
    * Structures that differ between replicas (types, lengths, dict keys, a
      tensor against a non-tensor) raise ValueError naming the path and the
      replica, e.g. "output['logits'] of replica 1 is None but replica 0's is
      a tensor"; tensors that cannot be concatenated raise the collective's
      error prefixed with their path.
    """
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, Sequence):
        raise TypeError(f"outputs: expected a sequence with one output per replica, but got {type(outputs).__name__}")
    values = list(outputs)
    if not values:
        raise ValueError("outputs: expected at least one replica's output, but got none")
    return _gather_tree(values, "output", target_device, dim)

