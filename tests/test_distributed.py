"""Hybrid data parallelism: DataParallel(..., process_group=pg) (dpcore/distributed.py).

Multi-process checks start 2 or 3 ranks of a gloo group on 127.0.0.1 (a free
port, nothing beyond loopback) running tests/distributed_worker.py; each run
is bounded by a timeout, so a hang is a failure. Several checks share one
run to keep the suite short. In-process checks use a one-process group.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpcore
from conftest import TESTS_DIR, requires_cuda, subprocess_env
from dpcore.bench.distributed import free_port

WORKER = os.path.join(TESTS_DIR, "distributed_worker.py")
ATOL = 1e-10


def loopback_env() -> dict[str, str]:
    """subprocess_env plus what keeps gloo on loopback and the children on one thread each."""
    env = subprocess_env()
    env.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    names = [name for _, name in socket.if_nameindex()]
    if "lo" in names:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def launch(
    scenario: str,
    world: int,
    out: Path,
    *,
    timeout: float = 180,
    pg_timeout: float = 60,
    wait_for: list[int] | None = None,
    backend: str = "gloo",
) -> list[dict[str, Any] | None]:
    """Runs `scenario` on `world` ranks; waits (at most `timeout` seconds in
    all) for the ranks in `wait_for` (default all), kills the rest, and
    returns each rank's JSON result (None where a rank wrote none). A rank
    still running at the deadline fails the test with every rank's output."""
    env = loopback_env()
    env.update(
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        DPCORE_TEST_PG_TIMEOUT=str(pg_timeout),
        DPCORE_TEST_BACKEND=backend,
    )
    procs = []
    logs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, scenario, str(out)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                cwd=TESTS_DIR,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for rank in wait_for if wait_for is not None else range(world):
            try:
                procs[rank].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{scenario}: rank {rank} still running after {timeout} s (a hang)\n" + _logs(out, world))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    results = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def _logs(out: Path, world: int) -> str:
    return "\n".join(
        f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(world)
    )


@pytest.fixture(scope="module", params=[2, 3], ids=["2 processes", "3 processes"])
def group_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    """One run of the checks that leave the group usable ("all" in
    distributed_worker.py) on 2 processes (2 replicas each) or 3 (2, 1 and 3
    replicas); every rank's results."""
    world = request.param
    out = tmp_path_factory.mktemp(f"group{world}")
    results = launch("all", world, out)
    assert all(r is not None for r in results), _logs(out, world)
    return world, [r for r in results if r is not None]


def test_hybrid_equals_single_device_in_float64(group_run: tuple[int, list[dict[str, Any]]]) -> None:
    """Against one device on the global batch, float64, after each of 3 SGD
    steps (momentum): equal and uneven local batches, many buckets, an
    empty local batch on rank 1,
    criterion= (mean and sum), no_sync
    accumulation (the same shares in every micro-step: single-device
    accumulation; changing shares: the documented weights by each process's
    share of the window), two backward passes into one .grad, a parameter
    used by rank 1 only and one used by none, buffers (rank 0's at
    construction and before each forward, or not), a parameter unfrozen
    during training."""
    _, results = group_run
    for rank, r in enumerate(results):
        r = r["equality"]
        for key in (
            "equal",
            "uneven",
            "uneven_small_buckets",
            "empty_rank",
            "criterion_mean",
            "criterion_sum",
            "criterion_function_mean",
            "criterion_function_sum",
            "no_sync",
            "no_sync_changing_shares",
            "twice_without_zero_grad",
            "unused",
            "buffers",
            "unfrozen",
        ):
            assert 0.0 <= r[key] <= ATOL, f"rank {rank}: {key} differs from the single-device run by {r[key]}"
        assert r["buckets"] > 2  # the overlap path: buckets launched from the hooks
        assert r["no_sync_left_gradients_local"] is True
        assert r["never_used_grad_is_none"] is True and r["extra_grad_on_every_rank"] is True
        assert r["scale_after_construction"] == 1.0  # rank 0's value, not 1 + rank
        assert r["scale_without_broadcast"] == 1.0 + 0.5 * rank
        assert r["fc1_weight_has_grad"] == [False, True, True]  # frozen at step 0, then synchronized


def test_models_that_differ_between_processes_fail_on_every_rank(group_run: tuple[int, list[dict[str, Any]]]) -> None:
    """Different shapes or bucket layouts: ValueError on every rank naming the
    first difference; the group stays usable. register_comm_hook on rank 1
    only: a RuntimeError on every rank at the first synchronizing backward,
    naming the rank; once every rank registered it, training goes on. Also,
    with one replica per rank, gradients of unused parameters (None
    everywhere, or used by one rank)."""
    world, results = group_run
    for r in results:
        r = r["mismatch"]
        assert r["shape"] is not None and "rank 1 has parameter '0.weight': shape (6, 4)" in r["shape"]
        assert "where rank 0 has parameter '0.weight': shape (5, 4)" in r["shape"]
        assert r["buckets"] is not None and "gradient bucket" in r["buckets"]
        assert r["then_trains"] is True
        assert r["hook_on_rank_1"] is not None and r["hook_on_rank_1"].startswith(
            "register_comm_hook: called on rank 1 only; every rank must register the same hook"
        ), r["hook_on_rank_1"]
        assert r["hook_then_everywhere"] == [4.0] * 3  # d(sum over 4 rows)/d(bias), every rank weighted alike
        assert r["single_replica_never_grad"] is None
        # rank 1: d(sum of 2 x 3 outputs)/d(bias) = 2 per entry; weighted by rank 1's share 2 / (2 * world)
        assert r["single_replica_extra_bias_grad"] == [pytest.approx(2.0 / world)] * 3


#: Every rank's default buffer options, as an agreement error shows them.
DEFAULT_BUFFERS = (
    "broadcast_buffers=None, forward_sync_buffers=None (buffers sent at construction and before training forwards)"
)


