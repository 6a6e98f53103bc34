"""``torch.cuda.comm``'s collectives (names, arguments, ``out=`` forms) on CUDA and CPU device
lists (``["cpu"] * 4``), repeats allowed; an int device is a CUDA index. Calls run in C++ without
the GIL; results carry no autograd history. broadcast's result for the source's device is the
source, scatter's chunks for it are views: every other result owns its memory (and version
counter). Misuse raises RuntimeError (TypeError/ValueError for a wrong kind of argument) naming
the argument, the index and what was expected. The ring collectives (reduce_scatter, all_gather,
all_reduce and their coalesced forms) spread the traffic evenly over the devices; traffic() counts
the bytes every collective moved between the slots (positions) of its device list."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_destination, as_devices, tensor_list
from dpcore._split import as_int_list

__all__ = ["broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter", "gather"]
__all__ += ["reduce_scatter", "all_gather", "all_reduce", "reduce_scatter_coalesced", "all_gather_coalesced"]
__all__ += ["traffic", "reset_traffic"]

#: Bucket size of the coalesced collectives: torch.cuda.comm's default buffer_size.
DEFAULT_BUFFER_SIZE: int = _C.default_bucket_bytes


def broadcast(
    tensor: torch.Tensor,
    devices: Sequence[DeviceLike] | None = None,
    *,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Copies ``tensor`` to every device of ``devices``, or into every tensor of ``out`` (exactly
    one of the two); returns one tensor per device, or ``out``."""
    if (devices is None) == (out is None):
        raise RuntimeError(
            "broadcast: exactly one of 'devices' and 'out' must be specified, but got "
            f"devices={devices!r} and out={'None' if out is None else 'a list'}"
        )
    if out is not None:
        outs = tensor_list(out, "out")
        _C.broadcast_out(tensor, outs)
        return outs
    return _C.broadcast(tensor, as_devices(devices, "devices"))


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    devices: Sequence[DeviceLike],
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> list[list[torch.Tensor]]:
    """Broadcasts tensors, all on ``devices[0]``, in buckets of one dtype of about ``buffer_size``
    bytes; returns ``result[d][i]``, tensors[i] on devices[d] (``result[0]``: the inputs)."""
    return _C.broadcast_coalesced(tensor_list(tensors, "tensors"), as_devices(devices, "devices"), buffer_size)


def reduce_add(inputs: Sequence[torch.Tensor], destination: DeviceLike | None = None) -> torch.Tensor:
    """Sums tensors of one shape and dtype (dense or sparse COO) into a new tensor on
    ``destination`` (None: the current device of their type; -1: the CPU)."""
    return _C.reduce_add(tensor_list(inputs, "inputs"), as_destination(destination))


def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]],
    destination: DeviceLike | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    *,
    slots: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """``result[i] = sum_k inputs[k][i]``, where ``inputs[k]`` holds device k's tensors (same
    shapes and dtypes in every list); dense tensors travel in buckets of about ``buffer_size``.
    ``slots``: each list's position in the caller's device list, for traffic(), the destination's 0."""
    if isinstance(inputs, torch.Tensor):
        raise TypeError("inputs: expected a sequence of lists of tensors, but got a tensor")
    lists = [tensor_list(group, f"inputs[{k}]") for k, group in enumerate(inputs)]
    positions = None if slots is None else as_int_list(slots, "slots")
    return _C.reduce_add_coalesced(lists, as_destination(destination), buffer_size, positions)


