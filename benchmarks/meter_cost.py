"""What the every-step communication clock costs a step: DDP step time with it vs without.

    python benchmarks/meter_cost.py --steps 40 --pairs 40

One pool of 2 engines, tiny_gpt as in ddp_vs_torchrun.py. Each pair trains the same
DDP run twice, once with the blocked clock on every step (`nbpar.measure.blocked`, what
every run does) and once with it off (`nbpar.train.loop.BLOCKED_CLOCK = False` on every
engine), the pairs alternating which goes first. A run's step time is the median of its
normal steps (the first two and the metered ones left out), the slower rank's; the clock
sits inside that step. The run's blocked share is recorded beside it.

Target: the median over pairs of (with / without) <= 1.05.
Writes results/meter_cost.json.
"""

import argparse
import statistics

from results import Recorder

import nbpar
from nbpar.measure.step_split import normal_step_times

SIZES = {"d_model": 128, "n_layers": 4, "seq_len": 128}  # as ddp_vs_torchrun.py


def _set_clock(on: bool) -> None:
    import nbpar.train.loop

    nbpar.train.loop.BLOCKED_CLOCK = on


def timed(pool, args, steps: int, clock: bool) -> dict:
    """The median normal step of one DDP run (the slower rank's), the clock on or off."""
    pool.run(_set_clock, clock)
    cfg = nbpar.TrainConfig(
        model="tiny_gpt",
        strategy="ddp",
        micro_batch=args.micro_batch,
        steps=steps,
        gpt=nbpar.GPTConfig(**SIZES),
    )
    run = pool.train(cfg)
    res = run.result()
    per_rank = run.per_rank()
    step_s = max(statistics.median(normal_step_times(per_rank[r]["history"])) for r in per_rank)
    return {"step_s": step_s, "blocked": res.get("comm_blocked_fraction")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--pairs", type=int, default=40)
    args = p.parse_args()
    if args.pairs < 5:
        p.error("--pairs: at least 5")
    rec = Recorder(
        "meter_cost",
        "DDP step time, every-step communication clock on vs off",
        __doc__.split("\n\n", 2)[2].split("\n\nTarget")[0],
        repeats=args.pairs,
        measures=["nbpar/measure", "nbpar/train", "nbpar/parallel", "benchmarks/meter_cost.py"],
        config={"engines": 2, "steps": args.steps, "micro_batch": args.micro_batch, **SIZES},
    )
    with nbpar.Pool(2) as pool:
        timed(pool, args, 4, True)  # warm-up both ways, not recorded
        timed(pool, args, 4, False)
        rows = rec.alternated_pairs(
            args.pairs,
            lambda side: timed(pool, args, args.steps, side == "with_clock"),
            ("with_clock", "without"),
            "step_s",
        )
        pool.run(_set_clock, True)
    rec.figure("with / without, median DDP step", [r["ratio"] for r in rows], "x", "<= 1.05", 3)
    rec.figure("step, with the clock", [r["with_clock"]["step_s"] for r in rows], "s", digits=3)
    rec.figure("step, without", [r["without"]["step_s"] for r in rows], "s", digits=3)
    rec.figure(
        "blocked share of a normal step",
        [r["with_clock"]["blocked"] for r in rows],
        digits=3,
    )
    rec.save()


if __name__ == "__main__":
    main()
