"""Trains a small CNN on scikit-learn's handwritten digits with dpcore.DataParallel.

The 1,797 8x8 images ship with scikit-learn (nothing is downloaded), split
80/20 with a fixed seed. The model runs on every visible GPU, else on
``["cpu"] * 4``, with the loss computed inside each replica. Before
training, the first steps run twice in float64 from the same weights, with
DataParallel and on one device: the run exits with status 1 if parameters
or BatchNorm buffers disagree (docs/notebooks.md and the options below say
what each flag adds to that check). Started by torchrun, it trains one
model over the processes in hybrid mode (docs/hybrid.md).

    python -m dpcore.demo                       # every GPU, else cpu:4
    python -m dpcore.demo --devices cpu:2 --epochs 5
    python -m dpcore.demo --devices 0,0         # two replicas on GPU 0
    python -m dpcore.demo --sync-batchnorm      # BatchNorm, synchronized
    python -m dpcore.demo --devices 0,0 --cuda-graphs
    python -m dpcore.demo --compile             # DataParallel(torch.compile(model))
    torchrun --standalone --nproc-per-node 2 -m dpcore.demo --devices cpu:2

Needs scikit-learn and tqdm (dpcore's demo extras: ``pip install
--no-build-isolation ".[demo]"``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import parse_devices, print_table

#: How many steps the float64 agreement check runs, and its tolerance on
#: every parameter element after each step.
CHECK_STEPS = 3
CHECK_ATOL = 1e-10

#: How many steps the check runs with --cuda-graphs: enough for
#: DataParallel's eager warm-up and capture to be followed by replays.
CHECK_STEPS_GRAPHED = 8

DEFAULTS = {"epochs": 12, "batch_size": 64, "lr": 0.1, "seed": 0}

HISTORY_COLUMNS = [
    ("epoch", "epoch", "d"),
    ("loss", "train loss", ".4f"),
    ("test_accuracy", "test acc", ".4f"),
    ("samples_per_second", "samples/s", ".0f"),
    ("seconds", "train s", ".2f"),
]

MISSING_DEPS = (
    "dpcore.demo needs scikit-learn and tqdm, but {} missing: pip install scikit-learn tqdm "
    '(or, in the dpcore source folder, pip install --no-build-isolation ".[demo]")'
)


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
        nn.Conv2d(1, 16, 3, padding=1),
        *norm(nn.BatchNorm2d, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        *norm(nn.BatchNorm2d, 32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        *norm(nn.BatchNorm1d, 64),
        nn.ReLU(),
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
        images, _, labels, _ = train_test_split(images, labels, train_size=limit, stratify=labels, random_state=seed)
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


def sampler_batches(n: int, batch_size: int, seed: int, epoch: int, world: int) -> list[torch.Tensor]:
    """One epoch as torch's DistributedSampler deals it to `world` processes:
    rank r takes batches of batch_size / world from its sampler; global batch
    b is rank 0's b-th batch, then rank 1's, and so on, so that
    ``index.tensor_split(world)[r]`` is rank r's share (every rank gets the
    same number of samples, so the shares of a batch have equal sizes)."""
    from torch.utils.data import DistributedSampler

    local: list[tuple[torch.Tensor, ...]] = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        local.append(torch.tensor(list(sampler)).split(batch_size // world))
    return [torch.cat(parts) for parts in zip(*local)]


def _silent(*args: Any, **kwargs: Any) -> None:
    """print's stand-in on ranks other than 0."""


