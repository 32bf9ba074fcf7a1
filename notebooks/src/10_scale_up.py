# ---
# jupyter:
#   jupytext:
#     formats: ipynb,src//py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · Scale up: simulate the cluster you don't have
#
# **Time:** about 30 minutes, 5 of them exercises ([the workshop day](../docs/workshop.md)).
#
# The questions worth asking are about 64 GPUs and 70B models; the machine at hand has a
# few CPU cores. `nbpar.simulate` answers them with the real strategy code instead of a
# formula: it builds the model on *fake tensors* (shapes and dtypes, no memory), joins a
# *fake process group* of any world size (collectives return at once, moving nothing),
# applies FSDP2, tensor parallelism and the pipeline cut exactly as a training run does,
# runs a warm-up and a measured step, and meters the step with the same tools
# `pool.train` uses. One rank of each role is simulated: every rank of a data- or
# tensor-parallel group holds an equal share (except ZeRO-1's optimizer state, below),
# each pipeline stage differs.
#
# Sizes print in decimal GB, as the papers' tables do.
#
# **Goal:** answer questions about hardware you do not have with the real strategy code:
# does a 13B model fit, what does fit beside it, the ZeRO paper's table by simulation,
# and a 70B layout on 1,024 ranks.

# %%
import nbpar
from nbpar.estimate import GB, estimate_memory, zero_table


def gb(n):
    return f"{n / GB:6.1f} GB"


def states(rank):
    return rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]


# %% [markdown]
# ## A 13B model does not fit on one GPU
#
# The built-in GPT with 16 blocks of width 8192 has 12.9B parameters. Simulated on one
# device in fp32 with Adam, beside the estimate's 16 bytes a parameter (4 weight, 4
# gradient, 8 for Adam's two moments) for the same count, and the table's 13B
# (52 + 52 + 104 = 208 GB):

# %%
gpt13 = nbpar.GPTConfig(d_model=8192, n_layers=16, n_heads=64, seq_len=16)
one = nbpar.simulate(nbpar.TrainConfig(strategy="single", gpt=gpt13, micro_batch=1), 1,
                     device_memory_gb=80)
psi13 = one["ranks"][0]["param_bytes"] / 4
est = estimate_memory(psi13, 1, "single", precision="fp32").per_rank_bytes
table = estimate_memory(13e9, 1, "single", precision="fp32").per_rank_bytes
r = one["ranks"][0]
print(f"parameters: {psi13 / 1e9:.1f}B")
for key, est_key in (("param_bytes", "params"), ("grad_bytes", "grads"),
                     ("optim_bytes", "optim")):
    print(f"{key:12s} simulated {gb(r[key])}   estimate {gb(est[est_key])}   "
          f"13B table {gb(table[est_key])}")
print(f"{'states':12s} simulated {gb(states(r))}   estimate {gb(est['total'])}   "
      f"13B table {gb(table['total'])}")
print(f"fits on an 80 GB GPU: {one['fits']}, short by {gb(-one['margin_bytes'])}")

# %% [markdown]
# What does fit beside it: the same model on 8 GPUs with ZeRO-3 (FSDP2) and mixed
# precision, each rank holding an eighth of the 16 bytes a parameter:

# %%
eight = nbpar.simulate(nbpar.TrainConfig(strategy="zero3", gpt=gpt13, micro_batch=1,
                                         precision="mixed"), 8, device_memory_gb=80)
r = eight["ranks"][0]
print(f"zero3 on 8 ranks: states {gb(states(r))} per rank, fits: {eight['fits']}, "
      f"sends {gb(r['comm_bytes'])} per step ({', '.join(sorted(r['comm_bytes_by_op']))})")

# %% [markdown]
# `nbpar.FitPicker` asks the same question for every strategy at once: choose a model,
# the number of devices and their memory, press *Simulate*, and it lists the layouts
# whose simulated peak fits, with the margin, then those that do not. Here for the 13B
# model on 8 devices of 80 GB and the four data-parallel strategies (the widget offers
# tp and pipeline too):

