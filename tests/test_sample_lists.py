"""Batches that are not one tensor: a ``dpcore.Samples`` list of
variable-size samples (detection and segmentation models) and a
PackedSequence (RNNs over packed input), against one device in float64.

* Samples: a small detection-style model written here (a list of images of
  different sizes in; in training a list of target dicts in and a loss dict
  out, each loss a mean over images; in eval a list of per-image dicts out,
  as many detections per image as its size gives) trains several SGD steps
  and infers exactly like one device, with uneven splits, fewer images than
  devices (replicas without images do not run), ``chunk_sizes`` and
  ``weights`` applied to image counts, ``criterion=``, and the errors for
  lists whose lengths disagree with another batched input; plain lists of
  images are errors naming ``dpcore.Samples`` (images of different sizes;
  any plain list given to a torchvision detection model), while lists of
  batch tensors keep torch's rule.
* PackedSequence: an LSTM tagger over packed input (``enforce_sorted`` True
  and False) whose output PackedSequence and last-layer ``h_n`` are joined
  back equal to one device, field by field, with gradients reaching the
  input's ``.data``; a packed target split alongside, ``criterion=``, and the
  errors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import dpcore
from dpcore.scatter_gather import GatherHints, gather_with_hints, scatter_kwargs

STEPS = 3
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _cpu(n: int) -> list[str]:
    return ["cpu"] * n


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    torch.testing.assert_close(a, b, **TOL)


def _same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            _close(p.grad, q.grad)


# ---------------------------------------------------------------------------
# A detection-style model
# ---------------------------------------------------------------------------


CALLS: list[tuple[str, int]] = []  # (device, number of images) of every forward


class TinyDetector(nn.Module):
    """torchvision's detection interface in small: ``forward(images,
    targets=None)`` with ``images`` a list of ``[3, H, W]`` tensors of any
    size. Each image is normalized (a 1-channel image is refused, as
    torchvision's normalization refuses it), and every 4 x 4 cell of its
    features is a detection: eval returns one dict per image with
    ``boxes``, ``scores``, ``labels`` (H // 4 * W // 4 of each); training
    takes one target dict per image (``boxes`` [K, 4], ``labels`` [K]) and
    returns ``{"loss_classifier", "loss_box_reg"}``, each the mean over
    images of that image's mean loss (target k is matched to cell
    k mod cells), as torchvision's losses weigh every image alike."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.5, 0.4, 0.3]).view(3, 1, 1))
        self.register_buffer("std", torch.tensor([0.2, 0.25, 0.3]).view(3, 1, 1))
        self.backbone = nn.Conv2d(3, 6, 3, padding=1)
        self.cls = nn.Linear(6, 4)
        self.box = nn.Linear(6, 4)

    def _cells(self, image: torch.Tensor) -> torch.Tensor:
        if image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"expected a [3, H, W] image, got {list(image.shape)}")
        x = (image - self.mean) / self.std
        features = torch.tanh(self.backbone(x.unsqueeze(0)))
        return F.avg_pool2d(features, 4).flatten(2)[0].t()  # [cells, 6]

    def forward(self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]] | None = None) -> Any:
        if not isinstance(images, list):
            raise TypeError(f"images: expected a list, got {type(images).__name__}")
        CALLS.append((str(self.cls.weight.device), len(images)))
        if self.training:
            if targets is None or len(targets) != len(images):
                raise ValueError("training needs one target dict per image")
            cls_losses, box_losses = [], []
            for image, target in zip(images, targets):
                cells = self._cells(image)
                k = target["labels"].numel()
                match = torch.arange(k, device=cells.device) % cells.shape[0]
                cls_losses.append(F.cross_entropy(self.cls(cells[match]), target["labels"]))
                box_losses.append(F.smooth_l1_loss(self.box(cells[match]), target["boxes"]))
            return {
                "loss_classifier": torch.stack(cls_losses).mean(),
                "loss_box_reg": torch.stack(box_losses).mean(),
            }
        detections = []
        for image in images:
            cells = self._cells(image)
            probabilities = self.cls(cells).softmax(-1)
            scores, labels = probabilities.max(-1)
            detections.append({"boxes": self.box(cells), "scores": scores, "labels": labels})
        return detections


