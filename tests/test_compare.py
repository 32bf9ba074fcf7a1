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
    zero = FakeRun(
        cfg=TrainConfig(strategy="zero3", backend="deepspeed", steps=5),
        history=history(5, comm=(0.02, 0.04)),
        finished=True,
    )
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
    assert b["exposed_comm_fraction"] == res["exposed_comm_fraction"] < b["comm_fraction"]
    assert b["comm_bytes"] == 2000  # the larger rank's bytes sent per step
    assert a["final_loss"] == [r["loss"] for r in ddp.history if r["rank"] == 1][-1]


def test_figure_bars_match_the_table():
    cmp = compare(list(_runs()))
    peak, step, comm, loss = cmp.figure.axes
    for ax, key in (
        (peak, "peak_bytes"),
        (step, "step_time_s"),
        (comm, "exposed_comm_fraction"),
        (loss, "final_loss"),
    ):
        assert [p.get_height() for p in ax.patches] == [row[key] for row in cmp.table]
    assert [t.get_text() for t in peak.get_xticklabels()] == ["ddp/torch", "zero3/deepspeed"]
    assert list(comm.get_lines()[0].get_ydata()) == [0.2, 0.2]


def test_text_and_html_reprs():
    cmp = compare(list(_runs()))
    text = repr(cmp).splitlines()
    assert text[0].split()[:2] == ["run", "steps"]
    assert "peak/rank" in text[0] and len(text) == 3  # like for like: no warning
    assert text[1].startswith("ddp/torch") and format_bytes(125 * MB) in text[1]
    page = cmp._repr_html_()
    assert page.count("<table>") == 2 and page.count("<tr>") == 2 * 3  # two tables, 2 runs
    assert "zero3/deepspeed" in page
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


def test_steps_batch_and_precision_beside_the_numbers_and_warnings():
    ddp, _ = _runs()
    long = FakeRun(
        cfg=TrainConfig(strategy="zero2", steps=8, micro_batch=4, precision="bf16"),
        history=history(8),
        finished=True,
    )
    cmp = compare([ddp, long])
    a, b = cmp.table
    assert (a["steps"], a["global_batch"], a["precision"]) == (5, 16, "fp32")
    assert (b["steps"], b["global_batch"], b["precision"]) == (8, 8, "bf16")
    assert cmp.warnings == [
        "runs differ in length (ddp/torch 5 steps, zero2/torch 8 steps): final losses and "
        "averages cover different spans",
        "runs differ in global batch (ddp/torch 16 samples, zero2/torch 8 samples): losses "
        "and throughput are not like for like",
        "runs differ in precision (ddp/torch fp32, zero2/torch bf16): memory, speed and "
        "losses differ by design",
    ]
    assert repr(cmp).splitlines()[-3].startswith("warning: runs differ in length")
    page = cmp._repr_html_()
    assert page.count("nbpar-warning") == 3 and "<th>global batch</th>" in page
    assert page.index("nbpar-warning") < page.index("<table>")


def test_figure_text_is_readable():
    fig = compare(list(_runs())).figure
    for ax in fig.axes:
        assert ax.title.get_fontsize() >= 11
        assert min(t.get_fontsize() for t in ax.get_xticklabels()) >= 10
        assert min(t.get_fontsize() for t in ax.get_yticklabels()) >= 10


def test_run_result_displays_a_summary_and_stays_the_same_dict():
    import json

    from IPython.lib.pretty import pretty

    from nbpar.pool.run import RunResult

    ddp, _ = _runs()
    plain = FakeRun(
        cfg=TrainConfig(strategy="ddp", steps=300), history=history(300), finished=True
    ).result()
    res = RunResult(plain)
    assert res == plain and json.loads(json.dumps(res)) == json.loads(json.dumps(plain))
    assert set(res) == {
        "config",
        "losses",
        "ranks",
        "step_time_s",
        "comm_fraction",
        "exposed_comm_fraction",
        "bubble_fraction",
    }
    text = pretty(res)
    assert len(text.splitlines()) <= 8 and len(text) < 800
    assert "ddp/torch tiny_gpt: 300 steps, global batch 16, fp32" in text
    assert f"loss {plain['losses'][0]:.4f} -> {plain['losses'][-1]:.4f}" in text
    assert "rank 1: peak " in text
    assert "<b>ddp/torch tiny_gpt: 300 steps" in res._repr_html_()


def make_tiny_mlp():
    import torch

    return torch.nn.Linear(4, 2)


def test_a_factory_model_is_labelled_by_its_name():
    from nbpar.view.picker_runs import run_row

    run = FakeRun(
        cfg=TrainConfig(strategy="ddp", steps=3, model=make_tiny_mlp),
        history=history(3),
        finished=True,
    )
    assert run_row(run)["run"] == "ddp/torch tests.test_compare:make_tiny_mlp"


def _states_run(strategy: str, ranks: list[tuple[int, int, int, int, int]]) -> dict:
    """A result dict whose ranks hold (params, grads, optim, peak, sent) bytes."""
    return {
        "config": TrainConfig(strategy=strategy, steps=2).to_dict(),
        "losses": [2.0, 1.5],
        "ranks": [
            dict(zip(("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes", "comm_bytes"), r))
            | {"rank": i}
            for i, r in enumerate(ranks)
        ],
        "step_time_s": 0.1,
        "comm_fraction": 0.5,
        "exposed_comm_fraction": 0.25,
    }


