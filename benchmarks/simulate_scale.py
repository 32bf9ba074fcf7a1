"""Llama 3 at scale on simulated ranks: time, host memory and the peak per rank.

    python benchmarks/simulate_scale.py [--repeats 3]

`nbpar.simulate` runs ranks on fake tensors under a fake process group with the strategy
code of a real run (stage cut between decoder layers, transformers' tensor-parallel plan
over DTensor, gradient all-reduce over dp). Two layouts of transformers' LlamaForCausalLM
(random weights on fake tensors, nothing downloaded):

- Llama 3 70B (`nbpar.model.hf.LLAMA_3_70B`, 70.6B parameters) on 1,024 ranks, dp 32 x
  tp 8 x pp 4, 512 tokens, 4 micro-batches. Targets: under 2 minutes, under 8 GiB of
  host memory.
- Llama 3 405B (`LLAMA_3_405B`: 126 layers, hidden 16384, 128 heads, 8 key/value heads,
  FFN 53248, vocabulary 128256) on 16,384 ranks, dp 128 x tp 8 x pp 16, 8,192 tokens, 16
  micro-batches, with sequence parallelism and full activation checkpointing. Targets:
  under 60 s, and every rank's peak under 80 GB.
- Llama 3 8B at 131,072 tokens on 8 ranks: ring attention over cp 8, FSDP2 over the 8,
  full activation checkpointing (long context; the peak is the answer, no target but 80 GB).
- A Mixtral-8x7B-shaped transformers Mixtral (46.7B parameters, 8 experts, 2 a token)
  on 32 ranks, ep 8 x dp 8 x pp 4, 4 micro-batches of 4,096 tokens, full activation
  checkpointing, the routing assumed uniform (`nbpar.model.moe.uniform_routing`).

A pipeline's stages that hold the same module are simulated once and each stage's step
is composed from segments of two micro-batches (`nbpar.simulate.segments`); the
simulated ranks run in as many processes as there are cores, so the time judged is the
wall time of the call; run it on an otherwise idle machine (the load is recorded beside
it). CPU time (this process and its children) is recorded too. Host memory: this
process's peak RSS plus each child's (an upper bound: the children's largest peak, times
their number).

Writes results/simulate_scale.json.
"""

import argparse
import os
import resource
import time

from results import Recorder

import nbpar

CPU_FIELDS = ("user", "system", "children_user", "children_system")
LLAMA_3_405B = {
    "vocab_size": 128256,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
}
LLAMA_3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
}
MIXTRAL_8X7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
}
FIGURES = (
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "activation_bytes",
    "peak_bytes",
    "comm_bytes",
)


def layouts() -> dict:
    """name -> (TrainConfig, world size, config recorded)."""
    from nbpar.model.hf import LLAMA_3_70B

    common = dict(model="hf:llama", strategy="hybrid", micro_batch=1, precision="bf16")
    the_70b = dict(dp=32, tp=8, pp=4, grad_accum=4, seq_len=512)
    the_405b = dict(dp=128, tp=8, pp=16, grad_accum=16, seq_len=8192)
    checkpointed = dict(sequence_parallel=True, activation_checkpointing="full")
    the_8b = dict(dp=1, cp=8, grad_accum=1, seq_len=131072)
    long = dict(attention="ring", fsdp_reshard=True, activation_checkpointing="full")
    mixtral = dict(dp=8, ep=8, pp=4, grad_accum=4, seq_len=4096)
    full = dict(activation_checkpointing="full")
    out = {}
    for name, model, shape, sizes, world, extra in (
        ("70B", "hf:llama", LLAMA_3_70B, the_70b, 1024, {}),
        ("405B", "hf:llama", LLAMA_3_405B, the_405b, 16384, checkpointed),
        ("8B at 128K", "hf:llama", LLAMA_3_8B, the_8b, 8, long),
        ("Mixtral 8x7B", "hf:mixtral", MIXTRAL_8X7B, mixtral, 32, full),
    ):
        sizes = dict(sizes)
        gpt = nbpar.GPTConfig(seq_len=sizes.pop("seq_len"))
        cfg = nbpar.TrainConfig(
            **{**common, "model": model}, model_config=shape, gpt=gpt, **sizes, **extra
        )
        out[name] = cfg, world, {**shape, **sizes, "seq_len": gpt.seq_len, **extra}
    return out


