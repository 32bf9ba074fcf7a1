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
# embedding and the last the head, each 1.05B parameters that nbpar leaves whole on
# every tp rank (it applies transformers' `base_model_tp_plan`, which covers the decoder
# layers; `LlamaForCausalLM`'s own plan would also split `lm_head` by columns), which is
# why the end stages hold half again as much as the middle ones. The first stage keeps
# the most activations: under 1F1B stage i holds p - i micro-batches at once. When the
# states are the problem, shard over dp as well (`fsdp_reshard=True`, ZeRO-3 on each
# stage): FSDP2 then splits each stage's parameters, gradients and optimizer state over
# its 32 dp ranks.

# %% [markdown]
# **Takeaway.**
#
# - Fake tensors and a fake process group ran the real strategy code at sizes this
#   machine cannot hold: the simulated 13B states matched the estimate and did not fit
#   80 GB, while ZeRO-3 on 8 ranks did.
# - By simulation, the ZeRO paper's baseline and P_os+g+p came out as in the paper;
#   PyTorch's ZeRO-1 held more than P_os (autocast keeps fp32 weights and gradients) and
#   FSDP2's ZeRO-2 less than P_os+g between steps.
# - Llama 3 70B on dp 32 x tp 8 x pp 4 peaked under 80 GB on every stage, the first
#   stage holding the most activations, as 1F1B predicts; the end stages carry the
#   embedding and the head whole.
# - A simulation answers whether a layout fits and what it sends before any cluster time
#   is spent.
