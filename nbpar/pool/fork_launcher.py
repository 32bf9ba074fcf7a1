"""ipyparallel's local engine launchers, with each engine forked by the pool's fork
server (`nbpar.pool.forked.ForkServer`) instead of started with Popen.

Each engine is still a process of its own with a launcher of its own (a pid to signal,
stop and watch), so restarts, spares, interrupts and the doctor work on them as on any
local engine; only their parent is the server, not the kernel.
"""

from __future__ import annotations

import os

from ipyparallel.cluster.launcher import (
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    ProcessStateError,
)
from traitlets import Float


class ForkEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the pool's `ForkServer` (``parent.forkserver``)."""

    def start(self):
        import psutil

        if self.state != "before":
            raise ProcessStateError(f"The process was already started and has state: {self.state}")
        env = os.environ.copy()
        env.update(self.get_env())
        pid = self.parent.forkserver.fork(
            [*self.cluster_args, *self.engine_args],
            {str(k): str(v) for k, v in env.items()},
            os.path.abspath(self.work_dir),
            os.path.abspath(self.output_file),
        )
        self.pid = pid
        try:
            self.process = psutil.Process(pid)
        except psutil.NoSuchProcess:  # exited, and was reaped, already
            raise ProcessStateError(
                f"engine {pid} exited as it started: see {self.output_file}"
            ) from None
        self.notify_start(pid)
        self._start_waiting()


class ForkEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, its engines forked by ``cluster.forkserver``."""

    launcher_class = ForkEngineLauncher
    #: no pause between engines: a fork takes milliseconds (ipyparallel waits 0.1 s)
    delay = Float(0.0, config=True, help="seconds between forking one engine and the next")

    @property
    def forkserver(self):
        return self.parent.forkserver
