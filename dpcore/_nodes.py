"""Which objects are pytree nodes for dpcore and how each comes apart and is rebuilt (private).

Torch's pytree registry first (the markers are registered there on first use), then
DataParallel's own rules for what torch leaves whole: the rules and the leaves are in
docs/design.md ("Scatter/gather walk pytrees"). The walk itself is :mod:`dpcore._pytree`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, MappingView
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
import torch.utils.data as torch_data
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpcore._markers import Broadcast, Samples

# The kinds of nodes: MAPPING (keyed, see mapping_keys) and NODE are containers; ITERABLE one by
# torch DP's rebuild rule.
TENSOR, LEAF, BROADCAST, SAMPLES, PACKED = "tensor", "leaf", "broadcast", "samples", "packed"
MAPPING, NODE, ITERABLE = "mapping", "node", "iterable"

_NEVER_ITERATED = (str, bytes, bytearray, memoryview, range, AbstractSet, MappingView, nn.Module, enum.EnumMeta)
_NEVER_ITERATED += (torch_data.Dataset, torch_data.DataLoader, torch_data.Sampler)
_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__cuda_array_interface__")
_DICTS = (dict, OrderedDict, defaultdict)  # torch's mappings, context: the keys ([factory, keys] for defaultdict)


class RebuildError(TypeError):
    """An iterable that cannot be rebuilt from its elements; ``node``: its Spec, set on the way up."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.node: Any = None


class Node:
    """How one type comes apart and is rebuilt: ``flatten(obj) -> (children, context)``,
    ``unflatten(values, context) -> obj``, ``keys(obj, context, count)`` the children's path suffixes."""

    __slots__ = ("kind", "flatten", "unflatten", "keys")

    def __init__(self, kind: str, flatten: Any = None, unflatten: Any = None, keys: Any = None) -> None:
        self.kind, self.flatten, self.unflatten, self.keys = kind, flatten, unflatten, keys


def _indices(obj: Any, context: Any, count: int) -> list[str]:
    return [f"[{i}]" for i in range(count)]


def _registered_keys(node_type: Any) -> Callable[[Any, Any, int], list[str]]:
    def keys(obj: Any, context: Any, count: int) -> list[str]:
        with_keys = torch_pytree.SUPPORTED_NODES[node_type].flatten_with_keys_fn
        if with_keys is not None:
            try:
                return [str(key) for key, _ in with_keys(obj)[0]]
            except Exception:  # noqa: BLE001 - only a name for a message
                pass
        return _indices(obj, context, count)

    return keys


def mapping_keys(cls: type, context: Any) -> list[Any]:
    """The keys in a mapping node's `context` (``[default_factory, keys]`` for a defaultdict)."""
    return context[1] if issubclass(cls, defaultdict) else context


@dataclasses.dataclass(frozen=True)
class _Fields:
    """A dataclass node's context: its set fields, and (not compared) a field-less copy of the
    instance where InitVars make the constructor unusable."""

    names: tuple[str, ...]
    template: Any = dataclasses.field(compare=False)

    def __repr__(self) -> str:
        return repr(self.names)


def _dataclass_node(cls: type) -> Node:
    fields = dataclasses.fields(cls)
    init = frozenset(f.name for f in fields if f.init)
    initvar = getattr(dataclasses, "_FIELD_INITVAR", None)
    initvars = any(getattr(f, "_field_type", None) is initvar for f in cls.__dataclass_fields__.values())

    def flatten(obj: Any) -> tuple[list[Any], _Fields]:
        names = tuple(f.name for f in fields if hasattr(obj, f.name))  # an init=False field may be unset
        template = None
        if initvars:
            template = copy.copy(obj)
            for name in names:
                object.__delattr__(template, name)
        return [getattr(obj, name) for name in names], _Fields(names, template)

    def unflatten(values: Iterable[Any], context: _Fields) -> Any:
        pairs = list(zip(context.names, values))
        if context.template is not None:
            new = copy.copy(context.template)
        else:
            new = cls(**{name: value for name, value in pairs if name in init})
        for name, value in pairs:
            if context.template is not None or name not in init:
                object.__setattr__(new, name, value)
        return new

    return Node(NODE, flatten, unflatten, lambda obj, context, count: [f".{name}" for name in context.names])


