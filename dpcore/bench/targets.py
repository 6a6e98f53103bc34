"""The targets of issue 34 (bench_targets): each row a ratio of dpcore's
training step (forward, MSE loss, backward, SGD step) to its baseline's,
measured in the same run in alternating rounds; the figures are the
medians of the per-round figures, with the spread of the per-round ratios.

- hybrid_mlp, hybrid_cnn: DataParallel(process_group=) on 2 processes x 1
  CPU replica against DistributedDataParallel (gloo) on the same model in
  the same processes; target <= 1.00.
- single_mlp, single_cnn: one process, DataParallel on ["cpu"] * 2 and all
  cores' intra-op threads, against DDP on 2 processes of cores / 2 threads,
  the same global batch; each round launches the one, then the other;
  target <= 0.90.
- split: ["cpu"] * 4 against bench_step's 4 quarter-batch passes and one
  optimizer step, 50 Linear 64x64 + ReLU, batch 32; target <= 1.05.
- streams: bench_step's 50-dropout model on ["cpu"] * 4, random streams
  against DPCORE_REPLICA_RNG=0 (read at each call: one process, one
  wrapper); target <= 1.05.

A missed target is reported, not an error. Models, batches and thread
counts: docs/measured.md, "bench_targets".

    python bench/bench_targets.py [--quick] [--repeats N] [--rounds R] [--json FILE] [--only ROW]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

import dpcore
from dpcore.bench._common import environment, measure, measure_rounds, print_table, ratio_spread, write_json
from dpcore.bench.distributed import against_ddp, join_workers, launch_workers
from dpcore.bench.profile import SETUPS
from dpcore.bench.step import _split_step, _train_step, mlp, replica_rng_restored, streams_steps

#: row -> (what it measures, target: the ratio of medians must be at most this).
ROWS: dict[str, tuple[str, float]] = {
    "hybrid_mlp": ("hybrid 2x1 vs DDP, MLP 128-256-256-10, local batch 32", 1.00),
    "hybrid_cnn": ("hybrid 2x1 vs DDP, CNN 3-16-32 on 16x16, local batch 16", 1.00),
    "single_mlp": ("1 process cpu*2 vs DDP 2 processes, MLP 512-1024-1024-10, batch 256", 0.90),
    "single_cnn": ("1 process cpu*2 vs DDP 2 processes, CNN 3-16-32-32 on 32x32, batch 64", 0.90),
    "split": ("cpu*4 vs 4 quarter-batch passes + 1 step, MLP 50x64, batch 32", 1.05),
    "streams": ("cpu*4 50x64+Dropout, streams on vs DPCORE_REPLICA_RNG=0, batch 32", 1.05),
}

#: The rows on bench_profile's models: row -> its SETUPS entry (model, shape, batch, replicas).
SETUP_OF = {
    "hybrid_mlp": "hybrid 1x1 MLP 128-256-256-10 b32",
    "hybrid_cnn": "hybrid 1x1 CNN 3-16-32 16x16 b16",
    "single_mlp": "cpu*2 MLP 512-1024-1024-10 b256",
    "single_cnn": "cpu*2 CNN 3-16-32-32 32x32 b64",
}

MODULE = "dpcore.bench.targets"
CPU = [torch.device("cpu")]


def lanes(replicas: int, threads: int) -> str:
    """How dpcore runs `replicas` CPU replicas under `threads` intra-op
    threads (the worker pool's rule, csrc/dpcore/worker_pool.cpp): at most
    `threads` at once, each with threads / lanes OpenMP threads."""
    at_once = min(replicas, threads)
    return f"{replicas} CPU replica(s), {at_once} at a time, {max(1, threads // at_once)} intra-op thread(s) each"


def _worker(kind: str, rows: Sequence[str], rounds: int, repeats: int, out: str) -> None:
    """One rank of `kind`: "hybrid" (2 processes: dpcore against DDP, per
    row the figures of against_ddp), "single" (1 process, dpcore on the
    setup's replicas) or "ddp" (2 processes, DDP on half the batch); these
    two write seconds per step. Rank 0 writes {row: result} to `out`."""
    world, rank, group = join_workers()
    result: dict[str, Any] = {}
    for row in rows:
        factory, shape, _, batch, replicas, _ = SETUPS[SETUP_OF[row]]
        torch.manual_seed(0)
        model = factory()
        x = torch.randn(batch // world if kind == "ddp" else batch, *shape)
        with torch.no_grad():
            y = torch.randn_like(model(x))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if kind == "hybrid":
            dp = dpcore.DataParallel(model, ["cpu"] * replicas, process_group=group)
            result[row] = against_ddp(dp, model, opt, x, y, rounds, repeats)
            continue
        if kind == "ddp":
            net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
        else:
            net = dpcore.DataParallel(model, ["cpu"] * replicas)
        result[row] = measure(lambda: _train_step(net, opt, x, y), CPU, warmup=2, repeats=repeats)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if group is not None:  # every rank past its last collective before the teardown (gloo aborted on a race)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _launch(kind: str, rows: Sequence[str], world: int, rounds: int, repeats: int) -> dict[str, Any]:
    args = ["--worker", kind, "--only", ",".join(rows), "--rounds", str(rounds), "--repeats", str(repeats)]
    return launch_workers(MODULE, args, world)


def _load() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _row(name: str, ms: float, baseline_ms: float, spread: dict[str, float], **facts: Any) -> dict[str, Any]:
    """A row of the result: the medians, their ratio, the per-round spread,
    the target and whether the ratio of medians meets it, and `facts`."""
    setup, target = ROWS[name]
    ratio = ms / baseline_ms
    row = {"row": name, "setup": setup, "dpcore_ms": ms, "baseline_ms": baseline_ms, "ratio": ratio, **spread}
    return {**row, "target": target, "met": ratio <= target, **facts}


def _in_process(
    ours: Callable[[], None], theirs: Callable[[], None], rounds: int, repeats: int
) -> tuple[float, float, dict[str, float]]:
    """(dpcore ms, baseline ms, spread) of measure_rounds in this process."""
    per_ours, per_theirs = measure_rounds(ours, theirs, CPU, rounds=rounds, repeats=repeats)
    ms = (statistics.median(per_ours) * 1e3, statistics.median(per_theirs) * 1e3)
    return (*ms, ratio_spread(per_ours, per_theirs))


def run(
    quick: bool = False, repeats: int | None = None, rounds: int | None = None, only: Sequence[str] | None = None
) -> dict[str, Any]:
    """Measures the rows `only` (default: every row of ROWS, in its order),
    `rounds` alternating rounds (default 5, 3 with `quick`) of `repeats`
    steps each (default 10, 4 with `quick`); returns the JSON-ready result."""
    rounds = rounds or (3 if quick else 5)
    repeats = repeats or (4 if quick else 10)
    wanted = [name for name in ROWS if only is None or name in only]
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    half = max(1, cores // 2)
    rows: list[dict[str, Any]] = []
    hybrid = [name for name in wanted if name.startswith("hybrid")]
    if hybrid:
        before = _load()
        measured = _launch("hybrid", hybrid, 2, rounds, repeats)
        for name in hybrid:
            m = measured[name]
            spread = {k: m[k] for k in ("ratio_median", "ratio_min", "ratio_max")}
            rows.append(
                _row(
                    name,
                    m["ms"],
                    m["baseline_ms"],
                    spread,
                    baseline="torch DDP (gloo), the same 2 processes",
                    threads=f"2 processes x {half} intra-op threads; dpcore: {lanes(1, half)}",
                    load_before=before,
                    load_after=_load(),
                )
            )
    single = [name for name in wanted if name.startswith("single")]
    if single:
        before = _load()
        ours: dict[str, list[float]] = {name: [] for name in single}
        theirs: dict[str, list[float]] = {name: [] for name in single}
        for _ in range(rounds):  # each round: one process of dpcore, then DDP's two
            for kind, world, into in (("single", 1, ours), ("ddp", 2, theirs)):
                for name, seconds in _launch(kind, single, world, rounds, repeats).items():
                    into[name].append(seconds)
        for name in single:
            ms = statistics.median(ours[name]) * 1e3, statistics.median(theirs[name]) * 1e3
            rows.append(
                _row(
                    name,
                    *ms,
                    ratio_spread(ours[name], theirs[name]),
                    baseline="torch DDP (gloo), 2 processes, half the batch each, launched after dpcore's",
                    threads=f"dpcore: 1 process, {cores} threads, {lanes(2, cores)}; DDP: 2 x {half} threads",
                    load_before=before,
                    load_after=_load(),
                )
            )
    in_process = f"1 process, {threads} intra-op threads; dpcore: {lanes(4, threads)}"
    devices = CPU * 4
    if "split" in wanted:
        before = _load()
        torch.manual_seed(0)
        model = mlp(50, 64)
        x = torch.randn(32, 64)
        with torch.no_grad():
            y = torch.randn_like(model(x))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        dp = dpcore.DataParallel(model, devices)
        xs, ys = x.chunk(4), y.chunk(4)
        figures = _in_process(
            lambda: _train_step(dp, opt, x, y), lambda: _split_step(model, opt, xs, ys), rounds, repeats
        )
        baseline = "4 plain passes on quarter batches + 1 SGD step (bench_step)"
        rows.append(
            _row("split", *figures, baseline=baseline, threads=in_process, load_before=before, load_after=_load())
        )
    if "streams" in wanted:
        before = _load()
        step, _ = streams_steps(devices)
        with replica_rng_restored():
            figures = _in_process(lambda: step("1"), lambda: step("0"), rounds, repeats)
        baseline = "the same wrapper with DPCORE_REPLICA_RNG=0"
        rows.append(
            _row("streams", *figures, baseline=baseline, threads=in_process, load_before=before, load_after=_load())
        )
    for row in rows:
        verdict = "met" if row["met"] else "MISSED"
        print(f"  {row['row']}: ratio {row['ratio']:.3f}, target <= {row['target']:.2f}: {verdict}")
    return {"benchmark": "targets", "rounds": rounds, "repeats": repeats, "env": environment(), "rows": rows}


COLUMNS = [
    ("row", "row", "s"),
    ("dpcore_ms", "dpcore ms", ".3f"),
    ("baseline_ms", "baseline ms", ".3f"),
    ("ratio", "ratio", ".3f"),
    ("ratio_median", "round median", ".3f"),
    ("ratio_min", "round min", ".3f"),
    ("ratio_max", "round max", ".3f"),
    ("target", "target <=", ".2f"),
    ("met", "met", ""),
    ("load_before", "load before", ".2f"),
    ("load_after", "load after", ".2f"),
]


def _only(parser: argparse.ArgumentParser, spec: str | None) -> list[str] | None:
    """The rows of --only (comma-separated names of ROWS); exits 2 naming
    --only for an unknown or empty name."""
    if spec is None:
        return None
    names = [part.strip() for part in spec.split(",")]
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        parser.error(f"--only: expected names among {', '.join(ROWS)}, but got {spec!r}")
    return names


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: see the module docstring. Exit status 0 whether or not
    the targets are met; 2 for a bad option, naming it."""
    parser = argparse.ArgumentParser(
        prog="bench_targets", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 steps unless set")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds, at least 3 (default 5)")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    parser.add_argument("--only", default=None, metavar="ROW", help=f"comma-separated rows: {', '.join(ROWS)}")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, but got {args.repeats}")
    if args.rounds is not None and args.rounds < 3:
        parser.error(f"--rounds: expected at least 3 (a median of rounds), but got {args.rounds}")
    only = _only(parser, args.only)
    if args.worker:
        _worker(args.worker, only or [], args.rounds, args.repeats, args.out)
        return {}
    print(f"bench_targets: rounds alternate dpcore and its baseline; {os.cpu_count()} cores")
    result = run(quick=args.quick, repeats=args.repeats, rounds=args.rounds, only=only)
    print()
    print_table(result["rows"], COLUMNS)
    if args.json:
        print(f"\nwrote {write_json(args.json, result)}")
    return result


if __name__ == "__main__":
    main()
