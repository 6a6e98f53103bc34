"""DataParallel(shard_parameters=...) with dpcore.ShardedOptimizer (ZeRO-3 in one process): each parameter lives
whole at one owner between calls (the module's own tensor emptied elsewhere), units gather theirs just in time on
each position and free them, and the backward reduce-scatters into the optimizer's shards. Compared in float64
after 20 AdamW steps with one device; bytes per position counted (dpcore/_units.py, docs/sharded_parameters.md)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpcore
from conftest import requires_cuda

STEPS = 20
TOL = {"atol": 1e-10, "rtol": 0.0}
COUNTS = [2, 3, 4]
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def _mlp() -> nn.Module:
    """Parameters of very different sizes (uneven shards), one frozen bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 40), nn.Tanh(), nn.Linear(40, 9), nn.Tanh(), nn.Linear(9, 3))
    model[2].bias.requires_grad_(False)
    return model.double()


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 4, 3))
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _cnn() -> nn.Module:
    return _Cnn().double()


def _gpt2(**config: Any) -> nn.Module:
    t = pytest.importorskip("transformers")
    settings = {"vocab_size": 50, "n_positions": 64, "n_embd": 16, "n_layer": 2, "n_head": 2, **config}
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    torch.manual_seed(0)
    config_ = t.GPT2Config(**settings, **dropout, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return t.GPT2LMHeadModel(config_).double()


def _batch(name: str, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if name == "gpt2":
        return {"input_ids": torch.randint(3, 50, (7, 9), generator=g)}
    if name == "cnn":
        return {"x": torch.randn(7, 2, 8, 8, generator=g, dtype=torch.float64)}
    return {"x": torch.randn(7, 5, generator=g, dtype=torch.float64)}


def _out(result: Any) -> torch.Tensor:
    return result.logits if hasattr(result, "logits") else result


MODELS = {"mlp": _mlp, "cnn": _cnn, "gpt2": _gpt2}


def _sharded(model: nn.Module, n: int, **options: Any) -> tuple[dpcore.DataParallel, dpcore.ShardedOptimizer]:
    dp = dpcore.DataParallel(model, ["cpu"] * n, **{"shard_parameters": True, **options})
    return dp, dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, **ADAMW)


def _step_both(*optimizers: torch.optim.Optimizer) -> None:
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _assert_same_state(dp: dpcore.DataParallel, bare: nn.Module) -> None:
    """The wrapper's state dict (whole, on the CPU) equals the bare module's."""
    state = dp.state_dict()
    for key, value in bare.state_dict().items():
        torch.testing.assert_close(state[key], value.cpu(), **TOL)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n", COUNTS)
def test_steps_equal_one_device(n: int, name: str, prefetch: bool) -> None:
    """20 steps of two backwards each with norm clipping (BatchNorm synchronized), with and without prefetching:
    outputs, gradients, the whole state dict and the running statistics equal one device's; p.grad stays None;
    between steps each parameter is held once, at its owner, and the module's own tensor is empty elsewhere."""
    model, bare = MODELS[name](), MODELS[name]()
    dp, optimizer = _sharded(model, n, sync_batchnorm=name == "cnn")
    dp.sharded_parameters.prefetch = prefetch
    plain = torch.optim.AdamW(bare.parameters(), **ADAMW)
    sharded = dp.sharded_parameters
    for step in range(STEPS):
        for half in (0, 1):
            batch = _batch(name, 2 * step + half)
            got, expected = _out(dp(*batch.values())), _out(bare(*batch.values()))
            torch.testing.assert_close(got, expected, **TOL)
            got.square().mean().backward()
            expected.square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        for p, q in zip(model.parameters(), bare.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
        optimizer.clip_grad_norm_(0.5)
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 0.5)
        _step_both(optimizer, plain)
    _assert_same_state(dp, bare)
    held = sharded.held_bytes()
    assert all(h["gathered"] == 0 for h in held.values())
    params = list(model.parameters())
    assert sum(h["parameters"] for h in held.values()) == _bytes(sharded.shard(p) for p in params)
    for p in params:
        k = sharded.owner_of(p)
        assert (p.numel() == 0) == (k != 0) and sharded.shard(p).device == dp.device_ids[k]


def _frozen_embedding() -> nn.Module:
    model = _gpt2()
    model.transformer.wte.weight.requires_grad_(False)  # and the tied head with it
    return model


def _frozen_block() -> nn.Module:
    model = _gpt2()
    model.transformer.h[0].requires_grad_(False)  # its units wholly frozen, between trainable ones
    return model


def _checkpointed(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = _gpt2()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model.train()

    return make


def _frozen_conv() -> nn.Module:
    model = _cnn()
    model.features[0].requires_grad_(False)
    return model


VARIANTS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2-frozen-embedding": (_frozen_embedding, "gpt2"),
    "gpt2-frozen-block": (_frozen_block, "gpt2"),
    "gpt2-checkpointed": (_checkpointed(False), "gpt2"),
    "gpt2-checkpointed-reentrant": (_checkpointed(True), "gpt2"),
    "cnn-frozen-conv": (_frozen_conv, "cnn"),
}


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_step_as_one_device(variant: str, n: int, prefetch: bool) -> None:
    """The default units over 20 AdamW steps with norm clipping, an eval no-grad forward every fifth step: frozen
    parameters (tied ones, a whole block, a first conv), transformers' gradient checkpointing in both forms. Outputs
    and the final state equal one device's; nothing stays gathered after a backward."""
    make, kind = VARIANTS[variant]
    model, bare = make(), make()
    dp, optimizer = _sharded(model, n, sync_batchnorm=kind == "cnn")
    dp.sharded_parameters.prefetch = prefetch
    plain = torch.optim.AdamW(bare.parameters(), **ADAMW)
    for step in range(STEPS):
        batch = _batch(kind, step)
        if step % 5 == 4:
            for m in (dp, bare):
                m.eval()
            with torch.no_grad():
                torch.testing.assert_close(_out(dp(*batch.values())), _out(bare(*batch.values())), **TOL)
            for m in (dp, bare):
                m.train()
        got, expected = _out(dp(*batch.values())), _out(bare(*batch.values()))
        torch.testing.assert_close(got, expected, **TOL)
        got.square().mean().backward()
        expected.square().mean().backward()
        assert all(h["gathered"] == 0 for h in dp.sharded_parameters.held_bytes().values())
        optimizer.clip_grad_norm_(0.5)
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 0.5)
        _step_both(optimizer, plain)
    _assert_same_state(dp, bare)


