"""The shims that make dpcore's wrapper stand where torch.nn.DataParallel stood: the signed ``forward``, the bare-key
state dict, DDP-only attribute errors, nominal ``isinstance``, and DCP's key hook."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.distributed.algorithms.join import Joinable


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
