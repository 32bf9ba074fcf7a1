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
# # 14b · Experts and zero-bubble pipelines
#
# **Time:** about 25 minutes ([the workshop day](../docs/workshop.md)).
#
# Two more ways large models are trained today. A **mixture of experts** replaces each
# block's feed-forward by E expert feed-forwards and a router that sends every token to
# k of them: E times the parameters for about k times the compute. **Expert
# parallelism** shares the experts out over `ep` data-parallel ranks; each token travels
# to the rank of its expert and back in an all-to-all (GShard, Lepikhin et al. 2020).
# **Zero-bubble pipeline schedules** split a stage's backward in two, the gradient of
# its input (I, which the previous stage waits for) and of its weights (W, which nobody
# waits for), and fill the pipeline's idle time with the W passes (Qi et al. 2023).
#
# **Goal:** train a mixture of experts with its experts shared out, equal to one
# process; see where the tokens went (the routing) and what that sent; and compare a
# zero-bubble schedule's timeline and bubble with 1F1B's.

# %%
# %matplotlib inline
import nbpar
import numpy as np
from matplotlib.figure import Figure
import nbpar.measure.timeline
from nbpar.estimate import format_bytes

# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## A mixture of experts, its experts on 2 ranks
#
# `tiny_moe` is TinyGPT with each feed-forward replaced by a top-k router over
# `moe.n_experts` experts and a load-balancing loss (Switch's `E Σ f_e P_e`, per
# sequence). With `strategy="ep"` on 2 engines every rank is a data-parallel rank and
# holds 2 of the 4 experts of each block (on 8 engines, `ep=4` would give each rank one
# and pair the ranks holding the same experts).

# %%
moe = nbpar.MoEConfig(n_experts=4, top_k=2)
common = dict(model="tiny_moe", moe=moe, micro_batch=2, grad_accum=2, steps=10, lr=3e-3,
              seed=0)
single = pool.train(nbpar.TrainConfig(strategy="single", **{**common, "micro_batch": 4})).wait()
experts = pool.train(nbpar.TrainConfig(strategy="ep", ep=2, **common)).wait()
a, b = single.result(), experts.result()
gap = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
print("single  :", [round(x, 2) for x in a["losses"][::3]])
print("ep 2    :", [round(x, 2) for x in b["losses"][::3]])
print("within 1e-5 at every step:", gap < 1e-5)
assert gap < 1e-5
last = [r for r in experts.history if r["step"] == common["steps"] - 1]
held, params = last[0]["expert_param_bytes"], last[0]["param_bytes"]
whole = single.history[-1]["param_bytes"]
print(f"parameters: {format_bytes(whole)} in one process, {format_bytes(params)} a rank, "
      f"of which experts {format_bytes(held)} (2 of the 4 of each block)")
assert all(r["expert_param_bytes"] == held for r in last) and whole - params == held

# %% [markdown]
# No token was dropped (the dispatch is *dropless*: each expert takes every token sent
# to it, however many), which is why the run equals one process exactly. Where did the
# tokens go? Each step record holds, per block, how many of this rank's tokens went to
# each expert:

# %%
routing = np.array([r["tokens_per_expert"]["0"] for r in b["ranks"]])  # block 0, all steps
fig = Figure(figsize=(6.5, 3.2), layout="constrained")
ax = fig.subplots()
im = ax.imshow(routing, cmap="viridis")
for (i, j), n in np.ndenumerate(routing):
    ax.text(j, i, str(n), ha="center", va="center", color="w", fontsize="small")
ax.set_xticks(range(moe.n_experts), [f"expert {e}\non rank {e // 2}" for e in range(moe.n_experts)],
              fontsize="small")
ax.set_yticks(range(len(routing)), [f"rank {r}'s tokens" for r in range(len(routing))])
ax.set_title("block 0: tokens sent to each expert over the run", fontsize="medium")
fig.colorbar(im, ax=ax, shrink=0.8)
fig

# %%
# NBVAL_IGNORE_OUTPUT
per_expert = routing.sum(axis=0)
print(f"tokens routed: {per_expert.sum()} = tokens x k "
      f"({per_expert.sum() // moe.top_k} x {moe.top_k})")
