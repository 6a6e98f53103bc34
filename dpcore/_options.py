"""DataParallel's options as one frozen value (:class:`Options`) and every rule that ties them together, checked in
one place (:func:`check_options`, at construction and at each write); errors name the option (and, for lists,
the index and the value)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dpcore._compiled import has_compiled
from dpcore._devices import DeviceLike, as_destination, as_devices
from dpcore._split import as_int, check_split
from dpcore._unit_plan import check_policy
from dpcore.parallel_apply import _module_device
from dpcore.replicate import check_on_device, check_replica_refresh

#: A loss module's own ``.reduction`` -> its reduction over the batch ("none" is refused per call).
_OWN_REDUCTIONS = {"mean": "mean", "batchmean": "mean", "sum": "sum", "none": "none"}
#: What ``model_loss=`` takes.
MODEL_LOSSES = ("rows", "items", "sum", "num_items_in_batch")
#: Fixed at construction, since the hybrid mode's ranks agree on them then.
_HYBRID = ("process_group", "forward_sync_buffers", "broadcast_buffers")
#: Fixed with a process group too: the ranks agreed on the module's layout and buckets on the first device.
_LAYOUT = ("module", "device_ids", "bucket_bytes", "sync_batchnorm")
#: Fixed once the parameters are sharded over the device list.
_SHARDED = ("module", "device_ids", "shard_parameters", "shard_gradients")


class FrozenList(list):  # type: ignore[type-arg]
    """A list option as read back (``dp.device_ids``): changed by assigning a new list, never in place."""

    def __init__(self, values: Sequence[Any], name: str) -> None:
        super().__init__(values)
        self.name = name

    def _refuse(self, *args: Any) -> Any:
        raise TypeError(f"{self.name}: read-only; assign a new list (dp.{self.name} = [...]) to change the option")

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenList, (list(self), self.name))


@dataclasses.dataclass(frozen=True, eq=False)
class Options:
    """A wrapper's options as given (``gather``: ``dp.gather_output``) once checked, and what they imply:
    ``devices`` (empty where the module runs as is), ``out`` (the output device), ``reduction`` (of the returned
    loss; None without one) and ``own_reduction`` (the criterion's ``.reduction`` when checked)."""

    device_ids: Sequence[DeviceLike] | None
    output_device: DeviceLike | None
    dim: int
    chunk_sizes: Sequence[int] | None
    weights: Sequence[float] | None
    criterion: Callable[..., Any] | None
    criterion_reduction: str | None
    model_loss: str | None
    loss_items: Callable[..., Any] | None
    gather: bool
    bucket_bytes: int
    sync_batchnorm: bool
    process_group: Any
    forward_sync_buffers: bool | None
    broadcast_buffers: bool | None
    cuda_graphs: bool
    replica_refresh: str
    shard_gradients: bool
    shard_parameters: Any
    reshard_after_forward: bool
    devices: Sequence[torch.device] = ()
    out: torch.device | None = None
    reduction: str | None = None
    own_reduction: Any = None


_GIVEN = [f.name for f in dataclasses.fields(Options) if f.default is dataclasses.MISSING]
#: Each writable attribute of a wrapper -> its option (``gather`` is torch's method: ``gather_output``), and ``module``.
ATTRIBUTES = {**{name: name for name in _GIVEN if name != "gather"}, "gather_output": "gather", "module": "module"}


def check_options(cls: type, base: type, module: Any, o: Options) -> Options:
    """`o`, the options of a `cls` wrapper of `module`, checked, with what they imply. `base`: dpcore's class."""
    criterion, loss_items = o.criterion, o.loss_items
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, but got {type(module).__name__}")
    check_policy(o.shard_parameters)
    for name in ("sync_batchnorm", "cuda_graphs", "gather", "shard_gradients", "reshard_after_forward"):
        if not isinstance(getattr(o, name), bool):
            raise TypeError(f"{name}: expected True or False, but got {getattr(o, name)!r}")
    if o.cuda_graphs and o.sync_batchnorm:
        raise ValueError(
            "cuda_graphs=True cannot be combined with sync_batchnorm=True: synchronized BatchNorm's replicas "
            "meet on the host inside forward, which a CUDA graph cannot capture"
        )
    if o.cuda_graphs:
        check_not_compiled(module)
    sharded = "shard_parameters=" if o.shard_parameters is not False else "shard_gradients=True"
    if (o.shard_gradients or o.shard_parameters is not False) and (o.process_group is not None or o.cuda_graphs):
        other = "process_group=" if o.process_group is not None else "cuda_graphs=True"
        raise ValueError(
            f"{sharded} cannot be combined with {other}: the gradients go, by the replicas' eager "
            f"backward, into the shards of a dpcore.ShardedOptimizer, never into .grad (which the hybrid mode "
            f"all-reduces and CUDA graph replays fill); drop one of them"
        )
    _check_overrides(cls, base, o)
    model_loss = _check_model_loss(o.model_loss, loss_items, criterion, o.gather, o.process_group)
    reduction = _criterion_reduction(criterion, o.criterion_reduction) or ("sum" if model_loss == "sum" else None)
    if criterion is not None and loss_items is not None:
        if reduction != "mean":
            raise ValueError(
                f"loss_items: with criterion=, only for a mean criterion (its reduction is {reduction!r}): "
                f"it counts the items each replica's loss averages over"
            )
        if o.process_group is not None:
            raise ValueError("loss_items: not supported with process_group= (processes are weighted by rows)")
    bucket_bytes = as_int(o.bucket_bytes, "bucket_bytes")
    if bucket_bytes <= 0:
        raise ValueError(
            f"bucket_bytes: expected a positive number of bytes per parameter bucket, but got {bucket_bytes}"
        )
    devices, out = _devices(module, o)
    chunk_sizes, weights = check_split(o.chunk_sizes, o.weights, len(devices) or None)
    return dataclasses.replace(
        o,
        device_ids=None if o.device_ids is None else devices,
        dim=as_int(o.dim, "dim"),
        chunk_sizes=None if chunk_sizes is None else FrozenList(chunk_sizes, "chunk_sizes"),
        weights=None if weights is None else FrozenList(weights, "weights"),
        bucket_bytes=bucket_bytes,
        replica_refresh=check_replica_refresh(o.replica_refresh),
        devices=devices,
        out=out,
        reduction=reduction,
        own_reduction=getattr(criterion, "reduction", None),
    )


def check_write(cls: type, base: type, module: Any, o: Options, field: str, value: Any) -> Options:
    """The options of a `cls` wrapper of `module` once its option `field` (or the ``module`` itself) is `value`,
    checked as :func:`check_options` checks; AttributeError naming `field` where it cannot change."""
    if field in _HYBRID or (o.process_group is not None and field in _LAYOUT):
        raise AttributeError(
            f"{field}: cannot be changed after construction{' with process_group=' if field in _LAYOUT else ''}: the "
            f"processes of the hybrid mode agree on it (and on the module's layout) once, when the wrapper is built; "
            f"build a new DataParallel instead"
        )
    if o.shard_parameters is not False and len(o.devices) > 1 and field in _SHARDED:
        raise AttributeError(
            f"{field}: cannot be changed once the parameters are sharded (shard_parameters=): they live on their "
            f"owners of this device list; save dp.state_dict() and build a new DataParallel instead"
        )
    if field == "module":
        return check_options(cls, base, value, o)
    return check_options(cls, base, module, dataclasses.replace(o, **{field: value}))


def _devices(module: nn.Module, o: Options) -> tuple[FrozenList, torch.device | None]:
    """The checked devices and output device; with a process group and no
    list, the module's device (as DDP); with neither a list nor a GPU, none."""
    device_ids = o.device_ids
    if device_ids is None and o.process_group is not None:
        device_ids = [_module_device(module)]
    if device_ids is None:
        device_ids = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        if not device_ids:
            if o.cuda_graphs:
                raise ValueError(
                    "cuda_graphs=True needs CUDA devices, but no device_ids were given and no GPU is visible"
                )
            return FrozenList([], "device_ids"), None
    devices = FrozenList(check_device_list(device_ids, "device_ids"), "device_ids")
    if o.cuda_graphs and devices[0].type != "cuda":
        raise ValueError(
            f"cuda_graphs=True needs a CUDA device list, but device_ids is {[str(d) for d in devices]}: "
            f"CUDA graphs capture CUDA work only"
        )
    out = as_destination(o.output_device, "output_device") or devices[0]
    check_usable(out, "output_device")
    check_on_device(module, devices[0], "device_ids[0]")
    return devices, out


def check_device_list(device_ids: Sequence[DeviceLike], arg: str) -> list[torch.device]:
    """`device_ids` as devices: at least one, of one type, each the CPU or a visible CUDA device."""
    devices = as_devices(device_ids, arg)
    if not devices:
        raise ValueError(f"{arg}: expected at least one device, but the list is empty")
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"{arg}: expected devices of one type, but got {sorted(kinds)}: {devices}")
    for i, d in enumerate(devices):
        check_usable(d, f"{arg}[{i}]")
    return devices


