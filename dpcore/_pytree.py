"""Pytrees as dpcore walks them (private), on ``torch.utils._pytree``.

Every walk of nested inputs and outputs (scatter, gather, the CUDA-graph
signature, ``map_tensors``) is :func:`flatten`: the tree's tensors in a
fixed order and a hashable :class:`Spec` that rebuilds the tree around any
tensors of that count (per replica too: :meth:`Spec.unflatten_replicas`).
Which objects are containers, and how each comes apart and is rebuilt, is
:mod:`dpcore._nodes` (torch's pytree registry, and DataParallel's own rules).

Paths such as ``inputs[1]['mask']`` name values in error messages; they are
computed only when a message needs one (:func:`path_at`, :class:`LazyPath`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpcore._nodes import BROADCAST, ITERABLE, LEAF, MAPPING, NODE, PACKED, SAMPLES, TENSOR  # noqa: F401 - the kinds
from dpcore._nodes import NODES, Node, RebuildError, check_registry, node_of


def _context_hash(context: Any) -> int:
    """A hash of a node's context: lists as tuples; an unhashable context of
    a registered type counts as None (it is still compared), as torch hashes."""
    try:
        return hash(context)
    except TypeError:
        if isinstance(context, list):
            return hash(tuple(_context_hash(c) for c in context))
        return hash(None)


class Spec:
    """The structure of a flattened pytree: what rebuilds it around its tensors.

    Guarantees: ``flatten(tree)`` gives ``(tensors, spec)`` with
    ``spec.unflatten(tensors)`` equal to ``tree`` (containers rebuilt with
    their own type and form, other leaves the same objects); two specs are
    equal when their trees have the same containers (types, keys, field
    names, registered contexts), tensors at the same places and equal
    non-tensor leaves of the same types. A spec is hashable (the key of a
    CUDA graph) unless a non-tensor leaf is unhashable (TypeError). A spec
    keeps the tree's non-tensor leaves, never its tensors.
    """

    __slots__ = ("kind", "type", "context", "children", "num_tensors", "node", "_hash")

    def __init__(
        self, kind: str, cls: Any, context: Any, kids: tuple[Spec, ...], num_tensors: int, node: Node | None = None
    ) -> None:
        self.kind = kind
        self.type = cls
        self.context = context  # a leaf's value
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
        """This container holding `values` (RebuildError with ``node`` set)."""
        try:
            return self.node.unflatten(values, self.context)
        except RebuildError as e:
            if e.node is None:
                e.node = self
            raise

    def unflatten(self, tensors: Sequence[torch.Tensor], *, unwrap_broadcast: bool = False) -> Any:
        """The tree with ``tensors`` (in flatten order) in place of its
        tensors; with ``unwrap_broadcast`` every marker replaced by its value.
        RebuildError (its ``node`` set) for an iterable that cannot be rebuilt."""
        if len(tensors) != self.num_tensors:
            raise ValueError(f"expected {self.num_tensors} tensors to unflatten, but got {len(tensors)}")
        return _build(self, iter(tensors), unwrap_broadcast)

    def unflatten_replicas(
        self,
        columns: Sequence[Sequence[torch.Tensor]],
        count: int,
        *,
        unwrap_broadcast: bool = True,
        sizes: Sequence[int] | None = None,
    ) -> list[Any]:
        """``count`` trees in one walk, tree ``j`` holding ``columns[i][j]`` in
        place of tensor ``i`` (what scatter hands the replicas: containers
        rebuilt per tree, other leaves shared, by default markers replaced by
        their values); a :class:`Samples` node gives tree ``j`` the next
        ``sizes[j]`` samples, built from entry ``j`` of their columns."""
        if len(columns) != self.num_tensors:
            raise ValueError(f"expected {self.num_tensors} columns of tensors to unflatten, but got {len(columns)}")
        return _build_replicas(self, iter(columns), count, unwrap_broadcast, sizes)

    def tensor_trail(self, index: int) -> list[int]:
        """The child indices from the root to tensor ``index`` (flatten order)."""
        trail: list[int] = []
        spec = self
        while spec.kind is not TENSOR:
            for i, child in enumerate(spec.children):
                if index < child.num_tensors:
                    trail.append(i)
                    spec = child
                    break
                index -= child.num_tensors
            else:
                raise IndexError(index)
        return trail

    def trail_to(self, node: Spec) -> list[int]:
        """The child indices from the root to the container `node` (by identity)."""
        if self is node:
            return []
        for i, child in enumerate(self.children):
            try:
                return [i, *child.trail_to(node)]
            except LookupError:
                pass
        raise LookupError(node)

    def unhashable_leaf(self) -> tuple[list[int], Any] | None:
        """(trail, value) of the first non-tensor leaf that cannot be hashed, or None."""
        if self.kind is LEAF:
            try:
                hash(self.context)
            except TypeError:
                return [], self.context
            return None
        for i, child in enumerate(self.children):
            found = child.unhashable_leaf()
            if found is not None:
                found[0].insert(0, i)
                return found
        return None


_TENSOR = Spec(TENSOR, None, None, (), 1)
_NONE = Spec(LEAF, type(None), None, (), 0)


def mapping_keys(spec: Spec) -> list[Any]:
    """The keys of a MAPPING node, in its children's order (torch's context
    form: the keys, or ``[default_factory, keys]`` for a defaultdict)."""
    return spec.context[1] if issubclass(spec.type, defaultdict) else spec.context


def node_for(obj: Any) -> Node:
    """How `obj`'s type is taken apart and rebuilt (for specs built without a flatten)."""
    check_registry()
    return node_of(obj)


