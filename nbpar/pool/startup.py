"""Bringing a pool up: its arguments checked, the ipyparallel cluster started, and
the rendezvous that joins the engines into one torch.distributed process group.

`nbpar.pool.pool.Pool` calls these when it starts, connects or restarts; they hand
back what they made and set nothing on the pool.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from nbpar.checks import positive_int
from nbpar.errors import PoolError

#: Faster than ipyparallel's defaults (its 3 s heartbeat period made registration take
#: ~6 s): an engine registers at its heart's first answer, and the controller beats
#: every 50 ms while engines register (`nbpar.pool.controller`); a dead engine is still
#: only declared after 10 s without heartbeats.
CONTROLLER_ARGS = ["--HeartMonitor.period=200", "--HeartMonitor.max_heartmonitor_misses=50"]


def check_size(n) -> int:
    """``n`` as a number of engines, or ValueError."""
    return positive_int("Pool size", n)


def check_start(n, launcher, backend, timeout, port, ip, restart, slurm_options, config):
    """A pool's arguments checked before anything starts: (n, backend, note), the
    note being what the pool says once where it starts (None: nothing to say)."""
    from nbpar import device
    from nbpar.pool import launchers, slurm

    n_gpus = device.accelerator_count() if backend in (None, "nccl") else 0
    if backend is not None and backend not in device.BACKENDS:
        raise ValueError(f"backend must be one of {device.BACKENDS}, got {backend!r}")
    if n is not None:
        check_size(n)
    launchers.check_launcher(launcher)
    slurm.check_options(slurm_options, launcher, config)
    n, backend, note = device.pool_plan(n, backend, n_gpus, launcher == "local")
    problem = device.cpu_torch_on_a_gpu_machine() if launcher == "local" else None
    if problem:  # its GPU unseen, the pool would run on gloo without a word
        note = f"{note}; {problem}" if note else problem
    n = check_size(n)
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    check_port(port, ip)
    if restart not in (None, "auto"):
        raise ValueError(f"restart must be None or 'auto', got {restart!r}")
    return n, backend, note


def check_port(port, ip: str) -> None:
    """A rendezvous ``port`` that is a port number and free on this host (None: any)."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    with socket.socket() as s:
        try:
            s.bind((ip if ip not in ("*", "0.0.0.0", "") else "", port))
        except OSError:
            raise ValueError(
                f"port {port} is already in use on this host; pass another "
                f"port or leave port=None to pick a free one"
            ) from None


def start_cluster(
    n: int,
    launcher: str,
    ip: str,
    start_timeout: float,
    env: dict,
    say=None,
    backend: str = "gloo",
    slurm_options: dict | None = None,
    forkserver=None,
    **kwargs,
):
    """Start a controller and ``n`` engines; (cluster, client, engine ids, EngineSets)
    once all ``n`` registered. ``say(text)`` hears each stage and each engine that
    registers (`progress.StartProgress`); ``forkserver``: a `nbpar.pool.forked.ForkServer`
    that forks the engines (local engines; None: one process each); ``kwargs`` go to
    ``ipyparallel.Cluster``."""
    say = say or (lambda text: None)
    import ipyparallel as ipp

    from nbpar.pool import launchers, slurm
    from nbpar.pool.engines import EngineSets

    options = dict(
        n=n,
        engines=launcher,
        controller_ip=ip,
        delay=0,
        controller_args=list(CONTROLLER_ARGS),
        log_level=40,
        engine_timeout=int(start_timeout),
    )
    if forkserver is not None:
        from nbpar.pool.fork_launcher import ForkEngineSetLauncher

        options["engines"] = ForkEngineSetLauncher
    options.update(kwargs)
    cluster, client = ipp.Cluster(**options), None
    cluster.forkserver = forkserver
    try:
        ours = launcher.lower() == "slurm" and not slurm.own_template(cluster.config)
        launchers.configure(cluster, launcher, n, env, backend, slurm_options)
        if ours:  # a script nbpar wrote: Slurm says now whether it would run it
            slurm.check_submit(cluster.config.SlurmEngineSetLauncher.batch_template, n)
        say(f"starting a controller and {n} engine(s) ({launcher})")
        start_both(cluster, launcher, n)
        if cluster.cluster_file and os.path.exists(cluster.cluster_file):
            os.chmod(cluster.cluster_file, 0o600)  # connection details: the owner's only
        client = cluster.connect_client_sync()
        try:
            wait_registered(client, n, start_timeout, say)
        except TimeoutError as e:
            job = slurm.job_state(cluster) if launcher.lower() == "slurm" else None
            if job:  # still queued, say: the reason is Slurm's, not the engines'
                raise TimeoutError(f"{e}; {job}") from None
            raise
    except BaseException:
        stop(cluster, client)  # nothing left running when start-up fails
        raise
    return cluster, client, sorted(client.ids)[:n], EngineSets(cluster, n, launcher)


def start_both(cluster, launcher: str, n: int) -> None:
    """Start the controller and the engines. ipyparallel starts the engines once the
    controller has written its connection file, to hand it to them; local engines read
    it from the profile themselves (ipengine waits for it), so they are started first
    and import ipyparallel and torch while the controller comes up. Forked engines
    (``cluster.forkserver``) come once the fork server has imported torch, which it
    started doing before the kernel imported ipyparallel: the controller goes first."""
    if launcher.lower() != "local":
        cluster.start_cluster_sync()
        return
    cluster.send_engines_connection_env = False
    if getattr(cluster, "forkserver", None) is not None:
        cluster.start_controller_sync()
        warm_client()  # while the fork server imports torch
        cluster.start_engines_sync(n)
        return
    cluster.start_engines_sync(n)
    cluster.start_controller_sync()


