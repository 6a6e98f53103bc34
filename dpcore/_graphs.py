"""``DataParallel(..., cuda_graphs=True)``: each replica's forward and backward captured once per call signature and
replayed, else run eagerly with one warning (docs/design.md, "CUDA graphs"; docs/cuda_graphs.md)."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as module_mod

from dpcore import _pytree as pt
from dpcore._loader import _C

if TYPE_CHECKING:
    from dpcore.replicate import ReplicaCache

__all__ = ["GraphRunner", "call_signature", "hook_reason", "Uncapturable", "WARMUP_CALLS", "CACHE_SIZE"]

_MakeCall = Callable[[nn.Module], Callable[..., Any]]  # replica -> what to call it with
_Leaves = list[list[torch.Tensor]]  # per replica, its input tensors in flatten order

#: Eager calls of a signature before it is captured (as torch's make_graphed_callables).
WARMUP_CALLS = 3
#: Captured signatures kept per wrapper; the least recently used is dropped.
CACHE_SIZE = 8
#: Signatures whose calls are counted towards their warm-up.
_SEEN_SIZE = 64

#: The device type graphs capture (a test stands the CPU in for CUDA).
_DEVICE_TYPE = "cuda"

_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in _MODULE_HOOK_DICTS)


class Uncapturable(Exception):
    """A call that a CUDA graph cannot capture; the message says why."""


def hook_reason(modules: Sequence[nn.Module]) -> str | None:
    """Why `modules` cannot be captured because of hooks (a module's or a global forward or backward hook, which a
    replay would skip), or None."""
    for name in _GLOBAL_HOOK_DICTS:
        if getattr(module_mod, name, None):
            return f"a global module hook is registered (torch.nn.modules.module.{name})"
    for m in modules:
        for name in _MODULE_HOOK_DICTS:
            if getattr(m, name, None):
                return f"a {type(m).__name__} module has a hook registered ({name})"
    return None


def _flatten_input(args: tuple[Any, ...], kwargs: dict[str, Any], root: str) -> tuple[list[torch.Tensor], Any]:
    """(tensors, key) of one replica's call: its tensors in flatten order and a hashable key (the pytree spec of
    ``(args, kwargs)`` and each tensor's metadata). Raises Uncapturable, naming the path under `root`, for a tensor off
    CUDA or not dense, or an unhashable leaf."""
    tree = (args, kwargs)
    tensors, spec = pt.flatten(tree)
    metas = []
    for i, t in enumerate(tensors):
        only = "CUDA" if t.device.type != _DEVICE_TYPE else "dense" if t.layout != torch.strided else None
        if only is not None:
            what = f"a tensor on {t.device}" if only == "CUDA" else f"a {t.layout} tensor"
            raise Uncapturable(
                f"{pt.tensor_path(tree, spec, i, root)} is {what}; a CUDA graph takes {only} tensors only"
            )
        metas.append((tuple(t.shape), t.stride(), t.dtype, t.device.index, t.requires_grad))
    try:
        hash(spec)
    except TypeError:
        found = spec.unhashable_leaf()
        if found is None:
            raise
        trail, value = found
        raise Uncapturable(
            f"{pt.path_at(tree, trail, root)} is an unhashable {type(value).__name__}, which a captured graph would "
            f"have to bake in"
        ) from None
    return tensors, (spec, tuple(metas))


def _signature(
    args: Sequence[Any], kws: Sequence[dict[str, Any]], used: Sequence[int], modules: Sequence[nn.Module]
) -> tuple[tuple[Any, ...], _Leaves, list[Any]]:
    """call_signature's key and, per replica, its input tensors and its ``(args, kwargs)`` spec."""
    cuda_autocast = torch.is_autocast_enabled("cuda")
    if cuda_autocast and torch.is_autocast_cache_enabled():
        raise Uncapturable(
            "autocast runs with its weight cache enabled; CUDA graphs need torch.autocast(..., cache_enabled=False)"
        )
    flat = [_flatten_input(a, k, f"replica {i}'s input") for i, a, k in zip(used, args, kws)]
    replicas = tuple(key for _, key in flat)
    autocast = (cuda_autocast, torch.get_autocast_dtype("cuda") if cuda_autocast else None)
    training = tuple(m.training for m in modules)
    key = (tuple(used), replicas, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, training)
    return key, [tensors for tensors, _ in flat], [spec for _, (spec, _) in flat]


