"""The one walk of nested inputs and outputs (private), on torch's pytree registry plus
DataParallel's own rules (docs/design.md, "Scatter/gather walk pytrees"): :func:`flatten` gives
a tree's tensors and a hashable :class:`Spec` that rebuilds it; paths such as
``inputs[1]['mask']`` name values in error messages."""

from __future__ import annotations

import copy
import dataclasses
import enum
import types
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as torch_pytree
import torch.utils.data as torch_data
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpcore._integrations import BY_ATTRIBUTES as INTEGRATIONS
from dpcore._markers import Broadcast, Samples

# The kinds of nodes; MAPPING, NODE, ITERABLE (torch DP's rebuild rule) and OBJECT (by attributes) are containers.
TENSOR, LEAF, BROADCAST, SAMPLES, PACKED = "tensor", "leaf", "broadcast", "samples", "packed"
MAPPING, NODE, ITERABLE, OBJECT = "mapping", "node", "iterable", "object"
# Kinds whose non-batched contents are one state of the whole batch (docs/design.md, "Scatter/gather walk pytrees").
STATE = (ITERABLE, OBJECT)

_NEVER_ITERATED = (str, bytes, bytearray, memoryview, range, AbstractSet, MappingView, nn.Module, enum.EnumMeta)
_NEVER_ITERATED += (torch_data.Dataset, torch_data.DataLoader, torch_data.Sampler)
_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__cuda_array_interface__")
_DICTS = (dict, OrderedDict, defaultdict)  # torch's mappings, context: the keys ([factory, keys] for defaultdict)


class RebuildError(TypeError):
    """An iterable that cannot be rebuilt from its elements; ``node``: its Spec, set on the way up."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.node: Any = None


class Node(NamedTuple):
    """How one type comes apart and is rebuilt: ``flatten(obj) -> (children, context)``,
    ``unflatten(values, context) -> obj``, ``keys(obj, context, count)`` the children's path suffixes."""

    kind: str
    flatten: Any = None
    unflatten: Any = None
    keys: Any = None


def _indices(obj: Any, context: Any, count: int) -> list[str]:
    return [f"[{i}]" for i in range(count)]


def _registered_keys(node_type: Any) -> Callable[[Any, Any, int], list[str]]:
    def keys(obj: Any, context: Any, count: int) -> list[str]:
        try:  # flatten_with_keys_fn may be None, or fail: only a name for a message
            return [str(key) for key, _ in torch_pytree.SUPPORTED_NODES[node_type].flatten_with_keys_fn(obj)[0]]
        except Exception:  # noqa: BLE001
            return _indices(obj, context, count)

    return keys


def mapping_keys(cls: type, context: Any) -> list[Any]:
    """The keys in a mapping node's `context` (``[default_factory, keys]`` for a defaultdict)."""
    return context[1] if issubclass(cls, defaultdict) else context


@dataclasses.dataclass(frozen=True)
class _Fields:
    """A dataclass's context: its set fields, and a field-less copy where InitVars bar the constructor."""

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
        template = context.template
        new = cls(**{n: v for n, v in pairs if n in init}) if template is None else copy.copy(template)
        for name, value in pairs:
            if template is not None or name not in init:
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


def _object_node(cls: type) -> Node:
    """An object as its attributes: rebuilt as ``cls.__new__(cls)`` with them (no constructor runs)."""

    def flatten(obj: Any) -> tuple[list[Any], tuple[str, ...]]:
        attributes = vars(obj)
        return list(attributes.values()), tuple(attributes)

    def unflatten(values: Iterable[Any], names: tuple[str, ...]) -> Any:
        new = cls.__new__(cls)
        new.__dict__.update(zip(names, values))
        return new

    return Node(OBJECT, flatten, unflatten, lambda obj, names, count: [f".{name}" for name in names])


def _integrated(cls: type) -> bool:
    """Whether `cls` is one of the libraries' types walked by their attributes (INTEGRATIONS)."""
    return any((c.__module__, None) in INTEGRATIONS or (c.__module__, c.__name__) in INTEGRATIONS for c in cls.__mro__)


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
    if _integrated(t) and hasattr(obj, "__dict__"):
        return _object_node(t)
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


