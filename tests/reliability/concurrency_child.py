"""Scenarios of tests/reliability/test_concurrency.py, each run in a child
process (``python concurrency_child.py SCENARIO``) so that a crash fails one
test instead of ending the run. A scenario prints "ok ..." when every check
passed; a failed check raises (non-zero exit status, traceback on stderr).

Every scenario runs on CPU device lists with two intra-op threads, so that
the worker pool runs at most two replicas at once on any machine.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore import _C
from dpcore.parallel_apply import start_parallel_apply
from dpcore.replicate import ReplicaCache

F64 = torch.float64
DEVICES = ["cpu"] * 4
BATCH = 8  # two rows per replica
INPUTS = 16  # distinct inputs the threads cycle through


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3)).to(F64)


def _inputs(count: int = INPUTS, rows: int = BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 12, dtype=F64, generator=g) for _ in range(count)]


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).sum()


class Reference:
    """Single-device outputs and parameter gradients of a copy of `module`."""

    def __init__(self, module: nn.Module, inputs: list[torch.Tensor]) -> None:
        ref = copy.deepcopy(module)
        params = list(ref.parameters())
        self.outputs: list[torch.Tensor] = []
        self.grads: list[list[torch.Tensor]] = []
        for x in inputs:
            y = ref(x)
            self.outputs.append(y.detach())
            self.grads.append([g.detach() for g in torch.autograd.grad(_loss(y), params)])


def _run_threads(count: int, body: Callable[[int], None], timeout: float = 120.0) -> None:
    """Runs body(t) on `count` threads started together; re-raises the first
    failure; fails if a thread has not finished within `timeout` seconds."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def target(t: int) -> None:
        try:
            start.wait()
            body(t)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(t,), daemon=True) for t in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), f"threads still running after {timeout} s (deadlock?)"
    if errors:
        raise errors[0]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------
# Many threads, one DataParallel
# ---------------------------------------------------------------------------


def threads_one_wrapper(mode: str, threads: int = 6, calls: int = 80) -> str:
    """`threads` threads x `calls` calls of one DataParallel in `mode`:
    forward, backward (into the master's .grad), grad (torch.autograd.grad),
    no_grad, inference, or mixed (thread t uses the mode t % 5)."""
    module = _mlp()
    dp = dpcore.DataParallel(module, DEVICES)
    inputs = _inputs()
    ref = Reference(module, inputs)
    params = list(module.parameters())
    modes = ["forward", "backward", "grad", "no_grad", "inference"]
    used: list[list[int]] = [[] for _ in range(threads)]  # inputs whose grads reached .grad

    def body(t: int) -> None:
        kind = modes[t % len(modes)] if mode == "mixed" else mode
        for i in range(calls):
            k = (7 * t + i) % INPUTS
            x = inputs[k]
            what = f"thread {t} call {i} ({kind})"
            if kind == "no_grad":
                with torch.no_grad():
                    y = dp(x)
                assert y.grad_fn is None, what
            elif kind == "inference":
                with torch.inference_mode():
                    y = dp(x)
                assert y.is_inference(), what
            else:
                y = dp(x)
                assert y.requires_grad, what
            _close(y.detach() if y.requires_grad else y, ref.outputs[k], what)
            if kind == "backward":
                _loss(y).backward()
                used[t].append(k)
            elif kind == "grad":
                grads = torch.autograd.grad(_loss(y), params)
                for p, (g, e) in enumerate(zip(grads, ref.grads[k])):
                    _close(g, e, f"{what} parameter {p}")

    started = time.perf_counter()
    _run_threads(threads, body)
    elapsed = time.perf_counter() - started
    backward_calls = [k for ks in used for k in ks]
    for p, param in enumerate(params):
        if not backward_calls:
            assert param.grad is None, f"parameter {p} got a .grad without any backward"
            continue
        expected = torch.stack([ref.grads[k][p] for k in backward_calls]).sum(0)
        torch.testing.assert_close(param.grad, expected, rtol=1e-9, atol=1e-9)
    return f"{threads * calls} calls in {elapsed:.2f} s, {len(backward_calls)} backward"


