"""FitPicker: will a model fit N devices of a given memory, and with which strategy?

The widget's "Simulate" button runs `nbpar.simulate.fit.what_fits`: every strategy at its
default degrees on N fake ranks, with the real strategy code (no engines, no devices),
and lists the layouts whose simulated peak fits, with the margin, then those that do not
and why. A model is one of the registered ones (built-ins, ``hf:*`` families,
`nbpar.register_model` names) with an optional ``model_config`` JSON object.
"""

from __future__ import annotations

import html
import json

from nbpar.dims import layout_words
from nbpar.estimate import format_bytes
from nbpar.simulate.fit import DEFAULT_STRATEGIES

_STYLE = {"description_width": "120px"}
PRECISIONS = ("mixed", "bf16", "fp32")


_CELL = "padding:2px 10px;text-align:left"
#: what each number box takes: field -> (label, whole number?)
NUMBERS = {
    "world_size": ("devices", True),
    "device_memory_gb": ("GB per device", False),
    "micro_batch": ("micro-batch", True),
    "seq_len": ("sequence length", True),
}


def _bar(peak: int, capacity: float) -> str:
    """The peak against the device's memory: a bar filled to peak / capacity (red when
    over, drawn to the box's end then; the number beside it says by how much)."""
    share = peak / capacity
    colour = "#2a7" if share <= 1 else "#c33"
    fill = f"{min(share, 1.0) * 100:.0f}%"
    return (
        f"<div style='width:120px;height:9px;background:#e5e5e5;display:inline-block'>"
        f"<div style='width:{fill};height:9px;background:{colour}'></div></div> "
        f"{share * 100:.0f}%"
    )


def fit_rows_html(rows: list[dict], world_size: int, device_gb: float, pending: int = 0) -> str:
    """`what_fits` rows as an HTML table: fitting layouts first, each with its margin and
    a bar of its peak against the device; ``pending`` layouts are still simulating."""
    names = ("strategy", "layout", "peak per device", "of the device", "fits", "margin")
    head = "<tr>" + "".join(f"<th style='{_CELL}'>{n}</th>" for n in names) + "</tr>"
    body = []
    for r in rows:
        if "error" in r:
            cells = [r["strategy"], "", "", "", "no", html.escape(r["error"])]
        else:
            cells = [
                r["strategy"],
                layout_words(r),
                format_bytes(r["peak_bytes"]),
                _bar(r["peak_bytes"], device_gb * 1e9),
                "yes" if r["fits"] else "no",
                ("" if r["fits"] else "short by ") + format_bytes(abs(r["margin_bytes"])),
            ]
        body.append("<tr>" + "".join(f"<td style='{_CELL}'>{c}</td>" for c in cells) + "</tr>")
    fitting = sum(r["fits"] for r in rows)
    title = (
        f"<b>{fitting} of {len(rows)} layouts fit {world_size} devices of "
        f"{device_gb:g} GB</b> (simulated peaks)"
    )
    if pending:
        title += f"; simulating {pending} more..."
    return f"{title}<table style='border-collapse:collapse'>{head}{''.join(body)}</table>"


def check_numbers(values: dict) -> list[str]:
    """Why the number boxes' values cannot be simulated, in the labels' words ([] when
    they can). Nothing is changed: a refused value stays as typed."""
    problems = []
    for field, (label, whole) in NUMBERS.items():
        v = values[field]
        if whole and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            problems.append(f"{label} must be a whole number of at least 1, got {v}")
        elif not whole and not v > 0:
            problems.append(f"{label} must be more than 0, got {v:g}")
    return problems


class FitPicker:
    """Widgets -> TrainConfig -> `what_fits`; ``.rows`` holds the last answer."""

    def __init__(
        self,
        model: str = "tiny_gpt",
        *,
        model_config: dict | None = None,
        world_size: int = 8,
        device_memory_gb: float = 80.0,
        micro_batch: int = 1,
        precision: str = "mixed",
        seq_len: int = 512,
        strategies=None,
    ):
        import ipywidgets as w

        from nbpar.view.picker_rules import model_options

        self.rows: list[dict] = []
        self.fields = {
            "model": w.Dropdown(
                options=model_options(model), value=model, description="model", style=_STYLE
            ),
            "model_config": w.Text(
                value=json.dumps(model_config) if model_config else "",
                description="model config",
                placeholder='{"hidden_size": 4096, ...}',
                style=_STYLE,
            ),
            # unbounded boxes: a bounded one silently changes 0 devices into 1
            "world_size": w.IntText(value=world_size, description="devices", style=_STYLE),
            "device_memory_gb": w.FloatText(
                value=device_memory_gb, description="GB per device", style=_STYLE
            ),
            "micro_batch": w.IntText(value=micro_batch, description="micro-batch", style=_STYLE),
            "seq_len": w.IntText(value=seq_len, description="sequence length", style=_STYLE),
            "precision": w.Dropdown(
                options=PRECISIONS, value=precision, description="precision", style=_STYLE
            ),
            "strategies": w.SelectMultiple(
                options=DEFAULT_STRATEGIES,
                value=tuple(strategies or DEFAULT_STRATEGIES),
                rows=len(DEFAULT_STRATEGIES),  # every option in view, chosen ones too
                description="strategies",
                style=_STYLE,
            ),
        }
        self.button = w.Button(description="Simulate", button_style="primary", icon="play")
        self.result = w.HTML()
        self.button.on_click(lambda _: self.simulate())
        self.widget = w.VBox([*self.fields.values(), self.button, self.result])

    def config(self):
        """The TrainConfig the widgets describe (a one-line ValueError when they cannot),
        read as ``nbpar simulate --model-config`` reads its JSON."""
        from nbpar.config import GPTConfig, TrainConfig, model_config_fields

        v = {k: f.value for k, f in self.fields.items() if k != "strategies"}
        text = v["model_config"].strip()
        extra = model_config_fields(v["model"], text) if text else {}
        extra.setdefault("gpt", GPTConfig()).seq_len = v["seq_len"]
        return TrainConfig(
            model=v["model"], micro_batch=v["micro_batch"], precision=v["precision"], **extra
        )

    def simulate(self) -> list[dict]:
        """Run `what_fits` for the widgets' values; show and return its rows."""
        from nbpar.simulate.fit import what_fits

        world = self.fields["world_size"].value
        device_gb = self.fields["device_memory_gb"].value
        problems = check_numbers({k: self.fields[k].value for k in NUMBERS})
        if problems:  # refused as typed: nothing simulated, nothing changed
            self.rows = []
            self.result.value = "<br>".join(
                f"<span style='color:#b00'>{html.escape(p)}</span>" for p in problems
            )
            return self.rows
        self.button.disabled = True
        self.result.value = f"simulating every strategy on {world} fake ranks..."

        def show(rows, total):
            self.result.value = fit_rows_html(rows, world, device_gb, pending=total - len(rows))

        try:
            strategies = self.fields["strategies"].value
            if not strategies:
                raise ValueError("choose at least one strategy")
            self.rows = what_fits(
                self.config(), world, device_gb, strategies=strategies, on_row=show
            )
            reasons = {r.get("error") for r in self.rows}
            if len(reasons) == 1 and None not in reasons:  # the model itself, not a layout
                raise ValueError(reasons.pop())
        except (ValueError, TypeError) as err:
            self.rows = []
            self.result.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            return self.rows
        finally:
            self.button.disabled = False
        self.result.value = fit_rows_html(self.rows, world, device_gb)
        return self.rows

    def _ipython_display_(self):
        from nbpar.view.placeholder import display_widget

        display_widget(self.widget, "nbpar FitPicker: which layouts fit these devices")
