"""torch.distributed.checkpoint (DCP) checkpoints move between the bare module, the wrapper with a plain optimizer
and the wrapper with a dpcore.ShardedOptimizer (also with shard_gradients=True and shard_parameters=True, where the
module's parameters are sharded at rest), in every direction and across device counts: get_state_dict ->
dcp.save -> dcp.load -> set_state_dict, in one process (no process group: DCP's no_dist=True), and training then
continues exactly as an uninterrupted run on one device (float64, AdamW). The keys are the bare module's, as DDP's
are: DCP is given the module (``dp.module``), since it names optimizer state by ``model.named_parameters()``,
which keep torch's ``module.`` on a wrapper; ``get_state_dict(dp, optimizer)`` says so, and every set_* takes the
wrapper itself."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import dpcore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KINDS = ["bare", "wrapper", "sharded", "grads", "params"]  # shard_gradients=True (ZeRO-2), shard_parameters=True
STEPS = 3  # before the checkpoint, and again after it
TOL = {"atol": 1e-10, "rtol": 1e-9}  # float64; sums over other device counts differ in their last bits


def _model(seed: int) -> nn.Module:
    """Uneven layers, BatchNorm statistics (buffers), a frozen bias."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 11), nn.BatchNorm1d(11), nn.Tanh(), nn.Linear(11, 7), nn.Tanh(), nn.Linear(7, 3))
    model[3].bias.requires_grad_(False)
    return model.double()


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randn(12, 3, generator=g, dtype=torch.float64))
        for _ in range(2 * STEPS)
    ]