def test_options_that_differ_between_processes_are_named_as_given(group_run: tuple[int, list[dict[str, Any]]]) -> None:
    """An option that disagrees between ranks is a ValueError on every rank
    naming the option by the name and value each disagreeing rank gave, and
    rank 0's: broadcast_buffers=False on every other rank (each named),
    forward_sync_buffers=False on ranks 1.. against True, sync_batchnorm=True
    on rank 1 alone, bucket_bytes on rank 1 alone (the bucket it changes), a
    summed criterion or model_loss='sum' on rank 1 alone (the loss, by which
    the processes' gradients are weighted).
    Options given differently to the same effect (broadcast_buffers=True,
    or with forward_sync_buffers=True) agree."""
    world, results = group_run
    others = range(1, world)
    expected = {
        "broadcast_buffers": [
            f"rank {r} has broadcast_buffers=False, forward_sync_buffers=None (buffers never sent) "
            f"where rank 0 has {DEFAULT_BUFFERS}"
            for r in others
        ],
        "forward_sync_buffers": [
            f"rank {r} has broadcast_buffers=None, forward_sync_buffers=False (buffers sent at construction only) "
            "where rank 0 has broadcast_buffers=None, forward_sync_buffers=True (buffers sent at construction and "
            "before training forwards)"
            for r in others
        ],
        "sync_batchnorm": ["rank 1 has sync_batchnorm=True where rank 0 has sync_batchnorm=False"],
        "criterion": [
            "rank 1 has criterion=MSELoss with reduction='sum' (the processes' gradients summed) where rank 0 has "
            "criterion=MSELoss with reduction='mean' (the processes' gradients weighted by rows)"
        ],
        "model_loss": [
            "rank 1 has model_loss='sum' (the processes' gradients summed) where rank 0 has no criterion or "
            "model_loss (the processes' gradients weighted by rows)"
        ],
    }
    for rank, r in enumerate(results):
        got = r["mismatch"]["options"]
        for name, phrases in expected.items():
            message = got[name]
            assert message is not None and message.startswith("process_group: every process must"), (rank, message)
            assert "; ".join(phrases) in message, (rank, message)
            assert message.count(" has ") == 2 * len(phrases), (rank, message)  # the agreeing ranks are not named
        assert got["same_effect"] is None and got["same_effect_both"] is None, (rank, got)
        assert got["same_effect_loss"] is None, (rank, got)
        buckets = r["mismatch"]["buckets"]
        assert "rank 1 has bucket_bytes=1024 (gradient bucket 0: parameters" in buckets, buckets
        assert "where rank 0 has bucket_bytes=1000000 (gradient bucket 0: parameters" in buckets, buckets
        assert "rank 2" not in buckets, buckets


@pytest.mark.parametrize(("where", "then"), [("forward", "exit"), ("backward", "stay")])
def test_a_failing_rank_is_an_error_on_the_others(where: str, then: str, tmp_path: Path) -> None:
    """Rank 1 raises at step 1, in forward (then its process ends) or in
    backward (then it stays alive, holding its connections): rank 0 raises
    too, within the group's timeout, instead of hanging."""
    pg_timeout = 4.0
    results = launch(f"failure-{where}-{then}", 2, tmp_path, pg_timeout=pg_timeout, wait_for=[0])
    assert results[1] is not None and results[1]["error"] == "ValueError", _logs(tmp_path, 2)
    assert f"boom in {where} on rank 1" in results[1]["message"]
    zero = results[0]
    assert zero is not None, _logs(tmp_path, 2)
    assert zero["runtime_error"] is True and zero["step"] == 1, zero  # the backend's error (gloo: RuntimeError)
    if then == "exit":
        assert zero["seconds"] < pg_timeout, zero  # the closed connection is seen at once
    else:
        assert pg_timeout * 0.9 <= zero["seconds"] < pg_timeout + 10, zero  # bounded by the group's timeout


#: The group timeout of the parity run: a collective that should not happen
#: (rank 0 evaluating alone) or a mismatched one fails within it, not in
#: gloo's 30 minutes.
PARITY_PG_TIMEOUT = 20.0
#: What "at once" means for those checks: far below the group's timeout.
AT_ONCE_S = 5.0


@pytest.fixture(
    scope="module",
    params=[("gloo", 2), ("gloo", 3), ("nccl", 2)],
    ids=["gloo 2 processes", "gloo 3 processes", "nccl 2 processes"],
)
def parity_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    """One run of the DDP-parity checks ("parity" in distributed_worker.py:
    rank-0-only evaluation, layout changes after construction, Join) with a
    20 s group timeout: gloo on 2 processes (2 replicas each) or 3 (2, 1 and
    3 replicas), or NCCL on 2 processes with one GPU each (skipped with
    fewer than 2 GPUs)."""
    return _every_rank_of("parity", request.param, tmp_path_factory)


def _every_rank_of(
    scenario: str, param: tuple[str, int], tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    """(world, every rank's results) of one run of `scenario` with the
    (backend, world) of `param` and PARITY_PG_TIMEOUT; skipped for NCCL
    with fewer GPUs than ranks; fails unless every rank wrote its results."""
    backend, world = param
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world):
        pytest.skip(f"NCCL needs {world} GPUs")
    out = tmp_path_factory.mktemp(f"{scenario}-{backend}{world}")
    results = launch(scenario, world, out, timeout=300, pg_timeout=PARITY_PG_TIMEOUT, backend=backend)
    assert all(r is not None for r in results), _logs(out, world)
    return world, [r for r in results if r is not None]


def test_rank_zero_evaluation_makes_no_collective(parity_run: tuple[int, list[dict[str, Any]]]) -> None:
    """`if rank == 0: evaluate(dp)` between training steps, the other ranks
    waiting outside any collective: under no_grad (model.eval() and train
    mode), inference_mode, and a model without trainable parameters it
    finishes at once (not at the group's timeout), and the training steps
    around it stay exact against one device (buffers are still broadcast
    before training forwards). With broadcast_buffers=False (as DDP's)
    buffers are never sent, not at construction either."""
    _, results = parity_run
    for rank, r in enumerate(results):
        r = r["eval"]
        for mode in ("no_grad_eval_mode", "no_grad_train_mode", "inference_mode"):
            assert 0.0 <= r[mode]["worst"] <= ATOL, f"rank {rank}: {mode}: {r[mode]}"
            if rank == 0:
                assert r[mode]["seconds"] < AT_ONCE_S, f"{mode}: {r[mode]}"
        if rank == 0:
            assert r["frozen"]["seconds"] < AT_ONCE_S, r["frozen"]
        assert r["own_buffer_without_broadcast"] == 1.0 + rank  # broadcast_buffers=False: never sent
        assert r["parameters_still_from_rank_0"] is True
        assert r["group_usable"] is True


def test_a_layout_change_on_one_rank_is_an_error_on_every_rank(parity_run: tuple[int, list[dict[str, Any]]]) -> None:
    """After construction, rank 1 freezes a parameter (before step 2), or
    rank 0 replaces one (before step 1), or every rank replaces one with
    different values, or rank 1 sets its criterion's reduction to 'sum' in
    place (before step 1): a ValueError on every rank in that step, at once,
    naming the rank and the change; the group stays usable. The same change
    on every rank (equal values; the reduction) is adopted, exact against
    one device."""
    world, results = parity_run
    expected = {
        "freeze_on_rank_1": (
            2,
            "on rank 1 (rank 1: parameter 'fc1.weight' frozen (requires_grad True -> False))",
            "but rank" + ("s 0, 2" if world == 3 else " 0") + " did not change",
        ),
        "freeze_on_rank_1_small_buckets": (2, "on rank 1 (rank 1: parameter 'fc1.weight' frozen", "did not change"),
        "replace_on_rank_0": (
            1,
            "on rank 0 (rank 0: parameter 'fc2.bias' replaced by another tensor)",
            "did not change",
        ),
        "replace_differently": (1, "on ranks " + ", ".join(map(str, range(world))), "the changes differ"),
        "reduction_on_rank_1": (
            1,
            "on rank 1 (rank 1: criterion=Criterion with reduction='sum' (the processes' gradients summed) where it "
            "had criterion=Criterion with reduction='mean' (the processes' gradients weighted by rows))",
            "did not change",
        ),
    }
    for rank, r in enumerate(results):
        r = r["layout"]
        for case, (step, *phrases) in expected.items():
            got = r[case]
            assert got["error"] == "ValueError" and got["step"] == step, f"rank {rank}: {case}: {got}"
            assert all(phrase in got["message"] for phrase in phrases), f"rank {rank}: {case}: {got['message']}"
            assert got["seconds"] < AT_ONCE_S, f"rank {rank}: {case}: {got}"
        for case in ("replace_equally", "freeze_everywhere"):
            assert r[case]["error"] is None and 0.0 <= r[case]["worst"] <= ATOL, f"rank {rank}: {case}: {r[case]}"
        assert 0.0 <= r["reduction_everywhere"] <= ATOL, (rank, r["reduction_everywhere"])
        assert r["group_usable"] is True


