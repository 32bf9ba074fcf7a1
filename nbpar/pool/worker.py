"""What runs inside each engine: join (and re-join) the process group.

The client calls these through ipyparallel. Engine 0 opens a TCPStore on a
port the OS picks (so ports never collide), every engine then joins the
default process group through it. Everything here is re-runnable: joining
again first leaves the old group, so re-running the cell that makes a pool
never hits "initialize the default process group twice".
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

# Process-wide registry (one per engine process): the rendezvous store, rank, world size
# and backend of the group this engine joined; `join` fills it, `leave` empties it.
_state: dict = {}


def routable_address(peer_host: str) -> str:
    """The address of this host on the interface that reaches ``peer_host``.

    Engine 0's answer is the rendezvous address, so engines on other hosts can
    reach it (no hard-coded localhost).
    """
    if peer_host in ("", "*", "0.0.0.0"):
        peer_host = "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, 9))  # UDP connect sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def whoami(toward: str | None = None) -> dict:
    """This engine's hostname and an address other hosts may reach it at (None: only
    loopback found): the interface that reaches ``toward`` (the controller's advertised
    location), else its hostname's address, else the interface of its default route."""
    host = socket.gethostname()
    for probe in (toward, None, "10.255.255.255"):
        try:
            if probe is None:
                addr = socket.gethostbyname(host)
            else:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((probe, 9))  # UDP connect sends nothing
                    addr = s.getsockname()[0]
        except OSError:
            continue
        if not addr.startswith("127.") and addr != "0.0.0.0":
            return {"host": host, "addr": addr}
    return {"host": host, "addr": None}


def leave() -> None:
    """Destroy this engine's process groups and store (safe to call twice)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from nbpar.parallel.mesh import forget_meshes

        forget_meshes()  # their sub-groups die with the default group
        dist.destroy_process_group()
    _state.pop("store", None)


def warm() -> None:
    """Finish importing torch.distributed (a spare engine, before it is needed)."""
    import torch.distributed  # noqa: F401


def open_store(peer_host: str, port: int, timeout_s: float) -> tuple[str, int]:
    """On engine 0: leave any old group, serve a TCPStore, return (addr, port)."""
    import torch.distributed as dist

    leave()
    addr = routable_address(peer_host)
    # listen on that one address only (TCPStore alone would listen on all interfaces)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {addr}:{port} for the rendezvous: {err}") from None
    try:
        store = dist.TCPStore(
            addr,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now and closes it
    _state["store"] = store
    return addr, store.port


def join(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    backend: str,
    timeout_s: float,
    env: dict,
    watch: dict | None = None,
) -> dict:
    """Join the default process group as ``rank``; return this engine's facts."""
    import torch
    import torch.distributed as dist

    from nbpar import device
    from nbpar.pool import snapshot

    os.environ.update(env)
    snapshot.enable_recorder()
    if rank != 0:
        leave()
        store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        _state["store"] = store
    store = _state["store"]
    host = socket.gethostname()
    store.set(f"host/{rank}", host)
    hosts = [store.get(f"host/{r}").decode() for r in range(world_size)]
    local_rank = hosts[:rank].count(host)
    local_world = hosts.count(host)
    dev = device.bind(local_rank, backend)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" not in env:
        # engines on one host share its cores (on GPUs too: data loading and CPU-side
        # ops run there): don't oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(
        device.process_group_backend(backend),  # nccl pools: gloo too, for CPU tensors
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if watch and watch.get("host") == host:
        _watch_client(watch["pid"], watch.get("also_kill", ()))
    snapshot.serve(addr, port, rank, backend)  # answers pool.doctor() from a side thread
    _state.update(rank=rank, world_size=world_size, backend=backend)
    return {
        "rank": rank,
        "host": host,
        "pid": os.getpid(),
        "device": dev,
        "local_rank": local_rank,
        "backend": backend,
        "addr": addr,
        "port": port,
        "threads": torch.get_num_threads(),
    }


def _watch_client(client_pid: int, also_kill=()) -> None:
    """Exit this engine (and the controller) if the client kernel dies.

    Normal shutdown stops engines through ipyparallel; this covers a kernel that
    was killed outright, so no engine outlives it.
    """
    if _state.get("watching") == client_pid:
        return
    _state["watching"] = client_pid

    def watch():
        while True:
            time.sleep(1.0)
            try:
                os.kill(client_pid, 0)
            except ProcessLookupError:
                for pid in also_kill:
                    try:
                        os.kill(pid, 15)
                    except OSError:
                        pass
                os._exit(0)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="nbpar-client-watch", daemon=True).start()


def memory() -> dict:
    """Resident and peak memory of this engine, plus device memory on GPUs."""
    from nbpar import device

    return {
        "rss_bytes": device.rss_bytes() or 0,
        "peak_rss_bytes": device.peak_rss_bytes(),
        **device.memory_stats(_state.get("backend", "gloo")),
    }