def test_tied_weights_in_two_units_get_both_gradients() -> None:
    """GPT-2's embedding and head share one parameter in two units: each gathers it, both gradients are summed."""
    model = _gpt2()
    dp, optimizer = _sharded(model, 3)
    names = {u.name for u in dp.sharded_parameters.units if any(p is model.lm_head.weight for p in u.params)}
    assert names == {"transformer.wte", "lm_head"}
    bare = _gpt2()
    batch = _batch("gpt2", 0)
    _out(dp(*batch.values())).sum().backward()
    _out(bare(*batch.values())).sum().backward()
    torch.testing.assert_close(optimizer.gradient(model.lm_head.weight), bare.lm_head.weight.grad, **TOL)


class _Checkpointed(nn.Module):
    """One unit whose inner blocks run under non-reentrant checkpointing (recomputed inside the unit's backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.out(x)


@pytest.mark.parametrize("reshard", [True, False])
def test_checkpointing_inside_a_unit(reshard: bool) -> None:
    model, bare = _Checkpointed().double(), _Checkpointed().double()
    dp, optimizer = _sharded(model, 3, shard_parameters=(nn.Sequential,), reshard_after_forward=reshard)
    assert [u.name for u in dp.sharded_parameters.units] == ["blocks.0", "blocks.1", "blocks.2", ""]
    x = torch.randn(7, 6, dtype=torch.float64)
    dp(x).square().sum().backward()
    bare(x).square().sum().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)


def test_gpt2_gradient_checkpointing_with_the_whole_body_one_unit() -> None:
    """transformers' gradient checkpointing (non-reentrant) inside one unit holding the whole transformer."""
    t = pytest.importorskip("transformers")
    model, bare = _gpt2(), _gpt2()
    for m in (model, bare):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    dp, optimizer = _sharded(model, 2, shard_parameters=(t.GPT2Model,))
    batch = _batch("gpt2", 1)
    _out(dp(*batch.values())).square().mean().backward()
    _out(bare(*batch.values())).square().mean().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)


