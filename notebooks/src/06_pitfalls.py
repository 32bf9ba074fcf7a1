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
# # 06 · Three pitfalls of distributed training, measured
#
# **Time:** about 30 minutes ([the workshop day](../docs/workshop.md)).
#
# 1. **A tiny global batch** makes the loss jump around; gradient accumulation fixes it
#    at the cost of time, and of some memory under every strategy (measured below).
# 2. **A starved data loader** leaves the model waiting for data; worker processes,
#    persistent workers, prefetching and a packed file format fix it.
# 3. **Communication eating the step**: if communication that compute does not hide
#    takes a large share of the step, each extra rank buys less: with a share f exposed,
#    N ranks give about (1 - f) N times one rank's throughput. ~20% (0.8 N) is a health
#    target, not a cliff. Measured per run as `exposed_comm_fraction`.
#
# **Goal:** produce each pitfall on the pool, measure it, and watch its fix work.

# %%
# %matplotlib inline
import nbpar
import nbpar.model.data
import nbpar.view.plots
import nbpar.model.loader_experiment
import nbpar.estimate
import nbpar.model.models
from matplotlib.figure import Figure
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## 1 · A tiny global batch, fixed by gradient accumulation
#
# The batch the optimizer sees per step is the *global* batch:
# micro-batch x accumulation steps x data-parallel ranks. Two DDP runs of the same
# model and learning rate, one with a global batch of 2, one accumulating 16
# micro-batches of 1 sample per rank before each optimizer step (each rank still holds
# only one sample's activations at a time):

# %%
common = dict(model="simple_cnn", strategy="ddp", micro_batch=1, steps=30, lr=1e-2, seed=0)
small = nbpar.TrainConfig(grad_accum=1, **common)
accum = nbpar.TrainConfig(grad_accum=16, **common)
for cfg in (small, accum):
    print(nbpar.model.data.global_batch_line(cfg.micro_batch, cfg.grad_accum, pool.n))
run_small = pool.train(small).wait()
run_accum = pool.train(accum).wait()


# %%
def roughness(losses):
    """mean absolute change of the loss from one step to the next"""
    return sum(abs(b - a) for a, b in zip(losses, losses[1:])) / (len(losses) - 1)

for name, run in (("global batch 2 ", run_small), ("global batch 32", run_accum)):
    losses = run.result()["losses"]
    print(f"{name}: last loss {losses[-1]:.2f}, step-to-step roughness {roughness(losses):.2f}")
# against samples seen, the axis on which the two runs compare (as notebook 11 plots)
from matplotlib.figure import Figure

ax = Figure(figsize=(7, 3), layout="constrained").add_subplot()
for label, run, batch in (("micro 1 x accum 1 x dp 2", run_small, 2),
                          ("micro 1 x accum 16 x dp 2", run_accum, 32)):
    losses = run.result()["losses"]
    ax.plot([batch * (i + 1) for i in range(len(losses))], losses, label=label, lw=1.2)
ax.set_xscale("log")
ax.set_xlabel("samples seen")
ax.set_ylabel("loss")
ax.set_title("training loss, 30 steps each", fontsize="medium")
ax.legend(fontsize="small")
ax.figure

# %% [markdown]
# Per step, with 2 samples every step follows the noise of two images (the roughness
# printed above); 32 samples average most of it out. Against samples seen the two runs
# are not the same length: in its 30 steps the small batch has seen 60 samples, the
# large one 960, so the figure puts each loss where its data ran out. With DDP the first 15 micro-batches run
# under `no_sync()`, so there is still only **one** all-reduce per optimizer step.
#
# Each micro-batch's loss is scaled by `1/K` before its backward, so the gradients that
# add up in `.grad` are those of the mean loss over all `K` micro-batches, the same as
# one big batch. Checked on one process:

# %%
import torch

torch.manual_seed(0)
layer = torch.nn.Linear(8, 1)
x, y = torch.randn(16, 8), torch.randn(16, 1)
K = 4
for xb, yb in zip(x.chunk(K), y.chunk(K)):          # accumulate K micro-batches
    (torch.nn.functional.mse_loss(layer(xb), yb) / K).backward()
