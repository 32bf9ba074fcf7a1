"""A run's wall time with the live dashboard following it vs not, in pairs.

    python benchmarks/dashboard_overhead.py --steps 30 --pairs 6

One pool, warmed with a 2-step run each way. Each pair times ``pool.train(cfg)`` of
N steps from the call until ``result()`` returns, once with the dashboard following
the run exactly as a notebook shows it (the widget built, `Dashboard.start()`: a
thread that reads the records and sends the browser the new steps every 0.8 s, its
``poll_s``; with no browser here the messages go nowhere after being built), once
without; the pairs alternate which goes first. Both sides run on the same live pool.

Target: the median over pairs of (following / not) <= 1.02.
Writes results/dashboard_overhead.json.
"""

import argparse
import time

from results import Recorder

import nbpar
from nbpar.view.dashboard import Dashboard

SIZES = {"d_model": 128, "n_layers": 4, "seq_len": 128}  # as ddp_vs_torchrun.py


def timed(pool, args, steps: int, dashboard: bool) -> dict:
    """Wall time of one run, from ``pool.train`` to its result (dashboard inside)."""
    cfg = nbpar.TrainConfig(
        model="tiny_gpt",
        strategy="ddp",
        micro_batch=args.micro_batch,
        steps=steps,
        gpt=nbpar.GPTConfig(**SIZES),
    )
    t = time.perf_counter()
    run = pool.train(cfg)
    dash = None
    if dashboard:
        dash = Dashboard(run)
        dash.widget  # noqa: B018 (builds the widget, as display(run) does)
        dash.start()
    run.result()
    wall = time.perf_counter() - t
    if dash is None:
        return {"wall_s": wall}
    dash.stop_following()
    if len(dash.chart.x) != steps:
        raise RuntimeError(f"the dashboard drew {len(dash.chart.x)} of {steps} steps")
    return {"wall_s": wall, "chunks_sent": dash.chart.sent}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--pairs", type=int, default=6)
    args = p.parse_args()
    if args.pairs < 5:
        p.error("--pairs: at least 5")
    rec = Recorder(
        "dashboard_overhead",
        "run wall time, live dashboard following vs not",
        __doc__.split("\n\n", 2)[2].split("\n\nTarget")[0],
        repeats=args.pairs,
        measures=[
            "nbpar/view",
            "nbpar/pool",
            "nbpar/train",
            "nbpar/measure",
            "benchmarks/dashboard_overhead.py",
        ],
        config={"engines": 2, "steps": args.steps, "micro_batch": args.micro_batch, **SIZES},
    )
    with nbpar.Pool(2) as pool:
        timed(pool, args, 2, True)  # warm-up both ways, not recorded
        timed(pool, args, 2, False)
        rows = rec.alternated_pairs(
            args.pairs,
            lambda side: timed(pool, args, args.steps, side == "following"),
            ("following", "not_following"),
            "wall_s",
        )
    rec.figure(
        f"following / not, wall time of {args.steps} steps",
        [r["ratio"] for r in rows],
        "x",
        "<= 1.02",
        digits=3,
    )
    rec.figure("wall time, following", [r["following"]["wall_s"] for r in rows], "s", digits=3)
    rec.figure(
        "wall time, not following", [r["not_following"]["wall_s"] for r in rows], "s", digits=3
    )
    rec.save()


if __name__ == "__main__":
    main()
