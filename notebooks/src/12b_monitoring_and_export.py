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

# %%

# %% [markdown]
# # 12b · Monitoring a run and exporting it for inference
#
# **Time:** about 20 minutes ([the workshop day](../docs/workshop.md)).
#
# **Goal:** see what a run reports while it trains, check that its memory stays flat,
# send the same numbers to the tools a cluster watches them with, and turn a sharded
# DeepSpeed ZeRO-3 checkpoint into one safetensors file for inference.
#
# It follows [12_torchrun_and_slurm](12_torchrun_and_slurm.ipynb), which took the recipe
# to a cluster job.

# %%
# %matplotlib inline
import contextlib
import io
import json
import os
import shutil
import tempfile

import numpy as np
import torch

import nbpar
import nbpar.train.checkpoint
import nbpar.view.export
import nbpar.view.live

workdir = tempfile.mkdtemp(prefix="nbpar-12b-")

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## Monitoring: utilisation, memory, Prometheus, W&B, TensorBoard
#
# Every step of every rank publishes one record. On GPUs it holds the allocator's
# figures (`device_allocated_bytes`, `device_peak_bytes`) and, where NVML is available
# (the `pynvml` package, which `torch.cuda.utilization()` reads), the GPU's utilisation
# (`device_util_pct`, shown in the dashboard's progress line). Here, on CPU, there is no
# NVML: the record holds the process's resident memory (`rss_bytes`) instead.

# %%
mon = nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=8, steps=40,
                        lr=3e-3, seed=0)
clean = pool.train(mon).wait()
rec = clean.history[-1]
print("GPU utilisation (NVML) in the records:", "device_util_pct" in rec)
print("memory read from:", nbpar.view.live.memory_key(rec))
print("record keys:", sorted(k for k in rec if k.endswith(("_bytes", "_s", "_pct"))))

# %% [markdown]
# On a cluster, NVIDIA's DCGM exporter (`dcgm-exporter`, port 9400) serves every GPU's
# utilisation (`DCGM_FI_DEV_GPU_UTIL`) and framebuffer memory (`DCGM_FI_DEV_FB_USED`) to
# Prometheus, next to nbpar's own metrics below.
#
# ### Memory stable, not rising
#
# After the first steps (allocator warm-up, Adam's moments created at step 1), a
# healthy training loop holds the same memory every step. A loop that keeps a reference
# to something per step grows until it dies. To see the difference, the same run with
# a classic bug: a loss function that keeps every step's output "for metrics later".

# %%
from nbpar.model.models import next_token_loss

kept = []

def leaky_loss(logits, targets):
    kept.append(logits)  # the bug: every step's logits stay alive
    return next_token_loss(logits, targets)

leaky = pool.train(mon, loss=leaky_loss).wait()
logits_kib = mon.micro_batch * mon.gpt.seq_len * mon.gpt.vocab_size * 4 / 1024
print(f"each step's logits: {logits_kib:.0f} KiB")

# %%
WARM = 5  # steps left out: allocator warm-up, optimizer state created


def memory_per_step(run, rank):
    recs = [r for r in run.history if r["rank"] == rank]
    key = nbpar.view.live.memory_key(recs[-1])
    return np.array([r["step"] for r in recs]), np.array([r[key] for r in recs]) / 2**20


def slope_kib_per_step(run, rank):
    steps, mib = memory_per_step(run, rank)
    return np.polyfit(steps[WARM:], mib[WARM:], 1)[0] * 1024


states = {(r["param_bytes"], r["grad_bytes"], r["optim_bytes"])
          for r in clean.history if r["step"] >= 1}
print("model states (params, grads, optimizer) the same at every step after the first:",
      len(states) == 1)
for rank in (0, 1):
    flat = abs(slope_kib_per_step(clean, rank)) < logits_kib / 4
    rising = slope_kib_per_step(leaky, rank) > logits_kib / 2
    print(f"rank {rank}: clean run flat after warm-up: {flat}; "
          f"leaky run rising by more than half the logits per step: {rising}")
    assert flat and rising and len(states) == 1

# %%
# NBVAL_IGNORE_OUTPUT
for name, r in (("clean", clean), ("leaky", leaky)):
    print(name, [f"{slope_kib_per_step(r, k):.0f} KiB/step" for k in (0, 1)])

# %%
from matplotlib.figure import Figure

