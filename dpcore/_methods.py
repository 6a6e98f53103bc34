"""Methods of the module other than forward, run data parallel through the
wrapper's pipeline: ``dp.parallel(name)``, ``dp.generate`` (docs/generate.md)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpcore import _pytree as pt
from dpcore._gather import _WRAPPABLE, _reraise
from dpcore._loss import Call

if TYPE_CHECKING:
    from dpcore.data_parallel import DataParallel

#: Module methods that ``dp.<name>`` runs data parallel (others fall through to the module).
PARALLEL_BY_NAME = frozenset({"generate"})
#: Fields of transformers' generate outputs with one entry per generation step.
STEP_FIELDS = tuple(
    "scores logits attentions hidden_states decoder_attentions cross_attentions decoder_hidden_states".split()
)


@dataclasses.dataclass(frozen=True)
class Method:
    """A method call's rule (in its :class:`Call`): `align` the results, pad beyond `dim` with `pad_value`, gather."""

    label: str
    dim: int
    pad_value: float | None
    align: Callable[[list[Any], Call], list[Any]] | None = None

    def combine(self, outputs: list[Any], call: Call, gather: Callable[[list[Any]], Any]) -> Any:
        """The gathered result of the replicas' `outputs`; errors name the method."""
        if self.align is not None:
            outputs = self.align(outputs, call)
        outputs = pad_outputs(outputs, self.dim, self.pad_value, self.label)
        try:
            return gather(outputs)
        except _WRAPPABLE as e:
            _reraise(e, f"{self.label}: the replicas' results cannot be gathered: ")


class ParallelMethod:
    """``dp.parallel(name)``: the module's method `name`, run data parallel at each call."""

    def __init__(self, dp: DataParallel, name: Any, pad_value: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"parallel: expected a method name (str), but got {type(name).__name__} {name!r}")
        if pad_value is not None and (isinstance(pad_value, bool) or not isinstance(pad_value, (int, float))):
            raise TypeError(
                f"parallel({name!r}): pad_value: expected a number (or None), but got {type(pad_value).__name__}"
            )
        module = dp.module
        self.label = f"{type(module).__name__}.{name} (data parallel)"
        try:
            target = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"parallel({name!r}): the module, a {type(module).__name__}, has no method {name!r}"
            ) from None
        owner = getattr(target, "__self__", None) if inspect.ismethod(target) else None
        if not isinstance(target, nn.Module) and not any(owner is m for m in module.modules()):
            raise TypeError(
                f"parallel({name!r}): {type(module).__name__}.{name} is a {type(target).__name__}, not a method of "
                f"the module (nor a submodule): each replica must run its own, so define it as a method of the "
                f"module's class"
            )
        self.dp, self.name, self.pad_value = dp, name, pad_value
        self.hugging_face = name == "generate" and hasattr(module, "generation_config")
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dp = self.dp
        method = _Generated.rule(self, kwargs) if self.hugging_face else Method(self.label, dp.dim, self.pad_value)
        with dp._calls:
            return dp._forward(args, kwargs, operator.attrgetter(self.name), method)[0]  # each replica's own

    def __repr__(self) -> str:
        return f"<{self.label} over {len(self.dp.device_ids)} device(s)>"


