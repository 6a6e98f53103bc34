"""Tests of dpcore.comm: broadcast, broadcast_coalesced, reduce_add,
reduce_add_coalesced, scatter and gather, on CPU device lists (["cpu"] * k)
and, where a GPU is present, on CUDA device lists (same test bodies).

The behaviours follow torch.cuda.comm and torch's own tests of it
(test_cuda_multigpu.py TestCudaComm), plus dpcore's guarantees (replicas on a
repeated device own their storage, errors name the argument and index).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import dpcore
from dpcore import comm
from dpcore._functions import Scatter

from conftest import DeviceLike, as_torch_device

# --------------------------------------------------------------------------- helpers


def current_device_of(device: torch.device) -> torch.device:
    """What destination=None means for inputs on `device`'s type."""
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device.type)


def rand(
    shape: Sequence[int], dtype: torch.dtype = torch.float32, device: DeviceLike = "cpu", seed: int = 0
) -> torch.Tensor:
    """A deterministic tensor with distinct small values (exact in every dtype used)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        values = torch.randint(-50, 50, tuple(shape), generator=generator).to(dtype) / 4
    else:
        values = torch.randint(-1000, 1000, tuple(shape), generator=generator).to(dtype)
    return values.to(as_torch_device(device))


def sparse(
    shape: tuple[int, int], dtype: torch.dtype = torch.float32, device: DeviceLike = "cpu", seed: int = 0
) -> torch.Tensor:
    """A small sparse COO tensor with a few non-zeros."""
    generator = torch.Generator().manual_seed(seed)
    nnz = 4
    indices = torch.stack(
        [
            torch.randint(0, shape[0], (nnz,), generator=generator),
            torch.randint(0, shape[1], (nnz,), generator=generator),
        ]
    )
    values = torch.arange(1, nnz + 1, dtype=dtype) * (seed + 1)
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True).to(as_torch_device(device))


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` as a dense CPU tensor (for comparisons)."""
    t = t.to_dense() if t.is_sparse else t
    return t.cpu()


def assert_same_tensor_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal shape, dtype, layout and values (devices may differ)."""
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert actual.layout == expected.layout
    assert torch.equal(dense(actual), dense(expected))


def storage_ptr(t: torch.Tensor) -> int:
    """Address of `t`'s storage (shared by all views of one storage)."""
    return t.untyped_storage().data_ptr()


def balanced(total: int, parts: int) -> list[int]:
    """Chunk sizes differing by at most one, the larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def non_contiguous_variants(device: DeviceLike) -> dict[str, torch.Tensor]:
    """Shape (4, 6) tensors on `device` laid out in different ways."""
    base_t = rand((6, 4), device=device, seed=3).t()  # transposed: dense, not contiguous
    base_s = rand((8, 12), device=device, seed=4)[::2, ::2]  # stepped: not dense
    offset = rand((5, 6), device=device, seed=5)[1:]  # storage offset, contiguous
    expanded = rand((1, 6), device=device, seed=6).expand(4, 6)  # stride 0: overlapping
    return {"transposed": base_t, "stepped": base_s, "offset": offset, "expanded": expanded}


LAYOUTS = ["transposed", "stepped", "offset", "expanded"]

MIXED_DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16]


def mixed_tensors(device: DeviceLike, seed: int = 0) -> list[torch.Tensor]:
    """An interleaved list of mixed dtypes, empty tensors, non-contiguous
    tensors and sparse COO tensors, all on `device`."""
    tensors = [
        rand((4, 5), torch.float32, device, seed),
        rand((3,), torch.float64, device, seed + 1),
        rand((2, 3), torch.int64, device, seed + 2),
        rand((7,), torch.float16, device, seed + 3),
        rand((0,), torch.float32, device, seed + 4),
        rand((10, 10), torch.float32, device, seed + 5),
        rand((5, 3), torch.float64, device, seed + 6).t(),
        rand((0, 2), torch.int64, device, seed + 7),
        rand((33,), torch.int64, device, seed + 8),
        rand((6, 8), torch.float16, device, seed + 9)[:, ::2],
        rand((2, 3, 4, 4), torch.float32, device, seed + 10).contiguous(memory_format=torch.channels_last),
        rand((1,), torch.float32, device, seed + 11),
        rand((1, 3), torch.float64, device, seed + 12).expand(2, 3),
    ]
    tensors.insert(3, sparse((5, 6), torch.float32, device, seed))
    tensors.append(sparse((3, 4), torch.float64, device, seed + 1))
    return tensors


BUFFER_SIZES = [
    pytest.param(1, id="buf1"),
    pytest.param(64, id="buf64"),
    pytest.param(1000, id="buf1000"),
    pytest.param(None, id="default"),
]


def buffer_kwargs(buffer_size: int | None) -> dict[str, int]:
    """buffer_size as a keyword argument; None: leave the default."""
    return {} if buffer_size is None else {"buffer_size": buffer_size}


# --------------------------------------------------------------------------- broadcast


def check_broadcast(source: torch.Tensor, devices: list[DeviceLike]) -> list[torch.Tensor]:
    """comm.broadcast(source, devices), checked: a list with one result per
    device, on that device, equal to the source, the first being the source."""
    results = comm.broadcast(source, devices)
    assert isinstance(results, list)
    assert len(results) == len(devices)
    assert results[0] is source
    for device, result in zip(devices, results):
        assert result.device == as_torch_device(device)
        assert_same_tensor_values(result, source)
    return results


@pytest.mark.parametrize("dtype", MIXED_DTYPES + [torch.bool, torch.complex64])
def test_broadcast_results_on_each_device_equal_source(any_devices: list[DeviceLike], dtype: torch.dtype) -> None:
    check_broadcast(rand((3, 5), device=any_devices[0]).to(dtype), any_devices)


def test_broadcast_first_source_device_result_is_source(any_devices: list[DeviceLike]) -> None:
    source = rand((3, 5), device=any_devices[0])
    results = comm.broadcast(source, any_devices)
    assert results[0] is source
    assert results[0].data_ptr() == source.data_ptr()
    # Every other result owns its storage, also on a repeated device.
    pointers = [storage_ptr(r) for r in results]
    assert len(set(pointers)) == len(results)
    for result in results[1:]:
        assert result.data_ptr() != source.data_ptr()
        result.add_(1)
    assert torch.equal(source.cpu(), rand((3, 5)))


def test_broadcast_results_carry_no_autograd_history(any_devices: list[DeviceLike]) -> None:
    source = rand((4,), device=any_devices[0]).requires_grad_()
    results = comm.broadcast(source, list(any_devices) + [any_devices[0]])
    assert results[0] is source
    for result in results[1:]:
        assert result.grad_fn is None
        assert not result.requires_grad


@pytest.mark.parametrize("layout", LAYOUTS)
def test_broadcast_non_contiguous(any_devices: list[DeviceLike], layout: str) -> None:
    check_broadcast(non_contiguous_variants(any_devices[0])[layout], any_devices)


def test_broadcast_sparse(any_devices: list[DeviceLike]) -> None:
    source = sparse((4, 5), device=any_devices[0])
    results = check_broadcast(source, any_devices)
    for result in results[1:]:
        assert result._values().data_ptr() != source._values().data_ptr()


def test_broadcast_keeps_channels_last(any_devices: list[DeviceLike]) -> None:
    source = rand((2, 3, 4, 5), device=any_devices[0]).contiguous(memory_format=torch.channels_last)
    for result in comm.broadcast(source, any_devices):
        assert result.is_contiguous(memory_format=torch.channels_last)
        assert_same_tensor_values(result, source)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 2)])
def test_broadcast_empty_tensor(any_devices: list[DeviceLike], shape: tuple[int, ...]) -> None:
    check_broadcast(torch.empty(shape, device=as_torch_device(any_devices[0])), any_devices)


def test_broadcast_accepts_device_objects_and_cpu_index() -> None:
    source = rand((2, 2))
    results = comm.broadcast(source, [torch.device("cpu"), "cpu:0", "cpu"])
    assert results[0] is source
    assert all(r.device == torch.device("cpu") for r in results)
    assert all(torch.equal(r, source) for r in results)


def test_broadcast_out(any_devices: list[DeviceLike]) -> None:
    source = rand((3, 4), device=any_devices[0])
    outs = [torch.zeros(3, 4, device=as_torch_device(d)) for d in any_devices]
    results = comm.broadcast(source, out=outs)
    assert len(results) == len(outs)
    for out, result in zip(outs, results):
        assert result is out
        assert_same_tensor_values(out, source)


@pytest.mark.parametrize("layout", ["transposed", "stepped"])
def test_broadcast_out_non_contiguous_source_and_outs(any_devices: list[DeviceLike], layout: str) -> None:
    source = non_contiguous_variants(any_devices[0])[layout]
    outs = [torch.zeros(6, 4, device=as_torch_device(d)).t() for d in any_devices]
    comm.broadcast(source, out=outs)
    for out in outs:
        assert_same_tensor_values(out, source)


def test_broadcast_out_including_source_itself(any_devices: list[DeviceLike]) -> None:
    source = rand((5,), device=any_devices[0])
    other = torch.zeros(5, device=as_torch_device(any_devices[-1]))
    results = comm.broadcast(source, out=[source, other])
    assert results[0] is source
    assert torch.equal(source.cpu(), rand((5,)))
    assert_same_tensor_values(other, source)


def test_broadcast_out_empty_tensor(any_devices: list[DeviceLike]) -> None:
    source = torch.empty(0, 3, device=as_torch_device(any_devices[0]))
    outs = [torch.empty(0, 3, device=as_torch_device(d)) for d in any_devices]
    results = comm.broadcast(source, out=outs)
    assert all(r is o for r, o in zip(results, outs))


def test_broadcast_requires_exactly_one_of_devices_and_out() -> None:
    source = rand((2,))
    with pytest.raises(RuntimeError, match="exactly one of 'devices' and 'out'"):
        comm.broadcast(source, ["cpu"], out=[torch.empty(2)])
    with pytest.raises(RuntimeError, match="exactly one of 'devices' and 'out'"):
        comm.broadcast(source)


def test_broadcast_out_shape_mismatch_names_index() -> None:
    source = rand((3, 4))
    outs = [torch.empty(3, 4), torch.empty(3, 4), torch.empty(4, 3)]
    with pytest.raises(RuntimeError, match=r"output tensor at index 2 has shape \[4, 3\]"):
        comm.broadcast(source, out=outs)


def test_broadcast_out_dtype_mismatch_names_index() -> None:
    source = rand((3,))
    with pytest.raises(RuntimeError, match="index 1 has dtype Double"):
        comm.broadcast(source, out=[torch.empty(3), torch.empty(3, dtype=torch.float64)])


def test_broadcast_out_mixed_device_types() -> None:
    source = rand((3,))
    outs = [torch.empty(3), torch.empty(3, device="meta")]
    with pytest.raises(RuntimeError, match="index 1 is on meta"):
        comm.broadcast(source, out=outs)


def test_broadcast_out_empty_list() -> None:
    with pytest.raises(RuntimeError, match="at least one tensor in 'out'"):
        comm.broadcast(rand((2,)), out=[])


def test_broadcast_out_non_tensor_entry() -> None:
    with pytest.raises(TypeError, match=r"out\[1\]"):
        comm.broadcast(rand((2,)), out=[torch.empty(2), "cpu"])


@pytest.mark.parametrize("bad", [1.5, None, object(), True])
def test_broadcast_bad_device_type_names_index(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"devices\[1\]"):
        comm.broadcast(rand((2,)), ["cpu", bad])


def test_broadcast_negative_device_index() -> None:
    with pytest.raises(ValueError, match=r"devices\[0\].*-1"):
        comm.broadcast(rand((2,)), [-1])


@pytest.mark.parametrize("single", ["cpu", torch.device("cpu")])
def test_broadcast_single_device_instead_of_list(single: DeviceLike) -> None:
    with pytest.raises(TypeError, match="single device"):
        comm.broadcast(rand((2,)), single)  # type: ignore[arg-type]


def test_broadcast_empty_device_list() -> None:
    with pytest.raises(RuntimeError, match="at least one device in 'devices'"):
        comm.broadcast(rand((2,)), [])


def test_invisible_cuda_device_is_an_error() -> None:
    # Index device_count() is never visible (0 on a CPU-only torch).
    missing = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=rf"broadcast: devices\[0\] is cuda:{missing}"):
        comm.broadcast(rand((2,)), [missing])
    with pytest.raises(RuntimeError, match=rf"gather: destination.* cuda:{missing}"):
        comm.gather([rand((2,))], destination=missing)
    with pytest.raises(RuntimeError, match=rf"reduce_add: destination.* cuda:{missing}"):
        comm.reduce_add([rand((2,))], destination=f"cuda:{missing}")
    with pytest.raises(RuntimeError, match=rf"scatter: devices\[0\] is cuda:{missing}"):
        comm.scatter(rand((2,)), [torch.device("cuda", missing)])


def test_broadcast_mixed_device_types_in_list() -> None:
    with pytest.raises(RuntimeError, match=r"devices\[1\] is meta"):
        comm.broadcast(rand((2,)), ["cpu", "meta"])


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as their bytes on the CPU (bitwise comparisons: NaN payloads, -0.0)."""
    return t.resolve_conj().resolve_neg().cpu().contiguous().view(torch.uint8)