def test_join_with_uneven_inputs_equals_ddp_under_join(parity_run: tuple[int, list[dict[str, Any]]]) -> None:
    """Rank r has 2 + r batches: dpcore under Join([dp]) equals
    DistributedDataParallel under Join (float64, SGD with momentum, buffers
    set differently on every rank before each forward) in every step's
    gradients and parameters and after the context, with
    divide_by_initial_world_size True and False (which do differ), and
    Join([dp, ZeroRedundancyOptimizer]) against Join([ddp, the same]);
    dp.join() is Join([dp]); throw_on_early_termination raises on every rank."""
    _, results = parity_run
    for rank, r in enumerate(results):
        r = r["join"]
        for divide in (True, False):
            got = r[f"divide_{divide}"]
            assert got["steps"] == 2 + rank
            assert 0.0 <= got["trace"] <= ATOL and 0.0 <= got["final"] <= ATOL, f"rank {rank}: {divide}: {got}"
        zero = r["zero"]
        assert 0.0 <= zero["trace"] <= ATOL and 0.0 <= zero["final"] <= ATOL, f"rank {rank}: ZeRO: {zero}"
        assert r["divide_changes_the_result"] > 1e-6
        assert r["join_method_equals_join"] == 0.0
        assert r["throw"] is not None and "exhausted" in r["throw"], r["throw"]
        assert r["group_usable"] is True


#: Per option of distributed_worker.BUFFER_OPTIONS (and "accumulate", the
#: default under no_sync): whether buffers are rank 0's right after wrapping,
#: whether every rank evaluates to the same output after training, and
#: whether rank 1's buffers between steps are its own (rank 0's updated by
#: its batch, or never rank 0's), not rank 0's.
BUFFER_MEANINGS = {
    "default": (True, True, True),
    "forward_sync_true": (True, True, True),
    "forward_sync_false": (True, False, True),
    "broadcast_true": (True, True, True),
    "broadcast_false": (False, False, True),
    "both": (True, True, True),
    "accumulate": (True, True, True),
}
MEANING_KEYS = ("init_synced", "ranks_agree", "buffers_differ_between_steps")


def test_buffers_between_steps_and_after_training_equal_ddps_under_each_option(tmp_path: Path) -> None:
    """BatchNorm trained for 4 steps on each rank's own batches, with a
    model.eval() inference_mode forward on every rank after the second, then
    model.eval() and a torch.no_grad() forward, against
    DistributedDataParallel with the same option (gloo, 2 processes): after
    every step each rank's parameters and buffers (running_mean,
    running_var, num_batches_tracked) equal DDP's on that rank (rank 0's
    sent at the start of each training forward after a synchronizing one,
    so between steps rank 1 holds rank 0's updated by its own batch), and
    so do both evaluations' outputs and the buffers after them, for the
    default, forward_sync_buffers True and False, broadcast_buffers True and
    False, both given (broadcast_buffers ignored), and no_sync accumulation;
    each option's meaning (buffers sent at construction; every rank
    evaluating rank 0's buffers) is DDP's. With 2 replicas per process,
    where DDP has no equivalent: against a one-process simulation of every
    rank (each rank's statistics are its first replica's). Rank 0
    evaluating alone after training finishes at once; then every rank's
    evaluation keeps a buffer it wrote after the last backward, and takes
    rank 0's others."""
    world = 2
    results = launch("buffers", world, tmp_path, timeout=300, pg_timeout=PARITY_PG_TIMEOUT)
    assert all(r is not None for r in results), _logs(tmp_path, world)
    for rank, r in enumerate(results):
        assert r is not None
        for name, meanings in BUFFER_MEANINGS.items():
            got = r[name]
            for key in ("output", "buffers", "trace"):
                assert 0.0 <= got[key] <= ATOL, f"rank {rank}: {name}: {key}: {got}"
            for key, expected in zip(MEANING_KEYS, meanings):
                assert got[f"ddp_{key}"] is expected and got[f"ours_{key}"] is expected, (name, key, got)
        for name, worst in r["replicas"].items():
            assert 0.0 <= worst <= ATOL, f"rank {rank}: 2 replicas: {name}: {worst}"
        if rank == 0:
            assert r["rank_0_alone_seconds"] < AT_ONCE_S, r["rank_0_alone_seconds"]
        assert r["written_buffer_kept"] is True and r["others_are_rank_0s"] is True, r
        assert r["group_usable"] is True


# -- communication hooks: register_comm_hook with torch's hooks -----------------

#: HookNet (tests/distributed_worker.py): gradient elements and tensors.
HOOKNET_ELEMENTS, HOOKNET_TENSORS = 8 * 16 + 8 + 8 + 1, 4
BYTES = {"torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}


@pytest.fixture(scope="module")
def hooks_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]]]:
    """One run of the communication-hook checks ("hooks" in
    distributed_worker.py) on 2 gloo processes."""
    world = 2
    out = tmp_path_factory.mktemp("hooks")
    results = launch("hooks", world, out, timeout=300)
    assert all(r is not None for r in results), _logs(out, world)
    return world, [r for r in results if r is not None]


def _wire_bytes(calls: list[list[Any]]) -> int:
    return sum(BYTES[dtype] * n for dtype, n in calls)


