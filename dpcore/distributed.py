"""Hybrid data parallelism: dpcore.DataParallel(..., process_group=pg).

Every process runs dpcore's in-process data parallelism over its own devices
(replica 0 is the master module, replicas 1..K-1 send their gradients to it
through the BroadcastBucket autograd nodes); :class:`GradientSync` joins the
processes of a ``torch.distributed`` process group into one training job:

* At construction every process compares a hash of the module's layout
  (names, shapes, dtypes, requires_grad, gradient buckets) with one
  collective, and a difference is a ValueError on every rank naming the
  first difference. Then parameters and buffers (buffers unless
  ``broadcast_buffers=False``) are broadcast from the group's rank 0.
* Which forwards communicate: only those that can start a gradient
  synchronization, i.e. grad mode on (so not ``torch.no_grad()`` nor
  ``torch.inference_mode()``) and a parameter that requires grad. Before
  each of them (``no_sync()`` ones included) buffers are broadcast from rank
  0, and again at the end of each synchronizing backward (rank 0's buffers
  as its forward left them: what DDP's next forward, of any grad mode, would
  send), both with ``forward_sync_buffers`` (default True). Every other
  forward makes no collective and uses this process's own buffers, so one
  rank may evaluate alone (``if rank == 0: evaluate(dp)`` under
  ``torch.no_grad()``), and an evaluation on every rank after training
  sees rank 0's buffers, as DDP's. ``forward_sync_buffers=False`` sends
  buffers at construction only; DDP's deprecated ``broadcast_buffers=False``
  never (resolved as torch 2.13's DDP resolves them, with its warnings).
* A structural change after construction (a parameter or buffer added,
  removed, replaced, frozen or unfrozen, converted; a submodule swapped) is
  noted locally, with no collective; the next synchronization still uses
  the buckets built so far (so every rank issues the same collectives), and
  its first bucket carries one mark per rank saying whose module changed.
  When one rank changed, all of them compare their layouts (one
  all_gather_object) and then: every rank made the same change (replaced
  tensors with the same values too) -- the buckets are rebuilt and the
  gradients of newly covered parameters all-reduced with the step's
  weights, so the step is exact; otherwise ValueError on every rank from
  ``backward()``, naming each rank that changed and what (e.g. "rank 1:
  parameter 'fc.weight' frozen"), with ``.grad`` not synchronized. No
  extra collective per step: the marks ride in the first bucket.
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
  process stays None (the optimizer skips it, as on one device; see
  "Unused parameters" below).
* ``no_sync()``: backward passes of forwards run inside it accumulate
  locally; the first synchronized backward all-reduces the accumulated
  ``.grad``, weighted by this process's share of all the samples since the
  last synchronization. That equals the sum of the global gradients of the
  accumulated steps (single-device accumulation) whenever each process's
  share is the same in every accumulated step, e.g. equal local batches.

Join (uneven inputs): ``DataParallel`` is a
``torch.distributed.algorithms.join.Joinable``. Under ``Join([dp, ...])``
each training forward notifies the join context and makes one all-reduce
(whether its backward synchronizes; which ranks are still training); a rank
that ran out of inputs shadows each of them (:class:`DataParallelJoinHook`):
buffers from the highest rank still training (as DDP), zero gradients in
the same buckets, and its last synchronization's sample count in the
weights with ``divide_by_initial_world_size=True`` (with equal local
batches: DDP's division by the initial world size), none with False (DDP:
division by the ranks still training). When all joined, parameters (and
buffers with ``forward_sync_buffers``) are broadcast from the last joiner.

Failures never hang: every wait is bounded by the process group's timeout,
and a failing peer surfaces as the backend's RuntimeError from forward or
``backward()``. Collective tensors live on the module's device, so a CPU
list runs over gloo and a CUDA list over NCCL (or gloo) with the same code.

Limits, most of them DDP's: every process must run the same sequence of
forwards that can synchronize (see above) and backward passes; a forward
with autograd whose output is never
backpropagated still counts in the next synchronization's weights
(evaluate under ``torch.no_grad()``); one window of accumulated forwards
should not mix a summed criterion with mean losses; ``torch.autograd.grad``
computes this process's gradients only (nothing is all-reduced); a module
with no trainable parameter at construction has no bucket to carry the
marks, so when parameters become trainable the buckets are rebuilt in the
first training forward (a collective: every rank must make that change);
under Join, a joined rank shadows training forwards only, so the ranks
still training must run backward after each of them; reentrant
backward (``torch.utils.checkpoint(..., use_reentrant=True)`` around
parameters) is an error, the non-reentrant form works; sparse gradients are
an error.

Communication hooks (``register_comm_hook(state, hook)``, DDP's contract):
each gradient bucket is handed to ``hook(state, bucket)`` (a
:class:`GradBucket`) instead of being all-reduced, and the tensor of the
returned Future is the bucket's reduced gradient. The hook divides by the
world size P itself (as torch's), so the buffer it gets is this process's
gradient pre-multiplied by P * n_p / N_ref, N_ref being the largest N so far
(the first synchronization learns its N by one blocking all-reduce of the
count, once): with equal full batches the factor is exactly 1 and the hook
sees DDP's bucket, bitwise; otherwise a factor N_ref / N on arrival makes
the weights n_p / N, exact up to the hook's precision (the factor stays at
most P, so a half-precision hook does not overflow for it). The flags, the
sample count and the layout marks do not ride in the buckets then: they go
in one float64 all-reduce per synchronization after the buckets
(8 * (parameter tensors + 2 + P) bytes), so no lossy hook touches them.
Buckets are handed to the hook in send order, one at a time: the next once
the previous Future is done (at once on NCCL, whose Futures complete on
enqueue; on gloo when its collectives finished), so collectives a hook
issues from its callbacks (PowerSGD's) keep one order on every rank. Under
Join a joined rank runs the hook on zero buckets, as DDP; gradients of
parameters that a layout change newly covers are all-reduced without the
hook (full precision, once).

Unused parameters, with any number of replicas per process: the in-process
reduction gives a parameter that none of a process's replicas used no
gradient (its ``.grad`` stays None, or as accumulated), so it takes part in
the all-reduce with zeros and a "no gradient" flag. One that no replica of
any process used stays None on every rank (the optimizer skips it, as on one
device); one used on some ranks gets, on every rank, the weighted sum of
their gradients, the same as one device computes on the global batch.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import os
import sys
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from dpcore._loader import _C
from dpcore._pytree import map_tensors
from dpcore.sync_batchnorm import AcrossProcesses

__all__ = ["GradientSync", "GradBucket", "DataParallelJoinHook"]

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


def _timeout_of(group: Any, device: torch.device) -> datetime.timedelta:
    """The timeout of `group`'s backend for `device` (what bounds each of its
    collectives), or torch.distributed's default where the backend does not say."""
    dist = _dist()
    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout
    return timeout if isinstance(timeout, datetime.timedelta) else dist.default_pg_timeout


