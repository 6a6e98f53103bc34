"""Fault-injection scenarios, each run in a child process by test_faults.py
(``python fault_scenarios.py NAME``) so that a crash (a segfault in the
worker pool, an abort) fails the test instead of killing the test run.

Every scenario injects a failure into DataParallel on ["cpu"] * 4, checks
how it surfaces, and then checks that the worker pool is still usable: a
clean DataParallel step equals the single-device step (float64), a plain
parallel_apply works, and the process's thread count does not change.
A scenario prints "ok NAME" and exits 0 when every check passed.
"""

from __future__ import annotations

import copy
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench.soak import os_threads

F64 = torch.float64
CPU4 = ["cpu"] * 4
MARK = 1000.0  # a row whose first feature is MARK makes its replica fail
BATCH = 8  # 2 rows per replica on 4 devices: replica j holds rows 2j, 2j+1


class InjectedError(Exception):
    """A custom exception with attributes that must survive the trip."""

    def __init__(self, message: str, code: int, payload: Any) -> None:
        super().__init__(message)
        self.code = code
        self.payload = payload


def batch(fail_replica: int | None = None, seed: int = 0, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 batch; with `fail_replica`, the last row of that replica's
    chunk (of 4 equal chunks) is marked."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 5, generator=g, dtype=F64)
    y = torch.randn(rows, 3, generator=g, dtype=F64)
    if fail_replica is not None:
        x[(fail_replica + 1) * (rows // 4) - 1, 0] = MARK
    return x, y


def marked(x: torch.Tensor) -> bool:
    return bool((x[:, 0] == MARK).any())


class Model(nn.Module):
    """An MLP whose forward (or backward) fails on a marked chunk, as set by `mode`."""

    PAYLOAD = object()

    def __init__(self, mode: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked_input = marked(x)
        if marked_input:
            if self.mode == "forward":
                raise InjectedError("forward failed", code=42, payload=Model.PAYLOAD)
            if self.mode == "keyboard":
                raise KeyboardInterrupt("interrupted in a replica")
            if self.mode == "torch":
                return x @ torch.ones(4, 4, dtype=F64)  # a shape error raised inside ATen
        x = x.clamp(max=10.0)
        if self.mode == "backward" and marked_input:
            # After the first layer: the input itself needs no gradient.
            return self.net[1:](FailInBackward.apply(self.net[0](x)))
        return self.net(x)


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise InjectedError("backward failed", code=7, payload=Model.PAYLOAD)


def expect_raises(kind: type[BaseException], fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except kind as error:  # noqa: PERF203
        return error
    raise AssertionError(f"expected {kind.__name__}, but nothing was raised")


def notes(error: BaseException) -> str:
    return " | ".join(getattr(error, "__notes__", []))


class Checker:
    """A DataParallel over `model` and a single-device reference copy; checks
    that clean steps agree and that threads do not change."""

    def __init__(
        self, model: nn.Module, dp: nn.Module | None = None, rows: int = BATCH, plain: nn.Module | None = None
    ) -> None:
        """`plain`: the bare module inside `model` when `model` wraps it (its
        copy is the single-device reference); default `model` itself."""
        self.model = model
        self.rows = rows
        self.reference = copy.deepcopy(plain if plain is not None else model)
        self.dp = dp if dp is not None else dpcore.DataParallel(model, CPU4)
        self.threads: int | None = None

    def clean_step(self, seed: int = 1) -> None:
        """One forward/backward on an unmarked batch; outputs and gradients
        must equal the reference's; then the same SGD update on both."""
        x, y = batch(None, seed, self.rows)
        for m in (self.model, self.reference):
            m.zero_grad(set_to_none=True)
        out = self.dp(x)
        expected = self.reference(x)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
        nn.functional.mse_loss(out, y).backward()
        nn.functional.mse_loss(expected, y).backward()
        named, reference = list(self.model.named_parameters()), list(self.reference.parameters())
        assert len(named) == len(reference) == 4, (len(named), len(reference))
        for (name, p), q in zip(named, reference):
            assert p.grad is not None, f"{name}: no gradient"
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.reference.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
        results = dpcore.parallel_apply([lambda t, i=i: t * i for i in range(4)], [torch.ones(2)] * 4)
        assert [float(r[0]) for r in results] == [0.0, 1.0, 2.0, 3.0]

    def pool_usable(self) -> None:
        """Two clean steps; the thread count stays within two spare pools of the
        count after the first check. A run's pool goes back to the free list when
        its last lane ends, which can come after the call returned: a nested call
        made at that moment finds no free pool and makes one more (kept for
        later calls). A thread kept per call exceeds that bound within a few checks."""
        self.clean_step(seed=2)
        self.clean_step(seed=3)
        threads = os_threads()
        if self.threads is None:
            self.threads = threads
        spare = 2 * min(len(CPU4), torch.get_num_threads())  # two pools of the most lanes a run has here
        assert self.threads <= threads <= self.threads + spare, f"threads changed: {self.threads} -> {threads}"


# --------------------------------------------------------------- scenarios


def forward_exception() -> None:
    """A custom exception in one replica's forward arrives as the same
    object (type, attributes, traceback) with a note naming the replica,
    for each replica in turn; then for several at once (the lowest wins)."""
    model = Model("forward")
    check = Checker(model)
    check.pool_usable()
    for fail in range(4):
        x, _ = batch(fail)
        error = expect_raises(InjectedError, lambda: check.dp(x))
        assert type(error) is InjectedError and error.code == 42 and error.payload is Model.PAYLOAD
        assert f"replica {fail} on device cpu" in notes(error), notes(error)
        frames = [f.name for f in traceback.extract_tb(error.__traceback__)]
        assert "forward" in frames, frames
        check.pool_usable()
    x, _ = batch(3)
    x[3, 0] = MARK  # replicas 1 and 3 fail: replica 1's error is raised
    error = expect_raises(InjectedError, lambda: check.dp(x))
    assert "replica 1 on device cpu" in notes(error), notes(error)
    check.pool_usable()


def torch_error_in_replica() -> None:
    """An ATen error (c10::Error) in one replica's forward surfaces as torch's RuntimeError."""
    check = Checker(Model("torch"))
    check.pool_usable()
    x, _ = batch(2)
    error = expect_raises(RuntimeError, lambda: check.dp(x))
    assert "replica 2 on device cpu" in notes(error), notes(error)
    check.pool_usable()


def criterion_exception() -> None:
    """An exception in the criterion of one replica."""
    model = Model("none")

    def criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if bool((target[:, 0] == MARK).any()):
            raise InjectedError("criterion failed", code=3, payload=None)
        return nn.functional.mse_loss(out, target)

    check = Checker(model)
    check.pool_usable()
    loss_dp = dpcore.DataParallel(model, CPU4, criterion=criterion, criterion_reduction="mean")
    x, y = batch(None)
    y[5, 0] = MARK  # replica 2
    error = expect_raises(InjectedError, lambda: loss_dp(x, y))
    assert error.code == 3 and "replica 2" in notes(error), notes(error)
    check.pool_usable()


def backward_exception() -> None:
    """An exception in one replica's backward (a custom Function) reaches
    loss.backward() as itself; partial gradients are discarded by zero_grad
    and later steps (bucket reduction included) are right."""
    check = Checker(Model("backward"))
    check.pool_usable()
    for fail in (0, 3, 1):
        x, y = batch(fail)
        loss = nn.functional.mse_loss(check.dp(x), y)
        error = expect_raises(InjectedError, loss.backward)
        assert type(error) is InjectedError and error.code == 7 and error.payload is Model.PAYLOAD
        check.pool_usable()
    # The graph of a failed backward is gone; a new forward is needed and works.
    check.pool_usable()


def keyboard_interrupt() -> None:
    """KeyboardInterrupt in a replica reaches the caller as KeyboardInterrupt
    (torch's DataParallel turns it into a KeyError), repeatedly."""
    check = Checker(Model("keyboard"))
    check.pool_usable()
    for fail in (1, 0, 3):
        x, _ = batch(fail)
        error = expect_raises(KeyboardInterrupt, lambda: check.dp(x))
        assert type(error) is KeyboardInterrupt and f"replica {fail}" in notes(error), notes(error)
        check.pool_usable()


class Nest(nn.Module):
    """`inner` wrapped in a DataParallel on two CPU devices."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.dp = dpcore.DataParallel(inner, ["cpu"] * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dp(x)


def nested_three_deep() -> None:
    """DataParallel(Nest(Nest(model))): three levels, 4 x 2 x 2 replicas (16
    rows: 1 per innermost replica), no deadlock, equal to one device; a
    failure in one innermost replica arrives with a note from every level,
    innermost first; the pool stays usable."""
    model = Model("forward")
    nested = Nest(Nest(model))
    check = Checker(nested, dpcore.DataParallel(nested, CPU4), rows=16, plain=model)
    check.pool_usable()
    x, _ = batch(3, rows=16)  # row 15: outer replica 3, middle 1, inner 1
    error = expect_raises(InjectedError, lambda: check.dp(x))
    assert error.code == 42 and error.payload is Model.PAYLOAD
    assert len(error.__notes__) == 3, notes(error)
    assert ["replica 1 on", "replica 1 on", "replica 3 on"] == [
        n[n.index("replica") :][:12] for n in error.__notes__
    ], notes(error)
    check.pool_usable()
    for _ in range(3):
        check.clean_step(seed=5)
    check.pool_usable()


SCENARIOS: dict[str, Callable[[], None]] = {
    f.__name__: f
    for f in (
        forward_exception,
        torch_error_in_replica,
        criterion_exception,
        backward_exception,
        keyboard_interrupt,
        nested_three_deep,
    )
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in SCENARIOS:
        print(f"usage: fault_scenarios.py {{{','.join(SCENARIOS)}}}", file=sys.stderr)
        return 2
    SCENARIOS[argv[0]]()
    print(f"ok {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
