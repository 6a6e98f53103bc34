"""Conversion of user-facing device arguments to torch.device."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Union

import torch

DeviceLike = Union[int, str, torch.device]


def normalize_device(device: torch.device) -> torch.device:
    """`device` as dpcore compares devices (the C++ core's rule): "cpu:0" is "cpu"."""
    return torch.device("cpu") if device.type == "cpu" else device


def as_device(device: DeviceLike, arg: str) -> torch.device:
    """One device, normalized: an int is a CUDA index (as in torch.cuda.comm), a str or torch.device is taken as is;
    else TypeError naming `arg`."""
    if type(device) is torch.device and (device.type != "cpu" or device.index is None):
        return device  # already normalized: the common case, at every call
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(
            f"{arg}: expected a device (an int CUDA index, a str such as 'cpu' or 'cuda:1', "
            f"or a torch.device), but got {type(device).__name__} {device!r}"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{arg}: expected a non-negative CUDA device index, but got {device}")
        return torch.device("cuda", device)
    return normalize_device(torch.device(device))


def as_devices(devices: Iterable[DeviceLike] | None, arg: str) -> list[torch.device]:
    """A list of devices (see as_device); element i is reported as ``arg[i]``."""
    if devices is None:
        raise ValueError(f"{arg}: expected a list of devices, but got None")
    if isinstance(devices, (str, torch.device, int)):
        raise TypeError(f"{arg}: expected a list of devices, but got a single device {devices!r}")
    return [as_device(d, f"{arg}[{i}]") for i, d in enumerate(devices)]


def as_destination(destination: DeviceLike | None, arg: str = "destination") -> torch.device | None:
    """A destination as torch.cuda.comm takes it: None (the inputs' current device) is returned as is, -1 is the CPU,
    else as_device."""
    if destination is None:
        return None
    if isinstance(destination, int) and not isinstance(destination, bool) and destination == -1:
        return torch.device("cpu")
    return as_device(destination, arg)


def tensor_list(tensors: Sequence[torch.Tensor], arg: str) -> list[torch.Tensor]:
    """`tensors` as a list, each element checked to be a tensor (named ``arg[i]``)."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{arg}: expected a sequence of tensors, but got a single tensor")
    result = list(tensors)
    for i, t in enumerate(result):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}[{i}]: expected a tensor, but got {type(t).__name__}")
    return result
