"""How dpcore._C links libstdc++, and the check that it did (used by setup.py and the tests).

A C++ extension must use the one shared libstdc++ (libstdc++.so.6) that torch
loads. A compiler that links libstdc++ statically (``-static-libstdc++``, as
some GCC wrappers do) puts a second copy of its internals (std::locale,
codecvt, ostream) into the extension; the first number formatted into a
stream then meets the other copy's locale state: with GCC 12 the number is
silently dropped, with GCC 13 the process crashes (every TORCH_CHECK message
with an integer goes through ``ostream::operator<<(unsigned long)``).

Two guards, both used by setup.py:

* ``SHARED_LIBSTDCXX_LINK_ARGS`` names the shared libstdc++ on the link line
  ahead of the compiler driver's implicit libraries, so that every libstdc++
  symbol the objects need is already resolved by libstdc++.so before a static
  libstdc++.a the driver appends is searched; no archive member is pulled in.
* ``CheckedBuildExtension`` (torch's BuildExtension) inspects each library it
  built and refuses it (removes it and fails the build) when it does not link
  libstdc++.so.6 dynamically, defines libstdc++ internals itself, or needs a
  libstdc++ symbol version that the libstdc++ torch loaded does not provide.

The ELF reading is plain Python (no binutils needed), for 64-bit
little-endian ELF files (x86-64, aarch64).

A build tool, not part of the dpcore package: setup.py and the tests import
it from its file (``importlib``), so it works from any source checkout.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The shared libstdc++ first, with -Bdynamic restored to whatever it was after.
# extra_link_args come after the objects and the -l libraries on the link line,
# and before what the driver adds (with -static-libstdc++: -Bstatic -lstdc++).
SHARED_LIBSTDCXX_LINK_ARGS: list[str] = (
    ["-Wl,--push-state,-Bdynamic,-lstdc++,--pop-state"] if sys.platform.startswith("linux") else []
)

LIBSTDCXX_SONAME = "libstdc++.so.6"

# Mangled-name prefixes of libstdc++ internals that an extension linked against
# the shared libstdc++ never defines (they are explicitly instantiated inside
# libstdc++): std::locale, std::codecvt, std::ostream (basic_ostream<char>),
# std::ios_base, std::basic_ios.
LIBSTDCXX_INTERNAL_PREFIXES: tuple[str, ...] = (
    "_ZNSt6locale",
    "_ZNKSt6locale",
    "_ZNSt7codecvt",
    "_ZNKSt7codecvt",
    "_ZNSo",
    "_ZNKSo",
    "_ZNSt8ios_base",
    "_ZNKSt8ios_base",
    "_ZNSt9basic_ios",
    "_ZNKSt9basic_ios",
)

FIX_ADVICE = (
    "build with a compiler that links libstdc++ dynamically, e.g. "
    "`CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install --no-build-isolation .`"
)

_SHT_DYNSYM = 11
_SHT_DYNAMIC = 6
_SHT_GNU_VERDEF = 0x6FFFFFFD
_SHT_GNU_VERNEED = 0x6FFFFFFE
_DT_NEEDED = 1
_DT_NULL = 0


@dataclass
class ElfDynamicInfo:
    """What the dynamic loader sees of a shared library."""

    needed: list[str] = field(default_factory=list)
    """DT_NEEDED entries, in order."""
    defined: list[str] = field(default_factory=list)
    """Names of the dynamic symbols the library defines (exports)."""
    version_needs: dict[str, set[str]] = field(default_factory=dict)
    """{needed file: symbol versions required from it} (.gnu.version_r)."""
    version_defs: set[str] = field(default_factory=set)
    """Symbol versions the library defines (.gnu.version_d)."""


def _c_string(data: bytes, offset: int) -> str:
    end = data.index(b"\0", offset)
    return data[offset:end].decode("utf-8", "replace")


def read_elf_dynamic(path: str | os.PathLike[str]) -> ElfDynamicInfo:
    """Reads DT_NEEDED, the defined dynamic symbols and the symbol versions of
    a 64-bit little-endian ELF shared library.

    Raises ValueError naming the file when it is not such a library.
    """
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: expected a 64-bit little-endian ELF file (class {data[4]}, data {data[5]})")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign, sh_entsize
        sections.append(struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize))

    def strtab(index: int) -> bytes:
        offset, size = sections[index][4], sections[index][5]
        return data[offset : offset + size]

    info = ElfDynamicInfo()
    for _, kind, _, _, offset, size, link, sh_info, _, entsize in sections:
        if kind == _SHT_DYNAMIC:
            names = strtab(link)
            for pos in range(offset, offset + size, entsize or 16):
                tag, value = struct.unpack_from("<qQ", data, pos)
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    info.needed.append(_c_string(names, value))
        elif kind == _SHT_DYNSYM:
            names = strtab(link)
            for pos in range(offset, offset + size, entsize or 24):
                st_name, _, _, st_shndx = struct.unpack_from("<IBBH", data, pos)
                if st_name and st_shndx != 0:  # SHN_UNDEF: a reference, not a definition
                    info.defined.append(_c_string(names, st_name))
        elif kind == _SHT_GNU_VERNEED:
            names = strtab(link)
            pos = offset
            for _ in range(sh_info):  # sh_info: number of entries
                _, count, file_name, aux, next_entry = struct.unpack_from("<HHIII", data, pos)
                versions = info.version_needs.setdefault(_c_string(names, file_name), set())
                aux_pos = pos + aux
                for _ in range(count):
                    _, _, _, name, aux_next = struct.unpack_from("<IHHII", data, aux_pos)
                    versions.add(_c_string(names, name))
                    aux_pos += aux_next
                if not next_entry:
                    break
                pos += next_entry
        elif kind == _SHT_GNU_VERDEF:
            names = strtab(link)
            pos = offset
            for _ in range(sh_info):
                _, _, _, count, _, aux, next_entry = struct.unpack_from("<HHHHIII", data, pos)
                if count:  # the first auxiliary entry names the version itself
                    name, _ = struct.unpack_from("<II", data, pos + aux)
                    info.version_defs.add(_c_string(names, name))
                if not next_entry:
                    break
                pos += next_entry
    return info


def loaded_libstdcxx() -> str | None:
    """Path of the libstdc++.so.6 mapped into this process (the one torch
    loaded, once torch is imported), or None where it cannot be told."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        return None
    return None


