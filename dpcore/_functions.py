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
* The coalesced broadcasts of parameters (:class:`BroadcastBucket`,
  :class:`BroadcastCoalesced`) sum in backward only the gradients that
  exist: a copy that nothing used contributes nothing, and a source none of
  whose copies was used gets no gradient at all (None), so an unused
  parameter keeps ``.grad`` None, as on one device.

With no input requiring grad (or under ``torch.no_grad()``) ``apply``
returns plain tensors without autograd history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpcore import comm
from dpcore._devices import DeviceLike, as_devices, tensor_list

__all__ = [
    "Scatter",
    "Gather",
    "BroadcastTensor",
    "BroadcastCoalesced",
    "ReduceAddCoalesced",
    "BroadcastBucket",
    "reduce_present",
]


class Function(torch.autograd.Function):
    """``torch.autograd.Function`` whose ``apply`` takes positional arguments
    only and, outside functorch transforms, goes straight to autograd's C++
    ``apply``: torch's binds the arguments with ``inspect.signature`` at every
    call of a Function that defines ``setup_context``. Under a transform
    (``torch.func``) it is torch's ``apply``."""

    @classmethod
    def apply(cls, *args: Any) -> Any:  # type: ignore[override]
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)  # torch._C._FunctionBase.apply


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
        devices: Sequence[DeviceLike], chunk_sizes: Sequence[int], dim: int, input: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return comm.scatter(input, as_devices(devices, "devices"), chunk_sizes, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dim, ctx.input_device = inputs[2], inputs[3].device

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
    def forward(destination: DeviceLike | None, dim: int, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not inputs:
            raise ValueError("Gather: expected at least one tensor to gather, but got none")
        tensor_list(inputs, "inputs")
        if all(t.dim() == 0 for t in inputs):
            return comm.gather([t.view(1) for t in inputs], 0, destination)
        return comm.gather(inputs, dim, destination)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = inputs[2:]
        ctx.input_devices = [t.device for t in tensors]
        ctx.unsqueezed_scalars = all(t.dim() == 0 for t in tensors)
        ctx.dim = 0 if ctx.unsqueezed_scalars else inputs[1]
        ctx.input_sizes = [1 if ctx.unsqueezed_scalars else t.size(ctx.dim) for t in tensors]

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
    def forward(devices: Sequence[DeviceLike], input: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(comm.broadcast(input, as_devices(devices, "devices")))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.input_device = inputs[1].device

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            total = grad_outputs[0].to(ctx.input_device)
            for g in grad_outputs[1:]:
                total = total + g.to(ctx.input_device)
        else:
            total = comm.reduce_add(list(grad_outputs), ctx.input_device)
        return None, total


def _split_lists(flat: Sequence[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """[a0, b0, a1, b1] with size 2 -> [[a0, b0], [a1, b1]]."""
    return [list(flat[i : i + size]) for i in range(0, len(flat), size)]


class ReduceAddCoalesced(Function):
    """Differentiable ``comm.reduce_add_coalesced``: the gradient path of the
    parameter broadcasts.

    ``ReduceAddCoalesced.apply(destination, num_inputs, *grads)`` takes K lists
    of ``num_inputs`` tensors, flattened one after another (list k on one
    device), and returns ``num_inputs`` sums on ``destination``. Its backward
    broadcasts the output gradients back to the K source devices with
    :class:`BroadcastCoalesced`, so double backward works.
    """

    @staticmethod
    def forward(destination: torch.device, num_inputs: int, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(comm.reduce_add_coalesced(_split_lists(grads, num_inputs), destination))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.source_devices = [group[0].device for group in _split_lists(inputs[2:], inputs[1])]

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        return (None, None) + BroadcastCoalesced.apply(ctx.source_devices, *grad_outputs)


class BroadcastCoalesced(Function):
    """Differentiable ``comm.broadcast_coalesced`` onto fresh memory.

    ``BroadcastCoalesced.apply(devices, *inputs)`` returns, for every device
    of ``devices`` in order, a copy of every input (flattened: device 0's
    copies first). Each copy owns its memory, also when its device is the
    inputs' own. Backward sums the copies' gradients onto the inputs' device
    with :class:`ReduceAddCoalesced` (see :func:`reduce_present`: an input
    none of whose copies was used gets None).
    """

    @staticmethod
    def forward(devices: Sequence[torch.device], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        copies = comm.broadcast_coalesced(list(inputs), [inputs[0].device, *devices])[1:]
        return tuple(t for group in copies for t in group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _set_up_copies(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None,) + reduce_present(ctx.input_device, ctx.num_inputs, grads)


class BroadcastBucket(Function):
    """One bucket of parameters onto the persistent buffers of cached replicas.

    ``BroadcastBucket.apply(replicas, *params)``, with ``replicas`` a
    ``dpcore._C.ReplicaBuffers`` built for these parameters (one bucket of a
    ``dpcore._C.ReplicaSet``), refreshes its per-device buffers (skipping the
    copy when nothing changed) and returns fresh tensors viewing them, device
    by device, as BroadcastCoalesced does.
    Each bucket is its own autograd node, so its gradients are reduced onto
    the master as soon as they all exist, while backward goes on elsewhere.

    Backward (see :func:`reduce_present`) returns for each master parameter
    the sum of the gradients of the replica copies that were used, and None
    for a parameter no replica copy was used by: then, where replica 0 (the
    master module itself) did not use it either, its ``.grad`` stays as it
    was (None, or the gradient accumulated so far), as on one device.
    """

    @staticmethod
    def forward(replicas: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(replicas.refresh(list(params)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _set_up_copies(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None,) + reduce_present(ctx.input_device, ctx.num_inputs, grads)


def reduce_present(
    destination: torch.device, num_inputs: int, grads: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    """The backward of a coalesced broadcast whose gradients may be missing.

    ``grads`` holds K lists of ``num_inputs`` gradients, one list per copy
    device, flattened one after another, with None for a copy that received
    no gradient (``ctx.set_materialize_grads(False)``). Returns
    ``num_inputs`` results on ``destination``:

    * input j's result is the sum of the present gradients of its K copies,
      or None when none of them is present;
    * the sums go through :class:`ReduceAddCoalesced` (one C++
      ``comm.reduce_add_coalesced`` call, differentiable for double
      backward) over the inputs that have a gradient and the devices that
      hold one of them; a missing gradient among those is a zero tensor of
      its device (only where another copy of the same input has one).

    When every gradient is present (the usual step) this is exactly one
    ReduceAddCoalesced over all of them.
    """
    if all(g is not None for g in grads):
        return ReduceAddCoalesced.apply(destination, num_inputs, *grads)
    lists = _split_lists(grads, num_inputs)
    used = [j for j in range(num_inputs) if any(group[j] is not None for group in lists)]
    results: list[torch.Tensor | None] = [None] * num_inputs
    if not used:
        return tuple(results)
    flat: list[torch.Tensor] = []
    for group in lists:
        present = next((g for g in group if g is not None), None)
        if present is None:
            continue  # this device used none of the inputs: it takes no part
        for j in used:
            g = group[j]
            if g is None:
                like = next(other[j] for other in lists if other[j] is not None)
                g = torch.zeros_like(like, device=present.device)
            flat.append(g)
    sums = ReduceAddCoalesced.apply(destination, len(used), *flat)
    for j, total in zip(used, sums):
        results[j] = total
    return tuple(results)


def _set_up_copies(ctx: Any, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """The context of a coalesced copy of `inputs`: missing gradients stay
    None, and the copies of inputs that do not require grad are marked
    non-differentiable."""
    ctx.set_materialize_grads(False)
    ctx.num_inputs = len(inputs)
    ctx.input_device = inputs[0].device
    frozen = [i for i, t in enumerate(inputs) if not t.requires_grad]
    if frozen:
        n = len(inputs)
        ctx.mark_non_differentiable(*[outputs[k] for k in range(len(outputs)) if k % n in frozen])