def measure(cfg, world: int, repeats: int):
    """Wall and CPU seconds and peak RSS (GiB) per repeat, and the last simulation."""
    walls, cpus, rss = [], [], []
    for _ in range(repeats):
        before = os.times()
        start = time.perf_counter()
        sim = nbpar.simulate(cfg, world)
        walls.append(time.perf_counter() - start)
        after = os.times()
        cpus.append(sum(getattr(after, k) - getattr(before, k) for k in CPU_FIELDS))
        children = min(os.cpu_count() or 1, len(sim["ranks"]))
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib += children * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        rss.append(kib / 2**20)
    return walls, cpus, rss, sim


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cases = layouts()
    rec = Recorder(
        "simulate_scale",
        "Llama 3 70B on 1,024 and 405B on 16,384 simulated ranks; 8B at 128K tokens on "
        "cp 8 and a Mixtral-8x7B shape on ep 8",
        "One nbpar.simulate call per repeat and layout: one rank per group of pipeline "
        "stages that hold the same module (4 of 4 stages for 70B, 4 of 16 for 405B), in "
        "one process per core, each built, cut and tp-split on fake tensors, warmed up (an "
        "optimizer step on zero gradients creates the Adam state) and run for a 1F1B step "
        "metered as segments of 2 micro-batches, composed in each stage's order: 70B dp 32 "
        "x tp 8 x pp 4, 4 micro-batches of 1 x 512 tokens; 405B dp 128 x tp 8 x pp 16, 16 "
        "micro-batches of 1 x 8,192 tokens, sequence parallel, full activation "
        "checkpointing; 8B: one rank for all 8 (cp 8, ring, FSDP2 over the 8, full "
        "activation checkpointing, 1 x 131,072 tokens, in this process); Mixtral 8x7B: ep 8 "
        "x dp 8 x pp 4, 4 micro-batches of 1 x 4,096 tokens, full activation checkpointing, "
        "routing assumed uniform; wall "
        "and CPU time of the call, the processes' peak RSS, every rank's simulated peak.",
        repeats=args.repeats,
        measures=[
            "nbpar/simulate",
            "nbpar/estimate.py",
            "nbpar/measure",
            "nbpar/parallel/tensor.py",
            "nbpar/parallel/tensor_ends.py",
            "nbpar/parallel/expert.py",
            "nbpar/parallel/cp.py",
            "nbpar/parallel/context.py",
            "nbpar/parallel/attention_block.py",
            "nbpar/model/moe.py",
            "benchmarks/simulate_scale.py",
        ],
        config={name: {"world_size": world, **conf} for name, (_, world, conf) in cases.items()},
        notes="the memory figures are deterministic (the rows); the times vary with the load",
    )
    targets = {  # wall s, host memory GiB, a rank's peak GB
        "70B": ("1,024", "< 120", "< 8", None),
        "405B": ("16,384", "< 60", None, "< 80"),
        "8B at 128K": ("8", None, None, "< 80"),
        "Mixtral 8x7B": ("32", None, None, "< 80"),
    }
    for name, (cfg, world, _) in cases.items():
        ranks, wall, host, peak = targets[name]
        walls, cpus, rss, sim = measure(cfg, world, args.repeats)
        where = f"simulate {name} on {ranks} ranks"
        rec.figure(f"{where} (wall time)", walls, "s", target=wall, digits=3)
        rec.figure(f"{where} (CPU time, all processes)", cpus, "s", digits=3)
        rec.figure(f"{name}: host memory (peak RSS, all processes)", rss, "GiB", target=host)
        largest = max(r["peak_bytes"] for r in sim["ranks"]) / 1e9
        rec.figure(f"{name}: largest simulated peak of a rank", [largest], "GB", target=peak)
        for r in sim["ranks"]:
            stands_for = f"{r['stands_for'][0]}-{r['stands_for'][-1]}"
            figures = {k: r[k] for k in FIGURES}
            rec.row(layout=name, rank=r["rank"], stands_for=stands_for, **figures)
        print(sim.table())
        print(f"{name}: wall {walls} s, CPU {cpus} s, peak RSS {max(rss):.2f} GiB")
    rec.save()


if __name__ == "__main__":
    main()
