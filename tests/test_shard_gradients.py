"""DataParallel(shard_gradients=True) with dpcore.ShardedOptimizer (ZeRO-2 in one process): the backward
reduce-scatters each bucket's gradients to the positions that own them (p.grad stays None), the shards step
there and an all-gather brings the updated parameters to the module and every replica. Compared in float64,
after 20 steps, with the plain optimizer on one device; traffic and memory per position counted."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpcore
from dpcore import sharded_optimizer
from conftest import requires_cuda

STEPS = 20
TOL = {"atol": 1e-10, "rtol": 0.0}
COUNTS = [2, 3, 4]

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 5e-2, "weight_decay": 0.01}),
}


def _model() -> nn.Module:
    """Parameters of very different sizes (uneven shards), one frozen bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 40), nn.Tanh(), nn.Linear(40, 9), nn.Tanh(), nn.Linear(9, 3))
    model[2].bias.requires_grad_(False)
    return model.double()


def _even(width: int = 32, layers: int = 12) -> nn.Module:
    """Equal parameters that split evenly over 2, 3 and 4 positions."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).double()


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    named = dict(model.named_parameters())
    return [
        {"params": [p for n, p in named.items() if n.endswith("weight")]},
        {"params": [p for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _batch(step: int, rows: int = 12) -> torch.Tensor:
    return torch.randn(rows, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _sharded(n: int, name: str, **options: Any) -> tuple[nn.Module, dpcore.DataParallel, dpcore.ShardedOptimizer]:
    model = _model()
    dp = dpcore.DataParallel(model, ["cpu"] * n, shard_gradients=True, **options)
    cls, kwargs = OPTIMIZERS[name]
    return model, dp, dpcore.ShardedOptimizer(_groups(model), cls, devices=dp, **kwargs)


@pytest.fixture(params=[False, True], ids=["in_place", "copies"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Shards that step the masters themselves (CPU lists) or working copies (distinct GPUs), forced here."""
    if request.param:
        monkeypatch.setattr(sharded_optimizer, "_holds_copies", lambda device, master: True)
    return request.param


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", COUNTS)
def test_steps_equal_the_plain_optimizer(n: int, name: str, copies: bool) -> None:
    """20 steps of two backwards each, norm clipping and a scheduler: the parameters equal the plain run's, every
    p.grad stays None and gradient(p) is the whole gradient, at its owner; the frozen bias has none."""
    model, dp, optimizer = _sharded(n, name)
    plain_model = _model()
    cls, kwargs = OPTIMIZERS[name]
    plain = cls(_groups(plain_model), **kwargs)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (optimizer, plain)]
    for step in range(STEPS):
        for half in (0, 1):
            x = _batch(2 * step + half)
            dp(x).square().mean().backward()
            plain_model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        for p, q in zip(model.parameters(), plain_model.parameters()):
            got = optimizer.gradient(p)
            assert (got is None) == (q.grad is None)
            if got is not None:
                torch.testing.assert_close(got, q.grad, **TOL)
        total = optimizer.clip_grad_norm_(0.5)
        torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.5), **TOL)
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
        plain.zero_grad()
        assert all(optimizer.gradient(p) is None for p in model.parameters())
        for s in schedulers:
            s.step()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    # the replicas are current: the next refresh copies nothing
    dpcore.comm.reset_traffic()
    dp(_batch(99)).sum().backward()
    assert dpcore.comm.traffic()["broadcast"] == []
    for replica in dp.replica_cache.replica_modules:
        for p, q in zip(replica[0].parameters(), model.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("n", COUNTS)
def test_clip_grad_value_and_checkpoints_both_ways(n: int) -> None:
    model, dp, optimizer = _sharded(n, "adamw")
    plain_model = _model()
    plain = torch.optim.AdamW(_groups(plain_model), **OPTIMIZERS["adamw"][1])
    for step in range(STEPS):
        x = _batch(step)
        dp(x).square().mean().backward()
        plain_model(x).square().mean().backward()
        optimizer.clip_grad_value_(0.01)
        torch.nn.utils.clip_grad_value_(plain_model.parameters(), 0.01)
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
        plain.zero_grad()
        if step == 9:  # the sharded state into a plain optimizer, and back into a new sharded one (own tensors each)
            plain = torch.optim.AdamW(_groups(plain_model), lr=1.0)
            plain.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            optimizer = dpcore.ShardedOptimizer(_groups(model), torch.optim.AdamW, devices=dp, lr=1.0)
            optimizer.load_state_dict(copy.deepcopy(plain.state_dict()))
            assert optimizer.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_a_parameter_no_replica_used_gets_no_gradient() -> None:
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Branch()
    dp = dpcore.DataParallel(model, ["cpu"] * 3, shard_gradients=True)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=dp, lr=0.1)
    dp(torch.randn(6, 4, dtype=torch.float64)).sum().backward()
    assert optimizer.gradient(model.unused.weight) is None and optimizer.gradient(model.used.weight) is not None
    before = model.unused.weight.clone()
    optimizer.step()
    assert torch.equal(model.unused.weight, before)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_batch_on_fewer_devices_than_the_list(rows: int) -> None:
    """One row: only the module runs (replicas(1)), its gradients still go to the shards."""
    model, dp, optimizer = _sharded(4, "sgd_momentum")
    plain_model = _model()
    plain = torch.optim.SGD(_groups(plain_model), **OPTIMIZERS["sgd_momentum"][1])
    for step in range(3):
        x = _batch(step, rows)
        dp(x).square().mean().backward()
        plain_model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
        plain.zero_grad()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def _slot_totals(traffic: dict[str, list[tuple[int, int]]], n: int) -> list[tuple[int, int]]:
    totals = [[0, 0] for _ in range(n)]
    for slots in traffic.values():
        for i, (sent, received) in enumerate(slots):
            totals[i][0] += sent
            totals[i][1] += received
    return [(s, r) for s, r in totals]