def test_torch_hooks_equal_ddp_with_the_same_hook(hooks_run: tuple[int, list[dict[str, Any]]]) -> None:
    """torch's allreduce_hook, fp16_compress_hook, bf16_compress_hook,
    fp16_compress_wrapper(allreduce_hook) and powerSGD_hook (rank 1, error
    feedback, warm start, compressing from step 2): dpcore (one replica per
    rank) equals DDP with the same hook in every step's gradients and
    parameters (float32, 5 SGD steps with momentum, equal batches), also
    with one bucket per parameter, under no_sync (2 accumulated backward
    passes) and under Join (rank r has 2 + r batches: the joined rank's
    zeros go through the hook). The results are bitwise equal: with equal
    batches the hook sees exactly DDP's bucket."""
    _, results = hooks_run
    for rank, r in enumerate(results):
        for name, difference in r["parity"].items():
            assert difference == 0.0, f"rank {rank}: {name}: {difference}"
        for name, difference in r["no_sync"].items():
            assert difference == 0.0, f"rank {rank}: no_sync {name}: {difference}"
        for name in ("allreduce", "fp16"):
            got = r["join"][name]
            assert got["steps"] == 2 + rank and got["trace"] == 0.0 and got["final"] == 0.0, (rank, name, got)
        # divide_by_initial_world_size=False keeps dpcore's weights: the same as without a hook.
        assert 0.0 <= r["join"]["divide_false_as_without_hook"] <= ATOL
        power = r["powerSGD_small_buckets"]
        assert power["same_on_every_rank"] and power["finite"], f"rank {rank}: {power}"
        assert r["group_usable"] is True


def test_half_precision_hooks_halve_the_bytes_on_the_wire(hooks_run: tuple[int, list[dict[str, Any]]]) -> None:
    """The all_reduce calls of each backward, counted: with fp16 or bf16
    compression the gradients travel in half the bytes of allreduce_hook
    (float32), in the same calls as DDP with that hook; beside them dpcore
    sends one float64 side tensor per synchronization (each parameter's
    "has a gradient" flag, the sample count, a counted flag, one layout mark
    per rank), plus the sample count and hook marks before the first. PowerSGD
    sends DDP's compressed tensors from step 2 on."""
    world, results = hooks_run
    side = [["torch.float64", HOOKNET_TENSORS + 2 + world]]
    for rank, r in enumerate(results):
        wire = r["wire"]
        for name, steps in wire.items():
            if name in ("none", "fp16_small_buckets"):
                continue
            ours, ddp = steps["dpcore"], steps["ddp"]
            assert ours[0][0] == ["torch.float64", 2 + world], (rank, name, ours[0])  # the first N, hook marks: once
            assert [step[1:] if k == 0 else step for k, step in enumerate(ours)] == [s + side for s in ddp]
        full = wire["allreduce"]["dpcore"]
        for name, dtype in (("fp16", "torch.float16"), ("bf16", "torch.bfloat16"), ("fp16_wrapper", "torch.float16")):
            for k, step in enumerate(wire[name]["dpcore"]):
                gradients = step[1:-1] if k == 0 else step[:-1]
                reference = full[k][1:-1] if k == 0 else full[k][:-1]
                assert gradients == [[dtype, HOOKNET_ELEMENTS]], (rank, name, step)
                assert _wire_bytes(gradients) * 2 == _wire_bytes(reference) == 4 * HOOKNET_ELEMENTS
        # Without a hook: one float32 bucket holding gradients, flags, count, counted flag and marks (at the first
        # synchronization after the count and hook marks, as with a hook).
        bucket = ["torch.float32", HOOKNET_ELEMENTS + HOOKNET_TENSORS + 2 + world]
        assert wire["none"]["dpcore"] == [[["torch.float64", 2 + world], bucket]] + [[bucket]] * 4
        # One bucket per parameter: each sent compressed, then the side tensor.
        for k, step in enumerate(wire["fp16_small_buckets"]):
            gradients = step[1:-1] if k == 0 else step[:-1]
            assert all(dtype == "torch.float16" for dtype, _ in gradients) and len(gradients) == 3, step
            assert sum(n for _, n in gradients) == HOOKNET_ELEMENTS and step[-1] == side[0]
        power = wire["powerSGD"]["dpcore"]
        assert _wire_bytes(power[4]) < _wire_bytes(full[4]) / 2, power[4]


def test_hooks_keep_uneven_batches_weighted(hooks_run: tuple[int, list[dict[str, Any]]]) -> None:
    """Several replicas per rank, uneven local batches (5 and 3, 4 and 0, 2
    and 7 rows), float64, 3 SGD steps against one device on the global
    batch: with allreduce_hook as exact as without a hook; with fp16 and
    bf16 compression within their precision (relative 2**-10 and 2**-7 of
    the largest entry), where DDP's unweighted mean is off by far more. A
    float16 model without a hook (no bucket can carry the sample count, which
    takes its own all-reduce) within float16's precision."""
    world, results = hooks_run
    for rank, r in enumerate(results):
        got = r["uneven"]
        assert 0.0 <= got["none"] <= 1e-12 and 0.0 <= got["allreduce"] <= 1e-12, (rank, got)
        assert 0.0 < got["fp16"] <= 2.0**-10, (rank, got)
        assert 0.0 < got["bf16"] <= 2.0**-7, (rank, got)
        assert got["ddp_unweighted"] > 0.1, (rank, got)
        assert 0.0 < got["float16_separate_count"] <= 2.0**-7, (rank, got)
        # A float16 bucket cannot carry the count: it goes alone in float64 (after the first synchronization's
        # count and hook marks).
        wire = r["float16_separate_count_wire"]
        bucket, alone = ["torch.float16", HOOKNET_ELEMENTS + HOOKNET_TENSORS + 2 + world], ["torch.float64", 2]
        assert wire == [[["torch.float64", 2 + world], alone, bucket]] + [[alone, bucket]] * 2, (rank, wire)


# -- synchronized BatchNorm across processes ------------------------------------


@pytest.fixture(scope="module", params=[("gloo", 2), ("nccl", 2)], ids=["gloo 2 processes", "nccl 2 processes"])
def syncbn_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    """One run of "syncbn" (distributed_worker.py): gloo on 2 processes with
    2 CPU replicas each, or NCCL on 2 processes with one GPU each (skipped
    with fewer than 2 GPUs); a 20 s group timeout."""
    return _every_rank_of("syncbn", request.param, tmp_path_factory)


def test_sync_batchnorm_across_processes_equals_one_device(syncbn_run: tuple[int, list[dict[str, Any]]]) -> None:
    """sync_batchnorm=True with a process group: BatchNorm2d and BatchNorm1d
    (momentum=None too) normalize with the global batch's statistics, so
    against one device on the global batch (float64, 4 SGD steps with
    momentum, uneven local batches, the last with no rows on rank 1, a mean
    loss and a summed criterion) the outputs, gradients, parameters and
    every rank's own BatchNorm buffers (broadcast_buffers=False: running
    mean and variance, num_batches_tracked) agree."""
    _, results = syncbn_run
    for rank, r in enumerate(results):
        for name in ("mean", "sum"):
            for what, worst in r[name].items():
                assert 0.0 <= worst <= ATOL, f"rank {rank}: {name}: {what}: {r[name]}"
            assert r[f"{name}_batches_tracked"] == 4


