"""Measured per-rank memory of each strategy next to the analytic estimate.

    python benchmarks/memory_vs_estimate.py

Runs a few steps of each strategy on a 2-engine pool and records, per strategy,
the relative error of measured param/grad/optimizer bytes against
`nbpar.estimate_memory(..., backend=...)` (target: within 5%), for the rank
furthest from the estimate. The estimate models each backend: FSDP2's "zero2"
reshards parameters after backward; DeepSpeed partitions gradients from stage 1
and keeps an fp32 master partition even in fp32; tensor parallelism leaves what the
model's plan does not split (embeddings, norms, head, row-parallel biases) whole on
every rank. Pipeline stages differ by what only the first or last keeps; the estimate
is their mean.

Writes results/memory_vs_estimate.json.
"""

from results import Recorder

import nbpar

CASES = [
    ("ddp", "torch"),
    ("zero1", "torch"),
    ("zero2", "torch"),
    ("zero3", "torch"),
    ("ddp", "deepspeed"),
    ("zero1", "deepspeed"),
    ("zero2", "deepspeed"),
    ("zero3", "deepspeed"),
    ("tp", "torch"),
    ("pipeline", "torch"),
]
# 4 engines: dp x tp and dp x pp
HYBRID = [{"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}]


def _worst(run) -> dict:
    """Per category, the relative error of the rank furthest from the estimate."""
    per_rank = run.memory_vs_estimate()
    return {
        k: round(max((c[k]["rel_error"] for c in per_rank.values()), key=abs), 5)
        for k in per_rank[0]
    }


def main():
    rec = Recorder(
        "memory_vs_estimate",
        "measured per-rank bytes vs estimate_memory(backend=)",
        "Per strategy and backend, a 3-step tiny_gpt run (micro-batch 4) on 2 "
        "engines (hybrid: 4); the relative error of the measured param, grad and "
        "optimizer bytes against the estimate, for the rank furthest from it.",
        repeats=1,
        measures=[
            "nbpar/measure",
            "nbpar/parallel",
            "nbpar/train",
            "nbpar/estimate.py",
            "nbpar/ds_partition.py",
            "benchmarks/memory_vs_estimate.py",
        ],
        config={"engines": 2, "steps": 3, "micro_batch": 4, "model": "tiny_gpt"},
        notes="memory is deterministic: one run per case; a figure is the largest "
        "|relative error| over the cases of one backend",
    )
    with nbpar.Pool(2) as pool:
        for strategy, backend in CASES:
            accum = 2 if strategy == "pipeline" else 1
            worst = _worst(
                pool.train(
                    nbpar.TrainConfig(
                        model="tiny_gpt",
                        strategy=strategy,
                        backend=backend,
                        micro_batch=4,
                        grad_accum=accum,
                        steps=3,
                    )
                )
            )
            rec.row(
                strategy=strategy,
                backend=backend,
                rel_error=worst,
                within_5pct=all(abs(v) <= 0.05 for v in worst.values()),
            )
    with nbpar.Pool(4) as pool:
        for degrees in HYBRID:
            worst = _worst(
                pool.train(
                    nbpar.TrainConfig(
                        model="tiny_gpt",
                        strategy="hybrid",
                        micro_batch=4,
                        grad_accum=2 if "pp" in degrees else 1,
                        steps=3,
                        **degrees,
                    )
                )
            )
            rec.row(
                strategy="hybrid " + " x ".join(f"{k} {v}" for k, v in degrees.items()),
                backend="torch",
                rel_error=worst,
                within_5pct=all(abs(v) <= 0.05 for v in worst.values()),
            )
    groups = (
        (
            "torch DDP, ZeRO-1/2/3",
            lambda r: (
                r["backend"] == "torch" and r["strategy"] in ("ddp", "zero1", "zero2", "zero3")
            ),
        ),
        ("DeepSpeed 0-3", lambda r: r["backend"] == "deepspeed"),
        (
            "TP, pipeline, hybrid dp x tp and dp x pp",
            lambda r: r["strategy"] in ("tp", "pipeline") or r["strategy"].startswith("hybrid"),
        ),
    )
    for what, chosen in groups:
        worst = max(abs(v) for r in rec.rows if chosen(r) for v in r["rel_error"].values())
        rec.figure(
            f"measured vs estimate, worst strategy, rank and category: {what}",
            [100 * worst],
            "%",
            "<= 5",
            digits=3,
        )
    rec.save()


if __name__ == "__main__":
    main()