class Run:
    """One training run: the bare module, or a wrapper over `count` CPU devices (BatchNorm synchronized: the
    statistics of the whole batch) with a plain or sharded AdamW."""

    def __init__(self, kind: str, count: int, seed: int) -> None:
        self.module = _model(seed)
        options = {"sync_batchnorm": True, "shard_gradients": kind == "grads", "shard_parameters": kind == "params"}
        self.net: nn.Module = (
            self.module if kind == "bare" else dpcore.DataParallel(self.module, ["cpu"] * count, **options)
        )
        kwargs = {"lr": 1e-2, "weight_decay": 0.1}
        if kind in ("sharded", "grads", "params"):
            self.opt: torch.optim.Optimizer = dpcore.ShardedOptimizer(
                _groups(self.module), torch.optim.AdamW, devices=self.net, **kwargs
            )
        else:
            self.opt = torch.optim.AdamW(_groups(self.module), **kwargs)

    def train(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            nn.functional.mse_loss(self.net(x), y).backward()
            self.opt.step()
            self.opt.zero_grad()


def _save(state: dict[str, Any], path: Path) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _load(state: dict[str, Any], path: Path) -> dict[str, Any]:
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _assert_same_training(run: Run, ref: Run) -> None:
    for (name, p), q in zip(run.module.state_dict().items(), ref.module.state_dict().values()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    ours, theirs = run.opt.state_dict(), ref.opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for i, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                ours["state"][i][key], value, **TOL, msg=lambda m, i=i, key=key: f"{i}.{key}: {m}"
            )


@pytest.fixture(scope="module")
def reference() -> Run:
    """The uninterrupted run on one device."""
    ref = Run("bare", 1, seed=0)
    ref.train(_batches())
    return ref


@pytest.mark.parametrize(("saved", "loaded"), list(itertools.product(KINDS, KINDS)))
def test_round_trip_continues_training_exactly(saved: str, loaded: str, reference: Run, tmp_path: Path) -> None:
    batches = _batches()
    first = Run(saved, 2, seed=0)
    first.train(batches[:STEPS])
    model_sd, optim_sd = get_state_dict(first.module, first.opt)
    _save({"model": model_sd, "optim": optim_sd}, tmp_path)

    second = Run(loaded, 3, seed=1)  # other weights and no state: the checkpoint must bring all of it
    model_sd, optim_sd = get_state_dict(second.module, second.opt)
    state = _load({"model": model_sd, "optim": optim_sd}, tmp_path)
    set_state_dict(second.net, second.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    second.train(batches[STEPS:])
    _assert_same_training(second, reference)


def test_checkpoint_keys_are_the_bare_modules(tmp_path: Path) -> None:
    keys = {}
    for kind in KINDS:
        run = Run(kind, 2, seed=0)
        run.train(_batches()[:1])
        model_sd, optim_sd = get_state_dict(run.module, run.opt)
        _save({"model": model_sd, "optim": optim_sd}, tmp_path / kind)
        keys[kind] = set(dcp.FileSystemReader(str(tmp_path / kind)).read_metadata().state_dict_metadata)
        assert list(model_sd) == list(_model(0).state_dict())
        assert set(optim_sd["state"]) == {n for n, p in _model(0).named_parameters() if p.requires_grad}
        if kind != "bare":  # the wrapper's own model state dict in DCP has the same keys
            assert list(get_model_state_dict(run.net)) == list(model_sd)
    assert keys["bare"] == keys["wrapper"] == keys["sharded"] == keys["grads"] == keys["params"]
    assert not any("module." in k for k in keys["bare"])


@pytest.mark.parametrize("kind", ["wrapper", "sharded", "grads", "params"])
def test_model_and_optimizer_variants(kind: str, reference: Run, tmp_path: Path) -> None:
    """get_model_state_dict / get_optimizer_state_dict saved apart, loaded into the wrapper by set_model_state_dict /
    set_optimizer_state_dict (the wrapper itself given as the model), also with full_state_dict and cpu_offload."""
    batches = _batches()
    first = Run(kind, 3, seed=0)
    first.train(batches[:STEPS])
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    _save({"model": get_model_state_dict(first.net)}, tmp_path / "model")
    _save({"optim": get_optimizer_state_dict(first.module, first.opt, options=options)}, tmp_path / "optim")

    second = Run("sharded" if kind == "wrapper" else "wrapper", 2, seed=1)
    model_sd = _load({"model": get_model_state_dict(second.net)}, tmp_path / "model")["model"]
    optim_sd = _load({"optim": get_optimizer_state_dict(second.module, second.opt)}, tmp_path / "optim")["optim"]
    assert set_model_state_dict(second.net, model_sd) == ([], [])
    set_optimizer_state_dict(second.net, second.opt, optim_sd)
    second.train(batches[STEPS:])
    _assert_same_training(second, reference)


@pytest.mark.parametrize("kind", ["wrapper", "sharded"])
def test_the_wrapper_as_dcps_model_for_the_optimizer_names_the_fix(kind: str) -> None:
    run = Run(kind, 2, seed=0)
    run.train(_batches()[:1])
    before = copy.deepcopy(run.opt.state_dict())
    with pytest.raises(ValueError, match=r"model: .* pass the wrapper's module \(dp.module\)"):
        get_state_dict(run.net, run.opt)
    with pytest.raises(ValueError, match=r"pass the wrapper's module \(dp.module\)"):
        get_optimizer_state_dict(run.net, run.opt)
    with pytest.raises(ValueError, match=r"pass the wrapper's module \(dp.module\)"):  # it walks named_parameters()
        get_model_state_dict(run.net, options=StateDictOptions(ignore_frozen_params=True))
    torch.testing.assert_close(run.opt.state_dict(), before)  # nothing stepped or changed by the refusals
    frozen = get_model_state_dict(run.module, options=StateDictOptions(ignore_frozen_params=True))
    assert "3.bias" not in frozen and "3.weight" in frozen


def test_a_module_with_a_child_named_module() -> None:
    """A module whose own child is called ``module`` keeps it in its keys; only the wrapper's level is bare."""
    inner = nn.Sequential()
    inner.module = nn.Linear(3, 2).double()  # type: ignore[assignment]
    dp = dpcore.DataParallel(inner, ["cpu"] * 2)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9)
    dp(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    assert list(get_model_state_dict(dp)) == ["module.weight", "module.bias"]
    model_sd, optim_sd = get_state_dict(inner, opt)
    assert list(optim_sd["state"]) == ["module.weight", "module.bias"]
    fresh = copy.deepcopy(inner)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    set_state_dict(
        dpcore.DataParallel(fresh, ["cpu"] * 3), fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    torch.testing.assert_close(fresh_opt.state_dict(), opt.state_dict())
