"""The units of ``shard_parameters=`` (docs/sharded_parameters.md): the policy's check, the post-order plan of a
module's units, and the byte balance that places each parameter (also the sharded optimizer's)."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import nn

__all__ = ["DEFAULT_UNIT_SHARE", "Unit", "balance", "check_policy", "plan_units"]

#: The default unit: a submodule holding at least this share of the module's parameters not in a smaller unit.
DEFAULT_UNIT_SHARE = 1 / 16


def balance(sizes: list[int], loads: list[int]) -> list[int]:
    """The shard of each item: largest first, each to the least loaded shard (the first of equals); updates `loads`."""
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = min(range(len(loads)), key=lambda k: loads[k])
        owners[i] = k
        loads[k] += sizes[i]
    return owners


def check_policy(value: Any) -> Any:
    """`value` if ``shard_parameters=`` takes it: False, True (the default units), an int (a unit's least number of
    parameters), a tuple of module classes, or a callable ``(module) -> bool``; TypeError naming it otherwise."""
    ok = isinstance(value, (bool, int)) or callable(value) and not isinstance(value, type)
    ok = ok or isinstance(value, tuple) and bool(value) and all(isinstance(c, type) for c in value)
    if not ok or (not isinstance(value, bool) and isinstance(value, int) and value <= 0):
        raise TypeError(
            f"shard_parameters: expected True or False, a positive int (the fewest parameters of a unit), a "
            f"tuple of module classes (each instance one unit) or a callable (module) -> bool, but got {value!r}"
        )
    return value


class Unit(NamedTuple):
    """One unit: its root module's index in ``module.modules()``, its name, its parameters (unique) and the slots
    ``(module index, name, parameter index)`` that hold them."""

    root: int
    name: str
    params: list[nn.Parameter]
    slots: list[tuple[int, str, int]]


def plan_units(module: nn.Module, policy: Any) -> list[Unit]:
    """The units of `module` by `policy` (:func:`check_policy`), post-order: a submodule is a unit where the policy
    picks it, holding the parameters of its subtree not in a unit below; the root is the last unit, with the rest.
    Containers without a forward (ModuleList, ModuleDict) are never units."""
    modules = list(module.named_modules(remove_duplicate=True))
    index = {id(m): i for i, (_, m) in enumerate(modules)}
    direct = [[(n, p) for n, p in m._parameters.items() if p is not None] for _, m in modules]
    total = sum(p.numel() for p in module.parameters())
    least = max(1, int(total * DEFAULT_UNIT_SHARE)) if policy is True else policy if type(policy) is int else 0
    claimed: set[int] = set()  # module indices inside a unit
    units: list[Unit] = []

    def free_params(i: int) -> int:
        seen: set[int] = set()
        count = 0
        for j in _subtree(modules, i, index):
            if j not in claimed:
                for _, p in direct[j]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        count += p.numel()
        return count

    def picks(m: nn.Module, i: int) -> bool:
        if getattr(type(m), "forward", None) is nn.Module.forward:
            return False
        if least:
            return free_params(i) >= least
        return isinstance(m, policy) if isinstance(policy, tuple) else bool(policy(m))

    for i in _post_order(modules, index):
        if i == 0 or i in claimed or not (picks(modules[i][1], i) and free_params(i)):
            continue
        members = [j for j in _subtree(modules, i, index) if j not in claimed]
        units.append(_unit(i, modules[i][0], members, direct))
        claimed.update(members)
    units.append(_unit(0, "", [j for j in range(len(modules)) if j not in claimed], direct))
    return units


def _unit(root: int, name: str, members: list[int], direct: list[list[tuple[str, nn.Parameter]]]) -> Unit:
    params: list[nn.Parameter] = []
    where: dict[int, int] = {}
    slots = []
    for j in members:
        for n, p in direct[j]:
            if id(p) not in where:
                where[id(p)] = len(params)
                params.append(p)
            slots.append((j, n, where[id(p)]))
    return Unit(root, name, params, slots)


def _children(modules: list[tuple[str, nn.Module]], i: int, index: dict[int, int]) -> list[int]:
    return [index[id(c)] for c in modules[i][1]._modules.values() if c is not None and id(c) in index]


def _subtree(modules: list[tuple[str, nn.Module]], i: int, index: dict[int, int]) -> list[int]:
    out, stack = [], [i]
    while stack:
        j = stack.pop()
        if j not in out:
            out.append(j)
            stack.extend(_children(modules, j, index))
    return out


def _post_order(modules: list[tuple[str, nn.Module]], index: dict[int, int]) -> list[int]:
    order: list[int] = []
    seen: set[int] = set()

    def visit(i: int) -> None:
        seen.add(i)
        for c in _children(modules, i, index):
            if c not in seen:
                visit(c)
        order.append(i)

    visit(0)
    return order
