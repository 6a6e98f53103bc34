"""Pytrees as dpcore walks them (private): one flatten, one spec, one rebuild.

Every walk of nested inputs and outputs (scatter, gather, the CUDA-graph
signature and placeholders, ``map_tensors``) goes through :func:`flatten`,
which returns the tree's tensors in a fixed order and a :class:`Spec` that
rebuilds the tree around any tensors of that count (:meth:`Spec.unflatten`).
A new container type is taught here, once.

The nodes, in the order they are recognized:

* tensors (any ``torch.Tensor`` subclass): the leaves that are split,
  gathered, broadcast or copied;
* :class:`Broadcast` and :class:`Samples` markers; ``None``;
* ``torch.nn.utils.rnn.PackedSequence``: a node of its own (its four
  fields), which scatter splits by sequences and gather joins back
  (:mod:`dpcore._packed`);
* ``torch.Size``: a leaf (torch registers it with its pytree; dpcore never
  splits or gathers shapes);
* types registered with ``torch.utils._pytree`` (``register_pytree_node``,
  ``register_dataclass``; transformers registers its ModelOutput classes
  there), other than the builtin containers below: split and joined through
  their registered flatten and unflatten functions (the registry is looked
  up by exact type, as torch's own pytree does);
* dataclass instances, namedtuples (collections and typing), tuples and
  lists (and their subclasses), Mappings (any ``collections.abc.Mapping``,
  ``defaultdict`` with its ``default_factory``): rebuilt with their own type
  and form;
* other sized iterables (``__iter__`` and ``__len__``) that hold a tensor:
  torch.nn.DataParallel's gather rule,
  ``type(obj)(iterator over the rebuilt elements)`` (``DynamicCache`` and
  ``EncoderDecoderCache`` of transformers keep that constructor form for
  DataParallel). Not iterated: strings, bytes, sets, ranges, dict views,
  iterators and generators, modules, datasets, data loaders, samplers,
  array-likes (``__array__``), enum classes. An iterable without a tensor
  inside is a leaf (so is one whose iteration raises), and so is one inside
  a :class:`Broadcast` (passed whole, by reference, to every replica);
* everything else is a leaf, kept by reference.

Paths such as ``inputs[1]['mask']``, ``kwargs['x'].field`` or
``output['logits'][0]`` name values in error messages; they are computed only
when a message needs one (:func:`path_at`), never on the fast path.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, MappingView, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Generic, TypeVar

import torch
import torch.utils._pytree as torch_pytree
import torch.utils.data as torch_data
from torch import nn
from torch.nn.utils.rnn import PackedSequence

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
      broadcast as above and every other leaf passed by reference; an
      iterable that is a container only by torch DP's rebuild rule (not
      registered with ``torch.utils._pytree``) is passed by reference.

    Tensors inside a Broadcast take no part in the batch-size check.
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value: T = value

    def __repr__(self) -> str:
        return f"Broadcast({self.value!r})"


class Samples(Generic[T]):
    """Marks a list (or tuple) as the batch itself: one entry per sample.

    ``Samples(images)`` as a positional or keyword argument (or anywhere
    inside one) is split between its samples, never inside one: each
    replica gets a ``list`` (a ``tuple`` for a tuple) of consecutive
    samples, in order, each sample's tensors moved whole to the replica's
    device (differentiably; a tensor already there is passed as is) and
    every other value passed by reference. How many samples each replica
    gets is the call's split (balanced, ``chunk_sizes``, ``weights``) over
    the number of samples, which is the batch size: every other batched
    input of the call (another Samples list, a PackedSequence, a tensor
    split along ``dim``) must agree with it. Replicas that would get no
    sample do not run. In the outputs of such a call every ``list`` is taken
    to hold one entry per sample and is joined by concatenation in replica
    order (see :func:`dpcore.scatter_gather.gather_with_hints`).

    For models that take a list of variable-size samples: torchvision's
    detection and segmentation models (a list of images, in training also a
    list of target dicts), or any list of per-sample dicts.
    """

    __slots__ = ("value",)

    def __init__(self, value: Sequence[T]) -> None:
        if not isinstance(value, (list, tuple)) or is_namedtuple(value):
            raise TypeError(
                f"dpcore.Samples: expected a list or tuple with one entry per sample, but got "
                f"{type(value).__name__}"
                + (
                    " (a tensor is split along dim already; Samples is for a list of samples)"
                    if isinstance(value, torch.Tensor)
                    else ""
                )
            )
        self.value: Sequence[T] = value

    def __repr__(self) -> str:
        return f"Samples({self.value!r})"


# The kinds of pytree nodes.
TENSOR = "tensor"
BROADCAST = "broadcast"
SAMPLES = "samples"
PACKED = "packed"
DATACLASS = "dataclass"
NAMEDTUPLE = "namedtuple"
SEQUENCE = "sequence"
MAPPING = "mapping"
REGISTERED = "registered"
ITERABLE = "iterable"
NONE = "none"
LEAF = "leaf"

#: The kinds with children (see children and rebuild).
CONTAINERS = (DATACLASS, NAMEDTUPLE, SEQUENCE, MAPPING, REGISTERED, ITERABLE, PACKED)

#: Containers dpcore rebuilds itself although torch registers them.
_OWN_CONTAINERS = frozenset({tuple, list, dict, OrderedDict, defaultdict})

#: Iterables that are never iterated (leaves).
_NEVER_ITERATED: tuple[type, ...] = (
    str,
    bytes,
    bytearray,
    memoryview,
    range,
    AbstractSet,
    MappingView,
    nn.Module,
    torch_data.Dataset,
    torch_data.DataLoader,
    torch_data.Sampler,
    enum.EnumMeta,
)

_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__cuda_array_interface__")


def is_namedtuple(obj: Any) -> bool:
    """Whether `obj` is a namedtuple instance (collections or typing)."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields") and hasattr(obj, "_asdict")