def _mapping_node(cls: type) -> Node:
    def flatten(obj: Mapping[Any, Any]) -> tuple[list[Any], list[Any]]:
        items = list(obj.items())
        keys = [k for k, _ in items]
        return [v for _, v in items], [obj.default_factory, keys] if isinstance(obj, defaultdict) else keys

    def unflatten(values: Iterable[Any], context: list[Any]) -> Any:
        if issubclass(cls, defaultdict):
            new = cls(context[0])
            new.update(zip(context[1], values))
            return new
        return cls(dict(zip(context, values)))

    def keys(obj: Any, context: list[Any], count: int) -> list[str]:
        return [f"[{k!r}]" for k in mapping_keys(cls, context)]

    return Node(MAPPING, flatten, unflatten, keys)


def _iterable_node(cls: type) -> Node:
    def unflatten(values: Iterable[Any], context: None) -> Any:
        try:
            return cls(iter(values))
        except Exception as e:  # noqa: BLE001 - any failure of the constructor is reported the same way
            raise RebuildError(
                f"is a {cls.__name__}, an iterable holding tensors, which DataParallel splits and joins as "
                f"torch.nn.DataParallel's gather does: rebuilt from its elements as "
                f"{cls.__name__}(iterator over the elements), but that raised {type(e).__name__}: {e}. Register "
                f"{cls.__name__} with torch.utils._pytree.register_pytree_node to say how it is taken apart "
                f"and rebuilt"
            ) from e

    return Node(ITERABLE, lambda obj: (list(obj), None), unflatten, _indices)


def _make_node(obj: Any) -> Node:
    t = type(obj)
    if issubclass(t, torch.Tensor):
        return Node(TENSOR)
    if obj is None or issubclass(t, torch.Size):
        return Node(LEAF)
    node_type = Broadcast if issubclass(t, Broadcast) else Samples if issubclass(t, Samples) else None
    node_type = node_type or torch_pytree._get_node_type(obj)
    registered = torch_pytree.SUPPORTED_NODES.get(node_type)
    if registered is not None:
        if node_type is Broadcast:
            return Node(BROADCAST, registered.flatten_fn, registered.unflatten_fn, lambda *_: [""])
        if node_type is Samples:
            return Node(SAMPLES, registered.flatten_fn, registered.unflatten_fn, _indices)
        kind = PACKED if issubclass(t, PackedSequence) else MAPPING if node_type in _DICTS else NODE
        return Node(kind, registered.flatten_fn, registered.unflatten_fn, _registered_keys(node_type))
    if dataclasses.is_dataclass(t):
        return _dataclass_node(t)
    if issubclass(t, (list, tuple)):
        return Node(NODE, lambda obj: (list(obj), None), lambda values, _: t(values), _indices)
    if issubclass(t, Mapping):
        return _mapping_node(t)
    if (
        issubclass(t, _NEVER_ITERATED)
        or hasattr(t, "__next__")
        or any(hasattr(t, name) for name in _ARRAY_PROTOCOLS)
        or getattr(t, "__iter__", None) is None
        or getattr(t, "__len__", None) is None  # an unsized iterable may never end
    ):
        return Node(LEAF)
    return _iterable_node(t)


NODES: dict[type, Node] = {}  # the Node of each type met, dropped when torch's registry changes
_registry_size = -1


def check_registry() -> None:
    """Registers the markers with torch's pytree (once); drops the known nodes when the registry changed."""
    global _registry_size
    if len(torch_pytree.SUPPORTED_NODES) != _registry_size:
        for marker, flatten, unflatten in (
            (Broadcast, lambda b: ([b.value], None), lambda values, _: Broadcast(list(values)[0])),
            (Samples, lambda s: (list(s.value), type(s.value)), lambda values, cls: Samples(cls(values))),
        ):
            if marker not in torch_pytree.SUPPORTED_NODES:
                name = f"dpcore.{marker.__name__}"
                torch_pytree.register_pytree_node(marker, flatten, unflatten, serialized_type_name=name)
        NODES.clear()
        _registry_size = len(torch_pytree.SUPPORTED_NODES)


def node_of(obj: Any) -> Node:
    """How `obj`'s type comes apart (after check_registry)."""
    node = NODES.get(type(obj))
    if node is None:
        node = NODES[type(obj)] = _make_node(obj)
    return node
