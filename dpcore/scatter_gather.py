"""Pytree scatter of inputs and gather of outputs for data parallelism.

Pytrees are walked through tensors, tuples, lists, dicts (any Mapping
subclass), namedtuples (collections and typing), dataclass instances and
:class:`Broadcast` wrappers; every container is rebuilt with its own type
for every replica, every other value is a leaf. ``torch.Size`` is a leaf.

* :func:`split_sizes`: how many rows (along the scatter dim) each device gets.
* :func:`scatter_kwargs`: splits positional and keyword arguments into one
  ``(args, kwargs)`` pair per replica; tensors through the differentiable
  :class:`dpcore._functions.Scatter`, so gradients reach the inputs.
* :func:`gather`: merges per-replica outputs of one structure into one
  output, tensors through the differentiable :class:`dpcore._functions.Gather`.

Errors name the pytree path of the offending value, e.g.
``inputs[1]['mask']``, ``kwargs['x'].field`` or ``output['logits'][0]``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Generic, TypeVar

import torch

from dpcore import _C, comm
from dpcore._devices import DeviceLike, as_devices
from dpcore._functions import BroadcastTensor, Gather, Scatter

__all__ = ["Broadcast", "split_sizes", "scatter_kwargs", "gather", "map_tensors"]

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
      broadcast as above and every other leaf passed by reference.

    Tensors inside a Broadcast take no part in the batch-size check.
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value: T = value

    def __repr__(self) -> str:
        return f"Broadcast({self.value!r})"


# ---------------------------------------------------------------------------
# Pytree nodes: classification, children, rebuilding
# ---------------------------------------------------------------------------

_TENSOR = "tensor"
_BROADCAST = "broadcast"
_DATACLASS = "dataclass"
_NAMEDTUPLE = "namedtuple"
_SEQUENCE = "sequence"
_MAPPING = "mapping"
_NONE = "none"
_LEAF = "leaf"

_CONTAINERS = (_DATACLASS, _NAMEDTUPLE, _SEQUENCE, _MAPPING)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields") and hasattr(obj, "_asdict")


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return _TENSOR
    if isinstance(obj, Broadcast):
        return _BROADCAST
    if obj is None:
        return _NONE
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _DATACLASS
    if _is_namedtuple(obj):
        return _NAMEDTUPLE
    if isinstance(obj, torch.Size):
        return _LEAF
    if isinstance(obj, (tuple, list)):
        return _SEQUENCE
    if isinstance(obj, Mapping):
        return _MAPPING
    return _LEAF


def _dataclass_fields(obj: Any) -> list[dataclasses.Field]:
    # An init=False field without a default may never have been set.
    return [f for f in dataclasses.fields(obj) if hasattr(obj, f.name)]


def _children(obj: Any, kind: str, path: str) -> list[tuple[str, Any]]:
    """(path, child) pairs of a container, in a fixed order."""
    if kind == _DATACLASS:
        return [(f"{path}.{f.name}", getattr(obj, f.name)) for f in _dataclass_fields(obj)]
    if kind == _NAMEDTUPLE:
        return [(f"{path}.{name}", v) for name, v in zip(obj._fields, obj)]
    if kind == _SEQUENCE:
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if kind == _MAPPING:
        return [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    raise AssertionError(kind)


def _has_initvars(cls: type) -> bool:
    initvar = getattr(dataclasses, "_FIELD_INITVAR", None)
    return any(getattr(f, "_field_type", None) is initvar for f in getattr(cls, "__dataclass_fields__", {}).values())


def _rebuild(obj: Any, kind: str, values: list[Any]) -> Any:
    """A container of ``obj``'s type (and form) holding ``values``, in the
    order of ``_children(obj)``."""
    if kind == _DATACLASS:
        fields = _dataclass_fields(obj)
        by_name = {f.name: v for f, v in zip(fields, values)}
        if _has_initvars(type(obj)):
            new = copy.copy(obj)  # replace() cannot recover InitVar arguments
            later = fields
        else:
            new = dataclasses.replace(obj, **{f.name: by_name[f.name] for f in fields if f.init})
            later = [f for f in fields if not f.init]
        for f in later:
            object.__setattr__(new, f.name, by_name[f.name])
        return new
    if kind == _NAMEDTUPLE:
        return type(obj)(*values)
    if kind == _SEQUENCE:
        if type(obj) is tuple:
            return tuple(values)
        if type(obj) is list:
            return values
        return type(obj)(values)
    if kind == _MAPPING:
        items = dict(zip(obj.keys(), values))
        if type(obj) is dict:
            return items
        if isinstance(obj, defaultdict):
            new = type(obj)(obj.default_factory)
            new.update(items)
            return new
        return type(obj)(items)
    raise AssertionError(kind)


def _contains_tensor(obj: Any) -> bool:
    kind = _kind(obj)
    if kind == _TENSOR:
        return True
    if kind == _BROADCAST:
        return _contains_tensor(obj.value)
    if kind in _CONTAINERS:
        return any(_contains_tensor(child) for _, child in _children(obj, kind, ""))
    return False


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, containers
    rebuilt with their own type (as gather does); other leaves are kept."""
    kind = _kind(obj)
    if kind == _TENSOR:
        return fn(obj)
    if kind in _CONTAINERS:
        return _rebuild(obj, kind, [map_tensors(fn, child) for _, child in _children(obj, kind, "")])
    return obj