def special_values(shape: Sequence[int], device: DeviceLike, seed: int = 0) -> torch.Tensor:
    """float32 values with NaNs of several payloads, infinities and -0.0."""
    values = rand(shape, device=device, seed=seed).reshape(-1)
    words = values.view(torch.int32)
    words[::5] = 0x7FC00001 + seed  # NaN payloads
    values[1::5] = -0.0
    values[2::7] = float("inf")
    return values.reshape(tuple(shape))


def bitwise_variants(device: DeviceLike) -> dict[str, torch.Tensor]:
    """Tensors whose copies must come out bit for bit: special values in
    several layouts, an empty one, a lazily conjugated complex one, large
    enough to span several pieces."""
    big = special_values((300, 400), device, 1)
    return {
        "contiguous": special_values((1000, 7), device, 2),
        "misaligned": special_values((100003,), device, 3)[1:],
        "transposed": big.t(),
        "channels_last": special_values((2, 6, 40, 40), device, 4).contiguous(memory_format=torch.channels_last),
        "stepped": big[:, ::3],
        "empty": special_values((0, 3), device, 5),
        "conj": torch.complex(special_values((50,), device, 6), special_values((50,), device, 7)).conj(),
    }


@pytest.mark.parametrize(
    "name", ["contiguous", "misaligned", "transposed", "channels_last", "stepped", "empty", "conj"]
)
def test_broadcast_repeated_device_copies_are_bitwise_and_own_memory(any_devices: list[DeviceLike], name: str) -> None:
    # Every copy on a repeat of the source's device comes from one pack_multi.
    source = bitwise_variants(any_devices[0])[name]
    devices = list(any_devices) + [any_devices[0]] * 2
    results = comm.broadcast(source, devices)
    assert results[0] is source
    pointers = {storage_ptr(source)}
    for d, result in enumerate(results[1:], 1):
        assert result.device == as_torch_device(devices[d])
        assert result.shape == source.shape and result.dtype == source.dtype
        assert torch.equal(bits(result), bits(source)), d
        assert not result.is_conj() and not result.requires_grad
        if name != "stepped":  # dense: the copy keeps its strides
            assert result.stride() == source.stride(), d
        if source.numel() > 0:
            assert storage_ptr(result) not in pointers, d
            pointers.add(storage_ptr(result))


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_broadcast_coalesced_repeated_devices_bitwise(any_devices: list[DeviceLike], buffer_size: int | None) -> None:
    variants = bitwise_variants(any_devices[0])
    names = ["contiguous", "misaligned", "transposed", "channels_last", "stepped", "empty"]
    tensors = [variants[name] for name in names] + [special_values((3500,), any_devices[0], seed) for seed in range(20)]
    devices = list(any_devices) + [any_devices[0]] * 3
    results = comm.broadcast_coalesced(tensors, devices, **buffer_kwargs(buffer_size))
    for d in range(1, len(devices)):
        for i, tensor in enumerate(tensors):
            result = results[d][i]
            assert torch.equal(bits(result), bits(tensor)), (d, i)
            if i != names.index("stepped"):  # dense: the copy keeps its strides
                assert result.stride() == tensor.stride(), (d, i)
    # The outputs of one device never share memory with another device's.
    for i, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            continue
        pointers = [results[d][i].data_ptr() for d in range(len(devices))]
        assert len(set(pointers)) == len(devices), i


