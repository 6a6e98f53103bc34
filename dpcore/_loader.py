"""Loads dpcore._C after checking it was built against the torch in use."""

from __future__ import annotations

from types import ModuleType

import torch


def _base(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': the local tag does not change the C++ ABI of a release."""
    return version.split("+", 1)[0]


def load_extension() -> ModuleType:
    """Import and return dpcore._C.

    Guarantees: raises ImportError naming both versions when _C was built
    against another torch than the imported one, instead of failing later
    with an undefined symbol or a crash; raises ImportError with rebuild
    advice when _C is missing.
    """
    try:
        from dpcore import _build_info
    except ImportError as error:
        raise ImportError(
            "dpcore's C++ extension is not built: install with "
            "`pip install --no-build-isolation .` from the dpcore source folder"
        ) from error
    built = _build_info.TORCH_VERSION
    if _base(built) != _base(torch.__version__):
        raise ImportError(
            f"dpcore._C was built against torch {built}, but torch {torch.__version__} is "
            "imported; rebuild dpcore (`pip install --no-build-isolation .`) against the "
            "torch in use"
        )
    try:
        from dpcore import _C
    except ImportError as error:
        import os

        folder = os.path.dirname(os.path.abspath(__file__))
        raise ImportError(
            f"dpcore._C is not in {folder}: if that is a source checkout, build in place "
            "(`python setup.py build_ext --inplace`) or import the installed dpcore from another "
            f"folder; otherwise reinstall (`pip install --no-build-isolation .`). Cause: {error}"
        ) from error

    return _C