def _type_kind(t: type) -> str:
    if issubclass(t, torch.Tensor):
        return TENSOR
    if issubclass(t, Broadcast):
        return BROADCAST
    if issubclass(t, Samples):
        return SAMPLES
    if issubclass(t, PackedSequence):
        return PACKED
    if t is type(None):
        return NONE
    if issubclass(t, torch.Size):
        return LEAF
    if t in torch_pytree.SUPPORTED_NODES and t not in _OWN_CONTAINERS:
        return REGISTERED
    if dataclasses.is_dataclass(t):
        return DATACLASS
    if issubclass(t, tuple) and hasattr(t, "_fields") and hasattr(t, "_asdict"):
        return NAMEDTUPLE
    if issubclass(t, (tuple, list)):
        return SEQUENCE
    if issubclass(t, Mapping):
        return MAPPING
    if (
        issubclass(t, _NEVER_ITERATED)
        or hasattr(t, "__next__")
        or any(hasattr(t, name) for name in _ARRAY_PROTOCOLS)
        or getattr(t, "__iter__", None) is None
        or getattr(t, "__len__", None) is None  # an unsized iterable may never end
    ):
        return LEAF
    return ITERABLE


# Kind by exact type; dropped when a type is (de)registered with torch's pytree.
_KINDS: dict[type, str] = {}
_registry_size = -1


def _check_registry() -> None:
    """Drops the kinds known by type when torch's pytree registry changed."""
    global _registry_size
    if len(torch_pytree.SUPPORTED_NODES) != _registry_size:
        _KINDS.clear()
        _registry_size = len(torch_pytree.SUPPORTED_NODES)


def _kind_of(t: type) -> str:
    _check_registry()
    found = _KINDS.get(t)
    if found is None:
        found = _KINDS[t] = _type_kind(t)
    return found


def kind(obj: Any) -> str:
    """The kind of pytree node `obj` is (one of the constants above). An
    ITERABLE without a tensor inside is flattened as a leaf."""
    return _kind_of(type(obj))


