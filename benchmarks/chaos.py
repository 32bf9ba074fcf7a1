"""Chaos: 20 SIGKILLs of a random engine at a random step of a checkpointed run.

    python benchmarks/chaos.py --kills 20

One `Pool(2, restart="auto")` trains tiny_gpt with DDP, a checkpoint every few steps.
`nbpar.bench.engine_kills.chaos_train` kills a random engine at a random step ahead (within
two checkpoints of the last one), the pool restarts itself (spare engines kept warm),
and the run resumes from its latest checkpoint, until the run has been killed
``--kills`` times and then finishes. The loss curve stitched from the runs (each step's
loss from the last run that computed it) is compared with an uninterrupted run on the
same pool. Per kill: seconds until the pool was back (recovery) and until the resumed
run was again at the step of the kill (lost: restart, resume and the steps done again).

Target: every kill recovered and the curve equal to the uninterrupted run's (max |diff|
<= 1e-6). Writes results/chaos.json.
"""

import argparse
import tempfile

from results import Recorder

import nbpar
from nbpar.bench.engine_kills import chaos_train
from nbpar.config import TrainConfig


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    base = dict(model="tiny_gpt", seed=1, strategy="ddp", micro_batch=4, steps=args.steps)
    rec = Recorder(
        "chaos",
        "20 random engine kills during a checkpointed run",
        __doc__.split("\n\n", 2)[2].split("\n\nTarget")[0],
        repeats=1,
        measures=["nbpar/pool", "nbpar/bench", "nbpar/train", "benchmarks/chaos.py"],
        config={
            "engines": 2,
            **base,
            "checkpoint_every": args.every,
            "kills": args.kills,
            "seed": args.seed,
        },
    )
    with nbpar.Pool(2, restart="auto", replace=False) as pool, tempfile.TemporaryDirectory() as ck:
        reference = pool.train(TrainConfig(**base)).result()["losses"]
        cfg = TrainConfig(**base, checkpoint_dir=ck, checkpoint_every=args.every)
        out = chaos_train(pool, cfg, kills=args.kills, seed=args.seed)
    kills = out["kills"]
    for i, k in enumerate(kills):
        rec.row(
            kill=i,
            rank=k["rank"],
            step=k["step"],
            resumed_from=k["resumed_from"],
            recovery_s=k["recovery_s"],
            lost_s=k["lost_s"],
        )
    worst = max(abs(a - b) for a, b in zip(out["losses"], reference))
    rec.figure("kills recovered", [len(kills)], "", f">= {args.kills}", 3)
    rec.figure("stitched loss curve vs uninterrupted, max |diff|", [worst], "", "<= 1e-06", 3)
    rec.figure(
        "seconds from a kill to the pool back", [k["recovery_s"] for k in kills], "s", digits=3
    )
    rec.figure(
        "seconds lost per kill (back at the killed step)",
        [k["lost_s"] for k in kills],
        "s",
        digits=3,
    )
    rec.figure(
        "steps done again per kill", [k["step"] - k["resumed_from"] for k in kills], "", digits=3
    )
    rec.save()


if __name__ == "__main__":
    main()
