"""Measured GPipe bubble vs the theory (p-1)/(m+p-1), p=2, m in {2,4,8}.

    python benchmarks/pipeline_bubble.py --json

The model is sized so compute, not send/recv latency, dominates a stage's
work (tiny models on CPU are all latency and show a much larger bubble).
Prints one JSON object with a row per m: measured, theory, difference in points.
"""
import argparse
import json
import os
import statistics

import nbpar
from nbpar.config import GPTConfig
from nbpar.train.timeline import theory_bubble


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    gpt = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4,
                    seq_len=args.seq_len)
    rows = []
    with nbpar.Pool(2, env={"OMP_NUM_THREADS": "1"}) as pool:
        for m in args.micro_batches:
            cfg = nbpar.TrainConfig(model="tiny_gpt", strategy="pipeline", schedule=args.schedule,
                                    micro_batch=2, grad_accum=m, steps=args.steps, gpt=gpt)
            per_rank = pool.train(cfg).per_rank()
            measured = statistics.median(r["bubble_fraction"] for r in per_rank.values())
            theory = theory_bubble(2, m)
            rows.append({"p": 2, "m": m, "measured": measured, "theory": theory,
                         "diff_points": 100 * (measured - theory)})
    print(json.dumps({"schedule": args.schedule, "rows": rows, "cores": os.cpu_count(),
                      "target_points": 5}))


if __name__ == "__main__":
    main()
