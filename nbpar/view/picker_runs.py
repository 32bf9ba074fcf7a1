"""The StrategyPicker's list of its runs: what ran, how far, with what batch, how it ended."""

from __future__ import annotations

import html

from nbpar.model.registry import display_name
from nbpar.view.history import as_history, run_label, steps_done


def run_row(run) -> dict:
    """One run as {"run", "steps", "global batch", "precision", "state", "final loss"}."""
    cfg = run.cfg
    history = as_history(run)
    done, n = run.done(), steps_done(history)
    try:
        batch = str(cfg.global_batch(len(run.ranks)))
    except ValueError:
        batch = "?"
    losses = [r["loss"] for r in history if r.get("loss") is not None]
    state = "running" if not done else "done" if n >= cfg.steps else "stopped"
    if done:
        try:
            run.result()
        except Exception as err:  # the engines' error, in one line
            state = "failed: " + (str(err).strip().splitlines() or [type(err).__name__])[0]
    return {
        "run": f"{run_label(run)} {display_name(cfg.model)}",
        "steps": f"{n}/{cfg.steps}",
        "global batch": batch,
        "precision": cfg.precision,
        "state": state,
        "final loss": f"{losses[-1]:.4f}" if losses and done else "-",
    }


def finished_runs(runs: list) -> list:
    """The runs that ended with a result (done or stopped, not failed): what compare takes."""
    out = []
    for run in runs:
        if not run.done():
            continue
        try:
            run.result()
        except Exception:  # a failed run has no result to compare
            continue
        out.append(run)
    return out


def runs_table(runs: list) -> str:
    """HTML table of ``runs`` (``picker.runs[i]`` in the first column); "" when empty."""
    if not runs:
        return ""
    rows = [run_row(r) for r in runs]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["", *rows[0]])
    body = "".join(
        f"<tr><td><code>picker.runs[{i}]</code></td>"
        + "".join(f"<td>{html.escape(str(v))}</td>" for v in row.values())
        + "</tr>"
        for i, row in enumerate(rows)
    )
    return (
        f"<div class='nbpar-runs'><b>runs of this picker</b>"
        f"<style>.nbpar-runs td, .nbpar-runs th {{padding: 1px 10px 1px 0; "
        f"text-align: left}}</style><table><tr>{head}</tr>{body}</table></div>"
    )
