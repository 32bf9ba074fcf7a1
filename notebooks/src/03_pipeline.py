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
# # 03 · Pipeline parallelism: GPipe, 1F1B and interleaved schedules
#
# Pipeline parallelism cuts the model into consecutive *stages*, one per rank, and
# streams micro-batches through them. A rank waits while the pipeline fills and drains:
# that idle time is the **bubble**. With `p` stages and `m` micro-batches per step,
# GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2019) idle a
# share `(p-1)/(m+p-1)` of the step; interleaving `v` model chunks per rank
# (Megatron-LM, Narayanan et al. 2021) shrinks it to `(p-1)/(v*m+p-1)`.

# %%
# %matplotlib inline
import nbpar
import nbpar.train.timeline
from matplotlib.figure import Figure
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## Three schedules on the same model
#
# A 4-layer TinyGPT (width 128, 64 tokens) on 2 stages (layers 0-1 on rank 0, 2-3 on
# rank 1; interleaved: rank 0 holds chunks {0, 2}, rank 1 chunks {1, 3}), 8
# micro-batches of 4 sequences per step. `run_training` is nbpar's training loop, callable from your own `%%dist`
# code; `on_finish` gets the trained runner, whose `timeline()` holds every forward (F)
# and backward (B) of the last step, on every stage, in seconds.

# %%
# %%dist
from nbpar.config import GPTConfig, TrainConfig
from nbpar.train.loop import run_training

gpt = GPTConfig(n_layers=4, d_model=128, seq_len=64)  # enough work per micro-batch
timelines, losses = {}, {}
for schedule in ("gpipe", "1f1b", "interleaved"):
    cfg = TrainConfig(model="tiny_gpt", strategy="pipeline", schedule=schedule,
                      micro_batch=4, grad_accum=8, steps=3, seed=0, gpt=gpt)
    out = run_training(cfg, on_finish=lambda runner: timelines.update({schedule:
                                                                       runner.timeline()}))
    losses[schedule] = out["losses"]


# %% [markdown]
# All three compute the same thing; only the order of the work differs, so the losses
# agree (up to float rounding):

# %%
def engine_results():
    return timelines, losses          # runs on an engine, in its namespace

timelines, losses = pool.run(engine_results, targets=0)[0]
for schedule, values in losses.items():
    print(f"{schedule:12s}", [round(x, 2) for x in values])
    assert max(abs(a - b) for a, b in zip(values, losses["gpipe"])) < 1e-5  # fp32 rounding

# %% [markdown]
# ## The timelines
#
# One row per rank, a box per micro-batch's forward (blue) and backward (orange). GPipe
# runs all forwards, then all backwards: every micro-batch's activations are alive at
# the peak. 1F1B starts backwards as soon as the last stage can, so at most `p`
# micro-batches are in flight: same bubble, less memory. Interleaved gives each rank
# two smaller chunks, so the pipeline fills faster. The title of each panel is the
# measured bubble next to the formula; on this shared 2-core machine every box also
# contains Python and communication overhead, so the measured values are noisy and
# above the ideal.

# %%
fig = Figure(figsize=(10, 7.5), layout="constrained")
for ax, (schedule, events) in zip(fig.subplots(3, 1), timelines.items()):
    nbpar.train.timeline.plot_timeline(events, ax=ax, p=2, m=8)
    ax.set_title(f"{schedule}: {ax.get_title()}", fontsize="medium")
fig

# %% [markdown]
# ## Bubble vs number of micro-batches
#
# The fix for the bubble is more micro-batches per step. A GPipe pipeline for
# `m = 1, 2, 4, 8` (1F1B has the same bubble but needs `m >= p`), measured with
# `pool.train` (each run reports the bubble of its last step) against `(p-1)/(m+p-1)`:

# %%
ms = [1, 2, 4, 8]
measured = []
for m in ms:
    run = pool.train(nbpar.TrainConfig(model="tiny_gpt", strategy="pipeline", schedule="gpipe",
                                       micro_batch=4, grad_accum=m, steps=3, seed=0,
                                       gpt=nbpar.GPTConfig(n_layers=4, d_model=128, seq_len=64)))
    measured.append(run.result()["bubble_fraction"])
theory = [nbpar.train.timeline.theory_bubble(p=2, m=m) for m in ms]
print("theory:", [round(t, 3) for t in theory])

# %%
ax = Figure(figsize=(5.5, 3.5), layout="constrained").add_subplot()
ax.plot(ms, theory, "k--", marker="o", label="(p-1)/(m+p-1), p=2")
ax.plot(ms, measured, color="tab:red", marker="s", label="measured (GPipe)")
ax.set_xscale("log", base=2)
ax.set_xticks(ms, [str(m) for m in ms])
ax.set_ylim(0, 1)
ax.set_xlabel("micro-batches per step m")
ax.set_ylabel("bubble (idle share)")
ax.legend(fontsize="small")
ax.figure

# %%
# NBVAL_IGNORE_OUTPUT
print("measured:", [round(b, 3) for b in measured])
print("more micro-batches, smaller bubble:", measured[-1] < measured[0])

# %% [markdown]
# The measured bubble falls with `m` like the formula; it stays above it because each
# send and receive between the stages costs time on the critical path, and on a busy
# CPU the stages run at different speeds. On GPUs with fast links the two come close.
# The price of a large `m` is a smaller micro-batch (less efficient kernels) or a
# larger global batch; interleaving buys a smaller bubble with more communication.

# %%
pool.shutdown()
