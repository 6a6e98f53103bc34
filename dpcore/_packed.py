"""PackedSequence split by whole sequences and joined back (private): the index arithmetic is _C's
(csrc/dpcore/packed.h), the rows move by one index_select and one Scatter or Gather. The rules: docs/samples.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import PackedSequence

from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_destination
from dpcore._functions import Gather, Scatter, apply

Fields = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # batch_sizes, sorted_, unsorted_indices
_FIELDS = ("batch_sizes", "sorted_indices", "unsorted_indices")


# The order of one PackedSequence, as _C.packed_split gives it and _C.packed_join reads it: its sequences' lengths
# (original order), its sorted_indices (CPU int64) and whether it had them (False where sorted_indices=None).
Layout = tuple[torch.Tensor, torch.Tensor, bool]


class Rows(NamedTuple):
    """One split PackedSequence: replica j holds ``rows[j]`` packed rows of ``sequences[j]`` sequences; ``back``: the
    row among the replicas' rows concatenated of each of the batch's packed rows (CPU int64), None for the identity;
    ``parts``: the Fields each replica's part was given; ``fields``: the input's own."""

    rows: tuple[int, ...]
    sequences: tuple[int, ...]
    back: torch.Tensor | None
    parts: tuple[Fields, ...] = ()
    fields: Fields | None = None


def sequences(packed: PackedSequence) -> int:
    """How many sequences `packed` holds."""
    return int(packed.batch_sizes[0]) if packed.batch_sizes.numel() else 0


def _to(fields: Fields, device: torch.device) -> Fields:
    return (fields[0], *(None if t is None else t.to(device) for t in fields[1:]))  # type: ignore[return-value]


def split(
    packed: PackedSequence, sizes: Sequence[int], devices: Sequence[torch.device]
) -> tuple[list[PackedSequence], Layout, Rows]:
    """`packed` cut into the PackedSequences of its next ``sizes[i]`` sequences on ``devices[i]`` (differentiably), its
    Layout and the parts' Rows."""
    layout, order, back, rows, parts = _C.packed_split(packed.batch_sizes, packed.sorted_indices, list(sizes))
    data = packed.data.index_select(0, order.to(packed.data.device))  # each replica's rows, in its packed order
    fields = [_to(f, d) for f, d in zip(parts, devices)]
    out = [PackedSequence(t, *f) for t, f in zip(apply(Scatter, list(devices), rows, 0, data), fields)]
    whole = (packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    return out, layout, Rows(tuple(rows), tuple(sizes), back, tuple(fields), whole)


def recombine(
    parts: Sequence[torch.Tensor], splits: Sequence[Rows], dim: int, destination: DeviceLike | None
) -> torch.Tensor | None:
    """The replicas' tensors `parts` of one output of a call whose PackedSequence inputs were split as `splits`, as the
    module returns it for the whole batch: a field of each replica's PackedSequence (batch_sizes, sorted_indices,
    unsorted_indices) as the input's; packed data (each replica's packed rows along dim 0) in the batch's packed order.
    None where it is gathered as any output: 0-dim (stacked), or one row per sequence along `dim`. ValueError where none
    of these fits, or where two fit that differ (the rules: _C.packed_output)."""
    kind, k, field, other = _C.packed_output(list(parts), dim, list(splits))
    if kind == "field":
        whole, target = splits[k].fields[field], as_destination(destination)  # type: ignore[index]
        return whole if field == 0 or target is None else whole.to(target)  # batch_sizes: on the CPU
    if kind == "data":
        gathered, back = apply(Gather, destination, 0, *parts), splits[k].back
        return gathered if back is None else gathered.index_select(0, back.to(gathered.device))
    if kind == "fields_differ":
        raise ValueError(
            f"on every replica it equals both the {_FIELDS[field]} and the {_FIELDS[other]} of the replica's part of a "
            f"PackedSequence input, which differ for the whole batch; return the PackedSequence itself, or pass "
            f"gather=False to get each replica's output"
        )
    if kind == "length_one":
        raise ValueError(
            "on every replica it has one row per sequence, which is also one row per packed row of the PackedSequence "
            "input: every sequence of this batch has length 1 and the batch's packed order (its sorted_indices) is not "
            "the order of its sequences, so packed data (put back in the packed order) cannot be told from one row per "
            "sequence (kept in order). Return packed data as a PackedSequence (with the input's batch_sizes, "
            "sorted_indices and unsorted_indices), or pass gather=False to get each replica's output"
        )
    if kind == "unfit":
        sequences, rows = [list(s.sequences) for s in splits], [list(s.rows) for s in splits]
        raise ValueError(
            f"its shapes on the replicas are {[list(t.shape) for t in parts]}: neither one row per sequence along dim "
            f"{dim} (the replicas' sequences {sequences[0] if len(splits) == 1 else sequences}), nor packed data (their "
            f"packed rows {rows[0] if len(splits) == 1 else rows} along dim 0), nor the batch_sizes, sorted_indices or "
            f"unsorted_indices of their parts of the PackedSequence input. The outputs of a call with a PackedSequence "
            f"input are recombined into what the module returns for the whole batch, and this one cannot be: return it "
            f"as a PackedSequence or with one row per sequence, or pass gather=False to get each replica's output"
        )
    return None


def join(
    packs: Sequence[PackedSequence], destination: DeviceLike | None, layouts: Sequence[Layout] = ()
) -> PackedSequence:
    """One PackedSequence of the sequences of `packs` on `destination`, sorted as the first of `layouts` with their
    lengths, else stably longest first."""
    fields, source = _C.packed_join([p.batch_sizes for p in packs], [p.sorted_indices for p in packs], list(layouts))
    gathered = apply(Gather, destination, 0, *[p.data for p in packs])
    data = gathered.index_select(0, source.to(gathered.device))
    return PackedSequence(data, *_to(fields, data.device))
