"""dpcore.DataParallel: torch.nn.DataParallel over cached replicas, a C++ worker pool and CPU device lists. One
pipeline through torch's four extension points: ``scatter`` (the call's record), ``replicate``, ``parallel_apply``,
and the loss rule's combine through ``gather`` (docs/design.md, "Semantics")."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from dpcore import _integrations
from dpcore._devices import DeviceLike
from dpcore._dropin import DDP_ONLY, BareStateDict, NominalMeta, SignedForward, dcp_names, has_module_prefix
from dpcore._dropin import strip_module_prefix
from dpcore._graphs import GraphRunner
from dpcore._loss import LossRule
from dpcore._options import ATTRIBUTES, Options, check_options, check_write
from dpcore._pipeline import ParallelMethod, Pipeline, substituted
from dpcore._units import ShardedParameters
from dpcore.distributed import DataParallelJoinHook, GradientSync
from dpcore.parallel_apply import CallGuard
from dpcore.replicate import DEFAULT_BUCKET_BYTES, ReplicaCache

__all__ = ["DataParallel", "data_parallel", "functional_call"]

#: torch's own class, bound before dpcore.patch_torch can rebind torch's names.
TorchDataParallel = nn.DataParallel


class DataParallel(TorchDataParallel, Joinable, metaclass=NominalMeta):
    """Runs ``module`` on several devices in one process: the batch is split along ``dim``, each device runs a
    replica on its chunk, and the results are combined on ``output_device``. A drop-in for torch.nn.DataParallel
    and an instance of it; options and their rules: docs/. ``forward`` calls ``scatter``, ``replicate``,
    ``parallel_apply`` and ``gather`` with torch's signatures, so a subclass written for torch's wrapper works
    unchanged (an option that would skip an override is an error).

    Guarantees: outputs and gradients equal the single-device ones (up to summation order); a parameter no
    replica used keeps ``.grad`` None; the first replica is ``module`` itself; calls from several threads are
    serialized; after Ctrl-C reaches the caller, nothing this wrapper started still touches the module.
    """

    # Per-instance state a replica of this wrapper and a pickle never share (ReplicaSet reads this name).
    _replica_private_attrs = ("_cache", "_calls", "_graphs", "_pipeline", "_sink")

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        chunk_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        criterion: Callable[..., Any] | None = None,
        criterion_reduction: str | None = None,
        model_loss: str | None = None,
        loss_items: Callable[..., Any] | None = None,
        gather: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_batchnorm: bool = False,
        process_group: Any = None,
        forward_sync_buffers: bool | None = None,
        broadcast_buffers: bool | None = None,
        cuda_graphs: bool = False,
        replica_refresh: str = "auto",
        shard_gradients: bool = False,
        shard_parameters: Any = False,
        reshard_after_forward: bool = True,
    ) -> None:
        nn.Module.__init__(self)  # not torch's DataParallel.__init__ (it resolves CUDA indices, moves the module)
        Joinable.__init__(self)
        given = Options(**{k: v for k, v in locals().items() if k not in ("self", "module")})  # the options here
        options = check_options(type(self), DataParallel, module, given)
        self.__dict__.update(_fresh_private_state(cuda_graphs))  # cuda_graphs=True has devices
        self.module = module
        self._sync: GradientSync | None = None
        self._adopt(options, "module")
        if options.devices and process_group is not None:
            self._sync = GradientSync(module, options)

    def __setattr__(self, name: str, value: Any) -> None:
        # An option (or ``module``) written is checked with the others, as the constructor checks them, and what
        # was built from it rebuilt; torch's own __setattr__ would register a Module criterion past the property.
        field = ATTRIBUTES.get(name) if "_options" in self.__dict__ else None
        if field is None:
            super().__setattr__(name, value)
            return
        options = check_write(type(self), DataParallel, self.module, self._options, field, value)
        if field == "module":
            super().__setattr__(name, value)
        self._adopt(options, field)

    def _adopt(self, options: Options, changed: str) -> None:
        """Makes the checked `options` the wrapper's and rebuilds what is built from them: the loss rule, the CUDA
        graphs, the replica cache where `changed` shapes it; a Module criterion is a child, as torch would have it."""
        self._options, self._loss = options, LossRule(options)
        self._graphs = GraphRunner() if options.cuda_graphs else None
        if isinstance(self._cache, ShardedParameters):
            self._cache.reshard_after_forward = options.reshard_after_forward
        elif changed in (
            "module",
            "device_ids",
            "bucket_bytes",
            "replica_refresh",
            "shard_gradients",
            "shard_parameters",
        ):
            self._cache = None
        if options.shard_parameters is not False and len(options.devices) > 1 and self._cache is None:
            self._cache = ShardedParameters(
                self.module, options.devices, options.shard_parameters, options.reshard_after_forward
            )
        if changed == "module":
            self._input_check = _integrations.input_check(self.module)
        self._modules.pop("criterion", None)
        if isinstance(options.criterion, nn.Module):
            self._modules["criterion"] = options.criterion

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "_join_config", "_options", *self._replica_private_attrs):
                raise
            try:
                found = getattr(self.module, name)
            except AttributeError:
                if name not in DDP_ONLY:
                    raise
                raise AttributeError(
                    f"dpcore.DataParallel has no attribute {name!r} (nor has its module, a "
                    f"{type(self.module).__name__}): it is an attribute of torch.nn.parallel.DistributedDataParallel "
                    f"that dpcore's hybrid mode (process_group=) does not provide"
                ) from None
            return self.parallel(name) if name in _integrations.PARALLEL_BY_NAME else found

    def parallel(self, name: str, *, pad_value: float | None = None) -> Callable[..., Any]:
        """The module's method `name`, run data parallel as forward (no loss rule); outputs whose sizes differ beyond
        ``dim`` are padded with `pad_value`. ``dp.generate`` is one (docs/generate.md)."""
        return ParallelMethod(self, name, pad_value)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The bare module's state dict (no ``module.`` prefix; a read by torch's prefixed key is a KeyError that says
        so). With a ``destination``, the module's entries are written into it."""
        if args or kwargs.get("destination") is not None:
            return self.module.state_dict(*args, **kwargs)
        kwargs["destination"] = destination = BareStateDict()
        destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        return self.module.state_dict(**kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Loads a bare module's state dict, or one with torch's ``module.``
        keys; the next call copies every tensor to the replicas."""
        result = self.module.load_state_dict(strip_module_prefix(state_dict, self.module), strict=strict, assign=assign)
        if self._cache is not None:  # a module may load through .data
            self._cache.invalidate()
        return result

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # As a submodule: saved without "module.", loaded through self.module with prefix + "module.".
        keys = [k for k in state_dict if k.startswith(prefix)]
        if keys and not has_module_prefix([k[len(prefix) :] for k in keys], self.module):
            for k in keys:
                state_dict[prefix + "module." + k[len(prefix) :]] = state_dict.pop(k)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint's hook: the module's tensors keep their bare keys there (dcp_names)."""
        return dcp_names(self.module)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(self._replica_private_attrs)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.update(_fresh_private_state(self.cuda_graphs))

    def _replicate_for_data_parallel(self) -> DataParallel:
        replica = super()._replicate_for_data_parallel()
        replica.__dict__.update(_fresh_private_state(self.cuda_graphs))
        return replica

    @property
    def src_device_obj(self) -> torch.device | None:
        """torch's attribute: ``device_ids[0]`` (None where the module runs as is)."""
        return self.device_ids[0] if self.device_ids else None

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike]) -> Any:
        """torch's ``scatter``: the pair ``(inputs, kwargs)``, each replica's arguments split along ``dim`` by
        dpcore's rules (docs/design.md)."""
        return self._pipeline.scatter(self, inputs, kwargs, device_ids)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """torch's ``replicate``: one module per device, the first ``module`` itself (cached and refreshed for this
        wrapper's module on a leading part of its devices)."""
        return self._pipeline.replicate(self, module, device_ids)

    def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """torch's ``parallel_apply``: ``replicas[i](*inputs[i], **kwargs[i])``
        for every i at once on the worker pool; one replica runs in this thread."""
        return self._pipeline.parallel_apply(self, replicas, inputs, kwargs)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike | None) -> Any:
        """torch's ``gather``: the outputs joined along ``dim`` on
        ``output_device`` (:func:`dpcore.gather`), by the hints of the call's inputs."""
        return self._pipeline.gather(self, outputs, output_device)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._pipeline.run(self, inputs, kwargs)

    forward = SignedForward(forward)  # type: ignore[assignment]

    @property
    def replica_cache(self) -> ReplicaCache | None:
        """The replicas' cache, as the last call left it (never built here): None before the first call that
        replicates, and after a write of an option it is built from (the next call builds a new one)."""
        return self._cache

    @property
    def sharded_parameters(self) -> ShardedParameters | None:
        """With ``shard_parameters=`` over several devices, the parameters' placement, units and per-position bytes
        (docs/sharded_parameters.md); else None."""
        return self._cache if isinstance(self._cache, ShardedParameters) else None

    def mark_parameters_changed(self) -> None:
        """Makes the next forward copy every parameter and buffer to every replica: call it after writes that bypass
        version counters outside an optimizer step (``p.data.add_(...)``, numpy)."""
        with self._calls:
            if self._cache is not None:
                self._cache.invalidate()

    def _require_group(self, what: str, why: str = "there are no ranks to join") -> GradientSync:
        if self._sync is None:
            raise ValueError(
                f"{what}: needs a dpcore.DataParallel with a process_group= (hybrid mode); this one runs in one "
                f"process only, so {why}"
            )
        return self._sync

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook``: each gradient bucket is sent by ``hook(state, bucket)``, which returns a
        Future of the reduced gradient; torch's own hooks work. One hook, before the first backward."""
        sync = self._require_group("register_comm_hook", "there is no gradient communication to hook")
        sync.register_comm_hook(state, hook)

    def join_hook(self, **kwargs: Any) -> DataParallelJoinHook:
        """DDP's ``join_hook``: lets ranks that ran out of inputs shadow the
        others' collectives (``divide_by_initial_world_size``, default True)."""
        sync = self._require_group("Join")
        if sync.batchnorm_group is not None:
            raise ValueError(
                "Join: a rank that ran out of inputs cannot shadow the BatchNorm collectives of sync_batchnorm=True "
                "across processes (it does not run the model); give every rank the same number of batches "
                "(e.g. a DistributedSampler with drop_last=True), or drop sync_batchnorm"
            )
        return sync.join_hook(kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's collectives: the module's."""
        return self._require_group("Join").device

    @property
    def join_process_group(self) -> Any:
        """The process group of the join context's collectives: the hybrid mode's."""
        return self._require_group("Join").group

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """DDP's ``join()``: ``Join([self], ...)``."""
        self._require_group("join()")
        return Join(
            [self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: backward passes of forwards run inside
        accumulate ``.grad`` in this process only (without a process group, always)."""
        with contextlib.nullcontext() if self._sync is None else self._sync.no_sync():
            yield


# Each option's attribute (``dp.criterion``, ...) reads the one checked value: device_ids and output_device as resolved.
for _name, _field in {**ATTRIBUTES, "device_ids": "devices", "output_device": "out"}.items():
    if _name not in ("module", "forward_sync_buffers", "broadcast_buffers"):
        setattr(DataParallel, _name, property(attrgetter(f"_options.{_field}")))


def _fresh_private_state(cuda_graphs: bool) -> dict[str, Any]:
    """New values of DataParallel._replica_private_attrs."""
    graphs = GraphRunner() if cuda_graphs else None
    state = {"_cache": None, "_calls": CallGuard(), "_graphs": graphs, "_pipeline": Pipeline(DataParallel)}
    return {**state, "_sink": None}  # shard_gradients=True: a weak reference to the ShardedOptimizer that sums them


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """torch.nn.parallel.data_parallel: ``module(*inputs, **module_kwargs)``
    in parallel over ``device_ids``, by a one-off DataParallel."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if module_kwargs is not None and not isinstance(module_kwargs, Mapping):
        raise TypeError(
            f"module_kwargs: expected a mapping of keyword arguments, but got {type(module_kwargs).__name__}"
        )
    return DataParallel(module, device_ids, output_device, dim, **options)(*inputs, **(module_kwargs or {}))


def functional_call(
    dp: DataParallel,
    parameter_and_buffer_dicts: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    args: Any = None,
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> Any:
    """``torch.func.functional_call`` over a dpcore wrapper, data parallel (torch refuses its DataParallel):
    ``dp(*args, **kwargs)`` with the module's parameters and buffers replaced by the given tensors (keyed by
    the module's names or torch's ``module.`` ones); their gradients are the whole batch's on one device."""
    if not isinstance(dp, DataParallel):
        raise TypeError(f"dp: expected a dpcore.DataParallel, but got {type(dp).__name__}")
    if dp.process_group is not None:
        raise ValueError("functional_call: not supported with process_group= (gradients are not synchronized)")
    if isinstance(dp._cache, ShardedParameters):
        raise ValueError(
            "functional_call: not supported with shard_parameters= (each unit gathers the module's own parameters)"
        )
    given = parameter_and_buffer_dicts
    tensors: dict[str, torch.Tensor] = {}
    for d in [given] if isinstance(given, Mapping) else given:
        tensors.update(strip_module_prefix(dict(d), dp.module))
    args = () if args is None else args if isinstance(args, tuple) else (args,)
    return dp._pipeline.run(dp, args, dict(kwargs or {}), substituted(tensors, tie_weights, strict))
