"""Trains a small CNN on scikit-learn's handwritten digits with dpcore.DataParallel.

The images ship with scikit-learn (nothing is downloaded). The model runs on
every visible GPU, else on ``["cpu"] * 4``, with the loss computed inside each
replica. First, a few steps run in float64 with DataParallel and on one device
from the same weights: the run exits with status 1 if they disagree. Under
torchrun it trains one model over the processes (docs/hybrid.md).

    python examples/digits.py --devices cpu:2 --epochs 5
    python examples/digits.py --devices 0,0 --cuda-graphs
    torchrun --standalone --nproc-per-node 2 examples/digits.py --devices cpu:2

Needs scikit-learn and tqdm (``pip install --no-build-isolation ".[demo]"``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dpcore
from dpcore.bench._common import parse_devices, print_table

CHECK_STEPS = 3  # float64 steps compared against one device
CHECK_STEPS_GRAPHED = 8  # with --cuda-graphs: the warm-up and capture, then replays
CHECK_ATOL = 1e-10  # on every parameter, buffer and loss after each step
MISSING_DEPS = (
    "examples/digits.py needs scikit-learn and tqdm, but {} missing: pip install scikit-learn tqdm "
    '(or, in the dpcore source folder, pip install --no-build-isolation ".[demo]")'
)
SGD = functools.partial(torch.optim.SGD, momentum=0.9)  # the optimizer of the check and of the run


def digits_cnn(batchnorm: bool = False) -> nn.Module:
    """A small CNN for 1x8x8 images and 10 classes; `batchnorm` adds BatchNorm after each hidden layer."""

    def hidden(layer: nn.Module, norm: type[nn.Module], channels: int) -> list[nn.Module]:
        return [layer, *([norm(channels)] if batchnorm else []), nn.ReLU()]

    return nn.Sequential(
        *hidden(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d, 16),
        *hidden(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d, 32),
        nn.MaxPool2d(2),
        nn.Flatten(),
        *hidden(nn.Linear(32 * 4 * 4, 64), nn.BatchNorm1d, 64),
        nn.Linear(64, 10),
    )


def load_data(seed: int, device: torch.device, limit: int | None = None) -> list[torch.Tensor]:
    """[x_train, y_train, x_test, y_test] on `device`: float32 N x 1 x 8 x 8 images in [0, 1], int64 labels; a
    stratified 80/20 split with `seed`, of a stratified subset of `limit` images if given."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    if limit is not None and limit < len(y):
        x, _, y, _ = train_test_split(x, y, train_size=limit, stratify=y, random_state=seed)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    images = [torch.tensor(a, dtype=torch.float32).div_(16.0).reshape(-1, 1, 8, 8) for a in (x_train, x_test)]
    labels = [torch.tensor(a, dtype=torch.int64) for a in (y_train, y_test)]
    return [t.to(device) for t in (images[0], labels[0], images[1], labels[1])]


def batches(n: int, batch_size: int, generator: torch.Generator, min_last: int = 1) -> list[torch.Tensor]:
    """A shuffled epoch of index tensors; a last batch shorter than `min_last` is dropped."""
    parts = list(torch.randperm(n, generator=generator).split(batch_size))
    return parts if len(parts[-1]) >= min_last or len(parts) == 1 else parts[:-1]


