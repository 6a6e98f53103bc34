"""dpcore: single-process, multi-device data parallelism for PyTorch, a thin Python front end over a C++ core
(dpcore._C). Device lists hold CUDA or CPU devices, repeats allowed: ``dpcore.DataParallel(model, ["cpu"] * 4)``."""

from dpcore import comm
from dpcore._loader import _C as _C
from dpcore._version import __version__
from dpcore._patch import TorchPatch, patch_torch, unpatch_torch
from dpcore.data_parallel import DataParallel, data_parallel, functional_call
from dpcore.info import info
from dpcore.memory import DeviceMemory, memory_report
from dpcore.parallel_apply import parallel_apply
from dpcore.replicate import replicate
from dpcore.scatter_gather import Broadcast, Samples, gather, scatter
from dpcore.sharded_optimizer import ShardedOptimizer
from dpcore._grad_scaler import ShardedGradScaler
from dpcore.sync_batchnorm import SyncBatchNormError

__all__ = [
    "Broadcast",
    "DataParallel",
    "DeviceMemory",
    "Samples",
    "ShardedGradScaler",
    "ShardedOptimizer",
    "SyncBatchNormError",
    "TorchPatch",
    "comm",
    "data_parallel",
    "functional_call",
    "gather",
    "info",
    "memory_report",
    "parallel_apply",
    "patch_torch",
    "replicate",
    "scatter",
    "unpatch_torch",
    "__version__",
]
