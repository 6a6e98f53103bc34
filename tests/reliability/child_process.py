"""Running a child Python for the reliability tests: the dpcore under test,
a crash (signal) or a hang reported as a test failure with its output."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from conftest import TESTS_DIR, subprocess_env

TIMEOUT_S = 180  # generous: the machine is shared; a hang is a failure too


def run_child(args: list[str], timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Runs ``python *args`` (cwd tests/, dpcore under test first on the
    path). A child killed by a signal, or still running after `timeout_s`,
    fails the calling test with the child's output; otherwise the completed
    process is returned for the caller's checks."""
    try:
        result = subprocess.run(
            [sys.executable, *args],
            cwd=TESTS_DIR,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(
            f"{args}: no result after {timeout_s} s (a hang or deadlock); output:\n{timeout.stdout}\n{timeout.stderr}"
        )
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name
        pytest.fail(f"{args}: the child crashed ({name}); output:\n{result.stdout}\n{result.stderr}")
    return result
