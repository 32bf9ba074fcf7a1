"""The kernel's side of the engines' fork server (`nbpar.pool.forkserver`): start it,
ask it for engines, stop it. Imports nothing heavy: a pool starts it first, so that it
imports torch while the kernel imports ipyparallel (`nbpar.pool.fork_launcher` holds
the ipyparallel launcher that uses it).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

from nbpar.errors import PoolError

#: set to "0" to start each local engine as a process of its own, as ipyparallel does
SWITCH = "NBPAR_FORKSERVER"


def usable(launcher: str) -> bool:
    """Whether a pool with ``launcher`` forks its engines: local engines, on Linux,
    unless ``NBPAR_FORKSERVER=0``."""
    return (
        isinstance(launcher, str)
        and launcher.lower() == "local"
        and sys.platform.startswith("linux")
        and os.environ.get(SWITCH, "1") != "0"
    )


class ForkServer:
    """The fork server of one pool: started at once, importing while the pool starts."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nbpar.pool.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,  # a kernel interrupt (its process group) is not ours
        )
        self._lock = threading.Lock()
        self._ready = False
        self.torch_error = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, deadline: float) -> dict:
        out = self.proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolError("the engines' fork server did not answer in time")
            if select.select([out], [], [], left)[0]:
                line = out.readline()
                if not line:
                    raise PoolError(
                        f"the engines' fork server exited (code {self.proc.poll()}); "
                        f"set {SWITCH}=0 to start engines one process each"
                    )
                return json.loads(line)

    def fork(self, argv: list, env: dict, cwd: str, output: str, timeout: float = 120) -> int:
        """Fork one engine that runs ipengine with ``argv``; its pid."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if not self._ready:
                hello = self._read(deadline)
                if not hello.get("ready"):
                    raise PoolError(f"the engines' fork server could not start: {hello}")
                self._ready, self.torch_error = True, hello.get("torch")
            request = {"argv": argv, "env": env, "cwd": cwd, "output": output}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            return int(self._read(deadline)["pid"])

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server: its stdin closed, it exits once its engines are stopped;
        killed if it does not, or at once while it is still importing (a pool that
        failed to start: it has no engine to wait for)."""
        if self.proc.poll() is None:
            try:
                if not self._ready:
                    raise OSError("still importing")
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
