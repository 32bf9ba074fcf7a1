"""Send a run's per-step records to TensorBoard (event files) or Prometheus (a scrape endpoint).

Both are opt-in: nothing is written or served unless you call them. The Prometheus endpoint
listens on loopback by default; docs/grafana_dashboard.json plots the metric names below.
"""

from __future__ import annotations

import os

from nbpar.measure.records import MEMORY_PARTS
from nbpar.view.history import as_history, by_rank, memory_parts

#: TensorBoard tag -> record key.
SCALARS = {
    "loss": "loss",
    "time/step_s": "step_time_s",
    "time/compute_s": "compute_s",
    "time/comm_s": "comm_s",
    "throughput/samples_per_s": "samples_per_s",
    "throughput/tokens_per_s": "tokens_per_s",
    **{f"memory/{key}": key for key in (*MEMORY_PARTS, "rss_bytes", "peak_bytes")},
}


def to_tensorboard(run_or_history, logdir) -> list[str]:
    """Write one event-file directory per rank (``logdir/rank0``, ...) with loss, step
    time split, throughput and memory per step; returns the directories."""
    from torch.utils.tensorboard import SummaryWriter

    dirs = []
    for rank, records in by_rank(as_history(run_or_history)).items():
        path = os.path.join(os.fspath(logdir), f"rank{rank}")
        writer = SummaryWriter(log_dir=path)
        try:
            for rec in records:
                for tag, key in SCALARS.items():
                    if rec.get(key) is not None:
                        writer.add_scalar(
                            tag, rec[key], global_step=rec["step"], walltime=rec.get("time")
                        )
        finally:
            writer.close()
        dirs.append(path)
    return dirs


def to_wandb(run_or_history, *, project: str = "nbpar", **init_kwargs):
    """Log a run's history to Weights & Biases, when the user has it installed and
    configured (logged in, ``WANDB_API_KEY`` set, or ``WANDB_MODE=offline``).

    One W&B step per training step; each scalar of each rank as ``rank{r}/{tag}``.
    Returns the finished wandb run.
    """
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "to_wandb needs the wandb package: `pip install wandb`, then "
            "`wandb login` (or set WANDB_MODE=offline)"
        ) from None
    configured = (
        os.environ.get("WANDB_API_KEY")
        or os.environ.get("WANDB_MODE") in ("offline", "disabled")
        or getattr(getattr(wandb, "api", None), "api_key", None)
    )
    if not configured:
        raise RuntimeError(
            "wandb is installed but not configured: run `wandb login`, set "
            "WANDB_API_KEY, or set WANDB_MODE=offline"
        )
    rows = wandb_rows(run_or_history)
    config = getattr(getattr(run_or_history, "cfg", None), "to_dict", dict)()
    wb = wandb.init(project=project, config=config, **init_kwargs)
    try:
        for step, row in rows.items():
            wb.log(row, step=step)
    finally:
        wb.finish()
    return wb


def wandb_rows(run_or_history) -> dict[int, dict[str, float]]:
    """What `to_wandb` logs: {step: {"rank{r}/{tag}": value}} in step order, every
    scalar of `SCALARS` that the step's records hold."""
    rows: dict[int, dict[str, float]] = {}
    for rec in as_history(run_or_history):
        row = rows.setdefault(rec["step"], {})
        for tag, key in SCALARS.items():
            if rec.get(key) is not None:
                row[f"rank{rec['rank']}/{tag}"] = rec[key]
    return dict(sorted(rows.items()))


class PrometheusExporter:
    """Gauges of the latest step per rank, served at ``.url`` for Prometheus to scrape.

    nbpar_loss, nbpar_step, nbpar_step_seconds, nbpar_compute_seconds, nbpar_comm_seconds,
    nbpar_comm_fraction, nbpar_samples_per_second, nbpar_tokens_per_second (label rank)
    and nbpar_memory_bytes (labels rank, kind = params|grads|optimizer|other|rss|peak).
    """

    def __init__(self, port: int = 0, addr: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(
                f"port must be an integer in 0..65535 (0 = any free port), got {port!r}"
            )
        self.registry = CollectorRegistry()  # own registry: several exporters never clash

        def gauge(name, doc, labels=("rank",)):
            return Gauge(name, doc, labels, registry=self.registry)

        self.gauges = {
            "loss": gauge("nbpar_loss", "training loss of the latest step"),
            "step": gauge("nbpar_step", "latest finished step"),
            "step_time_s": gauge("nbpar_step_seconds", "wall time of the latest step"),
            "compute_s": gauge("nbpar_compute_seconds", "step time outside collectives"),
            "comm_s": gauge("nbpar_comm_seconds", "step time with a collective in flight"),
            "comm_fraction": gauge("nbpar_comm_fraction", "comm_s / step_time_s"),
            "samples_per_s": gauge("nbpar_samples_per_second", "global samples per second"),
            "tokens_per_s": gauge("nbpar_tokens_per_second", "global tokens per second"),
        }
        self.memory = gauge("nbpar_memory_bytes", "bytes held by this rank", ("rank", "kind"))
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as err:
            raise ValueError(f"cannot serve metrics on {addr}:{port}: {err}") from None
        self.addr, self.port = addr, self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def update(self, run_or_history) -> None:
        """Set every gauge from the latest record of each rank."""
        for rank, records in by_rank(as_history(run_or_history)).items():
            rec, label = records[-1], str(rank)
            step_s = rec.get("step_time_s") or 0.0
            values = {
                **rec,
                "comm_fraction": (rec.get("comm_s") or 0.0) / step_s if step_s > 0 else 0.0,
            }
            for key, g in self.gauges.items():
                if values.get(key) is not None:
                    g.labels(rank=label).set(values[key])
            parts = {
                **memory_parts(rec),
                "rss": rec.get("rss_bytes"),
                "peak": rec.get("peak_bytes"),
            }
            for kind, value in parts.items():
                if value is not None:
                    self.memory.labels(rank=label, kind=kind).set(value)

    def close(self) -> None:
        """Stop serving and free the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<nbpar.PrometheusExporter {self.url}{'' if self._server else ' (closed)'}>"
