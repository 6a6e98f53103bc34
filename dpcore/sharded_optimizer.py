"""dpcore.ShardedOptimizer: any torch optimizer with its state split across a
device list (ZeRO stage 1 in one process).

Each position of the device list owns a shard of whole parameters, balanced
by bytes, and a ``torch.optim`` optimizer of its own over them: that shard's
state is created, kept and stepped on that position's device, and the
shards step in parallel on dpcore's worker pool. The master parameters and
their ``.grad`` stay whole on the first device. The mechanism (working
copies, version counters, what moves where) is in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from copy import deepcopy
from itertools import chain
from typing import Any

import torch
from torch import nn

from dpcore._devices import DeviceLike, normalize_device
from dpcore._options import check_device_list
from dpcore.data_parallel import DataParallel
from dpcore.parallel_apply import start_parallel_apply

__all__ = ["ShardedOptimizer"]

#: Optimizers whose step couples every parameter (one search direction over
#: all of them): a shard cannot step its part alone.
_NOT_SHARDABLE = (torch.optim.LBFGS,)

_NO_HYPERPARAMETER = ("params", "param_names")


def _holds_copies(device: torch.device, master: torch.device) -> bool:
    """Whether a shard on `device` steps copies of its parameters there (a
    device other than the masters'), not the masters themselves."""
    return normalize_device(device) != normalize_device(master)


def _nbytes(value: Any, seen: set[int]) -> int:
    """Bytes of the tensors in `value` (nested dicts, lists and tuples), each counted once."""
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return 0
        seen.add(id(value))
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_nbytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v, seen) for v in value)
    return 0


def balance(sizes: list[int], loads: list[int]) -> list[int]:
    """The shard of each item: largest first, each to the least loaded
    shard (the first of equals); `loads` (the shards' bytes so far) is
    updated. Deterministic: the same sizes give the same layout."""
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = min(range(len(loads)), key=lambda k: loads[k])
        owners[i] = k
        loads[k] += sizes[i]
    return owners


class _Shard:
    """One position's part: the optimizer over its parameters and, where its
    device is not the masters', a persistent working copy of each of them
    there (the tensors that optimizer steps)."""

    def __init__(self, position: int, device: torch.device, copies: bool) -> None:
        self.position = position
        self.device = device
        self.copies = copies
        self.optimizer: torch.optim.Optimizer | None = None
        self.load = 0  # the bytes of its trainable parameters
        # id(master) -> the tensor this shard's optimizer steps for it.
        self.working: dict[int, torch.Tensor] = {}
        # (master, working) pairs, in parameter order.
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        # id(master) -> (data_ptr, version) of the master when its working copy last equalled it.
        self.seen: dict[int, tuple[int, int]] = {}

    def adopt(self, master: torch.Tensor) -> torch.Tensor:
        """The tensor this shard steps for `master` (made on first call)."""
        work = self.working.get(id(master))
        if work is None:
            if self.copies:
                with torch.no_grad():
                    work = master.detach().to(self.device, copy=True).requires_grad_(master.requires_grad)
                self.seen[id(master)] = (master.data_ptr(), master._version)
            else:
                work = master
            self.working[id(master)] = work
            self.pairs.append((master, work))
        return work

    def has_grads(self) -> bool:
        return any(master.grad is not None for master, _ in self.pairs)

    def step(self) -> None:
        """Steps this shard's optimizer on its device; with working copies,
        their gradients come from the masters' and the updated values go
        back into the masters (an in-place copy: their version counters see
        it). A working copy whose master changed since (a new storage or
        version) is refreshed first."""
        assert self.optimizer is not None
        stepped: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.copies:
            with torch.no_grad():
                for master, work in self.pairs:
                    if master.grad is None:
                        work.grad = None
                        continue
                    if self.seen[id(master)] != (master.data_ptr(), master._version):
                        work.copy_(master)
                    work.grad = master.grad.to(self.device)
                    stepped.append((master, work))
        self.optimizer.step()
        if stepped:
            with torch.no_grad():
                for master, work in stepped:
                    master.copy_(work)
                    work.grad = None
                    self.seen[id(master)] = (master.data_ptr(), master._version)


