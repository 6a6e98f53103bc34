"""Join (uneven inputs) for the hybrid mode (private), as DDP's; docs/design.md, "Hybrid"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from dpcore._layout import Peers


def join_state(peers: Peers, training: bool, synchronizes: bool) -> tuple[int, bool]:
    """One all-reduce per training forward under Join (`training`: this rank runs
    it; a joined rank shadows it): the highest rank not joined (the source of
    buffers, as DDP's) and whether the backward synchronizes."""
    state = torch.zeros(peers.world_size + 1, dtype=torch.float32, device=peers.device)
    if training:
        state[peers.rank] = 1
        state[-1] = 1 if synchronizes else 0
    dist.all_reduce(state, group=peers.group)
    values = state.tolist()
    return max((r for r, v in enumerate(values[:-1]) if v != 0), default=0), values[-1] != 0


def notify(joinable: Any, peers: Peers, synchronizes: bool) -> int:
    """In a training forward inside an enabled Join (`joinable`: the wrapper),
    the join context's collectives; the rank whose buffers it uses (else 0)."""
    config = getattr(joinable, "_join_config", None)
    if config is None or not config.enable:
        return 0
    work = Join.notify_join_context(joinable)
    src, _ = join_state(peers, True, synchronizes)
    if work is not None:
        work.wait()
    return src


class DataParallelJoinHook(JoinHook):
    """The join hook of ``DataParallel(..., process_group=pg)``: `main()`, a joined
    rank's part of the others' training step; `post(is_last_joiner)`, once every rank joined."""

    def __init__(self, main: Callable[[], None], post: Callable[[bool], None]) -> None:
        super().__init__()
        self._main, self._post = main, post

    def main_hook(self) -> None:
        self._main()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._post(is_last_joiner)
