"""The Python front end's size (kept under 6,500 lines, no module over 700).

    python tools/front_end_size.py [PACKAGE_DIR]   # default: dpcore/ next to this folder

Prints, for the modules directly in the package: each module's lines and the
total (what ``wc -l dpcore/*.py`` counts), the total split into docstring,
comment, blank and code lines, the longest module docstring, and the AST
count of the two largest classes (lines, methods, attributes assigned on
``self`` or in the class body, docstring lines).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CLASSES = {"data_parallel.py": "DataParallel", "distributed.py": "GradientSync"}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _class_count(tree: ast.AST, name: str) -> str:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attrs = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and getattr(n.value, "id", "") == "self"
            }
            for n in node.body:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                attrs.update(t.id for t in targets if isinstance(t, ast.Name))
            doc = len((ast.get_docstring(node, clean=False) or "").splitlines())
            return f"{name}: {node.end_lineno - node.lineno + 1} lines, {len(methods)} methods, {len(attrs)} attributes, docstring {doc} lines"
    return f"{name}: not found"


def main() -> None:
    package = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "dpcore"
    kinds = {"docstring": 0, "comment": 0, "blank": 0, "code": 0}
    longest = (0, "")
    total = 0
    for path in sorted(package.glob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        docs = _docstring_lines(tree)
        total += len(lines)
        print(f"{len(lines):6d} {path.name}")
        for number, line in enumerate(lines, 1):
            kind = (
                "docstring"
                if number in docs
                else "blank"
                if not line.strip()
                else "comment"
                if line.lstrip().startswith("#")
                else "code"
            )
            kinds[kind] += 1
        module_doc = ast.get_docstring(tree, clean=False)
        if module_doc and len(module_doc.splitlines()) > longest[0]:
            longest = (len(module_doc.splitlines()), path.name)
        if path.name in CLASSES:
            print("       " + _class_count(tree, CLASSES[path.name]))
    print(f"{total:6d} total: " + ", ".join(f"{v} {k}" for k, v in kinds.items()))
    print(f"longest module docstring: {longest[0]} lines ({longest[1]})")


if __name__ == "__main__":
    main()
