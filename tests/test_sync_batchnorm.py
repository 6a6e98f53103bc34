"""Tests for synchronized BatchNorm, ``DataParallel(..., sync_batchnorm=True)``
(dpcore/sync_batchnorm.py), on CPU device lists.

Equivalence is checked in float64 against a deep copy of the model run on the
whole batch on one device, over several SGD steps: outputs, input gradients,
parameter gradients, running statistics and num_batches_tracked. Failures
(a replica that raises, skips a BatchNorm call, calls one more, or is late)
must give one clear error, leave nothing waiting and the pool usable.
"""

from __future__ import annotations

import copy
import re
import time
from typing import Any

import pytest
import torch
from torch import nn

import dpcore
from dpcore import sync_batchnorm

F64 = torch.float64
ATOL = 1e-10
RTOL = 1e-9


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _model(
    kind: str, affine: bool = True, track: bool = True, momentum: float | None = 0.1
) -> tuple[nn.Module, tuple[int, ...]]:
    """A small model with BatchNorm of `kind`, and its input shape without the batch."""
    torch.manual_seed(0)
    bn = {"1d": nn.BatchNorm1d, "1d-seq": nn.BatchNorm1d, "2d": nn.BatchNorm2d, "3d": nn.BatchNorm3d}[kind]
    options = {"affine": affine, "track_running_stats": track, "momentum": momentum}
    if kind == "1d":
        model, shape = nn.Sequential(nn.Linear(5, 6), bn(6, **options), nn.Tanh(), nn.Linear(6, 3)), (5,)
    elif kind == "1d-seq":
        model, shape = nn.Sequential(nn.Conv1d(3, 4, 3), bn(4, **options), nn.Tanh()), (3, 7)
    elif kind == "2d":
        model, shape = nn.Sequential(nn.Conv2d(3, 4, 3), bn(4, **options), nn.ReLU(), nn.Conv2d(4, 2, 1)), (3, 5, 5)
    else:
        model, shape = nn.Sequential(nn.Conv3d(2, 3, 2), bn(3, **options), nn.Tanh()), (2, 3, 4, 3)
    if affine:  # weight and bias away from their initial 1 and 0
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)
    return model.to(F64), shape


