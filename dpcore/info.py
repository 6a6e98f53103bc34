"""What was built and what is visible: ``dpcore.info()`` and ``python -m dpcore.info``."""

from __future__ import annotations

from typing import Any

import torch


def info() -> dict[str, Any]:
    """Facts about this dpcore install.

    Returns a dict with: ``dpcore`` (version), ``torch`` (imported version),
    ``built_against_torch`` and ``torch_matches`` (whether _C was built against
    the imported torch; a mismatch already fails at import), ``build``
    ("cuda" or "cpu"), ``cuda_arch_list`` (architectures compiled), and
    ``devices`` (visible CUDA devices by name; always includes "cpu"), and
    ``peer_access`` ({"cuda:i -> cuda:j": bool} for every ordered pair of
    distinct visible GPUs: whether kernels on i read j's memory directly,
    which reduce_add_coalesced then does instead of copying; asking enables
    access where the hardware allows it; empty with fewer than two GPUs).
    """
    import dpcore
    from dpcore import _C, _build_info
    from dpcore._loader import _base

    devices = ["cpu"]
    peer_access: dict[str, bool] = {}
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        devices += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(count)]
        gpus = [torch.device("cuda", i) for i in range(count)]
        peer_access = {f"cuda:{i} -> cuda:{j}": ok for (i, j), ok in sorted(_C.peer_access(gpus).items())}
    return {
        "dpcore": dpcore.__version__,
        "torch": torch.__version__,
        "built_against_torch": _build_info.TORCH_VERSION,
        "torch_matches": _base(_build_info.TORCH_VERSION) == _base(torch.__version__)
        and _base(_C.torch_version) == _base(torch.__version__),
        "build": "cuda" if _C.with_cuda else "cpu",
        "cuda_arch_list": list(_C.cuda_arch_list),
        "devices": devices,
        "peer_access": peer_access,
    }


def main() -> None:
    """Print info() one fact per line."""
    for key, value in info().items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
