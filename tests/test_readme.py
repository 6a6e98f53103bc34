"""The README and the pages of docs/ as a new user reads them: their Python
blocks run as pasted, the README's options table and docs/reference.md
document every option and public name with its default, the command
synopses list every flag of each command line, every link resolves (the
README links every page of docs/), and measured figures cite recorded runs.

Python blocks: every ```python block of README.md and of docs/*.md runs, in
a fresh child Python started in an empty folder, unless HTML comments on the
lines right above its fence say otherwise:

* ``<!-- not run: REASON -->``: not run (a process group, a GPU); the
  reason must be given;
* ``<!-- continues -->``: run after the block before it on the same page,
  in the same process (that block's own continuation included), as a
  reader pasting both would;
* ``<!-- needs: pkg, pkg -->``: run only where those optional packages are
  installed (the project's test environment has them).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.join import Joinable

import dpcore
from conftest import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
MEASURED = DOCS / "measured.md"
#: The README, then every page of docs/.
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MARKER = re.compile(r"<!--\s*(not run|continues|needs)\s*(?::\s*(.*?))?\s*-->")


def _name(page: Path) -> str:
    """The page's path in the repository, as messages name it."""
    return page.relative_to(ROOT).as_posix()


@dataclass
class Block:
    """One ```python block of a page."""

    page: str  # the page's path in the repository, e.g. "docs/losses.md"
    line: int  # 1-based line of its opening fence
    code: str
    not_run: str | None = None  # the reason, when marked "not run"
    continues: bool = False
    needs: list[str] = field(default_factory=list)
    previous: Block | None = None  # the block it continues (of the same page)

    @property
    def program(self) -> str:
        """The code a reader runs: the blocks it continues, then its own."""
        return (self.previous.program + "\n" if self.continues and self.previous else "") + self.code

    @property
    def all_needs(self) -> list[str]:
        return sorted({*self.needs, *(self.previous.all_needs if self.continues and self.previous else [])})


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The Python blocks of one page's `text` with their markers. Raises
    ValueError for a marker that is not directly above a ```python fence, an
    unknown marker, or a malformed one."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: list[tuple[int, str, str | None]] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("<!--") and re.match(r"<!--\s*(not run|continues|needs)\b", stripped):
            match = MARKER.fullmatch(stripped)
            if match is None:
                raise ValueError(f"{page}:{i + 1}: malformed block marker {stripped!r}")
            pending.append((i + 1, match.group(1), match.group(2)))
        elif stripped.startswith("```"):
            fence_line = i + 1
            language = stripped[3:].strip()
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if language == "python":
                code = _dedent("\n".join(body)) + "\n"
                block = Block(page, fence_line, code, previous=blocks[-1] if blocks else None)
                for where, kind, value in pending:
                    if kind == "not run":
                        if not value:
                            raise ValueError(f"{page}:{where}: 'not run' needs a reason")
                        block.not_run = value
                    elif kind == "continues":
                        if value:
                            raise ValueError(f"{page}:{where}: 'continues' takes no argument")
                        block.continues = True
                    else:
                        block.needs += [name.strip() for name in (value or "").split(",") if name.strip()]
                blocks.append(block)
            elif pending:
                raise ValueError(f"{page}:{pending[0][0]}: a block marker above a ```{language} block")
            pending = []
        elif pending and stripped:
            raise ValueError(f"{page}:{pending[0][0]}: a block marker not directly above a ```python fence")
        i += 1
    return blocks


def _dedent(code: str) -> str:
    import textwrap

    return textwrap.dedent(code)


BLOCKS = [block for page in PAGES for block in readme_blocks(page.read_text(), _name(page))]
RUN = [b for b in BLOCKS if b.not_run is None]


def test_markers_are_consistent() -> None:
    assert len(BLOCKS) >= 8
    for block in BLOCKS:
        where = f"{block.page}:{block.line}"
        if block.not_run is not None:
            assert len(block.not_run) > 10, f"{where}: say why the block is not run"
            assert not block.continues and not block.needs, f"{where}: not run, yet marked to run"
        if block.continues:
            assert block.previous is not None and block.previous.not_run is None, (
                f"{where}: continues a block that does not run"
            )
    # Every block either runs (below) or says why not: nothing is left unaccounted for.
    assert len(RUN) + sum(b.not_run is not None for b in BLOCKS) == len(BLOCKS)
    assert len(RUN) >= 6
    # The README's own example runs.
    assert any(b.page == "README.md" for b in RUN)


