"""The shards of a dpcore.ShardedOptimizer: each position's own optimizer and the tensors it steps (the masters
themselves, or working copies on another device), and the optimizer's ``state`` as a view of theirs."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dpcore.replicate import ReplicaCache
    from dpcore.sharded_optimizer import ShardedOptimizer

__all__ = ["Shard", "ShardStates"]


class Shard:
    """One position's optimizer, and the working copies it steps where `copies`."""

    def __init__(self, position: int, device: torch.device, copies: bool) -> None:
        self.position, self.device, self.copies = position, device, copies
        self.optimizer: torch.optim.Optimizer  # set once the groups are laid out
        self.load = 0  # the bytes of its trainable parameters
        self.working: dict[int, torch.Tensor] = {}  # id(master) -> the tensor stepped for it
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master, working), in order
        # id(master) -> the master's (data_ptr, version) when its working copy last equalled it.
        self.seen: dict[int, tuple[int, int]] = {}

    def adopt(self, master: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor this shard steps for `master` (made on first call; `given`: the wrapper's shard of it)."""
        work = self.working.get(id(master))
        if work is None:
            work = master if given is None else given
            if given is None and self.copies:
                with torch.no_grad():
                    work = master.detach().to(self.device, copy=True).requires_grad_(master.requires_grad)
                self.seen[id(master)] = (master.data_ptr(), master._version)
            self.working[id(master)] = work
            self.pairs.append((master, work))
        return work

    def step(
        self, cache: ReplicaCache | None, kwargs: dict[str, Any], store: dict[int, torch.Tensor] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Steps this shard's optimizer (with `kwargs`); with `copies`, on working copies synced from and back to the
        masters, and written into this position's replicas in `cache` (ReplicaCache.write). With `store`
        (shard_gradients: id(master) -> its gradient here) the gradients come from it, ``.grad`` holds them for the
        step only, and nothing is copied back. Returns the (master, tensor stepped) pairs that had a gradient."""
        stepped: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for master, work in self.pairs:
                if store is not None:
                    work.grad = store.get(id(master))
                elif self.copies:
                    work.grad = None if master.grad is None else master.grad.to(self.device)
                if work.grad is not None and (self.copies or store is not None):
                    if self.copies and self.seen[id(master)] != (master.data_ptr(), master._version):
                        work.copy_(master)
                    stepped.append((master, work))
        self.optimizer.step(**kwargs)
        if store is not None or not self.copies:
            for _, work in stepped:
                work.grad = None
            return stepped
        with torch.no_grad():
            for master, work in stepped:
                master.copy_(work)
                work.grad = None
                self.seen[id(master)] = (master.data_ptr(), master._version)
            if cache is not None:
                cache.write(self.position, stepped)
        return stepped

    def view_as_buckets(self) -> None:
        """The trainable tensors this shard steps become views of one flat buffer per dtype, each keeping its strides
        (ZeroRedundancyOptimizer's parameters_as_bucket_view); one with gaps keeps its own storage."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, work in self.pairs:
            if work.requires_grad and torch.empty_like(work).stride() == work.stride():
                by_dtype.setdefault(work.dtype, []).append(work)
        with torch.no_grad():
            for dtype, tensors in by_dtype.items():
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=self.device)
                offset = 0
                for t in tensors:
                    view = flat[offset : offset + t.numel()].as_strided(t.shape, t.stride())
                    t.data = view.copy_(t)
                    offset += t.numel()


class ShardStates(MutableMapping):  # type: ignore[type-arg]
    """``ShardedOptimizer.state``: each master parameter's state, kept in its shard's optimizer."""

    def __init__(self, owner: ShardedOptimizer) -> None:
        self._owner = owner

    def _found(self, param: object) -> tuple[dict[Any, Any], torch.Tensor]:
        """(the shard optimizer's state, the key of `param` there); KeyError if not a parameter."""
        shard = self._owner._shards[self._owner.shard_of(param)]  # type: ignore[arg-type]
        return shard.optimizer.state, shard.working[id(param)]

    def __getitem__(self, param: torch.Tensor) -> Any:
        state, work = self._found(param)
        return state[work]

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        state, work = self._found(param)
        state[work] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        state, work = self._found(param)
        del state[work]

    def __contains__(self, param: object) -> bool:
        try:
            state, work = self._found(param)
        except KeyError:
            return False
        return work in state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for group in self._owner.param_groups for p in group["params"] if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)
