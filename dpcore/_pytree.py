"""Pytrees as dpcore's scatter and gather walk them (private).

A pytree is walked through tuples, lists, dicts (any Mapping subclass),
namedtuples (collections and typing), dataclass instances and
:class:`Broadcast` wrappers; every container can be rebuilt with its own type
and form, every other value is a leaf (``torch.Size`` too). Paths such as
``inputs[1]['mask']``, ``kwargs['x'].field`` or ``output['logits'][0]`` name
values in error messages.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
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
      broadcast as above and every other leaf passed by reference.

    Tensors inside a Broadcast take no part in the batch-size check.
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value: T = value

    def __repr__(self) -> str:
        return f"Broadcast({self.value!r})"


# The kinds of pytree nodes.
TENSOR = "tensor"
BROADCAST = "broadcast"
DATACLASS = "dataclass"
NAMEDTUPLE = "namedtuple"
SEQUENCE = "sequence"
MAPPING = "mapping"
NONE = "none"
LEAF = "leaf"

#: The kinds with children (see children and rebuild).
CONTAINERS = (DATACLASS, NAMEDTUPLE, SEQUENCE, MAPPING)


def is_namedtuple(obj: Any) -> bool:
    """Whether `obj` is a namedtuple instance (collections or typing)."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields") and hasattr(obj, "_asdict")


def kind(obj: Any) -> str:
    """The kind of pytree node `obj` is (one of the constants above)."""
    if isinstance(obj, torch.Tensor):
        return TENSOR
    if isinstance(obj, Broadcast):
        return BROADCAST
    if obj is None:
        return NONE
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return DATACLASS
    if is_namedtuple(obj):
        return NAMEDTUPLE
    if isinstance(obj, torch.Size):
        return LEAF
    if isinstance(obj, (tuple, list)):
        return SEQUENCE
    if isinstance(obj, Mapping):
        return MAPPING
    return LEAF


def _dataclass_fields(obj: Any) -> list[dataclasses.Field]:
    # An init=False field without a default may never have been set.
    return [f for f in dataclasses.fields(obj) if hasattr(obj, f.name)]


def children(obj: Any, node_kind: str, path: str) -> list[tuple[str, Any]]:
    """(path, child) pairs of a container of kind `node_kind` at `path`, in
    a fixed order (the order rebuild takes its values in)."""
    if node_kind == DATACLASS:
        return [(f"{path}.{f.name}", getattr(obj, f.name)) for f in _dataclass_fields(obj)]
    if node_kind == NAMEDTUPLE:
        return [(f"{path}.{name}", v) for name, v in zip(obj._fields, obj)]
    if node_kind == SEQUENCE:
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if node_kind == MAPPING:
        return [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    raise AssertionError(node_kind)


def _has_initvars(cls: type) -> bool:
    initvar = getattr(dataclasses, "_FIELD_INITVAR", None)
    return any(getattr(f, "_field_type", None) is initvar for f in getattr(cls, "__dataclass_fields__", {}).values())


def rebuild(obj: Any, node_kind: str, values: list[Any]) -> Any:
    """A container of ``obj``'s type (and form: a defaultdict keeps its
    default_factory, a dataclass its init=False fields) holding ``values``,
    in the order of ``children(obj)``."""
    if node_kind == DATACLASS:
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
    if node_kind == NAMEDTUPLE:
        return type(obj)(*values)
    if node_kind == SEQUENCE:
        if type(obj) is tuple:
            return tuple(values)
        if type(obj) is list:
            return values
        return type(obj)(values)
    if node_kind == MAPPING:
        items = dict(zip(obj.keys(), values))
        if type(obj) is dict:
            return items
        if isinstance(obj, defaultdict):
            new = type(obj)(obj.default_factory)
            new.update(items)
            return new
        return type(obj)(items)
    raise AssertionError(node_kind)


def contains_tensor(obj: Any) -> bool:
    """Whether a tensor sits anywhere in `obj` (inside Broadcast too)."""
    node_kind = kind(obj)
    if node_kind == TENSOR:
        return True
    if node_kind == BROADCAST:
        return contains_tensor(obj.value)
    if node_kind in CONTAINERS:
        return any(contains_tensor(child) for _, child in children(obj, node_kind, ""))
    return False


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, containers
    rebuilt with their own type (as gather does); other leaves are kept."""
    node_kind = kind(obj)
    if node_kind == TENSOR:
        return fn(obj)
    if node_kind in CONTAINERS:
        return rebuild(obj, node_kind, [map_tensors(fn, child) for _, child in children(obj, node_kind, "")])
    return obj


def describe(obj: Any, node_kind: str) -> str:
    """`obj` in a few words for an error message ("a list of length 2")."""
    name = type(obj).__name__
    if node_kind == SEQUENCE or node_kind == NAMEDTUPLE:
        return f"a {name} of length {len(obj)}"
    if node_kind == MAPPING:
        return f"a {name} with keys {list(obj.keys())}"
    if node_kind == NONE:
        return "None"
    if node_kind == TENSOR:
        return f"a tensor of shape {list(obj.shape)}"
    return f"a {name}"
