"""torch.compile'd models under dpcore.DataParallel, on CPU device lists.

Each form of compiled model (``DataParallel(torch.compile(m))``, a model
with a compiled submodule, ``m.compile()`` then ``DataParallel(m)``) trains
exactly like the same compiled model on one device (float64, several SGD
steps, the eager, aot_eager and inductor backends); every replica runs
compiled code (a counting backend counts the compiled graphs' runs) on its
own parameters (a buffer the forward increments, and which the output
reads, ends where one device leaves it); nothing is compiled after the
first step; and the user's modules are not modified by wrapping.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

import dpcore

STEPS = 3
BATCH = 7  # uneven over 2 and 3 replicas


class Net(nn.Module):
    """A tiny MLP whose forward increments a buffer and reads it: a replica
    that ran the master's compiled call (or a copy that drifted) gives other
    outputs and another count than one device."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        # Not 0-dim: torch 2.13's aot backends drop an add_ on a 0-dim buffer.
        self.register_buffer("calls", torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.body(x) + 0.125 * self.calls


class Counting:
    """A torch.compile backend that compiles with backend `name` and counts
    the graphs it compiled and the runs of their compiled forwards (from any
    thread)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.graphs = 0
        self.runs = 0
        self.linear_graphs = 0  # graphs holding a linear layer (the model's own code)
        self._lock = threading.Lock()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = lookup_backend(self.name)(gm, example_inputs)
        with self._lock:
            self.graphs += 1
            if any(node.target is torch._C._nn.linear for node in gm.graph.nodes):
                self.linear_graphs += 1

        def run(*args: Any) -> Any:
            with self._lock:
                self.runs += 1
            return compiled(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    """Each test starts with Dynamo's caches empty (the recompile limit is per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _base() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 5, dtype=torch.float64, generator=g),
            torch.randn(BATCH, 3, dtype=torch.float64, generator=g),
        )
        for _ in range(STEPS)
    ]


def _compiled(form: str, base: Net, backend: Any) -> tuple[Net, nn.Module]:
    """(the user's model, what is called) for one form of compiled model."""
    model = copy.deepcopy(base)
    if form == "wrapped":
        return model, torch.compile(model, backend=backend)
    if form == "submodule":
        model.body = torch.compile(model.body, backend=backend)  # type: ignore[assignment]
        return model, model
    assert form == "inplace"
    model.compile(backend=backend)
    return model, model


