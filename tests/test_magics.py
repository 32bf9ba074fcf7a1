"""%%dist and %dist driven through IPython's run_cell_magic, on real engines."""

from __future__ import annotations

import time

import pytest

import nbpar
from nbpar.errors import DistTimeout, PoolError, RankError

pytestmark = pytest.mark.timeout(180)


def test_dist_before_a_pool_exists_says_how_to_start_one(ip, monkeypatch):
    from nbpar.pool import pool as pool_mod

    monkeypatch.setattr(pool_mod, "_current", None)
    with pytest.raises(PoolError, match=r"nbpar.Pool\(2\)"):
        ip.run_cell_magic("dist", "", "print(1)")


def test_output_grouped_per_rank_in_rank_order(ip, pool, capsys):
    pool.activate()
    ip.run_cell_magic(
        "dist",
        "",
        "import time, torch, torch.distributed as dist\n"
        "r = dist.get_rank()\ntime.sleep(0.3 * (1 - r))\n"
        "t = torch.ones(1) * (r + 1)\ndist.all_reduce(t)\n"
        "print('sum', t.item())\nprint('done', r)",
    )
    out = capsys.readouterr().out
    assert out == ("[rank 0] sum 3.0\n[rank 0] done 0\n[rank 1] sum 3.0\n[rank 1] done 1\n")


def test_targets_and_rank0_flags(ip, pool, capsys):
    pool.activate()
    ip.run_cell_magic("dist", "--targets 1", "print('hello from', dist.get_rank())")
    assert capsys.readouterr().out == "[rank 1] hello from 1\n"
    ip.run_cell_magic("dist", "--rank0", "print('x', dist.get_rank())")
    assert capsys.readouterr().out == "[rank 0] x 0\n"
    with pytest.raises(ValueError, match="do not exist"):
        ip.run_cell_magic("dist", "--targets 5", "pass")
    with pytest.raises(ValueError, match="unrecognized arguments"):
        ip.run_cell_magic("dist", "--bogus", "pass")
    with pytest.raises(ValueError, match="--timeout must be positive"):
        ip.run_cell_magic("dist", "--timeout 0", "pass")


def test_error_shows_failing_rank_traceback(ip, pool, capsys):
    pool.activate()
    with pytest.raises(RankError) as info:
        ip.run_cell_magic(
            "dist",
            "",
            "print('before', dist.get_rank())\n"
            "if dist.get_rank() == 1:\n    raise KeyError('lost')",
        )
    assert info.value.ranks == [1]
    assert "[rank 0] before 0" in capsys.readouterr().out
    assert any("KeyError" in line for line in info.value._render_traceback_())


def test_timeout_returns_control_then_restart_recovers(ip, pool):
    pool.activate()
    t = time.monotonic()
    with pytest.raises(DistTimeout, match=r"rank\(s\) \[1\] did not finish within 2 s"):
        # rank 1 waits in a collective rank 0 never joins
        ip.run_cell_magic(
            "dist",
            "--timeout 2",
            "import torch\nif dist.get_rank() == 1:\n    dist.all_reduce(torch.ones(1))",
        )
    assert time.monotonic() - t < 10
    assert [r["state"] for r in pool.status()] == ["ready", "busy"]
    with pytest.raises(PoolError, match="still running an earlier cell"):
        ip.run_cell_magic("dist", "", "pass")
    ip.run_line_magic("dist", "restart")
    assert [r["state"] for r in pool.status()] == ["ready", "ready"]
    res = pool.execute(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert res.results[1]["text/plain"] == "2.0"


def test_dist_line_commands(ip, pool, capsys):
    pool.activate()
    ip.run_line_magic("dist", "status")
    with pytest.raises(ValueError, match="unknown command 'frobnicate'"):
        ip.run_line_magic("dist", "frobnicate")


def test_start_and_shutdown_from_the_line_magic(ip, capsys):
    pool = ip.run_line_magic("dist", "start 1")
    try:
        assert isinstance(pool, nbpar.Pool) and pool.n == 1
        ip.run_cell_magic(
            "dist", "", "import torch.distributed as dist\nprint(dist.get_world_size())"
        )
        assert capsys.readouterr().out == "[rank 0] 1\n"
    finally:
        ip.run_line_magic("dist", "shutdown")
    assert pool.closed
    ip.user_ns.pop("pool", None)