def test_marker_parsing_refuses_stray_and_bad_markers() -> None:
    with pytest.raises(ValueError, match="needs a reason"):
        readme_blocks("<!-- not run: -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="not directly above"):
        readme_blocks("<!-- continues -->\ntext\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="above a ```bash block"):
        readme_blocks("<!-- not run: a shell command -->\n```bash\nls\n```\n")
    blocks = readme_blocks("```python\nx = 1\n```\n<!-- continues -->\n<!-- needs: numpy -->\n```python\ny = x\n```\n")
    assert blocks[1].program == "x = 1\n\ny = x\n" and blocks[1].all_needs == ["numpy"]
    # Errors name the page; a page's first block continues nothing of another page.
    with pytest.raises(ValueError, match=r"^docs/x\.md:2: 'continues' takes no argument"):
        readme_blocks("text\n<!-- continues: x -->\n```python\nx = 1\n```\n", "docs/x.md")
    first = readme_blocks("<!-- continues -->\n```python\nx = 1\n```\n", "docs/x.md")[0]
    assert first.continues and first.previous is None and first.program == "x = 1\n"


@pytest.mark.parametrize("block", RUN, ids=[f"{b.page}:{b.line}" for b in RUN])
def test_python_block_runs_as_pasted(block: Block, tmp_path: Path) -> None:
    missing = [name for name in block.all_needs if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{block.page}:{block.line} needs {', '.join(missing)}, not installed here")
    script = tmp_path / "block.py"
    script.write_text(block.program)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"{block.page}:{block.line} failed (exit status {result.returncode}):\n{block.program}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}"
    )


# ---------------------------------------------------------------------------
# Links: the README links every page of docs/, and every link resolves
# ---------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a `# comment` there is no heading)."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.M | re.S)


def _links(page: Path) -> list[str]:
    """The targets of the Markdown links of `page`, outside code blocks."""
    return _LINK.findall(_prose(page.read_text()))


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives `page`'s headings: lower case, punctuation
    other than '-' and '_' dropped, spaces as '-'."""
    headings = re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_anchor_rule_is_githubs() -> None:
    page = DOCS / "design.md"
    assert "semantics-decided-each-one-is-tested" in _anchors(page)
    assert "layers-data-flows-down-calls-never-go-up" in _anchors(page)


def test_readme_links_every_docs_page() -> None:
    linked = {target.split("#")[0] for target in _links(README) if target.startswith("docs/")}
    pages = {_name(page) for page in PAGES[1:]}
    assert pages - linked == set(), f"the README does not link {sorted(pages - linked)}"
    assert linked - pages == set(), f"the README links missing pages {sorted(linked - pages)}"


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_every_link_resolves(page: Path) -> None:
    """Each relative link of a page names a file or folder of this repository
    (never one outside it, such as ../shared), and each #anchor a heading of
    the page it points to."""
    text = page.read_text()
    assert "../shared" not in text and "/work/shared" not in text, f"{_name(page)} points outside the repository"
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{_name(page)}: {target} leaves the repository"
        assert resolved.exists(), f"{_name(page)}: {target} does not exist"
        if anchor:
            assert resolved.suffix == ".md" and anchor in _anchors(resolved), (
                f"{_name(page)}: {target}: no heading of {_name(resolved)} has the anchor #{anchor}"
            )


def test_readme_is_a_page_a_newcomer_finishes() -> None:
    assert len(README.read_text().splitlines()) <= 300


# ---------------------------------------------------------------------------
# The reference: every public name and option, with its default
# ---------------------------------------------------------------------------


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _section(page: Path, title: str) -> str:
    """The section `## title` of `page`, up to the next heading."""
    text = page.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n#", start + 1)
    return text[start : end if end >= 0 else len(text)]


def signature_text(name: str, fn: Callable[..., Any], drop_self: bool = False) -> str:
    """``name(a, b=1, *, c=None)`` as the docs write it: each default by its repr."""
    parts: list[str] = []
    star = False
    params = list(inspect.signature(fn).parameters.values())
    if drop_self:
        params = params[1:]
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"{name}({', '.join(parts)})"


def test_every_public_name_is_in_the_reference() -> None:
    assert "`dpcore.DataParallel(" in _section(README, "Options")
    reference = _section(REFERENCE, "Other public names")
    for name in dpcore.__all__:
        if name == "DataParallel":  # the README's options table, and docs/reference.md's Methods
            continue
        assert re.search(rf"`dpcore\.{re.escape(name)}[`(.]", reference), f"docs/reference.md lacks dpcore.{name}"
    for name in dpcore.comm.__all__:
        assert f"`dpcore.comm.{name}(" in reference, f"docs/reference.md lacks dpcore.comm.{name}"


def _public_functions() -> list[tuple[str, Callable[..., Any]]]:
    functions = [(f"dpcore.comm.{n}", getattr(dpcore.comm, n)) for n in dpcore.comm.__all__]
    for name in dpcore.__all__:
        value = getattr(dpcore, name)
        if inspect.isfunction(value) or value is dpcore.Broadcast:
            functions.append((f"dpcore.{name}", value))
    return functions


@pytest.mark.parametrize("name, fn", _public_functions(), ids=[n for n, _ in _public_functions()])
def test_reference_gives_every_function_with_its_defaults(name: str, fn: Callable[..., Any]) -> None:
    """A new argument, or a changed default, must reach docs/reference.md."""
    text = signature_text(name, fn)
    assert f"`{text}`" in _flat(_section(REFERENCE, "Other public names")), f"docs/reference.md lacks `{text}`"


def test_options_table_has_every_dataparallel_option_with_its_default() -> None:
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| .* \|$", _section(README, "Options"), flags=re.M)
    documented = dict(rows)
    params = list(inspect.signature(dpcore.DataParallel.__init__).parameters.values())[1:]
    assert [name for name, _ in rows] == [p.name for p in params]
    for p in params:
        if p.default is p.empty:
            assert documented[p.name] == "(required)", p.name
        else:
            assert documented[p.name].startswith(f"`{p.default!r}`"), (
                f"README: {p.name}'s default is {p.default!r}, the table says {documented[p.name]}"
            )


def test_options_table_cells_are_one_line() -> None:
    """Each option's row is one table line whose cells are short: the rules
    live on the pages the row links to."""
    for line in _section(README, "Options").splitlines():
        if line.startswith("| `"):
            assert len(line) <= 200, f"README's options table: a long row: {line}"


def test_reference_names_the_wrappers_own_methods() -> None:
    """The methods DataParallel adds to torch's (and Joinable's) are documented."""
    inherited = set(dir(torch.nn.DataParallel)) | set(dir(Joinable))
    own = [n for n in dir(dpcore.DataParallel) if not n.startswith("_") and n not in inherited]
    assert {"no_sync", "mark_parameters_changed", "join"} <= set(own)
    reference = _flat(_section(REFERENCE, "Methods"))
    for name in own:
        if name == "src_device_obj":  # torch's attribute (a property torch's class sets in __init__)
            continue
        assert f"`{name}" in reference, f"docs/reference.md's Methods lacks DataParallel.{name}"
    join = signature_text("join", dpcore.DataParallel.join, drop_self=True)
    assert f"`{join}`" in reference


# ---------------------------------------------------------------------------
# Command synopses: every visible flag of every command line
# ---------------------------------------------------------------------------


class _Captured(Exception):
    pass


def _parser_of(main: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser a command's main() builds, taken at parse_args, before it runs anything."""
    captured: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        captured.append(self)
        raise _Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Captured):
        main([])
    return captured[0]


