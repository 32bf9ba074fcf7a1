"""Write the student notebooks: every notebook of notebooks/ with each solution removed.

A solution lives in a code cell tagged ``solution``, between a ``# BEGIN SOLUTION`` and
a ``# END SOLUTION`` line; the student version keeps the cell (its function's ``def``
line and the check under it, its ``assert`` dropped) and puts ``raise
NotImplementedError`` in place of the lines between, at their indentation, so each
exercise cell still runs, its checker answers "not yet: rank 0 raised
NotImplementedError", and the notebook runs on past it. Outputs are cleared, so no
answer shows. ``make student`` writes them to student/ (or: --out FOLDER).
"""

from __future__ import annotations

import argparse
import pathlib
import re

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
STUB = 'raise NotImplementedError("your code here")'


def strip_solution(source: str) -> str:
    """``source`` with each BEGIN..END SOLUTION region replaced by the stub."""
    out, inside = [], False
    for line in source.splitlines():
        mark = line.strip()
        if mark == BEGIN:
            if inside:
                raise ValueError("a BEGIN SOLUTION inside another")
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + STUB)
        elif mark == END:
            if not inside:
                raise ValueError("an END SOLUTION without its BEGIN")
            inside = False
        elif not inside:
            # the solution asserts its pass (CI runs it); the learner's cell just answers
            out.append(re.sub(r"^assert (nbpar\.exercises\.check\()", r"\1", line))
    if inside:
        raise ValueError("a BEGIN SOLUTION without its END")
    return "\n".join(out)


def student_notebook(nb):
    """A copy of ``nb`` without solutions or outputs."""
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "solution" in cell.metadata.get("tags", []):
            cell.source = strip_solution(cell.source)
        elif BEGIN in cell.source:
            raise ValueError(f"a cell holds {BEGIN!r} but is not tagged solution")
        cell.outputs, cell.execution_count = [], None
    return nb


def exercises(nb) -> list[str]:
    """The exercise names the solution cells of ``nb`` check, in order."""
    names = []
    for cell in nb.cells:
        if "solution" in cell.get("metadata", {}).get("tags", []):
            names += re.findall(r"exercises\.check\(\s*\"(\w+)\"", cell.source)
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "student"), help="folder to write to")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = student_notebook(nbformat.read(path, as_version=4))
        nbformat.write(nb, out / path.name)
        print(f"{out / path.name}: {len(exercises(nbformat.read(path, as_version=4)))} exercise(s)")


if __name__ == "__main__":
    main()
