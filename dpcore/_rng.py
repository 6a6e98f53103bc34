"""torch's RNG-state functions, made to see a replica's own random stream
(``fork_rng``, activation checkpointing). ``dpcore._C`` calls
:func:`install_state_functions` on the first parallel call that gives a
replica a stream. Why and how: docs/design.md, "Randomness, what is process-wide".
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from dpcore._loader import _C

__all__ = ["install_state_functions"]

_install_lock = threading.Lock()


def _own(device_type: str, device: Any = None) -> torch.Generator | None:
    """The generator of this thread's replica stream if it is on a device of
    `device_type` (for CUDA: the one torch.cuda resolves `device` to), else None."""
    own = _C.replica_generator()
    if own is None or own.device.type != device_type:
        return None
    if device_type == "cuda":
        index = device if isinstance(device, int) else torch.device(device).index
        if own.device.index != (torch.cuda.current_device() if index is None else index):
            return None
    return own


def install_state_functions() -> None:
    """Rebinds ``torch.get_rng_state``/``set_rng_state`` (and torch.random's
    and torch.cuda's names of them) to act on the calling replica's stream
    for the device, and elsewhere call the functions they replace. Idempotent
    and thread-safe."""
    import torch.cuda
    import torch.cuda.random
    import torch.random

    with _install_lock:
        if not getattr(torch.random.get_rng_state, "_dpcore_streams", False):
            _rebind()


def _rebind() -> None:
    cpu_get, cpu_set = torch.random.get_rng_state, torch.random.set_rng_state
    cuda_get, cuda_set = torch.cuda.random.get_rng_state, torch.cuda.random.set_rng_state

    @functools.wraps(cpu_get)
    def get_rng_state() -> torch.Tensor:
        own = _own("cpu")
        return cpu_get() if own is None else own.get_state()

    @functools.wraps(cpu_set)
    def set_rng_state(new_state: torch.Tensor) -> None:
        own = _own("cpu")
        cpu_set(new_state) if own is None else own.set_state(new_state)

    @functools.wraps(cuda_get)
    def cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
        own = _own("cuda", device)
        return cuda_get(device) if own is None else own.get_state()

    @functools.wraps(cuda_set)
    def cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        own = _own("cuda", device)
        cuda_set(new_state, device) if own is None else own.set_state(new_state)

    for function in (get_rng_state, set_rng_state, cuda_get_rng_state, cuda_set_rng_state):
        function._dpcore_streams = True  # type: ignore[attr-defined]
    torch.get_rng_state = torch.random.get_rng_state = get_rng_state
    torch.set_rng_state = torch.random.set_rng_state = set_rng_state
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = cuda_get_rng_state
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = cuda_set_rng_state