def _commands() -> dict[str, Callable[..., Any]]:
    from dpcore.bench import __main__ as bench_all
    from dpcore.bench import comm, distributed, generate, kernels, optimizer, soak, step, targets
    from test_demo import demo  # examples/digits.py

    return {
        "python examples/digits.py": demo.main,
        "python -m dpcore.bench": bench_all.main,
        "python bench/bench_comm.py": comm.main,
        "python bench/bench_kernels.py": kernels.main,
        "python bench/bench_step.py": step.main,
        "python bench/bench_optimizer.py": optimizer.main,
        "python bench/bench_distributed.py": distributed.main,
        "python bench/bench_targets.py": targets.main,
        "python bench/soak.py": soak.main,
        "python bench/bench_generate.py": generate.main,
    }


def _synopsis(command: str) -> str:
    """The synopsis of `command`: a line of a ```bash block of the README or
    of a docs page that starts with it and lists options in brackets, with
    its continuation lines."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith(command + " ") and "[--" in line:
                synopsis = [line]
                for rest in lines[i + 1 :]:
                    if not rest.startswith(" ") or not rest.strip().startswith("["):
                        break
                    synopsis.append(rest)
                return " ".join(synopsis)
    raise AssertionError(f"neither the README nor docs/ has a synopsis of {command}")


@pytest.mark.parametrize("command", list(_commands()))
def test_synopsis_lists_every_flag(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _parser_of(_commands()[command], monkeypatch)
    flags = {
        option
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    listed = set(re.findall(r"\[(--[a-z][a-z0-9-]*)", _synopsis(command)))
    assert listed == flags, f"{command}: the docs list {sorted(listed)}, the parser has {sorted(flags)}"


# ---------------------------------------------------------------------------
# docs/design.md's layer map names every module
# ---------------------------------------------------------------------------


def _layer_map() -> str:
    text = (DOCS / "design.md").read_text()
    return text[text.index("## Layers") : text.index("\n## ", text.index("## Layers") + 1)]


def test_design_layer_map_names_every_source_file() -> None:
    """Each Python module of dpcore/ and each C++/CUDA file of csrc/ is named
    in docs/design.md's layer map (a .cpp or .cu by itself or by its header)."""
    layer_map = _layer_map()
    files = sorted(
        p
        for p in [*(ROOT / "dpcore").rglob("*.py"), *(ROOT / "csrc").rglob("*")]
        if p.is_file() and p.suffix in {".py", ".h", ".cpp", ".cu", ".cuh"} and "__pycache__" not in p.parts
    )
    assert len(files) > 40

    def named(name: str) -> bool:
        return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", layer_map) is not None

    missing = [
        str(p.relative_to(ROOT))
        for p in files
        if not (named(p.name) or (p.suffix in {".cpp", ".cu"} and named(p.stem + ".h")))
    ]
    assert missing == [], f"docs/design.md's layer map does not name {missing}"


