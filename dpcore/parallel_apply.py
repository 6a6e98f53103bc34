"""parallel_apply on dpcore's persistent C++ worker pool."""

from __future__ import annotations

import atexit
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpcore import _rng
from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_device, normalize_device

__all__ = ["parallel_apply", "start_parallel_apply"]

_C.set_rng_state_functions(_rng.STATE_FUNCTIONS)  # bound by _C only while replicas with streams run
atexit.register(_C.join_abandoned_runs)  # no worker may run Python code while the interpreter shuts down


def _module_device(module: Any) -> torch.device:
    """The device of a module's first parameter or buffer; the CPU if it has none."""
    if isinstance(module, torch.nn.Module):
        for t in itertools.chain(module.parameters(), module.buffers()):
            return normalize_device(t.device)
    return torch.device("cpu")


def parallel_apply(
    modules: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
    *,
    all_at_once: bool = False,
) -> list[Any]:
    """torch.nn.parallel.parallel_apply on persistent worker threads: ``modules[i](*inputs[i], **kwargs_tup[i])`` for
    every i at once, under the caller's grad, inference and autocast state with ``devices[i]`` (default: the module's)
    current; the results in order, or the lowest index's exception (the same object, noted with its replica and device).
    CPU calls run at most ``torch.get_num_threads()`` at a time, unless ``all_at_once`` (calls that wait for each
    other). Ctrl-C skips calls not started and interrupts running ones."""
    return start_parallel_apply(modules, inputs, kwargs_tup, devices, all_at_once=all_at_once).result()


def start_parallel_apply(
    modules: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
    *,
    all_at_once: bool = False,
) -> Any:
    """Starts :func:`parallel_apply`'s calls; returns a ``dpcore._C.ParallelRun`` at once: ``result()`` waits and
    returns (or raises) what parallel_apply would; ``join(timeout=None)`` waits without raising and returns whether all
    ended; ``cancel()`` skips those not started; ``done``."""
    n = len(modules)
    kwargs_tup = [{}] * n if kwargs_tup is None else kwargs_tup
    devices = [None] * n if devices is None else devices
    for what, given in (("input", inputs), ("kwargs dict", kwargs_tup), ("device", devices)):
        if len(given) != n:
            raise ValueError(f"parallel_apply: expected one {what} per module ({n}), but got {len(given)}")
    resolved = [
        _module_device(m) if d is None else as_device(d, f"devices[{i}]")
        for i, (m, d) in enumerate(zip(modules, devices))
    ]
    args = [tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    kws = [dict(k or {}) for k in kwargs_tup]
    return _C.start_parallel_apply(modules, args, kws, resolved, all_at_once=bool(all_at_once))


class CallGuard:
    """Serializes the calls of one DataParallel (``with guard:``); the next call first waits for the replicas of an
    interrupted one (``abandoned``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned: Any = None  # a dpcore._C.ParallelRun, or None

    def __enter__(self) -> CallGuard:
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
