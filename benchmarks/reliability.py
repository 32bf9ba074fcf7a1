"""Reliability figures: time from an engine kill to the error, time to restart a
2-engine pool, and a hung collective's return time with --timeout.

    python benchmarks/reliability.py --repeats 3

Each repeat on one 2-engine pool: SIGKILL engine 1 one second into a cell that loops
over all_reduce (seconds to `EngineDied`), `pool.restart()` (seconds), then a cell
where rank 0 waits in an all_reduce rank 1 never joins, run with ``timeout=2``
(seconds to `DistTimeout`), and a restart.

Writes results/reliability.json.
"""

import argparse
import os
import signal
import threading
import time

from results import Recorder

import nbpar
from nbpar.errors import DistTimeout, EngineDied

LOOP = (
    "import time, torch, torch.distributed as dist\n"
    "for _ in range(1000):\n    dist.all_reduce(torch.ones(1))\n    time.sleep(0.05)"
)
HANG = (
    "import torch, torch.distributed as dist\n"
    "if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))"
)


def once(pool) -> dict:
    """Kill an engine mid-loop, restart, hang a cell; seconds of each (None: not raised)."""
    out = dict.fromkeys(("kill_to_error_s", "restart_s", "hung_cell_returns_s"))
    killed = {}

    def kill():
        killed["t"] = time.monotonic()
        os.kill(pool.engines[1]["pid"], signal.SIGKILL)

    threading.Timer(1.0, kill).start()
    try:
        pool.execute(LOOP)
    except EngineDied:
        out["kill_to_error_s"] = time.monotonic() - killed["t"]
    t = time.monotonic()
    pool.restart()
    out["restart_s"] = time.monotonic() - t
    t = time.monotonic()
    try:
        pool.execute(HANG, timeout=2)
    except DistTimeout:
        out["hung_cell_returns_s"] = time.monotonic() - t
    pool.restart()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rec = Recorder(
        "reliability",
        "engine kill, pool restart, hung cell (2 engines)",
        __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0],
        repeats=args.repeats,
        measures=["nbpar/pool", "nbpar/bench", "benchmarks/reliability.py"],
        config={"engines": 2, "cell_timeout_s": 2},
    )
    with nbpar.Pool(2) as pool:
        for i in range(args.repeats):
            rec.row(repeat=i, **once(pool))
    missing = [k for r in rec.rows for k, v in r.items() if v is None]
    if missing:
        raise RuntimeError(f"expected errors not raised: {missing}")
    rec.figure(
        "SIGKILL of an engine to EngineDied",
        [r["kill_to_error_s"] for r in rec.rows],
        "s",
        digits=3,
    )
    rec.figure("restart of a 2-engine pool", [r["restart_s"] for r in rec.rows], "s", digits=3)
    rec.figure(
        "hung cell with --timeout 2 returns",
        [r["hung_cell_returns_s"] for r in rec.rows],
        "s",
        digits=3,
    )
    rec.save()


if __name__ == "__main__":
    main()
