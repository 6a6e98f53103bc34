"""Autograd Functions over dpcore.comm.

The collectives in :mod:`dpcore.comm` move data and carry no autograd
history; these Functions make them differentiable, with the contract of
``torch.nn.parallel._functions`` (same argument order), on CUDA and CPU
device lists alike:

* :class:`Scatter` and :class:`Gather` are each other's backward, so first
  and higher-order gradients (double backward) flow through them.
* :class:`BroadcastTensor` copies one tensor to several devices; its
  backward sums the gradients back onto the source's device (differentiably
  under ``create_graph=True``).

With no input requiring grad (or under ``torch.no_grad()``) ``apply``
returns plain tensors without autograd history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

from dpcore import comm
from dpcore._devices import DeviceLike, as_devices, tensor_list

__all__ = ["Scatter", "Gather", "BroadcastTensor"]


class Scatter(Function):
    """Differentiable ``comm.scatter``.

    ``Scatter.apply(devices, chunk_sizes, dim, input) -> tuple[Tensor, ...]``

    Guarantees:

    * Output i is the i-th chunk of ``input`` along ``dim`` (sizes
      ``chunk_sizes``, which must sum to ``input.size(dim)``; a 0 gives an
      empty chunk) on ``devices[i]``; a chunk for ``input``'s own device is
      a view of ``input`` (as in torch, such a view cannot be modified in
      place while ``input`` requires grad).
    * Backward gathers the output gradients along ``dim`` onto
      ``input.device`` with :class:`Gather`, so it is itself differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        devices: Sequence[DeviceLike],
        chunk_sizes: Sequence[int],
        dim: int,
        input: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.dim = dim
        ctx.input_device = input.device
        return comm.scatter(input, as_devices(devices, "devices"), [int(s) for s in chunk_sizes], dim)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        return None, None, None, Gather.apply(ctx.input_device, ctx.dim, *grad_outputs)


class Gather(Function):
    """Differentiable ``comm.gather``.

    ``Gather.apply(destination, dim, *inputs) -> Tensor``

    Guarantees:

    * Returns a new tensor on ``destination``: the concatenation of
      ``inputs`` along ``dim``.
    * If every input is 0-dim (per-replica scalars such as losses), they are
      stacked into a 1-D tensor of ``len(inputs)`` elements, whatever
      ``dim`` is, and without a warning (torch warns here every step).
    * Backward scatters the gradient back to each input's device with
      :class:`Scatter` (each input's gradient has its shape: 0-dim inputs get
      0-dim gradients), so it is itself differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        destination: DeviceLike | None,
        dim: int,
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        if not inputs:
            raise ValueError("Gather: expected at least one tensor to gather, but got none")
        tensor_list(inputs, "inputs")
        ctx.input_devices = [t.device for t in inputs]
        ctx.unsqueezed_scalars = all(t.dim() == 0 for t in inputs)
        if ctx.unsqueezed_scalars:
            inputs = tuple(t.view(1) for t in inputs)
            dim = 0
        ctx.dim = dim
        ctx.input_sizes = [t.size(dim) for t in inputs]
        return comm.gather(inputs, dim, destination)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grads = Scatter.apply(ctx.input_devices, ctx.input_sizes, ctx.dim, grad_output)
        if ctx.unsqueezed_scalars:
            grads = tuple(g.view(()) for g in grads)
        return (None, None) + tuple(grads)


class BroadcastTensor(Function):
    """Differentiable ``comm.broadcast`` of one tensor.

    ``BroadcastTensor.apply(devices, input) -> tuple[Tensor, ...]``

    Guarantees:

    * Output i equals ``input`` and lies on ``devices[i]``; the first output
      on ``input``'s own device shares its memory (autograd hands out an
      alias of ``input``, not ``input`` itself, when input requires grad);
      every other output owns its memory.
    * Backward sums the output gradients onto ``input.device``: in C++
      (``comm.reduce_add``) normally, with differentiable tensor ops under
      ``create_graph=True`` so that double backward works.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        devices: Sequence[DeviceLike],
        input: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.input_device = input.device
        return tuple(comm.broadcast(input, as_devices(devices, "devices")))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            total = grad_outputs[0].to(ctx.input_device)
            for g in grad_outputs[1:]:
                total = total + g.to(ctx.input_device)
        else:
            total = comm.reduce_add(list(grad_outputs), ctx.input_device)
        return None, total
