"""dpcore.memory_report: what dpcore holds on each device of a wrapper's list, by kind, and on CUDA the allocator's
peak beside it; memory_peak: the highest of those holdings over a span of training, such as one step (forward,
backward, optimizer step), sampled where they change (docs/sharded_optimizer.md, "Memory")."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from dpcore.data_parallel import DataParallel
from dpcore.sharded_optimizer import ShardedOptimizer

__all__ = ["DeviceMemory", "MemoryPeak", "memory_peak", "memory_report"]


class DeviceMemory(NamedTuple):
    """Bytes held at one position of the device list: the wrapper's ``module`` (position 0; with ``shard_parameters=``
    each position's shards of its parameters), the ``replicas``' copies of its parameters and buffers (with
    ``shard_parameters=`` the units gathered there now), ``gradients`` (the module's ``.grad``; a sharded optimizer's working copies'),
    ``optimizer_state``, ``working_copies`` (a sharded optimizer's), and on CUDA ``allocator_peak``, torch's
    ``max_memory_allocated`` of that device (shared by the positions of a repeated device), else None."""

    position: int
    device: torch.device
    module: int
    replicas: int
    gradients: int
    optimizer_state: int
    working_copies: int
    allocator_peak: int | None

    @property
    def total(self) -> int:
        """The bytes dpcore holds here (the allocator's peak aside)."""
        return self.module + self.replicas + self.gradients + self.optimizer_state + self.working_copies


def _bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of distinct `tensors` (a tensor listed twice, as tied weights are, counted once)."""
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of `optimizer`'s state tensors (one shared by two entries counted once)."""
    return _bytes(t for t in tree_leaves(dict(optimizer.state)) if isinstance(t, torch.Tensor))


def _check_wrapper(dp: object) -> None:
    if not isinstance(dp, DataParallel):
        raise TypeError(f"dp: expected a dpcore.DataParallel, but got {type(dp).__name__}")


def memory_report(dp: DataParallel, optimizer: torch.optim.Optimizer | None = None) -> list[DeviceMemory]:
    """One :class:`DeviceMemory` per position of ``dp.device_ids`` (one for the module's device where it runs as
    is). A plain `optimizer`'s state is counted where the module is (position 0); a :class:`ShardedOptimizer`'s at
    each position as it reports it (:meth:`ShardedOptimizer.held_bytes`). Replicas count from the first call that
    made them."""
    _check_wrapper(dp)
    module = dp.module
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    devices = list(dp.device_ids) or [torch.device("cpu") if first is None else first.device]
    cache = dp.replica_cache
    replica = cache.replica_bytes() if cache is not None else 0
    sharded = dp.sharded_parameters
    placed = sharded.held_bytes() if sharded is not None else {}
    held: dict[int, dict[str, int]] = {}
    if isinstance(optimizer, ShardedOptimizer):
        held = optimizer.held_bytes()
    elif optimizer is not None:
        held = {0: {"optimizer_state": _state_bytes(optimizer)}}
    report = []
    for position, device in enumerate(devices):
        own: dict[str, Any] = held.get(position, {})
        on_module = position == 0
        shards = placed.get(position, {"parameters": 0, "gathered": 0})
        whole = _bytes(itertools.chain(module.parameters(), module.buffers())) if on_module else shards["parameters"]
        report.append(
            DeviceMemory(
                position,
                device,
                module=whole,
                replicas=(replica if position > 0 else 0) + shards["gathered"],
                gradients=(_bytes(p.grad for p in module.parameters()) if on_module else 0) + own.get("gradients", 0),
                optimizer_state=own.get("optimizer_state", 0),
                working_copies=own.get("working_copies", 0),
                allocator_peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            )
        )
    return report


class MemoryPeak:
    """The peak, at each position of a wrapper's list, of what dpcore holds there (:func:`memory_report`'s totals) over
    the span of a ``with`` block, such as one training step. dpcore's holdings change only at a few points of a step,
    and a sample is taken at each:

    * entering and leaving the block, and wherever :meth:`sample` is called (e.g. after the forward);
    * at the start of each ``optimizer.step()``: after the backward, the gradients held (``.grad`` on position 0, or
      a ``shard_gradients=True`` wrapper's at their owners), the state as it was;
    * at the end of each shard's own step (a :class:`ShardedOptimizer`'s, on its thread): that position's state as
      the step left it (created by the first step), with the gradients the step read still held (a working copy's
      ``.grad``, the sharded gradients, dropped only once every shard is done); for a plain optimizer at the end of
      its step;
    * at the end of ``optimizer.step()`` (before ``zero_grad``: the gradients of the default mode still held).

    ``report`` then holds, per position, the :class:`DeviceMemory` of the sample with that position's highest total
    (on CUDA with ``allocator_peak`` torch's ``max_memory_allocated`` over the block: its peak stats are reset on
    entering). Transient buffers of the collectives are not dpcore's holdings: the allocator's peak counts them."""

    def __init__(self, dp: DataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        _check_wrapper(dp)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, but got {type(optimizer).__name__}")
        self.dp, self.optimizer = dp, optimizer
        self._best: list[DeviceMemory] = []
        self._last: list[DeviceMemory] = []
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._gpus: list[int] = []

    def sample(self) -> None:
        """Takes a sample now: :func:`memory_report` of every position."""
        self._merge(memory_report(self.dp, self.optimizer))

    def _merge(self, report: list[DeviceMemory]) -> None:
        """Keeps, per position, the higher-total entry of `report` and of what was kept."""
        with self._lock:
            self._last = list(report)
            if not self._best:
                self._best = list(report)
                return
            self._best = [new if new.total > old.total else old for old, new in zip(self._best, report)]

    def _sample_shard(self, shard: Any) -> None:
        """A sample of `shard`'s position alone at the end of its step, on its thread while other shards may still
        step (nothing of theirs is read): the last full sample, with this position's gradients, state and working
        copies as :meth:`ShardedOptimizer.held_bytes` counts them, now."""
        with self._lock:
            last = self._last[shard.position] if self._last else None
        if last is None:
            return
        store = getattr(self.optimizer, "_store", None)
        copies = [w for m, w in shard.pairs if w is not m] if shard.copies else []
        stored = [] if store is None else [store.get(id(m)) for m, _ in shard.pairs]
        # the module's .grad, whole at position 0; with sharded gradients the shards' own, set for the step only
        own_module = shard.position == 0 and store is None
        module_grads = _bytes(p.grad for p in self.dp.module.parameters()) if own_module else 0
        self._merge_one(
            last._replace(
                gradients=module_grads + _bytes([w.grad for w in copies] + stored),
                optimizer_state=_state_bytes(shard.optimizer),
                working_copies=_bytes(copies),
            )
        )

    def _merge_one(self, entry: DeviceMemory) -> None:
        """Keeps `entry` for its position where its total is the higher."""
        with self._lock:
            k = entry.position
            if entry.total > self._best[k].total:
                self._best[k] = entry

    def __enter__(self) -> MemoryPeak:
        devices = list(self.dp.device_ids)
        self._gpus = sorted({d.index for d in devices if d.type == "cuda" and d.index is not None})
        for i in self._gpus:
            torch.cuda.synchronize(i)
            torch.cuda.reset_peak_memory_stats(i)
        self._best, self._last = [], []
        self.sample()
        opt = self.optimizer
        if opt is not None:
            self._handles.append(opt.register_step_pre_hook(lambda *_: self.sample()))
            self._handles.append(opt.register_step_post_hook(lambda *_: self.sample()))
            shards = getattr(opt, "_shards", None) if isinstance(opt, ShardedOptimizer) else None
            for shard in shards or []:
                hook = (lambda s: lambda *_: self._sample_shard(s))(shard)
                self._handles.append(shard.optimizer.register_step_post_hook(hook))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if kind is None:
            self.sample()
        for i in self._gpus:
            torch.cuda.synchronize(i)
        self._best = [
            r._replace(allocator_peak=torch.cuda.max_memory_allocated(r.device)) if r.device.type == "cuda" else r
            for r in self._best
        ]

    @property
    def report(self) -> list[DeviceMemory]:
        """Per position, the sample with its highest total (empty before the block)."""
        return list(self._best)

    @property
    def totals(self) -> list[int]:
        """Per position, its peak total."""
        return [r.total for r in self._best]


def memory_peak(dp: DataParallel, optimizer: torch.optim.Optimizer | None = None) -> MemoryPeak:
    """A :class:`MemoryPeak` over `dp`'s positions (with `optimizer`'s holdings, as :func:`memory_report` counts
    them), to use as ``with dpcore.memory.memory_peak(dp, opt) as peak: ...``; ``peak.report`` after the block."""
    return MemoryPeak(dp, optimizer)
