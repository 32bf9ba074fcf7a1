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
# # 12 · From notebook to cluster: torchrun, monitoring, export for inference
#
# **Time:** about 35 minutes ([the workshop day](../docs/workshop.md)).
#
# **Goal:** take the notebooks' recipe to a cluster job and its tools: torchrun, Slurm,
# monitoring, and a checkpoint ready for inference.
#
# Three steps that come after the notebooks: **A** the DDP recipe as a standalone
# `torchrun` script, as a cluster job runs it, checked against `pool.train`; **B**
# monitoring a run the way the tutorial lists it (GPU utilisation and memory, memory that
# stays flat, Prometheus + Grafana, Weights & Biases, TensorBoard); **C** turning a
# sharded DeepSpeed ZeRO-3 checkpoint into one safetensors file for inference.

# %%
# %matplotlib inline
import contextlib
import inspect
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

import nbpar
import nbpar.train.checkpoint
import nbpar.view.export
import nbpar.view.live
import nbpar.view.plots
from nbpar.train import ddp_script

workdir = tempfile.mkdtemp(prefix="nbpar-12-")

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## A. The same recipe as a torchrun script
#
# **Goal:** run the DDP recipe of notebook 01 outside the notebook, as `torchrun` runs
# it on a cluster node, and show that it trains exactly what `pool.train` trains.
#
# `torchrun --nproc_per_node N script.py` starts N processes on a node and gives each
# `RANK`, `LOCAL_RANK` (its index on this node), `WORLD_SIZE` and the rendezvous address
# in its environment. The script then does what the notebook's cells did, in this order:
# `init_process_group`, bind its device, wrap the model in DDP, shard the data with a
# `DistributedSampler` and call `set_epoch` every epoch, log from rank 0, and
# `destroy_process_group` at the end. `nbpar.train.ddp_script` is that script (the same
# pieces build `benchmarks/plain_ddp.py`, the baseline nbpar's speed is measured
# against). Its heart:

# %%
for part in (ddp_script.setup, ddp_script.batches, ddp_script.train):
    print(inspect.getsource(part))

# %% [markdown]
# On GPUs `setup` calls `torch.cuda.set_device(local_rank)` before any CUDA work (or
# every process would allocate on GPU 0) and DDP gets `device_ids=[local_rank]`; on CPU
# the group uses gloo and `device_ids` stays `None`. The model, data and optimizer come
# from nbpar's config only so that the result can be compared; in your own script they
# are yours.
#
# `ddp_script.write_script(cfg, folder)` writes the script and its config into a folder.
# Here it runs for real: 2 processes on this machine's CPU, with gloo.

# %%
cfg = nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=8, steps=10,
                        lr=3e-3, seed=0)
job = os.path.join(workdir, "job")
script = ddp_script.write_script(cfg, job)
print(sorted(os.listdir(job)))
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
       script, "--out", os.path.join(job, "weights.pt")]
print("torchrun", *cmd[3:6], os.path.basename(script), "--out weights.pt")
proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
assert proc.returncode == 0, proc.stderr[-3000:]
*log_lines, last_line = proc.stdout.strip().splitlines()
print("\n".join(log_lines))                    # rank 0's log: one copy, not two
script_losses = json.loads(last_line)["losses"]

# %% [markdown]
# The same config through the pool, saving its final state; the checkpoint merged into
# one state dict and every tensor compared with the script's:

# %%
run = pool.train(cfg, checkpoint_dir=os.path.join(workdir, "ck-ddp"),
                 checkpoint_every=cfg.steps).wait()
nbpar_losses = run.result()["losses"]
ours = torch.load(nbpar.train.checkpoint.consolidate(
    os.path.join(workdir, "ck-ddp"), os.path.join(workdir, "ddp.pt")), weights_only=True)
theirs = torch.load(os.path.join(job, "weights.pt"), weights_only=True)
same = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
print("losses equal:", script_losses == nbpar_losses)
print(f"{len(ours)} tensors, all bit-for-bit equal:", same)
assert script_losses == nbpar_losses and same

# %%
nbpar.view.plots.plot_loss_difference(script_losses, nbpar_losses,
                                      labels=("torchrun script", "pool.train"))

