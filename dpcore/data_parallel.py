"""dpcore.DataParallel: torch.nn.DataParallel's signature and semantics, with
cached replicas, a persistent C++ worker pool, balanced splits, per-replica
loss and CPU device lists."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.utils.rnn import PackedSequence

from dpcore._compiled import has_compiled
from dpcore._devices import DeviceLike, as_destination, as_devices
from dpcore._pytree import map_tensors, without_markers
from dpcore._split import _as_weight, as_int, check_first_device, check_split
from dpcore.distributed import DataParallelJoinHook, GradientSync
from dpcore.parallel_apply import _module_device, start_parallel_apply
from dpcore.replicate import DEFAULT_BUCKET_BYTES, ReplicaCache, check_on_device
from dpcore.replicate import replicate as replicate_module
from dpcore.scatter_gather import (
    NO_HINTS,
    GatherHints,
    Scattered,
    check_image_lists,
    gather_with_hints,
    image_list_model,
    scatter_with_hints,
)
from dpcore.sync_batchnorm import AcrossProcesses, needs_sync, synchronized_apply

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


#: What ``criterion_reduction=`` takes: how the criterion reduces its chunk.
CRITERION_REDUCTIONS = ("mean", "sum")
#: A loss module's own ``.reduction`` -> the reduction over the batch it means
#: ("batchmean", KLDivLoss's, is a mean over rows; "none" is refused per call).
_OWN_REDUCTIONS = {"mean": "mean", "batchmean": "mean", "sum": "sum", "none": "none"}
#: What ``model_loss=`` takes (see DataParallel's docstring).
MODEL_LOSSES = ("rows", "items", "sum", "num_items_in_batch")


def _describe(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_describe(fn.func)}, ...)"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{name!r}"


def _criterion_reduction(criterion: Callable[..., Any] | None, declared: Any) -> str | None:
    """How `criterion` reduces its chunk: "mean", "sum" or "none" (the last
    refused per call by _check_losses, as before); None without a criterion.

    Never guessed: `declared` (``criterion_reduction=``, "mean" or "sum") or
    the criterion's own string ``.reduction`` (torch's loss modules); both
    given must agree. Raises TypeError naming ``criterion_reduction`` for a
    criterion that has neither (a function, functools.partial, lambda, a
    module without ``.reduction``), and TypeError/ValueError for a bad value."""
    if declared is not None:
        if not isinstance(declared, str):
            raise TypeError(
                f"criterion_reduction: expected 'mean' or 'sum', but got {type(declared).__name__} {declared!r}"
            )
        if declared not in CRITERION_REDUCTIONS:
            raise ValueError(f"criterion_reduction: expected 'mean' or 'sum', but got {declared!r}")
        if criterion is None:
            raise ValueError("criterion_reduction: given without a criterion; it says how criterion= reduces its chunk")
    if criterion is None:
        return None
    if not callable(criterion):
        raise TypeError(f"criterion: expected a callable loss_fn(output, target), but got {type(criterion).__name__}")
    own = getattr(criterion, "reduction", None)
    if own is not None and not isinstance(own, str):
        own = None  # not torch's convention: the user declares it
    if declared is not None:
        if own is not None and own in _OWN_REDUCTIONS and _OWN_REDUCTIONS[own] != declared:
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


def _summed(reduction: str | None) -> bool:
    """Whether the loss that `reduction` (a DataParallel's resolved loss
    reduction: its criterion's, or "sum" for ``model_loss="sum"``) describes
    is summed over the batch rather than averaged; the hybrid mode weighs
    its processes by it."""
    return reduction == "sum"


def _loss_weight(reduction: str | None, chunk: int, total: int) -> float:
    """Weight of one replica's loss so that the weighted sum is the loss of the whole batch."""
    return 1.0 if _summed(reduction) else chunk / total


def _check_model_loss(model_loss: Any, loss_items: Any, criterion: Any, gather: Any, process_group: Any) -> str | None:
    """The checked ``model_loss`` (None, or one of MODEL_LOSSES), with its
    ``loss_items``; TypeError/ValueError naming the option otherwise."""
    if model_loss is None:
        if loss_items is not None and criterion is None:
            raise ValueError(
                "loss_items: given without criterion= or model_loss='items' / 'num_items_in_batch', which use it"
            )
        if loss_items is not None and not callable(loss_items):
            raise TypeError(
                f"loss_items: expected a callable count(*args, **kwargs), but got {type(loss_items).__name__}"
            )
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
    if loss_items is not None and not callable(loss_items):
        raise TypeError(f"loss_items: expected a callable count(*args, **kwargs), but got {type(loss_items).__name__}")
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


def _is_loss_dict(output: Any) -> bool:
    """Whether `output` is a loss dict as model_loss takes one: a non-empty
    Mapping without a "loss" key whose every value is a one-element tensor
    (torchvision's detection models return one in training)."""
    return (
        isinstance(output, Mapping)
        and bool(output)
        and "loss" not in output
        and all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in output.values())
    )


