"""Losses: ``criterion=`` whose reduction is declared, never guessed, and
``model_loss=`` for models that compute their loss in forward.

Every case is compared, in float64 over several SGD steps, with the same
model on one device: the loss, and the parameters after each step.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore

TOL = {"rtol": 1e-9, "atol": 1e-11}
STEPS = 4
LR = 0.3


def _step(*modules: nn.Module) -> None:
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                if p.grad is not None:
                    p.sub_(LR * p.grad)
                    p.grad = None


def _assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------
# criterion= and criterion_reduction=
# ---------------------------------------------------------------------------


def _ce_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="sum")


def _ce_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


class _NoReduction(nn.Module):
    """A loss module without a ``reduction`` attribute (summing squared errors)."""

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - F.one_hot(target, output.shape[-1]).to(output.dtype)).square().sum()


CRITERIA: dict[str, tuple[Callable[..., torch.Tensor], str | None]] = {
    "function-sum": (_ce_sum, "sum"),
    "function-mean": (_ce_mean, "mean"),
    "partial-sum": (functools.partial(F.cross_entropy, reduction="sum"), "sum"),
    "partial-mean": (functools.partial(F.nll_loss, reduction="mean"), "mean"),
    "lambda-sum": (lambda o, t: F.cross_entropy(o, t, reduction="sum"), "sum"),
    "lambda-mean": (lambda o, t: F.mse_loss(o, F.one_hot(t, o.shape[-1]).to(o.dtype)), "mean"),
    "module-without-reduction-sum": (_NoReduction(), "sum"),
    "module-sum": (nn.CrossEntropyLoss(reduction="sum"), None),  # read from .reduction
    "module-mean": (nn.CrossEntropyLoss(), None),
    "module-sum-declared-too": (nn.CrossEntropyLoss(reduction="sum"), "sum"),
}


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4), nn.LogSoftmax(dim=-1)).double()


@pytest.mark.parametrize("n_devices", [2, 3, 4])
@pytest.mark.parametrize("name", list(CRITERIA))
def test_criterion_equals_one_device(name: str, n_devices: int) -> None:
    criterion, reduction = CRITERIA[name]
    torch.manual_seed(n_devices)
    module = _classifier()
    reference = copy.deepcopy(module)
    dp = dpcore.DataParallel(module, ["cpu"] * n_devices, criterion=criterion, criterion_reduction=reduction)
    for step in range(STEPS):
        batch = 7 + 3 * step  # 7, 10, 13, 16: uneven chunks on 2, 3 and 4 replicas
        x = torch.randn(batch, 5, dtype=torch.float64)
        y = torch.randint(0, 4, (batch,))
        loss = dp(x, y)
        expected = criterion(reference(x), y)
        assert loss.dim() == 0
        torch.testing.assert_close(loss, expected, **TOL)
        loss.backward()
        expected.backward()
        _step(module, reference)
        _assert_same_parameters(module, reference)


@pytest.mark.parametrize(
    "criterion",
    [_ce_sum, functools.partial(F.cross_entropy, reduction="sum"), lambda o, t: F.cross_entropy(o, t), _NoReduction()],
    ids=["function", "partial", "lambda", "module-without-reduction"],
)
def test_undeclared_criterion_is_refused_at_construction(criterion: Callable[..., Any]) -> None:
    with pytest.raises(
        TypeError,
        match=r"criterion: dpcore cannot tell whether .* criterion_reduction='mean'.*criterion_reduction='sum'",
    ):
        dpcore.DataParallel(_classifier(), ["cpu"] * 2, criterion=criterion)


def test_undeclared_criterion_is_refused_without_devices_too() -> None:
    """No device list and no GPU: the module runs as is, and the criterion is still checked."""
    with pytest.raises(TypeError, match="criterion_reduction"):
        dpcore.DataParallel(_classifier(), criterion=_ce_sum)


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [
        (
            {"criterion": _ce_sum, "criterion_reduction": "avg"},
            ValueError,
            r"criterion_reduction: expected 'mean' or 'sum', but got 'avg'",
        ),
        (
            {"criterion": _ce_sum, "criterion_reduction": "none"},
            ValueError,
            r"criterion_reduction: expected 'mean' or 'sum', but got 'none'",
        ),
        (
            {"criterion": _ce_sum, "criterion_reduction": True},
            TypeError,
            r"criterion_reduction: expected 'mean' or 'sum', but got bool",
        ),
        ({"criterion_reduction": "sum"}, ValueError, r"criterion_reduction: given without a criterion"),
        (
            {"criterion": nn.MSELoss(), "criterion_reduction": "sum"},
            ValueError,
            r"criterion_reduction='sum' disagrees with the criterion's own reduction='mean'",
        ),
        ({"criterion": 3}, TypeError, r"criterion: expected a callable"),
    ],
)
def test_criterion_reduction_is_validated(options: dict[str, Any], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        dpcore.DataParallel(_classifier(), ["cpu"] * 2, **options)


def test_unknown_own_reduction_needs_a_declaration() -> None:
    criterion = nn.MSELoss()
    criterion.reduction = "elementwise_mean"
    with pytest.raises(ValueError, match=r"its reduction 'elementwise_mean' is not one dpcore knows"):
        dpcore.DataParallel(_classifier(), ["cpu"] * 2, criterion=criterion)


def test_reduction_none_keeps_its_error() -> None:
    dp = dpcore.DataParallel(_classifier(), ["cpu"] * 2, criterion=nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(ValueError, match=r"criterion: expected a scalar \(0-dim\) loss .* shape \[2\]"):
        dp(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long))


def test_kl_div_batchmean_is_a_mean_over_rows() -> None:
    torch.manual_seed(0)
    module = _classifier()
    criterion = nn.KLDivLoss(reduction="batchmean", log_target=True)
    dp = dpcore.DataParallel(module, ["cpu"] * 3, criterion=criterion)
    x = torch.randn(7, 5, dtype=torch.float64)
    target = torch.log_softmax(torch.randn(7, 4, dtype=torch.float64), -1)
    torch.testing.assert_close(dp(x, target), criterion(module(x), target), **TOL)


@pytest.mark.parametrize(("reduction", "summed"), [("sum", True), ("mean", False)])
def test_hybrid_mode_reads_the_declared_reduction(reduction: str, summed: bool) -> None:
    """What the process-group mode is told (whether the loss is summed) is the declared value."""
    dp = dpcore.DataParallel(_classifier(), ["cpu"] * 2, criterion=lambda o, t: o.sum(), criterion_reduction=reduction)
    assert dp._loss.summed is summed
    assert (
        dpcore.DataParallel(_classifier(), ["cpu"] * 2, criterion=nn.NLLLoss(reduction=reduction))._loss.summed
        is summed
    )


# ---------------------------------------------------------------------------
# model_loss=: a tiny causal LM that computes its own loss
# ---------------------------------------------------------------------------

VOCAB = 11


@dataclasses.dataclass
class LMOutput:
    """A ModelOutput-like result: the loss (None without labels) and the logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class LMTuple(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyCausalLM(nn.Module):
    """Embedding + linear; with ``labels``, the shifted cross-entropy over the
    tokens whose label is not -100: their mean, or (given
    ``num_items_in_batch``) their sum divided by it (transformers' contract)."""

    def __init__(self, returns: str = "dataclass") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, VOCAB)
        self.returns = returns

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> Any:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1].reshape(-1, VOCAB)
            shift_labels = labels[:, 1:].reshape(-1)
            if num_items_in_batch is None:
                loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
            else:
                loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
                loss = loss / num_items_in_batch
        if self.returns == "dataclass":
            return LMOutput(loss, logits)
        if self.returns == "dict":
            return OrderedDict([("loss", loss), ("logits", logits)]) if loss is not None else {"logits": logits}
        if self.returns == "namedtuple":
            return LMTuple(loss, logits)
        if self.returns == "tuple":
            return (loss, logits) if loss is not None else (logits,)
        assert self.returns == "loss"
        return loss


