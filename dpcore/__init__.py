"""dpcore: single-process, multi-device data parallelism for PyTorch.

The collectives and the worker pool are C++ (dpcore._C); this package is the
thin Python front end. Device lists hold CUDA devices or CPU devices, repeats
allowed: ``["cpu"] * 4`` runs four replicas on the CPU.
"""

from dpcore._loader import load_extension

_C = load_extension()

from dpcore import comm  # noqa: E402
from dpcore.info import info  # noqa: E402

__version__ = "0.1.0"

__all__ = ["comm", "info", "__version__"]
