"""Reliability figures: time from an engine kill to the error, time to restart a
2-engine pool, and a hung collective's return time with --timeout.

    python benchmarks/reliability.py
"""
import json
import os
import signal
import threading
import time

import nbpar
from nbpar.errors import DistTimeout, EngineDied

LOOP = ("import time, torch, torch.distributed as dist\n"
        "for _ in range(1000):\n    dist.all_reduce(torch.ones(1))\n    time.sleep(0.05)")


def main():
    out = {}
    with nbpar.Pool(2) as pool:
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
            pool.execute("import torch, torch.distributed as dist\n"
                         "if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))",
                         timeout=2)
        except DistTimeout:
            out["hung_cell_returns_s"] = time.monotonic() - t
        pool.restart()
    print(json.dumps({**out, "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