def check_usable(device: torch.device, arg: str) -> None:
    """Raises ValueError naming `arg` unless `device` is the CPU or a visible CUDA device."""
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is None or not 0 <= device.index < count:
            raise ValueError(f"{arg} is {device}, but only {count} CUDA device(s) are visible")
    elif device.type != "cpu":
        raise ValueError(f"{arg}: unsupported device type {device.type!r}; expected 'cuda' or 'cpu'")


def check_not_compiled(module: nn.Module) -> None:
    """Raises ValueError where `module` or a submodule is torch.compile'd (for cuda_graphs=True)."""
    if has_compiled(module):
        raise ValueError(
            "cuda_graphs=True does not capture torch.compile'd modules, and the module (or one of its submodules) "
            "is compiled: pass cuda_graphs=False, where each replica runs its own compiled code, or the "
            "uncompiled module with cuda_graphs=True"
        )


def overrides(cls: type, base: type, name: str) -> bool:
    """Whether `cls` replaces the extension point `name` of `base`."""
    return getattr(cls, name) is not getattr(base, name)


def _check_overrides(cls: type, base: type, o: Options) -> None:
    """Raises ValueError where an option would silently skip a method that `cls` overrides."""
    overridden = [name for name in ("scatter", "replicate", "parallel_apply", "gather") if overrides(cls, base, name)]
    on = {"criterion=": o.criterion is not None, "gather=False": not o.gather, "model_loss=": o.model_loss is not None}
    bypasses_gather = next((option for option, given in on.items() if given), None)
    if bypasses_gather is not None and "gather" in overridden:
        raise ValueError(
            f"{cls.__name__} overrides gather, but {bypasses_gather} returns a loss or the per-replica "
            f"outputs without calling gather, so the override would never run: drop {bypasses_gather} or the override"
        )
    skipped = [name for name in overridden if name in ("replicate", "parallel_apply")]
    if o.cuda_graphs and skipped:
        raise ValueError(
            f"cuda_graphs=True replays captured replicas and calls neither replicate nor parallel_apply, "
            f"but {cls.__name__} overrides {' and '.join(skipped)}: drop cuda_graphs=True or the override"
        )
    if o.sync_batchnorm and "parallel_apply" in overridden:
        raise ValueError(
            f"sync_batchnorm=True runs the replicas itself, all at once, since they wait for each other, but "
            f"{cls.__name__} overrides parallel_apply: drop sync_batchnorm=True or the override"
        )


