"""``dpcore.patch_torch()``: library code that builds ``torch.nn.DataParallel``
itself (Hugging Face Trainer's ``_wrap_model``) builds dpcore's wrapper instead.

Opt-in, process-wide and reversible: nothing happens on import. While the
patch is on, ``torch.nn.DataParallel``, ``torch.nn.parallel.DataParallel``
and ``torch.nn.parallel.data_parallel.DataParallel`` are a subclass of
:class:`dpcore.DataParallel` (named ``DataParallel``) with the same
constructor; ``isinstance(x, torch.nn.DataParallel)`` still holds for
wrappers that torch built (before the patch), so code that unwraps by
isinstance (accelerate's ``extract_model_from_parallel``) unwraps both.
Names bound before the patch (``from torch.nn import DataParallel`` at a
module's top) keep torch's class.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType, TracebackType
from typing import Any

from dpcore.data_parallel import DataParallel as _DpcoreDataParallel
from dpcore.data_parallel import TorchDataParallel

__all__ = ["TorchPatch", "patch_torch", "unpatch_torch"]


class _StandInMeta(type(_DpcoreDataParallel)):  # ABCMeta: the wrapper is a Joinable
    """Metaclass of the class that stands in for torch's while patched:
    torch's own wrappers count as its instances too (only for that class
    itself, not for its subclasses). dpcore.DataParallel's own checks stay
    nominal (data_parallel._WrapperMeta), so they never ask this class."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if super().__instancecheck__(obj):
            return True
        return cls is DataParallel and isinstance(obj, TorchDataParallel)

    def __subclasscheck__(cls, sub: type) -> bool:
        if super().__subclasscheck__(sub):
            return True
        return cls is DataParallel and issubclass(sub, TorchDataParallel)


class DataParallel(_DpcoreDataParallel, metaclass=_StandInMeta):
    """What ``torch.nn.DataParallel`` is while dpcore's patch is on:
    :class:`dpcore.DataParallel` itself (constructor, defaults, behaviour),
    such that ``isinstance(w, torch.nn.DataParallel)`` also holds for a
    wrapper built by torch's own class."""


def _targets() -> list[ModuleType]:
    """The modules whose attribute ``DataParallel`` is torch's class."""
    import torch.nn
    import torch.nn.parallel

    return [torch.nn, torch.nn.parallel, importlib.import_module("torch.nn.parallel.data_parallel")]


_lock = threading.Lock()
_depth = 0  # handles active
_generation = 0  # bumped by unpatch_torch, which ends every handle
_saved: list[tuple[ModuleType, Any]] = []  # (module, its DataParallel before the patch)


def _install() -> None:
    _saved.clear()
    for module in _targets():
        _saved.append((module, module.DataParallel))
        module.DataParallel = DataParallel


def _restore() -> None:
    for module, original in _saved:
        if module.DataParallel is DataParallel:  # leave a later patch by someone else alone
            module.DataParallel = original
    _saved.clear()


class TorchPatch:
    """The handle :func:`patch_torch` returns: ``undo()`` (or leaving its
    ``with`` block) ends this patch; torch's class is back once every
    handle is undone (nested patches: the outermost restores) or after
    :func:`unpatch_torch`. Undoing twice does nothing."""

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
            if not (self._active and self._generation == _generation):
                self._active = False
                return
            self._active = False
            _depth -= 1
            if _depth == 0:
                _restore()

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.undo()


def patch_torch() -> TorchPatch:
    """Makes ``torch.nn.DataParallel(module, device_ids=None,
    output_device=None, dim=0)`` build a :class:`dpcore.DataParallel`, for
    library code that wraps a model in torch's class itself (Hugging Face
    Trainer with several GPUs). Process-wide until undone: ``with
    dpcore.patch_torch(): ...``, ``handle.undo()`` or
    :func:`unpatch_torch`.

    Guarantees: the three public names of torch's class
    (``torch.nn.DataParallel``, ``torch.nn.parallel.DataParallel``,
    ``torch.nn.parallel.data_parallel.DataParallel``) are rebound to a
    subclass of dpcore's class, so the wrappers built are dpcore's, with
    dpcore's defaults (every visible GPU; with no GPU and no device list the
    module runs as is, as torch's). ``isinstance(w, torch.nn.DataParallel)``
    holds for dpcore's wrappers and torch's alike while patched; after the
    patch ends, the names are torch's class again and wrappers built
    meanwhile stay dpcore's. Nested calls are counted."""
    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
        return TorchPatch(_generation)


def unpatch_torch() -> bool:
    """Ends every patch of :func:`patch_torch` at once (their handles become
    inactive) and rebinds torch's names to torch's class. Returns whether a
    patch was on."""
    global _depth, _generation
    with _lock:
        was_on = _depth > 0
        if was_on:
            _restore()
        _depth = 0
        _generation += 1
        return was_on
