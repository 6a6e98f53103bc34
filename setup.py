"""Build of dpcore's C++/CUDA extension, dpcore._C.

CUDAExtension when the installed torch has CUDA and nvcc is found, else
CppExtension; DPCORE_CUDA=0 or DPCORE_CUDA=1 forces either. Install with
`pip install --no-build-isolation .` after torch (and, with a setuptools
older than 70.1, the `wheel` package: the build says so when it is missing).

The extension always links the shared libstdc++ that torch loads, whatever
compiler CC / CXX name, and the build refuses a library that does not (see
tools/link_check.py: a static libstdc++ next to torch's crashes on the first
number formatted into an error message).
"""

from __future__ import annotations

import glob
import importlib.util
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

#: setup.py commands that make a wheel (pip's PEP 517 build runs dist_info for
#: the metadata, then bdist_wheel; editable installs run editable_wheel).
WHEEL_COMMANDS = {"bdist_wheel", "dist_info", "editable_wheel"}


def _check_wheel_support(commands: list[str]) -> None:
    """Exits naming the one command that fixes it when `commands` make a wheel
    and the running setuptools cannot: setuptools ships bdist_wheel itself
    only from 70.1, older ones need the `wheel` package (a fresh Python 3.11
    venv has setuptools 65.5 and no wheel; torch 2.13 and newer pull in a
    recent setuptools, older torch releases do not)."""
    if not WHEEL_COMMANDS.intersection(commands):
        return
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is not None:
        return
    if importlib.util.find_spec("wheel") is not None:
        return
    import setuptools

    sys.exit(
        f"dpcore: building a wheel with setuptools {setuptools.__version__} needs the `wheel` package "
        "(setuptools ships bdist_wheel itself only from 70.1): run `pip install wheel`, then "
        "`pip install --no-build-isolation .` again"
    )


_check_wheel_support(sys.argv[1:])

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def _load_link_check():
    """tools/link_check.py, imported from its file (it is not an installed package)."""
    spec = importlib.util.spec_from_file_location("dpcore_link_check", ROOT / "tools" / "link_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while it runs
    spec.loader.exec_module(module)
    return module


link_check = _load_link_check()


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
    # kernels' parallel loops would silently run on one thread. -g0: no debug
    # information, which Python's own CFLAGS (-g) would add to every object.
    cxx = ["-O3", "-g0", "-fopenmp"]
    link = ["-fopenmp", *link_check.SHARED_LIBSTDCXX_LINK_ARGS]
    # The ATen/ops/<op>.h headers of torch's wheel: csrc/dpcore's sources
    # (TORCH_ASSERT_ONLY_METHOD_OPERATORS) include only the operators they call.
    define_macros = [("AT_PER_OPERATOR_HEADERS", None)]
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
            extra_link_args=link,
        )
    return cpp_extension.CppExtension(
        "dpcore._C",
        _sources(False),
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
    )


def _license_metadata() -> dict[str, str]:
    """The license as the running setuptools wants it (pyproject.toml lists it
    as dynamic): an SPDX expression from setuptools 77 on, the plain license
    field before (Python 3.11's venvs bundle setuptools 65.5); neither warns."""
    import setuptools

    if int(setuptools.__version__.split(".")[0]) >= 77:
        return {"license_expression": "BSD-3-Clause"}
    return {"license": "BSD-3-Clause"}


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": link_check.make_checked_build_ext(cpp_extension.BuildExtension)},
    **_license_metadata(),
)
