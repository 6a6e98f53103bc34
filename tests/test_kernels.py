"""The kernels as operators (torch.ops.dpcore.pack / pack_multi / unpack / reduce_add_n):
the CPU implementation against plain torch for every dtype, odd sizes,
misaligned views and many tiny tensors; the CUDA implementation against the
CPU reference (skips only without a GPU); torch.library.opcheck on CPU (and
CUDA when present)."""

from __future__ import annotations

import pytest
import torch

import dpcore  # noqa: F401  (registers torch.ops.dpcore)
from conftest import requires_cuda

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
SIZES = [0, 1, 7, 2**20 + 3]
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])]


def _values(n: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Small exact integers (exact in every dtype used), pseudo-random."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (n,), generator=g).to(dtype).to(device)


def _reference_sum(sources: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    acc = torch.zeros(sources[0].shape, dtype=torch.float64)
    for s in sources:
        acc += s.cpu().double()
    if out is not None:
        acc += out.cpu().double()
    return acc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [1, 2, 4, 9])
@pytest.mark.parametrize("accumulate", [False, True])
def test_reduce_add_n_matches_reference(device: str, dtype: torch.dtype, n: int, k: int, accumulate: bool) -> None:
    if n > 1000 and k > 4:
        k = 4  # keeps the large case quick; k = 9 (more than one CUDA launch's 8 sources) runs on small sizes
    sources = [_values(n, dtype, device, seed) for seed in range(k)]
    out = _values(n, dtype, device, 99)
    expected = _reference_sum(sources, out if accumulate else None)
    torch.ops.dpcore.reduce_add_n(sources, out, accumulate)
    assert out.dtype == dtype and out.device.type == device
    assert torch.equal(out.cpu().double(), expected.to(dtype).double())


@pytest.mark.parametrize("device", DEVICES)
def test_reduce_add_n_half_accumulates_in_float(device: str) -> None:
    step = 2.0**-11  # below float16's resolution at 1.0: summed in half, each add is lost
    sources = [torch.ones(64, dtype=torch.float16, device=device)] + [
        torch.full((64,), step, dtype=torch.float16, device=device) for _ in range(4)
    ]
    out = torch.empty(64, dtype=torch.float16, device=device)
    torch.ops.dpcore.reduce_add_n(sources, out, False)
    assert out[0].item() == pytest.approx(1.0 + 4 * step, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, big", [(torch.float16, 2048.0), (torch.bfloat16, 256.0)])
@pytest.mark.parametrize("k", [9, 17, 40])
@pytest.mark.parametrize("accumulate", [False, True])
def test_reduce_add_n_half_accumulates_in_float_across_all_sources(
    device: str, dtype: torch.dtype, big: float, k: int, accumulate: bool
) -> None:
    # big + 1 lies halfway between two neighbours of `big` in dtype (their
    # spacing there is 2): rounded after the first sources it becomes big,
    # and the last source (-big) leaves 0 instead of the exact 1. Both the
    # CPU passes and the CUDA kernel must round once, after all k sources.
    n = 4 * 1000 + 3  # vector path and tail
    values = [big, 1.0] + [0.0] * (k - 3) + [-big]
    sources = [torch.full((n,), v, dtype=dtype, device=device) for v in values]
    out = torch.full((n,), 0.0, dtype=dtype, device=device)
    torch.ops.dpcore.reduce_add_n(sources, out, accumulate)
    assert torch.equal(out.cpu(), torch.ones(n, dtype=dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_reduce_add_n_misaligned_and_strided_views(device: str) -> None:
    base = [_values(4 * 1001, torch.float32, device, s) for s in range(3)]
    # Offset by one element: not 16-byte aligned, so the vector path must not be taken.
    sources = [b[1:1001] for b in base]
    out = torch.empty(4 * 1001, device=device)[3:1003]
    torch.ops.dpcore.reduce_add_n(sources, out, False)
    assert torch.equal(out.cpu().double(), _reference_sum(sources, None))
    # Strided (non-dense) views take the ATen path.
    strided = [b[::4] for b in base]
    out2 = torch.empty(strided[0].shape, device=device)
    torch.ops.dpcore.reduce_add_n(strided, out2, False)
    assert torch.equal(out2.cpu().double(), _reference_sum(strided, None))


def _tensor_list(device: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Odd sizes, a misaligned view, a transposed and a channels_last tensor."""
    big = _values(2**20 + 3, dtype, device, 1)
    return [
        _values(0, dtype, device, 2),
        _values(1, dtype, device, 3),
        _values(7, dtype, device, 4),
        big[1:],  # misaligned
        _values(12, dtype, device, 5).view(3, 4).t(),
        _values(2 * 3 * 4 * 5, dtype, device, 6).view(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        _values(40, dtype, device, 7)[::3],  # not dense: packed in contiguous order
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_round_trip(device: str, dtype: torch.dtype) -> None:
    tensors = _tensor_list(device, dtype)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    torch.ops.dpcore.pack(tensors, flat)
    # Dense tensors are stored in memory order, others in logical order; the
    # views that unflatten returns give every value back.
    views = dpcore._C.unflatten(flat, tensors)
    for t, v in zip(tensors, views):
        assert torch.equal(v.cpu(), t.cpu())
    outs = [torch.zeros_like(t) for t in tensors]
    torch.ops.dpcore.unpack(flat, outs)
    for t, o in zip(tensors, outs):
        assert torch.equal(o.cpu(), t.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 3])
def test_unflatten_views_match_as_strided_and_are_independent(device: str, offset: int) -> None:
    # The views unflatten builds directly (no dispatcher call each) are what
    # as_strided on the flat buffer would give: shape, strides (channels_last
    # and transposed kept, non-dense members contiguous), storage offset,
    # dtype, device; each has its own version counter and no history.
    tensors = _tensor_list(device, torch.float32)
    n = sum(t.numel() for t in tensors)
    flat = torch.zeros(n + offset, device=device)[offset:]
    views = dpcore._C.unflatten(flat, tensors)
    position = 0
    for i, (t, v) in enumerate(zip(tensors, views)):
        # _tensor_list's last member is its only non-dense one.
        stride = torch.empty(t.shape).stride() if i == len(tensors) - 1 else t.stride()
        expected = flat.as_strided(t.shape, stride, flat.storage_offset() + position)
        assert (v.shape, v.stride(), v.storage_offset(), v.dtype, v.device) == (
            expected.shape,
            expected.stride(),
            expected.storage_offset(),
            expected.dtype,
            expected.device,
        )
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert v.grad_fn is None and not v._is_view()
        position += t.numel()
    versions = [v._version for v in views]
    flat_version = flat._version
    for i, v in enumerate(views):
        if v.numel() == 0:
            continue
        before = [w.clone() for w in views]
        v.fill_(i + 1)
        assert torch.all(v == i + 1)
        for j, w in enumerate(views):
            if j != i:
                assert torch.equal(w, before[j]), (i, j)
                assert w._version == versions[j], (i, j)
        versions[i] = v._version
    assert flat._version == flat_version


@pytest.mark.parametrize("device", DEVICES)
def test_pack_many_tiny_tensors_matches_cat(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3500, generator=g).to(device) for _ in range(3000)]
    flat = torch.empty(3000 * 3500, device=device)
    torch.ops.dpcore.pack(tensors, flat)
    assert torch.equal(flat.cpu(), torch.cat([t.cpu() for t in tensors]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_pack_unpack_many_tensors_of_mixed_sizes(device: str, dtype: torch.dtype) -> None:
    # More tensors and chunks than one launch's kernel arguments hold (the
    # CUDA table path), odd sizes (misaligned slots), tensors over the 64 KiB
    # chunk and empty ones. Two calls back to back with different values
    # check that the second call's table does not disturb the first.
    g = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in torch.randint(0, 300, (400,), generator=g)] + [70_001, 0, 3, 200_000]
    for round_ in range(2):
        tensors = [torch.randint(0, 100, (n,), generator=g).to(dtype).to(device) for n in sizes]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        torch.ops.dpcore.pack(tensors, flat)
        outs = [torch.zeros_like(t) for t in tensors]
        torch.ops.dpcore.unpack(flat, outs)
        assert torch.equal(flat.cpu(), torch.cat([t.cpu() for t in tensors])), f"round {round_}"
        for i, (t, o) in enumerate(zip(tensors, outs)):
            assert torch.equal(o.cpu(), t.cpu()), f"round {round_}, tensor {i}"


def _lazy_views(device: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(view with a lazy bit, the same values materialised): a conjugate view
    of a complex tensor and a negative view of a real one, whose bytes are
    not their values."""
    z = torch.complex(torch.arange(12.0), torch.arange(12.0) + 0.5).reshape(3, 4).to(device)
    x = torch.arange(12.0).reshape(3, 4).to(device)
    conj = z.conj()
    neg = torch._neg_view(x)
    assert conj.is_conj() and neg.is_neg()
    return {"conj": (conj, conj.resolve_conj()), "neg": (neg, neg.resolve_neg())}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_kernels_resolve_lazy_conjugate_and_negative_views(device: str, kind: str) -> None:
    view, values = _lazy_views(device)[kind]
    # pack and unpack: values, not bytes.
    flat = torch.empty(2 * values.numel(), dtype=values.dtype, device=device)
    torch.ops.dpcore.pack([view, values], flat)
    assert torch.equal(flat.cpu(), torch.cat([values.flatten(), values.flatten()]).cpu())
    back = torch.zeros_like(values)
    torch.ops.dpcore.unpack(flat[: values.numel()], [back])
    assert torch.equal(back, values)
    # reduce_add_n with a lazy source, and into a lazy out.
    out = torch.empty_like(values)
    torch.ops.dpcore.reduce_add_n([view, values], out, False)
    assert torch.equal(out, 2 * values)
    base = values.clone()
    lazy_out = base.conj() if kind == "conj" else torch._neg_view(base)
    before = lazy_out.resolve_conj().resolve_neg().clone()
    torch.ops.dpcore.reduce_add_n([values], lazy_out, True)
    assert torch.equal(lazy_out.resolve_conj().resolve_neg(), before + values)


def _packed(tensors: list[torch.Tensor], device: str) -> torch.Tensor:
    """The reference: one pack of `tensors` into a new flat buffer."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=device)
    torch.ops.dpcore.pack(tensors, flat)
    return flat


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes on the CPU (bitwise comparisons: NaN, -0.0)."""
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 3, 17])
def test_pack_multi_equals_separate_packs(device: str, dtype: torch.dtype, k: int) -> None:
    # Mixed and odd sizes, an empty tensor, a misaligned view, a transposed,
    # a channels_last and a non-dense member; 17 flats: more destinations
    # than one CUDA launch writes.
    tensors = _tensor_list(device, dtype)
    expected = _packed(tensors, device)
    flats = [torch.full_like(expected, 3) for _ in range(k)]
    torch.ops.dpcore.pack_multi(tensors, flats)
    for flat in flats:
        assert torch.equal(_bits(flat), _bits(expected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 4])
def test_pack_multi_many_tensors_of_mixed_sizes(device: str, k: int) -> None:
    # 3000 tensors: more ranges than the CUDA kernel's arguments hold (the
    # range table path); sizes cross the 64 KiB chunk and 256 KiB group limits.
    sizes = [(i * 7919) % 70000 if i % 50 == 0 else (i * 31) % 3500 for i in range(3000)]
    tensors = [_values(n, torch.float32, device, i) for i, n in enumerate(sizes)]
    expected = torch.cat([t.reshape(-1) for t in tensors])
    flats = [torch.empty_like(expected) for _ in range(k)]
    torch.ops.dpcore.pack_multi(tensors, flats)
    for flat in flats:
        assert torch.equal(flat, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_multi_misaligned_flats_and_special_values(device: str) -> None:
    # Flats at different alignments (views one element in): the vector path
    # must only be taken when every destination is aligned; NaN payloads
    # and -0.0 come through bit for bit.
    values = _values(4 * 1000 + 3, torch.float32, device, 1)
    values[::7] = float("nan")
    values[1::7] = -0.0
    tensors = [values, _values(5, torch.float32, device, 2)]
    n = values.numel() + 5
    flats = [
        torch.empty(n, device=device),
        torch.empty(n + 1, device=device)[1:],
        torch.empty(n + 3, device=device)[3:],
    ]
    torch.ops.dpcore.pack_multi(tensors, flats)
    expected = _packed(tensors, device)
    for flat in flats:
        assert torch.equal(_bits(flat), _bits(expected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_pack_multi_lazy_conj_and_neg_members(device: str, kind: str) -> None:
    # A member with a lazy bit is written by value (not by bytes) into every flat.
    base = torch.complex(_values(6, torch.float32, device, 1), _values(6, torch.float32, device, 2))
    lazy = base.conj() if kind == "conj" else torch._neg_view(base)
    plain = base * 2
    flats = [torch.empty(12, dtype=torch.complex64, device=device) for _ in range(3)]
    torch.ops.dpcore.pack_multi([lazy, plain], flats)
    expected = torch.cat([lazy.resolve_conj().resolve_neg(), plain])
    for flat in flats:
        assert torch.equal(flat, expected)


def test_pack_multi_only_empty_tensors() -> None:
    flats = [torch.empty(0), torch.empty(0)]
    torch.ops.dpcore.pack_multi([torch.empty(0), torch.empty(3, 0)], flats)
    torch.ops.dpcore.pack_multi([], [torch.empty(0)])


def test_pack_multi_errors_name_the_flat() -> None:
    tensors = [torch.ones(3), torch.ones(2)]
    with pytest.raises(RuntimeError, match=r"pack_multi: expected at least one tensor in 'flats'"):
        torch.ops.dpcore.pack_multi(tensors, [])
    with pytest.raises(RuntimeError, match=r"expected flats\[1\] to have 5 elements, but it has 6"):
        torch.ops.dpcore.pack_multi(tensors, [torch.empty(5), torch.empty(6)])
    with pytest.raises(RuntimeError, match=r"expected flats\[2\] of dtype Float, but it is Double"):
        torch.ops.dpcore.pack_multi(tensors, [torch.empty(5), torch.empty(5), torch.empty(5, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=r"expected flats\[1\] to be a contiguous 1-D tensor"):
        torch.ops.dpcore.pack_multi(tensors, [torch.empty(5), torch.empty(10)[::2]])


@requires_cuda
@pytest.mark.cuda
def test_cuda_matches_cpu_reference() -> None:
    cpu = _tensor_list("cpu", torch.float32)
    cuda = [t.cuda() for t in cpu]
    flat_cpu = torch.empty(sum(t.numel() for t in cpu))
    flat_cuda = torch.empty(flat_cpu.numel(), device="cuda")
    torch.ops.dpcore.pack(cpu, flat_cpu)
    torch.ops.dpcore.pack(cuda, flat_cuda)
    assert torch.equal(flat_cuda.cpu(), flat_cpu)


def test_errors_name_the_argument() -> None:
    with pytest.raises(RuntimeError, match="expected 'flat' to have 6 elements"):
        torch.ops.dpcore.pack([torch.ones(3), torch.ones(3)], torch.empty(5))
    with pytest.raises(RuntimeError, match=r"sources\[1\] of shape"):
        torch.ops.dpcore.reduce_add_n([torch.ones(3), torch.ones(4)], torch.empty(3), False)
    with pytest.raises(RuntimeError, match="at least one source"):
        torch.ops.dpcore.reduce_add_n([], torch.empty(3), False)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    tensors = [torch.randn(5, device=device), torch.randn(2, 3, device=device)]
    torch.library.opcheck(torch.ops.dpcore.pack.default, (tensors, torch.empty(11, device=device)))
    torch.library.opcheck(
        torch.ops.dpcore.unpack.default,
        (torch.randn(11, device=device), [torch.empty(5, device=device), torch.empty(2, 3, device=device)]),
    )
    torch.library.opcheck(
        torch.ops.dpcore.pack_multi.default,
        (tensors, [torch.empty(11, device=device) for _ in range(3)]),
    )
    torch.library.opcheck(
        torch.ops.dpcore.reduce_add_n.default,
        ([torch.randn(6, device=device) for _ in range(3)], torch.randn(6, device=device), True),
    )


def test_meta_shapes_trace() -> None:
    """The Meta implementations accept fake tensors of the right shapes and
    reject wrong ones (what torch.compile's tracing relies on)."""
    meta = [torch.empty(5, device="meta"), torch.empty(2, 3, device="meta")]
    torch.ops.dpcore.pack(meta, torch.empty(11, device="meta"))
    with pytest.raises(RuntimeError, match="expected 'flat' to hold every element"):
        torch.ops.dpcore.pack(meta, torch.empty(10, device="meta"))
    torch.ops.dpcore.pack_multi(meta, [torch.empty(11, device="meta"), torch.empty(11, device="meta")])
    with pytest.raises(RuntimeError, match="pack_multi: expected 'flat' to hold every element"):
        torch.ops.dpcore.pack_multi(meta, [torch.empty(11, device="meta"), torch.empty(12, device="meta")])
