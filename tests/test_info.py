"""Tests of dpcore.info(), `python -m dpcore.info` and the extension loader's
torch-version check."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import dpcore
from dpcore import _build_info, _loader
from conftest import TESTS_DIR, requires_cuda, subprocess_env


EXPECTED_KEYS = {
    "dpcore",
    "torch",
    "built_against_torch",
    "torch_matches",
    "build",
    "cuda_arch_list",
    "devices",
    "peer_access",
    "self_check",
}


def test_info_keys() -> None:
    assert set(dpcore.info()) == EXPECTED_KEYS


def test_info_values() -> None:
    facts = dpcore.info()
    assert facts["dpcore"] == dpcore.__version__
    assert facts["torch"] == torch.__version__
    assert facts["built_against_torch"] == _build_info.TORCH_VERSION
    assert facts["torch_matches"] is True
    assert facts["build"] in ("cpu", "cuda")
    assert facts["build"] == ("cuda" if dpcore._C.with_cuda else "cpu")
    assert isinstance(facts["cuda_arch_list"], list)
    assert all(isinstance(arch, str) for arch in facts["cuda_arch_list"])
    if facts["build"] == "cpu":
        assert facts["cuda_arch_list"] == []


def test_self_check_formats_numbers_in_cpp_errors() -> None:
    # A C++ error raised and caught inside _C keeps its numbers: _C uses the
    # shared libstdc++ torch loads (a static copy drops them or crashes).
    assert dpcore._C._self_check() == "self-check: size_t 42, int64_t -7, double 0.5"
    assert dpcore.info()["self_check"] == "ok"


def test_self_check_failure_is_reported_and_fails_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    info_module = importlib.import_module("dpcore.info")  # the package; dpcore.info is the function
    monkeypatch.setattr(dpcore._C, "_self_check", lambda: "self-check: size_t , int64_t , double ")
    verdict = dpcore.info()["self_check"]
    assert verdict.startswith("failed: a C++ error message came out as 'self-check: size_t , int64_t , double '")
    assert "CC=/usr/bin/gcc CXX=/usr/bin/g++" in verdict
    with pytest.raises(SystemExit) as exit_info:
        info_module.main()
    assert exit_info.value.code == 1
    assert "self-check failed" in capsys.readouterr().err


def test_info_devices() -> None:
    devices = dpcore.info()["devices"]
    assert devices[0] == "cpu"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(devices) == 1 + visible
    for i, entry in enumerate(devices[1:]):
        assert entry.startswith(f"cuda:{i} (")


def test_info_peer_access() -> None:
    peer = dpcore.info()["peer_access"]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected_pairs = {f"cuda:{i} -> cuda:{j}" for i in range(visible) for j in range(visible) if i != j}
    assert set(peer) == expected_pairs  # empty below two GPUs
    assert all(isinstance(ok, bool) for ok in peer.values())


def test_peer_access_rejects_non_cuda_devices() -> None:
    with pytest.raises(RuntimeError, match=r"peer_access: expected CUDA devices, but devices\[0\] is cpu"):
        dpcore._C.peer_access([torch.device("cpu"), torch.device("cpu")])
    with pytest.raises(RuntimeError, match=r"peer_access: expected at least one device in 'devices'"):
        dpcore._C.peer_access([])


@requires_cuda
@pytest.mark.cuda
def test_peer_access_of_one_device_with_itself_is_not_listed() -> None:
    assert dpcore._C.peer_access([torch.device("cuda", 0)] * 2) == {}


@requires_cuda
@pytest.mark.cuda
def test_peer_access_checks_device_indices() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=f"devices\\[1\\] is cuda:{count}, but only {count} cuda device"):
        dpcore._C.peer_access([torch.device("cuda", 0), torch.device("cuda", count)])


def test_extension_built_against_imported_torch() -> None:
    assert _loader._base(dpcore._C.torch_version) == _loader._base(torch.__version__)


def test_python_m_dpcore_info_prints_torch_version() -> None:
    env = subprocess_env()
    completed = subprocess.run(
        [sys.executable, "-m", "dpcore.info"],
        cwd=TESTS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    lines = {
        key.strip(): value.strip() for key, _, value in (line.partition(":") for line in completed.stdout.splitlines())
    }
    assert lines["torch"] == torch.__version__
    assert lines["build"] == dpcore.info()["build"]
    assert lines["torch_matches"] == "True"
    assert lines["self_check"] == "ok"
    assert set(lines) == EXPECTED_KEYS


@pytest.mark.parametrize("version, base", [("2.13.0+cpu", "2.13.0"), ("2.14.1+cu130", "2.14.1"), ("2.13.0", "2.13.0")])
def test_base_version_drops_local_tag(version: str, base: str) -> None:
    assert _loader._base(version) == base


def test_loader_rejects_other_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "1.0.0")
    with pytest.raises(ImportError) as info:
        _loader.load_extension()
    message = str(info.value)
    assert "1.0.0" in message
    assert torch.__version__ in message
    assert "rebuild" in message


def test_loader_accepts_other_local_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    # Same release, another local tag (+cpu vs +cu130): same C++ ABI, accepted.
    monkeypatch.setattr(_build_info, "TORCH_VERSION", _loader._base(torch.__version__) + "+other")
    module = _loader.load_extension()
    assert isinstance(module, ModuleType)
    assert module is dpcore._C


def test_loader_without_build_info_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate a source checkout that was never built: dpcore._build_info
    # cannot be imported.
    monkeypatch.delattr(dpcore, "_build_info")
    monkeypatch.setitem(sys.modules, "dpcore._build_info", None)  # type: ignore[arg-type]
    with pytest.raises(ImportError, match="not built.*pip install --no-build-isolation"):
        _loader.load_extension()
    # The real module is intact afterwards.
    monkeypatch.undo()
    assert importlib.import_module("dpcore._build_info").TORCH_VERSION == _build_info.TORCH_VERSION


def test_python_m_dpcore_info_runs_without_the_sys_modules_warning() -> None:
    # `import dpcore` imports dpcore.info and binds the name to the function;
    # runpy warned "'dpcore.info' found in sys.modules" when that was a module.
    completed = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "dpcore.info"],
        cwd=TESTS_DIR,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "found in sys.modules" not in completed.stderr
    assert "self_check: ok" in completed.stdout


def test_dpcore_info_stays_the_function_after_importing_its_module() -> None:
    module = importlib.import_module("dpcore.info")
    assert callable(dpcore.info) and dpcore.info is module.info
    assert set(dpcore.info()) == EXPECTED_KEYS


def _unbuilt_checkout(root: Path) -> Path:
    """A source checkout's layout (setup.py, csrc/, dpcore/*.py) without any build output."""
    source = Path(TESTS_DIR).parent
    (root / "csrc").mkdir(parents=True)
    shutil.copy2(source / "setup.py", root / "setup.py")
    shutil.copytree(
        source / "dpcore", root / "dpcore", ignore=shutil.ignore_patterns("*.so", "_build_info.py", "__pycache__")
    )
    return root


