"""``torch.cuda.comm``'s collectives (names, arguments, ``out=`` forms) on CUDA and CPU device
lists (``["cpu"] * 4``), repeats allowed; an int device is a CUDA index. Calls run in C++ without
the GIL; results carry no autograd history. broadcast's result for the source's device is the
source, scatter's chunks for it are views: every other result owns its memory (and version
counter). Misuse raises RuntimeError (TypeError/ValueError for a wrong kind of argument) naming
the argument, the index and what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_destination, as_devices, tensor_list
from dpcore._split import as_int_list

__all__ = ["broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter", "gather"]

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
) -> list[torch.Tensor]:
    """``result[i] = sum_k inputs[k][i]``, where ``inputs[k]`` holds device k's tensors (same
    shapes and dtypes in every list); dense tensors travel in buckets of about ``buffer_size``."""
    if isinstance(inputs, torch.Tensor):
        raise TypeError("inputs: expected a sequence of lists of tensors, but got a tensor")
    lists = [tensor_list(group, f"inputs[{k}]") for k, group in enumerate(inputs)]
    return _C.reduce_add_coalesced(lists, as_destination(destination), buffer_size)


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
