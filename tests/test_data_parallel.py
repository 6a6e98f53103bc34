"""Tests for dpcore.DataParallel and dpcore.replicate, on CPU device lists
["cpu"] * k, k = 1..4, and, with the same bodies, on CUDA device lists that
skip only without a GPU (the ``any_devices`` fixture of conftest).

Numerics are compared in float64 against the bare module on one device.
Where torch.nn.DataParallel would fail a test, a comment says so (besides
the obvious: torch's DataParallel cannot run on CPU device lists at all).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import pickle
import threading
import warnings
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dpcore
from conftest import as_torch_device

F64 = torch.float64

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    mask: torch.Tensor
    tag: str = "batch"


def _devs(devices: list[Any]) -> list[torch.device]:
    return [as_torch_device(d) for d in devices]


def _dev0(devices: list[Any]) -> torch.device:
    return as_torch_device(devices[0])


def _randn(*shape: int, device: torch.device, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device)


def _mlp(device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(device, F64)


def _pair(module: nn.Module, devices: list[Any], **options: Any) -> tuple[nn.Module, dpcore.DataParallel]:
    """A reference copy of `module` and a DataParallel around `module`."""
    reference = copy.deepcopy(module)
    return reference, dpcore.DataParallel(module, devices, **options)


def _assert_grads_equal(module: nn.Module, reference: nn.Module) -> None:
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, f"{name}: no gradient reached the master parameter"
        a = p.grad.to_dense() if p.grad.is_sparse else p.grad
        b = q.grad.to_dense() if q.grad.is_sparse else q.grad
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def _assert_params_equal(module: nn.Module, reference: nn.Module) -> None:
    for (name, p), (_, q) in zip(module.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


class CallCounter:
    """Thread-safe record of the calls the replicas make (shared by reference:
    replicas copy the master's attribute dict)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[Any] = []

    def add(self, record: Any) -> None:
        with self.lock:
            self.records.append(record)


# ---------------------------------------------------------------------------
# Output and gradients equal the single-device ones
# ---------------------------------------------------------------------------


def test_output_and_grads_equal_single_device(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices)
    x = _randn(7, 5, device=dev)  # 7 rows: uneven chunks
    y = dp(x)
    assert y.device == dev
    torch.testing.assert_close(y, reference(x))
    (y * y).sum().backward()
    (reference(x) ** 2).sum().backward()
    _assert_grads_equal(dp.module, reference)


def test_input_gradients_flow_back(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices)
    x = _randn(6, 5, device=dev).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    dp(x).sum().backward()
    reference(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("form", ["torch.device", "str"])
def test_device_ids_as_devices_and_strings(any_devices: list[Any], form: str) -> None:
    devs = _devs(any_devices)
    if form == "torch.device":
        ids: list[Any] = devs
    else:
        ids = [str(d) for d in devs]
    reference, dp = _pair(_mlp(devs[0]), ids)
    assert dp.device_ids == devs
    x = _randn(9, 5, device=devs[0])
    torch.testing.assert_close(dp(x), reference(x))


def test_module_not_on_first_device_raises(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    elsewhere = "meta" if devs[0].type == "cpu" else "cpu"
    message = "module must have its parameters and buffers on device"
    with pytest.raises(RuntimeError, match=message):
        dpcore.DataParallel(nn.Linear(3, 2, device=elsewhere), any_devices)
    with pytest.raises(RuntimeError, match=message):
        dpcore.data_parallel(nn.Linear(3, 2, device=elsewhere), torch.ones(4, 3, device=devs[0]), any_devices)
    # Checked at forward time too (torch's test_data_parallel_model_device):
    # a module moved after it was wrapped, and after its replicas were cached.
    dp = dpcore.DataParallel(nn.Linear(3, 2).to(devs[0]), any_devices)
    dp(torch.ones(4, 3, device=devs[0]))
    dp.to(elsewhere)
    with pytest.raises(RuntimeError, match=message):
        dp(torch.ones(4, 3, device=devs[0]))


# ---------------------------------------------------------------------------
# Inputs and outputs of any structure
# ---------------------------------------------------------------------------


class Structured(nn.Module):
    """Takes a nested structure, returns one of the same types."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).to(F64)

    def forward(self, nested: list[Any], od: OrderedDict, pair: Pair, batch: Batch) -> dict[str, Any]:
        a, (b, inner) = nested
        return {
            "list": [self.linear(a), (b * 2, {"c": inner["c"] + 1})],
            "od": OrderedDict([("z", od["z"] * 3), ("a", od["a"])]),
            "pair": Pair(self.linear(pair.first), pair.second),
            "batch": Batch(self.linear(batch.features) * batch.mask, batch.mask, batch.tag + "!"),
        }


def test_nested_inputs_and_outputs_keep_their_types(any_devices: list[Any]) -> None:
    # torch's DataParallel does not scatter dataclasses (#41327) and cannot
    # gather dataclass or string outputs (#62466).
    dev = _dev0(any_devices)
    torch.manual_seed(0)
    reference, dp = _pair(Structured().to(dev), any_devices)
    n = 6
    args = (
        [_randn(n, 4, device=dev, seed=1), (_randn(n, 2, device=dev, seed=2), {"c": _randn(n, 3, device=dev, seed=3)})],
        OrderedDict([("z", _randn(n, 1, device=dev, seed=4)), ("a", _randn(n, 2, device=dev, seed=5))]),
        Pair(_randn(n, 4, device=dev, seed=6), _randn(n, 1, device=dev, seed=7)),
        Batch(_randn(n, 4, device=dev, seed=8), torch.ones(n, 1, device=dev, dtype=F64)),
    )
    out = dp(*args)
    ref = reference(*args)
    assert type(out) is dict and list(out) == list(ref)
    assert type(out["list"]) is list and type(out["list"][1]) is tuple and type(out["list"][1][1]) is dict
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["z", "a"]
    assert type(out["pair"]) is Pair
    assert type(out["batch"]) is Batch
    k = min(len(any_devices), n)
    assert out["batch"].tag == ["batch!"] * k  # strings gather into a list, one per replica
    torch.testing.assert_close(out["list"][0], ref["list"][0])
    torch.testing.assert_close(out["list"][1][0], ref["list"][1][0])
    torch.testing.assert_close(out["list"][1][1]["c"], ref["list"][1][1]["c"])
    torch.testing.assert_close(out["od"]["z"], ref["od"]["z"])
    torch.testing.assert_close(out["pair"].first, ref["pair"].first)
    torch.testing.assert_close(out["batch"].features, ref["batch"].features)
    torch.testing.assert_close(out["batch"].mask, ref["batch"].mask)


class ManyArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).to(F64)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, scale: float, mode: str, *, bias: torch.Tensor, square: bool = False
    ) -> torch.Tensor:
        out = self.linear(x) * scale + y + bias
        if mode == "double":
            out = out * 2
        return out * out if square else out


def test_positional_non_tensor_and_keyword_inputs(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    torch.manual_seed(0)
    reference, dp = _pair(ManyArgs().to(dev), any_devices)
    x, y, b = _randn(7, 3, device=dev, seed=1), _randn(7, 2, device=dev, seed=2), _randn(7, 2, device=dev, seed=3)
    out = dp(x, y, 0.5, "double", bias=b, square=True)
    torch.testing.assert_close(out, reference(x, y, 0.5, "double", bias=b, square=True))
    out.sum().backward()
    reference(x, y, 0.5, "double", bias=b, square=True).sum().backward()
    _assert_grads_equal(dp.module, reference)


class KwargsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, dtype=F64))

    def forward(self, x: torch.Tensor | None = None, a: Any = None, b: Any = None, c: Any = None) -> Any:
        assert (type(a), type(b), type(c)) == (list, dict, tuple), "empty containers must arrive with their types"
        assert (len(a), len(b), len(c)) == (0, 0, 0)
        return (self.w * 2 if x is None else x * self.w), a, b, c


def test_kwargs_only_inputs_with_empty_containers(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    dp = dpcore.DataParallel(KwargsOnly().to(dev), any_devices)
    x = _randn(5, 2, device=dev)
    out, a, b, c = dp(x=x, a=[], b={}, c=())
    torch.testing.assert_close(out, x)
    assert (a, b, c) == ([], {}, ())
    # No tensor at all: one replica, the master.
    out, a, b, c = dp(a=[], b={}, c=())
    torch.testing.assert_close(out, torch.full((2,), 2.0, dtype=F64, device=dev))


class NoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(3, dtype=F64))

    def forward(self) -> torch.Tensor:
        return self.w * 2


def test_forward_without_inputs(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    module = NoInputs().to(dev)
    out = dpcore.DataParallel(module, any_devices)()
    torch.testing.assert_close(out, torch.tensor([0.0, 2.0, 4.0], dtype=F64, device=dev))
    out.sum().backward()
    torch.testing.assert_close(module.w.grad, torch.full((3,), 2.0, dtype=F64, device=dev))


# ---------------------------------------------------------------------------
# Autograd: no_grad, buffers requiring grad, sparse gradients, RNNs,
# double backward, autograd.grad
# ---------------------------------------------------------------------------


class RecordsGradMode(nn.Module):
    def __init__(self, counter: CallCounter) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3).to(F64)
        self.counter = counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.counter.add((torch.is_grad_enabled(), out.requires_grad))
        return out


def test_no_grad_reaches_replicas(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    counter = CallCounter()
    dp = dpcore.DataParallel(RecordsGradMode(counter).to(dev), any_devices)
    x = _randn(8, 3, device=dev)
    with torch.no_grad():
        out = dp(x)
    assert not out.requires_grad
    assert counter.records == [(False, False)] * len(any_devices)
    counter.records.clear()
    assert dp(x).requires_grad
    assert counter.records == [(True, True)] * len(any_devices)


def test_autocast_dtype_reaches_replicas(any_devices: list[Any]) -> None:
    # torch's workers re-enter autocast with the device type's default dtype.
    dev = _dev0(any_devices)
    dtype = torch.float16 if dev.type == "cpu" else torch.bfloat16  # not the default
    module = nn.Linear(4, 3).to(dev)
    dp = dpcore.DataParallel(module, any_devices, gather=False)
    with torch.autocast(dev.type, dtype=dtype):
        outputs = dp(torch.randn(8, 4).to(dev))
    assert [o.dtype for o in outputs] == [dtype] * len(any_devices)


class BufferRequiringGrad(nn.Module):
    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("t_rg", t)
        self.register_buffer("t_not_rg", t.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.t_rg + self.t_not_rg


def test_buffers_requiring_grad_are_differentiable(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    module = BufferRequiringGrad(_randn(10, device=dev).requires_grad_())
    assert module.t_rg.requires_grad
    dp = dpcore.DataParallel(module, any_devices)
    x = _randn(4, 10, device=dev, seed=1)
    (dp(x) ** 2).sum().backward()
    t = module.t_rg.detach().clone().requires_grad_()
    ((x * t + module.t_not_rg) ** 2).sum().backward()
    torch.testing.assert_close(module.t_rg.grad, t.grad)


def test_gradcheck_through_data_parallel(any_devices: list[Any]) -> None:
    # torch's test_data_parallel_buffers_requiring_grad: gradcheck of the
    # whole DataParallel step with respect to a buffer. gradcheck's
    # perturbations write through `.data` (no version counter sees them):
    # the check for such writes (tests/test_stale_parameters.py) finds them.
    dev = _dev0(any_devices)
    module = BufferRequiringGrad(_randn(3, device=dev).requires_grad_())
    dp = dpcore.DataParallel(module, any_devices)
    x = _randn(4, 3, device=dev, seed=2)

    def fn(t: torch.Tensor) -> torch.Tensor:
        assert t is module.t_rg
        return dp(x)

    assert torch.autograd.gradcheck(fn, (module.t_rg,))


def test_writes_through_data_reach_replicas(any_devices: list[Any]) -> None:
    # Legacy updates such as WGAN's weight clipping write through `.data`;
    # torch's DataParallel copies every step and sees them, dpcore's check
    # for writes no version counter sees (tests/test_stale_parameters.py).
    dev = _dev0(any_devices)
    module = _mlp(dev)
    dp = dpcore.DataParallel(module, any_devices)
    x = _randn(8, 5, device=dev)
    with torch.no_grad():
        dp(x)
        for p in module.parameters():
            p.data.clamp_(-0.01, 0.01)
        torch.testing.assert_close(dp(x), module(x))


def test_sparse_embedding_gradients(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    torch.manual_seed(0)
    reference, dp = _pair(nn.Embedding(10, 4, sparse=True).to(dev, F64), any_devices)
    idx = torch.randint(0, 10, (7, 3), generator=torch.Generator().manual_seed(1)).to(dev)
    (dp(idx) ** 2).sum().backward()
    (reference(idx) ** 2).sum().backward()
    assert dp.module.weight.grad.is_sparse
    _assert_grads_equal(dp.module, reference)


class FlattenedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True).to(F64)
        self.head = nn.Linear(4, 2).to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rnn.flatten_parameters()
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def test_scatter_along_dim_1_sequence_first_lstm(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    torch.manual_seed(0)
    reference, dp = _pair(nn.LSTM(3, 4).to(dev, F64), any_devices, dim=1)
    x = _randn(5, 7, 3, device=dev)  # (time, batch, features)
    out, (h, c) = dp(x)
    out_ref, (h_ref, c_ref) = reference(x)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(c, c_ref)
    (out.sum() + h.sum()).backward()
    (out_ref.sum() + h_ref.sum()).backward()
    _assert_grads_equal(dp.module, reference)


def test_lstm_with_flatten_parameters(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    torch.manual_seed(0)
    reference, dp = _pair(FlattenedLSTM().to(dev), any_devices)
    x = _randn(5, 6, 3, device=dev)
    out = dp(x)
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    _assert_grads_equal(dp.module, reference)
    with torch.no_grad():
        torch.testing.assert_close(dp(x), reference(x))


def test_gradient_penalty_double_backward(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices)

    def step(model: nn.Module) -> None:
        x = _randn(7, 5, device=dev, seed=3).requires_grad_()
        out = model(x)
        (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (grad_x.pow(2).sum() + out.pow(2).mean()).backward()

    step(dp)
    step(reference)
    _assert_grads_equal(dp.module, reference)


def test_autograd_grad_with_respect_to_module_parameters(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices)
    x = _randn(7, 5, device=dev)
    grads = torch.autograd.grad(dp(x).pow(2).sum(), list(dp.module.parameters()))
    expected = torch.autograd.grad(reference(x).pow(2).sum(), list(reference.parameters()))
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    assert all(p.grad is None for p in dp.module.parameters())


class ZeroGradInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.zero_grad()
        return self.linear(x)


def test_zero_grad_inside_a_replica_warns(any_devices: list[Any]) -> None:
    # Documented difference from torch: replica 0 is the master itself, so
    # its zero_grad() in forward clears the master's gradients (torch's
    # replicas are all copies); the other replicas warn as torch's do.
    dev = _dev0(any_devices)
    dp = dpcore.DataParallel(ZeroGradInForward().to(dev), any_devices)
    x = _randn(4, 3, device=dev)
    dp.module.linear.weight.grad = torch.ones_like(dp.module.linear.weight)
    if len(any_devices) > 1:
        with pytest.warns(UserWarning, match="zero_grad"), warnings.catch_warnings():
            # torch's zero_grad then reads .grad of the replica's parameters,
            # which are not leaves; its own warning about that is expected.
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            dp(x)
    else:  # one device: the master runs alone, as the bare module would
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dp(x)
    assert dp.module.linear.weight.grad is None  # cleared by replica 0, the master


def test_uninitialized_lazy_module_raises_torchs_error() -> None:
    # torch's message, before anything is sized (not a ValueError from numel).
    dp = dpcore.DataParallel(nn.LazyLinear(10), ["cpu"] * 4)
    with pytest.raises(RuntimeError, match=r"Modules with uninitialized parameters can't be used with `DataParallel`"):
        dp(torch.ones(8, 3))
    with pytest.raises(RuntimeError, match="Run a dummy forward pass"):
        dpcore.replicate(nn.LazyLinear(10), ["cpu"] * 2)
    # A lazy parameter outside a lazy module too.
    holder = nn.Module()
    holder.weight = nn.parameter.UninitializedParameter()
    with pytest.raises(RuntimeError, match="uninitialized parameters"):
        dpcore.replicate(holder, ["cpu"] * 2)
    # One device runs the bare module, which initializes itself; afterwards
    # the module replicates.
    lazy = nn.LazyLinear(10).to(F64)
    dpcore.DataParallel(lazy, ["cpu"])(_randn(8, 3, device=torch.device("cpu")))
    x = _randn(8, 3, device=torch.device("cpu"))
    torch.testing.assert_close(dpcore.DataParallel(lazy, ["cpu"] * 4)(x), lazy(x))


def test_frozen_and_trainable_tensors_never_share_a_bucket(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    module = nn.Sequential(nn.Linear(5, 8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).to(dev, F64)
    module[1].requires_grad_(False)
    module[2].eval()  # running statistics: the same output as one device
    reference, dp = _pair(module, any_devices)
    x = _randn(9, 5, device=dev)
    dp(x).sum().backward()
    reference(x).sum().backward()
    _assert_grads_equal(dp.module, reference)
    plan = dp._cache._bucket_plan
    if len(any_devices) == 1:
        assert plan == []  # the master runs alone: nothing to copy
        return
    # Trainable float64; frozen float64 (module[1] and the running stats);
    # frozen int64 (num_batches_tracked).
    assert [requires_grad for _, _, requires_grad in plan] == [True, False, False]
    for _, masters, requires_grad in plan:
        assert all(t.requires_grad == requires_grad for t in masters)
    # In order of each bucket's first tensor, every tensor exactly once.
    tensors = [t for _, masters, _ in plan for t in masters]
    assert {id(t) for t in tensors} == {id(t) for t in [*module.parameters(), *module.buffers()]}
    assert len(tensors) == len(list(module.parameters())) + len(list(module.buffers()))
    assert plan[0][1][0] is module[0].weight and plan[1][1][0] is module[1].weight
    assert plan[2][1] == [module[2].num_batches_tracked]


def test_small_buckets_are_autograd_nodes_of_their_own(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices, bucket_bytes=1)
    x = _randn(9, 5, device=dev)
    dp(x).sum().backward()
    reference(x).sum().backward()
    _assert_grads_equal(dp.module, reference)
    assert len(dp._cache.buckets) == (4 if len(any_devices) > 1 else 0)  # one tensor each


def test_reference_cycle_through_the_replica_cache_is_collected(any_devices: list[Any]) -> None:
    # The module refers to its wrapper: the cycle passes through the C++
    # replica set, which the garbage collector must see through.
    dev = _dev0(any_devices)
    module = _mlp(dev)
    dp = dpcore.DataParallel(module, any_devices)
    object.__setattr__(module, "owner", dp)
    dp(_randn(7, 5, device=dev)).sum().backward()
    assert dp._cache is not None
    # What the C++ object reports holding (not kept: it would keep dp alive).
    assert any(isinstance(r, list) and module in r for r in gc.get_referents(dp._cache._set))
    alive = weakref.ref(dp)
    del dp, module
    gc.collect()
    assert alive() is None


def _garbage_description() -> str:
    """Types of the objects in reference cycles, for a failure message."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        kinds: dict[str, int] = {}
        for obj in gc.garbage:
            kinds[type(obj).__qualname__] = kinds.get(type(obj).__qualname__, 0) + 1
        return ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:15])
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_no_reference_cycles(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    gc.collect()
    dp = dpcore.DataParallel(_mlp(dev), any_devices)
    x = _randn(7, 5, device=dev)
    dp(x).sum().backward()  # the first call builds the replica cache
    dp(x).sum().backward()
    with torch.no_grad():
        dp(x)
    found = gc.collect()
    if found:
        dp(x).sum().backward()
        pytest.fail(f"{found} objects in reference cycles after a step: {_garbage_description()}")


# ---------------------------------------------------------------------------
# Numerical equivalence over several SGD steps
# ---------------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4) if norm == "group" else nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, _) = self.rnn(x)
        return self.head(h[-1])


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(idx).mean(dim=1))


def _model_and_input(kind: str, dev: torch.device, step: int) -> tuple[Callable[[], nn.Module], torch.Tensor]:
    n = 9
    if kind == "mlp":
        return lambda: _mlp(dev), _randn(n, 5, device=dev, seed=step)
    if kind in ("cnn_groupnorm", "cnn_batchnorm_eval"):

        def build() -> nn.Module:
            torch.manual_seed(0)
            m = SmallCNN("group" if kind == "cnn_groupnorm" else "batch").to(dev, F64)
            if kind == "cnn_batchnorm_eval":
                with torch.no_grad():
                    m.norm.running_mean.uniform_(-0.5, 0.5)
                    m.norm.running_var.uniform_(0.5, 1.5)
                m.eval()
            return m

        return build, _randn(n, 2, 6, 6, device=dev, seed=step)
    if kind == "lstm":

        def build_lstm() -> nn.Module:
            torch.manual_seed(0)
            return LSTMClassifier().to(dev, F64)

        return build_lstm, _randn(n, 4, 3, device=dev, seed=step)
    if kind == "sparse_embedding":

        def build_bag() -> nn.Module:
            torch.manual_seed(0)
            return SparseBag().to(dev, F64)

        idx = torch.randint(0, 20, (n, 3), generator=torch.Generator().manual_seed(step)).to(dev)
        return build_bag, idx
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["mlp", "cnn_groupnorm", "cnn_batchnorm_eval", "lstm", "sparse_embedding"])
def test_sgd_steps_match_single_device(any_devices: list[Any], kind: str) -> None:
    dev = _dev0(any_devices)
    build, _ = _model_and_input(kind, dev, 0)
    module, reference = build(), build()
    dp = dpcore.DataParallel(module, any_devices)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    target = _randn(9, 3, device=dev, seed=99)
    for step in range(5):
        _, x = _model_and_input(kind, dev, step + 1)
        opt.zero_grad()
        opt_ref.zero_grad()
        out, out_ref = dp(x), reference(x)
        torch.testing.assert_close(out, out_ref)
        nn.functional.mse_loss(out, target).backward()
        nn.functional.mse_loss(out_ref, target).backward()
        _assert_grads_equal(module, reference)
        opt.step()
        opt_ref.step()
        _assert_params_equal(module, reference)