def test_unbuilt_checkout_shadowing_the_installed_dpcore_says_so(tmp_path: Path) -> None:
    # `python -m dpcore.info` in a source checkout without an in-place build,
    # with a built dpcore further down sys.path (installed, or on PYTHONPATH).
    checkout = _unbuilt_checkout(tmp_path / "checkout")
    completed = subprocess.run(
        [sys.executable, "-m", "dpcore.info"],
        cwd=checkout,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 1
    message = completed.stderr.strip().splitlines()[-1]
    installed = os.path.dirname(os.path.abspath(dpcore.__file__))
    assert message == (
        f"ImportError: dpcore was imported from the source checkout {checkout / 'dpcore'}, which has no in-place "
        f"build, instead of the installed dpcore in {installed}: the checkout comes first on sys.path (it is the "
        "current directory, or on PYTHONPATH) and shadows the installed package. Run from another directory, or "
        "build the checkout in place (`python setup.py build_ext --inplace`)"
    )


def test_unbuilt_checkout_alone_says_how_to_build(tmp_path: Path) -> None:
    checkout = _unbuilt_checkout(tmp_path / "checkout")
    message = _loader.not_built_message(str(checkout / "dpcore"), [str(checkout)])
    assert message == (
        f"dpcore's C++ extension is not built in the source checkout {checkout / 'dpcore'}: install it "
        f"(`pip install --no-build-isolation .` in {checkout}, then import it from another directory) "
        "or build in place (`python setup.py build_ext --inplace`)"
    )
    # Not a checkout (no setup.py next to it): an install that lost its extension.
    (checkout / "setup.py").unlink()
    assert _loader.not_built_message(str(checkout / "dpcore"), [str(checkout)]) == (
        f"dpcore's C++ extension is not built in {checkout / 'dpcore'}: reinstall dpcore "
        "(`pip install --no-build-isolation .` from its source folder)"
    )


def test_installed_elsewhere_ignores_the_shadowing_folder_and_unbuilt_copies(tmp_path: Path) -> None:
    checkout = _unbuilt_checkout(tmp_path / "checkout")
    other = _unbuilt_checkout(tmp_path / "other")  # a second copy, not built either
    installed = os.path.dirname(os.path.abspath(dpcore.__file__))
    parent = os.path.dirname(installed)
    shadowing = str(checkout / "dpcore")
    assert _loader.installed_elsewhere(shadowing, [str(checkout), str(other), parent]) == installed
    assert _loader.installed_elsewhere(shadowing, [str(checkout), str(other)]) is None
    assert _loader.installed_elsewhere(installed, [parent]) is None  # itself is not "elsewhere"
