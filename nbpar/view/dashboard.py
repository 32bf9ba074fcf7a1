"""A live training dashboard: progress + ETA, Stop, and panels that grow while a run goes.

`Dashboard(run)` reads only ``run.history`` (records already on the client, no engine
round trip). While a run goes, a thread sends the browser the steps every rank has
finished since its last look (`nbpar.view.live.LiveFeed`), every ``poll_s`` (0.8 s),
and the browser draws them (`nbpar.view.livechart.LiveChart`, uPlot): the kernel
renders no image, so busy engines cannot starve the figure. ``figure``, ``png()`` and
``save()`` give the same state as a static matplotlib figure (for files and reports).
"""

from __future__ import annotations

import statistics
import threading
import time

from nbpar.view.history import as_history, by_rank


def format_seconds(s: float) -> str:
    """3 s, 2 min 05 s, 1 h 02 min."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def seconds_per_step(
    history: list[dict], window: int = 30, groups=None, *, average: bool = False
) -> float | None:
    """Wall seconds per step of the slowest rank: the median gap between its last
    ``window`` steps (a metered step, several times slower, hardly moves it, so an ETA
    does not jump), or with ``average`` the mean over the whole run (what a finished run
    took a step). Step time where the records carry no timestamps."""
    groups = by_rank(history) if groups is None else groups
    rates = []
    for recs in groups.values():
        recent = recs if average else recs[-(window + 1) :]
        stamps = [r["time"] for r in recent if r.get("time") is not None]
        if len(stamps) >= 2 and stamps[-1] > stamps[0]:
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            rates.append(statistics.fmean(gaps) if average else statistics.median(gaps))
        elif recent:
            rates.append(statistics.fmean(r.get("step_time_s") or 0.0 for r in recent))
    return max(rates) if rates else None


#: Largest share of wall time spent rendering a PNG where no widget can be shown.
RENDER_BUDGET = 0.03
#: Largest share of one core the follow thread spends reading the history (its own CPU
#: time, not the wall time, which waits for busy cores): a look at a run of 1500 steps
#: on 2 ranks costs ~3 ms, so it looks every ``poll_s``; a much longer run is looked at
#: less often, but at least every ``MAX_WAIT_S``.
UPDATE_BUDGET = 0.02
MAX_WAIT_S = 1.0


def stop_button(**layout):
    """The one Stop button nbpar draws (the picker's and the dashboard's look alike)."""
    import ipywidgets as w

    return w.Button(
        description="Stop",
        icon="stop",
        button_style="warning",
        tooltip="stop every rank after its current step",
        layout=w.Layout(**layout),
    )


class Dashboard:
    """Live view of one `Run`; ``update()`` reads the history and sends what is new."""

    def __init__(
        self,
        run,
        *,
        poll_s: float = 0.8,
        stop_button: bool = True,
        chart=None,
        figsize=(10, 6.5),
        dpi: int = 80,
    ):
        """``chart``: a `LiveChart` already on the page to draw this run in (the
        StrategyPicker's, so a run's first step does not wait for a new view to load)."""
        self.run, self.poll_s, self.stop_button = run, poll_s, stop_button
        self.figsize, self.dpi = figsize, dpi
        history = as_history(run)
        self.ranks = list(getattr(run, "ranks", None) or sorted({r["rank"] for r in history}))
        self.text = ""
        self.error: BaseException | None = None
        self.chart, self.feed = None, None  # the browser's panels, made with the widget
        self._reuse = chart
        self._figure = self._panels = None
        self._seen = None  # (len(history), done, set-up stage) last read
        self._widget = self._handle = self._thread = None
        self._rendered_at = self._render_s = self._update_s = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # update() runs in the follow thread and in cells
        self._on_finish: list = []
        self._on_update: list = []
        self._finished = False

    # -- data ------------------------------------------------------------------
    def total_steps(self) -> int | None:
        cfg = getattr(self.run, "cfg", None)
        return getattr(cfg, "steps", None)

    def progress(
        self, history: list[dict] | None = None, done: bool | None = None, groups=None
    ) -> dict:
        """{"steps", "total", "fraction", "s_per_step", "eta_s", "text"} of the run now."""
        history = as_history(self.run) if history is None else history
        done = self._done() if done is None else done
        groups = by_rank(history) if groups is None else groups
        n = min((len(v) for v in groups.values()), default=0)
        total = self.total_steps()
        rate = seconds_per_step(history, groups=groups, average=done)
        eta = rate * (total - n) if rate is not None and total is not None else None
        of = f"{n}/{total}" if total else f"{n}"
        pace = f" · {rate:.3g} s/step" if rate else ""
        if done and total and n < total:
            text = f"stopped after {of} steps{pace}"
        elif done:
            text = f"done: {of} steps{pace}"
        elif n == 0:
            stage = self._phase()  # "starting… building the model tiny_gpt, 1 s · 0/20 steps"
            text = "starting…" + (f" {stage}" if stage else "")
            text += (" ·" if stage and total else "") + (f" 0/{total} steps" if total else "")
        else:
            pct = f" ({n / total:.0%})" if total else ""
            text = f"step {of}{pct}{pace}" + (
                f" · ETA {format_seconds(eta)}" if eta is not None else ""
            )
        utils = [r["device_util_pct"] for r in history[-8:] if r.get("device_util_pct") is not None]
        if utils:  # on GPUs: NVML utilisation of the ranks' devices
            text += f" · GPU util {sum(utils) / len(utils):.0f}%"
        return {
            "steps": n,
            "total": total,
            "fraction": n / total if total else None,
            "s_per_step": rate,
            "eta_s": None if done else eta,
            "text": text,
        }

    def _judge_timings(self) -> bool:
        """Once the run ended: give the feed the run's own verdict on its timings (the
        hosts' load and the steps' spread, `Run.timing_verdict`). True the one time it
        is new."""
        judge = getattr(self.run, "timing_verdict", None)
        if self.feed.verdict is not None or self.error is not None or not callable(judge):
            return False
        try:
            self.feed.verdict = judge()
        except Exception:  # a failed run: its error is what the page shows, not a verdict
            return False
        return True

    def _phase(self) -> str | None:
        """The run's set-up stage before its first step (`Run.phase`), if it has one."""
        return getattr(self.run, "phase", None)

    def _done(self) -> bool:
        done = getattr(self.run, "done", None)
        return bool(done()) if callable(done) else True

    def update(self, force: bool = False) -> bool:
        """Read ``run.history``: send the browser the new steps, move the progress bar.
        True if there were new records (or the run just ended)."""
        with self._lock:
            history, done = as_history(self.run), self._done()
            seen = (len(history), done, None if history else self._phase())
            changed = self._seen != seen
            self._seen = seen
            if not changed and not force:
                return False
            groups = by_rank(history)
            info = self.progress(history, done, groups)
            self.text = info["text"]
            if self.chart is not None:  # one message to the page: new steps and progress
                steps, cols, spec = self.feed.read(history)
                judged = done and self._judge_timings()
                status = self._status(info, done)
                if steps or spec is not None or judged or status != self.chart.status:
                    self.chart.push(
                        steps,
                        cols,
                        self.feed.notes() if steps or judged else None,
                        spec=spec,
                        times=self.feed.times,
                        status=status,
                    )
                if done and not self._stop_button.disabled:
                    self._stop_button.disabled = True
            if self._handle is not None and (force or done or self._png_due()):
                self._render_png()
        if changed:
            for callback in self._on_update:
                callback(self)
        return changed

    # -- static figure -----------------------------------------------------------
    @property
    def figure(self):
        """The dashboard now as a matplotlib Figure (loss, memory, step split,
        throughput), drawn from the whole history."""
        from nbpar.view.panels import LossPanel, MemoryPanel, SplitPanel, ThroughputPanel

        if self._figure is None:
            from matplotlib.figure import Figure

            self._figure = Figure(figsize=self.figsize, dpi=self.dpi, layout="constrained")
            (a, b), (c, d) = self._figure.subplots(2, 2)
            self._panels = (
                LossPanel(a, self.ranks),
                MemoryPanel(b, self.ranks),
                SplitPanel(c, self.ranks),
                ThroughputPanel(d),
            )
        history = as_history(self.run)
        groups = by_rank(history)
        for panel in self._panels[:3]:
            panel.set(groups)
        self._panels[3].set(history)
        return self._figure

    @property
    def panels(self) -> dict:
        """The static figure's panels by name (drawn from the current history)."""
        self.figure  # noqa: B018 (draws)
        return dict(zip(("loss", "memory", "split", "throughput"), self._panels))

    def png(self) -> bytes:
        from nbpar.view.panels import figure_png

        return figure_png(self.figure)

    def save(self, path) -> str:
        """Write the current dashboard as a PNG file (headless; no display needed)."""
        import pathlib

        self.update()
        pathlib.Path(path).write_bytes(self.png())
        return str(path)

    def _png_due(self) -> bool:
        wait = max(2.0, self._render_s / RENDER_BUDGET)
        return time.monotonic() - self._rendered_at >= wait

    def _render_png(self) -> None:
        from IPython.display import Image

        start = time.monotonic()
        png = self.png()
        self._rendered_at = time.monotonic()
        self._render_s = self._rendered_at - start
        self._handle.update(Image(png))

    # -- widget ------------------------------------------------------------------
    def _status(self, info: dict, done: bool) -> dict:
        """The progress line the page draws above the panels."""
        style = (
            "danger"
            if self.error
            else "success"
            if done and info["fraction"] in (None, 1.0)
            else "warning"
            if done
            else ""
        )
        text = self.text if self.error is None else f"{self.text} · error: {self.error}"
        return {
            "text": text,
            "value": info["steps"],
            "max": info["total"] or max(info["steps"], 1),
            "style": style,
        }

    @property
    def widget(self):
        """An ipywidgets VBox: Stop above the live chart (progress line and panels)."""
        if self._widget is None:
            import ipywidgets as w

            from nbpar.view.live import LiveFeed, waiting_spec
            from nbpar.view.livechart import LiveChart

            self.feed = LiveFeed(self.ranks)
            if self._reuse is not None:
                self.chart = self._reuse
                self.chart.reset(waiting_spec())
            else:
                self.chart = LiveChart(waiting_spec())
            self._stop_button = stop_button()
            self._stop_button.on_click(self._stop_clicked)
            self._widget = w.VBox(([self._stop_button] if self.stop_button else []) + [self.chart])
            self._widget.add_class("nbpar-dashboard")
            self.update(force=True)
        return self._widget

    def _stop_clicked(self, _button=None) -> None:
        self._stop_button.disabled = True
        self._stop_button.description = "stopping…"
        self.run.stop()

    @property
    def status(self) -> dict | None:
        """The progress line as the page shows it ({"text", "value", "max", "style"})."""
        return None if self.chart is None else self.chart.status

    def _ipython_display_(self):
        self.display()

    def display(self) -> None:
        """Display the widget (its plain line for a page without its model, see
        `placeholder`); with no ipywidgets, a PNG updated in place."""
        from IPython.display import Image, display

        try:
            from nbpar.view.placeholder import display_widget

            display_widget(self.widget, f"nbpar dashboard: {self.progress()['text']}")
        except ImportError:  # no widgets: a PNG display handle updated in place
            self.update()
            self._handle = display(Image(self.png()), display_id=True)

    # -- following a run ---------------------------------------------------------
    def on_update(self, callback) -> Dashboard:
        """Call ``callback(dashboard)`` after each update that read new steps."""
        self._on_update.append(callback)
        return self

    def on_finish(self, callback) -> Dashboard:
        """Call ``callback(dashboard)`` once, when following ends (the run is done)."""
        self._on_finish.append(callback)
        return self

    def follow(self, poll_s: float | None = None) -> Dashboard:
        """Update until the run is done (or `stop_following`), then a final update."""
        poll_s = self.poll_s if poll_s is None else poll_s
        while not self._done() and not self._stop.is_set():
            start = time.thread_time()
            self.update()
            self._update_s = time.thread_time() - start
            self._stop.wait(min(MAX_WAIT_S, max(poll_s, self._update_s / UPDATE_BUDGET)))
        self.update(force=True)
        self._finish()
        return self

    def _finish(self, always: bool = False) -> None:
        if self._finished or not (always or self._done()):
            return
        self._finished = True
        for callback in self._on_finish:
            callback(self)

    def show(self, background: bool = True, poll_s: float | None = None) -> Dashboard:
        """Display the widget and keep it updated (in a daemon thread by default, so the
        cell returns at once while the run trains)."""
        self.display()
        return self.start(poll_s) if background else self.follow(poll_s)

    def start(self, poll_s: float | None = None) -> Dashboard:
        """`follow` in a daemon thread (ipyparallel fills the history in its own thread).
        The thread's work per look is a few milliseconds: it keeps normal priority, so
        a machine whose cores the engines keep busy still updates it every ``poll_s``."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._follow_quietly, args=(poll_s,), name="nbpar-dashboard", daemon=True
            )
            self._thread.start()
        return self

    def _follow_quietly(self, poll_s: float | None) -> None:
        try:
            self.follow(poll_s)
        except Exception as err:  # shown in the label: a thread has nowhere to raise to
            self.error = err
            self.update(force=True)
            self._finish(always=True)

    def stop_following(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __repr__(self):
        return f"<nbpar.Dashboard ranks={self.ranks}: {self.text or 'not drawn yet'}>"
