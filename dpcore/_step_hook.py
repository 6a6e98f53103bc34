"""The process-wide optimizer step post-hook that makes fused and ``.data`` steps visible to cached replicas
(docs/design.md, "Optimizer steps")."""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["track", "exempt"]

_lock = threading.Lock()
#: id() of every tracked master tensor -> how many live caches (which keep it alive) track it.
_tracked: collections.Counter[int] = collections.Counter()
_handle: Any = None
#: id() of every live optimizer whose steps mark nothing (exempt()).
_exempt: set[int] = set()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Bumps the version counters of the stepped optimizer's tracked parameters."""
    if not _tracked or id(optimizer) in _exempt:
        return
    changed = [p for group in optimizer.param_groups for p in group["params"] if id(p) in _tracked]
    if changed:
        torch.autograd.graph.increment_version(changed)


def track(owner: object, tensors: Iterable[torch.Tensor]) -> None:
    """Until ``owner`` (a replica cache) is collected, an optimizer step over any of ``tensors`` bumps its version
    counter. Registers the hook on first use."""
    global _handle
    ids = [id(t) for t in tensors]
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_post_hook(_after_step)
        _tracked.update(ids)
    weakref.finalize(owner, _untrack, ids)


def exempt(optimizer: torch.optim.Optimizer) -> None:
    """While ``optimizer`` lives, its steps mark nothing: it brings the replicas up to date (ShardedOptimizer)."""
    _exempt.add(id(optimizer))
    weakref.finalize(optimizer, _exempt.discard, id(optimizer))


def _untrack(ids: list[int]) -> None:
    global _tracked
    with _lock:
        _tracked -= collections.Counter(ids)  # keeps the positive counts only
