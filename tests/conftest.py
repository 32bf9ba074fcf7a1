"""Test session set-up: IPython and temp dirs inside the run, no leftover processes."""

from __future__ import annotations

import os
import pathlib
import tempfile
import time

_root = pathlib.Path(__file__).resolve().parent.parent
_scratch = pathlib.Path(os.environ.get("NBPAR_TEST_SCRATCH", _root / ".tmp"))
_scratch.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("IPYTHONDIR", str(_scratch / "ipython"))
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("MPLCONFIGDIR", str(_scratch / "mpl"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
tempfile.tempdir = str(_scratch)

import psutil  # noqa: E402
import pytest  # noqa: E402

from nbpar.pool.forkserver import POOL_MARKERS  # noqa: E402
from tests import lanes  # noqa: E402

pytest_plugins = ["pytester"]  # tests/test_lanes.py runs pytest inside pytest


def pytest_configure(config):
    if not config.pluginmanager.is_registered(lanes):  # unless `-p tests.lanes` did
        config.pluginmanager.register(lanes, "nbpar-lanes")  # the pool/spawn markers, the guard


def _cmdline(p) -> str:
    """A process's command line; "" once it has exited (a zombie waiting to be reaped
    has exited: it is not left running)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Every engine and controller a test starts must be gone when the tests end."""
    yield
    me = psutil.Process()
    left = [p for p in me.children(recursive=True) if any(s in _cmdline(p) for s in POOL_MARKERS)]
    for p in left:
        p.kill()
    assert not left, f"processes left running: {[p.cmdline() for p in left]}"


@pytest.fixture(scope="module")
def pool():
    """A 2-engine pool shared by the tests of one module."""
    import nbpar

    p = nbpar.Pool(2, replace=False)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def ip():
    """The test IPython shell, with nbpar's extension loaded (once per module)."""
    from IPython import get_ipython as running_shell
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython() or running_shell()  # one test shell per session, whoever made it
    shell.run_line_magic("load_ext", "nbpar")
    return shell


@pytest.fixture
def half_precision(monkeypatch):
    """Pretend this host's CPU does (True) or does not (False) compute fp16 natively:
    ``half_precision(fp16=False)``. Both sides of the capability check are tested
    whichever CPU the tests happen to run on."""
    from nbpar import device

    def fake(fp16: bool, bf16: bool = True):
        monkeypatch.setattr(
            device, "half_precision_support", lambda backend: {"bf16": bf16, "fp16": fp16}
        )

    return fake


@pytest.fixture
def pub(ip, monkeypatch):
    """Every display publication of the test shell, each with the time it was made."""
    from IPython.core.displaypub import CapturingDisplayPublisher

    class TimedPublisher(CapturingDisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False):
            super().publish(data, metadata, source, transient=transient, update=update)
            self.outputs[-1]["time"] = time.monotonic()

    rec = TimedPublisher(shell=ip)
    monkeypatch.setattr(ip, "display_pub", rec)
    # ipyparallel forwards the comms of widgets made on engines only when a kernel is
    # present, and reads `shell.kernel` to know: say "none" as a terminal shell would
    monkeypatch.setattr(ip, "kernel", None, raising=False)
    # the test shell is a TerminalInteractiveShell; here it stands for a notebook's page,
    # so a cell's live lines go to the display area, not printed as in a terminal
    monkeypatch.setattr("nbpar.pool.stream.in_terminal", lambda: False)
    return rec.outputs
