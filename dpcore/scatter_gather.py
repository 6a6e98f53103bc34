"""Scatter of inputs and gather of outputs for data parallelism, over pytrees: tensors through the
differentiable Scatter and Gather, containers rebuilt with their own type, errors naming the
pytree path of the value (``inputs[1]['mask']``, ``output['logits'][0]``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.nn.utils.rnn import PackedSequence

from dpcore import _packed
from dpcore import _pytree as pt
from dpcore import comm
from dpcore._devices import DeviceLike, as_devices, normalize_device
from dpcore._functions import BroadcastTensor, Scatter, apply
from dpcore._gather import NO_HINTS, GatherHints, gather_outputs
from dpcore._markers import Broadcast, Samples, is_namedtuple
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


class Scattered(NamedTuple):
    """What :func:`scatter_kwargs` returns: one entry per replica in each list."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    sizes: list[int]
    device_indices: list[int]


def _broadcast_tensor(tensor: torch.Tensor, devices: list[torch.device]) -> list[torch.Tensor]:
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return list(comm.broadcast(tensor, devices))
    outs = list(apply(BroadcastTensor, devices, tensor))
    source = normalize_device(tensor.device)
    if source in devices:
        outs[devices.index(source)] = tensor  # the source replica gets the object itself
    return outs


def _batch_size(path: Any, t: torch.Tensor, dim: int) -> int | None:
    """The size of `t` along `dim` (None when 0-dim); ValueError where it cannot be split so."""
    if t.layout != torch.strided:
        raise ValueError(
            f"{path} is a {t.layout} tensor and cannot be split: DataParallel splits dense (strided) "
            f"tensors only; wrap it in dpcore.Broadcast to pass it whole to every replica"
        )
    if t.dim() == 0:
        return None
    if not -t.dim() <= dim < t.dim():
        raise ValueError(
            f"{path} has {t.dim()} dimensions and cannot be split along dim {dim} "
            f"(expected dim in [{-t.dim()}, {t.dim() - 1}])"
        )
    return t.size(dim)


def _nonempty_device_list(devices: Sequence[DeviceLike], arg: str) -> list[torch.device]:
    if not (devs := as_devices(devices, arg)):
        raise ValueError(f"{arg}: expected at least one device, but got an empty list")
    return devs


