"""dpcore.memory_report: what dpcore holds on each device of a wrapper's list, by kind, and on CUDA the allocator's
peak beside it (docs/sharded_optimizer.md, "Memory")."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from dpcore.data_parallel import DataParallel
from dpcore.sharded_optimizer import ShardedOptimizer

__all__ = ["DeviceMemory", "memory_report"]


class DeviceMemory(NamedTuple):
    """Bytes held at one position of the device list: the wrapper's ``module`` (position 0), the ``replicas``' copies
    of its parameters and buffers, ``gradients`` (the module's ``.grad``; a sharded optimizer's working copies'),
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


def memory_report(dp: DataParallel, optimizer: torch.optim.Optimizer | None = None) -> list[DeviceMemory]:
    """One :class:`DeviceMemory` per position of ``dp.device_ids`` (one for the module's device where it runs as
    is). A plain `optimizer`'s state is counted where the module is (position 0); a :class:`ShardedOptimizer`'s at
    each position as it reports it (:meth:`ShardedOptimizer.held_bytes`). Replicas count from the first call that
    made them."""
    if not isinstance(dp, DataParallel):
        raise TypeError(f"dp: expected a dpcore.DataParallel, but got {type(dp).__name__}")
    module = dp.module
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    devices = list(dp.device_ids) or [torch.device("cpu") if first is None else first.device]
    cache = dp.replica_cache
    replica = cache.replica_bytes() if cache is not None else 0
    held: dict[int, dict[str, int]] = {}
    if isinstance(optimizer, ShardedOptimizer):
        held = optimizer.held_bytes()
    elif optimizer is not None:
        state = [t for t in torch.utils._pytree.tree_leaves(dict(optimizer.state)) if isinstance(t, torch.Tensor)]
        held = {0: {"optimizer_state": _bytes(state)}}
    report = []
    for position, device in enumerate(devices):
        own: dict[str, Any] = held.get(position, {})
        on_module = position == 0
        report.append(
            DeviceMemory(
                position,
                device,
                module=_bytes(itertools.chain(module.parameters(), module.buffers())) if on_module else 0,
                replicas=replica if position > 0 else 0,
                gradients=(_bytes(p.grad for p in module.parameters()) if on_module else 0) + own.get("gradients", 0),
                optimizer_state=own.get("optimizer_state", 0),
                working_copies=own.get("working_copies", 0),
                allocator_peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            )
        )
    return report
