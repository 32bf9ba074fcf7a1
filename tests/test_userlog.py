"""nbpar.log: records stay local outside an engine, reach the client's AsyncResult from an
engine, and LogPlot draws them per rank."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from nbpar.train import userlog
from nbpar.view.logplot import LogPlot


@dataclass
class FakeAR:
    data: dict = field(default_factory=dict)


@pytest.fixture(autouse=True)
def _fresh_log():
    userlog.reset()
    yield
    userlog.reset()


def test_log_outside_an_engine_keeps_records_locally():
    torch = pytest.importorskip("torch")
    first = userlog.log(loss=torch.tensor(2.5), lr=1e-3)
    second = userlog.log(loss=2.0)
    userlog.log(step=10, loss=1.0)
    third = userlog.log(loss=0.5)
    assert first == {"rank": 0, "step": 0, "loss": 2.5, "lr": 1e-3}
    assert second["step"] == 1 and third["step"] == 11
    assert userlog.RECORDS == [first, second, {"rank": 0, "step": 10, "loss": 1.0}, third]


def test_log_rejects_bad_values():
    with pytest.raises(TypeError, match="loss='high'"):
        userlog.log(loss="high")
    with pytest.raises(ValueError, match="at least one metric"):
        userlog.log()
    with pytest.raises(ValueError, match="step"):
        userlog.log(step=-1, loss=1.0)
    assert userlog.RECORDS == []


def test_logplot_one_line_per_rank_per_metric_growing_in_place():
    ars = {0: FakeAR(), 1: FakeAR()}
    plot = LogPlot(ars)
    assert plot.update() is False and plot.figure.axes == []
    for step in range(3):
        for rank in (0, 1):
            ars[rank].data[f"log/{step:08d}"] = {
                "rank": rank,
                "step": step,
                "loss": 3.0 - step + rank,
            }
    ars[1].data["run/00000000"] = {"step": 0}  # a training run's records are not logs
    assert plot.update() is True
    (ax,) = plot.figure.axes
    assert ax.get_title() == "loss" and len(ax.get_lines()) == 2
    assert list(plot.lines["loss", 1].get_ydata()) == [4.0, 3.0, 2.0]
    line = plot.lines["loss", 0]
    ars[0].data["log/00000003"] = {"rank": 0, "step": 3, "loss": 0.0, "acc": 0.9}
    assert plot.update() is True
    assert [a.get_title() for a in plot.figure.axes] == ["loss", "acc"]
    assert list(plot.lines["loss", 0].get_xdata()) == [0, 1, 2, 3]
    assert list(plot.lines["acc", 0].get_ydata()) == [0.9]
    assert list(plot.lines["acc", 1].get_ydata()) == []
    assert line is not plot.lines["loss", 0]  # a new metric re-lays out the figure
    assert plot.update() is False


@pytest.mark.timeout(120)
def test_log_on_engines_reaches_the_async_results(pool):
    code = (
        "import nbpar.train.userlog as ul\nul.reset()\n"
        "for i in range(3):\n    ul.log(loss=float(i) + ul._rank())\n"
        "n_local = len(ul.RECORDS)"
    )
    ars = {r: pool.client[pool.engine_id(r)].execute(code, block=False) for r in range(2)}
    for ar in ars.values():
        ar.get(60)
        ar.wait_for_output(10)  # data messages travel on IOPub, like printed output
    plot = LogPlot(ars)
    assert plot.update() is True, plot.records()
    assert list(plot.lines["loss", 0].get_ydata()) == [0.0, 1.0, 2.0], plot.records()
    assert list(plot.lines["loss", 1].get_ydata()) == [1.0, 2.0, 3.0]
    assert pool.run(lambda: __import__("nbpar.train.userlog").train.userlog.RECORDS) == [[], []]
