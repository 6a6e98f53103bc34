"""Collectives between the devices of a list, mirroring ``torch.cuda.comm``.

Same names, arguments and ``out=`` forms as torch.cuda.comm, on CUDA device
lists and on CPU device lists (``["cpu"] * 4``), repeats allowed. An int
device is a CUDA index, as in torch. Each call runs in C++ with the GIL
released.

Guarantees common to every function here:

* They move data and are not differentiable: results carry no autograd
  history (dpcore.DataParallel differentiates through its own Functions).
* broadcast and broadcast_coalesced: the result for the first entry equal
  to the source's device is the source itself; every other result owns its
  memory, also when its device repeats the source's.
* scatter: every chunk bound for the source's own device is a view of the
  source (chunks are disjoint, so no two results share elements); chunks
  for other devices are copies.
* Results of the coalesced forms each have their own version counter: an
  in-place change of one does not bump another's ``_version``.
* Misuse raises RuntimeError (or TypeError/ValueError for a wrong kind of
  argument) naming the argument, the index and what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_destination, as_devices, tensor_list
from dpcore._split import as_int_list

__all__ = [
    "broadcast",
    "broadcast_coalesced",
    "reduce_add",
    "reduce_add_coalesced",
    "scatter",
    "gather",
]

#: Default bucket size of the coalesced collectives (10 MiB, the C++ core's
#: kDefaultBucketBytes): torch.cuda.comm's default buffer_size, so that calls
#: ported from torch coalesce alike (DataParallel's replicas use smaller ones:
#: see replicate.DEFAULT_BUCKET_BYTES).
DEFAULT_BUFFER_SIZE: int = _C.default_bucket_bytes


def broadcast(
    tensor: torch.Tensor,
    devices: Sequence[DeviceLike] | None = None,
    *,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Copies ``tensor`` to every device of ``devices``, or into every tensor of ``out``.

    Exactly one of ``devices`` and ``out`` is given. Returns one tensor per
    device (or ``out`` itself): the first entry on the source's device is
    ``tensor`` itself, the others are new tensors equal to it.
    """
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
    """Broadcasts a list of tensors, all on ``devices[0]``, in buckets of one
    dtype of about ``buffer_size`` bytes.

    Returns ``result[d][i]``, tensors[i] on devices[d]: ``result[0]`` holds
    the inputs themselves, in input order for any mix of dtypes; sparse
    tensors are copied one by one.
    """
    return _C.broadcast_coalesced(tensor_list(tensors, "tensors"), as_devices(devices, "devices"), buffer_size)


def reduce_add(inputs: Sequence[torch.Tensor], destination: DeviceLike | None = None) -> torch.Tensor:
    """Sums tensors of one shape and dtype (dense, or sparse COO) from any
    devices onto ``destination`` (None: the current device of their type; -1:
    the CPU). Always returns a new tensor; the inputs are not modified."""
    return _C.reduce_add(tensor_list(inputs, "inputs"), as_destination(destination))


def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]],
    destination: DeviceLike | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> list[torch.Tensor]:
    """Sums lists of tensors elementwise: ``result[i] = sum_k inputs[k][i]``.

    ``inputs[k]`` holds device k's tensors (all on one device); every list has
    the same shapes and dtypes. Dense tensors travel in buckets of about
    ``buffer_size`` bytes and are summed in one pass per bucket.
    """
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
    """Splits ``tensor`` along ``dim`` and moves chunk i to ``devices[i]``
    (on ``streams[i]`` where given), or copies the chunks into ``out``.

    Chunk sizes default to a balanced split (differing by at most one, every
    device used, empty chunks only when the dim is smaller than the device
    count); given, they are ints (TypeError naming ``chunk_sizes[i]`` for a
    float, a str or a bool: never truncated), one per device, non-negative
    and summing to the dim's size (RuntimeError otherwise, as torch). A
    chunk for the tensor's own device is a view of it; memory format is
    preserved. Dense (strided) tensors only. An ``out`` tensor sharing
    memory with ``tensor`` or with another ``out`` raises, naming both,
    before anything is written.
    """
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
    """Concatenates ``tensors`` along ``dim`` onto ``destination`` (None: the
    current device of their type; -1 or "cpu": the CPU), or into ``out``.

    Returns a new tensor (or ``out``); channels_last is kept when every input
    has it. Dense (strided) tensors only. An ``out`` sharing memory with an
    input raises, naming it, before anything is written (as torch.cat(out=));
    non-dense views whose overlap with ``out`` cannot be decided cheaply are
    read from copies, so the result is right either way.
    """
    tensors = tensor_list(tensors, "tensors")
    if out is not None:
        if destination is not None:
            raise RuntimeError(f"gather: 'destination' must not be specified when 'out' is, but got {destination!r}")
        _C.gather_out(tensors, out, dim)
        return out
    return _C.gather(tensors, dim, as_destination(destination))
