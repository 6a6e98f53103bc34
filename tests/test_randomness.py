"""Reproducible randomness: under one ``torch.manual_seed``, two runs of the
same training through dpcore.DataParallel are bitwise equal, on CPU lists
and on a CUDA device used several times; each replica that shares its
device's generator with another replica draws from a stream of its own,
derived from (and advancing) that generator; a lone replica draws from the
default generator as the bare module does (docs/design.md, "Randomness").
Outside a replica, torch's functions behave as without dpcore, also on
other threads during a parallel call; DPCORE_REPLICA_RNG=0 turns the
streams off."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from conftest import TESTS_DIR, requires_cuda, subprocess_env

CPU_LISTS = [pytest.param(["cpu"] * 2, id="cpu*2"), pytest.param(["cpu"] * 3, id="cpu*3")]
CUDA_LISTS = [
    pytest.param([0, 0], id="cuda[0,0]", marks=[requires_cuda, pytest.mark.cuda]),
    pytest.param([0, 0, 0], id="cuda[0,0,0]", marks=[requires_cuda, pytest.mark.cuda]),
]


class Noisy(nn.Module):
    """Every common way of drawing random numbers in a forward: nn.Dropout,
    F.dropout, torch.rand_like, Tensor.bernoulli_, torch.randn (a factory
    with a device), F.rrelu, F.alpha_dropout, torch.randperm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        h = F.dropout(self.fc2(h), 0.3, training=self.training)
        if self.training:
            h = h + 0.1 * torch.rand_like(h)
            h = h * torch.empty_like(h).bernoulli_(0.8)
            h = h + 0.01 * torch.randn(h.shape, dtype=h.dtype, device=h.device)
            h = F.rrelu(h, training=True)
            h = F.alpha_dropout(h, 0.2, training=True)
            h = h[:, torch.randperm(h.shape[1], device=h.device)]
        return self.fc3(h)


def _train(devices: list[Any], seed: int, steps: int = 4, batch: int = 12) -> dict[str, torch.Tensor]:
    """Seeds, builds the model and data, trains `steps` SGD steps through
    DataParallel on `devices` and returns the final parameters, the last
    output and a draw from the default generator made after training."""
    torch.manual_seed(seed)
    device = torch.device("cpu") if devices[0] == "cpu" else torch.device("cuda", devices[0])
    model = Noisy().double().to(device)
    dp = dpcore.DataParallel(model, devices)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(batch, 8, dtype=torch.double, device=device)
    y = torch.randn(batch, 4, dtype=torch.double, device=device)
    out = None
    for _ in range(steps):
        opt.zero_grad()
        out = dp(x)
        F.mse_loss(out, y).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["__output__"] = out.detach().clone()
    state["__after__"] = torch.rand(4, dtype=torch.double, device=device)
    return state


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("devices", CPU_LISTS + CUDA_LISTS)
def test_same_seed_is_bitwise_reproducible(devices: list[Any]) -> None:
    first = _train(devices, seed=7)
    for _ in range(4):  # the replicas' timing differs from run to run
        again = _train(devices, seed=7)
        assert _bitwise_equal(first, again), [k for k in first if not torch.equal(first[k], again[k])]


@pytest.mark.parametrize("devices", CPU_LISTS + CUDA_LISTS)
def test_different_seeds_differ(devices: list[Any]) -> None:
    a, b = _train(devices, seed=7), _train(devices, seed=8)
    assert not torch.equal(a["__output__"], b["__output__"])
    assert not torch.equal(a["fc1.weight"], b["fc1.weight"])


@pytest.mark.parametrize("devices", CPU_LISTS + CUDA_LISTS)
def test_default_generator_is_advanced(devices: list[Any]) -> None:
    """A draw after a training step differs from the same draw with no step,
    and successive steps draw different masks."""
    device = torch.device("cpu") if devices[0] == "cpu" else torch.device("cuda", devices[0])
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)).double().to(device)
    x = torch.randn(12, 8, dtype=torch.double, device=device)
    state = torch.random.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    untouched = torch.rand(16, dtype=torch.double, device=device)
    if device.type == "cpu":
        torch.random.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)
    dp = dpcore.DataParallel(model, devices)
    first = dp(x)
    after = torch.rand(16, dtype=torch.double, device=device)
    assert not torch.equal(after, untouched)
    second = dp(x)
    assert not torch.equal(first == 0, second == 0), "two steps drew the same masks"


