"""Soak test: many training steps of dpcore.DataParallel, watching for growth.

Runs ``--steps`` SGD steps of a small MLP (4 Linear layers of 64, batch 64,
MSE loss) under dpcore.DataParallel on ``--devices`` (default ``cpu:4``),
and every ``--repeats`` steps (default: steps / 20) samples

* the thread count: ``threading.active_count()`` (Python threads) and the
  ``Threads:`` line of /proc/self/status (every OS thread: the worker pool,
  torch's intra-op pool);
* the resident set size: /proc/self/statm, after ``gc.collect()``;
* the mean step time over the block of steps since the last sample.

After a warm-up (the first fifth of the steps, at most 1,000) the OS thread
count must stay exactly what it was at the end of the warm-up and the RSS
must not grow by more than ``--max-rss-growth-mib`` (default 16). Prints the
table of samples and a JSON summary, writes the whole result with ``--json``,
and exits with status 1 when either check fails. ``--quick`` (without
``--steps``) runs 500 steps.

    python bench/soak.py --steps 10000 --json bench-results/soak.json
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import bench_command, environment, synchronize

DEFAULT_STEPS = 10_000
QUICK_STEPS = 500
DEFAULT_MAX_RSS_GROWTH_MIB = 16.0
_MIB = 1024.0 * 1024.0


def os_threads() -> int:
    """The number of OS threads of this process (/proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no 'Threads:' line")


def rss_bytes() -> int:
    """The resident set size of this process in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _mlp(width: int = 64, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def warmup_steps(steps: int) -> int:
    """Steps excluded from the growth checks: a fifth of the run, at most 1,000."""
    return min(1_000, steps // 5)


def run(
    devices: Sequence[torch.device],
    quick: bool = False,
    repeats: int | None = None,
    steps: int | None = None,
    max_rss_growth_mib: float = DEFAULT_MAX_RSS_GROWTH_MIB,
) -> dict[str, Any]:
    """Runs the soak; returns the JSON-ready result (rows: the samples;
    summary: thread counts, RSS at start, end of warm-up and end, ms/step
    after warm-up, and ``ok`` with the failed checks under ``problems``)."""
    steps = steps or (QUICK_STEPS if quick else DEFAULT_STEPS)
    if steps < 10:
        raise ValueError(f"steps: expected at least 10 steps, but got {steps}")
    if repeats is not None and repeats < 1:
        raise ValueError(f"repeats: expected at least 1 step per sample, but got {repeats}")
    interval = repeats or max(1, steps // 20)
    warmup = warmup_steps(steps)
    first = devices[0]
    torch.manual_seed(0)
    model = _mlp().to(first)
    dp = dpcore.DataParallel(model, device_ids=list(devices))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64, device=first)
    y = torch.randn(64, 64, device=first)

    def sample(step: int, block_seconds: float, block_steps: int) -> dict[str, Any]:
        gc.collect()
        row = {
            "step": step,
            "os_threads": os_threads(),
            "python_threads": threading.active_count(),
            "rss_mib": rss_bytes() / _MIB,
            "ms_per_step": None if block_steps == 0 else block_seconds / block_steps * 1e3,
            "warm": step >= warmup,
        }
        print(
            f"  step {step:>6}: {row['os_threads']} OS threads, {row['python_threads']} Python threads, "
            f"RSS {row['rss_mib']:.1f} MiB"
            + ("" if row["ms_per_step"] is None else f", {row['ms_per_step']:.2f} ms/step"),
            flush=True,
        )
        return row

    rows = [sample(0, 0.0, 0)]
    warm_row: dict[str, Any] | None = rows[0] if warmup == 0 else None
    block_start, block_steps = time.perf_counter(), 0
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(dp(x), y)
        loss.backward()
        opt.step()
        block_steps += 1
        if step % interval == 0 or step == steps or step == warmup:
            synchronize(devices)
            rows.append(sample(step, time.perf_counter() - block_start, block_steps))
            if step == warmup:
                warm_row = rows[-1]
            block_start, block_steps = time.perf_counter(), 0
    assert warm_row is not None
    warm_rows = [r for r in rows if r["step"] > warmup]
    end = rows[-1]
    problems: list[str] = []
    changed = [r for r in warm_rows if r["os_threads"] != warm_row["os_threads"]]
    if changed:
        problems.append(
            f"OS threads changed after warm-up: {warm_row['os_threads']} at step {warmup}, "
            f"{changed[0]['os_threads']} at step {changed[0]['step']}"
        )
    py_changed = [r for r in warm_rows if r["python_threads"] != warm_row["python_threads"]]
    if py_changed:
        problems.append(
            f"Python threads changed after warm-up: {warm_row['python_threads']} at step {warmup}, "
            f"{py_changed[0]['python_threads']} at step {py_changed[0]['step']}"
        )
    growth = max(r["rss_mib"] for r in warm_rows) - warm_row["rss_mib"] if warm_rows else 0.0
    if growth > max_rss_growth_mib:
        problems.append(
            f"RSS grew by {growth:.1f} MiB after warm-up (limit {max_rss_growth_mib:g} MiB): "
            f"{warm_row['rss_mib']:.1f} MiB at step {warmup}, {end['rss_mib']:.1f} MiB at step {steps}"
        )
    timed = [r["ms_per_step"] for r in warm_rows if r["ms_per_step"] is not None]
    summary = {
        "steps": steps,
        "warmup_steps": warmup,
        "sample_every": interval,
        "os_threads_start": rows[0]["os_threads"],
        "os_threads_warm": warm_row["os_threads"],
        "os_threads_end": end["os_threads"],
        "python_threads_end": end["python_threads"],
        "rss_start_mib": rows[0]["rss_mib"],
        "rss_warm_mib": warm_row["rss_mib"],
        "rss_end_mib": end["rss_mib"],
        "rss_growth_after_warmup_mib": growth,
        "max_rss_growth_mib": max_rss_growth_mib,
        "ms_per_step": statistics.median(timed) if timed else None,
        "final_loss": loss.item(),
        "ok": not problems,
        "problems": problems,
    }
    return {
        "benchmark": "soak",
        "devices": [str(d) for d in devices],
        "env": environment(),
        "rows": rows,
        "summary": summary,
    }


COLUMNS = [
    ("step", "step", "d"),
    ("os_threads", "OS threads", "d"),
    ("python_threads", "Python threads", "d"),
    ("rss_mib", "RSS MiB", ".1f"),
    ("ms_per_step", "ms/step", ".2f"),
]


def _at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, but got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, but got {value}")
        return value

    return parse


def _add_options(parser: Any) -> None:
    parser.add_argument(
        "--steps",
        type=_at_least(10),
        default=None,
        help=f"training steps (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)",
    )
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=DEFAULT_MAX_RSS_GROWTH_MIB,
        help="allowed RSS growth after warm-up (MiB)",
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: see the module docstring. Exits 1 when a check fails."""
    result = bench_command("soak", __doc__, run, COLUMNS, add_options=_add_options)(argv)
    print(json.dumps(result["summary"], indent=2))
    if not result["summary"]["ok"]:
        print("soak: FAILED: " + "; ".join(result["summary"]["problems"]), file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
