"""The package's seams, checked on the source: modules take the extension
from dpcore._loader and never import from the package's __init__ (only the
entry points, dpcore/bench/, use the public face), and
dpcore/_C.pyi types exactly what the built extension binds."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from dpcore._loader import _C
from conftest import TESTS_DIR

PACKAGE = Path(TESTS_DIR).parent / "dpcore"
STUB = PACKAGE / "_C.pyi"

#: Modules that use dpcore as a user does: the benchmarks (the demo, examples/digits.py, is outside the package).
ENTRY_POINTS = ("bench/",)


def _submodules() -> set[str]:
    """Names importable as dpcore.<name> from the source: .py modules and packages."""
    names = {path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    names |= {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    return names | {"_build_info"}  # written by setup.py next to the built _C


def _upward_imports(path: Path, submodules: set[str]) -> list[str]:
    """The imports in `path` that read the package face: `import dpcore`,
    `from dpcore import X` for an X that is no source module (such as _C,
    which __init__ binds), `import dpcore._C` or `from dpcore import _C`
    outside a TYPE_CHECKING block."""
    found: list[str] = []
    tree = ast.parse(path.read_text(), str(path))
    type_checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            type_checking |= {id(child) for part in node.body for child in ast.walk(part)}
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "dpcore" or alias.name == "dpcore._C":
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "dpcore":
            for alias in node.names:
                if alias.name not in submodules or alias.name == "_C":
                    found.append(f"line {node.lineno}: from dpcore import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append(f"line {node.lineno}: relative import")
    return found


def test_no_module_imports_from_the_package_face() -> None:
    submodules = _submodules()
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "__init__.py" or relative.startswith(ENTRY_POINTS):
            continue
        if relative == "_loader.py":
            continue  # the one module that imports the extension itself (through importlib)
        found = _upward_imports(path, submodules)
        if found:
            offenders[relative] = found
    assert offenders == {}


def test_the_package_init_needs_no_noqa() -> None:
    text = (PACKAGE / "__init__.py").read_text()
    assert "noqa" not in text
    tree = ast.parse(text)
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    # Imports and __all__ only: no statement runs before an import.
    assert all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body[:-1])
    assert isinstance(body[-1], ast.Assign) and ast.unparse(body[-1].targets[0]) == "__all__"


def test_upward_import_check_finds_what_it_should(tmp_path: Path) -> None:
    # The checker itself: each form it must refuse, and the forms it allows.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import dpcore\n"
        "from dpcore import _C\n"
        "from dpcore import DataParallel\n"
        "import dpcore._C\n"
        "from . import comm\n"
        "from dpcore import comm\n"
        "from dpcore._loader import _C\n"
        "import dpcore._build_info as b\n"
        "if TYPE_CHECKING:\n"
        "    import dpcore._C as _C\n"
    )
    assert _upward_imports(sample, _submodules()) == [
        "line 1: import dpcore",
        "line 2: from dpcore import _C",
        "line 3: from dpcore import DataParallel",
        "line 4: import dpcore._C",
        "line 5: relative import",
    ]


# -- dpcore/_C.pyi against the built extension ---------------------------------

#: pybind11's own members of every bound class.
_PYBIND_MEMBERS = {"_pybind11_conduit_v1_"}


def _split_top_level(text: str) -> list[str]:
    """'a: x[int, str], b: y = 1' -> ['a: x[int, str]', 'b: y = 1']."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def _bound_parameters(function: Any) -> list[str]:
    """Parameter names of a pybind11 function, from the signature line of its
    docstring ("name(a: T, *, b: U = 1) -> R"), `self` left out, `*` kept."""
    first = (function.__doc__ or "").splitlines()[0]
    match = re.match(r"\s*\w+\((.*)\)\s*->", first)
    assert match, f"no signature line in the docstring of {function!r}: {first!r}"
    names = [part.split(":")[0].split("=")[0].strip() for part in _split_top_level(match.group(1))]
    return [name for name in names if name != "self"]


def _stub_parameters(node: ast.FunctionDef) -> list[str]:
    names = [arg.arg for arg in node.args.posonlyargs + node.args.args if arg.arg != "self"]
    if node.args.kwonlyargs:
        names += ["*", *(arg.arg for arg in node.args.kwonlyargs)]
    return names


def _stub() -> dict[str, ast.AST]:
    tree = ast.parse(STUB.read_text(), str(STUB))
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def test_stub_names_are_the_extensions() -> None:
    bound = {name for name in vars(_C) if not name.startswith("__")}
    assert set(_stub()) == bound


@pytest.mark.parametrize("name", sorted(name for name, node in _stub().items() if isinstance(node, ast.FunctionDef)))
def test_stub_function_parameters_are_the_extensions(name: str) -> None:
    node = _stub()[name]
    assert isinstance(node, ast.FunctionDef)
    assert _stub_parameters(node) == _bound_parameters(getattr(_C, name))


@pytest.mark.parametrize("name", sorted(name for name, node in _stub().items() if isinstance(node, ast.ClassDef)))
def test_stub_class_members_are_the_extensions(name: str) -> None:
    node = _stub()[name]
    assert isinstance(node, ast.ClassDef)
    cls = getattr(_C, name)
    if issubclass(cls, BaseException):
        assert [ast.unparse(base) for base in node.bases] == [base.__name__ for base in cls.__bases__]
        return
    methods = {item.name: item for item in node.body if isinstance(item, ast.FunctionDef)}
    properties = {
        item.name
        for item in methods.values()
        if any(ast.unparse(decorator) == "property" for decorator in item.decorator_list)
    }
    bound_properties = {key for key, value in vars(cls).items() if isinstance(value, property)}
    bound_methods = {
        key
        for key in vars(cls)
        if key not in bound_properties
        and key not in _PYBIND_MEMBERS
        and (not key.startswith("__") or key == "__init__")
    }
    assert properties == bound_properties
    stub_methods = set(methods) - properties
    # A class built only in C++ (ParallelRun) has pybind's default __init__, which the stub leaves out.
    if "__init__" not in stub_methods:
        assert (cls.__init__.__doc__ or "").startswith("Initialize self")
        bound_methods.discard("__init__")
    assert stub_methods == bound_methods
    for method in stub_methods:
        assert _stub_parameters(methods[method]) == _bound_parameters(getattr(cls, method)), method