def _context_hash(context: Any) -> int:
    """As torch hashes a context: lists as tuples, an unhashable one as None (still compared)."""
    try:
        return hash(context)
    except TypeError:
        if isinstance(context, list):
            return hash(tuple(_context_hash(c) for c in context))
        return hash(None)


class Spec:
    """The structure of a flattened pytree, which ``unflatten(tensors)`` rebuilds: equal for the same
    containers, tensors at the same places and equal non-tensor leaves (which it keeps, never the
    tensors); hashable unless such a leaf is not."""

    __slots__ = ("kind", "type", "context", "children", "num_tensors", "node", "_hash")

    def __init__(
        self, kind: str, cls: Any, context: Any, kids: tuple[Spec, ...], num_tensors: int, node: Node | None = None
    ) -> None:
        self.kind, self.type, self.context, self.children, self.num_tensors = kind, cls, context, kids, num_tensors
        self.node = node  # how to rebuild it (neither compared nor hashed)
        self._hash: int | None = None

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Spec):
            return NotImplemented
        return (
            self.kind is other.kind
            and self.type is other.type
            and self.num_tensors == other.num_tensors
            and (self.context,) == (other.context,)
            and self.children == other.children
        )

    def __hash__(self) -> int:
        if self._hash is None:
            context = hash(self.context) if self.kind is LEAF else _context_hash(self.context)
            self._hash = hash((self.kind, self.type, context, self.children))
        return self._hash

    def rebuild(self, values: list[Any]) -> Any:
        """This container holding `values` (a RebuildError gets ``node`` set)."""
        try:
            return self.node.unflatten(values, self.context)
        except RebuildError as e:
            if e.node is None:
                e.node = self
            raise

    def unflatten(self, tensors: Sequence[torch.Tensor], *, unwrap_broadcast: bool = False) -> Any:
        """The tree holding `tensors` (flatten order); with ``unwrap_broadcast``, markers unwrapped."""
        if len(tensors) != self.num_tensors:
            raise ValueError(f"expected {self.num_tensors} tensors to unflatten, but got {len(tensors)}")
        return _build(self, iter(tensors), unwrap_broadcast)

    def unflatten_replicas(self, columns: Sequence[Sequence[torch.Tensor]], count: int, sizes: Sequence[int]) -> list:
        """`count` trees, tree ``j`` holding ``columns[i][j]`` as tensor ``i`` (markers unwrapped, other
        leaves shared); a Samples node gives tree ``j`` its next ``sizes[j]`` samples."""
        if len(columns) != self.num_tensors:
            raise ValueError(f"expected {self.num_tensors} columns of tensors to unflatten, but got {len(columns)}")
        return _build_replicas(self, iter(columns), count, sizes)

    def walk(self, trail: tuple[int, ...] = (), start: int = 0) -> Iterator[tuple[tuple[int, ...], Spec, int]]:
        """(child indices from the root, node, index of its first tensor) of every node, depth first."""
        yield trail, self, start
        for i, child in enumerate(self.children):
            yield from child.walk((*trail, i), start)
            start += child.num_tensors

    def trail_to(self, at: int | Spec) -> tuple[int, ...]:
        """The child indices from the root to tensor number `at` or to the node `at` (by identity)."""
        for trail, s, start in self.walk():
            if s is at if isinstance(at, Spec) else (s.kind is TENSOR and start == at):
                return trail
        raise LookupError(at)

    def unhashable_leaf(self) -> tuple[tuple[int, ...], Any] | None:
        """(trail, value) of the first non-tensor leaf that cannot be hashed, or None."""
        for trail, s, _ in self.walk():
            if s.kind is LEAF:
                try:
                    hash(s.context)
                except TypeError:
                    return trail, s.context
        return None


TENSOR_SPEC = Spec(TENSOR, None, None, (), 1)
NONE_SPEC = Spec(LEAF, type(None), None, (), 0)


