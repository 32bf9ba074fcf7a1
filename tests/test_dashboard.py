"""The live dashboard and the static plots draw exactly what the history holds."""
from __future__ import annotations

import threading

import pytest

from nbpar.estimate import estimate_memory
from nbpar.view.dashboard import Dashboard, format_seconds
from nbpar.view.history import COMM_HEALTH, by_rank
from nbpar.view.plots import plot_losses, plot_memory, plot_step_split
from tests.viz_fakes import MB, FakeRun, history


def _loss_lines(dash):
    return dash.figure.axes[0].get_lines()


def test_one_loss_line_per_rank_with_that_ranks_losses():
    run = FakeRun(ranks=[0, 1, 2], history=history(5, ranks=(0, 1, 2), comm=(0.01, 0.02, 0.03)))
    dash = Dashboard(run)
    dash.update()
    lines = _loss_lines(dash)
    assert len(lines) == 3
    for rank, line in zip((0, 1, 2), lines):
        expected = [r["loss"] for r in run.history if r["rank"] == rank]
        assert list(line.get_ydata()) == expected
        assert list(line.get_xdata()) == list(range(5))
        assert line.get_label() == f"rank {rank}"


def test_memory_bars_are_the_latest_bytes_stacked():
    run = FakeRun(history=history(3))
    dash = Dashboard(run)
    dash.update()
    bars = dash.memory.bars
    for i, rank in enumerate((0, 1)):
        last = [r for r in run.history if r["rank"] == rank][-1]
        params, grads, optim = (bars[k].patches[i] for k in ("params", "grads", "optimizer"))
        other = bars["other"].patches[i]
        assert params.get_height() == last["param_bytes"] == (4 + rank) * MB
        assert grads.get_height() == last["grad_bytes"]
        assert optim.get_height() == last["optim_bytes"]
        assert other.get_height() == last["rss_bytes"] - (16 + rank) * MB
        assert grads.get_y() == params.get_height()
        assert other.get_y() + other.get_height() == pytest.approx(last["rss_bytes"])
        assert dash.memory.texts[i].get_text() == f"states {(16 + rank) * MB / 1e6:.1f} MB"


def test_step_split_shares_and_health_line():
    run = FakeRun(history=history(4, comm=(0.01, 0.03)))
    dash = Dashboard(run)
    dash.update()
    assert list(dash.split.health.get_ydata()) == [COMM_HEALTH, COMM_HEALTH] == [0.2, 0.2]
    for i, rank in enumerate((0, 1)):
        recs = [r for r in run.history if r["rank"] == rank]
        step = sum(r["step_time_s"] for r in recs) / len(recs)
        comm = sum(r["comm_s"] for r in recs) / len(recs)
        assert dash.split.comm.patches[i].get_height() == pytest.approx(comm / step)
        assert dash.split.compute.patches[i].get_y() == pytest.approx(comm / step)
        assert dash.split.texts[i].get_text() == f"{step:.3g} s"


def test_throughput_uses_the_slowest_rank_and_tokens():
    run = FakeRun(history=history(4))
    dash = Dashboard(run)
    dash.update()
    ys = list(dash.throughput.line.get_ydata())
    slowest = [min(r["tokens_per_s"] for r in run.history if r["step"] == s) for s in range(4)]
    assert ys == slowest
    assert dash.throughput.ax.get_ylabel() == "tokens/s"


def test_update_grows_the_same_figure_and_progress():
    run = FakeRun(history=history(3))
    dash = Dashboard(run)
    figure, line = dash.figure, _loss_lines(dash)[0]
    assert dash.update() is True
    assert len(line.get_xdata()) == 3
    assert dash.text.startswith("step 3/20 (15%)") and "ETA" in dash.text
    assert dash.update() is False  # nothing new: no redraw work
    run.history = history(8)
    assert dash.update() is True
    assert dash.figure is figure and _loss_lines(dash)[0] is line
    assert len(line.get_xdata()) == 8
    info = dash.progress()
    assert info["steps"] == 8 and info["total"] == 20
    # timestamps 0.1 s apart -> 12 steps left take 1.2 s
    assert info["s_per_step"] == pytest.approx(0.1)
    assert info["eta_s"] == pytest.approx(1.2)
    assert "ETA 1.2 s" in dash.text


