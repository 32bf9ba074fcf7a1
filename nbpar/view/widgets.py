"""StrategyPicker: choose a training experiment with widgets, see every reason a choice
cannot run before launching it, train it on the pool with a live dashboard, and keep
the list of what ran.

Only the controls that apply to the chosen strategy are shown (schedule for pipeline
and hybrid, the degrees it can set besides its own (`strategies.settable_degrees`: tp
for torch ZeRO, all three for hybrid), offload for DeepSpeed); hidden ones take the
config's defaults. The rules are `TrainConfig.validate`'s, asked through
`nbpar.view.picker_rules`, which lists all problems at once in the labels' words.
"""

from __future__ import annotations

import html

import traitlets

from nbpar import config as C
from nbpar.checks import checkpointing_kind, positive_int
from nbpar.strategies import engines_for, settable_degrees, splits
from nbpar.view import picker_rules as R
from nbpar.view.dashboard import stop_button
from nbpar.view.picker_rules import model_options

_STYLE = {"description_width": "90px"}


def _number_box_class():
    import ipywidgets as w

    class NumberBox(w.Text):
        """A text box for a whole number that keeps what was typed (no silent clamping
        or dropped characters); ``box.value = 4`` works and shows "4"."""

        value = traitlets.CUnicode(help="what the box shows").tag(sync=True)

    return NumberBox


