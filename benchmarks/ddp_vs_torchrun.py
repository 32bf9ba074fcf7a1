"""nbpar DDP vs a plain torchrun script: wall time of the same N steps, in pairs.

    python benchmarks/ddp_vs_torchrun.py --engines 2 --steps 30 --pairs 12

One pair: start a pool and warm it with a 2-step run (engine-side modules imported,
as for any run after the first), time ``pool.train(cfg)`` of N steps from the call
until ``result()`` returns, shut the pool down (no engine left), then time the same
N steps under torchrun (`plain_ddp.py`: from a barrier after its process group is up
to a barrier after the last step). Both windows hold building the model, optimizer
and data loader and the N steps; nbpar's also holds its own per-step work (the stop
check, memory reads, the metered steps, publishing a record) and sending the
config and collecting the results. The pairs alternate which side goes first.

Target: the median over pairs of nbpar's / torchrun's wall time <= 1.05.
Also: the loop window alone (end of the first step to end of the last, wall clock on
the ranks, slowest rank) on both sides. Writes results/ddp_vs_torchrun.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import psutil
from results import Recorder

import nbpar
from nbpar.pool.forkserver import is_engine

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"d_model": 128, "n_layers": 4, "seq_len": 128}  # a step of ~0.1 s on 2 cores


def config(args, steps: int) -> nbpar.TrainConfig:
    return nbpar.TrainConfig(
        model=args.model,
        strategy="ddp",
        micro_batch=args.micro_batch,
        steps=steps,
        gpt=nbpar.GPTConfig(**SIZES),
    )


def engines_alive() -> int:
    """nbpar engine processes running now (anyone's: the baseline must see none of ours)."""
    me = psutil.Process()
    return sum(is_engine(p) for p in me.children(recursive=True) if p.is_running())


def nbpar_side(args) -> dict:
    with nbpar.Pool(args.engines) as pool:
        pool.train(config(args, 2)).result()  # warm-up, not timed
        t = time.perf_counter()
        run = pool.train(config(args, args.steps))
        res = run.result()
        wall = time.perf_counter() - t
        hists = [r["history"] for r in run.per_rank().values()]
    return {
        "wall_s": wall,
        "loop_s": max(h[-1]["time"] - h[0]["time"] for h in hists),
        "step_time_s": res["step_time_s"],
        "last_loss": res["losses"][-1],
    }


def torchrun_side(args) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.engines),
            "--standalone",
            os.path.join(HERE, "plain_ddp.py"),
            "--steps",
            str(args.steps),
            "--micro-batch",
            str(args.micro_batch),
            "--model",
            args.model,
            "--d-model",
            str(SIZES["d_model"]),
            "--layers",
            str(SIZES["n_layers"]),
            "--seq-len",
            str(SIZES["seq_len"]),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads([s for s in out.stdout.splitlines() if s.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--model", default="tiny_gpt")
    p.add_argument("--pairs", type=int, default=12)
    args = p.parse_args()
    if args.pairs < 5:
        p.error("--pairs: at least 5 (a median of fewer pairs says little on a busy machine)")
    rec = Recorder(
        "ddp_vs_torchrun",
        "nbpar DDP vs a plain torchrun script, same steps",
        __doc__.split("\n\n", 2)[2].split("\n\nTarget")[0],
        repeats=args.pairs,
        measures=[
            "nbpar/pool",
            "nbpar/train",
            "nbpar/measure",
            "nbpar/parallel",
            "benchmarks/plain_ddp.py",
            "benchmarks/ddp_vs_torchrun.py",
        ],
        config={
            "engines": args.engines,
            "steps": args.steps,
            "micro_batch": args.micro_batch,
            "model": args.model,
            **SIZES,
        },
    )
    for i in range(args.pairs):
        order = ("nbpar", "torchrun") if i % 2 == 0 else ("torchrun", "nbpar")
        got = {}
        for side in order:
            if side == "nbpar":
                got[side] = nbpar_side(args)
            else:
                got["alive"] = engines_alive()
                got[side] = torchrun_side(args)
        if got["alive"]:
            raise RuntimeError(f"{got['alive']} nbpar engines still ran beside the baseline")
        a, b = got["nbpar"], got["torchrun"]
        rec.row(
            pair=i,
            first=order[0],
            nbpar=a,
            torchrun=b,
            wall_ratio=a["wall_s"] / b["wall_s"],
            loop_ratio=a["loop_s"] / b["loop_s"],
        )
    rows = rec.rows
    rec.figure(
        f"nbpar / torchrun, wall time of {args.steps} steps (end to end)",
        [r["wall_ratio"] for r in rows],
        "x",
        "<= 1.05",
        digits=3,
    )
    rec.figure(
        f"nbpar / torchrun, loop only (steps 2-{args.steps})",
        [r["loop_ratio"] for r in rows],
        "x",
        digits=3,
    )
    rec.figure("nbpar wall time", [r["nbpar"]["wall_s"] for r in rows], "s", digits=3)
    rec.figure("torchrun wall time", [r["torchrun"]["wall_s"] for r in rows], "s", digits=3)
    rec.figure(
        "last loss, |nbpar - torchrun| (the same work)",
        [abs(r["nbpar"]["last_loss"] - r["torchrun"]["last_loss"]) for r in rows],
        "",
        "<= 1e-4",
        digits=2,
    )
    rec.save()


if __name__ == "__main__":
    main()
