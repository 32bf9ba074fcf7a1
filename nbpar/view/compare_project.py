"""`compare(runs, project=HW)`: each finished run's step on real hardware, estimated by
`nbpar.project` from what the run measured, beside the measured row and apart from it
(the estimate columns follow a bar, every assumption is printed once)."""

from __future__ import annotations


def model_params(config: dict) -> int:
    """The parameter count of a result's model, built on the meta device (no weights)."""
    import torch

    from nbpar.config import TrainConfig
    from nbpar.model.models import build_model

    with torch.device("meta"):
        model = build_model(TrainConfig.from_dict(config))
    return sum(p.numel() for p in model.parameters())


def project_rows(rows: list[dict], results: list[dict], hw) -> dict:
    """Set each row's ``projected`` to its run's `nbpar.project` on ``hw`` (None, with
    ``projected_error`` the line why, where it cannot be projected); the hardware and
    the assumptions of them all, each once."""
    from nbpar.project import project

    notes: list[str] = []
    for row, res in zip(rows, results):
        try:
            est = project(res, hw, params=model_params(res["config"]))
        except (ValueError, TypeError) as err:
            row["projected"], row["projected_error"] = None, str(err)
            continue
        row["projected"] = {**est.to_json(), "hardware": hw.name}
        notes += est.assumptions
    return {"hardware": hw.name, "description": hw.describe(), "assumptions": notes}


def projected_table(measured: str, out: dict) -> str:
    """The measured table; with a projection its estimate columns after a bar, the rows
    it could not project, and its assumptions once."""
    proj = out.get("projected")
    if proj is None:
        return measured
    from nbpar.project import describe_assumptions

    lines = measured.splitlines()
    table, warnings = lines[: 1 + len(out["runs"])], lines[1 + len(out["runs"]) :]
    cells = [(f"est. step on {proj['hardware']} (s)", "est. exposed")]
    cells += [("-", "-") if r["projected"] is None else estimate_cells(r) for r in out["runs"]]
    widths = [max(len(c[i]) for c in cells) for i in (0, 1)]
    width = max(map(len, table))
    rows = [
        f"{m.ljust(width)}  |  {a.rjust(widths[0])}  {b.rjust(widths[1])}"
        for m, (a, b) in zip(table, cells)
    ]
    rows += warnings
    rows += [
        f"est.: {r['label']}: {r['projected_error']}" for r in out["runs"] if r["projected"] is None
    ]
    rows.append(f"est. = estimated by nbpar.project, not measured, on {proj['description']}")
    if proj["assumptions"]:
        rows += ["assumptions:", describe_assumptions(proj["assumptions"])]
    return "\n".join(rows)


def estimate_cells(row: dict) -> tuple[str, str]:
    """A row's estimated step (seconds) and exposed communication share, as printed."""
    p = row["projected"]
    return f"{p['step_s']:.3g}", f"{p['exposed_share']:.1%}"
