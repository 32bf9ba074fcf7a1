"""Side-by-side comparison of finished runs: memory per rank, step time, communication, loss.

`compare([run_ddp, run_zero1, run_zero3])` accepts Run objects or the CLI's result dicts
and shows one table row and one bar per run, e.g. the ZeRO paper's memory staircase
(Rajbhandari et al. 2020) measured on your own pool.
"""

from __future__ import annotations

import base64
import html

from nbpar.estimate import format_bytes
from nbpar.measure.records import MEMORY_PARTS, PART_NAMES, model_state_bytes
from nbpar.view.history import COMM_HEALTH, run_label
from nbpar.view.panels import blocked_ticks, bytes_axis, figure_png

REQUIRED = ("config", "losses", "ranks", "step_time_s", "comm_fraction")
COLUMNS = (
    ("label", "run"),
    ("steps", "steps"),
    ("global_batch", "global batch"),
    ("precision", "precision"),
    ("peak_bytes", "peak/rank"),
    ("param_bytes", "params/rank"),
    ("grad_bytes", "grads/rank"),
    ("optim_bytes", "optim/rank"),
    ("step_time_s", "step time"),
    ("comm_blocked_fraction", "blocked"),
    ("comm_fraction", "comm"),
    ("exposed_comm_fraction", "exposed"),
    ("comm_wait_fraction", "waiting"),
    ("comm_bytes", "ring bytes/step/rank (c10d)"),
    ("final_loss", "final loss"),
)
#: The HTML tables, each narrow enough for a notebook (about eight columns): memory, then
#: time; every column of `COLUMNS` is in one of them.
HTML_TABLES = (
    (
        "memory per rank (the largest rank's)",
        ("label", "steps", "global_batch", "precision")
        + ("peak_bytes", "param_bytes", "grad_bytes", "optim_bytes"),
    ),
    (
        "time and communication",
        ("label", "step_time_s", "comm_blocked_fraction", "comm_fraction")
        + ("exposed_comm_fraction", "comm_wait_fraction", "comm_bytes", "final_loss"),
    ),
)
FONT = 11  # points: the figure is shown about its own width, so this is what you read


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("_bytes"):
        return format_bytes(value)
    if key == "step_time_s":
        return f"{value * 1e3:.1f} ms"
    if key.endswith("_fraction"):
        return f"{value:.0%}"
    if key == "final_loss":
        return f"{value:.4f}"
    return str(value)


def _result(obj) -> dict:
    if isinstance(obj, dict):
        res = obj
    elif callable(getattr(obj, "result", None)):
        res = obj.result()
    else:
        raise TypeError(f"compare takes Run objects or result dicts, got {type(obj).__name__}")
    missing = [k for k in REQUIRED if k not in res]
    if missing:
        raise ValueError(
            f"result dict lacks {', '.join(missing)}; expected the shape of "
            f"`nbpar train --json` ({', '.join(REQUIRED)})"
        )
    if not res["ranks"]:
        raise ValueError("result dict has an empty 'ranks' list")
    return res


def global_batch(res: dict) -> int | None:
    """Samples per optimizer step of a result dict (micro x accum x dp), None if unknown."""
    from nbpar.config import TrainConfig

    try:
        return TrainConfig.from_dict(res["config"]).global_batch(len(res["ranks"]))
    except (TypeError, ValueError, KeyError):
        return None


def summarize(obj, label: str | None = None) -> dict:
    """One table row: per-rank bytes are the largest over ranks (the rank that limits you)."""
    res = _result(obj)
    ranks = res["ranks"]
    cfg = res["config"] if isinstance(res["config"], dict) else {}
    row = {
        "label": label or run_label(res),
        "steps": len(res["losses"]),
        "global_batch": global_batch(res),
        "precision": cfg.get("precision"),
    }
    for key in ("peak_bytes", *MEMORY_PARTS):
        row[key] = max(r[key] for r in ranks)
    row["states_bytes"] = max(model_state_bytes(r) for r in ranks)
    sent = [r["comm_bytes"] for r in ranks if r.get("comm_bytes") is not None]
    row["comm_bytes"] = max(sent) if sent else None
    row.update(
        step_time_s=res["step_time_s"],
        comm_blocked_fraction=res.get("comm_blocked_fraction"),
        comm_fraction=res["comm_fraction"],
        exposed_comm_fraction=res.get("exposed_comm_fraction"),
        comm_wait_fraction=res.get("comm_wait_fraction"),
        bubble_fraction=res.get("bubble_fraction"),
        final_loss=res["losses"][-1] if res["losses"] else None,
        # whether this run's time figures can be trusted where it ran (`Run.timing_verdict`)
        timing_reliable=res.get("timing_reliable"),
        timing_note=res.get("timing_note"),
    )
    return row