def is_none(spec: Spec) -> bool:
    """Whether `spec` is the spec of None."""
    return spec.kind is LEAF and spec.type is type(None)


class Marks:
    """What :func:`flatten_marked` found besides the tensors, in flatten order
    (``start``: the index of a node's first tensor): ``broadcast``, the
    ``[start, end)`` of each :class:`Broadcast`'s tensors; ``samples``,
    ``(node, start)`` of each :class:`Samples` outside markers; ``packed``,
    ``(node, start, inside)`` of each PackedSequence (``inside``: the marker
    around it, or None); ``misplaced``, ``(node, outer kind)`` of each marker
    inside another; ``lists``, ``(node, start)`` of each ``list`` outside
    markers with two tensor entries or more."""

    __slots__ = ("broadcast", "samples", "packed", "misplaced", "lists", "any_marker")

    def __init__(self) -> None:
        self.any_marker = False  # whether any Broadcast or Samples was met
        self.broadcast: list[tuple[int, int]] = []
        self.samples: list[tuple[Spec, int]] = []
        self.packed: list[tuple[Spec, int, str | None]] = []
        self.misplaced: list[tuple[Spec, str]] = []
        self.lists: list[tuple[Spec, int]] = []


def _flatten(obj: Any, tensors: list[torch.Tensor], marks: Marks, inside: str | None = None) -> Spec:
    # (the caller has checked the registry); `inside`: the marker around obj, if any
    t = type(obj)
    node = NODES.get(t) or node_of(obj)
    kind = node.kind
    if kind is TENSOR:
        tensors.append(obj)
        return _TENSOR
    if kind is LEAF:
        return _NONE if obj is None else Spec(LEAF, t, obj, (), 0)
    start = len(tensors)
    if kind is BROADCAST:
        marks.any_marker = True
        inner = _flatten(obj.value, tensors, marks, BROADCAST if inside is None else inside)
        if len(tensors) == start:  # nothing to copy: every replica gets the value itself
            inner = Spec(LEAF, type(obj.value), obj.value, (), 0)
        else:
            marks.broadcast.append((start, len(tensors)))
        spec = Spec(BROADCAST, t, None, (inner,), len(tensors) - start, node)
        if inside is SAMPLES:  # (a Broadcast inside a Broadcast is whole anyway)
            marks.misplaced.append((spec, inside))
        return spec
    if kind is ITERABLE and inside is BROADCAST:  # passed whole, by reference, as an unknown object always was
        return Spec(LEAF, t, obj, (), 0)
    if t is tuple or t is list:  # torch's flatten of the builtins, inlined (the common case)
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
    elif inside is None and issubclass(t, list) and specs.count(_TENSOR) > 1:
        marks.lists.append((spec, start))
    return spec


