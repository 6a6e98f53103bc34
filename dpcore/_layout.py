"""The layout every rank of the hybrid mode shares, and the ranks themselves (private); docs/design.md, "Hybrid"."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpcore._loader import _C

#: The layout's items by key: (what every rank must have equal, how an error shows it).
Items = dict[str, tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class Peers:
    """The processes of the hybrid mode as this one sees them: their group, this rank, their number, and the device of
    the collectives (the module's)."""

    group: Any
    rank: int
    world_size: int
    device: torch.device


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """What the ranks agree on for a module: its `structure` (:func:`structure_of`), its trainable `params`, their
    gradient `buckets` (indices into `params`), and the `items` compared (the tensors, the buckets, then `options`)."""

    structure: list[tuple[Any, ...]]
    params: list[torch.Tensor]
    buckets: list[list[int]]
    items: Items
    options: Items


def _named(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) of every parameter, then every buffer."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            yield kind, name, t


def structure_of(module: nn.Module) -> list[tuple[Any, ...]]:
    """What a rebuild of the buckets depends on: every parameter and buffer (kind, name, identity, shape, dtype, device,
    requires_grad), in order."""
    return [(kind, name, id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad) for kind, name, t in _named(module)]


def _describe_change(old: Layout, new: Layout) -> list[str]:
    """One phrase per tensor or option that changed between two layouts."""
    before = {(kind, name): rest for kind, name, *rest in old.structure}
    after = {(kind, name): rest for kind, name, *rest in new.structure}
    phrases = []
    for (kind, name), (ident, *was) in before.items():
        if (kind, name) not in after:
            phrases.append(f"{kind} {name!r} removed")
            continue
        ident2, *now = after[(kind, name)]
        what = ["replaced by another tensor"] if ident2 != ident else []
        what += [f"{field} {a} -> {b}" for field, a, b in zip(("shape", "dtype", "device"), was, now) if a != b]
        if now[3] != was[3]:
            what.append("frozen (requires_grad True -> False)" if was[3] else "unfrozen (requires_grad False -> True)")
        if what:
            phrases.append(f"{kind} {name!r} " + ", ".join(what))
    phrases += [f"{kind} {name!r} added" for kind, name in after if (kind, name) not in before]
    phrases += [
        f"{shown} where it had {old.options[key][1]}"
        for key, (value, shown) in new.options.items()
        if key in old.options and old.options[key][0] != value
    ]
    return phrases or ["the order of its parameters or buffers"]


def _digest(t: torch.Tensor) -> str:
    """A hash of a tensor's values."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def layout_of(module: nn.Module, bucket_bytes: int, options: Items) -> Layout:
    """`module`'s layout: each tensor, each bucket (shown with `bucket_bytes`, which makes them), then `options`."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    buckets = [list(g) for g in _C.make_buckets(trainable, bucket_bytes)]
    items: Items = {}
    for kind, name, t in _named(module):
        line = f"{kind} {name!r}: shape {tuple(t.shape)}, {t.dtype}"
        items[f"{kind} {name!r}"] = (line + (f", requires_grad={t.requires_grad}" if kind == "parameter" else ""),) * 2
    for k, group in enumerate(buckets):
        line = f"gradient bucket {k}: parameters {group}"
        items[f"gradient bucket {k}"] = (line, f"bucket_bytes={bucket_bytes} ({line})")
    return Layout(structure_of(module), trainable, buckets, {**items, **options}, dict(options))


def _compared(items: Items) -> list[tuple[str, str]]:
    return [(key, value) for key, (value, _) in items.items()]


def _first_difference(theirs: Items, base: Items) -> tuple[str, str] | None:
    """How the first item that differs between `theirs` and `base` shows on each side; None if none does."""
    for key in dict.fromkeys([*base, *theirs]):
        a, b = theirs.get(key), base.get(key)
        if a is None or b is None or a[0] != b[0]:
            return (a[1] if a else f"no {key}"), (b[1] if b else f"no {key}")
    return None


def check_layout(layout: Layout, peers: Peers) -> None:
    """Collective: ValueError on every rank, naming each rank's first difference from rank 0 as the user gave it, unless
    every rank has the same items (one all-gather of a hash)."""
    digest = hashlib.sha256(repr(_compared(layout.items)).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], dtype=torch.int64, device=peers.device)
    every = [torch.empty_like(mine) for _ in range(peers.world_size)]
    dist.all_gather(every, mine, group=peers.group)
    if all(torch.equal(h, every[0]) for h in every):
        return
    layouts: list[Any] = [None] * peers.world_size
    dist.all_gather_object(layouts, layout.items, group=peers.group)
    found = [(rank, _first_difference(other, layouts[0])) for rank, other in enumerate(layouts)]
    parts = [f"rank {rank} has {d[0]} where rank 0 has {d[1]}" for rank, d in found if d is not None]
    raise ValueError(
        "process_group: every process must wrap a module of the same layout with the same options, but "
        + ("; ".join(parts) or "the order of the parameters or buffers differs")
    )


def agree_on_change(peers: Peers, module: nn.Module, built: Layout, now: Layout, changed: Sequence[int]) -> None:
    """Collective, once the ranks `changed` changed their module (or options) since `built`, to `now`: ValueError on
    every rank, naming each rank's change, unless every rank made the same change with the same values in new
    tensors."""
    known = {entry[2] for entry in built.structure}
    values = [f"{kind} {name!r} values {_digest(t)}" for kind, name, t in _named(module) if id(t) not in known]
    what = _describe_change(built, now) if peers.rank in changed else []
    world_size = peers.world_size
    reports: list[Any] = [None] * world_size
    dist.all_gather_object(reports, (_compared(now.items), values, what), group=peers.group)
    if len(changed) == world_size and all(r[:2] == reports[0][:2] for r in reports):
        return  # the same change everywhere: adopted after this synchronization
    parts = [f"rank {r}: {'; '.join(reports[r][2]) or 'its layout'}" for r in changed]
    unchanged = [r for r in range(world_size) if r not in changed]
    if unchanged:
        tail = f"rank{'s' if len(unchanged) > 1 else ''} {', '.join(map(str, unchanged))} did not change"
    else:
        tail = "the changes differ between ranks (the tensors' values too, for replaced ones)"
    raise ValueError(
        "DataParallel(process_group=...): the module's layout or the loss options changed after construction on "
        f"{'rank' if len(changed) == 1 else 'ranks'} {', '.join(map(str, changed))} ({' | '.join(parts)}), "
        f"but {tail}. Every rank must make the same change before the same forward; this backward's "
        "gradients were left as they were, not synchronized"
    )
