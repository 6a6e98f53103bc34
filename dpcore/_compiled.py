"""Compiled modules (``torch.compile``) inside dpcore's replicas: a replica
factory that never writes through an ``OptimizedModule`` (:func:`replicate_module`)
and per-replica compiled calls (:class:`CompiledReplicas`). The rule:
docs/design.md, "Compiled modules".
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["CompiledReplicas", "has_compiled", "replicate_module"]

#: The entries of an OptimizedModule's ``__dict__`` that each replica gets its own of.
_OPTIMIZED_OWN = ("forward", "_forward", "_torchdynamo_orig_callable", "_torchdynamo_wrapper_id", "get_compiler_config")

#: What one replica's compiled entries were made from (compared by identity),
#: the entries to write into its __dict__, and an object to keep alive.
_Made = tuple[tuple[Any, ...], dict[str, Any], Any]


def _optimized_module_type() -> type | None:
    """torch's OptimizedModule class, or None while torch._dynamo was never
    imported (then nothing was compiled; importing it only to check is slow)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return None if eval_frame is None else getattr(eval_frame, "OptimizedModule", None)


def is_optimized(module: nn.Module) -> bool:
    """Whether `module` is a ``torch.compile(module)`` wrapper (OptimizedModule)."""
    optimized = _optimized_module_type()
    return optimized is not None and isinstance(module, optimized)


def _compiled_call(module: nn.Module) -> Any:
    """``module.compile()``'s compiled call in the module's own ``__dict__``, or None."""
    return module.__dict__.get("_compiled_call_impl")


def has_compiled(module: nn.Module) -> bool:
    """Whether `module` or a submodule is an OptimizedModule or was ``compile()``'d."""
    if _optimized_module_type() is None:
        return False
    return any(is_optimized(m) or _compiled_call(m) is not None for m in module.modules())


def replicate_module(master: nn.Module) -> nn.Module:
    """A replica of `master` as ``_replicate_for_data_parallel()`` makes it,
    but for an OptimizedModule without writing through its ``__setattr__``
    (which would reach, and empty, the master's inner module)."""
    if not is_optimized(master):
        return master._replicate_for_data_parallel()
    replica = type(master).__new__(type(master))
    state = master.__dict__.copy()
    state["_parameters"] = {}
    state["_buffers"] = state["_buffers"].copy()
    state["_modules"] = state["_modules"].copy()
    state["_is_replica"] = True
    object.__setattr__(replica, "__dict__", state)
    return replica


def _dynamo_context(compiled: Any) -> Any:
    """The Dynamo context that made `compiled` (a ``torch.compile(fn, ...)``
    result), from its ``get_compiler_config`` closure, or None."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    getter = getattr(compiled, "get_compiler_config", None)
    code = getattr(getter, "__code__", None)
    if code is None or not getter.__closure__:
        return None
    cells = dict(zip(code.co_freevars, getter.__closure__))
    ctx = cells["self"].cell_contents if "self" in cells else None
    return ctx if isinstance(ctx, _TorchDynamoContext) else None


def _compile_call_for(replica: nn.Module, master: nn.Module, compiled: Any, index: int) -> Callable[..., Any]:
    """The replica's counterpart of the master's ``_compiled_call_impl``
    (compiled with the same Dynamo context, or for ``compile(disable=True)``
    the replica's own ``_call_impl``); TypeError for anything else."""
    ctx = _dynamo_context(compiled)
    if ctx is not None:
        return ctx(replica._call_impl)
    if isinstance(compiled, types.MethodType) and compiled.__self__ is master:
        return types.MethodType(compiled.__func__, replica)
    raise TypeError(
        f"DataParallel: module {index} of the model ({type(master).__name__}) holds a _compiled_call_impl "
        f"({type(compiled).__name__}) that was not made by module.compile() or torch.compile, so it cannot be "
        f"compiled again for each replica (running the master's on a replica would compute with the master's "
        f"parameters); wrap the module as torch.compile(module) instead"
    )


class CompiledReplicas:
    """Per-replica compiled calls for the compiled modules among `masters`
    (``module.modules()``) and their replicas ``rows[j][i]``: after
    :meth:`apply`, each replica of a compiled module calls its own compiled
    call, made with the master's Dynamo context on first use and kept while
    the master's compiled callable is the same object.
    """

    def __init__(self, masters: Sequence[nn.Module], rows: Sequence[Sequence[nn.Module]]):
        self._masters = list(masters)
        self._rows = [list(row) for row in rows]
        self._optimized = [i for i, m in enumerate(self._masters) if is_optimized(m)]
        self._called = [i for i, m in enumerate(self._masters) if _compiled_call(m) is not None]
        # (row, module index, kind) -> (source objects, values to set, keep-alive)
        self._made: dict[tuple[int, int, str], _Made] = {}

    @staticmethod
    def of(module: nn.Module, rows: Sequence[Sequence[nn.Module]]) -> CompiledReplicas | None:
        """The per-replica compiled calls of `module`'s replicas, or None when nothing is compiled."""
        if not rows or not has_compiled(module):
            return None
        return CompiledReplicas(list(module.modules()), rows)

    def apply(self, n: int) -> None:
        """Gives the replicas of rows 0..n-1 their own compiled calls."""
        for j in range(n):
            for i in self._optimized:
                self._set(j, i, "optimized", self._optimized_values)
            for i in self._called:
                self._set(j, i, "call", self._call_values)

    def _set(self, j: int, i: int, kind: str, make: Callable[[int, int], _Made]) -> None:
        """Writes the (j, i) replica's compiled entries, remade by `make` when their sources changed."""
        state = self._rows[j][i].__dict__
        made = self._made.get((j, i, kind))
        sources = self._sources(self._masters[i], kind, j, i)
        if made is None or any(a is not b for a, b in zip(made[0], sources)):
            made = self._made[(j, i, kind)] = make(j, i)
        for name, value in made[1].items():
            if value is _ABSENT:
                state.pop(name, None)
            else:
                state[name] = value

    def _sources(self, master: nn.Module, kind: str, j: int, i: int) -> tuple[Any, ...]:
        """What the replica's compiled call is made from."""
        if kind == "call":
            return (_compiled_call(master),)
        inner = self._rows[j][i].__dict__["_modules"].get("_orig_mod")
        return (master.__dict__.get("forward"), master.__dict__.get("dynamo_ctx"), inner)

    def _optimized_values(self, j: int, i: int) -> _Made:
        """The OptimizedModule replica's own entries: the master's Dynamo context on its inner module."""
        master = self._masters[i]
        replica = self._rows[j][i]
        inner = replica.__dict__["_modules"].get("_orig_mod")
        ctx = master.__dict__.get("dynamo_ctx")
        if inner is None or ctx is None:
            raise TypeError(
                f"DataParallel: the compiled module {i} of the model ({type(master).__name__}) has no _orig_mod "
                f"or dynamo_ctx, so it cannot be compiled again for each replica"
            )
        fresh = ctx(inner)
        values = {name: fresh.__dict__.get(name, _ABSENT) for name in _OPTIMIZED_OWN}
        return self._sources(master, "optimized", j, i), values, fresh

    def _call_values(self, j: int, i: int) -> _Made:
        """The replica's own ``_compiled_call_impl`` (see _compile_call_for)."""
        master = self._masters[i]
        compiled = _compiled_call(master)
        call = _compile_call_for(self._rows[j][i], master, compiled, i)
        return (compiled,), {"_compiled_call_impl": call}, None


#: Marks an entry to remove from a replica's ``__dict__``.
_ABSENT = object()
