"""The loss rules: what one call returns from its replicas' results
(docs/losses.md; :class:`LossRule`, built from each checked options value)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpcore._options import Options
from dpcore._pipeline import Call
from dpcore._split import _as_weight


class LossRule:
    """How the replicas' results of a call become what it returns, by the options it was built from (one
    frozen value: a wrapper builds a new rule whenever its options change)."""

    def __init__(self, options: Options) -> None:
        self.options = options

    @property
    def summed(self) -> bool:
        """Whether the returned loss is summed over the batch, not averaged."""
        return self.options.reduction == "sum"

    def make_call(self, module: Callable[..., Any], method: Any = None) -> Callable[..., Any]:
        """What a replica runs: `module`, or with a criterion (and no `method`),
        ``criterion(module(*args[:-1], **kwargs), args[-1])``."""
        criterion = self.options.criterion
        if criterion is None or method is not None:
            return module
        return lambda *args, **kwargs: criterion(module(*args[:-1], **kwargs), args[-1])

    def combine(self, outputs: list[Any], call: Call, gather: Callable[[list[Any]], Any]) -> Any:
        """What the call returns from the replicas' `outputs`; `gather` joins
        a list of per-replica outputs on the output device."""
        if call.method is not None:
            return call.method.combine(outputs, call, gather) if self.options.gather else outputs
        if self.options.criterion is not None:
            return self._criterion_loss(outputs, call)
        if not self.options.gather:
            return outputs
        if self.options.model_loss is not None:
            return self._with_model_loss(outputs, call, gather)
        return gather(outputs)

    def _criterion_loss(self, losses: list[Any], call: Call) -> torch.Tensor:
        for i, (loss, device) in enumerate(zip(losses, call.devices)):
            if not isinstance(loss, torch.Tensor):
                raise TypeError(
                    f"criterion: expected a loss tensor from every replica, but replica {i} (on {device}) "
                    f"returned {type(loss).__name__}"
                )
            if loss.dim() != 0:
                raise ValueError(
                    f"criterion: expected a scalar (0-dim) loss from every replica, because the per-replica "
                    f"losses are weighted by chunk size and summed, which needs one number per replica; but "
                    f"replica {i} (on {device}) returned a loss of shape {list(loss.shape)}. Use a reducing "
                    f"criterion (reduction='mean' or 'sum'), or drop criterion= and reduce the gathered outputs"
                )
        total, out = call.rows, self.options.out
        if total == 0:
            return losses[0]
        counts = self._criterion_counts(call)
        if counts is not None:  # a mean over counted items (loss_items, or CrossEntropyLoss's own targets)
            return _weighted_mean([loss.to(out) for loss in losses], counts)
        parts = [loss.to(out) * (1.0 if self.summed else size / total) for loss, size in zip(losses, call.sizes)]
        return torch.stack(parts).sum() if len(parts) > 1 else parts[0]

    def _counted(self, call: Call) -> list[float]:
        return [
            _as_weight(self.options.loss_items(*a, **k), f"loss_items: the count of replica {j}")
            for j, (a, k) in enumerate(zip(call.args, call.kws))
        ]

    def _criterion_counts(self, call: Call) -> list[Any] | None:
        """How many items each replica's mean criterion averages over where not its rows: ``loss_items``, or
        CrossEntropyLoss's and NLLLoss's weighted valid class-index targets (on the devices); else None."""
        reduction, criterion = self.options.reduction, self.options.criterion
        if self.options.loss_items is not None:
            return self._counted(call)
        if not self.summed and isinstance(call.args[0][-1], PackedSequence):
            raise ValueError(
                f"criterion: the target is a PackedSequence and the criterion's reduction is {reduction!r}: "
                f"each replica's loss is weighted by the items it averages over, which for a packed target may be "
                f"its sequences or its packed rows; declare them with loss_items= (e.g. lambda *args: "
                f"args[-1].data.size(0) for a mean over packed rows, lambda *args: args[-1].batch_sizes[0] for "
                f"one over sequences), or use a summed criterion (criterion_reduction='sum')"
            )
        if reduction != "mean" or not isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)):
            return None
        targets = [a[-1] for a in call.args]
        if not all(isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() for t in targets):
            return None  # class probabilities: a mean over rows
        counts = []
        for t in targets:
            valid = t != criterion.ignore_index
            if criterion.weight is None:
                count = valid.sum()
            else:
                weight = criterion.weight.detach().to(t.device)
                count = torch.where(valid, weight[t.clamp(0, weight.numel() - 1)], 0).sum()
            counts.append(count.to(self.options.out, torch.float64))
        return counts

    def _with_model_loss(self, outputs: list[Any], call: Call, gather: Callable[[list[Any]], Any]) -> Any:
        """The gathered `outputs` with the model's losses (or each entry of a
        loss dict) replaced by one scalar, combined as model_loss declares."""
        if all(_is_loss_dict(o) for o in outputs):  # a dict of losses (detection models in training)
            gathered = gather(outputs)
            combine = self._combiner(call)
            for key in outputs[0]:
                gathered[key] = combine([o[key] for o in outputs])
            return gathered
        samples = bool(getattr(call.hints, "samples", False))
        losses = [_loss_of(o, j, d, samples) for j, (o, d) in enumerate(zip(outputs, call.devices))]
        if all(loss is None for loss in losses):
            return gather(outputs)
        for j, (loss, device) in enumerate(zip(losses, call.devices)):
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(
                    f"model_loss={self.options.model_loss!r}: expected a scalar loss (a tensor of one element) in "
                    f"every replica's output, but replica {j} (on {device}) has {got} where the loss goes"
                )
        combined = self._combiner(call)(losses)
        if isinstance(outputs[0], torch.Tensor):
            return combined
        return _with_loss_replaced(gather(outputs), combined)

    def _combiner(self, call: Call) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        """Combines per-replica losses as model_loss declares, on the output
        device (the "items" counts taken once, for every loss it combines)."""
        mode = self.options.model_loss
        if mode == "num_items_in_batch":
            passed = call.kws[0].get("num_items_in_batch") is not None
            if not passed and self.options.loss_items is None:
                raise ValueError(
                    "model_loss='num_items_in_batch': this call passed no num_items_in_batch keyword, so each "
                    "replica's loss is its own mean and their sum is not the batch's loss; pass num_items_in_batch, "
                    "or declare loss_items= to weigh the calls without it (Trainer evaluates without it)"
                )
            mode = "sum" if passed else "items"
        out = self.options.out
        counts = self._counted(call) if mode == "items" and len(call.sizes) > 1 else call.sizes

        def combine(losses: list[torch.Tensor]) -> torch.Tensor:
            parts = [loss.to(out).reshape(()) for loss in losses]
            return torch.stack(parts).sum() if mode == "sum" and len(parts) > 1 else _weighted_mean(parts, counts)

        return combine


def _is_loss_dict(output: Any) -> bool:
    """Whether `output` is a non-empty Mapping of one-element tensors without "loss" (a dict of losses)."""
    return (
        isinstance(output, Mapping)
        and bool(output)
        and "loss" not in output
        and all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in output.values())
    )


def _loss_of(output: Any, replica: int, device: torch.device, samples: bool) -> Any:
    """The loss in one replica's output: a tensor itself, a Mapping's "loss", a dataclass's or namedtuple's ``loss``,
    else a sequence's entry 0; None where a Mapping has none, and for a list in a Samples call."""
    where = f"replica {replica} (on {device})"
    if isinstance(output, torch.Tensor):
        return output
    if samples and isinstance(output, list):
        return None
    if isinstance(output, Mapping):
        return output.get("loss")
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        if "loss" not in {f.name for f in dataclasses.fields(output)}:
            raise TypeError(f"model_loss: the output of {where} is a {type(output).__name__} with no 'loss' field")
        return output.loss
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        if "loss" in output._fields:
            return output.loss
        raise TypeError(f"model_loss: the output of {where} is a {type(output).__name__} with no 'loss' field")
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(
        f"model_loss: expected a model output that holds its loss (a 0-dim tensor, a ModelOutput or dict with "
        f"'loss', a tuple whose entry 0 is the loss), but {where} returned {type(output).__name__}"
    )


