"""Cached, exact replicas of a module on a list of devices.

torch.nn.DataParallel rebuilds every replica module and allocates fresh
parameter copies every step, in Python. dpcore keeps, per device, the replica
module objects and one persistent flat buffer per parameter bucket
(``dpcore._C.ReplicaBuffers``): each step only re-syncs the replicas'
attribute dicts from the master's and refreshes the buffers in C++, skipping
buckets whose master tensors did not change. Replica 0 is the master module
itself, so its gradients, hooks and in-place buffer updates (BatchNorm
statistics) act on the master directly; so does ``zero_grad()`` called
inside forward: on replica 0 it clears the master's gradients (torch's
replicas are all copies, where it only warns), on the other replicas it warns
as torch's do.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from dpcore._compiled import CompiledReplicas, has_compiled, replicate_module
from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_devices, normalize_device
from dpcore._functions import BroadcastBucket
from dpcore._step_hook import track

__all__ = [
    "replicate",
    "check_on_device",
    "check_replica_refresh",
    "ReplicaCache",
    "DEFAULT_BUCKET_BYTES",
    "CHECK_INTERVAL_MAX",
    "REPLICA_REFRESH",
]

#: Bucket size of the replica parameter copies: smaller than
#: comm.DEFAULT_BUFFER_SIZE (10 MiB, torch.cuda.comm's buffer size) on
#: purpose. Each bucket is one autograd node whose gradients are reduced onto
#: the master as soon as all of them exist, so smaller buckets let the first
#: reductions start earlier in backward; and a bucket whose master tensors
#: did not change is not copied, so they also skip more of a partly frozen
#: model. comm's one-shot collectives have neither concern and take fewer,
#: larger buckets.
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

#: The longest gap, in calls, between two checks of the replicas against the
#: master for writes that no version counter saw (docs/design.md, "Writes
#: no version counter sees"): such a write is found within this many calls.
CHECK_INTERVAL_MAX = 64

#: The choices of DataParallel's ``replica_refresh``: "auto" copies a bucket
#: when its master tensors changed (and checks for unseen writes), "always"
#: copies every bucket at every call, as torch.nn.DataParallel.
REPLICA_REFRESH = ("auto", "always")


def check_replica_refresh(value: Any) -> str:
    """`value` when it is one of REPLICA_REFRESH; else TypeError (not a
    str) or ValueError naming ``replica_refresh`` and the choices."""
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
    """Outside inference mode (without grad) where the caller is inside it:
    the persistent buffers and the copies viewing them must be normal tensors
    (inference tensors have no version counter and cannot be updated in place
    once inference mode is left)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            yield
    else:
        yield


_UNINITIALIZED = (
    "Modules with uninitialized parameters can't be used with `DataParallel`. "
    "Run a dummy forward pass to correctly initialize the modules"
)