# ---------------------------------------------------------------------------
# Replicas follow the master: BatchNorm statistics, attributes, structure
# ---------------------------------------------------------------------------


def test_train_mode_batchnorm_updates_master_running_stats(any_devices: list[Any]) -> None:
    # As in torch: the running statistics come from replica 0's chunk (which
    # runs on the master itself); each replica normalises its own chunk.
    dev = _dev0(any_devices)
    bn = nn.BatchNorm1d(3).to(dev, F64)
    dp = dpcore.DataParallel(bn, any_devices)
    x = _randn(8, 3, device=dev) * 2 + 5
    out = dp(x)
    sizes = dpcore._split.split_sizes(8, len(any_devices))
    chunks = x.split(sizes)
    reference = nn.BatchNorm1d(3).to(dev, F64)
    expected = [nn.BatchNorm1d(3).to(dev, F64)(c) for c in chunks]
    reference(chunks[0])
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert int(bn.num_batches_tracked) == 1
    assert bn.running_mean.abs().sum() > 0.1  # really updated
    torch.testing.assert_close(out, torch.cat(expected))
    dp(x)
    assert int(bn.num_batches_tracked) == 2


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).to(F64)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale * (10.0 if self.training else 1.0)


def test_attribute_and_mode_changes_reach_replicas(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    torch.manual_seed(0)
    reference, dp = _pair(Scaled().to(dev), any_devices)
    x = _randn(8, 3, device=dev)
    torch.testing.assert_close(dp(x), reference(x))
    dp.module.scale = reference.scale = 3.0
    torch.testing.assert_close(dp(x), reference(x))
    dp.eval()
    reference.eval()
    assert not dp.module.training
    torch.testing.assert_close(dp(x), reference(x))
    dp.train()
    reference.train()
    torch.testing.assert_close(dp(x), reference(x))


class Extendable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)
        self.extra: nn.Parameter | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.second(torch.tanh(self.first(x)))
        return out if self.extra is None else out * self.extra


