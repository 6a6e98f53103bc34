"""DataParallel's options and every rule that ties them together, checked once at construction
(:func:`check_options`); errors name the option (and, for lists, the index and the value)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dpcore._compiled import has_compiled
from dpcore._devices import DeviceLike, as_destination, as_devices
from dpcore._split import as_int, check_split
from dpcore.parallel_apply import _module_device
from dpcore.replicate import check_on_device, check_replica_refresh

#: A loss module's own ``.reduction`` -> its reduction over the batch ("none" is refused per call).
_OWN_REDUCTIONS = {"mean": "mean", "batchmean": "mean", "sum": "sum", "none": "none"}
#: What ``model_loss=`` takes.
MODEL_LOSSES = ("rows", "items", "sum", "num_items_in_batch")


def check_options(cls: type, base: type, args: Mapping[str, Any]) -> SimpleNamespace:
    """`args` (a `cls` wrapper's ``__init__`` arguments) checked, as attributes, plus ``devices`` (empty where
    the module runs as is) and ``reduction`` (of the returned loss; None without one). `base`: dpcore's class."""
    o = SimpleNamespace(**{k: v for k, v in args.items() if k != "self"})
    module, criterion, loss_items = o.module, o.criterion, o.loss_items
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, but got {type(module).__name__}")
    for name in ("sync_batchnorm", "cuda_graphs", "gather"):
        if not isinstance(getattr(o, name), bool):
            raise TypeError(f"{name}: expected True or False, but got {getattr(o, name)!r}")
    if o.cuda_graphs and o.sync_batchnorm:
        raise ValueError(
            "cuda_graphs=True cannot be combined with sync_batchnorm=True: synchronized BatchNorm's replicas "
            "meet on the host inside forward, which a CUDA graph cannot capture"
        )
    if o.cuda_graphs:
        check_not_compiled(module)
    _check_overrides(cls, base, o)
    o.model_loss = _check_model_loss(o.model_loss, loss_items, criterion, o.gather, o.process_group)
    o.reduction = _criterion_reduction(criterion, o.criterion_reduction) or ("sum" if o.model_loss == "sum" else None)
    if criterion is not None and loss_items is not None:
        if o.reduction != "mean":
            raise ValueError(
                f"loss_items: with criterion=, only for a mean criterion (its reduction is {o.reduction!r}): "
                f"it counts the items each replica's loss averages over"
            )
        if o.process_group is not None:
            raise ValueError("loss_items: not supported with process_group= (processes are weighted by rows)")
    o.bucket_bytes = as_int(o.bucket_bytes, "bucket_bytes")
    if o.bucket_bytes <= 0:
        raise ValueError(
            f"bucket_bytes: expected a positive number of bytes per parameter bucket, but got {o.bucket_bytes}"
        )
    o.devices, o.output_device = _devices(o)
    o.chunk_sizes, o.weights = check_split(o.chunk_sizes, o.weights, len(o.devices) or None)
    o.replica_refresh = check_replica_refresh(o.replica_refresh)
    return o


def _devices(o: SimpleNamespace) -> tuple[list[torch.device], torch.device | None]:
    """The checked devices and output device; with a process group and no
    list, the module's device (as DDP); with neither a list nor a GPU, none."""
    device_ids = o.device_ids
    if device_ids is None and o.process_group is not None:
        device_ids = [_module_device(o.module)]
    if device_ids is None:
        device_ids = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        if not device_ids:
            if o.cuda_graphs:
                raise ValueError(
                    "cuda_graphs=True needs CUDA devices, but no device_ids were given and no GPU is visible"
                )
            return [], None
    devices = check_device_list(device_ids, "device_ids")
    if o.cuda_graphs and devices[0].type != "cuda":
        raise ValueError(
            f"cuda_graphs=True needs a CUDA device list, but device_ids is {[str(d) for d in devices]}: "
            f"CUDA graphs capture CUDA work only"
        )
    out = as_destination(o.output_device, "output_device") or devices[0]
    check_usable(out, "output_device")
    check_on_device(o.module, devices[0], "device_ids[0]")
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


def _check_overrides(cls: type, base: type, o: SimpleNamespace) -> None:
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
