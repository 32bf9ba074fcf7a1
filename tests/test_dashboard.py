"""The live dashboard sends the browser exactly the new steps of the history, in panels
that show what differs per rank; the static figure draws the same state."""

from __future__ import annotations

import math
import threading
import time

import pytest

from nbpar.estimate import estimate_memory
from nbpar.view.dashboard import Dashboard, format_seconds
from nbpar.view.history import COMM_HEALTH, by_rank
from nbpar.view.live import WAITING, LiveFeed, nested_widths, rank_color
from nbpar.view.plots import plot_losses, plot_memory, plot_step_split
from tests.viz_fakes import MB, FakeRun, history


def live(run) -> Dashboard:
    """A dashboard whose browser chart exists (as when a notebook shows it)."""
    dash = Dashboard(run)
    assert dash.widget.children[-1] is dash.chart
    return dash


def _panel(spec, pid):
    return next(p for p in spec["panels"] if p["id"] == pid)


def _col(chart, pid, i=0):
    return chart.cols[pid][i]


def test_before_the_first_step_every_panel_waits_without_axes():
    dash = live(FakeRun())
    chunk, spec = dash.chart.chunk, dash.chart.spec
    assert dash.chart.x == [] and chunk["x"] == []
    assert spec["waiting"] == WAITING == "waiting for the first step"
    panels = ["loss", "step", "comm", "throughput", "states", "process"]
    assert [p["id"] for p in spec["panels"]] == panels
    assert all(p["series"] == [] for p in spec["panels"])  # nothing to draw yet
    assert dash.status == {"text": "starting… 0/20 steps", "value": 0, "max": 20, "style": ""}
    assert chunk["status"] == dash.status  # the progress line travels with the data


def test_only_steps_every_rank_finished_are_sent_and_only_once():
    feed = LiveFeed([0, 1])
    hist = history(3)
    steps, cols, spec = feed.read(hist)
    assert steps == [0, 1, 2] and spec is not None
    hist.append(history(4)[6])  # rank 0 finished step 3, rank 1 not yet
    assert feed.read(hist)[0] == []
    hist.append(history(4)[7])
    steps, cols, spec = feed.read(hist)
    assert steps == [3] and spec is None  # the panels are fixed at the first step
    assert cols["loss"] == [[5.0 / 4]]


def test_chart_receives_only_the_new_points_and_resyncs_on_request():
    run = FakeRun(history=history(3))
    dash = Dashboard(run)
    chart = dash.widget.children[-1]
    assert chart is dash.chart and chart.chunk["x"] == [0, 1, 2] and chart.points("loss") == 3
    seq = chart.seq
    run.history = history(5)
    assert dash.update() is True
    assert chart.chunk["x"] == [3, 4] and chart.chunk["seq"] == seq + 1
    assert "spec" not in chart.chunk and len(chart.chunk["cols"]["loss"][0]) == 2
    assert dash.update() is False and chart.seq == seq + 1  # nothing new: nothing sent
    chart._on_msg(chart, {"type": "resync"}, [])  # a reloaded page asks for everything
    assert chart.chunk["reset"] is True and chart.chunk["x"] == [0, 1, 2, 3, 4]
    assert chart.chunk["spec"]["panels"][0]["series"][0]["label"] == "loss (mean over ranks)"


def test_loss_is_one_global_line_and_rank_lines_only_when_ranks_differ():
    run = FakeRun(history=history(4))
    dash = live(run)
    loss = _panel(dash.chart.spec, "loss")
    assert [s["label"] for s in loss["series"]] == ["loss (mean over ranks)"]
    assert _col(dash.chart, "loss") == [5.0 / (1 + s) for s in range(4)]
    assert "every rank reports this same value" in dash.chart.notes["loss"]

    run = FakeRun(history=history(4, local=True))  # records with each rank's own loss
    dash = live(run)
    labels = [s["label"] for s in _panel(dash.chart.spec, "loss")["series"]]
    assert labels == ["loss (mean over ranks)", "rank 0 replica batch", "rank 1 replica batch"]
    for i, rank in enumerate((0, 1), start=1):
        assert _col(dash.chart, "loss", i) == [
            r["local_loss"] for r in run.history if r["rank"] == rank
        ]


