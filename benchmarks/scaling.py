"""Scaling on this machine: DDP throughput with 1, 2 and 4 engines, same global batch.

    python benchmarks/scaling.py

Kept honest: the core count is printed with the table. With 2 cores, 4 engines
share them, so throughput cannot grow past 2 engines; the point is to see the
split between compute and communication change, not a speed-up.
"""
import json
import os
import statistics

import nbpar


def main():
    rows = []
    global_batch = 16
    for engines in (1, 2, 4):
        with nbpar.Pool(engines) as pool:
            strategy = "single" if engines == 1 else "ddp"
            run = pool.train(nbpar.TrainConfig(model="tiny_gpt", strategy=strategy,
                                               micro_batch=global_batch // engines, steps=40))
            hist = run.per_rank()[0]["history"][5:]
            step = statistics.median(r["step_time_s"] for r in hist)
            comm = statistics.fmean(r["comm_s"] / r["step_time_s"] for r in hist)
            rows.append({"engines": engines, "step_time_s": step,
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in hist),
                         "comm_fraction": comm})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    print(json.dumps({"rows": rows, "cores": os.cpu_count(), "global_batch": global_batch}))


if __name__ == "__main__":
    main()
