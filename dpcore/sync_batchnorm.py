"""``DataParallel(..., sync_batchnorm=True)``: BatchNorm with the whole batch's statistics (of every process's, with a
process group), as on one device. The rules: docs/sync_batchnorm.md; the mechanism: docs/design.md."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from dpcore._loader import _C
from dpcore._devices import DeviceLike
from dpcore.parallel_apply import parallel_apply

__all__ = ["AcrossProcesses", "SyncBatchNormError", "needs_sync", "synchronized_apply"]

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
    """Whether a forward of `module` normalizes with batch statistics anywhere: a ``_BatchNorm`` in training mode, or
    one without running statistics."""
    return any(
        isinstance(m, _BatchNorm) and (m.training or (m.running_mean is None and m.running_var is None))
        for m in module.modules()
    )


def synchronized_apply(
    modules: Sequence[nn.Module],
    calls: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]],
    devices: Sequence[DeviceLike],
    *,
    run: Callable[..., list[Any]] = parallel_apply,
    across: AcrossProcesses | None = None,
) -> list[Any]:
    """``run(calls, inputs, kwargs_tup, devices, all_at_once=True)`` with BatchNorm synchronized among the calls
    (``calls[i]`` runs replica ``modules[i]``) and across the processes with `across`. Raises the exception of the
    lowest replica that raised one of its own, else SyncBatchNormError."""
    rendezvous = _C.Rendezvous(len(calls))
    if across is not None:  # replicas 1.. wait at each call while replica 0 waits for the other processes
        rendezvous = _C.Rendezvous(len(calls), rendezvous.timeout_s + across.timeout.total_seconds())
    broken: dict[int, BaseException] = {}  # the rendezvous' error, by the replica it was raised in

    def replica(rank: int, call: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
        def task(*args: Any, **kwargs: Any) -> Any:
            mode = _SyncBatchNormMode(rendezvous, rank, module, across)
            try:
                with mode:
                    result = call(*args, **kwargs)
            except BaseException as error:
                if error is not mode.broken:
                    rendezvous.fail(rank, _describe(error))
                    raise
                broken[rank], result = error, None
            rendezvous.finish(rank)
            return result

        return task

    tasks = [replica(rank, call, module) for rank, (call, module) in enumerate(zip(calls, modules))]
    try:
        results = run(tasks, inputs, kwargs_tup, devices, all_at_once=True)
    except BaseException as error:
        # Replicas still running (a caller interrupted while waiting) must not wait for the others.
        rendezvous.abort(f"the call was abandoned: {_describe(error)}")
        raise
    if rendezvous.broken:
        if broken:
            raise broken[min(broken)]
        raise SyncBatchNormError(rendezvous.reason)
    return results


def _describe(error: BaseException) -> str:
    """'ValueError: first line of the message' (at most 300 characters)."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


class _SyncBatchNormMode(TorchFunctionMode):
    """On one replica's thread, for its task: ``F.batch_norm`` with batch statistics becomes the synchronized version;
    everything else, and every other thread that inherits the mode, runs unchanged."""

    def __init__(self, rendezvous: Any, rank: int, module: nn.Module | None, across: AcrossProcesses | None) -> None:
        super().__init__()
        self.rendezvous, self.rank, self.module, self.across = rendezvous, rank, module, across
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
        """ "BatchNorm 'layer1.bn' (call 2)": the layer's name in the replica and how many times this replica has called
        it."""
        if self._names is None:
            self._names = {}
            if isinstance(self.module, nn.Module):
                for name, m in self.module.named_modules():
                    if isinstance(m, _BatchNorm):
                        for t in (m.weight, m.running_mean):
                            if t is not None:
                                self._names[id(t)] = name or f"<{type(m).__name__}, the wrapped module>"
        label = next((self._names[id(t)] for t in (weight, running_mean) if id(t) in self._names), None)
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
        device = input.device.type
        full_precision = torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else None
        with full_precision or contextlib.nullcontext():
            try:
                args = (self.rendezvous, self.rank, key, input, weight, bias, running_mean, running_var, self.rank == 0)
                return _C.sync_batch_norm(*args, momentum, eps, self.across)
            except SyncBatchNormError as error:
                self.broken = error
                raise