def _split_trees(
    trees: Sequence[tuple[Any, str]],
    devices: list[torch.device],
    dim: int,
    chunk_sizes: Sequence[int] | None,
    weights: Sequence[float] | None,
    without_tensors: list[int],
    lone_as_is: bool = False,
) -> tuple[list[list[Any]], list[int], list[int], GatherHints]:
    """Per (tree, path) of `trees` its value per replica (each tree flattened once), the replicas' sizes
    and device indices (`without_tensors` where no tensor is split), and the hints for the gather. With
    `lone_as_is`, a tensor a lone replica takes whole on its own device is passed as is, not as a view."""
    flats = [pt.flatten_marked(tree) for tree, _ in trees]
    leaves: list[tuple[Any, torch.Tensor]] = []  # (path, tensor) of the tensors to split along dim
    units: list[tuple[Any, int, str]] = []  # (path, count, noun) of the inputs split between samples
    # Per tree, tensor index -> ("sample", sample number) / ("packed", PackedSequence number, field)
    # / ("keep",) for the batch_sizes of a PackedSequence inside a marker / ("whole",) inside a Broadcast
    special: list[dict[int, tuple[Any, ...]]] = []
    packs: list[PackedSequence] = []
    for (tree, path), (tensors, spec, m) in zip(trees, flats):
        if m.misplaced:
            node, outer = m.misplaced[0]
            what = "dpcore.Samples" if node.kind is pt.SAMPLES else "dpcore.Broadcast"
            around = (
                "a dpcore.Samples list (a sample goes whole to one replica)"
                if outer is pt.SAMPLES
                else "dpcore.Broadcast"
            )
            raise TypeError(
                f"{pt.lazy_path(tree, spec, node, path)} is a {what} inside {around}: a marker says how a whole "
                f"argument is passed, so markers cannot be nested"
            )
        tags: dict[int, tuple[Any, ...]] = {i: ("whole",) for start, end in m.broadcast for i in range(start, end)}
        for node, start in m.samples:
            units.append((pt.lazy_path(tree, spec, node, path), len(node.children), "samples"))
            for number, child in enumerate(node.children):  # every Samples list of the call numbered from 0
                tags.update((i, ("sample", number)) for i in range(start, start + child.num_tensors))
                start += child.num_tensors
        for node, start, inside in m.packed:
            if inside is None:
                packed = node.unflatten(tensors[start : start + node.num_tensors])
                units.append((pt.lazy_path(tree, spec, node, path), _packed.sequences(packed), "sequences"))
                tags.update((start + field, ("packed", len(packs), field)) for field in range(node.num_tensors))
                packs.append(packed)
            else:
                tags[start + node.children[0].num_tensors] = ("keep",)
        special.append(tags)
        leaves.extend((pt.lazy_path(tree, spec, i, path), t) for i, t in enumerate(tensors) if i not in tags)
    entries = [(path, _batch_size(path, t, dim)) for path, t in leaves]
    for (tree, path), (tensors, spec, m) in zip(trees, flats):
        for node, start in m.lists:
            _check_list(tree, spec, node, tensors, start, dim, path)
    hint = pt.Lazy(lambda: _SAMPLES_HINT if any(_holds_list(spec) for _, spec, _ in flats) else "")
    plan = plan_split(entries, len(devices), chunk_sizes, weights, dim, units, hint)
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
            if whole or t.dim() == 0:
                parts: Sequence[torch.Tensor] = _broadcast_tensor(t, used_devices)
            else:  # plan_split checked the size: the batch's, split by the plan, or one row per replica
                size = t.size(dim)
                if size != plan.batch and size != count:  # rule 3b: one row per device, fewer replicas
                    t = check_repeated_rows(t, dim, count, next((p for p, leaf in leaves if leaf is t), "a tensor"))
                if lone_as_is and count == 1 and size == plan.batch and normalize_device(t.device) == used_devices[0]:
                    parts = (t,)
                else:
                    parts = apply(Scatter, used_devices, used_sizes if size == plan.batch else [1] * count, dim, t)
            hit = memo[key] = (source, parts)  # the source kept alive: its id stays its own
        return hit[1]

    def column(t: torch.Tensor, tag: tuple[Any, ...] | None) -> Any:
        if tag is None or tag[0] == "whole":
            return per_replica(t, tag is not None)
        if tag[0] == "keep":
            return [t] * count
        if tag[0] == "sample":  # moved whole to its replica's device (differentiably; as is where it is)
            owner = owners[tag[1]]
            entries: list[Any] = [None] * count
            entries[owner] = t.to(used_devices[owner])
            return entries
        return [[f for f in part if f is not None][tag[2]] for part in split_packs[tag[1]][0]]

    values = []
    for (tree, path), (tensors, spec, _), tags in zip(trees, flats, special):
        columns = [column(t, tags.get(i)) for i, t in enumerate(tensors)]
        try:
            values.append(spec.unflatten_replicas(columns, count, used_sizes))
        except pt.RebuildError as e:
            raise TypeError(
                f"{pt.path_at(tree, spec.trail_to(e.node), path)} {e}; or wrap it in dpcore.Broadcast to pass it whole "
                f"to every replica"
            ) from e
    samples = any(noun == "samples" for _, _, noun in units)
    hints = GatherHints(samples, tuple(s[1] for s in split_packs), tuple(s[2] for s in split_packs), tuple(used_sizes))
    return values, used_sizes, used, hints


def _check_list(
    tree: Any, spec: pt.Spec, node: pt.Spec, tensors: list[torch.Tensor], start: int, dim: int, path: str
) -> None:
    """ValueError naming dpcore.Samples where two tensors of the list `node` have one rank and one
    size along `dim` but differ otherwise (samples, not a batch)."""
    seen: dict[int, torch.Tensor] = {}  # the first entry of each rank
    for child in node.children:
        if child is pt.TENSOR_SPEC and tensors[start].dim() > 0:
            t = tensors[start]
            other = seen.setdefault(t.dim(), t)
            if -t.dim() <= dim < t.dim() and t.size(dim) == other.size(dim) and t.shape != other.shape:
                raise ValueError(
                    f"{pt.lazy_path(tree, spec, node, path)} is a list of tensors of one size along dim {dim} whose "
                    f"shapes differ otherwise ({list(other.shape)} and {list(t.shape)}), so it is not one batch: a "
                    f"list of samples (images of different sizes) goes in dpcore.Samples(list), which splits it "
                    f"between samples, while torch.nn.DataParallel's rule would split every tensor of the list along "
                    f"dim {dim} (an image along its channels); pass batch tensors of different shapes as a tuple"
                )
        start += child.num_tensors


