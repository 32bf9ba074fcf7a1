"""One results file per benchmark: what was measured, where, when, and how much it moved.

Every benchmark collects its figures in a `Recorder` and ends with ``save()``, which
writes ``results/<name>.json``:

    {"name", "title", "method", "date" (UTC ISO), "cpu_model", "cores", "torch",
     "commit" (the checkout's HEAD, "+dirty" when nbpar/ or benchmarks/ had changes),
     "load_avg": {"start", "end"} (1-minute load average of the machine),
     "load_ok" (the load at the start left the cores to the benchmark, `quiet`),
     "measures" (the paths of the code it measures: `stale` compares them with "commit"),
     "seconds" (the benchmark's run time), "repeats", "config", "notes",
     "figures": [{"label", "unit", "median", "min", "max", "n", "values", "ci95", "target",
                  "meets"}],
     "rows": [raw measurements, one per repeat or case]}

A benchmark starts on a quiet machine or not at all: `Recorder` waits (up to
`QUIET_WAIT_S`) for the 1-minute load average to fall to `QUIET_LOAD` per core, and
the benchmark refuses to start on a busier one (``NBPAR_BENCH_ALLOW_BUSY=1`` runs it and
writes its file marked ``"load_ok": false``, which docs/performance.md shows beside it); a
figure measured while other work took the cores measures that work, not nbpar.
A results file knows its code: `stale` lists the files under its ``measures`` paths that
changed after its ``commit`` (tests/test_bench_results.py fails on any), so a figure
cannot outlive the code it describes.

A figure is the median over its repeats and its spread (min and max, n values), with the
95% confidence interval of the median (``ci95``, distribution-free: order statistics of
the values, `median_ci`); a target is written ``"<= 1.05"`` (or ``<``, ``>=``, ``>``)
and judged on the median, and docs/performance.md calls it decided only where that
interval lies on one side of it.
`benchmarks/report.py` turns the files into the tables of docs/performance.md.
"""

from __future__ import annotations

import datetime
import json
import math
import operator
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().with_name("results")
ROOT = RESULTS.parent.parent
REQUIRED = (
    "name",
    "title",
    "method",
    "date",
    "cpu_model",
    "cores",
    "torch",
    "load_avg",
    "repeats",
    "config",
    "figures",
    "rows",
)
#: What a file written since results knew their code carries besides `REQUIRED`; older
#: files lack them, are stale by `stale`, and docs/performance.md says so beside their rows.
KNOWS_ITS_CODE = ("load_ok", "commit", "measures")
_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}
FIGURE_KEYS = ("label", "unit", "median", "min", "max", "n", "values", "target", "meets")


#: 1-minute load average per core under which a machine counts as quiet
QUIET_LOAD = 0.5
#: how long a benchmark waits for a quiet machine before it starts anyway (and is refused)
QUIET_WAIT_S = 180.0


def load_avg() -> float:
    """The machine's 1-minute load average (how busy the cores were)."""
    return round(os.getloadavg()[0], 2)