def _loss_of(output: Any, replica: int, device: torch.device, samples: bool = False) -> Any:
    """The loss in one replica's output, as model_loss finds it: the output
    itself if it is a tensor, a Mapping's "loss" (ModelOutput included), a
    dataclass's or namedtuple's ``loss`` field, else a tuple's or list's entry
    0 (transformers' ``return_dict=False`` order). None where a Mapping,
    dataclass or namedtuple has no loss (or it is None), and for a list in
    a call with a dpcore.Samples input (`samples`: one entry per sample,
    no loss). TypeError for an output of another kind."""
    where = f"replica {replica} (on {device})"
    if isinstance(output, torch.Tensor):
        return output
    if samples and isinstance(output, list):
        return None
    if isinstance(output, Mapping):
        return output.get("loss")
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        if "loss" not in {f.name for f in dataclasses.fields(output)}:
            raise TypeError(f"model_loss: the output of {where} is a {type(output).__name__} with no 'loss' field")
        return output.loss
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        if "loss" in output._fields:
            return output.loss
        raise TypeError(f"model_loss: the output of {where} is a {type(output).__name__} with no 'loss' field")
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(
        f"model_loss: expected a model output that holds its loss (a 0-dim tensor, a ModelOutput or dict with "
        f"'loss', a tuple whose entry 0 is the loss), but {where} returned {type(output).__name__}"
    )


def _with_loss_replaced(gathered: Any, loss: torch.Tensor) -> Any:
    """`gathered` (the gathered output, of the kind _loss_of read) with its loss replaced by `loss`."""
    if isinstance(gathered, torch.Tensor):
        return loss
    if isinstance(gathered, Mapping):
        gathered["loss"] = loss  # a fresh container from gather (ModelOutput sets the attribute too)
        return gathered
    if dataclasses.is_dataclass(gathered):
        return dataclasses.replace(gathered, loss=loss)
    if isinstance(gathered, tuple) and hasattr(gathered, "_fields"):
        return gathered._replace(loss=loss)
    return type(gathered)([loss, *gathered[1:]])


def _weighted_mean(parts: Sequence[torch.Tensor], counts: Sequence[Any]) -> torch.Tensor:
    """The mean over all items of per-replica means `parts` (one-element
    tensors on one device) over `counts` items each: sum of part * count /
    total. A replica with no item adds nothing (its own mean is 0/0); no
    item at all gives NaN, as a mean over nothing does on one device. One
    replica returns its own loss."""
    parts = [p.reshape(()) for p in parts]
    if len(parts) == 1:
        return parts[0]
    if any(isinstance(c, torch.Tensor) for c in counts):  # counted on the devices: masked, not filtered
        stacked = torch.stack(parts)
        c = torch.stack([torch.as_tensor(n, dtype=torch.float64, device=stacked.device) for n in counts])
        total = c.sum()
        terms = torch.where(c > 0, stacked * (c / total).to(stacked.dtype), torch.zeros_like(stacked))
        return torch.where(total > 0, terms.sum(), torch.full_like(terms[0], float("nan")))
    total = float(sum(counts))
    if total == 0:
        return torch.stack(parts).sum() * float("nan")
    return torch.stack([p * (c / total) for p, c in zip(parts, counts) if c > 0]).sum()


def _check_count(value: Any, replica: int) -> float:
    """`value` (what loss_items returned for one replica) as a float count."""
    return _as_weight(value, f"loss_items: the count of replica {replica}")


#: Attributes of torch's DistributedDataParallel that dpcore's wrapper does
#: not have: where the wrapped module lacks them too, looking them up is an
#: AttributeError naming dpcore's wrapper, not one from the wrapped module.
_DDP_ONLY = frozenset(
    {
        "_register_builtin_comm_hook",
        "_register_fused_optim",
        "reducer",
        "logger",
        "static_graph",
        "_set_static_graph",
        "find_unused_parameters",
        "gradient_as_bucket_view",
        "bucket_bytes_cap",
        "broadcast_bucket_size",
        "require_backward_grad_sync",
        "require_forward_param_sync",
        "will_sync_module_buffers",
        "_get_ddp_logging_data",
        "_register_buffer_comm_hook",
        "mixed_precision",
        "forward_sync_buffers",
        "parameters_to_ignore",
    }
)


_EXTENSION_POINTS = ("scatter", "replicate", "parallel_apply", "gather")


