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

from nbpar.estimate import format_bytes
from nbpar.simulate.fit import DEFAULT_STRATEGIES

_STYLE = {"description_width": "120px"}
PRECISIONS = ("mixed", "bf16", "fp32")


def fit_rows_html(rows: list[dict], world_size: int, device_gb: float) -> str:
    """`what_fits` rows as an HTML table: fitting layouts first, each with its margin."""
    head = (
        "<tr><th>strategy</th><th>dp x tp x pp</th><th>peak per device</th>"
        "<th>fits</th><th>margin or reason</th></tr>"
    )
    body = []
    for r in rows:
        if "error" in r:
            cells = [r["strategy"], "", "", "no", html.escape(r["error"])]
        else:
            cells = [
                r["strategy"],
                f"{r['dp']} x {r['tp']} x {r['pp']}",
                format_bytes(r["peak_bytes"]),
                "yes" if r["fits"] else "no",
                ("" if r["fits"] else "short by ") + format_bytes(abs(r["margin_bytes"])),
            ]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    fitting = sum(r["fits"] for r in rows)
    title = (
        f"<b>{fitting} of {len(rows)} layouts fit {world_size} devices of "
        f"{device_gb:g} GB</b> (simulated peaks)"
    )
    return f"{title}<table>{head}{''.join(body)}</table>"


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
            "world_size": w.BoundedIntText(
                value=world_size, min=1, max=1 << 20, description="devices", style=_STYLE
            ),
            "device_memory_gb": w.BoundedFloatText(
                value=device_memory_gb,
                min=0.001,
                max=1e6,
                description="GB per device",
                style=_STYLE,
            ),
            "micro_batch": w.BoundedIntText(
                value=micro_batch, min=1, max=1 << 16, description="micro-batch", style=_STYLE
            ),
            "seq_len": w.BoundedIntText(
                value=seq_len, min=1, max=1 << 20, description="sequence length", style=_STYLE
            ),
            "precision": w.Dropdown(
                options=PRECISIONS, value=precision, description="precision", style=_STYLE
            ),
            "strategies": w.SelectMultiple(
                options=DEFAULT_STRATEGIES,
                value=tuple(strategies or DEFAULT_STRATEGIES),
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
        self.button.disabled = True
        self.result.value = f"simulating every strategy on {world} fake ranks..."
        try:
            strategies = self.fields["strategies"].value
            if not strategies:
                raise ValueError("choose at least one strategy")
            self.rows = what_fits(self.config(), world, device_gb, strategies=strategies)
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
        from IPython.display import display

        display(self.widget)