def scatter(
    tensor: torch.Tensor,
    devices: Sequence[DeviceLike] | None = None,
    chunk_sizes: Sequence[int] | None = None,
    dim: int = 0,
    streams: Sequence[torch.Stream | None] | None = None,
    *,
    out: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Splits dense ``tensor`` along ``dim`` and moves chunk i to ``devices[i]`` (on ``streams[i]``
    where given), or copies the chunks into ``out`` (which must not overlap). Chunk sizes: balanced
    by default (differing by at most one), or ints (never truncated) summing to the dim's size."""
    stream_list = None if streams is None else list(streams)
    if out is None:
        if devices is None:
            raise RuntimeError("scatter: expected 'devices' when 'out' is not specified")
        sizes = None if chunk_sizes is None else as_int_list(chunk_sizes, "chunk_sizes")
        return tuple(_C.scatter(tensor, as_devices(devices, "devices"), sizes, dim, stream_list))
    if devices is not None:
        raise RuntimeError(f"scatter: 'devices' must not be specified when 'out' is, but got {devices!r}")
    if chunk_sizes is not None:
        raise RuntimeError(
            f"scatter: 'chunk_sizes' must not be specified when 'out' is (the outs' sizes give "
            f"them), but got {chunk_sizes!r}"
        )
    outs = tensor_list(out, "out")
    _C.scatter_out(tensor, outs, dim, stream_list)
    return tuple(outs)


def gather(
    tensors: Sequence[torch.Tensor],
    dim: int = 0,
    destination: DeviceLike | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Concatenates dense ``tensors`` along ``dim`` onto ``destination`` (None: the current device
    of their type; -1 or "cpu": the CPU), or into ``out`` (which must not overlap an input)."""
    tensors = tensor_list(tensors, "tensors")
    if out is not None:
        if destination is not None:
            raise RuntimeError(f"gather: 'destination' must not be specified when 'out' is, but got {destination!r}")
        _C.gather_out(tensors, out, dim)
        return out
    return _C.gather(tensors, dim, as_destination(destination))


def reduce_scatter(
    inputs: Sequence[torch.Tensor], devices: Sequence[DeviceLike], sizes: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Ring reduce-scatter: ``inputs[j]`` (on ``devices[j]``, one numel and dtype) summed; result[i], new
    on devices[i], is segment i of the flattened sum (``sizes`` elements each; default balanced), summed
    in ring order ``inputs[i+1] + ... + inputs[i]`` (indices mod N)."""
    sizes = None if sizes is None else as_int_list(sizes, "sizes")
    return _C.reduce_scatter(tensor_list(inputs, "inputs"), as_devices(devices, "devices"), sizes)


def all_gather(
    shards: Sequence[torch.Tensor],
    devices: Sequence[DeviceLike] | None = None,
    *,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Ring all-gather: the 1-D ``shards`` (shards[i] on devices[i]) concatenated onto every device, as new
    tensors, or into the flat ``out`` buffers (out[j] on shards[j]'s device; a shard that is already the
    view of its place in its out is not copied)."""
    shards = tensor_list(shards, "shards")
    if (devices is None) == (out is None):
        raise RuntimeError("all_gather: exactly one of 'devices' and 'out' must be specified")
    if out is None:
        return _C.all_gather(shards, as_devices(devices, "devices"))
    outs = tensor_list(out, "out")
    _C.all_gather_out(shards, outs)
    return outs


def all_reduce(inputs: Sequence[torch.Tensor], devices: Sequence[DeviceLike]) -> list[torch.Tensor]:
    """Ring all-reduce in place: every ``inputs[j]`` becomes the elementwise sum (bit-identical on every
    device; reduce_scatter's order); returns the inputs."""
    inputs = tensor_list(inputs, "inputs")
    _C.all_reduce(inputs, as_devices(devices, "devices"))
    return inputs


def reduce_scatter_coalesced(
    tensors: Sequence[Sequence[torch.Tensor]],
    devices: Sequence[DeviceLike],
    owners: Sequence[int],
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> list[torch.Tensor]:
    """``result[k] = sum_j tensors[j][k]`` on ``devices[owners[k]]``, where ``tensors[j]`` lists device j's
    tensors; bucketed per dtype (about ``buffer_size`` bytes), each owner's tensors one ring segment."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors: expected a sequence of lists of tensors, but got a tensor")
    lists = [tensor_list(group, f"tensors[{j}]") for j, group in enumerate(tensors)]
    return _C.reduce_scatter_coalesced(
        lists, as_devices(devices, "devices"), as_int_list(owners, "owners"), buffer_size
    )


def all_gather_coalesced(
    tensors: Sequence[torch.Tensor],
    owners: Sequence[int],
    devices: Sequence[DeviceLike],
    *,
    out: Sequence[Sequence[torch.Tensor]] | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> list[list[torch.Tensor]]:
    """``result[d][k]``: ``tensors[k]`` (on ``devices[owners[k]]``) on devices[d] (the owner's entry is
    tensors[k] itself), or written into ``out[d][k]`` (e.g. every replica's parameters), bucketed as
    reduce_scatter_coalesced."""
    outs = None if out is None else [tensor_list(group, f"out[{d}]") for d, group in enumerate(out)]
    owner_list = as_int_list(owners, "owners")
    return _C.all_gather_coalesced(
        tensor_list(tensors, "tensors"), owner_list, as_devices(devices, "devices"), outs, buffer_size
    )


def traffic() -> dict[str, list[tuple[int, int]]]:
    """Bytes moved since the last reset_traffic(): {kind: [(sent, received) per slot]}, for the kinds
    "broadcast" (the replica refresh included), "reduce_add", "scatter", "gather", "reduce_scatter" and
    "all_gather". A slot is a position in the collective's device list (docs/reference.md)."""
    return _C.traffic()


def reset_traffic() -> None:
    """Sets every traffic count to zero."""
    _C.reset_traffic()
