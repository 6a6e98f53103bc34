"""Steady-state training-step time of dpcore.DataParallel against baselines
measured in the same run.

On a CPU list of K entries the baseline is K plain forward/backward passes
on 1/K of the batch plus one optimizer step (the same arithmetic with no
scatter, threads, gather or reduction); ``ratio`` is dpcore's step over it.
Also: the plain full-batch step, the replica refresh against torch's
replicate (CUDA), torch.nn.DataParallel (CUDA), the check for writes no
version counter sees (``check / infer``), synchronized BatchNorm against
per-replica statistics (``x unsynced``), the random streams against
``DPCORE_REPLICA_RNG=0`` (``x streams off``), a compiled MLP
(``--compiled``) and, on CUDA lists, ``cuda_graphs=True`` (``--cuda-graphs``:
its targets are in the JSON's ``targets``; a graphed failure is recorded and
makes the exit status 1). Every ratio is between two figures of the same
run, model and batch. What each row and column means, and the targets:
docs/measured.md, "bench_step".

    python bench/bench_step.py --devices cpu:4 --json bench-results/step.json
    python bench/bench_step.py --devices 0,0,0,0 --repeats 10 --min-seconds 0.25
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import bench_command, environment, measure, measure_against, synchronize
from dpcore.replicate import CHECK_INTERVAL_MAX

#: (row name, model factory, input shape without the batch, batch size, sync_batchnorm).
ModelSpec = tuple[str, Callable[[], nn.Module], tuple[int, ...], int, bool]

#: Untimed calls of a cuda_graphs=True wrapper before its step is timed (the
#: timing itself adds measure()'s own warm-up calls): its eager warm-up and
#: the capture happen there, so the timed calls are replays.
GRAPH_WARMUP = 8

#: Why graphed rows are missing on a CPU list (the JSON's cuda_graphs.note).
CUDA_ONLY = "cuda_graphs: CUDA lists only"

#: Choices of --cuda-graphs (and of run's `cuda_graphs`).
CUDA_GRAPHS_CHOICES = ("auto", "on", "off")

#: The targets for the graphed rows, stated for [0, 0, 0, 0]: (row
#: name, column, "<=" or ">=", bound). Checked wherever the row has the
#: column; reported, never a failure.
GRAPH_TARGETS: list[tuple[str, str, str, float]] = [
    ("resnet18-style, batch 256 x 3 x 64 x 64", "graphed_vs_plain", "<=", 1.5),
    ("resnet18-style, batch 256 x 3 x 64 x 64", "torch_dp_vs_graphed", ">=", 4.0),
    ("MLP 50x64, batch 32", "torch_dp_vs_graphed", ">=", 4.0),
    ("small CNN, batch 32", "torch_dp_vs_graphed", ">=", 4.0),
    ("small CNN + BatchNorm, batch 32, sync", "torch_dp_vs_graphed", ">=", 4.0),
]


def mlp(depth: int = 50, width: int = 64) -> nn.Module:
    """The overhead-dominated model: `depth` Linear+ReLU layers of `width`."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def small_cnn() -> nn.Module:
    """A small CNN for 3x32x32 images and 10 classes."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.GroupNorm(4, 32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def small_cnn_bn() -> nn.Module:
    """small_cnn with BatchNorm2d in place of GroupNorm."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    """A bias-free convolution ("same" padding for odd kernels) and its BatchNorm."""
    return [nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class _Residual(nn.Module):
    """relu(body(x) + shortcut(x)); the shortcut is the identity, or a strided
    1x1 convolution with BatchNorm where the shape changes."""

    def __init__(self, body: list[nn.Module], cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*body)
        self.shortcut = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def basic_block(cin: int, width: int, stride: int) -> nn.Module:
    """ResNet's BasicBlock: two 3x3 convolutions of `width` channels (the
    first with `stride`), BatchNorm after each; `width` channels out."""
    return _Residual([*_conv_bn(cin, width, 3, stride), nn.ReLU(), *_conv_bn(width, width, 3)], cin, width, stride)


def bottleneck(cin: int, width: int, stride: int) -> nn.Module:
    """ResNet's Bottleneck: 1x1 down to `width`, 3x3 with `stride`, 1x1 up to
    4 x `width` channels, BatchNorm after each."""
    body = [
        *_conv_bn(cin, width, 1),
        nn.ReLU(),
        *_conv_bn(width, width, 3, stride),
        nn.ReLU(),
        *_conv_bn(width, 4 * width, 1),
    ]
    return _Residual(body, cin, 4 * width, stride)


def resnet(
    block: Callable[[int, int, int], nn.Module],
    depths: Sequence[int],
    expansion: int,
    classes: int = 100,
    base: int = 64,
) -> nn.Module:
    """A ResNet for 3-channel images: 7x7/2 stem of `base` channels with
    BatchNorm and a 3x3/2 max-pool, four stages of `depths` blocks at widths
    `base` x 1, 2, 4, 8 (64 .. 512 as in the paper; each stage after the
    first starts with stride 2; a block puts out `expansion` x width
    channels), global average pooling and a linear layer to `classes`.
    Spatial size is divided by 32 before the pooling."""
    layers: list[nn.Module] = [*_conv_bn(3, base, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1)]
    cin = base
    for stage, (width, depth) in enumerate(zip((base, 2 * base, 4 * base, 8 * base), depths)):
        for i in range(depth):
            layers.append(block(cin, width, 2 if stage > 0 and i == 0 else 1))
            cin = width * expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def resnet18(base: int = 64) -> nn.Module:
    """ResNet-18-style (BasicBlock, 2-2-2-2; 11.2 M parameters at `base`
    64), 100 classes."""
    return resnet(basic_block, (2, 2, 2, 2), 1, base=base)


def resnet50(base: int = 64) -> nn.Module:
    """ResNet-50-style (Bottleneck, 3-4-6-3; 23.7 M parameters at `base`
    64), 100 classes."""
    return resnet(bottleneck, (3, 4, 6, 3), 4, base=base)


def _models(quick: bool) -> list[ModelSpec]:
    """The overhead-dominated models (bench_distributed runs these too)."""
    return [
        ("MLP 50x64, batch 32", mlp, (64,), 32, False),
        ("small CNN, batch 32", small_cnn, (3, 32, 32), 32, False),
        ("small CNN + BatchNorm, batch 32, sync", small_cnn_bn, (3, 32, 32), 32, True),
    ]


def models(quick: bool, full_size: bool, replicas: int) -> list[ModelSpec]:
    """Every model of this benchmark: _models, then a wide MLP and the two
    ResNets, each row's name stating its widths, batch and image size.

    `full_size` (a CUDA list without `quick`): the full sizes, MLP
    50x1024 at batch 512, resnet18-style at 256 x 3 x 64 x 64,
    resnet50-style at 128 x 3 x 128 x 128. Otherwise (CPU lists): MLP 50x1024
    at batch 32, both ResNets at full width on 3 x 32 x 32 images at batch
    8. With `quick` the wide MLP is 50x128 and the ResNets an eighth as wide
    (8 .. 64 channels, on 3 x 16 x 16 images): a step of the full-width
    ones takes from 0.2 to 0.5 s on a 2-core CPU, too long for a smoke run.
    ResNet batches hold at least 2 samples per replica of the `replicas`
    (their last stage is 1 x 1 there, where BatchNorm needs 2 values)."""
    small = max(8, 2 * replicas)
    if full_size:
        width, mlp_batch, r18, r50, base = 1024, 512, (256, 64), (128, 128), 64
    elif quick:
        width, mlp_batch, r18, r50, base = 128, 32, (small, 16), (small, 16), 8
    else:
        width, mlp_batch, r18, r50, base = 1024, 32, (small, 32), (small, 32), 64
    quarter = "" if base == 64 else f" (width / {64 // base})"

    def wide() -> nn.Module:
        return mlp(50, width)

    def r18_model() -> nn.Module:
        return resnet18(base)

    def r50_model() -> nn.Module:
        return resnet50(base)

    def image(kind: str, size: tuple[int, int]) -> str:
        return f"{kind}-style{quarter}, batch {size[0]} x 3 x {size[1]} x {size[1]}"

    return [
        *_models(quick),
        (f"MLP 50x{width}, batch {mlp_batch}", wide, (width,), mlp_batch, False),
        (image("resnet18", r18), r18_model, (3, r18[1], r18[1]), r18[0], False),
        (image("resnet50", r50), r50_model, (3, r50[1], r50[1]), r50[0], False),
    ]


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)
    out = model(x)
    nn.functional.mse_loss(out, y).backward()
    opt.step()


def _split_step(
    model: nn.Module, opt: torch.optim.Optimizer, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]
) -> None:
    """The same arithmetic as one data-parallel step, sequentially, no overhead."""
    opt.zero_grad(set_to_none=False)
    total = sum(x.shape[0] for x in xs)
    for x, y in zip(xs, ys):
        (nn.functional.mse_loss(model(x), y) * (x.shape[0] / total)).backward()
    opt.step()


def _check_cost(
    dp: dpcore.DataParallel, x: torch.Tensor, measure_step: Callable[[Callable[[], Any]], float]
) -> tuple[float, float]:
    """(dpcore's inference call, one check of every bucket) in seconds, in
    eval mode without grad: nothing changes between calls, so each check
    compares every bucket with the master. The module is back in train mode
    after."""
    dp.module.eval()
    try:
        with torch.no_grad():
            t_infer = measure_step(lambda: dp(x))
            cache = dp._pipeline.cache(dp)
            t_check = measure_step(cache.check_now)
    finally:
        dp.module.train()
    return t_infer, t_check


def graphs_note(devices: Sequence[torch.device], cuda_graphs: str) -> str | None:
    """Why no graphed rows are measured on `devices` with --cuda-graphs
    `cuda_graphs`, or None when they are (a CUDA list, "auto" or "on").
    Raises ValueError naming --cuda-graphs for an unknown choice or for "on"
    with a CPU list."""
    if cuda_graphs not in CUDA_GRAPHS_CHOICES:
        raise ValueError(f"--cuda-graphs: expected one of {', '.join(CUDA_GRAPHS_CHOICES)}, but got {cuda_graphs!r}")
    if cuda_graphs == "off":
        return "cuda_graphs: not measured (--cuda-graphs off)"
    if devices[0].type != "cuda":
        if cuda_graphs == "on":
            raise ValueError(
                f"--cuda-graphs on needs a CUDA device list, but --devices is {[str(d) for d in devices]}: "
                f"CUDA graphs capture CUDA work only"
            )
        return CUDA_ONLY
    return None


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """GRAPH_TARGETS against `rows`: one {"model", "column", "op", "bound",
    "value", "met"} per target whose row is present with a value in that
    column (none on a CPU list, where nothing is graphed)."""
    by_name = {row["model"]: row for row in rows}
    checked = []
    for model, column, op, bound in GRAPH_TARGETS:
        value = by_name.get(model, {}).get(column)
        if value is not None:
            met = value <= bound if op == "<=" else value >= bound
            checked.append({"model": model, "column": column, "op": op, "bound": bound, "value": value, "met": met})
    return checked


def _compiled_row(
    devices: Sequence[torch.device], quick: bool, repeats: int, min_seconds: float, backend: str
) -> dict[str, Any]:
    """The compiled row (see the module docstring): the same columns as the
    other rows where they apply, measured on an MLP of 64-wide layers
    compiled with `backend`, plus ``eager_dpcore_ms`` and ``compile_s``."""
    first = devices[0]
    k = len(devices)
    depth = 4 if quick else 50
    name = f"MLP {depth}x64 compiled ({backend}), batch 32"
    torch.manual_seed(0)
    model = mlp(depth, 64).to(first)
    x = torch.randn(32, 64, device=first)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)
    dp = dpcore.DataParallel(compiled, device_ids=devices)
    eager = dpcore.DataParallel(model, device_ids=devices)
    xs, ys = x.chunk(k), y.chunk(k)

    def dp_step() -> None:
        _train_step(dp, opt, x, y)

    def split_step() -> None:
        _split_step(compiled, opt, xs, ys)

    def plain_step() -> None:
        _train_step(compiled, opt, x, y)

    started = time.perf_counter()
    for step in (dp_step, split_step, plain_step):  # compiles: every kind of replica and batch size
        step()
        step()
    synchronize(devices)
    compile_s = time.perf_counter() - started
    t_dp, t_split = measure_against(
        dp_step, split_step, devices, rounds=1 if quick else 5, repeats=max(2, repeats // 5)
    )
    t_plain = measure(plain_step, devices, warmup=1, repeats=repeats, min_seconds=min_seconds)
    t_eager = measure(
        lambda: _train_step(eager, opt, x, y), devices, warmup=1, repeats=repeats, min_seconds=min_seconds
    )
    print(
        f"  {name}: dpcore {t_dp * 1e3:.2f} ms, compiled sequential split {t_split * 1e3:.2f} ms, "
        f"ratio {t_dp / t_split:.3f}; eager dpcore {t_eager * 1e3:.2f} ms; compiling {compile_s:.1f} s"
    )
    unmeasured = (
        "unsynced_ms",
        "sync_ratio",
        "replicate_ms",
        "infer_ms",
        "check_ms",
        "check_vs_infer",
        "torch_replicate_ms",
        "torch_dp_ms",
        "speedup_vs_torch_dp",
        "graphed_ms",
        "graphed_vs_plain",
        "torch_dp_vs_graphed",
        "graphed_note",
        "graphed_error",
        "streams_off_ms",
        "streams_ratio",
    )
    return {
        "model": name,
        "devices": k,
        "batch": 32,
        "dpcore_ms": t_dp * 1e3,
        "sequential_split_ms": t_split * 1e3,
        "ratio": t_dp / t_split,
        "plain_full_batch_ms": t_plain * 1e3,
        **dict.fromkeys(unmeasured),
        "graphed_warnings": [],
        "compiled": backend,
        "eager_dpcore_ms": t_eager * 1e3,
        "compile_s": compile_s,
    }


def shares_generator(devices: Sequence[torch.device]) -> bool:
    """Whether two entries of `devices` draw from one default generator (two
    CPU entries, or one CUDA device twice): where replicas get random streams."""
    keys = [None if d.type == "cpu" else (d.type, d.index) for d in devices]
    return len(set(keys)) < len(keys)


def dropout_mlp(depth: int = 50, width: int = 64, p: float = 0.1) -> nn.Module:
    """mlp(depth, width) with a Dropout(p) after each ReLU."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(p)]
    return nn.Sequential(*layers)


@contextlib.contextmanager
def replica_rng_restored() -> Iterator[None]:
    """On exit, DPCORE_REPLICA_RNG is as it was on entry (set or unset)."""
    previous = os.environ.get("DPCORE_REPLICA_RNG")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("DPCORE_REPLICA_RNG", None)
        else:
            os.environ["DPCORE_REPLICA_RNG"] = previous


def streams_steps(devices: Sequence[torch.device]) -> tuple[Callable[[str], None], Callable[[], None]]:
    """(step, split) on dropout_mlp() at batch 32 on `devices`, one wrapper:
    ``step("1")`` is a training step with the random streams on,
    ``step("0")`` the same with DPCORE_REPLICA_RNG=0 (read at each parallel
    call, so both alternate in one process); ``split()`` the sequential
    1/K-batch baseline. `step` sets the variable: call it inside
    :func:`replica_rng_restored`."""
    first = devices[0]
    torch.manual_seed(0)
    model = dropout_mlp().to(first)
    x = torch.randn(32, 64, device=first)
    y = torch.randn(32, 64, device=first)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = dpcore.DataParallel(model, device_ids=devices)
    xs, ys = x.chunk(len(devices)), y.chunk(len(devices))

    def step(streams: str) -> None:
        os.environ["DPCORE_REPLICA_RNG"] = streams
        _train_step(dp, opt, x, y)

    return step, lambda: _split_step(model, opt, xs, ys)


def _streams_row(devices: Sequence[torch.device], quick: bool, repeats: int) -> dict[str, Any]:
    """The random-streams row (see the module docstring): the columns of the
    other rows where they apply, plus ``streams_off_ms`` and ``streams_ratio``."""
    k = len(devices)
    name = "MLP 50x64 + Dropout, batch 32, random streams"
    step, split = streams_steps(devices)
    rounds, each = (1 if quick else 5), max(2, repeats // 5)
    with replica_rng_restored():
        t_dp, t_split = measure_against(lambda: step("1"), split, devices, rounds=rounds, repeats=each)
        t_dp, t_off = measure_against(lambda: step("1"), lambda: step("0"), devices, rounds=rounds, repeats=each)
    print(
        f"  {name}: dpcore {t_dp * 1e3:.2f} ms, DPCORE_REPLICA_RNG=0 {t_off * 1e3:.2f} ms, "
        f"streams/off {t_dp / t_off:.3f}; sequential split {t_split * 1e3:.2f} ms"
    )
    row: dict[str, Any] = dict.fromkeys(key for key, _, _ in COLUMNS)
    row.update(
        {
            "model": name,
            "devices": k,
            "batch": 32,
            "dpcore_ms": t_dp * 1e3,
            "sequential_split_ms": t_split * 1e3,
            "ratio": t_dp / t_split,
            "streams_off_ms": t_off * 1e3,
            "streams_ratio": t_dp / t_off,
            "graphed_note": None,
            "graphed_warnings": [],
            "graphed_error": None,
            "compiled": None,
        }
    )
    return row


def _graphed_step(
    model: nn.Module, devices: Sequence[torch.device], opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[Callable[[], None], list[str]]:
    """A training step through a new ``cuda_graphs=True`` wrapper of `model`
    on `devices` (per-replica BatchNorm statistics), already called
    GRAPH_WARMUP times and synchronized; with the warnings those calls
    raised (one line each)."""
    graphed = dpcore.DataParallel(model, device_ids=list(devices), cuda_graphs=True)

    def step() -> None:
        _train_step(graphed, opt, x, y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(GRAPH_WARMUP):
            step()
        synchronize(devices)  # a capture's failure shows here, not in the first timed call
    return step, list(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))


def run(
    devices: Sequence[torch.device],
    quick: bool = False,
    repeats: int | None = None,
    min_seconds: float | None = None,
    cuda_graphs: str = "auto",
    compiled: str = "inductor",
) -> dict[str, Any]:
    """Measures every model on `devices`; returns the JSON-ready result. Each
    measurement runs at least `repeats` steps and `min_seconds` (defaults:
    10 and 0.5 s with `quick`, else 30 and 2 s; with `quick`, the wide MLP
    and the ResNets alternate with their baselines in one round instead of
    five: indicative figures for a short run). `cuda_graphs` ("auto",
    "on" or "off"): whether graphed rows are measured; "auto" measures them
    on a CUDA list only, "on" raises ValueError on a CPU list (see
    graphs_note). The result's "cuda_graphs" entry holds the choice,
    whether graphed rows were measured, and the note saying why not.
    `compiled`: the torch.compile backend of the compiled row, appended
    after the models, or "off" for none. The random-streams row comes last,
    on lists whose replicas share a generator (shares_generator)."""
    note = graphs_note(devices, cuda_graphs)
    if note is not None:
        print(f"  graphed rows not measured ({note})")
    repeats = repeats or (10 if quick else 30)
    if min_seconds is None:
        min_seconds = 0.5 if quick else 2.0
    first = devices[0]
    k = len(devices)
    rows: list[dict[str, Any]] = []
    overhead_models = {spec[0] for spec in _models(quick)}
    for name, factory, shape, batch, sync_bn in models(quick, first.type == "cuda" and not quick, k):
        # With quick, the larger models get the shortest protocol: one
        # alternating round, one warm-up call before the other timings.
        short = quick and name not in overhead_models
        torch.manual_seed(0)
        model = factory().to(first)
        x = torch.randn(batch, *shape, device=first)
        with torch.no_grad():
            y = torch.randn_like(model(x))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        dp = dpcore.DataParallel(model, device_ids=devices, sync_batchnorm=sync_bn)
        xs, ys = x.chunk(k), y.chunk(k)

        def measure_step(fn: Callable[[], Any]) -> float:
            return measure(fn, devices, warmup=1 if short else 3, repeats=repeats, min_seconds=min_seconds)

        def alternate(fn: Callable[[], Any], baseline: Callable[[], Any]) -> tuple[float, float]:
            # fn and its baseline alternate, so machine noise hits both alike.
            return measure_against(fn, baseline, devices, rounds=1 if short else 5, repeats=max(2, repeats // 5))

        def dp_step() -> None:
            _train_step(dp, opt, x, y)

        t_dp, t_split = alternate(dp_step, lambda: _split_step(model, opt, xs, ys))
        t_unsynced = None
        if sync_bn:
            unsynced = dpcore.DataParallel(model, device_ids=devices)
            t_dp, t_unsynced = alternate(dp_step, lambda: _train_step(unsynced, opt, x, y))
        t_plain = measure_step(lambda: _train_step(model, opt, x, y))

        def refresh() -> None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.0)  # a parameter update: every bucket must be copied again
            dp._pipeline.cache(dp).replicas(k)

        t_replicate = measure_step(refresh)
        t_infer, t_check = _check_cost(dp, x, measure_step)
        t_torch_replicate = None
        t_torch_dp = None
        if first.type == "cuda":
            indices = [d.index for d in devices]
            t_torch_replicate = measure_step(lambda: torch.nn.parallel.replicate(model, indices))
            try:
                tdp = torch.nn.DataParallel(model, device_ids=indices)
                t_torch_dp = measure_step(lambda: _train_step(tdp, opt, x, y))
            except RuntimeError as error:
                print(f"  torch.nn.DataParallel unavailable here: {error}".splitlines()[0])
        t_graphed = None
        graphed_warnings: list[str] = []
        graphed_error = None
        if note is None:
            try:
                graphed_step, graphed_warnings = _graphed_step(model, devices, opt, x, y)
                t_graphed = measure_step(graphed_step)
                del graphed_step  # its graphs and their memory pool go before the next model's
            except RuntimeError as error:  # recorded; main() exits 1 after writing the results
                graphed_error = f"{type(error).__name__}: {error}".splitlines()[0]
                print(f"  {name}: cuda_graphs=True FAILED: {graphed_error}")
        rows.append(
            {
                "model": name,
                "devices": k,
                "batch": batch,
                "dpcore_ms": t_dp * 1e3,
                "sequential_split_ms": t_split * 1e3,
                "ratio": t_dp / t_split,
                "unsynced_ms": None if t_unsynced is None else t_unsynced * 1e3,
                "sync_ratio": None if t_unsynced is None else t_dp / t_unsynced,
                "plain_full_batch_ms": t_plain * 1e3,
                "replicate_ms": t_replicate * 1e3,
                "infer_ms": t_infer * 1e3,
                "check_ms": t_check * 1e3,
                "check_vs_infer": t_check / (CHECK_INTERVAL_MAX * t_infer),
                "torch_replicate_ms": None if t_torch_replicate is None else t_torch_replicate * 1e3,
                "torch_dp_ms": None if t_torch_dp is None else t_torch_dp * 1e3,
                "speedup_vs_torch_dp": None if t_torch_dp is None else t_torch_dp / t_dp,
                "graphed_ms": None if t_graphed is None else t_graphed * 1e3,
                "graphed_vs_plain": None if t_graphed is None else t_graphed / t_plain,
                "torch_dp_vs_graphed": None if t_graphed is None or t_torch_dp is None else t_torch_dp / t_graphed,
                "graphed_note": (
                    "per-replica BatchNorm statistics: cuda_graphs=True cannot capture synchronized BatchNorm"
                    if t_graphed is not None and sync_bn
                    else None
                ),
                "graphed_warnings": graphed_warnings,
                "graphed_error": graphed_error,
                "compiled": None,
                "streams_off_ms": None,
                "streams_ratio": None,
            }
        )
        print(
            f"  {name}: dpcore {t_dp * 1e3:.2f} ms, sequential split {t_split * 1e3:.2f} ms, ratio {t_dp / t_split:.3f}"
        )
        print(
            f"  {name}: inference {t_infer * 1e3:.3f} ms, one check {t_check * 1e3:.3f} ms, amortized "
            f"{t_check / (CHECK_INTERVAL_MAX * t_infer):.3%} of a call"
        )
        if t_unsynced is not None:
            print(f"  {name}: sync_batchnorm=False {t_unsynced * 1e3:.2f} ms, sync/unsynced {t_dp / t_unsynced:.3f}")
        if t_graphed is not None:
            print(
                f"  {name}: cuda_graphs=True {t_graphed * 1e3:.2f} ms, x plain step {t_graphed / t_plain:.3f}"
                + ("" if t_torch_dp is None else f", torch DP / graphed {t_torch_dp / t_graphed:.2f}")
            )
            for line in graphed_warnings:
                print(f"  {name}: cuda_graphs warning: {line}")
    if compiled != "off":
        rows.append(_compiled_row(devices, quick, repeats, min_seconds, compiled))
    if shares_generator(devices):
        rows.append(_streams_row(devices, quick, repeats))
    targets = check_targets(rows)
    for target in targets:
        print(
            f"  target {'met' if target['met'] else 'MISSED'}: {target['model']}: {target['column']} "
            f"{target['value']:.3f} {target['op']} {target['bound']:g}"
        )
    return {
        "benchmark": "step",
        "devices": [str(d) for d in devices],
        "env": environment(),
        "targets": targets,
        "cuda_graphs": {
            "choice": cuda_graphs,
            "measured": note is None,
            "note": note,
            "warmup_calls": GRAPH_WARMUP if note is None else None,
        },
        "rows": rows,
    }


COLUMNS = [
    ("model", "model", "s"),
    ("dpcore_ms", "dpcore ms", ".2f"),
    ("sequential_split_ms", "K x 1/K plain ms", ".2f"),
    ("ratio", "ratio", ".3f"),
    ("unsynced_ms", "unsynced ms", ".2f"),
    ("sync_ratio", "x unsynced", ".3f"),
    ("plain_full_batch_ms", "plain ms", ".2f"),
    ("replicate_ms", "replicate ms", ".3f"),
    ("infer_ms", "infer ms", ".3f"),
    ("check_ms", "check ms", ".3f"),
    ("check_vs_infer", "check / infer", ".2%"),
    ("torch_replicate_ms", "torch replicate ms", ".3f"),
    ("torch_dp_ms", "torch DP ms", ".2f"),
    ("speedup_vs_torch_dp", "x torch DP", ".2f"),
    ("graphed_ms", "graphed ms", ".2f"),
    ("graphed_vs_plain", "graphed x plain", ".3f"),
    ("torch_dp_vs_graphed", "torch DP / graphed", ".2f"),
    ("streams_off_ms", "streams off ms", ".2f"),
    ("streams_ratio", "x streams off", ".3f"),
]


def _add_options(parser: argparse.ArgumentParser) -> None:
    """bench_step's own options: --cuda-graphs, --compiled and --min-seconds."""
    parser.add_argument(
        "--cuda-graphs",
        choices=CUDA_GRAPHS_CHOICES,
        default="auto",
        help="measure dpcore with cuda_graphs=True too: auto (default) on CUDA lists only, "
        "on (a CPU list is an error), off",
    )
    parser.add_argument(
        "--compiled",
        default="inductor",
        metavar="BACKEND",
        help="torch.compile backend of the compiled row (default inductor; off: no compiled row)",
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help="least time per measurement (default 2 s, 0.5 s with --quick)",
    )


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace, devices: list[torch.device]) -> None:
    """Exits with status 2 (parser.error) for --min-seconds below 0, an
    unknown --compiled backend or --cuda-graphs on with a CPU list."""
    if args.min_seconds is not None and not args.min_seconds >= 0:
        parser.error(f"--min-seconds: expected a number >= 0, but got {args.min_seconds}")
    if args.compiled != "off":
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if args.compiled not in known:
            parser.error(
                f"--compiled: expected off or a torch.compile backend ({', '.join(known)}), but got {args.compiled!r}"
            )
    try:
        graphs_note(devices, args.cuda_graphs)
    except ValueError as error:
        parser.error(str(error))


_command = bench_command("bench_step", __doc__, run, COLUMNS, _add_options, _check_options)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line (see the module docstring): runs, prints and writes
    the results; then exits with status 1, naming the models, when
    cuda_graphs=True failed on any of them (their rows' "graphed_error")."""
    result = _command(argv)
    failed = [row["model"] for row in result["rows"] if row.get("graphed_error")]
    if failed:
        sys.exit(f"bench_step: cuda_graphs=True failed on {'; '.join(failed)} (graphed_error in the results)")
    return result


if __name__ == "__main__":
    main()