@pytest.mark.parametrize("n", COUNTS)
def test_traffic_is_even_over_the_slots(n: int) -> None:
    """One training step after a first one: every slot sends and receives within 1.1x the mean, and device 0
    receives about 2(N-1)/N P (a reduce-scatter and an all-gather), not (N-1) P."""
    model = _even()
    dp = dpcore.DataParallel(model, ["cpu"] * n, shard_gradients=True)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, lr=1e-3)
    x = torch.randn(2 * n, 32, dtype=torch.float64)

    def step() -> None:
        dp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    dpcore.comm.reset_traffic()
    step()
    traffic = dpcore.comm.traffic()
    assert traffic["broadcast"] == [] and traffic["reduce_add"] == []
    totals = _slot_totals(traffic, n)
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for k in (0, 1):
        mean = sum(t[k] for t in totals) / n
        assert all(t[k] <= 1.1 * mean and t[k] >= mean / 1.1 for t in totals), totals
    expected = 2 * (n - 1) / n * p_bytes
    assert expected <= totals[0][1] <= 1.05 * expected, (totals[0], expected)


@pytest.mark.parametrize("n", COUNTS)
def test_memory_is_even_over_the_positions(n: int) -> None:
    """After a backward (the gradients held) following a step (AdamW's state made): position 0's total within 1.05x
    the others' mean; the gradients are counted at their owners, P/N each."""
    model = _even()
    dp = dpcore.DataParallel(model, ["cpu"] * n, shard_gradients=True)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, lr=1e-3)
    x = torch.randn(2 * n, 32, dtype=torch.float64)
    dp(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    dp(x).sum().backward()
    report = dpcore.memory_report(dp, optimizer)
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert [r.gradients for r in report] == [p_bytes // n] * n
    others = sum(r.total for r in report[1:]) / (n - 1)
    assert others / 1.05 <= report[0].total <= 1.05 * others, [r.total for r in report]


def test_sync_batchnorm_composes() -> None:
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()

    model, plain_model = net(), net()
    dp = dpcore.DataParallel(model, ["cpu"] * 3, shard_gradients=True, sync_batchnorm=True)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=dp, lr=0.1)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    for step in range(5):
        x = _batch(step)
        dp(x).square().mean().backward()
        plain_model(x).square().mean().backward()
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
        plain.zero_grad()
    for a, b in zip(model.state_dict().values(), plain_model.state_dict().values()):
        torch.testing.assert_close(a, b, **TOL)


class _Reentrant(nn.Module):
    """Two Linears under reentrant checkpointing (recomputed in the backward: replica 0's recomputation runs on the
    module's own parameters), then one outside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.tanh(self.b(torch.tanh(self.a(t)))), x, use_reentrant=True)
        return self.c(h)


@pytest.mark.parametrize("n", COUNTS)
def test_reentrant_checkpointing_equals_the_plain_optimizer(n: int) -> None:
    """The gradients that a reentrant recomputation accumulates on the module's parameters move into their shards:
    10 AdamW steps equal the plain optimizer's, every p.grad stays None."""
    model, plain_model = _Reentrant().double(), _Reentrant().double()
    dp = dpcore.DataParallel(model, ["cpu"] * n, shard_gradients=True)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, lr=1e-2)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    for step in range(10):
        x = _batch(step).requires_grad_()
        dp(x).square().mean().backward()
        plain_model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        for p, q in zip(model.parameters(), plain_model.parameters()):
            torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
        for o in (optimizer, plain):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_transformers_reentrant_checkpointing() -> None:
    """GPT-2 with transformers' gradient checkpointing, use_reentrant=True, on cpu*3: gradients equal one device's."""
    t = pytest.importorskip("transformers")

    def gpt2() -> nn.Module:
        torch.manual_seed(0)
        config = t.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        model = t.GPT2LMHeadModel(config).double()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model.train()

    model, bare = gpt2(), gpt2()
    dp = dpcore.DataParallel(model, ["cpu"] * 3, shard_gradients=True)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=dp, lr=0.1)
    ids = torch.randint(0, 50, (6, 8), generator=torch.Generator().manual_seed(0))
    dp(ids).logits.square().mean().backward()
    bare(ids).logits.square().mean().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)