@pytest.mark.parametrize("enabled", [True, False])
def test_coalesced_results_leave_the_garbage_collector_as_found(enabled: bool) -> None:
    # The coalesced collectives wrap their results with the cyclic GC paused:
    # afterwards it is enabled or disabled as before, and its collections
    # still find the results (they stay tracked).
    import gc

    tensors = [rand((3,), seed=s) for s in range(2000)]
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        results = comm.broadcast_coalesced(tensors, ["cpu"] * 3)
        assert gc.isenabled() == enabled
        summed = comm.reduce_add_coalesced(results, "cpu")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert all(gc.is_tracked(t) for t in results[1][:10] + summed[:10])
    assert all(torch.equal(s, 3 * t) for s, t in zip(summed, tensors))


# --------------------------------------------------------------------------- broadcast_coalesced


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_broadcast_coalesced_equals_per_tensor_broadcast(
    any_devices: list[DeviceLike], buffer_size: int | None
) -> None:
    tensors = mixed_tensors(any_devices[0])
    originals = [t.clone() for t in tensors]
    results = comm.broadcast_coalesced(tensors, any_devices, **buffer_kwargs(buffer_size))
    assert len(results) == len(any_devices)
    for d, device in enumerate(any_devices):
        assert len(results[d]) == len(tensors)
        for i, tensor in enumerate(tensors):
            expected = comm.broadcast(tensor, any_devices)[d]
            result = results[d][i]
            assert result.device == as_torch_device(device), (d, i)
            assert_same_tensor_values(result, expected)
    # Inputs untouched.
    for tensor, original in zip(tensors, originals):
        assert_same_tensor_values(tensor, original)


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_broadcast_coalesced_first_device_results_are_inputs(
    any_devices: list[DeviceLike], buffer_size: int | None
) -> None:
    tensors = mixed_tensors(any_devices[0])
    results = comm.broadcast_coalesced(tensors, any_devices, **buffer_kwargs(buffer_size))
    for i, tensor in enumerate(tensors):
        assert results[0][i] is tensor
    # Other devices' results own their memory (also on a repeated device).
    for d in range(1, len(any_devices)):
        for i, tensor in enumerate(tensors):
            if tensor.is_sparse or tensor.numel() == 0:
                continue
            assert storage_ptr(results[d][i]) != storage_ptr(tensor), (d, i)


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_broadcast_coalesced_own_version_counters(any_devices: list[DeviceLike], buffer_size: int | None) -> None:
    devices = list(any_devices) + [any_devices[0]]  # at least two devices
    # One dtype: with the default buffer size all share one flat bucket.
    tensors = [rand((3, 4), device=devices[0], seed=s) for s in range(4)]
    results = comm.broadcast_coalesced(tensors, devices, **buffer_kwargs(buffer_size))
    for d in range(1, len(devices)):
        versions = [t._version for t in results[d]]
        input_versions = [t._version for t in tensors]
        results[d][0].add_(1)
        assert results[d][0]._version > versions[0]
        assert [t._version for t in results[d][1:]] == versions[1:]
        assert [t._version for t in tensors] == input_versions
        # The data changed only in that one output.
        assert torch.equal(results[d][0].cpu(), tensors[0].cpu() + 1)
        for i in range(1, len(tensors)):
            assert torch.equal(results[d][i].cpu(), tensors[i].cpu())


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_broadcast_coalesced_preserves_order_of_interleaved_dtypes(
    any_devices: list[DeviceLike], buffer_size: int | None
) -> None:
    dtypes = [torch.float32, torch.int64, torch.float64, torch.float32, torch.float16, torch.int64, torch.float32]
    tensors = [
        torch.full((i + 1,), i, dtype=dtype, device=as_torch_device(any_devices[0])) for i, dtype in enumerate(dtypes)
    ]
    results = comm.broadcast_coalesced(tensors, any_devices, **buffer_kwargs(buffer_size))
    for per_device in results:
        assert [t.dtype for t in per_device] == dtypes
        assert [t.shape[0] for t in per_device] == list(range(1, len(dtypes) + 1))
        for i, t in enumerate(per_device):
            assert torch.all(t.cpu() == i)


def test_broadcast_coalesced_same_tensor_twice(any_devices: list[DeviceLike]) -> None:
    t = rand((3, 2), device=any_devices[0])
    devices = list(any_devices) + [any_devices[0]]
    results = comm.broadcast_coalesced([t, t, t[1:]], devices)
    assert results[0][0] is t and results[0][1] is t
    for per_device in results[1:]:
        assert storage_ptr(per_device[0]) != storage_ptr(t)
        assert per_device[0].data_ptr() != per_device[1].data_ptr()
        per_device[0].zero_()
        assert torch.equal(per_device[1].cpu(), t.cpu())
        assert torch.equal(per_device[2].cpu(), t[1:].cpu())


def test_broadcast_coalesced_keeps_channels_last(any_devices: list[DeviceLike]) -> None:
    t = rand((2, 3, 4, 4), device=any_devices[0]).contiguous(memory_format=torch.channels_last)
    u = rand((5,), device=any_devices[0])
    results = comm.broadcast_coalesced([u, t], any_devices)
    for per_device in results:
        assert per_device[1].is_contiguous(memory_format=torch.channels_last)
        assert_same_tensor_values(per_device[1], t)


def test_broadcast_coalesced_only_empty_tensors(any_devices: list[DeviceLike]) -> None:
    device = as_torch_device(any_devices[0])
    tensors = [torch.empty(0, device=device), torch.empty(2, 0, dtype=torch.int64, device=device)]
    results = comm.broadcast_coalesced(tensors, any_devices, buffer_size=1)
    for d, per_device in enumerate(results):
        assert [t.shape for t in per_device] == [t.shape for t in tensors]
        assert [t.dtype for t in per_device] == [t.dtype for t in tensors]
        assert all(t.device == as_torch_device(any_devices[d]) for t in per_device)


def test_broadcast_coalesced_empty_list(any_devices: list[DeviceLike]) -> None:
    assert comm.broadcast_coalesced([], any_devices) == [[] for _ in any_devices]


def test_broadcast_coalesced_only_sparse(any_devices: list[DeviceLike]) -> None:
    tensors = [sparse((4, 4), device=any_devices[0], seed=s) for s in range(3)]
    results = comm.broadcast_coalesced(tensors, any_devices, buffer_size=64)
    for d, per_device in enumerate(results):
        for t, result in zip(tensors, per_device):
            assert result.is_sparse
            assert result.device == as_torch_device(any_devices[d])
            assert torch.equal(dense(result), dense(t))


def test_broadcast_coalesced_tensor_not_on_first_device() -> None:
    tensors = [rand((2,)), torch.empty(2, device="meta")]
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is on meta"):
        comm.broadcast_coalesced(tensors, ["cpu", "cpu"])


