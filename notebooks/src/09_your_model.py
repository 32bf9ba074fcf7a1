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
# # 09 · Your own model
#
# **Time:** about 25 minutes ([the workshop day](../docs/workshop.md)).
#
# The strategies of the earlier notebooks are not tied to nbpar's teaching models.
# `TrainConfig(model=...)` also takes a function that returns an `nn.Module` (with
# `dataset=` and `loss=`), a `"package.module:function"` string, or a Hugging Face
# transformers family (`"hf:gpt2"`, `"hf:llama"`) built from a config with random
# weights. Data parallelism (DDP, ZeRO-1/2/3, offload, mixed precision) works on any
# module; tensor and pipeline parallelism need a model that declares its blocks.
#
# **Goal:** train a model, data set and loss written in this notebook and check ZeRO-3
# against one process; see a mismatch refused before any engine works; train a
# 100M-parameter Llama with DDP and ZeRO-3 and compare what each rank holds with the
# estimate.

# %%
# %matplotlib inline
import nbpar
import nbpar.view.plots
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from torch.utils.data import TensorDataset

pool = nbpar.Pool(2)

# %% [markdown]
# ## A module written here
#
# Three functions: the model, a map-style data set of `(input, target)` pairs, and the
# loss. They are defined in this notebook, so they travel to the engines by value
# (with `cloudpickle`), with the globals they use. Each engine takes its shard of the
# data through a `DistributedSampler` and calls `set_epoch` at every new epoch.

# %%
def make_model():
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1), nn.Flatten(0))


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 8, generator=g)
    return TensorDataset(x, 0.5 * x @ torch.linspace(-1, 1, 8))


def mse(out, target):
    return F.mse_loss(out, target)


nbpar.register_model("my_mlp", make_model, dataset=make_data, loss=mse)  # now in the picker
mine = dict(model="my_mlp", steps=10, lr=1e-2)
single = pool.train(nbpar.TrainConfig(strategy="single", micro_batch=16, **mine)).wait()
zero3 = pool.train(nbpar.TrainConfig(strategy="zero3", micro_batch=8, **mine)).wait()
gap = max(abs(a - b) for a, b in zip(single.result()["losses"], zero3.result()["losses"]))
print("ZeRO-3 on 2 ranks equals one process (within 1e-5):", gap < 1e-5)
assert gap < 1e-5

# %% [markdown]
# What does not fit is refused in one line, before any engine works: the first batch
# goes through the model in this kernel, first on the meta device (shapes only, no
# weights); when that pass fails it runs once more with real weights, so the message
# below is torch's own from that second pass.

# %% tags=["raises-exception"]
# NBVAL_RAISES_EXCEPTION
pool.train(nbpar.TrainConfig(model="my_mlp", dataset=lambda: TensorDataset(
    torch.randn(64, 5), torch.randn(64)), strategy="ddp"))

# %% [markdown]
# ## A Llama of 100M parameters
#
# A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention)
# from transformers' `LlamaConfig`, byte-level vocabulary, trained on the Python
# standard library's bytes. Adam in fp32 costs 16 bytes per parameter: 1.6 GB of model
# states for DDP on each rank. ZeRO-3 shards all of it over the 2 ranks.

# %%
LLAMA = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16,
         "num_attention_heads": 12, "num_key_value_heads": 4}
base = dict(model="hf:llama", model_config=LLAMA, micro_batch=1, steps=2, lr=3e-4)
with torch.device("meta"):  # the structure only, no weights
    llama = nbpar.model.models.build_model(nbpar.TrainConfig(**base))
print(f"{nbpar.estimate.count_parameters(llama) / 1e6:.1f}M parameters")
for s in ("ddp", "zero3"):
    print(nbpar.estimate_memory(llama, pool.n, s).table())

# %%
runs = {s: pool.train(nbpar.TrainConfig(strategy=s, **base)).wait() for s in ("ddp", "zero3")}
for s, run in runs.items():
    res = run.result()
    m = res["ranks"][0]
    print(f"{s:5s} losses {[round(x, 2) for x in res['losses']]} | rank 0 holds params "
          f"{m['param_bytes'] / 1e6:.1f} MB, grads {m['grad_bytes'] / 1e6:.1f} MB, "
          f"optimizer {m['optim_bytes'] / 1e6:.1f} MB")
gap = max(abs(a - b) for a, b in zip(*(r.result()["losses"] for r in runs.values())))
print("same losses (within 1e-5):", gap < 1e-5)

# %% [markdown]
# Per rank, measured next to the estimate: ZeRO-3 keeps half of the parameters,
# gradients and optimizer states. The peak line adds what a step holds for a moment
# (activations saved for backward, the parameters of the block being computed).

# %%
fig = Figure(figsize=(9, 3.2), layout="constrained")
for ax, (s, run) in zip(fig.subplots(1, 2), runs.items()):
    nbpar.view.plots.plot_memory(run.result(), nbpar.estimate_memory(llama, pool.n, s), ax=ax)
    ax.set_ylim(0, 2.4e9)
    ax.set_title(s, fontsize="medium")
fig

# %% [markdown]
# ## Tensor and pipeline parallelism
#
# `hf:llama` splits its attention and MLP by transformers' own tensor-parallel plan
# (`LlamaConfig.base_model_tp_plan`: q/k/v and gate/up column-wise, o and down
# row-wise), and a pipeline cuts it between decoder layers. The tp degree must divide
# the 12 attention heads and the 4 key/value heads:

# %%
print(nbpar.TrainConfig(strategy="tp", **base).validate(2).dims(2))
try:
    nbpar.TrainConfig(strategy="tp", **base).validate(8)
except ValueError as err:
    print(err)

# %% [markdown]
# A module of your own gets the same by declaring its blocks: a `parallel_plan()`
# method returning `nbpar.model.plan.ModelPlan` (the blocks, a DTensor split per
# block, which parts only the first and the last pipeline stage keep).
# `activation_checkpointing=True` recomputes each block's activations in backward
# instead of keeping them.

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - Functions defined in the notebook travel to the engines by value; ZeRO-3 on 2 ranks
#   gave the single-process losses.
# - A data set that does not fit the model was refused in one line, from a first batch
#   through the model in the kernel (meta device, then real weights for the message),
#   before any engine worked.
# - The 100M-parameter Llama trained to the same losses under DDP and ZeRO-3, ZeRO-3
#   holding half the bytes per rank, as the estimate said.
# - Tensor and pipeline parallelism need the model's blocks: `hf:llama` brings its own
#   plan (the tp degree must divide its heads); your own module declares one with
#   `parallel_plan()`.