def test_memory_states_and_process_are_separate_panels_per_rank():
    run = FakeRun(history=history(3))
    dash = live(run)
    spec = dash.chart.spec
    assert _panel(spec, "states")["unit"] == _panel(spec, "process")["unit"] == "B"
    assert _panel(spec, "process")["title"] == "process memory per rank (RSS)"
    for i, rank in enumerate((0, 1)):
        recs = [r for r in run.history if r["rank"] == rank]
        assert _col(dash.chart, "states", i) == [(4 + rank + 4 + 8) * MB] * 3
        assert _col(dash.chart, "process", i) == [r["rss_bytes"] for r in recs]
    assert dash.chart.notes["states"].startswith(
        "rank 0: params 4.2 MB, grads 4.2 MB, optimizer 8.4 MB · rank 1: params 5.2 MB"
    )
    assert dash.chart.notes["process"] == "peak: rank 0 127.9 MB · rank 1 129.0 MB"
    gpu = history(2)
    for rec in gpu:
        rec["device_allocated_bytes"] = 50 * MB
    dash = live(FakeRun(history=gpu))
    assert _panel(dash.chart.spec, "process")["title"] == "device memory per rank (allocated)"
    assert _col(dash.chart, "process") == [50 * MB, 50 * MB]


def test_step_and_comm_time_per_rank_with_the_health_note():
    """Step time and exposed communication are two panels of one line per rank each, in
    the rank's full colour (four ranks: four legend entries a panel, not eight pale
    lines in one)."""
    run = FakeRun(history=history(4, comm=(0.01, 0.1)))
    dash = live(run)
    for pid in ("step", "comm"):
        series = _panel(dash.chart.spec, pid)["series"]
        assert [s["label"] for s in series] == ["rank 0", "rank 1"]
        assert [s["color"] for s in series] == [rank_color(0), rank_color(1)]  # opaque
    rank1 = [r for r in run.history if r["rank"] == 1]
    assert _col(dash.chart, "step", 1) == [r["step_time_s"] for r in rank1]
    # the metered step (2) measured 0.1 s in flight, half exposed; carried forward
    assert _col(dash.chart, "comm", 1) == [None, None, 0.05, 0.05]
    metered = next(r for r in rank1 if r.get("comm_metered"))
    share = 0.05 / metered["comm_window_s"]  # of the metered step, as measured
    assert share > COMM_HEALTH
    assert f"rank 1 {share:.0%}" in dash.chart.notes["comm"]
    assert "worth a look" in dash.chart.notes["comm"]


def test_lines_that_coincide_show_every_rank():
    """Ranks that hold the same states draw the same line: each rank's is thinner than
    the one drawn before it, so rank 0 shows as the outer stripe, not hidden."""
    ranks = [0, 1, 2, 3]
    assert nested_widths(4) == [6.0, 4.5, 3.0, 1.5]
    assert nested_widths(1) == [1.5]
    assert nested_widths(16)[0] == 6.0 and nested_widths(16)[-1] == 1.5  # at most 4.5 px more
    widths = nested_widths(16)
    assert all(a > b for a, b in zip(widths, widths[1:]))
    dash = live(FakeRun(ranks=ranks, history=history(3, ranks=ranks, comm=(0.01,) * 4)))
    for pid in ("states", "process", "step", "comm"):
        assert [s["width"] for s in _panel(dash.chart.spec, pid)["series"]] == nested_widths(4)


