"""PackedSequence split by whole sequences and joined back (private): the index arithmetic of
both directions, on the host (CPU int64 tensors). The rules: docs/samples.md and docs/design.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import PackedSequence

from dpcore._devices import DeviceLike
from dpcore._functions import Gather, Scatter, apply


class Layout(NamedTuple):
    """The order of one PackedSequence: its sequences' ``lengths`` (original order) and
    ``sorted_indices`` (CPU int64); ``given_sorted`` False where it had ``sorted_indices=None``."""

    lengths: torch.Tensor
    sorted_indices: torch.Tensor
    given_sorted: bool


class Rows(NamedTuple):
    """One split PackedSequence: replica j holds ``rows[j]`` packed rows of ``sequences[j]``
    sequences; ``order``: the batch's packed row of each of the replicas' rows concatenated in
    replica order (CPU int64), None for the identity."""

    rows: tuple[int, ...]
    sequences: tuple[int, ...]
    order: torch.Tensor | None


def _cpu_long(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.int64)


def _row_times(batch_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(time step, sorted position) of every data row of a PackedSequence with these ``batch_sizes``."""
    steps = torch.arange(batch_sizes.numel(), dtype=torch.int64)
    times = torch.repeat_interleave(steps, batch_sizes)
    starts = torch.cumsum(batch_sizes, 0) - batch_sizes  # first row of each step
    return times, torch.arange(times.numel(), dtype=torch.int64) - starts[times]


def _above(values: torch.Tensor, count: int) -> torch.Tensor:
    """For each i < `count`, how many `values` exceed i (the sorted lengths of batch sizes, and back)."""
    return (values.unsqueeze(0) > torch.arange(count, dtype=torch.int64).unsqueeze(1)).sum(1)


def _is_identity(order: torch.Tensor) -> bool:
    return torch.equal(order, torch.arange(order.numel(), dtype=torch.int64))


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), dtype=permutation.dtype)
    return inverse


def sequences(packed: PackedSequence) -> int:
    """How many sequences `packed` holds."""
    return int(packed.batch_sizes[0]) if packed.batch_sizes.numel() else 0


def layout(packed: PackedSequence) -> Layout:
    """The Layout of `packed`."""
    count = sequences(packed)
    given = packed.sorted_indices is not None
    order = _cpu_long(packed.sorted_indices) if given else torch.arange(count, dtype=torch.int64)
    lengths = torch.empty(count, dtype=torch.int64)
    lengths[order] = _above(_cpu_long(packed.batch_sizes), count)
    return Layout(lengths, order, given)


def split(
    packed: PackedSequence, sizes: Sequence[int], devices: Sequence[torch.device]
) -> tuple[list[PackedSequence], Layout, Rows]:
    """`packed` cut into the PackedSequences of its next ``sizes[i]`` sequences on ``devices[i]``
    (differentiably), its Layout and the parts' Rows."""
    info = layout(packed)
    batch_sizes = _cpu_long(packed.batch_sizes)
    times, positions = _row_times(batch_sizes)
    bounds = torch.cumsum(torch.tensor(list(sizes), dtype=torch.int64), 0)
    owner_of_sequence = torch.bucketize(torch.arange(info.lengths.numel(), dtype=torch.int64), bounds, right=True)
    row_owner = owner_of_sequence[info.sorted_indices[positions]]
    order = torch.argsort(row_owner, stable=True)  # each replica's rows, in time-then-sorted order
    replicas = len(sizes)
    steps = batch_sizes.numel()
    per_step = torch.bincount(row_owner * steps + times, minlength=replicas * steps).view(replicas, steps)
    rows = per_step.sum(1).tolist()
    data = packed.data
    picked = data.index_select(0, order.to(data.device))
    parts = apply(Scatter, list(devices), rows, 0, picked)
    starts = [0, *bounds.tolist()[:-1]]
    out = []
    for j, device in enumerate(devices):
        local_sizes = per_step[j][per_step[j] > 0]
        if not info.given_sorted:
            out.append(PackedSequence(parts[j], local_sizes, None, None))
            continue
        mine = info.sorted_indices[owner_of_sequence[info.sorted_indices] == j] - starts[j]
        out.append(PackedSequence(parts[j], local_sizes, mine.to(device), _inverse(mine).to(device)))
    return out, info, Rows(tuple(rows), tuple(sizes), None if _is_identity(order) else order)