print(f"busiest expert / mean: {per_expert.max() / per_expert.mean():.2f}")
assert per_expert.sum() % moe.top_k == 0

# %% [markdown]
# The busiest expert's share over the mean is the **routing imbalance**: the rank that
# holds it computes more, and every other rank waits for it at the next all-to-all. The
# balance loss pushes it towards 1; capacity limits in other systems drop the overflow
# instead (and the run no longer equals one process).
#
# What the all-to-alls sent follows the routing: per MoE block and micro-batch a rank
# sends the rows of its tokens bound for other ranks' experts (the dispatch) and
# returns the rows others sent to its own expert (the combine); the backward sends both
# again; and each micro-batch first exchanges the counts. From the metered step's
# records:

# %%
# NBVAL_IGNORE_OUTPUT
steps = [r for r in experts.history if r.get("comm_metered")]
row = 32 * 4  # one token's hidden state: d_model 32, fp32
for rec in sorted(steps, key=lambda r: r["rank"]):
    me, theory = rec["rank"], 0
    mine = (2 * me, 2 * me + 1)  # the experts this rank holds
    for layer, counts in rec["tokens_per_expert"].items():
        sent = sum(c for e, c in enumerate(counts) if e not in mine)
        got = sum(r["tokens_per_expert"][layer][e] for r in steps if r["rank"] != me for e in mine)
        theory += 2 * (sent + got) * row + common["grad_accum"] * 2 * 8  # + the counts
    measured = rec["comm_bytes_by_op"]["all_to_all"]
    print(f"rank {me}: all-to-all {format_bytes(measured)}, from its routing "
          f"{format_bytes(theory)}")
    assert abs(measured / theory - 1) < 0.1
print("each rank's all-to-all bytes within 10% of what its routing sends: True")

# %% [markdown]
# ## A zero-bubble schedule next to 1F1B
#
# A TinyGPT of 4 blocks on a 2-stage pipeline, 8 micro-batches, once with 1F1B and
# once with ZB-V (`schedule="zbv"`: each rank holds two stages in a V, rank r stages r
# and 3-r, and every backward is split into I and W). The timelines are of a typical
# step (the one closest to the median of the normal steps):

# %%
# %%dist
from nbpar.config import GPTConfig, TrainConfig
from nbpar.train.loop import run_training

gpt = GPTConfig(n_layers=4, d_model=128, seq_len=64)  # boxes long enough to see
timelines = {}
for schedule in ("1f1b", "zbv"):
    cfg = TrainConfig(model="tiny_gpt", strategy="pipeline", schedule=schedule, gpt=gpt,
                      micro_batch=4, grad_accum=8, steps=7, seed=0)
    out = run_training(cfg, on_finish=lambda r: timelines.update(
        {schedule: (r.timeline(), r.bubble_fraction(), r.schedule_bubble_fraction(),
                    r.formula_bubbles())}))


# %%
def engine_timelines():
    return timelines  # runs on an engine, in its namespace


got = pool.run(engine_timelines)[0]
fig = Figure(figsize=(10, 4.5), layout="constrained")
for ax, (schedule, (events, *_)) in zip(fig.subplots(2, 1), got.items()):
    nbpar.measure.timeline.plot_timeline(events, ax=ax, p=2, m=8)
    ax.set_title(f"{schedule}: {ax.get_title()}", fontsize="medium")
fig

# %%
# NBVAL_IGNORE_OUTPUT
for schedule, (_, measured, forced, formulas) in got.items():
    print(f"{schedule:5s} bubble measured {measured:.2f}, forced by the schedule {forced:.2f}")
print("zbv's mean boxes (ms):", {k: round(v * 1e3, 2) for k, v in got["zbv"][3].items()
                                 if k in ("F", "I", "W")})

# %%
kinds = {s: {e["kind"] for e in events} for s, (events, *_) in got.items()}
print("1f1b boxes:", sorted(kinds["1f1b"]), "| zbv boxes:", sorted(kinds["zbv"]))
assert kinds["1f1b"] == {"F", "B"} and {"F", "I", "W"} <= kinds["zbv"]

