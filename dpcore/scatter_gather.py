"""Scatter of inputs and gather of outputs for data parallelism, over pytrees.

Pytrees (see :mod:`dpcore._pytree`, which flattens them) are walked through
tensors, tuples, lists, dicts (any Mapping subclass), namedtuples
(collections and typing), dataclass instances, types registered with
``torch.utils._pytree`` (through their registered flatten and unflatten),
other sized iterables holding tensors (rebuilt from their elements, as
torch.nn.DataParallel's gather does) and :class:`Broadcast` wrappers; every
container is rebuilt with its own type for every replica, every other value
is a leaf. ``torch.Size`` is a leaf. How many rows each device gets is
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

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dpcore import _pytree as pt
from dpcore import comm
from dpcore._devices import DeviceLike, as_devices, normalize_device
from dpcore._functions import BroadcastTensor, Gather, Scatter
from dpcore._pytree import BROADCAST, DATACLASS, LEAF, MAPPING, NONE, REGISTERED, TENSOR, Broadcast
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


def _broadcast_marks(count: int, ranges: list[tuple[int, int]]) -> list[bool] | None:
    """Which of `count` flattened tensors sit inside a Broadcast (None: none)."""
    if not ranges:
        return None
    marks = [False] * count
    for start, end in ranges:
        marks[start:end] = [True] * (end - start)
    return marks


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
    With no tensor to split the replicas are the devices `without_tensors`.
    Each tree is flattened once; its spec rebuilds it for every replica."""
    flats = [pt.flatten_marked(tree) for tree, _ in trees]
    marks = [_broadcast_marks(len(tensors), ranges) for tensors, _, ranges in flats]
    leaves: list[tuple[Any, torch.Tensor]] = []  # (path, tensor) of the tensors to split
    for (tree, path), (tensors, spec, _), marked in zip(trees, flats, marks):
        for i, t in enumerate(tensors):
            if marked is None or not marked[i]:
                leaves.append((pt.LazyPath(tree, spec, i, path), t))
    plan = plan_split(_check_batch(leaves, dim), len(devices), chunk_sizes, weights, dim)
    used = plan.devices(without_tensors)
    used_sizes = [plan.sizes[i] for i in used] if plan.batch is not None else [0] * len(used)
    used_devices = [devices[i] for i in used]
    memo: dict[tuple[int, bool], tuple[torch.Tensor, Sequence[torch.Tensor]]] = {}

    def per_replica(t: torch.Tensor, whole: bool) -> Sequence[torch.Tensor]:
        hit = memo.get((id(t), whole))
        if hit is None:
            # plan_split checked every tensor: 0-dim whole, the batch's size by the split, any other one row each
            if whole or t.dim() == 0:
                parts: Sequence[torch.Tensor] = _broadcast_tensor(t, used_devices)
            else:
                rows = used_sizes if t.size(dim) == plan.batch else [1] * len(used)
                parts = Scatter.apply(used_devices, rows, dim, t)
            hit = memo[(id(t), whole)] = (t, parts)
        return hit[1]

    values = []
    for (tree, path), (tensors, spec, _), marked in zip(trees, flats, marks):
        columns = [per_replica(t, marked is not None and marked[i]) for i, t in enumerate(tensors)]
        try:
            values.append(spec.unflatten_replicas(columns, len(used)))
        except pt.RebuildError as e:
            raise TypeError(
                f"{pt.path_at(tree, spec.trail_to(e.node), path)} {e}; or wrap it in dpcore.Broadcast to pass it whole to "
                f"every replica"
            ) from e
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
      also with ``init=False`` fields, types registered with
      ``torch.utils._pytree`` through their flatten and unflatten, other
      iterables holding tensors as ``type(obj)(iterator over the split
      elements)``, e.g. a KV cache fed back for the next decoding step) are
      rebuilt with their own type for every replica; empty containers
      survive; every other leaf is passed by reference (``is`` the caller's
      object) to every replica. An iterable whose type cannot be rebuilt so
      is a TypeError naming its path.
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


_WRAPPABLE = (RuntimeError, ValueError, IndexError, TypeError)
_VALUES = (NONE, LEAF, BROADCAST)


class _Mismatch(Exception):
    """Replica ``replica``'s output differs from replica 0's at ``trail``."""

    def __init__(self, replica: int, got: str, expected: str, what: str = "") -> None:
        super().__init__()
        self.replica, self.got, self.expected, self.what = replica, got, expected, what
        self.trail: list[int] = []


def _value(spec: pt.Spec, tensors: list[torch.Tensor], start: int) -> Any:
    """The non-tensor value at `spec` (None, a leaf, or a rebuilt Broadcast)."""
    if spec.kind is LEAF:
        return spec.context
    if spec.kind is NONE:
        return None
    return spec.unflatten(tensors[start : start + spec.num_tensors])


def _mismatch(
    specs: list[pt.Spec], starts: list[int], flats: list[list[torch.Tensor]], j: int, what: str = ""
) -> _Mismatch:
    got, first = specs[j], specs[0]
    return _Mismatch(
        j,
        pt.describe_spec(got, flats[j][starts[j]] if got.kind is TENSOR else None),
        pt.describe_spec(first, flats[0][starts[0]] if first.kind is TENSOR else None),
        what,
    )