accumulated = layer.weight.grad.clone()
layer.weight.grad = None
torch.nn.functional.mse_loss(layer(x), y).backward()  # one batch of 16
torch.testing.assert_close(accumulated, layer.weight.grad)
print("sum over K micro-batches of grad(loss / K) == grad of the big batch's loss")

# %% [markdown]
# What does accumulation cost? Time: 16 forward and backward passes per optimizer step.
# Memory is often said to be free, since each micro-batch's activations are freed by its
# backward. Measured, as the peak of live tensors on rank 0 for a 4-block GPT (3 steps
# each): one micro-batch per step, 16 accumulated, and the same 16 sequences as one
# micro-batch. (FSDP2 reduce-scatters after every backward by default; nbpar turns its
# gradient sync off, `set_requires_gradient_sync(False)`, until the last micro-batch, so
# a ZeRO-2/3 rank reduce-scatters once per step and through the accumulation holds the
# *full* gradients of every block, as DDP does, not its shard.)

# %%
# NBVAL_IGNORE_OUTPUT
from IPython.display import Markdown

four = dict(model="tiny_gpt", steps=3, lr=1e-3, seed=0,
            gpt=nbpar.GPTConfig(d_model=64, n_layers=4))
cases = {"micro 1": (1, 1), "micro 1 x accum 16": (1, 16), "micro 16": (16, 1)}
peak = {}
for strategy in ("ddp", "zero3"):
    for name, (micro, k) in cases.items():
        cfg = nbpar.TrainConfig(strategy=strategy, micro_batch=micro, grad_accum=k, **four)
        peak[strategy, name] = pool.train(cfg).result()["ranks"][0]["peak_bytes"]
grads = 4 * sum(p.numel() for p in nbpar.model.models.build_model(cfg).parameters())
fmt = nbpar.estimate.format_bytes
for (strategy, name), b in peak.items():
    print(f"{strategy:5s} {name:18s} peak {fmt(b)}")
rise = {s: peak[s, "micro 1 x accum 16"] - peak[s, "micro 1"] for s in ("ddp", "zero3")}
big = {s: peak[s, "micro 16"] - peak[s, "micro 1"] for s in ("ddp", "zero3")}
Markdown(f"Accumulating 16 micro-batches raised the peak by **{fmt(rise['ddp'])}** under DDP "
         f"and **{fmt(rise['zero3'])}** under ZeRO-3. The full gradients are {fmt(grads)} and "
         f"a rank's ZeRO-3 shard of them {fmt(grads / len(pool))}, so holding the full "
         f"gradients instead of the shard adds {fmt(grads - grads / len(pool))}. "
         f"The same 16 sequences as one micro-batch raised the peak by {fmt(big['ddp'])} and "
         f"{fmt(big['zero3'])}. Accumulation is not free in memory under either strategy, "
         f"but it costs a fraction of a bigger micro-batch.")

# %%
for s in ("ddp", "zero3"):
    assert 0 < peak[s, "micro 1 x accum 16"] - peak[s, "micro 1"] < peak[s, "micro 16"] - peak[s, "micro 1"]

# %% [markdown]
# Where does the rise come from? Not from DDP's buckets or `no_sync`: the same two runs in
# one process, with no communication at all, show it too. With one micro-batch per step the
# gradients are `None` until backward makes them, and backward frees the activations as it
# goes, so the two never peak together. With accumulation, the gradients of the earlier
# micro-batches are alive while the next micro-batch's forward holds its activations.

# %%
# NBVAL_IGNORE_OUTPUT
one = {name: pool.train(nbpar.TrainConfig(strategy="single", micro_batch=1, grad_accum=k, **four)).result()["ranks"][0]
       for name, k in (("micro 1", 1), ("micro 1 x accum 16", 16))}
