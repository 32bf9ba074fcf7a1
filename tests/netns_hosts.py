"""Fake hosts on one machine: network namespaces on a private bridge, each with its own
address and (in a UTS namespace) its own hostname. `tests/test_multihost.py` starts
engines in them by hand; `tests/test_ssh.py` runs an ssh server in each.

The hosts share a private /24 (10.213.7.0/24) on a bridge made for them: the host side
is 10.213.7.1, host i is 10.213.7.(i+2). Nothing outside that bridge is contacted;
`Hosts.down` removes namespaces, links and processes whatever state they are in.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

SUBNET = "10.213.7"
HOST_IP = f"{SUBNET}.1"
IFNAME = "nbp0"  # the engine-side interface, same name in every namespace


def run_ip(*args, check=True):
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
        run_ip("link", "add", self.bridge, "type", "bridge")
        run_ip("addr", "add", f"{HOST_IP}/24", "dev", self.bridge)
        run_ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            run_ip("netns", "add", ns)
            host_end = f"{self.tag}h{i}"
            run_ip("link", "add", host_end, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            run_ip("link", "set", host_end, "master", self.bridge, "up")
            run_ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            run_ip("-n", ns, "link", "set", IFNAME, "up")
            run_ip("-n", ns, "link", "set", "lo", "up")

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
            run_ip("link", "del", f"{self.tag}h{i}", check=False)
            run_ip("netns", "del", ns, check=False)
        run_ip("link", "del", self.bridge, check=False)


def namespaces_allowed() -> str | None:
    probe = f"nbpprobe{os.getpid() % 100000}"
    try:
        res = run_ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if res.returncode != 0:
        return f"this machine forbids network namespaces: {res.stderr.strip()}"
    run_ip("netns", "del", probe, check=False)
    return None
