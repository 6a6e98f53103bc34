"""timm with dpcore's wrapper, through the real library: its models train
exactly, and its utilities that take a DataParallel (unwrap_model,
get_state_dict, the EMAs v1/v2/v3, CheckpointSaver, resume_checkpoint)
treat dpcore's wrapper as torch's.

timm needs a torchvision that matches torch; where either is missing the
whole file is skipped with that reason. CI's CUDA-build job
(scripts/test_cuda_build.sh: torch 2.11.0, torchvision 0.26.0, timm 1.0.31)
runs it; the CPU counterparts of the same rules (the state-dict keys, the
EMA rule reduced to its code) are in tests/test_dropin.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore

try:
    import timm
    import timm.utils
    from timm.models import resume_checkpoint
except (ImportError, RuntimeError) as e:  # RuntimeError: a torchvision built for another torch
    pytest.skip(
        f"timm is not usable here ({type(e).__name__}: {e}); pip install timm with a torchvision that matches torch",
        allow_module_level=True,
    )

DEVICES = ["cpu"] * 2
STEPS = 3
TOL = 1e-10


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    size = {"img_size": 32} if "vit" in name else {}  # the batches' size (a ViT's is fixed)
    return timm.create_model(name, pretrained=False, num_classes=3, **size).double()


def _batch(step: int, rows: int = 5, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, 3, size, size, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (rows,), generator=g)


def _train(model: nn.Module, wrapper: nn.Module, ema: Any = None) -> list[torch.Tensor]:
    """STEPS of SGD with momentum on `wrapper` (which runs `model`), uneven
    batches of 5 rows; returns the losses. `ema.update(wrapper)` after each
    step. (Not Adam: its normalized update turns summation-order noise in
    near-zero gradients into 1e-9 differences, which would hide a real
    defect under a looser tolerance.)"""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(wrapper(x), y)
        loss.backward()
        opt.step()
        if ema is not None:
            ema.update(wrapper)
        losses.append(loss.detach())
    return losses


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=TOL, rtol=0, msg=k)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("test_vit", {}),  # LayerNorm: exact as it is
        ("test_resnet", {"sync_batchnorm": True}),  # BatchNorm: exact with the whole batch's statistics
        ("test_convnext", {}),
    ],
)
def test_timm_models_train_exactly_as_on_one_device(name: str, options: dict[str, Any]) -> None:
    model, reference = _model(name), _model(name)
    losses = _train(model, dpcore.DataParallel(model, DEVICES, **options))
    expected = _train(reference, reference)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), atol=TOL, rtol=0)
    _assert_same_state(model.state_dict(), reference.state_dict())
    assert not torch.equal(losses[0], losses[-1])  # it trained


def test_unwrap_model_and_get_state_dict_see_through_the_wrapper() -> None:
    model = _model("test_vit")
    dp = dpcore.DataParallel(model, DEVICES)
    assert timm.utils.unwrap_model(dp) is model
    _assert_same_state(timm.utils.get_state_dict(dp), model.state_dict())


@pytest.mark.parametrize("ema_of", ["model", "wrapper"])
@pytest.mark.parametrize("version", ["ModelEma", "ModelEmaV2", "ModelEmaV3"])
def test_timm_emas_track_the_wrapped_model(version: str, ema_of: str) -> None:
    """Every EMA of timm, made from the bare model or from the wrapper (as
    timm's train.py did for DataParallel) and updated from the wrapper,
    equals the same EMA trained on one device."""
    ema_class = getattr(timm.utils, version)
    model, reference = _model("test_resnet"), _model("test_resnet")
    dp = dpcore.DataParallel(model, DEVICES, sync_batchnorm=True)
    ema = ema_class(dp if ema_of == "wrapper" else model, decay=0.5)
    ema_ref = ema_class(reference, decay=0.5)
    if version == "ModelEma" and ema_of == "model":  # v1 reads torch's "module." keys: the bare keys only here
        with pytest.raises(KeyError, match="bare module's keys"):
            ema.update(dp)
        return
    _train(model, dp, ema)
    _train(reference, reference, ema_ref)
    got = timm.utils.unwrap_model(ema).state_dict()
    _assert_same_state(got, ema_ref.ema.state_dict() if version == "ModelEma" else ema_ref.module.state_dict())
    assert not torch.equal(got["fc.weight"], _model("test_resnet").fc.weight)


def test_checkpoint_saver_and_resume_round_trip(tmp_path: Path) -> None:
    """CheckpointSaver over the wrapper writes the bare model's keys;
    resume_checkpoint loads them into a bare model and into a new wrapper,
    and the next steps equal an uninterrupted run."""
    model = _model("test_vit")
    dp = dpcore.DataParallel(model, DEVICES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = timm.utils.ModelEmaV3(model, decay=0.5)
    saver = timm.utils.CheckpointSaver(
        dp, opt, model_ema=ema, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path), max_history=2
    )
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(dp(x), y).backward()
        opt.step()
        ema.update(dp)
    saver.save_checkpoint(epoch=0, metric=1.0)
    path = tmp_path / "checkpoint-0.pth.tar"
    saved = torch.load(path, weights_only=False)
    assert list(saved["state_dict"]) == list(model.state_dict())  # no "module." prefix
    _assert_same_state(saved["state_dict_ema"], ema.module.state_dict())

    bare = _model("test_vit")
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9)
    resume_checkpoint(bare, str(path), optimizer=bare_opt, log_info=False)
    _assert_same_state(bare.state_dict(), model.state_dict())

    again = _model("test_vit")
    wrapped = dpcore.DataParallel(again, DEVICES)
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    resume_checkpoint(wrapped, str(path), optimizer=again_opt, log_info=False)
    _assert_same_state(again.state_dict(), model.state_dict())

    x, y = _batch(STEPS)
    for m, w, o in ((model, dp, opt), (again, wrapped, again_opt)):
        o.zero_grad()
        F.cross_entropy(w(x), y).backward()
        o.step()
    _assert_same_state(again.state_dict(), model.state_dict())


def test_a_torch_dataparallel_checkpoint_resumes_into_dpcore(tmp_path: Path) -> None:
    """A checkpoint of torch.nn.DataParallel's keys ("module." prefixed, as
    timm's saver writes it without unwrapping) resumes into dpcore's wrapper."""
    model = _model("test_vit")
    prefixed = {"module." + k: v for k, v in model.state_dict().items()}
    torch.save({"state_dict": prefixed, "epoch": 4, "version": 2}, tmp_path / "torch_dp.pth")
    target = dpcore.DataParallel(_model("test_convnext"), DEVICES)  # a different model: its own error
    with pytest.raises(RuntimeError):
        resume_checkpoint(target, str(tmp_path / "torch_dp.pth"), log_info=False)
    fresh = _model("test_vit")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    dp = dpcore.DataParallel(fresh, DEVICES)
    epoch = resume_checkpoint(dp, str(tmp_path / "torch_dp.pth"), log_info=False)
    assert epoch == 5  # timm's resume returns the epoch after the saved one (checkpoint version 2)
    _assert_same_state(fresh.state_dict(), model.state_dict())
