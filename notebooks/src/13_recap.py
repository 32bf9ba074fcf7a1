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
# # 13 · Recap: the blueprint, and which strategy when
#
# **Time:** about 20 minutes ([the workshop day](../docs/workshop.md)).
#
# **Goal:** put the tutorial back together. First the architecture end to end, from a
# notebook cell to the figure that comes back, drawn from the objects of one real run:
# which backend, how many ranks, which strategy module, what each rank held and sent.
# Then the six strategies of the earlier notebooks on one model in one pool, and a
# decision table whose rules rest on numbers measured here: what each strategy saves
# in memory and what it costs in bytes sent (the pipeline's idle share is the formula's;
# its measured bubble follows). Last, the same rules at 7.5B parameters on
# 64 devices, with the estimator, against the ZeRO paper.

# %%
# %matplotlib inline
import textwrap

import nbpar
import nbpar.parallel
from matplotlib.figure import Figure
from nbpar.comm_estimate import comm_bytes_per_step
from nbpar.estimate import GB, estimate_memory, format_bytes
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## 1 · The blueprint, from one run
#
# One short DDP run of the small GPT, and the process group as the engines themselves
# report it (`pool.run` calls a function on every rank):

# %%
base = dict(model="tiny_gpt", steps=8, lr=3e-3, seed=0)
run_ddp = pool.train(nbpar.TrainConfig(strategy="ddp", micro_batch=8, **base)).wait()


def process_group():
    import torch.distributed as dist

    return dist.get_backend(), dist.get_world_size(), dist.get_rank()


groups = pool.run(process_group)
print(groups)
assert [g[2] for g in groups] == list(range(pool.n)) and {g[1] for g in groups} == {pool.n}

# %% [markdown]
# Each box below is one layer of nbpar, labelled with what this run used. The top row
# runs in the notebook's kernel, the bottom row on every engine; the arrows are the one
# direction data flows (no layer calls back up).

# %%
res = run_ddp.result()
cfg = nbpar.TrainConfig.from_dict(res["config"])
rank0 = res["ranks"][0]
states0 = rank0["param_bytes"] + rank0["grad_bytes"] + rank0["optim_bytes"]
backend, world, _ = groups[0]
module = nbpar.parallel.strategy_module(cfg.strategy, cfg.backend)
dp = cfg.dims(world).dp
boxes = {
    "notebook cell": f"pool.train(TrainConfig(\n  strategy={cfg.strategy!r},\n"
                     f"  model={cfg.model!r}))",
    "Pool (kernel)": f"nbpar.Pool({pool.n})\nlauncher {pool.launcher!r}",
    "engines": f"{pool.n} ipyparallel engines\ndevices "
               + ", ".join(row["device"] for row in pool.status()),
    "process group": f"torch.distributed\nbackend {backend}, world size {world}",
    "strategy wraps the model": f"nbpar.parallel.{module}\n"
                                f"{cfg.strategy} on {cfg.backend}, dp {dp}",
    "training loop": f"{len(res['losses'])} steps, micro {cfg.micro_batch} x accum "
                     f"{cfg.grad_accum} x dp {dp}\n= {cfg.global_batch(world)} samples/step",
    "measurement": f"rank 0 states {format_bytes(states0)}\n"
                   f"peak {format_bytes(rank0['peak_bytes'])}, "
                   f"sent {format_bytes(rank0['comm_bytes'])}/step",
    "view (kernel)": "Run, Dashboard,\nnbpar.compare",
}
edges = {1: "ipyparallel", 2: "rendezvous", 6: "records\npublished"}  # after box i
assert (backend, world) == (pool.backend, pool.n) and cfg.global_batch(world) == 16