class RaisesOnMarker(nn.Module):
    """A linear layer whose forward raises ValueError when its input holds
    the marker value (so that a chosen replica raises)."""

    MARKER = 1e9

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(12, 3).to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == self.MARKER).any()):
            raise ValueError("marker found")
        return self.linear(x)


def threads_with_a_raising_replica(threads: int = 6, calls: int = 90) -> str:
    """Every third call of each thread has one replica (chosen by the thread)
    raise; the others are forward+autograd.grad calls checked against the
    single-device results."""
    module = RaisesOnMarker()
    dp = dpcore.DataParallel(module, DEVICES)
    inputs = _inputs()
    ref = Reference(module, inputs)
    params = list(module.parameters())
    raised = [0] * threads

    def body(t: int) -> None:
        replica = t % len(DEVICES)
        for i in range(calls):
            k = (5 * t + i) % INPUTS
            what = f"thread {t} call {i}"
            if i % 3 == 2:
                x = inputs[k].clone()
                x[2 * replica, 0] = RaisesOnMarker.MARKER  # rows 2r, 2r+1 go to replica r
                try:
                    dp(x)
                except ValueError as e:
                    assert str(e) == "marker found", what
                    notes = getattr(e, "__notes__", [])
                    assert any(f"raised in replica {replica} on device cpu" in n for n in notes), (what, notes)
                    raised[t] += 1
                    continue
                raise AssertionError(f"{what}: expected replica {replica} to raise ValueError")
            y = dp(inputs[k])
            _close(y.detach(), ref.outputs[k], what)
            for p, (g, e) in enumerate(zip(torch.autograd.grad(_loss(y), params), ref.grads[k])):
                _close(g, e, f"{what} parameter {p}")

    _run_threads(threads, body)
    assert raised == [calls // 3] * threads, raised
    return f"{sum(raised)} raising calls"


class Outer(nn.Module):
    """A model with a DataParallel inside (replicated by an outer one)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(12, 16).to(F64)
        self.inner = dpcore.DataParallel(nn.Sequential(nn.Tanh(), nn.Linear(16, 3)).to(F64), ["cpu"] * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


def threads_nested_wrappers(threads: int = 4, calls: int = 60) -> str:
    """A DataParallel nested in a model replicated by another one, called from
    several threads: each replica of the inner wrapper keeps its own cache
    and lock; forward and autograd.grad match the single-device ones."""
    model = Outer()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    inputs = _inputs()
    plain = Outer()
    plain.inner = plain.inner.module  # the same computation without wrappers
    plain.load_state_dict(model.state_dict())
    ref = Reference(plain, inputs)
    params = list(model.parameters())

    def body(t: int) -> None:
        for i in range(calls):
            k = (3 * t + i) % INPUTS
            what = f"thread {t} call {i}"
            y = dp(inputs[k])
            _close(y.detach(), ref.outputs[k], what)
            for p, (g, e) in enumerate(zip(torch.autograd.grad(_loss(y), params), ref.grads[k])):
                _close(g, e, f"{what} parameter {p}")

    _run_threads(threads, body)
    replicas = dp._cache.replica_modules[0]
    inner_replica = next(m for m in replicas if isinstance(m, dpcore.DataParallel))
    assert inner_replica is not model.inner
    assert inner_replica._calls is not model.inner._calls, "a replica shares its master's lock"
    assert inner_replica._cache is not model.inner._cache, "a replica shares its master's replica cache"
    return f"{threads * calls} nested calls"


# ---------------------------------------------------------------------------
# The replica cache and its C++ buffers used directly
# ---------------------------------------------------------------------------


def threads_replica_cache(threads: int = 6, calls: int = 100) -> str:
    """ReplicaCache.replicas() from several threads at once: no crash, and
    every returned replica holds the master's values."""
    module = _mlp()
    cache = ReplicaCache(module, [torch.device(d) for d in DEVICES])
    expected = [t.detach().clone() for t in module.parameters()]

    def body(t: int) -> None:
        for i in range(calls):
            with torch.no_grad():
                replicas = cache.replicas(len(DEVICES))
                for r, replica in enumerate(replicas[1:], 1):
                    for p, (a, e) in enumerate(zip(replica.parameters(), expected)):
                        _close(a, e, f"thread {t} call {i} replica {r} parameter {p}")

    _run_threads(threads, body)
    return f"{threads * calls} refreshes"


def threads_bucket_refresh(threads: int = 6, calls: int = 300) -> str:
    """ReplicaBuffers.refresh (C++, GIL released) from several threads while
    the master tensors' versions change (every call of thread 0 bumps one,
    forcing a copy): each result equals the master, and copies of earlier
    calls are marked modified whenever a refresh wrote their entry."""
    torch.manual_seed(0)
    masters = [torch.randn(n, dtype=F64) for n in (5, 7, 3)]
    values = [m.clone() for m in masters]
    bucket = _C.ReplicaBuffers(masters, [torch.device("cpu")] * 3)
    copies = bucket.refresh(masters)  # device-major: tensor j on device d at d * 3 + j
    first_versions = [c._version for c in copies]

    def body(t: int) -> None:
        for i in range(calls):
            if t == 0:
                masters[i % 3].add_(0.0)  # same values, new version: the next refresh copies
            flat = bucket.refresh(masters)
            assert len(flat) == 9
            result = [flat[d * 3 : d * 3 + 3] for d in range(3)]
            for d, group in enumerate(result):
                for j, (a, e) in enumerate(zip(group, values)):
                    _close(a, e, f"thread {t} call {i} device {d} tensor {j}")

    _run_threads(threads, body)
    bumped = [c._version > v for c, v in zip(copies, first_versions)]
    assert all(bumped), f"copies of the first refresh not marked modified by later copies: {bumped}"
    return f"{threads * calls} refreshes"


# ---------------------------------------------------------------------------
# Ctrl-C while replicas run
# ---------------------------------------------------------------------------


def _nap(seconds: float) -> None:
    """Sleeps `seconds` in 5 ms slices: Python code between slices, as a model
    runs many short operations (an interrupt is delivered between two)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        time.sleep(0.005)


class Sleepy(nn.Module):
    """Records when each replica starts, and when it ends, with the tag it was
    called under; naps `nap` seconds in between (see _nap)."""

    def __init__(self, log: list[tuple[str, str, int, float]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(12, 3).to(F64)
        self.nap = 0.0
        self.tag = ""
        self.log = log  # shared by the replicas (a list is copied by reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tag, replica = self.tag, int(x[0, 0].item())  # replica 0 is the master, retagged meanwhile
        self.log.append((tag, "start", replica, time.perf_counter()))
        _nap(self.nap)
        out = self.linear(x)
        self.log.append((tag, "end", replica, time.perf_counter()))
        return out


def _interrupt_after(seconds: float) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()


def interrupt_data_parallel() -> str:
    """SIGINT 0.2 s into a call whose replicas nap 2 s: KeyboardInterrupt
    within 1 s; the running replicas were interrupted and had returned by
    then (nothing runs after the exception), those not yet started were
    skipped; the next call gives the single-device result."""
    log: list[tuple[str, str, int, float]] = []
    module = Sleepy(log)
    dp = dpcore.DataParallel(module, DEVICES)
    x = torch.randn(BATCH, 12, dtype=F64)
    x[:, 0] = torch.arange(BATCH, dtype=F64) // 2  # x[0, 0] of replica r's chunk is r
    expected = module(x).detach()
    log.clear()
    module.nap, module.tag = 2.0, "first"
    _interrupt_after(0.2)
    started = time.perf_counter()
    try:
        dp(x)
    except KeyboardInterrupt:
        waited = time.perf_counter() - started
    else:
        raise AssertionError("the call returned: no KeyboardInterrupt")
    assert waited < 1.0, f"KeyboardInterrupt reached the caller after {waited:.2f} s (replicas nap 2 s)"
    seen = list(log)
    time.sleep(0.5)
    assert log == seen, f"replicas still ran after the KeyboardInterrupt: {log[len(seen) :]}"
    first = [e for e in log if e[0] == "first"]
    assert sorted(e[2] for e in first if e[1] == "start") == [0, 1], f"expected replicas 0, 1 to start: {first}"
    assert not [e for e in first if e[1] == "end"], f"interrupted replicas ran to their end: {first}"
    module.nap, module.tag = 0.0, "second"
    out = dp(x)
    _close(out.detach(), expected, "the call after the interrupt")
    second = [e for e in log if e[0] == "second" and e[1] == "end"]
    assert sorted(e[2] for e in second) == [0, 1, 2, 3], second
    # And it keeps working, with autograd.
    y = dp(x)
    y.sum().backward()
    assert module.linear.weight.grad is not None
    return f"interrupt after {waited:.2f} s"


def interrupt_parallel_apply() -> str:
    """The same with parallel_apply: prompt KeyboardInterrupt, the running
    calls interrupted and finished by then, calls not yet started skipped,
    the pool usable."""
    ran: list[int] = []
    started_calls: list[int] = []

    def nap(i: int) -> int:
        started_calls.append(i)
        _nap(2.0)
        ran.append(i)
        return i

    _interrupt_after(0.2)
    started = time.perf_counter()
    run = start_parallel_apply([nap] * 4, [(i,) for i in range(4)], None, DEVICES)
    try:
        run.result()
    except KeyboardInterrupt:
        waited = time.perf_counter() - started
    else:
        raise AssertionError("the call returned: no KeyboardInterrupt")
    assert waited < 1.0, f"KeyboardInterrupt reached the caller after {waited:.2f} s"
    assert run.done and run.join(timeout=0.05) is True
    assert sorted(started_calls) == [0, 1] and ran == [], f"started {started_calls}, ran to the end {ran}"
    try:
        run.result()
    except RuntimeError as e:
        assert "skipped" in str(e), e
    except KeyboardInterrupt:
        pass  # replica 0's own interrupt: raised as the lowest failing index
    else:
        raise AssertionError("result() of a cancelled run returned")
    assert dpcore.parallel_apply([lambda i: i * 2] * 4, [(i,) for i in range(4)], None, DEVICES) == [0, 2, 4, 6]
    return f"interrupt after {waited:.2f} s"


def interrupt_twice() -> str:
    """A replica that ignores the first interrupt (catches it and naps on): a
    second SIGINT ends the wait for it; it finishes in the background and the
    next call waits for it before it touches the replicas."""
    log: list[tuple[str, str, int, float]] = []

    class Stubborn(Sleepy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                return super().forward(x)
            except KeyboardInterrupt:
                _nap(1.5)
                self.log.append((self.tag, "stubborn", int(x[0, 0].item()), time.perf_counter()))
                raise

    module = Stubborn(log)
    dp = dpcore.DataParallel(module, DEVICES)
    x = torch.randn(BATCH, 12, dtype=F64)
    x[:, 0] = torch.arange(BATCH, dtype=F64) // 2
    expected = module(x).detach()
    module.nap, module.tag = 2.0, "first"
    _interrupt_after(0.2)
    _interrupt_after(0.5)
    started = time.perf_counter()
    try:
        dp(x)
    except KeyboardInterrupt:
        waited = time.perf_counter() - started
    else:
        raise AssertionError("the call returned: no KeyboardInterrupt")
    assert 0.4 < waited < 1.2, f"the second interrupt ended the wait after {waited:.2f} s"
    module.nap, module.tag = 0.0, "second"
    out = dp(x)
    done = time.perf_counter() - started
    _close(out.detach(), expected, "the call after the interrupts")
    assert done >= 1.5, f"the next call did not wait for the stubborn replicas ({done:.2f} s)"
    assert sorted(e[2] for e in log if e[1] == "stubborn") == [0, 1], log
    return f"second interrupt after {waited:.2f} s, next call at {done:.2f} s"


class SlowBatchNorm(nn.Module):
    """Many short operations around a BatchNorm (so an interrupt can land on
    either side of the running-statistics update)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 6).to(F64)
        self.bn = nn.BatchNorm1d(6).to(F64)
        self.steps = 60

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            x = torch.tanh(x * 1.001)
            time.sleep(0.001)
        x = self.bn(self.linear(x))
        for _ in range(self.steps):
            x = x * 0.999
            time.sleep(0.001)
        return x