def test_sync_batchnorm_ranks_at_different_layers_fail_on_every_rank(
    syncbn_run: tuple[int, list[dict[str, Any]]],
) -> None:
    """Rank 0 reaches BatchNorm 'a' where rank 1 reaches 'b' (the same
    layout, another call): a SyncBatchNormError on every rank at once, naming
    each rank's call; the group stays usable. Join is refused (a joined rank
    cannot shadow BatchNorm's collectives), and a no_grad forward of rank 0
    alone in train mode makes no collective (it finishes at once)."""
    _, results = syncbn_run
    for rank, r in enumerate(results):
        got = r["different_layers"]
        assert got["error"] == "SyncBatchNormError", f"rank {rank}: {got}"
        assert (
            "rank 0: the forward of BatchNorm 'a' (call 1); rank 1: the forward of BatchNorm 'b' (call 1)"
            in (got["message"])
        ), got
        assert got["seconds"] < AT_ONCE_S, got
        assert r["join"] is not None and "cannot shadow the BatchNorm collectives" in r["join"]
        assert r["group_usable"] is True
    assert results[0]["no_grad_alone_seconds"] < AT_ONCE_S


def test_sync_batchnorm_a_rank_in_eval_mode_is_an_error_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 in eval mode makes no BatchNorm collective while rank 0 waits
    at its first one: both raise within the group's timeout (rank 0 a
    SyncBatchNormError naming the layer, rank 1 the backend's error from its
    gradient all-reduce), never a hang."""
    pg_timeout = 4.0
    results = launch("syncbn-eval", 2, tmp_path, pg_timeout=pg_timeout)
    zero, one = results
    assert zero is not None and one is not None, _logs(tmp_path, 2)
    assert zero["error"] == "SyncBatchNormError", zero
    assert "rank 0 waited in the forward of BatchNorm '1' (call 1)" in zero["message"], zero
    assert one["runtime_error"] is True, one
    for r in results:
        assert r is not None and r["seconds"] < pg_timeout + 10, r


# -- one process: the API, without spawning ------------------------------------


def test_one_process_group_matches_plain_data_parallel(world_of_one: Any) -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    b = copy.deepcopy(a)
    hybrid = dpcore.DataParallel(a, ["cpu"] * 3, process_group=world_of_one, bucket_bytes=64)
    plain = dpcore.DataParallel(b, ["cpu"] * 3)
    x = torch.randn(7, 6, dtype=torch.float64)
    hybrid(x).square().mean().backward()
    plain(x).square().mean().backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14)


def test_one_live_hybrid_wrapper_per_module(world_of_one: Any) -> None:
    model = nn.Linear(3, 2)
    dp = dpcore.DataParallel(model, ["cpu"], process_group=world_of_one)
    with pytest.raises(ValueError, match="module: already wrapped by a DataParallel with a process_group"):
        dpcore.DataParallel(model, ["cpu"] * 2, process_group=world_of_one)
    dpcore.DataParallel(model, ["cpu"] * 2)(torch.randn(2, 3))  # without a group: fine
    del dp
    again = dpcore.DataParallel(model, ["cpu"] * 2, process_group=world_of_one)  # the first one is gone
    again(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None


def test_default_devices_are_the_modules_and_no_sync_works_without_a_group(world_of_one: Any) -> None:
    model = nn.Linear(3, 2)
    dp = dpcore.DataParallel(model, process_group=world_of_one)
    assert dp.device_ids == [torch.device("cpu")]
    with dpcore.DataParallel(nn.Linear(3, 2), ["cpu"]).no_sync():
        pass


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The collectives torch.distributed makes while the test runs: (name, elements of the tensor sent), in order."""
    calls: list[tuple[str, int]] = []
    for name in ("broadcast", "all_reduce", "all_gather", "all_gather_object"):
        real = getattr(dist, name)

        def counted(tensor: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append((_name, tensor.numel() if isinstance(tensor, torch.Tensor) else 0))
            return _real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    return calls


def test_no_sync_leaves_gradients_local_and_autograd_grad_is_untouched(
    world_of_one: Any, collectives: list[tuple[str, int]]
) -> None:
    model = nn.Linear(3, 2)
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=world_of_one)
    with dp.no_sync():
        loss = dp(torch.randn(4, 3)).sum()
        collectives.clear()
        loss.backward()
    assert collectives == []  # nothing was launched
    loss = dp(torch.randn(4, 3)).sum()
    collectives.clear()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert len(grads) == 2 and collectives == []  # autograd.grad accumulates nothing: no synchronization
    dp(torch.randn(4, 3)).sum().backward()
    # A synchronizing one: one bucket of both gradients (6 + 2), a flag each, the count, the counted flag, 1 mark.
    assert ("all_reduce", 6 + 2 + 2 + 1 + 1 + 1) in collectives


