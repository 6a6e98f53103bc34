"""dpcore: single-process, multi-device data parallelism for PyTorch.

The collectives and the worker pool are C++ (dpcore._C); this package is the
thin Python front end. Device lists hold CUDA devices or CPU devices, repeats
allowed: ``["cpu"] * 4`` runs four replicas on the CPU.

    model = dpcore.DataParallel(model, device_ids=["cpu"] * 4)
"""

from dpcore import comm
from dpcore._loader import _C as _C
from dpcore._version import __version__
from dpcore._patch import TorchPatch, patch_torch, unpatch_torch
from dpcore._dropin import functional_call
from dpcore.data_parallel import DataParallel, data_parallel
from dpcore.info import info
from dpcore.parallel_apply import parallel_apply
from dpcore.replicate import replicate
from dpcore.scatter_gather import Broadcast, Samples, gather, scatter
from dpcore.sharded_optimizer import ShardedOptimizer
from dpcore.sync_batchnorm import SyncBatchNormError

__all__ = [
    "Broadcast",
    "DataParallel",
    "Samples",
    "ShardedOptimizer",
    "SyncBatchNormError",
    "TorchPatch",
    "comm",
    "data_parallel",
    "functional_call",
    "gather",
    "info",
    "parallel_apply",
    "patch_torch",
    "replicate",
    "scatter",
    "unpatch_torch",
    "__version__",
]
