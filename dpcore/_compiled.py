"""Compiled modules (``torch.compile``) inside dpcore's replicas: :func:`replicate_module` and
:class:`CompiledReplicas`; the rule: docs/design.md, "Compiled modules"."""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["CompiledReplicas", "has_compiled", "replicate_module"]

#: The entries of an OptimizedModule's ``__dict__`` that each replica gets its own of.
_OPTIMIZED_OWN = ("forward", "_forward", "_torchdynamo_orig_callable", "_torchdynamo_wrapper_id", "get_compiler_config")


def _optimized_module_type() -> type | None:
    """torch's OptimizedModule class, or None while torch._dynamo was never imported (then nothing was compiled;
    importing it only to check is slow)."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


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
    """A replica of `master` as ``_replicate_for_data_parallel()`` makes it, but for an OptimizedModule without writing
    through its ``__setattr__`` (which would reach, and empty, the master's inner module)."""
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
    """The Dynamo context that made `compiled` (a ``torch.compile(fn, ...)`` result), from its ``get_compiler_config``
    closure, or None."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    getter = getattr(compiled, "get_compiler_config", None)
    code = getattr(getter, "__code__", None)
    if code is None or not getter.__closure__:
        return None
    cells = dict(zip(code.co_freevars, getter.__closure__))
    ctx = cells["self"].cell_contents if "self" in cells else None
    return ctx if isinstance(ctx, _TorchDynamoContext) else None


def _own_entries(kind: str, master: nn.Module, replica: nn.Module, index: int, sources: tuple[Any, ...]) -> Any:
    """(entries, keep-alive): the replica's own compiled entries, made from `sources`. An OptimizedModule gets the
    master's Dynamo context on its inner module; a ``compile()``'d module the counterpart of the master's
    ``_compiled_call_impl`` (same Dynamo context, or for ``compile(disable=True)`` its own ``_call_impl``); TypeError
    for anything else."""
    if kind == "optimized":
        ctx, inner = sources[1], sources[2]
        if inner is None or ctx is None:
            raise TypeError(
                f"DataParallel: the compiled module {index} of the model ({type(master).__name__}) has no _orig_mod "
                f"or dynamo_ctx, so it cannot be compiled again for each replica"
            )
        fresh = ctx(inner)
        return {name: fresh.__dict__.get(name, _ABSENT) for name in _OPTIMIZED_OWN}, fresh
    compiled = sources[0]
    ctx = _dynamo_context(compiled)
    if ctx is not None:
        return {"_compiled_call_impl": ctx(replica._call_impl)}, None
    if isinstance(compiled, types.MethodType) and compiled.__self__ is master:
        return {"_compiled_call_impl": types.MethodType(compiled.__func__, replica)}, None
    raise TypeError(
        f"DataParallel: module {index} of the model ({type(master).__name__}) holds a _compiled_call_impl "
        f"({type(compiled).__name__}) that was not made by module.compile() or torch.compile, so it cannot be "
        f"compiled again for each replica (running the master's on a replica would compute with the master's "
        f"parameters); wrap the module as torch.compile(module) instead"
    )


class CompiledReplicas:
    """Per-replica compiled calls for the compiled modules among `masters` (``module.modules()``) and their replicas
    ``rows[j][i]``: after :meth:`apply`, each replica of a compiled module calls its own compiled call, made with the
    master's Dynamo context on first use and kept while the master's compiled callable is the same object."""

    def __init__(self, masters: Sequence[nn.Module], rows: Sequence[Sequence[nn.Module]]):
        self._masters = list(masters)
        self._rows = [list(row) for row in rows]
        optimized = [("optimized", i) for i, m in enumerate(self._masters) if is_optimized(m)]
        self._kinds = optimized + [("call", i) for i, m in enumerate(self._masters) if _compiled_call(m) is not None]
        # (row, module index, kind) -> (what the entries were made from, the entries, a keep-alive)
        self._made: dict[tuple[int, int, str], tuple[tuple[Any, ...], dict[str, Any], Any]] = {}

    def apply(self, n: int) -> None:
        """Gives the replicas of rows 0..n-1 their own compiled calls."""
        for j in range(n):
            for kind, i in self._kinds:
                self._set(j, i, kind)

    def _set(self, j: int, i: int, kind: str) -> None:
        """Writes the (j, i) replica's compiled entries, remade when what they were made from changed."""
        master, replica = self._masters[i], self._rows[j][i]
        state = replica.__dict__
        if kind == "call":
            sources: tuple[Any, ...] = (_compiled_call(master),)
        else:
            inner = state["_modules"].get("_orig_mod")
            sources = (master.__dict__.get("forward"), master.__dict__.get("dynamo_ctx"), inner)
        made = self._made.get((j, i, kind))
        if made is None or any(a is not b for a, b in zip(made[0], sources)):
            made = self._made[(j, i, kind)] = (sources, *_own_entries(kind, master, replica, i, sources))
        for name, value in made[1].items():
            if value is _ABSENT:
                state.pop(name, None)
            else:
                state[name] = value


#: Marks an entry to remove from a replica's ``__dict__``.
_ABSENT = object()