def test_forwards_that_cannot_synchronize_make_no_collective(
    world_of_one: Any, collectives: list[tuple[str, int]]
) -> None:
    """no_grad, inference_mode and a model without trainable parameters:
    no collective at all (so one rank may evaluate alone); a training
    forward broadcasts the buffers, and its backward all-reduces."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=world_of_one)
    frozen = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double().requires_grad_(False)
    dp_frozen = dpcore.DataParallel(frozen, ["cpu"] * 2, process_group=world_of_one)
    x = torch.randn(6, 3, dtype=torch.float64)
    collectives.clear()
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            dp(x)
        with torch.inference_mode():
            dp(x)
        dp_frozen(x).sum()
    assert collectives == []
    model.train()
    dp(x).sum().backward()
    names = [name for name, _ in collectives]
    assert "broadcast" in names and "all_reduce" in names


def test_bucket_readiness_is_counted_in_cpp(
    world_of_one: Any, monkeypatch: pytest.MonkeyPatch, collectives: list[tuple[str, int]]
) -> None:
    """The gradients' readiness is counted in C++ (csrc/dpcore/grad_ready.h):
    a synchronizing backward calls the Python side once when it begins and
    at most once per bucket, never once per parameter; a backward under
    no_sync not at all. The gradients equal the bare module's."""
    from dpcore import _buckets

    calls: list[str] = []
    for name in ("_begin", "_ready"):
        real = getattr(_buckets.BucketReducer, name)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name) -> None:
            calls.append(_name)
            _real(self, *args)

        monkeypatch.setattr(_buckets.BucketReducer, name, counted)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(10)]).double()
    reference = copy.deepcopy(model)
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=world_of_one, bucket_bytes=3 * 8 * 8 * 8)
    x = torch.randn(6, 8, dtype=torch.float64)
    loss = dp(x).square().mean()
    collectives.clear()
    loss.backward()
    buckets = len(collectives) - 1  # one all-reduce per bucket, after the first synchronization's agreement
    assert collectives[0] == ("all_reduce", 2 + 1) and {name for name, _ in collectives} == {"all_reduce"}
    assert 1 < buckets < len(list(model.parameters())) // 2
    assert calls.count("_begin") == 1 and 1 <= calls.count("_ready") <= buckets, calls
    reference(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14)
    calls.clear()
    with dp.no_sync():
        dp(x).sum().backward()
    assert calls == []


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def test_sync_batchnorm_across_a_group_of_one_equals_one_device(
    world_of_one: Any, replicas: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path of several processes (replica 0 all-gathers the process's
    statistics at each BatchNorm call and hands the result on in a second
    round; backward all-reduces their gradients), over a group of one set by
    hand (a real one needs two processes; a group of one synchronizes
    nothing): exact against one device in output, gradients and running
    statistics, with one replica too; one all-gather per BatchNorm call per
    forward and one all-reduce per backward; none under no_grad."""
    from dpcore.sync_batchnorm import AcrossProcesses

    calls = {"forward": 0, "backward": 0}
    forward, backward = AcrossProcesses.__call__, AcrossProcesses.reduce_gradients

    def counted_forward(self: Any, *args: Any) -> Any:
        calls["forward"] += 1
        return forward(self, *args)

    def counted_backward(self: Any, *args: Any) -> Any:
        calls["backward"] += 1
        return backward(self, *args)

    monkeypatch.setattr(AcrossProcesses, "__call__", counted_forward)
    monkeypatch.setattr(AcrossProcesses, "reduce_gradients", counted_backward)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Linear(3, 2)).double()
    reference = copy.deepcopy(model)
    model.to(device)
    devices = ["cpu"] * replicas if device == "cpu" else [0] * replicas  # gloo carries CUDA tensors too
    dp = dpcore.DataParallel(model, devices, process_group=world_of_one, sync_batchnorm=True)
    assert dp._sync.batchnorm_group is None  # one process: nothing to synchronize across
    dp._sync.batchnorm_group = world_of_one
    for step in range(2):
        x = torch.randn(7, 4, dtype=torch.float64)
        out, ref = dp(x.to(device)).cpu(), reference(x)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        out.pow(2).mean().backward()
        ref.pow(2).mean().backward()
        for a, b in zip(reference.parameters(), model.parameters()):
            torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-12, rtol=0)
        for a, b in zip(reference.buffers(), model.buffers()):
            torch.testing.assert_close(b.cpu(), a, atol=1e-12, rtol=0)
    assert calls == {"forward": 2, "backward": 2}
    with torch.no_grad():
        dp(torch.randn(5, 4, dtype=torch.float64, device=device))
    assert calls == {"forward": 2, "backward": 2}


def test_ddp_attributes_exist_or_name_the_wrapper(world_of_one: Any) -> None:
    """The wrapper is a Joinable (also as a base class), has DDP's
    process_group and join(); DDP-only attributes its module lacks are an
    AttributeError naming dpcore's wrapper; Join needs a process group."""
    from torch.distributed.algorithms.join import Join, Joinable

    model = nn.Linear(3, 2).double()
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=world_of_one)
    assert isinstance(dp, Joinable) and dp.process_group is world_of_one
    assert dp.join_process_group is world_of_one and dp.join_device == torch.device("cpu")
    plain = dpcore.DataParallel(nn.Linear(3, 2), ["cpu"] * 2)
    assert plain.process_group is None
    for name in ("reducer", "static_graph", "find_unused_parameters", "register_comm_hook"):
        if hasattr(type(dp), name):
            continue  # provided by the wrapper itself
        message = rf"dpcore.DataParallel has no attribute '{name}' \(nor has its module, a Linear\)"
        with pytest.raises(AttributeError, match=message):
            getattr(dp, name)
    model.reducer = "the module's own"  # a module attribute of that name still falls through
    assert dp.reducer == "the module's own"
    with pytest.raises(AttributeError, match="'Linear' object has no attribute 'no_such_thing'"):
        _ = dp.no_such_thing
    with pytest.raises(ValueError, match=r"Join: needs a dpcore.DataParallel with a process_group="):
        Join([plain])
    with pytest.raises(ValueError, match=r"join\(\): needs a dpcore.DataParallel with a process_group="):
        plain.join()

    class Sub(dpcore.DataParallel):
        pass

    torch.manual_seed(0)
    a = nn.Linear(3, 2).double()
    b = copy.deepcopy(a)
    sub = Sub(a, ["cpu"] * 2, process_group=world_of_one)
    reference = dpcore.DataParallel(b, ["cpu"] * 2)
    x = torch.randn(5, 3, dtype=torch.float64)
    with sub.join():  # one process: Join changes nothing
        sub(x).square().mean().backward()
    reference(x).square().mean().backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14)
    copy.deepcopy(plain)  # the join state copies with a wrapper without a group


@pytest.mark.parametrize(
    "options",
    [{}, {"forward_sync_buffers": False}, {"broadcast_buffers": True}, {"broadcast_buffers": False}]
    + [{"broadcast_buffers": b, "forward_sync_buffers": f} for b in (True, False) for f in (True, False)],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()) or "none",
)
def test_buffer_options_warn_and_resolve_as_ddps(world_of_one: Any, options: dict[str, bool]) -> None:
    """forward_sync_buffers and the deprecated broadcast_buffers: the same
    FutureWarnings as torch's DistributedDataParallel (none, one for the old
    name, one for both, which ignores the old name), pointing at the
    caller's line, and the same resolved forward_sync_buffers."""
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        dp = dpcore.DataParallel(nn.Linear(3, 2), ["cpu"], process_group=world_of_one, **options)
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(nn.Linear(3, 2), process_group=world_of_one, **options)
    assert [w.category for w in ours] == [w.category for w in theirs]
    assert len(ours) == ("broadcast_buffers" in options)
    assert all(w.filename == __file__ for w in ours)
    for ddp_warning, our_warning in zip(theirs, ours):  # the same first sentence, naming dpcore's wrapper
        assert str(our_warning.message).startswith("DataParallel: " + str(ddp_warning.message).split(".")[0])
    assert dp._sync is not None and dp._sync.forward_sync_buffers is ddp.forward_sync_buffers


@pytest.mark.parametrize("name", ["forward_sync_buffers", "broadcast_buffers"])
def test_buffer_options_must_be_true_false_or_none(world_of_one: Any, name: str) -> None:
    with pytest.raises(TypeError, match=rf"{name}: expected True, False or None, but got 'yes'"):
        dpcore.DataParallel(nn.Linear(3, 2), ["cpu"], process_group=world_of_one, **{name: "yes"})