def _tag(text: str) -> int:
    """A 20-bit number naming a BatchNorm call and its phase: the sums of the tags and of their squares over 8192 ranks
    stay exact in float64."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], "little") >> 4


class AcrossProcesses:
    """Synchronized BatchNorm across the processes of a ``torch.distributed`` `group` of its own (with its `timeout`),
    for one forward: the ``across`` callable that replica 0 calls at each BatchNorm call with its process's statistics.
    `weight`: this process's gradient weight in this forward."""

    def __init__(self, group: Any, timeout: datetime.timedelta, weight: float) -> None:
        self.group, self.timeout, self.weight = group, timeout, float(weight)
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)

    def __call__(
        self, key: str, mean: torch.Tensor, var: torch.Tensor, count: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(mean, biased variance, count) of every process's batch at the BatchNorm call `key`, from this process's;
        differentiable."""
        self._agree(key, "forward", mean.device)
        channels = mean.numel()
        count_t = torch.tensor([float(count)], dtype=torch.float64, device=mean.device)
        row = torch.cat([mean.detach().to(torch.float64), var.detach().to(torch.float64), count_t])
        rows = torch.empty(self.world_size, row.numel(), dtype=torch.float64, device=mean.device)
        self._wait(key, "forward", dist.all_gather(list(rows.unbind(0)), row, group=self.group, async_op=True))
        total = int(rows[:, 2 * channels].sum().item())
        g_mean, g_var = _GlobalStatistics.apply(mean, var, rows, total, self, key)
        return g_mean, g_var, total

    def reduce_gradients(self, key: str, grads: torch.Tensor) -> torch.Tensor:
        """Backward of the call `key`: the sum over the processes of each one's gradient times its weight, divided by
        this process's weight (0 where it is 0)."""
        self._agree(key, "backward", grads.device)
        payload = grads.to(torch.float64) * self.weight
        self._wait(key, "backward", dist.all_reduce(payload, group=self.group, async_op=True))
        return torch.zeros_like(grads) if self.weight == 0 else (payload / self.weight).to(grads.dtype)

    def _agree(self, key: str, phase: str, device: torch.device) -> None:
        """Before each collective, one all-reduce of one size for every call: every rank raises where ranks are at
        different calls (gloo aborts on collectives of different sizes)."""
        tag = float(_tag(f"{phase} {key}"))
        header = torch.tensor([tag, tag * tag], dtype=torch.float64, device=device)
        self._wait(key, phase, dist.all_reduce(header, group=self.group, async_op=True))
        if header.tolist() != [self.world_size * tag, self.world_size * tag * tag]:
            reached: list[Any] = [None] * self.world_size
            dist.all_gather_object(reached, f"the {phase} of {key}", group=self.group)
            raise SyncBatchNormError(
                "synchronized BatchNorm across processes: the ranks reached different BatchNorm calls ("
                + "; ".join(f"rank {r}: {k}" for r, k in enumerate(reached))
                + "); every rank must make the same BatchNorm calls with batch statistics in each training forward, "
                "in the same order, and run their backward in the same order"
            )

    def _wait(self, key: str, phase: str, work: Any) -> None:
        """Waits for a collective at most the group's timeout; else SyncBatchNormError."""
        try:
            work.wait(self.timeout)
        except Exception as error:
            raise SyncBatchNormError(
                f"synchronized BatchNorm across processes: rank {self.rank} waited in the {phase} of {key} for the "
                f"other ranks of the process group, which did not all take part within {self.timeout} (a rank "
                f"failed, or skipped this call: every rank must make the same BatchNorm calls with batch statistics "
                f"in each training forward, and their backward): {_describe(error)}"
            ) from error


class _GlobalStatistics(torch.autograd.Function):
    """The global (mean, biased variance) from every process's gathered rows, differentiable in this process's: d mean_p
    = s_p (G_mean + 2 (mean_p - mean) G_var), d var_p = s_p G_var (s_p: its share of the count; G: the all-reduced
    gradients)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mean: torch.Tensor, var: torch.Tensor, rows: torch.Tensor, total: int, sync: AcrossProcesses, key: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        channels = mean.numel()
        shares = rows[:, 2 * channels] / max(total, 1)  # a process without values weighs 0
        means = rows[:, :channels]
        g_mean = shares @ means
        g_var = shares @ (rows[:, channels : 2 * channels] + (means - g_mean).square())
        ctx.across, ctx.key, ctx.channels = sync, key, channels
        ctx.save_for_backward(shares[sync.rank], means[sync.rank], g_mean)
        return g_mean.to(mean.dtype), g_var.to(var.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_mean: torch.Tensor, grad_var: torch.Tensor) -> tuple[Any, ...]:
        share, mean, g_mean = ctx.saved_tensors
        grads = torch.cat([grad_mean.reshape(-1), grad_var.reshape(-1)])
        total = ctx.across.reduce_gradients(ctx.key, grads).to(torch.float64)
        total_mean, total_var = total[: ctx.channels], total[ctx.channels :]
        d_mean = share * (total_mean + 2.0 * (mean - g_mean) * total_var)
        return d_mean.to(grad_mean.dtype), (share * total_var).to(grad_var.dtype), None, None, None, None
