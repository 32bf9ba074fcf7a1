"""A workshop notebook on a one-GPU machine (#29: the policy's code path, on the CPU):
notebook 00 run top to bottom in a real kernel whose nbpar sees one GPU. `Pool(2)` there
starts CPU engines on gloo and says so in one line, and every cell runs as on a laptop."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
ONE_GPU = """\
import torch
import nbpar.device
torch.cuda.is_available = lambda: True  # one GPU, as the client kernel sees it
torch.cuda.device_count = lambda: 1
nbpar.device.accelerator_count = lambda: 1
assert nbpar.device.default_backend() == "nccl"
"""
NOTE = "2 engines on 1 GPU(s): CPU engines on gloo"


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", ""))
        out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


@pytest.mark.spawn
@pytest.mark.timeout(600)
def test_notebook_00_runs_to_its_end_on_a_one_gpu_machine():
    nb = nbformat.read(ROOT / "notebooks" / "00_quickstart.ipynb", as_version=4)
    cells = len(nb.cells)
    nb.cells.insert(0, nbformat.v4.new_code_cell(ONE_GPU))
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    )
    client.execute()  # raises CellExecutionError at the first cell that fails
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(nb.cells) == cells + 1 and all(c.get("execution_count") for c in code)
    said = [c for c in code if NOTE in _text(c)]
    assert len(said) == 1, "the one-GPU policy's line, once, where the pool starts"
    assert "nbpar.Pool(" in said[0].source