def test_a_backward_of_the_bare_module_accumulates_into_the_shards() -> None:
    """A backward of the module outside the wrapper adds its gradients into the shards, as the default mode adds
    them into p.grad; one built after another optimizer takes over the wrapper's gradients (the first gets none)."""
    model, dp, first = _sharded(3, "sgd_momentum")
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=dp, lr=0.1)
    plain_model = _model()
    dp(_batch(0)).sum().backward()
    model(_batch(1)).sum().backward()
    plain_model(_batch(0)).sum().backward()
    plain_model(_batch(1)).sum().backward()
    assert all(p.grad is None for p in model.parameters()) and not first._store
    for p, q in zip(model.parameters(), plain_model.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
    dp.shard_gradients = False  # the default mode again: p.grad as usual
    model(_batch(2)).sum().backward()
    assert model[0].weight.grad is not None


def test_one_device_keeps_p_grad() -> None:
    """Nothing to shard: p.grad as usual, and the optimizer steps it."""
    model, dp, optimizer = _sharded(1, "adamw")
    dp(_batch(0)).sum().backward()
    assert model[0].weight.grad is not None
    assert optimizer.gradient(model[0].weight) is model[0].weight.grad
    optimizer.step()


def test_errors_name_both() -> None:
    with pytest.raises(TypeError, match="shard_gradients: expected True or False"):
        dpcore.DataParallel(_model(), ["cpu"] * 2, shard_gradients=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard_gradients=True cannot be combined with cuda_graphs=True"):
        dpcore.DataParallel(_model(), ["cpu"] * 2, shard_gradients=True, cuda_graphs=True)
    # no ShardedOptimizer attached (none, a plain one, one over a device list): the backward says so
    model = _model()
    dp = dpcore.DataParallel(model, ["cpu"] * 2, shard_gradients=True)
    torch.optim.SGD(model.parameters(), lr=0.1)
    dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=["cpu"] * 2, lr=0.1)
    with pytest.raises(RuntimeError, match="shard_gradients=True.*dpcore.ShardedOptimizer.*devices=dp"):
        dp(_batch(0)).sum().backward()
    # one that does not cover every trainable parameter
    with pytest.raises(ValueError, match=r"shard_gradients=True.*'2.weight'"):
        dpcore.ShardedOptimizer([model[0].weight, model[0].bias], torch.optim.SGD, devices=dp, lr=0.1)
    # a write to p.grad, found at the step
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.SGD, devices=dp, lr=0.1)
    dp(_batch(0)).sum().backward()
    model[0].weight.grad = torch.zeros_like(model[0].weight)
    with pytest.raises(RuntimeError, match="shard_gradients=True.*ShardedOptimizer.*must stay None"):
        optimizer.step()
    # the wrapper's devices changed under the optimizer
    dp.device_ids = ["cpu"] * 3
    dp.shard_gradients = True
    with pytest.raises(ValueError, match="shard_gradients=True: the attached ShardedOptimizer shards over"):
        dp(_batch(0))


