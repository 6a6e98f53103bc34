"""DataParallel(cuda_graphs=True): graph-captured replicas.

The CPU tests check the argument rules and the pure parts of dpcore._graphs
(call signatures, hook detection, what cannot be captured); the CUDA tests
(skipped without a GPU) check that replayed steps equal eager dpcore, the
fallbacks and re-capture.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dpcore
from dpcore import _graphs
from conftest import CUDA_PARAMS, requires_cuda

STEPS = _graphs.WARMUP_CALLS + 3  # warm-up, the capture, then replays


# -- argument rules (CPU) ---------------------------------------------------


@pytest.mark.parametrize("value", [1, "yes", None])
def test_cuda_graphs_must_be_bool(value: Any) -> None:
    with pytest.raises(TypeError, match=r"cuda_graphs: expected True or False"):
        dpcore.DataParallel(nn.Linear(2, 2), ["cpu", "cpu"], cuda_graphs=value)


def test_cuda_graphs_on_cpu_list_is_value_error() -> None:
    with pytest.raises(
        ValueError, match=r"cuda_graphs=True needs a CUDA device list, but device_ids is \['cpu', 'cpu'\]"
    ):
        dpcore.DataParallel(nn.Linear(2, 2), ["cpu", "cpu"], cuda_graphs=True)


def test_cuda_graphs_with_sync_batchnorm_is_value_error() -> None:
    with pytest.raises(ValueError, match=r"cannot be combined with sync_batchnorm=True"):
        dpcore.DataParallel(nn.BatchNorm1d(2), ["cpu", "cpu"], cuda_graphs=True, sync_batchnorm=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")
def test_cuda_graphs_without_gpu_or_devices_is_value_error() -> None:
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs CUDA devices, but no device_ids were given"):
        dpcore.DataParallel(nn.Linear(2, 2), cuda_graphs=True)


def test_cuda_graphs_off_keeps_the_eager_path_and_pickles() -> None:
    dp = dpcore.DataParallel(nn.Linear(3, 2), ["cpu", "cpu"])
    assert dp.cuda_graphs is False and dp._graphs is None
    copy = pickle.loads(pickle.dumps(dp))
    assert copy._graphs is None
    x = torch.randn(4, 3)
    torch.testing.assert_close(copy(x), dp(x))


# -- signatures and hooks (CPU) -----------------------------------------------


def _key(
    args: list[tuple[Any, ...]], kws: list[dict[str, Any]] | None = None, modules: list[nn.Module] | None = None
) -> Any:
    kws = kws if kws is not None else [{} for _ in args]
    return _graphs.call_signature(args, kws, list(range(len(args))), modules or [])


def test_signature_bakes_non_tensor_leaves_and_containers() -> None:
    assert _key([(1, "a")]) == _key([(1, "a")])
    assert _key([(1, "a")]) != _key([(2, "a")])
    assert _key([(1,)]) != _key([(1.0,)])  # equal values of different types are different graphs
    assert _key([([1, 2],)]) != _key([((1, 2),)])
    assert _key([()], [{"k": None}]) != _key([()], [{"j": None}])
    assert _key([(1,), (1,)]) != _key([(1,)])  # how many replicas run


def test_signature_follows_grad_mode_and_training_flags() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    modules = list(m.modules())
    with torch.no_grad():
        frozen = _key([(1,)], modules=modules)
    assert frozen != _key([(1,)], modules=modules)
    train = _key([(1,)], modules=modules)
    m[1].eval()
    assert _key([(1,)], modules=modules) != train


def test_signature_refuses_cpu_tensors_and_unhashable_leaves() -> None:
    with pytest.raises(_graphs.Uncapturable, match=r"replica 0's input\[0\]\[0\] is a tensor on cpu"):
        _key([(torch.zeros(2),)])
    with pytest.raises(_graphs.Uncapturable, match=r"replica 1's input\[1\]\['opts'\] is an unhashable _Unhashable"):
        _key([(), ()], [{}, {"opts": _Unhashable()}])


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


def test_hook_reason_names_the_module_and_the_hook() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert _graphs.hook_reason(list(m.modules())) is None
    handle = m[1].register_forward_hook(lambda *a: None)
    assert _graphs.hook_reason(list(m.modules())) == "a ReLU module has a hook registered (_forward_hooks)"
    handle.remove()
    handle = m[0].register_full_backward_hook(lambda *a: None)
    assert "Linear module has a hook registered (_backward_hooks)" in str(_graphs.hook_reason(list(m.modules())))
    handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert "global module hook" in str(_graphs.hook_reason(list(m.modules())))
    finally:
        handle.remove()
    assert _graphs.hook_reason(list(m.modules())) is None


# -- CUDA: replays equal eager dpcore -------------------------------------------


def _mlp(seed: int = 0, dropout: float = 0.0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3)]
    return nn.Sequential(*layers).double()


def _pair(devices: list[Any], **options: Any) -> tuple[Any, Any]:
    """The same model wrapped eagerly and with CUDA graphs."""
    model_options = options.pop("model", {})
    eager = dpcore.DataParallel(_mlp(**model_options).cuda(), devices, **options)
    graphed_model = _mlp(**model_options).cuda()
    graphed_model.load_state_dict(eager.module.state_dict())
    graphed = dpcore.DataParallel(graphed_model, devices, cuda_graphs=True, **options)
    return eager, graphed


def _train_steps(
    dp: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Output and master gradients after each SGD step over `batches`."""
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    trace = []
    for x, y in batches:
        opt.zero_grad()
        out = dp(x)
        nn.functional.cross_entropy(out, y).backward()
        trace.append((out.detach().clone(), [p.grad.clone() for p in dp.module.parameters()]))
        opt.step()
    return trace


