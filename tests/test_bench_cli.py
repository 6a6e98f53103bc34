"""Tests for ``python -m dpcore.bench`` (dpcore/bench/__main__.py) and the
payload-size sweep of dpcore/bench/comm.py.

The plot needs matplotlib (``pip install 'dpcore[demo]'``); the test
environment installs it, so nothing here skips for want of it. The full
run uses ``--quick`` plus the hidden ``--smoke`` option (one repeat, two
small sweep sizes, no minimum measuring time) to finish in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpcore.bench import __main__ as bench_cli
from dpcore.bench import comm as bench_comm
from conftest import TESTS_DIR, subprocess_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SWEEP_OPS = {"copy_", "broadcast_coalesced", "reduce_add_coalesced", "scatter (out=)", "gather"}


def test_quick_run_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"  # created by main()
    result = bench_cli.main(["--quick", "--smoke", "--out", str(out)])

    assert sorted(p.name for p in out.iterdir()) == ["comm.json", "comm_bandwidth.png", "step.json"]
    assert sorted(Path(f).name for f in result["files"]) == ["comm.json", "comm_bandwidth.png", "step.json"]

    comm = json.loads((out / "comm.json").read_text())
    assert comm["benchmark"] == "comm" and comm["env"]["torch"] == torch.__version__
    ops = {row["op"] for row in comm["rows"]}
    assert ops == SWEEP_OPS - {"copy_"}
    assert all(row["gbps"] > 0 and row["copy_gbps"] > 0 for row in comm["rows"])
    sweep = comm["sweep"]
    assert sweep["sizes_bytes"] == [256 * 1024, 1024 * 1024]
    for size in sweep["sizes_bytes"]:
        rows = [r for r in sweep["rows"] if r["payload_bytes"] == size]
        assert {r["op"] for r in rows} == SWEEP_OPS
        assert all(r["gbps"] > 0 and r["ms"] > 0 for r in rows)
        copy = next(r for r in rows if r["op"] == "copy_")
        assert copy["traffic_bytes"] == 2 * size and copy["ratio_to_copy"] == pytest.approx(1.0)

    step = json.loads((out / "step.json").read_text())
    assert step["benchmark"] == "step" and len(step["rows"]) == 3
    assert all(row["dpcore_ms"] > 0 and row["ratio"] > 0 for row in step["rows"])
    synced = [row for row in step["rows"] if row["sync_ratio"] is not None]
    assert [row["model"] for row in synced] == ["small CNN + BatchNorm, batch 32, sync"]
    assert synced[0]["unsynced_ms"] > 0 and synced[0]["sync_ratio"] > 0
    assert result["comm"] == comm and result["step"] == step

    png = (out / "comm_bandwidth.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    printed = capsys.readouterr().out
    for marker in ("[1/3]", "[2/3]", "[3/3]", "x copy_", "K x 1/K plain ms", "x unsynced", "256 KiB", "wrote"):
        assert marker in printed


def test_sweep_on_one_device_has_no_broadcast() -> None:
    result = bench_comm.sweep([torch.device("cpu")], [64 * 1024], repeats=1, min_seconds=0.0)
    assert result["sizes_bytes"] == [64 * 1024]
    assert {r["op"] for r in result["rows"]} == SWEEP_OPS - {"broadcast_coalesced"}
    reduce = next(r for r in result["rows"] if r["op"] == "reduce_add_coalesced")
    assert reduce["traffic_bytes"] == 2 * 64 * 1024 and reduce["payload"] == "64 KiB"


def test_sweep_rejects_sizes_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError, match="multiples of 4 bytes"):
        bench_comm.sweep([torch.device("cpu")] * 2, [1024], repeats=1)


def test_plot_from_synthetic_rows(tmp_path: Path) -> None:
    rows = [
        {"op": op, "payload_bytes": size, "gbps": gbps}
        for size in (256 * 1024, 4 * 1024 * 1024)
        for op, gbps in (("copy_", 10.0), ("gather", 4.0), ("scatter (out=)", 5.0))
    ]
    path = bench_cli.plot_sweep({"rows": rows}, "synthetic", tmp_path / "sub" / "plot.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("256K,1M,64M", [256 * 1024, 1024**2, 64 * 1024**2]),
        ("16KiB, 2MiB", [16 * 1024, 2 * 1024**2]),
        ("1g", [1024**3]),
        ("65536", [65536]),
    ],
)
def test_parse_sizes(spec: str, expected: list[int]) -> None:
    assert bench_cli.parse_sizes(spec) == expected


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--sizes", "1T"], "--sizes"),
        (["--sizes", "256K,,1M"], "--sizes"),
        (["--sizes", "8K"], "--sizes"),
        (["--repeats", "0"], "--repeats"),
        (["--devices", "cpu:0"], "--devices"),
        (["--devices", "99"], "--devices"),
    ],
)
def test_bad_options_exit_2_naming_the_option(
    argv: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_cli.main([*argv, "--out", str(tmp_path / "never")])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m dpcore.bench: error:") and option in last
    assert not (tmp_path / "never").exists()


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(SystemExit) as exc:
        bench_cli.main(["--quick", "--smoke", "--out", str(tmp_path / "never")])
    message = str(exc.value.code)
    assert "pip install 'dpcore[demo]'" in message and "matplotlib" in message
    assert not (tmp_path / "never").exists()


def test_bench_modules_make_torch_cuda_comm_available() -> None:
    # torch.cuda.comm (the CUDA baselines) is no attribute of torch.cuda until
    # it is imported; a fresh interpreter shows whether the bench modules do.
    code = (
        "import torch, dpcore.bench.comm, dpcore.bench.kernels; "
        "print(torch.cuda.comm.scatter.__name__, torch.cuda.comm.gather.__name__)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=TESTS_DIR, env=subprocess_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["scatter", "gather"]
