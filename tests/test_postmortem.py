"""%dist debug N: pdb on a failed rank's traceback, driven with typed commands."""

from __future__ import annotations

import pytest

from nbpar.errors import PoolError, RankError

pytestmark = pytest.mark.timeout(180)

FAILING = (
    "import torch.distributed as dist\n"
    "def scale(x, factor):\n    table = {'a': 1}\n    return table[x] * factor\n"
    "rank = dist.get_rank()\nsecret = 40 + rank\n"
    "if rank == 1:\n    scale('b', 3)\n"
)


def typed(monkeypatch, *lines):
    """Feed ``lines`` to input() as if typed at the notebook's prompt."""
    it = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)


def test_bad_input_before_any_failure(ip, pool):
    pool.activate()
    pool.restart()  # no cell has failed on these engines
    with pytest.raises(PoolError, match="rank 0 has no failure to debug: no cell has failed"):
        ip.run_line_magic("dist", "debug 0")


def test_post_mortem_on_the_failed_rank_then_restart(ip, pool, monkeypatch, capsys):
    pool.activate()
    with pytest.raises(RankError):
        ip.run_cell_magic("dist", "", FAILING)
    capsys.readouterr()
    typed(
        monkeypatch,
        "where",
        "p x, factor, table",
        "args",
        "up",
        "p secret",
        "next",
        "q",
        "p 'never sent'",
    )
    ip.run_line_magic("dist", "debug 1")
    out = capsys.readouterr().out
    assert out.startswith("[rank 1] post-mortem: q to leave\nKeyError: 'b'\n")
    assert "-> return table[x] * factor" in out  # stopped in the frame that raised
    assert "('b', 3, {'a': 1})" in out  # that frame's locals
    assert "41" in out  # the cell's globals, one frame up
    assert "x = 'b'\nfactor = 3\n" in out  # `args` of that frame
    assert "`next` would resume rank 1" in out
    assert "never sent" not in out
    # the other ranks have no failure; ranks that do not exist are named
    with pytest.raises(
        PoolError,
        match=r"rank 0 has no failure to debug: the last failed "
        r"cell failed on rank\(s\) \[1\]",
    ):
        ip.run_line_magic("dist", "debug 0")
    with pytest.raises(ValueError, match=r"rank\(s\) \[5\] do not exist"):
        ip.run_line_magic("dist", "debug 5")
    with pytest.raises(ValueError, match="name one rank"):
        ip.run_line_magic("dist", "debug")
    pool.restart()
    res = pool.execute(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert res.results[1]["text/plain"] == "2.0"
    with pytest.raises(PoolError, match="rank 1 has no failure to debug"):
        ip.run_line_magic("dist", "debug 1")