_SAMPLES_HINT = (
    "; a list with one entry per sample (images of different sizes, their target dicts) goes in "
    "dpcore.Samples(list), which splits it between samples"
)


def _holds_list(spec: pt.Spec) -> bool:
    """Whether a ``list`` holding tensors sits in the tree of `spec`, outside markers."""
    if spec.kind is pt.BROADCAST or spec.kind is pt.SAMPLES or not spec.num_tensors:
        return False
    if spec.kind is pt.NODE and issubclass(spec.type, list):
        return True
    return any(_holds_list(child) for child in spec.children)


def scatter_kwargs(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> Scattered:
    """Splits a call's positional arguments `inputs` (a tuple, None for none, else the one argument)
    and `kwargs` across `devices`: replica j is called as ``f(*args[j], **kwargs[j])`` on
    ``devices[device_indices[j]]`` with ``sizes[j]`` rows, only devices with rows get one (at least
    ``devices[0]``). Tensors outside Broadcast are split along `dim` (balanced, `chunk_sizes` or
    `weights`; the rules: docs/design.md), Samples and PackedSequences by whole samples, containers
    rebuilt per replica; other leaves are passed by reference."""
    scattered, _ = scatter_with_hints(inputs, kwargs, devices, dim, chunk_sizes, weights)
    return scattered


def scatter_with_hints(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    lone_as_is: bool = False,
) -> tuple[Scattered, GatherHints]:
    """:func:`scatter_kwargs`, with the :class:`GatherHints` for the gather of the call's outputs
    (`lone_as_is`: see :func:`_split_trees`)."""
    devs = _nonempty_device_list(devices, "devices")
    chunk_sizes, weights = check_split(chunk_sizes, weights, len(devs))  # the one check of the call
    inputs = () if inputs is None else inputs if isinstance(inputs, tuple) and not is_namedtuple(inputs) else (inputs,)
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs: expected a mapping of keyword arguments, but got {type(kwargs).__name__}")
    trees = [(tuple(inputs), "inputs"), (kwargs, "kwargs")]
    (args, kws), sizes, used, hints = _split_trees(trees, devs, dim, chunk_sizes, weights, [0], lone_as_is)
    return Scattered(args, kws, sizes, used), hints


def scatter(inputs: Any, target_gpus: Sequence[DeviceLike], dim: int = 0) -> Any:
    """Splits `inputs` across `target_gpus` (torch.nn.parallel.scatter's arguments) as
    :func:`scatter_kwargs` does: a tuple of chunks for a tensor, else one value per device with
    rows (every device without a tensor to split); sizes that do not fit one batch are an error."""
    devs = _nonempty_device_list(target_gpus, "target_gpus")
    (values,), _, _, _ = _split_trees([(inputs, "inputs")], devs, dim, None, None, list(range(len(devs))))
    return tuple(values) if isinstance(inputs, torch.Tensor) else values


def gather(outputs: Sequence[Any], target_device: DeviceLike | None, dim: int = 0) -> Any:
    """Merges the per-replica `outputs` (of one structure) into one (torch.nn.parallel.gather's
    arguments): tensors concatenated along `dim` onto `target_device`, differentiably (0-dim ones
    stacked), containers rebuilt with their own type, PackedSequences joined longest first, None
    kept where all are None and other leaves listed. Structures that differ are a ValueError
    naming the path and the replica."""
    return gather_with_hints(outputs, target_device, dim, NO_HINTS)


def gather_with_hints(outputs: Sequence[Any], target_device: DeviceLike | None, dim: int, hints: GatherHints) -> Any:
    """:func:`gather` with the hints of the call's scatter: after a Samples input, lists are
    concatenated; PackedSequences and packed data are put in the order of the input's."""
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, Sequence):
        raise TypeError(f"outputs: expected a sequence with one output per replica, but got {type(outputs).__name__}")
    values = list(outputs)
    if not values:
        raise ValueError("outputs: expected at least one replica's output, but got none")
    return gather_outputs(values, target_device, dim, hints)
