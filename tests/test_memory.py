"""dpcore.memory_report: the bytes dpcore holds at each position of a wrapper's device list, counted exactly
(module, replicas, gradients, optimizer state, working copies) for the default mode and the sharded optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcore
from dpcore.memory import DeviceMemory
from conftest import requires_cuda

LISTS = [["cpu"] * 2, ["cpu"] * 3, ["cpu"] * 4]


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 3))
    net[4].weight.requires_grad_(False)  # frozen: no gradient, no state
    return net.double()


def _nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


def _step(dp: dpcore.DataParallel, opt: torch.optim.Optimizer) -> None:
    dp(torch.randn(9, 6, dtype=torch.float64)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("devices", LISTS, ids=lambda d: f"cpu*{len(d)}")
def test_default_mode_holds_everything_on_position_0(devices: list[str]) -> None:
    model = _model()
    dp = dpcore.DataParallel(model, devices)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    everything = _nbytes([*model.parameters(), *model.buffers()])
    trainable = _nbytes(p for p in model.parameters() if p.requires_grad)
    before = dpcore.memory_report(dp, opt)
    assert [r.replicas for r in before] == [0] * len(devices)  # no call made them yet
    _step(dp, opt)
    report = dpcore.memory_report(dp, opt)
    assert [r.position for r in report] == list(range(len(devices))) and all(
        isinstance(r, DeviceMemory) for r in report
    )
    first, rest = report[0], report[1:]
    steps = sum(1 for p in model.parameters() if p.requires_grad) * 8  # AdamW's float64-free 0-dim steps (float32)
    assert first.module == everything and first.gradients == trainable
    assert first.optimizer_state == 2 * trainable + steps // 2  # exp_avg, exp_avg_sq, a 4-byte step each
    assert all(r.replicas == everything and r.module == r.gradients == r.optimizer_state == 0 for r in rest)
    assert first.allocator_peak is None and first.total == everything + trainable + first.optimizer_state
    opt.zero_grad()
    assert dpcore.memory_report(dp, opt)[0].gradients == 0


@pytest.mark.parametrize("devices", LISTS, ids=lambda d: f"cpu*{len(d)}")
def test_sharded_optimizer_state_is_counted_where_each_shard_holds_it(devices: list[str]) -> None:
    model = _model()
    dp = dpcore.DataParallel(model, devices)
    opt = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, lr=1e-3)
    plain_model = _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    _step(dp, opt)
    _step(dpcore.DataParallel(plain_model, devices), plain)
    report = dpcore.memory_report(dp, opt)
    assert [r.optimizer_state for r in report] == [opt.state_bytes()[k] for k in range(len(devices))]
    assert sum(r.optimizer_state for r in report) == dpcore.memory_report(dp, plain)[0].optimizer_state
    assert sum(r.optimizer_state > 0 for r in report) >= 2  # spread, not all on position 0
    assert all(r.working_copies == 0 for r in report)  # CPU positions share memory: the shards step the masters


@pytest.mark.parametrize("devices", LISTS, ids=lambda d: f"cpu*{len(d)}")
def test_sharded_parameters_are_counted_at_their_owners(devices: list[str]) -> None:
    """shard_parameters=: each position's module bytes are its shards (the buffers at position 0), summing to the
    module's once; units gathered and kept until the backward count as replicas there, none after it."""
    model = _model()
    whole = _nbytes(model.parameters())
    buffers = _nbytes(model.buffers())
    dp = dpcore.DataParallel(model, devices, shard_parameters=(nn.Linear,), reshard_after_forward=False)
    opt = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, lr=1e-3)
    held = dp.sharded_parameters.held_bytes()
    out = dp(torch.randn(9, 6, dtype=torch.float64))
    during = dpcore.memory_report(dp, opt)
    assert [r.module for r in during] == [h["parameters"] + (buffers if k == 0 else 0) for k, h in held.items()]
    assert sum(r.module for r in during) == whole + buffers
    assert [r.replicas for r in during] == [h["gathered"] for h in dp.sharded_parameters.held_bytes().values()]
    assert all(r.replicas > 0 for r in during)
    out.square().mean().backward()
    opt.step()
    after = dpcore.memory_report(dp, opt)
    assert [r.module for r in after] == [r.module for r in during] and all(r.replicas == 0 for r in after)
    assert sum(r.optimizer_state for r in after) > 0


def test_tied_weights_are_counted_once() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    dp(torch.arange(6)).sum().backward()
    report = dpcore.memory_report(dp)
    assert report[0].module == report[1].replicas == emb.weight.numel() * 4
    assert report[0].gradients == emb.weight.numel() * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the default device list is the GPUs, not empty")
def test_a_module_run_as_is_has_one_position() -> None:
    model = nn.Linear(3, 2)
    report = dpcore.memory_report(dpcore.DataParallel(model))  # no GPU: device_ids is empty
    assert len(report) == 1 and report[0].module == _nbytes(model.parameters()) and report[0].replicas == 0


def test_wrong_arguments_name_them() -> None:
    with pytest.raises(TypeError, match="dp: expected a dpcore.DataParallel, but got Linear"):
        dpcore.memory_report(nn.Linear(2, 2))  # type: ignore[arg-type]


@requires_cuda  # CPU counterpart above
@pytest.mark.cuda
def test_cuda_positions_report_the_allocator_peak() -> None:
    model = _model().cuda()
    dp = dpcore.DataParallel(model, [0, 0])
    opt = torch.optim.AdamW(model.parameters())
    _step(dp, opt)
    report = dpcore.memory_report(dp, opt)
    assert all(r.allocator_peak is not None and r.allocator_peak >= r.total // 2 for r in report)
