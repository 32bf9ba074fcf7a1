"""``nbpar bench launch``: nbpar's pool vs raw ipyparallel, measured in one run.

Three figures for each: seconds from nothing to a completed all_reduce
(``ready_s``), the median round trip of a trivial cell (``cell_ms``) and of a
cell with one all_reduce (``allreduce_ms``). The baseline is what a user
would write by hand: ``ipp.Cluster(n)`` with default settings, then an
``init_process_group`` cell; its cells run as ``%px`` runs them
(``view.execute(code, silent=False)``, so values are displayed, as ``%%dist`` does).
Both pools stay up while cells are timed, and
the timings alternate between them, so a noisy machine's drift hits both.
Then, the baseline shut down, ``restart_s``: a hung cell times out, and
``pool.restart()`` to a completed all_reduce once the spare engines it started
have registered; ``restart_cold_s``: a restart with no spares prepared.
"""

from __future__ import annotations

import socket
import statistics
import time

ALLREDUCE = "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)"
#: A cell where rank 1 waits in an all_reduce that rank 0 never joins.
HANG = (
    "import torch, torch.distributed as dist\n"
    "if dist.get_rank() == 1:\n    dist.all_reduce(torch.ones(1))"
)


def _hand_init(port):
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))


def start_nbpar(n: int):
    import nbpar

    t0 = time.perf_counter()
    pool = nbpar.Pool(n, replace=False)
    pool.execute(ALLREDUCE)
    return pool, time.perf_counter() - t0


def start_baseline(n: int):
    """Raw ipyparallel, defaults, process group initialised by hand."""
    import ipyparallel as ipp

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    rc = cluster.start_and_connect_sync()
    view = rc[:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    view.scatter("RANK", list(range(n)), flatten=True, block=True)
    view.execute(
        f"import os; os.environ['RANK'] = str(RANK); os.environ['WORLD_SIZE'] = '{n}'", block=True
    )
    view.apply_sync(_hand_init, port)
    view.execute(ALLREDUCE, block=True)
    return cluster, view, time.perf_counter() - t0


def time_restart(pool, after_hang: bool = True, settle_s: float = 60.0) -> float:
    """Seconds from ``pool.restart()`` to a completed all_reduce on the new engines.

    ``after_hang``: as a user meets it: a cell hangs and times out (which starts spare
    engines), the user reads the message (here: until the spares have registered,
    at most ``settle_s``), then restarts. Otherwise a restart out of the blue, with
    no spares: new engines start while the old ones are killed.
    """
    from nbpar.errors import DistTimeout

    if after_hang:
        try:
            pool.execute(HANG, timeout=1.0)
        except DistTimeout:
            pass
        deadline = time.monotonic() + settle_s
        while not pool.restart_ready() and time.monotonic() < deadline:
            time.sleep(0.1)
    t0 = time.perf_counter()
    pool.restart()
    pool.execute(ALLREDUCE)
    return time.perf_counter() - t0


def _timed_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def bench_launch(engines: int = 2, reps: int = 30) -> dict:
    """nbpar's figures with the baseline's beside them, plus their ratios."""
    pool, ours_ready = start_nbpar(engines)
    try:
        cluster, view, base_ready = start_baseline(engines)
        try:
            cells = {k: [] for k in ("ours_cell", "base_cell", "ours_ar", "base_ar")}
            for i in range(reps + 1):  # the first round warms up
                order = [
                    ("ours", lambda c: pool.execute(c)),
                    ("base", lambda c: view.execute(c, silent=False, block=True)),
                ]
                for who, run in order if i % 2 else order[::-1]:
                    cell = _timed_ms(lambda run=run: run("pass"))
                    ar = _timed_ms(lambda run=run: run(ALLREDUCE))
                    if i:
                        cells[f"{who}_cell"].append(cell)
                        cells[f"{who}_ar"].append(ar)
        finally:
            cluster.stop_cluster_sync()
        restart_s = time_restart(pool)  # the baseline is gone: nothing else runs
        restart_cold_s = time_restart(pool, after_hang=False)
    finally:
        pool.shutdown()
    med = {k: statistics.median(v) for k, v in cells.items()}
    ours = {"ready_s": ours_ready, "cell_ms": med["ours_cell"], "allreduce_ms": med["ours_ar"]}
    base = {"ready_s": base_ready, "cell_ms": med["base_cell"], "allreduce_ms": med["base_ar"]}
    return {
        **ours,
        "baseline": base,
        "ratio": {k: ours[k] / base[k] for k in ours},
        "restart_s": restart_s,
        "restart_cold_s": restart_cold_s,
        "engines": engines,
        "reps": reps,
    }
