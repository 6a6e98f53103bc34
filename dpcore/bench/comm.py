"""Bandwidth of dpcore's collectives against a copy_ of the same bytes.

For each collective and payload it reports GB/s of memory traffic (bytes
read plus bytes written that the operation must move: a broadcast to K
devices moves the payload K-1 times, a K-way reduce reads K payloads and
writes one, scatter and gather move it once) and the ratio to a ``copy_``
moving the same traffic into a preallocated buffer on the first device,
measured in the same run (a broadcast to repeats of the source's device
reads the source once for all its copies, so it can exceed 1.0); and the
ratio to torch's own path for the same
work (``torch.cuda.comm`` on CUDA; on CPU, torch's flatten/clone/unflatten,
add, split+copy_ and cat).

Under "all_reduce" (devices > 1): the ring all_reduce against the star
DataParallel's default path forms (reduce_add_coalesced onto devices[0],
broadcast_coalesced back) on one tensor per device: time ratio star/ring from
alternating rounds of the same run, and each one's busiest slot in bytes (the
traffic counters: most sent or received by one slot).

    python bench/bench_comm.py --devices cpu:4 --json bench-results/comm.json
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.cuda.comm  # the baselines; not an attribute of torch.cuda until imported (torch 2.11)
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dpcore import comm
from dpcore.bench._common import bench_command, environment, measure, measure_against

MiB = 1024 * 1024


def payloads(quick: bool) -> list[tuple[str, list[int]]]:
    """(name, list of tensor shapes) for case (a), one 64 MiB tensor, and
    case (b), 3000 tensors of 3500 floats. --quick shrinks both by 4x."""
    scale = 4 if quick else 1
    return [
        (f"(a) 1 x {size_label(64 * MiB // scale)}", [16 * MiB // scale]),
        (f"(b) {3000 // scale} x 3500 floats", [3500] * (3000 // scale)),
    ]


def _torch_path(op: str, devices: Sequence[torch.device]) -> Callable[..., Any] | None:
    """torch's implementation of `op` on these devices, or None where torch has none."""
    cuda = devices[0].type == "cuda"
    indices = [d.index for d in devices]
    if op == "broadcast_coalesced":
        if cuda:
            return lambda ts: torch.cuda.comm.broadcast_coalesced(ts, indices)

        def broadcast_cpu(ts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
            flat = _flatten_dense_tensors(ts)
            return [ts] + [list(_unflatten_dense_tensors(flat.clone(), ts)) for _ in devices[1:]]

        return broadcast_cpu
    if op == "reduce_add_coalesced":
        if cuda:
            return lambda lists: torch.cuda.comm.reduce_add_coalesced(lists, indices[0])

        def reduce_cpu(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
            flats = [_flatten_dense_tensors(ts) for ts in lists]
            total = flats[0].clone()
            for flat in flats[1:]:
                total.add_(flat)
            return list(_unflatten_dense_tensors(total, lists[0]))

        return reduce_cpu
    if op == "scatter":
        if cuda:
            return lambda t, outs: torch.cuda.comm.scatter(t, out=outs)

        def scatter_cpu(t: torch.Tensor, outs: list[torch.Tensor]) -> None:
            for out, chunk in zip(outs, t.split([o.shape[0] for o in outs])):
                out.copy_(chunk)

        return scatter_cpu
    if op == "gather":
        if cuda:
            return lambda chunks: torch.cuda.comm.gather(chunks, 0, indices[0])
        return lambda chunks: torch.cat(chunks)
    raise ValueError(op)


def _copy_seconds(
    nbytes: int, device: torch.device, repeats: int, cache: dict[int, float], min_seconds: float = 0.0
) -> float:
    """Time of one copy_ of `nbytes` bytes into a preallocated buffer on `device`."""
    if nbytes not in cache:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        cache[nbytes] = measure(lambda: dst.copy_(src), [device], repeats=repeats, min_seconds=min_seconds)
    return cache[nbytes]


Case = tuple[str, int, Callable[[], Any], Optional[Callable[[], Any]]]


def _cases(devices: Sequence[torch.device], shapes: Sequence[int]) -> tuple[int, list[Case]]:
    """The collectives on a payload of float32 tensors of `shapes` (element
    counts) over `devices`: (payload bytes, [(op, traffic bytes, dpcore call,
    torch's call or None)]). Broadcast is left out on a single device."""
    k = len(devices)
    first = devices[0]
    tensors = [torch.randn(s, device=first) for s in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rows_per_elem = len(shapes) if len(shapes) > 1 else 4096
    batch = torch.randn(rows_per_elem, nbytes // 4 // rows_per_elem, device=first)
    sizes = comm.scatter(batch, devices)
    chunk_rows = [c.shape[0] for c in sizes]
    outs = [torch.empty(r, batch.shape[1], device=d) for r, d in zip(chunk_rows, devices)]
    chunks = [torch.randn(r, batch.shape[1], device=d) for r, d in zip(chunk_rows, devices)]
    lists = [[t.to(d, copy=True) for t in tensors] for d in devices]

    cases: list[Case] = []
    torch_bc = _torch_path("broadcast_coalesced", devices)
    torch_ra = _torch_path("reduce_add_coalesced", devices)
    torch_sc = _torch_path("scatter", devices)
    torch_ga = _torch_path("gather", devices)
    if k > 1:
        cases.append(
            (
                "broadcast_coalesced",
                2 * nbytes * (k - 1),
                lambda: comm.broadcast_coalesced(tensors, devices),
                (lambda: torch_bc(tensors)) if torch_bc else None,
            )
        )
    cases.append(
        (
            "reduce_add_coalesced",
            (k + 1) * nbytes,
            lambda: comm.reduce_add_coalesced(lists, first),
            (lambda: torch_ra(lists)) if torch_ra and k > 1 else None,
        )
    )
    cases.append(
        (
            "scatter (out=)",
            2 * nbytes,
            lambda: comm.scatter(batch, out=outs),
            (lambda: torch_sc(batch, outs)) if torch_sc else None,
        )
    )
    cases.append(
        (
            "gather",
            2 * nbytes,
            lambda: comm.gather(chunks, destination=first),
            (lambda: torch_ga(chunks)) if torch_ga else None,
        )
    )
    return nbytes, cases


def _row(op: str, payload: str, nbytes: int, traffic: int, seconds: float, copy: float) -> dict[str, Any]:
    """One result row: time, GB/s of traffic, and against a copy_ of the same traffic."""
    return {
        "op": op,
        "payload": payload,
        "payload_bytes": nbytes,
        "traffic_bytes": traffic,
        "ms": seconds * 1e3,
        "gbps": traffic / seconds / 1e9,
        "copy_gbps": traffic / copy / 1e9,
        "ratio_to_copy": copy / seconds,
    }


def _busiest_slot(fn: Callable[[], Any]) -> int:
    """The most bytes one slot sent or received in one call of `fn`, all kinds together."""
    comm.reset_traffic()
    fn()
    per_slot: dict[int, list[int]] = {}
    for counts in comm.traffic().values():
        for i, (sent, received) in enumerate(counts):
            per_slot.setdefault(i, [0, 0])
            per_slot[i][0] += sent
            per_slot[i][1] += received
    return max((max(pair) for pair in per_slot.values()), default=0)


def all_reduce_row(devices: Sequence[torch.device], numel: int, repeats: int) -> dict[str, Any]:
    """The ring all_reduce against reduce_add_coalesced + broadcast_coalesced on `numel` floats per device."""
    tensors = [torch.zeros(numel, device=d) for d in devices]  # zeros: repeated in-place sums stay finite
    lists = [[t] for t in tensors]

    def ring() -> None:
        comm.all_reduce(tensors, devices)

    def star() -> None:
        comm.broadcast_coalesced(comm.reduce_add_coalesced(lists, devices[0]), devices)

    ring_s, star_s = measure_against(ring, star, devices, rounds=5, repeats=max(2, repeats // 2))
    return {
        "devices": len(devices),
        "payload_bytes": numel * 4,
        "ring_ms": ring_s * 1e3,
        "star_ms": star_s * 1e3,
        "star_over_ring": star_s / ring_s,
        "ring_busiest_slot_bytes": _busiest_slot(ring),
        "star_busiest_slot_bytes": _busiest_slot(star),
    }


def run(devices: Sequence[torch.device], quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """Measures every collective on `devices`; returns the JSON-ready result."""
    repeats = repeats or (3 if quick else 10)
    first = devices[0]
    rows: list[dict[str, Any]] = []

    for name, shapes in payloads(quick):
        nbytes, cases = _cases(devices, shapes)
        for op, traffic, ours, theirs in cases:
            # The copy_ baseline alternates with the collective, so a noisy
            # neighbour on this shared machine slows both rather than one.
            src = torch.ones(traffic // 2 // 4, device=first)
            dst = torch.empty_like(src)
            seconds, copy = measure_against(
                ours, lambda: dst.copy_(src), devices, rounds=5, repeats=max(2, repeats // 2)
            )
            del src, dst
            torch_seconds = None
            if theirs is not None:
                try:
                    torch_seconds = measure(theirs, devices, repeats=repeats)
                except RuntimeError as error:  # torch's path may refuse repeated devices
                    print(f"  torch path for {op} unavailable here: {error}".splitlines()[0])
            rows.append(_row(op, name, nbytes, traffic, seconds, copy))
            rows[-1]["torch_ms"] = None if torch_seconds is None else torch_seconds * 1e3
            rows[-1]["speedup_vs_torch"] = None if torch_seconds is None else torch_seconds / seconds
            print(f"  {op:22s} {name:24s} {rows[-1]['gbps']:7.2f} GB/s  {rows[-1]['ratio_to_copy']:.2f} of copy_")
    result = {"benchmark": "comm", "devices": [str(d) for d in devices], "env": environment(), "rows": rows}
    if len(devices) > 1:
        row = all_reduce_row(devices, payloads(quick)[0][1][0], repeats)
        print(
            f"  all_reduce ring vs reduce_add+broadcast: {row['star_over_ring']:.2f}x (star/ring time); busiest "
            f"slot {size_label(row['ring_busiest_slot_bytes'])} vs {size_label(row['star_busiest_slot_bytes'])}"
        )
        result["all_reduce"] = row
    return result


def size_label(nbytes: int) -> str:
    """256 KiB, 4 MiB, 1.5 MiB: a byte count for tables and plot axes."""
    for unit, scale in (("GiB", 1024**3), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{nbytes} B"


def sweep_sizes(quick: bool) -> list[int]:
    """Payload sizes of the sweep: 256 KiB to 64 MiB by 4x; --quick: 256 KiB, 2 MiB, 16 MiB."""
    if quick:
        return [256 * 1024, 2 * MiB, 16 * MiB]
    return [256 * 1024, MiB, 4 * MiB, 16 * MiB, 64 * MiB]


def sweep(
    devices: Sequence[torch.device],
    sizes_bytes: Sequence[int],
    repeats: int = 5,
    min_seconds: float = 0.05,
) -> dict[str, Any]:
    """Bandwidth against payload size: for one float32 tensor of each size,
    the GB/s of every collective (as in run(), without torch's path) and of
    a ``copy_`` of the payload on devices[0] (op "copy_", traffic: the payload
    read and written once), the roofline the collectives are plotted
    against. Each measurement runs at least `repeats` times and
    `min_seconds`. Returns {"sizes_bytes", "rows"}."""
    first = devices[0]
    rows: list[dict[str, Any]] = []
    copy_cache: dict[int, float] = {}
    for size in sizes_bytes:
        if size < 4 * 4096 or size % 4:
            raise ValueError(f"sweep: payload sizes must be multiples of 4 bytes and at least 16 KiB, but got {size}")
        name = size_label(size)
        nbytes, cases = _cases(devices, [size // 4])
        copy = _copy_seconds(nbytes, first, repeats, copy_cache, min_seconds)
        rows.append(_row("copy_", name, nbytes, 2 * nbytes, copy, copy))
        for op, traffic, ours, _ in cases:
            seconds = measure(ours, devices, repeats=repeats, min_seconds=min_seconds)
            copy_same = _copy_seconds(traffic // 2, first, repeats, copy_cache, min_seconds)
            rows.append(_row(op, name, nbytes, traffic, seconds, copy_same))
        line = "  ".join(f"{r['op'].split(' ')[0]} {r['gbps']:.2f}" for r in rows if r["payload_bytes"] == nbytes)
        print(f"  {name:>8s}: {line} GB/s", flush=True)
        del cases
    return {"sizes_bytes": list(sizes_bytes), "rows": rows}


COLUMNS = [
    ("op", "op", "s"),
    ("payload", "payload", "s"),
    ("ms", "ms", ".2f"),
    ("gbps", "GB/s", ".2f"),
    ("copy_gbps", "copy_ GB/s", ".2f"),
    ("ratio_to_copy", "x copy_", ".2f"),
    ("torch_ms", "torch ms", ".2f"),
    ("speedup_vs_torch", "x torch", ".2f"),
]

SWEEP_COLUMNS = [
    ("payload", "payload", "s"),
    ("op", "op", "s"),
    ("ms", "ms", ".3f"),
    ("gbps", "GB/s", ".2f"),
    ("copy_gbps", "copy_ GB/s", ".2f"),
    ("ratio_to_copy", "x copy_", ".2f"),
]


main = bench_command("bench_comm", __doc__, run, COLUMNS)


if __name__ == "__main__":
    main()
