"""Shared fixtures for dpcore's pytest suite.

Device lists:

* ``devices``: CPU device lists ``["cpu"] * k`` for k = 1..4 (always run).
* ``cuda_devices``: CUDA device lists, including the repeated ``[0, 0]`` and
  ``[0, 0, 0, 0]``;
  skipped only when ``torch.cuda.is_available()`` is False.
* ``any_devices``: both of the above, so that one test body runs on CPU lists
  and, where a GPU is present, on CUDA lists.

CUDA parameters carry the ``cuda`` marker (``pytest -m cuda`` selects them).
"""

from __future__ import annotations

import datetime
from typing import Any, Union

import pytest
import torch
import torch.distributed as dist

DeviceLike = Union[int, str, torch.device]

NO_GPU_REASON = "no CUDA GPU: torch.cuda.is_available() is False (CUDA device lists need a GPU)"

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU_REASON)

CPU_DEVICE_LISTS: list[list[DeviceLike]] = [["cpu"] * k for k in range(1, 5)]


def _cuda_device_lists() -> list[list[DeviceLike]]:
    """CUDA lists to test: one GPU, the same GPU twice and four times (how a
    single-GPU machine stands in for four), and every GPU (in both orders)
    where there are several. The first three exist on every machine (and
    skip without a GPU), so the skip is visible in reports."""
    lists: list[list[DeviceLike]] = [[0], [0, 0], [0, 0, 0, 0]]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        lists.append(list(range(count)))
        lists.append([1, 0])
        lists.append([0, 1, 0])
    return lists


CUDA_DEVICE_LISTS: list[list[DeviceLike]] = _cuda_device_lists()


def _list_id(devices: list[DeviceLike]) -> str:
    if all(d == "cpu" for d in devices):
        return f"cpu*{len(devices)}"
    return "cuda[" + ",".join(str(d) for d in devices) + "]"


CPU_PARAMS: list[Any] = [pytest.param(d, id=_list_id(d)) for d in CPU_DEVICE_LISTS]
CUDA_PARAMS: list[Any] = [
    pytest.param(d, id=_list_id(d), marks=[requires_cuda, pytest.mark.cuda]) for d in CUDA_DEVICE_LISTS
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: the test runs on CUDA device lists (skips without a GPU)")
    config.addinivalue_line(
        "markers",
        "serial: a bound on wall time or on thread scheduling; CI runs these alone, after the tests that "
        "run in parallel (pytest -m serial)",
    )


@pytest.fixture(params=CPU_PARAMS)
def devices(request: pytest.FixtureRequest) -> list[DeviceLike]:
    """A CPU device list, ["cpu"] * k for k = 1..4."""
    return list(request.param)


@pytest.fixture(params=CUDA_PARAMS)
def cuda_devices(request: pytest.FixtureRequest) -> list[DeviceLike]:
    """A CUDA device list ([0], [0, 0], [0, 0, 0, 0], and multi-GPU lists where present)."""
    return list(request.param)


@pytest.fixture(params=CPU_PARAMS + CUDA_PARAMS)
def any_devices(request: pytest.FixtureRequest) -> list[DeviceLike]:
    """A CPU device list or (with a GPU) a CUDA device list."""
    return list(request.param)


def as_torch_device(device: DeviceLike) -> torch.device:
    """What dpcore makes of a device argument: an int is a CUDA index; CPU has no index."""
    from dpcore._devices import as_device

    return as_device(device, "device")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices name the same memory ("cpu" and "cpu:0" do)."""
    return as_torch_device(a) == as_torch_device(b)


def subprocess_env() -> dict[str, str]:
    """Environment for a child Python that must import the same dpcore as this
    process (the installed one in CI, the in-place build in development):
    its folder goes first on PYTHONPATH. Run the child with cwd=TESTS_DIR so
    that a source checkout without a built _C is never picked up instead."""
    import os

    import dpcore

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(dpcore.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH", "")]))
    return env


TESTS_DIR = __import__("os").path.dirname(__import__("os").path.abspath(__file__))


@pytest.fixture
def world_of_one() -> Any:
    """A one-process gloo group (the default group) for the duration of a test."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
