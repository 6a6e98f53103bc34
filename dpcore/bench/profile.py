"""The wrapper's own work per training step, by stage (bench_profile).

Each stage is a function of the pipeline, timed exclusively (time spent in
a nested timed stage counts for that stage only) while whole training steps
run: forward ``scatter``, ``refresh`` (the replica cache), ``launch`` (the
worker pool's start), ``gather``, ``combine`` (the loss rule), the hybrid
mode's forward hooks; backward ``reduce`` (the buckets' gradient sums),
``grad_hooks`` (the hybrid mode's per-gradient hooks) and ``allreduce``
(launch, wait and write-back). ``model`` is the rest of the step: the
replicas' own compute, autograd and the optimizer. Each row also gives the
plain single-device step on the whole batch, measured in the same run, and
the wrapper's stages as a fraction of it. A stage absent from the code
being profiled is reported as absent, so the same command profiles older
trees. The hybrid rows use a process group of one (gloo): its collectives
return at once, so they show the fixed cost of the hybrid path itself.

    python bench/bench_profile.py --devices cpu --json bench-results/profile.json
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import bench_command

#: stage -> "module:Class.attribute" names (every one found is timed, into its stage).
STAGES: dict[str, tuple[str, ...]] = {
    "scatter": ("dpcore.data_parallel:DataParallel.scatter", "dpcore.data_parallel:DataParallel._lone_call"),
    "refresh": ("dpcore.replicate:ReplicaCache.replicas",),
    "launch": ("dpcore._pipeline:start_parallel_apply", "dpcore.data_parallel:start_parallel_apply"),
    "gather": ("dpcore.data_parallel:DataParallel.gather",),
    "combine": ("dpcore._loss:LossRule.combine", "dpcore.data_parallel:DataParallel._combine"),
    "hybrid_forward": (
        "dpcore.distributed:GradientSync.before_forward",
        "dpcore.distributed:GradientSync.after_forward",
    ),
    "reduce": ("dpcore._functions:BroadcastBucket.backward",),
    "grad_hooks": (
        "dpcore._buckets:BucketReducer._begin",
        "dpcore._buckets:BucketReducer._ready",
    ),
    # GradientSync._finish is reached through a callback bound when the wrapper is built (before the timing):
    # the reducer's own steps, looked up per call, are what times it in this tree.
    "allreduce": (
        "dpcore.distributed:GradientSync._finish",
        "dpcore._buckets:BucketReducer.finish",
        "dpcore._buckets:BucketReducer.write_back",
    ),
}

COLUMNS = [
    ("setup", "setup", "s"),
    ("plain_us", "plain step us", ".0f"),
    ("step_us", "dp step us", ".0f"),
    ("own_us", "own us", ".0f"),
    ("own_share", "own/plain", ".3f"),
    ("bare_own_us", "uninstrumented own us", ".0f"),
    ("ddp_own_us", "DDP own us", ".0f"),
    ("stages", "own us by stage", "s"),
]


class _Timer:
    """Exclusive per-stage times, summed over all threads."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - begin
                nested = stack.pop()
                if stack:
                    stack[-1] += elapsed
                with self._lock:
                    self.totals[stage] = self.totals.get(stage, 0.0) + elapsed - nested

        return timed


@contextlib.contextmanager
def _instrumented(timer: _Timer) -> Iterator[list[str]]:
    """Every stage found wrapped by `timer` (yields the stages found)."""
    undo: list[tuple[Any, str, Any]] = []
    found: list[str] = []
    for stage, names in STAGES.items():
        for name in names:
            module_name, _, path = name.partition(":")
            try:
                owner: Any = importlib.import_module(module_name)
            except ImportError:
                continue
            *parents, attr = path.split(".")
            for part in parents:
                owner = getattr(owner, part, None)
            if owner is None or attr not in vars(owner):
                continue
            raw = vars(owner)[attr]
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapped = timer.wrap(stage, fn)
            setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
            undo.append((owner, attr, raw))
            if stage not in found:
                found.append(stage)
    try:
        yield found
    finally:
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)