def _padded_batch(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of random lengths (at least 1 token), right-padded; labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    ids = ids.masked_fill(~mask, 0)
    labels = ids.masked_fill(~mask, -100)
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": labels}


def count_labels(*args: Any, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The loss items of one replica: shifted labels other than -100."""
    return (labels[:, 1:] != -100).sum()


def _loss_and_logits(output: Any, returns: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if returns == "loss":
        return output, None
    if returns in ("dict",):
        return output["loss"], output["logits"]
    if returns == "tuple":
        return output[0], output[1]
    return output.loss, output.logits


def _run_lm(
    n_devices: int, returns: str, options: dict[str, Any], with_num_items: str | None, batches: list[int]
) -> None:
    torch.manual_seed(1)
    module = TinyCausalLM(returns).double()
    reference = copy.deepcopy(module)
    dp = dpcore.DataParallel(module, ["cpu"] * n_devices, **options)
    for step, batch in enumerate(batches):
        inputs = _padded_batch(batch, 6, seed=10 * n_devices + step)
        ref_out = reference(**inputs)
        ref_loss, ref_logits = _loss_and_logits(ref_out, returns)
        extra: dict[str, Any] = {}
        if with_num_items is not None:
            count = (inputs["labels"][:, 1:] != -100).sum().double()
            replicas = min(batch, n_devices)
            extra["num_items_in_batch"] = count if with_num_items == "zero_dim" else count.expand(replicas, 1)
        out = dp(**inputs, **extra)
        assert type(out) is type(ref_out)
        loss, logits = _loss_and_logits(out, returns)
        assert loss.dim() == 0
        torch.testing.assert_close(loss, ref_loss, **TOL)
        if logits is not None:
            torch.testing.assert_close(logits, ref_logits, **TOL)
        loss.backward()
        ref_loss.backward()
        _step(module, reference)
        _assert_same_parameters(module, reference)


BATCHES = [7, 8, 5, 7]  # uneven on 2 and 3 replicas


@pytest.mark.parametrize("n_devices", [2, 3])
@pytest.mark.parametrize("returns", ["dataclass", "dict", "namedtuple", "tuple", "loss"])
def test_model_loss_items_equals_one_device(n_devices: int, returns: str) -> None:
    _run_lm(n_devices, returns, {"model_loss": "items", "loss_items": count_labels}, None, BATCHES)


@pytest.mark.parametrize("n_devices", [2, 3])
@pytest.mark.parametrize("form", ["zero_dim", "per_replica"])
def test_model_loss_num_items_in_batch_equals_one_device(n_devices: int, form: str) -> None:
    """transformers' contract: the model divides by the count of the whole
    batch (0-dim on CPU lists, [n_gpu, 1] from Trainer on GPUs)."""
    _run_lm(n_devices, "dataclass", {"model_loss": "num_items_in_batch"}, form, BATCHES)


def test_model_loss_num_items_in_batch_falls_back_to_declared_items() -> None:
    """Calls without num_items_in_batch (Trainer's evaluation) are weighted by loss_items."""
    _run_lm(3, "dict", {"model_loss": "num_items_in_batch", "loss_items": count_labels}, None, BATCHES)


def test_model_loss_num_items_in_batch_without_it_is_an_error() -> None:
    dp = dpcore.DataParallel(TinyCausalLM().double(), ["cpu"] * 2, model_loss="num_items_in_batch")
    with pytest.raises(
        ValueError, match=r"model_loss='num_items_in_batch': this call passed no num_items_in_batch .* loss_items="
    ):
        dp(**_padded_batch(7, 6, 0))


def test_plain_mean_of_replica_losses_is_not_the_batch_loss() -> None:
    """Why the weights matter: with padding, rows (or the plain mean, torch
    DP's vector averaged) differ from the loss of the batch."""
    torch.manual_seed(1)
    module = TinyCausalLM().double()
    inputs = _padded_batch(7, 6, 3)
    exact = module(**inputs).loss
    by_rows = dpcore.DataParallel(module, ["cpu"] * 3, model_loss="rows")(**inputs).loss
    assert abs(by_rows.item() - exact.item()) > 1e-4


class _RowMean(nn.Module):
    """Returns (loss, prediction), loss a mean over rows (or their sum)."""

    def __init__(self, summed: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.summed = summed

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.linear(x)
        loss = F.mse_loss(pred, y, reduction="sum" if self.summed else "mean")
        return loss, pred


@pytest.mark.parametrize("n_devices", [2, 3])
@pytest.mark.parametrize(("mode", "summed"), [("rows", False), ("sum", True)])
def test_model_loss_rows_and_sum_equal_one_device(n_devices: int, mode: str, summed: bool) -> None:
    torch.manual_seed(2)
    module = _RowMean(summed).double()
    reference = copy.deepcopy(module)
    dp = dpcore.DataParallel(module, ["cpu"] * n_devices, model_loss=mode)
    for batch in BATCHES:
        x = torch.randn(batch, 4, dtype=torch.float64)
        y = torch.randn(batch, 3, dtype=torch.float64)
        (loss, pred), (ref_loss, ref_pred) = dp(x, y), reference(x, y)
        assert loss.dim() == 0
        torch.testing.assert_close(loss, ref_loss, **TOL)
        torch.testing.assert_close(pred, ref_pred, **TOL)
        loss.backward()
        ref_loss.backward()
        _step(module, reference)
        _assert_same_parameters(module, reference)


def test_model_loss_replica_without_items_adds_nothing() -> None:
    """Replica 2's rows are all padding (its own loss is 0/0): the batch loss and gradients stay exact and finite."""
    torch.manual_seed(3)
    module = TinyCausalLM().double()
    reference = copy.deepcopy(module)
    inputs = _padded_batch(7, 6, 4)
    inputs["labels"][5:] = -100  # rows 5 and 6: replica 2 of (3, 2, 2)
    dp = dpcore.DataParallel(module, ["cpu"] * 3, model_loss="items", loss_items=count_labels)
    out, ref = dp(**inputs), reference(**inputs)
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    out.loss.backward()
    ref.loss.backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_model_loss_no_item_at_all_is_nan_as_on_one_device() -> None:
    module = TinyCausalLM().double()
    inputs = _padded_batch(4, 6, 5)
    inputs["labels"][:] = -100
    assert torch.isnan(module(**inputs).loss)
    dp = dpcore.DataParallel(module, ["cpu"] * 2, model_loss="items", loss_items=count_labels)
    assert torch.isnan(dp(**inputs).loss)


def test_model_loss_without_labels_gathers_as_usual() -> None:
    module = TinyCausalLM().double()
    ids = _padded_batch(5, 6, 6)["input_ids"]
    out = dpcore.DataParallel(module, ["cpu"] * 2, model_loss="items", loss_items=count_labels)(ids)
    assert out.loss is None
    torch.testing.assert_close(out.logits, module(ids).logits, **TOL)


def test_model_loss_one_replica_is_the_models_loss() -> None:
    module = TinyCausalLM().double()
    inputs = _padded_batch(1, 6, 7)
    out = dpcore.DataParallel(module, ["cpu"] * 3, model_loss="items", loss_items=count_labels)(**inputs)
    torch.testing.assert_close(out.loss, module(**inputs).loss, rtol=0, atol=0)


def test_model_loss_with_transformers_model_output() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs", reason="transformers is not installed")

    class HFStyle(TinyCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            return modeling_outputs.CausalLMOutput(loss=out.loss, logits=out.logits)

    torch.manual_seed(4)
    module = HFStyle().double()
    inputs = _padded_batch(7, 6, 8)
    out = dpcore.DataParallel(module, ["cpu"] * 3, model_loss="items", loss_items=count_labels)(**inputs)
    ref = module(**inputs)
    assert type(out) is type(ref) and out.loss.dim() == 0
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    torch.testing.assert_close(out["loss"], ref.loss, **TOL)  # attribute and key agree
    torch.testing.assert_close(out.logits, ref.logits, **TOL)


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [
        (
            {"model_loss": "mean"},
            ValueError,
            r"model_loss: expected one of \['rows', 'items', 'sum', 'num_items_in_batch'\], but got 'mean'",
        ),
        ({"model_loss": 1}, TypeError, r"model_loss: expected one of .* but got int 1"),
        ({"model_loss": "items"}, ValueError, r"model_loss='items' needs loss_items="),
        ({"loss_items": count_labels}, ValueError, r"loss_items: given without criterion= or model_loss="),
        (
            {"model_loss": "rows", "loss_items": count_labels},
            ValueError,
            r"loss_items: model_loss='rows' does not use it",
        ),
        ({"model_loss": "items", "loss_items": 3}, TypeError, r"loss_items: expected a callable"),
        (
            {"model_loss": "rows", "criterion": nn.MSELoss()},
            ValueError,
            r"model_loss: cannot be combined with criterion=",
        ),
        ({"model_loss": "rows", "gather": False}, ValueError, r"model_loss: needs gather=True"),
        (
            {"model_loss": "items", "loss_items": count_labels, "process_group": object()},
            ValueError,
            r"model_loss='items' is not supported with process_group=",
        ),
    ],
)
def test_model_loss_options_are_validated(options: dict[str, Any], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        dpcore.DataParallel(TinyCausalLM().double(), ["cpu"] * 2, **options)


def test_model_loss_errors_at_call() -> None:
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    # a loss that is not one number
    vector = dpcore.DataParallel(nn.Linear(4, 3).double(), ["cpu"] * 2, model_loss="rows")
    with pytest.raises(
        ValueError, match=r"expected a scalar loss .* replica 0 \(on cpu\) has a tensor of shape \[3, 3\]"
    ):
        vector(x)
    # an output with no loss in it
    with pytest.raises(TypeError, match=r"model_loss: .* replica 0 \(on cpu\) returned str"):
        dpcore.DataParallel(_Returns(lambda p: "text").double(), ["cpu"] * 2, model_loss="rows")(x)
    # a bad count
    bad = dpcore.DataParallel(_RowMean(False).double(), ["cpu"] * 2, model_loss="items", loss_items=lambda x, y: -1)
    with pytest.raises(ValueError, match=r"loss_items: the count of replica 0: expected a non-negative finite number"):
        bad(x, y)
    with pytest.raises(TypeError, match=r"loss_items: the count of replica 0: expected a real number, but got str"):
        dpcore.DataParallel(_RowMean(False).double(), ["cpu"] * 2, model_loss="items", loss_items=lambda x, y: "3")(
            x, y
        )


class _Returns(nn.Module):
    def __init__(self, make: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.make = make

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(self.linear(x))


# ---------------------------------------------------------------------------
# Hugging Face Trainer's two branches
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_devices", [2, 3])
def test_trainer_gpu_branch_by_hand_needs_no_model_loss(n_devices: int) -> None:
    """What Trainer does with more than one GPU, step by step: it passes
    num_items_in_batch expanded to [n_gpu, 1], multiplies the gathered loss
    by n_gpu and averages it. The scatter rule gives each replica its row, so
    that equals one device without model_loss (model_loss would return a
    scalar, which Trainer's factor n_gpu would then scale wrongly)."""
    torch.manual_seed(5)
    module = TinyCausalLM().double()
    reference = copy.deepcopy(module)
    dp = dpcore.DataParallel(module, ["cpu"] * n_devices)
    for step, batch in enumerate(BATCHES):
        inputs = _padded_batch(batch, 6, seed=step)
        count = (inputs["labels"][:, 1:] != -100).sum().double()
        out = dp(**inputs, num_items_in_batch=count.unsqueeze(0).expand(n_devices, -1))
        assert out.loss.shape == (n_devices, 1)
        loss = (out.loss * n_devices).mean()
        ref_loss = reference(**inputs, num_items_in_batch=count).loss
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        ref_loss.backward()
        _step(module, reference)
        _assert_same_parameters(module, reference)


@pytest.mark.parametrize(("accumulation", "optim"), [(1, "sgd"), (2, "sgd"), (1, "default"), (2, "default")])
def test_trainer_on_cpu_list_equals_bare_model(accumulation: int, optim: str, tmp_path: Any) -> None:
    """docs/libraries.md's recipe: Trainer on a CPU list (it sees no GPU and passes a
    0-dim num_items_in_batch) with model_loss="num_items_in_batch" trains a
    GPT-2 on a padded batch with -100 labels exactly as the bare model; also
    with Trainer's default optimizer (fused AdamW, whose kernels bump no
    version counter: stale replicas were 1e-2 off after a few steps)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=40, n_positions=12, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    base = transformers.GPT2LMHeadModel(config).double()
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(21):
        ids = torch.randint(1, 40, (12,), generator=g)
        mask = (torch.arange(12) < int(torch.randint(2, 12, (1,), generator=g))).long()
        ids = ids * mask
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})

    def train(model: nn.Module) -> None:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=7,
            max_steps=3,
            **({"optim": "sgd", "learning_rate": 0.5} if optim == "sgd" else {"learning_rate": 1e-2}),
            lr_scheduler_type="constant",
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            seed=0,
            remove_unused_columns=False,
            gradient_accumulation_steps=accumulation,
            logging_strategy="no",
            disable_tqdm=True,
        )
        transformers.Trainer(model=model, args=args, train_dataset=rows).train()

    reference, mine = copy.deepcopy(base), copy.deepcopy(base)
    train(reference)
    train(dpcore.DataParallel(mine, ["cpu"] * 3, model_loss="num_items_in_batch"))
    assert max((p - q).abs().max().item() for p, q in zip(reference.parameters(), base.parameters())) > 1e-3
    if optim == "sgd":
        _assert_same_parameters(mine, reference)
    else:  # Adam divides by sqrt(v): summation-order noise in near-zero gradients grows, to ~1e-9 here
        for p, q in zip(mine.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def test_accelerate_recipe_equals_bare_model() -> None:
    """docs/libraries.md's accelerate recipe (one process, a CPU list): exact against the bare model."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    torch.manual_seed(0)
    base = TinyCausalLM().double()
    batches = [_padded_batch(7, 6, seed) for seed in range(3)]
    samples = [{k: v[i] for k, v in b.items()} for b in batches for i in range(7)]

    def train(model: nn.Module) -> None:
        accelerator = accelerate.Accelerator(cpu=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(samples, batch_size=7)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()

    reference, mine = copy.deepcopy(base), copy.deepcopy(base)
    train(reference)
    train(dpcore.DataParallel(mine, ["cpu"] * 3, model_loss="items", loss_items=count_labels))
    _assert_same_parameters(mine, reference)


# ---------------------------------------------------------------------------
# Mean criteria over counted items: CrossEntropyLoss's ignore_index and class weights, loss_items
# ---------------------------------------------------------------------------


def _targets(batch: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    y = torch.randint(0, 4, (batch,), generator=g)
    y[torch.rand(batch, generator=g) < 0.4] = -100
    y[:3] = -100  # replica 0 has no item on 3 replicas (its own mean is 0/0)
    return y


CE_CRITERIA: dict[str, tuple[Callable[..., torch.Tensor], dict[str, Any]]] = {
    "ignore_index": (nn.CrossEntropyLoss(), {}),
    "class-weights": (nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0, 0.7], dtype=torch.float64)), {}),
    "label-smoothing": (nn.CrossEntropyLoss(label_smoothing=0.1), {}),
    "nll-weights-ignore-1": (
        nn.NLLLoss(weight=torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64), ignore_index=1),
        {},
    ),
    "function-with-loss-items": (
        lambda o, t: F.cross_entropy(o, t, ignore_index=-100),
        {"criterion_reduction": "mean", "loss_items": lambda *args: (args[-1] != -100).sum()},
    ),
}


@pytest.mark.parametrize("n_devices", [2, 3])
@pytest.mark.parametrize("name", list(CE_CRITERIA))
def test_mean_over_counted_items_equals_one_device(name: str, n_devices: int) -> None:
    """A mean criterion over the targets it counts (not over rows): the
    replicas are weighted by their counts, so the loss is the batch's, and
    finite where a replica has no item."""
    criterion, options = CE_CRITERIA[name]
    torch.manual_seed(6)
    module = _classifier()
    reference = copy.deepcopy(module)
    dp = dpcore.DataParallel(module, ["cpu"] * n_devices, criterion=criterion, **options)
    for step in range(STEPS):
        batch = 7 + 3 * step
        x = torch.randn(batch, 5, dtype=torch.float64)
        y = _targets(batch, step)
        if name.startswith("nll"):
            y = y.masked_fill(y == -100, 1)  # its ignore_index
        loss, expected = dp(x, y), criterion(reference(x), y)
        assert torch.isfinite(expected)
        torch.testing.assert_close(loss, expected, **TOL)
        loss.backward()
        expected.backward()
        _step(module, reference)
        _assert_same_parameters(module, reference)


def test_cross_entropy_k_dim_targets_with_padding() -> None:
    """Token classification: logits [N, C, L], targets [N, L] with -100 padding."""
    torch.manual_seed(7)

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 6)
            self.head = nn.Linear(6, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids)).transpose(1, 2)

    module = Tagger().double()
    reference = copy.deepcopy(module)
    dp = dpcore.DataParallel(module, ["cpu"] * 3, criterion=nn.CrossEntropyLoss())
    for step in range(STEPS):
        batch = _padded_batch(7, 6, step)
        y = batch["labels"].clamp(max=3).masked_fill(batch["labels"] == -100, -100)
        loss, expected = dp(batch["input_ids"], y), nn.CrossEntropyLoss()(reference(batch["input_ids"]), y)
        torch.testing.assert_close(loss, expected, **TOL)
        loss.backward()
        expected.backward()
        _step(module, reference)
        _assert_same_parameters(module, reference)


def test_all_targets_ignored_is_nan_as_on_one_device() -> None:
    module = _classifier()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.full((6,), -100)
    assert torch.isnan(nn.CrossEntropyLoss()(module(x), y))
    assert torch.isnan(dpcore.DataParallel(module, ["cpu"] * 3, criterion=nn.CrossEntropyLoss())(x, y))


def test_probability_targets_are_a_mean_over_rows() -> None:
    torch.manual_seed(8)
    module = _classifier()
    x = torch.randn(7, 5, dtype=torch.float64)
    y = torch.softmax(torch.randn(7, 4, dtype=torch.float64), -1)
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0, 0.7], dtype=torch.float64))
    torch.testing.assert_close(
        dpcore.DataParallel(module, ["cpu"] * 3, criterion=criterion)(x, y), criterion(module(x), y), **TOL
    )


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        (
            {"criterion": nn.CrossEntropyLoss(reduction="sum"), "loss_items": lambda *a: 1},
            r"loss_items: with criterion=, only for a mean criterion",
        ),
        (
            {"criterion": nn.CrossEntropyLoss(), "loss_items": lambda *a: 1, "process_group": object()},
            r"loss_items: not supported with process_group=",
        ),
    ],
)
def test_criterion_loss_items_is_validated(options: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        dpcore.DataParallel(_classifier(), ["cpu"] * 2, **options)
