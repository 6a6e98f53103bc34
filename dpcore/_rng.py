"""torch's RNG-state functions, made to see a replica's own random stream.

Replicas that share a device's default generator each draw from a stream of
their own (the rule and the mechanism, in C++: docs/design.md,
"Randomness"). Code that saves and restores "the" generator state reads it with
``torch.get_rng_state`` (``torch.random.fork_rng``; activation
checkpointing, which recomputes dropout masks in backward from the state
saved in forward), and that function reads ``torch.default_generator``,
which no C++ hook can redirect. So, on the first parallel call that gives a
replica a stream, ``dpcore._C`` calls :func:`install_state_functions` once:
inside such a replica these functions act on its stream; everywhere else
they call torch's own functions, as before.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from dpcore._loader import _C

__all__ = ["install_state_functions"]

_install_lock = threading.Lock()


def _own(device_type: str) -> torch.Generator | None:
    """The generator of this thread's replica stream if it is on a device of
    `device_type`, else None."""
    own = _C.replica_generator()
    return own if own is not None and own.device.type == device_type else None


def _cuda_index(device: Any) -> int:
    """The CUDA device index torch.cuda's RNG-state functions resolve `device` to."""
    index = device if isinstance(device, int) else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def install_state_functions() -> None:
    """Rebinds ``torch.get_rng_state``/``set_rng_state`` (and torch.random's
    and torch.cuda's names of them): on a thread running a replica with a
    stream of its own for the device, they read and write the stream's
    generator; elsewhere they call the functions they replace. Idempotent
    and thread-safe: they are rebound once."""
    import torch.cuda
    import torch.cuda.random
    import torch.random

    with _install_lock:
        if not getattr(torch.random.get_rng_state, "_dpcore_streams", False):
            _rebind()


def _rebind() -> None:
    """install_state_functions' work, under its lock."""
    cpu_get, cpu_set = torch.random.get_rng_state, torch.random.set_rng_state
    cuda_get, cuda_set = torch.cuda.random.get_rng_state, torch.cuda.random.set_rng_state

    @functools.wraps(cpu_get)
    def get_rng_state() -> torch.Tensor:
        own = _own("cpu")
        return cpu_get() if own is None else own.get_state()

    @functools.wraps(cpu_set)
    def set_rng_state(new_state: torch.Tensor) -> None:
        own = _own("cpu")
        if own is None:
            cpu_set(new_state)
        else:
            own.set_state(new_state)

    @functools.wraps(cuda_get)
    def cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
        own = _own("cuda")
        if own is None or own.device.index != _cuda_index(device):
            return cuda_get(device)
        return own.get_state()

    @functools.wraps(cuda_set)
    def cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        own = _own("cuda")
        if own is None or own.device.index != _cuda_index(device):
            cuda_set(new_state, device)
        else:
            own.set_state(new_state)

    for function in (get_rng_state, set_rng_state, cuda_get_rng_state, cuda_set_rng_state):
        function._dpcore_streams = True  # type: ignore[attr-defined]
    torch.get_rng_state = torch.random.get_rng_state = get_rng_state
    torch.set_rng_state = torch.random.set_rng_state = set_rng_state
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = cuda_get_rng_state
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = cuda_set_rng_state
