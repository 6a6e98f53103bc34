"""The short soak (bench/soak.py --steps 500) in a child process: thread
count constant and RSS growth under 16 MiB after warm-up, over 500
DataParallel training steps on ["cpu"] * 4."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from child_process import run_child
from dpcore.bench import soak

SOAK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "soak.py")


def test_short_soak_shows_no_growth(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    result = run_child([SOAK, "--steps", "500", "--devices", "cpu:4", "--json", str(out)])
    assert result.returncode == 0, f"soak failed:\n{result.stdout}\n{result.stderr}"
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["ok"] and summary["problems"] == []
    assert summary["steps"] == 500 and summary["warmup_steps"] == 100
    warm = [row for row in report["rows"] if row["step"] >= summary["warmup_steps"]]
    assert len(warm) >= 10
    assert {row["os_threads"] for row in warm} == {summary["os_threads_warm"]}
    assert {row["python_threads"] for row in warm} == {warm[0]["python_threads"]}
    assert summary["rss_growth_after_warmup_mib"] < 16.0
    assert summary["ms_per_step"] > 0 and math.isfinite(summary["final_loss"])
    # The summary is printed as JSON too (the last object on stdout).
    printed = json.loads(result.stdout[result.stdout.rindex("\n{") :])
    assert printed == summary


@pytest.mark.parametrize("argv", [["--steps", "3"], ["--steps", "many"]])
def test_soak_rejects_bad_steps(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Rejected by the parser, before any step runs (so in-process is fine).
    with pytest.raises(SystemExit) as exc:
        soak.main(argv)
    assert exc.value.code == 2
    assert "--steps" in capsys.readouterr().err.strip().splitlines()[-1]