# ---------------------------------------------------------------------------
# Nodes: children, context and rebuild (the one place a container is taught)
# ---------------------------------------------------------------------------


class _DataclassInfo:
    __slots__ = ("names", "init", "initvars")

    def __init__(self, cls: type) -> None:
        self.names = tuple(f.name for f in dataclasses.fields(cls))
        self.init = frozenset(f.name for f in dataclasses.fields(cls) if f.init)
        initvar = getattr(dataclasses, "_FIELD_INITVAR", None)
        self.initvars = any(
            getattr(f, "_field_type", None) is initvar for f in getattr(cls, "__dataclass_fields__", {}).values()
        )


_DATACLASSES: dict[type, _DataclassInfo] = {}


def _dataclass_info(cls: type) -> _DataclassInfo:
    info = _DATACLASSES.get(cls)
    if info is None:
        info = _DATACLASSES[cls] = _DataclassInfo(cls)
    return info


def _node(obj: Any, node_kind: str) -> tuple[Any, list[Any], Any]:
    """(context, children, template) of a container of kind `node_kind`:
    the children in the order rebuild takes them, what besides its type
    identifies the node (compared and hashed), and what else a rebuild needs
    (neither compared nor hashed)."""
    if node_kind is SEQUENCE:
        return None, list(obj), None
    if node_kind is MAPPING:
        if isinstance(obj, dict):
            keys, values = tuple(obj), list(obj.values())
        else:
            items = list(obj.items())
            keys, values = tuple(k for k, _ in items), [v for _, v in items]
        factory = obj.default_factory if isinstance(obj, defaultdict) else None
        return (keys, factory), values, None
    if node_kind is NAMEDTUPLE or node_kind is PACKED:
        return None, list(obj), None
    if node_kind is SAMPLES:
        return type(obj.value), list(obj.value), None
    if node_kind is DATACLASS:
        # An init=False field without a default may never have been set.
        info = _dataclass_info(type(obj))
        names = tuple(name for name in info.names if hasattr(obj, name))
        template = None
        if info.initvars:
            # InitVar arguments cannot be recovered: rebuilt from a copy of
            # the instance (without its fields, which the spec must not keep).
            template = copy.copy(obj)
            for name in names:
                object.__delattr__(template, name)
        return names, [getattr(obj, name) for name in names], template
    if node_kind is REGISTERED:
        children, context = torch_pytree.SUPPORTED_NODES[type(obj)].flatten_fn(obj)
        return context, list(children), None
    if node_kind is ITERABLE:
        return None, list(obj), None
    raise AssertionError(node_kind)


