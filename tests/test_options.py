"""Options written after construction (issue 40): a write is checked as the constructor checks it, and the next call
follows it, equal to a wrapper built with that value and to the bare module on one device (float64); a refused write
raises the constructor's error and changes nothing; one the wrapper cannot follow is an error naming the option."""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import dpcore
from dpcore._options import ATTRIBUTES

F64 = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-12}
COUNTS = [2, 3]  # replicas; the batch (7 rows, 5 positions) splits unevenly over both


class Net(nn.Module):
    """A position-wise net (any dim splits it), BatchNorm over all positions with `bn`; with ``y=`` it returns
    ``{"loss", "logits"}``, the loss a mean over elements, a sum, or a mean over the kept positions (``y[..., 0] >= 0``).
    ``seen``: the input shape of every replica's call (a hook on the master runs on every replica)."""

    def __init__(self, seed: int = 0, bn: bool = False, loss: str = "mean") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 3).to(F64)
        self.bn = nn.BatchNorm1d(3).to(F64) if bn else None
        self.loss = loss
        self.seen: list[tuple[int, ...]] = []
        seen = self.seen
        self.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.lin(x)
        if self.bn is not None:
            out = self.bn(out.flatten(0, -2)).view_as(out)
        if y is None:
            return out
        losses = {"mean": lambda: mse(out, y), "sum": lambda: summed(out, y), "masked": lambda: masked(out, y)}
        return {"loss": losses[self.loss](), "logits": out}


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y, reduction="sum")


