"""environment.yml installs what every notebook imports or needs (no pools, no processes).

The notebooks' code cells are read as Python (magics left out); each top-level module they
import, other than nbpar itself and the standard library, is mapped to the distribution
that provides it, and so is each nbpar feature they use that needs an optional package
(``"hf:..."`` models need transformers, ...). Each must be installed by environment.yml:
listed in it, required by an nbpar extra it installs (read from pyproject.toml), installed
by the DeepSpeed line its header documents, or required by any of those in turn (read from
the installed packages' metadata). The README's notebook table says the same: what each
notebook needs beyond ``pip install -e '.[lab]'``.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENT = ROOT / "environment.yml"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
#: Modules whose distribution has another name (when it is not installed here to ask).
MODULE_DIST = {
    "IPython": "ipython",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "yaml": "pyyaml",
    "cv2": "opencv-python",
    "skimage": "scikit-image",
    "google.protobuf": "protobuf",
}
#: What a notebook's code uses of nbpar that needs an optional package, found as text.
FEATURE_DIST = {
    '"hf:': "transformers",
    'backend="deepspeed"': "deepspeed",
    "deepspeed_config=": "deepspeed",
    "write_hdf5(": "h5py",
    "HDF5Dataset(": "h5py",
    "PrometheusExporter(": "prometheus-client",
    "to_tensorboard(": "tensorboard",
}
#: What every notebook needs to be opened and run at all.
ALWAYS = {"jupyterlab", "ipykernel"}
#: The one package installed after the environment, documented in its header.
AFTERWARDS = re.compile(r"pip install --no-build-isolation ([\w-]+)==[\w.]+")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """'torch==2.13.0' -> 'torch'; 'scikit-learn>=1.4; python_version>"3"' -> 'scikit-learn'."""
    return canonical(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def code_cells(notebook: dict) -> list[str]:
    """Each code cell's source with IPython magics and shell lines left out."""
    out = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        out.append("\n".join(lines))
    return out


def imported_modules(notebook: dict) -> set[str]:
    """Top-level names of the modules a notebook imports, less nbpar and the stdlib."""
    found = set()
    for source in code_cells(notebook):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
    tops = set()
    for name in found:
        top = name.split(".")[0]
        if top == "nbpar" or top in sys.stdlib_module_names or top == "__future__":
            continue
        tops.add(name if name in MODULE_DIST else top)
    return tops


@functools.cache
def _providers() -> dict[str, list[str]]:
    return md.packages_distributions()


def distribution_of(module: str) -> str:
    if module in MODULE_DIST:
        return MODULE_DIST[module]
    provided = _providers().get(module.split(".")[0])
    return canonical(provided[0]) if provided else canonical(module)


def needed(notebook: dict) -> set[str]:
    """The distributions a notebook needs: what it imports, what its nbpar features use."""
    text = "\n".join(code_cells(notebook))
    features = {dist for marker, dist in FEATURE_DIST.items() if marker in text}
    return ALWAYS | features | {distribution_of(m) for m in imported_modules(notebook)}


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def listed(environment_text: str) -> set[str]:
    """The distributions environment.yml names: conda packages, pip entries, the project
    and its extras (from pyproject.toml), and the package its header says to add after."""
    yaml = pytest.importorskip("yaml")
    env = yaml.safe_load(environment_text)
    project = pyproject()
    names, pip = set(), []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip += dep.get("pip", [])
        else:
            names.add(requirement_name(dep))
    for entry in pip:
        if entry.startswith("--"):
            continue  # an option (an index URL)
        local = re.fullmatch(r"(?:-e\s+)?\.(?:\[([\w,\s-]+)\])?", entry.strip())
        if local is None:
            names.add(requirement_name(entry))
            continue
        names.add("nbpar")
        names.update(requirement_name(r) for r in project["dependencies"])
        for extra in (local.group(1) or "").split(","):
            if extra.strip():
                extras = project["optional-dependencies"][extra.strip()]
                names.update(requirement_name(r) for r in extras)
    names.update(canonical(n) for n in AFTERWARDS.findall(environment_text))
    return names


def closure(names: set[str]) -> set[str]:
    """``names`` and everything their installed metadata requires, recursively (the
    requirements without an extra marker, as pip installs them here)."""
    from packaging.requirements import Requirement

    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return seen


def missing(notebook: dict, installed: set[str]) -> set[str]:
    return needed(notebook) - installed