class Marks:
    """What :func:`flatten_marked` found besides the tensors (``start``: a node's first tensor index),
    outside markers unless said: ``broadcast``, ``(start, end)`` of each Broadcast; ``samples``,
    ``(node, start)`` of each Samples; ``packed``, ``(node, start, marker around it)``; ``misplaced``,
    ``(node, outer kind)`` of each marker in another; ``lists`` with two tensors or more."""

    __slots__ = ("broadcast", "samples", "packed", "misplaced", "lists", "any_marker")

    def __init__(self) -> None:
        self.any_marker = False
        self.broadcast: list[tuple[int, int]] = []
        self.samples: list[tuple[Spec, int]] = []
        self.packed: list[tuple[Spec, int, str | None]] = []
        self.misplaced: list[tuple[Spec, str]] = []
        self.lists: list[tuple[Spec, int]] = []


def _flatten(obj: Any, tensors: list[torch.Tensor], marks: Marks, inside: str | None = None) -> Spec:
    # `inside`: the marker around obj, if any
    t = type(obj)
    node = NODES.get(t) or node_of(obj)
    kind = node.kind
    if kind is TENSOR:
        tensors.append(obj)
        return TENSOR_SPEC
    if kind is LEAF:
        return NONE_SPEC if obj is None else Spec(LEAF, t, obj, (), 0)
    start = len(tensors)
    if kind is BROADCAST:
        marks.any_marker = True
        inner = _flatten(obj.value, tensors, marks, inside or BROADCAST)
        if len(tensors) == start:  # nothing to copy: every replica gets the value itself
            inner = Spec(LEAF, type(obj.value), obj.value, (), 0)
        else:
            marks.broadcast.append((start, len(tensors)))
        spec = Spec(BROADCAST, t, None, (inner,), len(tensors) - start, node)
        if inside is SAMPLES:
            marks.misplaced.append((spec, inside))
        return spec
    if kind is ITERABLE and inside is BROADCAST:  # passed whole, by reference
        return Spec(LEAF, t, obj, (), 0)
    if t is tuple or t is list:  # torch's flatten of the builtins, inlined
        kids, context = obj, None
    elif t is dict:
        kids, context = obj.values(), list(obj)
    else:
        try:
            kids, context = node.flatten(obj)
        except Exception:  # noqa: BLE001 - an iterable that cannot be iterated is a leaf
            if kind is not ITERABLE:
                raise
            return Spec(LEAF, t, obj, (), 0)
    within = SAMPLES if kind is SAMPLES and inside is None else inside
    specs = tuple([_flatten(child, tensors, marks, within) for child in kids])
    if kind in STATE and len(tensors) == start:
        return Spec(LEAF, t, obj, (), 0)
    spec = Spec(kind, t, context, specs, len(tensors) - start, node)
    if kind is SAMPLES:
        marks.any_marker = True
        if inside is None:
            marks.samples.append((spec, start))
        else:
            marks.misplaced.append((spec, inside))
    elif kind is PACKED:
        marks.packed.append((spec, start, inside))
    elif inside is None and issubclass(t, list) and specs.count(TENSOR_SPEC) > 1:
        marks.lists.append((spec, start))
    return spec


def flatten_marked(tree: Any) -> tuple[list[torch.Tensor], Spec, Marks]:
    """Every tensor of `tree` (depth first, marker contents included), its Spec and Marks, in one walk."""
    check_registry()
    tensors: list[torch.Tensor] = []
    marks = Marks()
    spec = _flatten(tree, tensors, marks)
    return tensors, spec, marks


def flatten(tree: Any) -> tuple[list[torch.Tensor], Spec]:
    """``(tensors, spec)`` of `tree`, as :func:`flatten_marked` gives them."""
    return flatten_marked(tree)[:2]


def without_markers(tree: Any) -> Any:
    """`tree` with every Broadcast and Samples replaced by its value (`tree` itself without any)."""
    tensors, spec, marks = flatten_marked(tree)
    return spec.unflatten(tensors, unwrap_broadcast=True) if marks.any_marker else tree


