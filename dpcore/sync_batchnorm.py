"""Synchronized BatchNorm across the replicas of one DataParallel call:
``dpcore.DataParallel(module, ..., sync_batchnorm=True)``.

With torch.nn.DataParallel every replica normalizes with the statistics of its
own chunk. With ``sync_batchnorm=True``, every BatchNorm call of the replicas
that uses batch statistics (a ``_BatchNorm`` module in training mode, or one
without running statistics) normalizes with the mean and variance of the whole
batch, over all replicas of the call.

How. Nothing is converted: the master and the cached replicas stay plain
BatchNorm modules (state_dict keys unchanged). Inside each replica's task, a
``TorchFunctionMode`` intercepts ``torch.nn.functional.batch_norm`` (which
every ``_BatchNorm`` calls) when it is asked for batch statistics:

* forward, in C++ without the GIL (``dpcore._C.sync_batch_norm``,
  csrc/dpcore/sync_batchnorm.h): the replica computes its chunk's
  per-channel mean and biased variance (differentiable), exchanges them and
  its count with the other replicas once, through a C++ rendezvous owned by
  this call (csrc/dpcore/rendezvous.h), combines them with the
  parallel-variance formula (Chan et al.: mean = sum n_i m_i / N, var =
  sum n_i (v_i + (m_i - mean)^2) / N; numerically stable, unlike sum and sum
  of squares) and normalizes with the global statistics (and weight, bias);
* backward needs no rendezvous: the exchanged statistics are the replicas'
  own tensors with their autograd history, so every replica's normalization
  depends on every replica's statistics in one graph, and autograd sums the
  gradients with respect to the global statistics across replicas (the
  "two gradient sums" of synchronized BatchNorm) in C++ autograd nodes.
  Nothing in backward waits, so nothing in backward can hang;
* running statistics: only replica 0 (the master module) updates its
  buffers, with the global mean and the unbiased global variance
  (var * N / (N - 1)), and the momentum factor the module passed (so
  ``momentum=None``, the cumulative average, works too).

Guarantees:

* Forward and backward equal single-device BatchNorm on the whole batch (up
  to floating-point summation order): output, input gradient, weight and
  bias gradients, running mean and variance, ``num_batches_tracked``; for
  BatchNorm1d/2d/3d, affine or not, with or without running statistics,
  uneven chunks (weighted by count) and fewer replicas than devices.
* One exchange per BatchNorm call in forward, among the replicas of that
  call only; no process group.
* Never hangs. A replica that raises, finishes without a BatchNorm call the
  others reached, makes an extra one, or reaches another layer breaks the
  rendezvous for every replica of the call; the caller gets one error: the
  raising replica's own exception (parallel_apply's note names the replica),
  or a ``SyncBatchNormError`` naming the replica and the layer. A replica
  that waits longer than DPCORE_SYNC_TIMEOUT_S seconds (default 300, read at
  each call) at one BatchNorm breaks it with a ``SyncBatchNormError`` naming
  who it waited for. The worker pool stays usable; nothing is left waiting.
* Eval mode with running statistics is plain BatchNorm (no exchange).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from dpcore._loader import _C
from dpcore._devices import DeviceLike
from dpcore.parallel_apply import parallel_apply

__all__ = ["SyncBatchNormError", "needs_sync", "synchronized_apply"]

#: Raised to every replica of a call whose BatchNorm rendezvous broke, and to
#: the caller when no replica raised an exception of its own.
SyncBatchNormError = _C.SyncBatchNormError
SyncBatchNormError.__module__ = "dpcore"
SyncBatchNormError.__doc__ = (
    "A synchronized BatchNorm call could not complete: a replica finished without a BatchNorm call the others "
    "reached, made an extra one, reached another layer, raised, or did not arrive within DPCORE_SYNC_TIMEOUT_S."
)

_F_BATCH_NORM = F.batch_norm


def needs_sync(module: nn.Module) -> bool:
    """Whether a forward of `module` normalizes with batch statistics anywhere:
    a ``_BatchNorm`` in training mode, or one without running statistics."""
    return any(
        isinstance(m, _BatchNorm) and (m.training or (m.running_mean is None and m.running_var is None))
        for m in module.modules()
    )


class _Broken:
    """What a replica returns when the rendezvous broke because of another
    replica (or of a mismatch it took part in): the caller raises one error."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def synchronized_apply(
    modules: Sequence[nn.Module],
    calls: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]],
    devices: Sequence[DeviceLike],
    *,
    run: Callable[..., list[Any]] = parallel_apply,
) -> list[Any]:
    """parallel_apply(calls, inputs, kwargs_tup, devices) with synchronized
    BatchNorm among the calls (see the module docstring). ``modules[i]`` is
    the replica module that ``calls[i]`` runs (used to name layers in errors);
    replica 0 updates the running statistics. All calls run at once, each on
    a worker thread of its own, since they wait for each other. ``run`` is
    the parallel_apply to use (called with ``all_at_once=True``).

    Raises the root cause when the rendezvous breaks: the exception of the
    lowest replica that raised one of its own, else SyncBatchNormError."""
    rendezvous = _C.Rendezvous(len(calls))
    replicas = [_SyncedReplica(call, module, rank, rendezvous) for rank, (call, module) in enumerate(zip(calls, modules))]
    try:
        results = run(replicas, inputs, kwargs_tup, devices, all_at_once=True)
    except BaseException as error:
        # Replicas still running (a caller interrupted while waiting) must not wait for the others.
        rendezvous.abort(f"the call was abandoned: {_describe(error)}")
        raise
    if rendezvous.broken:
        broken = [r.error for r in results if isinstance(r, _Broken)]
        if broken:
            raise broken[0]
        raise SyncBatchNormError(rendezvous.reason)
    return results


