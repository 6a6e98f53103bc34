"""dpcore.DataParallel: torch.nn.DataParallel's signature and semantics, with
cached replicas, a persistent C++ worker pool, balanced splits, per-replica
loss and CPU device lists."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpcore._devices import DeviceLike, as_destination, as_devices
from dpcore._pytree import map_tensors
from dpcore._split import as_int, check_split
from dpcore.distributed import GradientSync
from dpcore.parallel_apply import _module_device, start_parallel_apply
from dpcore.replicate import DEFAULT_BUCKET_BYTES, ReplicaCache, check_on_device
from dpcore.replicate import replicate as replicate_module
from dpcore.scatter_gather import Scattered, scatter_kwargs
from dpcore.scatter_gather import gather as gather_outputs
from dpcore.sync_batchnorm import needs_sync, synchronized_apply

if TYPE_CHECKING:
    from dpcore._graphs import GraphRunner

__all__ = ["DataParallel", "data_parallel"]

#: torch's own class, bound when dpcore is imported (before dpcore.patch_torch
#: can rebind torch's public names to dpcore's class).
TorchDataParallel = nn.DataParallel


def _check_device_list(devices: list[torch.device]) -> None:
    """Raises for an empty list, mixed device types or invisible CUDA devices."""
    if not devices:
        raise ValueError("device_ids: expected at least one device, but the list is empty")
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"device_ids: expected devices of one type, but got {sorted(kinds)}: {devices}")
    for i, d in enumerate(devices):
        _check_usable(d, f"device_ids[{i}]")


def _check_usable(device: torch.device, arg: str) -> None:
    """Raises ValueError naming `arg` unless `device` is the CPU or a visible CUDA device."""
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is None or not 0 <= device.index < count:
            raise ValueError(f"{arg} is {device}, but only {count} CUDA device(s) are visible")
    elif device.type != "cpu":
        raise ValueError(f"{arg}: unsupported device type {device.type!r}; expected 'cuda' or 'cpu'")


def _check_bucket_bytes(value: Any) -> int:
    """`value` as a positive int (bool is not one), else TypeError/ValueError naming bucket_bytes."""
    size = as_int(value, "bucket_bytes")
    if size <= 0:
        raise ValueError(f"bucket_bytes: expected a positive number of bytes per parameter bucket, but got {size}")
    return size


def _check_losses(losses: Sequence[Any], devices: Sequence[torch.device]) -> None:
    """Raises unless every replica's loss is a 0-dim tensor: the losses are
    weighted by chunk size and summed, which needs one number per replica."""
    for i, (loss, device) in enumerate(zip(losses, devices)):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"criterion: expected a loss tensor from every replica, but replica {i} (on {device}) "
                f"returned {type(loss).__name__}"
            )
        if loss.dim() != 0:
            raise ValueError(
                f"criterion: expected a scalar (0-dim) loss from every replica, because the per-replica "
                f"losses are weighted by chunk size and summed, which needs one number per replica; but "
                f"replica {i} (on {device}) returned a loss of shape {list(loss.shape)}. Use a reducing "
                f"criterion (reduction='mean' or 'sum'), or drop criterion= and reduce the gathered outputs"
            )


def _summed(criterion: Callable[..., Any] | None) -> bool:
    """Whether `criterion` sums over the batch (``reduction="sum"``) rather than averaging."""
    return criterion is not None and getattr(criterion, "reduction", "mean") == "sum"


def _loss_weight(criterion: Callable[..., Any], chunk: int, total: int) -> float:
    """Weight of one replica's loss so that the weighted sum is the loss of the whole batch."""
    return 1.0 if _summed(criterion) else chunk / total


_EXTENSION_POINTS = ("scatter", "replicate", "parallel_apply", "gather")


