# Types of dpcore._C, the C++ extension (bindings in csrc/python/*.cpp).
# Import it as `from dpcore._loader import _C`, which checks the build first.
# tests/test_layout.py compares this stub with the built module: every name and
# every parameter name here is one the extension has, and the reverse.

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# -- build facts (csrc/python/module.cpp) -------------------------------------

#: Whether the extension was compiled with CUDA (DPCORE_WITH_CUDA).
with_cuda: bool
#: The torch version the extension was compiled against (TORCH_VERSION).
torch_version: str
#: The CUDA architectures compiled, e.g. ["9.0"]; empty in a CPU build.
cuda_arch_list: list[str]
#: dpcore::kDefaultBucketBytes: the bucket size of the coalesced collectives.
default_bucket_bytes: int

def _self_check() -> str:
    """The message of a C++ error raised and caught inside _C, with numbers formatted into it."""

# -- collectives (csrc/dpcore/comm/; the public API is dpcore.comm) -----------

def broadcast(tensor: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]: ...
def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> None: ...
def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device], bucket_bytes: int
) -> list[list[torch.Tensor]]:
    """result[d][i]: tensors[i] on devices[d]."""

def reduce_add(inputs: Sequence[torch.Tensor], destination: torch.device | None) -> torch.Tensor: ...
def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]],
    destination: torch.device | None,
    bucket_bytes: int,
    slots: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """inputs[d][i]: tensor i on device d; result[i]: their sum on `destination`; `slots`: each list's position
    for the traffic counts (the destination's is 0)."""

def scatter(
    tensor: torch.Tensor,
    devices: Sequence[torch.device],
    chunk_sizes: Sequence[int] | None,
    dim: int,
    streams: Sequence[torch.Stream | None] | None,
    separate: bool = False,
) -> list[torch.Tensor]:
    """With `separate`, the chunks on the tensor's device share its storage but are no views, and all but
    the first have their own version counter (DataParallel's chunks); else they are views."""

