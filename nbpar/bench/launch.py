"""``nbpar bench launch``: nbpar's pool vs raw ipyparallel, measured in one run.

Three figures for each: seconds from nothing to a completed all_reduce
(``ready_s``), the median round trip of a trivial cell (``cell_ms``) and of a
cell with one all_reduce (``allreduce_ms``). The baseline is what a user
would write by hand: ``ipp.Cluster(n)`` with default settings, then an
``init_process_group`` cell.
"""
from __future__ import annotations

import statistics
import time

ALLREDUCE = ("import torch, torch.distributed as dist\n"
             "t = torch.ones(1)\ndist.all_reduce(t)")


def _median_ms(fn, reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure_nbpar(n: int, reps: int) -> dict:
    import nbpar

    t0 = time.perf_counter()
    pool = nbpar.Pool(n)
    try:
        pool.execute(ALLREDUCE)
        ready = time.perf_counter() - t0
        cell = _median_ms(lambda: pool.execute("pass"), reps)
        allreduce = _median_ms(lambda: pool.execute(ALLREDUCE), reps)
    finally:
        pool.shutdown()
    return {"ready_s": ready, "cell_ms": cell, "allreduce_ms": allreduce}


def _hand_init(port):
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))


def measure_baseline(n: int, reps: int) -> dict:
    """Raw ipyparallel, defaults, process group initialised by hand."""
    import socket

    import ipyparallel as ipp

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    rc = cluster.start_and_connect_sync()
    try:
        view = rc[:]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        view.scatter("RANK", list(range(n)), flatten=True, block=True)
        view.execute("import os; os.environ['RANK'] = str(RANK); "
                     f"os.environ['WORLD_SIZE'] = '{n}'", block=True)
        view.apply_sync(_hand_init, port)
        view.execute(ALLREDUCE, block=True)
        ready = time.perf_counter() - t0
        cell = _median_ms(lambda: view.execute("pass", block=True), reps)
        allreduce = _median_ms(lambda: view.execute(ALLREDUCE, block=True), reps)
    finally:
        cluster.stop_cluster_sync()
    return {"ready_s": ready, "cell_ms": cell, "allreduce_ms": allreduce}


def bench_launch(engines: int = 2, reps: int = 30) -> dict:
    """nbpar's figures with the baseline's beside them, plus their ratios."""
    ours = measure_nbpar(engines, reps)
    base = measure_baseline(engines, reps)
    ratios = {k: ours[k] / base[k] for k in ours if base[k]}
    return {**ours, "baseline": base, "ratio": ratios, "engines": engines}
