"""Reliability: one DataParallel (and the replica state under it) called from
several threads at once, and Ctrl-C while replicas run.

The crash-prone scenarios live in concurrency_child.py and each runs in a
child process, so that a segmentation fault or abort fails its test instead
of ending the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import dpcore
from conftest import TESTS_DIR, subprocess_env

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "concurrency_child.py")

#: Ctrl-C must reach the caller within a second: measured on wall time.
pytestmark = pytest.mark.serial


def _run_child(scenario: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, CHILD, scenario],
        cwd=TESTS_DIR,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _describe(result: subprocess.CompletedProcess[str]) -> str:
    status = result.returncode
    if status < 0:
        status_text = f"killed by signal {-status} ({signal.Signals(-status).name})"
    else:
        status_text = f"exit status {status}"
    return f"{status_text}; stdout: {result.stdout[-800:]!r}; stderr tail: {result.stderr[-2500:]}"


def _expect_ok(scenario: str) -> str:
    result = _run_child(scenario)
    assert result.returncode == 0 and f"ok {scenario}" in result.stdout, _describe(result)
    return result.stdout


# ---------------------------------------------------------------------------
# Several threads, one wrapper
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["forward", "backward", "grad", "no_grad", "inference", "mixed"])
def test_threads_share_one_data_parallel(scenario: str) -> None:
    # 6 threads x 80 calls (mixed: 8 x 60, thread t in the t % 5-th mode) on
    # ["cpu"] * 4; every output (and gradient) equals the single-device one;
    # after concurrent backward passes the master's .grad is the sum of all.
    _expect_ok(scenario)


def test_threads_with_a_replica_raising_every_third_call() -> None:
    _expect_ok("raising")


def test_threads_call_a_nested_data_parallel() -> None:
    _expect_ok("nested")


def test_threads_share_a_replica_cache() -> None:
    _expect_ok("replica_cache")


def test_threads_refresh_one_bucket_in_cpp() -> None:
    _expect_ok("bucket_refresh")


# ---------------------------------------------------------------------------
# Saved replica parameters across calls (in process: no crash involved)
# ---------------------------------------------------------------------------


def test_graph_of_an_earlier_call_refuses_parameters_refreshed_since() -> None:
    # Calls A and B share the replicas' buffers; the master changes, C's
    # refresh writes the new values. The replica copies A's graph saved (two
    # calls ago) must be marked modified, so that A's backward raises rather
    # than silently using the new values.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    dp = dpcore.DataParallel(module, ["cpu"] * 2)
    x = torch.randn(4, 4, dtype=torch.float64)
    a = dp(x).sum()
    copies_a = list(dp._cache.replica_modules[0][0].parameters())  # replica 1's parameters in call A
    versions_a = [t._version for t in copies_a]
    b = dp(x).sum()
    b.backward()  # nothing changed between A and B: B is fine
    assert [t._version for t in copies_a] == versions_a
    with torch.no_grad():
        module[2].weight.add_(1.0)
    dp(x)
    changed = [t._version > v for t, v in zip(copies_a, versions_a)]
    assert changed == [False, False, True, False], changed  # only module[2].weight changed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        a.backward()


def test_unchanged_entries_stay_valid_when_a_bucket_is_recopied() -> None:
    # A refresh that copies because one master tensor changed marks only that
    # entry: a graph that saved another entry of the same bucket still works.
    p = nn.Parameter(torch.randn(3, dtype=torch.float64))
    q = nn.Parameter(torch.randn(3, dtype=torch.float64))
    bucket = dpcore._C.ReplicaBuffers([p, q], [torch.device("cpu")])
    p1, q1 = bucket.refresh([p.detach(), q.detach()])
    versions = (p1._version, q1._version)
    with torch.no_grad():
        p.add_(1.0)
    p2, q2 = bucket.refresh([p.detach(), q.detach()])
    assert bucket.last_refresh_copied
    assert p1._version > versions[0] and p1._version == p2._version  # one counter per entry
    assert q1._version == versions[1] and q2._version == q1._version
    torch.testing.assert_close(p2, p.detach())
    bucket.refresh([p.detach(), q.detach()])
    assert not bucket.last_refresh_copied  # nothing changed since


def test_wrapper_survives_pickling_and_copies_with_its_own_lock() -> None:
    import copy
    import pickle

    module = nn.Linear(3, 2).double()
    dp = dpcore.DataParallel(module, ["cpu"] * 2)
    x = torch.randn(4, 3, dtype=torch.float64)
    expected = dp(x)
    for other in (pickle.loads(pickle.dumps(dp)), copy.deepcopy(dp)):
        assert other._calls is not dp._calls
        torch.testing.assert_close(other(x), expected)


# ---------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------


def test_ctrl_c_reaches_a_data_parallel_caller_promptly() -> None:
    # SIGINT 0.2 s into a call whose replicas nap 2 s (two run at once):
    # KeyboardInterrupt within 1 s, not after 4 s; the running replicas are
    # interrupted and have returned by then, those not started are skipped;
    # the next call is correct.
    _expect_ok("interrupt_data_parallel")


def test_ctrl_c_reaches_a_parallel_apply_caller_promptly() -> None:
    _expect_ok("interrupt_parallel_apply")


def test_a_second_ctrl_c_ends_the_wait_for_interrupted_replicas() -> None:
    _expect_ok("interrupt_twice")


def test_ctrl_c_leaves_the_users_module_alone() -> None:
    # A notebook's Ctrl-C: the module's state right after the exception is
    # its state later; latency about that of the bare module; training
    # resumed from its state_dict equals one device.
    _expect_ok("interrupt_leaves_module_alone")


def test_uncaught_ctrl_c_exits_cleanly_after_running_replicas_finish() -> None:
    started = time.perf_counter()
    result = _run_child("interrupt_at_exit")
    elapsed = time.perf_counter() - started
    # Python ends a process whose KeyboardInterrupt was not caught by killing
    # itself with SIGINT; a crash at exit would be SIGABRT or SIGSEGV.
    assert result.returncode == -signal.SIGINT, _describe(result)
    assert "KeyboardInterrupt" in result.stderr, _describe(result)
    # The two replicas that had started were interrupted before the
    # interpreter went away; the two not started never ran.
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("replica "))
    assert lines == ["replica 0 interrupted", "replica 1 interrupted"], _describe(result)
    assert elapsed < 60, elapsed
