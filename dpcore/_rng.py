"""torch's RNG-state functions, made to see a replica's own random stream (``fork_rng``, activation checkpointing).
:data:`STATE_FUNCTIONS` is handed to ``dpcore._C`` once (dpcore/parallel_apply.py), which binds torch's names to them
only while a replica with a stream runs. Why and how: docs/design.md, "Randomness, what is process-wide"."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.cuda.random
import torch.random

from dpcore._loader import _C

__all__ = ["STATE_FUNCTIONS"]

_cpu_get, _cpu_set = torch.random.get_rng_state, torch.random.set_rng_state
_cuda_get, _cuda_set = torch.cuda.random.get_rng_state, torch.cuda.random.set_rng_state


def _own(device_type: str, device: Any = None) -> torch.Generator | None:
    """The generator of this thread's replica stream if it is on a device of `device_type` (for CUDA: the one torch.cuda
    resolves `device` to), else None."""
    own = _C.replica_generator()
    if own is None or own.device.type != device_type:
        return None
    if device_type == "cuda":
        index = device if isinstance(device, int) else torch.device(device).index
        if own.device.index != (torch.cuda.current_device() if index is None else index):
            return None
    return own


@functools.wraps(_cpu_get)
def get_rng_state() -> torch.Tensor:
    own = _own("cpu")
    return _cpu_get() if own is None else own.get_state()


@functools.wraps(_cpu_set)
def set_rng_state(new_state: torch.Tensor) -> None:
    own = _own("cpu")
    _cpu_set(new_state) if own is None else own.set_state(new_state)


@functools.wraps(_cuda_get)
def cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    own = _own("cuda", device)
    return _cuda_get(device) if own is None else own.get_state()


@functools.wraps(_cuda_set)
def cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    own = _own("cuda", device)
    _cuda_set(new_state, device) if own is None else own.set_state(new_state)


#: (owner, name, function): on a thread running a replica with a stream, each
#: acts on that stream for its device; elsewhere it calls the function it replaces.
STATE_FUNCTIONS = [
    (owner, name, function)
    for owners, name, function in (
        ((torch, torch.random), "get_rng_state", get_rng_state),
        ((torch, torch.random), "set_rng_state", set_rng_state),
        ((torch.cuda, torch.cuda.random), "get_rng_state", cuda_get_rng_state),
        ((torch.cuda, torch.cuda.random), "set_rng_state", cuda_set_rng_state),
    )
    for owner in owners
]
