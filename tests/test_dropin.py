"""dpcore.DataParallel where code written for torch.nn.DataParallel runs it:
an instance of torch's class, torch's four extension points overridable by
subclasses (the patterns of PyTorch-Encoding's DataParallelModel and of
BalancedDataParallel), dpcore.patch_torch() for library code that builds
torch's wrapper itself, the wrapped module's forward signature, and state
dicts read by torch's keys. Every numeric comparison is float64 against one
device over several optimizer steps."""

from __future__ import annotations

import copy
import importlib
import inspect
import io
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from dpcore.scatter_gather import scatter_kwargs

F64 = torch.float64
TORCH_DP = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel
LISTS = [pytest.param(["cpu"] * 2, id="cpu*2"), pytest.param(["cpu"] * 3, id="cpu*3")]
STEPS = 4
TOL = 1e-9


class Net(nn.Module):
    """A small MLP whose forward takes a keyword argument too (for the signature)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * scale


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def _batch(step: int, n: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, dtype=F64, generator=g), torch.randint(0, 5, (n,), generator=g)


LossOf = Callable[[Any, torch.Tensor], torch.Tensor]


def _train(model: nn.Module, wrapper: nn.Module, loss_of: LossOf | None, n: int = 11) -> list[float]:
    """STEPS SGD steps (momentum, weight decay) of `wrapper`, whose
    parameters are `model`'s; the losses (`loss_of(wrapper(x), y)`, or
    `wrapper(x, y)` itself when `loss_of` is None: criterion=)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, n)
        opt.zero_grad()
        loss = wrapper(x, y) if loss_of is None else loss_of(wrapper(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _mean_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _assert_same_training(
    wrap: Callable[[nn.Module], nn.Module],
    loss_of: LossOf | None = _mean_ce,
    n: int = 11,
    make: Callable[[], nn.Module] = _net,
) -> nn.Module:
    """Trains a wrapped and a bare copy of one model (`make()` twice); asserts
    equal losses and parameters at 1e-9; returns the wrapper."""
    reference, model = make(), make()
    wrapper = wrap(model)
    expected = _train(reference, reference, _mean_ce, n)
    got = _train(model, wrapper, loss_of, n)
    assert got == pytest.approx(expected, abs=TOL, rel=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=TOL, rtol=0, msg=name)
    return wrapper


# ---------------------------------------------------------------------------
# An instance of torch.nn.DataParallel, with dpcore's behaviour
# ---------------------------------------------------------------------------


def test_is_an_instance_of_torch_data_parallel() -> None:
    dp = dpcore.DataParallel(_net(), ["cpu"] * 2)
    assert isinstance(dp, torch.nn.DataParallel)
    assert isinstance(dp, torch.nn.parallel.DataParallel)
    assert issubclass(dpcore.DataParallel, TORCH_DP)


def test_every_method_torch_defines_is_dpcores() -> None:
    own = [name for name, value in vars(TORCH_DP).items() if callable(value) and not name.startswith("__class")]
    assert {"__init__", "forward", "scatter", "replicate", "parallel_apply", "gather"} <= set(own)
    for name in own:
        assert getattr(dpcore.DataParallel, name) is not getattr(TORCH_DP, name), name
    assert "src_device_obj" in vars(dpcore.DataParallel)


def test_torch_init_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.nn.DataParallel.__init__ ran")

    monkeypatch.setattr(TORCH_DP, "__init__", fail)
    dp = dpcore.DataParallel(_net(), ["cpu"] * 2)
    assert isinstance(dp, TORCH_DP)
    x, _ = _batch(0)
    torch.testing.assert_close(dp(x), dp.module(x), atol=TOL, rtol=0)


def test_attributes_state_dict_and_pickling_unchanged() -> None:
    model = _net()
    model.extra = "hello"
    dp = dpcore.DataParallel(model, ["cpu", "cpu"], output_device="cpu", dim=0)
    assert dp.module is model
    assert dp.device_ids == [torch.device("cpu")] * 2
    assert dp.output_device == torch.device("cpu") and dp.dim == 0
    assert dp.src_device_obj == torch.device("cpu")
    assert dp.extra == "hello" and dp.fc1 is model.fc1  # attribute fall-through
    assert list(dp.state_dict()) == list(model.state_dict())  # bare keys
    assert dp.gather_output is True and callable(dp.gather)
    x, _ = _batch(0)
    clone = pickle.loads(pickle.dumps(dp))
    assert isinstance(clone, torch.nn.DataParallel) and clone.gather_output is True
    torch.testing.assert_close(clone(x), model(x), atol=TOL, rtol=0)
    passthrough = dpcore.DataParallel(_net())  # no GPU, no list: the module as is
    assert passthrough.device_ids == [] and passthrough.src_device_obj is None


def test_nested_wrapper_replicas_are_torch_instances() -> None:
    """A dpcore wrapper nested in a model that is itself replicated."""
    _assert_same_training(_nested)


def _nested(model: nn.Module) -> nn.Module:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = dpcore.DataParallel(model, ["cpu"] * 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert isinstance(self.inner, torch.nn.DataParallel)
            return self.inner(x)

    return dpcore.DataParallel(Outer(), ["cpu"] * 2)


# ---------------------------------------------------------------------------
# torch's extension points, overridden as well-known subclasses do
# ---------------------------------------------------------------------------


class DataParallelModel(dpcore.DataParallel):
    """PyTorch-Encoding's pattern: gather keeps the per-device outputs (the
    loss is computed per device by a DataParallelCriterion); replicate runs
    a callback on every copy of every submodule that defines one."""

    gathered: int = 0

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        type(self).gathered += 1
        return outputs

    def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
        modules = super().replicate(module, device_ids)
        for copy_id, replica in enumerate(modules):
            for sub in replica.modules():
                if hasattr(sub, "__data_parallel_replicate__"):
                    sub.__data_parallel_replicate__(copy_id)
        return modules


class Tagged(Net):
    """A Net whose forward reports which replica copy ran it (set by the
    replication callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.copy_id = -1
        self.seen: list[tuple[int, int]] = []

    def __data_parallel_replicate__(self, copy_id: int) -> None:
        self.copy_id = copy_id

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.seen.append((self.copy_id, x.shape[0]))
        return super().forward(x, scale)


def _per_device_loss(outputs: Any, y: torch.Tensor) -> torch.Tensor:
    """DataParallelCriterion's job for the mean cross-entropy: each replica's
    sum, on its device, added up and divided by the batch."""
    assert isinstance(outputs, (list, tuple)), type(outputs)
    targets = torch.split(y, [o.shape[0] for o in outputs])
    total = sum(F.cross_entropy(o, t, reduction="sum").to("cpu") for o, t in zip(outputs, targets))
    return total / y.shape[0]


@pytest.mark.parametrize("devices", LISTS)
def test_gather_override_keeps_per_device_outputs(devices: list[str]) -> None:
    class KeepOutputs(dpcore.DataParallel):
        def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
            return list(outputs)

    dp = _assert_same_training(lambda m: KeepOutputs(m, devices), _per_device_loss)
    outputs = dp(_batch(0)[0])
    assert isinstance(outputs, list) and len(outputs) == len(devices)


@pytest.mark.parametrize("devices", LISTS)
def test_replicate_override_runs_callbacks_on_every_copy(devices: list[str]) -> None:
    seen: list[tuple[int, int]] = []

    def wrap(model: nn.Module) -> nn.Module:
        model.seen = seen
        return DataParallelModel(model, devices)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return Tagged().double()

    DataParallelModel.gathered = 0
    _assert_same_training(wrap, _per_device_loss, make=make)
    assert DataParallelModel.gathered == STEPS
    per_step = len(devices)
    assert len(seen) == STEPS * per_step
    for step in range(STEPS):
        ids = sorted(c for c, _ in seen[step * per_step : (step + 1) * per_step])
        assert ids == list(range(len(devices)))  # each replica ran with its own copy id


class BalancedDataParallel(dpcore.DataParallel):
    """The BalancedDataParallel pattern: device 0 (which also holds the
    gathered outputs) gets `gpu0_bsz` rows, the other devices share the rest."""

    def __init__(self, gpu0_bsz: int, *args: Any, **kwargs: Any) -> None:
        self.gpu0_bsz = gpu0_bsz
        super().__init__(*args, **kwargs)

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[Any]) -> Any:
        bsz = inputs[0].size(self.dim)
        num_dev = len(self.device_ids)
        bsz_unit = (bsz - self.gpu0_bsz) // (num_dev - 1)
        if self.gpu0_bsz >= bsz_unit:
            return super().scatter(inputs, kwargs, device_ids)
        chunk_sizes = [self.gpu0_bsz] + [bsz_unit] * (num_dev - 1)
        for i in range(bsz - sum(chunk_sizes)):
            chunk_sizes[i + 1] += 1
        scattered = scatter_kwargs(inputs, kwargs, device_ids, self.dim, chunk_sizes=chunk_sizes)
        return scattered.args, scattered.kwargs  # torch's plain pair


@pytest.mark.parametrize("devices", LISTS)
def test_scatter_override_gives_device_zero_a_smaller_share(devices: list[str]) -> None:
    seen: list[int] = []

    def wrap(model: nn.Module) -> nn.Module:
        model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
        return BalancedDataParallel(1, model, devices)

    _assert_same_training(wrap)
    n = len(devices)
    rest = [(11 - 1) // (n - 1) + (1 if i < (11 - 1) % (n - 1) else 0) for i in range(n - 1)]
    assert sorted(seen[:n]) == sorted([1, *rest]) and len(seen) == STEPS * n


@pytest.mark.parametrize("devices", LISTS)
def test_scatter_override_with_criterion_weights_by_rows(devices: list[str]) -> None:
    """With criterion=, each replica's loss is weighted by the rows that the
    override gave it (1 on device 0): the mean over the whole batch."""
    seen: list[int] = []

    def wrap(model: nn.Module) -> nn.Module:
        model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
        return BalancedDataParallel(1, model, devices, criterion=nn.CrossEntropyLoss())

    _assert_same_training(wrap, loss_of=None)
    assert sorted(seen[: len(devices)])[0] == 1  # the override's split ran


def test_scatter_override_with_criterion_is_really_weighted() -> None:
    """The weighting is not the plain mean of the replicas' losses (which
    differs for the 1 / 5 / 5 split): the check above can fail."""
    model = _net()
    dp = BalancedDataParallel(1, model, ["cpu"] * 3, criterion=nn.CrossEntropyLoss())
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    x, y = _batch(0)
    with torch.no_grad():
        loss = dp(x, y)
    assert sorted(seen) == [1, 5, 5]
    with torch.no_grad():
        parts = [F.cross_entropy(model(a), b) for a, b in zip(torch.split(x, [1, 5, 5]), torch.split(y, [1, 5, 5]))]
        assert float(loss) == pytest.approx(float(F.cross_entropy(model(x), y)), abs=TOL)
    assert abs(float(sum(parts) / 3) - float(loss)) > 1e-6


class Sequential(dpcore.DataParallel):
    """parallel_apply overridden: the replicas run one after another in the
    calling thread (a pattern used to debug, or to bound memory)."""

    calls: list[int] = []

    def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        type(self).calls.append(len(replicas))
        assert threading.current_thread() is threading.main_thread()
        return [r(*i, **k) for r, i, k in zip(replicas, inputs, kwargs)]


@pytest.mark.parametrize("devices", LISTS)
def test_parallel_apply_override_is_called(devices: list[str]) -> None:
    Sequential.calls = []
    _assert_same_training(lambda m: Sequential(m, devices))
    assert Sequential.calls == [len(devices)] * STEPS


@pytest.mark.parametrize("devices", LISTS)
def test_parallel_apply_override_with_criterion_gets_loss_callables(devices: list[str]) -> None:
    Sequential.calls = []
    _assert_same_training(lambda m: Sequential(m, devices, criterion=nn.CrossEntropyLoss()), None)
    assert Sequential.calls == [len(devices)] * STEPS


def test_override_that_calls_torch_style_super_parallel_apply() -> None:
    class Counting(dpcore.DataParallel):
        count = 0

        def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
            type(self).count += 1
            return super().parallel_apply(replicas, inputs, kwargs)

    _assert_same_training(lambda m: Counting(m, ["cpu"] * 3, chunk_sizes=[4, 0, 7]))
    assert Counting.count == STEPS


def test_one_device_calls_scatter_only_and_returns_the_output_as_is() -> None:
    """torch: with one device, replicate, parallel_apply and gather are not called."""
    DataParallelModel.gathered = 0
    model = _net()
    dp = DataParallelModel(model, ["cpu"])
    x, _ = _batch(0)
    out = dp(x)
    assert isinstance(out, torch.Tensor) and DataParallelModel.gathered == 0
    torch.testing.assert_close(out, model(x), atol=TOL, rtol=0)


def test_not_overridden_keeps_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No override (or only gather's): every call goes through the four methods, as torch's forward, and the
    cached replicas serve every call (the defaults read the call's record: no second path)."""
    calls: list[int] = []
    default = dpcore.DataParallel.parallel_apply

    def counted(self: Any, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        calls.append(len(replicas))
        return default(self, replicas, inputs, kwargs)

    monkeypatch.setattr(dpcore.DataParallel, "parallel_apply", counted)
    dp = dpcore.DataParallel(_net(), ["cpu"] * 3)
    x, _ = _batch(0)
    dp(x).sum().backward()
    cache = dp._cache
    assert cache is not None
    dp(x).sum().backward()
    assert dp._cache is cache and calls == [3, 3]

    class OnlyGather(dpcore.DataParallel):
        def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
            return outputs

    dp = OnlyGather(_net(), ["cpu"] * 2)
    dp(_batch(0)[0])
    cache = dp._cache
    dp(_batch(1)[0])
    assert cache is not None and dp._cache is cache


def test_replicate_override_reuses_the_cache() -> None:
    class Counting(dpcore.DataParallel):
        count = 0

        def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
            type(self).count += 1
            return super().replicate(module, device_ids)

    dp = Counting(_net(), ["cpu"] * 3)
    dp(_batch(0)[0])
    cache = dp._cache
    dp(_batch(1)[0])
    assert cache is not None and dp._cache is cache and Counting.count == 2


def test_options_that_would_skip_an_override_are_errors() -> None:
    with pytest.raises(ValueError, match="cuda_graphs=True .* overrides replicate"):
        DataParallelModel(_net(), ["cpu"] * 2, cuda_graphs=True)
    with pytest.raises(ValueError, match="sync_batchnorm=True .* overrides parallel_apply"):
        Sequential(_net(), ["cpu"] * 2, sync_batchnorm=True)
    # checked once, at construction, before any call
    with pytest.raises(ValueError, match="overrides gather, but criterion="):
        DataParallelModel(_net(), ["cpu"] * 2, criterion=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="overrides gather, but gather=False"):
        DataParallelModel(_net(), ["cpu"] * 2, gather=False)
    with pytest.raises(ValueError, match="overrides gather, but model_loss="):
        DataParallelModel(_net(), ["cpu"] * 2, model_loss="rows")


def test_scatter_override_returning_too_many_replicas_is_an_error() -> None:
    class TooMany(dpcore.DataParallel):
        def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
            return [(t,) for t in inputs[0].split(2)], None

    with pytest.raises(ValueError, match="scatter: returned 6 replicas' arguments for 2 device"):
        TooMany(_net(), ["cpu"] * 2)(_batch(0)[0])


def test_scatter_override_without_rows_under_criterion_is_an_error() -> None:
    class NoRows(dpcore.DataParallel):
        def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
            x, y = inputs
            return [(x[:5], y[:5]), ("no tensor", 3)], None

    dp = NoRows(_net(), ["cpu"] * 2, criterion=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="replica 1 no tensor with a dimension 0"):
        dp(*_batch(0))


# ---------------------------------------------------------------------------
# dpcore.patch_torch(): library code that builds torch.nn.DataParallel itself
# ---------------------------------------------------------------------------


def _torch_names() -> list[Any]:
    return [
        torch.nn.DataParallel,
        torch.nn.parallel.DataParallel,
        importlib.import_module("torch.nn.parallel.data_parallel").DataParallel,
    ]


class FakeTrainer:
    """Hugging Face Trainer's wrapping, reduced: unwrap by isinstance (as
    accelerate's extract_model_from_parallel), wrap with nn.DataParallel
    looked up when called, when there are several GPUs."""

    def __init__(self, model: nn.Module, n_gpu: int = 2) -> None:
        self.model, self.n_gpu = model, n_gpu

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if extract_model_from_parallel(model) is not model:
            return model  # already wrapped
        if self.n_gpu > 1:
            model = nn.DataParallel(model)
        return model


def extract_model_from_parallel(model: nn.Module) -> nn.Module:
    """accelerate's unwrap, reduced to its isinstance loop."""
    options = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while isinstance(model, options):
        model = model.module
    return model


@pytest.fixture
def unpatched() -> Any:
    yield
    dpcore.unpatch_torch()
    assert all(name is TORCH_DP for name in _torch_names())


def test_patch_builds_dpcores_wrapper_and_undoes(unpatched: None) -> None:
    torch_built = torch.nn.DataParallel(_net())  # torch's own, before the patch
    with dpcore.patch_torch() as handle:
        assert handle.active
        for name in _torch_names():
            dp = name(_net(), ["cpu"] * 2)
            assert isinstance(dp, dpcore.DataParallel) and dp.device_ids == [torch.device("cpu")] * 2
        # isinstance by torch's name still holds for torch's own wrapper, and for dpcore's
        assert isinstance(torch_built, torch.nn.DataParallel)
        assert isinstance(dpcore.DataParallel(_net(), ["cpu"]), torch.nn.DataParallel)
        assert issubclass(TORCH_DP, torch.nn.DataParallel)
        assert not isinstance(torch_built, dpcore.DataParallel)
        assert type(torch.nn.DataParallel(_net())).__name__ == "DataParallel"
        # default devices: with no GPU and no list, the module runs as is (as torch's)
        default = torch.nn.DataParallel(_net())
        assert isinstance(default, dpcore.DataParallel) and default.device_ids == []
        x, _ = _batch(0)
        torch.testing.assert_close(default(x), default.module(x), atol=0, rtol=0)
    assert not handle.active
    assert all(name is TORCH_DP for name in _torch_names())
    assert type(torch.nn.DataParallel(_net())) is TORCH_DP


def test_patch_nesting_handles_and_unpatch(unpatched: None) -> None:
    outer = dpcore.patch_torch()
    inner = dpcore.patch_torch()
    inner.undo()
    assert torch.nn.DataParallel is not TORCH_DP  # the outer patch holds
    inner.undo()  # twice: nothing
    assert torch.nn.DataParallel is not TORCH_DP
    outer.undo()
    assert torch.nn.DataParallel is TORCH_DP
    dpcore.patch_torch()
    handle = dpcore.patch_torch()
    assert dpcore.unpatch_torch() is True
    assert torch.nn.DataParallel is TORCH_DP and not handle.active
    handle.undo()
    assert dpcore.unpatch_torch() is False


def test_patched_trainer_wrap_model_builds_dpcore(unpatched: None) -> None:
    model = _net()
    with dpcore.patch_torch():
        wrapped = FakeTrainer(model)._wrap_model(model)
        assert isinstance(wrapped, dpcore.DataParallel) and wrapped.module is model
        assert FakeTrainer(wrapped)._wrap_model(wrapped) is wrapped  # not wrapped twice
    unpatched_wrap = FakeTrainer(model)._wrap_model(model)
    assert type(unpatched_wrap) is TORCH_DP


def test_trainer_style_code_does_not_wrap_dpcore_twice() -> None:
    dp = dpcore.DataParallel(_net(), ["cpu"] * 2)
    assert FakeTrainer(dp)._wrap_model(dp) is dp


def test_unwrap_by_isinstance_and_get_name() -> None:
    """accelerate's extract_model_from_parallel and transformers' _get_name()
    of the unwrapped model (Trainer's causal-LM check for label smoothing)."""
    model = _net()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    assert extract_model_from_parallel(dp) is model
    assert extract_model_from_parallel(dp)._get_name() == "Net"


# ---------------------------------------------------------------------------
# forward's signature, state dicts read by torch's keys
# ---------------------------------------------------------------------------


def test_forward_signature_is_the_modules() -> None:
    model = _net()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    assert inspect.signature(dp.forward) == inspect.signature(model.forward)
    assert list(inspect.signature(dp.forward).parameters) == ["x", "scale"]
    nested = dpcore.DataParallel(dp, ["cpu"] * 2)
    assert inspect.signature(nested.forward) == inspect.signature(model.forward)
    x, _ = _batch(0)
    torch.testing.assert_close(dp.forward(x, scale=2.0), model(x) * 2.0, atol=TOL, rtol=0)
    # with criterion= the target is an extra last positional argument: the generic signature
    with_loss = dpcore.DataParallel(model, ["cpu"] * 2, criterion=nn.CrossEntropyLoss())
    assert list(inspect.signature(with_loss.forward).parameters) == ["inputs", "kwargs"]


def test_state_dict_has_the_bare_keys_only() -> None:
    model = _net()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    sd = dp.state_dict()
    assert list(sd) == list(model.state_dict())
    assert "module.fc1.weight" not in sd and sd.get("module.fc1.weight") is None  # keys(), in and [] agree
    with pytest.raises(KeyError):
        sd["module.fc1.weight"]
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is OrderedDict and loaded._metadata == sd._metadata
    assert type(copy.deepcopy(sd)) is OrderedDict and type(pickle.loads(pickle.dumps(sd))) is OrderedDict
    _net(1).load_state_dict(sd)  # loads into the bare module
    dp.load_state_dict({"module." + k: v for k, v in sd.items()})  # and torch's keys into the wrapper


def test_state_dict_no_alias_for_a_child_named_module() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.w = nn.Parameter(torch.zeros(2))

    sd = dpcore.DataParallel(Holder(), ["cpu"] * 2).state_dict()
    assert "module.weight" in sd
    with pytest.raises(KeyError):
        sd["module.w"]  # a bare-key reader's missing key must not become "w"


class ModelEmaV1:
    """timm's ModelEma (v1) update rule: a copy of the bare model, updated
    from anything that has ``.module`` through ``module.``-prefixed keys."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.ema = copy.deepcopy(model)
        self.decay = decay
        self.ema_has_module = hasattr(self.ema, "module")

    def update(self, model: nn.Module) -> None:
        needs_module = hasattr(model, "module") and not self.ema_has_module
        with torch.no_grad():
            msd = model.state_dict()
            for k, ema_v in self.ema.state_dict().items():
                if needs_module:
                    k = "module." + k
                model_v = msd[k].detach()
                ema_v.copy_(ema_v * self.decay + (1.0 - self.decay) * model_v)


@pytest.mark.parametrize("devices", LISTS)
def test_timm_model_ema_v1_reads_the_wrapper(devices: list[str]) -> None:
    """timm's ModelEma (v1) built from the wrapper tracks it exactly; one
    built from the bare model reads torch's prefixed keys from the wrapper's
    state dict, which holds the bare keys only: a KeyError naming the rule."""
    model, reference = _net(), _net()
    dp = dpcore.DataParallel(model, devices)
    ema, ema_ref = ModelEmaV1(dp), ModelEmaV1(reference)
    for wrapper, bare, e in ((dp, model, ema), (reference, reference, ema_ref)):
        opt = torch.optim.SGD(bare.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            F.cross_entropy(wrapper(x), y).backward()
            opt.step()
            e.update(wrapper)
    for p, q in zip(ema.ema.parameters(), ema_ref.ema.parameters()):
        torch.testing.assert_close(p, q, atol=TOL, rtol=0)
    assert not torch.equal(ema.ema.module.fc1.weight, _net().fc1.weight)
    with pytest.raises(KeyError, match="bare module's keys"):
        ModelEmaV1(_net()).update(dp)


# ---------------------------------------------------------------------------
# With the real libraries, where installed
# ---------------------------------------------------------------------------


def _tiny_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def test_accelerate_unwrap_model() -> None:
    accelerate = pytest.importorskip("accelerate")
    model = _net()
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    assert accelerate.Accelerator(cpu=True).unwrap_model(dp) is model
    assert accelerate.utils.extract_model_from_parallel(dp) is model


def _trainer(model: nn.Module, out: str, n_gpu: int = 2) -> Any:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=out, use_cpu=True, report_to=[], save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args)
    trainer.args._n_gpu = n_gpu  # Trainer's multi-GPU branches, as on a machine with 2 GPUs
    return trainer


def test_trainer_does_not_wrap_dpcore_twice(tmp_path: Any) -> None:
    bert = _tiny_bert()
    dp = dpcore.DataParallel(bert, ["cpu"] * 2)
    trainer = _trainer(dp, str(tmp_path))
    assert trainer._wrap_model(trainer.model) is dp


def test_patched_trainer_wraps_in_dpcore(tmp_path: Any, unpatched: None) -> None:
    bert = _tiny_bert()
    trainer = _trainer(bert, str(tmp_path))
    with dpcore.patch_torch():
        wrapped = trainer._wrap_model(trainer.model)
    assert isinstance(wrapped, dpcore.DataParallel) and wrapped.module is bert


def test_trainer_save_model_writes_config(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    bert = _tiny_bert()
    trainer = _trainer(dpcore.DataParallel(bert, ["cpu"] * 2), str(tmp_path))
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").exists()
    again = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    for p, q in zip(again.parameters(), bert.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_trainer_keeps_the_columns_the_model_takes(tmp_path: Any) -> None:
    bert = _tiny_bert()
    trainer = _trainer(dpcore.DataParallel(bert, ["cpu"] * 2), str(tmp_path))
    trainer._set_signature_columns_if_needed()
    assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