def test_relative_divides_each_run_by_the_baseline_run():
    ddp = _states_run("ddp", [(400, 400, 800, 3000, 400), (400, 400, 800, 3000, 400)])
    # pipeline-like: the ranks differ, and the largest sum is not the largest of each part
    pp = _states_run("pipeline", [(300, 300, 600, 1000, 100), (100, 100, 700, 2000, 120)])
    cmp = compare([ddp, pp], labels=["ddp", "pp"])
    assert cmp.table[1]["states_bytes"] == 1200  # rank 0's 1200, not 300 + 300 + 700
    base, other = cmp.relative("ddp")
    assert base["states_share"] == base["peak_share"] == base["comm_ratio"] == 1.0
    assert other["label"] == "pp" and other["states_bytes"] == 1200
    assert other["states_share"] == 1200 / 1600 and other["peak_share"] == 2000 / 3000
    assert other["comm_ratio"] == 120 / 400 and other["exposed_comm_fraction"] == 0.25
    assert [r["states_share"] for r in cmp.relative("pp")] == [1600 / 1200, 1.0]
    with pytest.raises(ValueError, match="no run labelled 'zero3'"):
        cmp.relative("zero3")


def test_relative_without_counted_bytes():
    ddp = _states_run("ddp", [(4, 4, 8, 30, 0)])
    for r in ddp["ranks"]:
        del r["comm_bytes"]
    zero = _states_run("zero1", [(4, 4, 4, 20, 40)])
    a, b = compare([ddp, zero]).relative("ddp/torch")
    assert a["comm_ratio"] is None and b["comm_ratio"] is None
    assert b["states_share"] == 12 / 16


def test_the_blocked_share_of_a_normal_step_is_a_column_a_tick_and_a_line():
    """The every-step figure (`comm_blocked_fraction`) travels from the result to the
    table, the figure's exposed panel and `describe`; a result without it shows '-'."""
    from nbpar.view.compare import describe

    ddp, zero = _runs()
    with_clock = {**ddp.result(), "comm_blocked_fraction": 0.37}
    without = {**zero.result(), "comm_blocked_fraction": None}
    cmp = compare([with_clock, without])
    assert [row["comm_blocked_fraction"] for row in cmp.table] == [0.37, None]
    table = repr(cmp).splitlines()
    end = table[0].index("blocked") + len("blocked")  # cells are right-aligned
    assert table[1][end - 3 : end] == "37%" and table[2][end - 1 : end] == "-"
    comm = cmp.figure.axes[2]
    tick = next(line for line in comm.get_lines() if line.get_marker() == "_")
    assert list(tick.get_xdata()) == [0] and list(tick.get_ydata()) == [0.37]
    assert "blocked 37% of a normal step" in describe(with_clock)[2]
    assert "blocked" not in describe(without)[2]


def test_the_html_tables_fit_a_notebook_and_lose_no_column():
    """Two tables of at most eight columns (memory; time and communication), each in a box
    that scrolls sideways rather than cutting its last columns; every column is in one."""
    from nbpar.view.compare import COLUMNS, HTML_TABLES

    cmp = compare(list(_runs()))
    page = cmp.html_table()
    tables = re.findall(r"<div style='overflow-x:auto[^']*'><table>(.*?)</table></div>", page)
    assert len(tables) == len(HTML_TABLES) == 2
    heads = [re.findall(r"<th>(.*?)</th>", t) for t in tables]
    assert all(len(h) <= 8 and h[0] == "run" for h in heads)
    titles = [title for _, title in COLUMNS]
    shown = [t for h in heads for t in h[1:]]
    assert sorted(shown) == sorted(titles[1:])  # each column once, none left out
    for table in tables:  # one row per run, as many cells as headers
        rows = re.findall(r"<tr>(.*?)</tr>", table)[1:]
        assert [r.count("<td") for r in rows] == [len(re.findall("<th>", table))] * 2


def test_the_figure_legend_names_every_mark_and_covers_no_bar():
    """The communication panel's legend sits below the panels: it overlaps no bar of any
    panel, and each of its marks (exposed, waiting, the blocked tick, the 20% line) has
    an entry."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    ddp, zero = (r.result() for r in _runs())
    fig = compare(
        [{**ddp, "comm_blocked_fraction": 0.3}, {**zero, "comm_wait_fraction": 0.1}]
    ).figure
    FigureCanvasAgg(fig).draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not ax.legend_  # no legend inside a panel
        for bar in ax.patches:
            assert not box.overlaps(bar.get_window_extent()), ax.get_title()
    labels = [t.get_text() for t in legend.get_texts()]
    comm = fig.axes[2]
    colours = {tuple(p.get_facecolor()) for p in comm.patches}
    assert len(colours) == 2 == sum(label.startswith(("exposed", "waiting")) for label in labels)
    assert "blocked, a normal step" in labels and "20% exposed" in labels


def test_a_run_whose_timings_cannot_be_trusted_says_so_beside_the_table():
    """The run's own verdict (`timing_reliable`, `timing_note`) is a warning of the
    comparison, in the text and above the HTML tables; a reliable run adds none."""
    ddp, zero = (r.result() for r in _runs())
    busy = "timings unreliable: other processes took 45% of the 2 cores; memory and bytes are exact"
    cmp = compare(
        [
            {**ddp, "timing_reliable": True, "timing_note": "timings reliable here: ..."},
            {**zero, "timing_reliable": False, "timing_note": busy},
        ]
    )
    assert cmp.warnings == [f"zero3/deepspeed: {busy}"]
    assert repr(cmp).splitlines()[-1] == f"warning: zero3/deepspeed: {busy}"
    page = cmp._repr_html_()
    assert page.index("other processes took 45%") < page.index("<table>")
    assert compare([ddp, zero]).warnings == []  # results without a verdict: nothing said
