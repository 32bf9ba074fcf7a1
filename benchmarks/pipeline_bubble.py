"""Measured GPipe bubble vs the theory (p-1)/(m+p-1), p=2, m in {2,4,8}.

    python benchmarks/pipeline_bubble.py --repeats 3

The model (d_model 512, 8 layers, 128 tokens) is sized so compute, not send/recv
latency and Python between ops, dominates a stage's work (tiny models on CPU are all
latency and show a much larger bubble; at d_model 256 and 4 layers the worst m was
7.7 points off).
Each round runs every m once (2 engines, micro-batch 2; a run's figure is the median
of both ranks' measured bubble, of the run's typical normal step with stalls left out,
`nbpar.measure.timeline.StepTimelines`, beside it with them); the rounds alternate the
order of m. The schedule's
own bubble replays the step's boxes with their measured lengths and no gaps
(`nbpar.measure.timeline.schedule_bubble`): it is what (p-1)/(m+p-1) predicts plus what
unequal stages add, and the measured bubble minus it is what send/recv and the work
between boxes add, reported per m.

Writes results/pipeline_bubble.json.
"""

import argparse
import statistics

from results import Recorder

import nbpar
from nbpar.config import GPTConfig
from nbpar.measure.timeline import theory_bubble


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    gpt = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len)
    rec = Recorder(
        "pipeline_bubble",
        f"measured {args.schedule} bubble vs (p-1)/(m+p-1), p=2",
        __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0],
        repeats=args.repeats,
        measures=[
            "nbpar/parallel",
            "nbpar/measure",
            "nbpar/train",
            "benchmarks/pipeline_bubble.py",
        ],
        config={
            "engines": 2,
            "schedule": args.schedule,
            "micro_batch": 2,
            "steps": args.steps,
            "d_model": args.d_model,
            "layers": args.layers,
            "seq_len": args.seq_len,
        },
    )
    with nbpar.Pool(2, env={"OMP_NUM_THREADS": "1"}) as pool:
        for i in range(args.repeats):  # rounds; the order of m alternates between them
            for m in args.micro_batches if i % 2 == 0 else args.micro_batches[::-1]:
                cfg = nbpar.TrainConfig(
                    model="tiny_gpt",
                    strategy="pipeline",
                    schedule=args.schedule,
                    micro_batch=2,
                    grad_accum=m,
                    steps=args.steps,
                    gpt=gpt,
                )
                per_rank = pool.train(cfg).per_rank()
                measured = statistics.median(r["bubble_fraction"] for r in per_rank.values())
                forced = statistics.median(r["schedule_bubble_fraction"] for r in per_rank.values())
                stalled = [r["bubble_fraction_with_stalls"] for r in per_rank.values()]
                rec.row(
                    repeat=i,
                    p=2,
                    m=m,
                    measured=measured,
                    forced=forced,
                    with_stalls=statistics.median(stalled),
                    stalls=sum(r["bubble_step"]["stalls"] for r in per_rank.values()),
                    typical=all(r["bubble_step"]["typical"] for r in per_rank.values()),
                    theory=theory_bubble(2, m),
                    diff_points=100 * (measured - theory_bubble(2, m)),
                    forced_diff_points=100 * (forced - theory_bubble(2, m)),
                    gap_points=100 * (measured - forced),
                )
    for m in args.micro_batches:
        rec.figure(
            f"bubble with stalls, m={m}",
            [r["with_stalls"] for r in rec.rows if r["m"] == m],
            "",
            digits=3,
        )
        rec.figure(
            f"bubble, m={m} (theory {theory_bubble(2, m):.3f})",
            [r["measured"] for r in rec.rows if r["m"] == m],
            "",
            digits=3,
        )
        rec.figure(
            f"of which send/recv and work between boxes, m={m}",
            [r["gap_points"] for r in rec.rows if r["m"] == m],
            "points",
            digits=3,
        )
    rec.figure(
        "|schedule's bubble - theory| in points, worst m",
        [
            max(abs(r["forced_diff_points"]) for r in rec.rows if r["repeat"] == i)
            for i in range(args.repeats)
        ],
        "points",
        digits=3,
    )
    rec.figure(
        "|measured - theory| in points, worst m",
        [
            max(abs(r["diff_points"]) for r in rec.rows if r["repeat"] == i)
            for i in range(args.repeats)
        ],
        "points",
        "<= 5",
        digits=3,
    )
    rec.save()


if __name__ == "__main__":
    main()
