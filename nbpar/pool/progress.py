"""What ``Pool(n)`` is doing while it starts (a few seconds), said in the notebook.

One display area, opened empty when the start-up begins and updated in place: "nbpar:
starting a controller and 2 engines (local), 1 s", then "2/2 engines registered", then
"joining the process group (gloo)". It is emptied when the pool is ready (or its start
failed, and the error says why), so a saved notebook holds one empty area however fast
the engines came (as the live output of a ``%%dist`` cell, `nbpar.pool.stream`). Only
in a Jupyter kernel: a terminal's ``Pool(n)`` stays quiet.
"""

from __future__ import annotations

import time

from nbpar.pool.stream import in_kernel


class StartProgress:
    def __init__(self):
        self.start = time.monotonic()
        self.handle = None
        if in_kernel():
            from IPython.display import display

            self.handle = display({"text/plain": ""}, raw=True, display_id=True)

    def say(self, text: str) -> None:
        if self.handle is not None:
            seconds = time.monotonic() - self.start
            self.handle.update({"text/plain": f"nbpar: {text}, {seconds:.0f} s"}, raw=True)

    def done(self) -> None:
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)
            self.handle = None
