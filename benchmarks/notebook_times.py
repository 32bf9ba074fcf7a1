"""How long each workshop notebook takes top to bottom, on this machine.

    python benchmarks/notebook_times.py [--repeats 1] [notebooks/03_pipeline.ipynb ...]

Each notebook is executed in a fresh kernel, as `make test-notebooks` runs it, from the
notebooks folder and without writing its outputs back; the figure is the wall-clock
seconds from the kernel's start to the last cell's end. Workshop rooms have laptops, so
the target is the one the notebooks promise: under 2 minutes each on 2 cores.

Writes results/notebook_times.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ExecutePreprocessor
from results import Recorder

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LIMIT_S = 120


def run_once(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    ExecutePreprocessor(timeout=300).preprocess(nb, {"metadata": {"path": str(path.parent)}})
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    rec = Recorder(
        "notebook_times",
        "seconds per workshop notebook, top to bottom in a fresh kernel",
        __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0],
        repeats=args.repeats,
        measures=["notebooks", "nbpar", "benchmarks/notebook_times.py"],
        config={"notebooks": [p.name for p in paths]},
        notes="one figure per notebook; the pools they start are part of the time",
    )
    for path in paths:
        seconds = []
        for i in range(args.repeats):
            seconds.append(run_once(path))
            rec.row(notebook=path.stem, repeat=i, seconds=round(seconds[-1], 2))
            print(f"{path.stem}: {seconds[-1]:.1f} s", flush=True)
        rec.figure(path.stem, seconds, "s", f"< {LIMIT_S}", 3)
    rec.save()


if __name__ == "__main__":
    main()