fig = Figure(figsize=(9, 3), layout="constrained")
ax = fig.subplots()
for name, r, color in (("clean", clean, "tab:blue"), ("keeps its logits", leaky, "tab:red")):
    for rank, style in ((0, "-"), (1, ":")):
        steps, mib = memory_per_step(r, rank)
        ax.plot(steps, mib - mib[WARM], style, color=color, label=f"{name}, rank {rank}")
ax.axvline(WARM, color="k", lw=0.5)
ax.set_xlabel("step")
ax.set_ylabel(f"memory - memory at step {WARM} (MiB)")
ax.set_title("resident memory per step (CPU; on GPUs the allocator's)")
ax.legend(fontsize="small")
fig

# %% [markdown]
# The clean run's line stays flat; the leaky one climbs steadily, every step by a little
# more than what it keeps (the measured slopes are in the uncompared cell above). The same check on GPUs reads `device_allocated_bytes`; the dashboard's memory
# panel plots it live.
#
# ### Prometheus and Grafana
#
# `nbpar.view.export.PrometheusExporter` serves the latest step of every rank as gauges
# on a local port (`127.0.0.1` unless told otherwise) for Prometheus to scrape;
# `docs/grafana_dashboard.json` is a Grafana dashboard over those metrics. Call
# `update(run)` while a run trains (e.g. from a thread); here once, after the run.
# What Prometheus reads from the endpoint (timings left out, they vary):

# %%
import urllib.request

with nbpar.view.export.PrometheusExporter() as exporter:
    exporter.update(clean)
    with urllib.request.urlopen(exporter.url, timeout=10) as resp:
        text = resp.read().decode()
print("served on 127.0.0.1:", exporter.url.startswith("http://127.0.0.1:"))
for line in text.splitlines():
    if line.startswith(("# HELP", "nbpar_step{", 'nbpar_memory_bytes{kind="params"')):
        print(line)
    elif line.startswith("nbpar_loss"):
        name, value = line.rsplit(" ", 1)
        print(name, round(float(value), 2))

# %% [markdown]
# A Prometheus job scrapes it with `scrape_configs: [{job_name: nbpar, static_configs:
# [{targets: ["127.0.0.1:PORT"]}]}]`; the Grafana dashboard's panels:

# %%
with open(os.path.join(os.path.dirname(nbpar.__file__), "..", "docs",
                       "grafana_dashboard.json")) as f:
    print([panel["title"] for panel in json.load(f)["panels"]])

# %% [markdown]
# ### Weights & Biases
#
# `nbpar.view.export.to_wandb(run)` logs one W&B step per training step, each rank's
# scalars as `rank{r}/{tag}`. Uploading needs an account and the network; with
# `WANDB_MODE=offline` the client writes the run to a local folder instead, which
# `wandb sync <folder>` uploads later. That is what runs here (all of W&B's files in
# this notebook's temp folder):

# %%
import wandb

for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    os.environ[var] = workdir
os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
rows = nbpar.view.export.wandb_rows(clean)
print(len(rows), "W&B steps; step 0 logs", sorted(rows[0])[:6], "...")
wb = nbpar.view.export.to_wandb(clean, project="nbpar-12", dir=workdir)
wandb.teardown()  # stops the client's background service
offline = [d for d in os.listdir(os.path.join(workdir, "wandb")) if d.startswith("offline-run")]
print("offline run written:", wb.offline and len(offline) == 1,
      "| files:", sorted(f.split("-")[0] + ".wandb" if f.endswith(".wandb") else f
                         for f in os.listdir(os.path.join(workdir, "wandb", offline[0]))))

# %% [markdown]
# ### TensorBoard
#
# The same records as TensorBoard event files, one folder per rank (notebook 07 reads
# them back):

# %%
tb_dirs = nbpar.view.export.to_tensorboard(clean, os.path.join(workdir, "tensorboard"))
print([os.path.basename(d) for d in tb_dirs])

# %% [markdown]
# **Takeaway:** GPU utilisation and memory come from NVML and the allocator on GPUs,
# resident memory on CPU; a run's memory after warm-up must be flat, and a slope of one
# tensor per step points at a reference kept per step. The same per-step records go to
# Prometheus (and Grafana), W&B (offline without an account) and TensorBoard.

# %% [markdown]
# ## Export for inference: from ZeRO-3 shards to one safetensors file
#
# **Goal:** train with DeepSpeed ZeRO-3, where no rank ever holds the whole model,
# merge the checkpoint's shards into one fp32 state dict with DeepSpeed's
# `zero_to_fp32`, save it as safetensors and load it into a plain single-process model
# that computes exactly what the trained one does.
#
# The run goes through `pool.run`, which calls a function on every rank: it trains
# (with a checkpoint at the end) and then gathers the trained parameters
# (`full_parameters`, a collective under ZeRO-3), to compare with the export.