r = one["micro 1 x accum 16"]
held = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] + r["activation_bytes"]
Markdown(f"One process: accumulating 16 raised the peak by "
         f"**{fmt(r['peak_bytes'] - one['micro 1']['peak_bytes'])}** (DDP: {fmt(rise['ddp'])}). "
         f"Its peak, {fmt(r['peak_bytes'])}, is parameters + full gradients + optimizer state + "
         f"one micro-batch's activations ({fmt(held)}) plus {fmt(r['peak_bytes'] - held)} of "
         f"temporaries.")

# %%
assert one["micro 1 x accum 16"]["peak_bytes"] > one["micro 1"]["peak_bytes"]
assert held <= r["peak_bytes"] < held + r["activation_bytes"]  # all four alive at once

# %% [markdown]
# ## 2 · A starved data loader
#
# `SlowDataset` sleeps 10 ms on every sample, standing in for decoding a JPEG or
# tokenising text (a sleep holds no CPU, so here workers overlap it even on 2 cores;
# real decoding needs the cores). With `num_workers=0` the training loop waits for every one of
# them. Worker processes decode in parallel; `persistent_workers=True` keeps them alive
# between epochs instead of starting them again; `prefetch_factor` is how many batches
# each worker prepares ahead. Best of all: decode once, store the samples packed in
# one binary file, and read them through a memory map (a slice, no decoding).

# %%
import os
import tempfile

slow = nbpar.model.loader_experiment.SlowDataset(n=128, delay_s=0.01)
path = nbpar.model.loader_experiment.write_packed(slow, os.path.join(tempfile.mkdtemp(), "train.npy"))
packed = nbpar.model.loader_experiment.PackedDataset(path)
print(len(packed), "samples packed; same first sample:",
      bool((packed[0][0] == slow[0][0]).all()), packed[0][1] == slow[0][1])

# %%
# NBVAL_IGNORE_OUTPUT
settings = {"0 workers": (slow, {}),
            "2 workers": (slow, dict(num_workers=2)),
            "2 persistent,\nprefetch 4": (slow, dict(num_workers=2, persistent_workers=True,
                                                     prefetch_factor=4)),
            "packed memmap,\n0 workers": (packed, {})}
speed = {name: nbpar.model.loader_experiment.loader_throughput(ds, batch_size=16, epochs=3, **kw)
         for name, (ds, kw) in settings.items()}
print("2 workers faster than none:", speed["2 workers"] > speed["0 workers"])
print("packed file faster than decoding:", speed["packed memmap,\n0 workers"] > speed["0 workers"])
ax = Figure(figsize=(7, 3), layout="constrained").add_subplot()
ax.bar(range(len(speed)), list(speed.values()), color=["tab:red", "tab:orange", "tab:olive",
                                                       "tab:green"])
ax.set_xticks(range(len(speed)), list(speed))
ax.set_yscale("log")
ax.set_ylabel("samples / s (log)")
ax.set_title("DataLoader throughput over 3 epochs (timings vary from run to run)",
             fontsize="medium")
ax.figure

# %% [markdown]
# Timings vary with the machine's load, so this cell's output is not checked, but the
# order is typical: workers divide the decoding time by their number (on a 2-core
# machine, 2 workers), persistent workers save the start-up of every new epoch, and the
# packed file is orders of magnitude faster because the work is gone, not just spread.
# For distributed training each rank has its own loader and its own workers: the
# cores per rank are what count.
#
# ## 3 · Communication over 20% of the step
#
# Every normal step measures the seconds the training thread was blocked: it neither
# computed nor waited for a core, so it waited for communication that compute did not
# hide, or for the slower rank to join (`comm_blocked_fraction`, the median over the
# steps, from the kernel's clocks of the thread; it costs the step nothing one can
# measure). That is the share the 20% rule of thumb is about. Sampled steps are also
# metered op by op: the time with a collective in flight (`comm_fraction`), and the
# blocked part split into waiting for the slower rank (`comm_wait_fraction`) and the rest
# (`exposed_comm_fraction`). In flight includes communication that overlaps backward
# (DDP's buckets all-reduce while later layers still compute). Waiting is imbalance
# between ranks, not communication. The metered step runs slower than the others (every
# op passes through Python), so its shares are of that slower step: they tell in flight
# from exposed from waiting, and the every-step figure says how much a normal step
# loses. A 1-sample micro-batch of the small GPT is a textbook
# case: a step with little compute per all-reduce. Accumulating 16
# micro-batches per all-reduce adds 15 forward and backward passes of compute to the
# same one all-reduce, so communication takes a smaller share of a (longer) step.