def data_rows(parts: Sequence[torch.Tensor], splits: Sequence[Rows], dim: int) -> Rows | None:
    """The Rows of the split whose packed data the replicas' outputs `parts` are (their dim-0
    sizes are its packed rows and their sizes along `dim` not its sequences), or None (gathered
    as any output); ValueError where both readings fit along dim 0 and the orders differ."""
    for split in splits:
        if len(parts) != len(split.rows) or not all(t.dim() > 0 and t.size(0) == r for t, r in zip(parts, split.rows)):
            continue
        along_rows = dim in (0, -parts[0].dim())  # the gather concatenates along dim 0 too
        if not all(-t.dim() <= dim < t.dim() and t.size(dim) == n for t, n in zip(parts, split.sequences)):
            return None if split.order is None and along_rows else split
        if not along_rows or split.order is None:
            return None
        raise ValueError(
            "on every replica it has one row per sequence, which is also one row per packed row of the "
            "PackedSequence input: every sequence of this batch has length 1 and the batch's packed order "
            "(its sorted_indices) is not the order of its sequences, so packed data (put back in the packed "
            "order) cannot be told from one row per sequence (kept in order). Return packed data as a "
            "PackedSequence (with the input's batch_sizes, sorted_indices and unsorted_indices), or pass "
            "gather=False to get each replica's output"
        )
    return None


def join_rows(parts: Sequence[torch.Tensor], rows: Rows, destination: DeviceLike | None) -> torch.Tensor:
    """The replicas' packed data `parts` as one tensor in the batch's packed order, differentiably."""
    gathered = apply(Gather, destination, 0, *parts)
    if rows.order is None:
        return gathered
    return gathered.index_select(0, _inverse(rows.order).to(gathered.device))


def join(
    packs: Sequence[PackedSequence], destination: DeviceLike | None, layouts: Sequence[Layout] = ()
) -> PackedSequence:
    """One PackedSequence of the sequences of `packs` on `destination`, sorted as the first of
    `layouts` with their lengths, else stably longest first."""
    lengths, sources = [], []
    offset = 0
    for pack in packs:
        info = layout(pack)
        lengths.append(info.lengths)
        times, positions = _row_times(_cpu_long(pack.batch_sizes))
        sources.append((times, info.sorted_indices[positions] + offset))  # (time, joined original index) per row
        offset += info.lengths.numel()
    all_lengths = torch.cat(lengths)
    match = next(
        (lay for lay in layouts if lay.lengths.shape == all_lengths.shape and torch.equal(lay.lengths, all_lengths)),
        None,
    )
    if match is not None:
        order, given = match.sorted_indices, match.given_sorted
    else:
        order = torch.sort(all_lengths, descending=True, stable=True).indices
        given = not (_is_identity(order) and all(p.sorted_indices is None for p in packs))
    steps = int(all_lengths.max()) if all_lengths.numel() else 0
    batch_sizes = _above(all_lengths, steps)
    step_starts = torch.cumsum(batch_sizes, 0) - batch_sizes
    position = _inverse(order)
    targets = torch.cat([step_starts[t] + position[i] for t, i in sources])  # joined row of each gathered row
    gathered = apply(Gather, destination, 0, *[p.data for p in packs])
    data = gathered.index_select(0, _inverse(targets).to(gathered.device))
    if not given:
        return PackedSequence(data, batch_sizes, None, None)
    return PackedSequence(data, batch_sizes, order.to(data.device), position.to(data.device))