# %%
# NBVAL_IGNORE_OUTPUT
fit = nbpar.FitPicker("tiny_gpt", model_config={"d_model": 8192, "n_layers": 16, "n_heads": 64},
                      world_size=8, device_memory_gb=80, seq_len=16,
                      strategies=("ddp", "zero1", "zero2", "zero3"))
fit

# %%
for r in fit.simulate():
    print(f"{r['strategy']:6s} dp {r['dp']} x tp {r['tp']} x pp {r['pp']}: peak "
          f"{gb(r['peak_bytes'])}, fits: {r['fits']}")
fits = {r["strategy"]: r["fits"] for r in fit.rows}
assert fits["zero3"] and not fits["ddp"]

# %% [markdown]
# ## The ZeRO paper's table, by simulation
#
# Fig. 1 of the ZeRO paper: a 7.5B model, mixed-precision Adam, 64 data-parallel GPUs:
# 120 / 31.4 / 16.6 / 1.9 GB per GPU for the baseline and stages 1, 2, 3. The simulation
# runs torch's implementations of each (DDP's math, ZeroRedundancyOptimizer, FSDP2 keeping
# and resharding parameters) on 64 fake ranks:

# %%
gpt7 = nbpar.GPTConfig(d_model=8192, n_layers=9, n_heads=64, vocab_size=16000, seq_len=16)
rows = zero_table(7.5e9, dp=64, precision="mixed")
sims = {}
for row, strategy in zip(rows, ("ddp", "zero1", "zero2", "zero3")):
    sims[strategy] = sim = nbpar.simulate(
        nbpar.TrainConfig(strategy=strategy, gpt=gpt7, micro_batch=1, precision="mixed"), 64)
    print(f"{row['name']:9s} paper {row['total_gb']:6.1f} GB   simulated {strategy:5s} "
          f"{gb(states(sim['ranks'][0]))}")

# %%
import torch

from nbpar.model.models import build_model

n_params = sims["ddp"]["ranks"][0]["param_bytes"] // 4  # fp32 weights, unsharded
with torch.device("meta"):  # shapes only
    biggest = max(p.numel() for p in build_model(nbpar.TrainConfig(gpt=gpt7)).parameters())
print(f"ZeRO-1, rank 0: Adam state {gb(sims['zero1']['ranks'][0]['optim_bytes']).strip()}; "
      f"an even 64th of it would be {gb(8 * n_params / 64).strip()}; the largest single "
      f"weight has {biggest / 1e6:.0f}M parameters ({gb(8 * biggest).strip()} of Adam state)")
assert sims["zero1"]["ranks"][0]["optim_bytes"] == 8 * biggest

# %% [markdown]
# Baseline and P_os+g+p agree: torch holds what the paper assumes, 16 bytes a parameter
# (fp32 weights, gradients and Adam moments under autocast instead of 16-bit copies plus an
# fp32 master, the same total). ZeroRedundancyOptimizer holds *more* than P_os, for two
# reasons: autocast keeps the weights and gradients in fp32 (8 bytes a parameter
# unsharded, where the paper has 4), and it hands *whole* tensors to ranks, largest
# first, each to the least-loaded rank: rank 0 holds the Adam state of one of the largest
# weights, more than an even 64th (printed above; other ranks hold less, some almost
# nothing). FSDP2's ZeRO-2 holds *less* than P_os+g between steps: it reshards the
# parameters after backward, so at rest it is ZeRO-3 (it differs in forward, where it
# keeps them gathered).
#
# ## 70B on 1,024 GPUs: a 3D layout
#
# transformers' Llama with Llama 3 70B's shape (`nbpar.model.hf.LLAMA_3_70B`: width 8192,
# 80 decoder layers, 64 heads, 8 key/value heads, a 128,256-token vocabulary; 70.6B
# parameters, random weights on fake tensors) on dp 32 x tp 8 x pp 4, 1F1B with 4
# micro-batches of 1 x 512 tokens, bf16 autocast. Four ranks are simulated, one per
# pipeline stage, each standing for 256, in one process per core
# (`benchmarks/simulate_scale.py` times the same call):

