"""The hybrid mode's weighted gradient all-reduce in buckets, and ``register_comm_hook`` (DDP's hooks) on them
(private); docs/design.md, "Hybrid"."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import torch
import torch.distributed as dist

from dpcore._layout import Layout, Peers
from dpcore._loader import _C

_P = ParamSpec("_P")

#: Dtypes that hold every sample count exactly (up to 2**24): a bucket of them can carry the count.
COUNT_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


class FlatBucket:
    """Tensors of one dtype in a flat buffer, then one "has a gradient" flag each, a sample count and, with `world` > 0,
    a "counted" flag and `world` layout marks (with `side` = (flags, tail): views of those, sent apart)."""

    __slots__ = ("params", "flat", "data", "views", "flags", "count", "counted", "marks")

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        device: torch.device,
        world: int = 0,
        side: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.params = list(params)
        sizes = [p.numel() for p in self.params]
        total, n = sum(sizes), len(sizes)
        if side is None:
            extra = 2 + world if world else 1
            self.flat = torch.zeros(total + n + extra, dtype=self.params[0].dtype, device=device)
            flags, tail = self.flat[total : total + n], self.flat[total + n :]
        else:
            self.flat = torch.zeros(total, dtype=self.params[0].dtype, device=device)
            flags, tail = side
        self.data = self.flat[:total]
        self.views = [v.view(p.shape) for v, p in zip(self.data.split(sizes), self.params)]
        self.flags, self.count, self.counted, self.marks = flags, tail[0:1], tail[1:2], tail[2:]

    def fill(self, grads: Sequence[torch.Tensor | None]) -> list[bool]:
        """Copies `grads` into the views (zeros for None) and sets the flags; which were present."""
        present = [g is not None for g in grads]
        if all(present):
            torch._foreach_copy_(self.views, grads)
            self.flags.fill_(1)
            return present
        for view, g in zip(self.views, grads):
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
        self.flags.copy_(torch.tensor(present, dtype=self.flags.dtype))
        return present

    def copy_back(self, present: Sequence[bool]) -> None:
        """Writes the reduced views into ``.grad`` where any process had a gradient (in place where this one had)."""
        if all(present):
            torch._foreach_copy_([p.grad for p in self.params], self.views)
            return
        used = self.flags.ne(0).tolist()
        for p, view, had, anyone in zip(self.params, self.views, present, used):
            if had:
                p.grad.copy_(view)
            elif anyone:
                p.grad = torch.empty_like(p).copy_(view)


def flat_groups(tensors: Sequence[torch.Tensor], device: torch.device, bucket_bytes: int) -> list[FlatBucket]:
    """`tensors` in flat buckets of one dtype each (the core's make_buckets)."""
    return [FlatBucket([tensors[i] for i in g], device) for g in _C.make_buckets(list(tensors), bucket_bytes)]


def broadcast(groups: Sequence[FlatBucket], src: int, peers: Peers, write: bool = True) -> None:
    """Overwrites the tensors of `groups` in place with rank `src`'s (versions bump on receiving ranks only); with
    `write` False, rank `src`'s values stay in the groups' views."""
    with torch.no_grad():
        for g in groups:
            if peers.rank == src:
                torch._foreach_copy_(g.views, [t.detach() for t in g.params])
            dist.broadcast(g.flat, group=peers.group, group_src=src)
            if peers.rank != src and write:
                torch._foreach_copy_([t.detach() for t in g.params], g.views)


@dataclasses.dataclass(eq=False)
class SampleCounts:
    """What the weights of the next synchronization depend on, kept across rebuilds."""

    local: int = 0  # this process's samples of mean-loss forwards since the last synchronization
    counted: bool = False  # whether there was such a forward
    previous_total: float | torch.Tensor = 1.0  # N_prev: the global count of the previous synchronization
    last: int = 0  # this process's count at its last synchronization (a joined rank's)
    ref: float | None = None  # with a hook: the largest global count so far
    started: bool = False  # whether the first synchronization began (the ranks agreed on the hook then)


def weakly(method: Callable[_P, None]) -> Callable[_P, None]:
    """The bound `method`, called through a weak reference to its object (nothing once that is gone): what the autograd
    hooks hold, so that the parameters keep no reducer or coordinator, nor their module, alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: _P.args, **kwargs: _P.kwargs) -> None:
        if (target := ref()) is not None:
            target(*args, **kwargs)

    return call


class BucketReducer:
    """The gradient buckets of `layout`'s trainable parameters and their weighted all-reduce among `peers`. The C++
    counter (armed by the coordinator) calls :meth:`_begin`, which queues `on_finish` as the backward's final callback,
    and :meth:`_ready`."""

    hook: tuple[Any, Any] | None = None  # (hook, state): see HookedReducer

    def __init__(self, peers: Peers, layout: Layout, counts: SampleCounts, on_finish: Callable[[], None]) -> None:
        self.params = list(layout.params)
        self.device, self.group, self.rank, self.world_size = peers.device, peers.group, peers.rank, peers.world_size
        self.counts = counts
        self.buckets = self._make_buckets([[self.params[i] for i in g] for g in layout.buckets])
        self.order = list(range(len(self.buckets)))[::-1]  # launch order, the same on every process
        self.count_bucket = next((b for b in self.order if self.buckets[b].flat.dtype in COUNT_DTYPES), None)
        self.pending = False  # this rank's module changed since the build (its mark goes out)
        self._on_finish = on_finish
        bucket = {i: b for b, g in enumerate(layout.buckets) for i in g}
        bucket_of = [bucket.get(i, 0) for i in range(len(self.params))]
        self.readiness = _C.GradReadiness(self.params, bucket_of, self.order, weakly(self._begin), weakly(self._ready))
        self.reset()

    def _make_buckets(self, groups: list[list[torch.Tensor]]) -> list[FlatBucket]:
        return [FlatBucket(g, self.device, world=self.world_size) for g in groups]

    def reset(self) -> None:
        """No synchronization in progress."""
        self.readiness.reset()
        self._clear()

    def _clear(self) -> None:
        self.next = 0  # buckets order[:next] are launched
        self.alpha: float | torch.Tensor | None = None  # the pre-multiplier of this synchronization
        self.count_work: tuple[torch.Tensor, Any] | None = None  # the count's own all-reduce, if needed
        self.launched: dict[int, tuple[list[bool], Any]] = {}  # bucket -> (had .grad, handle), in launch order
        self.previous: Any = None  # with a hook: the Future of the bucket sent last

    def _begin(self) -> None:
        """A synchronizing backward reached its first parameter."""
        self._clear()
        torch.autograd.Variable._execution_engine.queue_callback(self._on_finish)

    def _ready(self, prefix: int) -> None:
        """Buckets order[:prefix] are complete: launches those not yet sent."""
        while self.next < prefix and (self.previous is None or self.previous.done()):
            self._launch_next()

    def finish(self) -> float | torch.Tensor | None:
        """Launches what is left, waits for every bucket; the correction factor (None where 1)."""
        while self.next < len(self.order):
            if self.previous is not None:  # a hook's: collectives it issues from callbacks keep one order
                self.previous.wait()
            self._launch_next()
        return self._complete()

    def _launch_next(self) -> None:
        b = self.order[self.next]
        bucket = self.buckets[b]
        grads = [p.grad for p in bucket.params]
        for g in grads:
            if g is not None and g.layout != torch.strided:
                raise RuntimeError(
                    f"DataParallel(process_group=...): expected dense gradients, but a parameter's gradient has "
                    f"layout {g.layout} (sparse gradients are not supported)"
                )
        present = bucket.fill(grads)
        if self.alpha is None:
            self._begin_weights()
        if self.counts.counted and self.counts.local == 0:
            bucket.data.zero_()  # no samples here (an empty local batch): nothing, not 0 * inf or NaN
        elif not (isinstance(self.alpha, float) and self.alpha == 1.0):
            bucket.data.mul_(self.alpha)
        self._send(b, present)
        self.next += 1

    def _send(self, b: int, present: list[bool]) -> None:
        bucket = self.buckets[b]
        carrier = b == self.count_bucket
        bucket.count.fill_(self.counts.local if carrier else 0)
        bucket.counted.fill_(1 if carrier and self.counts.counted else 0)
        bucket.marks.zero_()
        if self.pending:
            bucket.marks[self.rank] = 1
        self.launched[b] = (present, dist.all_reduce(bucket.flat, group=self.group, async_op=True))

    def _agree(self, count: float, counted: bool) -> tuple[float, float]:
        """Blocking, at the first synchronization (and, with a hook, until a count is known): the global (count, counted
        flag); RuntimeError on every rank unless every rank or none registered a communication hook."""
        both = torch.zeros(2 + self.world_size, dtype=torch.float64, device=self.device)
        both[0], both[1], both[2 + self.rank] = count, 1.0 if counted else 0.0, 0.0 if self.hook is None else 1.0
        dist.all_reduce(both, group=self.group)
        total, flag, *hooked = both.tolist()
        if 0 < sum(hooked) < self.world_size:
            ranks = [str(r) for r, h in enumerate(hooked) if h]
            raise RuntimeError(
                f"register_comm_hook: called on rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)} only; every "
                "rank must register the same hook before the first backward that synchronizes, as with DDP (their "
                "gradient collectives would not match); this backward's gradients were not synchronized"
            )
        self.counts.started = True
        return total, flag

    def _all_reduce_count(self, count: float, counted: bool) -> tuple[torch.Tensor, Any]:
        """The asynchronous all-reduce of (count, counted flag) in float64."""
        both = torch.tensor([count, 1.0 if counted else 0.0], dtype=torch.float64, device=self.device)
        return both, dist.all_reduce(both, group=self.group, async_op=True)

    def _begin_weights(self) -> None:
        """At the first bucket: the pre-multiplier n_p / N_prev (1/P without a mean-loss forward); the count's own
        all-reduce where no bucket carries it."""
        c = self.counts
        if not c.started:
            self._agree(float(c.local), c.counted)
        self.alpha = c.local / c.previous_total if c.counted else 1.0 / self.world_size
        if self.count_bucket is None:
            self.count_work = self._all_reduce_count(float(c.local), c.counted)

    def _complete(self) -> float | torch.Tensor | None:
        """Waits for every collective; N_prev / N, the factor that turns the sent weights n_p / N_prev into n_p / N
        (None where it is 1); N becomes the next N_prev."""
        c = self.counts
        if self.count_work is not None:
            self.count_work[1].wait()
        factor = None
        if c.counted:
            if self.count_work is not None:
                count = self.count_work[0][:1]
            else:
                assert self.count_bucket is not None
                count = self.buckets[self.count_bucket].count
                self.launched[self.count_bucket][1].wait()
            c.last = c.local
            total = count.real if count.is_complex() else count
            if total.device.type == "cpu":
                n: float | torch.Tensor = max(total.item(), 1.0)
                factor = None if n == c.previous_total else c.previous_total / n
            else:
                n = total.to(torch.float64).clamp_min(1.0).reshape(())  # stays on the device
                factor = c.previous_total / n
            c.previous_total = n
        for _, work in self.launched.values():
            work.wait()
        return factor

    def write_back(self, factor: float | torch.Tensor | None) -> None:
        """Writes the reduced buckets, times `factor`, into ``.grad``."""
        for b, (present, _) in self.launched.items():
            if factor is not None:
                self.buckets[b].data.mul_(factor)
            self.buckets[b].copy_back(present)

    def fresh_weight(self, factor: float | torch.Tensor | None) -> float | torch.Tensor:
        """This rank's weight for the gradients a layout change newly covers."""
        alpha = self.alpha if self.alpha is not None else 0.0
        if self.hook is not None:  # the new buckets are summed without the hook's division by P
            alpha = alpha / self.world_size
        weight = 0.0 if self.counts.counted and self.counts.local == 0 else alpha
        return weight if factor is None else weight * factor

    def changed_ranks(self) -> list[int]:
        """The ranks whose layout changed since the build (the first bucket's marks)."""
        if not self.order:
            return []
        marks = self.buckets[self.order[0]].marks
        return [r for r, m in enumerate(marks.tolist()) if m != 0]

    def shadow(self, phantom: float, pending: bool) -> None:
        """A joined rank's part of the others' synchronization: the same collectives, zero gradients, `phantom` as its
        sample count."""
        self.reset()
        self.pending = pending
        if not self.counts.started:
            self._agree(phantom, False)
        count_work = self._all_reduce_count(phantom, False) if self.count_bucket is None else None
        works = []
        for b in self.order:
            bucket = self.buckets[b]
            bucket.flat.zero_()
            bucket.count.fill_(phantom if b == self.count_bucket else 0)
            bucket.marks[self.rank] = 1 if pending else 0
            works.append(dist.all_reduce(bucket.flat, group=self.group, async_op=True))
        if count_work is not None:
            count_work[1].wait()
            total, counted = count_work[0].tolist()
        for work in works:
            work.wait()
        if count_work is None:
            carrier = self.buckets[self.count_bucket]  # type: ignore[index]
            total, counted = carrier.count.real.item(), carrier.counted.real.item()
        if counted != 0:
            self.counts.previous_total = max(float(total), 1.0)  # N_prev stays the same on every rank


class GradBucket:
    """What a communication hook receives for one gradient bucket: dpcore's stand-in for
    ``torch.distributed.GradBucket`` (which Python cannot build), with the methods torch's hooks call."""

    __slots__ = ("_index", "_count", "_buffer", "_params")

    def __init__(self, index: int, count: int, buffer: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        self._index, self._count, self._buffer, self._params = index, count, buffer, list(params)

    def index(self) -> int:
        """The bucket's place in the send order (0 first: the last parameters, as DDP)."""
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        """The flat gradient of the bucket's parameters (this process's, weighted)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replaces the buffer by a 1-D tensor of as many elements; ``gradients()`` then views it."""
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.numel() != self._buffer.numel():
            is_tensor = isinstance(buffer, torch.Tensor)
            found = f"a tensor of shape {tuple(buffer.shape)}" if is_tensor else type(buffer).__name__
            raise ValueError(
                f"buffer: expected a 1-D tensor of {self._buffer.numel()} elements (the bucket's gradients), "
                f"but got {found}"
            )
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of the current buffer per parameter, in its shape."""
        sizes = [p.numel() for p in self._params]
        return [v.view(p.shape) for v, p in zip(self._buffer.split(sizes), self._params)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)


def check_hook(state: Any, hook: Any) -> None:
    """TypeError unless `hook` is a callable taking (state, bucket)."""
    if not callable(hook):
        raise TypeError(
            f"hook: expected a callable hook(state, bucket) -> torch.futures.Future[torch.Tensor], but got "
            f"{type(hook).__name__}"
        )
    try:
        inspect.signature(hook).bind(state, None)
    except TypeError as error:
        raise TypeError(
            f"hook: expected a callable taking (state, bucket), but {getattr(hook, '__name__', hook)!r} "
            f"does not: {error}"
        ) from None
    except ValueError:
        pass  # no signature to inspect (a builtin): called as it is


class HookedReducer(BucketReducer):
    """:class:`BucketReducer` whose buckets go to `hook` = (hook, state), one at a time, pre-multiplied by P * n_p /
    N_ref and corrected by N_ref / N on arrival."""

    def __init__(
        self, peers: Peers, layout: Layout, counts: SampleCounts, on_finish: Callable[[], None], hook: tuple[Any, Any]
    ) -> None:
        self.hook = hook
        super().__init__(peers, layout, counts, on_finish)
        self.count_bucket = None  # the count goes in the side tensor

    def _make_buckets(self, groups: list[list[torch.Tensor]]) -> list[FlatBucket]:
        """The flags, count, counted flag and marks in one float64 tensor sent apart."""
        self.side = torch.zeros(sum(map(len, groups)) + 2 + self.world_size, dtype=torch.float64, device=self.device)
        self.tail = self.side[len(self.side) - 2 - self.world_size :]
        starts = itertools.accumulate(map(len, groups), initial=0)
        return [
            FlatBucket(g, self.device, world=self.world_size, side=(self.side[o : o + len(g)], self.tail))
            for g, o in zip(groups, starts)
        ]

    def _learn_ref(self, count: float, counted: bool) -> None:
        """At the first synchronization, and until a rank counted: N_ref, by one blocking all-reduce of the counts."""
        if self.counts.ref is None:
            total, flag = self._agree(count, counted)
            if flag != 0:
                self.counts.ref = max(total, 1.0)

    def _begin_weights(self) -> None:
        """The pre-multiplier P * n_p / N_ref (at most P, so that a half-precision hook cannot overflow)."""
        c = self.counts
        self._learn_ref(float(c.local), c.counted)
        ref = c.ref if c.ref is not None else 1.0
        self.alpha = self.world_size * c.local / ref if c.counted else 1.0

    def _send(self, b: int, present: list[bool]) -> None:
        self.previous = self._call_hook(b)
        self.launched[b] = (present, self.previous)

    def _call_hook(self, b: int) -> Any:
        """Calls the hook on bucket `b`; its Future."""
        hook, state = self.hook
        bucket = self.buckets[b]
        index = self.order.index(b)
        future = hook(state, GradBucket(index, len(self.order), bucket.data, bucket.params))
        if not isinstance(future, torch._C.Future):
            raise TypeError(
                f"register_comm_hook: the hook must return a torch.futures.Future of the bucket's reduced gradient, "
                f"but it returned {type(future).__name__} (bucket {index})"
            )
        return future

    def _complete(self) -> float | None:
        """Waits for each Future into its bucket, then sends the side tensor; the correction N_ref / N (None where it is
        1)."""
        c = self.counts
        for b, (_, future) in self.launched.items():
            bucket, value = self.buckets[b], future.wait()
            result = value[0] if isinstance(value, (list, tuple)) and value else value  # a list: its first, as DDP
            is_tensor = isinstance(result, torch.Tensor)
            if not is_tensor or result.numel() != bucket.data.numel():
                found = f"a tensor of {result.numel()} elements" if is_tensor else type(value).__name__
                raise RuntimeError(
                    "register_comm_hook: the hook's Future must hold one tensor of the bucket's "
                    f"{bucket.data.numel()} elements (bucket {self.order.index(b)}), but it held {found}"
                )
            if result.data_ptr() != bucket.data.data_ptr() or result.dtype != bucket.data.dtype:
                bucket.data.copy_(result.reshape(-1))
        n, ref = self._send_side(float(c.local), c.counted)
        if c.counted:
            c.last = c.local
        return None if n is None or n == ref or not c.counted else ref / n

    def _send_side(self, count: float, counted: bool) -> tuple[float, float] | tuple[None, None]:
        """All-reduces the side tensor; if any rank counted, the global count N (at least 1) and N_ref before it (else
        N), and N_ref becomes the largest N."""
        self.tail[0] = count
        self.tail[1] = 1.0 if counted else 0.0
        self.tail[2:].zero_()
        if self.pending:
            self.tail[2 + self.rank] = 1.0
        dist.all_reduce(self.side, group=self.group)
        total, flag = self.tail[:2].tolist()
        if flag == 0:
            return None, None
        n = max(total, 1.0)
        ref = self.counts.ref if self.counts.ref is not None else n
        self.counts.ref = max(ref, n)
        return n, ref

    def shadow(self, phantom: float, pending: bool) -> None:
        """A joined rank's synchronization: the hook on zero buckets, each waited for."""
        self.reset()
        self.pending = pending
        self._learn_ref(phantom, False)
        for b in self.order:
            bucket = self.buckets[b]
            bucket.flat.zero_()
            bucket.flags.zero_()
            self._call_hook(b).wait()
        self._send_side(phantom, False)
