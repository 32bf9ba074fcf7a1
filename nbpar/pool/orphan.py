"""Exit when the process that started us dies, so nothing outlives the kernel.

nbpar's engine and controller processes call `exit_with_parent()` first thing:
a kernel killed outright (no atexit, no cleanup) then takes its engines and
controller with it within about a second.
"""

import os
import threading
import time


def _kill_children() -> None:
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Start a daemon thread that ends this process (and its children) with its parent."""
    parent = os.getppid()
    if parent <= 1:
        return

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:  # re-parented: the parent is gone
                _kill_children()
                os._exit(0)

    threading.Thread(target=watch, name="nbpar-exit-with-parent", daemon=True).start()