def libstdcxx_problems(library: str | os.PathLike[str], runtime_libstdcxx: str | None = None) -> list[str]:
    """Reasons why ``library`` does not use the shared libstdc++ (empty: it does).

    Guarantees: reports a library that lacks libstdc++.so.6 in DT_NEEDED, one
    that defines libstdc++ internals (std::locale, codecvt, ostream, ios_base;
    a static libstdc++ inside), and, given ``runtime_libstdcxx`` (the file the
    process loads), every libstdc++ symbol version the library needs that that
    file does not define (the import would fail).
    """
    info = read_elf_dynamic(library)
    problems = []
    if LIBSTDCXX_SONAME not in info.needed:
        problems.append(f"{LIBSTDCXX_SONAME} is not among its needed libraries ({', '.join(info.needed) or 'none'})")
    internals = sorted(name for name in info.defined if name.startswith(LIBSTDCXX_INTERNAL_PREFIXES))
    if internals:
        shown = ", ".join(internals[:3])
        problems.append(
            f"it defines {len(internals)} libstdc++ internals itself (a static libstdc++ inside), e.g. {shown}"
        )
    if runtime_libstdcxx is not None:
        needed_versions = info.version_needs.get(LIBSTDCXX_SONAME, set())
        missing = sorted(needed_versions - read_elf_dynamic(runtime_libstdcxx).version_defs)
        if missing:
            problems.append(
                f"it needs libstdc++ symbol versions {', '.join(missing)}, which {runtime_libstdcxx} "
                "(the libstdc++ torch loads) does not provide: the compiler's libstdc++ is newer "
                "than the one torch runs with"
            )
    return problems


def compiler_description(cxx: str | None = None) -> str:
    """The compiler in use, for messages: the C++ compiler setuptools ran
    (when known) and the CC / CXX environment variables."""
    described = f"CC={os.environ.get('CC', '(unset)')}, CXX={os.environ.get('CXX', '(unset)')}"
    return f"{cxx} ({described})" if cxx else described


def refusal_message(library: str | os.PathLike[str], problems: list[str], compiler: str) -> str:
    """The build error for a library that does not use the shared libstdc++."""
    return (
        f"{library} does not use the shared libstdc++ that torch loads: {'; '.join(problems)}. "
        f"Compiler: {compiler}. A second libstdc++ next to torch's corrupts or crashes every "
        f"number formatted into a stream (every error message with a number). The library was "
        f"removed. Fix: {FIX_ADVICE}."
    )


def make_checked_build_ext(base: type) -> type:
    """A subclass of the build_ext command ``base`` (torch's BuildExtension)
    that checks every library it builds with libstdcxx_problems() against the
    libstdc++ this process loaded, and on any problem removes the library and
    fails the build with refusal_message()."""
    from setuptools.errors import ExecError

    class CheckedBuildExtension(base):  # type: ignore[misc, valid-type]
        def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
            super().build_extension(ext)
            library = self.get_ext_fullpath(ext.name)
            problems = libstdcxx_problems(library, loaded_libstdcxx())
            if problems:
                os.remove(library)
                cxx = getattr(self.compiler, "compiler_cxx", None)
                raise ExecError(refusal_message(library, problems, compiler_description(cxx[0] if cxx else None)))

    return CheckedBuildExtension
