"""The live chart's seconds axis (nbpar/view/static/livechart.js, run in node): a first
step's set-up spike does not squash the steps after it."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest

JS = pathlib.Path(__file__).resolve().parents[1] / "nbpar" / "view" / "static" / "livechart.js"


def seconds_range(data: list, hi: float) -> list[float]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is needed to run the chart's JavaScript (apt-get install nodejs)")
    source = JS.read_text()
    found = re.search(r"^function secondsRange\(data, hi\) \{.*?^\}", source, re.S | re.M)
    assert found, "secondsRange is gone from livechart.js"
    script = (
        f"{found[0]}\nprocess.stdout.write(JSON.stringify(secondsRange({json.dumps(data)}, {hi})));"
    )
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_set_up_spike_runs_off_the_top():
    steps = list(range(12))
    rank0 = [1.30, 0.40] + [0.010 + 0.001 * (i % 3) for i in range(10)]  # set-up, then ~11 ms
    rank1 = [1.20, 0.35] + [0.011] * 10
    lo, top = seconds_range([steps, rank0, rank1], max(rank0))
    assert lo == 0
    assert top == pytest.approx(2 * 0.012 * 1.1)  # twice the 95th percentile, 10% headroom
    assert top < 0.1  # not 1.3 s: the later steps fill the panel


def test_few_steps_or_no_spike_keep_the_whole_range():
    assert seconds_range([[0, 1, 2], [0.5, 0.4, 0.01]], 0.5) == pytest.approx([0, 0.55])
    flat = [[*range(8)], [0.02] * 8]
    assert seconds_range(flat, 0.02) == pytest.approx([0, 0.022])  # the max is in range
    with_gaps = [[*range(8)], [None, None, 0.02, None, 0.02, 0.02, 0.02, 0.02]]
    assert seconds_range(with_gaps, 0.02) == pytest.approx([0, 0.022])
