"""Tests for dpcore._functions (Scatter, Gather, BroadcastTensor) and
dpcore._split (split_sizes and the checks of chunk_sizes and weights) and
dpcore.scatter_gather (scatter_kwargs, scatter, gather, Broadcast), on
CPU device lists ["cpu"] * k, k = 1..4 (the ``devices`` fixture)."""

from __future__ import annotations

import dataclasses
import inspect
import random
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import dpcore
from dpcore import comm
from dpcore._functions import BroadcastTensor, Gather, Scatter
from dpcore._split import check_chunk_sizes, check_weights, split_sizes
from dpcore.scatter_gather import Broadcast, gather, scatter, scatter_kwargs

CPU = torch.device("cpu")

Pair = namedtuple("Pair", ["a", "b"])


class TypedPair(NamedTuple):
    a: torch.Tensor
    b: Any


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str = "train"
    derived: torch.Tensor | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.post_inits = getattr(self, "post_inits", 0) + 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    n: int


def rows(batch: int, *trailing: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor whose row r is filled with r (so chunks are recognisable)."""
    t = torch.arange(batch, dtype=dtype).reshape(batch, *([1] * len(trailing)))
    return t.expand(batch, *trailing).contiguous()


def balanced(batch: int, n: int) -> list[int]:
    q, r = divmod(batch, n)
    return [q + 1] * r + [q] * (n - r)


# ---------------------------------------------------------------------------
# split_sizes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,n,expected",
    [
        (9, 4, [3, 2, 2, 2]),
        (3, 4, [1, 1, 1, 0]),
        (8, 4, [2, 2, 2, 2]),
        (0, 3, [0, 0, 0]),
        (5, 1, [5]),
        (7, 3, [3, 2, 2]),
    ],
)
def test_split_sizes_balanced(batch: int, n: int, expected: list[int]) -> None:
    assert split_sizes(batch, n) == expected


def test_split_sizes_balanced_matches_comm_scatter() -> None:
    # Python's balanced split and the C++ core's (comm.scatter without
    # chunk_sizes) are the same rule.
    for batch in range(0, 13):
        for n in range(1, 6):
            chunks = comm.scatter(torch.empty(batch, 1), ["cpu"] * n)
            assert [c.shape[0] for c in chunks] == split_sizes(batch, n)


def test_split_sizes_balanced_property() -> None:
    for batch in range(0, 40):
        for n in range(1, 9):
            sizes = split_sizes(batch, n)
            assert len(sizes) == n and sum(sizes) == batch
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)


def test_split_sizes_chunk_sizes() -> None:
    assert split_sizes(6, 3, chunk_sizes=[1, 0, 5]) == [1, 0, 5]
    assert split_sizes(6, 3, chunk_sizes=(2, 2, 2)) == [2, 2, 2]


@pytest.mark.parametrize(
    "chunk_sizes,match",
    [
        ([1, 2], r"chunk_sizes.*one size per device \(3\)"),
        ([1, 2, 2], r"chunk_sizes.*sum.*6.*5"),
        ([7, -1, 0], r"chunk_sizes\[1\].*non-negative"),
    ],
)
def test_split_sizes_chunk_sizes_errors(chunk_sizes: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_sizes(6, 3, chunk_sizes=chunk_sizes)


@pytest.mark.parametrize(
    "batch,weights,expected",
    [
        (8, [1, 3], [2, 6]),
        (10, [1, 1, 1], [4, 3, 3]),
        (7, [0, 1, 2, 3], [0, 1, 2, 4]),
        (5, [0.5, 0.5], [3, 2]),
        (3, [1, 0, 0], [3, 0, 0]),
        (0, [1, 2], [0, 0]),
    ],
)
def test_split_sizes_weights(batch: int, weights: list[float], expected: list[int]) -> None:
    assert split_sizes(batch, len(weights), weights=weights) == expected


def test_split_sizes_weights_largest_remainder_property() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        weights = [rng.choice([0.0, rng.random() * 10]) for _ in range(n)]
        if sum(weights) == 0:
            weights[0] = 1.0
        batch = rng.randint(0, 100)
        sizes = split_sizes(batch, n, weights=weights)
        assert sum(sizes) == batch
        total = sum(weights)
        for s, w in zip(sizes, weights):
            quota = batch * w / total
            assert abs(s - quota) < 1 + 1e-9
            if w == 0:
                assert s == 0


def test_split_sizes_weights_are_exact_rationals() -> None:
    """The largest remainder of the quotas as exact fractions of the doubles given (the C++ split compares
    them as rationals): weights 600 powers of two apart, subnormals, totals near 2**62, many ties."""

    def exact(total: int, weights: list[float]) -> list[int]:
        whole = sum(Fraction(w) for w in weights)
        quotas = [total * Fraction(w) / whole for w in weights]
        sizes = [int(q) for q in quotas]
        order = sorted(range(len(sizes)), key=lambda i: (sizes[i] - quotas[i], i))
        return [s + (i in order[: total - sum(sizes)]) for i, s in enumerate(sizes)]

    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 6)
        pick = [0.0, 5e-324, 1.0, 3.0, 0.1, 1e300, 1e-300]
        weights = [rng.choice([*pick, rng.random() * 10.0 ** rng.randint(-300, 300)]) for _ in range(n)]
        if sum(weights) == 0:
            weights[0] = 0.3
        batch = rng.choice([rng.randint(0, 100), rng.randint(0, 2**62)])
        assert split_sizes(batch, n, weights=weights) == exact(batch, weights), (batch, weights)
    assert split_sizes(10, 3, weights=[0.1, 0.2, 0.3]) == [2, 3, 5]


@pytest.mark.parametrize(
    "weights,match",
    [
        ([1, -1], r"weights\[1\].*non-negative"),
        ([0, 0], "weights.*positive sum"),
        ([1, float("nan")], r"weights\[1\]"),
        ([1, float("inf")], r"weights\[1\]"),
        ([1, 2, 3], r"weights.*one weight per device \(2\)"),
    ],
)
def test_split_sizes_weights_errors(weights: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_sizes(4, 2, weights=weights)


def test_split_sizes_both_is_an_error() -> None:
    with pytest.raises(ValueError, match="chunk_sizes.*weights"):
        split_sizes(4, 2, chunk_sizes=[2, 2], weights=[1, 1])
    with pytest.raises(ValueError, match="chunk_sizes.*weights"):
        scatter_kwargs((torch.ones(4),), None, ["cpu"] * 2, chunk_sizes=[2, 2], weights=[1, 1])


def test_split_sizes_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_devices"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="batch"):
        split_sizes(-1, 2)


# The rules of chunk_sizes and weights (dpcore._split), shared by
# DataParallel, comm.scatter and split_sizes: every bad value is named with
# its argument, index and value; nothing is truncated or parsed.
BAD_CHUNK_SIZES = [
    ([2.5, 2.5, 2, 2], TypeError, r"chunk_sizes\[0\]: expected an int, but got float 2\.5"),
    ([2, 2, 2.0, 2], TypeError, r"chunk_sizes\[2\]: expected an int, but got float 2\.0"),
    (["2"] * 4, TypeError, r"chunk_sizes\[0\]: expected an int, but got str '2'"),
    ([True, 3, 2, 2], TypeError, r"chunk_sizes\[0\]: expected an int, but got bool True"),
    ([2, 2, 2, torch.tensor(True)], TypeError, r"chunk_sizes\[3\]: expected an int, but got bool"),
    ([2, 2, torch.tensor(2.0), 2], TypeError, r"chunk_sizes\[2\]: expected an int, but got Tensor"),
    ([2, 2, 2, None], TypeError, r"chunk_sizes\[3\]: expected an int, but got NoneType None"),
    (8, TypeError, r"chunk_sizes: expected a sequence of ints, one per device, but got int 8"),
    ("2222", TypeError, r"chunk_sizes: expected a sequence of ints, one per device, but got str '2222'"),
    ([2, 2, 5, -1], ValueError, r"chunk_sizes\[3\]: expected a non-negative size, but got -1"),
    ([4, 4], ValueError, r"chunk_sizes: expected one size per device \(4\), but got 2"),
]

BAD_WEIGHTS = [
    ([1, True], TypeError, r"weights\[1\]: expected a real number, but got bool True"),
    ([1, "1"], TypeError, r"weights\[1\]: expected a real number, but got str '1'"),
    ([1j, 1], TypeError, r"weights\[0\]: expected a real number, but got complex 1j"),
    ([None, 1], TypeError, r"weights\[0\]: expected a real number, but got NoneType None"),
    ([1, torch.tensor(True)], TypeError, r"weights\[1\]: expected a real number, but got Tensor"),
    ([1, torch.ones(2)], TypeError, r"weights\[1\]: expected a real number, but got Tensor"),
    (3, TypeError, r"weights: expected a sequence of numbers, one per device, but got int 3"),
    ([1, -0.5], ValueError, r"weights\[1\]: expected a non-negative finite number, but got -0\.5"),
    ([float("nan"), 1], ValueError, r"weights\[0\]: expected a non-negative finite number, but got nan"),
    ([1, float("inf")], ValueError, r"weights\[1\]: expected a non-negative finite number, but got inf"),
    ([0, 0.0], ValueError, r"weights: expected a positive sum, but got \[0\.0, 0\.0\]"),
    ([1, 1, 1], ValueError, r"weights: expected one weight per device \(2\), but got 3"),
]


@pytest.mark.parametrize("chunk_sizes,error,match", BAD_CHUNK_SIZES)
def test_split_sizes_rejects_bad_chunk_sizes(chunk_sizes: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        split_sizes(8, 4, chunk_sizes=chunk_sizes)
    with pytest.raises(error, match=match):
        check_chunk_sizes(chunk_sizes, 4)


@pytest.mark.parametrize("weights,error,match", BAD_WEIGHTS)
def test_split_sizes_rejects_bad_weights(weights: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        split_sizes(8, 2, weights=weights)
    with pytest.raises(error, match=match):
        check_weights(weights, 2)


def test_numpy_and_torch_integers_are_chunk_sizes() -> None:
    sizes = [np.int64(3), torch.tensor(2), np.int32(1), torch.tensor([2], dtype=torch.int16)]
    assert split_sizes(8, 4, chunk_sizes=sizes) == [3, 2, 1, 2]
    assert all(type(s) is int for s in check_chunk_sizes(sizes))
    assert check_chunk_sizes(np.array([1, 2, 5])) == [1, 2, 5]
    assert check_chunk_sizes(torch.tensor([1, 2, 5])) == [1, 2, 5]


def test_real_numbers_are_weights() -> None:
    weights = [np.float32(1.0), torch.tensor(1.0), Fraction(1, 2), np.int64(1), 0.5]
    assert check_weights(weights) == [1.0, 1.0, 0.5, 1.0, 0.5]
    assert split_sizes(8, 5, weights=weights) == split_sizes(8, 5, weights=[2, 2, 1, 2, 1])


def test_scatter_kwargs_checks_the_split_arguments_without_tensors() -> None:
    # The values are checked even when nothing is split.
    with pytest.raises(TypeError, match=r"chunk_sizes\[1\]: expected an int, but got float 0\.5"):
        scatter_kwargs((), {"flag": True}, ["cpu"] * 2, chunk_sizes=[0, 0.5])
    with pytest.raises(ValueError, match=r"weights: expected one weight per device \(2\), but got 1"):
        scatter_kwargs((), None, ["cpu"] * 2, weights=[1])


# ---------------------------------------------------------------------------
# scatter_kwargs: splitting
# ---------------------------------------------------------------------------


def test_scatter_balanced_uses_every_device(devices: list[str]) -> None:
    n = len(devices)
    batch = 2 * n + 1
    x = rows(batch, 3)
    args, kwargs, sizes, _ = scatter_kwargs((x,), None, devices)
    assert sizes == balanced(batch, n)
    assert len(args) == len(kwargs) == n
    start = 0
    for (chunk,), kw, size in zip(args, kwargs, sizes):
        assert kw == {}
        assert torch.equal(chunk, x[start : start + size])
        assert chunk.device == CPU
        start += size
    assert start == batch


def test_scatter_nine_over_four() -> None:
    args, kwargs, sizes, _ = scatter_kwargs((rows(9),), {}, ["cpu"] * 4)
    assert sizes == [3, 2, 2, 2]
    assert [a[0].tolist() for a in args] == [[0, 1, 2], [3, 4], [5, 6], [7, 8]]
    assert len(kwargs) == 4


def test_scatter_fewer_rows_than_devices() -> None:
    args, kwargs, sizes, used = scatter_kwargs((rows(3),), {"y": rows(3)}, ["cpu"] * 4)
    assert sizes == [1, 1, 1]
    assert used == [0, 1, 2]
    assert len(args) == len(kwargs) == 3
    assert [a[0].item() for a in args] == [0, 1, 2]
    assert [k["y"].item() for k in kwargs] == [0, 1, 2]


def test_scatter_chunks_share_the_input_memory_as_tensors_of_their_own(devices: list[str]) -> None:
    """DataParallel's chunks on the input's device (unlike comm.scatter's views, test_comm) share its memory
    but are no views, and only the first shares its version counter: a write into one chunk bumps no other's."""
    for x in (rows(8, 2), rows(8, 2).mul(1).requires_grad_().mul(1)):  # plain, and not a leaf but requiring grad
        args, _, sizes, _ = scatter_kwargs((x,), None, devices)
        chunks = [a[0] for a in args]
        for chunk, start in zip(chunks, np.cumsum([0, *sizes[:-1]])):
            assert chunk._base is None and chunk.requires_grad == x.requires_grad
            assert chunk.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            assert chunk.storage_offset() == start * 2 and torch.equal(chunk, x[start : start + len(chunk)])
        with torch.no_grad():
            before = [c._version for c in chunks]
            chunks[-1].add_(100)
            after = [c._version for c in chunks]
        assert after[:-1] == before[:-1] and after[-1] > before[-1]
        assert x[-1].tolist() == [107.0, 107.0]  # the caller's tensor sees the write
        version = x._version
        with torch.no_grad():
            chunks[0].add_(1)
        assert x._version > version  # the first chunk and the caller's tensor share one counter
        assert [c._version for c in chunks[1:]] == after[1:]
    leaf = rows(8, 2).requires_grad_()  # a leaf requiring grad keeps views: writes into it are refused
    args, _, _, _ = scatter_kwargs((leaf,), None, devices)
    assert all(a[0]._base is leaf for a in args)


def test_scatter_chunk_sizes_drops_empty_replicas() -> None:
    x = rows(5)
    args, kwargs, sizes, used = scatter_kwargs((x,), None, ["cpu"] * 3, chunk_sizes=[2, 0, 3])
    assert sizes == [2, 3]
    assert used == [0, 2]  # the devices that got rows
    assert len(args) == len(kwargs) == 2
    assert args[0][0].tolist() == [0, 1] and args[1][0].tolist() == [2, 3, 4]


def test_scatter_chunk_sizes_error_names_argument() -> None:
    with pytest.raises(ValueError, match="chunk_sizes"):
        scatter_kwargs((rows(5),), None, ["cpu"] * 2, chunk_sizes=[2, 2])
    with pytest.raises(ValueError, match="chunk_sizes"):
        scatter_kwargs((rows(5),), None, ["cpu"] * 2, chunk_sizes=[5])


def test_scatter_weights() -> None:
    args, _, sizes, used = scatter_kwargs((rows(10),), None, ["cpu"] * 3, weights=[1, 0, 4])
    assert sizes == [2, 8]
    assert used == [0, 2]
    assert args[0][0].tolist() == [0, 1] and args[1][0].tolist() == list(range(2, 10))


def test_scatter_dim1_and_negative(devices: list[str]) -> None:
    n = len(devices)
    x = torch.arange(3 * (n + 2) * 2, dtype=torch.float32).reshape(3, n + 2, 2)
    for dim in (1, -2):
        args, _, sizes, _ = scatter_kwargs((x,), None, devices, dim=dim)
        assert sizes == balanced(n + 2, n)
        assert torch.equal(torch.cat([a[0] for a in args], dim=1), x)
        assert all(a[0].shape[0] == 3 and a[0].shape[2] == 2 for a in args)
    y = torch.arange(2 * (n + 1), dtype=torch.float32).reshape(2, n + 1)
    args, _, sizes, _ = scatter_kwargs((y,), None, devices, dim=-1)
    assert sizes == balanced(n + 1, n)
    assert [a[0].shape[1] for a in args] == sizes
    assert torch.equal(gather([a[0] for a in args], "cpu", dim=-1), y)


def test_scatter_zero_rows_gives_one_replica(devices: list[str]) -> None:
    x = torch.zeros(0, 3)
    args, kwargs, sizes, _ = scatter_kwargs((x,), {"s": "k"}, devices)
    assert sizes == [0] and len(args) == len(kwargs) == 1
    assert args[0][0].shape == (0, 3) and kwargs[0] == {"s": "k"}


# ---------------------------------------------------------------------------
# scatter_kwargs: pytrees
# ---------------------------------------------------------------------------


def test_scatter_nested_types_are_kept(devices: list[str]) -> None:
    batch = 7
    x = rows(batch, 2)
    dc = Batch(rows(batch))
    dc.derived = rows(batch) * 10
    dd: defaultdict[str, list[Any]] = defaultdict(list, {"t": rows(batch)})
    inputs = (
        [x, (rows(batch), "s")],
        {"a": rows(batch), "b": OrderedDict([("z", rows(batch)), ("y", 3)])},
        Pair(rows(batch), 1.5),
        TypedPair(rows(batch), None),
        dc,
        Frozen(rows(batch), 4),
    )
    args, kwargs, sizes, _ = scatter_kwargs(inputs, {"dd": dd}, devices)
    assert len(args) == len(sizes) == len(devices)
    start = 0
    for a, kw, size in zip(args, kwargs, sizes):
        expect = torch.arange(start, start + size, dtype=torch.float32)
        lst, dct, pair, tpair, batch_dc, frozen = a
        assert type(lst) is list and type(lst[1]) is tuple and lst[1][1] == "s"
        assert torch.equal(lst[0][:, 0], expect) and torch.equal(lst[1][0], expect)
        assert type(dct) is dict and type(dct["b"]) is OrderedDict
        assert list(dct["b"].keys()) == ["z", "y"] and dct["b"]["y"] == 3
        assert torch.equal(dct["a"], expect) and torch.equal(dct["b"]["z"], expect)
        assert type(pair) is Pair and torch.equal(pair.a, expect) and pair.b == 1.5
        assert type(tpair) is TypedPair and torch.equal(tpair.a, expect) and tpair.b is None
        assert type(batch_dc) is Batch and batch_dc.label == "train"
        assert torch.equal(batch_dc.x, expect) and torch.equal(batch_dc.derived, expect * 10)
        assert batch_dc is not dc
        assert type(frozen) is Frozen and frozen.n == 4 and torch.equal(frozen.x, expect)
        assert type(kw["dd"]) is defaultdict and kw["dd"].default_factory is list
        assert torch.equal(kw["dd"]["t"], expect)
        assert kw["dd"]["missing"] == []
        start += size
    # Containers are rebuilt per replica, not shared.
    if len(args) > 1:
        assert args[0][0] is not args[1][0]


def test_scatter_then_gather_round_trip(devices: list[str]) -> None:
    batch = 6
    tree = {
        "list": [rows(batch, 2), rows(batch)],
        "pair": Pair(rows(batch), rows(batch, 3)),
        "typed": TypedPair(rows(batch), rows(batch)),
        "dc": Batch(rows(batch)),
        "od": OrderedDict(b=rows(batch), a=rows(batch)),
    }
    args, _, _, _ = scatter_kwargs((tree,), None, devices)
    out = gather([a[0] for a in args], "cpu")
    assert type(out) is dict and list(out) == list(tree)
    assert type(out["list"]) is list and torch.equal(out["list"][0], tree["list"][0])
    assert type(out["pair"]) is Pair and torch.equal(out["pair"].b, tree["pair"].b)
    assert type(out["typed"]) is TypedPair and torch.equal(out["typed"].a, tree["typed"].a)
    assert type(out["dc"]) is Batch and torch.equal(out["dc"].x, tree["dc"].x)
    assert out["dc"].label == ["train"] * len(args)
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["b", "a"]


def test_scatter_kwargs_only(devices: list[str]) -> None:
    x = rows(5, 2)
    args, kwargs, sizes, _ = scatter_kwargs((), {"x": x, "flag": True}, devices)
    assert len(args) == len(kwargs) == len(sizes) == min(5, len(devices))
    assert all(a == () for a in args)
    assert torch.equal(torch.cat([k["x"] for k in kwargs]), x)
    assert all(k["flag"] is True for k in kwargs)


def test_scatter_empty_container_kwargs_survive(devices: list[str]) -> None:
    for inputs in [(), (rows(4),)]:
        args, kwargs, sizes, _ = scatter_kwargs(inputs, {"l": [], "d": {}, "t": (), "od": OrderedDict()}, devices)
        assert len(args) == len(kwargs) == len(sizes) >= 1
        for kw in kwargs:
            assert kw["l"] == [] and type(kw["l"]) is list
            assert kw["d"] == {} and type(kw["d"]) is dict
            assert kw["t"] == () and type(kw["t"]) is tuple
            assert type(kw["od"]) is OrderedDict and len(kw["od"]) == 0


def test_scatter_no_inputs_gives_one_replica(devices: list[str]) -> None:
    assert scatter_kwargs((), None, devices) == ([()], [{}], [0], [0])
    assert scatter_kwargs(None, {}, devices) == ([()], [{}], [0], [0])
    marker = object()
    args, kwargs, sizes, _ = scatter_kwargs((marker, [1, 2]), {"k": "v"}, devices)
    assert len(args) == 1 and args[0][0] is marker and args[0][1] == [1, 2] and kwargs == [{"k": "v"}]


def test_scatter_non_tensor_leaves_by_reference(devices: list[str]) -> None:
    class Config:
        pass

    config, text, number = Config(), "a string", 12345678901234567890
    args, kwargs, _, _ = scatter_kwargs((rows(8), config, [text]), {"n": number, "c": config}, devices)
    assert len(args) == len(devices)
    for a, kw in zip(args, kwargs):
        assert a[1] is config and a[2][0] is text
        assert kw["n"] is number and kw["c"] is config


def test_scatter_same_tensor_twice_shares_chunks(devices: list[str]) -> None:
    x = rows(6)
    args, kwargs, _, _ = scatter_kwargs((x, x), {"x": x}, devices)
    for a, kw in zip(args, kwargs):
        assert a[0] is a[1] is kw["x"]


def test_scatter_single_non_tuple_argument() -> None:
    args, _, sizes, _ = scatter_kwargs(rows(4), None, ["cpu"] * 2)
    assert sizes == [2, 2] and args[1][0].tolist() == [2, 3]
    args, _, _, _ = scatter_kwargs(Pair(rows(4), "b"), None, ["cpu"] * 2)
    assert type(args[0][0]) is Pair and args[0][0].a.tolist() == [0, 1]


# ---------------------------------------------------------------------------
# scatter_kwargs: Broadcast
# ---------------------------------------------------------------------------


def test_broadcast_tensor(devices: list[str]) -> None:
    x = rows(8)
    table = torch.randn(3, 5)
    args, kwargs, _, _ = scatter_kwargs((x, Broadcast(table)), {"t": Broadcast(table)}, devices)
    assert len(args) == len(devices)
    assert args[0][1] is table
    for i, (a, kw) in enumerate(zip(args, kwargs)):
        assert torch.equal(a[1], table) and torch.equal(kw["t"], table)
        if i > 0:  # copies own their memory, also on a repeated device
            assert a[1].data_ptr() != table.data_ptr()


def test_broadcast_non_tensor_by_reference(devices: list[str]) -> None:
    config = {"vocab": ["a", "b"], "depth": 3}
    args, kwargs, _, _ = scatter_kwargs((rows(8), Broadcast(config)), {"c": Broadcast(config)}, devices)
    assert len(args) == len(devices)
    assert all(a[1] is config and kw["c"] is config for a, kw in zip(args, kwargs))


def test_broadcast_container_of_tensors(devices: list[str]) -> None:
    w = torch.randn(4)
    label = "keep"
    args, _, _, _ = scatter_kwargs((rows(8), Broadcast([w, label])), None, devices)
    for a in args:
        assert type(a[1]) is list and torch.equal(a[1][0], w) and a[1][1] is label
    assert args[0][1][0] is w


def test_broadcast_tensor_is_excluded_from_batch_check(devices: list[str]) -> None:
    args, _, sizes, _ = scatter_kwargs((rows(8), Broadcast(torch.ones(3))), None, devices)
    assert sum(sizes) == 8 and all(a[1].shape == (3,) for a in args)


def test_broadcast_tensor_gradient_sums_over_replicas(devices: list[str]) -> None:
    x = torch.randn(7, 3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    args, _, _, _ = scatter_kwargs((x, Broadcast(w)), None, devices)
    loss = sum(((a[0] * a[1]) ** 2).sum() for a in args)
    (grad,) = torch.autograd.grad(loss, w)
    (expected,) = torch.autograd.grad(((x * w) ** 2).sum(), w)
    torch.testing.assert_close(grad, expected)


def test_broadcast_tensor_function_gradcheck() -> None:
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        outs = BroadcastTensor.apply(["cpu"] * 3, t)
        return sum((o * (i + 1)) ** 2 for i, o in enumerate(outs))

    assert torch.autograd.gradcheck(f, (w,))
    assert torch.autograd.gradgradcheck(f, (w,))


# ---------------------------------------------------------------------------
# scatter_kwargs: errors
# ---------------------------------------------------------------------------


def test_mismatched_batch_sizes_name_both_paths() -> None:
    with pytest.raises(ValueError) as info:
        scatter_kwargs((rows(8), {"mask": rows(5)}), None, ["cpu"] * 2)
    msg = str(info.value)
    assert "inputs[1]['mask']" in msg and "inputs[0]" in msg
    assert "size 5" in msg and "size 8" in msg and "dim 0" in msg


def test_mismatched_batch_sizes_in_kwargs_and_nested_types() -> None:
    with pytest.raises(ValueError, match=r"kwargs\['b'\]\.a has size 3 along dim 1 but kwargs\['a'\]\[0\] has size 4"):
        scatter_kwargs((), {"a": [torch.ones(2, 4)], "b": Pair(torch.ones(2, 3), 0)}, ["cpu"] * 2, dim=1)
    with pytest.raises(ValueError, match=r"inputs\[1\] has size 3 along dim 0 but inputs\[0\]\.x has size 2"):
        scatter_kwargs((Batch(torch.ones(2)), torch.ones(3)), None, ["cpu"])


def test_mismatched_batch_sizes_error_even_with_one_device() -> None:
    with pytest.raises(ValueError, match="inputs\\[1\\]"):
        scatter_kwargs((rows(4), rows(3)), None, ["cpu"])


def test_zero_dim_tensor_goes_whole_to_every_replica() -> None:
    args, _, _, _ = scatter_kwargs((rows(4), torch.tensor(1.0)), None, ["cpu"] * 2)
    assert [a[1].item() for a in args] == [1.0, 1.0] and all(a[1].dim() == 0 for a in args)
    # Wrapped in Broadcast it is the same.
    args, _, _, _ = scatter_kwargs((rows(4), Broadcast(torch.tensor(1.0))), None, ["cpu"] * 2)
    assert all(a[1].item() == 1.0 for a in args)


def test_dim_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"kwargs\['x'\] has 1 dimensions.*dim 1"):
        scatter_kwargs((), {"x": torch.ones(4)}, ["cpu"] * 2, dim=1)


def test_empty_device_list_is_an_error() -> None:
    with pytest.raises(ValueError, match="devices"):
        scatter_kwargs((rows(4),), None, [])


# ---------------------------------------------------------------------------
# gather
# ---------------------------------------------------------------------------


def test_gather_zero_dim_stacks_without_warning(devices: list[str]) -> None:
    values = [torch.tensor(float(i)) for i in range(len(devices))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = gather(values, "cpu")
        direct = Gather.apply(CPU, 0, *values)
        nested = gather([{"loss": v} for v in values], "cpu")
    assert out.shape == (len(devices),) and out.tolist() == list(range(len(devices)))
    assert torch.equal(direct, out) and torch.equal(nested["loss"], out)


def test_gather_zero_dim_gradients_are_zero_dim() -> None:
    values = [torch.tensor(float(i + 1), dtype=torch.float64, requires_grad=True) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = gather(values, "cpu")
        (out * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    assert [v.grad.shape for v in values] == [torch.Size([])] * 3
    assert [v.grad.item() for v in values] == [1.0, 2.0, 3.0]


def test_gather_tensors_dims(devices: list[str]) -> None:
    parts = [torch.full((2, i + 1), float(i)) for i in range(len(devices))]
    out = gather(parts, "cpu", dim=1)
    assert torch.equal(out, torch.cat(parts, dim=1))
    out = gather(parts, "cpu", dim=-1)
    assert torch.equal(out, torch.cat(parts, dim=-1))
    assert out.data_ptr() != parts[0].data_ptr()


def test_gather_strings_numbers_and_none(devices: list[str]) -> None:
    n = len(devices)
    outs = [
        {"name": f"r{i}", "count": i, "none": None, "mixed": None if i == 0 else i, "t": torch.ones(1)}
        for i in range(n)
    ]
    out = gather(outs, "cpu")
    assert out["name"] == [f"r{i}" for i in range(n)]
    assert out["count"] == list(range(n))
    assert out["none"] is None
    assert out["mixed"] == ([None] + list(range(1, n)) if n > 1 else None)
    assert out["t"].shape == (n,)


def test_gather_keeps_container_types(devices: list[str]) -> None:
    n = len(devices)
    outs = [
        (
            Pair(torch.ones(1), "a"),
            TypedPair(torch.ones(2), 1),
            [torch.ones(1)],
            OrderedDict(k=torch.ones(1)),
            Frozen(torch.ones(1), 1),
        )
        for _ in range(n)
    ]
    pair, tpair, lst, od, frozen = gather(outs, "cpu")
    assert type(pair) is Pair and pair.a.shape == (n,) and pair.b == ["a"] * n
    assert type(tpair) is TypedPair and tpair.a.shape == (2 * n,)
    assert type(lst) is list and lst[0].shape == (n,)
    assert type(od) is OrderedDict and od["k"].shape == (n,)
    assert type(frozen) is Frozen and frozen.x.shape == (n,) and frozen.n == [1] * n


@dataclasses.dataclass
class WithInitVar:
    x: torch.Tensor
    scale: dataclasses.InitVar[float] = 1.0

    def __post_init__(self, scale: float) -> None:
        self.x = self.x * scale


def test_dataclass_with_initvar_is_not_reinitialised() -> None:
    obj = WithInitVar(rows(4), scale=10.0)
    args, _, _, _ = scatter_kwargs((obj,), None, ["cpu"] * 2)
    assert [type(a[0]) for a in args] == [WithInitVar, WithInitVar]
    assert args[0][0].x.tolist() == [0, 10] and args[1][0].x.tolist() == [20, 30]
    out = gather([a[0] for a in args], "cpu")
    assert type(out) is WithInitVar and out.x.tolist() == [0, 10, 20, 30]


def test_gather_dataclass_with_init_false_field() -> None:
    a, b = Batch(torch.ones(2), "x"), Batch(torch.zeros(3), "y")
    a.derived, b.derived = torch.ones(2), torch.zeros(3)
    out = gather([a, b], "cpu")
    assert type(out) is Batch and out.label == ["x", "y"]
    assert out.x.tolist() == [1, 1, 0, 0, 0] and out.derived.tolist() == [1, 1, 0, 0, 0]


@pytest.mark.parametrize(
    "outputs,match",
    [
        (
            [{"logits": torch.ones(1)}, {"logits": None}],
            r"output\['logits'\] of replica 1 is None but replica 0's is a tensor",
        ),
        (
            [{"a": torch.ones(1)}, {"b": torch.ones(1)}],
            r"output of replica 1 .*missing keys \['a'\].*extra keys \['b'\]",
        ),
        ([[torch.ones(1), torch.ones(1)], [torch.ones(1)]], r"output of replica 1 is a list of length 1 .* length 2"),
        ([(torch.ones(1),), [torch.ones(1)]], r"output of replica 1 is a list .* tuple"),
        ([{"x": [torch.ones(1), "s"]}, {"x": [torch.ones(1), torch.ones(1)]}], r"output\['x'\]\[1\] of replica 1"),
        ([Pair(torch.ones(1), 1), TypedPair(torch.ones(1), 1)], r"output of replica 1 is a TypedPair"),
        ([{"d": {}}, {"d": OrderedDict()}], r"output\['d'\] of replica 1 is a OrderedDict"),
        ([torch.ones(1), torch.ones(1), "s"], r"output of replica 2 is a str"),
    ],
)
def test_gather_mismatched_structures_name_the_path(outputs: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gather(outputs, "cpu")


def test_gather_incompatible_tensors_error_names_path() -> None:
    with pytest.raises(RuntimeError, match=r"output\['h'\]"):
        gather([{"h": torch.ones(2, 3)}, {"h": torch.ones(2, 4)}], "cpu")


def test_gather_requires_outputs() -> None:
    with pytest.raises(ValueError, match="outputs"):
        gather([], "cpu")
    with pytest.raises(TypeError, match="outputs"):
        gather(torch.ones(2), "cpu")


# ---------------------------------------------------------------------------
# dpcore.scatter / dpcore.gather: torch.nn.parallel's top-level functions
# ---------------------------------------------------------------------------


def test_top_level_scatter_and_gather_have_torchs_arguments() -> None:
    assert {"scatter", "gather"} <= set(dpcore.__all__)
    assert dpcore.scatter is scatter and dpcore.gather is gather
    for ours, theirs in ((dpcore.scatter, torch.nn.parallel.scatter), (dpcore.gather, torch.nn.parallel.gather)):
        ours_params = inspect.signature(ours).parameters
        their_params = inspect.signature(theirs).parameters
        assert list(ours_params) == list(their_params)
        assert [p.default for p in ours_params.values()] == [p.default for p in their_params.values()]


def test_scatter_a_tensor_gives_a_tuple_of_chunks(devices: list[str]) -> None:
    n = len(devices)
    x = rows(2 * n + 1, 3)
    chunks = dpcore.scatter(x, devices)
    assert type(chunks) is tuple and [c.shape[0] for c in chunks] == balanced(2 * n + 1, n)
    assert torch.equal(dpcore.gather(list(chunks), "cpu"), x)
    assert torch.equal(dpcore.gather(list(chunks), target_device="cpu", dim=0), x)


def test_scatter_a_pytree_gives_a_list_per_device(devices: list[str]) -> None:
    n = len(devices)
    tree = ({"x": rows(n + 2), "tag": "t"}, [rows(n + 2, 2)])
    values = dpcore.scatter(tree, devices)
    assert type(values) is list and len(values) == n
    for value in values:
        assert type(value) is tuple and value[0]["tag"] == "t" and type(value[1]) is list
    assert torch.equal(torch.cat([v[1][0] for v in values]), tree[1][0])
    # dim, and gradients through both.
    y = torch.randn(3, n + 1, dtype=torch.float64, requires_grad=True)
    out = dpcore.gather([c * 2 for c in dpcore.scatter(y, devices, dim=1)], "cpu", dim=1)
    out.sum().backward()
    torch.testing.assert_close(y.grad, torch.full_like(y, 2.0))


def test_scatter_fewer_rows_or_no_tensor() -> None:
    # torch's zip truncates to the rows; with no tensor every device gets the value.
    assert len(dpcore.scatter(rows(2), ["cpu"] * 4)) == 2
    assert dpcore.scatter("text", ["cpu"] * 3) == ["text"] * 3
    assert dpcore.scatter((1, [2]), ["cpu"] * 2) == [(1, [2]), (1, [2])]
    with pytest.raises(ValueError, match=r"inputs\[1\] has size 3 along dim 0 but inputs\[0\] has size 4"):
        dpcore.scatter((rows(4), rows(3)), ["cpu"] * 2)
    with pytest.raises(ValueError, match="target_gpus: expected at least one device"):
        dpcore.scatter(rows(4), [])


# ---------------------------------------------------------------------------
# Scatter / Gather Functions and gradients
# ---------------------------------------------------------------------------


def test_scatter_function_without_grad_returns_plain_tensors() -> None:
    x = rows(5, 2)
    chunks = Scatter.apply([CPU] * 2, [3, 2], 0, x)
    assert all(c.grad_fn is None and not c.requires_grad for c in chunks)
    out = Gather.apply(CPU, 0, *chunks)
    assert out.grad_fn is None and torch.equal(out, x)


def test_scatter_function_empty_chunks() -> None:
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    chunks = Scatter.apply([CPU] * 3, [0, 3, 0], 0, x)
    assert [c.shape for c in chunks] == [(0, 2), (3, 2), (0, 2)]
    out = Gather.apply(CPU, 0, *chunks)
    (out * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))

    def f(t: torch.Tensor) -> torch.Tensor:
        return Gather.apply(CPU, 0, *Scatter.apply([CPU] * 3, [0, 3, 0], 0, t)) ** 2

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_gradient_flows_through_scatter_kwargs_and_gather(devices: list[str]) -> None:
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    args, kwargs, _, _ = scatter_kwargs(({"x": x},), {"y": x}, devices)
    outs = [a[0]["x"].sin() * kw["y"] for a, kw in zip(args, kwargs)]
    gathered = gather(outs, "cpu")
    (grad,) = torch.autograd.grad(gathered.sum(), x)
    (expected,) = torch.autograd.grad((x.sin() * x).sum(), x)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_gather_gradcheck_and_gradgradcheck(devices: list[str], dim: int) -> None:
    n = len(devices)
    x = torch.randn(n + 1, n + 2, dtype=torch.float64, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        args, _, _, _ = scatter_kwargs((t,), None, devices, dim=dim)
        outs = [(a[0] ** 3) * (i + 1) for i, a in enumerate(args)]
        return gather(outs, "cpu", dim=dim)

    assert f(x).shape == x.shape
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_functions_gradcheck_with_uneven_chunks() -> None:
    x = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    devs = [CPU] * 3

    def f(t: torch.Tensor) -> torch.Tensor:
        chunks = Scatter.apply(devs, [4, 1, 2], 1, t)
        return Gather.apply(CPU, 1, *(c.exp() * (i + 1) for i, c in enumerate(chunks)))

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_gather_scalars_gradgradcheck() -> None:
    values = tuple(torch.randn((), dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(*vs: torch.Tensor) -> torch.Tensor:
        return Gather.apply(CPU, 0, *(v**2 for v in vs)) ** 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.autograd.gradcheck(f, values)
        assert torch.autograd.gradgradcheck(f, values)


def test_gather_function_rejects_non_tensors() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        Gather.apply(CPU, 0)
    with pytest.raises(TypeError, match=r"inputs\[1\]"):
        Gather.apply(CPU, 0, torch.ones(1), 3)


class _WritesItsInputs(torch.nn.Module):
    """Writes its inputs in place before using them (their chunks are saved for backward after the write:
    Linear saves its input, cross_entropy its target, the product both factors)."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.write = write
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 5, dtype=torch.float64)

    def forward(self, x: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        pos = batch["pos"][0]
        pos.clamp_(0, 4)  # transformers' QA heads: start_positions.clamp_(0, ignored_index)
        if self.write == "add_":
            x.add_(1.5)
        elif self.write == "index":
            x[x < 0] = 0.25
        else:
            x.clamp_(-0.5, 0.5)
        h = self.lin(x)
        return torch.nn.functional.cross_entropy(h, pos, reduction="none") + (h * x.sum(1, keepdim=True)).sum(1)


def _writes_inputs_case(devices: list[str], write: str, grad: bool, as_kwargs: bool) -> None:
    module = _WritesItsInputs(write)
    dp = dpcore.DataParallel(_WritesItsInputs(write), devices)
    torch.manual_seed(1)
    base = torch.randn(len(devices) * 2 + 1, 4, dtype=torch.float64)
    pos = torch.tensor([-1, 3, 7, 2, 9, 0, 4, -3, 5][: base.shape[0]])
    results = []
    for model in (module, dp):
        leaf = base.clone().requires_grad_(grad)
        x = leaf * 1.0 if grad else leaf.clone()  # written in place: not a leaf where it requires grad
        batch = {"pos": [pos.clone()]}  # nested: a list inside a dict
        out = model(x=x, batch=batch) if as_kwargs else model(x, batch)
        out.pow(2).sum().backward()
        results.append((out.detach(), x.detach(), batch["pos"][0], leaf.grad, [p.grad for p in model.parameters()]))
    (want, want_x, want_pos, want_leaf, want_params), (got, got_x, got_pos, got_leaf, got_params) = results
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # On a CPU list (every chunk on the input's device) the caller's tensors see the writes, as the bare
    # module's would.
    torch.testing.assert_close(got_x, want_x, atol=0, rtol=0)
    assert torch.equal(got_pos, want_pos)
    if grad:
        torch.testing.assert_close(got_leaf, want_leaf, atol=1e-12, rtol=0)
    for g, w in zip(got_params, want_params):  # summed over the replicas: another order of a sum near 1e3
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-14)


@pytest.mark.parametrize("devices", [["cpu"] * k for k in (2, 3, 4)], ids=["cpu*2", "cpu*3", "cpu*4"])
@pytest.mark.parametrize("write", ["clamp_", "add_", "index"])
@pytest.mark.parametrize("grad", [False, True], ids=["plain", "requires_grad"])
def test_in_place_writes_to_inputs_train_as_the_bare_module(devices: list[str], write: str, grad: bool) -> None:
    """Each replica's chunk is its own tensor: one replica's in-place write never fails another's backward
    (before, the chunks shared one version counter: "modified by an inplace operation")."""
    _writes_inputs_case(devices, write, grad, as_kwargs=False)


@pytest.mark.parametrize("devices", [["cpu"] * k for k in (2, 3, 4)], ids=["cpu*2", "cpu*3", "cpu*4"])
@pytest.mark.parametrize("grad", [False, True], ids=["plain", "requires_grad"])
def test_in_place_writes_to_keyword_inputs_train_as_the_bare_module(devices: list[str], grad: bool) -> None:
    _writes_inputs_case(devices, "clamp_", grad, as_kwargs=True)


@pytest.mark.parametrize("devices", [["cpu"] * k for k in (2, 3, 4)], ids=["cpu*2", "cpu*3", "cpu*4"])
def test_in_place_write_errors_as_the_bare_module(devices: list[str]) -> None:
    """Where the bare module's backward or forward refuses a write, so does the wrapper's: the caller writes
    its input after the call (a saved chunk changed: the first chunk shares the input's version counter), or
    the module writes a leaf that requires grad (its chunks stay views)."""
    for model in (_WritesItsInputs("add_"), dpcore.DataParallel(_WritesItsInputs("add_"), devices)):
        x, pos = torch.randn(5, 4, dtype=torch.float64), torch.tensor([1, 2, 3, 0, 1])
        out = model(x, {"pos": [pos]})
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
        with pytest.raises(RuntimeError, match="in-place|inplace"):
            model(torch.randn(5, 4, dtype=torch.float64, requires_grad=True), {"pos": [pos]})


@pytest.mark.parametrize("devices", [["cpu"] * k for k in (2, 3, 4)], ids=["cpu*2", "cpu*3", "cpu*4"])
def test_separate_chunks_gradcheck_and_gradgradcheck(devices: list[str]) -> None:
    """Gradients through the separate chunks of a non-leaf input (double backward too), each written in place."""
    x = torch.randn(len(devices) + 2, 3, dtype=torch.float64, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        chunks = Scatter.apply(devices, None, 0, t * 1.0)
        return Gather.apply(CPU, 0, *(c.mul_(i + 2).pow(3) for i, c in enumerate(chunks)))

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))
