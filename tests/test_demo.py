"""Tests for the digits demo, ``python examples/digits.py`` (an application of dpcore, not part of the package).

The demo needs scikit-learn and tqdm (the demo extras); the
test environment installs them, so nothing here skips for want of them.
Runs are kept short: one epoch, or a stratified subset (the hidden
``--limit`` option)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import NO_GPU_REASON

# The demo is a script beside the package: imported from its folder (tests/test_readme.py and
# tests/test_distributed.py take it from here).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import digits as demo  # noqa: E402


def _check_summary(summary: dict[str, Any], epochs: int, devices: int) -> None:
    assert summary["agreement"] is True
    check = summary["agreement_check"]
    assert check["ok"] is True and check["steps"] == demo.CHECK_STEPS and check["atol"] == demo.CHECK_ATOL
    assert len(check["max_abs_diff"]) == demo.CHECK_STEPS
    assert all(0.0 <= d <= demo.CHECK_ATOL for d in check["max_abs_diff"] + check["loss_diff"])
    assert summary["epochs"] == epochs and len(summary["history"]) == epochs
    assert len(summary["devices"]) == devices
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    assert summary["final_accuracy"] == summary["history"][-1]["test_accuracy"]
    assert summary["samples_per_second"] > 0 and summary["seconds"] > 0
    for row in summary["history"]:
        assert row["loss"] == row["loss"] and row["loss"] > 0  # finite, not NaN


def test_one_epoch_on_four_cpu_devices(capsys: pytest.CaptureFixture[str]) -> None:
    summary = demo.main(["--epochs", "1", "--devices", "cpu:4", "--seed", "1"])
    _check_summary(summary, epochs=1, devices=4)
    assert summary["train_samples"] + summary["test_samples"] == 1797
    assert summary["test_samples"] == 360  # 80/20
    # One epoch already learns something: above chance (0.1; seed 1 gives
    # 0.33) and a mean loss below that of uniform predictions, ln 10.
    assert summary["final_accuracy"] > 0.2
    assert summary["history"][0]["loss"] < math.log(10)
    out, err = capsys.readouterr()
    assert "agreement check passed" in out
    assert "epoch 1/1" in out and "test accuracy" in out and "samples/s" in out
    assert "final test acc" in out  # the summary table
    assert "epoch 1/1" in err  # tqdm's bar


def test_uneven_splits_on_a_subset(capsys: pytest.CaptureFixture[str]) -> None:
    """Batch 7 on 3 devices (3, 2, 2), the last batch shorter, two epochs."""
    summary = demo.main(["--epochs", "2", "--devices", "cpu:3", "--batch-size", "7", "--limit", "200", "--no-progress"])
    _check_summary(summary, epochs=2, devices=3)
    assert summary["train_samples"] == 160 and summary["test_samples"] == 40
    out, err = capsys.readouterr()
    assert "epoch 2/2" in out
    assert "epoch 1/2" not in err  # --no-progress: no bar


def test_single_device_and_batch_smaller_than_device_count() -> None:
    _check_summary(
        demo.main(["--epochs", "1", "--devices", "cpu", "--limit", "100", "--no-progress"]), epochs=1, devices=1
    )
    _check_summary(
        demo.main(["--epochs", "1", "--devices", "cpu:4", "--batch-size", "2", "--limit", "60", "--no-progress"]),
        epochs=1,
        devices=4,
    )


def test_synchronized_batchnorm(capsys: pytest.CaptureFixture[str]) -> None:
    """--sync-batchnorm: BatchNorm layers in the CNN, synchronized across uneven
    replicas (batch 7 on 3 devices); the float64 check covers them, running
    statistics included, and passes."""
    summary = demo.main(
        [
            "--epochs",
            "1",
            "--devices",
            "cpu:3",
            "--batch-size",
            "7",
            "--limit",
            "200",
            "--no-progress",
            "--sync-batchnorm",
        ]
    )
    _check_summary(summary, epochs=1, devices=3)
    assert summary["batchnorm"] == "synchronized"
    out = capsys.readouterr().out
    assert "with synchronized BatchNorm" in out and "agreement check passed" in out


def test_per_replica_batchnorm_skips_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    summary = demo.main(["--epochs", "1", "--devices", "cpu:2", "--limit", "100", "--no-progress", "--batchnorm"])
    assert summary["batchnorm"] == "per-replica"
    assert summary["agreement"] is None and summary["agreement_check"] is None
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    assert "agreement check skipped" in capsys.readouterr().out


def test_check_agreement_covers_batchnorm() -> None:
    """With BatchNorm, the check passes only when it is synchronized: per-replica
    statistics differ from one device's, and the check sees it."""
    torch.manual_seed(0)
    model = demo.digits_cnn(batchnorm=True)
    assert sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()) == 3
    x = torch.rand(32, 1, 8, 8)
    y = torch.randint(0, 10, (32,))
    order = list(torch.arange(32).split(10))
    synced = demo.check_agreement(model, [torch.device("cpu")] * 3, x, y, order, lr=0.1, sync_batchnorm=True)
    assert synced["ok"], synced
    plain = demo.check_agreement(model, [torch.device("cpu")] * 3, x, y, order, lr=0.1)
    assert not plain["ok"] and max(plain["max_abs_diff"]) > 1e-6