# %%
from nbpar.model.hf import LLAMA_3_70B

cfg70 = nbpar.TrainConfig(model="hf:llama", model_config=LLAMA_3_70B, strategy="hybrid",
                          dp=32, tp=8, pp=4, micro_batch=1, grad_accum=4, precision="mixed",
                          gpt=nbpar.GPTConfig(seq_len=512))
big = nbpar.simulate(cfg70, 1024, device_memory_gb=80)
for r in big["ranks"]:
    print(f"ranks {r['stands_for'][0]:4d}-{r['stands_for'][-1]:4d}: states {gb(states(r))}, "
          f"activations {gb(r['activation_bytes'])}, peak {gb(r['peak_bytes'])}, "
          f"sends {gb(r['comm_bytes'])} per step")
print(f"every stage fits in 80 GB: {big['fits']}")
acts = [r["activation_bytes"] for r in big["ranks"]]
assert acts == sorted(acts, reverse=True)  # under 1F1B stage i holds p - i micro-batches

# %% [markdown]
# Each rank holds 1/32 of the decoder-layer parameters: a tp-8 shard of its stage's 20
# of the 80 layers. The dp replicas all-reduce their gradients (DDP's math), so its
# states are 16 bytes a parameter of that share. The first stage also keeps the
# embedding and the last the head, each 1.05B parameters, split over the 8 tp ranks too
# (the embedding by vocabulary rows, the head by columns, as `LlamaForCausalLM`'s own
# plan splits `lm_head`), so the end stages hold only a little more than the middle
# ones. The first stage keeps the most activations: under 1F1B stage i holds p - i
# micro-batches at once. When the
# states are the problem, shard over dp as well (`fsdp_reshard=True`, ZeRO-3 on each
# stage): FSDP2 then splits each stage's parameters, gradients and optimizer state over
# its 32 dp ranks.

# %% [markdown]
# ## What it would cost on real GPUs
#
# A simulation says what fits and how many bytes each rank sends; `nbpar.project` turns
# that, or what a config implies, into a step time on real hardware. It is an *estimate*
# and prints its assumptions beside the answer: compute is 6 FLOPs a parameter and token
# at 0.4 of the GPU's bf16 peak, each collective takes ring steps x latency + bytes /
# bandwidth on the link its group uses (`nbpar.hardware`: NVLink in a node, the nodes'
# InfiniBand or Ethernet shared by their GPUs), and part of the communication hides behind
# compute as the strategy allows. A 1B model under DDP, half a million tokens a step, on
# one node of 8 H100s, on two nodes over 400 Gb/s InfiniBand (one card a GPU), and on two
# nodes over one 100 Gb/s Ethernet card each:

# %%
from nbpar import hardware

cfg1b = nbpar.TrainConfig(strategy="ddp", precision="bf16", gpt=nbpar.GPTConfig(seq_len=2048))
for name in ("8xH100-SXM", "2x8xH100-400G", "2x8xH100-100GbE"):
    p = nbpar.project(cfg1b, name, params=1e9, tokens_per_step=2**19)
    print(f"{name:16s} compute {p.compute_s:.3f} s, all-reduce {p.comm_s['dp all_reduce']:.3f} s, "
          f"exposed {p.exposed_s:.3f} s, step {p.step_s:.3f} s: exposed {p.exposed_share:.0%}, "
          f"{'healthy' if p.healthy else 'not healthy'}")

# %% [markdown]
# On one node the all-reduce is 16 ms and hides in the backward; across nodes it is ten
# times slower (50 GB/s a GPU instead of 450) and still hides, because the step's compute
# halved but is still longer; behind one 100 Gb/s card per node it takes 4.8 s and the
# step is mostly waiting. The whole table, with every assumption, for the InfiniBand case:

# %%
print(nbpar.project(cfg1b, "2x8xH100-400G", params=1e9, tokens_per_step=2**19))