def _build(spec: Spec, tensors: Iterator[torch.Tensor], unwrap: bool) -> Any:
    kind = spec.kind
    if kind is TENSOR:
        return next(tensors)
    if kind is LEAF:
        return spec.context
    values = [_build(child, tensors, unwrap) for child in spec.children]
    if unwrap and kind is BROADCAST:
        return values[0]
    if unwrap and kind is SAMPLES:
        return spec.context(values)
    return spec.rebuild(values)


def _build_replicas(spec: Spec, columns: Iterator[Sequence[Any]], count: int, sizes: Sequence[int]) -> list[Any]:
    kind = spec.kind
    if kind is TENSOR:
        return list(next(columns))
    if kind is LEAF:
        return [spec.context] * count
    if kind is SAMPLES:  # replica j: the next sizes[j] samples, built from entry j of their columns
        if sum(sizes) != len(spec.children):
            raise ValueError(f"cannot split {len(spec.children)} samples between replicas of sizes {sizes}")
        samples, out = iter(spec.children), []
        for j, size in enumerate(sizes):
            values = []
            for child in (next(samples) for _ in range(size)):
                values.append(_build(child, iter([next(columns)[j] for _ in range(child.num_tensors)]), True))
            out.append(spec.context(values))
        return out
    kids = [_build_replicas(child, columns, count, sizes) for child in spec.children]
    if kind is BROADCAST:
        return kids[0]
    rows = zip(*kids) if kids else [()] * count
    if spec.type is tuple:
        return list(rows)
    if spec.type is list:
        return [list(row) for row in rows]
    if spec.type is dict:
        return [dict(zip(spec.context, row)) for row in rows]
    return [spec.rebuild(list(row)) for row in rows]


def path_at(tree: Any, trail: Sequence[int], root: str) -> str:
    """The path (`root` followed by keys) of the node of `tree` reached by the child indices `trail`."""
    check_registry()
    path = root
    for index in trail:
        node = node_of(tree)
        kids, context = node.flatten(tree)
        path += node.keys(tree, context, len(kids))[index]
        tree = kids[index]
    return path


def tensor_path(tree: Any, spec: Spec, index: int, root: str) -> str:
    """The path of tensor `index` (flatten order) of `tree`, whose spec is `spec`."""
    return path_at(tree, spec.trail_to(index), root)


class Lazy:
    """Text that `make()` gives only when a message formats it."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], str]) -> None:
        self.make = make

    def __str__(self) -> str:
        return self.make()


def lazy_path(tree: Any, spec: Spec, at: int | Spec, root: str) -> Lazy:
    """The path of tensor number `at` (or of the node `at`) of `tree`, made when formatted."""

    def make() -> str:
        try:
            return path_at(tree, spec.trail_to(at), root)
        except (LookupError, TypeError, AttributeError):  # `tree` is not the tree of `spec` there
            return root

    return Lazy(make)


_WITHOUT_TENSORS = (str, bytes, bytearray, int, float, complex, type(None), torch.Size, torch.device, torch.dtype)
_WITHOUT_TENSORS += (range, enum.Enum, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def holds_tensors(obj: Any, budget: int = 10_000) -> bool:
    """Whether a tensor is reachable from `obj` through the items of builtin containers and the attributes
    (``__dict__``, ``__slots__``) of objects, looking at `budget` objects at most; nothing is iterated but
    builtin containers, and no property or ``__getattr__`` runs."""
    seen: set[int] = set()
    todo = [obj]
    while todo and len(seen) < budget:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            return True
        if isinstance(o, _WITHOUT_TENSORS) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (list, tuple, set, frozenset, deque)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        names = [n for c in type(o).__mro__ for n in _slots(c)]
        for name in ("__dict__", *names):
            try:  # neither a property nor __getattr__ runs
                value = object.__getattribute__(o, name)
            except AttributeError:
                continue
            todo.extend(value.values() if name == "__dict__" and isinstance(value, dict) else (value,))
    return False


def _slots(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """`obj` with every tensor ``t`` replaced by ``fn(t)``, containers rebuilt with their own type."""
    tensors, spec = flatten(obj)
    return obj if spec.kind is LEAF else spec.unflatten([fn(t) for t in tensors])
