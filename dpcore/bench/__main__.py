"""Runs dpcore's benchmarks and writes their results into one folder.

1. comm: the collectives (broadcast_coalesced, reduce_add_coalesced, scatter
   with out=, gather) against a copy_ of the same traffic and torch's own
   path, on a single 64 MiB tensor and on 3000 tensors of 3500 floats;
2. comm sweep: the collectives' bandwidth against payload size for single
   tensors (256 KiB to 64 MiB), with the copy_ of each payload as roofline;
3. step: the steady-state training step of dpcore.DataParallel against the
   same arithmetic without data parallelism (on a CUDA list also with
   ``cuda_graphs=True``; see dpcore/bench/step.py).

Writes comm.json (the comm rows, plus the sweep under "sweep"), step.json
and comm_bandwidth.png (GB/s against payload size) into --out; without
matplotlib, the JSON files and the tables only, with a note that the plot
was skipped.

    python -m dpcore.bench                      # GPU 0 four times (0,0,0,0), else cpu:4
    python -m dpcore.bench --quick              # under a minute on a 2-core CPU machine
    python -m dpcore.bench --devices 0,1 --out results/

The plot needs matplotlib (``pip install matplotlib``, or dpcore's demo
extras: ``pip install --no-build-isolation ".[demo]"`` in the source folder).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


from dpcore.bench import comm as bench_comm
from dpcore.bench import step as bench_step
from dpcore.bench._common import add_devices_argument, default_devices, devices_from_args, print_table, write_json

PLOT_NAME = "comm_bandwidth.png"

#: Printed, and kept in the result's "notes", when matplotlib is missing.
NO_PLOT_NOTE = (
    f"{PLOT_NAME} skipped: matplotlib is not installed (pip install matplotlib, or in the dpcore "
    'source folder pip install --no-build-isolation ".[demo]")'
)
_UNITS = {"": 1, "B": 1, "K": 1024, "KIB": 1024, "M": 1024**2, "MIB": 1024**2, "G": 1024**3, "GIB": 1024**3}


def parse_sizes(spec: str) -> list[int]:
    """'256K,1M,64M' -> byte counts (K, M, G are powers of 1024; KiB, MiB too).

    Raises ValueError naming the option when an entry is malformed or not a
    multiple of 4 bytes of at least 16 KiB (the sweep's smallest payload)."""
    sizes: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", part)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"--sizes: expected sizes such as '256K,1M,64M', but got {part.strip()!r} in {spec!r}")
        size = int(match.group(1)) * _UNITS[unit]
        if size < 16 * 1024 or size % 4:
            raise ValueError(
                f"--sizes: each size must be at least 16K and a multiple of 4 bytes, but got {part.strip()!r}"
            )
        sizes.append(size)
    return sizes


def plot_sweep(sweep: dict[str, Any], title: str, path: Path) -> Path:
    """Draws GB/s against payload size, one line per collective and the copy_
    roofline dashed, into the PNG `path` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep["rows"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for op in ops:
        points = sorted((r["payload_bytes"], r["gbps"]) for r in rows if r["op"] == op)
        xs, ys = zip(*points)
        if op == "copy_":
            ax.plot(xs, ys, "k--", linewidth=2, label="copy_ of the payload (roofline)")
        else:
            ax.plot(xs, ys, "o-", label=op)
    sizes = sorted({r["payload_bytes"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([bench_comm.size_label(s) for s in sizes])
    ax.minorticks_off()
    values = [r["gbps"] for r in rows if r["gbps"] > 0]
    if values and max(values) > 20 * min(values):
        ax.set_yscale("log")  # a spread this wide hides the small values on a linear axis
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("payload size (one float32 tensor)")
    ax.set_ylabel("GB/s (bytes read + written per second)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dpcore.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_devices_argument(parser, "0,0,0,0 with a GPU, else cpu:4")
    parser.add_argument(
        "--out", default="bench-results", help="folder for the JSON files and the plot (default %(default)s/)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller payloads, fewer sizes and repeats (under a minute)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (minimum)")
    parser.add_argument(
        "--sizes",
        default=None,
        help="payload sizes of the sweep, e.g. '256K,1M,4M'; default 256K..64M by 4x (--quick: 256K,2M,16M)",
    )
    # For tests: --quick with the fewest repeats, two small sweep sizes and
    # no minimum measuring time, so that everything runs in seconds.
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmarks with command-line arguments `argv`; returns
    {"comm": comm.json's content, "step": step.json's content, "files":
    [paths written], "notes": [what was skipped]}: without matplotlib the
    plot is skipped and NO_PLOT_NOTE is printed and returned among the notes.
    Exits with status 2 on a bad option."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, but got {args.repeats}")
    spec, devices = devices_from_args(parser, args.devices, default_devices())
    try:
        sizes = parse_sizes(args.sizes) if args.sizes else None
    except ValueError as error:
        parser.error(str(error))
    notes: list[str] = []
    try:
        import matplotlib  # noqa: F401

        can_plot = True
    except ImportError:
        can_plot = False
        notes.append(NO_PLOT_NOTE)
        print(f"note: {NO_PLOT_NOTE}", flush=True)

    quick = args.quick or args.smoke
    repeats = 1 if args.smoke and args.repeats is None else args.repeats
    if sizes is None:
        sizes = [256 * 1024, 1024 * 1024] if args.smoke else bench_comm.sweep_sizes(quick)
    sweep_min_seconds = 0.0 if args.smoke else (0.05 if quick else 0.2)
    step_min_seconds = 0.0 if args.smoke else None
    out = Path(args.out)
    started = time.perf_counter()

    print(f"[1/3] comm: collectives against copy_ and torch on {spec}", flush=True)
    comm_result = bench_comm.run(devices, quick=quick, repeats=repeats)
    print(f"\n[2/3] comm sweep: single tensors of {', '.join(bench_comm.size_label(s) for s in sizes)}", flush=True)
    sweep = bench_comm.sweep(devices, sizes, repeats=repeats or (3 if quick else 5), min_seconds=sweep_min_seconds)
    comm_result["sweep"] = sweep
    print(f"\n[3/3] step: training step against the same arithmetic without data parallelism on {spec}", flush=True)
    # --smoke's compiled row runs Dynamo's eager backend: inductor compiles for a minute on a busy 2-core CPU.
    step_result = bench_step.run(
        devices,
        quick=quick,
        repeats=repeats,
        min_seconds=step_min_seconds,
        compiled="eager" if args.smoke else "inductor",
    )

    print("\ncomm")
    print_table(comm_result["rows"], bench_comm.COLUMNS)
    print("\ncomm sweep (single tensors; copy_ is the roofline)")
    print_table(sweep["rows"], bench_comm.SWEEP_COLUMNS)
    print("\nstep")
    print_table(step_result["rows"], bench_step.COLUMNS)

    files = [write_json(out / "comm.json", comm_result), write_json(out / "step.json", step_result)]
    if can_plot:
        title = f"dpcore collectives on {spec} ({comm_result['env']['build']} build)"
        files.append(plot_sweep(sweep, title, out / PLOT_NAME))
    print(f"\nwrote {', '.join(str(f) for f in files)} in {time.perf_counter() - started:.1f} s")
    for note in notes:
        print(f"note: {note}")
    return {"comm": comm_result, "step": step_result, "files": [str(f) for f in files], "notes": notes}


if __name__ == "__main__":
    main()