def sampler_batches(n: int, batch_size: int, seed: int, epoch: int, world: int) -> list[torch.Tensor]:
    """One epoch as torch's DistributedSampler deals it to `world` processes: global batch b is every rank's b-th batch
    in rank order, so ``index.tensor_split(world)[r]`` is rank r's share."""
    from torch.utils.data import DistributedSampler

    local: list[tuple[torch.Tensor, ...]] = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        local.append(torch.tensor(list(sampler)).split(batch_size // world))
    return [torch.cat(parts) for parts in zip(*local)]


def _torchrun() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun, else None."""
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
    """Runs `steps` float64 steps on the batches `order` from copies of `model` with DataParallel over `devices` (each
    rank of a `process_group` feeding its share) and on devices[0]; returns {"ok", "steps", "atol", "max_abs_diff",
    "loss_diff"} (per step, the worst over all ranks, parameters and buffers)."""
    criterion, group = nn.CrossEntropyLoss(), process_group
    single, parallel = copy.deepcopy(model).double(), copy.deepcopy(model).double()
    run_single, run_parallel = (
        m if compile_backend is None else torch.compile(m, backend=compile_backend) for m in (single, parallel)
    )
    options = {"process_group": group, "sync_batchnorm": sync_batchnorm, "cuda_graphs": cuda_graphs}
    dp = dpcore.DataParallel(run_parallel, device_ids=list(devices), criterion=criterion, **options)
    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    opt_single, opt_parallel = SGD(single.parameters(), lr=lr), SGD(parallel.parameters(), lr=lr)
    diffs: list[float] = []
    loss_diffs: list[float] = []
    for index in list(order)[:steps]:
        share = index.tensor_split(world)[rank]
        loss_single = criterion(run_single(x[index].double()), y[index])
        loss_parallel = dp(x[share].double(), y[share])
        for loss, optimizer in ((loss_single, opt_single), (loss_parallel, opt_parallel)):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        loss_global = loss_parallel.detach()
        if group is not None:  # the mean over the global batch
            loss_global = loss_global * len(share)
            dist.all_reduce(loss_global, group=group)
            loss_global = loss_global / len(index)
        loss_diffs.append(abs(loss_single.item() - loss_global.item()))
        with torch.no_grad():
            pairs = zip(single.state_dict().values(), parallel.state_dict().values())
            diffs.append(max((a.double() - b.double()).abs().max().item() for a, b in pairs))
    if group is not None:
        worst = torch.tensor(diffs + loss_diffs, dtype=torch.float64, device=devices[0])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        diffs, loss_diffs = worst[: len(diffs)].tolist(), worst[len(diffs) :].tolist()
    ok = len(diffs) == steps and all(d <= atol for d in diffs + loss_diffs)  # NaN fails too
    return {"ok": ok, "steps": len(diffs), "atol": atol, "max_abs_diff": diffs, "loss_diff": loss_diffs}


def _default_devices() -> str:
    """Every visible GPU (under torchrun: an equal share per local process), else four CPU devices."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if _torchrun() else 1
        return ",".join(str(i) for i in range(max(1, torch.cuda.device_count() // local)))
    return "cpu:4"


def _local_devices(devices: list[torch.device], local_rank: int) -> list[torch.device]:
    """This process's devices under torchrun: CPU lists as given, CUDA indices offset by local_rank * (largest index +
    1); ValueError naming --devices when one is not visible."""
    if devices[0].type != "cuda" or local_rank == 0:
        return devices
    stride = max(d.index for d in devices) + 1
    moved, count = [d.index + local_rank * stride for d in devices], torch.cuda.device_count()
    if max(moved) >= count:
        raise ValueError(
            f"--devices: local rank {local_rank} would use CUDA devices {moved}, but only {count} are visible"
        )
    return [torch.device("cuda", i) for i in moved]


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[torch.device], str]:
    """(options, this process's devices, the --devices spec); a bad option exits 2 naming it."""
    parser = argparse.ArgumentParser(
        prog="python examples/digits.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--devices", help="'cpu:N' or CUDA indices such as '0,1' or '0,0' (default: every GPU, else cpu:4)")
    add("--epochs", type=int, default=12, help="training epochs (default %(default)s)")
    add("--batch-size", type=int, default=64, help="global batch size, split across the devices (default %(default)s)")
    add("--lr", type=float, default=0.1, help="peak SGD learning rate, cosine decay (default %(default)s)")
    add("--seed", type=int, default=0, help="seed of the split, weights and shuffling (default %(default)s)")
    add("--batchnorm", action="store_true", help="BatchNorm after every hidden layer, per replica (no float64 check)")
    add("--sync-batchnorm", action="store_true", help="BatchNorm synchronized across replicas (implies --batchnorm)")
    add("--cuda-graphs", action="store_true", help="replay forward and backward from CUDA graphs (CUDA devices only)")
    add("--compile", nargs="?", const="inductor", metavar="BACKEND", help="torch.compile with BACKEND (inductor)")
    add("--no-progress", action="store_true", help="no progress bars (the per-epoch lines remain)")
    add("--checkpoint", metavar="FILE", help="save the trained model's state_dict here (rank 0 under torchrun)")
    add("--limit", type=int, help=argparse.SUPPRESS)  # for tests: a stratified subset of this many images
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
        known = torch._dynamo.list_backends(exclude_tags=())
        if args.compile not in known:
            parser.error(f"--compile: expected a torch.compile backend ({', '.join(known)}), but got {args.compile!r}")
    args.batchnorm = args.batchnorm or args.sync_batchnorm
    if args.batch_size < 1 + args.batchnorm:
        suffix = " with BatchNorm" if args.batchnorm else ""
        parser.error(f"--batch-size: expected at least {1 + args.batchnorm}{suffix}, but got {args.batch_size}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr: expected a positive finite number, but got {args.lr}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed: expected an integer in [0, 2**32), but got {args.seed}")
    if args.limit is not None and args.limit < 50:
        parser.error(f"--limit: expected at least 50 images, but got {args.limit}")
    spec = args.devices if args.devices is not None else _default_devices()
    launch = _torchrun()
    if launch is not None and args.batchnorm and not args.sync_batchnorm:
        parser.error(
            "--batchnorm: not available under torchrun without --sync-batchnorm (per-replica statistics); "
            "--sync-batchnorm synchronizes BatchNorm across every replica of every process"
        )
    if launch is not None and args.batch_size % launch[1]:
        parser.error(f"--batch-size: expected a multiple of the {launch[1]} processes, but got {args.batch_size}")
    try:
        devices = parse_devices(spec)
        devices = devices if launch is None else _local_devices(devices, launch[2])
    except ValueError as error:
        parser.error(str(error))  # every message names --devices
    if args.cuda_graphs and devices[0].type != "cuda":
        given = f"--devices {spec}" if args.devices is not None else f"the default --devices {spec} (no GPU visible)"
        parser.error(
            f"--cuda-graphs: needs CUDA devices, but {given} is {', '.join(str(d) for d in devices)}: "
            f"CUDA graphs capture CUDA work only"
        )
    return args, devices, spec


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the demo on the command line `argv` and returns its summary ("agreement" is None when the check is skipped);
    exits 2 on a bad option, 1 when scikit-learn or tqdm is missing or the check fails."""
    args, devices, spec = _parse(argv)
    missing = []
    for module, package in (("sklearn", "scikit-learn"), ("tqdm", "tqdm")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        sys.exit(MISSING_DEPS.format(" and ".join(missing) + (" is" if len(missing) == 1 else " are")))
    if _torchrun() is None:
        return _run(args, devices, spec)
    owned = not dist.is_initialized()
    if owned:
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])
        dist.init_process_group("nccl" if devices[0].type == "cuda" else "gloo")
    try:
        return _run(args, devices, spec, dist.group.WORLD)
    finally:
        if owned:  # the wrappers collected before the group goes (docs/hybrid.md)
            gc.collect()
            dist.destroy_process_group()


def _run(args: argparse.Namespace, devices: list[torch.device], spec: str, group: Any = None) -> dict[str, Any]:
    """The demo once the options are checked; `group`: the process group of a torchrun launch."""
    from tqdm import tqdm

    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    say = print if rank == 0 else lambda *a, **k: None
    first = devices[0]
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed, first, args.limit)
    model = digits_cnn(args.batchnorm).to(first)
    generator = torch.Generator().manual_seed(args.seed)
    if group is None:
        orders = [batches(len(y_train), args.batch_size, generator, 1 + args.batchnorm) for _ in range(args.epochs)]
    else:
        orders = [sampler_batches(len(y_train), args.batch_size, args.seed, e, world) for e in range(args.epochs)]
    where = f"{world} processes x {len(devices)} devices" if group is not None else f"{len(devices)} device(s)"
    batchnorm = "synchronized" if args.sync_batchnorm else "per-replica" if args.batchnorm else "none"
    extras = ", CUDA graphs" if args.cuda_graphs else ""
    extras += f", torch.compile (backend {args.compile})" if args.compile is not None else ""
    say(
        f"examples/digits.py: digits CNN{'' if batchnorm == 'none' else f' with {batchnorm} BatchNorm'} on {where} "
        f"[{', '.join(str(d) for d in devices)}] ({spec}{extras}); {len(y_train)} train / {len(y_test)} test "
        f"images, batch {args.batch_size}, {args.epochs} epoch(s), SGD lr {args.lr} (momentum 0.9, cosine decay), "
        f"seed {args.seed}"
    )

    options = {"process_group": group, "sync_batchnorm": args.sync_batchnorm, "cuda_graphs": args.cuda_graphs}
    check: dict[str, Any] | None = None
    if batchnorm == "per-replica":
        say(
            "agreement check skipped: BatchNorm with per-replica statistics (--batchnorm without "
            "--sync-batchnorm) normalizes each replica's chunk on its own, which one device cannot reproduce"
        )
    else:
        steps = CHECK_STEPS_GRAPHED if args.cuda_graphs else CHECK_STEPS
        # The run's first batches (repeated when the run has fewer).
        order = list(itertools.islice(itertools.cycle(itertools.chain(*orders)), steps))
        check = check_agreement(
            model, devices, x_train, y_train, order, args.lr, steps=steps, compile_backend=args.compile, **options
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

    compiled = model if args.compile is None else torch.compile(model, backend=args.compile)
    trainer = dpcore.DataParallel(compiled, device_ids=devices, criterion=nn.CrossEntropyLoss(), **options)
    evaluator = dpcore.DataParallel(model, device_ids=devices)  # every rank evaluates the whole test set
    optimizer = SGD(model.parameters(), lr=args.lr)
    total_steps = sum(len(order) for order in orders)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * s / total_steps)))
    history: list[dict[str, Any]] = []
    for epoch, order in enumerate(orders, start=1):
        model.train()
        total_loss = torch.zeros((), device=first)
        disable = args.no_progress or rank != 0
        bar = tqdm(
            order, desc=f"epoch {epoch}/{args.epochs}", unit="batch", leave=False, disable=disable, dynamic_ncols=True
        )
        start = time.perf_counter()
        for step, index in enumerate(bar):
            share = index.tensor_split(world)[rank]  # the whole batch in a single process
            optimizer.zero_grad(set_to_none=True)
            loss = trainer(x_train[share], y_train[share])
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
        with torch.no_grad():
            acc = (evaluator(x_test).argmax(dim=1) == y_test).double().mean().item()
        rate = trained / seconds
        history.append(
            {"epoch": epoch, "loss": mean_loss, "test_accuracy": acc, "samples_per_second": rate, "seconds": seconds}
        )
        say(
            f"epoch {epoch:>{len(str(args.epochs))}}/{args.epochs}  loss {mean_loss:.4f}  "
            f"test accuracy {acc:.4f}  {rate:,.0f} samples/s",
            flush=True,
        )

    train_seconds = sum(h["seconds"] for h in history)
    summary = {k: getattr(args, k) for k in ("epochs", "batch_size", "lr", "seed", "cuda_graphs", "compile")}
    summary.update(devices=[str(d) for d in devices], batchnorm=batchnorm, processes=world, history=history)
    summary.update(train_samples=len(y_train), test_samples=len(y_test), final_accuracy=acc, seconds=train_seconds)
    summary["samples_per_second"] = sum(len(i) for order in orders for i in order) / train_seconds
    summary.update(agreement=None if check is None else check["ok"], agreement_check=check)
    if args.checkpoint and rank == 0:
        torch.save(model.state_dict(), args.checkpoint)
        say(f"checkpoint written to {args.checkpoint}")
    if rank != 0:
        return summary
    columns = [("epoch", "epoch", "d"), ("loss", "train loss", ".4f"), ("test_accuracy", "test acc", ".4f")]
    print()
    print_table(history, columns + [("samples_per_second", "samples/s", ".0f"), ("seconds", "train s", ".2f")])
    print()
    row = {**summary, "devices": spec if group is None else f"{world} x {spec}"}
    row["check"] = "skipped" if check is None else f"passed ({check['steps']} steps, atol {check['atol']:g})"
    columns = [("devices", "devices", "s"), ("epochs", "epochs", "d"), ("final_accuracy", "final test acc", ".4f")]
    columns += [("samples_per_second", "samples/s", ".0f"), ("seconds", "train s", ".2f")]
    print_table([row], columns + [("check", "float64 agreement", "s")])
    return summary


if __name__ == "__main__":
    main()
