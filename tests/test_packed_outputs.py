"""Outputs that are a replica's packed data (``out.data`` of an RNN over a
PackedSequence input), and packed targets given to ``criterion=``, against
one device in float64.

* An LSTM and a GRU over packed input returning ``out.data`` (alone, and
  beside the per-sequence ``h_n[-1]``) train and infer exactly as one device
  on ``cpu*2`` .. ``cpu*4``, with ``enforce_sorted`` True and False, uneven
  splits and ``chunk_sizes``: the packed rows come back in the whole batch's
  packed order, the per-sequence rows in the sequences' order, and gradients
  reach the input and the parameters.
* With ``dim=1`` (other tensors split along dim 1), packed data still comes
  back joined along its rows.
* Every sequence of length 1: where the packed order is the sequences'
  order both readings agree (exact); where it is not, a ValueError that
  names the output and says to return a PackedSequence, never a guess.
* ``criterion=`` with a packed target: summed, exact; a mean needs
  ``loss_items`` (ValueError naming it), and with it is exact for a mean over
  the packed rows and for one over the sequences.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import dpcore
from test_sample_lists import _close, _same_grads

LENGTHS = [3, 7, 1, 7, 5, 2, 6, 4, 2, 5]


class PackedData(nn.Module):
    """An RNN over packed input that returns the packed data itself (the
    per-step features, one row per packed row) and, with ``last``, also the
    last layer's final hidden state (one row per sequence)."""

    def __init__(self, rnn: type[nn.RNNBase], last: bool) -> None:
        super().__init__()
        self.rnn = rnn(3, 5, num_layers=2)
        self.head = nn.Linear(5, 2)
        self.last = last

    def forward(self, packed: PackedSequence) -> Any:
        out, hidden = self.rnn(packed)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden
        data = self.head(out.data)
        return (data, h_n[-1]) if self.last else data


def _model(rnn: type[nn.RNNBase], last: bool) -> PackedData:
    torch.manual_seed(0)
    return PackedData(rnn, last).double()


def _batch(lengths: list[int], seed: int, enforce_sorted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    if enforce_sorted:
        lens = lens.sort(descending=True).values
    return torch.randn(len(lengths), int(lens.max()), 3, generator=g, dtype=torch.float64), lens


def _pack(x: torch.Tensor, lengths: torch.Tensor, enforce_sorted: bool) -> PackedSequence:
    return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)


def _run_steps(
    model: nn.Module, call: Callable[[PackedSequence], Any], count: int, enforce_sorted: bool
) -> list[tuple[Any, torch.Tensor]]:
    """Three SGD steps; per step the output (detached) and the input's gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(3):
        x, lengths = _batch(LENGTHS[:count], step, enforce_sorted)
        x.requires_grad_()
        optimizer.zero_grad()
        out = call(_pack(x, lengths, enforce_sorted))
        parts = out if isinstance(out, tuple) else (out,)
        sum((p * torch.linspace(-1, 1, p.numel(), dtype=p.dtype).view_as(p)).sum() for p in parts).backward()
        history.append((tuple(p.detach() for p in parts), x.grad))
        optimizer.step()
    return history


@pytest.mark.parametrize(
    ("rnn", "last", "enforce_sorted", "count", "n_devices", "split"),
    [
        (nn.LSTM, False, False, 8, 2, {}),
        (nn.LSTM, True, True, 7, 3, {}),
        (nn.LSTM, False, False, 10, 4, {}),
        (nn.GRU, False, True, 8, 2, {}),
        (nn.GRU, True, False, 7, 3, {}),
        (nn.GRU, False, False, 3, 4, {}),  # fewer sequences than devices
        (nn.LSTM, True, False, 6, 3, {"chunk_sizes": [1, 4, 1]}),
    ],
)
def test_packed_data_output_trains_like_one_device(
    rnn: type[nn.RNNBase], last: bool, enforce_sorted: bool, count: int, n_devices: int, split: dict[str, Any]
) -> None:
    one = _model(rnn, last)
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(dp_model, ["cpu"] * n_devices, **split)
    expected = _run_steps(one, one, count, enforce_sorted)
    got = _run_steps(dp_model, dp, count, enforce_sorted)
    for (e_out, e_grad), (g_out, g_grad) in zip(expected, got):
        for e, g in zip(e_out, g_out):
            _close(g, e)
        _close(g_grad, e_grad)
    _same_grads(dp_model, one)
    for p, q in zip(dp_model.parameters(), one.parameters()):
        _close(p, q)


def test_packed_data_is_reordered_not_just_concatenated() -> None:
    """The case of the issue: each replica's packed rows concatenated are not
    the batch's packed order (most rows differ), and the gather puts them there."""
    one = _model(nn.LSTM, last=False).eval()
    x, lengths = _batch(LENGTHS[:8], 0, enforce_sorted=False)
    packed = _pack(x, lengths, False)
    dp = dpcore.DataParallel(copy.deepcopy(one), ["cpu"] * 3, gather=False)
    with torch.no_grad():
        expected = one(packed)
        concatenated = torch.cat(dp(packed))
        dp.gather_output = True
        got = dp(packed)
    assert concatenated.shape == expected.shape
    assert (concatenated != expected).any(dim=1).sum() > expected.shape[0] // 2
    _close(got, expected)