def masked(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A mean over the kept positions (a criterion with no ``.reduction``: it is declared)."""
    keep = y[..., 0] >= 0
    return (out - y).square().sum(-1)[keep].sum() / keep.sum()


def kept(*args: Any, **kwargs: Any) -> torch.Tensor:
    """loss_items for `masked`: the kept positions of a replica's target."""
    y = kwargs["y"] if "y" in kwargs else args[-1]
    return (y[..., 0] >= 0).sum()


def positions(*args: Any, **kwargs: Any) -> int:
    """A wrong loss_items for `masked`: every position."""
    y = kwargs["y"] if "y" in kwargs else args[-1]
    return y[..., 0].numel()


#: (attribute, options built with, value written, Net's arguments); a dict value is per replica count.
WRITES: list[tuple[str, dict[str, Any], Any, dict[str, Any]]] = [
    ("device_ids", {}, {2: ["cpu"] * 3, 3: ["cpu"] * 2}, {}),
    ("device_ids", {"chunk_sizes": {2: [5, 2], 3: [3, 3, 1]}}, {2: ["cpu"] * 2, 3: ["cpu"] * 3}, {}),
    ("output_device", {}, "cpu", {}),
    ("dim", {}, 1, {}),
    ("chunk_sizes", {}, {2: [2, 5], 3: [1, 4, 2]}, {}),
    ("chunk_sizes", {"chunk_sizes": {2: [2, 5], 3: [1, 4, 2]}}, None, {}),
    ("weights", {}, {2: [1, 3], 3: [3, 1, 2]}, {}),
    ("criterion", {"criterion": nn.MSELoss()}, nn.MSELoss(reduction="sum"), {}),  # the case
    ("criterion", {"criterion": nn.MSELoss(reduction="sum")}, nn.MSELoss(), {}),
    ("criterion", {}, nn.MSELoss(), {}),
    ("criterion", {"criterion": nn.MSELoss()}, None, {}),
    ("criterion", {"criterion": mse, "criterion_reduction": "sum"}, summed, {}),
    ("criterion_reduction", {"criterion": summed, "criterion_reduction": "mean"}, "sum", {}),
    ("model_loss", {}, "rows", {}),
    ("model_loss", {"model_loss": "rows"}, "sum", {"loss": "sum"}),
    ("model_loss", {"model_loss": "rows"}, None, {}),
    ("loss_items", {"model_loss": "items", "loss_items": positions}, kept, {"loss": "masked"}),
    ("loss_items", {"criterion": masked, "criterion_reduction": "mean", "loss_items": positions}, kept, {}),
    ("gather_output", {"gather": False}, True, {}),
    ("gather_output", {}, False, {}),
    ("bucket_bytes", {}, 64, {}),
    ("sync_batchnorm", {}, True, {"bn": True}),
    ("cuda_graphs", {}, False, {}),  # True needs CUDA devices: refused below
    ("replica_refresh", {}, "always", {}),
    ("shard_gradients", {"shard_gradients": True}, False, {}),
    ("shard_parameters", {}, False, {}),  # once sharded it is fixed: tests/test_shard_parameters.py
    ("reshard_after_forward", {}, False, {}),
    ("module", {}, "Net(seed=1)", {}),
]
#: (attribute, options built with, a value the constructor refuses with them).
REFUSED: list[tuple[str, dict[str, Any], Any]] = [
    ("device_ids", {}, []),
    ("device_ids", {}, ["cpu", "meta"]),
    ("device_ids", {"chunk_sizes": {2: [4, 3], 3: [3, 2, 2]}}, ["cpu"] * 4),
    ("output_device", {}, "meta"),
    ("output_device", {}, "cuda:7"),
    ("dim", {}, "1"),
    ("chunk_sizes", {}, [7]),
    ("chunk_sizes", {}, {2: [4, -3], 3: [4, 4, -1]}),
    ("chunk_sizes", {"weights": {2: [1, 1], 3: [1, 1, 1]}}, {2: [4, 3], 3: [3, 2, 2]}),
    ("weights", {}, {2: [0, 0], 3: [0, 0, 0]}),
    ("criterion", {}, 3),
    ("criterion", {"model_loss": "rows"}, nn.MSELoss()),
    ("criterion", {}, mse),  # no .reduction and none declared
    ("criterion", {"criterion": nn.MSELoss(), "loss_items": kept}, nn.MSELoss(reduction="sum")),
    ("criterion_reduction", {"criterion": summed, "criterion_reduction": "sum"}, "avg"),
    ("criterion_reduction", {"criterion": nn.MSELoss()}, "sum"),
    ("criterion_reduction", {}, "mean"),
    ("model_loss", {}, "loss"),
    ("model_loss", {"criterion": nn.MSELoss()}, "rows"),
    ("loss_items", {"model_loss": "items", "loss_items": kept}, 3),
    ("loss_items", {}, kept),
    ("gather_output", {}, "yes"),
    ("gather_output", {"model_loss": "rows"}, False),
    ("bucket_bytes", {}, 0),
    ("bucket_bytes", {}, 1.5),
    ("sync_batchnorm", {}, 1),
    ("cuda_graphs", {}, True),
    ("replica_refresh", {}, "never"),
    ("shard_gradients", {}, 1),
    ("shard_parameters", {}, 0),
    ("shard_parameters", {}, "yes"),
    ("reshard_after_forward", {}, 1),
    ("module", {}, 3),
    ("module", {}, "Net(seed=1).to('meta')"),
]
#: What a wrapper cannot follow after construction.
FIXED = ("process_group", "forward_sync_buffers", "broadcast_buffers")
#: ... and with a process group, since its ranks agreed on the module's layout on the first device.
FIXED_WITH_A_GROUP = ("module", "device_ids", "bucket_bytes", "sync_batchnorm")


def _at(value: Any, n: int) -> Any:
    """`value` for `n` replicas (a dict value is per count), a Net built from its description."""
    if isinstance(value, dict):
        return value[n]
    return eval(value) if isinstance(value, str) and value.startswith("Net(") else value  # noqa: S307


def _options(options: dict[str, Any], n: int) -> dict[str, Any]:
    return {k: _at(v, n) for k, v in options.items()}


def _argument(attribute: str) -> str:
    return "gather" if attribute == "gather_output" else attribute


def _build(module: nn.Module, n: int, options: dict[str, Any]) -> dpcore.DataParallel:
    return dpcore.DataParallel(module, **{"device_ids": ["cpu"] * n, **options})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(7, 5, 4, generator=g, dtype=F64), torch.randn(7, 5, 3, generator=g, dtype=F64)


def _call(dp: dpcore.DataParallel, x: torch.Tensor, y: torch.Tensor) -> Any:
    """The wrapper's result as the options read now ask for it: a loss, the model's output with its loss, or
    the output (the replicas' outputs joined along ``dim`` where they are not gathered)."""
    if dp.criterion is not None:
        return dp(x, y)
    if dp.model_loss is not None:
        return dp(x, y=y)
    out = dp(x)
    return out if dp.gather_output else torch.cat(out, dp.dim)


def _one_device(module: nn.Module, options: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
    if options.get("criterion") is not None:
        return options["criterion"](module(x), y)
    return module(x, y=y) if options.get("model_loss") is not None else module(x)


def _backward(result: Any) -> None:
    sum(t.square().sum() for t in tree_leaves(result)).backward()


def _built(dp: dpcore.DataParallel) -> tuple[Any, ...]:
    """What the replica cache was built with: for the module itself, its buckets, refresh rule and devices."""
    cache = dp._cache
    assert cache is not None and cache.module is dp.module
    return len(cache.buckets), cache._always, cache.devices


def _net(attribute: str, net: dict[str, Any]) -> Net:
    """The net the wrapper runs after the write (another one where ``module`` is written)."""
    return Net(seed=1) if attribute == "module" else Net(**net)


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize(("attribute", "options", "value", "net"), WRITES)
def test_a_write_is_followed_as_a_wrapper_built_with_it(
    attribute: str, options: dict[str, Any], value: Any, net: dict[str, Any], n: int
) -> None:
    """The call after the write equals a wrapper built with the value, and the bare module on the whole batch:
    result, gradients, BatchNorm statistics, each replica's chunk and what the replica cache was built with."""
    x, y = _batch()
    before, value = _options(options, n), _at(value, n)
    after = {**before, **({} if attribute == "module" else {_argument(attribute): value})}
    dp = _build(Net(**net), n, before)
    dp.eval()
    with torch.no_grad():  # a call with the old options: the cache built, the old loss rule used
        _call(dp, x, y)
    dp.train()
    dp.module.seen.clear()
    setattr(dp, attribute, value)
    fresh = _build(_net(attribute, net), n, after)
    if attribute == "module":
        assert dp.module is value
    else:
        assert getattr(dp, attribute) == getattr(fresh, attribute)
    bare = _net(attribute, net)
    got, built, expected = _call(dp, x, y), _call(fresh, x, y), _one_device(bare, after, x, y)
    torch.testing.assert_close(got, built, **TOL)
    torch.testing.assert_close(got, expected, **TOL)
    assert sorted(dp.module.seen) == sorted(fresh.module.seen) and len(dp.module.seen) == len(fresh.device_ids)
    assert _built(dp) == _built(fresh)
    for result in (got, built, expected):
        _backward(result)
    for a, b, c in zip(dp.module.state_dict().values(), fresh.module.state_dict().values(), bare.state_dict().values()):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(a, c, **TOL)
    for a, b, c in zip(dp.module.parameters(), fresh.module.parameters(), bare.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **TOL)
        torch.testing.assert_close(a.grad, c.grad, **TOL)


def test_every_option_is_written_and_refused_in_the_tables() -> None:
    """The rule covers every constructor argument: each is an attribute (``gather``: ``gather_output``) that
    WRITES follows and REFUSED refuses, or one FIXED names."""
    arguments = [p for p in inspect.signature(dpcore.DataParallel.__init__).parameters if p != "self"]
    attributes = {"gather_output" if p == "gather" else p for p in arguments}
    assert set(ATTRIBUTES) == attributes
    assert {w[0] for w in WRITES} == {r[0] for r in REFUSED} == attributes - set(FIXED)


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize(("attribute", "options", "value"), REFUSED)
def test_a_refused_write_raises_the_constructors_error_and_changes_nothing(
    attribute: str, options: dict[str, Any], value: Any, n: int
) -> None:
    before, value = _options(options, n), _at(value, n)
    after = {**before, **({} if attribute == "module" else {_argument(attribute): value})}
    with pytest.raises(Exception) as built:
        _build(value if attribute == "module" else Net(), n, after)
    dp = _build(Net(), n, before)
    options_before, module = dp._options, dp.module
    with pytest.raises(type(built.value)) as written:
        setattr(dp, attribute, value)
    assert str(written.value) == str(built.value)
    assert dp._options is options_before and dp.module is module


@pytest.mark.parametrize("attribute", FIXED)
def test_the_hybrid_options_are_fixed_at_construction(attribute: str) -> None:
    dp = _build(Net(), 2, {})
    with pytest.raises(AttributeError, match=rf"^{attribute}: cannot be changed after construction: "):
        setattr(dp, attribute, None)


@pytest.mark.parametrize("n", COUNTS)
def test_with_a_process_group_the_layout_is_fixed_and_the_loss_follows(world_of_one: Any, n: int) -> None:
    """With a group, what its ranks agreed on (the module, its devices, buckets, synchronized BatchNorm) is an
    error naming the option; a criterion written is followed, gradients synchronized as the bare module's."""
    x, y = _batch()
    dp = _build(Net(), n, {"process_group": world_of_one, "criterion": nn.MSELoss()})
    for attribute, value in zip(FIXED_WITH_A_GROUP, (Net(), ["cpu"] * n, 64, True)):
        with pytest.raises(
            AttributeError, match=rf"^{attribute}: cannot be changed after construction with process_group="
        ):
            setattr(dp, attribute, value)
    for attribute in FIXED:
        with pytest.raises(AttributeError, match=rf"^{attribute}: cannot be changed after construction: "):
            setattr(dp, attribute, None)
    dp(x, y).backward()
    dp.module.zero_grad()
    dp.criterion = nn.MSELoss(reduction="sum")
    bare = Net()
    got, expected = dp(x, y), summed(bare(x), y)
    torch.testing.assert_close(got, expected, **TOL)
    got.backward()
    expected.backward()
    for a, b in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


@pytest.mark.parametrize("n", COUNTS)
def test_a_criterions_reduction_changed_in_place_is_followed(n: int) -> None:
    """The issue's second case: ``.reduction`` written on the criterion itself is read at the next call."""
    x, y = _batch()
    criterion = nn.MSELoss()
    dp, bare = _build(Net(), n, {"criterion": criterion}), Net()
    for reduction in ("sum", "mean", "sum"):
        criterion.reduction = reduction
        torch.testing.assert_close(dp(x, y), criterion(bare(x), y), **TOL)
    criterion.reduction = "elementwise_mean"
    with pytest.raises(ValueError, match=r"^criterion: its reduction 'elementwise_mean' is not one dpcore knows"):
        dp(x, y)
    criterion.reduction = "mean"
    torch.testing.assert_close(dp(x, y), criterion(bare(x), y), **TOL)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"criterion_reduction": "mean"},
            r"^criterion_reduction='mean' disagrees with the criterion's own reduction='sum'",
        ),
        ({"loss_items": kept}, r"^loss_items: with criterion=, only for a mean criterion \(its reduction is 'sum'\)"),
    ],
)
def test_a_reduction_changed_in_place_that_the_options_refuse_is_an_error_naming_it(
    options: dict[str, Any], message: str
) -> None:
    x, y = _batch()
    criterion = nn.MSELoss()
    dp = _build(Net(), 2, {"criterion": criterion, **options})
    dp(x, y)
    criterion.reduction = "sum"
    with pytest.raises(ValueError, match=message):
        dp(x, y)


