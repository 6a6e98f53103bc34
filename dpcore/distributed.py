"""Hybrid data parallelism: dpcore.DataParallel(..., process_group=pg).

Every process runs dpcore's in-process data parallelism over its own
devices (replica 0 is the master module); :class:`GradientSync` joins the
processes of a ``torch.distributed`` group into one training job, as DDP
does (the rules: docs/hybrid.md; the mechanism: docs/design.md, "Hybrid").
It coordinates, per forward and backward:

* dpcore/_layout.py: the layout every rank must share, compared at
  construction, and the agreement on a change made after it;
* dpcore/_buckets.py: the bucketed all-reduce of the gradients, weighted by
  each process's share of the samples, launched as a C++ counter
  (csrc/dpcore/grad_ready.h) finds buckets complete;
* dpcore/_comm_hooks.py: ``register_comm_hook`` (DDP's hooks);
* dpcore/_join.py: ``Join`` (uneven inputs);
* the buffers: rank 0's, before each training forward and after each
  synchronizing backward (``forward_sync_buffers``);
* dpcore/sync_batchnorm.py (``AcrossProcesses``): BatchNorm across processes.

Only forwards that can start a gradient synchronization communicate (grad
mode on and something trainable), so one rank may evaluate alone; a failing
peer surfaces as the backend's error within the group's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dpcore._buckets import BucketReducer, SampleCounts, weak_call, all_reduce_fresh, broadcast, flat_groups
from dpcore._comm_hooks import GradBucket, HookedReducer, check_hook
from dpcore._join import DataParallelJoinHook, notify
from dpcore._layout import agree_on_change, check_layout, layout_lines, structure_of
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


def _scaled_by(factor: float) -> Any:
    """A gradient hook multiplying by `factor`."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    return hook


