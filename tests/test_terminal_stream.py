"""In the ``ipython`` terminal a %%dist cell's lines arrive while it runs, once each (the
grouped output at the end leaves out what was printed): a real ``ipython`` process, its
stdout read line by line as it comes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.spawn]

SESSION = r"""
ip = get_ipython()
print("shell:", type(ip).__name__, flush=True)
ip.run_line_magic("load_ext", "nbpar")
import nbpar
pool = nbpar.Pool(2, replace=False)
ip.run_cell_magic("dist", "{flags}", '''
import sys, time
for i in range(3):
    print("tick", i, flush=True)
    time.sleep(0.8)
print("partial", end="")
sys.stdout.flush()
7 * 6
''')
print("cell done", flush=True)
pool.shutdown()
"""


def _session(flags: str = "") -> list[tuple[float, str]]:
    """(seconds since start, line) of everything an ``ipython`` session printed."""
    ipython = Path(sys.executable).with_name("ipython")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(ipython), "--no-banner", "--colors=nocolor", "-c", SESSION.format(flags=flags)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    assert proc.wait(60) == 0, lines
    return lines


def test_lines_arrive_while_the_cell_runs_and_once_each():
    lines = _session()
    text = [line for _, line in lines]
    assert "shell: TerminalInteractiveShell" in text
    at = {line: t for t, line in lines}
    done = at["cell done"]
    for r in (0, 1):
        assert [line for line in text if line.startswith(f"[rank {r}] tick")] == [
            f"[rank {r}] tick {i}" for i in range(3)
        ]  # each line once: not again in the grouped output
        assert at[f"[rank {r}] tick 0"] < done - 1.0, lines  # live, not at the end
        # the unfinished line and the result come with the grouped output at the end
        assert f"[rank {r}] partial" in text and f"[rank {r}] Out: 42" in text


def test_no_stream_prints_everything_at_the_end():
    lines = _session("--no-stream")
    at = {line: t for t, line in lines}
    assert at["[rank 1] tick 2"] > at["[rank 0] tick 0"] - 0.1
    assert at["cell done"] - at["[rank 0] tick 0"] < 1.0  # together, when the cell ended
    text = [line for _, line in lines]
    assert text.index("[rank 0] tick 2") < text.index("[rank 1] tick 0")  # rank order
