"""Cached, exact replicas of a module on a list of devices (:class:`ReplicaCache`); the rules: docs/design.md,
"Replicas are cached and exact" and "Writes no version counter sees"."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from dpcore._compiled import CompiledReplicas, has_compiled, replicate_module
from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_devices, normalize_device
from dpcore._functions import BroadcastBucket, ShardedBucket, apply
from dpcore._step_hook import track

__all__ = ["replicate", "check_on_device", "check_replica_refresh", "ReplicaCache", "DEFAULT_BUCKET_BYTES"]
__all__ += ["CHECK_INTERVAL_MAX", "REPLICA_REFRESH"]

#: Bucket size of the replica parameter copies (each bucket is one autograd
#: node, reduced as soon as its gradients exist; smaller than comm's on purpose).
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

#: The longest gap, in calls, between two checks for writes no version counter saw.
CHECK_INTERVAL_MAX = 64

#: The choices of DataParallel's ``replica_refresh``.
REPLICA_REFRESH = ("auto", "always")


def check_replica_refresh(value: Any) -> str:
    """`value` if one of REPLICA_REFRESH, else TypeError or ValueError naming ``replica_refresh``."""
    if not isinstance(value, str):
        raise TypeError(f'replica_refresh: expected "auto" or "always", but got {value!r}')
    if value not in REPLICA_REFRESH:
        raise ValueError(
            f'replica_refresh: expected "auto" (copy what changed, check for writes no version counter saw) '
            f'or "always" (copy every parameter and buffer at every call), but got {value!r}'
        )
    return value


@contextlib.contextmanager
def _normal_mode() -> Iterator[None]:
    """Leaves inference mode (for no_grad) where the caller is inside it: the persistent buffers and their copies must
    be normal tensors."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            yield
    else:
        yield