def _describe(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_describe(fn.func)}, ...)"
    return repr(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _criterion_reduction(criterion: Callable[..., Any] | None, declared: Any) -> str | None:
    """How `criterion` reduces its chunk ("mean", "sum", "none"; None without
    one): `declared`, or the criterion's own ``.reduction``; never guessed."""
    if declared is not None:
        if not isinstance(declared, str):
            raise TypeError(
                f"criterion_reduction: expected 'mean' or 'sum', but got {type(declared).__name__} {declared!r}"
            )
        if declared not in ("mean", "sum"):
            raise ValueError(f"criterion_reduction: expected 'mean' or 'sum', but got {declared!r}")
        if criterion is None:
            raise ValueError("criterion_reduction: given without a criterion; it says how criterion= reduces its chunk")
    if criterion is None:
        return None
    if not callable(criterion):
        raise TypeError(f"criterion: expected a callable loss_fn(output, target), but got {type(criterion).__name__}")
    own = getattr(criterion, "reduction", None)
    own = own if isinstance(own, str) else None  # else not torch's convention: the user declares it
    if declared is not None:
        if _OWN_REDUCTIONS.get(own, declared) != declared:
            raise ValueError(f"criterion_reduction={declared!r} disagrees with the criterion's own reduction={own!r}")
        return declared
    if own is not None and own not in _OWN_REDUCTIONS:
        raise ValueError(
            f"criterion: its reduction {own!r} is not one dpcore knows ({sorted(_OWN_REDUCTIONS)}); declare how it "
            f"reduces its chunk with criterion_reduction='mean' or 'sum'"
        )
    if own is None:
        raise TypeError(
            f"criterion: dpcore cannot tell whether {_describe(criterion)} averages or sums over its chunk (it has no "
            f"'reduction' attribute, as torch's loss modules have); declare it: criterion_reduction='mean' (a mean "
            f"over the chunk's rows, weighted by chunk size) or criterion_reduction='sum' (summed)"
        )
    return _OWN_REDUCTIONS[own]


def _check_model_loss(model_loss: Any, loss_items: Any, criterion: Any, gather: Any, process_group: Any) -> str | None:
    """The checked ``model_loss`` (None or one of MODEL_LOSSES), with its ``loss_items``."""
    if model_loss is None and loss_items is not None and criterion is None:
        raise ValueError(
            "loss_items: given without criterion= or model_loss='items' / 'num_items_in_batch', which use it"
        )
    if loss_items is not None and not callable(loss_items):
        raise TypeError(f"loss_items: expected a callable count(*args, **kwargs), but got {type(loss_items).__name__}")
    if model_loss is None:
        return None
    if not isinstance(model_loss, str):
        raise TypeError(
            f"model_loss: expected one of {list(MODEL_LOSSES)}, but got {type(model_loss).__name__} {model_loss!r}"
        )
    if model_loss not in MODEL_LOSSES:
        raise ValueError(f"model_loss: expected one of {list(MODEL_LOSSES)}, but got {model_loss!r}")
    if criterion is not None:
        raise ValueError(
            "model_loss: cannot be combined with criterion=: criterion computes the loss from the outputs, "
            "model_loss takes the loss that the model returns; give one of them"
        )
    if not gather:
        raise ValueError("model_loss: needs gather=True (it returns the gathered output with one exact loss)")
    if model_loss == "items" and loss_items is None:
        raise ValueError(
            "model_loss='items' needs loss_items=: a callable given each replica's (*args, **kwargs) that returns "
            "how many items its loss averages over (for example, labels other than -100)"
        )
    if loss_items is not None and model_loss not in ("items", "num_items_in_batch"):
        raise ValueError(
            f"loss_items: model_loss={model_loss!r} does not use it (only 'items' and 'num_items_in_batch')"
        )
    if process_group is not None and model_loss not in ("rows", "sum"):
        raise ValueError(
            f"model_loss={model_loss!r} is not supported with process_group= (the processes are weighted by their "
            f"share of rows): use 'rows' or 'sum'"
        )
    return model_loss
