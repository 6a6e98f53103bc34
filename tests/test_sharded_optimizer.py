"""dpcore.ShardedOptimizer: each position of the device list keeps and steps
the state of a shard of the parameters. Every training run here is compared
in float64, after 20 steps, with the plain optimizer on one device (uneven
shards, a frozen parameter, a group without weight decay): schedulers,
GradScaler, clipping, accumulation, closures, checkpoints both ways. On
CPU lists the placement is bookkeeping; the path of shards that step copies
on their own device (CUDA lists of several GPUs) runs here too, forced on
the CPU, and on CUDA lists where a GPU is present."""

from __future__ import annotations

import copy
import functools
import gc
import io
import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

import dpcore
from dpcore import _step_hook, sharded_optimizer
from dpcore.replicate import ReplicaCache
from conftest import CPU_PARAMS, CUDA_PARAMS

STEPS = 20
TOL = 1e-10

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd_fused": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01, "fused": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 5e-2, "weight_decay": 0.01}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "weight_decay": 0.01}),
}


def _model(device: str | torch.device = "cpu") -> nn.Module:
    """Uneven layers (the shards cannot be equal), one frozen bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 17), nn.Tanh(), nn.Linear(17, 9), nn.Tanh(), nn.Linear(9, 3))
    model[2].bias.requires_grad_(False)
    return model.double().to(device)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weights with the default weight decay, biases without."""
    params = dict(model.named_parameters())
    return [
        {"params": [p for n, p in params.items() if n.endswith("weight")]},
        {"params": [p for n, p in params.items() if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _batches(device: str | torch.device = "cpu", n: int = 13) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(n, 5, generator=g, dtype=torch.float64).to(device),
            torch.randn(n, 3, generator=g, dtype=torch.float64).to(device),
        )
        for _ in range(STEPS)
    ]


def _loss(net: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(x), y)


class Pair:
    """The same model trained twice: through dpcore.DataParallel with a
    ShardedOptimizer, and plainly on one device with the plain optimizer."""

    def __init__(self, devices: list[Any], name: str = "adamw", groups: bool = True) -> None:
        cls, kwargs = OPTIMIZERS[name]
        first = torch.device("cuda", devices[0]) if isinstance(devices[0], int) else torch.device(devices[0])
        self.model = _model(first)
        self.ref = copy.deepcopy(self.model)
        self.dp = dpcore.DataParallel(self.model, devices)
        params = _groups(self.model) if groups else self.model.parameters()
        ref_params = _groups(self.ref) if groups else self.ref.parameters()
        self.opt = dpcore.ShardedOptimizer(params, cls, devices=self.dp, **kwargs)
        self.ref_opt = cls(ref_params, **kwargs)
        self.batches = _batches(first)

    def both(self) -> list[tuple[Callable[..., Any], torch.optim.Optimizer]]:
        return [(self.dp, self.opt), (self.ref, self.ref_opt)]

    def train(self, steps: range = range(STEPS)) -> None:
        for i in steps:
            x, y = self.batches[i]
            for net, opt in self.both():
                _loss(net, x, y).backward()
                opt.step()
                opt.zero_grad()

    def assert_equal(self) -> None:
        for (name, p), q in zip(self.model.named_parameters(), self.ref.parameters()):
            torch.testing.assert_close(p, q, atol=TOL, rtol=0, msg=lambda m: f"{name}: {m}")
        _assert_state_dicts_equal(self.opt.state_dict(), self.ref_opt.state_dict())


def _assert_state_dicts_equal(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            mine = ours["state"][index][key]
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(mine.to(value.device), value, atol=TOL, rtol=0)
            else:
                assert mine == value, (index, key)


# ---------------------------------------------------------------------------
# Exact: equal to the plain optimizer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_plain_optimizer(devices: list[Any], name: str) -> None:
    pair = Pair(devices, name)
    pair.train()
    pair.assert_equal()
    # The frozen bias has state only where the plain optimizer makes it without a step (Adagrad).
    assert (pair.model[2].bias in pair.opt.state) == (pair.ref[2].bias in pair.ref_opt.state)
    if len(devices) > 1:  # every position holds state (uneven shards, but none empty)
        assert all(n > 0 for n in pair.opt.state_bytes().values())


def test_step_with_closure_returns_its_loss(devices: list[Any]) -> None:
    pair = Pair(devices, "sgd_momentum")
    for x, y in pair.batches:
        losses = []
        for net, opt in pair.both():

            def closure(net: Any = net, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
                opt.zero_grad()
                loss = _loss(net, x, y)
                loss.backward()
                return loss

            losses.append(opt.step(closure))
        torch.testing.assert_close(losses[0], losses[1], atol=TOL, rtol=0)
    pair.assert_equal()


def test_learning_rate_schedulers_reach_every_shard(devices: list[Any]) -> None:
    """OneCycleLR changes lr and the Adam betas of param_groups every step;
    a scheduler of a single group's lr changes one group only."""
    pair = Pair(devices, "adamw")
    schedulers = []
    for opt in (pair.opt, pair.ref_opt):
        schedulers.append(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[5e-2, 2e-2], total_steps=STEPS))
    for i, (x, y) in enumerate(pair.batches):
        for (net, opt), scheduler in zip(pair.both(), schedulers):
            _loss(net, x, y).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
        if i == 3:
            for opt in (pair.opt, pair.ref_opt):
                opt.param_groups[1]["weight_decay"] = 0.5  # a hand edit counts too
    assert pair.opt.param_groups[0]["lr"] != OPTIMIZERS["adamw"][1]["lr"]
    pair.assert_equal()


def test_grad_scaler_unscale_clip_and_skipped_steps(devices: list[Any]) -> None:
    """GradScaler scales the loss, unscales the masters' .grad (which
    clip_grad_norm_ then clips, whole on the first device) and skips the
    step where a gradient is inf: the sharded optimizer with it as the plain one."""
    pair = Pair(devices, "adamw")
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) for _ in range(2)]
    skipped = {4, 11}
    for i, (x, y) in enumerate(pair.batches):
        for (net, opt), scaler in zip(pair.both(), scalers):
            model = pair.model if opt is pair.opt else pair.ref
            scaler.scale(_loss(net, x, y)).backward()
            if i in skipped:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert pair.opt.state[pair.model[0].weight]["step"].item() == STEPS - len(skipped)
    pair.assert_equal()