def _torchrun() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun (RANK and
    WORLD_SIZE in the environment), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def check_agreement(
    model: nn.Module,
    devices: Sequence[torch.device],
    x: torch.Tensor,
    y: torch.Tensor,
    order: Sequence[torch.Tensor],
    lr: float,
    steps: int = CHECK_STEPS,
    atol: float = CHECK_ATOL,
    process_group: Any = None,
    sync_batchnorm: bool = False,
    cuda_graphs: bool = False,
    compile_backend: str | None = None,
) -> dict[str, Any]:
    """Runs `steps` training steps in float64 from `model`'s current weights
    twice: with dpcore.DataParallel over `devices` (loss inside each replica,
    BatchNorm synchronized if `sync_batchnorm`, forward and backward
    replayed from CUDA graphs after the warm-up if `cuda_graphs`) and with
    the bare model on devices[0], on the batches `order` of (x, y). With a
    `compile_backend`, both runs are of the model under
    ``torch.compile(backend=compile_backend)``.
    With a `process_group` of P processes, the DataParallel is the hybrid one
    and this process feeds it its share ``index.tensor_split(P)[rank]`` of
    each global batch, while the single-device run takes the whole batch; the
    loss compared is the global one, and every rank returns the largest
    differences over all ranks.

    Returns {"ok", "steps", "atol", "max_abs_diff" (per step: the largest
    difference of a parameter or buffer, such as BatchNorm's running
    statistics, after that step), "loss_diff" (per step)}; ok is True when
    `order` held `steps` batches and every parameter, buffer and loss agrees
    within `atol` after every step. `model` itself is not changed."""
    criterion = nn.CrossEntropyLoss()
    single = copy.deepcopy(model).double()
    parallel = copy.deepcopy(model).double()
    run_single = single if compile_backend is None else torch.compile(single, backend=compile_backend)
    dp = dpcore.DataParallel(
        parallel if compile_backend is None else torch.compile(parallel, backend=compile_backend),
        device_ids=list(devices),
        criterion=criterion,
        process_group=process_group,
        sync_batchnorm=sync_batchnorm,
        cuda_graphs=cuda_graphs,
    )
    rank, world = 0, 1
    if process_group is not None:
        import torch.distributed as dist

        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    opt_single = make_optimizer(single.parameters(), lr)
    opt_parallel = make_optimizer(parallel.parameters(), lr)
    diffs: list[float] = []
    loss_diffs: list[float] = []
    for index in list(order)[:steps]:
        xb, yb = x[index].double(), y[index]
        opt_single.zero_grad()
        loss_single = criterion(run_single(xb), yb)
        loss_single.backward()
        opt_single.step()
        opt_parallel.zero_grad()
        share = index.tensor_split(world)[rank]
        loss_parallel = dp(x[share].double(), y[share])
        loss_parallel.backward()
        opt_parallel.step()
        loss_global = loss_parallel.detach()
        if process_group is not None:  # the mean over the global batch
            loss_global = loss_global * len(share)
            dist.all_reduce(loss_global, group=process_group)
            loss_global = loss_global / len(index)
        loss_diffs.append(abs(loss_single.item() - loss_global.item()))
        with torch.no_grad():
            diffs.append(
                max(
                    (a.double() - b.double()).abs().max().item()
                    for a, b in zip(single.state_dict().values(), parallel.state_dict().values())
                )
            )
    if process_group is not None:  # every rank decides on the worst difference anywhere
        worst = torch.tensor(diffs + loss_diffs, dtype=torch.float64, device=devices[0])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=process_group)
        diffs, loss_diffs = worst[: len(diffs)].tolist(), worst[len(diffs) :].tolist()
    ok = len(diffs) == steps and all(d <= atol for d in diffs + loss_diffs)  # NaN fails too
    return {"ok": ok, "steps": len(diffs), "atol": atol, "max_abs_diff": diffs, "loss_diff": loss_diffs}