def quiet(limit: float | None = None, wait_s: float | None = None, poll_s: float = 5.0) -> bool:
    """Wait until the load average is at most ``limit`` per core (`QUIET_LOAD`; the
    previous benchmark's load dies away within a minute or two); False if it still is not
    after ``wait_s`` (`QUIET_WAIT_S`)."""
    limit = QUIET_LOAD if limit is None else limit
    cores = os.cpu_count() or 1
    deadline = time.monotonic() + (QUIET_WAIT_S if wait_s is None else wait_s)
    while load_avg() > limit * cores:
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class Recorder:
    """Collects a benchmark's figures and rows; `save()` writes its results file."""

    def __init__(
        self,
        name: str,
        title: str,
        method: str,
        *,
        repeats: int,
        measures: list[str],
        config: dict | None = None,
        notes: str = "",
    ):
        self.name, self.title, self.method = name, title, " ".join(method.split())
        self.repeats, self.config, self.notes = repeats, dict(config or {}), notes
        missing = [p for p in measures if not (ROOT / p).exists()]
        if not measures or missing:
            raise ValueError(f"{name}: measures must name existing paths, not {missing}")
        self.measures = list(measures)
        self.figures: list[dict] = []
        self.rows: list[dict] = []
        self.load_ok = quiet()
        self.load_start = load_avg()
        if not self.load_ok and os.environ.get("NBPAR_BENCH_ALLOW_BUSY") != "1":
            raise SystemExit(
                f"{name}: the machine is busy (load average {self.load_start} on "
                f"{os.cpu_count()} cores); its figures would measure that work. Run it on a "
                "quiet machine, or set NBPAR_BENCH_ALLOW_BUSY=1 to write one marked load_ok: false"
            )
        self.started = time.monotonic()

    def figure(
        self, label: str, values, unit: str = "", target: str | None = None, digits: int = 4
    ) -> dict:
        """Add a figure: the median and spread of ``values`` (one per repeat)."""
        fig = {"label": label, "unit": unit, **spread(values, digits), "target": target}
        fig["meets"] = meets(fig["median"], target)
        self.figures.append(fig)
        return fig

    def row(self, **values) -> None:
        self.rows.append(values)

    def alternated_pairs(self, pairs: int, measure, sides: tuple[str, str], key: str) -> list:
        """``pairs`` rows of ``measure(side)`` for both ``sides``, alternating which goes
        first, each row with the ratio of the first side's ``key`` to the second's."""
        for i in range(pairs):
            order = sides if i % 2 == 0 else sides[::-1]
            got = {side: measure(side) for side in order}
            a, b = (got[side] for side in sides)
            self.row(pair=i, first=order[0], **got, ratio=a[key] / b[key])
        return self.rows

    def save(self, root: Path = RESULTS) -> Path:
        data = {
            "name": self.name,
            "title": self.title,
            "method": self.method,
            **environment(),
            "load_avg": {"start": self.load_start, "end": load_avg()},
            "load_ok": self.load_ok,
            "measures": self.measures,
            "seconds": round(time.monotonic() - self.started, 1),
            "repeats": self.repeats,
            "config": self.config,
            "notes": self.notes,
            "figures": self.figures,
            "rows": self.rows,
        }
        try:
            return write(data, root)
        except ValueError:  # keep what was measured, to see what went wrong
            kept = Path(tempfile.gettempdir()) / f"{self.name}.rejected.json"
            kept.write_text(json.dumps(data, indent=1), encoding="utf-8")
            print(f"results refused; the data is in {kept}", file=sys.stderr)
            raise


def spread(values, digits: int = 4) -> dict:
    """Median, min, max, count and the median's 95% interval (`median_ci`) of ``values``,
    rounded to ``digits`` significant."""
    vals = [_round(float(v), digits) for v in values]  # the file holds these, and the
    if not vals:  # median is exactly theirs
        raise ValueError("a figure needs at least one value")
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": vals,
        "ci95": list(median_ci(vals)),
    }


