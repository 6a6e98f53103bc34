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

import datetime
import json
import os
import sys
import time
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

    def __init__(self, rank: int, world: int, **options: Any) -> None:
        self.rank, self.world = rank, world
        torch.manual_seed(0)
        self.reference = Net().double()
        torch.manual_seed(100 + rank)  # other ranks start elsewhere: construction must broadcast rank 0's
        self.model = Net().double()
        with torch.no_grad():
            self.model.scale.fill_(1.0 + rank)
        if rank == 0:
            self.model.load_state_dict(self.reference.state_dict())
        self.dp = dpcore.DataParallel(
            self.model, ["cpu"] * REPLICAS[world][rank], process_group=dist.group.WORLD, **options
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
        """Records the largest difference of parameters and gradients (None
        counts as zeros: with several replicas, a parameter no replica used
        gets zeros from the in-process reduction, as in torch.nn.DataParallel)."""
        for a, b in zip(self.reference.parameters(), self.model.parameters()):
            self.worst = max(self.worst, (a - b).abs().max().item())
            if a.grad is not None or b.grad is not None:
                ga = a.grad if a.grad is not None else torch.zeros_like(a)
                gb = b.grad if b.grad is not None else torch.zeros_like(b)
                self.worst = max(self.worst, (ga - gb).abs().max().item())

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
    user_loss(r.dp(xs[r.rank], **forward), ys[r.rank]).backward()


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
    out["buckets"] = len(small.dp._sync._buckets)
    out["uneven_small_buckets"] = check_steps(small, uneven)
    # No bucket that can carry the sample count (as when every bucket is half
    # precision): the count takes its own all-reduce.
    separate = Runner(rank, world)
    separate.dp._sync._carrier = None
    out["uneven_separate_count"] = check_steps(separate, uneven)

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
            sum(sizes[p] for sizes in windows) / total
            * sum(user_loss(r.reference(xs[p]), ys[p]) for xs, ys in batches)
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

    # A parameter used by rank 1 only (zeros elsewhere), one used nowhere.
    r = Runner(rank, world, bucket_bytes=64)
    for step in range(STEPS):
        r.zero_grad()
        sizes = uneven(step)
        xs, ys = r.batch(sizes)
        n = sum(sizes)
        reference = sum(
            sizes[p] / n * user_loss(r.reference(xs[p], use_extra=p == 1), ys[p]) for p in range(world)
        )
        reference.backward()
        user_loss(r.dp(xs[rank], use_extra=rank == 1), ys[rank]).backward()
        r.step()
    out["unused"] = r.worst
    never = r.model.never.grad
    out["never_used_grad_is_none_or_zero"] = never is None or not never.any().item()
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
        synced.append(sum(len(b.params) for b in r.dp._sync._buckets))
    out["unfrozen"] = r.worst
    out["synchronized_parameters"] = synced
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
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=dist.group.WORLD)
    dp(torch.randn(4, 40)).sum().backward()
    out["then_trains"] = model[0].weight.grad is not None
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
            result = {"error": type(error).__name__, "runtime_error": isinstance(error, RuntimeError),
                      "message": str(error)[:500], "step": step, "seconds": time.monotonic() - started}
            if rank == 1 and then == "stay":
                write(result)
                time.sleep(3 * timeout())  # alive, its connections open, doing nothing
            return result
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
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "all":  # the checks that leave the group usable, in one run
        result = {"equality": scenario_equality(rank, world), "mismatch": scenario_mismatch(rank, world)}
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
