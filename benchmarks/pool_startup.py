"""Pool start-up and cell round trips: nbpar vs raw ipyparallel, repeated.

    python benchmarks/pool_startup.py --engines 2 --repeats 5

The figures of ``nbpar bench launch`` (the baseline is the same: `Cluster(n)` with
ipyparallel's defaults and a hand-written ``init_process_group``, its cells run as
``%px`` runs them), repeated, each repeat in two parts. Start-up: nbpar's `Pool(n)` to
a completed all_reduce and the baseline's, each timed while the other is shut down,
alternating which goes first. Cells: both pools up, the round trips of a trivial cell
and of a cell with one all_reduce alternate between them (medians of ``--cells``);
then, the baseline shut down, nbpar's restart: after a hung cell timed out and the
spare engines it started have registered (``restart_s``), and with no spares prepared
(``restart_cold_s``), each from ``pool.restart()`` to a completed all_reduce.

Targets: start-up ratio <= 0.5, cell ratios <= 1.1, restart after a hang <= 2.5 s
(median over repeats).
Writes results/pool_startup.json.
"""

import argparse
import statistics
import time

from results import Recorder

from nbpar.bench.launch import ALLREDUCE, start_baseline, start_nbpar, time_restart


def ms(run, code: str) -> float:
    t = time.perf_counter()
    run(code)
    return (time.perf_counter() - t) * 1000


def ready(engines: int, first: str) -> dict:
    """Start-up seconds of each side, the other one shut down."""
    out = {}
    for who in (first, "baseline" if first == "nbpar" else "nbpar"):
        if who == "nbpar":
            pool, out[who] = start_nbpar(engines)
            pool.shutdown()
        else:
            cluster, _view, out[who] = start_baseline(engines)
            cluster.stop_cluster_sync()
    return out


def cells(engines: int, reps: int) -> dict:
    """Median round trips (ms) of both pools' cells, alternated, both pools up."""
    pool, _ = start_nbpar(engines)
    try:
        cluster, view, _ = start_baseline(engines)
        try:
            runs = {
                "nbpar": pool.execute,
                "baseline": lambda c: view.execute(c, silent=False, block=True),
            }
            got = {(who, kind): [] for who in runs for kind in ("cell", "allreduce")}
            for i in range(reps + 1):  # the first round warms up
                for who in list(runs) if i % 2 else list(runs)[::-1]:
                    cell, ar = ms(runs[who], "pass"), ms(runs[who], ALLREDUCE)
                    if i:
                        got[who, "cell"].append(cell)
                        got[who, "allreduce"].append(ar)
        finally:
            cluster.stop_cluster_sync()
        restart = {
            "restart_s": time_restart(pool),
            "restart_cold_s": time_restart(pool, after_hang=False),
        }
    finally:
        pool.shutdown()
    return {
        **{f"{who}_{kind}_ms": statistics.median(v) for (who, kind), v in got.items()},
        **restart,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--cells", type=int, default=20, help="round trips per repeat")
    args = p.parse_args()
    rec = Recorder(
        "pool_startup",
        "pool start-up and cell round trips vs raw ipyparallel",
        __doc__.split("\n\n", 2)[2].split("\n\nTargets")[0],
        repeats=args.repeats,
        measures=["nbpar/pool", "benchmarks/pool_startup.py"],
        config={"engines": args.engines, "cells_per_repeat": args.cells},
    )
    for i in range(args.repeats):
        up = ready(args.engines, "nbpar" if i % 2 == 0 else "baseline")
        rec.row(
            repeat=i,
            nbpar_ready_s=up["nbpar"],
            baseline_ready_s=up["baseline"],
            **cells(args.engines, args.cells),
        )
    rows = rec.rows
    rec.figure(
        f"Pool({args.engines}) to a completed all_reduce, nbpar / baseline",
        [r["nbpar_ready_s"] / r["baseline_ready_s"] for r in rows],
        "x",
        "<= 0.5",
        3,
    )
    rec.figure("start-up, nbpar", [r["nbpar_ready_s"] for r in rows], "s", digits=3)
    rec.figure("start-up, raw ipyparallel", [r["baseline_ready_s"] for r in rows], "s", digits=3)
    for kind, what in (("cell", "trivial cell"), ("allreduce", "cell with one all_reduce")):
        rec.figure(
            f"{what} round trip, nbpar / baseline",
            [r[f"nbpar_{kind}_ms"] / r[f"baseline_{kind}_ms"] for r in rows],
            "x",
            "<= 1.1",
            3,
        )
        rec.figure(f"{what}, nbpar", [r[f"nbpar_{kind}_ms"] for r in rows], "ms", digits=3)
        rec.figure(
            f"{what}, raw ipyparallel", [r[f"baseline_{kind}_ms"] for r in rows], "ms", digits=3
        )
    rec.figure(
        f"restart after a hang, {args.engines} engines to a completed all_reduce",
        [r["restart_s"] for r in rows],
        "s",
        "<= 2.5",
        3,
    )
    rec.figure(
        "restart with no spares prepared",
        [r["restart_cold_s"] for r in rows],
        "s",
        "<= 2.5",  # the budget holds without spares too on an idle machine
        3,
    )
    rec.save()


if __name__ == "__main__":
    main()
