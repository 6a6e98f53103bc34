"""``shard_parameters=``: the module's parameters sharded at rest over the device list, gathered unit by unit just
in time (ZeRO-3 in one process). Each parameter lives whole on one owner; a unit's are all-gathered where a
replica runs it and freed after it, gathered again for its backward, whose gradients are reduce-scattered into
the attached ShardedOptimizer's shards. Rules: docs/sharded_parameters.md."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpcore import comm
from dpcore._functions import _filled, apply
from dpcore._unit_plan import Unit, balance, plan_units

__all__ = ["ShardedParameters"]

#: Tensor metadata an unloaded parameter still answers (everything else is an error naming it).
_METADATA = {"shape", "dtype", "device", "size", "dim", "ndim", "numel", "nelement", "element_size", "requires_grad"}
_METADATA |= {"is_leaf", "grad_fn", "grad", "is_cuda", "is_sparse", "is_meta", "layout", "is_floating_point"}
_METADATA |= {"is_complex", "names", "_version"}


class _Unloaded(torch.Tensor):
    """What a replica's parameter slot holds while its unit is not gathered: its metadata, no memory; any other
    use is an error naming it."""

    _label: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(func.__self__, "__name__", name)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        label = next((a._label for a in tree_leaves((args, kwargs)) if isinstance(a, _Unloaded)), "a parameter")
        raise RuntimeError(
            f"shard_parameters=True: the forward used {label} outside that unit (in {name}): a unit's parameters are "
            f"gathered only while that unit's forward runs; read a parameter in the forward of a module of its unit "
            f"(or give shard_parameters= a policy whose units hold the modules that share it)"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"<unloaded {self._label}: {self.dtype}{list(self.shape)} on {self.device}>"


class _Replica(NamedTuple):
    """A module's replica at one position: its parameter slots, children, and own attributes (a unit's forward)."""

    module: nn.Module
    params: dict[str, Any]
    children: dict[str, Any]
    own: dict[str, Any]


class _GatherUnit(torch.autograd.Function):
    """``apply(state, copies, u, *shards)``: unit u's parameters on every position (position-major; a position's own
    shards as aliases), unfilled. Backward reduce-scatters every position's gradients into the attached optimizer's
    shards and frees the copies (`copies`: their :class:`_Copies`)."""

    @staticmethod
    def forward(state: ShardedParameters, copies: _Copies, u: int, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(t for row in state._gathered(u) for t in row)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.set_materialize_grads(False)
        ctx.state, ctx.copies, ctx.u = inputs[:3]
        n = len(inputs) - 3
        frozen = [i for i, t in enumerate(inputs[3:]) if not t.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*[output[k] for k in range(len(output)) if k % n in frozen])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        n = len(ctx.state.units[ctx.u].params)
        ctx.state._reduce(ctx.copies, ctx.u, [list(grads[k : k + n]) for k in range(0, len(grads), n)])
        return (None,) * (n + 3)


class _Hold(torch.autograd.Function):
    """``apply(state, copies, u, d, *tensors)``: position d's tensors of unit u (aliases); its backward, run once
    position d's gradients of them are complete, adds what a reentrant recomputation left on the refilled leaves and
    frees d's copies before the unit's reduce-scatter waits for the others."""

    @staticmethod
    def forward(
        state: ShardedParameters, copies: _Copies, u: int, d: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.set_materialize_grads(False)
        ctx.state, ctx.copies, ctx.u, ctx.d = inputs[:4]
        frozen = [output[i] for i, t in enumerate(inputs[4:]) if not t.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        left = ctx.state._harvest(ctx.copies, ctx.d)
        ctx.state._unload(ctx.copies, ctx.u, ctx.d)
        return (None, None, None, None, *(_plus(g, e) for g, e in zip(grads, left)))


class ShardedParameters:
    """The parameters of `module` sharded over `devices`: each one whole at its owner (:meth:`owner_of`, bytes
    balanced), the module's own tensor emptied (``numel() == 0``) where the owner is not position 0 (the module's
    state_dict/load_state_dict give and take whole values, by two hooks); replicas per position (position 0 sharing
    the module's buffers) whose units gather their parameters just in time. A structural change of the module after
    sharding is not followed (``valid()`` stays True)."""

    def __init__(
        self, module: nn.Module, devices: Sequence[torch.device], policy: Any, reshard_after_forward: bool
    ) -> None:
        self.module, self.devices = module, list(devices)
        self.reshard_after_forward = reshard_after_forward
        self.units = plan_units(module, policy)
        self.sink: Any = None  # the ShardedOptimizer that sums the gradients, set by the pipeline before each call
        self.sharded, self.aliases = True, {}  # the replica cache's interface (Pipeline._sharded)
        #: The most bytes of parameters (shards and gathered copies) a position may hold; None: no limit.
        self.budget: int | None = None
        self._lock = threading.Lock()
        self._modules = [m for _, m in module.named_modules(remove_duplicate=True)]
        params = list(module.parameters())
        loads = [0] * len(self.devices)
        owners = balance([p.numel() * p.element_size() for p in params], loads)
        self._owner = {id(p): k for p, k in zip(params, owners)}
        self._rest = loads  # bytes of shards at rest per position
        self._peak = list(loads)
        self._shards: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for p, k in zip(params, owners):
                shard = p.detach() if k == 0 else p.detach().to(self.devices[k], copy=True)
                self._shards[id(p)] = shard.requires_grad_(p.requires_grad)
                if k != 0:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._unloaded = [[self._sentinel(p, u, d) for u in self.units for p in u.params] for d in self.devices]
        self._rows = [self._replicate(d) for d in range(len(self.devices))]
        module.register_state_dict_post_hook(lambda *args: self._saved(*args))  # (torch marks the hook object)
        module.register_load_state_dict_pre_hook(lambda *args: self._loading(*args))
        self._call = _Call()  # the call in progress (replicas() starts one)
        self._copies: weakref.WeakSet[_Copies] = weakref.WeakSet()  # every unit's copies still alive
        self._live = [0] * len(self.devices)  # their bytes per position, running
        self._after_queued = False  # _after_backward queued for the backward running now
        #: Gather the next unit while one runs (the forward's next, the backward's previous): on CUDA on a side
        #: stream per position, overlapping the compute; on CPU lists it only moves the copy earlier (off there).
        self.prefetch = all(d.type == "cuda" for d in self.devices)
        self._after: dict[int, dict[int, int]] = {}  # per position: the unit that ran after each in the last call
        self._side: dict[int, torch.cuda.Stream] = {}

    # -- placement --

    def owner_of(self, param: torch.Tensor) -> int:
        """The position whose shard holds `param` whole."""
        return self._owner[id(param)]

    def shard(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s value at its owner (what the optimizer steps; an alias of the module's at position 0)."""
        return self._shards[id(param)]

    def held_bytes(self) -> dict[int, dict[str, int]]:
        """Per position: ``parameters`` (its shards), ``gathered`` (copies alive now) and ``peak_parameters`` (the most
        of both at once since the last :meth:`reset_peak`)."""
        return {
            k: {"parameters": self._rest[k], "gathered": self._gathered_bytes(k), "peak_parameters": self._peak[k]}
            for k in range(len(self.devices))
        }

    def reset_peak(self) -> None:
        self._peak = [r + self._gathered_bytes(k) for k, r in enumerate(self._rest)]

    def replica_bytes(self) -> int:
        """Bytes of persistent parameter copies per replica: none (the replica cache's interface)."""
        return 0

    def valid(self) -> bool:
        return True

    def invalidate(self) -> None:
        """Nothing to refresh: every call gathers from the shards."""

    # -- checkpoints --

    def full(self, param: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """`param`'s whole value, copied to `device`."""
        return self._shards[id(param)].detach().to(device, copy=True)

    def _saved(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """The module's state-dict hook: each parameter's entry its whole value, copied to the CPU one at a time."""
        for name, p in module.named_parameters(remove_duplicate=False):
            if prefix + name in state_dict:
                state_dict[prefix + name] = self.full(p)

    def _loading(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """The module's load pre-hook: each parameter whose owner is not position 0 is written into its shard, and
        its entry becomes the module's empty tensor (which the load then copies as is)."""
        with torch.no_grad():
            for name, p in module.named_parameters(remove_duplicate=False):
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and self._owner[id(p)] != 0:
                    shard = self._shards[id(p)]
                    if value.shape != shard.shape:
                        raise RuntimeError(
                            f"state_dict[{prefix + name!r}]: expected shape {list(shard.shape)} (the parameter's), "
                            f"but got {list(value.shape)}"
                        )
                    shard.copy_(value)
                    state_dict[prefix + name] = p.detach()

    # -- the replicas --

    def _sentinel(self, p: nn.Parameter, unit: Unit, device: torch.device) -> torch.Tensor:
        empty = torch.empty((), dtype=p.dtype, device=device).expand(p.shape)
        t = torch.Tensor._make_subclass(_Unloaded, empty, False)
        t._label = f"a parameter of unit {unit.name or '(the root)'!r} ({p.dtype}{list(p.shape)})"
        return t

    def _replicate(self, d: int) -> list[_Replica]:
        """Position d's replica of each module, with its own parameter slots (unloaded) and children, and each
        unit root's forward."""
        row = [m._replicate_for_data_parallel() for m in self._modules]
        index = {id(m): i for i, m in enumerate(self._modules)}
        out = []
        for m, r in zip(self._modules, row):
            children = {n: None if c is None else row[index[id(c)]] for n, c in m._modules.items()}
            out.append(_Replica(r, dict(m._parameters), children, {}))
        flat = 0
        for u, unit in enumerate(self.units):
            for j, name, k in unit.slots:
                out[j].params[name] = self._unloaded[d][flat + k]
            flat += len(unit.params)
            if unit.params:
                out[unit.root].own["forward"] = self._runner(u, d, out[unit.root].module)
        return out

    def _runner(self, u: int, d: int, replica: nn.Module) -> Callable[..., Any]:
        """Unit u's forward on position d: gathered, run, freed (reshard_after_forward), refilled before its
        backward."""
        unit, original = self.units[u], type(replica).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            copies = self._load(self._call, u, d)
            try:
                out = replica.__dict__.get("_dp_forward", original.__get__(replica))(*args, **kwargs)
            finally:
                if (self.reshard_after_forward or not torch.is_grad_enabled()) and d not in copies.leaves:
                    self._unload(copies, u, d)  # (a recomputation inside its backward keeps them)
            needing = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if needing:  # its backward reads the weights, trainable or not: gathered again first
                copies.hooked.add(d)
                torch.autograd.graph.register_multi_grad_hook(needing, lambda _: self._refill(copies, u, d), mode="any")
                inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
                if not copies.graph and inputs:  # a frozen unit: no node of its own frees them after its backward
                    torch.autograd.graph.register_multi_grad_hook(inputs, lambda _: self._unload(copies, u, d))
            return out

        forward.__name__ = f"forward of unit {unit.name or '(root)'}"
        return forward

    def replicas(self, n: int) -> list[nn.Module]:
        """Position 0..n-1's replicas, synced with the module (its attributes and training state; position 0 shares
        its buffers, the others get copies); every unit unloaded, for a new call (an earlier call's tensors stay
        its own, for its backward)."""
        with self._lock:
            last, self._call = self._call, _Call()
            if last.order:  # the next call prefetches in the order this one ran
                self._after = {d: dict(zip(order, order[1:])) for d, order in last.order.items()}
            for copies, _ in last.units.values():  # prefetched, never run: freed now
                for d in copies.positions:
                    if copies.filled[d] and d not in copies.ran:
                        self._free(copies, copies.unit, d)
            for u in range(len(self.units)):
                for d in range(len(self.devices)):
                    self._slots(u, d, None)
            self._live = [self._gathered_bytes(d) for d in range(len(self.devices))]
            roots = []
            for d in range(n):
                for m, rep in zip(self._modules, self._rows[d]):
                    state = dict(m.__dict__)
                    if "forward" in rep.own and "forward" in state:  # an instance's own forward, run by its unit's
                        state["_dp_forward"] = state.pop("forward")
                    state.update(rep.own, _parameters=rep.params, _modules=rep.children, _is_replica=True)
                    state["_buffers"] = m._buffers if d == 0 else self._buffers(m, d)
                    rep.module.__dict__ = state
                roots.append(self._rows[d][0].module)
            return roots

    def _buffers(self, m: nn.Module, d: int) -> dict[str, Any]:
        device = self.devices[d]
        with torch.no_grad():
            return {k: None if b is None else b.to(device, copy=True) for k, b in m._buffers.items()}

    # -- gathering --

    def _gathered(self, u: int) -> list[list[torch.Tensor]]:
        """Unit u's tensors for every position, unfilled (no memory) but an owner's (its shard)."""
        params = self.units[u].params
        rows = []
        for d, device in enumerate(self.devices):
            row = []
            for p in params:
                shard = self._shards[id(p)]
                if self._owner[id(p)] == d:
                    row.append(shard.detach())
                else:
                    t = torch.empty_like(shard, device=device)
                    t.untyped_storage().resize_(0)
                    row.append(t)
            rows.append(row)
        return rows

    def _load(self, call: _Call, u: int, d: int) -> _Copies:
        """Puts unit u's parameters into position d's slots, gathered there (the call's tensors made once, for
        every position, with the autograd node whose backward reduce-scatters their gradients); with
        :attr:`prefetch`, then gathers there the unit that ran after u in the previous call."""
        with self._lock:
            key, (copies, rows) = self._entry(call, u, d)
            if not copies.filled[d]:
                self._fill(copies, u, d)
            self._ready(copies, d)
            held = call.held.get((key, d))
            if held is None:
                grad = copies.graph and any(t.requires_grad for t in rows[d])
                held = call.held[key, d] = list(apply(_Hold, self, copies, u, d, *rows[d])) if grad else rows[d]
            self._slots(u, d, held)
            if key == u and not torch.is_grad_enabled():
                call.without_grad.add((u, d))
            first = d not in copies.ran
            copies.ran.add(d)
            if key == u and first:  # u's first run at d in this call
                order = call.order.setdefault(d, [])
                if order:
                    copies.before[d] = call.units[order[-1]][0]
                order.append(u)
                after = self._after.get(d, {}).get(u)
                if self.prefetch and after is not None:
                    _, (ahead, _) = self._entry(call, after, d)
                    if not ahead.filled[d]:
                        self._fill(ahead, after, d, early=True)
            return copies

    def _entry(self, call: _Call, u: int, d: int) -> tuple[Any, tuple[_Copies, list[list[torch.Tensor]]]]:
        """The call's record of unit u for position d (made on first use) and its key in ``call.units``."""
        shards = [self._shards[id(p)] for p in self.units[u].params]
        graph = torch.is_grad_enabled() and any(s.requires_grad for s in shards)
        key: int | tuple[int, int] = u
        if graph and u in call.units and (not call.units[u][0].graph or (u, d) in call.without_grad):
            key = (u, d)  # a recomputation with grad of a forward without (reentrant checkpointing): its own node
        entry = call.units.get(key)
        if entry is None:
            copies = _Copies(u, len(self.devices), graph, [d] if key != u else range(len(self.devices)))
            self._copies.add(copies)
            if copies.graph:
                flat = apply(_GatherUnit, self, copies, u, *shards)
            else:
                flat = tuple(t for row in self._gathered(u) for t in row)
            k = len(shards)
            rows = [list(flat[i : i + k]) for i in range(0, len(flat), k)]
            copies.tensors = [[t.detach() for t in row] for row in rows]  # no reference back to the graph
            entry = call.units[key] = (copies, rows)
        return key, entry

    def _unload(self, copies: _Copies, u: int, d: int) -> None:
        """Frees position d's copies of unit u (not its own shards) and unloads its slots."""
        with self._lock:
            if copies.filled[d]:
                self._free(copies, u, d)
            self._slots(u, d, None)
            copies.leaves.pop(d, None)

    def _refill(self, copies: _Copies, u: int, d: int) -> None:
        """Before unit u's backward on position d: its copies gathered again where freed, and in the slots as leaves
        (a recomputation inside the unit reads them; a reentrant one leaves its gradients on them, summed by
        :meth:`_Hold.backward` or at the end of the backward)."""
        with self._lock:
            if copies.tensors:
                if not copies.filled[d]:
                    self._fill(copies, u, d)
                needs = [self._shards[id(p)].requires_grad for p in self.units[u].params]  # as in the forward
                self._ready(copies, d)
                copies.refilled.add(d)
                copies.leaves[d] = [t.detach().requires_grad_(r) for t, r in zip(copies.tensors[d], needs)]
                self._slots(u, d, copies.leaves[d])
                before = copies.before.get(d)  # the next unit of this backward (if it has one here), gathered ahead
                ahead = before is not None and d in before.hooked and d not in before.refilled
                if self.prefetch and ahead and before.tensors and not before.filled[d]:  # type: ignore[union-attr]
                    self._fill(before, before.unit, d, early=True)  # type: ignore[union-attr]
                if not self._after_queued:
                    self._after_queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _harvest(self, copies: _Copies, d: int) -> list[torch.Tensor | None]:
        """The gradients left on position d's refilled leaves (by a reentrant recomputation), taken: each once."""
        out = [None if t.grad is None else t.grad for t in copies.leaves.get(d, ())]
        for t in copies.leaves.get(d, ()):
            t.grad = None
        return out or [None] * len(self.units[copies.unit].params)

    def _after_backward(self) -> None:
        """At the end of a backward: what reentrant recomputations left on refilled leaves whose unit's node never
        ran (every use of its parameters recomputed) summed into the sink, and those copies freed; so are copies
        prefetched for a unit that did not run."""
        self._after_queued = False
        for copies in list(self._copies):
            for d in copies.positions:
                if copies.filled[d] and d not in copies.ran:
                    with self._lock:
                        self._free(copies, copies.unit, d)
            for d in list(copies.leaves):
                left = self._harvest(copies, d)
                if any(g is not None for g in left):
                    self._sum(copies.unit, [left if k == d else [None] * len(left) for k in range(len(self.devices))])
                self._unload(copies, copies.unit, d)

    def _reduce(self, copies: _Copies, u: int, grads: list[list[torch.Tensor | None]]) -> None:
        """Unit u's backward: every position's gradients summed into the sink at the owners, then the copies freed."""
        self._sum(u, grads)
        with self._lock:
            for d in copies.positions:
                if copies.filled[d]:
                    self._free(copies, u, d)
                self._slots(u, d, None)
            copies.tensors, copies.leaves = [], {}

    def _sum(self, u: int, grads: list[list[torch.Tensor | None]]) -> None:
        """Per position, unit u's parameters' gradients (None where absent) reduce-scattered into the sink."""
        sink = self.sink
        if sink is None:
            raise RuntimeError(
                "shard_parameters=True: this backward sums the gradients into the shards of a "
                "dpcore.ShardedOptimizer, but none is attached to the wrapper: build dpcore.ShardedOptimizer("
                "model.parameters(), ..., devices=dp) before the backward"
            )
        used, rows, _ = _filled(grads, self.devices)
        params = self.units[u].params
        if used:
            masters = [params[j] for j in used]
            sink.add(masters, comm.reduce_scatter_coalesced(rows, self.devices, [self._owner[id(p)] for p in masters]))

    def _fill(self, copies: _Copies, u: int, d: int, early: bool = False) -> None:
        """Position d's copies of unit u allocated and copied from their owners (unseen by version counters). An
        `early` fill (a prefetch) on CUDA copies on position d's side stream, after what its stream has queued; the
        stream waits for it where the copies are used (:meth:`_ready`)."""
        params = self.units[u].params
        pulled = [(t, self._shards[id(p)]) for p, t in zip(params, copies.tensors[d]) if self._owner[id(p)] != d]
        for t, shard in pulled:
            self._count(copies, d, _nbytes(shard))
            t.untyped_storage().resize_(_nbytes(shard))  # allocated on the stream that uses and frees them
        device = self.devices[d]
        side = early and device.type == "cuda"
        if side:
            if d not in self._side:
                self._side[d] = torch.cuda.Stream(device)
            self._side[d].wait_stream(torch.cuda.current_stream(device))
        with (
            torch.no_grad(),
            torch.autograd._unsafe_preserve_version_counter(tuple(t for t, _ in pulled)),
            torch.cuda.stream(self._side[d]) if side else contextlib.nullcontext(),
        ):
            for t, shard in pulled:
                t.copy_(shard, non_blocking=side)
            if side:
                copies.ready[d] = torch.cuda.current_stream(device).record_event()
        copies.filled[d] = True

    def _ready(self, copies: _Copies, d: int) -> None:
        """Position d's stream waits for a prefetch of `copies` still in flight on its side stream."""
        event = copies.ready.pop(d, None)
        if event is not None:
            torch.cuda.current_stream(self.devices[d]).wait_event(event)

    def _free(self, copies: _Copies, u: int, d: int) -> None:
        self._ready(copies, d)  # (a prefetch never used: its memory reused only after its copy)
        params = self.units[u].params
        for i, t in enumerate(copies.tensors[d]):
            if self._owner[id(params[i])] != d:
                self._count(copies, d, -_nbytes(t))
                t.untyped_storage().resize_(0)
        copies.filled[d] = False

    def _slots(self, u: int, d: int, tensors: list[torch.Tensor] | None) -> None:
        unit, row = self.units[u], self._rows[d]
        base = sum(len(self.units[v].params) for v in range(u))
        for j, name, k in unit.slots:
            row[j].params[name] = self._unloaded[d][base + k] if tensors is None else tensors[k]

    def _gathered_bytes(self, d: int) -> int:
        """The bytes gathered at position d by every call whose tensors still exist."""
        return sum(copies.live[d] for copies in self._copies)

    def _count(self, copies: _Copies, d: int, nbytes: int) -> None:
        """Counts `nbytes` gathered (or freed, negative) at position d by `copies`; over the budget is an error. The
        running total is made exact again at each call (a record dropped unfreed, with its graph, leaves it)."""
        live = self._live[d] + nbytes
        if nbytes > 0 and self.budget is not None and self._rest[d] + live > self.budget:
            raise RuntimeError(
                f"budget: position {d} ({self.devices[d]}) would hold {self._rest[d] + live} bytes of parameters "
                f"({self._rest[d]} in its shards, {live} gathered), over its budget of {self.budget}; use smaller "
                f"units (shard_parameters=) or more devices"
            )
        copies.live[d] += nbytes
        self._live[d] = live
        self._peak[d] = max(self._peak[d], self._rest[d] + live)


class _Copies:
    """One unit's copies in one call, as its autograd nodes and hooks see them (nothing here refers back to the
    graph, which keeps this alive until its backward): its unit, the positions it serves (all, or the one whose
    reentrant recomputation made it), per position the tensors (detached), whether filled, the leaves a backward
    refilled (by position) and the bytes filled (``live``)."""

    def __init__(self, unit: int, positions: int, graph: bool, serves: Sequence[int]) -> None:
        self.unit, self.graph = unit, graph  # graph: made with autograd nodes
        self.positions = list(serves)
        self.tensors: list[list[torch.Tensor]] = []
        self.filled = [False] * positions
        self.leaves: dict[int, list[torch.Tensor]] = {}
        self.live = [0] * positions
        self.ran: set[int] = set()  # positions whose forward ran it (else it was only prefetched)
        self.hooked: set[int] = set()  # positions where its backward will refill it (its outputs need grad)
        self.refilled: set[int] = set()  # positions where its backward started
        self.before: dict[int, _Copies] = {}  # per position, the unit that ran before it in this call
        self.ready: dict[int, torch.cuda.Event] = {}  # per position, a prefetch in flight


class _Call:
    """One call: per unit its :class:`_Copies` and its node's outputs (position-major rows; keyed (unit, position)
    for a reentrant recomputation's), per (key, position) what the slots hold in the forward, and per position the
    order the units' forwards started in."""

    def __init__(self) -> None:
        self.units: dict[int | tuple[int, int], tuple[_Copies, list[list[torch.Tensor]]]] = {}
        self.held: dict[tuple[int | tuple[int, int], int], list[torch.Tensor]] = {}
        self.order: dict[int, list[int]] = {}  # per position, the units in the order their forwards started
        self.without_grad: set[tuple[int, int]] = set()  # (unit, position) run with grad disabled


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