class _FrozenMiddle(nn.Module):
    """Three units; the middle one wholly frozen, so its backward needs its weights but sums no gradient. With
    `reentrant`, the last unit runs under reentrant checkpointing (a no_grad forward, recomputed in backward)."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.b.requires_grad_(False)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return checkpoint(self.c, h, use_reentrant=True) if self.reentrant else self.c(h)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("reshard", [True, False])
def test_frozen_units_and_reentrant_checkpointing(reshard: bool, reentrant: bool, prefetch: bool) -> None:
    """A frozen unit between trainable ones is gathered again for its backward; a unit under reentrant
    checkpointing sums its recomputation's gradients (with prefetching too: the unit prefetched with grad, then run
    without). Both equal one device over steps, and nothing stays gathered after each backward."""
    model, bare = _FrozenMiddle(reentrant).double(), _FrozenMiddle(reentrant).double()
    dp, optimizer = _sharded(model, 3, shard_parameters=(nn.Linear,), reshard_after_forward=reshard)
    dp.sharded_parameters.prefetch = prefetch
    plain = torch.optim.AdamW(bare.parameters(), **ADAMW)
    for step in range(4):
        x = _batch("mlp", step)["x"]
        dp(x).square().sum().backward()
        bare(x).square().sum().backward()
        assert all(h["gathered"] == 0 for h in dp.sharded_parameters.held_bytes().values())
        for p, q in zip(model.parameters(), bare.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
        _step_both(optimizer, plain)
    _assert_same_state(dp, bare)


class _Reentrant(nn.Module):
    """A reentrant checkpoint over two Linears, scaled by a parameter outside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.scale = nn.Linear(4, 4), nn.Linear(4, 2), nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda h: self.b(torch.tanh(self.a(h))), x, use_reentrant=True) * self.scale


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("policy", ["root", "linear", "gpt2"])
def test_reentrant_checkpointing_over_units_and_inside_one(policy: str, reshard: bool) -> None:
    """Reentrant checkpointing whose recomputation reads the parameters of units it holds, of the unit enclosing it
    (one unit for the whole model: no use of them is recorded outside the recomputation), or both (transformers'
    use_reentrant=True, the default units): the gradients equal one device's, nothing stays gathered."""
    if policy == "gpt2":
        model, bare = _gpt2(n_layer=3), _gpt2(n_layer=3)
        for m in (model, bare):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        x = _batch("gpt2", 5)["input_ids"]
    else:
        model, bare = _Reentrant().double(), _Reentrant().double()
        x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    units = {"root": lambda m: False, "linear": (nn.Linear,), "gpt2": True}[policy]
    dp, optimizer = _sharded(model, 3, shard_parameters=units, reshard_after_forward=reshard)
    _out(dp(x)).square().sum().backward()
    _out(bare(x)).square().sum().backward()
    assert all(h["gathered"] == 0 for h in dp.sharded_parameters.held_bytes().values())
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)


@pytest.mark.parametrize("name", MODELS)
def test_no_grad_and_eval_forwards_gather_and_free(name: str) -> None:
    model, bare = MODELS[name](), MODELS[name]()
    dp, _ = _sharded(model, 3, sync_batchnorm=True)
    for mode in ("train", "eval"):
        getattr(dp, mode)()
        getattr(bare, mode)()
        batch = _batch(name, 3)
        with torch.no_grad():
            torch.testing.assert_close(_out(dp(*batch.values())), _out(bare(*batch.values())), **TOL)
        assert all(h["gathered"] == 0 for h in dp.sharded_parameters.held_bytes().values())


