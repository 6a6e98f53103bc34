"""parallel_apply on dpcore's persistent C++ worker pool."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpcore._loader import _C
from dpcore._devices import DeviceLike, as_device, normalize_device

__all__ = ["parallel_apply", "start_parallel_apply"]


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
    """Calls ``modules[i](*inputs[i], **kwargs_tup[i])`` for every i at once, on
    persistent worker threads (created once, reused by later calls), and
    returns the results in order; torch.nn.parallel.parallel_apply's contract.

    Guarantees: an input that is not a list or tuple is passed as the single
    argument; each call runs under the caller's grad mode, inference mode and
    autocast state (enabled, dtype, cache flag), with ``devices[i]`` (default:
    the module's parameter device) as current device and the caller's current
    stream on it; calls that share a device's default generator with another
    call each draw from a random stream of their own (docs/design.md,
    "Randomness"); the GIL is released while waiting. If calls raise, the
    exception of the lowest index is raised as the same object, with a note
    "raised in replica i on device d" and its original traceback (also
    KeyboardInterrupt and other BaseExceptions); the pool stays usable.
    Nested calls (a module calling parallel_apply) and concurrent calls from
    several threads do not deadlock. Accelerator calls all run at once; CPU
    calls run at most ``torch.get_num_threads()`` at a time, sharing those
    intra-op threads (more would only contend for the cores and the GIL), so
    a call must not wait for another call of the same parallel_apply, unless
    ``all_at_once``: then every call runs on a thread of its own, all at once,
    on the CPU too (synchronized BatchNorm's replicas wait for each other).

    Signals: Python's signal handlers keep running while the caller waits
    (it wakes every 50 ms). When one raises (KeyboardInterrupt on Ctrl-C),
    the calls not yet started are skipped, KeyboardInterrupt is raised in
    each running call at its next Python bytecode, and the caller waits for
    them to return before the handler's exception reaches it: once it does,
    no call is still running, and the latency is that of the slowest running
    call's current operation (about that of the same code on one thread). A
    second signal during that wait ends it: the calls still running then
    finish in the background on threads no other call is given meanwhile
    (the interpreter waits for them at exit; :func:`start_parallel_apply`'s
    ``join`` waits for them).
    """
    return start_parallel_apply(modules, inputs, kwargs_tup, devices, all_at_once=all_at_once).result()


def start_parallel_apply(
    modules: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
    *,
    all_at_once: bool = False,
) -> Any:
    """Starts :func:`parallel_apply`'s calls and returns at once a
    ``dpcore._C.ParallelRun``: ``result()`` waits and returns (or raises)
    what parallel_apply would; ``join(timeout=None)`` waits until every call
    has returned or been skipped, without raising their errors, and returns
    whether they have; ``cancel()`` skips the calls not yet started; ``done``
    says whether all have finished. Both waits are interruptible as
    parallel_apply's; a run interrupted in ``result()`` can still be joined.
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(f"parallel_apply: expected one input per module ({n}), but got {len(inputs)}")
    if kwargs_tup is None:
        kwargs_tup = [{}] * n
    if len(kwargs_tup) != n:
        raise ValueError(f"parallel_apply: expected one kwargs dict per module ({n}), but got {len(kwargs_tup)}")
    if devices is None:
        devices = [None] * n
    if len(devices) != n:
        raise ValueError(f"parallel_apply: expected one device per module ({n}), but got {len(devices)}")
    resolved = [
        _module_device(m) if d is None else as_device(d, f"devices[{i}]")
        for i, (m, d) in enumerate(zip(modules, devices))
    ]
    args = [tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    return _C.start_parallel_apply(
        modules,
        args,
        [dict(k or {}) for k in kwargs_tup],
        resolved,
        all_at_once=bool(all_at_once),
    )


class CallGuard:
    """Serializes the calls of one DataParallel (``with guard:``), and holds
    the run of a call interrupted while its replicas were still running: the
    next call waits for those replicas first (interruptibly)."""

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