@dataclasses.dataclass(frozen=True)
class _Generated:
    """transformers' ``generate``: the replicas' outputs aligned as the bare model returns them for the whole batch
    (`fill`: its pad of finished rows, None where it keeps generating; `beams` per row; `pad`: missing steps)."""

    label: str
    fill: int | None
    beams: int
    pad: float

    @classmethod
    def rule(cls, parallel: ParallelMethod, kwargs: dict[str, Any]) -> Method:
        """The rule of one call of `parallel` with `kwargs`."""
        dp = parallel.dp
        if dp.dim != 0:
            raise ValueError(
                f"{parallel.label}: transformers' generate takes the batch along dimension 0, but this "
                f"DataParallel has dim={dp.dim}"
            )
        config = dp.module.generation_config
        given = kwargs.get("generation_config")

        def setting(name: str) -> Any:  # transformers' order: kwargs, the given config, the model's
            if name in kwargs:
                return kwargs[name]
            value = getattr(given, name, None)
            return value if value is not None else getattr(config, name, None)

        eos = setting("eos_token_id")
        eos0 = None if eos is None else int(torch.as_tensor(eos).reshape(-1)[0])
        pad = setting("pad_token_id")
        pad = eos0 if pad is None else int(pad)
        beams = int(setting("num_beams") or 1)
        criteria = kwargs.get("stopping_criteria") or ()
        if beams > 1:  # transformers' _beam_search: its output_fill_value
            fill = -1 if eos is None else (pad or eos0)
        else:  # _sample pads finished rows only under an eos criterion
            fill = pad if eos is not None or any(hasattr(c, "eos_token_id") for c in criteria) else None
        value = math.nan if parallel.pad_value is None else parallel.pad_value
        return Method(parallel.label, 0, value, cls(parallel.label, fill, beams, value).align)

    def align(self, outputs: list[Any], call: Call) -> list[Any]:
        """`outputs` with their token ids, beam indices and steps aligned."""
        if all(isinstance(o, torch.Tensor) and o.dim() == 2 for o in outputs):
            return self._tokens(outputs, "output")
        if not all(isinstance(o, Mapping) and isinstance(o.get("sequences"), torch.Tensor) for o in outputs):
            return outputs  # not a generate output: the generic rules apply
        fields = [dict(o) for o in outputs]
        for f, padded in zip(fields, self._tokens([o["sequences"] for o in outputs], "output['sequences']")):
            f["sequences"] = padded
        if all(isinstance(o.get("beam_indices"), torch.Tensor) for o in outputs):
            starts = [sum(call.sizes[:j]) * self.beams for j in range(len(outputs))]
            moved = [torch.where(o["beam_indices"] >= 0, o["beam_indices"] + s, -1) for o, s in zip(outputs, starts)]
            for f, padded in zip(fields, _padded_tensors(moved, 0, -1, self.label, "output['beam_indices']")):
                f["beam_indices"] = padded
        for name in STEP_FIELDS:
            steps = [o.get(name) for o in outputs]
            if all(isinstance(s, tuple) and s for s in steps):
                for f, full in zip(fields, self._steps(steps)):
                    f[name] = full
        return [type(o)(**f) for o, f in zip(outputs, fields)]

    def _tokens(self, sequences: list[torch.Tensor], path: str) -> list[torch.Tensor]:
        """Token ids right-padded to the longest with the bare model's fill."""
        lengths = [s.size(1) for s in sequences]
        if self.fill is None and len(set(lengths)) > 1:
            raise ValueError(
                f"{self.label}: {path} has {lengths} tokens on the replicas: some stopped before others, and this "
                f"model gives no token to pad their rows with as it pads finished rows (without an eos_token_id it "
                f"keeps generating for them); set model.generation_config.eos_token_id (and pad_token_id), or pass "
                f"eos_token_id= and pad_token_id= to generate"
            )
        return _padded_tensors(sequences, 0, self.fill, self.label, path)

    def _steps(self, steps: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Per-step tuples extended to the longest one's steps, filled with `pad`."""
        longest = max(steps, key=len)
        out = []
        for own in steps:
            first, _ = pt.flatten(own[0])
            extra = []
            for step in longest[len(own) :]:
                tensors, spec = pt.flatten(step)
                shapes = [((f.size(0), *t.shape[1:]), t.dtype, f.device) for t, f in zip(tensors, first)]
                extra.append(spec.unflatten([torch.full(n, self.pad, dtype=d, device=v) for n, d, v in shapes]))
            out.append(own + tuple(extra))
        return out


def pad_outputs(values: list[Any], dim: int, pad_value: float | None, label: str, path: str = "output") -> list[Any]:
    """The replicas' outputs `values`, each tensor that differs from another replica's beyond `dim` padded at the end
    to the largest with `pad_value` (ValueError naming the path where None); other differences are left."""
    first = values[0]
    if all(isinstance(v, torch.Tensor) for v in values):
        return _padded_tensors(values, dim, pad_value, label, path)
    node = pt.node_of(first)
    if node.kind not in (pt.NODE, pt.MAPPING, *pt.STATE) or any(type(v) is not type(first) for v in values):
        return values
    flat = [node.flatten(v) for v in values]
    kids = [list(children) for children, _ in flat]
    keys = node.keys(first, flat[0][1], len(kids[0]))
    if any(node.keys(v, c, len(k)) != keys for v, (_, c), k in zip(values[1:], flat[1:], kids[1:])):
        return values
    columns = [pad_outputs([k[i] for k in kids], dim, pad_value, label, path + key) for i, key in enumerate(keys)]
    if all(column[j] is kids[j][i] for i, column in enumerate(columns) for j in range(len(values))):
        return values
    return [node.unflatten([column[j] for column in columns], flat[j][1]) for j in range(len(values))]


def _padded_tensors(values: list[torch.Tensor], dim: int, pad_value: float | None, label: str, path: str) -> list[Any]:
    rank = values[0].dim()
    if rank == 0 or any(v.dim() != rank for v in values) or not -rank <= dim < rank:
        return values
    batch = dim % rank
    target = [max(v.size(i) for v in values) for i in range(rank)]
    ragged = [j for j, v in enumerate(values) if any(v.size(i) != target[i] for i in range(rank) if i != batch)]
    if not ragged:
        return values
    if pad_value is None:
        j = next(j for j, v in enumerate(values) if v.shape != values[ragged[0]].shape)
        raise ValueError(
            f"{label}: {path} has shape {list(values[ragged[0]].shape)} on replica {ragged[0]} but "
            f"{list(values[j].shape)} on replica {j}, beyond the batch dimension {dim}; pass pad_value= to pad "
            f"them to the largest"
        )
    if not (values[0].is_floating_point() or values[0].is_complex()) and not float(pad_value).is_integer():
        raise ValueError(f"{label}: pad_value={pad_value!r} cannot pad {path}, a {values[0].dtype} tensor")
    out = list(values)
    for j in ragged:
        out[j] = values[j].new_full([values[j].size(i) if i == batch else target[i] for i in range(rank)], pad_value)
        out[j][tuple(slice(0, n) for n in values[j].shape)] = values[j]
    return out