@pytest.mark.parametrize("devices", CPU_LISTS + CUDA_LISTS)
def test_replicas_draw_different_masks(devices: list[Any]) -> None:
    """Every replica gets the same rows: their dropout masks must differ."""
    k = len(devices)
    device = torch.device("cpu") if devices[0] == "cpu" else torch.device("cuda", devices[0])
    torch.manual_seed(0)
    model = nn.Dropout(0.5).to(device)
    x = torch.ones(4, 256, dtype=torch.double, device=device).repeat(k, 1)
    masks = dpcore.DataParallel(model, devices)(x).reshape(k, 4, 256) != 0
    for i in range(1, k):
        assert not torch.equal(masks[0], masks[i]), f"replica {i} drew replica 0's mask"
    # And each replica's mask is a real draw (about half kept), not all zeros or ones.
    assert 0.3 < masks.double().mean().item() < 0.7


@pytest.mark.parametrize("devices", CPU_LISTS + CUDA_LISTS)
def test_eval_mode_is_unaffected(devices: list[Any]) -> None:
    device = torch.device("cpu") if devices[0] == "cpu" else torch.device("cuda", devices[0])
    torch.manual_seed(1)
    model = Noisy().double().to(device).eval()
    x = torch.randn(12, 8, dtype=torch.double, device=device)
    state = torch.random.get_rng_state()
    out = dpcore.DataParallel(model, devices)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.random.get_rng_state(), state) or device.type == "cuda"


def test_replica_streams_are_seeded_by_replica_seeds() -> None:
    """The one seed derivation: each replica's stream has the seed that
    _C.replica_seeds (what CUDA-graph captures use) gives under the same seed."""

    class Seeds(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tensor([dpcore._C.replica_generator().initial_seed() % (1 << 62)])

    torch.manual_seed(8)
    want = dpcore._C.replica_seeds([torch.device("cpu")] * 3)
    torch.manual_seed(8)
    got = dpcore.DataParallel(Seeds(), ["cpu"] * 3)(torch.zeros(3, 1))
    assert got.tolist() == [s % (1 << 62) for s in want] and len(set(want)) == 3


def test_one_replica_draws_like_the_bare_module() -> None:
    """One device (or a batch of one row on several devices): the module runs
    as it is, on the default generator, so the output equals the bare
    module's under the same seed and the generator ends in the same state."""
    torch.manual_seed(5)
    model = Noisy().double()
    x = torch.randn(6, 8, dtype=torch.double)
    for devices, batch in ((["cpu"], x), (["cpu"] * 3, x[:1])):
        torch.manual_seed(11)
        bare = model(batch)
        bare_state = torch.random.get_rng_state()
        torch.manual_seed(11)
        wrapped = dpcore.DataParallel(model, devices)(batch)
        assert torch.equal(wrapped, bare)
        assert torch.equal(torch.random.get_rng_state(), bare_state)


def test_synchronized_batchnorm_is_reproducible() -> None:
    """The synchronized BatchNorm path (all replicas at once) draws per replica too."""

    def run() -> dict[str, torch.Tensor]:
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2)).double()
        dp = dpcore.DataParallel(model, ["cpu"] * 3, sync_batchnorm=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(12, 8, dtype=torch.double)
        for _ in range(3):
            opt.zero_grad()
            dp(x).square().mean().backward()
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    first = run()
    for _ in range(3):
        assert _bitwise_equal(first, run())


def test_criterion_and_transformer_layer_are_reproducible() -> None:
    """Dropout drawn inside ATen's own composites (the attention and
    feed-forward dropout of a TransformerEncoderLayer) and a criterion."""

    def run() -> torch.Tensor:
        torch.manual_seed(4)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.3, batch_first=True).double()
        dp = dpcore.DataParallel(layer, ["cpu"] * 3, criterion=nn.MSELoss())
        opt = torch.optim.SGD(layer.parameters(), lr=0.05)
        x = torch.randn(9, 5, 16, dtype=torch.double)
        for _ in range(3):
            opt.zero_grad()
            loss = dp(x, torch.zeros(9, 5, 16, dtype=torch.double))
            loss.backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in layer.parameters()] + [loss.detach().reshape(1)])

    first = run()
    for _ in range(3):
        assert torch.equal(first, run())


def test_parallel_apply_is_reproducible() -> None:
    """dpcore.parallel_apply on calls that share the CPU generator."""

    def run() -> list[torch.Tensor]:
        torch.manual_seed(9)
        return dpcore.parallel_apply([lambda n: torch.rand(n)] * 4, [(1000,)] * 4, devices=["cpu"] * 4)

    first = run()
    assert all(not torch.equal(first[0], t) for t in first[1:])
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(first, run()))


