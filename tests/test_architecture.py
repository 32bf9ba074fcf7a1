"""The package's shape: no import cycles among nbpar modules (imports inside functions
count too; imports under ``if TYPE_CHECKING:``, for annotations only, do not), so the
data path cell -> pool -> engine -> loop -> strategy -> measurement -> view reads one way.

A package's ``__init__`` is a module like any other: ``from nbpar.parallel import
build_runner`` inside ``nbpar/parallel/ddp.py`` is an edge to ``nbpar.parallel``, and
``nbpar/parallel/__init__.py`` importing its strategies by name (``DISPATCH`` and
``importlib.import_module(f"{__name__}.{name}")``) are edges from it; a cycle through
them breaks as soon as the package imports one strategy at the top. Importing a
submodule (``from . import pipeline``) is an edge to that submodule only, not to the
packages above it. One
exception, `REEXPORT_ONLY`: ``nbpar/__init__.py`` owns no code a submodule can use; it
lazily re-exports the public API from the submodules and delegates ``%load_ext`` to
``nbpar.pool.magics``, so ``import nbpar; nbpar.Pool(...)`` in ``nbpar.pool.magics``
reaches ``nbpar.pool.pool``, not the package. `test_top_level_only_reexports` keeps
that claim true."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Ancestor packages whose __init__ only re-exports its submodules (see the module doc).
REEXPORT_ONLY = {"nbpar"}


def _typing_only(tree: ast.AST) -> set[int]:
    return {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for n in ast.walk(node)
    }


def _dispatched(tree: ast.AST) -> list[str]:
    """Submodule names a package imports by name: the string values of its ``DISPATCH``
    table when it calls ``importlib.import_module(f"{__name__}.{...}")``."""
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("import_module")
    ]
    if not any(ast.unparse(c.args[0]).startswith("f'{__name__}.") for c in calls if c.args):
        return []
    return [
        v.value
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "DISPATCH"
        for v in node.value.values
        if isinstance(v, ast.Constant) and isinstance(v.value, str)
    ]


def import_graph(package: pathlib.Path, reexport_only=REEXPORT_ONLY) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports anywhere in its body."""
    files = {}
    for f in package.rglob("*.py"):
        name = ".".join(f.relative_to(package.parent).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = f
    graph = {m: set() for m in files}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(f.read_text())
        typing_only = _typing_only(tree)
        targets = [f"{mod}.{name}" for name in _dispatched(tree)]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
                # `from base import name`: base itself unless every name is a submodule
                targets += names + ([] if all(n in files for n in names) else [base])
        for t in targets:
            while t and t not in files:
                t = t.rpartition(".")[0]
            if t and t != mod and t not in reexport_only:
                graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_cycles_in_nbpar():
    cycle = find_cycle(import_graph(ROOT / "nbpar"))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_the_cycle_finder_sees_cycles_through_a_package_init(tmp_path):
    """A package that dispatches to a strategy module by name, and the strategy that
    imports a helper back from the package: the cycle this test once missed."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import importlib\n"
        "DISPATCH = {'a': 'strat'}\n"
        "def helper():\n    pass\n"
        "def build(name):\n"
        "    return importlib.import_module(f'{__name__}.{DISPATCH[name]}')\n"
    )
    (pkg / "strat.py").write_text("from pkg import helper\n")
    (pkg / "other.py").write_text("from . import strat\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.strat"}, "pkg.strat": {"pkg"}, "pkg.other": {"pkg.strat"}}
    assert find_cycle(graph) == ["pkg", "pkg.strat", "pkg"]
    (pkg / "strat.py").write_text("from pkg.common import helper\n")
    (pkg / "common.py").write_text("def helper():\n    pass\n")
    assert find_cycle(import_graph(pkg)) == []


def test_the_dispatch_table_is_in_the_graph():
    from nbpar.parallel import DISPATCH

    graph = import_graph(ROOT / "nbpar")
    assert {f"nbpar.parallel.{name}" for name in DISPATCH.values()} <= graph["nbpar.parallel"]


def test_top_level_only_reexports():
    """`REEXPORT_ONLY`'s claim: ``nbpar/__init__.py`` imports nbpar modules only inside
    functions that hand on what they import (imports, then one statement), and its
    lazy table takes every public name from a submodule."""
    tree = ast.parse((ROOT / "nbpar" / "__init__.py").read_text())
    for node in tree.body:
        nbpar_imports = [
            n
            for n in ast.walk(node)
            if isinstance(n, ast.ImportFrom)
            and (n.module or "").startswith("nbpar")
            or isinstance(n, ast.Import)
            and any(a.name.startswith("nbpar") for a in n.names)
        ]
        if not nbpar_imports:
            continue
        assert isinstance(node, ast.FunctionDef), ast.unparse(node)[:80]
        body = node.body[1:] if ast.get_docstring(node) else node.body
        rest = [n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))]
        assert len(rest) == 1 and isinstance(rest[0], (ast.Expr, ast.Return)), node.name
    import nbpar

    assert all(module.startswith("nbpar.") for module, _ in nbpar._LAZY.values())


def test_engine_side_never_imports_the_kernel_side():
    """train/ and parallel/ run inside the engines: they may not reach the pool (which
    drives engines from the kernel) or the view (which draws in the kernel)."""
    graph = import_graph(ROOT / "nbpar")
    wrong = {
        m: sorted(t for t in targets if t.startswith(("nbpar.pool", "nbpar.view")))
        for m, targets in graph.items()
        if m.startswith(("nbpar.train", "nbpar.parallel"))
    }
    assert not {m: t for m, t in wrong.items() if t}


# The layers, bottom up (docs/architecture.md, "Layout"): a module may import its own layer
# and the layers below it, never one above, imports inside functions included. Within a
# layer, `test_no_import_cycles_in_nbpar` keeps the modules acyclic.
LAYERS = (
    ("base", ("nbpar.device", "nbpar.errors", "nbpar.checks", "nbpar.files", "nbpar.hardware")),
    ("model", ("nbpar.model",)),
    ("measure", ("nbpar.measure",)),
    ("strategies", ("nbpar.dims", "nbpar.strategies")),
    ("parallel", ("nbpar.parallel",)),
    (
        "estimate",
        (
            "nbpar.estimate",
            "nbpar.comm_estimate",
            "nbpar.estimate_plot",
            "nbpar.ds_partition",
            "nbpar.project",
            "nbpar.project_comm",
        ),
    ),
    ("config", ("nbpar.config", "nbpar.checkpoint_meta", "nbpar.probe")),
    ("train", ("nbpar.train",)),
    ("simulate", ("nbpar.simulate",)),
    ("view", ("nbpar.view",)),
    ("pool", ("nbpar.pool",)),
    (
        "cli",
        (
            "nbpar.bench",
            "nbpar.cli",
            "nbpar.cli_args",
            "nbpar.cli_compare",
            "nbpar.__main__",
            "nbpar",
        ),
    ),
)


def layer_of(module: str, layers=LAYERS) -> int:
    """Index of the layer that holds ``module`` (the longest matching prefix)."""
    best, found = -1, None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return found


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every edge from a module to a module of a higher layer, as "a -> b"."""
    return sorted(
        f"{a} ({layers[layer_of(a, layers)][0]}) -> {b} ({layers[layer_of(b, layers)][0]})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b, layers) > layer_of(a, layers)
    )


def test_imports_follow_the_layers():
    assert upward_imports(import_graph(ROOT / "nbpar")) == []


def test_every_module_has_a_layer():
    for module in import_graph(ROOT / "nbpar"):
        layer_of(module)


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """A measure module that reaches up into parallel inside a function: caught."""
    pkg = tmp_path / "nbpar"
    (pkg / "measure").mkdir(parents=True)
    (pkg / "parallel").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "measure" / "__init__.py").write_text("")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "runner.py").write_text("from nbpar.measure import meter\n")
    (pkg / "measure" / "meter.py").write_text(
        "def count():\n    from nbpar.parallel.runner import local\n    return local\n"
    )
    graph = import_graph(pkg, reexport_only={"nbpar"})
    assert upward_imports(graph) == [
        "nbpar.measure.meter (measure) -> nbpar.parallel.runner (parallel)"
    ]
    (pkg / "measure" / "meter.py").write_text("def count():\n    return 0\n")
    assert upward_imports(import_graph(pkg, reexport_only={"nbpar"})) == []


def test_the_documented_layout_draws_every_layer_and_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text[text.index("## Layout") :]
    diagram = layout[: layout.index("What each may import")]
    drawn = [line.split()[0] for line in diagram.splitlines() if line[:1] == " " and line.strip()]
    drawn = [word for word in drawn if word.isidentifier()]
    assert drawn == [name for name, _ in reversed(LAYERS)]
    modules = {
        f.name
        for f in (ROOT / "nbpar").rglob("*.py")
        if f.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(m for m in modules if m not in layout) == []


def cuda_literals(root: pathlib.Path) -> list[str]:
    """Every string literal naming 'cuda' in the package outside nbpar/device.py."""
    import io
    import tokenize

    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "device.py":
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type == tokenize.STRING and "cuda" in tok.string:
                found.append(f"{path.relative_to(root)}:{tok.start[0]}")
    return found


def test_only_the_device_module_names_cuda(tmp_path):
    assert cuda_literals(ROOT / "nbpar") == []
    (tmp_path / "device.py").write_text('KIND = "cuda"\n')
    (tmp_path / "loop.py").write_text('where = "cuda:0"  # a device chosen outside device.py\n')
    assert cuda_literals(tmp_path) == ["loop.py:1"]
