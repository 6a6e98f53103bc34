"""The wrapper's own cost per training step in instructions, counted by
valgrind's callgrind (bench_instructions): the same count for the same
code whatever else the machine runs, where bench_targets' timings on two
shared cores move by a factor of two between rounds.

For each hybrid setup of bench_profile (one replica in a process group of
one, gloo; forward, cross-entropy, backward, SGD step), the plain step,
DistributedDataParallel's and dpcore's are each run in a child process
under callgrind (every thread counted) twice: a warm-up alone, and the
warm-up then the measured steps. The difference over the steps is per
step; "own" is a step minus the plain one, and the ratio is dpcore's own
over DDP's (below 1: dpcore does less). Each child runs one intra-op
thread (OpenMP's idle threads spin, and a spinning thread's instructions
depend on the load). valgrind must be installed; a
child takes about two minutes (mostly importing torch under valgrind),
and the children run one per core.

    python bench/bench_instructions.py [--quick] [--repeats STEPS] [--json FILE]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import bench_command, environment
from dpcore.bench.profile import SETUPS, _group_of_one

KINDS = ("plain", "ddp", "dpcore")
WARMUP = 5
HYBRID = [name for name, setup in SETUPS.items() if setup[5]]

COLUMNS = [
    ("setup", "setup", "s"),
    ("plain", "plain instr/step", ",.0f"),
    ("ddp_own", "DDP own", ",.0f"),
    ("dpcore_own", "dpcore own", ",.0f"),
    ("ratio", "dpcore own / DDP own", ".3f"),
]


def steps_in_child(setup: str, kind: str, steps: int) -> None:
    """WARMUP + `steps` training steps of `kind` on `setup` (the child's work), on one intra-op thread:
    idle OpenMP threads spin, and their instructions would count what the load makes them wait."""
    torch.set_num_threads(1)
    factory, shape, classes, batch, _, _ = SETUPS[setup]
    torch.manual_seed(0)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    model, loss_fn = factory(), nn.CrossEntropyLoss()
    with _group_of_one() as group:
        if kind == "dpcore":
            net: nn.Module = dpcore.DataParallel(model, ["cpu"], process_group=group)
        elif kind == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)
        else:
            net = model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(WARMUP + steps):
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()


def collected(log: str) -> int:
    """The instruction count of callgrind's "Collected : N" line in `log`."""
    match = re.search(r"Collected\s*:\s*(\d+)", log)
    if match is None:
        raise RuntimeError(f"bench_instructions: no instruction count in callgrind's output:\n{log[-2000:]}")
    return int(match.group(1))


def _count(setup: str, kind: str, steps: int) -> int:
    """Instructions of a child running WARMUP + `steps` steps, from start to exit."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={os.path.join(folder, 'out')}",
            sys.executable,
            "-m",
            __name__,
            "--child",
            setup,
            kind,
            str(steps),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench_instructions: {' '.join(command[-4:])} failed:\n{done.stderr[-2000:]}")
    return collected(done.stderr)


def run(devices: Sequence[torch.device], quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """One row per hybrid setup (the device lists are the setups' own: --devices is not used)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions: valgrind is not installed (Debian: apt-get install valgrind)")
    steps = repeats or (20 if quick else 200)
    setups = HYBRID[:1] if quick else HYBRID
    jobs = [(setup, kind, n) for setup in setups for kind in KINDS for n in (0, steps)]
    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: _count(*job), jobs)))
    rows = []
    for setup in setups:
        per_step = {kind: (counts[setup, kind, steps] - counts[setup, kind, 0]) / steps for kind in KINDS}
        ddp_own, own = per_step["ddp"] - per_step["plain"], per_step["dpcore"] - per_step["plain"]
        rows.append(
            {
                "setup": setup,
                "plain": per_step["plain"],
                "ddp": per_step["ddp"],
                "dpcore": per_step["dpcore"],
                "ddp_own": ddp_own,
                "dpcore_own": own,
                "ratio": own / ddp_own,
            }
        )
    return {"benchmark": "instructions", "steps": steps, "warmup": WARMUP, "env": environment(), "rows": rows}


main = bench_command("bench_instructions", __doc__, run, COLUMNS)

if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        steps_in_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