def _change(module: nn.Module, change: str, seed: int) -> None:
    torch.manual_seed(seed)
    dev = module.first.weight.device
    if change == "add_parameter":
        module.extra = nn.Parameter(torch.rand(2, dtype=F64, device=dev) + 0.5)
    elif change == "replace_linear":
        module.second = nn.Linear(4, 2).to(dev, F64)
    elif change == "freeze":
        module.first.weight.requires_grad_(False)
    elif change == "convert_dtype":  # same Parameter objects, new data
        module.to(torch.float32)
    else:
        raise AssertionError(change)


@pytest.mark.parametrize("change", ["add_parameter", "replace_linear", "freeze", "convert_dtype"])
def test_structural_change_rebuilds_cache(any_devices: list[Any], change: str) -> None:
    dev = _dev0(any_devices)
    torch.manual_seed(0)
    reference, dp = _pair(Extendable().to(dev, F64), any_devices)
    module = dp.module

    def steps(count: int, dtype: torch.dtype) -> None:
        opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
        opt_ref = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
        for step in range(count):
            x = _randn(7, 4, device=dev, seed=step, dtype=dtype)
            opt.zero_grad()
            opt_ref.zero_grad()
            out, out_ref = dp(x), reference(x)
            torch.testing.assert_close(out, out_ref)
            out.pow(2).sum().backward()
            out_ref.pow(2).sum().backward()
            _assert_grads_equal(module, reference)
            opt.step()
            opt_ref.step()

    steps(2, F64)
    cache = dp._cache
    _change(module, change, seed=5)
    _change(reference, change, seed=5)
    module.zero_grad()
    reference.zero_grad()
    steps(2, torch.float32 if change == "convert_dtype" else F64)
    if len(any_devices) > 1:
        assert dp._cache is not cache, "the replica cache was not rebuilt"
    if change == "freeze":
        assert module.first.weight.grad is None
    _assert_params_equal(module, reference)


class RegistersHooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.register_forward_hook(lambda *args: None)
        self.linear.register_forward_pre_hook(lambda *args: None)
        return self.linear(x)


def test_hooks_registered_in_a_replica_do_not_leak_to_the_master(any_devices: list[Any]) -> None:
    # torch's replicas share the master's hook dicts (a shallow __dict__
    # copy): every replica's registration lands on the master.
    dev = _dev0(any_devices)
    module = RegistersHooks().to(dev)
    dp = dpcore.DataParallel(module, any_devices)
    x = _randn(8, 3, device=dev)
    for _ in range(3):
        dp(x)
    # Replica 0 is the master itself, so exactly what the bare module would do.
    assert len(module._forward_hooks) == 3
    assert len(module.linear._forward_pre_hooks) == 3


def test_hooks_registered_on_the_master_run_on_every_replica(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    counter = CallCounter()
    module = _mlp(dev)
    module[0].register_forward_hook(lambda mod, args, out: counter.add(out.shape[0]))
    dp = dpcore.DataParallel(module, any_devices)
    dp(_randn(9, 5, device=dev))
    assert sorted(counter.records) == sorted(dpcore._split.split_sizes(9, len(any_devices)))


# ---------------------------------------------------------------------------
# state_dict, attribute fall-through, pickling
# ---------------------------------------------------------------------------


class HasChildNamedModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)


