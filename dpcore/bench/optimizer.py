"""dpcore.ShardedOptimizer against the plain optimizer, measured in the same
run, in alternating rounds (both see the same machine load):

* ``step``: ``optimizer.step()`` alone, with the same gradients in place:
  the shards stepping in parallel on the worker pool, each on its device,
  against one plain optimizer stepping every parameter on the first device;
* ``training step``: forward, backward, step and ``zero_grad`` of one
  batch through dpcore.DataParallel, with either optimizer (two copies of
  the model, each with its own wrapper); the same row gives the training step
  with ``shard_gradients=True`` (ZeRO-2: gradients reduce-scattered to their
  shards, parameters all-gathered back) over today's ShardedOptimizer one
  (``zero2_ratio``, measured in the same run, on a third copy).

``ratio`` is sharded over plain (below 1: the sharded one is faster), the
median of the rounds' ratios, with the lowest and highest round's. The
model is an MLP of equal Linear layers (bench/step.py's), in float32. On a
CUDA list, each training-step row also gives, per GPU of the list, the
peak of ``torch.cuda.max_memory_allocated`` over one training step with
either optimizer, above what was allocated before it (``peak_mib``). Every
training-step row gives, after a step (before ``zero_grad``), the bytes dpcore holds at each
position (``dpcore.memory_report``: module, replicas, gradients, optimizer
state, working copies) and position 0's over the others' mean, for the
three modes.

    python bench/bench_optimizer.py --devices cpu:2 --json bench-results/optimizer.json
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

import dpcore
from dpcore.bench._common import bench_command, environment, measure_rounds, ratio_spread
from dpcore.bench.step import mlp
from dpcore.memory import memory_report

#: The optimizers' names in the memory figures (shard_gradients: the sharded one with DataParallel(shard_gradients=True)).
MODES = ("sharded", "plain", "shard_gradients")

#: (row name, optimizer class, its arguments).
OPTIMIZERS: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("AdamW", torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01}),
    ("AdamW fused", torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01, "fused": True}),
    ("SGD momentum", torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
]


def run(devices: Sequence[torch.device], quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """Measures both rows for each optimizer of OPTIMIZERS on `devices`."""
    depth, width, batch = (8, 256, 32) if quick else (24, 512, 64)
    rounds, per_round = (3, repeats or 2) if quick else (7, repeats or 4)
    first = devices[0]
    torch.manual_seed(0)
    base = mlp(depth, width).to(first)
    x = torch.randn(batch, width, device=first)
    rows: list[dict[str, Any]] = []
    for name, cls, kwargs in OPTIMIZERS:
        models = [copy.deepcopy(base) for _ in MODES]
        wrappers = [dpcore.DataParallel(m, list(devices), shard_gradients=i == 2) for i, m in enumerate(models)]
        sharded = dpcore.ShardedOptimizer(models[0].parameters(), cls, devices=wrappers[0], **kwargs)
        plain = cls(models[1].parameters(), **kwargs)
        zero2 = dpcore.ShardedOptimizer(models[2].parameters(), cls, devices=wrappers[2], **kwargs)
        optimizers = (sharded, plain, zero2)
        for dp in wrappers[:2]:
            dp(x).square().mean().backward()  # gradients in place for the step row

        def train(dp: dpcore.DataParallel, opt: torch.optim.Optimizer) -> Callable[[], None]:
            def one() -> None:
                dp(x).square().mean().backward()
                opt.step()
                opt.zero_grad()

            return one

        steps = measure_rounds(sharded.step, plain.step, devices, rounds=rounds, repeats=per_round)
        trainings = measure_rounds(
            train(wrappers[0], sharded), train(wrappers[1], plain), devices, rounds=rounds, repeats=per_round
        )
        zero2_rounds = measure_rounds(
            train(wrappers[2], zero2), train(wrappers[0], sharded), devices, rounds=rounds, repeats=per_round
        )
        peaks = [_peak_mib(train(dp, opt), devices) for dp, opt in zip(wrappers, optimizers)]
        held = {mode: _held_after_step(dp, opt, x) for mode, dp, opt in zip(MODES, wrappers, optimizers)}
        label = f"MLP {depth}x{width}, batch {batch}"
        for what, (ours, theirs) in (("step", steps), ("training step", trainings)):
            spread = ratio_spread(ours, theirs)
            rows.append(
                {
                    "model": label,
                    "optimizer": name,
                    "measured": what,
                    "sharded_ms": statistics.median(ours) * 1e3,
                    "plain_ms": statistics.median(theirs) * 1e3,
                    "ratio": spread["ratio_median"],
                    "ratio_min": spread["ratio_min"],
                    "ratio_max": spread["ratio_max"],
                    "state_bytes": sharded.state_bytes(),
                }
            )
            if what == "training step":
                zero2_spread = ratio_spread(*zero2_rounds)
                rows[-1]["zero2_ms"] = statistics.median(zero2_rounds[0]) * 1e3
                rows[-1]["zero2_ratio"] = zero2_spread["ratio_median"]
                rows[-1]["zero2_ratio_min"] = zero2_spread["ratio_min"]
                rows[-1]["zero2_ratio_max"] = zero2_spread["ratio_max"]
                print(
                    f"  {name}, training step with shard_gradients=True over sharded: {zero2_spread['ratio_median']:.2f}"
                )
                rows[-1]["held_bytes"] = held
                rows[-1]["device0_over_others"] = {mode: _first_over_rest(b) for mode, b in held.items()}
                print(f"  {name}, device 0's held bytes over the others' mean: {rows[-1]['device0_over_others']}")
            if what == "training step" and peaks[0]:
                rows[-1]["peak_mib"] = dict(zip(MODES, peaks))
                print(f"  {name}, peak MiB per GPU above the step's start: {rows[-1]['peak_mib']}")
            print(f"  {name}, {what}: ratio {spread['ratio_median']:.2f}")
    return {"benchmark": "optimizer", "devices": [str(d) for d in devices], "env": environment(), "rows": rows}


def _held_after_step(dp: dpcore.DataParallel, opt: torch.optim.Optimizer, x: torch.Tensor) -> list[int]:
    """The bytes dpcore holds at each position after a backward and a step, before ``zero_grad`` (gradients, state
    and copies all present); with shard_gradients=True before the step, which drops the sharded gradients."""
    dp(x).square().mean().backward()
    held = [r.total for r in memory_report(dp, opt)] if dp.shard_gradients else []
    opt.step()
    held = held or [r.total for r in memory_report(dp, opt)]
    opt.zero_grad()
    return held


def _first_over_rest(held: list[int]) -> float | None:
    """Position 0's bytes over the mean of the other positions' (None for one position)."""
    rest = held[1:]
    return round(held[0] / (sum(rest) / len(rest)), 3) if rest and sum(rest) else None


def _peak_mib(step: Callable[[], None], devices: Sequence[torch.device]) -> dict[str, float]:
    """Per CUDA device of `devices`, the peak MiB allocated during one `step()` above what was allocated
    before it ({} on a CPU list)."""
    gpus = sorted({d.index for d in devices if d.type == "cuda"})
    if not gpus:
        return {}
    before = {}
    for i in gpus:
        torch.cuda.synchronize(i)
        torch.cuda.reset_peak_memory_stats(i)
        before[i] = torch.cuda.memory_allocated(i)
    step()
    for i in gpus:
        torch.cuda.synchronize(i)
    return {f"cuda:{i}": round((torch.cuda.max_memory_allocated(i) - before[i]) / 2**20, 2) for i in gpus}


COLUMNS = [
    ("model", "model", "s"),
    ("optimizer", "optimizer", "s"),
    ("measured", "measured", "s"),
    ("sharded_ms", "sharded ms", ".2f"),
    ("plain_ms", "plain ms", ".2f"),
    ("ratio", "sharded / plain", ".2f"),
    ("ratio_min", "lowest", ".2f"),
    ("ratio_max", "highest", ".2f"),
    ("zero2_ms", "shard_gradients ms", ".2f"),
    ("zero2_ratio", "shard_gradients / sharded", ".2f"),
]


main = bench_command("bench_optimizer", __doc__, run, COLUMNS)


if __name__ == "__main__":
    main()