def _check_initialized(module: nn.Module) -> None:
    """Raises torch's RuntimeError for a module with uninitialized (lazy)
    parameters or buffers: they have no size to copy yet."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if is_lazy(t):
            raise RuntimeError(_UNINITIALIZED)


class ReplicaCache:
    """Replicas of `module` for ``devices[1:]``, kept across calls.

    The replica modules, the parameter buckets and their persistent buffers
    and the per-step sync live in one C++ object (``dpcore._C.ReplicaSet``);
    this class adds the autograd part: under grad mode each bucket whose
    tensors require grad is copied through :class:`BroadcastBucket`, its own
    autograd node, so that its gradients are reduced onto the master as soon
    as they all exist.

    Guarantees:

    * ``replicas(n)`` returns n modules: the master itself, then replicas on
      devices[1..n-1], whose parameters and buffers equal the master's at the
      time of the call and whose gradients flow to the master's parameters
      through autograd (``backward``, ``autograd.grad``, double backward).
    * Every change of a master tensor reaches the replicas at the next call:
      in-place updates through their version counters, a new storage
      (``p.data = t``), and ``step()`` of any ``torch.optim.Optimizer`` over
      them (fused kernels and writes through ``.data`` inside ``step()``
      included, see dpcore._step_hook). A bucket none of whose tensors
      changed is not copied.
    * The running statistics of norm layers (``_NormBase`` with
      ``track_running_stats``), which batch_norm updates without bumping a
      version counter, are copied at the call after any call that ran such
      a layer in training mode.
    * Writes that no version counter saw (``p.data.add_(...)`` outside an
      optimizer step, numpy) are found within ``CHECK_INTERVAL_MAX`` calls:
      at the 2nd, 3rd, 5th, 9th, ... call (the gap doubling up to
      ``CHECK_INTERVAL_MAX``) and at the first call after the module's
      train/eval switch, every bucket the refresh would skip is compared
      with the master byte for byte (``ReplicaBuffers.verify``); a
      difference is copied at once, warned about once per cache (naming
      the tensors, ``mark_parameters_changed()`` and ``replica_refresh``),
      and every call is checked until CHECK_INTERVAL_MAX calls in a row
      found none.
      :meth:`invalidate` makes the next call copy everything.
      ``refresh="always"`` copies every bucket at every call instead (no
      check, no warning).
    * Attribute changes and train/eval switches on the master reach every
      replica at the next call; hooks registered on a replica stay there.
    * A structural change of the master (a parameter or buffer added,
      removed, replaced, frozen or unfrozen, converted to another dtype,
      device or shape, a submodule swapped) is detected and the cache
      rebuilt (``valid()`` returns False until then).
    * Works under ``torch.inference_mode()``: the buffers and copies are
      normal tensors, usable by later steps outside inference mode.
    * With more than one device, a module with uninitialized (lazy)
      parameters raises torch's RuntimeError before anything is allocated.
    * ``replicas()`` may be called from several threads: calls are
      serialized, and each returns a consistent set. The replica modules are
      shared by every call, though: a caller that runs them while another
      thread calls ``replicas()`` must serialize the two (DataParallel does:
      it holds its own lock from ``replicas()`` until its replicas return).

    ``bucket_plan``, ``refresh_copies()`` and ``capture_replicas()`` are the
    CUDA-graph interface: they exist for dpcore._graphs (its
    ``CaptureSource``), grouped at the end of the class.
    """

    def __init__(
        self,
        module: nn.Module,
        devices: Sequence[torch.device],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        refresh: str = "auto",
    ):
        self.module = module
        self._always = check_replica_refresh(refresh) == "always"
        # The check for unseen writes: calls so far, the call of the next
        # check, the gap after it, the last call known exact (the last
        # check's; the first call copies everything), the call up to which
        # every call is checked (after a difference), the module's training
        # flag at the last call, whether a difference was warned of.
        self._calls = 0
        self._next_check = 2
        self._interval = 1
        self._checked_at = 1
        self._watch_until = 0
        self._training = module.training
        self._warned = False
        self._lock = threading.Lock()
        self.devices = list(devices)
        if len(self.devices) > 1:
            _check_initialized(module)
        with _normal_mode():
            self._set = _C.ReplicaSet(module, self.devices[1:], bucket_bytes, _replicator(module))
        # (ReplicaBuffers, master tensors, requires_grad) per bucket.
        self._bucket_plan: list[tuple[Any, list[torch.Tensor], bool]] = self._set.buckets
        if self._bucket_plan:
            # Optimizer steps that bump no version counter (fused kernels,
            # writes through .data) still mark these tensors changed.
            track(self, (t for _, masters, _ in self._bucket_plan for t in masters))
        # Per-replica compiled calls of torch.compile'd modules (None: none compiled).
        self._compiled = CompiledReplicas.of(module, self._set.replica_modules)
        # Norm layers' running statistics: batch_norm updates them inside its
        # kernel, bumping no version counter, so after a call with such a
        # layer in training mode their buckets are marked changed.
        self._norms = [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]
        running = {id(m.running_mean) for m in self._norms} | {id(m.running_var) for m in self._norms}
        self._norm_buckets = [b for b, masters, _ in self._bucket_plan if any(id(t) in running for t in masters)]
        self._norms_trained = False

    @property
    def buckets(self) -> list[Any]:
        """The ``dpcore._C.ReplicaBuffers`` of every bucket, in order (none
        with a single device): their ``last_refresh_copied``."""
        return [bucket for bucket, _, _ in self._bucket_plan]

    @property
    def replica_modules(self) -> list[list[nn.Module]]:
        """rows[j][i]: the replica of ``list(module.modules())[i]`` on devices[j + 1]."""
        return self._set.replica_modules

    def valid(self) -> bool:
        """False when the master's structure changed since the cache was built:
        a parameter, buffer or child added, removed or replaced, or a tensor's
        dtype, device, shape or requires_grad changed (checked in C++)."""
        return self._set.valid()

    def invalidate(self) -> None:
        """Makes the next refresh copy every master tensor to every replica:
        for writes that no version counter saw and no optimizer step
        covered (an EMA or clipping written through ``.data``)."""
        with self._lock:
            for bucket in self.buckets:
                bucket.invalidate()

    def replicas(self, n: int) -> list[nn.Module]:
        """The master plus n-1 refreshed replicas (see the class guarantees)."""
        with self._lock:
            return self._refresh(n)

    def _refresh(self, n: int) -> list[nn.Module]:
        if n < 1 or n > len(self.devices):
            raise ValueError(f"replicas: expected 1 <= n <= {len(self.devices)}, but got {n}")
        self._before_refresh()  # on a lone master too: it may train a norm layer
        if n == 1:
            return [self.module]
        grad_enabled = torch.is_grad_enabled()
        with _normal_mode():
            # None: the bucket needs no autograd and is refreshed in C++.
            outputs = [
                BroadcastBucket.apply(bucket, *masters) if grad_enabled and requires_grad else None
                for bucket, masters, requires_grad in self._bucket_plan
            ]
            return [self.module, *self._synced(n - 1, outputs)]

    def check_now(self) -> None:
        """Runs the check for writes no version counter saw now, as a check
        call does before its refresh (what bench_step times)."""
        with self._lock:
            self._check()

    def _before_refresh(self) -> None:
        """Per refresh of the replicas, before it: the running statistics
        marked changed after a call that trained a norm layer; with
        refresh="always", every bucket marked changed; else, at a check
        point (see the class guarantees), the check for writes no version
        counter saw."""
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
        """Compares the buckets the refresh would skip with the master (each
        bucket with a difference is copied by the refresh that follows);
        warns once where one differed; schedules the next check: the next
        call while fewer than CHECK_INTERVAL_MAX calls passed since the last
        difference, else after the gap, which doubles up to
        CHECK_INTERVAL_MAX."""
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
        """ReplicaSet.sync, then each replica of a compiled module gets its
        own compiled call back (the sync copied the master's)."""
        roots = self._set.sync(rows, outputs)
        if self._compiled is not None:
            self._compiled.apply(rows)
        return roots

    # -- The CUDA-graph interface ---------------------------------------------
    # What dpcore._graphs.GraphRunner needs beyond replicas(n) (its
    # CaptureSource protocol) and nothing else calls: the buckets, a refresh
    # of the buffers without the replica modules, and replicas whose
    # parameters view the buffers directly, for capture.

    @property
    def bucket_plan(self) -> list[tuple[Any, list[torch.Tensor], bool]]:
        """(``dpcore._C.ReplicaBuffers``, master tensors, requires_grad) of
        every bucket, in order."""
        return self._bucket_plan

    def refresh_copies(self) -> list[tuple[torch.Tensor, ...] | None]:
        """Brings every bucket's replica buffers up to date with the master,
        without touching the replica modules, and returns per bucket its
        copies (device-major, as BroadcastBucket returns them) where the
        bucket goes through autograd (grad mode on and a tensor of it
        requiring grad), None for the others. For replayed CUDA graphs, which
        read the buffers' memory directly."""
        with self._lock:
            grad_enabled = torch.is_grad_enabled()
            self._before_refresh()
            out: list[tuple[torch.Tensor, ...] | None] = []
            with _normal_mode():
                for bucket, masters, requires_grad in self._bucket_plan:
                    if grad_enabled and requires_grad:
                        out.append(BroadcastBucket.apply(bucket, *masters))
                    else:
                        bucket.update(masters)
                        out.append(None)
            return out

    def capture_replicas(self, n: int) -> tuple[list[nn.Module], list[list[tuple[int, int]]]]:
        """The master plus n-1 refreshed replicas whose parameters are leaf
        tensors viewing the persistent buffers (no autograd link to the
        master), for capturing a CUDA graph of a replica, and for each replica
        after the first, ``(bucket, copy index)`` of every parameter that
        requires grad, in ``parameters()`` order: where
        :meth:`refresh_copies` puts its autograd-linked counterpart."""
        if n < 1 or n > len(self.devices):
            raise ValueError(f"replicas: expected 1 <= n <= {len(self.devices)}, but got {n}")
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
    """The warning of a check that found replicas differing from `module`'s
    `stale` tensors, with `since` calls between the previous check and this
    one (the calls that may have used stale values)."""
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
        stacklevel=_caller_stacklevel(),
    )