def call_signature(
    args: Sequence[Any], kws: Sequence[dict[str, Any]], used: Sequence[int], modules: Sequence[nn.Module]
) -> tuple[Any, ...]:
    """The key a call's captured graphs are kept under: the replicas used, each one's argument structure and tensor
    metadata, grad, inference and CUDA autocast state, every module's training flag. Raises Uncapturable when the call
    cannot be captured."""
    return _signature(args, kws, used, modules)[0]


class _ReplayToken:
    """Lives as long as one replay's autograd node; says whether its backward ran."""

    __slots__ = ("done", "replay", "__weakref__")

    def __init__(self, replay: int) -> None:
        self.done = False
        self.replay = replay  # which replay of its graph


#: Graphs whose capture failed, kept alive: the allocator may still refer to them.
_ABANDONED: list[torch.cuda.CUDAGraph] = []


@contextlib.contextmanager
def _capturing(
    graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream, rng: torch.Generator
) -> Iterator[None]:
    """Captures the block's CUDA work on `stream` into `graph` (memory from `pool`), with `rng` as the device
    generator's state, which replays then draw from. On an error the capture is abandoned; the previous stream and
    generator state are restored in every case."""
    device = stream.device
    generator = torch.cuda.default_generators[device.index]
    previous = generator.graphsafe_get_state()
    generator.graphsafe_set_state(rng)
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                yield
                graph.capture_end()
            except BaseException:  # end the capture as far as torch lets one, and keep the graph
                with contextlib.suppress(Exception):
                    graph.capture_end()
                end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
                if end_pool is not None:
                    with contextlib.suppress(Exception):
                        end_pool(device.index, pool)
                _ABANDONED.append(graph)
                raise
    finally:
        generator.graphsafe_set_state(previous)


