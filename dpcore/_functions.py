"""Autograd Functions over dpcore.comm with the contract of ``torch.nn.parallel._functions``, on CUDA and CPU device
lists alike; each backward is differentiable, and a missing gradient stays None."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpcore import comm
from dpcore._devices import DeviceLike, as_devices, tensor_list
from dpcore._loader import _C
from dpcore._split import as_int_list

__all__ = ["Scatter", "Gather", "BroadcastTensor", "BroadcastCoalesced", "ReduceAddCoalesced", "BroadcastBucket"]
__all__ += ["ShardedBucket"]
__all__ += ["reduce_present"]


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``. Outside functorch transforms and dynamo's tracing it goes straight to autograd's C++
    ``apply``: torch's binds the arguments with ``inspect.signature`` at every call of a Function that defines
    ``setup_context``, as dpcore's do."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)  # torch._C._FunctionBase.apply


class Scatter(torch.autograd.Function):
    """Differentiable ``comm.scatter``: ``Scatter.apply(devices, chunk_sizes, dim, input)``, output i the i-th chunk on
    ``devices[i]``, each its own tensor with its own version counter (a chunk on ``input``'s device shares its memory;
    views for a leaf that requires grad). Backward is :class:`Gather`."""

    @staticmethod
    def forward(  # type: ignore[override]
        devices: Sequence[DeviceLike], chunk_sizes: Sequence[int] | None, dim: int, input: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        sizes = None if chunk_sizes is None else as_int_list(chunk_sizes, "chunk_sizes")
        separate = not (input.is_leaf and input.requires_grad)
        return tuple(_C.scatter(input, as_devices(devices, "devices"), sizes, dim, None, separate))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dim, ctx.input_device = inputs[2], inputs[3].device

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        return None, None, None, apply(Gather, ctx.input_device, ctx.dim, *grad_outputs)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], devices: Any, chunk_sizes: Any, dim: int, input: torch.Tensor) -> Any:
        """torch.func.vmap's rule: the batch dimension first, the split along the one after `dim`."""
        if in_dims[3] is None:
            return apply(Scatter, devices, chunk_sizes, dim, input), (None,) * len(devices)
        chunks = apply(Scatter, devices, chunk_sizes, dim + 1 if dim >= 0 else dim, input.movedim(in_dims[3], 0))
        return chunks, (0,) * len(chunks)


class Gather(torch.autograd.Function):
    """Differentiable ``comm.gather``: ``Gather.apply(destination, dim, *inputs)``, a new tensor on ``destination``;
    0-dim inputs are stacked into a 1-D tensor without a warning. Backward is :class:`Scatter`."""

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
        grads = apply(Scatter, ctx.input_devices, ctx.input_sizes, ctx.dim, grad_output)
        if ctx.unsqueezed_scalars:
            grads = tuple(g.view(()) for g in grads)
        return (None, None) + tuple(grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], destination: Any, dim: int, *inputs: torch.Tensor) -> Any:
        """torch.func.vmap's rule: every input with the batch dimension first (an unbatched one expanded), joined along
        the one after `dim` (0-dim ones stacked along 1)."""
        dims = in_dims[2:]
        if all(d is None for d in dims):
            return apply(Gather, destination, dim, *inputs), None
        batched = [
            t.expand(info.batch_size, *t.shape).contiguous() if d is None else t.movedim(d, 0)
            for t, d in zip(inputs, dims)
        ]
        if all(t.dim() == 1 for t in batched):  # 0-dim inputs
            return apply(Gather, destination, 1, *(t.unsqueeze(1) for t in batched)), 0
        return apply(Gather, destination, dim + 1 if dim >= 0 else dim, *batched), 0


class BroadcastTensor(torch.autograd.Function):
    """Differentiable ``comm.broadcast`` of one tensor: ``BroadcastTensor.apply(devices, input)``, output i on
    ``devices[i]`` (the first on ``input``'s device shares its memory). Backward sums onto ``input.device`` (with tensor
    ops under ``create_graph=True``)."""

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


class ReduceAddCoalesced(torch.autograd.Function):
    """Differentiable ``comm.reduce_add_coalesced``: ``apply(destination, slots, num_inputs, *grads)`` sums K flattened
    lists of ``num_inputs`` tensors onto ``destination`` (``slots``: the lists' positions, the destination's 0, for the
    traffic counts). Backward is :class:`BroadcastCoalesced`."""

    @staticmethod
    def forward(
        destination: torch.device, slots: Sequence[int], num_inputs: int, *grads: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(comm.reduce_add_coalesced(_split_lists(grads, num_inputs), destination, slots=slots))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.source_devices = [group[0].device for group in _split_lists(inputs[3:], inputs[2])]

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None) + apply(BroadcastCoalesced, ctx.source_devices, *grad_outputs)


