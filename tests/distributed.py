"""Run a function on N real gloo processes and collect what each rank returns.

Used by the tests of the parallel layers, which need real processes but not a
whole engine pool. ``fn`` must be importable (module level), since workers are
spawned, and its return value picklable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta


def children() -> set[int]:
    """The pids of this process's children, recursively: a test that compares them before
    and after sees whether it left a process running."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        out = fn(rank, world, *args)
        queue.put((rank, True, out))
    except BaseException:  # report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180):
    """Return ``[fn(rank, world_size, *args) for each rank]``, run in parallel."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, ok, out = queue.get(timeout=timeout)
            (results if ok else errors)[rank] = out
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
