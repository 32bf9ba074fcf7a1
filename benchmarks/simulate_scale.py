"""Llama 3 70B on 1,024 simulated ranks (dp 32 x tp 8 x pp 4): time and host memory.

    python benchmarks/simulate_scale.py [--repeats 3]

`nbpar.simulate` runs one rank per pipeline stage on fake tensors under a fake process
group of 1,024 ranks, with the strategy code of a real run (stage cut between decoder
layers, transformers' tensor-parallel plan over DTensor, gradient all-reduce over dp).
The model is transformers' LlamaForCausalLM with Llama 3 70B's shape
(`nbpar.model.hf.LLAMA_3_70B`, 70.6B parameters, random weights on fake tensors).
Targets: under 2 minutes and under 8 GiB of host memory on 2 cores. The stages are
simulated in as many processes as there are cores (at most one per stage), so the time
judged is the wall
time of the call; run it on an otherwise idle machine (the load is recorded beside it).
CPU time (this process and its children) is recorded too. Host memory: this process's
peak RSS plus each child's (an upper bound: the children's largest peak, times their
number).

Writes results/simulate_scale.json.
"""

import argparse
import os
import resource
import time

from results import Recorder

import nbpar

CPU_FIELDS = ("user", "system", "children_user", "children_system")
SEQ_LEN = 512


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from nbpar.model.hf import LLAMA_3_70B

    cfg = nbpar.TrainConfig(
        model="hf:llama",
        model_config=LLAMA_3_70B,
        strategy="hybrid",
        dp=32,
        tp=8,
        pp=4,
        micro_batch=1,
        grad_accum=4,
        precision="bf16",
        gpt=nbpar.GPTConfig(seq_len=SEQ_LEN),
    )
    rec = Recorder(
        "simulate_scale",
        "Llama 3 70B on 1,024 simulated ranks (dp 32 x tp 8 x pp 4)",
        "One nbpar.simulate call per repeat: one rank per pipeline stage (4), in one "
        "process per core, each built, cut and tp-split on fake tensors, warmed up (an "
        "optimizer step on zero gradients creates the Adam state) and run for one "
        "measured 1F1B step of 4 micro-batches (1 x 512 tokens); wall and CPU time of "
        "the call and the processes' peak RSS.",
        repeats=args.repeats,
        measures=[
            "nbpar/simulate",
            "nbpar/estimate.py",
            "nbpar/measure",
            "benchmarks/simulate_scale.py",
        ],
        config={
            "world_size": 1024,
            "model": "hf:llama",
            **LLAMA_3_70B,
            "seq_len": SEQ_LEN,
            "micro_batch": 1,
            "grad_accum": 4,
            "precision": "bf16",
        },
        notes="the memory figures are deterministic (the rows); the times vary with the load",
    )
    walls, cpus, rss = [], [], []
    for _ in range(args.repeats):
        before = os.times()
        start = time.perf_counter()
        sim = nbpar.simulate(cfg, 1024)
        walls.append(time.perf_counter() - start)
        after = os.times()
        cpus.append(sum(getattr(after, k) - getattr(before, k) for k in CPU_FIELDS))
        children = min(os.cpu_count() or 1, len(sim["ranks"]))
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib += children * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        rss.append(kib / 2**20)
    rec.figure("simulate 70B on 1,024 ranks (wall time)", walls, "s", target="< 120", digits=3)
    rec.figure("simulate 70B on 1,024 ranks (CPU time, all processes)", cpus, "s", digits=3)
    rec.figure("host memory (peak RSS, all processes)", rss, "GiB", target="< 8", digits=3)
    for r in sim["ranks"]:
        rec.row(
            rank=r["rank"],
            stands_for=f"{r['stands_for'][0]}-{r['stands_for'][-1]}",
            **{
                k: r[k]
                for k in (
                    "param_bytes",
                    "grad_bytes",
                    "optim_bytes",
                    "activation_bytes",
                    "peak_bytes",
                    "comm_bytes",
                )
            },
        )
    print(sim.table())
    print(f"wall {walls} s, CPU {cpus} s, peak RSS {max(rss):.2f} GiB")
    rec.save()


if __name__ == "__main__":
    main()
