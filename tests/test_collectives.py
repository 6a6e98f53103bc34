"""The ring collectives of dpcore.comm (reduce_scatter, all_gather, all_reduce
and their coalesced forms) and the traffic counters: values against torch's
sums (float64 bit for bit, in the ring's documented order), bad input, and the
bytes per slot of the ring and of DataParallel's default path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcore
from dpcore import comm
from dpcore._loader import _C
from conftest import DeviceLike, as_torch_device, requires_cuda

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]


def noisy(numel: int, dtype: torch.dtype, seed: int, device: DeviceLike = "cpu") -> torch.Tensor:
    """Values whose float sums depend on the order (small ints for int64)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-50, 50, (numel,), generator=g).to(as_torch_device(device))
    return (torch.randn(numel, generator=g, dtype=torch.float64) * 100).to(dtype).to(as_torch_device(device))


def ring_sum(inputs: list[torch.Tensor], i: int, start: int, size: int) -> torch.Tensor:
    """Segment i summed as the ring sums it: inputs[i+1] + inputs[i+2] + ... + inputs[i]."""
    n = len(inputs)
    parts = [inputs[(i + step) % n].reshape(-1)[start : start + size].cpu() for step in range(1, n + 1)]
    total = parts[0].clone()
    for part in parts[1:]:
        total = total + part
    return total


def offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def slots(kind: str, n: int) -> list[tuple[int, int]]:
    """traffic()[kind] padded to n slots."""
    counts = comm.traffic()[kind]
    return counts + [(0, 0)] * (n - len(counts))


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter_sums_in_ring_order(any_devices: list[DeviceLike], dtype: torch.dtype) -> None:
    n = len(any_devices)
    for numel in (0, 1, 7, 1000):
        inputs = [noisy(numel, dtype, j, d) for j, d in enumerate(any_devices)]
        sizes = _C.balanced_chunk_sizes(numel, n)
        out = comm.reduce_scatter(inputs, any_devices)
        assert len(out) == n
        for i, (part, start) in enumerate(zip(out, offsets(sizes))):
            assert part.device == as_torch_device(any_devices[i]) and part.dim() == 1
            assert torch.equal(part.cpu(), ring_sum(inputs, i, start, sizes[i]))


def test_reduce_scatter_float64_matches_torch_sums_and_uneven_sizes(devices: list[DeviceLike]) -> None:
    n = len(devices)
    inputs = [noisy(24, torch.float64, j).view(4, 6) for j in range(n)]
    sizes = [0] * (n - 1) + [24] if n > 1 else [24]
    out = comm.reduce_scatter(inputs, devices, sizes)
    # One segment holds everything: inputs[owner + 1] + ... + inputs[owner], as a cumulative sum in that
    # order adds them.
    owner = n - 1
    order = [(owner + step) % n for step in range(1, n + 1)]
    expected = torch.stack([inputs[j].reshape(-1) for j in order]).cumsum(0)[-1]
    assert torch.equal(out[owner], expected)
    assert all(o.numel() == 0 for o in out[:owner])
    # Balanced segments of exact values equal torch.sum over the inputs.
    ints = [torch.arange(24, dtype=torch.float64) * (j + 1) for j in range(n)]
    assert torch.equal(torch.cat(comm.reduce_scatter(ints, devices)), torch.stack(ints).sum(0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather_and_all_reduce(any_devices: list[DeviceLike], dtype: torch.dtype) -> None:
    n = len(any_devices)
    shards = [noisy(0 if i == 1 else 3 + i, dtype, i, d) for i, d in enumerate(any_devices)]
    gathered = comm.all_gather(shards, any_devices)
    for j, out in enumerate(gathered):
        assert out.device == as_torch_device(any_devices[j])
        assert torch.equal(out.cpu(), torch.cat([s.cpu() for s in shards]))
    inputs = [noisy(37, dtype, 10 + j, d) for j, d in enumerate(any_devices)]
    inputs[0] = noisy(74, dtype, 9, any_devices[0])[::2]  # not contiguous: summed through a copy
    before = [t.clone() for t in inputs]
    sizes = _C.balanced_chunk_sizes(37, n)
    expected = torch.cat([ring_sum(before, i, s, sizes[i]) for i, s in enumerate(offsets(sizes))])
    assert comm.all_reduce(inputs, any_devices) == inputs
    for t in inputs:
        assert torch.equal(t.cpu(), expected)


def test_all_gather_into_persistent_buffers(devices: list[DeviceLike]) -> None:
    """ZeRO's layout: each shard is the view of its place in its own flat buffer."""
    n = len(devices)
    sizes = [4, 0, 3, 5][:n]
    buffers = [torch.full((sum(sizes),), -1.0) for _ in range(n)]
    shards = [b[s : s + k] for b, s, k in zip(buffers, offsets(sizes), sizes)]
    for i, shard in enumerate(shards):
        shard.copy_(torch.arange(sizes[i], dtype=torch.float32) + 10 * i)
    expected = torch.cat([s.clone() for s in shards])
    pointers = [b.data_ptr() for b in buffers]
    assert comm.all_gather(shards, out=buffers) == buffers
    assert [b.data_ptr() for b in buffers] == pointers
    assert all(torch.equal(b, expected) for b in buffers)


def test_one_device_copies() -> None:
    t = torch.arange(6.0).view(2, 3)
    (out,) = comm.reduce_scatter([t], ["cpu"])
    assert torch.equal(out, t.reshape(-1)) and out.data_ptr() != t.data_ptr()
    (gathered,) = comm.all_gather([t.reshape(-1)], ["cpu"])
    assert torch.equal(gathered, t.reshape(-1)) and gathered.data_ptr() != t.data_ptr()
    assert torch.equal(comm.all_reduce([t], ["cpu"])[0], torch.arange(6.0).view(2, 3))


def coalesced_lists(n: int, device: DeviceLike = "cpu") -> tuple[list[list[torch.Tensor]], list[int]]:
    """Every list holds several dtypes, empty tensors and a 0-dim one; owners spread over the slots."""
    shapes = [(3, 4), (0,), (5,), (2, 3, 2), (7,), (), (6, 6), (0, 2), (9,)]
    lists = [
        [noisy(torch.Size(s).numel(), DTYPES[k % 4], 7 * j + k, device).view(s) for k, s in enumerate(shapes)]
        for j in range(n)
    ]
    return lists, [(3 * k) % n for k in range(len(shapes))]


@pytest.mark.parametrize("buffer_size", [1, 64, comm.DEFAULT_BUFFER_SIZE])
def test_reduce_scatter_coalesced(any_devices: list[DeviceLike], buffer_size: int) -> None:
    n = len(any_devices)
    lists, owners = coalesced_lists(n)
    lists = [[t.to(as_torch_device(d)) for t in group] for group, d in zip(lists, any_devices)]
    result = comm.reduce_scatter_coalesced(lists, any_devices, owners, buffer_size)
    for k, (out, owner) in enumerate(zip(result, owners)):
        assert out.device == as_torch_device(any_devices[owner]) and out.shape == lists[0][k].shape
        column = [group[k].reshape(-1) for group in lists]
        assert torch.equal(out.reshape(-1).cpu(), ring_sum(column, owner, 0, column[0].numel()))


def test_all_gather_coalesced(any_devices: list[DeviceLike]) -> None:
    n = len(any_devices)
    lists, owners = coalesced_lists(n)
    tensors = [lists[0][k].to(as_torch_device(any_devices[o])) for k, o in enumerate(owners)]
    result = comm.all_gather_coalesced(tensors, owners, any_devices, buffer_size=40)
    for d in range(n):
        for k, t in enumerate(tensors):
            assert result[d][k].device == as_torch_device(any_devices[d])
            assert torch.equal(result[d][k].cpu(), t.cpu())
            assert (result[d][k] is t) == (owners[k] == d)
    outs = [
        [
            t if owners[k] == d else torch.zeros_like(t, device=as_torch_device(any_devices[d]))
            for k, t in enumerate(tensors)
        ]
        for d in range(n)
    ]
    assert comm.all_gather_coalesced(tensors, owners, any_devices, out=outs) == outs
    assert all(torch.equal(outs[d][k].cpu(), t.cpu()) for d in range(n) for k, t in enumerate(tensors))


# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_argument() -> None:
    a = torch.zeros(6)
    cpu2 = ["cpu"] * 2
    with pytest.raises(
        RuntimeError,
        match=r"reduce_scatter: expected one tensor in 'inputs' per device \(len\(devices\) = 3\), but got 2",
    ):
        comm.reduce_scatter([a, a], ["cpu"] * 3)
    with pytest.raises(
        RuntimeError, match=r"expected inputs\[1\] to have 6 elements, as inputs\[0\] has, but it has 5"
    ):
        comm.reduce_scatter([a, torch.zeros(5)], cpu2)
    with pytest.raises(RuntimeError, match=r"expected inputs\[1\] of dtype Float, as inputs\[0\] is, but it is Double"):
        comm.all_reduce([a, a.double()], cpu2)
    with pytest.raises(
        RuntimeError, match=r"expected 'sizes' to sum to 6 \(the elements of each input\), but they sum to 5"
    ):
        comm.reduce_scatter([a, a], cpu2, [2, 3])
    with pytest.raises(RuntimeError, match=r"expected dense \(strided\) tensors, but inputs\[1\] has layout Sparse"):
        comm.reduce_scatter([a, a.to_sparse()], cpu2)
    with pytest.raises(RuntimeError, match=r"all_gather: expected shards\[1\] to be 1-D, but it has shape \[2, 3\]"):
        comm.all_gather([a, a.view(2, 3)], cpu2)
    with pytest.raises(RuntimeError, match=r"all_gather: exactly one of 'devices' and 'out'"):
        comm.all_gather([a, a])
    with pytest.raises(RuntimeError, match=r"all_reduce: inputs\[1\] and inputs\[0\] overlap in memory"):
        comm.all_reduce([a, a], cpu2)
    with pytest.raises(RuntimeError, match=r"expected owners\[1\] in \[0, 2\) \(an index into devices\), but it is 2"):
        comm.reduce_scatter_coalesced([[a, a], [a, a]], cpu2, [0, 2])
    with pytest.raises(
        RuntimeError, match=r"expected one list in 'tensors' per device \(len\(devices\) = 2\), but got 1"
    ):
        comm.reduce_scatter_coalesced([[a]], cpu2, [0])
    with pytest.raises(
        RuntimeError, match=r"all_gather_coalesced: expected tensors\[0\] on cpu \(devices\[owners\[0\]\]"
    ):
        comm.all_gather_coalesced([a.to("meta")], [0], cpu2)
    with pytest.raises(TypeError, match=r"owners\[0\]"):
        comm.all_gather_coalesced([a], ["0"], cpu2)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"tensors\[0\]\[1\]: expected a tensor"):
        comm.reduce_scatter_coalesced([[a, 1], [a, a]], cpu2, [0, 1])  # type: ignore[list-item]


# ---------------------------------------------------------------- traffic


def test_traffic_readout_and_reset() -> None:
    comm.reset_traffic()
    assert comm.traffic() == {
        k: [] for k in ("broadcast", "reduce_add", "scatter", "gather", "reduce_scatter", "all_gather")
    }
    comm.broadcast(torch.zeros(10), ["cpu"] * 3)
    assert comm.traffic()["broadcast"] == [(80, 0), (0, 40), (0, 40)]
    comm.reset_traffic()
    assert comm.traffic()["broadcast"] == []


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_spreads_the_bytes(n: int) -> None:
    inputs = [torch.ones(1200 * n) for _ in range(n)]
    total = inputs[0].numel() * 4
    comm.reset_traffic()
    comm.all_reduce(inputs, ["cpu"] * n)
    for kind in ("reduce_scatter", "all_gather"):
        counts = slots(kind, n)
        for direction in (0, 1):
            mean = sum(c[direction] for c in counts) / n
            assert mean == total * (n - 1) / n
            assert all(mean / 1.1 <= c[direction] <= 1.1 * mean for c in counts)
    # Uneven segments: a reduce-scatter's slot sends all but its own segment.
    sizes = [5, 0, 11, 2][:n]
    comm.reset_traffic()
    comm.reduce_scatter([torch.ones(sum(sizes)) for _ in range(n)], ["cpu"] * n, sizes)
    assert [c[0] for c in slots("reduce_scatter", n)] == [4 * (sum(sizes) - s) for s in sizes]


class Net(nn.Module):
    """Two layers with a frozen bias, and a layer no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.unused = nn.Linear(3, 3)
        self.a.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def data_parallel_traffic(devices: list[DeviceLike]) -> None:
    """DataParallel's default path, counted: the backward's gradient reduction and the refresh."""
    n = len(devices)
    first = as_torch_device(devices[0])
    model = Net().to(first)
    dp = dpcore.DataParallel(model, devices)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(12, 8, device=first)
    out = dp(x)
    comm.reset_traffic()
    out.sum().backward()
    backward = comm.traffic()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    assert grad_bytes == (16 * 8 + 16 * 4 + 4) * 4  # a.weight, b.weight, b.bias: not the frozen, not the unused
    # Replica 0 runs on the masters (autograd accumulates its gradients into .grad directly), so
    # reduce_add_coalesced sums replicas 1..N-1, each list counted at its replica's position (slots=):
    # (N-1) * G arrive at slot 0, G leave every other slot.
    assert {k for k, v in backward.items() if v} <= {"reduce_add"}
    received = [r for _, r in slots("reduce_add", n)]
    sent = [s for s, _ in slots("reduce_add", n)]
    assert received == [(n - 1) * grad_bytes] + [0] * (n - 1)
    assert sent == [0] + [grad_bytes] * (n - 1)
    optimizer.step()
    optimizer.zero_grad()
    # The next forward refreshes every replica's buckets that hold a stepped parameter: all the
    # parameters requiring grad (the unused one shares their bucket); the frozen bias's bucket is
    # unchanged and is not sent.
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    comm.reset_traffic()
    dp(x)
    assert slots("broadcast", n) == [((n - 1) * trainable, 0)] + [(0, trainable)] * (n - 1)
    comm.reset_traffic()
    dp(x)  # nothing changed: nothing is sent
    assert comm.traffic()["broadcast"] == []


@pytest.mark.parametrize("n", [2, 3, 4])
def test_data_parallel_traffic_cpu(n: int) -> None:
    data_parallel_traffic(["cpu"] * n)


@requires_cuda
@pytest.mark.cuda
def test_data_parallel_traffic_cuda_repeated() -> None:
    data_parallel_traffic([0, 0, 0])


@requires_cuda
@pytest.mark.cuda
def test_ring_traffic_cuda_repeated() -> None:
    inputs = [torch.ones(3000, device="cuda:0") for _ in range(2)]
    comm.reset_traffic()
    comm.all_reduce(inputs, [0, 0])
    assert all(torch.equal(t.cpu(), torch.full((3000,), 2.0)) for t in inputs)
    assert slots("reduce_scatter", 2) == [(6000, 6000), (6000, 6000)]
    assert slots("all_gather", 2) == [(6000, 6000), (6000, 6000)]


def test_reduce_add_coalesced_counts_each_list_at_its_given_slot() -> None:
    """slots=: each list's position in the caller's list (the destination's 0), as DataParallel's backward passes."""
    lists = [[torch.ones(4, dtype=torch.float64)], [torch.ones(4, dtype=torch.float64)]]
    comm.reset_traffic()
    (total,) = comm.reduce_add_coalesced(lists, "cpu", slots=[1, 3])
    assert torch.equal(total, torch.full((4,), 2.0, dtype=torch.float64))
    assert slots("reduce_add", 4) == [(0, 64), (32, 0), (0, 0), (32, 0)]
    with pytest.raises(RuntimeError, match=r"slots: expected one slot per list \(2\), but got 1"):
        comm.reduce_add_coalesced(lists, "cpu", slots=[1])
    with pytest.raises(RuntimeError, match=r"slots\[0\]: expected a position >= 0, but got -1"):
        comm.reduce_add_coalesced(lists, "cpu", slots=[-1, 1])