def test_register_comm_hook_needs_a_group_and_checks_its_arguments(world_of_one: Any) -> None:
    """Without a process group: an error naming dpcore's wrapper. A hook
    that is not callable or does not take (state, bucket): TypeError. Only
    one hook, registered before the first synchronizing backward."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    plain = dpcore.DataParallel(nn.Linear(3, 2), ["cpu"] * 2)
    with pytest.raises(ValueError, match=r"register_comm_hook: needs a dpcore.DataParallel with a process_group="):
        plain.register_comm_hook(None, allreduce_hook)
    dp = dpcore.DataParallel(nn.Linear(3, 2), ["cpu"] * 2, process_group=world_of_one)
    with pytest.raises(TypeError, match=r"hook: expected a callable hook\(state, bucket\)"):
        dp.register_comm_hook(None, "allreduce")
    with pytest.raises(TypeError, match=r"hook: expected a callable taking \(state, bucket\), but '<lambda>'"):
        dp.register_comm_hook(None, lambda bucket: bucket)
    dp.register_comm_hook(world_of_one, allreduce_hook)
    with pytest.raises(RuntimeError, match="a communication hook is already registered; only one"):
        dp.register_comm_hook(world_of_one, allreduce_hook)
    late = dpcore.DataParallel(nn.Linear(3, 2), ["cpu"], process_group=world_of_one)
    late(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="must be called before the first backward that synchronizes"):
        late.register_comm_hook(world_of_one, allreduce_hook)


def test_a_hook_gets_ddps_bucket_interface(world_of_one: Any) -> None:
    """A hook sees one bucket per call, in send order (index 0 first, the
    last parameters; is_last on the last), with its parameters, its flat
    buffer and gradients() viewing it; a completed Future of the buffer
    (DDP's no-op hook) gives the result of no hook, float64, exactly, and
    a parameter no replica used keeps .grad None."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.unused = nn.Linear(6, 5), nn.Linear(5, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.tanh(self.fc1(x)))

    a = Model().double()
    b = copy.deepcopy(a)
    hybrid = dpcore.DataParallel(a, ["cpu"] * 3, process_group=world_of_one, bucket_bytes=64)
    plain = dpcore.DataParallel(b, ["cpu"] * 3)
    seen: list[tuple[int, bool, list[int], bool]] = []

    def noop(state: Any, bucket: Any) -> Any:
        assert state == "state"
        buffer = bucket.buffer()
        views = bucket.gradients()
        inside = all(
            buffer.data_ptr() <= v.data_ptr() < buffer.data_ptr() + buffer.numel() * buffer.element_size()
            and v.shape == p.shape
            for v, p in zip(views, bucket.parameters())
        )
        seen.append((bucket.index(), bucket.is_last(), [id(p) for p in bucket.parameters()], inside))
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    hybrid.register_comm_hook("state", noop)
    x = torch.randn(7, 6, dtype=torch.float64)
    for _ in range(2):
        seen.clear()
        hybrid(x).square().mean().backward()
        plain(x).square().mean().backward()
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14)
        assert a.unused.weight.grad is None
        assert [index for index, *_ in seen] == list(range(len(seen))) and len(seen) > 2
        assert [last for _, last, *_ in seen] == [False] * (len(seen) - 1) + [True]
        assert all(inside for *_, inside in seen)
        sent = [i for _, _, ids, _ in seen for i in ids]
        assert sorted(sent) == sorted(id(p) for p in a.parameters()) and id(a.unused.bias) in seen[0][2]


def test_a_hook_that_breaks_the_contract_is_a_clear_error(world_of_one: Any) -> None:
    """A hook returning no Future, or a Future of the wrong size: an error
    from backward naming the contract; the next backward starts clean."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    mode = {"now": "none"}

    def hook(state: Any, bucket: Any) -> Any:
        if mode["now"] == "none":
            return bucket.buffer()
        if mode["now"] == "short":
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(bucket.buffer()[:1])
            return future
        return allreduce_hook(state, bucket)

    model = nn.Linear(3, 2).double()
    dp = dpcore.DataParallel(model, ["cpu"] * 2, process_group=world_of_one)
    dp.register_comm_hook(world_of_one, hook)
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"the hook must return a torch.futures.Future .* but it returned Tensor"):
        dp(x).sum().backward()
    mode["now"] = "short"
    model.zero_grad()
    with pytest.raises(RuntimeError, match=r"must hold one tensor of the bucket's 8 elements .* 1 elements"):
        dp(x).sum().backward()
    mode["now"] = "fine"
    model.zero_grad()
    dp(x).sum().backward()
    expected = torch.autograd.grad(model(x).sum(), [model.weight])[0]
    torch.testing.assert_close(model.weight.grad, expected, rtol=0, atol=1e-14)
    from dpcore.distributed import GradBucket

    bucket = GradBucket(0, 1, torch.zeros(8), [model.weight, model.bias])
    with pytest.raises(ValueError, match=r"buffer: expected a 1-D tensor of 8 elements .* shape \(2, 4\)"):
        bucket.set_buffer(torch.zeros(2, 4))


def test_a_layout_change_with_a_hook_is_adopted(world_of_one: Any) -> None:
    """With bf16 compression registered, a parameter frozen and another
    replaced (the same on every rank) rebuild the buckets, still sent
    through the hook; float64 against a plain DataParallel within bf16's
    precision."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    b = copy.deepcopy(a)
    hybrid = dpcore.DataParallel(a, ["cpu"] * 2, process_group=world_of_one, bucket_bytes=64)
    plain = dpcore.DataParallel(b, ["cpu"] * 2)
    dtypes: list[torch.dtype] = []
    hooked: list[Any] = []  # the parameters of each bucket the hook got

    def hook(state: Any, bucket: Any) -> Any:
        future = bf16_compress_hook(state, bucket)
        dtypes.append(bucket.buffer().dtype)
        hooked.extend(bucket.parameters())
        return future

    hybrid.register_comm_hook(world_of_one, hook)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1:
            a[0].weight.requires_grad_(False)
            b[0].weight.requires_grad_(False)
        if step == 2:
            a[2].bias = nn.Parameter(torch.full((2,), 0.25, dtype=torch.float64))
            b[2].bias = nn.Parameter(torch.full((2,), 0.25, dtype=torch.float64))
        x = torch.randn(5 + step, 6, generator=generator, dtype=torch.float64)
        for model in (a, b):
            model.zero_grad(set_to_none=True)
        dtypes.clear()
        hybrid(x).square().mean().backward()
        plain(x).square().mean().backward()
        assert dtypes and all(d == torch.float64 for d in dtypes)
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=2.0**-7, atol=0)
    hooked.clear()
    hybrid(x).square().mean().backward()  # the buckets as rebuilt: the hook gets every trainable parameter
    assert sorted(map(id, hooked)) == sorted(id(p) for p in (a[0].bias, a[2].weight, a[2].bias))


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_one_process_group_adopts_a_change_and_joins(backend: str, collectives: list[tuple[str, int]]) -> None:
    """A one-process group on the CPU (gloo) or a GPU (NCCL, skipped
    without one), float64 against a plain DataParallel over 3 steps: a
    parameter frozen before step 1 and another replaced before step 2 (a
    change on every rank: adopted, exact), under dp.join() (nothing to
    shadow), and a no_grad forward in between."""
    if backend == "nccl" and not torch.cuda.is_available():
        pytest.skip("NCCL needs a GPU")
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        torch.manual_seed(0)
        a = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double().to(device)
        b = copy.deepcopy(a)
        devices = [device] * (1 if backend == "nccl" else 2)
        hybrid = dpcore.DataParallel(a, devices, process_group=dist.group.WORLD)
        plain = dpcore.DataParallel(b, devices)
        generator = torch.Generator().manual_seed(1)
        with hybrid.join():
            for step in range(3):
                if step == 1:
                    a[0].weight.requires_grad_(False)
                    b[0].weight.requires_grad_(False)
                if step == 2:
                    a[2].bias = nn.Parameter(torch.full((2,), 0.25, dtype=torch.float64, device=device))
                    b[2].bias = nn.Parameter(torch.full((2,), 0.25, dtype=torch.float64, device=device))
                x = torch.randn(5 + step, 6, generator=generator, dtype=torch.float64).to(device)
                for model in (a, b):
                    model.zero_grad(set_to_none=True)
                hybrid(x).square().mean().backward()
                plain(x).square().mean().backward()
                with torch.no_grad():
                    hybrid(x)
                for p, q in zip(a.parameters(), b.parameters()):
                    assert (p.grad is None) == (q.grad is None)
                    if p.grad is not None:
                        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-13)
        loss = hybrid(x).square().mean()
        collectives.clear()
        loss.backward()  # the change adopted: no agreement, one bucket of the 3 trainable parameters
        # fc0.bias, fc2.weight, the new fc2.bias: gradients, a flag each, the count, the counted flag, one mark
        assert collectives == [("all_reduce", 5 + 10 + 2 + 3 + 1 + 1 + 1)], collectives
        del hybrid
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", ["gloo", 0, object()])
def test_process_group_must_be_a_process_group(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"process_group: expected a torch.distributed.ProcessGroup"):
        dpcore.DataParallel(nn.Linear(2, 2), ["cpu"], process_group=bad)


