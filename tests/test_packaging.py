"""pyproject.toml is accepted by every setuptools dpcore builds with: 65.5
(what Python 3.11's venvs bundle; it rejects an SPDX string as
project.license) through the current one (which deprecates the old license
forms). setup.py supplies the license (a dynamic field) in the form each
accepts: `license=` before setuptools 77, `license_expression=` from 77 on.

And the README's install in a fresh virtual environment: Python 3.11's venv
has pip 23.2, setuptools 65.5 and no `wheel`, which setuptools needs for
bdist_wheel before 70.1; the build names the one command that fixes it."""

from __future__ import annotations

import ensurepip
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import TESTS_DIR

ROOT = Path(TESTS_DIR).parent
PYPROJECT = ROOT / "pyproject.toml"

READ_WITH_BUNDLED_SETUPTOOLS = """
import sys
import setuptools
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

dist = apply_configuration(Distribution({"license": "BSD-3-Clause"}), sys.argv[1])
print(setuptools.__version__, dist.metadata.name, dist.metadata.version, dist.metadata.license, *dist.install_requires)
"""


def test_pyproject_is_valid_for_setuptools_65_5(tmp_path: Path) -> None:
    wheels = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("setuptools-65.5*.whl"))
    if not wheels:
        # Python 3.12 and later bundle no setuptools: take the same wheel from the package index.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(tmp_path / "wheels"),
                "setuptools==65.5.0",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        wheels = sorted((tmp_path / "wheels").glob("setuptools-65.5*.whl"))
    assert wheels, "no setuptools 65.5 wheel: neither bundled with this Python nor downloadable"
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(tmp_path)
    # -S: no site-packages, so the bundled setuptools is the only one.
    completed = subprocess.run(
        [sys.executable, "-S", "-c", READ_WITH_BUNDLED_SETUPTOOLS, str(PYPROJECT)],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["65.5.0", "dpcore", _version(), "BSD-3-Clause", "torch>=2.11"]


def test_pyproject_is_valid_without_warnings_for_the_installed_setuptools() -> None:
    import setuptools
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    modern = int(setuptools.__version__.split(".")[0]) >= 77
    attrs = {"license_expression": "BSD-3-Clause"} if modern else {"license": "BSD-3-Clause"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated form would raise here
        dist = apply_configuration(Distribution(attrs), str(PYPROJECT))
    assert dist.metadata.name == "dpcore"
    assert dist.metadata.version == _version()
    assert dist.install_requires == ["torch>=2.11"]
    license_field = dist.metadata.license_expression if modern else dist.metadata.license
    assert license_field == "BSD-3-Clause"


def _version() -> str:
    """dpcore's version as dpcore/_version.py writes it (the one place)."""
    match = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "dpcore" / "_version.py").read_text(), re.M)
    assert match, "dpcore/_version.py has no __version__ line"
    return match.group(1)


def test_version_is_written_once() -> None:
    import dpcore

    assert dpcore.__version__ == _version()
    assert not re.search(r"^version\s*=\s*\"", PYPROJECT.read_text(), re.M)  # read from dpcore/_version.py
    written = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "dpcore").rglob("*.py")
        if re.search(r"^__version__ =", path.read_text(), re.M)
    ]
    assert written == ["dpcore/_version.py"]


def test_every_package_and_the_stub_are_shipped() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(str(PYPROJECT), expand=False)["tool"]["setuptools"]
    found = sorted(".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "dpcore").rglob("__init__.py"))
    assert sorted(config["packages"]) == found
    assert {"_C.pyi", "py.typed"} <= set(config["package-data"]["dpcore"])
    assert (ROOT / "dpcore" / "_C.pyi").is_file() and (ROOT / "dpcore" / "py.typed").is_file()
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()


# -- the README's install in a fresh virtual environment ----------------------

#: Installing these fails for want of the package, not because of dpcore.
_UNAVAILABLE = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "NewConnectionError",
    "ReadTimeoutError",
)


def _dependency_pins(name: str, skip: set[str]) -> dict[str, str]:
    """{distribution: installed version} for `name` and everything it needs
    (its extras left out) in this environment, without those in `skip`."""
    pins: dict[str, str] = {}
    pending = [name]
    while pending:
        current = pending.pop()
        key = re.sub(r"[-_.]+", "-", current).lower()
        if key in pins or key in skip:
            continue
        dist = importlib.metadata.distribution(current)
        pins[key] = dist.version
        for requirement in dist.requires or []:
            if "extra ==" in requirement.replace(" ", "").replace("extra==", "extra =="):
                continue
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
            assert match, requirement
            pending.append(match.group(1))
    return pins


