"""What was built and what is visible: ``dpcore.info()`` and ``python -m dpcore.info``.

A package, not a module, so that ``python -m dpcore.info`` (its __main__.py)
runs cleanly although ``import dpcore`` has imported this and bound the name
``dpcore.info`` to the function info()."""

from __future__ import annotations

import sys
from typing import Any

import torch

# What _C._self_check() returns when C++ formats numbers into error messages
# correctly (csrc/python/module.cpp).
SELF_CHECK_EXPECTED = "self-check: size_t 42, int64_t -7, double 0.5"


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
    access where the hardware allows it; empty with fewer than two GPUs), and
    ``self_check``: "ok" when a C++ error raised inside _C carries its
    numbers (a size_t, an int64_t, a double), else "failed: ..." with what it
    carried (a static libstdc++ in _C next to torch's shared one drops them).
    """
    import dpcore._build_info as _build_info
    from dpcore._loader import _C, _base
    from dpcore._version import __version__

    devices = ["cpu"]
    peer_access: dict[str, bool] = {}
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        devices += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(count)]
        gpus = [torch.device("cuda", i) for i in range(count)]
        peer_access = {f"cuda:{i} -> cuda:{j}": ok for (i, j), ok in sorted(_C.peer_access(gpus).items())}
    return {
        "dpcore": __version__,
        "torch": torch.__version__,
        "built_against_torch": _build_info.TORCH_VERSION,
        "torch_matches": _base(_build_info.TORCH_VERSION) == _base(torch.__version__)
        and _base(_C.torch_version) == _base(torch.__version__),
        "build": "cuda" if _C.with_cuda else "cpu",
        "cuda_arch_list": list(_C.cuda_arch_list),
        "devices": devices,
        "peer_access": peer_access,
        "self_check": self_check(),
    }


def self_check() -> str:
    """ "ok" when _C formats numbers into its C++ error messages correctly,
    else "failed: " with the message it produced and the likely cause."""
    from dpcore._loader import _C

    message = _C._self_check()
    if message == SELF_CHECK_EXPECTED:
        return "ok"
    return (
        f"failed: a C++ error message came out as {message!r}, expected {SELF_CHECK_EXPECTED!r}; "
        "dpcore._C probably carries its own static libstdc++: rebuild with a compiler that links "
        "libstdc++ dynamically (CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install --no-build-isolation .)"
    )


def main() -> None:
    """Print info() one fact per line; exit with status 1 when the self-check failed."""
    facts = info()
    for key, value in facts.items():
        print(f"{key:>20}: {value}")
    if facts["self_check"] != "ok":
        print(f"dpcore.info: self-check {facts['self_check']}", file=sys.stderr)
        sys.exit(1)