def test_worth_a_look_gives_way_to_a_machine_whose_timings_cannot_carry_it():
    """Live, the step panel says how far each rank's normal steps spread; with steps that
    spread too widely, a share above 20% is not called worth a look. Once the run ended,
    its own verdict (hosts' load and spread, `Run.timing_verdict`) decides."""
    calm = live(FakeRun(history=history(12, comm=(0.01, 0.1))))
    assert "step times within" in calm.chart.notes["step"]
    assert "worth a look" in calm.chart.notes["comm"]
    noisy = history(12, comm=(0.01, 0.1))
    for rec in noisy:
        rec["step_time_s"] *= 1 + 2 * (rec["step"] % 2)  # every other step 3x slower
    dash = live(FakeRun(history=noisy))
    assert "timings unreliable so far: step times spread" in dash.chart.notes["step"]
    comm = dash.chart.notes["comm"]
    assert "worth a look" not in comm and "above 20%, but timings unreliable" in comm
    done = FakeRun(history=history(12, comm=(0.01, 0.1)), finished=True)
    done.timing_verdict = lambda: (
        False,
        "timings unreliable: other processes took 60% of the 2 cores",
    )
    dash = live(done)
    dash.update(force=True)
    assert dash.chart.notes["step"].startswith("timings unreliable: other processes took 60%")
    assert "worth a look" not in dash.chart.notes["comm"]


def test_throughput_unit_is_fixed_by_the_first_step():
    run = FakeRun(history=history(2, tokens=False))
    dash = live(run)
    assert _panel(dash.chart.spec, "throughput")["unit"] == "samples/s"
    slowest = [min(r["samples_per_s"] for r in run.history if r["step"] == s) for s in (0, 1)]
    assert _col(dash.chart, "throughput") == slowest
    run.history = history(2, tokens=False) + history(3)[4:]  # a later record with tokens
    dash.update()
    assert _panel(dash.chart.spec, "throughput")["unit"] == "samples/s"


def test_a_diverged_loss_is_a_gap_not_invalid_json():
    hist = history(3)
    for rec in hist[4:6]:
        rec["loss"] = math.nan
    dash = live(FakeRun(history=hist))
    assert _col(dash.chart, "loss") == [5.0, 2.5, None]
    assert dash.chart.chunk["cols"]["loss"][0][2] is None


@pytest.mark.slow  # 4 s of real time
def test_follow_thread_looks_at_least_every_second_and_shows_steps_while_they_come():
    """What the thread controls: the waits it asks for (never over MAX_WAIT_S) and that
    steps reach the page while the run trains. When the page sees them also depends on
    how busy the cores are, which a test on a shared machine cannot promise."""
    from nbpar.view.dashboard import MAX_WAIT_S

    run = FakeRun()
    dash = live(run)
    sends, waits, wait = [], [], dash._stop.wait
    dash._stop.wait = lambda s: (waits.append(s), wait(s))[1]
    dash.chart.observe(lambda change: sends.append(time.monotonic()), names="chunk")
    dash.start()
    full = history(40)
    for step in range(40):  # a step every 0.1 s, for 4 s
        run.history = full[: 2 * (step + 1)]
        time.sleep(0.1)
    run.finished, end = True, time.monotonic()
    dash.stop_following()
    assert dash.chart.points("loss") == 40
    assert waits and max(waits) <= MAX_WAIT_S
    assert min(waits) == dash.poll_s  # a look at 40 steps costs far below its budget
    assert len([t for t in sends if t < end]) >= 2, "steps shown only once the run ended"


def test_progress_bar_label_and_stop():
    run = FakeRun(history=history(3))
    dash = live(run)
    assert dash.text.startswith("step 3/20 (15%)") and "ETA" in dash.text
    assert dash.status == {"text": dash.text, "value": 3, "max": 20, "style": ""}
    assert dash._stop_button.button_style == "warning"  # as the picker's Stop
    dash._stop_button.click()
    assert run.stops == 1 and dash._stop_button.disabled
    run.history, run.finished = history(8), True
    dash.update()
    assert dash.text.startswith("stopped after 8/20 steps")
    assert dash.status["style"] == "warning" and dash.chart.chunk["status"] == dash.status
    info = dash.progress()
    assert info["s_per_step"] == pytest.approx(0.1) and info["eta_s"] is None


