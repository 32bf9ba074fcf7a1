"""Measured per-rank memory of each strategy next to the analytic estimate.

    python benchmarks/memory_vs_estimate.py

Runs a few steps of each strategy on a 2-engine pool and prints, per strategy,
the relative error of measured param/grad/optimizer bytes against
`nbpar.estimate_memory(..., backend=...)` (target: within 5%), for the rank
furthest from the estimate. The estimate models each backend: FSDP2's "zero2"
reshards parameters after backward; DeepSpeed partitions gradients from stage 1
and keeps an fp32 master partition even in fp32.
"""
import json
import os

import nbpar

CASES = [("ddp", "torch"), ("zero1", "torch"), ("zero2", "torch"), ("zero3", "torch"),
         ("ddp", "deepspeed"), ("zero1", "deepspeed"), ("zero2", "deepspeed"),
         ("zero3", "deepspeed")]


def main():
    rows = []
    with nbpar.Pool(2) as pool:
        for strategy, backend in CASES:
            run = pool.train(nbpar.TrainConfig(model="tiny_gpt", strategy=strategy,
                                               backend=backend, micro_batch=4, steps=3))
            per_rank = run.memory_vs_estimate()
            worst = {k: max((c[k]["rel_error"] for c in per_rank.values()), key=abs)
                     for k in per_rank[0]}  # the rank furthest from the estimate
            rows.append({"strategy": strategy, "backend": backend,
                         **{k: round(v, 4) for k, v in worst.items()},
                         "within_5pct": all(abs(v) <= 0.05 for v in worst.values())})
    print(json.dumps({"rows": rows, "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