# ---------------------------------------------------------------------------
# Measured figures come from committed records
# ---------------------------------------------------------------------------


def test_measured_figures_cite_committed_records() -> None:
    """Every record docs/measured.md's "Recorded figures" names exists under
    bench/results/cpu/, and each JSON says when, on what and under what load."""
    import json

    section = _section(MEASURED, "Recorded figures")
    cited = set(re.findall(r"`(\w+(?:-\d+)?\.(?:json|txt))`", section))
    assert {"comm.json", "kernels.json", "step.json", "demo.txt", "distributed.json", "soak.json"} <= cited
    results = ROOT / "bench" / "results" / "cpu"
    for name in sorted(cited):
        assert (results / name).is_file(), f"docs/measured.md cites {name}, which bench/results/cpu/ lacks"
        if name.endswith(".json"):
            env = json.loads((results / name).read_text())["env"]
            assert {"date", "load_average", "cpus", "torch", "machine"} <= env.keys(), name
    from dpcore.bench._common import environment

    env = environment()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", env["date"]) and env["cpus"] >= 1
    assert len(env["load_average"]) == 3


def test_measured_figures_are_quoted_only_in_measured_md() -> None:
    """A figure from a benchmark is quoted once, in docs/measured.md: no other
    page cites a record of bench/results/."""
    records = {p.name for p in (ROOT / "bench" / "results" / "cpu").iterdir()}
    for page in PAGES:
        if page != MEASURED:
            quoted = {name for name in records if f"`{name}`" in page.read_text()}
            assert quoted == set(), f"{_name(page)} quotes {sorted(quoted)}: quote them in docs/measured.md"