def test_state_dict_has_bare_keys_and_loads_both_ways(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    build = lambda seed: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(dev, F64)  # noqa: E731
    torch.manual_seed(0)
    bare = build(0)
    torch.manual_seed(1)
    dp = dpcore.DataParallel(build(1), any_devices)
    dp(_randn(8, 3, device=dev))  # running stats differ from bare's
    sd = dp.state_dict()
    assert list(sd) == list(bare.state_dict())  # torch's keys carry "module." (#3805)
    bare.load_state_dict(sd)
    _assert_params_equal(bare, dp.module)
    torch.manual_seed(2)
    other = build(2)
    dp.load_state_dict(other.state_dict())
    _assert_params_equal(dp.module, other)
    # A state dict written by torch.nn.DataParallel ("module." prefix).
    torch.manual_seed(3)
    torch_dp = nn.DataParallel(build(3))
    assert all(k.startswith("module.") for k in torch_dp.state_dict())
    dp.load_state_dict(torch_dp.state_dict())
    _assert_params_equal(dp.module, torch_dp.module)
    # A module whose own keys start with "module." is not stripped.
    inner = HasChildNamedModule().to(dev)
    wrapped = dpcore.DataParallel(HasChildNamedModule().to(dev), any_devices)
    wrapped.load_state_dict(inner.state_dict())
    _assert_params_equal(wrapped.module, inner)


def test_state_dict_of_a_parent_module_round_trips(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(dpcore.DataParallel(nn.Linear(3, 2).to(dev, F64), any_devices), nn.ReLU())

    source, target = build(0), build(1)
    assert list(source.state_dict()) == ["0.weight", "0.bias"]
    target.load_state_dict(source.state_dict())
    _assert_params_equal(target, source)
    # and from a parent holding a torch.nn.DataParallel
    torch.manual_seed(2)
    torch_parent = nn.Sequential(nn.DataParallel(nn.Linear(3, 2).to(dev, F64)), nn.ReLU())
    target.load_state_dict(torch_parent.state_dict())
    torch.testing.assert_close(target[0].module.weight, torch_parent[0].module.weight)


class WithAttribute(nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 2, dtype=F64)
        self.some_attr = "hello"

    def helper(self) -> int:
        return 42


def test_attribute_fall_through(any_devices: list[Any]) -> None:
    dp = dpcore.DataParallel(WithAttribute().to(_dev0(any_devices)), any_devices)
    assert dp.some_attr == "hello"
    assert dp.helper() == 42
    assert dp.weight is dp.module.weight
    with pytest.raises(AttributeError):
        dp.does_not_exist  # noqa: B018


def test_pickle_the_wrapper(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    dp = dpcore.DataParallel(_mlp(dev), any_devices)
    x = _randn(7, 5, device=dev)
    expected = dp(x)  # the replica cache (C++ buffers) exists now
    copy_ = pickle.loads(pickle.dumps(dp))
    assert copy_.module is not dp.module
    out = copy_(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert all(p.grad is not None for p in copy_.module.parameters())
    torch.testing.assert_close(copy.deepcopy(dp)(x), expected)


# ---------------------------------------------------------------------------
# dpcore.replicate
# ---------------------------------------------------------------------------


def test_replicate(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    module = _mlp(devs[0])
    x = _randn(4, 5, device=devs[0])
    expected = module(x).detach()
    replicas = dpcore.replicate(module, any_devices)
    assert len(replicas) == len(devs)
    total = 0
    for r, d in zip(replicas, devs):
        assert all(p.device == d for p in r.parameters())
        out = r(x.to(d))
        torch.testing.assert_close(out.to(devs[0]), expected)
        total = total + out.to(devs[0]).sum()
    total.backward()
    reference = copy.deepcopy(module)
    reference.zero_grad()
    (reference(x).sum() * len(devs)).backward()
    _assert_grads_equal(module, reference)
    # Replicas can be saved (torch's test_save_replica_module, gh-37182).
    torch.save(replicas, io.BytesIO())

    detached = dpcore.replicate(module, any_devices, detach=True)
    assert len(detached) == len(devs)
    for r in detached[1:]:
        assert all(p.grad_fn is None and not p.requires_grad for p in r.parameters())
        torch.testing.assert_close(r(x).detach(), expected)
    torch.save(detached, io.BytesIO())


# ---------------------------------------------------------------------------
# Loss inside the replicas
# ---------------------------------------------------------------------------


class Identity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones((), dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_criterion_loss_equals_whole_batch_loss(any_devices: list[Any]) -> None:
    # torch (DataParallel + mean of per-replica mean losses) gives 0.525 on two
    # devices for these 3 samples, the single-device loss is 0.4333 (#9811).
    dev = _dev0(any_devices)
    module = Identity().to(dev)
    dp = dpcore.DataParallel(module, any_devices, criterion=nn.L1Loss())
    x = torch.tensor([0.3, 0.2, 0.8], dtype=F64, device=dev)
    target = torch.zeros(3, dtype=F64, device=dev)
    loss = dp(x, target)
    assert loss.dim() == 0 and loss.device == dev
    torch.testing.assert_close(loss, torch.tensor(1.3 / 3, dtype=F64, device=dev))
    if len(any_devices) == 2:
        per_replica_mean = (0.25 + 0.8) / 2
        assert abs(loss.item() - per_replica_mean) > 0.09  # what torch's recipe gives
    loss.backward()
    reference = Identity().to(dev)
    nn.L1Loss()(reference(x), target).backward()
    torch.testing.assert_close(module.w.grad, reference.w.grad)


def test_criterion_sum_reduction_and_grads(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices, criterion=nn.MSELoss(reduction="sum"))
    x, target = _randn(7, 5, device=dev), _randn(7, 3, device=dev, seed=1)
    loss = dp(x, target)
    expected = nn.MSELoss(reduction="sum")(reference(x), target)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    _assert_grads_equal(dp.module, reference)
    # mean reduction of a multi-dimensional output
    reference.zero_grad()
    dp.module.zero_grad()
    dp_mean = dpcore.DataParallel(dp.module, any_devices, criterion=nn.MSELoss())
    loss = dp_mean(x, target)
    expected = nn.MSELoss()(reference(x), target)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    _assert_grads_equal(dp.module, reference)


# ---------------------------------------------------------------------------
# Splitting and gathering
# ---------------------------------------------------------------------------


def test_gather_false_returns_per_replica_outputs(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    module = _mlp(devs[0])
    dp = dpcore.DataParallel(module, any_devices, gather=False)
    x = _randn(9, 5, device=devs[0])
    outputs = dp(x)
    k = len(devs)
    sizes = [9 // k + (1 if i < 9 % k else 0) for i in range(k)]
    assert isinstance(outputs, list) and [o.shape[0] for o in outputs] == sizes
    assert [o.device for o in outputs] == devs
    torch.testing.assert_close(torch.cat([o.to(devs[0]) for o in outputs]), module(x))


class CountsCalls(nn.Module):
    def __init__(self, counter: CallCounter) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).to(F64)
        self.counter = counter

    def forward(self, x: torch.Tensor, tag: str = "", *, offset: float = 0.0) -> torch.Tensor:
        self.counter.add((x.shape[0], tag))
        return self.linear(x) + offset


def test_balanced_split_uses_every_device() -> None:
    # torch's chunk() splits 9 rows over 4 devices as 3, 3, 3 (one idle device).
    counter = CallCounter()
    dp = dpcore.DataParallel(CountsCalls(counter), ["cpu"] * 4)
    dp(_randn(9, 3, device=torch.device("cpu")))
    assert sorted(size for size, _ in counter.records) == [2, 2, 2, 3]


def test_balanced_split_any_device_list(any_devices: list[Any]) -> None:
    dev = _dev0(any_devices)
    counter = CallCounter()
    k = len(any_devices)
    dp = dpcore.DataParallel(CountsCalls(counter).to(dev), any_devices)
    dp(_randn(2 * k + 1, 3, device=dev))
    assert len(counter.records) == k
    assert max(s for s, _ in counter.records) - min(s for s, _ in counter.records) <= 1


def test_batch_smaller_than_device_count_with_non_tensor_and_kwargs() -> None:
    # torch replicates the non-tensor argument to every device but splits the
    # tensor into 3 chunks, then zips them: #15161-style failures.
    counter = CallCounter()
    module = CountsCalls(counter)
    dp = dpcore.DataParallel(module, ["cpu"] * 4)
    x = _randn(3, 3, device=torch.device("cpu"))
    out = dp(x, "tag", offset=1.5)
    assert sorted(counter.records) == [(1, "tag")] * 3
    torch.testing.assert_close(out, module.linear(x) + 1.5)


def test_mismatched_batch_sizes_raise(any_devices: list[Any]) -> None:
    # torch silently truncates to the shorter chunk list.
    dev = _dev0(any_devices)
    dp = dpcore.DataParallel(ManyArgs().to(dev), any_devices)
    with pytest.raises(ValueError, match=r"inputs\[1\].*size 6.*inputs\[0\].*size 7"):
        dp(_randn(7, 3, device=dev), _randn(6, 2, device=dev), 1.0, "", bias=_randn(7, 2, device=dev))
    with pytest.raises(ValueError, match=r"kwargs\['bias'\].*size 5.*inputs\[0\].*size 7"):
        dp(_randn(7, 3, device=dev), _randn(7, 2, device=dev), 1.0, "", bias=_randn(5, 2, device=dev))


class UsesWholeTable(nn.Module):
    def __init__(self, counter: CallCounter) -> None:
        super().__init__()
        self.counter = counter

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        self.counter.add((tuple(table.shape), table.device))
        return x @ table


def test_broadcast_argument_reaches_every_replica_whole(any_devices: list[Any]) -> None:
    devs = _devs(any_devices)
    counter = CallCounter()
    dp = dpcore.DataParallel(UsesWholeTable(counter), any_devices)
    x = _randn(8, 4, device=devs[0])
    table = _randn(4, 3, device=devs[0], seed=1).requires_grad_()
    out = dp(x, dpcore.Broadcast(table))
    assert sorted(counter.records, key=str) == sorted([((4, 3), d) for d in devs], key=str)
    torch.testing.assert_close(out, x @ table)
    out.pow(2).sum().backward()
    t = table.detach().clone().requires_grad_()
    (x @ t).pow(2).sum().backward()
    torch.testing.assert_close(table.grad, t.grad)


def test_chunk_sizes_and_weights() -> None:
    counter = CallCounter()
    module = CountsCalls(counter)
    x = _randn(10, 3, device=torch.device("cpu"))
    out = dpcore.DataParallel(module, ["cpu"] * 3, chunk_sizes=[6, 0, 4], gather=False)(x)
    assert [o.shape[0] for o in out] == [6, 4]
    assert sorted(s for s, _ in counter.records) == [4, 6]
    out = dpcore.DataParallel(module, ["cpu"] * 4, weights=[2, 1, 1, 1], gather=False)(x)
    assert [o.shape[0] for o in out] == [4, 2, 2, 2]
    torch.testing.assert_close(torch.cat(out), module.linear(x))
    with pytest.raises(ValueError, match="chunk_sizes"):
        dpcore.DataParallel(module, ["cpu"] * 3, chunk_sizes=[5, 5])


@pytest.mark.parametrize(
    ("options", "batch", "split"),
    [
        ({"chunk_sizes": [0, 6, 4]}, 10, r"chunk_sizes=\[0, 6, 4\] split the batch of 10 into \[0, 6, 4\]"),
        ({"weights": [0, 1, 1]}, 10, r"weights=\[0.0, 1.0, 1.0\] split the batch of 10 into \[0, 5, 5\]"),
        ({"weights": [0.1, 1, 1]}, 3, r"split the batch of 3 into \[0, 2, 1\]"),  # rounding, at this batch only
    ],
)
def test_a_split_that_leaves_the_first_device_out_is_an_error(options: dict[str, Any], batch: int, split: str) -> None:
    """The module lives on device_ids[0], which must get rows: a split that
    gives it none is an error naming the option and the split per device,
    before any replica runs."""
    counter = CallCounter()
    dp = dpcore.DataParallel(CountsCalls(counter), ["cpu"] * 3, **options)
    with pytest.raises(ValueError, match=r"the first device \(device_ids\[0\], which holds the module\) .*" + split):
        dp(_randn(batch, 3, device=torch.device("cpu")))
    assert counter.records == []
    if "weights" in options and batch == 3:
        assert dp(_randn(20, 3, device=torch.device("cpu"))).shape[0] == 20  # a larger batch gives it rows


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"chunk_sizes": [2.5, 2.5, 2, 2]}, TypeError, r"chunk_sizes\[0\]: expected an int, but got float 2\.5"),
        ({"chunk_sizes": ["2"] * 4}, TypeError, r"chunk_sizes\[0\]: expected an int, but got str '2'"),
        ({"chunk_sizes": 8}, TypeError, r"chunk_sizes: expected a sequence of ints, one per device, but got int 8"),
        ({"chunk_sizes": [4, 4, False, 0]}, TypeError, r"chunk_sizes\[2\]: expected an int, but got bool False"),
        ({"chunk_sizes": [4, 4, 1, -1]}, ValueError, r"chunk_sizes\[3\]: expected a non-negative size, but got -1"),
        ({"weights": [1, 1, "1", 1]}, TypeError, r"weights\[2\]: expected a real number, but got str '1'"),
        ({"weights": [1, 1, True, 1]}, TypeError, r"weights\[2\]: expected a real number, but got bool True"),
        ({"weights": [1, float("nan"), 1, 1]}, ValueError, r"weights\[1\]: expected a non-negative finite number"),
        ({"weights": [0, 0, 0, 0]}, ValueError, r"weights: expected a positive sum"),
        ({"weights": [1, 1]}, ValueError, r"weights: expected one weight per device \(4\), but got 2"),
        ({"chunk_sizes": [2] * 4, "weights": [1] * 4}, ValueError, "at most one of 'chunk_sizes' and 'weights'"),
    ],
)
def test_bad_split_arguments_are_rejected_at_construction(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    module = nn.Linear(3, 2)
    with pytest.raises(error, match=match):
        dpcore.DataParallel(module, ["cpu"] * 4, **options)


def test_numpy_and_torch_integer_chunk_sizes() -> None:
    module = nn.Linear(3, 2).to(F64)
    dp = dpcore.DataParallel(module, ["cpu"] * 3, chunk_sizes=[np.int64(5), torch.tensor(0), 3], gather=False)
    assert dp.chunk_sizes == [5, 0, 3] and all(type(c) is int for c in dp.chunk_sizes)
    out = dp(_randn(8, 3, device=torch.device("cpu")))
    assert [o.shape[0] for o in out] == [5, 3]


class ReturnsScalarAndLeaves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1).to(F64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str, int, float]:
        return self.linear(x).pow(2).mean(), "name", x.shape[0], 0.5


def test_zero_dim_outputs_gather_into_a_vector_without_warning(any_devices: list[Any]) -> None:
    # torch warns "Was asked to gather along dimension 0, but all input
    # tensors were scalars" every step; strings break its gather (#62466).
    dev = _dev0(any_devices)
    k = len(any_devices)
    dp = dpcore.DataParallel(ReturnsScalarAndLeaves().to(dev), any_devices)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses, names, sizes, halves = dp(_randn(2 * k, 3, device=dev))
    assert losses.shape == (k,) and losses.device == dev
    assert names == ["name"] * k and sizes == [2] * k and halves == [0.5] * k
    losses.sum().backward()
    assert dp.module.linear.weight.grad is not None


def test_device_list_errors() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="empty"):
        dpcore.DataParallel(module, [])
    with pytest.raises(ValueError, match="one type"):
        dpcore.DataParallel(module, ["cpu", "cuda:0"])
    with pytest.raises(ValueError, match="unsupported device type"):
        dpcore.DataParallel(nn.Linear(2, 2, device="meta"), ["meta", "meta"])
    with pytest.raises(ValueError, match="expected at least one device"):
        dpcore.data_parallel(module, torch.ones(2, 2), [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")
def test_invisible_cuda_device_raises_without_gpu() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        dpcore.DataParallel(nn.Linear(2, 2), [0])
    with pytest.raises(ValueError, match="CUDA device"):
        dpcore.DataParallel(nn.Linear(2, 2), ["cuda:1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="pass-through applies only without a GPU")
def test_no_device_list_without_gpu_is_a_pass_through() -> None:
    module = _mlp(torch.device("cpu"))
    dp = dpcore.DataParallel(module)
    x = _randn(5, 5, device=torch.device("cpu"))
    torch.testing.assert_close(dp(x), module(x))
    criterion_dp = dpcore.DataParallel(module, criterion=nn.MSELoss())
    target = _randn(5, 3, device=torch.device("cpu"), seed=1)
    torch.testing.assert_close(criterion_dp(x, target), nn.MSELoss()(module(x), target))


# ---------------------------------------------------------------------------
# The replica cache
# ---------------------------------------------------------------------------


def test_replica_cache_is_reused_and_unchanged_buckets_are_not_copied(any_devices: list[Any]) -> None:
    # torch rebuilds every replica and copies every parameter every step.
    dev = _dev0(any_devices)
    module = _mlp(dev)
    dp = dpcore.DataParallel(module, any_devices)
    x = _randn(8, 5, device=dev)
    with torch.no_grad():
        dp(x)
        cache = dp._cache
        replicas = [list(row) for row in cache.replica_modules]
        dp(x)
    assert dp._cache is cache
    assert len(replicas) == len(any_devices) - 1
    for before, after in zip(replicas, dp._cache.replica_modules):
        assert all(a is b for a, b in zip(before, after))
    if len(any_devices) == 1:
        assert cache.buckets == []  # the master runs alone: nothing to copy
        return
    assert all(not bucket.last_refresh_copied for bucket in cache.buckets)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    dp(x).sum().backward()
    opt.step()
    with torch.no_grad():
        out = dp(x)
    assert cache.buckets[0].last_refresh_copied
    torch.testing.assert_close(out, module(x))  # the replicas see the new weights


class BumpsItsCopy(nn.Module):
    """Replicas (not the master) change their parameter copy in place."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_is_replica", False):
            with torch.no_grad():
                self.w.add_(1.0)
        return x + self.w


@pytest.mark.parametrize("grad", [False, True])
def test_in_place_change_of_a_replica_copy_is_undone_next_step(any_devices: list[Any], grad: bool) -> None:
    dev = _dev0(any_devices)
    k = len(any_devices)
    module = BumpsItsCopy().to(dev)
    dp = dpcore.DataParallel(module, any_devices)
    x = torch.zeros(k, 3, dtype=F64, device=dev)
    expected = torch.tensor([[0.0]] + [[1.0]] * (k - 1), dtype=F64, device=dev).expand(k, 3)
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            # Each step starts from the master's values: the copy is refreshed.
            torch.testing.assert_close(dp(x), expected)
            if k > 1:
                assert dp._cache.buckets[0].last_refresh_copied
    torch.testing.assert_close(module.w, torch.zeros(3, dtype=F64, device=dev))


def test_inference_mode_steps_then_training(any_devices: list[Any]) -> None:
    # torch's workers lose inference mode; here it must reach the replicas,
    # and the replica cache built under it must stay usable for training.
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices)
    x = _randn(8, 5, device=dev)
    with torch.inference_mode():
        out = dp(x)
        assert out.is_inference()
        torch.testing.assert_close(out, reference(x))
        torch.testing.assert_close(dp(x), reference(x))
    opt, opt_ref = torch.optim.SGD(dp.module.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        dp(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        _assert_grads_equal(dp.module, reference)
        opt.step()
        opt_ref.step()
        with torch.inference_mode():
            torch.testing.assert_close(dp(x), reference(x))


def test_last_batch_smaller_than_device_count_then_full_batches(any_devices: list[Any]) -> None:
    # The replica count changes between steps (a short last batch).
    dev = _dev0(any_devices)
    reference, dp = _pair(_mlp(dev), any_devices)
    k = len(any_devices)
    for rows in (2 * k, max(1, k - 1), 1, 2 * k):
        x = _randn(rows, 5, device=dev, seed=rows)
        out = dp(x)
        torch.testing.assert_close(out, reference(x))
        out.sum().backward()
        reference(x).sum().backward()
        _assert_grads_equal(dp.module, reference)


class _Seen(nn.Module):
    """A linear layer that records the input tensor it was given and the output it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3, dtype=torch.float64)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.seen.append((x, out))
        return out


@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 3])
def test_a_lone_replica_gets_the_input_and_returns_its_output_as_is(devices: list[str]) -> None:
    # One replica on the tensors' device: the module is called as the bare module would be (no view of the
    # input, no copy of the output); values and gradients equal the bare module's.
    torch.manual_seed(0)
    model = _Seen()
    reference = copy.deepcopy(model)
    dp = dpcore.DataParallel(model, devices)
    x = torch.randn(1, 5, dtype=torch.float64, requires_grad=True)  # one row: one replica on any list
    out = dp(x)
    ((given, returned),) = model.seen
    assert given is x and out is returned
    x_ref = x.detach().clone().requires_grad_()
    want = reference(x_ref)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    _assert_grads_equal(model, reference)


class _Kw(nn.Module):
    """A linear layer over ``x * scale`` that records the tensors it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3, dtype=torch.float64)
        self.seen: list[tuple[Any, Any]] = []

    def forward(self, x: torch.Tensor, scale: Any = None) -> torch.Tensor:
        self.seen.append((x, scale))
        return self.linear(x if scale is None else x * scale)


@pytest.mark.parametrize("dim", [0, -2])
def test_a_one_device_list_passes_tensor_arguments_as_is_and_checks_them_as_a_split_would(dim: int) -> None:
    # A one-device call whose arguments are plain tensors of one row count takes them as is (positional and
    # keyword); any other call goes through the scatter rules, with their errors, on the same wrapper.
    torch.manual_seed(0)
    model = _Kw()
    reference = copy.deepcopy(model)
    dp = dpcore.DataParallel(model, ["cpu"], dim=dim)
    x, scale = torch.randn(4, 5, dtype=torch.float64), torch.rand(4, 1, dtype=torch.float64)
    out = dp(x, scale=scale)
    assert model.seen[-1][0] is x and model.seen[-1][1] is scale
    torch.testing.assert_close(out, reference(x, scale), rtol=0, atol=0)
    out = dp(x, scale=torch.tensor(2.0, dtype=torch.float64))  # a 0-dim tensor: the scatter's rule 1
    torch.testing.assert_close(out, reference(x, 2.0), rtol=0, atol=0)
    out = dp(x, scale=scale[:1])  # one row per replica (rule 3): the whole batch's one replica takes it
    torch.testing.assert_close(out, reference(x, scale[:1]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="scale"):  # sizes that fit no split: the scatter's error, naming it
        dp(x, scale=torch.rand(3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="dim"):
        dpcore.DataParallel(model, ["cpu"], dim=2)(x)


def test_a_one_device_list_calls_an_overridden_scatter_but_not_replicate_as_torch_does() -> None:
    calls: list[str] = []

    class Custom(dpcore.DataParallel):
        def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
            calls.append("scatter")
            return super().scatter(inputs, kwargs, device_ids)

        def replicate(self, module: nn.Module, device_ids: Any) -> Any:
            calls.append("replicate")
            return super().replicate(module, device_ids)

    model = _Kw()
    x = torch.randn(2, 5, dtype=torch.float64)
    torch.testing.assert_close(Custom(model, ["cpu"])(x), model(x), rtol=0, atol=0)
    assert calls == ["scatter"]
    del calls[:]
    Custom(model, ["cpu"] * 2)(x)
    assert calls == ["scatter", "replicate"]


def test_a_lone_replica_still_goes_through_an_overridden_gather_and_stacks_scalars() -> None:
    calls: list[int] = []

    class Gathering(dpcore.DataParallel):
        def gather(self, outputs: Any, output_device: Any) -> Any:
            calls.append(len(outputs))
            return super().gather(outputs, output_device)

    model = _Seen()
    x = torch.randn(1, 5, dtype=torch.float64)
    out = Gathering(model, ["cpu"] * 2)(x)
    assert calls == [1] and out is not model.seen[-1][1]  # the override ran and gathered a copy
    torch.testing.assert_close(out, model.seen[-1][1])

    class Scalar(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    assert dpcore.DataParallel(Scalar(), ["cpu"])(x).shape == (1,)  # per-replica scalars stacked, as with several
