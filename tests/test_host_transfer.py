"""Host transfers: scatter of a CPU batch to a device list and gather of device
tensors back to the CPU.

On CUDA lists these go through dpcore's ring of pinned staging buffers
(csrc/dpcore/cuda/host_staging.cpp) for pageable tensors of at least 1 MiB,
and straight through for pinned or small ones; the payloads below cross
every one of those cases, including transfers longer than the whole ring
(4 slots of 8 MiB) and views whose bytes are not in the destination's order.
On CPU lists the same bodies check the same contract through the CPU path.
"""

from __future__ import annotations

import pytest
import torch

from dpcore import comm
from conftest import DeviceLike, as_torch_device, requires_cuda

MiB = 1024 * 1024

# (rows, columns) of float32 payloads: empty, tiny (direct copies), just over
# the 1 MiB staging threshold, and 40 MiB (more than the 32 MiB ring).
SHAPES = [(0, 16), (7, 3), (4, 300_000), (40, 256 * 1024)]
SHAPE_IDS = ["empty", "tiny", "1MiB", "40MiB"]


def host_batch(shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A pageable CPU tensor whose every element differs from its neighbours'."""
    rows, cols = shape
    return torch.arange(rows * cols, dtype=torch.float64).remainder_(1009).reshape(rows, cols).to(dtype)


def expected_chunks(batch: torch.Tensor, count: int, dim: int = 0) -> list[torch.Tensor]:
    size = batch.size(dim)
    sizes = [size // count + (1 if i < size % count else 0) for i in range(count)]
    return list(batch.split(sizes, dim))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_scatter_from_host(any_devices: list[DeviceLike], shape: tuple[int, int]) -> None:
    batch = host_batch(shape)
    chunks = comm.scatter(batch, any_devices)
    assert len(chunks) == len(any_devices)
    for chunk, want, device in zip(chunks, expected_chunks(batch, len(any_devices)), any_devices):
        assert chunk.device == as_torch_device(device)
        assert chunk.shape == want.shape
        torch.testing.assert_close(chunk.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool])
def test_scatter_from_host_dtypes(any_devices: list[DeviceLike], dtype: torch.dtype) -> None:
    batch = host_batch((64, 80_000), dtype=dtype)  # chunks of 1.2 MiB or more: staged on CUDA
    for chunk, want in zip(comm.scatter(batch, any_devices), expected_chunks(batch, len(any_devices))):
        assert chunk.dtype == dtype
        assert torch.equal(chunk.cpu(), want)


def test_scatter_from_host_along_dim_1(any_devices: list[DeviceLike]) -> None:
    # Chunks along dim 1 are not dense: each is packed into its own order first.
    batch = host_batch((300, 4 * 1000))
    chunks = comm.scatter(batch, any_devices, dim=1)
    for chunk, want in zip(chunks, expected_chunks(batch, len(any_devices), dim=1)):
        assert torch.equal(chunk.cpu(), want)


def test_scatter_from_host_keeps_channels_last(any_devices: list[DeviceLike]) -> None:
    batch = host_batch((8, 3 * 64 * 64 * 4)).reshape(8, 3 * 4, 64, 64).contiguous(memory_format=torch.channels_last)
    chunks = comm.scatter(batch, any_devices)
    for chunk, want in zip(chunks, expected_chunks(batch, len(any_devices))):
        assert chunk.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(chunk.cpu(), want)


def test_scatter_out_from_host_into_other_layouts(any_devices: list[DeviceLike]) -> None:
    # Contiguous source, transposed (dense, other order) and strided (not
    # dense) outs: the bytes cannot be moved as they are.
    batch = host_batch((len(any_devices) * 16, 50_000))
    outs = []
    for i, device in enumerate(any_devices):
        d = as_torch_device(device)
        if i % 2 == 0:
            outs.append(torch.empty(50_000, 16, device=d).t())
        else:
            outs.append(torch.empty(16, 100_000, device=d)[:, ::2])
    comm.scatter(batch, out=outs)
    for out, want in zip(outs, batch.split(16)):
        assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_gather_to_host(any_devices: list[DeviceLike], shape: tuple[int, int]) -> None:
    batch = host_batch(shape)
    chunks = [c.to(as_torch_device(d)) for c, d in zip(expected_chunks(batch, len(any_devices)), any_devices)]
    result = comm.gather(chunks, destination="cpu")
    assert result.device.type == "cpu"
    assert torch.equal(result, batch)


def test_gather_to_host_along_dim_1_and_transposed_inputs(any_devices: list[DeviceLike]) -> None:
    # Slices along dim 1 of the result are not dense, and the transposed
    # inputs are dense in the other order: both go through host copies.
    batch = host_batch((200, len(any_devices) * 3000))
    wants = expected_chunks(batch, len(any_devices), dim=1)
    chunks = [w.t().contiguous().to(as_torch_device(d)).t() for w, d in zip(wants, any_devices)]
    assert torch.equal(comm.gather(chunks, dim=1, destination="cpu"), batch)


def test_gather_out_to_host(any_devices: list[DeviceLike]) -> None:
    batch = host_batch((40, 256 * 1024))
    chunks = [c.to(as_torch_device(d)) for c, d in zip(expected_chunks(batch, len(any_devices)), any_devices)]
    out = torch.zeros_like(batch)
    comm.gather(chunks, out=out)
    assert torch.equal(out, batch)  # read at once: the data has landed


def test_host_transfers_resolve_lazy_conjugate_and_negative_views(any_devices: list[DeviceLike]) -> None:
    # Their bytes are not their values: moved as values, never as bytes.
    real = host_batch((32, 70_000))
    lazy = {
        "conj": torch.complex(real, real + 0.5).conj(),
        "neg": torch._neg_view(real),
    }
    for kind, view in lazy.items():
        values = view.resolve_conj().resolve_neg()
        chunks = comm.scatter(view, any_devices)
        for chunk, want in zip(chunks, expected_chunks(values, len(any_devices))):
            assert torch.equal(chunk.resolve_conj().resolve_neg().cpu(), want), kind
        devices = [as_torch_device(d) for d in any_devices]
        parts = [w.to(d) for w, d in zip(expected_chunks(values, len(any_devices)), devices)]
        lazy_parts = [p.conj() if kind == "conj" else torch._neg_view(p.neg()) for p in parts]
        gathered = comm.gather(lazy_parts, destination="cpu")
        want = values.conj().resolve_conj() if kind == "conj" else values
        assert torch.equal(gathered.resolve_conj().resolve_neg(), want), kind


def test_scatter_gather_host_round_trip_dtypes(any_devices: list[DeviceLike]) -> None:
    for dtype in (torch.float16, torch.int32, torch.bool):
        batch = host_batch((32, 70_000), dtype=dtype)
        assert torch.equal(comm.gather(comm.scatter(batch, any_devices), destination="cpu"), batch)


# --------------------------------------------------------------- CUDA only:
# pinned host memory and stream semantics, which have no CPU counterpart
# beyond the tests above (CPU copies are synchronous, CPU memory is not
# pinned, and a CPU chunk is a view of the source).


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_scatter_from_pinned_host(cuda_devices: list[DeviceLike], shape: tuple[int, int]) -> None:
    batch = host_batch(shape).pin_memory()
    chunks = comm.scatter(batch, cuda_devices)
    for chunk, want, device in zip(chunks, expected_chunks(batch, len(cuda_devices)), cuda_devices):
        assert chunk.device == as_torch_device(device)
        assert torch.equal(chunk.cpu(), want)


def test_cuda_gather_out_to_pinned_host(cuda_devices: list[DeviceLike]) -> None:
    batch = host_batch((40, 256 * 1024))
    chunks = [c.to(as_torch_device(d)) for c, d in zip(expected_chunks(batch, len(cuda_devices)), cuda_devices)]
    out = torch.zeros_like(batch).pin_memory()
    comm.gather(chunks, out=out)
    assert torch.equal(out, batch)  # read at once: the data has landed


def test_cuda_scatter_from_host_source_reusable_at_once(cuda_devices: list[DeviceLike]) -> None:
    # The host side is done with a pageable source when scatter returns:
    # changing it then must not change the scattered values.
    batch = host_batch((40, 256 * 1024))
    want = [c.clone() for c in expected_chunks(batch, len(cuda_devices))]
    chunks = comm.scatter(batch, cuda_devices)
    batch.fill_(-1)
    for chunk, expected in zip(chunks, want):
        assert torch.equal(chunk.cpu(), expected)


@requires_cuda
@pytest.mark.cuda
def test_cuda_scatter_from_host_visible_on_non_default_caller_stream() -> None:
    batch = host_batch((40, 256 * 1024))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chunks = comm.scatter(batch, [0, 0, 0, 0])
        # Read at once on the caller's stream: it must wait for the copies.
        copies = [c.clone() for c in chunks]
    stream.synchronize()
    for copy, want in zip(copies, expected_chunks(batch, 4)):
        assert torch.equal(copy.cpu(), want)


@requires_cuda
@pytest.mark.cuda
def test_cuda_scatter_out_from_host_waits_for_callers_pending_work() -> None:
    # The caller's stream still has a write to the outs queued (behind a
    # sleep): the copies must land after it, not be overwritten by it.
    batch = host_batch((40, 256 * 1024))
    outs = [torch.empty(10, 256 * 1024, device="cuda:0") for _ in range(4)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        for out in outs:
            out.fill_(-1)
        comm.scatter(batch, out=outs)
        copies = [o.clone() for o in outs]
    stream.synchronize()
    for copy, want in zip(copies, batch.split(10)):
        assert torch.equal(copy.cpu(), want)


@requires_cuda
@pytest.mark.cuda
def test_cuda_gather_to_host_waits_for_producers_on_caller_stream() -> None:
    batch = host_batch((40, 256 * 1024))
    wants = expected_chunks(batch, 4)
    chunks = [torch.zeros(w.shape, device="cuda:0") for w in wants]
    values = [w.to("cuda:0") for w in wants]
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the values arrive late on this stream
        for chunk, value in zip(chunks, values):
            chunk.copy_(value)
        result = comm.gather(chunks, destination="cpu")
    assert torch.equal(result, batch)


@requires_cuda
@pytest.mark.cuda
def test_cuda_scatter_from_host_on_given_streams() -> None:
    batch = host_batch((40, 256 * 1024))
    streams = [torch.cuda.Stream() for _ in range(4)]
    chunks = comm.scatter(batch, [0, 0, 0, 0], streams=streams)
    for stream in streams:
        stream.synchronize()
    for chunk, want in zip(chunks, expected_chunks(batch, 4)):
        assert torch.equal(chunk.cpu(), want)


@requires_cuda
@pytest.mark.cuda
def test_cuda_host_transfers_from_threads() -> None:
    # Concurrent callers share the ring; each must get its own data.
    from concurrent.futures import ThreadPoolExecutor

    batches = [host_batch((40, 64 * 1024)).add_(i) for i in range(4)]

    def round_trip(batch: torch.Tensor) -> bool:
        chunks = comm.scatter(batch, [0, 0])
        return torch.equal(comm.gather(chunks, destination="cpu"), batch)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, batches * 3))


@requires_cuda
@pytest.mark.cuda
def test_cuda_results_in_host_memory_have_landed_when_returned() -> None:
    # The device is kept busy (a sleep queued ahead of every copy): whatever
    # a call returns in host memory, pinned or not, must already hold the data.
    x = torch.arange(3 * 1024 * 1024, dtype=torch.float32, device="cuda:0")
    want = x.cpu()

    def busy() -> None:
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)

    busy()
    assert torch.equal(torch.cat(comm.scatter(x, ["cpu", "cpu"])), want)
    busy()
    assert torch.equal(comm.reduce_add([x, x], destination="cpu"), 2 * want)
    busy()
    assert torch.equal(comm.reduce_add_coalesced([[x], [x]], destination="cpu")[0], 2 * want)
    pinned = torch.zeros_like(want).pin_memory()
    busy()
    comm.broadcast(x, out=[pinned])
    assert torch.equal(pinned, want)
    pinned.zero_()
    busy()
    comm.scatter(x, out=[pinned])
    assert torch.equal(pinned, want)
