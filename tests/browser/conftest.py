"""A real JupyterLab server and a headless Chromium for the browser tests.

The server runs from this Python's environment on 127.0.0.1 with a token, its root a temp
copy of notebooks/ (outputs stripped, so what the test sees was rendered in this run), and
every IPython/Jupyter dir inside the test's temp dir. Teardown shuts the kernels down the
normal way (so their atexit hooks run) and checks that no engine process is left.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import psutil
import pytest

from nbpar.pool.forkserver import POOL_MARKERS

REPO = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ENGINE_MARKERS = POOL_MARKERS
# Lab settings for a quiet, fully rendered page: no news fetch, every cell in the DOM.
USER_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


@dataclass
class Lab:
    url: str
    token: str
    proc: subprocess.Popen
    root: pathlib.Path
    notebooks: pathlib.Path
    ipythondir: pathlib.Path

    def api(self, method: str, path: str, timeout: float = 30.0):
        """Call the server's REST API; return the decoded JSON body (None when empty)."""
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strip_outputs(path: pathlib.Path) -> None:
    """Drop stored outputs so every rendered output comes from this run."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    nb["metadata"].pop("widgets", None)
    path.write_text(json.dumps(nb, indent=1))


def engine_processes(ipythondir: pathlib.Path, within: list[psutil.Process] = ()) -> list:
    """Live engine/controller processes started under this lab: those in `within` plus any
    process anywhere whose IPYTHONDIR is this lab's (engines outlive a killed parent)."""
    found = {}
    for p in [*within, *psutil.process_iter()]:
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
            if not any(m in cmd for m in ENGINE_MARKERS):
                continue
            if p in within or p.environ().get("IPYTHONDIR") == str(ipythondir):
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


def wait_gone(procs, timeout: float) -> list:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _wait_ready(lab: Lab, log: pathlib.Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            raise RuntimeError(
                f"jupyter lab exited with {lab.proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            lab.api("GET", "/api/status", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise RuntimeError(f"jupyter lab not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _shutdown(lab: Lab) -> None:
    """Kernels first (shutdown_request, so atexit hooks run), then the server; then check
    that no engine or controller process is left, killing and reporting any that is."""
    try:
        tree = psutil.Process(lab.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    try:
        for kernel in lab.api("GET", "/api/kernels"):
            lab.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=120)
        lab.api("POST", "/api/shutdown")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    try:
        lab.proc.wait(60)
    except subprocess.TimeoutExpired:
        lab.proc.terminate()
        try:
            lab.proc.wait(20)
        except subprocess.TimeoutExpired:
            lab.proc.kill()
            lab.proc.wait(20)
    left = wait_gone(engine_processes(lab.ipythondir, tree), timeout=30)
    stray = wait_gone([p for p in tree if p not in left], timeout=10)
    for p in left + stray:
        p.kill()
    assert not left, f"engine processes left after shutdown: {[p.cmdline() for p in left]}"
    assert not stray, f"server processes left after shutdown: {[p.cmdline() for p in stray]}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a temp copy of notebooks/; shut down (and checked) at the end."""
    root = tmp_path_factory.mktemp("lab")
    notebooks = root / "notebooks"
    shutil.copytree(
        REPO / "notebooks", notebooks, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "src")
    )
    for nb in notebooks.glob("*.ipynb"):
        strip_outputs(nb)
    config = root / "jupyter" / "config"
    for name, values in USER_SETTINGS.items():
        path = config / "lab" / "user-settings" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    # a peer a benchmark installs beside nbpar (jupyter-distributed) proxies every kernel
    # and redraws its outputs: the page must show what nbpar sends
    (config / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"jupyter_distributed": False}}})
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "JUPYTER_PATH")}
    env.update(
        IPYTHONDIR=str(root / "ipython"),
        JUPYTER_CONFIG_DIR=str(config),
        JUPYTER_DATA_DIR=str(root / "jupyter" / "data"),
        JUPYTER_RUNTIME_DIR=str(root / "jupyter" / "runtime"),
        MPLCONFIGDIR=str(root / "mpl"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    port, token = free_port(), secrets.token_hex(16)
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={notebooks}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--KernelManager.shutdown_wait_time=60",
    ]
    if os.geteuid() == 0:  # containers and CI runners often test as root
        cmd.append("--allow-root")
    log = root / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=notebooks,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Lab(f"http://127.0.0.1:{port}", token, proc, root, notebooks, root / "ipython")
    try:
        _wait_ready(server, log)
        yield server
    finally:
        try:
            _shutdown(server)
        finally:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, ARTIFACTS / "server.log")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Debian Chromium with a fresh profile, driven by playwright."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} not found: run `sh scripts/install_browser.sh .venv/bin/python`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "the playwright package is missing: run "
            "`sh scripts/install_browser.sh .venv/bin/python`"
        )
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 2000},
        )
        try:
            yield context
        finally:
            context.close()
