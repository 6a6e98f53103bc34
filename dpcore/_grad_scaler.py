"""dpcore.ShardedGradScaler: torch's GradScaler that also unscales and checks the gradients a ShardedOptimizer holds in
its shards (shard_gradients=True, where every p.grad stays None), as FSDP's ShardedGradScaler does for its shards."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import _MultiDeviceReplicator

from dpcore.sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedGradScaler"]


def _holds_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is a ShardedOptimizer whose gradients live in its shards (shard_gradients=True)."""
    return isinstance(optimizer, ShardedOptimizer) and optimizer._store is not None


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments, same use: ``scale``, ``unscale_``, ``step``, ``update``, state dicts)
    that, for a ``dpcore.ShardedOptimizer`` of a ``shard_gradients=True`` wrapper, unscales and checks the gradients
    held at each shard's device (``optimizer.gradient(p)``) and skips the whole step when any is inf or NaN, with one
    found_inf per device as torch records it; every other optimizer gets exactly torch's GradScaler."""

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """torch's: each gradient multiplied by `inv_scale` in place, per device and dtype, and the found_inf of each
        device that holds one; for a ShardedOptimizer with shard_gradients=True, the gradients its shards hold."""
        if not _holds_shards(optimizer):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        inv_scales, found_infs = _MultiDeviceReplicator(inv_scale), _MultiDeviceReplicator(found_inf)
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        for grad in optimizer._gradients():  # type: ignore[attr-defined]
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # torch's words
            grouped[grad.device][grad.dtype].append(grad)
        with torch.no_grad():
            for device, by_dtype in grouped.items():
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads, found_infs.get(device), inv_scales.get(device)
                    )
        return found_infs._per_device_tensors

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """torch's ``GradScaler.step``: unscales (unless ``unscale_`` did) and steps unless a gradient is inf or NaN.
        A ShardedOptimizer with shard_gradients=True takes torch's path for plain optimizers here (its
        ``_step_supports_amp_scaling`` is False during this call), so its shards' gradients are the ones checked."""
        if not _holds_shards(optimizer):
            return super().step(optimizer, *args, **kwargs)
        optimizer._unscaled_by_scaler = True  # type: ignore[attr-defined]
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            optimizer._unscaled_by_scaler = False  # type: ignore[attr-defined]