def differences(rows: list[dict]) -> list[str]:
    """Warnings for runs that are not like for like (other length, batch or precision) or
    whose timings cannot be trusted where they ran."""
    out = []
    for key, what, unit, why in (
        ("steps", "length", " steps", "final losses and averages cover different spans"),
        ("global_batch", "global batch", " samples", "losses and throughput are not like for like"),
        ("precision", "precision", "", "memory, speed and losses differ by design"),
    ):
        values = {row[key] for row in rows}
        if len(values) > 1:
            each = ", ".join(f"{row['label']} {_fmt(key, row[key])}{unit}" for row in rows)
            out.append(f"runs differ in {what} ({each}): {why}")
    # a run whose machine could not carry its timings: its step time and shares say little
    out += [
        f"{row['label']}: {row['timing_note']}" for row in rows if row["timing_reliable"] is False
    ]
    return out


class Comparison:
    """``.table`` (rows), ``.warnings``, ``.figure`` (bars), ``.relative(baseline)``;
    HTML table + figure."""

    def __init__(self, rows: list[dict], projected: dict | None = None):
        self.table = rows
        self.warnings = differences(rows)
        # with compare(..., project=HW): the hardware, its description and the
        # assumptions; each row's estimate is under row["projected"] (None where it could
        # not be projected, row["projected_error"] says why)
        self.projected = projected
        self._figure = None

    @property
    def figure(self):
        if self._figure is None:
            self._figure = _figure(self.table)
        return self._figure

    def relative(self, baseline: str) -> list[dict]:
        """Each run's model states, peak and ring bytes per step (bytes a rank sends under
        the ring algorithm, counted at the c10d call) next to the ``baseline`` run's (a
        label): ``states_share`` and ``peak_share`` are row / baseline, ``comm_ratio`` ring
        bytes / baseline's (None where a run counted none). Byte ratios are exact; the
        exposed communication share, a timing, is carried along as measured."""
        rows = {row["label"]: row for row in self.table}
        if baseline not in rows:
            raise ValueError(f"no run labelled {baseline!r}; labels: {', '.join(rows)}")
        base = rows[baseline]
        sent = base["comm_bytes"]
        return [
            {
                "label": row["label"],
                "states_bytes": row["states_bytes"],
                "states_share": row["states_bytes"] / base["states_bytes"],
                "peak_bytes": row["peak_bytes"],
                "peak_share": row["peak_bytes"] / base["peak_bytes"],
                "comm_bytes": row["comm_bytes"],
                "comm_ratio": None
                if not sent or row["comm_bytes"] is None
                else row["comm_bytes"] / sent,
                "exposed_comm_fraction": row["exposed_comm_fraction"],
            }
            for row in self.table
        ]

    def __repr__(self) -> str:
        cells = [[title for _, title in COLUMNS]]
        cells += [[_fmt(key, row[key]) for key, _ in COLUMNS] for row in self.table]
        widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
            for r in cells
        ]
        measured = "\n".join(lines + [f"warning: {w}" for w in self.warnings])
        if self.projected is None:
            return measured
        from nbpar.view.compare_project import projected_table

        return projected_table(measured, {"runs": self.table, "projected": self.projected})

    def html_table(self) -> str:
        """The table as `HTML_TABLES`: one HTML table each, scrolled sideways, never cut,
        where the notebook is narrower still."""
        titles = dict(COLUMNS)
        return "".join(
            html_grid(
                caption,
                [titles[k] for k in keys],
                [[_fmt(k, row[k]) for k in keys] for row in self.table],
            )
            for caption, keys in HTML_TABLES
        )

    def png(self) -> bytes:
        return figure_png(self.figure)

    def html_warnings(self) -> str:
        return "".join(
            f"<div class='nbpar-warning' style='color:#a40;margin:2px 0'>"
            f"&#9888; {html.escape(w)}</div>"
            for w in self.warnings
        )

    def html_projection(self) -> str:
        """With a projection: each run's estimate as a table of its own, then the lines
        the text table prints after it (runs not projected, the assumptions)."""
        if self.projected is None:
            return ""
        from nbpar.view.compare_project import estimate_cells

        head = ["run", f"est. step on {self.projected['hardware']} (s)", "est. exposed"]
        rows = [
            [row["label"], *(("-", "-") if row["projected"] is None else estimate_cells(row))]
            for row in self.table
        ]
        measured = len(self.table) + 1 + len(self.warnings)
        text = "\n".join(repr(self).splitlines()[measured:])
        return (
            html_grid("estimated, not measured", head, rows)
            + f"<pre class='nbpar-projected'>{html.escape(text)}</pre>"
        )

    def _repr_html_(self) -> str:
        img = base64.b64encode(self.png()).decode("ascii")
        return (
            f"<div class='nbpar-compare'>{self.html_warnings()}{self.html_table()}"
            f"{self.html_projection()}"
            f"<img src='data:image/png;base64,{img}' style='max-width:100%'/></div>"
        )


