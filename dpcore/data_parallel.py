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

from dpcore._devices import DeviceLike, as_devices, normalize_device
from dpcore._dropin import DDP_ONLY, BareStateDict, NominalMeta, SignedForward, has_module_prefix, split_of
from dpcore._dropin import dcp_names, strip_module_prefix
from dpcore._graphs import GraphRunner
from dpcore._loss import Call, LossRule
from dpcore._methods import PARALLEL_BY_NAME, Method, ParallelMethod
from dpcore._options import ATTRIBUTES, Options, check_not_compiled, check_options, check_write, overrides
from dpcore._pytree import without_markers
from dpcore._split import check_first_device
from dpcore.distributed import DataParallelJoinHook, GradientSync
from dpcore.parallel_apply import CallGuard, start_parallel_apply
from dpcore.replicate import DEFAULT_BUCKET_BYTES, ReplicaCache, check_on_device
from dpcore.replicate import replicate as replicate_module
from dpcore.scatter_gather import NO_HINTS, Scattered, check_image_lists, gather_with_hints, image_list_model
from dpcore.scatter_gather import scatter_with_hints
from dpcore.sync_batchnorm import needs_sync, synchronized_apply

__all__ = ["DataParallel", "data_parallel"]

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
    _replica_private_attrs = ("_cache", "_calls", "_graphs")

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
        if changed in ("module", "device_ids", "bucket_bytes", "replica_refresh"):
            self._cache = None
        self._image_lists = image_list_model(self.module)
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
            return self.parallel(name) if name in PARALLEL_BY_NAME else found

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
        """torch's ``scatter``: ``(inputs, kwargs)``, each replica's arguments
        split along ``dim`` by dpcore's rules; ``.call`` is the call's record."""
        scattered, hints = scatter_with_hints(
            inputs, kwargs, device_ids, self.dim, self.chunk_sizes, self.weights, lone_as_is=True
        )
        devices, used = as_devices(device_ids, "device_ids"), scattered.device_indices
        pair = _ScatteredPair((scattered.args, scattered.kwargs))
        pair.call = Call(scattered.args, scattered.kwargs, scattered.sizes, used, [devices[i] for i in used], hints)
        return pair

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """torch's ``replicate``: one module per device, the first ``module`` itself (cached and refreshed for this
        wrapper's module on a leading part of its devices)."""
        devices = as_devices(device_ids, "device_ids")
        if module is self.module and devices and devices == self.device_ids[: len(devices)]:
            return self._replica_cache().replicas(len(devices))
        return replicate_module(module, devices, detach=not torch.is_grad_enabled())

    def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """torch's ``parallel_apply``: ``replicas[i](*inputs[i], **kwargs[i])``
        for every i at once on the worker pool; one replica runs in this thread."""
        if len(replicas) == 1:
            first = inputs[0] if isinstance(inputs[0], (list, tuple)) else (inputs[0],)
            return [replicas[0](*first, **((kwargs or [{}])[0] or {}))]
        call = getattr(replicas, "call", None)
        devices = call.devices if call is not None and len(call.devices) == len(replicas) else None
        return self._parallel_apply(replicas, inputs, kwargs, devices or self.device_ids[: len(replicas)])

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike | None) -> Any:
        """torch's ``gather``: the outputs joined along ``dim`` on
        ``output_device`` (:func:`dpcore.gather`), by the hints of the call's inputs."""
        call = getattr(outputs, "call", None)
        return gather_with_hints(outputs, output_device, self.dim, call.hints if call is not None else NO_HINTS)

    def _overrides(self, name: str) -> bool:
        return overrides(type(self), DataParallel, name) or name in self.__dict__

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with self._calls:
            sync = self._sync
            if sync is not None:
                sync.before_forward(self)
            output, rows = self._forward(inputs, kwargs)
            return output if sync is None else sync.after_forward(output, rows, self._options)

    forward = SignedForward(forward)  # type: ignore[assignment]

    def _forward(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], through: Any = None, method: Method | None = None
    ) -> tuple[Any, int]:
        """The call's result and this process's rows. `through(replica)` runs
        in place of each replica, eagerly; a `method` call has no loss rule."""
        criterion = self.criterion
        if criterion is not None and getattr(criterion, "reduction", None) is not self._options.own_reduction:
            self.criterion = criterion  # its .reduction changed in place: checked again, followed from this call on
        if criterion is not None and not inputs and method is None:
            raise TypeError("DataParallel with a criterion expects the target as the last positional argument")
        if not self.device_ids:  # the module as is, on the values inside Broadcast and Samples markers
            inputs, kwargs = without_markers((inputs, kwargs))
            module = self.module if through is None else through(self.module)
            return self._loss.make_call(module, method)(*inputs, **kwargs), 0
        call = self._scatter(inputs, kwargs)
        call.method = method
        outputs = self._run(call, through)
        return self._loss.combine(outputs, call, lambda outs: self._gather(outs, call)), call.rows

    def _scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        if self._image_lists is not None:
            check_image_lists(self._image_lists, inputs, kwargs)
        lone = self._lone_call(inputs, kwargs)
        if lone is not None:
            return lone
        result = self.scatter(inputs, kwargs, self.device_ids)
        if isinstance(result, _ScatteredPair):
            call = result.call
        elif isinstance(result, Scattered):
            devices = [self.device_ids[i] for i in result.device_indices]
            call = Call(result.args, result.kwargs, result.sizes, result.device_indices, devices, NO_HINTS)
        else:
            args, kws, sizes = split_of(result, len(self.device_ids), self.dim)
            used = list(range(len(args)))
            call = Call(args, kws, sizes, used, self.device_ids[: len(args)], NO_HINTS)
            if self.criterion is not None and len(sizes) > 1 and 0 in sizes:
                raise ValueError(
                    f"criterion: each replica's loss is weighted by its rows, but {type(self).__name__}.scatter gave "
                    f"replica {sizes.index(0)} no tensor with a dimension {self.dim} to count them by"
                )
        check_first_device(call.sizes, call.used, len(self.device_ids), self.chunk_sizes, self.weights)
        return call

    def _lone_call(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
        """The call of a lone device whose arguments are all plain tensors on it with one row count along
        ``dim``: each passed as is, as ``scatter`` would pass it, with no tree walk. None for any other call."""
        if len(self.device_ids) != 1 or self.chunk_sizes is not None or self.weights is not None:
            return None
        device, dim, rows = self.device_ids[0], self.dim, -1
        for t in (*inputs, *kwargs.values()):
            if type(t) is not torch.Tensor or t.device != device or not -t.dim() <= dim < t.dim():
                return None
            if rows != t.size(dim):
                if rows != -1:
                    return None
                rows = t.size(dim)
        if rows < 1 or self._overrides("scatter"):
            return None
        return Call([inputs], [kwargs], [rows], [0], [device], NO_HINTS)

    def _run(self, call: Call, through: Callable[[Any], Any] | None = None) -> list[Any]:
        """Each used replica's result on its chunk: replayed CUDA graphs, or
        eagerly through ``replicate`` and ``parallel_apply``."""
        make_call = self._loss.make_call
        if through is not None:
            make_call = lambda m: self._loss.make_call(through(m), call.method)  # noqa: E731
        elif self._graphs is not None:  # combined: the outputs become new tensors (else the graphs clone them)
            loss = self.criterion is not None or self.model_loss is not None
            plain = not loss and self.gather_output and not call.hints.samples and not self._overrides("gather")
            combined = plain or (len(call.used) > 1 and loss)
            outputs = self._graphs.step(
                self._replica_cache(), call.args, call.kws, call.used, make_call, combined=combined
            )
            if outputs is not None:
                return outputs
        custom = len(self.device_ids) > 1 and (self._overrides("replicate") or self._overrides("parallel_apply"))
        count = call.used[-1] + 1
        if len(self.device_ids) == 1:  # as torch's wrapper: no replicate (the cache still checks the module)
            self._replica_cache()
            replicas: Sequence[nn.Module] = [self.module]
        else:
            replicas = self.replicate(self.module, self.device_ids[:count])
        if custom:
            self._check_per("replicate", "replica per device", replicas, count)
        modules = [replicas[i] for i in call.used]
        calls = _PerCall([make_call(m) for m in modules], call)
        across = None if self._sync is None else self._sync.batchnorm_across(call.rows, self._loss.summed)
        if self.sync_batchnorm and (len(calls) > 1 or across is not None) and needs_sync(self.module):
            return synchronized_apply(
                modules, calls, call.args, call.kws, call.devices, run=self._parallel_apply, across=across
            )
        if not custom:
            if len(calls) == 1:
                return [calls[0](*call.args[0], **call.kws[0])]
            return self._parallel_apply(calls, call.args, call.kws, call.devices)
        outputs = self.parallel_apply(calls, call.args, call.kws)
        self._check_per("parallel_apply", "output per replica", outputs, len(calls))
        return list(outputs)

    def _check_per(self, method: str, per: str, values: Any, count: int) -> None:
        if not isinstance(values, Sequence) or len(values) != count:
            got = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise ValueError(f"{type(self).__name__}.{method}: expected one {per} ({count}), but got {got}")

    def _gather(self, outputs: list[Any], call: Call) -> Any:
        if len(self.device_ids) == 1 and self._overrides("gather"):  # torch's wrapper does not gather then
            return outputs[0]
        out = outputs[0] if len(outputs) == 1 else None
        if type(out) is torch.Tensor and out.dim() > 0 and self._graphs is None and not call.hints.rows:
            if normalize_device(out.device) == self.output_device and not self._overrides("gather"):
                return out  # a lone replica's tensor where it belongs: as is, as from the bare module
        return self.gather(_PerCall(outputs, call), self.output_device)

    def _parallel_apply(
        self, fns: Sequence[Callable[..., Any]], args: Any, kws: Any, devices: Any, *, all_at_once: bool = False
    ) -> list[Any]:
        run = start_parallel_apply(fns, args, kws, devices, all_at_once=all_at_once)
        try:
            return run.result()
        except BaseException:
            if not run.done:  # interrupted: its running replicas finish in the background
                self._calls.abandoned = run
            raise

    def _replica_cache(self) -> ReplicaCache:
        """The replica cache, rebuilt first where the master's structure changed."""
        if self._cache is None or not self._cache.valid():
            check_on_device(self.module, self.device_ids[0], "device_ids[0]")
            if self.cuda_graphs:
                check_not_compiled(self.module)  # compiled after wrapping
            self._cache = ReplicaCache(self.module, self.device_ids, self.bucket_bytes, refresh=self.replica_refresh)
            if self._sync is not None:  # the gradient buckets follow a structural change (collective)
                self._sync.check_structure()
        return self._cache

    @property
    def replica_cache(self) -> ReplicaCache | None:
        """The replicas' cache, as the last call left it (never built here): None before the first call that
        replicates, and after a write of an option it is built from (the next call builds a new one)."""
        return self._cache

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


class _ScatteredPair(tuple):  # type: ignore[type-arg]
    """torch's pair ``(inputs, kwargs)``, with the call's record as ``.call``."""

    call: Call


class _PerCall(list):  # type: ignore[type-arg]
    """One entry per replica, with the call's record as ``.call`` (torch's signatures have no place for it)."""

    def __init__(self, items: Sequence[Any], call: Call) -> None:
        super().__init__(items)
        self.call = call


# Each option's attribute (``dp.criterion``, ...) reads the one checked value: device_ids and output_device as resolved.
for _name, _field in {**ATTRIBUTES, "device_ids": "devices", "output_device": "out"}.items():
    if _name not in ("module", "forward_sync_buffers", "broadcast_buffers"):
        setattr(DataParallel, _name, property(attrgetter(f"_options.{_field}")))


def _fresh_private_state(cuda_graphs: bool) -> dict[str, Any]:
    """New values of DataParallel._replica_private_attrs."""
    return {"_cache": None, "_calls": CallGuard(), "_graphs": GraphRunner() if cuda_graphs else None}


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
