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

* forward: the replica computes its chunk's per-channel mean and biased
  variance (differentiable), exchanges them and its count with the other
  replicas through a C++ rendezvous owned by this call (csrc/dpcore/
  rendezvous.h; the GIL is released while waiting), combines them with the
  parallel-variance formula (Chan et al.: mean = sum n_i m_i / N, var =
  sum n_i (v_i + (m_i - mean)^2) / N; numerically stable, unlike sum and sum
  of squares) and normalizes with the global statistics (and weight, bias);
* backward needs no rendezvous: the exchanged statistics are the replicas'
  own tensors with their autograd history, so every replica's normalization
  depends on every replica's statistics in one graph, and autograd sums the
  gradients with respect to the global statistics across replicas (the
  "two gradient sums" of synchronized BatchNorm). Nothing in backward waits,
  so nothing in backward can hang;
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

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from dpcore import _C
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

_FLOAT_STATS = (torch.float32, torch.float64)
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
) -> list[Any]:
    """parallel_apply(calls, inputs, kwargs_tup, devices) with synchronized
    BatchNorm among the calls (see the module docstring). ``modules[i]`` is
    the replica module that ``calls[i]`` runs (used to name layers in errors);
    replica 0 updates the running statistics. All calls run at once, each on
    a worker thread of its own, since they wait for each other.

    Raises the root cause when the rendezvous breaks: the exception of the
    lowest replica that raised one of its own, else SyncBatchNormError."""
    rendezvous = _C.Rendezvous(len(calls))
    replicas = [_SyncedReplica(call, module, rank, rendezvous) for rank, (call, module) in enumerate(zip(calls, modules))]
    try:
        results = parallel_apply(replicas, inputs, kwargs_tup, devices, all_at_once=True)
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
    synchronized version; every other function runs unchanged."""

    def __init__(self, rendezvous: Any, rank: int, module: nn.Module | None) -> None:
        super().__init__()
        self.rendezvous = rendezvous
        self.rank = rank
        self.module = module
        self.broken: BaseException | None = None  # the rendezvous' error, once raised here
        self._names: dict[int, str] | None = None
        self._calls: dict[str | None, int] = {}

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is _F_BATCH_NORM:
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
        if input.dim() < 2:
            raise ValueError(
                f"batch_norm: expected an input of shape (N, C, ...), but got shape {tuple(input.shape)}"
            )
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
        statistics (replica 0) and normalizes with the global statistics."""
        channels = input.shape[1]
        x = input if input.dtype in _FLOAT_STATS else input.float()
        mean, var = _LocalStats.apply(x)
        count = input.numel() // channels if channels else 0
        try:
            tensors, counts = self.rendezvous.exchange(self.rank, key, [mean, var], count)
        except SyncBatchNormError as error:
            self.broken = error
            raise
        total = sum(counts)
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total} over all replicas "
                f"(input size {list(input.shape)} on replica {self.rank})"
            )
        mean, var = _combine(tensors, counts, total, x.device)
        if self.rank == 0:
            _update_running_stats(running_mean, running_var, mean, var, total, momentum)
        return _Normalize.apply(x, mean, var, weight, bias, eps).to(input.dtype)


