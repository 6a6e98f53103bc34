"""Training-step time of hybrid data parallelism (DataParallel with a
process_group) over gloo on this machine, against baselines measured in the
same run.

1. 2 processes x 1 CPU replica: the hybrid step against
   torch.nn.parallel.DistributedDataParallel (gloo) on the same model, in the
   same processes, alternating rounds (at least 3; the target ratio is at
   most 1.03): the ratio of the medians, and the spread of the per-round
   ratios (median, lowest, highest round); also the ratio of the
   processes' CPU time per step (gloo's threads included), which a loaded
   machine disturbs less than wall time;
2. 2 processes x 2 CPU replicas against 1 process x 4 CPU replicas (plain
   dpcore.DataParallel), the same global batch; reported as measured (two
   separate runs, one after the other).

Each process gets cores / processes intra-op threads. The processes are
started here (gloo on 127.0.0.1, a free port), one configuration at a time.

    python bench/bench_distributed.py [--quick] [--repeats N] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import subprocess
import sys
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import environment, measure_against, measure_rounds, print_table, ratio_spread, write_json
from dpcore.bench.step import _models, _train_step

#: Global batch of every configuration.
GLOBAL_BATCH = 64


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_timed(fn: Callable[[], Any], out: list[float]) -> Callable[[], None]:
    """`fn`, appending the CPU time of the whole process (gloo's threads
    included) of each call to `out`: steadier than wall time on a loaded
    machine, where two processes wait on each other's scheduling."""

    def run() -> None:
        start = time.process_time()
        fn()
        out.append(time.process_time() - start)

    return run


def join_workers() -> tuple[int, int, Any]:
    """In a process of :func:`launch_workers`: sets cores / world intra-op
    threads and joins the gloo group of the world (none for a world of 1).
    Returns (world, rank, group or None)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # cores / processes
    if world == 1:
        return 1, 0, None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    return world, dist.get_rank(), dist.group.WORLD


def against_ddp(
    dp: nn.Module,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    rounds: int,
    repeats: int,
) -> dict[str, Any]:
    """`dp`'s training step (on `model`, `opt`) against DistributedDataParallel
    (gloo, a new group of the world) on a copy of `model`, in the same
    processes, in alternating rounds (:func:`measure_rounds`). Returns the
    row's figures: ms and baseline_ms (medians of the rounds), ratio, the
    per-round ratio spread, and the same for CPU time per step."""
    import torch.distributed as dist

    twin = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(twin, process_group=dist.new_group())
    opt_twin = torch.optim.SGD(twin.parameters(), lr=1e-3)
    cpu: dict[str, list[float]] = {"ours": [], "theirs": []}
    per_ours, per_theirs = measure_rounds(
        _cpu_timed(lambda: _train_step(dp, opt, x, y), cpu["ours"]),
        _cpu_timed(lambda: _train_step(ddp, opt_twin, x, y), cpu["theirs"]),
        [torch.device("cpu")],
        rounds=rounds,
        repeats=repeats,
    )
    ours, theirs = statistics.median(per_ours), statistics.median(per_theirs)
    cpu_ours, cpu_theirs = statistics.median(cpu["ours"]), statistics.median(cpu["theirs"])
    return dict(
        ms=ours * 1e3,
        baseline="torch DDP (gloo), same processes",
        baseline_ms=theirs * 1e3,
        ratio=ours / theirs,
        **ratio_spread(per_ours, per_theirs),
        rounds=rounds,
        cpu_ms=cpu_ours * 1e3,
        baseline_cpu_ms=cpu_theirs * 1e3,
        cpu_ratio=cpu_ours / cpu_theirs,
    )


def _worker(config: str, rounds: int, repeats: int, out: str) -> None:
    """One rank of `config` ("ddp": hybrid against DDP, 2 x 1; "hybrid":
    2 x 2; "single": 1 x 4 plain DataParallel); rank 0 writes its rows."""
    import torch.distributed as dist

    world, rank, group = join_workers()
    replicas = {"ddp": 1, "hybrid": 2, "single": 4}[config]
    devices = [torch.device("cpu")] * replicas
    rows = []
    for name, factory, shape, _, sync_bn in _models(quick=False):
        if sync_bn:  # the baseline, DDP with nn.SyncBatchNorm, needs CUDA: no CPU comparison
            continue
        torch.manual_seed(0)
        model = factory()
        local = GLOBAL_BATCH // world
        x = torch.randn(local, *shape)
        with torch.no_grad():
            y = torch.randn_like(model(x))
        dp = dpcore.DataParallel(model, devices, process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        row: dict[str, Any] = {"config": config, "model": name, "processes": world, "replicas": replicas}
        if config == "ddp":
            row.update(against_ddp(dp, model, opt, x, y, rounds, repeats))
        else:
            # Fixed step counts: every rank must run the same number of steps.
            ours, _ = measure_against(
                lambda: _train_step(dp, opt, x, y), lambda: None, devices, rounds=rounds, repeats=repeats
            )
            row.update(ms=ours * 1e3)
        rows.append(row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    if group is not None:
        dist.destroy_process_group()


def _launch(config: str, world: int, rounds: int, repeats: int) -> list[dict[str, Any]]:
    """Runs `config` on `world` local processes; returns rank 0's rows."""
    args = ["--worker", config, "--rounds", str(rounds), "--repeats", str(repeats)]
    return launch_workers("dpcore.bench.distributed", args, world)


