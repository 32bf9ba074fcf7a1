"""Pool: real engines, a real gloo process group, nothing left running."""

from __future__ import annotations

import os

import psutil
import pytest

import nbpar
from nbpar.errors import PoolError, RankError

pytestmark = pytest.mark.timeout(180)


def test_pool_joins_one_process_group(pool):
    out = pool.run(lambda: __import__("torch.distributed").distributed.get_world_size())
    assert out == [2, 2]
    ranks = pool.execute("import torch.distributed as dist\ndist.get_rank()").results
    assert [ranks[r]["text/plain"] for r in (0, 1)] == ["0", "1"]


def test_all_reduce_sums_over_ranks(pool):
    res = pool.execute(
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
        "print(t.item())"
    )
    assert res.text() == "[rank 0] 3.0\n[rank 1] 3.0"


def test_status_rows(pool):
    rows = pool.status()
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        assert {"rank", "host", "pid", "device", "state", "memory"} <= set(row)
        assert row["device"] == "cpu" and row["state"] == "ready"
        assert psutil.pid_exists(row["pid"]) and row["memory"] > 0
    assert len({r["pid"] for r in rows}) == 2
    html = pool._repr_html_()
    assert html.count("<tr>") == 3 and "gloo" in html
    assert "rank" in repr(pool).splitlines()[1]


def test_rendezvous_address_comes_from_engine_0(pool):
    assert pool.engines[0]["addr"] == pool.addr
    assert all(e["addr"] == pool.addr and e["port"] == pool.rendezvous_port for e in pool.engines)
    env = pool.run(
        lambda: (__import__("os").environ["MASTER_ADDR"], __import__("os").environ["RANK"])
    )
    assert env == [(pool.addr, "0"), (pool.addr, "1")]


def test_targets_and_errors(pool):
    res = pool.execute("import torch.distributed as dist\nprint(dist.get_rank())", targets="1")
    assert res.text() == "[rank 1] 1"
    with pytest.raises(ValueError, match="rank.*do not exist.*0..1"):
        pool.execute("pass", targets=[2])
    with pytest.raises(RankError, match="ZeroDivisionError on rank 1") as info:
        pool.execute("import torch.distributed as dist\n1 / (dist.get_rank() - 1)")
    lines = info.value._render_traceback_()
    assert all(line.startswith("[rank 1]") for line in lines)
    assert any("ZeroDivisionError" in line for line in lines)


def test_rerunning_init_in_a_cell_is_safe(pool):
    from nbpar.pool import worker

    # what re-running the pool cell does on the engines: leave, then join again
    pool._rendezvous()
    pool._rendezvous()
    res = pool.execute(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert res.results[0]["text/plain"] == "2.0"
    assert worker.routable_address("127.0.0.1") == "127.0.0.1"


def test_replace_restart_shutdown_and_context_manager():
    with nbpar.Pool(1, replace=False) as first:
        first_pids = [e["pid"] for e in first.engines]
        second = nbpar.Pool(1)  # re-running the cell that makes the pool
        assert first.closed and not second.closed
        assert not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in first_pids
        )
        old = second.engines[0]["pid"]
        second.restart()
        assert second.engines[0]["pid"] != old
        assert second.run(lambda: 6 * 7) == [42]
        pids = [e["pid"] for e in second.engines]
        second.shutdown()
        second.shutdown()  # idempotent
        with pytest.raises(PoolError, match="shut down"):
            second.execute("pass")
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_connect_attaches_to_a_running_cluster():
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=2, log_level=40)
    cluster.start_cluster_sync()
    try:
        pool = nbpar.Pool.connect(
            cluster.cluster_file and None,
            profile_dir=cluster.profile_dir,
            cluster_id=cluster.cluster_id,
            n=2,
        )
        res = pool.execute(
            "import torch, torch.distributed as dist\nt = torch.ones(1)\n"
            "dist.all_reduce(t)\nt.item()"
        )
        assert res.results[1]["text/plain"] == "2.0"
        pool.shutdown()  # leaves the cluster running: not ours
        assert (
            len(ipp.Client(profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id).ids) == 2
        )
    finally:
        cluster.stop_cluster_sync()


def test_listens_on_loopback_only_and_connection_files_are_private(pool):
    import glob
    import stat

    procs = [psutil.Process(pool.cluster.controller.process.pid)]
    procs += procs[0].children(recursive=True)
    procs += [psutil.Process(e["pid"]) for e in pool.engines]
    listening = {
        (p.pid, c.laddr.ip)
        for p in procs
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening and {ip for _, ip in listening} == {"127.0.0.1"}, listening
    files = glob.glob(
        os.path.join(pool.cluster.profile_dir, "security", f"*{pool.cluster.cluster_id}*.json")
    )
    assert pool.cluster.cluster_file in files and len(files) >= 3
    for path in files:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} is readable by others ({oct(mode)})"
