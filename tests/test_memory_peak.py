"""dpcore.memory.memory_peak: the peak, per position, of what dpcore holds (memory_report's totals) over a training step,
sampled where the holdings change (entering, each optimizer step's start and end, each shard's step end, leaving):
exact figures for the default mode with a plain optimizer, the sharded optimizer, and shard_gradients=True, a first
step whose state appears while the sharded gradients are held, working copies' gradients that exist only during the
step, and a GPT-2-like model from a config on cpu*4, where device 0's peak with shard_gradients=True is within 1.05x
the others' mean (the default mode's and ShardedOptimizer's device-0 excess as the tables in
docs/sharded_optimizer.md give them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcore
from dpcore import sharded_optimizer
from dpcore.memory import DeviceMemory, MemoryPeak, memory_peak

MODES = ("plain", "sharded", "shard_gradients")


def _nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).double()


def _build(mode: str, model: nn.Module, n: int) -> tuple[dpcore.DataParallel, torch.optim.Optimizer]:
    dp = dpcore.DataParallel(model, ["cpu"] * n, shard_gradients=mode == "shard_gradients")
    if mode == "plain":
        return dp, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return dp, dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, lr=1e-3)


def _train_step(dp: dpcore.DataParallel, opt: torch.optim.Optimizer, x: torch.Tensor) -> MemoryPeak:
    with memory_peak(dp, opt) as peak:
        dp(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    return peak


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_peak_of_a_step_counts_parameters_gradients_and_state_where_held(mode: str, n: int) -> None:
    model = _mlp()
    dp, opt = _build(mode, model, n)
    x = torch.randn(12, 8, dtype=torch.float64)
    p_bytes = _nbytes(model.parameters())
    for step in range(2):  # the first step makes the state, the second finds it
        peak = _train_step(dp, opt, x)
        report = peak.report
        assert [r.position for r in report] == list(range(n)) and all(isinstance(r, DeviceMemory) for r in report)
        assert report[0].module == p_bytes and all(r.replicas == p_bytes for r in report[1:])
        state = [r.optimizer_state for r in report]
        if mode == "plain":
            assert state[1:] == [0] * (n - 1) and state[0] == _nbytes(t for s in opt.state.values() for t in s.values())
            assert [r.gradients for r in report] == [p_bytes] + [0] * (n - 1), f"step {step}"
        else:
            assert state == [opt.state_bytes()[k] for k in range(n)], f"step {step}"
            owned = [_nbytes(p for p in model.parameters() if opt.shard_of(p) == k) for k in range(n)]
            # the default mode's .grad whole at position 0; shard_gradients' at each owner, held with the state
            expected = [p_bytes] + [0] * (n - 1) if mode == "sharded" else owned
            assert [r.gradients for r in report] == expected, f"step {step}"
        assert peak.totals == [r.total for r in report]


def test_the_first_step_holds_sharded_gradients_and_new_state_at_once() -> None:
    """With shard_gradients=True the gradients are dropped at the end of the step, and AdamW makes its state during
    the first one: only the shards' own end-of-step samples see both (memory_report before and after sees one)."""
    model = _mlp()
    dp, opt = _build("shard_gradients", model, 3)
    x = torch.randn(12, 8, dtype=torch.float64)
    with memory_peak(dp, opt) as peak:
        dp(x).square().mean().backward()
        before = [r.total for r in dpcore.memory_report(dp, opt)]
        opt.step()
        after = [r.total for r in dpcore.memory_report(dp, opt)]
    grads = [r.gradients for r in dpcore.memory_report(dp, opt)]
    assert grads == [0, 0, 0]  # dropped by the step
    for k in range(3):
        assert peak.totals[k] > max(before[k], after[k])
        assert peak.totals[k] == after[k] + peak.report[k].gradients and peak.report[k].gradients > 0


def test_working_copies_gradients_during_the_step_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards that step working copies (distinct GPUs; forced here on a CPU list) hold their gradients' copies only
    during the step: the shards' end-of-step samples count them at their positions."""
    monkeypatch.setattr(sharded_optimizer, "_holds_copies", lambda device, master: True)
    model = _mlp()
    dp, opt = _build("sharded", model, 3)
    x = torch.randn(12, 8, dtype=torch.float64)
    peak = _train_step(dp, opt, x)
    for k in (1, 2):
        own = _nbytes(p for p in model.parameters() if opt.shard_of(p) == k)
        assert own > 0
        assert peak.report[k].working_copies == own and peak.report[k].gradients == own
    assert dpcore.memory_report(dp, opt)[1].gradients == 0  # none after the step


