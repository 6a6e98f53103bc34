"""dpcore.ShardedOptimizer: any torch optimizer with its state split across a device list (ZeRO stage 1 in one process);
the mechanism is in docs/design.md."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from copy import deepcopy
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpcore import comm
from dpcore._devices import DeviceLike, normalize_device
from dpcore._options import check_device_list
from dpcore._shards import Shard, ShardStates
from dpcore._step_hook import exempt
from dpcore._unit_plan import balance
from dpcore.data_parallel import DataParallel
from dpcore.parallel_apply import start_parallel_apply
from dpcore.replicate import ReplicaCache

__all__ = ["ShardedOptimizer"]


def _holds_copies(device: torch.device, master: torch.device) -> bool:
    """Whether a shard on `device` steps copies of the `master` device's parameters."""
    return normalize_device(device) != normalize_device(master)


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)`` with its state split over `devices` (a ``dpcore.DataParallel`` over
    `params`' module, or a device list whose first device holds `params`). Each step equals the plain optimizer's;
    ``param_groups`` are the truth (schedulers and edits reach every shard at the next step); ``state_dict()`` is the
    plain optimizer's format; GradScaler skips the whole step on inf (dpcore.ShardedGradScaler with shard_gradients)."""

    def __init__(
        self,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        devices: DataParallel | Sequence[DeviceLike],
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        self._class = _check_class(optimizer_class)
        self.parameters_as_bucket_view = _check_flag(parameters_as_bucket_view, "parameters_as_bucket_view")
        if _check_flag(overlap_with_ddp, "overlap_with_ddp"):
            raise ValueError(
                "overlap_with_ddp: ZeroRedundancyOptimizer's overlap runs its step inside DDP's communication hook, "
                "bucket by bucket; a ShardedOptimizer steps when step() is called, every shard at once on the "
                "worker pool, and its gradients are whole before that: pass overlap_with_ddp=False"
            )
        self.devices, self._module = _placement(devices)
        self._wrapper = weakref.ref(devices) if isinstance(devices, DataParallel) else None
        # shard_parameters=: the wrapper's placement, whose shards this optimizer steps
        self._units = devices.sharded_parameters if isinstance(devices, DataParallel) else None
        self._shards: list[Shard] = []
        self._shard_of: dict[int, Shard] = {}
        params = _param_list(params)
        probe = self._class([_probe_tensor(params)], **defaults)  # checks the arguments, gives every default
        super().__init__(params, dict(probe.defaults))
        del probe
        masters = _masters(self)
        self._check_params(masters, "params")
        if not self.devices:  # a wrapper that runs its module as is: one shard where the module is
            self.devices = [normalize_device(masters[0].device)]
        master = self.devices[0]
        copies = [k > 0 and self._units is None and _holds_copies(d, master) for k, d in enumerate(self.devices)]
        self._shards = [Shard(k, d, copies[k]) for k, d in enumerate(self.devices)]
        self._place(masters)
        for shard in self._shards:
            shard.optimizer = self._class([self._shard_group(g, shard) for g in self.param_groups], **defaults)
            if self.parameters_as_bucket_view:
                shard.view_as_buckets()
        self.state = ShardStates(self)  # type: ignore[assignment]
        # shard_gradients=True: id(master) -> its gradient summed over the replicas, on its owner's device.
        self._store: dict[int, torch.Tensor] | None = None
        sharded = self._units is not None or isinstance(devices, DataParallel) and devices.shard_gradients
        if sharded and len(self.devices) > 1:
            self._attach(devices)
        exempt(self)  # from dpcore._step_hook: each shard's step marks or writes what it changed

    def _attach(self, dp: DataParallel) -> None:
        """Becomes the sink of `dp`'s sharded gradients (its backward adds them here); ValueError naming both unless
        every trainable parameter of its module is this optimizer's."""
        missing = [n for n, p in dp.module.named_parameters() if p.requires_grad and id(p) not in self._shard_of]
        if missing:
            raise ValueError(
                f"params: with shard_gradients=True every gradient goes into this ShardedOptimizer's shards, but it "
                f"does not step the module's trainable {', '.join(map(repr, missing[:3]))}"
                f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}: give it all of model.parameters()"
            )
        self._store, self._lock = {}, threading.Lock()
        previous = dp._sink() if dp._sink is not None else None
        if isinstance(previous, ShardedOptimizer):
            previous._release()
        dp._sink = weakref.ref(self)
        for shard in self._shards:  # the all-gather marks what they step; the step hook would mark all they hold
            exempt(shard.optimizer)
        if self._units is None:
            me = weakref.ref(self)
            self._absorbing = [
                p.register_post_accumulate_grad_hook(lambda p: _absorb(me, p))
                for p in dp.module.parameters()
                if p.requires_grad
            ]

    def _release(self) -> None:
        """No longer the wrapper's sink (a newer ShardedOptimizer is): its hooks on the module's parameters go."""
        for handle in getattr(self, "_absorbing", ()):
            handle.remove()
        self._absorbing = []

    def owners(self, masters: Sequence[torch.Tensor]) -> list[int]:
        """The shard position of each of `masters` (:meth:`shard_of`)."""
        return [self._shard_of[id(p)].position for p in masters]

    def add(self, masters: Sequence[torch.Tensor], sums: Sequence[torch.Tensor]) -> None:
        """Adds each gradient of `sums` (on its master's owner's device) to the one held for it (shard_gradients)."""
        with self._lock:
            for p, g in zip(masters, sums):
                held = self._store.get(id(p))  # type: ignore[union-attr]
                self._store[id(p)] = g if held is None else held.add_(g)  # type: ignore[index]

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s gradient as this optimizer steps it: with shard_gradients=True the sum over the replicas held at
        its owner (``shard_of(param)``'s device; ``param.grad`` stays None), else ``param.grad``."""
        self.shard_of(param)
        return param.grad if self._store is None else self._store.get(id(param))

    def _gradients(self) -> list[torch.Tensor]:
        """Every gradient held, in the order of ``param_groups``."""
        grads = (self.gradient(p) for p in _masters(self))
        return [g for g in grads if g is not None]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the gradients this optimizer steps (:meth:`gradient`, where they are
        held); returns the total norm, on the first device."""
        grads = self._gradients()
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grads_with_norm_
        with torch.no_grad():
            for g in grads:
                g.mul_(coef.to(g.device))
        return total.to(self.devices[0])

    def clip_grad_value_(self, clip_value: float) -> None:
        """torch.nn.utils.clip_grad_value_ over the gradients this optimizer steps, where they are held."""
        clip_value = float(clip_value)
        with torch.no_grad():
            for g in self._gradients():
                g.clamp_(min=-clip_value, max=clip_value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with shard_gradients=True the held gradients are dropped (set_to_none's rule)."""
        super().zero_grad(set_to_none)
        if self._store is not None:
            self._store.clear()

    def _check_params(self, params: list[torch.Tensor], arg: str) -> None:
        """ValueError naming `arg` unless every parameter is dense, on the first device, the module's, and listed once
        (torch's optimizer only warns of a repeat, and steps it twice)."""
        own = None if self._module is None else {id(p) for p in self._module.parameters()}
        first = self.devices[0] if self.devices else normalize_device(params[0].device) if params else None
        index: dict[int, int] = {}
        for i, p in enumerate(params):
            if index.setdefault(id(p), i) != i:
                raise ValueError(
                    f"{arg}: parameter {i} ({p.dtype}{list(p.shape)}) is parameter {index[id(p)]} again; "
                    "list each parameter once"
                )
            if own is not None and id(p) not in own:
                raise ValueError(
                    f"{arg}: parameter {i} ({p.dtype}{list(p.shape)}) is not a parameter of the wrapper's module "
                    "(devices=): a sharded optimizer steps the module's parameters only"
                )
            if normalize_device(p.device) != first:
                raise ValueError(
                    f"{arg}: parameter {i} is on {p.device}, but the master parameters must all be on the first "
                    f"device of the list, {first}"
                )
            if p.is_sparse:
                raise ValueError(f"{arg}: parameter {i} is sparse; only dense parameters can be sharded")

    def _place(self, params: list[torch.Tensor]) -> None:
        """Gives each new parameter a shard, balancing the bytes of trainable ones."""
        new = [p for p in params if id(p) not in self._shard_of]
        sizes = [p.numel() * p.element_size() if p.requires_grad else 0 for p in new]
        loads = [s.load for s in self._shards]
        owners = balance(sizes, loads) if self._units is None else [self._units.owner_of(p) for p in new]
        for p, k in zip(new, owners):
            self._shard_of[id(p)] = self._shards[k]
        for shard, load in zip(self._shards, loads):
            shard.load = load

    def _shard_group(self, group: dict[str, Any], shard: Shard) -> dict[str, Any]:
        """`group` restricted to `shard`'s parameters (as the tensors it steps)."""
        mine = [i for i, p in enumerate(group["params"]) if self._shard_of[id(p)] is shard]
        mine_params = [group["params"][i] for i in mine]
        given = [None] * len(mine) if self._units is None else [self._units.shard(p) for p in mine_params]
        local = {**_settings(group), "params": [shard.adopt(p, g) for p, g in zip(mine_params, given)]}
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in mine]
        return local

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; the new parameters go to the least loaded shards."""
        super().add_param_group(param_group)
        if not self._shards:  # during __init__: placed all at once there
            return
        group = self.param_groups[-1]
        try:
            self._check_params(group["params"], "param_group['params']")
        except ValueError:
            self.param_groups.pop()
            raise
        self._place(group["params"])
        for shard in self._shards:
            shard.optimizer.add_param_group(self._shard_group(group, shard))
            if self.parameters_as_bucket_view:
                shard.view_as_buckets()

    def _sync_groups(self) -> tuple[list[Shard], list[dict[str, Any]]]:
        """Copies ``param_groups``' hyperparameters to the shards; returns the shards with a gradient, and the
        hyperparameters copied (per group)."""
        listed = {id(p) for p in _masters(self)}
        if listed != self._shard_of.keys():
            raise ValueError(
                "param_groups: a group's 'params' list was changed by hand since the shards were laid out; "
                "add parameters with add_param_group()"
            )
        pushed = [_settings(group) for group in self.param_groups]
        for shard in self._shards:
            for local, settings in zip(shard.optimizer.param_groups, pushed):
                local.update(settings)
        if self._store is not None:
            masters = _masters(self)
            written = [i for i, p in enumerate(masters) if p.grad is not None]
            if written and not self._store and all(not masters[i].grad.any() for i in written):
                for p in (masters[i] for i in written):  # zero gradients (DCP's state initialization)
                    self._store[id(p)] = torch.zeros_like(self._shard_of[id(p)].working[id(p)])
            elif written:
                mode = "shard_gradients=True" if self._units is None else "shard_parameters=True"
                raise RuntimeError(
                    f"{mode}: the gradients live in the ShardedOptimizer's shards (gradient(p)), but "
                    f"parameter {written[0]} of param_groups has a .grad written by hand: p.grad of the module's "
                    f"parameters must stay None; set it to None, or clip and "
                    f"edit through the optimizer (clip_grad_norm_, clip_grad_value_, gradient(p))"
                )
        has = (lambda m: m.grad is not None) if self._store is None else (lambda m: id(m) in self._store)  # type: ignore[operator]
        return [shard for shard in self._shards if any(has(m) for m, _ in shard.pairs)], pushed

    _unscaled_by_scaler = False  # True while dpcore.ShardedGradScaler steps this optimizer

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler's protocol: True with shard_gradients=True (torch's GradScaler hands the step its scale: refused)
        unless dpcore.ShardedGradScaler steps, which unscales and checks the shards' gradients itself; else False."""
        return self._store is not None and not self._unscaled_by_scaler

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """One step of every shard with a gradient, in parallel on the worker pool, each shard's optimizer called with
        `kwargs`; `closure` is called once, first. Entries the shards' optimizers add to or change in their param groups
        during the step reach ``param_groups`` (ZeroRedundancyOptimizer's sync after its step)."""
        if closure is not None and not callable(closure):
            raise TypeError(f"closure: expected a callable that returns the loss, or None, but got {closure!r}")
        if self._store is not None and "grad_scale" in self.__dict__:
            del self.grad_scale, self.found_inf  # type: ignore[attr-defined]
            raise RuntimeError(
                "GradScaler cannot step a ShardedOptimizer with shard_gradients=True: it unscales and checks "
                "p.grad, which stays None there (the gradients live in the shards); use dpcore.ShardedGradScaler, "
                "which checks the shards' gradients (same arguments and calls as torch.amp.GradScaler)"
            )
        with torch.enable_grad():
            loss = None if closure is None else closure()
        busy, pushed = self._sync_groups()
        store = self._store
        cache = self._replica_cache() if store is None and any(s.copies for s in busy) else None
        results = []
        if len(busy) == 1:
            results = [busy[0].step(cache, kwargs, store)]
        elif busy:
            steps = [s.step for s in busy]
            args = [(cache, kwargs, store)] * len(busy)
            results = start_parallel_apply(steps, args, None, [s.device for s in busy]).result()
        if store is not None:
            self._publish([pair for result in results for pair in result])
            store.clear()
        for j, (group, before) in enumerate(zip(self.param_groups, pushed)):
            group.update(_changed_settings(j, before, [s.optimizer.param_groups[j] for s in busy]))
        return loss

    def _publish(self, stepped: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """shard_gradients: the parameters updated at their owners reach the masters and every replica's copies by one
        all-gather (the next refresh copies none of them); without a valid replica cache, the masters only."""
        if self._units is not None:  # the shards stepped are the parameters: each unit gathers them from there
            return
        masters = [m for m, _ in stepped]
        cache = self._replica_cache() if stepped else None
        outs = None if cache is None else cache.copies_of(masters)
        copied = [(m, w) for m, w in stepped if w is not m]
        with torch.no_grad():
            if outs is None:
                for m, w in copied:
                    m.copy_(w)
            else:
                works = [w for _, w in stepped]
                comm.all_gather_coalesced(works, self.owners(masters), self.devices, out=[masters, *outs])
                torch.autograd.graph.increment_version(masters)  # written by the all-gather (or a fused step) unseen
            for m, _ in copied:
                self._shard_of[id(m)].seen[id(m)] = (m.data_ptr(), m._version)
        if outs is not None:
            cache.mark_current(masters)  # type: ignore[union-attr]

    def _replica_cache(self) -> ReplicaCache | None:
        """The wrapper's replica cache where it replicates over this optimizer's device list, else None."""
        cache = None if self._wrapper is None or (dp := self._wrapper()) is None else dp.replica_cache
        return cache if cache is not None and cache.devices == self.devices else None

    def state_bytes(self) -> dict[int, int]:
        """Bytes of optimizer state held by each position of the device list (a tensor counted once)."""
        result = {}
        for shard in self._shards:
            tensors = {id(t): t for t in tree_leaves(dict(shard.optimizer.state)) if isinstance(t, torch.Tensor)}
            result[shard.position] = sum(t.numel() * t.element_size() for t in tensors.values())
        return result

    def held_bytes(self) -> dict[int, dict[str, int]]:
        """Per position of the device list, the bytes this optimizer holds there: ``optimizer_state`` (as
        :meth:`state_bytes`), ``working_copies`` (the copies a shard steps in place of masters on another device) and
        ``gradients`` (the working copies' during a step; with shard_gradients=True those held at their owners)."""
        states = self.state_bytes()
        held = {}
        for shard in self._shards:
            copies = [w for m, w in shard.pairs if w is not m] if shard.copies else []
            stored = [] if self._store is None else [self._store.get(id(m)) for m, _ in shard.pairs]
            grads = {id(g): g for g in [w.grad for w in copies] + stored if g is not None}
            held[shard.position] = {
                "optimizer_state": states[shard.position],
                "working_copies": sum(w.numel() * w.element_size() for w in copies),
                "gradients": sum(g.numel() * g.element_size() for g in grads.values()),
            }
        return held

    def shard_of(self, param: torch.Tensor) -> int:
        """The position in the device list whose shard steps `param`."""
        shard = self._shard_of.get(id(param)) if isinstance(param, torch.Tensor) else None
        if shard is None:
            raise KeyError("param: not a parameter of this optimizer")
        return shard.position

    def consolidate_state_dict(self, to: int = 0) -> None:
        """ZeroRedundancyOptimizer's call: state_dict() is always whole here, so this only checks `to` is 0."""
        if isinstance(to, bool) or not isinstance(to, int) or to != 0:
            raise ValueError(
                f"to: expected 0 (one process holds every shard, so its state_dict() is always whole), but got {to!r}"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this optimizer or of the plain one, each parameter's state into its shard."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(self.param_groups, saved_groups)):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
        masters = [id(p) for p in _masters(self)]
        index_of = dict(zip(masters, chain.from_iterable(s["params"] for s in saved_groups)))
        known = set(index_of.values())
        unknown = [k for k in state_dict["state"] if k not in known]
        if unknown:
            raise ValueError(f"state_dict['state']: entries {unknown[:5]} belong to no parameter of param_groups")
        for group, saved in zip(self.param_groups, saved_groups):
            saved["params"] = group["params"]
            if "param_names" in group:
                saved.setdefault("param_names", group["param_names"])
        self.param_groups = groups = saved_groups
        for shard in self._shards:
            local: dict[str, Any] = {"state": {}, "param_groups": []}
            count = 0
            for group in groups:
                mine = [p for p in group["params"] if self._shard_of[id(p)] is shard]
                local["param_groups"].append({**_settings(group), "params": list(range(count, count + len(mine)))})
                for i, p in enumerate(mine, count):
                    if index_of[id(p)] in state_dict["state"]:
                        local["state"][i] = state_dict["state"][index_of[id(p)]]
                count += len(mine)
            shard.optimizer.load_state_dict(local)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "ShardedOptimizer cannot be pickled or deep-copied (its shards live on several devices): save "
            "state_dict() instead, and load it into a new one"
        )


def _absorb(ref: Callable[[], ShardedOptimizer | None], param: torch.Tensor) -> None:
    """shard_gradients=True: a gradient that autograd accumulated into a module parameter anyway moves into its shard
    (a reentrant checkpoint's recomputation on position 0 runs on the module's own parameters; so does a backward of
    the bare module)."""
    optimizer = ref()
    wrapper = None if optimizer is None or optimizer._wrapper is None else optimizer._wrapper()
    if wrapper is None or not wrapper.shard_gradients or wrapper._sink is None or wrapper._sink() is not optimizer:
        return
    grad, param.grad = param.grad, None
    if grad is None:  # (autograd runs the hook for the None that the wrapper's node returns)
        return
    optimizer.add([param], [grad.to(optimizer.devices[optimizer.shard_of(param)])])


def _masters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of `optimizer`'s param_groups, in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_class(optimizer_class: Any) -> type[torch.optim.Optimizer]:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            "optimizer_class: expected a torch.optim.Optimizer subclass (torch.optim.AdamW, ...), but got "
            f"{optimizer_class!r}"
        )
    if issubclass(optimizer_class, ShardedOptimizer):
        raise TypeError("optimizer_class: a ShardedOptimizer cannot shard another one; pass the plain class")
    if issubclass(optimizer_class, torch.optim.LBFGS):
        raise ValueError(
            f"optimizer_class: {optimizer_class.__name__} searches one direction over all parameters at once "
            "(its step couples every parameter), so it cannot be split into shards that step alone"
        )
    return optimizer_class


def _placement(devices: Any) -> tuple[list[torch.device], nn.Module | None]:
    """(the device list, the wrapper's module or None) of the `devices` argument."""
    if isinstance(devices, DataParallel):
        return list(devices.device_ids), devices.module
    if isinstance(devices, nn.Module):
        raise TypeError(
            f"devices: expected a dpcore.DataParallel or a list of devices, but got {type(devices).__name__}"
        )
    return check_device_list(devices, "devices"), None


def _check_flag(value: Any, arg: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{arg}: expected True or False, but got {value!r}")
    return value


def _param_list(params: Any) -> list[Any]:
    """`params` as a list of tensors, (name, tensor) pairs or groups with a list each; TypeError or ValueError naming
    `params` for a lone tensor, a non-iterable, or a group without its 'params'."""
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise TypeError(f"params: expected an iterable of tensors or dicts, but got {torch.typename(params)}")
    entries = list(params)
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            if "params" not in entry:
                raise ValueError(f"params[{i}]: a parameter group needs a 'params' entry, but has {sorted(entry)}")
            group = entry["params"]
            entries[i] = dict(entry, params=[group] if isinstance(group, torch.Tensor) else list(group))
    return entries


def _changed_settings(j: int, before: dict[str, Any], after: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings of group `j` that the shards' optimizers added or changed during a step (`after`: their groups j);
    ValueError naming the entry if two shards set different values."""
    changed: dict[str, Any] = {}
    for group in after:
        for key, value in _settings(group).items():
            if key in before and value is before[key]:
                continue
            if key in changed and not _same(changed[key], value):
                raise ValueError(
                    f"param_groups[{j}][{key!r}]: the shards' optimizers set different values in one step "
                    f"({changed[key]!r} and {value!r}); a group setting computed from all of its parameters "
                    "cannot be split into shards"
                )
            changed[key] = value
    return changed


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu())
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _probe_tensor(params: list[Any]) -> torch.Tensor:
    """A meta tensor shaped as the first parameter, to build the optimizer class over once (its defaults)."""
    members = [m for entry in params for m in (entry["params"] if isinstance(entry, dict) else [entry])]
    first = members[0][1] if members and isinstance(members[0], tuple) else members[0] if members else None
    if not isinstance(first, torch.Tensor):
        return torch.empty(0, device="meta", requires_grad=True)
    return torch.empty_like(first, device="meta").requires_grad_(True)