def test_broadcast_coalesced_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="at least one device"):
        comm.broadcast_coalesced([rand((2,))], [])
    with pytest.raises(RuntimeError, match="buffer_size"):
        comm.broadcast_coalesced([rand((2,))], ["cpu", "cpu"], buffer_size=0)
    with pytest.raises(TypeError, match="single tensor"):
        comm.broadcast_coalesced(rand((2,)), ["cpu"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        comm.broadcast_coalesced([rand((2,)), 3], ["cpu"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"devices\[1\]"):
        comm.broadcast_coalesced([rand((2,))], ["cpu", 2.0])  # type: ignore[list-item]


# --------------------------------------------------------------------------- reduce_add


def inputs_on(devices: Sequence[DeviceLike], make: Callable[[DeviceLike, int], torch.Tensor]) -> list[torch.Tensor]:
    return [make(d, k) for k, d in enumerate(devices)]


DESTINATIONS = [pytest.param(None, id="None"), pytest.param("cpu", id="cpu"), pytest.param(-1, id="minus1")]


def expected_destination(destination: DeviceLike | None, inputs_device: torch.device) -> torch.device:
    if destination is None:
        return current_device_of(inputs_device)
    if destination == -1:
        return torch.device("cpu")
    return as_torch_device(destination)


@pytest.mark.parametrize("destination", DESTINATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
def test_reduce_add_dense(any_devices: list[DeviceLike], dtype: torch.dtype, destination: DeviceLike | None) -> None:
    inputs = inputs_on(any_devices, lambda d, k: rand((3, 5), dtype, d, seed=k))
    originals = [t.clone() for t in inputs]
    result = comm.reduce_add(inputs, destination)
    expected = sum(t.cpu() for t in inputs)
    assert result.device == expected_destination(destination, as_torch_device(any_devices[0]))
    assert result.dtype == dtype
    assert torch.equal(result.cpu(), expected)
    for t, original in zip(inputs, originals):
        assert torch.equal(t, original)
        assert result.data_ptr() != t.data_ptr()


def test_reduce_add_result_carries_no_autograd_history(any_devices: list[DeviceLike]) -> None:
    inputs = inputs_on(any_devices, lambda d, k: rand((3,), device=d, seed=k).requires_grad_())
    result = comm.reduce_add(inputs)
    assert result.grad_fn is None
    assert not result.requires_grad
    coalesced = comm.reduce_add_coalesced([[t] for t in inputs])
    assert not coalesced[0].requires_grad


def test_reduce_add_half_with_tolerance(any_devices: list[DeviceLike]) -> None:
    inputs = inputs_on(
        any_devices,
        lambda d, k: torch.randn(64, generator=torch.Generator().manual_seed(k)).half().to(as_torch_device(d)),
    )
    result = comm.reduce_add(inputs)
    assert result.dtype == torch.float16
    expected = sum(t.float().cpu() for t in inputs)
    assert_close(result.float().cpu(), expected, atol=1e-2, rtol=1e-2)


def low_precision_inputs(dtype: torch.dtype, layout: str) -> tuple[list[torch.Tensor], float]:
    """1 followed by four equal small addends that, added one at a time in
    `dtype`, are each lost to rounding (each is half a unit in the last place
    at 1.0, ties round to even), while their sum accumulated in float is
    representable: exact result 1 + 4 * step. Laid out as `layout`:
    "contiguous", "transposed" (all inputs), "stepped" (all inputs, not
    dense) or "mixed" (one transposed input among contiguous ones)."""
    step = 2.0**-11 if dtype == torch.float16 else 2.0**-8

    def lay(t: torch.Tensor, k: int) -> torch.Tensor:
        if layout == "transposed" or (layout == "mixed" and k == 1):
            return t.t().contiguous().t()
        if layout == "stepped":
            return torch.stack([t, t], dim=-1)[..., 0]
        return t

    inputs = [lay(torch.ones(4, 4, dtype=dtype), 0)]
    inputs += [lay(torch.full((4, 4), step, dtype=dtype), k) for k in range(1, 5)]
    return inputs, 1 + 4 * step


@pytest.mark.parametrize("coalesced", [False, True], ids=["reduce_add", "reduce_add_coalesced"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "stepped", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_reduce_add_low_precision_accumulates_in_float(dtype: torch.dtype, layout: str, coalesced: bool) -> None:
    """reduce_add_n's contract (csrc/dpcore/kernels.h): half types accumulate
    in float, so the result does not depend on the inputs' memory layout."""
    inputs, exact = low_precision_inputs(dtype, layout)
    expected = torch.full((4, 4), exact, dtype=dtype)
    if coalesced:
        result = comm.reduce_add_coalesced([[t] for t in inputs], "cpu")[0]
    else:
        result = comm.reduce_add(inputs, "cpu")
    assert torch.equal(result, expected), f"got {result[0, 0].item()}, expected {exact} (float accumulation)"


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_reduce_add_sparse(any_devices: list[DeviceLike], destination: DeviceLike | None) -> None:
    inputs = inputs_on(any_devices, lambda d, k: sparse((5, 6), device=d, seed=k))
    result = comm.reduce_add(inputs, destination)
    assert result.is_sparse
    assert result.device == expected_destination(destination, as_torch_device(any_devices[0]))
    expected = sum(dense(t) for t in inputs)
    assert torch.equal(dense(result), expected)


def test_reduce_add_single_input_returns_new_tensor(any_devices: list[DeviceLike]) -> None:
    source = rand((4, 4), device=any_devices[0])
    result = comm.reduce_add([source])
    assert result is not source
    assert result.data_ptr() != source.data_ptr()
    assert torch.equal(result.cpu(), source.cpu())
    result.add_(1)
    assert torch.equal(source.cpu(), rand((4, 4)))


def test_reduce_add_single_sparse_input_returns_new_tensor(any_devices: list[DeviceLike]) -> None:
    source = sparse((3, 3), device=any_devices[0])
    result = comm.reduce_add([source])
    assert result is not source
    assert torch.equal(dense(result), dense(source))
    result.add_(source)
    assert torch.equal(dense(source), dense(sparse((3, 3))))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reduce_add_non_contiguous(any_devices: list[DeviceLike], layout: str) -> None:
    # Mix laid-out-differently inputs with contiguous ones of the same shape.
    inputs = [
        non_contiguous_variants(d)[layout] if k % 2 == 0 else rand((4, 6), device=d, seed=10 + k)
        for k, d in enumerate(any_devices)
    ]
    result = comm.reduce_add(inputs)
    assert torch.equal(result.cpu(), sum(t.cpu() for t in inputs))


def test_reduce_add_all_transposed(any_devices: list[DeviceLike]) -> None:
    inputs = inputs_on(any_devices, lambda d, k: rand((6, 4), device=d, seed=k).t())
    result = comm.reduce_add(inputs)
    assert torch.equal(result.cpu(), sum(t.cpu() for t in inputs))


def test_reduce_add_empty_tensors(any_devices: list[DeviceLike]) -> None:
    inputs = inputs_on(any_devices, lambda d, k: torch.empty(0, 3, device=as_torch_device(d)))
    result = comm.reduce_add(inputs)
    assert result.shape == (0, 3)
    assert result.device == current_device_of(as_torch_device(any_devices[0]))


def test_reduce_add_large_spans_blocks(devices: list[DeviceLike]) -> None:
    # Larger than one kernel block and not a multiple of it.
    inputs = inputs_on(devices, lambda d, k: rand((70_001,), torch.float64, d, seed=k))
    assert torch.equal(comm.reduce_add(inputs), sum(inputs))


def test_reduce_add_errors() -> None:
    with pytest.raises(RuntimeError, match=r"inputs\[1\] has shape \[3, 2\]"):
        comm.reduce_add([torch.zeros(2, 3), torch.zeros(3, 2)])
    with pytest.raises(RuntimeError, match=r"inputs\[2\] has dtype Double"):
        comm.reduce_add([torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=r"inputs\[1\] has layout"):
        comm.reduce_add([torch.zeros(2, 2), torch.zeros(2, 2).to_sparse()])
    with pytest.raises(RuntimeError, match="at least one tensor"):
        comm.reduce_add([])
    with pytest.raises(TypeError, match="destination"):
        comm.reduce_add([torch.zeros(2)], 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inputs\[0\]"):
        comm.reduce_add([[1.0, 2.0]])  # type: ignore[list-item]


# --------------------------------------------------------------------------- reduce_add_coalesced


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_reduce_add_coalesced_equals_per_tensor_reduce_add(
    any_devices: list[DeviceLike], buffer_size: int | None
) -> None:
    inputs = [mixed_tensors(d, seed=10 * k) for k, d in enumerate(any_devices)]
    originals = [[t.clone() for t in group] for group in inputs]
    results = comm.reduce_add_coalesced(inputs, **buffer_kwargs(buffer_size))
    assert len(results) == len(inputs[0])
    for i, result in enumerate(results):
        column = [group[i] for group in inputs]
        expected = comm.reduce_add(column)
        assert result.device == expected.device, i
        # Values are multiples of 1/4: exact in every dtype, float16 included.
        assert_same_tensor_values(result, expected)
    # Inputs untouched.
    for group, original_group in zip(inputs, originals):
        for t, original in zip(group, original_group):
            assert_same_tensor_values(t, original)


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_reduce_add_coalesced_outputs_are_new_tensors(any_devices: list[DeviceLike], buffer_size: int | None) -> None:
    inputs = [[rand((3, 3), device=d, seed=k), rand((5,), torch.int64, d, seed=k)] for k, d in enumerate(any_devices)]
    results = comm.reduce_add_coalesced(inputs, **buffer_kwargs(buffer_size))
    input_storages = {storage_ptr(t) for group in inputs for t in group}
    for result in results:
        assert all(result is not t for group in inputs for t in group)
        assert storage_ptr(result) not in input_storages
    before = [[t.clone() for t in group] for group in inputs]
    for result in results:
        result.add_(1)
    for group, original in zip(inputs, before):
        for t, o in zip(group, original):
            assert torch.equal(t, o)


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_reduce_add_coalesced_own_version_counters(any_devices: list[DeviceLike], buffer_size: int | None) -> None:
    inputs = [[rand((2, 3), device=d, seed=k + s) for s in range(3)] for k, d in enumerate(any_devices)]
    results = comm.reduce_add_coalesced(inputs, **buffer_kwargs(buffer_size))
    versions = [t._version for t in results]
    expected_1 = results[1].clone()
    results[0].add_(1)
    assert results[0]._version > versions[0]
    assert [t._version for t in results[1:]] == versions[1:]
    assert torch.equal(results[1], expected_1)


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_reduce_add_coalesced_destination(any_devices: list[DeviceLike], destination: DeviceLike | None) -> None:
    inputs = [[rand((4,), device=d, seed=k), sparse((2, 2), device=d, seed=k)] for k, d in enumerate(any_devices)]
    results = comm.reduce_add_coalesced(inputs, destination)
    want = expected_destination(destination, as_torch_device(any_devices[0]))
    assert [r.device for r in results] == [want, want]
    assert torch.equal(results[0].cpu(), sum(group[0].cpu() for group in inputs))
    assert torch.equal(dense(results[1]), sum(dense(group[1]) for group in inputs))


def test_reduce_add_coalesced_preserves_order(any_devices: list[DeviceLike]) -> None:
    dtypes = [torch.float32, torch.int64, torch.float64, torch.float32, torch.int64]
    inputs = [
        [torch.full((i + 1,), i * (k + 1), dtype=dt, device=as_torch_device(d)) for i, dt in enumerate(dtypes)]
        for k, d in enumerate(any_devices)
    ]
    total = sum(k + 1 for k in range(len(any_devices)))
    for buffer_size in (1, 8, 10**6):
        results = comm.reduce_add_coalesced(inputs, buffer_size=buffer_size)
        assert [r.dtype for r in results] == dtypes
        for i, r in enumerate(results):
            assert r.shape == (i + 1,)
            assert torch.all(r.cpu() == i * total)


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_reduce_add_coalesced_layouts_differ_between_lists(
    any_devices: list[DeviceLike], buffer_size: int | None
) -> None:
    """inputs[k][i] share a shape but not strides: the first tensor of list k
    is laid out as LAYOUTS[k % 4] (transposed, stepped, offset, expanded),
    the second alternates transposed and contiguous."""
    inputs = []
    for k, d in enumerate(any_devices):
        variants = non_contiguous_variants(d)
        inputs.append(
            [
                variants[LAYOUTS[k % len(LAYOUTS)]],
                rand((4, 6), device=d, seed=20 + k) if k % 2 else rand((6, 4), device=d, seed=20 + k).t(),
                rand((3,), torch.int64, d, seed=k),
            ]
        )
    results = comm.reduce_add_coalesced(inputs, **buffer_kwargs(buffer_size))
    for i, result in enumerate(results):
        assert torch.equal(result.cpu(), sum(group[i].cpu() for group in inputs)), i


def test_reduce_add_coalesced_empty_tensors(any_devices: list[DeviceLike]) -> None:
    inputs = [
        [torch.empty(0, device=as_torch_device(d)), rand((2,), device=d, seed=k)] for k, d in enumerate(any_devices)
    ]
    results = comm.reduce_add_coalesced(inputs, buffer_size=1)
    assert results[0].shape == (0,)
    assert torch.equal(results[1].cpu(), sum(g[1].cpu() for g in inputs))


def test_reduce_add_coalesced_empty_lists(any_devices: list[DeviceLike]) -> None:
    assert comm.reduce_add_coalesced([[] for _ in any_devices]) == []


def test_reduce_add_coalesced_errors() -> None:
    with pytest.raises(RuntimeError, match=r"inputs\[1\] to hold 2 tensors"):
        comm.reduce_add_coalesced([[torch.zeros(1), torch.zeros(1)], [torch.zeros(1)]])
    with pytest.raises(RuntimeError, match=r"shape \[2\] of inputs\[0\]\[1\], but inputs\[1\]\[1\] has shape \[3\]"):
        comm.reduce_add_coalesced([[torch.zeros(1), torch.zeros(2)], [torch.zeros(1), torch.zeros(3)]])
    with pytest.raises(RuntimeError, match="dtype"):
        comm.reduce_add_coalesced([[torch.zeros(2)], [torch.zeros(2, dtype=torch.int64)]])
    with pytest.raises(RuntimeError, match="at least one list"):
        comm.reduce_add_coalesced([])
    with pytest.raises(TypeError, match="tensor"):
        comm.reduce_add_coalesced(torch.zeros(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inputs\[1\]\[0\]"):
        comm.reduce_add_coalesced([[torch.zeros(1)], ["x"]])  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="buffer_size"):
        comm.reduce_add_coalesced([[torch.zeros(1)], [torch.zeros(1)]], buffer_size=-5)


# --------------------------------------------------------------------------- scatter


def narrow_chunks(tensor: torch.Tensor, sizes: Sequence[int], dim: int) -> list[torch.Tensor]:
    chunks = []
    start = 0
    for size in sizes:
        chunks.append(tensor.narrow(dim, start, size))
        start += size
    return chunks


def check_scatter(
    tensor: torch.Tensor, chunks: Sequence[torch.Tensor], devices: Sequence[DeviceLike], sizes: Sequence[int], dim: int
) -> None:
    assert len(chunks) == len(devices)
    for chunk, expected, device in zip(chunks, narrow_chunks(tensor, sizes, dim), devices):
        assert chunk.device == as_torch_device(device)
        assert chunk.shape == expected.shape
        assert chunk.dtype == tensor.dtype
        assert torch.equal(chunk.cpu(), expected.cpu())


@pytest.mark.parametrize("dim", [0, 1, -2, 2, -1, -3])
def test_scatter_dims_balanced(any_devices: list[DeviceLike], dim: int) -> None:
    tensor = rand((4, 6, 8), device=any_devices[0])
    chunks = comm.scatter(tensor, any_devices, dim=dim)
    assert isinstance(chunks, tuple)
    check_scatter(tensor, chunks, any_devices, balanced(tensor.size(dim), len(any_devices)), dim)


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_scatter_chunk_sizes(any_devices: list[DeviceLike], dim: int) -> None:
    tensor = rand((10, 10, 3), device=any_devices[0])
    k = len(any_devices)
    sizes = list(range(1, k)) + [10 - sum(range(1, k))]  # uneven: 1, 2, ..., rest
    chunks = comm.scatter(tensor, any_devices, chunk_sizes=sizes, dim=dim)
    check_scatter(tensor, chunks, any_devices, sizes, dim)


def test_scatter_chunk_sizes_with_zero(any_devices: list[DeviceLike]) -> None:
    tensor = rand((5, 2), device=any_devices[0])
    sizes = [0] * (len(any_devices) - 1) + [5]
    chunks = comm.scatter(tensor, any_devices, chunk_sizes=tuple(sizes))
    check_scatter(tensor, chunks, any_devices, sizes, 0)


@pytest.mark.parametrize(
    "rows, expected", [(10, [3, 3, 2, 2]), (3, [1, 1, 1, 0]), (4, [1, 1, 1, 1]), (9, [3, 2, 2, 2])]
)
def test_scatter_default_split_is_balanced(rows: int, expected: list[int]) -> None:
    tensor = rand((rows, 2))
    chunks = comm.scatter(tensor, ["cpu"] * 4)
    assert [c.shape[0] for c in chunks] == expected
    assert torch.equal(torch.cat(chunks), tensor)


def test_scatter_default_split_every_device_list(any_devices: list[DeviceLike]) -> None:
    for rows in (0, 1, 3, 7, 10):
        tensor = rand((rows, 3), device=any_devices[0])
        chunks = comm.scatter(tensor, any_devices)
        sizes = [c.shape[0] for c in chunks]
        assert sizes == balanced(rows, len(any_devices))
        assert max(sizes) - min(sizes) <= 1


def test_scatter_source_device_chunks_are_views(any_devices: list[DeviceLike]) -> None:
    tensor = rand((8, 3), device=any_devices[0])
    chunks = comm.scatter(tensor, any_devices)
    assert chunks[0]._base is tensor
    assert chunks[0].data_ptr() == tensor.data_ptr()
    for chunk in chunks:
        if chunk.device == tensor.device:
            assert storage_ptr(chunk) == storage_ptr(tensor)
        else:
            assert storage_ptr(chunk) != storage_ptr(tensor)


def test_scatter_chunks_carry_no_autograd_history(any_devices: list[DeviceLike]) -> None:
    tensor = rand((8, 3), device=any_devices[0]).requires_grad_()
    for chunk in comm.scatter(tensor, any_devices):
        assert chunk.grad_fn is None
        if chunk.device != tensor.device:
            # A copy: detached. (A view on the source's device shares the
            # source's requires_grad, as views made under no_grad do.)
            assert not chunk.requires_grad


def test_scatter_keeps_channels_last(any_devices: list[DeviceLike]) -> None:
    tensor = rand((8, 3, 4, 5), device=any_devices[0]).contiguous(memory_format=torch.channels_last)
    chunks = comm.scatter(tensor, any_devices)
    for chunk in chunks:
        assert chunk.is_contiguous(memory_format=torch.channels_last)
    check_scatter(tensor, chunks, any_devices, balanced(8, len(any_devices)), 0)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_non_contiguous(any_devices: list[DeviceLike], layout: str, dim: int) -> None:
    tensor = non_contiguous_variants(any_devices[0])[layout]
    chunks = comm.scatter(tensor, any_devices, dim=dim)
    check_scatter(tensor, chunks, any_devices, balanced(tensor.size(dim), len(any_devices)), dim)


@pytest.mark.parametrize("shape, dim", [((0, 3), 0), ((0, 3), 1), ((4, 0), 0), ((4, 0), 1)])
def test_scatter_empty_tensor(any_devices: list[DeviceLike], shape: tuple[int, int], dim: int) -> None:
    tensor = torch.empty(shape, device=as_torch_device(any_devices[0]))
    chunks = comm.scatter(tensor, any_devices, dim=dim)
    check_scatter(tensor, chunks, any_devices, balanced(shape[dim], len(any_devices)), dim)


def test_scatter_streams_none(any_devices: list[DeviceLike]) -> None:
    tensor = rand((7, 2), device=any_devices[0])
    chunks = comm.scatter(tensor, any_devices, streams=[None] * len(any_devices))
    check_scatter(tensor, chunks, any_devices, balanced(7, len(any_devices)), 0)


def test_scatter_streams_wrong_length(any_devices: list[DeviceLike]) -> None:
    tensor = rand((7, 2), device=any_devices[0])
    with pytest.raises(RuntimeError, match="one entry of 'streams' per device"):
        comm.scatter(tensor, any_devices, streams=[None] * (len(any_devices) + 1))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_out(any_devices: list[DeviceLike], dim: int) -> None:
    tensor = rand((6, 5), device=any_devices[0])
    sizes = balanced(tensor.size(dim), len(any_devices))
    outs = []
    for device, size in zip(any_devices, sizes):
        shape = list(tensor.shape)
        shape[dim] = size
        outs.append(torch.full(shape, -1.0, device=as_torch_device(device)))
    results = comm.scatter(tensor, out=outs, dim=dim)
    assert isinstance(results, tuple)
    assert len(results) == len(outs)
    for result, out in zip(results, outs):
        assert result is out
    check_scatter(tensor, results, any_devices, sizes, dim)


def test_scatter_out_non_contiguous(any_devices: list[DeviceLike]) -> None:
    tensor = non_contiguous_variants(any_devices[0])["stepped"]  # (4, 6)
    sizes = balanced(4, len(any_devices))
    outs = [torch.zeros(6, s, device=as_torch_device(d)).t() for d, s in zip(any_devices, sizes)]
    comm.scatter(tensor, out=outs, streams=[None] * len(outs))
    check_scatter(tensor, outs, any_devices, sizes, 0)


def test_scatter_out_empty(any_devices: list[DeviceLike]) -> None:
    tensor = torch.empty(0, 3, device=as_torch_device(any_devices[0]))
    outs = [torch.empty(0, 3, device=as_torch_device(d)) for d in any_devices]
    results = comm.scatter(tensor, out=outs)
    assert all(r is o for r, o in zip(results, outs))


def test_scatter_errors() -> None:
    tensor = rand((10, 4))
    cpus = ["cpu"] * 3
    with pytest.raises(RuntimeError, match=r"len\(devices\) = 3, but len\(chunk_sizes\) = 2"):
        comm.scatter(tensor, cpus, chunk_sizes=[5, 5])
    with pytest.raises(RuntimeError, match=r"chunk_sizes\[1\] is -1"):
        comm.scatter(tensor, cpus, chunk_sizes=[6, -1, 5])
    with pytest.raises(RuntimeError, match="sum to 10 .* but they sum to 9"):
        comm.scatter(tensor, cpus, chunk_sizes=[3, 3, 3])
    with pytest.raises(RuntimeError, match="at least one device"):
        comm.scatter(tensor, [])
    with pytest.raises(RuntimeError, match="expected 'devices'"):
        comm.scatter(tensor)
    with pytest.raises(RuntimeError, match="at least one dimension"):
        comm.scatter(torch.tensor(1.0), cpus)
    with pytest.raises(IndexError):
        comm.scatter(tensor, cpus, dim=2)
    with pytest.raises(TypeError, match=r"devices\[2\]"):
        comm.scatter(tensor, ["cpu", "cpu", None])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "chunk_sizes,match",
    [
        ([2.5, 2.5, 2, 2], r"chunk_sizes\[0\]: expected an int, but got float 2\.5"),
        (["2"] * 4, r"chunk_sizes\[0\]: expected an int, but got str '2'"),
        ([2, 2, 2, True], r"chunk_sizes\[3\]: expected an int, but got bool True"),
        (8, r"chunk_sizes: expected a sequence of ints, one per device, but got int 8"),
    ],
)
def test_scatter_chunk_sizes_must_be_ints(chunk_sizes: Any, match: str) -> None:
    # Checked before the C++ int conversion: never truncated (torch's would be).
    with pytest.raises(TypeError, match=match):
        comm.scatter(rand((8, 2)), ["cpu"] * 4, chunk_sizes=chunk_sizes)
    with pytest.raises(TypeError, match=match):
        Scatter.apply(["cpu"] * 4, chunk_sizes, 0, rand((8, 2)))


def test_scatter_takes_numpy_and_torch_integer_chunk_sizes() -> None:
    tensor = rand((8, 2))
    chunks = comm.scatter(tensor, ["cpu"] * 3, chunk_sizes=[np.int64(3), torch.tensor(5), 0])
    assert [c.shape[0] for c in chunks] == [3, 5, 0]
    assert torch.equal(torch.cat(chunks), tensor)


def test_scatter_out_errors() -> None:
    tensor = rand((10, 4))
    with pytest.raises(RuntimeError, match=r"output tensor at index 1 has shape \[5, 3\]"):
        comm.scatter(tensor, out=[torch.empty(5, 4), torch.empty(5, 3)])
    with pytest.raises(RuntimeError, match=r"total size of the output tensors along dim 0 \(9\)"):
        comm.scatter(tensor, out=[torch.empty(5, 4), torch.empty(4, 4)])
    with pytest.raises(RuntimeError, match=r"out\[1\] to have 2 dimensions"):
        comm.scatter(tensor, out=[torch.empty(5, 4), torch.empty(5, 4, 1)])
    with pytest.raises(RuntimeError, match=r"out\[0\] of dtype"):
        comm.scatter(tensor, out=[torch.empty(5, 4, dtype=torch.float64), torch.empty(5, 4)])
    with pytest.raises(RuntimeError, match="'devices' must not be specified"):
        comm.scatter(tensor, ["cpu", "cpu"], out=[torch.empty(5, 4), torch.empty(5, 4)])
    with pytest.raises(RuntimeError, match="'chunk_sizes' must not be specified"):
        comm.scatter(tensor, chunk_sizes=[5, 5], out=[torch.empty(5, 4), torch.empty(5, 4)])
    with pytest.raises(RuntimeError, match="at least one tensor in 'out'"):
        comm.scatter(tensor, out=[])
    with pytest.raises(RuntimeError, match="at least one dimension"):
        comm.scatter(torch.tensor(1.0), out=[torch.empty(1)])
    with pytest.raises(RuntimeError, match="one device type"):
        comm.scatter(tensor, out=[torch.empty(5, 4), torch.empty(5, 4, device="meta")])


# --------------------------------------------------------------------------- gather


def gather_inputs(devices: Sequence[DeviceLike], dim: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Tensors of shape (i+1 along `dim`, else (2, 3, 4)) on devices[i]."""
    inputs = []
    for i, device in enumerate(devices):
        shape = [2, 3, 4]
        shape[dim] = i + 1
        inputs.append(rand(shape, dtype, device, seed=i))
    return inputs


@pytest.mark.parametrize("destination", DESTINATIONS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_gather(any_devices: list[DeviceLike], dim: int, destination: DeviceLike | None) -> None:
    inputs = gather_inputs(any_devices, dim)
    result = comm.gather(inputs, dim=dim, destination=destination)
    assert result.device == expected_destination(destination, as_torch_device(any_devices[0]))
    expected = torch.cat([t.cpu() for t in inputs], dim=dim)
    assert_same_tensor_values(result, expected)
    assert result.is_contiguous()


def test_gather_returns_new_tensor(any_devices: list[DeviceLike]) -> None:
    inputs = [t.requires_grad_() for t in gather_inputs(any_devices, 0)]
    result = comm.gather(inputs)
    assert all(storage_ptr(result) != storage_ptr(t) for t in inputs)
    assert result.grad_fn is None
    assert not result.requires_grad


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.bool])
def test_gather_dtypes(any_devices: list[DeviceLike], dtype: torch.dtype) -> None:
    inputs = gather_inputs(any_devices, 1, dtype)
    result = comm.gather(inputs, dim=1)
    assert_same_tensor_values(result, torch.cat([t.cpu() for t in inputs], dim=1))


@pytest.mark.parametrize("dim", [0, -4])
def test_gather_keeps_channels_last(any_devices: list[DeviceLike], dim: int) -> None:
    inputs = [
        rand((i + 1, 3, 4, 5), device=d, seed=i).contiguous(memory_format=torch.channels_last)
        for i, d in enumerate(any_devices)
    ]
    result = comm.gather(inputs, dim=dim)
    assert result.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(result.cpu(), torch.cat([t.cpu() for t in inputs]))


def test_gather_mixed_formats_is_contiguous(any_devices: list[DeviceLike]) -> None:
    devices = list(any_devices) + [any_devices[0]]  # at least two inputs
    inputs = [rand((2, 3, 4, 5), device=d, seed=i) for i, d in enumerate(devices)]
    inputs[0] = inputs[0].contiguous(memory_format=torch.channels_last)
    result = comm.gather(inputs)
    assert result.is_contiguous()
    assert torch.equal(result.cpu(), torch.cat([t.cpu() for t in inputs]))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_non_contiguous(any_devices: list[DeviceLike], layout: str, dim: int) -> None:
    inputs = [non_contiguous_variants(d)[layout] for d in any_devices]
    result = comm.gather(inputs, dim=dim)
    assert torch.equal(result.cpu(), torch.cat([t.cpu() for t in inputs], dim=dim))


def test_gather_empty_tensors(any_devices: list[DeviceLike]) -> None:
    inputs = [torch.empty(0, 3, device=as_torch_device(d)) for d in any_devices]
    assert comm.gather(inputs).shape == (0, 3)
    assert comm.gather(inputs, dim=1).shape == (0, 3 * len(inputs))
    # Empty chunks among non-empty ones (scatter of fewer rows than devices).
    mixed = [
        rand((1, 3), device=d, seed=i) if i % 2 == 0 else torch.empty(0, 3, device=as_torch_device(d))
        for i, d in enumerate(any_devices)
    ]
    assert torch.equal(comm.gather(mixed).cpu(), torch.cat([t.cpu() for t in mixed]))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_out(any_devices: list[DeviceLike], dim: int) -> None:
    inputs = gather_inputs(any_devices, dim)
    expected = torch.cat([t.cpu() for t in inputs], dim=dim)
    out = torch.full(expected.shape, -1.0, device=as_torch_device(any_devices[-1]))
    result = comm.gather(inputs, dim=dim, out=out)
    assert result is out
    assert torch.equal(out.cpu(), expected)


def test_gather_out_non_contiguous(any_devices: list[DeviceLike]) -> None:
    inputs = [non_contiguous_variants(d)["stepped"] for d in any_devices]
    out = torch.zeros(6, 4 * len(inputs), device=as_torch_device(any_devices[0])).t()
    comm.gather(inputs, out=out)
    assert torch.equal(out.cpu(), torch.cat([t.cpu() for t in inputs]))


def test_scatter_then_gather_round_trip(any_devices: list[DeviceLike]) -> None:
    tensor = rand((9, 4, 3), device=any_devices[0])
    for dim in (0, 1, -1):
        chunks = comm.scatter(tensor, any_devices, dim=dim)
        back = comm.gather(chunks, dim=dim, destination=tensor.device)
        assert torch.equal(back, tensor)


def test_gather_errors() -> None:
    with pytest.raises(RuntimeError, match="at least one tensor"):
        comm.gather([])
    with pytest.raises(
        RuntimeError, match=r"tensors\[0\] has 2 dimensions|as tensors\[0\] does, but tensors\[1\] has 1"
    ):
        comm.gather([torch.zeros(2, 3), torch.zeros(3)])
    with pytest.raises(RuntimeError, match=r"input tensor at index 1 has invalid shape \[2, 4\]"):
        comm.gather([torch.zeros(2, 3), torch.zeros(2, 4)], dim=0)
    with pytest.raises(RuntimeError, match="at least one dimension"):
        comm.gather([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is Double"):
        comm.gather([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(IndexError):
        comm.gather([torch.zeros(2), torch.zeros(2)], dim=1)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        comm.gather([torch.zeros(2), [1.0]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="single tensor"):
        comm.gather(torch.zeros(2, 2))  # type: ignore[arg-type]


def test_gather_out_errors() -> None:
    inputs = [torch.zeros(2, 3), torch.zeros(1, 3)]
    with pytest.raises(RuntimeError, match=r"'out' of shape \[3, 3\].*but it has shape \[4, 3\]"):
        comm.gather(inputs, out=torch.empty(4, 3))
    with pytest.raises(RuntimeError, match="'out' of dtype"):
        comm.gather(inputs, out=torch.empty(3, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="'destination' must not be specified"):
        comm.gather(inputs, destination="cpu", out=torch.empty(3, 3))


# --------------------------------------------------------------------------- errors are clean


ERROR_CALLS: dict[str, Callable[[], Any]] = {
    "broadcast_empty_devices": lambda: comm.broadcast(torch.zeros(2), []),
    "broadcast_out_shape": lambda: comm.broadcast(torch.zeros(2), out=[torch.zeros(3)]),
    "broadcast_coalesced_wrong_device": lambda: comm.broadcast_coalesced([torch.zeros(2, device="meta")], ["cpu"]),
    "reduce_add_shape": lambda: comm.reduce_add([torch.zeros(2), torch.zeros(3)]),
    "reduce_add_coalesced_lengths": lambda: comm.reduce_add_coalesced([[torch.zeros(2)], []]),
    "scatter_chunk_sum": lambda: comm.scatter(torch.zeros(4), ["cpu"] * 2, chunk_sizes=[1, 1]),
    "scatter_out_total": lambda: comm.scatter(torch.zeros(4), out=[torch.zeros(1), torch.zeros(1)]),
    "gather_empty": lambda: comm.gather([]),
    "gather_shape": lambda: comm.gather([torch.zeros(2, 2), torch.zeros(2, 3)]),
    "gather_out_shape": lambda: comm.gather([torch.zeros(2)], out=torch.zeros(3)),
}


@pytest.mark.parametrize("name", list(ERROR_CALLS))
def test_errors_are_runtime_errors_without_cpp_backtrace(name: str) -> None:
    with pytest.raises(RuntimeError) as info:
        ERROR_CALLS[name]()
    message = str(info.value)
    assert message
    assert "Exception raised from" not in message
    assert "frame #" not in message
    assert message.split(":", 1)[0] in {
        "broadcast",
        "broadcast_coalesced",
        "reduce_add",
        "reduce_add_coalesced",
        "scatter",
        "gather",
    }


def test_default_buffer_size_is_exposed() -> None:
    assert comm.DEFAULT_BUFFER_SIZE == dpcore._C.default_bucket_bytes
    assert comm.DEFAULT_BUFFER_SIZE > 0


# --------------------------------------------------------------------------- GIL


def main_thread_iterations_during(call: Callable[[], Any]) -> tuple[int, Any]:
    """Runs `call` in a worker thread and counts the Python loop iterations the
    main thread makes until the worker is done; returns (iterations, result).

    The main thread waits until the worker is about to call, and the switch
    interval is long, so the main thread can only get the GIL before the
    worker finishes if the worker releases it voluntarily, i.e. if the C++
    call releases the GIL. Held GIL: 0 iterations. The main loop's sleep(0)
    hands the GIL back as soon as the worker returns from C++.
    """
    started = threading.Event()
    done = [False]
    outcome: list[Any] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            started.set()
            outcome.append(call())
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)
        finally:
            done[0] = True

    previous = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        iterations = 0
        while not done[0]:
            iterations += 1
            time.sleep(0)
        thread.join()
    finally:
        sys.setswitchinterval(previous)
    if errors:
        raise errors[0]
    return iterations, outcome[0]


BIG = 16 * 1024 * 1024  # float32 elements: 64 MiB


def _gil_broadcast() -> None:
    source = torch.ones(BIG)
    iterations, results = main_thread_iterations_during(lambda: comm.broadcast(source, ["cpu", "cpu"]))
    assert iterations > 0, "the main thread never ran during broadcast: the GIL was held"
    assert results[0] is source
    assert results[1].data_ptr() != source.data_ptr()
    assert bool(torch.all(results[1] == 1))


def _gil_broadcast_coalesced() -> None:
    source = torch.ones(BIG)
    iterations, results = main_thread_iterations_during(lambda: comm.broadcast_coalesced([source], ["cpu", "cpu"]))
    assert iterations > 0, "the main thread never ran during broadcast_coalesced: the GIL was held"
    assert bool(torch.all(results[1][0] == 1))


def _gil_reduce_add() -> None:
    inputs = [torch.ones(BIG // 2), torch.full((BIG // 2,), 2.0)]
    iterations, result = main_thread_iterations_during(lambda: comm.reduce_add(inputs))
    assert iterations > 0, "the main thread never ran during reduce_add: the GIL was held"
    assert bool(torch.all(result == 3))


def _gil_reduce_add_coalesced() -> None:
    inputs = [[torch.ones(BIG // 2)], [torch.full((BIG // 2,), 2.0)]]
    iterations, result = main_thread_iterations_during(lambda: comm.reduce_add_coalesced(inputs))
    assert iterations > 0, "the main thread never ran during reduce_add_coalesced: the GIL was held"
    assert bool(torch.all(result[0] == 3))


def _gil_scatter_out() -> None:
    source = torch.ones(BIG)
    outs = [torch.empty(BIG // 2), torch.empty(BIG // 2)]
    iterations, result = main_thread_iterations_during(lambda: comm.scatter(source, out=outs))
    assert iterations > 0, "the main thread never ran during scatter: the GIL was held"
    assert all(bool(torch.all(o == 1)) for o in result)


def _gil_gather() -> None:
    inputs = [torch.ones(BIG // 2), torch.ones(BIG // 2)]
    iterations, result = main_thread_iterations_during(lambda: comm.gather(inputs))
    assert iterations > 0, "the main thread never ran during gather: the GIL was held"
    assert result.shape == (BIG,)
    assert bool(torch.all(result == 1))


GIL_CHECKS: dict[str, Callable[[], None]] = {
    "broadcast": _gil_broadcast,
    "broadcast_coalesced": _gil_broadcast_coalesced,
    "reduce_add": _gil_reduce_add,
    "reduce_add_coalesced": _gil_reduce_add_coalesced,
    "scatter_out": _gil_scatter_out,
    "gather": _gil_gather,
}


@pytest.mark.serial
@pytest.mark.parametrize("op", list(GIL_CHECKS))
def test_gil_released_during_collective(op: str) -> None:
    GIL_CHECKS[op]()


@pytest.mark.serial
def test_gil_probe_detects_a_held_gil() -> None:
    """The probe itself: a call that holds the GIL (pure Python busy work,
    which never releases it voluntarily with a long switch interval) lets the
    main thread make no progress, so the probe can fail."""

    def busy() -> int:
        total = 0
        for i in range(200_000):
            total += i
        return total

    iterations, result = main_thread_iterations_during(busy)
    assert result == sum(range(200_000))
    assert iterations == 0


# --------------------------------------------------------------------------- CUDA-only behaviours


def test_cuda_gather_to_cpu_and_broadcast_from_cpu(cuda_devices: list[DeviceLike]) -> None:
    inputs = gather_inputs(cuda_devices, 0)
    result = comm.gather(inputs, destination=-1)
    assert result.device == torch.device("cpu")
    assert torch.equal(result, torch.cat([t.cpu() for t in inputs]))
    source = rand((3, 3))
    copies = comm.broadcast(source, cuda_devices)
    for device, copy in zip(cuda_devices, copies):
        assert copy.device == as_torch_device(device)
        assert torch.equal(copy.cpu(), source)


def test_cuda_scatter_on_given_streams(cuda_devices: list[DeviceLike]) -> None:
    tensor = rand((8, 4), device=cuda_devices[0])
    streams = [torch.cuda.Stream(device=as_torch_device(d)) for d in cuda_devices]
    torch.cuda.synchronize()  # the side streams must not race the tensor's creation
    chunks = comm.scatter(tensor, cuda_devices, streams=streams)
    torch.cuda.synchronize()
    check_scatter(tensor, chunks, cuda_devices, balanced(8, len(cuda_devices)), 0)


def test_cuda_mixed_device_types(cuda_devices: list[DeviceLike]) -> None:
    with pytest.raises(RuntimeError, match=r"one device type.*devices\[1\] is cpu"):
        comm.broadcast(rand((2,), device=cuda_devices[0]), [0, "cpu"])
