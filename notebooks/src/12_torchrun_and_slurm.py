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
# # 12 · From notebook to cluster: torchrun, NCCL, Slurm
#
# **Time:** about 20 minutes ([the workshop day](../docs/workshop.md)).
#
# **Goal:** run the DDP recipe of notebook 01 outside the notebook, as `torchrun` runs it
# on a cluster node, and show that it trains exactly what `pool.train` trains; then what
# changes on a cluster: NCCL's variables, links inside and between nodes, and a pool
# started through Slurm.
#
# Monitoring a run and exporting its checkpoint for inference follow in
# [12b_monitoring_and_export](12b_monitoring_and_export.ipynb).

# %%
# %matplotlib inline
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import nbpar
import nbpar.train.checkpoint
import nbpar.view.plots
from nbpar.train import ddp_script

workdir = tempfile.mkdtemp(prefix="nbpar-12-")

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## The same recipe as a torchrun script
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
# ## NCCL's environment variables
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
# ## Inside a node vs between nodes
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
# printed above, many times what they cost over NVLink. Hence the rule: **tensor
# parallelism inside a node** (tp <= GPUs per node), data parallelism (one gradient
# all-reduce per step, overlapped with backward) and pipeline stages (point-to-point
# sends at stage boundaries) across nodes; notebook 05 builds such meshes. (Bandwidth is
# the upper bound: real collectives reach less, and NCCL's `all_reduce_perf` from
# nccl-tests measures what a cluster really gives.)
#
# ## The same notebooks at scale
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
STORED = os.path.join("stored", "slurm_pool.json")


def slurm_answers() -> bool:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0


if slurm_answers():
    t0 = time.perf_counter()
    on_slurm = nbpar.Pool(2, launcher="slurm", replace=False, slurm={"time": "10"})
    start_s = time.perf_counter() - t0
    job_id = next(s.job_id for s in on_slurm.cluster.engines.values() if s.job_id)
    got = on_slurm.execute(
        "import os, torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t)\n"
        "print(t.item(), os.environ['SLURM_JOB_ID'], os.environ['SLURM_PROCID'])"
    ).text().splitlines()
    batch_script = on_slurm.cluster.config.SlurmEngineSetLauncher.batch_template
    hosts = sorted({r["host"] for r in on_slurm.status()})
    on_slurm.shutdown()
    pool.activate()  # the notebook's own pool is the active one again
    for _ in range(100):  # cancelled: the job leaves squeue
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
        if not queued.stdout.strip():
            break
        time.sleep(0.2)
    slurm_run = {
        "date": time.strftime("%Y-%m-%d"),
        "start_s": round(start_s, 1),
        "lines": [" ".join(line.split()[2:3] + [str(line.split()[3] == job_id)]) for line in got],
        "tasks": sorted(line.split()[4] for line in got),
        "hosts": len(hosts),
        "script": [x for x in batch_script.splitlines() if x.startswith("#SBATCH")],
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

# %%
pool.shutdown()
shutil.rmtree(workdir)  # the script, its weights and the checkpoint

# %% [markdown]
# **Takeaway.**
#
# - The DDP recipe the pool runs cell by cell is an ordinary torchrun script: rank and
#   world come from torchrun, and it ended with the same weights as `pool.train`, bit for
#   bit.
# - On a cluster, NCCL's system variables belong in the job script; `NCCL_P2P_DISABLE` is
#   a debugging switch; tensor parallelism goes where NVLink is.
# - The notebooks' pools start through Slurm (or MPI, or SSH) as well: the engines are the
#   tasks of one job, and `pool.shutdown()` cancels it.