def test_batchnorm_needs_batches_of_two(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--sync-batchnorm", "--batch-size", "1"])
    assert exc.value.code == 2
    assert "--batch-size: expected at least 2 with BatchNorm, but got 1" in capsys.readouterr().err
    last = demo.batches(9, 4, torch.Generator().manual_seed(0), min_last=2)
    assert [len(b) for b in last] == [4, 4]  # a last batch of one is dropped


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU_REASON)
def test_one_epoch_on_a_repeated_gpu() -> None:
    summary = demo.main(["--epochs", "1", "--devices", "0,0", "--no-progress"])
    _check_summary(summary, epochs=1, devices=2)
    assert summary["devices"] == ["cuda:0", "cuda:0"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU_REASON)
def test_cuda_graphs_on_a_repeated_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """--cuda-graphs on [0, 0]: the float64 check runs CHECK_STEPS_GRAPHED
    steps with cuda_graphs=True (replays included) and passes; the run trains."""
    summary = demo.main(["--epochs", "1", "--devices", "0,0", "--no-progress", "--cuda-graphs"])
    assert summary["cuda_graphs"] is True and summary["agreement"] is True
    check = summary["agreement_check"]
    assert check["steps"] == demo.CHECK_STEPS_GRAPHED
    assert all(0.0 <= d <= demo.CHECK_ATOL for d in check["max_abs_diff"] + check["loss_diff"])
    assert summary["devices"] == ["cuda:0", "cuda:0"] and len(summary["history"]) == 1
    assert math.isfinite(summary["history"][0]["loss"]) and 0.0 <= summary["final_accuracy"] <= 1.0
    out = capsys.readouterr().out
    assert "CUDA graphs" in out and f"the first {demo.CHECK_STEPS_GRAPHED} steps" in out


def test_cuda_graphs_reach_the_check_and_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """--cuda-graphs is passed as cuda_graphs=True to the check's and the
    training wrapper (the evaluation wrapper stays eager), and the check runs
    CHECK_STEPS_GRAPHED steps. On CPU, where DataParallel refuses
    cuda_graphs=True, through a DataParallel that records the option and
    drops it, after options parsed as if the devices were CUDA ones."""
    import dpcore

    real_dp, real_parse = dpcore.DataParallel, demo._parse
    seen: list[bool] = []

    def recording(module: torch.nn.Module, **kwargs: Any) -> Any:
        seen.append(kwargs.pop("cuda_graphs", False))
        return real_dp(module, **kwargs)

    def parse_as_cuda(argv: Any) -> Any:
        args, devices, spec = real_parse([a for a in argv if a != "--cuda-graphs"])
        args.cuda_graphs = True
        return args, devices, spec

    monkeypatch.setattr(dpcore, "DataParallel", recording)
    monkeypatch.setattr(demo, "_parse", parse_as_cuda)
    summary = demo.main(["--epochs", "1", "--devices", "cpu:2", "--limit", "100", "--no-progress", "--cuda-graphs"])
    assert seen == [True, True, False]  # the check's, the trainer's, the evaluator's
    assert summary["cuda_graphs"] is True and summary["agreement"] is True
    assert summary["agreement_check"]["steps"] == demo.CHECK_STEPS_GRAPHED


