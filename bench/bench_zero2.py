"""The sharded modes measured in one run: shard_gradients=True (ZeRO-2 in one process) against today's
ShardedOptimizer, and shard_parameters=True (ZeRO-3) against ZeRO-2 and the default mode.

* ``training step`` rows: forward, backward, ``step()`` and ``zero_grad()`` of one batch through dpcore.DataParallel,
  two modes at a time (two copies of the model, each with its own wrapper), in alternating rounds (both see the same
  machine load). ``ratio`` is the first mode's time over the second's (at most 1: no slower), the median of the
  rounds' ratios, with the lowest and highest round's. Pairs: shard_gradients over sharded (both with a
  ShardedOptimizer), shard_parameters over shard_gradients, shard_parameters over the default mode with plain AdamW.
  Models: an MLP of 4 Linear layers 256 wide and GPT-2-like models built from a ``transformers.GPT2Config``
  (vocabulary 1000, 64 positions; the full run adds 4 layers 256 wide), AdamW. Without transformers the GPT-2 rows
  are left out, saying so.
* ``memory`` rows: a GPT-2-like model from a config (2 layers, 128 wide; without transformers the MLP), AdamW, in the
  four modes of MODES: each position's peak over a training step of what dpcore holds
  (``dpcore.memory.memory_peak``: parameters, replicas, gradients, optimizer state, working copies, sampled where
  they change; the second step, the state made) and ``device0_over_others``, position 0's peak over the others' mean;
  with shard_parameters also each position's peak of parameter bytes (shards and gathered units, counted at every
  gather: ``peak_parameter_bytes``); on CUDA each GPU's ``torch.cuda.max_memory_allocated`` over the step (MiB).

    python bench/bench_zero2.py --devices cpu:4 --json bench-results/zero2.json
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import dpcore
from dpcore.bench._common import bench_command, environment, measure_rounds, ratio_spread
from dpcore.memory import memory_peak

#: The modes: name -> (DataParallel options, sharded optimizer).
MODES: dict[str, tuple[dict[str, Any], bool]] = {
    "plain": ({}, False),
    "sharded": ({}, True),
    "shard_gradients": ({"shard_gradients": True}, True),
    "shard_parameters": ({"shard_parameters": True}, True),
}
#: The training-step rows' pairs: (mode timed, mode it is over).
PAIRS = (("shard_gradients", "sharded"), ("shard_parameters", "shard_gradients"), ("shard_parameters", "plain"))


def gpt2(n_layer: int, n_embd: int) -> nn.Module:
    """A GPT-2-like language model from a config (no weights downloaded): vocabulary 1000, 64 positions, 4 heads, no
    dropout (the two modes compute the same step)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=4,
        vocab_size=1000,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def mlp(depth: int, width: int) -> nn.Module:
    """`depth` Linear + ReLU layers of `width`."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def has_transformers() -> bool:
    """Whether the GPT-2 rows can run (a machine without transformers runs the MLP rows alone)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _models(quick: bool) -> list[tuple[str, Callable[[], nn.Module], Callable[[torch.device], Any]]]:
    """(label, model factory, batch on a device): the timed models."""

    def tokens(device: torch.device) -> torch.Tensor:
        return torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(0)).to(device)

    def features(device: torch.device) -> torch.Tensor:
        return torch.randn(32, 256, generator=torch.Generator().manual_seed(0)).to(device)

    rows = [("MLP 4x256", lambda: mlp(4, 256), features)]
    if not has_transformers():
        print("  transformers is not installed: the GPT-2 rows are left out")
        return rows
    rows.append(("GPT-2 2x128", lambda: gpt2(2, 128), tokens))
    if not quick:
        rows.append(("GPT-2 4x256", lambda: gpt2(4, 256), tokens))
    return rows


def _loss(dp: dpcore.DataParallel, batch: torch.Tensor) -> torch.Tensor:
    out = dp(batch)
    out = out.logits if hasattr(out, "logits") else out
    return out.float().square().mean()


def _setup(
    model: nn.Module, devices: Sequence[torch.device], mode: str
) -> tuple[dpcore.DataParallel, torch.optim.Optimizer]:
    options, sharded = MODES[mode]
    dp = dpcore.DataParallel(model, list(devices), **options)
    kwargs = {"lr": 1e-4, "weight_decay": 0.01}
    if sharded:
        return dp, dpcore.ShardedOptimizer(model.parameters(), torch.optim.AdamW, devices=dp, **kwargs)
    return dp, torch.optim.AdamW(model.parameters(), **kwargs)