class RebuildError(TypeError):
    """An iterable that cannot be rebuilt from its elements (torch DP's rule);
    ``node`` is its Spec once raised by unflatten (see Spec.trail_to)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.node: Spec | None = None


def _sequence(cls: type, values: list[Any]) -> Any:
    """A list or tuple (or a subclass, ``cls``) holding ``values``."""
    if cls is list:
        return values
    if cls is tuple:
        return tuple(values)
    return cls(values)


def _rebuild(node_kind: str, cls: type, context: Any, template: Any, values: list[Any]) -> Any:
    if node_kind is SEQUENCE:
        if cls is tuple:
            return tuple(values)
        if cls is list:
            return values
        return cls(values)
    if node_kind is MAPPING:
        keys, factory = context
        if cls is dict:
            return dict(zip(keys, values))
        if issubclass(cls, defaultdict):
            new = cls(factory)
            new.update(zip(keys, values))
            return new
        return cls(dict(zip(keys, values)))
    if node_kind is NAMEDTUPLE or node_kind is PACKED:
        return cls(*values)
    if node_kind is SAMPLES:
        return Samples(_sequence(context, values))
    if node_kind is DATACLASS:
        if template is not None:
            new = copy.copy(template)
            for name, value in zip(context, values):
                object.__setattr__(new, name, value)
            return new
        init = _dataclass_info(cls).init
        new = cls(**{name: value for name, value in zip(context, values) if name in init})
        for name, value in zip(context, values):
            if name not in init:
                object.__setattr__(new, name, value)
        return new
    if node_kind is REGISTERED:
        return torch_pytree.SUPPORTED_NODES[cls].unflatten_fn(values, context)
    if node_kind is ITERABLE:
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
    raise AssertionError(node_kind)


def children(obj: Any, node_kind: str, path: str) -> list[tuple[str, Any]]:
    """(path, child) pairs of a container of kind `node_kind` at `path`, in
    a fixed order (the order rebuild takes its values in)."""
    context, kids, _ = _node(obj, node_kind)
    return [(path + key, child) for key, child in zip(_keys(obj, node_kind, context, len(kids)), kids)]


def rebuild(obj: Any, node_kind: str, values: list[Any]) -> Any:
    """A container of ``obj``'s type (and form: a defaultdict keeps its
    default_factory, a dataclass its init=False fields) holding ``values``,
    in the order of ``children(obj)``."""
    context, _, template = _node(obj, node_kind)
    return _rebuild(node_kind, type(obj), context, template, values)


def _keys(obj: Any, node_kind: str, context: Any, count: int) -> list[str]:
    """The path suffixes of a node's children ("[0]", "['k']", ".name")."""
    if node_kind is SEQUENCE or node_kind is ITERABLE or node_kind is SAMPLES:
        return [f"[{i}]" for i in range(count)]
    if node_kind is MAPPING:
        return [f"[{k!r}]" for k in context[0]]
    if node_kind is NAMEDTUPLE or node_kind is PACKED:
        return [f".{name}" for name in type(obj)._fields]
    if node_kind is DATACLASS:
        return [f".{name}" for name in context]
    if node_kind is REGISTERED:
        with_keys = torch_pytree.SUPPORTED_NODES[type(obj)].flatten_with_keys_fn
        if with_keys is not None:
            try:
                return [str(key) for key, _ in with_keys(obj)[0]]
            except Exception:  # noqa: BLE001 - only a name for a message
                pass
        return [f"[{i}]" for i in range(count)]
    if node_kind is BROADCAST:
        return [""]
    raise AssertionError(node_kind)


# ---------------------------------------------------------------------------
# Spec, flatten, unflatten
# ---------------------------------------------------------------------------


class Spec:
    """The structure of a flattened pytree: what rebuilds it around its tensors.

    Guarantees: ``flatten(tree)`` gives ``(tensors, spec)`` with
    ``spec.unflatten(tensors)`` equal to ``tree`` (containers rebuilt with
    their own type and form, other leaves the same objects); two specs are
    equal when their trees have the same containers (types, keys, field
    names, registered contexts), tensors at the same places and equal
    non-tensor leaves of the same types. A spec is hashable (the key of a
    CUDA graph) unless a non-tensor leaf is unhashable (TypeError); a
    registered type's context is compared, and hashed where it can be. A spec
    keeps the tree's non-tensor leaves, never its tensors.
    """

    __slots__ = ("kind", "type", "context", "children", "num_tensors", "template", "_hash")

    def __init__(
        self,
        node_kind: str,
        cls: Any,
        context: Any,
        kids: tuple[Spec, ...],
        num_tensors: int,
        template: Any = None,
    ) -> None:
        self.kind = node_kind
        self.type = cls
        self.context = context  # the value itself for a leaf
        self.children = kids
        self.num_tensors = num_tensors
        self.template = template  # rebuild-only information (neither compared nor hashed)
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
        h = self._hash
        if h is None:
            context = self.context
            if self.kind is REGISTERED:
                try:
                    context = hash(context)
                except TypeError:  # e.g. a list of keys: compared by __eq__ only
                    context = None
            h = self._hash = hash((self.kind, self.type, context, self.children))
        return h

    def __repr__(self) -> str:
        if self.kind is TENSOR:
            return "*"
        if self.kind is LEAF or self.kind is NONE:
            return repr(self.context)
        return f"{getattr(self.type, '__name__', self.type)}({', '.join(map(repr, self.children))})"

    def unflatten(self, tensors: Sequence[torch.Tensor], *, unwrap_broadcast: bool = False) -> Any:
        """The tree with ``tensors`` (``num_tensors`` of them, in flatten
        order) in place of its tensors; with ``unwrap_broadcast`` every
        :class:`Broadcast` is replaced by its rebuilt value (what a replica
        gets). Raises RebuildError (a TypeError) for an iterable that cannot
        be rebuilt, its ``node`` set (``self.trail_to(node)`` locates it)."""
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
        """``count`` trees, tree ``j`` holding ``columns[i][j]`` in place of
        tensor ``i``: ``[self.unflatten([c[j] for c in columns]) for j in
        range(count)]`` in one walk of the spec (what scatter hands each
        replica: every container rebuilt per tree, other leaves shared; by
        default every :class:`Broadcast` and :class:`Samples` replaced by
        its value). A :class:`Samples` node gives tree ``j`` the next
        ``sizes[j]`` samples (``sizes`` sum to its length), each built from
        entry ``j`` of its tensors' columns. Raises RebuildError as
        unflatten does."""
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
            if child is node:
                return [i]
            if child.children:
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
_NONE = Spec(NONE, type(None), None, (), 0)