class _ReplicaGraph:
    """One replica's captured forward (and backward) for one signature: :meth:`load` then :meth:`launch` replay it;
    with grad, the outputs carry an autograd node whose backward replays the captured backward."""

    def __init__(
        self,
        call: Callable[..., Any],
        leaves: list[torch.Tensor],
        spec: pt.Spec,
        params: list[torch.Tensor],
        stream: torch.cuda.Stream,
        rng: torch.Generator,
        keep: Any,
        copy_grads: bool,
    ) -> None:
        self.keep = keep  # the replica buffers the captured memory views: a pending node may outlive the cache
        self.copy_grads = copy_grads  # replica 0 alone: its gradients reach the caller directly, so as copies
        self.replays = 0
        self.stream = stream
        self.device = stream.device
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            # this call's values, not garbage: no capture sees bad indices or non-finite numbers
            self.static_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        self.input_needs_grad = [t.requires_grad for t in leaves]
        static_args, static_kwargs = spec.unflatten(self.static_inputs)
        self.pool = torch.cuda.graph_pool_handle()
        self.fwd = torch.cuda.CUDAGraph()
        grad = torch.is_grad_enabled()
        with _capturing(self.fwd, self.pool, stream, rng):
            output = call(*static_args, **static_kwargs)
        outputs, self.output_spec = pt.flatten(output)
        self.output_needs_grad = [grad and o.requires_grad for o in outputs]
        self.bwd: torch.cuda.CUDAGraph | None = None
        self.static_grad_outputs: list[torch.Tensor] = []
        self.static_grads: list[torch.Tensor | None] = []
        if any(self.output_needs_grad):
            surface = [s for s, g in zip(self.static_inputs, self.input_needs_grad) if g] + list(params)
            differentiable = [o for o, g in zip(outputs, self.output_needs_grad) if g]
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                self.static_grad_outputs = [torch.empty_like(o) for o in differentiable]
            self.bwd = torch.cuda.CUDAGraph()
            with _capturing(self.bwd, self.pool, stream, rng):
                grads = (
                    torch.autograd.grad(differentiable, surface, self.static_grad_outputs, allow_unused=True)
                    if surface
                    else ()
                )
            self.static_grads = list(grads)
        self.static_outputs = [o.detach() for o in outputs]
        self._pending: weakref.ref[_ReplayToken] | None = None

    def busy(self) -> bool:
        """Whether the last replay's backward, which needs its activations, is still to come."""
        token = self._pending() if self._pending is not None else None
        return token is not None and not token.done

    def load(self, leaves: Sequence[torch.Tensor]) -> None:
        """Copies the inputs into the placeholders on the caller's stream (to wait for before :meth:`launch`)."""
        with torch.no_grad(), torch.cuda.device(self.device):
            for placeholder, value in zip(self.static_inputs, leaves):
                if placeholder.data_ptr() != value.data_ptr():
                    placeholder.copy_(value)

    def launch(self, leaves: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> Any:
        """Replays the forward on this replica's stream; the output aliases static memory until the next replay. With a
        backward graph, it carries a _Replay node over the differentiable `leaves` and `params`."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if self.bwd is None:
                self.fwd.replay()
                outputs: Sequence[torch.Tensor] = self.static_outputs
            else:
                differentiable = [t for t, g in zip(leaves, self.input_needs_grad) if g]
                self.replays += 1
                token = _ReplayToken(self.replays)
                self._pending = weakref.ref(token)
                outputs = _Replay.apply(self, token, *differentiable, *params)
        return self.output_spec.unflatten(outputs)

    def backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """Replays the backward; returns the static gradients of the differentiable inputs and parameters."""
        assert self.bwd is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            slots = iter(self.static_grad_outputs)
            for grad, needed in zip(grads, self.output_needs_grad):
                if not needed:
                    continue
                slot = next(slots)
                if grad is None:
                    slot.zero_()
                elif slot.data_ptr() != grad.data_ptr():
                    slot.copy_(grad)
                    grad.record_stream(self.stream)  # read here, maybe freed on its own stream
            self.bwd.replay()
        # the static tensors themselves: referenced, autograd never steals them into a .grad
        if self.copy_grads:
            return tuple(g.clone() if g is not None else None for g in self.static_grads)
        return tuple(self.static_grads)


class _Replay(torch.autograd.Function):
    """Autograd node of one replay: ``apply(graph, token, *inputs, *params)``."""

    @staticmethod
    def forward(
        ctx: Any, graph: _ReplicaGraph, token: _ReplayToken, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.graph = graph
        ctx.token = token
        graph.fwd.replay()
        outputs = tuple(o.detach() for o in graph.static_outputs)
        frozen = [o for o, g in zip(outputs, graph.output_needs_grad) if not g]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.token.replay != ctx.graph.replays:
            raise RuntimeError(
                "DataParallel(cuda_graphs=True): backward through a replayed call whose activations a later call "
                "with the same input signature has overwritten (a second backward with retain_graph=True after "
                "another forward); run such steps with cuda_graphs=False"
            )
        result = ctx.graph.backward(grads)
        ctx.token.done = True
        return (None, None) + result


class _SignatureGraphs:
    """The captured graphs of one signature, one per replica used, and what they assumed about the master."""

    def __init__(self, graphs: list[_ReplicaGraph], slots: list[list[tuple[int, int]]], module: nn.Module):
        self.graphs = graphs
        self.slots = slots  # per replica (after the first): (bucket, copy index) of each parameter
        self.master_params = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        self.master_tensors = [*module.parameters(), *module.buffers()]
        self.master_ptrs = self.current_ptrs()

    def current_ptrs(self) -> tuple[int, ...]:
        """Where the master's parameters and buffers live now."""
        return tuple(t.data_ptr() for t in self.master_tensors)


class GraphRunner:
    """The CUDA-graph side of one DataParallel: per-replica streams, the captured signatures (at most CACHE_SIZE, least
    recently used dropped) and the warm-up counts. It never reads the wrapper."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Any, _SignatureGraphs] = OrderedDict()
        self._seen: OrderedDict[Any, int] = OrderedDict()
        self._refused: dict[Any, str] = {}
        self._warned: set[str] = set()
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._cache: Any = None
        self._modules: list[nn.Module] = []
        self._buffer_buckets: list[Any] = []
        self._devices: list[torch.device] = []

    def reset(self) -> None:
        """Drops every capture and count (the replica buffers were rebuilt)."""
        if self._entries:
            self._synchronize()  # no replay may still read what is freed
        self._entries.clear()
        self._seen.clear()
        self._refused.clear()

    def _synchronize(self) -> None:
        """Waits for all work on the wrapper's devices."""
        for device in self._devices:
            torch.cuda.synchronize(device)

    def _bind(self, cache: ReplicaCache) -> None:
        """Follows the wrapper's current replica cache."""
        if cache is self._cache:
            return
        self.reset()
        self._cache = cache
        self._devices = list(dict.fromkeys(cache.devices))
        self._modules = list(cache.module.modules())
        self._buffer_buckets = cache.buckets_of(cache.module.buffers())

    def _warn(self, reason: str) -> None:
        """Warns once per reason that calls run eagerly."""
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"DataParallel(cuda_graphs=True): running eagerly: {reason}", RuntimeWarning, stacklevel=4)

    def stream(self, index: int, device: torch.device) -> torch.cuda.Stream:
        """Replica `index`'s own stream on `device`."""
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=device)
        return self._streams[index]

    def _generators(self, devices: list[torch.device]) -> list[torch.Generator]:
        """Per replica to capture on `devices`, a fresh random-number state (a failed capture leaves its state unusable)
        seeded as an eager call's replica stream is (_C.replica_seeds: one derivation)."""
        rngs = [torch.cuda.default_generators[device.index].clone_state() for device in devices]
        for rng, seed in zip(rngs, _C.replica_seeds(devices)):
            rng.manual_seed(seed)
        return rngs

    @contextlib.contextmanager
    def _master_stream(self, device: torch.device) -> Iterator[torch.cuda.Stream]:
        """Replica 0's stream, after the caller's, as the current stream: the autograd nodes touching the master's
        parameters are made on it (elsewhere, they would invalidate replica 0's capture)."""
        stream = self.stream(0, device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield stream

    def step(
        self,
        cache: ReplicaCache,
        args: list[tuple[Any, ...]],
        kws: list[dict[str, Any]],
        used: list[int],
        make_call: _MakeCall,
        *,
        combined: bool,
    ) -> list[Any] | None:
        """The outputs of the replicas `used`, each called as ``make_call(replica)(*args[j], **kws[j])``, by replay,
        capture or warm-up; or None for the eager path (the reason warned once). Unless `combined` (the caller makes new
        tensors of them), outputs are cloned so that they never alias graph memory."""
        self._bind(cache)
        reason = hook_reason(self._modules)
        if reason is not None:
            return self._warn(reason)
        try:
            key, leaves, specs = _signature(args, kws, used, self._modules)
        except Uncapturable as e:
            return self._warn(str(e))
        if key in self._refused:
            return self._warn(self._refused[key])
        entry = self._entries.get(key)
        if entry is None:
            seen = self._seen.pop(key, 0) + 1
            self._seen[key] = seen
            while len(self._seen) > _SEEN_SIZE:
                self._seen.popitem(last=False)
            if seen <= WARMUP_CALLS:
                return self._warm_up(cache, args, kws, used, make_call, leaves)
            try:
                entry = self._capture(cache, used, make_call, leaves, specs)
            except Exception as e:  # noqa: BLE001 - any capture failure means: eager for this signature
                with contextlib.suppress(Exception):
                    self._synchronize()
                first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self._refused[key] = f"capture failed ({type(e).__name__}: {first_line})"
                return self._warn(self._refused[key])
            self._entries[key] = entry
            while len(self._entries) > CACHE_SIZE:
                self._synchronize()
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        if entry.current_ptrs() != entry.master_ptrs:
            del self._entries[key]
            self._refused[key] = (
                "a parameter or buffer of the module now lives at another address than when its graphs were "
                "captured (an optimizer or other code replaced it instead of updating it in place)"
            )
            return self._warn(self._refused[key])
        if any(g.busy() for g in entry.graphs):
            return self._warn(
                "forward was called again before the backward of the previous call with the same input "
                "signature ran; a replay would overwrite the activations that backward needs, so such calls "
                "run eagerly"
            )
        outputs = self._replay(cache, entry, used, leaves)
        if combined:
            return outputs
        return [pt.map_tensors(torch.Tensor.clone, o) for o in outputs]

    def _warm_up(
        self, cache: ReplicaCache, args: list[Any], kws: list[Any], used: list[int], call: _MakeCall, leaves: _Leaves
    ) -> list[Any]:
        """An eager call, each replica in this thread on its own stream."""
        with self._master_stream(cache.devices[0]) as master:
            replicas = cache.replicas(used[-1] + 1)
        outputs = []
        callers = []
        for j, i in enumerate(used):
            device = cache.devices[i]
            stream = self.stream(i, device)
            caller = torch.cuda.current_stream(device)
            callers.append((caller, stream))
            stream.wait_stream(caller)
            stream.wait_stream(master)
            for t in leaves[j]:
                t.record_stream(stream)  # allocated on the caller's stream, read on this one
            try:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    outputs.append(call(replicas[i])(*args[j], **kws[j]))
            except BaseException as e:
                e.add_note(f"raised in replica {i} on device {device}")
                raise
        for caller, stream in callers:
            caller.wait_stream(stream)
        return outputs

    def _capture(
        self, cache: ReplicaCache, used: list[int], make_call: _MakeCall, leaves: _Leaves, specs: list[pt.Spec]
    ) -> _SignatureGraphs:
        """Captures every replica of `used` for this call's signature."""
        replicas, slots = cache.capture_replicas(used[-1] + 1)
        self._synchronize()
        graphs = []
        rngs = self._generators([cache.devices[i] for i in used])
        for j, i in enumerate(used):
            device, replica, rng = cache.devices[i], replicas[i], rngs[j]
            params = [p for p in replica.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
            call, stream = make_call(replica), self.stream(i, device)
            graphs.append(_ReplicaGraph(call, leaves[j], specs[j], params, stream, rng, cache, len(used) == 1))
        used_slots = [slots[i - 1] if i > 0 else [] for i in used]
        return _SignatureGraphs(graphs, used_slots, cache.module)

    def _replay(self, cache: ReplicaCache, entry: _SignatureGraphs, used: list[int], leaves: _Leaves) -> list[Any]:
        """Refreshes the replica buffers and replays; the outputs alias graph memory."""
        with self._master_stream(cache.devices[0]) as master:
            copies = cache.refresh_copies()
        callers = [torch.cuda.current_stream(graph.device) for graph in entry.graphs]
        for graph, inputs in zip(entry.graphs, leaves):
            graph.load(inputs)
        # all waits before any replay, the callers' after all launches: replicas of one device overlap
        for graph, caller in zip(entry.graphs, callers):
            graph.stream.wait_stream(caller)
            graph.stream.wait_stream(master)
        outputs = []
        for j, (i, graph) in enumerate(zip(used, entry.graphs)):  # a graph with a backward was captured with grad
            params: list[torch.Tensor] = []
            if graph.bwd is not None:
                params = [copies[b][k] for b, k in entry.slots[j]] if i else entry.master_params  # type: ignore[index]
            outputs.append(graph.launch(leaves[j], params))
        for graph, caller in zip(entry.graphs, callers):
            caller.wait_stream(graph.stream)
        # replays updated buffers (BatchNorm statistics) unseen by version counters
        for bucket in self._buffer_buckets:
            bucket.invalidate()
        return outputs
