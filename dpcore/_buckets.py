"""The hybrid mode's bucketed gradient all-reduce (private).

:class:`BucketReducer` sends the master's gradients in flat buckets (with
"has a gradient" flags, the sample count and one layout mark per rank),
weighted by this process's share of the samples, as a C++ counter
(``_C.GradReadiness``, csrc/dpcore/grad_ready.h) finds buckets complete in
backward; the final callback sends the rest, waits and writes ``.grad``.
The mechanism and the weights: docs/design.md, "Hybrid".
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dpcore._loader import _C

__all__ = ["FlatBucket", "SampleCounts", "BucketReducer", "flat_groups", "broadcast", "all_reduce_fresh", "weak_call"]

#: Dtypes that hold every sample count exactly (up to 2**24), so a bucket of
#: them can carry the count.
COUNT_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


class FlatBucket:
    """Tensors of one dtype and a persistent flat buffer holding them, then
    one "has a gradient" flag each, then one sample count; with `world` > 0
    (gradient buckets), then one "counted" flag (whether the sender's weights
    follow sample counts) and `world` layout marks (element r is 1 where
    rank r's module changed its layout since the buckets were built).

    With `side` = (flags, tail) (the buckets of a communication hook), the
    flat buffer holds the gradients only; the flags and the tail (count,
    counted flag, marks) are views of a tensor sent apart."""

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
        total = sum(sizes)
        n = len(sizes)
        if side is None:
            extra = 2 + world if world else 1
            self.flat = torch.zeros(total + n + extra, dtype=self.params[0].dtype, device=device)
            flags, tail = self.flat[total : total + n], self.flat[total + n :]
        else:
            self.flat = torch.zeros(total, dtype=self.params[0].dtype, device=device)
            flags, tail = side
        self.data = self.flat[:total]
        self.views = [v.view(p.shape) for v, p in zip(self.data.split(sizes), self.params)]
        self.flags = flags
        self.count = tail[0:1]
        self.counted = tail[1:2]
        self.marks = tail[2:]


def flat_groups(tensors: Sequence[torch.Tensor], device: torch.device, bucket_bytes: int) -> list[FlatBucket]:
    """`tensors` in flat buckets of one dtype each (the core's make_buckets)."""
    return [FlatBucket([tensors[i] for i in g], device) for g in _C.make_buckets(list(tensors), bucket_bytes)]


def broadcast(groups: Sequence[FlatBucket], src: int, rank: int, group: Any) -> None:
    """Overwrites the tensors of `groups` with rank `src`'s values (in place,
    bumping version counters on the receiving ranks only); one broadcast per
    group."""
    with torch.no_grad():
        for g in groups:
            if rank == src:
                torch._foreach_copy_(g.views, [t.detach() for t in g.params])
            dist.broadcast(g.flat, group=group, group_src=src)
            if rank != src:
                torch._foreach_copy_([t.detach() for t in g.params], g.views)


def copy_back(bucket: FlatBucket, present: Sequence[bool]) -> None:
    """Copies an all-reduced bucket into its parameters' ``.grad``: in place
    where this process had a gradient, into a new tensor where only another
    process had one (its flag), and not at all where no process had one (the
    gradient stays None, as on one device)."""
    used = bucket.flags.ne(0).tolist()
    for p, view, had, anyone in zip(bucket.params, bucket.views, present, used):
        if had:
            p.grad.copy_(view)
        elif anyone:
            p.grad = torch.empty_like(p).copy_(view)


def all_reduce_fresh(
    fresh: Sequence[torch.Tensor],
    weight: float | torch.Tensor,
    contribute: bool,
    device: torch.device,
    group: Any,
    bucket_bytes: int,
) -> None:
    """After a layout change every rank made: all-reduces the gradients of the
    parameters `fresh` (those the old buckets did not cover) with this rank's
    `weight` of the synchronization (zeros where not `contribute`: a joined
    rank), and writes the results into ``.grad`` where it contributes."""
    for g in flat_groups(fresh, device, bucket_bytes):
        present = [contribute and p.grad is not None for p in g.params]
        for view, p, had in zip(g.views, g.params, present):
            if had:
                view.copy_(p.grad)
            else:
                view.zero_()
        g.flags.copy_(torch.tensor(present, dtype=g.flat.dtype))
        if isinstance(weight, torch.Tensor) or weight != 1.0:
            g.data.mul_(weight)
        dist.all_reduce(g.flat, group=group)
        if contribute:
            copy_back(g, present)


class SampleCounts:
    """What the weights of the next synchronization depend on, kept across
    rebuilds of the buckets: this process's samples of mean-loss forwards
    since the last synchronization (`local`, and whether there was any:
    `counted`), N_prev (`previous_total`: the global count of the previous
    synchronization, the same on every process), this process's count at its
    last synchronization (`last`: a joined rank's weight), the largest global
    count so far with a hook (`ref`), and whether any synchronization began."""

    def __init__(self) -> None:
        self.local = 0
        self.counted = False
        self.previous_total: float | torch.Tensor = 1.0
        self.last = 0
        self.ref: float | None = None
        self.started = False

    def record(self, rows: int) -> None:
        """A forward of `rows` samples with a mean loss."""
        self.counted = True
        self.local += int(rows)

    def clear(self) -> None:
        """After a synchronization (or a backward that raised)."""
        self.local = 0
        self.counted = False


def weak_call(ref: weakref.ref[Any], name: str, *args: Any) -> None:
    """Calls method `name` of the object `ref` refers to, if still alive (the
    C++ hooks hold no strong reference to their reducer)."""
    target = ref()
    if target is not None:
        getattr(target, name)(*args)


class BucketReducer:
    """The gradient buckets of `params` (`indices`: the core's make_buckets
    of them) and their all-reduce over `group`, weighted by `counts`.
    :meth:`arm` before each backward that may synchronize; the C++ counter
    calls :meth:`_begin` (which queues `on_finish`, the final callback) and
    :meth:`_ready`; `on_finish` calls :meth:`finish`, then :meth:`write_back`."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        indices: Sequence[Sequence[int]],
        device: torch.device,
        group: Any,
        counts: SampleCounts,
        on_finish: Callable[[], None],
    ) -> None:
        self.params = list(params)
        self.device = device
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self.counts = counts
        self.buckets = self._make_buckets([[self.params[i] for i in g] for g in indices])
        self.order = list(range(len(self.buckets)))[::-1]  # launch order, the same on every process
        self.count_bucket = self._count_carrier()
        self.pending = False  # this rank's module changed since the build (its mark goes out)
        self._on_finish = on_finish
        bucket_of = [0] * len(self.params)
        for b, g in enumerate(indices):
            for i in g:
                bucket_of[i] = b
        ref = weakref.ref(self)
        self.readiness = _C.GradReadiness(
            self.params,
            bucket_of,
            self.order,
            functools.partial(weak_call, ref, "_begin"),
            functools.partial(weak_call, ref, "_ready"),
        )
        self.reset()

    def _make_buckets(self, groups: list[list[torch.Tensor]]) -> list[FlatBucket]:
        return [FlatBucket(g, self.device, world=self.world_size) for g in groups]

    def _count_carrier(self) -> int | None:
        """The first bucket sent that can carry the sample count exactly."""
        return next((b for b in self.order if self.buckets[b].flat.dtype in COUNT_DTYPES), None)

    @property
    def task(self) -> int:
        """The graph task of the synchronizing backward in progress, -1 if none."""
        return self.readiness.task

    def arm(self, synchronizes: bool, deferred: bool, pending: bool) -> None:
        """Before a backward: whether it synchronizes, whether every bucket
        waits for the final callback (synchronized BatchNorm across
        processes), whether this rank's layout changed since the build."""
        self.readiness.arm(synchronizes, deferred)
        self.pending = pending

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

    def close(self) -> None:
        """Removes the hooks (the buckets are replaced)."""
        self.readiness.remove()

    def _begin(self) -> None:
        """A synchronizing backward reached its first parameter."""
        self._clear()
        self.counts.started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._on_finish)

    def _ready(self, prefix: int) -> None:
        """Buckets order[:prefix] are complete: launches those not yet sent."""
        while self.next < prefix and not self._blocked():
            self._launch(self.order[self.next])
            self.next += 1

    def _blocked(self) -> bool:
        """Whether the next bucket must wait for the previous one (a hook's)."""
        return False

    def _wait_previous(self) -> None:
        """Waits until the bucket sent last may be followed by the next."""

    def finish(self) -> float | torch.Tensor | None:
        """In the final callback: launches what is left and waits for every
        bucket; the correction factor of the weights (None where it is 1)."""
        while self.next < len(self.order):
            self._wait_previous()
            self._launch(self.order[self.next])
            self.next += 1
        return self._complete()

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        grads = [p.grad for p in bucket.params]
        present = [g is not None for g in grads]
        for g in grads:
            if g is not None and g.layout != torch.strided:
                raise RuntimeError(
                    f"DataParallel(process_group=...): expected dense gradients, but a parameter's gradient has "
                    f"layout {g.layout} (sparse gradients are not supported)"
                )
        if all(present):
            torch._foreach_copy_(bucket.views, grads)
            bucket.flags.fill_(1)
        else:
            for view, g in zip(bucket.views, grads):
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
            bucket.flags.copy_(torch.tensor(present, dtype=bucket.flags.dtype))
        if self.alpha is None:
            self._begin_weights()
        alpha = self.alpha
        if self.counts.counted and self.counts.local == 0:
            bucket.data.zero_()  # no samples here (an empty local batch): nothing, not 0 * inf or NaN
        elif not (isinstance(alpha, float) and alpha == 1.0):
            bucket.data.mul_(alpha)
        self._send(b, present)

    def _send(self, b: int, present: list[bool]) -> None:
        bucket = self.buckets[b]
        carrier = b == self.count_bucket
        bucket.count.fill_(self.counts.local if carrier else 0)
        bucket.counted.fill_(1 if carrier and self.counts.counted else 0)
        bucket.marks.zero_()
        if self.pending:
            bucket.marks[self.rank] = 1
        self.launched[b] = (present, dist.all_reduce(bucket.flat, group=self.group, async_op=True))

    def _begin_weights(self) -> None:
        """At the first bucket sent: the pre-multiplier n_p / N_prev (1/P when
        no mean-loss forward was recorded: every process then weighs the same),
        and, where no bucket can carry the count, its own all-reduce
        (count, counted flag) before the first bucket's."""
        c = self.counts
        self.alpha = c.local / c.previous_total if c.counted else 1.0 / self.world_size
        if self.count_bucket is None:
            count = torch.tensor([float(c.local), 1.0 if c.counted else 0.0], dtype=torch.float64, device=self.device)
            self.count_work = (count, dist.all_reduce(count, group=self.group, async_op=True))

    def _complete(self) -> float | torch.Tensor | None:
        if self.count_work is not None:
            self.count_work[1].wait()
        factor = self._correction()
        for _, work in self.launched.values():
            work.wait()
        return factor

    def _correction(self) -> float | torch.Tensor | None:
        """After the sample count arrived: N_prev / N, the factor that turns
        the sent n_p / N_prev weights into n_p / N (None where it is 1); N
        becomes the next N_prev."""
        c = self.counts
        if not c.counted:
            return None
        if self.count_work is not None:
            count, work = self.count_work
            count = count[:1]
        else:
            assert self.count_bucket is not None
            count, work = self.buckets[self.count_bucket].count, self.launched[self.count_bucket][1]
        work.wait()
        c.last = c.local
        total = count.real if count.is_complex() else count
        if total.device.type == "cpu":
            n = max(total.item(), 1.0)
            factor = None if n == c.previous_total else c.previous_total / n
            c.previous_total = n
            return factor
        n_tensor = total.to(torch.float64).clamp_min(1.0).reshape(())  # stays on the device
        factor_t = c.previous_total / n_tensor
        c.previous_total = n_tensor
        return factor_t

    def write_back(self, factor: float | torch.Tensor | None) -> None:
        """Writes the reduced buckets, times `factor`, into ``.grad``."""
        for b, (present, _) in self.launched.items():
            bucket = self.buckets[b]
            if factor is not None:
                bucket.data.mul_(factor)
            if all(present):
                torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)
            else:
                copy_back(bucket, present)

    def fresh_weight(self, factor: float | torch.Tensor | None) -> float | torch.Tensor:
        """This rank's weight for gradients of parameters a layout change
        newly covers (summed, without a hook)."""
        alpha = self._fresh_alpha()
        weight = 0.0 if self.counts.counted and self.counts.local == 0 else alpha
        return weight if factor is None else weight * factor

    def _fresh_alpha(self) -> float | torch.Tensor:
        return self.alpha if self.alpha is not None else 0.0

    def changed_ranks(self) -> list[int]:
        """The ranks whose module changed structure since the buckets were
        built, from the marks of the first bucket sent (after it arrived)."""
        if not self.order:
            return []
        marks = self.buckets[self.order[0]].marks  # on CUDA: one read of world_size numbers per synchronization
        return [r for r, m in enumerate(marks.tolist()) if m != 0]

    def shadow(self, phantom: float, pending: bool) -> None:
        """A joined rank's part of one synchronization of the others: the same
        collectives with zero gradients and `phantom` as its sample count."""
        self.reset()
        self.counts.started = True
        self.pending = pending
        count_work = None
        if self.count_bucket is None:
            count = torch.tensor([phantom, 0.0], dtype=torch.float64, device=self.device)
            count_work = (count, dist.all_reduce(count, group=self.group, async_op=True))
        works = []
        for b in self.order:
            bucket = self.buckets[b]
            bucket.flat.zero_()
            if b == self.count_bucket:
                bucket.count.fill_(phantom)
            if pending:
                bucket.marks[self.rank] = 1
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
