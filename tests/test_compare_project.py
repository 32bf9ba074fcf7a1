"""`nbpar compare --project HARDWARE`: each run's step on real GPUs, estimated by
`nbpar.project`, in columns of their own beside the measured ones (no engines: the
runs are result dicts as `nbpar train --json` prints them)."""

from __future__ import annotations

import json

import pytest

import nbpar
from nbpar.cli import main
from nbpar.config import TrainConfig
from nbpar.model.models import build_model
from nbpar.view.compare import compare

HW = "8xH100-SXM"


def result(by_op: dict | None, **cfg) -> dict:
    """A two-rank result of tiny_gpt (or ``cfg``'s model) that metered ``by_op``."""
    config = TrainConfig(steps=3, **cfg).to_dict()
    ranks = [
        {
            "rank": r,
            "param_bytes": 4000 + r,
            "grad_bytes": 4000,
            "optim_bytes": 8000,
            "peak_bytes": 20_000 + r,
            "comm_bytes": None if by_op is None else sum(by_op.values()) + r,
            "comm_bytes_by_op": by_op,
        }
        for r in (0, 1)
    ]
    return {
        "config": config,
        "losses": [3.0, 2.5, 2.0],
        "ranks": ranks,
        "step_time_s": 0.04,
        "comm_fraction": 0.3,
        "exposed_comm_fraction": 0.1,
        "comm_wait_fraction": 0.02,
        "bubble_fraction": None,
    }


RUNS = {
    "ddp": result({"all_reduce": 350_000}, strategy="ddp"),
    "zero3": result({"all_gather": 260_000, "reduce_scatter": 130_000}, strategy="zero3"),
    "cnn": result({"all_reduce": 90_000}, strategy="ddp", model="simple_cnn"),
}


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, res in RUNS.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(res))
    return [str(p) for p in paths.values()]


def expected(res: dict):
    """`nbpar.project` of the run, with its model's parameters counted here."""
    model = build_model(TrainConfig.from_dict(res["config"]))
    return nbpar.project(res, HW, params=sum(p.numel() for p in model.parameters()))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["compare", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_rows_carry_the_projection_apart_from_the_measured_keys(files, capsys):
    code, out, _ = run_cli(capsys, *files, "--project", HW, "--json")
    assert code == 0
    doc = json.loads(out)
    measured = compare(list(RUNS.values())).table  # the same rows, without a projection
    for row, want, res in zip(doc["runs"], measured, RUNS.values()):
        assert {k: v for k, v in row.items() if not k.startswith("projected")} == want
        if res["config"]["model"] == "simple_cnn":  # reads no tokens: nothing to project
            assert row["projected"] is None and "tokens" in row["projected_error"]
            continue
        est = expected(res)
        assert row["projected"] == {**json.loads(json.dumps(est.to_json())), "hardware": HW}
        assert row["projected"]["step_s"] == est.step_s
        assert row["projected"]["exposed_share"] == est.exposed_share
        assert "projected_error" not in row
    top = doc["projected"]
    assert top["hardware"] == HW and top["description"] == nbpar.hardware.lookup(HW).describe()
    assert set(expected(RUNS["zero3"]).assumptions) <= set(top["assumptions"])


def test_the_table_prints_estimates_after_a_bar_and_the_assumptions_once(files, capsys):
    code, out, _ = run_cli(capsys, *files, "--project", HW)
    assert code == 0
    lines = out.splitlines()
    measured = str(compare(list(RUNS.values()))).splitlines()
    head, rows = lines[0], lines[1:4]
    assert head.split("  |  ")[0].rstrip() == measured[0]
    assert head.split("  |  ")[1].split() == f"est. step on {HW} (s) est. exposed".split()
    for line, want, res in zip(rows, measured[1:], RUNS.values()):
        left, right = line.split("  |  ")
        assert left.rstrip() == want
        if res["config"]["model"] == "simple_cnn":
            assert right.split() == ["-", "-"]
            continue
        est = expected(res)
        assert right.split() == [f"{est.step_s:.3g}", f"{est.exposed_share:.1%}"]
    assert any(line.startswith("est.: ddp/torch (2): ") for line in lines)
    assert out.count("assumptions:") == 1 and "estimated by nbpar.project, not measured" in out
    flat = " ".join(out.split())
    for note in expected(RUNS["ddp"]).assumptions + expected(RUNS["zero3"]).assumptions:
        assert flat.count(" ".join(note.split())) == 1


def test_without_project_nothing_is_estimated(files, capsys):
    code, out, _ = run_cli(capsys, *files[:2], "--json")
    doc = json.loads(out)
    assert code == 0 and "projected" not in doc
    assert all(not any(k.startswith("projected") for k in row) for row in doc["runs"])
    assert "est." not in doc["table"]


def test_an_unknown_hardware_is_one_line_before_any_file_is_read(capsys):
    code, out, err = run_cli(capsys, "no-such-result.json", "--project", "9xH100")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--project" in err and "9xH100" in err and HW in err


def test_a_missing_or_bad_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (tmp_path / "missing.json", bad):
        code, _, err = run_cli(capsys, str(path), "--project", HW)
        assert code == 2 and err.count("\n") == 1 and str(path) in err


def test_the_python_compare_takes_project_as_the_command_does(files, capsys):
    """`nbpar.compare(results, project=HW)`: the rows, the table and the HTML carry the
    same estimate the command prints; an unknown name is a ValueError before any run."""
    code, out, _ = run_cli(capsys, *files, "--project", HW, "--json")
    assert code == 0
    cmp = nbpar.compare(list(RUNS.values()), project=HW)
    by_cli = json.loads(out)
    assert cmp.projected == by_cli["projected"]
    assert [r.get("projected") for r in cmp.table] == [r.get("projected") for r in by_cli["runs"]]
    assert str(cmp) == by_cli["table"]
    assert cmp.table[0]["projected"]["step_s"] == pytest.approx(expected(RUNS["ddp"]).step_s)
    page = cmp._repr_html_()
    assert "nbpar-projected" in page and "est. = estimated by nbpar.project" in page
    est = cmp.table[0]["projected"]  # each run's estimate is in a table of the page too
    assert f"<td style='text-align:right'>{est['step_s']:.3g}</td>" in page
    assert f"<td style='text-align:right'>{est['exposed_share']:.1%}</td>" in page
    assert nbpar.compare(list(RUNS.values())).projected is None
    assert "nbpar-projected" not in nbpar.compare(list(RUNS.values()))._repr_html_()
    with pytest.raises(ValueError, match="H999"):
        nbpar.compare(list(RUNS.values()), project="H999")
