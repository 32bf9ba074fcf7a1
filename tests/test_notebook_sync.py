"""Each notebook and its jupytext source (notebooks/src/*.py) hold the same cells.

The notebooks are paired with percent-format scripts (`jupytext --sync`, `make notebooks`):
the script is what diffs and reviews read, the .ipynb is what nbval checks. These tests
start no kernel: every source parses as Python, is exactly what jupytext writes for its
notebook, and has the notebook's cells (type, source, tags), so an edit made on one side
only fails here instead of being lost at the next sync.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import shutil
import sys

import jupytext
import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
FORMATS = "ipynb,src//py:percent"


def source_of(notebook: pathlib.Path) -> pathlib.Path:
    """The paired script of notebooks/NAME.ipynb: notebooks/src/NAME.py."""
    return notebook.parent / "src" / f"{notebook.stem}.py"


def cells(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    """What must agree between the two sides: type, source and tags of every cell."""
    return [(c.cell_type, c.source, tuple(c.metadata.get("tags", ()))) for c in nb.cells]


def mismatches(notebook: pathlib.Path) -> list[str]:
    """How a notebook and its source differ, one line per cell (empty when in step)."""
    ours = cells(nbformat.read(notebook, as_version=4))
    theirs = cells(jupytext.read(source_of(notebook)))
    found = [
        f"cell {i}: notebook {a!r} != source {b!r}"
        for i, (a, b) in enumerate(zip(ours, theirs))
        if a != b
    ]
    if len(ours) != len(theirs):
        found.append(f"{len(ours)} cells in the notebook, {len(theirs)} in the source")
    return found


def test_every_notebook_has_a_source():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    sources = sorted((NOTEBOOK_DIR / "src").glob("*.py"))
    assert [source_of(nb) for nb in NOTEBOOKS] == sources


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_source_parses_as_python(notebook):
    source = source_of(notebook)
    ast.parse(source.read_text(encoding="utf-8"), filename=str(source))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_and_has_a_kernel(notebook):
    meta = nbformat.read(notebook, as_version=4).metadata
    assert meta.get("jupytext", {}).get("formats") == FORMATS
    # without a kernelspec JupyterLab opens a kernel chooser (breaks tests/browser)
    assert meta.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_source_cells_equal_notebook_cells(notebook):
    assert mismatches(notebook) == [], (
        f"{notebook.name} and src/{notebook.stem}.py differ; run `make notebooks` "
        "(jupytext --sync keeps the side edited last)"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_source_is_what_jupytext_writes(notebook):
    """Byte for byte, so a sync never rewrites a source that is already in step."""
    written = jupytext.writes(nbformat.read(notebook, as_version=4), fmt="py:percent")
    assert written == source_of(notebook).read_text(encoding="utf-8")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_raises_exception_cells_are_tagged(notebook):
    """nbval reads the comment; executing the notebook needs the tag to run past the error."""
    for i, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        if "NBVAL_RAISES_EXCEPTION" in cell.source:
            assert "raises-exception" in cell.metadata.get("tags", []), f"cell {i}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_nbval_markers_stand_alone_on_their_line(notebook):
    """nbval reads a marker only when the comment is the marker and nothing else: with a
    reason after it on the same line the cell is silently compared after all."""
    from nbval.plugin import comment_markers

    for i, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        for line in cell.source.splitlines():
            if "NBVAL_" in line and line.lstrip().startswith("#"):
                assert line.lstrip("#").strip() in comment_markers, f"cell {i}: {line!r}"


#: where a machine's own paths start: a stored output holding one says whose machine
#: ran it (and what its tracebacks were), and differs on the next one
MACHINE_PATH = re.compile(r"(?<![\w.])(/(work|root|home|tmp|Users|opt|usr|var)/|[A-Z]:\\)")


def _stored_texts(notebook):
    """(cell index, text) for every stored output's text (images left out)."""
    for i, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        for out in cell.get("outputs", []):
            parts = [out.get("text", ""), out.get("evalue", ""), *out.get("traceback", [])]
            for kind, data in out.get("data", {}).items():
                if not kind.startswith("image/"):
                    parts.append(data if isinstance(data, str) else json.dumps(data))
            yield i, "\n".join(parts)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_output_holds_a_path_of_the_machine_that_ran_it(notebook):
    here = [str(NOTEBOOK_DIR.parent), str(pathlib.Path.home()), sys.prefix]
    for i, text in _stored_texts(notebook):
        m = MACHINE_PATH.search(text)
        assert m is None, f"cell {i}: {text[max(0, m.start() - 60) : m.end() + 60]!r}"
        assert not [p for p in here if p in text], f"cell {i} holds a path of this machine"


def test_the_path_check_catches_a_traceback_path(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1/0")
    cell.outputs = [
        nbformat.v4.new_output(
            "error",
            ename="ZeroDivisionError",
            evalue="division by zero",
            traceback=['File "/work/main/nbpar/pool/pool.py", line 3'],
        )
    ]
    nb.cells.append(cell)
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, path)
    [(_, text)] = list(_stored_texts(path))
    assert MACHINE_PATH.search(text)


def _copy(notebook: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    (root / "src").mkdir()
    shutil.copy(source_of(notebook), root / "src")
    return pathlib.Path(shutil.copy(notebook, root))


def test_check_fails_on_an_edited_source(tmp_path):
    copy = _copy(NOTEBOOKS[0], tmp_path)
    text = source_of(copy).read_text(encoding="utf-8")
    source_of(copy).write_text(
        text.replace("import nbpar\n", "import nbpar  # edited\n", 1), encoding="utf-8"
    )
    found = mismatches(copy)
    assert len(found) == 1 and "# edited" in found[0], found


def test_check_fails_on_an_edited_notebook(tmp_path):
    copy = _copy(NOTEBOOKS[0], tmp_path)
    nb = nbformat.read(copy, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    nb.cells[code[-1]].source += "\nprint('edited')"
    nb.cells.append(nbformat.v4.new_markdown_cell("a cell only the notebook has"))
    nbformat.write(nb, copy)
    found = mismatches(copy)
    assert found[0].startswith(f"cell {code[-1]}:") and "edited" in found[0], found
    assert "cells in the notebook" in found[-1], found
