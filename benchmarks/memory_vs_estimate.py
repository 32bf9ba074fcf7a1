"""Measured per-rank memory of each strategy next to the analytic estimate.

    python benchmarks/memory_vs_estimate.py

Runs a few steps of each strategy on a 2-engine pool and records, per strategy,
the relative error of measured param/grad/optimizer bytes against
`nbpar.estimate_memory(..., backend=...)` (target: within 5%), for the rank
furthest from the estimate. The estimate models each backend: FSDP2's "zero2"
reshards parameters after backward; DeepSpeed partitions gradients from stage 1
and keeps an fp32 master partition even in fp32.

Writes results/memory_vs_estimate.json.
"""
from results import Recorder

import nbpar

CASES = [("ddp", "torch"), ("zero1", "torch"), ("zero2", "torch"), ("zero3", "torch"),
         ("ddp", "deepspeed"), ("zero1", "deepspeed"), ("zero2", "deepspeed"),
         ("zero3", "deepspeed")]


def main():
    rec = Recorder("memory_vs_estimate", "measured per-rank bytes vs estimate_memory(backend=)",
                   "Per strategy and backend, a 3-step tiny_gpt run (micro-batch 4) on 2 "
                   "engines; the relative error of the measured param, grad and optimizer "
                   "bytes against the estimate, for the rank furthest from it.",
                   repeats=1, config={"engines": 2, "steps": 3, "micro_batch": 4,
                                      "model": "tiny_gpt"},
                   notes="memory is deterministic: one run per case; a figure is the largest "
                         "|relative error| over the cases of one backend")
    with nbpar.Pool(2) as pool:
        for strategy, backend in CASES:
            run = pool.train(nbpar.TrainConfig(model="tiny_gpt", strategy=strategy,
                                               backend=backend, micro_batch=4, steps=3))
            per_rank = run.memory_vs_estimate()
            worst = {k: max((c[k]["rel_error"] for c in per_rank.values()), key=abs)
                     for k in per_rank[0]}  # the rank furthest from the estimate
            rec.row(strategy=strategy, backend=backend,
                    rel_error={k: round(v, 5) for k, v in worst.items()},
                    within_5pct=all(abs(v) <= 0.05 for v in worst.values()))
    for backend, what in (("torch", "torch DDP, ZeRO-1/2/3"), ("deepspeed", "DeepSpeed 0-3")):
        worst = max(abs(v) for r in rec.rows if r["backend"] == backend
                    for v in r["rel_error"].values())
        rec.figure(f"measured vs estimate, worst strategy, rank and category: {what}",
                   [100 * worst], "%", "<= 5", digits=3)
    rec.save()


if __name__ == "__main__":
    main()