def warm_client() -> None:
    """Pack one request as the client's first ``apply`` will: ipyparallel imports its
    serializers' types then (numpy: ~0.1 s), better while engines are still starting."""
    from ipyparallel.serialize import pack_apply_message

    pack_apply_message(os.getpid, (), {})


def wait_registered(client, n: int, timeout: float, say) -> None:
    """Wait for ``n`` engines, saying each count. ipyparallel's progress bar would be an
    output of its own: count here, one engine at a time (each wait still fails at once
    if an engine set stops, and raises TimeoutError at the deadline)."""
    deadline = time.monotonic() + timeout
    while (ready := len(client.ids)) < n:  # read once: another may register meanwhile
        say(f"{ready}/{n} engines registered")
        left = max(0.0, deadline - time.monotonic())
        client.wait_for_engines(ready + 1, timeout=left, interactive=False)


def stop(cluster, client) -> None:
    """Stop ``cluster`` (the engines and controller a pool started; None: not ours)
    and close ``client`` (None: none yet)."""
    try:
        if cluster is not None:
            # ipyparallel logs harmless races while removing engine log files
            # ("Failed to remove ...log"): not worth a red line in a notebook
            cluster.log.setLevel(logging.CRITICAL)
            for key, engines in list(cluster.engines.items()):
                if getattr(engines, "job_id", None) == "":  # never submitted: nothing to cancel
                    cluster.engines.pop(key)
            cluster.stop_cluster_sync()
    finally:
        if client is not None:
            client.close()


def orphan_watch(cluster) -> dict:
    """What each engine watches so that it exits with this kernel (and takes the
    controller this kernel started with it): `nbpar.pool.orphan`."""
    proc = getattr(getattr(cluster, "controller", None), "process", None)
    also = [proc.pid] if proc is not None else []
    return {"host": socket.gethostname(), "pid": os.getpid(), "also_kill": also}


def controller_host(client, ip: str) -> str:
    """The host the engines reached the controller at: engine 0 opens the store there."""
    url = client._config.get("registration", "") if hasattr(client, "_config") else ""
    host = url.split("://")[-1].rsplit(":", 1)[0] if url else ip
    return host or "127.0.0.1"


LOOPBACK_OR_ANY = ("", "*", "0.0.0.0", "localhost")


def rank_order(ids: list[int], hosts: dict[int, str]) -> list[int]:
    """Engine ids in rank order: by (host, engine id), so consecutive ranks share a
    host (tensor-parallel groups stay on one node) and LOCAL_RANK counts within it."""
    return sorted(ids, key=lambda eid: (hosts[eid], eid))


def store_peer(controller: str, engines: list[dict], here: str) -> str:
    """Where engine 0 routes to when it picks its rendezvous address.

    ``controller``: the host the client reached the controller at; ``engines``: one
    ``worker.whoami`` dict per rank (engine 0 first); ``here``: the client's hostname.
    A routable controller is the answer; a loopback or wildcard one (``ip="0.0.0.0"``)
    is, unless every engine runs here, replaced by another host's engine address, so
    engine 0 listens on the interface that reaches the other nodes.
    """
    if controller not in LOOPBACK_OR_ANY and not controller.startswith("127."):
        return controller
    first = engines[0]["host"]
    others = [e for e in engines if e["host"] != first]
    if not others:
        return "127.0.0.1"  # one host: loopback reaches every rank
    for e in [*others, engines[0]]:  # engine 0's own address routes to itself
        if e["addr"]:
            return e["addr"]
    raise PoolError(
        f"the controller listens on {controller!r} but engines run on "
        f"{sorted({e['host'] for e in engines})} and none reported a routable address: "
        f"pass ip=<this host's address on the cluster network> to Pool"
    )


def rendezvous(
    client,
    ids: list[int],
    *,
    backend: str,
    ip: str,
    port: int | None,
    pg_timeout: float,
    start_timeout: float,
    env: dict,
    watch: dict | None,
) -> tuple[list[dict], str, int]:
    """Engines ``ids`` join the process group in `rank_order`; rank 0's engine opens the
    store on the address `store_peer` picks. Returns (one dict per rank as `worker.join`
    reports it, with its ``engine_id``, store address, port)."""
    from nbpar.pool import worker

    location = client._config.get("location") if hasattr(client, "_config") else None
    who = dict(zip(ids, client[ids].apply_sync(worker.whoami, location)))
    ids = rank_order(ids, {eid: w["host"] for eid, w in who.items()})
    peer = store_peer(controller_host(client, ip), [who[e] for e in ids], socket.gethostname())
    addr, port = client[ids[0]].apply_sync(worker.open_store, peer, port or 0, pg_timeout)
    n = len(ids)
    results = [
        client[eid].apply_async(worker.join, rank, n, addr, port, backend, pg_timeout, env, watch)
        for rank, eid in enumerate(ids)
    ]
    deadline = time.monotonic() + start_timeout
    engines = []
    for rank, ar in enumerate(results):
        if not ar.wait(max(0.0, deadline - time.monotonic())):
            raise PoolError(
                f"rank {rank} did not join the process group at "
                f"{addr}:{port} within {start_timeout:.0f} s: "
                f"is that address reachable from every engine?"
            )
        engines.append({**ar.get(), "engine_id": ids[rank]})
    return engines, addr, port