def flatten(tree: Any) -> tuple[list[torch.Tensor], Spec]:
    """``(tensors, spec)`` of `tree`: every tensor in it, depth first in child
    order (marker contents included), and the :class:`Spec` that rebuilds
    it. One walk of the tree."""
    check_registry()
    tensors: list[torch.Tensor] = []
    return tensors, _flatten(tree, tensors, Marks())


def flatten_marked(tree: Any) -> tuple[list[torch.Tensor], Spec, Marks]:
    """As :func:`flatten`, also returning the :class:`Marks`: where the
    tensors inside a :class:`Broadcast` are, the :class:`Samples` lists,
    PackedSequences and lists of tensors, and markers misplaced inside
    another."""
    check_registry()
    tensors: list[torch.Tensor] = []
    marks = Marks()
    spec = _flatten(tree, tensors, marks)
    return tensors, spec, marks


def without_markers(tree: Any) -> Any:
    """`tree` with every :class:`Broadcast` and :class:`Samples` replaced by
    its value (what a module run as is gets); `tree` itself where it holds
    neither."""
    tensors, spec, marks = flatten_marked(tree)
    if not marks.any_marker:
        return tree
    return spec.unflatten(tensors, unwrap_broadcast=True)


def _build(spec: Spec, tensors: Any, unwrap: bool) -> Any:
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


def _build_replicas(
    spec: Spec, columns: Any, count: int, unwrap: bool, sizes: Sequence[int] | None = None
) -> list[Any]:
    kind = spec.kind
    if kind is TENSOR:
        return list(next(columns))
    if kind is LEAF:
        return [spec.context] * count
    if kind is SAMPLES:  # replica j: the next sizes[j] samples, built from entry j of their columns
        if sizes is None or sum(sizes) != len(spec.children):
            raise ValueError(f"cannot split {len(spec.children)} samples between replicas of sizes {sizes}")
        samples, out = iter(spec.children), []
        for j, size in enumerate(sizes):
            values = []
            for child in (next(samples) for _ in range(size)):
                values.append(_build(child, iter([next(columns)[j] for _ in range(child.num_tensors)]), unwrap))
            out.append(spec.context(values) if unwrap else spec.rebuild(values))
        return out
    kids = [_build_replicas(child, columns, count, unwrap, sizes) for child in spec.children]
    if kind is BROADCAST:
        return kids[0] if unwrap else [spec.rebuild(list(v)) for v in zip(*kids)]
    if not kids:
        return [spec.rebuild([]) for _ in range(count)]
    rows = zip(*kids)
    if spec.type is tuple:
        return list(rows)
    if spec.type is list:
        return [list(row) for row in rows]
    if spec.type is dict:
        keys = spec.context
        return [dict(zip(keys, row)) for row in rows]
    return [spec.rebuild(list(row)) for row in rows]


def path_at(tree: Any, trail: Sequence[int], root: str) -> str:
    """The path (``root`` followed by keys) of the node of `tree` reached by
    the child indices `trail` (as Spec.tensor_trail gives them)."""
    check_registry()
    path = root
    node = tree
    for index in trail:
        kind = node_of(node)
        kids, context = kind.flatten(node)
        path += kind.keys(node, context, len(kids))[index]
        node = kids[index]
    return path


def tensor_path(tree: Any, spec: Spec, index: int, root: str) -> str:
    """The path of tensor ``index`` (flatten order) of `tree`, whose spec is `spec`."""
    return path_at(tree, spec.tensor_trail(index), root)


class LazyPath:
    """The path of tensor number `at` (or of the node `at`, a Spec) of the
    flattened `tree`, computed only when a message formats it."""

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
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, containers
    rebuilt with their own type (as gather does); other leaves are kept."""
    tensors, spec = flatten(obj)
    if spec.kind is LEAF:
        return obj
    return spec.unflatten([fn(t) for t in tensors])
