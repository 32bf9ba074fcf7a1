"""docs/multinode.md's GPU-cluster example is the code's: its Pool call is checked the
way Pool checks it, and the batch script it shows is the one nbpar writes for it."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import nbpar
from nbpar.pool import slurm

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "multinode.md"


def _block(marker: str) -> str:
    """The fenced code block right after ``<!-- marker: ... -->``."""
    text = DOC.read_text()
    m = re.search(rf"<!-- {marker}:[^>]*-->\n```\w*\n(.*?)```", text, re.S)
    assert m, f"docs/multinode.md has no code block marked {marker}"
    return m.group(1)


def _pool_call() -> tuple[list, dict]:
    """The positional and keyword arguments of the example's ``nbpar.Pool(...)``."""
    tree = ast.parse(_block("gpu-cluster-pool"))
    assigned = {
        t.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    (call,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "nbpar.Pool"
    ]

    def value(node):
        if isinstance(node, ast.Name):  # a variable of the example, e.g. env=nccl
            return ast.literal_eval(assigned[node.id])
        return ast.literal_eval(node)

    return [value(a) for a in call.args], {k.arg: value(k.value) for k in call.keywords}


def test_the_gpu_cluster_call_uses_pools_own_parameters_and_valid_options():
    args, kwargs = _pool_call()
    known = inspect.signature(nbpar.Pool).parameters
    assert set(kwargs) <= set(known), set(kwargs) - set(known)
    assert kwargs["launcher"] == "slurm" and kwargs["backend"] == "nccl"
    checked = slurm.check_options(kwargs["slurm"], kwargs["launcher"])
    assert checked["extra"] == kwargs["slurm"]["extra"]
    nodes = re.search(r"--nodes=(\d+)", " ".join(checked["extra"])).group(1)
    per_node = re.search(r"--ntasks-per-node=(\d+)", " ".join(checked["extra"])).group(1)
    assert args == [int(nodes) * int(per_node)]  # one engine per GPU of every node
    text = DOC.read_text()
    for name in kwargs["env"]:  # each NCCL variable it sets is explained
        assert f"`{name}" in text.split("The NCCL variables that matter", 1)[1], name


def test_the_script_shown_is_the_one_nbpar_writes_for_that_call():
    _, kwargs = _pool_call()
    options = slurm.check_options(kwargs["slurm"], kwargs["launcher"])
    assert _block("gpu-cluster-script") == slurm.batch_template(options, kwargs["backend"])