@torch.no_grad()
def accuracy(evaluator: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of `x` that `evaluator` classifies as `y`."""
    return (evaluator(x).argmax(dim=1) == y).double().mean().item()


def _default_devices() -> str:
    """Every visible GPU (under torchrun: an equal share per local process), else four CPU devices."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if _torchrun() else 1
        return ",".join(str(i) for i in range(max(1, torch.cuda.device_count() // local)))
    return "cpu:4"


def _local_devices(devices: list[torch.device], local_rank: int) -> list[torch.device]:
    """This process's devices under torchrun: CPU lists as given, CUDA
    indices offset by local_rank * (largest index + 1). Raises ValueError
    naming --devices when an offset index is not visible."""
    if devices[0].type != "cuda" or local_rank == 0:
        return devices
    stride = max(d.index for d in devices) + 1
    moved = [torch.device("cuda", d.index + local_rank * stride) for d in devices]
    count = torch.cuda.device_count()
    if any(d.index >= count for d in moved):
        raise ValueError(
            f"--devices: local rank {local_rank} would use CUDA devices {[d.index for d in moved]}, "
            f"but only {count} are visible"
        )
    return moved


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dpcore.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="'cpu:N' (N CPU replicas) or CUDA indices such as '0,1' or '0,0'; default: every GPU, else cpu:4",
    )
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="training epochs (default %(default)s)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULTS["batch_size"],
        help="global batch size, split across the devices (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=DEFAULTS["lr"],
        help="peak SGD learning rate (momentum 0.9, cosine decay to 0 over the run; default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS["seed"],
        help="seed of the split, weights and shuffling (default %(default)s)",
    )
    parser.add_argument(
        "--batchnorm",
        action="store_true",
        help="add BatchNorm after every hidden layer, with per-replica statistics (the float64 check is skipped)",
    )
    parser.add_argument(
        "--sync-batchnorm",
        action="store_true",
        help="add BatchNorm after every hidden layer, synchronized across the replicas (implies --batchnorm)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay each replica's forward and backward from CUDA graphs after a warm-up "
        "(DataParallel(cuda_graphs=True)); CUDA devices only, not with --sync-batchnorm",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="train DataParallel(torch.compile(model, backend=BACKEND)) (default backend: inductor); "
        "not with --cuda-graphs",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (the per-epoch lines remain)")
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="FILE",
        help="save the trained model's state_dict here (torch.save; from rank 0 only under torchrun)",
    )
    # For tests: train and test on a stratified subset of this many images.
    parser.add_argument("--limit", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[torch.device], str]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs: expected at least 1, but got {args.epochs}")
    if args.cuda_graphs and args.sync_batchnorm:
        parser.error(
            "--cuda-graphs: not with --sync-batchnorm (synchronized BatchNorm meets on the host inside "
            "forward, which a CUDA graph cannot capture)"
        )
    if args.compile is not None:
        if args.cuda_graphs:
            parser.error("--compile: not with --cuda-graphs (cuda_graphs=True does not capture compiled modules)")
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if args.compile not in known:
            parser.error(f"--compile: expected a torch.compile backend ({', '.join(known)}), but got {args.compile!r}")
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
    spec = args.devices if args.devices is not None else _default_devices()
    launch = _torchrun()
    if launch is not None and args.batchnorm and not args.sync_batchnorm:
        # Per-replica statistics: nothing for the float64 check to compare across processes.
        parser.error(
            "--batchnorm: not available under torchrun without --sync-batchnorm (per-replica statistics); "
            "--sync-batchnorm synchronizes BatchNorm across every replica of every process"
        )
    if launch is not None and args.batch_size % launch[1]:
        parser.error(f"--batch-size: expected a multiple of the {launch[1]} processes, but got {args.batch_size}")
    try:
        devices = parse_devices(spec)
        if launch is not None:
            devices = _local_devices(devices, launch[2])
    except ValueError as error:
        message = str(error)
        parser.error(message if message.startswith("--devices") else f"--devices: {message}")
    if args.cuda_graphs and devices[0].type != "cuda":
        given = f"--devices {spec}" if args.devices is not None else f"the default --devices {spec} (no GPU visible)"
        parser.error(
            f"--cuda-graphs: needs CUDA devices, but {given} is {', '.join(str(d) for d in devices)}: "
            f"CUDA graphs capture CUDA work only"
        )
    return args, devices, spec


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the demo with command-line arguments `argv` (default sys.argv[1:]).

    Returns the summary: {"devices", "epochs", "batch_size", "lr", "seed",
    "train_samples", "test_samples",
    "cuda_graphs" (whether --cuda-graphs was given), "compile" (the
    --compile backend, or None),
    "final_accuracy", "samples_per_second" (all epochs' training samples
    over their training time), "seconds" (training time), "agreement" (True when the float64 check passed,
    None when it was skipped: per-replica BatchNorm), "agreement_check" (its details, see
    check_agreement; None when skipped), "batchnorm" ("none", "per-replica" or "synchronized"), "history" (one
    dict per epoch), "processes" (1, or the torchrun world size)}. Exits
    with status 2 on a bad option (argparse), 1 when scikit-learn or tqdm is
    missing or the agreement check fails."""
    args, devices, spec = _parse(argv)
    _require_demo_deps()
    if _torchrun() is None:
        return _run(args, devices, spec)
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])
        dist.init_process_group("nccl" if devices[0].type == "cuda" else "gloo")
    try:
        return _run(args, devices, spec, dist.group.WORLD)
    finally:
        if owned:
            # Teardown in this order: the wrappers (locals of _run, some held
            # only by reference cycles) are collected first, then the group
            # is destroyed. A hybrid wrapper still alive at interpreter exit
            # can make torch's gloo abort after a successful run (exit 1).
            gc.collect()
            dist.destroy_process_group()


def _run(args: argparse.Namespace, devices: list[torch.device], spec: str, group: Any = None) -> dict[str, Any]:
    """The demo proper, once the options are checked (see main); `group`:
    the process group of a torchrun launch (hybrid data parallelism)."""
    from tqdm import tqdm

    rank, world = 0, 1
    if group is not None:
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
    say = print if rank == 0 else _silent
    first = devices[0]
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed, first, args.limit)
    model = digits_cnn(args.batchnorm).to(first)
    generator = torch.Generator().manual_seed(args.seed)
    if group is None:
        min_last = 2 if args.batchnorm else 1
        epoch_orders = [batches(len(y_train), args.batch_size, generator, min_last) for _ in range(args.epochs)]
    else:
        epoch_orders = [
            sampler_batches(len(y_train), args.batch_size, args.seed, epoch, world) for epoch in range(args.epochs)
        ]
    names = ", ".join(str(d) for d in devices)
    where = f"{world} processes x {len(devices)} devices" if group is not None else f"{len(devices)} device(s)"
    batchnorm = "synchronized" if args.sync_batchnorm else "per-replica" if args.batchnorm else "none"
    graphs = ", CUDA graphs" if args.cuda_graphs else ""
    graphs += f", torch.compile (backend {args.compile})" if args.compile is not None else ""
    say(
        f"dpcore.demo: digits CNN{'' if batchnorm == 'none' else f' with {batchnorm} BatchNorm'} on {where} "
        f"[{names}] ({spec}{graphs}); "
        f"{len(y_train)} train / {len(y_test)} test images, batch {args.batch_size}, "
        f"{args.epochs} epoch(s), SGD lr {args.lr} (momentum 0.9, cosine decay), seed {args.seed}"
    )

    # The check's batches are the run's first ones (repeated when the whole
    # run has fewer than the check's steps).
    check_steps = CHECK_STEPS_GRAPHED if args.cuda_graphs else CHECK_STEPS
    first_batches = list(itertools.islice(itertools.cycle(itertools.chain(*epoch_orders)), check_steps))
    check: dict[str, Any] | None = None
    if batchnorm == "per-replica":
        say(
            "agreement check skipped: BatchNorm with per-replica statistics (--batchnorm without "
            "--sync-batchnorm) normalizes each replica's chunk on its own, which one device cannot reproduce"
        )
    else:
        check = check_agreement(
            model,
            devices,
            x_train,
            y_train,
            first_batches,
            args.lr,
            steps=check_steps,
            process_group=group,
            sync_batchnorm=args.sync_batchnorm,
            cuda_graphs=args.cuda_graphs,
            compile_backend=args.compile,
        )
        worst = max(check["max_abs_diff"] + check["loss_diff"], default=float("nan"))
        if not check["ok"]:
            say(
                f"agreement check FAILED: DataParallel and single-device float64 runs differ by {worst:.3g} "
                f"(tolerance {check['atol']:g}) within the first {check['steps']} steps; per step: "
                + ", ".join(f"{d:.3g}" for d in check["max_abs_diff"]),
                file=sys.stderr,
            )
            raise SystemExit(1)
        say(
            f"agreement check passed: the first {check['steps']} steps in float64 with DataParallel over "
            f"{where} and on one device from the same initial weights agree "
            f"(largest parameter, buffer or loss difference {worst:.2g} <= atol {check['atol']:g})"
        )

    criterion = nn.CrossEntropyLoss()
    trainer = dpcore.DataParallel(
        model if args.compile is None else torch.compile(model, backend=args.compile),
        device_ids=devices,
        criterion=criterion,
        process_group=group,
        sync_batchnorm=args.sync_batchnorm,
        cuda_graphs=args.cuda_graphs,
    )
    # Every rank evaluates the whole test set (the same weights, the same result); no collective.
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
            order,
            desc=f"epoch {epoch}/{args.epochs}",
            unit="batch",
            leave=False,
            disable=args.no_progress or rank != 0,
            dynamic_ncols=True,
        )
        start = time.perf_counter()
        for step, index in enumerate(bar):
            share = index.tensor_split(world)[rank]  # the whole batch in a single process
            xb, yb = x_train[share], y_train[share]
            optimizer.zero_grad(set_to_none=True)
            loss = trainer(xb, yb)
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += loss.detach() * len(share)
            if step % 8 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
        if group is not None:
            dist.all_reduce(total_loss, group=group)
        trained = sum(len(index) for index in order)
        mean_loss = total_loss.item() / trained  # also waits for queued GPU work
        seconds = time.perf_counter() - start
        bar.close()
        model.eval()
        acc = accuracy(evaluator, x_test, y_test)
        history.append(
            {
                "epoch": epoch,
                "loss": mean_loss,
                "test_accuracy": acc,
                "samples_per_second": trained / seconds,
                "seconds": seconds,
            }
        )
        say(
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
        "cuda_graphs": args.cuda_graphs,
        "compile": args.compile,
        "train_samples": len(y_train),
        "test_samples": len(y_test),
        "final_accuracy": history[-1]["test_accuracy"],
        "samples_per_second": sum(len(i) for order in epoch_orders for i in order) / train_seconds,
        "seconds": train_seconds,
        "agreement": None if check is None else check["ok"],
        "agreement_check": check,
        "history": history,
        "processes": world,
    }
    if args.checkpoint and rank == 0:
        torch.save(model.state_dict(), args.checkpoint)
        say(f"checkpoint written to {args.checkpoint}")
    if rank != 0:
        return summary
    print()
    print_table(history, HISTORY_COLUMNS)
    print()
    print_table(
        [
            {
                "devices": spec if group is None else f"{world} x {spec}",
                "epochs": args.epochs,
                "acc": summary["final_accuracy"],
                "sps": summary["samples_per_second"],
                "s": train_seconds,
                "check": "skipped" if check is None else f"passed ({check['steps']} steps, atol {check['atol']:g})",
            }
        ],
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