def test_cannot_be_pickled_or_copied(world_of_one: Any) -> None:
    dp = dpcore.DataParallel(nn.Linear(2, 2), ["cpu"], process_group=world_of_one)
    for action in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            action(dp)
    copy.deepcopy(dp.module)  # the bare module copies, without the hooks' owner


def test_reentrant_backward_is_a_clear_error(world_of_one: Any) -> None:
    """A second graph task reaching the parameters while a synchronizing one
    is running (reentrant checkpointing) raises instead of reducing twice."""
    from torch.utils.checkpoint import checkpoint

    inner = nn.Linear(4, 4)
    head = nn.Linear(4, 1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.head = inner, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.inner, x, use_reentrant=True))

    dp = dpcore.DataParallel(Model(), ["cpu"], process_group=world_of_one)
    with pytest.raises(RuntimeError, match="reentrant backward"):
        dp(torch.randn(3, 4, requires_grad=True)).sum().backward()
    # The next forward starts clean.
    dp.module.inner = nn.Identity()  # structure change: rebuilt
    dp(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert head.weight.grad is not None


def _torchrun_demo(*args: str) -> str:
    """`torchrun --standalone --nproc-per-node 2 examples/digits.py --devices
    cpu:2 --epochs 1 --no-progress ARGS`; its output, after checking it
    exited 0 and its float64 agreement check passed once (rank 0 only)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    script = str(Path(TESTS_DIR).parent / "examples" / "digits.py")
    cmd += [script, "--devices", "cpu:2", "--epochs", "1", "--no-progress", *args]
    done = subprocess.run(cmd, env=loopback_env(), cwd=TESTS_DIR, capture_output=True, text=True, timeout=240)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert out.count("agreement check passed") == 1, out
    return out


def test_torchrun_demo_logs_from_rank_zero_only(tmp_path: Path) -> None:
    """The main job: `torchrun --standalone --nproc-per-node 2 examples/digits.py
    --devices cpu:2` (here shortened with --limit and one epoch)."""
    checkpoint = tmp_path / "digits.pt"
    out = _torchrun_demo("--limit", "300", "--checkpoint", str(checkpoint))
    assert "2 processes x 2 devices" in out
    assert len(re.findall(r"^epoch 1/1", out, flags=re.M)) == 1, out
    assert out.count("checkpoint written") == 1
    state = torch.load(checkpoint, weights_only=True)
    assert isinstance(state, dict) and any(k.endswith("weight") for k in state)


def test_torchrun_demo_with_sync_batchnorm_passes_its_float64_check() -> None:
    """`torchrun ... examples/digits.py --devices cpu:2 --sync-batchnorm`:
    BatchNorm synchronized across the 2 processes x 2 replicas, and the
    float64 check against one device on the global batch (running
    statistics included) passes."""
    out = _torchrun_demo("--limit", "200", "--sync-batchnorm")
    assert "with synchronized BatchNorm on 2 processes x 2 devices" in out, out


def test_bench_distributed_runs_hybrid_against_ddp() -> None:
    """bench/bench_distributed.py's two-process configuration with the
    fewest steps (the numbers are not checked): both rows, rank 0's."""
    from dpcore.bench import distributed as bench

    rows = bench._launch("ddp", 2, rounds=1, repeats=1)
    # Every model of bench_step but the synchronized-BatchNorm one (its DDP baseline needs CUDA).
    assert [r["model"] for r in rows] == [name for name, *_, sync_bn in bench._models(quick=False) if not sync_bn]
    for r in rows:
        assert (r["processes"], r["replicas"]) == (2, 1)
        assert r["ms"] > 0 and r["baseline_ms"] > 0 and r["ratio"] == pytest.approx(r["ms"] / r["baseline_ms"])
        assert r["cpu_ms"] > 0 and r["cpu_ratio"] == pytest.approx(r["cpu_ms"] / r["baseline_cpu_ms"])
        assert "DDP" in r["baseline"]


# -- the demo's torchrun helpers, in process -----------------------------------


def test_sampler_batches_share_each_global_batch_equally() -> None:
    from test_demo import demo  # examples/digits.py

    sampler_batches = demo.sampler_batches

    for world in (1, 2, 3):
        epoch = sampler_batches(100, 12, seed=0, epoch=1, world=world)
        shares = [index.tensor_split(world) for index in epoch]
        assert all(len({len(s) for s in parts}) == 1 for parts in shares)  # equal shares in every batch
        assert len(shares[0][0]) == 12 // world
        seen = torch.cat(epoch)
        assert len(seen) == world * -(-100 // world)  # DistributedSampler pads to a multiple of world
        assert set(seen.tolist()) == set(range(100))
    assert not torch.equal(torch.cat(sampler_batches(100, 12, 0, 0, 2)), torch.cat(sampler_batches(100, 12, 0, 1, 2)))


def test_demo_under_torchrun_checks_batch_size_and_devices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_demo import demo  # examples/digits.py

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exc:
        demo.main(["--devices", "cpu:2", "--batch-size", "64"])
    assert exc.value.code == 2
    assert "--batch-size: expected a multiple of the 3 processes, but got 64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # per-replica statistics: nothing for the check to compare
        demo.main(["--devices", "cpu:2", "--batch-size", "63", "--batchnorm"])
    assert exc.value.code == 2
    assert "--batchnorm: not available under torchrun without --sync-batchnorm" in capsys.readouterr().err
    assert demo._local_devices([torch.device("cpu")] * 2, 1) == [torch.device("cpu")] * 2
    if torch.cuda.device_count() < 4:
        with pytest.raises(ValueError, match=r"--devices: local rank 1 would use CUDA devices \[2, 3\]"):
            demo._local_devices([torch.device("cuda", 0), torch.device("cuda", 1)], 1)