class ReplicaCache:
    """Replicas of `module` for ``devices[1:]``, kept across calls (one C++ ``ReplicaSet``; each bucket needing grad
    goes through a BroadcastBucket node). ``replicas(n)`` returns the master and n-1 replicas equal to it, whose
    gradients flow to it; writes no version counter saw are found within CHECK_INTERVAL_MAX calls; a structural change
    makes ``valid()`` False. Calls are serialized across threads."""

    def __init__(
        self,
        module: nn.Module,
        devices: Sequence[torch.device],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        refresh: str = "auto",
    ):
        self.module = module
        self._always = check_replica_refresh(refresh) == "always"
        self._calls = 0  # calls so far
        self._next_check = 2  # the call of the next check for unseen writes
        self._interval = 1  # the gap after it
        self._checked_at = 1  # the last call known exact
        self._watch_until = 0  # every call up to this one is checked (after a difference)
        self._training = module.training
        self._warned = False
        self._lock = threading.Lock()
        self.devices = list(devices)
        if len(self.devices) > 1 and any(is_lazy(t) for t in itertools.chain(module.parameters(), module.buffers())):
            raise RuntimeError(  # torch's message
                "Modules with uninitialized parameters can't be used with `DataParallel`. "
                "Run a dummy forward pass to correctly initialize the modules"
            )
        with _normal_mode():
            factory = replicate_module if has_compiled(module) else None
            self._set = _C.ReplicaSet(module, self.devices[1:], bucket_bytes, factory)
        # (ReplicaBuffers, master tensors, requires_grad) per bucket.
        self._bucket_plan: list[tuple[Any, list[torch.Tensor], bool]] = self._set.buckets
        # id(master tensor) -> (its bucket's ReplicaBuffers, its entry there), for write().
        self._entries = {id(t): (bucket, i) for bucket, masters, _ in self._bucket_plan for i, t in enumerate(masters)}
        if self._bucket_plan:
            track(self, (t for _, masters, _ in self._bucket_plan for t in masters))
        rows = self._set.replica_modules
        self._compiled = CompiledReplicas(list(module.modules()), rows) if factory and rows else None
        # norm layers' running statistics, which batch_norm updates unseen by version counters
        self._norms = [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]
        self._norm_buckets = self.buckets_of(t for m in self._norms for t in (m.running_mean, m.running_var))
        self._norms_trained = False
        # shard_gradients=True: the ShardedOptimizer that sums the gradients (None: none attached), set by the pipeline
        # before each call, and position 0's aliases of the masters that the last replicas() made (by name).
        self.sink: Any = None
        self.sharded = False
        self.aliases: dict[str, torch.Tensor] = {}
        self._names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), []).append(name)

    @property
    def buckets(self) -> list[Any]:
        """The ``dpcore._C.ReplicaBuffers`` of every bucket, in order."""
        return [bucket for bucket, _, _ in self._bucket_plan]

    def write(self, position: int, updates: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes each ``(master, value)`` of `updates` (value on ``devices[position]``, equal to master) into that
        replica's copy, which the next refresh leaves as it is until master changes; writes nothing once invalid."""
        entries = self._entries if self.valid() else {}
        for master, value in updates:
            if (entry := entries.get(id(master))) is not None:
                entry[0].write(position - 1, entry[1], value, master)

    def copies_of(self, masters: Sequence[torch.Tensor]) -> list[list[torch.Tensor]] | None:
        """Per replica (devices[1:]), a tensor viewing its persistent copy of each of `masters`, for a collective that
        writes them in place (then :meth:`mark_current`); None once invalid or where a master has no copy."""
        entries = [self._entries.get(id(m)) for m in masters] if self.valid() else [None]
        if any(e is None for e in entries):
            return None
        views: dict[tuple[int, int], list[torch.Tensor]] = {}
        rows = []
        for d in range(len(self.devices) - 1):
            rows.append([])
            for bucket, i in entries:  # type: ignore[misc]
                if (id(bucket), d) not in views:
                    views[id(bucket), d] = bucket.views(d)
                rows[-1].append(views[id(bucket), d][i])
        return rows

    def mark_current(self, masters: Sequence[torch.Tensor]) -> None:
        """Every replica's copy of each of `masters` (written by the caller) holds its bytes as they are now: the next
        refresh leaves them as they are unless a master changes again."""
        by_bucket: dict[int, tuple[Any, list[int], list[torch.Tensor]]] = {}
        for m in masters:
            bucket, i = self._entries[id(m)]
            _, entries, tensors = by_bucket.setdefault(id(bucket), (bucket, [], []))
            entries.append(i)
            tensors.append(m)
        for bucket, entries, tensors in by_bucket.values():
            for d in range(len(self.devices) - 1):
                bucket.mark_current(d, entries, tensors)

    def replica_bytes(self) -> int:
        """The bytes of the persistent copies of the master's parameters and buffers that each replica holds."""
        return sum(t.numel() * t.element_size() for _, masters, _ in self._bucket_plan for t in masters)

    def buckets_of(self, tensors: Iterable[torch.Tensor]) -> list[Any]:
        """The buckets holding any of the master tensors `tensors`."""
        ids = {id(t) for t in tensors}
        return [bucket for bucket, masters, _ in self._bucket_plan if any(id(t) in ids for t in masters)]

    @property
    def replica_modules(self) -> list[list[nn.Module]]:
        """rows[j][i]: the replica of ``list(module.modules())[i]`` on devices[j + 1]."""
        return self._set.replica_modules

    def valid(self) -> bool:
        """False when the master's structure changed since the cache was built."""
        return self._set.valid()

    def invalidate(self) -> None:
        """Makes the next refresh copy every master tensor to every replica."""
        with self._lock:
            for bucket in self.buckets:
                bucket.invalidate()

    def replicas(self, n: int) -> list[nn.Module]:
        """The master plus n-1 refreshed replicas."""
        with self._lock:
            self._check_n(n)
            self._before_refresh()  # on a lone master too: it may train a norm layer
            self.aliases = {}
            grad_enabled = torch.is_grad_enabled()
            if n == 1 and not (self.sharded and grad_enabled):
                return [self.module]
            with _normal_mode():
                copies = self._copies(grad_enabled)
                return [self.module, *(self._synced(n - 1, copies) if n > 1 else [])]

    def _check_n(self, n: int) -> None:
        if n < 1 or n > len(self.devices):
            raise ValueError(f"replicas: expected 1 <= n <= {len(self.devices)}, but got {n}")

    def _copies(self, grad_enabled: bool) -> list[tuple[torch.Tensor, ...] | None]:
        """Per bucket, its copies through a BroadcastBucket node where it needs autograd, else None; with ``sharded``,
        through a ShardedBucket node, whose aliases of the masters go to ``aliases``."""
        if not (self.sharded and grad_enabled):
            return [
                apply(BroadcastBucket, bucket, *masters) if grad_enabled and requires_grad else None
                for bucket, masters, requires_grad in self._bucket_plan
            ]
        out: list[tuple[torch.Tensor, ...] | None] = []
        for bucket, masters, requires_grad in self._bucket_plan:
            if not requires_grad:
                out.append(None)
                continue
            outputs = apply(ShardedBucket, bucket, self.sink, *masters)
            for master, alias in zip(masters, outputs):
                self.aliases.update(dict.fromkeys(self._names.get(id(master), ()), alias))
            out.append(outputs[len(masters) :])
        return out

    def check_now(self) -> None:
        """Runs the check for writes no version counter saw now (what bench_step times)."""
        with self._lock:
            self._check()

    def _before_refresh(self) -> None:
        """Before each refresh: marks changed the norm statistics after a call that trained a norm layer, and every
        bucket with refresh="always"; else runs the check at its check points."""
        if self._norm_buckets:
            if self._norms_trained:
                for bucket in self._norm_buckets:
                    bucket.invalidate()
            self._norms_trained = any(m.training for m in self._norms)
        if self._always:
            for bucket, _, _ in self._bucket_plan:
                bucket.invalidate()
            return
        self._calls += 1
        training = self.module.training
        if self._calls < self._next_check and training is self._training:
            return
        self._training = training
        self._check()

    def _check(self) -> None:
        """Compares the buckets the refresh would skip with the master (a difference is copied by the next refresh),
        warns once, and schedules the next check."""
        with torch._C._DisableFuncTorch():  # under torch.func's transforms (functional_call): plain tensors
            stale = [masters[i] for bucket, masters, _ in self._bucket_plan for i in bucket.verify(masters)]
        since, self._checked_at = max(0, self._calls - self._checked_at - 1), self._calls
        if stale:
            self._watch_until = self._calls + CHECK_INTERVAL_MAX
            if not self._warned:
                self._warned = True
                _warn_stale(self.module, stale, since)
        if self._calls < self._watch_until:
            self._interval = 1
            self._next_check = self._calls + 1
        else:
            self._next_check = self._calls + self._interval
            self._interval = min(2 * self._interval, CHECK_INTERVAL_MAX)

    def _synced(self, rows: int, outputs: list[Any]) -> list[nn.Module]:
        """ReplicaSet.sync, then each compiled replica gets its own compiled call back."""
        roots = self._set.sync(rows, outputs)
        if self._compiled is not None:
            self._compiled.apply(rows)
        return roots

    # -- The CUDA-graph interface (dpcore._graphs.GraphRunner) --

    def refresh_copies(self) -> list[tuple[torch.Tensor, ...] | None]:
        """Brings every bucket's replica buffers up to date without touching the replica modules; returns per bucket its
        autograd-linked copies or None."""
        with self._lock:
            grad_enabled = torch.is_grad_enabled()
            self._before_refresh()
            with _normal_mode():
                out = self._copies(grad_enabled)
                for (bucket, masters, _), copies in zip(self._bucket_plan, out):
                    if copies is None:
                        bucket.update(masters)
            return out

    def capture_replicas(self, n: int) -> tuple[list[nn.Module], list[list[tuple[int, int]]]]:
        """The master plus n-1 replicas whose parameters are leaves viewing the persistent buffers (for capture), and
        per replica after the first the ``(bucket, copy index)`` of each parameter requiring grad: where
        :meth:`refresh_copies` puts its autograd-linked counterpart."""
        self._check_n(n)
        with self._lock, _normal_mode(), torch.no_grad():
            outputs: list[tuple[torch.Tensor, ...] | None] = []
            where: dict[int, tuple[int, int]] = {}
            for b, (bucket, masters, requires_grad) in enumerate(self._bucket_plan):
                if not requires_grad:
                    outputs.append(None)
                    continue
                copies = bucket.refresh(list(masters))
                for k, copy in enumerate(copies):
                    copy.requires_grad_(masters[k % len(masters)].requires_grad)
                    where[id(copy)] = (b, k)
                outputs.append(tuple(copies))
            rows = self._synced(n - 1, outputs) if n > 1 else []
        slots = [[where[id(p)] for p in row.parameters() if p.requires_grad] for row in rows]
        return [self.module, *rows], slots


def _warn_stale(module: nn.Module, stale: list[torch.Tensor], since: int) -> None:
    """Warns that the replicas' copies of `stale` differed, `since` calls after the previous check."""
    ids = {id(t) for t in stale}
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    names = [name for name, t in named if id(t) in ids]
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    affected = (
        "no call used them (this call's check came first)"
        if since == 0
        else f"the outputs of up to {since} call(s) before this one (since the previous check) may have used "
        f"stale parameters or buffers"
    )
    warnings.warn(
        f"dpcore.DataParallel: the replicas' copies of the module's {shown} differed from the module's values, "
        f"which were changed without a version counter seeing it (written through .data, e.g. by a "
        f"hand-written optimizer step `p.data.add_(...)` or an EMA copied in through .data, or through "
        f"numpy); {affected}. The replicas were synced again before this call, and every call is checked while "
        f"such writes go on (else such a write is found within {CHECK_INTERVAL_MAX} calls). After such writes "
        f'call `mark_parameters_changed()` on the wrapper, or build it with `replica_refresh="always"` to copy '
        f"every parameter and buffer at every call, as torch.nn.DataParallel does.",
        UserWarning,
        stacklevel=caller_stacklevel(),
    )


def caller_stacklevel() -> int:
    """The stacklevel, for the caller's ``warnings.warn``, of the first frame outside dpcore and torch."""
    inside = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """torch.nn.parallel.replicate's contract: one module per device, the first ``network`` itself (on devices[0]), the
    others copies whose gradients reach ``network``'s parameters, unless ``detach``."""
    devs = as_devices(devices, "devices")
    if not devs:
        return []
    check_on_device(network, devs[0], "devices[0]")
    cache = ReplicaCache(network, devs)
    with torch.no_grad() if detach else contextlib.nullcontext():
        return cache.replicas(len(devs))


def check_on_device(module: nn.Module, device: torch.device, arg: str) -> None:
    """Raises RuntimeError unless every parameter and buffer of `module` is on `device`."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if normalize_device(t.device) != device:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {device} ({arg}) "
                f"but found one of them on device: {t.device}"
            )
