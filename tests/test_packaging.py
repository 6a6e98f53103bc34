"""pyproject.toml is accepted by every setuptools dpcore builds with: 65.5
(what Python 3.11's venvs bundle; it rejects an SPDX string as
project.license) through the current one (which deprecates the old license
forms). setup.py supplies the license (a dynamic field) in the form each
accepts: `license=` before setuptools 77, `license_expression=` from 77 on."""

from __future__ import annotations

import ensurepip
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

from conftest import TESTS_DIR

PYPROJECT = Path(TESTS_DIR).parent / "pyproject.toml"

READ_WITH_BUNDLED_SETUPTOOLS = """
import sys
import setuptools
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

dist = apply_configuration(Distribution({"license": "BSD-3-Clause"}), sys.argv[1])
print(setuptools.__version__, dist.metadata.name, dist.metadata.license, *dist.install_requires)
"""


def test_pyproject_is_valid_for_setuptools_65_5(tmp_path: Path) -> None:
    wheels = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("setuptools-65.5*.whl"))
    if not wheels:
        # Python 3.12 and later bundle no setuptools: take the same wheel from the package index.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", str(tmp_path / "wheels"), "setuptools==65.5.0"],
            capture_output=True, text=True, timeout=300, check=True,
        )
        wheels = sorted((tmp_path / "wheels").glob("setuptools-65.5*.whl"))
    assert wheels, "no setuptools 65.5 wheel: neither bundled with this Python nor downloadable"
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(tmp_path)
    # -S: no site-packages, so the bundled setuptools is the only one.
    completed = subprocess.run(
        [sys.executable, "-S", "-c", READ_WITH_BUNDLED_SETUPTOOLS, str(PYPROJECT)],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["65.5.0", "dpcore", "BSD-3-Clause", "torch>=2.11"]


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
    assert dist.install_requires == ["torch>=2.11"]
    license_field = dist.metadata.license_expression if modern else dist.metadata.license
    assert license_field == "BSD-3-Clause"
