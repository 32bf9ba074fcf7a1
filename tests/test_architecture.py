"""The package's shape: no import cycles among nbpar modules (imports inside functions
count too; imports under ``if TYPE_CHECKING:``, for annotations only, do not), so the
data path cell -> pool -> engine -> loop -> strategy -> measurement -> view reads one way."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """module -> the nbpar modules it imports anywhere in its body."""
    files = {}
    for f in package.rglob("*.py"):
        name = ".".join(f.relative_to(package.parent).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = f
    graph = {m: set() for m in files}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(f.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):
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


def test_old_module_paths_still_import():
    """In a fresh interpreter: an old import binds the old name as an attribute of the
    package, which would shadow ``nbpar.compare`` (the function) in this one."""
    import subprocess
    import sys

    code = (
        "import importlib, nbpar\n"
        "for old, new in nbpar.MOVED.items():\n"
        "    assert importlib.import_module('nbpar.' + old) is "
        "importlib.import_module('nbpar.' + new), old\n"
        "print(len(nbpar.MOVED))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 20