def scatter_out(
    tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int, streams: Sequence[torch.Stream | None] | None
) -> None: ...
def gather(tensors: Sequence[torch.Tensor], dim: int, destination: torch.device | None) -> torch.Tensor: ...
def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> None: ...
def reduce_scatter(
    inputs: Sequence[torch.Tensor], devices: Sequence[torch.device], sizes: Sequence[int] | None
) -> list[torch.Tensor]: ...
def all_gather(shards: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> list[torch.Tensor]: ...
def all_gather_out(shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None: ...
def all_reduce(inputs: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> None: ...
def reduce_scatter_coalesced(
    tensors: Sequence[Sequence[torch.Tensor]], devices: Sequence[torch.device], owners: Sequence[int], bucket_bytes: int
) -> list[torch.Tensor]:
    """tensors[j][k]: tensor k on device j; result[k]: their sum on devices[owners[k]]."""

def all_gather_coalesced(
    tensors: Sequence[torch.Tensor],
    owners: Sequence[int],
    devices: Sequence[torch.device],
    outs: Sequence[Sequence[torch.Tensor]] | None,
    bucket_bytes: int,
) -> list[list[torch.Tensor]]:
    """result[d][k]: tensors[k] (on devices[owners[k]]) on devices[d], or outs with the values written."""

# -- the split arithmetic (csrc/python/split.cpp) ------------------------------

def split_sizes(
    batch: int, n_devices: int, chunk_sizes: Sequence[int] | None, weights: Sequence[float] | None
) -> list[int]:
    """Each device's rows of `batch`: chunk_sizes as given, in proportion to weights (exact largest remainder), else
    balanced (csrc/dpcore/split.h)."""

def plan_split(
    entries: Sequence[tuple[Any, int | None]],
    n_devices: int,
    chunk_sizes: Sequence[int] | None,
    weights: Sequence[float] | None,
    dim: int,
    units: Sequence[tuple[Any, int, Any]],
    hint: Any,
) -> tuple[int | None, list[int], int]:
    """(batch, sizes, replicas) of one call's scatter (dpcore._split.plan_split's rules); a ValueError naming two
    paths where no size is the batch."""

def traffic() -> dict[str, list[tuple[int, int]]]:
    """{kind: [(bytes sent, bytes received) per slot]} of every collective since the last reset."""

def reset_traffic() -> None: ...
def balanced_chunk_sizes(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes differing by at most one, the larger first."""

# -- buckets, the host cache, peer access -------------------------------------

def make_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` grouped as the C++ core buckets them."""

def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...
def host_cache_stats() -> dict[str, int]:
    """{"cached_bytes", "hits", "misses"} of the caching allocator for large CPU buffers."""

def host_cache_clear() -> None: ...
def peer_access(devices: Sequence[torch.device]) -> dict[tuple[int, int], bool]:
    """{(reader, owner): whether kernels on CUDA device `reader` read `owner`'s memory directly}."""

# -- parallel_apply on the worker pool (csrc/python/parallel_apply.cpp) --------

class GradReadiness:
    """Counts, in C++, the parameters of each gradient bucket whose gradient a
    backward accumulated (csrc/dpcore/grad_ready.h): calls `on_begin()` once
    per synchronizing backward and `on_ready(prefix)` when the buckets
    `order[:prefix]` are complete."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        bucket_of: Sequence[int],
        order: Sequence[int],
        on_begin: Callable[[], None],
        on_ready: Callable[[int], None],
    ) -> None: ...
    def arm(self, armed: bool, deferred: bool) -> None:
        """Whether the next backward synchronizes; whether launches wait for the final callback."""

    def reset(self) -> None:
        """No synchronizing backward in progress."""

    @property
    def task(self) -> int:
        """The graph task of the synchronizing backward in progress, -1 if none."""

    def remove(self) -> None:
        """Removes the hooks."""

class ParallelRun:
    """The calls started by start_parallel_apply."""

    def result(self) -> list[Any]:
        """Waits for every call; their results in order, or the error of the lowest failing index."""

    def join(self, timeout: float | None = None) -> bool:
        """Waits until every call returned or was skipped (at most `timeout` s); whether they have."""

    def cancel(self) -> None:
        """Calls not yet started will be skipped."""

    @property
    def done(self) -> bool: ...

def parallel_apply(
    callables: Sequence[Callable[..., Any]],
    args: Sequence[Sequence[Any]],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
    *,
    all_at_once: bool = False,
) -> list[Any]: ...
def start_parallel_apply(
    callables: Sequence[Callable[..., Any]],
    args: Sequence[Sequence[Any]],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
    *,
    all_at_once: bool = False,
) -> ParallelRun: ...
def replica_generator() -> torch.Generator | None:
    """This thread's stream generator inside a replica that has one, else None."""

def replica_seeds(devices: Sequence[torch.device]) -> list[int]:
    """Each call's stream seed for a parallel call on `devices` (every call, lone ones too), derived as the
    replicas' streams are: one number taken now per group sharing a default generator, then the position."""

def set_rng_state_functions(functions: list[tuple[Any, str, Callable[..., Any]]]) -> None:
    """(owner, name, function): owner.name is function while a replica with a random stream runs."""

def worker_thread_count() -> int: ...
def worker_pool_count() -> int: ...
def join_abandoned_runs() -> None:
    """Cancels unfinished abandoned runs and waits for their running calls (registered with atexit)."""

# -- replicas (csrc/python/replica_sync.cpp) ------------------------------------

class ReplicaBuffers:
    """Persistent per-device copies of one bucket of master tensors (built by ReplicaSet)."""

    def __init__(self, like: Sequence[torch.Tensor], targets: Sequence[torch.device]) -> None: ...
    def refresh(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Brings the buffers up to date; fresh views, device-major (tensors[i] on targets[d] at d * len + i)."""

    def update(self, tensors: Sequence[torch.Tensor]) -> None: ...
    def invalidate(self) -> None: ...
    def verify(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Indices of the entries whose replica bytes differ from `tensors` where no refresh would copy."""

    def write(self, target: int, entry: int, value: torch.Tensor, master: torch.Tensor) -> None:
        """Writes `value` into targets[target]'s copy of entry `entry`, which `master` now equals."""

    def views(self, target: int) -> list[torch.Tensor]:
        """Tensors viewing targets[target]'s copy of each entry, for a collective that writes them in place."""

    def mark_current(self, target: int, entries: Sequence[int], masters: Sequence[torch.Tensor]) -> None:
        """Marks targets[target]'s copies of `entries` equal to `masters` now: the next refresh leaves them."""

    @property
    def last_refresh_copied(self) -> bool: ...
    @property
    def last_copied_bytes(self) -> list[int]: ...

class ReplicaSet:
    """The cached replicas of one module on `targets`, refreshed by sync()."""

    def __init__(
        self,
        module: nn.Module,
        targets: Sequence[torch.device],
        bucket_bytes: int,
        replicate: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        """`replicate(master)` makes each replica module (default: its
        ``_replicate_for_data_parallel()``)."""
    def valid(self) -> bool:
        """Whether the masters' structure is still the one the set was built for."""

    def sync(self, rows: int, outputs: Sequence[Sequence[torch.Tensor] | None]) -> list[nn.Module]:
        """Refreshes rows 0..rows-1 from each bucket's copies (None: refreshed here); their root modules."""

    @property
    def buckets(self) -> list[tuple[ReplicaBuffers, list[torch.Tensor], bool]]:
        """(ReplicaBuffers, master tensors, requires_grad) for every bucket, in order."""

    @property
    def replica_modules(self) -> list[list[nn.Module]]:
        """rows[j][i]: the replica of module i on targets[j]."""

# -- synchronized BatchNorm (csrc/python/rendezvous.cpp) -------------------------

class SyncBatchNormError(RuntimeError):
    """A synchronized BatchNorm call could not complete (see dpcore.SyncBatchNormError)."""

class Rendezvous:
    """A per-call exchange between `participants` ranks (csrc/dpcore/rendezvous.h)."""

    def __init__(self, participants: int, timeout_s: float | None = None) -> None: ...
    def exchange(
        self, rank: int, key: str, tensors: Sequence[torch.Tensor], count: int
    ) -> tuple[list[list[torch.Tensor]], list[int]]:
        """Blocks until every rank reached this round with the same key: (tensors per rank, count per rank)."""

    def finish(self, rank: int) -> None: ...
    def fail(self, rank: int, reason: str) -> None: ...
    def abort(self, reason: str) -> None: ...
    @property
    def broken(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def culprit(self) -> int: ...
    @property
    def rounds(self) -> int: ...
    @property
    def participants(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...

def sync_batch_norm(
    rendezvous: Rendezvous,
    rank: int,
    key: str,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    update_running_stats: bool,
    momentum: float,
    eps: float,
    across: Callable[[str, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, int]] | None = None,
) -> torch.Tensor:
    """One replica's training-mode BatchNorm with the statistics of every replica's input; with
    `across`, rank 0 turns this process's statistics into those of every process through it."""

# -- PackedSequence index arithmetic (csrc/python/packed.cpp) -------------------

_Fields = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
_Layout = tuple[torch.Tensor, torch.Tensor, bool]

def packed_split(
    batch_sizes: torch.Tensor, sorted_indices: torch.Tensor | None, sizes: Sequence[int]
) -> tuple[_Layout, torch.Tensor, torch.Tensor | None, list[int], list[_Fields]]:
    """(layout (lengths, sorted_indices, given_sorted), order, back, rows, parts) of the split of a PackedSequence into
    its next sizes[j] sequences (csrc/dpcore/packed.h)."""

def packed_join(
    batch_sizes: Sequence[torch.Tensor], sorted_indices: Sequence[torch.Tensor | None], layouts: Sequence[_Layout]
) -> tuple[_Fields, torch.Tensor]:
    """((batch_sizes, sorted_indices, unsorted_indices), source) of the PackedSequences with these fields joined."""

def packed_output(
    parts: Sequence[torch.Tensor], dim: int, splits: Sequence[tuple[Any, ...]]
) -> tuple[str, int, int, int]:
    """(kind, split, field, other): the rule of one output of a call with PackedSequence inputs split as `splits`
    (dpcore._packed.Rows); kind: as_any, field, fields_differ, data, length_one or unfit."""