def _check_overrides(cls: type, *, cuda_graphs: bool, sync_batchnorm: bool) -> None:
    """Raises ValueError where an option would silently skip a method that
    `cls` (a subclass of DataParallel) overrides."""
    if cls is DataParallel:
        return
    overridden = [name for name in _EXTENSION_POINTS if getattr(cls, name) is not getattr(DataParallel, name)]
    if cuda_graphs:
        skipped = [name for name in overridden if name in ("replicate", "parallel_apply")]
        if skipped:
            raise ValueError(
                f"cuda_graphs=True replays captured replicas and calls neither replicate nor parallel_apply, "
                f"but {cls.__name__} overrides {' and '.join(skipped)}: drop cuda_graphs=True or the override"
            )
    if sync_batchnorm and "parallel_apply" in overridden:
        raise ValueError(
            f"sync_batchnorm=True runs the replicas itself, all at once, since they wait for each other, but "
            f"{cls.__name__} overrides parallel_apply: drop sync_batchnorm=True or the override"
        )


class _ScatteredPair(tuple):  # type: ignore[type-arg]
    """What DataParallel.scatter returns: torch's pair ``(inputs, kwargs)``
    (one entry per replica in each), with dpcore's ``sizes`` (rows per
    replica) and ``device_indices`` (each replica's index into the device
    list) as attributes."""

    sizes: list[int]
    device_indices: list[int]

    def __new__(cls, scattered: Scattered) -> _ScatteredPair:
        pair = super().__new__(cls, (scattered.args, scattered.kwargs))
        pair.sizes = scattered.sizes
        pair.device_indices = scattered.device_indices
        return pair


def _split_of(result: Any, devices: Sequence[torch.device], dim: int) -> tuple[list[Any], list[Any], list[int], list[int]]:
    """(args, kwargs, sizes, device indices) per replica from what a
    ``scatter`` returned: dpcore's own pair carries them; for torch's plain
    ``(inputs, kwargs)`` (an overriding subclass) the replicas sit on the
    first devices, in order, and each one's rows are the size along `dim` of
    the first tensor in its arguments. Raises naming ``scatter`` for anything
    else."""
    if isinstance(result, _ScatteredPair):
        return result[0], result[1], result.sizes, result.device_indices
    if isinstance(result, Scattered):
        return result.args, result.kwargs, result.sizes, result.device_indices
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
    if len(args) > len(devices):
        raise ValueError(f"scatter: returned {len(args)} replicas' arguments for {len(devices)} device(s)")
    sizes = [_rows((a, k), dim) for a, k in zip(args, kws)]
    return args, kws, sizes, list(range(len(args)))


def _rows(tree: Any, dim: int) -> int:
    """The size along `dim` of the first tensor in `tree` (0 where there is
    none, or it has too few dimensions)."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(t)
        return t

    map_tensors(visit, tree)
    if not found or not -found[0].dim() <= dim < found[0].dim():
        return 0
    return int(found[0].size(dim))


class _SignedForward:
    """``DataParallel.forward`` as a descriptor: ``dp.forward`` is a bound
    callable whose ``inspect.signature`` is the wrapped module's forward
    signature (libraries such as Hugging Face's Trainer read it to pick the
    arguments the model takes)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.fn
        return _BoundForward(self.fn, obj)