def test_samples_cover_explicit_calls_and_hooks_are_removed() -> None:
    model = _mlp()
    dp, opt = _build("sharded", model, 2)
    x = torch.randn(12, 8, dtype=torch.float64)
    inner = opt._shards[0].optimizer  # type: ignore[attr-defined]
    hooks = (
        len(opt._optimizer_step_pre_hooks),
        len(opt._optimizer_step_post_hooks),
        len(inner._optimizer_step_post_hooks),
    )
    with memory_peak(dp, opt) as peak:
        dp(x).square().mean().backward()  # no step: the gradients are seen by the explicit sample
        peak.sample()
        opt.zero_grad()
    assert peak.report[0].gradients == _nbytes(model.parameters())
    assert (
        len(opt._optimizer_step_pre_hooks),
        len(opt._optimizer_step_post_hooks),
        len(inner._optimizer_step_post_hooks),
    ) == hooks
    assert memory_peak(dp, opt).report == []  # nothing before the block


def test_without_an_optimizer_and_wrong_arguments() -> None:
    model = _mlp()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    with memory_peak(dp) as peak:
        dp(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
        peak.sample()
    assert peak.totals == [2 * _nbytes(model.parameters()), _nbytes(model.parameters())]
    with pytest.raises(TypeError, match="dp: expected a dpcore.DataParallel, but got Linear"):
        memory_peak(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer or None, but got int"):
        memory_peak(dp, 3)  # type: ignore[arg-type]


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_device_0_peak_with_sharded_gradients_within_1_05_of_the_others() -> None:
    """cpu*4, AdamW, the second training step's peak: with shard_gradients=True device 0 holds the module (P), its
    shard's gradients and state, each other device its replica (P) and its shard's: within 1.05x. The default mode
    holds P + P (.grad) + 2P (state) on device 0 against P; ShardedOptimizer P + P + its state against P + its
    state."""
    base = _gpt2()
    ids = torch.randint(0, 512, (4, 16))
    p_bytes = _nbytes(base.parameters())
    ratios = {}
    for mode in MODES:
        model = _gpt2()
        dp, opt = _build(mode, model, 4)

        def step() -> MemoryPeak:
            with memory_peak(dp, opt) as peak:
                dp(ids).logits.float().square().mean().backward()
                opt.step()
            opt.zero_grad()
            return peak

        step()
        totals = step().totals
        assert all(t >= p_bytes for t in totals)
        ratios[mode] = totals[0] / (sum(totals[1:]) / 3)
        state = [r.optimizer_state for r in dpcore.memory_report(dp, opt)]
        if mode == "plain":
            assert totals == [2 * p_bytes + state[0]] + [p_bytes] * 3
        elif mode == "sharded":
            assert totals == [2 * p_bytes + state[0]] + [p_bytes + s for s in state[1:]]
    assert ratios["shard_gradients"] <= 1.05, ratios
    assert ratios["plain"] == pytest.approx(4.0, rel=1e-3), ratios  # 4P against P (AdamW's 0-dim steps aside)
    assert 1.6 <= ratios["sharded"] <= 1.75, ratios  # (2P + 2P/4) / (P + 2P/4) = 1.67 with even shards


def test_bench_zero2_memory_rows() -> None:
    """bench/bench_zero2.py's memory rows (the figures the bench prints): one per mode, shard_gradients within 1.05."""
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "bench_zero2.py"
    spec = importlib.util.spec_from_file_location("bench_zero2", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.memory_rows([torch.device("cpu")] * 4)
    assert [r["measured"] for r in rows] == [f"memory, {m}" for m in (*MODES, "shard_parameters")]
    ratios = {r["measured"].split(", ")[1]: r["device0_over_others"] for r in rows}
    assert ratios["shard_gradients"] <= 1.05 and ratios["plain"] == pytest.approx(4.0, rel=1e-3)
    assert all(len(r["peak_bytes"]) == 4 for r in rows)
    assert all(r["peak_bytes"][0] > r["parameter_bytes"] for r in rows[:3])
    zero3 = rows[3]  # no position holds the whole module
    assert max(zero3["peak_parameter_bytes"]) < zero3["parameter_bytes"] and zero3["device0_over_others"] <= 1.1