def test_process_group_is_refused(world_of_one: Any) -> None:
    with pytest.raises(ValueError, match="shard_gradients=True cannot be combined with process_group="):
        dpcore.DataParallel(_model(), ["cpu"] * 2, shard_gradients=True, process_group=world_of_one)


def test_torch_grad_scaler_is_refused_naming_the_fix() -> None:
    """torch's GradScaler reads p.grad, None here: its step is an error naming dpcore.ShardedGradScaler, with or
    without unscale_ first (and the optimizer still steps without it)."""
    model, dp, optimizer = _sharded(2, "adamw")
    assert optimizer._step_supports_amp_scaling
    for unscale_first in (False, True):
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(dp(_batch(0)).square().mean()).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        with pytest.raises(
            RuntimeError, match="GradScaler cannot step .*shard_gradients=True.*dpcore.ShardedGradScaler"
        ):
            scaler.step(optimizer)
        assert "grad_scale" not in optimizer.__dict__ and "found_inf" not in optimizer.__dict__
    before = model[0].weight.clone()
    optimizer.step()
    assert not torch.equal(model[0].weight, before)


SCALER = {"init_scale": 2.0**10, "growth_interval": 3}
SKIPPED = {4: float("inf"), 5: float("nan"), 11: float("inf"), 17: float("-inf")}  # step -> what one input row holds


def _state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Each parameter's optimizer state, cloned ({} for one without)."""
    return [
        {k: torch.as_tensor(v).clone() for k, v in optimizer.state[p].items()} if p in optimizer.state else {}
        for p in params
    ]


def _assert_states_equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert [sorted(s) for s in a] == [sorted(s) for s in b]
    for s, t in zip(a, b):
        for key in s:
            torch.testing.assert_close(s[key], t[key], **TOL)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", COUNTS)