def test_progress_when_done_or_starting():
    run = FakeRun(history=history(20), finished=True)
    dash = Dashboard(run)
    dash.update()
    assert dash.text.startswith("done: 20/20 steps")
    assert Dashboard(FakeRun()).progress()["text"] == "starting… 0/20 steps"
    run = FakeRun(history=history(8))
    assert "ETA 1.2 s" in Dashboard(run).progress()["text"]  # 12 steps of 0.1 s left


def test_follow_returns_when_the_run_finishes_and_calls_on_finish_once():
    run = FakeRun(history=history(2))
    finished = []

    def finish():
        run.history = history(20)
        run.finished = True

    timer = threading.Timer(0.2, finish)
    timer.start()
    dash = live(run).on_finish(finished.append)
    dash.follow(poll_s=0.05)
    timer.join()
    dash.follow()
    assert finished == [dash]
    assert dash.chart.points("loss") == 20 and dash.text.startswith("done")


def test_static_figure_shows_the_same_panels():
    run = FakeRun(history=history(5, local=True))
    dash = Dashboard(run)
    assert repr(dash.figure) == "<Figure size 800x520 with 4 Axes>"  # notebook 07 shows it
    panels = dash.panels
    loss = panels["loss"]
    assert list(loss.line.get_ydata()) == [5.0 / (1 + s) for s in range(5)]
    assert list(loss.local[1].get_ydata()) == [
        r["local_loss"] for r in run.history if r["rank"] == 1
    ]
    memory = panels["memory"]
    last = [r for r in run.history if r["rank"] == 1][-1]
    assert memory.bars["params"].patches[1].get_height() == 5 * MB
    assert memory.bars["optimizer"].patches[1].get_y() == 9 * MB
    assert memory.process.patches[1].get_height() == last["rss_bytes"]
    assert memory.states_ax.get_ylim()[1] < memory.process_ax.get_ylim()[1] / 3
    assert [t.get_text() for t in memory.texts] == ["16.8 MB", "17.8 MB"]