class Marks:
    """What :func:`flatten_marked` found besides the tensors (each entry in
    flatten order; indices are into the flattened tensor list):

    * ``broadcast``: ``[start, end)`` of the tensors inside each
      :class:`Broadcast`;
    * ``samples``: ``(node, start)`` of each :class:`Samples` outside any
      marker (``node`` its Spec, whose children are the samples);
    * ``packed``: ``(node, start, inside)`` of each PackedSequence, ``inside``
      None, BROADCAST or SAMPLES (the marker around it);
    * ``misplaced``: ``(node, outer)`` of each marker inside another one
      (``outer`` the kind of the one around it), which scatter refuses;
    * ``lists``: ``(node, start)`` of each ``list`` outside any marker that
      holds two tensors or more as entries (scatter checks their shapes).
    """

    __slots__ = ("broadcast", "samples", "packed", "misplaced", "lists", "any_marker")

    def __init__(self) -> None:
        self.any_marker = False  # whether any Broadcast or Samples was met
        self.broadcast: list[tuple[int, int]] = []
        self.samples: list[tuple[Spec, int]] = []
        self.packed: list[tuple[Spec, int, str | None]] = []
        self.misplaced: list[tuple[Spec, str]] = []
        self.lists: list[tuple[Spec, int]] = []


def _flatten(obj: Any, tensors: list[torch.Tensor], marks: Marks, inside: str | None = None) -> Spec:
    # (the caller has checked the registry: _KINDS is current); `inside`: the marker around obj, if any
    t = type(obj)
    node_kind = _KINDS.get(t)
    if node_kind is None:
        node_kind = _kind_of(t)
    if node_kind is TENSOR:
        tensors.append(obj)
        return _TENSOR
    if node_kind is LEAF:
        return Spec(LEAF, t, obj, (), 0)
    if node_kind is NONE:
        return _NONE
    start = len(tensors)
    if node_kind is BROADCAST:
        marks.any_marker = True
        inner = _flatten(obj.value, tensors, marks, BROADCAST if inside is None else inside)
        if len(tensors) == start:  # nothing to copy: every replica gets the value itself
            inner = Spec(LEAF, type(obj.value), obj.value, (), 0)
        else:
            marks.broadcast.append((start, len(tensors)))
        spec = Spec(BROADCAST, t, None, (inner,), len(tensors) - start)
        if inside is SAMPLES:  # (a Broadcast inside a Broadcast is whole anyway)
            marks.misplaced.append((spec, inside))
        return spec
    if node_kind is SAMPLES:
        marks.any_marker = True
        samples = tuple([_flatten(child, tensors, marks, SAMPLES if inside is None else inside) for child in obj.value])
        spec = Spec(SAMPLES, t, type(obj.value), samples, len(tensors) - start)
        if inside is None:
            marks.samples.append((spec, start))
        else:
            marks.misplaced.append((spec, inside))
        return spec
    if node_kind is ITERABLE:
        if inside is BROADCAST:  # passed whole, by reference, as an unknown object always was
            return Spec(LEAF, t, obj, (), 0)
        try:
            kids = list(obj)
        except Exception:  # noqa: BLE001 - an object that cannot be iterated is a leaf
            return Spec(LEAF, t, obj, (), 0)
        specs = tuple([_flatten(child, tensors, marks, inside) for child in kids])
        if len(tensors) == start:
            return Spec(LEAF, t, obj, (), 0)
        return Spec(ITERABLE, t, None, specs, len(tensors) - start)
    context, kids, template = _node(obj, node_kind)
    specs = tuple([_flatten(child, tensors, marks, inside) for child in kids])
    spec = Spec(node_kind, t, context, specs, len(tensors) - start, template)
    if node_kind is PACKED:
        marks.packed.append((spec, start, inside))
    elif node_kind is SEQUENCE and inside is None and issubclass(t, list) and specs.count(_TENSOR) > 1:
        marks.lists.append((spec, start))
    return spec


