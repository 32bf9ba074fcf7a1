"""A ~70B model on 1,024 simulated ranks (dp 32 x tp 8 x pp 4): time and host memory.

    python benchmarks/simulate_scale.py

`nbpar.simulate` runs one rank per pipeline stage on fake tensors under a fake process
group of 1,024 ranks, with the strategy code of a real run (stage cut, Megatron tp over
DTensor, gradient all-reduce over dp). The model is the built-in GPT (tiny_gpt with
d_model 8192, 86 layers, 64 heads, ffn 4 x d, vocab 32000: 69.8B parameters), standing in
for a Llama-family 70B until Hugging Face models can be simulated. Targets: under 2
minutes and under 8 GiB of host memory on 2 cores. The stages are simulated in as many
processes as there are cores (at most one per stage), so the time judged is the wall
time of the call; run it on an otherwise idle machine (the load is recorded beside it).
CPU time (this process and its children) is recorded too. Host memory: this process's
peak RSS plus each child's (an upper bound: the children's largest peak, times their
number).

Writes results/simulate_scale.json.
"""

import os
import resource
import time

from results import Recorder

import nbpar

CPU_FIELDS = ("user", "system", "children_user", "children_system")
GPT = dict(d_model=8192, n_layers=86, n_heads=64, ffn_mult=4, vocab_size=32000, seq_len=512)


def main():
    cfg = nbpar.TrainConfig(
        strategy="hybrid",
        dp=32,
        tp=8,
        pp=4,
        micro_batch=1,
        grad_accum=4,
        precision="bf16",
        gpt=nbpar.GPTConfig(**GPT),
    )
    rec = Recorder(
        "simulate_scale",
        "70B GPT on 1,024 simulated ranks (dp 32 x tp 8 x pp 4)",
        "One nbpar.simulate call: one rank per pipeline stage (4), in one process per "
        "core, each built, "
        "cut and tp-split on fake tensors, warmed up (an optimizer step on zero "
        "gradients creates the Adam state) and run for one measured 1F1B step "
        "of 4 micro-batches (1 x 512 tokens); CPU and wall time of the call and "
        "the processes' peak RSS.",
        repeats=1,
        config={"world_size": 1024, **GPT, "micro_batch": 1, "grad_accum": 4, "precision": "bf16"},
        notes="the built-in GPT stands in for Llama 70B (same width and depth "
        "class); one run: a simulation is deterministic, its time is "
        "dominated by Python per op",
    )
    before = os.times()
    start = time.perf_counter()
    sim = nbpar.simulate(cfg, 1024)
    seconds = time.perf_counter() - start
    after = os.times()
    cpu = sum(getattr(after, k) - getattr(before, k) for k in CPU_FIELDS)
    children = min(os.cpu_count() or 1, len(sim["ranks"]))
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kib += children * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rss_gib = kib / 2**20
    rec.figure("simulate 70B on 1,024 ranks (wall time)", [seconds], "s", target="< 120", digits=3)
    rec.figure("simulate 70B on 1,024 ranks (CPU time, all processes)", [cpu], "s", digits=3)
    rec.figure("host memory (peak RSS, all processes)", [rss_gib], "GiB", target="< 8", digits=3)
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
    print(f"{cpu:.1f} s CPU, {seconds:.1f} s wall, peak RSS {rss_gib:.2f} GiB")
    rec.save()


if __name__ == "__main__":
    main()
