"""``dpcore.patch_torch()``: code that builds ``torch.nn.DataParallel`` builds dpcore's instead; opt-in, process-wide,
reversible (docs/migration.md)."""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any

from dpcore.data_parallel import DataParallel as _DpcoreDataParallel
from dpcore.data_parallel import TorchDataParallel

__all__ = ["TorchPatch", "patch_torch", "unpatch_torch"]


class _StandInMeta(type(_DpcoreDataParallel)):  # ABCMeta: the wrapper is a Joinable
    """Metaclass of the stand-in for torch's class: torch's own wrappers count as instances of the stand-in itself (not
    of its subclasses)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return super().__instancecheck__(obj) or (cls is DataParallel and isinstance(obj, TorchDataParallel))

    def __subclasscheck__(cls, sub: type) -> bool:
        return super().__subclasscheck__(sub) or (cls is DataParallel and issubclass(sub, TorchDataParallel))


class DataParallel(_DpcoreDataParallel, metaclass=_StandInMeta):
    """``torch.nn.DataParallel`` while patched: :class:`dpcore.DataParallel`, of which torch's own wrappers are
    instances too."""


_lock = threading.Lock()
_depth = 0  # handles active
_generation = 0  # bumped by unpatch_torch, which ends every handle
_saved: list[tuple[ModuleType, Any]] = []  # (module, its DataParallel before the patch)


def _install() -> None:
    import torch.nn
    import torch.nn.parallel

    _saved.clear()
    for module in (torch.nn, torch.nn.parallel, importlib.import_module("torch.nn.parallel.data_parallel")):
        _saved.append((module, module.DataParallel))
        module.DataParallel = DataParallel


def _restore() -> None:
    for module, original in _saved:
        if module.DataParallel is DataParallel:  # leave a later patch by someone else alone
            module.DataParallel = original
    _saved.clear()


class TorchPatch:
    """The handle :func:`patch_torch` returns: ``undo()`` (or leaving its ``with`` block) ends this patch; torch's class
    is back once every handle is undone or after :func:`unpatch_torch`. Undoing twice does nothing."""

    def __init__(self, generation: int) -> None:
        self._generation = generation
        self._active = True

    @property
    def active(self) -> bool:
        """Whether this handle still holds the patch."""
        return self._active and self._generation == _generation

    def undo(self) -> None:
        """Ends this handle's patch (see the class)."""
        global _depth
        with _lock:
            held, self._active = self.active, False
            if held:
                _depth -= 1
                if _depth == 0:
                    _restore()

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def patch_torch() -> TorchPatch:
    """Makes ``torch.nn.DataParallel`` (and torch's two other names of it) build a :class:`dpcore.DataParallel`, with
    dpcore's defaults, until undone: ``with dpcore.patch_torch(): ...``, ``handle.undo()`` or :func:`unpatch_torch`.
    ``isinstance(w, torch.nn.DataParallel)`` holds for dpcore's wrappers and torch's alike while patched. Nested calls
    are counted; names bound before the patch keep torch's class."""
    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
        return TorchPatch(_generation)


def unpatch_torch() -> bool:
    """Ends every patch of :func:`patch_torch` at once (their handles become inactive); returns whether a patch was
    on."""
    global _depth, _generation
    with _lock:
        was_on = _depth > 0
        if was_on:
            _restore()
        _depth = 0
        _generation += 1
        return was_on