def test_sharded_grad_scaler_equals_torch_grad_scaler(n: int, name: str, copies: bool) -> None:
    """dpcore.ShardedGradScaler on the shards against torch's GradScaler on the plain optimizer, 20 steps of two
    backwards each with unscale_ and norm clipping: an inf or NaN in one input row skips the step (parameters and
    state untouched, the gradients kept until zero_grad), the scale sequence is torch's (backoffs and growths),
    and the final parameters and state equal the plain run's."""
    model, dp, optimizer = _sharded(n, name)
    plain_model = _model()
    cls, kwargs = OPTIMIZERS[name]
    plain = cls(_groups(plain_model), **kwargs)
    scaler, reference = dpcore.ShardedGradScaler("cpu", **SCALER), torch.amp.GradScaler("cpu", **SCALER)
    params = list(model.parameters())
    scales, reference_scales = [], []
    for step in range(STEPS):
        params_before, state_before = [p.clone() for p in params], _state(optimizer, params)
        for half in (0, 1):
            x = _batch(2 * step + half)
            if half == 1 and step in SKIPPED:
                x[3, 1] = SKIPPED[step]
            scaler.scale(dp(x).square().mean()).backward()
            reference.scale(plain_model(x).square().mean()).backward()
        assert all(p.grad is None for p in params)
        scaler.unscale_(optimizer)
        reference.unscale_(plain)
        if step not in SKIPPED:  # unscaled where they are held
            for p, q in zip(params, plain_model.parameters()):
                got = optimizer.gradient(p)
                assert (got is None) == (q.grad is None)
                if got is not None:
                    torch.testing.assert_close(got, q.grad, **TOL)
        total = optimizer.clip_grad_norm_(0.5)
        reference_total = torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.5)
        assert total.isfinite().item() == (step not in SKIPPED) == reference_total.isfinite().item()
        if step not in SKIPPED:
            torch.testing.assert_close(total, reference_total, **TOL)
        scaler.step(optimizer)
        reference.step(plain)
        if step in SKIPPED:
            assert all(torch.equal(p, q) for p, q in zip(params, params_before))
            _assert_states_equal(_state(optimizer, params), state_before)
            assert optimizer.gradient(model[0].weight) is not None  # not stepped: kept until zero_grad
        else:
            assert not torch.equal(model[0].weight, params_before[0])
        scaler.update()
        reference.update()
        scales.append(scaler.get_scale())
        reference_scales.append(reference.get_scale())
        optimizer.zero_grad()
        plain.zero_grad()
    assert scales == reference_scales
    assert min(scales) < SCALER["init_scale"] < max(scales)  # both backed off and grew
    assert optimizer._step_supports_amp_scaling  # torch's GradScaler is still refused
    for p, q in zip(params, plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    _assert_states_equal(_state(optimizer, params), _state(plain, list(plain_model.parameters())))
    if name != "sgd_momentum":
        assert optimizer.state[model[0].weight]["step"].item() == STEPS - len(SKIPPED)


def test_sharded_grad_scaler_is_torch_grad_scaler_elsewhere() -> None:
    """A plain optimizer, a ShardedOptimizer without shard_gradients (it unscales the masters' .grad) and a disabled
    scaler: dpcore.ShardedGradScaler gives torch's GradScaler's scales and parameters bit for bit."""

    def run(scaler_class: type[torch.amp.GradScaler], kind: str, enabled: bool = True) -> tuple[list[float], Any]:
        model = _model()
        if kind == "plain":
            net, optimizer = model, torch.optim.AdamW(_groups(model), lr=1e-2)
        else:
            net = dpcore.DataParallel(model, ["cpu"] * 3)
            optimizer = dpcore.ShardedOptimizer(_groups(model), torch.optim.AdamW, devices=net, lr=1e-2)
            assert not optimizer._step_supports_amp_scaling
        scaler = scaler_class("cpu", enabled=enabled, **SCALER)
        scales = []
        for step in range(8):
            x = _batch(step)
            if step in SKIPPED:
                x[3, 1] = SKIPPED[step]
            scaler.scale(net(x).square().mean()).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in model.parameters()]

    for kind in ("plain", "sharded"):
        for enabled in (True, False):
            ours, theirs = run(dpcore.ShardedGradScaler, kind, enabled), run(torch.amp.GradScaler, kind, enabled)
            assert ours[0] == theirs[0]
            for a, b in zip(ours[1], theirs[1]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            assert all(p.isfinite().all() for p in ours[1]) == enabled  # a disabled scaler steps the inf too


def test_sharded_grad_scaler_keeps_torchs_checks() -> None:
    """torch's rules hold on the shards: unscale_ twice, step twice, update with nothing recorded are errors; a
    step with no gradient held is torch's 'no inf checks'; the scaler's state dict round-trips."""
    model, dp, optimizer = _sharded(3, "sgd_momentum")
    scaler = dpcore.ShardedGradScaler("cpu", **SCALER)
    scaler.scale(dp(_batch(0)).square().mean()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(optimizer)
    assert optimizer._step_supports_amp_scaling  # reset after the step, even one that raised
    scaler.update()
    optimizer.zero_grad()
    scaler.scale(torch.ones((), dtype=torch.float64))
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(optimizer)  # no backward: nothing held
    assert optimizer._step_supports_amp_scaling
    again = dpcore.ShardedGradScaler("cpu")
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()


@requires_cuda  # CPU counterpart: test_steps_equal_the_plain_optimizer
@pytest.mark.cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_steps_equal_the_plain_optimizer_on_a_repeated_gpu(name: str) -> None:
    """[0, 0]: the ring, the shards and the all-gather on one GPU's streams equal the plain optimizer after 20 steps,
    with norm clipping; every p.grad stays None."""
    cls, kwargs = OPTIMIZERS[name]
    model = _model().cuda()
    dp = dpcore.DataParallel(model, [0, 0], shard_gradients=True)
    optimizer = dpcore.ShardedOptimizer(_groups(model), cls, devices=dp, **kwargs)
    plain_model = _model().cuda()
    plain = cls(_groups(plain_model), **kwargs)
    for step in range(STEPS):
        x = _batch(step).cuda()
        dp(x).square().mean().backward()
        plain_model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        torch.testing.assert_close(
            optimizer.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.5), **TOL
        )
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
        plain.zero_grad()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@requires_cuda  # CPU counterpart: test_sharded_grad_scaler_equals_torch_grad_scaler
@pytest.mark.cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_grad_scaler_on_a_repeated_gpu(name: str) -> None:
    """[0, 0]: dpcore.ShardedGradScaler("cuda") on the shards against torch's GradScaler on the plain optimizer, 20
    steps with unscale_, norm clipping and skipped steps: the same scales, found_inf on the GPU, equal parameters."""
    cls, kwargs = OPTIMIZERS[name]
    model = _model().cuda()
    dp = dpcore.DataParallel(model, [0, 0], shard_gradients=True)
    optimizer = dpcore.ShardedOptimizer(_groups(model), cls, devices=dp, **kwargs)
    plain_model = _model().cuda()
    plain = cls(_groups(plain_model), **kwargs)
    scaler, reference = dpcore.ShardedGradScaler("cuda", **SCALER), torch.amp.GradScaler("cuda", **SCALER)
    scales, reference_scales = [], []
    for step in range(STEPS):
        x = _batch(step).cuda()
        if step in SKIPPED:
            x[3, 1] = SKIPPED[step]
        scaler.scale(dp(x).square().mean()).backward()
        reference.scale(plain_model(x).square().mean()).backward()
        assert all(p.grad is None for p in model.parameters())
        scaler.unscale_(optimizer)
        reference.unscale_(plain)
        found = scaler._found_inf_per_device(optimizer)
        assert [d.type for d in found] == ["cuda"] and found[next(iter(found))].item() == (step in SKIPPED)
        optimizer.clip_grad_norm_(0.5)
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.5)
        scaler.step(optimizer)
        reference.step(plain)
        scaler.update()
        reference.update()
        scales.append(scaler.get_scale())
        reference_scales.append(reference.get_scale())
        optimizer.zero_grad()
        plain.zero_grad()
    assert scales == reference_scales and min(scales) < SCALER["init_scale"] < max(scales)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL)
