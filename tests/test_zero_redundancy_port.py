"""torch's own tests of ZeroRedundancyOptimizer, ported to dpcore.ShardedOptimizer in one process.

Source: pytorch/pytorch, test/distributed/optim/test_zero_redundancy_optimizer.py (commit 0807990db8a3), the
single-rank class TestZeroRedundancyOptimizerSingleRank and the parity tests of
TestZeroRedundancyOptimizerDistributed. A world of W ranks is a list of W CPU devices, ``devices=["cpu"] * W``
(or a dpcore.DataParallel over it where DDP wrapped the model); torch's ``o.optim`` (the one local optimizer)
is ``o.state`` / ``o._shards[k].optimizer`` here. Where dpcore differs, the test says how:
- ``step(closure)`` needs a callable or None (torch hands ``step(0)``'s 0 on to the inner optimizer);
- parameters of mixed dtypes are accepted (ZeRO refuses them), each shard bucketed per dtype;
- a parameter listed twice is an error (torch's optimizer warns and steps it twice);
- placement balances the bytes of trainable parameters (ZeRO's counts every element), so the sharding tests
  make theirs trainable;
- not ported: the Join hook and uneven inputs (several processes), model parallelism (dpcore's master
  parameters all live on the first device) and ``overlap_with_ddp=True`` (a DDP communication hook), which is
  an error naming it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import SGD, AdamW

import dpcore
from conftest import CPU_PARAMS

TOL = {"atol": 1e-10, "rtol": 0.0}


def _sharded(params: Any, cls: type[torch.optim.Optimizer], world: int = 2, **kwargs: Any) -> dpcore.ShardedOptimizer:
    return dpcore.ShardedOptimizer(params, cls, devices=["cpu"] * world, **kwargs)


# ---------------------------------------------------------------------------
# TestZeroRedundancyOptimizerSingleRank
# ---------------------------------------------------------------------------


def test_state_dict() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    o = _sharded([x], SGD, lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    assert torch.equal(x, torch.tensor([0.9]))
    assert torch.equal(o.state[x]["momentum_buffer"], torch.tensor([1.0]))
    o.zero_grad()
    o.consolidate_state_dict(to=0)
    state_dict = o.state_dict()
    assert {"param_groups", "state"} <= state_dict.keys()
    group = state_dict["param_groups"][0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"], group["dampening"]) == (
        0.1,
        0.9,
        False,
        0.0,
        0.0,
    )
    assert all(group[k] == o.param_groups[0][k] for k in group if k != "params")
    o = _sharded([x], SGD, lr=0.01)
    o.load_state_dict(state_dict)
    assert torch.equal(o.state[x]["momentum_buffer"], torch.tensor([1.0]))
    assert o.param_groups[0]["lr"] == 0.1  # the checkpoint's, in param_groups and in the shard that steps
    x.backward()
    o.step()
    torch.testing.assert_close(x, torch.tensor([0.71]))
    torch.testing.assert_close(o.state[x]["momentum_buffer"], torch.tensor([1.9]))
    assert o.param_groups[0]["params"][0].device == x.device


def test_lr_scheduler() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    x2 = torch.tensor([1.0], requires_grad=True)
    o = _sharded([x], SGD, lr=0.01)
    o2 = SGD([x2], lr=0.01)
    s = torch.optim.lr_scheduler.StepLR(o, 1)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1)
    for _ in range(5):
        for p, opt, sched in ((x, o, s), (x2, o2, s2)):
            p.backward()
            opt.zero_grad()
            opt.step()
            sched.step()
        assert torch.equal(x, x2)


class SGDWithStepKWArg(SGD):
    def step(self, closure: Any = None, kwarg: Any = None) -> None:  # type: ignore[override]
        super().step()
        kwarg.append(5)


def test_step_with_kwargs() -> None:
    kwarg: list[Any] = []
    x = torch.tensor([1.0], requires_grad=True)
    o = _sharded([x], SGDWithStepKWArg, lr=0.1)
    x.backward()
    o.step(kwarg=kwarg)
    assert kwarg == [5]
    assert torch.equal(x, torch.tensor([0.9]))
    # dpcore: each shard with a gradient steps once, with the keyword arguments
    y = torch.tensor([2.0], requires_grad=True)
    o = _sharded([x, y], SGDWithStepKWArg, lr=0.1)
    assert o.shard_of(x) != o.shard_of(y)
    (x + y).backward()
    o.step(None, kwarg=kwarg)
    assert kwarg == [5, 5, 5]
    # dpcore: torch's test passes step(0, kwarg=...), and ZeRO hands the 0 on as the closure
    with pytest.raises(TypeError, match="closure: expected a callable that returns the loss, or None, but got 0"):
        o.step(0, kwarg=kwarg)  # type: ignore[arg-type]


class SGDWithNewKey(SGD):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        super().step()
        self.param_groups[0]["new_key"] = 0.1


def test_step_with_extra_inner_key() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    o = _sharded([x], SGDWithNewKey, lr=0.1)
    x.backward()
    o.step()
    assert o.param_groups[0]["new_key"] == 0.1
    assert torch.equal(x, torch.tensor([0.9]))
    assert o.state_dict()["param_groups"][0]["new_key"] == 0.1
    # dpcore: several shards setting one value agree; the next step gives it to every shard
    params = [torch.tensor([float(i)], requires_grad=True) for i in range(3)]
    o = _sharded(params, SGDWithNewKey, world=3, lr=0.1)
    sum(params).backward()
    o.step()
    assert o.param_groups[0]["new_key"] == 0.1
    o.param_groups[0]["new_key"] = 0.5  # an edit reaches the shards before their step, which overwrites it
    o.step()
    assert o.param_groups[0]["new_key"] == 0.1


class SGDWithCountedKey(SGD):
    """Sets a group entry from its own parameters: shards of one group disagree."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        super().step()
        self.param_groups[0]["numel"] = sum(p.numel() for p in self.param_groups[0]["params"])


