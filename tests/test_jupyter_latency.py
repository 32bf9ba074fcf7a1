"""benchmarks/jupyter_latency.py's pure helpers: the wait for a cell's 'idle' (no kernels)."""

from __future__ import annotations

import importlib
import queue
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
jl = importlib.import_module("jupyter_latency")


def msg(kind: str, parent: str, **content) -> dict:
    return {"header": {"msg_type": kind}, "parent_header": {"msg_id": parent}, "content": content}


def feed(messages):
    """A ``get_iopub_msg`` stand-in: the messages in order, `queue.Empty` for None."""
    it = iter(messages)

    def get_msg(timeout):
        m = next(it)
        if m is None:
            raise queue.Empty
        return m

    return get_msg


def test_until_idle_collects_its_own_outputs_and_stops_at_its_idle():
    got = jl.until_idle(
        feed(
            [
                msg("status", "a", execution_state="busy"),
                msg("stream", "other", name="stdout", text="not ours\n"),
                None,  # a quiet moment: keep waiting
                msg("stream", "a", name="stdout", text="[rank 0] sum 2.0\n"),
                msg("display_data", "a", data={"text/plain": "[Rank 1 — ok]"}),
                msg("status", "other", execution_state="idle"),
                msg("status", "a", execution_state="idle"),
                msg("stream", "a", name="stdout", text="never read\n"),
            ]
        ),
        "a",
        timeout=5,
    )
    assert got["text"] == "[rank 0] sum 2.0\n[Rank 1 — ok]"
    assert got["messages"] == 3 and got["errors"] == []  # busy, stream, display


def test_until_idle_reports_errors_and_times_out():
    got = jl.until_idle(
        feed(
            [
                msg("error", "a", ename="NameError", evalue="x"),
                msg("status", "a", execution_state="idle"),
            ]
        ),
        "a",
        timeout=5,
    )
    assert got["errors"] == ["NameError: x"]
    with pytest.raises(TimeoutError, match="idle"):
        jl.until_idle(feed([None] * 10**6), "a", timeout=0.01)


def test_sides_rotate_so_each_goes_first_in_turn():
    sides = ("nbpar", "ipp", "jd")
    assert [jl.rotated(sides, i)[0] for i in range(4)] == ["nbpar", "ipp", "jd", "nbpar"]
    assert sorted(jl.rotated(sides, 5)) == sorted(sides)


def test_cells_cover_every_side_of_each_figure():
    assert set(jl.CELLS["trivial"]) == {"local", "dist", "px", "jd"}
    for kind in ("allreduce", "print"):
        assert set(jl.CELLS[kind]) == {"dist", "px", "jd"}
    assert all(code.startswith("%%dist") for where, code in (s["dist"] for s in jl.CELLS.values()))
    assert "MASTER_PORT='1234'" in jl.ipp_cells(1234)[1]