def _twin_group(group: Any, timeout: datetime.timedelta) -> Any:
    """A new process group of `group`'s ranks (in its order), backend and
    `timeout`. Collective over `group`'s ranks only (every one of them must
    call it, in the same order of group creations)."""
    dist = _dist()
    ranks = dist.get_process_group_ranks(group)
    options: dict[str, Any] = {} if ranks == sorted(ranks) else {"sort_ranks": False}
    return dist.new_group(
        ranks=ranks, timeout=timeout, backend=dist.get_backend(group), use_local_synchronization=True, **options
    )


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by the caller of this function
    that points at the first frame outside dpcore (the user's call)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def buffer_sync_options(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(forward, init): whether buffers are sent from rank 0 while training,
    and at construction, resolved as torch 2.13's DistributedDataParallel
    resolves its options of these names (the same FutureWarnings for the
    deprecated ``broadcast_buffers``); TypeError naming an option that is
    neither True, False nor None."""
    for name, value in (("broadcast_buffers", broadcast_buffers), ("forward_sync_buffers", forward_sync_buffers)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name}: expected True, False or None, but got {value!r}")
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            message = (
                "DataParallel: Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated (as in torch's DistributedDataParallel) and its value is "
                "ignored when `forward_sync_buffers` is provided."
            )
        else:
            message = (
                "DataParallel: `broadcast_buffers` is deprecated (as in torch's DistributedDataParallel). Use "
                "`forward_sync_buffers` instead. IMPORTANT: unlike `broadcast_buffers=False`, "
                "`forward_sync_buffers=False` still syncs buffers at construction; for buffers that must stay "
                "rank-local from the start, keep `broadcast_buffers=False`."
            )
        warnings.warn(message, FutureWarning, stacklevel=_caller_stacklevel())
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def _structure_of(module: nn.Module) -> list[tuple[Any, ...]]:
    """What a rebuild of the buckets depends on: every parameter and buffer
    (kind, name, identity, shape, dtype, device, requires_grad), in order."""
    return [
        (kind, name, id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
        for name, t in named
    ]


def _describe_change(old: Sequence[tuple[Any, ...]], new: Sequence[tuple[Any, ...]]) -> list[str]:
    """What changed between two :func:`_structure_of` lists, one phrase per
    tensor ("parameter 'fc.weight' frozen (requires_grad True -> False)")."""
    before = {(kind, name): rest for kind, name, *rest in old}
    after = {(kind, name): rest for kind, name, *rest in new}
    phrases = []
    for (kind, name), (ident, shape, dtype, device, grad) in before.items():
        if (kind, name) not in after:
            phrases.append(f"{kind} {name!r} removed")
            continue
        ident2, shape2, dtype2, device2, grad2 = after[(kind, name)]
        what = []
        if ident2 != ident:
            what.append("replaced by another tensor")
        if shape2 != shape:
            what.append(f"shape {shape} -> {shape2}")
        if dtype2 != dtype:
            what.append(f"dtype {dtype} -> {dtype2}")
        if device2 != device:
            what.append(f"device {device} -> {device2}")
        if grad2 != grad:
            what.append("frozen (requires_grad True -> False)" if grad else "unfrozen (requires_grad False -> True)")
        if what:
            phrases.append(f"{kind} {name!r} " + ", ".join(what))
    phrases += [f"{kind} {name!r} added" for kind, name in after if (kind, name) not in before]
    return phrases or ["the order of its parameters or buffers"]


def _digest(t: torch.Tensor) -> str:
    """A hash of a tensor's values (for comparing replaced tensors across processes)."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class _AllReduceBuffer:
    """One all-reduce bucket of the hybrid mode (the gradients' counterpart
    of the replicas' C++ ReplicaBuffers): parameters of one dtype and a
    persistent flat buffer holding their gradients, then one "has a
    gradient" flag each,
    then one sample count; with `world` > 0 (gradient buckets), then one
    "counted" flag (whether the sender's weights follow sample counts) and
    `world` layout marks (element r is 1 where rank r's module changed its
    layout since the buckets were built).

    With `side` = (flags, tail) (the buckets of a communication hook), the
    flat buffer holds the gradients only, and the flags and the tail (count,
    counted flag, marks) are those views of a tensor sent apart, so that no
    hook (a lossy compression) touches them."""

    __slots__ = ("params", "flat", "data", "views", "flags", "count", "counted", "marks")

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        device: torch.device,
        world: int = 0,
        side: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.params = list(params)
        sizes = [p.numel() for p in self.params]
        total = sum(sizes)
        n = len(sizes)
        if side is None:
            extra = 2 + world if world else 1
            self.flat = torch.zeros(total + n + extra, dtype=self.params[0].dtype, device=device)
            flags, tail = self.flat[total : total + n], self.flat[total + n :]
        else:
            self.flat = torch.zeros(total, dtype=self.params[0].dtype, device=device)
            flags, tail = side
        self.data = self.flat[:total]
        self.views = [v.view(p.shape) for v, p in zip(self.data.split(sizes), self.params)]
        self.flags = flags
        self.count = tail[0:1]
        self.counted = tail[1:2]
        self.marks = tail[2:]


#: Dtypes that hold every sample count exactly (up to 2**24), so a bucket of
#: them can carry the count.
_COUNT_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _scaled_by(factor: float) -> Any:
    """A gradient hook multiplying by `factor`."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    return hook


def _copy_back(bucket: _AllReduceBuffer, present: Sequence[bool]) -> None:
    """Copies an all-reduced bucket into its parameters' ``.grad``: in place
    where this process had a gradient, into a new tensor where only another
    process had one (its flag), and not at all where no process had one (the
    gradient stays None, as on one device)."""
    used = bucket.flags.ne(0).tolist()
    for p, view, had, anyone in zip(bucket.params, bucket.views, present, used):
        if had:
            p.grad.copy_(view)
        elif anyone:
            p.grad = torch.empty_like(p).copy_(view)


class GradBucket:
    """What a communication hook receives for one gradient bucket: dpcore's
    stand-in for ``torch.distributed.GradBucket`` (a C++ class that Python
    cannot build), with the methods torch's hooks call. ``buffer()`` is the
    flat gradient of the bucket's parameters (this process's, weighted; see
    the module docstring), ``gradients()`` views of the current buffer in
    the shapes of ``parameters()``, ``index()`` the bucket's place in the
    order the buckets are sent (0 first: the last parameters, as DDP) and
    ``is_last()`` whether it is the last one sent in this synchronization."""

    __slots__ = ("_index", "_count", "_buffer", "_params")

    def __init__(self, index: int, count: int, buffer: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        self._index = index
        self._count = count
        self._buffer = buffer
        self._params = list(params)

    def index(self) -> int:
        """The bucket's place in the send order (the same on every rank and step, until a rebuild)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket sent in the synchronization."""
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        """The flat (1-D) gradient of the bucket's parameters."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replaces the buffer (as ``fp16_compress_wrapper`` does) by a 1-D
        tensor of the same number of elements; ``gradients()`` then views it."""
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.numel() != self._buffer.numel():
            found = (
                f"a tensor of shape {tuple(buffer.shape)}"
                if isinstance(buffer, torch.Tensor)
                else type(buffer).__name__
            )
            raise ValueError(
                f"buffer: expected a 1-D tensor of {self._buffer.numel()} elements (the bucket's gradients), "
                f"but got {found}"
            )
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of the current buffer per parameter, in its shape."""
        sizes = [p.numel() for p in self._params]
        return [v.view(p.shape) for v, p in zip(self._buffer.split(sizes), self._params)]

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in buffer order."""
        return list(self._params)