def test_gradient_accumulation(devices: list[Any]) -> None:
    pair = Pair(devices, "adam_amsgrad")
    for i in range(0, STEPS, 2):
        for net, opt in pair.both():
            for x, y in pair.batches[i : i + 2]:
                (_loss(net, x, y) / 2).backward()
            opt.step()
            opt.zero_grad()
    pair.assert_equal()


@pytest.mark.parametrize("name", ["adamw_fused", "adagrad"])
def test_checkpoint_into_the_plain_optimizer_and_back(devices: list[Any], name: str) -> None:
    """Half the steps, then the sharded optimizer's state dict (through
    torch.save) goes into a new plain optimizer and the plain one's into a
    new sharded optimizer; both continue and still agree with a run that
    never stopped."""
    cls, kwargs = OPTIMIZERS[name]
    pair = Pair(devices, name)
    pair.train(range(STEPS // 2))
    saved = io.BytesIO()
    torch.save({"sharded": pair.opt.state_dict(), "plain": pair.ref_opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved)
    _assert_state_dicts_equal(checkpoint["sharded"], checkpoint["plain"])
    into_plain = cls(_groups(pair.ref), **kwargs)
    into_plain.load_state_dict(checkpoint["sharded"])
    into_sharded = dpcore.ShardedOptimizer(_groups(pair.model), cls, devices=pair.dp, **kwargs)
    into_sharded.load_state_dict(checkpoint["plain"])
    _assert_state_dicts_equal(into_sharded.state_dict(), into_plain.state_dict())
    pair.opt, pair.ref_opt = into_sharded, into_plain
    pair.train(range(STEPS // 2, STEPS))

    pair.assert_equal()
    straight = _model()
    straight_opt = cls(_groups(straight), **kwargs)
    for x, y in _batches():
        _loss(straight, x, y).backward()
        straight_opt.step()
        straight_opt.zero_grad()
    for p, q in zip(pair.model.parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, atol=TOL, rtol=0)


def test_load_state_dict_refuses_a_dict_of_other_groups(devices: list[Any]) -> None:
    pair = Pair(devices, "adamw")
    pair.train(range(2))
    state = pair.ref_opt.state_dict()
    one_group = dpcore.ShardedOptimizer(pair.model.parameters(), torch.optim.AdamW, devices=pair.dp)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        one_group.load_state_dict(state)
    state["state"][99] = {"step": torch.tensor(1.0)}
    with pytest.raises(ValueError, match=r"entries \[99\] belong to no parameter"):
        pair.opt.load_state_dict(state)


def test_named_parameters_and_consolidate(devices: list[Any]) -> None:
    """Groups of (name, parameter) pairs keep their names in the state dict,
    as the plain optimizer's; consolidate_state_dict() is ZeRO's call."""
    pair = Pair(devices, "adamw")
    pair.opt = dpcore.ShardedOptimizer(pair.model.named_parameters(), torch.optim.AdamW, devices=pair.dp, lr=1e-2)
    pair.ref_opt = torch.optim.AdamW(pair.ref.named_parameters(), lr=1e-2)
    pair.train(range(3))
    pair.opt.consolidate_state_dict()
    pair.opt.consolidate_state_dict(to=0)
    assert pair.opt.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in pair.model.named_parameters()]
    pair.train(range(3, 6))
    pair.assert_equal()
    with pytest.raises(ValueError, match="to: expected 0"):
        pair.opt.consolidate_state_dict(to=1)


def test_add_param_group_later(devices: list[Any]) -> None:
    """Fine-tuning: the last layer first, the rest added after 5 steps."""
    cls, kwargs = OPTIMIZERS["adamw"]
    pair = Pair(devices, "adamw")
    pair.opt = dpcore.ShardedOptimizer(pair.model[4].parameters(), cls, devices=pair.dp, **kwargs)
    pair.ref_opt = cls(pair.ref[4].parameters(), **kwargs)
    pair.train(range(5))
    pair.opt.add_param_group({"params": [*pair.model[0].parameters(), pair.model[2].weight], "lr": 3e-3})
    pair.ref_opt.add_param_group({"params": [*pair.ref[0].parameters(), pair.ref[2].weight], "lr": 3e-3})
    pair.train(range(5, STEPS))
    for p, q in zip(pair.model.parameters(), pair.ref.parameters()):
        torch.testing.assert_close(p, q, atol=TOL, rtol=0)
    _assert_state_dicts_equal(pair.opt.state_dict(), pair.ref_opt.state_dict())


def test_replicas_see_every_sharded_step(devices: list[Any]) -> None:
    """After each step (fused kernels bump no version counter), the next
    forward of the wrapper equals the module's own: no replica is stale."""
    pair = Pair(devices, "adamw_fused")
    for x, y in pair.batches[:6]:
        _loss(pair.dp, x, y).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(pair.dp(x), pair.model(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("devices", CPU_PARAMS[1:])
def test_shards_step_in_parallel_on_the_worker_pool(devices: list[Any]) -> None:
    """Every shard's optimizer steps once per step, off the caller's thread
    (the pool's workers); each steps only its own parameters."""
    pair = Pair(devices, "adamw")
    seen: list[tuple[int, int]] = []

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is not pair.ref_opt and not isinstance(optimizer, dpcore.ShardedOptimizer):
            seen.append((threading.get_ident(), sum(len(g["params"]) for g in optimizer.param_groups)))

    handle = register_optimizer_step_pre_hook(record)
    try:
        pair.train(range(1))
    finally:
        handle.remove()
    assert len(seen) == len(devices) and sum(n for _, n in seen) == 6  # one call per shard, all parameters
    assert any(ident != threading.get_ident() for ident, _ in seen)


# ---------------------------------------------------------------------------
# Memory, counted
# ---------------------------------------------------------------------------


def _equal_layers(device: str | torch.device = "cpu", layers: int = 8, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def test_state_bytes_a_quarter_each_on_four_devices() -> None:
    model = _equal_layers()
    dp = dpcore.DataParallel(model, ["cpu"] * 4)
    opt = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, lr=1e-3)
    assert opt.state_bytes() == {0: 0, 1: 0, 2: 0, 3: 0}  # Adam's state is made at the first step
    dp(torch.randn(8, 32)).sum().backward()
    opt.step()
    params = list(model.parameters())
    whole = 2 * sum(p.numel() * p.element_size() for p in params)  # exp_avg and exp_avg_sq
    steps = len(params) * torch.tensor(0.0).element_size()  # Adam's step counters
    counted = opt.state_bytes()
    assert sorted(counted) == [0, 1, 2, 3]
    assert sum(counted.values()) == whole + steps
    for n in counted.values():
        assert n == (whole + steps) // 4
    assert sorted(opt.shard_of(p) for p in params) == sorted([0, 1, 2, 3] * 4)  # 2 weights and 2 biases each
    for p in params:  # each parameter's state is in its own shard's optimizer, on the CPU here
        assert all(t.device.type == "cpu" for t in opt.state[p].values())


def test_balance_is_by_bytes_of_trainable_parameters() -> None:
    assert sharded_optimizer.balance([10, 1, 7, 3, 0], [0, 0]) == [0, 0, 1, 1, 1]
    loads = [5, 0, 0]
    assert sharded_optimizer.balance([4, 4, 4], loads) == [1, 2, 1]
    assert loads == [5, 8, 4]


def test_more_devices_than_parameters() -> None:
    model = nn.Linear(3, 1).double()
    dp = dpcore.DataParallel(model, ["cpu"] * 4)
    opt = dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=dp, lr=0.1, momentum=0.9)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x in torch.randn(5, 8, 3, dtype=torch.float64):
        for net, o in ((dp, opt), (ref, ref_opt)):
            net(x).sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(model.weight, ref.weight, atol=TOL, rtol=0)
    assert sum(n > 0 for n in opt.state_bytes().values()) == 2


# ---------------------------------------------------------------------------
# Shards that step copies on their own device (CUDA lists of several GPUs),
# forced on the CPU: every position but the first holds working copies.
# ---------------------------------------------------------------------------


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded_optimizer, "_holds_copies", lambda device, master: True)


@pytest.mark.parametrize("name", ["adamw", "adamw_fused", "sgd_momentum", "adagrad"])
@pytest.mark.parametrize("devices", CPU_PARAMS[1:])
def test_working_copies_equal_plain_optimizer(devices: list[Any], name: str, copies: None) -> None:
    pair = Pair(devices, name)
    work = [w for s in pair.opt._shards[1:] for w in s.working.values()]
    masters = {id(p) for p in pair.model.parameters()}
    assert work and all(id(w) not in masters for w in work)
    pair.train(range(STEPS // 2))
    # The masters changed outside any step (a checkpoint loaded into the
    # module): the working copies take the new values at the next step.
    with torch.no_grad():
        for p, q in zip(pair.model.parameters(), pair.ref.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    pair.train(range(STEPS // 2, STEPS))
    pair.assert_equal()
    assert all(w.grad is None for s in pair.opt._shards for w in s.working.values())  # freed after each step


def test_working_copies_are_refreshed_only_when_their_master_changed(copies: None) -> None:
    pair = Pair(["cpu"] * 2, "sgd_momentum")
    pair.train(range(2))
    shard = pair.opt._shards[1]
    master, work = shard.pairs[0]
    refreshed = []
    original = work.copy_

    def spy(*args: Any, **kwargs: Any) -> Any:
        refreshed.append(1)
        return original(*args, **kwargs)

    work.copy_ = spy  # type: ignore[method-assign]
    pair.train(range(2, 4))
    assert refreshed == []  # the step's own update of the master is no change to copy back
    with torch.no_grad():
        master.add_(1.0)
    pair.train(range(4, 5))
    assert refreshed == [1]


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_updated_shards_are_not_copied_back_to_their_own_replicas(name: str, copies: None) -> None:
    # Position k's shard writes its updated parameters into replica k's buffers as well as into the masters:
    # the next refresh sends replica k every bucket's bytes but those, so the updated shards reach the
    # replicas with no more bytes than the refresh moves without sharding; the replicas are current.
    pair = Pair(["cpu"] * 4, name)
    pair.train(range(1))  # the first call builds the replicas; the first step creates the state
    cache = pair.dp.replica_cache
    for i in range(1, 4):
        x, y = pair.batches[i]
        stepped = {id(p) for p in pair.model.parameters() if p.requires_grad}
        pair.train(range(i, i + 1))
        with torch.no_grad():
            torch.testing.assert_close(pair.dp(x), pair.model(x), atol=1e-12, rtol=0)  # refreshed, then run
        written = 0
        for bucket, masters, _ in cache._bucket_plan:
            size = sum(m.numel() * m.element_size() for m in masters)
            own = [
                sum(m.numel() * m.element_size() for m in masters if id(m) in stepped and pair.opt.shard_of(m) == k)
                for k in range(1, 4)
            ]
            changed = any(id(m) in stepped for m in masters)  # else (the frozen bias) nothing is copied
            assert bucket.last_copied_bytes == [size - b if changed else 0 for b in own]
            written += sum(own)
        assert written > 0
    pair.train(range(4, STEPS))
    pair.assert_equal()


def test_a_device_list_changed_under_the_optimizer_gets_no_writes(copies: None) -> None:
    # The shards keep the device list they were laid out on; the wrapper's replicas now cover another one, so
    # no shard writes into them (the refresh copies the updated masters) and training stays exact.
    pair = Pair(["cpu"] * 4, "adamw")
    pair.train(range(3))
    pair.dp.device_ids = ["cpu"] * 3
    pair.train(range(3, STEPS))
    assert len(pair.dp.replica_cache.devices) == 3
    x, _ = pair.batches[0]
    with torch.no_grad():
        torch.testing.assert_close(pair.dp(x), pair.model(x), atol=1e-12, rtol=0)
    pair.assert_equal()


def test_replica_cache_write_is_left_as_it_is_by_the_next_refresh() -> None:
    # ReplicaCache.write(position, [(master, value)]): the value is that position's copy of master, which the next
    # refresh leaves as it is until master changes again; the other positions are refreshed; a tensor the cache
    # does not hold is skipped; a cache made invalid by a change of structure writes nothing.
    model = _model()
    cache = ReplicaCache(model, [torch.device("cpu")] * 3)
    cache.replicas(3)
    weight = model[0].weight
    (bucket, masters) = next((b, m) for b, m, _ in cache._bucket_plan if any(t is weight for t in m))
    size = sum(t.numel() * t.element_size() for t in masters)
    with torch.no_grad():
        weight.mul_(0.5)
    cache.write(2, [(weight, weight.detach().clone()), (torch.zeros(3), torch.zeros(3))])
    replicas = cache.replicas(3)
    assert bucket.last_copied_bytes == [size, size - weight.numel() * weight.element_size()]
    for replica in replicas[1:]:
        torch.testing.assert_close(replica[0].weight, weight, atol=0, rtol=0)
    with torch.no_grad():
        weight.add_(1.0)
    cache.replicas(3)
    assert bucket.last_copied_bytes == [size, size]
    with pytest.raises(RuntimeError, match="ReplicaBuffers.write: expected a value of"):
        cache.write(1, [(weight, torch.zeros(1, dtype=weight.dtype))])
    model.add_module("extra", nn.Linear(2, 2))
    assert not cache.valid()
    cache.write(1, [(weight, torch.zeros(1, dtype=weight.dtype))])  # nothing written, so nothing to refuse


def test_the_step_hook_exempts_a_sharded_optimizer_while_it_lives() -> None:
    # Fused steps bump no version counter; the step hook bumps each of the optimizer's parameters once. A sharded optimizer
    # is exempt by registration (its shards' own steps are hooked): each master is bumped once, as by the
    # plain optimizer; a plain optimizer's class attribute exempts nothing; the registration ends with its owner.
    model = _model()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    sharded = dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=dp, lr=0.1, fused=True)

    class Marks(torch.optim.SGD):
        _marks_own_changes = True  # the attribute the hook once probed for

    x, y = _batches()[0]
    plain = [torch.optim.SGD(model.parameters(), lr=0.1, fused=True), Marks(model.parameters(), lr=0.1, fused=True)]
    for opt in (sharded, *plain):
        _loss(dp, x, y).backward()
        before = [p._version for p in model.parameters()]
        opt.step()
        assert [p._version for p in model.parameters()] == [v + 1 for v in before], type(opt)
        opt.zero_grad()
    key = id(sharded)
    assert key in _step_hook._exempt
    del sharded
    gc.collect()
    assert key not in _step_hook._exempt


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def test_bad_arguments_name_the_argument() -> None:
    model = _model()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    with pytest.raises(TypeError, match="optimizer_class: expected a torch.optim.Optimizer subclass"):
        dpcore.ShardedOptimizer(model.parameters(), "adam", devices=dp)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer_class"):
        dpcore.ShardedOptimizer(model.parameters(), torch.optim.Adam(model.parameters()), devices=dp)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer_class: a ShardedOptimizer"):
        dpcore.ShardedOptimizer(model.parameters(), dpcore.ShardedOptimizer, devices=dp)
    with pytest.raises(ValueError, match="optimizer_class: LBFGS"):
        dpcore.ShardedOptimizer(model.parameters(), torch.optim.LBFGS, devices=dp)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own check of the defaults
        dpcore.ShardedOptimizer(model.parameters(), torch.optim.Adam, devices=dp, lr=-1.0)
    other = nn.Linear(5, 17).double()
    with pytest.raises(ValueError, match=r"params: parameter 6 \(torch.float64\[17, 5\]\) is not a parameter"):
        dpcore.ShardedOptimizer([*model.parameters(), other.weight], torch.optim.Adam, devices=dp)
    with pytest.raises(TypeError, match="devices: expected a dpcore.DataParallel or a list of devices"):
        dpcore.ShardedOptimizer(model.parameters(), torch.optim.Adam, devices=nn.DataParallel(model))
    with pytest.raises(ValueError, match="devices: expected at least one device"):
        dpcore.ShardedOptimizer(model.parameters(), torch.optim.Adam, devices=[])
    with pytest.raises(TypeError, match="devices: expected a list of devices"):
        dpcore.ShardedOptimizer(model.parameters(), torch.optim.Adam, devices="cpu")  # type: ignore[arg-type]
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="params: parameter 0 is on meta, but the master parameters"):
        dpcore.ShardedOptimizer(meta.parameters(), torch.optim.Adam, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        dpcore.ShardedOptimizer([], torch.optim.Adam, devices=dp)
    opt = dpcore.ShardedOptimizer(model.parameters(), torch.optim.Adam, devices=dp)
    with pytest.raises(ValueError, match=r"param_group\['params'\]: parameter 0 .* is not a parameter"):
        opt.add_param_group({"params": [other.bias]})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    opt.param_groups[0]["params"].append(other.bias)
    with pytest.raises(ValueError, match="param_groups: a group's 'params' list was changed by hand"):
        opt.step()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(opt)


def test_device_list_without_a_wrapper_and_wrapper_without_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """devices= also takes a plain device list (the parameters on its first
    device); a wrapper that runs its module as is (no GPU and no device
    list) gives one shard, the plain optimizer's step."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)
        as_is = dpcore.DataParallel(_model())
    assert as_is.device_ids == []
    for devices in (["cpu"] * 3, as_is):
        model = devices.module if isinstance(devices, nn.Module) else _model()
        ref = copy.deepcopy(model)
        opt = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=devices, lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for x, y in _batches()[:5]:
            for net, o in ((model, opt), (ref, ref_opt)):
                _loss(net, x, y).backward()
                o.step()
                o.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=TOL, rtol=0)
        assert len(opt.state_bytes()) == (3 if isinstance(devices, list) else 1)


# ---------------------------------------------------------------------------
# Hybrid mode: each process steps the whole model, its state split over its
# own devices; torch's ZeroRedundancyOptimizer shards across the processes
# with a ShardedOptimizer as its local optimizer.
# ---------------------------------------------------------------------------


@pytest.fixture
def group_of_one() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_hybrid_wrapper_and_zero_redundancy_optimizer(group_of_one: Any) -> None:
    cls, kwargs = OPTIMIZERS["adamw"]
    for zero in (False, True):
        model = _model()
        ref = copy.deepcopy(model)
        dp = dpcore.DataParallel(model, ["cpu"] * 3, process_group=group_of_one)
        if zero:
            local = functools.partial(dpcore.ShardedOptimizer, optimizer_class=cls, devices=dp)
            opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=local, **kwargs)
        else:
            opt = dpcore.ShardedOptimizer(model.parameters(), cls, devices=dp, **kwargs)
        ref_opt = cls(ref.parameters(), **kwargs)
        for x, y in _batches():
            for net, o in ((dp, opt), (ref, ref_opt)):
                _loss(net, x, y).backward()
                o.step()
                o.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=TOL, rtol=0)
        if zero:
            opt.consolidate_state_dict()  # type: ignore[attr-defined]
        _assert_state_dicts_equal(opt.state_dict(), ref_opt.state_dict())
        if zero:  # ZeRO writes each parameter's state into its local optimizer's .state
            opt.load_state_dict(ref_opt.state_dict())
            local_opt = opt.optim  # type: ignore[attr-defined]
            assert isinstance(local_opt, dpcore.ShardedOptimizer) and len(local_opt.state) == 5
        del dp


# ---------------------------------------------------------------------------
# CUDA lists (skipped without a GPU; the tests above are their CPU counterparts)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("devices", CUDA_PARAMS)
@pytest.mark.parametrize("name", ["adamw", "adamw_fused", "sgd_momentum"])
def test_cuda_each_shards_state_on_its_own_device(devices: list[Any], name: str) -> None:
    pair = Pair(devices, name)
    pair.train()
    pair.assert_equal()
    listed = [torch.device("cuda", d) for d in devices]
    for p in pair.model.parameters():
        position = pair.opt.shard_of(p)
        for key, value in pair.opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device == listed[position], (key, position)
        assert p.device == listed[0] and p.grad is None


def test_bench_reports_both_rows_as_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpcore.bench import optimizer as bench_optimizer

    monkeypatch.setattr(bench_optimizer, "OPTIMIZERS", bench_optimizer.OPTIMIZERS[:1])
    result = bench_optimizer.run([torch.device("cpu")] * 2, quick=True, repeats=1)
    assert [row["measured"] for row in result["rows"]] == ["step", "training step"]
    for row in result["rows"]:
        assert row["sharded_ms"] > 0 and row["plain_ms"] > 0 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert row["state_bytes"][0] == row["state_bytes"][1] > 0  # 8 equal layers: half each
    assert result["env"]["load_average"] is not None


# ---------------------------------------------------------------------------
# parameters_as_bucket_view=True (ZeroRedundancyOptimizer's): each shard's
# trainable tensors are views of one flat buffer per dtype, steps unchanged
# ---------------------------------------------------------------------------


def _assert_bucketed(opt: dpcore.ShardedOptimizer) -> None:
    for shard in opt._shards:
        stepped = [w for _, w in shard.pairs]
        for dtype in {w.dtype for w in stepped}:
            mine = [w for w in stepped if w.dtype == dtype and w.requires_grad]
            storages = {w.untyped_storage().data_ptr() for w in mine}
            assert len(storages) <= 1, (shard.position, dtype)
            spans = sorted((w.storage_offset(), w.storage_offset() + w.numel()) for w in mine)
            assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]]  # back to back, from the start
            assert all(w.untyped_storage().nbytes() == spans[-1][1] * w.element_size() for w in mine)
        for w in stepped:
            if not w.requires_grad:  # a frozen one keeps its own storage
                assert all(
                    w.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for v in stepped if v is not w
                )


@pytest.mark.parametrize("forced_copies", [False, True])
def test_bucket_view_equals_plain_optimizer(
    devices: list[Any], forced_copies: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if forced_copies:
        monkeypatch.setattr(sharded_optimizer, "_holds_copies", lambda device, master: True)
    pair = Pair(devices, "adamw_foreach")
    pair.opt = dpcore.ShardedOptimizer(
        _groups(pair.model),
        torch.optim.AdamW,
        devices=pair.dp,
        parameters_as_bucket_view=True,
        lr=1e-2,
        weight_decay=0.1,
    )
    pair.ref_opt = torch.optim.AdamW(_groups(pair.ref), lr=1e-2, weight_decay=0.1)
    _assert_bucketed(pair.opt)
    pair.train(range(STEPS // 2))
    extra, ref_extra = (
        nn.Parameter(torch.ones(4, dtype=torch.float64)),
        nn.Parameter(torch.ones(4, dtype=torch.float64)),
    )
    pair.model.register_parameter("extra", extra)
    pair.ref.register_parameter("extra", ref_extra)
    pair.opt.add_param_group({"params": [extra], "lr": 0.1})
    pair.ref_opt.add_param_group({"params": [ref_extra], "lr": 0.1})
    _assert_bucketed(pair.opt)
    for i in range(STEPS // 2, STEPS):
        x, y = pair.batches[i]
        for net, opt, p in ((pair.dp, pair.opt, extra), (pair.ref, pair.ref_opt, ref_extra)):
            (_loss(net, x, y) + p.square().sum()).backward()
            opt.step()
            opt.zero_grad()
    pair.assert_equal()


def test_bucket_view_keeps_strides_and_splits_dtypes() -> None:
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    half = nn.Linear(3, 2).to(torch.bfloat16)
    params = [conv.weight, conv.bias, *half.parameters()]
    strides = [p.stride() for p in params]
    before = [p.detach().clone() for p in params]
    opt = dpcore.ShardedOptimizer(params, torch.optim.SGD, devices=["cpu"], parameters_as_bucket_view=True, lr=0.1)
    assert [p.stride() for p in params] == strides and conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    storages = [p.untyped_storage().data_ptr() for p in params]
    assert storages[0] == storages[1] and storages[2] == storages[3] and storages[0] != storages[2]
    _assert_bucketed(opt)