def _check_overrides(cls: type, *, cuda_graphs: bool, sync_batchnorm: bool, bypasses_gather: str | None) -> None:
    """Raises ValueError where an option would silently skip a method that
    `cls` (a subclass of DataParallel) overrides; `bypasses_gather` names the
    option (``criterion=``, ``gather=False``, ``model_loss=``) that returns
    without calling gather, if one was given."""
    if cls is DataParallel:
        return
    overridden = [name for name in _EXTENSION_POINTS if getattr(cls, name) is not getattr(DataParallel, name)]
    if bypasses_gather is not None and "gather" in overridden:
        raise ValueError(
            f"{cls.__name__} overrides gather, but {bypasses_gather} returns a loss or the per-replica "
            f"outputs without calling gather, so the override would never run: drop {bypasses_gather} or the override"
        )
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
    replica), ``device_indices`` (each replica's index into the device
    list) and ``hints`` (what the gather of the call's outputs needs to know
    of its inputs: GatherHints) as attributes."""

    sizes: list[int]
    device_indices: list[int]
    hints: GatherHints

    def __new__(cls, scattered: Scattered, hints: GatherHints = NO_HINTS) -> _ScatteredPair:
        pair = super().__new__(cls, (scattered.args, scattered.kwargs))
        pair.sizes = scattered.sizes
        pair.device_indices = scattered.device_indices
        pair.hints = hints
        return pair


def _split_of(
    result: Any, devices: Sequence[torch.device], dim: int
) -> tuple[list[Any], list[Any], list[int], list[int], GatherHints]:
    """(args, kwargs, sizes, device indices) per replica, and the gather
    hints, from what a ``scatter`` returned: dpcore's own pair carries them; for torch's plain
    ``(inputs, kwargs)`` (an overriding subclass) the replicas sit on the
    first devices, in order, and each one's rows are the size along `dim` of
    the first tensor in its arguments. Raises naming ``scatter`` for anything
    else."""
    if isinstance(result, _ScatteredPair):
        return result[0], result[1], result.sizes, result.device_indices, result.hints
    if isinstance(result, Scattered):
        return result.args, result.kwargs, result.sizes, result.device_indices, NO_HINTS
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
    return args, kws, sizes, list(range(len(args))), NO_HINTS


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


class _WrapperMeta(type(Joinable)):  # type: ignore[misc]
    """The wrapper's metaclass: ABCMeta (it is a Joinable), with plain
    nominal isinstance/issubclass. ABCMeta would answer them by asking the
    subclasses too, so a subclass with a wider check (dpcore.patch_torch's
    stand-in, which accepts torch's own wrappers) would make torch's
    wrappers instances of this class."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        return type.__subclasscheck__(cls, sub)


class DataParallel(TorchDataParallel, Joinable, metaclass=_WrapperMeta):
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
            the replica and the shape). How it reduces its chunk is never
            guessed: a loss module's ``.reduction`` ("mean", "sum",
            "batchmean"; "none" is the error above) is read, any other
            callable (a function, functools.partial, lambda, a module
            without ``.reduction``) needs ``criterion_reduction`` (else
            TypeError at construction).
        criterion_reduction: "mean" (the criterion returns the mean over its
            chunk's rows, or over its elements with a fixed number per row:
            the losses are weighted by chunk size) or "sum" (summed); must
            agree with a ``.reduction`` the criterion has. A mean
            ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` with class-index
            targets is a mean over its targets other than ``ignore_index``
            (each counted by its class weight): the replicas are weighted by
            those counts (computed on the devices). Any other mean criterion
            over items that are not rows takes ``loss_items`` (called with
            the replica's arguments, the target last).
        model_loss: for a model that computes its own loss in forward (a
            ``ModelOutput``'s or dict's "loss", a dataclass's or namedtuple's
            ``loss`` field, a tuple's entry 0, or the output itself when it is
            a tensor): the gathered output, with that loss replaced by one
            scalar on ``output_device`` equal to the loss of the whole batch
            on one device. The per-replica losses (tensors of one element,
            else ValueError) are combined as declared, never guessed:
            "rows": each is a mean over its rows, weighted by its share of
            rows; "items": each is a mean over the items that ``loss_items``
            counts, weighted by its share of them (a replica with no item
            adds nothing; no item at all gives NaN, as on one device);
            "sum": summed (a loss that sums over the batch);
            "num_items_in_batch": summed, where the call passes the keyword
            ``num_items_in_batch`` (transformers' contract: each replica
            divides by the count of the whole batch), else weighted as
            "items" by ``loss_items`` (ValueError without it). Outputs in
            which no replica has a loss (None) are gathered as they are.
            Needs ``gather=True``; not with ``criterion``; with
            ``process_group`` only "rows" and "sum".
        loss_items: ``count(*args, **kwargs)``, called with each replica's
            arguments (with ``criterion``, a mean one, the target last),
            returns how many items its loss averages over (an
            int, a real number or a one-element tensor, >= 0), e.g.
            ``lambda *a, labels, **k: (labels[:, 1:] != -100).sum()``.
        gather: False returns the per-replica outputs where they were computed.
        bucket_bytes: size of the parameter buckets broadcast to replicas
            (a positive int; with a process group, also the size of the
            gradient all-reduce buckets; the default's rationale:
            dpcore.replicate.DEFAULT_BUCKET_BYTES).
        sync_batchnorm: BatchNorm layers that use batch statistics normalize
            with those of the whole batch across the replicas of the call
            (with a ``process_group``, of every process, in forwards that can
            synchronize gradients), exactly as on one device (the rules:
            README, "Synchronized BatchNorm"; the mechanism:
            dpcore/sync_batchnorm.py).
        process_group: a torch.distributed process group: every process of
            it runs this in-process data parallelism over its own
            ``device_ids`` and together they train one model (hybrid data
            parallelism; the rules: README, "Several processes (hybrid)"; the
            mechanism: dpcore/distributed.py). ``device_ids`` defaults to the
            module's device here.
        broadcast_buffers: with a process group, whether buffers are sent
            from rank 0 (README, "Several processes (hybrid)").
        cuda_graphs: capture each replica's forward and backward into CUDA
            graphs per input signature and replay them (the rules and
            fallbacks: README, "CUDA graphs"; the mechanism:
            dpcore/_graphs.py). CUDA device lists only (else ValueError);
            not with ``sync_batchnorm``, nor with a torch.compile'd module
            or submodule (ValueError).

    Guarantees: outputs and parameter gradients equal the single-device ones
    (up to floating-point summation order); a parameter that no replica used
    keeps ``.grad`` None (or as accumulated), one used by some replicas gets
    the sum of their gradients; a balanced split uses every
    device while the batch is at least the device count; tensors whose batch
    sizes disagree raise ValueError naming both; replicas are cached across
    steps and refreshed only where the master changed; ``state_dict()`` has
    the bare module's keys. Unlike torch, the first replica is ``module``
    itself: ``zero_grad()`` called on it inside forward clears the master's
    gradients (torch's replicas are copies, where it only warns; dpcore's
    other replicas warn as torch's do). A torch.compile'd ``module`` (or
    submodule, or ``module.compile()``) gives every replica code compiled
    from the replica itself with the same options (dpcore/_compiled.py);
    ``module`` is not modified.

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

    Signals: Ctrl-C (or any signal handler's exception) during a call
    interrupts the running replicas at their next Python bytecode and skips
    those not yet started; once the exception reaches the caller, nothing
    this wrapper started still reads or writes the module (safe to save,
    load or evaluate it at once, as in a notebook). A second Ctrl-C during
    that short wait ends it; the replicas still running then finish in the
    background, and the next call of this wrapper waits for them before it
    touches the replicas.
    """

    # The wrapper's private per-instance state, the one list of it: its
    # replica cache, its call serialization and its CUDA-graph runner. A
    # replica of this wrapper (DataParallel nested in a model that is itself
    # replicated) keeps its own (ReplicaSet reads this name); a pickle holds
    # none of it; each is made by _fresh_private_state.
    _replica_private_attrs = ("_cache", "_calls", "_graphs")

    # The devices of the replicas of the call in progress, for the default
    # parallel_apply when a subclass overrides replicate (None otherwise).
    _call_devices: list[torch.device] | None = None
    # What the scatter of the call in progress told its gather (None outside a call).
    _gather_hints: GatherHints | None = None
    # The class name of a torchvision detection model (see scatter_gather.image_list_model), else None.
    _image_lists: str | None = None

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
        criterion_reduction: str | None = None,
        model_loss: str | None = None,
        loss_items: Callable[..., Any] | None = None,
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
        Joinable.__init__(self)  # the join context's per-instance state (disabled outside Join)
        self.__dict__.update(_fresh_private_state(cuda_graphs=False))
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
        if cuda_graphs:
            _check_not_compiled(module)
        given = {"criterion=": criterion is not None, "gather=False": not gather, "model_loss=": model_loss is not None}
        _check_overrides(
            type(self),
            cuda_graphs=cuda_graphs,
            sync_batchnorm=sync_batchnorm,
            bypasses_gather=next((name for name, on in given.items() if on), None),
        )
        self.cuda_graphs = cuda_graphs
        self.sync_batchnorm = sync_batchnorm
        self.module = module
        self.dim = dim
        self.chunk_sizes, self.weights = check_split(chunk_sizes, weights)
        self.criterion = criterion
        self.criterion_reduction = criterion_reduction
        self.model_loss = _check_model_loss(model_loss, loss_items, criterion, gather, process_group)
        self.loss_items = loss_items
        # How the loss returned is reduced over the batch (the hybrid mode weighs processes by it).
        self._reduction = _criterion_reduction(criterion, criterion_reduction) or (
            "sum" if self.model_loss == "sum" else None
        )
        if criterion is not None and loss_items is not None:
            if self._reduction != "mean":
                raise ValueError(
                    f"loss_items: with criterion=, only for a mean criterion (its reduction is {self._reduction!r}): "
                    f"it counts the items each replica's loss averages over"
                )
            if process_group is not None:
                raise ValueError("loss_items: not supported with process_group= (processes are weighted by rows)")
        # ``gather`` is torch's method name; the option is stored as ``gather_output``.
        self.gather_output = gather
        self._image_lists = image_list_model(module)
        self.bucket_bytes = _check_bucket_bytes(bucket_bytes)
        self._sync: GradientSync | None = None
        if device_ids is None and process_group is not None:
            device_ids = [_module_device(module)]  # one device per process, as DDP
        defaulted = device_ids is None
        if defaulted:
            device_ids = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
            if not device_ids and cuda_graphs:
                raise ValueError(
                    "cuda_graphs=True needs CUDA devices, but no device_ids were given and no GPU is visible"
                )
        if defaulted and not device_ids:  # no accelerator and no list: the module runs as is
            self.device_ids: list[torch.device] = []
            self.output_device = None
        else:
            self._set_up_devices(module, device_ids, output_device, cuda_graphs, process_group, broadcast_buffers)

    def _set_up_devices(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike],
        output_device: DeviceLike | None,
        cuda_graphs: bool,
        process_group: Any,
        broadcast_buffers: bool,
    ) -> None:
        """The device list and what hangs on it (checked; see __init__)."""
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
        self.__dict__.update(_fresh_private_state(cuda_graphs))
        if process_group is not None:
            self._sync = GradientSync(
                module,
                self.device_ids[0],
                process_group,
                broadcast_buffers=broadcast_buffers,
                bucket_bytes=self.bucket_bytes,
                sync_batchnorm=self.sync_batchnorm,
            )

    # -- attribute fall-through, state dicts, pickling -----------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "_join_config", *self._replica_private_attrs):
                raise
            try:
                return getattr(self.module, name)
            except AttributeError:
                if name not in _DDP_ONLY:
                    raise
            raise AttributeError(
                f"dpcore.DataParallel has no attribute {name!r} (nor has its module, a "
                f"{type(self.module).__name__}): it is an attribute of torch.nn.parallel.DistributedDataParallel "
                f"that dpcore's hybrid mode (process_group=) does not provide"
            ) from None

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
        for name in self._replica_private_attrs:  # a lock, CUDA graphs, streams: each copy gets its own
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.update(_fresh_private_state(bool(state.get("cuda_graphs"))))

    def _replicate_for_data_parallel(self) -> DataParallel:
        # A replica of this wrapper (nested in a replicated model) runs its
        # own replicas, concurrently with the master's: never share them.
        replica = super()._replicate_for_data_parallel()
        replica.__dict__.update(_fresh_private_state(self.cuda_graphs))
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
        ``.sizes`` (rows, or samples, per replica), ``.device_indices`` (the
        indices into ``device_ids`` of the replicas' devices) and
        ``.hints`` (for the gather of the call: whether an input was a
        ``dpcore.Samples`` list, the order of PackedSequence inputs)."""
        return _ScatteredPair(*scatter_with_hints(inputs, kwargs, device_ids, self.dim, self.chunk_sizes, self.weights))

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
            return [
                replicas[0](*(first if isinstance(first, (list, tuple)) else (first,)), **((kwargs or [{}])[0] or {}))
            ]
        devices = self._call_devices
        if devices is None or len(devices) != len(replicas):
            devices = self.device_ids[: len(replicas)]
        return self._parallel_apply(replicas, inputs, kwargs, devices)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike | None) -> Any:
        """torch's ``gather``: the per-replica outputs joined along ``dim`` on
        ``output_device`` (see :func:`dpcore.gather`); during a call with a
        ``dpcore.Samples`` input its lists are joined by concatenation, and a
        PackedSequence output of the sequences of a PackedSequence input is
        joined in that input's order."""
        return gather_with_hints(outputs, output_device, self.dim, self._gather_hints or NO_HINTS)

    def _overrides(self, name: str) -> bool:
        """Whether this wrapper's class (or the instance) replaces the
        extension point `name` of dpcore's class."""
        return getattr(type(self), name) is not getattr(DataParallel, name) or name in self.__dict__

    # -- forward --------------------------------------------------------------

    def _replica_cache(self) -> ReplicaCache:
        """The replica cache, rebuilt first where the master's structure changed."""
        if self._cache is None or not self._cache.valid():
            check_on_device(self.module, self.device_ids[0], "device_ids[0]")
            if self.cuda_graphs:
                _check_not_compiled(self.module)  # compiled after wrapping
            self._cache = ReplicaCache(self.module, self.device_ids, self.bucket_bytes)
            if self._sync is not None:  # the gradient buckets follow a structural change (collective)
                self._sync.check_structure()
        return self._cache

    def _replicas(self, n: int) -> list[nn.Module]:
        return self._replica_cache().replicas(n)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with self._calls:
            if self._sync is None:
                return self._forward(*inputs, **kwargs)[0]
            self._sync.before_forward(self)
            output, local_batch = self._forward(*inputs, **kwargs)
            return self._sync.after_forward(output, local_batch, _summed(self._reduction))

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

    # -- DDP's process-group API: Join for uneven inputs ---------------------

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` process group of the hybrid mode (None without one)."""
        return None if self._sync is None else self._sync.group

    def _require_group(self, what: str, why: str = "there are no ranks to join") -> GradientSync:
        if self._sync is None:
            raise ValueError(
                f"{what}: needs a dpcore.DataParallel with a process_group= (hybrid mode); this one runs in one "
                f"process only, so {why}"
            )
        return self._sync

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook`` for the hybrid mode: each gradient
        bucket is sent by ``hook(state, bucket)``, which returns a
        ``torch.futures.Future`` holding the bucket's reduced gradient; the
        hook divides by the world size itself (as torch's do), and torch's
        own hooks (``allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook``, their wrappers, PowerSGD) work unchanged.
        ``bucket`` is a :class:`dpcore.distributed.GradBucket`. Only one
        hook, registered on every rank before the first synchronizing
        backward. What it composes with (uneven batches, Join, no_sync) is
        in README.md, "Several processes (hybrid)"."""
        sync = self._require_group("register_comm_hook", "there is no gradient communication to hook")
        sync.register_comm_hook(state, hook)

    def join_hook(self, **kwargs: Any) -> DataParallelJoinHook:
        """The hook with which ``torch.distributed.algorithms.join.Join``
        lets ranks that ran out of inputs shadow the others' collectives:
        zero gradients, the same buffer broadcasts (from the highest rank
        still training, as DDP), and at the end parameters and buffers from
        the last rank to join. ``divide_by_initial_world_size`` (default
        True, as DDP): a joined rank still counts the samples of its last
        synchronization in the weights, which with equal local batches is
        DDP's division by the initial world size; False: it counts none,
        the gradient is the mean over the samples of the ranks still
        training (DDP: division by the number of those ranks)."""
        sync = self._require_group("Join")
        if sync.batchnorm_group is not None:
            raise ValueError(
                "Join: a rank that ran out of inputs cannot shadow the BatchNorm collectives of sync_batchnorm=True "
                "across processes (it does not run the model); give every rank the same number of batches "
                "(e.g. a DistributedSampler with drop_last=True), or drop sync_batchnorm"
            )
        # Other keyword arguments are for the context's other joinables (as DDP, ignored here).
        return DataParallelJoinHook(sync, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's collectives: the module's."""
        return self._require_group("Join").device

    @property
    def join_process_group(self) -> Any:
        """The process group of the join context's collectives: the hybrid mode's."""
        return self._require_group("Join").group

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """DDP's ``join()``: ``Join([self], ...)``, training with uneven
        numbers of inputs across ranks (see :meth:`join_hook`)."""
        self._require_group("join()")
        return Join(
            [self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

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

    def mark_parameters_changed(self) -> None:
        """Makes the next forward copy every parameter and buffer of the
        module to every replica. Needed only after writes that bypass version
        counters outside any optimizer step: an EMA, clipping or weight
        surgery written through ``.data`` (or by a custom kernel). In-place
        updates under ``torch.no_grad()`` and ``step()`` of any
        ``torch.optim.Optimizer`` (fused ones and those writing ``p.data``
        included) are seen without it. For a few known tensors,
        ``torch.autograd.graph.increment_version(tensors)`` does the same at
        a smaller cost."""
        with self._calls:
            if self._cache is not None:
                self._cache.invalidate()

    def _forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, int]:
        """The call's output and this process's rows (the sum of the
        replicas', for the process group's weights): the inputs scattered,
        the replicas run (replayed graphs, or eagerly), their outputs
        combined (:meth:`_run_and_combine`)."""
        criterion = self.criterion
        if criterion is not None:
            if not inputs:
                raise TypeError("DataParallel with a criterion expects the target as the last positional argument")
        if not self.device_ids:  # the module as is, given the values inside Broadcast and Samples markers
            inputs, kwargs = without_markers((inputs, kwargs))
            if criterion is None:
                return self.module(*inputs, **kwargs), 0
            return criterion(self.module(*inputs[:-1], **kwargs), inputs[-1]), 0
        if self._image_lists is not None:
            check_image_lists(self._image_lists, inputs, kwargs)
        args, kws, sizes, used, hints = _split_of(
            self.scatter(inputs, kwargs, self.device_ids), self.device_ids, self.dim
        )
        self._gather_hints = hints  # for gather, whose signature is torch's (the call holds self._calls)
        try:
            return self._run_and_combine(args, kws, sizes, used), sum(sizes)
        finally:
            self._gather_hints = None

    def _run_and_combine(self, args: list[Any], kws: list[Any], sizes: list[int], used: list[int]) -> Any:
        """The rest of _forward, after the scatter: run the replicas, then
        combine their outputs (:meth:`_combine`)."""
        criterion = self.criterion
        if criterion is not None and len(sizes) > 1 and 0 in sizes:  # only from an overridden scatter
            raise ValueError(
                f"criterion: each replica's loss is weighted by its rows, but {type(self).__name__}.scatter gave "
                f"replica {sizes.index(0)} no tensor with a dimension {self.dim} to count them by"
            )
        check_first_device(sizes, used, len(self.device_ids), self.chunk_sizes, self.weights)
        devices = [self.device_ids[i] for i in used]
        make_call: Callable[[nn.Module], Callable[..., Any]] = (
            (lambda m: m) if criterion is None else functools.partial(_with_loss, criterion=criterion)
        )
        outputs = None
        if self._graphs is not None:
            # Outputs that become new tensors before they reach the user: any
            # through dpcore's own gather of tensors (it copies, one replica's
            # too; a Samples call's lists are joined, not copied), and several
            # replicas' losses (summed); the graphs clone the rest.
            samples = self._gather_hints is not None and self._gather_hints.samples
            plain_gather = criterion is None and self.model_loss is None and self.gather_output and not samples
            combined = (plain_gather and not self._overrides("gather")) or (
                len(used) > 1 and (criterion is not None or self.model_loss is not None)
            )
            outputs = self._graphs.step(self._replica_cache(), args, kws, used, make_call, combined=combined)
        if outputs is None:  # not by the graphs: eagerly
            if len(self.device_ids) > 1 and (self._overrides("replicate") or self._overrides("parallel_apply")):
                outputs = self._run_overridden(args, kws, used, make_call, sum(sizes))
            else:
                outputs = self._run_eagerly(args, kws, used, make_call, sum(sizes))
        return self._combine(outputs, args, kws, sizes, devices)

    def _combine(
        self, outputs: list[Any], args: list[Any], kws: list[Any], sizes: list[int], devices: list[torch.device]
    ) -> Any:
        """What the call returns, from the replicas' `outputs` (on `devices`,
        of `sizes` rows, called with `args`/`kws`): with a criterion, the
        weighted loss; with gather=False, the outputs as they are; with
        model_loss=, the gathered outputs with one loss; else ``gather``."""
        criterion = self.criterion
        if criterion is not None:
            _check_losses(outputs, devices)
            total = sum(sizes)
            if total == 0:
                return outputs[0]
            out = self.output_device
            counts = self._criterion_counts(args, kws)
            if counts is not None:  # a mean over counted items (loss_items, or CrossEntropyLoss's own targets)
                return _weighted_mean([loss.to(out) for loss in outputs], counts)
            parts = [loss.to(out) * _loss_weight(self._reduction, size, total) for loss, size in zip(outputs, sizes)]
            return torch.stack(parts).sum() if len(parts) > 1 else parts[0]
        if not self.gather_output:
            return outputs
        if self.model_loss is not None:
            return self._gather_with_model_loss(outputs, args, kws, sizes, devices)
        if len(self.device_ids) == 1 and self._overrides("gather"):
            return outputs[0]  # torch: with one device, the module's output as is
        return self.gather(outputs, self.output_device)

    def _run_overridden(
        self,
        args: list[Any],
        kws: list[Any],
        used: list[int],
        make_call: Callable[[nn.Module], Callable[..., Any]],
        local_batch: int,
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
            across = self._batchnorm_across(local_batch)
            if self.sync_batchnorm and (len(calls) > 1 or across is not None) and needs_sync(self.module):
                # parallel_apply is dpcore's here (checked at construction)
                return synchronized_apply(modules, calls, args, kws, devices, run=self._parallel_apply, across=across)
            outputs = self.parallel_apply(calls, args, kws)
        finally:
            self._call_devices = None
        if not isinstance(outputs, Sequence) or len(outputs) != len(calls):
            got = len(outputs) if isinstance(outputs, Sequence) else type(outputs).__name__
            raise ValueError(
                f"{type(self).__name__}.parallel_apply: expected one output per replica ({len(calls)}), but got {got}"
            )
        return list(outputs)

    def _criterion_counts(self, args: list[Any], kws: list[Any]) -> list[Any] | None:
        """How many items each replica's mean criterion averages over, where
        that is not its rows: ``loss_items`` where given; for torch's
        CrossEntropyLoss and NLLLoss (reduction "mean", class-index targets)
        the targets other than ``ignore_index``, each counted by its class
        weight, as those losses divide; else None (weighted by rows). A
        PackedSequence target of a criterion that is not summed is a
        ValueError without ``loss_items``: a mean over its sequences (the
        rows) and one over its packed rows weigh the replicas differently."""
        if self.loss_items is not None:
            return [_check_count(self.loss_items(*a, **k), j) for j, (a, k) in enumerate(zip(args, kws))]
        if not _summed(self._reduction) and isinstance(args[0][-1], PackedSequence):
            raise ValueError(
                f"criterion: the target is a PackedSequence and the criterion's reduction is {self._reduction!r}: "
                f"each replica's loss is weighted by the items it averages over, which for a packed target may be "
                f"its sequences or its packed rows; declare them with loss_items= (e.g. lambda *args: "
                f"args[-1].data.size(0) for a mean over packed rows, lambda *args: args[-1].batch_sizes[0] for "
                f"one over sequences), or use a summed criterion (criterion_reduction='sum')"
            )
        if self._reduction != "mean":
            return None
        criterion = self.criterion
        if not isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)):
            return None
        targets = [a[-1] for a in args]
        if not all(isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() for t in targets):
            return None  # class probabilities: a mean over rows
        out = self.output_device
        counts = []
        for t in targets:  # tensors, never read on the host: no synchronization
            valid = t != criterion.ignore_index
            if criterion.weight is None:
                count = valid.sum()
            else:
                weight = criterion.weight.detach().to(t.device)
                count = torch.where(valid, weight[t.clamp(0, weight.numel() - 1)], 0).sum()
            counts.append(count.to(out, torch.float64))
        return counts

    def _gather_with_model_loss(
        self,
        outputs: list[Any],
        args: list[Any],
        kws: list[Any],
        sizes: list[int],
        devices: list[torch.device],
    ) -> Any:
        """The gathered `outputs` with the model's per-replica losses replaced
        by one scalar on output_device: the weighted sum that model_loss
        declares (see the class docstring); for a loss dict, each entry so.
        Outputs without a loss on every replica are gathered as they are."""
        hints = self._gather_hints or NO_HINTS
        if all(_is_loss_dict(o) for o in outputs):  # e.g. torchvision's detection models in training
            gathered = gather_with_hints(outputs, self.output_device, self.dim, hints)
            combine = self._loss_combiner(args, kws, sizes)
            for key in outputs[0]:
                gathered[key] = combine([o[key] for o in outputs])
            return gathered
        losses = [_loss_of(o, j, d, hints.samples) for j, (o, d) in enumerate(zip(outputs, devices))]
        if all(loss is None for loss in losses):
            return gather_with_hints(outputs, self.output_device, self.dim, hints)
        for j, (loss, device) in enumerate(zip(losses, devices)):
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(
                    f"model_loss={self.model_loss!r}: expected a scalar loss (a tensor of one element) in every "
                    f"replica's output, but replica {j} (on {device}) has {got} where the loss goes"
                )
        combined = self._loss_combiner(args, kws, sizes)(losses)
        if isinstance(outputs[0], torch.Tensor):
            return combined
        return _with_loss_replaced(gather_with_hints(outputs, self.output_device, self.dim, hints), combined)

    def _loss_combiner(
        self, args: list[Any], kws: list[Any], sizes: list[int]
    ) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        """A function of the per-replica losses (one-element tensors) that
        returns their combination as model_loss declares, on output_device
        (the counts of "items" taken once, for every loss it combines)."""
        mode = self.model_loss
        if mode == "num_items_in_batch":
            passed = kws[0].get("num_items_in_batch") is not None
            if not passed and self.loss_items is None:
                raise ValueError(
                    "model_loss='num_items_in_batch': this call passed no num_items_in_batch keyword, so each "
                    "replica's loss is its own mean and their sum is not the batch's loss; pass num_items_in_batch, "
                    "or declare loss_items= to weigh the calls without it (Trainer evaluates without it)"
                )
            mode = "sum" if passed else "items"
        out = self.output_device
        counts: Sequence[Any] = sizes
        if mode == "items" and len(sizes) > 1:
            counts = [_check_count(self.loss_items(*a, **k), j) for j, (a, k) in enumerate(zip(args, kws))]

        def combine(losses: list[torch.Tensor]) -> torch.Tensor:
            parts = [loss.to(out).reshape(()) for loss in losses]
            if len(parts) == 1:
                return parts[0]
            if mode == "sum":
                return torch.stack(parts).sum()
            return _weighted_mean(parts, counts)

        return combine

    def _run_eagerly(
        self,
        args: list[Any],
        kws: list[Any],
        used: list[int],
        make_call: Callable[[nn.Module], Callable[..., Any]],
        local_batch: int,
    ) -> list[Any]:
        """The outputs of the replicas `used` on their chunks, run eagerly:
        several on the worker pool (synchronized BatchNorm's replicas all at
        once), one in this thread."""
        replicas = self._replicas(used[-1] + 1)
        calls = [make_call(replicas[i]) for i in used]
        across = self._batchnorm_across(local_batch)
        if len(calls) == 1 and across is None:
            return [calls[0](*args[0], **kws[0])]
        devices = [self.device_ids[i] for i in used]
        if self.sync_batchnorm and needs_sync(self.module):
            modules = [replicas[i] for i in used]
            return synchronized_apply(modules, calls, args, kws, devices, run=self._parallel_apply, across=across)
        if len(calls) == 1:
            return [calls[0](*args[0], **kws[0])]
        return self._parallel_apply(calls, args, kws, devices)

    def _batchnorm_across(self, local_batch: int) -> AcrossProcesses | None:
        """Synchronized BatchNorm's link to the other processes for the
        forward being run on `local_batch` rows of this process (hybrid mode
        with ``sync_batchnorm``, in a forward that can synchronize
        gradients), else None: see GradientSync.batchnorm_across."""
        if self._sync is None or not self.sync_batchnorm:
            return None
        return self._sync.batchnorm_across(local_batch, _summed(self._reduction))


def _check_not_compiled(module: nn.Module) -> None:
    """Raises ValueError where `module` or a submodule is torch.compile'd:
    cuda_graphs=True captures eager replicas only."""
    if has_compiled(module):
        raise ValueError(
            "cuda_graphs=True does not capture torch.compile'd modules, and the module (or one of its submodules) "
            "is compiled: pass cuda_graphs=False, where each replica runs its own compiled code, or the "
            "uncompiled module with cuda_graphs=True"
        )


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


def _fresh_private_state(cuda_graphs: bool) -> dict[str, Any]:
    """A new value for each of DataParallel._replica_private_attrs: no
    replica cache yet, a call guard of its own, and a CUDA-graph runner
    where ``cuda_graphs``."""
    graphs: GraphRunner | None = _graph_runner() if cuda_graphs else None
    return {"_cache": None, "_calls": _CallGuard(), "_graphs": graphs}


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
        raise TypeError(
            f"module_kwargs: expected a mapping of keyword arguments, but got {type(module_kwargs).__name__}"
        )
    return DataParallel(module, device_ids, output_device, dim, **options)(*inputs, **(module_kwargs or {}))
