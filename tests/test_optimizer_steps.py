"""Every optimizer step reaches the replicas: fused optimizers (whose kernels
bump no version counter), optimizers writing ``p.data`` inside ``step()``,
optimizers created before and after the wrapper; writes no hook can see are
covered by ``DataParallel.mark_parameters_changed()`` (and else found by the
check of tests/test_stale_parameters.py, with a warning). Each case is
compared in float64 against the same training on one device."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import dpcore
from conftest import CUDA_PARAMS

STEPS = 6


def _model(device: str | torch.device = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double().to(device)


def _batches(device: str | torch.device = "cpu", n: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(n, 5, generator=g, dtype=torch.float64).to(device),
            torch.randn(n, 3, generator=g, dtype=torch.float64).to(device),
        )
        for _ in range(STEPS)
    ]


class DataWritingSGD(torch.optim.Optimizer):
    """A LARS-style custom optimizer: updates through ``p.data``, which bumps
    no version counter."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = 1.0 / (1.0 + p.data.norm().item())
                    p.data.add_(p.grad, alpha=-group["lr"] * trust)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "data_writing": lambda ps: DataWritingSGD(ps, lr=1e-1),
}


def _train(model: nn.Module, net: nn.Module, opt: torch.optim.Optimizer, batches) -> list[torch.Tensor]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _reference(make_opt, device="cpu") -> tuple[list[torch.Tensor], nn.Module]:
    model = _model(device)
    losses = _train(model, model, make_opt(list(model.parameters())), _batches(device))
    return losses, model


def _assert_equal(model: nn.Module, ref: nn.Module, losses, ref_losses) -> None:
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9, msg=f"parameter {name}")


def test_a_fused_step_bumps_no_version_counter() -> None:
    """The premise: without dpcore's hook a fused step is invisible to version
    counters (so a refresh that trusts them alone would skip it)."""
    p = nn.Parameter(torch.ones(3, dtype=torch.float64))
    p.grad = torch.ones(3, dtype=torch.float64)
    before = p._version
    torch.optim.AdamW([p], lr=0.1, fused=True).step()
    assert not torch.equal(p.detach(), torch.ones(3, dtype=torch.float64))
    # Without a live replica cache tracking p, no version bump happens.
    assert p._version == before


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("created", ["before", "after"])
def test_steps_reach_every_replica(name: str, k: int, created: str) -> None:
    make_opt = OPTIMIZERS[name]
    ref_losses, ref = _reference(make_opt)
    model = _model()
    if created == "before":
        opt = make_opt(list(model.parameters()))
        dp = dpcore.DataParallel(model, ["cpu"] * k)
    else:
        dp = dpcore.DataParallel(model, ["cpu"] * k)
        opt = make_opt(list(model.parameters()))
    losses = _train(model, dp, opt, _batches())
    _assert_equal(model, ref, losses, ref_losses)


def test_tracked_parameters_are_bumped_only_by_their_optimizer() -> None:
    """Only the stepping optimizer's tracked parameters are marked changed:
    another model's parameters keep their version, and a frozen parameter
    the optimizer does not hold is not copied again."""
    model = _model()
    model[0].bias.requires_grad_(False)
    other = nn.Linear(2, 2).double()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2, fused=True)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, fused=True)
    x = torch.randn(4, 5, dtype=torch.float64)
    dp(x).sum().backward()
    other(torch.randn(3, 2, dtype=torch.float64)).sum().backward()
    versions = {id(p): p._version for p in model.parameters()}
    other_versions = [p._version for p in other.parameters()]
    opt.step()
    other_opt.step()
    assert [p._version for p in other.parameters()] == other_versions
    for p in model.parameters():
        assert (p._version > versions[id(p)]) == p.requires_grad
    dp(x)
    # The frozen bias sits in a bucket of its own, which has nothing to copy.
    copied = [b.last_refresh_copied for b in dp._cache.buckets]
    assert copied.count(False) == 1 and copied.count(True) == len(copied) - 1