def _pip(python: Path, *args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Runs the venv's pip; its output (stdout and stderr) is in .stdout."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [str(python), "-m", "pip", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


def _install_or_skip(python: Path, packages: list[str], what: str, *, deps: bool = False) -> None:
    """pip install `packages` (with their dependencies where `deps`; no
    byte-compiling, which would take most of the time); skips the test when
    they cannot be had here."""
    completed = _pip(python, "install", "-q", "--no-compile", *([] if deps else ["--no-deps"]), *packages)
    if completed.returncode != 0:
        if any(marker in completed.stdout for marker in _UNAVAILABLE):
            lines = [line for line in completed.stdout.splitlines() if line.strip()]
            pytest.skip(f"{what} is neither on local disk nor downloadable here: {lines[-1] if lines else ''}")
        raise AssertionError(f"installing {what} failed:\n{completed.stdout}")


def _source_copy(target: Path) -> Path:
    """What `pip install .` reads of a clean checkout, without any build output."""
    target.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, target / name)
    ignore = shutil.ignore_patterns("*.so", "_build_info.py", "__pycache__")
    for folder in ("dpcore", "csrc", "tools"):
        shutil.copytree(ROOT / folder, target / folder, ignore=ignore)
    return target


def test_fresh_venv_without_wheel_names_pip_install_wheel(tmp_path: Path) -> None:
    """A fresh venv as Python 3.11 makes it (pip 23.2, setuptools 65.5, no
    wheel) with torch and ninja installed, as with a torch release that does
    not pull in a newer setuptools (torch 2.11 and 2.12 on Python 3.11):
    `pip install --no-build-isolation .` stops before compiling anything,
    naming `pip install wheel`, instead of "invalid command 'bdist_wheel'";
    after that command, pip prepares dpcore's metadata."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, capture_output=True)
    python = venv / "bin" / "python"
    # Python 3.12 and later put no setuptools into a venv: the 3.11 one, then.
    _install_or_skip(python, ["setuptools==65.5.0"], "setuptools 65.5.0")
    installed = {line.split("==")[0].lower() for line in _pip(python, "freeze", "--all").stdout.split()}
    assert "wheel" not in installed and "setuptools" in installed
    # torch as installed here, and what it needs, but not the newer setuptools
    # that torch 2.13 asks for: that is the state the install must handle.
    pins = _dependency_pins("torch", skip={"setuptools", "wheel"})
    packages = [f"{name}=={version}" for name, version in sorted(pins.items())]
    _install_or_skip(python, [*packages, "ninja"], f"torch=={torch.__version__} and its dependencies")

    source = _source_copy(tmp_path / "dpcore-src")
    failed = _pip(python, "install", "--no-build-isolation", ".", cwd=source)
    assert failed.returncode != 0, failed.stdout
    assert "invalid command 'bdist_wheel'" not in failed.stdout
    assert (
        "dpcore: building a wheel with setuptools 65.5.0 needs the `wheel` package (setuptools ships "
        "bdist_wheel itself only from 70.1): run `pip install wheel`, then `pip install --no-build-isolation .` "
        "again"
    ) in failed.stdout
    assert not (source / "build").exists() and not (source / "dpcore" / "_build_info.py").exists()

    _install_or_skip(python, ["wheel"], "wheel", deps=True)  # the command the message names
    metadata = _pip(python, "install", "--dry-run", "--no-deps", "--no-build-isolation", ".", cwd=source)
    assert metadata.returncode == 0, metadata.stdout
    assert f"Would install dpcore-{_version()}" in metadata.stdout


def test_readme_install_lines_name_wheel_and_the_python_versions() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 numpy ninja setuptools wheel\n  pip install --no-build-isolation ." in readme
    assert "Python 3.10 or newer" in readme
    assert 'requires-python = ">=3.10"' in PYPROJECT.read_text()


@pytest.mark.parametrize("name", ["scripts/run.sh", "scripts/test.sh", "scripts/test_cuda_build.sh", "README.md"])
def test_every_setup_installs_what_the_build_imports_before_the_build(name: str) -> None:
    """The build imports torch, which prints "Failed to initialize NumPy" where numpy is missing: each of the
    README's commands, the CUDA build's script and the README's install lines put numpy in before dpcore's build."""
    text = (ROOT / name).read_text()
    build = re.search(r"pip install[^\n]*--no-build-isolation", text)
    assert build is not None, f"{name}: no `pip install --no-build-isolation` of dpcore found"
    before = [line for line in text[: build.start()].splitlines() if "pip install" in line or line.startswith("  ")]
    assert any(re.search(r"\bnumpy\b", line) for line in before), f"{name}: numpy is not installed before the build"
