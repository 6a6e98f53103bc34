"""CUDA-graph-captured replicas: ``DataParallel(..., cuda_graphs=True)``.

On a GPU the host sets the pace of an eager replicated step: every replica
launches hundreds of kernels one at a time, taking turns under the GIL.
Here each replica's forward and backward are captured once per input
signature into CUDA graphs and replayed (:class:`GraphRunner`): one launch
per graph, and every replica on a stream of its own. The first calls of a
signature run eagerly (lazy initialization happens outside any capture),
the next captures and replays, later ones copy their inputs into the
placeholders and replay; replica gradients reach the master through the
same reductions as in eager mode. What cannot be captured runs eagerly,
with one warning naming the reason.

The rule, the fallbacks and their reasons: docs/design.md, "CUDA graphs",
and docs/cuda_graphs.md. Imported only where ``cuda_graphs=True``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from dpcore import _pytree as pt

__all__ = [
    "GraphRunner",
    "CaptureSource",
    "call_signature",
    "hook_reason",
    "Uncapturable",
    "WARMUP_CALLS",
    "CACHE_SIZE",
]

#: Eager calls of a signature before it is captured (torch's
#: make_graphed_callables warms up 3 times).
WARMUP_CALLS = 3
#: Captured signatures kept per wrapper; the least recently used is dropped.
CACHE_SIZE = 8
#: Signatures whose calls are counted towards their warm-up.
_SEEN_SIZE = 64

#: The device type graphs capture (a test runs the orchestration on a
#: stand-in for CUDA on the CPU).
_DEVICE_TYPE = "cuda"

_GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


class Uncapturable(Exception):
    """A call that a CUDA graph cannot capture; the message says why."""


def hook_reason(modules: Sequence[nn.Module]) -> str | None:
    """Why `modules` (a module and all its submodules) cannot be captured
    because of hooks, or None: a forward or backward hook on any of them, or
    a global module hook, runs Python at call time that a replayed graph
    would skip."""
    from torch.nn.modules import module as module_mod

    for name in _GLOBAL_HOOK_DICTS:
        if getattr(module_mod, name, None):
            return f"a global module hook is registered (torch.nn.modules.module.{name})"
    for m in modules:
        for name in _MODULE_HOOK_DICTS:
            if getattr(m, name, None):
                return f"a {type(m).__name__} module has a hook registered ({name})"
    return None


def _flatten_input(args: tuple[Any, ...], kwargs: dict[str, Any], root: str) -> tuple[list[torch.Tensor], Any]:
    """(tensors, key) of one replica's call: its tensors in flatten order, and
    a hashable description of it: the pytree spec of ``(args, kwargs)`` (its
    containers and their keys, the value of every non-tensor leaf, baked into
    a captured graph) with every tensor's shape, strides, dtype, device and
    requires_grad. Raises Uncapturable for a tensor off CUDA or not dense, or
    an unhashable leaf; the message names its path under `root`."""
    tree = (args, kwargs)
    tensors, spec = pt.flatten(tree)
    metas = []
    for i, t in enumerate(tensors):
        if t.device.type != _DEVICE_TYPE:
            raise Uncapturable(
                f"{pt.tensor_path(tree, spec, i, root)} is a tensor on {t.device}; a CUDA graph takes CUDA tensors only"
            )
        if t.layout != torch.strided:
            raise Uncapturable(
                f"{pt.tensor_path(tree, spec, i, root)} is a {t.layout} tensor; a CUDA graph takes dense tensors only"
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
) -> tuple[tuple[Any, ...], list[list[torch.Tensor]], list[Any]]:
    """(key, tensors, specs) of a call: the key its captured graphs are kept
    under (see call_signature), and per replica its input tensors and the
    spec of its ``(args, kwargs)``, from one walk of each replica's inputs."""
    cuda_autocast = torch.is_autocast_enabled("cuda")
    if cuda_autocast and torch.is_autocast_cache_enabled():
        raise Uncapturable(
            "autocast runs with its weight cache enabled; CUDA graphs need torch.autocast(..., cache_enabled=False)"
        )
    flat = [_flatten_input(a, k, f"replica {i}'s input") for i, a, k in zip(used, args, kws)]
    replicas = tuple(key for _, key in flat)
    autocast = (cuda_autocast, torch.get_autocast_dtype("cuda") if cuda_autocast else None)
    key = (
        tuple(used),
        replicas,
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        autocast,
        tuple(m.training for m in modules),
    )
    return key, [tensors for tensors, _ in flat], [spec for _, (spec, _) in flat]


