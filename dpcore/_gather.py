"""The gather of the replicas' outputs into one (private): their specs merged node by node and
the joins the scatter's hints call for; the rules: :func:`dpcore.scatter_gather.gather_with_hints`."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn, Union

import torch

from dpcore import _packed
from dpcore import _pytree as pt
from dpcore._devices import DeviceLike, as_destination
from dpcore._functions import Gather, apply
from dpcore._pytree import BROADCAST, ITERABLE, LEAF, MAPPING, NODE, OBJECT, PACKED, SAMPLES, STATE, TENSOR


class GatherHints(NamedTuple):
    """What the scatter of a call tells the gather of its outputs: whether an input was a Samples
    list, the Layout and Rows of each PackedSequence input (:mod:`dpcore._packed`), and each
    replica's rows (samples, sequences)."""

    samples: bool = False
    packed: tuple[_packed.Layout, ...] = ()
    rows: tuple[_packed.Rows, ...] = ()
    sizes: tuple[int, ...] = ()


NO_HINTS = GatherHints()
_WRAPPABLE = (RuntimeError, ValueError, IndexError, TypeError)
# Per gathered tensor: the replicas' tensors to concatenate, or a function making the tensors.
_Column = Union[list[torch.Tensor], Callable[[], list[torch.Tensor]]]


def _reraise(e: Exception, prefix: str) -> NoReturn:
    """`e` with `prefix` before its message where its type is exactly one of _WRAPPABLE, else `e`."""
    if type(e) in _WRAPPABLE:
        raise type(e)(f"{prefix}{e}") from e
    raise e


def _moved(t: torch.Tensor, destination: DeviceLike | None) -> torch.Tensor:
    """`t` on the gather's destination (as comm.gather resolves it), differentiably."""
    device = as_destination(destination)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if t.is_cuda else t.device
    return t.to(device)