# ---------------------------------------------------------------------------
# Split sizes
# ---------------------------------------------------------------------------


def _as_int(value: Any, arg: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{arg}: expected an int, but got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{arg}: expected an int, but got {type(value).__name__} {value!r}") from None


def _as_list(values: Any, arg: str) -> list[Any]:
    if isinstance(values, (str, bytes, Mapping)):
        raise TypeError(f"{arg}: expected a sequence with one entry per device, but got {type(values).__name__}")
    try:
        return list(values)
    except TypeError:
        raise TypeError(
            f"{arg}: expected a sequence with one entry per device, but got {type(values).__name__}"
        ) from None


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
    * ``chunk_sizes``: used as given, after checking there is one
      non-negative int per device and that they sum to ``batch``;
    * ``weights``: one non-negative finite number per device with a positive
      sum; device i gets ``batch * weights[i] / sum(weights)`` rows rounded by
      the largest-remainder method (ties to the lower index); a zero weight
      gets no rows.

    Raises ValueError (TypeError for a wrong kind of value) naming the
    argument; giving both ``chunk_sizes`` and ``weights`` is an error.
    """
    batch = _as_int(batch, "batch")
    n_devices = _as_int(n_devices, "n_devices")
    if batch < 0:
        raise ValueError(f"batch: expected a non-negative size, but got {batch}")
    if n_devices < 1:
        raise ValueError(f"n_devices: expected at least one device, but got {n_devices}")
    if chunk_sizes is not None and weights is not None:
        raise ValueError("split_sizes: give at most one of 'chunk_sizes' and 'weights', but got both")

    if chunk_sizes is not None:
        sizes = [_as_int(s, f"chunk_sizes[{i}]") for i, s in enumerate(_as_list(chunk_sizes, "chunk_sizes"))]
        if len(sizes) != n_devices:
            raise ValueError(
                f"chunk_sizes: expected one size per device ({n_devices}), but got {len(sizes)}: {sizes}"
            )
        for i, s in enumerate(sizes):
            if s < 0:
                raise ValueError(f"chunk_sizes[{i}]: expected a non-negative size, but got {s}")
        if sum(sizes) != batch:
            raise ValueError(
                f"chunk_sizes: expected sizes summing to the batch size {batch}, but {sizes} sum to {sum(sizes)}"
            )
        return sizes

    if weights is not None:
        ws = _as_list(weights, "weights")
        if len(ws) != n_devices:
            raise ValueError(f"weights: expected one weight per device ({n_devices}), but got {len(ws)}: {ws}")
        fracs: list[Fraction] = []
        for i, w in enumerate(ws):
            try:
                if isinstance(w, (bool, str, bytes)):
                    raise TypeError
                wf = float(w)
            except (TypeError, ValueError):
                raise TypeError(f"weights[{i}]: expected a number, but got {type(w).__name__} {w!r}") from None
            if not math.isfinite(wf) or wf < 0:
                raise ValueError(f"weights[{i}]: expected a non-negative finite number, but got {w!r}")
            fracs.append(Fraction(wf))
        total = sum(fracs, Fraction(0))
        if total <= 0:
            raise ValueError(f"weights: expected a positive sum, but got {ws}")
        quotas = [batch * f / total for f in fracs]
        sizes = [math.floor(q) for q in quotas]
        remaining = batch - sum(sizes)
        order = sorted(range(n_devices), key=lambda i: (-(quotas[i] - sizes[i]), i))
        for i in order[:remaining]:
            sizes[i] += 1
        return sizes

    return list(_C.balanced_chunk_sizes(batch, n_devices))


# ---------------------------------------------------------------------------
# Scatter
# ---------------------------------------------------------------------------


def _collect_tensors(obj: Any, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    """Appends (path, tensor) for every tensor to scatter (outside Broadcast)."""
    kind = _kind(obj)
    if kind == _TENSOR:
        out.append((path, obj))
    elif kind in _CONTAINERS:
        for sub, child in _children(obj, kind, path):
            _collect_tensors(child, sub, out)


def _broadcast_tensor(tensor: torch.Tensor, devices: list[torch.device]) -> list[torch.Tensor]:
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return list(comm.broadcast(tensor, devices))
    outs = list(BroadcastTensor.apply(devices, tensor))
    for i, device in enumerate(devices):
        if device == tensor.device:
            outs[i] = tensor  # the source replica gets the object itself
            break
    return outs


def _broadcast_tree(obj: Any, devices: list[torch.device]) -> list[Any]:
    """One copy of ``obj`` per device: tensors broadcast, containers rebuilt,
    other leaves (and tensor-free subtrees) by reference."""
    if not _contains_tensor(obj):
        return [obj] * len(devices)
    kind = _kind(obj)
    if kind == _TENSOR:
        return _broadcast_tensor(obj, devices)
    if kind == _BROADCAST:
        return _broadcast_tree(obj.value, devices)
    columns = [_broadcast_tree(child, devices) for _, child in _children(obj, kind, "")]
    return [_rebuild(obj, kind, [col[j] for col in columns]) for j in range(len(devices))]


def _scatter_tree(
    obj: Any,
    path: str,
    n: int,
    scatter_tensor: Callable[[torch.Tensor], Sequence[torch.Tensor]],
    devices: list[torch.device],
) -> list[Any]:
    kind = _kind(obj)
    if kind == _TENSOR:
        return list(scatter_tensor(obj))
    if kind == _BROADCAST:
        return _broadcast_tree(obj.value, devices)
    if kind in _CONTAINERS:
        columns = [_scatter_tree(child, sub, n, scatter_tensor, devices) for sub, child in _children(obj, kind, path)]
        return [_rebuild(obj, kind, [col[j] for col in columns]) for j in range(n)]
    return [obj] * n


def _check_batch(leaves: list[tuple[str, torch.Tensor]], dim: int) -> int:
    """The common size along ``dim`` of the tensors to scatter."""
    first_path, batch = "", -1
    for path, t in leaves:
        if t.dim() == 0:
            raise ValueError(
                f"{path} is a 0-dim tensor and cannot be split along dim {dim}; "
                f"wrap it in dpcore.Broadcast to pass it whole to every replica"
            )
        if not -t.dim() <= dim < t.dim():
            raise ValueError(
                f"{path} has {t.dim()} dimensions and cannot be split along dim {dim} "
                f"(expected dim in [{-t.dim()}, {t.dim() - 1}])"
            )
        size = t.size(dim)
        if batch < 0:
            first_path, batch = path, size
        elif size != batch:
            raise ValueError(
                f"{path} has size {size} along dim {dim} but {first_path} has size {batch}: every tensor "
                f"scattered in one call must have the same size along dim {dim} (wrap a tensor in "
                f"dpcore.Broadcast to pass it whole to every replica)"
            )
    return batch


def scatter_kwargs(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
    """Splits a call's positional and keyword arguments across ``devices``.

    ``inputs`` is the tuple of positional arguments (None means none; any
    other value, a namedtuple included, is taken as the single positional
    argument), ``kwargs`` the keyword arguments (or None).

    Returns ``(args, kwargs_list, sizes)``, three lists of one length R, the
    number of replicas: replica j is called as ``f(*args[j], **kwargs_list[j])``
    and got ``sizes[j]`` rows.

    Guarantees:

    * Every tensor outside :class:`Broadcast` is split along ``dim`` with the
      differentiable :class:`~dpcore._functions.Scatter` (gradients flow back
      to the input tensors); all of them must have the same size along
      ``dim``, else ValueError naming both pytree paths and sizes (never a
      silent truncation). A 0-dim tensor to split is an error too.
    * The rows are split by :func:`split_sizes` (balanced by default, or
      ``chunk_sizes`` / ``weights``). Devices whose chunk is empty get no
      replica: replica j runs on ``devices[k_j]``, ``k_j`` the index of the
      j-th non-zero split entry; with the default split these are the first
      R devices (batch 3 over 4 devices gives 3 replicas). A chunk on its
      source tensor's device is a view of it.
    * Containers (tuple, list, any Mapping subclass incl. OrderedDict and
      defaultdict with its ``default_factory``, namedtuples, dataclasses,
      also with ``init=False`` fields) are rebuilt with their own type for
      every replica; empty containers survive; every other leaf is passed by
      reference (``is`` the caller's object) to every replica.
    * With no tensor to split, or a batch of 0 rows, there is exactly one
      replica (on ``devices[0]``), with ``sizes == [0]``.
    """
    devs = as_devices(devices, "devices")
    if not devs:
        raise ValueError("devices: expected at least one device, but got an empty list")
    if chunk_sizes is not None and weights is not None:
        raise ValueError("scatter_kwargs: give at most one of 'chunk_sizes' and 'weights', but got both")
    if inputs is None:
        inputs = ()
    elif not isinstance(inputs, tuple) or _is_namedtuple(inputs):
        inputs = (inputs,)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs: expected a mapping of keyword arguments, but got {type(kwargs).__name__}")

    leaves: list[tuple[str, torch.Tensor]] = []
    _collect_tensors(inputs, "inputs", leaves)
    _collect_tensors(kwargs, "kwargs", leaves)

    if leaves:
        batch = _check_batch(leaves, dim)
        sizes = split_sizes(batch, len(devs), chunk_sizes, weights)
        used = [i for i, s in enumerate(sizes) if s > 0] or [0]
    else:
        sizes, used = [0], [0]
    used_devices = [devs[i] for i in used]
    used_sizes = [sizes[i] for i in used]
    n = len(used)

    memo: dict[int, tuple[torch.Tensor, Sequence[torch.Tensor]]] = {}

    def scatter_tensor(t: torch.Tensor) -> Sequence[torch.Tensor]:
        hit = memo.get(id(t))
        if hit is None:
            hit = memo[id(t)] = (t, Scatter.apply(used_devices, used_sizes, dim, t))
        return hit[1]

    args_per_replica = _scatter_tree(tuple(inputs), "inputs", n, scatter_tensor, used_devices)
    kwargs_per_replica = _scatter_tree(kwargs, "kwargs", n, scatter_tensor, used_devices)
    return list(args_per_replica), list(kwargs_per_replica), used_sizes


# ---------------------------------------------------------------------------
# Gather
# ---------------------------------------------------------------------------


def _describe(obj: Any, kind: str) -> str:
    name = type(obj).__name__
    if kind == _SEQUENCE or kind == _NAMEDTUPLE:
        return f"a {name} of length {len(obj)}"
    if kind == _MAPPING:
        return f"a {name} with keys {list(obj.keys())}"
    if kind == _NONE:
        return "None"
    if kind == _TENSOR:
        return f"a tensor of shape {list(obj.shape)}"
    return f"a {name}"


def _mismatch(path: str, j: int, value: Any, kind: str, first: Any, first_kind: str, what: str = "") -> ValueError:
    return ValueError(
        f"gather: {path} of replica {j} is {_describe(value, kind)} but replica 0's is "
        f"{_describe(first, first_kind)}{what}; every replica must return the same structure"
    )


_WRAPPABLE = (RuntimeError, ValueError, IndexError, TypeError)


def _gather_tree(values: list[Any], path: str, destination: DeviceLike | None, dim: int) -> Any:
    first = values[0]
    first_kind = _kind(first)
    kinds = [_kind(v) for v in values]

    if first_kind in (_NONE, _LEAF, _BROADCAST):
        # Plain values: None stays None if every replica returned None; any
        # mix of non-container, non-tensor values gathers into a list.
        for j, (v, k) in enumerate(zip(values, kinds)):
            if k not in (_NONE, _LEAF, _BROADCAST):
                raise _mismatch(path, j, v, k, first, first_kind)
        if all(k == _NONE for k in kinds):
            return None
        return list(values)

    for j, (v, k) in enumerate(zip(values, kinds)):
        if k != first_kind or type(v) is not type(first):
            raise _mismatch(path, j, v, k, first, first_kind)

    if first_kind == _TENSOR:
        try:
            return Gather.apply(destination, dim, *values)
        except _WRAPPABLE as e:
            if type(e) in _WRAPPABLE:
                raise type(e)(f"gather: {path}: {e}") from e
            raise

    if first_kind == _MAPPING:
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
        return _rebuild(first, first_kind, gathered)

    child_lists = [_children(v, first_kind, path) for v in values]
    first_paths = [p for p, _ in child_lists[0]]
    for j, children in enumerate(child_lists[1:], 1):
        if [p for p, _ in children] != first_paths:
            raise _mismatch(path, j, values[j], first_kind, first, first_kind)
    gathered = [
        _gather_tree([children[i][1] for children in child_lists], sub, destination, dim)
        for i, sub in enumerate(first_paths)
    ]
    return _rebuild(first, first_kind, gathered)


def gather(outputs: Sequence[Any], destination: DeviceLike | None, dim: int = 0) -> Any:
    """Merges the per-replica ``outputs`` (one each, of one structure) into one.

    Guarantees:

    * Tensors at the same path are concatenated along ``dim`` onto
      ``destination`` with the differentiable
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
    return _gather_tree(values, "output", destination, dim)