def _interrupt_training(net: nn.Module, x: torch.Tensor, after: float) -> float:
    """Trains on `x` until SIGINT (sent `after` seconds in) stops it; returns
    the seconds from the signal to the KeyboardInterrupt."""
    sent: list[float] = []

    def fire() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(after, fire).start()
    try:
        while True:
            net(x).pow(2).mean().backward()
    except KeyboardInterrupt:
        return time.perf_counter() - sent[0]


def interrupt_leaves_module_alone() -> str:
    """Ctrl-C in a notebook: once KeyboardInterrupt reaches the caller,
    nothing dpcore started still reads or writes the user's module (its state
    right after the exception equals its state later), the latency is about
    that of the bare module, and training resumed from its state_dict
    equals one device."""
    devices = ["cpu"] * 3
    x = torch.randn(9, 6, dtype=F64, generator=torch.Generator().manual_seed(2))
    bare = SlowBatchNorm()
    single = max(_interrupt_training(bare, x, after) for after in (0.15, 0.33))
    worst = 0.0
    for after in (0.15, 0.27, 0.33, 0.41):
        module = SlowBatchNorm()
        dp = dpcore.DataParallel(module, devices)
        worst = max(worst, _interrupt_training(dp, x, after))
        right_after = {k: v.clone() for k, v in module.state_dict().items()}
        grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
        time.sleep(0.4)
        for k, v in module.state_dict().items():
            assert torch.equal(v, right_after[k]), f"{k} changed after the KeyboardInterrupt (interrupt at {after} s)"
        for p, g in zip(module.parameters(), grads):
            assert (p.grad is None and g is None) or torch.equal(p.grad, g), "a gradient changed after the interrupt"
    assert worst < single + 0.25, f"interrupt latency {worst:.3f} s under dpcore, {single:.3f} s on one device"
    # Training resumed from the interrupted module's state equals one device.
    module.steps = 1
    state = copy.deepcopy(module.state_dict())
    ref, resumed = SlowBatchNorm(), SlowBatchNorm()
    ref.steps = resumed.steps = 1
    ref.load_state_dict(state)
    resumed.load_state_dict(state)
    dp = dpcore.DataParallel(resumed, devices, sync_batchnorm=True)  # batch statistics of the whole batch
    for net in (ref, dp):
        model = ref if net is ref else resumed
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    for (k, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        if a.is_floating_point():
            _close(b, a, k)
        else:
            assert torch.equal(a, b), k
    return f"latency {worst:.3f} s (one device {single:.3f} s)"


def interrupt_at_exit() -> str:
    """An uncaught KeyboardInterrupt while replicas run: the running ones are
    interrupted (each says so), those not started never run, and the
    interpreter ends as killed by SIGINT, not by a crash (checked by the
    parent)."""

    def nap(i: int) -> int:
        try:
            _nap(1.0)
        except KeyboardInterrupt:
            sys.stdout.write(f"replica {i} interrupted\n")  # one write: lines from two threads never interleave
            sys.stdout.flush()
            raise
        sys.stdout.write(f"replica {i} finished\n")
        sys.stdout.flush()
        return i

    _interrupt_after(0.2)
    dpcore.parallel_apply([nap] * 4, [(i,) for i in range(4)], None, DEVICES)
    return "unreachable"


SCENARIOS: dict[str, Callable[[], str]] = {
    "forward": lambda: threads_one_wrapper("forward"),
    "backward": lambda: threads_one_wrapper("backward"),
    "grad": lambda: threads_one_wrapper("grad"),
    "no_grad": lambda: threads_one_wrapper("no_grad"),
    "inference": lambda: threads_one_wrapper("inference"),
    "mixed": lambda: threads_one_wrapper("mixed", threads=8, calls=60),
    "raising": threads_with_a_raising_replica,
    "nested": threads_nested_wrappers,
    "replica_cache": threads_replica_cache,
    "bucket_refresh": threads_bucket_refresh,
    "interrupt_data_parallel": interrupt_data_parallel,
    "interrupt_parallel_apply": interrupt_parallel_apply,
    "interrupt_twice": interrupt_twice,
    "interrupt_leaves_module_alone": interrupt_leaves_module_alone,
    "interrupt_at_exit": interrupt_at_exit,
}


def main(argv: list[str]) -> Any:
    # Python leaves SIGINT ignored where its parent ignored it (a test run
    # started in the background by a non-interactive shell): these scenarios
    # are about Ctrl-C, so they install Python's own handler whatever the
    # parent did.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(2)
    name = argv[1]
    started = time.perf_counter()
    detail = SCENARIOS[name]()
    print(f"ok {name}: {detail} ({time.perf_counter() - started:.2f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv)
