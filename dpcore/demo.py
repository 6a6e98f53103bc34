"""Trains a small CNN on scikit-learn's handwritten digits with dpcore.DataParallel.

The data are the 1,797 8x8 images that ship inside scikit-learn
(``sklearn.datasets.load_digits``, nothing is downloaded), split 80/20,
stratified, with a fixed seed. The model runs on every visible GPU or, with
none, on four CPU "devices" (``["cpu"] * 4``); the loss is computed inside
each replica (``DataParallel(..., criterion=...)``). torch's thread
settings are left as they are: on a CPU device list dpcore's worker pool
runs at most ``torch.get_num_threads()`` replicas at a time, sharing those
intra-op threads.

Before training, the first steps are run twice in float64 from the same
initial weights, once with DataParallel and once on a single device, and the
parameters (and BatchNorm buffers) are compared after each step: the run
stops with exit status 1 if they disagree.

``--sync-batchnorm`` adds BatchNorm after every hidden layer and synchronizes
it across the replicas (``DataParallel(..., sync_batchnorm=True)``), so the
check holds with BatchNorm too, running statistics included. ``--batchnorm``
alone adds the layers with per-replica statistics, as torch.nn.DataParallel
has them: a single device cannot reproduce those, so the check is skipped.

    python -m dpcore.demo                       # every GPU, else cpu:4
    python -m dpcore.demo --devices cpu:2 --epochs 5
    python -m dpcore.demo --devices 0,0         # two replicas on GPU 0
    python -m dpcore.demo --sync-batchnorm      # BatchNorm, synchronized

Needs scikit-learn and tqdm: ``pip install 'dpcore[demo]'``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import add_devices_argument, default_devices, devices_from_args, print_table

#: How many steps the float64 agreement check runs, and its tolerance on
#: every parameter element after each step.
CHECK_STEPS = 3
CHECK_ATOL = 1e-10

DEFAULTS = {"epochs": 12, "batch_size": 64, "lr": 0.1, "seed": 0}

HISTORY_COLUMNS = [
    ("epoch", "epoch", "d"),
    ("loss", "train loss", ".4f"),
    ("test_accuracy", "test acc", ".4f"),
    ("samples_per_second", "samples/s", ".0f"),
    ("seconds", "train s", ".2f"),
]

MISSING_DEPS = "dpcore.demo needs scikit-learn and tqdm, but {} missing: pip install 'dpcore[demo]'"


def _require_demo_deps() -> None:
    """Exits with a one-line message when scikit-learn or tqdm is missing."""
    missing = []
    for module, package in (("sklearn", "scikit-learn"), ("tqdm", "tqdm")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        sys.exit(MISSING_DEPS.format(" and ".join(missing) + (" is" if len(missing) == 1 else " are")))


def digits_cnn(batchnorm: bool = False) -> nn.Module:
    """A small CNN for 1x8x8 images and 10 classes (about 40k parameters).

    `batchnorm` adds BatchNorm2d after each convolution and BatchNorm1d after
    the hidden linear layer. Their statistics depend on how the batch is
    split unless DataParallel synchronizes them (``sync_batchnorm=True``)."""

    def norm(kind: type[nn.Module], channels: int) -> list[nn.Module]:
        return [kind(channels)] if batchnorm else []

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), *norm(nn.BatchNorm2d, 16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), *norm(nn.BatchNorm2d, 32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), *norm(nn.BatchNorm1d, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer of both the training run and the agreement check (the
    training run also decays the learning rate along a cosine; the check's
    three steps keep it constant, which changes nothing it compares)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def load_data(
    seed: int, device: torch.device, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test) on `device`: images as float32
    N x 1 x 8 x 8 scaled to [0, 1], labels as int64; a stratified 80/20 split
    with `seed`. `limit` keeps only that many images (stratified) first."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    if limit is not None and limit < len(labels):
        images, _, labels, _ = train_test_split(
            images, labels, train_size=limit, stratify=labels, random_state=seed
        )
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=seed
    )

    def images_to(x: Any) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32).div_(16.0).reshape(-1, 1, 8, 8).to(device)

    def labels_to(y: Any) -> torch.Tensor:
        return torch.tensor(y, dtype=torch.int64).to(device)

    return images_to(x_train), labels_to(y_train), images_to(x_test), labels_to(y_test)


def batches(n: int, batch_size: int, generator: torch.Generator, min_last: int = 1) -> list[torch.Tensor]:
    """A shuffled epoch: index tensors of `batch_size` (the last one may be
    shorter; one shorter than `min_last` is dropped: BatchNorm needs 2)."""
    parts = list(torch.randperm(n, generator=generator).split(batch_size))
    return parts if len(parts[-1]) >= min_last or len(parts) == 1 else parts[:-1]


def check_agreement(
    model: nn.Module,
    devices: Sequence[torch.device],
    x: torch.Tensor,
    y: torch.Tensor,
    order: Sequence[torch.Tensor],
    lr: float,
    steps: int = CHECK_STEPS,
    atol: float = CHECK_ATOL,
    sync_batchnorm: bool = False,
) -> dict[str, Any]:
    """Runs `steps` training steps in float64 from `model`'s current weights
    twice: with dpcore.DataParallel over `devices` (loss inside each replica,
    BatchNorm synchronized if `sync_batchnorm`) and with the bare model on
    devices[0], on the batches `order` of (x, y).

    Returns {"ok", "steps", "atol", "max_abs_diff" (per step: the largest
    difference of a parameter or buffer, such as BatchNorm's running
    statistics, after that step), "loss_diff" (per step)}; ok is True when
    `order` held `steps` batches and every parameter, buffer and loss agrees
    within `atol` after every step. `model` itself is not changed."""
    criterion = nn.CrossEntropyLoss()
    single = copy.deepcopy(model).double()
    parallel = copy.deepcopy(model).double()
    dp = dpcore.DataParallel(parallel, device_ids=list(devices), criterion=criterion, sync_batchnorm=sync_batchnorm)
    opt_single = make_optimizer(single.parameters(), lr)
    opt_parallel = make_optimizer(parallel.parameters(), lr)
    diffs: list[float] = []
    loss_diffs: list[float] = []
    for index in list(order)[:steps]:
        xb, yb = x[index].double(), y[index]
        opt_single.zero_grad()
        loss_single = criterion(single(xb), yb)
        loss_single.backward()
        opt_single.step()
        opt_parallel.zero_grad()
        loss_parallel = dp(xb, yb)
        loss_parallel.backward()
        opt_parallel.step()
        loss_diffs.append(abs(loss_single.item() - loss_parallel.item()))
        with torch.no_grad():
            diffs.append(max(
                (a.double() - b.double()).abs().max().item()
                for a, b in zip(single.state_dict().values(), parallel.state_dict().values())
            ))
    ok = len(diffs) == steps and all(d <= atol for d in diffs + loss_diffs)  # NaN fails too
    return {"ok": ok, "steps": len(diffs), "atol": atol, "max_abs_diff": diffs, "loss_diff": loss_diffs}


@torch.no_grad()
def accuracy(evaluator: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of `x` that `evaluator` classifies as `y`."""
    return (evaluator(x).argmax(dim=1) == y).double().mean().item()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dpcore.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_devices_argument(parser, "every GPU, else cpu:4")
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="training epochs (default %(default)s)")
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULTS["batch_size"],
        help="global batch size, split across the devices (default %(default)s)",
    )
    parser.add_argument(
        "--lr", type=float, default=DEFAULTS["lr"],
        help="peak SGD learning rate (momentum 0.9, cosine decay to 0 over the run; default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULTS["seed"], help="seed of the split, weights and shuffling (default %(default)s)"
    )
    parser.add_argument(
        "--batchnorm", action="store_true",
        help="add BatchNorm after every hidden layer, with per-replica statistics (the float64 check is skipped)",
    )
    parser.add_argument(
        "--sync-batchnorm", action="store_true",
        help="add BatchNorm after every hidden layer, synchronized across the replicas (implies --batchnorm)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (the per-epoch lines remain)")
    # For tests: train and test on a stratified subset of this many images.
    parser.add_argument("--limit", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[torch.device], str]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs: expected at least 1, but got {args.epochs}")
    if args.sync_batchnorm:
        args.batchnorm = True
    if args.batch_size < (2 if args.batchnorm else 1):
        parser.error(
            f"--batch-size: expected at least {2 if args.batchnorm else 1}"
            f"{' with BatchNorm' if args.batchnorm else ''}, but got {args.batch_size}"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr: expected a positive finite number, but got {args.lr}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed: expected an integer in [0, 2**32), but got {args.seed}")
    if args.limit is not None and args.limit < 50:
        parser.error(f"--limit: expected at least 50 images, but got {args.limit}")
    spec, devices = devices_from_args(parser, args.devices, default_devices(every_gpu=True))
    return args, devices, spec


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the demo with command-line arguments `argv` (default sys.argv[1:]).

    Returns the summary: {"devices", "epochs", "batch_size", "lr", "seed",
    "batchnorm" ("none", "per-replica" or "synchronized"), "train_samples", "test_samples",
    "final_accuracy", "samples_per_second" (all epochs' training samples
    over their training time), "seconds" (training time), "agreement" (True when the float64 check passed,
    None when it was skipped: per-replica BatchNorm), "agreement_check" (its details, see
    check_agreement; None when skipped), "history" (one
    dict per epoch)}. Exits with status 2 on a bad option (argparse), 1 when
    scikit-learn or tqdm is missing or the agreement check fails."""
    args, devices, spec = _parse(argv)
    _require_demo_deps()
    return _run(args, devices, spec)


def _report_check(check: dict[str, Any], devices: int) -> None:
    """Prints the agreement check's outcome; exits with status 1 when it failed."""
    worst = max(check["max_abs_diff"] + check["loss_diff"], default=float("nan"))
    if not check["ok"]:
        print(
            f"agreement check FAILED: DataParallel and single-device float64 runs differ by {worst:.3g} "
            f"(tolerance {check['atol']:g}) within the first {check['steps']} steps; per step: "
            + ", ".join(f"{d:.3g}" for d in check["max_abs_diff"]),
            file=sys.stderr,
        )
        raise SystemExit(1)
    print(
        f"agreement check passed: the first {check['steps']} steps in float64 with DataParallel over "
        f"{devices} device(s) and on one device from the same initial weights agree "
        f"(largest parameter, buffer or loss difference {worst:.2g} <= atol {check['atol']:g})"
    )


def _run(args: argparse.Namespace, devices: list[torch.device], spec: str) -> dict[str, Any]:
    """The demo proper, once the options are checked (see main)."""
    from tqdm import tqdm

    first = devices[0]
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed, first, args.limit)
    model = digits_cnn(args.batchnorm).to(first)
    generator = torch.Generator().manual_seed(args.seed)
    min_last = 2 if args.batchnorm else 1
    epoch_orders = [batches(len(y_train), args.batch_size, generator, min_last) for _ in range(args.epochs)]
    batchnorm = "synchronized" if args.sync_batchnorm else "per-replica" if args.batchnorm else "none"
    names = ", ".join(str(d) for d in devices)
    print(
        f"dpcore.demo: digits CNN{'' if batchnorm == 'none' else f' with {batchnorm} BatchNorm'} on "
        f"{len(devices)} device(s) [{names}] ({spec}); "
        f"{len(y_train)} train / {len(y_test)} test images, batch {args.batch_size}, "
        f"{args.epochs} epoch(s), SGD lr {args.lr} (momentum 0.9, cosine decay), seed {args.seed}"
    )

    # The check's batches are the run's first ones (repeated when the whole
    # run has fewer than CHECK_STEPS batches).
    first_batches = list(itertools.islice(itertools.cycle(itertools.chain(*epoch_orders)), CHECK_STEPS))
    check: dict[str, Any] | None = None
    if batchnorm == "per-replica":
        print(
            "agreement check skipped: BatchNorm with per-replica statistics (--batchnorm without "
            "--sync-batchnorm) normalizes each replica's chunk on its own, which one device cannot reproduce"
        )
    else:
        check = check_agreement(
            model, devices, x_train, y_train, first_batches, args.lr, sync_batchnorm=args.sync_batchnorm
        )
        _report_check(check, len(devices))

    criterion = nn.CrossEntropyLoss()
    trainer = dpcore.DataParallel(model, device_ids=devices, criterion=criterion, sync_batchnorm=args.sync_batchnorm)
    evaluator = dpcore.DataParallel(model, device_ids=devices)  # gathers the logits on devices[0]
    optimizer = make_optimizer(model.parameters(), args.lr)
    total_steps = sum(len(order) for order in epoch_orders)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
    )
    history: list[dict[str, Any]] = []
    for epoch, order in enumerate(epoch_orders, start=1):
        model.train()
        total_loss = torch.zeros((), device=first)
        bar = tqdm(
            order, desc=f"epoch {epoch}/{args.epochs}", unit="batch", leave=False,
            disable=args.no_progress, dynamic_ncols=True,
        )
        start = time.perf_counter()
        for step, index in enumerate(bar):
            xb, yb = x_train[index], y_train[index]
            optimizer.zero_grad(set_to_none=True)
            loss = trainer(xb, yb)
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += loss.detach() * len(index)
            if step % 8 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
        trained = sum(len(index) for index in order)
        mean_loss = total_loss.item() / trained  # also waits for queued GPU work
        seconds = time.perf_counter() - start
        bar.close()
        model.eval()
        acc = accuracy(evaluator, x_test, y_test)
        history.append({
            "epoch": epoch,
            "loss": mean_loss,
            "test_accuracy": acc,
            "samples_per_second": trained / seconds,
            "seconds": seconds,
        })
        print(
            f"epoch {epoch:>{len(str(args.epochs))}}/{args.epochs}  loss {mean_loss:.4f}  "
            f"test accuracy {acc:.4f}  {trained / seconds:,.0f} samples/s",
            flush=True,
        )

    train_seconds = sum(h["seconds"] for h in history)
    summary: dict[str, Any] = {
        "devices": [str(d) for d in devices],
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "batchnorm": batchnorm,
        "train_samples": len(y_train),
        "test_samples": len(y_test),
        "final_accuracy": history[-1]["test_accuracy"],
        "samples_per_second": sum(len(i) for order in epoch_orders for i in order) / train_seconds,
        "seconds": train_seconds,
        "agreement": None if check is None else check["ok"],
        "agreement_check": check,
        "history": history,
    }
    print()
    print_table(history, HISTORY_COLUMNS)
    print()
    print_table(
        [{
            "devices": spec,
            "epochs": args.epochs,
            "acc": summary["final_accuracy"],
            "sps": summary["samples_per_second"],
            "s": train_seconds,
            "check": "skipped" if check is None else f"passed ({check['steps']} steps, atol {check['atol']:g})",
        }],
        [
            ("devices", "devices", "s"),
            ("epochs", "epochs", "d"),
            ("acc", "final test acc", ".4f"),
            ("sps", "samples/s", ".0f"),
            ("s", "train s", ".2f"),
            ("check", "float64 agreement", "s"),
        ],
    )
    return summary


if __name__ == "__main__":
    main()