def draw_blueprint(boxes, edges):
    """Top row left to right, bottom row right to left; ``edges`` label the arrow after box i."""
    fig = Figure(figsize=(13, 4.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_xlim(0, 4)
    ax.set_ylim(0.2, 2.1)
    places = [(x + 0.5, 1.6) for x in range(4)] + [(3.5 - x, 0.6) for x in range(4)]
    kernel = {"notebook cell", "Pool (kernel)", "view (kernel)"}
    texts = [ax.text(x, y, f"{title}\n\n{text}", ha="center", va="center", fontsize=10,
                     bbox=dict(boxstyle="round,pad=0.5", ec="0.4",
                               fc="#dbe9f6" if title in kernel else "#fde8cf"))
             for (x, y), (title, text) in zip(places, boxes.items())]
    for i, (a, b) in enumerate(zip(texts, texts[1:])):
        # from edge to edge of the two boxes: right to left, or bottom to top
        (x0, y0), (x1, y1) = places[i], places[i + 1]
        out, into = {1: ((1, 0.5), (0, 0.5)), -1: ((0, 0.5), (1, 0.5)),
                     0: ((0.5, 0), (0.5, 1))}[(x1 > x0) - (x1 < x0)]
        ax.annotate("", xy=into, xycoords=b, xytext=out, textcoords=a,
                    arrowprops=dict(arrowstyle="-|>", color="0.3", shrinkA=8, shrinkB=8))
        if i in edges:
            dx, dy = (0.03, 0) if x0 == x1 else (0, 0.08)
            ax.text((x0 + x1) / 2 + dx, (y0 + y1) / 2 + dy, edges[i], fontsize=9, color="0.3",
                    ha="left" if x0 == x1 else "center", va="center")
    ax.set_title("nbpar end to end (blue: the notebook's kernel, orange: every engine)",
                 fontsize=11)
    return fig


draw_blueprint(boxes, edges)

# %% [markdown]
# ## 2 · Which strategy when, measured
#
# The same model, seed and global batch of 16 samples per step under all six
# strategies on this pool: data parallel (DDP), ZeRO-1/2/3 (PyTorch's
# `ZeroRedundancyOptimizer` and FSDP2), tensor parallel (each rank sees the whole
# 16-sample batch), and a 2-stage pipeline (4 micro-batches of 4, 1F1B). Same
# training, so the same losses:

# %%
shapes = {"zero1": (8, 1), "zero2": (8, 1), "zero3": (8, 1), "tp": (16, 1), "pipeline": (4, 4)}
runs = {"ddp": run_ddp}
for name, (micro, accum) in shapes.items():
    cfg_s = nbpar.TrainConfig(strategy=name, micro_batch=micro, grad_accum=accum, **base)
    runs[name] = pool.train(cfg_s).wait()
for name, run in runs.items():
    batch = nbpar.TrainConfig.from_dict(run.result()["config"]).global_batch(pool.n)
    print(f"{name:8s} global batch {batch}, losses {[round(x, 2) for x in run.result()['losses']]}")
for run in runs.values():  # fp32: equal up to the order of float additions
    assert max(abs(a - b) for a, b in zip(run.result()["losses"], res["losses"])) < 1e-5

# %% [markdown]
# `nbpar.compare` summarises the runs; `Comparison.relative("ddp")` puts each next to
# DDP: the model states (parameters + gradients + optimizer states) of the rank that
# holds the most, and the bytes it sent in one step, counted at the c10d layer. Both are
# exact byte counts, so the rules below are computed from them, not typed in:

# %%
comparison = nbpar.compare(list(runs.values()), labels=list(runs))
rel = {row["label"]: row for row in comparison.relative("ddp")}
s = {k: r["states_share"] for k, r in rel.items()}
c = {k: r["comm_ratio"] for k, r in rel.items()}
m, p = shapes["pipeline"][1], pool.n  # the pipeline: micro-batches per step, stages
when = {
    "ddp": "the model states fit on every device: nothing to gather, no more bytes than any "
    "data-parallel alternative (FSDP2's ZeRO-2 sends the same), overlapped with backward",
    "zero1": f"the optimizer states do not fit: {s['zero1']:.0%} of DDP's states for "
    f"{c['zero1']:.1f}x its bytes (torch all-reduces, then broadcasts the updated shards)",
    "zero2": f"the gradients do not fit either: {s['zero2']:.0%} of DDP's states for "
    f"{c['zero2']:.1f}x its bytes (FSDP2 also reshards the parameters after backward)",
    "zero3": f"the parameters do not fit either: {s['zero3']:.0%} of DDP's states between "
    f"steps, as FSDP2's ZeRO-2, but it also frees the gathered parameters between forward and "
    f"backward (a lower peak during the step, below), for {c['zero3']:.1f}x DDP's bytes",
    "tp": f"one layer is too big, and the ranks share fast links (one node): {s['tp']:.0%} "
    f"of DDP's states for {c['tp']:.1f}x its bytes, activations that grow with batch x sequence",
    "pipeline": f"the model is too deep and the links are slow (across nodes): "
    f"{s['pipeline']:.0%} of DDP's states (the larger stage) for {c['pipeline']:.2f}x its "
    f"bytes, but idle (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.0%} of the step",
}
print(f"{'strategy':9s}{'states/rank':>12s}{'vs DDP':>8s}{'sent/step':>11s}{'vs DDP':>8s}")
for name, row in rel.items():
    print(f"{name:9s}{format_bytes(row['states_bytes']):>12s}{row['states_share']:>8.0%}"
          f"{format_bytes(row['comm_bytes']):>11s}{row['comm_ratio']:>7.2f}x")
    print(textwrap.fill(when[name], 88, initial_indent="  choose it when ",
                        subsequent_indent="    "))

# %% [markdown]
# The rules hold as exact statements about these runs, and the data-parallel shares are
# the estimator's (`nbpar.estimate_memory`, with PyTorch's implementation) to within the
# uneven split of the optimizer state:

# %%
n_params = rank0["param_bytes"] // 4
psi = rank0["param_bytes"]  # fp32 bytes of the whole model, which DDP holds on every rank
for name in ("zero1", "zero2", "zero3"):
    est = estimate_memory(n_params, pool.n, name, backend="torch").per_rank_bytes["total"]
    est_ddp = estimate_memory(n_params, pool.n, "ddp", backend="torch").per_rank_bytes["total"]
    assert abs(s[name] - est / est_ddp) < 0.01, name
    theory = comm_bytes_per_step(name, param_bytes=psi, dp=pool.n, backend="torch")
    assert abs(c[name] - theory / comm_bytes_per_step("ddp", param_bytes=psi, dp=pool.n)) < 0.01
assert s["zero3"] <= s["zero2"] < s["zero1"] < 1 and c["zero3"] > c["zero2"]
assert s["tp"] < 1 < c["tp"] and s["pipeline"] < 1 and c["pipeline"] < 1
print(f"ZeRO-3 holds {s['zero3']:.0%} of DDP's model states at {c['zero3']:.1f}x the bytes; "
      f"the pipeline sends {c['pipeline']:.2f}x DDP's bytes, tensor parallelism {c['tp']:.1f}x")

# %% [markdown]
# The timings are the other half of the decision: the peak of live tensors during a
# step (activations included), a normal step's time (the median of the steps after the
# two with one-off set-up, the metered one left out) and the share of it each rank spent
# blocked on communication no compute hid, a slower rank included (for the pipeline, its
# bubble too: a stage waiting for its activations is blocked). On a shared CPU they
# change from run to run, so this cell is not checked, and it prints whether this
# machine's timings could be trusted; on a model this small, activations and latency
# dominate, and the figures say little about a large model (section 3 does).

# %%
# NBVAL_IGNORE_OUTPUT
for name, row in rel.items():
    out = runs[name].result()
    print(f"{name:9s} peak {format_bytes(row['peak_bytes']):>9s} ({row['peak_share']:4.0%} of "
          f"DDP's), step {out['step_time_s'] * 1e3:5.1f} ms, blocked on communication "
          f"{out['comm_blocked_fraction']:4.0%} of it")
print(runs["ddp"].result()["timing_note"])
print(f"pipeline bubble measured {runs['pipeline'].result()['bubble_fraction']:.0%} "
      f"(schedule alone {runs['pipeline'].result()['schedule_bubble_fraction']:.0%})")
comparison

# %% [markdown]
# ## 3 · What changes at scale
#
# At two ranks ZeRO-3 halves the states; over `N` ranks it divides them by `N`, while its
# bytes per step stay 1.5x DDP's whatever `N`. The ZeRO paper (Rajbhandari et al. 2020,
# Fig. 1) takes a 7.5B-parameter model on 64 devices with mixed-precision Adam (16 bytes
# a parameter): 120 GB per device under DDP, 31.4 with optimizer states sharded, 16.6
# with gradients too, 1.9 with parameters too. Below, the estimator's memory is the
# paper's, and beside it what each device sends per step (16-bit gradients) twice: by
# the paper's algorithm (2 Psi, ZeRO-3 3 Psi), and by PyTorch's implementations, as
# measured above (its ZeRO-1 all-reduces and broadcasts, 3 Psi). Notebook 10 simulates
# PyTorch's own implementations' memory at this size, where `ZeroRedundancyOptimizer`
# holds more than P_os.

# %%
big, devices = 7.5e9, 64
ddp_sent = comm_bytes_per_step("ddp", param_bytes=2 * big, dp=devices)
scale = {}
ring = (devices - 1) / devices * 2 * big  # one pass of the 16-bit parameters, ring
print("memory: the paper's; last two columns: bytes sent per step, the paper's algorithm, "
      "then torch's")
for name in ("ddp", "zero1", "zero2", "zero3"):
    states = estimate_memory(big, devices, name, precision="mixed").per_rank_bytes["total"]
    paper = (3 if name == "zero3" else 2) * ring
    sent = comm_bytes_per_step(name, param_bytes=2 * big, dp=devices, backend="torch")
    scale[name] = states
    print(f"{name:6s} {states / GB:6.1f} GB per device ({states / scale['ddp']:5.1%} of DDP), "
          f"fits 80 GB: {states < 80 * GB!s:5s}  {paper / GB:5.1f} GB ({paper / ddp_sent:.1f}x)"
          f"  {sent / GB:5.1f} GB ({sent / ddp_sent:.1f}x)")
for name in ("tp", "pipeline"):
    states = estimate_memory(big, 8, name, precision="mixed").per_rank_bytes["total"]
    print(f"{name:8s} over 8 devices: {states / GB:5.1f} GB per device")
assert [round(scale[k] / GB, 1) for k in scale] == [120.0, 31.4, 16.6, 1.9]  # the paper's Fig. 1

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - One run crosses every layer: a cell in the kernel, the pool, the engines in one
#   process group, a strategy module around the model, the training loop, and the
#   measurements that come back to the view; the figure above named what each layer was.
# - Every strategy trained the same model to the same losses; what differs is where the
#   bytes live and how many move. The table's rules are those measured ratios.
# - DDP while the states fit; ZeRO-1, -2, -3 as first the optimizer states, then the
#   gradients, then the parameters do not. The table shows the price of each: FSDP2's
#   ZeRO-2 already held ZeRO-3's share between steps and sent what DDP sent; ZeRO-3's
#   saving is the lower peak during the step, for 1.5x DDP's bytes.
# - Tensor parallelism trades memory for activation traffic in every block (keep it
#   inside a node); the pipeline sent the fewest bytes but idles in its bubble.
# - At 7.5B on 64 devices only the sharded stages fit 80 GB; the byte ratios are those
#   measured at two ranks, while ZeRO-3's share of DDP's states shrinks as 1/N.
