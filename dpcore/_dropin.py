"""The shims that make dpcore's wrapper stand where torch.nn.DataParallel stood: the signed ``forward``, the bare-key
state dict, DDP-only attribute errors, nominal ``isinstance``, an overridden ``scatter``'s pair read by torch's rules,
and :func:`functional_call`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable

from dpcore._pytree import flatten

if TYPE_CHECKING:
    from dpcore.data_parallel import DataParallel

#: DistributedDataParallel's attributes that dpcore's wrapper lacks (an AttributeError names the wrapper).
DDP_ONLY = frozenset(
    """_register_builtin_comm_hook _register_fused_optim reducer logger static_graph _set_static_graph
    find_unused_parameters gradient_as_bucket_view bucket_bytes_cap broadcast_bucket_size require_backward_grad_sync
    require_forward_param_sync will_sync_module_buffers _get_ddp_logging_data _register_buffer_comm_hook
    mixed_precision forward_sync_buffers parameters_to_ignore""".split()
)


class NominalMeta(type(Joinable)):  # type: ignore[misc]
    """ABCMeta (the wrapper is a Joinable) with nominal isinstance and issubclass: ABCMeta would ask the
    subclasses, among them patch_torch's stand-in, which accepts torch's own wrappers."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        return type.__subclasscheck__(cls, sub)


class SignedForward:
    """``DataParallel.forward`` as a descriptor: ``dp.forward``'s
    ``inspect.signature`` is the module's forward's (Trainer reads it)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self.fn if obj is None else _BoundForward(self.fn, obj)


class _BoundForward:
    """A DataParallel's bound ``forward`` (see SignedForward)."""

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
            with contextlib.suppress(TypeError, ValueError):
                return inspect.signature(dp.module.forward)
        return inspect.signature(functools.partial(self.__func__, dp))

    @property
    def __name__(self) -> str:
        return self.__func__.__name__

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.__func__.__doc__

    def __repr__(self) -> str:
        return f"<bound method DataParallel.forward of {type(self.__self__).__name__}>"


def has_module_prefix(keys: Sequence[Any], module: nn.Module) -> bool:
    """Whether state-dict `keys` carry torch's ``module.`` prefix, rather
    than being `module`'s own keys (it may have a child named ``module``)."""
    if not keys or not all(isinstance(k, str) and k.startswith("module.") for k in keys):
        return False
    own = module.state_dict(keep_vars=True).keys()
    return any(k not in own for k in keys)


def strip_module_prefix(state_dict: Any, module: nn.Module) -> Any:
    """`state_dict` without torch's ``module.`` prefix where its keys carry it."""
    if not has_module_prefix(list(state_dict), module):
        return state_dict
    return {k[len("module.") :]: v for k, v in state_dict.items()}


class BareStateDict(OrderedDict):  # type: ignore[type-arg]
    """A DataParallel's state dict: the bare module's keys (a read by torch's ``module.`` key is a KeyError
    naming the rule); pickles as a plain OrderedDict with its ``_metadata`` (a checkpoint never needs dpcore)."""

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, str) and key.startswith("module.") and dict.__contains__(self, key[len("module.") :]):
            raise KeyError(
                f"{key!r}: a dpcore.DataParallel's state_dict has the bare module's keys, without torch's "
                f"'module.' prefix; read {key[len('module.') :]!r}, or build the reader from the wrapper"
            )
        raise KeyError(key)

    def __reduce__(self) -> tuple[Any, ...]:
        metadata = self.__dict__.get("_metadata")
        state = None if metadata is None else {"_metadata": metadata}
        return (OrderedDict, (), state, None, iter(self.items()))


class DCPNames(dict):  # type: ignore[type-arg]
    """``DataParallel._fqn_modifiers()``, torch.distributed.checkpoint.state_dict's hook: each top-level name of the
    module maps to the wrapper's ``module``, so DCP's walk gives the module's tensors their bare keys, as the
    wrapper's state_dict(). DCP names optimizer state by ``model.named_parameters()``, whose names keep torch's
    ``module.`` (code such as Trainer's weight-decay groups pairs them with ``named_children()``): DCP's look-up
    of that prefix, which would give keys no bare module loads, is an error naming the fix."""

    def get(self, key: Any, default: Any = None) -> Any:
        if key == "module" and key not in self:
            raise ValueError(
                "model: torch.distributed.checkpoint names the optimizer's state by model.named_parameters(), and a "
                "dpcore.DataParallel's keep torch's 'module.' prefix; pass the wrapper's module (dp.module) as the "
                "model: the keys are then the bare module's, as dp.state_dict()'s, and load into the bare module, "
                "the wrapper (as dp or dp.module) and DDP alike"
            )
        return super().get(key, default)


def dcp_names(module: nn.Module) -> DCPNames:
    """The DCPNames of a wrapper of `module`."""
    return DCPNames(dict.fromkeys([*module._modules, *module._parameters, *module._buffers], "module"))


def split_of(result: Any, device_count: int, dim: int) -> tuple[list[Any], list[Any], list[int]]:
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


def functional_call(
    dp: DataParallel,
    parameter_and_buffer_dicts: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    args: Any = None,
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> Any:
    """``torch.func.functional_call`` over a dpcore wrapper, data parallel (torch refuses its DataParallel):
    ``dp(*args, **kwargs)`` with the module's parameters and buffers replaced by the given tensors (keyed by
    the module's names or torch's ``module.`` ones); their gradients are the whole batch's on one device."""
    from dpcore.data_parallel import DataParallel as Wrapper  # the wrapper's module imports this one

    if not isinstance(dp, Wrapper):
        raise TypeError(f"dp: expected a dpcore.DataParallel, but got {type(dp).__name__}")
    if dp.process_group is not None:
        raise ValueError("functional_call: not supported with process_group= (gradients are not synchronized)")
    given = parameter_and_buffer_dicts
    tensors: dict[str, torch.Tensor] = {}
    for d in [given] if isinstance(given, Mapping) else given:
        tensors.update(strip_module_prefix(dict(d), dp.module))
    args = () if args is None else args if isinstance(args, tuple) else (args,)

    def through(replica: nn.Module) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            first = next(itertools.chain(replica.parameters(), replica.buffers()), None)
            moved = tensors if first is None else {n: t.to(first.device) for n, t in tensors.items()}
            return torch.func.functional_call(replica, moved, a, k, tie_weights=tie_weights, strict=strict)

        return call

    with dp._calls:
        return dp._forward(args, dict(kwargs or {}), through)[0]