def _mlp(widths: Sequence[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _cnn(channels: Sequence[int], size: int, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(channels[:-1], channels[1:]):
        layers += [nn.Conv2d(a, b, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.MaxPool2d(2), nn.Flatten(), nn.Linear(channels[-1] * (size // 2) ** 2, classes))


#: name -> (model factory, input shape without the batch, classes, batch, replicas, hybrid)
SETUPS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int, int, int, bool]] = {
    "hybrid 1x1 MLP 128-256-256-10 b32": (lambda: _mlp([128, 256, 256, 10]), (128,), 10, 32, 1, True),
    "hybrid 1x1 CNN 3-16-32 16x16 b16": (lambda: _cnn([3, 16, 32], 16), (3, 16, 16), 10, 16, 1, True),
    "cpu*2 MLP 512-1024-1024-10 b256": (lambda: _mlp([512, 1024, 1024, 10]), (512,), 10, 256, 2, False),
    "cpu*2 CNN 3-16-32-32 32x32 b64": (lambda: _cnn([3, 16, 32, 32], 32), (3, 32, 32), 10, 64, 2, False),
    "cpu*4 MLP 50x64 b32": (lambda: _mlp([64] * 51), (64,), 64, 32, 4, False),
}


@contextlib.contextmanager
def _group_of_one() -> Iterator[Any]:
    """A gloo process group of this process alone."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _fastest(steppers: dict[str, Callable[[], None]], steps: int, rounds: int = 10) -> dict[str, float]:
    """µs per step of each stepper, uninstrumented: the fastest of `rounds`
    alternating rounds of `steps` steps (the least disturbed by other work)."""
    best = dict.fromkeys(steppers, float("inf"))
    for _ in range(rounds):
        for key, fn in steppers.items():
            begin = time.perf_counter()
            for _ in range(steps):
                fn()
            best[key] = min(best[key], (time.perf_counter() - begin) / steps * 1e6)
    return best


def _profile(name: str, steps: int) -> dict[str, Any]:
    factory, shape, classes, batch, replicas, hybrid = SETUPS[name]
    torch.manual_seed(0)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    plain, model = factory(), factory()
    model.load_state_dict(plain.state_dict())
    loss_fn = nn.CrossEntropyLoss()
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(_group_of_one()) if hybrid else None
        dp = dpcore.DataParallel(model, ["cpu"] * replicas, process_group=group)

        def stepper(net: nn.Module, params: Any) -> Callable[[], None]:
            opt = torch.optim.SGD(params, lr=0.01)

            def step() -> None:
                opt.zero_grad()
                loss_fn(net(x), y).backward()
                opt.step()

            return step

        ours, theirs = stepper(dp, model.parameters()), stepper(plain, plain.parameters())
        steppers = {"dp": ours, "plain": theirs}
        if hybrid:  # DDP on a copy, in the same group of one
            twin = copy.deepcopy(plain)
            steppers["ddp"] = stepper(torch.nn.parallel.DistributedDataParallel(twin), twin.parameters())
        for fn in (*steppers.values(), *steppers.values()):
            fn()
        bare = _fastest(steppers, steps)
        timer = _Timer()
        ours_times, plain_times = [], []
        with _instrumented(timer) as found:
            for _ in range(steps):
                for fn, out in ((ours, ours_times), (theirs, plain_times)):
                    begin = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - begin)
    per_step = {stage: timer.totals.get(stage, 0.0) / steps * 1e6 for stage in found}
    own = sum(per_step.values())
    plain_us = statistics.median(plain_times) * 1e6
    return {
        "setup": name,
        "plain_us": plain_us,
        "step_us": statistics.median(ours_times) * 1e6,
        "own_us": own,
        "own_share": own / plain_us,
        "bare_own_us": bare["dp"] - bare["plain"],
        "ddp_own_us": bare["ddp"] - bare["plain"] if hybrid else None,
        "stages_us": per_step,
        "absent": [stage for stage in STAGES if stage not in found],
        "stages": " ".join(f"{k}={v:.0f}" for k, v in per_step.items()),
    }


def run(devices: Sequence[torch.device], quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """One row per setup (the device lists are the setups' own: --devices is not used)."""
    steps = repeats or (5 if quick else 40)
    rows = [_profile(name, steps) for name in SETUPS]
    return {"benchmark": "profile", "steps": steps, "rows": rows}


main = bench_command("bench_profile", __doc__, run, COLUMNS)

if __name__ == "__main__":
    main()