def call_signature(
    args: Sequence[Any], kws: Sequence[dict[str, Any]], used: Sequence[int], modules: Sequence[nn.Module]
) -> tuple[Any, ...]:
    """The key a call's captured graphs are kept under: which replicas run
    (`used`), each replica's argument structure (the pytree spec of its
    ``(args, kwargs)`` and its tensors' metadata), grad mode, inference mode,
    CUDA autocast state and every module's training flag. Raises
    Uncapturable when the call cannot be captured."""
    return _signature(args, kws, used, modules)[0]


class _ReplayToken:
    """Lives as long as one replay's autograd node; says whether its backward ran."""

    __slots__ = ("done", "replay", "__weakref__")

    def __init__(self, replay: int) -> None:
        self.done = False
        self.replay = replay  # which replay of its graph


@contextlib.contextmanager
def _capturing(
    graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream, rng: torch.Generator
) -> Iterator[None]:
    """Captures the CUDA work of the block on `stream` into `graph` (memory
    from `pool`), with `rng` as the device's default generator state: the
    graph registers that state, so its replays draw fresh numbers from it.
    On an error inside the block the capture is ended and discarded, and the
    previous stream and generator state are restored in every case."""
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
            except BaseException:
                _abandon(graph, pool, device)
                raise
    finally:
        generator.graphsafe_set_state(previous)


#: Graphs whose capture failed. Kept alive: torch's caching allocator may
#: still hold the capture's pool filter, which refers to its graph.
_ABANDONED: list[torch.cuda.CUDAGraph] = []


def _abandon(graph: torch.cuda.CUDAGraph, pool: Any, device: torch.device) -> None:
    """Ends a failed capture as far as torch lets one: the stream leaves
    capture mode (capture_end raises for an invalidated capture before it
    tells the allocator, so that is done here too) and the graph is kept."""
    with contextlib.suppress(Exception):
        graph.capture_end()
    end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end_pool is not None:
        with contextlib.suppress(Exception):
            end_pool(device.index, pool)
    _ABANDONED.append(graph)


