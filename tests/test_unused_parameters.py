"""Parameters that a forward did not use keep ``.grad`` None, as on one device.

A parameter that no replica used (a branch skipped on this step) must come
back with ``.grad`` None (or unchanged, when gradients accumulate over
several backward passes); one used by some replicas only gets the sum of
their gradients. With zeros instead, AdamW and SGD with momentum or weight
decay move a parameter that one device would leave alone, and training
drifts (torch.nn.DataParallel gives zeros).

Each check runs float64 against the bare module on one device, over several
optimizer steps, on CPU lists (always) and on CUDA lists (skipped without a
GPU); in hybrid mode (``process_group=``) on 2 processes x 2 CPU replicas
through the harness of tests/test_distributed.py.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dpcore
from conftest import as_torch_device
from distributed_worker import Branchy
from test_cuda_graphs import stand_in_cuda  # noqa: F401 - the fixture: torch.cuda's graph API on the CPU

F64 = torch.float64
ATOL = 1e-9

#: Per step: (whether the `sometimes` branch runs, which rows flag the
#: `flagged` branch). Row blocks of a batch of 12 on 2 or 3 replicas: rows
#: 0-3 are always in replica 0's chunk, rows 8-11 always in the last
#: replica's, so the flags below reach no replica, the master only, the
#: last replica only, or every replica.
PLAN: list[tuple[bool, list[int]]] = [
    (True, list(range(12))),  # everything used: every optimizer state exists from here on
    (False, []),  # neither branch: both keep .grad None
    (True, [10]),  # flagged branch used by the last replica only (not the master)
    (False, [1, 2]),  # ... by the master (replica 0) only
    (True, []),
    (False, [0, 11]),  # ... by the first and the last replica
    (False, []),
]
STEPS = len(PLAN)
BATCH = 12


# Branchy: the model both this file and the hybrid scenario train (its
# docstring says which parameter is used when).


def _batch(step: int, flags: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 6, generator=g, dtype=F64)
    x[:, 5] = 0.0
    x[flags, 5] = 1.0
    y = torch.randn(BATCH, 3, generator=g, dtype=F64)
    return x.to(device), y.to(device)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


Optimizer = Callable[[Any], torch.optim.Optimizer]

OPTIMIZERS: list[Any] = [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1), id="AdamW"),
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05), id="SGD-momentum-wd"),
]


def _assert_same(model: nn.Module, reference: nn.Module, what: str) -> None:
    """Parameters equal to 1e-9; .grad None exactly where the reference's
    is, and equal elsewhere."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: {name}.grad should be None (as on one device), but is {p.grad}"
        else:
            assert p.grad is not None, f"{what}: {name}.grad is None, but one device has a gradient"
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=ATOL, msg=lambda m: f"{what}: {name}.grad: {m}")
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=ATOL, msg=lambda m: f"{what}: {name}: {m}")


def _models(device: torch.device) -> tuple[Branchy, Branchy]:
    torch.manual_seed(0)
    model = Branchy().to(device, F64)
    return model, copy.deepcopy(model)


def _train(devices: list[Any], make_optimizer: Optimizer, **options: Any) -> None:
    device = as_torch_device(devices[0])
    model, reference = _models(device)
    dp = dpcore.DataParallel(model, devices, **options)
    opt, opt_ref = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    for step, (use_sometimes, flags) in enumerate(PLAN[:STEPS]):
        model.use_sometimes = reference.use_sometimes = use_sometimes
        x, y = _batch(step, flags, device)
        opt.zero_grad()
        opt_ref.zero_grad()
        _loss(dp(x), y).backward()
        _loss(reference(x), y).backward()
        _assert_same(model, reference, f"step {step} after backward")
        opt.step()
        opt_ref.step()
        _assert_same(model, reference, f"step {step} after the optimizer step")
    assert model.never.grad is None


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
@pytest.mark.parametrize("bucket_bytes", [None, 64], ids=["one-bucket", "bucket-per-parameter"])
@pytest.mark.parametrize("devices", [["cpu"] * 2, ["cpu"] * 3], ids=["cpu*2", "cpu*3"])
def test_unused_parameters_train_as_on_one_device(
    devices: list[Any], bucket_bytes: int | None, make_optimizer: Optimizer
) -> None:
    """AdamW and SGD(momentum, weight_decay) over 7 steps with branches used
    on some steps only and by some replicas only: parameters and gradients
    equal one device's, ``.grad`` None exactly where one device's is
    (before the fix: zeros, which the optimizers' weight decay and momentum
    then applied)."""
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    _train(devices, make_optimizer, **options)


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
def test_unused_parameters_train_as_on_one_device_cuda(cuda_devices: list[Any], make_optimizer: Optimizer) -> None:
    _train(cuda_devices, make_optimizer)
    _train(cuda_devices, make_optimizer, bucket_bytes=64)


