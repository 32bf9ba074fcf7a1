"""Peak activation memory of pipeline stage 0: 1F1B vs GPipe, p=2, m=8.

    python benchmarks/pipeline_memory.py

GPipe (Huang et al. 2019) keeps all m micro-batches' saved activations on the
first stage until the backwards start; 1F1B (PipeDream-Flush, Narayanan et al.
2019) keeps at most p. Counted by `nbpar.parallel.saved_activations` (bytes
autograd saves for backward, live until that micro-batch's backward).
Prints one JSON object: stage-0 peak bytes per schedule and their ratio.
"""
import argparse
import json

import nbpar
from nbpar.config import GPTConfig


def stage0_peak(pool, schedule: str, args) -> int:
    """Rank 0's (first stage's) activation peak in the last step of one run."""
    gpt = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4,
                    seq_len=args.seq_len)
    cfg = nbpar.TrainConfig(model="tiny_gpt", strategy="pipeline", schedule=schedule,
                            micro_batch=args.micro_batch, grad_accum=args.m,
                            steps=args.steps, gpt=gpt)
    return pool.train(cfg).per_rank()[0]["history"][-1]["activation_peak_bytes"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8, help="micro-batches per step (grad_accum)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    with nbpar.Pool(2) as pool:
        gpipe = stage0_peak(pool, "gpipe", args)
        f1b = stage0_peak(pool, "1f1b", args)
    print(json.dumps({"gpipe_stage0_bytes": gpipe, "1f1b_stage0_bytes": f1b,
                      "ratio": f1b / gpipe, "p": 2, "m": args.m}))


if __name__ == "__main__":
    main()