# %% [markdown]
# A simulation's own bytes by op project the same way: the 13B model under ZeRO-3 on 8
# ranks, above, on one node of 8 H100s with the same half million tokens a step. And the
# 70B layout on 1,024 H100s (128 nodes, `hardware.cluster`), with the 4 micro-batches
# simulated above and with 256 (4.2M tokens a step, the size of batch such runs use):

# %%
p13 = nbpar.project(eight, "8xH100-SXM", params=psi13, tokens_per_step=2**19)
print(f"13B zero3, 8 x H100: compute {p13.compute_s:.2f} s, "
      + ", ".join(f"{op} {s:.3f} s" for op, s in p13.comm_s.items())
      + f", exposed {p13.exposed_s:.3f} s, step {p13.step_s:.2f} s")
h100x1024 = hardware.cluster("H100-SXM", 128)
for k in (4, 256):
    cfg = nbpar.TrainConfig.from_dict({**cfg70.to_dict(), "grad_accum": k})
    p = nbpar.project(cfg, h100x1024, params=70.6e9)
    print(f"70B, {k:3d} micro-batches: compute {p.compute_s:.3f} s, bubble {p.bubble_s:.3f} s, "
          + ", ".join(f"{op} {s:.3f} s" for op, s in p.comm_s.items())
          + f"; step {p.step_s:.3f} s, exposed {p.exposed_share:.0%}")

# %% [markdown]
# With 4 micro-batches of 512 tokens on each of 32 data-parallel replicas the step is too
# small for 1,024 GPUs: the pipeline bubble (3/4 of the compute) and the gradient
# all-reduce over the network, which the short backward cannot hide, dominate. With 256
# micro-batches the bubble shrinks to 3/256 and the all-reduce hides; what stays exposed
# is tensor parallelism's all-reduces, which sit between the matmuls (nbpar's blocks send
# 6 a layer, where Megatron's fused QKV sends 4, and 30,720 calls add their latency).
#
# The same sum answers the classic claim "a 1B model trains in about 28 days on one A100,
# in under 12 hours on 64": with Chinchilla's 20 tokens a parameter (20B tokens) at 0.4 of
# the A100's 312 TFLOP/s, compute alone (perfect scaling, no communication) says:

# %%
one = nbpar.days_to_train(1e9, 20e9, "A100-80GB")
many = nbpar.days_to_train(1e9, 20e9, "A100-80GB", gpus=64)
print("claim: ~28 days on 1 A100, under 12 hours on 64")
print(f"model: {one:.1f} days on 1 A100, {many * 24:.1f} hours on 64 "
      f"(6 x 1e9 x 20e9 FLOPs / (312e12 x 0.4) = {6 * 1e9 * 20e9 / (312e12 * 0.4):,.0f} s)")
print(f"28 days would need {28 / one * 20:.0f}B tokens at 0.4, or utilisation "
      f"{0.4 * one / 28:.2f} for 20B tokens")
# the second half: 64 GPUs give 64x one GPU's speed only at perfect scaling
for label, days in (("the claim's 28 days", 28), (f"the model's {one:.1f} days", one)):
    print(f"from {label}, under 12 hours on 64 needs a scaling efficiency of at least "
          f"{days * 24 / (64 * 12):.0%}")

# %% [markdown]
# So the two halves hold together only with assumptions the claim does not state: 28
# days is 50B tokens at 0.4 of the peak (or 20B at 0.16), and 12 hours on 64 GPUs from
# 28 days asks for 88% scaling efficiency: data parallelism with ZeRO over fast links
# can give that for a 1B model (its all-reduce hides behind compute, as above); from the
# 11-day compute figure it needs only 35%.
#
# ## A compute model, measured here
#
# The same arithmetic on this machine: its matrix-multiply peak measured, one model's
# training steps timed, and the model FLOPs utilisation (MFU) that follows. FLOPs a token
# are 6N for the weights plus the attention's score and value products, 12 L s d (PaLM,
# appendix B). Timings of a shared laptop: they say what this machine did just now.