def test_explicit_generator_is_respected() -> None:
    """A generator passed explicitly inside a replica is used as it is."""

    class Explicit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = torch.Generator().manual_seed(123)
            return self.lin(x) + torch.rand(x.shape, generator=g, dtype=x.dtype)

    model = Explicit().double()
    x = torch.randn(6, 4, dtype=torch.double)
    out = dpcore.DataParallel(model, ["cpu"] * 2)(x)
    noise = out - torch.cat([model.lin(x[:3]), model.lin(x[3:])])
    g = torch.Generator().manual_seed(123)
    torch.testing.assert_close(noise, torch.rand((3, 4), generator=g, dtype=x.dtype).repeat(2, 1))


@requires_cuda
@pytest.mark.cuda
def test_distinct_cuda_devices_keep_their_generators() -> None:
    """Replicas on distinct CUDA devices draw from their devices' own
    generators, as the bare module on each device would."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.manual_seed(0)
    model = nn.Dropout(0.5).cuda(0)
    x = torch.ones(8, 64, device="cuda:0")
    torch.manual_seed(6)
    out = dpcore.DataParallel(model, [0, 1])(x)
    torch.manual_seed(6)
    with torch.cuda.device(0):
        first = model(x[:4])
    with torch.cuda.device(1):
        second = model.to(1)(x[4:].to(1))
    assert torch.equal(out[:4] != 0, first != 0)
    assert torch.equal(out[4:].cpu() != 0, second.cpu() != 0)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("devices", CPU_LISTS + CUDA_LISTS)
def test_checkpointed_dropout_recomputes_the_forward_masks(devices: list[Any], reentrant: bool) -> None:
    """Activation checkpointing saves the generator state in forward and
    recomputes the masks from it in backward: the gradient must use the
    masks of the forward (x -> dropout(x * w), so d sum / dx = kept * 2)."""
    from torch.utils.checkpoint import checkpoint

    device = torch.device("cpu") if devices[0] == "cpu" else torch.device("cuda", devices[0])

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1, dtype=torch.double, device=device))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda t: F.dropout(t * self.w, 0.5), x, use_reentrant=reentrant)

    torch.manual_seed(0)
    dp = dpcore.DataParallel(Checkpointed(), devices)
    for _ in range(3):
        x = torch.ones(6 * len(devices), 128, dtype=torch.double, device=device, requires_grad=True)
        y = dp(x)
        y.sum().backward()
        assert torch.equal(x.grad, (y != 0).double() * 2)


def test_lstm_dropout_and_multinomial_are_reproducible() -> None:
    """LSTM's inter-layer dropout (drawn inside ATen's lstm) and multinomial."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 8, num_layers=2, dropout=0.5, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lstm(x)[0]
            picks = torch.multinomial(torch.ones(y.shape[0], 5, dtype=y.dtype), 3)
            return y + picks.to(y.dtype).sum(-1).reshape(-1, 1, 1)

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        model = Recurrent().double()
        return dpcore.DataParallel(model, ["cpu"] * 3)(torch.randn(6, 3, 4, dtype=torch.double))

    first = run()
    for _ in range(4):
        assert torch.equal(first, run())


def test_nested_data_parallel_is_reproducible() -> None:
    """A DataParallel inside a replica derives its replicas' streams from the
    outer replica's stream."""

    def run() -> torch.Tensor:
        torch.manual_seed(1)
        inner = dpcore.DataParallel(nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5)).double(), ["cpu"] * 2)
        outer = dpcore.DataParallel(nn.Sequential(inner, nn.Dropout(0.3)), ["cpu"] * 2)
        return outer(torch.randn(8, 4, dtype=torch.double))

    first = run()
    for _ in range(4):
        assert torch.equal(first, run())