class StrategyPicker:
    """Widgets -> `TrainConfig` -> ``pool.train(cfg)``; ``.config()``, ``.run``, ``.runs``."""

    def __init__(self, pool, *, background: bool = True, **defaults):
        import ipywidgets as w

        self.pool, self.background = pool, background
        self._message = ""
        self._auto_layout: dict | None = None  # degrees the picker set for a hybrid
        self.run = self.dashboard = None
        self.runs: list = []
        self.running = False
        cfg = C.TrainConfig(**defaults)
        if "schedule" not in defaults:  # valid for every pipeline, whatever the accumulation
            cfg.schedule = "gpipe"
        self._base = cfg
        layout = w.Layout(width="230px")

        def pick(name, options):
            value = getattr(cfg, name)
            if name in R.DEGREES:  # 0 means auto: ipywidgets shows None as no selection
                value = value or 0
            return w.Dropdown(
                options=options,
                value=value,
                description=R.LABELS[name],
                style=_STYLE,
                layout=w.Layout(width="230px"),
            )

        degrees = [("auto", 0)] + [(str(i), i) for i in range(1, pool.n + 1)]
        self.fields = {
            "model": pick("model", model_options(cfg.model)),
            "strategy": pick("strategy", C.STRATEGIES),
            "backend": pick("backend", C.BACKENDS),
            "schedule": pick("schedule", C.SCHEDULES),
            "attention": pick("attention", C.ATTENTIONS),
            **{k: pick(k, degrees) for k in R.DEGREES},
            "precision": pick("precision", C.PRECISIONS),
            "offload": pick("offload", C.OFFLOADS),
            "activation_checkpointing": w.Dropdown(
                options=[("none", False), ("full", "full"), ("selective", "selective")],
                value=checkpointing_kind(cfg.activation_checkpointing) or False,
                description=R.LABELS["activation_checkpointing"],
                style=_STYLE,
                layout=w.Layout(width="230px"),
            ),
            "sequence_parallel": w.Checkbox(
                value=cfg.sequence_parallel,
                description=R.LABELS["sequence_parallel"],
                style=_STYLE,
                layout=w.Layout(width="230px"),
            ),
        }
        box = _number_box_class()
        for name in R.COUNTS:
            self.fields[name] = box(
                value=str(getattr(cfg, name)),
                description=R.LABELS[name],
                style=_STYLE,
                layout=layout,
                continuous_update=True,
            )
        self._build_layout(w)
        for widget in self.fields.values():
            widget.observe(self._refresh, names="value")
        self._refresh()

    def _build_layout(self, w) -> None:
        f = self.fields
        self.batch_label = w.HTML()
        self.explanation = w.HTML()
        self.button = w.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = stop_button(display="none")
        self.runs_list = w.HTML()
        self.compare_button = w.Button(
            description="Compare these runs",
            icon="table",
            tooltip="nbpar.compare of the finished runs: memory, time, bytes, loss side by side",
            layout=w.Layout(width="auto", display="none"),
        )
        self.compare_output = w.Output()
        self.output = w.Output()
        # the runs' chart, on the page before the first run (hidden), so a run's first
        # step is drawn as soon as it is done, not after the chart's code has loaded
        from nbpar.view.live import waiting_spec
        from nbpar.view.livechart import LiveChart

        self.chart = LiveChart(waiting_spec())
        for widget, name in (
            (self.batch_label, "batch"),
            (self.explanation, "explanation"),
            (self.runs_list, "runs-list"),
            (self.button, "run"),
            (self.stop_button, "stop"),
            (self.compare_button, "compare"),
        ):
            widget.add_class(f"nbpar-{name}")
        columns = [
            w.VBox([f[k] for k in ("model", "strategy", "backend", "schedule", "attention")]),
            w.VBox([f[k] for k in (*R.DEGREES, "precision", "offload")]),
            w.VBox(
                [f[k] for k in R.COUNTS] + [f["activation_checkpointing"], f["sequence_parallel"]]
            ),
        ]
        self.widget = w.VBox(
            [
                w.HBox(columns),
                self.batch_label,
                w.HBox([self.button, self.stop_button, self.explanation]),
                self.runs_list,
                self.compare_button,
                self.compare_output,
                self.output,
                w.Box([self.chart], layout=w.Layout(display="none")),
            ]
        )
        self.widget.add_class("nbpar-picker")
        self.button.on_click(self._launch)
        self.stop_button.on_click(self._stop)
        self.compare_button.on_click(self._show_comparison)

    # -- what the widgets say ------------------------------------------------------
    def world_size(self, strategy: str | None = None) -> int:
        """Ranks the run would use: 1 for strategy single, else the whole pool."""
        strategy = strategy or self.fields["strategy"].value
        return engines_for(strategy, self.pool.n)

    def applies(self, name: str) -> bool:
        """Whether control ``name`` applies to the chosen strategy and backend."""
        strategy, backend = self.fields["strategy"].value, self.fields["backend"].value
        if name == "schedule":
            return strategy in C.PIPELINED
        if name == "attention":  # how a sequence split over cp ranks is attended to
            return strategy == "cp" or (strategy == "hybrid" and (self.fields["cp"].value or 1) > 1)
        if name in R.DEGREES:
            return name in settable_degrees(strategy, backend)
        if name == "offload":
            return backend == "deepspeed"
        if name == "activation_checkpointing":  # a model that runs its blocks in order
            return self.fields["model"].value != "simple_cnn"
        if name == "sequence_parallel":  # Megatron's: the norms' tokens over the tp ranks
            return "tp" in splits(strategy, backend) and (
                strategy == "tp" or (self.fields["tp"].value or 1) > 1
            )
        return True

    def _values(self) -> tuple[dict, list[str]]:
        """(TrainConfig fields, problems of the number boxes). A box that holds no valid
        number contributes a neutral value, so the other problems can still be found."""
        values, box_problems = self._base.to_dict(), []
        for name, widget in self.fields.items():
            if not self.applies(name):
                continue  # the config's default
            if name in R.COUNTS:
                value, problem = R.parse_count(name, widget.value)
                if problem:
                    box_problems.append(problem)
                    value = R.NEUTRAL[name]
                values[name] = value
            else:
                values[name] = (widget.value or None) if name in R.DEGREES else widget.value
        if not self.applies("schedule"):
            values["schedule"] = C.DEFAULT_SCHEDULE
        if not self.applies("attention"):
            values["attention"] = C.DEFAULT_ATTENTION
        if not self.applies("sequence_parallel"):
            values["sequence_parallel"] = False
        if not self.applies("activation_checkpointing"):
            values["activation_checkpointing"] = False
        if values["model"] != self._base.model:  # the given sizes, data and loss were its
            values.update(model_config=None, dataset=None, loss=None)
        return values, box_problems

    def config(self) -> C.TrainConfig:
        """The TrainConfig the widgets describe now (not validated); ValueError when a
        number box does not hold a whole number."""
        values, box_problems = self._values()
        if box_problems:
            raise ValueError("; ".join(box_problems))
        return C.TrainConfig.from_dict(values)

    @property
    def problems(self) -> list[str]:
        """Every reason the current choice cannot run on this pool ([] when it can)."""
        values, found = self._values()
        return found + R.problems(values, self.world_size(values["strategy"]))

    def check(self) -> str | None:
        """None if the current choice can run on this pool, else the reasons, one a line."""
        found = self.problems
        return "\n".join(found) if found else None

    def global_batch_text(self) -> str:
        head = "global batch = micro-batch × grad accum × dp"
        try:
            cfg = self.config()
            dp = cfg.dims(self.world_size(cfg.strategy)).dp
            for name in ("micro_batch", "grad_accum"):  # no product of a refused size
                positive_int(name, getattr(cfg, name))
        except ValueError:
            return f"{head} = ? (see below)"
        return (
            f"{head} = {cfg.micro_batch} × {cfg.grad_accum} × {dp} = "
            f"{cfg.micro_batch * cfg.grad_accum * dp}"
        )

    @property
    def message(self) -> str:
        """The explanation next to Run, as plain text (one problem a line)."""
        return self._message

    def _say(self, text: str, html_text: str | None = None) -> None:
        self._message = text
        self.explanation.value = html.escape(text) if html_text is None else html_text

    # -- state -----------------------------------------------------------------------
    def _refresh(self, _change=None) -> None:
        for name, widget in self.fields.items():
            widget.layout.display = None if self.applies(name) else "none"
        strategy = self.fields["strategy"].value
        if strategy == "hybrid" and not any(self.fields[k].value for k in R.DEGREES):
            layout = R.hybrid_layout(self._values()[0], self.pool.n)
            if layout:  # explicit degrees that fit this pool, to start from
                self._auto_layout = layout  # said next to Run while the degrees keep it
                for k, v in layout.items():
                    self.fields[k].value = v  # observers refresh again
                return
        self.batch_label.value = html.escape(self.global_batch_text())
        found = self.problems
        self.button.disabled = self.running or bool(found)
        if self.running:
            return
        if found:
            items = "".join(f"<li>{html.escape(p)}</li>" for p in found)
            text = (
                f"cannot run: {found[0]}"
                if len(found) == 1
                else "cannot run:\n" + "\n".join(f"- {p}" for p in found)
            )
            self._say(
                text,
                f"<div class='nbpar-problems' style='color:#b00'>cannot run:"
                f"<ul style='margin:0;padding-left:1.4em'>{items}</ul></div>",
            )
        else:
            cfg = self.config()
            d = cfg.dims(self.world_size(cfg.strategy))
            ranks = "1 rank" if d.world_size == 1 else f"{d.world_size} ranks"
            layout = f"dp {d.dp} × tp {d.tp} × pp {d.pp}" + (f" × cp {d.cp}" if d.cp > 1 else "")
            text = f"ready: {cfg.strategy}/{cfg.backend} on {ranks}, {layout}"
            if d.ep > 1:
                text += f", experts over ep {d.ep}"
            auto = self._auto_layout or {}
            chosen = {k: self.fields[k].value for k in auto}
            if cfg.strategy == "hybrid" and auto and chosen == auto:
                text += (
                    f" (the degrees were auto: hybrid needs all three, so the picker set a "
                    f"layout that runs on {self.pool.n} engines; change them above)"
                )
            self._say(text)

    def _set_running(self, running: bool) -> None:
        self.running = running
        self.button.description = "running..." if running else "Run"
        self.button.icon = "spinner" if running else "play"
        self.button.disabled = running or bool(self.problems)
        self.stop_button.layout.display = None if running else "none"
        self.stop_button.disabled = not running
        self.stop_button.description = "Stop"
        if running:
            self._say(f"running picker.runs[{len(self.runs)}]: Stop ends it after the current step")

    def _stop(self, _button=None) -> None:
        if self.run is not None and self.running:
            self.stop_button.disabled = True
            self.stop_button.description = "stopping..."
            self.run.stop()

    def _launch(self, _button=None):
        """The Run button: validate again, train, show the run's dashboard."""

        from nbpar.view.dashboard import Dashboard

        if self.running:
            return None  # the button is disabled while a run goes
        if self.problems:
            self._refresh()
            return None
        cfg = self.config()
        self._set_running(True)
        try:
            run = self.pool.train(cfg)
        except Exception as err:  # pool closed, engine died: say so next to the button
            self._set_running(False)
            self._say(
                f"could not start: {err}",
                f"<span style='color:#b00'>could not start: {html.escape(str(err))}</span>",
            )
            return None
        self.run = run
        self.runs.append(run)
        self.dashboard = Dashboard(run, stop_button=False, chart=self.chart)
        # the runs list counts the steps as the progress bar does, not only at the ends
        self.dashboard.on_update(lambda _d: self._show_runs()).on_finish(self._finished)
        self._show_runs()
        self.output.clear_output(wait=True)
        with self.output:
            self.dashboard.display()  # the widget, with its one plain line (`placeholder`)
        if self.background:
            self.dashboard.start()
        else:
            self.dashboard.follow()
        return run

    def _finished(self, _dashboard) -> None:
        self._show_runs()  # the runs list is current before Run comes back
        self._set_running(False)
        self._refresh()

    def _show_runs(self) -> None:
        from nbpar.view.picker_runs import finished_runs, runs_table

        self.runs_list.value = runs_table(self.runs)
        # offered once two runs have results to put side by side
        self.compare_button.layout.display = None if len(finished_runs(self.runs)) > 1 else "none"

    def compare(self):
        """`nbpar.compare` of this picker's finished runs (failed and running ones left
        out), labelled ``picker.runs[i]`` as the list of runs names them."""
        from nbpar.view.compare import compare
        from nbpar.view.history import run_label
        from nbpar.view.picker_runs import finished_runs

        done = finished_runs(self.runs)
        if not done:
            raise ValueError("no finished run to compare yet: press Run, let it finish")
        labels = [f"runs[{self.runs.index(r)}] {run_label(r)}" for r in done]
        return compare(done, labels=labels)

    def _show_comparison(self, _button=None) -> None:
        from IPython.display import display

        self.compare_output.clear_output(wait=True)
        with self.compare_output:
            display(self.compare())

    def _ipython_display_(self):
        from nbpar.view.placeholder import display_widget

        f = {name: widget.value for name, widget in self.fields.items()}
        display_widget(
            self.widget,
            f"nbpar StrategyPicker: model {f['model']}, strategy {f['strategy']}, "
            f"{self.pool.n} engines",
        )

    def __repr__(self):
        return f"<nbpar.StrategyPicker {self.message}>"