def _combine(
    tensors: Sequence[Sequence[torch.Tensor]], counts: Sequence[int], total: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and biased variance on `device` from each replica's
    (mean, biased variance) and count, differentiable with respect to every
    replica's tensors."""
    weights = torch.tensor([c / total for c in counts], dtype=tensors[0][0].dtype)
    if device.type != "cpu":  # from pinned memory: no wait for the device's queued work
        weights = weights.pin_memory().to(device, non_blocking=True)
    flat = [t if t.device == device else t.to(device) for pair in tensors for t in pair]
    return _Combine.apply(weights, *flat)


class _Combine(torch.autograd.Function):
    """The parallel-variance formula over K replicas, one autograd node:
    inputs (weights n_i / N, m_0, v_0, m_1, v_1, ...), outputs
    mean = sum w_i m_i, var = sum w_i (v_i + (m_i - mean)^2). Backward:
    d m_i = w_i (g_mean + 2 (m_i - mean) g_var), d v_i = w_i g_var (the
    terms through mean cancel, since sum w_i (m_i - mean) = 0)."""

    @staticmethod
    def forward(ctx: Any, weights: torch.Tensor, *stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        means = torch.stack(stats[0::2])
        mean = torch.matmul(weights, means)
        var = torch.matmul(weights, torch.stack(stats[1::2]) + (means - mean).square_())
        ctx.save_for_backward(weights, mean, *stats[0::2])
        return mean, var

    @staticmethod
    def backward(ctx: Any, g_mean: torch.Tensor, g_var: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        weights, mean, *means = ctx.saved_tensors
        w = weights.unsqueeze(1)
        d_means = w * (g_mean + 2.0 * (torch.stack(means) - mean) * g_var)
        d_vars = w * g_var
        grads: list[Any] = [None]
        for i in range(len(means)):
            grads += [d_means[i], d_vars[i]]
        return tuple(grads)


@torch.no_grad()
def _update_running_stats(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    total: int,
    momentum: float,
) -> None:
    """running = (1 - momentum) * running + momentum * batch statistic, with
    the unbiased variance, as BatchNorm does on one device."""
    if running_mean is not None:
        running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        running_var.mul_(1.0 - momentum).add_((var * (total / (total - 1))).to(running_var.dtype), alpha=momentum)


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """(1, C, 1, ...): how a per-channel vector broadcasts against `x`."""
    return (1, -1) + (1,) * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels (dim 1)."""
    return [0, *range(2, x.dim())]


class _LocalStats(torch.autograd.Function):
    """(mean, biased variance) per channel of one replica's chunk; backward:
    dx = g_mean / n + 2 g_var (x - mean) / n."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        # Two passes (mean, then squared deviations): as exact as var_mean,
        # and on the CPU several times faster than its reduction over (0, 2, ...).
        dims = _reduce_dims(x)
        n = max(1, x.numel() // max(1, x.shape[1]))
        mean = x.sum(dims) / n
        var = (x - mean.view(_channel_shape(x))).square_().sum(dims) / n
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx: Any, g_mean: torch.Tensor | None, g_var: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        x, mean = ctx.saved_tensors
        n = max(1, x.numel() // max(1, x.shape[1]))
        scale = g_var * (2.0 / n)
        shift = g_mean / n
        if torch.is_grad_enabled():  # create_graph: plain differentiable operations
            shape = _channel_shape(x)
            return (x - mean.view(shape)) * scale.view(shape) + shift.view(shape)
        # (x - mean) * scale + shift in one pass: the inference BatchNorm
        # kernel with unit variance and eps 0 is exactly that affine map.
        return torch.batch_norm(x, scale, shift, mean, torch.ones_like(mean), False, 0.0, 0.0, False)


class _Normalize(torch.autograd.Function):
    """(x - mean) / sqrt(var + eps) * weight + bias per channel (dim 1),
    differentiable with respect to x, mean, var, weight and bias. Forward is the
    native inference kernel; backward is the native BatchNorm backward
    (inference form: dx = dy w / sqrt(var + eps), dw, db) plus the gradients
    with respect to the statistics, from the same two sums:
    d mean = -w invstd sum(dy), d var = -w invstd^2 dw / 2. Under
    create_graph the same formulas run as plain differentiable operations,
    so double backward is exact too."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        mean: torch.Tensor,
        var: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        ctx.eps = eps
        ctx.has_weight = weight is not None
        ctx.save_for_backward(x, mean, var, weight)
        return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, torch.backends.cudnn.enabled)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, mean, var, weight = ctx.saved_tensors
        eps = ctx.eps
        invstd = torch.rsqrt(var + eps)
        if torch.is_grad_enabled():  # create_graph: differentiable formulas
            shape = _channel_shape(x)
            scale = invstd if weight is None else invstd * weight
            dims = _reduce_dims(x)
            sum_dy = dy.sum(dims)
            sum_dy_xmu = (dy * (x - mean.view(shape))).sum(dims)
            dx = dy * scale.view(shape)
            dw = sum_dy_xmu * invstd
        else:
            w = weight if weight is not None else torch.ones_like(mean)
            dx, dw, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, w, mean, var, None, None, False, eps, [ctx.needs_input_grad[0], True, True]
            )
            scale = invstd * w
        d_mean = -scale * sum_dy
        d_var = (-0.5 * invstd) * (dw if weight is None else dw * weight) * invstd
        return (
            dx,
            d_mean,
            d_var,
            dw if ctx.has_weight else None,
            sum_dy if ctx.needs_input_grad[4] else None,
            None,
        )
