"""The hang doctor on real hangs: a rank that sleeps, skips a collective, or sends a
different shape; every rank answers from a side thread while blocked in gloo."""

from __future__ import annotations

import re
import time

import pytest

from nbpar.errors import DistTimeout, PoolError

pytestmark = pytest.mark.timeout(240)

SETUP = "import time, torch, torch.distributed as dist\nt = torch.ones(3)\ndist.all_reduce(t)\n"


def hang(pool, code: str) -> DistTimeout:
    """Run ``code`` with a 2 s timeout on a fresh process group; return the timeout."""
    pool.execute(SETUP)
    with pytest.raises(DistTimeout) as info:
        pool.execute(code, timeout=2)
    return info.value


def test_a_rank_that_sleeps_is_named_with_its_cell_line(ip, pool, capsys):
    pool.activate()
    err = hang(pool, "if dist.get_rank() == 1:\n    time.sleep(60)\ndist.all_reduce(t)\n")
    msg = str(err)
    assert "\n" not in msg
    m = re.search(
        r"rank 1 is not in a collective, at cell line 2: time.sleep\(60\) "
        r"\(last: all_reduce #(\d+)\); rank 0 waits in all_reduce #(\d+) "
        r"\(cell line 3: dist.all_reduce\(t\)\)",
        msg,
    )
    assert m, msg
    assert int(m[2]) == int(m[1]) + 1
    # on demand, while the cell is still running: every rank's stack and collectives
    ip.run_line_magic("dist", "doctor")
    out = capsys.readouterr().out
    assert "diagnosis: rank 1 is not in a collective" in out
    assert "way out: run `%dist restart`" in out
    assert re.search(r"rank 0 \(pid \d+\): in collective, at cell line 3", out)
    assert re.search(r"distributed_c10d.py:\d+ in all_reduce", out)  # rank 0's stack
    assert re.search(r"rank 1 \(pid \d+\): running, at cell line 2", out)
    report = pool.doctor()
    assert report.reports[0]["waiting_in"]["op"] == "all_reduce"
    assert report.reports[0]["waiting_in"]["shapes"] == [[3]]
    assert report.reports[1]["waiting_in"] is None
    pool.restart()


def test_a_rank_that_skips_a_collective(pool):
    err = hang(pool, "if dist.get_rank() == 0:\n    dist.all_reduce(t)\ndist.barrier()\n")
    assert re.search(
        r"ranks disagree on collective #\d+: rank 0 calls all_reduce; "
        r"rank 1 calls barrier",
        str(err),
    ), str(err)
    assert err.report.reports[1]["where"]["line"] == 3
    pool.restart()


def test_mismatched_shapes(pool):
    err = hang(pool, "dist.all_reduce(torch.ones(3 + dist.get_rank()))\n")
    assert re.search(
        r"all_reduce #\d+ has different shapes on different ranks: "
        r"rank 0 \[3\], rank 1 \[4\]; rank 1 still in it",
        str(err),
    ), str(err)
    pool.restart()


def test_a_rank_behind_its_peers_is_named_among_four():
    """Diagnosis of four ranks' reports: one is a collective behind the other three."""
    from nbpar.pool.doctor import diagnose

    def rep(seq, line):
        c = {
            "seq": seq,
            "op": "all_reduce",
            "group": "default",
            "group_id": "0",
            "shapes": [[8]],
            "state": "scheduled",
        }
        done = [{**c, "seq": s, "state": "completed"} for s in range(1, seq)]
        return {
            "state": "in collective",
            "waiting_in": c,
            "collectives": done + [c],
            "where": {
                "line": line,
                "code": "dist.all_reduce(x)",
                "cell": True,
                "file": "cell",
                "function": "<module>",
            },
        }

    reports = {0: rep(18, 6), 1: rep(17, 4), 2: rep(18, 6), 3: rep(18, 6)}
    reports[1]["collectives"] = reports[1]["collectives"][:-1]  # #17 in flight, not #18
    assert diagnose(reports, range(4)) == (
        "rank 1 is at all_reduce #17 (cell line 4: dist.all_reduce(x)); "
        "ranks 0, 2, 3 wait in all_reduce #18"
    )


def test_bad_input_one_clear_line_each(ip, pool, monkeypatch):
    from nbpar.pool import pool as pool_mod

    pool.activate()
    with pytest.raises(PoolError, match="nothing is running on the pool"):
        ip.run_line_magic("dist", "doctor")
    with pytest.raises(ValueError, match="abort=True needs nccl; gloo cannot abort"):
        pool.doctor(abort=True)
    monkeypatch.setattr(pool_mod, "_current", None)
    with pytest.raises(PoolError, match=r"no pool is running"):
        ip.run_line_magic("dist", "doctor")


def test_doctor_while_a_training_run_is_in_progress(pool):
    import nbpar

    pool.activate()
    run = pool.train(
        nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=4, steps=100_000)
    )
    try:
        while len(run.history) < 2:
            time.sleep(0.05)
        report = pool.doctor()
        for rank in (0, 1):
            rep = report.reports[rank]
            assert rep["state"] in ("running", "in collective")
            assert rep["stack"][0]["function"] == "train_on_engine"  # the run, not the engine
            assert rep["collectives"], "DDP's all_reduces were not recorded"
        assert "idle" not in report.diagnosis
    finally:
        run.stop()
        run.wait(60)