def _caller_stacklevel() -> int:
    """The stacklevel, for a ``warnings.warn`` made by this function's
    caller, of the first frame outside dpcore and torch (the user's call)."""
    inside = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame = frame.f_back
        level += 1
    return level


def _replicator(module: nn.Module) -> Any:
    """The replica factory for ReplicaSet: None (each module's own
    ``_replicate_for_data_parallel()``) unless the tree holds compiled
    modules, whose wrappers must be replicated without writing through them
    (dpcore._compiled.replicate_module)."""
    return replicate_module if has_compiled(module) else None


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """torch.nn.parallel.replicate's contract: one module per device.

    The first is ``network`` itself (which must sit on devices[0]); the others
    are module objects whose parameters and buffers are copies, made by a
    differentiable broadcast so that gradients reach ``network``'s
    parameters, unless ``detach`` (then copies without autograd history).
    """
    devs = as_devices(devices, "devices")
    if not devs:
        return []
    check_on_device(network, devs[0], "devices[0]")
    cache = ReplicaCache(network, devs)
    if detach:
        with torch.no_grad():
            return cache.replicas(len(devs))
    return cache.replicas(len(devs))


def check_on_device(module: nn.Module, device: torch.device, arg: str) -> None:
    """Raises RuntimeError unless every parameter and buffer of `module` is on `device`."""
    for t in module.parameters():
        _check_tensor_device(t, device, arg)
    for t in module.buffers():
        _check_tensor_device(t, device, arg)


def _check_tensor_device(t: torch.Tensor, device: torch.device, arg: str) -> None:
    if normalize_device(t.device) != device:
        raise RuntimeError(
            f"module must have its parameters and buffers on device {device} ({arg}) "
            f"but found one of them on device: {t.device}"
        )