def test_save_writes_a_png(tmp_path):
    path = Dashboard(FakeRun(history=history(4))).save(tmp_path / "dash.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_format_seconds():
    assert format_seconds(3.25) == "3.2 s"
    assert format_seconds(125) == "2 min 05 s"
    assert format_seconds(3720) == "1 h 02 min"


def test_gpu_utilisation_in_the_progress_text():
    run = FakeRun(history=history(3))
    for rec in run.history:
        rec.update(device_allocated_bytes=50_000_000, device_util_pct=80)
    assert "GPU util 80%" in Dashboard(run).progress()["text"]


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
    window = {
        r: [x for x in g if x.get("comm_metered")][-1]["comm_window_s"] for r, g in groups.items()
    }
    # bars per rank, bottom up: exposed, waiting for a slower rank, hidden by compute,
    # compute only (shares of the metered step itself, measured in its own seconds)
    exposed, wait, hidden, compute = (ax.patches[i : i + 2] for i in (0, 2, 4, 6))
    assert [p.get_height() for p in exposed] == pytest.approx(
        [0.005 / window[0], 0.015 / window[1]]
    )
    assert [p.get_height() for p in wait] == pytest.approx([0.0025 / window[0], 0.0075 / window[1]])
    assert [p.get_height() for p in hidden] == pytest.approx(
        [0.0025 / window[0], 0.0075 / window[1]]
    )
    assert [p.get_y() + p.get_height() for p in compute] == pytest.approx([1.0, 1.0])
    assert [p.get_y() for p in wait] == [p.get_height() for p in exposed]
    assert [t.get_text() for t in ax.texts[:2]] == [f"{window[r]:.3g} s" for r in (0, 1)]
    # the tick on each bar: the blocked share of a normal step, the median over the steps
    # after the first two, metered ones left out (step 2 is metered: steps 3 only)
    tick = next(line for line in ax.get_lines() if line.get_marker() == "_")
    normal = {r: [x for x in g[3:]] for r, g in groups.items()}
    assert all(not x.get("comm_metered") for g in normal.values() for x in g)
    expected = [0.6 * g[0]["comm_s"] / g[0]["step_time_s"] for g in normal.values()]
    assert list(tick.get_xdata()) == [0, 1]
    assert list(tick.get_ydata()) == pytest.approx(expected)
    note = live(run).chart.notes["comm"]
    assert "blocked on communication in a normal step (every step): rank 0 " in note
    assert f"rank 1 {expected[1]:.0%}" in note


def test_step_split_is_empty_before_the_first_metered_step():
    run = FakeRun(history=history(4)[:2])  # step 0 only: nothing metered yet
    ax = plot_step_split(run).axes[0]
    assert [p.get_height() for p in ax.patches] == [0.0] * 8
    dash = live(run)
    assert "not metered yet" in dash.chart.notes["comm"]


def test_loss_difference_figure_plots_both_curves_and_their_difference():
    from nbpar.view.plots import plot_loss_difference

    run, ref = [3.0, 2.5, 2.0], [3.0, 2.4, 2.1]
    fig = plot_loss_difference(run, ref, labels=("tp=2", "single"))
    left, right = fig.axes
    assert [list(line.get_ydata()) for line in left.get_lines()] == [ref, run]
    assert [t.get_text() for t in left.get_legend().get_texts()] == ["single", "tp=2"]
    assert list(right.get_lines()[0].get_ydata()) == pytest.approx([0.0, 0.1, -0.1])
    assert right.get_ylabel() == "tp=2 minus single"
    with pytest.raises(ValueError, match="same length"):
        plot_loss_difference(run, ref[:2])


def test_the_pace_ignores_a_metered_spike_and_a_finished_run_says_its_average():
    from nbpar.view.dashboard import seconds_per_step

    def records(gaps):
        t, out = 100.0, []
        for step, gap in enumerate(gaps):
            t += gap
            out.append({"step": step, "rank": 0, "time": t, "step_time_s": gap})
        return out

    steady = records([0.1] * 25)
    spiked = records([0.1] * 12 + [1.0] + [0.1] * 12)  # a metered step, ten times slower
    assert seconds_per_step(spiked) == pytest.approx(seconds_per_step(steady))
    # the whole run's mean: 24 gaps, one of them 1.0 s
    assert seconds_per_step(spiked, average=True) == pytest.approx((23 * 0.1 + 1.0) / 24)


def test_a_mixture_of_experts_run_shows_its_routing_imbalance():
    """A run whose records carry tokens per expert gets a panel of each rank's busiest
    expert over the mean one (the most uneven layer), and a note with every rank's
    tokens per expert summed; a dense run has no such panel."""
    hist = history(3)
    for rec in hist:
        even, skewed = [8, 8, 8, 8], [20, 4, 4, 4]
        rec["tokens_per_expert"] = {"0": even, "1": skewed if rec["rank"] else even}
    dash = live(FakeRun(history=hist))
    panel = _panel(dash.chart.spec, "routing")
    assert [s["label"] for s in panel["series"]] == ["rank 0", "rank 1"]
    assert _col(dash.chart, "routing", 0) == [1.0] * 3
    assert _col(dash.chart, "routing", 1) == [2.5] * 3  # 20 of 32 tokens, 8 the mean
    assert dash.chart.notes["routing"].startswith(
        "latest step, all ranks' tokens per expert in layer 1: 28 12 12 12"
    )
    assert "routing" not in [
        p["id"] for p in live(FakeRun(history=history(3))).chart.spec["panels"]
    ]