def _with_loss_replaced(gathered: Any, loss: torch.Tensor) -> Any:
    """`gathered` with its loss (where _loss_of read it) replaced by `loss`."""
    if isinstance(gathered, Mapping):
        gathered["loss"] = loss  # a fresh container from gather (ModelOutput sets the attribute too)
        return gathered
    if dataclasses.is_dataclass(gathered):
        return dataclasses.replace(gathered, loss=loss)
    if isinstance(gathered, tuple) and hasattr(gathered, "_fields"):
        return gathered._replace(loss=loss)
    return type(gathered)([loss, *gathered[1:]])


def _weighted_mean(parts: Sequence[torch.Tensor], counts: Sequence[Any]) -> torch.Tensor:
    """The mean over all items of per-replica means `parts` over `counts`
    items each; no item at all gives NaN, as on one device."""
    parts = [p.reshape(()) for p in parts]
    if len(parts) == 1:
        return parts[0]
    if any(isinstance(c, torch.Tensor) for c in counts):  # counted on the devices: masked, not filtered
        stacked = torch.stack(parts)
        c = torch.stack([torch.as_tensor(n, dtype=torch.float64, device=stacked.device) for n in counts])
        total = c.sum()
        terms = torch.where(c > 0, stacked * (c / total).to(stacked.dtype), torch.zeros_like(stacked))
        return torch.where(total > 0, terms.sum(), torch.full_like(terms[0], float("nan")))
    total = float(sum(counts))
    if total == 0:
        return torch.stack(parts).sum() * float("nan")
    return torch.stack([p * (c / total) for p, c in zip(parts, counts) if c > 0]).sum()
