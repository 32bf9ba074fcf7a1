"""The performance tables of docs/performance.md are what benchmarks/results/*.json say
(no pools).

Every results file carries its date, CPU, cores, torch version, load, repeats and,
per figure, a median with its spread; `benchmarks/report.py` writes the tables
between the page's bench markers, and these tests fail when the two disagree.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PAGE = ROOT / "docs" / "performance.md"  # where the tables live
sys.path.insert(0, str(BENCH))
report = importlib.import_module("report")
results = importlib.import_module("results")

HELPERS = {"results", "report", "plain_ddp"}  # not benchmarks of their own
SIDE_BY_SIDE = ("ddp_vs_torchrun", "dashboard_overhead")
#: Results files written before results knew their code, not re-measured yet (each row
#: says so on the page); re-running the benchmark takes it off this list.
NOT_RE_MEASURED: frozenset = frozenset()


@pytest.fixture
def copied(tmp_path):
    """docs/performance.md and results/ copied to tmp_path: (page, results dir)."""
    readme = tmp_path / "performance.md"
    shutil.copy(PAGE, readme)
    root = shutil.copytree(BENCH / "results", tmp_path / "results")
    return readme, root


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_every_results_file_is_complete():
    found = results.read_all()
    assert found, "no results files in benchmarks/results"
    for name, data in found.items():
        assert data["name"] == name
        assert results.problems(data) == [], name
        assert data["cores"] >= 1 and data["cpu_model"] and data["torch"]


def test_every_benchmark_is_on_the_page_or_said_not_measured():
    scripts = {p.stem for p in BENCH.glob("*.py")} - HELPERS
    listed = {n for names in report.SECTIONS.values() for n in names}
    assert scripts == listed
    assert set(report.NOT_MEASURED) <= listed
    have = set(results.read_all())
    assert listed - set(report.NOT_MEASURED) <= have, "benchmarks without a results file"


def test_the_tables_are_generated_from_the_results():
    assert report.README == PAGE  # what `python benchmarks/report.py` rewrites
    assert report.check() == [], "run `make bench-report`"


def test_the_readme_links_the_page_and_holds_no_tables():
    readme = (ROOT / "README.md").read_text()
    assert "docs/performance.md" in readme
    assert not report.MARKER.search(readme) and not report.FIG.search(readme)


@pytest.mark.parametrize("name", SIDE_BY_SIDE)
def test_side_by_side_ratios_are_medians_of_alternated_pairs(name):
    data = results.read_all()[name]
    assert data["repeats"] >= 5
    assert data["figures"][0]["unit"] == "x" and data["figures"][0]["n"] == data["repeats"]
    firsts = [row["first"] for row in data["rows"]]
    assert len(set(firsts)) == 2 and all(a != b for a, b in zip(firsts, firsts[1:]))


def test_generator_catches_and_fixes_a_disagreement(copied):
    readme, root = copied
    before = readme.read_text()
    assert report.check(readme, root) == []

    def slower(data):
        fig = data["figures"][0]
        fig["values"] = [v * 2 for v in fig["values"]]
        fig.update(results.spread(fig["values"]))
        fig["meets"] = results.meets(fig["median"], fig["target"])

    edit(root / "ddp_vs_torchrun.json", slower)
    found = report.check(readme, root)
    assert found and "'training' differs" in found[0]
    assert report.main(["--check", "--readme", str(readme), "--results", str(root)]) == 1
    assert report.main(["--readme", str(readme), "--results", str(root)]) == 0
    assert report.check(readme, root) == []
    after = readme.read_text()
    assert after != before
    # only the text between the markers changed
    outside = report.MARKER.sub(lambda m: m.group(1) + m.group(4), after)
    assert outside == report.MARKER.sub(lambda m: m.group(1) + m.group(4), before)


def test_a_hand_edited_table_is_caught(copied):
    readme, root = copied
    text = readme.read_text()
    fig = results.read_all(root)["ddp_vs_torchrun"]["figures"][0]
    cell = f"| {report.number(fig['median'], fig['unit'])} |"
    assert cell in text
    readme.write_text(text.replace(cell, "| 123.4x |", 1))
    assert any("differs" in f for f in report.check(readme, root))


@pytest.mark.parametrize("field", ["date", "cpu_model", "cores", "torch", "repeats", "figures"])
def test_a_results_file_without_a_required_field_fails(copied, field):
    readme, root = copied
    edit(root / "scaling.json", lambda data: data.pop(field))
    found = report.check(readme, root)
    assert any(f"missing field {field!r}" in f for f in found)
    before = readme.read_text()
    assert report.main(["--readme", str(readme), "--results", str(root)]) == 1
    assert readme.read_text() == before, "a broken results file must not be written out"


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda f: f.update(median=f["max"] * 2), "median/min/max"),
        (lambda f: f.update(max=f["max"] + 1), "min/max/n"),
        (lambda f: f.update(n=f["n"] + 1), "min/max/n"),
        (lambda f: f.pop("values"), "lacks"),
        (lambda f: f.update(meets=not f["meets"]), "'meets'"),
    ],
)
def test_a_figure_that_disagrees_with_its_values_fails(copied, change, words):
    _, root = copied
    data = results.read_all(root)["ddp_vs_torchrun"]
    change(data["figures"][0])
    assert any(words in p for p in results.problems(data))


def test_median_is_checked_against_the_values():
    data = results.read_all()["pipeline_bubble"]
    fig = data["figures"][0]
    fig["values"] = sorted(fig["values"])
    fig["values"][-1] = fig["max"] = fig["values"][-1] + 10  # max moves, median must not
    fig["ci95"] = list(results.median_ci(fig["values"]))  # with few values: the range
    assert results.problems(data) == []
    fig["median"] = fig["max"]
    assert any("median is not the median" in p for p in results.problems(data))


def test_targets_are_judged_on_the_median():
    assert results.meets(1.04, "<= 1.05") and not results.meets(1.06, "<= 1.05")
    assert results.meets(0.9, "< 1") and not results.meets(1.0, "< 1")
    assert results.meets(2, ">= 2") and results.meets(0, None) is None
    with pytest.raises(ValueError):
        results.meets(1.0, "about 1")
    fig = results.spread([3.0, 1.0, 2.0, 10.0])
    assert (fig["median"], fig["min"], fig["max"], fig["n"]) == (2.5, 1.0, 10.0, 4)


def test_a_target_inside_the_spread_is_undecided():
    fig = {"n": 5, "min": 0.9, "max": 1.1, "median": 1.0, "meets": True}
    assert report.verdict(fig, 1.02).startswith("**undecided** (met on the median")
    assert report.verdict({**fig, "median": 1.05, "meets": False}, 1.02).startswith(
        "**undecided** (not met"
    )
    assert report.verdict({**fig, "max": 1.01}, 1.02) == "met"
    assert report.verdict({**fig, "min": 1.03, "meets": False}, 1.02) == "**not met**"
    assert report.verdict({**fig, "n": 1}, 1.02) == "met"  # one value has no spread


@pytest.mark.parametrize("n", [6, 9, 20, 60, 180])
def test_the_medians_interval_is_the_widest_95_percent_order_statistic_one(n):
    """k-th smallest to k-th largest, k the largest rank with P(Bin(n, 1/2) < k) <= 2.5%:
    the interval covers the median with probability >= 95%, and one rank narrower would
    not."""
    import math

    lo, hi = results.median_ci(list(range(1, n + 1)))
    k = int(lo)
    assert hi == n + 1 - k
    below = sum(math.comb(n, j) for j in range(k)) / 2**n
    assert below <= 0.025 < below + math.comb(n, k) / 2**n
    assert results.median_ci([5.0, 1.0, 3.0]) == (1.0, 5.0)  # too few values: all of them


def test_a_target_the_medians_interval_keeps_to_one_side_of_is_decided():
    """60 values from 0.8 to 1.39 reach past 1.3, but their median cannot: met."""
    fig = results.spread([0.8 + 0.01 * i for i in range(60)])
    fig.update(unit="x", target="<= 1.3", meets=results.meets(fig["median"], "<= 1.3"))
    assert fig["min"] < 1.3 < fig["max"] and fig["ci95"][1] < 1.3
    assert report.verdict(fig, 1.3) == "met"
    assert report.verdict(fig, 1.1).startswith("**undecided** (met on the median; its 95%")
    assert "median in 1.01x–1.18x" in report.spread_text(fig)
    assert results.problems({**_complete(), "figures": [{**fig, "ci95": [0.8, 1.4]}]})


def _complete() -> dict:
    return json.loads((results.RESULTS / "chaos.json").read_text())


def test_generated_rows_have_six_cells():
    text = PAGE.read_text()
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| `")
        and any(line.startswith(f"| `{n}.py`") for n in results.read_all())
    ]
    assert rows
    for line in rows:
        assert line.replace("\\|", "").count("|") == 7, line


def _git(root: Path, *args) -> str:
    import subprocess

    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()


def _shallow() -> bool:
    return _git(ROOT, "rev-parse", "--is-shallow-repository") == "true"


@pytest.mark.spawn  # asks git
def test_every_results_file_describes_the_code_it_measures():
    """No figure outlives its code: each file's `measures` paths are as they were at
    the commit it measured (a change since, committed or not, makes it stale)."""
    if _shallow():
        pytest.skip("a shallow clone has no history to compare the commits with")
    for name, data in results.read_all().items():
        if name in NOT_RE_MEASURED and "measures" not in data:
            continue  # marked on the page as measured on older code
        assert results.stale(data) == [], f"{name} is stale: re-run benchmarks/{name}.py"
    # the list only shrinks: a file re-measured since must leave it
    legacy = {n for n, d in results.read_all().items() if "measures" not in d}
    assert legacy == set(NOT_RE_MEASURED), legacy ^ set(NOT_RE_MEASURED)
    page = PAGE.read_text()
    for name in NOT_RE_MEASURED:
        assert f"| `{name}.py` |" in page and "older code: not re-measured" in page


@pytest.mark.spawn  # builds a small git repository
def test_a_stale_results_file_is_caught(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "other").mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.org")
    _git(repo, "config", "user.name", "t")
    (repo / "pkg" / "code.py").write_text("x = 1\n")
    (repo / "other" / "notes.txt").write_text("a\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "code")
    data = {"commit": _git(repo, "rev-parse", "HEAD"), "measures": ["pkg"]}
    assert results.stale(data, repo) == []
    (repo / "other" / "notes.txt").write_text("b\n")  # not what it measures
    _git(repo, "commit", "-qam", "notes")
    assert results.stale(data, repo) == []
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    assert results.stale(data, repo) == ["pkg/code.py"]  # changed in the working tree
    _git(repo, "commit", "-qam", "faster")
    assert results.stale(data, repo) == ["pkg/code.py"]  # and committed
    assert results.stale({**data, "commit": data["commit"] + "+dirty"}, repo)
    assert results.stale({**data, "commit": "0" * 40}, repo)  # not in this history
    assert results.stale({**data, "commit": None}, repo)


def test_a_benchmark_on_a_busy_machine_refuses_or_is_marked(monkeypatch, tmp_path):
    cores = results.os.cpu_count() or 1
    monkeypatch.setattr(results, "load_avg", lambda: 4.0 * cores)
    monkeypatch.setattr(results, "QUIET_WAIT_S", 0.0)
    monkeypatch.delenv("NBPAR_BENCH_ALLOW_BUSY", raising=False)
    with pytest.raises(SystemExit, match="busy"):
        results.Recorder("probe", "a probe", "counted", repeats=1, measures=["nbpar"])
    monkeypatch.setenv("NBPAR_BENCH_ALLOW_BUSY", "1")
    rec = results.Recorder("probe", "a probe", "counted", repeats=1, measures=["nbpar"])
    assert rec.load_ok is False
    monkeypatch.setattr(results, "commit", lambda: "f" * 40)
    rec.figure("x", [1.0], unit="s")
    data = json.loads(rec.save(tmp_path).read_text())
    assert data["load_ok"] is False and data["measures"] == ["nbpar"]
    assert "busy machine" in report.where(data)
    with pytest.raises(ValueError, match="measures"):
        results.Recorder("probe", "a probe", "counted", repeats=1, measures=["no/such/path"])


@pytest.mark.spawn  # asks git
def test_a_new_results_file_records_the_commit_it_measured(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(results, "QUIET_WAIT_S", 0.0)
    monkeypatch.setenv("NBPAR_BENCH_ALLOW_BUSY", "1")
    rec = results.Recorder("probe", "a probe", "counted", repeats=1, measures=["nbpar"])
    rec.figure("x", [1.0, 2.0, 3.0], unit="s")
    rec.row(x=1.0)
    data = json.loads(rec.save(tmp_path).read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert data["commit"] in (head, head + "+dirty")
