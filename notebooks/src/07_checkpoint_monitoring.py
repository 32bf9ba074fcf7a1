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
# # 07 · Checkpoints and monitoring: save, kill, resume, export
#
# **Time:** about 25 minutes ([the workshop day](../docs/workshop.md)).
#
# Long runs die: a node fails, a job hits its time limit, someone presses stop. A
# checkpoint keeps everything needed to continue *exactly*: model and optimizer state
# (sharded the way the strategy shards them), each rank's random generator, and where
# the data loader was. This notebook kills a rank mid-run, resumes, and checks the
# resumed losses against a run that never stopped; then it exports one consolidated
# state dict and TensorBoard logs.
#
# **Goal:** checkpoint a run, kill a rank mid-run, resume on fresh engines and prove the
# result equal, bit for bit, to a run that never stopped; then load the checkpoint into
# another layout and export the metrics.

# %%
# %matplotlib inline
import os
import signal
import tempfile
import time

import nbpar
import nbpar.train.checkpoint
import nbpar.view.export
import nbpar.view.plots
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## Save every few steps
#
# `checkpoint_dir` and `checkpoint_every` turn on checkpointing. Every save is written
# to a temporary folder by all ranks (through `torch.distributed.checkpoint`: each rank
# writes its own shards), renamed when complete, and only then does the `latest`
# pointer move, so a crash in the middle of a save never leaves a half checkpoint
# behind. The newest `checkpoint_keep` (default 2) are kept.

# %%
workdir = tempfile.mkdtemp(prefix="nbpar-07-")
ckpt = os.path.join(workdir, "checkpoints")
cfg = nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=8, steps=120,
                        lr=3e-3, seed=0, checkpoint_dir=ckpt, checkpoint_every=10)
run = pool.train(cfg)

# %% [markdown]
# ## Kill a rank mid-run
#
# Once the run is past step 25, rank 1's engine process gets `SIGKILL`: no clean-up, no
# chance to save, like a crashed node. The run fails at once with `EngineDied`.

# %% tags=["raises-exception"]
# NBVAL_IGNORE_OUTPUT
# NBVAL_RAISES_EXCEPTION
while not any(rec["step"] >= 25 for rec in run.history):
    time.sleep(0.02)
os.kill(pool.status()[1]["pid"], signal.SIGKILL)
run.wait()

# %% [markdown]
# What survived is on disk: the newest checkpoints and the `latest` pointer. (Which
# steps exactly depends on how far the run got before the kill.)

# %%
# NBVAL_IGNORE_OUTPUT
print(sorted(os.listdir(ckpt)))
meta = nbpar.train.checkpoint.read_meta(nbpar.train.checkpoint.resolve(ckpt))
print({k: meta[k] for k in ("step", "world_size", "dims", "data", "global_batch")})

# %% [markdown]
# ## Resume
#
# `pool.restart()` replaces the engines (fresh processes, a new process group). Then the
# same config with `resume_from=` the checkpoint folder continues at the saved step:
# weights, Adam moments, RNG state and data position are restored.

# %%
# NBVAL_IGNORE_OUTPUT
pool.restart()

# %%
final = {name: os.path.join(workdir, name) for name in ("resumed", "uninterrupted")}
resumed = pool.train(cfg, resume_from=ckpt, checkpoint_dir=final["resumed"],
                     checkpoint_every=cfg.steps).wait()          # saves once, at the end
start = resumed.history[0]["step"]
reference = pool.train(cfg, checkpoint_dir=final["uninterrupted"],
                       checkpoint_every=cfg.steps).wait()
ref_losses, res_losses = reference.result()["losses"], resumed.result()["losses"]
print("resumed run trains until step", resumed.history[-1]["step"])
print("resumed losses equal the uninterrupted run's:", res_losses == ref_losses[start:])
assert res_losses == ref_losses[start:]

# %%
ax = nbpar.view.plots.plot_losses(reference, labels=["uninterrupted"]).axes[0]
ax.plot([r["step"] for r in resumed.history if r["rank"] == 1], res_losses, "o", ms=3,
        color="tab:red", label="resumed after the kill")
ax.axvline(start, ls=":", color="k")
ax.legend(fontsize="small")
ax.figure

# %% [markdown]
# The resumed run sees the same batches in the same order and applies the same updates.
# Equal losses are a hint; the weights are the proof. Both runs saved their final state:
# merged into one state dict each, every tensor compared bit for bit:

# %%
import torch

weights = {name: torch.load(nbpar.train.checkpoint.consolidate(
    path, os.path.join(workdir, f"{name}.pt")), weights_only=True)
    for name, path in final.items()}