def flatten(tree: Any) -> tuple[list[torch.Tensor], Spec]:
    """``(tensors, spec)`` of `tree`: every tensor in it, depth first in child
    order (marker contents included), and the :class:`Spec` that rebuilds
    it. One walk of the tree."""
    _check_registry()
    tensors: list[torch.Tensor] = []
    return tensors, _flatten(tree, tensors, Marks())


def flatten_marked(tree: Any) -> tuple[list[torch.Tensor], Spec, Marks]:
    """As :func:`flatten`, also returning the :class:`Marks`: where the
    tensors inside a :class:`Broadcast` are, the :class:`Samples` lists and
    PackedSequences, and markers misplaced inside another."""
    _check_registry()
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
    node_kind = spec.kind
    if node_kind is TENSOR:
        return next(tensors)
    if node_kind is LEAF:
        return spec.context
    if node_kind is NONE:
        return None
    values = [_build(child, tensors, unwrap) for child in spec.children]
    if node_kind is BROADCAST:
        return values[0] if unwrap else Broadcast(values[0])
    if node_kind is SAMPLES:
        value = _sequence(spec.context, values)
        return value if unwrap else Samples(value)
    try:
        return _rebuild(node_kind, spec.type, spec.context, spec.template, values)
    except RebuildError as e:
        if e.node is None:
            e.node = spec
        raise


def _build_samples(spec: Spec, columns: Any, sizes: Sequence[int] | None, unwrap: bool) -> list[Any]:
    """One container per replica of the samples of a SAMPLES node: replica j
    gets the next ``sizes[j]`` samples, each built from entry j of its
    tensors' columns."""
    if sizes is None or sum(sizes) != len(spec.children):
        raise ValueError(
            f"cannot split {len(spec.children)} samples between replicas of sizes {sizes}: the sizes must sum to "
            f"the number of samples"
        )
    samples = iter(spec.children)
    out = []
    for j, size in enumerate(sizes):
        values = []
        for _ in range(size):
            child = next(samples)
            values.append(_build(child, iter([next(columns)[j] for _ in range(child.num_tensors)]), unwrap))
        value = _sequence(spec.context, values)
        out.append(value if unwrap else Samples(value))
    return out


def _build_replicas(
    spec: Spec, columns: Any, count: int, unwrap: bool, sizes: Sequence[int] | None = None
) -> list[Any]:
    node_kind = spec.kind
    if node_kind is TENSOR:
        return list(next(columns))
    if node_kind is LEAF:
        return [spec.context] * count
    if node_kind is NONE:
        return [None] * count
    if node_kind is SAMPLES:
        return _build_samples(spec, columns, sizes, unwrap)
    kids = [_build_replicas(child, columns, count, unwrap, sizes) for child in spec.children]
    if node_kind is BROADCAST:
        return kids[0] if unwrap else [Broadcast(v) for v in kids[0]]
    cls = spec.type
    if not kids:
        rows: Any = [[] for _ in range(count)]
    else:
        rows = zip(*kids)
        if node_kind is SEQUENCE and cls is tuple:
            return list(rows)
        if node_kind is MAPPING and cls is dict:
            keys = spec.context[0]
            return [dict(zip(keys, row)) for row in rows]
    try:
        return [_rebuild(node_kind, cls, spec.context, spec.template, list(row)) for row in rows]
    except RebuildError as e:
        if e.node is None:
            e.node = spec
        raise


