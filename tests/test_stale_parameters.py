"""Writes that no version counter sees never leave replicas stale unnoticed.

A hand-written optimizer updating through ``.data``, an EMA swapped in
through ``.data``, numpy writes and buffers changed through ``.data`` bump
no version counter. torch.nn.DataParallel copies every parameter at every
call; dpcore copies what changed, and checks the replicas against the module
byte for byte at set calls (docs/design.md, "Writes no version counter
sees"): a difference is copied at once and warned about, within
``CHECK_INTERVAL_MAX`` calls. ``replica_refresh="always"`` copies at every
call as torch does. Every case runs in float64 on CPU lists of 2 to 4
devices and is compared with the bare module on one device.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import dpcore
from dpcore.replicate import CHECK_INTERVAL_MAX, ReplicaCache

LISTS = [pytest.param(["cpu"] * k, id=f"cpu*{k}") for k in (2, 3, 4)]
ATOL = 1e-9
STALE_MESSAGE = r"mark_parameters_changed\(\).*replica_refresh=\"always\""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _batches(steps: int, n: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64))
        for _ in range(steps)
    ]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=ATOL)


def _data_add(model: nn.Module, lr: float) -> None:
    """PyTorch's word-language-model example's update."""
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)


def _numpy_add(model: nn.Module, lr: float) -> None:
    for p in model.parameters():
        p.detach().numpy()[...] -= lr * p.grad.numpy()


def _manual_sgd(
    net: nn.Module, model: nn.Module, update: Callable[[nn.Module, float], None], steps: int, mark: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, loss) of every step of a hand-written SGD loop (no torch.optim)."""
    record = []
    for x, y in _batches(steps):
        out = net(x)
        loss = nn.functional.mse_loss(out, y)
        model.zero_grad()
        loss.backward()
        update(model, 0.1)
        if mark:
            net.mark_parameters_changed()
        record.append((out.detach(), loss.detach()))
    return record


def _stale_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "mark_parameters_changed" in str(w.message)]


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("update", [_data_add, _numpy_add], ids=["data_add", "numpy"])
def test_manual_sgd_is_exact_and_warned_once(devices: list[str], update: Callable[[nn.Module, float], None]) -> None:
    """Every step equals the bare module's (the first check comes at the
    first call that could be stale, and every call is checked while the
    writes go on, past CHECK_INTERVAL_MAX calls); one warning, naming the
    parameters, mark_parameters_changed() and replica_refresh="always"."""
    steps = CHECK_INTERVAL_MAX + 16
    ref = _manual_sgd(*(2 * [_model()]), update, steps)
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _manual_sgd(dpcore.DataParallel(model, devices), model, update, steps)
    for step, ((out, loss), (ref_out, ref_loss)) in enumerate(zip(got, ref)):
        assert _close(out, ref_out) and _close(loss, ref_loss), f"step {step}"
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert caught[0].category is UserWarning and caught[0].filename == __file__
    assert "'0.weight'" in message and "no call used them" in message  # checked at the first call that could be stale
    assert "mark_parameters_changed()" in message and 'replica_refresh="always"' in message


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("option", ["always", "mark"])
def test_manual_sgd_with_the_fixes_is_exact_without_warning(devices: list[str], option: str) -> None:
    """The two fixes the warning names: replica_refresh="always" and
    mark_parameters_changed() after each write; every step exact, no warning."""
    ref = _manual_sgd(*(2 * [_model()]), _data_add, 12)
    model = _model()
    dp = dpcore.DataParallel(model, devices, replica_refresh="always" if option == "always" else "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _manual_sgd(dp, model, _data_add, 12, mark=option == "mark")
    for step, ((out, loss), (ref_out, ref_loss)) in enumerate(zip(got, ref)):
        assert _close(out, ref_out) and _close(loss, ref_loss), f"step {step}"
    if option == "always":  # every bucket copied at every call
        dp(torch.randn(4, 5, dtype=torch.float64))
        assert all(b.last_refresh_copied for b in dp.replica_cache.buckets)


def _ema_run(devices: list[str] | None, swap: str, steps: int = 12) -> tuple[list[torch.Tensor], list[str]]:
    """Training with torch.optim.SGD and an EMA of the weights; after every
    step the EMA is swapped in (through ``.data``) for an evaluation in
    eval mode, then swapped back. Returns every output (training and
    evaluation) and the stale warnings raised."""
    model = _model()
    net = dpcore.DataParallel(model, devices) if devices else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = copy.deepcopy(model)
    outputs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(steps):
            opt.zero_grad()
            out = net(x)
            nn.functional.mse_loss(out, y).backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.5).add_(p, alpha=0.5)
            backup = [p.detach().clone() for p in model.parameters()]
            for p, e in zip(model.parameters(), ema.parameters()):
                if swap == "copy":
                    p.data.copy_(e.data)
                else:
                    p.data = e.detach().clone()
            model.eval()
            with torch.no_grad():
                evaluated = net(x)
            for p, b in zip(model.parameters(), backup):
                if swap == "copy":
                    p.data.copy_(b)
                else:
                    p.data = b
            model.train()
            outputs += [out.detach(), evaluated]
    return outputs, _stale_warnings(caught)


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("swap", ["copy", "assign"])
def test_ema_swapped_in_through_data(devices: list[str], swap: str) -> None:
    """``p.data.copy_(ema)`` (in place: caught at the train/eval switch, one
    warning) and ``p.data = ema.clone()`` (a new storage: seen at once, no
    warning): every training and evaluation output equals the bare module's."""
    ref, _ = _ema_run(None, swap)
    got, warned = _ema_run(devices, swap)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert _close(a, b), f"output {i} ({'evaluation' if i % 2 else 'training'})"
    assert len(warned) == (1 if swap == "copy" else 0), warned