SIZES = [(8, 12), (16, 8), (12, 12), (4, 20), (20, 16), (8, 8), (12, 4)]


def _images(count: int, seed: int = 0) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    images, targets = [], []
    for i in range(count):
        h, w = SIZES[i % len(SIZES)]
        images.append(torch.rand(3, h, w, generator=g, dtype=torch.float64))
        k = 1 + i % 3
        targets.append(
            {
                "boxes": torch.rand(k, 4, generator=g, dtype=torch.float64),
                "labels": torch.randint(0, 4, (k,), generator=g),
            }
        )
    return images, targets


def _detector() -> TinyDetector:
    torch.manual_seed(0)
    return TinyDetector().double()


def _train(
    model: nn.Module,
    step: Callable[[list[torch.Tensor], list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    count: int,
) -> list[dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for s in range(STEPS):
        images, targets = _images(count, seed=s)
        optimizer.zero_grad()
        losses = step(images, targets)
        sum(losses.values()).backward()
        history.append({k: v.detach() for k, v in losses.items()})
        if s < STEPS - 1:
            optimizer.step()
    return history


@pytest.mark.parametrize(
    ("count", "n_devices", "split"),
    [
        (5, 2, {}),  # uneven: 3, 2
        (7, 3, {}),  # uneven: 3, 2, 2
        (4, 4, {}),  # one image each
        (3, 4, {}),  # fewer images than devices: 3 replicas run
        (6, 2, {"chunk_sizes": [1, 5]}),
        (6, 3, {"weights": [1, 0, 2]}),  # device 1 gets no image and runs no replica
    ],
)
def test_detector_trains_like_one_device(count: int, n_devices: int, split: dict[str, Any]) -> None:
    one = _detector()
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(dp_model, _cpu(n_devices), model_loss="rows", **split)
    expected = _train(one, lambda images, targets: one(images, targets), count)
    CALLS.clear()
    got = _train(dp, lambda images, targets: dp(dpcore.Samples(images), dpcore.Samples(targets)), count)
    for e, g in zip(expected, got):
        assert list(g) == list(e)
        for key in e:
            _close(g[key], e[key])
    _same_grads(dp_model, one)
    for p, q in zip(dp_model.parameters(), one.parameters()):
        _close(p, q)
    # Every replica that ran got images, and together they saw each image once per step.
    assert all(n > 0 for _, n in CALLS)
    assert sum(n for _, n in CALLS) == count * STEPS
    sizes = scatter_kwargs((dpcore.Samples(list(range(count))),), None, _cpu(n_devices), **split).sizes
    assert len(CALLS) == len(sizes) * STEPS


@pytest.mark.parametrize(("count", "n_devices"), [(5, 2), (7, 3), (2, 4), (1, 3), (0, 2)])
def test_detector_infers_like_one_device(count: int, n_devices: int) -> None:
    one = _detector().eval()
    dp = dpcore.DataParallel(copy.deepcopy(one), _cpu(n_devices))
    images, _ = _images(count)
    with torch.no_grad():
        expected = one(images)
        got = dp(dpcore.Samples(images))
    assert isinstance(got, list) and len(got) == count
    for e, g in zip(expected, got):
        assert list(g) == list(e)
        for key in e:
            if e[key].is_floating_point():
                _close(g[key], e[key])
            else:
                assert torch.equal(g[key], e[key])


def test_inference_outputs_keep_per_image_sizes_and_gradients() -> None:
    """Each image's dict comes back whole (as many detections as its size
    gives), and gradients flow from the joined outputs into the images."""
    one = _detector().eval()
    dp = dpcore.DataParallel(copy.deepcopy(one), _cpu(3))
    images, _ = _images(5)
    mine = [i.clone().requires_grad_() for i in images]
    theirs = [i.clone().requires_grad_() for i in images]
    expected = one(theirs)
    got = dp(dpcore.Samples(mine))
    assert [d["boxes"].shape[0] for d in got] == [(h // 4) * (w // 4) for h, w in SIZES[:5]]
    sum(d["boxes"].sum() + d["scores"].sum() for d in expected).backward()
    sum(d["boxes"].sum() + d["scores"].sum() for d in got).backward()
    for a, b in zip(mine, theirs):
        _close(a.grad, b.grad)


def test_loss_dict_without_model_loss_is_stacked_per_replica() -> None:
    """Without model_loss=, a loss dict is gathered as losses always are:
    each entry stacked into one value per replica (torch's result)."""
    dp = dpcore.DataParallel(_detector(), _cpu(2))
    images, targets = _images(5)
    losses = dp(dpcore.Samples(images), dpcore.Samples(targets))
    assert set(losses) == {"loss_classifier", "loss_box_reg"}
    assert all(v.shape == (2,) for v in losses.values())


def test_criterion_is_weighted_by_sample_counts() -> None:
    """criterion= with a Samples target: each replica's mean over its images,
    weighted by its image count, is the one-device mean."""

    def score_loss(detections: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        per_image = [
            (d["boxes"][: t["boxes"].shape[0]] - t["boxes"]).pow(2).mean() for d, t in zip(detections, targets)
        ]
        return torch.stack(per_image).mean()

    one = _detector().eval()
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(dp_model, _cpu(3), criterion=score_loss, criterion_reduction="mean")
    images, targets = _images(7)
    expected = score_loss(one(images), targets)
    got = dp(dpcore.Samples(images), dpcore.Samples(targets))
    _close(got, expected)
    expected.backward()
    got.backward()
    _same_grads(dp_model, one)


def test_samples_with_batched_tensor_and_keyword() -> None:
    """A tensor of the sample count is split with the samples (same rows),
    Samples may be a keyword argument, and a tuple stays a tuple."""
    images = [torch.full((2,), float(i)) for i in range(5)]
    scale = torch.arange(5.0)
    scattered = scatter_kwargs((scale,), {"images": dpcore.Samples(tuple(images))}, _cpu(2))
    assert scattered.sizes == [3, 2]
    for args, kwargs in zip(scattered.args, scattered.kwargs):
        assert isinstance(kwargs["images"], tuple)
        assert [float(i[0]) for i in kwargs["images"]] == args[0].tolist()
    assert scattered.kwargs[0]["images"][0] is images[0]  # on its device already: the object itself


def test_functional_scatter_and_the_gather_of_a_samples_call() -> None:
    """dpcore.scatter splits a Samples list; the gather of a Samples call
    concatenates per-replica lists (a tuple of lists: each list)."""
    parts = dpcore.scatter(dpcore.Samples([torch.ones(i + 1) for i in range(5)]), _cpu(3))
    assert [len(p) for p in parts] == [2, 2, 1]
    outputs = [([t.sum() for t in p], torch.stack([t.sum() for t in p])) for p in parts]
    joined_list, joined_tensor = gather_with_hints(outputs, "cpu", 0, GatherHints(samples=True))
    assert [float(v) for v in joined_list] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert joined_tensor.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    # Without samples=True, lists are zipped element by element (torch's rule).
    assert len(dpcore.gather([[torch.ones(1)], [torch.ones(1)]], "cpu")) == 1


def test_samples_errors_name_both_inputs() -> None:
    images, targets = _images(5)
    dp = dpcore.DataParallel(_detector(), _cpu(2))
    with pytest.raises(ValueError, match=r"inputs\[1\] has 4 samples but inputs\[0\] has 5 samples"):
        dp(dpcore.Samples(images), dpcore.Samples(targets[:4]))
    with pytest.raises(ValueError, match=r"kwargs\['w'\] has size 3 along dim 0 but inputs\[0\] has 5 samples"):
        scatter_kwargs((dpcore.Samples(images),), {"w": torch.ones(3)}, _cpu(2))
    with pytest.raises(ValueError, match=r"kwargs\['p'\] has 2 sequences but inputs\[0\] has 5 samples"):
        packed = pack_padded_sequence(torch.ones(2, 3, 1), torch.tensor([3, 2]), batch_first=True)
        scatter_kwargs((dpcore.Samples(images),), {"p": packed}, _cpu(2))
    with pytest.raises(TypeError, match="expected a list or tuple with one entry per sample, but got Tensor"):
        dpcore.Samples(torch.ones(3))
    with pytest.raises(TypeError, match=r"inputs\[0\]\[1\] is a dpcore.Broadcast inside a dpcore.Samples list"):
        scatter_kwargs((dpcore.Samples([torch.ones(1), dpcore.Broadcast(torch.ones(1))]),), None, _cpu(2))
    with pytest.raises(TypeError, match=r"inputs\[0\] is a dpcore.Samples inside dpcore.Broadcast"):
        scatter_kwargs((dpcore.Broadcast(dpcore.Samples([torch.ones(1)])),), None, _cpu(2))
    with pytest.raises(ValueError, match="chunk_sizes: expected sizes summing to the batch size 5"):
        scatter_kwargs((dpcore.Samples(images),), None, _cpu(2), chunk_sizes=[2, 2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a device list, a GPU machine runs replicas on its GPUs")
def test_module_run_as_is_gets_the_marked_values() -> None:
    """No accelerator and no device list: the module runs as is, and gets the
    list inside Samples (and the value inside Broadcast), not the markers."""
    one = _detector().eval()
    dp = dpcore.DataParallel(copy.deepcopy(one))
    assert dp.device_ids == []
    images, _ = _images(3)
    with torch.no_grad():
        got = dp(dpcore.Samples(images))
        expected = one(images)
    assert [torch.equal(g["boxes"], e["boxes"]) for g, e in zip(got, expected)] == [True] * 3


def test_plain_list_of_images_is_an_error_naming_samples() -> None:
    """A plain list of images of different sizes is not one batch (torch's
    rule would split each image along its channels): a ValueError naming
    the list's path and dpcore.Samples, in inference and in training, and
    from dpcore.scatter too."""
    dp = dpcore.DataParallel(_detector().eval(), _cpu(3))
    images, targets = _images(4)
    with pytest.raises(ValueError, match=r"inputs\[0\] is a list of tensors of one size .*dpcore\.Samples"):
        dp(images)
    dp.train()
    with pytest.raises(ValueError, match=r"inputs\[0\] is a list of tensors .*\[3, 8, 12\] and \[3, 16, 8\]"):
        dp(images, targets)
    with pytest.raises(ValueError, match=r"kwargs\['x'\]\[1\] is a list of tensors .*dpcore\.Samples"):
        scatter_kwargs((), {"x": (0, images)}, _cpu(2))
    with pytest.raises(ValueError, match=r"inputs is a list of tensors"):
        dpcore.scatter(images, _cpu(2))


def test_plain_lists_of_images_of_one_size_with_targets_name_samples() -> None:
    """Images of one size with their target dicts in plain lists: the targets'
    box counts disagree with the images' first dimension, and the error
    names dpcore.Samples."""
    dp = dpcore.DataParallel(_detector(), _cpu(2))
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 8, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    targets = [
        {"boxes": torch.rand(k, 4, dtype=torch.float64), "labels": torch.zeros(k, dtype=torch.long)}
        for k in (1, 2, 4, 2)
    ]
    with pytest.raises(ValueError, match=r"has size .* along dim 0 .*goes in dpcore\.Samples\(list\)"):
        dp(images, targets)


def test_torchvision_detection_models_refuse_plain_lists() -> None:
    """A module holding torchvision's GeneralizedRCNNTransform (here a
    stand-in of that name and module; tests/test_detection.py runs the real
    models) takes its images and targets as dpcore.Samples: plain lists are
    an error naming it, whatever the images' sizes (one size, one image)."""
    transform = type("GeneralizedRCNNTransform", (nn.Module,), {"__module__": "torchvision.models.detection.transform"})
    model = _detector()
    model.transform = transform()
    one = copy.deepcopy(model).eval()
    dp = dpcore.DataParallel(model.eval(), _cpu(3))
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 8, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    for plain in (images, images[:1], tuple(images)):
        with pytest.raises(ValueError, match=r"inputs\[0\] is a plain .* given to TinyDetector, a torchvision"):
            dp(plain)
    with pytest.raises(
        ValueError, match=r"kwargs\['targets'\] is a plain list of targets .*dpcore\.Samples\(targets\)"
    ):
        dp(dpcore.Samples(images), targets=[{}] * 4)
    with torch.no_grad():
        got, expected = dp(dpcore.Samples(images)), one(images)
    for e, d in zip(expected, got):
        _close(d["boxes"], e["boxes"])


def test_lists_of_batch_tensors_keep_torchs_rule() -> None:
    """A list of batch tensors of one shape, a tuple of batch tensors of
    different shapes, and a list inside Broadcast are split (or passed) as
    torch.nn.DataParallel splits them."""
    a, b, c = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 5, 2)
    scattered = scatter_kwargs(([a, b], (a, c), dpcore.Broadcast([a, c])), None, _cpu(2))
    first, second = scattered.args
    assert torch.equal(first[0][1], b[:2]) and torch.equal(second[0][1], b[2:])
    assert torch.equal(first[1][1], c[:2]) and torch.equal(second[1][1], c[2:])
    assert first[2][1] is c and torch.equal(second[2][1], c)  # whole on every replica
    # 0-dim entries take no part in the shape check
    assert scatter_kwargs(([a, torch.tensor(2.0)],), None, _cpu(2)).sizes == [2, 2]


# ---------------------------------------------------------------------------
# PackedSequence
# ---------------------------------------------------------------------------


class Tagger(nn.Module):
    """An LSTM over packed input: returns the per-step tags as a
    PackedSequence of the input's layout, and the last layer's final hidden
    state ``h_n[-1]`` ([batch, hidden], batch first)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, num_layers=2)
        self.head = nn.Linear(5, 2)

    def forward(self, packed: PackedSequence) -> tuple[PackedSequence, torch.Tensor]:
        out, (h_n, _) = self.lstm(packed)
        tags = PackedSequence(self.head(out.data), out.batch_sizes, out.sorted_indices, out.unsorted_indices)
        return tags, h_n[-1]


LENGTHS = [3, 7, 1, 7, 5, 2, 6, 4]


def _sequences(count: int, seed: int, enforce_sorted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS[:count])
    if enforce_sorted:
        lengths = lengths.sort(descending=True).values
    return torch.randn(count, int(lengths.max()), 3, generator=g, dtype=torch.float64), lengths


def _pack(x: torch.Tensor, lengths: torch.Tensor, enforce_sorted: bool) -> PackedSequence:
    return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)


def _same_packed(got: PackedSequence, expected: PackedSequence) -> None:
    _close(got.data, expected.data)
    assert torch.equal(got.batch_sizes, expected.batch_sizes) and got.batch_sizes.device.type == "cpu"
    for a, b in ((got.sorted_indices, expected.sorted_indices), (got.unsorted_indices, expected.unsorted_indices)):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def _tagger() -> Tagger:
    torch.manual_seed(0)
    return Tagger().double()


@pytest.mark.parametrize("enforce_sorted", [False, True])
@pytest.mark.parametrize(
    ("count", "n_devices", "split"),
    [(5, 2, {}), (8, 3, {}), (2, 4, {}), (6, 2, {"chunk_sizes": [5, 1]}), (7, 3, {"weights": [2, 0, 1]})],
)
def test_lstm_over_packed_trains_like_one_device(
    count: int, n_devices: int, split: dict[str, Any], enforce_sorted: bool
) -> None:
    one = _tagger()
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(dp_model, _cpu(n_devices), **split)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (one, dp_model)]
    for step in range(STEPS):
        x, lengths = _sequences(count, step, enforce_sorted)
        target = torch.randn(
            count, x.shape[1], 2, generator=torch.Generator().manual_seed(step + 9), dtype=torch.float64
        )
        results = []
        for model, optimizer in zip((one, dp), optimizers):
            xs = x.clone().requires_grad_()
            optimizer.zero_grad()
            tags, last = model(_pack(xs, lengths, enforce_sorted))
            packed_target = _pack(target, lengths, enforce_sorted)
            loss = F.mse_loss(tags.data, packed_target.data) + last.pow(2).mean()
            loss.backward()
            results.append((tags, last, loss, xs.grad))
            optimizer.step()
        (e_tags, e_last, e_loss, e_grad), (g_tags, g_last, g_loss, g_grad) = results
        _same_packed(g_tags, e_tags)
        _close(g_last, e_last)
        _close(g_loss, e_loss)
        _close(g_grad, e_grad)  # through the PackedSequence's data into the padded input
    for p, q in zip(dp_model.parameters(), one.parameters()):
        _close(p, q)


@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_lstm_over_packed_infers_like_one_device(enforce_sorted: bool) -> None:
    one = _tagger().eval()
    dp = dpcore.DataParallel(copy.deepcopy(one), _cpu(3))
    x, lengths = _sequences(8, 0, enforce_sorted)
    packed = _pack(x, lengths, enforce_sorted)
    with torch.no_grad():
        e_tags, e_last = one(packed)
        g_tags, g_last = dp(packed)
    _same_packed(g_tags, e_tags)
    _close(g_last, e_last)
    padded, got_lengths = pad_packed_sequence(g_tags, batch_first=True)
    assert torch.equal(got_lengths, lengths)


def test_each_replica_gets_a_valid_packed_sequence_of_its_sequences() -> None:
    """Replica j gets its consecutive sequences of the original order, packed
    as pack_padded_sequence packs them (unpacking gives the same padded
    rows and lengths)."""
    x, lengths = _sequences(8, 1, enforce_sorted=False)
    packed = _pack(x, lengths, enforce_sorted=False)
    scattered = scatter_kwargs((packed,), None, _cpu(3))
    assert scattered.sizes == [3, 3, 2]
    start = 0
    for args, size in zip(scattered.args, scattered.sizes):
        part = args[0]
        assert isinstance(part, PackedSequence) and part.batch_sizes.device.type == "cpu"
        padded, part_lengths = pad_packed_sequence(part, batch_first=True)
        assert torch.equal(part_lengths, lengths[start : start + size])
        expected, _ = pad_packed_sequence(_pack(x[start : start + size], part_lengths, False), batch_first=True)
        assert torch.equal(padded, expected)
        start += size


def test_packed_target_and_criterion() -> None:
    """A packed target is split by the same sequences as the input, and a
    summed criterion over the packed rows is the one-device loss."""

    def loss_fn(output: tuple[PackedSequence, torch.Tensor], target: PackedSequence) -> torch.Tensor:
        return (output[0].data - target.data).pow(2).sum()

    one = _tagger()
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(dp_model, _cpu(3), criterion=loss_fn, criterion_reduction="sum")
    x, lengths = _sequences(7, 2, enforce_sorted=False)
    target = _pack(torch.randn(7, x.shape[1], 2, dtype=torch.float64), lengths, False)
    expected = loss_fn(one(_pack(x, lengths, False)), target)
    got = dp(_pack(x, lengths, False), target)
    _close(got, expected)
    expected.backward()
    got.backward()
    _same_grads(dp_model, one)


def test_packed_sequence_errors_name_both_inputs() -> None:
    x, lengths = _sequences(5, 0, enforce_sorted=False)
    packed = _pack(x, lengths, False)
    with pytest.raises(ValueError, match=r"inputs\[1\] has size 4 along dim 0 but inputs\[0\] has 5 sequences"):
        scatter_kwargs((packed, torch.ones(4, 2)), None, _cpu(2))
    other = _pack(x[:3], lengths[:3], False)
    with pytest.raises(ValueError, match=r"kwargs\['h'\] has 3 sequences but inputs\[0\] has 5 sequences"):
        scatter_kwargs((packed,), {"h": other}, _cpu(2))


def test_gather_joins_packed_outputs_without_an_input_layout() -> None:
    """dpcore.gather alone joins PackedSequences in the stable longest-first
    order: unpacked, the sequences of every replica in replica order."""
    x, lengths = _sequences(6, 3, enforce_sorted=False)
    parts = [_pack(x[:4], lengths[:4], False), _pack(x[4:], lengths[4:], False)]
    joined = dpcore.gather(parts, "cpu")
    padded, got_lengths = pad_packed_sequence(joined, batch_first=True)
    expected, _ = pad_packed_sequence(_pack(x, lengths, False), batch_first=True)
    assert torch.equal(got_lengths, lengths) and torch.equal(padded, expected)
