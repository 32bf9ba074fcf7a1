"""A pool through ipyparallel's SSH launcher, against real ssh servers on two fake hosts.

Each fake host (`tests/netns_hosts.py`: a network namespace with its own address and,
in a UTS namespace, its own hostname) runs an OpenSSH server of its own on port 22,
with a host key and one authorised key made for the test. The pool's controller
listens on the bridge's host side; ipyparallel logs into each host, copies the
engine connection file and starts nbpar's engine there, so the rendezvous, the
hostnames, the hang doctor and the training cross hosts as on a real cluster.
Needs root, network namespaces and Debian's openssh-server (`scripts/install_cluster.sh`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch

import nbpar
from nbpar.errors import DistTimeout
from tests.netns_hosts import HOST_IP, IFNAME, Hosts, namespaces_allowed

pytestmark = pytest.mark.timeout(300)

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PRIVSEP = "/run/sshd"  # OpenSSH's privilege-separation folder, which it must find


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "ssh servers in network namespaces need root"
    if not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None:
        return "no OpenSSH server or client: run `sh scripts/install_cluster.sh`"
    return namespaces_allowed()


def _sshd_config(folder, i: int) -> str:
    path = os.path.join(folder, f"sshd{i}.conf")
    with open(path, "w") as f:
        f.write(
            "\n".join(
                [
                    f"ListenAddress {Hosts.addr(i)}:22",
                    f"HostKey {folder}/host_key",
                    f"AuthorizedKeysFile {folder}/authorized_keys",
                    f"PidFile {folder}/sshd{i}.pid",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",  # the test folder is root's, but not 0755 all the way
                    "Subsystem sftp internal-sftp",  # scp speaks sftp
                    "",
                ]
            )
        )
    return path


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    folder = str(tmp_path_factory.mktemp("ssh"))
    made_privsep = not os.path.isdir(PRIVSEP)
    os.makedirs(PRIVSEP, mode=0o755, exist_ok=True)
    for name, kind in (("host_key", "ed25519"), ("id", "ed25519")):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", f"{folder}/{name}"], check=True
        )
    shutil.copy(f"{folder}/id.pub", f"{folder}/authorized_keys")
    hosts = Hosts(2)
    try:
        hosts.up()
        for i in range(2):
            conf = _sshd_config(folder, i)
            hosts.procs.append(
                subprocess.Popen(
                    [
                        *("ip", "netns", "exec", hosts.names[i], "unshare", "--uts", "sh", "-c"),
                        f"hostname nbphost{i} && exec {SSHD} -D -e -f {conf}",
                    ],
                    stdout=open(f"{folder}/sshd{i}.log", "ab"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        hosts.folder = folder
        hosts.ssh_args = [
            *("-i", f"{folder}/id", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"),
            *("-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"),
        ]
        for i in range(2):
            _wait_for_login(hosts, i)
        yield hosts
    finally:
        hosts.down()  # the ssh servers (their process groups), then the namespaces
        if made_privsep:
            shutil.rmtree(PRIVSEP, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for_login(hosts, i: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        res = subprocess.run(
            ["ssh", *hosts.ssh_args, Hosts.addr(i), "hostname"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if res.returncode == 0:
            assert res.stdout.strip() == f"nbphost{i}"
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no ssh login on {Hosts.addr(i)}: {res.stderr.strip()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ssh_pool(ssh_hosts):
    from traitlets.config import Config

    c = Config()
    c.SSHEngineSetLauncher.engines = {Hosts.addr(0): 1, Hosts.addr(1): 1}
    c.SSHLauncher.ssh_args = ssh_hosts.ssh_args
    c.SSHLauncher.scp_args = ssh_hosts.ssh_args
    # same paths on every host, as on a cluster; an ssh login gets no kernel environment,
    # so the remote side is told the test's IPython directory (none made in the home dir)
    here = shlex.quote(os.environ["IPYTHONDIR"])
    c.SSHLauncher.remote_python = f"env IPYTHONDIR={here} {shlex.quote(sys.executable)}"
    # where ipyparallel copies the connection file to: not the file itself
    c.SSHLauncher.remote_profile_dir = os.path.join(ssh_hosts.folder, "remote_profile")
    pool = nbpar.Pool(
        2,
        launcher="ssh",
        ip=HOST_IP,
        config=c,
        env={"GLOO_SOCKET_IFNAME": IFNAME},
        replace=False,
        start_timeout=90,
        pg_timeout=60,
    )
    yield pool
    pool.shutdown()


def test_ssh_engines_on_two_hosts_rendezvous_and_report_both_hosts(ssh_pool):
    assert [r["host"] for r in ssh_pool.status()] == ["nbphost0", "nbphost1"]
    assert ssh_pool.addr == Hosts.addr(0)  # engine 0's address on the cluster network
    html = ssh_pool._repr_html_()
    assert "nbphost0" in html and "nbphost1" in html
    res = ssh_pool.execute(
        "import socket, torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t)\n"
        "print(t.item(), socket.gethostname())"
    )
    assert res.text() == "[rank 0] 3.0 nbphost0\n[rank 1] 3.0 nbphost1"
    # the cell went straight to the engines on the other hosts, not through the controller
    assert ssh_pool.cells is not None


def test_training_across_ssh_hosts_equals_single(ssh_pool):
    common = dict(model="simple_cnn", steps=20, seed=5)
    ddp = ssh_pool.train(nbpar.TrainConfig(strategy="ddp", micro_batch=4, **common)).result()
    single = ssh_pool.train(nbpar.TrainConfig(strategy="single", micro_batch=8, **common))
    torch.testing.assert_close(
        torch.tensor(ddp["losses"]),
        torch.tensor(single.result()["losses"]),
        atol=1e-5,
        rtol=0,
    )
    # the gradients crossed from one host to the other, all-reduced as on one host
    assert all(r["comm_bytes_by_op"].get("all_reduce", 0) > 0 for r in ddp["ranks"])


def test_the_doctor_names_the_rank_and_host_that_hangs(ssh_pool):
    ssh_pool.execute("import time, torch, torch.distributed as dist\nt = torch.ones(3)")
    with pytest.raises(DistTimeout) as err:
        ssh_pool.execute(
            "if dist.get_rank() == 1:\n    time.sleep(60)\ndist.all_reduce(t)\n", timeout=3
        )
    assert re.search(r"rank 1 is not in a collective, at cell line 2", str(err.value))
    lines = err.value.report.lines()
    assert any(re.match(r"rank 0 \(pid \d+ on nbphost0\): in collective", x) for x in lines)
    assert any(re.match(r"rank 1 \(pid \d+ on nbphost1\): running", x) for x in lines)
    ssh_pool.restart()  # fresh engines, logged into again over ssh
    assert [r["host"] for r in ssh_pool.status()] == ["nbphost0", "nbphost1"]
    # (a cell, not pool.run(f): f would be pickled by reference to this test module, which
    # engines started by ssh, in the login's home folder, cannot import)
    res = ssh_pool.execute("import torch.distributed as dist\nprint(dist.get_rank())")
    assert res.text() == "[rank 0] 0\n[rank 1] 1"