class _ShardStates(MutableMapping):  # type: ignore[type-arg]
    """``ShardedOptimizer.state``: each master parameter's state, kept in its
    shard's optimizer (read, created on first read as a plain optimizer's
    defaultdict, written and deleted there; a value is stored as given)."""

    def __init__(self, owner: ShardedOptimizer) -> None:
        self._owner = owner

    def _where(self, param: torch.Tensor) -> tuple[dict[Any, Any], torch.Tensor] | None:
        shard = self._owner._shard_of.get(id(param))
        if shard is None or shard.optimizer is None:
            return None
        return shard.optimizer.state, shard.working[id(param)]

    def _found(self, param: Any) -> tuple[dict[Any, Any], torch.Tensor]:
        where = self._where(param) if isinstance(param, torch.Tensor) else None
        if where is None:
            raise KeyError("not a parameter of this optimizer")
        return where

    def __getitem__(self, param: torch.Tensor) -> Any:
        state, work = self._found(param)
        return state[work]

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        state, work = self._found(param)
        state[work] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        state, work = self._found(param)
        del state[work]

    def __contains__(self, param: object) -> bool:
        where = self._where(param) if isinstance(param, torch.Tensor) else None
        return where is not None and where[1] in where[0]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for group in self._owner.param_groups for p in group["params"] if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)`` with its state split over
    `devices`: a ``dpcore.DataParallel`` (its device list; `params` must be
    its module's) or a device list (the parameters on its first device).

    Guarantees: each step equals the plain optimizer's over the same
    parameters; ``param_groups`` are the truth (schedulers and user edits
    reach every shard at the next step); ``state_dict()`` is the plain
    optimizer's format and ``load_state_dict`` takes one from either;
    GradScaler unscales and checks the masters' ``.grad`` and skips the
    whole step on inf. :meth:`state_bytes` counts each position's state.
    """

    # dpcore._step_hook: this optimizer's step marks what it changes itself
    # (the shards' steps, and the copies back into the masters).
    _marks_own_changes = True

    def __init__(
        self,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        devices: DataParallel | Sequence[DeviceLike],
        **defaults: Any,
    ) -> None:
        self._class = _check_class(optimizer_class)
        self.devices, self._module = _placement(devices)
        self._shards: list[_Shard] = []
        self._shard_of: dict[int, _Shard] = {}
        if isinstance(params, torch.Tensor):
            raise TypeError(f"params: expected an iterable of tensors or dicts, but got {torch.typename(params)}")
        params = [dict(g, params=_as_list(g["params"])) if isinstance(g, dict) else g for g in params]
        probe = self._class([_probe_tensor(params)], **defaults)  # checks the arguments, gives every default
        super().__init__(params, dict(probe.defaults))
        del probe
        masters = [p for group in self.param_groups for p in group["params"]]
        self._check_params(masters, "params")
        if not self.devices:  # a wrapper that runs its module as is: one shard where the module is
            self.devices = [normalize_device(masters[0].device)]
        master = self.devices[0]
        self._shards = [_Shard(k, d, k > 0 and _holds_copies(d, master)) for k, d in enumerate(self.devices)]
        self._place(masters)
        for shard in self._shards:
            shard.optimizer = self._class([self._shard_group(g, shard) for g in self.param_groups], **defaults)
        self.state = _ShardStates(self)  # type: ignore[assignment]

    # -- placement ----------------------------------------------------------

    def _check_params(self, params: list[torch.Tensor], arg: str) -> None:
        """Every parameter is on the first device, and the wrapper's module's."""
        own = None if self._module is None else {id(p) for p in self._module.parameters()}
        first = self.devices[0] if self.devices else normalize_device(params[0].device) if params else None
        for i, p in enumerate(params):
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
        """Gives each new parameter a shard, balancing the bytes of the
        trainable ones (a frozen parameter counts as 0)."""
        new = [p for p in params if id(p) not in self._shard_of]
        sizes = [p.numel() * p.element_size() if p.requires_grad else 0 for p in new]
        loads = [s.load for s in self._shards]
        for p, k in zip(new, balance(sizes, loads)):
            self._shard_of[id(p)] = self._shards[k]
        for shard, load in zip(self._shards, loads):
            shard.load = load

    def _shard_group(self, group: dict[str, Any], shard: _Shard) -> dict[str, Any]:
        """`group` restricted to `shard`'s parameters (as the tensors it steps)."""
        mine = [i for i, p in enumerate(group["params"]) if self._shard_of[id(p)] is shard]
        local = {k: v for k, v in group.items() if k not in _NO_HYPERPARAMETER}
        local["params"] = [shard.adopt(group["params"][i]) for i in mine]
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in mine]
        return local

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``: the new parameters are placed on the
        least loaded shards; every shard's optimizer gets the group (with
        its part of it, possibly empty)."""
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
            assert shard.optimizer is not None
            shard.optimizer.add_param_group(self._shard_group(group, shard))

    def _sync_groups(self) -> list[_Shard]:
        """Copies every hyperparameter of ``param_groups`` to the shards'
        groups and returns the shards that have a gradient to step. Raises
        ValueError where a group's parameter list was edited by hand."""
        listed = {id(p) for group in self.param_groups for p in group["params"]}
        if listed != self._shard_of.keys():
            raise ValueError(
                "param_groups: a group's 'params' list was changed by hand since the shards were laid out; "
                "add parameters with add_param_group()"
            )
        for j, group in enumerate(self.param_groups):
            settings = {k: v for k, v in group.items() if k not in _NO_HYPERPARAMETER}
            for shard in self._shards:
                assert shard.optimizer is not None
                shard.optimizer.param_groups[j].update(settings)
        return [shard for shard in self._shards if shard.has_grads()]

    # -- the step -----------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of every shard, in parallel on the worker pool (each on
        its device); `closure` (re-evaluates the loss) is called once, first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        busy = self._sync_groups()
        if len(busy) == 1:
            busy[0].step()
        elif busy:
            run = start_parallel_apply([s.step for s in busy], [()] * len(busy), None, [s.device for s in busy])
            run.result()
        return loss

    # -- state ----------------------------------------------------------------

    def state_bytes(self) -> dict[int, int]:
        """Bytes of optimizer state held by each position of the device list
        (its shard's state tensors; a tensor counted once)."""
        result = {}
        for shard in self._shards:
            assert shard.optimizer is not None
            result[shard.position] = _nbytes(dict(shard.optimizer.state), set())
        return result

    def shard_of(self, param: torch.Tensor) -> int:
        """The position in the device list whose shard steps `param`."""
        shard = self._shard_of.get(id(param)) if isinstance(param, torch.Tensor) else None
        if shard is None:
            raise KeyError("param: not a parameter of this optimizer")
        return shard.position

    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's ZeroRedundancyOptimizer call, for code written for it: in
        one process every shard is at hand, so :meth:`state_dict` is always
        whole and current, and this only checks that `to` is 0 (the one rank)."""
        if isinstance(to, bool) or not isinstance(to, int) or to != 0:
            raise ValueError(
                f"to: expected 0 (one process holds every shard, so its state_dict() is always whole), but got {to!r}"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this optimizer or of the plain one over the
        same parameter groups: the hyperparameters into ``param_groups``, each
        parameter's state straight into its shard (cast to its device and
        dtype there, as torch's own load does)."""
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
        index_of = dict(
            zip(
                (id(p) for g in self.param_groups for p in g["params"]),
                chain.from_iterable(s["params"] for s in saved_groups),
            )
        )
        known = set(index_of.values())
        unknown = [k for k in state_dict["state"] if k not in known]
        if unknown:
            raise ValueError(f"state_dict['state']: entries {unknown[:5]} belong to no parameter of param_groups")
        groups = []
        for group, saved in zip(self.param_groups, saved_groups):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            groups.append(saved)
        self.param_groups = groups
        for shard in self._shards:
            assert shard.optimizer is not None
            local: dict[str, Any] = {"state": {}, "param_groups": []}
            count = 0
            for group in groups:
                mine = [p for p in group["params"] if self._shard_of[id(p)] is shard]
                settings = {k: v for k, v in group.items() if k not in _NO_HYPERPARAMETER}
                local["param_groups"].append({**settings, "params": list(range(count, count + len(mine)))})
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


def _check_class(optimizer_class: Any) -> type[torch.optim.Optimizer]:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            "optimizer_class: expected a torch.optim.Optimizer subclass (torch.optim.AdamW, ...), but got "
            f"{optimizer_class!r}"
        )
    if issubclass(optimizer_class, ShardedOptimizer):
        raise TypeError("optimizer_class: a ShardedOptimizer cannot shard another one; pass the plain class")
    if issubclass(optimizer_class, _NOT_SHARDABLE):
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


def _as_list(params: Any) -> Any:
    return params if isinstance(params, torch.Tensor) else list(params)


def _probe_tensor(params: list[Any]) -> torch.Tensor:
    """A meta tensor shaped as the first parameter (one with no storage):
    what the optimizer class is built over once to check the arguments and
    fill in its defaults."""
    first: Any = None
    for entry in params:
        members: Iterable[Any] = entry["params"] if isinstance(entry, dict) else [entry]
        if isinstance(members, torch.Tensor):
            members = [members]
        for m in members:
            first = m[1] if isinstance(m, tuple) else m
            break
        if first is not None:
            break
    if not isinstance(first, torch.Tensor):
        return torch.empty(0, device="meta", requires_grad=True)
    return torch.empty_like(first, device="meta").requires_grad_(True)
