"""One rank of a test of dpcore's hybrid data parallelism (run by
tests/test_distributed.py, never collected by pytest itself).

    python distributed_worker.py SCENARIO OUT_DIR

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a gloo group on
127.0.0.1, 120 s to start) and DPCORE_TEST_PG_TIMEOUT (the timeout in
seconds of the group the failure scenarios use). The
rank writes its results as JSON to OUT_DIR/rank<r>.json; an exception is
recorded there as {"error": type name, "message", "seconds"} (seconds since
the step that failed began).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpcore

#: Replicas per rank: rank r of a P-process run uses REPLICAS[P][r] CPU devices.
REPLICAS = {1: [2], 2: [2, 2], 3: [2, 1, 3]}
STEPS = 3
#: This rank's device: the CPU (gloo), or with DPCORE_TEST_BACKEND=nccl the
#: GPU of its rank (set in main).
DEVICE = torch.device("cpu")


def local_devices(world: int, rank: int) -> list[Any]:
    """The device list of rank `rank`: REPLICAS CPU devices, or its one GPU."""
    return ["cpu"] * REPLICAS[world][rank] if DEVICE.type == "cpu" else [DEVICE]


class Net(nn.Module):
    """Linear-tanh-linear returning (hidden, output); a buffer scales the
    hidden layer, ``extra`` is used only when asked, ``never`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 3)
        self.extra = nn.Linear(5, 3)
        self.never = nn.Parameter(torch.zeros(2))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.fc1(x)) * self.scale
        out = self.fc2(hidden)
        if use_extra:
            out = out + self.extra(x)
        return hidden, out


class Criterion(nn.Module):
    """Cross entropy of the second output, with a `reduction` attribute as torch's losses have."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output[1], target, reduction=self.reduction)


def user_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """A mean loss over the batch that uses both outputs (the hidden one also
    feeds the other, so a gradient reaches it along two paths)."""
    hidden, out = output
    return F.mse_loss(out, target) + 0.1 * hidden.pow(2).mean()


class Runner:
    """The rank's view of one equality check: a single-device reference on
    the global batch and the hybrid model on this rank's share of it."""

    def __init__(self, rank: int, world: int, group: Any = None, **options: Any) -> None:
        self.rank, self.world = rank, world
        torch.manual_seed(0)
        self.reference = Net().double()
        torch.manual_seed(100 + rank)  # other ranks start elsewhere: construction must broadcast rank 0's
        self.model = Net().double()
        with torch.no_grad():
            self.model.scale.fill_(1.0 + rank)
        if rank == 0:
            self.model.load_state_dict(self.reference.state_dict())
        self.model.to(DEVICE)
        self.dp = dpcore.DataParallel(
            self.model, local_devices(world, rank), process_group=group or dist.group.WORLD, **options
        )
        self.opt_ref = torch.optim.SGD(self.reference.parameters(), lr=0.1, momentum=0.9)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.generator = torch.Generator().manual_seed(7)
        self.worst = 0.0

    def batch(self, sizes: list[int], classes: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One global batch (the same on every rank), as per-rank slices."""
        n = sum(sizes)
        x = torch.randn(n, 5, generator=self.generator, dtype=torch.float64)
        if classes:
            y = torch.randint(0, 3, (n,), generator=self.generator)
        else:
            y = torch.randn(n, 3, generator=self.generator, dtype=torch.float64)
        return list(x.split(sizes)), list(y.split(sizes))

    def compare(self) -> None:
        """Records the largest difference of parameters and gradients; a
        gradient that is None on one side only counts as infinitely
        different (an unused parameter keeps .grad None, as on one device)."""
        for a, b in zip(self.reference.parameters(), self.model.parameters()):
            self.worst = max(self.worst, (a - b.cpu()).abs().max().item())
            if (a.grad is None) != (b.grad is None):
                self.worst = float("inf")
            elif a.grad is not None:
                self.worst = max(self.worst, (a.grad - b.grad.cpu()).abs().max().item())

    def step(self) -> None:
        self.compare()
        self.opt_ref.step()
        self.opt.step()
        self.compare()

    def zero_grad(self) -> None:
        self.opt_ref.zero_grad()
        self.opt.zero_grad()


def run_user_loss(r: Runner, sizes: list[int], **forward: Any) -> None:
    """Accumulates one forward/backward of user_loss on both sides."""
    xs, ys = r.batch(sizes)
    user_loss(r.reference(torch.cat(xs), **forward), torch.cat(ys)).backward()
    user_loss(r.dp(xs[r.rank].to(DEVICE), **forward), ys[r.rank].to(DEVICE)).backward()


def check_steps(r: Runner, sizes: Callable[[int], list[int]]) -> float:
    for step in range(STEPS):
        r.zero_grad()
        run_user_loss(r, sizes(step))
        r.step()
    return r.worst


def scenario_equality(rank: int, world: int) -> dict[str, Any]:
    """Hybrid against single-device float64 runs; each entry is the largest
    parameter or gradient difference over its steps."""
    out: dict[str, Any] = {}
    equal = lambda step: [4] * world  # noqa: E731
    uneven = lambda step: [3 + 2 * p + step for p in range(world)]  # noqa: E731
    out["equal"] = check_steps(Runner(rank, world), equal)
    out["uneven"] = check_steps(Runner(rank, world), uneven)
    # Many small buckets: launched from the hooks while backward goes on.
    small = Runner(rank, world, bucket_bytes=64)
    with _WireCounter() as wire:
        wire.on = True
        out["uneven_small_buckets"] = check_steps(small, uneven)
    out["buckets"] = (len(wire.calls) - 1) / STEPS  # all_reduce calls per step, less the first one's agreement

    # Rank 1 with an empty local batch (its loss is NaN): it weighs nothing.
    r = Runner(rank, world, criterion=Criterion("mean"))
    for step in range(STEPS):
        r.zero_grad()
        sizes = [0 if p == 1 else 3 + p for p in range(world)]
        xs, ys = r.batch(sizes, classes=True)
        Criterion("mean")(r.reference(torch.cat(xs)), torch.cat(ys)).backward()
        r.dp(xs[rank], ys[rank]).backward()
        r.step()
    out["empty_rank"] = r.worst

    for reduction in ("mean", "sum"):
        r = Runner(rank, world, criterion=Criterion(reduction))
        for step in range(STEPS):
            r.zero_grad()
            sizes = uneven(step)
            xs, ys = r.batch(sizes, classes=True)
            Criterion(reduction)(r.reference(torch.cat(xs)), torch.cat(ys)).backward()
            loss = r.dp(xs[rank], ys[rank])
            loss.backward()
            r.step()
        out[f"criterion_{reduction}"] = r.worst

    # A plain function as the criterion: its declared reduction is what the processes are weighted by.
    for reduction in ("mean", "sum"):

        def function(output: Any, target: torch.Tensor, reduction: str = reduction) -> torch.Tensor:
            return F.cross_entropy(output[1], target, reduction=reduction)

        r = Runner(rank, world, criterion=function, criterion_reduction=reduction)
        for step in range(STEPS):
            r.zero_grad()
            xs, ys = r.batch(uneven(step), classes=True)
            function(r.reference(torch.cat(xs)), torch.cat(ys)).backward()
            r.dp(xs[rank], ys[rank]).backward()
            r.step()
        out[f"criterion_function_{reduction}"] = r.worst

    # no_sync: two local micro-steps, then a synchronized one. With the same
    # shares in every micro-step (rank p's size is proportional to 1 + p)
    # this is single-device accumulation exactly.
    r = Runner(rank, world)
    local_differs = []
    for step in range(STEPS):
        r.zero_grad()
        with r.dp.no_sync():
            run_user_loss(r, [(1 + p) * (1 + step) for p in range(world)])
            run_user_loss(r, [2 * (1 + p) for p in range(world)])
        grads = torch.cat([p.grad.reshape(-1) for p in (r.model.fc1.weight, r.model.fc2.weight)])
        every = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(every, grads)
        local_differs.append(not all(torch.equal(every[0], g) for g in every))
        run_user_loss(r, [3 * (1 + p) for p in range(world)])
        r.step()
    out["no_sync"] = r.worst
    out["no_sync_left_gradients_local"] = all(local_differs)

    # Shares that change between micro-steps: each process's accumulated
    # gradient is weighted by its share of all the window's samples.
    r = Runner(rank, world)
    for step in range(STEPS):
        r.zero_grad()
        windows = [[2 + p + step for p in range(world)], [5 - p for p in range(world)], uneven(step)]
        batches = [r.batch(sizes) for sizes in windows]
        total = sum(sum(sizes) for sizes in windows)
        reference = sum(
            sum(sizes[p] for sizes in windows) / total * sum(user_loss(r.reference(xs[p]), ys[p]) for xs, ys in batches)
            for p in range(world)
        )
        reference.backward()
        with r.dp.no_sync():
            for xs, ys in batches[:-1]:
                user_loss(r.dp(xs[rank]), ys[rank]).backward()
        xs, ys = batches[-1]
        user_loss(r.dp(xs[rank]), ys[rank]).backward()
        r.step()
    out["no_sync_changing_shares"] = r.worst

    # Two synchronized backward passes into one .grad (no zero_grad between).
    r = Runner(rank, world)
    for step in range(STEPS):
        r.zero_grad()
        run_user_loss(r, uneven(step))
        run_user_loss(r, [4] * world)
        r.step()
    out["twice_without_zero_grad"] = r.worst

    # A parameter used by rank 1 only (None on the others before the
    # all-reduce), one used nowhere (None everywhere).
    r = Runner(rank, world, bucket_bytes=64)
    for step in range(STEPS):
        r.zero_grad()
        sizes = uneven(step)
        xs, ys = r.batch(sizes)
        n = sum(sizes)
        reference = sum(sizes[p] / n * user_loss(r.reference(xs[p], use_extra=p == 1), ys[p]) for p in range(world))
        reference.backward()
        user_loss(r.dp(xs[rank], use_extra=rank == 1), ys[rank]).backward()
        r.step()
    out["unused"] = r.worst
    never = r.model.never.grad
    out["never_used_grad_is_none"] = never is None
    out["extra_grad_on_every_rank"] = r.model.extra.weight.grad is not None

    # Buffers: rank 0's at construction (Runner starts rank r at 1 + r) and
    # before each forward; broadcast_buffers=False keeps each rank's own.
    r = Runner(rank, world)
    out["scale_after_construction"] = r.model.scale[0].item()
    for step in range(STEPS):
        with torch.no_grad():
            r.model.scale.fill_(1.0 + 0.5 * rank)  # rank 0's stays 1: the reference's
        r.zero_grad()
        run_user_loss(r, uneven(step))
        r.step()
    out["buffers"] = r.worst
    r = Runner(rank, world, broadcast_buffers=False)
    with torch.no_grad():
        r.model.scale.fill_(1.0 + 0.5 * rank)
    r.dp(torch.ones(2, 5, dtype=torch.float64))
    out["scale_without_broadcast"] = r.model.scale[0].item()

    # A parameter unfrozen after the first step: the bucket layout is rebuilt.
    r = Runner(rank, world)
    for model in (r.reference, r.model):
        model.fc1.weight.requires_grad_(False)
    synced = []
    for step in range(STEPS):
        if step == 1:
            for model in (r.reference, r.model):
                model.fc1.weight.requires_grad_(True)
        r.zero_grad()
        run_user_loss(r, uneven(step))
        r.step()
        synced.append(r.model.fc1.weight.grad is not None)
    out["unfrozen"] = r.worst  # fc1.weight synchronized once unfrozen: a local gradient would differ
    out["fc1_weight_has_grad"] = synced
    return out


class Branchy(nn.Module):
    """A trunk and a head used on every call; ``sometimes`` used while the
    attribute ``use_sometimes`` is True; ``flagged`` used by a call only where
    a row of its input has the flag (last column) set, and only for those
    rows (so each replica decides on its own chunk, and one device on the
    whole batch gives the same gradient); ``never`` never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)
        self.sometimes = nn.Linear(6, 3)
        self.flagged = nn.Linear(5, 3)
        self.never = nn.Parameter(torch.randn(4))
        self.use_sometimes = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features, flag = x[:, :5], x[:, 5:].detach()  # a flag, not a feature: no gradient
        hidden = torch.tanh(self.trunk(features))
        out = self.head(hidden)
        if self.use_sometimes:
            out = out + self.sometimes(hidden)
        if bool(flag.any()):
            out = out + flag * self.flagged(features)
        return out


def scenario_unused(rank: int, world: int) -> dict[str, Any]:
    """Parameters used by some replicas of some ranks, or by none, against
    one device on the global batch: each rank holds 8 rows of it (rank p rows
    8p..8p+7: its replica 0 the first 4, replica 1 the last 4). Records every
    difference of .grad's None-ness and the largest difference of values."""
    local = 8
    replicas = REPLICAS[world][rank]
    last = world * local - 1
    # (use_sometimes, flagged rows) per synchronization; a window of two
    # entries is two backward passes into one .grad.
    plan: list[list[tuple[bool, list[int]]]] = [
        [(True, list(range(world * local)))],  # everything used: every optimizer state exists
        [(False, [])],  # neither branch anywhere: None on every rank
        [(True, [local + 6])],  # flagged used by rank 1's replica 1 only
        [(False, [local + 1])],  # ... by rank 1's master only
        [(True, [5])],  # ... by rank 0's replica 1 only
        [(False, [0, last])],
        [(False, [])],
        [(False, []), (True, [local + 5])],  # accumulated: unused, then used by rank 1's replica 1
        [(False, []), (False, [])],  # accumulated, unused in both: None
    ]
    out: dict[str, Any] = {"failures": [], "checks": 0, "worst": {}}
    optimizers = {
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05),
    }
    for bucket_bytes in (64, 1 << 20):
        for name, make in optimizers.items():
            key = f"{name}, bucket_bytes={bucket_bytes}"
            torch.manual_seed(0)
            reference = Branchy().double()
            torch.manual_seed(100 + rank)  # other ranks start elsewhere: construction broadcasts rank 0's
            model = Branchy().double()
            if rank == 0:
                model.load_state_dict(reference.state_dict())
            dp = dpcore.DataParallel(
                model, ["cpu"] * replicas, process_group=dist.group.WORLD, bucket_bytes=bucket_bytes
            )
            opt, opt_ref = make(model.parameters()), make(reference.parameters())
            generator = torch.Generator().manual_seed(11)
            worst = 0.0

            def compare(what: str) -> float:
                diff = 0.0
                for (pname, a), b in zip(reference.named_parameters(), model.parameters()):
                    out["checks"] += 1
                    diff = max(diff, (a - b).abs().max().item())
                    if (a.grad is None) != (b.grad is None):
                        out["failures"].append(
                            f"{key}, {what}: {pname}.grad is {'None' if b.grad is None else 'a tensor'}, "
                            f"on one device {'None' if a.grad is None else 'a tensor'}"
                        )
                    elif a.grad is not None:
                        diff = max(diff, (a.grad - b.grad).abs().max().item())
                return diff

            for step, window in enumerate(plan):
                opt.zero_grad()
                opt_ref.zero_grad()
                for micro, (use_sometimes, flags) in enumerate(window):
                    model.use_sometimes = reference.use_sometimes = use_sometimes
                    x = torch.randn(world * local, 6, generator=generator, dtype=torch.float64)
                    x[:, 5] = 0.0
                    x[flags, 5] = 1.0
                    y = torch.randn(world * local, 3, generator=generator, dtype=torch.float64)
                    F.mse_loss(reference(x), y).backward()
                    mine = slice(rank * local, (rank + 1) * local)
                    F.mse_loss(dp(x[mine]), y[mine]).backward()
                    worst = max(worst, compare(f"step {step}, pass {micro}"))
                opt.step()
                opt_ref.step()
                worst = max(worst, compare(f"step {step}, after the optimizer step"))
            out["worst"][key] = worst
            out["never_grad_is_none"] = out.get("never_grad_is_none", True) and model.never.grad is None
            del dp
    return out


def scenario_mismatch(rank: int, world: int) -> dict[str, Any]:
    """Models that differ between ranks fail at construction on every rank;
    the group stays usable."""
    out: dict[str, Any] = {}
    model = nn.Sequential(nn.Linear(4, 6 if rank == 1 else 5))
    try:
        dpcore.DataParallel(model, ["cpu"], process_group=dist.group.WORLD)
        out["shape"] = None
    except ValueError as error:
        out["shape"] = str(error)
    model = nn.Sequential(nn.Linear(40, 50), nn.Linear(50, 5))
    try:
        dpcore.DataParallel(model, ["cpu"], process_group=dist.group.WORLD, bucket_bytes=1024 if rank == 1 else 10**6)
        out["buckets"] = None
    except ValueError as error:
        out["buckets"] = str(error)
    # Options that disagree, each named as this rank gave it; options given differently to the same effect agree.
    given: dict[str, dict[str, Any]] = {
        "broadcast_buffers": {"broadcast_buffers": False} if rank else {},
        "forward_sync_buffers": {"forward_sync_buffers": rank == 0},
        "sync_batchnorm": {"sync_batchnorm": rank == 1},
        "same_effect": {"broadcast_buffers": True} if rank == 1 else {},
        "same_effect_both": {"broadcast_buffers": False, "forward_sync_buffers": True} if rank == 1 else {},
        "criterion": {"criterion": nn.MSELoss(reduction="sum" if rank == 1 else "mean")},
        "model_loss": {"model_loss": "sum"} if rank == 1 else {},
        "same_effect_loss": {"model_loss": "rows"} if rank == 1 else {"criterion": nn.MSELoss()},
    }
    out["options"] = {}
    for name, options in given.items():
        normed = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dpcore.DataParallel(normed, ["cpu"], process_group=dist.group.WORLD, **options)
            out["options"][name] = None
        except ValueError as error:
            out["options"][name] = str(error)
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=dist.group.WORLD)
    dp(torch.randn(4, 40)).sum().backward()
    out["then_trains"] = model[0].weight.grad is not None
    # register_comm_hook on rank 1 only: a RuntimeError on every rank at the first synchronizing backward, before
    # any gradient collective; once every rank has registered it, training goes on.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    hooked = nn.Linear(4, 3)
    dp = dpcore.DataParallel(hooked, ["cpu"] * 2, process_group=dist.group.WORLD)
    if rank == 1:
        dp.register_comm_hook(dist.group.WORLD, allreduce_hook)
    try:
        dp(torch.ones(4, 4)).sum().backward()
        out["hook_on_rank_1"] = None
    except RuntimeError as error:
        out["hook_on_rank_1"] = str(error)
    loss = dp(torch.ones(4, 4)).sum()
    if rank != 1:
        dp.register_comm_hook(dist.group.WORLD, allreduce_hook)
    hooked.zero_grad()
    loss.backward()
    out["hook_then_everywhere"] = hooked.bias.grad.tolist()
    # One replica per rank: a parameter no rank used keeps .grad None, one
    # that only rank 1 used gets rank 1's gradient (halved) on every rank.
    torch.manual_seed(0)
    net = Net()
    dp = dpcore.DataParallel(net, ["cpu"], process_group=dist.group.WORLD)
    x = torch.ones(2, 5)
    dp(x, use_extra=rank == 1)[1].sum().backward()
    out["single_replica_never_grad"] = None if net.never.grad is None else net.never.grad.tolist()
    out["single_replica_extra_bias_grad"] = net.extra.bias.grad.tolist()
    return out


def wait_for_file(path: str, limit: float = 60.0) -> None:
    """Waits (at most `limit` seconds) until `path` exists: an order between
    ranks that needs no collective."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {limit} s")
        time.sleep(0.01)


def scenario_eval(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 alone evaluates through the wrapper between training steps
    (no_grad with model.eval() and in train mode, inference_mode, a no_grad
    forward of a model without trainable parameters), the other ranks wait
    for it outside any collective (a file). Each entry: the evaluation's
    seconds on rank 0 and the largest difference from the single-device run
    over the training steps around it. The group's timeout is short, so a
    collective in the evaluation fails within it instead of hanging."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    out: dict[str, Any] = {}
    modes: dict[str, Callable[[], Any]] = {
        "no_grad_eval_mode": torch.no_grad,
        "no_grad_train_mode": torch.no_grad,
        "inference_mode": torch.inference_mode,
    }
    uneven = lambda step: [3 + 2 * p + step for p in range(world)]  # noqa: E731
    for name, context in modes.items():
        r = Runner(rank, world, group=group)
        seconds = None
        for step in range(STEPS):
            r.zero_grad()
            run_user_loss(r, uneven(step))
            r.step()
            if step == 0:
                flag = os.path.join(_OUT, f"eval-{name}-done")
                if rank == 0:
                    try:
                        started = time.monotonic()
                        r.model.train(name != "no_grad_eval_mode")
                        with context():
                            for _ in range(3):
                                r.dp(torch.randn(5, 5, dtype=torch.float64, device=DEVICE))
                        r.model.train()
                        seconds = time.monotonic() - started
                    finally:
                        open(flag, "w").close()
                else:
                    wait_for_file(flag)
        out[name] = {"seconds": seconds, "worst": r.worst}
    # Nothing trainable (a frozen model), grad mode on: no collective either.
    frozen = nn.Linear(5, 3).double().to(DEVICE)
    frozen.requires_grad_(False)
    dp = dpcore.DataParallel(frozen, local_devices(world, rank), process_group=group)
    flag = os.path.join(_OUT, "eval-frozen-done")
    if rank == 0:
        try:
            started = time.monotonic()
            dp(torch.randn(4, 5, dtype=torch.float64, device=DEVICE))
            out["frozen"] = {"seconds": time.monotonic() - started}
        finally:
            open(flag, "w").close()
    else:
        wait_for_file(flag)
        out["frozen"] = {"seconds": None}
    # broadcast_buffers=False (as DDP's): buffers are never sent, at construction neither.
    torch.manual_seed(rank)
    net = Net().double().to(DEVICE)
    with torch.no_grad():
        net.scale.fill_(1.0 + rank)
    dp = dpcore.DataParallel(net, local_devices(world, rank), process_group=group, broadcast_buffers=False)
    dp(torch.ones(2, 5, dtype=torch.float64, device=DEVICE))[1].sum().backward()
    weights = [torch.empty_like(net.fc1.weight) for _ in range(world)]
    dist.all_gather(weights, net.fc1.weight.detach().contiguous(), group=group)
    out["own_buffer_without_broadcast"] = net.scale[0].item()
    out["parameters_still_from_rank_0"] = all(torch.equal(w, weights[0]) for w in weights)
    ones = torch.ones(1, device=DEVICE)
    dist.all_reduce(ones, group=group)
    out["group_usable"] = ones.item() == world
    return out


def _attempt(steps: int, step_fn: Callable[[int], None]) -> dict[str, Any]:
    """Runs step_fn(0..steps-1); the first exception ends it: its type,
    message, step and the seconds that step took."""
    for step in range(steps):
        started = time.monotonic()
        try:
            step_fn(step)
        except Exception as error:  # noqa: BLE001 - the error is the result
            return {
                "error": type(error).__name__,
                "message": str(error),
                "step": step,
                "seconds": time.monotonic() - started,
            }
    return {"error": None}


def scenario_layout(rank: int, world: int) -> dict[str, Any]:
    """Layout changes after construction. On one rank only: rank 1 freezes
    fc1.weight before step 2, or rank 0 replaces fc2.bias before step 1;
    every rank replaces fc2.bias with different values: a ValueError on
    every rank, in that step, well within the group's timeout, and the
    group stays usable. The same change on every rank (fc2.bias replaced
    by equal values, fc1.weight frozen): exact against one device."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    out: dict[str, Any] = {}
    uneven = lambda step: [3 + 2 * p + step for p in range(world)]  # noqa: E731

    def case(change: Callable[[Runner, int], None], **options: Any) -> tuple[Runner, dict[str, Any]]:
        r = Runner(rank, world, group=group, **options)

        def step_fn(step: int) -> None:
            change(r, step)
            r.zero_grad()
            run_user_loss(r, uneven(step))
            r.step()

        return r, _attempt(4, step_fn)

    def freeze_on_rank_1(r: Runner, step: int) -> None:
        if step == 2 and rank == 1:
            r.model.fc1.weight.requires_grad_(False)

    def replace_on_rank_0(r: Runner, step: int) -> None:
        if step == 1 and rank == 0:
            r.model.fc2.bias = nn.Parameter(r.model.fc2.bias.detach().clone())

    def replace_differently(r: Runner, step: int) -> None:
        if step == 1:
            r.model.fc2.bias = nn.Parameter(torch.full((3,), 0.1 * rank, dtype=torch.float64, device=DEVICE))

    def replace_equally(r: Runner, step: int) -> None:
        if step == 1:
            r.reference.fc2.bias = nn.Parameter(torch.full((3,), 0.5, dtype=torch.float64))
            r.model.fc2.bias = nn.Parameter(torch.full((3,), 0.5, dtype=torch.float64, device=DEVICE))

    def freeze_everywhere(r: Runner, step: int) -> None:
        if step == 2:
            r.reference.fc1.weight.requires_grad_(False)
            r.model.fc1.weight.requires_grad_(False)

    for name, change in (
        ("freeze_on_rank_1", freeze_on_rank_1),
        ("replace_on_rank_0", replace_on_rank_0),
        ("replace_differently", replace_differently),
    ):
        _, out[name] = case(change)
    _, out["freeze_on_rank_1_small_buckets"] = case(freeze_on_rank_1, bucket_bytes=64)
    for name, change in (("replace_equally", replace_equally), ("freeze_everywhere", freeze_everywhere)):
        r, result = case(change)
        out[name] = {**result, "worst": r.worst}
    # The criterion's reduction changed in place after construction: on rank 1 before step 1, an error on every
    # rank in that step; then on every rank before step 2, adopted: exact against one device, summed.
    r = Runner(rank, world, group=group, criterion=Criterion("mean"))

    def loss_step(step: int) -> None:
        if (step == 1 and rank == 1) or step == 2:
            r.dp.criterion.reduction = "sum"
        r.zero_grad()
        xs, ys = r.batch(uneven(step), classes=True)
        Criterion("sum" if step >= 2 else "mean")(r.reference(torch.cat(xs)), torch.cat(ys)).backward()
        r.dp(xs[rank].to(DEVICE), ys[rank].to(DEVICE)).backward()
        r.step()

    out["reduction_on_rank_1"] = _attempt(2, loss_step)
    r.worst = 0.0
    r.opt.zero_grad()
    r.opt_ref.zero_grad()
    loss_step(2)
    out["reduction_everywhere"] = r.worst
    ones = torch.ones(1, device=DEVICE)
    dist.all_reduce(ones, group=group)
    out["group_usable"] = ones.item() == world
    return out


class JoinNet(nn.Module):
    """Linear-tanh-linear with a buffer that scales the hidden layer (every
    parameter used, as DDP without find_unused_parameters needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


def _train_under_join(
    rank: int,
    make: Callable[[nn.Module], nn.Module],
    batches: int,
    join: Callable[[nn.Module, Any], Any],
    group: Any = None,
) -> dict[str, Any]:
    """Trains JoinNet (float64) for `batches` equal local batches of 4 under
    the join context `join(wrapper, optimizer)`; rank-dependent buffer values
    before each forward; SGD with momentum, sharded by
    ZeroRedundancyOptimizer over `group` where one is given. Returns the
    parameters and gradients after every step and the parameters and buffer
    after the context."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = JoinNet().double().to(DEVICE)
    wrapper = make(model)
    if group is None:
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, process_group=group, lr=0.1, momentum=0.9
        )
    generator = torch.Generator().manual_seed(11 + rank)
    trace = []
    with join(wrapper, opt):
        for step in range(batches):
            with torch.no_grad():
                model.scale.fill_(1.0 + 0.25 * rank + 0.1 * step)
            x = torch.randn(4, 5, generator=generator, dtype=torch.float64).to(DEVICE)
            y = torch.randn(4, 3, generator=generator, dtype=torch.float64).to(DEVICE)
            opt.zero_grad()
            F.mse_loss(wrapper(x), y).backward()
            trace.append([p.grad.cpu().clone() for p in model.parameters()])
            opt.step()
            trace.append([p.detach().cpu().clone() for p in model.parameters()])
    final = [t.detach().cpu().clone() for t in itertools.chain(model.parameters(), model.buffers())]
    return {"trace": trace, "final": final}


def _largest_difference(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((x - y).abs().max().item() for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def scenario_join(rank: int, world: int) -> dict[str, Any]:
    """Uneven numbers of batches (rank r has 2 + r): dpcore under
    Join([dp]) (and dp.join()) against DistributedDataParallel under Join,
    float64, divide_by_initial_world_size True and False; the largest
    difference of gradients and parameters over every step and after the
    context. Then throw_on_early_termination: every rank raises."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    batches = 2 + rank
    devices = local_devices(world, rank)
    ddp_ids = None if DEVICE.type == "cpu" else [DEVICE]
    out: dict[str, Any] = {}
    finals = []
    for divide in (True, False):
        ddp = _train_under_join(
            rank,
            lambda m: DistributedDataParallel(m, device_ids=ddp_ids, process_group=group),
            batches,
            lambda w, _: Join([w], divide_by_initial_world_size=divide),
        )
        ours = _train_under_join(
            rank,
            lambda m: dpcore.DataParallel(m, devices, process_group=group),
            batches,
            lambda w, _: Join([w], divide_by_initial_world_size=divide),
        )
        out[f"divide_{divide}"] = {
            "trace": _largest_difference(ddp["trace"], ours["trace"]),
            "final": _largest_difference([ddp["final"]], [ours["final"]]),
            "steps": len(ours["trace"]) // 2,
        }
        finals.append(ours["final"])
    # The option matters (else the two comparisons above would prove little).
    out["divide_changes_the_result"] = _largest_difference([finals[0]], [finals[1]])
    method = _train_under_join(
        rank, lambda m: dpcore.DataParallel(m, devices, process_group=group), batches, lambda w, _: w.join()
    )
    ours_default = _train_under_join(
        rank,
        lambda m: dpcore.DataParallel(m, devices, process_group=group),
        batches,
        lambda w, _: Join([w]),
    )
    out["join_method_equals_join"] = _largest_difference([method["final"]], [ours_default["final"]])
    # With a joinable optimizer too: Join([wrapper, ZeroRedundancyOptimizer]).
    ddp = _train_under_join(
        rank,
        lambda m: DistributedDataParallel(m, device_ids=ddp_ids, process_group=group),
        batches,
        lambda w, opt: Join([w, opt]),
        group=group,
    )
    ours = _train_under_join(
        rank,
        lambda m: dpcore.DataParallel(m, devices, process_group=group),
        batches,
        lambda w, opt: Join([w, opt]),
        group=group,
    )
    out["zero"] = {
        "trace": _largest_difference(ddp["trace"], ours["trace"]),
        "final": _largest_difference([ddp["final"]], [ours["final"]]),
    }
    try:
        _train_under_join(
            rank,
            lambda m: dpcore.DataParallel(m, devices, process_group=group),
            batches,
            lambda w, _: Join([w], throw_on_early_termination=True),
        )
        out["throw"] = None
    except RuntimeError as error:
        out["throw"] = str(error)
    ones = torch.ones(1, device=DEVICE)
    dist.all_reduce(ones, group=group)
    out["group_usable"] = ones.item() == world
    return out


# -- buffers after training, against DDP ---------------------------------------


class BatchNormNet(nn.Module):
    """Linear, BatchNorm1d, tanh, linear: running statistics as buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


#: The buffer options compared with DDP's (torch 2.13's names and meanings).
BUFFER_OPTIONS: dict[str, dict[str, bool]] = {
    "default": {},
    "forward_sync_true": {"forward_sync_buffers": True},
    "forward_sync_false": {"forward_sync_buffers": False},
    "broadcast_true": {"broadcast_buffers": True},
    "broadcast_false": {"broadcast_buffers": False},
    "both": {"broadcast_buffers": False, "forward_sync_buffers": True},
}


def _state(model: nn.Module) -> list[torch.Tensor]:
    """Copies of the parameters, then the buffers, on the CPU."""
    return [t.detach().cpu().clone() for t in itertools.chain(model.parameters(), model.buffers())]


def _rank_bn_statistics(model: BatchNormNet, rank: int) -> None:
    """Running statistics that differ between ranks."""
    with torch.no_grad():
        model.bn.running_mean.fill_(0.5 * rank)
        model.bn.running_var.fill_(1.0 + rank)


def _train_then_evaluate(
    rank: int, make: Callable[[nn.Module], nn.Module], accumulate: int, group: Any
) -> dict[str, Any]:
    """BatchNormNet (float64) with rank-dependent running statistics before
    wrapping, 4 SGD steps on this rank's own batches of 4 (each step
    `accumulate` micro-batches, all but the last under no_sync; after the
    second, a model.eval() forward under inference_mode on every rank), then
    model.eval() and one torch.no_grad() forward of an input that is the
    same on every rank. Returns the parameters and buffers after every step
    ("trace"), the outputs of the evaluations, the buffers after the last,
    whether the buffers were rank 0's right after wrapping, whether every
    rank evaluated to the same output, and whether rank 0's buffers differed
    from another rank's after some step."""
    torch.manual_seed(0)
    model = BatchNormNet().double().to(DEVICE)
    _rank_bn_statistics(model, rank)
    wrapper = make(model)
    world = dist.get_world_size(group)

    def agree(t: torch.Tensor) -> bool:
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t.detach().contiguous(), group=group)
        return all(torch.equal(e, every[0]) for e in every)

    init_synced = agree(model.bn.running_mean)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(21 + rank)
    probe = torch.linspace(-1, 1, 30, dtype=torch.float64).reshape(6, 5).to(DEVICE)
    trace, outputs, buffers_agree = [], [], True
    for step in range(4):
        opt.zero_grad()
        for micro in range(accumulate):
            x = torch.randn(4, 5, generator=generator, dtype=torch.float64).to(DEVICE)
            y = torch.randn(4, 3, generator=generator, dtype=torch.float64).to(DEVICE)
            context = wrapper.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with context:
                F.mse_loss(wrapper(x), y).backward()
        opt.step()
        trace.append(_state(model))
        buffers_agree = agree(model.bn.running_mean) and buffers_agree
        if step == 1:
            model.eval()
            with torch.inference_mode():
                outputs.append(wrapper(probe).cpu())
            model.train()
    model.eval()
    with torch.no_grad():
        output = wrapper(probe)
    outputs.append(output.cpu())
    return {
        "trace": trace,
        "outputs": outputs,
        "buffers": [b.detach().cpu().double() for b in model.buffers()],
        "init_synced": init_synced,
        "ranks_agree": agree(output),
        "buffers_differ_between_steps": not buffers_agree,
    }


def _replicas_against_one_process(rank: int, world: int, group: Any, options: dict[str, bool]) -> float:
    """BatchNormNet (float64, rank-dependent running statistics before
    wrapping) on 2 CPU replicas per rank, 3 SGD steps of 4 rows per rank,
    against a one-process simulation of every rank (DDP has no equivalent
    within a process): the gradients of the mean loss over the global batch
    with BatchNorm on each replica's chunk of 2, and each rank's buffers
    updated by its first replica's chunk (replica 0 is the module), starting
    from rank 0's before each step where forward buffers are sent, from
    rank 0's at construction where the construction sends them. The largest
    difference of parameters and buffers after any step."""
    torch.manual_seed(0)
    reference = BatchNormNet().double()
    torch.manual_seed(0)
    model = BatchNormNet().double()
    _rank_bn_statistics(model, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dp = dpcore.DataParallel(model, ["cpu", "cpu"], process_group=group, **options)
    assert dp._sync is not None
    forward, init = dp._sync.forward_sync_buffers, dp._sync.init_sync_buffers
    names = [name for name, _ in reference.named_buffers()]
    states = []  # each rank's buffers, as the simulation has them
    for r in range(world):
        _rank_bn_statistics(reference, r if not init else 0)
        states.append({n: b.clone() for n, b in reference.named_buffers()})
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(5)
    worst = 0.0
    for _ in range(3):
        x = torch.randn(4 * world, 5, generator=generator, dtype=torch.float64)
        y = torch.randn(4 * world, 3, generator=generator, dtype=torch.float64)
        opt_ref.zero_grad()
        opt.zero_grad()
        if forward:
            states = [dict(states[0]) for _ in range(world)]
        for r in range(world):
            for chunk in (slice(4 * r, 4 * r + 2), slice(4 * r + 2, 4 * r + 4)):
                with torch.no_grad():
                    for name, b in reference.named_buffers():
                        b.copy_(states[r][name])
                (F.mse_loss(reference(x[chunk]), y[chunk]) * 2 / (4 * world)).backward()
                if chunk.start == 4 * r:  # the first replica's chunk: the module's statistics
                    states[r] = {n: b.clone() for n, b in reference.named_buffers()}
        F.mse_loss(dp(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4]).backward()
        opt_ref.step()
        opt.step()
        expected = list(reference.parameters()) + [states[rank][n] for n in names]
        worst = max(worst, _largest_difference([expected], [_state(model)]))
    return worst


def scenario_buffers(rank: int, world: int) -> dict[str, Any]:
    """Buffers between steps and after training, against
    DistributedDataParallel (one replica per rank, so that BatchNorm sees
    DDP's batches): for each option of BUFFER_OPTIONS, the largest
    difference of the evaluations' outputs, of the buffers after the last
    and of every step's parameters and buffers from DDP's with the same
    option, and each side's init_synced, ranks_agree and
    buffers_differ_between_steps; the default with no_sync accumulation
    too. "replicas": 2 replicas per rank against one process, for 3 of the
    options. Then rank 0 evaluates alone after training (the others wait
    outside any collective): its seconds; then every rank evaluates after
    writing its own running_var."""
    from torch.nn.parallel import DistributedDataParallel

    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    devices = [DEVICE]
    ddp_ids = None if DEVICE.type == "cpu" else [DEVICE]
    out: dict[str, Any] = {"replicas": {}}
    for name in ("default", "forward_sync_false", "broadcast_false"):
        out["replicas"][name] = _replicas_against_one_process(rank, world, group, BUFFER_OPTIONS[name])
    cases = [(name, options, 1) for name, options in BUFFER_OPTIONS.items()] + [("accumulate", {}, 2)]
    for name, options, accumulate in cases:
        ddp = _train_then_evaluate(
            rank,
            lambda m: DistributedDataParallel(m, device_ids=ddp_ids, process_group=group, **options),
            accumulate,
            group,
        )
        ours = _train_then_evaluate(
            rank, lambda m: dpcore.DataParallel(m, devices, process_group=group, **options), accumulate, group
        )
        keys = ("init_synced", "ranks_agree", "buffers_differ_between_steps")
        out[name] = {
            "output": _largest_difference([ddp["outputs"]], [ours["outputs"]]),
            "buffers": _largest_difference([ddp["buffers"]], [ours["buffers"]]),
            "trace": _largest_difference(ddp["trace"], ours["trace"]),
            **{f"ddp_{key}": ddp[key] for key in keys},
            **{f"ours_{key}": ours[key] for key in keys},
        }
    # Rank 0 alone evaluates after training: no collective, at once.
    flag = os.path.join(_OUT, "buffers-rank-0-eval-done")
    seconds = None
    model = BatchNormNet().double().to(DEVICE)
    dp = dpcore.DataParallel(model, local_devices(world, rank), process_group=group)
    dp(torch.randn(6, 5, dtype=torch.float64, device=DEVICE)).square().mean().backward()
    if rank == 0:
        try:
            started = time.monotonic()
            model.eval()
            with torch.no_grad():
                dp(torch.randn(4, 5, dtype=torch.float64, device=DEVICE))
            seconds = time.monotonic() - started
        finally:
            open(flag, "w").close()
    else:
        wait_for_file(flag)
    out["rank_0_alone_seconds"] = seconds
    # Every rank evaluates: rank 0's statistics from the last backward, except a buffer written since (kept).
    with torch.no_grad():
        model.bn.running_var.fill_(2.0 + rank)
    model.eval()
    with torch.no_grad():
        dp(torch.randn(4, 5, dtype=torch.float64, device=DEVICE))
    means = [torch.empty_like(model.bn.running_mean) for _ in range(world)]
    dist.all_gather(means, model.bn.running_mean, group=group)
    out["written_buffer_kept"] = bool((model.bn.running_var == 2.0 + rank).all())
    out["others_are_rank_0s"] = all(torch.equal(m, means[0]) for m in means)
    ones = torch.ones(1, device=DEVICE)
    dist.all_reduce(ones, group=group)
    out["group_usable"] = ones.item() == world
    return out


# -- communication hooks (register_comm_hook) ----------------------------------


class HookNet(nn.Module):
    """Linear-tanh-linear without buffers whose only matrix PowerSGD
    compresses is fc1.weight (8 x 16): its result then does not depend on
    the order of the tensors inside a bucket (DDP reorders them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _named_hooks(group: Any) -> dict[str, tuple[Callable[[], Any], Any]]:
    """torch's hooks by name: (a fresh state, the hook). The bf16 hook goes
    to DDP under another name (DDP refuses torch's bf16 hooks without NCCL;
    the hook's code is the same)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def bf16_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations (strings here)
        return default_hooks.bf16_compress_hook(state, bucket)

    def power_sgd() -> Any:
        return powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=5
        )

    return {
        "allreduce": (lambda: group, default_hooks.allreduce_hook),
        "fp16": (lambda: group, default_hooks.fp16_compress_hook),
        "bf16": (lambda: group, bf16_hook),
        "fp16_wrapper": (lambda: group, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
        "powerSGD": (power_sgd, powerSGD_hook.powerSGD_hook),
    }


class _WireCounter:
    """Counts the tensors passed to torch.distributed.all_reduce while on:
    one (dtype, elements) entry per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.on = False
        self._real = dist.all_reduce

    def __enter__(self) -> _WireCounter:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls.append((str(tensor.dtype), tensor.numel()))
            return self._real(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._real


def _train_hooked(
    rank: int,
    make: Callable[[nn.Module], Any],
    hook: tuple[Callable[[], Any], Any] | None,
    steps: int,
    sizes: Callable[[int], int],
    accumulate: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Trains HookNet (SGD with momentum) on this rank's own data, `steps`
    synchronizations of `accumulate` backward passes each (all but the last
    under no_sync), `sizes(step)` rows per forward; the hook registered as
    (state, hook). Returns the gradients and parameters after every step and
    each step's all_reduce calls (dtype, elements)."""
    torch.manual_seed(0)
    model = HookNet().to(dtype)
    wrapper = make(model)
    if hook is not None:
        wrapper.register_comm_hook(hook[0](), hook[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(31 + rank)
    trace: list[list[torch.Tensor]] = []
    wire: list[list[tuple[str, int]]] = []
    with _WireCounter() as counter:
        for step in range(steps):
            opt.zero_grad()
            counter.calls = []
            for micro in range(accumulate):
                n = sizes(step)
                x = torch.randn(n, 16, generator=generator, dtype=torch.float64).to(dtype)  # the reference's rows
                y = torch.randn(n, 1, generator=generator, dtype=torch.float64).to(dtype)
                context = wrapper.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
                with context:
                    out = wrapper(x)
                    counter.on = True
                    F.mse_loss(out, y).backward()
                    counter.on = False
            wire.append(counter.calls)
            trace.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            trace.append([p.detach().clone() for p in model.parameters()])
    return {"trace": trace, "wire": wire}


def _relative_difference(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    """The largest |a - b| over the largest |b|, entry by entry (float64)."""
    assert len(a) == len(b), (len(a), len(b))
    worst = 0.0
    for xs, ys in zip(a, b):
        for x, y in zip(xs, ys):
            x, y = x.double(), y.double()
            worst = max(worst, (x - y).abs().max().item() / max(y.abs().max().item(), 1e-30))
    return worst


def _global_reference(steps: int, sizes: Callable[[int], list[int]], world: int) -> list[list[torch.Tensor]]:
    """One device, float64, on the global batch of every step (every rank's
    rows as _train_hooked draws them): the trace _train_hooked returns."""
    torch.manual_seed(0)
    model = HookNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generators = [torch.Generator().manual_seed(31 + r) for r in range(world)]
    trace = []
    for step in range(steps):
        xs, ys = [], []
        for r in range(world):
            n = sizes(step)[r]
            xs.append(torch.randn(n, 16, generator=generators[r], dtype=torch.float64))
            ys.append(torch.randn(n, 1, generator=generators[r], dtype=torch.float64))
        opt.zero_grad()
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        trace.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    return trace


def scenario_hooks(rank: int, world: int) -> dict[str, Any]:
    """register_comm_hook with torch's hooks: against DDP with the same hook
    (one replica per rank, float32, equal batches of 6, 5 SGD steps; plain,
    under no_sync and under Join), the all_reduce calls of each (bytes on the
    wire), and with several replicas per rank on uneven batches against one
    device in float64."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    hooks = _named_hooks(group)
    ddp = lambda m: DistributedDataParallel(m, process_group=group)  # noqa: E731
    ours = lambda m: dpcore.DataParallel(m, ["cpu"], process_group=group)  # noqa: E731
    six = lambda step: 6  # noqa: E731
    out: dict[str, Any] = {"parity": {}, "wire": {}}
    for name, hook in hooks.items():
        theirs = _train_hooked(rank, ddp, hook, 5, six)
        mine = _train_hooked(rank, ours, hook, 5, six)
        out["parity"][name] = _relative_difference(mine["trace"], theirs["trace"])
        out["wire"][name] = {"ddp": theirs["wire"], "dpcore": mine["wire"]}
    out["wire"]["none"] = {"dpcore": _train_hooked(rank, ours, None, 5, six)["wire"]}
    # One bucket per parameter: the hooks run in order, one bucket in flight (PowerSGD's callbacks all-reduce).
    small = lambda m: dpcore.DataParallel(m, ["cpu"], process_group=group, bucket_bytes=64)  # noqa: E731
    fp16_small = _train_hooked(rank, small, hooks["fp16"], 5, six)
    out["parity"]["fp16_small_buckets"] = _relative_difference(
        fp16_small["trace"], _train_hooked(rank, ddp, hooks["fp16"], 5, six)["trace"]
    )
    out["wire"]["fp16_small_buckets"] = fp16_small["wire"]
    power = _train_hooked(rank, small, hooks["powerSGD"], 5, six)
    final = torch.cat([t.reshape(-1) for t in power["trace"][-1]]).double()
    every = [torch.empty_like(final) for _ in range(world)]
    dist.all_gather(every, final, group=group)
    out["powerSGD_small_buckets"] = {
        "same_on_every_rank": all(torch.equal(t, every[0]) for t in every),
        "finite": bool(final.isfinite().all()),
        "wire": power["wire"],
    }
    # Gradient accumulation: 2 backward passes under no_sync, then one that synchronizes.
    out["no_sync"] = {
        name: _relative_difference(
            _train_hooked(rank, ours, hooks[name], 3, six, accumulate=3)["trace"],
            _train_hooked(rank, ddp, hooks[name], 3, six, accumulate=3)["trace"],
        )
        for name in ("fp16", "powerSGD")
    }

    # Join: rank r has 2 + r batches; the joined ranks' shadows go through the hook.
    def hooked(make: Callable[[nn.Module], Any], name: str) -> Callable[[nn.Module], Any]:
        def build(m: nn.Module) -> Any:
            wrapper = make(m)
            wrapper.register_comm_hook(hooks[name][0](), hooks[name][1])
            return wrapper

        return build

    out["join"] = {}
    for name in ("allreduce", "fp16"):
        theirs_join = _train_under_join(rank, hooked(ddp, name), 2 + rank, lambda w, _: Join([w]))
        mine_join = _train_under_join(rank, hooked(ours, name), 2 + rank, lambda w, _: Join([w]))
        out["join"][name] = {
            "trace": _relative_difference(mine_join["trace"], theirs_join["trace"]),
            "final": _relative_difference([mine_join["final"]], [theirs_join["final"]]),
            "steps": len(mine_join["trace"]) // 2,
        }
    # divide_by_initial_world_size=False: with a hook as without (the mean over the ranks still training).
    plain = _train_under_join(rank, ours, 2 + rank, lambda w, _: Join([w], divide_by_initial_world_size=False))
    with_hook = _train_under_join(
        rank, hooked(ours, "allreduce"), 2 + rank, lambda w, _: Join([w], divide_by_initial_world_size=False)
    )
    out["join"]["divide_false_as_without_hook"] = _largest_difference(with_hook["trace"], plain["trace"])
    # Several replicas per rank, uneven local batches (and an empty one on rank 1): the weights stay exact.
    uneven = lambda step: [[5, 3], [4, 0], [2, 7]][step][:world] + [3] * (world - 2)  # noqa: E731
    reference = _global_reference(3, uneven, world)
    devices = local_devices(world, rank)
    hybrid = lambda m: dpcore.DataParallel(m, devices, process_group=group)  # noqa: E731
    out["uneven"] = {}
    for name in ("none", "allreduce", "fp16", "bf16"):
        got = _train_hooked(
            rank,
            hybrid,
            None if name == "none" else hooks[name],
            3,
            lambda step: uneven(step)[rank],
            dtype=torch.float64,
        )
        out["uneven"][name] = _relative_difference(got["trace"], reference)
    # No bucket that can carry the sample count (every bucket half precision): the count takes its own all-reduce.
    half = _train_hooked(rank, hybrid, None, 3, lambda step: uneven(step)[rank], dtype=torch.float16)
    out["uneven"]["float16_separate_count"] = _relative_difference(half["trace"], reference)
    out["float16_separate_count_wire"] = half["wire"]
    # What the unweighted mean of the ranks' gradients (DDP's) would be off by on these batches.
    ddp_uneven = _train_hooked(rank, ddp, hooks["allreduce"], 1, lambda step: uneven(step)[rank], dtype=torch.float64)
    out["uneven"]["ddp_unweighted"] = _relative_difference(ddp_uneven["trace"], reference[:2])
    ones = torch.ones(1)
    dist.all_reduce(ones, group=group)
    out["group_usable"] = ones.item() == world
    return out


class RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise ValueError("boom in backward on rank 1")


class Failing(nn.Module):
    """A model that raises on rank 1 from step 1 on: in forward or in backward."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        self.where = where
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail and self.where == "forward":
            raise ValueError("boom in forward on rank 1")
        if self.fail and self.where == "backward":
            x = RaiseInBackward.apply(x.requires_grad_())
        return self.net(x)


def scenario_failure(rank: int, world: int, where: str, then: str) -> dict[str, Any]:
    """Rank 1 raises at step 1 (in forward or backward), then exits at once
    (`then` == "exit") or stays alive for three timeouts ("stay"). The other
    ranks must raise, never hang."""
    model = Failing(where)
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=group, bucket_bytes=64)
    for step in range(4):
        model.fail = rank == 1 and step == 1
        started = time.monotonic()
        try:
            dp(torch.randn(6, 5)).pow(2).mean().backward()
        except Exception as error:  # noqa: BLE001 - every error is the result
            result = {
                "error": type(error).__name__,
                "runtime_error": isinstance(error, RuntimeError),
                "message": str(error)[:500],
                "step": step,
                "seconds": time.monotonic() - started,
            }
            if rank == 1 and then == "stay":
                write(result)
                time.sleep(3 * timeout())  # alive, its connections open, doing nothing
            return result
    return {"error": None}


class BNNet(nn.Module):
    """Conv-BatchNorm2d-ReLU, Linear-BatchNorm1d (momentum=None: the
    cumulative average)-tanh, then one of two BatchNorm1d without running
    statistics (`which`; the layout is the same either way), Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 6)
        self.bn1 = nn.BatchNorm1d(6, momentum=None)
        self.a = nn.BatchNorm1d(6, track_running_stats=False)
        self.b = nn.BatchNorm1d(6, track_running_stats=False)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, which: str = "a") -> torch.Tensor:
        h = torch.relu(self.bn2(self.conv(x)))
        h = torch.tanh(self.bn1(self.fc(h.flatten(1))))
        return self.out(self.a(h) if which == "a" else self.b(h))


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """The largest difference; inf where only one is None (a gradient)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return 0.0 if a.numel() == 0 else (a.double() - b.double().cpu()).abs().max().item()


def scenario_syncbn(rank: int, world: int) -> dict[str, Any]:
    """sync_batchnorm=True across processes (float64, SGD with momentum,
    broadcast_buffers=False so that every rank's running statistics are its
    own): against one device on the global batch, the largest difference of
    outputs, gradients, parameters and BatchNorm buffers over uneven steps
    (then one where rank 1 has no rows), with a mean loss and a summed
    criterion; then ranks at different BatchNorm layers (an error on every
    rank, at once), Join (refused), a no_grad train-mode forward on rank 0
    alone (no collective) and a last training step (the group still usable)."""
    out: dict[str, Any] = {}
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    for name, criterion in (("mean", None), ("sum", nn.MSELoss(reduction="sum"))):
        torch.manual_seed(0)
        reference = BNNet().double()
        torch.manual_seed(1 + rank)
        model = BNNet().double()
        if rank == 0:
            model.load_state_dict(reference.state_dict())
        model.to(DEVICE)
        dp = dpcore.DataParallel(
            model,
            local_devices(world, rank),
            process_group=group,
            sync_batchnorm=True,
            broadcast_buffers=False,
            criterion=criterion,
        )
        lr = 0.1 if criterion is None else 0.01  # a summed loss: about the mean's steps, not diverging
        opt_ref = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        generator = torch.Generator().manual_seed(3)
        worst = dict.fromkeys(("outputs", "gradients", "parameters", "buffers"), 0.0)
        plan = [[3 + 2 * p + step for p in range(world)] for step in range(3)]
        plan.append([0 if p == 1 else 4 + p for p in range(world)])  # rank 1: an empty local batch
        for sizes in plan:
            x = torch.randn(sum(sizes), 2, 4, 4, generator=generator, dtype=torch.float64)
            y = torch.randn(sum(sizes), 2, generator=generator, dtype=torch.float64)
            opt_ref.zero_grad()
            opt.zero_grad()
            mine_x, mine_y = x.split(sizes)[rank].to(DEVICE), y.split(sizes)[rank].to(DEVICE)
            if criterion is None:
                ref_out = reference(x)
                F.mse_loss(ref_out, y).backward()
                mine = dp(mine_x)
                worst["outputs"] = max(worst["outputs"], _max_diff(ref_out.split(sizes)[rank].detach(), mine.detach()))
                F.mse_loss(mine, mine_y).backward()
            else:
                ref_loss = criterion(reference(x), y)
                ref_loss.backward()
                loss = dp(mine_x, mine_y)
                loss.backward()
            for a, b in zip(reference.parameters(), model.parameters()):
                worst["gradients"] = max(worst["gradients"], _max_diff(a.grad, b.grad))
            opt_ref.step()
            opt.step()
            for a, b in zip(reference.parameters(), model.parameters()):
                worst["parameters"] = max(worst["parameters"], _max_diff(a.detach(), b.detach()))
            for (key, a), (_, b) in zip(reference.named_buffers(), model.named_buffers()):
                worst["buffers"] = max(worst["buffers"], _max_diff(a, b))
        out[name] = worst
        out[f"{name}_batches_tracked"] = int(model.bn2.num_batches_tracked.item())

    x = torch.randn(4 + rank, 2, 4, 4, dtype=torch.float64, device=DEVICE)
    started = time.monotonic()
    try:
        dp(x, x[:, 0, 0, :2], which="a" if rank == 0 else "b")
        out["different_layers"] = {"error": None}
    except Exception as error:  # noqa: BLE001 - the error is the result
        out["different_layers"] = {
            "error": type(error).__name__,
            "message": str(error)[:600],
            "seconds": time.monotonic() - started,
        }
    try:
        dp.join()
        out["join"] = None
    except ValueError as error:
        out["join"] = str(error)

    flag = os.path.join(_OUT, "syncbn-no-grad-done")
    if rank == 0:
        try:
            started = time.monotonic()
            with torch.no_grad():
                dp(x, x[:, 0, 0, :2])
            out["no_grad_alone_seconds"] = time.monotonic() - started
        finally:
            open(flag, "w").close()
    else:
        wait_for_file(flag)
    dp(x, x[:, 0, 0, :2]).backward()
    ones = torch.ones(1, device=DEVICE)
    dist.all_reduce(ones, group=group)
    out["group_usable"] = ones.item() == world
    return out


def scenario_syncbn_eval(rank: int, world: int) -> dict[str, Any]:
    """sync_batchnorm=True across processes with rank 1 in eval mode (no
    BatchNorm collective there): every rank must raise within the group's
    timeout, never hang."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout()))
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Linear(3, 1)).double().to(DEVICE)
    dp = dpcore.DataParallel(model, local_devices(world, rank), process_group=group, sync_batchnorm=True)
    model.train(rank != 1)
    started = time.monotonic()
    try:
        dp(torch.randn(6, 4, dtype=torch.float64, device=DEVICE)).pow(2).mean().backward()
    except Exception as error:  # noqa: BLE001 - every error is the result
        return {
            "error": type(error).__name__,
            "runtime_error": isinstance(error, RuntimeError),
            "message": str(error)[:600],
            "seconds": time.monotonic() - started,
        }
    return {"error": None}


def timeout() -> float:
    return float(os.environ.get("DPCORE_TEST_PG_TIMEOUT", "30"))


_OUT = ""


def write(result: dict[str, Any]) -> None:
    with open(os.path.join(_OUT, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    global _OUT
    scenario, _OUT = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    backend = os.environ.get("DPCORE_TEST_BACKEND", "gloo")
    if backend == "nccl":
        global DEVICE
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "all":  # the checks that leave the group usable, in one run
        result = {"equality": scenario_equality(rank, world), "mismatch": scenario_mismatch(rank, world)}
    elif scenario.split(":")[0] == "parity":  # rank-0-only evaluation, layout changes, Join ("parity:join": one)
        parts = {"eval": scenario_eval, "layout": scenario_layout, "join": scenario_join}
        chosen = scenario.split(":")[1:] or list(parts)
        result = {name: parts[name](rank, world) for name in chosen}
    elif scenario == "buffers":
        result = scenario_buffers(rank, world)
    elif scenario == "unused":
        result = scenario_unused(rank, world)
    elif scenario == "hooks":
        result = scenario_hooks(rank, world)
    elif scenario == "syncbn":
        result = scenario_syncbn(rank, world)
    elif scenario == "syncbn-eval":
        result = scenario_syncbn_eval(rank, world)
        write(result)
        os._exit(1 if result["error"] else 0)  # no clean shutdown of a broken group
    elif scenario.startswith("failure-"):
        _, where, then = scenario.split("-")
        result = scenario_failure(rank, world, where, then)
        write(result)
        os._exit(1 if result["error"] else 0)  # no clean shutdown of a broken group
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    write(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