def _hook_result(value: Any, bucket: _AllReduceBuffer, index: int) -> torch.Tensor:
    """The tensor a hook's Future gave for a bucket (a tensor, or a list
    whose first element is one, as DDP accepts), checked for size."""
    tensor = value[0] if isinstance(value, (list, tuple)) and value else value
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != bucket.data.numel():
        found = f"a tensor of {tensor.numel()} elements" if isinstance(tensor, torch.Tensor) else type(value).__name__
        raise RuntimeError(
            f"register_comm_hook: the hook's Future must hold one tensor of the bucket's {bucket.data.numel()} "
            f"elements (bucket {index}), but it held {found}"
        )
    return tensor


class GradientSync:
    """The cross-process half of ``DataParallel(..., process_group=pg)``; see
    the module docstring for what it guarantees. ``module`` is the master
    (replica 0), all of whose parameters and buffers sit on ``device``.

    DataParallel calls :meth:`before_forward` and :meth:`after_forward`
    around each forward. Every process of the group must construct it, run
    the forwards that can synchronize (:meth:`can_sync`) and backward passes
    in the same sequence (same ``no_sync`` use), as with DDP (other forwards
    are local); a process that stops or raises makes the others raise
    within the group's timeout instead.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        process_group: Any,
        *,
        broadcast_buffers: bool | None = None,
        forward_sync_buffers: bool | None = None,
        bucket_bytes: int,
        sync_batchnorm: bool = False,
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
        self.forward_sync_buffers, self.init_sync_buffers = buffer_sync_options(broadcast_buffers, forward_sync_buffers)
        self._buffer_src = 0  # the rank whose buffers the latest training forward's synchronization sends
        self.bucket_bytes = int(bucket_bytes)
        self._no_sync_depth = 0
        self._sync_backward = False  # whether the latest forward's backward synchronizes
        self._hook_handles: list[Any] = []
        self._task = -1  # graph task of the synchronizing backward in progress, -1 if none
        # Samples of this process's mean-loss forwards since the last
        # synchronization, whether there was any, and N_prev (the global sample
        # count of the previous synchronization, which weighted this one's sends).
        self._local_count = 0
        self._counted = False
        self._previous_total: float | torch.Tensor = 1.0
        self._last_count = 0  # n_p of the last synchronization with a mean-loss forward (a joined rank's weight)
        self._pending = False  # the module's structure changed since the build; not yet agreed with the others
        self._hook: tuple[Any, Any] | None = None  # (hook, state) of register_comm_hook
        self._ref: float | None = None  # with a hook: the largest N so far (None before the first)
        self._started = False  # a synchronization (or a joined rank's shadow of one) has begun
        self._build(initial=True)
        # Synchronized BatchNorm across processes: a group of its own (see batchnorm_across).
        self.batchnorm_group: Any = None
        self.timeout = _timeout_of(process_group, device)
        if sync_batchnorm and self.world_size > 1:
            self.batchnorm_group = _twin_group(process_group, self.timeout)
        _OWNERS[module] = weakref.ref(self)

    # -- construction -----------------------------------------------------

    def _build(self, initial: bool = False) -> None:
        """(Re)builds buckets and hooks for the module's current structure;
        collective: layout check, then parameters and buffers from rank 0
        (buffers: with ``init_sync_buffers`` at construction, else with
        ``forward_sync_buffers``)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._pending = False
        self._structure = _structure_of(self.module)
        named_params = list(self.module.named_parameters())
        named_buffers = list(self.module.named_buffers())
        self._params = [p for _, p in named_params if p.requires_grad]
        indices = _C.make_buckets(self._params, self.bucket_bytes)
        self._check_layout(named_params, named_buffers, indices)

        send_buffers = self.init_sync_buffers if initial else self.forward_sync_buffers
        shared = named_params + (named_buffers if send_buffers else [])
        self._broadcast([t for _, t in shared], fresh=True)
        self._buffers = [b for _, b in named_buffers]
        self._buffer_groups = [
            _AllReduceBuffer([self._buffers[i] for i in group], self.device)
            for group in _C.make_buckets(self._buffers, self.bucket_bytes)
        ]

        self._indices = [list(group) for group in indices]
        self._make_buckets()
        self._bucket_of: list[int] = [0] * len(self._params)
        for b, group in enumerate(indices):
            for i in group:
                self._bucket_of[i] = b
        self._reset()
        ref = weakref.ref(self)
        for i, p in enumerate(self._params):

            def hook(_param: torch.Tensor, i: int = i) -> None:
                sync = ref()
                if sync is not None:
                    sync._on_grad(i)

            self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def _make_buckets(self) -> None:
        """The gradient buckets of ``self._indices``: flags, count and marks
        inside each bucket's buffer, or with a communication hook in one
        float64 tensor sent apart (``self._side``: every bucket's flags, then
        count, counted flag and marks)."""
        groups = [[self._params[i] for i in group] for group in self._indices]
        self._side: torch.Tensor | None = None
        if self._hook is None:
            self._buckets = [_AllReduceBuffer(group, self.device, world=self.world_size) for group in groups]
        else:
            flags = sum(len(group) for group in groups)
            self._side = torch.zeros(flags + 2 + self.world_size, dtype=torch.float64, device=self.device)
            tail = self._side[flags:]
            self._buckets = []
            offset = 0
            for group in groups:
                side = (self._side[offset : offset + len(group)], tail)
                self._buckets.append(_AllReduceBuffer(group, self.device, world=self.world_size, side=side))
                offset += len(group)
        # Launch order, the same on every process: last bucket first.
        self._order = list(range(len(self._buckets)))[::-1]
        # The first bucket sent that can carry the sample count exactly (none with a hook).
        self._count_bucket = (
            next((b for b in self._order if self._buckets[b].flat.dtype in _COUNT_DTYPES), None)
            if self._hook is None
            else None
        )

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """DDP's ``register_comm_hook``: from then on every gradient bucket
        is sent by ``hook(state, bucket)`` (a :class:`GradBucket`), which
        returns a ``torch.futures.Future`` of the bucket's reduced gradient
        (divided by the world size by the hook itself, as torch's hooks do).
        Once only, on every rank, before the first synchronizing backward."""
        if not callable(hook):
            raise TypeError(
                f"hook: expected a callable hook(state, bucket) -> torch.futures.Future[torch.Tensor], but got "
                f"{type(hook).__name__}"
            )
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError as error:
            raise TypeError(
                f"hook: expected a callable taking (state, bucket), but {getattr(hook, '__name__', hook)!r} "
                f"does not: {error}"
            ) from None
        except ValueError:
            pass  # no signature to inspect (a builtin): called as it is
        if self._hook is not None:
            raise RuntimeError(
                "register_comm_hook: a communication hook is already registered; only one can be, as with DDP"
            )
        if self._started or self._task != -1:
            raise RuntimeError(
                "register_comm_hook: must be called before the first backward that synchronizes gradients (as "
                "DDP's), on every rank; this wrapper has already synchronized"
            )
        self._hook = (hook, state)
        self._make_buckets()
        self._reset()

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
        lines.append(f"forward_sync_buffers={self.forward_sync_buffers}, init_sync_buffers={self.init_sync_buffers}")
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

    def _broadcast(self, tensors: Sequence[torch.Tensor], fresh: bool = False, src: int = 0) -> None:
        """Overwrites `tensors` with rank `src`'s values (in place, bumping
        version counters on the receiving ranks only); one broadcast per dtype
        group (the buffers' persistent groups unless `fresh`)."""
        dist = _dist()
        groups = (
            [
                _AllReduceBuffer([tensors[i] for i in g], self.device)
                for g in _C.make_buckets(tensors, self.bucket_bytes)
            ]
            if fresh
            else self._buffer_groups
        )
        with torch.no_grad():
            for group in groups:
                if self.rank == src:
                    torch._foreach_copy_(group.views, [t.detach() for t in group.params])
                dist.broadcast(group.flat, group=self.group, group_src=src)
                if self.rank != src:
                    torch._foreach_copy_([t.detach() for t in group.params], group.views)

    def _send_buffers(self) -> None:
        """At the end of a synchronizing backward (every rank, joined ones
        too, after the gradient collectives): the buffers of the rank that
        sent them before the forward (rank 0, or the highest rank still
        training under Join), with ``forward_sync_buffers``. So every rank
        evaluates after training with the buffers that DDP's next forward
        would have sent, and no forward that cannot synchronize needs a
        collective."""
        if self.forward_sync_buffers and self._buffer_groups:
            self._broadcast(self._buffers, src=self._buffer_src)

    # -- forward ----------------------------------------------------------

    def check_structure(self) -> None:
        """Notes (no collective) that the module's structure changed since
        the last build: a parameter or buffer added, removed, replaced,
        frozen or unfrozen, converted, a submodule swapped. DataParallel
        calls it whenever its replica cache finds such a change, so the
        check costs nothing in the usual forward. The change is agreed with
        the other processes at the next synchronization (its first bucket
        carries one mark per rank), which keeps the buckets built so far
        until then, so every rank issues the same collectives: see
        :meth:`_agree_on_change`."""
        if _structure_of(self.module) != self._structure:
            self._pending = True

    def can_sync(self) -> bool:
        """Whether a forward run now can start a gradient synchronization:
        grad mode on (so not inference mode either) and a parameter that
        requires grad. Forwards that cannot make no collective."""
        return torch.is_grad_enabled() and bool(self._params or self._pending)

    def before_forward(self, joinable: Any = None) -> None:
        """Drops the state of a backward that raised; in a forward that can
        start a gradient synchronization (:meth:`can_sync`), and only there,
        the collectives of a forward: inside an enabled
        ``torch.distributed.algorithms.join.Join`` (`joinable` is the
        wrapper), the join context's notification and one all-reduce that
        tells the joined ranks whether this backward synchronizes and which
        rank is the highest not joined; then buffers broadcast from rank 0
        (from that rank under Join, as DDP)."""
        if self._task != -1:  # a synchronizing backward raised: start afresh
            self._reset()
            self._clear_counts()
        if not self.can_sync():
            return
        src = 0
        config = getattr(joinable, "_join_config", None)
        if config is not None and config.enable:
            from torch.distributed.algorithms.join import Join

            work = Join.notify_join_context(joinable)
            src, _ = self._join_state(active=True)
            if work is not None:
                work.wait()
        self._buffer_src = src
        if self.forward_sync_buffers and self._buffer_groups:
            self._broadcast(self._buffers, src=src)

    def batchnorm_across(self, local_batch: int, summed: bool) -> AcrossProcesses | None:
        """What synchronizes BatchNorm across the processes in the forward
        about to run (dpcore/sync_batchnorm.py), or None: without
        ``sync_batchnorm``, with one process, or where the forward cannot
        start a gradient synchronization (:meth:`can_sync`; its BatchNorm
        then uses this process's statistics, with no collective). Its
        collectives go over a group of their own, so they never meet the
        gradient buckets'; the buckets of such a synchronization are
        launched at the end of backward (in the final callback), after the
        BatchNorm collectives of backward, so that every rank issues its
        collectives in one order. `local_batch` and `summed` give this
        process's gradient weight, as :meth:`after_forward` counts it."""
        if self.batchnorm_group is None or not self.can_sync():
            return None
        return AcrossProcesses(self.batchnorm_group, self.timeout, 1.0 if summed else float(local_batch))

    def after_forward(self, output: Any, local_batch: int, summed: bool) -> Any:
        """Records the forward's batch size for the next synchronization's
        weights and returns `output`; with `summed` (a criterion with
        ``reduction="sum"``), `output` with every tensor that carries
        autograd history replaced by a view of it whose gradient is
        multiplied by the number of processes."""
        if not torch.is_grad_enabled():
            return output
        if self._pending and not self._buckets:
            # Nothing synchronizes yet, so no bucket can carry the change:
            # rebuild now (collective; every rank must make the same change).
            self._build()
        if not self._params:
            return output
        self._sync_backward = self._no_sync_depth == 0
        if not summed:
            self._counted = True
            self._local_count += int(local_batch)
            return output
        if self.world_size == 1:
            return output
        hook = _scaled_by(float(self.world_size))

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
        self._previous: Any = None  # with a hook: the Future of the bucket sent last

    def _begin_weights(self) -> None:
        """At the first bucket sent: the pre-multiplier n_p / N_prev (1/P when
        no mean-loss forward was recorded: every process then weighs the same),
        and, where no bucket can carry the count, its own all-reduce
        (count, counted flag) before the first bucket's."""
        if self._hook is not None:
            # The hook divides by P itself: the pre-multiplier is P * n_p / N_ref, with N_ref the largest N so
            # far (1 with equal full batches, at most P otherwise, so a half-precision hook cannot overflow
            # for a large factor). Before the first synchronization, N_ref is this one's N (a blocking
            # all-reduce of the count, once).
            if self._ref is None:
                total, counted = self._count_all(float(self._local_count), self._counted)
                if counted:
                    self._ref = max(total, 1.0)
            ref = self._ref if self._ref is not None else 1.0
            self._alpha = self.world_size * self._local_count / ref if self._counted else 1.0
            return
        self._alpha = self._local_count / self._previous_total if self._counted else 1.0 / self.world_size
        if self._count_bucket is None:
            count = torch.tensor(
                [float(self._local_count), 1.0 if self._counted else 0.0], dtype=torch.float64, device=self.device
            )
            self._count_work = (count, _dist().all_reduce(count, group=self.group, async_op=True))

    def _count_all(self, count: float, counted: bool) -> tuple[float, bool]:
        """Blocking all-reduce of (sample count, counted flag): the total and
        whether any rank counted."""
        both = torch.tensor([count, 1.0 if counted else 0.0], dtype=torch.float64, device=self.device)
        _dist().all_reduce(both, group=self.group)
        total, flag = both.tolist()
        return total, flag != 0

    def _on_grad(self, i: int) -> None:
        """Post-accumulate hook of parameter i: launches every bucket that is
        complete and next in the launch order."""
        if not self._sync_backward:
            return
        task = _grad_task()
        if self._task == -1:
            self._reset()
            self._started = True
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        elif task != self._task:
            raise RuntimeError(
                "DataParallel(process_group=...): a backward pass reached the parameters while another one that "
                "synchronizes them has not finished (a reentrant backward, such as "
                "torch.utils.checkpoint(..., use_reentrant=True), is not supported: use use_reentrant=False)"
            )
        self._remaining[self._bucket_of[i]] -= 1
        if self.batchnorm_group is not None:
            return  # every bucket in _finish, in one order on every rank (see batchnorm_across)
        order, remaining = self._order, self._remaining
        while self._next < len(order) and remaining[order[self._next]] == 0:
            if self._previous is not None and not self._previous.done():
                break  # a hook's bucket is still in flight: sent at a later gradient or in _finish
            self._launch(order[self._next])
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
            bucket.flags.copy_(torch.tensor(present, dtype=bucket.flags.dtype))
        if self._alpha is None:
            self._begin_weights()
        alpha = self._alpha
        if self._counted and self._local_count == 0:
            bucket.data.zero_()  # no samples here (an empty local batch): nothing, not 0 * inf or NaN
        elif not (isinstance(alpha, float) and alpha == 1.0):
            bucket.data.mul_(alpha)
        if self._hook is not None:
            self._previous = self._call_hook(b)
            self._launched[b] = (present, self._previous)
            return
        carrier = b == self._count_bucket
        bucket.count.fill_(self._local_count if carrier else 0)
        bucket.counted.fill_(1 if carrier and self._counted else 0)
        bucket.marks.zero_()
        if self._pending:
            bucket.marks[self.rank] = 1
        work = _dist().all_reduce(bucket.flat, group=self.group, async_op=True)
        self._launched[b] = (present, work)

    def _call_hook(self, b: int) -> Any:
        """Calls the communication hook on bucket `b`'s gradients; its Future."""
        hook, state = self._hook  # type: ignore[misc]
        bucket = self._buckets[b]
        index = self._order.index(b)
        future = hook(state, GradBucket(index, len(self._order), bucket.data, bucket.params))
        if not isinstance(future, torch._C.Future):
            raise TypeError(
                f"register_comm_hook: the hook must return a torch.futures.Future of the bucket's reduced gradient, "
                f"but it returned {type(future).__name__} (bucket {index})"
            )
        return future

    def _wait_previous(self) -> None:
        """With a hook: waits until the bucket sent last is reduced, so that
        collectives a hook issues from its Future's callbacks (PowerSGD's)
        come in the same order on every rank."""
        if self._previous is not None:
            self._previous.wait()

    def _finish_hooked(self) -> float | None:
        """With a hook, after every bucket was sent: waits for each Future and
        writes its tensor into the bucket, then all-reduces the side tensor
        (flags, sample count, counted flag, marks; float64, one collective)
        and returns the correction N_ref / N (None where it is 1); N_ref
        becomes the largest N so far."""
        for b, (_, future) in self._launched.items():
            bucket = self._buckets[b]
            result = _hook_result(future.wait(), bucket, self._order.index(b))
            if result.data_ptr() != bucket.data.data_ptr() or result.dtype != bucket.data.dtype:
                bucket.data.copy_(result.reshape(-1))
        total, counted = self._send_side(float(self._local_count), self._counted)
        if self._counted:
            self._last_count = self._local_count
        if not counted:
            return None
        n = max(total, 1.0)
        ref = self._ref if self._ref is not None else n
        factor = None if n == ref or not self._counted else ref / n
        self._ref = max(ref, n)
        return factor

    def _send_side(self, count: float, counted: bool) -> tuple[float, bool]:
        """With a hook: all-reduces the side tensor (the bucket flags already
        in it) with this rank's count, counted flag and layout mark; returns
        the total count and whether any rank counted."""
        assert self._side is not None
        tail = self._side[len(self._side) - self.world_size - 2 :]
        tail[0] = count
        tail[1] = 1.0 if counted else 0.0
        tail[2:].zero_()
        if self._pending:
            tail[2 + self.rank] = 1.0
        _dist().all_reduce(self._side, group=self.group)
        total, flag = tail[:2].tolist()
        return total, flag != 0

    def _correction(self) -> float | torch.Tensor | None:
        """After the sample count arrived: N_prev / N, the factor that turns
        the sent n_p / N_prev weights into n_p / N (None where it is 1); N
        becomes the next N_prev."""
        if not self._counted:
            return None
        if self._count_work is not None:
            count, work = self._count_work
            count = count[:1]
        else:
            count, work = self._buckets[self._count_bucket].count, self._launched[self._count_bucket][1]
        work.wait()
        self._last_count = self._local_count
        total = count.real if count.is_complex() else count
        if total.device.type == "cpu":
            n = max(total.item(), 1.0)
            factor = None if n == self._previous_total else self._previous_total / n
            self._previous_total = n
            return factor
        n_tensor = total.to(torch.float64).clamp_min(1.0).reshape(())  # stays on the device
        factor_t = self._previous_total / n_tensor
        self._previous_total = n_tensor
        return factor_t

    def _finish(self) -> None:
        """Final callback of a synchronizing backward: launches what is left,
        waits for every bucket, writes the averages into ``.grad``."""
        try:
            while self._next < len(self._order):
                self._wait_previous()
                self._launch(self._order[self._next])
                self._next += 1
            if self._hook is not None:
                factor: float | torch.Tensor | None = self._finish_hooked()
            else:
                if self._count_work is not None:
                    self._count_work[1].wait()
                factor = self._correction()
                for _, work in self._launched.values():
                    work.wait()
            self._send_buffers()
            changed = self._changed_ranks()
            if changed:  # raises unless every rank made the same change (nothing written into .grad then)
                self._agree_on_change(changed)
            for b, (present, work) in self._launched.items():
                bucket = self._buckets[b]
                if factor is not None:
                    bucket.data.mul_(factor)
                if all(present):
                    torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)
                    continue
                _copy_back(bucket, present)
            if changed:
                alpha = self._alpha if self._alpha is not None else 0.0
                if self._hook is not None:
                    alpha = alpha / self.world_size  # the new buckets are summed, without the hook's division
                weight = 0.0 if self._counted and self._local_count == 0 else alpha
                self._adopt_change(weight if factor is None else weight * factor, contribute=True)
        finally:
            self._clear_counts()
            self._reset()

    # -- a layout change after construction --------------------------------

    def _changed_ranks(self) -> list[int]:
        """The ranks whose module changed structure since the buckets were
        built, from the marks of the first bucket sent (after it arrived)."""
        if not self._order:
            return []
        marks = self._buckets[self._order[0]].marks  # on CUDA: one read of world_size numbers per synchronization
        return [r for r, m in enumerate(marks.tolist()) if m != 0]

    def _agree_on_change(self, changed: Sequence[int]) -> None:
        """Collective, on every rank once a synchronization's marks show a
        change: gathers every rank's layout (and a hash of the values of the
        tensors that are new since the build) and raises ValueError on every
        rank, naming each changed rank and what it changed, unless every rank
        made the same change with the same values."""
        dist = _dist()
        named_params = list(self.module.named_parameters())
        named_buffers = list(self.module.named_buffers())
        grads = [p for _, p in named_params if p.requires_grad]
        lines = self._layout(named_params, named_buffers, _C.make_buckets(grads, self.bucket_bytes))
        known = {entry[2] for entry in self._structure}
        values = [  # tensors new since the build must hold the same values everywhere
            f"{kind} {name!r} values {_digest(t)}"
            for kind, named in (("parameter", named_params), ("buffer", named_buffers))
            for name, t in named
            if id(t) not in known
        ]
        what = _describe_change(self._structure, _structure_of(self.module)) if self._pending else []
        reports: list[Any] = [None] * self.world_size
        dist.all_gather_object(reports, (lines, values, what), group=self.group)
        if len(changed) == self.world_size and all(r[:2] == reports[0][:2] for r in reports):
            return  # the same change everywhere: adopted after this synchronization
        parts = [f"rank {r}: {'; '.join(reports[r][2]) or 'its layout'}" for r in changed]
        unchanged = [r for r in range(self.world_size) if r not in changed]
        if unchanged:
            tail = f"rank{'s' if len(unchanged) > 1 else ''} {', '.join(map(str, unchanged))} did not change"
        else:
            tail = "the changes differ between ranks (the tensors' values too, for replaced ones)"
        raise ValueError(
            "DataParallel(process_group=...): the module's layout changed after construction on "
            f"{'rank' if len(changed) == 1 else 'ranks'} {', '.join(map(str, changed))} ({' | '.join(parts)}), "
            f"but {tail}. Every rank must make the same change before the same forward; this backward's "
            "gradients were left as they were, not synchronized"
        )

    def _adopt_change(self, weight: float | torch.Tensor, contribute: bool) -> None:
        """After every rank made the same change: rebuilds the buckets
        (collective: layout check, then parameters and buffers from rank 0,
        which every rank already holds) and synchronizes the gradients of the
        parameters the old buckets did not cover, with this rank's `weight`
        of the synchronization (zeros where not `contribute`: a joined rank)."""
        covered = {id(p) for p in self._params}
        self._build()
        fresh = [p for p in self._params if id(p) not in covered]
        if not fresh:
            return
        dist = _dist()
        for group in _C.make_buckets(fresh, self.bucket_bytes):
            bucket = _AllReduceBuffer([fresh[i] for i in group], self.device)
            present = [contribute and p.grad is not None for p in bucket.params]
            for view, p, had in zip(bucket.views, bucket.params, present):
                if had:
                    view.copy_(p.grad)
                else:
                    view.zero_()
            bucket.flags.copy_(torch.tensor(present, dtype=bucket.flat.dtype))
            if isinstance(weight, torch.Tensor) or weight != 1.0:
                bucket.data.mul_(weight)
            dist.all_reduce(bucket.flat, group=self.group)
            if not contribute:
                continue
            _copy_back(bucket, present)

    # -- Join (uneven inputs) ---------------------------------------------

    def _join_state(self, active: bool) -> tuple[int, bool]:
        """One all-reduce per forward under Join: element r is 1 where rank r
        has not joined, the last one counts the ranks whose backward will
        synchronize. Returns the highest rank not joined (the source of
        buffers, as DDP's) and whether the backward synchronizes."""
        state = torch.zeros(self.world_size + 1, dtype=torch.float32, device=self.device)
        if active:
            state[self.rank] = 1
            state[-1] = 1 if self._no_sync_depth == 0 else 0
        _dist().all_reduce(state, group=self.group)
        values = state.tolist()
        active_ranks = [r for r, v in enumerate(values[:-1]) if v != 0]
        return (max(active_ranks) if active_ranks else 0), values[-1] != 0

    def join_step(self, divide_by_initial_world_size: bool) -> None:
        """A joined rank's part of one training forward and backward of the
        others (the JoinHook's main hook): the same collectives, with zero
        gradients. Its sample count in the weights is that of its last
        synchronization with `divide_by_initial_world_size` (with equal local
        batches: DDP's division by the initial world size), else 0 (the mean
        over the samples of the ranks still training)."""
        src, sync = self._join_state(active=False)
        self._buffer_src = src
        if self.forward_sync_buffers and self._buffer_groups:
            self._broadcast(self._buffers, src=src)
        if not sync or not self._buckets:
            return
        dist = _dist()
        phantom = float(self._last_count if divide_by_initial_world_size else 0)
        self._reset()
        self._started = True
        if self._hook is not None:
            self._join_step_hooked(phantom)
            return
        count_work = None
        if self._count_bucket is None:
            count = torch.tensor([phantom, 0.0], dtype=torch.float64, device=self.device)
            count_work = (count, dist.all_reduce(count, group=self.group, async_op=True))
        works = []
        for b in self._order:
            bucket = self._buckets[b]
            bucket.flat.zero_()
            if b == self._count_bucket:
                bucket.count.fill_(phantom)
            if self._pending:
                bucket.marks[self.rank] = 1
            works.append(dist.all_reduce(bucket.flat, group=self.group, async_op=True))
        if count_work is not None:
            count_work[1].wait()
            total, counted = count_work[0].tolist()
        for work in works:
            work.wait()
        if count_work is None:
            carrier = self._buckets[self._count_bucket]
            total, counted = carrier.count.real.item(), carrier.counted.real.item()
        if counted != 0:
            self._previous_total = max(float(total), 1.0)  # N_prev stays the same on every rank
        self._send_buffers()
        changed = self._changed_ranks()
        if changed:
            self._agree_on_change(changed)
            self._adopt_change(0.0, contribute=False)

    def _join_step_hooked(self, phantom: float) -> None:
        """:meth:`join_step` with a communication hook: the collectives of a
        synchronization with one (the count once before the first, the
        hook on zero buckets in order, each waited for, the side tensor)."""
        if self._ref is None:
            total, counted = self._count_all(phantom, False)
            if counted:
                self._ref = max(total, 1.0)
        for b in self._order:
            bucket = self._buckets[b]
            bucket.flat.zero_()
            bucket.flags.zero_()
            self._call_hook(b).wait()
        total, counted = self._send_side(phantom, False)
        if counted:
            n = max(total, 1.0)
            self._ref = n if self._ref is None else max(self._ref, n)
        self._send_buffers()
        changed = self._changed_ranks()
        if changed:
            self._agree_on_change(changed)
            self._adopt_change(0.0, contribute=False)

    def join_finish(self, is_last_joiner: bool) -> None:
        """After every rank joined (the JoinHook's post hook): parameters, and
        buffers with ``forward_sync_buffers``, from the highest of the ranks that
        joined last, as DDP."""
        dist = _dist()
        rank = torch.tensor([float(self.rank) if is_last_joiner else -1.0], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.group)
        src = int(rank.item())
        tensors = list(self.module.parameters())
        if self.forward_sync_buffers:
            tensors += list(self.module.buffers())
        if tensors:
            self._broadcast(tensors, fresh=True, src=src)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "DataParallel with a process_group cannot be pickled or copied (it holds a process group and hooks); "
            "save or copy its module or state_dict() instead"
        )

    def __del__(self) -> None:
        for handle in getattr(self, "_hook_handles", ()):
            handle.remove()


class DataParallelJoinHook(JoinHook):
    """The join hook of ``DataParallel(..., process_group=pg)``: while other
    ranks train, a joined rank shadows each of their training forwards and
    backward passes (:meth:`GradientSync.join_step`); once all joined, the
    model is broadcast from the last joiner (:meth:`GradientSync.join_finish`)."""

    def __init__(self, sync: GradientSync, divide_by_initial_world_size: bool = True) -> None:
        super().__init__()
        self.sync = sync
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        self.sync.join_step(self.divide_by_initial_world_size)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.sync.join_finish(is_last_joiner)


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