def test_shards_that_set_different_group_values_name_the_entry() -> None:
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    o = _sharded(params, SGDWithCountedKey, lr=0.1)
    sum(p.sum() for p in params).backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['numel'\]: the shards' optimizers set different values"):
        o.step()


class SGDWithoutClosure(SGD):
    def step(self) -> Any:  # type: ignore[override]
        return super().step()


def test_step_without_closure() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    o = _sharded([x], SGDWithoutClosure, lr=0.1)
    x.backward()
    o.step()
    assert torch.equal(x, torch.tensor([0.9]))


def test_zero_grad() -> None:
    x = torch.rand(1)
    m = nn.Linear(1, 1)
    o = _sharded(m.parameters(), SGD, lr=0.01)
    m(x).backward(x)
    assert m.weight.grad is not None and m.bias.grad is not None
    o.zero_grad()
    assert m.weight.grad is None and m.bias.grad is None


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_constructor() -> None:
    m = nn.Sequential(nn.Linear(5, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    ctor_inputs: list[tuple[Any, type[Exception] | None, str]] = [
        ([], ValueError, "empty parameter list"),
        (torch.randn(1), TypeError, "params: expected an iterable of tensors or dicts, but got torch.FloatTensor"),
        (1.2, TypeError, "params: expected an iterable of tensors or dicts, but got float"),
        ([{"params": [layer.weight for layer in m]}, {"params": [layer.bias for layer in m]}], None, ""),
        ([*m.parameters(), 42], TypeError, "optimizer can only optimize Tensors"),
        (m.parameters(), None, ""),
        (list(m.parameters()), None, ""),
        # dpcore: more bad input, each naming what is wrong
        ([{"lr": 0.1}], ValueError, r"params\[0\]: a parameter group needs a 'params' entry"),
        ([m[0].weight, m[0].bias, m[0].weight], ValueError, r"params: parameter 2 .* is parameter 0 again"),
        ([{"params": [m[0].weight]}, {"params": [m[0].weight]}], ValueError, "more than one parameter group"),
    ]
    for ctor_input, error, message in ctor_inputs:
        if error is None:
            _sharded(ctor_input, SGD, lr=0.01)
            continue
        with pytest.raises(error, match=message):
            _sharded(ctor_input, SGD, lr=0.01)
    params = [
        {"params": [layer.weight for layer in m], "weight_decay": 0.0},
        {"params": [layer.bias for layer in m], "weight_decay": 0.01},
    ]
    o = _sharded(params, AdamW, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    assert len(o.param_groups) == 2
    assert all(len(shard.optimizer.param_groups) == 2 for shard in o._shards)


def test_same_dense_param_type() -> None:
    for params in (
        [torch.sparse_coo_tensor(size=(2, 3))],
        [torch.rand(1), torch.rand(1), torch.sparse_coo_tensor(size=(2, 3))],
    ):
        with pytest.raises(ValueError, match=r"params: parameter \d is sparse"):
            _sharded(params, SGD, lr=0.01)
    # dpcore: mixed dense dtypes are accepted (ZeRO refuses them), and step as the plain optimizer
    mixed = [torch.rand(3, requires_grad=True), torch.rand(2, dtype=torch.float64, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in mixed]
    o, o2 = _sharded(mixed, SGD, lr=0.1, momentum=0.9, parameters_as_bucket_view=True), SGD(ref, lr=0.1, momentum=0.9)
    for _ in range(3):
        for params, opt in ((mixed, o), (ref, o2)):
            sum(p.square().sum() for p in params).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(mixed, ref):
        assert p.dtype == q.dtype and torch.equal(p, q)


# ---------------------------------------------------------------------------
# TestZeroRedundancyOptimizerDistributed: the tests that hold in one process
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharding(world: int) -> None:
    sizes = [9, 7, 5, 3]
    params = [torch.rand(size, 1, requires_grad=True) for size in sizes * world]  # dpcore balances trainable bytes
    o = _sharded(params, SGD, world=world, lr=0.01)
    assert [sum(p.numel() for p in s.optimizer.param_groups[0]["params"]) for s in o._shards] == [sum(sizes)] * world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_add_param_group(world: int) -> None:
    sizes = [9, 7, 5, 3]
    params = [torch.rand(size, 1, requires_grad=True) for size in (sizes * world)[:-1]]
    o = _sharded(params, SGD, world=world, lr=0.01)
    assert len(o.param_groups) == 1
    o.add_param_group({"params": [torch.rand(3, 1, requires_grad=True)]})
    assert len(o.param_groups) == 2
    for shard in o._shards:
        assert sum(x.numel() for g in shard.optimizer.param_groups for x in g["params"]) == sum(sizes)
        assert len(shard.optimizer.param_groups) == 2
    # a pathological config with a first big non-trainable param
    params = [torch.rand(size, 1) for size in [100, 3, 5, 2, 6, 4]]
    for p in params[1:]:
        p.requires_grad = True
    o = _sharded(params, SGD, world=world, lr=0.01)
    o.add_param_group({"params": [torch.rand(3, 1)]})
    assert len(o.param_groups) == 2
    assert all(len(shard.optimizer.param_groups) == 2 for shard in o._shards)


@pytest.mark.parametrize("devices", CPU_PARAMS)
def test_step(devices: list[str]) -> None:
    m = nn.Linear(1, 1).double()
    with torch.no_grad():
        m.weight.fill_(1.0)
        m.bias.fill_(2.0)
    m_zero = copy.deepcopy(m)
    dp = dpcore.DataParallel(m_zero, devices)
    o, o_zero = SGD(m.parameters(), lr=0.01), dpcore.ShardedOptimizer(m_zero.parameters(), SGD, devices=dp, lr=0.01)
    x = torch.arange(1.0, len(devices) + 1, dtype=torch.float64)[:, None]  # rank r's input r + 1, one row each
    m(x).backward(x)
    dp(x).backward(x)
    o.step()
    o_zero.step()
    torch.testing.assert_close(m.weight, m_zero.weight, **TOL)
    torch.testing.assert_close(m.bias, m_zero.bias, **TOL)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_step_with_closure(bucket_view: bool) -> None:
    weight, bias, error = 1.0, 2.0, 1.0
    x = torch.tensor([1.0])
    target = torch.tensor([x.item() * weight + bias + error])
    m = nn.Linear(1, 1)
    with torch.no_grad():
        m.weight.fill_(weight)
        m.bias.fill_(bias)
    o = _sharded(m.parameters(), SGD, parameters_as_bucket_view=bucket_view, lr=0.1)
    m(x).backward(x)

    def closure() -> torch.Tensor:
        o.zero_grad()
        loss = nn.functional.l1_loss(m(x), target)
        loss.backward()
        return loss

    assert torch.equal(o.step(closure=closure), torch.tensor(error))  # type: ignore[arg-type]
    torch.testing.assert_close(m.weight, torch.tensor([[1.1]]))
    torch.testing.assert_close(m.bias, torch.tensor([2.1]))


def _three_layers(dims: tuple[int, int, int] = (5, 10, 5)) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dims[0], dims[1]), nn.Linear(dims[1], dims[1]), nn.Linear(dims[1], dims[2])).double()


@pytest.mark.parametrize("devices", CPU_PARAMS)
def test_multiple_param_groups(devices: list[str]) -> None:
    models = [_three_layers() for _ in range(3)]
    nets = [dpcore.DataParallel(models[0], devices), dpcore.DataParallel(models[1], devices), models[2]]
    optim1 = dpcore.ShardedOptimizer(
        [
            {"params": [layer.weight for layer in models[0]], "weight_decay": 0.0},
            {"params": [layer.bias for layer in models[0]]},
        ],
        AdamW,
        devices=nets[0],
        lr=0.01,
        weight_decay=0.01,
    )
    optim2 = dpcore.ShardedOptimizer(
        [layer.weight for layer in models[1]], AdamW, devices=nets[1], lr=0.01, weight_decay=0.0
    )
    optim2.add_param_group({"params": [layer.bias for layer in models[1]], "weight_decay": 0.01})
    optim3 = AdamW(
        [
            {"params": [layer.weight for layer in models[2]], "weight_decay": 0.0},
            {"params": [layer.bias for layer in models[2]]},
        ],
        lr=0.01,
        weight_decay=0.01,
    )
    for _ in range(3):
        x = torch.randn(8, 5, dtype=torch.float64)
        for net, optim in zip(nets, (optim1, optim2, optim3)):
            optim.zero_grad()
            net(x).sum().backward()
            optim.step()
        for layers in zip(*models):
            for layer in layers[:2]:
                torch.testing.assert_close(layer.weight, layers[2].weight, **TOL)
                torch.testing.assert_close(layer.bias, layers[2].bias, **TOL)


@pytest.mark.parametrize("devices", CPU_PARAMS[1:])
def test_collect_shards(devices: list[str]) -> None:
    model = nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 5))
    dp = dpcore.DataParallel(model, devices)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), SGD, devices=dp, lr=1e-3, momentum=0.99)
    inputs, target = torch.rand(3 * len(devices), 20), torch.rand(3 * len(devices), 5)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.l1_loss(dp(inputs), target)
        loss.backward()
        return loss

    optimizer.step(closure=closure)  # type: ignore[arg-type]
    optimizer.consolidate_state_dict(to=0)
    state_dict = optimizer.state_dict()
    assert len(state_dict["state"]) == len(list(model.parameters()))
    optimizer.load_state_dict(state_dict)