def _batches(n: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(batch, 6, generator=g, dtype=torch.float64).cuda(),
            torch.randint(0, 3, (batch,), generator=g).cuda(),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("devices", CUDA_PARAMS)
def test_graphed_steps_equal_eager(devices: list[Any]) -> None:
    eager, graphed = _pair(devices)
    batches = _batches(STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back
        got = _train_steps(graphed, batches)
    want = _train_steps(eager, batches)
    for (out, grads), (out_e, grads_e) in zip(got, want):
        torch.testing.assert_close(out, out_e, rtol=1e-12, atol=1e-12)
        for g, g_e in zip(grads, grads_e):
            torch.testing.assert_close(g, g_e, rtol=1e-12, atol=1e-12)
    assert len(graphed._graphs._entries) == 1  # captured, and replayed since


class _Counting(nn.Module):
    """Counts the Python calls of its forward (a replay makes none)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


@requires_cuda
@pytest.mark.cuda
def test_replays_run_no_python_forward() -> None:
    model = _Counting().cuda()
    dp = dpcore.DataParallel(model, [0, 0], cuda_graphs=True)
    x = torch.randn(4, 4, device="cuda")
    for _ in range(_graphs.WARMUP_CALLS + 1):  # warm-up, then the capture (replica 0 is the master)
        dp(x).sum().backward()
    before = model.calls
    for _ in range(3):
        dp(x).sum().backward()
    assert model.calls == before


@pytest.mark.parametrize("devices", CUDA_PARAMS)
def test_batchnorm_statistics_advance_as_in_eager(devices: list[Any]) -> None:
    eager, graphed = _pair(devices, model={"batchnorm": True})
    batches = _batches(STEPS)
    _train_steps(graphed, batches)
    _train_steps(eager, batches)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(
            getattr(graphed.module[1], name), getattr(eager.module[1], name), rtol=1e-12, atol=1e-12
        )
    graphed.eval()
    eager.eval()
    x = batches[0][0]
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), eager(x), rtol=1e-12, atol=1e-12)


@requires_cuda
@pytest.mark.cuda
def test_dropout_draws_fresh_numbers_every_replay_and_replica() -> None:
    model = nn.Dropout(0.5).cuda()
    dp = dpcore.DataParallel(model, [0, 0], cuda_graphs=True, gather=False)
    x = torch.ones(2, 4096, device="cuda")
    masks = []
    with torch.no_grad():
        for _ in range(_graphs.WARMUP_CALLS + 4):
            outs = dp(x)
            masks.append([o != 0 for o in outs])
    assert dp._graphs._entries, "the signature was captured"
    replays = masks[_graphs.WARMUP_CALLS :]
    for a, b in zip(replays, replays[1:]):
        assert not torch.equal(a[0], b[0])  # fresh numbers every replay
    for replica_masks in replays:
        assert not torch.equal(replica_masks[0], replica_masks[1])  # replicas draw different numbers
        assert 0.4 < replica_masks[0].float().mean().item() < 0.6


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> tuple[torch.Tensor, dict[str, Any]]:
        h = self.lin(batch["x"]) * scale
        return h, {"sum": h.sum(dim=1), "tag": "t"}


@requires_cuda
@pytest.mark.cuda
def test_nested_inputs_outputs_and_gather_false() -> None:
    torch.manual_seed(0)
    model = _Nested().cuda()
    dp = dpcore.DataParallel(model, [0, 0], cuda_graphs=True, gather=False)
    x = torch.randn(6, 4, dtype=torch.float64, device="cuda")
    kept = []
    for _ in range(STEPS):
        outs = dp({"x": x}, scale=2.0)
        sum(h.sum() + extra["sum"].sum() for h, extra in outs).backward()
        kept.append(outs)
    assert dp._graphs._entries, "the signature was captured"
    for j, (h, extra) in enumerate(kept[-1]):
        want = model.lin(x[3 * j : 3 * j + 3]) * 2.0
        torch.testing.assert_close(h, want)
        torch.testing.assert_close(extra["sum"], want.sum(dim=1))
        assert extra["tag"] == "t"
    # outputs handed out are not overwritten by later replays
    torch.testing.assert_close(kept[-2][0][0], kept[-1][0][0])
    assert kept[-2][0][0].data_ptr() != kept[-1][0][0].data_ptr()


@requires_cuda
@pytest.mark.cuda
def test_criterion_and_inference_graphs() -> None:
    eager, graphed = _pair([0, 0, 0], criterion=nn.CrossEntropyLoss())
    batches = _batches(STEPS, batch=10)
    for dp in (eager, graphed):
        dp.losses = []
        opt = torch.optim.SGD(dp.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            loss = dp(x, y)
            loss.backward()
            dp.losses.append(loss.detach())
            opt.step()
    torch.testing.assert_close(torch.stack(graphed.losses), torch.stack(eager.losses), rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # a forward-only signature of its own
        for _ in range(STEPS):
            torch.testing.assert_close(graphed(*batches[0]), eager(*batches[0]), rtol=1e-12, atol=1e-12)
    assert len(graphed._graphs._entries) == 2


# -- CUDA: fallbacks and re-capture -------------------------------------------


def _run(dp: Any, steps: int = STEPS, batch: int = 8) -> None:
    for x, y in _batches(steps, batch):
        nn.functional.cross_entropy(dp(x), y).backward()


@requires_cuda
@pytest.mark.cuda
def test_module_hook_falls_back_with_one_warning() -> None:
    eager, graphed = _pair([0, 0])
    graphed.module[0].register_forward_hook(lambda m, i, o: o * 2)
    eager.module[0].register_forward_hook(lambda m, i, o: o * 2)
    x = _batches(1)[0][0]
    with pytest.warns(RuntimeWarning, match=r"running eagerly: a Linear module has a hook registered") as record:
        outs = [graphed(x) for _ in range(STEPS)]
    assert len([w for w in record if "cuda_graphs" in str(w.message)]) == 1
    torch.testing.assert_close(outs[-1], eager(x), rtol=1e-12, atol=1e-12)
    assert not graphed._graphs._entries


class _Syncs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * 2 if h.sum().item() > 0 else h  # data-dependent: a host synchronization


@requires_cuda
@pytest.mark.cuda
def test_host_sync_in_forward_falls_back_for_that_signature() -> None:
    model = _Syncs().cuda()
    dp = dpcore.DataParallel(model, [0, 0], cuda_graphs=True)
    x = _batches(1)[0][0]
    with pytest.warns(RuntimeWarning, match=r"running eagerly: capture failed"):
        outs = [dp(x) for _ in range(STEPS)]
    h = model.lin(x)
    want = h * 2 if h.sum().item() > 0 else h
    torch.testing.assert_close(outs[-1], want)
    assert not dp._graphs._entries and len(dp._graphs._refused) == 1
    # the device is usable afterwards
    torch.testing.assert_close(dp(x), want)


@requires_cuda
@pytest.mark.cuda
def test_replaced_parameter_storage_falls_back() -> None:
    eager, graphed = _pair([0, 0])
    _run(graphed)
    assert graphed._graphs._entries
    with torch.no_grad():
        for dp in (eager, graphed):
            dp.module[0].weight.data = dp.module[0].weight.data * 0.5  # a new tensor, not an in-place update
    x = _batches(1)[0][0]
    with pytest.warns(RuntimeWarning, match=r"now lives at another address"):
        got = graphed(x)
    torch.testing.assert_close(got, eager(x), rtol=1e-12, atol=1e-12)


@requires_cuda
@pytest.mark.cuda
def test_forward_twice_before_backward_stays_exact() -> None:
    eager, graphed = _pair([0, 0])
    _run(graphed)
    _run(eager)
    x1, x2 = _batches(2)[0][0], _batches(2)[1][0]
    for dp in (eager, graphed):
        dp.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (dp(x1).sum() + dp(x2).square().sum()).backward()
    for p, q in zip(graphed.module.parameters(), eager.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


@requires_cuda
@pytest.mark.cuda
def test_new_signatures_are_captured_and_the_cache_is_bounded() -> None:
    eager, graphed = _pair([0, 0])
    sizes = [4 + 2 * k for k in range(_graphs.CACHE_SIZE + 2)]
    for size in sizes:
        _run(graphed, batch=size)
    assert len(graphed._graphs._entries) == _graphs.CACHE_SIZE
    x = _batches(1, batch=sizes[0])[0][0]  # evicted (its warm-up count is kept): captured again
    for _ in range(STEPS):
        got = graphed(x)
    torch.testing.assert_close(got, eager(x), rtol=1e-12, atol=1e-12)


@requires_cuda
@pytest.mark.cuda
def test_structural_change_drops_the_captures() -> None:
    eager, graphed = _pair([0, 0])
    _run(graphed)
    assert graphed._graphs._entries
    for dp in (eager, graphed):
        dp.module[0].bias.requires_grad_(False)  # a structural change: the replica cache is rebuilt
    x = _batches(1)[0][0]
    got = graphed(x)
    assert not graphed._graphs._entries
    torch.testing.assert_close(got, eager(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("devices", CUDA_PARAMS)
def test_gradients_accumulate_across_replays(devices: list[Any]) -> None:
    """Without zero_grad, replayed gradients add up as eager ones do (a
    master .grad never aliases a graph's static gradient memory)."""
    eager, graphed = _pair(devices)
    batches = _batches(STEPS + 2)
    for dp in (eager, graphed):
        for x, y in batches[:STEPS]:
            dp.zero_grad()
            nn.functional.cross_entropy(dp(x), y).backward()
        dp.zero_grad()
        for x, y in batches[STEPS:]:  # two replays accumulate
            nn.functional.cross_entropy(dp(x), y).backward()
    assert graphed._graphs._entries
    for p, q in zip(graphed.module.parameters(), eager.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


class _DropoutOrSync(nn.Module):
    """Dropout; with a batch of 5 rows per replica also a host synchronization."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 5 and x.sum().item() > float("inf"):
            return x
        return self.drop(x)


@requires_cuda
@pytest.mark.cuda
def test_failed_capture_leaves_other_signatures_replaying() -> None:
    """A capture that fails (signature B) does not break the random-number
    state the captured signature A replays with."""
    dp = dpcore.DataParallel(_DropoutOrSync().cuda(), [0, 0], cuda_graphs=True, gather=False)
    a, b = torch.ones(8, 1024, device="cuda"), torch.ones(10, 1024, device="cuda")
    with torch.no_grad():
        for _ in range(STEPS):
            dp(a)
        with pytest.warns(RuntimeWarning, match=r"capture failed"):
            for _ in range(STEPS):
                dp(b)
        first, second = dp(a), dp(a)
    assert len(dp._graphs._entries) == 1 and len(dp._graphs._refused) == 1
    assert not torch.equal(first[0] != 0, second[0] != 0)


@requires_cuda
@pytest.mark.cuda
def test_backward_after_a_later_replay_is_refused() -> None:
    eager, graphed = _pair([0, 0])
    _run(graphed)
    x = _batches(1)[0][0]
    loss = graphed(x).sum()
    loss.backward(retain_graph=True)
    graphed(x).sum().backward()  # replays again, overwriting the first call's activations
    with pytest.raises(RuntimeError, match=r"activations a later call with the same input signature has overwritten"):
        loss.backward()


@requires_cuda
@pytest.mark.cuda
def test_single_replica_gradients_are_not_static_memory() -> None:
    """With replica 0 alone, torch.autograd.grad returns copies that later
    replays do not overwrite."""
    _, graphed = _pair([0])
    _run(graphed)
    x1, x2 = _batches(2)[0][0], _batches(2)[1][0]
    params = list(graphed.module.parameters())
    g1 = torch.autograd.grad(graphed(x1).sum(), params)
    kept = [g.clone() for g in g1]
    torch.autograd.grad(graphed(x2).square().sum(), params)
    for g, k in zip(g1, kept):
        torch.testing.assert_close(g, k, rtol=0, atol=0)


# -- the orchestration on a stand-in device (CPU) --------------------------------
#
# No GPU here: these run GraphRunner's Python (signatures, warm-up, capture
# with autograd.grad, the _Replay autograd node, the gradient routing to the
# master, the fallbacks) with torch.cuda's streams, generators and graphs
# replaced by stand-ins on CPU tensors. A stand-in graph runs its captured
# work once, at capture, and its replays do nothing, so the values after a
# capture are not checked here (the CUDA tests above do that): only that
# every path runs, what is replayed and when, and where gradients go.


class _FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, other: Any) -> None:
        pass


class _FakeGenerator:
    """A CUDA default generator's graph-safe states on the CPU: a state is a
    torch.Generator, and while one is set, the calling thread's draws use it
    (as a capture's kernels use the state set on the device generator)."""

    def clone_state(self) -> torch.Generator:
        return torch.Generator().set_state(torch.default_generator.get_state())

    def graphsafe_get_state(self) -> torch.Generator:
        return self.clone_state()

    def graphsafe_set_state(self, state: torch.Generator) -> None:
        torch.default_generator.set_state(state.get_state())


class _FakeGraph:
    capturing = False
    log: list[str] = []

    def capture_begin(self, pool: Any = None) -> None:
        _FakeGraph.capturing = True
        _FakeGraph.log.append("capture")

    def capture_end(self) -> None:
        _FakeGraph.capturing = False

    def replay(self) -> None:
        _FakeGraph.log.append("replay")


@pytest.fixture
def stand_in_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda's stream, generator and graph API on the CPU; returns the
    log of captures and replays."""
    import contextlib

    streams: dict[Any, _FakeStream] = {}
    generator = _FakeGenerator()
    pools = iter(range(1, 1 << 30))
    monkeypatch.setattr(_graphs, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: streams.setdefault(str(device), _FakeStream())
    )
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "default_generators", {None: generator})
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(pools)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    _FakeGraph.log = []
    _FakeGraph.capturing = False
    return _FakeGraph.log


def _stand_in_dp(model: nn.Module, n: int = 2, **options: Any) -> Any:
    dp = dpcore.DataParallel(model, ["cpu"] * n, **options)
    dp._graphs = _graphs.GraphRunner()
    return dp


def test_stand_in_training_steps_capture_once_then_replay(stand_in_cuda: list[str]) -> None:
    dp = _stand_in_dp(_mlp(), n=3)
    params = list(dp.module.parameters())
    batches = _batches_cpu(STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, (x, y) in enumerate(batches):
            dp.zero_grad()
            out = dp(x)
            assert out.shape == (8, 3)
            nn.functional.cross_entropy(out, y).backward()
            assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
    warm = _graphs.WARMUP_CALLS
    # 3 replicas: forward and backward captured once each, then every later
    # call is one forward replay and one backward replay per replica
    assert stand_in_cuda.count("capture") == 3 * 2
    assert stand_in_cuda.count("replay") == 3 * 2 * (STEPS - warm)
    assert len(dp._graphs._entries) == 1
    entry = next(iter(dp._graphs._entries.values()))
    assert [len(s) for s in entry.slots] == [0, 4, 4]  # replicas 1, 2: every parameter through its bucket


def test_stand_in_gradients_of_replicas_reach_the_master(stand_in_cuda: list[str]) -> None:
    """After a capture, the master's gradient is replica 0's static gradient
    plus the reduction of the others' (a stand-in replay leaves the static
    gradients as the capture computed them)."""
    dp = _stand_in_dp(_mlp(), n=2)
    for x, y in _batches_cpu(_graphs.WARMUP_CALLS + 1):
        dp.zero_grad()
        nn.functional.cross_entropy(dp(x), y).backward()
    entry = next(iter(dp._graphs._entries.values()))
    g0, g1 = entry.graphs
    for p, s0, s1 in zip(dp.module.parameters(), g0.static_grads, g1.static_grads):
        torch.testing.assert_close(p.grad, s0 + s1, equal_nan=True)
        assert p.grad.data_ptr() not in (s0.data_ptr(), s1.data_ptr())


def test_stand_in_nested_outputs_criterion_and_no_grad(stand_in_cuda: list[str]) -> None:
    dp = _stand_in_dp(_Nested(), n=2, gather=False)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(STEPS):
        outs = dp({"x": x}, scale=2.0)
        sum(h.sum() + extra["sum"].sum() for h, extra in outs).backward()
    assert [extra["tag"] for _, extra in outs] == ["t", "t"]
    assert [h.shape for h, _ in outs] == [(3, 4), (3, 4)]
    static = {o.data_ptr() for g in next(iter(dp._graphs._entries.values())).graphs for o in g.static_outputs}
    assert all(h.data_ptr() not in static for h, _ in outs)  # gather=False hands out copies
    crit = _stand_in_dp(_mlp(), n=2, criterion=nn.CrossEntropyLoss())
    for x, y in _batches_cpu(STEPS):
        loss = crit(x, y)
        assert loss.dim() == 0
        loss.backward()
    with torch.no_grad():
        for x, y in _batches_cpu(STEPS):
            assert crit(x, y).dim() == 0
    assert len(crit._graphs._entries) == 2  # a forward-only graph of its own
    assert all(g.bwd is None for g in list(crit._graphs._entries.values())[1].graphs)


def test_stand_in_capture_draws_the_eager_replicas_streams(stand_in_cuda: list[str]) -> None:
    """One seed derivation for eager and graphed replicas: under one seed, the
    call that captures draws, replica by replica, the numbers that the same
    call draws eagerly (each replica a stream of its own), and leaves the
    device generator where the eager call leaves it."""
    model = _mlp(dropout=0.5)
    eager = dpcore.DataParallel(model, ["cpu"] * 3)
    graphed = _stand_in_dp(model, n=3)
    x = torch.ones(9, 6, dtype=torch.float64)  # every replica the same rows
    for _ in range(_graphs.WARMUP_CALLS):
        graphed(x)
    torch.manual_seed(5)
    want = eager(x)
    after = torch.default_generator.get_state()
    torch.manual_seed(5)
    got = graphed(x)
    assert stand_in_cuda.count("capture") == 3 * 2  # this call captured each replica's forward and backward
    assert torch.equal(got, want)
    assert torch.equal(torch.default_generator.get_state(), after)
    chunks = want.chunk(3)
    assert not torch.equal(chunks[0], chunks[1]) and not torch.equal(chunks[1], chunks[2])


@pytest.mark.parametrize(
    ("n", "options", "batch"),
    [
        (1, {}, 8),  # one device: gather of one replica returns its output
        (3, {}, 1),  # fewer rows than devices: one replica used
        (2, {"criterion": nn.CrossEntropyLoss()}, 1),  # one replica's loss
        (2, {"model_loss": "rows"}, 1),
        (2, {}, 8),  # two replicas gathered: new tensors anyway
    ],
)
def test_stand_in_outputs_never_alias_graph_memory(
    stand_in_cuda: list[str], n: int, options: dict[str, Any], batch: int
) -> None:
    """Whatever a replayed call returns lives outside the graphs' static
    outputs, which the next replay overwrites (the runner clones unless the
    wrapper combines several replicas into new tensors)."""
    model = _LossOut() if "model_loss" in options else _mlp()
    dp = _stand_in_dp(model, n=n, **options)
    for x, y in _batches_cpu(STEPS, batch=batch):
        out = dp(x, y) if options else dp(x)
        tensors = list(out.values()) if isinstance(out, dict) else [out]
        sum(t.sum() for t in tensors).backward()
    assert stand_in_cuda.count("replay") > 0
    static = {o.data_ptr() for g in next(iter(dp._graphs._entries.values())).graphs for o in g.static_outputs}
    assert static and all(t.data_ptr() not in static for t in tensors)


class _LossOut(nn.Module):
    """Returns its own loss, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits}


class _CaptureSensitive(nn.Module):
    """Raises as a host synchronization does inside a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _FakeGraph.capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return self.lin(x)


def test_stand_in_fallbacks(stand_in_cuda: list[str]) -> None:
    x, y = _batches_cpu(1)[0]
    failing = _stand_in_dp(_CaptureSensitive(), n=2)
    with pytest.warns(RuntimeWarning, match=r"capture failed \(RuntimeError: CUDA error: operation not permitted"):
        for _ in range(STEPS):
            torch.testing.assert_close(failing(x), failing.module.lin(x))
    assert not failing._graphs._entries and len(failing._graphs._refused) == 1

    dp = _stand_in_dp(_mlp(), n=2)
    for _ in range(STEPS):
        nn.functional.cross_entropy(dp(x), y).backward()
    pending = dp(x)  # a replay whose backward is still to come
    with pytest.warns(RuntimeWarning, match=r"forward was called again before the backward"):
        eager = dp(x)
    (pending.sum() + eager.sum()).backward()

    loss = dp(x).sum()
    loss.backward(retain_graph=True)
    dp(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"activations a later call with the same input signature has overwritten"):
        loss.backward()

    with torch.no_grad():
        dp.module[0].weight.data = dp.module[0].weight.data.clone()
    with pytest.warns(RuntimeWarning, match=r"now lives at another address"):
        dp(x)

    hooked = _stand_in_dp(_mlp(), n=2)
    hooked.module[0].register_forward_hook(lambda m, i, o: o * 2)
    with pytest.warns(RuntimeWarning, match=r"a Linear module has a hook registered"):
        for _ in range(STEPS):
            hooked(x)
    assert not hooked._graphs._entries


def test_stand_in_bounded_cache_and_structural_change(stand_in_cuda: list[str]) -> None:
    dp = _stand_in_dp(_mlp(), n=2)
    for size in range(4, 4 + 2 * (_graphs.CACHE_SIZE + 2), 2):
        for x, y in _batches_cpu(STEPS, batch=size):
            nn.functional.cross_entropy(dp(x), y).backward()
    assert len(dp._graphs._entries) == _graphs.CACHE_SIZE
    dp.module[0].bias.requires_grad_(False)
    x, y = _batches_cpu(1)[0]
    dp(x)
    assert not dp._graphs._entries


def _batches_cpu(n: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
        for _ in range(n)
    ]