same = all(torch.equal(weights["resumed"][k], weights["uninterrupted"][k])
           for k in weights["uninterrupted"])
print(f"{len(weights['uninterrupted'])} tensors, all bit-for-bit equal:", same)
assert same and weights["resumed"].keys() == weights["uninterrupted"].keys()

# %% [markdown]
# A checkpoint written with one strategy loads into another layout too:
# `torch.distributed.checkpoint` stores tensors by name and reshards on load. The DDP
# checkpoint from before the kill, resumed as FSDP2's ZeRO-3 (each rank now holds half
# of every tensor): the same losses, up to the order in which the sums add up
# (reduce-scatter instead of all-reduce):

# %%
as_zero3 = pool.train(cfg, strategy="zero3", resume_from=ckpt, checkpoint_dir=None,
                      checkpoint_every=0).wait()
z3_losses = as_zero3.result()["losses"]
gap = max(abs(a - b) for a, b in zip(z3_losses, ref_losses[start:]))
print(f"zero3 resumed from the ddp checkpoint and ran the remaining steps: "
      f"{len(z3_losses) == cfg.steps - start}; largest difference from the "
      f"uninterrupted ddp run below 1e-5: {gap < 1e-5}")
assert len(z3_losses) == len(res_losses) and gap < 1e-5
held = {name: run.result()["ranks"][0]["param_bytes"] for name, run in
        (("ddp", reference), ("zero3", as_zero3))}
print(f"rank 0 holds {held['zero3'] / held['ddp']:.2f} of the ddp run's parameter bytes")
assert held["zero3"] < 0.6 * held["ddp"]

# %% [markdown]
# ## One consolidated state dict
#
# For inference or sharing, `nbpar.train.checkpoint.consolidate` merges the shards of a
# checkpoint into one plain `{name: tensor}` file, loadable without nbpar's training
# machinery by `model.load_state_dict`:

# %%
from nbpar.model.models import build_model, next_token_loss

out_file = nbpar.train.checkpoint.consolidate(ckpt, os.path.join(workdir, "tiny_gpt.pt"))
state = torch.load(out_file, weights_only=True)
model = build_model(cfg)
print(model.load_state_dict(state))
print(len(state), "tensors,", sum(t.numel() for t in state.values()), "parameters")

# %% [markdown]
# ## Monitoring: TensorBoard
#
# Every step record (loss, step time split into compute and communication, throughput,
# memory per rank) can be written as TensorBoard event files, one folder per rank. Open
# them with `%load_ext tensorboard` and `%tensorboard --logdir <logdir>`, or on the
# command line `tensorboard --logdir <logdir>`.

# %%
logdir = os.path.join(workdir, "tensorboard")
dirs = nbpar.view.export.to_tensorboard(reference, logdir)
print([os.path.relpath(d, logdir) for d in dirs])

# %% [markdown]
# Reading the events back (what TensorBoard will plot):

# %%
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

events = EventAccumulator(dirs[0]).Reload()
print(sorted(events.Tags()["scalars"]))
loss_events = events.Scalars("loss")
print(len(loss_events), "loss points, first", round(loss_events[0].value, 2),
      "last", round(loss_events[-1].value, 2))

# %% [markdown]
# The same records feed the live dashboard of a run (displayed by a cell that ends
# with `run`); here its final state as a figure:

# %%
from nbpar.view.dashboard import Dashboard

board = Dashboard(reference)
board.update(force=True)
board.figure

# %% [markdown]
# The step panel's black ticks are each rank's blocked share of a normal step: measured
# on every step, the time the rank waited for communication its compute did not hide
# (the same figure notebook 06 prints for its DDP runs, and `nbpar.compare` shows). Its
# note says the figures; the run says whether this machine's timings can be trusted:

# %%
# NBVAL_IGNORE_OUTPUT
res = reference.result()
per_rank = ", ".join(f"{r['comm_blocked_fraction']:.0%}" for r in res["ranks"])
print(f"blocked on communication {res['comm_blocked_fraction']:.0%} of a normal step "
      f"(per rank: {per_rank})")
print(res["timing_note"])

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - Every save is written by all ranks and made visible only when complete, so killing a
#   rank mid-run left the last complete checkpoints and the `latest` pointer.
# - After `pool.restart()`, resuming from the checkpoint gave the uninterrupted run's
#   losses, and the merged final weights were equal bit for bit.
# - The DDP checkpoint resumed as ZeRO-3 (`torch.distributed.checkpoint` reshards on
#   load) and merged into one state dict that loads into a plain model.
# - The same step records become TensorBoard events, one folder per rank, and the run's
#   dashboard.