def _accumulate(devices: list[Any]) -> None:
    device = as_torch_device(devices[0])
    model, reference = _models(device)
    dp = dpcore.DataParallel(model, devices, bucket_bytes=64)
    # (use_sometimes, flags) of two backward passes into one .grad.
    windows = [
        [(False, []), (False, [])],  # neither used in either pass: None
        [(True, [10]), (False, [])],  # used in the first pass only: unchanged by the second
        [(False, []), (True, [0])],  # used in the second only
        [(True, [1, 11]), (True, [2])],  # both
    ]
    for step, window in enumerate(windows):
        for m in (model, reference):
            m.zero_grad()
        for micro, (use_sometimes, flags) in enumerate(window):
            model.use_sometimes = reference.use_sometimes = use_sometimes
            x, y = _batch(10 * step + micro, flags, device)
            _loss(dp(x), y).backward()
            _loss(reference(x), y).backward()
            _assert_same(model, reference, f"window {step}, pass {micro}")


@pytest.mark.parametrize("devices", [["cpu"] * 2, ["cpu"] * 3], ids=["cpu*2", "cpu*3"])
def test_gradients_accumulated_over_two_backward_passes(devices: list[Any]) -> None:
    """Two backward passes into one .grad: a parameter unused in a pass keeps
    the gradient of the other (unchanged), one unused in both stays None."""
    _accumulate(devices)


def test_gradients_accumulated_over_two_backward_passes_cuda(cuda_devices: list[Any]) -> None:
    _accumulate(cuda_devices)


