"""torchvision's own detection models (Faster R-CNN, RetinaNet, Mask R-CNN,
random weights, a ResNet-18 FPN backbone, 32-pixel images so they run in
seconds on a CPU) called as torch users call them, in float64.

* A plain list of images (of different sizes or of one size, in inference
  and in training with a plain list of target dicts) is a ValueError that
  names ``dpcore.Samples``, on 2 and 3 devices: never a result from images
  split along their channels.
* ``dpcore.Samples(images)``: inference equals one device, per image (boxes,
  scores, labels, masks), with uneven splits; images of different sizes
  included (the transform pads every batch to the same 32 x 32 here, so the
  replicas see what one device sees). Training returns one loss dict (with
  ``model_loss="rows"``): RetinaNet's losses (means over images) and
  gradients equal one device's; the R-CNNs, whose samplers draw at random
  and whose losses are means over sampled anchors and proposals, give a
  finite loss of every kind that reaches the backbone.

torchvision must match torch; where it is missing or does not load the
whole file is skipped with that reason. CI's CUDA-build job
(scripts/test_cuda_build.sh) runs it; the CPU counterparts of these rules,
with a detection-style model written in the test, are in
tests/test_sample_lists.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dpcore

try:
    from torchvision.models import detection
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
except (ImportError, RuntimeError) as e:  # RuntimeError: a torchvision built for another torch
    pytest.skip(
        f"torchvision is not usable here ({type(e).__name__}: {e}); pip install a torchvision that matches torch",
        allow_module_level=True,
    )

TOL = {"rtol": 1e-10, "atol": 1e-10}
SMALL = {"min_size": 32, "max_size": 32}
# Every anchor and proposal sampled, none suppressed: the R-CNNs' proposals do not depend on the other images.
ALL_SAMPLED = {"rpn_batch_size_per_image": 10**6, "box_batch_size_per_image": 10**6, "rpn_nms_thresh": 1.0}


def _backbone() -> nn.Module:
    return resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)


def _faster_rcnn() -> nn.Module:
    return detection.FasterRCNN(_backbone(), num_classes=3, box_detections_per_img=20, **SMALL, **ALL_SAMPLED)


def _retinanet() -> nn.Module:
    return detection.RetinaNet(_backbone(), num_classes=3, score_thresh=0.001, detections_per_img=20, **SMALL)


def _mask_rcnn() -> nn.Module:
    return detection.MaskRCNN(_backbone(), num_classes=3, box_detections_per_img=20, **SMALL, **ALL_SAMPLED)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "faster_rcnn": _faster_rcnn,
    "retinanet": _retinanet,
    "mask_rcnn": _mask_rcnn,
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().double()


def _batch(sizes: list[tuple[int, int]], seed: int = 0) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    images, targets = [], []
    for i, (h, w) in enumerate(sizes):
        images.append(torch.rand(3, h, w, generator=g, dtype=torch.float64))
        boxes = torch.tensor([[2.0, 3.0, 14.0, 15.0], [5.0, 1.0, 20.0, 9.0]], dtype=torch.float64) + i
        masks = (torch.rand(2, h, w, generator=g) > 0.5).to(torch.uint8)
        targets.append({"boxes": boxes, "labels": torch.tensor([1, 2]), "masks": masks})
    return images, targets


ONE_SIZE = [(32, 32)] * 4
SIZES = [(32, 48), (40, 32), (32, 32), (48, 40), (36, 44)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("sizes", [ONE_SIZE, SIZES, SIZES[:1]], ids=["one-size", "sizes", "one-image"])
@pytest.mark.parametrize("n_devices", [2, 3])
def test_plain_lists_are_an_error_naming_samples(name: str, sizes: list[tuple[int, int]], n_devices: int) -> None:
    dp = dpcore.DataParallel(_model(name), ["cpu"] * n_devices)
    images, targets = _batch(sizes)
    dp.eval()
    with pytest.raises(ValueError, match=r"inputs\[0\] is a plain list of images .*dpcore\.Samples\(images\)"):
        dp(images)
    dp.train()
    with pytest.raises(ValueError, match=r"inputs\[0\] is a plain list of images .*dpcore\.Samples\(images\)"):
        dp(images, targets)
    with pytest.raises(ValueError, match=r"inputs\[1\] is a plain list of targets .*dpcore\.Samples\(targets\)"):
        dp(dpcore.Samples(images), targets)
    with pytest.raises(ValueError, match=r"kwargs\['targets'\] is a plain list of targets"):
        dp(dpcore.Samples(images), targets=targets)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("sizes", "n_devices"), [(ONE_SIZE, 3), (SIZES, 2)], ids=["one-size-cpu*3", "sizes-cpu*2"])
def test_samples_infer_like_one_device(name: str, sizes: list[tuple[int, int]], n_devices: int) -> None:
    one = _model(name).eval()
    dp = dpcore.DataParallel(copy.deepcopy(one), ["cpu"] * n_devices)
    images, _ = _batch(sizes)
    with torch.no_grad():
        expected = one(images)
        got = dp(dpcore.Samples(images))
    assert isinstance(got, list) and len(got) == len(images)
    assert sum(len(e["boxes"]) for e in expected) > 0  # random weights still detect something
    for e, g in zip(expected, got):
        assert list(g) == list(e)
        for key in e:
            assert g[key].shape == e[key].shape, key
            torch.testing.assert_close(g[key], e[key], **TOL)


def test_retinanet_trains_like_one_device() -> None:
    """RetinaNet's losses are means over images of per-image losses, drawn
    without sampling: with model_loss="rows" the loss dict and the
    gradients equal one device's."""
    one = _model("retinanet").train()
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(dp_model, ["cpu"] * 3, model_loss="rows")
    images, targets = _batch(SIZES, seed=1)
    expected = one(images, targets)
    got = dp(dpcore.Samples(images), dpcore.Samples(targets))
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **TOL)
    sum(expected.values()).backward()
    sum(got.values()).backward()
    for (path, p), q in zip(dp_model.named_parameters(), one.parameters()):
        assert (p.grad is None) == (q.grad is None), path
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL)


@pytest.mark.parametrize("name", ["faster_rcnn", "mask_rcnn"])
def test_rcnn_trains_through_samples(name: str) -> None:
    one = _model(name).train()
    dp_model = copy.deepcopy(one)
    dp = dpcore.DataParallel(dp_model, ["cpu"] * 2, model_loss="rows")
    images, targets = _batch(SIZES, seed=2)
    expected: dict[str, Any] = one(images, targets)
    got = dp(dpcore.Samples(images), dpcore.Samples(targets))
    assert list(got) == list(expected)
    assert all(v.dim() == 0 and torch.isfinite(v) for v in got.values())
    sum(got.values()).backward()
    first = next(dp_model.backbone.parameters())
    assert first.grad is not None and bool(first.grad.abs().sum() > 0)
