"""docs/workshop.md's agenda and the notebooks agree: each notebook opens with its goal
and the minutes the agenda gives it, each exercise listed is one its cells check, and
the tracks add up to the day and the half day they promise."""

from __future__ import annotations

import pathlib
import re

import nbformat

from tests.test_student import student

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "workshop.md").read_text()
EXERCISE_TITLES = {
    "ring_all_reduce": "ring all-reduce",
    "all_reduce_from_halves": "all-reduce from its halves",
    "shard_indices": "a DistributedSampler by hand",
    "average_gradients": "DDP by hand",
    "accumulate": "gradient accumulation with no_sync",
    "zero1_step": "ZeRO-1 by hand",
    "fully_shard": "FSDP2 fully_shard",
    "memory": "memory by hand",
    "gpipe": "a two-stage GPipe",
    "tp_mlp": "column- and row-parallel linears",
    "mesh": "a dp x tp DeviceMesh",
    "training_time": "training time by hand",
}


def _table() -> dict[str, dict]:
    rows = {}
    for line in DOC.split("## The notebooks, with minutes", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].isdigit():
            name, minutes, ex, listed, day, half = cells
            rows[name] = dict(
                minutes=int(minutes),
                ex=int(ex),
                listed=listed,
                day=day == "yes",
                half=half == "yes",
            )
    return rows


def test_every_notebook_is_in_the_table_and_opens_with_goal_and_its_minutes():
    rows = _table()
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(rows) == [p.stem for p in notebooks]
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        first = next(c for c in nb.cells if c.cell_type == "markdown").source
        row = rows[path.stem]
        time = f"**Time:** about {row['minutes']} minutes" + (
            f", {row['ex']} of them exercises" if row["ex"] else ""
        )
        assert time in first, (path.stem, first[:300])
        assert "**Goal" in first, path.stem
        names = student.exercises(nb)
        assert (row["listed"] == "—") == (not names), path.stem
        assert [EXERCISE_TITLES[n] for n in names] == (
            [] if row["listed"] == "—" else row["listed"].split(", ")
        ), path.stem


def test_the_tracks_add_up_to_what_they_promise():
    rows = _table().values()
    day = [r for r in rows if r["day"]]
    half = [r for r in rows if r["half"]]
    day_min, half_min = sum(r["minutes"] for r in day), sum(r["minutes"] for r in half)
    assert f"One day: {day_min} minutes, {sum(r['ex'] for r in day)} of them exercises" in DOC
    assert f"Half day: {half_min} minutes, {sum(r['ex'] for r in half)} of them" in DOC
    assert 360 <= day_min + 30 <= 400  # with questions, about 6.5 hours
    assert 180 <= half_min + 30 <= 225  # with questions, about 3.5 hours


def test_the_schedules_follow_the_minutes():
    """Each row of a schedule starts where the one before it ends."""
    rows = _table()
    for track in ("## One day", "## Half day"):
        text = DOC.split(track, 1)[1].split("\n## ", 1)[0]
        times = re.findall(r"^\| (\d+):(\d\d) \| `?([\w]+)?", text, re.M)
        starts = [int(h) * 60 + int(m) for h, m, _ in times]
        for (start, nxt), (_, _, name) in zip(zip(starts, starts[1:]), times):
            if name in rows:
                assert nxt - start == rows[name]["minutes"], (track, name)