# %%
ds_cfg = nbpar.TrainConfig(model="tiny_gpt", strategy="zero3", backend="deepspeed",
                           micro_batch=8, steps=6, lr=3e-3, seed=0,
                           checkpoint_dir=os.path.join(workdir, "ck-zero3"), checkpoint_every=6)


def train_and_gather(cfg):
    from nbpar.train.loop import run_training

    trained = {}
    res = run_training(cfg, on_finish=lambda runner: trained.update(runner.full_parameters()))
    return res["losses"], {name: t.numpy() for name, t in trained.items()}


(ds_losses, trained), _ = pool.run(train_and_gather, ds_cfg.to_dict(), timeout=300)
print("losses", [round(x, 2) for x in ds_losses])

# %% [markdown]
# The checkpoint holds one file of fp32 master weights and optimizer state per rank
# (each rank's half of every flattened parameter group) and one model-states file per
# rank whose parameters are empty placeholders:

# %%
step_dir = nbpar.train.checkpoint.resolve(ds_cfg.checkpoint_dir)
ds_dir = os.path.join(step_dir, "ds")
print(sorted(os.listdir(ds_dir)))
model_file = sorted(f for f in os.listdir(ds_dir) if f.endswith("model_states.pt"))[0]
module = torch.load(os.path.join(ds_dir, model_file), weights_only=False)["module"]
print("elements in the model file's parameters:", sum(t.numel() for t in module.values()))

# %% [markdown]
# `consolidate` runs DeepSpeed's `zero_to_fp32` (`get_fp32_state_dict_from_zero_checkpoint`)
# on it in this one process and writes the merged weights; a name ending in
# `.safetensors` makes a safetensors file: tensors and a JSON header, no pickle, so
# loading it cannot run code (a `.pt` file is a pickle).

# %%
from safetensors import safe_open
from safetensors.torch import load_file

from nbpar.model.models import build_model

with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    # zero_to_fp32 reports its progress: left out here
    out = nbpar.train.checkpoint.consolidate(step_dir,
                                             os.path.join(workdir, "tiny_gpt.safetensors"))
with safe_open(out, framework="pt") as f:
    print(len(list(f.keys())), "tensors, metadata", f.metadata())
exported = load_file(out)
print("dtypes:", sorted({str(t.dtype) for t in exported.values()}))

fresh = build_model(ds_cfg)       # a plain model in this process: no DeepSpeed, no group
fresh.load_state_dict(exported)   # strict: every name and shape
same_weights = all(torch.equal(exported[k], torch.from_numpy(v)) for k, v in trained.items())
print(f"{len(trained)} trained parameters gathered from the ranks, equal to the export "
      "bit for bit:", same_weights)

# %% [markdown]
# And the outputs: the model with the gathered trained parameters and the model loaded
# from the file, on the same batch:

# %%
reference = build_model(ds_cfg)
reference.load_state_dict({k: torch.from_numpy(v) for k, v in trained.items()}, strict=False)
tokens = torch.randint(0, ds_cfg.gpt.vocab_size, (4, ds_cfg.gpt.seq_len),
                       generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    a, b = reference.eval()(tokens), fresh.eval()(tokens)
print("logits", tuple(b.shape), "bit-for-bit equal:", torch.equal(a, b))
assert same_weights and torch.equal(a, b)

# %% [markdown]
# **Takeaway:** a sharded checkpoint is not an inference artifact. `zero_to_fp32` (here
# through `consolidate`) merges ZeRO's partitions into one fp32 state dict; written as
# safetensors it loads without DeepSpeed, without a process group and without
# unpickling, into a plain model that gives the trained model's outputs exactly. FSDP2
# or DDP checkpoints go the same way (`consolidate` reads them through
# `torch.distributed.checkpoint`, notebook 07).


# %%
pool.shutdown()
shutil.rmtree(workdir)  # checkpoints, exports and W&B's files

# %% [markdown]
# **Takeaway.**
#
# - Monitoring is per rank and per step: the records above showed a clean run's memory
#   flat and a leaking run's rising, and the same records went to Prometheus, W&B
#   (offline) and TensorBoard. The loss they carry is the global batch's, the same on
#   every rank; what differs per rank is memory, time and communication.
# - A ZeRO-3 checkpoint became one safetensors file that a plain model loads without
#   DeepSpeed, giving the trained model's outputs exactly.