def test_generate_equals_the_bare_model() -> None:
    model, bare = _gpt2().eval(), _gpt2().eval()
    dp, _ = _sharded(model, 3)
    ids = torch.randint(3, 50, (7, 4), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    got = dp.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, bare.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


def test_reshard_after_forward_false_keeps_the_units_until_backward() -> None:
    model, bare = _mlp(), _mlp()
    dp, optimizer = _sharded(model, 3, shard_parameters=1, reshard_after_forward=False)
    x = _batch("mlp", 0)["x"]
    out = dp(x)
    assert sum(h["gathered"] for h in dp.sharded_parameters.held_bytes().values()) > 0
    out.sum().backward()
    bare(x).sum().backward()
    assert all(h["gathered"] == 0 for h in dp.sharded_parameters.held_bytes().values())
    for p, q in zip(model.parameters(), bare.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
    dp.reshard_after_forward = True  # followed at the next call
    dp(x)
    assert all(h["gathered"] == 0 for h in dp.sharded_parameters.held_bytes().values())


@pytest.mark.parametrize("reshard", [True, False])
def test_two_forwards_before_one_backward(reshard: bool) -> None:
    """Each call keeps its own gathered tensors for its backward: two calls' losses summed, one backward; a call
    whose graph is dropped without a backward no longer counts once its tensors are gone (at the next call)."""
    model, bare = _mlp(), _mlp()
    dp, optimizer = _sharded(model, 3, shard_parameters=1, reshard_after_forward=reshard)
    x, y = _batch("mlp", 1)["x"], _batch("mlp", 2)["x"]
    (dp(x).square().sum() + dp(y).sin().sum()).backward()
    (bare(x).square().sum() + bare(y).sin().sum()).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
    dropped = dp(x)
    assert (sum(h["gathered"] for h in dp.sharded_parameters.held_bytes().values()) > 0) == (not reshard)
    del dropped
    with torch.no_grad():  # the next call: the dropped one's tensors are gone
        dp(y)
    assert all(h["gathered"] == 0 for h in dp.sharded_parameters.held_bytes().values())


@pytest.mark.parametrize("reshard", [True, False])
def test_prefetch_gathers_the_next_unit_ahead(reshard: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """prefetch=True (the default on CUDA; on CPU lists set here): from the second call on, each unit but the first is
    gathered while the one before it runs in the forward, and (reshard_after_forward=True) while the one after it
    runs in the backward; results equal one device's, every prefetch is used (nothing stays gathered after the
    backward), and with resharding a position's peak is its shards plus two units (the one running and the next)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)), nn.Linear(6, 2)).double()
    bare = copy.deepcopy(model)
    dp, optimizer = _sharded(model, 3, shard_parameters=(nn.Linear,), reshard_after_forward=reshard)
    sharded = dp.sharded_parameters
    assert sharded.prefetch is False
    sharded.prefetch = True
    fills: list[tuple[int, int, bool, bool]] = []  # (unit, position, early, in backward)
    fill = sharded._fill

    def recorded(copies: Any, u: int, d: int, early: bool = False) -> None:
        fills.append((u, d, early, torch._C._current_graph_task_id() != -1))
        fill(copies, u, d, early)

    monkeypatch.setattr(sharded, "_fill", recorded)
    plain = torch.optim.AdamW(bare.parameters(), **ADAMW)
    units = [u for u, unit in enumerate(sharded.units) if unit.params]
    for step in range(3):
        fills.clear()
        sharded.reset_peak()
        x = torch.randn(7, 6, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        dp(x).square().sum().backward()
        bare(x).square().sum().backward()
        assert all(h["gathered"] == 0 for h in sharded.held_bytes().values())
        for p, q in zip(model.parameters(), bare.parameters()):
            torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
        _step_both(optimizer, plain)
        forward = {(u, d, early) for u, d, early, back in fills if not back}
        backward = {(u, d, early) for u, d, early, back in fills if back}
        for d in range(3):
            if step == 0:  # no order known yet: each unit gathered as it runs
                assert {(u, early) for u, e, early in forward if e == d} == {(u, False) for u in units}
                continue
            assert {(u, early) for u, e, early in forward if e == d} == {(units[0], False)} | {
                (u, True) for u in units[1:]
            }
            if reshard:  # the last unit's backward refills it; each one before it is gathered ahead
                assert {(u, early) for u, e, early in backward if e == d} == {(units[-1], False)} | {
                    (u, True) for u in units[:-1]
                }
            else:
                assert not backward
    largest = max(_bytes(sharded.shard(p) for p in sharded.units[u].params) for u in units)
    for h in sharded.held_bytes().values():
        assert (h["peak_parameters"] <= h["parameters"] + 2 * largest) == reshard


class _Skipping(nn.Module):
    """Three Linear units; the middle one runs only when asked (a forward whose order changes between calls)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, middle: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(h)) if middle else h)


def test_a_prefetched_unit_that_does_not_run_is_freed() -> None:
    """A call that skips the unit the last call ran next: its prefetched copies are freed by the end of the backward
    (and a no-grad call's by the next call); the results equal one device's."""
    model, bare = _Skipping().double(), _Skipping().double()
    dp, optimizer = _sharded(model, 3, shard_parameters=(nn.Linear,))
    sharded = dp.sharded_parameters
    sharded.prefetch = True
    for step, middle in enumerate([True, False, True, False]):
        x = _batch("mlp", step)["x"]
        dp(x, middle).square().sum().backward()
        bare(x, middle).square().sum().backward()
        assert all(h["gathered"] == 0 for h in sharded.held_bytes().values())
        for p, q in zip(model.parameters(), bare.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(optimizer.gradient(p), q.grad, **TOL)
    with torch.no_grad():
        dp(x, True)
        dp(x, False)  # b prefetched after a, not run
    assert sum(h["gathered"] for h in sharded.held_bytes().values()) > 0
    with torch.no_grad():
        dp(x, False)
    dp(x, True)  # order a, c (the last call's): b not prefetched; the no-grad call's copies freed
    assert all(h["gathered"] == 0 for h in sharded.held_bytes().values())


def test_memory_per_position_is_a_share_plus_two_units() -> None:
    """On cpu*4, each position's peak of parameter, gradient and optimizer bytes over a step is at most
    (P + G + S) / 4 + 2 x the largest unit, plus what whole-parameter placement can leave uneven (the largest
    parameter, once per kind)."""
    model = _gpt2(n_layer=4, n_embd=32)
    dp, optimizer = _sharded(model, 4)
    sharded = dp.sharded_parameters
    for step in range(2):
        sharded.reset_peak()
        _out(dp(*_batch("gpt2", step).values())).square().mean().backward()
        grads = {k: h["gradients"] for k, h in optimizer.held_bytes().items()}
        optimizer.step()
        optimizer.zero_grad()
    params = list(model.parameters())
    whole = _bytes(sharded.shard(p) for p in params)
    state = optimizer.held_bytes()
    total = whole + sum(grads.values()) + sum(h["optimizer_state"] for h in state.values())
    unit = max(_bytes(sharded.shard(p) for p in u.params) for u in sharded.units)
    largest = max(_bytes([sharded.shard(p)]) for p in params)
    for k, h in sharded.held_bytes().items():
        peak = h["peak_parameters"] + grads[k] + state[k]["optimizer_state"]
        assert peak <= total / 4 + 2 * unit + 4 * largest, (k, peak, total / 4, unit, largest)
        assert h["parameters"] <= whole / 4 + largest
    assert max(h["peak_parameters"] for h in sharded.held_bytes().values()) < whole  # no position held the model


def test_a_model_larger_than_the_budget_trains() -> None:
    """A per-position budget of parameter bytes below the whole model: training runs within it; a budget below a
    position's shards plus one unit is an error naming it."""
    model, bare = _gpt2(n_layer=4, n_embd=32), _gpt2(n_layer=4, n_embd=32)
    dp, optimizer = _sharded(model, 4)
    sharded = dp.sharded_parameters
    whole = _bytes(sharded.shard(p) for p in model.parameters())
    sharded.budget = int(0.6 * whole)
    plain = torch.optim.AdamW(bare.parameters(), **ADAMW)
    for step in range(3):
        batch = _batch("gpt2", step)
        _out(dp(*batch.values())).square().mean().backward()
        _out(bare(*batch.values())).square().mean().backward()
        _step_both(optimizer, plain)
    assert max(h["peak_parameters"] for h in sharded.held_bytes().values()) <= sharded.budget
    _assert_same_state(dp, bare)
    sharded.budget = max(h["parameters"] for h in sharded.held_bytes().values())
    with pytest.raises(RuntimeError, match="budget: position"):
        dp(*_batch("gpt2", 9).values())


def test_state_dict_round_trip_reshards() -> None:
    """state_dict() is the bare module's, whole, on the CPU (the module's own too); load_state_dict writes each
    parameter into its shard."""
    model, bare = _mlp(), _mlp()
    with torch.no_grad():
        for p in bare.parameters():
            p.add_(1.0)
    dp, _ = _sharded(model, 3)
    dp.load_state_dict(bare.state_dict())
    x = _batch("mlp", 4)["x"]
    with torch.no_grad():
        torch.testing.assert_close(dp(x), bare(x), **TOL)
    state = dp.state_dict()
    assert list(state) == list(bare.state_dict()) and all(v.device.type == "cpu" for v in state.values())
    assert all(torch.equal(a, b) for a, b in zip(dp.module.state_dict().values(), state.values()))
    with pytest.raises(RuntimeError, match="Missing key"):
        dp.load_state_dict({k: v for k, v in bare.state_dict().items() if k != "0.weight"})
    with pytest.raises(RuntimeError, match=r"state_dict\['0.weight'\]: expected shape"):
        dp.load_state_dict({**bare.state_dict(), "0.weight": torch.zeros(3)})


class _Reader(nn.Module):
    """Reads its child's weight in its own forward: outside the child's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale + x @ self.inner.weight


def test_errors_name_what_cannot_compose() -> None:
    with pytest.raises(RuntimeError, match="used a parameter of unit 'inner' .* outside that unit"):
        dp = dpcore.DataParallel(_Reader(), ["cpu"] * 2, shard_parameters=(nn.Linear,))
        dp(torch.randn(4, 4))
    for options, other in (
        ({"process_group": object()}, "process_group="),
        ({"cuda_graphs": True}, "cuda_graphs=True"),
    ):
        with pytest.raises(ValueError, match=f"shard_parameters= cannot be combined with {other}"):
            dpcore.DataParallel(_mlp(), ["cpu"] * 2, shard_parameters=True, **options)
    with pytest.raises(TypeError, match="shard_parameters: expected True or False"):
        dpcore.DataParallel(_mlp(), ["cpu"] * 2, shard_parameters="blocks")
    dp = dpcore.DataParallel(_mlp(), ["cpu"] * 2, shard_parameters=True)
    for attribute, value in (("device_ids", ["cpu"] * 3), ("shard_parameters", False), ("module", _mlp())):
        with pytest.raises(AttributeError, match=f"{attribute}: cannot be changed once the parameters are sharded"):
            setattr(dp, attribute, value)
    with pytest.raises(ValueError, match="functional_call: not supported with shard_parameters="):
        dpcore.functional_call(dp, dict(dp.module.named_parameters()), (torch.randn(2, 5, dtype=torch.float64),))
    with pytest.raises(RuntimeError, match="none is attached to the wrapper"):
        dp(torch.randn(4, 5, dtype=torch.float64)).sum().backward()
    dp, optimizer = _sharded(_mlp(), 2)
    dp(torch.randn(4, 5, dtype=torch.float64)).sum().backward()
    for p in dp.module.parameters():
        p.grad = torch.ones_like(p)  # a write the step would otherwise ignore
    with pytest.raises(RuntimeError, match=r"shard_parameters=True: the gradients live .* must stay None"):
        optimizer.step()


def test_one_device_runs_the_module_as_is() -> None:
    model = _mlp()
    dp = dpcore.DataParallel(model, ["cpu"], shard_parameters=True)
    assert dp.sharded_parameters is None
    x = _batch("mlp", 0)["x"]
    torch.testing.assert_close(dp(x), copy.deepcopy(model)(x), **TOL)


@requires_cuda  # CPU counterpart: test_steps_equal_one_device
@pytest.mark.cuda
def test_steps_equal_one_device_on_a_repeated_gpu() -> None:
    """The CUDA counterpart of test_steps_equal_one_device on [0, 0]."""
    model, bare = _mlp().cuda(), _mlp().cuda()
    dp = dpcore.DataParallel(model, [0, 0], shard_parameters=1)
    optimizer = dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, **ADAMW)
    plain = torch.optim.AdamW(bare.parameters(), **ADAMW)
    for step in range(STEPS):
        x = _batch("mlp", step)["x"].cuda()
        dp(x).square().mean().backward()
        bare(x).square().mean().backward()
        _step_both(optimizer, plain)
    _assert_same_state(dp, bare)