class _Merger:
    """The replicas' specs (``flats[j]``: replica j's tensors) merged into the gathered output's."""

    def __init__(self, output: Any, flats: list[list[torch.Tensor]], destination: Any, dim: int, hints: GatherHints):
        self.output, self.flats, self.destination, self.dim, self.hints = output, flats, destination, dim, hints
        self.columns: list[_Column] = []

    def mismatch(
        self, specs: list[pt.Spec], starts: list[int], trail: tuple[int, ...], j: int, what: str = ""
    ) -> ValueError:
        def describe(k: int) -> str:
            return _describe(specs[k], self.flats[k][starts[k]] if specs[k].kind is TENSOR else None)

        return ValueError(
            f"gather: {pt.path_at(self.output, trail, 'output')} of replica {j} is {describe(j)} but replica 0's is "
            f"{describe(0)}{what}; every replica must return the same structure"
        )

    def subtrees(self, specs: list[pt.Spec], starts: list[int]) -> list[Any]:
        return [s.unflatten(f[i : i + s.num_tensors]) for s, f, i in zip(specs, self.flats, starts)]

    def path(self, trail: tuple[int, ...]) -> str:
        return pt.path_at(self.output, trail, "output")

    def merge(
        self, specs: list[pt.Spec], starts: list[int], trail: tuple[int, ...] = (), state: bool = False
    ) -> pt.Spec:
        """The gathered spec at `trail` from the replicas' there (``starts[j]``: replica j's first
        tensor there), one _Column per tensor appended to ``columns``; ValueError where they differ.
        `state`: inside a cache (an ITERABLE or OBJECT node), whose values without a batch are kept once."""
        first = specs[0]
        kind, cls = first.kind, first.type
        plain = kind is LEAF or kind is BROADCAST  # None if every replica gave None, else a list of the values
        for j, s in enumerate(specs):
            if not ((s.kind is LEAF or s.kind is BROADCAST) if plain else (s.kind is kind and s.type is cls)):
                raise self.mismatch(specs, starts, trail, j)
        if kind is TENSOR:
            column = [flat[start] for flat, start in zip(self.flats, starts)]
            if state and any(t.dim() == 0 for t in column):
                self.columns.append(self.kept_once(column, trail))
            else:
                self.columns.append(self.recombined(column) if self.hints.rows else column)
            return first
        if plain:
            if all(s == pt.NONE_SPEC for s in specs):
                return first
            if state:
                return self.kept_leaf(specs, trail)
            for s in specs:
                if s.kind is LEAF and pt.holds_tensors(s.context):
                    raise TypeError(
                        f"gather: {self.path(trail)} is a {type(s.context).__name__} that holds tensors, which "
                        f"DataParallel cannot take apart to join the replicas' (it would return them as a list): "
                        f"register {type(s.context).__name__} with torch.utils._pytree.register_pytree_node to say "
                        f"how it is taken apart and rebuilt, or pass gather=False to get the per-replica outputs"
                    )
            return pt.Spec(LEAF, list, self.subtrees(specs, starts), (), 0)
        if kind is PACKED:
            return self.merge_packed(specs, starts)
        if kind is SAMPLES or (
            kind is NODE and issubclass(cls, list) and (self.hints.samples or self.per_sample(specs, starts))
        ):
            return self.merge_samples(specs, starts)
        count = len(first.children)
        keys = pt.mapping_keys(cls, first.context) if kind is MAPPING else None
        picks: list[Any] = []  # per replica: its child index of each of first's children
        for j, s in enumerate(specs):
            if kind is MAPPING and (other := pt.mapping_keys(cls, s.context)) != keys:
                if set(other) != set(keys):
                    missing = [k for k in keys if k not in set(other)]
                    extra = [k for k in other if k not in set(keys)]
                    raise self.mismatch(specs, starts, trail, j, f" (missing keys {missing}, extra keys {extra})")
                position = {k: i for i, k in enumerate(other)}
                picks.append([position[k] for k in keys])
                continue
            if (kind is NODE or kind is OBJECT) and (s.context,) != (first.context,):
                what = f" (its structure differs: {s.context!r} against replica 0's {first.context!r})"
                raise self.mismatch(specs, starts, trail, j, what)
            if len(s.children) != count:
                raise self.mismatch(specs, starts, trail, j)
            picks.append(range(count))
        offsets = [
            list(itertools.accumulate([c.num_tensors for c in s.children], initial=i)) for s, i in zip(specs, starts)
        ]
        inner = state or kind in STATE
        kids = [
            self.merge(
                [s.children[p[c]] for s, p in zip(specs, picks)],
                [o[p[c]] for o, p in zip(offsets, picks)],
                (*trail, c),
                inner,
            )
            for c in range(count)
        ]
        return pt.Spec(kind, cls, first.context, tuple(kids), sum(k.num_tensors for k in kids), first.node)

    def kept_once(self, column: list[torch.Tensor], trail: tuple[int, ...]) -> Callable[[], list[torch.Tensor]]:
        """Replica 0's 0-dim tensor of a cache, where every replica's equals it (a counter, a window)."""
        ref = column[0]
        for j, t in enumerate(column):
            if t.shape != ref.shape or t.dtype != ref.dtype or not torch.equal(t.to(ref.device), ref):
                raise ValueError(
                    f"gather: {self.path(trail)} of replica {j} is {_scalar(t)} but replica 0's is {_scalar(ref)}: "
                    f"a 0-dim tensor inside a cache is one state of the whole batch (a length, a window), so every "
                    f"replica must return the same; pass gather=False to get the per-replica outputs"
                )
        return lambda: [_moved(ref, self.destination)]

    def kept_leaf(self, specs: list[pt.Spec], trail: tuple[int, ...]) -> pt.Spec:
        """The one value of a cache's non-tensor leaf (a device: the gather's destination); ValueError where
        the replicas' differ."""
        first = specs[0]
        if first.type is torch.device:
            device = as_destination(self.destination)
            return first if device is None else pt.Spec(LEAF, torch.device, device, (), 0)
        for j, s in enumerate(specs):
            try:
                same = s.kind is LEAF and (s.context is first.context or bool(s.context == first.context))
            except Exception:  # noqa: BLE001 - a comparison that fails is a difference
                same = False
            if not same:
                raise ValueError(
                    f"gather: {self.path(trail)} of replica {j} is {_value(s)} but replica 0's is {_value(first)}: "
                    f"a value without a batch dimension inside a cache is one state of the whole batch, so every "
                    f"replica must return the same; pass gather=False to get the per-replica outputs"
                )
        return first

    def per_sample(self, specs: list[pt.Spec], starts: list[int]) -> bool:
        """Whether the replicas' lists hold one entry per sample: each as long as its replica's rows, and
        some entry on some replica not a batch (a tensor with those rows along ``dim``, or a tree of them)."""
        sizes = self.hints.sizes
        if len(sizes) != len(specs) or any(len(s.children) != n for s, n in zip(specs, sizes)):
            return False
        for s, flat, start, rows in zip(specs, self.flats, starts, sizes):
            for child in s.children:
                tensors = flat[start : start + child.num_tensors]
                start += child.num_tensors
                dim = self.dim
                if not tensors or not all(-t.dim() <= dim < t.dim() and t.size(dim) == rows for t in tensors):
                    return True
        return False

    def merge_packed(self, specs: list[pt.Spec], starts: list[int]) -> pt.Spec:
        """One PackedSequence of all the replicas' sequences (:func:`dpcore._packed.join`)."""
        try:
            joined = _packed.join(self.subtrees(specs, starts), self.destination, self.hints.packed)
        except _WRAPPABLE as e:
            _reraise(e, "gather: joining the replicas' PackedSequence outputs: ")
        fields = [f for f in joined if f is not None]
        self.columns.append(lambda: fields)
        kids = tuple(pt.TENSOR_SPEC if f is not None else pt.NONE_SPEC for f in joined)
        return pt.Spec(PACKED, type(joined), type(joined), kids, len(fields), specs[0].node)

    def merge_samples(self, specs: list[pt.Spec], starts: list[int]) -> pt.Spec:
        """Lists of one entry per sample, concatenated in replica order (their tensors moved)."""
        for s, flat, start in zip(specs, self.flats, starts):
            mine = flat[start : start + s.num_tensors]
            self.columns.append(lambda mine=mine: [_moved(t, self.destination) for t in mine])
        kids = tuple(child for s in specs for child in s.children)
        total = sum(s.num_tensors for s in specs)
        if specs[0].kind is NODE:
            return pt.Spec(NODE, specs[0].type, None, kids, total, specs[0].node)
        return pt.Spec(NODE, list, None, kids, total, pt.node_of([]))

    def recombined(self, column: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """A column of a call with a PackedSequence input, as :func:`_packed.recombine` joins it."""

        def make() -> list[torch.Tensor]:
            joined = _packed.recombine(column, self.hints.rows, self.dim, self.destination)
            return [apply(Gather, self.destination, self.dim, *column) if joined is None else joined]

        return make


def gather_outputs(values: list[Any], target_device: DeviceLike | None, dim: int, hints: GatherHints) -> Any:
    """The gather of the replicas' outputs `values` (at least one), as gather_with_hints says."""
    first = values[0]
    if not hints.rows and all(type(v) is torch.Tensor for v in values):
        try:
            return apply(Gather, target_device, dim, *values)
        except _WRAPPABLE as e:
            _reraise(e, "gather: output: ")
    flats = [pt.flatten(v) for v in values]
    merger = _Merger(first, [t for t, _ in flats], target_device, dim, hints)
    spec = merger.merge([s for _, s in flats], [0] * len(values))
    gathered: list[torch.Tensor] = []
    for column in merger.columns:
        try:
            gathered.extend(column() if callable(column) else [apply(Gather, target_device, dim, *column)])
        except _WRAPPABLE as e:
            _reraise(e, f"gather: {pt.lazy_path(first, spec, len(gathered), 'output')}: ")
    try:
        return spec.unflatten(gathered)
    except pt.RebuildError as e:
        raise TypeError(
            f"gather: {pt.path_at(first, spec.trail_to(e.node), 'output')} {e}; or use gather=False to get the "
            f"per-replica outputs"
        ) from e


def _scalar(t: torch.Tensor) -> str:
    return f"tensor({t.item()!r}, dtype={t.dtype})" if t.dim() == 0 else f"a tensor of shape {list(t.shape)}"


def _value(spec: pt.Spec) -> str:
    """A leaf's value for a message (None, ``'text'``, a short repr or its type)."""
    text = repr(spec.context)
    return text if len(text) <= 60 else f"a {type(spec.context).__name__}"


def _describe(spec: pt.Spec, tensor: torch.Tensor | None = None) -> str:
    """The node `spec` (first tensor `tensor`) in a few words ("a list of length 2")."""
    kind = spec.kind
    if kind is TENSOR:
        return "a tensor" if tensor is None else f"a tensor of shape {list(tensor.shape)}"
    if spec == pt.NONE_SPEC:
        return "None"
    name = spec.type.__name__
    if kind is SAMPLES:
        return f"a dpcore.Samples of {len(spec.children)} samples"
    if kind is MAPPING:
        return f"a {name} with keys {list(pt.mapping_keys(spec.type, spec.context))}"
    if kind is ITERABLE:
        return f"a {name} of {len(spec.children)} elements"
    if issubclass(spec.type, (list, tuple)) and kind is not PACKED:
        return f"a {name} of length {len(spec.children)}"
    return f"a {name}"


def pad_outputs(values: list[Any], dim: int, pad_value: float | None, label: str, path: str = "output") -> list[Any]:
    """The replicas' outputs `values`, each tensor that differs from another replica's beyond `dim` padded at the end
    to the largest with `pad_value` (ValueError naming the path where None); other differences are left."""
    first = values[0]
    if all(isinstance(v, torch.Tensor) for v in values):
        return _padded_tensors(values, dim, pad_value, label, path)
    node = pt.node_of(first)
    if node.kind not in (pt.NODE, pt.MAPPING, *pt.STATE) or any(type(v) is not type(first) for v in values):
        return values
    flat = [node.flatten(v) for v in values]
    kids = [list(children) for children, _ in flat]
    keys = node.keys(first, flat[0][1], len(kids[0]))
    if any(node.keys(v, c, len(k)) != keys for v, (_, c), k in zip(values[1:], flat[1:], kids[1:])):
        return values
    columns = [pad_outputs([k[i] for k in kids], dim, pad_value, label, path + key) for i, key in enumerate(keys)]
    if all(column[j] is kids[j][i] for i, column in enumerate(columns) for j in range(len(values))):
        return values
    return [node.unflatten([column[j] for column in columns], flat[j][1]) for j in range(len(values))]


def _padded_tensors(values: list[torch.Tensor], dim: int, pad_value: float | None, label: str, path: str) -> list[Any]:
    rank = values[0].dim()
    if rank == 0 or any(v.dim() != rank for v in values) or not -rank <= dim < rank:
        return values
    batch = dim % rank
    target = [max(v.size(i) for v in values) for i in range(rank)]
    ragged = [j for j, v in enumerate(values) if any(v.size(i) != target[i] for i in range(rank) if i != batch)]
    if not ragged:
        return values
    if pad_value is None:
        j = next(j for j, v in enumerate(values) if v.shape != values[ragged[0]].shape)
        raise ValueError(
            f"{label}: {path} has shape {list(values[ragged[0]].shape)} on replica {ragged[0]} but "
            f"{list(values[j].shape)} on replica {j}, beyond the batch dimension {dim}; pass pad_value= to pad "
            f"them to the largest"
        )
    if not (values[0].is_floating_point() or values[0].is_complex()) and not float(pad_value).is_integer():
        raise ValueError(f"{label}: pad_value={pad_value!r} cannot pad {path}, a {values[0].dtype} tensor")
    out = list(values)
    for j in ragged:
        out[j] = values[j].new_full([values[j].size(i) if i == batch else target[i] for i in range(rank)], pad_value)
        out[j][tuple(slice(0, n) for n in values[j].shape)] = values[j]
    return out