def _merge(
    specs: list[pt.Spec], starts: list[int], flats: list[list[torch.Tensor]], columns: list[list[torch.Tensor]]
) -> pt.Spec:
    """The spec of the gathered output at one node, from the replicas' specs
    there (`starts`: where each replica's tensors of this node begin in its
    flattened list `flats[j]`). Appends one column of per-replica tensors to
    `columns` per tensor, in the order of the returned spec; raises _Mismatch
    where the structures differ."""
    first = specs[0]
    first_kind = first.kind
    if first_kind is TENSOR:
        for j, s in enumerate(specs):
            if s.kind is not TENSOR:
                raise _mismatch(specs, starts, flats, j)
        columns.append([flat[start] for flat, start in zip(flats, starts)])
        return first

    if first_kind in _VALUES:
        # Plain values: None stays None if every replica returned None; any
        # mix of non-container, non-tensor values gathers into a list.
        for j, s in enumerate(specs):
            if s.kind not in _VALUES:
                raise _mismatch(specs, starts, flats, j)
        if all(s.kind is NONE for s in specs):
            return first
        return pt.Spec(LEAF, list, [_value(s, flats[j], starts[j]) for j, s in enumerate(specs)], (), 0)

    cls = first.type
    count = len(first.children)
    orders: list[list[int] | None] | None = None  # per replica: its child index of each of first's
    for j in range(1, len(specs)):
        s = specs[j]
        if s.kind is not first_kind or s.type is not cls:
            raise _mismatch(specs, starts, flats, j)
        if first_kind is MAPPING:
            keys, other = first.context[0], s.context[0]
            if other == keys:
                continue
            if set(other) != set(keys):
                missing = [k for k in keys if k not in set(other)]
                extra = [k for k in other if k not in set(keys)]
                raise _mismatch(specs, starts, flats, j, f" (missing keys {missing}, extra keys {extra})")
            position = {k: i for i, k in enumerate(other)}
            orders = orders or [None] * len(specs)
            orders[j] = [position[k] for k in keys]
            continue
        if (first_kind is REGISTERED or first_kind is DATACLASS) and not (s.context,) == (first.context,):
            raise _mismatch(
                specs, starts, flats, j, f" (its structure differs: {s.context!r} against replica 0's {first.context!r})"
            )
        if len(s.children) != count:
            raise _mismatch(specs, starts, flats, j)

    # Where each replica's tensors of each child begin.
    child_starts = []
    for s, start in zip(specs, starts):
        offsets = []
        for child in s.children:
            offsets.append(start)
            start += child.num_tensors
        child_starts.append(offsets)
    before = len(columns)
    kids = []
    for c in range(count):
        if orders is None:
            sub_specs = [s.children[c] for s in specs]
            sub_starts = [offsets[c] for offsets in child_starts]
        else:
            picks = [c if order is None else order[c] for order in orders]
            sub_specs = [s.children[i] for s, i in zip(specs, picks)]
            sub_starts = [offsets[i] for offsets, i in zip(child_starts, picks)]
        try:
            kids.append(_merge(sub_specs, sub_starts, flats, columns))
        except _Mismatch as e:
            e.trail.insert(0, c)
            raise
    return pt.Spec(first_kind, cls, first.context, tuple(kids), len(columns) - before, first.template)


def _gather_tensors(values: list[torch.Tensor], path: Any, destination: DeviceLike | None, dim: int) -> torch.Tensor:
    try:
        return Gather.apply(destination, dim, *values)
    except _WRAPPABLE as e:
        if type(e) in _WRAPPABLE:
            raise type(e)(f"gather: {path}: {e}") from e
        raise


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
      dataclasses are rebuilt with their own type; types registered with
      ``torch.utils._pytree`` through their unflatten function (the
      replicas' contexts must be equal); other sized iterables holding tensors as
      torch.nn.DataParallel rebuilds them, ``type(out)(iterator over the
      gathered elements)`` (a KV cache comes back as one cache for the
      whole batch); an iterable whose type cannot be rebuilt so is a
      TypeError naming its path.
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
    first = values[0]
    if all(type(v) is torch.Tensor for v in values):
        return _gather_tensors(values, "output", target_device, dim)
    flats = [pt.flatten(v) for v in values]
    columns: list[list[torch.Tensor]] = []
    try:
        spec = _merge([s for _, s in flats], [0] * len(values), [t for t, _ in flats], columns)
    except _Mismatch as e:
        raise ValueError(
            f"gather: {pt.path_at(first, e.trail, 'output')} of replica {e.replica} is {e.got} but replica 0's is "
            f"{e.expected}{e.what}; every replica must return the same structure"
        ) from None
    gathered = []
    for i, column in enumerate(columns):
        try:
            gathered.append(Gather.apply(target_device, dim, *column))
        except _WRAPPABLE as e:
            if type(e) in _WRAPPABLE:
                raise type(e)(f"gather: {pt.tensor_path(first, spec, i, 'output')}: {e}") from e
            raise
    try:
        return spec.unflatten(gathered)
    except pt.RebuildError as e:
        raise TypeError(
            f"gather: {pt.path_at(first, spec.trail_to(e.node), 'output')} {e}; or use gather=False to get the per-replica outputs"
        ) from e

