"""Hybrid data parallelism: dpcore.DataParallel(..., process_group=pg).

Every process runs dpcore's in-process data parallelism over its own devices
(replica 0 is the master module, replicas 1..K-1 send their gradients to it
through the BroadcastBucket autograd nodes); :class:`GradientSync` joins the
processes of a ``torch.distributed`` process group into one training job:

* At construction (and again when the module's parameters or buffers change
  structure, see :meth:`GradientSync.check_structure`) every process compares a hash of the module's layout (names,
  shapes, dtypes, requires_grad, gradient buckets) with one collective, and a
  difference is a ValueError on every rank naming the first difference. Then
  parameters and buffers are broadcast from the group's rank 0.
* Before each forward, buffers are broadcast from rank 0
  (``broadcast_buffers=True``, as DDP).
* Weights: a synchronization weights this process's ``.grad`` by
  ``n_p / N``: n_p the samples of this process's forwards (with autograd)
  since the last synchronization, N those of all processes. So the result
  is the gradient of the mean loss over the global batch, also for uneven
  local batches (the last batch of an epoch). No collective of its own: n_p
  travels in a spare element of the first gradient bucket sent (float32 or
  wider; a separate small all-reduce when every bucket is half precision),
  gradients are sent pre-multiplied by n_p / N_prev (N_prev: the previous
  synchronization's N, the same on every process) and multiplied by
  N_prev / N on arrival only when N changed (the last batch of an epoch). Without ``criterion=``
  the caller's loss is taken to be a mean over the batch (as DDP averages).
  With a ``reduction="sum"`` criterion the gradient flowing back from the
  loss is multiplied by P and the weight is 1/P: the gradient of the summed
  loss. Gradients already in ``.grad`` (the same on every process after a
  synchronization) are kept as they are, since the weights sum to 1.
* Each master parameter has a post-accumulate-grad hook: it fires once per
  backward, with the complete in-process gradient in ``.grad``. Parameters
  are grouped into buckets (dtype, about ``bucket_bytes``, parameter order);
  a bucket whose parameters have all fired is flattened, weighted and
  all-reduced (summed) asynchronously, in a fixed order (last bucket first,
  as backward goes), so communication overlaps the rest of backward and every
  process issues the same collectives in the same order. The autograd
  engine's final callback launches the remaining buckets (a parameter
  without a gradient takes part with zeros), waits on every handle and
  copies the results into ``.grad``, so the step after ``loss.backward()``
  sees the finished gradients. A parameter whose ``.grad`` is None in every
  process stays None (the optimizer skips it, as on one device).
* ``no_sync()``: backward passes of forwards run inside it accumulate
  locally; the first synchronized backward all-reduces the accumulated
  ``.grad``, weighted by this process's share of all the samples since the
  last synchronization. That equals the sum of the global gradients of the
  accumulated steps (single-device accumulation) whenever each process's
  share is the same in every accumulated step, e.g. equal local batches.

Failures never hang: every wait is bounded by the process group's timeout,
and a failing peer surfaces as the backend's RuntimeError from forward or
``backward()``. Collective tensors live on the module's device, so a CPU
list runs over gloo and a CUDA list over NCCL (or gloo) with the same code.

Limits, most of them DDP's: every process must run the same sequence of
forwards and backward passes (with buffers and ``broadcast_buffers`` every
forward is a collective; the gradient synchronization always is), so ranks
that evaluate differently should use the bare module or a DataParallel
without a process group; a forward with autograd whose output is never
backpropagated still counts in the next synchronization's weights
(evaluate under ``torch.no_grad()``); one window of accumulated forwards
should not mix a summed criterion with mean losses; ``torch.autograd.grad``
computes this process's gradients only (nothing is all-reduced); reentrant
backward (``torch.utils.checkpoint(..., use_reentrant=True)`` around
parameters) is an error, the non-reentrant form works; sparse gradients are
an error. With two or more replicas in a process, a parameter no replica
used already gets zeros from the in-process reduction (as in
torch.nn.DataParallel), so it is no longer None after the all-reduce.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dpcore._loader import _C
from dpcore._pytree import map_tensors

__all__ = ["GradientSync"]

#: The live GradientSync of each module: a second one would reduce every
#: gradient twice.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[GradientSync]] = weakref.WeakKeyDictionary()


def _dist() -> Any:
    """torch.distributed, or a clear error where this torch build lacks it."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("process_group: torch.distributed is not available in this build of torch")
    return dist


#: Id of the backward pass (graph task) running on this thread, -1 outside backward.
_grad_task = torch._C._current_graph_task_id