def _describe(error: BaseException) -> str:
    """'ValueError: first line of the message' (at most 300 characters)."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


class _SyncedReplica:
    """One replica's task: runs `call` under the BatchNorm interception and
    tells the rendezvous when it finished or raised."""

    def __init__(self, call: Callable[..., Any], module: nn.Module, rank: int, rendezvous: Any) -> None:
        self.call = call
        self.module = module
        self.rank = rank
        self.rendezvous = rendezvous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mode = _SyncBatchNormMode(self.rendezvous, self.rank, self.module)
        try:
            with mode:
                result = self.call(*args, **kwargs)
        except BaseException as error:
            if error is mode.broken:
                self.rendezvous.finish(self.rank)
                return _Broken(error)
            self.rendezvous.fail(self.rank, _describe(error))
            raise
        self.rendezvous.finish(self.rank)
        return result


class _SyncBatchNormMode(TorchFunctionMode):
    """Active on one replica's thread for the duration of its task:
    ``torch.nn.functional.batch_norm`` with batch statistics becomes the
    synchronized version; every other function runs unchanged. Threads that
    inherit the mode (the worker pool hands function modes on, e.g. to the
    replicas of a DataParallel nested in this replica) get plain BatchNorm."""

    def __init__(self, rendezvous: Any, rank: int, module: nn.Module | None) -> None:
        super().__init__()
        self.rendezvous = rendezvous
        self.rank = rank
        self.module = module
        self.broken: BaseException | None = None  # the rendezvous' error, once raised here
        self._names: dict[int, str] | None = None
        self._calls: dict[str | None, int] = {}
        self._thread = threading.get_ident()

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is _F_BATCH_NORM and threading.get_ident() == self._thread:
            return self._batch_norm(*args, **(kwargs or {}))
        return func(*args, **kwargs) if kwargs else func(*args)

    def _key(self, weight: torch.Tensor | None, running_mean: torch.Tensor | None) -> str:
        """'BatchNorm 'layer1.bn' (call 2)': the layer's qualified name in the
        replica (found through its weight or running mean) and how many times
        this replica has called it in this call."""
        if self._names is None:
            self._names = {}
            if isinstance(self.module, nn.Module):
                for name, m in self.module.named_modules():
                    if isinstance(m, _BatchNorm):
                        for t in (m.weight, m.running_mean):
                            if t is not None:
                                self._names[id(t)] = name or f"<{type(m).__name__}, the wrapped module>"
        label = None
        for t in (weight, running_mean):
            if label is None and t is not None:
                label = self._names.get(id(t))
        count = self._calls[label] = self._calls.get(label, 0) + 1
        if label is None:
            return f"BatchNorm call {count} without a named layer (torch.nn.functional.batch_norm)"
        return f"BatchNorm '{label}' (call {count})"

    def _batch_norm(
        self,
        input: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        training: bool = False,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> torch.Tensor:
        if not training:  # running statistics: plain BatchNorm
            return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        key = self._key(weight, running_mean)
        if torch.is_autocast_enabled(input.device.type):  # statistics in full precision
            with torch.autocast(input.device.type, enabled=False):
                return self._synchronized(key, input, running_mean, running_var, weight, bias, momentum, eps)
        return self._synchronized(key, input, running_mean, running_var, weight, bias, momentum, eps)

    def _synchronized(
        self,
        key: str,
        input: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        momentum: float,
        eps: float,
    ) -> torch.Tensor:
        """Exchanges this replica's statistics under `key`, updates the running
        statistics (replica 0) and normalizes with the global statistics, in
        C++ without the GIL (csrc/dpcore/sync_batchnorm.h)."""
        try:
            return _C.sync_batch_norm(
                self.rendezvous, self.rank, key, input, weight, bias, running_mean, running_var,
                self.rank == 0, momentum, eps,
            )
        except SyncBatchNormError as error:
            self.broken = error
            raise


