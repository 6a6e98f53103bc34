"""A random stream of its own for each replica that shares a generator.

ATen's random operations (dropout, ``bernoulli_``, ``rand``, ``randn``,
``normal_``, ``uniform_``, ``randint``, ``randperm``, ``multinomial``,
``rrelu``, ...) draw from the process-wide default CPU generator, or from the
per-device default CUDA generator, unless a ``generator=`` is passed. Replicas
that run at once on threads of the worker pool and share such a generator
(every replica of a CPU list, the replicas of one CUDA device in ``[0, 0]``)
take their numbers from it in whatever order the threads happen to run: the
same seed gives different masks from run to run.

Rule. In one parallel call, each group of calls that share a device's
default generator (all CPU calls; the calls on one CUDA device) and has at
least two members gets one fresh ``torch.Generator`` per call, seeded from
one number taken from that default generator when the first of them draws
(so it is advanced: later draws outside the wrapper and the next step's
draws differ, deterministically; a step that draws nothing, in eval mode
say, leaves it untouched) and the call's position in its group. Inside the
call, every random operation on that device that is given no generator
draws from the call's own one. So the numbers depend only on the seed and
the sequence of calls, never on thread timing: under one
``torch.manual_seed``, two runs are bitwise equal. A call alone on its
device (one replica; replicas on distinct CUDA devices) is left as it is
and draws from its device's generator exactly as the bare module would. A
generator passed explicitly is used as given. A call that itself runs
parallel calls (a nested DataParallel) derives their streams from its own
stream. The numbers differ from a single-device run's (one stream per
replica, not one for the whole batch), as with torch.nn.DataParallel.

Saving and restoring the state works on the stream: inside such a call,
``torch.get_rng_state``/``torch.set_rng_state`` (and ``torch.cuda``'s for
the call's device) read and write the call's own generator, so
``torch.random.fork_rng`` and activation checkpointing (which saves the
state in forward and recomputes the dropout masks from it in backward, on
another thread, with the default generator) see the numbers the replica
drew: the recomputed masks are the forward's. Not covered: CPU draws made by
CUDA replicas (the CPU generator stays shared, as with
torch.nn.DataParallel), ``torch.manual_seed`` called inside a replica (it
seeds the default generators, which the call no longer draws from), and
code that holds a reference to the default generator object
(``torch.default_generator``) and draws from it explicitly.

Mechanism, and why. A thread-local dispatch key, included only on the
worker threads of calls that got a stream of their own and only while they
run, with (i) a fallthrough fallback (every other operator skips the key, at
no cost: the dispatcher masks fallthrough keys out once per operator) and
(ii) a kernel for each ATen operator that takes a ``generator`` argument:
when the operator gets none and works on the call's device, the kernel
passes the call's generator and re-dispatches past the key; otherwise it
just re-dispatches. Because the key sits above autograd and stays included
while the operator runs, random operators called inside ATen's own
composites (dropout's ``bernoulli_``, the dropout inside
``TransformerEncoderLayer`` and ``scaled_dot_product_attention``'s math
path, LSTM dropout on the CPU, ``rand``'s ``uniform_``) are caught too.
CUDA kernels that take the device generator themselves, with no generator
argument (the fused ``native_dropout``, the flash / memory-efficient / cuDNN
attention kernels), run with the device's default generator holding the
call's state, swapped in and out under a lock per device: the same kernel
as on one device, on the call's own stream of numbers.

The alternatives: a ``torch.overrides.TorchFunctionMode`` on the replica
threads sees only Python-level calls (it misses the random operators inside
C++ composites such as the attention dropout above, and every function
without a ``generator=`` argument would need a rewrite), and it costs a
Python call for every torch function a replica's forward makes, random or
not, on every CPU replica (a pass-through mode made the forward and
backward of an MLP of 50 layers of 64 at batch 8 12 % slower, minimum of 15
alternating rounds, one thread). A ``TorchDispatchMode`` sees every ATen
operator, but costs a Python call for each of them. The dispatch key costs
nothing for non-random operators and a Python call only for random ones
(and a lock per call of the CUDA kernels above). The key is c10's
``TESTING_ONLY_GenericMode``: c10 reserves it for tests, but it is the one
mode key (a functionality key above autograd, included thread-locally)
that PyTorch itself never registers on or includes (its other mode keys
belong to autocast, functorch, tracing and the Python dispatcher), and
PyTorch offers no thread-local generator override. Where some other code
has already registered on it, or a PyTorch build lacks it, the mechanism
stays off with one warning (the replicas then draw from the shared
generator, as before) rather than fighting over the key.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["with_own_streams"]

_KEY_NAME = "TESTING_ONLY_GenericMode"
_MASK64 = (1 << 64) - 1
_CPU = torch.device("cpu")

# Per thread: the _OwnStream of the call running on this thread, else absent.
_local = threading.local()
_install_lock = threading.Lock()
# None: not tried yet; else (dispatch key or None when unavailable, libraries kept alive).
_installed: tuple[Any, list[Any]] | None = None


def _mix(seed: int, position: int) -> int:
    """A 64-bit seed for the call at `position` of a group, from the group's
    `seed` (splitmix64's finalizer: distinct positions give unrelated seeds)."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _parent(device: torch.device) -> torch.Generator:
    """The generator that calls on `device` would draw from on this thread:
    this thread's own stream where it has one for `device` (a nested parallel
    call inside a call with a stream), else the device's default generator."""
    stream = getattr(_local, "stream", None)
    if stream is not None and stream.device == device:
        return stream.generator()
    if device == _CPU:
        return torch.default_generator
    if not torch.cuda.default_generators:
        torch.cuda.init()
    return torch.cuda.default_generators[device.index]


def _take_seed(parent: torch.Generator) -> int:
    """One 64-bit number from `parent`, advancing it. On the CPU a draw; on
    CUDA, without a kernel launch or a host synchronization, the Philox
    generator's (seed, offset), whose offset is then moved on by one draw's
    worth (4), as a kernel drawing from it would."""
    if parent.device.type == "cpu":
        return int(torch.randint(0, (1 << 63) - 1, (), dtype=torch.int64, generator=parent).item())
    offset = parent.get_offset()
    parent.set_offset(offset + 4)
    return _mix(parent.initial_seed(), offset)


class _Group:
    """The calls of one parallel call that share `parent` (a device's
    default generator, or a nested call's own stream): one number is taken
    from `parent` for all of them, on the first draw any of them makes."""

    __slots__ = ("parent", "seed", "lock")

    def __init__(self, parent: torch.Generator) -> None:
        self.parent = parent
        self.seed: int | None = None
        self.lock = threading.Lock()

    def take_seed(self) -> int:
        with self.lock:
            if self.seed is None:
                self.seed = _take_seed(self.parent)
            return self.seed


class _OwnStream:
    """One call with a random stream of its own: while it runs on its thread,
    random operators on `device` given no generator draw from its generator,
    created and seeded on the first such draw (a call that draws nothing
    touches no generator)."""

    __slots__ = ("fn", "device", "kind", "group", "position", "key", "_generator")

    def __init__(self, fn: Callable[..., Any], device: torch.device, group: _Group, position: int, key: Any) -> None:
        self.fn = fn
        self.device = device
        self.kind = device.type
        self.group = group
        self.position = position
        self.key = key
        self._generator: torch.Generator | None = None

    def generator(self) -> torch.Generator:
        """This call's generator (used only on the call's own thread)."""
        generator = self._generator
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(_mix(self.group.take_seed(), self.position))
            self._generator = generator
        return generator

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        previous = getattr(_local, "stream", None)
        included = torch._C._dispatch_tls_is_dispatch_key_included(self.key)
        _local.stream = self
        torch._C._dispatch_tls_set_dispatch_key_included(self.key, True)
        try:
            return self.fn(*args, **kwargs)
        finally:
            torch._C._dispatch_tls_set_dispatch_key_included(self.key, included)
            _local.stream = previous


def with_own_streams(fns: Sequence[Callable[..., Any]], devices: Sequence[torch.device]) -> list[Callable[..., Any]]:
    """`fns` (the calls of one parallel call, ``fns[i]`` to run on
    ``devices[i]``), where those that share a device's default generator
    with another call are wrapped to draw from a stream of their own (see
    the module docstring): seeded from one number taken from that generator
    (advancing it, once per parallel call, when the first of them draws) and
    the call's position among the calls of its device. Calls alone on their
    device, and all of them when there is only one, are returned as they
    are. Deterministic: the same generator states give the same streams,
    whatever the order in which the calls run."""
    if len(fns) < 2:
        return list(fns)
    groups: dict[int | None, list[int]] = {}  # None: the CPU; else a CUDA device index
    for i, device in enumerate(devices):
        if device == _CPU or device.type == "cpu":  # the comparison first: reading .type costs more
            groups.setdefault(None, []).append(i)
        elif device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            groups.setdefault(index, []).append(i)
    if all(len(members) < 2 for members in groups.values()):
        return list(fns)
    key = _dispatch_key()
    if key is None:
        return list(fns)
    wrapped = list(fns)
    for index, members in groups.items():
        if len(members) < 2:
            continue
        device = _CPU if index is None else torch.device("cuda", index)
        group = _Group(_parent(device))
        for position, i in enumerate(members):
            wrapped[i] = _OwnStream(fns[i], device, group, position, key)
    return wrapped


# -- the dispatch key and its kernels ----------------------------------------


def _dispatch_key() -> Any:
    """The dispatch key with the kernels installed (once, on first use), or
    None where it is unavailable (warned once)."""
    installed = _installed
    if installed is None:
        with _install_lock:
            installed = _installed if _installed is not None else _install()
    return installed[0]


def _install() -> tuple[Any, list[Any]]:
    """Registers the fallthrough fallback and the kernels (called under the
    lock, once); returns (key or None, the libraries, kept alive)."""
    global _installed
    from torch.library import Library, fallthrough_kernel

    key = None
    libraries: list[Any] = []
    try:
        candidate = torch._C._parse_dispatch_key(_KEY_NAME)
        taken = candidate is not None and torch._C._dispatch_get_registrations_for_dispatch_key(_KEY_NAME)
        if candidate is None or torch._C._dispatch_key_name(candidate) != _KEY_NAME:
            reason = f"this PyTorch has no dispatch key {_KEY_NAME}"
        elif taken:
            reason = f"the dispatch key {_KEY_NAME} is already used by other code ({taken[0]}, ...)"
        else:
            fallback = Library("_", "IMPL")
            fallback.fallback(fallthrough_kernel, _KEY_NAME)
            aten = Library("aten", "IMPL")
            libraries = [fallback, aten]
            for name, op, index in _random_operators():
                aten.impl(name, _generator_kernel(op, index, candidate), _KEY_NAME, with_keyset=True)
            for name in _DEVICE_GENERATOR_OPERATORS:
                op = getattr(torch.ops.aten, name, None)
                if op is not None and hasattr(op, "default"):
                    aten.impl(name, _device_generator_kernel(op.default, candidate), _KEY_NAME, with_keyset=True)
            _patch_state_functions()
            key = candidate
            reason = ""
    except (RuntimeError, AttributeError) as error:  # a PyTorch whose internals moved
        reason = f"{type(error).__name__}: {error}"
        libraries = []
    if key is None:
        warnings.warn(
            f"dpcore: replicas that share a generator draw from it in thread order, so random numbers "
            f"(dropout) are not reproducible from run to run: {reason}",
            RuntimeWarning,
            stacklevel=4,
        )
    _installed = (key, libraries)
    return _installed


def _random_operators() -> list[tuple[str, Any, int]]:
    """(name.overload, OpOverload, index of its ``generator`` argument) for
    every ATen operator with a ``Generator? generator`` argument."""
    found = []
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        names = [a.name for a in schema.arguments]
        if "generator" not in names:
            continue
        index = names.index("generator")
        if "Generator" not in str(schema.arguments[index].type):
            continue
        base = schema.name[len("aten::") :]
        try:
            op = getattr(getattr(torch.ops.aten, base), schema.overload_name or "default")
        except (AttributeError, RuntimeError):
            continue
        found.append((base + (f".{schema.overload_name}" if schema.overload_name else ""), op, index))
    return found


def _first_tensor(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value
    return None


def _generator_kernel(op: Any, index: int, key: Any) -> Callable[..., Any]:
    """The kernel of a random operator `op` whose ``generator`` is argument
    `index`: on a thread with a stream of its own, a call given no generator
    whose first tensor (``self``, ``out``) is on the stream's device gets the
    stream's generator. Calls without a tensor (the factories ``rand``,
    ``randn``, ``randperm``) pass through: they fill a tensor with a random
    operator that is caught here in turn."""

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        stream = getattr(_local, "stream", None)
        if stream is not None and (args[index] if len(args) > index else kwargs.get("generator")) is None:
            tensor = _first_tensor(args, kwargs)
            if tensor is not None and tensor.device == stream.device:
                if len(args) > index:
                    args = (*args[:index], stream.generator(), *args[index + 1 :])
                else:
                    kwargs["generator"] = stream.generator()
        return op.redispatch(keyset.remove(key), *args, **kwargs)

    return kernel


#: CUDA operators without a ``generator`` argument whose kernels take the
#: device's default generator themselves (fused dropout and attention).
_DEVICE_GENERATOR_OPERATORS = (
    "native_dropout",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

_device_locks: dict[int, threading.Lock] = {}


def _device_generator_kernel(op: Any, key: Any) -> Callable[..., Any]:
    """The kernel of an operator that takes a CUDA device's default generator
    inside its kernel (``native_dropout``, the fused attention kernels): on
    a thread with a stream of its own for that device, the device's default
    generator holds the stream's state while the operator runs (under a lock
    per device, so the replicas of one device take turns for the launch
    only), and the stream takes the advanced state back. The same kernel
    runs as on one device, so a recomputation from the saved state (see
    _patch_state_functions) draws the same numbers. The CPU's
    ``native_dropout`` draws with ``bernoulli_``, which its own kernel
    catches."""

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        stream = getattr(_local, "stream", None)
        if stream is not None and stream.kind == "cuda":
            tensor = _first_tensor(args, kwargs)
            if tensor is not None and tensor.device == stream.device:
                own = stream.generator()
                default = torch.cuda.default_generators[stream.device.index]
                lock = _device_locks.setdefault(stream.device.index, threading.Lock())
                with lock:
                    saved = default.get_state()
                    default.set_state(own.get_state())
                    try:
                        return op.redispatch(keyset.remove(key), *args, **kwargs)
                    finally:
                        own.set_state(default.get_state())
                        default.set_state(saved)
        return op.redispatch(keyset.remove(key), *args, **kwargs)

    return kernel


def _cuda_index(device: Any) -> int:
    """The CUDA device index that torch.cuda's RNG-state functions resolve `device` to."""
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _patch_state_functions() -> None:
    """Makes ``torch.get_rng_state``/``torch.set_rng_state`` (and
    ``torch.cuda``'s, for the stream's device) read and write the calling
    thread's own stream where it has one, and the default generator
    everywhere else, as before. So code inside a replica that saves and
    restores "the" generator state sees the generator it draws from:
    ``torch.random.fork_rng``, and activation checkpointing, which saves the
    state in forward and recomputes from it in backward (on another thread,
    from the default generator, which then draws the numbers the replica
    drew). Installed once, with the dispatch key."""
    import functools

    import torch.random

    cpu_get, cpu_set = torch.random.get_rng_state, torch.random.set_rng_state

    @functools.wraps(cpu_get)
    def get_rng_state() -> torch.Tensor:
        stream = getattr(_local, "stream", None)
        if stream is not None and stream.kind == "cpu":
            return stream.generator().get_state()
        return cpu_get()

    @functools.wraps(cpu_set)
    def set_rng_state(new_state: torch.Tensor) -> None:
        stream = getattr(_local, "stream", None)
        if stream is not None and stream.kind == "cpu":
            stream.generator().set_state(new_state)
        else:
            cpu_set(new_state)

    torch.get_rng_state = torch.random.get_rng_state = get_rng_state
    torch.set_rng_state = torch.random.set_rng_state = set_rng_state

    import torch.cuda
    import torch.cuda.random

    cuda_get, cuda_set = torch.cuda.random.get_rng_state, torch.cuda.random.set_rng_state

    @functools.wraps(cuda_get)
    def cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
        stream = getattr(_local, "stream", None)
        if stream is not None and stream.kind == "cuda" and _cuda_index(device) == stream.device.index:
            return stream.generator().get_state()
        return cuda_get(device)

    @functools.wraps(cuda_set)
    def cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        stream = getattr(_local, "stream", None)
        if stream is not None and stream.kind == "cuda" and _cuda_index(device) == stream.device.index:
            stream.generator().set_state(new_state)
        else:
            cuda_set(new_state, device)

    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = cuda_get_rng_state
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = cuda_set_rng_state
