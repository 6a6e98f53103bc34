"""``dp.generate`` against the bare model's ``generate`` on the whole batch,
in generated tokens per second, measured in the same run.

The model is a GPT-2 of transformers built from a small config with random
weights (nothing downloaded; float32): 4 layers of width 256, a vocabulary
of 2000, 16 prompts of 16 tokens, some left-padded. Every row generates
exactly ``--new-tokens`` tokens (``min_new_tokens`` equals
``max_new_tokens``), so both sides generate the same tokens (checked) and
the ratio of their rates is the inverse ratio of their times. Rows: greedy
search and beam search (4 beams). Each is timed in alternating rounds
(``measure_rounds``): ``x bare`` is dp.generate's tokens/s over the bare
model's, the median round's, with the lowest and highest round's ratio (on
a shared machine the spread is the noise). On a CPU list also ``x bare 1
thread``: against the bare model run with ``torch.set_num_threads(1)``. On
a loaded CPU, torch's intra-op threads of a whole-batch call wait for each
other; the replicas of a CPU list do not, so ``x bare`` there measures that
as much as the parallelism, and ``x bare 1 thread`` is the baseline without
it.

    python bench/bench_generate.py --devices cpu:2 --json out/generate.json

Needs transformers (``pip install transformers``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

import dpcore
from dpcore.bench._common import bench_command, environment, measure_rounds, ratio_spread

BATCH = 16
PROMPT = 16
COLUMNS = [
    ("search", "search", ""),
    ("new_tokens", "new tokens", "d"),
    ("bare_tokens_per_s", "bare tok/s", ".1f"),
    ("dpcore_tokens_per_s", "dp tok/s", ".1f"),
    ("ratio_median", "x bare", ".2f"),
    ("ratio_min", "min", ".2f"),
    ("ratio_max", "max", ".2f"),
    ("one_thread_ratio_median", "x bare 1 thread", ".2f"),
    ("one_thread_ratio_min", "min", ".2f"),
    ("one_thread_ratio_max", "max", ".2f"),
]


def _model(device: torch.device) -> Any:
    try:
        import transformers
    except ImportError:
        raise SystemExit(
            "bench_generate needs transformers, which is not installed (pip install transformers)"
        ) from None
    config = transformers.GPT2Config(
        vocab_size=2000,
        n_positions=128,
        n_embd=256,
        n_layer=4,
        n_head=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device).eval()


def run(
    devices: Sequence[torch.device], quick: bool = False, repeats: int | None = None, new_tokens: int | None = None
) -> dict[str, Any]:
    """Times dp.generate over `devices` against the bare model's generate on the whole batch."""
    first = devices[0]
    model = _model(first)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2000, (BATCH, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(0, BATCH, 3):  # left padding of 1..5 tokens in every third row
        ids[row, : row % 5 + 1], mask[row, : row % 5 + 1] = 0, 0
    ids, mask = ids.to(first), mask.to(first)
    new = new_tokens or (8 if quick else 16)
    dp = dpcore.DataParallel(model, list(devices))
    rows = []
    for search, beams in (("greedy", 1), ("beam 4", 4)):
        settings = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "num_beams": beams}
        ours = dp.generate(ids, attention_mask=mask, **settings)
        bare = model.generate(ids, attention_mask=mask, **settings)
        if not torch.equal(ours, bare):
            raise AssertionError(f"{search}: dp.generate's tokens differ from the bare model's")
        rounds, calls = (3 if quick else 5), (repeats or 1)

        def ours_call() -> Any:
            return dp.generate(ids, attention_mask=mask, **settings)

        def bare_call() -> Any:
            return model.generate(ids, attention_mask=mask, **settings)

        mine, theirs = measure_rounds(ours_call, bare_call, devices, rounds=rounds, repeats=calls)
        tokens = BATCH * new
        row: dict[str, Any] = {
            "search": search,
            "new_tokens": new,
            "bare_tokens_per_s": tokens / statistics.median(theirs),
            "dpcore_tokens_per_s": tokens / statistics.median(mine),
            **ratio_spread(theirs, mine),  # the time ratio bare/ours: the rate ratio ours/bare
        }
        if first.type == "cpu":
            mine, theirs = measure_rounds(ours_call, _one_thread(bare_call), devices, rounds=rounds, repeats=calls)
            spread = ratio_spread(theirs, mine)
            row.update({f"one_thread_{key}": value for key, value in spread.items()})
            row["bare_one_thread_tokens_per_s"] = tokens / statistics.median(theirs)
        rows.append(row)
        alone = f", x bare 1 thread {row['one_thread_ratio_median']:.2f}" if "one_thread_ratio_median" in row else ""
        print(f"  {search}: x bare {row['ratio_median']:.2f}{alone}", flush=True)
    return {
        "benchmark": "generate",
        "devices": [str(d) for d in devices],
        "batch": BATCH,
        "prompt_tokens": PROMPT,
        "rows": rows,
        "env": environment(),
    }


def _one_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` run with one intra-op thread (the setting restored after)."""

    def call() -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(threads)

    return call


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="tokens generated per row (default 16; --quick: 8)"
    )


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace, devices: list[torch.device]) -> None:
    if args.new_tokens is not None and args.new_tokens < 1:
        parser.error(f"--new-tokens: expected at least 1, but got {args.new_tokens}")


main = bench_command("python bench/bench_generate.py", __doc__, run, COLUMNS, _options, _check)

if __name__ == "__main__":
    main()