# %%
gpt = dict(model="tiny_gpt", strategy="ddp", micro_batch=1, steps=20, lr=3e-3, seed=0)
run_latency = pool.train(nbpar.TrainConfig(grad_accum=1, **gpt)).wait()
run_compute = pool.train(nbpar.TrainConfig(grad_accum=16, **gpt)).wait()

# %%
# NBVAL_IGNORE_OUTPUT
for name, run in (("accum 1 ", run_latency), ("accum 16", run_compute)):
    res = run.result()
    lo, hi = res["ranks"][0]["comm_blocked_fraction_spread"]
    print(f"{name}: blocked on communication {res['comm_blocked_fraction']:.0%} of a normal "
          f"step (rank 0: {lo:.0%}-{hi:.0%} over its steps); the metered step: in flight "
          f"{res['comm_fraction']:.0%}, exposed {res['exposed_comm_fraction']:.0%}, waiting "
          f"for the other rank {res['comm_wait_fraction']:.0%}")
    print("  ", res["timing_note"])
fig = Figure(figsize=(10, 3), layout="constrained")
left, right = fig.subplots(1, 2)
nbpar.view.plots.plot_step_split(run_latency, ax=left)
nbpar.view.plots.plot_step_split(run_compute, ax=right)
left.set_title("tiny_gpt, micro 1 x accum 1", fontsize="medium")
right.set_title("tiny_gpt, micro 1 x accum 16", fontsize="medium")
fig

# %% [markdown]
# Timings are noisy on a shared machine (a rank that waits for a slower peer inside
# an all-reduce counts that wait as communication), so these outputs are not checked;
# the line under each says whether this machine's timings could be trusted. The black
# tick on each bar is the rank's blocked share of a normal step (every step, measured).
# Each panel splits the metered step of each rank into communication that compute did not
# hide once both ranks had joined (exposed), waiting inside a collective for the slower
# rank, communication hidden by compute, and compute alone, as the metered step measured
# them; the dashed line is the 20% exposed mark (the same panel is in the live dashboard
# shown when you display a `Run`). Exposed is an upper bound (Python between ops counts
# as not hiding it). The metered step sends every op through Python, which slows the
# ranks by different amounts, so on a busy CPU the wait reads larger than on a normal
# step. Above the mark: give each rank more work per all-reduce (a bigger
# micro-batch, accumulation), overlap communication with backward (DDP's buckets do),
# or use fewer, faster links (on GPUs: NVLink within a node before the network).
# `nbpar.compare` puts the numbers side by side:

# %%
# NBVAL_IGNORE_OUTPUT
nbpar.compare([run_latency, run_compute], labels=["accum 1", "accum 16"])

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - A global batch of 2 made the loss jump from step to step; accumulating 16
#   micro-batches smoothed it (the printed roughness) with one all-reduce per optimizer
#   step, and the accumulated gradient equals the big batch's exactly.
# - Accumulation is not free in memory: it raised the measured peak under DDP, ZeRO-3
#   and in one process alike (the gradients stay alive through the next micro-batch's
#   forward), but by less than the same samples as one micro-batch.
# - A loader that decodes in Python starves the loop; workers, persistent workers with
#   prefetching, and above all a packed memory-mapped file raised the throughput (a
#   timing: the order matters, not the numbers).
# - With a 1-sample micro-batch a large share of every normal step was blocked on the
#   all-reduce; accumulating 16 micro-batches per all-reduce cut that share (the printed
#   figures, when the line under them says the timings can be trusted). The metered split keeps a rank's wait for its slower peer apart
#   from exposed communication: the wait is imbalance, not bandwidth. Above ~20% exposed
#   communication, give each rank more work per all-reduce, overlap it with backward, or
#   use faster links.
