"""``register_comm_hook`` (DDP's hooks) for the hybrid mode (private); docs/design.md, "Hybrid"."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dpcore._buckets import BucketReducer, FlatBucket, SampleCounts
from dpcore._layout import Layout, Peers


class GradBucket:
    """What a communication hook receives for one gradient bucket: dpcore's
    stand-in for ``torch.distributed.GradBucket`` (which Python cannot build),
    with the methods torch's hooks call."""

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
    """:class:`BucketReducer` whose buckets go to `hook` = (hook, state), one at a
    time, pre-multiplied by P * n_p / N_ref and corrected by N_ref / N on arrival."""

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
        """Waits for each Future into its bucket, then sends the side tensor; the
        correction N_ref / N (None where it is 1)."""
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
        """All-reduces the side tensor; if any rank counted, the global count N (at
        least 1) and N_ref before it (else N), and N_ref becomes the largest N."""
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
