"""PackedSequence split by whole sequences and joined back (private): the index arithmetic of both directions, on the
host (CPU int64 tensors). The rules: docs/samples.md and docs/design.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import PackedSequence

from dpcore._devices import DeviceLike, as_destination
from dpcore._functions import Gather, Scatter, apply


class Layout(NamedTuple):
    """The order of one PackedSequence: its sequences' ``lengths`` (original order) and ``sorted_indices`` (CPU int64);
    ``given_sorted`` False where it had ``sorted_indices=None``."""

    lengths: torch.Tensor
    sorted_indices: torch.Tensor
    given_sorted: bool


class Rows(NamedTuple):
    """One split PackedSequence: replica j holds ``rows[j]`` packed rows of ``sequences[j]`` sequences; ``order``: the
    batch's packed row of each of the replicas' rows concatenated in replica order (CPU int64), None for the identity;
    ``parts``: the (batch_sizes, sorted_indices, unsorted_indices) of each replica's part (the tensors it was given,
    None where not given); ``fields``: the input's own."""

    rows: tuple[int, ...]
    sequences: tuple[int, ...]
    order: torch.Tensor | None
    parts: tuple[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], ...] = ()
    fields: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None


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
    """`packed` cut into the PackedSequences of its next ``sizes[i]`` sequences on ``devices[i]`` (differentiably), its
    Layout and the parts' Rows."""
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
    out, fields = [], []
    for j, device in enumerate(devices):
        local_sizes = per_step[j][per_step[j] > 0]
        if not info.given_sorted:
            out.append(PackedSequence(parts[j], local_sizes, None, None))
            fields.append((local_sizes, None, None))
            continue
        mine = info.sorted_indices[owner_of_sequence[info.sorted_indices] == j] - starts[j]
        fields.append((local_sizes, mine.to(device), _inverse(mine).to(device)))
        out.append(PackedSequence(parts[j], *fields[-1]))
    whole = (packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    return out, info, Rows(tuple(rows), tuple(sizes), None if _is_identity(order) else order, tuple(fields), whole)


_FIELDS = ("batch_sizes", "sorted_indices", "unsorted_indices")


def _fits(parts: Sequence[torch.Tensor], counts: Sequence[int], dim: int) -> bool:
    """Whether part j has ``counts[j]`` rows along `dim`, for every j."""
    return len(parts) == len(counts) and all(
        -t.dim() <= dim < t.dim() and t.size(dim) == n for t, n in zip(parts, counts)
    )


def _field_of(parts: Sequence[torch.Tensor], split: Rows) -> list[tuple[str, torch.Tensor]]:
    """(name, the input's field) of the field that every part is (the replica's own tensor, as an RNN's output passes it
    on), else of each field that every part equals in value."""
    if len(parts) != len(split.parts) or split.fields is None:
        return []
    if not all(t.dim() == 1 and t.dtype == torch.int64 for t in parts):
        return []
    given = [(name, [fields[i] for fields in split.parts], split.fields[i]) for i, name in enumerate(_FIELDS)]
    for name, mine, whole in given:
        if all(t is m for t, m in zip(parts, mine)):
            return [(name, whole)]
    return [
        (name, whole)
        for name, mine, whole in given
        if all(m is not None and torch.equal(_cpu_long(t), _cpu_long(m)) for t, m in zip(parts, mine))
    ]


def recombine(
    parts: Sequence[torch.Tensor], splits: Sequence[Rows], dim: int, destination: DeviceLike | None
) -> torch.Tensor | None:
    """The replicas' tensors `parts` of one output of a call whose PackedSequence inputs were split as `splits`, as the
    module returns it for the whole batch: a field of each replica's PackedSequence (batch_sizes, sorted_indices,
    unsorted_indices) as the input's; packed data (each replica's packed rows along dim 0) in the batch's packed order.
    None where it is gathered as any output: 0-dim (stacked), or one row per sequence along `dim`. ValueError where none
    of these fits, or where two fit that differ."""
    if all(t.dim() == 0 for t in parts):
        return None
    fields = [found for split in splits for found in _field_of(parts, split)]
    if fields:
        name, field = fields[0]
        other = next(((n, f) for n, f in fields if not torch.equal(f.cpu(), field.cpu())), None)
        if other is not None:
            raise ValueError(
                f"on every replica it equals both the {name} and the {other[0]} of the replica's part of a "
                f"PackedSequence input, which differ for the whole batch; return the PackedSequence itself, or pass "
                f"gather=False to get each replica's output"
            )
        target = as_destination(destination)
        return field if name == "batch_sizes" or target is None else field.to(target)  # batch_sizes: on the CPU
    for split in splits:
        if not _fits(parts, split.rows, 0):
            continue
        if not _fits(parts, split.sequences, dim):
            return None if split.order is None and dim in (0, -parts[0].dim()) else join_rows(parts, split, destination)
        if dim not in (0, -parts[0].dim()) or split.order is None:
            return None
        raise ValueError(
            "on every replica it has one row per sequence, which is also one row per packed row of the "
            "PackedSequence input: every sequence of this batch has length 1 and the batch's packed order "
            "(its sorted_indices) is not the order of its sequences, so packed data (put back in the packed "
            "order) cannot be told from one row per sequence (kept in order). Return packed data as a "
            "PackedSequence (with the input's batch_sizes, sorted_indices and unsorted_indices), or pass "
            "gather=False to get each replica's output"
        )
    if any(_fits(parts, split.sequences, dim) for split in splits):
        return None
    shapes = [list(t.shape) for t in parts]
    sequences = [list(s.sequences) for s in splits]
    packed_rows = [list(s.rows) for s in splits]
    raise ValueError(
        f"its shapes on the replicas are {shapes}: neither one row per sequence along dim {dim} (the replicas' "
        f"sequences {sequences[0] if len(splits) == 1 else sequences}), nor packed data (their packed rows "
        f"{packed_rows[0] if len(splits) == 1 else packed_rows} along dim 0), nor the batch_sizes, sorted_indices "
        f"or unsorted_indices of their parts of the PackedSequence input. The outputs of a call with a "
        f"PackedSequence input are recombined into what the module returns for the whole batch, and this one "
        f"cannot be: return it as a PackedSequence or with one row per sequence, or pass gather=False to get "
        f"each replica's output"
    )


def join_rows(parts: Sequence[torch.Tensor], rows: Rows, destination: DeviceLike | None) -> torch.Tensor:
    """The replicas' packed data `parts` as one tensor in the batch's packed order, differentiably."""
    gathered = apply(Gather, destination, 0, *parts)
    if rows.order is None:
        return gathered
    return gathered.index_select(0, _inverse(rows.order).to(gathered.device))


def join(
    packs: Sequence[PackedSequence], destination: DeviceLike | None, layouts: Sequence[Layout] = ()
) -> PackedSequence:
    """One PackedSequence of the sequences of `packs` on `destination`, sorted as the first of `layouts` with their
    lengths, else stably longest first."""
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