def test_no_step_no_copy() -> None:
    """A forward after no optimizer step copies nothing: the hook costs no
    re-broadcast on steps where nothing changed."""
    model = _model()
    dp = dpcore.DataParallel(model, ["cpu"] * 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(6, 5, dtype=torch.float64)
    dp(x).sum().backward()  # first call: everything copied
    dp(x).sum().backward()  # gradient accumulation: nothing changed
    assert not any(b.last_refresh_copied for b in dp._cache.buckets)
    opt.step()
    dp(x)
    assert all(b.last_refresh_copied for b in dp._cache.buckets)


def test_hook_stops_tracking_dead_caches() -> None:
    """A wrapper that is gone leaves no tracked tensors behind."""
    import gc

    from dpcore import _step_hook

    model = _model()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    dp(torch.randn(4, 5, dtype=torch.float64))
    assert all(id(p) in _step_hook._tracked for p in model.parameters())
    del dp
    gc.collect()
    assert not any(id(p) in _step_hook._tracked for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    versions = [p._version for p in model.parameters()]
    opt.step()
    assert [p._version for p in model.parameters()] == versions


@pytest.mark.parametrize("k", [2, 3])
def test_data_writes_outside_a_step_need_mark_parameters_changed(k: int) -> None:
    """An EMA written through ``.data`` outside any optimizer is invisible to
    version counters; ``mark_parameters_changed()`` makes it seen without a
    warning. Without it the check for unseen writes finds it, copies it
    before any call uses it, and warns naming the method."""

    def run(mark: bool, parallel: bool) -> nn.Module:
        model = _model()
        net = dpcore.DataParallel(model, ["cpu"] * k) if parallel else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        shadow = copy.deepcopy(model)
        for x, y in _batches():
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            with torch.no_grad():
                net(x)  # an evaluation: the replicas now hold the stepped weights
            for p, s in zip(model.parameters(), shadow.parameters()):
                s.data.mul_(0.5).add_(p.data, alpha=0.5)
                p.data.copy_(s.data)  # "swap in" the average through .data
            if parallel and mark:
                net.mark_parameters_changed()
        return model

    ref = run(mark=False, parallel=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        good = run(mark=True, parallel=True)
    for p, q in zip(good.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9)
    with pytest.warns(UserWarning, match=r"mark_parameters_changed\(\)"):
        found = run(mark=False, parallel=True)
    for p, q in zip(found.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9)


def test_mark_parameters_changed_without_replicas() -> None:
    """Callable before the first forward and on a single device (no cache)."""
    model = _model()
    dpcore.DataParallel(model, ["cpu"]).mark_parameters_changed()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    dp.mark_parameters_changed()
    dp(torch.randn(3, 5, dtype=torch.float64))


def test_grad_scaler_and_scheduler_steps_are_seen() -> None:
    """The step reaches the hook through GradScaler.step and an LR scheduler's
    wrapping of optimizer.step (CPU GradScaler, disabled scaling)."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)  # noqa: E731

    def run(parallel: bool) -> nn.Module:
        model = _model()
        net = dpcore.DataParallel(model, ["cpu"] * 3) if parallel else model
        opt = make(list(model.parameters()))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for x, y in _batches():
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        return model

    for p, q in zip(run(True).parameters(), run(False).parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9)


@pytest.mark.parametrize("devices", CUDA_PARAMS)
@pytest.mark.parametrize("name", ["adam_fused", "adamw_fused", "sgd_fused"])
def test_fused_steps_on_cuda(devices: list, name: str) -> None:
    make_opt = OPTIMIZERS[name]
    first = torch.device("cuda", int(devices[0]))
    ref_losses, ref = _reference(make_opt, first)
    model = _model(first)
    dp = dpcore.DataParallel(model, devices)
    losses = _train(model, dp, make_opt(list(model.parameters())), _batches(first))
    _assert_equal(model, ref, losses, ref_losses)
