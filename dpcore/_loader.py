"""Loads dpcore._C after checking it was built against the torch in use.

The one place that imports the extension: every module takes it from here
(``from dpcore._loader import _C``), so none can reach _C before the check
ran, and none imports it from the package's ``__init__``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

#: The in-place build command of a source checkout (docs/building.md).
INPLACE_BUILD = "python setup.py build_ext --inplace"
#: The install command of a source checkout (docs/building.md).
INSTALL = "pip install --no-build-isolation ."


def _base(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': the local tag does not change the C++ ABI of a release."""
    return version.split("+", 1)[0]


def _package_dir() -> str:
    """The folder of the dpcore package being imported (this file's folder)."""
    return os.path.dirname(os.path.abspath(__file__))


def is_source_checkout(package_dir: str) -> bool:
    """Whether `package_dir` is the dpcore folder of a source checkout (its
    parent holds setup.py and csrc/), not of an installed copy."""
    parent = os.path.dirname(package_dir)
    return os.path.isfile(os.path.join(parent, "setup.py")) and os.path.isdir(os.path.join(parent, "csrc"))


def installed_elsewhere(package_dir: str, search_path: Sequence[str] | None = None) -> str | None:
    """The folder of the first built dpcore package on `search_path` (default
    sys.path) other than `package_dir`: the one an import would have found
    had `package_dir` not come first; None when there is none.

    Built means it holds _build_info.py, which setup.py writes next to _C."""
    entries = list(sys.path if search_path is None else search_path)
    shadowing = os.path.realpath(os.path.dirname(package_dir))
    for entry in entries:
        if os.path.realpath(entry or os.getcwd()) == shadowing:
            continue
        spec = importlib.machinery.PathFinder.find_spec("dpcore", [entry])
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            if os.path.realpath(folder) != os.path.realpath(package_dir) and os.path.isfile(
                os.path.join(folder, "_build_info.py")
            ):
                return folder
    return None


def not_built_message(package_dir: str, search_path: Sequence[str] | None = None) -> str:
    """What to tell the user when `package_dir` holds no built extension.

    Guarantees: when a built dpcore is installed elsewhere on `search_path`
    (default sys.path), the message says that this source checkout shadows it
    (it comes first on the path: the current directory, or PYTHONPATH) and
    names both folders; otherwise it says how to build, in place for a source
    checkout and by installing otherwise."""
    installed = installed_elsewhere(package_dir, search_path)
    if installed is not None:
        return (
            f"dpcore was imported from the source checkout {package_dir}, which has no in-place build, "
            f"instead of the installed dpcore in {installed}: the checkout comes first on sys.path "
            "(it is the current directory, or on PYTHONPATH) and shadows the installed package. "
            f"Run from another directory, or build the checkout in place (`{INPLACE_BUILD}`)"
        )
    if is_source_checkout(package_dir):
        return (
            f"dpcore's C++ extension is not built in the source checkout {package_dir}: install it "
            f"(`{INSTALL}` in {os.path.dirname(package_dir)}, then import it from another directory) "
            f"or build in place (`{INPLACE_BUILD}`)"
        )
    return (
        f"dpcore's C++ extension is not built in {package_dir}: reinstall dpcore (`{INSTALL}` from its source folder)"
    )


def load_extension() -> ModuleType:
    """Import and return dpcore._C.

    Guarantees: raises ImportError naming both versions when _C was built
    against another torch than the imported one, instead of failing later
    with an undefined symbol or a crash; raises ImportError with rebuild
    advice when _C is missing, saying so when a source checkout without a
    build shadows an installed dpcore (see not_built_message).
    """
    package_dir = _package_dir()
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