@pytest.mark.parametrize("devices", [["--devices", "cpu:2"], ["--devices", "cpu"]])
def test_cuda_graphs_on_a_cpu_list_is_an_option_error(devices: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--cuda-graphs", *devices])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("python examples/digits.py: error: --cuda-graphs: needs CUDA devices")
    assert f"--devices {devices[1]} is cpu" in last and "CUDA graphs capture CUDA work only" in last
    assert out == ""  # nothing ran


def test_cuda_graphs_on_the_default_cpu_list_is_an_option_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --devices on a machine without a GPU (cpu:4 stands in where one is present)."""
    monkeypatch.setattr(demo, "_default_devices", lambda: "cpu:4")
    with pytest.raises(SystemExit) as exc:
        demo.main(["--cuda-graphs"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cuda-graphs: needs CUDA devices, but the default --devices cpu:4" in last
    assert "cpu, cpu, cpu, cpu" in last


def test_cuda_graphs_under_torchrun_need_cuda_devices_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hybrid mode allows --cuda-graphs (the process-group wrapper is a
    DataParallel with the same options), so a torchrun launch on a CPU list
    gets the CPU-list error, not a torchrun one."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exc:
        demo.main(["--cuda-graphs", "--devices", "cpu:2"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cuda-graphs: needs CUDA devices, but --devices cpu:2 is cpu, cpu" in last
    assert "torchrun" not in last


@pytest.mark.parametrize("devices", ["cpu:2", "0,0"])
def test_cuda_graphs_refuse_sync_batchnorm(devices: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before the devices are looked at, so on any machine."""
    with pytest.raises(SystemExit) as exc:
        demo.main(["--cuda-graphs", "--sync-batchnorm", "--devices", devices])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert "--cuda-graphs: not with --sync-batchnorm" in last and out == ""


def test_compile_trains_a_compiled_model(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--compile BACKEND: the check and the trainer get torch.compile'd
    models (the check against the compiled model on one device, and it
    passes), the evaluator the eager one."""
    import dpcore

    real = dpcore.DataParallel
    seen: list[str] = []

    def recording(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append(type(module).__name__)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(dpcore, "DataParallel", recording)
    summary = demo.main(
        ["--epochs", "1", "--devices", "cpu:2", "--limit", "100", "--no-progress", "--compile", "aot_eager"]
    )
    assert seen == ["OptimizedModule", "OptimizedModule", "Sequential"]  # the check's, the trainer's, the evaluator's
    assert summary["compile"] == "aot_eager" and summary["agreement"] is True
    assert "torch.compile (backend aot_eager)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "detail"),
    [
        (["--compile", "nonesuch"], "--compile: expected a torch.compile backend"),
        (["--compile", "--cuda-graphs", "--devices", "0,0"], "--compile: not with --cuda-graphs"),
    ],
)
def test_compile_option_errors(argv: list[str], detail: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert detail in err.strip().splitlines()[-1] and out == ""


def test_same_seed_same_run() -> None:
    args = ["--epochs", "1", "--devices", "cpu:2", "--limit", "150", "--no-progress", "--seed", "3"]
    first, second = demo.main(args), demo.main(args)
    assert first["final_accuracy"] == second["final_accuracy"]
    assert first["history"][0]["loss"] == pytest.approx(second["history"][0]["loss"], rel=1e-6)


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--epochs", "0"], "--epochs"),
        (["--epochs", "-3"], "--epochs"),
        (["--epochs", "two"], "--epochs"),
        (["--devices", "cpu:0"], "--devices"),
        (["--devices", "gpu"], "--devices"),
        (["--devices", "99"], "--devices"),  # no GPU: none available; with GPUs: not visible
        (["--batch-size", "0"], "--batch-size"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "-0.1"], "--lr"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_bad_options_exit_2_naming_the_option(argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("python examples/digits.py: error:") and option in last
    assert out == ""  # nothing ran


def test_cuda_index_without_gpu_is_an_option_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`--devices 0` on a machine without a GPU (the CPU test machine; where a
    GPU is present, `--devices 0` is valid and an unseen index stands in)."""
    spec = "0" if not torch.cuda.is_available() else str(torch.cuda.device_count())
    with pytest.raises(SystemExit) as exc:
        demo.main(["--devices", spec])
    assert exc.value.code == 2
    assert "--devices" in capsys.readouterr().err


def test_disagreement_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed float64 check stops the run before training: with a negative
    tolerance nothing can agree."""
    original = demo.check_agreement
    monkeypatch.setattr(demo, "check_agreement", lambda *a, **k: original(*a, **{**k, "atol": -1.0}))
    with pytest.raises(SystemExit) as exc:
        demo.main(["--epochs", "1", "--devices", "cpu:2", "--limit", "100", "--no-progress"])
    assert exc.value.code == 1
    out, err = capsys.readouterr()
    assert "agreement check FAILED" in err
    assert "epoch 1/1" not in out


def test_check_agreement_detects_a_different_model() -> None:
    """The check compares real parameters: a DataParallel whose replicas see a
    different loss (here: labels shifted on the parallel side) disagrees."""
    torch.manual_seed(0)
    model = demo.digits_cnn()
    x = torch.rand(32, 1, 8, 8)
    y = torch.randint(0, 10, (32,))
    order = list(torch.arange(32).split(8))
    good = demo.check_agreement(model, [torch.device("cpu")] * 3, x, y, order, lr=0.1)
    assert good["ok"] and good["steps"] == 3
    before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # model untouched

    class Shifted(torch.nn.CrossEntropyLoss):
        def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return super().forward(logits, (target + 1) % 10)

    import dpcore

    real = dpcore.DataParallel

    def shifted_dp(module: torch.nn.Module, **kwargs: Any) -> Any:
        return real(module, **{**kwargs, "criterion": Shifted()})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dpcore, "DataParallel", shifted_dp)
        bad = demo.check_agreement(model, [torch.device("cpu")] * 2, x, y, order, lr=0.1)
    assert not bad["ok"] and max(bad["max_abs_diff"]) > 1e-6


@pytest.mark.parametrize("module", ["sklearn", "tqdm"])
def test_missing_dependency_names_the_extra(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(SystemExit) as exc:
        demo.main(["--epochs", "1", "--devices", "cpu:2"])
    message = str(exc.value.code)
    missing = "scikit-learn" if module == "sklearn" else "tqdm"
    assert message == (
        f"examples/digits.py needs scikit-learn and tqdm, but {missing} is missing: pip install scikit-learn tqdm "
        '(or, in the dpcore source folder, pip install --no-build-isolation ".[demo]")'
    )


def test_help_works(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--devices",
        "--epochs",
        "--batch-size",
        "--seed",
        "--lr",
        "--batchnorm",
        "--sync-batchnorm",
        "--cuda-graphs",
    ):
        assert option in out
    assert "--limit" not in out
