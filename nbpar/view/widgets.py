"""StrategyPicker: choose a training experiment with widgets, see why a choice cannot run
before launching it, then train it on the pool with a live dashboard."""
from __future__ import annotations

import html

from nbpar import config as C

_DEGREES = ("dp", "tp", "pp")

_INT_FIELDS = {"micro_batch": ("micro-batch", 8, 4096), "grad_accum": ("grad accum", 1, 4096),
               "steps": ("steps", 20, 10 ** 7)}


class StrategyPicker:
    """Widgets -> `TrainConfig` -> ``pool.train(cfg)``; ``.config()``, ``.run``."""

    def __init__(self, pool, *, background: bool = True, **defaults):
        import ipywidgets as w

        self.pool, self.background = pool, background
        self.run = self.dashboard = None
        cfg = C.TrainConfig(**defaults)
        n = pool.n
        # 0 means auto: ipywidgets shows a None value as an empty selection
        degrees = [("auto", 0)] + [(str(i), i) for i in range(1, n + 1)]
        style = {"description_width": "90px"}

        def pick(name, options):
            value = getattr(cfg, name)
            if name in _DEGREES:
                value = value or 0
            return w.Dropdown(options=options, value=value, description=name,
                              style=style, layout=w.Layout(width="230px"))

        self.fields = {"model": pick("model", C.MODELS),
                       "strategy": pick("strategy", C.STRATEGIES),
                       "backend": pick("backend", C.BACKENDS),
                       **{k: pick(k, degrees) for k in ("dp", "tp", "pp")},
                       "schedule": pick("schedule", C.SCHEDULES),
                       "precision": pick("precision", C.PRECISIONS),
                       "offload": pick("offload", C.OFFLOADS)}
        for name, (label, _, top) in _INT_FIELDS.items():
            self.fields[name] = w.BoundedIntText(value=getattr(cfg, name), min=1, max=top,
                                                 description=label, style=style,
                                                 layout=w.Layout(width="230px"))
        self._base = cfg
        self.batch_label = w.HTML()
        self.explanation = w.HTML()
        self.button = w.Button(description="Run", button_style="primary", icon="play")
        self.output = w.Output()
        f = self.fields
        columns = [w.VBox([f[k] for k in ("model", "strategy", "backend", "schedule")]),
                   w.VBox([f[k] for k in ("dp", "tp", "pp", "precision")]),
                   w.VBox([f[k] for k in ("micro_batch", "grad_accum", "steps", "offload")])]
        self.widget = w.VBox([w.HBox(columns), self.batch_label,
                              w.HBox([self.button, self.explanation]), self.output])
        for widget in self.fields.values():
            widget.observe(self._refresh, names="value")
        self.button.on_click(self._launch)
        self._refresh()

    def world_size(self, strategy: str | None = None) -> int:
        """Ranks the run would use: 1 for strategy single, else the whole pool."""
        strategy = strategy or self.fields["strategy"].value
        return 1 if strategy == "single" else self.pool.n

    def config(self) -> C.TrainConfig:
        """The TrainConfig the widgets describe now (not validated)."""
        values = {k: (widget.value or None) if k in _DEGREES else widget.value
                  for k, widget in self.fields.items()}
        return C.TrainConfig.from_dict({**self._base.to_dict(), **values})

    def check(self) -> str | None:
        """None if the current choice can run on this pool, else the reason."""
        cfg = self.config()
        try:
            cfg.validate(self.world_size(cfg.strategy))
        except ValueError as err:
            return str(err)
        return None

    def global_batch_text(self) -> str:
        cfg = self.config()
        try:
            dp = cfg.dims(self.world_size(cfg.strategy)).dp
        except ValueError:
            return (f"global batch = micro x accum x dp = {cfg.micro_batch} x "
                    f"{cfg.grad_accum} x ? (degrees do not fit the pool)")
        return (f"global batch = micro x accum x dp = {cfg.micro_batch} x {cfg.grad_accum} x "
                f"{dp} = {cfg.micro_batch * cfg.grad_accum * dp}")

    def _refresh(self, _change=None) -> None:
        self.batch_label.value = html.escape(self.global_batch_text())
        problem = self.check()
        self.button.disabled = problem is not None
        if problem is None:
            cfg = self.config()
            d = cfg.dims(self.world_size(cfg.strategy))
            self.explanation.value = html.escape(
                f"ready: {cfg.strategy}/{cfg.backend} on {d.world_size} rank(s), "
                f"dp={d.dp} tp={d.tp} pp={d.pp}")
        else:
            self.explanation.value = (f"<span style='color:#b00'>cannot run: "
                                      f"{html.escape(problem)}</span>")

    @property
    def message(self) -> str:
        """The explanation line as plain text."""
        import re

        return html.unescape(re.sub(r"<[^>]+>", "", self.explanation.value))

    def _launch(self, _button=None):
        """The Run button: validate again, train, show the run's dashboard."""
        from IPython.display import display

        from nbpar.view.dashboard import Dashboard

        if self.check() is not None:
            self._refresh()
            return None
        cfg = self.config()
        self.button.disabled = True
        try:
            self.run = self.pool.train(cfg)
        except Exception as err:  # pool closed, engine died: say so next to the button
            self.explanation.value = (f"<span style='color:#b00'>could not start: "
                                      f"{html.escape(str(err))}</span>")
            return None
        finally:
            self.button.disabled = self.check() is not None
        self.dashboard = Dashboard(self.run)
        self.output.clear_output(wait=True)
        with self.output:
            display(self.dashboard.widget)
        if self.background:
            self.dashboard.start()
        else:
            self.dashboard.follow()
        return self.run

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def __repr__(self):
        return f"<nbpar.StrategyPicker {self.message}>"