def _compare_steps(
    model: nn.Module,
    devices: list[Any],
    batches: list[torch.Tensor],
    *,
    forwards: int = 1,
    **options: Any,
) -> None:
    """Runs one SGD step per batch with DataParallel(sync_batchnorm=True) and
    on a deep copy on one device, each step `forwards` forward calls on
    slices of the batch; compares everything after every step."""
    reference = copy.deepcopy(model)
    dp = dpcore.DataParallel(model, devices, sync_batchnorm=True, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate(batches):
        parts = batch.tensor_split(forwards) if forwards > 1 else [batch]
        xs = [p.clone().requires_grad_() for p in parts]
        xs_ref = [p.clone().requires_grad_() for p in parts]
        outs = [dp(x) for x in xs]
        outs_ref = [reference(x) for x in xs_ref]
        projections = [_randn(*o.shape, seed=100 + step + i) for i, o in enumerate(outs_ref)]
        sum((o * p).sum() for o, p in zip(outs, projections)).backward()
        sum((o * p).sum() for o, p in zip(outs_ref, projections)).backward()
        for i, (o, o_ref, x, x_ref) in enumerate(zip(outs, outs_ref, xs, xs_ref)):
            _close(o, o_ref, f"step {step} forward {i}: output")
            _close(x.grad, x_ref.grad, f"step {step} forward {i}: input gradient")
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert p.grad is not None, f"step {step}: {name} got no gradient"
            _close(p.grad, q.grad, f"step {step}: gradient of {name}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        state, state_ref = model.state_dict(), reference.state_dict()
        assert list(state) == list(state_ref)
        for name in state:
            _close(state[name], state_ref[name], f"after step {step}: {name}")


@pytest.mark.parametrize("kind", ["1d", "1d-seq", "2d", "3d"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
@pytest.mark.parametrize("track", [True, False], ids=["running-stats", "no-running-stats"])
def test_matches_one_device_on_the_whole_batch(kind: str, affine: bool, track: bool) -> None:
    model, shape = _model(kind, affine, track)
    batches = [_randn(10, *shape, seed=s) * 2 + 1 for s in range(3)]  # 10 on 3 devices: 4, 3, 3
    _compare_steps(model, ["cpu"] * 3, batches)


@pytest.mark.parametrize("count", [2, 4])
def test_matches_on_two_and_four_devices(count: int) -> None:
    model, shape = _model("2d")
    _compare_steps(model, ["cpu"] * count, [_randn(9, *shape, seed=s) for s in range(3)])


class _ReadThroughTranspose(nn.Module):
    """Reads BatchNorm's output as LeViT's patch embeddings do, ``flatten(2).transpose(1, 2)``: each
    replica's gradient arrives channels_last-strided (its batch stride free where its chunk has one row)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)


def _formatted(x: torch.Tensor, layout: str) -> torch.Tensor:
    """`x` in the memory format `layout`; "channels-first-last" is a 3-d input laid out (N, L, C)."""
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last_3d":
        return x.contiguous(memory_format=torch.channels_last_3d)
    if layout == "channels-first-last":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x


_LAYOUTS = [
    ((6,), "contiguous"),
    ((6, 5), "contiguous"),
    ((6, 5), "channels-first-last"),
    ((8, 3, 2), "contiguous"),
    ((8, 3, 2), "channels_last"),
    ((8, 2, 3, 2), "contiguous"),
    ((8, 2, 3, 2), "channels_last_3d"),
]
_CASES = [
    (shape, layout, read)
    for shape, layout in _LAYOUTS
    for read in ("as-is", "transposed")
    if len(shape) > 1 or read == "as-is"
]


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize(("shape", "layout", "read"), _CASES, ids=[f"{len(s) + 1}d-{f}-{r}" for s, f, r in _CASES])
def test_every_chunk_size_and_memory_format(count: int, shape: tuple[int, ...], layout: str, read: str) -> None:
    """Batches of `count`, `count` + 1 and 2 `count` + 1 rows: chunks of 1 (all of them, or beside chunks of 2),
    2 and 3; inputs in every memory format, read as they are or through a transpose (channels_last-strided
    gradients: torch's CPU BatchNorm backward is wrong for those on a contiguous input of one row)."""
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}[len(shape)]
    torch.manual_seed(0)
    model = nn.Sequential(bn(shape[0]), _ReadThroughTranspose() if read == "transposed" else nn.Identity()).to(F64)
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-0.5, 0.5)
    batches = [_formatted(_randn(n, *shape, seed=n) * 2 + 1, layout) for n in (count, count + 1, 2 * count + 1)]
    _compare_steps(model, ["cpu"] * count, batches)


def test_cumulative_average_momentum_none() -> None:
    model, shape = _model("2d", momentum=None)
    _compare_steps(model, ["cpu"] * 3, [_randn(7, *shape, seed=s) + s for s in range(3)])
    assert model[1].num_batches_tracked.item() == 3


def test_uneven_chunks_are_weighted_by_count() -> None:
    model, shape = _model("1d")
    batches = [_randn(10, *shape, seed=s) for s in range(3)]
    _compare_steps(model, ["cpu"] * 3, batches, chunk_sizes=[6, 1, 3])


def test_fewer_replicas_than_devices() -> None:
    # Batch 3 on 4 devices runs 3 replicas of one sample each; an empty chunk in the middle too.
    model, shape = _model("1d")
    _compare_steps(model, ["cpu"] * 4, [_randn(3, *shape, seed=s) for s in range(3)])
    model, shape = _model("2d")
    _compare_steps(model, ["cpu"] * 4, [_randn(6, *shape, seed=s) for s in range(2)], chunk_sizes=[2, 0, 1, 3])


def test_double_forward_in_one_step() -> None:
    model, shape = _model("2d")
    _compare_steps(model, ["cpu"] * 3, [_randn(12, *shape, seed=s) for s in range(3)], forwards=2)
    assert model[1].num_batches_tracked.item() == 6


class _Twice(nn.Module):
    """Calls one BatchNorm twice per forward, and a second one once."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.a(x)).tanh()
        x = self.bn(self.b(x)).tanh()
        return self.head(x)


def test_a_layer_called_twice_per_forward() -> None:
    torch.manual_seed(1)
    _compare_steps(_Twice().to(F64), ["cpu"] * 3, [_randn(8, 4, seed=s) for s in range(3)])


def test_one_exchange_per_batchnorm_call(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    real = dpcore._C.Rendezvous

    def counting(participants: int) -> Any:
        made.append(real(participants))
        return made[-1]

    monkeypatch.setattr(dpcore._C, "Rendezvous", counting)
    torch.manual_seed(1)
    dp = dpcore.DataParallel(_Twice().to(F64), ["cpu"] * 3, sync_batchnorm=True)
    dp(_randn(8, 4, seed=0)).sum().backward()
    assert len(made) == 1 and made[0].participants == 3
    assert made[0].rounds == 3  # bn twice, head.1 once; backward exchanges nothing through it
    dp.eval()
    dp(_randn(8, 4, seed=0))
    assert len(made) == 1  # eval with running statistics: plain BatchNorm, no rendezvous


def test_loss_inside_the_replicas() -> None:
    model, shape = _model("2d")
    reference = copy.deepcopy(model)
    criterion = nn.MSELoss()
    dp = dpcore.DataParallel(model, ["cpu"] * 3, criterion=criterion, sync_batchnorm=True)
    x, target = _randn(10, *shape, seed=0), _randn(10, 2, 3, 3, seed=1)
    loss = dp(x, target)
    loss_ref = criterion(reference(x), target)
    _close(loss, loss_ref, "loss")
    loss.backward()
    loss_ref.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        _close(p.grad, q.grad, f"gradient of {name}")
    _close(model[1].running_var, reference[1].running_var, "running_var")


def test_eval_mode_and_the_master_stay_plain_batchnorm() -> None:
    model, shape = _model("2d")
    keys = list(model.state_dict())
    reference = copy.deepcopy(model)
    dp = dpcore.DataParallel(model, ["cpu"] * 3, sync_batchnorm=True)
    x = _randn(9, *shape, seed=0)
    _close(dp(x), reference(x), "training output")
    dp.eval()
    reference.eval()
    y = _randn(9, *shape, seed=1)
    _close(dp(y), reference(y), "eval output")
    _close(model[1].running_mean, reference[1].running_mean, "running_mean")  # eval did not update it
    assert type(model[1]) is nn.BatchNorm2d
    assert list(dp.state_dict()) == keys


def test_without_sync_replicas_use_their_own_chunk() -> None:
    """The defect this option fixes: without it, outputs differ from one device."""
    model, shape = _model("1d")
    reference = copy.deepcopy(model)
    x = _randn(8, *shape, seed=0)
    plain = dpcore.DataParallel(copy.deepcopy(model), ["cpu"] * 2)(x)
    assert not torch.allclose(plain, reference(x), atol=1e-3)
    _close(dpcore.DataParallel(model, ["cpu"] * 2, sync_batchnorm=True)(x), reference(x), "output")


def test_gradcheck_and_gradgradcheck() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(F64)
    dp = dpcore.DataParallel(model, ["cpu"] * 3, sync_batchnorm=True)
    x = _randn(7, 3, seed=0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: dp(t), (x,))
    assert torch.autograd.gradgradcheck(lambda t: dp(t), (x,))


def test_reduced_precision_input_keeps_its_dtype() -> None:
    torch.manual_seed(0)
    model = nn.BatchNorm1d(4)
    reference = copy.deepcopy(model)
    x = torch.randn(12, 4).to(torch.bfloat16)
    out = dpcore.DataParallel(model, ["cpu"] * 3, sync_batchnorm=True)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(x).float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(model.running_mean, reference.running_mean, atol=1e-3, rtol=1e-3)


def test_autocast_inference_mode_and_no_grad() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    reference = copy.deepcopy(model)
    dp = dpcore.DataParallel(model, ["cpu"] * 3, sync_batchnorm=True)
    x = torch.randn(12, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = dp(x), reference(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var, atol=1e-3, rtol=1e-3)
    for context in (torch.inference_mode, torch.no_grad):
        with context():
            out, expected = dp(x), reference(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
        assert model[1].num_batches_tracked.item() == reference[1].num_batches_tracked.item()


def test_a_plain_dataparallel_nested_in_a_synchronized_replica() -> None:
    """The inner DataParallel's replicas inherit the outer replica's function
    modes (the pool hands them on) but keep plain, per-chunk BatchNorm."""
    inner_bn = nn.BatchNorm1d(3).to(F64)
    model = nn.Sequential(nn.BatchNorm1d(3), dpcore.DataParallel(inner_bn, ["cpu"] * 2)).to(F64)
    outer = dpcore.DataParallel(model, ["cpu"] * 2, sync_batchnorm=True)
    x = _randn(8, 3, seed=0)
    first = nn.functional.batch_norm(x, None, None, training=True)  # outer: the whole batch
    expected = torch.cat([nn.functional.batch_norm(part, None, None, training=True) for part in first.split(2)])
    _close(outer(x), expected, "output")


def test_sync_batchnorm_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="sync_batchnorm: expected True or False, but got 1"):
        dpcore.DataParallel(nn.BatchNorm1d(2), ["cpu"] * 2, sync_batchnorm=1)  # type: ignore[arg-type]
    assert issubclass(dpcore.SyncBatchNormError, RuntimeError)


# -- failures: one clear error, nothing left waiting, the pool usable ---------


MARK = 1000.0  # a sample whose first feature is MARK triggers the faulty behaviour


class _Faulty(nn.Module):
    """Linear, bn1, tanh, bn2; `behaviour` on a replica whose chunk holds a marked sample."""

    def __init__(self, behaviour: str) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.lin = nn.Linear(3, 3)
        self.bn1 = nn.BatchNorm1d(3)
        self.bn2 = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked = bool((x[:, 0] == MARK).any())
        if marked and self.behaviour == "late":
            time.sleep(1.5)
        if marked and self.behaviour == "raise-first":
            raise ValueError("boom before any BatchNorm")
        x = self.lin(x.clamp(max=10))
        if not (marked and self.behaviour == "skip-bn1"):
            x = self.bn1(x)
        if marked and self.behaviour == "raise":
            raise ValueError("boom between the BatchNorms")
        x = self.bn2(x.tanh())
        if marked and self.behaviour == "extra":
            x = self.bn2(x)
        return x


def _marked_batch(replica: int, devices: int = 3, per_replica: int = 2) -> torch.Tensor:
    x = _randn(devices * per_replica, 3, seed=0)
    x[replica * per_replica, 0] = MARK
    return x


def _check_usable_afterwards(dp: dpcore.DataParallel) -> None:
    model = dp.module
    model.behaviour = "none"
    reference = copy.deepcopy(model)
    x = _randn(9, 3, seed=5)
    _close(dp(x), reference(x), "output of the call after the failure")


@pytest.mark.parametrize("replica", [0, 1, 2])
@pytest.mark.parametrize("behaviour", ["raise", "raise-first"])
def test_a_replica_that_raises_gives_its_own_error(replica: int, behaviour: str) -> None:
    torch.manual_seed(0)
    dp = dpcore.DataParallel(_Faulty(behaviour).to(F64), ["cpu"] * 3, sync_batchnorm=True)
    threads = dpcore._C.worker_thread_count()
    started = time.perf_counter()
    with pytest.raises(ValueError, match="boom") as info:
        dp(_marked_batch(replica))
    assert time.perf_counter() - started < 30  # the others were woken, not timed out (300 s)
    assert f"raised in replica {replica} on device cpu" in getattr(info.value, "__notes__", [])
    _check_usable_afterwards(dp)
    assert dpcore._C.worker_thread_count() <= threads + 3  # no thread left behind per failure


@pytest.mark.parametrize("replica", [0, 2])
def test_a_replica_that_skips_a_batchnorm(replica: int) -> None:
    torch.manual_seed(0)
    dp = dpcore.DataParallel(_Faulty("skip-bn1").to(F64), ["cpu"] * 3, sync_batchnorm=True)
    others = "replicas 1, 2" if replica == 0 else "replicas 0, 1"
    expected = f"replica {replica} reached BatchNorm 'bn2' (call 1) where {others} reached BatchNorm 'bn1' (call 1)"
    with pytest.raises(dpcore.SyncBatchNormError) as info:
        dp(_marked_batch(replica))
    assert expected in str(info.value)
    _check_usable_afterwards(dp)


class _SomeReplicas(nn.Module):
    """Calls its BatchNorm only on chunks of at least `min_rows` rows."""

    def __init__(self, min_rows: int) -> None:
        super().__init__()
        self.min_rows = min_rows
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        return self.bn(x) if x.shape[0] >= self.min_rows else x


def test_batchnorm_called_only_on_some_replicas() -> None:
    torch.manual_seed(0)
    dp = dpcore.DataParallel(_SomeReplicas(3).to(F64), ["cpu"] * 3, sync_batchnorm=True)
    started = time.perf_counter()
    with pytest.raises(dpcore.SyncBatchNormError) as info:
        dp(_randn(8, 3, seed=0))  # chunks 3, 3, 2: replica 2 skips 'bn'
    assert time.perf_counter() - started < 30
    # Which of replicas 0 and 1 were already waiting when replica 2 finished is a race; either way
    # the message names replica 2 and the layer.
    message = str(info.value)
    assert re.search(
        r"replica 2 finished without reaching BatchNorm 'bn' \(call 1\), which replicas? [01]", message
    ) or ("after replica 2 had finished without it" in message and "BatchNorm 'bn' (call 1)" in message), message
    dp.module.min_rows = 0
    reference = copy.deepcopy(dp.module)
    x = _randn(8, 3, seed=1)
    _close(dp(x), reference(x), "output after the failure")


def test_an_extra_batchnorm_call_on_one_replica() -> None:
    torch.manual_seed(0)
    dp = dpcore.DataParallel(_Faulty("extra").to(F64), ["cpu"] * 3, sync_batchnorm=True)
    with pytest.raises(dpcore.SyncBatchNormError) as info:
        dp(_marked_batch(1))
    message = str(info.value)
    assert "BatchNorm 'bn2' (call 2)" in message and "replica 1" in message, message
    _check_usable_afterwards(dp)


def test_a_late_replica_times_out_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPCORE_SYNC_TIMEOUT_S", "1")
    torch.manual_seed(0)
    dp = dpcore.DataParallel(_Faulty("late").to(F64), ["cpu"] * 3, sync_batchnorm=True)
    started = time.perf_counter()
    with pytest.raises(dpcore.SyncBatchNormError) as info:
        dp(_marked_batch(1))
    assert 1.0 <= time.perf_counter() - started < 30
    # Normally replicas 0 and 2 wait; on a very busy machine replica 2 may be late too.
    assert re.fullmatch(
        r"replicas? 1(, 2)? did not reach BatchNorm 'bn1' \(call 1\) within 1 s, while replicas? 0(, 2)? waited "
        r"there \(raise the limit with DPCORE_SYNC_TIMEOUT_S=<seconds>\)",
        str(info.value),
    ), str(info.value)
    monkeypatch.delenv("DPCORE_SYNC_TIMEOUT_S")
    _check_usable_afterwards(dp)


def test_a_malformed_timeout_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPCORE_SYNC_TIMEOUT_S", "soon")
    dp = dpcore.DataParallel(nn.BatchNorm1d(2).to(F64), ["cpu"] * 2, sync_batchnorm=True)
    with pytest.raises(RuntimeError, match="DPCORE_SYNC_TIMEOUT_S to be an integer of at least 1, but it is 'soon'"):
        dp(_randn(4, 2, seed=0))


def test_repeated_failures_leave_no_threads_behind() -> None:
    torch.manual_seed(0)
    dp = dpcore.DataParallel(_Faulty("raise").to(F64), ["cpu"] * 3, sync_batchnorm=True)
    with pytest.raises(ValueError):
        dp(_marked_batch(1))
    threads = dpcore._C.worker_thread_count()
    for replica in (0, 1, 2, 1):
        with pytest.raises(ValueError):
            dp(_marked_batch(replica))
    assert dpcore._C.worker_thread_count() == threads


def test_replicas_of_a_sync_call_all_run_at_once() -> None:
    """More replicas than intra-op threads (2 here): without running them all
    at once, replica 0 would wait for a replica queued behind it."""
    model, shape = _model("1d")
    count = torch.get_num_threads() * 2 + 1
    _compare_steps(model, ["cpu"] * count, [_randn(2 * count, *shape, seed=0)])


def test_rendezvous_binding_errors() -> None:
    rv = dpcore._C.Rendezvous(2, timeout_s=5.0)
    assert rv.timeout_s == 5.0 and not rv.broken and rv.culprit == -1
    with pytest.raises(IndexError, match=r"expected a rank in \[0, 2\), but got 3"):
        rv.exchange(3, "k", [], 1)
    rv.fail(1, "RuntimeError: x")
    with pytest.raises(dpcore.SyncBatchNormError, match="replica 1 raised RuntimeError: x"):
        rv.exchange(0, "k", [torch.zeros(1)], 1)
    assert rv.broken and rv.culprit == 1
    with pytest.raises(ValueError, match="timeout_s to be at least 0.001 seconds"):
        dpcore._C.Rendezvous(2, timeout_s=0.0)


def test_needs_sync() -> None:
    model, _ = _model("2d")
    assert sync_batchnorm.needs_sync(model)
    model.eval()
    assert not sync_batchnorm.needs_sync(model)
    model, _ = _model("2d", track=False)
    model.eval()
    assert sync_batchnorm.needs_sync(model)  # no running statistics: batch statistics in eval too
    assert not sync_batchnorm.needs_sync(nn.Linear(2, 2))