class BroadcastCoalesced(torch.autograd.Function):
    """Differentiable ``comm.broadcast_coalesced`` onto fresh memory: ``apply(devices, *inputs)``, a copy of every input
    per device, device by device. Backward is :func:`reduce_present`."""

    @staticmethod
    def forward(devices: Sequence[torch.device], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        copies = comm.broadcast_coalesced(list(inputs), [inputs[0].device, *devices])[1:]
        return tuple(t for group in copies for t in group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        """Missing gradients stay None; copies of inputs not requiring grad are non-differentiable."""
        ctx.set_materialize_grads(False)
        ctx.num_inputs = n = len(inputs) - 1
        ctx.input_device = inputs[1].device
        frozen = [i for i, t in enumerate(inputs[1:]) if not t.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*[output[k] for k in range(len(output)) if k % n in frozen])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None,) + reduce_present(ctx.input_device, ctx.num_inputs, grads)


class BroadcastBucket(torch.autograd.Function):
    """One bucket of parameters onto the persistent buffers of cached replicas: ``apply(replicas, *params)``, with
    ``replicas`` the bucket's ``dpcore._C.ReplicaBuffers``, refreshes them and returns tensors viewing them, as
    BroadcastCoalesced does (and with its backward)."""

    @staticmethod
    def forward(replicas: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(replicas.refresh(list(params)))

    setup_context = staticmethod(BroadcastCoalesced.setup_context)
    backward = staticmethod(BroadcastCoalesced.backward)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], replicas: Any, *params: torch.Tensor) -> Any:
        """torch.func.vmap's rule for the module's own parameters (what vmap over the inputs, or over the tensors of a
        functional call, sees): unbatched, so are their copies."""
        if any(d is not None for d in in_dims[1:]):
            raise ValueError(
                "vmap over the module's own parameters is not supported by DataParallel's replica buffers; "
                "vmap over the parameters given to dpcore.functional_call instead"
            )
        copies = apply(BroadcastBucket, replicas, *params)
        return copies, (None,) * len(copies)


class ShardedBucket(torch.autograd.Function):
    """BroadcastBucket for ``shard_gradients=True``: ``apply(replicas, sink, *params)`` returns, for position 0, an
    alias of each master (its storage: no memory), then the replicas' copies as BroadcastBucket does. Backward
    reduce-scatters every position's gradients of the bucket at once to their owners (``sink.owners``: positions of
    ``sink.devices``), missing ones as zeros, and adds the sums into `sink` (``sink.add``); the masters get None.
    `sink` None (no ShardedOptimizer attached) is an error there."""

    @staticmethod
    def forward(replicas: Any, sink: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(p.detach() for p in params) + tuple(replicas.refresh(list(params)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.set_materialize_grads(False)
        ctx.sink, ctx.masters = inputs[1], inputs[2:]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        sink, n = ctx.sink, len(ctx.masters)
        if sink is None:
            raise RuntimeError(
                "shard_gradients=True: this backward sums the gradients into the shards of a dpcore.ShardedOptimizer, "
                "but none is attached to the wrapper: build dpcore.ShardedOptimizer(model.parameters(), ..., "
                "devices=dp) before the backward (a plain optimizer would see no .grad)"
            )
        used, rows, _ = _filled(_split_lists(grads, n), sink.devices)
        if used:
            masters = [ctx.masters[j] for j in used]
            sink.add(masters, comm.reduce_scatter_coalesced(rows, sink.devices, sink.owners(masters)))
        return (None,) * (n + 2)


def _filled(
    lists: list[list[torch.Tensor | None]], devices: Sequence[torch.device] | None = None
) -> tuple[list[int], list[list[torch.Tensor]], list[int]]:
    """(the inputs j with a gradient in some list, per list its gradients of them with zeros where missing, the lists
    taking part); a list with none of them takes no part, or with `devices` (one per list) takes part with zeros on
    its device."""
    like = {j: next((group[j] for group in lists if group[j] is not None), None) for j in range(len(lists[0]))}
    used = [j for j, t in like.items() if t is not None]
    rows, taking = [], []
    for k, group in enumerate(lists):
        device = next((g.device for g in group if g is not None), None if devices is None else devices[k])
        if used and device is not None:
            rows.append([torch.zeros_like(like[j], device=device) if group[j] is None else group[j] for j in used])
            taking.append(k)
    return used, rows, taking


def reduce_present(
    destination: torch.device, num_inputs: int, grads: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    """The backward of a coalesced broadcast: `grads` holds K flattened lists of ``num_inputs`` gradients, None where
    missing. Input j gets the sum of its present gradients on `destination` (one :class:`ReduceAddCoalesced`, missing
    ones as zeros), or None when none is present. List k is the copy at position k + 1 (the source's is 0)."""
    if all(g is not None for g in grads):
        slots = list(range(1, len(grads) // num_inputs + 1))
        return apply(ReduceAddCoalesced, destination, slots, num_inputs, *grads)
    used, rows, taking = _filled(_split_lists(grads, num_inputs))
    if not used:
        return (None,) * num_inputs
    flat = [g for row in rows for g in row]
    sums = dict(zip(used, apply(ReduceAddCoalesced, destination, [k + 1 for k in taking], len(used), *flat)))
    return tuple(sums.get(j) for j in range(num_inputs))