def unflatten(spec: Spec, tensors: Sequence[torch.Tensor]) -> Any:
    """``spec.unflatten(tensors)``."""
    return spec.unflatten(tensors)


def path_at(tree: Any, trail: Sequence[int], root: str) -> str:
    """The path (``root`` followed by keys) of the node of `tree` reached by
    the child indices `trail` (as Spec.tensor_trail gives them)."""
    path = root
    node = tree
    for index in trail:
        node_kind = kind(node)
        if node_kind is BROADCAST:
            node = node.value
            continue
        if node_kind is SAMPLES:
            path += f"[{index}]"
            node = node.value[index]
            continue
        context, kids, _ = _node(node, node_kind)
        path += _keys(node, node_kind, context, len(kids))[index]
        node = kids[index]
    return path


def tensor_path(tree: Any, spec: Spec, index: int, root: str) -> str:
    """The path of tensor ``index`` (flatten order) of `tree`, whose spec is `spec`."""
    return path_at(tree, spec.tensor_trail(index), root)


class LazyPath:
    """The path of one tensor of a flattened tree, formatted (and computed)
    only when a message uses it: ``f"{path}"`` or ``str(path)``."""

    __slots__ = ("tree", "spec", "index", "root")

    def __init__(self, tree: Any, spec: Spec, index: int, root: str) -> None:
        self.tree, self.spec, self.index, self.root = tree, spec, index, root

    def __str__(self) -> str:
        return tensor_path(self.tree, self.spec, self.index, self.root)

    def __format__(self, format_spec: str) -> str:
        return format(str(self), format_spec)

    def __repr__(self) -> str:
        return repr(str(self))


class NodePath(LazyPath):
    """The path of one node (by its Spec) of a flattened tree, computed only
    when a message uses it."""

    __slots__ = ("node",)

    def __init__(self, tree: Any, spec: Spec, node: Spec, root: str) -> None:
        super().__init__(tree, spec, -1, root)
        self.node = node

    def __str__(self) -> str:
        try:
            trail = self.spec.trail_to(self.node)
        except LookupError:
            return self.root
        return path_at(self.tree, trail, self.root)


def contains_tensor(obj: Any) -> bool:
    """Whether a tensor sits anywhere in `obj` (inside Broadcast too)."""
    return bool(flatten(obj)[0])


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, containers
    rebuilt with their own type (as gather does); other leaves are kept."""
    tensors, spec = flatten(obj)
    if spec.kind is LEAF or spec.kind is NONE:
        return obj
    return spec.unflatten([fn(t) for t in tensors])


def describe_spec(spec: Spec, tensor: torch.Tensor | None = None) -> str:
    """The node `spec` (its first tensor `tensor`) in a few words for an
    error message ("a list of length 2")."""
    node_kind = spec.kind
    if node_kind is TENSOR:
        return "a tensor" if tensor is None else f"a tensor of shape {list(tensor.shape)}"
    if node_kind is NONE:
        return "None"
    name = spec.type.__name__
    if node_kind is SEQUENCE or node_kind is NAMEDTUPLE:
        return f"a {name} of length {len(spec.children)}"
    if node_kind is MAPPING:
        return f"a {name} with keys {list(spec.context[0])}"
    if node_kind is ITERABLE:
        return f"a {name} of {len(spec.children)} elements"
    if node_kind is SAMPLES:
        return f"a dpcore.Samples of {len(spec.children)} samples"
    return f"a {name}"


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
