"""Peak activation memory of pipeline stage 0: 1F1B vs GPipe, p=2, m=8.

    python benchmarks/pipeline_memory.py

GPipe (Huang et al. 2019) keeps all m micro-batches' saved activations on the
first stage until the backwards start; 1F1B (PipeDream-Flush, Narayanan et al.
2021) keeps at most p. Counted by `nbpar.parallel.saved_activations` (bytes
autograd saves for backward, live until that micro-batch's backward).
Each repeat runs both schedules on one 2-engine pool (order alternated).

Writes results/pipeline_memory.json.
"""

import argparse

from results import Recorder

import nbpar
from nbpar.config import GPTConfig


def stage0_peak(pool, schedule: str, args) -> int:
    """Rank 0's (first stage's) activation peak in the last step of one run."""
    gpt = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len)
    cfg = nbpar.TrainConfig(
        model="tiny_gpt",
        strategy="pipeline",
        schedule=schedule,
        micro_batch=args.micro_batch,
        grad_accum=args.m,
        steps=args.steps,
        gpt=gpt,
    )
    return pool.train(cfg).per_rank()[0]["history"][-1]["activation_peak_bytes"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8, help="micro-batches per step (grad_accum)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    rec = Recorder(
        "pipeline_memory",
        f"stage-0 activation memory, 1F1B vs GPipe, p=2, m={args.m}",
        __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0],
        repeats=args.repeats,
        measures=[
            "nbpar/parallel",
            "nbpar/measure",
            "nbpar/train",
            "benchmarks/pipeline_memory.py",
        ],
        config={
            "engines": 2,
            "m": args.m,
            "micro_batch": args.micro_batch,
            "d_model": args.d_model,
            "layers": args.layers,
            "seq_len": args.seq_len,
            "steps": args.steps,
        },
        notes="activation bytes are deterministic; repeated to show it",
    )
    with nbpar.Pool(2) as pool:
        for i in range(args.repeats):
            order = ("gpipe", "1f1b") if i % 2 == 0 else ("1f1b", "gpipe")
            got = {schedule: stage0_peak(pool, schedule, args) for schedule in order}
            rec.row(repeat=i, gpipe_stage0_bytes=got["gpipe"], f1b_stage0_bytes=got["1f1b"])
    rows = rec.rows
    rec.figure(
        f"1F1B / GPipe (p/m = {2 / args.m:.2f})",
        [r["f1b_stage0_bytes"] / r["gpipe_stage0_bytes"] for r in rows],
        "x",
        "< 1",
        3,
    )
    rec.figure("GPipe, stage 0", [r["gpipe_stage0_bytes"] / 1e6 for r in rows], "MB", digits=3)
    rec.figure("1F1B, stage 0", [r["f1b_stage0_bytes"] / 1e6 for r in rows], "MB", digits=3)
    rec.save()


if __name__ == "__main__":
    main()