# %% [markdown]
# ### NCCL's environment variables
#
# On GPUs the group uses NCCL, which reads its settings from the environment of every
# process (`Pool(env={...})` sets them on all engines; a batch script exports them before
# `torchrun`). NCCL's documentation sorts them into *system configuration*, which
# belongs in job scripts, and *debugging*, which "should not be used in production nor
# retained in scripts" ([NCCL environment variables](https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)):
#
# | variable | what it does | when |
# |---|---|---|
# | `NCCL_DEBUG=INFO` | prints the topology NCCL found and the transport of every link (`via P2P/IPC`, `via SHM`, `via NET/IB`, `via NET/Socket`; P2P is the same transport over NVLink or PCIe) | the first thing to set when a job is slow or hangs |
# | `NCCL_SOCKET_IFNAME=eth0` (or `^docker,lo`) | the IP interfaces NCCL may use for bootstrap and socket traffic | nodes with several interfaces, where NCCL picks a wrong one |
# | `NCCL_IB_HCA=mlx5_0,mlx5_1` | which InfiniBand adapters (and ports) to use | nodes whose adapters are not all on the compute fabric |
# | `NCCL_IB_DISABLE=1` | no InfiniBand: inter-node traffic over TCP sockets | debugging a fabric problem; much slower |
# | `NCCL_P2P_DISABLE=1` | no direct GPU-to-GPU copies (NVLink or PCIe peer access): traffic goes through host memory | a **debugging switch** for machines whose peer-to-peer path is broken, not a speed setting: it slows intra-node traffic down |
#
# The tutorial lists `NCCL_P2P_DISABLE=1` among speed tips; what is true: it only ever
# removes the fastest path inside a node.
#
# ### Inside a node vs between nodes
#
# Links differ by an order of magnitude. Per GPU and per direction, from the vendors'
# figures: NVLink 4 on H100/H200 SXM is 900 GB/s counted both ways, 450 GB/s each way
# ([H100 datasheet](https://www.nvidia.com/en-us/data-center/h100/)); PCIe Gen5 x16 is
# 128 GB/s both ways, 64 each way (same source); an InfiniBand NDR port is 400 Gb/s,
# 50 GB/s each way (ConnectX-7; a DGX H100 has one per GPU); 100 Gb Ethernet is 12.5 GB/s.
# What that means for one all-reduce of tensor parallelism over 8 GPUs (a ring sends
# 2(n-1)/n of the tensor per GPU), for the activations of one layer of a 70B-class model
# (batch 1 x 4,096 tokens x width 8,192 in bf16), and for a step (80 layers, 2 all-reduces
# each forward and 2 backward):

# %%
links_gb_s = {"NVLink 4 (H100/H200 SXM)": 450, "PCIe Gen5 x16": 64,
              "InfiniBand NDR (1 port)": 50, "100 Gb Ethernet": 12.5}
n, act_bytes = 8, 1 * 4096 * 8192 * 2
per_gpu = 2 * (n - 1) / n * act_bytes
print(f"one all-reduce moves {per_gpu / 2**20:.0f} MiB per GPU")
for link, gb_s in links_gb_s.items():
    ms = per_gpu / (gb_s * 1e9) * 1e3
    print(f"{link:26s} {ms:6.2f} ms each, {ms * 80 * 4 / 1e3:5.2f} s per step")

# %% [markdown]
# These all-reduces sit on the critical path: a layer cannot go on until its all-reduce
# is done (notebook 04). Over InfiniBand or Ethernet they cost the seconds per step
# printed above, many times what they cost over NVLink. Hence the rule: **tensor parallelism inside a node** (tp <= GPUs per
# node), data parallelism (one gradient all-reduce per step, overlapped with backward)
# and pipeline stages (point-to-point sends at stage boundaries) across nodes; notebook
# 05 builds such meshes. (Bandwidth is the upper bound: real collectives reach less, and
# NCCL's `all_reduce_perf` from nccl-tests measures what a cluster really gives.)
#
# ### The same notebooks at scale
#
# The notebooks themselves run on a cluster too: `nbpar.Pool(n, launcher="mpi" |
# "slurm" | "ssh")` starts the engines through ipyparallel's launchers
# (`nbpar/pool/launchers.py` checks first that the launcher can work on this machine),
# `Pool.connect(...)` attaches to engines a batch script started, and
# `docs/multinode.md` has an 8 nodes x 8 GPUs example for Slurm and SSH. Each engine then
# binds GPU `local_rank` of its host, exactly as `setup` above.
#
# ### A pool through Slurm
#
# Where a Slurm answers on this machine (`sinfo` works), the next cell starts a 2-engine
# pool through it: the engines are two tasks of one Slurm job, `sbatch` submits it,
# `srun` starts them, `pool.shutdown()` cancels it. Where none runs (a laptop, CI), it
# reads what the same cell recorded against a one-node Slurm on a 2-core machine
# (`notebooks/stored/slurm_pool.json`; `tests/slurm_cluster.py` starts such a Slurm).
# On a real cluster three things change: the partition, time and account your site
# asks for go in `slurm={...}` (checked, and then asked of Slurm with `sbatch
# --test-only`, before anything is queued); the job may wait in the queue, so give
# `start_timeout` room; and the engines run on other nodes, so the controller must
# listen where they reach it (`ip="0.0.0.0"`).

