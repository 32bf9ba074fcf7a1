"""The README and docs/ say only what the code does (no pools, no processes).

Every `nbpar` command in their shell code blocks (and in the README's inline code) parses
against the real command line, with JSON where JSON is asked for; every `make` target
they name is one the Makefile has; every extra in a `pip install '.[...]'` is one
pyproject.toml defines; every path a command names exists; every relative link and
anchor resolves; the README links each notebook, and its `nbpar estimate` prints what
the README shows.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from nbpar.cli import build_parser
from nbpar.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
NOT_SHELL = {"python", "py", "json", "text", "yaml", "toml"}
INLINE = re.compile(r"`([^`]+)`")  # a code span may wrap onto the next line
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: Prefixes a command may carry in the docs before the program's name.
PREFIXES = (".venv/bin/", "$ ")
PATHLIKE = re.compile(r"^(benchmarks|scripts|notebooks|tests|docs)/[\w./-]+$")


def shell_commands(text: str) -> list[str]:
    """Each command of the shell (or unlabelled) fenced blocks, `\\` continuations joined."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang in NOT_SHELL:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            for prefix in PREFIXES:
                line = line.removeprefix(prefix)
            if line:
                out.append(line)
    return out


def inline_commands(text: str) -> list[str]:
    """Inline code outside fenced blocks that is an nbpar, make or pip command."""
    prose = FENCE.sub("", text)
    found = [" ".join(c.split()) for c in INLINE.findall(prose)]
    return [c for c in found if c.startswith(("nbpar ", "make ", ".venv/bin/", "pip install "))]


def make_targets(makefile: Path = ROOT / "Makefile") -> set[str]:
    """The targets the Makefile defines (rules, not variable assignments)."""
    targets = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([\w.\- ]+?)\s*:(?![:=])", line)
        if m and not line.startswith(("\t", "#")):
            targets.update(w for w in m.group(1).split() if not w.startswith("."))
    return targets


