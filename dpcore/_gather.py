"""The gather of per-replica outputs into one (private): the replicas'
pytree specs merged node by node, tensors concatenated with the
differentiable :class:`dpcore._functions.Gather`, and the joins that the
scatter's :class:`GatherHints` call for (lists of samples, PackedSequences,
packed data). The rules: :func:`dpcore.scatter_gather.gather` and
:func:`dpcore.scatter_gather.gather_with_hints`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Union

import torch

from dpcore import _packed
from dpcore import _pytree as pt
from dpcore._devices import DeviceLike, as_destination
from dpcore._functions import Gather
from dpcore._pytree import BROADCAST, LEAF, MAPPING, NODE, TENSOR


class GatherHints(NamedTuple):
    """What the scatter of a call tells the gather of its outputs:
    ``samples``, whether an input was a :class:`Samples` list (then the
    outputs' lists hold one entry per sample, joined by concatenation), the
    :class:`dpcore._packed.Layout` of each PackedSequence input (a
    PackedSequence output of the same sequences is joined in that order),
    and the :class:`dpcore._packed.Rows` of each (a tensor output that is
    the replicas' packed data is joined in the batch's packed order)."""

    samples: bool = False
    packed: tuple[_packed.Layout, ...] = ()
    rows: tuple[_packed.Rows, ...] = ()


NO_HINTS = GatherHints()


_WRAPPABLE = (RuntimeError, ValueError, IndexError, TypeError)
_VALUES = (LEAF, BROADCAST)


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
    return spec.unflatten(tensors[start : start + spec.num_tensors])


def _mismatch(
    specs: list[pt.Spec], starts: list[int], flats: list[list[torch.Tensor]], j: int, what: str = ""
) -> _Mismatch:
    got, first = specs[j], specs[0]
    return _Mismatch(
        j,
        _describe(got, flats[j][starts[j]] if got.kind is TENSOR else None),
        _describe(first, flats[0][starts[0]] if first.kind is TENSOR else None),
        what,
    )


class _Joined:
    """Tensors of the gathered output made otherwise than by concatenating a
    column: by `make` (called once, when the gather runs), `count` of them."""

    __slots__ = ("make", "count")

    def __init__(self, make: Callable[[], list[torch.Tensor]], count: int) -> None:
        self.make, self.count = make, count


_Column = Union[list[torch.Tensor], _Joined]


class _Gathering(NamedTuple):
    """What one gather needs at every node besides the replicas' specs."""

    destination: DeviceLike | None
    dim: int
    hints: GatherHints


def _moved(t: torch.Tensor, destination: DeviceLike | None) -> torch.Tensor:
    """`t` on the gather's destination (as comm.gather resolves it), differentiably; itself where it is there."""
    device = as_destination(destination)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if t.is_cuda else t.device
    return t.to(device)


def _merge_packed(
    specs: list[pt.Spec], starts: list[int], flats: list[list[torch.Tensor]], columns: list[_Column], how: _Gathering
) -> pt.Spec:
    """_merge of PackedSequence nodes: one PackedSequence of all the replicas'
    sequences (dpcore._packed.join), its fields as one _Joined entry."""
    packs = [spec.unflatten(flat[start : start + spec.num_tensors]) for spec, start, flat in zip(specs, starts, flats)]
    try:
        joined = _packed.join(packs, how.destination, how.hints.packed)
    except _WRAPPABLE as e:
        if type(e) in _WRAPPABLE:
            raise type(e)(f"gather: joining the replicas' PackedSequence outputs: {e}") from e
        raise
    fields = [f for f in joined if f is not None]
    columns.append(_Joined(lambda: fields, len(fields)))
    kids = tuple(pt._TENSOR if f is not None else pt._NONE for f in joined)
    return pt.Spec(pt.PACKED, type(joined), type(joined), kids, len(fields), specs[0].node)


def _packed_data(column: list[torch.Tensor], how: _Gathering) -> _Column:
    """A column of the replicas' tensors in a call with a PackedSequence
    input: joined in the batch's packed order where they are its packed data
    (dpcore._packed.data_rows decides, when the gather runs), else as is."""

    def make() -> list[torch.Tensor]:
        rows = _packed.data_rows(column, how.hints.rows, how.dim)
        if rows is None:
            return [Gather.apply(how.destination, how.dim, *column)]
        return [_packed.join_rows(column, rows, how.destination)]

    return _Joined(make, 1)


def _merge_samples(
    specs: list[pt.Spec], starts: list[int], flats: list[list[torch.Tensor]], columns: list[_Column], how: _Gathering
) -> pt.Spec:
    """_merge of lists that hold one entry per sample: their entries
    concatenated in replica order, untouched but for their tensors, each
    moved to the destination."""
    kids: list[pt.Spec] = []
    total = 0
    for spec, start, flat in zip(specs, starts, flats):
        kids.extend(spec.children)
        mine = flat[start : start + spec.num_tensors]
        columns.append(_Joined(lambda mine=mine: [_moved(t, how.destination) for t in mine], len(mine)))
        total += len(mine)
    if specs[0].kind is NODE:
        return pt.Spec(NODE, specs[0].type, None, tuple(kids), total, specs[0].node)
    return pt.Spec(NODE, list, None, tuple(kids), total, pt.node_for([]))


def _merge(
    specs: list[pt.Spec],
    starts: list[int],
    flats: list[list[torch.Tensor]],
    columns: list[_Column],
    how: _Gathering,
) -> pt.Spec:
    """The spec of the gathered output at one node, from the replicas' specs
    there (`starts`: where each replica's tensors of this node begin in its
    flattened list `flats[j]`). Appends to `columns`, in the order of the
    returned spec, one column of per-replica tensors per tensor to
    concatenate, or a _Joined entry for tensors made otherwise (per-sample
    lists, PackedSequences); raises _Mismatch where the structures differ."""
    first = specs[0]
    first_kind = first.kind
    if first_kind is TENSOR:
        for j, s in enumerate(specs):
            if s.kind is not TENSOR:
                raise _mismatch(specs, starts, flats, j)
        column = [flat[start] for flat, start in zip(flats, starts)]
        columns.append(_packed_data(column, how) if how.hints.rows else column)
        return first

    if first_kind in _VALUES:
        # Plain values: None stays None if every replica returned None; any
        # mix of non-container, non-tensor values gathers into a list.
        for j, s in enumerate(specs):
            if s.kind not in _VALUES:
                raise _mismatch(specs, starts, flats, j)
        if all(pt.is_none(s) for s in specs):
            return first
        return pt.Spec(LEAF, list, [_value(s, flats[j], starts[j]) for j, s in enumerate(specs)], (), 0)

    cls = first.type
    count = len(first.children)
    orders: list[list[int] | None] | None = None  # per replica: its child index of each of first's
    for j in range(1, len(specs)):
        s = specs[j]
        if s.kind is not first_kind or s.type is not cls:
            raise _mismatch(specs, starts, flats, j)
    if first_kind is pt.PACKED:
        return _merge_packed(specs, starts, flats, columns, how)
    if first_kind is pt.SAMPLES or (how.hints.samples and first_kind is NODE and issubclass(cls, list)):
        return _merge_samples(specs, starts, flats, columns, how)
    for j in range(1, len(specs)):
        s = specs[j]
        if first_kind is MAPPING:
            keys, other = pt.mapping_keys(first), pt.mapping_keys(s)
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
        if first_kind is NODE and not (s.context,) == (first.context,):
            raise _mismatch(
                specs,
                starts,
                flats,
                j,
                f" (its structure differs: {s.context!r} against replica 0's {first.context!r})",
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
            kids.append(_merge(sub_specs, sub_starts, flats, columns, how))
        except _Mismatch as e:
            e.trail.insert(0, c)
            raise
    return pt.Spec(first_kind, cls, first.context, tuple(kids), sum(k.num_tensors for k in kids), first.node)


def _gather_tensors(values: list[torch.Tensor], path: Any, destination: DeviceLike | None, dim: int) -> torch.Tensor:
    try:
        return Gather.apply(destination, dim, *values)
    except _WRAPPABLE as e:
        if type(e) in _WRAPPABLE:
            raise type(e)(f"gather: {path}: {e}") from e
        raise


def gather_outputs(values: list[Any], target_device: DeviceLike | None, dim: int, hints: GatherHints) -> Any:
    """The gather of the replicas' outputs `values` (at least one; see
    dpcore.scatter_gather.gather_with_hints for the rules)."""
    first = values[0]
    if not hints.rows and all(type(v) is torch.Tensor for v in values):
        return _gather_tensors(values, "output", target_device, dim)
    flats = [pt.flatten(v) for v in values]
    columns: list[_Column] = []
    try:
        spec = _merge(
            [s for _, s in flats],
            [0] * len(values),
            [t for t, _ in flats],
            columns,
            _Gathering(target_device, dim, hints),
        )
    except _Mismatch as e:
        raise ValueError(
            f"gather: {pt.path_at(first, e.trail, 'output')} of replica {e.replica} is {e.got} but replica 0's is "
            f"{e.expected}{e.what}; every replica must return the same structure"
        ) from None
    gathered: list[torch.Tensor] = []
    for column in columns:
        try:
            if isinstance(column, _Joined):
                gathered.extend(column.make())
            else:
                gathered.append(Gather.apply(target_device, dim, *column))
        except _WRAPPABLE as e:
            if type(e) in _WRAPPABLE:
                raise type(e)(f"gather: {_output_path(first, spec, len(gathered))}: {e}") from e
            raise
    try:
        return spec.unflatten(gathered)
    except pt.RebuildError as e:
        raise TypeError(
            f"gather: {pt.path_at(first, spec.trail_to(e.node), 'output')} {e}; or use gather=False to get the per-replica outputs"
        ) from e


def _output_path(first: Any, spec: pt.Spec, index: int) -> str:
    """The path of tensor `index` of the gathered output (of spec `spec`),
    named through replica 0's output `first`; "output" where the two differ
    there (a concatenated per-sample list is longer than replica 0's)."""
    try:
        return pt.tensor_path(first, spec, index, "output")
    except (IndexError, LookupError, TypeError, AttributeError):
        return "output"


def _describe(spec: pt.Spec, tensor: torch.Tensor | None = None) -> str:
    """The node `spec` (its first tensor `tensor`) in a few words for an
    error message ("a list of length 2")."""
    kind = spec.kind
    if kind is TENSOR:
        return "a tensor" if tensor is None else f"a tensor of shape {list(tensor.shape)}"
    if pt.is_none(spec):
        return "None"
    name = spec.type.__name__
    if kind is pt.SAMPLES:
        return f"a dpcore.Samples of {len(spec.children)} samples"
    if kind is MAPPING:
        return f"a {name} with keys {list(pt.mapping_keys(spec))}"
    if kind is pt.ITERABLE:
        return f"a {name} of {len(spec.children)} elements"
    if issubclass(spec.type, (list, tuple)) and kind is not pt.PACKED:
        return f"a {name} of length {len(spec.children)}"
    return f"a {name}"
