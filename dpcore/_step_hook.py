"""Optimizer steps made visible to cached replicas (private).

Cached replicas (dpcore.replicate.ReplicaCache) copy a bucket of master
tensors to the replicas only when one of them changed, and "changed" means a
new storage or a new version counter value. Most in-place updates bump the
version counter, but some optimizer steps do not: the fused kernels of
``torch.optim.Adam/AdamW/SGD(fused=True)`` (the default of Hugging Face
Trainer), and any ``step()`` that writes through ``p.data``. Without help the
replicas would keep training on stale weights, silently.

This module closes that gap with one process-wide optimizer step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``): after every
``step()`` of any ``torch.optim.Optimizer`` (created before or after the
wrapper, fused or not), the parameters of its ``param_groups`` that a live
replica cache tracks get their version counters bumped
(``torch.autograd.graph.increment_version``), exactly as a non-fused step
would have done. A forward that follows no step copies nothing; other
models' parameters and frozen ones are never touched.

The hook is registered the first time a replica cache with replicas is
built (never at import), and stays registered; with no cache alive it only
walks the stepping optimizer's parameter list. It skips an optimizer whose
class sets ``_marks_own_changes`` (dpcore.ShardedOptimizer: its shards'
steps and its in-place copies into the masters mark them already).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["track"]

_lock = threading.Lock()
#: id() of every tracked master tensor -> how many live caches track it. A
#: cache keeps its master tensors alive, so an id here always names a live
#: tracked tensor (it is removed when the last cache tracking it dies).
_tracked: collections.Counter[int] = collections.Counter()
_handle: Any = None


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The post-hook: bumps the version counters of the stepped optimizer's
    tracked parameters."""
    if not _tracked or getattr(optimizer, "_marks_own_changes", False):
        return
    changed = [p for group in optimizer.param_groups for p in group["params"] if id(p) in _tracked]
    if changed:
        torch.autograd.graph.increment_version(changed)


def track(owner: object, tensors: Iterable[torch.Tensor]) -> None:
    """Marks ``tensors`` as master tensors of ``owner`` (a replica cache) until
    ``owner`` is garbage collected: from now on, an optimizer step over any
    of them bumps its version counter, so that the owner's next refresh
    copies it. Registers the process-wide post-hook on first use."""
    global _handle
    ids = [id(t) for t in tensors]
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_post_hook(_after_step)
        _tracked.update(ids)
    weakref.finalize(owner, _untrack, ids)


def _untrack(ids: list[int]) -> None:
    with _lock:
        _tracked.subtract(ids)
        for i in ids:
            if _tracked[i] <= 0:
                del _tracked[i]
