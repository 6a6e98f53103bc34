"""Tests for dpcore.parallel_apply (the persistent C++ worker pool), on CPU
device lists ["cpu"] * k, k = 1..4, and, with the same bodies, on CUDA device
lists that skip only without a GPU (the ``any_devices`` fixture of conftest).

Where torch.nn.parallel.parallel_apply would fail a test, a comment says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import pytest
import torch
from torch import nn

import dpcore
from dpcore import parallel_apply
from conftest import TESTS_DIR, as_torch_device, subprocess_env


def _devs(devices: list[Any]) -> list[torch.device]:
    return [as_torch_device(d) for d in devices]


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _run_with_timeout(fn: Any, timeout: float = 30.0) -> Any:
    """Runs fn() on a daemon thread; fails the test (instead of hanging) if
    it has not finished after `timeout` seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"did not finish within {timeout} s (deadlock?)"
    if "error" in box:
        raise box["error"]
    return box["result"]


class CustomError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
        self.payload = {"replica": code}


# ---------------------------------------------------------------------------
# Results, arguments, devices
# ---------------------------------------------------------------------------


def test_results_in_order(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    k = len(devs)

    def make(i: int) -> Any:
        def f(x: torch.Tensor, *, offset: int) -> tuple[int, torch.Tensor]:
            time.sleep(0.002 * (k - i))  # later replicas finish first
            return i, x * i + offset

        return f

    inputs = [(torch.full((2,), float(i + 1), device=d),) for i, d in enumerate(devs)]
    kwargs = [{"offset": 10 * i} for i in range(k)]
    results = parallel_apply([make(i) for i in range(k)], inputs, kwargs, devs)
    assert isinstance(results, list) and len(results) == k
    for i, (index, value) in enumerate(results):
        assert index == i
        assert value.device == devs[i]
        torch.testing.assert_close(value.cpu(), torch.full((2,), float((i + 1) * i + 10 * i)))


def test_modules_and_default_devices(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    torch.manual_seed(0)
    modules = [nn.Linear(3, 2).double().to(d) for d in devs]
    inputs = [torch.randn(4, 3, dtype=torch.float64, device=d) for d in devs]
    # A bare tensor input (not a tuple) is the single argument; devices default to the module's.
    outputs = parallel_apply(modules, inputs)
    for m, x, y in zip(modules, inputs, outputs):
        torch.testing.assert_close(y, m(x))


def test_argument_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="one input per module"):
        parallel_apply([lambda: 1, lambda: 2], [()])
    with pytest.raises(ValueError, match="one device per module"):
        parallel_apply([lambda: 1], [()], None, ["cpu", "cpu"])


def test_device_guard_and_caller_stream(cuda_devices: list[Any]) -> None:
    devs = _devs(cuda_devices)
    streams = {d.index: torch.cuda.Stream(device=d) for d in devs}

    def probe() -> tuple[int, int]:
        return torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream

    ctxs = [torch.cuda.stream(s) for s in streams.values()]
    for c in ctxs:
        c.__enter__()
    try:
        results = parallel_apply([probe] * len(devs), [()] * len(devs), None, devs)
    finally:
        for c in reversed(ctxs):
            c.__exit__(None, None, None)
    for d, (current, stream) in zip(devs, results):
        assert current == d.index
        # The caller's current stream on that device (torch's parallel_apply
        # does this too, but dpcore's C++ pool must set it itself).
        assert stream == streams[d.index].cuda_stream


# ---------------------------------------------------------------------------
# Persistent pool: no thread per call
# ---------------------------------------------------------------------------


def test_worker_threads_do_not_grow_across_calls(any_devices: list[Any]) -> None:
    # torch.nn.parallel.parallel_apply starts len(modules) new threads every call.
    devs = _devs(any_devices)
    fns = [lambda x: x + 1] * len(devs)
    inputs = [(torch.zeros(1, device=d),) for d in devs]
    for _ in range(3):  # warm-up: the pool reaches its size
        parallel_apply(fns, inputs, None, devs)
    workers, os_threads = dpcore._C.worker_thread_count(), _os_threads()
    for _ in range(100):
        out = parallel_apply(fns, inputs, None, devs)
    assert [o.item() for o in out] == [1.0] * len(devs)
    assert dpcore._C.worker_thread_count() == workers
    assert _os_threads() <= os_threads


def test_threads_do_not_grow_across_data_parallel_steps(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    model = nn.Linear(4, 2).to(devs[0])
    dp = dpcore.DataParallel(model, any_devices)
    x = torch.randn(8, 4, device=devs[0])
    for _ in range(3):
        dp(x).sum().backward()
    py_threads, os_threads, workers = threading.active_count(), _os_threads(), dpcore._C.worker_thread_count()
    for _ in range(100):
        dp(x).sum().backward()
    assert threading.active_count() <= py_threads
    assert _os_threads() <= os_threads
    assert dpcore._C.worker_thread_count() == workers


# ---------------------------------------------------------------------------
# Thread-local state reaches the workers
# ---------------------------------------------------------------------------


def _state(_: Any = None) -> dict[str, Any]:
    return {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
    }


def test_grad_mode_reaches_workers(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    k = len(devs)
    with torch.no_grad():
        states = parallel_apply([_state] * k, [()] * k, None, devs)
    assert [s["grad"] for s in states] == [False] * k
    # ... and does not stick to the (persistent) workers afterwards.
    states = parallel_apply([_state] * k, [()] * k, None, devs)
    assert [s["grad"] for s in states] == [True] * k

    def grad_of(x: torch.Tensor) -> bool:
        return (x * 2).requires_grad

    xs = [(torch.ones(2, device=d, requires_grad=True),) for d in devs]
    assert parallel_apply([grad_of] * k, xs, None, devs) == [True] * k
    with torch.no_grad():
        assert parallel_apply([grad_of] * k, xs, None, devs) == [False] * k


def test_inference_mode_reaches_workers(any_devices: list[Any]) -> None:
    # torch's parallel_apply propagates grad mode only: inference mode is lost.
    devs = _devs(any_devices)
    k = len(devs)

    def probe(x: torch.Tensor) -> tuple[bool, bool]:
        return torch.is_inference_mode_enabled(), (x + 1).is_inference()

    xs = [(torch.ones(2, device=d),) for d in devs]
    with torch.inference_mode():
        results = parallel_apply([probe] * k, xs, None, devs)
    assert results == [(True, True)] * k
    assert parallel_apply([probe] * k, xs, None, devs) == [(False, False)] * k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_reaches_workers(any_devices: list[Any], dtype: torch.dtype) -> None:
    # torch's parallel_apply re-enters autocast with the on/off flag only, so the
    # dtype falls back to the device type's default (float16 on CUDA,
    # bfloat16 on CPU): it fails for bfloat16 on CUDA and float16 on CPU.
    devs = _devs(any_devices)
    k = len(devs)
    kind = devs[0].type

    def probe(x: torch.Tensor) -> tuple[bool, torch.dtype, torch.dtype]:
        return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), (x @ x).dtype

    xs = [(torch.randn(4, 4, device=d),) for d in devs]
    with torch.autocast(kind, dtype=dtype):
        results = parallel_apply([probe] * k, xs, None, devs)
    assert results == [(True, dtype, dtype)] * k
    # Nothing sticks to the persistent workers.
    after = parallel_apply([probe] * k, xs, None, devs)
    assert [(enabled, out) for enabled, _, out in after] == [(False, torch.float32)] * k


def test_autocast_cache_flag_reaches_workers(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    k = len(devs)

    def probe() -> bool:
        return torch.is_autocast_cache_enabled()

    previous = torch.is_autocast_cache_enabled()
    try:
        torch.set_autocast_cache_enabled(False)
        assert parallel_apply([probe] * k, [()] * k, None, devs) == [False] * k
        torch.set_autocast_cache_enabled(True)
        assert parallel_apply([probe] * k, [()] * k, None, devs) == [True] * k
    finally:
        torch.set_autocast_cache_enabled(previous)


# ---------------------------------------------------------------------------
# Exceptions
# ---------------------------------------------------------------------------


def _raise_custom(i: int, raised: list[BaseException]) -> None:
    error = CustomError(f"replica {i} failed", code=i)
    raised.append(error)
    raise error


def test_exception_keeps_type_attributes_notes_and_traceback(any_devices: list[Any]) -> None:
    # torch rebuilds the exception from a string: custom attributes are lost
    # (and a constructor taking two arguments breaks the rebuild).
    devs = _devs(any_devices)
    k = len(devs)
    fail = k - 1
    raised: list[BaseException] = []

    def make(i: int) -> Any:
        def f() -> int:
            if i == fail:
                _raise_custom(i, raised)
            return i

        return f

    with pytest.raises(CustomError) as info:
        parallel_apply([make(i) for i in range(k)], [()] * k, None, devs)
    error = info.value
    assert error is raised[0]  # the same object, not a copy
    assert error.code == fail and error.payload == {"replica": fail}
    assert any(f"replica {fail} on device {devs[fail]}" in note for note in error.__notes__)
    text = "".join(traceback.format_exception(error))
    assert "_raise_custom" in text  # the worker-side frames survive
    assert f"replica {fail} failed" in text


def test_keyboard_interrupt_is_carried_as_keyboard_interrupt(any_devices: list[Any]) -> None:
    # torch turns a KeyboardInterrupt in a worker into a KeyError.
    devs = _devs(any_devices)
    k = len(devs)

    def interrupt() -> None:
        raise KeyboardInterrupt("stop")

    fns = [lambda: None] * (k - 1) + [interrupt]
    with pytest.raises(KeyboardInterrupt) as info:
        parallel_apply(fns, [()] * k, None, devs)
    assert type(info.value) is KeyboardInterrupt
    assert any(f"replica {k - 1}" in note for note in info.value.__notes__)


def test_lowest_failing_index_is_raised_and_pool_survives(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    k = len(devs)
    raised: list[BaseException] = []

    def make(i: int) -> Any:
        def f() -> int:
            if i >= 1 or k == 1:
                time.sleep(0.002 * (k - i))  # higher indices fail first
                _raise_custom(i, raised)
            return i

        return f

    for _ in range(3):
        with pytest.raises(CustomError) as info:
            parallel_apply([make(i) for i in range(k)], [()] * k, None, devs)
        expected = 0 if k == 1 else 1
        assert info.value.code == expected
        assert f"replica {expected} on device" in " ".join(info.value.__notes__)
        assert len(info.value.__notes__) == 1  # a note from this call only
    # The pool still works after failures, and grad mode was restored.
    assert parallel_apply([lambda i: (i, torch.is_grad_enabled())] * k, list(range(k)), None, devs) == [
        (i, True) for i in range(k)
    ]


def test_error_in_data_parallel_replica_names_replica() -> None:
    class FailOnSecondChunk(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x[0].item() >= 2:
                raise CustomError("bad chunk", code=int(x[0].item()))
            return x

    dp = dpcore.DataParallel(FailOnSecondChunk(), ["cpu"] * 2)
    with pytest.raises(CustomError) as info:
        dp(torch.arange(4.0))
    assert info.value.code == 2
    assert "replica 1 on device cpu" in " ".join(info.value.__notes__)
    torch.testing.assert_close(dp(torch.zeros(4)), torch.zeros(4))


# ---------------------------------------------------------------------------
# Concurrency and nesting
# ---------------------------------------------------------------------------


def test_concurrent_calls_from_two_threads(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    k = len(devs)
    start = threading.Barrier(2, timeout=30)
    box: dict[int, list[list[float]]] = {}

    def caller(tag: int) -> None:
        def f(x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.001)  # let the two threads' calls overlap
            return x + tag

        start.wait()
        results = []
        for _ in range(20):
            inputs = [(torch.full((3,), float(i), device=d),) for i, d in enumerate(devs)]
            outs = parallel_apply([f] * k, inputs, None, devs)
            results.append([o.cpu()[0].item() for o in outs])
        box[tag] = results

    threads = [threading.Thread(target=caller, args=(tag,), daemon=True) for tag in (100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "concurrent parallel_apply calls deadlocked"
    assert box[100] == [[100.0 + i for i in range(k)]] * 20
    assert box[200] == [[200.0 + i for i in range(k)]] * 20


def test_nested_parallel_apply_does_not_deadlock(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    k = len(devs)

    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def outer(x: torch.Tensor) -> list[torch.Tensor]:
        # A replica that itself runs parallel_apply (e.g. a nested DataParallel).
        return parallel_apply([inner] * k, [(x + j,) for j in range(k)], None, devs)

    def call() -> list[Any]:
        return parallel_apply(
            [outer] * k, [(torch.full((1,), float(i), device=d),) for i, d in enumerate(devs)], None, devs
        )

    results = _run_with_timeout(call, timeout=30)
    for i, inner_results in enumerate(results):
        assert [r.item() for r in inner_results] == [2.0 * (i + j) for j in range(k)]


# ---------------------------------------------------------------------------
# Pools of different widths (in a subprocess: the failure mode is a crash)
# ---------------------------------------------------------------------------

_NARROW_CALLS = """
from dpcore import parallel_apply
for width in (1, 2, 3, 4):  # one pool, used, then grown
    assert parallel_apply([lambda: 0] * width, [()] * width, None, ["cpu"] * width) == [0] * width
for _ in range(2000):  # calls with fewer tasks than the pool has threads
    assert parallel_apply([lambda: 1], [()], None, ["cpu"]) == [1]
print("survived")
"""


def test_calls_narrower_than_the_pool_do_not_crash() -> None:
    # A DataParallel whose last batch is smaller than its device count, or two
    # DataParallels over different device counts, share the pool this way.
    env = subprocess_env()
    result = subprocess.run(
        [sys.executable, "-c", _NARROW_CALLS], cwd=TESTS_DIR, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0 and "survived" in result.stdout, (
        f"exit status {result.returncode} (-11 is a segmentation fault); stderr tail: {result.stderr[-1500:]}"
    )


_TRACED = """
import sys, torch, dpcore
dp = dpcore.DataParallel(torch.nn.Linear(8, 8), ["cpu"] * 2)
x = torch.randn(4, 8)
dp(x)
sys.{hook}(lambda *args: None)
assert dp(x).shape == (4, 8)
assert dpcore.parallel_apply([lambda: 1, lambda: 2], [(), ()]) == [1, 2]
print("done")
"""


@pytest.mark.parametrize("hook", ["settrace", "setprofile"])
def test_calls_return_under_a_trace_or_profile_function(hook: str) -> None:
    """Debuggers, coverage.py and cProfile set one: a worker's finished call must leave the interpreter's eval
    breaker as it found it (clearing a pending interrupt that is not there once signalled it for good, and the
    traced thread spun on it)."""
    run = subprocess.run([sys.executable, "-c", _TRACED.format(hook=hook)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr
