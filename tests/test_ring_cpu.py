"""The coalesced ring collectives on a CPU list (comm/ring.cpp): there every slot's memory is the host's, so
reduce_scatter_coalesced sums each owner's tensors where they lie and all_gather_coalesced copies each tensor straight
into its targets, in one parallel loop, instead of running the ring's hops. What the ring guarantees still holds, checked
here on tensors large enough to be cut into pieces: the ring's summation order bit for bit (half types rounded at each
hop), any strides, every owner and an empty one, a target sharing memory with a source, and the traffic each slot of
the ring would have sent and received."""

from __future__ import annotations

import pytest
import torch

from dpcore import comm

BIG = 200_003  # more than the 64 Ki elements of a piece: cut into pieces over the threads


def noisy(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values whose float sums depend on the order (small ints for int64)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-50, 50, shape, generator=g)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)


def ring_order_sum(column: list[torch.Tensor], owner: int) -> torch.Tensor:
    """tensors[owner+1] + tensors[owner+2] + ... + tensors[owner], left to right in the dtype (comm.h's ring order)."""
    n = len(column)
    total = column[(owner + 1) % n].clone()
    for step in range(2, n + 1):
        total = total + column[(owner + step) % n]
    return total


def lists_for(n: int, dtype: torch.dtype) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Per slot: a big tensor, a big transposed one on slot 1 only (other strides), small and empty ones; owners
    leave the last slot without any tensor where n > 2."""
    shapes = [(BIG,), (3, 5), (400, 300), (0,), (7,), (2, 65_600)]
    lists = []
    for j in range(n):
        row = [noisy(s, dtype, 11 * j + k) for k, s in enumerate(shapes)]
        if j == 1:
            row[2] = row[2].t().contiguous().t()
        lists.append(row)
    owners = [k % max(1, n - 1) for k in range(len(shapes))]
    return lists, owners


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("buffer_size", [64, comm.DEFAULT_BUFFER_SIZE])
def test_reduce_scatter_coalesced_sums_in_ring_order(n: int, dtype: torch.dtype, buffer_size: int) -> None:
    lists, owners = lists_for(n, dtype)
    result = comm.reduce_scatter_coalesced(lists, ["cpu"] * n, owners, buffer_size)
    for k, owner in enumerate(owners):
        expected = ring_order_sum([row[k] for row in lists], owner)
        assert result[k].shape == expected.shape and result[k].dtype == dtype
        assert torch.equal(result[k], expected), f"tensor {k}"
        assert not any(result[k].data_ptr() == row[k].data_ptr() for row in lists if row[k].numel())


def test_bfloat16_rounds_at_every_hop() -> None:
    # 256 + 1 + 1 + 1 in bfloat16 (spacing 2 there): 257 rounds back to 256 at each hop, so the ring gives 256 where
    # one rounding of the float sum 259 would give 260 (the ring order from owner 0 is slots 1, 2, 3, 0).
    column = [torch.full((BIG,), v, dtype=torch.bfloat16) for v in (1.0, 256.0, 1.0, 1.0)]
    (out,) = comm.reduce_scatter_coalesced([[t] for t in column], ["cpu"] * 4, [0])
    assert torch.equal(out, torch.full((BIG,), 256.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_gather_coalesced_into_new_tensors_and_outs(n: int) -> None:
    lists, owners = lists_for(n, torch.float32)
    tensors = lists[0]
    result = comm.all_gather_coalesced(tensors, owners, ["cpu"] * n, buffer_size=4096)
    for d in range(n):
        for k, t in enumerate(tensors):
            assert torch.equal(result[d][k], t)
            assert (result[d][k] is t) == (owners[k] == d)
            if owners[k] != d and t.numel():
                assert result[d][k].data_ptr() != t.data_ptr()
    outs = [[t if owners[k] == d else torch.zeros_like(t).t().t() for k, t in enumerate(tensors)] for d in range(n)]
    outs[0][2] = torch.zeros(300, 400).t() if owners[2] != 0 else outs[0][2]  # other strides than the source
    assert comm.all_gather_coalesced(tensors, owners, ["cpu"] * n, out=outs) == outs
    assert all(torch.equal(outs[d][k], t) for d in range(n) for k, t in enumerate(tensors))


def test_a_target_sharing_memory_with_a_source_reads_the_source_as_it_was() -> None:
    a, b = noisy((BIG,), torch.float32, 1), noisy((BIG,), torch.float32, 2)
    a_before, b_before = a.clone(), b.clone()
    into_a = a.view(BIG)  # position 0's target for b: a's memory, written before position 1 reads a
    elsewhere = torch.zeros(BIG)
    comm.all_gather_coalesced([a, b], [0, 1], ["cpu"] * 2, out=[[a, into_a], [elsewhere, b]])
    assert torch.equal(elsewhere, a_before) and torch.equal(a, b_before) and torch.equal(b, b_before)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_traffic_is_what_the_ring_moves(n: int) -> None:
    lists, owners = lists_for(n, torch.float64)
    nbytes = [t.numel() * t.element_size() for t in lists[0]]
    total = sum(nbytes)
    own = [sum(b for b, o in zip(nbytes, owners) if o == i) for i in range(n)]
    comm.reset_traffic()
    sums = comm.reduce_scatter_coalesced(lists, ["cpu"] * n, owners, 4096)
    comm.all_gather_coalesced(sums, owners, ["cpu"] * n, buffer_size=4096)
    counts = comm.traffic()
    reduce_scatter = counts["reduce_scatter"] + [(0, 0)] * (n - len(counts["reduce_scatter"]))
    all_gather = counts["all_gather"] + [(0, 0)] * (n - len(counts["all_gather"]))
    for i in range(n):
        assert reduce_scatter[i] == (total - own[i], total - own[(i - 1) % n]), f"slot {i}"
        assert all_gather[i] == (total - own[(i + 1) % n], total - own[i]), f"slot {i}"
