"""dpcore: single-process, multi-device data parallelism for PyTorch.

The collectives and the worker pool are C++ (dpcore._C); this package is the
thin Python front end. Device lists hold CUDA devices or CPU devices, repeats
allowed: ``["cpu"] * 4`` runs four replicas on the CPU.

    model = dpcore.DataParallel(model, device_ids=["cpu"] * 4)
"""

from dpcore._loader import load_extension

_C = load_extension()

from dpcore import comm  # noqa: E402
from dpcore.data_parallel import DataParallel, data_parallel  # noqa: E402
from dpcore._patch import TorchPatch, patch_torch, unpatch_torch  # noqa: E402
from dpcore.info import info  # noqa: E402
from dpcore.parallel_apply import parallel_apply  # noqa: E402
from dpcore.replicate import replicate  # noqa: E402
from dpcore.scatter_gather import Broadcast, gather, scatter  # noqa: E402
from dpcore.sync_batchnorm import SyncBatchNormError  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Broadcast",
    "DataParallel",
    "SyncBatchNormError",
    "TorchPatch",
    "comm",
    "data_parallel",
    "gather",
    "info",
    "parallel_apply",
    "patch_torch",
    "replicate",
    "scatter",
    "unpatch_torch",
    "__version__",
]
