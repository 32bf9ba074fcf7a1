"""compare(): table rows and bars equal the runs' numbers; Runs and result dicts both work."""
from __future__ import annotations

import base64
import re

import pytest

from nbpar.config import TrainConfig
from nbpar.estimate import format_bytes
from nbpar.view.compare import compare
from tests.viz_fakes import MB, FakeRun, history


def _runs():
    ddp = FakeRun(cfg=TrainConfig(strategy="ddp", steps=5), history=history(5), finished=True)
    zero = FakeRun(cfg=TrainConfig(strategy="zero3", backend="deepspeed", steps=5),
                   history=history(5, comm=(0.02, 0.04)), finished=True)
    return ddp, zero


def test_table_rows_from_runs_and_dicts():
    ddp, zero = _runs()
    res = zero.result()
    cmp = compare([ddp, res])
    a, b = cmp.table
    assert a["label"] == "ddp/torch" and b["label"] == "zero3/deepspeed"
    assert a["peak_bytes"] == max(r["peak_bytes"] for r in ddp.history) == 125 * MB
    assert a["param_bytes"] == 5 * MB  # the larger of rank 0 (4 MB) and rank 1 (5 MB)
    assert a["grad_bytes"] == 4 * MB and a["optim_bytes"] == 8 * MB
    assert a["step_time_s"] == ddp.result()["step_time_s"]
    assert b["comm_fraction"] == res["comm_fraction"]
    assert a["final_loss"] == [r["loss"] for r in ddp.history if r["rank"] == 1][-1]


def test_figure_bars_match_the_table():
    cmp = compare(list(_runs()))
    peak, step, comm, loss = cmp.figure.axes
    for ax, key in ((peak, "peak_bytes"), (step, "step_time_s"), (comm, "comm_fraction"),
                    (loss, "final_loss")):
        assert [p.get_height() for p in ax.patches] == [row[key] for row in cmp.table]
    assert [t.get_text() for t in peak.get_xticklabels()] == ["ddp/torch", "zero3/deepspeed"]
    assert list(comm.get_lines()[0].get_ydata()) == [0.2, 0.2]


def test_text_and_html_reprs():
    cmp = compare(list(_runs()))
    text = repr(cmp).splitlines()
    assert text[0].split()[:2] == ["run", "peak/rank"]
    assert text[1].startswith("ddp/torch") and format_bytes(125 * MB) in text[1]
    page = cmp._repr_html_()
    assert page.count("<tr>") == 3 and "zero3/deepspeed" in page
    png = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)", page).group(1))
    assert png[:4] == b"\x89PNG"


def test_duplicate_labels_and_bad_input():
    ddp, _ = _runs()
    assert [r["label"] for r in compare([ddp, ddp]).table] == ["ddp/torch", "ddp/torch (2)"]
    assert compare([ddp], labels=["mine"]).table[0]["label"] == "mine"
    with pytest.raises(ValueError, match="at least one"):
        compare([])
    with pytest.raises(ValueError, match="lacks"):
        compare([{"losses": [1.0]}])
    with pytest.raises(TypeError):
        compare([3])
    assert format_bytes(52e9) == "52.0 GB" and format_bytes(512) == "512 B"
