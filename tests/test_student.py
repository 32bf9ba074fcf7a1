"""The workbook: exercises spread over the notebooks, their solutions run by nbval, and
the student notebooks `make student` writes (scripts/student.py) with none of them."""

from __future__ import annotations

import importlib.util
import pathlib

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("student", ROOT / "scripts" / "student.py")
student = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(student)


def _solutions(nb):
    return [c for c in nb.cells if "solution" in c.metadata.get("tags", [])]


def test_at_least_twelve_exercises_spread_over_the_notebooks_each_passing():
    from nbpar.exercises import EXERCISES

    seen = {}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for name in student.exercises(nb):
            seen.setdefault(name, path.stem)
        for cell in _solutions(nb):  # the stored output of each solution is its pass
            text = "".join(o.get("text", "") for o in cell.outputs)
            assert ": passed: " in text and ": not yet: " not in text, (path.stem, text)
    assert len(seen) >= 12 and set(seen) == set(EXERCISES), set(EXERCISES) ^ set(seen)
    assert len(set(seen.values())) >= 6  # in six notebooks or more, not one


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_student_notebook_has_no_solution_and_no_output(path):
    nb = nbformat.read(path, as_version=4)
    mine = student.student_notebook(nb)
    assert len(mine.cells) == len(nb.cells)
    for theirs, ours in zip(nb.cells, mine.cells, strict=True):
        if ours.cell_type == "code":
            assert ours.outputs == []
        if "solution" not in theirs.metadata.get("tags", []):
            assert ours.source == theirs.source
            continue
        hidden = theirs.source.split(student.BEGIN)[1].split(student.END)[0]
        body = [x for x in hidden.splitlines()[1:] if x.strip() and not x.strip().startswith("#")]
        assert body and not [x for x in body if x in ours.source.splitlines()], body
        assert student.STUB in ours.source and student.BEGIN not in ours.source
        assert "assert nbpar.exercises.check(" not in ours.source


def test_markers_out_of_place_are_refused():
    with pytest.raises(ValueError, match="without its END"):
        student.strip_solution("def f():\n    # BEGIN SOLUTION\n    return 1\n")
    with pytest.raises(ValueError, match="without its BEGIN"):
        student.strip_solution("# END SOLUTION\n")
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("# BEGIN SOLUTION\nx = 1\n# END SOLUTION"))
    with pytest.raises(ValueError, match="not tagged solution"):
        student.student_notebook(nb)


@pytest.mark.spawn  # a kernel, and the notebook's pool
@pytest.mark.timeout(300)
def test_a_student_notebook_runs_past_its_exercise_which_says_not_yet(tmp_path):
    """`make student`'s notebook 04 top to bottom in a real kernel: every cell runs, and
    the exercise, unsolved, answers 'not yet' with the stub's error."""
    from nbclient import NotebookClient

    student.main(["--out", str(tmp_path)])
    path = tmp_path / "04_tensor_parallel.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    ).execute()
    (cell,) = _solutions(nb)
    text = "".join(o.get("text", "") for o in cell.outputs)
    assert text.startswith(
        "[rank 0] column- and row-parallel linears: not yet: rank 0 raised "
        "NotImplementedError: your code here"
    ), text
