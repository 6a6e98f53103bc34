"""dpcore.functional_call: torch.func.functional_call over a wrapper, data
parallel (torch refuses its DataParallel instances, which dpcore's are)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcore
from conftest import CPU_PARAMS

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 0}


def _model(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
    return nn.Sequential(nn.Linear(5, 8), norm, nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _bare(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in params.items()}


@pytest.mark.parametrize("devices", CPU_PARAMS)
@pytest.mark.parametrize("keys", ["wrapper", "module"])
def test_functional_call_equals_the_bare_module_and_its_gradients(devices: list[str], keys: str) -> None:
    model = _model()
    dp = dpcore.DataParallel(model, devices)
    named = dp.named_parameters() if keys == "wrapper" else model.named_parameters()
    params = {k: v.detach() * 1.5 for k, v in named}
    x = torch.randn(11, 5, dtype=F64)
    ref_model = _model()
    torch.testing.assert_close(
        dpcore.functional_call(dp, params, (x,)), torch.func.functional_call(ref_model, _bare(params), (x,)), **TOL
    )
    # torch.func.grad over it: the gradient of the whole batch, nothing accumulated on the module
    loss = lambda p: dpcore.functional_call(dp, p, x).pow(2).sum()  # noqa: E731
    ref_loss = lambda p: torch.func.functional_call(ref_model, p, x).pow(2).sum()  # noqa: E731
    grads, ref = torch.func.grad(loss)(params), torch.func.grad(ref_loss)(_bare(params))
    assert set(grads) == set(params)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref[k.removeprefix("module.")], **TOL)
    assert all(p.grad is None for p in model.parameters())
    # torch.autograd.grad with respect to the given tensors
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    auto = torch.autograd.grad(dpcore.functional_call(dp, leaves, (x,)).pow(2).sum(), list(leaves.values()))
    for k, g in zip(leaves, auto):
        torch.testing.assert_close(g, ref[k.removeprefix("module.")], **TOL)
    # the module's own parameters are untouched, and the next plain call uses them
    torch.testing.assert_close(dp(x), _model()(x), **TOL)


_TRANSFORMS = {
    "grad": lambda f, p, x: torch.func.grad(lambda q: f(q, x).pow(2).sum())(p),
    "grad_and_value": lambda f, p, x: torch.func.grad_and_value(lambda q: f(q, x).pow(2).sum())(p),
    "vjp": lambda f, p, x: torch.func.vjp(lambda q: f(q, x), p)[1](
        torch.linspace(-1, 1, 3 * len(x), dtype=F64).view(-1, 3)
    ),
    "grad of grad": lambda f, p, x: torch.func.grad(
        lambda q: torch.func.grad(lambda r: f(r, x).pow(3).sum())(q)["0.weight"].sum()
    )(p),
    "grad wrt input": lambda f, p, x: torch.func.grad(lambda y: f(p, y * 1.0).pow(2).sum())(x),
    "jacrev": lambda f, p, x: torch.func.jacrev(lambda q: f(q, x))(p),
    "vmap over parameters": lambda f, p, x: torch.func.vmap(lambda q: f(q, x))(
        {k: torch.stack([v, -v]) for k, v in p.items()}
    ),
    "vmap over inputs": lambda f, p, x: torch.func.vmap(lambda y: f(p, y))(torch.stack([x, x.flip(0) * 2])),
    "grad of vmap": lambda f, p, x: torch.func.grad(
        lambda q: torch.func.vmap(lambda y: f(q, y))(torch.stack([x, -x])).sum()
    )(p),
}


@pytest.mark.parametrize("devices", CPU_PARAMS)
@pytest.mark.parametrize("transform", list(_TRANSFORMS))
def test_a_fresh_wrapper_under_each_transform_equals_torch_func_on_the_bare_module(
    devices: list[str], transform: str
) -> None:
    """The wrapper's first call made under a torch.func transform builds its replicas from the real tensors
    (before, "Cannot access storage of TensorWrapper"), and equals torch.func on the bare module, as later
    calls do."""
    run = _TRANSFORMS[transform]
    x = torch.randn(len(devices) * 2 + 1, 5, dtype=F64)
    ref_model = _model()
    params = {k: v.detach() * 1.5 for k, v in ref_model.named_parameters()}
    want = run(lambda p, y: torch.func.functional_call(ref_model, p, (y,)), params, x)
    for fresh in (True, False):  # the first call, then a later one
        dp = dpcore.DataParallel(_model(), devices)
        if not fresh:
            dp(x)
        got = run(lambda p, y: dpcore.functional_call(dp, p, (y,)), params, x)
        for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
            torch.testing.assert_close(g, w, **TOL)
        assert all(p.grad is None for p in dp.parameters())
        torch.testing.assert_close(dp(x), _model()(x), **TOL)  # the module's own parameters, untouched


@pytest.mark.parametrize("devices", CPU_PARAMS)
def test_functional_call_with_a_criterion_and_buffers(devices: list[str]) -> None:
    model = _model(batchnorm=True).eval()
    criterion = nn.MSELoss()
    dp = dpcore.DataParallel(model, devices, criterion=criterion)
    state = {k: v.detach().clone() + 0.25 for k, v in model.state_dict().items() if v.is_floating_point()}
    x, y = torch.randn(9, 5, dtype=F64), torch.randn(9, 3, dtype=F64)
    ref = criterion(torch.func.functional_call(_model(batchnorm=True).eval(), state, (x,)), y)
    torch.testing.assert_close(dpcore.functional_call(dp, [state], (x, y)), ref, **TOL)


def test_functional_call_errors_and_torch_refusal() -> None:
    model = _model()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    with pytest.raises(TypeError, match="dp: expected a dpcore.DataParallel"):
        dpcore.functional_call(model, {}, torch.randn(2, 5, dtype=F64))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="stateless API"):  # torch's own check: dpcore's wrapper is torch's kind
        torch.func.functional_call(dp, dict(dp.named_parameters()), torch.randn(2, 5, dtype=F64))
    passthrough = dpcore.DataParallel(_model())  # no GPU and no list: the module as is
    x = torch.randn(4, 5, dtype=F64)
    params = {k: v.detach() * 2 for k, v in model.named_parameters()}
    torch.testing.assert_close(
        dpcore.functional_call(passthrough, params, (x,)), torch.func.functional_call(_model(), params, (x,)), **TOL
    )
