"""Pytrees as dpcore walks them (private): the one walk of nested inputs and outputs.

:func:`flatten` gives a tree's tensors in a fixed order and a hashable :class:`Spec` that
rebuilds the tree around any tensors of that count (per replica too); which objects are
containers is :mod:`dpcore._nodes`. Paths such as ``inputs[1]['mask']`` name values in error
messages and are computed only when a message needs one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dpcore._nodes import BROADCAST, ITERABLE, LEAF, MAPPING, NODE, PACKED, SAMPLES, TENSOR  # noqa: F401 - the kinds
from dpcore._nodes import NODES, Node, RebuildError, check_registry, mapping_keys, node_of  # noqa: F401


def _context_hash(context: Any) -> int:
    """As torch hashes a context: lists as tuples, an unhashable one as None (still compared)."""
    try:
        return hash(context)
    except TypeError:
        if isinstance(context, list):
            return hash(tuple(_context_hash(c) for c in context))
        return hash(None)


class Spec:
    """The structure of a flattened pytree: ``spec.unflatten(tensors)`` rebuilds the tree.

    Two specs are equal when their trees have the same containers (types, keys, contexts),
    tensors at the same places and equal non-tensor leaves; a spec is hashable unless such a
    leaf is not (TypeError). It keeps the tree's non-tensor leaves (``context`` of a LEAF),
    never its tensors.
    """

    __slots__ = ("kind", "type", "context", "children", "num_tensors", "node", "_hash")

    def __init__(
        self, kind: str, cls: Any, context: Any, kids: tuple[Spec, ...], num_tensors: int, node: Node | None = None
    ) -> None:
        self.kind = kind
        self.type = cls
        self.context = context
        self.children = kids
        self.num_tensors = num_tensors
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

    def __repr__(self) -> str:
        if self.kind is TENSOR:
            return "*"
        if self.kind is LEAF:
            return repr(self.context)
        return f"{getattr(self.type, '__name__', self.type)}({', '.join(map(repr, self.children))})"

    def rebuild(self, values: list[Any]) -> Any:
        """This container holding `values` (a RebuildError gets ``node`` set)."""
        try:
            return self.node.unflatten(values, self.context)
        except RebuildError as e:
            if e.node is None:
                e.node = self
            raise

    def unflatten(self, tensors: Sequence[torch.Tensor], *, unwrap_broadcast: bool = False) -> Any:
        """The tree with `tensors` (in flatten order) in its tensors' places; with
        ``unwrap_broadcast`` every marker replaced by its value."""
        if len(tensors) != self.num_tensors:
            raise ValueError(f"expected {self.num_tensors} tensors to unflatten, but got {len(tensors)}")
        return _build(self, iter(tensors), unwrap_broadcast)

    def unflatten_replicas(self, columns: Sequence[Sequence[torch.Tensor]], count: int, sizes: Sequence[int]) -> list:
        """`count` trees, tree ``j`` holding ``columns[i][j]`` as tensor ``i``, markers replaced by
        their values and other leaves shared; a Samples node gives tree ``j`` its next ``sizes[j]``
        samples, built from entry ``j`` of their columns."""
        if len(columns) != self.num_tensors:
            raise ValueError(f"expected {self.num_tensors} columns of tensors to unflatten, but got {len(columns)}")
        return _build_replicas(self, iter(columns), count, sizes)

    def walk(self, trail: tuple[int, ...] = (), start: int = 0) -> Iterator[tuple[tuple[int, ...], Spec, int]]:
        """(child indices from the root, node, index of its first tensor) of every node, depth first."""
        yield trail, self, start
        for i, child in enumerate(self.children):
            yield from child.walk((*trail, i), start)
            start += child.num_tensors

    def tensor_trail(self, index: int) -> tuple[int, ...]:
        """The child indices from the root to tensor `index` (IndexError if there is none)."""
        trail = next((t for t, s, start in self.walk() if s.kind is TENSOR and start == index), None)
        if trail is None:
            raise IndexError(index)
        return trail

    def trail_to(self, node: Spec) -> tuple[int, ...]:
        """The child indices from the root to `node` (by identity; LookupError if absent)."""
        trail = next((t for t, s, _ in self.walk() if s is node), None)
        if trail is None:
            raise LookupError(node)
        return trail

    def unhashable_leaf(self) -> tuple[tuple[int, ...], Any] | None:
        """(trail, value) of the first non-tensor leaf that cannot be hashed, or None."""
        for trail, s, _ in self.walk():
            if s.kind is LEAF and not _hashable(s.context):
                return trail, s.context
        return None


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


TENSOR_SPEC = Spec(TENSOR, None, None, (), 1)
NONE_SPEC = Spec(LEAF, type(None), None, (), 0)


class Marks:
    """What :func:`flatten_marked` found besides the tensors (``start``: a node's first tensor):
    ``broadcast``, ``[start, end)`` of each Broadcast's tensors; ``samples``, ``(node, start)`` of
    each Samples; ``packed``, ``(node, start, marker around it or None)`` of each PackedSequence;
    ``misplaced``, ``(node, outer kind)`` of each marker in another; ``lists``, ``(node, start)``
    of each ``list`` with two tensor entries or more (all outside markers unless said)."""

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
    if kind is ITERABLE and len(tensors) == start:
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
    """Every tensor of `tree`, depth first in child order (marker contents included), the
    :class:`Spec` that rebuilds it and the :class:`Marks`, in one walk."""
    check_registry()
    tensors: list[torch.Tensor] = []
    marks = Marks()
    spec = _flatten(tree, tensors, marks)
    return tensors, spec, marks


def flatten(tree: Any) -> tuple[list[torch.Tensor], Spec]:
    """``(tensors, spec)`` of `tree`, as :func:`flatten_marked` gives them."""
    tensors, spec, _ = flatten_marked(tree)
    return tensors, spec


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
    if not kids:
        return [spec.rebuild([]) for _ in range(count)]
    rows = zip(*kids)
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
    return path_at(tree, spec.tensor_trail(index), root)


class LazyPath:
    """The path of tensor number `at` (or of the node `at`) of `tree`, computed when formatted."""

    __slots__ = ("tree", "spec", "at", "root")

    def __init__(self, tree: Any, spec: Spec, at: int | Spec, root: str) -> None:
        self.tree, self.spec, self.at, self.root = tree, spec, at, root

    def __str__(self) -> str:
        if isinstance(self.at, int):
            return tensor_path(self.tree, self.spec, self.at, self.root)
        try:
            return path_at(self.tree, self.spec.trail_to(self.at), self.root)
        except LookupError:
            return self.root

    def __format__(self, format_spec: str) -> str:
        return format(str(self), format_spec)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """`obj` with every tensor ``t`` replaced by ``fn(t)``, containers rebuilt with their own type."""
    tensors, spec = flatten(obj)
    if spec.kind is LEAF:
        return obj
    return spec.unflatten([fn(t) for t in tensors])