def html_grid(caption: str, head: list[str], rows: list[list[str]]) -> str:
    """One HTML table under its caption, the first column left-aligned, numbers right;
    a notebook narrower than the table scrolls it sideways."""
    cell = "<td style='text-align:{}'>{}</td>"
    body = "".join(
        "<tr>"
        + "".join(cell.format("right" if i else "left", html.escape(c)) for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return (
        f"<div style='overflow-x:auto;max-width:100%;margin:4px 0'><table>"
        f"<caption style='text-align:left;font-weight:600'>{html.escape(caption)}</caption>"
        f"<tr>{''.join(f'<th>{html.escape(t)}</th>' for t in head)}</tr>{body}</table></div>"
    )


def _figure(rows: list[dict]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.0), dpi=90, layout="constrained")
    axes = fig.subplots(1, 4)
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    panels = (
        ("peak_bytes", "peak memory per rank", "tab:blue"),
        ("step_time_s", "step time (s)", "tab:gray"),
        ("exposed_comm_fraction", "exposed communication share", "tab:red"),
        ("final_loss", "final loss", "tab:purple"),
    )
    for ax, (key, title, color) in zip(axes, panels):
        ax.bar(x, [r[key] if r[key] is not None else 0.0 for r in rows], color=color, label=title)
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=FONT)
        ax.tick_params(axis="y", labelsize=FONT)
        ax.set_title(title, fontsize=FONT + 1)
    bytes_axis(axes[0])
    exposed = [r["exposed_comm_fraction"] or 0.0 for r in rows]
    wait = [r.get("comm_wait_fraction") or 0.0 for r in rows]
    if any(wait):  # waiting for a slower rank, stacked on the exposed share
        axes[2].bar(x, wait, bottom=exposed, color="tab:orange", label="waiting for a rank")
    blocked = [r["comm_blocked_fraction"] for r in rows]
    if any(b is not None for b in blocked):  # a normal step's blocked share, on each bar
        blocked_ticks(axes[2], blocked, label="blocked, a normal step", size=24)
    axes[2].axhline(COMM_HEALTH, ls="--", color="k", lw=1, label=f"{COMM_HEALTH:.0%} exposed")
    # below the panels, where it covers no bar: every mark of the communication panel
    fig.legend(
        *axes[2].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=4,
        fontsize=FONT - 1,
    )
    return fig


def compare(runs, labels=None, project=None) -> Comparison:
    """Compare Runs or result dicts; ``labels`` default to "strategy/backend" (made unique).
    ``project``: a `nbpar.hardware` preset name or `Hardware`; each run's step there,
    estimated by `nbpar.project`, goes under its row's ``projected`` and after the table."""
    runs = list(runs) if isinstance(runs, (list, tuple)) else [runs]
    if not runs:
        raise ValueError("compare needs at least one run or result dict")
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"labels has {len(labels)} entries for {len(runs)} runs")
    hw = None
    if project is not None:  # an unknown name stops here, before any run is read
        from nbpar.hardware import lookup

        hw = lookup(project)
    results = [_result(r) for r in runs]
    rows = [summarize(r, None if labels is None else labels[i]) for i, r in enumerate(results)]
    seen: dict[str, int] = {}
    for row in rows:
        n = seen[row["label"]] = seen.get(row["label"], 0) + 1
        if n > 1:
            row["label"] = f"{row['label']} ({n})"
    if hw is None:
        return Comparison(rows)
    from nbpar.view.compare_project import project_rows

    return Comparison(rows, project_rows(rows, results, hw))


def describe(res: dict) -> list[str]:
    """A result dict (`Run.result()`, `nbpar train --json`) as a few lines: what ran,
    the loss from first to last, timing and the largest rank's memory."""
    row = summarize(res)
    cfg = res["config"] if isinstance(res["config"], dict) else {}
    losses = res["losses"]
    batch = f"global batch {row['global_batch']}" if row["global_batch"] else "global batch ?"
    lines = [
        f"{row['label']} {cfg.get('model', '')}: {row['steps']} steps, {batch}, "
        f"{row['precision']}".replace(" :", ":")
    ]
    if losses:
        lines.append(
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (all {len(losses)} values: ['losses'])"
        )
    timing = f"step time {_fmt('step_time_s', res['step_time_s'])}, "
    if res.get("comm_blocked_fraction") is not None:
        timing += f"blocked {_fmt('comm_blocked_fraction', res['comm_blocked_fraction'])} "
        timing += "of a normal step; metered step: "
    timing += f"communication {_fmt('comm_fraction', res['comm_fraction'])}"
    if res.get("exposed_comm_fraction") is not None:
        timing += f" ({_fmt('exposed_comm_fraction', res['exposed_comm_fraction'])} exposed"
        if res.get("comm_wait_fraction") is not None:
            timing += f", {_fmt('comm_wait_fraction', res['comm_wait_fraction'])} waiting"
        timing += ")"
    if res.get("bubble_fraction") is not None:
        timing += f", pipeline bubble {res['bubble_fraction']:.0%}"
    lines.append(timing)
    for r in res["ranks"]:
        parts = ", ".join(f"{PART_NAMES[k]} {_fmt(k, r.get(k))}" for k in MEMORY_PARTS)
        lines.append(f"rank {r['rank']}: peak {_fmt('peak_bytes', r.get('peak_bytes'))}, {parts}")
    return lines