def _train(
    model: Net, net: Callable[[torch.Tensor], torch.Tensor], after_first: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Outputs, gradients, final parameters and the call count of STEPS SGD steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs, grads = [], []
    for step, (x, y) in enumerate(_data()):
        out = net(x)
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        outs.append(out.detach().clone())
        if step == 0 and after_first is not None:
            after_first()
    params = [p.detach().clone() for p in model.parameters()]
    return {"outs": outs, "grads": grads, "params": params, "calls": model.calls.item()}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["calls"] == want["calls"] == STEPS
    for a, b in zip(got["outs"], want["outs"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    for ga, gb in zip(got["grads"], want["grads"], strict=True):
        for a, b in zip(ga, gb, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    for a, b in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def _snapshot(
    root: nn.Module,
) -> list[tuple[nn.Module, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """Every module of `root`'s tree with copies of its __dict__, _parameters, _buffers and _modules."""
    return [
        (
            m,
            dict(m.__dict__),
            dict(m.__dict__["_parameters"]),
            dict(m.__dict__["_buffers"]),
            dict(m.__dict__["_modules"]),
        )
        for m in root.modules()
    ]


def _assert_unchanged(before: list[Any], root: nn.Module) -> None:
    """The tree has the same modules, and each the same entries (the same objects) as in `before`."""
    after = _snapshot(root)
    assert [m for m, *_ in after] == [m for m, *_ in before]
    for (m, *old), (_, *new) in zip(before, after, strict=True):
        for old_dict, new_dict in zip(old, new, strict=True):
            assert old_dict.keys() == new_dict.keys(), type(m).__name__
            for key, value in old_dict.items():
                assert new_dict[key] is value, f"{type(m).__name__}.{key} was replaced"


BACKENDS = ["eager", "aot_eager", "inductor"]
FORMS = ["wrapped", "submodule", "inplace"]


def _cases() -> list[Any]:
    """Every form and backend on 3 replicas; eager and aot_eager on 2 as well
    (inductor compiles for seconds per graph on a CPU)."""
    cases = [pytest.param(form, backend, 3, id=f"{form}-{backend}-3") for form in FORMS for backend in BACKENDS]
    cases += [pytest.param(form, backend, 2, id=f"{form}-{backend}-2") for form in FORMS for backend in BACKENDS[:2]]
    return cases


@pytest.mark.parametrize(("form", "backend", "k"), _cases())
def test_compiled_model_trains_like_one_device(form: str, backend: str, k: int) -> None:
    base = _base()
    want_model, want_net = _compiled(form, base, Counting(backend))
    want = _train(want_model, want_net)

    counting = Counting(backend)
    model, net = _compiled(form, base, counting)
    before = _snapshot(net)
    dp = dpcore.DataParallel(net, ["cpu"] * k)
    graphs_after_first: list[int] = []
    runs_after_first: list[int] = []

    def first_step_done() -> None:
        graphs_after_first.append(counting.graphs)
        runs_after_first.append(counting.runs)

    got = _train(model, dp, after_first=first_step_done)
    _assert_same(got, want)
    _assert_unchanged(before, net)
    # Compiled once per kind of replica on the first step (the master with
    # its leaf parameters; the replicas with their copies), never after.
    assert 1 <= graphs_after_first[0] <= k
    assert counting.graphs == graphs_after_first[0]
    # Each replica ran compiled code on every step: one forward run per replica.
    assert runs_after_first[0] >= k
    assert counting.runs - runs_after_first[0] == (STEPS - 1) * runs_after_first[0]
    assert counting.runs == STEPS * k


def test_compiled_model_counts_calls_once_per_call() -> None:
    """module.compile() then DataParallel: the master's state a forward
    updates is updated once per call (not once per replica), and the
    replicas' compiled calls are their own."""
    base = _base()
    model = copy.deepcopy(base)
    model.compile(backend="eager")
    dp = dpcore.DataParallel(model, ["cpu"] * 3)
    x = torch.randn(6, 5, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(4):
            dp(x)
    assert model.calls.item() == 4
    replicas = dp._cache.replica_modules
    calls = [row[0].__dict__["_compiled_call_impl"] for row in replicas]
    assert all(c is not model.__dict__["_compiled_call_impl"] for c in calls)
    assert len({id(c) for c in calls}) == len(calls)


@pytest.mark.parametrize("k", [2, 3])
def test_compile_after_wrapping(k: int) -> None:
    """module.compile() called after the wrapper's first steps: the next
    steps run compiled replicas of their own, exactly like one device."""
    base = _base()
    want_model = copy.deepcopy(base)
    want = _train(want_model, want_model, after_first=lambda: want_model.compile(backend="eager"))

    model = copy.deepcopy(base)
    dp = dpcore.DataParallel(model, ["cpu"] * k)
    counting = Counting("eager")
    got = _train(model, dp, after_first=lambda: model.compile(backend=counting))
    _assert_same(got, want)
    assert counting.runs == (STEPS - 1) * k


def test_replicas_of_a_compiled_module_are_compiled_with_its_options() -> None:
    """Each replica's compiled forward comes from the master's own Dynamo
    context (backend and options), applied to the replica's inner module."""
    base = _base()
    counting = Counting("eager")
    compiled = torch.compile(copy.deepcopy(base), backend=counting, dynamic=False)
    dp = dpcore.DataParallel(compiled, ["cpu"] * 3)
    with torch.no_grad():
        dp(torch.randn(6, 5, dtype=torch.float64))
    for j, row in enumerate(dp._cache.replica_modules):
        replica = row[0]
        assert type(replica) is type(compiled)
        assert replica.dynamo_ctx is compiled.dynamo_ctx
        assert replica._orig_mod is row[1] and replica._orig_mod is not compiled._orig_mod
        assert replica.__dict__["forward"] is not compiled.__dict__["forward"], j
    assert counting.runs == 3


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_of_dataparallel_runs_the_model_eagerly(backend: str) -> None:
    """torch.compile(DataParallel(m)) trains like one device; Dynamo breaks
    its graph at each call into dpcore's C++ and the replicas run in
    dpcore's worker threads, where the compile does not reach: no graph of
    the model's own layers is compiled (as docs/compiled.md says)."""
    base = _base()
    want_model = copy.deepcopy(base)
    want = _train(want_model, want_model)

    model = copy.deepcopy(base)
    counting = Counting(backend)
    net = torch.compile(dpcore.DataParallel(model, ["cpu"] * 3), backend=counting)
    got = _train(model, net)
    _assert_same(got, want)
    assert counting.linear_graphs == 0


def test_torch_compile_of_dataparallel_fullgraph_is_an_error() -> None:
    """fullgraph=True cannot trace dpcore's orchestration (docs/compiled.md
    says so): Dynamo raises its Unsupported error, and the model is untouched."""
    model = _base()
    before = _snapshot(model)
    net = torch.compile(dpcore.DataParallel(model, ["cpu"] * 2), backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        net(torch.randn(4, 5, dtype=torch.float64))
    _assert_unchanged(before, model)
    assert model.calls.item() == 0


@pytest.mark.parametrize("form", FORMS)
def test_cuda_graphs_with_a_compiled_module_is_an_error(form: str) -> None:
    """cuda_graphs=True does not capture compiled modules: a ValueError that
    names the alternatives, raised before the device list is looked at."""
    _, net = _compiled(form, _base(), "eager")
    with pytest.raises(ValueError, match=r"cuda_graphs=True.*torch\.compile.*cuda_graphs=False"):
        dpcore.DataParallel(net, ["cpu"] * 2, cuda_graphs=True)


def test_compiled_model_with_sync_batchnorm_trains_like_one_device() -> None:
    """sync_batchnorm=True over a compiled model: the synchronized statistics
    (Dynamo breaks its graph at the rendezvous) give the compiled model's
    single-device outputs, gradients and running statistics."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    want_model, got_model = copy.deepcopy(base), copy.deepcopy(base)
    want_net = torch.compile(want_model, backend="eager")
    dp = dpcore.DataParallel(torch.compile(got_model, backend="eager"), ["cpu"] * 3, sync_batchnorm=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (want_model, got_model)]
    for x, y in _data():
        for net, opt in zip((want_net, dp), opts):
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
    for a, b in zip(want_model.state_dict().values(), got_model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_compile_disabled_runs_each_replica_on_its_own() -> None:
    """module.compile(disable=True) stores the master's bound _call_impl:
    each replica calls its own instead (once per call on the master)."""
    model = _base()
    model.compile(disable=True)
    assert model.__dict__["_compiled_call_impl"].__self__ is model
    dp = dpcore.DataParallel(model, ["cpu"] * 3)
    want = copy.deepcopy(_base())
    x = torch.randn(6, 5, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(dp(x), want(x), rtol=1e-9, atol=1e-9)
    assert model.calls.item() == 2


def test_an_unknown_compiled_call_is_an_error() -> None:
    """A _compiled_call_impl that torch.compile did not make cannot be made
    again for each replica: a TypeError naming the module, not the master's
    callable run on every replica."""
    model = _base()
    model._compiled_call_impl = lambda *args, **kwargs: model._call_impl(*args, **kwargs)
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    with pytest.raises(TypeError, match=r"module 0 of the model \(Net\) holds a _compiled_call_impl"):
        dp(torch.randn(4, 5, dtype=torch.float64))
