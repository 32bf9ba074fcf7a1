"""Scaling on this machine: DDP throughput with 1, 2 and 4 engines, same global batch.

    python benchmarks/scaling.py --repeats 3

Kept honest: the core count is written with the figures. With 2 cores, 4 engines
share them, so throughput cannot grow past 2 engines; the point is to see the
split between compute and communication change, not a speed-up.

Each round starts a fresh pool per engine count (the order reverses between rounds)
and trains tiny_gpt for ``--steps`` steps at a global batch of 16 (1 engine: strategy
single); a run's figures are rank 0's median tokens/s, steps 6 on, and its median share
of a normal step blocked on communication (`comm_blocked_fraction`: exposed and
waiting). Threads per engine are nbpar's default (the host's cores shared out between
its engines: 2, 1 and 1 here), recorded per run and as figures beside the core count; an
engine with 2 threads suffers most when other work keeps the cores busy. A benchmark
starts only on a quiet machine (`results.quiet`).

Writes results/scaling.json.
"""

import argparse
import os
import statistics

from results import Recorder

import nbpar

ENGINES = (1, 2, 4)
GLOBAL_BATCH = 16


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def one(engines: int, steps: int) -> dict:
    with nbpar.Pool(engines) as pool:
        strategy = "single" if engines == 1 else "ddp"
        run = pool.train(
            nbpar.TrainConfig(
                model="tiny_gpt",
                strategy=strategy,
                steps=steps,
                micro_batch=GLOBAL_BATCH // engines,
            )
        )
        hist = run.per_rank()[0]["history"][5:]
        threads = pool.client[pool.engine_id(0)].apply_sync(_threads)
    return {
        "torch_threads": threads,
        "step_time_s": statistics.median(r["step_time_s"] for r in hist),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in hist),
        # blocked on communication (exposed and waiting, `nbpar.measure.blocked`): rank 0's
        "blocked_fraction": run.per_rank()[0]["comm_blocked_fraction"],
        "cores": os.cpu_count(),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rec = Recorder(
        "scaling",
        "tiny GPT DDP, global batch 16, 1 / 2 / 4 engines",
        __doc__.split("\n\n", 3)[3].split("\n\nWrites")[0],
        repeats=args.repeats,
        measures=[
            "nbpar/pool",
            "nbpar/train",
            "nbpar/measure",
            "nbpar/parallel",
            "benchmarks/scaling.py",
        ],
        config={
            "engines": list(ENGINES),
            "global_batch": GLOBAL_BATCH,
            "steps": args.steps,
            "model": "tiny_gpt",
        },
    )
    for i in range(args.repeats):
        for engines in ENGINES if i % 2 == 0 else ENGINES[::-1]:
            rec.row(repeat=i, engines=engines, **one(engines, args.steps))
    for engines in ENGINES:
        mine = [r for r in rec.rows if r["engines"] == engines]
        rec.figure(
            f"tokens/s, {engines} engine{'s' if engines > 1 else ''}",
            [r["tokens_per_s"] / 1000 for r in mine],
            "k",
            digits=3,
        )
    for engines in ENGINES[1:]:
        mine = [r for r in rec.rows if r["engines"] == engines]
        rec.figure(
            f"blocked share of the step, {engines} engines",
            [100 * r["blocked_fraction"] for r in mine],
            "%",
            digits=3,
        )
    for engines in ENGINES:  # what the tokens/s above ran on
        mine = [r for r in rec.rows if r["engines"] == engines]
        rec.figure(f"torch threads per engine, {engines}", [r["torch_threads"] for r in mine])
    rec.figure("cores", [os.cpu_count()])
    rec.save()


if __name__ == "__main__":
    main()
