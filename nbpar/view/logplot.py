"""The live figure of a ``%%dist`` cell's `nbpar.log` records: one subplot per metric,
one line per rank, redrawn in place while the cell runs (kernel side)."""

from __future__ import annotations

import time

from nbpar.train.userlog import PREFIX
from nbpar.view.panels import figure_png


class LogPlot:
    """Logged metrics per rank, one subplot per metric, one line per rank, updated in place.

    ``ars`` maps rank -> AsyncResult-like objects whose ``.data`` dict gains "log/..."
    records while the cell runs. `poll()` is cheap and safe to call every 0.1 s.
    """

    def __init__(self, ars: dict, *, min_interval_s: float = 0.5, show: bool = False):
        self.ars, self.min_interval_s, self.show = ars, min_interval_s, show
        self._figure = None  # made on first use: most cells never log anything
        self.lines: dict[tuple[str, int], object] = {}
        self.metrics: list[str] = []
        self._count, self._rendered_at, self._handle = -1, 0.0, None

    @property
    def figure(self):
        if self._figure is None:
            from matplotlib.figure import Figure

            self._figure = Figure(figsize=(9, 3), dpi=80, layout="constrained")
        return self._figure

    def records(self) -> list[dict]:
        out = []
        for rank, ar in self.ars.items():
            data = getattr(ar, "data", None)
            if isinstance(data, dict):
                out += [
                    {"rank": rank, **rec}
                    for key, rec in sorted(data.items())
                    if key.startswith(PREFIX) and isinstance(rec, dict)
                ]
        return out

    def _layout(self, metrics: list[str]) -> None:
        self.figure.clear()
        self.lines, self.metrics = {}, metrics
        axes = self.figure.subplots(1, len(metrics), squeeze=False)[0]
        for ax, metric in zip(axes, metrics):
            ax.set_title(metric, fontsize="medium")
            ax.set_xlabel("step")
            for rank in sorted(self.ars):
                self.lines[metric, rank] = ax.plot([], [], label=f"rank {rank}", lw=1.2)[0]
            if len(self.ars) > 1:
                ax.legend(fontsize="small")

    def update(self, force: bool = False) -> bool:
        """Redraw from the records received so far; True if there was anything new."""
        records = self.records()
        changed = len(records) != self._count
        if changed and records:
            self._count = len(records)
            metrics = list(
                dict.fromkeys(k for r in records for k in r if k not in ("rank", "step"))
            )
            if metrics != self.metrics:
                self._layout(metrics)
            for (metric, rank), line in self.lines.items():
                pts = sorted(
                    (r["step"], r[metric])
                    for r in records
                    if r["rank"] == rank and r.get(metric) is not None
                )
                line.set_data([p[0] for p in pts], [p[1] for p in pts])
            for ax in self.figure.axes:
                ax.relim()
                ax.autoscale_view()
        due = time.monotonic() - self._rendered_at >= self.min_interval_s
        if self.show and self.metrics and (force or (changed and due)):
            self._render()
        return changed and bool(records)

    poll = update

    def finish(self) -> None:
        """Final redraw once the cell is done."""
        self.update(force=True)

    def png(self) -> bytes:
        return figure_png(self.figure)

    def _render(self) -> None:
        from IPython.display import Image, display

        image = Image(self.png())
        self._rendered_at = time.monotonic()
        if self._handle is None:
            self._handle = display(image, display_id=True) or False  # False: no frontend
        elif self._handle:
            self._handle.update(image)

    def _ipython_display_(self):
        self.show = True
        self.update(force=True)