def extras(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    return set(tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"])


def nbpar_problem(argv: list[str]) -> str | None:
    """Why ``nbpar ARGV`` would not parse, or None; JSON flags must hold JSON objects."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except UsageError as err:
        return str(err)
    except SystemExit as err:  # --help
        return None if err.code == 0 else f"exit {err.code}"
    config = getattr(args, "model_config", None)
    if config is not None:
        try:
            if not isinstance(json.loads(config), dict):
                return f"--model-config {config!r} is not a JSON object"
        except json.JSONDecodeError as err:
            return f"--model-config {config!r} is not JSON: {err}"
    return None


def problems(commands: list[str], targets: set[str], known_extras: set[str]) -> list[str]:
    """What is wrong with each command: a flag nbpar refuses, a make target the Makefile
    lacks, an extra pyproject.toml lacks, a path that does not exist."""
    found = []
    for command in commands:
        try:
            words = shlex.split(command, comments=True)
        except ValueError as err:
            found.append(f"{command!r}: {err}")
            continue
        if not words:
            continue
        name = Path(words[0]).name
        if name == "nbpar" or words[:3] == ["python", "-m", "nbpar"]:
            argv = words[3:] if name == "python" else words[1:]
            why = nbpar_problem(argv)
            if why:
                found.append(f"{command!r}: {why}")
        elif name == "make":
            for word in words[1:]:
                if "=" not in word and not word.startswith("-") and word not in targets:
                    found.append(f"{command!r}: the Makefile has no target {word!r}")
        elif name.startswith("pip") and "install" in words:
            for word in words:
                m = re.fullmatch(r"\.\[([\w,-]+)\]", word)
                for extra in m.group(1).split(",") if m else ():
                    if extra not in known_extras:
                        found.append(f"{command!r}: pyproject.toml has no extra {extra!r}")
        for word in words[1:]:
            if PATHLIKE.match(word) and not (ROOT / word).exists():
                found.append(f"{command!r}: {word} does not exist")
    return found


def slug(heading: str) -> str:
    """The anchor a markdown heading gets: lower case, punctuation dropped, '-' for ' '."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def link_problems(page: Path) -> list[str]:
    """Relative links of ``page`` whose file or anchor does not exist."""
    found = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            found.append(f"{page.name}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{page.name}: link to {target}: no such heading")
    return found


def page_commands(page: Path) -> list[str]:
    text = page.read_text()
    return shell_commands(text) + (inline_commands(text) if page == README else [])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_in_the_docs_parses(page):
    commands = page_commands(page)
    assert problems(commands, make_targets(), extras()) == []


def test_the_readme_shows_the_commands_newcomers_start_with():
    commands = page_commands(README)
    nbpar = [c for c in commands if c.startswith("nbpar ")]
    assert any(c.startswith("nbpar estimate ") for c in nbpar)
    assert any(c.startswith("nbpar simulate ") and "--what-fits" in c for c in nbpar)
    assert any("pip install -e '.[lab]'" in c for c in commands)
    assert {"setup", "demo", "lab"} <= {c.split()[1] for c in commands if c.startswith("make ")}


def test_the_readmes_estimate_prints_what_the_readme_shows(capsys):
    """The "Will it fit?" answer is the command's real output (it is arithmetic: cheap)."""
    from nbpar.cli import main

    blocks = FENCE.findall(README.read_text())
    at = next(i for i, (_, body) in enumerate(blocks) if body.startswith("nbpar estimate "))
    assert blocks[at + 1][0] == "text"
    assert main(shlex.split(blocks[at][1])[1:]) == 0
    assert capsys.readouterr().out == blocks[at + 1][1]


def test_a_wrong_command_is_caught():
    """The checks can fail: a typo'd flag, an unknown subcommand, an elided config, a
    make target or extra that does not exist, a missing script."""
    text = """
```sh
nbpar estimate --params 13e9 --world-size 8 --stratgy zero3
nbpar simluate --world-size 8
nbpar simulate --world-size 8 --model-config '{...}'
nbpar simulate --world-size 8 \\
  --strategy zero4
make tset
pip install -e '.[lab,gpu]'
.venv/bin/python benchmarks/no_such_benchmark.py
```
```python
nbpar estimate --not-a-shell-block
```
"""
    found = problems(shell_commands(text), make_targets(), extras())
    assert len(found) == 7, found
    for words in ("--stratgy", "simluate", "not JSON", "zero4", "'tset'", "'gpu'", "no_such"):
        assert any(words in f for f in found), (words, found)
    good = "```sh\nnbpar estimate --params 13e9 --world-size 8 --json\nmake test-fast\n```\n"
    assert problems(shell_commands(good), make_targets(), extras()) == []


def test_the_makefile_targets_are_read_as_make_sees_them():
    targets = make_targets()
    assert {"setup", "test", "lint", "test-fast", "test-unit", "test-notebooks"} <= targets
    assert {"test-browser", "notebooks", "demo", "lab", "bench-results", "bench-report"} <= targets
    assert not {"PY", "PYTHON", "VENV", "export", "PHONY"} & targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert link_problems(page) == []


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#no-such) [file](missing.md)\n")
    assert link_problems(page) == [
        "page.md: link to #no-such: no such heading",
        "page.md: link to missing.md: no such file",
    ]


def test_the_readme_links_every_notebook():
    text = README.read_text()
    linked = set(re.findall(r"\]\((notebooks/\d\d_\w+\.ipynb)\)", text))
    on_disk = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert on_disk and linked == on_disk


def test_the_readme_fits_one_screen_per_reader():
    lines = README.read_text().splitlines()
    assert len(lines) < 300
    top = "\n".join(lines[:60])
    # each reader's first action is in the first 60 lines
    assert "pip install -e '.[lab]'" in top and "jupyter lab notebooks/00_quickstart" in top
    assert "(#the-notebooks)" in top and "(#status)" in top
    assert "nbpar estimate --params 13e9 --world-size 8" in top
