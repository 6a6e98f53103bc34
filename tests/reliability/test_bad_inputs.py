"""The bad-input table: every public function of dpcore (dpcore.comm.*,
DataParallel, data_parallel, parallel_apply, replicate) given a wrong
argument raises the documented exception type with a message that names the
argument (and the index or replica, where there is one).

Each row is (callable, exception type, regular expression searched in the
message). A CUDA index equal to the number of visible GPUs is invisible on
every machine, so no row needs a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dpcore
from dpcore import comm

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

CPU2 = ["cpu"] * 2
CPU4 = ["cpu"] * 4
INVISIBLE_CUDA = torch.cuda.device_count()  # one past the last visible GPU


def t23() -> torch.Tensor:
    return torch.arange(6.0).reshape(2, 3)


def x8() -> torch.Tensor:
    return torch.arange(8.0)


def coo() -> torch.Tensor:
    return torch.eye(4).to_sparse()


def csr() -> torch.Tensor:
    return torch.eye(4).to_sparse_csr()


def linear() -> nn.Module:
    return nn.Linear(3, 2)


def dp(**options: Any) -> dpcore.DataParallel:
    return dpcore.DataParallel(nn.Linear(3, 2), CPU4, **options)


class ReturnsPerDevice(nn.Module):
    """Replica i returns what `make(x)` gives; used for malformed outputs."""

    def __init__(self, make: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.make = make

    def forward(self, x: torch.Tensor, mask: Any = None) -> Any:
        return self.make(self.linear(x))


def _scatter_outs_overlap() -> Any:
    buf = torch.zeros(10)
    return comm.scatter(x8(), out=[buf[:4], buf[2:6]])


Case = tuple[Callable[[], Any], type[BaseException], str]

CASES: dict[str, Case] = {
    # ------------------------------------------------------------ broadcast
    "broadcast/devices-and-out": (
        lambda: comm.broadcast(t23(), CPU2, out=[t23()]),
        RuntimeError,
        "exactly one of 'devices' and 'out'",
    ),
    "broadcast/neither": (lambda: comm.broadcast(t23()), RuntimeError, "exactly one of 'devices' and 'out'"),
    "broadcast/device-float": (
        lambda: comm.broadcast(t23(), ["cpu", 1.5]),
        TypeError,
        r"devices\[1\]: expected a device",
    ),
    "broadcast/device-negative": (
        lambda: comm.broadcast(t23(), [-1]),
        ValueError,
        r"devices\[0\]: expected a non-negative",
    ),
    "broadcast/single-device": (lambda: comm.broadcast(t23(), "cpu"), TypeError, "devices: expected a list of devices"),
    "broadcast/no-devices": (lambda: comm.broadcast(t23(), []), RuntimeError, "at least one device in 'devices'"),
    "broadcast/invisible-cuda": (
        lambda: comm.broadcast(t23(), [INVISIBLE_CUDA]),
        RuntimeError,
        r"devices\[0\] is cuda",
    ),
    "broadcast/out-not-tensor": (
        lambda: comm.broadcast(t23(), out=[t23(), 3]),
        TypeError,
        r"out\[1\]: expected a tensor",
    ),
    "broadcast/out-shape": (
        lambda: comm.broadcast(t23(), out=[torch.empty(2, 3), torch.empty(3, 2)]),
        RuntimeError,
        "output tensor at index 1 has shape",
    ),
    "broadcast/out-dtype": (
        lambda: comm.broadcast(t23(), out=[torch.empty(2, 3, dtype=torch.long)]),
        RuntimeError,
        "output tensor at index 0 has dtype Long",
    ),
    # -------------------------------------------------- broadcast_coalesced
    "broadcast_coalesced/single-tensor": (
        lambda: comm.broadcast_coalesced(t23(), CPU2),
        TypeError,
        "tensors: expected a sequence",
    ),
    "broadcast_coalesced/not-tensor": (
        lambda: comm.broadcast_coalesced([t23(), "x"], CPU2),
        TypeError,
        r"tensors\[1\]: expected a tensor",
    ),
    "broadcast_coalesced/buffer-size-0": (
        lambda: comm.broadcast_coalesced([t23()], CPU2, 0),
        RuntimeError,
        r"buffer_size\) to be positive, but got 0",
    ),
    "broadcast_coalesced/buffer-size-negative": (
        lambda: comm.broadcast_coalesced([t23()], CPU2, -8),
        RuntimeError,
        r"buffer_size\) to be positive, but got -8",
    ),
    "broadcast_coalesced/not-on-devices0": (
        lambda: comm.broadcast_coalesced([t23(), torch.empty(2, device="meta")], CPU2),
        RuntimeError,
        r"tensors\[1\] is on meta",
    ),
    "broadcast_coalesced/csr": (
        lambda: comm.broadcast_coalesced([t23(), csr()], CPU2),
        RuntimeError,
        "tensor 1 has layout SparseCsr",
    ),
    "broadcast_coalesced/no-devices": (
        lambda: comm.broadcast_coalesced([t23()], []),
        RuntimeError,
        "at least one device in 'devices'",
    ),
    # ----------------------------------------------------------- reduce_add
    "reduce_add/single-tensor": (lambda: comm.reduce_add(t23()), TypeError, "inputs: expected a sequence"),
    "reduce_add/empty": (lambda: comm.reduce_add([]), RuntimeError, "reduce_add: expected at least one tensor"),
    "reduce_add/shape": (
        lambda: comm.reduce_add([t23(), torch.zeros(3, 2)]),
        RuntimeError,
        r"inputs\[1\] has shape \[3, 2\]",
    ),
    "reduce_add/dtype": (lambda: comm.reduce_add([t23(), t23().long()]), RuntimeError, r"inputs\[1\] has dtype Long"),
    "reduce_add/layout": (
        lambda: comm.reduce_add([coo(), torch.eye(4)]),
        RuntimeError,
        r"inputs\[1\] has layout Strided",
    ),
    "reduce_add/csr": (lambda: comm.reduce_add([csr(), csr()]), RuntimeError, r"inputs\[0\] has layout SparseCsr"),
    "reduce_add/destination-type": (lambda: comm.reduce_add([t23()], 1.5), TypeError, "destination: expected a device"),
    "reduce_add/destination-invisible": (
        lambda: comm.reduce_add([t23()], INVISIBLE_CUDA),
        RuntimeError,
        r"destination\[0\] is cuda",
    ),
    # -------------------------------------------------- reduce_add_coalesced
    "reduce_add_coalesced/tensor": (
        lambda: comm.reduce_add_coalesced(t23()),
        TypeError,
        "inputs: expected a sequence of lists",
    ),
    "reduce_add_coalesced/not-tensor": (
        lambda: comm.reduce_add_coalesced([[t23()], [None]]),
        TypeError,
        r"inputs\[1\]\[0\]: expected a tensor",
    ),
    "reduce_add_coalesced/lengths": (
        lambda: comm.reduce_add_coalesced([[t23(), t23()], [t23()]]),
        RuntimeError,
        r"inputs\[1\] to hold 2 tensors",
    ),
    "reduce_add_coalesced/shape": (
        lambda: comm.reduce_add_coalesced([[t23()], [torch.zeros(3, 2)]]),
        RuntimeError,
        r"inputs\[1\]\[0\] has shape \[3, 2\]",
    ),
    "reduce_add_coalesced/buffer-size-0": (
        lambda: comm.reduce_add_coalesced([[t23()], [t23()]], None, 0),
        RuntimeError,
        r"buffer_size\) to be positive",
    ),
    "reduce_add_coalesced/destination-invisible": (
        lambda: comm.reduce_add_coalesced([[t23()], [t23()]], INVISIBLE_CUDA),
        RuntimeError,
        r"destination\[0\] is cuda",
    ),
    # -------------------------------------------------------------- scatter
    "scatter/no-devices-no-out": (
        lambda: comm.scatter(x8()),
        RuntimeError,
        "expected 'devices' when 'out' is not specified",
    ),
    "scatter/devices-with-out": (
        lambda: comm.scatter(x8(), CPU2, out=[torch.empty(8)]),
        RuntimeError,
        "'devices' must not be specified",
    ),
    "scatter/chunk-sizes-with-out": (
        lambda: comm.scatter(x8(), chunk_sizes=[8], out=[torch.empty(8)]),
        RuntimeError,
        "'chunk_sizes' must not be specified",
    ),
    "scatter/chunk-sizes-length": (lambda: comm.scatter(x8(), CPU2, [8]), RuntimeError, r"len\(chunk_sizes\) = 1"),
    "scatter/chunk-sizes-negative": (
        lambda: comm.scatter(x8(), CPU2, [9, -1]),
        RuntimeError,
        r"chunk_sizes\[1\] is -1",
    ),
    "scatter/chunk-sizes-sum": (lambda: comm.scatter(x8(), CPU2, [3, 3]), RuntimeError, "chunk_sizes to sum to 8"),
    "scatter/0-dim": (lambda: comm.scatter(torch.tensor(1.0), CPU2), RuntimeError, "0-dim"),
    "scatter/dim": (lambda: comm.scatter(x8(), CPU2, dim=1), IndexError, "Dimension out of range"),
    "scatter/streams-length": (
        lambda: comm.scatter(x8(), CPU2, streams=[None]),
        RuntimeError,
        "one entry of 'streams' per device",
    ),
    "scatter/device-type": (lambda: comm.scatter(x8(), ["cpu", None]), TypeError, r"devices\[1\]: expected a device"),
    "scatter/out-not-tensor": (
        lambda: comm.scatter(x8(), out=[torch.empty(4), 4]),
        TypeError,
        r"out\[1\]: expected a tensor",
    ),
    "scatter/out-dtype": (
        lambda: comm.scatter(x8(), out=[torch.empty(4, dtype=torch.half), torch.empty(4)]),
        RuntimeError,
        r"out\[0\] of dtype Float",
    ),
    "scatter/out-total": (
        lambda: comm.scatter(x8(), out=[torch.empty(4), torch.empty(3)]),
        RuntimeError,
        r"output tensors along dim 0 \(7\)",
    ),
    # this task: sparse inputs and outputs
    "scatter/sparse": (
        lambda: comm.scatter(coo(), CPU2),
        RuntimeError,
        "'tensor' has layout Sparse: dpcore's scatter and gather take dense",
    ),
    "scatter/sparse-out-form": (
        lambda: comm.scatter(coo(), out=[torch.empty(2, 4), torch.empty(2, 4)]),
        RuntimeError,
        "'tensor' has layout Sparse",
    ),
    "scatter/sparse-out": (
        lambda: comm.scatter(torch.eye(4), out=[torch.empty(2, 4), torch.empty(2, 4).to_sparse()]),
        RuntimeError,
        r"out\[1\] has layout Sparse",
    ),
    # this task: outs overlapping the input or each other
    "scatter/out-is-part-of-tensor": (
        lambda: (lambda x: comm.scatter(x, out=[torch.empty(4), x[:4]]))(x8()),
        RuntimeError,
        r"out\[1\] and 'tensor' overlap in memory \(partly\)",
    ),
    "scatter/out-is-tensor": (
        lambda: (lambda x: comm.scatter(x, out=[x]))(x8()),
        RuntimeError,
        r"out\[0\] and 'tensor' overlap in memory \(fully\)",
    ),
    "scatter/outs-overlap": (_scatter_outs_overlap, RuntimeError, r"out\[1\] and out\[0\] overlap in memory"),
    "scatter/out-internal-overlap": (
        lambda: comm.scatter(x8(), out=[torch.empty(1).expand(4), torch.empty(4)]),
        RuntimeError,
        r"out\[0\] has internal overlap",
    ),
    # --------------------------------------------------------------- gather
    "gather/empty": (lambda: comm.gather([]), RuntimeError, "at least one tensor to gather"),
    "gather/single-tensor": (lambda: comm.gather(t23()), TypeError, "tensors: expected a sequence"),
    "gather/not-tensor": (lambda: comm.gather([t23(), 1]), TypeError, r"tensors\[1\]: expected a tensor"),
    "gather/dtype": (lambda: comm.gather([t23(), t23().long()]), RuntimeError, r"tensors\[1\] is Long"),
    "gather/shape": (
        lambda: comm.gather([t23(), torch.zeros(2, 4)]),
        RuntimeError,
        "input tensor at index 1 has invalid shape",
    ),
    "gather/0-dim": (lambda: comm.gather([torch.tensor(1.0)]), RuntimeError, r"tensors\[0\] is 0-dim"),
    "gather/destination-with-out": (
        lambda: comm.gather([t23()], destination="cpu", out=t23()),
        RuntimeError,
        "'destination' must not be specified",
    ),
    "gather/destination-type": (
        lambda: comm.gather([t23()], destination=2.0),
        TypeError,
        "destination: expected a device",
    ),
    "gather/destination-invisible": (
        lambda: comm.gather([t23()], destination=INVISIBLE_CUDA),
        RuntimeError,
        r"destination\[0\] is cuda",
    ),
    "gather/out-shape": (
        lambda: comm.gather([t23(), t23()], out=torch.empty(4, 4)),
        RuntimeError,
        r"'out' of shape \[4, 3\]",
    ),
    "gather/out-dtype": (
        lambda: comm.gather([t23()], out=torch.empty(2, 3, dtype=torch.half)),
        RuntimeError,
        "'out' of dtype Float",
    ),
    # this task: sparse inputs and outputs
    "gather/sparse": (
        lambda: comm.gather([torch.eye(4), coo()]),
        RuntimeError,
        r"tensors\[1\] has layout Sparse: dpcore's scatter and gather",
    ),
    "gather/sparse-out": (
        lambda: comm.gather([torch.eye(4), torch.eye(4)], out=torch.zeros(8, 4).to_sparse()),
        RuntimeError,
        "'out' has layout Sparse",
    ),
    # this task: out overlapping the inputs
    "gather/out-overlaps-inputs": (
        lambda: (lambda x: comm.gather([x[4:], x[:4]], out=x))(x8()),
        RuntimeError,
        r"'out' and tensors\[0\] overlap in memory \(partly\)",
    ),
    "gather/out-is-input": (
        lambda: (lambda x: comm.gather([x], out=x))(x8()),
        RuntimeError,
        r"'out' and tensors\[0\] overlap in memory \(fully\)",
    ),
    "gather/out-overlaps-second-input": (
        lambda: (lambda x: comm.gather([torch.zeros(4), x[2:6]], out=x))(x8()),
        RuntimeError,
        r"'out' and tensors\[1\] overlap",
    ),
    "gather/out-internal-overlap": (
        lambda: comm.gather([t23(), t23()], out=torch.empty(1, 3).expand(4, 3)),
        RuntimeError,
        "'out' has internal overlap",
    ),
    # ---------------------------------------------------- DataParallel init
    "DataParallel/module": (
        lambda: dpcore.DataParallel(lambda x: x, CPU2),
        TypeError,
        "module: expected a torch.nn.Module",
    ),
    "DataParallel/no-devices": (
        lambda: dpcore.DataParallel(linear(), []),
        ValueError,
        "device_ids: expected at least one device",
    ),
    "DataParallel/mixed-devices": (
        lambda: dpcore.DataParallel(linear(), ["cpu", "meta"]),
        ValueError,
        "device_ids: expected devices of one type",
    ),
    "DataParallel/device-type": (
        lambda: dpcore.DataParallel(linear(), ["cpu", 2.5]),
        TypeError,
        r"device_ids\[1\]: expected a device",
    ),
    "DataParallel/device-unsupported": (
        lambda: dpcore.DataParallel(nn.Linear(2, 2, device="meta"), ["meta"]),
        ValueError,
        r"device_ids\[0\]: unsupported device type 'meta'",
    ),
    "DataParallel/device-invisible": (
        lambda: dpcore.DataParallel(linear(), [INVISIBLE_CUDA]),
        ValueError,
        r"device_ids\[0\] is cuda:\d+, but only \d+ CUDA device",
    ),
    "DataParallel/module-elsewhere": (
        lambda: dpcore.DataParallel(nn.Linear(2, 2, device="meta"), CPU2),
        RuntimeError,
        r"\(device_ids\[0\]\)",
    ),
    "DataParallel/chunk-sizes-length": (
        lambda: dp(chunk_sizes=[1, 2]),
        ValueError,
        r"chunk_sizes: expected one size per device \(4\)",
    ),
    "DataParallel/weights-length": (
        lambda: dp(weights=[1.0]),
        ValueError,
        r"weights: expected one weight per device \(4\)",
    ),
    # this task: output_device checked at construction
    "DataParallel/output-device-invisible": (
        lambda: dp(output_device=INVISIBLE_CUDA),
        ValueError,
        r"output_device is cuda:\d+, but only \d+ CUDA device",
    ),
    "DataParallel/output-device-invisible-criterion": (
        lambda: dp(output_device=INVISIBLE_CUDA, criterion=nn.MSELoss()),
        ValueError,
        "output_device is cuda",
    ),
    "DataParallel/output-device-unsupported": (
        lambda: dp(output_device="meta"),
        ValueError,
        "output_device: unsupported device type 'meta'",
    ),
    "DataParallel/output-device-type": (lambda: dp(output_device=1.5), TypeError, "output_device: expected a device"),
    "DataParallel/output-device-negative": (
        lambda: dp(output_device=-2),
        ValueError,
        "output_device: expected a non-negative",
    ),
    # this task: bucket_bytes as comm's buffer_size
    "DataParallel/bucket-bytes-0": (
        lambda: dp(bucket_bytes=0),
        ValueError,
        "bucket_bytes: expected a positive number of bytes",
    ),
    "DataParallel/bucket-bytes-negative": (
        lambda: dp(bucket_bytes=-4096),
        ValueError,
        "bucket_bytes: expected a positive number of bytes",
    ),
    "DataParallel/bucket-bytes-bool": (
        lambda: dp(bucket_bytes=True),
        TypeError,
        "bucket_bytes: expected an int, but got bool",
    ),
    "DataParallel/bucket-bytes-float": (
        lambda: dp(bucket_bytes=4096.0),
        TypeError,
        "bucket_bytes: expected an int, but got float",
    ),
    "DataParallel/bucket-bytes-str": (
        lambda: dp(bucket_bytes="4MiB"),
        TypeError,
        "bucket_bytes: expected an int, but got str",
    ),
    # ------------------------------------------------- DataParallel forward
    "DataParallel/batch-mismatch": (
        lambda: dp()(torch.zeros(8, 3), torch.zeros(7, 3)),
        ValueError,
        r"inputs\[1\] has size 7 .* inputs\[0\] has size 8",
    ),
    # a 0-dim input goes whole to every replica; a size that is neither the batch nor the replica count is an error
    "DataParallel/size-not-batch-nor-replicas": (
        lambda: dp()(torch.zeros(8, 3), torch.zeros(3, 1)),
        ValueError,
        r"inputs\[1\] has size 3 along dim 0 but inputs\[0\] has size 8: .* the number of replicas used \(4 for a batch of 8\)",
    ),
    "DataParallel/device-count-rows-that-differ-when-fewer-replicas": (
        lambda: dp()(torch.zeros(3, 3), torch.arange(4.0).reshape(4, 1)),
        ValueError,
        r"inputs\[1\] has size 4 along dim 0, one row per device, but the batch runs on 3 replica\(s\), and its "
        r"rows differ",
    ),
    "DataParallel/neither-batch-nor-replicas-nor-devices": (
        lambda: dp()(torch.zeros(3, 3), torch.zeros(5, 1)),
        ValueError,
        r"inputs\[1\] has size 5 along dim 0 but inputs\[0\] has size 3: .* \(3 for a batch of 3\)",
    ),
    "DataParallel/criterion-function-undeclared": (
        lambda: dp(criterion=lambda out, y: (out - y).pow(2).mean()),
        TypeError,
        r"criterion: dpcore cannot tell whether '.*<lambda>' averages or sums .* criterion_reduction='mean'",
    ),
    "DataParallel/dim": (
        lambda: dp(dim=2)(torch.zeros(8, 3)),
        ValueError,
        r"inputs\[0\] has 2 dimensions and cannot be split along dim 2",
    ),
    "DataParallel/chunk-sizes-sum": (
        lambda: dp(chunk_sizes=[1, 1, 1, 1])(torch.zeros(8, 3)),
        ValueError,
        "chunk_sizes: expected sizes summing to the batch size 8",
    ),
    # this task: an empty first device shows the computed split
    "DataParallel/weights-empty-device0": (
        lambda: dp(weights=[0.1, 1, 1, 1])(torch.zeros(3, 3)),
        ValueError,
        r"weights: the first device .* must get a non-empty chunk, but weights=\[0\.1, 1\.0, 1\.0, 1\.0\] split the batch of 3 into \[0, 1, 1, 1\]",
    ),
    "DataParallel/chunk-sizes-empty-device0": (
        lambda: dp(chunk_sizes=[0, 4, 2, 2])(torch.zeros(8, 3)),
        ValueError,
        r"chunk_sizes: the first device .* but chunk_sizes=\[0, 4, 2, 2\] split the batch of 8 into \[0, 4, 2, 2\]",
    ),
    # this task: sparse inputs
    "DataParallel/sparse-input": (
        lambda: dp()(coo()),
        ValueError,
        r"inputs\[0\] is a torch.sparse_coo tensor and cannot be split",
    ),
    "DataParallel/sparse-kwarg": (
        lambda: dpcore.DataParallel(ReturnsPerDevice(lambda y: y), CPU4)(torch.zeros(4, 3), mask=coo()),
        ValueError,
        r"kwargs\['mask'\] is a torch.sparse_coo tensor",
    ),
    "DataParallel/sparse-nested-input": (
        lambda: dp()([torch.zeros(4, 3), {"m": csr()}]),
        ValueError,
        r"inputs\[0\]\[1\]\['m'\] is a torch.sparse_csr tensor",
    ),
    "DataParallel/sparse-output": (
        lambda: dpcore.DataParallel(ReturnsPerDevice(lambda y: y.to_sparse()), CPU2)(torch.zeros(4, 3)),
        RuntimeError,
        r"output: .*tensors\[0\] has layout Sparse",
    ),
    # this task: criterion must return a scalar
    "DataParallel/criterion-not-scalar-batch-8": (
        lambda: dp(criterion=nn.MSELoss(reduction="none"))(torch.zeros(8, 3), torch.zeros(8, 2)),
        ValueError,
        r"criterion: expected a scalar \(0-dim\) loss from every replica, because .* weighted by chunk size .* replica 0 \(on cpu\) returned a loss of shape \[2, 2\]",
    ),
    "DataParallel/criterion-not-scalar-batch-7": (
        lambda: dp(criterion=nn.MSELoss(reduction="none"))(torch.zeros(7, 3), torch.zeros(7, 2)),
        ValueError,
        r"replica 0 \(on cpu\) returned a loss of shape \[2, 2\]",
    ),
    "DataParallel/criterion-not-scalar-one-replica": (
        lambda: dp(criterion=nn.MSELoss(reduction="none"))(torch.zeros(1, 3), torch.zeros(1, 2)),
        ValueError,
        r"replica 0 \(on cpu\) returned a loss of shape \[1, 2\]",
    ),
    "DataParallel/criterion-shape-1": (
        lambda: dp(criterion=lambda out, y: (out - y).pow(2).mean().reshape(1), criterion_reduction="mean")(
            torch.zeros(8, 3), torch.zeros(8, 2)
        ),
        ValueError,
        r"returned a loss of shape \[1\]",
    ),
    "DataParallel/criterion-not-tensor": (
        lambda: dp(criterion=lambda out, y: 0.5, criterion_reduction="mean")(torch.zeros(8, 3), torch.zeros(8, 2)),
        TypeError,
        r"replica 0 \(on cpu\) returned float",
    ),
    "DataParallel/criterion-no-target": (
        lambda: dp(criterion=nn.MSELoss())(),
        TypeError,
        "expects the target as the last positional argument",
    ),
    "DataParallel/output-structure": (
        lambda: dpcore.DataParallel(ReturnsPerDevice(lambda y: y if y.shape[0] > 1 else None), CPU2)(torch.zeros(3, 3)),
        ValueError,
        r"output of replica 1 is None but replica 0's is a tensor",
    ),
    # -------------------------------------------------------- data_parallel
    "data_parallel/no-devices": (
        lambda: dpcore.data_parallel(linear(), torch.zeros(2, 3), []),
        ValueError,
        "device_ids: expected at least one device",
    ),
    "data_parallel/output-device": (
        lambda: dpcore.data_parallel(linear(), torch.zeros(2, 3), CPU2, INVISIBLE_CUDA),
        ValueError,
        "output_device is cuda",
    ),
    "data_parallel/module-kwargs": (
        lambda: dpcore.data_parallel(linear(), torch.zeros(2, 3), CPU2, module_kwargs=[1]),
        TypeError,
        "module_kwargs: expected a mapping",
    ),
    "data_parallel/unknown-option": (
        lambda: dpcore.data_parallel(linear(), torch.zeros(2, 3), CPU2, chunks=2),
        TypeError,
        "chunks",
    ),
    "data_parallel/bucket-bytes": (
        lambda: dpcore.data_parallel(linear(), torch.zeros(2, 3), CPU2, bucket_bytes=0),
        ValueError,
        "bucket_bytes",
    ),
    # ------------------------------------------------------- parallel_apply
    "parallel_apply/inputs-length": (
        lambda: dpcore.parallel_apply([linear(), linear()], [torch.zeros(1, 3)]),
        ValueError,
        r"one input per module \(2\), but got 1",
    ),
    "parallel_apply/kwargs-length": (
        lambda: dpcore.parallel_apply([linear()], [torch.zeros(1, 3)], [{}, {}]),
        ValueError,
        r"one kwargs dict per module \(1\), but got 2",
    ),
    "parallel_apply/devices-length": (
        lambda: dpcore.parallel_apply([linear()], [torch.zeros(1, 3)], None, CPU2),
        ValueError,
        r"one device per module \(1\), but got 2",
    ),
    "parallel_apply/device-type": (
        lambda: dpcore.parallel_apply([linear(), linear()], [torch.zeros(1, 3)] * 2, None, ["cpu", 0.5]),
        TypeError,
        r"devices\[1\]: expected a device",
    ),
    "parallel_apply/not-callable": (
        lambda: dpcore.parallel_apply([linear(), 3], [torch.zeros(1, 3)] * 2),
        TypeError,
        r"'int' object is not callable",
    ),
    # ------------------------------------------------------------ replicate
    "replicate/single-device": (
        lambda: dpcore.replicate(linear(), "cpu"),
        TypeError,
        "devices: expected a list of devices",
    ),
    "replicate/device-type": (
        lambda: dpcore.replicate(linear(), ["cpu", {}]),
        TypeError,
        r"devices\[1\]: expected a device",
    ),
    "replicate/module-elsewhere": (
        lambda: dpcore.replicate(nn.Linear(2, 2, device="meta"), CPU2),
        RuntimeError,
        r"\(devices\[0\]\)",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_naming_the_argument(name: str) -> None:
    call, exception, pattern = CASES[name]
    with pytest.raises(exception) as info:
        call()
    assert type(info.value) is exception, (
        f"{name}: expected {exception.__name__}, got {type(info.value).__name__}: {info.value}"
    )
    message = " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert re.search(pattern, message, flags=re.S), f"{name}: {pattern!r} not found in {message!r}"


def test_rejected_out_is_left_untouched() -> None:
    # The overlap checks run before anything is written.
    x = x8()
    with pytest.raises(RuntimeError, match="overlap"):
        comm.gather([x[4:], x[:4]], out=x)
    assert torch.equal(x, x8())
    x = x8()
    other = torch.full((4,), -1.0)
    with pytest.raises(RuntimeError, match="overlap"):
        comm.scatter(x, out=[other, x[:4]])
    assert torch.equal(x, x8()) and torch.equal(other, torch.full((4,), -1.0))


def test_valid_out_next_to_the_input_is_accepted() -> None:
    # Disjoint parts of one buffer are fine: no false positives.
    buf = torch.arange(16.0)
    src, dst = buf[:8], buf[8:]
    comm.gather([src[4:], src[:4]], out=dst)
    assert torch.equal(dst, torch.cat([torch.arange(4.0, 8.0), torch.arange(4.0)]))
    grid = torch.zeros(4, 6)
    comm.scatter(torch.arange(24.0).reshape(4, 6), dim=1, out=[grid[:, :2], grid[:, 2:]])
    assert torch.equal(grid, torch.arange(24.0).reshape(4, 6))
    columns = torch.arange(16.0).reshape(4, 4)
    out = torch.zeros(4, 4)
    comm.gather([columns[:, 2:], columns[:, :2]], dim=1, out=out)
    assert torch.equal(out, torch.cat([columns[:, 2:], columns[:, :2]], dim=1))


def test_interleaved_views_whose_overlap_is_undecidable_give_right_values() -> None:
    # Non-dense views of the out's own storage (torch.cat(out=) lets these
    # through and can compute wrong values): read from a copy, so the result
    # is the concatenation of the inputs as they were.
    x = torch.arange(16.0).reshape(4, 4)
    original = x.clone()
    assert comm.gather([x[:, 2:], x[:, :2]], dim=1, out=x) is x
    assert torch.equal(x, torch.cat([original[:, 2:], original[:, :2]], dim=1))
    grid = torch.arange(8.0).reshape(4, 2)
    original = grid.clone()
    comm.scatter(grid, dim=1, out=[grid[:, 1:], grid[:, :1]])
    assert torch.equal(grid, original.flip(1))


def test_sparse_broadcast_and_reduce_add_still_work() -> None:
    # What the sparse message points to: broadcast and reduce_add take COO.
    s = coo()
    copies = comm.broadcast(s, CPU2)
    assert copies[0] is s and torch.equal(copies[1].to_dense(), torch.eye(4))
    assert torch.equal(comm.reduce_add([s, s]).to_dense(), 2 * torch.eye(4))
    (summed,) = comm.reduce_add_coalesced([[s], [s]])
    assert torch.equal(summed.to_dense(), 2 * torch.eye(4))
    out = dpcore.DataParallel(ReturnsPerDevice(lambda y: y), CPU2)(torch.ones(4, 3), mask=dpcore.Broadcast(s))
    assert out.shape == (4, 3)