# %%
# NBVAL_IGNORE_OUTPUT
# (which of the two it was, and the seconds it took)
import time

STORED = os.path.join("stored", "slurm_pool.json")


def slurm_answers() -> bool:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0


if slurm_answers():
    t0 = time.perf_counter()
    on_slurm = nbpar.Pool(2, launcher="slurm", replace=False, slurm={"time": "10"})
    start_s = time.perf_counter() - t0
    job = next(s.job_id for s in on_slurm.cluster.engines.values() if s.job_id)
    got = on_slurm.execute(
        "import os, torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t)\n"
        "print(t.item(), os.environ['SLURM_JOB_ID'], os.environ['SLURM_PROCID'])"
    ).text().splitlines()
    script = on_slurm.cluster.config.SlurmEngineSetLauncher.batch_template
    hosts = sorted({r["host"] for r in on_slurm.status()})
    on_slurm.shutdown()
    pool.activate()  # %%dist runs on the notebook's own pool again
    for _ in range(100):  # cancelled: the job leaves squeue
        queued = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
        if not queued.stdout.strip():
            break
        time.sleep(0.2)
    slurm_run = {
        "date": time.strftime("%Y-%m-%d"),
        "start_s": round(start_s, 1),
        "lines": [" ".join(line.split()[2:3] + [str(line.split()[3] == job)]) for line in got],
        "tasks": sorted(line.split()[4] for line in got),
        "hosts": len(hosts),
        "script": [x for x in script.splitlines() if x.startswith("#SBATCH")],
        "gone_after_shutdown": not queued.stdout.strip(),
    }
    if os.environ.get("NBPAR_STORE_SLURM_RUN") == "1":  # who refreshes the stored run
        with open(STORED, "w") as f:
            json.dump(slurm_run, f, indent=1)
    print(f"live: a Slurm answered here; Pool(2) through it in {start_s:.1f} s")
else:
    with open(STORED) as f:
        slurm_run = json.load(f)
    print(f"no Slurm answers here: the run stored on {slurm_run['date']} "
          f"(Pool(2) through Slurm took {slurm_run['start_s']} s there)")

# %%
print("each rank: all_reduce of rank + 1, and whether it ran in the engines' job")
for rank, line in enumerate(slurm_run["lines"]):
    print(f"  rank {rank}: {line}")
print("Slurm task ids:", slurm_run["tasks"], "on", slurm_run["hosts"], "host(s)")
print("the engines' batch script:")
for line in slurm_run["script"]:
    print("  " + line)
print("job gone from squeue after shutdown:", slurm_run["gone_after_shutdown"])
assert slurm_run["lines"] == ["3.0 True", "3.0 True"] and slurm_run["tasks"] == ["0", "1"]
assert "#SBATCH --time=10" in slurm_run["script"] and slurm_run["gone_after_shutdown"]

# %% [markdown]
# **Takeaway:** the script is the notebook's recipe with torchrun providing rank and
# world; it ends with the same weights as `pool.train`, bit for bit. On a cluster,
# set NCCL's system variables in the job script, keep `NCCL_P2P_DISABLE` for debugging,
# and place tensor parallelism where NVLink is.

# %% [markdown]
# ## B. Monitoring: utilisation, memory, Prometheus, W&B, TensorBoard
#
# **Goal:** see what a run reports while it trains, check that its memory stays flat,
# and send the same numbers to the tools a cluster watches them with.
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
# ## C. Export for inference: from ZeRO-3 shards to one safetensors file
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
shutil.rmtree(workdir)  # the script, checkpoints, exports and W&B's files

# %% [markdown]
# **Takeaway.**
#
# - The DDP recipe the pool runs cell by cell is an ordinary torchrun script: rank and
#   world come from torchrun, and it ended with the same weights as `pool.train`, bit for
#   bit. On a cluster, NCCL's variables belong in the job script, `NCCL_P2P_DISABLE` is a
#   debugging switch, and tensor parallelism goes where NVLink is.
# - Monitoring is per rank and per step: the records above showed a clean run's memory
#   flat and a leaking run's rising, and the same records went to Prometheus, W&B
#   (offline) and TensorBoard. The loss they carry is the global batch's, the same on
#   every rank; what differs per rank is memory, time and communication.
# - A ZeRO-3 checkpoint became one safetensors file that a plain model loads without
#   DeepSpeed, giving the trained model's outputs exactly.
