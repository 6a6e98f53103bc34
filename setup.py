"""Build of dpcore's C++/CUDA extension, dpcore._C.

CUDAExtension when the installed torch has CUDA and nvcc is found, else
CppExtension; DPCORE_CUDA=0 or DPCORE_CUDA=1 forces either. Install with
`pip install --no-build-isolation .` after torch.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - reported to the user
    sys.exit(
        "dpcore: torch must be installed before dpcore is built; install it, then "
        "run `pip install --no-build-isolation .`"
    )

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def _nvcc() -> str | None:
    """Path of nvcc under CUDA_HOME (as torch resolves it), else on PATH."""
    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _want_cuda() -> bool:
    flag = os.environ.get("DPCORE_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        sys.exit(f"dpcore: DPCORE_CUDA must be 0 or 1, but it is {flag!r}")
    if flag == "0":
        return False
    torch_cuda = torch.version.cuda
    nvcc = _nvcc()
    if flag == "1":
        missing = []
        if torch_cuda is None:
            missing.append(
                f"the installed torch {torch.__version__} is a CPU build "
                "(torch.version.cuda is None); install a CUDA build of torch"
            )
        if nvcc is None:
            missing.append(
                "no CUDA toolkit was found (no nvcc under CUDA_HOME="
                f"{os.environ.get('CUDA_HOME')!r} nor on PATH); set CUDA_HOME"
            )
        if missing:
            sys.exit("dpcore: DPCORE_CUDA=1 but " + "; and ".join(missing))
        return True
    return torch_cuda is not None and nvcc is not None


def _pip_cuda_include_dirs() -> list[str]:
    """Include folders of pip's nvidia packages (nvidia/cu13/include and the like),
    which carry headers a pip torch expects but a bare toolkit may lack."""
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return []
    found: list[str] = []
    for base in getattr(nvidia, "__path__", []):
        found.extend(sorted(glob.glob(os.path.join(base, "*", "include"))))
    return found


def _arch_list() -> str:
    arches = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arches:
        return arches.replace(" ", ";")
    return ";".join(a.replace("sm_", "") for a in torch.cuda.get_arch_list() if a.startswith("sm_"))


def _sources(with_cuda: bool) -> list[str]:
    patterns = ["dpcore/*.cpp", "dpcore/comm/*.cpp", "dpcore/kernels/*.cpp", "python/*.cpp"]
    if with_cuda:
        patterns += ["dpcore/cuda/*.cpp", "dpcore/cuda/*.cu"]
    sources: list[str] = []
    for pattern in patterns:
        sources.extend(sorted(str(p.relative_to(ROOT)) for p in CSRC.glob(pattern)))
    return sources


def _write_build_info() -> None:
    # The torch version alone: whether CUDA was built, and for which
    # architectures, is dpcore._C.with_cuda and dpcore._C.cuda_arch_list.
    (ROOT / "dpcore" / "_build_info.py").write_text(
        '"""Written by setup.py at build time: what dpcore._C was built against."""\n\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
    )


def _extension():
    with_cuda = _want_cuda()
    arches = _arch_list() if with_cuda else ""
    _write_build_info()
    # at::parallel_for is an inline OpenMP template: without -fopenmp the
    # kernels' parallel loops would silently run on one thread.
    cxx = ["-O3", "-fopenmp"]
    define_macros = []
    include_dirs = [str(CSRC)]
    if with_cuda:
        define_macros += [("DPCORE_WITH_CUDA", None), ("DPCORE_CUDA_ARCH_LIST", f'"{arches}"')]
        include_dirs += _pip_cuda_include_dirs()
        return cpp_extension.CUDAExtension(
            "dpcore._C",
            _sources(True),
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
            extra_link_args=["-fopenmp"],
        )
    return cpp_extension.CppExtension(
        "dpcore._C",
        _sources(False),
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
