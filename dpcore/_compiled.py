"""Compiled modules (``torch.compile``) inside dpcore's replicas.

torch's ``_replicate_for_data_parallel()`` fits neither form of compiled
code: on an ``OptimizedModule`` its assignments go through ``__setattr__``
into the master's inner module, and a replica of a ``module.compile()``'d
module runs the master's compiled callable on the master's parameters.
This module gives the replica cache what it needs instead:

* :func:`replicate_module`, the replica factory for ``dpcore._C.ReplicaSet``:
  an ``OptimizedModule``'s ``__dict__`` is copied directly; the user's
  modules are not touched;
* :class:`CompiledReplicas`: after each refresh, every replica of a
  compiled module gets its own callable, compiled from the replica itself
  with the master's options, made once per replica and kept while the
  master's compiled callable is the same.

The rule and its details: docs/design.md, "Compiled modules".
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["CompiledReplicas", "has_compiled", "replicate_module"]

#: The entries of an OptimizedModule's ``__dict__`` that hold its compiled
#: call, or refer to it: each replica gets its own.
_OPTIMIZED_OWN = ("forward", "_forward", "_torchdynamo_orig_callable", "_torchdynamo_wrapper_id", "get_compiler_config")


#: What one replica's compiled entries were made from (compared by identity),
#: the entries to write into its __dict__, and an object to keep alive.
_Made = tuple[tuple[Any, ...], dict[str, Any], Any]


def _optimized_module_type() -> type | None:
    """torch's OptimizedModule class, or None while torch._dynamo was never
    imported (then no module can have been compiled): importing Dynamo only
    to check would cost every user a second."""
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
    """Whether `module` or a submodule is compiled: an OptimizedModule, or a
    module on which ``compile()`` was called."""
    if _optimized_module_type() is None:
        return False
    return any(is_optimized(m) or _compiled_call(m) is not None for m in module.modules())


def replicate_module(master: nn.Module) -> nn.Module:
    """A replica of `master` as ``_replicate_for_data_parallel()`` makes it
    (its ``__dict__`` copied; its own empty ``_parameters`` and copies of
    ``_buffers`` and ``_modules``; ``_is_replica`` set), that never writes
    through the master's ``__setattr__``: for an OptimizedModule, that
    would reach (and empty) the master's inner module. Any other module is
    replicated by its own ``_replicate_for_data_parallel()``, overrides
    included."""
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
    """The Dynamo context (torch.compile's options) that made `compiled`, a
    function returned by ``torch.compile(fn, ...)``, or None. torch keeps
    it only in the closure of the function's ``get_compiler_config``."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    getter = getattr(compiled, "get_compiler_config", None)
    code = getattr(getter, "__code__", None)
    if code is None or not getter.__closure__:
        return None
    cells = dict(zip(code.co_freevars, getter.__closure__))
    ctx = cells["self"].cell_contents if "self" in cells else None
    return ctx if isinstance(ctx, _TorchDynamoContext) else None


def _compile_call_for(replica: nn.Module, master: nn.Module, compiled: Any, index: int) -> Callable[..., Any]:
    """The replica's counterpart of the master's ``_compiled_call_impl``:
    ``replica._call_impl`` compiled with the same Dynamo context (or, for
    ``compile(disable=True)``, which stores the master's bound
    ``_call_impl``, the replica's own). Raises TypeError for anything else:
    running the master's callable in a replica would compute on the master's
    parameters."""
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
    (``module.modules()``, in that order) and their replicas ``rows[j][i]``
    (``ReplicaSet.replica_modules``).

    Guarantees: after :meth:`apply` (called after every refresh of the
    replica ``__dict__``\\ s, which copies the masters'), the replica of an
    OptimizedModule calls its own inner replica through a compiled call made
    by the master's Dynamo context, and the replica of a module with
    ``_compiled_call_impl`` calls its own ``_call_impl`` compiled with the
    master's options. Each is made on first use and kept while the master's
    compiled callable (and, for an OptimizedModule, its Dynamo context) is
    the same object; the user's modules are never written.
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
        """The per-replica compiled calls of `module`'s replicas, or None
        when no module of its tree is compiled (nothing to do per step)."""
        if not rows or not has_compiled(module):
            return None
        return CompiledReplicas(list(module.modules()), rows)

    def apply(self, n: int) -> None:
        """Gives the replicas of rows 0..n-1 their own compiled calls (see
        the class guarantees)."""
        for j in range(n):
            for i in self._optimized:
                self._set(j, i, "optimized", self._optimized_values)
            for i in self._called:
                self._set(j, i, "call", self._call_values)

    def _set(self, j: int, i: int, kind: str, make: Callable[[int, int], _Made]) -> None:
        """Writes the (j, i) replica's own compiled entries, remade by `make`
        first when what they were made from changed."""
        master = self._masters[i]
        state = self._rows[j][i].__dict__
        key = (j, i, kind)
        made = self._made.get(key)
        sources = self._sources(master, kind, j, i)
        if made is None or len(made[0]) != len(sources) or any(a is not b for a, b in zip(made[0], sources)):
            made = make(j, i)
            self._made[key] = made
        for name, value in made[1].items():
            if value is _ABSENT:
                state.pop(name, None)
            else:
                state[name] = value

    def _sources(self, master: nn.Module, kind: str, j: int, i: int) -> tuple[Any, ...]:
        """What the replica's compiled call was made from: remade when any changes."""
        if kind == "call":
            return (_compiled_call(master),)
        inner = self._rows[j][i].__dict__["_modules"].get("_orig_mod")
        return (master.__dict__.get("forward"), master.__dict__.get("dynamo_ctx"), inner)

    def _optimized_values(self, j: int, i: int) -> _Made:
        """The OptimizedModule replica's own compiled forward: the master's
        Dynamo context applied to the replica's inner module (what
        ``torch.compile(inner, same options)`` returns)."""
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
        own = fresh.__dict__
        values = {name: own.get(name, _ABSENT) for name in _OPTIMIZED_OWN}
        return self._sources(master, "optimized", j, i), values, fresh

    def _call_values(self, j: int, i: int) -> _Made:
        """The replica's own ``_compiled_call_impl`` (see _compile_call_for)."""
        master = self._masters[i]
        compiled = _compiled_call(master)
        call = _compile_call_for(self._rows[j][i], master, compiled, i)
        return (compiled,), {"_compiled_call_impl": call}, None


#: Marks an entry to remove from a replica's ``__dict__``.
_ABSENT = object()
