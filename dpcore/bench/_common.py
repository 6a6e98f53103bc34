"""Timing, device-list parsing and reporting shared by the benchmarks."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def parse_devices(spec: str) -> list[torch.device]:
    """'cpu:4' -> four CPU devices; '0,0,1' -> CUDA devices 0, 0, 1; 'cpu' -> one CPU.

    Raises ValueError naming the spec when it is malformed.
    """
    spec = spec.strip()
    if spec.startswith("cpu"):
        count = spec[3:].lstrip(":") or "1"
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--devices: expected 'cpu:N' with N >= 1, but got {spec!r}")
        return [torch.device("cpu")] * int(count)
    try:
        indices = [int(part) for part in spec.split(",") if part.strip() != ""]
    except ValueError:
        raise ValueError(f"--devices: expected 'cpu:N' or CUDA indices like '0,1', but got {spec!r}") from None
    if not indices:
        raise ValueError(f"--devices: expected at least one device, but got {spec!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--devices {spec!r} names CUDA devices, but no GPU is available")
    count = torch.cuda.device_count()
    for index in indices:
        if not 0 <= index < count:
            raise ValueError(f"--devices: CUDA device {index} is not visible ({count} visible)")
    return [torch.device("cuda", i) for i in indices]


def default_devices(every_gpu: bool = False) -> str:
    """The --devices spec used when none is given: 'cpu:4' without a GPU;
    with one, GPU 0 four times ('0,0,0,0'), or every visible GPU where
    `every_gpu` ('0,1,...')."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "cpu:4"
    if every_gpu:
        return ",".join(str(i) for i in range(torch.cuda.device_count()))
    return "0,0,0,0"


def add_devices_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """Adds the --devices option every command line here shares; `default`
    says in words what its default is."""
    parser.add_argument(
        "--devices",
        default=None,
        help=f"'cpu:N' (N CPU replicas) or CUDA indices such as '0,0,0,0' or '0,1'; default: {default}",
    )


def devices_from_args(
    parser: argparse.ArgumentParser, spec: str | None, default: str
) -> tuple[str, list[torch.device]]:
    """(the spec used, its devices) for the --devices value `spec` (`default`
    when None); a bad spec exits with status 2 through ``parser.error``,
    naming --devices."""
    spec = spec if spec is not None else default
    try:
        return spec, parse_devices(spec)
    except ValueError as error:
        parser.error(str(error))
        raise  # parser.error exits


def synchronize(devices: Sequence[torch.device]) -> None:
    """Waits for all work queued on the CUDA devices of `devices`."""
    for index in sorted({d.index for d in devices if d.type == "cuda"}):
        torch.cuda.synchronize(index)


def measure(
    fn: Callable[[], Any],
    devices: Sequence[torch.device],
    *,
    warmup: int = 2,
    repeats: int = 10,
    min_seconds: float = 0.0,
) -> float:
    """Median wall time of one call of `fn` in seconds, after `warmup` calls,
    with the devices synchronized around each call (CUDA) so that queued
    work is counted. Runs at least `repeats` times and at least `min_seconds`."""
    for _ in range(warmup):
        fn()
    synchronize(devices)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - started < min_seconds:
        begin = time.perf_counter()
        fn()
        synchronize(devices)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_rounds(
    fn: Callable[[], Any],
    baseline: Callable[[], Any],
    devices: Sequence[torch.device],
    *,
    rounds: int = 5,
    repeats: int = 4,
) -> tuple[list[float], list[float]]:
    """Per-round median times (seconds) of `fn` and `baseline`, measured in
    alternating rounds (`repeats` calls of each per round, after two warm-up
    calls each) so that both see the same machine load: a noisy neighbour
    slows both, not one of them. Round r's two figures are comparable."""
    ours: list[float] = []
    theirs: list[float] = []
    for f in (fn, baseline):
        f()
        f()
    synchronize(devices)
    for _ in range(rounds):
        for f, out in ((fn, ours), (baseline, theirs)):
            times = []
            for _ in range(repeats):
                begin = time.perf_counter()
                f()
                synchronize(devices)
                times.append(time.perf_counter() - begin)
            out.append(statistics.median(times))
    return ours, theirs


def measure_against(
    fn: Callable[[], Any],
    baseline: Callable[[], Any],
    devices: Sequence[torch.device],
    *,
    rounds: int = 5,
    repeats: int = 4,
) -> tuple[float, float]:
    """Median times of `fn` and `baseline` over the rounds of
    :func:`measure_rounds`. Returns (fn seconds, baseline seconds)."""
    ours, theirs = measure_rounds(fn, baseline, devices, rounds=rounds, repeats=repeats)
    return statistics.median(ours), statistics.median(theirs)


def ratio_spread(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """The per-round ratios ours/theirs of :func:`measure_rounds`: their
    median, and the spread as the lowest and highest round's ratio."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def git_commit() -> str | None:
    """The commit checked out in the source folder dpcore is imported from,
    with "+dirty" when tracked files differ from it; None outside a git
    checkout or without git."""
    import dpcore

    root = Path(dpcore.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded next to every result, taken when
    the result is assembled (the end of the run): the date (UTC, ISO 8601),
    the CPU count and the 1-, 5- and 15-minute load averages (a shared
    machine's figures are as noisy as its load), and the git commit
    (:func:`git_commit`)."""
    import dpcore

    return {
        "dpcore": dpcore.__version__,
        "torch": torch.__version__,
        "build": dpcore.info()["build"],
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": git_commit(),
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """Prints rows as a fixed-width table; columns are (key, header, format)."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(key) is None else format(row[key], fmt)) for key, _, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for n, line in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
        if n == 0:
            print("  ".join("-" * width for width in widths))


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Writes payload as indented JSON, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def bench_command(
    name: str,
    doc: str | None,
    run: Callable[..., dict[str, Any]],
    columns: Sequence[tuple[str, str, str]],
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
    check_options: Callable[[argparse.ArgumentParser, argparse.Namespace, list[torch.device]], None] | None = None,
) -> Callable[[Sequence[str] | None], dict[str, Any]]:
    """The ``main(argv=None)`` of a benchmark, with the command line every
    benchmark shares: --devices, --quick, --repeats, --json. It runs
    `run(devices, quick=, repeats=)`, prints the table of its rows, writes
    the JSON and returns the result. Bad --devices exit 2 naming it.
    `add_options(parser)` adds a benchmark's own options; their values are
    passed to `run` as keyword arguments too. `check_options(parser, args,
    devices)` runs before `run` and refuses a bad combination through
    ``parser.error`` (exit status 2, nothing measured)."""

    def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
        parser = argparse.ArgumentParser(
            prog=name, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        add_devices_argument(parser, "0,0,0,0 with a GPU, else cpu:4")
        parser.add_argument("--quick", action="store_true", help="smaller payloads and fewer repeats")
        parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement")
        parser.add_argument("--json", default=None, help="write the results here as JSON")
        shared = {action.dest for action in parser._actions}
        if add_options is not None:
            add_options(parser)
        args = parser.parse_args(argv)
        extra = {key: value for key, value in vars(args).items() if key not in shared}
        spec, devices = devices_from_args(parser, args.devices, default_devices())
        if check_options is not None:
            check_options(parser, args, devices)
        print(f"{name} on {spec}")
        result = run(devices, quick=args.quick, repeats=args.repeats, **extra)
        print()
        print_table(result["rows"], columns)
        if args.json:
            print(f"\nwrote {write_json(args.json, result)}")
        return result

    main.__doc__ = f"Command line of {name}: see its module docstring."
    return main
