"""One call's way through a DataParallel (docs/design.md, "Semantics"): its record (:class:`Call`), built complete by
the scatter stage, and :class:`Pipeline`, whose stages call the wrapper's four methods as torch's ``forward`` does
(``scatter``; with more than one device ``replicate``, ``parallel_apply``; ``gather`` through the loss rule) and
whose methods are their defaults, which read the record of the call in progress."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple

import torch
from torch import nn

from dpcore import _integrations
from dpcore._devices import DeviceLike, as_devices
from dpcore._gather import _WRAPPABLE, NO_HINTS, GatherHints, _reraise, pad_outputs
from dpcore._options import check_not_compiled, overrides
from dpcore._pytree import flatten, without_markers
from dpcore._split import check_first_device
from dpcore.parallel_apply import start_parallel_apply
from dpcore.replicate import ReplicaCache, check_on_device
from dpcore.replicate import replicate as replicate_module
from dpcore.scatter_gather import gather_with_hints, scatter_with_hints
from dpcore.sync_batchnorm import needs_sync, synchronized_apply

#: What a replica runs in place of itself: the replica -> a callable (a method of it, a functional call).
Through = Callable[[nn.Module], Callable[..., Any]]


@dataclasses.dataclass(frozen=True)
class Method:
    """A call of a module method other than forward (``dp.parallel(name)``): no loss rule; the results `align`ed
    (given each replica's rows), padded beyond `dim` with `pad_value`, then gathered; errors name `label`."""

    label: str
    dim: int
    pad_value: float | None
    align: _integrations.Align | None = None

    def combine(self, outputs: list[Any], call: Call, gather: Callable[[list[Any]], Any]) -> Any:
        """The gathered result of the replicas' `outputs`."""
        if self.align is not None:
            outputs = self.align(outputs, call.sizes)
        outputs = pad_outputs(outputs, self.dim, self.pad_value, self.label)
        try:
            return gather(outputs)
        except _WRAPPABLE as e:
            _reraise(e, f"{self.label}: the replicas' results cannot be gathered: ")


class Call(NamedTuple):
    """One call's record: replica j runs on ``devices[j]`` (``used[j]``: its index in the device list) as
    ``f(*args[j], **kws[j])`` with ``sizes[j]`` rows; the gather's `hints`; a non-forward `method` and what each
    replica runs in place of itself (`through`), None for a plain forward."""

    args: list[tuple[Any, ...]]
    kws: list[dict[str, Any]]
    sizes: list[int]
    used: list[int]
    devices: list[torch.device]
    hints: GatherHints = NO_HINTS
    method: Method | None = None
    through: Through | None = None

    @property
    def rows(self) -> int:
        """The rows of this process in the call."""
        return sum(self.sizes)


class _Split(NamedTuple):
    """What the default ``scatter`` planned for the pair it returned."""

    pair: tuple[Any, Any]
    sizes: list[int]
    used: list[int]
    hints: GatherHints


class Pipeline:
    """The calls of one wrapper, serialized by its guard. The call in progress is readable only from the thread
    that runs it; a method called outside a call (or on values other than the call's) follows torch's rules."""

    def __init__(self, base: type) -> None:
        self.base = base  # the class whose four methods are the defaults (an override differs from them)
        self.call: Call | None = None
        self._thread = 0
        self._split: _Split | None = None
        self._modules: list[nn.Module] = []
        self._overridden: dict[tuple[type, str], bool] = {}

    def run(
        self,
        dp: Any,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        through: Through | None = None,
        method: Method | None = None,
    ) -> Any:
        """``dp``'s result for one call: each replica runs ``through(replica)`` in place of itself where given,
        and a `method` call has no loss rule; a plain forward in hybrid mode is synchronized across processes."""
        with dp._calls:
            sync = dp._sync if through is None and method is None else None
            if sync is not None:
                sync.before_forward(dp)
            output, rows = self._result(dp, inputs, kwargs, through, method)
            return output if sync is None else sync.after_forward(output, rows, dp._options)

    def _result(
        self, dp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], through: Through | None, method: Method | None
    ) -> tuple[Any, int]:
        """The call's result and this process's rows in it."""
        criterion = dp.criterion
        if criterion is not None and getattr(criterion, "reduction", None) is not dp._options.own_reduction:
            dp.criterion = criterion  # its .reduction changed in place: checked again, followed from here on
        if criterion is not None and not inputs and method is None:
            raise TypeError("DataParallel with a criterion expects the target as the last positional argument")
        if not dp.device_ids:  # the module as is, on the values inside Broadcast and Samples markers
            inputs, kwargs = without_markers((inputs, kwargs))
            module = dp.module if through is None else through(dp.module)
            return dp._loss.make_call(module, method)(*inputs, **kwargs), 0
        self.call = call = self._scatter(dp, inputs, kwargs, through, method)
        self._thread = threading.get_ident()
        try:
            outputs = self._apply(dp, call)
            return dp._loss.combine(outputs, call, lambda outs: self._gather(dp, outs)), call.rows
        finally:
            self.call, self._modules = None, []

    def _scatter(self, dp: Any, inputs: Any, kwargs: Any, through: Through | None, method: Method | None) -> Call:
        """The call's record, from ``dp.scatter``'s pair: as the default planned it, else read by torch's rules."""
        if dp._input_check is not None:
            dp._input_check(inputs, kwargs)
        self._split = None
        result = dp.scatter(inputs, kwargs, dp.device_ids)
        split, self._split = self._split, None
        devices = dp.device_ids
        if split is not None and result is split.pair:
            args, kws, sizes, used, hints = *split.pair, split.sizes, split.used, split.hints
        else:
            args, kws, sizes = _read_pair(result, len(devices), dp.dim)
            used, hints = list(range(len(args))), NO_HINTS
            if dp.criterion is not None and len(sizes) > 1 and 0 in sizes:
                raise ValueError(
                    f"criterion: each replica's loss is weighted by its rows, but {type(dp).__name__}.scatter gave "
                    f"replica {sizes.index(0)} no tensor with a dimension {dp.dim} to count them by"
                )
        check_first_device(sizes, used, len(devices), dp.chunk_sizes, dp.weights)
        return Call(list(args), list(kws), sizes, used, [devices[i] for i in used], hints, method, through)

    def _apply(self, dp: Any, call: Call) -> list[Any]:
        """Each replica's result: replayed CUDA graphs (in place of replicate and parallel_apply), the module
        itself with one device (torch's rule), else through ``dp.replicate`` and ``dp.parallel_apply``."""
        rule, through = dp._loss, call.through
        if through is None and dp._graphs is not None:  # combined: the outputs become new tensors (else cloned)
            loss = dp.criterion is not None or dp.model_loss is not None
            plain = not loss and dp.gather_output and not call.hints.samples and not self.overrides(dp, "gather")
            combined = plain or (len(call.used) > 1 and loss)
            outputs = dp._graphs.step(self.cache(dp), call.args, call.kws, call.used, rule.make_call, combined=combined)
            if outputs is not None:
                return outputs

        def runs(module: nn.Module) -> Callable[..., Any]:
            return rule.make_call(module if through is None else through(module), call.method)

        if len(dp.device_ids) == 1:
            self.cache(dp)  # checks the module where the replicas would
            self._modules = [dp.module]
            return self._run(dp, [runs(dp.module)], call.args, call.kws, call.devices)
        count = call.used[-1] + 1
        cache = self._sharded(dp)
        replicas = _checked(
            dp, "replicate", "replica per device", dp.replicate(dp.module, dp.device_ids[:count]), count
        )
        self._modules = [replicas[i] for i in call.used]
        fns = [runs(m) for m in self._modules]
        if cache is not None and cache.aliases:  # shard_gradients: replica 0 runs on the masters' aliases
            fns[0] = _on_aliases(fns[0], dp.module, cache.aliases)
            cache.aliases = {}
        return list(
            _checked(dp, "parallel_apply", "output per replica", dp.parallel_apply(fns, call.args, call.kws), len(fns))
        )

    def _sharded(self, dp: Any) -> ReplicaCache | None:
        """With ``shard_gradients=True``, the replica cache, told which ShardedOptimizer sums the gradients."""
        if not dp.shard_gradients and dp.shard_parameters is False:
            return None
        cache = self.cache(dp)
        cache.sharded, cache.sink = True, None if dp._sink is None else dp._sink()
        if cache.sink is not None and list(cache.sink.devices) != list(dp.device_ids):
            raise ValueError(
                f"shard_gradients=True: the attached ShardedOptimizer shards over {cache.sink.devices}, but the "
                f"wrapper's device_ids are now {list(dp.device_ids)}: build a new ShardedOptimizer with devices=dp"
            )
        return cache

    def _run(self, dp: Any, fns: Sequence[Callable[..., Any]], args: Any, kws: Any, devices: Any) -> list[Any]:
        """``fns[j](*args[j], **kws[j])`` on ``devices[j]``: synchronized BatchNorm where the call's replicas
        need it, one in this thread, several at once on the worker pool."""
        across = None if dp._sync is None else dp._sync.batchnorm_across(sum(self.call.sizes), dp._loss.summed)
        if dp.sync_batchnorm and (len(fns) > 1 or across is not None) and needs_sync(dp.module):
            return synchronized_apply(self._modules, fns, args, kws, devices, run=self._pool(dp), across=across)
        if len(fns) == 1:
            return [fns[0](*args[0], **kws[0])]
        return self._pool(dp)(fns, args, kws, devices)

    @staticmethod
    def _pool(dp: Any) -> Callable[..., list[Any]]:
        """Runs calls at once on the worker pool; an interrupted run's replicas finish in the background."""

        def run(
            fns: Sequence[Callable[..., Any]], args: Any, kws: Any, devices: Any, *, all_at_once: bool = False
        ) -> list[Any]:
            started = start_parallel_apply(fns, args, kws, devices, all_at_once=all_at_once)
            try:
                return started.result()
            except BaseException:
                if not started.done:
                    dp._calls.abandoned = started
                raise

        return run

    def _gather(self, dp: Any, outputs: list[Any]) -> Any:
        """The loss rule's gather: ``dp.gather``, except one device's output with gather overridden (torch's rule)."""
        if len(dp.device_ids) == 1 and self.overrides(dp, "gather"):
            return outputs[0]
        return dp.gather(outputs, dp.output_device)

    def overrides(self, dp: Any, name: str) -> bool:
        """Whether ``dp`` replaces the method `name` (in its class or on itself)."""
        key = (type(dp), name)
        found = self._overridden.get(key)
        if found is None:
            found = self._overridden[key] = overrides(type(dp), self.base, name)
        return found or name in dp.__dict__

    def current(self, count: int) -> Call | None:
        """The call in progress where it is this thread's and has `count` replicas."""
        call = self.call
        ok = call is not None and self._thread == threading.get_ident() and len(call.used) == count
        return call if ok else None

    # The defaults of the wrapper's four methods.

    def scatter(self, dp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Any) -> Any:
        """torch's pair ``(inputs, kwargs)``, each replica's arguments split along ``dim`` by dpcore's rules; a lone
        device's plain tensors with one row count are passed as they are, with no tree walk."""
        kwargs = {} if kwargs is None else kwargs
        rows = _lone_rows(dp, inputs, kwargs, device_ids)
        if rows:
            pair: tuple[Any, Any] = ([inputs], [kwargs])
            self._split = _Split(pair, [rows], [0], NO_HINTS)
            return pair
        scattered, hints = scatter_with_hints(
            inputs, kwargs, device_ids, dp.dim, dp.chunk_sizes, dp.weights, lone_as_is=True
        )
        pair = (scattered.args, scattered.kwargs)
        self._split = _Split(pair, scattered.sizes, scattered.device_indices, hints)
        return pair

    def replicate(self, dp: Any, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """One module per device, the first `module` itself: cached and refreshed for ``dp.module`` on a leading
        part of its devices, else new copies."""
        devices = as_devices(device_ids, "device_ids")
        if module is dp.module and devices and devices == dp.device_ids[: len(devices)]:
            return self.cache(dp).replicas(len(devices))
        return replicate_module(module, devices, detach=not torch.is_grad_enabled())

    def parallel_apply(self, dp: Any, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """``replicas[i](*inputs[i], **kwargs[i])`` for every i: on the call's devices, at once."""
        call = self.current(len(replicas))
        if call is None:
            args = [tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in inputs]
            kws = [dict(k or {}) for k in (kwargs or [{}] * len(replicas))]
            if len(replicas) == 1:
                return [replicas[0](*args[0], **kws[0])]
            return self._pool(dp)(replicas, args, kws, dp.device_ids[: len(replicas)])
        return self._run(dp, replicas, inputs, kwargs, call.devices)

    def gather(self, dp: Any, outputs: Sequence[Any], output_device: DeviceLike | None) -> Any:
        """The outputs joined along ``dim`` on `output_device`, by the hints of the call's inputs; a lone
        replica's tensor already there is returned as is, as from the bare module (unless an override calls this)."""
        call = self.current(len(outputs)) if isinstance(outputs, Sequence) else None
        lone = call is not None and len(outputs) == 1 and dp._graphs is None and not call.hints.rows
        if lone and not self.overrides(dp, "gather"):
            out = outputs[0]
            here = type(out) is torch.Tensor and out.dim() > 0 and out.device == dp.output_device
            if here and output_device == dp.output_device:
                return out
        return gather_with_hints(outputs, output_device, dp.dim, call.hints if call is not None else NO_HINTS)

    def cache(self, dp: Any) -> ReplicaCache:
        """``dp``'s replica cache, rebuilt first where the module's structure changed."""
        if dp._cache is None or not dp._cache.valid():
            check_on_device(dp.module, dp.device_ids[0], "device_ids[0]")
            if dp.cuda_graphs:
                check_not_compiled(dp.module)  # compiled after wrapping
            dp._cache = ReplicaCache(dp.module, dp.device_ids, dp.bucket_bytes, refresh=dp.replica_refresh)
            if dp._sync is not None:  # the gradient buckets follow a structural change (collective)
                dp._sync.check_structure()
        return dp._cache


class ParallelMethod:
    """``dp.parallel(name)``: the module's method `name`, run data parallel at each call."""

    def __init__(self, dp: Any, name: Any, pad_value: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"parallel: expected a method name (str), but got {type(name).__name__} {name!r}")
        if pad_value is not None and (isinstance(pad_value, bool) or not isinstance(pad_value, (int, float))):
            raise TypeError(
                f"parallel({name!r}): pad_value: expected a number (or None), but got {type(pad_value).__name__}"
            )
        module = dp.module
        self.label = f"{type(module).__name__}.{name} (data parallel)"
        try:
            target = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"parallel({name!r}): the module, a {type(module).__name__}, has no method {name!r}"
            ) from None
        owner = getattr(target, "__self__", None) if inspect.ismethod(target) else None
        if not isinstance(target, nn.Module) and not any(owner is m for m in module.modules()):
            raise TypeError(
                f"parallel({name!r}): {type(module).__name__}.{name} is a {type(target).__name__}, not a method of "
                f"the module (nor a submodule): each replica must run its own, so define it as a method of the "
                f"module's class"
            )
        self.dp, self.name, self.pad_value, self.__name__ = dp, name, pad_value, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dp = self.dp
        pad, align = _integrations.method_rule(dp.module, self.name, kwargs, self.label, dp.dim, self.pad_value)
        method = Method(self.label, dp.dim, pad, align)
        return dp._pipeline.run(dp, args, kwargs, attrgetter(self.name), method)  # each replica's own

    def __repr__(self) -> str:
        return f"<{self.label} over {len(self.dp.device_ids)} device(s)>"


def substituted(tensors: Mapping[str, torch.Tensor], tie_weights: bool, strict: bool) -> Through:
    """What each replica runs for ``torch.func.functional_call(replica, tensors, ...)``: the tensors moved to the
    replica's device."""

    def through(replica: nn.Module) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            first = next(itertools.chain(replica.parameters(), replica.buffers()), None)
            moved = tensors if first is None else {n: t.to(first.device) for n, t in tensors.items()}
            return torch.func.functional_call(replica, moved, a, k, tie_weights=tie_weights, strict=strict)

        return call

    return through


def _on_aliases(fn: Callable[..., Any], module: nn.Module, aliases: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """`fn` run with `module`'s parameters named in `aliases` replaced by them (only replica 0 runs on the module)."""

    def call(*a: Any, **k: Any) -> Any:
        with torch.nn.utils.stateless._reparametrize_module(module, aliases):
            return fn(*a, **k)

    return call


def _checked(dp: Any, method: str, per: str, values: Any, count: int) -> Any:
    if not isinstance(values, Sequence) or len(values) != count:
        got = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(f"{type(dp).__name__}.{method}: expected one {per} ({count}), but got {got}")
    return values


def _lone_rows(dp: Any, inputs: tuple[Any, ...], kwargs: Mapping[str, Any], device_ids: Any) -> int:
    """The rows of a call on one device whose arguments are all plain tensors on it with one row count along
    ``dim``; 0 for any other call (the tree walk's)."""
    if len(device_ids) != 1 or device_ids is not dp.device_ids or dp.chunk_sizes is not None or dp.weights is not None:
        return 0
    device, dim, rows = device_ids[0], dp.dim, -1
    for t in (*inputs, *kwargs.values()):
        if type(t) is not torch.Tensor or t.device != device or not -t.dim() <= dim < t.dim():
            return 0
        if rows != t.size(dim):
            if rows != -1:
                return 0
            rows = t.size(dim)
    return max(rows, 0)


def _read_pair(result: Any, device_count: int, dim: int) -> tuple[list[Any], list[Any], list[int]]:
    """(args, kwargs, rows) per replica from the pair an overridden ``scatter`` returned, read as torch reads
    it: replicas on the first devices; rows: each one's first tensor's size along `dim` (0 where it has none)."""
    if not isinstance(result, Sequence) or len(result) != 2:
        raise TypeError(
            f"scatter: expected the pair (inputs, kwargs) with one entry per replica in each, as torch's "
            f"DataParallel.scatter returns, but got {type(result).__name__}"
        )
    inputs, kwargs = result
    args = [a if isinstance(a, tuple) else tuple(a) if isinstance(a, list) else (a,) for a in inputs]
    kws = [dict(k or {}) for k in kwargs] if kwargs is not None else [{} for _ in args]
    if not args and not kws:  # no arguments at all: one replica, as torch
        args, kws = [()], [{}]
    if len(args) != len(kws):
        raise ValueError(
            f"scatter: expected as many kwargs entries as inputs entries (one per replica), but got "
            f"{len(args)} inputs and {len(kws)} kwargs"
        )
    if len(args) > device_count:
        raise ValueError(f"scatter: returned {len(args)} replicas' arguments for {device_count} device(s)")
    firsts = [next(iter(flatten((a, k))[0]), None) for a, k in zip(args, kws)]
    return args, kws, [int(t.size(dim)) if t is not None and -t.dim() <= dim < t.dim() else 0 for t in firsts]
