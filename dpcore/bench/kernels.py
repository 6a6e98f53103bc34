"""The kernels and host transfers against their baselines, each
measured in the same run:

* reduce_add_n of 4 buffers: GB/s counting bytes read and written, its
  ratio to a device-to-device ``copy_`` of the same traffic, and its speedup
  over the same sum done with torch adds;
* pack of 3000 tensors of 3500 floats: speedup over ``torch.cat`` of their
  flattened views;
* pack_multi of the same tensors, and of one 64 MiB tensor, into 3 flat
  buffers (a broadcast to [d, d, d, d]'s three copies): speedup over 3
  separate packs, and (note) its ratio to ``copy_`` of the bytes written,
  which one read and three writes can beat;
* (CUDA only) scatter of a pageable CPU batch to the device list, as a
  fraction of one pinned host-to-device ``copy_`` of the same bytes, and
  gather back to the CPU against ``torch.cuda.comm.gather(..., destination=-1)``.

    python bench/bench_kernels.py --devices 0,0,0,0 --json out/kernels.json
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.cuda.comm  # the baselines; not an attribute of torch.cuda until imported (torch 2.11)

import dpcore  # noqa: F401  (registers torch.ops.dpcore)
from dpcore import comm
from dpcore.bench._common import bench_command, environment, measure, measure_against

MiB = 1024 * 1024


def run(devices: Sequence[torch.device], quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """Measures the kernels on devices[0] and the host transfers over `devices`."""
    repeats = repeats or (3 if quick else 10)
    first = devices[0]
    cuda = first.type == "cuda"
    rows: list[dict[str, Any]] = []

    def add(name: str, seconds: float, traffic: int | None, baseline: str, base_seconds: float, note: str = "") -> None:
        rows.append(
            {
                "kernel": name,
                "ms": seconds * 1e3,
                "gbps": None if traffic is None else traffic / seconds / 1e9,
                "baseline": baseline,
                "baseline_ms": base_seconds * 1e3,
                "ratio": base_seconds / seconds,
                "note": note,
            }
        )
        print(
            f"  {name}: {seconds * 1e3:.3f} ms; {baseline} {base_seconds * 1e3:.3f} ms; ratio {base_seconds / seconds:.2f}"
        )

    # reduce_add_n: K reads and one write per element.
    nbytes = (64 if quick else 256) * MiB if cuda else (16 if quick else 64) * MiB
    k = 4
    sources = [torch.rand(nbytes // 4, device=first) for _ in range(k)]
    out = torch.empty_like(sources[0])
    traffic = (k + 1) * nbytes
    t_ours = measure(lambda: torch.ops.dpcore.reduce_add_n(sources, out, False), [first], repeats=repeats)
    src = torch.empty(traffic // 2 // 4, device=first)
    dst = torch.empty_like(src)
    t_copy = measure(lambda: dst.copy_(src), [first], repeats=repeats)
    del src, dst

    def torch_adds() -> None:
        torch.add(sources[0], sources[1], out=out)
        for s in sources[2:]:
            out.add_(s)

    t_torch = measure(torch_adds, [first], repeats=repeats)
    add(
        f"reduce_add_n 4 x {nbytes // MiB} MiB",
        t_ours,
        traffic,
        "copy_ of same traffic",
        t_copy,
        f"{t_torch / t_ours:.2f}x torch adds ({t_torch * 1e3:.3f} ms)",
    )
    del sources, out

    # pack of many tiny tensors.
    count = 750 if quick else 3000
    tensors = [torch.randn(3500, device=first) for _ in range(count)]
    flat = torch.empty(count * 3500, device=first)
    t_pack = measure(lambda: torch.ops.dpcore.pack(tensors, flat), [first], repeats=repeats)
    views = [t.view(-1) for t in tensors]
    t_cat = measure(lambda: torch.cat(views), [first], repeats=repeats)
    add(f"pack {count} x 3500 floats", t_pack, 2 * flat.numel() * 4, "torch.cat", t_cat)
    del flat, views

    # pack_multi: one read, three writes.
    big = [torch.randn((16 if quick else 64) * MiB // 4, device=first)]
    for label, members in ((f"{count} x 3500 floats", tensors), (f"1 x {big[0].numel() * 4 // MiB} MiB", big)):
        n = sum(t.numel() for t in members)
        flats = [torch.empty(n, device=first) for _ in range(3)]
        t_multi = measure(lambda: torch.ops.dpcore.pack_multi(members, flats), [first], repeats=repeats)
        t_packs = measure(lambda: [torch.ops.dpcore.pack(members, f) for f in flats], [first], repeats=repeats)
        src = torch.empty(3 * n, device=first)
        dst = torch.empty_like(src)
        t_copy = measure(lambda: dst.copy_(src), [first], repeats=repeats)
        add(
            f"pack_multi {label} -> 3 flats",
            t_multi,
            4 * n * 4,
            "3 packs",
            t_packs,
            f"{t_copy / t_multi:.2f} of a copy_ of the 3 flats' bytes ({t_copy * 1e3:.3f} ms)",
        )
        del flats, src, dst
    del tensors, big

    if cuda:
        nbytes = (64 if quick else 256) * MiB
        batch = torch.randn(nbytes // 4 // 1024, 1024)  # pageable
        pinned = torch.empty_like(batch).pin_memory()
        on_gpu = torch.empty_like(batch, device=first)
        indices = [d.index for d in devices]
        # Host transfers go through dpcore's pinned staging ring; the
        # baselines are one pinned copy_ of the same bytes (the DMA roofline)
        # and torch.cuda.comm on the same pageable tensors.
        t_scatter, t_pinned = measure_against(
            lambda: comm.scatter(batch, devices),
            lambda: on_gpu.copy_(pinned, non_blocking=True),
            devices,
            rounds=3,
            repeats=max(2, repeats // 2),
        )
        t_torch_scatter = measure(lambda: torch.cuda.comm.scatter(batch, indices), devices, repeats=repeats)
        add(
            f"scatter {nbytes // MiB} MiB pageable CPU -> {len(devices)} devices",
            t_scatter,
            nbytes,
            "pinned H2D copy_",
            t_pinned,
            f"{t_torch_scatter / t_scatter:.2f}x torch.cuda.comm.scatter ({t_torch_scatter * 1e3:.3f} ms)",
        )
        del on_gpu
        chunks = comm.scatter(batch, devices)
        pinned_out = torch.empty_like(batch).pin_memory()
        gathered_on_gpu = torch.cat(chunks)
        t_gather, t_pinned_d2h = measure_against(
            lambda: comm.gather(chunks, destination="cpu"),
            lambda: pinned_out.copy_(gathered_on_gpu),
            devices,
            rounds=3,
            repeats=max(2, repeats // 2),
        )
        t_torch_gather = measure(lambda: torch.cuda.comm.gather(chunks, 0, -1), devices, repeats=repeats)
        add(
            f"gather {nbytes // MiB} MiB -> CPU",
            t_gather,
            nbytes,
            "torch.cuda.comm.gather(-1)",
            t_torch_gather,
            f"{t_pinned_d2h / t_gather:.2f} of a pinned D2H copy_ ({t_pinned_d2h * 1e3:.3f} ms)",
        )
    return {"benchmark": "kernels", "devices": [str(d) for d in devices], "env": environment(), "rows": rows}


COLUMNS = [
    ("kernel", "kernel", "s"),
    ("ms", "ms", ".3f"),
    ("gbps", "GB/s", ".1f"),
    ("baseline", "baseline", "s"),
    ("baseline_ms", "baseline ms", ".3f"),
    ("ratio", "x baseline", ".2f"),
    ("note", "note", "s"),
]


main = bench_command("bench_kernels", __doc__, run, COLUMNS)


if __name__ == "__main__":
    main()