# %% [markdown]
# 1F1B runs each micro-batch's whole backward (B) as one box; ZB-V runs its input part
# (I) as soon as the next stage sends the gradient, and keeps the weight part (W) for
# the gaps that 1F1B leaves idle. The replay of each step's own boxes with no time
# between them ("forced by the schedule") is the bubble the schedule itself leaves; the
# measured one adds the sends and the work between boxes, which at a few milliseconds a
# box weigh a lot on a laptop (the same reason notebook 03's bubbles sit above their
# formulas). By Qi et al.'s formulas, 1F1B idles `(p-1)(F+I+W)` per device and ZB-H1
# `(p-1)(F+I-W)` (both in each panel's title, from the step's mean boxes). Splitting the
# backward also doubles the passes and their hand-overs: where a box is short next to
# a send, as on a laptop, that can cost more than the bubble it fills (compare the two
# steps' lengths); it pays where boxes are long, large models on GPUs.

# %%
pool.shutdown()

# %% [markdown]
# ## At full size, on fake ranks: a Mixtral-8x7B-shaped model on ep 8
#
# Mixtral 8x7B's shape (32 blocks, hidden 4096, 8 experts of width 14336 each, 2 per
# token; transformers' Mixtral with random weights) holds 46.7B parameters, 45B of them
# in experts. The estimator says what expert parallelism over 8 data-parallel ranks
# leaves each rank in mixed precision; `nbpar.simulate` then runs one rank per pipeline
# stage of ep 8 x dp 8 x pp 4 (32 ranks) on fake tensors, 4 micro-batches of 4,096
# tokens with full activation checkpointing (without it, the first stage's 4 micro-batches
# in flight take it past 80 GB). Fake tensors have no routing,
# so the simulation sends every expert the same share of tokens
# (`nbpar.model.moe.uniform_routing`): the balance a real run's routing loss aims at.

# %%
from nbpar.estimate import estimate_memory

MIXTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768)
in_experts = 32 * 8 * 3 * 4096 * 14336  # gate, up and down of every expert
flat = estimate_memory(46.7e9, 8, "hybrid", dp=8, ep=8, expert_params=in_experts,
                       precision="mixed").per_rank_bytes
print(f"ep 8 x dp 8, no pipeline: {format_bytes(flat['total'])} of model states a rank "
      f"(estimate): more than an 80 GB device")
moe = nbpar.TrainConfig(model="hf:mixtral", model_config=MIXTRAL, strategy="hybrid",
                        dp=8, ep=8, pp=4, grad_accum=4, precision="bf16", micro_batch=1,
                        gpt=nbpar.GPTConfig(seq_len=4096), activation_checkpointing="full")
sim = nbpar.simulate(moe, world_size=32, device_memory_gb=80)
for r in sim["ranks"]:
    print(f"ranks {r['stands_for'][0]:2d}-{r['stands_for'][-1]:2d}: peak {format_bytes(r['peak_bytes'])}, "
          f"all-to-all {format_bytes(r['comm_bytes_by_op']['all_to_all'])} a step")
print(f"ep 8 x dp 8 x pp 4 fits 80 GB: {sim['fits']}")
assert flat["total"] > 80e9 and sim["fits"]

# %% [markdown]
# Expert parallelism divides the experts, not the rest: every rank still holds its
# stage's attention, norms and embeddings whole, and Adam's mixed-precision states (16
# bytes a parameter) of everything it holds. Stages divide both, which is how a 47B
# mixture fits 80 GB devices here; the all-to-alls grow with the tokens, not the
# parameters.

# %% [markdown]
# **Takeaway.**
#
# - Expert parallelism shares a mixture of experts' experts out over data-parallel
#   ranks; tokens travel to their expert and back in all-to-alls whose bytes follow the
#   routing, and a dropless dispatch trains exactly what one process trains.
# - The routing decides the load: the busiest expert's rank sets the pace.
# - Zero-bubble schedules split the backward into I and W and fill the bubble with W;
#   the timeline shows the three kinds of boxes.
