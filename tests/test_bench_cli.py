"""Tests for ``python -m dpcore.bench`` (dpcore/bench/__main__.py) and the
payload-size sweep of dpcore/bench/comm.py.

The plot needs matplotlib (the demo extras); the test environment installs
it, so nothing here skips for want of it, and a test hides it to check the
run without it. The full
run uses ``--quick`` plus the hidden ``--smoke`` option (one repeat, two
small sweep sizes, no minimum measuring time) to finish in seconds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dpcore.bench import __main__ as bench_cli
from dpcore.bench import comm as bench_comm
from dpcore.bench import step as bench_step
from dpcore.bench import targets as bench_targets
from conftest import TESTS_DIR, subprocess_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SWEEP_OPS = {"copy_", "broadcast_coalesced", "reduce_add_coalesced", "scatter (out=)", "gather"}


def test_quick_run_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"  # created by main()
    result = bench_cli.main(["--quick", "--smoke", "--out", str(out)])

    assert sorted(p.name for p in out.iterdir()) == ["comm.json", "comm_bandwidth.png", "step.json"]
    assert sorted(Path(f).name for f in result["files"]) == ["comm.json", "comm_bandwidth.png", "step.json"]
    assert result["notes"] == []

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
    assert step["benchmark"] == "step"
    assert [row["model"] for row in step["rows"]] == [
        *(name for name, *_ in bench_step.models(True, False, 4)),
        "MLP 4x64 compiled (eager), batch 32",
        "MLP 50x64 + Dropout, batch 32, random streams",  # the default lists share a generator
    ]
    assert [row["model"] for row in step["rows"]][3:-2] == [
        "MLP 50x128, batch 32",
        "resnet18-style (width / 8), batch 8 x 3 x 16 x 16",
        "resnet50-style (width / 8), batch 8 x 3 x 16 x 16",
    ]
    assert all(row["dpcore_ms"] > 0 and row["ratio"] > 0 for row in step["rows"])
    compiled = step["rows"][-2]  # DataParallel(torch.compile(model)) against the compiled model on one device
    assert compiled["compiled"] == "eager" and compiled["plain_full_batch_ms"] > 0
    assert compiled["eager_dpcore_ms"] > 0 and compiled["compile_s"] > 0
    assert compiled["ratio"] == pytest.approx(compiled["dpcore_ms"] / compiled["sequential_split_ms"])
    if step["devices"][0] == "cpu":  # no graphed rows, and the JSON says why
        assert step["cuda_graphs"] == {
            "choice": "auto",
            "measured": False,
            "note": bench_step.CUDA_ONLY,
            "warmup_calls": None,
        }
        assert step["cuda_graphs"]["note"] == "cuda_graphs: CUDA lists only"
        assert all(row["graphed_ms"] is None and row["torch_dp_vs_graphed"] is None for row in step["rows"])
        assert step["targets"] == []
    else:
        assert step["cuda_graphs"]["measured"] is True
        assert all(row["graphed_ms"] > 0 and row["graphed_vs_plain"] > 0 for row in step["rows"][:-2])
        assert compiled["graphed_ms"] is None  # cuda_graphs=True does not capture compiled modules
    synced = [row for row in step["rows"] if row["sync_ratio"] is not None]
    assert [row["model"] for row in synced] == ["small CNN + BatchNorm, batch 32, sync"]
    assert synced[0]["unsynced_ms"] > 0 and synced[0]["sync_ratio"] > 0
    streams = step["rows"][-1]  # the random streams against DPCORE_REPLICA_RNG=0, same wrapper
    assert streams["streams_off_ms"] > 0 and streams["streams_ratio"] == pytest.approx(
        streams["dpcore_ms"] / streams["streams_off_ms"]
    )
    assert [row["model"] for row in step["rows"] if row["streams_ratio"] is not None] == [streams["model"]]
    assert result["comm"] == comm and result["step"] == step

    png = (out / "comm_bandwidth.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    printed = capsys.readouterr().out
    for marker in (
        "[1/3]",
        "[2/3]",
        "[3/3]",
        "x copy_",
        "K x 1/K plain ms",
        "x unsynced",
        "x streams off",
        "256 KiB",
        "wrote",
        "graphed ms",
        "graphed x plain",
        "torch DP / graphed",
    ):
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


def test_without_matplotlib_writes_json_and_tables_and_skips_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    # The collectives and the step benchmark stand in for themselves with no
    # rows (the full run is test_quick_run_writes_json_and_plot's); the sweep,
    # whose plot is skipped, runs for real at one small size.
    monkeypatch.setattr(
        bench_cli.bench_comm, "run", lambda devices, quick, repeats: {"rows": [], "env": {"build": "cpu"}}
    )
    monkeypatch.setattr(
        bench_cli.bench_step, "run", lambda devices, quick, repeats, min_seconds, compiled=None: {"rows": []}
    )
    out = tmp_path / "results"
    result = bench_cli.main(["--smoke", "--devices", "cpu:2", "--sizes", "16K", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["comm.json", "step.json"]
    assert sorted(Path(f).name for f in result["files"]) == ["comm.json", "step.json"]
    assert json.loads((out / "comm.json").read_text())["sweep"]["rows"]
    assert result["notes"] == [bench_cli.NO_PLOT_NOTE]
    assert bench_cli.NO_PLOT_NOTE == (
        "comm_bandwidth.png skipped: matplotlib is not installed (pip install matplotlib, or in the dpcore "
        'source folder pip install --no-build-isolation ".[demo]")'
    )
    printed = capsys.readouterr().out
    assert printed.count(f"note: {bench_cli.NO_PLOT_NOTE}") == 2  # at the start and after the tables
    assert "comm sweep" in printed and "x copy_" in printed


def test_bench_modules_make_torch_cuda_comm_available() -> None:
    # torch.cuda.comm (the CUDA baselines) is no attribute of torch.cuda until
    # it is imported; a fresh interpreter shows whether the bench modules do.
    code = (
        "import torch, dpcore.bench.comm, dpcore.bench.kernels; "
        "print(torch.cuda.comm.scatter.__name__, torch.cuda.comm.gather.__name__)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=TESTS_DIR,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["scatter", "gather"]


# -- bench_step: the model list, --cuda-graphs and the graphed rows ----------


def test_step_models_full_size() -> None:
    """On a CUDA list without --quick: the full batches and images, and
    ResNets of the published sizes (torchvision's parameter counts with a
    100-class head); built, not run."""
    specs = {
        name: (factory, shape, batch, sync) for name, factory, shape, batch, sync in bench_step.models(False, True, 4)
    }
    assert list(specs)[3:] == [
        "MLP 50x1024, batch 512",
        "resnet18-style, batch 256 x 3 x 64 x 64",
        "resnet50-style, batch 128 x 3 x 128 x 128",
    ]
    assert specs["MLP 50x1024, batch 512"][1:] == ((1024,), 512, False)
    assert specs["resnet18-style, batch 256 x 3 x 64 x 64"][1:] == ((3, 64, 64), 256, False)
    assert specs["resnet50-style, batch 128 x 3 x 128 x 128"][1:] == ((3, 128, 128), 128, False)
    counts = [sum(p.numel() for p in specs[name][0]().parameters()) for name in list(specs)[3:]]
    assert counts == [50 * (1024 * 1024 + 1024), 11_227_812, 23_712_932]
    # The first rows are those bench_distributed runs too.
    assert [s[0] for s in bench_step.models(False, True, 4)[:3]] == [s[0] for s in bench_step._models(False)]


@pytest.mark.parametrize("replicas", [4, 6])
def test_step_models_small_sizes_keep_two_samples_per_replica(replicas: int) -> None:
    """CPU lists: full-width ResNets on 32 x 32 images, at least 2 samples per
    replica (BatchNorm's 1 x 1 last stage); their forward and backward run on
    each replica's chunk in training mode."""
    rows = bench_step.models(False, False, replicas)
    assert rows[3][0] == "MLP 50x1024, batch 32"
    batch = max(8, 2 * replicas)
    for name, factory, shape, size, sync in rows[4:]:
        assert size == batch and shape == (3, 32, 32) and not sync
        assert name.endswith(f"batch {batch} x 3 x 32 x 32")
    torch.manual_seed(0)
    for _, factory, shape, size, _ in bench_step.models(True, False, replicas)[4:]:
        model = factory()
        chunk = torch.randn(size // replicas, *shape)
        out = model(chunk)
        assert out.shape == (size // replicas, 100)
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("auto", bench_step.CUDA_ONLY), ("off", "cuda_graphs: not measured (--cuda-graphs off)")],
)
def test_graphs_note_on_a_cpu_list(choice: str, expected: str) -> None:
    assert bench_step.graphs_note([torch.device("cpu")] * 2, choice) == expected


def test_graphs_note_refuses_on_with_a_cpu_list_and_unknown_choices() -> None:
    with pytest.raises(
        ValueError, match=r"--cuda-graphs on needs a CUDA device list, but --devices is \['cpu', 'cpu'\]"
    ):
        bench_step.graphs_note([torch.device("cpu")] * 2, "on")
    with pytest.raises(ValueError, match="--cuda-graphs: expected one of auto, on, off, but got 'yes'"):
        bench_step.graphs_note([torch.device("cpu")], "yes")


@pytest.mark.parametrize(
    ("argv", "option", "detail"),
    [
        (["--devices", "cpu:2", "--cuda-graphs", "on"], "--cuda-graphs", "cpu"),
        (["--devices", "cpu:2", "--cuda-graphs", "always"], "--cuda-graphs", "invalid choice"),
        (["--devices", "cpu:2", "--min-seconds", "-1"], "--min-seconds", "-1.0"),
        (["--devices", "cpu:2", "--min-seconds", "nan"], "--min-seconds", "nan"),
        (["--devices", "cpu:2", "--compiled", "nonesuch"], "--compiled", "nonesuch"),
    ],
)
def test_step_bad_options_exit_2_before_measuring(
    argv: list[str], option: str, detail: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_step.main([*argv, "--json", str(tmp_path / "never.json")])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("bench_step: error:") and option in last and detail in last
    assert out == "" and not (tmp_path / "never.json").exists()


class _RecordingDataParallel(torch.nn.Module):
    """Stands in for dpcore.DataParallel where CUDA graphs cannot run: records
    the cuda_graphs argument and the calls, warns in its first two calls
    as a fallback to eager might (the same two-line warning), and runs the
    module itself."""

    made: list[_RecordingDataParallel] = []

    def __init__(self, module: torch.nn.Module, device_ids: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.cuda_graphs = kwargs.pop("cuda_graphs", False)
        self.calls = 0
        _RecordingDataParallel.made.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= 2:
            warnings.warn("cuda_graphs: capture failed, running eagerly\nsecond line")
        return self.module(x)


def test_graphed_step_warms_up_and_records_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    _RecordingDataParallel.made = []
    monkeypatch.setattr(bench_step.dpcore, "DataParallel", _RecordingDataParallel)
    torch.manual_seed(0)
    model = bench_step.mlp(2, 8)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step, caught = bench_step._graphed_step(model, [torch.device("cpu")] * 2, opt, x, y)
    (wrapper,) = _RecordingDataParallel.made
    assert wrapper.cuda_graphs is True and wrapper.module is model
    assert wrapper.calls == bench_step.GRAPH_WARMUP >= 5
    assert caught == ["cuda_graphs: capture failed, running eagerly"]  # first lines, once each
    step()
    assert wrapper.calls == bench_step.GRAPH_WARMUP + 1


def test_graphed_rows_and_their_ratios(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The graphed columns, as a CUDA list fills them (here on a CPU list,
    with the graphed wrapper stood in for): each ratio is the row's own
    figures, measured in the run; the sync-BatchNorm row's graphed wrapper
    has per-replica statistics and says so."""
    _RecordingDataParallel.made = []
    real = bench_step.dpcore.DataParallel

    def make(module: torch.nn.Module, device_ids: Any = None, **kwargs: Any) -> torch.nn.Module:
        if kwargs.get("cuda_graphs"):
            assert not kwargs.get("sync_batchnorm")
            return _RecordingDataParallel(module, device_ids, **kwargs)
        return real(module, device_ids=device_ids, **kwargs)

    monkeypatch.setattr(bench_step.dpcore, "DataParallel", make)
    monkeypatch.setattr(bench_step, "graphs_note", lambda devices, choice: None)
    picked = [  # tiny models: the columns are under test, not the timings
        ("tiny MLP", lambda: bench_step.mlp(2, 8), (8,), 4, False),
        (
            "tiny BatchNorm, sync",
            lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)),
            (8,),
            4,
            True,
        ),
    ]
    monkeypatch.setattr(bench_step, "models", lambda quick, full_size, replicas: picked)
    result = bench_step.run([torch.device("cpu")] * 2, quick=True, repeats=1, min_seconds=0.0, compiled="off")
    assert result["cuda_graphs"] == {
        "choice": "auto",
        "measured": True,
        "note": None,
        "warmup_calls": bench_step.GRAPH_WARMUP,
    }
    assert len(_RecordingDataParallel.made) == 2
    # The warm-up calls, then measure()'s own warm-up call (quick, not an
    # overhead model: the short protocol) and at least one timed call.
    assert all(w.cuda_graphs and w.calls >= bench_step.GRAPH_WARMUP + 2 for w in _RecordingDataParallel.made)
    plain, synced, streams = result["rows"]  # the last: the random-streams row of a CPU list
    assert streams["model"].endswith("random streams")
    for row in (plain, synced):
        assert row["graphed_ms"] > 0
        assert row["graphed_vs_plain"] == pytest.approx(row["graphed_ms"] / row["plain_full_batch_ms"])
        assert row["torch_dp_vs_graphed"] is None  # torch.nn.DataParallel runs on CUDA lists only
        assert row["graphed_warnings"] == ["cuda_graphs: capture failed, running eagerly"]
    assert plain["graphed_note"] is None and plain["graphed_error"] is None
    assert "per-replica BatchNorm" in synced["graphed_note"]


def test_a_failing_graphed_wrapper_is_recorded_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A RuntimeError of the cuda_graphs=True wrapper: the row records it,
    the other rows still run, the JSON is written, and the command exits 1
    naming the models."""
    real = bench_step.dpcore.DataParallel

    class Failing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    def make(module: torch.nn.Module, device_ids: Any = None, **kwargs: Any) -> torch.nn.Module:
        return Failing() if kwargs.pop("cuda_graphs", False) else real(module, device_ids=device_ids, **kwargs)

    monkeypatch.setattr(bench_step.dpcore, "DataParallel", make)
    monkeypatch.setattr(bench_step, "graphs_note", lambda devices, choice: None)
    tiny = [(f"tiny MLP {i}", lambda: bench_step.mlp(2, 8), (8,), 4, False) for i in (1, 2)]
    monkeypatch.setattr(bench_step, "models", lambda quick, full_size, replicas: tiny)
    out = tmp_path / "step.json"
    with pytest.raises(SystemExit) as exc:
        bench_step.main(
            [
                "--devices",
                "cpu:2",
                "--quick",
                "--repeats",
                "1",
                "--min-seconds",
                "0",
                "--compiled",
                "off",
                "--json",
                str(out),
            ]
        )
    assert (
        exc.value.code == "bench_step: cuda_graphs=True failed on tiny MLP 1; tiny MLP 2 (graphed_error in the results)"
    )
    rows = json.loads(out.read_text())["rows"]
    assert rows[-1]["model"].endswith("random streams")  # a CPU list's last row: not graphed
    rows = rows[:-1]
    assert [r["graphed_error"] for r in rows] == [
        "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    ] * 2
    assert all(r["graphed_ms"] is None and r["dpcore_ms"] > 0 for r in rows)
    assert "cuda_graphs=True FAILED" in capsys.readouterr().out


def test_check_targets_reports_met_and_missed() -> None:
    rows = [
        {"model": "resnet18-style, batch 256 x 3 x 64 x 64", "graphed_vs_plain": 1.6, "torch_dp_vs_graphed": 4.0},
        {"model": "MLP 50x64, batch 32", "graphed_vs_plain": 0.9, "torch_dp_vs_graphed": None},
        {"model": "small CNN, batch 32", "graphed_vs_plain": 0.9, "torch_dp_vs_graphed": 3.9},
    ]
    checked = bench_step.check_targets(rows)
    assert [(t["model"].split(",")[0], t["column"], t["met"]) for t in checked] == [
        ("resnet18-style", "graphed_vs_plain", False),  # 1.6 > 1.5
        ("resnet18-style", "torch_dp_vs_graphed", True),  # 4.0 >= 4: the bound itself is met
        ("small CNN", "torch_dp_vs_graphed", False),
    ]
    assert checked[0]["value"] == 1.6 and checked[0]["op"] == "<=" and checked[0]["bound"] == 1.5
    assert bench_step.check_targets([]) == []


def test_profile_times_every_stage_of_the_current_tree() -> None:
    """bench_profile finds every stage it names in this tree (a renamed
    pipeline function must be renamed there too) and reports them per step."""
    from dpcore.bench import profile as bench_profile

    result = bench_profile.run([], quick=True, repeats=1)
    assert [row["setup"] for row in result["rows"]] == list(bench_profile.SETUPS)
    for row in result["rows"]:
        assert row["absent"] == [], row["setup"]
        assert row["plain_us"] > 0 and row["step_us"] > 0 and row["own_us"] > 0
        assert row["stages_us"]["scatter"] > 0 and row["stages_us"]["combine"] > 0
        hybrid = row["setup"].startswith("hybrid")
        assert (row["stages_us"]["allreduce"] > 0) == hybrid and (row["stages_us"]["launch"] > 0) == (not hybrid)


def test_instructions_child_and_count_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_instructions' child runs each kind's steps (here without valgrind), the
    count is read from callgrind's summary line, and the rows are the
    differences per step, own cost against the plain step's."""
    from dpcore.bench import instructions

    for kind in instructions.KINDS:
        instructions.steps_in_child(instructions.HYBRID[0], kind, 1)
    assert instructions.collected("==12== Events    : Ir\n==12== Collected : 9918584359\n") == 9918584359
    with pytest.raises(RuntimeError, match="no instruction count"):
        instructions.collected("valgrind: not found")
    fake = {"plain": (100, 300), "ddp": (150, 450), "dpcore": (120, 400)}  # (warm-up alone, + 10 steps)
    monkeypatch.setattr(instructions.shutil, "which", lambda name: "/usr/bin/valgrind")
    monkeypatch.setattr(instructions, "_count", lambda setup, kind, steps: fake[kind][steps > 0])
    result = instructions.run([], quick=True, repeats=10)
    (row,) = result["rows"]
    assert (row["plain"], row["ddp"], row["dpcore"]) == (20, 30, 28)
    assert (row["ddp_own"], row["dpcore_own"], row["ratio"]) == (10, 8, 0.8)


def test_targets_quick_run_reports_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench_targets with the fewest steps (the figures are not checked):
    every row of the issue's table, in order, each with positive finite
    times and ratios, a spread that holds its median, the target and the
    load around it; the JSON written is the result."""
    out = tmp_path / "targets.json"
    result = bench_targets.main(["--quick", "--repeats", "1", "--rounds", "3", "--json", str(out)])

    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "targets" and (result["rounds"], result["repeats"]) == (3, 1)
    env = result["env"]
    assert env["torch"] == torch.__version__ and env["cpus"] > 0 and "commit" in env
    assert [row["row"] for row in result["rows"]] == list(bench_targets.ROWS)
    for row in result["rows"]:
        figures = [row[k] for k in ("dpcore_ms", "baseline_ms", "ratio", "ratio_median", "ratio_min", "ratio_max")]
        assert all(math.isfinite(v) and v > 0 for v in figures), row
        assert row["ratio"] == pytest.approx(row["dpcore_ms"] / row["baseline_ms"])
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        assert row["target"] == bench_targets.ROWS[row["row"]][1] and row["met"] == (row["ratio"] <= row["target"])
        assert row["load_before"] >= 0 and row["load_after"] >= 0 and row["threads"] and row["baseline"]
    printed = capsys.readouterr().out
    assert "round min" in printed and "target <=" in printed and "wrote" in printed


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--rounds", "2"], "--rounds"),
        (["--repeats", "0"], "--repeats"),
        (["--only", "hybrid_mlp,nope"], "--only"),
    ],
)
def test_targets_bad_options_exit_2_naming_the_option(
    argv: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_targets.main([*argv, "--json", str(tmp_path / "never.json")])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("bench_targets: error:") and option in last
    assert not (tmp_path / "never.json").exists()


def test_targets_only_runs_the_rows_named() -> None:
    """--only picks rows by name, reported in the table's order."""
    result = bench_targets.main(["--only", "streams,split", "--rounds", "3", "--repeats", "1"])
    assert [row["row"] for row in result["rows"]] == ["split", "streams"]