def _structure_of(module: nn.Module) -> list[tuple[Any, ...]]:
    """What a rebuild of the buckets depends on: every parameter and buffer
    (name, identity, shape, dtype, device, requires_grad), in order."""
    return [
        (name, id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers())
    ]


class _Bucket:
    """One all-reduce bucket: parameters of one dtype and a persistent flat
    buffer holding their gradients, then one "has a gradient" flag each,
    then one sample count."""

    __slots__ = ("params", "flat", "data", "views", "flags", "count")

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device) -> None:
        self.params = list(params)
        sizes = [p.numel() for p in self.params]
        total = sum(sizes)
        self.flat = torch.zeros(total + len(sizes) + 1, dtype=self.params[0].dtype, device=device)
        self.data = self.flat[:total]
        self.views = [v.view(p.shape) for v, p in zip(self.data.split(sizes), self.params)]
        self.flags = self.flat[total : total + len(sizes)]
        self.count = self.flat[total + len(sizes) :]


#: Dtypes that hold every sample count exactly (up to 2**24), so a bucket of
#: them can carry the count.
_COUNT_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _times(factor: float) -> Any:
    """A gradient hook multiplying by `factor`."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    return hook


class GradientSync:
    """The cross-process half of ``DataParallel(..., process_group=pg)``; see
    the module docstring for what it guarantees. ``module`` is the master
    (replica 0), all of whose parameters and buffers sit on ``device``.

    DataParallel calls :meth:`before_forward` and :meth:`after_forward`
    around each forward. Every process of the group must construct it, run
    forwards and backward passes in the same sequence (same grad mode, same
    ``no_sync`` use), as with DDP; a process that stops or raises makes the
    others raise within the group's timeout instead.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        process_group: Any,
        *,
        broadcast_buffers: bool = True,
        bucket_bytes: int,
    ) -> None:
        dist = _dist()
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group: expected a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD "
                f"after init_process_group), but got {type(process_group).__name__}"
            )
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: expected a positive size, but got {bucket_bytes}")
        owner = _OWNERS.get(module)
        if owner is not None and owner() is not None:
            raise ValueError(
                "module: already wrapped by a DataParallel with a process_group that is still alive (its hooks would "
                "all-reduce every gradient a second time); reuse that wrapper, or evaluate through the module itself "
                "or a DataParallel without a process_group"
            )
        self.module = module
        self.device = device
        self.group = process_group
        self.rank: int = dist.get_rank(process_group)
        self.world_size: int = dist.get_world_size(process_group)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.bucket_bytes = int(bucket_bytes)
        self._no_sync_depth = 0
        self._sync_backward = False  # whether the latest forward's backward synchronizes
        self._hook_handles: list[Any] = []
        self._task = -1  # graph task of the synchronizing backward in progress, -1 if none
        # Samples of this process's mean-loss forwards since the last
        # synchronization, whether there was any, and N_prev.
        self._local_count = 0
        self._counted = False
        self._norm: float | torch.Tensor = 1.0
        self._build()
        _OWNERS[module] = weakref.ref(self)

    # -- construction -----------------------------------------------------

    def _build(self) -> None:
        """(Re)builds buckets and hooks for the module's current structure;
        collective: layout check, then parameters and buffers from rank 0."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._structure = _structure_of(self.module)
        named_params = list(self.module.named_parameters())
        named_buffers = list(self.module.named_buffers())
        self._params = [p for _, p in named_params if p.requires_grad]
        indices = _C.make_buckets(self._params, self.bucket_bytes)
        self._check_layout(named_params, named_buffers, indices)

        self._broadcast([p for _, p in named_params] + [b for _, b in named_buffers], fresh=True)
        self._buffers = [b for _, b in named_buffers]
        self._buffer_groups = [
            _Bucket([self._buffers[i] for i in group], self.device)
            for group in _C.make_buckets(self._buffers, self.bucket_bytes)
        ]

        self._buckets = [_Bucket([self._params[i] for i in group], self.device) for group in indices]
        self._bucket_of: list[int] = [0] * len(self._params)
        for b, group in enumerate(indices):
            for i in group:
                self._bucket_of[i] = b
        # Launch order, the same on every process: last bucket first.
        self._order = list(range(len(self._buckets)))[::-1]
        # The first bucket sent that can carry the sample count exactly.
        self._carrier = next((b for b in self._order if self._buckets[b].flat.dtype in _COUNT_DTYPES), None)
        self._reset()
        ref = weakref.ref(self)
        for i, p in enumerate(self._params):

            def hook(_param: torch.Tensor, i: int = i) -> None:
                sync = ref()
                if sync is not None:
                    sync._on_grad(i)

            self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def _layout(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        named_buffers: Sequence[tuple[str, torch.Tensor]],
        buckets: Sequence[Sequence[int]],
    ) -> list[str]:
        """What must be equal on every process, one line per item."""
        lines = [
            f"parameter {name!r}: shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"
            for name, p in named_params
        ]
        lines += [f"buffer {name!r}: shape {tuple(b.shape)}, {b.dtype}" for name, b in named_buffers]
        lines += [f"gradient bucket {k}: parameters {list(group)}" for k, group in enumerate(buckets)]
        lines.append(f"broadcast_buffers={self.broadcast_buffers}")
        return lines

    def _check_layout(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        named_buffers: Sequence[tuple[str, torch.Tensor]],
        buckets: Sequence[Sequence[int]],
    ) -> None:
        """One all_gather of a 64-bit layout hash; on a difference, every rank
        gathers the layouts and raises ValueError naming the first difference."""
        dist = _dist()
        lines = self._layout(named_params, named_buffers, buckets)
        digest = hashlib.sha256("\n".join(lines).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        if all(torch.equal(h, every[0]) for h in every):
            return
        layouts: list[Any] = [None] * self.world_size
        dist.all_gather_object(layouts, lines, group=self.group)
        raise ValueError(_describe_difference(layouts))

    def _broadcast(self, tensors: Sequence[torch.Tensor], fresh: bool = False) -> None:
        """Overwrites `tensors` with rank 0's values (in place, bumping version
        counters on the receiving ranks only); one broadcast per dtype group."""
        dist = _dist()
        groups = (
            [_Bucket([tensors[i] for i in g], self.device) for g in _C.make_buckets(tensors, self.bucket_bytes)]
            if fresh
            else self._buffer_groups
        )
        with torch.no_grad():
            for group in groups:
                if self.rank == 0:
                    torch._foreach_copy_(group.views, [t.detach() for t in group.params])
                dist.broadcast(group.flat, group=self.group, group_src=0)
                if self.rank != 0:
                    torch._foreach_copy_([t.detach() for t in group.params], group.views)

    # -- forward ----------------------------------------------------------

    def check_structure(self) -> None:
        """Rebuilds (collective: layout check, then parameters and buffers
        from rank 0) when the module's structure changed since the last
        build: a parameter or buffer added, removed, replaced, frozen or
        unfrozen, converted, a submodule swapped. DataParallel calls it
        whenever its replica cache finds such a change, before the module
        runs, so the check costs nothing in the usual forward."""
        if _structure_of(self.module) != self._structure:
            self._build()

    def before_forward(self) -> None:
        """Drops the state of a backward that raised, broadcasts buffers."""
        if self._task != -1:  # a synchronizing backward raised: start afresh
            self._reset()
            self._clear_counts()
        if self.broadcast_buffers and self._buffer_groups:
            self._broadcast(self._buffers)

    def after_forward(self, output: Any, local_batch: int, summed: bool) -> Any:
        """Records the forward's batch size for the next synchronization's
        weights and returns `output`; with `summed` (a criterion with
        ``reduction="sum"``), `output` with every tensor that carries
        autograd history replaced by a view of it whose gradient is
        multiplied by the number of processes."""
        if not (torch.is_grad_enabled() and self._params):
            return output
        self._sync_backward = self._no_sync_depth == 0
        if not summed:
            self._counted = True
            self._local_count += int(local_batch)
            return output
        if self.world_size == 1:
            return output
        hook = _times(float(self.world_size))

        def scaled(t: torch.Tensor) -> torch.Tensor:
            if t.grad_fn is None:
                return t
            view = t.view_as(t)  # scaled once, even where one output feeds another
            view.register_hook(hook)
            return view

        return map_tensors(scaled, output)

    def _clear_counts(self) -> None:
        self._local_count = 0
        self._counted = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside do not synchronize."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # -- backward ---------------------------------------------------------

    def _reset(self) -> None:
        self._task = -1
        self._remaining = [len(b.params) for b in self._buckets]
        self._next = 0
        self._alpha: float | torch.Tensor | None = None  # the pre-multiplier of this synchronization
        self._count_work: tuple[torch.Tensor, Any] | None = None  # the count's own all-reduce, if needed
        self._launched: dict[int, tuple[list[bool], Any]] = {}  # bucket -> (had .grad, handle), in launch order

    def _begin_weights(self) -> None:
        """At the first bucket sent: the pre-multiplier n_p / N_prev (1/P when
        no mean-loss forward was recorded: every process then weighs the same),
        and the count's own all-reduce where no bucket can carry it."""
        if not self._counted:
            self._alpha = 1.0 / self.world_size
            return
        self._alpha = self._local_count / self._norm
        if self._carrier is None:
            count = torch.tensor([float(self._local_count)], dtype=torch.float64, device=self.device)
            self._count_work = (count, _dist().all_reduce(count, group=self.group, async_op=True))

    def _on_grad(self, i: int) -> None:
        """Post-accumulate hook of parameter i: launches every bucket that is
        complete and next in the launch order."""
        if not self._sync_backward:
            return
        task = _grad_task()
        if self._task == -1:
            self._reset()
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        elif task != self._task:
            raise RuntimeError(
                "DataParallel(process_group=...): a backward pass reached the parameters while another one that "
                "synchronizes them has not finished (a reentrant backward, such as "
                "torch.utils.checkpoint(..., use_reentrant=True), is not supported: use use_reentrant=False)"
            )
        b = self._bucket_of[i]
        remaining = self._remaining
        remaining[b] -= 1
        if remaining[b] == 0:
            while self._next < len(self._order) and self._remaining[self._order[self._next]] == 0:
                self._launch(self._order[self._next])
                self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        grads = [p.grad for p in bucket.params]
        present = [g is not None for g in grads]
        for g in grads:
            if g is not None and g.layout != torch.strided:
                raise RuntimeError(
                    f"DataParallel(process_group=...): expected dense gradients, but a parameter's gradient has "
                    f"layout {g.layout} (sparse gradients are not supported)"
                )
        if all(present):
            torch._foreach_copy_(bucket.views, grads)
            bucket.flags.fill_(1)
        else:
            for view, g in zip(bucket.views, grads):
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
            bucket.flags.copy_(torch.tensor(present, dtype=bucket.flat.dtype))
        if self._alpha is None:
            self._begin_weights()
        alpha = self._alpha
        if self._counted and self._local_count == 0:
            bucket.data.zero_()  # no samples here (an empty local batch): nothing, not 0 * inf or NaN
        elif not (isinstance(alpha, float) and alpha == 1.0):
            bucket.data.mul_(alpha)
        bucket.count.fill_(self._local_count if b == self._carrier else 0)
        work = _dist().all_reduce(bucket.flat, group=self.group, async_op=True)
        self._launched[b] = (present, work)

    def _correction(self) -> float | torch.Tensor | None:
        """After the sample count arrived: N_prev / N, the factor that turns
        the sent n_p / N_prev weights into n_p / N (None where it is 1); N
        becomes the next N_prev."""
        if not self._counted:
            return None
        if self._count_work is not None:
            count, work = self._count_work
        else:
            count, work = self._buckets[self._carrier].count, self._launched[self._carrier][1]
        work.wait()
        total = count.real if count.is_complex() else count
        if total.device.type == "cpu":
            n = max(total.item(), 1.0)
            factor = None if n == self._norm else self._norm / n
            self._norm = n
            return factor
        n_tensor = total.to(torch.float64).clamp_min(1.0).reshape(())  # stays on the device
        factor_t = self._norm / n_tensor
        self._norm = n_tensor
        return factor_t

    def _finish(self) -> None:
        """Final callback of a synchronizing backward: launches what is left,
        waits for every bucket, writes the averages into ``.grad``."""
        try:
            while self._next < len(self._order):
                self._launch(self._order[self._next])
                self._next += 1
            factor = self._correction()
            for b, (present, work) in self._launched.items():
                work.wait()
                bucket = self._buckets[b]
                if factor is not None:
                    bucket.data.mul_(factor)
                if all(present):
                    torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)
                    continue
                used = bucket.flags.ne(0).tolist()
                for p, view, had, anyone in zip(bucket.params, bucket.views, present, used):
                    if had:
                        p.grad.copy_(view)
                    elif anyone:
                        p.grad = torch.empty_like(p).copy_(view)
        finally:
            self._clear_counts()
            self._reset()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "DataParallel with a process_group cannot be pickled or copied (it holds a process group and hooks); "
            "save or copy its module or state_dict() instead"
        )

    def __del__(self) -> None:
        for handle in getattr(self, "_hook_handles", ()):
            handle.remove()


def _describe_difference(layouts: Sequence[Sequence[str]]) -> str:
    """The first line in which a rank's layout differs from rank 0's."""
    base = list(layouts[0])
    for rank, lines in enumerate(layouts[1:], start=1):
        lines = list(lines)
        if lines == base:
            continue
        for k in range(max(len(lines), len(base))):
            mine = lines[k] if k < len(lines) else "nothing"
            theirs = base[k] if k < len(base) else "nothing"
            if mine != theirs:
                return (
                    "process_group: the module must have the same layout in every process, but rank "
                    f"{rank} has {mine} where rank 0 has {theirs}"
                )
    return "process_group: the module's layout differs between processes"
