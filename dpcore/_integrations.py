"""The rules for other libraries' types, in one place (the pipeline and the tree walk consult it; nothing here is
imported from those libraries): transformers' caches taken apart by their attributes, its ``generate`` outputs
aligned as the bare model returns them, and torchvision's detection models, which take their images as lists."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from dpcore._markers import is_namedtuple

# Types taken apart by their attributes (``vars(obj)``), each its tensors batch-first: (module, class name) of a
# class in the type's MRO, None for every class of that module. The rule: dpcore._pytree's OBJECT nodes.
BY_ATTRIBUTES: frozenset[tuple[str, str | None]] = frozenset(
    {
        ("transformers.cache_utils", None),  # Cache, its layers (DynamicCache's iteration drops their state)
        ("transformers.models.reformer.modeling_reformer", "ReformerDynamicCache"),
    }
)
#: Module methods that ``dp.<name>`` runs data parallel (others fall through to the module).
PARALLEL_BY_NAME = frozenset({"generate"})
#: Fields of transformers' generate outputs with one entry per generation step.
STEP_FIELDS = tuple(
    "scores logits attentions hidden_states decoder_attentions cross_attentions decoder_hidden_states".split()
)
#: Aligns the replicas' outputs of one call, given each replica's rows.
Align = Callable[[list[Any], list[int]], list[Any]]


def input_check(module: nn.Module) -> Callable[[tuple[Any, ...], Mapping[str, Any]], None] | None:
    """The check of each call's inputs that `module` needs, once per module (None for almost every module): a
    torchvision detection model's images and targets given as a plain list are a ValueError naming dpcore.Samples
    (torch's rule would split every image along its channels)."""
    if not any(
        type(m).__name__ == "GeneralizedRCNNTransform" and type(m).__module__.startswith("torchvision.")
        for m in module.modules()
    ):
        return None
    model = type(module).__name__

    def check(inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        for index, name in enumerate(("images", "targets")):
            given = len(inputs) > index
            path, value = (f"inputs[{index}]", inputs[index]) if given else (f"kwargs[{name!r}]", kwargs.get(name))
            if isinstance(value, (list, tuple)) and not is_namedtuple(value):
                raise ValueError(
                    f"{path} is a plain {type(value).__name__} of {name} given to {model}, a torchvision detection "
                    f"model, which takes one [C, H, W] tensor (and one target dict) per image: wrap it in "
                    f"dpcore.Samples({name}) so that each replica gets whole images; a plain list is split inside "
                    f"every image, along its channels, as torch.nn.DataParallel splits it"
                )

    return check


def method_rule(
    module: nn.Module, name: str, kwargs: dict[str, Any], label: str, dim: int, pad_value: float | None
) -> tuple[float | None, Align | None]:
    """``(pad_value, align)`` of one data-parallel call of ``module.<name>(**kwargs)``: the given `pad_value` and no
    alignment, except for transformers' ``generate`` (its own fill of finished rows, NaN for missing steps)."""
    if name != "generate" or not hasattr(module, "generation_config"):
        return pad_value, None
    if dim != 0:
        raise ValueError(
            f"{label}: transformers' generate takes the batch along dimension 0, but this DataParallel has dim={dim}"
        )
    config, given = module.generation_config, kwargs.get("generation_config")

    def setting(key: str) -> Any:  # transformers' order: kwargs, the given config, the model's
        if key in kwargs:
            return kwargs[key]
        value = getattr(given, key, None)
        return value if value is not None else getattr(config, key, None)

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
    value = math.nan if pad_value is None else pad_value
    return value, _Generated(label, fill, beams, value).align


@dataclasses.dataclass(frozen=True)
class _Generated:
    """transformers' ``generate``: the replicas' outputs aligned as the bare model returns them for the whole batch
    (`fill`: its pad of finished rows, None where it keeps generating; `beams` per row; `pad`: missing steps)."""

    label: str
    fill: int | None
    beams: int
    pad: float

    def align(self, outputs: list[Any], sizes: list[int]) -> list[Any]:
        """`outputs` with their token ids, beam indices and steps aligned."""
        if all(isinstance(o, torch.Tensor) and o.dim() == 2 for o in outputs):
            return self._tokens(outputs, "output")
        if not all(isinstance(o, Mapping) and isinstance(o.get("sequences"), torch.Tensor) for o in outputs):
            return outputs  # not a generate output: the generic rules apply
        fields = [dict(o) for o in outputs]
        for f, padded in zip(fields, self._tokens([o["sequences"] for o in outputs], "output['sequences']")):
            f["sequences"] = padded
        if all(isinstance(o.get("beam_indices"), torch.Tensor) for o in outputs):
            starts = [sum(sizes[:j]) * self.beams for j in range(len(outputs))]
            moved = [torch.where(o["beam_indices"] >= 0, o["beam_indices"] + s, -1) for o, s in zip(outputs, starts)]
            for f, padded in zip(fields, _right_padded(moved, -1)):
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
        return sequences if self.fill is None else _right_padded(sequences, self.fill)

    def _steps(self, steps: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Per-step tuples extended to the longest one's steps, filled with `pad`."""
        longest = max(steps, key=len)
        out = []
        for own in steps:
            first = torch_pytree.tree_leaves(own[0])
            extra = []
            for step in longest[len(own) :]:
                tensors, spec = torch_pytree.tree_flatten(step)
                made = [
                    torch.full((f.size(0), *t.shape[1:]), self.pad, dtype=t.dtype, device=f.device)
                    for t, f in zip(tensors, first)
                ]
                extra.append(torch_pytree.tree_unflatten(made, spec))
            out.append(own + tuple(extra))
        return out


def _right_padded(values: list[torch.Tensor], fill: float) -> list[torch.Tensor]:
    """2-d `values` right-padded along dimension 1 to the longest with `fill`."""
    longest = max(v.size(1) for v in values)
    return [
        v if v.size(1) == longest else torch.nn.functional.pad(v, (0, longest - v.size(1)), value=fill) for v in values
    ]