class _BoundForward:
    """A DataParallel's bound ``forward`` (see _SignedForward)."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, fn: Callable[..., Any], obj: Any) -> None:
        self.__func__ = fn
        self.__self__ = obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        dp = self.__self__
        if getattr(dp, "criterion", None) is None:
            try:
                return inspect.signature(dp.module.forward)
            except (TypeError, ValueError):
                pass
        return inspect.signature(functools.partial(self.__func__, dp))

    @property
    def __name__(self) -> str:
        return self.__func__.__name__

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.__func__.__doc__

    def __repr__(self) -> str:
        return f"<bound method DataParallel.forward of {type(self.__self__).__name__}>"


class DataParallel(TorchDataParallel):
    """Runs ``module`` on several devices in one process: the batch is split
    along ``dim``, each device runs a replica on its chunk, and the outputs
    are gathered onto ``output_device``. Drop-in for torch.nn.DataParallel,
    and an instance of it (``isinstance(dp, torch.nn.DataParallel)`` holds,
    so libraries that unwrap torch's wrapper by isinstance unwrap this one;
    torch's ``__init__`` never runs and every method torch's class defines
    is dpcore's own).

    Extension points, as torch's: ``forward`` calls ``scatter(inputs,
    kwargs, device_ids)``, ``replicate(module, device_ids)``,
    ``parallel_apply(replicas, inputs, kwargs)`` and ``gather(outputs,
    output_device)``, with torch's signatures, so a subclass written for
    torch's wrapper that overrides any of them works unchanged (as torch,
    with a single device in ``device_ids`` only ``scatter`` is called and the
    module's output is returned as is when ``gather`` is overridden). Where
    a subclass overrides none of them, dpcore's fast paths run (the cached
    replicas, the worker pool, ``sync_batchnorm``, ``cuda_graphs``). An
    overridden ``scatter`` returns ``(inputs, kwargs)``, one entry per
    replica on ``device_ids[0..n-1]``; each replica's rows (its weight with
    ``criterion=``, its share with a process group) are then the size along
    ``dim`` of the first tensor in its arguments. Combinations that would
    silently skip an override are errors: ``cuda_graphs=True`` with an
    overridden ``replicate`` or ``parallel_apply`` (replays call neither),
    ``sync_batchnorm=True`` with an overridden ``parallel_apply`` (its
    replicas must run at once), ``criterion=`` or ``gather=False`` with an
    overridden ``gather`` (neither gathers outputs). With ``criterion=``,
    ``parallel_apply`` gets, per replica, a callable that runs the replica
    and returns its loss. ``inspect.signature(dp.forward)`` is the wrapped
    module's forward signature (without ``criterion=``).

    Args:
        module: the module to parallelise; must sit on ``device_ids[0]``.
        device_ids: CUDA devices (ints, "cuda:i", torch.device) or CPU devices
            (``["cpu"] * 4``), repeats allowed. Default: every visible GPU;
            with no GPU and no list, the module runs as is.
        output_device: where outputs (or the loss) are gathered; default
            ``device_ids[0]``; -1 or "cpu" is the CPU. Checked at
            construction: the CPU or a visible CUDA device.
        dim: the batch dimension.
        chunk_sizes: explicit split sizes, one int per device (zeros allowed).
        weights: per-device split weights (proportional split): real numbers,
            finite, >= 0, with a positive sum. Both are checked here, by the
            rules of dpcore._split: a float, str or bool size (or weight) is
            a TypeError, a negative one or a wrong count a ValueError, each
            naming the argument, the index and the value.
        criterion: ``loss_fn(output, target)``; then ``dp(*inputs, target)``
            returns one scalar loss computed inside each replica, weighted by
            chunk size (equal to the single-device loss of the whole batch for
            a mean-reduced loss, summed for ``reduction="sum"``). It must
            return a 0-dim tensor for each replica (else ValueError naming
            the replica and the shape).
        gather: False returns the per-replica outputs where they were computed.
        bucket_bytes: size of the parameter buckets broadcast to replicas
            (a positive int; with a process group, also the size of the
            gradient all-reduce buckets).
        sync_batchnorm: BatchNorm layers that use batch statistics normalize
            with those of the whole batch across the replicas of the call
            (dpcore/sync_batchnorm.py: exact against one device, the running
            statistics too; a replica that raises or skips a BatchNorm call
            gives one clear error, never a hang). The modules stay plain
            BatchNorm; eval mode is unchanged.
        process_group: a torch.distributed process group; every process of
            it runs this in-process data parallelism over its own
            ``device_ids`` and together they train one model (hybrid data
            parallelism, see dpcore.distributed): parameters and buffers
            start from the group's rank 0, gradients after ``backward()`` are
            those of the loss over the global batch (each process weighted
            by its share; without ``criterion=`` the loss is taken to be a
            mean over the batch, as DDP averages). ``device_ids`` defaults to
            the module's device here.
        broadcast_buffers: with a process group, broadcast buffers from rank
            0 before each forward (as DDP's option of that name).
        cuda_graphs: capture each replica's forward and backward into CUDA
            graphs and replay them (see dpcore/_graphs.py). Per input
            signature (which replicas run; every argument's structure,
            shapes, strides, dtypes and requires_grad, non-tensor argument
            values; grad and inference mode; autocast; every submodule's
            training flag) the first 3 calls run eagerly, each replica on a
            stream of its own, the 4th captures and every later one replays:
            one launch per replica and graph, replicas on one device
            overlapping. Results equal eager dpcore's (BatchNorm statistics
            too; dropout draws fresh numbers every replay from a per-replica
            generator state). Module hooks, host synchronizations in forward,
            parameters whose storage was replaced rather than updated in
            place, autocast with its cache on, and non-CUDA or unhashable
            arguments run eagerly, with one warning naming the reason. A
            replay runs no Python of the module: attributes other than
            ``training`` that forward reads are those of the capture, and
            replayed gradients support no double backward. CUDA device lists
            only (else ValueError); not with ``sync_batchnorm``.

    Guarantees: outputs and parameter gradients equal the single-device ones
    (up to floating-point summation order); a balanced split uses every
    device while the batch is at least the device count; tensors whose batch
    sizes disagree raise ValueError naming both; replicas are cached across
    steps and refreshed only where the master changed; ``state_dict()`` has
    the bare module's keys. Unlike torch, the first replica is ``module``
    itself: ``zero_grad()`` called on it inside forward clears the master's
    gradients (torch's replicas are copies, where it only warns; dpcore's
    other replicas warn as torch's do).

    Threads: one wrapper may be called from several threads at once. Its
    calls are serialized: one call at a time refreshes the replicas, runs
    them and collects their outputs (so the replicas of concurrent calls
    never see each other's refresh), and each call's results equal those of
    the same call made alone (while no thread changes the master). Backward
    passes of different calls may run at once (the master's ``.grad``
    accumulates, as for any module shared by threads); a graph that saved
    replica parameters whose values a later call's refresh changed (the
    master was updated in between) raises autograd's "modified by an
    inplace operation" error rather than reading the new values. A replica
    of this wrapper (nested in a replicated model) serializes its own calls;
    different wrappers are not serialized against one another.

    Signals: Ctrl-C (or any signal handler's exception) during a call is
    raised in the calling thread within about 50 ms, however long the
    replicas take; replicas not yet started are skipped, running ones finish
    in the background, and the next call of this wrapper waits for them
    before it touches the replicas.
    """

    # Attributes a replica of this wrapper (DataParallel nested in a model
    # that is itself replicated) keeps for itself: its own replica cache and
    # its own call serialization.
    _replica_private_attrs = ("_cache", "_calls", "_graphs")

    # The devices of the replicas of the call in progress, for the default
    # parallel_apply when a subclass overrides replicate (None otherwise).
    _call_devices: list[torch.device] | None = None

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        chunk_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        criterion: Callable[..., Any] | None = None,
        gather: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_batchnorm: bool = False,
        process_group: Any = None,
        broadcast_buffers: bool = True,
        cuda_graphs: bool = False,
    ) -> None:
        # torch.nn.DataParallel.__init__ must not run (it would resolve CUDA
        # indices, move the module and warn): only nn.Module's.
        nn.Module.__init__(self)
        self._calls = _CallGuard()
        self._graphs: GraphRunner | None = None
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, but got {type(module).__name__}")
        if not isinstance(sync_batchnorm, bool):
            raise TypeError(f"sync_batchnorm: expected True or False, but got {sync_batchnorm!r}")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected True or False, but got {cuda_graphs!r}")
        if cuda_graphs and sync_batchnorm:
            raise ValueError(
                "cuda_graphs=True cannot be combined with sync_batchnorm=True: synchronized BatchNorm's replicas "
                "meet on the host inside forward, which a CUDA graph cannot capture"
            )
        _check_overrides(type(self), cuda_graphs=cuda_graphs, sync_batchnorm=sync_batchnorm)
        self.cuda_graphs = cuda_graphs
        self.sync_batchnorm = sync_batchnorm
        self.module = module
        self.dim = dim
        self.chunk_sizes, self.weights = check_split(chunk_sizes, weights)
        self.criterion = criterion
        # ``gather`` is torch's method name; the option is stored as ``gather_output``.
        self.gather_output = gather
        self.bucket_bytes = _check_bucket_bytes(bucket_bytes)
        self._sync: GradientSync | None = None
        if device_ids is None and process_group is not None:
            device_ids = [_module_device(module)]  # one device per process, as DDP
        if device_ids is None:
            device_ids = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
            if not device_ids:
                if cuda_graphs:
                    raise ValueError(
                        "cuda_graphs=True needs CUDA devices, but no device_ids were given and no GPU is visible"
                    )
                self.device_ids: list[torch.device] = []
                self.output_device = None
                self._cache = None
                return
        self.device_ids = as_devices(device_ids, "device_ids")
        _check_device_list(self.device_ids)
        if cuda_graphs and self.device_ids[0].type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs a CUDA device list, but device_ids is {[str(d) for d in self.device_ids]}: "
                f"CUDA graphs capture CUDA work only"
            )
        check_split(self.chunk_sizes, self.weights, len(self.device_ids))
        self.output_device = as_destination(output_device, "output_device") or self.device_ids[0]
        _check_usable(self.output_device, "output_device")
        check_on_device(module, self.device_ids[0], "device_ids[0]")
        self._cache: ReplicaCache | None = None
        if cuda_graphs:
            self._graphs = _graph_runner()
        if process_group is not None:
            self._sync = GradientSync(
                module, self.device_ids[0], process_group,
                broadcast_buffers=broadcast_buffers, bucket_bytes=self.bucket_bytes,
            )

    # -- attribute fall-through, state dicts, pickling -----------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "_cache", "_calls", "_graphs"):
                raise
            return getattr(self.module, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The bare module's state dict (no ``module.`` prefix). Reading an
        entry by torch.nn.DataParallel's key (``sd["module.fc.weight"]``)
        gives the bare key's entry too (see _StateDict); iteration, ``in``,
        saving and loading see the bare keys only. With a ``destination``,
        the module's entries are written into it, as nn.Module does."""
        if args or kwargs.get("destination") is not None:
            return self.module.state_dict(*args, **kwargs)
        kwargs.pop("destination", None)
        destination = _StateDict()
        destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        return self.module.state_dict(destination=destination, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Loads a bare module's state dict (keys with a ``module.`` prefix, as
        torch's DataParallel writes them, are accepted too)."""
        if _has_module_prefix(list(state_dict), self.module):
            state_dict = {k[len("module.") :]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Reached only when this wrapper is a submodule of a module whose
        # load_state_dict runs: its state_dict() wrote our entries without the
        # "module." segment, but the loader descends into self.module with
        # prefix + "module.". Children's entries are picked from this same
        # dict afterwards, so renaming here is enough.
        keys = [k for k in state_dict if k.startswith(prefix)]
        if keys and not _has_module_prefix([k[len(prefix) :] for k in keys], self.module):
            for k in keys:
                state_dict[prefix + "module." + k[len(prefix) :]] = state_dict.pop(k)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = None
        state["_calls"] = None  # a lock cannot be pickled; each copy gets its own
        state["_graphs"] = None  # CUDA graphs and streams neither
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("gather"), bool):  # pickled before the option became gather_output
            state["gather_output"] = state.pop("gather")
        super().__setstate__(state)
        self._calls = _CallGuard()
        self._graphs = _graph_runner() if state.get("cuda_graphs") else None

    def _replicate_for_data_parallel(self) -> DataParallel:
        # A replica of this wrapper (nested in a replicated model) runs its
        # own replicas, concurrently with the master's: never share them.
        replica = super()._replicate_for_data_parallel()
        replica._cache = None
        replica._calls = _CallGuard()
        replica._graphs = _graph_runner() if self.cuda_graphs else None
        return replica

    @property
    def src_device_obj(self) -> torch.device | None:
        """torch's attribute: the device of the module, ``device_ids[0]``
        (None where the wrapper runs the module as is, with no device)."""
        return self.device_ids[0] if self.device_ids else None

    # -- torch.nn.DataParallel's extension points --------------------------

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike]) -> Any:
        """torch's ``scatter``: ``(inputs, kwargs)``, the positional and
        keyword arguments of each replica, split along ``dim`` by dpcore's
        rules (balanced, or ``chunk_sizes`` / ``weights``; see
        :func:`dpcore.scatter_gather.scatter_kwargs`). The pair also carries
        ``.sizes`` (rows per replica) and ``.device_indices`` (the indices
        into ``device_ids`` of the replicas' devices)."""
        return _ScatteredPair(scatter_kwargs(inputs, kwargs, device_ids, self.dim, self.chunk_sizes, self.weights))

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """torch's ``replicate``: one module per device of ``device_ids``, the
        first ``module`` itself, gradients flowing back to it (without
        autograd history under no_grad, as torch). For this wrapper's module
        on a leading part of its own ``device_ids`` (what ``forward`` asks
        for), the cached replicas, refreshed; else fresh ones."""
        devices = as_devices(device_ids, "device_ids")
        if module is self.module and devices and devices == self.device_ids[: len(devices)]:
            return self._replicas(len(devices))
        return replicate_module(module, devices, detach=not torch.is_grad_enabled())

    def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """torch's ``parallel_apply``: ``replicas[i](*inputs[i], **kwargs[i])``
        for every i at once on dpcore's worker pool (see
        :func:`dpcore.parallel_apply`), each with the device of its replica in
        this call (else ``device_ids[i]``) as current device; the outputs in
        order."""
        if len(replicas) == 1:  # in this thread, as forward runs a single replica
            first = inputs[0]
            return [replicas[0](*(first if isinstance(first, (list, tuple)) else (first,)), **((kwargs or [{}])[0] or {}))]
        devices = self._call_devices
        if devices is None or len(devices) != len(replicas):
            devices = self.device_ids[: len(replicas)]
        return self._parallel_apply(replicas, inputs, kwargs, devices)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike | None) -> Any:
        """torch's ``gather``: the per-replica outputs joined along ``dim`` on
        ``output_device`` (see :func:`dpcore.gather`)."""
        return gather_outputs(outputs, output_device, dim=self.dim)

    def _overrides(self, name: str) -> bool:
        """Whether this wrapper's class (or the instance) replaces the
        extension point `name` of dpcore's class."""
        return getattr(type(self), name) is not getattr(DataParallel, name) or name in self.__dict__

    # -- forward --------------------------------------------------------------

    def _replica_cache(self) -> ReplicaCache:
        """The replica cache, rebuilt first where the master's structure changed."""
        if self._cache is None or not self._cache.valid():
            check_on_device(self.module, self.device_ids[0], "device_ids[0]")
            self._cache = ReplicaCache(self.module, self.device_ids, self.bucket_bytes)
            if self._sync is not None:  # the gradient buckets follow a structural change (collective)
                self._sync.check_structure()
        return self._cache

    def _replicas(self, n: int) -> list[nn.Module]:
        return self._replica_cache().replicas(n)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with self._calls:
            if self._sync is None:
                return self._forward(*inputs, **kwargs)
            self._sync.before_forward()
            output = self._forward(*inputs, **kwargs)
            return self._sync.after_forward(output, self._local_batch, _summed(self.criterion))

    forward = _SignedForward(forward)  # type: ignore[assignment]

    def _parallel_apply(
        self, fns: Sequence[Callable[..., Any]], args: Any, kws: Any, devices: Any, *, all_at_once: bool = False
    ) -> list[Any]:
        run = start_parallel_apply(fns, args, kws, devices, all_at_once=all_at_once)
        try:
            return run.result()
        except BaseException:
            if not run.done:  # interrupted: its running replicas finish in the background
                self._calls.abandoned = run
            raise

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as DDP's ``no_sync``: the backward passes of
        forwards run inside accumulate into ``.grad`` in this process only;
        the first backward of a forward outside all-reduces the accumulated
        gradients. Without a process group there is nothing to skip."""
        if self._sync is None:
            yield
        else:
            with self._sync.no_sync():
                yield

    def _forward(self, *inputs: Any, **kwargs: Any) -> Any:
        criterion = self.criterion
        if criterion is not None:
            if not inputs:
                raise TypeError("DataParallel with a criterion expects the target as the last positional argument")
        if not self.device_ids:
            if criterion is None:
                return self.module(*inputs, **kwargs)
            return criterion(self.module(*inputs[:-1], **kwargs), inputs[-1])

        if criterion is not None or not self.gather_output:
            if self._overrides("gather"):
                given = "criterion=" if criterion is not None else "gather=False"
                raise ValueError(
                    f"{type(self).__name__} overrides gather, but {given} gathers no outputs, so the override "
                    f"would never run: drop {given} or the override"
                )
        args, kws, sizes, used = _split_of(self.scatter(inputs, kwargs, self.device_ids), self.device_ids, self.dim)
        self._local_batch = sum(sizes)  # this process's share, for the process group's weights
        if criterion is not None and len(sizes) > 1 and 0 in sizes:  # only from an overridden scatter
            raise ValueError(
                f"criterion: each replica's loss is weighted by its rows, but {type(self).__name__}.scatter gave "
                f"replica {sizes.index(0)} no tensor with a dimension {self.dim} to count them by"
            )
        if used[0] != 0:
            given = "chunk_sizes" if self.chunk_sizes is not None else "weights"
            split = [0] * len(self.device_ids)
            for index, size in zip(used, sizes):
                split[index] = size
            raise ValueError(
                f"{given}: the first device (device_ids[0], which holds the module) must get a non-empty "
                f"chunk, but {given}={self.chunk_sizes or self.weights} split the batch of {sum(sizes)} "
                f"into {split}"
            )
        devices = [self.device_ids[i] for i in used]
        make_call: Callable[[nn.Module], Callable[..., Any]] = (
            (lambda m: m) if criterion is None else functools.partial(_with_loss, criterion=criterion)
        )
        outputs = None
        if self._graphs is not None:
            outputs = self._graphs.step(self, args, kws, used, make_call)
        replayed = outputs is not None  # by replay (or an eager warm-up on the replica streams)
        if replayed:
            if (not self.gather_output or self._overrides("gather")) and criterion is None:
                # Replayed outputs alias the graphs' static memory, which the next replay overwrites.
                outputs = [map_tensors(torch.Tensor.clone, o) for o in outputs]
        elif len(self.device_ids) > 1 and (self._overrides("replicate") or self._overrides("parallel_apply")):
            outputs = self._run_overridden(args, kws, used, make_call)
        else:
            outputs = self._run_eagerly(args, kws, used, make_call)
        if criterion is not None:
            _check_losses(outputs, devices)
            total = sum(sizes)
            if total == 0:
                return outputs[0].clone() if replayed else outputs[0]
            out = self.output_device
            parts = [loss.to(out) * _loss_weight(criterion, size, total) for loss, size in zip(outputs, sizes)]
            return torch.stack(parts).sum() if len(parts) > 1 else parts[0]
        if not self.gather_output:
            return outputs
        if len(self.device_ids) == 1 and self._overrides("gather"):
            return outputs[0]  # torch: with one device, the module's output as is
        return self.gather(outputs, self.output_device)

    def _run_overridden(
        self, args: list[Any], kws: list[Any], used: list[int], make_call: Callable[[nn.Module], Callable[..., Any]]
    ) -> list[Any]:
        """The outputs of the replicas `used`, through this wrapper's
        ``replicate`` and ``parallel_apply`` (a subclass overrides one of
        them): as torch's forward calls them."""
        replicas = self.replicate(self.module, self.device_ids[: used[-1] + 1])
        if not isinstance(replicas, Sequence) or len(replicas) != used[-1] + 1:
            got = len(replicas) if isinstance(replicas, Sequence) else type(replicas).__name__
            raise ValueError(
                f"{type(self).__name__}.replicate: expected one replica per device ({used[-1] + 1}), but got {got}"
            )
        modules = [replicas[i] for i in used]
        calls = [make_call(m) for m in modules]
        devices = [self.device_ids[i] for i in used]
        self._call_devices = devices
        try:
            if self.sync_batchnorm and len(calls) > 1 and needs_sync(self.module):
                # parallel_apply is dpcore's here (checked at construction)
                return synchronized_apply(modules, calls, args, kws, devices, run=self._parallel_apply)
            outputs = self.parallel_apply(calls, args, kws)
        finally:
            self._call_devices = None
        if not isinstance(outputs, Sequence) or len(outputs) != len(calls):
            got = len(outputs) if isinstance(outputs, Sequence) else type(outputs).__name__
            raise ValueError(
                f"{type(self).__name__}.parallel_apply: expected one output per replica ({len(calls)}), but got {got}"
            )
        return list(outputs)

    def _run_eagerly(
        self, args: list[Any], kws: list[Any], used: list[int], make_call: Callable[[nn.Module], Callable[..., Any]]
    ) -> list[Any]:
        """The outputs of the replicas `used` on their chunks, run eagerly:
        several on the worker pool (synchronized BatchNorm's replicas all at
        once), one in this thread."""
        replicas = self._replicas(used[-1] + 1)
        calls = [make_call(replicas[i]) for i in used]
        if len(calls) == 1:
            return [calls[0](*args[0], **kws[0])]
        devices = [self.device_ids[i] for i in used]
        if self.sync_batchnorm and needs_sync(self.module):
            modules = [replicas[i] for i in used]
            return synchronized_apply(modules, calls, args, kws, devices, run=self._parallel_apply)
        return self._parallel_apply(calls, args, kws, devices)