@pytest.mark.parametrize("devices", [["cpu"] * 2, ["cpu"] * 3], ids=["cpu*2", "cpu*3"])
def test_autograd_grad_reports_unused_parameters_as_one_device_does(devices: list[Any]) -> None:
    """torch.autograd.grad with respect to the parameters: None for an unused
    one with ``allow_unused=True``, and without it torch's own error (before
    the fix: a zero tensor, and no error)."""
    model, reference = _models(torch.device("cpu"))
    dp = dpcore.DataParallel(model, devices)
    model.use_sometimes = reference.use_sometimes = False
    x, y = _batch(0, [10], torch.device("cpu"))  # `flagged` used by the last replica only
    grads = torch.autograd.grad(_loss(dp(x), y), list(model.parameters()), allow_unused=True)
    expected = torch.autograd.grad(_loss(reference(x), y), list(reference.parameters()), allow_unused=True)
    for (name, _), g, e in zip(model.named_parameters(), grads, expected):
        if e is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, e, rtol=0, atol=ATOL)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(_loss(reference(x), y), list(reference.parameters()))
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(_loss(dp(x), y), list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def _double_backward(devices: list[Any]) -> None:
    device = as_torch_device(devices[0])
    model, reference = _models(device)
    dp = dpcore.DataParallel(model, devices, bucket_bytes=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
    for step, (use_sometimes, flags) in enumerate(PLAN[:4]):
        model.use_sometimes = reference.use_sometimes = use_sometimes
        x, y = _batch(step, flags, device)
        for m, o in ((dp, opt), (reference, opt_ref)):
            o.zero_grad()
            xr = x.clone().requires_grad_()
            loss = _loss(m(xr), y)
            (grad_x,) = torch.autograd.grad(loss, xr, create_graph=True)
            (loss + grad_x.pow(2).sum()).backward()
        _assert_same(model, reference, f"step {step}")
        opt.step()
        opt_ref.step()
        _assert_same(model, reference, f"step {step} after the optimizer step")


@pytest.mark.parametrize("devices", [["cpu"] * 2, ["cpu"] * 3], ids=["cpu*2", "cpu*3"])
def test_double_backward_with_unused_parameters(devices: list[Any]) -> None:
    """A gradient penalty (create_graph=True, then backward through the
    gradient) with branches used by some replicas or none."""
    _double_backward(devices)


def test_double_backward_with_unused_parameters_cuda(cuda_devices: list[Any]) -> None:
    _double_backward(cuda_devices)


@pytest.mark.parametrize("devices", [["cpu"] * 2, ["cpu"] * 3], ids=["cpu*2", "cpu*3"])
def test_broadcast_input_unused_by_every_replica_keeps_grad_none(devices: list[Any]) -> None:
    """A ``dpcore.Broadcast`` tensor requiring grad: None when no replica
    used it, the sum of the users' gradients otherwise (as on one device).
    A guard, not a regression test: its broadcast node has one input, which
    either some copy used or none (then the node never runs)."""

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * scale if bool(x[:, 0].gt(100).any()) else x * 2

    dp = dpcore.DataParallel(Scaled(), devices)
    scale = torch.ones(3, dtype=F64, requires_grad=True)
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    dp(x, dpcore.Broadcast(scale)).sum().backward()
    assert scale.grad is None and x.grad is not None
    x2 = x.detach().clone()
    x2[-1, 0] = 1000.0  # the last replica (its chunk: the last 6 // n rows) uses it
    dp(x2, dpcore.Broadcast(scale)).sum().backward()
    torch.testing.assert_close(scale.grad, x2[-(6 // len(devices)) :].sum(0), rtol=0, atol=ATOL)


# -- cuda_graphs: the orchestration on the CPU stand-in of tests/test_cuda_graphs.py


def test_graph_replays_keep_unused_parameters_none(stand_in_cuda: list[str]) -> None:
    """A captured replica's backward is ``autograd.grad(..., allow_unused=True)``:
    a parameter its forward did not use has no static gradient, and no
    replica's replay hands one on, so the master's ``.grad`` stays None over
    capture and replays (the branch taken is the capture's, as for any
    attribute a replay does not read)."""
    from dpcore import _graphs
    from test_cuda_graphs import _stand_in_dp

    torch.manual_seed(0)
    model = Branchy().double()
    model.use_sometimes = False
    dp = _stand_in_dp(model, n=2)
    used = [model.trunk.weight, model.trunk.bias, model.head.weight, model.head.bias]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(_graphs.WARMUP_CALLS + 3):
            dp.zero_grad()
            x, y = _batch(step, [], torch.device("cpu"))
            _loss(dp(x), y).backward()
            assert all(p.grad is not None for p in used)
            unused = [n for n, p in model.named_parameters() if p.grad is not None and all(p is not u for u in used)]
            assert not unused, f"step {step}: unused parameters got gradients: {unused}"
    assert len(dp._graphs._entries) == 1
    assert "replay" in stand_in_cuda


# -- hybrid: 2 processes x 2 CPU replicas (gloo on loopback) -------------------


def test_hybrid_unused_parameters_as_on_one_device(tmp_path: Path) -> None:
    """``process_group=`` with 2 replicas per process, against one device on
    the global batch, over 6 steps of AdamW and of SGD(momentum,
    weight_decay): a parameter no replica of any process used stays None on
    every rank; one used by one replica of one rank (the master or the
    other replica) gets the averaged gradient on every rank; two backward
    passes accumulate. (distributed_worker.py's "unused" scenario.)"""
    from test_distributed import _logs, launch

    world = 2
    results = launch("unused", world, tmp_path)
    assert all(r is not None for r in results), _logs(tmp_path, world)
    for rank, r in enumerate(results):
        assert r is not None
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["checks"] >= 50, r
        assert r["never_grad_is_none"] is True
        for key, worst in r["worst"].items():
            assert 0.0 <= worst <= ATOL, f"rank {rank}: {key} differs from one device by {worst}"
