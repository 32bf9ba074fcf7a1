"""The fast lane (tests/lanes.py): its guard fails a test that starts a process, even one
whose code under test swallows the refusal, and the pool/spawn markers follow a test's
helpers. Pytest runs inside pytest here (pytester, in this process: nothing is started)."""

from __future__ import annotations

# the inner runs' guard imports matplotlib; pytester forgets the modules an inner run
# imported first, and numpy cannot be imported twice in one process
import matplotlib.font_manager  # noqa: F401
import pytest

from tests import lanes

FAST = ("-p", "tests.lanes", "-p", "no:cacheprovider", "-m", "not pool and not spawn")

# tests that start processes in ways their code does not show
HIDDEN = """
import importlib, os

def test_swallowed():
    try:  # the code under test swallows the refusal
        importlib.import_module("subprocess").run(["true"])
    except Exception:
        pass

def test_multiprocessing():
    importlib.import_module("multiprocessing").get_context("spawn").Process(target=print).start()

def test_system():
    os.system("true")

def test_quiet():
    assert sum([1, 2]) == 3
"""

LANES = """
import subprocess
import pytest
from tests import lanes

def test_names_subprocess():  # marked spawn from its code, so not in the fast lane
    assert subprocess.run

@pytest.mark.pool
def test_marked_by_hand(request):  # a run that selects it is not guarded
    assert not request.config.stash[lanes.GUARDED]

def test_guarded(request):
    assert request.config.stash[lanes.GUARDED]
"""


def _run(pytester, source, *args) -> dict[str, list]:
    """{test name: its failed reports' texts (empty: passed)} of a pytest run of source."""
    pytester.makepyfile(test_inner=source)
    runs: dict[str, list] = {}
    for report in pytester.inline_run(*args).getreports("pytest_runtest_logreport"):
        failures = runs.setdefault(report.nodeid.split("::")[-1], [])
        if report.failed:
            failures.append(f"{report.when}: {report.longreprtext}")
    return runs


def test_the_guard_fails_every_test_that_starts_a_process(pytester):
    runs = _run(pytester, HIDDEN, *FAST)
    assert runs["test_quiet"] == []
    for name, started in [
        ("test_swallowed", "subprocess ['true']"),
        ("test_multiprocessing", "multiprocessing"),
        ("test_system", "os.system"),
    ]:
        teardown = [f for f in runs[name] if f.startswith("teardown")]
        assert len(teardown) == 1, (name, runs[name])
        said = f"test_inner.py::{name} is in the fast lane but started a process ({started})"
        assert said in teardown[0]
    # refused, not started: the calls that did not swallow the error failed with it
    assert "ProcessStartError" in runs["test_multiprocessing"][0]
    assert "ProcessStartError" in runs["test_system"][0]


def test_the_fast_lane_leaves_out_marked_tests_and_is_guarded(pytester):
    assert _run(pytester, LANES, *FAST) == {"test_guarded": []}
    assert _run(pytester, LANES, "-p", "tests.lanes", "-p", "no:cacheprovider", "-m", "pool") == {
        "test_marked_by_hand": []
    }


# marked from their code; called by no test (a test that named them would be marked too)
def _gloo():
    from tests.distributed import run_distributed

    return run_distributed(print, 2)


def _via_a_helper():
    return [_gloo() for _ in range(2)]


class _Hosts:
    def up(self):
        import ipyparallel

        return ipyparallel.Cluster(n=2)


def _via_a_class():
    return _Hosts().up()


def _in_a_lambda(pool_module):
    return lambda: pool_module.Pool(2)


def _quiet():
    return sorted({"Pool": 1})


SAMPLES = {
    _via_a_helper: {"spawn"},
    _via_a_class: {"pool"},
    _in_a_lambda: {"pool"},
    _quiet: set(),
}


@pytest.mark.parametrize("fn", SAMPLES, ids=lambda fn: fn.__name__)
def test_markers_follow_the_helpers_of_tests(fn):
    assert lanes.process_marks([fn]) == SAMPLES[fn]