def launch_workers(module: str, args: Sequence[str], world: int) -> Any:
    """Runs ``python -m module *args --out FILE`` as `world` local processes
    (ranks 0 .. world-1; gloo's rendezvous on 127.0.0.1, a free port;
    OMP_NUM_THREADS cores / world, as torchrun sets it) and returns the JSON
    that rank 0 wrote to FILE. Raises RuntimeError naming `module` and the
    exit codes when a process fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        threads = str(max(1, (os.cpu_count() or 1) // world))  # as torchrun's OMP_NUM_THREADS
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS=threads,
        )
        if "lo" in [name for _, name in socket.if_nameindex()]:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the host name resolves to
        cmd = [sys.executable, "-m", module, *args, "--out", out]
        procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise RuntimeError(f"{module} {' '.join(args)} failed, exit codes {codes}")
        with open(out) as f:
            return json.load(f)


def run(quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """Measures every configuration; returns the JSON-ready result."""
    # Many alternating rounds: the machine's load drifts, and a ratio near 1
    # needs both sides measured under the same load.
    rounds = 3 if quick else 20
    repeats = repeats or (4 if quick else 10)
    rows = _launch("ddp", 2, rounds, repeats)
    hybrid = _launch("hybrid", 2, rounds, repeats)
    single = {r["model"]: r for r in _launch("single", 1, rounds, repeats)}
    for row in hybrid:
        base = single[row["model"]]
        row.update(
            baseline="1 process x 4 replicas (separate run)", baseline_ms=base["ms"], ratio=row["ms"] / base["ms"]
        )
    rows += hybrid
    return {"benchmark": "distributed", "global_batch": GLOBAL_BATCH, "env": environment(), "rows": rows}


COLUMNS = [
    ("model", "model", "s"),
    ("processes", "processes", "d"),
    ("replicas", "replicas", "d"),
    ("ms", "hybrid ms", ".2f"),
    ("baseline", "baseline", "s"),
    ("baseline_ms", "baseline ms", ".2f"),
    ("ratio", "ratio", ".3f"),
    ("ratio_min", "round min", ".3f"),
    ("ratio_max", "round max", ".3f"),
    ("cpu_ratio", "CPU-time ratio", ".3f"),
]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="bench_distributed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds and repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per round")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, but got {args.repeats}")
    if args.worker:
        _worker(args.worker, args.rounds, args.repeats or 10, args.out)
        return {}
    print(f"bench_distributed: global batch {GLOBAL_BATCH}, gloo on 127.0.0.1")
    result = run(quick=args.quick, repeats=args.repeats)
    print()
    print_table(result["rows"], COLUMNS)
    if args.json:
        print(f"\nwrote {write_json(args.json, result)}")
    return result


if __name__ == "__main__":
    main()