def test_packed_data_with_another_split_dim() -> None:
    """dim=1 splits a time-major tensor along its batch; the packed data,
    one row per packed row, is still joined along its rows."""

    class WithContext(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 4)

        def forward(self, packed: PackedSequence, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, _ = self.rnn(packed)
            return out.data, context * 2

    torch.manual_seed(0)
    one = WithContext().double()
    dp = dpcore.DataParallel(copy.deepcopy(one), ["cpu"] * 3, dim=1)
    x, lengths = _batch(LENGTHS[:7], 1, enforce_sorted=False)
    packed = _pack(x, lengths, False)
    context = torch.randn(2, 7, 3, dtype=torch.float64)  # [time, batch, features]
    e_data, e_context = one(packed, context)
    g_data, g_context = dp(packed, context)
    _close(g_data, e_data)
    _close(g_context, e_context)


def test_sequences_of_length_one_in_the_sequences_order_are_exact() -> None:
    """Every sequence of length 1 and a packed order that is the sequences'
    order (enforce_sorted, or pack_padded_sequence's sort of up to 16 equal
    lengths): one row per sequence and one per packed row are the same rows."""
    one = _model(nn.LSTM, last=True).eval()
    for count, enforce_sorted in ((20, True), (12, False)):
        x, lengths = _batch([1] * count, 2, enforce_sorted)
        packed = _pack(x, lengths, enforce_sorted)
        assert packed.sorted_indices is None or torch.equal(packed.sorted_indices, torch.arange(count))
        dp = dpcore.DataParallel(copy.deepcopy(one), ["cpu"] * 3)
        with torch.no_grad():
            for e, g in zip(one(packed), dp(packed)):
                _close(g, e)


def test_sequences_of_length_one_in_another_order_are_an_error() -> None:
    """Every sequence of length 1 and a packed order that is not the
    sequences' order: packed data and one row per sequence need different
    orders, and nothing tells them apart; the error names the output and the
    fix. A PackedSequence output of the same call is exact."""
    one = _model(nn.LSTM, last=True).eval()
    x, lengths = _batch([1] * 20, 3, enforce_sorted=False)
    permutation = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    packed = _pack(x, lengths, False)
    packed = PackedSequence(x[permutation, 0], packed.batch_sizes, permutation, torch.argsort(permutation))
    dp = dpcore.DataParallel(copy.deepcopy(one), ["cpu"] * 3)
    with torch.no_grad(), pytest.raises(ValueError, match=r"gather: output\[0\]: on every replica it has one row per"):
        dp(packed)
    with pytest.raises(ValueError, match=r"Return packed data as a PackedSequence"):
        dp(packed)

    class AsPacked(nn.Module):
        def __init__(self, inner: PackedData) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, packed: PackedSequence) -> PackedSequence:
            out, _ = self.inner.rnn(packed)
            return PackedSequence(self.inner.head(out.data), out.batch_sizes, out.sorted_indices, out.unsorted_indices)

    wrapped = AsPacked(one)
    dp = dpcore.DataParallel(copy.deepcopy(wrapped), ["cpu"] * 3)
    with torch.no_grad():
        _close(dp(packed).data, wrapped(packed).data)


# ---------------------------------------------------------------------------
# criterion= with a packed target
# ---------------------------------------------------------------------------


def _rows_loss(reduction: str) -> Callable[[torch.Tensor, PackedSequence], torch.Tensor]:
    def loss(out: torch.Tensor, target: PackedSequence) -> torch.Tensor:
        return F.mse_loss(out, target.data, reduction=reduction)

    return loss


def _sequence_mean(out: torch.Tensor, target: PackedSequence) -> torch.Tensor:
    """A mean over sequences: each sequence's summed squared error, averaged."""
    per_row = (out - target.data).pow(2).sum(1)
    batch_sizes = target.batch_sizes
    times = torch.repeat_interleave(torch.arange(batch_sizes.numel()), batch_sizes)
    owner = torch.arange(times.numel()) - (torch.cumsum(batch_sizes, 0) - batch_sizes)[times]  # sorted position
    sums = torch.zeros(int(batch_sizes[0]), dtype=out.dtype).index_add(0, owner, per_row)
    return sums.mean()


@pytest.mark.parametrize("n_devices", [2, 3, 4])
@pytest.mark.parametrize(
    ("criterion", "reduction", "loss_items"),
    [
        (_rows_loss("sum"), "sum", None),
        (_rows_loss("mean"), "mean", lambda *args: args[-1].data.numel()),
        (_sequence_mean, "mean", lambda *args: args[-1].batch_sizes[0]),
    ],
    ids=["sum", "mean-over-packed-rows", "mean-over-sequences"],
)
def test_criterion_with_a_packed_target(
    n_devices: int, criterion: Callable[..., torch.Tensor], reduction: str, loss_items: Any
) -> None:
    one = _model(nn.LSTM, last=False)
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(
        dp_model, ["cpu"] * n_devices, criterion=criterion, criterion_reduction=reduction, loss_items=loss_items
    )
    x, lengths = _batch(LENGTHS[:9], 4, enforce_sorted=False)
    target = _pack(torch.randn(9, x.shape[1], 2, dtype=torch.float64), lengths, False)
    expected = criterion(one(_pack(x, lengths, False)), target)
    got = dp(_pack(x, lengths, False), target)
    _close(got, expected)
    expected.backward()
    got.backward()
    _same_grads(dp_model, one)


def test_mean_criterion_with_a_packed_target_needs_loss_items() -> None:
    dp = dpcore.DataParallel(
        _model(nn.LSTM, last=False), ["cpu"] * 2, criterion=_rows_loss("mean"), criterion_reduction="mean"
    )
    x, lengths = _batch(LENGTHS[:5], 5, enforce_sorted=False)
    target = _pack(torch.randn(5, x.shape[1], 2, dtype=torch.float64), lengths, False)
    with pytest.raises(ValueError, match=r"criterion: the target is a PackedSequence .*declare them with loss_items="):
        dp(_pack(x, lengths, False), target)