@pytest.mark.parametrize("devices", CPU_PARAMS[1:])
@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("bucket_view", [False, True])
def test_local_optimizer_parity(
    devices: list[str], optimizer_class: type[torch.optim.Optimizer], maximize: bool, bucket_view: bool
) -> None:
    """The wrapper with a ShardedOptimizer against the bare module with the plain optimizer (torch: DDP with ZeRO
    against DDP with a local optimizer), trainability changing in the second half, then state dicts cross-loaded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3)).double()
    model.test_buffer = nn.Buffer(torch.ones(1, dtype=torch.float64))
    local_model = copy.deepcopy(model)
    defaults = {"maximize": True} if maximize else {}
    sharded_model = dpcore.DataParallel(model, devices)
    sharded_optimizer = dpcore.ShardedOptimizer(
        model.parameters(),
        optimizer_class,
        devices=sharded_model,
        parameters_as_bucket_view=bucket_view,
        lr=1e-3,
        **defaults,
    )
    local_optimizer = optimizer_class(local_model.parameters(), lr=1e-3, **defaults)
    g = torch.Generator().manual_seed(1)

    def check_step() -> None:
        x = torch.rand(64, 2, generator=g, dtype=torch.float64)
        losses = []
        for net, optim in ((local_model, local_optimizer), (sharded_model, sharded_optimizer)):

            def closure(net: nn.Module = net, optim: torch.optim.Optimizer = optim) -> torch.Tensor:
                optim.zero_grad()
                loss = net(x).abs().sum()
                loss.backward()
                return loss

            losses.append(optim.step(closure=closure))  # type: ignore[arg-type]
        torch.testing.assert_close(losses[0], losses[1], **TOL)
        for p, q in zip(model.parameters(), local_model.parameters()):
            torch.testing.assert_close(p, q, **TOL)
        for b, c in zip(model.buffers(), local_model.buffers()):
            torch.testing.assert_close(b, c, **TOL)

    for i in range(20):
        check_step()
        if i > 10:
            next(model.parameters()).requires_grad = bool(i % 2)
            next(local_model.parameters()).requires_grad = bool(i % 2)
    # state_dict() references the live state tensors, and a load may keep them (same device and dtype): torch's
    # test reloads the sharded one live after more steps, under atol=1e-3; here each is a copy, at 1e-10
    local_state, sharded_state = (
        copy.deepcopy(local_optimizer.state_dict()),
        copy.deepcopy(sharded_optimizer.state_dict()),
    )
    local_optimizer.load_state_dict(copy.deepcopy(sharded_state))
    sharded_optimizer.load_state_dict(copy.deepcopy(local_state))
    check_step()
    local_optimizer.load_state_dict(local_state)
    sharded_optimizer.load_state_dict(sharded_state)
    check_step()


def test_overlap_with_ddp_and_bucket_view_flags() -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"overlap_with_ddp: .*DDP's communication hook.* pass overlap_with_ddp=False"):
        _sharded(m.parameters(), SGD, lr=0.1, overlap_with_ddp=True)
    for flag in ("overlap_with_ddp", "parameters_as_bucket_view"):
        with pytest.raises(TypeError, match=f"{flag}: expected True or False, but got 1"):
            _sharded(m.parameters(), SGD, lr=0.1, **{flag: 1})
    o = _sharded(m.parameters(), SGD, lr=0.1, overlap_with_ddp=False, parameters_as_bucket_view=False)
    assert o.parameters_as_bucket_view is False