def _train(dp: dpcore.DataParallel, opt: torch.optim.Optimizer, batch: torch.Tensor) -> Callable[[], None]:
    def one() -> None:
        _loss(dp, batch).backward()
        opt.step()
        opt.zero_grad()

    return one


def run(devices: Sequence[torch.device], quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """The training-step rows for each model of :func:`_models`, then the memory rows, on `devices`."""
    rounds, per_round = (11, repeats or 3) if quick else (21, repeats or 4)
    first = devices[0]
    rows: list[dict[str, Any]] = []
    for label, factory, make_batch in _models(quick):
        torch.manual_seed(0)
        base = factory().to(first)
        batch = make_batch(first)
        for mode, baseline in PAIRS:
            one = _train(*_setup(copy.deepcopy(base), devices, mode), batch)
            other = _train(*_setup(copy.deepcopy(base), devices, baseline), batch)
            ours, theirs = measure_rounds(one, other, devices, rounds=rounds, repeats=per_round)
            spread = ratio_spread(ours, theirs)
            rows.append(
                {
                    "model": label,
                    "measured": f"training step, {mode} over {baseline}",
                    "mode_ms": statistics.median(ours) * 1e3,
                    "baseline_ms": statistics.median(theirs) * 1e3,
                    "ratio": spread["ratio_median"],
                    "ratio_min": spread["ratio_min"],
                    "ratio_max": spread["ratio_max"],
                }
            )
            print(f"  {label}, training step, {mode} over {baseline}: {spread['ratio_median']:.3f}")
    rows += memory_rows(devices)
    return {"benchmark": "zero2", "devices": [str(d) for d in devices], "env": environment(), "rows": rows}


def memory_rows(devices: Sequence[torch.device], n_layer: int = 2, n_embd: int = 128) -> list[dict[str, Any]]:
    """Per mode of MODES, each position's peak over the second training step of a GPT-2-like model (the MLP without
    transformers) and position 0's over the others' mean."""
    first = devices[0]
    torch.manual_seed(0)
    if has_transformers():
        label, base = f"GPT-2 {n_layer}x{n_embd}", gpt2(n_layer, n_embd).to(first)
        batch = torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(0)).to(first)
    else:
        label, base = "MLP 4x256", mlp(4, 256).to(first)
        batch = torch.randn(32, 256, generator=torch.Generator().manual_seed(0)).to(first)
    p_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    rows = []
    for mode in MODES:
        dp, opt = _setup(copy.deepcopy(base), devices, mode)
        step = _train(dp, opt, batch)
        step()  # the state made
        units = dp.sharded_parameters
        if units is not None:
            units.reset_peak()
        with memory_peak(dp, opt) as peak:
            _loss(dp, batch).backward()
            opt.step()
        opt.zero_grad()
        totals = peak.totals
        rest = totals[1:]
        row: dict[str, Any] = {
            "model": label,
            "measured": f"memory, {mode}",
            "parameter_bytes": p_bytes,
            "peak_bytes": totals,
            "peak_over_parameters": [round(t / p_bytes, 3) for t in totals],
            "device0_over_others": round(totals[0] / (sum(rest) / len(rest)), 4) if rest else None,
        }
        if units is not None:
            row["peak_parameter_bytes"] = [h["peak_parameters"] for h in units.held_bytes().values()]
        allocator = [r.allocator_peak for r in peak.report]
        if any(a is not None for a in allocator):
            row["allocator_peak_mib"] = [None if a is None else round(a / 2**20, 2) for a in allocator]
        rows.append(row)
        print(
            f"  {row['model']}, {mode}: peak/P per position {row['peak_over_parameters']}, "
            f"device 0 over the others' mean {row['device0_over_others']}"
        )
    return rows


COLUMNS = [
    ("model", "model", "s"),
    ("measured", "measured", "s"),
    ("mode_ms", "mode ms", ".2f"),
    ("baseline_ms", "baseline ms", ".2f"),
    ("ratio", "mode / baseline", ".3f"),
    ("ratio_min", "lowest", ".3f"),
    ("ratio_max", "highest", ".3f"),
    ("device0_over_others", "device 0 / others' mean", ".3f"),
]


main = bench_command("bench_zero2", __doc__, run, COLUMNS)


if __name__ == "__main__":
    main()