@pytest.fixture(scope="module")
def installed():
    return closure(listed(ENVIRONMENT.read_text()))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_environment_yml_installs_what_the_notebook_needs(path, installed):
    notebook = json.loads(path.read_text())
    assert missing(notebook, installed) == set()


def test_the_notebooks_are_all_read():
    assert len(NOTEBOOKS) >= 14
    every = set().union(*(needed(json.loads(p.read_text())) for p in NOTEBOOKS))
    # what the notebooks import, and what they need through nbpar, is really found
    assert {"torch", "matplotlib", "ipython", "wandb", "safetensors"} <= every
    assert {"transformers", "deepspeed", "h5py", "prometheus-client", "tensorboard"} <= every


def test_every_feature_marker_is_used_by_a_notebook():
    """The feature map is about these notebooks: a marker none uses has gone stale."""
    text = "\n".join("\n".join(code_cells(json.loads(p.read_text()))) for p in NOTEBOOKS)
    assert [marker for marker in FEATURE_DIST if marker not in text] == []


def test_deepspeed_is_documented_in_the_file_and_the_readme():
    text = ENVIRONMENT.read_text()
    line = AFTERWARDS.search(text)
    assert line and line.group(1) == "deepspeed"
    assert line.group(0) in (ROOT / "README.md").read_text()
    version = re.search(r"DEEPSPEED_VERSION \?= ([\w.]+)", (ROOT / "Makefile").read_text())
    assert line.group(0).endswith(f"=={version.group(1)}"), "the Makefile pins another one"


def test_a_notebook_needing_what_the_environment_lacks_is_caught(installed):
    cell = {
        "cell_type": "code",
        "source": ["%%dist\n", "import polars as pl\n", "from os import path\n", "import nbpar\n"],
    }
    assert missing({"cells": [cell]}, installed) == {"polars"}
    hf = {"cell_type": "code", "source": ['cfg = nbpar.TrainConfig(model="hf:llama")\n']}
    narrow = closure(listed(ENVIRONMENT.read_text().replace("[lab,monitor,hf,test]", "[lab]")))
    assert missing({"cells": [hf]}, narrow) == {"transformers"}
    assert missing({"cells": [hf]}, installed) == set()
    path = ROOT / "notebooks" / "12b_monitoring_and_export.ipynb"
    lacking = missing(json.loads(path.read_text()), narrow)
    assert {"tensorboard", "wandb", "safetensors"} <= lacking


def extras_needed(notebook: dict) -> set[str]:
    """What a notebook needs beyond ``pip install -e '.[lab]'``: the nbpar extras that
    bring it, and "DeepSpeed" (installed after torch, by its own line)."""
    project = pyproject()
    base = closure(
        {"nbpar"}
        | {requirement_name(r) for r in project["dependencies"]}
        | {requirement_name(r) for r in project["optional-dependencies"]["lab"]}
    )
    by_extra = {
        extra: closure({requirement_name(r) for r in reqs})
        for extra, reqs in project["optional-dependencies"].items()
        if extra not in ("lab", "deepspeed")
    }
    out = set()
    for dist in needed(notebook) - base:
        if dist == "deepspeed":
            out.add("DeepSpeed")
            continue
        extra = next((e for e, dists in by_extra.items() if dist in dists), None)
        out.add(extra or f"no extra has {dist}")
    return out


def readme_needs() -> dict[str, set[str]]:
    """The "needs" column of the README's notebook table, per notebook."""
    out = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"^\| \[(\d\d[a-z]?_\w+)\]\(notebooks/\1\.ipynb\) \|.*\| ([^|]*) \|$", line)
        if m:
            cell = m.group(2)
            extras = {e for group in re.findall(r"`\[([\w,]+)\]`", cell) for e in group.split(",")}
            out[m.group(1)] = extras | ({"DeepSpeed"} if "DeepSpeed" in cell else set())
    return out


def test_the_readme_says_what_each_notebook_needs():
    said = readme_needs()
    assert set(said) == {p.stem for p in NOTEBOOKS}
    found = {p.stem: extras_needed(json.loads(p.read_text())) for p in NOTEBOOKS}
    assert said == found
    assert found["12b_monitoring_and_export"] == {"monitor", "hf", "DeepSpeed"}
    readme = (ROOT / "README.md").read_text()
    plain = sum(not needs for needs in found.values())
    assert f"enough for {plain} of the {len(found)} notebooks" in readme
    others = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    assert f"which extras the other {others[len(found) - plain]} need" in readme
    assert f"all {len(found)} run under nbval" in readme
