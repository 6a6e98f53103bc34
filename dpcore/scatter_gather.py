"""Scatter of inputs and gather of outputs for data parallelism, over pytrees.

Pytrees are walked by :mod:`dpcore._pytree` (which containers it enters:
:mod:`dpcore._nodes`): every container is rebuilt with its own type for
every replica, every other value is a leaf. How many rows each device gets
is :func:`dpcore._split.plan_split`.

* :func:`scatter_kwargs`: splits positional and keyword arguments into one
  ``(args, kwargs)`` pair per replica; tensors through the differentiable
  :class:`dpcore._functions.Scatter`, so gradients reach the inputs.
* :func:`scatter` and :func:`gather`: torch.nn.parallel's top-level
  functions, with their arguments (``dpcore.scatter``, ``dpcore.gather``);
  gather merges per-replica outputs of one structure into one output
  (:mod:`dpcore._gather`), tensors through the differentiable
  :class:`dpcore._functions.Gather`.

Errors name the pytree path of the offending value, e.g.
``inputs[1]['mask']``, ``kwargs['x'].field`` or ``output['logits'][0]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.nn.utils.rnn import PackedSequence

from dpcore import _packed
from dpcore import _pytree as pt
from dpcore import comm
from dpcore._devices import DeviceLike, as_devices, normalize_device
from dpcore._functions import BroadcastTensor, Scatter
from dpcore._gather import NO_HINTS, GatherHints, gather_outputs
from dpcore._markers import Broadcast, Samples, is_namedtuple
from dpcore._pytree import NODE
from dpcore._split import check_repeated_rows, check_split, plan_split

__all__ = [
    "Broadcast",
    "Samples",
    "Scattered",
    "GatherHints",
    "scatter_kwargs",
    "scatter_with_hints",
    "scatter",
    "gather",
]


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


def _nonempty_device_list(devices: Sequence[DeviceLike], arg: str) -> list[torch.device]:
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


def _misplaced(tree: Any, spec: pt.Spec, node: pt.Spec, outer: str, path: str) -> TypeError:
    what = "dpcore.Samples" if node.kind is pt.SAMPLES else "dpcore.Broadcast"
    around = "a dpcore.Samples list (a sample goes whole to one replica)" if outer is pt.SAMPLES else "dpcore.Broadcast"
    return TypeError(
        f"{pt.LazyPath(tree, spec, node, path)} is a {what} inside {around}: a marker says how a whole "
        f"argument is passed, so markers cannot be nested"
    )


def _split_trees(
    trees: Sequence[tuple[Any, str]],
    devices: list[torch.device],
    dim: int,
    chunk_sizes: Sequence[int] | None,
    weights: Sequence[float] | None,
    without_tensors: list[int],
) -> tuple[list[list[Any]], list[int], list[int], GatherHints]:
    """Splits each (tree, path) of `trees` into one value per replica; returns
    (per tree, its values), the replicas' sizes and their device indices,
    and the hints for the gather of the call's outputs. With no tensor to
    split the replicas are the devices `without_tensors`. Each tree is
    flattened once; its spec rebuilds it for every replica."""
    flats = [pt.flatten_marked(tree) for tree, _ in trees]
    whole = [_broadcast_marks(len(tensors), m.broadcast) for tensors, _, m in flats]
    leaves: list[tuple[Any, torch.Tensor]] = []  # (path, tensor) of the tensors to split
    units: list[tuple[Any, int, str]] = []  # (path, count, noun) of the inputs split between samples
    # Per tree: tensor index -> ("sample", sample number, 0) / ("packed", PackedSequence number, field number)
    # / ("keep", 0, 0) for the batch_sizes of a PackedSequence inside a marker (they stay on the CPU)
    special: list[dict[int, tuple[str, int, int]]] = []
    packs: list[PackedSequence] = []
    for (tree, path), (tensors, spec, m), marked in zip(trees, flats, whole):
        if m.misplaced:
            node, outer = m.misplaced[0]
            raise _misplaced(tree, spec, node, outer, path)
        tags: dict[int, tuple[str, int, int]] = {}
        for node, start in m.samples:
            units.append((pt.LazyPath(tree, spec, node, path), len(node.children), "samples"))
            for number, child in enumerate(node.children):  # every Samples list of the call numbered from 0
                for i in range(start, start + child.num_tensors):
                    tags[i] = ("sample", number, 0)
                start += child.num_tensors
        for node, start, inside in m.packed:
            if inside is None:
                packed = node.unflatten(tensors[start : start + node.num_tensors])
                units.append((pt.LazyPath(tree, spec, node, path), _packed.count(packed), "sequences"))
                for field in range(node.num_tensors):
                    tags[start + field] = ("packed", len(packs), field)
                packs.append(packed)
            else:
                tags[start + node.children[0].num_tensors] = ("keep", 0, 0)
        special.append(tags)
        for i, t in enumerate(tensors):
            if i not in tags and (marked is None or not marked[i]):
                leaves.append((pt.LazyPath(tree, spec, i, path), t))
    entries = _check_batch(leaves, dim)
    for (tree, path), (tensors, spec, m) in zip(trees, flats):
        for node, start in m.lists:
            _check_list(tree, spec, node, tensors, start, dim, path)
    plan = plan_split(entries, len(devices), chunk_sizes, weights, dim, units, _SamplesHint(flats))
    used = plan.devices(without_tensors)
    used_sizes = [plan.sizes[i] for i in used] if plan.batch is not None else [0] * len(used)
    used_devices = [devices[i] for i in used]
    count = len(used)
    owners = [j for j, size in enumerate(used_sizes) for _ in range(size)]  # the replica of each sample
    split_packs = [_packed.split(p, used_sizes, used_devices) for p in packs]
    memo: dict[tuple[int, bool], tuple[torch.Tensor, Sequence[torch.Tensor]]] = {}

    def per_replica(t: torch.Tensor, whole: bool) -> Sequence[torch.Tensor]:
        key = (id(t), whole)
        hit = memo.get(key)
        if hit is None:
            source = t
            # plan_split checked every tensor: 0-dim whole, the batch's size by the split, any other one row each
            if whole or t.dim() == 0:
                parts: Sequence[torch.Tensor] = _broadcast_tensor(t, used_devices)
            else:
                size = t.size(dim)
                if size != plan.batch and size != count:  # one row per device, fewer replicas (plan_split's 3b)
                    path = next((p for p, leaf in leaves if leaf is t), "a tensor")  # this rare case only
                    t = check_repeated_rows(t, dim, count, path)
                rows = used_sizes if size == plan.batch else [1] * count
                parts = Scatter.apply(used_devices, rows, dim, t)
            hit = memo[key] = (source, parts)  # the source kept alive: its id stays its own
        return hit[1]

    def column(i: int, t: torch.Tensor, tags: dict[int, tuple[str, int, int]], marked: list[bool] | None) -> Any:
        tag = tags.get(i)
        if tag is None:
            return per_replica(t, marked is not None and marked[i])
        what, number, field = tag
        if what == "keep":
            return [t] * count
        if what == "sample":  # moved whole to its replica's device (differentiably; as is where it is)
            owner = owners[number]
            entries: list[Any] = [None] * count
            entries[owner] = t.to(used_devices[owner])
            return entries
        return _packed_column(split_packs[number][0], field)

    values = []
    for (tree, path), (tensors, spec, _), tags, marked in zip(trees, flats, special, whole):
        columns = [column(i, t, tags, marked) for i, t in enumerate(tensors)]
        try:
            values.append(spec.unflatten_replicas(columns, count, sizes=used_sizes))
        except pt.RebuildError as e:
            raise TypeError(
                f"{pt.path_at(tree, spec.trail_to(e.node), path)} {e}; or wrap it in dpcore.Broadcast to pass it whole to "
                f"every replica"
            ) from e
    hints = GatherHints(
        any(noun == "samples" for _, _, noun in units),
        tuple(s[1] for s in split_packs),
        tuple(s[2] for s in split_packs),
    )
    return values, used_sizes, used, hints


def _check_list(
    tree: Any, spec: pt.Spec, node: pt.Spec, tensors: list[torch.Tensor], start: int, dim: int, path: str
) -> None:
    """ValueError naming dpcore.Samples where two tensor entries of the list
    `node` (its tensors from `start`) have one rank and one size along `dim`
    but differ in another dimension (images of different sizes): a list of
    samples, not of batch tensors."""
    seen: dict[int, torch.Tensor] = {}  # the first entry of each rank
    for child in node.children:
        if child is pt._TENSOR and tensors[start].dim() > 0:
            t = tensors[start]
            other = seen.setdefault(t.dim(), t)
            if -t.dim() <= dim < t.dim() and t.size(dim) == other.size(dim) and t.shape != other.shape:
                raise ValueError(
                    f"{pt.LazyPath(tree, spec, node, path)} is a list of tensors of one size along dim {dim} whose "
                    f"shapes differ otherwise ({list(other.shape)} and {list(t.shape)}), so it is not one batch: a "
                    f"list of samples (images of different sizes) goes in dpcore.Samples(list), which splits it "
                    f"between samples, while torch.nn.DataParallel's rule would split every tensor of the list along "
                    f"dim {dim} (an image along its channels); pass batch tensors of different shapes as a tuple"
                )
        start += child.num_tensors


class _SamplesHint:
    """The end of a batch-size error where a tensor sits in a plain list
    (formatted, and the trees walked, only when an error is raised)."""

    def __init__(self, flats: list[tuple[list[torch.Tensor], pt.Spec, pt.Marks]]) -> None:
        self.flats = flats

    def __format__(self, format_spec: str) -> str:
        if not any(_holds_list(spec) for _, spec, _ in self.flats):
            return ""
        return (
            "; a list with one entry per sample (images of different sizes, their target dicts) goes in "
            "dpcore.Samples(list), which splits it between samples"
        )


def _holds_list(spec: pt.Spec) -> bool:
    """Whether a ``list`` holding tensors sits in the tree of `spec`, outside markers."""
    if spec.kind is pt.BROADCAST or spec.kind is pt.SAMPLES or not spec.num_tensors:
        return False
    if spec.kind is NODE and issubclass(spec.type, list):
        return True
    return any(_holds_list(child) for child in spec.children)


def _packed_column(parts: list[PackedSequence], field: int) -> list[torch.Tensor]:
    """The per-replica values of tensor number `field` among the non-None
    fields of the replicas' PackedSequences `parts` (all of one form)."""
    return [[f for f in p if f is not None][field] for p in parts]


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
      row per replica, as is one of the device count where fewer replicas
      run if its rows all repeat the first (rule 3b). Any other disagreement is a ValueError naming both
      pytree paths and sizes (never a silent truncation).
    * A :class:`Samples` list is split between its samples (each replica
      gets consecutive samples, their tensors moved whole to its device) and
      a PackedSequence between its whole sequences (each replica gets a
      valid PackedSequence of its sequences, see :mod:`dpcore._packed`);
      their counts are the batch, which every other batched input must
      have (ValueError naming both otherwise).
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
    scattered, _ = scatter_with_hints(inputs, kwargs, devices, dim, chunk_sizes, weights)
    return scattered


