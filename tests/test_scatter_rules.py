"""The scatter rules for tensors whose size is not the batch's.

* A 0-dim tensor reaches every replica whole.
* A tensor whose size along the split dim equals the number of replicas
  used, while the batch's does not, is split one row per replica (torch's
  result for Hugging Face Trainer's ``num_items_in_batch``, expanded to
  ``[n_gpu, 1]``), in the order of the replicas, also for uneven batches and
  when fewer replicas than devices run.
* Every other disagreement is a ValueError naming both tensors: never a
  silent truncation.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dpcore
from dpcore._split import plan_split
from dpcore.scatter_gather import scatter_kwargs

CPU2 = ["cpu"] * 2
CPU3 = ["cpu"] * 3


def _ids(batch: int, length: int = 5) -> torch.Tensor:
    return torch.arange(batch * length).reshape(batch, length)


# ---------------------------------------------------------------------------
# plan_split, the rule itself
# ---------------------------------------------------------------------------


def test_plan_all_equal_sizes_are_the_batch() -> None:
    # 2 rows on 2 devices: the size is both the batch and the replica count; it is the batch
    plan = plan_split([("a", 2), ("b", 2)], 2)
    assert plan.batch == 2 and plan.sizes == [1, 1] and plan.replicas == 2


def test_plan_zero_dim_takes_no_part() -> None:
    assert plan_split([("a", None), ("b", 7), ("c", None)], 3) == (7, [3, 2, 2], 3)
    assert plan_split([("a", None)], 3) == (None, [], 1)


@pytest.mark.parametrize(
    ("entries", "devices", "expected"),
    [
        ([("input_ids", 8), ("num_items", 2)], 2, (8, [4, 4], 2)),
        ([("num_items", 2), ("input_ids", 8)], 2, (8, [4, 4], 2)),  # either order
        ([("x", 7), ("r", 3)], 3, (7, [3, 2, 2], 3)),  # uneven
        ([("x", 2), ("r", 2)], 3, (2, [1, 1, 0], 2)),  # fewer replicas than devices: all equal, the batch
        ([("x", 9), ("r", 4)], 4, (9, [3, 2, 2, 2], 4)),
    ],
)
def test_plan_replica_count_tensor(entries: list[tuple[str, int]], devices: int, expected: tuple[Any, ...]) -> None:
    assert tuple(plan_split(entries, devices)) == expected


def test_plan_a_tensor_of_the_device_count_when_fewer_replicas_run() -> None:
    """Rule 3b: Trainer's [n_gpu, 1] when the last batch has fewer rows than
    devices (3 replicas run, not 4), or a split with an empty device."""
    assert tuple(plan_split([("ids", 3), ("n", 4)], 4)) == (3, [1, 1, 1, 0], 3)
    assert tuple(plan_split([("n", 4), ("ids", 1)], 4)) == (1, [1, 0, 0, 0], 1)
    assert tuple(plan_split([("x", 5), ("n", 3)], 3, chunk_sizes=[3, 0, 2])) == (5, [3, 0, 2], 2)


def test_plan_follows_chunk_sizes_and_weights() -> None:
    # chunk_sizes with an empty device: 2 replicas run, so a size 2 is one row per replica
    assert tuple(plan_split([("x", 5), ("r", 2)], 3, chunk_sizes=[3, 0, 2])) == (5, [3, 0, 2], 2)
    assert tuple(plan_split([("x", 6), ("r", 3)], 3, weights=[1, 1, 1])) == (6, [2, 2, 2], 3)
    with pytest.raises(ValueError, match=r"r has size 4 .* x has size 5: .*\(2 for a batch of 5\)"):
        plan_split([("x", 5), ("r", 4)], 3, chunk_sizes=[3, 0, 2])


@pytest.mark.parametrize(
    ("entries", "devices", "pattern"),
    [
        ([("a", 8), ("b", 3)], 2, r"b has size 3 along dim 0 but a has size 8: .*\(2 for a batch of 8\)"),
        ([("a", 8), ("b", 2), ("c", 3)], 2, r"c has size 3 along dim 0 but a has size 8"),
        # neither the batch, nor the replicas used (2), nor the device count (4)
        ([("ids", 2), ("n", 3)], 4, r"n has size 3 along dim 0 but ids has size 2: .*\(2 for a batch of 2\)"),
        ([("a", 1), ("b", 3)], 2, r"b has size 3 along dim 0 but a has size 1"),
    ],
)
def test_plan_other_disagreements_are_errors(entries: list[tuple[str, int]], devices: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        plan_split(entries, devices)


# ---------------------------------------------------------------------------
# scatter_kwargs: Trainer's exact shapes
# ---------------------------------------------------------------------------


def test_trainer_gpu_shapes_num_items_expanded_to_replicas() -> None:
    """Trainer with 2 GPUs: input_ids [8, L], num_items_in_batch [2, 1]."""
    ids = _ids(8)
    num_items = torch.tensor(37).unsqueeze(0).expand(2, -1)
    args, kws, sizes, used = scatter_kwargs((), {"input_ids": ids, "num_items_in_batch": num_items}, CPU2)
    assert sizes == [4, 4] and used == [0, 1]
    for j in range(2):
        assert torch.equal(kws[j]["input_ids"], ids[4 * j : 4 * j + 4])
        assert kws[j]["num_items_in_batch"].shape == (1, 1) and kws[j]["num_items_in_batch"].item() == 37


@pytest.mark.parametrize("devices", [CPU2, CPU3])
def test_trainer_cpu_shapes_zero_dim_num_items(devices: list[str]) -> None:
    """Trainer on a CPU list sees no GPU and passes a 0-dim num_items_in_batch."""
    ids = _ids(8)
    num_items = torch.tensor(37)
    _, kws, sizes, _ = scatter_kwargs((), {"input_ids": ids, "num_items_in_batch": num_items}, devices)
    assert sum(sizes) == 8 and len(kws) == len(devices)
    for kw in kws:
        assert kw["num_items_in_batch"].dim() == 0 and kw["num_items_in_batch"].item() == 37


def test_uneven_batch_rows_and_replicas_line_up() -> None:
    """Batch 7 on 3 replicas (3, 2, 2 rows): replica j gets row j of the per-replica tensor."""
    x = torch.arange(7.0).unsqueeze(1)
    r = torch.tensor([[10.0], [20.0], [30.0]])
    args, _, sizes, _ = scatter_kwargs((x, r), None, CPU3)
    assert sizes == [3, 2, 2]
    assert [a[0].flatten().tolist() for a in args] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [a[1].flatten().tolist() for a in args] == [[10.0], [20.0], [30.0]]


def test_split_dim_one() -> None:
    x = torch.arange(14.0).reshape(2, 7)
    r = torch.tensor([[1.0, 2.0, 3.0]])
    args, _, sizes, _ = scatter_kwargs((x, r), None, CPU3, dim=1)
    assert sizes == [3, 2, 2]
    assert [a[1].tolist() for a in args] == [[[1.0]], [[2.0]], [[3.0]]]
    assert all(a[0].shape == (2, s) for a, s in zip(args, sizes))


def test_mismatch_still_errors_in_scatter_kwargs() -> None:
    with pytest.raises(ValueError, match=r"kwargs\['n'\] has size 3 along dim 0 but kwargs\['input_ids'\] has size 8"):
        scatter_kwargs((), {"input_ids": _ids(8), "n": torch.ones(3, 1)}, CPU2)


def test_top_level_scatter_zero_dim_and_per_replica() -> None:
    parts = dpcore.scatter((torch.arange(6.0), torch.tensor(5.0), torch.tensor([1.0, 2.0, 3.0])), CPU3)
    assert len(parts) == 3
    for j, (x, s, r) in enumerate(parts):
        assert x.tolist() == [2.0 * j, 2.0 * j + 1] and s.item() == 5.0 and r.tolist() == [j + 1.0]


def test_gradients_reach_zero_dim_and_per_replica_inputs() -> None:
    """A 0-dim scale that requires grad gets the sum of every replica's
    gradient, a per-replica tensor each replica's own rows' gradient."""
    x = torch.arange(7.0, dtype=torch.float64).unsqueeze(1)
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    r = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64, requires_grad=True)
    args, _, sizes, _ = scatter_kwargs((x, scale, r), None, CPU3)
    total = sum(((a[0] * a[1]) * a[2]).sum() for a in args)
    total.backward()
    chunks = x.split(sizes)
    assert scale.grad is not None and r.grad is not None
    torch.testing.assert_close(scale.grad, sum(c.sum() * r[j, 0].detach() for j, c in enumerate(chunks)))
    torch.testing.assert_close(r.grad.flatten(), torch.stack([2.0 * c.sum() for c in chunks]))


# ---------------------------------------------------------------------------
# Through DataParallel, against one device
# ---------------------------------------------------------------------------


class _Scaled(nn.Module):
    """out = linear(x) / num_items, num_items a 0-dim tensor or one row of [R, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        return self.linear(x) / num_items_in_batch.reshape(())


@pytest.mark.parametrize(("devices", "batch"), [(CPU2, 8), (CPU3, 7), (CPU3, 2), (CPU3, 1), (CPU2, 1)])
@pytest.mark.parametrize("form", ["zero_dim", "per_replica", "per_device"])
def test_data_parallel_num_items_equals_one_device(devices: list[str], batch: int, form: str) -> None:
    """num_items_in_batch as a 0-dim tensor (Trainer on a CPU list), one row
    per replica used, or one row per device (Trainer's [n_gpu, 1], also
    where a last batch smaller than the device list runs fewer replicas:
    each replica gets its row, the rows left over repeat the first, so
    nothing is lost): exact against one device."""
    torch.manual_seed(0)
    module = _Scaled().double()
    reference = copy.deepcopy(module)
    dp = dpcore.DataParallel(module, devices)
    x = torch.randn(batch, 4, dtype=torch.float64)
    count = torch.tensor(11.0, dtype=torch.float64)
    rows = {"zero_dim": 0, "per_replica": min(batch, len(devices)), "per_device": len(devices)}[form]
    # materialized, as Trainer's division of the expanded count leaves it
    given = count if form == "zero_dim" else count.unsqueeze(0).expand(rows, -1) / 1
    out = dp(x, num_items_in_batch=given)
    expected = reference(x, num_items_in_batch=count)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def test_data_parallel_rows_per_device_that_differ_are_an_error_when_fewer_replicas_run() -> None:
    """One row per device whose rows differ, against a batch smaller than the
    device list: the rows beyond the replicas would be dropped, so it is an
    error naming the argument, never a truncation."""
    dp = dpcore.DataParallel(_Scaled().double(), CPU3)
    per_device = torch.tensor([[11.0], [11.0], [12.0]], dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"kwargs\['num_items_in_batch'\] has size 3 along dim 0, one row per "
        r"device, but the batch runs on 2 replica\(s\), and its rows differ",
    ):
        dp(torch.randn(2, 4, dtype=torch.float64), num_items_in_batch=per_device)
