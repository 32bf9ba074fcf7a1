"""A live training dashboard: loss, memory, step-time split, throughput, progress + ETA.

`Dashboard(run)` reads only ``run.history`` (records already on the client, no
engine round trip), moves its artists' data in place and re-renders the PNG at
most every ``min_interval_s``; the figure is a plain `matplotlib.figure.Figure`
(no pyplot state), shown in an ipywidgets Image so the output updates in place.
"""
from __future__ import annotations

import os
import statistics
import threading
import time

from nbpar.view.history import as_history, by_rank, steps_done
from nbpar.view.panels import LossPanel, MemoryPanel, SplitPanel, ThroughputPanel, figure_png


def format_seconds(s: float) -> str:
    """3 s, 2 min 05 s, 1 h 02 min."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def seconds_per_step(history: list[dict], window: int = 10) -> float | None:
    """Recent wall time per step of the slowest rank (step time when no timestamps)."""
    groups = by_rank(history)
    rates = []
    for recs in groups.values():
        recent = recs[-window:]
        stamps = [r["time"] for r in recent if r.get("time") is not None]
        if len(stamps) >= 2 and stamps[-1] > stamps[0]:
            rates.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        elif recent:
            rates.append(statistics.fmean(r.get("step_time_s") or 0.0 for r in recent))
    return max(rates) if rates else None


#: Largest share of wall time spent drawing the figure while following a run.
RENDER_BUDGET = 0.03

class Dashboard:
    """Live figure of one `Run`; ``update()`` redraws from the current history."""

    def __init__(self, run, *, min_interval_s: float = 0.5, figsize=(10, 6.5), dpi: int = 80):
        from matplotlib.figure import Figure

        self.run, self.min_interval_s = run, min_interval_s
        history = as_history(run)
        self.ranks = list(getattr(run, "ranks", None) or sorted({r["rank"] for r in history}))
        self.figure = Figure(figsize=figsize, dpi=dpi, layout="constrained")
        (a, b), (c, d) = self.figure.subplots(2, 2)
        self.loss, self.memory = LossPanel(a, self.ranks), MemoryPanel(b, self.ranks)
        self.split, self.throughput = SplitPanel(c, self.ranks), ThroughputPanel(d)
        self.text = ""
        self.error: BaseException | None = None
        self._seen = None          # (len(history), done) last drawn
        self._stale = True         # data changed since the last render
        self._rendered_at = self._render_s = 0.0
        self._widget = self._handle = self._thread = None
        self._stop = threading.Event()

    # -- data ------------------------------------------------------------------
    def total_steps(self) -> int | None:
        cfg = getattr(self.run, "cfg", None)
        return getattr(cfg, "steps", None)

    def progress(self, history: list[dict] | None = None, done: bool | None = None) -> dict:
        """{"steps", "total", "fraction", "s_per_step", "eta_s", "text"} of the run now."""
        history = as_history(self.run) if history is None else history
        done = self._done() if done is None else done
        n, total = steps_done(history), self.total_steps()
        rate = seconds_per_step(history)
        eta = rate * (total - n) if rate is not None and total is not None else None
        of = f"{n}/{total}" if total else f"{n}"
        pace = f" · {rate:.3g} s/step" if rate else ""
        if done and total and n < total:
            text = f"stopped after {of} steps{pace}"
        elif done:
            text = f"done: {of} steps{pace}"
        elif n == 0:
            text = f"starting… 0/{total} steps" if total else "starting…"
        else:
            pct = f" ({n / total:.0%})" if total else ""
            text = f"step {of}{pct}{pace}" + (f" · ETA {format_seconds(eta)}"
                                              if eta is not None else "")
        utils = [r["device_util_pct"] for r in history[-8:] if r.get("device_util_pct") is not None]
        if utils:  # on GPUs: NVML utilisation of the ranks' devices
            text += f" · GPU util {sum(utils) / len(utils):.0f}%"
        return {"steps": n, "total": total, "fraction": n / total if total else None,
                "s_per_step": rate, "eta_s": None if done else eta, "text": text}

    def _done(self) -> bool:
        done = getattr(self.run, "done", None)
        return bool(done()) if callable(done) else True

    def update(self, force: bool = False) -> bool:
        """Redraw from ``run.history``; render the PNG if shown and due. True if data changed."""
        history, done = as_history(self.run), self._done()
        changed = self._seen != (len(history), done)
        if changed:
            groups = by_rank(history)
            for panel in (self.loss, self.memory, self.split):
                panel.set(groups)
            self.throughput.set(history)
            self._seen, self._stale = (len(history), done), True
        info = self.progress(history, done)
        self.text = info["text"]
        self._show_progress(info, done)
        # rendering shares the cores with the engines: spend at most RENDER_BUDGET of
        # the wall time on it, however fast the steps come
        due = time.monotonic() - self._rendered_at >= max(self.min_interval_s,
                                                          self._render_s / RENDER_BUDGET)
        if (self._widget is not None or self._handle is not None) and \
                (force or (self._stale and (due or done))):
            self._render()
        return changed

    # -- output ----------------------------------------------------------------
    def png(self) -> bytes:
        return figure_png(self.figure)

    def save(self, path) -> str:
        """Write the current dashboard as a PNG file (headless; no display needed)."""
        self.update()
        self.figure.savefig(path, format="png")
        return str(path)

    def _render(self) -> None:
        start = time.monotonic()
        png = self.png()
        self._rendered_at, self._stale = time.monotonic(), False
        self._render_s = self._rendered_at - start
        if self._widget is not None:
            self._image.value = png
        if self._handle is not None:
            from IPython.display import Image

            self._handle.update(Image(png))

    def _show_progress(self, info: dict, done: bool) -> None:
        if self._widget is None:
            return
        self._bar.max = info["total"] or max(info["steps"], 1)
        self._bar.value = info["steps"]
        self._bar.bar_style = ("danger" if self.error else "success" if done and
                               info["fraction"] in (None, 1.0) else "warning" if done else "")
        self._label.value = self.text if self.error is None else f"{self.text} · error: " \
                                                                f"{self.error}"

    @property
    def widget(self):
        """An ipywidgets VBox: progress bar + label above the figure image."""
        if self._widget is None:
            import ipywidgets as w

            self._bar = w.FloatProgress(min=0, max=1, value=0,
                                        layout=w.Layout(width="40%"))
            self._label = w.Label(self.text)
            self._image = w.Image(format="png")
            self._widget = w.VBox([w.HBox([self._bar, self._label]), self._image])
            self.update(force=True)
        return self._widget

    def _ipython_display_(self):
        from IPython.display import Image, display

        try:
            display(self.widget)
        except ImportError:  # no ipywidgets: a display handle updated in place
            self.update()
            self._handle = display(Image(self.png()), display_id=True)

    # -- following a run ---------------------------------------------------------
    def follow(self, poll_s: float = 0.5) -> Dashboard:
        """Update until the run is done (or `stop_following`), then a final update."""
        while not self._done() and not self._stop.is_set():
            self.update()
            self._stop.wait(poll_s)
        self.update(force=True)
        return self

    def show(self, background: bool = True, poll_s: float = 0.5) -> Dashboard:
        """Display the widget and keep it updated (in a daemon thread by default, so the
        cell returns at once while the run trains)."""
        from IPython.display import display

        display(self)
        return self.start(poll_s) if background else self.follow(poll_s)

    def start(self, poll_s: float = 0.5) -> Dashboard:
        """`follow` in a daemon thread (ipyparallel fills the history in its own thread)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._follow_quietly, args=(poll_s,),
                                            name="nbpar-dashboard", daemon=True)
            self._thread.start()
        return self

    def _follow_quietly(self, poll_s: float) -> None:
        try:  # lowest CPU priority for this thread: training on the engines comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            self.follow(poll_s)
        except Exception as err:  # shown in the label: a thread has nowhere to raise to
            self.error = err
            self.update(force=True)

    def stop_following(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __repr__(self):
        return f"<nbpar.Dashboard ranks={self.ranks}: {self.text or 'not drawn yet'}>"