class GradientSync:
    """The cross-process half of ``DataParallel(..., process_group=pg)``.
    ``module`` is the master (replica 0), all of whose parameters and
    buffers sit on ``device``. DataParallel calls :meth:`before_forward` and
    :meth:`after_forward` around each forward. Every process of the group
    must construct it, run the forwards that can synchronize
    (:meth:`can_sync`) and backward passes in the same sequence (same
    ``no_sync`` use), as with DDP; other forwards are local."""

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
        self.bucket_bytes = int(bucket_bytes)
        self.no_sync_depth = 0
        self.pending = False  # the module's structure changed since the build; not yet agreed with the others
        self.counts = SampleCounts()
        self.reducer: BucketReducer = None  # type: ignore[assignment]  # set by _build
        self._hook: tuple[Any, Any] | None = None  # (hook, state) of register_comm_hook
        self._buffer_src = 0  # the rank whose buffers the latest training forward used
        self._build(initial=True)
        # Synchronized BatchNorm across processes: a group of its own (see batchnorm_across).
        self.batchnorm_group: Any = None
        self.timeout = _timeout_of(process_group, device)
        if sync_batchnorm and self.world_size > 1:
            self.batchnorm_group = _twin_group(process_group, self.timeout)
        _OWNERS[module] = weakref.ref(self)

    def _options(self) -> str:
        """The options every rank must share, as one layout line."""
        return f"forward_sync_buffers={self.forward_sync_buffers}, init_sync_buffers={self.init_sync_buffers}"

    def _build(self, initial: bool = False) -> None:
        """(Re)builds the buckets for the module's current structure;
        collective: layout check, then parameters and buffers from rank 0
        (buffers: with ``init_sync_buffers`` at construction, else with
        ``forward_sync_buffers``)."""
        self.pending = False
        self._structure = structure_of(self.module)
        named_params = list(self.module.named_parameters())
        named_buffers = list(self.module.named_buffers())
        self._params = [p for _, p in named_params if p.requires_grad]
        self._indices = _C.make_buckets(self._params, self.bucket_bytes)
        lines = layout_lines(named_params, named_buffers, self._indices, self._options())
        check_layout(lines, self.group, self.device, self.world_size)
        send_buffers = self.init_sync_buffers if initial else self.forward_sync_buffers
        shared = [t for _, t in named_params + (named_buffers if send_buffers else [])]
        broadcast(flat_groups(shared, self.device, self.bucket_bytes), 0, self.rank, self.group)
        self._buffer_groups = flat_groups([b for _, b in named_buffers], self.device, self.bucket_bytes)
        self._make_reducer()

    def _make_reducer(self) -> None:
        """The reducer of the current buckets (its hooks replace the old one's)."""
        if self.reducer is not None:
            self.reducer.close()
        finish = functools.partial(weak_call, weakref.ref(self), "_finish")
        args = (self._params, self._indices, self.device, self.group, self.counts, finish)
        self.reducer = BucketReducer(*args) if self._hook is None else HookedReducer(*args, hook=self._hook)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """DDP's ``register_comm_hook``: from then on every gradient bucket
        is sent by ``hook(state, bucket)`` (dpcore/_comm_hooks.py). Once
        only, on every rank, before the first synchronizing backward."""
        check_hook(state, hook)
        if self._hook is not None:
            raise RuntimeError(
                "register_comm_hook: a communication hook is already registered; only one can be, as with DDP"
            )
        if self.counts.started or self.reducer.task != -1:
            raise RuntimeError(
                "register_comm_hook: must be called before the first backward that synchronizes gradients (as "
                "DDP's), on every rank; this wrapper has already synchronized"
            )
        self._hook = (hook, state)
        self._make_reducer()

    # -- the reducer's state, as the tests read it ------------------------

    @property
    def _buckets(self) -> list[Any]:
        return self.reducer.buckets

    @property
    def _count_bucket(self) -> int | None:
        return self.reducer.count_bucket

    @_count_bucket.setter
    def _count_bucket(self, value: int | None) -> None:
        self.reducer.count_bucket = value

    @property
    def _task(self) -> int:
        return self.reducer.task

    @property
    def _launched(self) -> dict[int, Any]:
        return self.reducer.launched

    @property
    def _pending(self) -> bool:
        return self.pending

    # -- forward ----------------------------------------------------------

    def check_structure(self) -> None:
        """Notes (no collective) that the module's structure changed since
        the last build. DataParallel calls it whenever its replica cache finds
        such a change; the change is agreed with the other processes at the
        next synchronization (its first bucket carries one mark per rank)."""
        if structure_of(self.module) != self._structure:
            self.pending = True

    def can_sync(self) -> bool:
        """Whether a forward run now can start a gradient synchronization:
        grad mode on (so not inference mode either) and a parameter that
        requires grad. Forwards that cannot make no collective."""
        return torch.is_grad_enabled() and bool(self._params or self.pending)

    def before_forward(self, joinable: Any = None) -> None:
        """Drops the state of a backward that raised; in a forward that can
        start a gradient synchronization, and only there: under an enabled
        Join (`joinable` is the wrapper) the join context's collectives,
        then the buffers from rank 0 (under Join, the highest rank still
        training, as DDP)."""
        reducer = self.reducer
        if reducer.task != -1:  # a synchronizing backward raised: start afresh
            reducer.reset()
            self.counts.clear()
        if self.can_sync():
            self.send_buffers(notify(self, joinable))

    def send_buffers(self, src: int) -> None:
        """With ``forward_sync_buffers``: rank `src`'s buffers to every rank.
        Before a training forward (the DDP rule), and at the end of its
        synchronizing backward from the same rank, after the gradient
        collectives: every rank then holds what DDP's next forward would
        broadcast, so no forward that cannot synchronize needs a collective."""
        self._buffer_src = src
        if self.forward_sync_buffers and self._buffer_groups:
            broadcast(self._buffer_groups, src, self.rank, self.group)

    def batchnorm_across(self, local_batch: int, summed: bool) -> AcrossProcesses | None:
        """What synchronizes BatchNorm across the processes in the forward
        about to run (dpcore/sync_batchnorm.py), or None: without
        ``sync_batchnorm``, with one process, or in a forward that cannot
        synchronize. Its collectives go over a group of their own; the
        gradient buckets of such a synchronization wait for the final
        callback, after BatchNorm's collectives of backward, so that every
        rank issues its collectives in one order. `local_batch` and `summed`
        give this process's gradient weight, as :meth:`after_forward` counts it."""
        if self.batchnorm_group is None or not self.can_sync():
            return None
        return AcrossProcesses(self.batchnorm_group, self.timeout, 1.0 if summed else float(local_batch))

    def after_forward(self, output: Any, local_batch: int, summed: bool) -> Any:
        """Arms the next backward and records the forward's batch size for
        its weights; returns `output`, with `summed` (a criterion with
        ``reduction="sum"``) with every tensor that carries autograd history
        replaced by a view whose gradient is multiplied by the process count."""
        if not torch.is_grad_enabled():
            return output
        if self.pending and not self.reducer.buckets:
            # Nothing synchronizes yet, so no bucket can carry the change:
            # rebuild now (collective; every rank must make the same change).
            self._build()
        if not self._params:
            return output
        self.reducer.arm(self.no_sync_depth == 0, self.batchnorm_group is not None, self.pending)
        if not summed:
            self.counts.record(local_batch)
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

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside do not synchronize."""
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1

    # -- the end of a synchronizing backward -------------------------------

    def _finish(self) -> None:
        """Final callback of a synchronizing backward: the rest of the
        buckets, the buffers, the agreement on a layout change, ``.grad``."""
        reducer = self.reducer
        try:
            factor = reducer.finish()
            self.send_buffers(self._buffer_src)
            changed = self.agree_if_changed()  # raises unless every rank made the same change
            reducer.write_back(factor)
            if changed:
                self.adopt_change(reducer.fresh_weight(factor), contribute=True)
        finally:
            self.counts.clear()
            self.reducer.reset()

    def agree_if_changed(self) -> bool:
        """After a synchronization: whether some rank's layout changed (its
        mark arrived); if so, the agreement (dpcore/_layout.py), which raises
        ValueError on every rank unless every rank made the same change."""
        changed = self.reducer.changed_ranks()
        if changed:
            agree_on_change(
                self.module,
                self._structure,
                self.pending,
                changed,
                bucket_bytes=self.bucket_bytes,
                options=self._options(),
                group=self.group,
                world_size=self.world_size,
            )
        return bool(changed)

    def adopt_change(self, weight: float | torch.Tensor, contribute: bool) -> None:
        """After every rank made the same change: rebuilds the buckets and
        all-reduces the gradients of the parameters the old ones did not
        cover, with this rank's `weight` (zeros where not `contribute`)."""
        covered = {id(p) for p in self._params}
        self._build()
        fresh = [p for p in self._params if id(p) not in covered]
        if fresh:
            all_reduce_fresh(fresh, weight, contribute, self.device, self.group, self.bucket_bytes)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "DataParallel with a process_group cannot be pickled or copied (it holds a process group and hooks); "
            "save or copy its module or state_dict() instead"
        )

    def __del__(self) -> None:
        reducer = getattr(self, "reducer", None)
        if reducer is not None:
            reducer.close()
