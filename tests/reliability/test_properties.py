"""Property tests (hypothesis) of the collectives and of DataParallel on CPU
device lists ["cpu"] * k, k = 1..4.

* scatter then gather gives the tensor back, bit for bit, for every dtype,
  memory layout (contiguous, channels_last, transposed, strided slices),
  dimension, split (balanced or explicit, zeros included) and for the
  ``out=`` forms;
* broadcast_coalesced equals broadcast of each tensor, for any mix of
  dtypes, layouts and bucket size;
* reduce_add_coalesced equals the elementwise sum (integer-valued data, so
  exact in every dtype);
* DataParallel (float64) equals the bare module on one device, for random
  MLPs, batch sizes and splits (balanced, chunk_sizes, weights), outputs,
  loss (criterion=) and parameter gradients.

Examples are derandomized (the same on every run and in CI), few enough for
the suite to stay fast, with no deadline (the machine is shared).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dpcore
from dpcore import comm

PROPERTY_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
LAYOUTS = ["contiguous", "channels_last", "transposed", "strided_slice"]

device_counts = st.integers(min_value=1, max_value=4)


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers in `dtype` (exact everywhere), distinct enough to catch misplaced elements."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-50, 50, shape, generator=g)
    if dtype == torch.bool:
        return base > 0
    if dtype == torch.uint8:
        return (base + 50).to(dtype)
    if dtype.is_complex:
        return torch.complex(base.double(), base.flip(-1).double() if base.dim() else base.double()).to(dtype)
    return base.to(dtype)


def _in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values in the given memory layout (same shape and values)."""
    if layout == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "strided_slice":
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        view = wide[..., ::2]
        view.copy_(t)
        return view
    return t.contiguous()


@st.composite
def tensors(draw: st.DrawFn, min_dims: int = 1, max_dims: int = 4) -> torch.Tensor:
    dims = draw(st.integers(min_dims, max_dims))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=dims, max_size=dims)))
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    return _in_layout(_values(shape, dtype, draw(st.integers(0, 2**16))), layout)


def _split(draw: st.DrawFn, total: int, parts: int) -> list[int]:
    """A random composition of `total` into `parts` non-negative sizes."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a, b)


@settings(PROPERTY_SETTINGS, max_examples=200)
@given(x=tensors(), k=device_counts, data=st.data())
def test_scatter_then_gather_round_trip(x: torch.Tensor, k: int, data: st.DataObject) -> None:
    devices = ["cpu"] * k
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1), label="dim")
    explicit = data.draw(st.booleans(), label="explicit chunk sizes")
    sizes = _split(data.draw, x.size(dim), k) if explicit else None
    chunks = comm.scatter(x, devices, sizes, dim)
    assert len(chunks) == k
    expected = sizes or [len(c) for c in torch.arange(x.size(dim)).tensor_split(k)]
    start = 0
    for chunk, size in zip(chunks, expected):
        _same(chunk, x.narrow(dim, start, size))
        start += size
    _same(comm.gather(list(chunks), dim), x)
    _same(comm.gather(list(chunks), dim, destination="cpu"), x)

    # The out= forms: scatter into fresh outs, gather into a fresh out.
    outs = [torch.empty_like(c) for c in chunks]
    comm.scatter(x, out=outs, dim=dim)
    for out, chunk in zip(outs, chunks):
        _same(out, chunk)
    joined = torch.empty_like(x)
    assert comm.gather(outs, dim, out=joined) is joined
    _same(joined, x)


@settings(PROPERTY_SETTINGS, max_examples=50)
@given(
    k=device_counts,
    extra_rows=st.integers(0, 5),
    chw=st.tuples(st.integers(2, 4), st.integers(2, 4), st.integers(2, 4)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_scatter_gather_keep_channels_last(
    k: int, extra_rows: int, chw: tuple[int, int, int], dtype: torch.dtype, seed: int
) -> None:
    # Every device gets rows and no dim is 1, so the format is unambiguous.
    x = _values((k + extra_rows, *chw), dtype, seed).contiguous(memory_format=torch.channels_last)
    chunks = comm.scatter(x, ["cpu"] * k)
    assert all(c.is_contiguous(memory_format=torch.channels_last) for c in chunks)
    back = comm.gather(list(chunks))
    _same(back, x)
    assert back.is_contiguous(memory_format=torch.channels_last)


@settings(PROPERTY_SETTINGS, max_examples=100)
@given(
    items=st.lists(tensors(max_dims=3), min_size=0, max_size=6),
    k=device_counts,
    buffer_size=st.sampled_from([1, 8, 64, 1024, 10 * 1024 * 1024]),
    sparse_at=st.sets(st.integers(0, 5), max_size=2),
)
def test_broadcast_coalesced_equals_per_tensor_broadcast(
    items: list[torch.Tensor], k: int, buffer_size: int, sparse_at: set[int]
) -> None:
    items = [t.to_sparse() if i in sparse_at and t.dtype != torch.bool else t for i, t in enumerate(items)]
    devices = ["cpu"] * k
    result = comm.broadcast_coalesced(items, devices, buffer_size)
    assert len(result) == k
    for i, t in enumerate(items):
        assert result[0][i] is t
        per_tensor = comm.broadcast(t, devices)
        for d in range(k):
            got, want = result[d][i], per_tensor[d]
            assert got.layout == want.layout
            _same(got.to_dense() if got.is_sparse else got, want.to_dense() if want.is_sparse else want)


@settings(PROPERTY_SETTINGS, max_examples=100)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.int32]), min_size=5, max_size=5
    ),
    k=device_counts,
    layout=st.sampled_from(LAYOUTS),
    buffer_size=st.sampled_from([1, 16, 256, 10 * 1024 * 1024]),
    seed=st.integers(0, 2**16),
)
def test_reduce_add_coalesced_equals_the_sum(
    shapes: list[tuple[int, ...]],
    dtypes: list[torch.dtype],
    k: int,
    layout: str,
    buffer_size: int,
    seed: int,
) -> None:
    inputs = [
        [_in_layout(_values(shape, dtypes[i], seed + 31 * r + i), layout) for i, shape in enumerate(shapes)]
        for r in range(k)
    ]
    result = comm.reduce_add_coalesced(inputs, "cpu", buffer_size)
    assert len(result) == len(shapes)
    for i in range(len(shapes)):
        expected = inputs[0][i].clone()
        for r in range(1, k):
            expected += inputs[r][i]
        _same(result[i], expected)
        single = comm.reduce_add([inputs[r][i] for r in range(k)], "cpu")
        _same(single, expected)


class _MLP(nn.Module):
    def __init__(self, widths: list[int], activation: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.activation = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid}[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = self.activation(x)
        return x


@st.composite
def splits(draw: st.DrawFn, batch: int, k: int) -> dict[str, Any]:
    """DataParallel split options; device 0 always gets a non-empty chunk."""
    kind = draw(st.sampled_from(["balanced", "chunk_sizes", "weights"]))
    if kind == "chunk_sizes":
        rest = _split(draw, batch - 1, k)
        return {"chunk_sizes": [rest[0] + 1, *rest[1:]]}
    if kind == "weights":
        weights = draw(st.lists(st.floats(0.0, 4.0, allow_nan=False), min_size=k, max_size=k))
        # The largest weight on device 0 gives it a row (an empty device 0 is
        # a documented error, tested in test_bad_inputs); zeros elsewhere
        # leave devices without a replica.
        weights[0] = max(max(weights), 0.5)
        return {"weights": weights}
    return {}


@settings(PROPERTY_SETTINGS, max_examples=100)
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    activation=st.sampled_from(["tanh", "relu", "sigmoid"]),
    batch=st.integers(1, 12),
    k=device_counts,
    use_criterion=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_data_parallel_equals_single_device(
    widths: list[int],
    activation: str,
    batch: int,
    k: int,
    use_criterion: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    options = data.draw(splits(batch, k), label="split")
    torch.manual_seed(seed)
    module = _MLP(widths, activation).double()
    reference = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, widths[0], generator=g, dtype=torch.float64)
    target = torch.randn(batch, widths[-1], generator=g, dtype=torch.float64)
    criterion = nn.MSELoss() if use_criterion else None
    dp = dpcore.DataParallel(module, ["cpu"] * k, criterion=criterion, **options)

    for _step in range(2):  # the second step runs on refreshed cached replicas
        if use_criterion:
            loss = dp(x, target)
            expected = nn.functional.mse_loss(reference(x), target)
            assert loss.dim() == 0
        else:
            out = dp(x)
            expected_out = reference(x)
            torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
            loss = nn.functional.mse_loss(out, target)
            expected = nn.functional.mse_loss(expected_out, target)
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
        module.zero_grad()
        reference.zero_grad()
        loss.backward()
        expected.backward()
        for (name, p), q in zip(module.named_parameters(), reference.parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        with torch.no_grad():
            for p, q in zip(module.parameters(), reference.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