class _ReplicaGraph:
    """One replica's captured forward (and backward) for one signature.

    Guarantees: :meth:`load` then :meth:`launch` compute, by replay, what
    the replica's call on the given inputs computes eagerly (with the
    parameters and buffers the captured memory holds then: the master's own
    for replica 0, the refreshed replica buffers for the others); with grad,
    the outputs carry an autograd node whose backward replays the captured
    backward and returns the gradients of the inputs and parameters that
    require grad."""

    def __init__(
        self,
        call: Callable[..., Any],
        leaves: list[torch.Tensor],
        spec: pt.Spec,
        params: list[torch.Tensor],
        stream: torch.cuda.Stream,
        rng: torch.Generator,
        *,
        keep: Any = None,
        copy_grads: bool = False,
    ) -> None:
        # What the captured memory belongs to (the replica buffers) lives as
        # long as this graph, which a pending autograd node may outlive the
        # wrapper's cache with.
        self.keep = keep
        # The only replica (replica 0 alone): its parameter gradients reach
        # the caller directly (torch.autograd.grad, tensor hooks), so they are
        # handed on as copies rather than as static memory.
        self.copy_grads = copy_grads
        self.replays = 0
        self.stream = stream
        self.device = stream.device
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            # Holding this call's values (not garbage): nothing at capture
            # may see out-of-range indices or non-finite numbers.
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
        self.num_params = len(params)
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
        # The captured autograd graph is not needed any more (its saved
        # tensors live in the pool, written by each replay).
        self.static_outputs = [o.detach() for o in outputs]
        self._pending: weakref.ref[_ReplayToken] | None = None

    def busy(self) -> bool:
        """Whether the last replay's backward is still to come (its autograd
        node is alive and has not run): a replay now would overwrite the
        activations it needs."""
        token = self._pending() if self._pending is not None else None
        return token is not None and not token.done

    def load(self, leaves: Sequence[torch.Tensor]) -> None:
        """Copies the call's input tensors (`leaves`, in flatten order) into
        the placeholders, on the caller's current stream of this device (so
        the inputs are only ever read on the stream that made them); the
        replica's stream must wait for that stream before :meth:`launch`."""
        with torch.no_grad(), torch.cuda.device(self.device):
            for placeholder, value in zip(self.static_inputs, leaves):
                if placeholder.data_ptr() != value.data_ptr():
                    placeholder.copy_(value)

    def launch(self, leaves: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> Any:
        """Replays the forward on this replica's stream and returns the
        output, whose tensors alias this graph's static memory until the next
        replay. With a backward graph, the output tensors carry a _Replay
        node whose inputs are the differentiable `leaves` and `params` (the
        replica's parameters that require grad, in capture order)."""
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
        """Replays the backward with `grads` (one per forward output) and
        returns the static gradients of the differentiable inputs and the
        parameters, in forward-argument order."""
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
        # The static tensors themselves, not fresh aliases: autograd steals a
        # gradient only from a tensor nothing else refers to, and a stolen
        # one would become a parameter's .grad that the next replay
        # overwrites; referenced, they are copied or summed out of place.
        if self.copy_grads:
            return tuple(g.clone() if g is not None else None for g in self.static_grads)
        return tuple(self.static_grads)


class _Replay(torch.autograd.Function):
    """Autograd node of one replay: ``_Replay.apply(graph, token,
    *differentiable_inputs, *params)`` replays the graph's forward and returns
    its static outputs; backward replays its backward graph."""

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
    """The captured graphs of one signature: one _ReplicaGraph per replica
    that runs, and what they assumed about the master. The master's tensor
    objects are fixed while the replica cache is valid (any change of them
    rebuilds it), so they are listed once here rather than walked per call."""

    def __init__(self, graphs: list[_ReplicaGraph], slots: list[list[tuple[int, int]]], module: nn.Module):
        self.graphs = graphs
        self.slots = slots  # per replica (after the first): (bucket, copy index) of each parameter
        # replica 0's parameter surface (the master's parameters that require grad, in capture order)
        self.master_params = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        # what replica 0's graph reads and updates in place
        self.master_tensors = [*module.parameters(), *module.buffers()]
        self.master_ptrs = self.current_ptrs()

    def current_ptrs(self) -> tuple[int, ...]:
        """Where the master's parameters and buffers live now."""
        return tuple(t.data_ptr() for t in self.master_tensors)


class CaptureSource(Protocol):
    """What a :class:`GraphRunner` needs of the replicas it captures: the
    wrapper's replica cache (:class:`dpcore.replicate.ReplicaCache`, whose
    section "The CUDA-graph interface" documents the three members below that
    exist for this runner only). The runner holds nothing else of the
    wrapper."""

    #: The master module (replica 0), on ``devices[0]``.
    module: nn.Module
    #: One device per replica, the master's first.
    devices: list[torch.device]

    @property
    def bucket_plan(self) -> list[tuple[Any, list[torch.Tensor], bool]]:
        """(replica buffers, master tensors, requires_grad) of every bucket."""
        ...

    def replicas(self, n: int) -> list[nn.Module]:
        """The master plus n-1 refreshed eager replicas."""
        ...

    def refresh_copies(self) -> list[tuple[torch.Tensor, ...] | None]:
        """The buckets brought up to date; per bucket its autograd-linked copies or None."""
        ...

    def capture_replicas(self, n: int) -> tuple[list[nn.Module], list[list[tuple[int, int]]]]:
        """Replicas whose parameters view the persistent buffers, and where
        each one's parameters sit among refresh_copies()'s copies."""
        ...


class GraphRunner:
    """The CUDA-graph side of one DataParallel: per-replica streams and
    random-number states, the captured signatures (at most CACHE_SIZE, least
    recently used dropped) and the warm-up counts.

    ``step(...)`` returns the replicas' outputs (losses with a criterion) for
    one call, by replay, capture or eager warm-up, or None where the call must
    run on the ordinary eager path (the reason has been warned about once).
    It is given everything it uses: the replica cache (a
    :class:`CaptureSource`), the scattered arguments, the replicas to run and
    how to call one; it never reads the wrapper.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[Any, _SignatureGraphs] = OrderedDict()
        self._seen: OrderedDict[Any, int] = OrderedDict()
        self._refused: dict[Any, str] = {}
        self._warned: set[str] = set()
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._captures = 0
        self._cache: Any = None
        self._modules: list[nn.Module] = []
        self._buffer_buckets: list[Any] = []
        self._devices: list[torch.device] = []

    # -- bookkeeping ------------------------------------------------------

    def reset(self) -> None:
        """Drops every capture and count (after a structural change of the
        master, whose replica buffers were rebuilt)."""
        if self._entries:
            self._synchronize()  # no replay may still read what is freed
        self._entries.clear()
        self._seen.clear()
        self._refused.clear()

    def _synchronize(self) -> None:
        """Waits for all work on the wrapper's devices."""
        for device in self._devices:
            torch.cuda.synchronize(device)

    def _bind(self, cache: CaptureSource) -> None:
        """Follows the wrapper's current replica cache."""
        if cache is self._cache:
            return
        self.reset()
        self._cache = cache
        self._devices = list(dict.fromkeys(cache.devices))
        self._modules = list(cache.module.modules())
        buffers = {id(b) for b in cache.module.buffers()}
        self._buffer_buckets = [
            bucket for bucket, masters, _ in cache.bucket_plan if any(id(t) in buffers for t in masters)
        ]

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"DataParallel(cuda_graphs=True): running eagerly: {reason}", RuntimeWarning, stacklevel=4)

    def stream(self, index: int, device: torch.device) -> torch.cuda.Stream:
        """Replica `index`'s own stream on `device`."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=device)
        return stream

    def _generator(self, index: int, device: torch.device) -> torch.Generator:
        """A fresh random-number state for one capture of replica `index` on
        `device`: a clone of the device's default generator with a seed of
        its own, derived from the device's initial seed, the replica and a
        capture count, so replicas and signatures never repeat one another's
        numbers and a run seeded with torch.manual_seed repeats. Fresh per
        capture: a failed capture leaves its state unusable (torch marks it
        capturing and only a successful capture_end clears that), and it is
        thrown away with the failed graphs."""
        self._captures += 1
        default = torch.cuda.default_generators[device.index]
        rng = default.clone_state()
        rng.manual_seed(
            (default.initial_seed() + 0x9E3779B97F4A7C15 * (index + 1) + 0xBF58476D1CE4E5B9 * self._captures)
            % (1 << 63)
        )
        return rng

    @contextlib.contextmanager
    def _master_stream(self, device: torch.device) -> Iterator[torch.cuda.Stream]:
        """Replica 0's stream, after the caller's stream of that device, as
        the current stream: where the autograd nodes that touch the master's
        parameters (BroadcastBucket, and so the parameters' AccumulateGrad
        nodes) are made. A node keeps the stream it was made on, and one made
        on the caller's (default) stream would make capturing replica 0's
        backward wait for a stream that is not capturing, which invalidates
        the capture; made here, every such node is on replica 0's stream
        (`device`: the master's)."""
        stream = self.stream(0, device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield stream

    # -- one call -----------------------------------------------------------

    def step(
        self,
        cache: CaptureSource,
        args: list[tuple[Any, ...]],
        kws: list[dict[str, Any]],
        used: list[int],
        make_call: Callable[[nn.Module], Callable[..., Any]],
        *,
        combined: bool,
    ) -> list[Any] | None:
        """The outputs of the replicas `used` (indices into ``cache.devices``)
        on their scattered `args`/`kws`, each replica called as
        ``make_call(replica)(*args[j], **kws[j])``, or None for the eager
        path.

        Replayed outputs live in the graphs' static memory, which the next
        replay overwrites: unless `combined` (the caller makes new tensors of
        them, as a gather of several replicas or a weighted sum of their
        losses does, before anything reaches the user), they are returned
        cloned, so what the runner returns never aliases its graphs."""
        self._bind(cache)
        reason = hook_reason(self._modules)
        if reason is not None:
            self._warn(reason)
            return None
        try:
            key, leaves, specs = _signature(args, kws, used, self._modules)
        except Uncapturable as e:
            self._warn(str(e))
            return None
        refused = self._refused.get(key)
        if refused is not None:
            self._warn(refused)
            return None
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
                self._warn(self._refused[key])
                return None
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
            self._warn(self._refused[key])
            return None
        if any(g.busy() for g in entry.graphs):
            self._warn(
                "forward was called again before the backward of the previous call with the same input "
                "signature ran; a replay would overwrite the activations that backward needs, so such calls "
                "run eagerly"
            )
            return None
        outputs = self._replay(cache, entry, used, leaves)
        if combined:
            return outputs
        return [pt.map_tensors(torch.Tensor.clone, o) for o in outputs]

    def _warm_up(
        self,
        cache: CaptureSource,
        args: list[Any],
        kws: list[Any],
        used: list[int],
        make_call: Callable[[nn.Module], Callable[..., Any]],
        leaves: list[list[torch.Tensor]],
    ) -> list[Any]:
        """An eager call, each replica in this thread on its own stream
        (`leaves`: each replica's input tensors)."""
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
                    outputs.append(make_call(replicas[i])(*args[j], **kws[j]))
            except BaseException as e:
                e.add_note(f"raised in replica {i} on device {device}")
                raise
        for caller, stream in callers:
            caller.wait_stream(stream)
        return outputs

    def _capture(
        self,
        cache: CaptureSource,
        used: list[int],
        make_call: Callable[[nn.Module], Callable[..., Any]],
        leaves: list[list[torch.Tensor]],
        specs: list[pt.Spec],
    ) -> _SignatureGraphs:
        """Captures every replica of `used` for this call's signature (each
        replica's input tensors `leaves` and the `specs` of its arguments)."""
        replicas, slots = cache.capture_replicas(used[-1] + 1)
        self._synchronize()
        graphs = []
        for j, i in enumerate(used):
            device = cache.devices[i]
            replica = replicas[i]
            params = [p for p in replica.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
            graphs.append(
                _ReplicaGraph(
                    make_call(replica),
                    leaves[j],
                    specs[j],
                    params,
                    self.stream(i, device),
                    self._generator(i, device),
                    keep=cache,
                    copy_grads=len(used) == 1,
                )
            )
        used_slots = [slots[i - 1] if i > 0 else [] for i in used]
        return _SignatureGraphs(graphs, used_slots, cache.module)

    def _replay(
        self, cache: CaptureSource, entry: _SignatureGraphs, used: list[int], leaves: list[list[torch.Tensor]]
    ) -> list[Any]:
        """Refreshes the replica buffers from the master and replays (`leaves`:
        each replica's input tensors); the outputs alias the graphs' memory."""
        with self._master_stream(cache.devices[0]) as master:
            copies = cache.refresh_copies()
        grad = torch.is_grad_enabled()
        callers = [torch.cuda.current_stream(graph.device) for graph in entry.graphs]
        for graph, inputs in zip(entry.graphs, leaves):
            graph.load(inputs)
        # Every replica stream waits for the copies before any replays, and the
        # callers wait for the replays only after all were launched: the
        # replicas of one device overlap.
        for graph, caller in zip(entry.graphs, callers):
            graph.stream.wait_stream(caller)
            graph.stream.wait_stream(master)
        outputs = []
        for j, i in enumerate(used):
            graph = entry.graphs[j]
            if not grad or graph.bwd is None:
                params: list[torch.Tensor] = []
            elif i == 0:
                params = entry.master_params
            else:
                params = [copies[b][k] for b, k in entry.slots[j]]  # type: ignore[index]
            outputs.append(graph.launch(leaves[j], params))
        for graph, caller in zip(entry.graphs, callers):
            caller.wait_stream(graph.stream)
        # The replays updated buffers (BatchNorm statistics) of the master and
        # of the replicas in place, which no version counter saw: the next
        # refresh must copy them again.
        for bucket in self._buffer_buckets:
            bucket.invalidate()
        return outputs
