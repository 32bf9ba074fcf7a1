"""The fast lane: which tests start processes, and a guard that fails a fast-lane test
that starts one anyway. A pytest plugin (tests/conftest.py registers it).

Two markers (registered in pyproject.toml) say a test starts processes:

* ``pool``: an engine pool: it uses the ``pool`` fixture, or builds an ``nbpar.Pool`` or
  an ipyparallel ``Cluster`` itself;
* ``spawn``: other processes: gloo workers (``tests.distributed.run_distributed``),
  ``multiprocessing``, ``subprocess`` (python, the nbpar CLI, torchrun, jupyter, ip).

They are set at collection from the test's code: the test function, the fixtures it uses
and the functions and classes of tests/ that these name, followed all the way, so one
helper that spawns marks every test that reaches it. A test that starts processes only
inside nbpar's own code is marked by hand (``@pytest.mark.spawn``).

``make test-fast`` selects ``-m "not pool and not spawn and not slow and not browser"``
(slow: long tests in one process, marked by hand). When a run
selects no test marked pool, spawn or browser, the guard is on for the whole run: starting
a process (subprocess, multiprocessing, os.fork, posix_spawn, system) raises
ProcessStartError, and the test that tried fails even if the code under test swallowed the
error, as does a test that leaves a new child process running. A mis-marked test fails
loudly instead of slowing the lane down. Runs that select process tests are unguarded.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import multiprocessing.process
import os
import pathlib
import platform
import subprocess
import sys
import types

import psutil
import pytest

# names in a test's code (attributes included: nbpar.Pool, ipp.Cluster) that start processes
STARTS = {
    "pool": {"Pool", "Cluster"},
    "spawn": {"run_distributed", "subprocess", "multiprocessing", "ProcessPoolExecutor"},
}
# a function, class or module from these, under any name, starts processes
SPAWN_MODULES = (
    "subprocess",
    "multiprocessing",
    "torch.multiprocessing",
    "concurrent.futures.process",
)
PROCESS_MARKS = ("pool", "spawn", "browser")
TESTS = pathlib.Path(__file__).resolve().parent
GUARDED = pytest.StashKey[bool]()
TRIED = pytest.StashKey[list]()


class ProcessStartError(RuntimeError):
    """A test of the fast lane tried to start a process."""


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            names |= _code_names(const)
    return names


def _module_of(obj) -> str:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    return name if isinstance(name, str) else ""


def _in_tests(obj) -> bool:
    """Defined in tests/, this guard apart."""
    path = getattr(sys.modules.get(_module_of(obj)), "__file__", None)
    if path is None or pathlib.Path(path).resolve() == pathlib.Path(__file__).resolve():
        return False
    return TESTS in pathlib.Path(path).resolve().parents


def process_marks(functions) -> set[str]:
    """The markers (``pool``, ``spawn``) that the code of ``functions`` earns, following
    the functions and classes of tests/ it names."""
    found: set[str] = set()
    seen: set[types.CodeType] = set()
    todo = list(functions)
    while todo:
        fn = inspect.unwrap(todo.pop())
        code = getattr(fn, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        for name in _code_names(code):
            found |= {mark for mark, names in STARTS.items() if name in names}
            obj = fn.__globals__.get(name)
            if obj is None:
                continue
            module = _module_of(obj)
            if any(module == m or module.startswith(m + ".") for m in SPAWN_MODULES):
                found.add("spawn")
            elif inspect.isclass(obj) and _in_tests(obj):
                for v in vars(obj).values():
                    todo.append(getattr(v, "__func__", None) or getattr(v, "fget", None) or v)
            elif inspect.isfunction(obj) and _in_tests(obj):
                todo.append(obj)
    return found


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in info.name2fixturedefs.values() for d in ds] if info else []
        fixtures = [d.func for d in defs if _in_tests(d.func)]
        marks = process_marks([getattr(item, "function", None), *fixtures])
        for mark in sorted(marks - {m.name for m in item.iter_markers()}):
            item.add_marker(mark)


def pytest_collection_finish(session):
    session.config.stash[GUARDED] = not any(
        item.get_closest_marker(mark) for item in session.items for mark in PROCESS_MARKS
    )


@contextlib.contextmanager
def refusing_processes(tried: list):
    """Every way Python starts a process raises ProcessStartError, noted in ``tried``."""

    def refuse(what, argv=None):
        def refused(*args, **kwargs):
            started = f"{what} {args[argv]!r}" if argv is not None else what
            tried.append(started)
            raise ProcessStartError(f"{started}: the fast lane starts no process")

        return refused

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", refuse("subprocess", argv=1))
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                mp.setattr(os, name, refuse(f"os.{name}"))
        yield tried


def _children() -> set[psutil.Process]:
    return set(psutil.Process().children(recursive=True))


@pytest.fixture(scope="session", autouse=True)
def _fast_lane_refuses_processes(request):
    """Session-wide, so that module fixtures are refused too: their tries are charged to
    the test whose set-up ran them."""
    tried = request.config.stash[TRIED] = []
    if not request.config.stash.get(GUARDED, False):
        yield
        return
    # two probes run a process once and keep the answer: platform.processor() (`uname -p`,
    # asked by h5py's import) and matplotlib's font cache (`fc-list`, once per
    # MPLCONFIGDIR); they are set-up, not a test's processes
    platform.processor()
    importlib.import_module("matplotlib.font_manager")
    with refusing_processes(tried):
        yield
    assert not tried, f"processes started after the last test: {tried}"


@pytest.fixture(autouse=True)
def fast_lane_guard(request, _fast_lane_refuses_processes):
    """Fails a test of a guarded run that started (or tried to start) a process."""
    if not request.config.stash.get(GUARDED, False):
        yield
        return
    before = _children()
    yield
    tried, left = request.config.stash[TRIED], _children() - before
    what = list(dict.fromkeys(tried))
    for p in left:
        try:
            what.append(" ".join(p.cmdline()) or str(p.pid))
            p.kill()
        except psutil.Error:  # gone, or a zombie: it was started all the same
            what.append(str(p.pid))
    if what:
        tried.clear()
        pytest.fail(
            f"{request.node.nodeid} is in the fast lane but started a process ({', '.join(what)})"
            ": mark it pool or spawn (tests/lanes.py)",
            pytrace=False,
        )
