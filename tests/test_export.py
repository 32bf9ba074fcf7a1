"""TensorBoard event files and the Prometheus endpoint carry the run's numbers."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import pytest

from nbpar.view.export import PrometheusExporter, to_tensorboard
from tests.viz_fakes import MB, FakeRun, history


def test_tensorboard_event_files_per_rank(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = FakeRun(history=history(4, tokens=False))
    dirs = to_tensorboard(run, tmp_path)
    assert dirs == [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    for rank, path in enumerate(dirs):
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(path))
        acc = EventAccumulator(path)
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert "throughput/tokens_per_s" not in tags  # None values are not written
        mine = [r for r in run.history if r["rank"] == rank]
        for tag, key in (
            ("loss", "loss"),
            ("memory/param_bytes", "param_bytes"),
            ("time/step_s", "step_time_s"),
            ("time/comm_s", "comm_s"),
        ):
            events = acc.Scalars(tag)
            assert [e.step for e in events] == [0, 1, 2, 3]
            assert [e.value for e in events] == pytest.approx([r[key] for r in mine])
        assert [e.wall_time for e in acc.Scalars("loss")] == pytest.approx(
            [r["time"] for r in mine]
        )


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nbpar_")
    }


def test_prometheus_serves_gauges_on_loopback_and_closes():
    run = FakeRun(history=history(3))
    exporter = PrometheusExporter()
    try:
        assert exporter.url.startswith("http://127.0.0.1:") and exporter.port > 0
        exporter.update(run)
        metrics = _scrape(exporter.url)
        last = {r["rank"]: r for r in run.history if r["step"] == 2}
        assert metrics['nbpar_loss{rank="0"}'] == pytest.approx(last[0]["loss"])
        assert metrics['nbpar_step{rank="1"}'] == 2
        assert metrics['nbpar_memory_bytes{kind="params",rank="1"}'] == 5 * MB
        assert (
            metrics['nbpar_memory_bytes{kind="other",rank="0"}'] == last[0]["rss_bytes"] - 16 * MB
        )
        assert metrics['nbpar_comm_fraction{rank="1"}'] == pytest.approx(
            last[1]["comm_s"] / last[1]["step_time_s"]
        )
        run.history = history(5)
        exporter.update(run)
        assert _scrape(exporter.url)['nbpar_step{rank="0"}'] == 4
    finally:
        exporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(exporter.url, timeout=2)


def test_prometheus_rejects_bad_ports():
    with pytest.raises(ValueError, match="port"):
        PrometheusExporter(port=70000)
    with PrometheusExporter() as first:
        with pytest.raises(ValueError, match="cannot serve"):
            PrometheusExporter(port=first.port)


def test_grafana_sample_queries_only_exported_metrics():
    import json
    import pathlib
    import re

    path = pathlib.Path(__file__).resolve().parent.parent / "docs" / "grafana_dashboard.json"
    board = json.loads(path.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"nbpar_[a-z_]+", e)}
    with PrometheusExporter() as exporter:
        exporter.update(history(1))
        served = {name.split("{")[0] for name in _scrape(exporter.url)}
    assert used and used <= served, used - served


class _FakeWandb:
    """Stands in for the wandb client (the real one needs an account and the network)."""

    def __init__(self):
        self.logged, self.finished, self.init_kwargs = [], False, None

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


def test_to_wandb_logs_every_rank_per_step(monkeypatch):
    import sys

    from nbpar.view.export import to_wandb
    from tests.viz_fakes import FakeRun, history

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = FakeRun(history=history(3))
    to_wandb(run, project="demo")
    assert fake.init_kwargs["project"] == "demo" and fake.finished
    assert [s for s, _ in fake.logged] == [0, 1, 2]
    step0 = fake.logged[0][1]
    assert step0["rank0/loss"] == run.history[0]["loss"]
    assert step0["rank1/loss"] == run.history[1]["loss"]


def test_to_wandb_explains_what_is_missing(monkeypatch):
    import sys

    import pytest

    from nbpar.view.export import to_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        to_wandb([])
    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb())
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(RuntimeError, match="wandb login"):
        to_wandb([])


def test_wandb_rows_one_row_per_step_every_rank_in_it():
    from nbpar.view.export import wandb_rows

    hist = history(3, tokens=False)
    rows = wandb_rows(list(reversed(hist)))  # records in any order
    assert list(rows) == [0, 1, 2]
    for rec in hist:
        row = rows[rec["step"]]
        assert row[f"rank{rec['rank']}/loss"] == rec["loss"]
        assert row[f"rank{rec['rank']}/memory/param_bytes"] == rec["param_bytes"]
    assert not any(k.endswith("tokens_per_s") for k in rows[0])  # None values are left out


@pytest.mark.spawn  # wandb starts its wandb-core service
def test_to_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # the monitor extra installs it
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from nbpar.view.export import to_wandb

    try:
        wb = to_wandb(FakeRun(history=history(3)), project="test", dir=str(tmp_path))
    finally:
        wandb.teardown()
    assert wb.offline and wb.project == "test"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
