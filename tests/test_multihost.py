"""Multi-host without a second machine: engines in network namespaces of their own.

The test builds a private /24 (10.213.7.0/24) on a bridge it creates: the
controller listens on the host side (10.213.7.1), each engine runs in its own
namespace and UTS namespace (its own address and hostname), so the rendezvous
must go to engine 0's namespace address, exactly as across real hosts. Nothing
outside that bridge is contacted; namespaces, links and processes are removed
by a finalizer whatever happens.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import nbpar
from nbpar.errors import PoolError
from nbpar.pool import pool as pool_mod
from tests.distributed import children

pytestmark = pytest.mark.timeout(180)

SUBNET = "10.213.7"
HOST_IP = f"{SUBNET}.1"
IFNAME = "nbp0"  # the engine-side interface, same name in every namespace


def _ip(*args, check=True):
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


class Hosts:
    """N fake hosts: namespace i has address 10.213.7.(i+2) and hostname nbphost<i>."""

    _made = itertools.count()  # a fresh tag per set: no name of an earlier set is reused

    def __init__(self, n: int):
        self.tag = f"nbp{os.getpid() % 100000}{next(Hosts._made) % 10}"
        self.bridge = f"{self.tag}br"
        self.names = [f"{self.tag}n{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self.cluster = None

    def up(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{HOST_IP}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            host_end = f"{self.tag}h{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 2}"

    def start_controller(self, ip: str = HOST_IP):
        """ip="0.0.0.0" is the Slurm recipe: listen everywhere, advertise HOST_IP."""
        import ipyparallel as ipp

        from nbpar.pool.startup import CONTROLLER_ARGS

        args = [*CONTROLLER_ARGS, f"--IPController.location={HOST_IP}"]
        self.cluster = ipp.Cluster(n=0, controller_ip=ip, log_level=40, controller_args=args)
        self.cluster.start_controller_sync()
        return self.cluster

    def start_engine(self, i: int, log_dir, host: int | None = None) -> None:
        """`ip netns exec` + a UTS namespace: engine i on fake host nbphost<host> (default i)."""
        host = i if host is None else host
        cfile = os.path.join(
            self.cluster.profile_dir,
            "security",
            f"ipcontroller-{self.cluster.cluster_id}-engine.json",
        )
        engine = (
            f"hostname nbphost{host} && exec {sys.executable} -m nbpar.pool.engine "
            f"--file={cfile} --IPEngine.id={i} --log-level=40"
        )
        with open(os.path.join(log_dir, f"engine{i}.log"), "ab") as log:
            self.procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        self.names[host],
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        engine,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def wait_for_engines(self, n: int, timeout: float = 90) -> None:
        client = self.cluster.connect_client_sync()
        try:
            client.wait_for_engines(n, timeout=timeout, interactive=False)
        finally:
            client.close()

    def down(self):
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        if self.cluster is not None:
            self.cluster.stop_cluster_sync()
        for i, ns in enumerate(self.names):
            # deleting a veth end removes its peer at once; a namespace's own interfaces
            # go when the kernel gets to it, after `netns del` has returned
            _ip("link", "del", f"{self.tag}h{i}", check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)


def _namespaces_allowed() -> str | None:
    probe = f"nbpprobe{os.getpid() % 100000}"
    try:
        res = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if res.returncode != 0:
        return f"this machine forbids network namespaces: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def hosts(request, tmp_path):
    reason = _namespaces_allowed()
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
    _ip("-n", hosts.names[1], "route", "add", "prohibit", f"{Hosts.addr(0)}/32")
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