def scatter_with_hints(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[Scattered, GatherHints]:
    """:func:`scatter_kwargs`, with the :class:`GatherHints` for the gather of
    the call's outputs (what DataParallel's scatter keeps for its gather)."""
    devs = _nonempty_device_list(devices, "devices")
    chunk_sizes, weights = check_split(chunk_sizes, weights, len(devs))  # the one check of the call
    if inputs is None:
        inputs = ()
    elif not isinstance(inputs, tuple) or is_namedtuple(inputs):
        inputs = (inputs,)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs: expected a mapping of keyword arguments, but got {type(kwargs).__name__}")
    (args, kws), sizes, used, hints = _split_trees(
        [(tuple(inputs), "inputs"), (kwargs, "kwargs")], devs, dim, chunk_sizes, weights, [0]
    )
    return Scattered(args, kws, sizes, used), hints


def image_list_model(module: torch.nn.Module) -> str | None:
    """The class name of `module` where it is a torchvision detection model
    (it holds torchvision's ``GeneralizedRCNNTransform``, which batches a
    list of per-image ``[C, H, W]`` tensors itself), else None."""
    for m in module.modules():
        t = type(m)
        if t.__name__ == "GeneralizedRCNNTransform" and t.__module__.startswith("torchvision."):
            return type(module).__name__
    return None


def check_image_lists(model: str, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """ValueError naming dpcore.Samples where the images or the targets of
    the torchvision detection model `model` (its ``forward(images,
    targets=None)``) are a plain list or tuple: whatever the images' sizes,
    torch's rule would split every image along its channels."""
    for index, name in enumerate(("images", "targets")):
        path, value = (
            (f"inputs[{index}]", inputs[index]) if len(inputs) > index else (f"kwargs[{name!r}]", kwargs.get(name))
        )
        if isinstance(value, (list, tuple)) and not is_namedtuple(value):
            raise ValueError(
                f"{path} is a plain {type(value).__name__} of {name} given to {model}, a torchvision detection model, "
                f"which takes one [C, H, W] tensor (and one target dict) per image: wrap it in "
                f"dpcore.Samples({name}) so that each replica gets whole images; a plain list is split inside every "
                f"image, along its channels, as torch.nn.DataParallel splits it"
            )


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
    devs = _nonempty_device_list(target_gpus, "target_gpus")
    (values,), _, _, _ = _split_trees([(inputs, "inputs")], devs, dim, None, None, list(range(len(devs))))
    return tuple(values) if isinstance(inputs, torch.Tensor) else values


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
    * PackedSequences are joined into one holding every replica's
      sequences, in replica order (the batch's original order), on
      ``target_device``, in the stable longest-first order (DataParallel
      uses the order of its PackedSequence input instead, so an RNN's output
      equals the one-device output field by field; see dpcore._packed).

    DataParallel gathers with :func:`gather_with_hints`, which also joins
    the lists of a call with a :class:`Samples` input by concatenation.
    """
    return gather_with_hints(outputs, target_device, dim, NO_HINTS)


def gather_with_hints(outputs: Sequence[Any], target_device: DeviceLike | None, dim: int, hints: GatherHints) -> Any:
    """:func:`gather`, with the :class:`GatherHints` the scatter of the call
    gave: where ``hints.samples`` (the call had a :class:`Samples` input),
    every ``list`` holds one entry per sample and is joined by concatenation
    in replica order, its entries untouched but for their tensors, each
    moved to ``target_device``; other containers are merged as gather merges
    them (a tuple of lists: each list concatenated). A PackedSequence output
    whose sequences have the lengths of a PackedSequence input of the call
    (``hints.packed``) is joined in that input's order, and a tensor that
    is the replicas' packed data of such an input (``hints.rows``) in the
    batch's packed order (the rule: :func:`dpcore._packed.data_rows`)."""
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, Sequence):
        raise TypeError(f"outputs: expected a sequence with one output per replica, but got {type(outputs).__name__}")
    values = list(outputs)
    if not values:
        raise ValueError("outputs: expected at least one replica's output, but got none")
    return gather_outputs(values, target_device, dim, hints)