# %%
# NBVAL_IGNORE_OUTPUT
# (timings: they depend on this CPU and what else it runs)
import time

import torch

from nbpar.model.models import build_model, next_token_loss


def matmul_flops(n=1024, repeats=20):
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


peak = matmul_flops()
tiny = nbpar.TrainConfig(model="tiny_gpt", micro_batch=8, seed=0,
                         gpt=nbpar.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=128))
model = build_model(tiny)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
seq, width, layers = tiny.gpt.seq_len, tiny.gpt.d_model, tiny.gpt.n_layers
x = torch.randint(0, tiny.gpt.vocab_size, (tiny.micro_batch, seq + 1))


def step():
    loss = next_token_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()


step()  # warm
steps = [_timed(step) for _ in range(10)]
step_s = sorted(steps)[len(steps) // 2]
n_params = sum(p.numel() for p in model.parameters())
per_token = 6 * n_params + 12 * layers * seq * width
tokens_per_s = tiny.micro_batch * seq / step_s
mfu = tokens_per_s * per_token / peak
print(f"this CPU's fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s (1024 x 1024, best of 20)")
print(f"a GPT of width 256, 4 layers: {n_params:,} parameters, {per_token:,} FLOPs a token "
      f"(6N = {6 * n_params:,}, attention {12 * layers * seq * width:,})")
print(f"{tokens_per_s:,.0f} tokens/s (median of 10 steps) -> MFU {mfu:.1%}")

# %%
assert 0 < mfu < 1  # an MFU over 1 would mean the FLOP count is too low

# %% [markdown]
# The MFU printed above is this machine's: how much of its own matmul peak a training
# step turns into model FLOPs (the optimizer, the softmax and Python's overhead count as
# time but not as FLOPs; smaller widths fill the cores less). The projections above
# assume 0.4 of a GPU's bf16 peak; Llama 3's pre-training reports 38-43% on H100s.

# %% [markdown]
# ## Exercise: training time by hand
#
# Training costs about 6 N D FLOPs (2 in the forward pass, 4 in the backward, per
# parameter and token); at `mfu` of `gpus` GPUs' peak, how many seconds? The checker
# compares your formula with nbpar's and says what the tutorial's "28 days on one A100"
# means in tokens. (In this process; `make student` removes the solution.)

# %% tags=["solution"]
import nbpar.exercises


def training_time(n_params, tokens, gpus, peak_flops, mfu):
    # BEGIN SOLUTION
    return 6 * n_params * tokens / (gpus * peak_flops * mfu)
    # END SOLUTION


assert nbpar.exercises.check("training_time", training_time)

# %% [markdown]
# **Takeaway.**
#
# - Fake tensors and a fake process group ran the real strategy code at sizes this
#   machine cannot hold: the simulated 13B states matched the estimate and did not fit
#   80 GB, while ZeRO-3 on 8 ranks did.
# - By simulation, the ZeRO paper's baseline and P_os+g+p came out as in the paper;
#   PyTorch's ZeRO-1 held more than P_os (autocast keeps fp32 weights and gradients) and
#   FSDP2's ZeRO-2 less than P_os+g between steps.
# - Llama 3 70B on dp 32 x tp 8 x pp 4 peaked under 80 GB on every stage, at 512-token
#   sequences and 4 micro-batches of one sequence: a short sequence, and with m = 4 on
#   p = 4 stages a bubble of (p-1)/(m+p-1) = 43% of the step; real runs use longer
#   sequences (more activations) and more micro-batches (less bubble). The first stage
#   held the most activations, as 1F1B predicts; the end stages carry the embedding and
#   the head whole.
# - A simulation answers whether a layout fits and what it sends before any cluster time
#   is spent.
# - `nbpar.project` turned the same layouts into estimated step times on real GPUs, each
#   assumption printed: a 1B DDP all-reduce hides on NVLink and on 400 Gb/s InfiniBand, not
#   behind one 100 Gb/s card per node; the 1B claim's "28 days on one A100" is 11 days of
#   compute at 0.4 of the peak for 20B tokens.
