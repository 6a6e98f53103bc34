"""Cached, exact replicas of a module on a list of devices.

torch.nn.DataParallel rebuilds every replica module and allocates fresh
parameter copies every step, in Python. dpcore keeps, per device, the replica
module objects and one persistent flat buffer per parameter bucket
(``dpcore._C.BucketReplicas``): each step only re-syncs the replicas'
attribute dicts from the master's and refreshes the buffers in C++, skipping
buckets whose master tensors did not change. Replica 0 is the master module
itself, so its gradients, hooks and in-place buffer updates (BatchNorm
statistics) act on the master directly.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from dpcore import _C
from dpcore._devices import DeviceLike, as_devices
from dpcore._functions import BroadcastBucket

__all__ = ["replicate", "check_on_device", "ReplicaCache", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024



@contextlib.contextmanager
def _normal_mode() -> Iterator[None]:
    """Outside inference mode (without grad) where the caller is inside it:
    the persistent buffers and the copies viewing them must be normal tensors
    (inference tensors have no version counter and cannot be updated in place
    once inference mode is left)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            yield
    else:
        yield


def _hook_dict_names(module: nn.Module) -> list[str]:
    """Names of the hook registries (dicts) in a module's __dict__."""
    return [k for k, v in module.__dict__.items() if "hook" in k and isinstance(v, dict)]


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` grouped by (dtype, requires_grad) into buckets of
    about `bucket_bytes`, in order."""
    open_: dict[tuple[torch.dtype, bool], list[int]] = {}
    sizes: dict[tuple[torch.dtype, bool], int] = {}
    buckets: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.requires_grad)
        if key not in open_:
            open_[key] = []
            sizes[key] = 0
            buckets.append(open_[key])
        open_[key].append(i)
        sizes[key] += t.numel() * t.element_size()
        if sizes[key] >= bucket_bytes:
            del open_[key]
    return buckets


class ReplicaCache:
    """Replicas of `module` for ``devices[1:]``, kept across calls.

    Guarantees:

    * ``replicas(n)`` returns n modules: the master itself, then replicas on
      devices[1..n-1], whose parameters and buffers equal the master's at the
      time of the call and whose gradients flow to the master's parameters
      through autograd (``backward``, ``autograd.grad``, double backward).
    * Attribute changes and train/eval switches on the master reach every
      replica at the next call; hooks registered on a replica stay there.
    * A structural change of the master (a parameter or buffer added,
      removed, replaced, frozen or unfrozen, converted to another dtype,
      device or shape, a submodule swapped) is detected and the cache
      rebuilt (``valid()`` returns False until then).
    * Works under ``torch.inference_mode()``: the buffers and copies are
      normal tensors, usable by later steps outside inference mode.
    * ``replicas()`` may be called from several threads: calls are
      serialized, and each returns a consistent set. The replica modules are
      shared by every call, though: a caller that runs them while another
      thread calls ``replicas()`` must serialize the two (DataParallel does:
      it holds its own lock from ``replicas()`` until its replicas return).
    """

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.module = module
        self._lock = threading.Lock()
        self.devices = list(devices)
        self.targets = self.devices[1:]
        self.masters: list[nn.Module] = list(module.modules())
        self._index = {id(m): i for i, m in enumerate(self.masters)}
        self._structure = _C.StructureSignature(self.masters)
        # Unique tensors (shared parameters appear once), and where each sits.
        self.tensors: list[torch.Tensor] = []
        self._slots: list[tuple[int, str, str, int]] = []  # (module index, kind, name, tensor index)
        seen: dict[int, int] = {}
        for mi, m in enumerate(self.masters):
            for kind in ("_parameters", "_buffers"):
                for name, t in m.__dict__[kind].items():
                    if t is None:
                        self._slots.append((mi, kind, name, -1))
                        continue
                    if id(t) not in seen:
                        seen[id(t)] = len(self.tensors)
                        self.tensors.append(t)
                    self._slots.append((mi, kind, name, seen[id(t)]))
        self._is_param = [False] * len(self.tensors)
        for mi, kind, _, ti in self._slots:
            if kind == "_parameters" and ti >= 0:
                self._is_param[ti] = True
        self._bucket_indices = _buckets(self.tensors, bucket_bytes) if self.targets else []
        with _normal_mode():
            self._buckets = [
                _C.BucketReplicas([self.tensors[i] for i in b], self.targets) for b in self._bucket_indices
            ]
        self._hook_names = [_hook_dict_names(m) for m in self.masters]
        # replicas[j][mi]: the replica of master module mi on targets[j].
        self.replica_modules: list[list[nn.Module]] = []
        for _ in self.targets:
            mods = [m._replicate_for_data_parallel() for m in self.masters]
            self.replica_modules.append(mods)
        # The per-step refresh of the replica modules runs in C++.
        self._plan = _C.ReplicaSyncPlan(
            self.masters,
            self._hook_names,
            [list(getattr(m, "_replica_private_attrs", ())) for m in self.masters],
            [
                [(name, -1 if child is None else self._index[id(child)]) for name, child in m._modules.items()]
                for m in self.masters
            ],
            [(mi, 0 if kind == "_parameters" else 1, name, ti) for mi, kind, name, ti in self._slots],
        )

    def valid(self) -> bool:
        """False when the master's structure changed since the cache was built:
        a parameter, buffer or child added, removed or replaced, or a tensor's
        dtype, device, shape or requires_grad changed (checked in C++)."""
        return self._structure.matches(self.masters)

    def replicas(self, n: int) -> list[nn.Module]:
        """The master plus n-1 refreshed replicas (see the class guarantees)."""
        with self._lock:
            return self._refresh(n)

    def _refresh(self, n: int) -> list[nn.Module]:
        if n < 1 or n > len(self.devices):
            raise ValueError(f"replicas: expected 1 <= n <= {len(self.devices)}, but got {n}")
        if n == 1:
            return [self.module]
        grad_enabled = torch.is_grad_enabled()
        copies: list[list[torch.Tensor | None]] = [[None] * len(self.tensors) for _ in self.targets]
        with _normal_mode():
            for replicas, indices in zip(self._buckets, self._bucket_indices):
                masters = [self.tensors[i] for i in indices]
                if grad_enabled and masters[0].requires_grad:
                    flat = BroadcastBucket.apply(replicas, *masters)
                else:
                    flat = [t for group in replicas.refresh(masters) for t in group]
                k = len(indices)
                for j in range(len(self.targets)):
                    for pos, i in enumerate(indices):
                        copies[j][i] = flat[j * k + pos]
        result: list[nn.Module] = [self.module]
        for j in range(n - 1):
            mods = self.replica_modules[j]
            self._plan.sync(mods, copies[j])
            result.append(mods[0])
        return result


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """torch.nn.parallel.replicate's contract: one module per device.

    The first is ``network`` itself (which must sit on devices[0]); the others
    are module objects whose parameters and buffers are copies, made by a
    differentiable broadcast so that gradients reach ``network``'s
    parameters, unless ``detach`` (then copies without autograd history).
    """
    devs = as_devices(devices, "devices")
    if not devs:
        return []
    check_on_device(network, devs[0], "devices[0]")
    cache = ReplicaCache(network, devs)
    if detach:
        with torch.no_grad():
            return cache.replicas(len(devs))
    return cache.replicas(len(devs))


def check_on_device(module: nn.Module, device: torch.device, arg: str) -> None:
    """Raises RuntimeError unless every parameter and buffer of `module` is on `device`."""
    for t in module.parameters():
        _check_tensor_device(t, device, arg)
    for t in module.buffers():
        _check_tensor_device(t, device, arg)


def _check_tensor_device(t: torch.Tensor, device: torch.device, arg: str) -> None:
    found = torch.device("cpu") if t.device.type == "cpu" else t.device
    if found != device:
        raise RuntimeError(
            f"module must have its parameters and buffers on device {device} ({arg}) "
            f"but found one of them on device: {t.device}"
        )
