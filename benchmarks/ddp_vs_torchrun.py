"""nbpar DDP (live metrics on) vs a plain torchrun script, side by side in one run.

    python benchmarks/ddp_vs_torchrun.py --engines 2 --steps 60 --rounds 2

Target: nbpar's median step time <= 1.05x the plain script's. Runs alternate
(A B A B) so drift of a noisy machine hits both. Prints one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import nbpar

HERE = os.path.dirname(os.path.abspath(__file__))


SIZES = {"d_model": 128, "n_layers": 4, "seq_len": 128}  # a step of ~0.1 s on 2 cores


def plain(engines: int, steps: int, micro: int, model: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(engines),
         "--standalone",
         os.path.join(HERE, "plain_ddp.py"), "--steps", str(steps),
         "--micro-batch", str(micro), "--model", model, "--d-model", str(SIZES["d_model"]),
         "--layers", str(SIZES["n_layers"]), "--seq-len", str(SIZES["seq_len"])],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = [s for s in out.stdout.splitlines() if s.startswith("{")][-1]
    return json.loads(line)["step_time_s"]


def ours(pool, steps: int, micro: int, model: str) -> float:
    run = pool.train(nbpar.TrainConfig(model=model, strategy="ddp", micro_batch=micro,
                                       steps=steps, gpt=nbpar.GPTConfig(**SIZES)))
    times = [r["step_time_s"] for r in run.per_rank()[0]["history"]][5:]
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--model", default="tiny_gpt")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    a, b = [], []
    with nbpar.Pool(args.engines, env={"OMP_NUM_THREADS": "1"}) as pool:
        for _ in range(args.rounds):
            a.append(ours(pool, args.steps, args.micro_batch, args.model))
            b.append(plain(args.engines, args.steps, args.micro_batch, args.model))
    nb, base = statistics.median(a), statistics.median(b)
    print(json.dumps({"nbpar_step_s": nb, "torchrun_step_s": base, "ratio": nb / base,
                      "target": 1.05, "engines": args.engines, "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
