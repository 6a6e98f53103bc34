"""Join (uneven inputs) for the hybrid mode (private), as DDP's; docs/design.md, "Hybrid"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from dpcore._buckets import broadcast, flat_groups

if TYPE_CHECKING:
    from dpcore.distributed import GradientSync


def _join_state(sync: GradientSync, active: bool) -> tuple[int, bool]:
    """One all-reduce per training forward under Join: the highest rank not
    joined (the source of buffers, as DDP's) and whether the backward synchronizes."""
    state = torch.zeros(sync.world_size + 1, dtype=torch.float32, device=sync.device)
    if active:
        state[sync.rank] = 1
        state[-1] = 1 if sync.no_sync_depth == 0 else 0
    dist.all_reduce(state, group=sync.group)
    values = state.tolist()
    return max((r for r, v in enumerate(values[:-1]) if v != 0), default=0), values[-1] != 0


def notify(sync: GradientSync, joinable: Any) -> int:
    """In a training forward inside an enabled Join (`joinable`: the wrapper),
    the join context's collectives; the rank whose buffers it uses (else 0)."""
    config = getattr(joinable, "_join_config", None)
    if config is None or not config.enable:
        return 0
    work = Join.notify_join_context(joinable)
    src, _ = _join_state(sync, active=True)
    if work is not None:
        work.wait()
    return src


class DataParallelJoinHook(JoinHook):
    """The join hook of ``DataParallel(..., process_group=pg)``."""

    def __init__(self, sync: GradientSync, divide_by_initial_world_size: bool = True) -> None:
        super().__init__()
        self.sync, self.divide_by_initial_world_size = sync, bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        """A joined rank's part of the others' training step: the same collectives,
        zero gradients, its last sample count (0 unless `divide_by_initial_world_size`)."""
        sync = self.sync
        src, synchronizes = _join_state(sync, active=False)
        sync.send_buffers(src, send=sync.forward_buffers)  # as the others' before_forward (DDP's join hook)
        sync.forward_buffers = synchronizes
        if not synchronizes or not sync.reducer.buckets:
            return
        sync.reducer.shadow(float(sync.counts.last if self.divide_by_initial_world_size else 0), sync.pending)
        sync.send_buffers(src, stage=True)
        if sync.agree_if_changed():
            sync.adopt_change(0.0, contribute=False)

    def post_hook(self, is_last_joiner: bool) -> None:
        """After every rank joined: the model from the highest of the last joiners."""
        sync = self.sync
        rank = torch.tensor([float(sync.rank) if is_last_joiner else -1.0], device=sync.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=sync.group)
        tensors = list(sync.module.parameters())
        sync.staged = None  # the last joiner's buffers replace them
        if sync.forward_sync_buffers:
            tensors += list(sync.module.buffers())
        if tensors:
            broadcast(flat_groups(tensors, sync.device, sync.bucket_bytes), int(rank.item()), sync.rank, sync.group)