@pytest.mark.parametrize("devices", LISTS)
def test_vector_to_parameters(devices: list[str]) -> None:
    """A flat-vector optimizer writing back with
    ``torch.nn.utils.vector_to_parameters`` (``param.data = ...``): exact at
    every step, no warning."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    def update(model: nn.Module, lr: float) -> None:
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        vector_to_parameters(parameters_to_vector(model.parameters()) - lr * grads, model.parameters())

    ref = _manual_sgd(*(2 * [_model()]), update, 10)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _manual_sgd(dpcore.DataParallel(model, devices), model, update, 10)
    for step, ((out, loss), (ref_out, ref_loss)) in enumerate(zip(got, ref)):
        assert _close(out, ref_out) and _close(loss, ref_loss), f"step {step}"


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double().eval()


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("how", ["in_place", "assign"])
def test_buffers_changed_through_data(devices: list[str], how: str) -> None:
    """A BatchNorm's running statistics changed through ``.data`` between
    evaluations: exact at every call; in place is warned about (naming the
    buffer), a new storage is not."""
    model = _bn_model()
    dp = dpcore.DataParallel(model, devices)
    x = torch.randn(8, 5, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for step in range(6):
            assert _close(dp(x), model(x)), f"call {step + 1}"
            if how == "in_place":
                model[1].running_mean.data.add_(0.5)
            else:
                model[1].running_var.data = model[1].running_var * 2
    warned = _stale_warnings(caught)
    assert len(warned) == (1 if how == "in_place" else 0), warned
    if warned:
        assert "'1.running_mean'" in warned[0]


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("sync_batchnorm", [False, True])
def test_batchnorm_statistics_reach_the_replicas(devices: list[str], sync_batchnorm: bool) -> None:
    """batch_norm updates the running statistics without bumping their
    version counters: after training, evaluation through the wrapper equals
    the bare module's at once, with no warning (they are copied after every
    call that trained a norm layer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()
    dp = dpcore.DataParallel(model, devices, sync_batchnorm=sync_batchnorm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.zero_grad()
            dp(torch.randn(8, 5, generator=g, dtype=torch.float64)).sum().backward()
            opt.step()
        model.eval()
        x = torch.randn(8, 5, generator=g, dtype=torch.float64)
        with torch.no_grad():
            assert _close(dp(x), model(x))
    for row in dp.replica_cache.replica_modules:
        assert torch.equal(row[2].running_mean, model[1].running_mean)
        assert torch.equal(row[2].running_var, model[1].running_var)


@pytest.mark.parametrize("devices", LISTS[:1])
def test_batchnorm_trained_by_the_master_alone(devices: list[str]) -> None:
    """A batch of one sample runs on the master alone, in training mode: its
    statistics still reach the replicas before the next call uses them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten()).double()
    dp = dpcore.DataParallel(model, devices)
    x = torch.randn(6, 2, 5, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(x)
        dp(x[:1])  # one replica: the master
        model.eval()
        with torch.no_grad():
            assert _close(dp(x), model(x))


class _LoadsThroughData(nn.Module):
    """A module whose own loader writes its weight through ``.data`` (no
    version counter sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # type: ignore[override]
        self.weight.data.copy_(state_dict[prefix + "weight"])


@pytest.mark.parametrize("devices", LISTS)
def test_load_state_dict(devices: list[str]) -> None:
    """After load_state_dict, directly on the module (its copies bump version
    counters) or through the wrapper (which copies everything at the next
    call, also for a module loading through ``.data``): the next call is
    exact, with no warning."""
    model = _model()
    dp = dpcore.DataParallel(model, devices)
    x = torch.randn(9, 5, dtype=torch.float64)
    other = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    custom = _LoadsThroughData()
    dp_custom = dpcore.DataParallel(custom, devices)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        for _ in range(3):
            dp(x)
            dp_custom(x)
        model.load_state_dict(other)
        assert _close(dp(x), model(x))
        dp_custom.load_state_dict({"weight": torch.randn(5, 3, dtype=torch.float64)})
        assert _close(dp_custom(x), custom(x))


#: (k, the call that catches a write made before call k) for the schedule
#: of docs/design.md: checks at calls 2, 3, 5, 9, 17, 33, 65, then every 64.
SCHEDULE = [(2, 2), (3, 3), (4, 5), (10, 17), (33, 33), (34, 65), (66, 129), (100, 129), (200, 257)]


@pytest.mark.parametrize("devices", LISTS[:1])
@pytest.mark.parametrize("written_before, expected", SCHEDULE)
def test_a_write_is_caught_within_the_bound(devices: list[str], written_before: int, expected: int) -> None:
    """A write through ``.data`` before call k is copied, and warned about,
    by call k + CHECK_INTERVAL_MAX - 1 at the latest; the calls in between
    are stale (nothing else catches it), the calls after exact. The warning
    counts the calls since the previous check, every stale one among them."""
    model = _model().eval()
    dp = dpcore.DataParallel(model, devices)
    x = torch.randn(6, 5, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for call in range(1, written_before):
            assert _close(dp(x), model(x)), f"call {call}"
        model[0].weight.data.mul_(1.5)
        call = written_before
        while not _close(dp(x), model(x)):
            call += 1
            assert call < written_before + CHECK_INTERVAL_MAX, "the write was not caught within the bound"
        caught_at = call
        for call in range(caught_at + 1, caught_at + 2 * CHECK_INTERVAL_MAX):
            assert _close(dp(x), model(x)), f"call {call}"
    assert caught_at == expected
    warned = _stale_warnings(caught)
    assert len(warned) == 1
    stale_calls = caught_at - written_before
    counted = re.search(r"up to (\d+) call\(s\)", warned[0])
    if counted is None:
        assert "no call used them" in warned[0] and stale_calls == 0
    else:
        assert int(counted.group(1)) >= stale_calls


class _Tied(nn.Module):
    """Tied input and output embeddings, dropout, BatchNorm, a frozen layer
    and a buffer holding NaN and -0.0 (compared as bytes, never as values)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("odd", torch.tensor([float("nan"), -0.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.bn(torch.tanh(self.frozen(self.embed(tokens)))))
        return self.out(h) + self.odd.nan_to_num().sum()


@pytest.mark.parametrize("devices", LISTS)
def test_no_warning_in_normal_training(devices: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch.optim training loop with BatchNorm, dropout, tied weights, a
    frozen layer and a NaN buffer, evaluated every few steps in eval mode,
    then evaluated alone: many checks run, none finds a difference. The
    checks are live on this model: a write to the frozen layer through
    ``.data`` is then caught."""
    checks = []
    original = ReplicaCache._check

    def counted(self: ReplicaCache) -> None:
        checks.append(self._calls)
        original(self)

    monkeypatch.setattr(ReplicaCache, "_check", counted)
    torch.manual_seed(0)
    model = _Tied().double()
    dp = dpcore.DataParallel(model, devices)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 10, (12,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(40):
            tokens = torch.randint(0, 10, (12,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(dp(tokens), tokens).backward()
            opt.step()
            if step % 10 == 9:
                model.eval()
                with torch.no_grad():
                    assert _close(dp(tokens), model(tokens))
                    assert _close(dp(tokens), model(tokens))
                model.train()
        model.eval()
        with torch.no_grad():
            for _ in range(2 * CHECK_INTERVAL_MAX):
                assert _close(dp(tokens), model(tokens))
    assert len(checks) >= 10, checks
    with pytest.warns(UserWarning, match="'frozen.weight'"), torch.no_grad():
        model.frozen.weight.data.add_(1.0)
        for _ in range(CHECK_INTERVAL_MAX):
            dp(tokens)
    assert _close(dp(tokens), model(tokens))


@pytest.mark.parametrize("devices", LISTS[:1])
def test_a_sign_of_zero_is_a_difference(devices: list[str]) -> None:
    """The comparison is of bytes: a zero whose sign changed through ``.data``
    is a difference (equal as values, not as bytes)."""
    model = nn.Linear(3, 2).double().eval()
    with torch.no_grad():
        model.bias.zero_()
    dp = dpcore.DataParallel(model, devices)
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match=STALE_MESSAGE), torch.no_grad():
        dp(x)
        model.bias.data.neg_()
        dp(x)
    replica_bias = dp.replica_cache.replica_modules[0][0].bias
    assert torch.equal(torch.signbit(replica_bias), torch.signbit(model.bias))


@pytest.mark.parametrize(
    "value, error",
    [("never", ValueError), ("Always", ValueError), (True, TypeError), (None, TypeError), (1, TypeError)],
)
def test_replica_refresh_bad_values(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match='replica_refresh: expected "auto".*"always"'):
        dpcore.DataParallel(_model(), ["cpu"] * 2, replica_refresh=value)  # type: ignore[arg-type]