def test_progress_when_done_or_stopped():
    run = FakeRun(history=history(20), finished=True)
    dash = Dashboard(run)
    dash.update()
    assert dash.text.startswith("done: 20/20 steps")
    run = FakeRun(history=history(5), finished=True)
    assert Dashboard(run).progress()["text"].startswith("stopped after 5/20 steps")
    assert Dashboard(FakeRun()).progress()["text"] == "starting… 0/20 steps"


def test_widget_shows_progress_and_png():
    run = FakeRun(history=history(5))
    dash = Dashboard(run, min_interval_s=0.0)
    widget = dash.widget
    assert dash._bar.value == 5 and dash._bar.max == 20
    assert dash._label.value == dash.text
    assert dash._image.value[:8] == b"\x89PNG\r\n\x1a\n"
    run.history, run.finished = history(20), True
    dash.update()
    assert dash._bar.value == 20 and dash._bar.bar_style == "success"
    assert widget is dash.widget


def test_follow_returns_when_the_run_finishes():
    run = FakeRun(history=history(2))

    def finish():
        run.history = history(20)
        run.finished = True

    timer = threading.Timer(0.2, finish)
    timer.start()
    dash = Dashboard(run).follow(poll_s=0.05)
    timer.join()
    assert len(_loss_lines(dash)[0].get_xdata()) == 20
    assert dash.text.startswith("done")


def test_save_writes_a_png(tmp_path):
    path = Dashboard(FakeRun(history=history(4))).save(tmp_path / "dash.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_format_seconds():
    assert format_seconds(3.25) == "3.2 s"
    assert format_seconds(125) == "2 min 05 s"
    assert format_seconds(3720) == "1 h 02 min"


def test_plot_losses_one_line_per_run_or_rank():
    a = FakeRun(history=history(4))
    b = FakeRun(history=history(6), cfg=a.cfg.__class__(strategy="zero3", steps=6))
    fig = plot_losses([a, b])
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["ddp/torch", "zero3/torch"]
    assert list(lines[1].get_ydata()) == [r["loss"] for r in b.history if r["rank"] == 1]
    fig = plot_losses(a.history, per_rank=True)
    assert len(fig.axes[0].get_lines()) == 2
    with pytest.raises(TypeError):
        plot_losses(42)


def test_plot_memory_measured_next_to_estimate():
    run = FakeRun(history=history(3))
    est = estimate_memory(params=4 * MB / 4, world_size=2, strategy="ddp")
    fig = plot_memory(run, estimate=est)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["rank 0", "rank 1", "estimate"]
    params = [p for p in ax.patches if p.get_facecolor() == ax.patches[0].get_facecolor()]
    assert [p.get_height() for p in params] == [4 * MB, 5 * MB, est.per_rank_bytes["params"]]
    fig = plot_memory(run.result())  # result dicts: params/grads/optim, no 'other'
    assert len(fig.axes[0].patches) == 2 * 3


def test_plot_step_split_static():
    run = FakeRun(history=history(4, comm=(0.01, 0.03)))
    ax = plot_step_split(run).axes[0]
    groups = by_rank(run.history)
    heights = [p.get_height() for p in ax.patches[:2]]
    expected = [sum(r["comm_s"] for r in g) / sum(r["step_time_s"] for r in g)
                for g in groups.values()]
    assert heights == pytest.approx(expected)


def test_gpu_records_use_device_memory_and_show_utilisation():
    from nbpar.view.dashboard import Dashboard
    from nbpar.view.history import other_bytes
    from tests.viz_fakes import FakeRun, history

    run = FakeRun(history=history(3))
    for rec in run.history:
        rec.update(device_allocated_bytes=50_000_000, device_util_pct=80)
    rec = run.history[-1]
    states = rec["param_bytes"] + rec["grad_bytes"] + rec["optim_bytes"]
    assert other_bytes(rec) == 50_000_000 - states
    assert "GPU util 80%" in Dashboard(run).progress()["text"]