def median_ci(values, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: the k-th smallest and
    k-th largest value, k the largest rank whose binomial tail P(Bin(n, 1/2) < k) stays
    within (1 - level) / 2 (so the interval holds the true median with probability at
    least ``level``, whatever the noise's shape). With fewer than 6 values it is the
    whole range: so few repeats cannot pin a median down at 95%."""
    vals = sorted(values)
    n = len(vals)
    tail, k = 0.0, 0
    for j in range(n):
        tail += math.comb(n, j) / 2**n
        if tail > (1 - level) / 2:
            break
        k = j + 1
    if k == 0:
        return vals[0], vals[-1]
    return vals[k - 1], vals[n - k]


def _round(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def meets(value: float, target: str | None) -> bool | None:
    """Whether ``value`` meets a target written ``"<= x"``, ``"< x"``, ``">= x"`` or
    ``"> x"`` (None: no target)."""
    if not target:
        return None
    op, bound = target.split()
    if op not in _OPS:
        raise ValueError(f"target {target!r}: write '<= x', '< x', '>= x' or '> x'")
    return _OPS[op](value, float(bound))


def _git(root: Path, *args) -> str | None:
    import subprocess

    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def stale(data: dict, root: Path = ROOT) -> list[str]:
    """The files under ``data["measures"]`` that differ from its ``commit`` (committed
    later or changed in the working tree): empty when the file describes this code. A
    file measured on a dirty tree, or on a commit this history lacks, is stale whole."""
    if "measures" not in data:
        return ["measured before results files named their code"]
    commit_ = data.get("commit") or ""
    if not commit_ or commit_.endswith("+dirty"):
        return [f"measured on {commit_ or 'no commit'}: not a committed tree"]
    if _git(root, "cat-file", "-e", f"{commit_}^{{commit}}") is None:
        return [f"commit {commit_[:12]} is not in this history"]
    changed = _git(root, "diff", "--name-only", commit_, "--", *data["measures"])
    return changed.splitlines() if changed else []


def commit(root: Path = ROOT) -> str | None:
    """The commit the measured code is at: HEAD, "+dirty" when nbpar/ or benchmarks/
    differ from it (None outside a git checkout)."""
    head = _git(root, "rev-parse", "HEAD")
    if head is None:
        return None
    dirty = _git(
        root,
        "status",
        "--porcelain",
        "--",
        "nbpar",
        "benchmarks",
        "notebooks",
        ":!benchmarks/results",
    )
    return head + ("+dirty" if dirty else "")


def environment() -> dict:
    """Date (UTC), commit, CPU model, core count and torch version of this machine."""
    import torch

    from nbpar.device import cpu_model

    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {
        "date": now.isoformat(),
        "commit": commit(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def problems(data: dict) -> list[str]:
    """What a results file lacks or gets wrong (empty when it is complete)."""
    name = data.get("name", "?")
    out = [f"{name}: missing field {k!r}" for k in REQUIRED if k not in data]
    if not isinstance(data.get("load_avg"), dict) or set(data["load_avg"]) != {"start", "end"}:
        out.append(f"{name}: load_avg must be {{'start', 'end'}}")
    if "measures" in data:  # a file that knows its code also says its commit and load
        out += [f"{name}: missing field {k!r}" for k in KNOWS_ITS_CODE if k not in data]
    if not data.get("figures"):
        out.append(f"{name}: no figures")
    for fig in data.get("figures") or []:
        label = fig.get("label", "?")
        missing = [k for k in FIGURE_KEYS if k not in fig]
        if missing:
            out.append(f"{name}: figure {label!r} lacks {missing}")
            continue
        vals = fig["values"]
        if not vals or fig["n"] != len(vals) or (fig["min"], fig["max"]) != (min(vals), max(vals)):
            out.append(f"{name}: figure {label!r}: min/max/n disagree with its values")
        elif not fig["min"] <= fig["median"] <= fig["max"]:
            out.append(f"{name}: figure {label!r}: median/min/max out of order")
        elif not math.isclose(statistics.median(vals), fig["median"], rel_tol=1e-9):
            out.append(f"{name}: figure {label!r}: median is not the median of its values")
        if "ci95" in fig and list(fig["ci95"]) != list(median_ci(vals)):
            out.append(f"{name}: figure {label!r}: ci95 is not its values' interval")
        if fig["meets"] != meets(fig["median"], fig["target"]):
            out.append(f"{name}: figure {label!r}: 'meets' disagrees with its target")
    return out


def write(data: dict, root: Path = RESULTS) -> Path:
    """Write ``data`` as ``root/<name>.json`` (checked first) and print where."""
    found = problems(data)
    if found:
        raise ValueError("; ".join(found))
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{data['name']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    print(
        json.dumps(
            {"results": str(path), "figures": {f["label"]: f["median"] for f in data["figures"]}}
        )
    )
    return path


def read_all(root: Path = RESULTS) -> dict[str, dict]:
    """Every results file under ``root``, by benchmark name."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(root.glob("*.json"))}
