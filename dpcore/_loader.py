"""Loads dpcore._C after checking it was built against the torch in use: the one place that imports it (every module
does ``from dpcore._loader import _C``, never from ``__init__``)."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

INPLACE_BUILD = "python setup.py build_ext --inplace"
INSTALL = "pip install --no-build-isolation ."


def _base(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': the local tag does not change the C++ ABI of a release."""
    return version.split("+", 1)[0]


def installed_elsewhere(package_dir: str, search_path: Sequence[str] | None = None) -> str | None:
    """The folder of the first built dpcore package (one with _build_info.py) on `search_path` (default sys.path) other
    than `package_dir` and its parent's entry; None when there is none."""
    shadowing = os.path.realpath(os.path.dirname(package_dir))
    for entry in list(sys.path if search_path is None else search_path):
        if os.path.realpath(entry or os.getcwd()) == shadowing:
            continue
        spec = importlib.machinery.PathFinder.find_spec("dpcore", [entry])
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            built = os.path.isfile(os.path.join(folder, "_build_info.py"))
            if built and os.path.realpath(folder) != os.path.realpath(package_dir):
                return folder
    return None


def not_built_message(package_dir: str, search_path: Sequence[str] | None = None) -> str:
    """What to say when `package_dir` holds no build: that it shadows a built dpcore further on `search_path` (naming
    both), else how to build: in place in a source checkout, else reinstall."""
    installed = installed_elsewhere(package_dir, search_path)
    if installed is not None:
        return (
            f"dpcore was imported from the source checkout {package_dir}, which has no in-place build, "
            f"instead of the installed dpcore in {installed}: the checkout comes first on sys.path "
            "(it is the current directory, or on PYTHONPATH) and shadows the installed package. "
            f"Run from another directory, or build the checkout in place (`{INPLACE_BUILD}`)"
        )
    parent = os.path.dirname(package_dir)
    if os.path.isfile(os.path.join(parent, "setup.py")) and os.path.isdir(os.path.join(parent, "csrc")):
        return (
            f"dpcore's C++ extension is not built in the source checkout {package_dir}: install it "
            f"(`{INSTALL}` in {parent}, then import it from another directory) "
            f"or build in place (`{INPLACE_BUILD}`)"
        )
    return (
        f"dpcore's C++ extension is not built in {package_dir}: reinstall dpcore (`{INSTALL}` from its source folder)"
    )


def load_extension() -> ModuleType:
    """Imports dpcore._C; ImportError naming both versions when it was built against another torch release, or saying
    how to build it (not_built_message) when it is missing."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    try:
        build_info = importlib.import_module("dpcore._build_info")
    except ImportError as error:
        raise ImportError(not_built_message(package_dir)) from error
    built = build_info.TORCH_VERSION
    if _base(built) != _base(torch.__version__):
        raise ImportError(
            f"dpcore._C was built against torch {built}, but torch {torch.__version__} is "
            f"imported; rebuild dpcore (`{INSTALL}`) against the torch in use"
        )
    try:
        return importlib.import_module("dpcore._C")
    except ImportError as error:
        raise ImportError(f"{not_built_message(package_dir)}. Cause: {error}") from error


if TYPE_CHECKING:
    import dpcore._C as _C  # typed by dpcore/_C.pyi
else:
    _C = load_extension()
