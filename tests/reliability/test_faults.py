"""Fault injection into DataParallel and the worker pool, each scenario in a
child process (see fault_scenarios.py) so that a crash is a test failure
with the child's output, not the end of the test run: exceptions in one
replica's forward (custom exception attributes preserved), in an ATen op,
in the criterion, in backward, KeyboardInterrupt in a replica, and
DataParallel nested three deep; after each, the pool must be usable.
"""

from __future__ import annotations

import os

import pytest

import fault_scenarios
from child_process import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fault_scenarios.py")
SCENARIOS = [
    "forward_exception",
    "torch_error_in_replica",
    "criterion_exception",
    "backward_exception",
    "keyboard_interrupt",
    "nested_three_deep",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault_scenario_in_child_process(scenario: str) -> None:
    result = run_child([SCRIPT, scenario])
    assert result.returncode == 0, f"{scenario} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip().splitlines()[-1] == f"ok {scenario}"


def test_every_scenario_is_listed() -> None:
    # The parametrization above must not miss a scenario added to the script.
    assert sorted(fault_scenarios.SCENARIOS) == sorted(SCENARIOS)


def test_a_crashing_child_is_reported_as_a_crash() -> None:
    # The harness itself: a child killed by a signal fails with its name.
    with pytest.raises(pytest.fail.Exception, match="crashed \\(SIGABRT\\)"):
        run_child(["-c", "import os; os.abort()"])
