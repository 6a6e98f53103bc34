"""dpcore._C must use the shared libstdc++ that torch loads (tools/link_check.py,
used by setup.py): a tiny C++ library built through the same link arguments
and build command as dpcore._C, with a compiler wrapper that adds
-static-libstdc++ (as some GCC installations do), still links libstdc++.so.6
and formats numbers after `import torch`; without those arguments the build
is refused; the installed dpcore._C passes the same check."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import dpcore
from conftest import TESTS_DIR

ROOT = Path(TESTS_DIR).parent
LINK_CHECK_FILE = ROOT / "tools" / "link_check.py"

TINY_SOURCE = r"""
#include <cstring>
#include <sstream>
#include <string>

// "value 42" when the library uses the libstdc++ the process has loaded.
extern "C" int format_value(char* buffer, int size) {
  std::ostringstream stream;
  stream << "value " << 42ul;
  const std::string text = stream.str();
  std::strncpy(buffer, text.c_str(), size - 1);
  buffer[size - 1] = '\0';
  return static_cast<int>(text.size());
}
"""

# The same pieces as setup.py: the link arguments and the checking build_ext
# (on top of torch's BuildExtension), with TINY_LINK=none leaving the
# arguments out.
TINY_SETUP = """
import importlib.util, os, sys
from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension

spec = importlib.util.spec_from_file_location("dpcore_link_check", os.environ["LINK_CHECK_FILE"])
link_check = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = link_check
spec.loader.exec_module(link_check)
link = link_check.SHARED_LIBSTDCXX_LINK_ARGS if os.environ["TINY_LINK"] == "project" else []
setup(
    name="tiny",
    ext_modules=[Extension("tiny", ["tiny.cpp"], extra_link_args=link, language="c++")],
    cmdclass={"build_ext": link_check.make_checked_build_ext(BuildExtension)},
)
"""

LOAD_AND_FORMAT = """
import ctypes, sys
import torch  # first, as for dpcore._C: its libstdc++.so.6 is loaded
buffer = ctypes.create_string_buffer(64)
ctypes.CDLL(sys.argv[1]).format_value(buffer, 64)
print(buffer.value.decode())
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared libraries: Linux only")


@pytest.fixture(scope="module")
def link_check() -> ModuleType:
    """tools/link_check.py, imported from its file as setup.py does."""
    spec = importlib.util.spec_from_file_location("dpcore_link_check", LINK_CHECK_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _system_compiler(tool: str) -> str:
    """/usr/bin/<tool> (the system compiler, as dpcore is built with), else <tool> on PATH."""
    path = f"/usr/bin/{tool}" if os.access(f"/usr/bin/{tool}", os.X_OK) else shutil.which(tool)
    if path is None:
        pytest.fail(f"no {tool} in /usr/bin nor on PATH: the extension cannot be built here either")
    return path


def _static_wrappers(folder: Path) -> dict[str, str]:
    """gcc and g++ wrappers around the system compiler that add -static-libstdc++ to every command."""
    folder.mkdir()
    paths = {}
    for env_name, tool in (("CC", "gcc"), ("CXX", "g++")):
        real = _system_compiler(tool)
        wrapper = folder / tool
        wrapper.write_text(f'#!/bin/sh\nexec {real} "$@" -static-libstdc++\n')
        wrapper.chmod(0o755)
        paths[env_name] = str(wrapper)
    return paths


def _build_tiny(tmp_path: Path, link: str) -> tuple[subprocess.CompletedProcess[str], Path, dict[str, str]]:
    """Builds tiny.cpp in place with the static wrappers; returns the build,
    the folder and the wrappers."""
    wrappers = _static_wrappers(tmp_path / "wrap")
    work = tmp_path / "tiny"
    work.mkdir()
    (work / "tiny.cpp").write_text(TINY_SOURCE)
    (work / "setup.py").write_text(TINY_SETUP)
    env = dict(os.environ, LINK_CHECK_FILE=str(LINK_CHECK_FILE), TINY_LINK=link, MAX_JOBS="1", **wrappers)
    env.pop("LDSHARED", None)
    env.pop("LDCXXSHARED", None)
    completed = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return completed, work, wrappers


def test_project_link_args_keep_the_shared_libstdcxx_with_a_static_wrapper(
    tmp_path: Path, link_check: ModuleType
) -> None:
    completed, work, _ = _build_tiny(tmp_path, "project")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    [library] = work.glob("tiny*.so")
    info = link_check.read_elf_dynamic(library)
    assert "libstdc++.so.6" in info.needed
    assert not [name for name in info.defined if name.startswith(link_check.LIBSTDCXX_INTERNAL_PREFIXES)]
    assert link_check.libstdcxx_problems(library, link_check.loaded_libstdcxx()) == []
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_AND_FORMAT, str(library)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "value 42"


def test_build_refuses_a_library_with_a_static_libstdcxx(tmp_path: Path) -> None:
    completed, work, wrappers = _build_tiny(tmp_path, "none")
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0, output
    assert "does not use the shared libstdc++ that torch loads" in output
    assert "libstdc++.so.6 is not among its needed libraries" in output
    assert "libstdc++ internals itself" in output
    assert f"CXX={wrappers['CXX']}" in output  # names the compiler in use
    assert "CC=/usr/bin/gcc CXX=/usr/bin/g++" in output  # and the fix
    assert list(work.glob("tiny*.so")) == []  # removed: nothing can load it


def test_check_reports_versions_the_runtime_libstdcxx_lacks(tmp_path: Path, link_check: ModuleType) -> None:
    library = tmp_path / "plain.so"
    source = tmp_path / "plain.cpp"
    source.write_text(TINY_SOURCE)
    subprocess.run(
        [
            _system_compiler("g++"),
            "-shared",
            "-fPIC",
            str(source),
            "-o",
            str(library),
            *link_check.SHARED_LIBSTDCXX_LINK_ARGS,
        ],
        check=True,
        timeout=120,
    )
    runtime = link_check.loaded_libstdcxx()
    assert runtime is not None and os.path.basename(runtime).startswith("libstdc++.so")
    needs = link_check.read_elf_dynamic(library).version_needs["libstdc++.so.6"]
    assert needs and all(v.startswith(("GLIBCXX_", "CXXABI_")) for v in needs)
    assert link_check.libstdcxx_problems(library, runtime) == []
    # Against a library that defines none of them (the C library), every one is missing.
    libc = next(path for path in _mapped_libraries() if os.path.basename(path).startswith("libc.so"))
    [problem] = link_check.libstdcxx_problems(library, libc)
    assert "needs libstdc++ symbol versions" in problem
    assert all(version in problem for version in needs)


def test_read_elf_dynamic_rejects_a_file_that_is_not_elf(tmp_path: Path, link_check: ModuleType) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    with pytest.raises(ValueError, match="notes.txt: not an ELF file"):
        link_check.read_elf_dynamic(text)


def test_installed_extension_uses_the_shared_libstdcxx(link_check: ModuleType) -> None:
    library = dpcore._C.__file__
    assert "libstdc++.so.6" in link_check.read_elf_dynamic(library).needed
    assert link_check.libstdcxx_problems(library, link_check.loaded_libstdcxx()) == []


def _mapped_libraries() -> list[str]:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return [line.split(None, 5)[-1].strip() for line in maps if "/" in line]