def test_a_criterion_module_stays_a_child_and_the_state_dict_the_bare_modules() -> None:
    """As torch's __setattr__ registers it: a Module criterion is a child (``dp.to`` reaches its weight), never in
    the wrapper's state dict; a criterion written replaces it there, a function or None leaves no child."""
    net = Net()
    keys = list(net.state_dict())
    dp = _build(net, 2, {"criterion": nn.MSELoss()})
    assert dict(dp.named_children()) == {"module": net, "criterion": dp.criterion}
    weighted = nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float32))
    dp.criterion = weighted
    assert dict(dp.named_children()) == {"module": net, "criterion": weighted}
    dp.to(F64)
    assert weighted.weight.dtype == F64
    assert list(dp.state_dict()) == keys
    dp.criterion = nn.MSELoss(reduction="sum")  # one write at a time, each checked with the others
    dp.criterion_reduction = "sum"
    dp.criterion = summed
    assert dict(dp.named_children()) == {"module": net} and dp.criterion is summed
    dp.criterion, dp.criterion_reduction, dp.criterion = nn.MSELoss(reduction="sum"), None, None
    assert dict(dp.named_children()) == {"module": net} and dp.criterion is None
    assert list(dp.state_dict()) == keys


def test_list_options_read_back_are_not_changed_in_place() -> None:
    dp = _build(nn.Linear(4, 3).to(F64), 2, {"chunk_sizes": [4, 3]})
    assert dp.device_ids == [torch.device("cpu")] * 2 and dp.chunk_sizes == [4, 3]
    with pytest.raises(TypeError, match=r"^device_ids: read-only; assign a new list"):
        dp.device_ids.append("cpu")
    with pytest.raises(TypeError, match=r"^chunk_sizes: read-only; assign a new list"):
        dp.chunk_sizes[0] = 5
    with pytest.raises(TypeError, match=r"^chunk_sizes: read-only"):
        dp.chunk_sizes += [1]
    assert dp.chunk_sizes == [4, 3]
    for copied in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert copied.device_ids == dp.device_ids and copied.chunk_sizes == [4, 3]
        x, y = _batch()
        torch.testing.assert_close(copied(x), dp(x), **TOL)
