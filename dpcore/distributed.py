"""``DataParallel(..., process_group=pg)``: :class:`GradientSync` joins a ``torch.distributed`` group's processes into
one training job, as DDP does. The rules: docs/hybrid.md; the mechanism: docs/design.md, "Hybrid"."""

from __future__ import annotations

import contextlib
import datetime
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook

from dpcore._buckets import BucketReducer, GradBucket, HookedReducer, SampleCounts, broadcast, check_hook, flat_groups
from dpcore._buckets import weakly
from dpcore._layout import Items, Peers, agree_on_change, check_layout, layout_of, structure_of
from dpcore._options import Options
from dpcore._pytree import map_tensors
from dpcore.replicate import caller_stacklevel
from dpcore.sync_batchnorm import AcrossProcesses

__all__ = ["GradientSync", "GradBucket", "DataParallelJoinHook"]

#: The live GradientSync of each module (a second would reduce every gradient twice).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[GradientSync]] = weakref.WeakKeyDictionary()


def buffer_sync_options(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(forward, init): whether buffers go out from rank 0 while training and at construction, resolved (and warned
    about) as torch 2.13's DDP does."""
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
        warnings.warn(message, FutureWarning, stacklevel=caller_stacklevel())
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def option_items(options: Options, resolved: tuple[bool, bool]) -> Items:
    """The options every rank must agree on, as :class:`dpcore._layout.Layout`'s items: what is compared (their effect;
    `resolved`: :func:`buffer_sync_options`'s) and how an error shows them (the names and values given)."""
    forward, init = resolved
    sent = {
        (True, True): "sent at construction and before training forwards",
        (False, True): "sent at construction only",
    }
    buffers = f"broadcast_buffers={options.broadcast_buffers!r}, forward_sync_buffers={options.forward_sync_buffers!r}"
    criterion = options.criterion
    loss = [] if criterion is None else [f"criterion={getattr(criterion, '__name__', type(criterion).__name__)}"]
    if criterion is not None and options.criterion_reduction is None and options.own_reduction is not None:
        loss[0] += f" with reduction={options.own_reduction!r}"
    loss += [
        f"{name}={getattr(options, name)!r}" for name in ("criterion_reduction", "model_loss") if getattr(options, name)
    ]
    summed = options.reduction == "sum"
    weighted = "the processes' gradients summed" if summed else "the processes' gradients weighted by rows"
    return {
        "buffer options": (f"{forward}, {init}", f"{buffers} (buffers {sent.get((forward, init), 'never sent')})"),
        "sync_batchnorm": (str(options.sync_batchnorm), f"sync_batchnorm={options.sync_batchnorm!r}"),
        "loss": (str(summed), f"{', '.join(loss) or 'no criterion or model_loss'} ({weighted})"),
    }


def join_state(peers: Peers, training: bool, synchronizes: bool) -> tuple[int, bool]:
    """One all-reduce per training forward under Join (`training`: this rank runs it; a joined rank shadows it): the
    highest rank not joined (the source of buffers, as DDP's) and whether the backward synchronizes."""
    state = torch.zeros(peers.world_size + 1, dtype=torch.float32, device=peers.device)
    if training:
        state[peers.rank] = 1
        state[-1] = 1 if synchronizes else 0
    dist.all_reduce(state, group=peers.group)
    values = state.tolist()
    return max((r for r, v in enumerate(values[:-1]) if v != 0), default=0), values[-1] != 0


def notify(joinable: Any, peers: Peers, synchronizes: bool) -> int:
    """In a training forward inside an enabled Join (`joinable`: the wrapper), the join context's collectives; the
    rank whose buffers it uses (else 0)."""
    config = getattr(joinable, "_join_config", None)
    if config is None or not config.enable:
        return 0
    work = Join.notify_join_context(joinable)
    src, _ = join_state(peers, True, synchronizes)
    if work is not None:
        work.wait()
    return src


class DataParallelJoinHook(JoinHook):
    """The join hook of ``DataParallel(..., process_group=pg)``: :meth:`GradientSync.join_hook`'s."""

    def __init__(self, sync: GradientSync, phantom: bool) -> None:
        super().__init__()
        self._sync, self._phantom = sync, phantom

    def main_hook(self) -> None:
        self._sync._shadow(self._phantom)

    def post_hook(self, is_last_joiner: bool) -> None:
        self._sync._from_last_joiner(is_last_joiner)


class GradientSync:
    """The cross-process half of ``DataParallel(..., process_group=pg)`` for the master `module` (replica 0, on the
    first device of `options`), called around each forward. As with DDP, every rank constructs it and runs the same
    synchronizing forwards (:meth:`can_sync`) and backward passes, with the same ``no_sync`` use."""

    def __init__(self, module: nn.Module, options: Options) -> None:
        process_group = options.process_group
        if not dist.is_available():
            raise RuntimeError("process_group: torch.distributed is not available in this build of torch")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group: expected a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD "
                f"after init_process_group), but got {type(process_group).__name__}"
            )
        owner = _OWNERS.get(module)
        if owner is not None and owner() is not None:
            raise ValueError(
                "module: already wrapped by a DataParallel with a process_group that is still alive (its hooks would "
                "all-reduce every gradient a second time); reuse that wrapper, or evaluate through the module itself "
                "or a DataParallel without a process_group"
            )
        device = options.devices[0]
        self.module, self.device, self.group = module, device, process_group
        self.peers = Peers(process_group, dist.get_rank(process_group), dist.get_world_size(process_group), device)
        resolved = self._resolved = buffer_sync_options(options.broadcast_buffers, options.forward_sync_buffers)
        self.forward_sync_buffers, self.init_sync_buffers = resolved
        self._given, self._options = options, option_items(options, resolved)  # the latest forward's
        self.bucket_bytes = options.bucket_bytes
        self.no_sync_depth = 0
        self.pending = False  # the module (or an option) changed since the build; not yet agreed with the others
        self.counts = SampleCounts()
        self.reducer: BucketReducer = None  # type: ignore[assignment]  # set by _build
        self._hook: tuple[Any, Any] | None = None  # (hook, state) of register_comm_hook
        self._buffer_src = 0  # the rank whose buffers the latest training forward used
        self.forward_buffers = True  # DDP's require_forward_param_sync: the next training forward sends buffers
        self.staged: list[list[int]] | None = None  # see send_buffers
        self._armed = (False, False)  # how the latest forward armed the readiness (the next backward synchronizes)
        self._build(initial=True)
        self.batchnorm_group: Any = None  # sync_batchnorm's collectives: a group of its own, of the same ranks
        try:  # what bounds the group's collectives
            timeout = process_group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            timeout = None
        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else dist.default_pg_timeout
        if options.sync_batchnorm and self.peers.world_size > 1:
            ranks = dist.get_process_group_ranks(process_group)
            order = {} if ranks == sorted(ranks) else {"sort_ranks": False}
            backend = dist.get_backend(process_group)
            self.batchnorm_group = dist.new_group(ranks, self.timeout, backend, use_local_synchronization=True, **order)
        _OWNERS[module] = weakref.ref(self)

    def _build(self, initial: bool = False) -> None:
        """Collective: checks the layout, builds its buckets, sends rank 0's parameters and buffers."""
        self.pending = False
        self.layout = layout_of(self.module, self.bucket_bytes, self._options)
        check_layout(self.layout, self.peers)
        buffers = list(self.module.buffers())
        shared = list(self.module.parameters()) + (buffers if initial and self.init_sync_buffers else [])
        broadcast(flat_groups(shared, self.device, self.bucket_bytes), 0, self.peers)
        self._buffer_groups = flat_groups(buffers, self.device, self.bucket_bytes)
        if not initial:  # a rebuild within a step: the buffers as _finish sends them
            self.send_buffers(self._buffer_src, stage=True)
        self._make_reducer()

    def _make_reducer(self) -> None:
        if self.reducer is not None:
            self.reducer.readiness.remove()
        parts = (self.peers, self.layout, self.counts, weakly(self._finish))  # weakly: see weakly's doc
        self.reducer = BucketReducer(*parts) if self._hook is None else HookedReducer(*parts, self._hook)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """DDP's ``register_comm_hook``: once, on every rank, before the first synchronizing backward (which checks that
        every rank registered one)."""
        check_hook(state, hook)
        if self._hook is not None:
            raise RuntimeError(
                "register_comm_hook: a communication hook is already registered; only one can be, as with DDP"
            )
        if self.counts.started:
            raise RuntimeError(
                "register_comm_hook: must be called before the first backward that synchronizes gradients (as "
                "DDP's), on every rank; this wrapper has already synchronized"
            )
        self._hook = (hook, state)
        self._drop_raised()
        self._make_reducer()
        self.reducer.readiness.arm(*self._armed)  # as the latest forward armed the reducer replaced

    def check_structure(self) -> None:
        """Notes a change of the module's structure (agreed at the next synchronization)."""
        if structure_of(self.module) != self.layout.structure:
            self.pending = True

    def can_sync(self) -> bool:
        """Whether a forward now can start a gradient synchronization; no other makes a collective."""
        return torch.is_grad_enabled() and bool(self.layout.params or self.pending)

    def _drop_raised(self) -> None:
        """Drops the state of a synchronizing backward that raised (its task is still set): start afresh."""
        if self.reducer.readiness.task != -1:
            self.reducer.reset()
            self.counts.local, self.counts.counted = 0, False

    def before_forward(self, joinable: Any = None) -> None:
        """Drops the state of a backward that raised; in a forward that can synchronize, the Join notification
        (`joinable`: the wrapper) and, after a synchronizing forward (DDP's schedule), the buffers; in any other, the
        staged buffers."""
        self._drop_raised()
        self._armed = (False, False)
        if self.can_sync():
            self.send_buffers(notify(joinable, self.peers, self.no_sync_depth == 0), send=self.forward_buffers)
            self.forward_buffers = self.no_sync_depth == 0
        elif self.staged is not None:
            self.write_staged()

    def send_buffers(self, src: int, send: bool = True, stage: bool = False) -> None:
        """With ``forward_sync_buffers`` and `send`: rank `src`'s buffers to every rank; with `stage`, they are kept
        aside (:attr:`staged`: this rank's buffers' versions then) for :meth:`write_staged`, and the module keeps its
        own."""
        self._buffer_src, self.staged = src, None
        if send and self.forward_sync_buffers and self._buffer_groups:
            broadcast(self._buffer_groups, src, self.peers, write=not stage)
            if stage and self.peers.rank != src:
                self.staged = [[t._version for t in g.params] for g in self._buffer_groups]

    def write_staged(self) -> None:
        """At a forward that makes no collective where DDP's would send the buffers (the first after a synchronizing
        backward): the staged buffers of rank `src` into this rank's, except those written since they arrived."""
        with torch.no_grad():
            for g, versions in zip(self._buffer_groups, self.staged or []):
                for t, staged, version in zip(g.params, g.views, versions):
                    if t._version == version:
                        t.copy_(staged)
        self.staged = None

    def batchnorm_across(self, local_batch: int, summed: bool) -> AcrossProcesses | None:
        """BatchNorm across the processes for the forward about to run, weighted as :meth:`after_forward` weighs it;
        None where nothing is to synchronize."""
        if self.batchnorm_group is None or not self.can_sync():
            return None
        return AcrossProcesses(self.batchnorm_group, self.timeout, 1.0 if summed else float(local_batch))

    def after_forward(self, output: Any, local_batch: int, options: Options) -> Any:
        """Arms the next backward and records the batch size for its weights; `output`, where the loss of `options` (the
        wrapper's now) is summed, with gradients multiplied by the process count. A loss option changed since the build
        is agreed with the other ranks at the next synchronization, as a layout change is."""
        if not torch.is_grad_enabled():
            return output
        if options is not self._given:
            self._given, self._options = options, option_items(options, self._resolved)
            self.pending = self.pending or self._options != self.layout.options
        if self.pending and not self.reducer.buckets:  # no bucket can carry the change: rebuild now (collective)
            self._build()
        if not self.layout.params:
            return output
        self._armed = (self.no_sync_depth == 0, self.batchnorm_group is not None)
        self.reducer.readiness.arm(*self._armed)
        self.reducer.pending = self.pending
        summed = options.reduction == "sum"
        if not summed:
            self.counts.counted = True
            self.counts.local += int(local_batch)
        if not summed or self.peers.world_size == 1:
            return output
        factor = float(self.peers.world_size)

        def scaled(t: torch.Tensor) -> torch.Tensor:
            if t.grad_fn is None:
                return t
            view = t.view_as(t)  # scaled once, even where one output feeds another
            view.register_hook(lambda grad: grad * factor)
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

    def _finish(self) -> None:
        """Final callback of a synchronizing backward."""
        reducer = self.reducer
        try:
            factor = reducer.finish()
            self.send_buffers(self._buffer_src, stage=True)
            changed = self.agree_if_changed()  # raises unless every rank made the same change
            reducer.write_back(factor)
            if changed:
                self.adopt_change(reducer.fresh_weight(factor), contribute=True)
        finally:
            self.counts.local, self.counts.counted = 0, False
            self.reducer.reset()

    def agree_if_changed(self) -> bool:
        """Whether some rank's layout changed; ValueError unless every rank made the same change."""
        changed = self.reducer.changed_ranks()
        if changed:
            now = layout_of(self.module, self.bucket_bytes, self._options)
            agree_on_change(self.peers, self.module, self.layout, now, changed)
        return bool(changed)

    def adopt_change(self, weight: float | torch.Tensor, contribute: bool) -> None:
        """Rebuilds the buckets and all-reduces the newly covered gradients times `weight` (0 unless `contribute`)."""
        covered = {id(p) for p in self.layout.params}
        self._build()
        for g in flat_groups([p for p in self.layout.params if id(p) not in covered], self.device, self.bucket_bytes):
            present = g.fill([p.grad if contribute else None for p in g.params])
            if isinstance(weight, torch.Tensor) or weight != 1.0:
                g.data.mul_(weight)
            dist.all_reduce(g.flat, group=self.group)
            if contribute:
                g.copy_back(present)

    def join_hook(self, divide_by_initial_world_size: bool = True) -> DataParallelJoinHook:
        """DDP's ``join_hook``: a joined rank shadows the others' collectives, counting its last samples with
        `divide_by_initial_world_size` (else none)."""
        return DataParallelJoinHook(self, bool(divide_by_initial_world_size))

    def _shadow(self, phantom: bool) -> None:
        """A joined rank's part of the others' training step: the same collectives, zero gradients, its last sample
        count if `phantom` (else 0)."""
        src, synchronizes = join_state(self.peers, False, False)
        self.send_buffers(src, send=self.forward_buffers)  # as the others' before_forward (DDP's join hook)
        self.forward_buffers = synchronizes
        if not synchronizes or not self.reducer.buckets:
            return
        self.reducer.shadow(float(self.counts.last if phantom else 0), self.pending)
        self.send_buffers(src, stage=True)
        if self.agree_if_changed():
            self.adopt_change(0.0, contribute=False)

    def _from_last_joiner(self, is_last_joiner: bool) -> None:
        """After every rank joined: the model from the highest of the last joiners."""
        rank = torch.tensor([float(self.peers.rank) if is_last_joiner else -1.0], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.group)
        tensors = list(self.module.parameters())
        self.staged = None  # the last joiner's buffers replace them
        if self.forward_sync_buffers:
            tensors += list(self.module.buffers())
        if tensors:
            broadcast(flat_groups(tensors, self.device, self.bucket_bytes), int(rank.item()), self.peers)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "DataParallel with a process_group cannot be pickled or copied (it holds a process group and hooks); "
            "save or copy its module or state_dict() instead"
        )

    def __del__(self) -> None:
        reducer = getattr(self, "reducer", None)
        if reducer is not None:
            reducer.readiness.remove()