class _StateDict(OrderedDict):  # type: ignore[type-arg]
    """A DataParallel's state dict: the bare module's keys and values, where
    reading a key that has torch.nn.DataParallel's ``module.`` prefix
    (``sd["module.fc.weight"]``, as code written for torch's wrapper reads
    its state dict: timm's ModelEma) gives the entry of the bare key, as a
    defaultdict answers missing keys; ``in``, ``get``, iteration and
    ``len`` see the bare keys only. No alias is made where a key of the
    module itself starts with ``module.`` (a child named ``module``): then
    a missing key stays a KeyError. Pickles (``torch.save``, also
    ``torch.load(weights_only=True)``), copies and deep-copies as a plain
    OrderedDict with its ``_metadata``, so a checkpoint never needs dpcore
    to load."""

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, str) and key.startswith("module.") and not self._has_prefixed_keys():
            bare = key[len("module.") :]
            if dict.__contains__(self, bare):
                return dict.__getitem__(self, bare)
        raise KeyError(key)

    def _has_prefixed_keys(self) -> bool:
        """Whether any real key starts with ``module.`` (cached per length)."""
        cached = self.__dict__.get("_prefixed")
        if cached is None or cached[0] != len(self):
            cached = (len(self), any(isinstance(k, str) and k.startswith("module.") for k in self))
            self.__dict__["_prefixed"] = cached
        return cached[1]

    def __reduce__(self) -> tuple[Any, ...]:
        metadata = self.__dict__.get("_metadata")
        state = None if metadata is None else {"_metadata": metadata}
        return (OrderedDict, (), state, None, iter(self.items()))


