"""Multi-host without a second machine: engines in network namespaces of their own.

The test builds a private /24 (10.213.7.0/24) on a bridge it creates: the
controller listens on the host side (10.213.7.1), each engine runs in its own
namespace and UTS namespace (its own address and hostname), so the rendezvous
must go to engine 0's namespace address, exactly as across real hosts. Nothing
outside that bridge is contacted; namespaces, links and processes are removed
by a finalizer whatever happens.
"""

from __future__ import annotations

import time

import psutil
import pytest

import nbpar
from nbpar.errors import PoolError
from nbpar.pool import pool as pool_mod
from tests.distributed import children
from tests.netns_hosts import IFNAME, Hosts, namespaces_allowed, run_ip

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def hosts(request, tmp_path):
    reason = namespaces_allowed()
    if reason:
        pytest.skip(reason)
    h = Hosts(2)
    request.addfinalizer(h.down)  # before up(): a half-built network is removed too
    h.up()
    h.start_controller()
    h.log_dir = str(tmp_path)
    return h


def _children_except(h) -> set[int]:
    """Our child processes, leaving out the engines and controller the test started."""
    ours = set()
    for pid in [p.pid for p in h.procs] + [h.cluster.controller.process.pid]:
        try:
            ours |= {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    return children() - ours


def _connect(h, n=2, **kwargs):
    return nbpar.Pool.connect(
        profile_dir=h.cluster.profile_dir,
        cluster_id=h.cluster.cluster_id,
        n=n,
        env={"GLOO_SOCKET_IFNAME": IFNAME},
        **kwargs,
    )


def test_engines_on_two_hosts_rendezvous_on_engine_0_and_all_reduce(hosts):
    for i in range(2):
        hosts.start_engine(i, hosts.log_dir)
    pool = _connect(hosts, start_timeout=90, pg_timeout=60)
    try:
        assert pool.addr == Hosts.addr(0)  # engine 0's namespace address, not 127.0.0.1
        assert [e["host"] for e in pool.engines] == ["nbphost0", "nbphost1"]
        assert [e["local_rank"] for e in pool.engines] == [0, 0]
        seen = pool.run(
            lambda: __import__("nbpar.pool.worker").pool.worker.routable_address("10.213.7.1")
        )
        assert seen == [Hosts.addr(0), Hosts.addr(1)]
        res = pool.execute(
            "import torch, torch.distributed as dist\n"
            "t = torch.arange(4.0) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
            "print(t.tolist())"
        )
        assert res.text() == "[rank 0] [0.0, 3.0, 6.0, 9.0]\n[rank 1] [0.0, 3.0, 6.0, 9.0]"
        assert [r["host"] for r in pool.status()] == ["nbphost0", "nbphost1"]
    finally:
        pool.shutdown()


def test_unreachable_rendezvous_names_the_address_and_leaves_nothing(hosts):
    # host 1 reaches the controller but not host 0: a firewall between two nodes
    run_ip("-n", hosts.names[1], "route", "add", "prohibit", f"{Hosts.addr(0)}/32")
    for i in range(2):
        hosts.start_engine(i, hosts.log_dir)
    hosts.wait_for_engines(2)  # registration is not what this test times
    before = _children_except(hosts)
    live = set(pool_mod._live)
    t = time.monotonic()
    with pytest.raises(PoolError, match=rf"{Hosts.addr(0)}:\d+ within 4 s.*reachable"):
        _connect(hosts, start_timeout=4, pg_timeout=4)
    assert time.monotonic() - t < 60
    extra = _children_except(hosts) - before
    assert not extra, [psutil.Process(p).cmdline() for p in extra]  # the pool started nothing
    assert set(pool_mod._live) == live  # ... and did not become the current pool


def test_ranks_group_by_host_when_registration_interleaves_hosts(hosts):
    # engine ids 0..3 on hosts 0, 1, 0, 1 (what Slurm or SSH registration looks like)
    for i in range(4):
        hosts.start_engine(i, hosts.log_dir, host=i % 2)
        hosts.wait_for_engines(i + 1)  # registration order = engine id order
    pool = _connect(hosts, n=4, start_timeout=90, pg_timeout=60)
    try:
        assert [e["host"] for e in pool.engines] == ["nbphost0"] * 2 + ["nbphost1"] * 2
        assert [e["local_rank"] for e in pool.engines] == [0, 1, 0, 1]
        assert [pool.engine_id(r) for r in range(4)] == [0, 2, 1, 3]
        got = pool.run(lambda: __import__("os").environ["LOCAL_RANK"])
        assert got == ["0", "1", "0", "1"]
        res = pool.execute(
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1) * dist.get_rank(); dist.all_reduce(t); print(t.item())"
        )
        assert res.text() == "\n".join(f"[rank {r}] 6.0" for r in range(4))
    finally:
        pool.shutdown()


def test_controller_on_all_interfaces_rendezvous_on_engine_0s_routable_address(hosts):
    # the documented Slurm recipe: ip="0.0.0.0"; the client sees the controller on loopback
    hosts.cluster.stop_cluster_sync()
    hosts.start_controller(ip="0.0.0.0")
    for i in range(2):
        hosts.start_engine(i, hosts.log_dir)
    pool = _connect(hosts, start_timeout=30, pg_timeout=30)
    try:
        assert pool.addr == Hosts.addr(0)  # not engine 0's loopback
        res = pool.execute(
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t); print(t.item())"
        )
        assert res.text() == "[rank 0] 3.0\n[rank 1] 3.0"
    finally:
        pool.shutdown()