def test_fork_rng_inside_a_replica_works_on_its_stream() -> None:
    """Saving and restoring the state inside a replica (torch.random.fork_rng,
    get_rng_state/set_rng_state) acts on the generator the replica draws from."""

    class Replay(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            state = torch.get_rng_state()
            first = torch.rand_like(x)
            torch.set_rng_state(state)
            second = torch.rand_like(x)
            with torch.random.fork_rng():
                torch.rand_like(x)
            third = torch.rand_like(x)
            return torch.stack([first, second, third])

    torch.manual_seed(2)
    out = dpcore.DataParallel(Replay(), ["cpu"] * 3, dim=1)(torch.zeros(1, 6, 16))
    first, second, third = out.unbind(0)
    assert torch.equal(first, second)
    assert not torch.equal(first, third)
    assert not torch.equal(first[0], first[2])  # the replicas' streams differ


@requires_cuda
@pytest.mark.cuda
def test_cuda_fused_kernels_are_reproducible_on_one_device() -> None:
    """[0, 0]: the fused dropout kernel and scaled_dot_product_attention with
    dropout (fused kernels that take the device generator themselves)."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.proj(x).view(x.shape[0], 4, 16, 16)
            y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
            return F.dropout(y, 0.5).flatten(1)

    def run(dtype: torch.dtype) -> torch.Tensor:
        torch.manual_seed(3)
        model = Attention().to("cuda", dtype)
        dp = dpcore.DataParallel(model, [0, 0])
        x = torch.randn(8, 16, 64, device="cuda", dtype=dtype)
        out = dp(x)
        out.float().square().sum().backward()
        return torch.cat([out.detach().flatten().float(), model.proj.weight.grad.flatten().float()])

    for dtype in (torch.float32, torch.float16):
        first = run(dtype)
        for _ in range(3):
            assert torch.equal(first, run(dtype))


def test_other_threads_keep_torch_as_it_is_during_a_parallel_call() -> None:
    """While replicas draw from their streams, another thread draws from the
    default generator exactly as with no dpcore call running: its
    torch.get_rng_state is the default generator's real state, its torch.rand
    numbers are that generator's, torch.set_rng_state sets that generator;
    and the replicas' numbers do not depend on that thread."""
    replicas_drew = threading.Event()
    outside_done = threading.Event()
    seen: dict[str, Any] = {}

    class DrawsMeanwhile(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.dropout(x, 0.5)  # the streams exist: the group's number is taken
            replicas_drew.set()
            while "outside" in seen and not outside_done.wait(0.001):
                torch.rand(64)  # the replica keeps drawing from its stream meanwhile
            return y

    def outside() -> None:
        assert replicas_drew.wait(60)
        seen["state"] = torch.get_rng_state()
        seen["real"] = torch.default_generator.get_state()
        seen["numbers"] = torch.cat([torch.rand(64) for _ in range(200)])
        torch.set_rng_state(seen["state"])
        seen["again"] = torch.rand(64)
        outside_done.set()

    def run(with_thread: bool) -> torch.Tensor:
        replicas_drew.clear()
        outside_done.clear()
        seen.clear()
        torch.manual_seed(0)
        dp = dpcore.DataParallel(DrawsMeanwhile(), ["cpu"] * 2)
        if not with_thread:
            return dp(torch.ones(4, 256))
        seen["outside"] = True
        thread = threading.Thread(target=outside)
        thread.start()
        try:
            return dp(torch.ones(4, 256))
        finally:
            outside_done.set()
            thread.join()

    alone = run(with_thread=False)
    assert torch.equal(run(with_thread=True), alone)
    assert torch.equal(seen["state"], seen["real"])
    plain = torch.Generator().set_state(seen["state"])  # the default generator from that state, no dpcore
    assert torch.equal(seen["numbers"], torch.cat([torch.rand(64, generator=plain) for _ in range(200)]))
    assert torch.equal(seen["again"], seen["numbers"][:64])


class ReadsStates(nn.Module):
    """Returns, per replica, whether torch.get_rng_state() read the default
    generator's state (it draws nothing: that state cannot move meanwhile)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        same = torch.equal(torch.get_rng_state(), torch.default_generator.get_state())
        return torch.full((x.shape[0],), float(same))


def test_streams_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """DPCORE_REPLICA_RNG=0: the replicas draw from the shared default
    generator (torch.get_rng_state inside them reads it); 1 or unset: their
    own streams; anything else: an error naming the variable."""
    dp = dpcore.DataParallel(ReadsStates(), ["cpu"] * 2)
    x = torch.zeros(4, 1)
    assert not dp(x).any()  # on by default: each replica reads its own stream
    monkeypatch.setenv("DPCORE_REPLICA_RNG", "0")
    assert dp(x).all()
    monkeypatch.setenv("DPCORE_REPLICA_RNG", "1")
    assert not dp(x).any()
    monkeypatch.setenv("DPCORE_REPLICA_RNG", "yes")
    with pytest.raises(ValueError, match="DPCORE_REPLICA_RNG to be 0 or 1, but it is 'yes'"):
        dp(x)


#: torch's RNG-state names that dpcore binds while a replica with a stream runs.
STATE_NAMES = [
    (owner, name)
    for owner in (torch, torch.random, torch.cuda, torch.cuda.random)
    for name in ("get_rng_state", "set_rng_state")
]


def _bound(originals: list[Any]) -> list[bool]:
    """Per name of STATE_NAMES, whether it is bound to something other than `originals`' entry."""
    return [getattr(owner, name) is not f for (owner, name), f in zip(STATE_NAMES, originals)]


class SeesBindings(nn.Module):
    """Records, per call, _bound(torch's functions) seen inside the replica, then applies dropout."""

    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else nn.Identity()
        self.originals = [getattr(owner, name) for owner, name in STATE_NAMES]
        self.seen: list[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(_bound(self.originals))
        return F.dropout(self.inner(x), 0.5)


def test_torch_names_are_bound_only_while_replicas_with_streams_run() -> None:
    """Inside every replica with a stream (nested ones too), torch's RNG-state
    names are dpcore's; before and after a call they are torch's own (no
    process-wide patch left); a lone replica never sees dpcore's; a name that
    code rebinds during a call keeps that code's value."""
    originals = [getattr(owner, name) for owner, name in STATE_NAMES]
    inner = SeesBindings()
    outer = SeesBindings(dpcore.DataParallel(inner, ["cpu"] * 2))
    x = torch.ones(8, 16)
    dpcore.DataParallel(outer, ["cpu"] * 2)(x)
    assert outer.seen == [[True] * 8] * 2 and inner.seen == [[True] * 8] * 4
    assert _bound(originals) == [False] * 8
    lone = SeesBindings()
    dpcore.DataParallel(lone, ["cpu"])(x)
    assert lone.seen == [[False] * 8] and _bound(originals) == [False] * 8

    class Rebinds(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.get_rng_state = mine
            return x

    def mine() -> torch.Tensor:
        return originals[0]()

    try:
        dpcore.DataParallel(Rebinds(), ["cpu"] * 2)(x)
        assert torch.get_rng_state is mine and _bound(originals)[1:] == [False] * 7
    finally:
        torch.get_rng_state = originals[0]


def test_kernels_are_cpp_and_installed_once_on_first_need() -> None:
    """Nothing is installed before a parallel call gives a replica a stream,
    nor ever while DPCORE_REPLICA_RNG=0 (torch's names are not rebound even
    inside replicas); then the kernels are C++ ones, registered once (a
    fresh process)."""
    script = """
import os, torch, dpcore
from test_randomness import SeesBindings
key = "TESTING_ONLY_GenericMode"
model = SeesBindings()
x = torch.randn(8, 4)
dpcore.DataParallel(model, ["cpu"])(x)                    # one replica: nothing shared
dpcore.DataParallel(model, ["cpu"] * 2)(x)                # the streams are off
assert torch._C._dispatch_get_registrations_for_dispatch_key(key) == []
assert model.seen == [[False] * 8] * 3, model.seen
os.environ["DPCORE_REPLICA_RNG"] = "1"
dpcore.DataParallel(model, ["cpu"] * 2)(x)
assert model.seen[3:] == [[True] * 8] * 2, model.seen
registered = torch._C._dispatch_get_registrations_for_dispatch_key(key)
assert "aten::bernoulli_.float" in registered and "aten::native_dropout" in registered, registered
assert all(name.startswith("aten::") for name in registered), registered
dump = torch._C._dispatch_dump("aten::bernoulli_.float")
line = next(l for l in dump.splitlines() if l.startswith(key))
assert "replica_rng.cpp" in line, line
dpcore.DataParallel(model, ["cpu"] * 3)(x)
assert torch._C._dispatch_get_registrations_for_dispatch_key(key) == registered
print("ok")
"""
    env = subprocess_env()
    env["DPCORE_REPLICA_RNG"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=TESTS_DIR, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_key_taken_by_other_code_warns_once_and_shares_the_generator() -> None:
    """Where other code has registered on the dispatch key, dpcore installs
    nothing (no kernel, no rebinding) and says so once; the replicas then
    draw from the shared generator (a fresh process)."""
    script = """
import warnings, torch, dpcore
from torch import nn
original = torch.get_rng_state
other = torch.library.Library("aten", "IMPL")
other.impl("sin", lambda keys, x: torch.ops.aten.sin.default.redispatch(keys, x), "TESTING_ONLY_GenericMode", with_keyset=True)
model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        dpcore.DataParallel(model, ["cpu"] * 2)(torch.randn(8, 4))
messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
assert len(messages) == 1, messages
assert "not reproducible" in messages[0] and "already used by other code (aten::sin" in messages[0], messages
assert torch._C._dispatch_get_registrations_for_dispatch_key("TESTING_ONLY_GenericMode") == ["aten::sin"]
assert torch.get_rng_state is original
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=TESTS_DIR, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