def _graph_runner() -> GraphRunner:
    """A fresh CUDA-graph runner (dpcore._graphs is imported only where
    cuda_graphs=True)."""
    from dpcore._graphs import GraphRunner

    return GraphRunner()


class _CallGuard:
    """Serializes the calls of one DataParallel (``with guard:`` around a
    call), and holds the run of a call interrupted while its replicas were
    still running: the next call waits for those replicas first
    (interruptibly), since they use the same replica modules."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned: Any = None  # a dpcore._C.ParallelRun, or None

    def __enter__(self) -> _CallGuard:
        self.lock.acquire()
        try:
            if self.abandoned is not None:
                self.abandoned.join()
                self.abandoned = None
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _has_module_prefix(keys: list[str], module: nn.Module) -> bool:
    """Whether state-dict `keys` carry torch.nn.DataParallel's "module."
    prefix, rather than being `module`'s own keys (a module may well have a
    child named "module")."""
    if not keys or not all(k.startswith("module.") for k in keys):
        return False
    own = module.state_dict(keep_vars=True).keys()
    return any(k not in own for k in keys)


def _with_loss(module: nn.Module, criterion: Callable[..., Any]) -> Callable[..., Any]:
    """A callable that runs `module` on all but the last argument and returns
    criterion(output, last argument)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return criterion(module(*args[:-1], **kwargs), args[-1])

    return call


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """Functional form (torch.nn.parallel.data_parallel's contract): evaluates
    ``module(*inputs, **module_kwargs)`` in parallel over ``device_ids``. Uses
    a one-off DataParallel, so nothing is cached between calls."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if module_kwargs is not None and not isinstance(module_kwargs, Mapping):
        raise TypeError(f"module_kwargs: expected a mapping of keyword arguments, but got {type(module_kwargs).__name__}")
    return DataParallel(module, device_ids, output_device, dim, **options)(*inputs, **(module_kwargs or {}))
