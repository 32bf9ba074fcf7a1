"""A %%dist cell that hangs without a --timeout says, live, who waits where; a busy cell
of collectives says nothing (`nbpar.pool.hangwatch`), on real gloo ranks."""

from __future__ import annotations

import re
import time

import pytest

from nbpar.pool import hangwatch
from nbpar.pool.hangwatch import STOP_HINT, describe

pytestmark = pytest.mark.timeout(180)

SETUP = "import time, torch, torch.distributed as dist\nt = torch.ones(3)\ndist.all_reduce(t)\n"
APART = "if dist.get_rank() == 1:\n    time.sleep(6)\ndist.all_reduce(t)\n"


@pytest.fixture
def quick(monkeypatch):
    """Looks every second (4 s by default), so a hang shows within about 2 s."""
    monkeypatch.setattr(hangwatch, "WATCH_S", 1.0)
    monkeypatch.setattr(hangwatch, "LOOK_S", 1.0)


def live_texts(pub) -> list[tuple[float, str]]:
    return [(o["time"], o["data"]["text/plain"]) for o in pub if o["transient"]]


def test_a_hang_shows_who_waits_where_while_it_waits(ip, pool, pub, quick):
    pool.activate()
    pool.execute(SETUP)
    ip.run_cell_magic("dist", "--stream", APART)
    end = time.monotonic()
    shown = [(t, text) for t, text in live_texts(pub) if text.startswith("nbpar, ")]
    assert shown, live_texts(pub)
    first_at, text = shown[0]
    assert first_at < end - 1.5  # live, seconds before the cell ended
    head, hint, diagnosis, *view = text.splitlines()
    assert re.fullmatch(
        r"nbpar, \d+ s into the cell: rank 0 waits in all_reduce #\d+ "
        r"\(cell line 3: dist.all_reduce\(t\)\) for at least [1-9]\d* s; "
        r"rank 1 is at cell line 2: time.sleep\(6\), not in a collective",
        head,
    ), head
    assert hint == STOP_HINT
    assert diagnosis.startswith("diagnosis: rank 1 is not in a collective, at cell line 2")
    assert any(re.match(r"rank 0 \(pid \d+\): in collective", line) for line in view), view
    assert any("in all_reduce" in line for line in view)  # rank 0's stack, as the doctor's
    assert live_texts(pub)[-1][1] == ""  # emptied at the end: no saved notebook keeps it


def test_in_a_terminal_the_word_goes_to_stderr_once_per_change(ip, pool, pub, quick, capsys):
    pool.activate()
    pool.execute(SETUP)
    ip.run_cell_magic("dist", "--no-stream", APART)
    err = capsys.readouterr().err.splitlines()
    heads = [i for i, line in enumerate(err) if line.startswith("nbpar, ")]
    assert heads, err
    assert "rank 0 waits in all_reduce" in err[heads[0]]
    assert all(err[i + 1] == STOP_HINT for i in heads)
    assert len(heads) <= 3  # not once a second: only when what it says changes
    assert not live_texts(pub)  # no live area was opened


def test_a_busy_cell_of_collectives_shows_nothing(ip, pool, pub, monkeypatch):
    monkeypatch.setattr(hangwatch, "WATCH_S", 0.5)
    monkeypatch.setattr(hangwatch, "LOOK_S", 0.5)
    pool.activate()
    pool.execute(SETUP)
    ip.run_cell_magic(
        "dist", "--stream", "for i in range(60):\n    dist.all_reduce(t)\n    time.sleep(0.05)\n"
    )
    assert not [text for _, text in live_texts(pub) if "nbpar, " in text]


def _rep(state, seq=None, line=3, code="dist.all_reduce(t)"):
    c = {"seq": seq, "op": "all_reduce", "group": "default", "group_id": "0"}
    where = {"file": "<cell>", "line": line, "function": "<module>", "code": code, "cell": True}
    return {"state": state, "where": where, "waiting_in": c if seq else None}


def test_describe_says_each_rank_in_order():
    reports = {
        0: _rep("in collective", seq=2),
        1: _rep("running", line=2, code="time.sleep(60)"),
        3: {"error": "boom"},
    }
    text = describe(reports, finished=[2], waited={0: 8.2}, ranks=[0, 1, 2, 3, 4])
    assert text == (
        "rank 0 waits in all_reduce #2 (cell line 3: dist.all_reduce(t)) for at least 8 s; "
        "rank 1 is at cell line 2: time.sleep(60), not in a collective; rank 2 finished; "
        "rank 3 did not answer; rank 4 did not answer"
    )
